//! The `f32` convolution as GEMMs, with no patch matrix.
//!
//! Output pixels are computed in "wide" coordinates: every output row spans the whole
//! width `wq = ceil((w + pad_left + pad_right) / stride_x)` of the input's phase
//! planes, and the last `wq - ow` positions of each row are junk the store drops. The
//! input is split into `stride_y x stride_x` phase planes (plane `(py, px)` holds the
//! padded input's rows `py, py + sy, ..` and columns `px, px + sx, ..`). Tap `(ky, kx)`
//! reads phase `((ky dy) % sy, (kx dx) % sx)` shifted by `((ky dy) / sy, (kx dx) /
//! sx)`, and in wide coordinates that shift is one offset: the tap's operand is the
//! phase planes read from that offset, one plane per input channel. So a convolution
//! is one GEMM per tap over the input channels, all accumulating into one block, with
//! `B` read in place. Writing a patch matrix instead (`im2col`) repeats each input
//! value once per tap, and cost as much as the products.
//!
//! A unit-stride convolution with no padding reads its input as the phase plane; any
//! other builds the planes a block reads (one strided copy of those input rows). Two
//! kinds copy each `(channel, tap)` row of the phase planes (a contiguous run in wide
//! coordinates) into packed GEMM panels and run one GEMM instead: a 1x1 convolution
//! (the GEMM reads packed panels faster than rows a plane apart), and one with few
//! input channels per group (a product per tap over so few channels would be all
//! overhead; the first layer of an image model has 3).
//!
//! Work is split into pool tasks by image, group and block of output pixels; a block
//! is sized so the input rows it reads take about half of L2.

use super::conv::{ConvEpilogue, extent, nchw};
use super::{Ctx, conv_pixels_f32, depthwise_f32, winograd_f32};
use crate::gemm::{Activation, BFormat, Epilogue, Gemm, sgemm_serial};
use crate::tensor::{Dst, Src};
use crate::vmath::multiversion;
use rlx_ir::{Result, Shape, Window2d};

/// Below this many output pixels per thread, a convolution of one image splits its
/// output channels between threads instead of its pixels (four panels of the widest
/// kernel): a 7 x 7 layer cut in two by pixels gave each thread 25 columns, half of
/// every 48-wide panel wasted.
const NARROW_PIXELS: usize = 192;

/// Below this many input channels per group, a convolution with several taps packs
/// its `(channel, tap)` rows into panels instead of multiplying per tap.
const PER_TAP_MIN_CHANNELS: usize = 32;

/// Output pixels per block: as many as let the input values the block reads (per
/// pixel of output) fill `budget` bytes, then evened out over the blocks the image
/// needs (600 pixels at 512 per block make two of 304 and 296, not 512 and a
/// thin 88 that rereads all the weights for little work).
fn pixel_block(per_pixel: usize, pixels: usize, budget: usize) -> usize {
    let nr = crate::gemm::packed_panel_width(pixels);
    let fit = budget / 4 / per_pixel.max(1);
    let fit = (fit / nr * nr).max(nr);
    // Up to an eighth over the budget rather than one more block: 49 pixels at 48 per
    // block made a second block of one pixel that packed and multiplied all the
    // weights again.
    let blocks = pixels.div_ceil(fit + fit / 8).max(1);
    (pixels.div_ceil(blocks).div_ceil(nr) * nr).min(pixels.max(1))
}

/// Output pixels per block when one image's `pixels` are shared by `parts` threads:
/// at most `fit`, and a multiple of `parts` blocks in all, so every thread gets the
/// same number. Three blocks of 1056 for 3136 pixels on two threads left one thread
/// idle for a third of the layer (ResNet-50's 1x1 convolutions at 56 x 56).
fn even_block(pixels: usize, parts: usize, fit: usize) -> usize {
    let nr = crate::gemm::packed_panel_width(pixels);
    let share = pixels.div_ceil(parts.max(1));
    let rounds = share.div_ceil(fit.max(1));
    let block = share.div_ceil(rounds);
    // Whole panels where that keeps the count (and stays within `fit`, which the
    // scratch is sized for); a thin last panel otherwise.
    let whole = block.next_multiple_of(nr).min(fit);
    if pixels.div_ceil(whole).is_multiple_of(parts.max(1))
        || pixels.div_ceil(whole) == pixels.div_ceil(block)
    {
        whole
    } else {
        block
    }
}

/// Bytes of input a block of output pixels may read: all of L2 when there is an
/// image (and group) for every thread, half of it when images are cut into blocks to
/// give every thread work.
///
/// With whole images per thread, larger blocks re-read the weights (streamed from L3
/// once per block) fewer times: at batch 32 on a 512 KiB L2, the CRNN's 3x3 stride-2
/// layer went from 13.0 to 11.1 ms and its 1x1 stride-2 projection from 9.6 to 8.6
/// ms against half of L2 (`conv_layers` example, alternating runs); at batch 1 the
/// larger budget measured 1% slower.
fn block_budget(whole_images: bool) -> usize {
    let l2 = crate::gemm::l2_cache_bytes();
    if whole_images { l2 } else { l2 / 2 }
}

/// The geometry of one convolution in wide coordinates.
#[derive(Clone, Copy)]
struct Geometry {
    /// Input channels per group, taps per filter.
    cg: usize,
    taps: usize,
    /// Input rows and columns.
    h: usize,
    w: usize,
    /// Output columns.
    ow: usize,
    /// Width of a phase plane (output columns plus junk).
    wq: usize,
    /// Phase planes per channel that some tap reads (a 1x1 stride-2 window reads one
    /// of its four).
    phases: usize,
    /// Bit `p` set when phase `p` is read (every phase when there are more than 64).
    phase_mask: u64,
    /// Phase rows a window reaches below its first (`(kh - 1) dy / sy`).
    reach: usize,
    /// Whether the input itself is the one phase plane (unit stride, no padding).
    in_place: bool,
    /// Whether the taps run as one GEMM over `(channel, tap)` rows packed into
    /// panels (see the module docs), with the weights as they are.
    packed: bool,
}

