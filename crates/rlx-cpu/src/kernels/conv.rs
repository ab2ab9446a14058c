//! 2-D convolution and pooling over NCHW: the direct loops for any dtype (an f32
//! convolution runs as GEMMs, in `conv_f32`), f32 pooling, and the fused
//! convolution's epilogue.

use super::Ctx;
use crate::elem::{Elem, with_dtype};
use crate::tensor::{Dst, Src};
use crate::vmath::multiversion;
use rlx_ir::UnaryOp;
use rlx_ir::scalar::unary_f64;
use rlx_ir::{Result, Shape, Window2d};

/// The dims of an NCHW tensor (the builder checked its rank).
pub(super) fn nchw(s: &Shape) -> [usize; 4] {
    [s.dim(0), s.dim(1), s.dim(2), s.dim(3)]
}

/// Output extent of a window along `axis` over an input of `size` (the builder
/// checked that the window fits).
pub(super) fn extent(win: &Window2d, axis: usize, size: usize) -> usize {
    let padded = size + win.padding[axis] + win.padding[axis + 2];
    let span = win.dilation[axis] * (win.kernel[axis] - 1) + 1;
    padded.saturating_sub(span) / win.stride[axis] + 1
}

/// What a fused convolution does around the product: to each output value after the
/// bias, `post((act(v) + residual) * scale[c] + shift[c])`; to each input value
/// before it (the prologue), `pre(x * in_scale[c] + in_shift[c])`.
#[derive(Clone, Copy, Default)]
pub(crate) struct ConvEpilogue<'a> {
    pub activation: Option<UnaryOp>,
    /// A tensor of the output's shape added next.
    pub residual: Option<Src<'a>>,
    /// `(scale, shift)`, one value per output channel each.
    pub channel_affine: Option<(Src<'a>, Src<'a>)>,
    /// Applied last.
    pub post_activation: Option<UnaryOp>,
    /// `(in_scale, in_shift)`, one value per input channel each.
    pub input_affine: Option<(Src<'a>, Src<'a>)>,
    /// Applied to the input after its affine.
    pub input_activation: Option<UnaryOp>,
}

impl ConvEpilogue<'_> {
    /// Whether it changes the input first.
    pub fn has_prologue(&self) -> bool {
        self.input_affine.is_some() || self.input_activation.is_some()
    }
}

/// Writes `pre(x * in_scale + in_shift)` of `epilogue` into `dst` (`x`'s dtype and
/// length, in bytes), rounding each step to the dtype.
pub(crate) fn apply_prologue(epilogue: &ConvEpilogue, x: Src, dst: &mut [u8]) {
    let (channels, pixels) = (
        x.shape.dim(1).max(1),
        (x.shape.dim(2) * x.shape.dim(3)).max(1),
    );
    with_dtype!(x.shape.dtype(), T => {
        // SAFETY: `dst` holds `x.len` values of `T` (the step's scratch is 8-byte
        // aligned).
        let out = unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<T>(), x.len) };
        for (i, o) in out.iter_mut().enumerate() {
            let c = i / pixels % channels;
            let v = affine_then::<T>(x.f64::<T>(i), epilogue.input_affine, epilogue.input_activation, c);
            *o = T::from_f64(v);
        }
    })
}

