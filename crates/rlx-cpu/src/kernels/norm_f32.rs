//! Single-pass-per-row `f32` LayerNorm, RMSNorm and softmax: each row is read once
//! for its statistics and once more (from L1) for the output, with vectorized loops,
//! rows split across the thread pool when there are enough of them.

use super::Ctx;
use crate::tensor::{Dst, Src};
use crate::vmath;
use crate::vmath::multiversion;
use rlx_ir::Result;

/// Rows per pool task.
const ROWS_PER_TASK: usize = 16;

/// Operands shared by the row tasks.
struct Rows<'a> {
    x: Src<'a>,
    gamma: Option<&'a [f32]>,
    beta: Option<&'a [f32]>,
    out: Dst<'a>,
    width: usize,
}

// SAFETY: tasks read `x` and the params and write disjoint rows of `out` (which never
// overlaps `x`: these ops do not run in place).
unsafe impl Sync for Rows<'_> {}

/// LayerNorm (with `beta`) or RMSNorm (without) over the last axis.
pub(crate) fn norm(
    x: Src,
    gamma: Src,
    beta: Option<Src>,
    eps: f64,
    out: Dst,
    ctx: &Ctx,
) -> Result<()> {
    let width = x.shape.dims().last().copied().unwrap_or(1);
    let rows = Rows {
        x,
        gamma: Some(gamma.as_slice::<f32>()),
        beta: beta.map(|b| b.as_slice::<f32>()),
        out,
        width,
    };
    let eps = eps as f32;
    for_rows(&rows, ctx, &|row, dst| match rows.beta {
        Some(beta) => layer_norm_row(row, rows.gamma.unwrap_or(&[]), beta, eps, dst),
        None => rms_norm_row(row, rows.gamma.unwrap_or(&[]), eps, dst),
    })
}

/// Softmax (or log-softmax) over the last axis.
pub(crate) fn softmax_last(log: bool, x: Src, out: Dst, ctx: &Ctx) -> Result<()> {
    let width = x.shape.dims().last().copied().unwrap_or(1);
    let rows = Rows {
        x,
        gamma: None,
        beta: None,
        out,
        width,
    };
    for_rows(&rows, ctx, &|row, dst| softmax_row(log, row, dst))
}

fn for_rows(rows: &Rows, ctx: &Ctx, f: &(dyn Fn(&[f32], &mut [f32]) + Sync)) -> Result<()> {
    let w = rows.width;
    if w == 0 {
        return Ok(());
    }
    let count = rows.x.len / w;
    let tasks = count.div_ceil(ROWS_PER_TASK);
    let threads = if rows.x.len >= 1 << 14 {
        ctx.gemm.threads()
    } else {
        1
    };
    let task = |t: usize, _thread: usize| {
        let first = t * ROWS_PER_TASK;
        let last = (first + ROWS_PER_TASK).min(count);
        // SAFETY: rows first..last of `x` and `out`, both `count * w` floats; each task
        // owns its rows of `out`, which does not overlap `x`.
        let (src, dst) = unsafe {
            (
                std::slice::from_raw_parts(
                    rows.x.ptr.cast::<f32>().add(first * w),
                    (last - first) * w,
                ),
                std::slice::from_raw_parts_mut(
                    rows.out.ptr.cast::<f32>().add(first * w),
                    (last - first) * w,
                ),
            )
        };
        for (row, out) in src.chunks_exact(w).zip(dst.chunks_exact_mut(w)) {
            run_row(f, row, out);
        }
    };
    ctx.pool.run(tasks, threads, &task)
}

fn run_row(f: &(dyn Fn(&[f32], &mut [f32]) + Sync), row: &[f32], out: &mut [f32]) {
    f(row, out)
}

/// Sum of `v` in 16 lanes (vectorizes; also more accurate than one running sum).
#[inline(always)]
fn sum16(v: &[f32], f: impl Fn(f32) -> f32) -> f32 {
    let mut lanes = [0.0f32; 16];
    let mut chunks = v.chunks_exact(16);
    for c in &mut chunks {
        for (l, &x) in lanes.iter_mut().zip(c) {
            *l += f(x);
        }
    }
    let tail: f32 = chunks.remainder().iter().map(|&x| f(x)).sum();
    lanes.iter().sum::<f32>() + tail
}

