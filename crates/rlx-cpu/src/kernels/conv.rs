//! 2-D convolution and pooling over NCHW. An f32 convolution is a GEMM per image and
//! group: the weights `[out channels, in channels x kh x kw]` times the input's
//! patches laid out as columns (`im2col`), into the output's `[channels, pixels]`
//! rows. A 1x1 convolution with unit stride and no padding reads the input in place.
//! Other dtypes take the direct loop.

use super::Ctx;
use crate::elem::{Elem, with_dtype};
use crate::gemm::{BFormat, Epilogue, Gemm, sgemm_serial};
use crate::tensor::{Dst, Src};
use rlx_ir::UnaryOp;
use rlx_ir::scalar::unary_f64;
use rlx_ir::{Result, Shape, Window2d};

/// The dims of an NCHW tensor (the builder checked its rank).
fn nchw(s: &Shape) -> [usize; 4] {
    [s.dim(0), s.dim(1), s.dim(2), s.dim(3)]
}

/// Output extent of a window along `axis` over an input of `size` (the builder
/// checked that the window fits).
fn extent(win: &Window2d, axis: usize, size: usize) -> usize {
    let padded = size + win.padding[axis] + win.padding[axis + 2];
    let span = win.dilation[axis] * (win.kernel[axis] - 1) + 1;
    padded.saturating_sub(span) / win.stride[axis] + 1
}

/// Output pixels per block of patch columns: the block (`k` rows of it) takes about
/// half of L2, so the GEMM reads it from there right after `im2col` wrote it.
fn column_block(k: usize, pixels: usize) -> usize {
    let nr = crate::gemm::packed_panel_width(pixels);
    let fit = crate::gemm::l2_cache_bytes() / 2 / 4 / k.max(1);
    (fit / nr * nr).max(nr).min(pixels.max(1))
}

/// Per-thread floats an f32 convolution needs, from its input and weight shapes: one
/// block of patch columns packed into panels, and then either one row of it before
/// packing or, for a [`wide`] convolution, its padded input rows and its product
/// before the junk columns are dropped.
pub(crate) fn im2col_floats(win: &Window2d, x: &Shape, w: &Shape) -> usize {
    let k = w.dim(1) * w.dim(2) * w.dim(3);
    let (oh, ow) = (extent(win, 0, x.dim(2)), extent(win, 1, x.dim(3)));
    // The largest block `conv2d_f32` picks.
    let block = if shifted(win) {
        column_block(w.dim(1), oh * ow)
    } else {
        column_block(k, oh * ow)
    };
    if !wide(win) {
        return crate::gemm::packed_len(k, block) + block;
    }
    let span = wide_span(win, block, ow);
    let padded = if win.padding == [0; 4] {
        0
    } else {
        w.dim(1) * span.rows * (x.dim(3) + win.padding[1] + win.padding[3])
    };
    let product = if win.kernel[1] > 1 {
        w.dim(0) * span.wide
    } else {
        0
    };
    let columns = if shifted(win) {
        0
    } else {
        crate::gemm::packed_len(k, span.wide)
    };
    columns + padded + product
}

/// Whether a [`wide`] convolution multiplies shifted views of its input instead of
/// patch columns: with more than one tap, the patch matrix repeats each input value
/// once per tap, and writing it cost as much as the product. In wide pixels, tap
/// `(ky, kx)`'s rows are the padded planes read from offset `ky * w2 + kx` with the
/// plane as row stride, so each tap is one GEMM over the input channels, with `B`
/// read in place and all of them accumulating into one block.
pub(crate) fn shifted(win: &Window2d) -> bool {
    wide(win) && win.kernel[0] * win.kernel[1] > 1
}

/// `f64` scratch an f32 convolution needs: its weights regrouped by tap for
/// [`shifted`] convolutions (`[group][tap][out channel][in channel]`).
pub(crate) fn conv_scratch_f64(win: &Window2d, w: &Shape) -> usize {
    if shifted(win) {
        w.num_elements().div_ceil(2)
    } else {
        0
    }
}

