//! `AffineGrid` and `GridSample` in primitives: the grid's normalized coordinates
//! become input positions per spatial axis, each position its taps (one, two or
//! four per axis) with weights, and every combination of taps one gather from the
//! input laid out as `[N * spatial, C]`.

use super::{Converter, unsupported};
use crate::import::Cx;
use rlx_ir::{DType, Error, NodeId, Result};

pub(super) const NAMES: &[&str] = &["AffineGrid", "GridSample"];

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "AffineGrid" => affine_grid,
        "GridSample" => grid_sample,
        _ => return None,
    })
}

/// The normalized coordinate of each of `len` positions along an axis, in f64:
/// the centres of `len` equal cells of `[-1, 1]`, or with `align_corners` the two
/// ends and evenly between. Built in the graph, so a declared size costs nothing
/// at import.
fn normalized_positions(cx: &Cx, len: usize, align_corners: bool) -> Result<NodeId> {
    let (first, step) = match (align_corners, len) {
        (true, 1) => (-1.0, 0.0),
        (true, _) => (-1.0, 2.0 / (len - 1) as f64),
        (false, _) => (-1.0 + 1.0 / len as f64, 2.0 / len as f64),
    };
    let i = cx.g.iota(len, DType::F64)?;
    let scaled = cx.g.mul(i, cx.g.scalar(step, DType::F64))?;
    cx.g.add(scaled, cx.g.scalar(first, DType::F64))
}

/// `AffineGrid`: the homogeneous coordinates `(x, y[, z], 1)` of every output
/// position (x along the last axis) times each batch's `theta` transposed.
fn affine_grid(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let td = cx.dims(0)?;
    let dt = cx.dtype(0)?;
    let size: Vec<usize> = cx
        .ints(1)?
        .iter()
        .map(|&v| super::size(v, "size"))
        .collect::<Result<_>>()?;
    let spatial = match size.len() {
        4 | 5 => &size[2..],
        n => {
            return Err(unsupported(format!(
                "AffineGrid of size {size:?} ({n} values; 4 or 5 are defined)"
            )));
        }
    };
    let r = spatial.len();
    if td != [size[0], r, r + 1] {
        return Err(Error::invalid(
            "theta",
            format!("dims {td:?}, expected [{}, {r}, {}]", size[0], r + 1),
        ));
    }
    let align = cx.attr_i("align_corners", 0) != 0;
    let points = spatial
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| Error::invalid("size", format!("{size:?} overflows")))?;
    // One column per coordinate, (x, y[, z]) from the last spatial axis to the
    // first, then the homogeneous 1.
    let mut columns = Vec::with_capacity(r + 1);
    for a in (0..r).rev() {
        let mut along = vec![1; r];
        along[a] = spatial[a];
        let c = normalized_positions(cx, spatial[a], align)?;
        let c = cx.g.expand(cx.g.reshape(c, &along)?, spatial)?;
        columns.push(cx.g.reshape(c, &[points, 1])?);
    }
    columns.push(cx.g.expand(cx.g.scalar(1.0, DType::F64), &[points, 1])?);
    let base = cx.g.cast(cx.g.concat(&columns, 1)?, dt)?;
    let theta = cx.input(0)?;
    let theta_t = cx.g.permute(theta, &[0, 2, 1])?;
    let grid = cx.g.matmul(base, theta_t)?;
    let mut dims = vec![size[0]];
    dims.extend_from_slice(spatial);
    dims.push(r);
    Ok(vec![cx.g.reshape(grid, &dims)?])
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Nearest,
    Linear,
    Cubic,
}

#[derive(Clone, Copy, PartialEq)]
enum Padding {
    Zeros,
    Border,
    Reflection,
}

/// One tap along one axis: the input index (i64, in range) and its weight.
struct Tap {
    index: NodeId,
    weight: NodeId,
}

/// What `GridSample` needs per axis.
struct Axis {
    len: usize,
    /// Coordinates outside `[lo, hi]` are clamped or reflected.
    lo: f64,
    hi: f64,
}

