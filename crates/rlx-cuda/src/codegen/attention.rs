//! Causal attention of new queries over a key/value cache ([`Op::CachedAttention`]),
//! split over the keys.
//!
//! A block takes one query row of one batch entry, one query head, and one of up
//! to `splits` equal shares of the visible keys: the shares are cut at run time
//! from the position, one for every two staged chunks of keys (a short context is
//! one block's, as combining shares costs a round trip through memory), and the
//! blocks past them return at once. (The query heads that share a key/value head
//! read its rows from L2 after the first: a block per head keeps a short context
//! spread over as many multiprocessors as there are heads.) It stages its keys and
//! values in shared memory a chunk at a time, every load issued before any store,
//! then scores each key with a thread, turns a chunk's scores into weights under a
//! running maximum (one warp), and accumulates the weighted values with a thread
//! per (value element, every `parts`-th key), the parts added in order at the end.
//! With several splits each block leaves its running maximum, sum and weighted
//! values in the workspace, and the last block of a (row, head) to finish, counted on its counter, combines them in split
//! order, so the result does not depend on which block finished when.
//!
//! A decode step's short context is a chain of dependent loads: this keeps the
//! chain to the staging load (whose rows the block asked L2 for before waiting for
//! the kernel ahead), plus the workspace's round trip when split. A long context
//! is spread over `splits` blocks a row instead of walked by one.

use super::{Grid, Kernel, load, store, unsupported};
use rlx_ir::{DType, Op, Result, Shape};
use std::fmt::Write;

/// Threads per block.
const THREADS: usize = 256;
/// Shared memory a block may stage into.
const SHARED_BYTES: usize = 48 << 10;
/// The most keys staged at once.
const MOST_KEYS: usize = 128;
/// Keys a split should have at the least (of a full cache).
const KEYS_PER_SPLIT: usize = 16;
/// Staged chunks of keys a share takes at the least (at run time).
const CHUNKS_PER_SHARE: usize = 2;

/// The geometry of one cached attention.
struct Geometry {
    b: usize,
    sq: usize,
    hq: usize,
    hkv: usize,
    group: usize,
    d: usize,
    dv: usize,
    smax: usize,
}

impl Geometry {
    fn of(inputs: &[Shape]) -> Result<Geometry> {
        let [q, k, v] = [&inputs[0], &inputs[1], &inputs[2]];
        if q.rank() != 4 || k.rank() != 4 || v.rank() != 4 {
            return Err(unsupported(
                "cached attention of other than 4-D tensors".into(),
            ));
        }
        let (hq, hkv) = (q.dim(2), k.dim(2));
        if hkv == 0 || hq % hkv != 0 {
            return Err(unsupported(format!(
                "cached attention of {hq} query heads over {hkv} key/value heads"
            )));
        }
        Ok(Geometry {
            b: q.dim(0),
            sq: q.dim(1),
            hq,
            hkv,
            group: hq / hkv,
            d: q.dim(3),
            dv: v.dim(3),
            smax: k.dim(1),
        })
    }

    /// Blocks that each take all the keys: one per (batch entry, query row, head).
    fn rows(&self) -> usize {
        self.b * self.sq * self.hq
    }
}

/// How many blocks may share one (batch entry, query row, head)'s keys: about
/// `target_blocks` blocks in all, each with at least [`KEYS_PER_SPLIT`] keys of a
/// full cache, and one when a counter each would not fit in `counters`.
pub(crate) fn splits(inputs: &[Shape], target_blocks: usize, counters: usize) -> usize {
    let Ok(g) = Geometry::of(inputs) else {
        return 1;
    };
    let rows = g.rows().max(1);
    if rows > counters {
        return 1;
    }
    (target_blocks / rows).clamp(1, g.smax.div_ceil(KEYS_PER_SPLIT).max(1))
}

