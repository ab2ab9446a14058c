//! CUDA C for the steps of a plan that are not matrix products. Shapes are written
//! into each kernel as constants, so a kernel does only its own index arithmetic;
//! every kernel of a program goes into one source, compiled once by NVRTC (and cached
//! on disk by the source's hash).
//!
//! This module writes elementwise ops with broadcasting, casts, reductions and data
//! movement (permute, expand, slice, concat); [`index`] the ops that pick, scan or
//! rank elements; [`window`] convolutions and pooling; [`attention`] attention over a
//! KV cache; [`flash`] attention over whole sequences ([`flash_mma`] on tensor
//! cores); [`rows`] norms and softmax;
//! [`rope`] rotary embeddings; [`quant`] the GGUF block formats.
//!
//! Each kernel takes its output pointer first, then one pointer per operand, and,
//! when it checks its operands at run time (an index in range, a cache position), a
//! last pointer to two error words where the first failing thread leaves its code
//! and the value that failed. Most walk their
//! output elements with a grid-stride loop over 64-bit indices ([`Grid::Elements`]).

mod attention;
mod flash;
mod flash_mma;
pub(crate) mod fused;
pub(crate) mod gemv;
pub(crate) mod gemv_group;
mod index;
mod quant;
mod rope;
pub(crate) mod rope_write;
mod rows;
mod window;

#[cfg(test)]
mod syntax_check;

use rlx_ir::{BinaryOp, DType, Error, Op, ReduceOp, Result, Shape, UnaryOp};
use std::fmt::Write;

/// The name kernels are generated under, replaced by each distinct kernel's own.
pub(crate) const STEP_NAME: &str = "rlx_step";

