//! Several matrix-vector products of one input as one kernel (a decode step's
//! q/k/v projections, or its gate and up projections with the SwiGLU product
//! applied): the input is read once per output instead of once per kernel, and the
//! launches between them are gone. Optionally the input is RMS-normalized as it is
//! read, so the norm before the products needs no kernel of its own.
//!
//! The weights are stored `[N, K]`, as for [`super::gemv::gemv_rows`]: a warp owns
//! one output and walks its contiguous row (its rows, when the outputs are
//! combined), 16 bytes a lane at a time. Each block first copies the input into
//! shared memory, so the walk reads only weights from memory. A folded norm is
//! applied as `inv * (w . (x * gamma))`: the copy scales by `gamma` and sums the
//! squares in one pass, and the reciprocal root scales each finished sum.

use super::fused::{Epilogue, region_steps, rounded};
use super::gemv::{GEMV_THREADS, line_mask, row_chunk};
use super::{Grid, Kernel, ctype, load, store, unsupported};
use rlx_ir::{DType, EwStep, Result};
use std::fmt::Write;

/// The most input values (`rows x K`) a group takes: each block keeps them in
/// shared memory (32 KiB as float).
pub(crate) const GROUP_INPUT_FLOATS: usize = 8192;

/// One product of a [`RowGroup`]: its output columns and epilogue.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GroupProduct {
    /// Output columns (rows of its weight).
    pub n: usize,
    /// What is applied to each result before it is stored (or combined).
    pub epilogue: Epilogue,
}

/// Products `a [rows, K] @ w_i^T` (`w_i [n_i, K]`) computed by one kernel.
#[derive(Clone, Debug)]
pub(crate) struct RowGroup {
    /// Rows of `a` (at most [`super::gemv::GEMV_MAX_ROWS`]).
    pub rows: usize,
    /// The shared inner dimension, a multiple of 8.
    pub k: usize,
    /// The products, in operand order.
    pub products: Vec<GroupProduct>,
    /// When set, the kernel stores one output: this elementwise region applied to
    /// the products' results at the same index (register `i` is product `i`; every
    /// product has the same `n`). Otherwise each product stores its own output.
    pub combine: Option<Vec<EwStep>>,
    /// When set, `a` is RMS-normalized over `K` with this epsilon and the `gamma [K]`
    /// operand before the products (activations `f32`).
    pub norm: Option<f64>,
    /// The most blocks to launch.
    pub max_blocks: usize,
    /// Whether each block first copies `a` into shared memory (scaled by `gamma`
    /// when the norm is folded, its squares summed on the way); otherwise warps
    /// read it as they walk (and each sums its squares itself).
    pub staged: bool,
}

impl RowGroup {
    /// Outputs a warp takes in turn: every product's when stored separately, one
    /// product's count when combined.
    pub fn walked_outputs(&self) -> usize {
        match self.combine {
            Some(_) => self.products.first().map_or(0, |p| p.n),
            None => self.products.iter().map(|p| p.n).sum(),
        }
    }

    /// Blocks launched: 8 warps each, a warp per output at a time.
    pub fn blocks(&self) -> usize {
        self.walked_outputs()
            .div_ceil(8)
            .clamp(1, self.max_blocks.max(1))
    }
}

