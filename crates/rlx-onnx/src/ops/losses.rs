//! Loss operators: `NegativeLogLikelihoodLoss` and `SoftmaxCrossEntropyLoss`, written
//! in primitives (the class pick is a one-hot product).

use super::{Converter, unsupported};
use crate::import::Cx;
use rlx_ir::{DType, Error, NodeId, Op, ReduceOp, Result};

pub(super) const NAMES: &[&str] = &["NegativeLogLikelihoodLoss", "SoftmaxCrossEntropyLoss"];

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "NegativeLogLikelihoodLoss" => |cx| {
            let x = cx.input(0)?;
            loss(cx, x, false)
        },
        "SoftmaxCrossEntropyLoss" => |cx| {
            let x = cx.input(0)?;
            let logp = cx.g.log_softmax(x, 1)?;
            let mut out = loss(cx, logp, true)?;
            out.push(logp);
            Ok(out)
        },
        _ => return None,
    })
}

fn reduce_all(cx: &Cx, op: ReduceOp, x: NodeId) -> Result<NodeId> {
    let rank = cx.g.shape(x)?.rank();
    if rank == 0 {
        return Ok(x);
    }
    cx.g.push(
        Op::Reduce {
            op,
            axes: (0..rank).collect(),
            keepdims: false,
        },
        &[x],
    )
}

/// The loss of log-probabilities `logp [N, C, d...]` against `target [N, d...]`.
/// `sce` selects the cross-entropy rule for when ignored targets weigh in.
fn loss(cx: &mut Cx, logp: NodeId, sce: bool) -> Result<Vec<NodeId>> {
    let xs = cx.g.shape(logp)?;
    if xs.rank() < 2 {
        return Err(Error::invalid("loss", "input must have rank 2 or more"));
    }
    let dt = xs.dtype();
    let classes = xs.dim(1);
    let mut target = cx.input(1)?;
    if cx.g.shape(target)?.dtype() != DType::I64 {
        target = cx.g.cast(target, DType::I64)?;
    }
    let tdims = cx.g.shape(target)?.dims().to_vec();
    let ignore = cx
        .has_attr("ignore_index")
        .then(|| cx.attr_i("ignore_index", 0));
    let reduction = cx.attr_s("reduction", "mean");
    // -logp[n, target[n, d], d] via a one-hot over the class axis.
    let hot = cx.g.one_hot(target, classes, dt)?;
    let rank = xs.rank();
    let mut perm: Vec<usize> = vec![0, rank - 1];
    perm.extend(1..rank - 1);
    let hot = cx.g.permute(hot, &perm)?;
    let picked = cx.g.push(
        Op::Reduce {
            op: ReduceOp::Sum,
            axes: vec![1],
            keepdims: false,
        },
        &[cx.g.mul(hot, logp)?],
    )?;
    let mut neg = cx.g.neg(picked)?;
    let keep = match ignore {
        Some(ii) => {
            let k = cx.g.binary(
                rlx_ir::BinaryOp::Ne,
                target,
                cx.g.scalar(ii as f64, DType::I64),
            )?;
            neg = cx.g.select(k, neg, cx.g.scalar(0.0, dt))?;
            Some(cx.g.cast(k, dt)?)
        }
        None => None,
    };
    let weight = match cx.opt_input(2)? {
        Some(w) => {
            let hi = cx.g.scalar((classes.max(1) - 1) as f64, DType::I64);
            let clipped = cx.g.binary(
                rlx_ir::BinaryOp::Max,
                cx.g.binary(rlx_ir::BinaryOp::Min, target, hi)?,
                cx.g.scalar(0.0, DType::I64),
            )?;
            let gw = cx.g.gather(w, clipped, 0)?;
            Some(match keep {
                Some(k) => cx.g.mul(gw, k)?,
                None => gw,
            })
        }
        None if sce => keep,
        None if ignore != Some(-1) => keep,
        None => None,
    };
    let weighted = match weight {
        Some(w) => cx.g.mul(neg, w)?,
        None => neg,
    };
    let _ = tdims;
    let out = match reduction.as_str() {
        "none" => weighted,
        "sum" => reduce_all(cx, ReduceOp::Sum, weighted)?,
        "mean" => match weight {
            Some(w) => cx.g.div(
                reduce_all(cx, ReduceOp::Sum, weighted)?,
                reduce_all(cx, ReduceOp::Sum, w)?,
            )?,
            None => reduce_all(cx, ReduceOp::Mean, weighted)?,
        },
        other => return Err(unsupported(format!("reduction '{other}'"))),
    };
    Ok(vec![out])
}
