//! Packing: copies a block of `B` into `NR`-column panels laid out in the order the
//! micro-kernel reads them, and the last short row panel of `A` into zero-padded rows;
//! both padded with zeros past the matrix edge.

use super::{BFormat, Gemm};

/// Copies `rows` (< `mr`) rows of `A[i0.., pc..pc+kc]` into `out` as `mr` rows of `kc`
/// values, the missing rows zero.
///
/// # Safety
/// The rows must lie inside `A`; `out` holds at least `mr * kc` floats.
pub(super) unsafe fn pack_a_rows(
    g: &Gemm,
    i0: usize,
    rows: usize,
    pc: usize,
    kc: usize,
    mr: usize,
    out: &mut [f32],
) {
    for i in 0..mr {
        let dst = &mut out[i * kc..(i + 1) * kc];
        if i < rows {
            // SAFETY: row i0 + i, columns pc..pc+kc, lie inside A.
            let src = unsafe { std::slice::from_raw_parts(g.a.add((i0 + i) * g.lda + pc), kc) };
            dst.copy_from_slice(src);
        } else {
            dst.fill(0.0);
        }
    }
}

/// Copies `rows` rows of a transposed `A` (`A[i, p] = a[p * lda + i]`), `A[i0..,
/// pc..pc+kc]`, into `out` as rows of `kc` values `ld` apart, then zero rows up to
/// `padded`: 8 x 8
/// blocks are transposed in registers where the CPU has AVX, the rest value by value.
///
/// # Safety
/// The block must lie inside `A`; `out` holds at least `padded * ld` floats,
/// `padded >= rows` and `ld >= kc`.
pub(super) unsafe fn pack_a_transposed(
    g: &Gemm,
    (i0, rows): (usize, usize),
    (pc, kc): (usize, usize),
    padded: usize,
    ld: usize,
    out: &mut [f32],
) {
    assert!(
        out.len() >= padded * ld && padded >= rows && ld >= kc,
        "A block out of bounds"
    );
    // SAFETY: the block's `kc` stored rows from `pc`, `rows` values from `i0` each,
    // lie inside A; `out` holds `rows` rows of `ld >= kc` floats (checked above).
    unsafe { transpose_into(g.a.add(pc * g.lda + i0), g.lda, out, ld, (rows, kc)) };
    for i in rows..padded {
        out[i * ld..i * ld + kc].fill(0.0);
    }
}

/// Packs `B[pc..pc+kc, jc..jc+nc]`: panel `q` holds columns `jc + q*nr ..`, stored as
/// `kc` groups of `nr` values, converted to `f32` from `B`'s storage format.
///
/// # Safety
/// The block must lie inside `B`; `out` holds at least `kc*ceil(nc/nr)*nr` floats.
pub(super) unsafe fn pack_b(
    g: &Gemm,
    pc: usize,
    kc: usize,
    jc: usize,
    nc: usize,
    nr: usize,
    out: &mut [f32],
) {
    if let BFormat::PackedI8 { nr: stored, scales } = g.b_format
        && stored == nr
        && jc.is_multiple_of(nr)
    {
        // Whole stored panels: each row of bytes becomes a row of the packed block.
        for (panel, cols) in (0..nc).step_by(nr).enumerate() {
            let first = jc + cols;
            // SAFETY: per the contract, the block lies inside B: stored panel
            // `first / nr` holds `k` rows of `nr` bytes, and the scales cover it.
            let (bytes, scales) = unsafe {
                (
                    std::slice::from_raw_parts(
                        g.b.cast::<i8>().add(first * g.k + pc * nr),
                        kc * nr,
                    ),
                    std::slice::from_raw_parts(scales.add(first), nr),
                )
            };
            dequantize_panel(
                bytes,
                scales,
                &mut out[panel * nr * kc..(panel + 1) * nr * kc],
            );
        }
        return;
    }
    let mut column = [0.0f32; super::KC_MAX];
    for (panel, cols) in (0..nc).step_by(nr).enumerate() {
        let dst = &mut out[panel * nr * kc..(panel + 1) * nr * kc];
        let valid = nr.min(nc - cols);
        if g.b_transposed && g.b_format == BFormat::F32 {
            // SAFETY: per the contract, columns jc + cols .. + valid, rows pc..pc+kc, lie
            // inside B; `dst` holds the panel.
            unsafe { transposed_f32_panel(g, pc, kc, jc + cols, valid, nr, dst) };
        } else if g.b_transposed {
            // B[p, j] = b[j * ldb + p]: each column of the panel is contiguous in memory.
            for j in 0..nr {
                if j < valid {
                    let run = &mut column[..kc];
                    // SAFETY: column jc + cols + j, rows pc..pc+kc, lie inside B.
                    unsafe { read_b_run(g, (jc + cols + j) * g.ldb + pc, run) };
                    for (p, &v) in run.iter().enumerate() {
                        dst[p * nr + j] = v;
                    }
                } else {
                    for p in 0..kc {
                        dst[p * nr + j] = 0.0;
                    }
                }
            }
        } else {
            for p in 0..kc {
                let row = &mut dst[p * nr..(p + 1) * nr];
                // SAFETY: row pc + p, columns jc+cols .. +valid, lie inside B.
                unsafe { read_b_run(g, (pc + p) * g.ldb + jc + cols, &mut row[..valid]) };
                row[valid..].fill(0.0);
            }
        }
    }
}

