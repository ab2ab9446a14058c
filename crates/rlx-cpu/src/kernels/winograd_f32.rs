//! 3x3 stride-1 `f32` convolutions (any dilation) by Winograd's minimal filtering F(4x4, 3x3)
//! (Lavin and Gray, "Fast Algorithms for Convolutional Neural Networks", 2015), with
//! the interpolation points 0, 1, -1, 1/2, -2 and infinity: in `f32` these round
//! about half as much as the more common 0, ±1, ±2 (measured on random data; the
//! filters are transformed in `f64` and rounded once).
//!
//! The output is cut into 4x4 tiles; tile `t` reads a 6x6 patch of the padded input.
//! With the transforms `V = Bᵀ d B` of each patch (per input channel) and `U = G g Gᵀ`
//! of each filter, the tile's 6x6 products are, for each of the 36 points `p`,
//! `M[p][t][co] = Σ_ci V[p][t][ci] U[p][ci][co]`: 36 GEMMs of `tiles x cg` by
//! `cg x og`, whose right operands are the transformed weights (packed ahead when they
//! are a param). The output tile is `Aᵀ M A`. That is 36 multiply-adds per 16 output
//! pixels and channel pair instead of 144, at the cost of the transforms (a few adds
//! per value) and a small change in rounding (see the tests for the size). A dilated
//! window is the same undilated one over each phase of its output (see [`Tiling`]).
//!
//! Work is split into pool tasks of whole tile rows (a tile row is 4 output rows of
//! one image and row phase), or of pieces of at most 32 tiles of a wider row, so the per-thread
//! scratch stays bounded; a task stages the 6 input rows a piece reads with the channels
//! innermost (so 8 channels of one pixel are one vector), transforms every patch of
//! the row, runs the 36 GEMMs over all its tiles, and writes the output rows with the
//! bias, then the activation, residual and channel affine over the finished rows.

use super::conv_pixels_f32::{BlockedIo, Finish};
use crate::gemm::GemmScratch;
use crate::gemm::{BFormat, Epilogue, Gemm, packed_len, packed_panel_width};
use crate::layout::{BLOCK, Blocks};
use crate::pool::ThreadPool;
use crate::tensor::{Dst, Src};
use crate::vmath::multiversion;
use rlx_ir::{Result, Shape, Window2d};

/// Output tile side.
const TILE: usize = 4;
/// Input patch side (`TILE + 2`).
const PATCH: usize = 6;
/// Transform points (`PATCH * PATCH`): one GEMM each.
const POINTS: usize = PATCH * PATCH;
/// Channels transformed together (one AVX2 vector).
const LANES: usize = 8;
/// Below this many input or output channels the transforms cost more than the
/// multiply-adds they save.
const MIN_CHANNELS: usize = 32;
/// Tiles per task (whole tile rows, at least one): the GEMMs' rows, enough that the
/// weights of each point are read for many tiles at once. 32 measured faster than 64
/// (whose transformed patches no longer stay in L2 at 128 channels): the CRNN's 3x3
/// layers at batch 32 went from 4.1 to 3.8 ms (128 channels, 8 x 20) and 4.6 to 4.55
/// (64 channels, 15 x 40); 16, 24 and 48 were slower than both.
const BLOCK_TILES: usize = 32;

/// Whether a convolution runs here: a 3x3 window, unit stride (any dilation), one
/// group, and channel counts that are multiples of 8 and at least [`MIN_CHANNELS`].
/// `RLX_WINOGRAD=0` in the environment turns it off (the next method of
/// `conv_f32::method` then runs, which rounds like a plain sum).
pub(crate) fn applies(win: &Window2d, groups: usize, cg: usize, og: usize) -> bool {
    win.kernel == [3, 3]
        && win.stride == [1, 1]
        && groups == 1
        && cg.is_multiple_of(LANES)
        && og.is_multiple_of(LANES)
        && cg >= MIN_CHANNELS
        && og >= MIN_CHANNELS
        && enabled()
}

fn enabled() -> bool {
    static ENABLED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ENABLED.get_or_init(|| rlx_ir::env::Switch::Winograd.enabled())
}

/// Floats of the transformed weights: one packed `cg x og` GEMM operand per point.
pub(crate) fn weights_len(cg: usize, og: usize) -> usize {
    packed_len(cg, og).saturating_mul(POINTS)
}

/// Transforms OIHW 3x3 weights (`og` filters of `cg` channels) into `out`
/// ([`weights_len`] floats): point `p`'s `cg x og` matrix `U[p]`, packed in the
/// GEMM's panels for width `og`, starts at `p * packed_len(cg, og)`.
pub(crate) fn transform_weights(ws: &[f32], cg: usize, og: usize, out: &mut [f32]) {
    let (nr, per_point) = (packed_panel_width(og), packed_len(cg, og));
    out.fill(0.0);
    for co in 0..og {
        for ci in 0..cg {
            let g = &ws[(co * cg + ci) * 9..][..9];
            // U = G g Gᵀ in f64: rows, then columns.
            let mut rows = [[0.0f64; 3]; PATCH];
            for c in 0..3 {
                let col = filter_points([g[c] as f64, g[3 + c] as f64, g[6 + c] as f64]);
                for (r, &v) in col.iter().enumerate() {
                    rows[r][c] = v;
                }
            }
            let at = (co / nr) * nr * cg + ci * nr + co % nr;
            for (i, row) in rows.iter().enumerate() {
                for (j, &u) in filter_points(*row).iter().enumerate() {
                    out[(i * PATCH + j) * per_point + at] = u as f32;
                }
            }
        }
    }
}

