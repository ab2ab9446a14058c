//! `f32` convolutions whose input or output is channel-blocked
//! ([`crate::layout`]: blocks of 16 channels, a last one of 8 where the channels
//! end there).
//!
//! - **Pointwise** (1x1, unit stride, no padding, one group; input and output each
//!   plain or blocked): output pixels are the product's rows, as in
//!   [`super::conv_pixels_f32`], and its micro-kernel runs unchanged. Each step
//!   broadcasts one input value per pixel from a table of channel offsets, so the
//!   input is read in place in either layout (a last block of 8 as a tail of the
//!   steps, from pixel bases 8 floats apart): no packing and no staged copy (but
//!   for an input prologue: an affine alone over many more pixels than filters
//!   folded into the weights, [`fold_prologue`], else applied to a per-task copy
//!   in its layout, a block in one pass). A blocked output is stored as the
//!   micro-kernel holds it (pixels by 16 channels; a last block of 8 takes a
//!   panel's first half); a plain one is transposed into channel rows. With 512 or
//!   more input channels the micro-kernel asks for its weights ahead.
//! - **Depthwise** (one channel per group; blocked in and out; any window, stride,
//!   dilation and padding): a block of channels per vector (a last block of 8 in
//!   the low half, under a lane mask), each output vector the sum of
//!   its taps' input vectors scaled by the tap's 16 weights. Runs of output pixels
//!   keep their sums in registers across all taps. Inside a row, for kernels 3, 5
//!   or 7 wide at stride 1 or 2, a run loads each input vector of a row of taps
//!   once and adds it to every sum that reads it ([`run_fixed`]). Rows shorter
//!   than [`STAGED_ROW`] are computed from a copy of their input rows with the
//!   padding written as zeros, so no tap is checked; in longer rows, the runs of a
//!   fixed-width window whose columns cross the left or right edge mask those
//!   columns' loads off, and other windows' edge runs check each tap. A finish whose steps
//!   all have a vector form is applied to each sum as it is stored.
//!
//! - **Grouped** (groups of 2 to 16 channels inside the blocks; blocked in and
//!   out): each block a dense convolution by filters over the block
//!   ([`conv_pixels_f32::conv2d_block_groups`]).
//!
//! Otherwise the epilogue (bias, activation, residual, channel affine) runs on
//! each finished piece while it is in L1.

use super::conv_pixels_f32::{self, Finish, MR, NR, TILE};
use crate::gemm::GemmScratch;
use crate::layout::{BLOCK, Blocks, HALF, StepLayout};
use crate::pool::ThreadPool;
use crate::tensor::{Dst, Src};
use rlx_ir::{DType, Result, Shape, Window2d};

#[cfg(target_arch = "x86_64")]
mod depthwise_avx2;

/// A convolution kernel for blocked values.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BlockedConv {
    /// 1x1, unit stride, unpadded, one group; any layouts.
    Pointwise,
    /// One input channel per output channel, blocked input and output.
    Depthwise,
    /// Any other window of one group that [`conv_pixels_f32`] runs (3x3 layers,
    /// strided 1x1 ones, stems), input and output each plain or blocked.
    Dense,
    /// A 3x3 layer that runs better by Winograd's transform
    /// ([`super::conv_f32::winograd_over_blocks`]), input and output each plain or
    /// blocked.
    Winograd,
    /// Groups of 2 to 16 channels, as many outputs as inputs each, that lie
    /// inside blocks of 16 (RegNet's, ResNeXt's): blocked input and output, each
    /// block a dense convolution ([`conv_pixels_f32::conv2d_block_groups`]).
    Grouped,
}

impl BlockedConv {
    /// The method's name in kernel names.
    pub(crate) fn name(self) -> &'static str {
        match self {
            BlockedConv::Pointwise => "blocked-pointwise",
            BlockedConv::Depthwise => "blocked-depthwise",
            BlockedConv::Dense => "blocked-direct",
            BlockedConv::Winograd => "blocked-winograd",
            BlockedConv::Grouped => "blocked-grouped",
        }
    }
}

/// The blocked kernel that runs a convolution of `x` by `w` in `groups` groups with
/// `layout` (operand 0 is `x`), if there is one. Only the operands `x`, the output
/// (and a residual, which the caller checks has the output's layout) may be blocked.
pub(crate) fn kind(
    win: &Window2d,
    groups: usize,
    x: &Shape,
    w: &Shape,
    layout: StepLayout,
) -> Option<BlockedConv> {
    let shapes_fit = x.rank() == 4 && w.rank() == 4 && x.dtype() == DType::F32;
    let isa = crate::isa::isa();
    if !shapes_fit || !isa.avx2_fma || layout.input(1) {
        return None;
    }
    let pointwise = groups == 1
        && w.dim(2) == 1
        && w.dim(3) == 1
        && win.stride == [1, 1]
        && win.padding == [0; 4]
        && w.dim(1) == x.dim(1)
        // The channel offsets are 32-bit.
        && x.num_elements() / x.dim(0).max(1) < u32::MAX as usize;
    // Plain on both sides, the kernel was measured against the GEMM on AVX-512 only.
    if pointwise && (layout.any() || (isa.avx512f && plain_pointwise_wins(x))) {
        return Some(BlockedConv::Pointwise);
    }
    if !layout.any() {
        return None;
    }
    if super::conv_f32::winograd_over_blocks(win, x, w) {
        return Some(BlockedConv::Winograd);
    }
    let dense = groups == 1 && w.dim(1) == x.dim(1) && conv_pixels_f32::applies(win, groups, x);
    if dense {
        return Some(BlockedConv::Dense);
    }
    let depthwise = groups > 1
        && groups == x.dim(1)
        && w.dim(0) == groups
        && w.dim(1) == 1
        && layout.input(0)
        && layout.output();
    if depthwise {
        return Some(BlockedConv::Depthwise);
    }
    let (c, cg) = (x.dim(1), w.dim(1));
    let plane = Shape::new(&[x.dim(0), BLOCK, x.dim(2), x.dim(3)], DType::F32);
    // Every group inside a block: of 16 channels, or the last one of 8.
    let block_width = if c.is_multiple_of(BLOCK) { BLOCK } else { HALF };
    let grouped = groups > 1
        && cg > 1
        && crate::layout::blockable_channels(c)
        && block_width.is_multiple_of(cg)
        && cg * groups == c
        && w.dim(0) == c
        && layout.input(0)
        && layout.output()
        && conv_pixels_f32::applies(win, 1, &plane);
    grouped.then_some(BlockedConv::Grouped)
}

/// Whether a pointwise convolution whose input and output are both plain runs on
/// the pointwise kernel rather than as a GEMM: few pixels an image (at most
/// [`PLAIN_POINTWISE_MAX_PIXELS`]) over many input channels (at least
/// [`PLAIN_POINTWISE_MIN_CHANNELS`]). The GEMM splits the pixels between the threads
/// (a 16 x 16 plane is five and a third panels of 48) and reads all the weights for
/// each part, where the pointwise kernel splits the filters (two threads, best of
/// 2000 runs: 960 -> 256 at 16 x 16 0.46 against 0.76 ms, 2048 -> 512 at 7 x 7 0.39
/// against 0.65, 160 -> 960 at 16 x 16 0.36 against 0.40). With more pixels, or few
/// channels, the GEMM is as fast or faster (512 -> 128 at 28 x 28 0.36 against 0.42,
/// 64 -> 256 at 56 x 56 0.49 against 0.92). One pixel (a squeeze-and-excitation
/// block's) stays a matrix-vector product, which `gemm::gemv` reads in place.
fn plain_pointwise_wins(x: &Shape) -> bool {
    let pixels = x.dim(2) * x.dim(3);
    (2..=PLAIN_POINTWISE_MAX_PIXELS).contains(&pixels) && x.dim(1) >= PLAIN_POINTWISE_MIN_CHANNELS
}

/// The most pixels an image of a plain pointwise convolution on the pointwise
/// kernel ([`plain_pointwise_wins`]).
const PLAIN_POINTWISE_MAX_PIXELS: usize = 256;
/// The fewest input channels of a plain pointwise convolution on the pointwise
/// kernel.
const PLAIN_POINTWISE_MIN_CHANNELS: usize = 128;

/// `f64` values of scratch a run needs: for a pointwise convolution, room for its
/// packed weights (packed there when not packed ahead, or scaled there by a folded
/// prologue), its table of channel offsets and a folded prologue's bias; for a
/// dense, Winograd or grouped one, its weights when not packed ahead.
pub(crate) fn scratch_f64(kind: BlockedConv, w: &Shape) -> usize {
    match kind {
        BlockedConv::Pointwise => {
            // The weights, the channel offsets, and a bias for a folded prologue.
            let (o, c) = (w.dim(0), w.dim(1));
            conv_pixels_f32::weights_len(o, c).div_ceil(2) + c.div_ceil(2) + o.div_ceil(NR) * NR / 2
        }
        BlockedConv::Dense => {
            let (o, k) = (w.dim(0), w.dim(1) * w.dim(2) * w.dim(3));
            conv_pixels_f32::weights_len(o, k).div_ceil(2)
        }
        BlockedConv::Winograd => super::winograd_f32::weights_len(w.dim(1), w.dim(0)).div_ceil(2),
        BlockedConv::Grouped => {
            conv_pixels_f32::block_groups_weights_len(w.dim(0), w.dim(2) * w.dim(3)).div_ceil(2)
        }
        BlockedConv::Depthwise => 0,
    }
}

/// Floats of scratch each thread needs: a depthwise block's weights, tap by tap,
/// then the padded rows it stages (if any); a pointwise convolution with a
/// prologue, its block of changed input and the block's channel offsets; a dense
/// or grouped one, what [`conv_pixels_f32`] stages.
pub(crate) fn thread_floats(
    kind: BlockedConv,
    win: &Window2d,
    [x, w]: [&Shape; 2],
    prologue: bool,
) -> usize {
    match kind {
        BlockedConv::Dense => {
            let out_hw = [0, 1].map(|axis| super::conv::extent(win, axis, x.dim(2 + axis)));
            conv_pixels_f32::thread_floats(win, x, w, out_hw)
        }
        BlockedConv::Winograd => super::conv_f32::thread_floats(win, x, w),
        BlockedConv::Grouped => {
            let out_hw = [0, 1].map(|axis| super::conv::extent(win, axis, x.dim(2 + axis)));
            conv_pixels_f32::block_groups_thread_floats(win, x, out_hw)
        }
        BlockedConv::Pointwise if prologue => {
            // A block's input ([`block_pixels`]: at most a tile past the fit) and
            // its offsets; by filters, the changed image and a tile's sums per
            // panel.
            let (n, c, pixels) = (x.dim(0), x.dim(1), x.dim(2) * x.dim(3));
            let by_filters = match weights_outweigh([n, pixels, w.dim(0)]) {
                true => c * pixels + w.dim(0).div_ceil(NR) * TILE,
                false => 0,
            };
            ((block_fit(c).next_multiple_of(MR) + MR) * c + c).max(by_filters)
        }
        // A tile's sums per panel, for a convolution by filters.
        BlockedConv::Pointwise => w.dim(0).div_ceil(NR) * TILE,
        // A block's weights, tap by tap, at a vector per tap whatever the block;
        // then the padded rows it stages, if it does.
        BlockedConv::Depthwise => {
            let [oh, ow] = [0, 1].map(|axis| super::conv::extent(win, axis, x.dim(2 + axis)));
            let (kh, kw) = (w.dim(2), w.dim(3));
            // Blocks of 16 and a last one of fewer may stage differently.
            let blocks = Blocks::new(x.dim(1), 1);
            let staged = [0, blocks.count().saturating_sub(1)]
                .into_iter()
                .filter_map(|k| {
                    let b = blocks.width(k);
                    depthwise_staging(win, [oh, ow], [kh, kw], b)
                        .map(|width| input_rows(win, oh, kh) * width * b)
                })
                .max()
                .unwrap_or(0);
            kh * kw * BLOCK + staged
        }
    }
}

/// A per-input-channel change a convolution applies to its input before the
/// product: `activation(x * scale[c] + shift[c])`.
#[derive(Clone, Copy)]
pub(crate) struct Prologue<'a> {
    /// The scale and shift, one per input channel.
    pub affine: Option<(&'a [f32], &'a [f32])>,
    /// Applied after the affine.
    pub activation: Option<crate::gemm::Activation>,
}

