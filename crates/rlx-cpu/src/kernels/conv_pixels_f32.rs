//! `f32` convolutions of one group as a product with output pixels for rows (an
//! image model's 7x7 stride-2 stem, its 3x3 layers, and 1x1 layers over planes too
//! small for the GEMM's panels; [`super::conv_f32::method`] chooses):
//! `Cᵀ[pixel, co] = Σ_p X[pixel, p] Wᵀ[p, co]` over `p = (ci, ky, kx)`.
//!
//! The GEMM path ([`super::conv_f32`]) keeps pixels in vectors, so a strided window
//! first splits its input into phase planes, computes junk columns between rows,
//! and multiplies per tap (or packs every `(channel, tap)` row). Here the
//! micro-kernel holds 6 output pixels by 16 output channels: each step broadcasts one
//! input value per pixel, from any address, so the stride costs nothing, and
//! multiplies it by 16 weights packed ahead (`Wᵀ` in panels of 16 channels). A table
//! gives each step's offset from a pixel's first input value, and each pixel of a
//! tile has its own base, so a tile's 6 pixels run on across output rows and only
//! the last tile of a block is short.
//!
//! A pool task takes a block of output rows of one image. It copies the input rows
//! they read, padded with zeros, so every tap reads inside the copy. Then, for each
//! panel of 16 output channels and each depth block of `KC` steps (whose weights stay
//! in L1), it runs every tile of the block; the last depth block stores the tile
//! transposed into the output's channel rows. The bias, activation, residual and
//! channel affine then run over the panel's finished rows. Into a channel-blocked
//! output in one depth block, the whole tiles instead go straight to their places
//! through [`micro_kernel_to`], a run of a row's tiles in one call, with any
//! finish that has a vector form applied as they are stored.

use super::blocked_conv_f32::Prologue;
use super::conv_f32::ChannelAffine;
use crate::gemm::Activation;
use crate::layout::{BLOCK, HALF};
use crate::pool::ThreadPool;
use crate::tensor::{Dst, Src};
use rlx_ir::{Result, Shape, Window2d};

#[cfg(target_arch = "x86_64")]
mod avx2;
mod slices;

/// Output pixels per tile (the micro-kernel's rows).
pub(crate) const MR: usize = 6;
/// [`MR`], for the choice of kernel.
pub(crate) const TILE_PIXELS: usize = MR;
/// Output channels per panel (the micro-kernel's columns: two AVX2 vectors).
pub(crate) const NR: usize = 16;
/// Steps per depth block (a 3x3 window over 128 channels takes one): a panel's
/// block of weights (`KC x NR` floats, 72 KiB) stays in L2 while every tile of the
/// block reads it. On the CRNN's 3x3 stride-2 layer at batch 32, blocks of 1152
/// steps ran in 9.06 ms, of 576 in 9.07, of 256 in 9.22 and of 128 in 9.60.
const KC: usize = 1152;
/// Floats of one tile's product, as the micro-kernel leaves it (`[pixel][channel]`).
pub(crate) const TILE: usize = MR * NR;
/// The most panels one micro-kernel call covers: with AVX-512, a tile is 6 pixels by
/// 4 panels (64 channels, 24 zmm accumulators), so each step's 6 broadcasts serve 24
/// multiply-adds instead of 12.
const MAX_GROUP: usize = 4;

/// Whether a convolution can run here: `f32` on a CPU with AVX2 and FMA, one group,
/// with offsets that fit 32 bits (a window of one tap too: [`super::conv_f32::method`]
/// takes it here only where the GEMM would waste columns). `RLX_CONV_PIXELS=0` in the
/// environment turns it off. ([`super::conv_f32::method`] chooses among the
/// convolution kernels that can run one.)
pub(crate) fn applies(win: &Window2d, groups: usize, x: &Shape) -> bool {
    let geo = Geometry::new(win, x, [1, 1]);
    groups == 1
        && geo.staged_len(geo.h + win.padding[0] + win.padding[2]) < u32::MAX as usize
        && supported()
        && enabled()
}

/// Floats of staged input a block may take: half of L2.
fn stage_budget() -> usize {
    crate::gemm::l2_cache_bytes() / 2 / 4
}

fn enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| rlx_ir::env::Switch::ConvPixels.enabled())
}

fn supported() -> bool {
    crate::isa::isa().avx2_fma
}

/// Floats of the packed weights of `o` filters of `k` values: `Wᵀ` in panels of
/// [`NR`] channels, zero past the last.
pub(crate) fn weights_len(o: usize, k: usize) -> usize {
    o.div_ceil(NR).saturating_mul(NR).saturating_mul(k)
}

/// The order of a convolution's steps, in its packed weights and in the offsets
/// that read its input: channel by channel, each channel's taps in turn
/// ([`StepOrder::NATURAL`]); or, over a channel-blocked input, block by block of
/// `runs` channels, each tap's `runs` channels of the block in turn, so that a
/// tap's steps read consecutive values of each pixel ([`TileInput::runs`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct StepOrder {
    /// Taps per channel (1 in the natural order, where they need not be told apart).
    pub taps: usize,
    /// Channels per run (1 in the natural order).
    pub runs: usize,
}

impl StepOrder {
    /// Channel by channel, each channel's taps in turn.
    pub(crate) const NATURAL: StepOrder = StepOrder { taps: 1, runs: 1 };

    /// The order [`conv2d`] reads the weights of a convolution over `cg` channels
    /// by `taps` taps in: in runs of a block's channels over a `blocked` input
    /// ([`step_runs`]), else natural (and natural wherever the two agree).
    pub(crate) fn of(blocked: bool, cg: usize, taps: usize) -> StepOrder {
        let runs = step_runs(blocked, cg);
        if runs == 1 || taps == 1 {
            StepOrder::NATURAL
        } else {
            StepOrder { taps, runs }
        }
    }

    /// The step that multiplies channel `ci`'s tap `tap`.
    fn step(self, ci: usize, tap: usize) -> usize {
        (ci / self.runs * self.taps + tap) * self.runs + ci % self.runs
    }
}

/// Channels per run of steps ([`StepOrder`]) over an input of `cg` channels: 1 for
/// a plain input; for a channel-blocked one, 16, or 8 where its channels end in a
/// block of 8 (staged as planes of 8).
pub(crate) fn step_runs(blocked: bool, cg: usize) -> usize {
    match blocked {
        false => 1,
        true if cg.is_multiple_of(BLOCK) => BLOCK,
        true => HALF,
    }
}

/// Packs OIHW weights (`o` filters of `k` values) into `out` ([`weights_len`]
/// floats) in the natural step order: panel `q` holds, for each step `p`, the 16
/// weights `W[q * 16 + j][p]`.
pub(crate) fn pack_weights(ws: &[f32], o: usize, k: usize, out: &mut [f32]) {
    pack_weights_in(ws, o, k, StepOrder::NATURAL, out);
}

/// [`pack_weights`] in step order `order` (`k = cg * order.taps` values a filter).
pub(crate) fn pack_weights_in(ws: &[f32], o: usize, k: usize, order: StepOrder, out: &mut [f32]) {
    let taps = order.taps.max(1);
    for (q, panel) in out[..weights_len(o, k)]
        .chunks_exact_mut(k * NR)
        .enumerate()
    {
        for j in 0..NR {
            let co = q * NR + j;
            for ci in 0..k / taps {
                for tap in 0..taps {
                    let p = ci * taps + tap;
                    panel[order.step(ci, tap) * NR + j] = if co < o { ws[co * k + p] } else { 0.0 };
                }
            }
        }
    }
}

/// Floats of [`pack_block_groups`]' form for `o` filters of `taps` taps.
pub(crate) fn block_groups_weights_len(o: usize, taps: usize) -> usize {
    weights_len(o, BLOCK.saturating_mul(taps))
}

/// Packs the OIHW weights of a grouped convolution whose groups of `cg` channels
/// (`cg` dividing 16, as many outputs as inputs a group) lie inside blocks of 16
/// channels ([`conv2d_block_groups`]): for each output channel, a filter over the
/// 16 input channels of its block, zero outside its group, in
/// [`pack_weights`]' form (`16 * taps` steps a panel) in the step order of a
/// blocked input ([`StepOrder`]: runs of the block's 16 channels, or 8 for a last
/// block of 8).
pub(crate) fn pack_block_groups(ws: &[f32], o: usize, (cg, taps): (usize, usize), out: &mut [f32]) {
    let k = BLOCK * taps;
    let out = &mut out[..weights_len(o, k)];
    out.fill(0.0);
    for co in 0..o {
        // The first input channel of the filter's group within its block.
        let first = co / cg * cg % BLOCK;
        let (q, j) = (co / NR, co % NR);
        // In runs of the block's channels: a last block of 8 reads the first
        // `8 * taps` steps of its panel.
        let runs = (o - q * NR).min(BLOCK);
        let order = StepOrder { taps, runs };
        for ci in 0..cg {
            for tap in 0..taps {
                let p = order.step(first + ci, tap);
                out[(q * k + p) * NR + j] = ws[(co * cg + ci) * taps + tap];
            }
        }
    }
}

/// The sizes of one convolution, and of the padded input rows a block stages.
#[derive(Clone, Copy)]
struct Geometry {
    cg: usize,
    h: usize,
    w: usize,
    oh: usize,
    ow: usize,
    /// Columns of a staged row: every column some tap reads, from the left padding.
    wp: usize,
    /// Input channels per staged plane: 1 for a plain input; for a channel-blocked
    /// one, 16, or 8 where its channels end in a block of 8 (the staged rows are
    /// `[plane][row][wp][lanes]`, every plane as wide, so that every pixel's
    /// inputs lie the same distances from its first).
    lanes: usize,
}

impl Geometry {
    fn new(win: &Window2d, x: &Shape, [oh, ow]: [usize; 2]) -> Geometry {
        let (sx, kw, dx) = (win.stride[1], win.kernel[1], win.dilation[1]);
        Geometry {
            cg: x.dim(1),
            h: x.dim(2),
            w: x.dim(3),
            oh,
            ow,
            wp: (ow.max(1) - 1) * sx + (kw - 1) * dx + 1,
            lanes: 1,
        }
    }

    /// The same geometry over a channel-blocked input (`blocked`).
    fn with_blocked_input(self, blocked: bool) -> Geometry {
        Geometry {
            lanes: step_runs(blocked, self.cg),
            ..self
        }
    }

    /// The geometry of a block of `cols` output columns of a row: its staged rows
    /// hold only the columns those read.
    fn columns(self, win: &Window2d, cols: usize) -> Geometry {
        let (sx, kw, dx) = (win.stride[1], win.kernel[1], win.dilation[1]);
        Geometry {
            ow: cols,
            wp: (cols.max(1) - 1) * sx + (kw - 1) * dx + 1,
            ..self
        }
    }

    /// Input rows that `rows` output rows read.
    fn rows_read(&self, win: &Window2d, rows: usize) -> usize {
        (rows.max(1) - 1) * win.stride[0] + (win.kernel[0] - 1) * win.dilation[0] + 1
    }

    /// Floats of `rows` staged input rows of every channel.
    fn staged_len(&self, rows: usize) -> usize {
        self.cg.saturating_mul(rows).saturating_mul(self.wp)
    }
}

