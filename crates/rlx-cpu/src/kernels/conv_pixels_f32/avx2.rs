//! The pixel kernel on AVX2: its one-panel tile into scratch (`tile_sums`) and its
//! stores into channel-blocked outputs, what the AVX-512 forms in the parent
//! module do, with a block of 16 channels held as two 8-lane vectors (a last block
//! of 8 as one). A tile is 6 pixels by one panel of 16 channels: 12 sums, 2 weight
//! vectors and a broadcast, 15 of the 16 registers. Channel blocks are whole
//! multiples of 8 lanes, so nothing here needs a mask.

use super::{MR, NR, RegisterFinish, TileInput, TileOut, TileRun, WEIGHTS_AHEAD};
use crate::layout::{BLOCK, HALF};
use std::arch::x86_64::*;

/// Lanes of an AVX2 vector.
const LANES: usize = 8;

/// The steps `$j` of one run for [`run_steps`]: each pixel `i`'s value `$j` floats
/// past `$base[i]` times the step's weights at `$w + j * NR`, added to `$acc`.
macro_rules! run_step {
    ($acc:ident, $w:ident, $base:ident, $prefetch:literal; $($j:literal)*) => {$(
        // SAFETY: the caller's contract: step `j` of the run is pixel `i`'s value
        // `j` floats past its base, and the weights hold `NR` a step.
        unsafe {
            let wj = $w.add($j * NR);
            if $prefetch {
                _mm_prefetch::<_MM_HINT_T0>(wj.wrapping_add(WEIGHTS_AHEAD * NR).cast::<i8>());
            }
            let ws: [__m256; L] = std::array::from_fn(|l| _mm256_loadu_ps(wj.add(l * LANES)));
            for (i, row) in $acc.iter_mut().enumerate() {
                let x = _mm256_broadcast_ss(&*$base[i].add($j));
                for (sum, &wv) in row.iter_mut().zip(&ws) {
                    *sum = _mm256_fmadd_ps(x, wv, *sum);
                }
            }
        }
    )*};
}

/// The steps of `$offsets` from the bases `$pixel`, in runs of `$j`'s count (16 or
/// 8) steps whose offsets are consecutive ([`TileInput::runs`]), adding to the sums
/// `$acc` (a local of the caller, so that they stay in registers: as a function of
/// its own, a tile's sums went through memory on each call, a fifth of a
/// 16-channel layer's time). A run's steps are unrolled, each pixel's value at a
/// fixed distance from its base, so no step reads the offset table or tests
/// anything (with a table load and the tests per step, 30 instructions fed 12
/// multiply-adds and the front end, not the units, set the pace). With
/// `$ahead`, each run first asks for every pixel's line of the next run
/// ([`TileInput::blocks_ahead`]); with `$prefetch` (a literal) each step for the
/// weights [`WEIGHTS_AHEAD`] steps on. Evaluates to the weights after the last
/// step.
///
/// Used inside an AVX2 function, under the caller's contract: that of [`steps`],
/// with the offsets in such runs.
macro_rules! run_steps {
    ($acc:ident, ($offsets:expr, $pixel:expr, $ahead:expr), $weights:expr, $prefetch:literal; $($j:literal)*) => {{
        const RUN: usize = [$($j),*].len();
        let offsets: &[u32] = $offsets;
        let pixel: [*const f32; MR] = $pixel;
        let runs = offsets.len() / RUN;
        let mut w: *const f32 = $weights;
        for r in 0..runs {
            let at = offsets[r * RUN] as usize;
            let base: [*const f32; MR] = pixel.map(|p| p.wrapping_add(at));
            if $ahead && r + 1 < runs {
                let next = offsets[(r + 1) * RUN] as usize;
                for p in pixel {
                    // A prefetch never faults.
                    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(next).cast::<i8>());
                }
            }
            run_step!($acc, w, base, $prefetch; $($j)*);
            w = w.wrapping_add(RUN * NR);
        }
        w
    }};
}

