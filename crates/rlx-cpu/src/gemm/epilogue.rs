//! The GEMM epilogue, `post((act(v * alpha + bias[j] + row_bias[i]) + residual[i, j]) *
//! scale[i] + shift[i])`, applied to a block
//! of `C` once its last `K` block is done, while the block is still in L2: per row,
//! one plain loop per step.

use super::{Activation, Gemm};
use crate::vmath::{self, multiversion};

/// Applies `g`'s epilogue to `C[rows, cols]` in place.
///
/// # Safety
/// The region of `C`, the bias (`n` values) and the residual must be valid.
pub(super) unsafe fn apply(g: &Gemm, rows: std::ops::Range<usize>, cols: std::ops::Range<usize>) {
    let e = &g.epilogue;
    for i in rows {
        // SAFETY: row `i`, columns `cols`, of C.
        let out =
            unsafe { std::slice::from_raw_parts_mut(g.c.add(i * g.ldc + cols.start), cols.len()) };
        // SAFETY: the bias has `n` values.
        let bias = e
            .bias
            .map(|b| unsafe { std::slice::from_raw_parts(b.add(cols.start), cols.len()) });
        // SAFETY: the residual is m x n with row stride `ld`.
        let residual = e.residual.map(|(r, ld)| unsafe {
            std::slice::from_raw_parts(r.add(i * ld + cols.start), cols.len())
        });
        // SAFETY: the row bias has `m` values.
        let shift = e.row_bias.map_or(0.0, |b| unsafe { *b.add(i) });
        // SAFETY: the scales and shifts have `m` values.
        let affine = e.row_affine.map(|(scale, shift, activation)| unsafe {
            RowAffine {
                scale: *scale.add(i),
                shift: *shift.add(i),
                activation,
            }
        });
        row(out, e.alpha, bias, shift, e.activation, residual, affine);
    }
}

/// Whether `g` has an epilogue that can run on each 16-wide tile right after the
/// AVX2 micro-kernel stored it ([`tile_avx2`]): no scale, ReLU or the exact GELU first and
/// ReLU at most after the affine (the other activations stay with the block pass).
pub(super) fn per_tile_avx2(g: &Gemm, nr: usize) -> bool {
    let e = &g.epilogue;
    if e.is_identity() {
        return false;
    }
    let simple = |a: Option<Activation>| matches!(a, None | Some(Activation::Relu));
    #[cfg(target_arch = "x86_64")]
    let avx2 = nr == 16 && crate::vmath::simd_level() >= 1;
    #[cfg(not(target_arch = "x86_64"))]
    let avx2 = false;
    let first = |a: Option<Activation>| simple(a) || a == Some(Activation::Gelu);
    avx2 && e.alpha == 1.0
        && first(e.activation)
        && e.row_affine.is_none_or(|(_, _, post)| simple(post))
}

