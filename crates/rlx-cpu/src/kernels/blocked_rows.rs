//! Slices, constant pads and resamples over the planes of channel-blocked `f32`
//! values ([`crate::layout`]).
//!
//! A blocked `[n, c, h, w]` value is, in memory, each image's blocks of 16
//! channels, each an `[h, w, 16]` plane, then a last block of 8 as an `[h, w, 8]`
//! one. So every run of equal-width blocks is a plain `[blocks, h, w, lanes]`
//! tensor, and an op that moves only the plane's axes runs on it as the plain
//! row kernels do, with the channel axis as the blocks and the lanes as a last
//! axis: whole vectors move where the plain layout moves single values.
//!
//! A resampling also runs from a plain value too small to be blocked (a pooled
//! `[n, c, 1, 1]` branch upsampled to the plane) into a blocked one, value by
//! value ([`interpolate_into_blocked`]).

use super::{Ctx, layout, resample};
use crate::layout::{BLOCK, Blocks, HALF, MIN_PIXELS};
use crate::tensor::{Dst, Src};
use rlx_ir::{DType, Error, Op, PadMode, Result, Shape, SliceAxis};

/// Whether `op` runs on blocked operands by [`run`]: a slice or constant pad of
/// the plane's axes only, or a resampling along one of them (`i64` indices),
/// from a blocked `f32` value into a blocked one; a resampling also from a plain
/// value of fewer than [`MIN_PIXELS`] pixels.
pub(crate) fn accepts(op: &Op, inputs: &[Shape], blocked_in: bool, blocked_out: bool) -> bool {
    let x = &inputs[0];
    let tiny = x.rank() == 4 && x.dim(2) * x.dim(3) < MIN_PIXELS;
    let from_plain = !blocked_in && tiny && matches!(op, Op::Interpolate { .. });
    if !((blocked_in || from_plain) && blocked_out && x.dtype() == DType::F32 && x.rank() == 4) {
        return false;
    }
    match op {
        Op::Slice { axes } => axes.len() == 4 && (0..2).all(|a| whole(&axes[a], x.dim(a))),
        Op::Pad {
            pads,
            mode: PadMode::Constant(_),
        } => pads.len() == 4 && pads[0] == (0, 0) && pads[1] == (0, 0),
        Op::Interpolate { axis } => {
            *axis >= 2 && inputs.get(1).is_some_and(|i| i.dtype() == DType::I64)
        }
        _ => false,
    }
}

/// Whether `axis` takes all of an axis of `len` in order.
fn whole(axis: &SliceAxis, len: usize) -> bool {
    axis.start == 0 && axis.step == 1 && axis.len == len
}

/// Runs `op` (one that [`accepts`] takes) from `x` (blocked when `blocked_in`)
/// into blocked `out`; a resampling's indices and weights are `extra`.
pub(crate) fn run(
    op: &Op,
    (x, blocked_in): (Src, bool),
    extra: [Option<Src>; 2],
    out: Dst,
    ctx: &Ctx,
) -> Result<()> {
    if let (Op::Interpolate { axis }, false, [Some(index), Some(weight)]) = (op, blocked_in, extra)
    {
        return interpolate_into_blocked(*axis, x, (index, weight), out);
    }
    for part in parts(x.shape, out.shape) {
        let (x_part, out_part) = (part.shape(x.shape), part.shape(out.shape));
        let xs = Src {
            // SAFETY: the part's first value lies inside `x` ([`parts`]).
            ptr: unsafe { x.ptr.cast::<f32>().add(part.x_at) }.cast(),
            len: x_part.num_elements(),
            shape: &x_part,
        };
        let os = Dst {
            // SAFETY: the part's first value lies inside `out`.
            ptr: unsafe { out.ptr.cast::<f32>().add(part.out_at) }.cast(),
            len: out_part.num_elements(),
            shape: &out_part,
        };
        match op {
            Op::Slice { axes } => {
                let whole = |len: usize| SliceAxis {
                    start: 0,
                    step: 1,
                    len,
                };
                let axes = [whole(part.blocks), axes[2], axes[3], whole(part.lanes)];
                layout::slice(&axes, xs, os, ctx)?;
            }
            Op::Pad { pads, mode } => {
                layout::pad(&[(0, 0), pads[2], pads[3], (0, 0)], *mode, xs, os);
            }
            Op::Interpolate { axis } => {
                let [Some(index), Some(weight)] = extra else {
                    return Err(Error::runtime(
                        "interpolate",
                        "a blocked resampling needs its indices and weights",
                    ));
                };
                resample::interpolate(axis - 1, xs, index, weight, os, ctx)?;
            }
            _ => {
                return Err(Error::runtime(op.name(), "not an op over blocked planes"));
            }
        }
    }
    Ok(())
}

