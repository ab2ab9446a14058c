//! `Op::Interpolate`: each output position along the axis is a weighted sum of a
//! few input positions. With elements after the axis (`inner > 1`, a resize of an
//! image's rows) every output row is a weighted sum of whole input rows, a
//! vectorized loop; along the last axis each output value gathers its taps. Output
//! rows are split between the pool's threads.

use super::Ctx;
use super::layout::index_at;
use crate::elem::{Elem, with_dtype};
use crate::tensor::{Dst, Src};
use rlx_ir::{DType, Error, Result};

/// Output values from which the work is split between threads.
const PARALLEL_VALUES: usize = 1 << 15;

/// Errors naming the first index outside an axis of length `n` (compared as `f64`,
/// so an unsigned index past `i64::MAX` is out of range, not wrapped).
pub(crate) fn check_indices(index: &Src, n: usize) -> Result<()> {
    let n = n as f64;
    for at in 0..index.len {
        let k = with_dtype!(index.shape.dtype(), I => index.get::<I>(at).to_f64());
        if k < -n || k >= n {
            return Err(Error::runtime(
                "interpolate",
                format!("index {k} at position {at} is out of range for an axis of length {n}"),
            ));
        }
    }
    Ok(())
}

/// Geometry of one resampling: `outer` blocks of `n` input rows of `inner` values
/// become blocks of `width` output rows, each from `taps` input rows.
#[derive(Clone, Copy)]
struct Geometry {
    outer: usize,
    n: usize,
    inner: usize,
    width: usize,
    taps: usize,
}

/// Runs `Op::Interpolate` on `axis` (indices checked first; nothing is written when
/// one is out of range).
pub(crate) fn interpolate(
    axis: usize,
    x: Src,
    index: Src,
    weight: Src,
    out: Dst,
    ctx: &Ctx,
) -> Result<()> {
    let dims = x.shape.dims();
    let g = Geometry {
        outer: dims[..axis].iter().product(),
        n: dims[axis],
        inner: dims[axis + 1..].iter().product(),
        width: index.shape.dim(1),
        taps: index.shape.dim(0),
    };
    check_indices(&index, g.n)?;
    if out.len == 0 {
        return Ok(());
    }
    if x.shape.dtype() == DType::F32 && index.shape.dtype() == DType::I64 {
        return interpolate_f32(g, x, index, weight, out, ctx);
    }
    with_dtype!(x.shape.dtype(), T => {
        let position = |at: usize| {
            let k = index_at(&index, at);
            (if k < 0 { k + g.n as i64 } else { k }) as usize
        };
        for o in 0..g.outer {
            for j in 0..g.width {
                for i in 0..g.inner {
                    let term = |k: usize| {
                        let at = k * g.width + j;
                        weight.f64::<T>(at) * x.f64::<T>((o * g.n + position(at)) * g.inner + i)
                    };
                    let first = if g.taps == 0 { 0.0 } else { term(0) };
                    let sum = (1..g.taps).fold(first, |s, k| s + term(k));
                    out.set::<T>((o * g.width + j) * g.inner + i, T::from_f64(sum));
                }
            }
        }
    });
    Ok(())
}

