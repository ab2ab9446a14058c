//! Dilated 2-D convolutions whose windows reach far into the padding, split into
//! regions of the output that each read one rectangle of taps inside the input.
//!
//! Along an axis, tap `k` of output `y` reads input `y * stride + k * dilation -
//! begin`. Each tap is inside the input for one run of outputs, so the outputs fall
//! into segments over which the same (contiguous) taps are live: with dilation 12
//! over 16 positions, the first 4 outputs read taps 1 and 2, the middle 8 only tap 1,
//! the last 4 taps 0 and 1. A convolution over the whole output multiplies every tap
//! of every output, most of them by padding zeros (a quarter of the products are
//! live in that example, in 2-D). Each region (a segment of rows by a segment of
//! columns) is instead a convolution without padding of the input rectangle it reads
//! by its live taps, and the regions are joined by concatenation. Where the
//! weights outweigh the output (many channels over a small plane), the convolution
//! is instead summed tap by tap: each live tap a 1x1 convolution of the input
//! rectangle its live outputs read, padded with zeros to the output and added, so
//! each tap's weights are read once ([`split_by_tap`]).

use crate::import::Cx;
use rlx_ir::{NodeId, Result};

/// At most this share of a convolution's products may be live for it to be split:
/// every region is a launch of its own with its own slice of the weights.
const MAX_LIVE_SHARE: f64 = 0.6;
/// At most this many regions (a dilated window's three segments per axis): a wide
/// window over few positions (a 128-tap positional convolution over 50 frames)
/// would cut a segment per output, a launch each.
const MAX_REGIONS: usize = 9;

/// Outputs `start..end` along an axis, whose windows all read taps `first..=last`
/// inside the input.
#[derive(Clone, Copy, Debug, PartialEq)]
struct Segment {
    start: usize,
    end: usize,
    first: usize,
    last: usize,
}

/// The segments of the `out` outputs along an axis of `n` inputs, or `None` when
/// some output reads no tap inside the input (it is only padding and bias).
fn segments(
    n: usize,
    kernel: usize,
    [stride, dilation]: [usize; 2],
    begin: usize,
    out: usize,
) -> Option<Vec<Segment>> {
    // Outputs `lo..hi` for which tap `k` lies inside the input.
    let live: Vec<(usize, usize)> = (0..kernel)
        .map(|k| {
            let offset = (k * dilation) as i64 - begin as i64;
            let lo = if offset >= 0 {
                0
            } else {
                ((-offset) as usize).div_ceil(stride)
            };
            let reach = n as i64 - 1 - offset;
            let hi = if reach < 0 {
                0
            } else {
                (reach as usize / stride + 1).min(out)
            };
            (lo.min(out), hi.max(lo.min(out)))
        })
        .collect();
    let mut cuts: Vec<usize> = live.iter().flat_map(|&(lo, hi)| [lo, hi]).collect();
    cuts.extend([0, out]);
    cuts.sort_unstable();
    cuts.dedup();
    let mut segs = Vec::new();
    for pair in cuts.windows(2) {
        let (start, end) = (pair[0], pair[1]);
        let taps: Vec<usize> = (0..kernel)
            .filter(|&k| live[k].0 <= start && end <= live[k].1)
            .collect();
        let (&first, &last) = (taps.first()?, taps.last()?);
        if last - first + 1 != taps.len() {
            return None;
        }
        segs.push(Segment {
            start,
            end,
            first,
            last,
        });
    }
    Some(segs)
}

/// The share of an axis's products (outputs times taps) that read inside the input.
fn live_share(segs: &[Segment], kernel: usize, out: usize) -> f64 {
    let live: usize = segs
        .iter()
        .map(|s| (s.end - s.start) * (s.last - s.first + 1))
        .sum();
    live as f64 / (out * kernel).max(1) as f64
}

