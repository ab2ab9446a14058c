//! Matrix-vector products: a rectangle of `C` one row or one column wide (a
//! classifier's `1 x K` input times its weights, a squeeze-and-excitation block's
//! 1x1 convolutions over one pixel, a decode step's attention scores).
//!
//! The blocked GEMM reuses each packed panel across the rows of a tile; with one row
//! or column there is nothing to reuse, and packing `A` or `B` only adds a pass over
//! the matrix that bounds the product. Here the matrix is read once, in place, in
//! address order: a column of `C` is a dot product per row of `A`, four rows at a
//! time against the vector; a row of `C` sums the rows of `B` (or of a packed panel)
//! scaled by the vector's values, up to 128 columns held in registers (64 on AVX2,
//! `avx2`). The sums run
//! in several independent chains, so the order differs from the blocked kernels'
//! (within rounding).

use super::{BFormat, Gemm, epilogue};
use std::ops::Range;

#[cfg(target_arch = "x86_64")]
mod avx2;

/// Whether [`run`] takes the rectangle `rows x cols` of `g`: one row or column of an
/// `f32` product on a CPU with AVX-512 or AVX2 and FMA, with the vector's `k` values
/// fitting `buf`.
pub(super) fn applies(g: &Gemm, rows: &Range<usize>, cols: &Range<usize>, buf: usize) -> bool {
    let isa = crate::isa::isa();
    if !(isa.avx512f || isa.avx2_fma) || g.k == 0 || g.k > buf {
        return false;
    }
    let f32_b = g.b_format == BFormat::F32;
    let packed = |wide: bool| matches!(g.b_format, BFormat::Packed { nr, .. } if !wide || nr.is_multiple_of(16));
    if cols.len() == 1 {
        // A dot product per row of A (a packed column is gathered first).
        !g.a_transposed && (f32_b || packed(false))
    } else if rows.len() == 1 {
        f32_b || packed(true)
    } else {
        false
    }
}

/// `C[rows, cols] = epilogue(A · B)` (plus `C` when accumulating) for a rectangle
/// [`applies`] accepted, with `buf` as scratch for a strided vector.
///
/// # Safety
/// As the GEMM's `serial`; [`applies`] returned true for these arguments.
pub(super) unsafe fn run(g: &Gemm, rows: Range<usize>, cols: Range<usize>, buf: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX-512F, or AVX2 and FMA, was detected ([`applies`]); forwarded
    // contract.
    unsafe {
        match (crate::isa::isa().avx512f, cols.len() == 1) {
            (true, true) => column_avx512(g, rows.clone(), cols.start, buf),
            (true, false) => row_avx512(g, rows.start, cols.clone(), buf),
            (false, true) => avx2::column(g, rows.clone(), cols.start, buf),
            (false, false) => avx2::row(g, rows.start, cols.clone(), buf),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = buf;
    if !g.epilogue.is_identity() {
        // SAFETY: the rectangle lies inside C.
        unsafe { epilogue::apply(g, rows, cols) };
    }
}

/// The vector `x[p]` for `p < k`, in place when its values are adjacent, otherwise
/// copied into `buf`.
///
/// # Safety
/// `base + p * stride` for `p < k` must lie inside its operand.
unsafe fn vector(base: *const f32, stride: usize, k: usize, buf: &mut [f32]) -> &[f32] {
    if stride == 1 || k == 1 {
        // SAFETY: per the contract.
        unsafe { std::slice::from_raw_parts(base, k) }
    } else {
        for (p, v) in buf[..k].iter_mut().enumerate() {
            // SAFETY: per the contract.
            *v = unsafe { *base.add(p * stride) };
        }
        &buf[..k]
    }
}

/// Column `j` of `B`, the vector of a column of `C`: `B[p, j]` is `b[p * ldb + j]`,
/// or `b[j * ldb + p]` stored transposed, or value `j % nr` of row `p` of panel
/// `j / nr` when packed.
///
/// # Safety
/// As [`run`]; column `j` lies inside `B`.
unsafe fn column_vector<'b>(g: &Gemm, j: usize, buf: &'b mut [f32]) -> &'b [f32] {
    let k = g.k;
    // SAFETY: column j of B has k values at these places.
    unsafe {
        if let BFormat::Packed { nr, .. } = g.b_format {
            vector(g.b.add(j / nr * nr * k + j % nr), nr, k, buf)
        } else if g.b_transposed {
            vector(g.b.add(j * g.ldb), 1, k, buf)
        } else {
            vector(g.b.add(j), g.ldb, k, buf)
        }
    }
}