/// `G g` for one 3-tap filter: its values at the points 0, 1, -1, 1/2, -2 (each
/// over the product of its distances to the others) and at infinity.
fn filter_points([g0, g1, g2]: [f64; 3]) -> [f64; PATCH] {
    [
        g0,
        (g0 + g1 + g2) / 3.0,
        (-g0 + g1 - g2) / 3.0,
        -(16.0 * g0 + 8.0 * g1 + 4.0 * g2) / 15.0,
        (g0 - 2.0 * g1 + 4.0 * g2) / 15.0,
        g2,
    ]
}

/// How the output's tiles are cut into work.
///
/// With dilation `[dy, dx]`, output pixel `(y, x)` reads only input rows `y - pad +
/// dy k` and columns `x - pad + dx k`: the outputs of one phase `(y % dy, x % dx)`
/// form an undilated convolution of the input pixels a multiple of the dilation
/// apart. A tile is 4 x 4 outputs of one phase (rows `y0 + dy i`, columns `x0 + dx
/// j`), and reads a 6 x 6 patch of input pixels as far apart. (Without dilation
/// there is one phase, and a tile is 4 x 4 adjacent outputs.)
///
/// A tile row is 4 rows of one row phase. It is cut into pieces, each a run of
/// `dx * TILE * chunk` adjacent output columns: `chunk` tiles of every column phase,
/// which read the same staged input columns. Tasks take whole tile rows up to
/// [`BLOCK_TILES`] tiles, or one piece of a wide row, so a task's scratch stays
/// bounded however wide the image.
#[derive(Clone, Copy)]
struct Tiling {
    /// Dilation (rows, columns).
    dy: usize,
    dx: usize,
    /// Tile rows of one image (every row phase's) and tiles per row phase of one
    /// column phase.
    th: usize,
    tw: usize,
    /// Tiles per column phase in a piece (the last piece may have fewer) and pieces
    /// per tile row.
    chunk: usize,
    pieces: usize,
    /// Pieces per task (all but the last task): whole tile rows up to
    /// [`BLOCK_TILES`] tiles, or one piece of a wide row.
    pieces_per_task: usize,
    /// Staged columns of a piece: `dx * (chunk * TILE + 2)`.
    wp: usize,
}

/// One piece of output: its image, first row and column, and the tiles it holds of
/// each column phase.
#[derive(Clone, Copy)]
struct Piece {
    image: usize,
    y0: usize,
    x0: usize,
    /// Tiles per column phase.
    per_phase: usize,
}

impl Tiling {
    fn new(oh: usize, ow: usize, [dy, dx]: [usize; 2]) -> Tiling {
        let (dy, dx) = (dy.max(1), dx.max(1));
        // Every phase takes as many tiles as the first (the largest); tiles past the
        // output are computed and not stored (the method's choice bounds that waste).
        let th_phase = oh.div_ceil(dy).div_ceil(TILE);
        let tw = ow.div_ceil(dx).div_ceil(TILE).max(1);
        let per_piece = (BLOCK_TILES / dx).max(1);
        let chunk = tw.div_ceil(tw.div_ceil(per_piece));
        let pieces = tw.div_ceil(chunk);
        Tiling {
            dy,
            dx,
            th: th_phase * dy,
            tw,
            chunk,
            pieces,
            pieces_per_task: if pieces == 1 {
                (BLOCK_TILES / (tw * dx)).max(1)
            } else {
                1
            },
            wp: dx * (chunk * TILE + 2),
        }
    }

    /// Tiles of one image.
    fn tiles_per_image(&self) -> usize {
        self.th * self.tw * self.dx
    }

    /// The most tiles one task holds.
    fn max_tiles(&self) -> usize {
        self.pieces_per_task * self.chunk * self.dx
    }

    /// Piece `v`: tile rows in order of their first output row (the row phases of
    /// one band of `4 dy` rows side by side, so neighbours stage neighbouring rows).
    fn piece(&self, v: usize) -> Piece {
        let (row, piece) = (v / self.pieces, v % self.pieces);
        let (image, row) = (row / self.th, row % self.th);
        let (band, phase) = (row / self.dy, row % self.dy);
        let t0 = piece * self.chunk;
        Piece {
            image,
            y0: band * TILE * self.dy + phase,
            x0: t0 * TILE * self.dx,
            per_phase: self.chunk.min(self.tw - t0),
        }
    }

