//! Recognizing activations that exported models spell out in primitives, so the
//! fusions that follow see the activation: `x * 0.5 * (1 + erf(x / sqrt(2)))`, in any
//! grouping of the product and with `x * (1 / sqrt(2))` for the division, becomes
//! `gelu(x)`, which then joins the matmul that feeds it as its epilogue; its tanh
//! approximation `0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))` becomes
//! `gelu_tanh(x)` the same way; and
//! `x * sigmoid(x)` (in either order) becomes `silu(x)`, which joins a convolution
//! or matmul the same way; `min(max(x, 0), 6)` (ONNX's `Clip` to `[0, 6]`)
//! becomes `relu6(x)`. An activation read through a reshape that only it reads
//! moves before the reshape, next to the product it can join (a 2-D `Gemm` reshaped
//! back to `[batch, tokens, features]` before its GELU).

use crate::fuse::Fused;
use crate::rewrite::{Rewriter, use_counts};
use rlx_ir::{BinaryOp, F64Bits, Graph, Node, NodeId, Op, ReduceOp, UnaryOp};

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

/// The parts of a GELU-shaped product ending at `end`: `0.5 * x * (1 + f)` in any
/// grouping (inner products read only there), where `f` is a unary `op` of one
/// operand read only by the sum. Returns `x`, `f`'s node and the nodes the product
/// and sum take (`end` last).
fn half_x_one_plus(
    graph: &Graph,
    nodes: &[Node],
    uses: &[usize],
    end: usize,
    op: UnaryOp,
) -> Option<(NodeId, NodeId, Vec<usize>)> {
    if nodes[end].op != Op::Binary(BinaryOp::Mul) || !nodes[end].shape.dtype().is_float() {
        return None;
    }
    let mut fs = Vec::new();
    let mut replaced = Vec::new();
    factors(
        nodes,
        uses,
        NodeId::from_index(end),
        true,
        &mut fs,
        &mut replaced,
    );
    if fs.len() != 3 {
        return None;
    }
    let half = fs
        .iter()
        .position(|f| scalar(graph, &nodes[f.index()]).is_some_and(|v| near(v, 0.5)))?;
    let once = |id: NodeId| uses[id.index()] == 1;
    // The `1 + f` factor, read only here.
    let plus = fs.iter().enumerate().find_map(|(k, f)| {
        let n = &nodes[f.index()];
        (k != half && n.op == Op::Binary(BinaryOp::Add) && once(*f)).then_some(k)
    })?;
    let x = fs[(0..3).find(|&k| k != half && k != plus)?];
    if nodes[x.index()].shape != nodes[end].shape {
        return None;
    }
    let add = &nodes[fs[plus].index()];
    let f = [add.inputs[0], add.inputs[1]].into_iter().find(|&t| {
        nodes[t.index()].op == Op::Unary(op)
            && once(t)
            && add
                .inputs
                .iter()
                .any(|&o| o != t && scalar(graph, &nodes[o.index()]).is_some_and(|v| near(v, 1.0)))
    })?;
    replaced.extend([fs[plus].index(), f.index(), end]);
    Some((x, f, replaced))
}

/// Matches a spelled-out exact GELU ending at product `end`: returns `x` and the
/// nodes the match replaces.
fn match_gelu(
    graph: &Graph,
    nodes: &[Node],
    uses: &[usize],
    end: usize,
) -> Option<(NodeId, Vec<usize>)> {
    let (x, e, mut replaced) = half_x_one_plus(graph, nodes, uses, end, UnaryOp::Erf)?;
    let t = nodes[e.index()].inputs[0];
    if uses[t.index()] != 1 || scaled_input(graph, nodes, t)? != x {
        return None;
    }
    replaced.push(t.index());
    Some((x, replaced))
}

