//! Fused `f32` attention: one pool task per (batch, head, block of queries). Scores are
//! computed for one block of keys at a time with the GEMM micro-kernels, masked, and
//! folded into the output with an online softmax (running maximum and sum), so the
//! full `Sq x Sk` score matrix never exists.

use super::Ctx;
use crate::elem::Bool8;
use crate::elem::{Elem, with_dtype};
use crate::gemm::{BFormat, Epilogue, Gemm, sgemm_serial};
use crate::tensor::{Dst, Src, broadcast_strides};
use crate::vmath;
use crate::vmath::multiversion;
use rlx_ir::{DType, Error, MAX_RANK, Result, Shape};

/// Queries per task (64 measured best: 32 repeats key packing, 128 overflows L2).
const QB: usize = 64;
/// Keys per score block (512 rather than 256: Whisper's 1500-key attention 3.5%
/// faster, paired; shorter sequences fit one block either way).
const KB: usize = 512;

/// Per-thread scratch floats the kernel needs for value width `dv`.
pub(crate) fn scratch_floats(dv: usize) -> usize {
    QB * KB + QB * dv + 2 * QB
}

/// The most floats of keys (all heads', packed) the step's scratch holds for
/// [`packed_keys_f64`]: 4 Mi, 16 MiB.
const PACKED_KEYS_MAX: usize = 1 << 22;

/// Floats a key block of `kb` keys over a depth of `d` takes packed: whole panels.
fn packed_block_len(kb: usize, d: usize) -> usize {
    crate::gemm::packed_len(d, kb)
}

/// Floats one head's keys (`sk` of depth `d`) take packed, block by block.
fn packed_head_len(sk: usize, d: usize) -> usize {
    let last = sk % KB;
    sk / KB * packed_block_len(KB, d)
        + if last > 0 {
            packed_block_len(last, d)
        } else {
            0
        }
}

/// `f64` scratch for the keys packed once per step into the score products' panels
/// (`q` and `k` the queries' and keys' shapes, `[b, heads, positions, d]`, or `[b,
/// positions, heads, d]` when `seq_major`): every task then reads them as they are,
/// where each packed (transposed) every block of keys again (Whisper's 1500 keys: 24
/// times each). None for two blocks of queries or fewer (no step packs them then),
/// and at most [`PACKED_KEYS_MAX`] floats: a step whose keys take more reads K
/// itself. The size never falls as the shapes grow, so a plan made for the largest
/// shapes holds every smaller run's.
pub(crate) fn packed_keys_f64(q: &Shape, k: &Shape, seq_major: bool) -> usize {
    if k.rank() != 4 || q.rank() != 4 || k.dtype() != DType::F32 {
        return 0;
    }
    let axes = |s: &Shape| {
        if seq_major {
            (s.dim(2), s.dim(1))
        } else {
            (s.dim(1), s.dim(2))
        }
    };
    let ((_, queries), (heads, keys)) = (axes(q), axes(k));
    if queries <= 2 * QB {
        return 0;
    }
    let floats = k
        .dim(0)
        .saturating_mul(heads)
        .saturating_mul(packed_head_len(keys, k.dim(3)));
    floats.min(PACKED_KEYS_MAX).div_ceil(2)
}

/// The operands, shared by every task.
struct Problem<'a> {
    scale: f32,
    causal: bool,
    q: Src<'a>,
    k: Src<'a>,
    v: Src<'a>,
    mask: Option<(Src<'a>, [isize; MAX_RANK])>,
    out: Dst<'a>,
    dims: [usize; 7], // b, hq, hkv, sq, sk, d, dv
    /// Rows stored per key/value head (`sk`, or the cache length).
    stored: usize,
    seq_major: bool,
    /// The keys packed into panels, head by head and block by block, when the step
    /// made that copy.
    keys_packed: Option<*const f32>,
}

impl Problem<'_> {
    /// Offset of row (batch, head, position) and the stride between positions, for a
    /// tensor with `heads` heads, `len` positions and rows of `width`.
    fn row(
        &self,
        bi: usize,
        h: usize,
        i: usize,
        heads: usize,
        len: usize,
        width: usize,
    ) -> (usize, usize) {
        if self.seq_major {
            (((bi * len + i) * heads + h) * width, heads * width)
        } else {
            (((bi * heads + h) * len + i) * width, width)
        }
    }
}