/// Asks for the cache lines of the epilogue's residual under the `rows x 16` tile at
/// `(i0, j0)`, if it has a residual, so that they arrive while the tile before it
/// multiplies (a 1x1 convolution with a residual: -8 to -11% on the layer,
/// alternating runs). Rows past the end of `C` are only prefetched, which never
/// faults.
#[inline(always)]
pub(super) fn prefetch_residual(g: &Gemm, (i0, j0): (usize, usize), rows: usize) {
    #[cfg(target_arch = "x86_64")]
    if let Some((r, ld)) = g.epilogue.residual {
        use std::arch::x86_64::{_MM_HINT_T0, _mm_prefetch};
        for i in i0..i0 + rows {
            let row = r.wrapping_add(i * ld + j0);
            // SAFETY: a prefetch reads nothing architecturally and never faults.
            unsafe {
                _mm_prefetch::<_MM_HINT_T0>(row.cast::<i8>());
                _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(15).cast::<i8>());
            }
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (g, i0, j0, rows);
}

/// Applies `g`'s epilogue (one [`per_tile_avx2`] accepts) to the `rows x 16` tile of
/// `C` at `(i0, j0)`, in registers: the same steps in the same order as [`row`], so
/// the values are the same.
///
/// # Safety
/// AVX2 must be available; the tile (and its bias, residual and per-row values) must
/// lie inside their operands.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn tile_avx2(g: &Gemm, (i0, j0): (usize, usize), rows: usize) {
    use std::arch::x86_64::*;
    let e = &g.epilogue;
    let zero = _mm256_setzero_ps();
    // `max(0, v)` gives `v` when it is NaN, as the scalar ReLU does.
    let relu = |v: __m256| _mm256_max_ps(zero, v);
    // SAFETY: per the contract, every pointer below stays inside its operand.
    unsafe {
        let bias = e
            .bias
            .map(|b| (_mm256_loadu_ps(b.add(j0)), _mm256_loadu_ps(b.add(j0 + 8))));
        for i in i0..i0 + rows {
            let c = g.c.add(i * g.ldc + j0);
            let (mut v0, mut v1) = (_mm256_loadu_ps(c), _mm256_loadu_ps(c.add(8)));
            if let Some((b0, b1)) = bias {
                v0 = _mm256_add_ps(v0, b0);
                v1 = _mm256_add_ps(v1, b1);
            }
            if let Some(rb) = e.row_bias {
                let s = _mm256_set1_ps(*rb.add(i));
                v0 = _mm256_add_ps(v0, s);
                v1 = _mm256_add_ps(v1, s);
            }
            match e.activation {
                None => {}
                Some(Activation::Gelu) => {
                    v0 = crate::vmath::gelu_avx2(v0);
                    v1 = crate::vmath::gelu_avx2(v1);
                }
                Some(_) => {
                    v0 = relu(v0);
                    v1 = relu(v1);
                }
            }
            if let Some((r, ld)) = e.residual {
                let r = r.add(i * ld + j0);
                v0 = _mm256_add_ps(v0, _mm256_loadu_ps(r));
                v1 = _mm256_add_ps(v1, _mm256_loadu_ps(r.add(8)));
            }
            if let Some((scale, shift, post)) = e.row_affine {
                let (a, b) = (_mm256_set1_ps(*scale.add(i)), _mm256_set1_ps(*shift.add(i)));
                v0 = _mm256_add_ps(_mm256_mul_ps(v0, a), b);
                v1 = _mm256_add_ps(_mm256_mul_ps(v1, a), b);
                if post.is_some() {
                    v0 = relu(v0);
                    v1 = relu(v1);
                }
            }
            _mm256_storeu_ps(c, v0);
            _mm256_storeu_ps(c.add(8), v1);
        }
    }
}

/// `act(v + shift) + residual`, then `affine`, over `out` in place: the epilogue for
/// values a kernel stored itself (a convolution compacting its output rows, `shift`
/// its channel's bias).
pub(crate) fn activate_and_add(
    out: &mut [f32],
    shift: f32,
    activation: Option<Activation>,
    residual: Option<&[f32]>,
    affine: Option<RowAffine>,
) {
    row(out, 1.0, None, shift, activation, residual, affine);
}

/// What follows the residual in a row: `post(v * scale + shift)` (a batch norm and
/// activation after a residual add, one scale and shift per row of `C`).
#[derive(Clone, Copy, Debug)]
pub(crate) struct RowAffine {
    pub scale: f32,
    pub shift: f32,
    pub activation: Option<Activation>,
}

