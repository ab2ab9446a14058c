//! Fast `f32` math for the hot kernels: branch-free `exp` and `erf` written so the
//! compiler vectorizes loops over them, compiled once per instruction set and chosen
//! at run time. Accuracy is a few units in the last place of `f32` (tests bound it
//! against `f64`).

/// Defines `fn $name` whose body is compiled three times: for AVX-512, for AVX2+FMA and
/// for the baseline, and dispatches on the CPU at run time. The body should be plain
/// loops over slices that the compiler can vectorize.
macro_rules! multiversion {
    ($(#[$doc:meta])* fn $name:ident($($arg:ident: $ty:ty),*) $(-> $ret:ty)? $body:block) => {
        $(#[$doc])*
        fn $name($($arg: $ty),*) $(-> $ret)? {
            #[inline(always)]
            fn body($($arg: $ty),*) $(-> $ret)? $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f")]
                unsafe fn wide($($arg: $ty),*) $(-> $ret)? { body($($arg),*) }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn narrow($($arg: $ty),*) $(-> $ret)? { body($($arg),*) }
                match $crate::vmath::simd_level() {
                    // SAFETY: the level says the features are available.
                    2 => return unsafe { wide($($arg),*) },
                    // SAFETY: as above.
                    1 => return unsafe { narrow($($arg),*) },
                    _ => {}
                }
            }
            body($($arg),*)
        }
    };
}

pub(crate) use multiversion;

/// ln 2 split in a part exact in `f32` and the rest, for an exact range reduction in
/// [`exp`] and [`exp_nonpositive_avx2`].
const LN2_HI: f32 = 0.693_145_75;
const LN2_LO: f32 = 1.428_606_8e-6;
/// Adding and subtracting 1.5 * 2^23 rounds an `f32` to the nearest integer.
const ROUND: f32 = 12_582_912.0;
/// [`exp`] gives 0 at or below `EXP_MIN` and `+inf` above `EXP_MAX`.
const EXP_MIN: f32 = -87.33;
const EXP_MAX: f32 = 88.722_84;

/// `e^x` for `f32`, relative error below 2e-7; 0 below -87.33 and infinity past
/// `ln(f32::MAX)`.
#[inline(always)]
pub(crate) fn exp(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    let big = x > EXP_MAX;
    let x = x.clamp(EXP_MIN, EXP_MAX);
    let shifted = x * LOG2E + ROUND;
    let n = shifted - ROUND;
    let r = (x - n * LN2_HI) - n * LN2_LO;
    // e^r on |r| <= ln2/2: Taylor series to r^7.
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0
                    + r * (1.0 / 24.0
                        + r * (1.0 / 120.0 + r * (1.0 / 720.0 + r * (1.0 / 5040.0)))))));
    // 2^n as 2^h * 2^(n - h) with h = floor(n / 2): each half's biased exponent
    // (between 64 and 191 for n in -126..=128) goes straight into the exponent bits.
    // `shifted` is 1.5 * 2^23 + n, so its bits are those of 1.5 * 2^23 plus n: an
    // integer read that vectorizes (a float-to-int `as` cast saturates, and its NaN
    // and range checks kept the compiler from vectorizing callers on AVX2).
    let ni = (shifted.to_bits() as i32).wrapping_sub(ROUND.to_bits() as i32);
    let h = ni >> 1;
    let s1 = f32::from_bits(((h + 127) as u32) << 23);
    let s2 = f32::from_bits(((ni - h + 127) as u32) << 23);
    let value = p * s1 * s2;
    if x <= EXP_MIN {
        0.0
    } else if big {
        f32::INFINITY
    } else {
        value
    }
}

/// `tanh(x)` for `f32` from the fast `exp` (absolute error below 3e-7).
#[inline(always)]
pub(crate) fn tanh(x: f32) -> f32 {
    let ax = x.abs().min(9.0);
    let e = exp(-2.0 * ax);
    let wide = ((1.0 - e) / (1.0 + e)).copysign(x);
    // Near zero `1 - e` cancels; the Taylor series keeps the relative error small
    // (its first omitted term is below 1e-8 relative for |x| < 0.125).
    let x2 = x * x;
    let narrow = x * (1.0 + x2 * (-1.0 / 3.0 + x2 * (2.0 / 15.0 - x2 * (17.0 / 315.0))));
    let value = if ax < 0.125 { narrow } else { wide };
    if x.is_nan() { x } else { value }
}

/// Exact GELU, `x Φ(x)`, with `Φ` from [`erf`]: absolute error below
/// `2e-7 (1 + |x|)`.
#[inline(always)]
pub(crate) fn gelu(x: f32) -> f32 {
    0.5 * x * (1.0 + erf(x * std::f32::consts::FRAC_1_SQRT_2))
}

/// `erf(x)` as `x P(x²) / Q(x²)` on `|x| <= 3.92` (1 beyond, in `f32`): one division and
/// ten multiplies and adds, against the Abramowitz-Stegun form's two polynomials, exponential and division. The
/// fit's own error is 2e-8; rounding in `f32` brings it to 3.3e-7 absolute near 1
/// (where that form stays under 3e-7), which `gelu` scales by `|x| / 2`. The
/// coefficients are a weighted least-squares rational fit (Sanathanan-Koerner
/// iterations with Lawson reweighting) on 12000 points.
#[inline(always)]
pub(crate) fn erf(x: f32) -> f32 {
    let (p, q) = (ERF_P, ERF_Q);
    let x = x.clamp(-ERF_EDGE, ERF_EDGE);
    let z = x * x;
    let p = ((((p[5] * z + p[4]) * z + p[3]) * z + p[2]) * z + p[1]) * z + p[0];
    let q = ((((q[5] * z + q[4]) * z + q[3]) * z + q[2]) * z + q[1]) * z + q[0];
    x * p / q
}