/// All the steps of `$input` (its offsets, then its tail's) times the weights
/// from `$weights`, added to the sums `$acc` (`[[__m256; L]; MR]`, `L` in scope):
/// runs of consecutive offsets unrolled ([`run_steps`]), other steps one by one
/// ([`steps`]).
///
/// Used inside an AVX2 function, under the contract of [`steps`] for the input's
/// steps and its tail's.
macro_rules! tile_steps {
    ($acc:ident, $input:expr, $weights:expr) => {{
        let input: &TileInput = $input;
        let weights: *const f32 = $weights;
        let (offsets, pixel, ahead) = (input.offsets, input.pixel, input.blocks_ahead);
        // Runs only over whole runs: steps that are not (a caller's mistake) go
        // one by one rather than be dropped.
        let runs = match offsets.len().is_multiple_of(input.runs.max(1)) {
            true => input.runs,
            false => 1,
        };
        match (runs, input.prefetch) {
            (BLOCK, true) => {
                run_steps!($acc, (offsets, pixel, ahead), weights, true;
                    0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
            }
            (BLOCK, false) => {
                run_steps!($acc, (offsets, pixel, ahead), weights, false;
                    0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15);
            }
            (HALF, true) => {
                run_steps!($acc, (offsets, pixel, ahead), weights, true; 0 1 2 3 4 5 6 7);
            }
            (HALF, false) => {
                run_steps!($acc, (offsets, pixel, ahead), weights, false; 0 1 2 3 4 5 6 7);
            }
            _ => {
                // SAFETY: the caller's contract.
                unsafe { steps::<L>(&mut $acc, (offsets, pixel), weights, (input.prefetch, ahead)) };
            }
        }
        if !input.tail.is_empty() {
            // The tail is one block of 8 channels: a run of 8 consecutive offsets.
            let tail = weights.wrapping_add(offsets.len() * NR);
            let pixel = input.tail_pixel;
            if input.prefetch {
                run_steps!($acc, (input.tail, pixel, false), tail, true; 0 1 2 3 4 5 6 7);
            } else {
                run_steps!($acc, (input.tail, pixel, false), tail, false; 0 1 2 3 4 5 6 7);
            }
        }
    }};
}

/// Whether `input`'s offsets lie in runs of [`TileInput::runs`] consecutive
/// values and its tail in runs of [`HALF`] (what [`tile_steps`] assumes).
fn runs_hold(input: &TileInput) -> bool {
    let consecutive = |offsets: &[u32], run: usize| {
        offsets.len().is_multiple_of(run)
            && offsets.chunks_exact(run).all(|r| {
                r.iter()
                    .enumerate()
                    .all(|(j, &o)| o as usize == r[0] as usize + j)
            })
    };
    (input.runs <= 1 || consecutive(input.offsets, input.runs)) && consecutive(input.tail, HALF)
}

/// [`super::micro_kernel_to`] on AVX2: for each of `count` panels and each tile of
/// `run`, the sums stored straight to their place in the blocked output (added to
/// the values there with `accumulate`), finished as they are stored: the whole
/// finish in registers, a channel affine and its activation too (over each
/// stored tile, a second pass cost ResNet-50's 64 -> 256 layers a fifth of
/// their time, the affine being the identity that carries the ReLU after the
/// skip add).
///
/// # Safety
/// As [`super::micro_kernel_to`], with AVX2 and FMA in place of AVX-512F.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn micro_kernel_to(
    input: TileInput,
    (panels, stride, count): (*const f32, usize, usize),
    (out, run): (TileOut, TileRun),
    (finish, accumulate): (Option<&RegisterFinish>, bool),
) {
    for v in 0..count {
        let half = out.half.is_some() && v + 1 == count;
        // Where this panel's tile 0 goes, and its pixels' distance.
        let (place, pixel, tile_step) = match out.half {
            Some(h) if half => (h, HALF, MR * HALF),
            _ => (out.at.wrapping_add(v * out.panel), out.pixel, run.out_step),
        };
        let panel = Panel {
            accumulate,
            weights: panels.wrapping_add(v * stride),
            place,
            pixel,
            tile_step,
            // The residual is laid out as the output, from the tile's place.
            residual: finish
                .and_then(|f| f.residual)
                .map(|r| r.wrapping_offset(floats_from(out.at, place))),
            bias: finish.and_then(|f| f.bias).map(|b| b.wrapping_add(v * NR)),
            activation: finish.and_then(|f| f.activation),
            affine: finish.and_then(|f| f.affine).map(|(scale, shift, post)| {
                (scale.wrapping_add(v * NR), shift.wrapping_add(v * NR), post)
            }),
        };
        // SAFETY: the caller's contract, for this panel's tiles.
        unsafe {
            match (half, panel.residual.is_some(), panel.affine.is_some()) {
                (false, false, false) => tiles::<2, false, false>(input, run, &panel),
                (false, true, false) => tiles::<2, true, false>(input, run, &panel),
                (true, false, false) => tiles::<1, false, false>(input, run, &panel),
                (true, true, false) => tiles::<1, true, false>(input, run, &panel),
                (false, false, true) => tiles::<2, false, true>(input, run, &panel),
                (false, true, true) => tiles::<2, true, true>(input, run, &panel),
                (true, false, true) => tiles::<1, false, true>(input, run, &panel),
                (true, true, true) => tiles::<1, true, true>(input, run, &panel),
            }
        }
    }
}