multiversion! {
    /// One row of the epilogue, one plain loop per step over the row (still in L1):
    /// each vectorizes on its own. The activation loops call the math directly; a
    /// closure or function value passed down was called per value, without this
    /// version's instruction set (an exact GELU ran at a sixth of its speed). A
    /// convolution's two common epilogues take one loop for all their steps (the
    /// same operations in the same order, so the same values).
    fn row(
        out: &mut [f32],
        alpha: f32,
        bias: Option<&[f32]>,
        shift: f32,
        activation: Option<Activation>,
        residual: Option<&[f32]>,
        affine: Option<RowAffine>
    ) {
        let plain = alpha == 1.0 && bias.is_none();
        let relu = |v: f32| {
            let v = v + 0.0;
            if v < 0.0 { 0.0 } else { v }
        };
        match (residual, affine) {
            // The channel's bias, then a ReLU.
            (None, None) if plain && activation == Some(Activation::Relu) => {
                for x in out.iter_mut() {
                    *x = relu(*x * alpha + shift);
                }
                return;
            }
            // The residual, then the channel's affine and a ReLU (a batch norm after
            // a residual block).
            (Some(residual), Some(a))
                if plain
                    && shift == 0.0
                    && activation.is_none()
                    && a.activation == Some(Activation::Relu) =>
            {
                for (x, &r) in out.iter_mut().zip(residual) {
                    *x = relu((*x + r) * a.scale + a.shift);
                }
                return;
            }
            _ => {}
        }
        match bias {
            Some(bias) => {
                for (x, &b) in out.iter_mut().zip(bias) {
                    *x = *x * alpha + b + shift;
                }
            }
            None if alpha != 1.0 || shift != 0.0 => {
                for x in out.iter_mut() {
                    *x = *x * alpha + shift;
                }
            }
            None => {}
        }
        activate(out, activation);
        if let Some(residual) = residual {
            for (x, &r) in out.iter_mut().zip(residual) {
                *x += r;
            }
        }
        if let Some(a) = affine {
            for x in out.iter_mut() {
                *x = *x * a.scale + a.shift;
            }
            activate(out, a.activation);
        }
    }
}

/// Per-lane steps after the residual: `post(v * scale[j] + shift[j])` for lane `j`.
pub(crate) type LaneAffine<'a> = (&'a [f32], &'a [f32], Option<Activation>);

/// The epilogue of [`activate_and_add`] over channel-blocked values: `out` holds
/// pixels of `lanes` channels each (one block), and `shift` and `affine` hold one
/// value per lane: `act(v + shift[j]) + residual`, then `affine`.
pub(crate) fn activate_and_add_lanes(
    out: &mut [f32],
    shift: Option<&[f32]>,
    activation: Option<Activation>,
    residual: Option<&[f32]>,
    affine: Option<LaneAffine>,
) {
    lanes(out, shift, activation, residual, affine);
}

multiversion! {
    /// [`activate_and_add_lanes`], one version per instruction set; the steps in
    /// the order [`row`] takes them.
    fn lanes(
        out: &mut [f32],
        shift: Option<&[f32]>,
        activation: Option<Activation>,
        residual: Option<&[f32]>,
        affine: Option<LaneAffine>
    ) {
        if let Some(shift) = shift {
            for pixel in out.chunks_exact_mut(shift.len().max(1)) {
                for (x, &s) in pixel.iter_mut().zip(shift) {
                    *x += s;
                }
            }
        }
        activate(out, activation);
        if let Some(residual) = residual {
            for (x, &r) in out.iter_mut().zip(residual) {
                *x += r;
            }
        }
        if let Some((scale, shift, post)) = affine {
            for pixel in out.chunks_exact_mut(scale.len().max(1)) {
                for ((x, &a), &b) in pixel.iter_mut().zip(scale).zip(shift) {
                    *x = *x * a + b;
                }
            }
            activate(out, post);
        }
    }
}

/// Stores `post(v * scale + shift)` of `affine` for each value of `row` as row `r`
/// of a `k`-row matrix packed into `nr`-column panels, zero past its end: a
/// convolution's input prologue, applied as the input is packed (one pass).
pub(crate) fn affine_scatter_row(
    row: &[f32],
    layout: (usize, usize, usize),
    panels: &mut [f32],
    affine: RowAffine,
) {
    scatter_row(row, layout, panels, affine);
}