/// Row `i` of `A`, the vector of a row of `C`: `A[i, p]` is `a[i * lda + p]`, or
/// `a[p * lda + i]` stored transposed.
///
/// # Safety
/// As [`run`]; row `i` lies inside `A`.
unsafe fn row_vector<'a>(g: &Gemm, i: usize, buf: &'a mut [f32]) -> &'a [f32] {
    // SAFETY: row i of A has k values at these places.
    unsafe {
        if g.a_transposed {
            vector(g.a.add(i), g.lda, g.k, buf)
        } else {
            vector(g.a.add(i * g.lda), 1, g.k, buf)
        }
    }
}

/// Column `j` of `C` over `rows`: `C[i, j] = A[i, :] · B[:, j]`, four rows of `A` at
/// a time, two chains each.
///
/// # Safety
/// AVX-512F; as [`run`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn column_avx512(g: &Gemm, rows: Range<usize>, j: usize, buf: &mut [f32]) {
    use std::arch::x86_64::*;
    let k = g.k;
    // SAFETY: column j lies inside B.
    let x = unsafe { column_vector(g, j, buf) };
    let (whole, tail) = (k / 16 * 16, crate::vmath::first_lanes(k % 16));
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
        let mut acc = [[_mm512_setzero_ps(); 2]; 4];
        let mut p = 0;
        // SAFETY: rows i..i+4 of A and the vector hold k values; masked lanes past k
        // are not read.
        unsafe {
            while p + 32 <= whole {
                let (x0, x1) = (_mm512_loadu_ps(xp.add(p)), _mm512_loadu_ps(xp.add(p + 16)));
                for r in 0..4 {
                    acc[r][0] = _mm512_fmadd_ps(_mm512_loadu_ps(a[r].add(p)), x0, acc[r][0]);
                    acc[r][1] = _mm512_fmadd_ps(_mm512_loadu_ps(a[r].add(p + 16)), x1, acc[r][1]);
                }
                p += 32;
            }
            while p < k {
                let m = if p < whole { u16::MAX } else { tail };
                let xv = _mm512_maskz_loadu_ps(m, xp.add(p));
                for r in 0..4 {
                    let av = _mm512_maskz_loadu_ps(m, a[r].add(p));
                    acc[r][0] = _mm512_fmadd_ps(av, xv, acc[r][0]);
                }
                p += 16;
            }
        }
        for (r, [s0, s1]) in acc.into_iter().enumerate() {
            store(i + r, _mm512_reduce_add_ps(_mm512_add_ps(s0, s1)));
        }
        i += 4;
    }
    for i in i..rows.end {
        // SAFETY: row i of A holds k values.
        store(i, unsafe { dot(x, g.a.add(i * g.lda)) });
    }
}

