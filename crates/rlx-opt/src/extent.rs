//! Running a plan on fewer leading rows than it was planned for.
//!
//! A plan made for `P` rows of some inputs (their dimension 0: a batch) can run on
//! `rows < P` of them when every value computed from those inputs keeps its rows
//! apart: then each such value's first `rows / P` share of its dimension 0 is a
//! prefix of its bytes, computed only from the prefixes of its operands, and the
//! kernels can run on the smaller shapes in the same memory. [`active_shapes`]
//! checks that op by op and returns every value's shape at the smaller extent.

use crate::Plan;
use rlx_ir::{Error, NodeId, Op, Result, Shape};

/// Every node's shape when the inputs `inputs` (graph input nodes, all with the same
/// dimension 0, `P`) carry `rows` rows instead of `P`: values computed from them
/// scale their dimension 0 by `rows / P`, the rest keep their shape.
///
/// # Errors
/// [`Error::InvalidArgument`] when `rows` is 0 or above `P`, an input is not a graph
/// input or has another dimension 0, or a node mixes rows (a reduction over
/// dimension 0, a slice or concatenation along it, a product whose right operand is
/// computed from the inputs, state written in place...), naming the node and op.
pub fn active_shapes(plan: &Plan, inputs: &[NodeId], rows: usize) -> Result<Vec<Shape>> {
    let nodes = plan.graph.nodes();
    let context = "set_active_extent";
    let mut planned = None;
    for &id in inputs {
        let node = nodes
            .get(id.index())
            .filter(|n| matches!(n.op, Op::Input { .. }))
            .ok_or_else(|| Error::invalid(context, format!("{id} is not a graph input")))?;
        let d0 = node.shape.dims().first().copied().ok_or_else(|| {
            Error::invalid(context, format!("input {id} is a scalar: it has no rows"))
        })?;
        match planned {
            None => planned = Some(d0),
            Some(p) if p != d0 => {
                return Err(Error::invalid(
                    context,
                    format!("the inputs' first dims differ ({p} and {d0})"),
                ));
            }
            Some(_) => {}
        }
    }
    let Some(p) = planned else {
        return Err(Error::invalid(context, "no inputs named"));
    };
    if rows == 0 || rows > p {
        return Err(Error::invalid(
            context,
            format!("{rows} rows: the graph was planned for 1..={p}"),
        ));
    }
    let mut scaled = vec![false; nodes.len()];
    let mut shapes: Vec<Shape> = nodes.iter().map(|n| n.shape.clone()).collect();
    for (i, node) in nodes.iter().enumerate() {
        let fail = |why: &str| {
            Error::invalid(
                context,
                format!(
                    "%{i} ({}) {why}, so the graph cannot run on fewer rows",
                    node.op.name()
                ),
            )
        };
        if matches!(node.op, Op::Input { .. }) {
            scaled[i] = inputs.contains(&NodeId::from_index(i));
        } else {
            let ins: Vec<(bool, &Shape)> = node
                .inputs
                .iter()
                .map(|x| (scaled[x.index()], &nodes[x.index()].shape))
                .collect();
            if !ins.iter().any(|(s, _)| *s) {
                continue;
            }
            row_wise(&node.op, &ins, &node.shape).map_err(&fail)?;
            scaled[i] = true;
        }
        if scaled[i] {
            let dims = node.shape.dims();
            let d0 = *dims.first().ok_or_else(|| fail("gives a scalar"))?;
            if d0 % p != 0 {
                return Err(fail(&format!("has {d0} rows, not a multiple of {p}")));
            }
            let mut new = dims.to_vec();
            new[0] = d0 / p * rows;
            shapes[i] = node.shape.with_dims(&new);
        }
    }
    Ok(shapes)
}

/// Whether an unscaled operand of rank `rank` is the same for every row of an output
/// of rank `out_rank` (broadcast along dimension 0, or of lower rank).
fn same_for_every_row(shape: &Shape, out_rank: usize) -> bool {
    shape.rank() < out_rank || shape.dims().first() == Some(&1)
}

/// Operands read elementwise against `out`: computed ones share its rows, the others
/// do not vary by row.
fn elementwise_operands(
    ins: &[(bool, &Shape)],
    out: &Shape,
) -> std::result::Result<(), &'static str> {
    let rank = out.rank();
    ins.iter().try_for_each(|&(s, shape)| {
        if s {
            (shape.rank() == rank && shape.dims().first() == out.dims().first())
                .then_some(())
                .ok_or("broadcasts a computed operand along the rows")
        } else {
            same_for_every_row(shape, rank)
                .then_some(())
                .ok_or("reads an operand that differs from row to row")
        }
    })
}

