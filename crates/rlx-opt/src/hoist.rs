//! Hoisting a weight out of a loop that was unrolled: an exported recurrent layer
//! multiplies each time step's row, gathered from one sequence tensor, by the same
//! weight matrix, reading the whole matrix once per step. A row-wise product commutes
//! with taking rows, `gather(x, i) @ w == gather(x @ w, i)`, so those products become
//! one product over the whole sequence (the weight read once, a tall GEMM that threads
//! well) and each step gathers its rows of the result.

use crate::fuse::Fused;
use crate::rewrite::{Rewriter, use_counts};
use rlx_ir::{Graph, Node, NodeId, Op, Shape, SliceAxis};
use std::collections::HashMap;

/// One `matmul(gather(x, idx, axis), w)` eligible for hoisting.
struct Member {
    matmul: usize,
    indices: NodeId,
    rows: usize,
}

/// Replaces groups of `matmul(gather(x, idx_t, axis), w)` sharing `x`, `w` and `axis`
/// by one `h = matmul(x, w)` and `gather(h, idx_t, axis)` per member. A group is
/// hoisted when it has two members or more and together they take at least as many
/// rows as `x` has along `axis` (so no work is added).
pub fn hoist_gathered_matmuls(graph: &Graph) -> Fused {
    let nodes = graph.nodes();
    let uses = use_counts(graph);
    let mut groups: HashMap<(NodeId, NodeId, usize), Vec<Member>> = HashMap::new();
    for (i, n) in nodes.iter().enumerate() {
        if n.op != Op::MatMul || !n.shape.dtype().is_float() {
            continue;
        }
        let (a, w) = (n.inputs[0], n.inputs[1]);
        let ga = &nodes[a.index()];
        let Op::Gather { axis } = ga.op else {
            continue;
        };
        let (x, idx) = (ga.inputs[0], ga.inputs[1]);
        let xs = &nodes[x.index()].shape;
        let ws = &nodes[w.index()].shape;
        if ws.rank() != 2
            || axis + 1 >= xs.rank()
            || ga.shape.rank() < 2
            || uses[a.index()] != 1
            || !matches!(nodes[idx.index()].op, Op::Constant { .. })
        {
            continue;
        }
        groups.entry((x, w, axis)).or_default().push(Member {
            matmul: i,
            indices: idx,
            rows: nodes[idx.index()].shape.num_elements(),
        });
    }
    groups.retain(|&(x, _, axis), members| {
        let taken: usize = members.iter().map(|m| m.rows).sum();
        members.len() >= 2 && taken >= nodes[x.index()].shape.dim(axis)
    });
    // The first member of each group, where the hoisted product is placed.
    let mut first: HashMap<usize, (NodeId, NodeId)> = HashMap::new();
    // Each member's group and indices.
    let mut member_of: HashMap<usize, ((NodeId, NodeId, usize), NodeId)> = HashMap::new();
    for (&key, members) in &groups {
        let lead = members.iter().map(|m| m.matmul).min().unwrap_or(0);
        first.insert(lead, (key.0, key.1));
        for m in members {
            member_of.insert(m.matmul, (key, m.indices));
        }
    }
    let mut w = Rewriter::new(nodes.len());
    let mut hoisted: HashMap<(NodeId, NodeId, usize), NodeId> = HashMap::new();
    let mut records = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        let Some(&(key, indices)) = member_of.get(&i) else {
            w.place(i, n.clone());
            continue;
        };
        if let Some(&(x, weight)) = first.get(&i) {
            let xs = &nodes[x.index()].shape;
            let mut dims = xs.dims().to_vec();
            *dims.last_mut().unwrap_or(&mut 0) = nodes[weight.index()].shape.dim(1);
            let product = w.insert(Node {
                op: Op::MatMul,
                inputs: vec![x, weight],
                shape: Shape::new(&dims, n.shape.dtype()),
            });
            hoisted.insert(key, product);
        }
        let product = hoisted[&key];
        w.place_with_new_inputs(
            i,
            Node {
                op: Op::Gather { axis: key.2 },
                inputs: vec![product, w.map(indices)],
                shape: n.shape.clone(),
            },
        );
        records.push((
            i,
            vec![
                format!("matmul %{i}"),
                format!("gather %{}", n.inputs[0].index()),
            ],
        ));
    }
    crate::fuse::finish(graph, w, records)
}

/// Replaces `matmul(slice(x), w)`, where the slice keeps `x`'s last axis whole and
/// takes every row of the others (a reversal of the time axis, say) and `w` is a
/// matrix no wider than it is deep, by `slice(matmul(x, w))`: the same products,
/// with the slice copying rows of the narrower result. An exported bidirectional
/// recurrent layer flips its whole input sequence (`[steps, batch, 4096]` in the CRNN
/// benchmark model) only to multiply it by a `4096 x 400` weight.
pub fn hoist_sliced_matmuls(graph: &Graph) -> Fused {
    let nodes = graph.nodes();
    let uses = use_counts(graph);
    let eligible = |n: &Node| -> Option<(NodeId, NodeId, Vec<SliceAxis>)> {
        if n.op != Op::MatMul || !n.shape.dtype().is_float() {
            return None;
        }
        let (a, w) = (n.inputs[0], n.inputs[1]);
        let Op::Slice { axes } = &nodes[a.index()].op else {
            return None;
        };
        let x = nodes[a.index()].inputs[0];
        let (xs, ws) = (&nodes[x.index()].shape, &nodes[w.index()].shape);
        let (rank, k) = (xs.rank(), xs.dims().last().copied().unwrap_or(0));
        let whole_rows = axes.len() == rank
            && rank >= 2
            && axes[..rank - 1]
                .iter()
                .zip(xs.dims())
                .all(|(s, &d)| s.len == d)
            && axes[rank - 1]
                == (SliceAxis {
                    start: 0,
                    step: 1,
                    len: k,
                });
        (whole_rows && ws.rank() == 2 && ws.dim(1) <= k && uses[a.index()] == 1)
            .then(|| (x, w, axes.clone()))
    };
    let mut w = Rewriter::new(nodes.len());
    let mut records = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        let Some((x, weight, mut axes)) = eligible(n) else {
            w.place(i, n.clone());
            continue;
        };
        let cols = nodes[weight.index()].shape.dim(1);
        let mut dims = nodes[x.index()].shape.dims().to_vec();
        if let (Some(d), Some(a)) = (dims.last_mut(), axes.last_mut()) {
            *d = cols;
            a.len = cols;
        }
        let product = w.insert(Node {
            op: Op::MatMul,
            inputs: vec![x, weight],
            shape: Shape::new(&dims, n.shape.dtype()),
        });
        w.place_with_new_inputs(
            i,
            Node {
                op: Op::Slice { axes },
                inputs: vec![product],
                shape: n.shape.clone(),
            },
        );
        records.push((
            i,
            vec![
                format!("matmul %{i}"),
                format!("slice %{}", n.inputs[0].index()),
            ],
        ));
    }
    crate::fuse::finish(graph, w, records)
}