/// Row `i` of `C` over `cols`: `C[i, cols] = Σ_p A[i, p] B[p, cols]`, in blocks of
/// columns whose sums stay in registers while the rows of `B` (or of its packed
/// panel) stream past.
///
/// # Safety
/// AVX-512F; as [`run`].
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn row_avx512(g: &Gemm, i: usize, cols: Range<usize>, buf: &mut [f32]) {
    let k = g.k;
    // SAFETY: row i lies inside A.
    let x = unsafe { row_vector(g, i, buf) };
    let c = g.c.wrapping_add(i * g.ldc);
    match g.b_format {
        BFormat::Packed { nr, .. } => {
            // Panel q holds columns q nr.. as k rows of nr values.
            let mut j = cols.start;
            while j < cols.end {
                let (q, offset) = (j / nr, j % nr);
                let width = (nr - offset).min(cols.end - j).min(128);
                let panel = g.b.wrapping_add(q * nr * k + offset);
                // SAFETY: the panel's k rows of nr values lie inside the packed B;
                // columns j..j+width of C lie inside row i.
                unsafe { rows_sum(x, panel, nr, width, c.add(j), g.accumulate) };
                j += width;
            }
        }
        _ if g.b_transposed => {
            for j in cols {
                // Column j of B is contiguous: a dot product.
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
                let width = (cols.end - j).min(128);
                // SAFETY: rows 0..k of B hold columns j..j+width; C as above.
                unsafe { rows_sum(x, g.b.add(j), g.ldb, width, c.add(j), g.accumulate) };
                j += width;
            }
        }
    }
}

/// `x · y` over `x.len()` values.
///
/// # Safety
/// AVX-512F; `y` holds `x.len()` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn dot(x: &[f32], y: *const f32) -> f32 {
    use std::arch::x86_64::*;
    let k = x.len();
    let (whole, tail) = (k / 16 * 16, crate::vmath::first_lanes(k % 16));
    let xp = x.as_ptr();
    let mut acc = [_mm512_setzero_ps(); 4];
    let mut p = 0;
    // SAFETY: both hold k values; masked lanes are not read.
    unsafe {
        while p + 64 <= whole {
            for (h, s) in acc.iter_mut().enumerate() {
                let q = p + 16 * h;
                *s = _mm512_fmadd_ps(_mm512_loadu_ps(xp.add(q)), _mm512_loadu_ps(y.add(q)), *s);
            }
            p += 64;
        }
        while p < k {
            let m = if p < whole { u16::MAX } else { tail };
            let v = _mm512_maskz_loadu_ps(m, xp.add(p));
            acc[0] = _mm512_fmadd_ps(v, _mm512_maskz_loadu_ps(m, y.add(p)), acc[0]);
            p += 16;
        }
    }
    _mm512_reduce_add_ps(_mm512_add_ps(
        _mm512_add_ps(acc[0], acc[1]),
        _mm512_add_ps(acc[2], acc[3]),
    ))
}

/// `out[..width] (+)= Σ_p x[p] · b[p * ld ..][..width]` for `width` at most 128.
///
/// # Safety
/// AVX-512F; the `k = x.len()` rows of `b`, `ld` apart, hold `width` values each, and
/// `out` holds `width` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn rows_sum(x: &[f32], b: *const f32, ld: usize, width: usize, out: *mut f32, add: bool) {
    debug_assert!(width <= 128);
    // Eight chains of multiply-adds in flight: narrow blocks split the rows of B
    // between several sets of sums.
    // SAFETY: forwarded contract.
    unsafe {
        match width.div_ceil(16) {
            1 => rows_sum_n::<1, 8>(x, b, ld, width, out, add),
            2 => rows_sum_n::<2, 4>(x, b, ld, width, out, add),
            3 | 4 => rows_sum_n::<4, 2>(x, b, ld, width, out, add),
            _ => rows_sum_n::<8, 1>(x, b, ld, width, out, add),
        }
    }
}

