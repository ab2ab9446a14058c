//! 2-D convolution and pooling over NCHW. An f32 convolution is a GEMM per image and
//! group: the weights `[out channels, in channels x kh x kw]` times the input's
//! patches laid out as columns (`im2col`), into the output's `[channels, pixels]`
//! rows. A 1x1 convolution with unit stride and no padding reads the input in place.
//! Other dtypes take the direct loop.

use super::Ctx;
use crate::elem::{Elem, with_dtype};
use crate::gemm::{BFormat, Epilogue, Gemm, sgemm, sgemm_serial};
use crate::tensor::{Dst, Src};
use rlx_ir::{Result, Shape, Window2d};

/// Floats of patch columns an f32 convolution needs (0 when it reads its input in
/// place), from its input and weight shapes.
pub(crate) fn im2col_floats(win: &Window2d, x: &Shape, w: &Shape) -> usize {
    if reads_in_place(win) {
        return 0;
    }
    // Output extent along an axis (the builder checked the window fits).
    let extent = |axis: usize, size: usize| {
        let padded = size + win.padding[axis] + win.padding[axis + 2];
        let span = win.dilation[axis] * (win.kernel[axis] - 1) + 1;
        padded.saturating_sub(span) / win.stride[axis] + 1
    };
    w.dim(1) * w.dim(2) * w.dim(3) * extent(0, x.dim(2)) * extent(1, x.dim(3))
}

fn reads_in_place(win: &Window2d) -> bool {
    win.kernel == [1, 1] && win.stride == [1, 1] && win.padding == [0; 4]
}

/// Writes the patches of one image's group (`c` channels of `h x w` at `x`) as a
/// `[c * kh * kw, oh * ow]` matrix: row `(ic, ky, kx)` holds the input value each
/// output pixel's tap reads (0 in the padding).
fn im2col(win: &Window2d, x: &[f32], [c, h, w]: [usize; 3], [oh, ow]: [usize; 2], col: &mut [f32]) {
    let [kh, kw] = win.kernel;
    let p = oh * ow;
    for ic in 0..c {
        let plane = &x[ic * h * w..(ic + 1) * h * w];
        for ky in 0..kh {
            for kx in 0..kw {
                let row = &mut col[((ic * kh + ky) * kw + kx) * p..][..p];
                for y in 0..oh {
                    let out = &mut row[y * ow..(y + 1) * ow];
                    let Some(iy) = tap(win, 0, y, ky, h) else {
                        out.fill(0.0);
                        continue;
                    };
                    let src = &plane[iy * w..(iy + 1) * w];
                    for (xo, v) in out.iter_mut().enumerate() {
                        *v = tap(win, 1, xo, kx, w).map_or(0.0, |ix| src[ix]);
                    }
                }
            }
        }
    }
}