/// Numerator coefficients of [`erf`], lowest power first.
const ERF_P: [f32; 6] = [
    std::f32::consts::FRAC_2_SQRT_PI,
    1.927_553_9e-1,
    5.305_882e-2,
    3.867_79e-3,
    2.874_392e-4,
    2.034_452_3e-6,
];
/// Denominator coefficients of [`erf`], lowest power first.
const ERF_Q: [f32; 6] = [
    1.0,
    5.041_567e-1,
    1.150_805_6e-1,
    1.517_127_7e-2,
    1.187_930_2e-3,
    3.806_556_6e-5,
];
/// Where [`erf`] clamps its argument (erf is 1 in `f32` beyond).
const ERF_EDGE: f32 = 3.92;

/// [`gelu`] on 8 lanes, with the same operations in the same order (so the same
/// values), for epilogues that run in registers.
///
/// # Safety
/// AVX2 and FMA must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
pub(crate) unsafe fn gelu_avx2(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    let c = _mm256_set1_ps;
    let poly = |k: [f32; 6], z: __m256| {
        let mut acc = c(k[5]);
        for &coefficient in k[..5].iter().rev() {
            acc = _mm256_add_ps(_mm256_mul_ps(acc, z), c(coefficient));
        }
        acc
    };
    let t = _mm256_mul_ps(x, c(std::f32::consts::FRAC_1_SQRT_2));
    // `max(lo, t)` then `min(hi, .)` keep a NaN (the second operand wins), as
    // `clamp` does.
    let t = _mm256_min_ps(c(ERF_EDGE), _mm256_max_ps(c(-ERF_EDGE), t));
    let z = _mm256_mul_ps(t, t);
    let erf = _mm256_div_ps(_mm256_mul_ps(t, poly(ERF_P, z)), poly(ERF_Q, z));
    _mm256_mul_ps(_mm256_mul_ps(c(0.5), x), _mm256_add_ps(c(1.0), erf))
}

/// Tanh-approximated GELU.
#[inline(always)]
pub(crate) fn gelu_tanh(x: f32) -> f32 {
    const C: f32 = 0.797_884_6; // sqrt(2 / pi)
    0.5 * x * (1.0 + tanh(C * (x + 0.044_715 * x * x * x)))
}

/// `x σ(x)`.
#[inline(always)]
pub(crate) fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// `min(max(x, 0), 6)`, NaN passing through (inlined into vectorized loops).
#[inline(always)]
pub(crate) fn relu6(x: f32) -> f32 {
    x.clamp(0.0, 6.0)
}

/// `x relu6(x + 3) / 6`, NaN passing through.
#[inline(always)]
pub(crate) fn hard_swish(x: f32) -> f32 {
    x * relu6(x + 3.0) * (1.0 / 6.0)
}

/// [`silu`] over `v` in place; with AVX-512 without a division (see
/// [`logistic_avx512`]), within 3e-7 of the exact value times `1 + |x|`.
pub(crate) fn silu_in_place(v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    match simd_level() {
        // SAFETY: AVX-512F is available.
        2 => return unsafe { logistic_avx512::<true>(v) },
        // SAFETY: AVX2 and FMA are available.
        1 => return unsafe { logistic_avx2::<true>(v) },
        _ => {}
    }
    for x in v {
        *x = silu(*x);
    }
}

/// `σ(x)` over `v` in place; as [`silu_in_place`].
pub(crate) fn sigmoid_in_place(v: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    match simd_level() {
        // SAFETY: AVX-512F is available.
        2 => return unsafe { logistic_avx512::<false>(v) },
        // SAFETY: AVX2 and FMA are available.
        1 => return unsafe { logistic_avx2::<false>(v) },
        _ => {}
    }
    for x in v {
        *x = 1.0 / (1.0 + exp(-*x));
    }
}

/// `σ(x)`, times `x` with `TIMES_X`, over `v`: `e^-x` as [`exp`] computes it (the
/// same split reduction and polynomial, the power of two by `vscalefps`), and
/// `1 / (1 + e^-x)` by a reciprocal estimate and one Newton step instead of a
/// division, whose latency otherwise sets the speed (a convolution's SiLU epilogue
/// took as long as its products).
///
/// # Safety
/// AVX-512F must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn logistic_avx512<const TIMES_X: bool>(v: &mut [f32]) {
    use std::arch::x86_64::*;
    // SAFETY (all calls below): AVX-512F is available.
    let lanes = |x: __m512| unsafe { logistic_lanes_avx512::<TIMES_X>(x) };
    let mut chunks = v.chunks_exact_mut(16);
    for chunk in &mut chunks {
        // SAFETY: 16 values.
        unsafe {
            let x = _mm512_loadu_ps(chunk.as_ptr());
            _mm512_storeu_ps(chunk.as_mut_ptr(), lanes(x));
        }
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let mask = (1u16 << rest.len()) - 1;
        // SAFETY: the mask covers the remaining values only.
        unsafe {
            let x = _mm512_maskz_loadu_ps(mask, rest.as_ptr());
            _mm512_mask_storeu_ps(rest.as_mut_ptr(), mask, lanes(x));
        }
    }
}