/// Whether a convolution runs in "wide" pixels (unit stride and dilation): output
/// rows are computed over the padded input's whole width `w + pad_left + pad_right`,
/// whose last `kw - 1` positions per row are junk the store drops. In those
/// coordinates every row `(channel, ky, kx)` of the patch matrix is one contiguous
/// run of the padded input, so `im2col` is one copy per row, with no bounds to test.
fn wide(win: &Window2d) -> bool {
    win.stride == [1, 1] && win.dilation == [1, 1]
}

/// The largest wide extent of a block of `block` output pixels.
struct WideSpan {
    /// Wide pixels, junk included.
    wide: usize,
    /// Padded input rows its windows read.
    rows: usize,
}

fn wide_span(win: &Window2d, block: usize, ow: usize) -> WideSpan {
    // A block starting anywhere in a row ends at most ceil(block / ow) rows further.
    let extra_rows = block.div_ceil(ow.max(1));
    WideSpan {
        wide: block + (win.kernel[1] - 1) * extra_rows,
        rows: extra_rows + win.kernel[0],
    }
}

/// The output positions `o` along `axis` whose tap `t` lands inside an input of
/// `size`, as `lo..hi`.
fn inside_outputs(
    win: &Window2d,
    axis: usize,
    t: usize,
    size: usize,
    outputs: usize,
) -> (usize, usize) {
    let (s, pad) = (win.stride[axis] as isize, win.padding[axis] as isize);
    let shift = (t * win.dilation[axis]) as isize - pad; // input = o * s + shift
    let lo = if shift >= 0 { 0 } else { (-shift + s - 1) / s };
    let hi = if size as isize - 1 - shift < 0 {
        0
    } else {
        ((size as isize - 1 - shift) / s + 1).min(outputs as isize)
    };
    (lo as usize, (hi.max(lo)) as usize)
}

/// Writes patch columns `first..first + width` of one image's group (`c` channels of
/// `h x w` at `x`) as the `[c * kh * kw, width]` matrix whose row `(ic, ky, kx)` holds
/// the input value each of those output pixels' tap reads (0 in the padding), packed
/// into `col` as the GEMM's `nr`-column panels (`BFormat::Packed`); `row` holds
/// `width` floats.
#[allow(clippy::too_many_arguments)] // geometry, source, block and two buffers
fn im2col(
    win: &Window2d,
    x: &[f32],
    [c, h, w]: [usize; 3],
    ow: usize,
    (first, width): (usize, usize),
    nr: usize,
    col: &mut [f32],
    row: &mut [f32],
) {
    let [kh, kw] = win.kernel;
    let k = c * kh * kw;
    let (sx, dx, px) = (win.stride[1], win.dilation[1], win.padding[1]);
    let row = &mut row[..width];
    // The input rows this block's windows read: the same span of every plane.
    let (last_y, (sy, dy, py)) = (
        (first + width - 1) / ow,
        (win.stride[0], win.dilation[0], win.padding[0]),
    );
    let span_lo = ((first / ow) * sy).saturating_sub(py).min(h);
    let span_hi = (last_y * sy + (kh - 1) * dy + 1).saturating_sub(py).min(h);
    for ic in 0..c {
        let plane = &x[ic * h * w..(ic + 1) * h * w];
        // A plane's rows are a short run read once: the hardware prefetchers do not
        // catch it in time, and each line would be a demand miss. Ask for the next
        // plane's span while this one is copied.
        if ic + 1 < c {
            prefetch_span(&x[(ic + 1) * h * w + span_lo * w..(ic + 1) * h * w + span_hi * w]);
        }
        for ky in 0..kh {
            for kx in 0..kw {
                let r = (ic * kh + ky) * kw + kx;
                let (xlo, xhi) = inside_outputs(win, 1, kx, w, ow);
                let mut q = first;
                let mut at = 0;
                while at < width {
                    let (y, x0) = (q / ow, q % ow);
                    let len = (ow - x0).min(width - at);
                    let out = &mut row[at..at + len];
                    match tap(win, 0, y, ky, h) {
                        None => fill_short(out, 0.0),
                        Some(iy) => {
                            let src = &plane[iy * w..(iy + 1) * w];
                            // Columns x0..x0 + len; inside the input for xlo..xhi.
                            let (a, b) = (xlo.clamp(x0, x0 + len), xhi.clamp(x0, x0 + len));
                            fill_short(&mut out[..a - x0], 0.0);
                            fill_short(&mut out[b - x0..], 0.0);
                            if b > a {
                                let start = a * sx + kx * dx - px;
                                let dst = &mut out[a - x0..b - x0];
                                if sx == 1 {
                                    copy_short(dst, &src[start..start + (b - a)]);
                                } else {
                                    for (i, v) in dst.iter_mut().enumerate() {
                                        *v = src[start + i * sx];
                                    }
                                }
                            }
                        }
                    }
                    at += len;
                    q += len;
                }
                scatter_to_panels(row, r, k, nr, col);
            }
        }
    }
}

