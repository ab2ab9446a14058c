//! `f32` depthwise convolutions: one input channel per group (MobileNet's and
//! EfficientNet's 3x3 and 5x5 layers, ConvNeXt's 7x7, any stride, dilation and
//! padding, any channel multiplier). A GEMM has nothing to reuse here (each output
//! channel reads one plane with a handful of weights), so each plane is a stencil:
//! its padded input is staged in the thread's scratch for each output plane, and
//! each output row is a sum of
//! shifted input rows scaled by the tap's weight, vectorized along the row (strided
//! rows are computed at every column and their outputs picked). Pool
//! tasks take runs of output planes; the epilogue (bias, activation, residual, channel
//! affine) runs over the plane while it is in cache.

use super::conv::extent;
use super::conv_pixels_f32::Finish;
use crate::pool::ThreadPool;
use crate::tensor::{Dst, Src};
use crate::vmath::multiversion;
use rlx_ir::{Result, Shape, Window2d};

/// Whether a convolution of `x` by `w` in `groups` groups is depthwise: every group
/// reads one input channel (`w` is `[groups * multiplier, 1, kh, kw]`).
pub(crate) fn applies(groups: usize, x: &Shape, w: &Shape) -> bool {
    groups > 1 && x.rank() == 4 && w.rank() == 4 && w.dim(1) == 1 && x.dim(1) == groups
}

/// The staged plane of one input channel: the padded input, `hp` rows of `wp`,
/// and room for the sums before they are stored (`full` values).
///
/// At unit stride the whole plane is one stencil over the padded plane read as one
/// long row: output `(y, x)` sums the staged values at `y * wp + x` plus each tap's
/// offset, so every tap is one long vectorized loop (the `wp - ow` sums past each
/// row's end are dropped when the rows are stored), however narrow the rows are
/// (a 7 x 7 plane is 7 rows of 7). Strided windows are computed a row at a time at
/// every column and the outputs' columns picked: twice the multiply-adds at stride
/// 2, all vectorized, instead of reading the input two columns apart.
#[derive(Clone, Copy)]
struct Staging {
    hp: usize,
    wp: usize,
    /// Sums computed before the outputs are picked or stored.
    full: usize,
}

impl Staging {
    fn new(win: &Window2d, x: &Shape, ow: usize) -> Staging {
        let [top, left, bottom, _] = win.padding;
        let sx = win.stride[1].max(1);
        let oh = extent(win, 0, x.dim(2));
        let wp_min = left + x.dim(3);
        // Every column a tap reads: the last output's last tap.
        let span_w = (ow.max(1) - 1) * sx + (win.kernel[1] - 1) * win.dilation[1] + 1;
        let wp = span_w.max(wp_min);
        let full = if win.stride == [1, 1] {
            (oh.max(1) - 1) * wp + ow
        } else {
            (ow.max(1) - 1) * sx + 1
        };
        Staging {
            hp: top + x.dim(2) + bottom,
            wp,
            full,
        }
    }

    fn len(&self) -> usize {
        self.hp * self.wp + self.full
    }
}

/// Per-thread floats a depthwise convolution of `x` needs (its staged plane and
/// the sums before they are stored).
pub(crate) fn thread_floats(win: &Window2d, x: &Shape) -> usize {
    let ow = extent(win, 1, x.dim(3));
    Staging::new(win, x, ow).len()
}

multiversion! {
    /// Output rows of one plane: `out[y][..] = Σ taps weight * staged row`, the taps
    /// in row-major order (each multiply-add rounded, the first tap a product).
    /// `staged` is the padded plane followed by room for the sums (`Staging::full`:
    /// the whole plane's at unit stride, one unstrided row's otherwise).
    fn plane(out: &mut [f32], staged: &mut [f32], weights: &[f32], geo: PlaneGeometry) {
        let PlaneGeometry { oh, ow, kh, kw, sy, sx, dy, dx, stage } = geo;
        let (staged, full) = staged.split_at_mut(stage.hp * stage.wp);
        if sx == 1 && sy == 1 {
            let acc = &mut full[..stage.full];
            let width = acc.len();
            for ky in 0..kh {
                for kx in 0..kw {
                    let start = ky * dy * stage.wp + kx * dx;
                    let src = &staged[start..start + width];
                    tap(acc, src, weights[ky * kw + kx], ky == 0 && kx == 0);
                }
            }
            for y in 0..oh {
                out[y * ow..(y + 1) * ow].copy_from_slice(&acc[y * stage.wp..y * stage.wp + ow]);
            }
            return;
        }
        for y in 0..oh {
            let acc: &mut [f32] = if sx == 1 {
                &mut out[y * ow..(y + 1) * ow]
            } else {
                &mut full[..stage.full]
            };
            let width = acc.len();
            for ky in 0..kh {
                let r = y * sy + ky * dy;
                for kx in 0..kw {
                    let start = r * stage.wp + kx * dx;
                    let src = &staged[start..start + width];
                    tap(acc, src, weights[ky * kw + kx], ky == 0 && kx == 0);
                }
            }
            if sx != 1 {
                for (v, &f) in out[y * ow..(y + 1) * ow].iter_mut().zip(full.iter().step_by(sx)) {
                    *v = f;
                }
            }
        }
    }
}