// SAFETY: tasks only read q, k, v and the mask, and write disjoint rows of `out`.
unsafe impl Sync for Problem<'_> {}

/// `softmax(q k^T * scale + mask) v` for `f32` operands (see `Graph::attention`).
#[allow(clippy::too_many_arguments)]
pub(crate) fn attention(
    scale: f64,
    causal: bool,
    seq_major: bool,
    q: Src,
    k: Src,
    v: Src,
    mask: Option<Src>,
    valid_keys: Option<usize>,
    out: Dst,
    ctx: &mut Ctx,
) -> Result<()> {
    let (hd, sd) = if seq_major { (2, 1) } else { (1, 2) };
    let [b, hq, sq, d] = [
        q.shape.dim(0),
        q.shape.dim(hd),
        q.shape.dim(sd),
        q.shape.dim(3),
    ];
    let (hkv, stored, dv) = (k.shape.dim(hd), k.shape.dim(sd), v.shape.dim(3));
    // With a cache, only the first `valid_keys` stored rows are keys.
    let sk = valid_keys.unwrap_or(stored).min(stored);
    let full = [b, hq, sq, sk];
    let mut p = Problem {
        scale: scale as f32,
        causal,
        q,
        k,
        v,
        mask: mask.map(|m| (m, broadcast_strides(m.shape.dims(), &full))),
        out,
        dims: [b, hq, hkv, sq, sk, d, dv],
        stored,
        seq_major,
        keys_packed: None,
    };
    // The keys packed once, head by head and block by block, where the scratch
    // holds them and three or more blocks of queries read each head's keys (with
    // two, BERT's 128 queries, the separate pass cost about what it saved).
    let floats = b * hkv * packed_head_len(sk, d);
    if sq > 2 * QB && sk > 0 && d > 0 && ctx.scratch.len() * 2 >= floats {
        // SAFETY: f64 scratch, aligned for f32, holding `floats` f32 values.
        let packed = unsafe {
            std::slice::from_raw_parts_mut(ctx.scratch.as_mut_ptr().cast::<f32>(), floats)
        };
        pack_keys(&p, packed, ctx)?;
        p.keys_packed = Some(packed.as_ptr());
    }
    let blocks = sq.div_ceil(QB);
    let tasks = b * hq * blocks;
    let task = |t: usize, thread: usize| {
        // SAFETY: each thread index runs one task at a time and owns its scratch.
        let (gemm_buf, extra) = unsafe { ctx.gemm.parts(thread) };
        // SAFETY: the task writes only its own rows of `out`.
        unsafe { one_block(&p, t / blocks, (t % blocks) * QB, gemm_buf, extra) };
    };
    ctx.pool.run(tasks, ctx.gemm.threads(), &task)
}

/// Causal attention of new queries over a sequence-major key/value cache
/// (`Op::CachedAttention`): the queries start at the position held by `pos`.
pub(crate) fn cached_attention(
    scale: f64,
    [q, k, v]: [Src; 3],
    pos: Src,
    out: Dst,
    ctx: &mut Ctx,
) -> Result<()> {
    if [q.shape, k.shape, v.shape, out.shape]
        .iter()
        .any(|s| s.dtype() != DType::F32)
    {
        return Err(Error::runtime(
            "cached_attention",
            "the CPU runs cached attention on f32 queries and caches only",
        ));
    }
    let p = with_dtype!(pos.shape.dtype(), I => pos.get::<I>(0).to_i64());
    let (sq, stored) = (q.shape.dim(1), k.shape.dim(1));
    if p < 0 || p as usize + sq > stored {
        return Err(Error::runtime(
            "cached_attention",
            format!("position {p} + {sq} queries does not fit a cache of {stored} rows"),
        ));
    }
    let keys = p as usize + sq;
    if sq <= FEW_QUERIES && keys <= FEW_QUERIES_MAX_KEYS {
        return few_queries(scale as f32, [q, k, v], p as usize, out, ctx);
    }
    attention(scale, true, true, q, k, v, None, Some(keys), out, ctx)
}

/// Up to this many new queries (token-by-token decoding) take [`few_queries`].
const FEW_QUERIES: usize = 4;