/// Floats from `from` to `to`.
fn floats_from(from: *const f32, to: *const f32) -> isize {
    (to as isize - from as isize) / 4
}

/// One panel's part of [`micro_kernel_to`]: its weights, where its tile 0's pixel
/// 0 goes, the floats from pixel to pixel and from tile to tile there, and the
/// finish as the sums are stored (a residual laid out as the output, from
/// `place`; a bias and a channel affine at the panel's first channel).
struct Panel {
    /// Whether the sums start from the values stored at their places.
    accumulate: bool,
    weights: *const f32,
    place: *mut f32,
    pixel: usize,
    tile_step: usize,
    residual: Option<*const f32>,
    bias: Option<*const f32>,
    activation: Option<crate::gemm::Activation>,
    /// `(scale, shift, post)`: applied after the residual.
    affine: Option<(*const f32, *const f32, Option<crate::gemm::Activation>)>,
}

/// The tiles of `run` for one panel of `L` vectors (2: 16 channels; 1: a last
/// block of 8), each stored through the panel's finish (its residual only with
/// `RESIDUAL`, its channel affine only with `AFFINE`).
///
/// # Safety
/// As [`micro_kernel_to`] for this panel.
#[target_feature(enable = "avx2,fma")]
unsafe fn tiles<const L: usize, const RESIDUAL: bool, const AFFINE: bool>(
    input: TileInput,
    run: TileRun,
    p: &Panel,
) {
    debug_assert!(runs_hold(&input));
    for t in 0..run.tiles {
        let input = input.nth(t, run);
        let at = p.place.wrapping_add(t * p.tile_step);
        let mut acc = [[_mm256_setzero_ps(); L]; MR];
        if p.accumulate {
            for (i, row) in acc.iter_mut().enumerate() {
                for (l, sum) in row.iter_mut().enumerate() {
                    // SAFETY: the caller's contract: the tile's places hold its
                    // sums so far.
                    *sum = unsafe { _mm256_loadu_ps(at.add(i * p.pixel + l * LANES)) };
                }
            }
        }
        // The steps under the caller's contract.
        tile_steps!(acc, &input, p.weights);
        let residual = p.residual.map(|r| r.wrapping_add(t * p.tile_step));
        // SAFETY: the caller's contract: the bias and the affine hold the panel's
        // lanes, the residual and the output the tile's.
        unsafe {
            if AFFINE {
                // Out of line: inlined, the affine's vectors (the same for every
                // tile) were hoisted out of the tile loop into registers the sums
                // needed, and the sums went through the stack at every step (2.8
                // times as long).
                store_tile_affine::<L, RESIDUAL>(acc, at, residual, p);
            } else {
                store_tile::<L, RESIDUAL, false>(acc, at, residual, p);
            }
        }
    }
}