crate::vmath::multiversion! {
    /// Rows of `scales.len()` signed bytes into `f32` rows, column `j` times
    /// `scales[j]` (the conversion vectorizes per instruction set).
    fn dequantize_panel(bytes: &[i8], scales: &[f32], out: &mut [f32]) {
        let nr = scales.len();
        if let Ok(scales) = <&[f32; 16]>::try_from(scales) {
            // The AVX2 kernel's width, as a constant: whole rows in two vectors (the
            // general loop below runs four lanes at a time for so short a row).
            for (row, dst) in bytes.chunks_exact(16).zip(out.chunks_exact_mut(16)) {
                for ((d, &q), &s) in dst.iter_mut().zip(row).zip(scales) {
                    *d = f32::from(q) * s;
                }
            }
            return;
        }
        for (row, dst) in bytes.chunks_exact(nr).zip(out.chunks_exact_mut(nr)) {
            for ((d, &q), &s) in dst.iter_mut().zip(row).zip(scales) {
                *d = f32::from(q) * s;
            }
        }
    }
}

/// One panel of a transposed `f32` `B` (`B[p, j] = b[j * ldb + p]`): columns `c0 ..
/// c0 + valid`, rows `pc .. pc + kc`, into `dst` (`kc` groups of `nr`, zero past
/// `valid`). Blocks of 8 x 8 are transposed in registers where the CPU has AVX; the
/// rest goes value by value.
///
/// # Safety
/// The block must lie inside `B`; `dst` holds `kc * nr` floats.
unsafe fn transposed_f32_panel(
    g: &Gemm,
    pc: usize,
    kc: usize,
    c0: usize,
    valid: usize,
    nr: usize,
    dst: &mut [f32],
) {
    // SAFETY: columns c0..c0 + valid, rows pc..pc + kc, lie inside B; `dst` holds
    // `kc` rows of `nr >= valid` floats.
    unsafe { transpose_into(g.b.add(c0 * g.ldb + pc), g.ldb, dst, nr, (kc, valid)) };
    for row in dst[..kc * nr].chunks_exact_mut(nr) {
        row[valid..].fill(0.0);
    }
}

