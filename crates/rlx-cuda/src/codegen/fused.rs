//! Kernels for the fused forms the optimizer makes: an elementwise region as one
//! pass, and the pieces of a matrix product with its epilogue (the epilogue applied
//! in place after cuBLAS, and a matrix-vector kernel for products of a few rows,
//! which reads the weights as stored, `f16` and `bf16` included, and writes the
//! epilogue's result directly).

use super::{
    Grid, Kernel, binary_expr, broadcast_strides, ctype, elements, header, load, offset_code,
    store, unary_expr,
};
use rlx_ir::{DType, EwStep, Result, Shape, UnaryOp};
use std::fmt::Write;

/// Threads of a matrix-vector block: 8 warps.
pub(crate) const GEMV_THREADS: u32 = 256;
/// Output columns one matrix-vector block covers: 32 lanes of 8 columns.
pub(crate) const GEMV_TILE: usize = 256;
/// The most rows a product may have to take the matrix-vector kernel.
pub(crate) const GEMV_MAX_ROWS: usize = 4;

/// `v` rounded to `dt` and back to its compute type (nothing for `f32`/`f64`): every
/// step of a fused form is rounded as the unfused op would round it.
fn rounded(dt: DType, v: &str) -> String {
    match dt {
        DType::F16 => format!("h2f(f2h({v}))"),
        DType::BF16 => format!("bf2f(f2bf({v}))"),
        _ => v.to_string(),
    }
}

/// An `Elementwise` region: each thread loads its operands (broadcast to the output),
/// runs the steps in registers and stores the last one.
pub(super) fn elementwise(
    name: &str,
    steps: &[EwStep],
    inputs: &[Shape],
    out: &Shape,
) -> Result<Kernel> {
    let dt = out.dtype();
    let c = ctype(dt).compute;
    let in_dts: Vec<DType> = inputs.iter().map(|s| s.dtype()).collect();
    let mut s = header(name, dt, &in_dts);
    let n = out.num_elements();
    let _ = writeln!(s, "  RLX_LOOP({n}LL) {{");
    for (k, shape) in inputs.iter().enumerate() {
        let st = broadcast_strides(shape.dims(), out.dims());
        offset_code(&mut s, &format!("o{k}"), out.dims(), &st);
        let v = load(shape.dtype(), &format!("in{k}"), &format!("o{k}"));
        let _ = writeln!(s, "    const {c} r{k} = {v};");
    }
    let first = inputs.len();
    for (k, step) in steps.iter().enumerate() {
        let reg = |r: u16| format!("r{r}");
        let v = match *step {
            EwStep::Unary(op, a) => unary_expr(op, dt, &reg(a))?,
            EwStep::Binary(op, a, b) => binary_expr(op, dt, &reg(a), &reg(b))?,
        };
        let _ = writeln!(s, "    const {c} r{} = {};", first + k, rounded(dt, &v));
    }
    let last = first + steps.len() - 1;
    let _ = writeln!(s, "    out[i] = {};", store(dt, &format!("r{last}")));
    s.push_str("  }\n}\n");
    Ok(elements(s, n))
}

/// What a matrix product applies to each result before storing it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Epilogue {
    /// Scale of the product.
    pub alpha: f64,
    /// Whether a bias `[N]` is added.
    pub bias: bool,
    /// The activation after the bias.
    pub activation: Option<UnaryOp>,
    /// Whether a residual of the output's shape is added last.
    pub residual: bool,
}

impl Epilogue {
    /// Whether it changes nothing.
    pub fn is_identity(&self) -> bool {
        self.alpha == 1.0 && !self.bias && self.activation.is_none() && !self.residual
    }

    /// Statements turning `{c} v` (the product at output element `row * N + col`)
    /// into the stored value, reading the bias from `bias` and the residual from `res`.
    fn code(&self, s: &mut String, dt: DType, row: &str, col: &str, n: usize) -> Result<()> {
        let residual = load(dt, "res", &format!("(({row}) * {n}LL + ({col}))"));
        self.code_with(s, dt, col, &residual)
    }