/// Asks for every cache line of `values` to be brought into L1.
#[inline(always)]
fn prefetch_span(values: &[f32]) {
    #[cfg(target_arch = "x86_64")]
    for line in values.chunks(16) {
        // SAFETY: a prefetch reads nothing architecturally and never faults.
        unsafe {
            std::arch::x86_64::_mm_prefetch::<{ std::arch::x86_64::_MM_HINT_T0 }>(
                line.as_ptr().cast(),
            )
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = values;
}

/// Stores `row` as row `r` of a `k`-row matrix packed into `nr`-column panels, zero
/// past its end.
fn scatter_to_panels(row: &[f32], r: usize, k: usize, nr: usize, col: &mut [f32]) {
    for (q, chunk) in row.chunks(nr).enumerate() {
        let dst = &mut col[(q * k + r) * nr..][..nr];
        copy_short(&mut dst[..chunk.len()], chunk);
        fill_short(&mut dst[chunk.len()..], 0.0);
    }
}

/// `dst.copy_from_slice(src)` for the short runs `im2col` moves, in fixed-size pieces
/// the compiler keeps inline: a `memmove` call per run cost more than the copy.
#[inline(always)]
fn copy_short(dst: &mut [f32], src: &[f32]) {
    let n = dst.len();
    assert_eq!(n, src.len());
    if n >= 8 {
        let mut i = 0;
        while i + 8 <= n {
            let piece: [f32; 8] = src[i..i + 8].try_into().unwrap();
            dst[i..i + 8].copy_from_slice(&piece);
            i += 8;
        }
        if i < n {
            // The last piece overlaps the one before: the same values again.
            let piece: [f32; 8] = src[n - 8..].try_into().unwrap();
            dst[n - 8..].copy_from_slice(&piece);
        }
    } else if n >= 4 {
        let head: [f32; 4] = src[..4].try_into().unwrap();
        let tail: [f32; 4] = src[n - 4..].try_into().unwrap();
        dst[..4].copy_from_slice(&head);
        dst[n - 4..].copy_from_slice(&tail);
    } else {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = s;
        }
    }
}

/// `dst.fill(value)` for short runs, kept inline as [`copy_short`] is.
#[inline(always)]
fn fill_short(dst: &mut [f32], value: f32) {
    let n = dst.len();
    if n >= 8 {
        let mut i = 0;
        while i + 8 <= n {
            dst[i..i + 8].copy_from_slice(&[value; 8]);
            i += 8;
        }
        if i < n {
            dst[n - 8..].copy_from_slice(&[value; 8]);
        }
    } else {
        for d in dst {
            *d = value;
        }
    }
}

/// The f32 convolution as GEMMs over blocks of output pixels: each task takes one
/// image, group and block of pixels, writes that block's patch columns into its
/// thread's buffer (sized by [`im2col_floats`]) as packed panels and multiplies them
/// serially, so the columns are read from L2 and both threads stay busy even for one
/// image.
pub(crate) fn conv2d_f32(
    win: &Window2d,
    groups: usize,
    [x, w]: [Src; 2],
    bias: Option<Src>,
    epilogue: ConvEpilogue,
    out: Dst,
    ctx: &mut Ctx,
) -> Result<()> {
    let [n, c, h, wd] = nchw(x.shape);
    let [o, oh, ow] = [out.shape.dim(1), out.shape.dim(2), out.shape.dim(3)];
    let (cg, og) = (c / groups, o / groups);
    let k = cg * win.kernel[0] * win.kernel[1];
    let p = oh * ow;
    if p == 0 || og == 0 || n == 0 {
        return Ok(());
    }
    let threads = ctx.gemm.threads();
    let block = if shifted(win) {
        // No patch matrix: the block is sized by the padded input rows it reads
        // (`cg` values per pixel), and cut so that every thread has a block.
        let fit = column_block(cg, p);
        let images = n * groups;
        if images >= threads {
            fit
        } else {
            fit.min(p.div_ceil(threads.div_ceil(images)))
        }
    } else {
        column_block(k, p)
    };
    let blocks = p.div_ceil(block);
    // SAFETY: the operands are f32 tensors of the shapes read above, and the plan
    // never places the output over an input.
    let (xs, ws) = unsafe {
        (
            std::slice::from_raw_parts(x.ptr.cast::<f32>(), x.len),
            std::slice::from_raw_parts(w.ptr.cast::<f32>(), w.len),
        )
    };
    // The output as an address, so tasks on other threads can write their blocks.
    let out_addr = out.ptr as usize;
    let bias = bias.map(|b| unsafe { std::slice::from_raw_parts(b.ptr.cast::<f32>(), b.len) });
    let activation = epilogue
        .activation
        .map(|a| super::fused::gemm_activation(a).ok_or(a))
        .transpose()
        .map_err(|a| {
            rlx_ir::Error::runtime(
                "fused_conv2d",
                format!("{} has no epilogue kernel", a.name()),
            )
        })?;
    // The residual as an address, read by every task at its block's place.
    let residual_addr = epilogue.residual.map(|r| r.ptr as usize);
    let is_wide = wide(win);
    let span = wide_span(win, block, ow);
    let [kh, kw] = win.kernel;
    let taps = kh * kw;
    // Regroup the weights by tap (see `shifted`): tap `t`'s `og x cg` matrix of group
    // `g` starts at `(g * taps + t) * og * cg`.
    let spec = crate::prepack::PackSpec::ConvTaps {
        groups,
        og,
        cg,
        taps,
    };
    let by_tap: &[f32] = if !shifted(win) {
        &[]
    } else if let Some(packed) = ctx.packed_b.filter(|p| p.fits(spec)) {
        // Regrouped when the param was set.
        packed.values()
    } else {
        // SAFETY: the step asked for `conv_scratch_f64` values: room for every weight
        // as f32 (f64 storage is aligned for f32).
        let regrouped = unsafe {
            std::slice::from_raw_parts_mut(ctx.scratch.as_mut_ptr().cast::<f32>(), ws.len())
        };
        regroup_by_tap(ws, [groups, og, cg, taps], regrouped);
        regrouped
    };
    let task = |u: usize, thread: usize| {
        let (image, rest) = (u / (groups * blocks), u % (groups * blocks));
        let (g, j0) = (rest / blocks, (rest % blocks) * block);
        let width = block.min(p - j0);
        // SAFETY: one task per thread index at a time.
        let (buf, extra) = unsafe { ctx.gemm.parts(thread) };
        let src = &xs[(image * c + g * cg) * h * wd..][..cg * h * wd];
        if is_wide {
            let block_out = BlockOut {
                // SAFETY: rows `g * og ..` of image `image`'s output: inside `out`.
                out: unsafe { (out_addr as *mut f32).add((image * o + g * og) * p) },
                residual: residual_addr
                    .map(|r| unsafe { (r as *const f32).add((image * o + g * og) * p) }),
                bias: bias.map(|b| &b[g * og..(g + 1) * og]),
                activation,
                pixels: p,
            };
            let weights = if by_tap.is_empty() {
                &ws[g * og * k..(g + 1) * og * k]
            } else {
                &by_tap[g * og * k..(g + 1) * og * k]
            };
            wide_block(
                win,
                src,
                [cg, h, wd],
                [og, ow],
                (j0, width),
                weights,
                block_out,
                span.wide,
                buf,
                extra,
            );
            return;
        }
        // The panel width the GEMM picks for this block's width (a last, narrower
        // block may get another kernel).
        let nr = crate::gemm::packed_panel_width(width);
        let (col, row) = extra.split_at_mut(crate::gemm::packed_len(k, block));
        im2col(win, src, [cg, h, wd], ow, (j0, width), nr, col, row);
        // SAFETY: rows `g * og ..` of image `image`'s output, columns j0..j0 + width:
        // inside `out`, and each task writes its own.
        let dst = unsafe { (out_addr as *mut f32).add((image * o + g * og) * p + j0) };
        if let Some(bias) = bias {
            for r in 0..og {
                // SAFETY: as above.
                unsafe { std::slice::from_raw_parts_mut(dst.add(r * p), width) }
                    .fill(bias[g * og + r]);
            }
        }
        let gemm = Gemm {
            m: og,
            n: width,
            k,
            a: ws[g * og * k..].as_ptr(),
            lda: k,
            b: col.as_ptr(),
            ldb: width,
            b_transposed: false,
            b_format: BFormat::Packed { nr },
            c: dst,
            ldc: p,
            accumulate: bias.is_some(),
            epilogue: Epilogue {
                activation,
                // SAFETY: the residual has the output's shape: the same offset and
                // row stride address this block of it.
                residual: residual_addr.map(|r| {
                    (
                        unsafe { (r as *const f32).add((image * o + g * og) * p + j0) },
                        p,
                    )
                }),
                ..Epilogue::NONE
            },
        };
        // SAFETY: A and C above are `m x k` and `m x width` matrices inside their
        // tensors, B the packed panels of a `k x width` one.
        unsafe { sgemm_serial(&gemm, buf) };
    };
    ctx.pool.run(n * groups * blocks, threads, &task)
}

/// Copies OIHW weights (`groups * og` filters of `cg x taps`) into `out` as
/// `[group][tap][og][cg]`.
pub(crate) fn regroup_by_tap(ws: &[f32], [groups, og, cg, taps]: [usize; 4], out: &mut [f32]) {
    for g in 0..groups {
        let group_out = &mut out[g * taps * og * cg..][..taps * og * cg];
        for co in 0..og {
            let filter = &ws[(g * og + co) * cg * taps..][..cg * taps];
            for (ci, tap_values) in filter.chunks_exact(taps).enumerate() {
                for (t, &v) in tap_values.iter().enumerate() {
                    group_out[(t * og + co) * cg + ci] = v;
                }
            }
        }
    }
}

/// Where one image and group's output goes and what is applied on the way.
struct BlockOut<'a> {
    /// The group's first output channel of the image (`og` rows of `pixels`).
    out: *mut f32,
    /// The residual at the same place, if any.
    residual: Option<*const f32>,
    /// The group's `og` bias values.
    bias: Option<&'a [f32]>,
    activation: Option<crate::gemm::Activation>,
    /// Output pixels per channel.
    pixels: usize,
}