    /// Per-thread floats: the staged input rows, the transformed patches and the
    /// products.
    fn thread_floats(&self, cg: usize, og: usize) -> usize {
        PATCH * self.wp * cg + POINTS * self.max_tiles() * (cg + og)
    }
}

/// Tiles (over the whole batch) a Winograd convolution computes of an output of
/// `images x oh x ow` pixels with dilation `dilation`.
pub(crate) fn tiles(images: usize, [oh, ow]: [usize; 2], dilation: [usize; 2]) -> usize {
    images * Tiling::new(oh, ow, dilation).tiles_per_image()
}

/// Per-thread floats a Winograd convolution needs, from its input and weight shapes
/// and output rows and columns.
pub(crate) fn thread_floats(
    x: &Shape,
    w: &Shape,
    [oh, ow]: [usize; 2],
    dilation: [usize; 2],
) -> usize {
    Tiling::new(oh, ow, dilation).thread_floats(x.dim(1), w.dim(0))
}

/// The convolution, with `weights` from [`transform_weights`] (which may live in the
/// step's scratch: this takes only the GEMM buffers and the pool).
pub(crate) fn conv2d(
    win: &Window2d,
    x: Src,
    weights: &[f32],
    finish: Finish,
    (out, blocks): (Dst, BlockedIo),
    (gemm, pool): (&GemmScratch, &ThreadPool),
) -> Result<()> {
    let [n, cg, h, w] = [
        x.shape.dim(0),
        x.shape.dim(1),
        x.shape.dim(2),
        x.shape.dim(3),
    ];
    let [og, oh, ow] = [out.shape.dim(1), out.shape.dim(2), out.shape.dim(3)];
    if n == 0 || oh == 0 || ow == 0 || og == 0 {
        return Ok(());
    }
    let tiling = Tiling::new(oh, ow, win.dilation);
    let (dy, dx) = (tiling.dy, tiling.dx);
    let threads = gemm.threads();
    let units = n * tiling.th * tiling.pieces;
    let (pixels, per_point) = (oh * ow, packed_len(cg, og));
    let nr = packed_panel_width(og);
    // With few tiles, threads share the output channels, each streaming only its part
    // of the transformed weights (once per task of up to BLOCK_TILES tiles);
    // otherwise they share the tiles (fewer pieces per task when that is what gives
    // every thread one).
    let split = channel_split(n * tiling.tiles_per_image(), threads, og, nr);
    let per_task = if split.parts > 1 {
        tiling.pieces_per_task
    } else {
        tiling.pieces_per_task.min(units.div_ceil(threads)).max(1)
    };
    let tasks = units.div_ceil(per_task) * split.parts;
    // SAFETY: an f32 tensor of `x.len` values.
    let xs = unsafe { std::slice::from_raw_parts(x.ptr.cast::<f32>(), x.len) };
    // Addresses, so tasks on other threads can write their rows.
    let out_addr = out.ptr as usize;
    let residual_addr = finish.residual.map(|r| r.ptr as usize);
    // The bias goes in with the output transform; the rest over finished rows.
    let after_bias = finish.per_channel().without_bias();
    let task = |u: usize, thread: usize| {
        let (u, part) = (u / split.parts, u % split.parts);
        let channels = part * split.width..((part + 1) * split.width).min(og);
        let first = u * per_task;
        let count = per_task.min(units - first);
        let cap = tiling.max_tiles();
        // SAFETY: one task per thread index at a time.
        let (gemm_buf, extra) = unsafe { gemm.parts(thread) };
        let (staged, rest) = extra.split_at_mut(PATCH * tiling.wp * cg);
        let (patches, rest) = rest.split_at_mut(POINTS * cap * cg);
        let products = &mut rest[..POINTS * cap * og];
        let mut tiles = 0;
        for v in first..first + count {
            let piece = tiling.piece(v);
            let src = &xs[piece.image * cg * h * w..][..cg * h * w];
            let iy0 = piece.y0 as isize - win.padding[0] as isize;
            let ix0 = piece.x0 as isize - win.padding[1] as isize;
            stage_rows(
                (src, blocks.input),
                [h, w, cg],
                [iy0, ix0],
                [dy, tiling.wp],
                staged,
            );
            let at = Patches {
                values: patches.as_mut_ptr(),
                point_stride: cap * cg,
                first_tile: tiles,
            };
            let piece_tiles = piece.per_phase * dx;
            // SAFETY: the piece's tiles lie inside the task's `cap` tiles.
            unsafe { transform_inputs(staged, [tiling.wp, dx], cg, piece_tiles, at) };
            tiles += piece_tiles;
        }
        for p in 0..POINTS {
            let gemm = Gemm {
                m: tiles,
                n: og,
                k: cg,
                a: patches[p * cap * cg..].as_ptr(),
                lda: cg,
                b: weights[p * per_point..].as_ptr(),
                ldb: og,
                a_transposed: false,
                b_transposed: false,
                b_format: BFormat::Packed { nr, streamed: true },
                c: products[p * cap * og..].as_mut_ptr(),
                ldc: og,
                accumulate: false,
                epilogue: Epilogue::NONE,
            };
            // SAFETY: A is `tiles x cg` inside the patches, B point p's packed panels,
            // C `tiles x og` inside the products; the part starts on a panel.
            unsafe { crate::gemm::sgemm_serial_columns(&gemm, channels.clone(), gemm_buf) };
        }
        let mut done = 0;
        for v in first..first + count {
            let piece = tiling.piece(v);
            let (y0, x0) = (piece.y0, piece.x0);
            let piece_tiles = piece.per_phase * dx;
            // Output rows y0, y0 + dy, .. below oh (at most 4; none in a row phase
            // whose last band lies past the output), and the piece's run of columns.
            let rows = TILE.min(oh.saturating_sub(y0).div_ceil(dy));
            let x1 = (x0 + piece.per_phase * TILE * dx).min(ow);
            let image_at = piece.image * og * pixels;
            let dst = OutRows {
                // SAFETY: image `image`'s output channels lie inside the output.
                out: unsafe { (out_addr as *mut f32).add(image_at) },
                pixels,
                ow,
                y0,
                rows,
                x0,
                step: [dy, dx],
                blocks: blocks.output.then(|| Blocks::new(og, pixels)),
            };
            let products_at = (products[done * og..].as_ptr(), cap * og);
            done += piece_tiles;
            // SAFETY: the piece's tiles' products are inside the task's; its pixels
            // are inside the output and only this task writes them.
            unsafe {
                transform_outputs(
                    products_at,
                    og,
                    channels.clone(),
                    piece_tiles,
                    finish.bias,
                    &dst,
                )
            };
            if finish.activation.is_none() && residual_addr.is_none() && finish.affine.is_none() {
                continue;
            }
            // The piece's rows in one run per channel (or block) when they are
            // adjacent and span the width.
            let spans: &[(usize, usize)] = if x0 == 0 && x1 == ow && dy == 1 {
                &[(y0 * ow, rows * ow)]
            } else {
                &[]
            };
            let row_spans = (0..rows).map(|i| ((y0 + i * dy) * ow + x0, x1 - x0));
            for (start, len) in spans
                .iter()
                .copied()
                .chain(row_spans.filter(|_| spans.is_empty()))
            {
                // Whole blocks: the task's channels start on one (a part is whole
                // GEMM panels, 16, 32 or 48 channels wide).
                let (step, out_blocks) = (
                    if blocks.output { BLOCK } else { 1 },
                    Blocks::new(og, pixels),
                );
                for co in channels.clone().step_by(step) {
                    let (at, lanes) = if blocks.output {
                        let lanes = out_blocks.width(co / BLOCK);
                        (out_blocks.index(co, start), lanes)
                    } else {
                        (co * pixels + start, 1)
                    };
                    let (at, len) = (image_at + at, len * lanes);
                    // SAFETY: pixels start..start+len of channel (or block) co: inside
                    // the output (and the residual, of the same shape and layout); only
                    // this task writes them.
                    let (values, residual) = unsafe {
                        (
                            std::slice::from_raw_parts_mut((out_addr as *mut f32).add(at), len),
                            residual_addr.map(|a| {
                                std::slice::from_raw_parts((a as *const f32).add(at), len)
                            }),
                        )
                    };
                    match blocks.output {
                        true => after_bias.apply_lanes((co, lanes), values, residual),
                        false => after_bias.apply(co, values, residual),
                    }
                }
            }
        }
        debug_assert_eq!(done, tiles);
    };
    pool.run(tasks, threads, &task)
}