    /// [`Epilogue::code`] with the residual read by the expression `residual`.
    fn code_with(&self, s: &mut String, dt: DType, col: &str, residual: &str) -> Result<()> {
        if self.alpha != 1.0 {
            let a = super::literal(self.alpha, dt);
            let _ = writeln!(s, "      v = {};", rounded(dt, &format!("v * {a}")));
        }
        if self.bias {
            let b = load(dt, "bias", col);
            let _ = writeln!(s, "      v = {};", rounded(dt, &format!("v + {b}")));
        }
        if let Some(act) = self.activation {
            let e = unary_expr(act, dt, "v")?;
            let _ = writeln!(s, "      v = {};", rounded(dt, &e));
        }
        if self.residual {
            let _ = writeln!(s, "      v = {};", rounded(dt, &format!("v + {residual}")));
        }
        Ok(())
    }

    /// The pointer parameters for the bias and residual operands.
    fn params(&self, dt: DType) -> String {
        let t = ctype(dt).storage;
        let mut p = String::new();
        if self.bias {
            let _ = write!(p, ", const {t}* __restrict__ bias");
        }
        if self.residual {
            let _ = write!(p, ", const {t}* __restrict__ res");
        }
        p
    }
}

/// The epilogue applied in place to a product already in `out` (`[rows, N]` of
/// `dt`); operands are the bias and residual the epilogue takes. With `vector`,
/// each thread takes 16 bytes of a row at once (`N` must fill whole 16-byte
/// pieces, and `out` and the residual must be 16-byte aligned).
pub(crate) fn epilogue_in_place(
    name: &str,
    epilogue: &Epilogue,
    out: &Shape,
    vector: bool,
) -> Result<Kernel> {
    let dt = out.dtype();
    let ct = ctype(dt);
    let n = out.dims().last().copied().unwrap_or(1).max(1);
    let total = out.num_elements();
    let mut s = format!(
        "extern \"C\" __global__ void {name}({}* __restrict__ out{}) {{\n",
        ct.storage,
        epilogue.params(dt)
    );
    let per = 16 / dt.size_in_bytes().max(1);
    if !vector || per <= 1 || n % per != 0 {
        let _ = writeln!(s, "  RLX_LOOP({total}LL) {{");
        let _ = writeln!(s, "      long long row = i / {n}LL, col = i % {n}LL;");
        let _ = writeln!(s, "      {} v = {};", ct.compute, load(dt, "out", "i"));
        epilogue.code(&mut s, dt, "row", "col", n)?;
        let _ = writeln!(s, "      out[i] = {};", store(dt, "v"));
        s.push_str("  }\n}\n");
        return Ok(elements(s, total));
    }
    let pieces = total / per;
    let _ = writeln!(s, "  RLX_LOOP({pieces}LL) {{");
    let _ = writeln!(
        s,
        "    const long long at = i * {per}LL, col0 = at % {n}LL;\n    uint4 pk = *(const uint4*)(out + at); {st}* pv = ({st}*)&pk;",
        st = ct.storage
    );
    if epilogue.residual {
        let _ = writeln!(
            s,
            "    const uint4 rk = *(const uint4*)(res + at); const {st}* rv = (const {st}*)&rk;",
            st = ct.storage
        );
    }
    let _ = writeln!(
        s,
        "    #pragma unroll\n    for (int u = 0; u < {per}; ++u) {{\n      const long long col = col0 + u;\n      {} v = {};",
        ct.compute,
        load(dt, "pv", "u")
    );
    epilogue.code_with(&mut s, dt, "col", &load(dt, "rv", "u"))?;
    let _ = writeln!(s, "      pv[u] = {};\n    }}", store(dt, "v"));
    s.push_str("    *(uint4*)(out + at) = pk;\n  }\n}\n");
    Ok(elements(s, pieces))
}

/// The geometry of a matrix-vector product: `rows` (at most [`GEMV_MAX_ROWS`]) of
/// `a [rows, K]` times `b [K, N]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Gemv {
    pub rows: usize,
    pub k: usize,
    pub n: usize,
    /// Slices of `K` summed by separate blocks (their partial sums meet in the
    /// workspace; the last block of a column tile adds them in order).
    pub splits: usize,
    /// Whether `b`'s rows may be read 16 bytes at a time (`N` a multiple of 8 and
    /// `b` 16-byte aligned).
    pub vector: bool,
}