/// One block of a [`wide`] convolution: pads the input rows it reads (unless the
/// window has no padding), writes each patch row as one run into packed panels,
/// multiplies, and stores the block's valid pixels with the bias, activation and
/// residual. `wide_max` is the widest block the scratch was sized for.
#[allow(clippy::too_many_arguments)] // geometry, operands, destination and buffers
fn wide_block(
    win: &Window2d,
    src: &[f32],
    [c, h, w]: [usize; 3],
    [og, ow]: [usize; 2],
    (first, width): (usize, usize),
    weights: &[f32],
    dst: BlockOut,
    wide_max: usize,
    gemm_buf: &mut [f32],
    extra: &mut [f32],
) {
    let [kh, kw] = win.kernel;
    let [pt, pl, _, pr] = win.padding;
    let k = c * kh * kw;
    let (y0, x0) = (first / ow, first % ow);
    let (y1, x1) = ((first + width - 1) / ow, (first + width - 1) % ow);
    let w2 = w + pl + pr;
    let wide = (y1 - y0) * w2 + x1 + 1 - x0;
    let rows = y1 - y0 + kh;
    let nr = crate::gemm::packed_panel_width(wide);
    let taps = kh * kw;
    let columns = if taps > 1 {
        0
    } else {
        crate::gemm::packed_len(k, wide_max)
    };
    let (col, rest) = extra.split_at_mut(columns);
    // The source planes as `(floats, offset of padded row y0, plane stride)`.
    let padded = win.padding != [0; 4];
    let (rest, planes, first_row, plane_len): (&mut [f32], &[f32], usize, usize) = if padded {
        let (xpad, rest) = rest.split_at_mut(c * rows * w2);
        for (ci, plane) in xpad.chunks_exact_mut(rows * w2).enumerate() {
            for (r, line) in plane.chunks_exact_mut(w2).enumerate() {
                let iy = (y0 + r) as isize - pt as isize;
                if (0..h as isize).contains(&iy) {
                    let iy = iy as usize;
                    line[..pl].fill(0.0);
                    line[pl..pl + w].copy_from_slice(&src[(ci * h + iy) * w..][..w]);
                    line[pl + w..].fill(0.0);
                } else {
                    line.fill(0.0);
                }
            }
        }
        (rest, &*xpad, 0, rows * w2)
    } else {
        (rest, src, y0 * w, h * w)
    };
    if taps == 1 {
        for ci in 0..c {
            let plane = &planes[ci * plane_len + first_row..];
            if !padded && ci + 1 < c {
                prefetch_span(&planes[(ci + 1) * plane_len + first_row..][..rows * w2]);
            }
            scatter_to_panels(&plane[x0..][..wide], ci, k, nr, col);
        }
    }
    let direct = kw == 1;
    let (c_ptr, ldc) = if direct {
        // No junk columns: the product goes straight to the output.
        // SAFETY: pixels first.. of every channel row lie inside this image's output.
        (unsafe { dst.out.add(first) }, dst.pixels)
    } else {
        (rest[..og * wide].as_mut_ptr(), wide)
    };
    if let Some(bias) = dst.bias {
        for (r, &b) in bias.iter().enumerate() {
            // SAFETY: row r of the product, `wide` values, is inside C.
            unsafe { std::slice::from_raw_parts_mut(c_ptr.add(r * ldc), wide) }.fill(b);
        }
    }
    let epilogue = if direct {
        Epilogue {
            activation: dst.activation,
            // SAFETY: the residual has the output's layout.
            residual: dst.residual.map(|r| (unsafe { r.add(first) }, dst.pixels)),
            ..Epilogue::NONE
        }
    } else {
        Epilogue::NONE
    };
    if taps == 1 {
        let gemm = Gemm {
            m: og,
            n: wide,
            k,
            a: weights.as_ptr(),
            lda: k,
            b: col.as_ptr(),
            ldb: wide,
            b_transposed: false,
            b_format: BFormat::Packed { nr },
            c: c_ptr,
            ldc,
            accumulate: dst.bias.is_some(),
            epilogue,
        };
        // SAFETY: A is `og x k` in `weights`, B the packed panels of a `k x wide`
        // matrix, C `og x wide` with row stride `ldc` (the output's rows or the
        // scratch product).
        unsafe { sgemm_serial(&gemm, gemm_buf) };
    } else {
        // One product per tap over the input channels; `weights` is grouped by tap.
        for t in 0..taps {
            let (ky, kx) = (t / kw, t % kw);
            let gemm = Gemm {
                m: og,
                n: wide,
                k: c,
                a: weights[t * og * c..].as_ptr(),
                lda: c,
                b: planes[first_row + ky * w2 + kx + x0..].as_ptr(),
                ldb: plane_len,
                b_transposed: false,
                b_format: BFormat::F32,
                c: c_ptr,
                ldc,
                accumulate: t > 0 || dst.bias.is_some(),
                epilogue: if t + 1 == taps {
                    epilogue
                } else {
                    Epilogue::NONE
                },
            };
            // SAFETY: A is `og x c` in `weights`; B's rows (one per channel, `plane_len`
            // apart) hold `wide` values from the tap's offset inside each plane (the
            // wide geometry keeps the last one inside); C as above.
            unsafe { sgemm_serial(&gemm, gemm_buf) };
        }
    }
    if direct {
        return;
    }
    // Store each output row's valid run, dropping the junk columns.
    let product = &rest[..og * wide];
    for (co, prow) in product.chunks_exact(wide).enumerate() {
        for y in y0..=y1 {
            let xs = if y == y0 { x0 } else { 0 };
            let xe = if y == y1 { x1 + 1 } else { ow };
            let at = co * dst.pixels + y * ow + xs;
            // SAFETY: pixels `y * ow + xs .. + (xe - xs)` of channel row `co` lie inside
            // the output (and the residual); this task alone writes them.
            let (out, residual) = unsafe {
                (
                    std::slice::from_raw_parts_mut(dst.out.add(at), xe - xs),
                    dst.residual
                        .map(|r| std::slice::from_raw_parts(r.add(at), xe - xs)),
                )
            };
            out.copy_from_slice(&prow[(y - y0) * w2 + xs - x0..][..xe - xs]);
            if dst.activation.is_some() || residual.is_some() {
                crate::gemm::activate_and_add(out, dst.activation, residual);
            }
        }
    }
}