fn grid_sample(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let xd = cx.dims(0)?;
    let gd = cx.dims(1)?;
    let dt = cx.dtype(0)?;
    if !matches!(dt, DType::F32 | DType::F64) {
        return Err(unsupported(format!("GridSample on {dt} data")));
    }
    let r = xd.len().saturating_sub(2);
    if r == 0 || gd.len() != r + 2 || gd[0] != xd[0] || gd[r + 1] != r {
        return Err(Error::invalid(
            "GridSample",
            format!("input {xd:?} and grid {gd:?} do not agree"),
        ));
    }
    let mode = match cx.attr_s("mode", "linear").as_str() {
        "nearest" => Mode::Nearest,
        "linear" | "bilinear" => Mode::Linear,
        "cubic" | "bicubic" => Mode::Cubic,
        other => return Err(unsupported(format!("GridSample mode '{other}'"))),
    };
    let padding = match cx.attr_s("padding_mode", "zeros").as_str() {
        "zeros" => Padding::Zeros,
        "border" => Padding::Border,
        "reflection" => Padding::Reflection,
        other => return Err(unsupported(format!("GridSample padding_mode '{other}'"))),
    };
    let align = cx.attr_i("align_corners", 0) != 0;
    let (n, c) = (xd[0], xd[1]);
    let spatial = &xd[2..];
    if spatial.contains(&0) {
        return Err(Error::invalid(
            "GridSample",
            format!("input {xd:?} has no positions to sample"),
        ));
    }
    let s: usize = spatial.iter().product();
    let p: usize = gd[1..=r].iter().product();
    let x = cx.input(0)?;
    // Coordinates and weights in at least f32: a half-precision position is exact
    // only up to 2048.
    let cd = match dt {
        DType::F16 | DType::BF16 => DType::F32,
        other => other,
    };
    let mut grid = cx.input(1)?;
    if cx.dtype(1)? != cd {
        grid = cx.g.cast(grid, cd)?;
    }
    let grid = cx.g.reshape(grid, &[n, p, r])?;
    let k = |v: f64| cx.g.scalar(v, cd);
    // Per axis, the taps of every output position.
    let mut per_axis: Vec<Vec<Tap>> = Vec::with_capacity(r);
    for (a, &len) in spatial.iter().enumerate() {
        let axis = Axis {
            len,
            lo: if align { 0.0 } else { -0.5 },
            hi: if align {
                len as f64 - 1.0
            } else {
                len as f64 - 0.5
            },
        };
        // The grid's last component is x, along the last spatial axis.
        let comp = (r - 1 - a) as isize;
        let g = cx.g.slice(grid, 2, comp, comp + 1, 1)?;
        let g = cx.g.reshape(g, &[n, p])?;
        let one = k(1.0);
        let shifted = cx.g.add(g, one)?;
        let mut pos = if align {
            cx.g.mul(shifted, k((len as f64 - 1.0) / 2.0))?
        } else {
            let scaled = cx.g.mul(shifted, k(len as f64))?;
            cx.g.mul(cx.g.sub(scaled, one)?, k(0.5))?
        };
        if mode == Mode::Nearest {
            pos = cx.g.round(pos)?;
        }
        pos = fix_coordinate(cx, pos, &axis, padding, cd)?;
        per_axis.push(taps(cx, pos, &axis, mode, padding, cd)?);
    }
    // The input as rows of channels, and each batch's first row.
    let rows = cx.g.reshape(x, &[n, c, s])?;
    let rows = cx.g.permute(rows, &[0, 2, 1])?;
    let rows = cx.g.reshape(rows, &[n * s, c])?;
    // Flat row indices are summed in i64, exact at any size.
    let index_k = |v: usize| cx.g.scalar(v as f64, DType::I64);
    let offsets = cx.g.mul(cx.g.iota(n, DType::I64)?, index_k(s))?;
    let offsets = cx.g.reshape(offsets, &[n, 1])?;
    let strides: Vec<usize> = (0..r).map(|a| spatial[a + 1..].iter().product()).collect();
    let per = per_axis[0].len();
    let combos = per.pow(r as u32);
    let mut total: Option<NodeId> = None;
    for combo in 0..combos {
        let mut flat = offsets;
        let mut weight: Option<NodeId> = None;
        let mut rest = combo;
        for a in 0..r {
            let tap = &per_axis[a][rest % per];
            rest /= per;
            let step = cx.g.mul(tap.index, index_k(strides[a]))?;
            flat = cx.g.add(flat, step)?;
            weight = Some(match weight {
                None => tap.weight,
                Some(w) => cx.g.mul(w, tap.weight)?,
            });
        }
        let picked = cx.g.gather(rows, flat, 0)?;
        let weight = weight.ok_or_else(|| Error::invalid("GridSample", "no spatial axis"))?;
        let mut weight = cx.g.reshape(weight, &[n, p, 1])?;
        if cd != dt {
            weight = cx.g.cast(weight, dt)?;
        }
        let term = cx.g.mul(picked, weight)?;
        total = Some(match total {
            None => term,
            Some(t) => cx.g.add(t, term)?,
        });
    }
    let total = total.ok_or_else(|| Error::invalid("GridSample", "no taps"))?;
    let y = cx.g.permute(total, &[0, 2, 1])?;
    let mut dims = vec![n, c];
    dims.extend_from_slice(&gd[1..=r]);
    Ok(vec![cx.g.reshape(y, &dims)?])
}