/// The most keys [`few_queries`] takes: a row of their scores lies in the
/// scratch's room for a score block (`QB * KB` floats, at least this many); longer
/// caches take the blocked kernel, as they did with blocks of 256 keys.
const FEW_QUERIES_MAX_KEYS: usize = 16 * 1024;
const _: () = assert!(FEW_QUERIES_MAX_KEYS <= QB * KB);

/// Cached attention for a few queries: per (query row, head), scores by direct dot
/// products with the cached keys, a softmax, and a weighted sum of cached values.
/// No packing: every key and value row is read once per query head.
fn few_queries(scale: f32, [q, k, v]: [Src; 3], pos: usize, out: Dst, ctx: &Ctx) -> Result<()> {
    let [b, sq, hq, d] = [
        q.shape.dim(0),
        q.shape.dim(1),
        q.shape.dim(2),
        q.shape.dim(3),
    ];
    let (stored, hkv, dv) = (k.shape.dim(1), k.shape.dim(2), v.shape.dim(3));
    let group = hq / hkv;
    let (qp, kp, vp, op) = (
        q.ptr.cast::<f32>() as usize,
        k.ptr.cast::<f32>() as usize,
        v.ptr.cast::<f32>() as usize,
        out.ptr.cast::<f32>() as usize,
    );
    let task = |t: usize, thread: usize| {
        let (bi, i, h) = (t / (sq * hq), t / hq % sq, t % hq);
        let kh = h / group;
        let len = pos + i + 1;
        // SAFETY: each thread index runs one task at a time and owns its scratch.
        let (_, extra) = unsafe { ctx.gemm.parts(thread) };
        let scores = &mut extra[..len];
        // SAFETY: row (bi, i, h) of q, rows 0..len of key head kh of the caches, and
        // row (bi, i, h) of the output (written by this task only) lie inside their
        // tensors, whose sizes the plan fixed.
        unsafe {
            let q_row =
                std::slice::from_raw_parts((qp as *const f32).add(((bi * sq + i) * hq + h) * d), d);
            let keys = Rows {
                k: (kp as *const f32).add((bi * stored * hkv + kh) * d),
                k_stride: hkv * d,
                v: (vp as *const f32).add((bi * stored * hkv + kh) * dv),
                v_stride: hkv * dv,
            };
            let o_row = std::slice::from_raw_parts_mut(
                (op as *mut f32).add(((bi * sq + i) * hq + h) * dv),
                dv,
            );
            decode_row(scale, q_row, &keys, scores, o_row);
        }
    };
    ctx.pool.run(b * sq * hq, ctx.gemm.threads(), &task)
}

/// Where the cached key and value rows of one head start, and their strides.
struct Rows {
    k: *const f32,
    k_stride: usize,
    v: *const f32,
    v_stride: usize,
}

multiversion! {
    /// One query row: `softmax(scale * q . k_j) . v_j` over the rows `0..scores.len()`
    /// of `rows` (which must hold that many key and value rows).
    fn decode_row(scale: f32, q: &[f32], rows: &Rows, scores: &mut [f32], out: &mut [f32]) {
        let d = q.len();
        let mut max = f32::NEG_INFINITY;
        for (j, s) in scores.iter_mut().enumerate() {
            // SAFETY: the caller passes rows that lie inside the cache.
            let k = unsafe { std::slice::from_raw_parts(rows.k.add(j * rows.k_stride), d) };
            let mut lanes = [0f32; 16];
            for (cq, ck) in q.chunks_exact(16).zip(k.chunks_exact(16)) {
                for l in 0..16 {
                    lanes[l] += cq[l] * ck[l];
                }
            }
            let tail = d / 16 * 16;
            let mut dot: f32 = q[tail..].iter().zip(&k[tail..]).map(|(a, b)| a * b).sum();
            for l in lanes {
                dot += l;
            }
            *s = dot * scale;
            max = max.max(*s);
        }
        let total = vmath::exp_shifted_sum(scores, max);
        let inv = if total > 0.0 { 1.0 / total } else { 0.0 };
        out.fill(0.0);
        for (j, &w) in scores.iter().enumerate() {
            // SAFETY: as above.
            let v = unsafe { std::slice::from_raw_parts(rows.v.add(j * rows.v_stride), out.len()) };
            let w = w * inv;
            for (o, &x) in out.iter_mut().zip(v) {
                *o += w * x;
            }
        }
    }
}