impl Gemv {
    /// The split of `K` that gives about `target_blocks` blocks, each slice at least
    /// 64 rows.
    pub fn new(rows: usize, k: usize, n: usize, target_blocks: usize, vector: bool) -> Gemv {
        let tiles = n.div_ceil(GEMV_TILE).max(1);
        let most = k.div_ceil(64).max(1);
        let splits = target_blocks.div_ceil(tiles).clamp(1, most);
        Gemv {
            rows,
            k,
            n,
            splits,
            vector,
        }
    }

    /// Column tiles.
    pub fn tiles(&self) -> usize {
        self.n.div_ceil(GEMV_TILE).max(1)
    }

    /// Rows of `K` per split, a multiple of the 8 warps that share them.
    fn slice(&self) -> usize {
        self.k.div_ceil(self.splits).div_ceil(8) * 8
    }

    /// Bytes of partial sums in the workspace.
    pub fn partial_bytes(&self) -> usize {
        if self.splits == 1 {
            0
        } else {
            self.splits * self.rows * self.n * 4
        }
    }
}

/// One 16-byte load of 8 consecutive `b` elements into `float w[8]`.
fn vector_load(s: &mut String, bdt: DType) {
    let _ = writeln!(s, "      float w[8];");
    match bdt {
        DType::F32 => {
            let _ = writeln!(
                s,
                "      const float4 q0 = *reinterpret_cast<const float4*>(b + k * N + col0);\n      const float4 q1 = *reinterpret_cast<const float4*>(b + k * N + col0 + 4);\n      w[0] = q0.x; w[1] = q0.y; w[2] = q0.z; w[3] = q0.w; w[4] = q1.x; w[5] = q1.y; w[6] = q1.z; w[7] = q1.w;"
            );
        }
        _ => {
            let cvt = if bdt == DType::F16 { "h2f" } else { "bf2f" };
            let _ = writeln!(
                s,
                "      const uint4 q = *reinterpret_cast<const uint4*>(b + k * N + col0);\n      const unsigned int u[4] = {{q.x, q.y, q.z, q.w}};\n      #pragma unroll\n      for (int j = 0; j < 4; ++j) {{ w[2 * j] = {cvt}((unsigned short)(u[j] & 0xffffu)); w[2 * j + 1] = {cvt}((unsigned short)(u[j] >> 16)); }}"
            );
        }
    }
}