/// The 2-D convolution of `x` by `w` split into regions (see the module doc), or
/// `None` when that does not save enough products. `padding` is `[top, left,
/// bottom, right]`.
pub(super) fn split_conv(
    cx: &Cx,
    (x, w, bias): (NodeId, NodeId, Option<NodeId>),
    [stride, dilation]: [[usize; 2]; 2],
    padding: [usize; 4],
    groups: usize,
) -> Result<Option<NodeId>> {
    let xd = cx.g.shape(x)?.dims().to_vec();
    let wd = cx.g.shape(w)?.dims().to_vec();
    if xd.len() != 4 || wd.len() != 4 || padding == [0; 4] {
        return Ok(None);
    }
    let mut axes = Vec::with_capacity(2);
    let mut share = 1.0;
    for a in 0..2 {
        let (n, k, s, d) = (xd[2 + a], wd[2 + a], stride[a], dilation[a]);
        if k == 0 || d == 0 || s == 0 || n == 0 {
            return Ok(None);
        }
        let padded = n + padding[a] + padding[a + 2];
        let span = (k - 1) * d + 1;
        if padded < span {
            return Ok(None);
        }
        let out = (padded - span) / s + 1;
        let Some(segs) = segments(n, k, [s, d], padding[a], out) else {
            return Ok(None);
        };
        share *= live_share(&segs, k, out);
        axes.push(segs);
    }
    let regions = axes[0].len() * axes[1].len();
    if share > MAX_LIVE_SHARE || regions == 1 || regions > MAX_REGIONS {
        return Ok(None);
    }
    if let Some(y) = split_by_tap(
        cx,
        (x, w, bias),
        (&axes, [stride, dilation]),
        padding,
        groups,
    )? {
        return Ok(Some(y));
    }
    let mut rows = Vec::with_capacity(axes[0].len());
    for r in &axes[0] {
        let mut cols = Vec::with_capacity(axes[1].len());
        for c in &axes[1] {
            // The input rectangle the region reads, and its taps.
            let read = |seg: &Segment, a: usize| {
                let first = seg.start * stride[a] + seg.first * dilation[a] - padding[a];
                let last = (seg.end - 1) * stride[a] + seg.last * dilation[a] - padding[a];
                (first as isize, last as isize + 1)
            };
            let ((r0, r1), (c0, c1)) = (read(r, 0), read(c, 1));
            let part = cx.g.slice_axes(x, &[(2, r0, r1, 1), (3, c0, c1, 1)])?;
            let taps = cx.g.slice_axes(
                w,
                &[
                    (2, r.first as isize, r.last as isize + 1, 1),
                    (3, c.first as isize, c.last as isize + 1, 1),
                ],
            )?;
            cols.push(cx.g.conv2d(part, taps, bias, stride, [0; 4], dilation, groups)?);
        }
        rows.push(if cols.len() == 1 {
            cols[0]
        } else {
            cx.g.concat(&cols, 3)?
        });
    }
    Ok(Some(if rows.len() == 1 {
        rows[0]
    } else {
        cx.g.concat(&rows, 2)?
    }))
}

/// The live outputs `lo..hi` of tap `k` along an axis: the union of the segments
/// that read it.
fn tap_outputs(segs: &[Segment], k: usize) -> Option<(usize, usize)> {
    let live: Vec<&Segment> = segs
        .iter()
        .filter(|s| s.first <= k && k <= s.last)
        .collect();
    Some((live.first()?.start, live.last()?.end))
}