/// [`apply_prologue`] for `f32` with an activation the GEMM epilogue has: each
/// channel row copied and changed in place by the epilogue's vectorized row
/// function (the same operations in the same order, so the same values), rows
/// shared between the pool's threads. `false` (nothing written) otherwise.
pub(crate) fn apply_prologue_f32(
    epilogue: &ConvEpilogue,
    x: Src,
    dst: &mut [f32],
    pool: &crate::pool::ThreadPool,
) -> Result<bool> {
    let activation = match epilogue.input_activation {
        None => None,
        Some(op) => match super::fused::gemm_activation(op) {
            Some(a) => Some(a),
            None => return Ok(false),
        },
    };
    if x.shape.dtype() != rlx_ir::DType::F32 || x.shape.rank() != 4 {
        return Ok(false);
    }
    let (channels, pixels) = (x.shape.dim(1), x.shape.dim(2) * x.shape.dim(3));
    let rows = x.shape.dim(0) * channels;
    if rows == 0 || pixels == 0 {
        return Ok(true);
    }
    // SAFETY: f32 tensors of their lengths: the input, and one value per channel.
    let (src, affine) = unsafe {
        (
            std::slice::from_raw_parts(x.ptr.cast::<f32>(), x.len),
            epilogue.input_affine.map(|(s, t)| {
                (
                    std::slice::from_raw_parts(s.ptr.cast::<f32>(), s.len),
                    std::slice::from_raw_parts(t.ptr.cast::<f32>(), t.len),
                )
            }),
        )
    };
    let dst_addr = dst[..rows * pixels].as_mut_ptr() as usize;
    let tasks = rows.min(8 * pool.threads());
    let task = |t: usize, _thread: usize| {
        for r in t * rows / tasks..(t + 1) * rows / tasks {
            // SAFETY: row `r` of `dst`; only this task writes it.
            let out = unsafe {
                std::slice::from_raw_parts_mut((dst_addr as *mut f32).add(r * pixels), pixels)
            };
            out.copy_from_slice(&src[r * pixels..(r + 1) * pixels]);
            let c = r % channels;
            let affine = affine.map(|(s, t)| crate::gemm::RowAffine {
                scale: s[c],
                shift: t[c],
                activation,
            });
            // Without an affine the activation is the only step.
            let first = if affine.is_none() { activation } else { None };
            crate::gemm::activate_and_add(out, 0.0, first, None, affine);
        }
    };
    pool.run(tasks, pool.threads(), &task)?;
    Ok(true)
}

/// `act(v * scale[c] + shift[c])`, each step rounded to `T` as the graph's own
/// multiply, add and activation round: a fused convolution's channel affine (before
/// or after the product) and the activation that follows it.
fn affine_then<T: Elem>(
    mut v: f64,
    affine: Option<(Src, Src)>,
    activation: Option<UnaryOp>,
    c: usize,
) -> f64 {
    if let Some((scale, shift)) = affine {
        v = T::from_f64(v * scale.f64::<T>(c)).to_f64();
        v = T::from_f64(v + shift.f64::<T>(c)).to_f64();
    }
    if let Some(act) = activation {
        v = T::from_f64(unary_f64(act, v)).to_f64();
    }
    v
}

/// Applies `epilogue` to every value of `out` in place (any dtype; the f32 path
/// applies it inside its GEMMs).
pub(crate) fn apply_epilogue(epilogue: ConvEpilogue, out: Dst) {
    let (channels, pixels) = (
        out.shape.dim(1).max(1),
        (out.shape.dim(2) * out.shape.dim(3)).max(1),
    );
    with_dtype!(out.shape.dtype(), T => {
        for i in 0..out.len {
            let mut v = out.get::<T>(i).to_f64();
            if let Some(act) = epilogue.activation {
                v = T::from_f64(unary_f64(act, v)).to_f64();
            }
            if let Some(r) = epilogue.residual {
                v = T::from_f64(v + r.f64::<T>(i)).to_f64();
            }
            let c = i / pixels % channels;
            let v = affine_then::<T>(v, epilogue.channel_affine, epilogue.post_activation, c);
            out.set(i, T::from_f64(v));
        }
    })
}

/// Input coordinate of window tap `k` at output position `o` on `axis`, if inside.
#[inline]
fn tap(win: &Window2d, axis: usize, o: usize, k: usize, size: usize) -> Option<usize> {
    let p = (o * win.stride[axis] + k * win.dilation[axis]) as isize - win.padding[axis] as isize;
    (0..size as isize).contains(&p).then_some(p as usize)
}

pub(crate) fn conv2d(win: &Window2d, groups: usize, x: Src, w: Src, bias: Option<Src>, out: Dst) {
    let [n, c, h, wd] = nchw(x.shape);
    let [o, oh, ow] = [out.shape.dim(1), out.shape.dim(2), out.shape.dim(3)];
    let (cg, og) = (c / groups, o / groups);
    let [kh, kw] = win.kernel;
    with_dtype!(x.shape.dtype(), T => {
        for b in 0..n {
            for oc in 0..o {
                let g = oc / og;
                for y in 0..oh {
                    for xo in 0..ow {
                        let mut acc = bias.map_or(0.0, |bs| bs.f64::<T>(oc));
                        for ic in 0..cg {
                            for ky in 0..kh {
                                let Some(iy) = tap(win, 0, y, ky, h) else { continue };
                                for kx in 0..kw {
                                    let Some(ix) = tap(win, 1, xo, kx, wd) else { continue };
                                    acc += x.f64::<T>(((b * c + g * cg + ic) * h + iy) * wd + ix)
                                        * w.f64::<T>(((oc * cg + ic) * kh + ky) * kw + kx);
                                }
                            }
                        }
                        out.set(((b * o + oc) * oh + y) * ow + xo, T::from_f64(acc));
                    }
                }
            }
        }
    })
}

