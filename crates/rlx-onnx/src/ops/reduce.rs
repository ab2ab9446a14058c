//! Reductions (`ReduceSum` ... `ReduceLogSumExp`) and `ArgMax`/`ArgMin`.

use super::{Converter, axes, axis, scalar, size, unsupported};
use crate::import::Cx;
use rlx_ir::{ArgReduceOp, BinaryOp, DType, Error, NodeId, Op, ReduceOp, Result, SliceAxis};

pub(super) const NAMES: &[&str] = &[
    "ArgMax",
    "ArgMin",
    "ReduceL1",
    "ReduceL2",
    "ReduceLogSum",
    "ReduceLogSumExp",
    "ReduceMax",
    "ReduceMean",
    "ReduceMin",
    "ReduceProd",
    "ReduceSum",
    "ReduceSumSquare",
];

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "ReduceSum" => |cx| reduce(cx, Kind::Plain(ReduceOp::Sum)),
        "ReduceMean" => |cx| reduce(cx, Kind::Plain(ReduceOp::Mean)),
        "ReduceMax" => |cx| reduce(cx, Kind::Plain(ReduceOp::Max)),
        "ReduceMin" => |cx| reduce(cx, Kind::Plain(ReduceOp::Min)),
        "ReduceProd" => |cx| reduce(cx, Kind::Plain(ReduceOp::Prod)),
        "ReduceL1" => |cx| reduce(cx, Kind::L1),
        "ReduceL2" => |cx| reduce(cx, Kind::L2),
        "ReduceSumSquare" => |cx| reduce(cx, Kind::SumSquare),
        "ReduceLogSum" => |cx| reduce(cx, Kind::LogSum),
        "ReduceLogSumExp" => |cx| reduce(cx, Kind::LogSumExp),
        "ArgMax" => |cx| arg_reduce(cx, ArgReduceOp::ArgMax),
        "ArgMin" => |cx| arg_reduce(cx, ArgReduceOp::ArgMin),
        _ => return None,
    })
}

#[derive(Clone, Copy)]
enum Kind {
    Plain(ReduceOp),
    L1,
    L2,
    SumSquare,
    LogSum,
    LogSumExp,
}

/// The axes a reduce node names (attribute before the opset that moved them to an
/// input: 13 for `ReduceSum`, 18 for the rest), or `None` for "no axes given".
fn reduce_axes(cx: &mut Cx) -> Result<Option<Vec<i64>>> {
    let op_type = cx.node.op_type.as_deref().unwrap_or("");
    let from_input = if op_type == "ReduceSum" {
        cx.opset >= 13
    } else {
        cx.opset >= 18
    };
    if from_input {
        Ok(cx.opt_ints(1)?.filter(|a| !a.is_empty()))
    } else {
        Ok(cx.attr_ints("axes").filter(|a| !a.is_empty()))
    }
}

fn reduce(cx: &mut Cx, kind: Kind) -> Result<Vec<NodeId>> {
    let x = cx.input(0)?;
    let shape = cx.shape(0)?;
    let keepdims = cx.attr_i("keepdims", 1) != 0;
    let list = match reduce_axes(cx)? {
        Some(list) => axes(&list, shape.rank())?,
        None if cx.attr_i("noop_with_empty_axes", 0) != 0 => {
            return Ok(vec![x]);
        }
        None => (0..shape.rank()).collect(),
    };
    let dt = shape.dtype();
    if dt == DType::Bool {
        // Reduce bools as 0/1 bytes: max is any, min is all.
        let Kind::Plain(op @ (ReduceOp::Max | ReduceOp::Min)) = kind else {
            return Err(unsupported("this reduction on bool"));
        };
        let empty = list.iter().any(|&a| shape.dim(a) == 0);
        let bytes = cx.g.cast(x, DType::U8)?;
        let r = if list.is_empty() {
            bytes
        } else if empty {
            let fill = if op == ReduceOp::Max { 0.0 } else { 1.0 };
            return Ok(vec![filled(
                cx,
                &shape.with_dtype(DType::Bool),
                &list,
                keepdims,
                fill,
            )?]);
        } else {
            cx.g.push(
                Op::Reduce {
                    op,
                    axes: list.clone(),
                    keepdims,
                },
                &[bytes],
            )?
        };
        return Ok(vec![cx.g.cast(r, DType::Bool)?]);
    }
    let plain = |op: ReduceOp, v: NodeId| -> Result<NodeId> {
        if list.is_empty() {
            // Reducing a scalar: the value itself.
            return Ok(v);
        }
        cx.g.push(
            Op::Reduce {
                op,
                axes: list.clone(),
                keepdims,
            },
            &[v],
        )
    };
    let y = match kind {
        Kind::Plain(op) => {
            let empty = list.iter().any(|&a| shape.dim(a) == 0);
            if empty && matches!(op, ReduceOp::Max | ReduceOp::Min) {
                // The identity of max is -inf (min: +inf); numpy-style references agree.
                let fill = if op == ReduceOp::Max {
                    f64::NEG_INFINITY
                } else {
                    f64::INFINITY
                };
                let fill = if dt.is_float() {
                    fill
                } else if op == ReduceOp::Max {
                    int_bounds(dt).0
                } else {
                    int_bounds(dt).1
                };
                return Ok(vec![filled(cx, &shape, &list, keepdims, fill)?]);
            }
            plain(op, x)?
        }
        Kind::L1 => plain(ReduceOp::Sum, cx.g.abs(x)?)?,
        Kind::L2 => cx.g.sqrt(plain(ReduceOp::Sum, cx.g.mul(x, x)?)?)?,
        Kind::SumSquare => plain(ReduceOp::Sum, cx.g.mul(x, x)?)?,
        Kind::LogSum => cx.g.log(plain(ReduceOp::Sum, x)?)?,
        Kind::LogSumExp => {
            let empty = list.iter().any(|&a| shape.dim(a) == 0);
            if empty || list.is_empty() {
                cx.g.log(plain(ReduceOp::Sum, cx.g.exp(x)?)?)?
            } else {
                // Shifted by the max so large values do not overflow.
                let m = cx.g.push(
                    Op::Reduce {
                        op: ReduceOp::Max,
                        axes: list.clone(),
                        keepdims: true,
                    },
                    &[x],
                )?;
                let e = cx.g.exp(cx.g.sub(x, m)?)?;
                let s = cx.g.log(plain(ReduceOp::Sum, e)?)?;
                let m = if keepdims {
                    m
                } else {
                    plain(ReduceOp::Max, x)?
                };
                cx.g.add(s, m)?
            }
        }
    };
    let _ = scalar;
    Ok(vec![y])
}