/// How the output is cut into pool tasks: blocks of whole output rows of one image,
/// or, where one row's staged input overflows the budget (a long 1-D convolution
/// over many channels), blocks of the columns of one row.
#[derive(Clone, Copy)]
struct Blocking {
    /// Output rows per block.
    rows: usize,
    /// Blocks per image.
    blocks: usize,
    /// Output columns per block: the whole row, or whole tiles of it.
    cols: usize,
    /// Blocks per output row (1 for blocks of whole rows).
    row_blocks: usize,
}

/// One block of a [`Blocking`]: `rows` output rows from `y0`, of `cols` columns
/// from `x0`.
#[derive(Clone, Copy)]
struct BlockAt {
    y0: usize,
    rows: usize,
    x0: usize,
    cols: usize,
}

impl Blocking {
    /// Blocks whose staged input takes at most half of L2 (at least one output row,
    /// or whole tiles of one), evened out, and cut further when there are fewer
    /// images than threads.
    fn new(win: &Window2d, geo: &Geometry, images: usize, threads: usize) -> Blocking {
        let budget = stage_budget();
        let share = threads.div_ceil(images.max(1));
        let one_row = geo.rows_read(win, 1);
        if geo.ow > MR && geo.staged_len(one_row) > budget {
            // wav2vec2's first strided feature convolution (512 channels, 3199
            // samples, 6.5 MB a row) took 20.4 ms in one block of its row, and
            // 14.6 ms as per-tap GEMMs.
            let mut cols = geo.ow;
            while cols > MR && geo.columns(win, cols).staged_len(one_row) > budget {
                cols = cols.div_ceil(2);
            }
            let mut row_blocks = geo.ow.div_ceil(cols);
            if images * geo.oh < threads {
                row_blocks = row_blocks.next_multiple_of(share).min(geo.ow.div_ceil(MR));
            }
            let cols = geo.ow.div_ceil(row_blocks).next_multiple_of(MR);
            let row_blocks = geo.ow.div_ceil(cols);
            return Blocking {
                rows: 1,
                blocks: geo.oh.max(1) * row_blocks,
                cols,
                row_blocks,
            };
        }
        let mut fit = geo.oh.max(1);
        while fit > 1 && geo.staged_len(geo.rows_read(win, fit)) > budget {
            fit = fit.div_ceil(2);
        }
        let mut blocks = geo.oh.div_ceil(fit).max(1);
        if images < threads {
            // A multiple of the threads an image is shared by, so none idles while
            // another runs a last block.
            blocks = blocks.next_multiple_of(share).min(geo.oh.max(1));
        }
        let rows = geo.oh.div_ceil(blocks).max(1);
        Blocking {
            rows,
            blocks: geo.oh.div_ceil(rows).max(1),
            cols: geo.ow,
            row_blocks: 1,
        }
    }

    /// The largest block any thread count gives (one image, one thread).
    fn largest(win: &Window2d, geo: &Geometry) -> Blocking {
        Blocking::new(win, geo, 1, 1)
    }

    /// Block `b` of an image of `geo`'s output.
    fn block(&self, b: usize, geo: &Geometry) -> BlockAt {
        let (row_block, column_block) = (b / self.row_blocks, b % self.row_blocks);
        let (y0, x0) = (row_block * self.rows, column_block * self.cols);
        BlockAt {
            y0,
            rows: self.rows.min(geo.oh - y0),
            x0,
            cols: self.cols.min(geo.ow - x0),
        }
    }

    /// The geometry a block of `geo` stages: `geo` itself for whole rows, else
    /// that of its columns.
    fn geometry(&self, win: &Window2d, geo: &Geometry, at: &BlockAt) -> Geometry {
        match self.row_blocks {
            1 => *geo,
            _ => geo.columns(win, at.cols),
        }
    }
}

/// Per-thread floats a convolution here needs, from its input and weight shapes and
/// output rows and columns: the staged rows, the step offsets, and the products of
/// every tile of a block when the depth takes more than one block.
pub(crate) fn thread_floats(win: &Window2d, x: &Shape, w: &Shape, out_hw: [usize; 2]) -> usize {
    let geo = Geometry::new(win, x, out_hw);
    let blocking = Blocking::largest(win, &geo);
    let block = blocking.block(0, &geo);
    let staged = blocking.geometry(win, &geo, &block);
    let k = w.dim(1) * w.dim(2) * w.dim(3);
    let plain = staged.staged_len(geo.rows_read(win, block.rows))
        + k
        + products_len(k, block.rows * block.cols);
    plain.max(slices::thread_floats(win, &geo, w.dim(0)))
}

/// Floats of the tile products a block keeps between depth blocks (one tile when the
/// depth is one block).
fn products_len(k: usize, pixels: usize) -> usize {
    let group = MAX_GROUP * TILE;
    if k > KC {
        pixels.div_ceil(MR) * group
    } else {
        group
    }
}

/// What a convolution here (and a Winograd one) writes besides the product: bias,
/// then activation, then residual, then the channel affine and its activation.
pub(crate) struct Finish<'a> {
    pub bias: Option<&'a [f32]>,
    pub activation: Option<Activation>,
    pub residual: Option<Src<'a>>,
    pub affine: Option<ChannelAffine<'a>>,
}

impl<'a> Finish<'a> {
    /// Whether every activation of the finish has a vector form
    /// ([`crate::gemm::has_lanes_form`]), so a tile can be finished a vector at a
    /// time ([`RegisterFinish`]).
    pub(crate) fn has_lanes_form(&self) -> bool {
        let vector = |a: Option<Activation>| a.is_none_or(crate::gemm::has_lanes_form);
        vector(self.activation) && self.affine.is_none_or(|(_, _, post)| vector(post))
    }

    /// Whether it is at most a bias and a ReLU, which [`store_transposed`] applies as
    /// it stores a tile into a plain output.
    pub(crate) fn is_bias_and_relu(&self) -> bool {
        self.residual.is_none()
            && self.affine.is_none()
            && matches!(self.activation, None | Some(Activation::Relu))
    }

    /// The per-channel steps (without the residual's pointer, so that pool tasks can
    /// share them).
    pub(crate) fn per_channel(&self) -> ChannelFinish<'a> {
        ChannelFinish {
            bias: self.bias,
            activation: self.activation,
            affine: self.affine,
        }
    }
}

/// [`Finish`] less its residual, applied to one output channel at a time.
#[derive(Clone, Copy)]
pub(crate) struct ChannelFinish<'a> {
    bias: Option<&'a [f32]>,
    activation: Option<Activation>,
    affine: Option<ChannelAffine<'a>>,
}

impl ChannelFinish<'_> {
    /// The same steps less the bias (for a kernel that adds it itself).
    pub(crate) fn without_bias(self) -> Self {
        ChannelFinish { bias: None, ..self }
    }

    /// Applies the finish to output channel `channel`'s values in place (`residual`:
    /// the same pixels of the residual, when there is one); nothing when there is
    /// nothing to apply.
    pub(crate) fn apply(&self, channel: usize, values: &mut [f32], residual: Option<&[f32]>) {
        let shift = self.bias.map_or(0.0, |b| b[channel]);
        let affine = self
            .affine
            .map(|(s, t, activation)| crate::gemm::RowAffine {
                scale: s[channel],
                shift: t[channel],
                activation,
            });
        if shift != 0.0 || self.activation.is_some() || residual.is_some() || affine.is_some() {
            crate::gemm::activate_and_add(values, shift, self.activation, residual, affine);
        }
    }
}

impl ChannelFinish<'_> {
    /// Applies the finish to channel-blocked values in place: `values` holds pixels
    /// of the `block` channels from `first` (`residual`: the same values of the
    /// residual, when there is one).
    pub(crate) fn apply_lanes(
        &self,
        (first, block): (usize, usize),
        values: &mut [f32],
        residual: Option<&[f32]>,
    ) {
        let lanes = first..first + block;
        let shift = self.bias.map(|b| &b[lanes.clone()]);
        let affine = self
            .affine
            .map(|(s, t, activation)| (&s[lanes.clone()], &t[lanes.clone()], activation));
        if shift.is_some() || self.activation.is_some() || residual.is_some() || affine.is_some() {
            crate::gemm::activate_and_add_lanes(values, shift, self.activation, residual, affine);
        }
    }
}

/// The layouts of a convolution's input and output here: whether each is
/// channel-blocked ([`crate::layout`]), else NCHW.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct BlockedIo {
    pub input: bool,
    pub output: bool,
}