/// Pooling over f32 planes, threaded over planes. Matches [`pool`]: a window with a
/// NaN gives NaN for max, and the average divides by the window size or by the taps
/// inside the input. Separable: for each output row the window's input rows are first
/// reduced into one row, then that row's windows along it (both contiguous,
/// vectorized passes), and each output inside the input reads its value; one at the
/// edge reduces its taps that are inside.
pub(crate) fn pool_f32(
    win: &Window2d,
    max: bool,
    count_include_pad: bool,
    x: Src,
    out: Dst,
    ctx: &Ctx,
) -> Result<()> {
    let [n, c, h, w] = nchw(x.shape);
    let [oh, ow] = [out.shape.dim(2), out.shape.dim(3)];
    let planes = n * c;
    // SAFETY: f32 tensors of the shapes read above; the output never overlaps the
    // input (the plan does not run pooling in place).
    let xs = unsafe { std::slice::from_raw_parts(x.ptr.cast::<f32>(), x.len) };
    let out_addr = out.ptr as usize;
    let shape = PoolPlane {
        win,
        max,
        count_include_pad,
        in_hw: [h, w],
        out_hw: [oh, ow],
    };
    // Runs of consecutive planes per task, so that each thread reads one long stream
    // the hardware prefetcher follows across planes (one plane a task interleaved the
    // threads' planes, and every task started on lines not yet asked for).
    let threads = ctx.gemm.threads();
    let per_task = planes.div_ceil(threads * PLANE_RUNS_PER_THREAD).max(1);
    let plane_task = |task: usize, thread: usize| {
        // SAFETY: one task per thread index at a time; the step asked for `2 w` floats.
        let (line, across) = unsafe { ctx.gemm.parts(thread) }.1[..2 * w].split_at_mut(w);
        for plane in task * per_task..((task + 1) * per_task).min(planes) {
            let src = &xs[plane * h * w..(plane + 1) * h * w];
            // SAFETY: plane `plane` of the output, written by this task alone.
            let dst = unsafe {
                std::slice::from_raw_parts_mut((out_addr as *mut f32).add(plane * oh * ow), oh * ow)
            };
            pool_plane(&shape, src, dst, line, across);
        }
    };
    ctx.pool
        .run(planes.div_ceil(per_task), threads, &plane_task)
}

/// `Op::TiledMaxPoolGrad` in `f32`: per window, the inputs equal to the pooled value
/// (`y`) each take `g / ties`, the others zero, runs of output rows (across planes)
/// on the threads. (The
/// same arithmetic as the decomposition: a window with no hit, its maximum NaN,
/// gets `0 * (g / 0)`, NaN.)
pub(crate) fn tiled_max_pool_grad_f32(
    [kh, kw]: [usize; 2],
    (x, y, g): (Src, Src, Src),
    out: Dst,
    ctx: &Ctx,
) -> Result<()> {
    let [n, c, h, w] = nchw(x.shape);
    let (oh, ow) = (h / kh, w / kw);
    let planes = n * c;
    if out.len == 0 {
        // No windows (rows of no width would be chunks of no length).
        return Ok(());
    }
    // SAFETY: f32 tensors of the shapes read above (shape inference checked them);
    // the output is written through its own pointer, by runs of output rows.
    let (xs, ys, gs) = unsafe {
        (
            std::slice::from_raw_parts(x.ptr.cast::<f32>(), x.len),
            std::slice::from_raw_parts(y.ptr.cast::<f32>(), y.len),
            std::slice::from_raw_parts(g.ptr.cast::<f32>(), g.len),
        )
    };
    let out_addr = out.ptr as usize;
    // Output rows (of windows) across all planes: row `r` reads input rows `r kh` to
    // `r kh + kh - 1`, so a run of output rows is one contiguous block of the input.
    let (rows, block) = (planes * oh, kh * w);
    let run = |from: usize, to: usize| {
        // SAFETY: output rows `from..to` are written by this call alone (the plan never
        // runs the op in place: the output has the input's size, not its data).
        let dst = unsafe {
            std::slice::from_raw_parts_mut(
                (out_addr as *mut f32).add(from * block),
                (to - from) * block,
            )
        };
        let src = &xs[from * block..to * block];
        let (maxes, grads) = (&ys[from * ow..to * ow], &gs[from * ow..to * ow]);
        // Constant windows let the compiler unroll the taps (2x2 is the usual pool).
        match (kh, kw) {
            (2, 2) => window_grads(2, 2, w, ow, src, dst, (maxes, grads)),
            (3, 3) => window_grads(3, 3, w, ow, src, dst, (maxes, grads)),
            _ => window_grads(kh, kw, w, ow, src, dst, (maxes, grads)),
        }
    };
    let threads = ctx.gemm.threads();
    // Small tensors (under `GRAD_THREADING_FROM` values) stay on the calling thread.
    if threads <= 1 || planes * h * w < GRAD_THREADING_FROM {
        run(0, rows);
        return Ok(());
    }
    let tasks = threads * PLANE_RUNS_PER_THREAD;
    let per_task = rows.div_ceil(tasks).max(1);
    let task = |task: usize, _thread: usize| {
        let from = task * per_task;
        if from < rows {
            run(from, (from + per_task).min(rows))
        }
    };
    ctx.pool.run(rows.div_ceil(per_task), threads, &task)
}