/// A coordinate outside `[lo, hi]`: clamped into the input (`border`) or reflected
/// back (`reflection`); `zeros` leaves it (its taps read zeros).
fn fix_coordinate(
    cx: &Cx,
    pos: NodeId,
    axis: &Axis,
    padding: Padding,
    dt: DType,
) -> Result<NodeId> {
    let k = |v: f64| cx.g.scalar(v, dt);
    let outside =
        cx.g.or(cx.g.lt(pos, k(axis.lo))?, cx.g.gt(pos, k(axis.hi))?)?;
    let fixed = match padding {
        Padding::Zeros => return Ok(pos),
        Padding::Border => clamp(cx, pos, 0.0, axis.len as f64 - 1.0, dt)?,
        Padding::Reflection => reflect(cx, pos, axis.lo, axis.hi, dt)?,
    };
    cx.g.select(outside, fixed, pos)
}

fn clamp(cx: &Cx, v: NodeId, lo: f64, hi: f64, dt: DType) -> Result<NodeId> {
    let low = cx.g.maximum(v, cx.g.scalar(lo, dt))?;
    cx.g.minimum(low, cx.g.scalar(hi, dt))
}

/// `v` reflected at `lo` and `hi` until it lies between them: past an end by `d`,
/// it comes back `d mod (hi - lo)` from that end after an even number of crossings
/// of the range, from the other end after an odd number.
fn reflect(cx: &Cx, v: NodeId, lo: f64, hi: f64, dt: DType) -> Result<NodeId> {
    let k = |x: f64| cx.g.scalar(x, dt);
    let range = hi - lo;
    if range <= 0.0 {
        // A single position: everything reflects onto it.
        let zero = cx.g.mul(v, k(0.0))?;
        return cx.g.add(zero, k(lo));
    }
    // Distance past the nearer end (0 inside).
    let below = cx.g.maximum(cx.g.sub(k(lo), v)?, k(0.0))?;
    let above = cx.g.maximum(cx.g.sub(v, k(hi))?, k(0.0))?;
    let past = cx.g.add(below, above)?;
    let crossings = cx.g.floor(cx.g.div(past, k(range))?)?;
    let rem = cx.g.sub(past, cx.g.mul(crossings, k(range))?)?;
    let half = cx.g.mul(crossings, k(0.5))?;
    let odd = cx.g.ne(cx.g.floor(half)?, half)?;
    let is_below = cx.g.lt(v, k(lo))?;
    // Even crossings: back in from the end it left by; odd: in from the other end.
    let from_lo = cx.g.add(k(lo), rem)?;
    let from_hi = cx.g.sub(k(hi), rem)?;
    let even_pick = cx.g.select(is_below, from_lo, from_hi)?;
    let odd_pick = cx.g.select(is_below, from_hi, from_lo)?;
    cx.g.select(odd, odd_pick, even_pick)
}