/// The convolution, with `weights` from [`pack_weights_in`] in the step order
/// [`StepOrder::of`] gives for its input's layout, in and out of the layouts
/// `blocks` says. A `prologue` is applied to the input as it is staged (the
/// padding stays zero, as the convolution of the changed input pads it).
pub(crate) fn conv2d(
    win: &Window2d,
    x: Src,
    weights: &[f32],
    (finish, prologue): (Finish, Option<Prologue>),
    out: Dst,
    blocks: BlockedIo,
    (gemm, pool): (&crate::gemm::GemmScratch, &ThreadPool),
) -> Result<()> {
    let [n, o] = [out.shape.dim(0), out.shape.dim(1)];
    let geo = Geometry::new(win, x.shape, [out.shape.dim(2), out.shape.dim(3)])
        .with_blocked_input(blocks.input);
    let pixels = geo.oh * geo.ow;
    if n == 0 || o == 0 || pixels == 0 {
        return Ok(());
    }
    if slices::applies(win, &geo, o, &blocks) {
        return slices::conv2d(
            win,
            (x, geo),
            weights,
            (finish, prologue),
            out,
            (gemm, pool),
        );
    }
    let threads = gemm.threads();
    let k = geo.cg * win.kernel[0] * win.kernel[1];
    let panels = o.div_ceil(NR);
    let group = panel_group();
    // With fewer images than threads, threads split the output channels instead of
    // the rows where the weights outweigh the image's staged input (a 14 x 14 layer
    // of 256 channels: cut by rows, each thread streamed all 2.4 MB of weights for 7
    // rows), or where there are too few rows to give each thread one (a 1-D
    // convolution's single row ran on one thread).
    let few_rows = n * geo.oh * Blocking::new(win, &geo, n, threads).row_blocks < threads;
    let by_channels = n < threads
        && (few_rows || o * k >= geo.staged_len(geo.rows_read(win, geo.oh)))
        && panels >= 2 * group * threads.div_ceil(n);
    let parts = if by_channels { threads.div_ceil(n) } else { 1 };
    let part_panels = panels.div_ceil(group).div_ceil(parts) * group;
    let blocking = Blocking::new(win, &geo, n * parts, threads);
    // SAFETY: an f32 tensor of `x.len` values.
    let xs = unsafe { std::slice::from_raw_parts(x.ptr.cast::<f32>(), x.len) };
    let out_addr = out.ptr as usize;
    let finish_at = FinishAt::of(&finish);
    let residual_addr = finish_at.residual;
    // Into a plain output, a bias and a ReLU are applied to each tile as it is
    // stored; into a blocked one, any finish whose activations have a vector form;
    // anything else in one pass over a panel's finished rows.
    let in_store = match blocks.output {
        false => finish.is_bias_and_relu(),
        true => finish.has_lanes_form(),
    };
    let per_channel = finish.per_channel();
    let out_blocks = crate::layout::Blocks::new(o, pixels);
    let task = |u: usize, thread: usize| {
        let (u, part) = (u / parts, u % parts);
        let part_range = part * part_panels..((part + 1) * part_panels).min(panels);
        if part_range.is_empty() {
            return;
        }
        let (image, block) = (u / blocking.blocks, u % blocking.blocks);
        let at = blocking.block(block, &geo);
        let (y0, rows) = (at.y0, at.rows);
        // What the block stages: its rows, and of them its columns' inputs.
        let staging = blocking.geometry(win, &geo, &at);
        let staged_rows = geo.rows_read(win, rows);
        // SAFETY: one task per thread index at a time.
        let extra = unsafe { gemm.parts(thread) }.1;
        let (staged, rest) = extra.split_at_mut(staging.staged_len(staged_rows));
        let (offsets, rest) = rest.split_at_mut(k);
        let block_pixels = rows * at.cols;
        let products = &mut rest[..products_len(k, block_pixels)];
        let src = &xs[image * geo.cg * geo.h * geo.w..][..geo.cg * geo.h * geo.w];
        stage_rows(
            win,
            &staging,
            (src, prologue, 0),
            (y0, at.x0),
            staged_rows,
            staged,
        );
        step_offsets(win, &staging, staged_rows, offsets);
        // The image's first output value, and the block's first pixel (a block of
        // columns lies in one row).
        let (image_at, first_pixel) = (image * o * pixels, y0 * geo.ow + at.x0);
        let block_out = BlockOut {
            // SAFETY: inside the output.
            image: unsafe { (out_addr as *mut f32).add(image_at) },
            first_pixel,
            pixels,
            channels: o,
            blocked: blocks.output,
            finish: (in_store && blocks.output).then(|| finish_at.in_registers(image_at)),
        };
        let bases = PixelBases {
            ow: at.cols,
            row_step: win.stride[0] * staging.wp * geo.lanes,
            sx: win.stride[1] * geo.lanes,
            last: block_pixels - 1,
        };
        let step_offsets: &[u32] = as_offsets(offsets);
        for q0 in part_range.clone().step_by(group) {
            let count = group.min(part_range.end - q0);
            let stored: [Option<StoreFinish>; MAX_GROUP] = std::array::from_fn(|v| {
                (in_store && !blocks.output).then(|| {
                    StoreFinish::for_panel(finish.bias, finish.activation.is_some(), q0 + v)
                })
            });
            run_group(
                (staged, step_offsets, weights, geo.lanes),
                bases,
                (q0, count, &stored[..count]),
                products,
                &block_out,
            );
            if in_store {
                continue;
            }
            // The finished rows (or block runs) of the group's channels: each a
            // channel's (or block's, of `lanes` a pixel) values of the block's pixels.
            let (c0, c1) = (q0 * NR, ((q0 + count) * NR).min(o));
            let step = if blocks.output { NR } else { 1 };
            for c in (c0..c1).step_by(step) {
                let lanes = if blocks.output {
                    out_blocks.width(c / NR)
                } else {
                    1
                };
                let (at, len) = (image_at + block_out.at(c, 0), block_pixels * lanes);
                // SAFETY: the block's pixels of channel (or block) `c`: inside the
                // output (and the residual, of the same shape and layout); only this
                // task writes them.
                let (values, residual) = unsafe {
                    (
                        std::slice::from_raw_parts_mut((out_addr as *mut f32).add(at), len),
                        residual_addr
                            .map(|a| std::slice::from_raw_parts((a as *const f32).add(at), len)),
                    )
                };
                match blocks.output {
                    true => per_channel.apply_lanes((c, lanes), values, residual),
                    false => per_channel.apply(c, values, residual),
                }
            }
        }
    };
    pool.run(n * blocking.blocks * parts, threads, &task)
}

/// A grouped convolution of blocked `x` into blocked `out` whose groups lie inside
/// its blocks ([`crate::layout::Blocks`]: of 16 channels, a last one of 8;
/// `weights` from [`pack_block_groups`]): each block of the output is a dense
/// convolution of the same block of the input by filters over the block's
/// channels, zero outside each channel's group, run as [`conv2d`] runs one
/// (staged rows of that block's plane, tiles of pixels by one panel). A group 8
/// channels wide multiplies twice the values it needs, at the dense kernel's
/// rate, and the layers around it stay blocked.
pub(crate) fn conv2d_block_groups(
    win: &Window2d,
    x: Src,
    weights: &[f32],
    finish: Finish,
    out: Dst,
    (gemm, pool): (&crate::gemm::GemmScratch, &ThreadPool),
) -> Result<()> {
    let [n, o] = [out.shape.dim(0), out.shape.dim(1)];
    let [c, h, w] = [x.shape.dim(1), x.shape.dim(2), x.shape.dim(3)];
    let out_hw = [out.shape.dim(2), out.shape.dim(3)];
    // The geometry of a block of 16 channels and of one of 8.
    let geometry = |lanes: usize| {
        let plane = Shape::new(&[n, lanes, h, w], rlx_ir::DType::F32);
        Geometry::new(win, &plane, out_hw).with_blocked_input(true)
    };
    let (whole, half) = (geometry(BLOCK), geometry(HALF));
    let pixels = whole.oh * whole.ow;
    if n == 0 || o == 0 || pixels == 0 {
        return Ok(());
    }
    if c != o || !crate::layout::blockable_channels(c) {
        return Err(rlx_ir::Error::runtime(
            "blocked grouped convolution",
            format!("{c} input and {o} output channels are not the same blocks"),
        ));
    }
    let threads = gemm.threads();
    let taps = win.kernel[0] * win.kernel[1];
    let x_blocks = crate::layout::Blocks::new(c, h * w);
    let planes = x_blocks.count();
    let blocking = Blocking::new(win, &whole, n * planes, threads);
    // SAFETY: an f32 tensor of `x.len` values.
    let xs = unsafe { std::slice::from_raw_parts(x.ptr.cast::<f32>(), x.len) };
    let out_addr = out.ptr as usize;
    let finish_at = FinishAt::of(&finish);
    let residual_addr = finish_at.residual;
    let in_store = finish.has_lanes_form();
    let per_channel = finish.per_channel();
    let task = |u: usize, thread: usize| {
        let (image, rest) = (
            u / (planes * blocking.blocks),
            u % (planes * blocking.blocks),
        );
        let (plane, block) = (rest / blocking.blocks, rest % blocking.blocks);
        let lanes = x_blocks.width(plane);
        let geo = if lanes == BLOCK { whole } else { half };
        let k = lanes * taps;
        let at = blocking.block(block, &geo);
        let (y0, rows) = (at.y0, at.rows);
        let staging = blocking.geometry(win, &geo, &at);
        let staged_rows = geo.rows_read(win, rows);
        // SAFETY: one task per thread index at a time.
        let extra = unsafe { gemm.parts(thread) }.1;
        let (staged, rest) = extra.split_at_mut(staging.staged_len(staged_rows));
        let (offsets, rest) = rest.split_at_mut(k);
        let block_pixels = rows * at.cols;
        let products = &mut rest[..products_len(k, block_pixels)];
        let src = &xs[image * c * h * w + x_blocks.start(plane)..][..lanes * h * w];
        stage_rows(
            win,
            &staging,
            (src, None, 0),
            (y0, at.x0),
            staged_rows,
            staged,
        );
        step_offsets(win, &staging, staged_rows, offsets);
        let image_at = image * o * pixels;
        let block_out = BlockOut {
            // SAFETY: inside the output.
            image: unsafe { (out_addr as *mut f32).add(image_at) },
            first_pixel: y0 * geo.ow + at.x0,
            pixels,
            channels: o,
            blocked: true,
            finish: in_store.then(|| finish_at.in_registers(image_at)),
        };
        let bases = PixelBases {
            ow: at.cols,
            row_step: win.stride[0] * staging.wp * geo.lanes,
            sx: win.stride[1] * geo.lanes,
            last: block_pixels - 1,
        };
        // The weights from which panel `plane` of `k` steps is this block's: a
        // half block reads the first half of its panel's steps (its 8 channels'),
        // every other panel before it holding `16 * taps`.
        let first = plane * (BLOCK * taps - k) * NR;
        run_group(
            (staged, as_offsets(offsets), &weights[first..], geo.lanes),
            bases,
            (plane, 1, &[None]),
            products,
            &block_out,
        );
        if !in_store {
            let (at, len) = (
                image_at + block_out.at(plane * BLOCK, 0),
                block_pixels * lanes,
            );
            // SAFETY: the block's pixels of this plane: inside the output (and the
            // residual, of the same shape and layout); only this task writes them.
            let (values, residual) = unsafe {
                (
                    std::slice::from_raw_parts_mut((out_addr as *mut f32).add(at), len),
                    residual_addr
                        .map(|a| std::slice::from_raw_parts((a as *const f32).add(at), len)),
                )
            };
            per_channel.apply_lanes((plane * BLOCK, lanes), values, residual);
        }
    };
    pool.run(n * planes * blocking.blocks, threads, &task)
}

/// Per-thread floats [`conv2d_block_groups`] needs: as [`thread_floats`] for a
/// dense convolution of one block of 16 channels.
pub(crate) fn block_groups_thread_floats(win: &Window2d, x: &Shape, out_hw: [usize; 2]) -> usize {
    let plane = Shape::new(&[x.dim(0), BLOCK, x.dim(2), x.dim(3)], rlx_ir::DType::F32);
    let taps = Shape::new(
        &[BLOCK, BLOCK, win.kernel[0], win.kernel[1]],
        rlx_ir::DType::F32,
    );
    thread_floats(win, &plane, &taps, out_hw)
}

/// A [`Finish`]'s operands as addresses, which pool tasks can share.
#[derive(Clone, Copy)]
struct FinishAt {
    bias: Option<usize>,
    activation: Option<Activation>,
    residual: Option<usize>,
    affine: Option<(usize, usize, Option<Activation>)>,
}

impl FinishAt {
    fn of(finish: &Finish) -> FinishAt {
        FinishAt {
            bias: finish.bias.map(|b| b.as_ptr() as usize),
            activation: finish.activation,
            residual: finish.residual.map(|r| r.ptr as usize),
            affine: finish
                .affine
                .map(|(s, t, post)| (s.as_ptr() as usize, t.as_ptr() as usize, post)),
        }
    }

    /// The whole finish in registers, the residual at the place of the image
    /// whose first output value is `image_at` floats in.
    fn in_registers(&self, image_at: usize) -> RegisterFinish {
        RegisterFinish {
            bias: self.bias.map(|a| a as *const f32),
            activation: self.activation,
            residual: self
                .residual
                .map(|a| (a as *const f32).wrapping_add(image_at)),
            affine: self
                .affine
                .map(|(s, t, post)| (s as *const f32, t as *const f32, post)),
        }
    }
}

/// Reads `f32` scratch as the `u32` offsets stored in it.
fn as_offsets(values: &mut [f32]) -> &[u32] {
    // SAFETY: f32 and u32 have the same size and alignment, and the slice is only
    // written through `step_offsets` as `u32` bit patterns.
    unsafe { std::slice::from_raw_parts(values.as_ptr().cast::<u32>(), values.len()) }
}

