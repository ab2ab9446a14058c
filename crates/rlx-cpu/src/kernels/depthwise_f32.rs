//! `f32` depthwise convolutions: one input channel per group (MobileNet's and
//! EfficientNet's 3x3 and 5x5 layers, ConvNeXt's 7x7, any stride, dilation and
//! padding, any channel multiplier). A GEMM has nothing to reuse here (each output
//! channel reads one plane with a handful of weights), so each plane is a stencil
//! over a padded copy of its input staged in the thread's scratch. Pool tasks take
//! runs of output planes; the epilogue (bias, activation, residual, channel affine)
//! runs over the plane while it is in cache.
//!
//! With AVX-512 or AVX2 the copy is split by column stride phase (at stride 2, the
//! even columns then the odd ones), so that every tap of every output vector is one
//! contiguous load, and eight output vectors at a time keep their sums in registers
//! across all taps: one load and one multiply-add per tap and vector, one store per
//! vector. Elsewhere each output row is a sum of shifted staged rows scaled by the
//! tap's weight, vectorized along the row (strided rows are computed at every column
//! and their outputs picked).

use super::conv::extent;
use super::conv_pixels_f32::Finish;
use crate::pool::ThreadPool;
use crate::tensor::{Dst, Src};
use crate::vmath::multiversion;
use rlx_ir::{Result, Shape, Window2d};

/// Whether a convolution of `x` by `w` in `groups` groups is depthwise: every group
/// reads one input channel (`w` is `[groups * multiplier, 1, kh, kw]`).
pub(crate) fn applies(groups: usize, x: &Shape, w: &Shape) -> bool {
    groups > 1 && x.rank() == 4 && w.rank() == 4 && w.dim(1) == 1 && x.dim(1) == groups
}

/// The staged plane of one input channel: the padded input, `hp` rows of `wp`,
/// and room for the sums before they are stored (`full` values).
///
/// At unit stride the whole plane is one stencil over the padded plane read as one
/// long row: output `(y, x)` sums the staged values at `y * wp + x` plus each tap's
/// offset, so every tap is one long vectorized loop (the `wp - ow` sums past each
/// row's end are dropped when the rows are stored), however narrow the rows are
/// (a 7 x 7 plane is 7 rows of 7). Strided windows are computed a row at a time at
/// every column and the outputs' columns picked: twice the multiply-adds at stride
/// 2, all vectorized, instead of reading the input two columns apart.
#[derive(Clone, Copy)]
struct Staging {
    hp: usize,
    wp: usize,
    /// Sums computed before the outputs are picked or stored.
    full: usize,
}

impl Staging {
    fn new(win: &Window2d, x: &Shape, ow: usize) -> Staging {
        let [top, left, bottom, _] = win.padding;
        let sx = win.stride[1].max(1);
        let oh = extent(win, 0, x.dim(2));
        let wp_min = left + x.dim(3);
        // Every column a tap reads: the last output's last tap.
        let span_w = (ow.max(1) - 1) * sx + (win.kernel[1] - 1) * win.dilation[1] + 1;
        let wp = span_w.max(wp_min);
        let full = if win.stride == [1, 1] {
            (oh.max(1) - 1) * wp + ow
        } else {
            (ow.max(1) - 1) * sx + 1
        };
        Staging {
            hp: top + x.dim(2) + bottom,
            wp,
            full,
        }
    }

    fn len(&self) -> usize {
        self.hp * self.wp + self.full
    }
}

/// Per-thread floats a depthwise convolution of `x` needs (its staged plane and
/// the sums before they are stored).
pub(crate) fn thread_floats(win: &Window2d, x: &Shape) -> usize {
    let (oh, ow) = (extent(win, 0, x.dim(2)), extent(win, 1, x.dim(3)));
    let lanes = if super::depthwise_lanes_f32::applies(win, x, [oh, ow]) {
        super::depthwise_lanes_f32::thread_floats(win, x)
    } else {
        0
    };
    Staging::new(win, x, ow)
        .len()
        .max(Phased::new(win, x, ow).len())
        .max(lanes)
}

/// The input plane split by column stride phase, for [`plane_avx512`]: phase `px`
/// holds the padded plane's columns `px, px + sx, px + 2 sx, ...`, `hp` rows of `wq`,
/// so output column `x`'s tap at padded column `x sx + kx dx` is column
/// `x + kx dx / sx` of phase `kx dx % sx`: contiguous across a vector of outputs.
#[derive(Clone, Copy)]
struct Phased {
    hp: usize,
    wq: usize,
    sx: usize,
}