/// Helpers every program's source starts with: half and bfloat16 conversions written
/// as PTX, so the source needs no CUDA headers.
pub(crate) const PRELUDE: &str = r#"
__device__ __forceinline__ float h2f(unsigned short h) { float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h)); return f; }
__device__ __forceinline__ unsigned short f2h(float f) { unsigned short h; asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ float bf2f(unsigned short h) { return __uint_as_float(((unsigned int)h) << 16); }
__device__ __forceinline__ unsigned short f2bf(float f) { unsigned short h; asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f)); return h; }
__device__ __forceinline__ long long ipow(long long b, long long e) {
  if (e < 0) return b == 1 ? 1 : (b == -1 ? ((e & 1) ? -1 : 1) : 0);
  unsigned long long r = 1, x = (unsigned long long)b;
  while (e > 0) { if (e & 1) r *= x; x *= x; e >>= 1; }
  return (long long)r;
}
// random_uniform: the hash of rlx_ir::scalar (random_stream, random_uniform).
__device__ __forceinline__ unsigned int rlx_mix32(unsigned int x) {
  x ^= x >> 16; x *= 0x7FEB352Du; x ^= x >> 15; x *= 0x846CA68Bu; return x ^ (x >> 16);
}
__device__ __forceinline__ unsigned int rlx_stream(unsigned long long seed, long long key) {
  unsigned long long k = (unsigned long long)key;
  return rlx_mix32(rlx_mix32((unsigned int)seed ^ rlx_mix32((unsigned int)(seed >> 32)))
                   ^ rlx_mix32((unsigned int)k ^ rlx_mix32((unsigned int)(k >> 32))));
}
__device__ __forceinline__ double rlx_uniform(unsigned int stream, unsigned long long i) {
  unsigned int h = rlx_mix32(((unsigned int)i) * 0x9E3779B9u ^ stream ^ rlx_mix32((unsigned int)(i >> 32)));
  return (double)(h >> 8) / 16777216.0;
}
#define RLX_LOOP(n) for (long long i = (long long)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (long long)gridDim.x * blockDim.x)
#define RLX_INF __int_as_float(0x7f800000)
#define RLX_WARP_LOOP(n) for (long long w = ((long long)blockIdx.x * blockDim.x + threadIdx.x) >> 5; w < (n); w += ((long long)gridDim.x * blockDim.x) >> 5)
// The first failing check leaves its code in err[0] and the offending value in err[1].
__device__ __forceinline__ void rlx_fail(long long* err, int code, long long value) {
  if (atomicCAS((unsigned long long*)err, 0ULL, (unsigned long long)code) == 0ULL) err[1] = value;
}
__device__ __forceinline__ float warp_sum(float v) { for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o); return v; }
__device__ __forceinline__ double warp_sum(double v) { for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o); return v; }
__device__ __forceinline__ float warp_max(float v) { for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o)); return v; }
__device__ __forceinline__ double warp_max(double v) { for (int o = 16; o > 0; o >>= 1) v = fmax(v, __shfl_xor_sync(0xffffffffu, v, o)); return v; }
// Block-wide sum and maximum through `red` (32 slots of shared memory); every
// thread of the block calls them and gets the result.
template <typename T> __device__ T block_sum(T v, T* red) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = warp_sum(v); if (lane == 0) red[warp] = v; __syncthreads();
  if (warp == 0) { v = lane < warps ? red[lane] : (T)0; v = warp_sum(v); if (lane == 0) red[0] = v; }
  __syncthreads(); T r = red[0]; __syncthreads(); return r;
}
template <typename T> __device__ T block_max(T v, T* red) {
  int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = (blockDim.x + 31) >> 5;
  v = warp_max(v); if (lane == 0) red[warp] = v; __syncthreads();
  if (warp == 0) { v = lane < warps ? red[lane] : (T)-RLX_INF; v = warp_max(v); if (lane == 0) red[0] = v; }
  __syncthreads(); T r = red[0]; __syncthreads(); return r;
}
__device__ __forceinline__ float half_at(const unsigned char* b, int at) { return h2f((unsigned short)(b[at] | (b[at + 1] << 8))); }
// Sixteen zero bytes.
__device__ __forceinline__ uint4 rlx_zero4() { uint4 z; z.x = 0u; z.y = 0u; z.z = 0u; z.w = 0u; return z; }
// Two floats as an f16 pair, the first in the low half (an mma operand register).
__device__ __forceinline__ unsigned int rlx_pack(float lo, float hi) { return (unsigned int)f2h(lo) | ((unsigned int)f2h(hi) << 16); }
// Programmatic dependent launch (compute capability 9.0+): every kernel first waits
// until the kernel before it has finished and its writes are visible, then lets the
// next kernel's blocks be scheduled, so a launch overlaps its predecessor's tail
// instead of following it. Without such a launch both are no-ops.
// Asks L2 for the 128-byte line holding `p` (a hint: nothing waits for it).
__device__ __forceinline__ void rlx_prefetch_l2(const void* p) { asm("prefetch.global.L2 [%0];" :: "l"(p)); }
// (Scheduling the next kernel only when this one's blocks exit measured the same
// on a Llama decode step: 718 and 729 tokens/s against 724 and 700.)
#if __CUDA_ARCH__ >= 900
#define RLX_ENTER() do { asm volatile("griddepcontrol.wait;" ::: "memory"); asm volatile("griddepcontrol.launch_dependents;" ::: "memory"); } while (0)
#else
#define RLX_ENTER() do { } while (0)
#endif
#if __CUDA_ARCH__ >= 800
// c += a b on tensor cores: a 16x16 f16 tile (4 registers), b 16x8 (2), c 16x8 f32.
__device__ __forceinline__ void rlx_mma(float* c, const unsigned int* a, unsigned int b0, unsigned int b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3]) : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Four 8x8 f16 matrices from shared memory, transposed: lane l gives the address of
// row l % 8 of matrix l / 8; register m holds this lane's pair of matrix m (as the
// B operand of `rlx_mma` when the rows are keys).
__device__ __forceinline__ void rlx_ldmatrix_t4(unsigned int* r, const unsigned short* row) {
  unsigned int a; asm("{ .reg .u64 g; cvta.to.shared.u64 g, %1; cvt.u32.u64 %0, g; }" : "=r"(a) : "l"(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];" : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
}
#endif
"#;

/// `source` (one kernel) with `RLX_ENTER()` as the first statement of its body, so
/// it touches no memory before the kernel ahead of it has finished (see the
/// prelude); launched with a programmatic dependency, it is scheduled early.
pub(crate) fn entering_after_predecessor(source: &str) -> String {
    if source.contains("RLX_ENTER") {
        // The kernel enters itself (after prefetching what no kernel writes).
        return source.to_string();
    }
    let body = source
        .find("__global__")
        .and_then(|g| source[g..].find('{').map(|b| g + b + 1));
    match body {
        Some(at) => format!("{}\n  RLX_ENTER();{}", &source[..at], &source[at..]),
        None => source.to_string(),
    }
}

/// How a dtype is stored and computed in generated code.
struct CType {
    storage: &'static str,
    compute: &'static str,
}

fn ctype(dt: DType) -> CType {
    let (storage, compute) = match dt {
        DType::F32 => ("float", "float"),
        DType::F64 => ("double", "double"),
        DType::F16 | DType::BF16 => ("unsigned short", "float"),
        DType::I8 => ("signed char", "long long"),
        DType::I16 => ("short", "long long"),
        DType::I32 => ("int", "long long"),
        DType::I64 => ("long long", "long long"),
        DType::U8 | DType::Bool => ("unsigned char", "long long"),
        DType::U16 => ("unsigned short", "long long"),
        DType::U32 => ("unsigned int", "long long"),
        DType::U64 => ("unsigned long long", "long long"),
    };
    CType { storage, compute }
}

/// The expression reading element `idx` of pointer `p` of `dt` in its compute type.
fn load(dt: DType, p: &str, idx: &str) -> String {
    match dt {
        DType::F16 => format!("h2f({p}[{idx}])"),
        DType::BF16 => format!("bf2f({p}[{idx}])"),
        DType::F32 | DType::F64 => format!("{p}[{idx}]"),
        _ => format!("((long long){p}[{idx}])"),
    }
}

/// The expression turning compute value `v` into `dt`'s storage.
fn store(dt: DType, v: &str) -> String {
    match dt {
        DType::F16 => format!("f2h({v})"),
        DType::BF16 => format!("f2bf({v})"),
        DType::Bool => format!("(unsigned char)(({v}) != 0)"),
        _ => format!("({})({v})", ctype(dt).storage),
    }
}

fn is_float(dt: DType) -> bool {
    dt.is_float()
}

/// A math function's name for the compute type (`expf` for float, `exp` for double).
fn f(name: &str, dt: DType) -> String {
    if dt == DType::F64 {
        name.to_string()
    } else {
        format!("{name}f")
    }
}

fn unsupported(what: String) -> Error {
    Error::Unsupported {
        device: "cuda".into(),
        what,
    }
}

fn unary_expr(op: UnaryOp, dt: DType, x: &str) -> Result<String> {
    if is_float(dt) {
        let c = ctype(dt).compute;
        Ok(match op {
            UnaryOp::Neg => format!("(-{x})"),
            UnaryOp::Abs => format!("{}({x})", f("fabs", dt)),
            UnaryOp::Exp => format!("{}({x})", f("exp", dt)),
            UnaryOp::Log => format!("{}({x})", f("log", dt)),
            UnaryOp::Sqrt => format!("{}({x})", f("sqrt", dt)),
            UnaryOp::Rsqrt => format!("{}({x})", f("rsqrt", dt)),
            UnaryOp::Reciprocal => format!("(({c})1 / {x})"),
            UnaryOp::Tanh => format!("{}({x})", f("tanh", dt)),
            UnaryOp::Sigmoid => format!("(({c})1 / (({c})1 + {}(-{x})))", f("exp", dt)),
            UnaryOp::Relu => format!("(({x}) > 0 || ({x}) != ({x}) ? ({x}) : ({c})0)"),
            UnaryOp::Gelu => format!(
                "(({c})0.5 * {x} * (({c})1 + {}({x} * ({c})0.70710678118654752440)))",
                f("erf", dt)
            ),
            UnaryOp::GeluTanh => format!(
                "(({c})0.5 * {x} * (({c})1 + {}(({c})0.79788456080286535588 * ({x} + ({c})0.044715 * {x} * {x} * {x}))))",
                f("tanh", dt)
            ),
            UnaryOp::Silu => format!("({x} / (({c})1 + {}(-{x})))", f("exp", dt)),
            // NaN passes through (fmin/fmax would drop it).
            UnaryOp::Relu6 => format!(
                "(({x}) != ({x}) ? ({x}) : (({x}) < 0 ? ({c})0 : (({x}) > 6 ? ({c})6 : ({x}))))"
            ),
            UnaryOp::HardSwish => format!(
                "(({x}) != ({x}) ? ({x}) : ({x}) * (({x}) < -3 ? ({c})0 : (({x}) > 3 ? ({c})6 : ({x}) + ({c})3)) / ({c})6)"
            ),
            UnaryOp::Erf => format!("{}({x})", f("erf", dt)),
            UnaryOp::Sin => format!("{}({x})", f("sin", dt)),
            UnaryOp::Cos => format!("{}({x})", f("cos", dt)),
            UnaryOp::Floor => format!("{}({x})", f("floor", dt)),
            UnaryOp::Ceil => format!("{}({x})", f("ceil", dt)),
            UnaryOp::Round => format!("{}({x})", f("rint", dt)),
            UnaryOp::Atan => format!("{}({x})", f("atan", dt)),
            UnaryOp::Sign => {
                format!("(({x}) > 0 ? ({c})1 : (({x}) < 0 ? ({c})-1 : ({x})))")
            }
            UnaryOp::Not => format!("(({c})(({x}) == 0))"),
            UnaryOp::BitNot => return Err(unsupported(format!("bitwise not of {dt:?}"))),
        })
    } else {
        Ok(match op {
            UnaryOp::Neg => format!("((long long)(0ULL - (unsigned long long){x}))"),
            UnaryOp::Abs => {
                format!("(({x}) < 0 ? (long long)(0ULL - (unsigned long long){x}) : ({x}))")
            }
            UnaryOp::Relu => format!("(({x}) > 0 ? ({x}) : 0LL)"),
            UnaryOp::Sign => format!("(({x}) > 0 ? 1LL : (({x}) < 0 ? -1LL : 0LL))"),
            UnaryOp::Not => format!("((long long)(({x}) == 0))"),
            UnaryOp::BitNot => format!("(~({x}))"),
            other => {
                return Err(unsupported(format!(
                    "{} of an integer tensor",
                    other.name()
                )));
            }
        })
    }
}

fn binary_expr(op: BinaryOp, dt: DType, a: &str, b: &str) -> Result<String> {
    let c = ctype(dt).compute;
    let cmp = |o: &str| format!("(({c})(({a}) {o} ({b})))");
    let logic = |o: &str| format!("(({c})((({a}) != 0) {o} (({b}) != 0)))");
    if is_float(dt) {
        Ok(match op {
            BinaryOp::Add => format!("({a} + {b})"),
            BinaryOp::Sub => format!("({a} - {b})"),
            BinaryOp::Mul => format!("({a} * {b})"),
            BinaryOp::Div => format!("({a} / {b})"),
            BinaryOp::Pow => format!("{}({a}, {b})", f("pow", dt)),
            BinaryOp::Max => format!(
                "(({a}) != ({a}) || ({b}) != ({b}) ? ({a}) + ({b}) : {}({a}, {b}))",
                f("fmax", dt)
            ),
            BinaryOp::Min => format!(
                "(({a}) != ({a}) || ({b}) != ({b}) ? ({a}) + ({b}) : {}({a}, {b}))",
                f("fmin", dt)
            ),
            BinaryOp::Mod => {
                let r = format!("{}({a}, {b})", f("fmod", dt));
                format!("({r} != 0 && (({r} < 0) != (({b}) < 0)) ? {r} + ({b}) : {r})")
            }
            BinaryOp::Eq => cmp("=="),
            BinaryOp::Ne => cmp("!="),
            BinaryOp::Lt => cmp("<"),
            BinaryOp::Le => cmp("<="),
            BinaryOp::Gt => cmp(">"),
            BinaryOp::Ge => cmp(">="),
            BinaryOp::And => logic("&&"),
            BinaryOp::Or => logic("||"),
            BinaryOp::Xor => logic("!="),
            other => return Err(unsupported(format!("{} of {dt:?}", other.name()))),
        })
    } else {
        let u = |o: &str| {
            format!("((long long)((unsigned long long)({a}) {o} (unsigned long long)({b})))")
        };
        Ok(match op {
            BinaryOp::Add => u("+"),
            BinaryOp::Sub => u("-"),
            BinaryOp::Mul => u("*"),
            BinaryOp::Div => format!(
                "(({b}) == 0 ? 0LL : ((({b}) == -1) ? (long long)(0ULL - (unsigned long long)({a})) : ({a}) / ({b})))"
            ),
            BinaryOp::Pow => format!("ipow({a}, {b})"),
            BinaryOp::Max => format!("(({a}) > ({b}) ? ({a}) : ({b}))"),
            BinaryOp::Min => format!("(({a}) < ({b}) ? ({a}) : ({b}))"),
            BinaryOp::Mod => format!(
                "(({b}) == 0 || ({b}) == -1 ? 0LL : ((({a}) % ({b})) != 0 && (((({a}) % ({b})) < 0) != (({b}) < 0)) ? (({a}) % ({b})) + ({b}) : (({a}) % ({b}))))"
            ),
            BinaryOp::Eq => cmp("=="),
            BinaryOp::Ne => cmp("!="),
            BinaryOp::Lt => cmp("<"),
            BinaryOp::Le => cmp("<="),
            BinaryOp::Gt => cmp(">"),
            BinaryOp::Ge => cmp(">="),
            BinaryOp::And => logic("&&"),
            BinaryOp::Or => logic("||"),
            BinaryOp::Xor => logic("!="),
            BinaryOp::BitAnd => format!("(({a}) & ({b}))"),
            BinaryOp::BitOr => format!("(({a}) | ({b}))"),
            BinaryOp::BitXor => format!("(({a}) ^ ({b}))"),
            BinaryOp::ShiftLeft => format!(
                "(({b}) < 0 || ({b}) >= 64 ? 0LL : (long long)((unsigned long long)({a}) << ({b})))"
            ),
            BinaryOp::ShiftRight => format!(
                "(({b}) < 0 || ({b}) >= 64 ? 0LL : (long long)((unsigned long long)({a}) >> ({b})))"
            ),
        })
    }
}

/// Row-major strides of `dims`.
fn strides(dims: &[usize]) -> Vec<i64> {
    let mut s = vec![0i64; dims.len()];
    let mut acc = 1i64;
    for k in (0..dims.len()).rev() {
        s[k] = acc;
        acc *= dims[k] as i64;
    }
    s
}

/// Strides of an operand of dims `src` broadcast against output dims `out`
/// (right-aligned; a dim of 1 reads the same element).
fn broadcast_strides(src: &[usize], out: &[usize]) -> Vec<i64> {
    let own = strides(src);
    let lead = out.len() - src.len();
    (0..out.len())
        .map(|k| {
            if k < lead || src[k - lead] == 1 {
                0
            } else {
                own[k - lead]
            }
        })
        .collect()
}

/// Code that sets `long long {name}` to the offset of output element `i` in an
/// operand read with `strides` over output `dims` (just `i` when contiguous).
fn offset_code(out: &mut String, name: &str, dims: &[usize], strides_: &[i64]) {
    if strides_ == strides(dims).as_slice() {
        let _ = writeln!(out, "    long long {name} = i;");
        return;
    }
    let _ = writeln!(out, "    long long {name} = 0; {{ long long r = i;");
    for k in (0..dims.len()).rev() {
        if dims[k] == 1 {
            continue;
        }
        let _ = writeln!(
            out,
            "      {{ long long c = r % {d}; r /= {d}; {name} += c * ({s}LL); }}",
            d = dims[k],
            s = strides_[k]
        );
    }
    let _ = writeln!(out, "    }}");
}

/// How a kernel is launched.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Grid {
    /// A grid-stride loop over this many items (`RLX_LOOP`), 256 threads a block.
    Elements(usize),
    /// A warp-stride loop over this many items (`RLX_WARP_LOOP`), 256 threads a block.
    Warps(usize),
    /// Exactly `count` blocks of `threads` threads.
    Blocks { count: usize, threads: u32 },
}