/// What a tile goes through as it is stored: a panel's 16 biases (zero past the
/// last channel), then a ReLU if `relu`.
#[derive(Clone, Copy)]
pub(crate) struct StoreFinish {
    bias: [f32; NR],
    relu: bool,
}

impl StoreFinish {
    /// Panel `q`'s part of a finish that is at most a bias and a ReLU
    /// ([`Finish::is_bias_and_relu`]): its `bias`, and a ReLU if `relu`.
    pub(crate) fn for_panel(bias: Option<&[f32]>, relu: bool, q: usize) -> StoreFinish {
        StoreFinish {
            bias: std::array::from_fn(|j| {
                bias.and_then(|b| b.get(q * NR + j)).copied().unwrap_or(0.0)
            }),
            relu,
        }
    }
}

/// Where a block's output goes: pixels from `first_pixel` of the image whose first
/// value is at `image`, of `channels` channels of `pixels` pixels each, plain or
/// channel-blocked (`blocked`).
struct BlockOut {
    image: *mut f32,
    first_pixel: usize,
    pixels: usize,
    channels: usize,
    blocked: bool,
    /// A blocked output's finish, applied as each tile is stored (pointers at
    /// channel 0, the residual at `image`).
    finish: Option<RegisterFinish>,
}

impl BlockOut {
    /// The output's blocks (when it is blocked).
    fn blocks(&self) -> crate::layout::Blocks {
        crate::layout::Blocks::new(self.channels, self.pixels)
    }

    /// Floats from `image` to pixel `pixel` (of the block's) of channel `c` (plain)
    /// or of the block that starts at channel `c` (blocked).
    fn at(&self, c: usize, pixel: usize) -> usize {
        let pixel = self.first_pixel + pixel;
        if self.blocked {
            self.blocks().index(c, pixel)
        } else {
            c * self.pixels + pixel
        }
    }
}

/// Where each output pixel of a block reads its first input value in the staged rows.
#[derive(Clone, Copy)]
struct PixelBases {
    ow: usize,
    /// Staged floats from one output row's first input row to the next's.
    row_step: usize,
    sx: usize,
    /// The block's last pixel (a short last tile repeats it).
    last: usize,
}

impl PixelBases {
    /// The staged offset of pixel `j`'s first input value.
    fn of(&self, j: usize) -> usize {
        (j / self.ow) * self.row_step + (j % self.ow) * self.sx
    }

    /// The block's first `whole` tiles as runs that one micro-kernel call takes:
    /// `(first pixel, the run, the first tile's pixel bases)`, a run's tiles lying
    /// in one row (their pixels `sx` staged floats apart), a tile across rows a
    /// run alone (each pixel's base its own).
    fn row_runs(self, whole: usize) -> impl Iterator<Item = (usize, TileRun, [usize; MR])> {
        let mut done = 0;
        std::iter::from_fn(move || {
            if done >= whole {
                return None;
            }
            let first = done * MR;
            let column = first % self.ow;
            let tiles = ((self.ow - column) / MR).clamp(1, whole - done);
            done += tiles;
            let run = TileRun {
                tiles,
                pixel_step: MR * self.sx,
                tail_step: 0,
                out_step: MR * NR,
            };
            Some((first, run, std::array::from_fn(|i| self.of(first + i))))
        })
    }

    /// Each tile's pixel bases in turn, from the block's first pixel: a short last
    /// tile repeats the last pixel. The row and column advance without a division
    /// per pixel (with 27 steps a tile, as in a 3-channel stem, six divisions cost
    /// about as much as the products).
    fn tiles(self) -> impl Iterator<Item = [usize; MR]> {
        let last_base = self.of(self.last);
        let (mut y, mut x, mut next) = (0, 0, 0);
        std::iter::from_fn(move || {
            if next > self.last {
                return None;
            }
            let mut bases = [last_base; MR];
            for (i, base) in bases.iter_mut().enumerate() {
                if next + i > self.last {
                    break;
                }
                *base = y * self.row_step + x * self.sx;
                x += 1;
                if x == self.ow {
                    (x, y) = (0, y + 1);
                }
            }
            next += MR;
            Some(bases)
        })
    }
}

/// Copies the input rows `staged_rows` rows from output row `y0`'s first into
/// `staged` (`[channel][row][wp]`, or `[plane][row][wp][lanes]` for a blocked
/// input: [`Geometry::lanes`]), the `wp` columns from the first that output
/// column `x0` reads, zero where they fall in the padding, through `prologue` if
/// any (`src`'s first channel being the prologue's `first_channel`).
fn stage_rows(
    win: &Window2d,
    geo: &Geometry,
    (src, prologue, first_channel): (&[f32], Option<Prologue>, usize),
    (y0, x0): (usize, usize),
    staged_rows: usize,
    staged: &mut [f32],
) {
    let pt = win.padding[0] as isize;
    let (h, w, wp, lanes) = (geo.h, geo.w, geo.wp, geo.lanes);
    let x_blocks = crate::layout::Blocks::new(geo.cg, h * w);
    // Staged column `c` holds input column `c + left` (`left` negative in the left
    // padding): inside for `c0..c1`.
    let left = (x0 * win.stride[1]) as isize - win.padding[1] as isize;
    let inside_from = |column: isize| (column - left).clamp(0, wp as isize) as usize;
    let (c0, c1) = (inside_from(0), inside_from(w as isize));
    // The input column staged at `c0` (none when the block reads only padding).
    let first_column = match c1 > c0 {
        true => (c0 as isize + left) as usize,
        false => 0,
    };
    let top = (y0 * win.stride[0]) as isize - pt;
    for (plane_index, plane) in staged
        .chunks_exact_mut(staged_rows * wp * lanes)
        .enumerate()
    {
        let channels = plane_index * lanes..(plane_index + 1) * lanes;
        // Where the plane's channels start in the input, and the floats from one
        // pixel to the next there (a block of 16 stages as two planes of 8 when
        // the last block is 8).
        let (from, step) = if lanes == 1 {
            (channels.start * h * w, 1)
        } else {
            let k = channels.start / BLOCK;
            (x_blocks.index(channels.start, 0), x_blocks.width(k))
        };
        for (r, line) in plane.chunks_exact_mut(wp * lanes).enumerate() {
            let iy = top + r as isize;
            if !(0..h as isize).contains(&iy) {
                line.fill(0.0);
                continue;
            }
            let row = &src[from + (iy as usize * w + first_column) * step..];
            line[..c0 * lanes].fill(0.0);
            let inside = &mut line[c0 * lanes..c1 * lanes];
            if step == lanes {
                inside.copy_from_slice(&row[..(c1 - c0) * lanes]);
            } else {
                for (to, pixel) in inside.chunks_exact_mut(lanes).zip(row.chunks(step)) {
                    to.copy_from_slice(&pixel[..lanes]);
                }
            }
            if let Some(prologue) = prologue {
                let at = first_channel;
                prologue.apply(inside, at + channels.start..at + channels.end);
            }
            line[c1 * lanes..].fill(0.0);
        }
    }
}

/// Writes each step's offset from a pixel's first input value in the staged rows:
/// the step that multiplies channel `ci`'s tap `(ky, kx)` (in the step order of
/// the staged layout: natural for a plain input, in runs of a block's channels
/// for a blocked one, [`StepOrder`]) reads channel `ci`, `ky` rows and `kx`
/// columns on (times the dilation), in the staged rows' layout.
fn step_offsets(win: &Window2d, geo: &Geometry, staged_rows: usize, offsets: &mut [f32]) {
    let ([kh, kw], [dy, dx]) = (win.kernel, win.dilation);
    let (plane, b) = (staged_rows * geo.wp * geo.lanes, geo.lanes);
    let order = StepOrder {
        taps: kh * kw,
        runs: b,
    };
    for ci in 0..geo.cg {
        for ky in 0..kh {
            for kx in 0..kw {
                let offset = ci / b * plane + (ky * dy * geo.wp + kx * dx) * b + ci % b;
                // `applies` checked that every staged offset fits.
                offsets[order.step(ci, ky * kw + kx)] = f32::from_bits(offset as u32);
            }
        }
    }
}

/// Panels per micro-kernel call on this CPU: [`MAX_GROUP`] with AVX-512, else one.
pub(crate) fn panel_group() -> usize {
    if crate::isa::isa().avx512f {
        MAX_GROUP
    } else {
        1
    }
}

/// Runs every tile of a block against panels `q0 .. q0 + count` of the packed weights
/// (each `k x NR`), depth block by depth block, and stores the finished tiles into
/// the output's channels `q0 * NR ..`, panel `v` through `finish[v]`. The offsets
/// come in runs of `runs` consecutive values ([`TileInput::runs`]).
fn run_group(
    (staged, offsets, weights, runs): (&[f32], &[u32], &[f32], usize),
    bases: PixelBases,
    (q0, count, finish): (usize, usize, &[Option<StoreFinish>]),
    products: &mut [f32],
    out: &BlockOut,
) {
    let k = offsets.len();
    // Depth blocks of whole runs (the steps are whole runs: `runs` divides `k`).
    let kc = (k / runs).div_ceil(k.div_ceil(KC).max(1)).max(1) * runs;
    let depth_blocks = k.div_ceil(kc);
    let group = count * TILE;
    let panel_floats = k * NR;
    let panels = &weights[q0 * panel_floats..(q0 + count) * panel_floats];
    // Into a blocked output in one depth block, the whole tiles go straight to
    // their places, a run of a row's tiles at a time.
    let mut done_tiles = 0;
    if let (true, 1) = (out.blocked, depth_blocks) {
        done_tiles = (bases.last + 1) / MR;
        for (first, run, pixels) in bases.row_runs(done_tiles) {
            // SAFETY: as below; the tiles' MR pixels of the panels' blocks lie
            // inside the block's output, which only this task writes; a run of
            // more than one tile lies in one row, its pixels `sx` staged floats
            // apart (a tile across rows is a run of one, each pixel's base its own).
            unsafe {
                whole_tiles_blocked(
                    TileInput::new(
                        offsets,
                        pixels.map(|p| staged.as_ptr().add(p)),
                        prefetches_weights(k),
                        runs,
                    ),
                    (panels.as_ptr(), panel_floats, count),
                    out,
                    (q0, first),
                    run,
                    false,
                )
            };
        }
    }
    for d in 0..depth_blocks {
        let (p0, p1) = (d * kc, ((d + 1) * kc).min(k));
        for (t, pixels) in bases.tiles().enumerate().skip(done_tiles) {
            let valid = MR.min(bases.last + 1 - t * MR);
            let at = if depth_blocks == 1 { 0 } else { t * group };
            let tile = &mut products[at..at + group];
            // A tile's pixels reach a new line of the output rows about every third
            // tile (16 floats a line, 6 pixels a tile).
            let ahead = t * MR + STORE_AHEAD;
            let plain_out = !out.blocked;
            if plain_out && d + 1 == depth_blocks && (t == 0 || ahead / 16 != (ahead - MR) / 16) {
                prefetch_output(
                    out,
                    q0 * NR..(q0 * NR + count * NR).min(out.channels),
                    ahead,
                );
            }
            // SAFETY: every base plus every offset lies inside the staged rows (the
            // offsets reach the last tap of the last channel; the bases, the last
            // output row and column of the block); each of the `count` panels holds
            // `k` steps of NR; the tile holds `count` tiles.
            unsafe {
                micro_kernel(
                    TileInput::new(
                        &offsets[p0..p1],
                        pixels.map(|b| staged.as_ptr().add(b)),
                        prefetches_weights(k),
                        runs,
                    ),
                    (panels[p0 * NR..].as_ptr(), panel_floats, count),
                    (tile, valid),
                    d > 0,
                )
            };
            if d + 1 == depth_blocks {
                for (v, (product, finish)) in tile.chunks_exact(TILE).zip(finish).enumerate() {
                    let q = q0 + v;
                    let channels = NR.min(out.channels - q * NR);
                    // SAFETY: pixels t * MR.. (valid of them) of channels q * NR..
                    // (channels of them, whole blocks of a blocked output) lie
                    // inside the block's output.
                    unsafe {
                        let at = out.at(q * NR, t * MR);
                        match out.blocked {
                            false => store_transposed(
                                product,
                                out.image.add(at),
                                out.pixels,
                                (valid, channels),
                                *finish,
                            ),
                            true => store_blocked(
                                product,
                                (out.image, at),
                                (valid, q * NR, channels),
                                out.finish.as_ref(),
                            ),
                        }
                    };
                }
            }
        }
    }
}