impl Phased {
    fn new(win: &Window2d, x: &Shape, ow: usize) -> Phased {
        let [top, left, bottom, _] = win.padding;
        let sx = win.stride[1].max(1);
        let span_w = (ow.max(1) - 1) * sx + (win.kernel[1].max(1) - 1) * win.dilation[1] + 1;
        let wp = span_w.max(left + x.dim(3));
        Phased {
            hp: top + x.dim(2) + bottom,
            wq: wp.div_ceil(sx),
            sx,
        }
    }

    fn plane_len(&self) -> usize {
        self.hp * self.wq
    }

    /// Floats of the phases and of [`PHASED_SLACK`] after them.
    fn len(&self) -> usize {
        self.sx * self.plane_len() + PHASED_SLACK
    }

    /// Offset of tap `(ky, kx)` from its output row's first staged value.
    fn tap_offset(&self, win: &Window2d, ky: usize, kx: usize) -> usize {
        let (col, sx) = (kx * win.dilation[1], self.sx);
        (col % sx) * self.plane_len() + ky * win.dilation[0] * self.wq + col / sx
    }
}

/// Copies one input plane (`h x w`) into its column phases (see [`Phased`]), zero
/// in the padding.
fn stage_phases(
    src: &[f32],
    (h, w): (usize, usize),
    win: &Window2d,
    ph: Phased,
    staged: &mut [f32],
) {
    let [top, left, _, _] = win.padding;
    let (sx, wq) = (ph.sx, ph.wq);
    let plane_len = ph.plane_len();
    if w == 0 {
        // All padding (an empty input row has no chunks to walk).
        staged[..sx * plane_len].fill(0.0);
        return;
    }
    // Phase `px`'s columns `first..end` hold input columns (padded column `j sx + px`
    // inside `left..left + w`), from input column `first sx + px - left` on.
    let span = |px: usize| {
        let end = (left + w).saturating_sub(px).div_ceil(sx).min(wq);
        let first = left.saturating_sub(px).div_ceil(sx).min(end);
        (first, end)
    };
    #[cfg(target_arch = "x86_64")]
    if sx == 1 && crate::isa::isa().avx512f {
        // SAFETY: AVX-512F was detected; `staged` holds the one phase plane.
        unsafe { stage_rows_avx512(src, (h, w), (top, left), wq, &mut staged[..plane_len]) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if sx == 1 && crate::isa::isa().avx2_fma {
        // SAFETY: AVX2 was detected; `staged` holds the one phase plane.
        unsafe { stage_rows_avx2(src, (h, w), (top, left), wq, &mut staged[..plane_len]) };
        return;
    }
    for plane in staged.chunks_exact_mut(plane_len).take(sx) {
        plane[..top * wq].fill(0.0);
        plane[(top + h) * wq..].fill(0.0);
    }
    #[cfg(target_arch = "x86_64")]
    if sx == 2 && (crate::isa::isa().avx512f || crate::isa::isa().avx2_fma) {
        // Input column 0 sits at padded column `left`: the even input columns go to
        // phase `left % 2`, the odd ones to the other, both from one read of the row.
        let (p0, p1) = staged.split_at_mut(plane_len);
        let p1 = &mut p1[..plane_len];
        let (even_px, odd_px) = (left % 2, 1 - left % 2);
        let (even_plane, odd_plane) = if even_px == 0 { (p0, p1) } else { (p1, p0) };
        let (even_span, odd_span) = (span(even_px), span(odd_px));
        for (i, row) in src.chunks_exact(w).take(h).enumerate() {
            let at = (top + i) * wq;
            let evens = &mut even_plane[at..at + wq];
            let odds = &mut odd_plane[at..at + wq];
            evens[..even_span.0].fill(0.0);
            evens[even_span.1..].fill(0.0);
            odds[..odd_span.0].fill(0.0);
            odds[odd_span.1..].fill(0.0);
            let (evens, odds) = (
                &mut evens[even_span.0..even_span.1],
                &mut odds[odd_span.0..odd_span.1],
            );
            // SAFETY: AVX-512F, else AVX2, was detected.
            unsafe {
                if crate::isa::isa().avx512f {
                    split_pairs_avx512(row, evens, odds)
                } else {
                    split_pairs_avx2(row, evens, odds)
                }
            };
        }
        return;
    }
    for (px, plane) in staged.chunks_exact_mut(plane_len).take(sx).enumerate() {
        let (first, end) = span(px);
        for (i, row) in src.chunks_exact(w).take(h).enumerate() {
            let dst = &mut plane[(top + i) * wq..(top + i + 1) * wq];
            dst[..first].fill(0.0);
            dst[end..].fill(0.0);
            if first < end {
                let from = first * sx + px - left;
                strided_copy(&row[from..], sx, &mut dst[first..end]);
            }
        }
    }
}

/// The padded plane at unit column stride, in vectors: each input row copied to its
/// place between zeroed padding (a row of MobileNet's 14 x 14 planes was three
/// library calls, a copy and two fills, for 16 values), and the padding rows zeroed.
///
/// # Safety
/// AVX-512F must be available; `src` holds `h` rows of `w`, and the padded plane
/// (`top` rows above, `left` columns before each row) fits `wq` columns.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn stage_rows_avx512(
    src: &[f32],
    (h, w): (usize, usize),
    (top, left): (usize, usize),
    wq: usize,
    staged: &mut [f32],
) {
    use crate::vmath::first_lanes;
    use std::arch::x86_64::*;
    debug_assert!(left + w <= wq && src.len() >= h * w);
    let zero = _mm512_setzero_ps();
    // SAFETY (both closures): every store's lanes lie inside `line`, every load's
    // inside `row`.
    let zeros = |line: *mut f32, len: usize| {
        for j in (0..len).step_by(16) {
            unsafe { _mm512_mask_storeu_ps(line.add(j), first_lanes(len - j), zero) };
        }
    };
    for (r, line) in staged.chunks_exact_mut(wq).enumerate() {
        let line = line.as_mut_ptr();
        let Some(i) = r.checked_sub(top).filter(|&i| i < h) else {
            zeros(line, wq);
            continue;
        };
        let row = src[i * w..][..w].as_ptr();
        zeros(line, left);
        for j in (0..w).step_by(16) {
            let lanes = first_lanes(w - j);
            unsafe {
                let values = _mm512_maskz_loadu_ps(lanes, row.add(j));
                _mm512_mask_storeu_ps(line.add(left + j), lanes, values);
            }
        }
        zeros(line.wrapping_add(left + w), wq - left - w);
    }
}

/// `evens[t] = row[2 t]` and `odds[t] = row[2 t + 1]`, as many as each holds (and
/// `row` has), from one pass over `row` in vectors of 32.
///
/// # Safety
/// AVX-512F must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn split_pairs_avx512(row: &[f32], evens: &mut [f32], odds: &mut [f32]) {
    use std::arch::x86_64::*;
    let even_index = _mm512_setr_epi32(0, 2, 4, 6, 8, 10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30);
    let odd_index = _mm512_setr_epi32(1, 3, 5, 7, 9, 11, 13, 15, 17, 19, 21, 23, 25, 27, 29, 31);
    let n_even = evens.len().min(row.len().div_ceil(2));
    let n_odd = odds.len().min(row.len() / 2);
    let mut t = 0;
    while t < n_even.max(n_odd) {
        // `t < ceil(len / 2)`, so `2 t` is inside the row.
        let have = (row.len() - 2 * t).min(32);
        // SAFETY: the masks cover values inside the slices only.
        unsafe {
            let lo =
                _mm512_maskz_loadu_ps(crate::vmath::first_lanes(have), row.as_ptr().add(2 * t));
            let hi = _mm512_maskz_loadu_ps(
                crate::vmath::first_lanes(have.saturating_sub(16)),
                row.as_ptr().wrapping_add(2 * t + 16),
            );
            let even_mask = crate::vmath::first_lanes(n_even.saturating_sub(t));
            let odd_mask = crate::vmath::first_lanes(n_odd.saturating_sub(t));
            _mm512_mask_storeu_ps(
                evens.as_mut_ptr().wrapping_add(t),
                even_mask,
                _mm512_permutex2var_ps(lo, even_index, hi),
            );
            _mm512_mask_storeu_ps(
                odds.as_mut_ptr().wrapping_add(t),
                odd_mask,
                _mm512_permutex2var_ps(lo, odd_index, hi),
            );
        }
        t += 16;
    }
}