/// A run of blocks of one width: `blocks` of them, `lanes` channels each, from
/// value `x_at` of the input and `out_at` of the output.
struct Part {
    blocks: usize,
    lanes: usize,
    x_at: usize,
    out_at: usize,
}

impl Part {
    /// The run as the plain `[blocks, h, w, lanes]` tensor it is in a value of
    /// shape `full`.
    fn shape(&self, full: &Shape) -> Shape {
        Shape::new(
            &[self.blocks, full.dim(2), full.dim(3), self.lanes],
            full.dtype(),
        )
    }
}

/// The runs of blocks of `x` and `out` (as many channels and images, blocked):
/// all images' whole blocks in one run when every block is whole, else each
/// image's whole blocks and then its last block of 8. Nothing is allocated: a
/// step's run walks them.
fn parts(x: &Shape, out: &Shape) -> impl Iterator<Item = Part> {
    let (n, c) = (x.dim(0), x.dim(1));
    let pixels = |s: &Shape| s.dim(2) * s.dim(3);
    let (x_pixels, out_pixels) = (pixels(x), pixels(out));
    let whole = c / BLOCK;
    let all_whole = c.is_multiple_of(BLOCK);
    // One run of every image's blocks when they are all whole, else a run per image.
    let (runs, blocks) = if all_whole {
        (1, n * whole)
    } else {
        (n, whole)
    };
    let (x_blocks, out_blocks) = (Blocks::new(c, x_pixels), Blocks::new(c, out_pixels));
    (0..runs).flat_map(move |image| {
        let (x_image, out_image) = (image * c * x_pixels, image * c * out_pixels);
        let whole_blocks = (blocks > 0).then_some(Part {
            blocks,
            lanes: BLOCK,
            x_at: x_image,
            out_at: out_image,
        });
        let last_half = (!all_whole).then(|| Part {
            blocks: 1,
            lanes: HALF,
            x_at: x_image + x_blocks.start(whole),
            out_at: out_image + out_blocks.start(whole),
        });
        [whole_blocks, last_half].into_iter().flatten()
    })
}

/// A resampling along `axis` (2 or 3) of plain `x` into blocked `out`, one value
/// at a time, the taps summed in order as the plain kernel sums them.
fn interpolate_into_blocked(
    axis: usize,
    x: Src,
    (index, weight): (Src, Src),
    out: Dst,
) -> Result<()> {
    let (n, c, h, w) = (
        x.shape.dim(0),
        x.shape.dim(1),
        x.shape.dim(2),
        x.shape.dim(3),
    );
    let (oh, ow) = (out.shape.dim(2), out.shape.dim(3));
    let along = x.shape.dim(axis) as i64;
    resample::check_indices(&index, along as usize)?;
    let (taps, width) = (index.shape.dim(0), index.shape.dim(1));
    let (xs, idx, wt) = (
        x.as_slice::<f32>(),
        index.as_slice::<i64>(),
        weight.as_slice::<f32>(),
    );
    // SAFETY: the plan sized the output for its shape; it overlaps no operand.
    let ys = unsafe { std::slice::from_raw_parts_mut(out.ptr.cast::<f32>(), out.len) };
    let blocks = Blocks::new(c, oh * ow);
    for image in 0..n {
        for channel in 0..c {
            let plane = &xs[(image * c + channel) * h * w..][..h * w];
            for oy in 0..oh {
                for ox in 0..ow {
                    let j = if axis == 2 { oy } else { ox };
                    let mut sum = 0.0f32;
                    for t in 0..taps {
                        let k = idx[t * width + j];
                        let at = (if k < 0 { k + along } else { k }) as usize;
                        let (sy, sx) = if axis == 2 { (at, ox) } else { (oy, at) };
                        let term = wt[t * width + j] * plane[sy * w + sx];
                        sum = if t == 0 { term } else { sum + term };
                    }
                    ys[image * c * oh * ow + blocks.index(channel, oy * ow + ox)] = sum;
                }
            }
        }
    }
    Ok(())
}