/// The gradients of rows of `kh x kw` windows: `src` and `dst` hold `kh` input rows
/// of `w` values per output row, `maxes` and `grads` `ow` values per output row.
#[inline(always)]
fn window_grads(
    kh: usize,
    kw: usize,
    w: usize,
    ow: usize,
    src: &[f32],
    dst: &mut [f32],
    (maxes, grads): (&[f32], &[f32]),
) {
    let block = kh * w;
    let rows = src.chunks_exact(block).zip(dst.chunks_exact_mut(block));
    for ((src, dst), (maxes, grads)) in rows.zip(maxes.chunks_exact(ow).zip(grads.chunks_exact(ow)))
    {
        for ox in 0..ow {
            let max = maxes[ox];
            let mut ties = 0f32;
            for i in 0..kh {
                for j in 0..kw {
                    ties += if src[i * w + ox * kw + j] == max {
                        1.0
                    } else {
                        0.0
                    };
                }
            }
            let share = grads[ox] / ties;
            for i in 0..kh {
                for j in 0..kw {
                    let at = i * w + ox * kw + j;
                    dst[at] = if src[at] == max { 1.0 } else { 0.0 } * share;
                }
            }
        }
    }
}

/// Values from which a pooling gradient runs on the threads.
const GRAD_THREADING_FROM: usize = 1 << 14;

/// `Op::TiledMaxPoolGrad` in any float type, computed in `f64` and rounded as the
/// decomposition rounds: the share once, then `hit * share` exactly.
pub(crate) fn tiled_max_pool_grad([kh, kw]: [usize; 2], (x, y, g): (Src, Src, Src), out: Dst) {
    let [n, c, h, w] = nchw(x.shape);
    let (oh, ow) = (h / kh, w / kw);
    with_dtype!(x.shape.dtype(), T => {
        for plane in 0..n * c {
            for oy in 0..oh {
                for ox in 0..ow {
                    let o = (plane * oh + oy) * ow + ox;
                    let max = y.f64::<T>(o);
                    let at = |i: usize, j: usize| (plane * h + oy * kh + i) * w + ox * kw + j;
                    let taps = || (0..kh).flat_map(|i| (0..kw).map(move |j| (i, j)));
                    let ties = taps().filter(|&(i, j)| x.f64::<T>(at(i, j)) == max).count();
                    let share = T::from_f64(g.f64::<T>(o) / ties as f64).to_f64();
                    for (i, j) in taps() {
                        let hit = if x.f64::<T>(at(i, j)) == max { 1.0 } else { 0.0 };
                        out.set(at(i, j), T::from_f64(hit * share));
                    }
                }
            }
        }
    })
}

/// Tasks per thread that pooling cuts its planes into (a few, so that a thread slowed
/// by another process leaves work to the others).
const PLANE_RUNS_PER_THREAD: usize = 4;

/// Output rows ahead whose input rows pooling asks for: a plane is too short for the
/// hardware prefetcher to get ahead of the reads, and pooling does little per value.
const POOL_AHEAD: usize = 2;

