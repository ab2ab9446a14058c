//! Block sizes of the blocked GEMM loops, chosen per product from the shape and the
//! size of the per-core L2 cache.
//!
//! The depth `kc` is as large as the L2 allows: every `K` block but the first reads
//! and writes all of `C` once more, and for products whose `C` does not fit in cache
//! (MiniLM at batch 32 writes 24 MB per product) that traffic, not the arithmetic, was
//! what set the speed. A deep block makes the `B` micro-panel (`kc x NR`) larger than
//! L1, but the kernel streams it from L2 fast enough, and it is read by `MC / MR` row
//! tiles in turn. The width `nc` then keeps the packed `B` block (`kc x nc`) in L2.

/// `(depth, columns)` of the packed `B` block, and rows of `A` per block, for one
/// product.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(super) struct Blocking {
    /// Depth of one `K` block.
    pub kc: usize,
    /// Columns of `B` packed at once (a multiple of `nr`).
    pub nc: usize,
    /// Rows of `A` per block (a multiple of `mr`).
    pub mc: usize,
}

/// The deepest `K` block any product uses.
pub(super) const KC_MAX: usize = 1536;
/// The shallowest cap on the depth, for CPUs with a small L2.
const KC_MIN: usize = 192;
/// The widest `B` block.
const NC_MAX: usize = 480;
/// Rows of `A` per block, before rounding to a multiple of `MR`.
pub(super) const MC: usize = 96;
/// The share of L2, in eighths, the packed `B` block may fill (the rest holds the
/// rows of `A` and `C` the kernel touches).
const B_BLOCK_EIGHTHS: usize = 7;

impl Blocking {
    /// Blocks for a `rows x cols x k` part of a product with an `mr x nr` kernel.
    pub fn new(rows: usize, cols: usize, k: usize, (mr, nr): (usize, usize)) -> Blocking {
        Self::for_l2(rows, cols, k, (mr, nr), l2_bytes())
    }

    fn for_l2(rows: usize, cols: usize, k: usize, (mr, nr): (usize, usize), l2: usize) -> Blocking {
        let budget_floats = l2 / 8 * B_BLOCK_EIGHTHS / 4;
        // The micro-panel should take at most half the budget, so that at least two
        // panels of the block fit.
        let kc_cap = (budget_floats / (2 * nr)).clamp(KC_MIN, KC_MAX);
        let kc = even(k, kc_cap, 8).min(kc_cap);
        let nc_cap = (budget_floats / kc.max(1) / nr * nr).clamp(nr, NC_MAX / nr * nr);
        let mc_cap = (MC / mr).max(1) * mr;
        Blocking {
            kc,
            nc: even(cols, nc_cap, nr).min(nc_cap),
            mc: even(rows, mc_cap, mr).min(mc_cap),
        }
    }

    /// Blocks for a product whose `A` is packed (a transposed `A`): `A` is packed once
    /// per column block, so the column block takes all of the rectangle's columns
    /// that fit the packed-`B` buffer with a shallower `K` block (at least 256 deep).
    pub fn with_packed_a(rows: usize, cols: usize, k: usize, (mr, nr): (usize, usize)) -> Blocking {
        let plain = Self::new(rows, cols, k, (mr, nr));
        let room = Self::max_b_block_floats();
        let wide = cols.next_multiple_of(nr);
        let kc =
            even(k, (room / wide.max(1)).clamp(256, plain.kc.max(256)), 8).min(plain.kc.max(8));
        if kc * wide > room {
            return plain;
        }
        Blocking {
            kc,
            nc: wide,
            ..plain
        }
    }

    /// Floats of the packed `B` block buffer every product fits in.
    pub fn max_b_block_floats() -> usize {
        Self::max_b_block_floats_for(l2_bytes())
    }

    fn max_b_block_floats_for(l2: usize) -> usize {
        let budget_floats = l2 / 8 * B_BLOCK_EIGHTHS / 4;
        // `kc * nc` is at most the budget, or one panel (`nc = nr`) when a panel at the
        // deepest depth is larger; 64 covers every kernel's `nr`.
        budget_floats.max(KC_MAX * 64)
    }
}

/// The block length that cuts `len` into as few blocks of at most `limit` as
/// possible, all about the same size, rounded up to a multiple of `unit`: no thin
/// leftover block repeats the per-block work.
pub(super) fn even(len: usize, limit: usize, unit: usize) -> usize {
    let blocks = len.div_ceil(limit).max(1);
    len.div_ceil(blocks).div_ceil(unit) * unit
}

/// Bytes of L2 cache per core (detected once; 512 KiB where it cannot be read).
pub(super) fn l2_bytes() -> usize {
    static L2: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *L2.get_or_init(|| detect_l2().unwrap_or(512 << 10))
}

#[cfg(target_arch = "x86_64")]
fn detect_l2() -> Option<usize> {
    use std::arch::x86_64::__cpuid;
    // Extended leaf 0x8000_0006 gives the L2 size in KiB in ECX[31:16], on both AMD
    // and Intel processors.
    let max_leaf = __cpuid(0x8000_0000).eax;
    if max_leaf < 0x8000_0006 {
        return None;
    }
    let kib = (__cpuid(0x8000_0006).ecx >> 16) as usize;
    (kib >= 128).then_some(kib << 10)
}

#[cfg(not(target_arch = "x86_64"))]
fn detect_l2() -> Option<usize> {
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn deep_blocks_fit_the_l2_budget_and_cover_the_product() {
        for l2 in [256 << 10, 512 << 10, 1 << 20, 2 << 20] {
            let budget = l2 / 8 * B_BLOCK_EIGHTHS / 4;
            for (rows, cols, k) in [(1024, 1024, 1024), (4096, 1536, 384), (7, 5, 3000)] {
                for (mr, nr) in [(8, 48), (8, 32), (6, 16), (4, 8)] {
                    let b = Blocking::for_l2(rows, cols, k, (mr, nr), l2);
                    assert!(
                        b.kc >= 1 && b.kc <= KC_MAX && b.kc.is_multiple_of(8),
                        "{b:?}"
                    );
                    assert!(
                        b.nc.is_multiple_of(nr) && b.nc >= nr && b.nc <= NC_MAX,
                        "{b:?}"
                    );
                    assert!(b.mc.is_multiple_of(mr) && b.mc >= mr, "{b:?}");
                    assert!(b.kc * b.nc <= budget.max(KC_MIN * nr), "{b:?} {l2}");
                    assert!(b.kc * b.nc <= Blocking::max_b_block_floats_for(l2), "{b:?}");
                    // The blocks tile the product with no thin remainder.
                    let k_blocks = k.div_ceil(b.kc);
                    assert!(k_blocks == 1 || k - (k_blocks - 1) * b.kc >= b.kc / 2);
                }
            }
        }
        // On a 1 MiB L2, MiniLM's depths of 384 and 1536 take one block.
        let b = Blocking::for_l2(4096, 1536, 384, (8, 48), 1 << 20);
        assert_eq!(b.kc, 384);
        let b = Blocking::for_l2(4096, 384, 1536, (8, 48), 1 << 20);
        assert_eq!(b.kc, 1536);
    }
}