/// Whole tiles of panels `q0..q0 + count` into a blocked output, the first from
/// the block's pixel `first`: straight to their places through
/// [`micro_kernel_to`], with the output's finish in registers where it has one (a
/// copy through a tile and a store per vector cost a 3-channel stem about a fifth
/// of its time); with `accumulate`, added to the sums stored there
/// ([`micro_kernel_add_to`]).
///
/// # Safety
/// As [`micro_kernel_to`] for `run`'s tiles of `MR` pixels of those panels' blocks
/// of `out`; AVX2 and FMA are available (a blocked output needs them); with
/// `accumulate`, as [`micro_kernel_add_to`].
#[cfg(target_arch = "x86_64")]
unsafe fn whole_tiles_blocked(
    input: TileInput,
    weights: (*const f32, usize, usize),
    out: &BlockOut,
    (q0, first): (usize, usize),
    run: TileRun,
    accumulate: bool,
) {
    let count = weights.2;
    let at = out.at(q0 * NR, first);
    let last = q0 + count - 1;
    let tile = TileOut {
        at: out.image.wrapping_add(at),
        panel: NR * out.pixels,
        pixel: NR,
        half: (out.blocks().width(last) < NR)
            .then(|| out.image.wrapping_add(out.at(last * NR, first))),
    };
    let c0 = q0 * NR;
    let finish = out.finish.map(|f| RegisterFinish {
        bias: f.bias.map(|p| p.wrapping_add(c0)),
        activation: f.activation,
        residual: f.residual.map(|p| p.wrapping_add(at)),
        affine: f
            .affine
            .map(|(s, t, post)| (s.wrapping_add(c0), t.wrapping_add(c0), post)),
    });
    // SAFETY: the caller's contract.
    unsafe {
        match accumulate {
            false => micro_kernel_to(input, weights, (tile, run), finish.as_ref()),
            true => micro_kernel_add_to(input, weights, (tile, run), (finish.as_ref(), true)),
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn whole_tiles_blocked(
    _: TileInput,
    _: (*const f32, usize, usize),
    _: &BlockOut,
    _: (usize, usize),
    _: TileRun,
    _: bool,
) {
    unreachable!("blocked layouts need x86-64")
}

/// Output floats ahead of a tile's first pixel that [`prefetch_output`] asks for.
const STORE_AHEAD: usize = 32;

/// Asks for the cache line of `pixel` in rows `channels` of the block's output, which
/// a later tile stores into: every channel row is a stream of its own, more streams
/// than the hardware prefetcher follows (the 7x7 stem at batch 32 went from 5.45 to
/// 4.76 ms with this).
fn prefetch_output(out: &BlockOut, channels: std::ops::Range<usize>, pixel: usize) {
    for c in channels {
        crate::prefetch::lines(out.image.wrapping_add(out.at(c, pixel)).cast(), 1);
    }
}

/// What a micro-kernel tile reads: step `p`'s value of pixel `i` at `pixel[i] +
/// offsets[p]`, then those of the `tail` steps at `tail_pixel[i] + tail[p]` (a
/// channel-blocked input's last block of 8 channels, whose pixels lie 8 floats
/// apart where the whole blocks' lie 16; no steps for any other input).
#[derive(Clone, Copy)]
pub(crate) struct TileInput<'a> {
    pub offsets: &'a [u32],
    pub pixel: [*const f32; MR],
    pub tail: &'a [u32],
    pub tail_pixel: [*const f32; MR],
    /// Whether the products ask for the weights [`WEIGHTS_AHEAD`] steps ahead
    /// ([`prefetches_weights`]).
    pub prefetch: bool,
    /// Whether the steps read whole blocks of [`BLOCK`] channels in order, each
    /// pixel's block on one line (a channel-blocked input): each block's steps then
    /// ask for every pixel's next block ahead, a line the hardware does not foresee
    /// (a 576 -> 96 channel product at 14 x 14 waited on them for a tenth of its
    /// time).
    pub blocks_ahead: bool,
    /// The steps' offsets come in runs of this many (16 or 8) consecutive values
    /// (a channel block's values of a pixel, or of a tap of it), which the AVX2
    /// kernel unrolls; 1 where they need not (the tail's are always one run of
    /// [`HALF`]).
    pub runs: usize,
}

impl<'a> TileInput<'a> {
    /// Steps at `offsets` from `pixel`, in runs of `runs` ([`TileInput::runs`]),
    /// without a tail.
    pub(crate) fn new(
        offsets: &'a [u32],
        pixel: [*const f32; MR],
        prefetch: bool,
        runs: usize,
    ) -> TileInput<'a> {
        TileInput {
            offsets,
            pixel,
            tail: &[],
            tail_pixel: pixel,
            prefetch,
            blocks_ahead: false,
            runs,
        }
    }

    /// The input of tile `t` of `run`.
    #[inline]
    fn nth(self, t: usize, run: TileRun) -> TileInput<'a> {
        TileInput {
            pixel: self.pixel.map(|p| p.wrapping_add(t * run.pixel_step)),
            tail_pixel: self.tail_pixel.map(|p| p.wrapping_add(t * run.tail_step)),
            ..self
        }
    }
}

/// One tile of `count` panels: `tile[v][i][j] (+)= Σ_p x_i[p] * panel_v[p][j]`
/// over the steps `input` reads, panel `v` starting `v * stride` floats after
/// `panels`, for the tile's first `rows` pixels (the others' values are left
/// unspecified).
///
/// # Safety
/// Every value `input` names is readable; each panel holds as many steps of
/// [`NR`] floats; `tile` holds `count` tiles; `count` is at most [`panel_group`];
/// `rows` is 1 to [`MR`]; AVX2 and FMA are available (checked by [`applies`]).
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn micro_kernel(
    input: TileInput,
    (panels, stride, count): (*const f32, usize, usize),
    (tile, rows): (&mut [f32], usize),
    accumulate: bool,
) {
    let out = TileOut {
        at: tile.as_mut_ptr(),
        panel: TILE,
        pixel: NR,
        half: None,
    };
    // SAFETY: forwarded contract; `count > 1` only where `panel_group` found AVX-512,
    // and one panel goes to the AVX-512 kernel only where the CPU has it.
    unsafe {
        match count {
            1 if !crate::isa::isa().avx512f => avx2::tile_sums(input, panels, (tile, accumulate)),
            _ if rows < MR => short_tile_of(
                (count, rows),
                input,
                (panels, stride),
                tile.as_mut_ptr(),
                accumulate,
            ),
            _ => micro_kernel_avx512_of(
                count,
                input,
                (panels, stride),
                (out, TileRun::ONE),
                (accumulate, SimpleFinish::NONE),
            ),
        }
    }
}

/// Where a micro-kernel tile's sums go: panel `v`'s pixel `i` is the [`NR`] floats
/// at `at + v * panel + i * pixel`, but for a last panel of half a vector.
#[derive(Clone, Copy)]
pub(crate) struct TileOut {
    pub at: *mut f32,
    pub panel: usize,
    pub pixel: usize,
    /// Where the last panel's pixel 0 goes when that panel has only its first
    /// [`HALF`] lanes (an output's last block of 8 channels, stored [`HALF`]
    /// floats a pixel); `None` when every panel is whole.
    pub half: Option<*mut f32>,
}

/// Whole tiles one micro-kernel call runs in turn, each [`MR`] output pixels on
/// from the previous one: each tile's pixels start `pixel_step` floats on from the
/// previous tile's (every base; `tail_step` for the tail's), and its place in the
/// output (and its residual) `out_step` floats on (a half panel's, `MR * HALF`). A call per tile cost a
/// 16 -> 16 channel layer (16 steps a tile) three times its products.
#[derive(Clone, Copy)]
pub(crate) struct TileRun {
    pub tiles: usize,
    pub pixel_step: usize,
    pub tail_step: usize,
    pub out_step: usize,
}

impl TileRun {
    /// One tile.
    pub(crate) const ONE: TileRun = TileRun {
        tiles: 1,
        pixel_step: 0,
        tail_step: 0,
        out_step: 0,
    };
}

impl TileOut {
    /// The lanes panel `v` of `count` has.
    #[inline]
    fn lanes_of(&self, v: usize, count: usize) -> u16 {
        if self.half.is_some() && v + 1 == count {
            crate::layout::lane_mask(HALF)
        } else {
            0xffff
        }
    }

    /// Where pixel `i` of panel `v` of `count` goes.
    #[inline]
    fn place(&self, v: usize, i: usize, count: usize) -> *mut f32 {
        match self.half {
            Some(half) if v + 1 == count => half.wrapping_add(i * HALF),
            _ => self.at.wrapping_add(v * self.panel + i * self.pixel),
        }
    }

    /// The place of tile `t` of a run of `out_step` (tiles [`MR`] pixels apart).
    #[inline]
    fn nth(self, t: usize, out_step: usize) -> TileOut {
        TileOut {
            at: self.at.wrapping_add(t * out_step),
            half: self.half.map(|h| h.wrapping_add(t * MR * HALF)),
            ..self
        }
    }
}

/// A [`Finish`] applied a vector at a time to a tile stored into a blocked output
/// (by [`micro_kernel_to`] and the pixel kernel's blocked stores), in its order: the
/// bias, the activation, the residual, then the channel affine and its activation
/// (activations with a vector form only: [`Finish::has_lanes_form`]). The bias,
/// scale and shift pointers are at some channel, and [`RegisterFinish::apply`] is
/// told each vector's channel from there; the residual pointer is at the output
/// value its offsets count from.
#[derive(Clone, Copy)]
pub(crate) struct RegisterFinish {
    pub bias: Option<*const f32>,
    pub activation: Option<Activation>,
    pub residual: Option<*const f32>,
    pub affine: Option<(*const f32, *const f32, Option<Activation>)>,
}