/// [`logistic_avx512`] on one vector: `σ(x)`, times `x` with `TIMES_X` (for kernels
/// that apply a SiLU in registers, with the same values).
///
/// # Safety
/// AVX-512F must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
pub(crate) unsafe fn logistic_lanes_avx512<const TIMES_X: bool>(
    x: std::arch::x86_64::__m512,
) -> std::arch::x86_64::__m512 {
    use std::arch::x86_64::*;
    // x inside [FLOOR, 100] (NaN kept: these return their second operand when
    // one is NaN), so that e^-x stays finite (ln(f32::MAX) is 88.72): below FLOOR
    // σ(x) is under 1e-38, and is taken as 0, as the scalar form gives it.
    const FLOOR: f32 = -88.0;
    let c = _mm512_set1_ps;
    let one = c(1.0);
    let x_in = _mm512_max_ps(c(FLOOR), _mm512_min_ps(c(100.0), x));
    // -x = n ln 2 + r, n rounded by adding and subtracting 1.5 * 2^23.
    let n = _mm512_sub_ps(
        _mm512_fmadd_ps(x_in, c(-std::f32::consts::LOG2_E), c(ROUND)),
        c(ROUND),
    );
    let r = _mm512_fnmadd_ps(n, c(LN2_LO), _mm512_fnmsub_ps(n, c(LN2_HI), x_in));
    // e^r on |r| <= ln2/2: Taylor series to r^6 (relative error below 1.8e-7).
    let mut p = c(1.0 / 720.0);
    for k in [120.0, 24.0, 6.0, 2.0, 1.0, 1.0] {
        p = _mm512_fmadd_ps(p, r, c(1.0 / k));
    }
    let d = _mm512_add_ps(one, _mm512_scalef_ps(p, n));
    let e = _mm512_rcp14_ps(d);
    let s = _mm512_mul_ps(e, _mm512_fnmadd_ps(d, e, c(2.0)));
    // σ = 0 below FLOOR (NaN kept: unordered compares true), then x σ: -0 there,
    // and NaN for -inf, as the scalar forms give.
    let kept = _mm512_cmp_ps_mask::<_CMP_NLT_UQ>(x, c(FLOOR));
    let s = _mm512_maskz_mov_ps(kept, s);
    if TIMES_X { _mm512_mul_ps(x, s) } else { s }
}

/// [`logistic_avx512`] on AVX2: `σ(x)`, times `x` with `TIMES_X`, over `v`, eight
/// lanes at a time ([`logistic_lanes_avx2`]), the last few through a copy.
///
/// # Safety
/// AVX2 and FMA must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn logistic_avx2<const TIMES_X: bool>(v: &mut [f32]) {
    use std::arch::x86_64::*;
    // SAFETY (all calls below): AVX2 and FMA are available.
    let lanes = |x: __m256| unsafe { logistic_lanes_avx2::<TIMES_X>(x) };
    let mut chunks = v.chunks_exact_mut(8);
    for chunk in &mut chunks {
        // SAFETY: 8 values.
        unsafe {
            let x = _mm256_loadu_ps(chunk.as_ptr());
            _mm256_storeu_ps(chunk.as_mut_ptr(), lanes(x));
        }
    }
    let rest = chunks.into_remainder();
    if !rest.is_empty() {
        let mut copy = [0.0f32; 8];
        copy[..rest.len()].copy_from_slice(rest);
        // SAFETY: 8 values.
        unsafe { _mm256_storeu_ps(copy.as_mut_ptr(), lanes(_mm256_loadu_ps(copy.as_ptr()))) };
        rest.copy_from_slice(&copy[..rest.len()]);
    }
}

/// [`logistic_lanes_avx512`] on 8 lanes: `σ(x)`, times `x` with `TIMES_X`. The
/// input is clamped to `[-88, 87]` (above 87, `σ` is 1 in `f32`), so that `2^n`
/// of `e^-x = 2^n e^r` is a normal number built in the exponent bits; the
/// reciprocal is a division (AVX2's estimate has half the bits).
///
/// # Safety
/// AVX2 and FMA must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
pub(crate) unsafe fn logistic_lanes_avx2<const TIMES_X: bool>(
    x: std::arch::x86_64::__m256,
) -> std::arch::x86_64::__m256 {
    use std::arch::x86_64::*;
    const FLOOR: f32 = -88.0;
    let c = _mm256_set1_ps;
    let one = c(1.0);
    // NaN kept: `min` and `max` return their second operand when one is NaN.
    let x_in = _mm256_max_ps(c(FLOOR), _mm256_min_ps(c(87.0), x));
    // -x = n ln 2 + r, n rounded by adding and subtracting 1.5 * 2^23.
    let shifted = _mm256_fmadd_ps(x_in, c(-std::f32::consts::LOG2_E), c(ROUND));
    let n = _mm256_sub_ps(shifted, c(ROUND));
    let r = _mm256_fnmadd_ps(n, c(LN2_LO), _mm256_fnmsub_ps(n, c(LN2_HI), x_in));
    // e^r on |r| <= ln2/2: Taylor series to r^6 (relative error below 1.8e-7).
    let mut p = c(1.0 / 720.0);
    for k in [120.0, 24.0, 6.0, 2.0, 1.0, 1.0] {
        p = _mm256_fmadd_ps(p, r, c(1.0 / k));
    }
    // `shifted`'s bits are ROUND's plus n (-126 to 127 here): 2^n's exponent bits.
    let bias = _mm256_set1_epi32(127i32.wrapping_sub(ROUND.to_bits() as i32));
    let exponent = _mm256_add_epi32(_mm256_castps_si256(shifted), bias);
    let scale = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(exponent));
    let d = _mm256_fmadd_ps(p, scale, one);
    let s = _mm256_div_ps(one, d);
    // σ = 0 below FLOOR (NaN kept: unordered compares true), then x σ: -0 there,
    // and NaN for -inf, as the scalar forms give.
    let kept = _mm256_cmp_ps::<_CMP_NLT_UQ>(x, c(FLOOR));
    let s = _mm256_and_ps(kept, s);
    if TIMES_X { _mm256_mul_ps(x, s) } else { s }
}