impl Geometry {
    fn new(win: &Window2d, cg: usize, [h, w]: [usize; 2], ow: usize) -> Geometry {
        let [sy, sx] = win.stride;
        let padded_width = w + win.padding[1] + win.padding[3];
        let unit_stride = win.stride == [1, 1];
        let taps = win.kernel[0] * win.kernel[1];
        let mask = phase_mask(win);
        Geometry {
            cg,
            taps,
            h,
            w,
            ow,
            wq: padded_width.div_ceil(sx),
            phases: if sy * sx > 64 {
                sy * sx
            } else {
                mask.count_ones() as usize
            },
            phase_mask: mask,
            reach: (win.kernel[0] - 1) * win.dilation[0] / sy,
            in_place: unit_stride && win.padding == [0; 4],
            packed: !by_tap(win, cg),
        }
    }

    /// Rows of the packed matrix (`cg * taps`), if packed.
    fn packed_rows(&self) -> usize {
        if self.packed { self.cg * self.taps } else { 0 }
    }

    /// Values per output pixel a block keeps in L2: its phase planes' and packed
    /// panels'.
    fn per_pixel(&self) -> usize {
        self.cg * self.phases + self.packed_rows()
    }

    /// Where phase `phase` lies among the phases kept (in planes of one channel).
    fn slot(&self, phase: usize) -> usize {
        if self.phase_mask == u64::MAX {
            phase
        } else {
            (self.phase_mask & ((1u64 << phase) - 1)).count_ones() as usize
        }
    }

    /// `(wide pixels, phase rows)` of a block of `width` output pixels from `first`.
    fn span(&self, first: usize, width: usize) -> (usize, usize) {
        let (y0, x0) = (first / self.ow, first % self.ow);
        let (y1, x1) = ((first + width - 1) / self.ow, (first + width - 1) % self.ow);
        ((y1 - y0) * self.wq + x1 + 1 - x0, y1 - y0 + self.reach + 1)
    }

    /// The largest `(wide pixels, phase rows)` of a block of `block` pixels.
    fn max_span(&self, block: usize) -> (usize, usize) {
        // A block starting anywhere in a row ends at most ceil(block / ow) rows on.
        let extra_rows = block.div_ceil(self.ow.max(1));
        (
            block + (self.wq - self.ow) * extra_rows,
            extra_rows + self.reach + 1,
        )
    }

    /// Floats of the phase planes of a block reading `rows` phase rows.
    fn planes_len(&self, rows: usize) -> usize {
        if self.in_place {
            0
        } else {
            self.phases * self.cg * rows * self.wq
        }
    }
}

/// The phases (`(ty % sy) * sx + tx % sx`) the taps of `win` read, as a bit mask; all
/// of them when there are more than 64.
fn phase_mask(win: &Window2d) -> u64 {
    let ([sy, sx], [kh, kw], [dy, dx]) = (win.stride, win.kernel, win.dilation);
    if sy * sx > 64 {
        return u64::MAX;
    }
    let mut mask = 0u64;
    for ky in 0..kh {
        for kx in 0..kw {
            mask |= 1 << ((ky * dy % sy) * sx + kx * dx % sx);
        }
    }
    mask
}

/// How an `f32` convolution runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum ConvMethod {
    /// Winograd's F(4x4, 3x3) (`winograd_f32`).
    Winograd,
    /// Output pixels as GEMM rows over `(in, ky, kx)` (`conv_pixels_f32`).
    Pixels,
    /// A GEMM per tap over phase planes (this file).
    Gemm,
    /// A stencil per plane, one input channel per group (`depthwise_f32`).
    Depthwise,
}

impl ConvMethod {
    /// The name kernel names use.
    pub(crate) fn name(self) -> &'static str {
        match self {
            ConvMethod::Winograd => "winograd",
            ConvMethod::Pixels => "pixels",
            ConvMethod::Gemm => "gemm",
            ConvMethod::Depthwise => "depthwise",
        }
    }
}

/// Winograd tiles (4 x 4 outputs, over the whole batch) below which the pixel-row
/// kernel wins: each point's GEMM has a row per tile, and under two row tiles of its
/// kernel (8 rows) the products run at a fraction of its speed while the weights, 4
/// times a 3x3 filter's, still stream in whole. Kernel time a run on 2 threads,
/// Winograd against pixel rows: 16 tiles (14 x 14) 0.55-0.84 ms against 0.76-1.5 at
/// 256 channels, 0.31 against 0.38 at 128, 0.067 against 0.076 at 128 -> 32; 9 tiles
/// (10 x 10, 256 channels) 0.46 against 0.39; 4 tiles (7 x 7) 1.3 against 0.94 at
/// 512 channels, 0.042 against 0.025 at 128 -> 32.
const WINOGRAD_MIN_TILES: usize = 16;