/// Copies the `PATCH` input rows `iy0, iy0 + dy, ..` (some may lie in the padding)
/// into `staged` as `[row][column][channel]`, `wp` columns from input column `ix0`,
/// zero outside the input; `src` is one image, channel-blocked if `blocked` (each
/// pixel's block is then one run of the staged pixel's channels).
fn stage_rows(
    (src, blocked): (&[f32], bool),
    [h, w, cg]: [usize; 3],
    [iy0, ix0]: [isize; 2],
    [dy, wp]: [usize; 2],
    staged: &mut [f32],
) {
    // Input columns lo..hi are inside; they land from staged column lo - ix0.
    let lo = ix0.clamp(0, w as isize) as usize;
    let hi = (ix0 + wp as isize).clamp(lo as isize, w as isize) as usize;
    let at = (lo as isize - ix0) as usize;
    for (r, line) in staged.chunks_exact_mut(wp * cg).take(PATCH).enumerate() {
        let iy = iy0 + (r * dy) as isize;
        if !(0..h as isize).contains(&iy) || lo == hi {
            line.fill(0.0);
            continue;
        }
        line[..at * cg].fill(0.0);
        line[(at + hi - lo) * cg..].fill(0.0);
        if !blocked {
            transpose_into(src, [h, w], iy as usize, [lo, hi], &mut line[at * cg..]);
            continue;
        }
        let blocks = Blocks::new(cg, h * w);
        for k in 0..blocks.count() {
            let b = blocks.width(k);
            let row = &src[blocks.index(k * BLOCK, iy as usize * w + lo)..][..(hi - lo) * b];
            for (x, pixel) in row.chunks_exact(b).enumerate() {
                line[(at + x) * cg + k * BLOCK..][..b].copy_from_slice(pixel);
            }
        }
    }
}