/// The operand of `node`, a product of two, beside a one-element constant near
/// `want` (either side).
fn times_scalar(graph: &Graph, nodes: &[Node], node: &Node, want: f64) -> Option<NodeId> {
    if node.op != Op::Binary(BinaryOp::Mul) {
        return None;
    }
    let [a, b] = [*node.inputs.first()?, *node.inputs.get(1)?];
    let near_want = |id: NodeId| scalar(graph, &nodes[id.index()]).is_some_and(|v| near(v, want));
    if near_want(b) {
        Some(a)
    } else if near_want(a) {
        Some(b)
    } else {
        None
    }
}

/// Whether `cube` is `x^3`: `pow(x, 3)`, or a product whose factors are `x` three
/// times; `inner` gets the product's inner nodes.
fn is_cube(
    graph: &Graph,
    nodes: &[Node],
    uses: &[usize],
    cube: NodeId,
    x: NodeId,
    inner: &mut Vec<usize>,
) -> bool {
    let n = &nodes[cube.index()];
    match n.op {
        Op::Binary(BinaryOp::Pow) => {
            n.inputs[0] == x && scalar(graph, &nodes[n.inputs[1].index()]) == Some(3.0)
        }
        Op::Binary(BinaryOp::Mul) => {
            let mut fs = Vec::new();
            factors(nodes, uses, cube, true, &mut fs, inner);
            fs == [x, x, x]
        }
        _ => false,
    }
}

/// Matches the tanh approximation of GELU spelled out, ending at product `end`:
/// `0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x^3)))`, the product in any
/// grouping, each sum and product in either order, the cube as `pow(x, 3)` or
/// `x * x * x` (GPT-2's `gelu_new`, PyTorch's tanh GELU before opset 20). Returns
/// `x` and the nodes the match replaces.
fn match_gelu_tanh(
    graph: &Graph,
    nodes: &[Node],
    uses: &[usize],
    end: usize,
) -> Option<(NodeId, Vec<usize>)> {
    let (x, th, mut replaced) = half_x_one_plus(graph, nodes, uses, end, UnaryOp::Tanh)?;
    let once = |id: NodeId| uses[id.index()] == 1;
    let t = nodes[th.index()].inputs[0];
    let sum = times_scalar(
        graph,
        nodes,
        &nodes[t.index()],
        (2.0 / std::f64::consts::PI).sqrt(),
    )?;
    let sum_node = &nodes[sum.index()];
    if !once(t) || !once(sum) || sum_node.op != Op::Binary(BinaryOp::Add) {
        return None;
    }
    let [a, b] = [sum_node.inputs[0], sum_node.inputs[1]];
    let scaled_cube = match (a == x, b == x) {
        (true, false) => b,
        (false, true) => a,
        _ => return None,
    };
    let cube = times_scalar(graph, nodes, &nodes[scaled_cube.index()], 0.044715)?;
    if !once(scaled_cube) || !once(cube) || !is_cube(graph, nodes, uses, cube, x, &mut replaced) {
        return None;
    }
    replaced.extend([t, sum, scaled_cube, cube].iter().map(|n| n.index()));
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

/// Replaces every spelled-out exact GELU by one `gelu` node (its tanh approximation
/// by `gelu_tanh`), every
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
                match_gelu_tanh(graph, &nodes, &uses, end)
                    .map(|(x, replaced)| (x, replaced, UnaryOp::GeluTanh))
            })
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