impl Prologue<'_> {
    /// Applies the change in place to `values`: pixels of the channels `channels`,
    /// a value of each per pixel (one channel: a plain row; a block: its lanes).
    pub(crate) fn apply(&self, values: &mut [f32], channels: std::ops::Range<usize>) {
        match (self.affine, channels.len()) {
            (Some((scale, shift)), 1) => crate::gemm::activate_and_add(
                values,
                0.0,
                None,
                None,
                Some(crate::gemm::RowAffine {
                    scale: scale[channels.start],
                    shift: shift[channels.start],
                    activation: self.activation,
                }),
            ),
            (Some((scale, shift)), _) => crate::gemm::activate_and_add_lanes(
                values,
                None,
                None,
                None,
                Some((&scale[channels.clone()], &shift[channels], self.activation)),
            ),
            (None, 1) => crate::gemm::activate_and_add(values, 0.0, self.activation, None, None),
            (None, _) => {
                crate::gemm::activate_and_add_lanes(values, None, self.activation, None, None)
            }
        }
    }

    /// Writes the changed values of pixels `p0..p0 + len` of image `x_image` (its
    /// `c` channels of `pixels`, channel-blocked when `blocked`) into `stage` in
    /// the same layout over a plane of `len` pixels.
    fn stage(
        &self,
        x_image: *const f32,
        (c, blocked, pixels): (usize, bool, usize),
        (p0, len): (usize, usize),
        stage: &mut [f32],
    ) {
        let (from, to) = (Blocks::new(c, pixels), Blocks::new(c, len));
        let count = if blocked { from.count() } else { c };
        for k in 0..count {
            // Block (or channel) `k`: its values a pixel, first channel and places.
            let (b, first, src_at, dst_at) = if blocked {
                let b = from.width(k);
                (b, k * BLOCK, from.index(k * BLOCK, p0), to.start(k))
            } else {
                (1, k, k * pixels + p0, k * len)
            };
            let run = len * b;
            let dst = &mut stage[dst_at..][..run];
            // SAFETY: pixels `p0..p0 + len` of block (or channel) `k` of the image.
            let src = unsafe { std::slice::from_raw_parts(x_image.add(src_at), run) };
            // A block in one pass: copied then changed in place, a block of 64
            // pixels took 7 times as long (a 960 -> 160 projection at 16 x 16 with
            // its input staged 0.35 -> 0.31 ms).
            #[cfg(target_arch = "x86_64")]
            if blocked && self.activation.is_none_or(crate::gemm::has_lanes_form) {
                let isa = crate::isa::isa();
                if isa.avx512f {
                    // SAFETY: AVX-512F; `src` and `dst` hold `len` pixels of `b`
                    // lanes.
                    unsafe { self.stage_block_avx512(src, dst, first..first + b) };
                    continue;
                }
                if isa.avx2_fma {
                    // SAFETY: AVX2 and FMA; as above, `b` being 16 or 8.
                    unsafe { self.stage_block_avx2(src, dst, first..first + b) };
                    continue;
                }
            }
            dst.copy_from_slice(src);
            self.apply(dst, first..first + b);
        }
    }

    /// [`Prologue::stage`] for one block of `channels` (16 or 8 lanes a pixel):
    /// each pixel of `src` changed into `dst` in one pass.
    ///
    /// # Safety
    /// AVX-512F is available; `src` and `dst` are whole pixels of the block's lanes.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    unsafe fn stage_block_avx512(
        &self,
        src: &[f32],
        dst: &mut [f32],
        channels: std::ops::Range<usize>,
    ) {
        use std::arch::x86_64::*;
        let lanes = channels.len();
        let mask = crate::layout::lane_mask(lanes);
        // SAFETY: AVX-512F (the caller's); each masked access touches the first
        // `lanes` values of a slice of `lanes` (the block's scale and shift, a
        // pixel of `src` and `dst`).
        unsafe {
            let (scale, shift) = match self.affine {
                Some((scale, shift)) => (
                    _mm512_maskz_loadu_ps(mask, scale[channels.clone()].as_ptr()),
                    _mm512_maskz_loadu_ps(mask, shift[channels].as_ptr()),
                ),
                None => (_mm512_set1_ps(1.0), _mm512_setzero_ps()),
            };
            for (from, to) in src.chunks_exact(lanes).zip(dst.chunks_exact_mut(lanes)) {
                let x = _mm512_maskz_loadu_ps(mask, from.as_ptr());
                let mut v = if self.affine.is_some() {
                    _mm512_add_ps(_mm512_mul_ps(x, scale), shift)
                } else {
                    x
                };
                if let Some(a) = self.activation {
                    v = crate::gemm::activate_lanes_avx512(v, a);
                }
                _mm512_mask_storeu_ps(to.as_mut_ptr(), mask, v);
            }
        }
    }
}

impl Prologue<'_> {
    /// [`Prologue::stage`] for one block of `channels` (16 or 8 lanes a pixel) on
    /// AVX2: each pixel of `src` changed into `dst` in one pass, 8 lanes at a time.
    ///
    /// # Safety
    /// AVX2 and FMA are available; `src` and `dst` are whole pixels of the block's
    /// lanes, 16 or 8.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx2,fma")]
    unsafe fn stage_block_avx2(
        &self,
        src: &[f32],
        dst: &mut [f32],
        channels: std::ops::Range<usize>,
    ) {
        use std::arch::x86_64::*;
        let lanes = channels.len();
        debug_assert!(lanes == BLOCK || lanes == HALF);
        for (from, to) in src.chunks_exact(lanes).zip(dst.chunks_exact_mut(lanes)) {
            for l in (0..lanes).step_by(HALF) {
                // SAFETY: AVX2 and FMA (the caller's); 8 lanes from `l` of a pixel
                // of `src` and `dst`, and of the block's scale and shift.
                unsafe {
                    let mut v = _mm256_loadu_ps(from.as_ptr().add(l));
                    if let Some((scale, shift)) = self.affine {
                        let c = channels.start + l;
                        // A product then a sum, as the other forms round.
                        v = _mm256_add_ps(
                            _mm256_mul_ps(v, _mm256_loadu_ps(scale[c..c + HALF].as_ptr())),
                            _mm256_loadu_ps(shift[c..c + HALF].as_ptr()),
                        );
                    }
                    if let Some(a) = self.activation {
                        v = crate::gemm::activate_lanes_avx2(v, a);
                    }
                    _mm256_storeu_ps(to.as_mut_ptr().add(l), v);
                }
            }
        }
    }
}

/// Whether a pointwise convolution of `o` filters over `pixels` input pixels (all
/// images') on `threads` threads takes `prologue` folded into its weights
/// ([`fold_prologue`]) rather than applied to its input: an affine alone (a
/// squeeze-and-excitation block's channel scaling) over many more pixels than
/// filters, where scaling the weights (`o` values a channel) costs less than
/// staging the changed input (`pixels` values a channel). Folded weights are
/// written each run and then read by every thread; a staged block stays with the
/// thread that reads it, so with fewer pixels staging wins (paired, folding
/// whenever the filters are no more than the pixels: a 960 -> 160 projection at
/// 16 x 16 2.8% slower for its model, LR-ASPP 1.6%; never folding: EfficientNet-B0
/// 1.6% slower).
pub(crate) fn folds_prologue(prologue: &Prologue, o: usize, pixels: usize, threads: usize) -> bool {
    prologue.affine.is_some() && prologue.activation.is_none() && 2 * o * threads < pixels
}

/// Folds an input affine (`x * scale[c] + shift[c]`) into a pointwise
/// convolution's weights ([`conv_pixels_f32::pack_weights`]'s form, `c` steps a
/// panel): `W[o][c] * scale[c]` into `to`, read from `from` (or from `to` itself,
/// in place, when `None`), and the shift into a bias, `bias[o] + Σ_c W[o][c] *
/// shift[c]`, written to `folded_bias` (a value per packed filter). The panels are
/// split over `threads` threads of `pool`. Returns whether the convolution has a
/// bias: `bias` was given or some shift is not zero.
pub(crate) fn fold_prologue(
    (scale, shift): (&[f32], &[f32]),
    (from, to, c): (Option<&[f32]>, &mut [f32], usize),
    bias: Option<&[f32]>,
    folded_bias: &mut [f32],
    (pool, threads): (&ThreadPool, usize),
) -> Result<bool> {
    let shifts = shift.iter().any(|&t| t != 0.0);
    let panel = c * NR;
    let panels = (to.len() / panel.max(1)).min(folded_bias.len() / NR);
    debug_assert!(from.is_none_or(|f| f.len() >= panels * panel));
    let (to_addr, bias_addr) = (to.as_mut_ptr() as usize, folded_bias.as_mut_ptr() as usize);
    let from_addr = from.map_or(to_addr, |f| f.as_ptr() as usize);
    let tasks = threads.min(panels).max(1);
    let task = |t: usize, _: usize| {
        for q in t * panels / tasks..(t + 1) * panels / tasks {
            let (src, dst) = (
                (from_addr as *const [f32; NR]).wrapping_add(q * c),
                (to_addr as *mut [f32; NR]).wrapping_add(q * c),
            );
            let mut sums = [0.0f32; NR];
            for p in 0..c {
                let (s, t) = (scale[p], shift[p]);
                // SAFETY: step `p` of panel `q` (of `panels`, inside `from` and
                // `to`), each task's panels its own; in place, the step is read
                // before it is written.
                let mut step = unsafe { src.add(p).read() };
                for (w, sum) in step.iter_mut().zip(&mut sums) {
                    *sum += *w * t;
                    *w *= s;
                }
                // SAFETY: as above.
                unsafe { dst.add(p).write(step) };
            }
            // SAFETY: panel `q`'s `NR` values of `folded_bias` (checked above),
            // this task's alone.
            let out =
                unsafe { std::slice::from_raw_parts_mut((bias_addr as *mut f32).add(q * NR), NR) };
            for (j, (value, sum)) in out.iter_mut().zip(sums).enumerate() {
                let given = bias.and_then(|b| b.get(q * NR + j)).copied().unwrap_or(0.0);
                *value = if shifts { given + sum } else { given };
            }
        }
    };
    pool.run(tasks, threads, &task)?;
    Ok(bias.is_some() || shifts)
}

/// Fills `offsets` with each input channel's offset from its pixel's first value
/// in its block ([`input_channels`]): `c * pixels` plain; channel-blocked, its block's
/// start and its lane.
pub(crate) fn channel_offsets(pixels: usize, blocked: bool, offsets: &mut [u32]) {
    let blocks = Blocks::new(offsets.len(), pixels);
    for (c, offset) in offsets.iter_mut().enumerate() {
        let at = match blocked {
            true => blocks.index(c, 0),
            false => c * pixels,
        };
        *offset = at as u32;
    }
}

/// The input channels of a pointwise product as `(run, tail)`: channels `run` read
/// at one distance from pixel to pixel (a plain input's along each channel's row, a
/// blocked input's in its whole blocks of 16), and `tail` in the same pass, a
/// blocked input's last block of 8 (8 floats a pixel; empty for any other input).
fn input_channels(c: usize, blocked: bool) -> (std::ops::Range<usize>, std::ops::Range<usize>) {
    let whole = if blocked { c / BLOCK * BLOCK } else { c };
    (0..whole, whole..c)
}

/// The most pixels of a block whose input (`channels` values a pixel) takes about a
/// quarter of L2.
fn block_fit(channels: usize) -> usize {
    (crate::gemm::l2_cache_bytes() / 4 / 4 / channels.max(1)).max(MR)
}

/// Blocks of output pixels per image: each block's input (`channels` values a
/// pixel) in about a quarter of L2, and enough tasks (with `units` output channel
/// groups of all images) for [`TASKS_PER_THREAD`] per thread; never under a tile
/// of pixels.
fn pixel_blocks(pixels: usize, channels: usize, units: usize, threads: usize) -> usize {
    let by_size = pixels.div_ceil(block_fit(channels));
    let for_threads = (TASKS_PER_THREAD * threads).div_ceil(units.max(1));
    by_size.max(for_threads).min(pixels.div_ceil(MR)).max(1)
}

/// Tasks per thread that a pointwise convolution's pixels are split into at
/// least. Two rather than four, paired in one process on 2 threads: MobileNet
/// v2 and v3, EfficientNet-B0, LR-ASPP and DeepLabV3 1.3-2.5% faster, DenseNet,
/// RegNet, SqueezeNet and ShuffleNet 0.5-1.5%, ResNet-50 even (a 16 -> 16 layer at
/// 112 x 112 4%); one a thread lost 4% on MobileNet v2.
const TASKS_PER_THREAD: usize = 2;

/// Pixels `p0..p1` of block `b` of `blocks`: whole tiles of [`MR`] pixels, split as
/// evenly as they go (sizes rounded up to whole tiles left the last block of 196
/// pixels in 4 at 34, its thread idle for a fifth of the step), the last block
/// ending at `pixels`. Each holds at most one tile more than
/// `pixels.div_ceil(blocks)` rounded up to whole tiles.
fn block_pixels(b: usize, blocks: usize, pixels: usize) -> (usize, usize) {
    let tiles = pixels.div_ceil(MR);
    let first = |b: usize| b * tiles / blocks * MR;
    (first(b), first(b + 1).min(pixels))
}