impl Grid {
    /// Whether the launch has no work (the step is skipped).
    pub fn is_empty(self) -> bool {
        match self {
            Grid::Elements(n) | Grid::Warps(n) => n == 0,
            Grid::Blocks { count, .. } => count == 0,
        }
    }
}

/// One step's kernel: the source of `extern "C" __global__ void {name}(...)`, how to
/// launch it, and, when it checks its operands at run time, what a failure means.
pub(crate) struct Kernel {
    pub source: String,
    pub grid: Grid,
    /// The error reported when the kernel sets the error words, `{value}` standing
    /// for the value that failed (`None`: it takes no error words).
    pub check: Option<String>,
}

/// A grid-stride kernel over `n` items without run-time checks.
fn elements(source: String, n: usize) -> Kernel {
    Kernel {
        source,
        grid: Grid::Elements(n),
        check: None,
    }
}

/// The opening of a kernel: output pointer, one `const` pointer per operand, and the
/// error word when `checked`.
fn header_with(name: &str, out_dt: DType, inputs: &[DType], checked: bool) -> String {
    let mut s = format!(
        "extern \"C\" __global__ void {name}({}* __restrict__ out",
        ctype(out_dt).storage
    );
    for (k, dt) in inputs.iter().enumerate() {
        let _ = write!(s, ", const {}* __restrict__ in{k}", ctype(*dt).storage);
    }
    if checked {
        s.push_str(", long long* __restrict__ err");
    }
    s.push_str(") {\n");
    s
}