/// The one choice of how an `f32` convolution of `x` by `w` runs, for the
/// kernel, its scratch, its packed weights and its name.
///
/// Winograd first, for the 3x3 stride-1 windows with enough tiles: its 4 times fewer
/// products beat the pixel-row kernel (6 pixels by 64 channels a step with AVX-512)
/// on every such layer measured, kernel time a run on 2 threads: 64 -> 64 channels at
/// 112 x 112 3.2 ms against 5.1, 128 at 56 x 56 2.0 against 3.2, 256 at 28 x 28 1.7
/// against 3.7, 512 at 28 x 28 7.7 against 12.0, 64 -> 32 at 56 x 56 0.50 against 0.80.
/// With few tiles it loses (see [`WINOGRAD_MIN_TILES`]). Then the pixel-row kernel, for the other
/// multi-tap single-group windows with AVX-512, and with AVX2 (4 times fewer channels
/// a step) the strided ones.
pub(crate) fn method(win: &Window2d, groups: usize, x: &Shape, w: &Shape) -> ConvMethod {
    if depthwise_f32::applies(groups, x, w) {
        return ConvMethod::Depthwise;
    }
    let (cg, og) = (w.dim(1), w.dim(0) / groups.max(1));
    let taps = win.kernel[0] * win.kernel[1];
    let (oh, ow) = (extent(win, 0, x.dim(2)), extent(win, 1, x.dim(3)));
    let tiles = winograd_f32::tiles(x.dim(0), [oh, ow], win.dilation);
    // Tiles computed past the output (a dilation wider than a quarter of the
    // output leaves most of each phase's tile empty) at most double the products.
    let covered = tiles * 16 <= 2 * x.dim(0) * oh * ow;
    if winograd_f32::applies(win, groups, cg, og) && tiles >= WINOGRAD_MIN_TILES && covered {
        return ConvMethod::Winograd;
    }
    let pixels =
        conv_pixels_f32::applies(win, groups, x) && (taps > 1 || pointwise_by_pixels(win, x, cg));
    if pixels && (crate::isa::isa().avx512f || win.stride != [1, 1]) {
        return ConvMethod::Pixels;
    }
    ConvMethod::Gemm
}

/// Whether a convolution that [`method`] runs by Winograd should keep to it where
/// its input or output could be channel-blocked instead (the blocked direct
/// kernel, [`super::blocked_conv_f32`]): where its 36 products per tile are deep
/// enough (64 input channels or more) and its tiles cover little past the output.
/// Alternating per-layer runs on 2 threads: 64 -> 64 channels at 56 x 56 took
/// 0.78 ms by Winograd against 1.08 direct, and 128 -> 32 at 56 x 56 0.85 against
/// 1.21; 32 -> 128 at 27 x 27 took 0.295 against 0.263, and 64 -> 256 at 13 x 13
/// (tiles covering 1.5 times the output) 0.245 against 0.244.
pub(crate) fn winograd_over_blocks(win: &Window2d, x: &Shape, w: &Shape) -> bool {
    let (oh, ow) = (extent(win, 0, x.dim(2)), extent(win, 1, x.dim(3)));
    let tiles = winograd_f32::tiles(x.dim(0), [oh, ow], win.dilation);
    let pixels = x.dim(0) * oh * ow;
    method(win, groups_of(x, w), x, w) == ConvMethod::Winograd
        && w.dim(1) >= 64
        && tiles * 16 * 10 <= pixels * 14
}

/// Input channels from which a 1x1 convolution's products outweigh the pixel-row
/// kernel's transposed stores.
const POINTWISE_PIXELS_MIN_CHANNELS: usize = 64;

/// Whether a 1x1 convolution over `cg` input channels runs on the pixel-row kernel
/// (AVX-512): where the GEMM's panels (48 columns, the last one 16 or 32 wide)
/// would compute many more columns past the pixels than the pixel kernel's tiles
/// of 6 do. A 7 x 7 plane is 49 pixels: 64 columns of products against 54,
/// and ResNet-50's last 1x1 layers ran in 0.62-0.66 ms this way against 0.80-0.81
/// as GEMMs (2048 -> 512 and 512 -> 2048 channels, alternating runs); 14 x 14
/// planes (208 columns for 196 pixels) stay GEMMs.
fn pointwise_by_pixels(win: &Window2d, x: &Shape, cg: usize) -> bool {
    let p = extent(win, 0, x.dim(2)) * extent(win, 1, x.dim(3));
    // Under one tile of pixels the GEMM wins: one pixel is a matrix-vector product
    // there (`gemm::gemv`), six times fewer products than a tile.
    if !crate::isa::isa().avx512f
        || cg < POINTWISE_PIXELS_MIN_CHANNELS
        || p < conv_pixels_f32::TILE_PIXELS
    {
        return false;
    }
    let nr = crate::gemm::packed_panel_width(p);
    let gemm_columns = p / nr * nr + (p % nr).next_multiple_of(16);
    let pixel_columns = p.next_multiple_of(conv_pixels_f32::TILE_PIXELS);
    gemm_columns * 100 > pixel_columns * 115
}

/// Per-thread floats an f32 convolution needs, from its input and weight shapes: the
/// phase planes of a block, its packed panels (when it packs) and its product before the junk
/// columns are dropped; for a Winograd convolution, its staged rows, transformed
/// patches and products.
pub(crate) fn thread_floats(win: &Window2d, x: &Shape, w: &Shape) -> usize {
    let (oh, ow) = (extent(win, 0, x.dim(2)), extent(win, 1, x.dim(3)));
    match method(win, groups_of(x, w), x, w) {
        ConvMethod::Winograd => {
            return winograd_f32::thread_floats(x, w, [oh, ow], win.dilation);
        }
        ConvMethod::Pixels => return conv_pixels_f32::thread_floats(win, x, w, [oh, ow]),
        ConvMethod::Depthwise => return depthwise_f32::thread_floats(win, x),
        ConvMethod::Gemm => {}
    }
    let geo = Geometry::new(win, w.dim(1), [x.dim(2), x.dim(3)], ow);
    // The largest block any thread count gives.
    let block = pixel_block(geo.per_pixel(), oh * ow, block_budget(true));
    let (wide, rows) = geo.max_span(block);
    let panels = if geo.packed {
        crate::gemm::packed_len_up_to(geo.packed_rows(), wide)
    } else {
        0
    };
    // Output channels per group (`x`'s channels over `w`'s per group is the groups).
    let og = w.dim(0) / groups_of(x, w);
    let product = if geo.wq > ow { og * wide } else { 0 };
    panels + geo.planes_len(rows) + product
}