/// Moves every epilogue activation whose operand is a reshape read only by it to
/// before the reshape: `act(reshape(x))` becomes `reshape(act(x))`, the same values,
/// with the activation now right after the node that makes `x`.
pub fn activations_before_reshapes(graph: &Graph) -> Fused {
    let nodes = graph.nodes();
    let uses = use_counts(graph);
    // The activation that takes the place of each reshape it moves before.
    let mut moved: Vec<Option<UnaryOp>> = vec![None; nodes.len()];
    let mut records = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        let Some(act) = crate::fuse::epilogue_activation(&node.op) else {
            continue;
        };
        let r = node.inputs[0].index();
        if matches!(nodes[r].op, Op::Reshape { .. }) && uses[r] == 1 {
            moved[r] = Some(act);
            records.push((
                r,
                vec![format!("reshape %{r}"), format!("{} %{i}", node.op.name())],
            ));
        }
    }
    let mut w = Rewriter::new(nodes.len());
    for (i, node) in nodes.iter().enumerate() {
        if let Some(act) = moved[i] {
            // The activation, on the reshape's operand.
            let x = node.inputs[0];
            w.place(
                i,
                Node {
                    op: Op::Unary(act),
                    inputs: vec![x],
                    shape: nodes[x.index()].shape.clone(),
                },
            );
        } else if let Some(r) = node.inputs.first().filter(|r| moved[r.index()].is_some())
            && crate::fuse::epilogue_activation(&node.op).is_some()
        {
            // The reshape, of the moved activation.
            w.place(
                i,
                Node {
                    op: nodes[r.index()].op.clone(),
                    inputs: vec![*r],
                    shape: node.shape.clone(),
                },
            );
        } else {
            w.place(i, node.clone());
        }
    }
    crate::fuse::finish(graph, w, records)
}

/// `s` when `r` is `1 / sqrt(s)`: `rsqrt(s)`, `reciprocal(sqrt(s))` or `1 / sqrt(s)`,
/// every node between read only there; `inner` gets those nodes.
fn inverse_root(
    graph: &Graph,
    nodes: &[Node],
    uses: &[usize],
    r: NodeId,
    inner: &mut Vec<usize>,
) -> Option<NodeId> {
    let n = &nodes[r.index()];
    let root_of = |x: NodeId| -> Option<NodeId> {
        let m = &nodes[x.index()];
        (m.op == Op::Unary(UnaryOp::Sqrt) && uses[x.index()] == 1).then(|| m.inputs[0])
    };
    let s = match n.op {
        Op::Unary(UnaryOp::Rsqrt) => n.inputs[0],
        Op::Unary(UnaryOp::Reciprocal) => {
            inner.push(n.inputs[0].index());
            root_of(n.inputs[0])?
        }
        Op::Binary(BinaryOp::Div) if scalar(graph, &nodes[n.inputs[0].index()]) == Some(1.0) => {
            inner.push(n.inputs[1].index());
            root_of(n.inputs[1])?
        }
        _ => return None,
    };
    Some(s)
}