/// The convolution as a sum over its live taps instead of its regions, when that
/// reads fewer values: each tap a 1x1 convolution of the input rectangle its live
/// outputs read (the weights' slice for it read once, where each region reads its
/// own slice of every tap it has), padded with zeros to the output and added. A
/// tap whose outputs are all of them carries the bias and starts the sum; without
/// one, `None`. DeepLabV3's rate-12 atrous convolution over a 16 x 16 plane reads
/// 25 taps' weights as 9 regions and 9 as taps, and its centre tap is one
/// 256-pixel product instead of a 64-pixel one.
fn split_by_tap(
    cx: &Cx,
    (x, w, bias): (NodeId, NodeId, Option<NodeId>),
    (axes, [stride, dilation]): (&[Vec<Segment>], [[usize; 2]; 2]),
    padding: [usize; 4],
    groups: usize,
) -> Result<Option<NodeId>> {
    let xd = cx.g.shape(x)?.dims().to_vec();
    let wd = cx.g.shape(w)?.dims().to_vec();
    let out = [0, 1].map(|a| axes[a].last().map_or(0, |s| s.end));
    let (n, o) = (xd[0], wd[0]);
    // Values read: each region its taps' weights; each tap its weights once, and
    // its padded partial sum written and added (about three passes over it).
    let per_tap = wd[1] * o;
    let region_taps: usize = axes[0]
        .iter()
        .flat_map(|r| {
            axes[1]
                .iter()
                .map(move |c| (r.last - r.first + 1) * (c.last - c.first + 1))
        })
        .sum();
    let mut taps = Vec::new();
    for ky in 0..wd[2] {
        for kx in 0..wd[3] {
            if let (Some(rows), Some(cols)) = (tap_outputs(&axes[0], ky), tap_outputs(&axes[1], kx))
            {
                taps.push(([ky, kx], [rows, cols]));
            }
        }
    }
    let sums = 3 * (taps.len() - 1) * n * o * out[0] * out[1];
    let Some(full) = taps
        .iter()
        .position(|&(_, live)| live == [(0, out[0]), (0, out[1])])
    else {
        return Ok(None);
    };
    if taps.len() * per_tap + sums >= region_taps * per_tap {
        return Ok(None);
    }
    // Tap `k`'s 1x1 convolution over its live outputs `live`, and the zeros that
    // pad it to the whole output.
    let tap_sum = |(k, live): ([usize; 2], [(usize, usize); 2]), b: Option<NodeId>| {
        let read = |a: usize| {
            let (lo, hi) = live[a];
            let first = lo * stride[a] + k[a] * dilation[a] - padding[a];
            (
                first as isize,
                (first + (hi - lo - 1) * stride[a] + 1) as isize,
            )
        };
        let ((r0, r1), (c0, c1)) = (read(0), read(1));
        let part = cx.g.slice_axes(x, &[(2, r0, r1, 1), (3, c0, c1, 1)])?;
        let (ky, kx) = (k[0] as isize, k[1] as isize);
        let taps =
            cx.g.slice_axes(w, &[(2, ky, ky + 1, 1), (3, kx, kx + 1, 1)])?;
        let y = cx.g.conv2d(part, taps, b, stride, [0; 4], [1, 1], groups)?;
        let pads = [
            (0, 0),
            (0, 0),
            (live[0].0, out[0] - live[0].1),
            (live[1].0, out[1] - live[1].1),
        ];
        Ok::<_, rlx_ir::Error>((y, pads))
    };
    let (mut sum, _) = tap_sum(taps[full], bias)?;
    for (i, &tap) in taps.iter().enumerate() {
        if i == full {
            continue;
        }
        let (y, pads) = tap_sum(tap, None)?;
        let zero = rlx_ir::PadMode::Constant(rlx_ir::F64Bits::new(0.0));
        let placed = cx.g.pad(y, &pads, zero)?;
        sum = cx.g.binary(rlx_ir::BinaryOp::Add, sum, placed)?;
    }
    Ok(Some(sum))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_follow_the_live_taps() {
        // Dilation 12 over 16 positions, padding 12: taps {1, 2}, {1}, {0, 1}.
        let segs = segments(16, 3, [1, 12], 12, 16).unwrap();
        let runs: Vec<(usize, usize, usize, usize)> = segs
            .iter()
            .map(|s| (s.start, s.end, s.first, s.last))
            .collect();
        assert_eq!(runs, [(0, 4, 1, 2), (4, 12, 1, 1), (12, 16, 0, 1)]);
        assert!((live_share(&segs, 3, 16) - 0.5).abs() < 1e-12);
        // Padding 1: the first and last outputs miss one tap each.
        let segs = segments(10, 3, [1, 1], 1, 10).unwrap();
        assert_eq!(segs.len(), 3);
        // No padding: every output reads every tap.
        let segs = segments(10, 3, [1, 1], 0, 8).unwrap();
        assert_eq!(
            segs,
            [Segment {
                start: 0,
                end: 8,
                first: 0,
                last: 2
            }]
        );
        // Stride 2: output y reads 2y + 3k - 3.
        let segs = segments(9, 3, [2, 3], 3, 5).unwrap();
        for s in &segs {
            for y in s.start..s.end {
                for k in 0..3 {
                    let at = (2 * y + 3 * k) as i64 - 3;
                    let inside = (0..9).contains(&at);
                    assert_eq!(inside, (s.first..=s.last).contains(&k), "y {y} k {k}");
                }
            }
        }
        // An output that reads only padding: not split.
        assert!(segments(2, 1, [1, 1], 5, 12).is_none());
    }
}