fn header(name: &str, out_dt: DType, inputs: &[DType]) -> String {
    header_with(name, out_dt, inputs, false)
}

/// Declares `long long {p}{k}` for every axis `k`: the coordinates of linear index
/// `var` over `dims` (an empty tensor runs no thread, so a zero dim is written as 1).
fn unravel_code(s: &mut String, var: &str, dims: &[usize], p: &str) {
    let _ = writeln!(s, "    long long {p}_r = {var};");
    for (k, d) in dims.iter().enumerate().rev() {
        let d = (*d).max(1);
        let _ = writeln!(s, "    long long {p}{k} = {p}_r % {d}LL; {p}_r /= {d}LL;");
    }
}

/// A literal of value `v` in `dt`'s compute type (bit-exact for floats, NaN and
/// infinities included; integers rounded as the reference rounds them).
fn literal(v: f64, dt: DType) -> String {
    if dt.is_float() {
        let d = format!("__longlong_as_double({}LL)", v.to_bits() as i64);
        if dt == DType::F64 {
            d
        } else {
            format!("((float){d})")
        }
    } else {
        format!("{}LL", dt.round_value(v) as i64)
    }
}

/// The kernel for `op` with operand shapes `inputs` and output `output`, or `None`
/// when the op is not one this generator writes.
///
/// A kernel that checks its operands at run time leaves `fail_code` in the error
/// word when a check fails.
pub(crate) fn kernel(
    name: &str,
    op: &Op,
    inputs: &[Shape],
    output: &Shape,
    fail_code: i32,
) -> Result<Option<Kernel>> {
    kernel_for(name, op, inputs, output, fail_code, false)
}