multiversion! {
    /// One LayerNorm row.
    fn layer_norm_row(x: &[f32], gamma: &[f32], beta: &[f32], eps: f32, out: &mut [f32]) {
        let n = x.len() as f32;
        let mean = sum16(x, |v| v) / n;
        let var = sum16(x, |v| (v - mean) * (v - mean)) / n;
        let inv = 1.0 / (var + eps).sqrt();
        for (((o, &v), &g), &b) in out.iter_mut().zip(x).zip(gamma).zip(beta) {
            *o = (v - mean) * inv * g + b;
        }
    }
}

multiversion! {
    /// One RMSNorm row.
    fn rms_norm_row(x: &[f32], gamma: &[f32], eps: f32, out: &mut [f32]) {
        let n = x.len() as f32;
        let inv = 1.0 / (sum16(x, |v| v * v) / n + eps).sqrt();
        for ((o, &v), &g) in out.iter_mut().zip(x).zip(gamma) {
            *o = v * inv * g;
        }
    }
}

multiversion! {
    /// One softmax (or log-softmax) row.
    fn softmax_row(log: bool, x: &[f32], out: &mut [f32]) {
        let max = x.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if max == f32::NEG_INFINITY {
            // Every entry is -inf (or the row is empty): the reference gives NaN.
            out.iter_mut().for_each(|o| *o = f32::NAN);
            return;
        }
        out.copy_from_slice(x);
        let sum = vmath::exp_shifted_sum(out, max);
        if log {
            let shift = max + sum.ln();
            for (o, &v) in out.iter_mut().zip(x) {
                *o = v - shift;
            }
        } else {
            let inv = 1.0 / sum;
            out.iter_mut().for_each(|o| *o *= inv);
        }
    }
}

/// Sum (or mean) of `f32` values over the consecutive axes `first..=last`: `x` seen
/// as `[outer, len, inner]`, the result `[outer, inner]`. Each output accumulates in
/// `f64`, as the reference does. Row sums (`inner == 1`) split the rows between
/// threads; column sums split blocks of 64 columns.
pub(crate) fn sum_axes(
    mean: bool,
    x: Src,
    (first, last): (usize, usize),
    out: Dst,
    ctx: &Ctx,
) -> Result<()> {
    let dims = x.shape.dims();
    let outer: usize = dims[..first].iter().product();
    let len: usize = dims[first..=last].iter().product();
    let inner: usize = dims[last + 1..].iter().product();
    // A mean over nothing is 0 / 0 = NaN, as in the reference.
    let scale = if mean { 1.0 / len as f64 } else { 1.0 };
    let (src, dst) = (x.ptr.cast::<f32>() as usize, out.ptr.cast::<f32>() as usize);
    let threads = if outer * len * inner >= 1 << 15 {
        ctx.gemm.threads()
    } else {
        1
    };
    if len == 0 {
        // SAFETY: the output is `outer * inner` floats.
        let dst = unsafe { std::slice::from_raw_parts_mut(dst as *mut f32, outer * inner) };
        dst.fill((0.0 * scale) as f32);
        return Ok(());
    }
    if inner == 1 {
        let per_task = (1usize << 14).div_ceil(len).max(1);
        let tasks = outer.div_ceil(per_task);
        let task = |t: usize, _thread: usize| {
            let rows = t * per_task..((t + 1) * per_task).min(outer);
            // SAFETY: rows `rows` of `x` (`outer * len` floats) and of the output
            // (`outer` floats); each task writes its own outputs, and a reduction never
            // runs in place.
            let (src, dst) = unsafe {
                (
                    std::slice::from_raw_parts(
                        (src as *const f32).add(rows.start * len),
                        rows.len() * len,
                    ),
                    std::slice::from_raw_parts_mut((dst as *mut f32).add(rows.start), rows.len()),
                )
            };
            for (d, row) in dst.iter_mut().zip(src.chunks_exact(len)) {
                *d = (sum_row(row) * scale) as f32;
            }
        };
        return ctx.pool.run(tasks, threads, &task);
    }
    let blocks = inner.div_ceil(64);
    // Short columns (a 2x2 window's rows) take many outer rows per task, so that a
    // task is worth its hand-off to a thread.
    let outers_per_task = if blocks == 1 {
        ((1usize << 14) / (len * inner)).max(1)
    } else {
        1
    };
    let tasks = outer.div_ceil(outers_per_task) * blocks;
    let task = |t: usize, _thread: usize| {
        let (group, c0) = (t / blocks, t % blocks * 64);
        let width = 64.min(inner - c0);
        let first = group * outers_per_task;
        for o in first..(first + outers_per_task).min(outer) {
            // SAFETY: output row `o` columns `c0..c0 + width` belong to this task
            // alone; the input is `outer * len * inner` floats.
            let (src, dst) = unsafe {
                (
                    std::slice::from_raw_parts(
                        (src as *const f32).add(o * len * inner),
                        len * inner,
                    ),
                    std::slice::from_raw_parts_mut((dst as *mut f32).add(o * inner + c0), width),
                )
            };
            sum_columns(src, dst, (len, inner, c0), scale);
        }
    };
    ctx.pool.run(tasks, threads, &task)
}