/// The smallest and largest values of an integer dtype.
pub(super) fn int_bounds(dt: rlx_ir::DType) -> (f64, f64) {
    use rlx_ir::DType::*;
    match dt {
        I8 => (i8::MIN as f64, i8::MAX as f64),
        U8 => (0.0, u8::MAX as f64),
        I16 => (i16::MIN as f64, i16::MAX as f64),
        U16 => (0.0, u16::MAX as f64),
        I32 => (i32::MIN as f64, i32::MAX as f64),
        U32 => (0.0, u32::MAX as f64),
        U64 => (0.0, u64::MAX as f64),
        Bool => (0.0, 1.0),
        _ => (i64::MIN as f64, i64::MAX as f64),
    }
}

/// The result of reducing an empty axis: a tensor of `fill`.
fn filled(
    cx: &Cx,
    shape: &rlx_ir::Shape,
    list: &[usize],
    keepdims: bool,
    fill: f64,
) -> Result<NodeId> {
    let dims: Vec<usize> = (0..shape.rank())
        .filter_map(|a| match (list.contains(&a), keepdims) {
            (true, true) => Some(1),
            (true, false) => None,
            (false, _) => Some(shape.dim(a)),
        })
        .collect();
    let n: usize = dims.iter().product();
    cx.g.constant(
        rlx_ir::TensorData::from_f64(shape.dtype(), &vec![fill; n]),
        &dims,
    )
}

fn arg_reduce(cx: &mut Cx, op: ArgReduceOp) -> Result<Vec<NodeId>> {
    let x = cx.input(0)?;
    let shape = cx.shape(0)?;
    let a = axis(cx.attr_i("axis", 0), shape.rank())?;
    let keepdims = cx.attr_i("keepdims", 1) != 0;
    if cx.attr_i("select_last_index", 0) == 0 {
        return Ok(vec![cx.g.push(
            Op::ArgReduce {
                op,
                axis: a,
                keepdims,
            },
            &[x],
        )?]);
    }
    // The last extreme is the first one of the reversed axis: n - 1 - index.
    let n = shape.dim(a);
    if n == 0 {
        return Err(Error::invalid("ArgMax/ArgMin", "the axis is empty"));
    }
    let slice: Vec<SliceAxis> = shape
        .dims()
        .iter()
        .enumerate()
        .map(|(i, &d)| {
            if i == a {
                SliceAxis {
                    start: d - 1,
                    step: -1,
                    len: d,
                }
            } else {
                SliceAxis {
                    start: 0,
                    step: 1,
                    len: d,
                }
            }
        })
        .collect();
    let rev = cx.g.push(Op::Slice { axes: slice }, &[x])?;
    let idx = cx.g.push(
        Op::ArgReduce {
            op,
            axis: a,
            keepdims,
        },
        &[rev],
    )?;
    let last =
        cx.g.scalar((size(n as i64, "axis")? - 1) as f64, rlx_ir::DType::I64);
    Ok(vec![cx.g.binary(BinaryOp::Sub, last, idx)?])
}