/// Adds `weight * src` into `acc`, or stores it for the first tap (inlined into
/// [`plane`]'s per-instruction-set copies).
#[inline(always)]
fn tap(acc: &mut [f32], src: &[f32], weight: f32, first: bool) {
    if first {
        for (v, &s) in acc.iter_mut().zip(src) {
            *v = weight * s;
        }
    } else {
        for (v, &s) in acc.iter_mut().zip(src) {
            *v += weight * s;
        }
    }
}

/// What [`plane`] needs to know of the window and output.
#[derive(Clone, Copy)]
struct PlaneGeometry {
    oh: usize,
    ow: usize,
    kh: usize,
    kw: usize,
    sy: usize,
    sx: usize,
    dy: usize,
    dx: usize,
    stage: Staging,
}

/// Copies one input plane (`h x w`) into the padded plane `staged`, zero in the
/// padding (only the padding is cleared).
fn stage_plane(
    src: &[f32],
    (h, w): (usize, usize),
    win: &Window2d,
    stage: Staging,
    staged: &mut [f32],
) {
    let [top, left, _, _] = win.padding;
    let wp = stage.wp;
    staged[..top * wp].fill(0.0);
    staged[(top + h) * wp..stage.hp * wp].fill(0.0);
    for (i, row) in src.chunks_exact(w).take(h).enumerate() {
        let dst = &mut staged[(top + i) * wp..(top + i + 1) * wp];
        dst[..left].fill(0.0);
        dst[left..left + w].copy_from_slice(row);
        dst[left + w..].fill(0.0);
    }
}

/// The depthwise convolution: pool tasks take runs of output planes, the finish
/// applied to each plane as it is done.
pub(crate) fn conv2d(
    win: &Window2d,
    [x, w]: [Src; 2],
    finish: Finish,
    out: Dst,
    (gemm, pool): (&crate::gemm::GemmScratch, &ThreadPool),
) -> Result<()> {
    let [n, c, h, wd] = [
        x.shape.dim(0),
        x.shape.dim(1),
        x.shape.dim(2),
        x.shape.dim(3),
    ];
    let [o, oh, ow] = [out.shape.dim(1), out.shape.dim(2), out.shape.dim(3)];
    let pixels = oh * ow;
    if n == 0 || o == 0 || pixels == 0 {
        return Ok(());
    }
    let multiplier = o / c.max(1);
    let taps = win.kernel[0] * win.kernel[1];
    let stage = Staging::new(win, x.shape, ow);
    let geo = PlaneGeometry {
        oh,
        ow,
        kh: win.kernel[0],
        kw: win.kernel[1],
        sy: win.stride[0],
        sx: win.stride[1],
        dy: win.dilation[0],
        dx: win.dilation[1],
        stage,
    };
    // SAFETY: f32 tensors of their lengths; the plan never places the output over
    // an operand.
    let (xs, ws) = unsafe {
        (
            std::slice::from_raw_parts(x.ptr.cast::<f32>(), x.len),
            std::slice::from_raw_parts(w.ptr.cast::<f32>(), w.len),
        )
    };
    let out_addr = out.ptr as usize;
    let residual_addr = finish.residual.map(|r| r.ptr as usize);
    let one_plane = |plane_index: usize, thread: usize| {
        let (image, oc) = (plane_index / o, plane_index % o);
        let ic = oc / multiplier.max(1);
        // SAFETY: one task per thread index at a time.
        let staged = &mut unsafe { gemm.parts(thread) }.1[..stage.len()];
        let src = &xs[(image * c + ic) * h * wd..][..h * wd];
        stage_plane(src, (h, wd), win, stage, &mut staged[..stage.hp * stage.wp]);
        let at = plane_index * pixels;
        // SAFETY: output plane `plane_index` (and the residual's, of the same
        // shape); only this task writes it.
        let (values, residual) = unsafe {
            (
                std::slice::from_raw_parts_mut((out_addr as *mut f32).add(at), pixels),
                residual_addr
                    .map(|a| std::slice::from_raw_parts((a as *const f32).add(at), pixels)),
            )
        };
        plane(values, staged, &ws[oc * taps..(oc + 1) * taps], geo);
        let shift = finish.bias.map_or(0.0, |b| b[oc]);
        let affine = finish
            .affine
            .map(|(s, t, activation)| crate::gemm::RowAffine {
                scale: s[oc],
                shift: t[oc],
                activation,
            });
        if shift != 0.0 || finish.activation.is_some() || residual.is_some() || affine.is_some() {
            crate::gemm::activate_and_add(values, shift, finish.activation, residual, affine);
        }
    };
    let planes = n * o;
    let threads = gemm.threads();
    // About eight tasks per thread, so small planes are not one task each.
    let tasks = planes.min(8 * threads);
    let task = |t: usize, thread: usize| {
        for plane_index in t * planes / tasks..(t + 1) * planes / tasks {
            one_plane(plane_index, thread);
        }
    };
    pool.run(tasks, threads, &task)
}
