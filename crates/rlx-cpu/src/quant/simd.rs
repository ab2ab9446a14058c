//! AVX-512 dot products of activation rows with one packed weight row, for the
//! formats GGUF models mostly use (Q4_0, Q4_1, Q8_0). Each block is widened to two
//! vectors of 16 `f32` weights once and multiplied into every activation row.

use super::GEMV_MAX_ROWS;
use rlx_ir::QuantFormat;

/// `sums[i] = a[i, :] . row` for `i < m`, when this CPU and format have a fast
/// kernel; returns false (and leaves `sums` alone) otherwise.
pub(super) fn dot_rows(
    format: QuantFormat,
    row: &[u8],
    a: &[f32],
    m: usize,
    k: usize,
    sums: &mut [f32; GEMV_MAX_ROWS],
) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if !matches!(
            format,
            QuantFormat::Q4_0 | QuantFormat::Q4_1 | QuantFormat::Q8_0
        ) || !avx512::available()
            || m == 0
            || m > GEMV_MAX_ROWS
            || row.len() != k / 32 * format.block_bytes()
            || a.len() < m * k
        {
            return false;
        }
        // SAFETY: the features are present; `row` holds k/32 blocks and `a` m x k
        // floats (both checked above).
        unsafe { avx512::dot_rows(format, row, a, m, k, sums) };
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (format, row, a, m, k, sums);
        false
    }
}

