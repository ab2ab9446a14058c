//! The blocked depthwise kernel's rows on AVX2: a pixel's block of 16 channels is
//! two 8-lane vectors (a last block of 8, one), each output vector the sum of its
//! taps' input vectors times the taps' weights. A run of output pixels keeps its
//! sums in registers over all taps (12 vectors: 6 pixels of 16 channels or 12 of
//! 8). Runs whose taps all lie inside the input row check nothing; the others
//! take only the taps inside. Blocks are whole multiples of 8 lanes, so no load
//! or store needs a mask.

use super::{BLOCK, DepthwiseRow, FinishSteps};
use crate::gemm::Activation;
use std::arch::x86_64::*;

/// Lanes of an AVX2 vector.
const LANES: usize = 8;

/// Sums a run keeps in registers.
const SUMS: usize = 12;

/// A depthwise finish for one block of channels, applied to each output vector
/// as it is stored: the bias, activation and channel affine of the block's
/// channels (every activation with a vector form), and the residual at the output
/// row's place.
#[derive(Clone, Copy)]
pub(super) struct RowFinish {
    bias: Option<[f32; BLOCK]>,
    activation: Option<Activation>,
    affine: Option<([f32; BLOCK], [f32; BLOCK], Option<Activation>)>,
    residual: Option<*const f32>,
}

impl RowFinish {
    /// The steps' values for the `b` channels from `first` (zero past them).
    pub(super) fn new((bias, activation, affine): FinishSteps, (first, b): (usize, usize)) -> Self {
        let lanes = |values: &[f32]| -> [f32; BLOCK] {
            std::array::from_fn(|j| if j < b { values[first + j] } else { 0.0 })
        };
        RowFinish {
            bias: bias.map(lanes),
            activation,
            affine: affine.map(|(scale, shift, post)| (lanes(scale), lanes(shift), post)),
            residual: None,
        }
    }

    /// The same finish with the residual of an output row at `residual`.
    pub(super) fn with_residual(self, residual: Option<*const f32>) -> Self {
        RowFinish { residual, ..self }
    }

    /// The finished value of output vector `x`: lanes `l * 8..` of its pixel's
    /// block, `at` floats into the row.
    ///
    /// # Safety
    /// AVX2 and FMA are available; the residual row holds those 8 values.
    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn apply(&self, x: __m256, l: usize, at: usize) -> __m256 {
        use crate::gemm::activate_lanes_avx2 as activate;
        let lanes = l * LANES;
        // SAFETY (all): the caller's contract; each array holds 16 values.
        unsafe {
            let mut x = x;
            if let Some(bias) = &self.bias {
                x = _mm256_add_ps(x, _mm256_loadu_ps(bias.as_ptr().add(lanes)));
            }
            if let Some(a) = self.activation {
                x = activate(x, a);
            }
            if let Some(residual) = self.residual {
                x = _mm256_add_ps(x, _mm256_loadu_ps(residual.add(at)));
            }
            if let Some((scale, shift, post)) = &self.affine {
                let (s, t) = (
                    _mm256_loadu_ps(scale.as_ptr().add(lanes)),
                    _mm256_loadu_ps(shift.as_ptr().add(lanes)),
                );
                x = _mm256_fmadd_ps(x, s, t);
                if let Some(a) = *post {
                    x = activate(x, a);
                }
            }
            x
        }
    }
}

/// Output row `oy` of one blocked plane ([`super::depthwise_row`] on AVX2).
///
/// # Safety
/// AVX2 and FMA are available; `x` holds the plane's `h * w` pixels of
/// `geo.lanes` values (16 or 8), `weights` its `kh * kw` tap vectors ([`BLOCK`]
/// floats apart), and `row` the row's `ow` pixels; a finish's residual row holds
/// them too.
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn depthwise_row(
    x: *const f32,
    weights: &[f32],
    oy: usize,
    geo: DepthwiseRow,
    (row, finish): (&mut [f32], Option<&RowFinish>),
) {
    let taps = geo.tap_rows(oy);
    let out = (row.as_mut_ptr(), finish);
    // SAFETY: forwarded contract.
    unsafe {
        if geo.lanes == BLOCK {
            row_of::<2>(x, weights, taps, geo, out);
        } else {
            row_of::<1>(x, weights, taps, geo, out);
        }
    }
}