/// The pointwise convolution: `packed` holds the weights from
/// [`conv_pixels_f32::pack_weights`] (`o` filters of `c` values) and `offsets` the
/// table from [`channel_offsets`] for `x`'s layout. With a `prologue`, each task
/// first writes its pixels' changed input into its scratch (in `x`'s layout) and
/// multiplies that.
#[allow(clippy::too_many_arguments)]
pub(crate) fn pointwise(
    x: Src,
    (packed, offsets): (&[f32], &[u32]),
    prologue: Option<Prologue>,
    finish: Finish,
    out: Dst,
    layout: StepLayout,
    (gemm, pool): (&GemmScratch, &ThreadPool),
) -> Result<()> {
    let [n, c] = [x.shape.dim(0), x.shape.dim(1)];
    let pixels = x.shape.dim(2) * x.shape.dim(3);
    let o = out.shape.dim(1);
    if n == 0 || o == 0 || pixels == 0 || c == 0 {
        return Ok(());
    }
    let (x_blocked, out_blocked) = (layout.input(0), layout.output());
    if by_filters((x_blocked, out_blocked), &finish, [n, pixels, o]) {
        return pointwise_by_filters(x, (packed, offsets), prologue, finish, out, (gemm, pool));
    }
    let out_blocks = Blocks::new(o, pixels);
    let panels = o.div_ceil(NR);
    let groups = panels.div_ceil(conv_pixels_f32::panel_group());
    let threads = gemm.threads();
    // With a prologue a task runs every group of its pixels: staged once, not once
    // per group (960 -> 160 channels at 16 x 16 staged its input 3 times). So it
    // does when the input fills a block a thread or more: split by groups as well,
    // each block's input was read by both cores (576 -> 96 channels at 28 x 28:
    // 0.49 -> 0.40 ms).
    let group_tasks = if prologue.is_some() || pixels.div_ceil(block_fit(c)) >= threads {
        1
    } else {
        groups
    };
    let blocks = pixel_blocks(pixels, c, n * group_tasks, threads);
    let (x_addr, out_addr) = (x.ptr as usize, out.ptr as usize);
    let residual_addr = finish.residual.map(|r| r.ptr as usize);
    let per_channel = finish.per_channel();
    // Floats from one input pixel to the next (in a whole block when blocked).
    let step = if x_blocked { BLOCK } else { 1 };
    // Consecutive whole tiles: MR pixels on in the input and in the blocked output.
    let tile_run = |tiles: usize| conv_pixels_f32::TileRun {
        tiles,
        pixel_step: MR * step,
        tail_step: MR * HALF,
        out_step: MR * NR,
    };
    // Whole tiles into a blocked output go straight to their place and take their
    // finish as they are stored (a pass over stored values every few tiles cost a
    // ResNet bottleneck's 64 -> 256 convolution a fifth of its time); into a plain
    // output, a bias and a ReLU are applied as tiles are stored.
    let in_registers = out_blocked && finish.has_lanes_form();
    let plain_in_store = !out_blocked && finish.is_bias_and_relu();
    let finishes = in_registers
        && (finish.bias.is_some()
            || finish.activation.is_some()
            || residual_addr.is_some()
            || finish.affine.is_some());
    let task = |t: usize, thread: usize| {
        let g = t % group_tasks;
        let b = (t / group_tasks) % blocks;
        let image = t / (group_tasks * blocks);
        let task_groups = if group_tasks == 1 {
            0..groups
        } else {
            g..g + 1
        };
        let (p0, p1) = block_pixels(b, blocks, pixels);
        let x_image = (x_addr as *const f32).wrapping_add(image * c * pixels);
        let image_at = image * o * pixels;
        // What the products read: the input in place, or the block's changed copy
        // (from its first pixel, with offsets for a plane of the block's pixels).
        let (read, offsets, first) = match prologue {
            None => (x_image, offsets, 0),
            Some(prologue) => {
                // SAFETY: one task per thread index at a time; the step asked for
                // `thread_floats` (the block's input and its offsets).
                let scratch = unsafe { gemm.parts(thread) }.1;
                let (stage, rest) = scratch.split_at_mut(c * (p1 - p0));
                prologue.stage(x_image, (c, x_blocked, pixels), (p0, p1 - p0), stage);
                // SAFETY: room for `c` u32 values (f32-sized and aligned).
                let local =
                    unsafe { std::slice::from_raw_parts_mut(rest.as_mut_ptr().cast::<u32>(), c) };
                channel_offsets(p1 - p0, x_blocked, local);
                (stage.as_ptr(), &*local, p0)
            }
        };
        // What a tile from pixel `i0` reads of a run (`m` pixels; the rest repeat
        // the last, read but never stored): the run's channels from pixel bases
        // `step` floats apart, its tail's from bases `HALF` apart.
        let input =
            |i0: usize, m: usize, (run, tail): (std::ops::Range<usize>, std::ops::Range<usize>)| {
                let bases = |step: usize| -> [*const f32; MR] {
                    std::array::from_fn(|i| read.wrapping_add((i0 - first + i.min(m - 1)) * step))
                };
                conv_pixels_f32::TileInput {
                    offsets: &offsets[run],
                    pixel: bases(step),
                    tail: &offsets[tail],
                    tail_pixel: bases(HALF),
                    prefetch: conv_pixels_f32::prefetches_weights(c),
                    // A staged copy is in cache already.
                    blocks_ahead: x_blocked && prologue.is_none(),
                    runs: if x_blocked { BLOCK } else { 1 },
                }
            };
        for g in task_groups {
            let (q0, q1) = (g * panels / groups, (g + 1) * panels / groups);
            // The panels' weights.
            let weights = (packed.as_ptr().wrapping_add(q0 * c * NR), c * NR, q1 - q0);
            // Where a whole tile from pixel `i0` goes in the blocked output (the
            // panel and pixel strides, and a last block of 8's own place), and its
            // finish in registers where it has one.
            let tile_at = |i0: usize| {
                let first_value = image_at + out_blocks.index(q0 * NR, i0);
                let out = conv_pixels_f32::TileOut {
                    at: (out_addr as *mut f32).wrapping_add(first_value),
                    panel: pixels * NR,
                    pixel: NR,
                    half: (out_blocks.width(q1 - 1) < NR).then(|| {
                        (out_addr as *mut f32)
                            .wrapping_add(image_at + out_blocks.index((q1 - 1) * NR, i0))
                    }),
                };
                let register_finish = finishes.then(|| conv_pixels_f32::RegisterFinish {
                    bias: finish.bias.map(|b| b[q0 * NR..].as_ptr()),
                    activation: finish.activation,
                    residual: residual_addr.map(|r| (r as *const f32).wrapping_add(first_value)),
                    affine: finish.affine.map(|(scale, shift, post)| {
                        (scale[q0 * NR..].as_ptr(), shift[q0 * NR..].as_ptr(), post)
                    }),
                });
                (out, register_finish)
            };
            // The finish over pixels `c0..c1` of the output's blocks (or plain
            // channels) this task writes, run every few tiles while the values are
            // in L1 (a call per tile cost as much as the products at 16 input
            // channels).
            let finish_pixels = |c0: usize, c1: usize| {
                let (step, end) = if out_blocked {
                    (NR, q1 * NR)
                } else {
                    (1, (q1 * NR).min(o))
                };
                for channel in (q0 * NR..end).step_by(step) {
                    let (at, lanes) = if out_blocked {
                        let lanes = out_blocks.width(channel / NR);
                        (out_blocks.index(channel, c0), lanes)
                    } else {
                        (channel * pixels + c0, 1)
                    };
                    let (at, len) = (image_at + at, (c1 - c0) * lanes);
                    // SAFETY: pixels `c0..c1` of this block (or channel) of this image's
                    // output, stored above by this task alone; the residual has the
                    // output's shape and layout.
                    let (dst, residual) = unsafe {
                        (
                            std::slice::from_raw_parts_mut((out_addr as *mut f32).add(at), len),
                            residual_addr.map(|r| {
                                std::slice::from_raw_parts((r as *const f32).add(at), len)
                            }),
                        )
                    };
                    if out_blocked {
                        per_channel.apply_lanes((channel, lanes), dst, residual);
                    } else {
                        per_channel.apply(channel, dst, residual);
                    }
                }
            };
            let mut tile = [0.0f32; 4 * TILE];
            let mut unfinished = p0;
            // Into a plain output, each panel's bias and ReLU as it is stored.
            let stored: [Option<conv_pixels_f32::StoreFinish>; 4] = std::array::from_fn(|v| {
                (plain_in_store && q0 + v < q1).then(|| {
                    conv_pixels_f32::StoreFinish::for_panel(
                        finish.bias,
                        finish.activation.is_some(),
                        q0 + v,
                    )
                })
            });
            // The whole tiles into a blocked output, finished as they are stored, in
            // one call over all the input channels. (Runs of 128 channels over all
            // the task's pixels, each adding to the stored sums, kept a run's
            // weights in L1; with the weights asked ahead, one pass is faster:
            // 960 -> 160 and 160 -> 960 channels at 16 x 16 4%, 2048 -> 512 at
            // 7 x 7 7%, 512 -> 128 at 28 x 28 2%.)
            let mut start = p0;
            if in_registers {
                let whole_end = p0 + (p1 - p0) / MR * MR;
                if whole_end > p0 {
                    let (out, register_finish) = tile_at(p0);
                    // SAFETY: as for the whole tiles below, all of them.
                    unsafe {
                        conv_pixels_f32::micro_kernel_to(
                            input(p0, MR, input_channels(c, x_blocked)),
                            weights,
                            (out, tile_run((whole_end - p0) / MR)),
                            register_finish.as_ref(),
                        )
                    };
                }
                start = whole_end;
            }
            for i0 in (start..p1).step_by(MR) {
                let m = MR.min(p1 - i0);
                let whole = out_blocked && m == MR;
                // One run of all the input channels.
                let all = input(i0, m, input_channels(c, x_blocked));
                if whole {
                    // A whole tile goes straight to its place in the blocked
                    // output, finished in registers where it can be.
                    let (out, register_finish) = tile_at(i0);
                    // SAFETY: every base plus every offset is a value of what the
                    // products read (the offsets were made for its layout and
                    // pixels, the bases for the run's and the tail's); panels
                    // `q0..q1` hold `c` steps of `NR` weights each; `MR` pixels of
                    // blocks `q0..q1` of this image's output, which only this task
                    // writes; AVX2 and FMA (checked by `kind`).
                    unsafe {
                        conv_pixels_f32::micro_kernel_to(
                            all,
                            weights,
                            (out, tile_run(1)),
                            register_finish.as_ref(),
                        )
                    };
                } else {
                    // SAFETY: as above, into the tile; at most `panel_group`
                    // panels.
                    unsafe { conv_pixels_f32::micro_kernel(all, weights, (&mut tile, m), false) };
                }
                if !whole {
                    // Lane `j` of panel `q`'s pixel `i` is channel `q * 16 + j`:
                    // stored into its block or plain row at pixel `i0 + i`.
                    let dst = out_addr as *mut f32;
                    for q in q0..q1 {
                        let values = &tile[(q - q0) * TILE..][..m * NR];
                        if out_blocked {
                            let lanes = out_blocks.width(q);
                            let at = image_at + out_blocks.index(q * NR, i0);
                            for (i, v) in values.chunks_exact(NR).enumerate() {
                                // SAFETY: pixel `i0 + i` of block `q` of this image's
                                // output; only this task writes it.
                                let to = unsafe {
                                    std::slice::from_raw_parts_mut(dst.add(at + i * lanes), lanes)
                                };
                                to.copy_from_slice(&v[..lanes]);
                            }
                        } else {
                            // SAFETY: pixels `i0..i0 + m` of channels `q * 16..` (at
                            // most 16, inside the output) of this image; only this
                            // task writes them; AVX2 and FMA (checked by
                            // `kind`).
                            unsafe {
                                conv_pixels_f32::store_transposed(
                                    &tile[(q - q0) * TILE..][..TILE],
                                    dst.add(image_at + q * NR * pixels + i0),
                                    pixels,
                                    (m, NR.min(o - q * NR)),
                                    stored[q - q0],
                                )
                            };
                        }
                    }
                }
                if plain_in_store {
                    // Finished as stored.
                } else if in_registers {
                    if !whole {
                        finish_pixels(i0, i0 + m);
                    }
                } else if i0 + m - unfinished >= FINISH_PIXELS || i0 + m == p1 {
                    finish_pixels(unfinished, i0 + m);
                    unfinished = i0 + m;
                }
            }
        }
    };
    pool.run(n * blocks * group_tasks, threads, &task)
}

/// Whether a pointwise convolution runs by filters ([`pointwise_by_filters`]): on
/// AVX2 (without AVX-512), blocked in and out with a finish in vector form, where
/// its weights outweigh its input twice or more ([`weights_outweigh`]: the last
/// layers of a CNN, over 7 x 7 planes). Split by pixels, every task read all the
/// weights: ResNet-50's 2048 -> 512 layers at 7 x 7 took twice ONNX Runtime's
/// time, RegNet's 440 -> 440 ones with a squeeze-and-excitation scale 1.5 times.
fn by_filters((x_blocked, out_blocked): (bool, bool), finish: &Finish, dims: [usize; 3]) -> bool {
    !crate::isa::isa().avx512f
        && x_blocked
        && out_blocked
        && finish.has_lanes_form()
        && weights_outweigh(dims)
}

/// Whether a pointwise convolution of `o` filters over `n` images of `pixels`
/// pixels has at least twice as many filters as pixels in all images.
fn weights_outweigh([n, pixels, o]: [usize; 3]) -> bool {
    o >= 2 * n * pixels
}

/// Input channels of one pass of [`pointwise_by_filters`]: whole blocks, all the
/// image's pixels of them in about a quarter of L2, as even as the passes go.
fn filter_pass_channels(whole: usize, pixels: usize) -> usize {
    let fit = (crate::gemm::l2_cache_bytes() / 16 / pixels.max(1)) / BLOCK * BLOCK;
    let passes = whole.div_ceil(fit.max(BLOCK)).max(1);
    whole.div_ceil(passes).next_multiple_of(BLOCK).max(BLOCK)
}

