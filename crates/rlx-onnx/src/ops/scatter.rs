//! `ScatterElements`, `Scatter`, `ScatterND` and `TensorScatter`. Each works out the
//! flat offset into `data` of every update, then writes all updates at once through a
//! match mask of updates × positions: the updates that land on a position are combined
//! with the reduction, and positions no update reaches keep `data`. The mask costs
//! `updates × data` elements, which suits the small scatters models do at shape level.

use super::reduce::int_bounds;
use super::shape::{offsets_off_axis, wrap_indices};
use super::{Converter, axis, unsupported};
use crate::import::Cx;
use rlx_ir::{BinaryOp, DType, Error, NodeId, Op, ReduceOp, Result, TensorData};

pub(super) const NAMES: &[&str] = &["Scatter", "ScatterElements", "ScatterND", "TensorScatter"];

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "Scatter" | "ScatterElements" => scatter_elements,
        "ScatterND" => scatter_nd,
        "TensorScatter" => tensor_scatter,
        _ => return None,
    })
}

/// How updates that land on one position combine with it.
#[derive(Clone, Copy, PartialEq)]
enum Reduction {
    None,
    Add,
    Mul,
    Max,
    Min,
}

fn reduction(cx: &Cx) -> Result<Reduction> {
    Ok(match cx.attr_s("reduction", "none").as_str() {
        "none" => Reduction::None,
        "add" => Reduction::Add,
        "mul" => Reduction::Mul,
        "max" => Reduction::Max,
        "min" => Reduction::Min,
        other => return Err(unsupported(format!("reduction = '{other}'"))),
    })
}

/// Writes `updates` (flat, `m` values) at flat offsets `offsets` (`[m]`, i64, in
/// range) into `data` (flat, `n` values).
fn scatter_flat(
    cx: &Cx,
    data: NodeId,
    offsets: NodeId,
    updates: NodeId,
    red: Reduction,
) -> Result<NodeId> {
    let n = cx.g.shape(data)?.num_elements();
    let m = cx.g.shape(offsets)?.num_elements();
    let dt = cx.g.shape(data)?.dtype();
    if m == 0 {
        return Ok(data);
    }
    let positions: Vec<i64> = (0..n as i64).collect();
    let positions = cx.g.constant(TensorData::I64(positions), &[1, n])?;
    let hits =
        cx.g.binary(BinaryOp::Eq, cx.g.reshape(offsets, &[m, 1])?, positions)?;
    let (lo, hi) = if dt.is_float() {
        (f64::NEG_INFINITY, f64::INFINITY)
    } else {
        int_bounds(dt)
    };
    let (identity, op) = match red {
        Reduction::None | Reduction::Add => (0.0, ReduceOp::Sum),
        Reduction::Mul => (1.0, ReduceOp::Prod),
        Reduction::Max => (lo, ReduceOp::Max),
        Reduction::Min => (hi, ReduceOp::Min),
    };
    let column = cx.g.reshape(updates, &[m, 1])?;
    let spread = cx.g.select(hits, column, cx.g.scalar(identity, dt))?;
    let down = |op: ReduceOp, x: NodeId| {
        cx.g.push(
            Op::Reduce {
                op,
                axes: vec![0],
                keepdims: false,
            },
            &[x],
        )
    };
    let combined = down(op, spread)?;
    let reached = || -> Result<NodeId> {
        let any = down(ReduceOp::Max, cx.g.cast(hits, DType::U8)?)?;
        cx.g.cast(any, DType::Bool)
    };
    match red {
        Reduction::None => cx.g.select(reached()?, combined, data),
        Reduction::Add => cx.g.add(data, combined),
        Reduction::Mul => cx.g.mul(data, combined),
        Reduction::Max => {
            let v = cx.g.binary(BinaryOp::Max, data, combined)?;
            cx.g.select(reached()?, v, data)
        }
        Reduction::Min => {
            let v = cx.g.binary(BinaryOp::Min, data, combined)?;
            cx.g.select(reached()?, v, data)
        }
    }
}

fn flat(cx: &Cx, x: NodeId) -> Result<NodeId> {
    let n = cx.g.shape(x)?.num_elements();
    cx.g.reshape(x, &[n])
}

fn scatter_elements(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let dd = cx.dims(0)?;
    let id = cx.dims(1)?;
    let rank = dd.len();
    if id.len() != rank || cx.dims(2)? != id {
        return Err(Error::invalid(
            "ScatterElements",
            format!(
                "indices {id:?} and updates {:?} must match each other and the rank of data {dd:?}",
                cx.dims(2)?
            ),
        ));
    }
    let a = axis(cx.attr_i("axis", 0), rank)?;
    if id
        .iter()
        .zip(&dd)
        .enumerate()
        .any(|(k, (i, d))| k != a && i > d)
    {
        return Err(Error::invalid(
            "ScatterElements",
            format!("indices {id:?} exceed data {dd:?}"),
        ));
    }
    let red = reduction(cx)?;
    let strides = rlx_ir::contiguous_strides(&dd);
    let base = offsets_off_axis(&id, &dd, a);
    let (data, idx, upd) = (cx.input(0)?, cx.input(1)?, cx.input(2)?);
    let idx = wrap_indices(cx, idx, &[dd[a]])?;
    let base = cx.g.constant(TensorData::I64(base), &id)?;
    let off = cx.g.add(
        cx.g.mul(idx, cx.g.scalar(strides[a] as f64, DType::I64))?,
        base,
    )?;
    let out = scatter_flat(cx, flat(cx, data)?, flat(cx, off)?, flat(cx, upd)?, red)?;
    Ok(vec![cx.g.reshape(out, &dd)?])
}