/// [`depthwise_row`] for blocks of `L` vectors: the left edge, the interior (runs
/// that check nothing), then the right edge, in runs of at most `SUMS / L` pixels.
///
/// # Safety
/// As [`depthwise_row`], `geo.lanes == L * 8`.
#[target_feature(enable = "avx2,fma")]
unsafe fn row_of<const L: usize>(
    x: *const f32,
    weights: &[f32],
    taps: (isize, (usize, usize)),
    geo: DepthwiseRow,
    out: (*mut f32, Option<&RowFinish>),
) {
    let span = SUMS / L;
    let (lo, hi) = geo.interior();
    // Each run's sums in exactly as many registers as it has pixels.
    macro_rules! runs {
        ($from:expr, $to:expr, $inside:literal) => {
            let mut ox = $from;
            while ox < $to {
                let count = span.min($to - ox);
                // SAFETY: the caller's contract; a run inside the interior reads
                // all its taps, any other only its taps inside the row.
                unsafe {
                    match count {
                        1 => run::<1, L, $inside>(x, weights, taps, ox, geo, out),
                        2 => run::<2, L, $inside>(x, weights, taps, ox, geo, out),
                        3 => run::<3, L, $inside>(x, weights, taps, ox, geo, out),
                        4 => run::<4, L, $inside>(x, weights, taps, ox, geo, out),
                        5 => run::<5, L, $inside>(x, weights, taps, ox, geo, out),
                        6 => run::<6, L, $inside>(x, weights, taps, ox, geo, out),
                        7 => run::<7, L, $inside>(x, weights, taps, ox, geo, out),
                        8 => run::<8, L, $inside>(x, weights, taps, ox, geo, out),
                        9 => run::<9, L, $inside>(x, weights, taps, ox, geo, out),
                        10 => run::<10, L, $inside>(x, weights, taps, ox, geo, out),
                        11 => run::<11, L, $inside>(x, weights, taps, ox, geo, out),
                        _ => run::<12, L, $inside>(x, weights, taps, ox, geo, out),
                    }
                }
                ox += count;
            }
        };
    }
    runs!(0, lo, false);
    runs!(lo, hi, true);
    runs!(hi.max(lo), geo.ow, false);
}

/// `R` output pixels from `ox` of a block of `L` vectors: their sums stay in
/// registers over all taps. `INSIDE`: every tap of every pixel lies inside the
/// row (no checks); otherwise each pixel takes only its taps inside.
///
/// # Safety
/// As [`depthwise_row`]; `R * L` is at most [`SUMS`]; with `INSIDE`, every tap of
/// pixels `ox..ox + R` lies inside the row.
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn run<const R: usize, const L: usize, const INSIDE: bool>(
    x: *const f32,
    weights: &[f32],
    (iy0, (ky_lo, ky_hi)): (isize, (usize, usize)),
    ox: usize,
    geo: DepthwiseRow,
    (out, finish): (*mut f32, Option<&RowFinish>),
) {
    let [dy, dx] = geo.dilation;
    let (sx, b) = (geo.stride[1], geo.lanes);
    let mut acc = [[_mm256_setzero_ps(); L]; R];
    for ky in ky_lo..ky_hi {
        let iy = (iy0 + (ky * dy) as isize) as usize;
        let row = x.wrapping_add(iy * geo.w * b);
        for kx in 0..geo.kw {
            // The input column of pixel `ox`'s tap (left of the row when negative).
            let first = (ox * sx + kx * dx) as isize - geo.left as isize;
            // SAFETY: the caller's contract (tap rows inside the plane, columns
            // inside the row, checked unless `INSIDE`); the weights hold a vector
            // of 16 per tap.
            unsafe {
                let tap = weights.as_ptr().add((ky * geo.kw + kx) * BLOCK);
                let w: [__m256; L] = std::array::from_fn(|l| _mm256_loadu_ps(tap.add(l * LANES)));
                for (r, sums) in acc.iter_mut().enumerate() {
                    let ix = first + (r * sx) as isize;
                    if INSIDE || (ix >= 0 && ix < geo.w as isize) {
                        let at = row.add(ix as usize * b);
                        for (l, sum) in sums.iter_mut().enumerate() {
                            let v = _mm256_loadu_ps(at.add(l * LANES));
                            *sum = _mm256_fmadd_ps(v, w[l], *sum);
                        }
                    }
                }
            }
        }
    }
    for (r, sums) in acc.iter().enumerate() {
        for (l, &sum) in sums.iter().enumerate() {
            let at = (ox + r) * b + l * LANES;
            // SAFETY: pixel `ox + r` of the row (and of the residual's row).
            unsafe {
                let value = match finish {
                    Some(f) => f.apply(sum, l, at),
                    None => sum,
                };
                _mm256_storeu_ps(out.add(at), value);
            }
        }
    }
}