/// Writes `rows x cols` values to `dst` (row stride `ldd`) as the transpose of the
/// `cols x rows` block at `src` (row stride `lds`): `dst[r * ldd + c] = src[c * lds +
/// r]`. 8 x 8 blocks go through registers where the CPU has AVX, sixteen output rows
/// at a time, so every line of them is filled in order and each step reads whole
/// 64-byte lines of the source (down the output instead, each step touches one line
/// of every output row, `ldd` floats apart: the same cache set when that is a
/// multiple of 1024); the edges go value by value.
///
/// # Safety
/// The source block lies inside its matrix; `dst` holds `rows` rows of `ldd >= cols`
/// floats.
unsafe fn transpose_into(
    src: *const f32,
    lds: usize,
    dst: &mut [f32],
    ldd: usize,
    (rows, cols): (usize, usize),
) {
    let (mut full_rows, mut full_cols) = (0, 0);
    #[cfg(target_arch = "x86_64")]
    if crate::vmath::simd_level() >= 1 {
        (full_rows, full_cols) = (rows / 8 * 8, cols / 8 * 8);
        for first in (0..full_rows).step_by(16) {
            for c in (0..full_cols).step_by(8) {
                for r in (first..(first + 16).min(full_rows)).step_by(8) {
                    // SAFETY: AVX is available (level 1 has AVX2); the 8 x 8 source
                    // block (rows c.., columns r..) and its transpose in `dst` lie
                    // inside them, per the contract.
                    unsafe {
                        x86::transpose_8x8(
                            src.add(c * lds + r),
                            lds,
                            dst[r * ldd + c..].as_mut_ptr(),
                            ldd,
                        )
                    };
                }
            }
        }
    }
    for r in 0..rows {
        let row = &mut dst[r * ldd..r * ldd + cols];
        let first = if r < full_rows { full_cols } else { 0 };
        for (c, d) in row.iter_mut().enumerate().skip(first) {
            // SAFETY: source row c, column r, lies inside the block.
            *d = unsafe { *src.add(c * lds + r) };
        }
    }
}

/// Writes the transpose of the 8 x 8 block at the start of `src` (row stride `lds`)
/// to `dst` (row stride `ldd`) with vector shuffles, and returns true; returns false,
/// writing nothing, where the CPU lacks AVX (the caller then copies value by value).
///
/// # Panics
/// If either slice is shorter than its 8 rows.
pub(crate) fn transpose_8x8_f32(src: &[f32], lds: usize, dst: &mut [f32], ldd: usize) -> bool {
    assert!(src.len() >= 7 * lds + 8 && dst.len() >= 7 * ldd + 8);
    #[cfg(target_arch = "x86_64")]
    if crate::vmath::simd_level() >= 1 {
        // SAFETY: AVX is available (level 1 has AVX2); both blocks lie inside their
        // slices (checked above).
        unsafe { x86::transpose_8x8(src.as_ptr(), lds, dst.as_mut_ptr(), ldd) };
        return true;
    }
    false
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// Writes the transpose of the 8 x 8 block at `src` (row stride `lds`) to `dst`
    /// (row stride `ldd`): row `i` of the output is column `i` of the input.
    ///
    /// # Safety
    /// AVX must be available; both blocks must be valid for 8 rows of 8 floats.
    #[target_feature(enable = "avx")]
    pub(super) unsafe fn transpose_8x8(src: *const f32, lds: usize, dst: *mut f32, ldd: usize) {
        // SAFETY: per the contract.
        unsafe {
            let row = |i: usize| _mm256_loadu_ps(src.add(i * lds));
            let (r0, r1, r2, r3) = (row(0), row(1), row(2), row(3));
            let (r4, r5, r6, r7) = (row(4), row(5), row(6), row(7));
            // Rows interleaved in pairs: `lo01` holds elements 0, 1 (and 4, 5) of rows 0
            // and 1, `hi01` elements 2, 3 (and 6, 7).
            let (lo01, hi01) = (_mm256_unpacklo_ps(r0, r1), _mm256_unpackhi_ps(r0, r1));
            let (lo23, hi23) = (_mm256_unpacklo_ps(r2, r3), _mm256_unpackhi_ps(r2, r3));
            let (lo45, hi45) = (_mm256_unpacklo_ps(r4, r5), _mm256_unpackhi_ps(r4, r5));
            let (lo67, hi67) = (_mm256_unpacklo_ps(r6, r7), _mm256_unpackhi_ps(r6, r7));
            // `top[c]`: column c (low half) and c + 4 (high half) of rows 0..4;
            // `bottom[c]` the same of rows 4..8.
            let top = [
                _mm256_shuffle_ps::<0x44>(lo01, lo23),
                _mm256_shuffle_ps::<0xEE>(lo01, lo23),
                _mm256_shuffle_ps::<0x44>(hi01, hi23),
                _mm256_shuffle_ps::<0xEE>(hi01, hi23),
            ];
            let bottom = [
                _mm256_shuffle_ps::<0x44>(lo45, lo67),
                _mm256_shuffle_ps::<0xEE>(lo45, lo67),
                _mm256_shuffle_ps::<0x44>(hi45, hi67),
                _mm256_shuffle_ps::<0xEE>(hi45, hi67),
            ];
            for c in 0..4 {
                let low = _mm256_permute2f128_ps::<0x20>(top[c], bottom[c]);
                let high = _mm256_permute2f128_ps::<0x31>(top[c], bottom[c]);
                _mm256_storeu_ps(dst.add(c * ldd), low);
                _mm256_storeu_ps(dst.add((c + 4) * ldd), high);
            }
        }
    }
}

