//! Offset assignment for values with known lifetimes: lifetimes in, offsets out.
//!
//! The strategy is greedy by size with best fit: the largest values are placed first,
//! each into the smallest gap between already-placed values whose lifetimes overlap
//! its own, or above them all when no gap fits.

use rlx_ir::{Error, Result};

/// One value to place: `size` bytes, live from step `start` to step `end` inclusive.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Lifetime {
    /// Bytes needed.
    pub size: usize,
    /// First step at which the value is live (when it is written).
    pub start: usize,
    /// Last step at which the value is live (its last read).
    pub end: usize,
}

impl Lifetime {
    fn overlaps(&self, other: &Lifetime) -> bool {
        self.start <= other.end && other.start <= self.end
    }
}

/// The result of [`assign_offsets`].
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct OffsetAssignment {
    /// Byte offset of each value, in input order.
    pub offsets: Vec<usize>,
    /// Bytes the arena needs.
    pub arena_bytes: usize,
    /// The largest total of simultaneously live bytes (no assignment can use less).
    pub lower_bound: usize,
}

/// Assigns every value an offset (a multiple of `align`) such that values whose
/// lifetimes overlap never share bytes. With `reuse` off, every value gets its own
/// bytes (useful to rule the planner out when chasing a miscompile).
///
/// # Errors
/// [`Error::SizeOverflow`] when an aligned size, an offset or the arena would pass
/// `isize::MAX` bytes (every sum is checked; nothing wraps).
pub fn assign_offsets(values: &[Lifetime], align: usize, reuse: bool) -> Result<OffsetAssignment> {
    let align = align.max(1);
    let too_large = |what: String| Error::SizeOverflow {
        context: "memory plan".into(),
        what,
    };
    let padded: Vec<usize> = values
        .iter()
        .map(|v| {
            v.size
                .div_ceil(align)
                .checked_mul(align)
                .filter(|&p| p <= isize::MAX as usize)
                .ok_or_else(|| too_large(format!("a value of {} bytes", v.size)))
        })
        .collect::<Result<_>>()?;
    let mut offsets = vec![0usize; values.len()];
    let mut order: Vec<usize> = (0..values.len()).filter(|&i| values[i].size > 0).collect();
    order.sort_by_key(|&i| (std::cmp::Reverse(values[i].size), values[i].start, i));
    let mut placed: Vec<usize> = Vec::with_capacity(order.len());
    let mut arena = 0usize;
    for &i in &order {
        let size = padded[i];
        let offset = if reuse {
            // Placed values end at most at `arena`, which is checked below.
            let mut busy: Vec<(usize, usize)> = placed
                .iter()
                .filter(|&&j| values[j].overlaps(&values[i]))
                .map(|&j| (offsets[j], offsets[j] + padded[j]))
                .collect();
            busy.sort_unstable();
            let mut best: Option<(usize, usize)> = None; // (gap size, offset)
            let mut cursor = 0usize;
            for &(lo, hi) in &busy {
                if lo > cursor {
                    let gap = lo - cursor;
                    if gap >= size && best.is_none_or(|(g, _)| gap < g) {
                        best = Some((gap, cursor));
                    }
                }
                cursor = cursor.max(hi);
            }
            best.map_or(cursor, |(_, off)| off)
        } else {
            arena
        };
        let end = offset
            .checked_add(size)
            .filter(|&e| e <= isize::MAX as usize)
            .ok_or_else(|| {
                too_large(format!(
                    "an arena of {} values (a value of {} bytes at offset {offset})",
                    order.len(),
                    values[i].size
                ))
            })?;
        offsets[i] = offset;
        arena = arena.max(end);
        placed.push(i);
    }
    Ok(OffsetAssignment {
        offsets,
        arena_bytes: arena,
        lower_bound: lower_bound(values, align),
    })
}