impl RegisterFinish {
    /// The sums of the lanes `mask` names of one pixel, whose first lane is
    /// channel `channel` (of the pointers' channels) and which lie `at` floats on
    /// from the residual's pointer (before it when negative); lanes outside the
    /// mask are never read.
    ///
    /// # Safety
    /// AVX-512F is available; every pointer holds those lanes' values there.
    #[cfg(target_arch = "x86_64")]
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn apply(
        &self,
        x: std::arch::x86_64::__m512,
        channel: usize,
        at: isize,
        mask: std::arch::x86_64::__mmask16,
    ) -> std::arch::x86_64::__m512 {
        use crate::gemm::activate_lanes_avx512 as activate;
        use std::arch::x86_64::*;
        // SAFETY: the caller's contract.
        unsafe {
            let load = |p: *const f32| _mm512_maskz_loadu_ps(mask, p);
            let mut x = x;
            if let Some(bias) = self.bias {
                x = _mm512_add_ps(x, load(bias.add(channel)));
            }
            if let Some(a) = self.activation {
                x = activate(x, a);
            }
            if let Some(residual) = self.residual {
                x = _mm512_add_ps(x, load(residual.wrapping_offset(at)));
            }
            if let Some((scale, shift, post)) = self.affine {
                let (s, t) = (load(scale.add(channel)), load(shift.add(channel)));
                x = _mm512_fmadd_ps(x, s, t);
                if let Some(a) = post {
                    x = activate(x, a);
                }
            }
            x
        }
    }
}

/// [`micro_kernel`] on AVX-512 for `count` panels (1 to [`MAX_GROUP`]) and each tile
/// of `run`, storing each panel's [`MR`] pixels through `out` (a channel-blocked
/// output's own place) instead of a tile, then applying `finish` to them if any.
///
/// # Safety
/// As [`micro_kernel`] for every tile `t < run.tiles`, whose bases are `input`'s
/// plus `t * run.pixel_step` (`t * run.tail_step` for the tail's); AVX-512F is
/// available; every place `out` names for tile `t` ([`TileRun`]: `t * run.out_step`
/// floats on, a half panel's `t * MR * HALF`) is writable; `finish`'s pointers as
/// [`RegisterFinish`] says (the residual's also `t * run.out_step` on for tile `t`).
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn micro_kernel_to(
    input: TileInput,
    (panels, stride, count): (*const f32, usize, usize),
    (out, run): (TileOut, TileRun),
    finish: Option<&RegisterFinish>,
) {
    if !crate::isa::isa().avx512f {
        // SAFETY: forwarded contract; AVX2 and FMA (the pixel kernel's least).
        unsafe {
            avx2::micro_kernel_to(input, (panels, stride, count), (out, run), (finish, false))
        };
        return;
    }
    let sums = (panels, stride);
    // A bias, an activation with a vector form and a residual are applied to the
    // sums in registers as they are stored; a channel affine once the tile is
    // stored, while it is in L1 (in the micro-kernel's registers, the general
    // finish's code cost the products their registers).
    let (simple, rest) = match finish {
        Some(f) if f.affine.is_none() => (
            SimpleFinish {
                bias: f.bias,
                activation: f.activation,
                residual: f.residual,
            },
            None,
        ),
        _ => (SimpleFinish::NONE, finish),
    };
    // SAFETY: forwarded contract.
    unsafe {
        let Some(finish) = rest else {
            micro_kernel_avx512_of(count, input, sums, (out, run), (false, simple));
            return;
        };
        // Tile by tile, so each is finished while it is in L1.
        for t in 0..run.tiles {
            let out = out.nth(t, run.out_step);
            micro_kernel_avx512_of(
                count,
                input.nth(t, run),
                sums,
                (out, TileRun::ONE),
                (false, simple),
            );
            let finish = RegisterFinish {
                residual: finish.residual.map(|r| r.wrapping_add(t * run.out_step)),
                ..*finish
            };
            finish_tile(out, count, &finish);
        }
    }
}

/// [`micro_kernel_to`] on a CPU without AVX-512, adding each tile's sums to the
/// values stored at its places when `accumulate` (a product split over its steps:
/// [`super::blocked_conv_f32`]'s pointwise kernel by filters, and the convolution
/// in channel slices, `slices`).
///
/// # Safety
/// As [`micro_kernel_to`], with AVX2 and FMA and without AVX-512; with
/// `accumulate`, every place holds the sums of the earlier steps.
#[cfg(target_arch = "x86_64")]
pub(crate) unsafe fn micro_kernel_add_to(
    input: TileInput,
    weights: (*const f32, usize, usize),
    (out, run): (TileOut, TileRun),
    (finish, accumulate): (Option<&RegisterFinish>, bool),
) {
    debug_assert!(!crate::isa::isa().avx512f);
    // SAFETY: forwarded contract.
    unsafe { avx2::micro_kernel_to(input, weights, (out, run), (finish, accumulate)) };
}

/// The finish the micro-kernel applies to its sums before storing them: a bias
/// (one vector per panel, from `bias` on), an activation with a vector form
/// ([`crate::gemm::has_lanes_form`]) and a residual.
#[derive(Clone, Copy)]
struct SimpleFinish {
    bias: Option<*const f32>,
    activation: Option<Activation>,
    /// Added after the activation: the residual at the tile's first value, laid
    /// out as the output is (the same strides).
    residual: Option<*const f32>,
}

impl SimpleFinish {
    /// No finish.
    const NONE: SimpleFinish = SimpleFinish {
        bias: None,
        activation: None,
        residual: None,
    };
}

/// Applies `finish` (one with a channel affine: anything else is applied in the
/// micro-kernel) to the `MR`
/// pixels of `count` panels that `out` names.
///
/// # Safety
/// AVX-512F is available; `out` names `count` panels of `MR` pixels of the lanes
/// each panel has, `finish`'s pointers as [`RegisterFinish`] says.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn finish_tile(out: TileOut, count: usize, finish: &RegisterFinish) {
    // SAFETY: the caller's contract.
    unsafe {
        if out.half.is_none() {
            finish_tile_as::<false>(out, count, finish);
        } else {
            finish_tile_as::<true>(out, count, finish);
        }
    }
}

/// [`finish_tile`] with whole panels (`HALF_LAST` false: the common case, without
/// tests per vector) or a last half one.
///
/// # Safety
/// As [`finish_tile`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn finish_tile_as<const HALF_LAST: bool>(
    out: TileOut,
    count: usize,
    finish: &RegisterFinish,
) {
    use std::arch::x86_64::*;
    for v in 0..count {
        let lanes = if HALF_LAST {
            out.lanes_of(v, count)
        } else {
            0xffff
        };
        // SAFETY: the caller's contract: each pointer holds the panel's values.
        unsafe {
            for i in 0..MR {
                let at = if HALF_LAST {
                    out.place(v, i, count)
                } else {
                    out.at.add(v * out.panel + i * out.pixel)
                };
                let at_offset = (at as isize - out.at as isize) / 4;
                let x = finish.apply(_mm512_maskz_loadu_ps(lanes, at), v * NR, at_offset, lanes);
                _mm512_mask_storeu_ps(at, lanes, x);
            }
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) unsafe fn micro_kernel_to(
    _: TileInput,
    _: (*const f32, usize, usize),
    _: (TileOut, TileRun),
    _: Option<&RegisterFinish>,
) {
    unreachable!("blocked layouts need x86-64")
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) unsafe fn micro_kernel(
    _: TileInput,
    _: (*const f32, usize, usize),
    _: (&mut [f32], usize),
    _: bool,
) {
    unreachable!("`applies` is false off x86-64")
}

/// Steps ahead whose weights the micro-kernels ask for.
const WEIGHTS_AHEAD: usize = 24;

/// Whether a product of `k` steps asks for its weights ahead: only long ones. With
/// fewer steps the panels stay in L1 from tile to tile and the requests only take
/// load slots (a 24 -> 72 -> 24 chain's 1x1 layers 1.01 -> 0.84 ms without them,
/// 256-channel ones at 28 x 28 2.93 -> 2.55; 672-channel ones at 14 x 14 1.45 ->
/// 1.55 and 3x3 ones over 64 channels, 576 steps, 2% slower).
pub(crate) fn prefetches_weights(k: usize) -> bool {
    k >= 512
}

/// [`micro_kernel_avx512`] for `count` panels (1 to [`MAX_GROUP`]).
///
/// # Safety
/// As [`micro_kernel_avx512`] with `NP = count`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn micro_kernel_avx512_of(
    count: usize,
    input: TileInput,
    sums: (*const f32, usize),
    out: (TileOut, TileRun),
    steps: (bool, SimpleFinish),
) {
    // SAFETY: forwarded contract.
    unsafe {
        if steps.1.residual.is_some() {
            micro_kernel_avx512_as::<true>(count, input, sums, out, steps)
        } else {
            micro_kernel_avx512_as::<false>(count, input, sums, out, steps)
        }
    }
}

/// [`micro_kernel_avx512_of`] with or without a residual.
///
/// # Safety
/// As [`micro_kernel_avx512`] with `NP = count`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn micro_kernel_avx512_as<const RESIDUAL: bool>(
    count: usize,
    at: TileInput,
    sums: (*const f32, usize),
    out: (TileOut, TileRun),
    steps: (bool, SimpleFinish),
) {
    // SAFETY: forwarded contract.
    unsafe {
        match (count, out.0.half.is_some()) {
            (1, false) => micro_kernel_avx512::<1, RESIDUAL, false>(at, sums, out, steps),
            (2, false) => micro_kernel_avx512::<2, RESIDUAL, false>(at, sums, out, steps),
            (3, false) => micro_kernel_avx512::<3, RESIDUAL, false>(at, sums, out, steps),
            (_, false) => micro_kernel_avx512::<4, RESIDUAL, false>(at, sums, out, steps),
            (1, true) => micro_kernel_avx512::<1, RESIDUAL, true>(at, sums, out, steps),
            (2, true) => micro_kernel_avx512::<2, RESIDUAL, true>(at, sums, out, steps),
            (3, true) => micro_kernel_avx512::<3, RESIDUAL, true>(at, sums, out, steps),
            (_, true) => micro_kernel_avx512::<4, RESIDUAL, true>(at, sums, out, steps),
        }
    }
}