/// Workspace bytes the kernel with `splits` splits needs (after the counters).
pub(crate) fn workspace_bytes(inputs: &[Shape], splits: usize) -> usize {
    match Geometry::of(inputs) {
        Ok(g) if splits > 1 => {
            let acc = if inputs[0].dtype() == DType::F64 {
                8
            } else {
                4
            };
            g.rows() * splits * (g.dv + 2) * acc
        }
        _ => 0,
    }
}

/// The kernel for `op` with up to `splits` blocks a row (1: no workspace), or
/// `None` when `op` is not one of this module's. Operands: `out`, `q`, the key and
/// value caches, the position, the error words, then with splits the workspace's
/// data and its counters (each back to zero when the kernel ends).
pub(crate) fn kernel(
    name: &str,
    op: &Op,
    inputs: &[Shape],
    out: &Shape,
    fail_code: i32,
    splits: usize,
) -> Result<Option<Kernel>> {
    let Op::CachedAttention { scale } = op else {
        return Ok(None);
    };
    let g = Geometry::of(inputs)?;
    let (q, k, v, pos) = (&inputs[0], &inputs[1], &inputs[2], &inputs[3]);
    let Geometry {
        sq,
        hq,
        hkv,
        group,
        d,
        dv,
        smax,
        ..
    } = g;
    let splits = splits.max(1);
    let double = q.dtype() == DType::F64;
    let (acc, exp, size) = if double {
        ("double", "exp", 8)
    } else {
        ("float", "expf", 4)
    };
    // Scores read 16 bytes of the query and a key at a time where the rows allow
    // (rows padded by 4 then, which keeps 8 threads' reads in distinct banks).
    let vector = !double && d % 4 == 0;
    let kstride = if vector { d + 4 } else { d + 1 };
    // Threads per value element, each taking every `parts`-th key.
    let parts = (THREADS / dv.max(1)).max(1);
    let per_thread = dv.div_ceil(THREADS).max(1);
    // Shared memory: the scaled query, a chunk of keys and values, its scores, the
    // running maximum, sum and rescale, and the parts' sums.
    let fixed = d + 3 + parts * dv.min(THREADS);
    let per_key = kstride + dv + 1;
    let room = (SHARED_BYTES / size).saturating_sub(fixed) / per_key;
    let chunk = if room >= MOST_KEYS {
        MOST_KEYS
    } else if room >= 1 {
        1 << room.ilog2()
    } else {
        return Err(unsupported(format!(
            "cached attention of heads of {d} and {dv}: past shared memory"
        )));
    };
    let chunk = chunk.min(smax.next_power_of_two().max(1));
    let staged_k = (chunk * d).div_ceil(THREADS);
    let staged_v = (chunk * dv).div_ceil(THREADS);

    let at = |dt: DType| super::ctype(dt).storage;
    let mut s = format!(
        "extern \"C\" __global__ void __launch_bounds__({THREADS}) {name}({}* __restrict__ out, const {}* __restrict__ in0, const {}* __restrict__ in1, const {}* __restrict__ in2, const {}* __restrict__ in3, long long* __restrict__ err",
        at(out.dtype()),
        at(q.dtype()),
        at(k.dtype()),
        at(v.dtype()),
        at(pos.dtype())
    );
    if splits > 1 {
        let _ = write!(
            s,
            ", {acc}* __restrict__ ws, unsigned int* __restrict__ count"
        );
    }
    s.push_str(") {\n");
    let _ = writeln!(
        s,
        "  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;\n  const long long split = blockIdx.x % {splits}LL, row = blockIdx.x / {splits}LL;\n  const long long h = row % {hq}LL, kvh = h / {group}LL, qi = (row / {hq}LL) % {sq}LL, bi = row / ({hq}LL * {sq}LL);"
    );
    // The block's share of the keys of query row `qi` at position `p`: `shares`
    // blocks of the row take keys, each at least two chunks' worth.
    let least = CHUNKS_PER_SHARE * chunk;
    let share = |s: &mut String, p: &str| {
        let _ = writeln!(
            s,
            "    const long long len = {p} + qi + 1 < 0 ? 0 : ({p} + qi + 1 > {smax}LL ? {smax}LL : {p} + qi + 1);\n    const long long wanted = (len + {least}LL - 1) / {least}LL;\n    const long long shares = wanted < 1 ? 1 : (wanted > {splits}LL ? {splits}LL : wanted);\n    const long long per = (len + shares - 1) / shares;\n    const long long k0 = split * per < len ? split * per : len, k1 = k0 + per < len ? k0 + per : len;"
        );
    };
    // Before waiting for the kernel ahead (which writes the newest row), ask L2 for
    // the cached rows of this block's share: they are the cache of earlier steps,
    // and the range is clamped to the cache, so a position the kernel ahead has
    // not written yet only changes what is prefetched.
    let pos0 = load(pos.dtype(), "in3", "0");
    s.push_str("  {\n");
    share(&mut s, &format!("({pos0})"));
    let _ = writeln!(
        s,
        "    for (long long j = k0 + tid; j < k1; j += {THREADS}) {{\n      const long long r = (bi * {smax}LL + j) * {hkv}LL + kvh;\n      for (int o = 0; o < {kb}; o += 128) rlx_prefetch_l2((const char*)(in1 + r * {d}LL) + o);\n      for (int o = 0; o < {vb}; o += 128) rlx_prefetch_l2((const char*)(in2 + r * {dv}LL) + o);\n    }}\n  }}\n  RLX_ENTER();",
        kb = d * k.dtype().size_in_bytes(),
        vb = dv * v.dtype().size_in_bytes(),
    );
    let _ = writeln!(
        s,
        "  const long long pos = {pos0};\n  if (pos < 0 || pos + {sq}LL > {smax}LL) {{ if (blockIdx.x == 0 && tid == 0) rlx_fail(err, {fail_code}, pos); return; }}"
    );
    share(&mut s, "pos");
    s.push_str("  if (split >= shares) return;\n");
    let _ = writeln!(
        s,
        "  __shared__ __align__(16) {acc} qs[{d}];\n  __shared__ __align__(16) {acc} ks[{kn}];\n  __shared__ {acc} vs[{vn}];\n  __shared__ {acc} sc[{chunk}];\n  __shared__ {acc} rm, rl, ra;",
        kn = chunk * kstride,
        vn = chunk * dv,
    );
    let _ = writeln!(
        s,
        "  const long long qrow = ((bi * {sq}LL + qi) * {hq}LL + h) * {d}LL;\n  for (int i = tid; i < {d}; i += {THREADS}) qs[i] = ({acc}){} * ({acc}){};\n  if (tid == 0) {{ rm = -RLX_INF; rl = 0; }}\n  {acc} o[{per_thread}];\n  #pragma unroll\n  for (int a = 0; a < {per_thread}; ++a) o[a] = 0;",
        load(q.dtype(), "in0", "qrow + i"),
        super::literal(scale.get(), DType::F64),
    );
    let _ = writeln!(
        s,
        "  for (long long c0 = k0; c0 < k1; c0 += {chunk}) {{\n    const int cn = (int)(k1 - c0 < {chunk} ? k1 - c0 : {chunk});\n    __syncthreads();"
    );
    // Staging: each thread's loads first, then its stores.
    for (tag, input, dt, width, count, stride) in [
        ("k", "in1", k.dtype(), d, staged_k, kstride),
        ("v", "in2", v.dtype(), dv, staged_v, dv),
    ] {
        let _ = writeln!(
            s,
            "    {{\n      {acc} t[{count}];\n      #pragma unroll\n      for (int u = 0; u < {count}; ++u) {{\n        const int i = tid + u * {THREADS}, j = i / {width}, e = i % {width};\n        t[u] = i < cn * {width} ? ({acc}){} : ({acc})0;\n      }}\n      #pragma unroll\n      for (int u = 0; u < {count}; ++u) {{\n        const int i = tid + u * {THREADS}, j = i / {width}, e = i % {width};\n        if (i < cn * {width}) {tag}s[j * {stride} + e] = t[u];\n      }}\n    }}",
            load(
                dt,
                input,
                &format!("((bi * {smax}LL + c0 + j) * {hkv}LL + kvh) * {width}LL + e")
            ),
        );
    }
    s.push_str("    __syncthreads();\n");
    // Scores: a thread per key.
    let dot = if vector {
        format!(
            "#pragma unroll 4\n        for (int e = 0; e < {d}; e += 4) {{ const float4 x = *reinterpret_cast<const float4*>(qs + e), y = *reinterpret_cast<const float4*>(ks + j * {kstride} + e); t = fmaf(x.x, y.x, fmaf(x.y, y.y, fmaf(x.z, y.z, fmaf(x.w, y.w, t)))); }}"
        )
    } else {
        format!(
            "#pragma unroll 8\n        for (int e = 0; e < {d}; ++e) t += qs[e] * ks[j * {kstride} + e];"
        )
    };
    let _ = writeln!(
        s,
        "    for (int j = tid; j < cn; j += {THREADS}) {{\n      {acc} t = 0;\n      {dot}\n      sc[j] = t;\n    }}\n    __syncthreads();"
    );
    // Weights under the running maximum: one warp.
    let _ = writeln!(
        s,
        "    if (warp == 0) {{\n      {acc} cm = -RLX_INF;\n      for (int j = lane; j < cn; j += 32) cm = sc[j] > cm || sc[j] != sc[j] ? sc[j] : cm;\n      cm = warp_max(cm);\n      const {acc} mo = rm, nm = cm > mo || cm != cm ? cm : mo;\n      const {acc} alpha = mo == nm ? ({acc})1 : {exp}(mo - nm);\n      {acc} cs = 0;\n      for (int j = lane; j < cn; j += 32) {{ const {acc} x = sc[j]; const {acc} p = x == -RLX_INF ? ({acc})0 : {exp}(x - nm); sc[j] = p; cs += p; }}\n      cs = warp_sum(cs);\n      if (lane == 0) {{ rl = rl * alpha + cs; rm = nm; ra = alpha; }}\n    }}\n    __syncthreads();"
    );
    // Values: a thread per (element, every `parts`-th key), or per element when
    // the row is wider than the block.
    if parts > 1 {
        let _ = writeln!(
            s,
            "    if (tid < {busy}) {{\n      const int e = tid % {dv}, part = tid / {dv};\n      {acc} t = o[0] * ra;\n      #pragma unroll 4\n      for (int j = part; j < cn; j += {parts}) t += sc[j] * vs[j * {dv} + e];\n      o[0] = t;\n    }}\n  }}\n  __syncthreads();",
            busy = parts * dv,
        );
        // The parts' sums added in part order.
        let _ = writeln!(
            s,
            "  __shared__ {acc} po[{busy}];\n  if (tid < {busy}) po[tid] = o[0];\n  __syncthreads();\n  if (tid < {dv}) {{ {acc} t = 0; for (int p = 0; p < {parts}; ++p) t += po[p * {dv} + tid]; o[0] = t; }}",
            busy = parts * dv,
        );
    } else {
        let _ = writeln!(
            s,
            "    #pragma unroll\n    for (int a = 0; a < {per_thread}; ++a) {{\n      const int e = tid + a * {THREADS};\n      if (e < {dv}) {{\n        {acc} t = o[a] * ra;\n        #pragma unroll 4\n        for (int j = 0; j < cn; ++j) t += sc[j] * vs[j * {dv} + e];\n        o[a] = t;\n      }}\n    }}\n  }}\n  __syncthreads();"
        );
    }
    let orow = format!("((bi * {sq}LL + qi) * {hq}LL + h) * {dv}LL");
    // One share: the block's sums are the row's.
    let _ = writeln!(
        s,
        "  if (shares == 1) {{\n    #pragma unroll\n    for (int a = 0; a < {per_thread}; ++a) {{\n      const int e = tid + a * {THREADS};\n      if (e < {dv}) out[{orow} + e] = {};\n    }}\n    return;\n  }}",
        store(out.dtype(), "(rl > 0 ? o[a] / rl : 0)"),
    );
    if splits > 1 {
        // The block's maximum, sum and weighted values into the workspace; the last
        // block of the row combines every share's in share order.
        let blocks = g.rows() * splits;
        let _ = writeln!(
            s,
            "  {acc}* wo = ws + blockIdx.x * {dv}LL;\n  {acc}* wm = ws + {blocks}LL * {dv}LL;\n  {acc}* wl = wm + {blocks}LL;\n  #pragma unroll\n  for (int a = 0; a < {per_thread}; ++a) {{ const int e = tid + a * {THREADS}; if (e < {dv}) wo[e] = o[a]; }}\n  if (tid == 0) {{ wm[blockIdx.x] = rm; wl[blockIdx.x] = rl; }}\n  __threadfence();\n  __syncthreads();\n  __shared__ unsigned int last;\n  if (tid == 0) last = atomicAdd(&count[row], 1u) == (unsigned int)shares - 1u;\n  __syncthreads();\n  if (!last) return;\n  __threadfence();\n  #pragma unroll\n  for (int a = 0; a < {per_thread}; ++a) {{\n    const int e = tid + a * {THREADS};\n    if (e < {dv}) {{\n      {acc} m = -RLX_INF;\n      for (int p = 0; p < shares; ++p) {{ const {acc} x = __ldcg(&wm[row * {splits}LL + p]); m = x > m || x != x ? x : m; }}\n      {acc} l = 0, t = 0;\n      for (int p = 0; p < shares; ++p) {{\n        const long long blk = row * {splits}LL + p;\n        const {acc} x = __ldcg(&wm[blk]);\n        const {acc} w = x == -RLX_INF ? ({acc})0 : {exp}(x - m);\n        l += __ldcg(&wl[blk]) * w;\n        t += __ldcg(&wo[(p - split) * {dv}LL + e]) * w;\n      }}\n      out[{orow} + e] = {};\n    }}\n  }}\n  if (tid == 0) count[row] = 0u;",
            store(out.dtype(), "(l > 0 ? t / l : 0)"),
        );
    }
    s.push_str("}\n");
    Ok(Some(Kernel {
        source: s,
        grid: Grid::Blocks {
            count: g.rows() * splits,
            threads: THREADS as u32,
        },
        check: Some(format!(
            "cached_attention: position {{value}} + {sq} new queries does not fit a cache of {smax} rows"
        )),
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn shapes(b: usize, sq: usize, hq: usize, hkv: usize, smax: usize) -> Vec<Shape> {
        vec![
            Shape::new(&[b, sq, hq, 64], DType::F32),
            Shape::new(&[b, smax, hkv, 64], DType::F32),
            Shape::new(&[b, smax, hkv, 64], DType::F32),
            Shape::new(&[1], DType::I64),
        ]
    }

    #[test]
    fn keys_are_split_to_fill_the_card_with_at_least_16_a_split() {
        // A ~1B Llama's decode step: 32 heads, a 64-row cache.
        let decode = shapes(1, 1, 32, 8, 64);
        assert_eq!(splits(&decode, 264, 16384), 4);
        assert_eq!(workspace_bytes(&decode, 4), 32 * 4 * 66 * 4);
        // A long cache: as many as the target allows.
        assert_eq!(splits(&shapes(1, 1, 32, 8, 4096), 264, 16384), 8);
        // A prompt's many rows fill the card alone; more rows than counters: one.
        assert_eq!(splits(&shapes(1, 128, 32, 8, 4096), 264, 16384), 1);
        assert_eq!(splits(&shapes(4, 1, 8, 8, 4096), 264, 31), 1);
        assert_eq!(workspace_bytes(&decode, 1), 0);
    }
}
