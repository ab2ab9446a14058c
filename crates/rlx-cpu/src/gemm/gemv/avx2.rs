//! The matrix-vector products of the parent module on AVX2 and FMA: the same
//! loops with vectors of 8 lanes, the last columns of a row's block masked.

use super::super::{BFormat, Gemm};
use super::{column_vector, row_vector};
use std::arch::x86_64::*;
use std::ops::Range;

/// Lanes of a vector.
const LANES: usize = 8;

/// The most columns of `C` one pass of [`rows_sum`] keeps in registers.
const WIDEST: usize = 64;

/// Column `j` of `C` over `rows`: `C[i, j] = A[i, :] · B[:, j]`, four rows of `A` at
/// a time, two chains each.
///
/// # Safety
/// AVX2 and FMA; as [`super::run`].
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn column(g: &Gemm, rows: Range<usize>, j: usize, buf: &mut [f32]) {
    let k = g.k;
    // SAFETY: column j lies inside B.
    let x = unsafe { column_vector(g, j, buf) };
    let xp = x.as_ptr();
    let store = |i: usize, sum: f32| {
        // SAFETY: (i, j) is inside C.
        unsafe {
            let c = g.c.add(i * g.ldc + j);
            *c = if g.accumulate { *c + sum } else { sum };
        }
    };
    let mut i = rows.start;
    while i + 4 <= rows.end {
        let a: [*const f32; 4] = std::array::from_fn(|r| g.a.wrapping_add((i + r) * g.lda));
        let mut acc = [[_mm256_setzero_ps(); 2]; 4];
        let mut p = 0;
        // SAFETY: rows i..i+4 of A and the vector hold k values.
        unsafe {
            while p + 2 * LANES <= k {
                let (x0, x1) = (
                    _mm256_loadu_ps(xp.add(p)),
                    _mm256_loadu_ps(xp.add(p + LANES)),
                );
                for r in 0..4 {
                    acc[r][0] = _mm256_fmadd_ps(_mm256_loadu_ps(a[r].add(p)), x0, acc[r][0]);
                    acc[r][1] =
                        _mm256_fmadd_ps(_mm256_loadu_ps(a[r].add(p + LANES)), x1, acc[r][1]);
                }
                p += 2 * LANES;
            }
        }
        for (r, [s0, s1]) in acc.into_iter().enumerate() {
            let mut sum = sum_lanes(_mm256_add_ps(s0, s1));
            for q in p..k {
                // SAFETY: as above.
                sum += unsafe { *a[r].add(q) * *xp.add(q) };
            }
            store(i + r, sum);
        }
        i += 4;
    }
    for i in i..rows.end {
        // SAFETY: row i of A holds k values.
        store(i, unsafe { dot(x, g.a.add(i * g.lda)) });
    }
}

/// Row `i` of `C` over `cols`: `C[i, cols] = Σ_p A[i, p] B[p, cols]`, in blocks of
/// up to [`WIDEST`] columns whose sums stay in registers while the rows of `B` (or
/// of its packed panel) stream past.
///
/// # Safety
/// AVX2 and FMA; as [`super::run`].
#[target_feature(enable = "avx2,fma")]
pub(super) unsafe fn row(g: &Gemm, i: usize, cols: Range<usize>, buf: &mut [f32]) {
    let k = g.k;
    // SAFETY: row i lies inside A.
    let x = unsafe { row_vector(g, i, buf) };
    let c = g.c.wrapping_add(i * g.ldc);
    match g.b_format {
        BFormat::Packed { nr, .. } => {
            let mut j = cols.start;
            while j < cols.end {
                let (q, offset) = (j / nr, j % nr);
                let width = (nr - offset).min(cols.end - j).min(WIDEST);
                let panel = g.b.wrapping_add(q * nr * k + offset);
                // SAFETY: the panel's k rows of nr values lie inside the packed B;
                // columns j..j+width of C lie inside row i.
                unsafe { rows_sum(x, panel, nr, width, c.add(j), g.accumulate) };
                j += width;
            }
        }
        _ if g.b_transposed => {
            for j in cols {
                let bj = g.b.wrapping_add(j * g.ldb);
                // SAFETY: column j of B holds k values; (i, j) is inside C.
                unsafe {
                    let sum = dot(x, bj);
                    let at = c.add(j);
                    *at = if g.accumulate { *at + sum } else { sum };
                }
            }
        }
        _ => {
            let mut j = cols.start;
            while j < cols.end {
                let width = (cols.end - j).min(WIDEST);
                // SAFETY: rows 0..k of B hold columns j..j+width; C as above.
                unsafe { rows_sum(x, g.b.add(j), g.ldb, width, c.add(j), g.accumulate) };
                j += width;
            }
        }
    }
}

/// The sum of a vector's 8 lanes.
#[target_feature(enable = "avx2,fma")]
fn sum_lanes(v: __m256) -> f32 {
    let halves = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
    let pairs = _mm_add_ps(halves, _mm_movehl_ps(halves, halves));
    _mm_cvtss_f32(_mm_add_ss(pairs, _mm_shuffle_ps::<1>(pairs, pairs)))
}