multiversion! {
    /// Columns `cols` of row `iy` of every channel into `dst` with the channels
    /// innermost: column `cols[0] + x`'s `cg` values start at `x * cg`.
    fn transpose_into(src: &[f32], hw: [usize; 2], iy: usize, cols: [usize; 2], dst: &mut [f32]) {
        let [h, w] = hw;
        let cg = src.len() / (h * w);
        let valid = cols[1] - cols[0];
        let row = |c: usize| (c * h + iy) * w + cols[0];
        for c0 in (0..cg).step_by(LANES) {
            // 8 x 8 blocks: 8 columns of 8 channel rows in, 8 pixels of 8 channels out.
            let whole = valid / LANES * LANES;
            for x0 in (0..whole).step_by(LANES) {
                let (from, to) = (row(c0) + x0, x0 * cg + c0);
                // Vector shuffles where the CPU has AVX; the lane-by-lane copy
                // below compiled to scalar moves.
                if crate::gemm::transpose_8x8_f32(&src[from..], h * w, &mut dst[to..], cg) {
                    continue;
                }
                let mut pixels = [[0.0; LANES]; LANES];
                for l in 0..LANES {
                    let values = load(&src[row(c0 + l) + x0..]);
                    for (pixel, &v) in pixels.iter_mut().zip(&values) {
                        pixel[l] = v;
                    }
                }
                for (x, pixel) in pixels.iter().enumerate() {
                    dst[(x0 + x) * cg + c0..][..LANES].copy_from_slice(pixel);
                }
            }
            for x in whole..valid {
                for l in 0..LANES {
                    dst[x * cg + c0 + l] = src[row(c0 + l) + x];
                }
            }
        }
    }
}

/// Where a tile row's transformed patches go: point `p` of tile `first_tile + tx`
/// starts at `values + p * point_stride + (first_tile + tx) * cg`.
struct Patches {
    values: *mut f32,
    point_stride: usize,
    first_tile: usize,
}

type Lanes = [f32; LANES];

/// A vector from its lanes. (`std::array::from_fn` is not inlined into the
/// per-instruction-set copies, which left these loops scalar.)
#[inline(always)]
fn lanes(f: impl Fn(usize) -> f32) -> Lanes {
    let mut out = [0.0; LANES];
    for (l, v) in out.iter_mut().enumerate() {
        *v = f(l);
    }
    out
}

/// `LANES` values from the start of `values`.
#[inline(always)]
fn load(values: &[f32]) -> Lanes {
    let mut out = [0.0; LANES];
    out.copy_from_slice(&values[..LANES]);
    out
}

/// Rows as columns.
#[inline(always)]
fn transpose<const R: usize, const C: usize>(m: &[[Lanes; C]; R]) -> [[Lanes; R]; C] {
    let mut out = [[[0.0; LANES]; R]; C];
    for (r, row) in m.iter().enumerate() {
        for (c, &v) in row.iter().enumerate() {
            out[c][r] = v;
        }
    }
    out
}

/// `Bᵀ d` for one column of 6 patch values (8 channels each). Every coefficient is
/// a small dyadic fraction, exact in binary.
#[inline(always)]
fn input_points(d: &[Lanes; PATCH]) -> [Lanes; PATCH] {
    let [d0, d1, d2, d3, d4, d5] = d;
    [
        lanes(|l| (d0[l] + d4[l]) - 1.5 * (d1[l] - d3[l]) - 2.0 * d2[l]),
        lanes(|l| (d4[l] - d1[l]) + 0.5 * d2[l] + 2.5 * d3[l]),
        lanes(|l| (d4[l] + d1[l]) - 2.5 * d2[l] + 0.5 * d3[l]),
        lanes(|l| (d4[l] - d2[l]) + 2.0 * (d3[l] - d1[l])),
        lanes(|l| (d4[l] - d2[l]) + 0.5 * (d1[l] - d3[l])),
        lanes(|l| (d1[l] + d5[l]) - 1.5 * (d2[l] - d4[l]) - 2.0 * d3[l]),
    ]
}

/// `Aᵀ m` for one column of 6 products (8 channels each).
#[inline(always)]
fn output_points(m: &[Lanes; PATCH]) -> [Lanes; TILE] {
    let [m0, m1, m2, m3, m4, m5] = m;
    [
        lanes(|l| m0[l] + (m1[l] + m2[l]) + (m3[l] + m4[l])),
        lanes(|l| (m1[l] - m2[l]) + 0.5 * m3[l] - 2.0 * m4[l]),
        lanes(|l| (m1[l] + m2[l]) + 0.25 * m3[l] + 4.0 * m4[l]),
        lanes(|l| (m1[l] - m2[l]) + 0.125 * m3[l] - 8.0 * m4[l] + m5[l]),
    ]
}