/// `out [rows, N] = epilogue(a [rows, K] @ b [K, N])` for a few rows: each block
/// takes 256 columns and one slice of `K`; within it, 32 lanes of 8 columns and 8
/// warps over the rows. Operands: `a`, `b`, the bias and residual if taken, then the
/// workspace's partial sums and per-tile counters (each counter is back to zero when
/// the kernel ends).
pub(crate) fn gemv(
    name: &str,
    g: &Gemv,
    epilogue: &Epilogue,
    adt: DType,
    bdt: DType,
) -> Result<Kernel> {
    let (m, k, n) = (g.rows, g.k, g.n);
    let tiles = g.tiles();
    let mut s = format!(
        "extern \"C\" __global__ void __launch_bounds__({GEMV_THREADS}) {name}({}* __restrict__ out, const {}* __restrict__ a, const {}* __restrict__ b{}, float* __restrict__ part, unsigned int* __restrict__ count) {{\n",
        ctype(adt).storage,
        ctype(adt).storage,
        ctype(bdt).storage,
        epilogue.params(adt)
    );
    let _ = writeln!(
        s,
        "  const long long K = {k}LL, N = {n}LL;\n  const int tile = blockIdx.x % {tiles}, split = blockIdx.x / {tiles};\n  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;\n  const long long col0 = (long long)tile * {GEMV_TILE} + lane * 8;\n  const long long k0 = (long long)split * {slice}LL;\n  const long long k1 = k0 + {slice}LL < K ? k0 + {slice}LL : K;\n  float acc[{m}][8];\n  #pragma unroll\n  for (int r = 0; r < {m}; ++r) {{ for (int j = 0; j < 8; ++j) acc[r][j] = 0.f; }}",
        slice = g.slice()
    );
    let _ = writeln!(
        s,
        "  if (col0 < N) {{\n    #pragma unroll 4\n    for (long long k = k0 + warp; k < k1; k += 8) {{"
    );
    if g.vector {
        vector_load(&mut s, bdt);
    } else {
        let _ = writeln!(s, "      float w[8];");
        let _ = writeln!(
            s,
            "      #pragma unroll\n      for (int j = 0; j < 8; ++j) w[j] = col0 + j < N ? {} : 0.f;",
            load(bdt, "b", "k * N + col0 + j")
        );
    }
    let _ = writeln!(
        s,
        "      #pragma unroll\n      for (int r = 0; r < {m}; ++r) {{\n        const float x = {};\n        #pragma unroll\n        for (int j = 0; j < 8; ++j) acc[r][j] = fmaf(x, w[j], acc[r][j]);\n      }}\n    }}\n  }}",
        load(adt, "a", "r * K + k")
    );
    // Sum the 8 warps' partial sums through shared memory: thread t owns column t of
    // the tile.
    let _ = writeln!(
        s,
        "  __shared__ float red[{size}];\n  #pragma unroll\n  for (int r = 0; r < {m}; ++r) {{ for (int j = 0; j < 8; ++j) red[(warp * {m} + r) * {GEMV_TILE} + lane * 8 + j] = acc[r][j]; }}\n  __syncthreads();\n  const int t = threadIdx.x;\n  const long long col = (long long)tile * {GEMV_TILE} + t;\n  float sum[{m}];\n  #pragma unroll\n  for (int r = 0; r < {m}; ++r) {{ float v = 0.f; for (int w = 0; w < 8; ++w) v += red[(w * {m} + r) * {GEMV_TILE} + t]; sum[r] = v; }}",
        size = 8 * m * GEMV_TILE
    );
    let c = ctype(adt).compute;
    let mut finish = String::new();
    let _ = writeln!(finish, "    for (int r = 0; r < {m}; ++r) {{");
    let _ = writeln!(finish, "      {c} v = {};", rounded(adt, "total[r]"));
    epilogue.code(&mut finish, adt, "r", "col", n)?;
    let _ = writeln!(
        finish,
        "      out[r * N + col] = {};\n    }}",
        store(adt, "v")
    );
    if g.splits == 1 {
        let _ = writeln!(
            s,
            "  if (col < N) {{\n    const float* total = sum;\n{finish}  }}"
        );
    } else {
        // The last block to finish a tile (counted on its counter after a fence that
        // makes its partial sums visible) adds every split's sums in split order, so
        // the result does not depend on which block finished when.
        let splits = g.splits;
        let _ = writeln!(
            s,
            "  if (col < N) {{ for (int r = 0; r < {m}; ++r) part[((long long)split * {m} + r) * N + col] = sum[r]; }}\n  __threadfence();\n  __syncthreads();\n  __shared__ unsigned int last;\n  if (t == 0) last = atomicAdd(&count[tile], 1u) == {splits}u - 1u;\n  __syncthreads();\n  if (!last) return;\n  __threadfence();\n  if (col < N) {{\n    float total[{m}];\n    for (int r = 0; r < {m}; ++r) {{ float v = 0.f; for (int p = 0; p < {splits}; ++p) v += __ldcg(&part[((long long)p * {m} + r) * N + col]); total[r] = v; }}\n{finish}  }}\n  if (t == 0) count[tile] = 0u;"
        );
    }
    s.push_str("}\n");
    Ok(Kernel {
        source: s,
        grid: Grid::Blocks {
            count: tiles * g.splits,
            threads: GEMV_THREADS,
        },
        check: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_split_of_k_keeps_slices_of_at_least_64_rows() {
        let g = Gemv::new(1, 2048, 2048, 400, true);
        assert_eq!(g.tiles(), 8);
        assert_eq!(g.splits, 32);
        assert_eq!(g.slice(), 64);
        // A wide product needs no split.
        let wide = Gemv::new(1, 2048, 128_256, 400, true);
        assert_eq!(wide.splits, 1);
        assert_eq!(wide.partial_bytes(), 0);
        // Slices cover K.
        let odd = Gemv::new(3, 1000, 100, 400, false);
        assert!(odd.slice() * odd.splits >= 1000);
    }

    #[test]
    fn an_identity_epilogue_is_recognized() {
        let e = Epilogue {
            alpha: 1.0,
            bias: false,
            activation: None,
            residual: false,
        };
        assert!(e.is_identity());
        assert!(
            !Epilogue {
                residual: true,
                ..e
            }
            .is_identity()
        );
    }
}