/// The `f32` kernel with `i64` indices: output rows (`inner` values each) in
/// ranges on the threads.
fn interpolate_f32(
    g: Geometry,
    x: Src,
    index: Src,
    weight: Src,
    out: Dst,
    ctx: &Ctx,
) -> Result<()> {
    // SAFETY: the plan sized every operand for its shape; the output is a value of
    // its own (this op never runs in place), so it overlaps no operand.
    let (xs, idx, w) = unsafe {
        (
            std::slice::from_raw_parts(x.ptr.cast::<f32>(), x.len),
            std::slice::from_raw_parts(index.ptr.cast::<i64>(), index.len),
            std::slice::from_raw_parts(weight.ptr.cast::<f32>(), weight.len),
        )
    };
    let rows = g.outer * g.width;
    let out_addr = out.ptr as usize;
    let out_len = out.len;
    let run_rows = |first: usize, last: usize| {
        // SAFETY: each call writes output rows `first..last` only, disjoint from
        // every other call's.
        let dst = unsafe {
            std::slice::from_raw_parts_mut(
                (out_addr as *mut f32).add(first * g.inner),
                (last - first) * g.inner,
            )
        };
        debug_assert!(last * g.inner <= out_len);
        rows_f32(g, xs, idx, w, first, dst);
    };
    let threads = ctx.gemm.threads();
    if threads < 2 || out_len < PARALLEL_VALUES {
        run_rows(0, rows);
        return Ok(());
    }
    let tasks = (4 * threads).min(rows);
    ctx.pool.run(tasks, threads, &|t, _| {
        run_rows(t * rows / tasks, (t + 1) * rows / tasks)
    })
}

/// Output rows `first..` into `dst` (whole rows of `inner` values).
fn rows_f32(g: Geometry, x: &[f32], idx: &[i64], w: &[f32], first: usize, dst: &mut [f32]) {
    let position = |at: usize| {
        let k = idx[at];
        (if k < 0 { k + g.n as i64 } else { k }) as usize
    };
    if g.inner == 1 {
        // Along the last axis: every input row is resampled by the same taps, so each
        // stretch of an output row is a weighted sum of gathers from its input row.
        let mut r = 0;
        while r < dst.len() {
            let (o, j) = ((first + r) / g.width, (first + r) % g.width);
            let len = (g.width - j).min(dst.len() - r);
            let src = &x[o * g.n..(o + 1) * g.n];
            gather_row_f32(src, idx, w, [g.width, j], &mut dst[r..r + len]);
            r += len;
        }
        return;
    }
    for (r, y) in dst.chunks_exact_mut(g.inner).enumerate() {
        let (o, j) = ((first + r) / g.width, (first + r) % g.width);
        if g.taps == 0 {
            y.fill(0.0);
        }
        for k in 0..g.taps {
            let at = k * g.width + j;
            let (wk, p) = (w[at], position(at));
            let start = (o * g.n + p) * g.inner;
            let src = &x[start..start + g.inner];
            if k == 0 {
                for (v, &s) in y.iter_mut().zip(src) {
                    *v = wk * s;
                }
            } else {
                for (v, &s) in y.iter_mut().zip(src) {
                    *v += wk * s;
                }
            }
        }
    }
}

crate::vmath::multiversion! {
    /// `y[i] = sum over taps k of w[k][j + i] * src[idx[k][j + i]]` (a negative
    /// index counting from the row's end), where the taps' indices and weights are
    /// `[taps, width]` and `[width, j]` says where `y` starts in the row (compiled
    /// for each vector width, so the loop gathers).
    fn gather_row_f32(src: &[f32], idx: &[i64], w: &[f32], at: [usize; 2], y: &mut [f32]) {
        let [width, j] = at;
        let taps = idx.len() / width.max(1);
        let len = y.len();
        let n = src.len() as i64;
        if taps == 0 {
            y.fill(0.0);
            return;
        }
        debug_assert!(idx.iter().all(|&k| -n <= k && k < n));
        let position = |k: i64| (if k < 0 { k + n } else { k }) as usize;
        let (i0, w0) = (&idx[j..j + len], &w[j..j + len]);
        // SAFETY (both loops): every index was checked to lie in `-n..n` (indices out
        // of range are rejected before the kernel runs), so every position is in the row.
        for ((v, &k), &wk) in y.iter_mut().zip(i0).zip(w0) {
            *v = wk * unsafe { *src.get_unchecked(position(k)) };
        }
        for t in 1..taps {
            let base = t * width + j;
            let (ik, wk) = (&idx[base..base + len], &w[base..base + len]);
            for ((v, &k), &wt) in y.iter_mut().zip(ik).zip(wk) {
                *v += wt * unsafe { *src.get_unchecked(position(k)) };
            }
        }
    }
}