multiversion! {
    /// The `f64` sum of one contiguous row, in eight lanes.
    fn sum_row(row: &[f32]) -> f64 {
        let mut lanes = [0.0f64; 8];
        let chunks = row.chunks_exact(8);
        let tail = chunks.remainder();
        for c in chunks {
            for (l, &v) in lanes.iter_mut().zip(c) {
                *l += f64::from(v);
            }
        }
        let mut total = lanes.iter().sum::<f64>();
        for &v in tail {
            total += f64::from(v);
        }
        total
    }
}

multiversion! {
    /// Sums `len` rows of `inner` floats at columns `c0..c0 + dst.len()`.
    fn sum_columns(src: &[f32], dst: &mut [f32], shape: (usize, usize, usize), scale: f64) {
        let (len, inner, c0) = shape;
        let mut acc = [0.0f64; 64];
        let acc = &mut acc[..dst.len()];
        for k in 0..len {
            let row = &src[k * inner + c0..][..acc.len()];
            for (a, &v) in acc.iter_mut().zip(row) {
                *a += f64::from(v);
            }
        }
        for (d, &a) in dst.iter_mut().zip(acc.iter()) {
            *d = (a * scale) as f32;
        }
    }
}

/// Row blocks (and partial sums) of [`norm_scale_grad`]: a fixed count, so the sums
/// do not depend on the number of threads.
pub(crate) const SCALE_GRAD_PARTS: usize = 8;

/// Operands of the norm-gradient row tasks.
struct GradRows {
    x: usize,
    dy: usize,
    out: usize,
}

/// `Op::NormGrad` in `f32`: per row, the statistics, `Σ gγ` and `Σ gγ x̂`, then the
/// input's gradient, in one pass over the row (a second from L1).
pub(crate) fn norm_grad(
    x: Src,
    gamma: Src,
    dy: Src,
    (eps, centered): (f64, bool),
    out: Dst,
    ctx: &Ctx,
) -> Result<()> {
    let width = x.shape.dims().last().copied().unwrap_or(1);
    if width == 0 || x.len == 0 {
        return Ok(());
    }
    let rows = GradRows {
        x: x.ptr as usize,
        dy: dy.ptr as usize,
        out: out.ptr as usize,
    };
    let gamma = gamma.as_slice::<f32>();
    let count = x.len / width;
    let threads = if x.len >= 1 << 14 {
        ctx.gemm.threads()
    } else {
        1
    };
    let task = |t: usize, _thread: usize| {
        let first = t * ROWS_PER_TASK;
        let last = (first + ROWS_PER_TASK).min(count);
        for r in first..last {
            // SAFETY: row `r` of `x`, `dy` and the output (`count * width` floats each);
            // each task writes only its rows of the output, which never shares bytes
            // with `x` or `dy` (only elementwise ops run in place).
            let (x, dy, out) = unsafe {
                (
                    std::slice::from_raw_parts((rows.x as *const f32).add(r * width), width),
                    std::slice::from_raw_parts((rows.dy as *const f32).add(r * width), width),
                    std::slice::from_raw_parts_mut((rows.out as *mut f32).add(r * width), width),
                )
            };
            norm_grad_row(x, gamma, dy, eps as f32, centered, out);
        }
    };
    ctx.pool.run(count.div_ceil(ROWS_PER_TASK), threads, &task)
}