/// One plane's pooling problem: the window, the kind, and the plane sizes.
#[derive(Clone, Copy)]
struct PoolPlane<'a> {
    win: &'a Window2d,
    max: bool,
    count_include_pad: bool,
    in_hw: [usize; 2],
    out_hw: [usize; 2],
}

multiversion! {
    /// Pools one plane `src` into `dst` (see [`pool_f32`]), with `line` and `across`
    /// one input row each of scratch; compiled per instruction set.
    fn pool_plane(shape: &PoolPlane, src: &[f32], dst: &mut [f32], line: &mut [f32], across: &mut [f32]) {
        let PoolPlane {
            win,
            max,
            count_include_pad,
            in_hw: [h, w],
            out_hw: [oh, ow],
        } = *shape;
        let window_len = (win.kernel[0] * win.kernel[1]) as f32;
        let (dy, dx) = (win.dilation[0], win.dilation[1]);
        let (sy, kh) = (win.stride[0], (win.kernel[0] - 1) * dy + 1);
        for y in 0..oh {
            // The input rows that the output row `POOL_AHEAD` rows on reads first
            // (past the plane's end, the next plane's first rows).
            let newest = (y + POOL_AHEAD) * sy + kh.saturating_sub(sy);
            crate::prefetch::lines(
                src.as_ptr().wrapping_add(newest * w).cast(),
                sy.min(kh) * w * 4,
            );
            let (iy0, ny) = inside_taps(win, 0, y, h);
            if ny == 0 {
                line.fill(if max { f32::NEG_INFINITY } else { 0.0 });
            } else {
                line.copy_from_slice(&src[iy0 * w..(iy0 + 1) * w]);
                for ty in 1..ny {
                    let row = &src[(iy0 + ty * dy) * w..][..w];
                    if max {
                        for (acc, &t) in line.iter_mut().zip(row) {
                            *acc = max_kept(*acc, t);
                        }
                    } else {
                        for (acc, &t) in line.iter_mut().zip(row) {
                            *acc += t;
                        }
                    }
                }
            }
            let kw = win.kernel[1];
            let reach = (kw - 1) * dx;
            let starts = w.saturating_sub(reach);
            let (pl, sx) = (win.padding[1], win.stride[1]);
            let row = &mut dst[y * ow..(y + 1) * ow];
            // Outputs `inner` have their whole window inside the row (`origin - pl <
            // starts`): a strided read of `across`, with no test per output.
            let inner = pl.div_ceil(sx).min(ow)..(starts + pl).div_ceil(sx).min(ow);
            let inner = inner.start..inner.end.max(inner.start);
            let divisor = if max || count_include_pad {
                window_len
            } else {
                (ny * kw).max(1) as f32
            };
            let first = (inner.start * sx).saturating_sub(pl);
            if max && sx == 2 && kw == 3 && dx == 1 && !inner.is_empty() {
                // The usual 3x3 stride-2 max pool: each output from its pair of
                // columns and the next pair's first, with no pass over every column
                // (the same maxima in the same order as below, so the same bits).
                let outputs = &mut row[inner.clone()];
                let n = outputs.len();
                let pairs = line[first..].chunks_exact(2).zip(line[first + 2..].chunks_exact(2));
                for (v, (p, q)) in outputs[..n - 1].iter_mut().zip(pairs) {
                    *v = max_kept(max_kept(p[0], p[1]), q[0]);
                }
                let last = first + 2 * (n - 1);
                outputs[n - 1] = max_kept(max_kept(line[last], line[last + 1]), line[last + 2]);
            } else {
                // The same along the row: `across[i]` reduces the window's taps from
                // input column `i`, for every window that lies inside the row.
                let across = &mut across[..starts];
                across.copy_from_slice(&line[..starts]);
                for tx in 1..kw {
                    let shifted = &line[tx * dx..tx * dx + starts];
                    if max {
                        for (acc, &t) in across.iter_mut().zip(shifted) {
                            *acc = max_kept(*acc, t);
                        }
                    } else {
                        for (acc, &t) in across.iter_mut().zip(shifted) {
                            *acc += t;
                        }
                    }
                }
                if inner.is_empty() {
                    // No window lies inside the row.
                } else if sx == 2 {
                    // Whole pairs with a fixed stride vectorize (as shuffles); the last
                    // output may lack the pair's second value.
                    let outputs = &mut row[inner.clone()];
                    let whole = ((starts - first.min(starts)) / 2).min(outputs.len());
                    for (v, pair) in outputs.iter_mut().zip(across[first..first + 2 * whole].chunks_exact(2)) {
                        *v = pair[0];
                    }
                    if whole < outputs.len() {
                        outputs[whole] = across[first + 2 * whole];
                    }
                } else {
                    for (v, &value) in row[inner.clone()].iter_mut().zip(across[first..].iter().step_by(sx)) {
                        *v = value;
                    }
                }
            }
            if !max {
                for v in &mut row[inner.clone()] {
                    *v /= divisor;
                }
            }
            for xo in (0..inner.start).chain(inner.end..ow) {
                let v = &mut row[xo];
                let (ix0, nx) = inside_taps(win, 1, xo, w);
                let taps = (0..nx).map(|tx| line[ix0 + tx * dx]);
                *v = if max {
                    taps.fold(f32::NEG_INFINITY, max_nan)
                } else {
                    let sum: f32 = taps.sum();
                    if count_include_pad {
                        sum / window_len
                    } else {
                        sum / (ny * nx).max(1) as f32
                    }
                };
            }
        }
    }
}

