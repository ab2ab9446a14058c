//! The pixel kernel over slices of the input channels, for convolutions whose
//! weights outweigh their input (the last layers of a CNN: few pixels, many
//! channels) into a channel-blocked output.
//!
//! [`super::conv2d`] stages all the channels of a block of output rows, so where
//! an image's staged input overflows the staging budget it cuts the image into
//! blocks of rows, and each block reads all the weights again: ResNet-50's 3x3
//! stride-2 layer over 512 channels at 7 x 7 took 4 blocks, 38 MB of weights
//! read for 9.4 MB of them. Here each block stages the rows of one slice of the
//! channels at a time (a depth block of steps), multiplies it by that slice of
//! every panel's weights and adds the sums to the output's values, so a block
//! covers the whole image, and every weight is read once a block.

use super::{
    BlockOut, BlockedIo, Blocking, Finish, FinishAt, Geometry, KC, MR, NR, PixelBases, Prologue,
    TILE, TileInput, as_offsets, prefetches_weights, stage_budget, stage_rows, step_offsets,
    store_blocked, whole_tiles_blocked,
};
use crate::layout::BLOCK;
use crate::pool::ThreadPool;
use crate::tensor::{Dst, Src};
use rlx_ir::{Result, Window2d};

/// Channels per slice of a convolution of `o` filters over `geo`'s input, when it
/// runs in slices: where its weights outweigh the whole image's staged input and
/// the plain path would cut the image into blocks of rows or the steps into depth
/// blocks. A slice is whole blocks of 16 channels whose steps fill a depth block
/// at most and whose rows of the whole image fit the staging budget; never fewer
/// than 16 channels (then a wide window's slice may take more steps, and where
/// 16 channels' rows overflow the budget, the blocks of rows follow from them).
pub(super) fn slice_channels(win: &Window2d, geo: &Geometry, o: usize) -> Option<usize> {
    let taps = win.kernel[0] * win.kernel[1];
    let k = geo.cg * taps;
    // Staged floats of one channel for all the image's output rows.
    let per_channel = geo.rows_read(win, geo.oh).saturating_mul(geo.wp);
    let image = geo.cg.saturating_mul(per_channel);
    if o.saturating_mul(k) < image || (k <= KC && image <= stage_budget()) {
        return None;
    }
    let channels =
        ((KC / taps).min(stage_budget() / per_channel.max(1)) / BLOCK * BLOCK).max(BLOCK);
    (channels < geo.cg).then_some(channels)
}

/// Whether [`conv2d`] runs the convolution: [`slice_channels`] gives slices, the
/// output is blocked, and the CPU has no AVX-512 (the sums of a slice are added
/// to the stored ones by the AVX2 kernel).
pub(super) fn applies(win: &Window2d, geo: &Geometry, o: usize, blocks: &BlockedIo) -> bool {
    blocks.output && !crate::isa::isa().avx512f && slice_channels(win, geo, o).is_some()
}

/// Per-thread floats [`conv2d`] needs for a convolution over `geo`'s input with `o`
/// filters (0 where it does not run in slices): a slice's staged rows of the
/// largest block, its step offsets, and a tile of sums per panel for a block's
/// last short tile.
pub(super) fn thread_floats(win: &Window2d, geo: &Geometry, o: usize) -> usize {
    let Some(channels) = slice_channels(win, geo, o) else {
        return 0;
    };
    let slice = Geometry {
        cg: channels,
        ..*geo
    };
    let blocking = Blocking::largest(win, &slice);
    let block = blocking.block(0, &slice);
    let staged = blocking.geometry(win, &slice, &block);
    let taps = win.kernel[0] * win.kernel[1];
    staged.staged_len(slice.rows_read(win, block.rows)) + channels * taps + o.div_ceil(NR) * TILE
}