/// Packs the keys of every (batch, key head) into `packed`, one head a task: each
/// block of [`KB`] keys as the score product's `B` (the keys transposed) in its
/// kernel's panels.
fn pack_keys(p: &Problem, packed: &mut [f32], ctx: &Ctx) -> Result<()> {
    let [b, _, hkv, _, sk, d, _] = p.dims;
    let (k_addr, out) = (p.k.ptr as usize, packed.as_mut_ptr() as usize);
    let head_len = packed_head_len(sk, d);
    let task = |head: usize, _: usize| {
        let (bi, kh) = (head / hkv, head % hkv);
        // SAFETY: this head's part of the copy, written by this task alone.
        let dst = unsafe {
            std::slice::from_raw_parts_mut((out as *mut f32).add(head * head_len), head_len)
        };
        let mut at = 0;
        for j0 in (0..sk).step_by(KB) {
            let kb = KB.min(sk - j0);
            let len = packed_block_len(kb, d);
            let (k_at, k_stride) = p.row(bi, kh, j0, hkv, p.stored, d);
            // SAFETY: keys j0..j0 + kb of this key head, rows of `d` values
            // `k_stride` apart; the block's part of the copy holds its panels.
            unsafe {
                crate::gemm::pack_transposed_b_panels(
                    (k_addr as *const f32).add(k_at),
                    k_stride,
                    (d, kb),
                    &mut dst[at..at + len],
                )
            };
            at += len;
        }
    };
    ctx.pool.run(b * hkv, ctx.gemm.threads(), &task)
}

/// Attention for rows `q0 .. q0 + QB` of head `bh` (= batch * hq + head).
///
/// # Safety
/// `extra` holds `scratch_floats(dv)` floats; no other task writes these output rows.
unsafe fn one_block(p: &Problem, bh: usize, q0: usize, gemm_buf: &mut [f32], extra: &mut [f32]) {
    let [_, hq, hkv, sq, sk, d, dv] = p.dims;
    let (bi, h) = (bh / hq, bh % hq);
    let kh = h / (hq / hkv);
    let rows = QB.min(sq - q0);
    let (scores, rest) = extra.split_at_mut(QB * KB);
    let (acc, rest) = rest.split_at_mut(QB * dv);
    let (row_max, rest) = rest.split_at_mut(QB);
    let row_sum = &mut rest[..QB];
    row_max.fill(f32::NEG_INFINITY);
    row_sum.fill(0.0);
    let q_ptr = p.q.ptr.cast::<f32>();
    let k_ptr = p.k.ptr.cast::<f32>();
    let v_ptr = p.v.ptr.cast::<f32>();
    // With a causal mask, query i sees key j when j + sq <= i + sk: the block's last
    // query sees the keys below `q0 + rows + sk - sq`, and none of its queries any
    // key past them, so the score and value products stop there.
    let keys = if p.causal {
        (q0 + rows + sk).saturating_sub(sq).min(sk)
    } else {
        sk
    };
    if keys == 0 {
        // No key block runs (no keys, or all masked): the output rows are zeros.
        acc[..rows * dv].fill(0.0);
    }
    let mut j0 = 0;
    while j0 < keys {
        let kb = KB.min(keys - j0);
        let (q_at, q_stride) = p.row(bi, h, q0, hq, sq, d);
        // The keys `j0..` of this key head: their block of the packed copy, or rows
        // of K read transposed (packed per call). A block the causal mask cuts short
        // (the copy's panels are those of the whole block) reads K itself.
        let whole_block = kb == KB.min(sk - j0);
        let (keys, ldb, b_transposed, b_format) = match p.keys_packed {
            Some(packed) if whole_block => {
                // Blocks before this one are whole: KB keys each.
                let at =
                    (bi * hkv + kh) * packed_head_len(sk, d) + j0 / KB * packed_block_len(KB, d);
                let nr = crate::gemm::packed_panel_width(kb);
                // SAFETY: block j0 / KB of head (bi, kh) of the copy.
                let format = BFormat::Packed {
                    nr,
                    streamed: false,
                };
                (unsafe { packed.add(at) }, kb, false, format)
            }
            _ => {
                let (k_at, k_stride) = p.row(bi, kh, j0, hkv, p.stored, d);
                // SAFETY: keys j0.. of this key head of K.
                (unsafe { k_ptr.add(k_at) }, k_stride, true, BFormat::F32)
            }
        };
        let scores_gemm = Gemm {
            m: rows,
            n: kb,
            k: d,
            // SAFETY: rows q0.. of this head of Q.
            a: unsafe { q_ptr.add(q_at) },
            lda: q_stride,
            b: keys,
            ldb,
            a_transposed: false,
            b_transposed,
            b_format,
            c: scores.as_mut_ptr(),
            ldc: KB,
            accumulate: false,
            // The scale is applied in the softmax: with the mask, or inside the
            // exponential.
            epilogue: Epilogue::NONE,
        };
        // SAFETY: the operands lie inside Q and K; `scores` holds QB x KB floats.
        unsafe { sgemm_serial(&scores_gemm, gemm_buf) };
        let block = Block {
            bi,
            h,
            q0,
            j0,
            rows,
            kb,
            dv,
        };
        softmax_block(p, &block, scores, row_max, row_sum, acc);
        let (v_at, v_stride) = p.row(bi, kh, j0, hkv, p.stored, dv);
        let values_gemm = Gemm {
            m: rows,
            n: dv,
            k: kb,
            a: scores.as_ptr(),
            lda: KB,
            // SAFETY: keys j0.. of this key head of V.
            b: unsafe { v_ptr.add(v_at) },
            ldb: v_stride,
            a_transposed: false,
            b_transposed: false,
            b_format: BFormat::F32,
            c: acc.as_mut_ptr(),
            ldc: dv,
            // The first block writes the accumulator, later ones add to it.
            accumulate: j0 > 0,
            epilogue: Epilogue::NONE,
        };
        // SAFETY: the operands lie inside the scratch and V.
        unsafe { sgemm_serial(&values_gemm, gemm_buf) };
        j0 += kb;
    }
    let out = p.out.ptr.cast::<f32>();
    for r in 0..rows {
        let o_row = p.row(bi, h, q0 + r, hq, sq, dv).0;
        // SAFETY: this task's rows of the output, which no other task writes.
        let o_row = unsafe { std::slice::from_raw_parts_mut(out.add(o_row), dv) };
        normalize_row(&acc[r * dv..(r + 1) * dv], row_sum[r], o_row);
    }
}