/// [`kernel`] for a GPU that has `mma.m16n8k16` tensor-core instructions (compute
/// capability 8.0 and later) when `tensor_cores`.
pub(crate) fn kernel_for(
    name: &str,
    op: &Op,
    inputs: &[Shape],
    output: &Shape,
    fail_code: i32,
    tensor_cores: bool,
) -> Result<Option<Kernel>> {
    if let Some(k) = index::kernel(name, op, inputs, output, fail_code)? {
        return Ok(Some(k));
    }
    if let Some(k) = window::kernel(name, op, inputs, output) {
        return Ok(Some(k));
    }
    if let Some(k) = attention::kernel(name, op, inputs, output, fail_code)? {
        return Ok(Some(k));
    }
    if let Some(k) = flash::kernel(name, op, inputs, output, tensor_cores)? {
        return Ok(Some(k));
    }
    if let Some(k) = rows::kernel(name, op, inputs, output) {
        return Ok(Some(k));
    }
    if let Some(k) = rope::kernel(name, op, inputs, output) {
        return Ok(Some(k));
    }
    if let Some(k) = quant::kernel(name, op, inputs, output) {
        return Ok(Some(k));
    }
    if let Op::Elementwise { steps } = op {
        return fused::elementwise(name, steps, inputs, output).map(Some);
    }
    let out_dims = output.dims();
    let n = output.num_elements();
    let odt = output.dtype();
    let in_dts: Vec<DType> = inputs.iter().map(|s| s.dtype()).collect();
    let mut s = header(name, odt, &in_dts);
    let _ = writeln!(s, "  RLX_LOOP({n}LL) {{");
    match op {
        Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast(_) => {
            let mut vals = Vec::new();
            for (k, shape) in inputs.iter().enumerate() {
                let st = broadcast_strides(shape.dims(), out_dims);
                offset_code(&mut s, &format!("o{k}"), out_dims, &st);
                vals.push(load(shape.dtype(), &format!("in{k}"), &format!("o{k}")));
            }
            let value = match op {
                Op::Unary(u) => unary_expr(*u, in_dts[0], &vals[0])?,
                Op::Binary(b) => binary_expr(*b, in_dts[0], &vals[0], &vals[1])?,
                Op::Where => format!("(({}) != 0 ? {} : {})", vals[0], vals[1], vals[2]),
                Op::Cast(_) => cast_expr(in_dts[0], odt, &vals[0]),
                _ => unreachable!("matched above"),
            };
            // Comparisons compute in the operands' type and store as bool.
            let _ = writeln!(s, "    out[i] = {};", store(odt, &value));
        }
        Op::Reduce { op: rop, axes, .. }
            if axes.iter().map(|&a| inputs[0].dims()[a]).product::<usize>()
                >= BLOCK_REDUCE_FROM
                && n <= BLOCK_REDUCE_OUTPUTS =>
        {
            let count: usize = axes.iter().map(|&a| inputs[0].dims()[a]).product();
            let threads = match count {
                65536.. => 1024,
                8192.. => 512,
                _ => 256,
            };
            let shapes = (&inputs[0], output);
            return reduce_long(name, *rop, axes, shapes, Reducer::Block(threads)).map(Some);
        }
        Op::Reduce { op: rop, axes, .. }
            if axes.iter().map(|&a| inputs[0].dims()[a]).product::<usize>() >= WARP_REDUCE_FROM =>
        {
            let shapes = (&inputs[0], output);
            return reduce_long(name, *rop, axes, shapes, Reducer::Warp).map(Some);
        }
        Op::Reduce { op: rop, axes, .. } => {
            let src = inputs[0].dims();
            let src_strides = strides(src);
            let kept: Vec<usize> = (0..src.len()).filter(|a| !axes.contains(a)).collect();
            // Output element i -> base offset over the kept axes.
            let _ = writeln!(s, "    long long base = 0;");
            offset_over_axes(&mut s, "    ", "base", "i", &kept, src, &src_strides);
            let count: usize = axes.iter().map(|&a| src[a]).product();
            let idt = in_dts[0];
            let acc_t = accumulator(idt);
            let init = match rop {
                ReduceOp::Sum | ReduceOp::Mean => "0".to_string(),
                ReduceOp::Prod => "1".to_string(),
                ReduceOp::Max | ReduceOp::Min => {
                    let _ = writeln!(s, "    long long first = base;");
                    load(idt, "in0", "first")
                }
            };
            let _ = writeln!(s, "    {acc_t} acc = {init};");
            let _ = writeln!(s, "    for (long long j = 0; j < {count}LL; ++j) {{");
            let _ = writeln!(s, "      long long off = base;");
            offset_over_axes(&mut s, "      ", "off", "j", axes, src, &src_strides);
            let step = combine(*rop, acc_t, &load(idt, "in0", "off"));
            let _ = writeln!(s, "      {step}");
            let _ = writeln!(s, "    }}");
            if *rop == ReduceOp::Mean {
                let _ = writeln!(s, "    acc = acc / ({acc_t}){count};");
            }
            let _ = writeln!(s, "    out[i] = {};", store(odt, "acc"));
        }
        Op::Permute { perm } => {
            let own = strides(inputs[0].dims());
            let st: Vec<i64> = perm.iter().map(|&p| own[p]).collect();
            gather_copy(&mut s, out_dims, &st, 0, in_dts[0], odt);
        }
        Op::Expand { .. } => {
            let st = broadcast_strides(inputs[0].dims(), out_dims);
            gather_copy(&mut s, out_dims, &st, 0, in_dts[0], odt);
        }
        Op::Reshape { .. } => {
            gather_copy(&mut s, out_dims, &strides(out_dims), 0, in_dts[0], odt);
        }
        Op::Slice { axes } => {
            let own = strides(inputs[0].dims());
            let start: i64 = axes
                .iter()
                .zip(&own)
                .map(|(a, st)| a.start as i64 * st)
                .sum();
            let st: Vec<i64> = axes
                .iter()
                .zip(&own)
                .map(|(a, st)| a.step as i64 * st)
                .collect();
            gather_copy(&mut s, out_dims, &st, start, in_dts[0], odt);
        }
        Op::Concat { axis } => {
            // Output element -> its coordinate along the axis picks the operand.
            let inner: usize = out_dims[axis + 1..].iter().product();
            let along = out_dims[*axis];
            let _ = writeln!(
                s,
                "    long long inner = i % {inner}LL; long long c = (i / {inner}LL) % {along}LL; long long outer = i / ({inner}LL * {along}LL);"
            );
            let mut start = 0usize;
            for (k, shape) in inputs.iter().enumerate() {
                let len = shape.dims()[*axis];
                let _ = writeln!(
                    s,
                    "    if (c >= {start}LL && c < {end}LL) {{ out[i] = {}; }}",
                    store(
                        odt,
                        &load(
                            shape.dtype(),
                            &format!("in{k}"),
                            &format!("(outer * {len}LL + (c - {start}LL)) * {inner}LL + inner")
                        )
                    ),
                    end = start + len
                );
                start += len;
            }
        }
        _ => return Ok(None),
    }
    s.push_str("  }\n}\n");
    Ok(Some(elements(s, n)))
}