multiversion! {
    /// [`affine_scatter_row`], one version per instruction set.
    fn scatter_row(row: &[f32], layout: (usize, usize, usize), panels: &mut [f32], affine: RowAffine) {
        let (r, k, nr) = layout;
        let (scale, shift) = (affine.scale, affine.shift);
        for (q, values) in row.chunks(nr).enumerate() {
            let dst = &mut panels[(q * k + r) * nr..][..nr];
            let (piece, rest) = dst.split_at_mut(values.len());
            if affine.activation == Some(Activation::Relu) {
                // NaN passes through, as the scalar definition has it.
                for (d, &x) in piece.iter_mut().zip(values) {
                    let v = x * scale + shift;
                    *d = if v < 0.0 { 0.0 } else { v };
                }
            } else {
                for (d, &x) in piece.iter_mut().zip(values) {
                    *d = x * scale + shift;
                }
                activate(piece, affine.activation);
            }
            rest.fill(0.0);
        }
    }
}

/// `act` over `out` in place (inlined into each version of [`row`]).
#[inline(always)]
fn activate(out: &mut [f32], activation: Option<Activation>) {
    match activation {
        None => {}
        Some(Activation::Relu) => {
            // NaN passes through, as the scalar definition has it. The `+ 0.0`
            // (which only turns -0 into +0) keeps the compiler from storing just the
            // zeroed lanes of a value it reloaded: it did that with masked stores,
            // microcoded on AMD Zen, and the epilogue then took 40% as long as the
            // products.
            for x in out.iter_mut() {
                let v = *x + 0.0;
                *x = if v < 0.0 { 0.0 } else { v };
            }
        }
        Some(Activation::Gelu) => {
            for x in out.iter_mut() {
                *x = vmath::gelu(*x);
            }
        }
        Some(Activation::GeluTanh) => {
            for x in out.iter_mut() {
                *x = vmath::gelu_tanh(*x);
            }
        }
        Some(Activation::Silu) => vmath::silu_in_place(out),
        Some(Activation::Relu6) => {
            for x in out.iter_mut() {
                *x = vmath::relu6(*x);
            }
        }
        Some(Activation::HardSwish) => {
            for x in out.iter_mut() {
                *x = vmath::hard_swish(*x);
            }
        }
    }
}

/// Whether [`activate_lanes_avx512`] and [`activate_lanes_avx2`] compute
/// `activation` (the others run only in the scalar epilogue).
pub(crate) fn has_lanes_form(activation: Activation) -> bool {
    matches!(
        activation,
        Activation::Relu | Activation::Relu6 | Activation::HardSwish | Activation::Silu
    )
}

/// `activation` on 16 lanes, as [`activate_and_add`] computes it (NaN passing
/// through), for the activations [`has_lanes_form`] names; any other returns `x`.
///
/// # Safety
/// AVX-512F must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn activate_lanes_avx512(
    x: std::arch::x86_64::__m512,
    activation: Activation,
) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    let zero = _mm512_setzero_ps();
    // `max` and `min` return their second operand when one is NaN.
    let relu6 = |x: __m512| _mm512_min_ps(_mm512_set1_ps(6.0), _mm512_max_ps(zero, x));
    match activation {
        Activation::Relu => _mm512_max_ps(zero, _mm512_add_ps(x, zero)),
        Activation::Relu6 => relu6(x),
        Activation::HardSwish => _mm512_mul_ps(
            _mm512_mul_ps(x, relu6(_mm512_add_ps(x, _mm512_set1_ps(3.0)))),
            _mm512_set1_ps(1.0 / 6.0),
        ),
        // SAFETY: AVX-512F is available.
        Activation::Silu => unsafe { crate::vmath::logistic_lanes_avx512::<true>(x) },
        Activation::Gelu | Activation::GeluTanh => x,
    }
}