/// Whether a fused convolution's input prologue (`pre(x * in_scale + in_shift)`) is
/// applied while its input is packed into panels: an `f32` 1x1 unit-stride, unpadded
/// convolution (it reads each input value once) whose activation the GEMM epilogue
/// has, and that runs on the per-tap GEMMs (not a depthwise one, whose kernel reads
/// its input as it is). Other convolutions get a copy of the input with the
/// prologue applied.
pub(crate) fn prologue_while_packing(
    win: &Window2d,
    (x, w): (&Shape, &Shape),
    activation: Option<rlx_ir::UnaryOp>,
) -> bool {
    x.dtype() == rlx_ir::DType::F32
        && method(win, groups_of(x, w), x, w) == ConvMethod::Gemm
        && win.kernel == [1, 1]
        && win.stride == [1, 1]
        && win.padding == [0; 4]
        && activation.is_none_or(|a| super::fused::gemm_activation(a).is_some())
}

/// Groups of a convolution: `x`'s channels over `w`'s per group.
pub(crate) fn groups_of(x: &Shape, w: &Shape) -> usize {
    (x.dim(1) / w.dim(1).max(1)).max(1)
}

/// Past this many taps a convolution packs its `(channel, tap)` rows even with many
/// channels: per tap, every tap's product reads and writes the whole output block
/// again for a depth of only `cg` (wav2vec2's 128-tap grouped positional
/// convolution took 15.6 ms per tap, 6.8 ms packed).
const PER_TAP_MAX_TAPS: usize = 25;

/// Whether a convolution with `cg` input channels per group multiplies per tap and
/// so reads its weights regrouped by tap.
pub(crate) fn by_tap(win: &Window2d, cg: usize) -> bool {
    let taps = win.kernel[0] * win.kernel[1];
    taps > 1 && taps <= PER_TAP_MAX_TAPS && cg >= PER_TAP_MIN_CHANNELS
}

/// `f64` scratch an f32 convolution needs: its weights regrouped by tap (or
/// transformed for Winograd), for when the step has no copy made ahead.
pub(crate) fn scratch_f64(win: &Window2d, x: &Shape, w: &Shape) -> usize {
    match method(win, groups_of(x, w), x, w) {
        ConvMethod::Winograd => winograd_f32::weights_len(w.dim(1), w.dim(0)).div_ceil(2),
        ConvMethod::Pixels => {
            conv_pixels_f32::weights_len(w.dim(0), w.num_elements() / w.dim(0).max(1)).div_ceil(2)
        }
        ConvMethod::Gemm if by_tap(win, w.dim(1)) => w.num_elements().div_ceil(2),
        ConvMethod::Gemm | ConvMethod::Depthwise => 0,
    }
}

/// Copies OIHW weights (`groups * og` filters of `cg x taps`) into `out` as
/// `[group][tap][og][cg]`: tap `t`'s `og x cg` matrix of group `g` starts at
/// `(g * taps + t) * og * cg`.
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