/// Replaces every `x` by `e^(x - shift)` and returns their sum (`-inf` gives 0);
/// `shift` must be at least every value (a softmax's maximum).
pub(crate) fn exp_shifted_sum(v: &mut [f32], shift: f32) -> f32 {
    exp_scaled_shifted_sum(v, 1.0, shift)
}

/// Replaces every `x` by `e^(x * scale - shift)` and returns their sum (`-inf` gives
/// 0, for a positive `scale`); `shift` must be at least every `x * scale` (a scaled
/// softmax's maximum). The product and the difference are one fused multiply-add,
/// so a scale of 1 gives [`exp_shifted_sum`]'s values exactly.
pub(crate) fn exp_scaled_shifted_sum(v: &mut [f32], scale: f32, shift: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if simd_level() >= 2 {
            // SAFETY: AVX-512F is available.
            return unsafe { exp_scaled_shifted_sum_avx512(v, scale, shift) };
        }
        if simd_level() == 1 {
            // SAFETY: AVX2 and FMA are available.
            return unsafe { exp_scaled_shifted_sum_avx2(v, scale, shift) };
        }
    }
    exp_scaled_shifted_sum_body(v, scale, shift)
}

/// [`exp_nonpositive_avx2_lanes`] on sixteen lanes a vector: the same operations in
/// the same order, so both give the same values.
///
/// # Safety
/// AVX-512F must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
#[inline]
unsafe fn exp_nonpositive_avx512_lanes<const N: usize>(
    x: [std::arch::x86_64::__m512; N],
) -> [std::arch::x86_64::__m512; N] {
    use std::arch::x86_64::*;
    let c = _mm512_set1_ps;
    let small = x.map(|x| _mm512_cmp_ps_mask::<_CMP_LE_OQ>(x, c(EXP_MIN)));
    // The second operand wins for a NaN, which then stays NaN. A positive lane is
    // read as 0.
    let x = x.map(|x| _mm512_min_ps(c(0.0), _mm512_max_ps(c(EXP_MIN), x)));
    let shifted = x.map(|x| _mm512_fmadd_ps(x, c(std::f32::consts::LOG2_E), c(ROUND)));
    let n = shifted.map(|s| _mm512_sub_ps(s, c(ROUND)));
    let mut r = x;
    for i in 0..N {
        r[i] = _mm512_fnmadd_ps(n[i], c(LN2_HI), r[i]);
    }
    for i in 0..N {
        r[i] = _mm512_fnmadd_ps(n[i], c(LN2_LO), r[i]);
    }
    let r2 = r.map(|r| _mm512_mul_ps(r, r));
    let mut p = r.map(|r| _mm512_fmadd_ps(r, c(1.0 / 5040.0), c(1.0 / 720.0)));
    let mut q = r.map(|r| _mm512_fmadd_ps(r, c(1.0 / 120.0), c(1.0 / 24.0)));
    for i in 0..N {
        p[i] = _mm512_fmadd_ps(p[i], r2[i], q[i]);
    }
    for i in 0..N {
        q[i] = _mm512_fmadd_ps(r[i], c(1.0 / 6.0), c(0.5));
    }
    let mut low = r.map(|r| _mm512_add_ps(r, c(1.0)));
    for i in 0..N {
        low[i] = _mm512_fmadd_ps(q[i], r2[i], low[i]);
    }
    let r4 = r2.map(|r2| _mm512_mul_ps(r2, r2));
    for i in 0..N {
        p[i] = _mm512_fmadd_ps(p[i], r4[i], low[i]);
    }
    let bias = _mm512_set1_epi32(127i32.wrapping_sub(ROUND.to_bits() as i32));
    let mut out = p;
    for i in 0..N {
        let exponent = _mm512_add_epi32(_mm512_castps_si512(shifted[i]), bias);
        let scale = _mm512_castsi512_ps(_mm512_slli_epi32::<23>(exponent));
        out[i] = _mm512_maskz_mul_ps(!small[i], p[i], scale);
    }
    out
}