/// [`split_pairs_avx512`] in AVX2 vectors: 16 values of the row at a time, the
/// last ones loaded and stored under masks.
///
/// # Safety
/// AVX2 must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn split_pairs_avx2(row: &[f32], evens: &mut [f32], odds: &mut [f32]) {
    use crate::vmath::first_lanes_avx2 as lanes;
    use std::arch::x86_64::*;
    let n_even = evens.len().min(row.len().div_ceil(2));
    let n_odd = odds.len().min(row.len() / 2);
    let mut t = 0;
    while t < n_even.max(n_odd) {
        // `t < ceil(len / 2)`, so `2 t` is inside the row.
        let have = row.len() - 2 * t;
        // SAFETY: the masks cover values inside the slices only.
        unsafe {
            let at = row.as_ptr().add(2 * t);
            let (lo, hi) = if have >= 16 {
                (_mm256_loadu_ps(at), _mm256_loadu_ps(at.add(8)))
            } else {
                (
                    _mm256_maskload_ps(at, lanes(have)),
                    _mm256_maskload_ps(at.wrapping_add(8), lanes(have.saturating_sub(8))),
                )
            };
            // Within each 128-bit half: lo's two evens then hi's; the 64-bit
            // quarters then go in order 0, 2, 1, 3.
            let even = _mm256_shuffle_ps::<0b10_00_10_00>(lo, hi);
            let odd = _mm256_shuffle_ps::<0b11_01_11_01>(lo, hi);
            let even = _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(
                even,
            )));
            let odd = _mm256_castpd_ps(_mm256_permute4x64_pd::<0b11_01_10_00>(_mm256_castps_pd(
                odd,
            )));
            let (e, o) = (n_even.saturating_sub(t), n_odd.saturating_sub(t));
            let (e_at, o_at) = (
                evens.as_mut_ptr().wrapping_add(t),
                odds.as_mut_ptr().wrapping_add(t),
            );
            if e >= 8 {
                _mm256_storeu_ps(e_at, even);
            } else if e > 0 {
                _mm256_maskstore_ps(e_at, lanes(e), even);
            }
            if o >= 8 {
                _mm256_storeu_ps(o_at, odd);
            } else if o > 0 {
                _mm256_maskstore_ps(o_at, lanes(o), odd);
            }
        }
        t += 8;
    }
}