/// The kernel for `g`. Operands: the output (one per product unless combined), `a`,
/// `gamma` when normalizing, then for each product its weight and the bias and
/// residual its epilogue takes. `a`, `gamma` and every weight 16-byte aligned.
pub(crate) fn gemv_group(name: &str, g: &RowGroup, adt: DType, wdt: DType) -> Result<Kernel> {
    let (m, k) = (g.rows, g.k);
    let count = g.products.len();
    if count == 0 || k % 8 != 0 {
        return Err(unsupported(format!(
            "a row group of {count} products over K = {k}"
        )));
    }
    if g.norm.is_some() && adt != DType::F32 {
        return Err(unsupported(format!("a norm folded into {adt} products")));
    }
    if m * k > GROUP_INPUT_FLOATS {
        return Err(unsupported(format!(
            "a row group input of {m} x {k}, past {GROUP_INPUT_FLOATS} values"
        )));
    }
    if let Some(steps) = &g.combine
        && (steps.is_empty() || g.products.iter().any(|p| p.n != g.products[0].n))
    {
        return Err(unsupported(
            "a combined row group of unequal products".into(),
        ));
    }
    let at = ctype(adt).storage;
    let wt = ctype(wdt).storage;
    let c = ctype(adt).compute;
    let mut s = format!("extern \"C\" __global__ void __launch_bounds__({GEMV_THREADS}) {name}(");
    let outs = if g.combine.is_some() { 1 } else { count };
    for o in 0..outs {
        let _ = write!(s, "{at}* __restrict__ out{o}, ");
    }
    let _ = write!(s, "const {at}* __restrict__ a");
    if g.norm.is_some() {
        let _ = write!(s, ", const {at}* __restrict__ gamma");
    }
    for (i, p) in g.products.iter().enumerate() {
        let _ = write!(
            s,
            ", const {wt}* __restrict__ b{i}{}",
            p.epilogue.params_tagged(adt, &i.to_string())
        );
    }
    s.push_str(") {\n");
    let total = g.walked_outputs();
    let _ = writeln!(
        s,
        "  const long long K = {k}LL;\n  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;"
    );
    // Rows a warp walks at once: every product's when combined. (Splitting a
    // block's warps between the products instead, their results meeting in shared
    // memory, measured slower in `gemv_bench`: 28.5 against 26.5 us for a
    // 2048 x 8192 pair.)
    let walked = if g.combine.is_some() { count } else { 1 };
    // The rows of output `col` (`c` within its product `p`).
    let select = |s: &mut String, col: &str| {
        if g.combine.is_some() {
            let _ = writeln!(s, "    const long long c = {col};");
            for i in 0..count {
                let _ = writeln!(s, "    const {wt}* row{i} = b{i} + c * K;");
            }
            return;
        }
        let _ = writeln!(s, "    int p = 0; long long c = {col};");
        let mut start = 0usize;
        for i in 1..count {
            start += g.products[i - 1].n;
            let _ = writeln!(
                s,
                "    if ({col} >= {start}LL) {{ p = {i}; c = {col} - {start}LL; }}"
            );
        }
        let mut pick = String::from("b0");
        for i in 1..count {
            pick = format!("(p == {i} ? b{i} : {pick})");
        }
        let _ = writeln!(s, "    const {wt}* row0 = {pick} + c * K;");
    };
    // Ask L2 for the first output's first row before waiting for the kernel ahead
    // (one row a warp: the resident blocks' rows fit in L2, both rows of every
    // combined pair may not).
    let _ = writeln!(
        s,
        "  {{\n    const long long first = (long long)blockIdx.x * 8 + warp;\n    if (first < {total}LL && (lane & {mask}) == 0) {{",
        mask = line_mask(wdt)
    );
    select(&mut s, "first");
    s.push_str(
        "    for (long long k = lane * 8; k < K; k += 256) rlx_prefetch_l2(row0 + k);\n    }\n  }\n  RLX_ENTER();\n",
    );
    if g.staged {
        // The block's copy of `a` in shared memory as float. With the norm folded it
        // holds `x * gamma` and the row's reciprocal root scales each finished sum
        // (a per-row constant): the squares are summed in the same pass, so one
        // barrier separates the copy from the walk.
        let size = m * k;
        let warps = GEMV_THREADS / 32;
        let _ = writeln!(s, "  __shared__ __align__(16) float xs[{size}];");
        match g.norm {
            None => {
                let _ = writeln!(
                    s,
                    "  for (int i = threadIdx.x; i < {size}; i += {GEMV_THREADS}) xs[i] = {};\n  __syncthreads();",
                    load(adt, "a", "i")
                );
            }
            Some(eps) => {
                let _ = writeln!(
                    s,
                    "  __shared__ float squares[{m}][{warps}];\n  for (int r = 0; r < {m}; ++r) {{\n    float t = 0.f;\n    for (int i = threadIdx.x; i < {k}; i += {GEMV_THREADS}) {{\n      const float x = {};\n      t = fmaf(x, x, t);\n      xs[r * {k} + i] = x * {};\n    }}\n    t = warp_sum(t);\n    if (lane == 0) squares[r][warp] = t;\n  }}\n  __syncthreads();\n  float inv[{m}];\n  for (int r = 0; r < {m}; ++r) {{\n    float t = 0.f;\n    for (int w = 0; w < {warps}; ++w) t += squares[r][w];\n    inv[r] = rsqrtf(t / {} + {});\n  }}",
                    load(adt, "a", &format!("r * {k} + i")),
                    load(adt, "gamma", "i"),
                    super::literal(k as f64, DType::F32),
                    super::literal(eps, DType::F32),
                );
            }
        }
    }
    // Each warp walks on its own (measured faster than a block-uniform walk with a
    // test inside: 11.9 against 16.0 us for 2048 x 8192 in `gemv_bench`).
    let _ = writeln!(
        s,
        "  for (long long col = (long long)blockIdx.x * 8 + warp; col < {total}LL; col += (long long)gridDim.x * 8) {{"
    );
    select(&mut s, "col");
    for w in 0..walked {
        let _ = writeln!(
            s,
            "    float acc{w}[{m}];\n    #pragma unroll\n    for (int r = 0; r < {m}; ++r) acc{w}[r] = 0.f;"
        );
    }
    let direct_norm = g.norm.is_some() && !g.staged;
    if direct_norm {
        let _ = writeln!(
            s,
            "    float ss[{m}];\n    #pragma unroll\n    for (int r = 0; r < {m}; ++r) ss[r] = 0.f;"
        );
    }
    // Eight pieces in flight, as `gemv_rows`: for a gate/up pair (2048 x 8192 each,
    // norm staged) 4 measured the same (26.35 against 26.45 us) and 2 slower (28.7).
    let _ = writeln!(
        s,
        "    #pragma unroll 8\n    for (long long k = lane * 8; k < K; k += 256) {{"
    );
    for w in 0..walked {
        row_chunk(&mut s, wdt, &format!("row{w} + k"), &w.to_string());
    }
    let _ = writeln!(
        s,
        "      #pragma unroll\n      for (int r = 0; r < {m}; ++r) {{"
    );
    if g.staged {
        s.push_str("        const float4 xa = *reinterpret_cast<const float4*>(xs + r * K + k), xb = *reinterpret_cast<const float4*>(xs + r * K + k + 4);\n        const float x[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};\n");
    } else if adt == DType::F32 {
        s.push_str("        const float4 xa = *reinterpret_cast<const float4*>(a + r * K + k), xb = *reinterpret_cast<const float4*>(a + r * K + k + 4);\n        float x[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};\n");
    } else {
        let _ = writeln!(
            s,
            "        float x[8];\n        #pragma unroll\n        for (int j = 0; j < 8; ++j) x[j] = {};",
            load(adt, "a", "r * K + k + j")
        );
    }
    if direct_norm {
        // The sum of squares rides along; `gamma` scales the input here and the
        // reciprocal root scales the finished sum (a per-row constant).
        s.push_str("        const float4 ga = *reinterpret_cast<const float4*>(gamma + k), gb = *reinterpret_cast<const float4*>(gamma + k + 4);\n        const float gm[8] = {ga.x, ga.y, ga.z, ga.w, gb.x, gb.y, gb.z, gb.w};\n        #pragma unroll\n        for (int j = 0; j < 8; ++j) { ss[r] = fmaf(x[j], x[j], ss[r]); x[j] *= gm[j]; }\n");
    }
    for w in 0..walked {
        let _ = writeln!(
            s,
            "        #pragma unroll\n        for (int j = 0; j < 8; ++j) acc{w}[r] = fmaf(x[j], w{w}[j], acc{w}[r]);"
        );
    }
    s.push_str("      }\n    }\n");
    let _ = writeln!(
        s,
        "    #pragma unroll\n    for (int r = 0; r < {m}; ++r) {{"
    );
    for w in 0..walked {
        let _ = writeln!(s, "      acc{w}[r] = warp_sum(acc{w}[r]);");
    }
    if direct_norm {
        s.push_str("      ss[r] = warp_sum(ss[r]);\n");
    }
    s.push_str("    }\n");
    let _ = writeln!(
        s,
        "    if (lane == 0) {{\n      for (int r = 0; r < {m}; ++r) {{"
    );
    let scale = match g.norm {
        Some(_) if g.staged => " * inv[r]",
        Some(eps) if direct_norm => {
            let _ = writeln!(
                s,
                "      const float inv = rsqrtf(ss[r] / {} + {});",
                super::literal(k as f64, DType::F32),
                super::literal(eps, DType::F32)
            );
            " * inv"
        }
        _ => "",
    };
    match &g.combine {
        None => {
            let _ = writeln!(
                s,
                "      {c} v = {};",
                rounded(adt, &format!("acc0[r]{scale}"))
            );
            for (i, prod) in g.products.iter().enumerate() {
                let _ = writeln!(
                    s,
                    "      {}if (p == {i}) {{",
                    if i == 0 { "" } else { "else " }
                );
                prod.epilogue
                    .code_tagged(&mut s, adt, "r", "c", prod.n, &i.to_string())?;
                let _ = writeln!(
                    s,
                    "      out{i}[r * {}LL + c] = {};\n      }}",
                    prod.n,
                    store(adt, "v")
                );
            }
        }
        Some(steps) => {
            // Each product's epilogue in its own scope, then the region over them.
            for (i, prod) in g.products.iter().enumerate() {
                let _ = writeln!(
                    s,
                    "      {c} r{i};\n      {{\n      {c} v = {};",
                    rounded(adt, &format!("acc{i}[r]{scale}"))
                );
                prod.epilogue
                    .code_tagged(&mut s, adt, "r", "c", prod.n, &i.to_string())?;
                let _ = writeln!(s, "      r{i} = v;\n      }}");
            }
            let last = region_steps(&mut s, steps, count, adt)?;
            let _ = writeln!(s, "      out0[r * {total}LL + c] = {};", store(adt, &last));
        }
    }
    s.push_str("      }\n    }\n  }\n}\n");
    Ok(Kernel {
        source: s,
        grid: Grid::Blocks {
            count: g.blocks(),
            threads: GEMV_THREADS,
        },
        check: None,
    })
}