/// [`exp_scaled_shifted_sum`] through [`exp_nonpositive_avx512_lanes`], four vectors
/// a step so that their polynomials overlap, the last values under a lane mask.
///
/// # Safety
/// AVX-512F must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn exp_scaled_shifted_sum_avx512(v: &mut [f32], scale: f32, shift: f32) -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (_mm512_set1_ps(scale), _mm512_set1_ps(-shift));
    let mut sums = [_mm512_setzero_ps(); 4];
    let mut quads = v.chunks_exact_mut(64);
    for chunk in &mut quads {
        // SAFETY: the chunk holds 64 values.
        unsafe {
            let p = chunk.as_mut_ptr();
            let x: [__m512; 4] =
                std::array::from_fn(|q| _mm512_fmadd_ps(_mm512_loadu_ps(p.add(16 * q)), a, b));
            let e = exp_nonpositive_avx512_lanes(x);
            for (q, (sum, e)) in sums.iter_mut().zip(e).enumerate() {
                _mm512_storeu_ps(p.add(16 * q), e);
                *sum = _mm512_add_ps(*sum, e);
            }
        }
    }
    for chunk in quads.into_remainder().chunks_mut(16) {
        let lanes = first_lanes(chunk.len());
        // SAFETY: the masked lanes lie inside the chunk; the others are neither read
        // nor written, and their exponentials (of 0 * scale - shift) are dropped.
        unsafe {
            let p = chunk.as_mut_ptr();
            let x = _mm512_fmadd_ps(_mm512_maskz_loadu_ps(lanes, p), a, b);
            let [e] = exp_nonpositive_avx512_lanes([x]);
            _mm512_mask_storeu_ps(p, lanes, e);
            sums[0] = _mm512_add_ps(sums[0], _mm512_maskz_mov_ps(lanes, e));
        }
    }
    let total = _mm512_add_ps(
        _mm512_add_ps(sums[0], sums[1]),
        _mm512_add_ps(sums[2], sums[3]),
    );
    _mm512_reduce_add_ps(total)
}

/// [`exp`] on eight lanes that are at most 0 (or `-inf`, or NaN), as the shifted
/// values of a softmax are, with fused multiply-adds: no overflow to handle, so
/// `2^n` is one exponent field (`n` is between -126 and 0), and the only special
/// case is the flush to 0 below the normal range. The same range reduction and
/// Taylor polynomial as [`exp`], summed in another order (relative error below
/// 2e-7 still).
///
/// # Safety
/// AVX2 and FMA must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_nonpositive_avx2(x: std::arch::x86_64::__m256) -> std::arch::x86_64::__m256 {
    // SAFETY: the caller checked the features.
    let [e] = unsafe { exp_nonpositive_avx2_lanes([x]) };
    e
}

/// [`exp_nonpositive_avx2`] on `N` vectors at once, each step over all of them
/// before the next: the steps of one vector depend on each other (about 45 cycles
/// deep), and the out-of-order window only overlaps vectors whose steps lie close
/// together in the instruction stream.
///
/// # Safety
/// AVX2 and FMA must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[inline]
unsafe fn exp_nonpositive_avx2_lanes<const N: usize>(
    x: [std::arch::x86_64::__m256; N],
) -> [std::arch::x86_64::__m256; N] {
    use std::arch::x86_64::*;
    let c = _mm256_set1_ps;
    let small = x.map(|x| _mm256_cmp_ps::<_CMP_LE_OQ>(x, c(EXP_MIN)));
    // The second operand wins for a NaN, which then stays NaN. A positive lane (a
    // caller's broken promise) is read as 0.
    let x = x.map(|x| _mm256_min_ps(c(0.0), _mm256_max_ps(c(EXP_MIN), x)));
    let shifted = x.map(|x| _mm256_fmadd_ps(x, c(std::f32::consts::LOG2_E), c(ROUND)));
    let n = shifted.map(|s| _mm256_sub_ps(s, c(ROUND)));
    let mut r = x;
    for i in 0..N {
        r[i] = _mm256_fnmadd_ps(n[i], c(LN2_HI), r[i]);
    }
    for i in 0..N {
        r[i] = _mm256_fnmadd_ps(n[i], c(LN2_LO), r[i]);
    }
    // The same Taylor polynomial in Estrin's form: three multiply-adds deep instead
    // of seven.
    let r2 = r.map(|r| _mm256_mul_ps(r, r));
    let mut p = r.map(|r| _mm256_fmadd_ps(r, c(1.0 / 5040.0), c(1.0 / 720.0)));
    let mut q = r.map(|r| _mm256_fmadd_ps(r, c(1.0 / 120.0), c(1.0 / 24.0)));
    for i in 0..N {
        p[i] = _mm256_fmadd_ps(p[i], r2[i], q[i]);
    }
    for i in 0..N {
        q[i] = _mm256_fmadd_ps(r[i], c(1.0 / 6.0), c(0.5));
    }
    let mut low = r.map(|r| _mm256_add_ps(r, c(1.0)));
    for i in 0..N {
        low[i] = _mm256_fmadd_ps(q[i], r2[i], low[i]);
    }
    let r4 = r2.map(|r2| _mm256_mul_ps(r2, r2));
    for i in 0..N {
        p[i] = _mm256_fmadd_ps(p[i], r4[i], low[i]);
    }
    // `shifted`'s bits are ROUND's plus n: the biased exponent n + 127 in one add.
    let bias = _mm256_set1_epi32(127i32.wrapping_sub(ROUND.to_bits() as i32));
    let mut out = p;
    for i in 0..N {
        let exponent = _mm256_add_epi32(_mm256_castps_si256(shifted[i]), bias);
        let scale = _mm256_castsi256_ps(_mm256_slli_epi32::<23>(exponent));
        out[i] = _mm256_andnot_ps(small[i], _mm256_mul_ps(p[i], scale));
    }
    out
}