multiversion! {
    /// Transforms the `tw` patches of one staged piece into `at`: tile `k` is tile
    /// `k / dx` of column phase `k % dx`, whose patch is every `dx`-th staged column
    /// from column `k % dx + dx * TILE * (k / dx)` (adjacent columns without
    /// dilation).
    fn transform_inputs_body(
        staged: &[f32],
        columns: [usize; 2],
        cg: usize,
        tw: usize,
        at: &Patches
    ) {
        let [wp, dx] = columns;
        for tx in 0..tw {
            let first_column = tx % dx + dx * TILE * (tx / dx);
            for c0 in (0..cg).step_by(LANES) {
                // Bᵀ d column by column, then each row of that times B.
                let mut cols = [[[0.0; LANES]; PATCH]; PATCH];
                for (c, col) in cols.iter_mut().enumerate() {
                    let mut d = [[0.0; LANES]; PATCH];
                    for (r, v) in d.iter_mut().enumerate() {
                        *v = load(&staged[(r * wp + first_column + c * dx) * cg + c0..]);
                    }
                    *col = input_points(&d);
                }
                for (i, row) in transpose(&cols).iter().enumerate() {
                    for (j, v) in input_points(row).into_iter().enumerate() {
                        let offset =
                            (i * PATCH + j) * at.point_stride + (at.first_tile + tx) * cg + c0;
                        // SAFETY: the caller guarantees the tile lies inside the
                        // patches buffer.
                        unsafe { at.values.add(offset).cast::<Lanes>().write_unaligned(v) };
                    }
                }
            }
        }
    }
}

/// [`transform_inputs_body`].
///
/// # Safety
/// Points `0..36` of tiles `at.first_tile .. + tw` (`cg` values each) lie inside the
/// buffer `at` addresses.
unsafe fn transform_inputs(staged: &[f32], columns: [usize; 2], cg: usize, tw: usize, at: Patches) {
    transform_inputs_body(staged, columns, cg, tw, &at);
}

/// Output rows one piece writes.
struct OutRows {
    /// The image's first output channel.
    out: *mut f32,
    /// Pixels per channel and output columns.
    pixels: usize,
    ow: usize,
    /// First row and how many (at most 4, `step[0]` apart) lie inside the output.
    y0: usize,
    rows: usize,
    /// The piece's first column.
    x0: usize,
    /// The dilation: rows and columns of one tile lie this far apart.
    step: [usize; 2],
    /// The output's blocks where it is channel-blocked.
    blocks: Option<Blocks>,
}

multiversion! {
    /// `Aᵀ M A` plus the bias for output channels `channels` of the `tw` tiles of one
    /// piece, stored to the valid pixels of `dst`.
    fn transform_outputs_body(
        products: (*const f32, usize),
        og: usize,
        channels: std::ops::Range<usize>,
        tw: usize,
        bias: Option<&[f32]>,
        dst: &OutRows
    ) {
        let (first, point_stride) = products;
        let [dy, dx] = dst.step;
        let mut tx = 0;
        while tx < tw {
            // Tile `tx / dx` of column phase `tx % dx`: columns x0, x0 + dx, ..
            let x0 = dst.x0 + tx % dx + dx * TILE * (tx / dx);
            if x0 >= dst.ow {
                // A phase's tile wholly past the output (the phases past the last
                // column have one column fewer).
                tx += 1;
                continue;
            }
            // Two whole adjacent tiles side by side give each output row 8 pixels
            // of 8 channels: one 8 x 8 transpose stores them as 8 channel runs.
            let pair = dx == 1 && tx + 1 < tw && x0 + 2 * TILE <= dst.ow;
            let tiles = if pair { 2 } else { 1 };
            let valid = TILE.min((dst.ow - x0).div_ceil(dx));
            for c0 in channels.clone().step_by(LANES) {
                let b: Lanes = match bias {
                    Some(bias) => load(&bias[c0..]),
                    None => [0.0; LANES],
                };
                // Row `i`, pixel `j` of the tiles (channels in lanes), bias added.
                let mut block = [[[0.0; LANES]; 2 * TILE]; TILE];
                for t in 0..tiles {
                    let value = |i: usize, j: usize| -> Lanes {
                        let offset = (i * PATCH + j) * point_stride + (tx + t) * og + c0;
                        // SAFETY: the caller guarantees every point of the row's tiles
                        // lies inside the products.
                        unsafe { first.add(offset).cast::<Lanes>().read_unaligned() }
                    };
                    let mut cols = [[[0.0; LANES]; TILE]; PATCH];
                    for (j, col) in cols.iter_mut().enumerate() {
                        let mut m = [[0.0; LANES]; PATCH];
                        for (i, v) in m.iter_mut().enumerate() {
                            *v = value(i, j);
                        }
                        *col = output_points(&m);
                    }
                    for (i, row) in transpose(&cols).iter().enumerate() {
                        for (j, px) in output_points(row).iter().enumerate() {
                            block[i][t * TILE + j] = lanes(|l| px[l] + b[l]);
                        }
                    }
                }
                if let Some(blocks) = dst.blocks {
                    // The 8 channels of a pixel lie together in its block.
                    let count = if pair { 2 * TILE } else { valid };
                    for (i, pixels) in block.iter().enumerate().take(dst.rows) {
                        let row = (dst.y0 + i * dy) * dst.ow + x0;
                        for (j, px) in pixels.iter().enumerate().take(count) {
                            // A run of 8 channels lies in one block.
                            let at = blocks.index(c0, row + j * dx);
                            // SAFETY: channels c0..c0 + 8 of pixel (y0 + i dy, x0 + j
                            // dx), one run of its block, lie inside the image's output.
                            unsafe {
                                std::slice::from_raw_parts_mut(dst.out.add(at), LANES)
                                    .copy_from_slice(px)
                            };
                        }
                    }
                    continue;
                }
                for (i, pixels) in block.iter().enumerate().take(dst.rows) {
                    let at = c0 * dst.pixels + (dst.y0 + i * dy) * dst.ow + x0;
                    if pair {
                        // SAFETY: channels c0..c0 + 8, pixels (y0 + i dy, x0 .. x0 + 8),
                        // lie inside the image's output (caller's guarantee); the slice
                        // spans them.
                        let out = unsafe {
                            std::slice::from_raw_parts_mut(dst.out.add(at), 7 * dst.pixels + 8)
                        };
                        if crate::gemm::transpose_8x8_f32(
                            pixels.as_flattened(),
                            LANES,
                            out,
                            dst.pixels,
                        ) {
                            continue;
                        }
                    }
                    let count = if pair { 2 * TILE } else { valid };
                    for (j, px) in pixels.iter().enumerate().take(count) {
                        for (l, &v) in px.iter().enumerate() {
                            // SAFETY: channel c0 + l, pixel (y0 + i dy, x0 + j dx) lies
                            // inside the image's output (caller's guarantee).
                            unsafe { *dst.out.add(at + l * dst.pixels + j * dx) = v };
                        }
                    }
                }
            }
            tx += tiles;
        }
    }
}