/// The largest total of (aligned) bytes live at any one step (saturating at
/// `usize::MAX`).
pub fn lower_bound(values: &[Lifetime], align: usize) -> usize {
    let align = align.max(1) as i128;
    let mut events: Vec<(usize, i128)> = Vec::with_capacity(values.len() * 2);
    for v in values.iter().filter(|v| v.size > 0) {
        let size = (v.size as i128 + align - 1) / align * align;
        events.push((v.start, size));
        events.push((v.end.saturating_add(1), -size));
    }
    // At equal steps, frees (negative) come before allocations.
    events.sort_unstable();
    let (mut live, mut peak) = (0i128, 0i128);
    for (_, delta) in events {
        live += delta;
        peak = peak.max(live);
    }
    usize::try_from(peak).unwrap_or(usize::MAX)
}

/// Checks that no two overlapping lifetimes share bytes; returns the first clash.
pub fn find_overlap(values: &[Lifetime], offsets: &[usize]) -> Option<(usize, usize)> {
    for i in 0..values.len() {
        for j in i + 1..values.len() {
            let (a, b) = (&values[i], &values[j]);
            if a.size == 0 || b.size == 0 || !a.overlaps(b) {
                continue;
            }
            if offsets[i] < offsets[j].saturating_add(b.size)
                && offsets[j] < offsets[i].saturating_add(a.size)
            {
                return Some((i, j));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rng(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    #[test]
    fn chain_reuses_two_slots() {
        // A chain where each value lives from its step to the next.
        let values: Vec<Lifetime> = (0..50)
            .map(|t| Lifetime {
                size: 1000,
                start: t,
                end: t + 1,
            })
            .collect();
        let a = assign_offsets(&values, 64, true).unwrap();
        assert_eq!(a.lower_bound, 2 * 1024);
        assert_eq!(a.arena_bytes, 2 * 1024);
        assert!(find_overlap(&values, &a.offsets).is_none());
        let no_reuse = assign_offsets(&values, 64, false).unwrap();
        assert_eq!(no_reuse.arena_bytes, 50 * 1024);
    }

    #[test]
    fn random_schedules_never_overlap_and_stay_near_bound() {
        let mut seed = 0x9e37_79b9_7f4a_7c15u64;
        for _ in 0..200 {
            let n = (rng(&mut seed) % 60) as usize + 1;
            let values: Vec<Lifetime> = (0..n)
                .map(|_| {
                    let start = (rng(&mut seed) % 40) as usize;
                    let len = (rng(&mut seed) % 10) as usize;
                    Lifetime {
                        size: (rng(&mut seed) % 5000) as usize,
                        start,
                        end: start + len,
                    }
                })
                .collect();
            let a = assign_offsets(&values, 64, true).unwrap();
            assert!(find_overlap(&values, &a.offsets).is_none());
            assert!(a.arena_bytes >= a.lower_bound);
            assert!(a.offsets.iter().all(|o| o % 64 == 0));
        }
    }

    #[test]
    fn arena_past_isize_max_is_an_error() {
        let big = isize::MAX as usize / 2;
        let values = vec![
            Lifetime {
                size: big,
                start: 0,
                end: 1,
            };
            3
        ];
        // Live together, or placed apart with reuse off: 3 * (isize::MAX / 2) bytes.
        for reuse in [true, false] {
            let err = assign_offsets(&values, 64, reuse).unwrap_err();
            assert!(matches!(err, Error::SizeOverflow { .. }), "{err}");
        }
        // One step apart, they share the same bytes.
        let apart: Vec<Lifetime> = (0..3)
            .map(|t| Lifetime {
                size: big,
                start: 2 * t,
                end: 2 * t,
            })
            .collect();
        let a = assign_offsets(&apart, 64, true).unwrap();
        assert!(a.arena_bytes < isize::MAX as usize);
        assert!(assign_offsets(&apart, 64, false).is_err());
        // Aligning usize::MAX up overflows.
        let huge = [Lifetime {
            size: usize::MAX,
            start: 0,
            end: 0,
        }];
        assert!(assign_offsets(&huge, 64, true).is_err());
        assert_eq!(lower_bound(&huge, 64), usize::MAX);
    }
}