/// `dst[j] = src[j * step]`.
fn strided_copy(src: &[f32], step: usize, dst: &mut [f32]) {
    if step == 1 {
        dst.copy_from_slice(&src[..dst.len()]);
    } else {
        for (j, v) in dst.iter_mut().enumerate() {
            *v = src[j * step];
        }
    }
}

/// Floats after the staged phases that [`plane_avx2`] may read: a row's last
/// vector reads whole vectors, at most 7 values past the row's last column (see
/// [`Phased`]), and the last row's past the phases. Those lanes' sums are never
/// stored.
const PHASED_SLACK: usize = 8;

/// The most taps [`plane_avx512`] takes (their offsets live on the stack); larger
/// windows take the row-sum path.
const MAX_PHASED_TAPS: usize = 64;

/// Output vectors [`plane_avx512`] sums at once, each in its own register.
#[cfg(target_arch = "x86_64")]
const VECTORS_AT_ONCE: usize = 8;

/// Where the group of output vectors from `v` (of `vectors`, `LANES` outputs each,
/// rows cut into `ceil(ow / LANES)` of them) reads, from its row's first staged
/// value (`row_pitch` apart), and writes in the `ow`-wide plane; and how many of the
/// group's [`VECTORS_AT_ONCE`] there are (the rest stay 0).
#[cfg(target_arch = "x86_64")]
fn group_places<const LANES: usize>(
    v: usize,
    vectors: usize,
    (ow, row_pitch): (usize, usize),
) -> ([usize; VECTORS_AT_ONCE], [usize; VECTORS_AT_ONCE], usize) {
    let per_row = ow.div_ceil(LANES);
    let (mut src, mut at) = ([0; VECTORS_AT_ONCE], [0; VECTORS_AT_ONCE]);
    let count = VECTORS_AT_ONCE.min(vectors - v);
    for i in 0..count {
        let (y, x) = ((v + i) / per_row, (v + i) % per_row * LANES);
        src[i] = y * row_pitch + x;
        at[i] = y * ow + x;
    }
    (src, at, count)
}