/// [`activate_lanes_avx512`] on 8 lanes, for AVX2 kernels: the same activations
/// ([`has_lanes_form`]), NaN passing through; any other returns `x`.
///
/// # Safety
/// AVX2 and FMA must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn activate_lanes_avx2(
    x: std::arch::x86_64::__m256,
    activation: Activation,
) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let zero = _mm256_setzero_ps();
    // `max` and `min` return their second operand when one is NaN.
    let relu6 = |x: __m256| _mm256_min_ps(_mm256_set1_ps(6.0), _mm256_max_ps(zero, x));
    match activation {
        Activation::Relu => _mm256_max_ps(zero, _mm256_add_ps(x, zero)),
        Activation::Relu6 => relu6(x),
        Activation::HardSwish => _mm256_mul_ps(
            _mm256_mul_ps(x, relu6(_mm256_add_ps(x, _mm256_set1_ps(3.0)))),
            _mm256_set1_ps(1.0 / 6.0),
        ),
        // SAFETY: AVX2 and FMA are available.
        Activation::Silu => unsafe { crate::vmath::logistic_lanes_avx2::<true>(x) },
        Activation::Gelu | Activation::GeluTanh => x,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_combination_of_steps_matches_the_scalar_formula() {
        let n = 53;
        let mut seed = 11u32;
        let mut next = || {
            seed = seed.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
            (seed >> 8) as f32 / (1 << 24) as f32 * 8.0 - 4.0
        };
        let start: Vec<f32> = (0..n).map(|_| next()).collect();
        let bias: Vec<f32> = (0..n).map(|_| next()).collect();
        let residual: Vec<f32> = (0..n).map(|_| next()).collect();
        let acts = [
            None,
            Some(Activation::Gelu),
            Some(Activation::GeluTanh),
            Some(Activation::Relu),
            Some(Activation::Silu),
            Some(Activation::Relu6),
            Some(Activation::HardSwish),
        ];
        for (act, alpha) in acts.into_iter().flat_map(|a| [(a, 0.75), (a, 1.0)]) {
            for with_bias in [false, true] {
                for with_residual in [false, true] {
                    for shift in [0.0, -0.375] {
                        let mut out = start.clone();
                        let (b, r) = (
                            with_bias.then_some(&bias[..]),
                            with_residual.then_some(&residual[..]),
                        );
                        row(&mut out, alpha, b, shift, act, r, None);
                        for j in 0..n {
                            let mut want =
                                start[j] * alpha + if with_bias { bias[j] } else { 0.0 } + shift;
                            want = match act {
                                None => want,
                                Some(Activation::Gelu) => vmath::gelu(want),
                                Some(Activation::GeluTanh) => vmath::gelu_tanh(want),
                                Some(Activation::Relu) => want.max(0.0),
                                Some(Activation::Silu) => vmath::silu(want),
                                Some(Activation::Relu6) => want.clamp(0.0, 6.0),
                                Some(Activation::HardSwish) => {
                                    want * (want + 3.0).clamp(0.0, 6.0) / 6.0
                                }
                            };
                            want += if with_residual { residual[j] } else { 0.0 };
                            assert!(
                                (out[j] - want).abs() <= 1e-6 * (1.0 + want.abs()),
                                "{act:?} bias={with_bias} shift={shift} residual={with_residual} at {j}: {} vs {want}",
                                out[j]
                            );
                        }
                    }
                }
            }
        }
        // A residual, then a channel affine and a ReLU (one loop for all three).
        let affine = RowAffine {
            scale: 1.5,
            shift: -0.25,
            activation: Some(Activation::Relu),
        };
        let mut out = start.clone();
        row(
            &mut out,
            1.0,
            None,
            0.0,
            None,
            Some(&residual),
            Some(affine),
        );
        for j in 0..n {
            let want = ((start[j] + residual[j]) * 1.5 - 0.25).max(0.0);
            assert_eq!(out[j], want, "residual, affine, relu at {j}");
        }
    }
}