/// The pointwise convolution by filters: a task per thread and image takes a
/// share of the output's panels over all its pixels, in passes over the input
/// channels ([`filter_pass_channels`]), each pass running every panel of the task
/// and adding to the sums stored by the one before, so a pass's input stays in L2
/// while the task's weights are read once. The last pass adds the input's last
/// block of 8 (if any) and applies the finish; a plane's last short tile keeps
/// its sums in the thread's scratch between passes. With a `prologue`, each task
/// first writes its image's changed input into its scratch and multiplies that
/// (the image is small: its weights outweigh it).
fn pointwise_by_filters(
    x: Src,
    (packed, offsets): (&[f32], &[u32]),
    prologue: Option<Prologue>,
    finish: Finish,
    out: Dst,
    (gemm, pool): (&GemmScratch, &ThreadPool),
) -> Result<()> {
    let [n, c] = [x.shape.dim(0), x.shape.dim(1)];
    let pixels = x.shape.dim(2) * x.shape.dim(3);
    let o = out.shape.dim(1);
    let out_blocks = Blocks::new(o, pixels);
    let panels = o.div_ceil(NR);
    let threads = gemm.threads();
    let parts = threads.min(panels).max(1);
    let (whole, tail) = input_channels(c, true);
    let pass = filter_pass_channels(whole.end, pixels);
    let passes = whole.end.div_ceil(pass).max(1);
    let (whole_tiles, rest) = (pixels / MR, pixels % MR);
    let (x_addr, out_addr) = (x.ptr as usize, out.ptr as usize);
    let residual_addr = finish.residual.map(|r| r.ptr as usize);
    let per_channel = finish.per_channel();
    let task = |t: usize, thread: usize| {
        let (image, part) = (t / parts, t % parts);
        let (q0, q1) = (part * panels / parts, (part + 1) * panels / parts);
        let x_image = (x_addr as *const f32).wrapping_add(image * c * pixels);
        let image_at = image * o * pixels;
        // SAFETY: one task per thread index at a time; the step asked for
        // `thread_floats` (a tile per panel, after the changed image with a
        // prologue).
        let scratch = unsafe { gemm.parts(thread) }.1;
        let (x_image, short_sums) = match prologue {
            None => (x_image, scratch),
            Some(prologue) => {
                let (stage, rest) = scratch.split_at_mut(c * pixels);
                prologue.stage(x_image, (c, true, pixels), (0, pixels), stage);
                (stage.as_ptr(), rest)
            }
        };
        let bases = |first: usize, step: usize| -> [*const f32; MR] {
            std::array::from_fn(|i| x_image.wrapping_add((first + i).min(pixels - 1) * step))
        };
        for p in 0..passes {
            let steps = p * pass..((p + 1) * pass).min(whole.end);
            let last = p + 1 == passes;
            let tail = if last { tail.clone() } else { c..c };
            let input = |first: usize| conv_pixels_f32::TileInput {
                offsets: &offsets[steps.clone()],
                pixel: bases(first, BLOCK),
                tail: &offsets[tail.clone()],
                tail_pixel: bases(first, HALF),
                prefetch: conv_pixels_f32::prefetches_weights(steps.len()),
                blocks_ahead: true,
                runs: BLOCK,
            };
            for q in q0..q1 {
                let weights = (
                    packed.as_ptr().wrapping_add((q * c + steps.start) * NR),
                    c * NR,
                    1,
                );
                let first_value = image_at + out_blocks.index(q * NR, 0);
                let place = (out_addr as *mut f32).wrapping_add(first_value);
                let lanes = out_blocks.width(q);
                if whole_tiles > 0 {
                    let tile = conv_pixels_f32::TileOut {
                        at: place,
                        panel: pixels * NR,
                        pixel: NR,
                        half: (lanes < NR).then_some(place),
                    };
                    let register_finish = last.then(|| conv_pixels_f32::RegisterFinish {
                        bias: finish.bias.map(|b| b[q * NR..].as_ptr()),
                        activation: finish.activation,
                        residual: residual_addr
                            .map(|r| (r as *const f32).wrapping_add(first_value)),
                        affine: finish.affine.map(|(scale, shift, post)| {
                            (scale[q * NR..].as_ptr(), shift[q * NR..].as_ptr(), post)
                        }),
                    });
                    let run = conv_pixels_f32::TileRun {
                        tiles: whole_tiles,
                        pixel_step: MR * BLOCK,
                        tail_step: MR * HALF,
                        out_step: MR * NR,
                    };
                    // SAFETY: the input's pixels and steps (offsets made for its
                    // blocked layout, bases of whole tiles inside the image), panel
                    // `q`'s weights from the pass's first step, the whole tiles of
                    // block `q` of this image's output, which only this task
                    // writes and the passes before stored; AVX2 without AVX-512
                    // (`by_filters`).
                    unsafe {
                        conv_pixels_f32::micro_kernel_add_to(
                            input(0),
                            weights,
                            (tile, run),
                            (register_finish.as_ref(), p > 0),
                        )
                    };
                }
                if rest > 0 {
                    let sums = &mut short_sums[(q - q0) * TILE..][..TILE];
                    // SAFETY: as above, the last tile's bases repeating its last
                    // pixel, into this panel's sums in scratch.
                    unsafe {
                        conv_pixels_f32::micro_kernel(
                            input(whole_tiles * MR),
                            weights,
                            (sums, rest),
                            p > 0,
                        )
                    };
                    if last {
                        let at = first_value + whole_tiles * MR * lanes;
                        // SAFETY: the last `rest` pixels of block `q` of this
                        // image's output (and of the residual, of its layout),
                        // which only this task writes.
                        let (dst, residual) = unsafe {
                            (
                                std::slice::from_raw_parts_mut(
                                    (out_addr as *mut f32).add(at),
                                    rest * lanes,
                                ),
                                residual_addr.map(|r| {
                                    std::slice::from_raw_parts(
                                        (r as *const f32).add(at),
                                        rest * lanes,
                                    )
                                }),
                            )
                        };
                        for (to, from) in dst.chunks_exact_mut(lanes).zip(sums.chunks_exact(NR)) {
                            to.copy_from_slice(&from[..lanes]);
                        }
                        per_channel.apply_lanes((q * NR, lanes), dst, residual);
                    }
                }
            }
        }
    };
    pool.run(n * parts, threads, &task)
}

/// Output pixels a pointwise task stores before it runs the finish over them (in
/// L1 still).
const FINISH_PIXELS: usize = 48;

/// Output pixels whose sums a depthwise run keeps in registers ([`run`]; the
/// fixed runs keep up to 12, [`run_fixed`]).
const RUN: usize = 8;
/// Vectors of a run of pixel pairs (half-vector blocks): 16 pixels, so that each
/// pass over a tap's row feeds 8 sums (with 4, a 72-channel 3x3 layer at 64 x 64
/// took 1.2 times as long on one thread).
const PAIR_RUN: usize = 8;

/// The geometry a depthwise row needs.
#[derive(Clone, Copy)]
struct DepthwiseRow {
    h: usize,
    w: usize,
    ow: usize,
    kh: usize,
    kw: usize,
    stride: [usize; 2],
    dilation: [usize; 2],
    top: usize,
    left: usize,
    /// Channels per block (values per pixel).
    lanes: usize,
}

impl DepthwiseRow {
    /// For output row `oy`: the input row of its first row of taps (above the
    /// plane when negative), and its rows of taps inside the plane, `ky_lo..ky_hi`.
    fn tap_rows(&self, oy: usize) -> (isize, (usize, usize)) {
        let iy0 = (oy * self.stride[0]) as isize - self.top as isize;
        let dy = self.dilation[0] as isize;
        let ky_lo = if iy0 >= 0 {
            0
        } else {
            ((-iy0) as usize).div_ceil(self.dilation[0])
        };
        let ky_hi = if iy0 >= self.h as isize {
            0
        } else {
            (((self.h as isize - 1 - iy0) / dy) as usize + 1).min(self.kh)
        };
        (iy0, (ky_lo, ky_hi.max(ky_lo)))
    }

    /// Output columns whose every tap lies inside the input row: `lo..hi` (empty
    /// when `hi <= lo`).
    fn interior(&self) -> (usize, usize) {
        let [_, sx] = self.stride;
        let lo = self.left.div_ceil(sx).min(self.ow);
        let reach = (self.kw - 1) * self.dilation[1];
        let hi = if self.w + self.left > reach {
            ((self.w - 1 + self.left - reach) / sx + 1).min(self.ow)
        } else {
            0
        };
        (lo, hi.max(lo))
    }
}

/// Floats of [`pack_depthwise_weights`]'s form for `c` filters of `taps` taps
/// (saturating).
pub(crate) fn depthwise_weights_len(c: usize, taps: usize) -> usize {
    c.div_ceil(BLOCK).saturating_mul(taps).saturating_mul(BLOCK)
}

/// Depthwise weights (`values`: filters of `taps` taps each) as the kernel reads
/// them: for each block of channels ([`Blocks`]), a vector per tap holding the
/// block's filters' values at that tap. A block of half a vector fills both
/// halves, for the kernel's pairs of pixels.
pub(crate) fn pack_depthwise_weights(values: &[f32], taps: usize, out: &mut [f32]) {
    let blocks = Blocks::new(values.len() / taps.max(1), 1);
    for (k, block) in out
        .chunks_exact_mut(taps * BLOCK)
        .take(blocks.count())
        .enumerate()
    {
        let lanes = blocks.width(k);
        let filters = &values[k * BLOCK * taps..][..lanes * taps];
        for (j, filter) in filters.chunks_exact(taps).enumerate() {
            for (tap, &value) in filter.iter().enumerate() {
                for lane in (j..BLOCK).step_by(lanes) {
                    block[tap * BLOCK + lane] = value;
                }
            }
        }
    }
}

/// The depthwise convolution of blocked `x` by `w` (`[c, 1, kh, kw]`) into blocked
/// `out`. `packed`
/// holds the weights in [`pack_depthwise_weights`]'s form when they were packed
/// ahead; otherwise each task arranges its block's in its thread scratch.
pub(crate) fn depthwise(
    win: &Window2d,
    [x, w]: [Src; 2],
    packed: Option<&[f32]>,
    finish: Finish,
    out: Dst,
    (gemm, pool): (&GemmScratch, &ThreadPool),
) -> Result<()> {
    let [n, c, h, wd] = super::conv::nchw(x.shape);
    let [oh, ow] = [out.shape.dim(2), out.shape.dim(3)];
    let (kh, kw) = (w.shape.dim(2), w.shape.dim(3));
    let taps = kh * kw;
    if !crate::layout::blockable_channels(c) {
        return Err(rlx_ir::Error::runtime(
            "blocked depthwise convolution",
            format!("{c} channels are not a multiple of 8"),
        ));
    }
    if n == 0 || oh == 0 || ow == 0 {
        return Ok(());
    }
    let geo = DepthwiseRow {
        h,
        w: wd,
        ow,
        kh,
        kw,
        stride: win.stride,
        dilation: win.dilation,
        top: win.padding[0],
        left: win.padding[1],
        lanes: BLOCK,
    };
    let (x_blocks, out_blocks) = (Blocks::new(c, h * wd), Blocks::new(c, oh * ow));
    let blocks = x_blocks.count();
    let planes = n * blocks;
    let threads = gemm.threads();
    let parts = (8 * threads).div_ceil(planes).clamp(1, oh);
    let (x_addr, w_addr, out_addr) = (x.ptr as usize, w.ptr as usize, out.ptr as usize);
    let residual_addr = finish.residual.map(|r| r.ptr as usize);
    let per_channel = finish.per_channel();
    // Finished as each vector is stored where every step has a vector form.
    let in_registers = finish.has_lanes_form();
    let steps = (finish.bias, finish.activation, finish.affine);
    let task = |t: usize, thread: usize| {
        let (plane, part) = (t / parts, t % parts);
        let block = plane % blocks;
        let ((x_at, b, first_channel), (out_plane, _, _)) =
            (x_blocks.plane(plane), out_blocks.plane(plane));
        let geo = DepthwiseRow { lanes: b, ..geo };
        // SAFETY: one task per thread index at a time; the step asked for
        // `thread_floats` (a vector per tap, then the staged rows).
        let (mine, stage) = unsafe { gemm.parts(thread) }.1.split_at_mut(taps * BLOCK);
        let weights: &[f32] = match packed {
            Some(all) => &all[block * taps * BLOCK..(block + 1) * taps * BLOCK],
            None => {
                // SAFETY: `w` holds `c * taps` values.
                let filters = unsafe {
                    std::slice::from_raw_parts(
                        (w_addr as *const f32).add(first_channel * taps),
                        b * taps,
                    )
                };
                pack_depthwise_weights(filters, taps, mine);
                mine
            }
        };
        let x_plane = (x_addr as *const f32).wrapping_add(x_at);
        let (oy0, oy1) = (part * oh / parts, (part + 1) * oh / parts);
        // With staging, the rows these outputs read, padding included, and the
        // geometry of that copy (which has no padding left to check).
        let (source, geo, first) = match depthwise_staging(win, [oh, ow], [kh, kw], b) {
            Some(width) if oy1 > oy0 => {
                let rows = input_rows(win, oy1 - oy0, kh);
                let stage = &mut stage[..rows * width * b];
                // SAFETY: the plane holds `h * wd` pixels of `b` values.
                let plane = unsafe { std::slice::from_raw_parts(x_plane, h * wd * b) };
                stage_padded(
                    plane,
                    [h, wd],
                    b,
                    (oy0 * win.stride[0], win.padding[0], win.padding[1]),
                    [rows, width],
                    stage,
                );
                let geo = DepthwiseRow {
                    h: rows,
                    w: width,
                    top: 0,
                    left: 0,
                    ..geo
                };
                (stage.as_ptr(), geo, oy0)
            }
            _ => (x_plane, geo, 0),
        };
        #[cfg(target_arch = "x86_64")]
        if !crate::isa::isa().avx512f {
            let finish =
                in_registers.then(|| depthwise_avx2::RowFinish::new(steps, (first_channel, b)));
            for oy in oy0..oy1 {
                let at = out_plane + oy * ow * b;
                // SAFETY: row `oy` of this plane of the output, only this task
                // writes it.
                let row = unsafe {
                    std::slice::from_raw_parts_mut((out_addr as *mut f32).add(at), ow * b)
                };
                let row_finish = finish.map(|f| {
                    f.with_residual(residual_addr.map(|r| (r as *const f32).wrapping_add(at)))
                });
                // SAFETY: AVX2 and FMA (checked by `kind`); as below.
                unsafe {
                    depthwise_avx2::depthwise_row(
                        source,
                        weights,
                        oy - first,
                        geo,
                        (row, row_finish.as_ref()),
                    )
                };
                if !in_registers {
                    // SAFETY: as below.
                    let residual = residual_addr.map(|r| unsafe {
                        std::slice::from_raw_parts((r as *const f32).add(at), ow * b)
                    });
                    per_channel.apply_lanes((first_channel, b), row, residual);
                }
            }
            return;
        }
        let lane_finish = in_registers.then(|| {
            let pairs = pairs(b, win.stride[1]);
            LaneFinish::new(steps, (first_channel, b), pairs)
        });
        for oy in oy0..oy1 {
            let at = out_plane + oy * ow * b;
            // SAFETY: row `oy` of this plane of the output, only this task writes it.
            let row =
                unsafe { std::slice::from_raw_parts_mut((out_addr as *mut f32).add(at), ow * b) };
            // The finish in registers, with the residual's row at the output's.
            let row_finish = lane_finish.map(|f| LaneFinish {
                residual: residual_addr.map(|r| (r as *const f32).wrapping_add(at)),
                ..f
            });
            // SAFETY: AVX-512F (checked by `kind`); `source` holds `geo.h * geo.w`
            // pixels of `b` values and the weights `taps` vectors; the residual
            // has the output's shape and layout.
            unsafe { depthwise_row(source, weights, oy - first, geo, (row, row_finish.as_ref())) };
            if !in_registers {
                // SAFETY: as above.
                let residual = residual_addr.map(|r| unsafe {
                    std::slice::from_raw_parts((r as *const f32).add(at), ow * b)
                });
                per_channel.apply_lanes((first_channel, b), row, residual);
            }
        }
    };
    pool.run(planes * parts, threads, &task)
}

