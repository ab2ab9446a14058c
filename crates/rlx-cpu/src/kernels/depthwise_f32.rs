//! `f32` depthwise convolutions: one input channel per group (MobileNet's and
//! EfficientNet's 3x3 and 5x5 layers, ConvNeXt's 7x7, any stride, dilation and
//! padding, any channel multiplier). A GEMM has nothing to reuse here (each output
//! channel reads one plane with a handful of weights), so each plane is a stencil:
//! its padded input is staged once per thread with the columns split by stride
//! phase (so that every tap reads a contiguous run), and each output row is a sum of
//! shifted input rows scaled by the tap's weight, vectorized along the row. Pool
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

/// The staged plane of one input channel: `sx` phase planes of `hp` rows by `wq`
/// columns, phase `q` holding the padded input's columns `q, q + sx, ..`.
#[derive(Clone, Copy)]
struct Staging {
    hp: usize,
    wq: usize,
    sx: usize,
}

impl Staging {
    fn new(win: &Window2d, x: &Shape, ow: usize) -> Staging {
        let [top, left, bottom, _] = win.padding;
        let sx = win.stride[1].max(1);
        // Every column a tap reads: the last output's last tap.
        let span_w = (ow.max(1) - 1) * sx + (win.kernel[1] - 1) * win.dilation[1] + 1;
        let wp = span_w.max(left + x.dim(3));
        Staging {
            hp: top + x.dim(2) + bottom,
            wq: wp.div_ceil(sx),
            sx,
        }
    }

    fn len(&self) -> usize {
        self.sx * self.hp * self.wq
    }
}

/// Per-thread floats a depthwise convolution of `x` needs (its staged plane).
pub(crate) fn thread_floats(win: &Window2d, x: &Shape) -> usize {
    let ow = extent(win, 1, x.dim(3));
    Staging::new(win, x, ow).len()
}

multiversion! {
    /// Output rows of one plane: `out[y][..] = Σ taps weight * staged row`, the taps
    /// in row-major order (each multiply-add rounded, the first tap a product).
    fn plane(out: &mut [f32], staged: &[f32], weights: &[f32], geo: PlaneGeometry) {
        let PlaneGeometry { oh, ow, kh, kw, sy, dy, dx, stage } = geo;
        for y in 0..oh {
            let row = &mut out[y * ow..(y + 1) * ow];
            for ky in 0..kh {
                let r = y * sy + ky * dy;
                for kx in 0..kw {
                    let c = kx * dx;
                    let (q, off) = (c % stage.sx, c / stage.sx);
                    let start = (q * stage.hp + r) * stage.wq + off;
                    let src = &staged[start..start + ow];
                    let wt = weights[ky * kw + kx];
                    if ky == 0 && kx == 0 {
                        for (v, &s) in row.iter_mut().zip(src) {
                            *v = wt * s;
                        }
                    } else {
                        for (v, &s) in row.iter_mut().zip(src) {
                            *v += wt * s;
                        }
                    }
                }
            }
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
    dy: usize,
    dx: usize,
    stage: Staging,
}

/// Copies one input plane (`h x w`) into `staged`, zero where the padding is.
fn stage_plane(
    src: &[f32],
    (h, w): (usize, usize),
    win: &Window2d,
    stage: Staging,
    staged: &mut [f32],
) {
    let [top, left, _, _] = win.padding;
    staged.fill(0.0);
    let sx = stage.sx;
    for (i, row) in src.chunks_exact(w).take(h).enumerate() {
        let r = top + i;
        if sx == 1 {
            let at = r * stage.wq + left;
            staged[at..at + w].copy_from_slice(row);
            continue;
        }
        // Phase `q` takes the padded columns `c ≡ q (mod sx)`: input columns from
        // the first such `c` at or after `left`, every `sx`-th one.
        for q in 0..sx {
            let first = left + (q + sx - left % sx) % sx;
            if first >= left + w {
                continue;
            }
            let at = (q * stage.hp + r) * stage.wq + first / sx;
            let values = row[first - left..].iter().step_by(sx);
            for (d, &v) in staged[at..].iter_mut().zip(values) {
                *d = v;
            }
        }
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
        stage_plane(src, (h, wd), win, stage, staged);
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