/// `(Σ a b, Σ a b (c - shift))` in 16 lanes.
#[inline(always)]
fn dot_pair(a: &[f32], b: &[f32], c: &[f32], shift: f32) -> (f32, f32) {
    let (mut plain, mut weighted) = ([0.0f32; 16], [0.0f32; 16]);
    let blocks = a.len() / 16 * 16;
    for ((a, b), c) in a[..blocks]
        .chunks_exact(16)
        .zip(b[..blocks].chunks_exact(16))
        .zip(c[..blocks].chunks_exact(16))
    {
        for l in 0..16 {
            let ab = a[l] * b[l];
            plain[l] += ab;
            weighted[l] += ab * (c[l] - shift);
        }
    }
    let (mut p, mut w) = (plain.iter().sum::<f32>(), weighted.iter().sum::<f32>());
    for j in blocks..a.len() {
        let ab = a[j] * b[j];
        p += ab;
        w += ab * (c[j] - shift);
    }
    (p, w)
}

multiversion! {
    /// One row of a norm's input gradient.
    fn norm_grad_row(x: &[f32], gamma: &[f32], dy: &[f32], eps: f32, centered: bool, out: &mut [f32]) {
        let n = x.len() as f32;
        let mean = if centered { sum16(x, |v| v) / n } else { 0.0 };
        let inv = 1.0 / (sum16(x, |v| (v - mean) * (v - mean)) / n + eps).sqrt();
        let (sum_scaled, sum_dot) = dot_pair(dy, gamma, x, mean);
        let centre = if centered { sum_scaled / n } else { 0.0 };
        // Σ gγ x̂ / n, with x̂ = (x - mean) inv.
        let mean_dot = sum_dot * inv / n;
        for (((o, &v), &g), &s) in out.iter_mut().zip(x).zip(dy).zip(gamma) {
            *o = inv * (g * s - centre - (v - mean) * inv * mean_dot);
        }
    }
}

/// `Op::NormScaleGrad` in `f32`: [`SCALE_GRAD_PARTS`] blocks of rows each sum `g x̂`
/// into their own `f64` partial (in `ctx.scratch`), then the partials are added in
/// order.
pub(crate) fn norm_scale_grad(
    x: Src,
    dy: Src,
    (eps, centered): (f64, bool),
    out: Dst,
    ctx: &mut Ctx,
) -> Result<()> {
    let width = x.shape.dims().last().copied().unwrap_or(1);
    let count = x.len.checked_div(width).unwrap_or(0);
    let partials = &mut ctx.scratch[..SCALE_GRAD_PARTS * width];
    partials.fill(0.0);
    let rows = GradRows {
        x: x.ptr as usize,
        dy: dy.ptr as usize,
        out: partials.as_mut_ptr() as usize,
    };
    let per_part = count.div_ceil(SCALE_GRAD_PARTS);
    let threads = if x.len >= 1 << 14 {
        ctx.gemm.threads()
    } else {
        1
    };
    let task = |t: usize, _thread: usize| {
        // SAFETY: partial `t` (`width` values of the scratch) belongs to this task.
        let acc =
            unsafe { std::slice::from_raw_parts_mut((rows.out as *mut f64).add(t * width), width) };
        for r in t * per_part..((t + 1) * per_part).min(count) {
            // SAFETY: row `r` of `x` and `dy` (`count * width` floats each).
            let (x, dy) = unsafe {
                (
                    std::slice::from_raw_parts((rows.x as *const f32).add(r * width), width),
                    std::slice::from_raw_parts((rows.dy as *const f32).add(r * width), width),
                )
            };
            scale_grad_row(x, dy, eps as f32, centered, acc);
        }
    };
    ctx.pool.run(SCALE_GRAD_PARTS, threads, &task)?;
    let partials = &ctx.scratch[..SCALE_GRAD_PARTS * width];
    for j in 0..width {
        let sum: f64 = (0..SCALE_GRAD_PARTS).map(|t| partials[t * width + j]).sum();
        out.set(j, sum as f32);
    }
    Ok(())
}

multiversion! {
    /// Adds one row's `g x̂` to `acc`.
    fn scale_grad_row(x: &[f32], dy: &[f32], eps: f32, centered: bool, acc: &mut [f64]) {
        let n = x.len() as f32;
        let mean = if centered { sum16(x, |v| v) / n } else { 0.0 };
        let inv = 1.0 / (sum16(x, |v| (v - mean) * (v - mean)) / n + eps).sqrt();
        for ((a, &v), &g) in acc.iter_mut().zip(x).zip(dy) {
            *a += f64::from(g * ((v - mean) * inv));
        }
    }
}