/// Reads `dst.len()` consecutive elements of `B` from element `offset` on, as `f32`.
///
/// # Safety
/// The elements must lie inside `B`.
pub(super) unsafe fn read_b_run(g: &Gemm, offset: usize, dst: &mut [f32]) {
    let len = dst.len();
    match g.b_format {
        BFormat::F32 => {
            // SAFETY: per the contract.
            let src = unsafe { std::slice::from_raw_parts(g.b.add(offset), len) };
            dst.copy_from_slice(src);
        }
        BFormat::F16 => {
            // SAFETY: per the contract; half-precision B holds `u16` elements.
            let src =
                unsafe { std::slice::from_raw_parts(g.b.cast::<half::f16>().add(offset), len) };
            crate::vmath::f16_to_f32(src, dst);
        }
        BFormat::Quant(format) => {
            let (row, start) = (offset / g.ldb, offset % g.ldb);
            let row_bytes = g.ldb / format.block_len() * format.block_bytes();
            // SAFETY: per the contract, values start.. of stored row `row` exist, and
            // `b` points at the packed bytes for this format.
            unsafe {
                crate::quant::decode_run(format, g.b.cast::<u8>().add(row * row_bytes), start, dst)
            };
        }
        BFormat::Packed { nr, .. } => {
            // The serial loop reads packed panels in place; this element-wise form
            // keeps the format well defined everywhere else.
            for (i, d) in dst.iter_mut().enumerate() {
                let (r, c) = ((offset + i) / g.ldb, (offset + i) % g.ldb);
                // SAFETY: per the contract, (r, c) lies inside B, whose panel of column
                // c holds k rows of nr values.
                *d = unsafe { *g.b.add(c / nr * nr * g.k + r * nr + c % nr) };
            }
        }
        BFormat::PackedI8 { nr, scales } => {
            for (i, d) in dst.iter_mut().enumerate() {
                let (r, c) = ((offset + i) / g.ldb, (offset + i) % g.ldb);
                // SAFETY: per the contract, (r, c) lies inside B, whose panel of column
                // c holds k rows of nr bytes, and the scales cover every column.
                *d = unsafe {
                    f32::from(*g.b.cast::<i8>().add(c / nr * nr * g.k + r * nr + c % nr))
                        * *scales.add(c)
                };
            }
        }
        BFormat::BF16 => {
            // SAFETY: as above.
            let src = unsafe { std::slice::from_raw_parts(g.b.cast::<u16>().add(offset), len) };
            for (d, &bits) in dst.iter_mut().zip(src) {
                *d = f32::from_bits(u32::from(bits) << 16);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_8x8_block_transposes_between_strided_rows() {
        let (lds, ldd) = (13, 11);
        let src: Vec<f32> = (0..7 * lds + 8).map(|i| i as f32 * 0.5 - 7.0).collect();
        let mut dst = vec![f32::NAN; 7 * ldd + 8];
        if !transpose_8x8_f32(&src, lds, &mut dst, ldd) {
            return; // No AVX: the callers copy value by value.
        }
        for i in 0..8 {
            for j in 0..8 {
                assert_eq!(dst[i * ldd + j], src[j * lds + i], "({i}, {j})");
            }
            // Nothing between the rows is written.
            if i < 7 {
                assert!(dst[i * ldd + 8..(i + 1) * ldd].iter().all(|v| v.is_nan()));
            }
        }
    }
}