/// [`rows_sum`] with `V` vectors of sums (the last ones masked to `width`) and `U`
/// sets of them, set `u` taking the rows `p ≡ u (mod U)`.
///
/// # Safety
/// As [`rows_sum`], with `width <= 16 V`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn rows_sum_n<const V: usize, const U: usize>(
    x: &[f32],
    b: *const f32,
    ld: usize,
    width: usize,
    out: *mut f32,
    add: bool,
) {
    use std::arch::x86_64::*;
    let masks: [u16; V] =
        std::array::from_fn(|v| crate::vmath::first_lanes(width.saturating_sub(16 * v)));
    let full = masks.iter().all(|&m| m == u16::MAX);
    let mut acc = [[_mm512_setzero_ps(); V]; U];
    let k = x.len();
    let mut p = 0;
    // SAFETY: rows p < k of B hold `width` values; masked lanes are not read.
    unsafe {
        while p + U <= k {
            for (u, sums) in acc.iter_mut().enumerate() {
                let row = b.add((p + u) * ld);
                let s = _mm512_set1_ps(*x.get_unchecked(p + u));
                for v in 0..V {
                    // Vectors past `width` (mask 0) read nothing: their address
                    // may lie past the row.
                    let values = if full {
                        _mm512_loadu_ps(row.add(16 * v))
                    } else {
                        _mm512_maskz_loadu_ps(masks[v], row.wrapping_add(16 * v))
                    };
                    sums[v] = _mm512_fmadd_ps(values, s, sums[v]);
                }
            }
            p += U;
        }
        for p in p..k {
            let row = b.add(p * ld);
            let s = _mm512_set1_ps(*x.get_unchecked(p));
            for v in 0..V {
                let values = _mm512_maskz_loadu_ps(masks[v], row.wrapping_add(16 * v));
                acc[0][v] = _mm512_fmadd_ps(values, s, acc[0][v]);
            }
        }
        for v in 0..V {
            let mut sum = acc[0][v];
            for set in &acc[1..] {
                sum = _mm512_add_ps(sum, set[v]);
            }
            let at = out.wrapping_add(16 * v);
            if add {
                sum = _mm512_add_ps(sum, _mm512_maskz_loadu_ps(masks[v], at));
            }
            _mm512_mask_storeu_ps(at, masks[v], sum);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::lcg;
    use super::super::{
        Activation, BFormat, Epilogue, Gemm, GemmScratch, best_kernel, pack_b_panels_for,
        sgemm_with,
    };
    use super::applies;
    use crate::pool::ThreadPool;

    /// How `B` is stored in a case.
    #[derive(Clone, Copy, Debug)]
    enum Stored {
        /// Row-major with `extra` unused values after each row.
        Rows { extra: usize },
        /// Column-major: column `j` is `k` adjacent values.
        Transposed,
        /// Packed into panels `nr` columns wide (`pack_b_panels_for`).
        Packed { nr: usize },
    }

    /// One product `[m, k] x [k, n]` through `sgemm_with`, `A` stored transposed or
    /// not, `B` as `stored`, with the epilogue's bias (per column, or per row where
    /// `n` is 1), ReLU and residual, against an `f64` reference.
    fn check(m: usize, n: usize, k: usize, a_transposed: bool, stored: Stored, seed: &mut u64) {
        let pool = ThreadPool::new(3);
        let a: Vec<f32> = (0..m * k).map(|_| lcg(seed)).collect();
        let b: Vec<f32> = (0..k * n).map(|_| lcg(seed)).collect();
        let a_stored: Vec<f32> = if a_transposed {
            (0..k * m).map(|q| a[(q % m) * k + q / m]).collect()
        } else {
            a.clone()
        };
        let isa = crate::isa::isa();
        let kernel_width = if isa.avx512f { None } else { Some(16) };
        if let Stored::Packed { nr } = stored
            && (!(isa.avx512f || isa.avx2_fma) || kernel_width.is_some_and(|w| w != nr))
        {
            // Panels of these widths are read only by the matrix-vector path (the
            // blocked kernels of other CPUs have their own panel width).
            return;
        }
        let (b_stored, ldb, b_format, b_transposed) = match stored {
            Stored::Rows { extra } => {
                let ld = n + extra;
                let rows = (0..k * ld)
                    .map(|q| {
                        if q % ld < n {
                            b[q / ld * n + q % ld]
                        } else {
                            f32::NAN
                        }
                    })
                    .collect();
                (rows, ld, BFormat::F32, false)
            }
            Stored::Transposed => {
                let cols = (0..n * k).map(|q| b[(q % k) * n + q / k]).collect();
                (cols, k, BFormat::F32, true)
            }
            Stored::Packed { nr } => {
                let mut packed = vec![f32::NAN; n.div_ceil(nr) * nr * k];
                pack_b_panels_for(nr, &b, k, n, &mut packed);
                let format = BFormat::Packed { nr, streamed: true };
                (packed, n, format, false)
            }
        };
        let bias: Vec<f32> = (0..m.max(n)).map(|_| lcg(seed)).collect();
        let residual: Vec<f32> = (0..m * n).map(|_| lcg(seed)).collect();
        let start: Vec<f32> = (0..m * n).map(|_| lcg(seed)).collect();
        let per_row = n == 1;
        for (accumulate, epilogue) in [(false, false), (true, false), (false, true), (true, true)] {
            for threads in [1, 3] {
                let mut c = start.clone();
                let g = Gemm {
                    m,
                    n,
                    k,
                    a: a_stored.as_ptr(),
                    lda: if a_transposed { m } else { k },
                    a_transposed,
                    b: b_stored.as_ptr(),
                    ldb,
                    b_transposed,
                    b_format,
                    c: c.as_mut_ptr(),
                    ldc: n,
                    accumulate,
                    epilogue: if epilogue {
                        Epilogue {
                            bias: (!per_row).then_some(bias.as_ptr()),
                            row_bias: per_row.then_some(bias.as_ptr()),
                            activation: Some(Activation::Relu),
                            residual: Some((residual.as_ptr(), n)),
                            ..Epilogue::NONE
                        }
                    } else {
                        Epilogue::NONE
                    },
                };
                let whole = (0..m, 0..n);
                if (isa.avx512f || isa.avx2_fma) && k > 0 {
                    assert!(applies(&g, &whole.0, &whole.1, k), "{m}x{n}x{k} {stored:?}");
                }
                // SAFETY: every buffer matches the stated sizes and layouts.
                unsafe { sgemm_with(&g, best_kernel(), &pool, &GemmScratch::new(threads, 0)) }
                    .unwrap();
                for i in 0..m {
                    for j in 0..n {
                        let mut want: f64 = (0..k)
                            .map(|p| f64::from(a[i * k + p]) * f64::from(b[p * n + j]))
                            .sum();
                        if accumulate {
                            want += f64::from(start[i * n + j]);
                        }
                        if epilogue {
                            want += f64::from(bias[if per_row { i } else { j }]);
                            want = want.max(0.0) + f64::from(residual[i * n + j]);
                        }
                        let got = f64::from(c[i * n + j]);
                        let tol = 1e-5 * (k as f64).sqrt().max(1.0) * 4.0;
                        assert!(
                            (got - want).abs() <= tol,
                            "{m}x{n}x{k} at={a_transposed} {stored:?} acc={accumulate} \
                             epilogue={epilogue} threads={threads} at ({i}, {j}): {got} vs {want}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn one_row_of_c_matches_the_reference_for_every_layout_of_b() {
        let mut seed = 7u64;
        for (n, k) in [
            (2, 1),
            (5, 7),
            (16, 33),
            (49, 200),
            (130, 17),
            (300, 64),
            (1000, 96),
        ] {
            for a_transposed in [false, true] {
                for stored in [
                    Stored::Rows { extra: 0 },
                    Stored::Rows { extra: 3 },
                    Stored::Transposed,
                    Stored::Packed { nr: 48 },
                    Stored::Packed { nr: 32 },
                    Stored::Packed { nr: 16 },
                ] {
                    check(1, n, k, a_transposed, stored, &mut seed);
                }
            }
        }
    }

    #[test]
    fn one_column_of_c_matches_the_reference_for_every_layout_of_b() {
        let mut seed = 11u64;
        for (m, k) in [
            (1, 1),
            (3, 15),
            (4, 16),
            (7, 17),
            (37, 100),
            (240, 960),
            (9, 300),
        ] {
            for stored in [
                Stored::Rows { extra: 0 },
                Stored::Rows { extra: 2 },
                Stored::Transposed,
                Stored::Packed { nr: 48 },
                Stored::Packed { nr: 16 },
            ] {
                check(m, 1, k, false, stored, &mut seed);
            }
        }
    }
}