/// [`super::conv2d`] in slices of the input channels ([`applies`]): each task (a
/// block of an image's output rows, and with fewer images than threads a share of
/// the panels) stages one slice's rows at a time and adds that slice's products
/// to the block's output, finishing it with the last slice. `weights` are packed
/// in [`StepOrder::of`]'s order for the input, so a slice's steps are a run of
/// each panel's, after those of the slices before it.
pub(super) fn conv2d(
    win: &Window2d,
    (x, geo): (Src, Geometry),
    weights: &[f32],
    (finish, prologue): (Finish, Option<Prologue>),
    out: Dst,
    (gemm, pool): (&crate::gemm::GemmScratch, &ThreadPool),
) -> Result<()> {
    let [n, o] = [out.shape.dim(0), out.shape.dim(1)];
    let pixels = geo.oh * geo.ow;
    let Some(channels) = slice_channels(win, &geo, o) else {
        return Err(rlx_ir::Error::runtime(
            "convolution in channel slices",
            "the convolution does not run in slices",
        ));
    };
    let taps = win.kernel[0] * win.kernel[1];
    let k = geo.cg * taps;
    let slices = geo.cg.div_ceil(channels);
    let threads = gemm.threads();
    let panels = o.div_ceil(NR);
    // With fewer images than threads, the threads share each image's panels.
    let parts = if n < threads && panels >= 2 * threads.div_ceil(n) {
        threads.div_ceil(n)
    } else {
        1
    };
    let part_panels = panels.div_ceil(parts);
    let slice_geo = Geometry {
        cg: channels,
        ..geo
    };
    let blocking = Blocking::new(win, &slice_geo, n * parts, threads);
    // SAFETY: an f32 tensor of `x.len` values.
    let xs = unsafe { std::slice::from_raw_parts(x.ptr.cast::<f32>(), x.len) };
    let out_addr = out.ptr as usize;
    let finish_at = FinishAt::of(&finish);
    let residual_addr = finish_at.residual;
    let in_store = finish.has_lanes_form();
    let per_channel = finish.per_channel();
    let out_blocks = crate::layout::Blocks::new(o, pixels);
    let image_len = geo.cg * geo.h * geo.w;
    let task = |u: usize, thread: usize| {
        let (u, part) = (u / parts, u % parts);
        let part_range = part * part_panels..((part + 1) * part_panels).min(panels);
        if part_range.is_empty() {
            return;
        }
        let (image, block) = (u / blocking.blocks, u % blocking.blocks);
        let at = blocking.block(block, &slice_geo);
        let (y0, rows) = (at.y0, at.rows);
        let staging = blocking.geometry(win, &slice_geo, &at);
        let staged_rows = geo.rows_read(win, rows);
        // SAFETY: one task per thread index at a time; the step asked for
        // `thread_floats`.
        let extra = unsafe { gemm.parts(thread) }.1;
        let (staged, rest) = extra.split_at_mut(staging.staged_len(staged_rows));
        let (offsets, rest) = rest.split_at_mut(channels * taps);
        let short_sums = &mut rest[..part_range.len() * TILE];
        let block_pixels = rows * at.cols;
        let (whole_tiles, short) = (block_pixels / MR, block_pixels % MR);
        let image_at = image * o * pixels;
        let src = &xs[image * image_len..][..image_len];
        let bases = PixelBases {
            ow: at.cols,
            row_step: win.stride[0] * staging.wp * geo.lanes,
            sx: win.stride[1] * geo.lanes,
            last: block_pixels - 1,
        };
        for s in 0..slices {
            let c0 = s * channels;
            let slice = Geometry {
                cg: channels.min(geo.cg - c0),
                ..staging
            };
            let last = s + 1 == slices;
            // A slice starts at a whole block of the input (or a plain channel), so
            // its values follow from channel `c0`'s first, as an input of its own.
            let slice_src = &src[c0 * geo.h * geo.w..][..slice.cg * geo.h * geo.w];
            stage_rows(
                win,
                &slice,
                (slice_src, prologue, c0),
                (y0, at.x0),
                staged_rows,
                &mut staged[..slice.staged_len(staged_rows)],
            );
            let steps = slice.cg * taps;
            step_offsets(win, &slice, staged_rows, &mut offsets[..steps]);
            let slice_offsets = as_offsets(&mut offsets[..steps]);
            let staged = &*staged;
            // What a tile with these pixel bases reads of the staged slice.
            let input = |pixel: [usize; MR]| {
                TileInput::new(
                    slice_offsets,
                    pixel.map(|p| staged.as_ptr().wrapping_add(p)),
                    prefetches_weights(steps),
                    geo.lanes,
                )
            };
            let block_out = BlockOut {
                // SAFETY: inside the output.
                image: unsafe { (out_addr as *mut f32).add(image_at) },
                first_pixel: y0 * geo.ow + at.x0,
                pixels,
                channels: o,
                blocked: true,
                finish: (last && in_store).then(|| finish_at.in_registers(image_at)),
            };
            for q in part_range.clone() {
                // Panel `q`'s steps of this slice, which in either step order
                // follow those of the channels before it.
                let panel = (weights[(q * k + c0 * taps) * NR..].as_ptr(), k * NR, 1);
                for (first, run, pixel) in bases.row_runs(whole_tiles) {
                    // SAFETY: every base plus every offset lies inside the staged
                    // rows; the panel holds the slice's steps; the tiles' pixels of
                    // block `q` lie inside the block's output, which only this task
                    // writes, and hold the sums of the slices before (`s > 0`); a
                    // run of more than one tile lies in one row, its pixels `sx`
                    // staged floats apart; AVX2 without AVX-512 (`applies`).
                    unsafe {
                        whole_tiles_blocked(input(pixel), panel, &block_out, (q, first), run, s > 0)
                    };
                }
                if short > 0 {
                    let first = whole_tiles * MR;
                    let pixel: [usize; MR] =
                        std::array::from_fn(|i| bases.of((first + i).min(bases.last)));
                    let sums = &mut short_sums[(q - part_range.start) * TILE..][..TILE];
                    // SAFETY: as above, into this panel's short tile in scratch.
                    unsafe { super::micro_kernel(input(pixel), panel, (sums, short), s > 0) };
                    if last {
                        let lanes = out_blocks.width(q);
                        // SAFETY: the block's last `short` pixels of block `q`,
                        // which only this task writes.
                        unsafe {
                            store_blocked(
                                sums,
                                (block_out.image, block_out.at(q * NR, first)),
                                (short, q * NR, lanes),
                                block_out.finish.as_ref(),
                            )
                        };
                    }
                }
            }
        }
        if in_store {
            return;
        }
        for q in part_range {
            let lanes = out_blocks.width(q);
            let first_pixel = y0 * geo.ow + at.x0;
            let (at, len) = (
                image_at + out_blocks.index(q * NR, first_pixel),
                block_pixels * lanes,
            );
            // SAFETY: the block's pixels of block `q`: inside the output (and the
            // residual, of the same shape and layout); only this task writes them.
            let (values, residual) = unsafe {
                (
                    std::slice::from_raw_parts_mut((out_addr as *mut f32).add(at), len),
                    residual_addr
                        .map(|a| std::slice::from_raw_parts((a as *const f32).add(at), len)),
                )
            };
            per_channel.apply_lanes((q * NR, lanes), values, residual);
        }
    };
    pool.run(n * blocking.blocks * parts, threads, &task)
}