/// [`transform_outputs_body`].
///
/// # Safety
/// Points `0..36` of the `tw` tiles from `products.0` (point stride `products.1`,
/// `og` values per tile) are readable; `dst` addresses the image's `og x pixels`
/// output, of which channels `channels` (within `0..og`, starting on a multiple of
/// [`LANES`]) of rows `y0 + i step[0]` (`i < rows`), in the columns of the piece's
/// tiles, are this caller's alone.
unsafe fn transform_outputs(
    products: (*const f32, usize),
    og: usize,
    channels: std::ops::Range<usize>,
    tw: usize,
    bias: Option<&[f32]>,
    dst: &OutRows,
) {
    transform_outputs_body(products, og, channels, tw, bias, dst);
}

/// How the output channels are shared between threads: `parts` ranges of `width`
/// channels (the last one shorter).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct ChannelSplit {
    parts: usize,
    width: usize,
}

/// Below this many tiles per thread, threads share the output channels instead of
/// the tiles.
const SPLIT_TILES: usize = 16;

/// The channel split for `tiles` tiles in all on `threads` threads, `og` output
/// channels packed in panels `nr` wide: up to one part per thread (fewer where the
/// panels do not divide evenly: 5 panels on 4 threads make 3 parts of 2), in whole
/// panels, where the tiles are too few to give every thread [`SPLIT_TILES`] of them;
/// one part otherwise.
///
/// Each point's GEMM streams all of its transformed weights once per task whatever
/// its rows: at 14 x 14 (16 tiles) and 256 channels, two threads with 8 tiles each
/// read the 9.4 MB of weights twice. Split, each part's task reads only its part
/// (once per task of up to [`BLOCK_TILES`] tiles), at the cost of every part
/// transforming the same input patches.
fn channel_split(tiles: usize, threads: usize, og: usize, nr: usize) -> ChannelSplit {
    let panels = og.div_ceil(nr);
    let parts = threads.min(panels);
    if parts < 2 || tiles >= threads * SPLIT_TILES {
        return ChannelSplit {
            parts: 1,
            width: og,
        };
    }
    let width = panels.div_ceil(parts) * nr;
    ChannelSplit {
        parts: og.div_ceil(width),
        width,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm::tests::lcg;
    use crate::kernels::conv::{conv2d as direct_conv2d, extent};
    use rlx_ir::DType;

    /// Runs the kernel on `threads` threads on fresh random data and compares it
    /// with the plain direct convolution (`kernels::conv`, sums in `f64`).
    fn check(threads: usize, [n, c, h, w]: [usize; 4], o: usize, win: Window2d, seed: u64) {
        let mut seed = seed;
        let x: Vec<f32> = (0..n * c * h * w).map(|_| lcg(&mut seed)).collect();
        let wt: Vec<f32> = (0..o * c * 9).map(|_| lcg(&mut seed)).collect();
        let bias: Vec<f32> = (0..o).map(|_| lcg(&mut seed)).collect();
        let (oh, ow) = (extent(&win, 0, h), extent(&win, 1, w));
        let xs = Shape::new(&[n, c, h, w], DType::F32);
        let os = Shape::new(&[n, o, oh, ow], DType::F32);
        let ws = Shape::new(&[o, c, 3, 3], DType::F32);
        let bs = Shape::new(&[o], DType::F32);
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
        let mut want = vec![f32::NAN; n * o * oh * ow];
        let (x_src, w_src, b_src) = (src(&x, &xs), src(&wt, &ws), src(&bias, &bs));
        direct_conv2d(&win, 1, x_src, w_src, Some(b_src), dst(&mut want, &os));
        let mut transformed = vec![0.0; weights_len(c, o)];
        transform_weights(&wt, c, o, &mut transformed);
        let mut out = vec![f32::NAN; n * o * oh * ow];
        let pool = ThreadPool::new(threads);
        let scratch = GemmScratch::new(threads, thread_floats(&xs, &ws, [oh, ow], win.dilation));
        let finish = Finish {
            bias: Some(&bias),
            activation: None,
            residual: None,
            affine: None,
        };
        let out_dst = dst(&mut out, &os);
        conv2d(
            &win,
            x_src,
            &transformed,
            finish,
            (out_dst, BlockedIo::default()),
            (&scratch, &pool),
        )
        .unwrap();
        let what = format!("{threads} threads x[{n},{c},{h},{w}] o{o} {win:?}");
        let tol = 5e-6 * ((9 * c) as f64).sqrt();
        for (i, (&got, &want)) in out.iter().zip(&want).enumerate() {
            let (got, want) = (f64::from(got), f64::from(want));
            assert!(
                (got - want).abs() <= tol * (1.0 + want.abs()),
                "{what}: output {i}: {got} vs {want}"
            );
        }
    }

    fn window(padding: [usize; 4], dilation: [usize; 2]) -> Window2d {
        Window2d {
            kernel: [3, 3],
            stride: [1, 1],
            padding,
            dilation,
        }
    }

    #[test]
    fn channel_parts_on_many_threads_match_the_reference() {
        // Fewer than SPLIT_TILES tiles per thread: the threads share the output
        // channels in whole weight panels, each part's tasks taking whole tile rows
        // (at 28 x 28 on 4 threads, 7 tile rows make two tasks a part; with three
        // threads on two panels, two parts).
        // (threads, x dims, output channels, dilation; padding = dilation, so the
        // output is the input's size)
        let cases = [
            (4, [1usize, 32, 28, 28], 96, 1),
            (3, [1, 40, 24, 21], 200, 1),
            (3, [1, 32, 9, 9], 64, 1),
            (4, [2, 32, 13, 16], 64, 1),
            // 160 channels in 32-wide panels split 96 + 64: the kernel must be the
            // one for 160 columns (32 wide), not for 96 (48 wide).
            (2, [1, 32, 14, 14], 160, 1),
            // Dilated: 16 tiles, four phases of 2 x 2.
            (2, [1, 32, 16, 16], 96, 2),
        ];
        for (case, (threads, dims, o, d)) in cases.into_iter().enumerate() {
            let tiles = super::tiles(dims[0], [dims[2], dims[3]], [d, d]);
            let split = channel_split(tiles, threads, o, packed_panel_width(o));
            assert!(
                split.parts > 1,
                "{threads} threads, {tiles} tiles: {split:?}"
            );
            check(threads, dims, o, window([d; 4], [d, d]), case as u64);
        }
    }

    #[test]
    fn dilated_windows_match_the_reference() {
        // Each phase of the output an undilated convolution: dilations that divide
        // the output and ones that leave phases of unequal size (some tiles wholly
        // past the output), unequal in the two directions, padding smaller and larger
        // than the dilation, pieces of a row wider than BLOCK_TILES, several images.
        let cases = [
            ([1, 32, 32, 32], 40, [2, 2, 2, 2], [2, 2]),
            ([1, 32, 30, 29], 32, [4, 4, 4, 4], [4, 4]),
            ([2, 40, 19, 23], 48, [3, 1, 0, 2], [3, 2]),
            ([1, 32, 14, 150], 32, [2, 2, 2, 2], [2, 2]),
            ([1, 48, 21, 17], 32, [5, 5, 5, 5], [5, 3]),
            ([1, 32, 16, 16], 32, [1, 0, 2, 1], [1, 1]),
            // 17 columns at dilation 2: 9 in the even phase, 8 in the odd, so the odd
            // phase's last tile lies wholly past the output.
            ([1, 32, 17, 17], 32, [2, 2, 2, 2], [2, 2]),
        ];
        for (case, (dims, o, padding, dilation)) in cases.into_iter().enumerate() {
            check(2, dims, o, window(padding, dilation), 100 + case as u64);
            check(1, dims, o, window(padding, dilation), 200 + case as u64);
        }
    }
}