/// `x · y` over `x.len()` values, in four chains.
///
/// # Safety
/// AVX2 and FMA; `y` holds `x.len()` values.
#[target_feature(enable = "avx2,fma")]
unsafe fn dot(x: &[f32], y: *const f32) -> f32 {
    let k = x.len();
    let xp = x.as_ptr();
    let mut acc = [_mm256_setzero_ps(); 4];
    let mut p = 0;
    // SAFETY: both hold k values.
    unsafe {
        while p + 4 * LANES <= k {
            for (h, s) in acc.iter_mut().enumerate() {
                let q = p + LANES * h;
                *s = _mm256_fmadd_ps(_mm256_loadu_ps(xp.add(q)), _mm256_loadu_ps(y.add(q)), *s);
            }
            p += 4 * LANES;
        }
        while p + LANES <= k {
            acc[0] = _mm256_fmadd_ps(
                _mm256_loadu_ps(xp.add(p)),
                _mm256_loadu_ps(y.add(p)),
                acc[0],
            );
            p += LANES;
        }
        let mut sum = sum_lanes(_mm256_add_ps(
            _mm256_add_ps(acc[0], acc[1]),
            _mm256_add_ps(acc[2], acc[3]),
        ));
        for q in p..k {
            sum += *xp.add(q) * *y.add(q);
        }
        sum
    }
}

/// `out[..width] (+)= Σ_p x[p] · b[p * ld ..][..width]` for `width` at most
/// [`WIDEST`].
///
/// # Safety
/// AVX2 and FMA; the `k = x.len()` rows of `b`, `ld` apart, hold `width` values
/// each, and `out` holds `width` values.
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_sum(x: &[f32], b: *const f32, ld: usize, width: usize, out: *mut f32, add: bool) {
    debug_assert!(width <= WIDEST);
    // Eight chains of multiply-adds in flight: narrow blocks split the rows of B
    // between several sets of sums.
    // SAFETY: forwarded contract.
    unsafe {
        match width.div_ceil(LANES) {
            1 => rows_sum_n::<1, 8>(x, b, ld, width, out, add),
            2 => rows_sum_n::<2, 4>(x, b, ld, width, out, add),
            3 | 4 => rows_sum_n::<4, 2>(x, b, ld, width, out, add),
            _ => rows_sum_n::<8, 1>(x, b, ld, width, out, add),
        }
    }
}

/// The lanes of vector `v` of a block `width` columns wide that lie inside it, as
/// an AVX2 load and store mask (all set for a whole vector).
#[target_feature(enable = "avx2,fma")]
fn lane_mask(v: usize, width: usize) -> __m256i {
    let inside = width.saturating_sub(LANES * v).min(LANES);
    let lane = |l: usize| -i32::from(inside > l);
    _mm256_set_epi32(
        lane(7),
        lane(6),
        lane(5),
        lane(4),
        lane(3),
        lane(2),
        lane(1),
        lane(0),
    )
}

/// [`rows_sum`] with `V` vectors of sums (the last ones masked to `width`) and `U`
/// sets of them, set `u` taking the rows `p ≡ u (mod U)`.
///
/// # Safety
/// As [`rows_sum`], with `width <= 8 V`.
#[target_feature(enable = "avx2,fma")]
unsafe fn rows_sum_n<const V: usize, const U: usize>(
    x: &[f32],
    b: *const f32,
    ld: usize,
    width: usize,
    out: *mut f32,
    add: bool,
) {
    let masks: [__m256i; V] = std::array::from_fn(|v| lane_mask(v, width));
    let full = width == V * LANES;
    let mut acc = [[_mm256_setzero_ps(); V]; U];
    let k = x.len();
    let load = |row: *const f32, v: usize| {
        // SAFETY: the caller's contract: a whole block's vectors lie inside the
        // row; a masked load reads only the lanes inside `width` (a vector past
        // it, all lanes off, reads nothing: its address may lie past the row).
        unsafe {
            if full {
                _mm256_loadu_ps(row.add(LANES * v))
            } else {
                _mm256_maskload_ps(row.wrapping_add(LANES * v), masks[v])
            }
        }
    };
    let mut p = 0;
    // SAFETY: rows p < k of B hold `width` values.
    unsafe {
        while p + U <= k {
            for (u, sums) in acc.iter_mut().enumerate() {
                let row = b.add((p + u) * ld);
                let s = _mm256_set1_ps(*x.get_unchecked(p + u));
                for (v, sum) in sums.iter_mut().enumerate() {
                    *sum = _mm256_fmadd_ps(load(row, v), s, *sum);
                }
            }
            p += U;
        }
        for p in p..k {
            let row = b.add(p * ld);
            let s = _mm256_set1_ps(*x.get_unchecked(p));
            for (v, sum) in acc[0].iter_mut().enumerate() {
                *sum = _mm256_fmadd_ps(load(row, v), s, *sum);
            }
        }
        for v in 0..V {
            let mut sum = acc[0][v];
            for set in &acc[1..] {
                sum = _mm256_add_ps(sum, set[v]);
            }
            let at = out.wrapping_add(LANES * v);
            if add {
                sum = _mm256_add_ps(sum, _mm256_maskload_ps(at, masks[v]));
            }
            _mm256_maskstore_ps(at, masks[v], sum);
        }
    }
}
