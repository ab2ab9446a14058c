//! Several matrix-vector products of one input as one kernel (a decode step's
//! q/k/v projections, or its gate and up projections with the SwiGLU product
//! applied): the input is read once per output instead of once per kernel, and the
//! launches between them are gone. Optionally the input is RMS-normalized as it is
//! read, so the norm before the products needs no kernel of its own.
//!
//! The weights are stored `[N, K]`, as for [`super::gemv::gemv_rows`]: a warp owns
//! one output and walks its contiguous row (its rows, when the outputs are
//! combined or taken in pairs), 16 bytes a lane at a time. Each block first copies
//! the input into shared memory, so the walk reads only weights from memory. A folded norm is
//! applied as `inv * (w . (x * gamma))`: the copy scales by `gamma` and sums the
//! squares in one pass, and the reciprocal root scales each finished sum.

use super::fused::{Epilogue, region_steps, rounded};
use super::gemv::{GEMV_THREADS, line_mask, row_chunk};
use super::rope_write::{self, RopeJob, RopeWrites};
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
    /// Whether each warp walks two rows of one product at a time (the pair a
    /// rotation turns together, or two neighbours), so that a [`GroupTail`] can be
    /// done by the warp that computed the values. Not with `combine`.
    pub pairs: bool,
    /// Rotations and cache writes of the outputs, done in the same kernel (needs
    /// `pairs`).
    pub tail: Option<GroupTail>,
}

/// Rotations and cache writes of a group's outputs (a decode step's q and k
/// rotated, k and v written into their caches) done by the group's kernel: each
/// warp computes the two outputs a rotation turns together (or two neighbours that
/// are written or left alone) and does their share of the work straight from its
/// registers. A launch and a trip through memory fewer than [`rope_write::kernel`]
/// after the group, and nothing shared between warps.
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
    /// The rotation that reads product `p`'s output, with its last dim.
    fn rope_of(&self, p: usize) -> Option<(&RopeJob, usize)> {
        match self.reader.get(p).copied().flatten()? {
            Ok(j) => {
                let rope = self.spec.ropes.get(j)?;
                Some((rope, rope.x.dims().last().copied()?))
            }
            Err(_) => None,
        }
    }
}