/// [`exp_scaled_shifted_sum`] through [`exp_nonpositive_avx2`] (every value times
/// `scale` less `shift` is at most 0), four vectors a step so that their polynomials
/// overlap.
///
/// # Safety
/// AVX2 and FMA must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_scaled_shifted_sum_avx2(v: &mut [f32], scale: f32, shift: f32) -> f32 {
    use std::arch::x86_64::*;
    let (a, b) = (_mm256_set1_ps(scale), _mm256_set1_ps(-shift));
    let mut sums = [_mm256_setzero_ps(); 4];
    let mut quads = v.chunks_exact_mut(32);
    for chunk in &mut quads {
        // SAFETY: the chunk holds 32 values.
        unsafe {
            let p = chunk.as_mut_ptr();
            let x: [__m256; 4] =
                std::array::from_fn(|q| _mm256_fmadd_ps(_mm256_loadu_ps(p.add(8 * q)), a, b));
            let e = exp_nonpositive_avx2_lanes(x);
            for (q, (sum, e)) in sums.iter_mut().zip(e).enumerate() {
                _mm256_storeu_ps(p.add(8 * q), e);
                *sum = _mm256_add_ps(*sum, e);
            }
        }
    }
    let rest = quads.into_remainder();
    let mut eights = rest.chunks_exact_mut(8);
    for chunk in &mut eights {
        // SAFETY: the chunk holds 8 values.
        unsafe {
            let p = chunk.as_mut_ptr();
            let e = exp_nonpositive_avx2(_mm256_fmadd_ps(_mm256_loadu_ps(p), a, b));
            _mm256_storeu_ps(p, e);
            sums[0] = _mm256_add_ps(sums[0], e);
        }
    }
    let mut lanes = [0.0f32; 8];
    let total = _mm256_add_ps(
        _mm256_add_ps(sums[0], sums[1]),
        _mm256_add_ps(sums[2], sums[3]),
    );
    // SAFETY: eight floats.
    unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), total) };
    let mut total: f32 = eights
        .into_remainder()
        .iter_mut()
        .map(|x| {
            *x = exp(x.mul_add(scale, -shift));
            *x
        })
        .sum();
    total += lanes.iter().sum::<f32>();
    total
}

/// [`exp_scaled_shifted_sum`] as plain code, for CPUs without AVX2.
fn exp_scaled_shifted_sum_body(v: &mut [f32], scale: f32, shift: f32) -> f32 {
    // Sixteen partial sums so the additions vectorize.
    let mut sums = [0.0f32; 16];
    let mut chunks = v.chunks_exact_mut(16);
    for chunk in &mut chunks {
        for (x, s) in chunk.iter_mut().zip(sums.iter_mut()) {
            *x = exp(x.mul_add(scale, -shift));
            *s += *x;
        }
    }
    let mut total: f32 = chunks
        .into_remainder()
        .iter_mut()
        .map(|x| {
            *x = exp(x.mul_add(scale, -shift));
            *x
        })
        .sum();
    total += sums.iter().sum::<f32>();
    total
}

/// Converts half-precision values to `f32` (the F16C instructions where the CPU has
/// them, exact either way).
pub(crate) fn f16_to_f32(src: &[half::f16], dst: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    {
        if crate::isa::isa().f16c {
            // SAFETY: F16C (with AVX, which it implies) is available.
            return unsafe { f16_to_f32_f16c(src, dst) };
        }
    }
    for (d, s) in dst.iter_mut().zip(src) {
        *d = s.to_f32();
    }
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx,f16c")]
unsafe fn f16_to_f32_f16c(src: &[half::f16], dst: &mut [f32]) {
    use std::arch::x86_64::{__m128i, _mm_loadu_si128, _mm256_cvtph_ps, _mm256_storeu_ps};
    let n = src.len().min(dst.len());
    let mut i = 0;
    while i + 8 <= n {
        // SAFETY: elements i..i+8 of both slices exist.
        unsafe {
            let halves = _mm_loadu_si128(src.as_ptr().add(i).cast::<__m128i>());
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(halves));
        }
        i += 8;
    }
    for k in i..n {
        dst[k] = src[k].to_f32();
    }
}

/// The mask of an AVX-512 vector's first `n` lanes (all 16 from `n = 16` on), for
/// loads and stores of a row's last values.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn first_lanes(n: usize) -> u16 {
    if n >= 16 { u16::MAX } else { (1u16 << n) - 1 }
}

/// [`first_lanes`] for AVX2's masked loads and stores: an AVX2 vector whose first
/// `n` lanes (all 8 from `n = 8` on) are all ones and the rest zero (called from
/// AVX2 code, into which it is inlined).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn first_lanes_avx2(n: usize) -> std::arch::x86_64::__m256i {
    use std::arch::x86_64::*;
    _mm256_cmpgt_epi32(
        _mm256_set1_epi32(n.min(8) as i32),
        _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7),
    )
}