multiversion! {
    /// Writes one accumulated output row divided by its softmax sum (zeros for a row
    /// whose keys were all masked).
    fn normalize_row(acc: &[f32], sum: f32, out: &mut [f32]) {
        let inv = if sum > 0.0 { 1.0 / sum } else { 0.0 };
        for (o, &a) in out.iter_mut().zip(acc) {
            *o = a * inv;
        }
    }
}

/// Where one block of scores sits: batch, head, first query, first key, and sizes.
struct Block {
    bi: usize,
    h: usize,
    q0: usize,
    j0: usize,
    rows: usize,
    kb: usize,
    dv: usize,
}

multiversion! {
    /// Masks one block of scores and folds it into the running softmax: turns the
    /// scores into `e^(s * scale - max)` (the scale applied here, or already with an
    /// explicit mask), updates each row's maximum and sum, and rescales the rows of
    /// the accumulated output when the maximum grows.
    fn softmax_block(
        p: &Problem,
        b: &Block,
        scores: &mut [f32],
        row_max: &mut [f32],
        row_sum: &mut [f32],
        acc: &mut [f32]
    ) {
        let dv = b.dv;
        // Without an explicit mask, the scale is applied inside the exponential (one
        // multiply-add with the shift) instead of in a pass of its own: a positive
        // scale keeps the largest score the largest.
        let scale_in_exp = p.mask.is_none() && p.scale > 0.0 && p.scale.is_finite();
        for r in 0..b.rows {
            let row = &mut scores[r * KB..r * KB + b.kb];
            let scale = if scale_in_exp {
                mask_causal(p, b.q0 + r, b.j0, row);
                p.scale
            } else {
                scale_and_mask_row(p, b.bi, b.h, b.q0 + r, b.j0, row);
                1.0
            };
            let block_max = max16(row) * scale;
            if block_max == f32::NEG_INFINITY {
                row.fill(0.0);
                continue;
            }
            let new_max = row_max[r].max(block_max);
            let correction = if row_max[r] == f32::NEG_INFINITY {
                0.0
            } else {
                vmath::exp(row_max[r] - new_max)
            };
            // The dispatching form: its AVX2 version is written with fused
            // multiply-adds, faster than this function's own vectorization.
            let block_sum = vmath::exp_scaled_shifted_sum(row, scale, new_max);
            row_sum[r] = row_sum[r] * correction + block_sum;
            // The first block's products overwrite the accumulator: nothing to rescale.
            if correction != 1.0 && b.j0 > 0 {
                for x in acc[r * dv..(r + 1) * dv].iter_mut() {
                    *x *= correction;
                }
            }
            row_max[r] = new_max;
        }
    }
}