/// Reductions over at least this many elements take a warp per output.
const WARP_REDUCE_FROM: usize = 64;

/// Reductions over at least this many elements into at most
/// [`BLOCK_REDUCE_OUTPUTS`] values take a block per output: a gradient norm's sum of
/// squares over a whole weight (one output), or a bias gradient's column sums (a few
/// hundred), would leave a warp per output with thousands of values in each lane and
/// most of the GPU idle.
const BLOCK_REDUCE_FROM: usize = 1024;

/// The most outputs of a reduction that takes a block for each (past it, a warp
/// each already fills the GPU).
const BLOCK_REDUCE_OUTPUTS: usize = 2048;

/// The accumulator type of a reduction over `dt`.
fn accumulator(dt: DType) -> &'static str {
    if dt == DType::F64 {
        "double"
    } else if is_float(dt) {
        "float"
    } else {
        "long long"
    }
}

/// `acc = combine(acc, v)` for a reduction (max and min propagate NaN).
fn combine(rop: ReduceOp, acc_t: &str, v: &str) -> String {
    match rop {
        ReduceOp::Sum | ReduceOp::Mean => format!("acc += {v};"),
        ReduceOp::Prod => format!("acc *= {v};"),
        ReduceOp::Max => format!(
            "{{ {acc_t} v = {v}; acc = (v != v || acc != acc) ? (acc + v) : (v > acc ? v : acc); }}"
        ),
        ReduceOp::Min => format!(
            "{{ {acc_t} v = {v}; acc = (v != v || acc != acc) ? (acc + v) : (v < acc ? v : acc); }}"
        ),
    }
}