/// Decodes block `b` of a packed row into `out` (32 values) when this CPU and format
/// have a fast kernel; returns false otherwise.
pub(super) fn decode_block32(format: QuantFormat, row: &[u8], b: usize, out: &mut [f32]) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        if !matches!(
            format,
            QuantFormat::Q4_0 | QuantFormat::Q4_1 | QuantFormat::Q8_0
        ) || !avx512::available()
            || out.len() != 32
            || row.len() < (b + 1) * format.block_bytes()
        {
            return false;
        }
        // SAFETY: the features are present; block b lies inside `row` and `out`
        // holds 32 floats (both checked above).
        unsafe { avx512::decode_block(format, row.as_ptr(), b, out.as_mut_ptr()) };
        true
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (format, row, b, out);
        false
    }
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::GEMV_MAX_ROWS;
    use rlx_ir::QuantFormat;
    use std::arch::x86_64::*;

    /// AVX-512F and F16C, detected once.
    pub(super) fn available() -> bool {
        let isa = crate::isa::isa();
        isa.avx512f && isa.f16c
    }

    /// Dispatches on the row count so the accumulators stay in registers.
    ///
    /// # Safety
    /// AVX-512F and F16C are available; `row` holds `k / 32` blocks of `format` and
    /// `a` holds `m x k` floats, `1 <= m <= GEMV_MAX_ROWS`.
    #[target_feature(enable = "avx512f,f16c")]
    pub(super) unsafe fn dot_rows(
        format: QuantFormat,
        row: &[u8],
        a: &[f32],
        m: usize,
        k: usize,
        sums: &mut [f32; GEMV_MAX_ROWS],
    ) {
        macro_rules! go {
            ($m:literal) => {
                go!($m, 1)
            };
            ($m:literal, $chains:literal) => {
                // SAFETY: forwarded contract.
                unsafe { rows::<$m, $chains>(format, row.as_ptr(), a.as_ptr(), k, sums) }
            };
        }
        match m {
            // Few rows: blocks alternate between accumulator sets, so the sums do not
            // wait on each other's latency.
            1 => go!(1, 2),
            2 => go!(2, 2),
            3 => go!(3),
            4 => go!(4),
            5 => go!(5),
            6 => go!(6),
            7 => go!(7),
            _ => go!(8),
        }
    }

    /// The `f16` at `p`, widened and broadcast to 16 lanes.
    #[inline]
    #[target_feature(enable = "avx512f,f16c")]
    unsafe fn half_splat(p: *const u8) -> __m512 {
        // SAFETY: the caller's block holds 2 bytes at `p`.
        let bits = unsafe { p.cast::<i16>().read_unaligned() };
        _mm512_cvtph_ps(_mm256_set1_epi16(bits))
    }

    /// Block `b`'s 32 weights as two vectors (values 0..16 and 16..32).
    ///
    /// 4-bit formats: a block has only 16 distinct weights, `d * q + m` for the
    /// nibble `q`, so one multiply-add makes all 16 of them and two in-register
    /// lookups (`vpermps`, which reads the low 4 bits of each index) place them:
    /// the bytes, widened to 32 bits, index with their low nibble directly and with
    /// their high nibble after a shift.
    #[inline]
    #[target_feature(enable = "avx512f,f16c")]
    unsafe fn weights(format: QuantFormat, row: *const u8, b: usize) -> (__m512, __m512) {
        let nibble_values = _mm512_setr_ps(
            0.0, 1.0, 2.0, 3.0, 4.0, 5.0, 6.0, 7.0, 8.0, 9.0, 10.0, 11.0, 12.0, 13.0, 14.0, 15.0,
        );
        match format {
            QuantFormat::Q4_1 => {
                // SAFETY: block b of a Q4_1 row is 20 bytes at b * 20.
                let block = unsafe { row.add(b * 20) };
                // SAFETY: as above.
                let (d, min) = unsafe { (half_splat(block), half_splat(block.add(2))) };
                // SAFETY: as above.
                let q = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(block.add(4).cast()) });
                let table = _mm512_fmadd_ps(nibble_values, d, min);
                (
                    _mm512_permutexvar_ps(q, table),
                    _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table),
                )
            }
            QuantFormat::Q4_0 => {
                // SAFETY: block b of a Q4_0 row is 18 bytes at b * 18.
                let block = unsafe { row.add(b * 18) };
                // SAFETY: as above.
                let d = unsafe { half_splat(block) };
                // SAFETY: as above.
                let q = _mm512_cvtepu8_epi32(unsafe { _mm_loadu_si128(block.add(2).cast()) });
                let table = _mm512_mul_ps(_mm512_sub_ps(nibble_values, _mm512_set1_ps(8.0)), d);
                (
                    _mm512_permutexvar_ps(q, table),
                    _mm512_permutexvar_ps(_mm512_srli_epi32(q, 4), table),
                )
            }
            _ => {
                // Q8_0: 34 bytes per block.
                // SAFETY: block b of a Q8_0 row is 34 bytes at b * 34.
                let block = unsafe { row.add(b * 34) };
                // SAFETY: as above.
                let d = unsafe { half_splat(block) };
                // SAFETY: as above.
                let (q0, q1) = unsafe {
                    (
                        _mm_loadu_si128(block.add(2).cast()),
                        _mm_loadu_si128(block.add(18).cast()),
                    )
                };
                (
                    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q0)), d),
                    _mm512_mul_ps(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(q1)), d),
                )
            }
        }
    }

    /// Stores block `b`'s 32 weights at `out`.
    ///
    /// # Safety
    /// As [`dot_rows`] for the block; `out` addresses 32 writable floats.
    #[target_feature(enable = "avx512f,f16c")]
    pub(super) unsafe fn decode_block(
        format: QuantFormat,
        row: *const u8,
        b: usize,
        out: *mut f32,
    ) {
        // SAFETY: per the contract.
        unsafe {
            let (w0, w1) = weights(format, row, b);
            _mm512_storeu_ps(out, w0);
            _mm512_storeu_ps(out.add(16), w1);
        }
    }

    /// `M` activation rows against one weight row. Each row's sum is split over
    /// `2 * CHAINS` independent accumulators (the two halves of a block, and blocks
    /// taken in turn by `CHAINS` sets): one chain of dependent multiply-adds per
    /// block would leave the loop waiting on their latency.
    #[inline]
    #[target_feature(enable = "avx512f,f16c")]
    unsafe fn rows<const M: usize, const CHAINS: usize>(
        format: QuantFormat,
        row: *const u8,
        a: *const f32,
        k: usize,
        sums: &mut [f32; GEMV_MAX_ROWS],
    ) {
        let mut acc = [[[_mm512_setzero_ps(); 2]; M]; CHAINS];
        let blocks = k / 32;
        // Set `c` takes blocks c, c + CHAINS, ...; indices stay constant per set so
        // the accumulators live in registers.
        let step = |set: &mut [[__m512; 2]; M], b: usize| {
            // SAFETY: b < k / 32 blocks.
            let (w0, w1) = unsafe { weights(format, row, b) };
            for (i, acc) in set.iter_mut().enumerate() {
                // SAFETY: row i of `a` holds k floats.
                let x = unsafe { a.add(i * k + b * 32) };
                // SAFETY: as above.
                unsafe {
                    acc[0] = _mm512_fmadd_ps(_mm512_loadu_ps(x), w0, acc[0]);
                    acc[1] = _mm512_fmadd_ps(_mm512_loadu_ps(x.add(16)), w1, acc[1]);
                }
            }
        };
        let mut b = 0;
        while b + CHAINS <= blocks {
            for (c, set) in acc.iter_mut().enumerate() {
                step(set, b + c);
            }
            b += CHAINS;
        }
        for (c, set) in acc.iter_mut().enumerate().take(blocks - b) {
            step(set, b + c);
        }
        for (i, s) in sums.iter_mut().enumerate().take(M) {
            let mut total = _mm512_setzero_ps();
            for set in &acc {
                total = _mm512_add_ps(total, _mm512_add_ps(set[i][0], set[i][1]));
            }
            *s = _mm512_reduce_add_ps(total);
        }
    }
}