/// Stores a tile's sums at `at` (its pixels `p.pixel` floats apart) through the
/// panel's bias, activation and residual (the tile's, at `residual`, only with
/// `RESIDUAL`), then (with `AFFINE`) its channel affine and that's activation.
/// The sums come by value: by reference, where this was not inlined, they lived
/// in memory through the steps (EfficientNet-B0's projections with a skip add
/// took twice as long).
///
/// # Safety
/// AVX2 and FMA are available; the bias and affine hold the panel's `L * 8`
/// lanes, the residual and `at` the tile's values.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn store_tile<const L: usize, const RESIDUAL: bool, const AFFINE: bool>(
    acc: [[__m256; L]; MR],
    at: *mut f32,
    residual: Option<*const f32>,
    p: &Panel,
) {
    for (i, row) in acc.iter().enumerate() {
        for (l, &sum) in row.iter().enumerate() {
            let place = i * p.pixel + l * LANES;
            let mut value = sum;
            // SAFETY: the caller's contract.
            unsafe {
                if let Some(b) = p.bias {
                    value = _mm256_add_ps(value, _mm256_loadu_ps(b.add(l * LANES)));
                }
                if let Some(a) = p.activation {
                    value = crate::gemm::activate_lanes_avx2(value, a);
                }
                if let (true, Some(r)) = (RESIDUAL, residual) {
                    value = _mm256_add_ps(value, _mm256_loadu_ps(r.add(place)));
                }
                if let (true, Some((scale, shift, post))) = (AFFINE, p.affine) {
                    let (s, t) = (scale.add(l * LANES), shift.add(l * LANES));
                    value = _mm256_fmadd_ps(value, _mm256_loadu_ps(s), _mm256_loadu_ps(t));
                    if let Some(a) = post {
                        value = crate::gemm::activate_lanes_avx2(value, a);
                    }
                }
                _mm256_storeu_ps(at.add(place), value);
            }
        }
    }
}

/// [`store_tile`] for a panel with a channel affine, never inlined.
///
/// # Safety
/// As [`store_tile`].
#[target_feature(enable = "avx2,fma")]
#[inline(never)]
unsafe fn store_tile_affine<const L: usize, const RESIDUAL: bool>(
    acc: [[__m256; L]; MR],
    at: *mut f32,
    residual: Option<*const f32>,
    p: &Panel,
) {
    // SAFETY: the caller's contract.
    unsafe { store_tile::<L, RESIDUAL, true>(acc, at, residual, p) }
}

/// [`super::micro_kernel`] on AVX2 for one panel: the tile's sums over all of
/// `input`'s steps (its tail's too) added to the `[pixel][channel]` sums in
/// `tile` with `accumulate`, else stored there.
///
/// # Safety
/// As [`super::micro_kernel`] with one panel; AVX2 and FMA are available.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn tile_sums(
    input: TileInput,
    panel: *const f32,
    (tile, accumulate): (&mut [f32], bool),
) {
    const L: usize = 2;
    debug_assert!(runs_hold(&input) && tile.len() >= MR * NR);
    let mut acc = [[_mm256_setzero_ps(); L]; MR];
    if accumulate {
        for (i, row) in acc.iter_mut().enumerate() {
            for (l, sum) in row.iter_mut().enumerate() {
                // SAFETY: the tile holds MR rows of NR floats.
                *sum = unsafe { _mm256_loadu_ps(tile.as_ptr().add(i * NR + l * LANES)) };
            }
        }
    }
    tile_steps!(acc, &input, panel);
    for (i, row) in acc.iter().enumerate() {
        for (l, &sum) in row.iter().enumerate() {
            // SAFETY: as above.
            unsafe { _mm256_storeu_ps(tile.as_mut_ptr().add(i * NR + l * LANES), sum) };
        }
    }
}