/// [`micro_kernel`] for `NP` panels at once and each tile of `run`, each panel in
/// one zmm per pixel, with `finish` applied to the sums before they are stored
/// (its residual only with `RESIDUAL`); with `HALF_LAST`, the last panel is half
/// of one, stored (and its residual and bias read) 8 lanes at a time at its own
/// place ([`TileOut::half`]).
///
/// # Safety
/// As [`micro_kernel`] with `count = NP` for every tile `t < run.tiles` (bases
/// `t * run.pixel_step` on, place and residual `t * run.out_step` on, a half
/// panel's place `t * MR * HALF`); AVX-512F is
/// available; a bias holds `NP` panels' [`NR`] values (8 for a half panel);
/// `HALF_LAST` exactly where `out.half` is set.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn micro_kernel_avx512<const NP: usize, const RESIDUAL: bool, const HALF_LAST: bool>(
    input: TileInput,
    sums: (*const f32, usize),
    (out, run): (TileOut, TileRun),
    (accumulate, finish): (bool, SimpleFinish),
) {
    if NP == MAX_GROUP && !HALF_LAST && !accumulate && blocked_run(&input, run) {
        // SAFETY: the caller's contract, for whole tiles of whole panels over
        // bases a block apart.
        unsafe { whole_blocked_run::<RESIDUAL>(input, sums, (out, run), finish) };
        return;
    }
    for t in 0..run.tiles {
        let input = input.nth(t, run);
        let out = out.nth(t, run.out_step);
        let finish = SimpleFinish {
            residual: finish.residual.map(|r| r.wrapping_add(t * run.out_step)),
            ..finish
        };
        let tile = (input, sums, out, (accumulate, finish));
        // SAFETY: the caller's contract, for tile `t`.
        unsafe {
            if NP >= 3 {
                tile_apart::<NP, RESIDUAL, HALF_LAST>(tile)
            } else {
                one_tile::<NP, RESIDUAL, HALF_LAST>(tile)
            }
        }
    }
}

/// Whether [`whole_blocked_run`] runs `input`'s tiles: each tile's pixels one
/// [`BLOCK`] apart (a blocked input, read in place or staged), every step a whole
/// block's (no tail), and tiles a tile of such pixels apart.
#[cfg(target_arch = "x86_64")]
fn blocked_run(input: &TileInput, run: TileRun) -> bool {
    input.tail.is_empty()
        && run.pixel_step == MR * BLOCK
        && (0..MR).all(|i| input.pixel[i] == input.pixel[0].wrapping_add(i * BLOCK))
}

/// [`micro_kernel_avx512`] for whole tiles of [`MAX_GROUP`] whole panels over a
/// blocked input ([`blocked_run`]), in one loop: each pixel's value at a step is
/// read at a constant distance from the tile's first pixel's, so the run keeps one
/// base in a register, not one per pixel, and the tiles' loop needs no call per
/// tile. (A call per tile with its bases, a tile's finish and its steps' setup
/// cost a 64 -> 256 channel layer at 56 x 56 7% against ONNX Runtime's kernel.)
///
/// # Safety
/// As [`micro_kernel_avx512`] with `NP = MAX_GROUP`, `HALF_LAST` false and no
/// accumulation, where [`blocked_run`] holds.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline(never)]
unsafe fn whole_blocked_run<const RESIDUAL: bool>(
    input: TileInput,
    (panels, stride): (*const f32, usize),
    (out, run): (TileOut, TileRun),
    finish: SimpleFinish,
) {
    use std::arch::x86_64::*;
    const NP: usize = MAX_GROUP;
    let offsets = input.offsets;
    let (prefetch, blocks_ahead) = (input.prefetch, input.blocks_ahead);
    for t in 0..run.tiles {
        let first = input.pixel[0].wrapping_add(t * run.pixel_step);
        let at = out.at.wrapping_add(t * run.out_step);
        let residual = finish.residual.map(|r| r.wrapping_add(t * run.out_step));
        let mut acc = [[_mm512_setzero_ps(); NP]; MR];
        let mut w = panels;
        for (s, &offset) in offsets.iter().enumerate() {
            // SAFETY (all loads): the caller's contract: pixel `i`'s value at this
            // step is `i` blocks past the first's, and the panels hold a step of
            // `NR` weights each per offset.
            unsafe {
                let x = first.add(offset as usize);
                if let (true, 0, Some(&next)) = (blocks_ahead, s % BLOCK, offsets.get(s + BLOCK)) {
                    let ahead = first.wrapping_add(next as usize);
                    for i in 0..MR {
                        // A prefetch never faults.
                        _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(i * BLOCK).cast::<i8>());
                    }
                }
                let ws: [__m512; NP] = std::array::from_fn(|v| _mm512_loadu_ps(w.add(v * stride)));
                if prefetch {
                    for v in 0..NP {
                        _mm_prefetch::<_MM_HINT_T0>(
                            w.wrapping_add(v * stride + WEIGHTS_AHEAD * NR).cast::<i8>(),
                        );
                    }
                }
                for (i, row) in acc.iter_mut().enumerate() {
                    let value = _mm512_set1_ps(*x.add(i * BLOCK));
                    for (sum, &wv) in row.iter_mut().zip(&ws) {
                        *sum = _mm512_fmadd_ps(value, wv, *sum);
                    }
                }
                w = w.add(NR);
            }
        }
        for (i, row) in acc.iter().enumerate() {
            for (v, &sum) in row.iter().enumerate() {
                let place = v * out.panel + i * out.pixel;
                let mut value = sum;
                // SAFETY: the caller's contract: the bias holds the panels' values,
                // the residual and the output the tile's.
                unsafe {
                    if let Some(b) = finish.bias {
                        value = _mm512_add_ps(value, _mm512_loadu_ps(b.add(v * NR)));
                    }
                    if let Some(a) = finish.activation {
                        value = crate::gemm::activate_lanes_avx512(value, a);
                    }
                    if let (true, Some(r)) = (RESIDUAL, residual) {
                        value = _mm512_add_ps(value, _mm512_loadu_ps(r.add(place)));
                    }
                    _mm512_storeu_ps(at.add(place), value);
                }
            }
        }
    }
}

/// What [`one_tile`] takes: what it reads, the panels and their stride, the
/// tile's place, and whether it adds to the sums there and the finish.
#[cfg(target_arch = "x86_64")]
type OneTile<'a> = (
    TileInput<'a>,
    (*const f32, usize),
    TileOut,
    (bool, SimpleFinish),
);

/// [`one_tile`] in a function of its own, for 3 or 4 panels: so that nothing a
/// run of tiles keeps live competes with the 18 or 24 sums for registers (with
/// the run's loop around it, some sums stayed on the stack through the products'
/// loop).
///
/// # Safety
/// As [`one_tile`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline(never)]
unsafe fn tile_apart<const NP: usize, const RESIDUAL: bool, const HALF_LAST: bool>(tile: OneTile) {
    // SAFETY: forwarded contract.
    unsafe { one_tile::<NP, RESIDUAL, HALF_LAST>(tile) }
}

/// One tile of [`micro_kernel_avx512`]: its sums, finished and stored.
///
/// # Safety
/// As [`micro_kernel_avx512`] for one tile.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn one_tile<const NP: usize, const RESIDUAL: bool, const HALF_LAST: bool>(
    (input, (panels, stride), out, (accumulate, finish)): OneTile,
) {
    use std::arch::x86_64::*;
    // Floats from the tile's place to pixel `i` of panel `v`'s: the last panel's
    // own place when it is half of one (before the tile's place where that panel
    // is the tile's only one, whose place a run advances by whole panels' pixels).
    let half_at = out.half.map_or(0, |h| (h as isize - out.at as isize) / 4);
    let offset = |v: usize, i: usize| -> isize {
        if HALF_LAST && v + 1 == NP {
            half_at + (i * HALF) as isize
        } else {
            (v * out.panel + i * out.pixel) as isize
        }
    };
    // SAFETY (all three): AVX-512F, and the caller's places (a half panel's first
    // 8 lanes, and a bias of its 8 values, alone).
    let load = |p: *const f32, v: usize| unsafe {
        if HALF_LAST && v + 1 == NP {
            _mm512_zextps256_ps512(_mm256_loadu_ps(p))
        } else {
            _mm512_loadu_ps(p)
        }
    };
    let store = |p: *mut f32, v: usize, x: __m512| unsafe {
        if HALF_LAST && v + 1 == NP {
            _mm256_storeu_ps(p, _mm512_castps512_ps256(x))
        } else {
            _mm512_storeu_ps(p, x)
        }
    };
    let mut acc = [[_mm512_setzero_ps(); NP]; MR];
    if accumulate {
        for (i, row) in acc.iter_mut().enumerate() {
            for (v, value) in row.iter_mut().enumerate() {
                *value = load(out.at.wrapping_offset(offset(v, i)), v);
            }
        }
    }
    // SAFETY: the caller's contract.
    let acc = unsafe {
        if NP >= 3 && (RESIDUAL || HALF_LAST) {
            let mut acc = acc;
            products_apart::<NP>(&mut acc, input, (panels, stride));
            acc
        } else {
            products::<NP, MR>(acc, input, (panels, stride))
        }
    };
    // The finish as the sums are stored (a finish that changed `acc` in place once
    // kept it on the stack through the loop, twice as slow).
    for (i, row) in acc.iter().enumerate() {
        for (v, &value) in row.iter().enumerate() {
            let mut value = value;
            if let Some(b) = finish.bias {
                // The bias holds NP panels' values (a half panel's 8).
                value = _mm512_add_ps(value, load(b.wrapping_add(v * NR), v));
            }
            if let Some(a) = finish.activation {
                // SAFETY: AVX-512F, as this function's.
                value = unsafe { crate::gemm::activate_lanes_avx512(value, a) };
            }
            let at = offset(v, i);
            if let (true, Some(r)) = (RESIDUAL, finish.residual) {
                value = _mm512_add_ps(value, load(r.wrapping_offset(at), v));
            }
            store(out.at.wrapping_offset(at), v, value);
        }
    }
}

/// [`products`] in a function of its own, for 3 or 4 panels with a residual: so that nothing the tile's loads and stores keep live
/// competes with the 18 or 24 sums for registers (inlined there, some sums stayed
/// on the stack through the loop).
///
/// # Safety
/// As [`products`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline(never)]
unsafe fn products_apart<const NP: usize>(
    acc: *mut [[std::arch::x86_64::__m512; NP]; MR],
    at: TileInput,
    weights: (*const f32, usize),
) {
    // Through a pointer, read before the loop and written after it: returned by
    // value, the compiler kept one sum in the return slot, stored every step.
    // SAFETY: forwarded contract; `acc` is the caller's.
    unsafe { acc.write(products::<NP, MR>(acc.read(), at, weights)) }
}

/// A short tile into a tile on the stack: [`micro_kernel`] for `NP` panels of
/// only the first `M` pixels (`M < MR`), the rest of the tile untouched. A plane's
/// last tile is short (49 pixels: 8 tiles and one pixel), and computed whole it
/// cost as much as a whole one.
///
/// # Safety
/// As [`micro_kernel`] for those pixels, with `count = NP`; AVX-512F is available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn short_tile<const NP: usize, const M: usize>(
    input: TileInput,
    sums: (*const f32, usize),
    tile: *mut f32,
    accumulate: bool,
) {
    use std::arch::x86_64::*;
    let at = |v: usize, i: usize| tile.wrapping_add(v * TILE + i * NR);
    let mut acc = [[_mm512_setzero_ps(); NP]; M];
    if accumulate {
        for (i, row) in acc.iter_mut().enumerate() {
            for (v, value) in row.iter_mut().enumerate() {
                // SAFETY: the tile holds NP panels of MR pixels.
                *value = unsafe { _mm512_loadu_ps(at(v, i)) };
            }
        }
    }
    // SAFETY: the caller's contract.
    let acc = unsafe { products::<NP, M>(acc, input, sums) };
    for (i, row) in acc.iter().enumerate() {
        for (v, &value) in row.iter().enumerate() {
            // SAFETY: as above.
            unsafe { _mm512_storeu_ps(at(v, i), value) };
        }
    }
}

