//! Causal attention of new queries over a key/value cache ([`Op::CachedAttention`]).
//!
//! One block per (batch, query, head). The block walks the visible keys in chunks:
//! each warp scores keys against the query (held, scaled, in shared memory), the
//! chunk's scores become weights under a running maximum (the online softmax), and
//! each thread accumulates the weighted values of the output element it owns over
//! its share of the keys (the block's threads split the keys when the value rows
//! are shorter than the block; the shares are added at the end). Keys and values
//! are read once per block, coalesced along the head dimension.

use super::{Grid, Kernel, header_with, load, store};
use rlx_ir::{DType, Op, Result, Shape};
use std::fmt::Write;

/// Threads per block.
const THREADS: u32 = 256;
/// Keys scored per pass (their weights sit in shared memory).
const CHUNK: usize = 256;

/// The kernel for `op`, or `None` when it is not one of this module's.
pub(super) fn kernel(
    name: &str,
    op: &Op,
    inputs: &[Shape],
    out: &Shape,
    fail_code: i32,
) -> Result<Option<Kernel>> {
    let Op::CachedAttention { scale } = op else {
        return Ok(None);
    };
    let (q, k, v, pos) = (&inputs[0], &inputs[1], &inputs[2], &inputs[3]);
    let [b, sq, hq, d] = [q.dim(0), q.dim(1), q.dim(2), q.dim(3)];
    let [smax, hkv] = [k.dim(1), k.dim(2)];
    let dv = v.dim(3);
    let group = (hq / hkv.max(1)).max(1);
    let acc = if q.dtype() == DType::F64 {
        "double"
    } else {
        "float"
    };
    let exp = if acc == "double" { "exp" } else { "expf" };
    let per_thread = dv.div_ceil(THREADS as usize).max(1);
    // Threads that share one output element, each taking every `split`-th key.
    let split = if per_thread == 1 && dv > 0 {
        (THREADS as usize / dv.max(1)).max(1)
    } else {
        1
    };
    let mut s = header_with(
        name,
        out.dtype(),
        &[q.dtype(), k.dtype(), v.dtype(), pos.dtype()],
        true,
    );
    // Before waiting for the kernel ahead (which writes the newest row), ask L2 for
    // the cached rows this block reads first: they are the cache of earlier steps,
    // and the rows are clamped to the cache, so a position the kernel ahead has
    // not written yet only changes what is prefetched.
    let row_bytes = |dt: DType, n: usize| n * dt.size_in_bytes();
    let _ = writeln!(
        s,
        "  {{\n    const long long p0 = {pos0}, n = p0 + {sq} < 0 ? 0 : (p0 + {sq} > {cap} ? {cap} : p0 + {sq});\n    const long long kvh = (blockIdx.x % {hq}LL) / {group}LL, bi = blockIdx.x / ({hq}LL * {sq}LL);\n    for (long long jj = threadIdx.x; jj < n; jj += blockDim.x) {{\n      const long long r = (bi * {smax}LL + jj) * {hkv}LL + kvh;\n      for (int o = 0; o < {kb}; o += 128) rlx_prefetch_l2((const char*)(in1 + r * {d}LL) + o);\n      for (int o = 0; o < {vb}; o += 128) rlx_prefetch_l2((const char*)(in2 + r * {dv}LL) + o);\n    }}\n  }}\n  RLX_ENTER();",
        pos0 = load(pos.dtype(), "in3", "0"),
        sq = sq.max(1),
        cap = smax.min(CHUNK),
        hq = hq.max(1),
        kb = row_bytes(k.dtype(), d),
        vb = row_bytes(v.dtype(), dv),
    );
    let _ = writeln!(
        s,
        "  __shared__ {acc} qs[{}]; __shared__ {acc} sc[{CHUNK}]; __shared__ {acc} red[32];",
        d.max(1)
    );
    if split > 1 {
        let _ = writeln!(s, "  __shared__ {acc} part[{}];", split * dv);
    }
    let _ = writeln!(
        s,
        "  const long long pos = {};",
        load(pos.dtype(), "in3", "0")
    );
    let _ = writeln!(
        s,
        "  if (pos < 0 || pos + {sq}LL > {smax}LL) {{ if (blockIdx.x == 0 && threadIdx.x == 0) rlx_fail(err, {fail_code}, pos); return; }}"
    );
    let _ = writeln!(
        s,
        "  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5, warps = blockDim.x >> 5;"
    );
    let _ = writeln!(
        s,
        "  const long long h = blockIdx.x % {hq}LL, qi = (blockIdx.x / {hq}LL) % {sq}LL, bi = blockIdx.x / ({hq}LL * {sq}LL);",
        hq = hq.max(1),
        sq = sq.max(1)
    );
    let _ = writeln!(s, "  const long long kvh = h / {group}LL;");
    let _ = writeln!(
        s,
        "  const long long qrow = ((bi * {sq}LL + qi) * {hq}LL + h) * {d}LL;"
    );
    let _ = writeln!(
        s,
        "  for (int j = tid; j < {d}; j += blockDim.x) qs[j] = ({acc}){} * ({acc}){};",
        load(q.dtype(), "in0", "(qrow + j)"),
        super::literal(scale.get(), DType::F64)
    );
    let _ = writeln!(
        s,
        "  {acc} m = -RLX_INF, l = 0; {acc} o[{per_thread}]; for (int a = 0; a < {per_thread}; ++a) o[a] = 0;"
    );
    let _ = writeln!(s, "  const long long len = pos + qi + 1;");
    s.push_str("  __syncthreads();\n");
    let _ = writeln!(
        s,
        "  for (long long c0 = 0; c0 < len; c0 += {CHUNK}) {{\n    const int cn = (int)(len - c0 < {CHUNK} ? len - c0 : {CHUNK});"
    );
    // Scores: one warp per key, lanes along the head dimension.
    // The key and value loops are unrolled so that several rows' loads are in
    // flight at once: a decode step's short context is a chain of dependent loads
    // otherwise (each warp takes a key, each thread a strip of keys).
    let _ = writeln!(
        s,
        "    #pragma unroll 4\n    for (int jj = warp; jj < cn; jj += warps) {{\n      const long long krow = ((bi * {smax}LL + c0 + jj) * {hkv}LL + kvh) * {d}LL;\n      {acc} t = 0;\n      for (int j = lane; j < {d}; j += 32) t += qs[j] * ({acc}){};\n      t = warp_sum(t);\n      if (lane == 0) sc[jj] = t;\n    }}",
        load(k.dtype(), "in1", "(krow + j)")
    );
    s.push_str("    __syncthreads();\n");
    let _ = writeln!(
        s,
        "    {acc} cm = -RLX_INF; for (int jj = tid; jj < cn; jj += blockDim.x) cm = sc[jj] > cm || sc[jj] != sc[jj] ? sc[jj] : cm;"
    );
    let _ = writeln!(s, "    cm = block_max(cm, red);");
    let _ = writeln!(s, "    const {acc} nm = cm > m || cm != cm ? cm : m;");
    let _ = writeln!(
        s,
        "    const {acc} alpha = m == nm ? ({acc})1 : {exp}(m - nm);"
    );
    let _ = writeln!(
        s,
        "    {acc} cs = 0; for (int jj = tid; jj < cn; jj += blockDim.x) {{ {acc} p = sc[jj] == -RLX_INF ? ({acc})0 : {exp}(sc[jj] - nm); sc[jj] = p; cs += p; }}"
    );
    // block_sum synchronizes, so every weight is written before it is read below.
    let _ = writeln!(s, "    cs = block_sum(cs, red);");
    let _ = writeln!(s, "    l = l * alpha + cs; m = nm;");
    let value = load(
        v.dtype(),
        "in2",
        &format!("(((bi * {smax}LL + c0 + jj) * {hkv}LL + kvh) * {dv}LL + j)"),
    );
    if split > 1 {
        let _ = writeln!(
            s,
            "    if (tid < {all}) {{\n      const int j = tid % {dv}, s0 = tid / {dv};\n      {acc} t = o[0] * alpha;\n      #pragma unroll 8\n      for (int jj = s0; jj < cn; jj += {split}) t += sc[jj] * ({acc}){value};\n      o[0] = t;\n    }}",
            all = split * dv
        );
    } else {
        let _ = writeln!(
            s,
            "    for (int a = 0; a < {per_thread}; ++a) {{\n      const int j = tid + a * blockDim.x; if (j >= {dv}) break;\n      {acc} t = o[a] * alpha;\n      #pragma unroll 8\n      for (int jj = 0; jj < cn; ++jj) t += sc[jj] * ({acc}){value};\n      o[a] = t;\n    }}"
        );
    }
    s.push_str("    __syncthreads();\n  }\n");
    let _ = writeln!(
        s,
        "  const long long orow = ((bi * {sq}LL + qi) * {hq}LL + h) * {dv}LL;"
    );
    if split > 1 {
        // The shares of each element meet in shared memory, added in share order.
        let _ = writeln!(
            s,
            "  if (tid < {all}) part[tid] = o[0];\n  __syncthreads();\n  if (tid < {dv}) {{ {acc} t = 0; for (int s0 = 0; s0 < {split}; ++s0) t += part[s0 * {dv} + tid]; out[orow + tid] = {}; }}",
            store(out.dtype(), "(l > 0 ? t / l : 0)"),
            all = split * dv
        );
    } else {
        let _ = writeln!(
            s,
            "  for (int a = 0; a < {per_thread}; ++a) {{ const int j = tid + a * blockDim.x; if (j < {dv}) out[orow + j] = {}; }}",
            store(out.dtype(), "(l > 0 ? o[a] / l : 0)")
        );
    }
    s.push_str("}\n");
    Ok(Some(Kernel {
        source: s,
        grid: Grid::Blocks {
            count: b * sq * hq,
            threads: THREADS,
        },
        check: Some(format!(
            "cached_attention: position {{value}} + {sq} new queries does not fit a cache of {smax} rows"
        )),
    }))
}