fn scatter_nd(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let dd = cx.dims(0)?;
    let id = cx.dims(1)?;
    let ud = cx.dims(2)?;
    let k = *id
        .last()
        .ok_or_else(|| Error::invalid("ScatterND", "indices must have rank 1 or more"))?;
    let rows = &id[..id.len() - 1];
    let want: Vec<usize> = rows
        .iter()
        .chain(dd.get(k..).unwrap_or(&[]))
        .copied()
        .collect();
    if k > dd.len() || ud != want {
        return Err(Error::invalid(
            "ScatterND",
            format!("indices {id:?} and updates {ud:?} do not address data {dd:?}"),
        ));
    }
    let red = reduction(cx)?;
    let strides = rlx_ir::contiguous_strides(&dd);
    let r: usize = rows.iter().product();
    let slice: usize = dd[k..].iter().product();
    let (data, idx, upd) = (cx.input(0)?, cx.input(1)?, cx.input(2)?);
    let idx = cx.g.reshape(idx, &[r, k])?;
    let idx = wrap_indices(cx, idx, &dd[..k])?;
    // Row offset: the index tuple dotted with the leading strides.
    let lead: Vec<i64> = strides[..k].iter().map(|&s| s as i64).collect();
    let lead = cx.g.constant(TensorData::I64(lead), &[k])?;
    let row = cx.g.push(
        Op::Reduce {
            op: ReduceOp::Sum,
            axes: vec![1],
            keepdims: true,
        },
        &[cx.g.mul(idx, lead)?],
    )?;
    let within: Vec<i64> = (0..slice as i64).collect();
    let within = cx.g.constant(TensorData::I64(within), &[1, slice])?;
    let off = cx.g.add(row, within)?;
    let out = scatter_flat(cx, flat(cx, data)?, flat(cx, off)?, flat(cx, upd)?, red)?;
    Ok(vec![cx.g.reshape(out, &dd)?])
}

/// `TensorScatter`: writes `update` into the cache along `axis`, starting at each
/// batch row's write index (wrapping around in `circular` mode).
fn tensor_scatter(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let cd = cx.dims(0)?;
    let ud = cx.dims(1)?;
    let rank = cd.len();
    let a = axis(cx.attr_i("axis", -2), rank)?;
    if a == 0 {
        return Err(Error::invalid(
            "TensorScatter",
            "axis must not be the batch axis",
        ));
    }
    if ud.len() != rank
        || (0..rank).any(|i| {
            if i == a {
                ud[i] > cd[i]
            } else {
                ud[i] != cd[i]
            }
        })
    {
        return Err(Error::invalid(
            "TensorScatter",
            format!("update {ud:?} does not fit the cache {cd:?} along axis {a}"),
        ));
    }
    let circular = match cx.attr_s("mode", "linear").as_str() {
        "linear" => false,
        "circular" => true,
        other => return Err(unsupported(format!("mode = '{other}'"))),
    };
    let strides = rlx_ir::contiguous_strides(&cd);
    // Offsets of every update element, less the write position along the axis.
    let rest = offsets_off_axis(&ud, &cd, a);
    let rest = cx.g.constant(TensorData::I64(rest), &ud)?;
    let mut along = vec![1; rank];
    along[a] = ud[a];
    let steps: Vec<i64> = (0..ud[a] as i64).collect();
    let steps = cx.g.constant(TensorData::I64(steps), &along)?;
    let mut pos = steps;
    if let Some(w) = cx.opt_input(2)? {
        let mut per_batch = vec![1; rank];
        per_batch[0] = cd[0];
        let w = cx.g.reshape(cx.g.cast(w, DType::I64)?, &per_batch)?;
        pos = cx.g.add(pos, w)?;
    }
    if circular {
        pos =
            cx.g.binary(BinaryOp::Mod, pos, cx.g.scalar(cd[a] as f64, DType::I64))?;
    }
    let off = cx.g.add(
        cx.g.mul(pos, cx.g.scalar(strides[a] as f64, DType::I64))?,
        rest,
    )?;
    let (cache, upd) = (cx.input(0)?, cx.input(1)?);
    let out = scatter_flat(
        cx,
        flat(cx, cache)?,
        flat(cx, off)?,
        flat(cx, upd)?,
        Reduction::None,
    )?;
    Ok(vec![cx.g.reshape(out, &cd)?])
}