/// The convolution: one pool task per image, group, block of output pixels and
/// part of the output channels.
pub(crate) fn conv2d(
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
    let p = oh * ow;
    if p == 0 || og == 0 || n == 0 {
        return Ok(());
    }
    let activation = epilogue.activation.map(super::fused::gemm_activation);
    let post = epilogue.post_activation.map(super::fused::gemm_activation);
    if matches!(activation, Some(None))
        || matches!(post, Some(None))
        || (post.is_some() && epilogue.channel_affine.is_none())
    {
        // An activation the GEMM epilogue lacks (or one with no channel affine
        // before it): the convolution (with its prologue), then the epilogue over the
        // output.
        let plain = ConvEpilogue {
            input_affine: epilogue.input_affine,
            input_activation: epilogue.input_activation,
            ..ConvEpilogue::default()
        };
        conv2d(win, groups, [x, w], bias, plain, out, ctx)?;
        super::conv::apply_epilogue(epilogue, out);
        return Ok(());
    }
    let activation = activation.flatten();
    // SAFETY: f32 tensors of `o` values each.
    let affine = epilogue.channel_affine.map(|(scale, shift)| unsafe {
        (
            std::slice::from_raw_parts(scale.ptr.cast::<f32>(), scale.len),
            std::slice::from_raw_parts(shift.ptr.cast::<f32>(), shift.len),
            post.flatten(),
        )
    });
    // SAFETY: f32 tensors of `c` values each.
    let input_affine = epilogue.input_affine.map(|(scale, shift)| unsafe {
        (
            std::slice::from_raw_parts(scale.ptr.cast::<f32>(), scale.len),
            std::slice::from_raw_parts(shift.ptr.cast::<f32>(), shift.len),
        )
    });
    let input_activation = epilogue
        .input_activation
        .and_then(super::fused::gemm_activation);
    let has_prologue = epilogue.has_prologue();
    let chosen = method(win, groups, x.shape, w.shape);
    if chosen == ConvMethod::Winograd {
        debug_assert!(!has_prologue, "only a packing convolution takes a prologue");
        let finish = (activation, epilogue.residual, affine);
        return winograd(win, [x, w], bias, finish, (out, Default::default()), ctx);
    }
    if chosen == ConvMethod::Pixels {
        debug_assert!(!has_prologue, "only a packing convolution takes a prologue");
        let finish = conv_pixels_f32::Finish {
            // SAFETY: an f32 tensor of `o` values.
            bias: bias.map(|b| unsafe { std::slice::from_raw_parts(b.ptr.cast::<f32>(), b.len) }),
            activation,
            residual: epilogue.residual,
            affine,
        };
        return pixels(win, [x, w], finish, out, ctx);
    }
    if chosen == ConvMethod::Depthwise && !has_prologue {
        let finish = conv_pixels_f32::Finish {
            // SAFETY: an f32 tensor of `o` values.
            bias: bias.map(|b| unsafe { std::slice::from_raw_parts(b.ptr.cast::<f32>(), b.len) }),
            activation,
            residual: epilogue.residual,
            affine,
        };
        return depthwise_f32::conv2d(win, [x, w], finish, out, (ctx.gemm, ctx.pool));
    }
    let geo = Geometry::new(win, cg, [h, wd], ow);
    let threads = ctx.gemm.threads();
    let images = n * groups;
    let fit = pixel_block(geo.per_pixel(), p, block_budget(images >= threads));
    // Cut so that every thread has a block: by pixels, or by output channels where
    // a thread's share of the pixels would be only a few kernel panels wide.
    let parts = threads.div_ceil(images);
    let by_channels = images < threads && p.div_ceil(parts) < NARROW_PIXELS && og >= 16 * parts;
    let block = if images >= threads || by_channels {
        fit
    } else {
        even_block(p, parts, fit)
    };
    let blocks = p.div_ceil(block);
    let (channel_parts, part_channels) = if by_channels {
        (parts, og.div_ceil(parts).next_multiple_of(8))
    } else {
        (1, og)
    };
    let (wide_max, _) = geo.max_span(block);
    // SAFETY: the operands are f32 tensors of the shapes read above, and the plan
    // never places the output over an input.
    let (xs, ws) = unsafe {
        (
            std::slice::from_raw_parts(x.ptr.cast::<f32>(), x.len),
            std::slice::from_raw_parts(w.ptr.cast::<f32>(), w.len),
        )
    };
    let weights: &[f32] = if !by_tap(win, cg) {
        ws
    } else if let Some(packed) = ctx.packed_b.filter(|p| {
        p.fits(crate::prepack::PackSpec::ConvTaps {
            groups,
            og,
            cg,
            taps: geo.taps,
        })
    }) {
        // Regrouped when the param was set.
        packed.values()
    } else {
        // SAFETY: the step asked for `scratch_f64` values: room for every weight as
        // f32 (f64 storage is aligned for f32).
        let regrouped = unsafe {
            std::slice::from_raw_parts_mut(ctx.scratch.as_mut_ptr().cast::<f32>(), ws.len())
        };
        regroup_by_tap(ws, [groups, og, cg, geo.taps], regrouped);
        regrouped
    };
    // Addresses, so tasks on other threads can write their blocks.
    let out_addr = out.ptr as usize;
    let residual_addr = epilogue.residual.map(|r| r.ptr as usize);
    // SAFETY: an f32 tensor of `o` values.
    let bias = bias.map(|b| unsafe { std::slice::from_raw_parts(b.ptr.cast::<f32>(), b.len) });
    let task = |u: usize, thread: usize| {
        let (u, part) = (u / channel_parts, u % channel_parts);
        let c0 = part * part_channels;
        let rows = part_channels.min(og.saturating_sub(c0));
        if rows == 0 {
            return;
        }
        let (image, rest) = (u / (groups * blocks), u % (groups * blocks));
        let (g, j0) = (rest / blocks, (rest % blocks) * block);
        let width = block.min(p - j0);
        let first_channel = (image * o + g * og + c0) * p;
        let channels = g * og + c0..g * og + c0 + rows;
        let dst = BlockOut {
            // SAFETY: rows `g * og ..` of image `image`'s output: inside `out`.
            out: unsafe { (out_addr as *mut f32).add(first_channel) },
            // SAFETY: the residual has the output's shape.
            residual: residual_addr.map(|r| unsafe { (r as *const f32).add(first_channel) }),
            bias: bias.map(|b| &b[channels.clone()]),
            activation,
            affine: affine.map(|(s, t, a)| (&s[channels.clone()], &t[channels.clone()], a)),
            pixels: p,
        };
        // SAFETY: one task per thread index at a time.
        let (gemm_buf, extra) = unsafe { ctx.gemm.parts(thread) };
        let block_task = BlockTask {
            win,
            geo: &geo,
            src: &xs[(image * c + g * cg) * h * wd..][..cg * h * wd],
            // By tap, tap t's rows start `og * cg` after tap 0's; as stored, a
            // channel's row is `cg * taps` long.
            weights: if by_tap(win, cg) {
                &weights[(g * og * geo.taps + c0) * cg..][..((geo.taps - 1) * og + rows) * cg]
            } else {
                &weights[(g * og + c0) * cg * geo.taps..][..rows * cg * geo.taps]
            },
            og: rows,
            tap_stride: og * cg,
            first: j0,
            width,
            wide_max,
            prologue: has_prologue.then(|| Prologue {
                affine: input_affine
                    .map(|(s, t)| (&s[g * cg..(g + 1) * cg], &t[g * cg..(g + 1) * cg])),
                activation: input_activation,
            }),
        };
        block_task.run(dst, gemm_buf, extra);
    };
    ctx.pool
        .run(n * groups * blocks * channel_parts, threads, &task)
}

/// The convolution by [`winograd_f32`], with the weights transformed ahead (a param)
/// or into the step's scratch, in and out of the layouts `blocks` says.
pub(crate) fn winograd(
    win: &Window2d,
    [x, w]: [Src; 2],
    bias: Option<Src>,
    (activation, residual, affine): (Option<Activation>, Option<Src>, Option<ChannelAffine>),
    (out, blocks): (Dst, conv_pixels_f32::BlockedIo),
    ctx: &mut Ctx,
) -> Result<()> {
    let (cg, og) = (w.shape.dim(1), w.shape.dim(0));
    let spec = crate::prepack::PackSpec::Winograd { cg, og };
    let transformed: &[f32] = if let Some(packed) = ctx.packed_b.filter(|p| p.fits(spec)) {
        packed.values()
    } else {
        // SAFETY: an f32 tensor of `w.len` values.
        let ws = unsafe { std::slice::from_raw_parts(w.ptr.cast::<f32>(), w.len) };
        let len = winograd_f32::weights_len(cg, og);
        // SAFETY: the step asked for `scratch_f64` values: room for `len` f32 values
        // (f64 storage is aligned for f32).
        let values =
            unsafe { std::slice::from_raw_parts_mut(ctx.scratch.as_mut_ptr().cast::<f32>(), len) };
        winograd_f32::transform_weights(ws, cg, og, values);
        values
    };
    // The scratch is read-only from here on: a shared view the tasks can hold.
    // SAFETY: the values stay in place for the call and nothing writes them.
    let transformed =
        unsafe { std::slice::from_raw_parts(transformed.as_ptr(), transformed.len()) };
    let finish = conv_pixels_f32::Finish {
        // SAFETY: an f32 tensor of `og` values.
        bias: bias.map(|b| unsafe { std::slice::from_raw_parts(b.ptr.cast::<f32>(), b.len) }),
        activation,
        residual,
        affine,
    };
    winograd_f32::conv2d(
        win,
        x,
        transformed,
        finish,
        (out, blocks),
        (ctx.gemm, ctx.pool),
    )
}