/// Per-thread floats [`pool_f32`] needs: two input rows.
pub(crate) fn pool_floats(x: &Shape) -> usize {
    2 * x.dim(3)
}

/// [`max_nan`] for a running maximum updated in place: `acc + 0.0` (which only turns
/// -0 into +0) is a new value, so every lane is stored. Where the result could be the
/// reloaded `acc` itself, AVX2 code stored only the lanes `t` won, with masked stores
/// that AMD Zen runs as microcode (max pooling ran 60% slower than baseline SSE code).
#[inline(always)]
pub(crate) fn max_kept(acc: f32, t: f32) -> f32 {
    max_nan(acc + 0.0, t)
}

/// The larger of `acc` and `t`, NaN if either is (compiles to a compare and blend).
#[inline(always)]
fn max_nan(acc: f32, t: f32) -> f32 {
    if t > acc || t.is_nan() { t } else { acc }
}

/// The taps of window `o` along `axis` that fall inside an input of `size`, as a
/// range of input positions with the dilation as step: `(first, count)`.
pub(crate) fn inside_taps(win: &Window2d, axis: usize, o: usize, size: usize) -> (usize, usize) {
    let (k, d) = (win.kernel[axis] as isize, win.dilation[axis] as isize);
    let origin = (o * win.stride[axis]) as isize - win.padding[axis] as isize;
    // Taps t with 0 <= origin + t * d < size.
    let lo = if origin >= 0 {
        0
    } else {
        (-origin + d - 1) / d
    };
    let hi = ((size as isize - 1 - origin).div_euclid(d)).min(k - 1);
    if hi < lo {
        (0, 0)
    } else {
        ((origin + lo * d) as usize, (hi - lo + 1) as usize)
    }
}

pub(crate) fn pool(win: &Window2d, max: bool, count_include_pad: bool, x: Src, out: Dst) {
    let [n, c, h, w] = nchw(x.shape);
    let [oh, ow] = [out.shape.dim(2), out.shape.dim(3)];
    let window_len = win.kernel[0] * win.kernel[1];
    with_dtype!(x.shape.dtype(), T => {
        for plane in 0..n * c {
            for y in 0..oh {
                for xo in 0..ow {
                    let (mut acc, mut count, mut nan) = (if max { f64::NEG_INFINITY } else { 0.0 }, 0usize, false);
                    for ky in 0..win.kernel[0] {
                        let Some(iy) = tap(win, 0, y, ky, h) else { continue };
                        for kx in 0..win.kernel[1] {
                            let Some(ix) = tap(win, 1, xo, kx, w) else { continue };
                            let v = x.f64::<T>((plane * h + iy) * w + ix);
                            nan |= v.is_nan();
                            acc = if max { acc.max(v) } else { acc + v };
                            count += 1;
                        }
                    }
                    let v = if max {
                        if nan { f64::NAN } else { acc }
                    } else {
                        acc / (if count_include_pad { window_len } else { count.max(1) }) as f64
                    };
                    out.set((plane * oh + y) * ow + xo, T::from_f64(v));
                }
            }
        }
    })
}