/// `sums[i][l] += Σ_p pixel_i[offsets[p]] * w[p][l * 8..]` for each pixel of a
/// tile: a step's weights (the first `L` vectors of its [`NR`]) loaded once and
/// multiplied by each pixel's broadcast value. With `blocks_ahead`
/// ([`TileInput::blocks_ahead`]), every [`BLOCK`] steps ask for each pixel's next
/// block's line; with `prefetch`, each step asks for the weights
/// [`WEIGHTS_AHEAD`] steps on.
///
/// # Safety
/// As [`super::micro_kernel`] for these steps; AVX2 and FMA are available.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn steps<const L: usize>(
    sums: &mut [[__m256; L]; MR],
    (offsets, pixel): (&[u32], [*const f32; MR]),
    weights: *const f32,
    (prefetch, blocks_ahead): (bool, bool),
) {
    let mut acc = *sums;
    let mut w = weights;
    let chunk = if blocks_ahead {
        BLOCK
    } else {
        offsets.len().max(1)
    };
    let mut chunks = offsets.chunks(chunk).peekable();
    while let Some(chunk) = chunks.next() {
        if let (true, Some(next)) = (blocks_ahead, chunks.peek()) {
            for p in pixel {
                // A prefetch never faults.
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(next[0] as usize).cast::<i8>());
            }
        }
        for &offset in chunk {
            // SAFETY: the caller's contract: each step holds `NR` weights, and every
            // pixel's value at this offset is readable.
            unsafe {
                if prefetch {
                    _mm_prefetch::<_MM_HINT_T0>(w.wrapping_add(WEIGHTS_AHEAD * NR).cast::<i8>());
                }
                let ws: [__m256; L] = std::array::from_fn(|l| _mm256_loadu_ps(w.add(l * LANES)));
                for (i, row) in acc.iter_mut().enumerate() {
                    let x = _mm256_broadcast_ss(&*pixel[i].add(offset as usize));
                    for (sum, &wv) in row.iter_mut().zip(&ws) {
                        *sum = _mm256_fmadd_ps(x, wv, *sum);
                    }
                }
                w = w.add(NR);
            }
        }
    }
    *sums = acc;
}

/// [`RegisterFinish::apply`] on 8 lanes: the lanes' first channel is `channel`
/// (of the pointers' channels), and their residual lies `at` floats on from the
/// residual pointer.
///
/// # Safety
/// AVX2 and FMA are available; every pointer holds those 8 lanes' values.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn apply(finish: &RegisterFinish, x: __m256, channel: usize, at: isize) -> __m256 {
    use crate::gemm::activate_lanes_avx2 as activate;
    // SAFETY: the caller's contract.
    unsafe {
        let mut x = x;
        if let Some(bias) = finish.bias {
            x = _mm256_add_ps(x, _mm256_loadu_ps(bias.add(channel)));
        }
        if let Some(a) = finish.activation {
            x = activate(x, a);
        }
        if let Some(residual) = finish.residual {
            x = _mm256_add_ps(x, _mm256_loadu_ps(residual.wrapping_offset(at)));
        }
        if let Some((scale, shift, post)) = finish.affine {
            let (s, t) = (
                _mm256_loadu_ps(scale.add(channel)),
                _mm256_loadu_ps(shift.add(channel)),
            );
            x = _mm256_fmadd_ps(x, s, t);
            if let Some(a) = post {
                x = activate(x, a);
            }
        }
        x
    }
}

/// [`super::store_blocked`] on AVX2: a tile's `valid` pixels (`[pixel][channel]`,
/// [`NR`] a pixel, from channel `c0`) into its block, `lanes` (16 or 8) a pixel at
/// `out + at + i * lanes`, through `finish` (its residual at `out`).
///
/// # Safety
/// As [`super::store_blocked`], with AVX2 and FMA in place of AVX-512F; `lanes` is
/// 8 or 16.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn store_blocked(
    tile: &[f32],
    (out, at): (*mut f32, usize),
    (valid, c0, lanes): (usize, usize, usize),
    finish: Option<&RegisterFinish>,
) {
    debug_assert!(lanes == NR || lanes == HALF);
    for i in 0..valid {
        let to = at + i * lanes;
        for l in (0..lanes).step_by(LANES) {
            // SAFETY: the tile holds MR rows of NR floats; the caller's contract
            // for the rest.
            unsafe {
                let v = _mm256_loadu_ps(tile.as_ptr().add(i * NR + l));
                let v = match finish {
                    Some(f) => apply(f, v, c0 + l, (to + l) as isize),
                    None => v,
                };
                _mm256_storeu_ps(out.add(to + l), v);
            }
        }
    }
}