/// The convolution by [`conv_pixels_f32`], with the weights packed ahead (a param) or
/// into the step's scratch.
fn pixels(
    win: &Window2d,
    [x, w]: [Src; 2],
    finish: conv_pixels_f32::Finish,
    out: Dst,
    ctx: &mut Ctx,
) -> Result<()> {
    let (packed, _) = pixel_weights(
        w,
        conv_pixels_f32::StepOrder::NATURAL,
        ctx.packed_b,
        ctx.scratch,
    );
    conv_pixels_f32::conv2d(
        win,
        x,
        packed,
        (finish, None),
        out,
        conv_pixels_f32::BlockedIo::default(),
        (ctx.gemm, ctx.pool),
    )
}

/// A convolution's weights `w` in the pixel kernel's panels: `packed` ahead (a
/// param), or packed into the front of `scratch`; with the rest of the scratch.
pub(crate) fn pixel_weights<'s>(
    w: Src<'_>,
    order: conv_pixels_f32::StepOrder,
    packed: Option<&'s crate::prepack::PackedParam>,
    scratch: &'s mut [f64],
) -> (&'s [f32], &'s mut [f64]) {
    let o = w.shape.dim(0);
    let k = w.len / o.max(1);
    let spec = crate::prepack::PackSpec::ConvPixels { o, k, order };
    let len = conv_pixels_f32::weights_len(o, k);
    match packed.filter(|p| p.fits(spec)) {
        Some(packed) => (packed.values(), &mut scratch[len.div_ceil(2)..]),
        None => {
            let (weights, rest) = scratch.split_at_mut(len.div_ceil(2));
            // SAFETY: the step asked for `scratch_f64`: room for `len` f32 values
            // here (f64 storage is aligned for f32); an f32 tensor of `w.len`
            // values, alive for the step.
            let (values, ws) = unsafe {
                (
                    std::slice::from_raw_parts_mut(weights.as_mut_ptr().cast::<f32>(), len),
                    std::slice::from_raw_parts(w.ptr.cast::<f32>(), w.len),
                )
            };
            conv_pixels_f32::pack_weights_in(ws, o, k, order, values);
            (values, rest)
        }
    }
}

/// Room in `scratch` for [`pixel_weights`] to be changed there: the values packed
/// ahead, if any (to be read into the room), else the room holds them packed.
/// Returns them, the room and the rest of the scratch.
pub(crate) fn pixel_weights_room<'s, 'p>(
    w: Src<'_>,
    packed: Option<&'p crate::prepack::PackedParam>,
    scratch: &'s mut [f64],
) -> (Option<&'p [f32]>, &'s mut [f32], &'s mut [f64]) {
    let o = w.shape.dim(0);
    let k = w.len / o.max(1);
    let len = conv_pixels_f32::weights_len(o, k);
    let (weights, rest) = scratch.split_at_mut(len.div_ceil(2));
    // SAFETY: the step asked for `scratch_f64`: room for `len` f32 values here
    // (f64 storage is aligned for f32).
    let values = unsafe { std::slice::from_raw_parts_mut(weights.as_mut_ptr().cast::<f32>(), len) };
    let spec = crate::prepack::PackSpec::ConvPixels {
        o,
        k,
        order: conv_pixels_f32::StepOrder::NATURAL,
    };
    match packed.filter(|p| p.fits(spec)) {
        Some(packed) => (Some(&packed.values()[..len]), values, rest),
        None => {
            // SAFETY: an f32 tensor of `w.len` values, alive for the step.
            let ws = unsafe { std::slice::from_raw_parts(w.ptr.cast::<f32>(), w.len) };
            conv_pixels_f32::pack_weights(ws, o, k, values);
            (None, values, rest)
        }
    }
}

/// `(scale, shift, post)`: a batch norm and activation after the residual, one scale
/// and shift per output channel.
pub(crate) type ChannelAffine<'a> = (&'a [f32], &'a [f32], Option<Activation>);

/// Where one image and group's output goes and what is applied on the way.
struct BlockOut<'a> {
    /// The group's first output channel of the image (`og` rows of `pixels`).
    out: *mut f32,
    /// The residual at the same place, if any.
    residual: Option<*const f32>,
    /// The group's `og` bias values.
    bias: Option<&'a [f32]>,
    activation: Option<Activation>,
    /// The group's channels' affine and activation after the residual, if any.
    affine: Option<ChannelAffine<'a>>,
    /// Output pixels per channel.
    pixels: usize,
}

/// One block of output pixels of one image and group.
struct BlockTask<'a> {
    win: &'a Window2d,
    geo: &'a Geometry,
    /// The group's `cg` input planes of the image.
    src: &'a [f32],
    /// The group's weights: by tap when it multiplies per tap, else as stored
    /// (`[og][cg * taps]`).
    weights: &'a [f32],
    /// Output channels the block computes (the group's, or a part of them).
    og: usize,
    /// By tap, floats from one tap's weights to the next's.
    tap_stride: usize,
    first: usize,
    width: usize,
    /// The widest block the scratch was sized for.
    wide_max: usize,
    /// What the group's input channels go through as they are packed (only for an
    /// unpadded convolution that packs: see [`prologue_while_packing`]).
    prologue: Option<Prologue<'a>>,
}