/// 2 with AVX-512F, 1 with AVX2+FMA, 0 otherwise ([`crate::isa`]).
#[cfg(target_arch = "x86_64")]
pub(crate) fn simd_level() -> u8 {
    let isa = crate::isa::isa();
    if isa.avx512f {
        2
    } else if isa.avx2_fma {
        1
    } else {
        0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn samples() -> impl Iterator<Item = f32> {
        (-200_000..=200_000).map(|i| i as f32 * 1e-4).chain([
            -100.0, -88.0, -87.0, 80.0, 88.0, 88.5, 88.7, 88.72, 0.0, -0.0,
        ])
    }

    #[test]
    fn exp_is_accurate() {
        for x in samples() {
            let want = f64::from(x).exp();
            let got = f64::from(exp(x));
            if want < 1e-37 {
                assert!(got < 1e-37, "exp({x}) = {got}");
            } else {
                assert!(
                    ((got - want) / want).abs() < 2e-7,
                    "exp({x}) = {got}, want {want}"
                );
            }
        }
    }

    #[test]
    fn exp_overflows_to_infinity_and_keeps_nan() {
        for x in [88.73f32, 89.0, 100.0, f32::INFINITY] {
            assert_eq!(exp(x), f32::INFINITY, "exp({x})");
        }
        assert!(exp(f32::NAN).is_nan());
        assert_eq!(exp(f32::NEG_INFINITY), 0.0);
    }

    #[test]
    fn tanh_keeps_relative_accuracy_near_zero() {
        for x in (1..=20_000)
            .map(|i| i as f32 * 1e-5)
            .chain([1e-30, 1e-10, 3e-5, 0.1249, 0.1251])
        {
            for x in [x, -x] {
                let want = f64::from(x).tanh();
                let rel = ((f64::from(tanh(x)) - want) / want).abs();
                assert!(rel < 5e-7, "tanh({x}) relative error {rel}");
            }
        }
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_vector_gelu_gives_the_scalar_values() {
        if simd_level() == 0 {
            return;
        }
        let special = [
            f32::NAN,
            f32::INFINITY,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            5.6,
            -5.6,
        ];
        let values: Vec<f32> = samples().step_by(7).chain(special).collect();
        for (x, g) in on_eight_lanes(&values, gelu_avx2) {
            let want = gelu(x);
            assert!(
                g.to_bits() == want.to_bits() || (g.is_nan() && want.is_nan()),
                "gelu({x}): {g} vs {want}"
            );
        }
    }

    /// `(x, f(x))` for every value, `f` run on vectors of eight.
    #[cfg(target_arch = "x86_64")]
    fn on_eight_lanes(
        values: &[f32],
        f: unsafe fn(std::arch::x86_64::__m256) -> std::arch::x86_64::__m256,
    ) -> Vec<(f32, f32)> {
        use std::arch::x86_64::*;
        let mut out = Vec::with_capacity(values.len());
        for chunk in values.chunks(8) {
            let mut lanes = [0.0f32; 8];
            lanes[..chunk.len()].copy_from_slice(chunk);
            let mut got = [0.0f32; 8];
            // SAFETY: the callers checked AVX2 and FMA (level 1 or more).
            unsafe { _mm256_storeu_ps(got.as_mut_ptr(), f(_mm256_loadu_ps(lanes.as_ptr()))) };
            out.extend(chunk.iter().copied().zip(got));
        }
        out
    }

    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_softmax_exp_is_accurate_at_and_below_zero() {
        if simd_level() == 0 {
            return;
        }
        let special = [
            f32::NAN,
            f32::NEG_INFINITY,
            0.0,
            -0.0,
            -87.32,
            -87.33,
            -87.34,
            -103.0,
        ];
        let values: Vec<f32> = samples().filter(|&x| x <= 0.0).chain(special).collect();
        for (x, g) in on_eight_lanes(&values, exp_nonpositive_avx2) {
            let want = f64::from(x).exp();
            if x.is_nan() {
                assert!(g.is_nan());
            } else if want < 1e-37 {
                assert!(g == 0.0 || f64::from(g) < 1e-37, "exp({x}) = {g}");
            } else {
                let rel = ((f64::from(g) - want) / want).abs();
                assert!(
                    rel < 2e-7,
                    "exp({x}) = {g}, want {want}: relative error {rel}"
                );
            }
        }
        // Rows of every length up to two steps of 32 and a tail, shifted by their max.
        for len in 0..75 {
            let mut row: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin() * 40.0).collect();
            if len > 3 {
                row[3] = f32::NEG_INFINITY;
            }
            let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let want: Vec<f32> = row.iter().map(|&x| exp(x - max)).collect();
            let total = exp_shifted_sum(&mut row, max);
            for (g, w) in row.iter().zip(&want) {
                assert!((g - w).abs() <= 2.5e-7 * w, "length {len}: {g} vs {w}");
            }
            let want_total: f32 = want.iter().sum();
            assert!((total - want_total).abs() <= 1e-6 * want_total.max(1.0));
        }
        // Scaled rows past two steps of 64 (the AVX-512 form's) and every tail, the
        // scale inside the exponential: normalized, against the softmax of
        // `x * scale` in f64. The shift is the rounded largest `x * scale`, so the
        // largest value's argument may be half an ulp of it above 0 (read as 0): the
        // error allowed grows with the shift, as rounding `x * scale` first would.
        for scale in [0.125f32, 1.7] {
            for len in (1..150).step_by(7).chain([64, 128, 129]) {
                let mut row: Vec<f32> = (0..len).map(|i| (i as f32 * 0.61).cos() * 30.0).collect();
                if len > 5 {
                    row[5] = f32::NEG_INFINITY;
                }
                let max = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) * scale;
                let want: Vec<f64> = row
                    .iter()
                    .map(|&x| (f64::from(x) * f64::from(scale) - f64::from(max)).exp())
                    .collect();
                let want_total: f64 = want.iter().sum();
                let total = exp_scaled_shifted_sum(&mut row, scale, max);
                let tol = 4e-7 + 1.2e-7 * f64::from(max.abs());
                for (g, w) in row.iter().zip(&want) {
                    let (g, w) = (f64::from(*g) / f64::from(total), w / want_total);
                    assert!(
                        (g - w).abs() <= tol * w + 1e-37,
                        "scale {scale}, length {len}: {g} vs {w}"
                    );
                }
                assert!((f64::from(total) - want_total).abs() <= tol * want_total);
            }
        }
    }

    /// The AVX-512 form of the softmax's exponential gives the AVX2 form's values
    /// (the same operations in the same order).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn the_softmax_exp_gives_the_same_values_on_sixteen_lanes() {
        use std::arch::x86_64::*;
        if simd_level() < 2 {
            return;
        }
        let special = [f32::NAN, f32::NEG_INFINITY, 0.0, -0.0, -87.33, -103.0, 3.0];
        let values: Vec<f32> = samples().filter(|&x| x <= 0.0).chain(special).collect();
        let eight = on_eight_lanes(&values, exp_nonpositive_avx2);
        for (chunk, want) in values.chunks(16).zip(eight.chunks(16)) {
            let mut lanes = [0.0f32; 16];
            lanes[..chunk.len()].copy_from_slice(chunk);
            let mut got = [0.0f32; 16];
            // SAFETY: AVX-512F is available (level 2).
            unsafe {
                let [e] = exp_nonpositive_avx512_lanes([_mm512_loadu_ps(lanes.as_ptr())]);
                _mm512_storeu_ps(got.as_mut_ptr(), e);
            }
            for (g, &(x, w)) in got.iter().zip(want) {
                assert!(
                    g.to_bits() == w.to_bits() || (g.is_nan() && w.is_nan()),
                    "exp({x}): {g} against {w}"
                );
            }
        }
    }

    #[test]
    fn erf_tanh_and_activations_are_accurate() {
        for x in samples() {
            let xd = f64::from(x);
            let want = libm::erf(xd);
            assert!((f64::from(tanh(x)) - xd.tanh()).abs() < 3e-7, "tanh({x})");
            let err = (f64::from(erf(x)) - want).abs();
            assert!(
                err < 3.5e-7 && (xd.abs() >= 0.6 || err <= 1e-6 * want.abs()),
                "erf({x}): error {err}"
            );
            let g = 0.5 * xd * (1.0 + libm::erf(xd / std::f64::consts::SQRT_2));
            assert!(
                (f64::from(gelu(x)) - g).abs() <= 2e-7 * (1.0 + xd.abs()),
                "gelu({x})"
            );
            assert!(gelu(f32::NAN).is_nan());
            let s = xd / (1.0 + (-xd).exp());
            assert!(
                (f64::from(silu(x)) - s).abs() <= 3e-7 * (1.0 + xd.abs()),
                "silu({x})"
            );
        }
    }

    #[test]
    fn silu_and_sigmoid_in_place_are_accurate_at_every_length() {
        let xs: Vec<f32> = samples()
            .chain([
                -1e4,
                -150.0,
                -88.0,
                -80.5,
                -79.5,
                80.0,
                100.0,
                f32::INFINITY,
            ])
            .collect();
        for len in [xs.len(), 17, 15, 1, 0] {
            let xs = &xs[xs.len() - len..];
            let mut silus = xs.to_vec();
            silu_in_place(&mut silus);
            let mut sigmoids = xs.to_vec();
            sigmoid_in_place(&mut sigmoids);
            for ((&x, &got_silu), &got_sigmoid) in xs.iter().zip(&silus).zip(&sigmoids) {
                let xd = f64::from(x);
                let sigma = 1.0 / (1.0 + (-xd).exp());
                let want = if x.is_infinite() { xd } else { xd * sigma };
                let tol = 3e-7 * (1.0 + xd.abs());
                assert!(
                    (f64::from(got_silu) - want).abs() <= tol || got_silu == want as f32,
                    "silu({x}) = {got_silu}, want {want}"
                );
                assert!(
                    (f64::from(got_sigmoid) - sigma).abs() <= 3e-7,
                    "sigmoid({x}) = {got_sigmoid}, want {sigma}"
                );
                // Tiny but normal results keep their relative accuracy (a log of
                // the sigmoid reads them).
                if (-87.0..-30.0).contains(&x) {
                    assert!(
                        (f64::from(got_sigmoid) / sigma - 1.0).abs() <= 1e-6,
                        "sigmoid({x}) = {got_sigmoid}, want {sigma}"
                    );
                }
            }
        }
        for f in [silu_in_place, sigmoid_in_place] {
            let mut nan = [f32::NAN; 3];
            f(&mut nan);
            assert!(nan.iter().all(|v| v.is_nan()));
        }
    }
}