/// Rows shorter than this many pixels are staged with their padding (when it
/// fits, below): a short row spends most of its taps at the edges, where a window
/// other than a fixed-width one checks each tap of each pixel (at 7 x 7 a 5 x 5
/// kernel checked 16 of 25 pixels' taps), and a fixed-width one loads masked
/// columns.
const STAGED_ROW: usize = 4 * RUN;

/// The most floats a staged copy of a plane's rows may take in a thread's scratch.
const STAGED_FLOATS: usize = 16 * 1024;

/// The width in pixels of the padded rows a depthwise convolution stages, when it
/// stages them: a padded window over output rows shorter than [`STAGED_ROW`]
/// whose whole plane's copy fits in [`STAGED_FLOATS`].
fn depthwise_staging(
    win: &Window2d,
    [oh, ow]: [usize; 2],
    [kh, kw]: [usize; 2],
    b: usize,
) -> Option<usize> {
    if win.padding == [0; 4] || ow >= STAGED_ROW || oh == 0 || ow == 0 {
        return None;
    }
    let width = (ow - 1) * win.stride[1] + (kw - 1) * win.dilation[1] + 1;
    (input_rows(win, oh, kh) * width * b <= STAGED_FLOATS).then_some(width)
}

/// Rows of padded input that `rows` consecutive output rows (at least 1) read
/// through a window `kh` rows tall.
fn input_rows(win: &Window2d, rows: usize, kh: usize) -> usize {
    (rows - 1) * win.stride[0] + (kh - 1) * win.dilation[0] + 1
}

/// Copies the rows of a blocked `plane` (`[h, w]` pixels of `b` values) from padded
/// row `from` on into `stage` (`[rows, width]` pixels), with zeros wherever the
/// padding (`top` rows above, `left` columns before) or the bottom and right of
/// the window lie outside the plane.
fn stage_padded(
    plane: &[f32],
    [h, w]: [usize; 2],
    b: usize,
    (from, top, left): (usize, usize, usize),
    [rows, width]: [usize; 2],
    stage: &mut [f32],
) {
    let start = left.min(width);
    let end = (left + w).min(width);
    for (r, dst) in stage.chunks_exact_mut(width * b).take(rows).enumerate() {
        let iy = (from + r).wrapping_sub(top);
        if iy >= h {
            dst.fill(0.0);
            continue;
        }
        dst[..start * b].fill(0.0);
        dst[start * b..end * b].copy_from_slice(&plane[iy * w * b..(iy * w + end - start) * b]);
        dst[end * b..].fill(0.0);
    }
}

/// Output row `oy` of one blocked plane.
///
/// # Safety
/// AVX-512F is available; `x` holds the plane's `h * w` pixels of `geo.lanes`
/// values, `weights` its `kh * kw` tap vectors (at [`BLOCK`] floats apart), and
/// `row` the row's `ow` pixels; a finish's residual row holds them too.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn depthwise_row(
    x: *const f32,
    weights: &[f32],
    oy: usize,
    geo: DepthwiseRow,
    (row, finish): (&mut [f32], Option<&LaneFinish>),
) {
    let (lo, hi) = geo.interior();
    let (iy0, ky) = geo.tap_rows(oy);
    let out = row.as_mut_ptr();
    // The block's lanes of a vector (a block of 8 uses the low half).
    let mask = crate::layout::lane_mask(geo.lanes);
    let at = (iy0, ky, mask);
    // Half-vector blocks at unit stride take two neighbouring pixels a vector.
    let pairs = pairs(geo.lanes, geo.stride[1]);
    let span = if pairs { 2 * PAIR_RUN } else { RUN };
    // Each run's sums in exactly as many registers as it has pixels (a run that
    // skipped registers past its count spilled them all to the stack).
    macro_rules! chunk {
        ($ox:expr, $count:expr, $inside:expr) => {
            // SAFETY: the caller's contract; a run inside the interior reads all its
            // taps, any other only its taps inside the row.
            unsafe {
                let (ox, count): (usize, usize) = ($ox, $count);
                if pairs {
                    match ($inside, count.div_ceil(2)) {
                        (true, 1) => {
                            run_pairs::<1, true>(x, weights, at, (ox, count), geo, (out, finish))
                        }
                        (true, 2) => {
                            run_pairs::<2, true>(x, weights, at, (ox, count), geo, (out, finish))
                        }
                        (true, 3) => {
                            run_pairs::<3, true>(x, weights, at, (ox, count), geo, (out, finish))
                        }
                        (true, 4) => {
                            run_pairs::<4, true>(x, weights, at, (ox, count), geo, (out, finish))
                        }
                        (true, 5) => {
                            run_pairs::<5, true>(x, weights, at, (ox, count), geo, (out, finish))
                        }
                        (true, 6) => {
                            run_pairs::<6, true>(x, weights, at, (ox, count), geo, (out, finish))
                        }
                        (true, 7) => {
                            run_pairs::<7, true>(x, weights, at, (ox, count), geo, (out, finish))
                        }
                        (true, _) => run_pairs::<PAIR_RUN, true>(
                            x,
                            weights,
                            at,
                            (ox, count),
                            geo,
                            (out, finish),
                        ),
                        (false, 1) => {
                            run_pairs::<1, false>(x, weights, at, (ox, count), geo, (out, finish))
                        }
                        (false, 2) => {
                            run_pairs::<2, false>(x, weights, at, (ox, count), geo, (out, finish))
                        }
                        (false, 3) => {
                            run_pairs::<3, false>(x, weights, at, (ox, count), geo, (out, finish))
                        }
                        (false, 4) => {
                            run_pairs::<4, false>(x, weights, at, (ox, count), geo, (out, finish))
                        }
                        (false, 5) => {
                            run_pairs::<5, false>(x, weights, at, (ox, count), geo, (out, finish))
                        }
                        (false, 6) => {
                            run_pairs::<6, false>(x, weights, at, (ox, count), geo, (out, finish))
                        }
                        (false, 7) => {
                            run_pairs::<7, false>(x, weights, at, (ox, count), geo, (out, finish))
                        }
                        (false, _) => run_pairs::<PAIR_RUN, false>(
                            x,
                            weights,
                            at,
                            (ox, count),
                            geo,
                            (out, finish),
                        ),
                    }
                } else {
                    match ($inside, count) {
                        (true, 1) => run::<1, true>(x, weights, at, ox, geo, (out, finish)),
                        (true, 2) => run::<2, true>(x, weights, at, ox, geo, (out, finish)),
                        (true, 3) => run::<3, true>(x, weights, at, ox, geo, (out, finish)),
                        (true, 4) => run::<4, true>(x, weights, at, ox, geo, (out, finish)),
                        (true, 5) => run::<5, true>(x, weights, at, ox, geo, (out, finish)),
                        (true, 6) => run::<6, true>(x, weights, at, ox, geo, (out, finish)),
                        (true, 7) => run::<7, true>(x, weights, at, ox, geo, (out, finish)),
                        (true, _) => run::<RUN, true>(x, weights, at, ox, geo, (out, finish)),
                        (false, 1) => run::<1, false>(x, weights, at, ox, geo, (out, finish)),
                        (false, 2) => run::<2, false>(x, weights, at, ox, geo, (out, finish)),
                        (false, 3) => run::<3, false>(x, weights, at, ox, geo, (out, finish)),
                        (false, 4) => run::<4, false>(x, weights, at, ox, geo, (out, finish)),
                        (false, 5) => run::<5, false>(x, weights, at, ox, geo, (out, finish)),
                        (false, 6) => run::<6, false>(x, weights, at, ox, geo, (out, finish)),
                        (false, 7) => run::<7, false>(x, weights, at, ox, geo, (out, finish)),
                        (false, _) => run::<RUN, false>(x, weights, at, ox, geo, (out, finish)),
                    }
                }
            }
        };
    }
    if !pairs && fixed_width(&geo) {
        // The row in as few runs as `run_fixed` takes for this width and stride,
        // as even as they can be (a 14-pixel row in two runs of 7, not one of 12
        // and one of 2). A run with pixels at an edge skips, in each row of taps,
        // the columns left or right of the input row; the others check nothing.
        // (Run one tap at a time with a check on each, the 6 edge pixels of a
        // 56-pixel row took a third of a 7x7 layer's time; in runs of their own,
        // 3 sums each, they waited on their multiply-adds.)
        macro_rules! fixed_runs {
            ($kw:literal, $sx:literal; $($r:literal)+) => {{
                let full = [$($r),+].len();
                let len = geo.ow;
                let runs = len.div_ceil(full);
                for k in 0..runs {
                    let (from, to) = (len * k / runs, len * (k + 1) / runs);
                    let edge = from < lo || to > hi;
                    // SAFETY: as `chunk`'s; a run inside the interior reads all
                    // its taps, one at an edge only its taps inside the row.
                    unsafe {
                        let f = (out, finish);
                        match (edge, to - from) {
                            $((false, $r) => run_fixed::<$r, $kw, $sx, false>(x, weights, at, from, geo, f),)+
                            $((true, $r) => run_fixed::<$r, $kw, $sx, true>(x, weights, at, from, geo, f),)+
                            _ => unreachable!("runs of 1 to {full} pixels"),
                        }
                    }
                }
            }};
        }
        match (geo.kw, geo.stride[1]) {
            (3, 1) => fixed_runs!(3, 1; 1 2 3 4 5 6 7 8 9 10 11 12),
            (3, _) => fixed_runs!(3, 2; 1 2 3 4 5 6),
            (5, 1) => fixed_runs!(5, 1; 1 2 3 4 5 6 7 8),
            (5, _) => fixed_runs!(5, 2; 1 2 3 4 5 6),
            (_, 1) => fixed_runs!(7, 1; 1 2 3 4 5 6 7 8),
            (_, _) => fixed_runs!(7, 2; 1 2 3 4),
        }
        return;
    }
    // The left edge, the interior (runs that check nothing), then the right edge,
    // each in runs of at most `span` pixels.
    let mut ox = 0;
    while ox < lo {
        let count = span.min(lo - ox);
        chunk!(ox, count, false);
        ox += count;
    }
    while ox < hi {
        let count = span.min(hi - ox);
        chunk!(ox, count, true);
        ox += count;
    }
    while ox < geo.ow {
        let count = span.min(geo.ow - ox);
        chunk!(ox, count, false);
        ox += count;
    }
}

/// Stores a run's sums (`$acc`, `$r` consecutive output pixels), the first `$at`
/// floats into the row `$out`, `$b` floats apart, finished first when there is a
/// `$finish` (inline: a call took the sums through memory).
///
/// # Safety
/// Used inside an AVX-512F function; those pixels' `$mask` lanes are in the row
/// (and in the finish's residual row).
macro_rules! store_run {
    ($acc:expr, ($out:expr, $finish:expr), $at:expr, $b:expr, $mask:expr) => {
        for (r, &sum) in $acc.iter().enumerate() {
            let at = $at + r * $b;
            // SAFETY: the caller's contract.
            unsafe {
                let value = $finish.map_or(sum, |f: &LaneFinish| f.apply(sum, at, $mask));
                std::arch::x86_64::_mm512_mask_storeu_ps($out.add(at), $mask, value);
            }
        }
    };
}