/// One output plane from its staged phases: every output row is cut into vectors of
/// 16 (the last one masked), and eight vectors at a time, from one row or several,
/// sum all taps in registers before one store each.
///
/// # Safety
/// AVX-512F must be available; `staged` holds the phases of [`Phased`] for this
/// window, `offsets` one [`Phased::tap_offset`] per weight, and `out` `oh x ow`
/// values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn plane_avx512(
    out: &mut [f32],
    staged: &[f32],
    weights: &[f32],
    offsets: &[usize],
    (oh, ow, row_pitch): (usize, usize, usize),
) {
    use std::arch::x86_64::*;
    debug_assert_eq!(weights.len(), offsets.len());
    let per_row = ow.div_ceil(16);
    let vectors = oh * per_row;
    let (base, dst) = (staged.as_ptr(), out.as_mut_ptr());
    let mut v = 0;
    while v < vectors {
        // Where each vector reads and writes, and its lanes; missing vectors load
        // and store nothing.
        let (src, at, count) = group_places::<16>(v, vectors, (ow, row_pitch));
        let mut mask = [0u16; VECTORS_AT_ONCE];
        for i in 0..count {
            mask[i] = crate::vmath::first_lanes(ow - at[i] % ow);
        }
        let mut acc = [_mm512_setzero_ps(); VECTORS_AT_ONCE];
        if mask == [u16::MAX; VECTORS_AT_ONCE] {
            for (&weight, &offset) in weights.iter().zip(offsets) {
                let wv = _mm512_set1_ps(weight);
                let at = base.wrapping_add(offset);
                for i in 0..VECTORS_AT_ONCE {
                    // SAFETY: every vector's 16 values lie inside the staged phase
                    // row the tap reads (see `Phased`).
                    let values = unsafe { _mm512_loadu_ps(at.add(src[i])) };
                    acc[i] = _mm512_fmadd_ps(values, wv, acc[i]);
                }
            }
        } else {
            for (&weight, &offset) in weights.iter().zip(offsets) {
                let wv = _mm512_set1_ps(weight);
                for i in 0..VECTORS_AT_ONCE {
                    // SAFETY: masked lanes lie inside the staged phase row the tap
                    // reads (see `Phased`); unmasked lanes are not read.
                    let values =
                        unsafe { _mm512_maskz_loadu_ps(mask[i], base.add(src[i] + offset)) };
                    acc[i] = _mm512_fmadd_ps(values, wv, acc[i]);
                }
            }
        }
        for i in 0..VECTORS_AT_ONCE {
            // SAFETY: the lanes of `mask[i]` lie inside output row `y`.
            unsafe { _mm512_mask_storeu_ps(dst.add(at[i]), mask[i], acc[i]) };
        }
        v += VECTORS_AT_ONCE;
    }
}

/// [`plane_avx512`] with AVX2 vectors of 8: eight output vectors at a time sum
/// every tap in registers. A row's last vector, when short, reads and sums whole
/// vectors (the values past the row are the next row's, or [`PHASED_SLACK`]) and is
/// stored whole where that stays in the plane: its extra lanes fall on the next
/// row's first values, which a later store of the same call writes (vectors are
/// stored in order); a vector that would run past the plane is stored under a mask.
///
/// # Safety
/// AVX2 and FMA must be available; as [`plane_avx512`], with `staged` holding
/// [`PHASED_SLACK`] values past the phases.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn plane_avx2(
    out: &mut [f32],
    staged: &[f32],
    weights: &[f32],
    offsets: &[usize],
    (oh, ow, row_pitch): (usize, usize, usize),
) {
    use std::arch::x86_64::*;
    debug_assert_eq!(weights.len(), offsets.len());
    debug_assert!(out.len() >= oh * ow);
    let per_row = ow.div_ceil(8);
    let vectors = oh * per_row;
    let (base, dst) = (staged.as_ptr(), out.as_mut_ptr());
    let mut v = 0;
    while v < vectors {
        // Missing vectors (past the plane) read the plane's first values and are
        // not stored.
        let (src, at, count) = group_places::<8>(v, vectors, (ow, row_pitch));
        let mut acc = [_mm256_setzero_ps(); VECTORS_AT_ONCE];
        for (&weight, &offset) in weights.iter().zip(offsets) {
            let wv = _mm256_set1_ps(weight);
            let at = base.wrapping_add(offset);
            for i in 0..VECTORS_AT_ONCE {
                // SAFETY: a vector's 8 values lie inside the staged phases and
                // their slack (see `PHASED_SLACK`).
                let values = unsafe { _mm256_loadu_ps(at.add(src[i])) };
                acc[i] = _mm256_fmadd_ps(values, wv, acc[i]);
            }
        }
        for i in 0..count {
            // A whole vector is stored where it fits in the plane (its lanes past
            // its row land on values a later store writes); one that would run
            // past the plane (its last vector, or any in a plane under 8 values)
            // keeps to the plane under a mask.
            let room = oh * ow - at[i];
            // SAFETY: the stored lanes lie inside the plane.
            unsafe {
                if room >= 8 {
                    _mm256_storeu_ps(dst.add(at[i]), acc[i]);
                } else {
                    let mask = crate::vmath::first_lanes_avx2(room);
                    _mm256_maskstore_ps(dst.add(at[i]), mask, acc[i]);
                }
            }
        }
        v += VECTORS_AT_ONCE;
    }
}

