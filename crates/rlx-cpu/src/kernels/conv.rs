//! Direct 2-D convolution and pooling over NCHW.

use crate::elem::{Elem, with_dtype};
use crate::tensor::{Dst, Src};
use rlx_ir::Window2d;

/// Input coordinate of window tap `k` at output position `o` on `axis`, if inside.
#[inline]
fn tap(win: &Window2d, axis: usize, o: usize, k: usize, size: usize) -> Option<usize> {
    let p = (o * win.stride[axis] + k * win.dilation[axis]) as isize - win.padding[axis] as isize;
    (0..size as isize).contains(&p).then_some(p as usize)
}

pub(crate) fn conv2d(win: &Window2d, groups: usize, x: Src, w: Src, bias: Option<Src>, out: Dst) {
    let [n, c, h, wd] = [
        x.shape.dim(0),
        x.shape.dim(1),
        x.shape.dim(2),
        x.shape.dim(3),
    ];
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

pub(crate) fn pool(win: &Window2d, max: bool, count_include_pad: bool, x: Src, out: Dst) {
    let [n, c, h, w] = [
        x.shape.dim(0),
        x.shape.dim(1),
        x.shape.dim(2),
        x.shape.dim(3),
    ];
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