/// [`run`] for blocks of half a vector at unit stride: vector `r` holds pixels
/// `ox + 2r` (low half) and `ox + 2r + 1` (high half), `count` pixels in all
/// (at most `2R`); each half takes only its taps inside the row unless `INSIDE`.
///
/// # Safety
/// As [`run`]; `geo.lanes` is half a vector, the weights fill both halves, and the
/// stride along the row is 1.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn run_pairs<const R: usize, const INSIDE: bool>(
    x: *const f32,
    weights: &[f32],
    (iy0, (ky_lo, ky_hi), _): (isize, (usize, usize), u16),
    (ox, count): (usize, usize),
    geo: DepthwiseRow,
    (out, finish): (*mut f32, Option<&LaneFinish>),
) {
    use std::arch::x86_64::*;
    const LOW: u16 = 0x00ff;
    const HIGH: u16 = 0xff00;
    let [dy, dx] = geo.dilation;
    let half = geo.lanes;
    // The lanes of each vector's pixels that exist.
    let present: [u16; R] = std::array::from_fn(|r| {
        (if 2 * r < count { LOW } else { 0 }) | (if 2 * r + 1 < count { HIGH } else { 0 })
    });
    let w = geo.w as isize;
    let mut acc = [_mm512_setzero_ps(); R];
    for ky in ky_lo..ky_hi {
        let iy = (iy0 + (ky * dy) as isize) as usize;
        let row = x.wrapping_add(iy * geo.w * half);
        for kx in 0..geo.kw {
            let first = (ox + kx * dx) as isize - geo.left as isize;
            // SAFETY: the caller's contract; a masked lane is never read, so a pair
            // whose low pixel lies left of the row reads only its high half.
            unsafe {
                let wv = _mm512_loadu_ps(weights.as_ptr().add((ky * geo.kw + kx) * BLOCK));
                for (r, sum) in acc.iter_mut().enumerate() {
                    let ix = first + 2 * r as isize;
                    let lanes = if INSIDE {
                        present[r]
                    } else {
                        present[r]
                            & ((if ix >= 0 && ix < w { LOW } else { 0 })
                                | (if ix + 1 >= 0 && ix + 1 < w { HIGH } else { 0 }))
                    };
                    if INSIDE || lanes != 0 {
                        let v =
                            _mm512_maskz_loadu_ps(lanes, row.wrapping_offset(ix * half as isize));
                        *sum = _mm512_fmadd_ps(v, wv, *sum);
                    }
                }
            }
        }
    }
    for (r, sum) in acc.iter().enumerate() {
        if present[r] != 0 {
            let at = (ox + 2 * r) * half;
            // SAFETY: the row's pixels `ox + 2r` and `ox + 2r + 1` where they exist
            // (the residual's too).
            unsafe {
                let value = finish.map_or(*sum, |f| f.apply(*sum, at, present[r]));
                _mm512_mask_storeu_ps(out.add(at), present[r], value)
            };
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn depthwise_row(
    _: *const f32,
    _: &[f32],
    _: usize,
    _: DepthwiseRow,
    _: (&mut [f32], Option<&LaneFinish>),
) {
    unreachable!("`kind` is None off x86-64")
}

/// Off x86-64 no kernel finishes in registers (`kind` is None there).
#[cfg(not(target_arch = "x86_64"))]
#[derive(Clone, Copy)]
struct LaneFinish {
    residual: Option<*const f32>,
}

#[cfg(not(target_arch = "x86_64"))]
impl LaneFinish {
    fn new(_: FinishSteps, _: (usize, usize), _: bool) -> LaneFinish {
        unreachable!("`kind` is None off x86-64")
    }
}

/// `R` output pixels from `ox`: their sums stay in registers over all taps.
/// `INSIDE`: every tap of every pixel lies inside the row (no checks); otherwise
/// each pixel takes only its taps inside.
///
/// # Safety
/// As [`depthwise_row`]; with `INSIDE`, every tap of pixels `ox..ox + R` lies
/// inside the row; `mask` has the block's lanes.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn run<const R: usize, const INSIDE: bool>(
    x: *const f32,
    weights: &[f32],
    (iy0, (ky_lo, ky_hi), mask): (isize, (usize, usize), u16),
    ox: usize,
    geo: DepthwiseRow,
    (out, finish): (*mut f32, Option<&LaneFinish>),
) {
    use std::arch::x86_64::*;
    let [dy, dx] = geo.dilation;
    let (sx, b) = (geo.stride[1], geo.lanes);
    let mut acc = [_mm512_setzero_ps(); R];
    for ky in ky_lo..ky_hi {
        let iy = (iy0 + (ky * dy) as isize) as usize;
        let row = x.wrapping_add(iy * geo.w * b);
        for kx in 0..geo.kw {
            // The input column of pixel `ox`'s tap (left of the row when negative).
            let first = (ox * sx + kx * dx) as isize - geo.left as isize;
            // SAFETY: the caller's contract (tap rows inside the plane; columns inside
            // the row, checked unless `INSIDE`; the masked lanes are never read).
            unsafe {
                let wv = _mm512_loadu_ps(weights.as_ptr().add((ky * geo.kw + kx) * BLOCK));
                for (r, sum) in acc.iter_mut().enumerate() {
                    let ix = first + (r * sx) as isize;
                    if INSIDE || (ix >= 0 && ix < geo.w as isize) {
                        let v = _mm512_maskz_loadu_ps(mask, row.add(ix as usize * b));
                        *sum = _mm512_fmadd_ps(v, wv, *sum);
                    }
                }
            }
        }
    }
    // Pixels `ox..ox + R` of the row (their lanes; the residual's too).
    store_run!(acc, (out, finish), ox * b, b, mask);
}

/// Whether [`run_fixed`] computes whole rows of this geometry (edges included): a
/// kernel 3, 5 or 7 taps wide, stride 1 or 2 along the row, no dilation there.
#[cfg(target_arch = "x86_64")]
fn fixed_width(geo: &DepthwiseRow) -> bool {
    matches!(geo.kw, 3 | 5 | 7) && matches!(geo.stride[1], 1 | 2) && geo.dilation[1] == 1
}

/// [`run`] for a kernel `KW` taps wide at stride `SX` along the row: each row of
/// taps loads each input vector it reads once and adds it, times each tap's
/// weights, to every sum that reads it. [`run`] loads a vector per multiply-add,
/// and vector loads from L1 run at half the rate of the multiply-adds here (a
/// 96-channel 3x3 layer took twice ONNX Runtime's time). With `EDGE`, the columns
/// left or right of the input row are skipped (their loads masked off).
///
/// # Safety
/// As [`run`] with `INSIDE = !EDGE`; `geo.kw == KW`, `geo.stride[1] == SX` and
/// `geo.dilation[1] == 1`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn run_fixed<const R: usize, const KW: usize, const SX: usize, const EDGE: bool>(
    x: *const f32,
    weights: &[f32],
    (iy0, (ky_lo, ky_hi), mask): (isize, (usize, usize), u16),
    ox: usize,
    geo: DepthwiseRow,
    (out, finish): (*mut f32, Option<&LaneFinish>),
) {
    use std::arch::x86_64::*;
    let b = geo.lanes;
    let dy = geo.dilation[0];
    // The first input column read (left of the row when negative, at an edge).
    let first = (ox * SX) as isize - geo.left as isize;
    // Each column's lanes: none for a column outside the row (padding, read as
    // zeros and never touched: a masked-off load does not fault). Masks rather
    // than a branch per column, which kept the loop from unrolling.
    let columns = const {
        assert!((R - 1) * SX + KW <= MAX_RUN_COLUMNS);
        (R - 1) * SX + KW
    };
    let mut lanes = [mask; MAX_RUN_COLUMNS];
    if EDGE {
        for (j, lane) in lanes.iter_mut().enumerate().take(columns) {
            if !(0..geo.w as isize).contains(&(first + j as isize)) {
                *lane = 0;
            }
        }
    }
    let mut acc = [_mm512_setzero_ps(); R];
    for ky in ky_lo..ky_hi {
        let iy = (iy0 + (ky * dy) as isize) as usize;
        // SAFETY (all loads): the caller's contract: every column of the run's
        // window lies inside the row but, at an edge, those whose lanes are all
        // masked off (never read), and the weights hold `kh * KW` vectors.
        let row = x.wrapping_offset((iy * geo.w) as isize * b as isize + first * b as isize);
        let w: [__m512; KW] = std::array::from_fn(|kx| unsafe {
            _mm512_loadu_ps(weights.as_ptr().add((ky * KW + kx) * BLOCK))
        });
        // Each column written out, so that every index is a constant and the sums
        // stay in registers (as a loop, some runs' columns were not unrolled and
        // their sums went through the stack).
        macro_rules! column {
            ($($j:literal)+) => {$(
                if $j < columns {
                    let lane = if EDGE { lanes[$j] } else { mask };
                    let v = unsafe { _mm512_maskz_loadu_ps(lane, row.wrapping_add($j * b)) };
                    for (kx, &wv) in w.iter().enumerate() {
                        // Column `j` is tap `kx` of output `(j - kx) / SX` when that
                        // divides.
                        if $j >= kx && ($j - kx) % SX == 0 && ($j - kx) / SX < R {
                            let r = ($j - kx) / SX;
                            acc[r] = _mm512_fmadd_ps(v, wv, acc[r]);
                        }
                    }
                }
            )+};
        }
        column!(0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
    }
    // Pixels `ox..ox + R` of the row (their lanes; the residual's too).
    store_run!(acc, (out, finish), ox * b, b, mask);
}

/// The most input columns a run of [`run_fixed`] reads: `(R - 1) * SX + KW` for
/// its widest runs.
#[cfg(target_arch = "x86_64")]
const MAX_RUN_COLUMNS: usize = 16;

/// Whether a block of `lanes` channels at `stride` along the row runs in pairs of
/// pixels a vector ([`run_pairs`]): half-vector blocks at unit stride.
fn pairs(lanes: usize, stride: usize) -> bool {
    lanes * 2 == BLOCK && stride == 1
}

/// A [`Finish`]'s steps but the residual: bias, activation, channel affine.
type FinishSteps<'a> = (
    Option<&'a [f32]>,
    Option<crate::gemm::Activation>,
    Option<super::conv_f32::ChannelAffine<'a>>,
);

/// A depthwise finish in vector form for one block of channels, applied to each
/// output vector as it is stored (a pass over each stored row cost a 96-channel
/// 3x3 layer a third of its time).
#[cfg(target_arch = "x86_64")]
#[derive(Clone, Copy)]
struct LaneFinish {
    bias: Option<std::arch::x86_64::__m512>,
    activation: Option<crate::gemm::Activation>,
    affine: Option<(
        std::arch::x86_64::__m512,
        std::arch::x86_64::__m512,
        Option<crate::gemm::Activation>,
    )>,
    /// The residual at the output row's place.
    residual: Option<*const f32>,
}

#[cfg(target_arch = "x86_64")]
impl LaneFinish {
    /// A finish's bias, activation and affine (the residual comes per row) with
    /// their per-channel values for the `b` channels from `first`, a lane per
    /// channel (both halves of a vector for `pairs` of pixels). Every activation
    /// must have a vector form ([`Finish::has_lanes_form`]).
    fn new(
        (bias, activation, affine): FinishSteps,
        (first, b): (usize, usize),
        pairs: bool,
    ) -> LaneFinish {
        let lanes = |values: &[f32]| {
            let lane = |j: usize| {
                if pairs || j < b {
                    values[first + j % b]
                } else {
                    0.0
                }
            };
            let values: [f32; BLOCK] = std::array::from_fn(lane);
            // SAFETY: 16 floats; AVX-512F (the kernel's).
            unsafe { std::arch::x86_64::_mm512_loadu_ps(values.as_ptr()) }
        };
        LaneFinish {
            bias: bias.map(lanes),
            activation,
            affine: affine.map(|(scale, shift, post)| (lanes(scale), lanes(shift), post)),
            residual: None,
        }
    }

    /// The finished value of output vector `x`, `at` floats into the row (the
    /// residual's `mask` lanes there).
    ///
    /// # Safety
    /// AVX-512F is available; the residual row holds those lanes.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn apply(
        &self,
        x: std::arch::x86_64::__m512,
        at: usize,
        mask: u16,
    ) -> std::arch::x86_64::__m512 {
        use crate::gemm::activate_lanes_avx512 as activate;
        use std::arch::x86_64::*;
        let mut x = x;
        if let Some(bias) = self.bias {
            x = _mm512_add_ps(x, bias);
        }
        // SAFETY (all): the caller's contract.
        if let Some(a) = self.activation {
            x = unsafe { activate(x, a) };
        }
        if let Some(residual) = self.residual {
            x = _mm512_add_ps(x, unsafe { _mm512_maskz_loadu_ps(mask, residual.add(at)) });
        }
        if let Some((scale, shift, post)) = self.affine {
            x = _mm512_fmadd_ps(x, scale, shift);
            if let Some(a) = post {
                x = unsafe { activate(x, a) };
            }
        }
        x
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm::tests::lcg;
    use crate::kernels::conv::{conv2d as direct_conv2d, extent};
    use crate::layout::{from_blocked, to_blocked};

    /// What the kernels are checked with: a window, the shapes, and the finish.
    struct Case {
        threads: usize,
        x: [usize; 4],
        o: usize,
        kernel: [usize; 2],
        win: Window2d,
        groups: usize,
        /// Whether the input, then the output (and residual), are blocked.
        layout: [bool; 2],
        residual: bool,
        affine: bool,
        /// An input prologue: `silu(x * scale + shift)`.
        prologue: bool,
        /// Instead, an input affine alone, `x * scale + shift`, folded into the
        /// weights and bias ([`fold_prologue`]; pointwise only).
        folded: bool,
    }

    impl Case {
        /// A dense convolution of one group (`o` filters over a window of `win`).
        fn dense(
            threads: usize,
            x: [usize; 4],
            o: usize,
            win: Window2d,
            layout: [bool; 2],
        ) -> Case {
            Case {
                threads,
                x,
                o,
                kernel: win.kernel,
                win,
                groups: 1,
                layout,
                residual: false,
                affine: false,
                prologue: false,
                folded: false,
            }
        }
    }

    fn window(
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 4],
        dilation: [usize; 2],
    ) -> Window2d {
        Window2d {
            kernel,
            stride,
            padding,
            dilation,
        }
    }

    /// Runs the case's kernel on fresh random data and compares it, value by value,
    /// with the plain direct convolution (sums in `f64`) followed by the finish
    /// written out in scalars: bias, ReLU6, residual, then `scale * v + shift` and
    /// hard-swish.
    fn check(case: &Case, seed: u64) {
        check_with(case, seed, crate::gemm::Activation::Relu6);
    }

    /// [`check`] with `activation` after the bias (ReLU, ReLU6 or the tanh GELU).
    fn check_with(case: &Case, seed: u64, activation: crate::gemm::Activation) {
        let [n, c, h, w] = case.x;
        // Blocked kernels need AVX2 and FMA.
        if !crate::isa::isa().avx2_fma {
            return;
        }
        let mut seed = seed;
        let (o, [kh, kw]) = (case.o, case.kernel);
        let cg = c / case.groups;
        let (oh, ow) = (extent(&case.win, 0, h), extent(&case.win, 1, w));
        let (pixels, out_pixels) = (h * w, oh * ow);
        let mut random = |len: usize| -> Vec<f32> { (0..len).map(|_| lcg(&mut seed)).collect() };
        let x = random(n * c * pixels);
        let wt = random(o * cg * kh * kw);
        let bias = random(o);
        let residual = random(n * o * out_pixels);
        let (scale, shift) = (random(o), random(o));
        let xs = Shape::new(&[n, c, h, w], DType::F32);
        let os = Shape::new(&[n, o, oh, ow], DType::F32);
        let ws = Shape::new(&[o, cg, kh, kw], DType::F32);
        let src = |values: &[f32], shape| Src {
            ptr: values.as_ptr().cast(),
            shape,
            len: values.len(),
        };
        let dst = |values: &mut [f32], shape| Dst {
            ptr: values.as_mut_ptr().cast(),
            shape,
            len: values.len(),
        };
        let (in_scale, in_shift) = (random(c), random(c));
        let changed: Vec<f32> = if case.prologue || case.folded {
            x.iter()
                .enumerate()
                .map(|(i, &v)| {
                    let ci = i / pixels % c;
                    let v = v * in_scale[ci] + in_shift[ci];
                    if case.folded {
                        v
                    } else {
                        v / (1.0 + (-v).exp())
                    }
                })
                .collect()
        } else {
            x.clone()
        };
        let mut want = vec![f32::NAN; n * o * out_pixels];
        direct_conv2d(
            &case.win,
            case.groups,
            src(&changed, &xs),
            src(&wt, &ws),
            None,
            dst(&mut want, &os),
        );
        for (i, v) in want.iter_mut().enumerate() {
            let co = i / out_pixels % o;
            let biased = *v + bias[co];
            let mut value = match activation {
                crate::gemm::Activation::Relu => biased.max(0.0),
                crate::gemm::Activation::GeluTanh => {
                    let inner = (2.0 / std::f32::consts::PI).sqrt()
                        * (biased + 0.044715 * biased * biased * biased);
                    0.5 * biased * (1.0 + inner.tanh())
                }
                _ => biased.clamp(0.0, 6.0),
            };
            if case.residual {
                value += residual[i];
            }
            if case.affine {
                value = value * scale[co] + shift[co];
                value *= (value + 3.0).clamp(0.0, 6.0) / 6.0;
            }
            *v = value;
        }
        let [x_blocked, out_blocked] = case.layout;
        let x_stored = if x_blocked {
            to_blocked(&x, c, pixels)
        } else {
            x.clone()
        };
        let residual_stored = if out_blocked {
            to_blocked(&residual, o, out_pixels)
        } else {
            residual.clone()
        };
        let layout = StepLayout::new(&[x_blocked, false], out_blocked);
        let kind = kind(&case.win, case.groups, &xs, &ws, layout).expect("a blocked kernel");
        let pool = ThreadPool::new(case.threads);
        let floats = thread_floats(kind, &case.win, [&xs, &ws], true);
        let scratch = GemmScratch::new(case.threads, floats);
        let finish = Finish {
            bias: Some(&bias),
            activation: Some(activation),
            residual: case.residual.then(|| src(&residual_stored, &os)),
            affine: case.affine.then_some((
                &scale[..],
                &shift[..],
                Some(crate::gemm::Activation::HardSwish),
            )),
        };
        let prologue = case.prologue.then_some(Prologue {
            affine: Some((&in_scale[..], &in_shift[..])),
            activation: Some(crate::gemm::Activation::Silu),
        });
        // Room past the output, which must stay untouched.
        const GUARD: usize = 256;
        let mut out = vec![f32::NAN; n * o * out_pixels + GUARD];
        let x_src = src(&x_stored, &xs);
        match kind {
            BlockedConv::Pointwise => {
                let mut packed = vec![0.0; conv_pixels_f32::weights_len(o, c)];
                conv_pixels_f32::pack_weights(&wt, o, c, &mut packed);
                let mut offsets = vec![0u32; c];
                channel_offsets(pixels, x_blocked, &mut offsets);
                let out_dst = dst(&mut out, &os);
                let mut folded_bias = vec![f32::NAN; o.div_ceil(NR) * NR];
                let (prologue, finish) = if case.folded {
                    let affine = (&in_scale[..], &in_shift[..]);
                    // Folded from weights packed ahead into another buffer, and in
                    // place: the same values.
                    let mut from_ahead = vec![f32::NAN; packed.len()];
                    let mut bias_from_ahead = folded_bias.clone();
                    let pool_threads = (&pool, case.threads);
                    assert!(
                        fold_prologue(
                            affine,
                            (Some(&packed), &mut from_ahead, c),
                            finish.bias,
                            &mut bias_from_ahead,
                            pool_threads,
                        )
                        .unwrap()
                    );
                    assert!(
                        fold_prologue(
                            affine,
                            (None, &mut packed, c),
                            finish.bias,
                            &mut folded_bias,
                            pool_threads,
                        )
                        .unwrap()
                    );
                    assert_eq!(from_ahead, packed);
                    assert_eq!(bias_from_ahead, folded_bias);
                    let bias = Some(&folded_bias[..]);
                    (None, Finish { bias, ..finish })
                } else {
                    (prologue, finish)
                };
                pointwise(
                    x_src,
                    (&packed, &offsets),
                    prologue,
                    finish,
                    out_dst,
                    layout,
                    (&scratch, &pool),
                )
                .unwrap();
            }
            BlockedConv::Dense => {
                let k = cg * kh * kw;
                let mut packed = vec![0.0; conv_pixels_f32::weights_len(o, k)];
                let order = conv_pixels_f32::StepOrder::of(x_blocked, cg, kh * kw);
                conv_pixels_f32::pack_weights_in(&wt, o, k, order, &mut packed);
                let blocks = conv_pixels_f32::BlockedIo {
                    input: x_blocked,
                    output: out_blocked,
                };
                let out_dst = dst(&mut out, &os);
                conv_pixels_f32::conv2d(
                    &case.win,
                    x_src,
                    &packed,
                    (finish, prologue),
                    out_dst,
                    blocks,
                    (&scratch, &pool),
                )
                .unwrap();
            }
            BlockedConv::Winograd => {
                let mut transformed = vec![0.0; crate::kernels::winograd_f32::weights_len(c, o)];
                crate::kernels::winograd_f32::transform_weights(&wt, c, o, &mut transformed);
                let blocks = conv_pixels_f32::BlockedIo {
                    input: x_blocked,
                    output: out_blocked,
                };
                let out_dst = dst(&mut out, &os);
                crate::kernels::winograd_f32::conv2d(
                    &case.win,
                    x_src,
                    &transformed,
                    finish,
                    (out_dst, blocks),
                    (&scratch, &pool),
                )
                .unwrap();
            }
            BlockedConv::Grouped => {
                let taps = kh * kw;
                let mut packed = vec![f32::NAN; conv_pixels_f32::block_groups_weights_len(o, taps)];
                conv_pixels_f32::pack_block_groups(&wt, o, (cg, taps), &mut packed);
                let out_dst = dst(&mut out, &os);
                conv_pixels_f32::conv2d_block_groups(
                    &case.win,
                    x_src,
                    &packed,
                    finish,
                    out_dst,
                    (&scratch, &pool),
                )
                .unwrap();
            }
            BlockedConv::Depthwise => {
                // With a residual the weights come packed ahead, without one each
                // task arranges its own.
                let (c, taps) = (case.o, case.kernel[0] * case.kernel[1]);
                let mut ahead = vec![f32::NAN; depthwise_weights_len(c, taps)];
                pack_depthwise_weights(&wt, taps, &mut ahead);
                let out_dst = dst(&mut out, &os);
                depthwise(
                    &case.win,
                    [x_src, src(&wt, &ws)],
                    case.residual.then_some(&ahead[..]),
                    finish,
                    out_dst,
                    (&scratch, &pool),
                )
                .unwrap();
            }
        }
        let past = out.split_off(n * o * out_pixels);
        assert!(
            past.iter().all(|v| v.is_nan()),
            "{kind:?} wrote past the output"
        );
        let got = if out_blocked {
            from_blocked(&out, o, out_pixels)
        } else {
            out
        };
        let what = format!(
            "{} threads x{:?} o{o} k{:?} {:?} groups {} layout {:?} prologue {} folded {} {activation:?}",
            case.threads,
            case.x,
            case.kernel,
            case.win,
            case.groups,
            case.layout,
            case.prologue,
            case.folded
        );
        let tol = 5e-6 * ((cg * kh * kw) as f64).sqrt();
        for (i, (&got, &want)) in got.iter().zip(&want).enumerate() {
            let (got, want) = (f64::from(got), f64::from(want));
            assert!(
                (got - want).abs() <= tol * (1.0 + want.abs()),
                "{what}: output {i}: {got} vs {want}"
            );
        }
    }

    #[test]
    fn plain_pointwise_convolutions_take_the_kernel_only_over_few_pixels() {
        let one = window([1, 1], [1, 1], [0; 4], [1, 1]);
        let plain = StepLayout::new(&[false, false], false);
        let chosen = |x: [usize; 4], o: usize| {
            let (xs, ws) = (
                Shape::new(&x, DType::F32),
                Shape::new(&[o, x[1], 1, 1], DType::F32),
            );
            kind(&one, 1, &xs, &ws, plain)
        };
        if !crate::isa::isa().avx512f {
            return;
        }
        assert_eq!(chosen([1, 960, 16, 16], 256), Some(BlockedConv::Pointwise));
        assert_eq!(chosen([4, 2048, 7, 7], 512), Some(BlockedConv::Pointwise));
        assert_eq!(chosen([1, 512, 28, 28], 128), None);
        assert_eq!(chosen([1, 64, 14, 14], 256), None);
        assert_eq!(chosen([1, 960, 1, 1], 240), None);
        // Other windows stay on their plain kernels.
        let (xs, ws) = (
            Shape::new(&[1, 960, 16, 16], DType::F32),
            Shape::new(&[256, 960, 3, 3], DType::F32),
        );
        let three = window([3, 3], [1, 1], [1; 4], [1, 1]);
        assert_eq!(kind(&three, 1, &xs, &ws, plain), None);
    }

    #[test]
    fn pointwise_matches_the_reference_in_every_layout() {
        let one = window([1, 1], [1, 1], [0; 4], [1, 1]);
        // (threads, x dims, output channels, layouts): plain sides may have any
        // channel count; tails of pixel tiles (7 x 5 = 35 pixels) and of panel
        // groups (80 channels: 4 + 1 panels).
        let cases = [
            (2, [2, 32, 7, 5], 48, [true, true]),
            (3, [1, 64, 9, 9], 80, [true, false]),
            (2, [2, 24, 6, 7], 32, [false, true]),
            (1, [1, 48, 3, 4], 40, [true, false]),
            (4, [3, 16, 11, 13], 16, [true, true]),
            (2, [1, 160, 7, 7], 96, [true, true]),
            // Groups of four whole panels over whole blocks: the tiles' run in one
            // loop, with few steps and with many (weights and blocks asked ahead).
            (2, [2, 64, 9, 8], 128, [true, true]),
            (3, [1, 528, 6, 7], 64, [true, true]),
            // Groups of three and four whole panels over steps with a tail (a last
            // block of 8 in).
            (2, [1, 40, 9, 7], 64, [true, true]),
            (2, [2, 72, 6, 8], 48, [true, true]),
            // Last blocks of 8: in (a tail of the steps), out (a last half
            // panel, alone or after whole ones), both, and beside a side of whole
            // blocks.
            (2, [2, 24, 7, 5], 40, [true, true]),
            (3, [1, 40, 6, 6], 72, [false, true]),
            (2, [1, 72, 9, 4], 32, [true, false]),
            (1, [2, 32, 5, 5], 24, [true, true]),
            // Many input channels (their weights asked ahead), in from either
            // layout, and from and into values ending in a block of 8.
            (2, [1, 640, 5, 7], 48, [true, true]),
            (3, [2, 528, 4, 5], 64, [false, true]),
            (2, [1, 520, 5, 7], 24, [true, true]),
            // Twice as many filters as pixels or more (by filters on AVX2): a short
            // last tile, last blocks of 8 in and out over two images, and passes
            // over the input channels (2320 of them over 15 pixels).
            (2, [1, 256, 3, 5], 64, [true, true]),
            (3, [2, 200, 2, 5], 72, [true, true]),
            (1, [1, 2320, 3, 5], 48, [true, true]),
            // One block of 8 in: the last pass alone, all tail.
            (2, [1, 8, 2, 3], 24, [true, true]),
            // Plain in and out: few pixels over many channels (a 16 x 16 plane,
            // weights asked ahead, and a last pixel tile and panel group short).
            (2, [1, 160, 7, 7], 96, [false, false]),
            (3, [2, 544, 16, 16], 72, [false, false]),
            (1, [1, 130, 9, 5], 40, [false, false]),
        ];
        for (i, &(threads, x, o, layout)) in cases.iter().enumerate() {
            // Plain on both sides, the kernel takes a product on AVX-512 only.
            if layout == [false, false] && !crate::isa::isa().avx512f {
                continue;
            }
            for (residual, affine, prologue, folded) in [
                (false, false, false, false),
                (true, false, false, false),
                (true, true, false, false),
                (false, false, true, false),
                (true, true, true, false),
                (false, false, false, true),
                (true, true, false, true),
            ] {
                let case = Case {
                    threads,
                    x,
                    o,
                    kernel: [1, 1],
                    win: one,
                    groups: 1,
                    layout,
                    residual,
                    affine,
                    prologue,
                    folded,
                };
                check(&case, 11 + i as u64);
                if !residual && !affine {
                    // A ReLU (applied in the micro-kernel's registers on whole tiles
                    // into blocked outputs), and an activation without a vector form
                    // (applied after the products).
                    check_with(&case, 31 + i as u64, crate::gemm::Activation::Relu);
                    check_with(&case, 41 + i as u64, crate::gemm::Activation::GeluTanh);
                }
            }
        }
    }

    #[test]
    fn grouped_matches_the_reference_for_every_group_width() {
        // (threads, x dims, groups, window): groups 2 to 16 channels wide (RegNet's
        // 8, ResNeXt's 4), strides 1 and 2, 1x1 and 5x5 windows, several images.
        let cases = [
            (
                2,
                [1, 48, 14, 13],
                6,
                window([3, 3], [1, 1], [1, 1, 1, 1], [1, 1]),
            ),
            (
                3,
                [2, 32, 9, 11],
                8,
                window([3, 3], [2, 2], [1, 1, 1, 1], [1, 1]),
            ),
            (
                2,
                [1, 64, 7, 7],
                4,
                window([3, 3], [1, 1], [1, 1, 1, 1], [1, 1]),
            ),
            (
                1,
                [1, 32, 10, 9],
                16,
                window([5, 5], [1, 1], [2, 2, 2, 2], [1, 1]),
            ),
            (2, [1, 16, 6, 8], 2, window([1, 1], [1, 1], [0; 4], [1, 1])),
            (
                2,
                [1, 80, 15, 15],
                10,
                window([3, 3], [2, 2], [1, 0, 1, 1], [1, 1]),
            ),
            // A last block of 8: RegNet's 104 and 440 channels in groups of 8.
            (
                2,
                [1, 104, 9, 10],
                13,
                window([3, 3], [1, 1], [1, 1, 1, 1], [1, 1]),
            ),
            (
                3,
                [2, 40, 8, 7],
                10,
                window([3, 3], [2, 2], [1, 1, 1, 1], [1, 1]),
            ),
        ];
        for (i, &(threads, x, groups, win)) in cases.iter().enumerate() {
            for (residual, affine) in [(false, false), (true, true)] {
                let case = Case {
                    threads,
                    x,
                    o: x[1],
                    kernel: win.kernel,
                    win,
                    groups,
                    layout: [true, true],
                    residual,
                    affine,
                    prologue: false,
                    folded: false,
                };
                check(&case, 201 + i as u64);
                if i % 2 == 0 {
                    check_with(&case, 251 + i as u64, crate::gemm::Activation::GeluTanh);
                }
            }
        }
    }

    #[test]
    fn depthwise_matches_the_reference_for_every_window() {
        // (threads, x dims, window): 3x3 and 5x5, strides 1 and 2, dilation,
        // asymmetric and no padding, planes narrower than a run of 8 pixels and
        // rows where the edge pixels meet; short rows are staged with their
        // padding, long ones are not.
        let cases = [
            (
                2,
                [2, 32, 9, 11],
                window([3, 3], [1, 1], [1, 1, 1, 1], [1, 1]),
            ),
            (
                3,
                [1, 48, 14, 14],
                window([3, 3], [2, 2], [1, 1, 1, 1], [1, 1]),
            ),
            (
                2,
                [1, 16, 7, 7],
                window([5, 5], [1, 1], [2, 2, 2, 2], [1, 1]),
            ),
            (
                2,
                [2, 32, 12, 17],
                window([5, 5], [2, 2], [2, 2, 2, 2], [1, 1]),
            ),
            (
                1,
                [1, 16, 10, 10],
                window([3, 3], [1, 1], [2, 2, 2, 2], [2, 2]),
            ),
            (
                2,
                [1, 32, 9, 8],
                window([3, 3], [2, 2], [0, 0, 1, 1], [1, 1]),
            ),
            (4, [1, 64, 20, 23], window([3, 3], [1, 1], [0; 4], [1, 1])),
            (
                2,
                [1, 16, 3, 2],
                window([7, 7], [1, 1], [3, 3, 3, 3], [1, 1]),
            ),
            // Rows too long to stage: the edge runs skip the columns outside the
            // row (masked off), or check each tap where the width is not fixed.
            // Rows narrower than the window and too tall to stage: every run is
            // an edge run, masked on both sides (at stride 1 and 2).
            (
                1,
                [1, 16, 130, 2],
                window([7, 7], [1, 1], [3, 3, 3, 3], [1, 1]),
            ),
            (
                2,
                [1, 16, 140, 3],
                window([7, 7], [2, 2], [3, 3, 3, 3], [1, 1]),
            ),
            (
                2,
                [1, 32, 6, 40],
                window([3, 3], [1, 1], [1, 1, 1, 1], [1, 1]),
            ),
            (
                3,
                [1, 16, 5, 70],
                window([5, 5], [2, 2], [2, 1, 2, 2], [1, 1]),
            ),
            (
                2,
                [1, 24, 4, 37],
                window([5, 5], [1, 1], [2, 2, 2, 2], [1, 1]),
            ),
            // Long interior runs of every width and stride the fixed runs take
            // (7 wide, stride 2, asymmetric padding), and a dilated row beside.
            (
                2,
                [1, 32, 9, 45],
                window([7, 7], [1, 1], [3, 3, 3, 3], [1, 1]),
            ),
            (
                2,
                [1, 16, 8, 61],
                window([7, 7], [2, 2], [3, 2, 3, 4], [1, 1]),
            ),
            (
                3,
                [1, 48, 6, 53],
                window([3, 3], [2, 2], [1, 0, 1, 1], [1, 1]),
            ),
            (
                1,
                [1, 32, 7, 50],
                window([3, 3], [1, 1], [2, 2, 2, 2], [2, 2]),
            ),
            // Last blocks of 8 (pairs of pixels at unit stride: runs of 1 to 8
            // pairs, and a right edge run of more than one pixel).
            (
                2,
                [2, 24, 9, 11],
                window([3, 3], [1, 1], [1, 1, 1, 1], [1, 1]),
            ),
            (
                2,
                [1, 24, 5, 41],
                window([5, 5], [1, 1], [2, 2, 2, 2], [1, 1]),
            ),
            (
                3,
                [1, 40, 14, 13],
                window([5, 5], [2, 2], [2, 2, 2, 2], [1, 1]),
            ),
            (
                1,
                [1, 72, 10, 10],
                window([3, 3], [1, 1], [2, 2, 2, 2], [2, 2]),
            ),
            // A last block of 8 at stride 2 in long rows: fixed runs under a mask.
            (
                2,
                [1, 40, 5, 47],
                window([5, 5], [2, 2], [2, 2, 2, 2], [1, 1]),
            ),
        ];
        for (i, &(threads, x, win)) in cases.iter().enumerate() {
            for (residual, affine) in [(false, false), (true, true)] {
                let case = Case {
                    threads,
                    x,
                    o: x[1],
                    kernel: win.kernel,
                    win,
                    groups: x[1],
                    layout: [true, true],
                    residual,
                    affine,
                    prologue: false,
                    folded: false,
                };
                check(&case, 101 + i as u64);
                if i % 3 == 0 {
                    check_with(&case, 151 + i as u64, crate::gemm::Activation::GeluTanh);
                }
            }
        }
    }

    #[test]
    fn dense_matches_the_reference_in_every_layout() {
        let three = |stride, padding| window([3, 3], [stride, stride], padding, [1, 1]);
        // (threads, x dims, output channels, window): 3x3 layers the plain layout
        // runs without Winograd (under 32 channels, strided, few tiles), a stem of
        // 3 channels, a strided 1x1, a dilated 5x5 with asymmetric padding, last
        // blocks of 8, and depths over one block of steps (144 x 9 > KC; 136 x 9
        // in runs of 8, over 7 x 7 pixels whose tiles cross rows).
        let cases = [
            (2, [2, 16, 11, 13], 64, three(1, [1; 4])),
            (3, [1, 32, 14, 15], 48, three(2, [1; 4])),
            (2, [1, 16, 9, 9], 24, three(1, [0, 1, 2, 1])),
            (
                1,
                [2, 3, 17, 19],
                32,
                window([7, 7], [2, 2], [3; 4], [1, 1]),
            ),
            (
                2,
                [1, 64, 9, 11],
                32,
                window([1, 1], [2, 2], [0; 4], [1, 1]),
            ),
            (
                2,
                [1, 24, 12, 10],
                40,
                window([5, 5], [1, 1], [4, 3, 2, 4], [2, 2]),
            ),
            (4, [1, 144, 6, 6], 32, three(1, [1; 4])),
            (2, [3, 8, 5, 7], 8, three(1, [1; 4])),
            (2, [1, 136, 7, 7], 40, three(1, [1; 4])),
            // Weights that outweigh the input, run in channel slices: a strided
            // 3x3 in three slices (the last of 64 channels), and a strided 1x1
            // whose whole image overflows the staging budget of any L2 up to 2 MiB.
            (2, [1, 320, 15, 15], 48, three(2, [1; 4])),
            (
                3,
                [1, 1024, 17, 17],
                296,
                window([1, 1], [2, 2], [0; 4], [1, 1]),
            ),
        ];
        for (i, &(threads, x, o, win)) in cases.iter().enumerate() {
            for layout in [[true, true], [true, false], [false, true]] {
                // Blocked sides need a multiple of 8 channels.
                let blockable = crate::layout::blockable_channels;
                if (layout[0] && !blockable(x[1])) || (layout[1] && !blockable(o)) {
                    continue;
                }
                for (residual, affine, prologue) in [
                    (false, false, false),
                    (true, false, false),
                    (true, true, true),
                    (false, false, true),
                ] {
                    let case = Case {
                        residual,
                        affine,
                        prologue,
                        ..Case::dense(threads, x, o, win, layout)
                    };
                    check(&case, 201 + i as u64);
                }
                // A bias and ReLU alone are applied as each tile is stored.
                let case = Case::dense(threads, x, o, win, layout);
                check_with(&case, 301 + i as u64, crate::gemm::Activation::Relu);
            }
        }
    }

    #[test]
    fn winograd_matches_the_reference_in_every_layout() {
        // The blocked kernels (and so `kind`'s choice) need AVX2 and FMA.
        if !crate::isa::isa().avx2_fma {
            return;
        }
        let three = |padding, dilation| window([3, 3], [1, 1], padding, [dilation; 2]);
        // (threads, x dims, output channels, window): 3x3 layers the blocked layout
        // runs by Winograd (64 or more input channels, tiles covering the output),
        // with a row of tiles past the bottom, last blocks of 8, asymmetric padding,
        // dilation, and two images.
        let cases = [
            (2, [1, 64, 16, 16], 64, three([1; 4], 1)),
            (3, [2, 64, 12, 16], 48, three([1; 4], 1)),
            (2, [1, 72, 16, 20], 40, three([0, 1, 2, 1], 1)),
            (1, [1, 64, 24, 24], 32, three([2; 4], 2)),
            (4, [1, 128, 28, 27], 96, three([1; 4], 1)),
        ];
        for (i, &(threads, x, o, win)) in cases.iter().enumerate() {
            for layout in [[true, true], [true, false], [false, true]] {
                for (residual, affine) in [(false, false), (true, false), (true, true)] {
                    let case = Case {
                        residual,
                        affine,
                        ..Case::dense(threads, x, o, win, layout)
                    };
                    let (xs, ws) = (
                        Shape::new(&x, DType::F32),
                        Shape::new(&[o, x[1], 3, 3], DType::F32),
                    );
                    let chosen = kind(&win, 1, &xs, &ws, StepLayout::new(&[layout[0]], layout[1]));
                    // Unless `RLX_WINOGRAD=0` turned the transform off.
                    if crate::kernels::conv_f32::method(&win, 1, &xs, &ws)
                        == crate::kernels::conv_f32::ConvMethod::Winograd
                    {
                        assert_eq!(chosen, Some(BlockedConv::Winograd), "case {i}");
                    }
                    check(&case, 401 + i as u64);
                }
                let case = Case::dense(threads, x, o, win, layout);
                check_with(&case, 501 + i as u64, crate::gemm::Activation::Relu);
            }
        }
    }
}