/// [`stage_rows_avx512`] in AVX2 vectors of 8: each line a vector at a time, its
/// row's values loaded under the mask of the lanes they cover (the others zero: the
/// padding). Library calls for a few values each cost more than the copy, and a
/// plain copy loop is turned into one.
///
/// # Safety
/// AVX2 must be available; as [`stage_rows_avx512`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn stage_rows_avx2(
    src: &[f32],
    (h, w): (usize, usize),
    (top, left): (usize, usize),
    wq: usize,
    staged: &mut [f32],
) {
    use std::arch::x86_64::*;
    debug_assert!(left + w <= wq && src.len() >= h * w);
    let index = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
    let line_tail = crate::vmath::first_lanes_avx2(wq % 8);
    let (below, end) = (_mm256_set1_epi32(-1), _mm256_set1_epi32(w as i32));
    let zero = _mm256_setzero_ps();
    for (r, line) in staged.chunks_exact_mut(wq).enumerate() {
        let line = line.as_mut_ptr();
        let row = r
            .checked_sub(top)
            .filter(|&i| i < h)
            .map(|i| src[i * w..].as_ptr());
        let mut k = 0;
        while k < wq {
            let values = match row {
                Some(row) => {
                    // Row columns `k - left ..` in this vector's lanes.
                    let columns =
                        _mm256_add_epi32(index, _mm256_set1_epi32(k as i32 - left as i32));
                    let inside = _mm256_and_si256(
                        _mm256_cmpgt_epi32(columns, below),
                        _mm256_cmpgt_epi32(end, columns),
                    );
                    // SAFETY: the lanes of `inside` are columns of the row; the
                    // others are not read.
                    unsafe { _mm256_maskload_ps(row.wrapping_add(k).wrapping_sub(left), inside) }
                }
                None => zero,
            };
            // SAFETY: the stored lanes lie inside `line`.
            unsafe {
                if k + 8 <= wq {
                    _mm256_storeu_ps(line.add(k), values);
                } else {
                    _mm256_maskstore_ps(line.add(k), line_tail, values);
                }
            }
            k += 8;
        }
    }
}

multiversion! {
    /// Output rows of one plane: `out[y][..] = Σ taps weight * staged row`, the taps
    /// in row-major order (each multiply-add rounded, the first tap a product).
    /// `staged` is the padded plane followed by room for the sums (`Staging::full`:
    /// the whole plane's at unit stride, one unstrided row's otherwise).
    fn plane(out: &mut [f32], staged: &mut [f32], weights: &[f32], geo: PlaneGeometry) {
        let PlaneGeometry { oh, ow, kh, kw, sy, sx, dy, dx, stage } = geo;
        let (staged, full) = staged.split_at_mut(stage.hp * stage.wp);
        if sx == 1 && sy == 1 {
            let acc = &mut full[..stage.full];
            let width = acc.len();
            for ky in 0..kh {
                for kx in 0..kw {
                    let start = ky * dy * stage.wp + kx * dx;
                    let src = &staged[start..start + width];
                    tap(acc, src, weights[ky * kw + kx], ky == 0 && kx == 0);
                }
            }
            for y in 0..oh {
                out[y * ow..(y + 1) * ow].copy_from_slice(&acc[y * stage.wp..y * stage.wp + ow]);
            }
            return;
        }
        for y in 0..oh {
            let acc: &mut [f32] = if sx == 1 {
                &mut out[y * ow..(y + 1) * ow]
            } else {
                &mut full[..stage.full]
            };
            let width = acc.len();
            for ky in 0..kh {
                let r = y * sy + ky * dy;
                for kx in 0..kw {
                    let start = r * stage.wp + kx * dx;
                    let src = &staged[start..start + width];
                    tap(acc, src, weights[ky * kw + kx], ky == 0 && kx == 0);
                }
            }
            if sx != 1 {
                for (v, &f) in out[y * ow..(y + 1) * ow].iter_mut().zip(full.iter().step_by(sx)) {
                    *v = f;
                }
            }
        }
    }
}