/// Matches an RMS norm spelled out, ending at product `end`: `w * (x * r)` (either
/// order, or `x / sqrt(...)` for `x * r`) with `r = 1 / sqrt(mean(x^2, last axis) +
/// eps)` and `w` one value per feature, the square as `pow(x, 2)` or `x * x`, as T5
/// and Llama-family exports write it. Returns `x`, `w`, `eps` and the nodes the
/// match replaces.
fn match_rms_norm(
    graph: &Graph,
    nodes: &[Node],
    uses: &[usize],
    end: usize,
) -> Option<(NodeId, NodeId, f64, Vec<usize>)> {
    let node = &nodes[end];
    if node.op != Op::Binary(BinaryOp::Mul) || !node.shape.dtype().is_float() {
        return None;
    }
    let dims = node.shape.dims();
    let features = *dims.last()?;
    let once = |id: NodeId| uses[id.index()] == 1;
    let [a, b] = [node.inputs[0], node.inputs[1]];
    [(a, b), (b, a)].into_iter().find_map(|(w, normed)| {
        if nodes[w.index()].shape.dims() != [features] || !once(normed) {
            return None;
        }
        let mut replaced = vec![normed.index()];
        let n = &nodes[normed.index()];
        // `x * r` (either order) or `x / sqrt(s)`.
        let (x, s) = match n.op {
            Op::Binary(BinaryOp::Mul) => [(n.inputs[0], n.inputs[1]), (n.inputs[1], n.inputs[0])]
                .into_iter()
                .find_map(|(x, r)| {
                    let mut inner = vec![r.index()];
                    let s = once(r)
                        .then(|| inverse_root(graph, nodes, uses, r, &mut inner))
                        .flatten()?;
                    replaced.extend(inner);
                    Some((x, s))
                })?,
            Op::Binary(BinaryOp::Div) => {
                let root = n.inputs[1];
                let m = &nodes[root.index()];
                if m.op != Op::Unary(UnaryOp::Sqrt) || !once(root) {
                    return None;
                }
                replaced.push(root.index());
                (n.inputs[0], m.inputs[0])
            }
            _ => return None,
        };
        if nodes[x.index()].shape != node.shape || !once(s) {
            return None;
        }
        // `s = mean + eps`, either order.
        let sum = &nodes[s.index()];
        if sum.op != Op::Binary(BinaryOp::Add) {
            return None;
        }
        let [p, q] = [sum.inputs[0], sum.inputs[1]];
        let (mean, eps) = match (
            scalar(graph, &nodes[p.index()]),
            scalar(graph, &nodes[q.index()]),
        ) {
            (_, Some(e)) => (p, e),
            (Some(e), None) => (q, e),
            _ => return None,
        };
        if !(eps >= 0.0 && eps.is_finite() && once(mean)) {
            return None;
        }
        let last = dims.len() - 1;
        let reduce = &nodes[mean.index()];
        let Op::Reduce {
            op: ReduceOp::Mean,
            axes,
            keepdims: true,
        } = &reduce.op
        else {
            return None;
        };
        let square = reduce.inputs[0];
        let sq = &nodes[square.index()];
        let squares_x = match sq.op {
            Op::Binary(BinaryOp::Pow) => {
                sq.inputs[0] == x && scalar(graph, &nodes[sq.inputs[1].index()]) == Some(2.0)
            }
            Op::Binary(BinaryOp::Mul) => sq.inputs[0] == x && sq.inputs[1] == x,
            _ => false,
        };
        if axes.as_slice() != [last] || !once(square) || !squares_x {
            return None;
        }
        replaced.extend([s.index(), mean.index(), square.index(), end]);
        Some((x, w, eps, replaced))
    })
}

/// Replaces every spelled-out RMS norm (see [`match_rms_norm`]) by one `rms_norm`
/// node, where `runs` says the backend runs it natively: one pass over each row
/// instead of a square, a mean, a root and two products.
pub fn recognize_rms_norms(graph: &Graph, runs: &dyn Fn(&Op) -> bool) -> Fused {
    let nodes = graph.nodes();
    let uses = use_counts(graph);
    let mut at_end: Vec<Option<(NodeId, NodeId, f64)>> = vec![None; nodes.len()];
    let mut absorbed = vec![false; nodes.len()];
    let mut records = Vec::new();
    for (end, slot) in at_end.iter_mut().enumerate() {
        let Some((x, w, eps, replaced)) = match_rms_norm(graph, &nodes, &uses, end) else {
            continue;
        };
        let op = Op::RmsNorm {
            eps: F64Bits::new(eps),
        };
        if !runs(&op) || replaced.iter().any(|&n| absorbed[n]) {
            continue;
        }
        for &n in &replaced {
            absorbed[n] = true;
        }
        *slot = Some((x, w, eps));
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
    let mut w = Rewriter::new(nodes.len());
    for (i, node) in nodes.iter().enumerate() {
        if let Some((x, gamma, eps)) = at_end[i] {
            w.place(
                i,
                Node {
                    op: Op::RmsNorm {
                        eps: F64Bits::new(eps),
                    },
                    inputs: vec![x, gamma],
                    shape: node.shape.clone(),
                },
            );
        } else if !absorbed[i] {
            w.place(i, node.clone());
        }
    }
    crate::fuse::finish(graph, w, records)
}