/// The largest value (NaN ignored, as `f32::max` does), in 16 lanes.
#[inline(always)]
fn max16(v: &[f32]) -> f32 {
    let mut lanes = [f32::NEG_INFINITY; 16];
    let mut chunks = v.chunks_exact(16);
    for c in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l = if x > *l { x } else { *l };
        }
    }
    // No lane is NaN (a lane only takes a value greater than it): folded in
    // halves, as vector shuffles and maxima (a lane at a time, with `f32::max`'s
    // NaN checks, took a tenth of Whisper's attention).
    let mut width = 8;
    while width > 0 {
        for i in 0..width {
            let other = lanes[i + width];
            lanes[i] = if other > lanes[i] { other } else { lanes[i] };
        }
        width /= 2;
    }
    chunks.remainder().iter().copied().fold(lanes[0], f32::max)
}

/// Scales the scores of query `i`, keys `j0..`, and applies the causal and explicit
/// masks to them.
#[inline(always)]
fn scale_and_mask_row(p: &Problem, bi: usize, h: usize, i: usize, j0: usize, row: &mut [f32]) {
    let scale = p.scale;
    if !explicit_mask(p, bi, h, i, j0, row) {
        for s in row.iter_mut() {
            *s *= scale;
        }
    }
    mask_causal(p, i, j0, row);
}

/// Applies the causal mask (if the attention has one) to the scores of query `i`,
/// keys `j0..`.
#[inline(always)]
fn mask_causal(p: &Problem, i: usize, j0: usize, row: &mut [f32]) {
    let [_, _, _, sq, sk, _, _] = p.dims;
    if p.causal {
        // Keys `j0 + j` with `j0 + j + sq > i + sk` are masked: a suffix of the row
        // (one fill, where a per-key test compiled to masked stores).
        let first_masked = (i + sk + 1).saturating_sub(sq + j0).min(row.len());
        row[first_masked..].fill(f32::NEG_INFINITY);
    }
}

/// Applies the explicit mask (if any) to a row of scores, scaling them in the same
/// pass; returns whether the row was scaled.
#[inline(always)]
fn explicit_mask(p: &Problem, bi: usize, h: usize, i: usize, j0: usize, row: &mut [f32]) -> bool {
    let scale = p.scale;
    if let Some((m, st)) = &p.mask {
        let base = bi as isize * st[0] + h as isize * st[1] + i as isize * st[2];
        let start = base + j0 as isize * st[3];
        if st[3] == 1 && start >= 0 && start as usize + row.len() <= m.len {
            // The common case: the mask row is contiguous along the keys.
            let at = start as usize;
            if m.shape.dtype() == DType::Bool {
                let keep = &m.as_slice::<u8>()[at..at + row.len()];
                for (s, &k) in row.iter_mut().zip(keep) {
                    *s = if k == 0 {
                        f32::NEG_INFINITY
                    } else {
                        *s * scale
                    };
                }
            } else {
                let add = &m.as_slice::<f32>()[at..at + row.len()];
                for (s, &a) in row.iter_mut().zip(add) {
                    *s = *s * scale + a;
                }
            }
            return true;
        }
        for (j, s) in row.iter_mut().enumerate() {
            *s *= scale;
            let at = (base + (j0 + j) as isize * st[3]) as usize;
            if m.shape.dtype() == DType::Bool {
                if m.get::<Bool8>(at).0 == 0 {
                    *s = f32::NEG_INFINITY;
                }
            } else {
                *s += m.get::<f32>(at);
            }
        }
        return true;
    }
    false
}