/// Adds `weight * src` into `acc`, or stores it for the first tap (inlined into
/// [`plane`]'s per-instruction-set copies).
#[inline(always)]
fn tap(acc: &mut [f32], src: &[f32], weight: f32, first: bool) {
    if first {
        for (v, &s) in acc.iter_mut().zip(src) {
            *v = weight * s;
        }
    } else {
        for (v, &s) in acc.iter_mut().zip(src) {
            *v += weight * s;
        }
    }
}

/// What [`plane`] needs to know of the window and output.
#[derive(Clone, Copy)]
struct PlaneGeometry {
    oh: usize,
    ow: usize,
    kh: usize,
    kw: usize,
    sy: usize,
    sx: usize,
    dy: usize,
    dx: usize,
    stage: Staging,
}

/// Copies one input plane (`h x w`) into the padded plane `staged`, zero in the
/// padding (only the padding is cleared).
fn stage_plane(
    src: &[f32],
    (h, w): (usize, usize),
    win: &Window2d,
    stage: Staging,
    staged: &mut [f32],
) {
    let [top, left, _, _] = win.padding;
    let wp = stage.wp;
    if w == 0 {
        // All padding (an empty input row has no chunks to walk).
        staged[..stage.hp * wp].fill(0.0);
        return;
    }
    staged[..top * wp].fill(0.0);
    staged[(top + h) * wp..stage.hp * wp].fill(0.0);
    for (i, row) in src.chunks_exact(w).take(h).enumerate() {
        let dst = &mut staged[(top + i) * wp..(top + i + 1) * wp];
        dst[..left].fill(0.0);
        dst[left..left + w].copy_from_slice(row);
        dst[left + w..].fill(0.0);
    }
}

