//! Recognizing activations that exported models spell out in primitives, so the
//! fusions that follow see the activation: `x * 0.5 * (1 + erf(x / sqrt(2)))`, in any
//! grouping of the product and with `x * (1 / sqrt(2))` for the division, becomes
//! `gelu(x)`, which then joins the matmul that feeds it as its epilogue; and
//! `x * sigmoid(x)` (in either order) becomes `silu(x)`, which joins a convolution
//! or matmul the same way; `min(max(x, 0), 6)` (ONNX's `Clip` to `[0, 6]`)
//! becomes `relu6(x)`.

use crate::fuse::Fused;
use crate::rewrite::{Rewriter, use_counts};
use rlx_ir::{BinaryOp, Graph, Node, NodeId, Op, UnaryOp};

/// The single value of a one-element constant.
fn scalar(graph: &Graph, node: &Node) -> Option<f64> {
    let Op::Constant { id } = node.op else {
        return None;
    };
    if node.shape.num_elements() != 1 {
        return None;
    }
    graph
        .constants()
        .get(id)?
        .clone()
        .as_ref()
        .to_f64_vec()
        .first()
        .copied()
}

fn near(v: f64, want: f64) -> bool {
    (v - want).abs() <= 1e-6 * want.abs()
}

/// The factors of a product: `mul` nodes read only by the product are opened up.
fn factors(
    nodes: &[Node],
    uses: &[usize],
    id: NodeId,
    top: bool,
    out: &mut Vec<NodeId>,
    inner: &mut Vec<usize>,
) {
    let n = &nodes[id.index()];
    if n.op == Op::Binary(BinaryOp::Mul) && (top || uses[id.index()] == 1) {
        if !top {
            inner.push(id.index());
        }
        for &i in &n.inputs {
            factors(nodes, uses, i, false, out, inner);
        }
    } else {
        out.push(id);
    }
}

/// `x` when `t` is `x / sqrt(2)` or `x * (1 / sqrt(2))`.
fn scaled_input(graph: &Graph, nodes: &[Node], t: NodeId) -> Option<NodeId> {
    let n = &nodes[t.index()];
    let [a, b] = [*n.inputs.first()?, *n.inputs.get(1)?];
    match n.op {
        Op::Binary(BinaryOp::Div) => {
            near(scalar(graph, &nodes[b.index()])?, std::f64::consts::SQRT_2).then_some(a)
        }
        Op::Binary(BinaryOp::Mul) => {
            let (x, c) = match (
                scalar(graph, &nodes[a.index()]),
                scalar(graph, &nodes[b.index()]),
            ) {
                (_, Some(c)) => (a, c),
                (Some(c), None) => (b, c),
                _ => return None,
            };
            near(c, std::f64::consts::FRAC_1_SQRT_2).then_some(x)
        }
        _ => None,
    }
}

/// Matches a spelled-out exact GELU ending at product `end`: returns `x` and the
/// nodes the match replaces.
fn match_gelu(
    graph: &Graph,
    nodes: &[Node],
    uses: &[usize],
    end: usize,
) -> Option<(NodeId, Vec<usize>)> {
    if nodes[end].op != Op::Binary(BinaryOp::Mul) || !nodes[end].shape.dtype().is_float() {
        return None;
    }
    let mut fs = Vec::new();
    let mut inner = Vec::new();
    factors(
        nodes,
        uses,
        NodeId::from_index(end),
        true,
        &mut fs,
        &mut inner,
    );
    if fs.len() != 3 {
        return None;
    }
    let half = fs
        .iter()
        .position(|f| scalar(graph, &nodes[f.index()]).is_some_and(|v| near(v, 0.5)))?;
    // The `1 + erf(...)` factor, read only here.
    let plus = fs.iter().enumerate().find_map(|(k, f)| {
        let n = &nodes[f.index()];
        (k != half && n.op == Op::Binary(BinaryOp::Add) && uses[f.index()] == 1).then_some(k)
    })?;
    let add = &nodes[fs[plus].index()];
    let (e, one) = (add.inputs[0], add.inputs[1]);
    let (e, one) = if nodes[e.index()].op == Op::Unary(UnaryOp::Erf) {
        (e, one)
    } else {
        (one, e)
    };
    if nodes[e.index()].op != Op::Unary(UnaryOp::Erf)
        || uses[e.index()] != 1
        || !scalar(graph, &nodes[one.index()]).is_some_and(|v| near(v, 1.0))
    {
        return None;
    }
    let t = nodes[e.index()].inputs[0];
    if uses[t.index()] != 1 {
        return None;
    }
    let x = scaled_input(graph, nodes, t)?;
    let other = (0..3).find(|&k| k != half && k != plus)?;
    if fs[other] != x || nodes[x.index()].shape != nodes[end].shape {
        return None;
    }
    let mut replaced = inner;
    replaced.extend([fs[plus].index(), e.index(), t.index(), end]);
    Some((x, replaced))
}