/// A fused convolution's input prologue for one group: `act(x * scale[c] +
/// shift[c])`.
#[derive(Clone, Copy)]
struct Prologue<'a> {
    affine: Option<(&'a [f32], &'a [f32])>,
    activation: Option<Activation>,
}

impl BlockTask<'_> {
    /// Builds the block's phase planes (unless the input is one), multiplies, and
    /// stores the valid pixels with the bias, activation and residual.
    fn run(&self, dst: BlockOut, gemm_buf: &mut [f32], extra: &mut [f32]) {
        let (geo, win) = (self.geo, self.win);
        let (cg, wq, ow) = (geo.cg, geo.wq, geo.ow);
        let (y0, x0) = (self.first / ow, self.first % ow);
        let (wide, rows) = geo.span(self.first, self.width);
        let nr = crate::gemm::packed_panel_width(wide);
        let panels_len = if geo.packed {
            crate::gemm::packed_len_up_to(geo.packed_rows(), self.wide_max)
        } else {
            0
        };
        let (panels, rest) = extra.split_at_mut(panels_len);
        // The planes as `(floats, offset of phase row 0, plane stride)`; phase
        // `(py, px)` of channel `ci` starts at `((py * sx + px) * cg + ci) * stride`.
        let (planes, first_row, plane_len, rest): (&[f32], usize, usize, &mut [f32]) =
            if geo.in_place {
                (self.src, y0 * geo.w, geo.h * geo.w, rest)
            } else {
                let (planes, rest) = rest.split_at_mut(geo.planes_len(rows));
                fill_phase_planes(win, geo, self.src, y0, rows, planes);
                (planes, 0, rows * wq, rest)
            };
        let direct = wq == ow;
        let (c_ptr, ldc) = if direct {
            // No junk columns: the product goes straight to the output.
            // SAFETY: pixels first.. of every channel row lie inside the output.
            (unsafe { dst.out.add(self.first) }, dst.pixels)
        } else {
            (rest[..self.og * wide].as_mut_ptr(), wide)
        };
        // The bias goes in with the last product's epilogue (or as the valid pixels
        // are stored): filling `C` with it first was one more pass over the block.
        let epilogue = if direct {
            Epilogue {
                row_bias: dst.bias.map(|b| b.as_ptr()),
                row_affine: dst.affine.map(|(s, t, a)| (s.as_ptr(), t.as_ptr(), a)),
                activation: dst.activation,
                // SAFETY: the residual has the output's layout.
                residual: dst
                    .residual
                    .map(|r| (unsafe { r.add(self.first) }, dst.pixels)),
                ..Epilogue::NONE
            }
        } else {
            Epilogue::NONE
        };
        let base = Gemm {
            m: self.og,
            n: wide,
            k: cg,
            a: self.weights.as_ptr(),
            lda: cg,
            b: planes.as_ptr(),
            ldb: plane_len,
            a_transposed: false,
            b_transposed: false,
            b_format: BFormat::F32,
            c: c_ptr,
            ldc,
            accumulate: false,
            epilogue,
        };
        let place = PlanePlace {
            first_row,
            x0,
            plane_len,
            rows,
        };
        if geo.packed {
            let k = geo.packed_rows();
            pack_block(win, geo, planes, place, (wide, nr), self.prologue, panels);
            let gemm = Gemm {
                k,
                lda: k,
                b: panels.as_ptr(),
                ldb: wide,
                // The panels were just packed: in cache.
                b_format: BFormat::Packed {
                    nr,
                    streamed: false,
                },
                ..base
            };
            // SAFETY: A is `og x k`, B the packed panels of a `k x wide` matrix, C
            // `og x wide` with row stride `ldc` (the output's rows or the product).
            unsafe { sgemm_serial(&gemm, gemm_buf) };
        } else {
            debug_assert!(self.prologue.is_none(), "B is read in place: no prologue");
            for t in 0..geo.taps {
                let gemm = Gemm {
                    a: self.weights[t * self.tap_stride..].as_ptr(),
                    b: planes[tap_offset(win, geo, place, t)..].as_ptr(),
                    accumulate: t > 0,
                    epilogue: if t + 1 == geo.taps {
                        epilogue
                    } else {
                        Epilogue::NONE
                    },
                    ..base
                };
                // SAFETY: A is tap t's `og x cg` matrix; B's rows (one per channel,
                // `plane_len` apart) hold `wide` values from the tap's offset inside
                // each plane (the span keeps the last one inside); C as above.
                unsafe { sgemm_serial(&gemm, gemm_buf) };
            }
        }
        if !direct {
            store_valid(&rest[..self.og * wide], wide, wq, (y0, x0), self, &dst);
        }
    }
}

/// Where a block's phase planes lie in the floats it multiplies from.
#[derive(Clone, Copy)]
struct PlanePlace {
    /// Offset of phase row 0 in each plane.
    first_row: usize,
    /// The block's first output column (its first pixel's column).
    x0: usize,
    /// Floats from one plane to the next.
    plane_len: usize,
    /// Phase rows the block reads.
    rows: usize,
}

/// Where tap `t`'s operand starts in the planes (channel 0): its phase's planes,
/// shifted by the tap's offset in wide coordinates.
#[inline(always)]
fn tap_offset(win: &Window2d, geo: &Geometry, place: PlanePlace, t: usize) -> usize {
    let kw = win.kernel[1];
    let ([sy, sx], [dy, dx]) = (win.stride, win.dilation);
    let (ty, tx) = ((t / kw) * dy, (t % kw) * dx);
    let phase = (ty % sy) * sx + tx % sx;
    geo.slot(phase) * geo.cg * place.plane_len
        + place.first_row
        + (ty / sy) * geo.wq
        + tx / sx
        + place.x0
}

