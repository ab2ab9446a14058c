//! Common-subexpression elimination and constant folding.

use crate::rewrite::Rewriter;
use rlx_ir::reference::{HostTensor, eval_node};
use rlx_ir::{Graph, Node, NodeId, Op};
use std::collections::HashMap;

/// Nodes that compute the same op on the same operands become one. Sources and
/// `write_at` (which has an effect) are never merged. A reshape to its operand's own
/// shape (exporters write them around attention) and a slice that takes all of
/// every axis (a dilated convolution's middle region, split by the importer) are
/// their operand, unless a graph output; a permute that moves only unit axes (a
/// batch-first model around a sequence-first block) is a reshape, so fusions see
/// through it.
pub fn eliminate_common_subexpressions(graph: &Graph) -> Graph {
    let nodes = graph.nodes();
    let mut w = Rewriter::new(nodes.len());
    let mut seen: HashMap<(Op, Vec<NodeId>), NodeId> = HashMap::new();
    for (i, node) in nodes.iter().enumerate() {
        let reshaped;
        let node = match &node.op {
            Op::Permute { perm }
                if crate::plan::moves_only_unit_axes(
                    perm,
                    &nodes[node.inputs[0].index()].shape,
                ) =>
            {
                reshaped = Node {
                    op: Op::Reshape {
                        dims: node.shape.dims().to_vec(),
                    },
                    ..node.clone()
                };
                &reshaped
            }
            _ => node,
        };
        let source = &nodes[node.inputs.first().map_or(i, |x| x.index())].shape;
        let unchanged = match &node.op {
            Op::Reshape { .. } => *source == node.shape,
            Op::Slice { axes } => {
                axes.len() == source.rank()
                    && axes
                        .iter()
                        .zip(source.dims())
                        .all(|(a, &len)| a.start == 0 && a.step == 1 && a.len == len)
            }
            _ => false,
        };
        if unchanged && !graph.outputs().contains(&NodeId::from_index(i)) {
            w.alias(i, node.inputs[0]);
            continue;
        }
        let mergeable = !node.op.is_source() && !matches!(node.op, Op::WriteAt { .. });
        if mergeable {
            let key = (
                node.op.clone(),
                node.inputs.iter().map(|&x| w.map(x)).collect(),
            );
            if let Some(&first) = seen.get(&key) {
                w.alias(i, first);
                continue;
            }
            w.place(i, node.clone());
            seen.insert(key, NodeId::from_index(i));
        } else {
            w.place(i, node.clone());
        }
    }
    let constants = graph.constants().to_vec();
    w.finish(graph, constants)
}

/// The largest result (in elements) folded into a constant.
const MAX_FOLDED_ELEMENTS: usize = 1 << 16;

/// Nodes whose operands are all constants (and `range`, which has none) are evaluated
/// once with the reference evaluator and become constants. A node whose evaluation
/// fails (say, a gather with an index out of range) is left for run time to report.
pub fn fold_constants(graph: &Graph) -> Graph {
    let nodes = graph.nodes();
    let mut constants = graph.constants().to_vec();
    let mut w = Rewriter::new(nodes.len());
    // Values of the constant nodes seen so far, by old index.
    let mut values: HashMap<usize, HostTensor> = HashMap::new();
    for (i, node) in nodes.iter().enumerate() {
        if let Op::Constant { id } = node.op {
            if let Some(t) = constants
                .get(id)
                .and_then(|d| HostTensor::from_data(node.shape.dims(), d).ok())
            {
                values.insert(i, t);
            }
            w.place(i, node.clone());
            continue;
        }
        let foldable = !node.op.is_source()
            && !matches!(node.op, Op::WriteAt { .. })
            && (node.inputs.is_empty() == matches!(node.op, Op::Range { .. }))
            && node.inputs.iter().all(|x| values.contains_key(&x.index()))
            && node.shape.num_elements() <= MAX_FOLDED_ELEMENTS;
        let folded = foldable
            .then(|| {
                let operands: Vec<&HostTensor> =
                    node.inputs.iter().map(|x| &values[&x.index()]).collect();
                eval_node(&node.op, &operands, &node.shape, &constants).ok()
            })
            .flatten();
        match folded {
            Some(t) => {
                let id = constants.len();
                constants.push(t.to_data());
                values.insert(i, t);
                w.place(
                    i,
                    Node {
                        op: Op::Constant { id },
                        inputs: Vec::new(),
                        shape: node.shape.clone(),
                    },
                );
            }
            None => w.place(i, node.clone()),
        }
    }
    w.finish(graph, constants)
}
