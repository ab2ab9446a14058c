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
use super::rope_write::{self, RopeWrites};
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
    /// Rotations and cache writes of the outputs, done in the same kernel.
    pub tail: Option<GroupTail>,
}

/// Rotations and cache writes of a group's outputs (a decode step's q and k
/// rotated, k and v written into their caches) done by the group's kernel: each
/// output is cut into segments (a head: a rotation's last dim, a written row's), and
/// the warp that finishes a segment's last output does the segment's share, reading
/// the outputs the other warps wrote. A launch and a trip through memory fewer than
/// [`rope_write::kernel`] after the group.
#[derive(Clone, Debug)]
pub(crate) struct GroupTail {
    /// The rotations and writes; a rotation's input, and an operand written, is a
    /// product's output.
    pub spec: RopeWrites,
    /// For each product, what reads its output: a rotation (`Ok`, its index) or a
    /// write (`Err`, its index); `None` when neither does.
    pub reader: Vec<Option<std::result::Result<usize, usize>>>,
    /// The code a position that does not fit is reported as.
    pub code: i32,
}

impl GroupTail {
    /// Product `p`'s segment length in outputs, when a job reads it.
    fn segment(&self, p: usize) -> Option<usize> {
        Some(match self.reader.get(p).copied().flatten()? {
            Ok(j) => self.spec.ropes[j].x.dims().last().copied()?,
            Err(w) => self.spec.writes[w].update.dims().last().copied()?,
        })
    }

    /// The segment counters the kernel uses (one per segment of every read product).
    pub fn counters(&self, products: &[GroupProduct]) -> usize {
        products
            .iter()
            .enumerate()
            .filter_map(|(p, prod)| Some(prod.n / self.segment(p)?.max(1)))
            .sum()
    }
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
    if let Some(tail) = &g.tail {
        check_tail(g, tail, adt)?;
    }
    let at = ctype(adt).storage;
    let wt = ctype(wdt).storage;
    let c = ctype(adt).compute;
    let mut s = format!("extern \"C\" __global__ void __launch_bounds__({GEMV_THREADS}) {name}(");
    let outs = if g.combine.is_some() { 1 } else { count };
    // A tail reads the outputs back through other pointers: they are not
    // `__restrict__` then.
    let restrict = if g.tail.is_some() {
        ""
    } else {
        " __restrict__"
    };
    for o in 0..outs {
        let _ = write!(s, "{at}*{restrict} out{o}, ");
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
    if let Some(tail) = &g.tail {
        for param in rope_write::params(&tail.spec, true) {
            let _ = write!(s, ", {param}");
        }
        s.push_str(", unsigned int* __restrict__ tail_count");
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
    s.push_str("      }\n    }\n");
    if let Some(tail) = &g.tail {
        tail_code(&mut s, g, tail, adt)?;
    }
    s.push_str("  }\n}\n");
    Ok(Kernel {
        source: s,
        grid: Grid::Blocks {
            count: g.blocks(),
            threads: GEMV_THREADS,
        },
        check: None,
    })
}

/// Whether `tail` fits `g`: one row, products stored separately, each read by at
/// most one job whose segments tile it, every job reading a product.
fn check_tail(g: &RowGroup, tail: &GroupTail, adt: DType) -> Result<()> {
    let refuse = |why: &str| Err(unsupported(format!("a row group's rotations: {why}")));
    if g.rows != 1 || g.combine.is_some() || tail.reader.len() != g.products.len() {
        return refuse("more than one row, or combined products");
    }
    rope_write::check_rows(&tail.spec)?;
    for (p, prod) in g.products.iter().enumerate() {
        match tail.segment(p) {
            Some(len) if len == 0 || prod.n % len != 0 => {
                return refuse("segments that do not tile an output");
            }
            _ => {}
        }
    }
    let read = |job| tail.reader.contains(&Some(job));
    let ropes_read =
        (0..tail.spec.ropes.len()).all(|j| read(Ok(j)) && tail.spec.ropes[j].x.dtype() == adt);
    let writes_read =
        tail.spec.writes.iter().enumerate().all(|(w, write)| {
            write.from.is_some() || (read(Err(w)) && write.update.dtype() == adt)
        });
    if !ropes_read || !writes_read {
        return refuse("a rotation or write of a value the group does not compute");
    }
    Ok(())
}

/// After output `c` of product `p` is stored: the warp counts it into its segment,
/// and the warp that completes a segment does that segment's rotation or write.
fn tail_code(s: &mut String, g: &RowGroup, tail: &GroupTail, adt: DType) -> Result<()> {
    let at = ctype(adt).storage;
    let jobs = rope_write::jobs(&tail.spec)?;
    s.push_str("    {\n      const int gp = p; const long long gc = c;\n      unsigned int* counter = nullptr; unsigned int len = 0u;\n");
    let mut base = 0usize;
    for (p, prod) in g.products.iter().enumerate() {
        let Some(len) = tail.segment(p) else {
            continue;
        };
        let _ = writeln!(
            s,
            "      if (gp == {p}) {{ counter = tail_count + {base}LL + gc / {len}LL; len = {len}u; }}"
        );
        base += prod.n / len;
    }
    // The store, then the count: a warp that sees the segment complete sees every
    // output of it (fences on both sides, as for split sums).
    s.push_str("      if (counter != nullptr) {\n        unsigned int done = 0u;\n        if (lane == 0) { __threadfence(); done = atomicAdd(counter, 1u) + 1u; }\n        done = __shfl_sync(0xffffffffu, done, 0);\n        if (done == len) {\n          __threadfence();\n          if (lane == 0) *counter = 0u;\n          const long long seg = gc / len;\n");
    for (p, reader) in tail.reader.iter().enumerate() {
        let Some(reader) = reader else {
            continue;
        };
        let Some(job) = jobs.iter().find(|j| j.source == *reader) else {
            // A rotation written straight into a cache has its own job; a write of
            // a rotation has none.
            continue;
        };
        // The segment's items: a rotation's pairs, a write's elements.
        let per = match reader {
            Ok(_) => "(len / 2)",
            Err(_) => "len",
        };
        let alias = match reader {
            Ok(j) => format!("x{j}"),
            Err(w) => format!("upd{w}"),
        };
        let _ = writeln!(
            s,
            "          if (gp == {p}) {{\n          const volatile {at}* {alias} = out{p};"
        );
        rope_write::position_check(s, &tail.spec, tail.code, "lane == 0");
        let _ = writeln!(
            s,
            "          for (long long i = seg * {per} + lane; i < (seg + 1) * {per}; i += 32) {{\n{}          }}\n          }}",
            job.body
        );
    }
    s.push_str("        }\n      }\n    }\n");
    Ok(())
}