/// What a fused convolution does to each output value after the bias:
/// `act(v) + residual`.
#[derive(Clone, Copy, Default)]
pub(crate) struct ConvEpilogue<'a> {
    pub activation: Option<UnaryOp>,
    /// A tensor of the output's shape added last.
    pub residual: Option<Src<'a>>,
}

/// Applies `epilogue` to every value of `out` in place (any dtype; the f32 path
/// applies it inside [`conv2d_f32`]'s GEMMs).
pub(crate) fn apply_epilogue(epilogue: ConvEpilogue, out: Dst) {
    with_dtype!(out.shape.dtype(), T => {
        for i in 0..out.len {
            let mut v = out.get::<T>(i).to_f64();
            if let Some(act) = epilogue.activation {
                v = T::from_f64(unary_f64(act, v)).to_f64();
            }
            if let Some(r) = epilogue.residual {
                v += r.f64::<T>(i);
            }
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
/// reduced into one row (a contiguous, vectorized pass), then each output reads its
/// taps along that row.
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
    let window_len = (win.kernel[0] * win.kernel[1]) as f32;
    // SAFETY: f32 tensors of the shapes read above; the output never overlaps the
    // input (the plan does not run pooling in place).
    let xs = unsafe { std::slice::from_raw_parts(x.ptr.cast::<f32>(), x.len) };
    let out_addr = out.ptr as usize;
    let (dy, dx) = (win.dilation[0], win.dilation[1]);
    let plane_task = |plane: usize, thread: usize| {
        let src = &xs[plane * h * w..(plane + 1) * h * w];
        // SAFETY: plane `plane` of the output, written by this task alone.
        let dst = unsafe {
            std::slice::from_raw_parts_mut((out_addr as *mut f32).add(plane * oh * ow), oh * ow)
        };
        // SAFETY: one task per thread index at a time; the step asked for `w` floats.
        let line = &mut unsafe { ctx.gemm.parts(thread) }.1[..w];
        for y in 0..oh {
            let (iy0, ny) = inside_taps(win, 0, y, h);
            if ny == 0 {
                line.fill(if max { f32::NEG_INFINITY } else { 0.0 });
            } else {
                line.copy_from_slice(&src[iy0 * w..(iy0 + 1) * w]);
                for ty in 1..ny {
                    let row = &src[(iy0 + ty * dy) * w..][..w];
                    if max {
                        for (acc, &t) in line.iter_mut().zip(row) {
                            *acc = max_nan(*acc, t);
                        }
                    } else {
                        for (acc, &t) in line.iter_mut().zip(row) {
                            *acc += t;
                        }
                    }
                }
            }
            for (xo, v) in dst[y * ow..(y + 1) * ow].iter_mut().enumerate() {
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
    };
    ctx.pool.run(planes, ctx.gemm.threads(), &plane_task)
}

/// Per-thread floats [`pool_f32`] needs: one input row.
pub(crate) fn pool_floats(x: &Shape) -> usize {
    x.dim(3)
}

/// The larger of `acc` and `t`, NaN if either is (compiles to a compare and blend).
#[inline(always)]
fn max_nan(acc: f32, t: f32) -> f32 {
    if t > acc || t.is_nan() { t } else { acc }
}

/// The taps of window `o` along `axis` that fall inside an input of `size`, as a
/// range of input positions with the dilation as step: `(first, count)`.
fn inside_taps(win: &Window2d, axis: usize, o: usize, size: usize) -> (usize, usize) {
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