impl RowGroup {
    /// Tasks a warp takes in turn: every product's outputs when stored separately
    /// (pairs of them with `pairs`), one product's count when combined.
    pub fn walked_outputs(&self) -> usize {
        match self.combine {
            Some(_) => self.products.first().map_or(0, |p| p.n),
            None if self.pairs => self.products.iter().map(|p| p.n.div_ceil(2)).sum(),
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
/// residual its epilogue takes, then the tail's operands. `a`, `gamma` and every
/// weight 16-byte aligned.
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
        && (steps.is_empty() || g.pairs || g.products.iter().any(|p| p.n != g.products[0].n))
    {
        return Err(unsupported(
            "a combined row group of unequal products, or of pairs".into(),
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
    if let Some(tail) = &g.tail {
        for param in rope_write::params(&tail.spec, true) {
            let _ = write!(s, ", {param}");
        }
    }
    s.push_str(") {\n");
    let total = g.walked_outputs();
    let _ = writeln!(
        s,
        "  const long long K = {k}LL;\n  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;"
    );
    // Rows a warp walks at once: every product's when combined, two with pairs.
    // (Splitting a block's warps between the products instead, their results
    // meeting in shared memory, measured slower in `gemv_bench`: 28.5 against
    // 26.5 us for a 2048 x 8192 pair.)
    let walked = match (&g.combine, g.pairs) {
        (Some(_), _) => count,
        (None, true) => 2,
        (None, false) => 1,
    };
    let select = |s: &mut String, col: &str| select_rows(s, g, wt, col);
    // Ask L2 for the first task's rows before waiting for the kernel ahead (the
    // resident blocks' rows fit in L2).
    let _ = writeln!(
        s,
        "  {{\n    const long long first = (long long)blockIdx.x * 8 + warp;\n    if (first < {total}LL && (lane & {mask}) == 0) {{",
        mask = line_mask(wdt)
    );
    select(&mut s, "first");
    let prefetched = if g.combine.is_some() { 1 } else { walked };
    for w in 0..prefetched {
        let _ = writeln!(
            s,
            "    for (long long k = lane * 8; k < K; k += 256) rlx_prefetch_l2(row{w} + k);"
        );
    }
    s.push_str("    }\n  }\n  RLX_ENTER();\n");
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
        None if g.pairs => {
            // Each product's two outputs through its epilogue, kept (as stored) for
            // the tail.
            let _ = writeln!(s, "      {at} sv[2];");
            for (i, prod) in g.products.iter().enumerate() {
                let _ = writeln!(
                    s,
                    "      {}if (p == {i}) {{",
                    if i == 0 { "" } else { "else " }
                );
                for (w, col) in ["ca", "cb"].into_iter().enumerate() {
                    let _ = writeln!(
                        s,
                        "      if ({}) {{\n      const long long c = {col};\n      {c} v = {};",
                        if w == 0 { "true" } else { "hasb" },
                        rounded(adt, &format!("acc{w}[r]{scale}"))
                    );
                    prod.epilogue
                        .code_tagged(&mut s, adt, "r", "c", prod.n, &i.to_string())?;
                    let _ = writeln!(
                        s,
                        "      sv[{w}] = {};\n      out{i}[r * {}LL + c] = sv[{w}];\n      }}",
                        store(adt, "v"),
                        prod.n,
                    );
                }
                s.push_str("      }\n");
            }
            if let Some(tail) = &g.tail {
                tail_code(&mut s, tail, adt)?;
            }
        }
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

/// Statements choosing task `col`'s product and weight rows: `row0` (and `row1`
/// with pairs, `row{i}` for each product when combined), with `c` the output
/// column (`ca`, `cb` and `hasb`, whether the second is real, with pairs) and `p`
/// the product when not combined.
fn select_rows(s: &mut String, g: &RowGroup, wt: &str, col: &str) {
    let count = g.products.len();
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
        start += tasks(g, i - 1);
        let _ = writeln!(
            s,
            "    if ({col} >= {start}LL) {{ p = {i}; c = {col} - {start}LL; }}"
        );
    }
    let mut pick = String::from("b0");
    for i in 1..count {
        pick = format!("(p == {i} ? b{i} : {pick})");
    }
    if !g.pairs {
        let _ = writeln!(s, "    const {wt}* row0 = {pick} + c * K;");
        return;
    }
    // Task `c` of a rotated product is its pair `c` (the rotation's element
    // indices); otherwise the neighbours `2c` and `2c + 1`.
    s.push_str("    long long ca = 2 * c, cb = 2 * c + 1;\n    bool hasb = true;\n");
    for (i, prod) in g.products.iter().enumerate() {
        let rope = g.tail.as_ref().and_then(|t| t.rope_of(i));
        match rope {
            Some((r, d)) => {
                let (ia, ib) = rope_write::pair_elements(r.style, d);
                let _ = writeln!(
                    s,
                    "    if (p == {i}) {{ const long long row = c / {h}LL, k = c % {h}LL; ca = {ia}; cb = {ib}; }}",
                    h = (d / 2).max(1)
                );
            }
            None if prod.n % 2 == 1 => {
                let _ = writeln!(s, "    if (p == {i}) hasb = cb < {}LL;", prod.n);
            }
            None => {}
        }
    }
    let _ = writeln!(
        s,
        "    const {wt}* row0 = {pick} + ca * K;\n    const {wt}* row1 = {pick} + (hasb ? cb : ca) * K;"
    );
}

/// Tasks of product `i`: its outputs, or pairs of them with `pairs`.
fn tasks(g: &RowGroup, i: usize) -> usize {
    let n = g.products[i].n;
    if g.pairs { n.div_ceil(2) } else { n }
}

/// Whether `tail` fits `g`: one row, products stored separately in pairs, each read
/// by at most one job, every job reading a product, a rotated product's rows whole
/// rotations.
fn check_tail(g: &RowGroup, tail: &GroupTail, adt: DType) -> Result<()> {
    let refuse = |why: &str| Err(unsupported(format!("a row group's rotations: {why}")));
    if g.rows != 1 || g.combine.is_some() || !g.pairs || tail.reader.len() != g.products.len() {
        return refuse("more than one row, combined products, or single outputs");
    }
    rope_write::check_rows(&tail.spec)?;
    for (p, prod) in g.products.iter().enumerate() {
        if let Some(Ok(j)) = tail.reader[p] {
            match tail.rope_of(p) {
                Some((_, d)) if d > 0 && d % 2 == 0 && prod.n % d == 0 => {}
                _ => return refuse(&format!("rotation {j} does not tile its product")),
            }
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

/// After a pair's outputs are stored (`sv`, by lane 0): their rotation, or their
/// writes into a cache, from the values in hand.
fn tail_code(s: &mut String, tail: &GroupTail, adt: DType) -> Result<()> {
    let value = |e: usize| load(adt, "sv", &e.to_string());
    for (p, reader) in tail.reader.iter().enumerate() {
        let Some(reader) = *reader else {
            continue;
        };
        // A write of a rotation's result is done by the rotation.
        if let Err(w) = reader
            && tail.spec.writes[w].from.is_some()
        {
            continue;
        }
        let _ = writeln!(s, "      if (p == {p}) {{");
        // The position check shadows `p` (the product) within the branch.
        rope_write::position_check(s, &tail.spec, tail.code, "true");
        match reader {
            Ok(j) => {
                // A rotation's pair `c` is the task's.
                let _ = writeln!(s, "    const long long i = c;");
                rope_write::rope_body(
                    s,
                    j,
                    &tail.spec.ropes[j],
                    &tail.spec,
                    Some((&value(0), &value(1))),
                )?;
            }
            Err(w) => {
                let write = &tail.spec.writes[w];
                for (e, col) in ["ca", "cb"].into_iter().enumerate() {
                    let _ = writeln!(
                        s,
                        "    if ({}) {{\n    const long long i = {col};",
                        if e == 0 { "true" } else { "hasb" }
                    );
                    rope_write::write_body(s, w, write, Some(&value(e)));
                    s.push_str("    }\n");
                }
            }
        }
        s.push_str("      }\n");
    }
    Ok(())
}