/// Who reduces one output of a long reduction.
#[derive(Clone, Copy)]
enum Reducer {
    /// A warp: the lanes stride over the reduced elements (adjacent lanes read
    /// adjacent elements when the reduced axes are the innermost), then combine
    /// through shuffles.
    Warp,
    /// A block of this many threads (a power of two from 64 to 1024): each warp
    /// combines its lanes through shuffles, then the first warp combines the warps'
    /// partials, always in the same order (the result does not depend on timing).
    Block(usize),
}

/// A reduction with a warp or a block per output (`count >= 32`, or the block's
/// thread count: every thread starts from an element of its own).
fn reduce_long(
    name: &str,
    rop: ReduceOp,
    axes: &[usize],
    (input, output): (&Shape, &Shape),
    reducer: Reducer,
) -> Result<Kernel> {
    let src = input.dims();
    let src_strides = strides(src);
    let kept: Vec<usize> = (0..src.len()).filter(|a| !axes.contains(a)).collect();
    let count: usize = axes.iter().map(|&a| src[a]).product();
    let (idt, odt) = (input.dtype(), output.dtype());
    let acc_t = accumulator(idt);
    let outputs = output.num_elements();
    let mut s = header(name, odt, &[idt]);
    let (index, thread, stride) = match reducer {
        Reducer::Warp => {
            let _ = writeln!(s, "  const int lane = threadIdx.x & 31;");
            let _ = writeln!(s, "  RLX_WARP_LOOP({outputs}LL) {{");
            ("w", "lane", 32)
        }
        Reducer::Block(threads) => {
            // The partials' butterfly needs a power-of-two warp count.
            debug_assert!(count >= threads && threads.is_power_of_two() && threads >= 64);
            s = s.replacen(
                "__global__ void ",
                &format!("__global__ void __launch_bounds__({threads}) "),
                1,
            );
            let _ = writeln!(s, "  __shared__ {acc_t} part[{}];", threads / 32);
            let _ = writeln!(
                s,
                "  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;"
            );
            let _ = writeln!(
                s,
                "  for (long long b = blockIdx.x; b < {outputs}LL; b += gridDim.x) {{"
            );
            ("b", "threadIdx.x", threads)
        }
    };
    let _ = writeln!(s, "    long long base = 0;");
    offset_over_axes(&mut s, "    ", "base", index, &kept, src, &src_strides);
    let _ = writeln!(s, "    long long first = base;");
    offset_over_axes(&mut s, "    ", "first", thread, axes, src, &src_strides);
    let _ = writeln!(s, "    {acc_t} acc = {};", load(idt, "in0", "first"));
    let _ = writeln!(
        s,
        "    for (long long j = {thread} + {stride}; j < {count}LL; j += {stride}) {{"
    );
    let _ = writeln!(s, "      long long off = base;");
    offset_over_axes(&mut s, "      ", "off", "j", axes, src, &src_strides);
    let _ = writeln!(s, "      {}", combine(rop, acc_t, &load(idt, "in0", "off")));
    let _ = writeln!(s, "    }}");
    shuffle_combine(&mut s, rop, acc_t, 16);
    let mean = if rop == ReduceOp::Mean {
        format!("acc = acc / ({acc_t}){count}; ")
    } else {
        String::new()
    };
    let store_acc = format!(
        "if (lane == 0) {{ {mean}out[{index}] = {}; }}",
        store(odt, "acc")
    );
    let grid = match reducer {
        Reducer::Warp => {
            let _ = writeln!(s, "    {store_acc}");
            Grid::Warps(outputs)
        }
        Reducer::Block(threads) => {
            let warps = threads / 32;
            let _ = writeln!(s, "    if (lane == 0) part[warp] = acc;");
            let _ = writeln!(s, "    __syncthreads();");
            // Lanes past the warp count read a partial they never combine into lane 0
            // (an xor below `warps` stays among the first `warps` lanes).
            let _ = writeln!(s, "    if (warp == 0) {{");
            let _ = writeln!(s, "    acc = part[lane < {warps} ? lane : 0];");
            shuffle_combine(&mut s, rop, acc_t, warps / 2);
            let _ = writeln!(s, "    {store_acc}");
            let _ = writeln!(s, "    }}");
            let _ = writeln!(s, "    __syncthreads();");
            Grid::Blocks {
                count: outputs,
                threads: threads as u32,
            }
        }
    };
    s.push_str("  }\n}\n");
    Ok(Kernel {
        source: s,
        grid,
        check: None,
    })
}