/// The taps of each position along one axis, with in-range indices: a tap outside
/// the input reads zero (its weight is zeroed), the edge (`border`) or its
/// reflection (`reflection`).
fn taps(
    cx: &Cx,
    pos: NodeId,
    axis: &Axis,
    mode: Mode,
    padding: Padding,
    dt: DType,
) -> Result<Vec<Tap>> {
    let k = |v: f64| cx.g.scalar(v, dt);
    let (base, offsets, weights): (NodeId, Vec<f64>, Vec<NodeId>) = match mode {
        Mode::Nearest => {
            let one = cx.g.add(cx.g.mul(pos, k(0.0))?, k(1.0))?;
            (pos, vec![0.0], vec![one])
        }
        Mode::Linear => {
            let floor = cx.g.floor(pos)?;
            let f = cx.g.sub(pos, floor)?;
            let w0 = cx.g.sub(k(1.0), f)?;
            (floor, vec![0.0, 1.0], vec![w0, f])
        }
        Mode::Cubic => {
            let floor = cx.g.floor(pos)?;
            let f = cx.g.sub(pos, floor)?;
            (floor, vec![-1.0, 0.0, 1.0, 2.0], cubic_weights(cx, f, dt)?)
        }
    };
    let last = axis.len as f64 - 1.0;
    let mut out = Vec::with_capacity(offsets.len());
    for (off, mut weight) in offsets.into_iter().zip(weights) {
        let t = cx.g.add(base, k(off))?;
        let index = match padding {
            Padding::Zeros => {
                let inside = cx.g.and(cx.g.ge(t, k(0.0))?, cx.g.le(t, k(last))?)?;
                weight = cx.g.select(inside, weight, k(0.0))?;
                clamp(cx, t, 0.0, last, dt)?
            }
            Padding::Border => clamp(cx, t, 0.0, last, dt)?,
            Padding::Reflection => {
                let outside = cx.g.or(cx.g.lt(t, k(axis.lo))?, cx.g.gt(t, k(axis.hi))?)?;
                let back =
                    cx.g.select(outside, reflect(cx, t, axis.lo, axis.hi, dt)?, t)?;
                // Toward zero, as the integer conversion of the reflected position.
                let toward_zero =
                    cx.g.select(cx.g.lt(back, k(0.0))?, cx.g.ceil(back)?, cx.g.floor(back)?)?;
                clamp(cx, toward_zero, 0.0, last, dt)?
            }
        };
        out.push(Tap {
            index: cx.g.cast(index, DType::I64)?,
            weight,
        });
    }
    Ok(out)
}

/// Keys' cubic convolution weights (`a = -0.75`) of the taps at -1, 0, 1, 2 from
/// the floor of a position whose fraction is `f`.
fn cubic_weights(cx: &Cx, f: NodeId, dt: DType) -> Result<Vec<NodeId>> {
    const A: f64 = -0.75;
    let k = |v: f64| cx.g.scalar(v, dt);
    // For a distance d in [1, 2]: ((A d - 5A) d + 8A) d - 4A; in [0, 1]:
    // ((A + 2) d - (A + 3)) d d + 1.
    let far = |d: NodeId| -> Result<NodeId> {
        let t = cx.g.sub(cx.g.mul(d, k(A))?, k(5.0 * A))?;
        let t = cx.g.add(cx.g.mul(t, d)?, k(8.0 * A))?;
        cx.g.sub(cx.g.mul(t, d)?, k(4.0 * A))
    };
    let near = |d: NodeId| -> Result<NodeId> {
        let t = cx.g.sub(cx.g.mul(d, k(A + 2.0))?, k(A + 3.0))?;
        cx.g.add(cx.g.mul(cx.g.mul(t, d)?, d)?, k(1.0))
    };
    let one_minus = cx.g.sub(k(1.0), f)?;
    Ok(vec![
        far(cx.g.add(f, k(1.0))?)?,
        near(f)?,
        near(one_minus)?,
        far(cx.g.sub(k(2.0), f)?)?,
    ])
}