multiversion! {
    /// Copies the block's `(channel, tap)` rows (`wide` values each, from the phase
    /// planes) into packed GEMM panels `nr` wide, through the prologue if there is
    /// one; compiled per instruction set (inside the task closure these copies ran as
    /// baseline code, with a software popcount per row).
    fn pack_block(
        win: &Window2d,
        geo: &Geometry,
        planes: &[f32],
        place: PlanePlace,
        dims: (usize, usize),
        prologue: Option<Prologue>,
        panels: &mut [f32]
    ) {
        let (wide, nr) = dims;
        let (cg, taps, k) = (geo.cg, geo.taps, geo.packed_rows());
        let span = place.rows * geo.wq;
        for t in 0..taps {
            let offset = tap_offset(win, geo, place, t);
            for ci in 0..cg {
                if geo.in_place && t == 0 && ci + 1 < cg {
                    prefetch_span(&planes[(ci + 1) * place.plane_len + place.first_row..][..span]);
                }
                let run = &planes[ci * place.plane_len + offset..][..wide];
                // Row `ci * taps + t`: the weights' own order.
                let row = ci * taps + t;
                if let Some(p) = prologue {
                    debug_assert!(win.padding == [0; 4], "a prologue would change padding");
                    let affine = crate::gemm::RowAffine {
                        scale: p.affine.map_or(1.0, |(s, _)| s[ci]),
                        shift: p.affine.map_or(0.0, |(_, t)| t[ci]),
                        activation: p.activation,
                    };
                    crate::gemm::affine_scatter_row(run, (row, k, nr), panels, affine);
                } else {
                    scatter_to_panels(run, row, k, nr, panels);
                }
            }
        }
    }
}

multiversion! {
    /// Fills `planes` with the phase planes of `rows` phase rows from `y0` (see the
    /// module docs), zero where they fall in the padding; compiled per instruction
    /// set (these copies ran as baseline SSE code inside the task closure).
    fn fill_phase_planes(
        win: &Window2d,
        geo: &Geometry,
        src: &[f32],
        y0: usize,
        rows: usize,
        planes: &mut [f32]
    ) {
    let ([sy, sx], [pt, pl]) = (win.stride, [win.padding[0], win.padding[1]]);
    let (h, w, wq) = (geo.h, geo.w, geo.wq);
    let per_channel = rows * wq;
    let used = (0..sy * sx).filter(|&p| p >= 64 || geo.phase_mask & (1 << p) != 0);
    let plane_of = used.flat_map(|phase| (0..geo.cg).map(move |ci| (phase, ci)));
    for ((phase, ci), plane) in plane_of.zip(planes.chunks_exact_mut(per_channel)) {
        let (py, px) = (phase / sx, phase % sx);
        // Columns j of the phase read input column j * sx + px - pl: inside for
        // j_lo..j_hi.
        let j_lo = pl.saturating_sub(px).div_ceil(sx).min(wq);
        let j_hi = if w + pl > px {
            ((w + pl - px - 1) / sx + 1).clamp(j_lo, wq)
        } else {
            j_lo
        };
        for (r, line) in plane.chunks_exact_mut(wq).enumerate() {
            let iy = ((y0 + r) * sy + py) as isize - pt as isize;
            if !(0..h as isize).contains(&iy) {
                line.fill(0.0);
                continue;
            }
            let row = &src[(ci * h + iy as usize) * w..][..w];
            line[..j_lo].fill(0.0);
            line[j_hi..].fill(0.0);
            let start = j_lo * sx + px - pl;
            if sx == 1 {
                line[j_lo..j_hi].copy_from_slice(&row[start..start + (j_hi - j_lo)]);
            } else if sx == 2 {
                // Whole pairs with a fixed stride vectorize (as shuffles of whole
                // vectors); a runtime step, or a last pair that may be cut short,
                // does not.
                let n = j_hi - j_lo;
                let whole = ((w - start) / 2).min(n);
                let pairs = row[start..start + 2 * whole].chunks_exact(2);
                for (v, pair) in line[j_lo..j_lo + whole].iter_mut().zip(pairs) {
                    *v = pair[0];
                }
                if whole < n {
                    line[j_lo + whole] = row[start + 2 * whole];
                }
            } else {
                for (v, &x) in line[j_lo..j_hi]
                    .iter_mut()
                    .zip(row[start..].iter().step_by(sx))
                {
                    *v = x;
                }
            }
        }
    }
}
}

/// Stores each output row's valid run of the block's `product` (`og` rows of `wide`
/// wide pixels from `(y0, x0)`), dropping the junk columns, with the bias, activation,
/// residual and channel affine.
fn store_valid(
    product: &[f32],
    wide: usize,
    wq: usize,
    (y0, x0): (usize, usize),
    block: &BlockTask,
    dst: &BlockOut,
) {
    let ow = block.geo.ow;
    let last = block.first + block.width - 1;
    let (y1, x1) = (last / ow, last % ow);
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
            out.copy_from_slice(&prow[(y - y0) * wq + xs - x0..][..xe - xs]);
            let shift = dst.bias.map_or(0.0, |b| b[co]);
            let affine = dst.affine.map(|(s, t, activation)| crate::gemm::RowAffine {
                scale: s[co],
                shift: t[co],
                activation,
            });
            if shift != 0.0 || dst.activation.is_some() || residual.is_some() || affine.is_some() {
                crate::gemm::activate_and_add(out, shift, dst.activation, residual, affine);
            }
        }
    }
}

/// Asks for every cache line of `values` to be brought into L1: a plane's rows are
/// a short run read once, which the hardware prefetchers do not catch in time.
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
        dst[chunk.len()..].fill(0.0);
    }
}

/// `dst.copy_from_slice(src)` for short runs, in fixed-size pieces the compiler keeps
/// inline: a `memmove` call per run cost more than the copy.
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
    } else {
        for (d, &s) in dst.iter_mut().zip(src) {
            *d = s;
        }
    }
}