/// Combines `acc` across lanes `o` apart for `o = from, from / 2, ..., 1` (a
/// butterfly: lane 0 ends with the combination of lanes `0..2 from`).
fn shuffle_combine(s: &mut String, rop: ReduceOp, acc_t: &str, from: usize) {
    let other = if acc_t == "long long" {
        "__shfl_xor_sync(0xffffffffu, acc, o)".to_string()
    } else {
        format!("({acc_t})__shfl_xor_sync(0xffffffffu, acc, o)")
    };
    let _ = writeln!(
        s,
        "    for (int o = {from}; o > 0; o >>= 1) {{ {acc_t} other = {other}; {} }}",
        combine(rop, acc_t, "other")
    );
}

/// Adds to `long long {target}` the offset of linear index `index` counted over
/// `axes` of `dims` (last axis fastest), each step `strides[axis]` apart.
fn offset_over_axes(
    s: &mut String,
    indent: &str,
    target: &str,
    index: &str,
    axes: &[usize],
    dims: &[usize],
    strides: &[i64],
) {
    let _ = writeln!(s, "{indent}{{ long long r = {index};");
    for &a in axes.iter().rev() {
        let _ = writeln!(
            s,
            "{indent}  {{ long long c = r % {d}; r /= {d}; {target} += c * {st}LL; }}",
            d = dims[a],
            st = strides[a]
        );
    }
    let _ = writeln!(s, "{indent}}}");
}

/// `out[i] = in0[start + sum(coord_k * strides_k)]`.
fn gather_copy(s: &mut String, dims: &[usize], st: &[i64], start: i64, idt: DType, odt: DType) {
    offset_code(s, "o0", dims, st);
    let _ = writeln!(
        s,
        "    out[i] = {};",
        store(odt, &load(idt, "in0", &format!("({start}LL + o0)")))
    );
}

/// Converts compute value `v` of `from` to the compute type of `to` (floats to
/// integers truncate toward zero; to bool tests for non-zero).
fn cast_expr(from: DType, to: DType, v: &str) -> String {
    let c = ctype(to).compute;
    if to == DType::Bool {
        return format!("(({v}) != 0)");
    }
    if is_float(from) && !is_float(to) {
        // NaN and out-of-range values have no integer; they give 0 rather than
        // whatever the conversion instruction saturates to.
        return format!("(({v}) != ({v}) ? 0LL : ({c})({v}))");
    }
    format!("(({c})({v}))")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcast_strides_zero_the_repeated_axes() {
        assert_eq!(broadcast_strides(&[3, 1], &[2, 3, 4]), vec![0, 1, 0]);
        assert_eq!(broadcast_strides(&[2, 3, 4], &[2, 3, 4]), vec![12, 4, 1]);
    }

    #[test]
    fn a_broadcast_add_reads_each_operand_at_its_own_offset() {
        let a = Shape::new(&[2, 3], DType::F32);
        let b = Shape::new(&[3], DType::F32);
        let k = kernel("k0", &Op::Binary(BinaryOp::Add), &[a.clone(), b], &a, 1)
            .unwrap()
            .unwrap();
        assert_eq!(k.grid, Grid::Elements(6));
        assert!(k.source.contains("long long o0 = i;"), "{}", k.source);
        assert!(k.source.contains("o1 += c * (1LL)"), "{}", k.source);
    }

    #[test]
    fn half_values_convert_through_float() {
        let h = Shape::new(&[4], DType::F16);
        let k = kernel(
            "k1",
            &Op::Unary(UnaryOp::Exp),
            std::slice::from_ref(&h),
            &h,
            1,
        )
        .unwrap()
        .unwrap();
        assert!(k.source.contains("f2h(expf(h2f(in0[o0])))"), "{}", k.source);
    }

    #[test]
    fn ops_without_a_generator_are_left_to_the_caller() {
        let a = Shape::new(&[2, 2], DType::F32);
        assert!(
            kernel("k", &Op::MatMul, &[a.clone(), a.clone()], &a, 1)
                .unwrap()
                .is_none()
        );
    }
}
