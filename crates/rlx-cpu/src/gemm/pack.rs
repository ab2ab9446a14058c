//! Packing: copies a block of `B` into `NR`-column panels laid out in the order the
//! micro-kernel reads them, and the last short row panel of `A` into zero-padded rows;
//! both padded with zeros past the matrix edge.

use super::Gemm;

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
/// `kc` groups of `nr` values.
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
    for (panel, cols) in (0..nc).step_by(nr).enumerate() {
        let dst = &mut out[panel * nr * kc..(panel + 1) * nr * kc];
        let valid = nr.min(nc - cols);
        if g.b_transposed {
            // B[p, j] = b[j * ldb + p]: each column of the panel is contiguous in memory.
            for j in 0..nr {
                if j < valid {
                    // SAFETY: column jc + cols + j, rows pc..pc+kc, lie inside B.
                    let src = unsafe {
                        std::slice::from_raw_parts(g.b.add((jc + cols + j) * g.ldb + pc), kc)
                    };
                    for (p, &v) in src.iter().enumerate() {
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
                let src = unsafe {
                    std::slice::from_raw_parts(g.b.add((pc + p) * g.ldb + jc + cols), valid)
                };
                row[..valid].copy_from_slice(src);
                row[valid..].fill(0.0);
            }
        }
    }
}