/// Matches `x * sigmoid(x)` (either order) ending at product `end`, the sigmoid
/// read only there: returns `x` and the nodes the match replaces.
fn match_silu(nodes: &[Node], uses: &[usize], end: usize) -> Option<(NodeId, Vec<usize>)> {
    let node = &nodes[end];
    if node.op != Op::Binary(BinaryOp::Mul) || !node.shape.dtype().is_float() {
        return None;
    }
    let [a, b] = [*node.inputs.first()?, *node.inputs.get(1)?];
    [(a, b), (b, a)].into_iter().find_map(|(x, s)| {
        let sigmoid = &nodes[s.index()];
        (sigmoid.op == Op::Unary(UnaryOp::Sigmoid)
            && sigmoid.inputs.first() == Some(&x)
            && uses[s.index()] == 1
            && nodes[x.index()].shape == node.shape)
            .then(|| (x, vec![s.index(), end]))
    })
}

/// The operand of a binary `op` node beside a one-element constant equal to `want`
/// (either side).
fn beside_scalar(
    graph: &Graph,
    nodes: &[Node],
    node: &Node,
    op: BinaryOp,
    want: f64,
) -> Option<NodeId> {
    if node.op != Op::Binary(op) {
        return None;
    }
    let [a, b] = [*node.inputs.first()?, *node.inputs.get(1)?];
    let is_want = |id: NodeId| scalar(graph, &nodes[id.index()]).is_some_and(|v| v == want);
    if is_want(b) {
        Some(a)
    } else if is_want(a) {
        Some(b)
    } else {
        None
    }
}

/// Matches a clamp to `[0, 6]` ending at `end`: `min(max(x, 0), 6)` or
/// `max(min(x, 6), 0)` (operands in either order, the inner node read only here), as
/// ONNX `Clip` imports. Returns `x` and the nodes the match replaces.
fn match_relu6(
    graph: &Graph,
    nodes: &[Node],
    uses: &[usize],
    end: usize,
) -> Option<(NodeId, Vec<usize>)> {
    let node = &nodes[end];
    if !node.shape.dtype().is_float() {
        return None;
    }
    [
        (BinaryOp::Min, 6.0, BinaryOp::Max, 0.0),
        (BinaryOp::Max, 0.0, BinaryOp::Min, 6.0),
    ]
    .into_iter()
    .find_map(|(outer, outer_bound, inner, inner_bound)| {
        let mid = beside_scalar(graph, nodes, node, outer, outer_bound)?;
        let x = beside_scalar(graph, nodes, &nodes[mid.index()], inner, inner_bound)?;
        (uses[mid.index()] == 1 && nodes[x.index()].shape == node.shape)
            .then(|| (x, vec![mid.index(), end]))
    })
}

/// Replaces every spelled-out exact GELU by one `gelu` node, every
/// `x * sigmoid(x)` by one `silu` node, and every clamp to `[0, 6]` by one `relu6`,
/// each only where `runs` says the backend runs the activation natively (the
/// decompositions ran before this).
pub fn recognize_activations(graph: &Graph, runs: &dyn Fn(&Op) -> bool) -> Fused {
    let nodes = graph.nodes();
    let uses = use_counts(graph);
    let mut at_end: Vec<Option<(NodeId, UnaryOp)>> = vec![None; nodes.len()];
    let mut absorbed = vec![false; nodes.len()];
    let mut records = Vec::new();
    for (end, slot) in at_end.iter_mut().enumerate() {
        let found = match_gelu(graph, &nodes, &uses, end)
            .map(|(x, replaced)| (x, replaced, UnaryOp::Gelu))
            .or_else(|| {
                match_silu(&nodes, &uses, end).map(|(x, replaced)| (x, replaced, UnaryOp::Silu))
            })
            .or_else(|| {
                match_relu6(graph, &nodes, &uses, end)
                    .map(|(x, replaced)| (x, replaced, UnaryOp::Relu6))
            });
        if let Some((x, replaced, activation)) = found
            && runs(&Op::Unary(activation))
            && replaced.iter().all(|&n| !absorbed[n])
        {
            for &n in &replaced {
                absorbed[n] = true;
            }
            *slot = Some((x, activation));
            let mut sorted = replaced.clone();
            sorted.sort_unstable();
            records.push((
                end,
                sorted
                    .iter()
                    .map(|&n| format!("{} %{n}", nodes[n].op.name()))
                    .collect(),
            ));
        }
    }
    let mut w = Rewriter::new(nodes.len());
    for (i, node) in nodes.iter().enumerate() {
        if let Some((x, activation)) = at_end[i] {
            w.place(
                i,
                Node {
                    op: Op::Unary(activation),
                    inputs: vec![x],
                    shape: node.shape.clone(),
                },
            );
        } else if !absorbed[i] {
            w.place(i, node.clone());
        }
    }
    crate::fuse::finish(graph, w, records)
}