/// [`short_tile`] for `count` panels (1 to [`MAX_GROUP`]) and `rows` pixels (1
/// to `MR - 1`).
///
/// # Safety
/// As [`short_tile`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn short_tile_of(
    (count, rows): (usize, usize),
    input: TileInput,
    sums: (*const f32, usize),
    tile: *mut f32,
    accumulate: bool,
) {
    macro_rules! rows {
        ($np:literal) => {
            match rows {
                1 => short_tile::<$np, 1>(input, sums, tile, accumulate),
                2 => short_tile::<$np, 2>(input, sums, tile, accumulate),
                3 => short_tile::<$np, 3>(input, sums, tile, accumulate),
                4 => short_tile::<$np, 4>(input, sums, tile, accumulate),
                _ => short_tile::<$np, 5>(input, sums, tile, accumulate),
            }
        };
    }
    // SAFETY: forwarded contract.
    unsafe {
        match count {
            1 => rows!(1),
            2 => rows!(2),
            3 => rows!(3),
            _ => rows!(4),
        }
    }
}

/// The micro-kernel's loops: `acc[i][v] += Σ_p x_i[p] * panel_v[p]` over the
/// steps `input` reads (its tail's after the others), returned.
///
/// # Safety
/// As [`micro_kernel`] with `count = NP`; AVX-512F is available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn products<const NP: usize, const M: usize>(
    acc: [[std::arch::x86_64::__m512; NP]; M],
    input: TileInput,
    (panels, stride): (*const f32, usize),
) -> [[std::arch::x86_64::__m512; NP]; M] {
    // SAFETY: the caller's contract; the tail's weights follow the other steps'.
    unsafe {
        let ahead = input.prefetch;
        let mut acc = acc;
        product_steps::<NP, M>(
            &mut acc,
            (input.offsets, input.pixel),
            (panels, stride),
            (ahead, input.blocks_ahead),
        );
        if input.tail.is_empty() {
            return acc;
        }
        let tail_panels = panels.wrapping_add(input.offsets.len() * NR);
        product_steps::<NP, M>(
            &mut acc,
            (input.tail, input.tail_pixel),
            (tail_panels, stride),
            (ahead, false),
        );
        acc
    }
}

/// One loop of [`products`]: `sums[i][v] += Σ_p pixel_i[offsets[p]] * panel_v[p]`
/// for the first `M` pixels; with `blocks_ahead`
/// ([`TileInput::blocks_ahead`]), the steps go [`BLOCK`] at a time, each block
/// first asking for the next one's lines.
///
/// # Safety
/// As [`products`] for these steps.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn product_steps<const NP: usize, const M: usize>(
    sums: &mut [[std::arch::x86_64::__m512; NP]; M],
    (offsets, pixel): (&[u32], [*const f32; MR]),
    (panels, stride): (*const f32, usize),
    (prefetch, blocks_ahead): (bool, bool),
) {
    use std::arch::x86_64::*;
    // The sums in a local of their own through the loop, written back after it:
    // returned by value when this was not inlined, they lived in the return slot,
    // stored every step.
    let mut acc = *sums;
    // One step: every pixel's value at `offset` times each panel's weights at `w`.
    // SAFETY (for each use): the caller's contract.
    let step = |acc: &mut [[__m512; NP]; M], offset: usize, w: *const f32| unsafe {
        let ws: [__m512; NP] = std::array::from_fn(|v| _mm512_loadu_ps(w.add(v * stride)));
        if prefetch {
            for v in 0..NP {
                _mm_prefetch::<_MM_HINT_T0>(
                    w.wrapping_add(v * stride + WEIGHTS_AHEAD * NR).cast::<i8>(),
                );
            }
        }
        for (i, row) in acc.iter_mut().enumerate() {
            let x = _mm512_set1_ps(*pixel[i].add(offset));
            for (value, &wv) in row.iter_mut().zip(&ws) {
                *value = _mm512_fmadd_ps(x, wv, *value);
            }
        }
    };
    // With 12 sums or fewer, each waits on its last multiply-add (4 cycles) more
    // than the units are busy: alternate steps go to a second set of sums.
    let pairs = M * NP <= 2 * MR;
    let mut other = [[_mm512_setzero_ps(); NP]; M];
    let mut w = panels;
    let chunk = if blocks_ahead {
        BLOCK
    } else {
        offsets.len().max(1)
    };
    let mut chunks = offsets.chunks(chunk).peekable();
    while let Some(steps) = chunks.next() {
        if let (true, Some(next)) = (blocks_ahead, chunks.peek()) {
            for p in &pixel[..M] {
                // A prefetch never faults.
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(next[0] as usize).cast::<i8>());
            }
        }
        if pairs {
            let mut two = steps.chunks_exact(2);
            for pair in &mut two {
                step(&mut acc, pair[0] as usize, w);
                step(&mut other, pair[1] as usize, w.wrapping_add(NR));
                w = w.wrapping_add(2 * NR);
            }
            if let [last] = two.remainder() {
                step(&mut acc, *last as usize, w);
                w = w.wrapping_add(NR);
            }
        } else {
            for &offset in steps {
                step(&mut acc, offset as usize, w);
                w = w.wrapping_add(NR);
            }
        }
    }
    if pairs {
        for (row, more) in acc.iter_mut().zip(&other) {
            for (value, &m) in row.iter_mut().zip(more) {
                *value = _mm512_add_ps(*value, m);
            }
        }
    }
    *sums = acc;
}

/// Stores a tile's product (`[pixel][channel]`) into `channels` output rows `ldo`
/// apart, `valid` pixels each, through `finish` if any.
///
/// # Safety
/// `out + c * ldo + i` is writable for every `c < channels` and `i < valid`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn store_transposed(
    tile: &[f32],
    out: *mut f32,
    ldo: usize,
    (valid, channels): (usize, usize),
    finish: Option<StoreFinish>,
) {
    use std::arch::x86_64::*;
    let relu = finish.is_some_and(|f| f.relu);
    if valid == MR && channels == NR {
        for half in 0..2 {
            // SAFETY: the tile holds MR rows of NR floats, the bias NR values; the
            // caller's contract for the stores.
            unsafe {
                let bias = finish.map_or(_mm256_setzero_ps(), |f| {
                    _mm256_loadu_ps(f.bias.as_ptr().add(half * 8))
                });
                let row = |i: usize| {
                    let v =
                        _mm256_add_ps(_mm256_loadu_ps(tile.as_ptr().add(i * NR + half * 8)), bias);
                    // `max(0, NaN)` keeps the NaN, like the other ReLUs.
                    if relu {
                        _mm256_max_ps(_mm256_setzero_ps(), v)
                    } else {
                        v
                    }
                };
                let columns = transpose_6x8([row(0), row(1), row(2), row(3), row(4), row(5)]);
                for (c, column) in columns.iter().enumerate() {
                    let dst = out.add((half * 8 + c) * ldo);
                    _mm_storeu_ps(dst, _mm256_castps256_ps128(*column));
                    _mm_storel_epi64(
                        dst.add(4).cast::<__m128i>(),
                        _mm_castps_si128(_mm256_extractf128_ps::<1>(*column)),
                    );
                }
            }
        }
        return;
    }
    for c in 0..channels {
        let bias = finish.map_or(0.0, |f| f.bias[c]);
        for i in 0..valid {
            let v = tile[i * NR + c] + bias;
            let v = if relu && v < 0.0 { 0.0 } else { v };
            // SAFETY: the caller's contract.
            unsafe { *out.add(c * ldo + i) = v };
        }
    }
}

/// Stores a tile's product (`[pixel][channel]`, [`NR`] channels a pixel, from
/// channel `c0`) into its block of a channel-blocked output, `lanes` channels a
/// pixel (16, or 8): pixel `i`'s go `at + i * lanes` floats after `out`, through
/// `finish` if any.
///
/// # Safety
/// AVX2 and FMA are available (blocked values exist only with them); `out + at + i
/// * lanes + j` is writable for every `i < valid` and `j < lanes`; `lanes` is a
/// block's width; `finish`'s pointers as [`RegisterFinish`] says, its residual at
/// `out`.
#[cfg(target_arch = "x86_64")]
unsafe fn store_blocked(
    tile: &[f32],
    (out, at): (*mut f32, usize),
    (valid, c0, lanes): (usize, usize, usize),
    finish: Option<&RegisterFinish>,
) {
    // SAFETY: forwarded contract; without AVX-512, AVX2 and FMA (the pixel
    // kernel's least), and lanes of 16 or 8 (a block's).
    unsafe {
        if crate::isa::isa().avx512f {
            store_blocked_avx512(tile, (out, at), (valid, c0, lanes), finish)
        } else {
            avx2::store_blocked(tile, (out, at), (valid, c0, lanes), finish)
        }
    }
}

/// [`store_blocked`] on AVX-512, any `lanes` up to 16 under a mask.
///
/// # Safety
/// As [`store_blocked`]; AVX-512F is available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn store_blocked_avx512(
    tile: &[f32],
    (out, at): (*mut f32, usize),
    (valid, c0, lanes): (usize, usize, usize),
    finish: Option<&RegisterFinish>,
) {
    use std::arch::x86_64::*;
    let mask: __mmask16 = crate::layout::lane_mask(lanes);
    for i in 0..valid {
        let to = at + i * lanes;
        // SAFETY: the tile holds MR rows of NR floats; the caller's contract for
        // the rest.
        unsafe {
            let v = _mm512_maskz_loadu_ps(mask, tile.as_ptr().add(i * NR));
            let v = match finish {
                Some(f) => f.apply(v, c0, to as isize, mask),
                None => v,
            };
            _mm512_mask_storeu_ps(out.add(to), mask, v);
        }
    }
}

#[cfg(not(target_arch = "x86_64"))]
unsafe fn store_blocked(
    _: &[f32],
    _: (*mut f32, usize),
    _: (usize, usize, usize),
    _: Option<&RegisterFinish>,
) {
    unreachable!("blocked layouts need x86-64")
}

#[cfg(not(target_arch = "x86_64"))]
pub(crate) unsafe fn store_transposed(
    _: &[f32],
    _: *mut f32,
    _: usize,
    _: (usize, usize),
    _: Option<StoreFinish>,
) {
    unreachable!("`applies` is false off x86-64")
}

/// Columns of a 6 x 8 matrix (rows `r`): column `c` holds `r[0][c] .. r[5][c]` in
/// lanes 0 to 5 (lanes 6 and 7 are zero).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
fn transpose_6x8(r: [std::arch::x86_64::__m256; MR]) -> [std::arch::x86_64::__m256; 8] {
    use std::arch::x86_64::*;
    let zero = _mm256_setzero_ps();
    // Pairs of rows interleaved, then pairs of pairs: the 4 x 4 transposes of each
    // 128-bit half; rows 6 and 7 are zero.
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, zero);
    let u5 = _mm256_shuffle_ps::<0xEE>(t4, zero);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, zero);
    let u7 = _mm256_shuffle_ps::<0xEE>(t5, zero);
    // u0 holds columns 0 (low half) and 4 (high half) of rows 0-3; u4 the same of
    // rows 4-5.
    [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ]
}
