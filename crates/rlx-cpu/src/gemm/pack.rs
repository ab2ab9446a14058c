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
    let mut column = [0.0f32; super::KC_MAX];
    for (panel, cols) in (0..nc).step_by(nr).enumerate() {
        let dst = &mut out[panel * nr * kc..(panel + 1) * nr * kc];
        let valid = nr.min(nc - cols);
        if g.b_transposed {
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

/// Reads `dst.len()` consecutive elements of `B` from element `offset` on, as `f32`.
///
/// # Safety
/// The elements must lie inside `B`.
unsafe fn read_b_run(g: &Gemm, offset: usize, dst: &mut [f32]) {
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
        BFormat::Packed { nr } => {
            // The serial loop reads packed panels in place; this element-wise form
            // keeps the format well defined everywhere else.
            for (i, d) in dst.iter_mut().enumerate() {
                let (r, c) = ((offset + i) / g.ldb, (offset + i) % g.ldb);
                // SAFETY: per the contract, (r, c) lies inside B, whose panel of column
                // c holds k rows of nr values.
                *d = unsafe { *g.b.add(c / nr * nr * g.k + r * nr + c % nr) };
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