/// Checks that `op` keeps rows apart for operands `(scaled, shape)` and output `out`;
/// the reason when it does not.
fn row_wise(op: &Op, ins: &[(bool, &Shape)], out: &Shape) -> std::result::Result<(), &'static str> {
    let rank = out.rank();
    let elementwise = || elementwise_operands(ins, out);
    let not_axis0 = |axis: usize| {
        (axis != 0 && rank > 1)
            .then_some(())
            .ok_or("works along dimension 0")
    };
    match op {
        Op::Unary(_)
        | Op::Binary(_)
        | Op::Where
        | Op::Cast(_)
        | Op::Elementwise { .. }
        | Op::Rope { .. } => elementwise(),
        Op::LayerNorm { .. } | Op::RmsNorm { .. } => {
            if rank < 2 {
                return Err("normalizes along dimension 0");
            }
            elementwise()
        }
        Op::Softmax { axis } | Op::LogSoftmax { axis } | Op::Cumsum { axis, .. } => {
            not_axis0(*axis)?;
            elementwise()
        }
        Op::TopK { axis, .. } => not_axis0(*axis),
        Op::Reduce { axes, .. } => {
            if axes.contains(&0) || ins[0].1.rank() < 2 {
                return Err("reduces over dimension 0");
            }
            Ok(())
        }
        Op::ArgReduce { axis, .. } => not_axis0(*axis),
        Op::FusedMatMul {
            transpose_a: true, ..
        } => Err("reads its rows operand transposed"),
        Op::MatMul | Op::FusedMatMul { .. } | Op::QuantMatMul { .. } => {
            let (a, b) = (ins[0], ins[1]);
            if !a.0 || a.1.rank() < 2 || a.1.rank() != rank {
                return Err("multiplies by an operand computed from the rows");
            }
            if b.0 {
                // A batched product of two computed operands: rows must be batches.
                if rank < 3 || b.1.rank() != rank || b.1.dims().first() != out.dims().first() {
                    return Err("multiplies two computed operands across rows");
                }
            } else if !(b.1.rank() <= 2 || same_for_every_row(b.1, rank)) {
                return Err("multiplies by a weight that differs from batch to batch");
            }
            // Bias and residual, as elementwise operands.
            elementwise_operands(&ins[2..], out)
        }
        Op::Attention { .. } => {
            if !(ins[0].0 && ins[1].0 && ins[2].0) {
                return Err("attends over keys or values not computed from the rows");
            }
            elementwise_like(ins, out)
        }
        Op::Reshape { .. } => Ok(()),
        Op::Permute { perm } => (perm.first() == Some(&0))
            .then_some(())
            .ok_or("moves dimension 0"),
        Op::Slice { axes } => {
            let whole = axes.first().is_some_and(|a| {
                a.start == 0 && a.step == 1 && Some(&a.len) == ins[0].1.dims().first()
            });
            whole.then_some(()).ok_or("slices along dimension 0")
        }
        Op::Concat { axis } => {
            not_axis0(*axis)?;
            ins.iter()
                .all(|(s, _)| *s)
                .then_some(())
                .ok_or("joins computed rows with fixed ones")
        }
        Op::Gather { axis } => match (ins[0].0, ins[1].0) {
            (true, false) if *axis != 0 => Ok(()),
            (false, true) if *axis == 0 => Ok(()),
            _ => Err("gathers across rows"),
        },
        Op::Expand { .. } => (ins[0].1.rank() == rank
            && ins[0].1.dims().first() == out.dims().first())
        .then_some(())
        .ok_or("expands along dimension 0"),
        Op::Pad { pads, .. } => (pads.first() == Some(&(0, 0)))
            .then_some(())
            .ok_or("pads dimension 0"),
        Op::Tile { reps } => (reps.first() == Some(&1))
            .then_some(())
            .ok_or("tiles dimension 0"),
        Op::OneHot { .. } => Ok(()),
        Op::Conv2d { .. } | Op::MaxPool2d { .. } | Op::AvgPool2d { .. } => (ins[0].0
            && ins[1..].iter().all(|(s, _)| !*s))
        .then_some(())
        .ok_or("convolves with a computed filter"),
        Op::FusedConv2d { fusion, .. } => {
            let filter = fusion.residual_at();
            if !(ins[0].0 && ins[1..filter].iter().all(|(s, _)| !*s)) {
                return Err("convolves with a computed filter");
            }
            // The residual and the per-channel scales and shifts, as elementwise
            // operands (the per-channel ones are the same for every row).
            elementwise_operands(&ins[filter..], out)
        }
        _ => Err("is not known to keep rows apart"),
    }
}

/// Attention operands: each computed one shares the output's batch, a mask that is
/// not computed is broadcast over it.
fn elementwise_like(ins: &[(bool, &Shape)], out: &Shape) -> std::result::Result<(), &'static str> {
    ins.iter().try_for_each(|&(s, shape)| {
        if s {
            // Masks broadcast right-aligned: only a full-rank one has the batch first.
            (shape.rank() == out.rank() && shape.dims().first() == out.dims().first())
                .then_some(())
                .ok_or("mixes batches")
        } else {
            same_for_every_row(shape, out.rank())
                .then_some(())
                .ok_or("reads a mask that differs from batch to batch")
        }
    })
}