/// The f32 convolution as GEMMs; `col` holds [`im2col_floats`] floats.
pub(crate) fn conv2d_f32(
    win: &Window2d,
    groups: usize,
    [x, w]: [Src; 2],
    bias: Option<Src>,
    out: Dst,
    col: &mut [f32],
    ctx: &Ctx,
) -> Result<()> {
    let [n, c, h, wd] = [
        x.shape.dim(0),
        x.shape.dim(1),
        x.shape.dim(2),
        x.shape.dim(3),
    ];
    let [o, oh, ow] = [out.shape.dim(1), out.shape.dim(2), out.shape.dim(3)];
    let (cg, og) = (c / groups, o / groups);
    let k = cg * win.kernel[0] * win.kernel[1];
    let p = oh * ow;
    let in_place = reads_in_place(win);
    // SAFETY: the operands are f32 tensors of the shapes read above, and the plan
    // never places the output over an input.
    let (xs, ws) = unsafe {
        (
            std::slice::from_raw_parts(x.ptr.cast::<f32>(), x.len),
            std::slice::from_raw_parts(w.ptr.cast::<f32>(), w.len),
        )
    };
    // The output as an address, so tasks on other threads can write their rows.
    let out_addr = out.ptr as usize;
    let bias = bias.map(|b| unsafe { std::slice::from_raw_parts(b.ptr.cast::<f32>(), b.len) });
    // One product per image and group.
    let product = |b: usize, g: usize, col: &mut [f32]| -> Gemm {
        let image = &xs[(b * c + g * cg) * h * wd..][..cg * h * wd];
        let cols: *const f32 = if in_place {
            image.as_ptr()
        } else {
            im2col(win, image, [cg, h, wd], [oh, ow], &mut col[..k * p]);
            col.as_ptr()
        };
        // SAFETY: rows `g * og ..` of image `b`'s output, inside `out`; each (b, g)
        // writes its own rows.
        let dst = unsafe { (out_addr as *mut f32).add((b * o + g * og) * p) };
        if let Some(bias) = bias {
            for r in 0..og {
                // SAFETY: as above.
                unsafe { std::slice::from_raw_parts_mut(dst.add(r * p), p) }.fill(bias[g * og + r]);
            }
        }
        Gemm {
            m: og,
            n: p,
            k,
            a: ws[g * og * k..].as_ptr(),
            lda: k,
            b: cols,
            ldb: p,
            b_transposed: false,
            b_format: BFormat::F32,
            c: dst,
            ldc: p,
            accumulate: bias.is_some(),
            epilogue: Epilogue::NONE,
        }
    };
    let units = n * groups;
    let threads = ctx.gemm.threads();
    if threads > 1 && units >= threads {
        // Enough images for every thread: each runs whole products, serially, with
        // its own patch buffer.
        let task = |u: usize, thread: usize| {
            // SAFETY: one task per thread index at a time.
            let (buf, extra) = unsafe { ctx.gemm.parts(thread) };
            let gemm = product(u / groups, u % groups, extra);
            // SAFETY: the matrices of `product` lie inside their tensors.
            unsafe { sgemm_serial(&gemm, buf) };
        };
        return ctx.pool.run(units, threads, &task);
    }
    for b in 0..n {
        for g in 0..groups {
            let gemm = product(b, g, col);
            // SAFETY: A, B and C above are `m x k`, `k x n` and `m x n` matrices
            // inside their tensors.
            unsafe { sgemm(&gemm, ctx.pool, ctx.gemm)? };
        }
    }
    Ok(())
}

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

/// Pooling over f32 planes, threaded over planes. Matches [`pool`]: a window with a
/// NaN gives NaN for max, and the average divides by the window size or by the taps
/// inside the input.
pub(crate) fn pool_f32(
    win: &Window2d,
    max: bool,
    count_include_pad: bool,
    x: Src,
    out: Dst,
    ctx: &Ctx,
) -> Result<()> {
    let [n, c, h, w] = [
        x.shape.dim(0),
        x.shape.dim(1),
        x.shape.dim(2),
        x.shape.dim(3),
    ];
    let [oh, ow] = [out.shape.dim(2), out.shape.dim(3)];
    let planes = n * c;
    let window_len = (win.kernel[0] * win.kernel[1]) as f32;
    // SAFETY: f32 tensors of the shapes read above; the output never overlaps the
    // input (the plan does not run pooling in place).
    let xs = unsafe { std::slice::from_raw_parts(x.ptr.cast::<f32>(), x.len) };
    let out_addr = out.ptr as usize;
    // The taps of a window that fall inside the input along one axis, as a range of
    // input positions with the dilation as step: `(first, count)`.
    let inside = |axis: usize, o: usize, size: usize| -> (usize, usize) {
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
    };
    let (dy, dx) = (win.dilation[0], win.dilation[1]);
    let plane_task = |plane: usize, _thread: usize| {
        let src = &xs[plane * h * w..(plane + 1) * h * w];
        // SAFETY: plane `plane` of the output, written by this task alone.
        let dst = unsafe {
            std::slice::from_raw_parts_mut((out_addr as *mut f32).add(plane * oh * ow), oh * ow)
        };
        for y in 0..oh {
            let (iy0, ny) = inside(0, y, h);
            let row = &mut dst[y * ow..(y + 1) * ow];
            for (xo, v) in row.iter_mut().enumerate() {
                let (ix0, nx) = inside(1, xo, w);
                let mut acc = if max { f32::NEG_INFINITY } else { 0.0 };
                let mut nan = false;
                for ty in 0..ny {
                    let line = &src[(iy0 + ty * dy) * w..];
                    for tx in 0..nx {
                        let t = line[ix0 + tx * dx];
                        nan |= t.is_nan();
                        acc = if max { acc.max(t) } else { acc + t };
                    }
                }
                *v = if max {
                    if nan { f32::NAN } else { acc }
                } else if count_include_pad {
                    acc / window_len
                } else {
                    acc / (ny * nx).max(1) as f32
                };
            }
        }
    };
    ctx.pool.run(planes, ctx.gemm.threads(), &plane_task)
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