/// The depthwise convolution: pool tasks take runs of output planes, the finish
/// applied to each plane as it is done.
pub(crate) fn conv2d(
    win: &Window2d,
    [x, w]: [Src; 2],
    finish: Finish,
    out: Dst,
    (gemm, pool): (&crate::gemm::GemmScratch, &ThreadPool),
) -> Result<()> {
    let [n, c, h, wd] = [
        x.shape.dim(0),
        x.shape.dim(1),
        x.shape.dim(2),
        x.shape.dim(3),
    ];
    let [o, oh, ow] = [out.shape.dim(1), out.shape.dim(2), out.shape.dim(3)];
    let pixels = oh * ow;
    if n == 0 || o == 0 || pixels == 0 {
        return Ok(());
    }
    if super::depthwise_lanes_f32::applies(win, x.shape, [oh, ow]) {
        return super::depthwise_lanes_f32::conv2d(win, [x, w], finish, out, (gemm, pool));
    }
    let multiplier = o / c.max(1);
    let taps = win.kernel[0] * win.kernel[1];
    let stage = Staging::new(win, x.shape, ow);
    let geo = PlaneGeometry {
        oh,
        ow,
        kh: win.kernel[0],
        kw: win.kernel[1],
        sy: win.stride[0],
        sx: win.stride[1],
        dy: win.dilation[0],
        dx: win.dilation[1],
        stage,
    };
    // SAFETY: f32 tensors of their lengths; the plan never places the output over
    // an operand.
    let (xs, ws) = unsafe {
        (
            std::slice::from_raw_parts(x.ptr.cast::<f32>(), x.len),
            std::slice::from_raw_parts(w.ptr.cast::<f32>(), w.len),
        )
    };
    let out_addr = out.ptr as usize;
    let residual_addr = finish.residual.map(|r| r.ptr as usize);
    let phased = Phased::new(win, x.shape, ow);
    let mut offsets = [0usize; MAX_PHASED_TAPS];
    let isa = crate::isa::isa();
    let use_phased = (isa.avx512f || isa.avx2_fma) && taps <= MAX_PHASED_TAPS;
    for ky in 0..win.kernel[0] {
        for kx in 0..win.kernel[1] {
            if let Some(slot) = offsets.get_mut(ky * win.kernel[1] + kx) {
                *slot = phased.tap_offset(win, ky, kx);
            }
        }
    }
    let offsets = &offsets[..taps.min(MAX_PHASED_TAPS)];
    // `restage`: whether the plane's input channel is not already staged (with a
    // channel multiplier, consecutive output planes read the same input).
    let per_channel = finish.per_channel();
    let one_plane = |plane_index: usize, thread: usize, restage: bool| {
        let (image, oc) = (plane_index / o, plane_index % o);
        let ic = oc / multiplier.max(1);
        let src = &xs[(image * c + ic) * h * wd..][..h * wd];
        let at = plane_index * pixels;
        // SAFETY: output plane `plane_index`; only this task writes it.
        let values =
            unsafe { std::slice::from_raw_parts_mut((out_addr as *mut f32).add(at), pixels) };
        let plane_weights = &ws[oc * taps..(oc + 1) * taps];
        // SAFETY: one task per thread index at a time.
        let scratch = unsafe { gemm.parts(thread) }.1;
        if use_phased {
            let staged = &mut scratch[..phased.len()];
            if restage {
                stage_phases(src, (h, wd), win, phased, staged);
            }
            let shape = (oh, ow, geo.sy * phased.wq);
            #[cfg(target_arch = "x86_64")]
            // SAFETY: AVX-512F, else AVX2 and FMA, was detected; the phases were
            // staged for this window and the offsets computed from them.
            unsafe {
                if isa.avx512f {
                    plane_avx512(values, staged, plane_weights, offsets, shape)
                } else {
                    plane_avx2(values, staged, plane_weights, offsets, shape)
                }
            };
        } else {
            let staged = &mut scratch[..stage.len()];
            if restage {
                stage_plane(src, (h, wd), win, stage, &mut staged[..stage.hp * stage.wp]);
            }
            plane(values, staged, plane_weights, geo);
        }
        // SAFETY: the residual has the output's shape.
        let residual = residual_addr
            .map(|a| unsafe { std::slice::from_raw_parts((a as *const f32).add(at), pixels) });
        per_channel.apply(oc, values, residual);
    };
    let planes = n * o;
    let threads = gemm.threads();
    // About eight tasks per thread, so small planes are not one task each.
    let tasks = planes.min(8 * threads);
    let task = |t: usize, thread: usize| {
        let range = t * planes / tasks..(t + 1) * planes / tasks;
        for plane_index in range.clone() {
            let restage = plane_index == range.start || (plane_index % o) % multiplier.max(1) == 0;
            one_plane(plane_index, thread, restage);
        }
    };
    pool.run(tasks, threads, &task)
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::*;

    type SplitFn = unsafe fn(&[f32], &mut [f32], &mut [f32]);

    /// Both vector forms of the stride-2 split against a plain one: rows shorter
    /// and longer than a step, of odd and even lengths, into outputs shorter than
    /// the row's halves (the padding's columns take the rest).
    #[test]
    fn split_pairs_match_a_plain_split() {
        let isa = crate::isa::Isa::hardware();
        for len in [0usize, 1, 2, 7, 15, 16, 17, 31, 32, 33, 57, 112] {
            let row: Vec<f32> = (0..len).map(|i: usize| i as f32 * 0.5 - 3.0).collect();
            for (even_len, odd_len) in [(len.div_ceil(2), len / 2), (len / 2, len / 2), (3, 1)] {
                let want_evens: Vec<f32> = row.iter().step_by(2).take(even_len).copied().collect();
                let want_odds: Vec<f32> = row
                    .iter()
                    .skip(1)
                    .step_by(2)
                    .take(odd_len)
                    .copied()
                    .collect();
                let mut kernels: Vec<SplitFn> = Vec::new();
                if isa.avx2_fma {
                    kernels.push(split_pairs_avx2);
                }
                if isa.avx512f {
                    kernels.push(split_pairs_avx512);
                }
                for split in kernels {
                    let (mut evens, mut odds) = (vec![f32::NAN; even_len], vec![f32::NAN; odd_len]);
                    // SAFETY: the kernel's instruction set was detected.
                    unsafe { split(&row, &mut evens, &mut odds) };
                    let n = want_evens.len();
                    assert_eq!(&evens[..n], &want_evens[..], "evens of {len}");
                    let n = want_odds.len();
                    assert_eq!(&odds[..n], &want_odds[..], "odds of {len}");
                }
            }
        }
    }
}
