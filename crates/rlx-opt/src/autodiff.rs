//! Reverse-mode gradients: [`grad`] appends to a graph the nodes that compute the
//! gradient of a scalar loss with respect to some of its params or inputs, by the
//! vector-Jacobian product (VJP) of each node on a path between them, from the loss
//! back.
//!
//! Rules exist for every differentiable op, listed in [`grad`]'s docs; a node on a
//! path that needs a gradient through an op with none (a comparison, an index
//! result, an integer op, a write into state) is an error that names it.

use rlx_ir::{
    BinaryOp, DType, Error, Graph, NodeId, Op, PadMode, ReduceOp, Result, SliceAxis, UnaryOp,
};

/// Appends to `graph` the gradient of `loss` (a float tensor of one element) with
/// respect to each of `wrt` (params or inputs, or any node), and returns one node per
/// entry of `wrt`, of its shape: the gradient, or zeros where the loss does not depend
/// on it. The graph's outputs are left as they were.
///
/// Rules: `neg`, `abs`, `exp`, `log`, `sqrt`, `rsqrt`, `reciprocal`, `tanh`,
/// `sigmoid`, `relu`, `silu`, `gelu`, `gelu_tanh`, `erf`, `sin`, `cos` and `atan`;
/// `floor`, `ceil`, `round` and `sign` (zero, as PyTorch gives); `add`, `sub`, `mul`,
/// `div`, `pow` (positive bases), `max` and `min` (the first operand on a tie) and
/// `mod` (`g` and `-g q`, `q` the quotient the op used) with broadcasting; `where` (to
/// its two values); `matmul` (any ranks, batch dims broadcast); `sum`, `mean` and
/// `prod` reductions (a zero in a group gets the product of the others), and `max`
/// and `min` ones (to the extremes, ties sharing evenly); `softmax` and
/// `log_softmax`; `reshape`, `permute`, `expand`, `slice` (any steps), `concat`,
/// `gather` (any axis and ranks, repeated indices summed), `pad` (every mode: the
/// border's gradient adds into the elements it copied), `tile`, `cumsum`,
/// `topk_values` (to the picked positions); `conv2d` (any stride, padding, dilation
/// and groups), `max_pool2d` and `avg_pool2d` (any window, padding and dilation; the
/// max to each window's maximum, ties sharing evenly); `quant_matmul` (to its float
/// activations) and float casts. Layer and RMS norm and attention (in `f32` and
/// `f64`) have closed-form rules of their own; other composites (rope, the fused
/// forms, half-precision norms and attention) go through their decomposition into
/// primitives.
///
/// No rule: comparisons, argmax and argmin, `one_hot`, integer and bool ops, index
/// results (`topk_indices`), `random_uniform` (whose operand is an integer key),
/// `write_at` (a write into state) and `cached_attention` (inference over a cache).
///
/// # Errors
/// [`Error::InvalidArgument`] when `loss` is not a float tensor of one element or an
/// id is not in the graph; [`Error::InvalidGraph`] naming the node and op when a path
/// from one of `wrt` to the loss goes through an op with no gradient rule.
pub fn grad(graph: &Graph, loss: NodeId, wrt: &[NodeId]) -> Result<Vec<NodeId>> {
    let count = graph.len();
    for &id in wrt.iter().chain([&loss]) {
        if id.index() >= count {
            return Err(Error::invalid(
                "grad",
                format!("node %{} is not in graph '{}'", id.index(), graph.name()),
            ));
        }
    }
    let loss_shape = graph.shape(loss)?;
    if !loss_shape.dtype().is_float() || loss_shape.num_elements() != 1 {
        return Err(Error::invalid(
            "grad",
            format!(
                "the loss must be a float tensor of one element, got {loss_shape} (node %{})",
                loss.index()
            ),
        ));
    }
    let needed = on_paths(graph, loss, wrt);
    let mut adjoints: Vec<Option<NodeId>> = vec![None; count];
    let ones = graph.scalar(1.0, loss_shape.dtype());
    adjoints[loss.index()] = Some(graph.reshape(ones, loss_shape.dims())?);
    for index in (0..=loss.index()).rev() {
        let Some(cotangent) = adjoints[index] else {
            continue;
        };
        if !needed[index] {
            continue;
        }
        let node = graph.node(NodeId::from_index(index))?;
        let operands: Vec<NodeId> = node.inputs.clone();
        if operands.iter().all(|x| !needed[x.index()]) {
            // A leaf, or a node none of whose operands lead back to `wrt`.
            continue;
        }
        // A bool or integer value between `wrt` and the loss (a comparison, an
        // index, an integer op) carries no gradient: name the op that made it. (A
        // `where`'s condition and a gather's indices only select, and need none.)
        let selects = |i: usize| {
            (node.op == Op::Where && i == 0) || (matches!(node.op, Op::Gather { .. }) && i == 1)
        };
        let carrying = operands.iter().enumerate().filter(|&(i, _)| !selects(i));
        for (_, &x) in carrying.filter(|(_, x)| needed[x.index()]) {
            let made = graph.node(x)?;
            if !made.shape.dtype().is_float() {
                return Err(Error::InvalidGraph {
                    graph: graph.name().to_string(),
                    node: format!("%{}", x.index()),
                    message: format!(
                        "the loss needs a gradient through `{}` (node %{index}) to its \
                         operand %{}, the {} result of `{}`, which carries none",
                        node.op.name(),
                        x.index(),
                        made.shape.dtype(),
                        made.op.name(),
                    ),
                });
            }
        }
        let contributions = vjp(graph, index, &node.op, &operands, cotangent)?;
        for (operand, contribution) in operands.iter().zip(contributions) {
            let (Some(contribution), true) = (contribution, needed[operand.index()]) else {
                continue;
            };
            let slot = &mut adjoints[operand.index()];
            *slot = Some(match *slot {
                Some(sum) => graph.binary(BinaryOp::Add, sum, contribution)?,
                None => contribution,
            });
        }
    }
    wrt.iter()
        .map(|&id| match adjoints[id.index()] {
            Some(g) => Ok(g),
            None => zeros_like(graph, id),
        })
        .collect()
}

/// Appends to `graph` the forward-mode derivative of `y` along `tangent` at `x`: the
/// Jacobian-vector product `J v` (of `y`'s shape) of `y` with respect to `x`, for a
/// `tangent` of `x`'s shape and dtype.
///
/// It transposes the reverse mode rather than keeping a second set of rules: with `u`
/// of `y`'s shape, `Jᵀu` is the gradient of `sum(y u)`, linear in `u`, and `J v` is the
/// gradient of `sum(Jᵀu v)` with respect to `u` (taken at `u = 0`). So every op with a
/// reverse rule whose backward nodes have rules too has a forward one.
///
/// # Errors
/// As [`grad`]; [`Error::InvalidArgument`] when `y` is not a float tensor or the
/// tangent's shape is not `x`'s.
pub fn jvp(graph: &Graph, y: NodeId, x: NodeId, tangent: NodeId) -> Result<NodeId> {
    for id in [y, x, tangent] {
        if id.index() >= graph.len() {
            return Err(Error::invalid(
                "jvp",
                format!("node %{} is not in graph '{}'", id.index(), graph.name()),
            ));
        }
    }
    let (ys, xs, vs) = (graph.shape(y)?, graph.shape(x)?, graph.shape(tangent)?);
    if !ys.dtype().is_float() {
        return Err(Error::invalid(
            "jvp",
            format!("the output must be a float tensor, got {ys}"),
        ));
    }
    if vs != xs {
        return Err(Error::invalid(
            "jvp",
            format!("the tangent must have the input's shape {xs}, got {vs}"),
        ));
    }
    let u = zeros_like(graph, y)?;
    let paired = graph.sum(graph.binary(BinaryOp::Mul, y, u)?, &[], false)?;
    let pulled = grad(graph, paired, &[x])?[0];
    let along = graph.sum(graph.binary(BinaryOp::Mul, pulled, tangent)?, &[], false)?;
    Ok(grad(graph, along, &[u])?[0])
}

/// Which nodes lie on a path from one of `wrt` to `loss`: reachable from `wrt` through
/// operand edges, and among `loss`'s operands (transitively).
fn on_paths(graph: &Graph, loss: NodeId, wrt: &[NodeId]) -> Vec<bool> {
    let nodes = graph.nodes();
    let mut from_wrt = vec![false; nodes.len()];
    for &id in wrt {
        from_wrt[id.index()] = true;
    }
    // Operands come before the nodes that read them.
    for (i, node) in nodes.iter().enumerate() {
        if node.inputs.iter().any(|x| from_wrt[x.index()]) {
            from_wrt[i] = true;
        }
    }
    let mut to_loss = vec![false; nodes.len()];
    to_loss[loss.index()] = true;
    for i in (0..=loss.index()).rev() {
        if to_loss[i] {
            for x in &nodes[i].inputs {
                to_loss[x.index()] = true;
            }
        }
    }
    from_wrt
        .iter()
        .zip(&to_loss)
        .map(|(&a, &b)| a && b)
        .collect()
}

/// The contribution of node `index` (`op` over `operands`) to each operand's
/// gradient, given the gradient `g` of its result (`None` for an operand it does not
/// depend on differentiably).
fn vjp(
    graph: &Graph,
    index: usize,
    op: &Op,
    operands: &[NodeId],
    g: NodeId,
) -> Result<Vec<Option<NodeId>>> {
    let out = NodeId::from_index(index);
    let dtype = graph.shape(out)?.dtype();
    let constant = |v: f64| graph.scalar(v, dtype);
    let mul = |a, b| graph.binary(BinaryOp::Mul, a, b);
    let no_rule = |why: &str| {
        Err(Error::InvalidGraph {
            graph: graph.name().to_string(),
            node: format!("%{index}"),
            message: format!(
                "the loss needs a gradient through `{}`, which {why}",
                op.name()
            ),
        })
    };
    if !dtype.is_float() {
        return no_rule("has no gradient (its result is not a float)");
    }
    Ok(match op {
        Op::Unary(u) => {
            let x = operands[0];
            let dx = match u {
                UnaryOp::Neg => graph.unary(UnaryOp::Neg, g)?,
                UnaryOp::Exp => mul(g, out)?,
                UnaryOp::Log => graph.binary(BinaryOp::Div, g, x)?,
                UnaryOp::Sqrt => graph.binary(BinaryOp::Div, mul(g, constant(0.5))?, out)?,
                UnaryOp::Tanh => {
                    let square = mul(out, out)?;
                    mul(g, graph.binary(BinaryOp::Sub, constant(1.0), square)?)?
                }
                UnaryOp::Sigmoid => {
                    let slope = mul(out, graph.binary(BinaryOp::Sub, constant(1.0), out)?)?;
                    mul(g, slope)?
                }
                UnaryOp::Relu => {
                    // sign(relu(x)) is 1 where x > 0 and 0 elsewhere: float ops that
                    // fuse into one elementwise kernel with the product.
                    let step = graph.unary(UnaryOp::Sign, out)?;
                    mul(g, step)?
                }
                UnaryOp::Reciprocal => graph.unary(UnaryOp::Neg, mul(g, mul(out, out)?)?)?,
                UnaryOp::Rsqrt => {
                    let cube = mul(out, mul(out, out)?)?;
                    mul(g, mul(cube, constant(-0.5))?)?
                }
                UnaryOp::Abs => mul(g, graph.unary(UnaryOp::Sign, x)?)?,
                UnaryOp::Sin => mul(g, graph.unary(UnaryOp::Cos, x)?)?,
                UnaryOp::Cos => {
                    graph.unary(UnaryOp::Neg, mul(g, graph.unary(UnaryOp::Sin, x)?)?)?
                }
                UnaryOp::Erf => mul(g, erf_slope(graph, x, dtype)?)?,
                UnaryOp::Silu => {
                    // s + x s (1 - s), with s = sigmoid(x).
                    let s = graph.unary(UnaryOp::Sigmoid, x)?;
                    let one_minus = graph.binary(BinaryOp::Sub, constant(1.0), s)?;
                    let slope = mul(
                        s,
                        graph.binary(BinaryOp::Add, constant(1.0), mul(x, one_minus)?)?,
                    )?;
                    mul(g, slope)?
                }
                UnaryOp::Gelu => {
                    // Φ(x) + x φ(x): erf'(x / √2) / (2 √2) is φ(x).
                    let scaled = mul(x, constant(std::f64::consts::FRAC_1_SQRT_2))?;
                    let cdf = mul(
                        graph.binary(
                            BinaryOp::Add,
                            constant(1.0),
                            graph.unary(UnaryOp::Erf, scaled)?,
                        )?,
                        constant(0.5),
                    )?;
                    let pdf = mul(
                        erf_slope(graph, scaled, dtype)?,
                        constant(0.5 * std::f64::consts::FRAC_1_SQRT_2),
                    )?;
                    mul(g, graph.binary(BinaryOp::Add, cdf, mul(x, pdf)?)?)?
                }
                UnaryOp::GeluTanh => {
                    // 0.5 (1 + t) + 0.5 x (1 - t²) c (1 + 3 a x²), t = tanh(c (x + a x³)).
                    let (c, a) = ((2.0 / std::f64::consts::PI).sqrt(), 0.044715);
                    let square = mul(x, x)?;
                    let inner = mul(
                        graph.binary(BinaryOp::Add, x, mul(mul(square, x)?, constant(a))?)?,
                        constant(c),
                    )?;
                    let t = graph.unary(UnaryOp::Tanh, inner)?;
                    let one_plus = graph.binary(BinaryOp::Add, constant(1.0), t)?;
                    let sech2 = graph.binary(BinaryOp::Sub, constant(1.0), mul(t, t)?)?;
                    let inner_slope = mul(
                        graph.binary(
                            BinaryOp::Add,
                            constant(1.0),
                            mul(square, constant(3.0 * a))?,
                        )?,
                        constant(c),
                    )?;
                    let second = mul(mul(x, sech2)?, inner_slope)?;
                    mul(
                        g,
                        mul(
                            graph.binary(BinaryOp::Add, one_plus, second)?,
                            constant(0.5),
                        )?,
                    )?
                }
                UnaryOp::Relu6 => {
                    // 1 strictly inside (0, 6), 0 elsewhere (as PyTorch gives).
                    let inside = graph.binary(
                        BinaryOp::And,
                        graph.binary(BinaryOp::Gt, x, constant(0.0))?,
                        graph.binary(BinaryOp::Lt, x, constant(6.0))?,
                    )?;
                    mul(g, graph.cast(inside, dtype)?)?
                }
                UnaryOp::HardSwish => {
                    // 0 below -3, 1 above 3, (2x + 3) / 6 between (as PyTorch gives,
                    // with the ramp's value at both ends).
                    let ramp =
                        graph.binary(BinaryOp::Add, mul(x, constant(1.0 / 3.0))?, constant(0.5))?;
                    let below = graph.binary(BinaryOp::Lt, x, constant(-3.0))?;
                    let above = graph.binary(BinaryOp::Gt, x, constant(3.0))?;
                    let slope = graph.select(
                        below,
                        constant(0.0),
                        graph.select(above, constant(1.0), ramp)?,
                    )?;
                    mul(g, slope)?
                }
                // Steps: flat almost everywhere (as PyTorch gives).
                UnaryOp::Floor | UnaryOp::Ceil | UnaryOp::Round | UnaryOp::Sign => {
                    zeros_like(graph, x)?
                }
                UnaryOp::Atan => {
                    let denominator = graph.binary(BinaryOp::Add, constant(1.0), mul(x, x)?)?;
                    graph.binary(BinaryOp::Div, g, denominator)?
                }
                _ => return no_rule("has no gradient (it is defined on bools or integers)"),
            };
            vec![Some(dx)]
        }
        Op::Where => {
            let (cond, a, b) = (operands[0], operands[1], operands[2]);
            let zero = constant(0.0);
            let da = graph.select(cond, g, zero)?;
            let db = graph.select(cond, zero, g)?;
            vec![
                None,
                Some(unbroadcast(graph, da, a)?),
                Some(unbroadcast(graph, db, b)?),
            ]
        }
        Op::Expand { .. } => vec![Some(unbroadcast(graph, g, operands[0])?)],
        Op::Softmax { axis } => {
            // y (g - Σ g y) along the axis.
            let axis = [*axis as isize];
            let dot = graph.sum(mul(g, out)?, &axis, true)?;
            vec![Some(mul(out, graph.binary(BinaryOp::Sub, g, dot)?)?)]
        }
        Op::LogSoftmax { axis } => {
            // g - softmax(x) Σ g along the axis.
            let total = graph.sum(g, &[*axis as isize], true)?;
            let softmax = graph.unary(UnaryOp::Exp, out)?;
            vec![Some(graph.binary(
                BinaryOp::Sub,
                g,
                mul(softmax, total)?,
            )?)]
        }
        Op::Binary(b) => {
            let (x, y) = (operands[0], operands[1]);
            let (dx, dy) = match b {
                BinaryOp::Add => (g, g),
                BinaryOp::Sub => (g, graph.unary(UnaryOp::Neg, g)?),
                BinaryOp::Mul => (mul(g, y)?, mul(g, x)?),
                BinaryOp::Max | BinaryOp::Min => {
                    // To the operand picked, the first one on a tie.
                    let first = if *b == BinaryOp::Max {
                        BinaryOp::Ge
                    } else {
                        BinaryOp::Le
                    };
                    let picked = graph.binary(first, x, y)?;
                    let zero = constant(0.0);
                    (
                        graph.select(picked, g, zero)?,
                        graph.select(picked, zero, g)?,
                    )
                }
                BinaryOp::Pow => {
                    // y x^(y-1) and x^y ln x (for positive bases).
                    let dx = mul(g, graph.binary(BinaryOp::Div, mul(y, out)?, x)?)?;
                    let dy = mul(g, mul(out, graph.unary(UnaryOp::Log, x)?)?)?;
                    (dx, dy)
                }
                BinaryOp::Div => {
                    let dx = graph.binary(BinaryOp::Div, g, y)?;
                    // d(x / y)/dy = -(x / y) / y.
                    let dy =
                        graph.unary(UnaryOp::Neg, graph.binary(BinaryOp::Div, mul(g, out)?, y)?)?;
                    (dx, dy)
                }
                BinaryOp::Mod => {
                    // x mod y = x - q y with q the integer the op rounded x / y to: taken
                    // from the result and rounded, which is exact while q fits the
                    // mantissa (half precision works in f32 for that).
                    let wide = |t: NodeId| -> Result<NodeId> {
                        if matches!(dtype, DType::F16 | DType::BF16) {
                            graph.cast(t, DType::F32)
                        } else {
                            Ok(t)
                        }
                    };
                    let quotient = graph.binary(
                        BinaryOp::Div,
                        graph.binary(BinaryOp::Sub, wide(x)?, wide(out)?)?,
                        wide(y)?,
                    )?;
                    let mut q = graph.unary(UnaryOp::Round, quotient)?;
                    if graph.shape(q)?.dtype() != dtype {
                        q = graph.cast(q, dtype)?;
                    }
                    (g, graph.unary(UnaryOp::Neg, mul(g, q)?)?)
                }
                _ => return no_rule("has no gradient (its result is not a float)"),
            };
            vec![
                Some(unbroadcast(graph, dx, x)?),
                Some(unbroadcast(graph, dy, y)?),
            ]
        }
        Op::MatMul => matmul_vjp(graph, operands, g)?,
        Op::QuantMatMul { format } => {
            // a @ dequantize(w)ᵀ is linear in a; the packed weights get nothing.
            let weights = graph.dequantize(operands[1], *format)?;
            vec![Some(graph.matmul(g, weights)?), None]
        }
        Op::Reduce {
            op: op @ (ReduceOp::Sum | ReduceOp::Mean),
            axes,
            keepdims,
        } => {
            let x = operands[0];
            let shape = graph.shape(x)?;
            // The gradient with the reduced axes kept (size 1), spread over them.
            let g = with_reduced_axes(graph, g, x, (axes, *keepdims))?;
            let mut dx = graph.expand(g, shape.dims())?;
            if *op == ReduceOp::Mean {
                let n: usize = axes.iter().map(|&a| shape.dim(a)).product();
                dx = mul(dx, constant(1.0 / n.max(1) as f64))?;
            }
            vec![Some(dx)]
        }
        Op::Reduce {
            op: ReduceOp::Max | ReduceOp::Min,
            axes,
            keepdims,
        } => {
            // To the extreme values, shared evenly between ties.
            let x = operands[0];
            let g = with_reduced_axes(graph, g, x, (axes, *keepdims))?;
            let out = with_reduced_axes(graph, out, x, (axes, *keepdims))?;
            let hit = graph.cast(graph.binary(BinaryOp::Eq, x, out)?, dtype)?;
            let axes: Vec<isize> = axes.iter().map(|&a| a as isize).collect();
            let ties = graph.sum(hit, &axes, true)?;
            let share = graph.binary(BinaryOp::Div, g, ties)?;
            vec![Some(mul(hit, share)?)]
        }
        Op::Reduce {
            op: ReduceOp::Prod,
            axes,
            keepdims,
        } => vec![Some(prod_vjp(graph, operands[0], g, (axes, *keepdims))?)],
        Op::Slice { axes } => {
            let dims = graph.shape(operands[0])?.dims().to_vec();
            vec![Some(slice_vjp(graph, axes, &dims, g)?)]
        }
        Op::Pad { pads, mode } => vec![Some(pad_vjp(graph, pads, *mode, operands[0], g)?)],
        Op::Tile { reps } => vec![Some(tile_vjp(graph, reps, operands[0], g)?)],
        Op::Cumsum {
            axis,
            exclusive,
            reverse,
        } => {
            // Each input feeds the outputs after it (before it, reversed): the
            // gradient is the same running sum of g taken the other way.
            let axis = *axis as isize;
            vec![Some(graph.cumsum(g, axis, *exclusive, !*reverse)?)]
        }
        Op::TopK {
            k,
            axis,
            largest,
            output: rlx_ir::TopKOutput::Values,
        } => vec![Some(topk_vjp(
            graph,
            operands[0],
            (*k, *axis, *largest),
            g,
        )?)],
        Op::Concat { axis } => {
            let mut start = 0;
            operands
                .iter()
                .map(|&x| {
                    let len = graph.shape(x)?.dim(*axis);
                    let range = (start as isize, (start + len) as isize);
                    start += len;
                    Ok(Some(graph.slice(g, *axis as isize, range.0, range.1, 1)?))
                })
                .collect::<Result<Vec<_>>>()?
        }
        Op::Gather { axis } => {
            let dims = graph.shape(operands[0])?.dims().to_vec();
            vec![Some(gather_vjp(graph, &dims, *axis, operands[1], g)?), None]
        }
        Op::Conv2d { window, groups: 1 }
            if window.dilation == [1, 1]
                && window.padding[0].max(window.padding[2]) < graph.shape(operands[1])?.dim(2)
                && window.padding[1].max(window.padding[3]) < graph.shape(operands[1])?.dim(3) =>
        {
            conv2d_vjp(graph, window, operands, g)?
        }
        Op::Conv2d { window, groups } => conv2d_general_vjp(graph, window, *groups, operands, g)?,
        Op::AvgPool2d { window, .. } if tiles(window, &graph.shape(operands[0])?) => {
            // Each value's share of its window's mean: the gradient spread over the
            // window, divided by its size.
            let [kh, kw] = window.kernel;
            let spread = spread_windows(graph, g, window.kernel)?;
            vec![Some(mul(spread, constant(1.0 / (kh * kw) as f64))?)]
        }
        Op::MaxPool2d { window } if tiles(window, &graph.shape(operands[0])?) => {
            // One composite (a pass over the input where a backend runs it natively).
            vec![Some(graph.tiled_max_pool_grad(
                operands[0],
                out,
                g,
                window.kernel,
            )?)]
        }
        Op::AvgPool2d {
            window,
            count_include_pad,
        } => vec![Some(avg_pool_vjp(
            graph,
            window,
            *count_include_pad,
            operands[0],
            g,
        )?)],
        Op::MaxPool2d { window } => vec![Some(max_pool_vjp(graph, window, operands[0], out, g)?)],
        Op::Reshape { .. } => {
            let dims = graph.shape(operands[0])?.dims().to_vec();
            vec![Some(graph.reshape(g, &dims)?)]
        }
        Op::Permute { perm } => {
            let mut inverse = vec![0; perm.len()];
            for (i, &p) in perm.iter().enumerate() {
                inverse[p] = i;
            }
            vec![Some(graph.permute(g, &inverse)?)]
        }
        // Between float types (other operands were rejected above).
        Op::Cast(_) => {
            let from = graph.shape(operands[0])?.dtype();
            vec![Some(graph.cast(g, from)?)]
        }
        Op::LayerNorm { eps } if matches!(dtype, DType::F32 | DType::F64) => {
            norm_vjp(graph, operands, g, eps.get(), true)?
        }
        Op::RmsNorm { eps } if matches!(dtype, DType::F32 | DType::F64) => {
            norm_vjp(graph, operands, g, eps.get(), false)?
        }
        Op::Attention {
            scale,
            causal,
            seq_major,
        } => match attention_vjp(graph, out, operands, g, (scale.get(), *causal, *seq_major))? {
            Some(contributions) => contributions,
            None => return through_decomposition(graph, op, operands, g),
        },
        _ if rlx_ir::decompose::is_composite(op) => {
            return through_decomposition(graph, op, operands, g);
        }
        Op::WriteAt { .. } => {
            return no_rule("writes into state in place and has no gradient");
        }
        Op::CachedAttention { .. } => {
            return no_rule(
                "reads a key/value cache for inference and has no gradient (use `attention`)",
            );
        }
        _ => return no_rule("has no gradient"),
    })
}

/// The VJP of a layer norm (`centered`: `x̂ = (x - mean) r`, `y = x̂ γ + β`) or an RMS
/// norm (`x̂ = x r`, `y = x̂ γ`) over the last axis, `r = 1 / sqrt(var + eps)` (the
/// mean square for RMS): `dx = r (gγ - mean(gγ) - x̂ mean(gγ x̂))` (no first mean for
/// RMS) as one [`Op::NormGrad`], `dγ = Σ g x̂` as one [`Op::NormScaleGrad`] (composites
/// a backend runs in a pass over the rows, or decomposes), `dβ = Σ g`.
fn norm_vjp(
    graph: &Graph,
    operands: &[NodeId],
    g: NodeId,
    eps: f64,
    centered: bool,
) -> Result<Vec<Option<NodeId>>> {
    let (x, gamma) = (operands[0], operands[1]);
    let dx = graph.norm_grad(x, gamma, g, eps, centered)?;
    let dgamma = graph.norm_scale_grad(x, g, eps, centered)?;
    let mut contributions = vec![Some(dx), Some(dgamma)];
    if centered {
        contributions.push(Some(unbroadcast(graph, g, operands[2])?));
    }
    Ok(contributions)
}

/// The VJP of attention in `f32` or `f64` (half precision goes through the
/// decomposition): the probabilities `P` are recomputed (one product, the mask, a
/// softmax), then with `dO` the output's gradient, `dV = Pᵀ dO`, `dS = P (dO Vᵀ -
/// rowsum(dO O))`, `dQ = dS K scale`, `dK = dSᵀ Q scale`; a float mask's gradient is
/// `dS` summed to its shape. Grouped key/value heads sum the gradients of the query
/// heads they serve.
fn attention_vjp(
    graph: &Graph,
    out: NodeId,
    operands: &[NodeId],
    g: NodeId,
    (scale, causal, seq_major): (f64, bool, bool),
) -> Result<Option<Vec<Option<NodeId>>>> {
    const HEAD_SWAP: [usize; 4] = [0, 2, 1, 3];
    let dtype = graph.shape(out)?.dtype();
    if !matches!(dtype, DType::F32 | DType::F64) {
        return Ok(None);
    }
    let head_major = |x: NodeId| {
        if seq_major {
            graph.permute(x, &HEAD_SWAP)
        } else {
            Ok(x)
        }
    };
    let (q, k, v) = (
        head_major(operands[0])?,
        head_major(operands[1])?,
        head_major(operands[2])?,
    );
    let (qs, ks) = (graph.shape(q)?, graph.shape(k)?);
    let (hq, hkv, sq, sk) = (qs.dim(1), ks.dim(1), qs.dim(2), ks.dim(2));
    let group = hq / hkv.max(1);
    // Each key/value head serves `group` consecutive query heads.
    let (k_full, v_full) = if group > 1 {
        let heads: Vec<i64> = (0..hq).map(|h| (h / group) as i64).collect();
        let idx = graph.constant(rlx_ir::TensorData::I64(heads), &[hq])?;
        (graph.gather(k, idx, 1)?, graph.gather(v, idx, 1)?)
    } else {
        (k, v)
    };
    let (o, d_o) = (head_major(out)?, head_major(g)?);
    let transpose = |x: NodeId| graph.permute(x, &[0, 1, 3, 2]);
    let mul = |a, b| graph.binary(BinaryOp::Mul, a, b);
    let scale_node = graph.scalar(scale, dtype);
    let neg = graph.scalar(f64::NEG_INFINITY, dtype);
    let mask = operands.get(3).copied();
    let scores = rlx_ir::decompose::attention_scores(graph, (q, k_full, scale), mask, causal)?;
    let mut p = graph.softmax(scores, -1)?;
    if mask.is_some() || (causal && sq > sk) {
        // A query with every key masked gives zeros, as the forward does (a plain
        // softmax of an all -inf row is NaN).
        let top = graph.reduce(ReduceOp::Max, scores, &[-1], true)?;
        let seen = graph.binary(BinaryOp::Ne, top, neg)?;
        p = graph.select(seen, p, graph.scalar(0.0, dtype))?;
    }
    let mut dv = graph.matmul(transpose(p)?, d_o)?;
    let dp = graph.matmul(d_o, transpose(v_full)?)?;
    let delta = graph.sum(mul(d_o, o)?, &[-1], true)?;
    let d_scores = mul(p, graph.binary(BinaryOp::Sub, dp, delta)?)?;
    let ds = mul(d_scores, scale_node)?;
    let dq = graph.matmul(ds, k_full)?;
    let mut dk = graph.matmul(transpose(ds)?, q)?;
    if group > 1 {
        let fold = |x: NodeId| -> Result<NodeId> {
            let dims = graph.shape(x)?.dims().to_vec();
            let grouped = graph.reshape(x, &[dims[0], hkv, group, dims[2], dims[3]])?;
            graph.sum(grouped, &[2], false)
        };
        dk = fold(dk)?;
        dv = fold(dv)?;
    }
    let back = |x: NodeId| -> Result<Option<NodeId>> { Ok(Some(head_major(x)?)) };
    let mut contributions = vec![back(dq)?, back(dk)?, back(dv)?];
    if let Some(m) = mask {
        contributions.push(if graph.shape(m)?.dtype().is_float() {
            Some(unbroadcast(graph, d_scores, m)?)
        } else {
            None
        });
    }
    Ok(Some(contributions))
}

/// The VJP of a composite with no rule of its own (the norms, attention, rope, the
/// fused forms): its decomposition into primitives is built from the same operands,
/// and `g` is taken back through it to them.
fn through_decomposition(
    graph: &Graph,
    op: &Op,
    operands: &[NodeId],
    g: NodeId,
) -> Result<Vec<Option<NodeId>>> {
    let start = graph.len();
    let Some(y) = rlx_ir::decompose::decompose(graph, op, operands)? else {
        return Err(Error::invalid(
            "grad",
            format!("`{}` has no decomposition", op.name()),
        ));
    };
    let mut adjoints: std::collections::HashMap<usize, NodeId> = Default::default();
    adjoints.insert(y.index(), g);
    for index in (start..=y.index()).rev() {
        let Some(&cotangent) = adjoints.get(&index) else {
            continue;
        };
        let node = graph.node(NodeId::from_index(index))?;
        // Constants the decomposition made, and values that are not floats, pass
        // nothing on.
        if node.inputs.is_empty() || !node.shape.dtype().is_float() {
            continue;
        }
        let contributions = vjp(graph, index, &node.op, &node.inputs, cotangent)?;
        for (operand, contribution) in node.inputs.iter().zip(contributions) {
            let Some(contribution) = contribution else {
                continue;
            };
            // Only the decomposition's own nodes and the composite's operands carry
            // a gradient anywhere; constants it built need none.
            let inside = operand.index() >= start;
            if !inside && !operands.contains(operand) {
                continue;
            }
            let sum = match adjoints.get(&operand.index()) {
                Some(&sum) => graph.binary(BinaryOp::Add, sum, contribution)?,
                None => contribution,
            };
            adjoints.insert(operand.index(), sum);
        }
    }
    Ok(operands
        .iter()
        .map(|x| adjoints.get(&x.index()).copied())
        .collect())
}

/// The VJP of an undilated, single-group convolution whose padding is less than its
/// kernel on every side: the input's gradient is the output's (spaced out by the
/// stride) convolved with the flipped, transposed weights, with the padding that
/// restores the input's size; the weights' is one product of the output's gradient
/// and the input's patches; the bias's the output's summed over batch and pixels.
fn conv2d_vjp(
    graph: &Graph,
    window: &rlx_ir::Window2d,
    operands: &[NodeId],
    g: NodeId,
) -> Result<Vec<Option<NodeId>>> {
    let (x, w) = (operands[0], operands[1]);
    let (xs, ws, gs) = (graph.shape(x)?, graph.shape(w)?, graph.shape(g)?);
    let (kh, kw) = (ws.dim(2) as isize, ws.dim(3) as isize);
    let [t, l, _, _] = window.padding;
    let [sy, sx] = window.stride;
    let flipped = graph.slice_axes(w, &[(2, -1, -kh - 1, -1), (3, -1, -kw - 1, -1)])?;
    let turned = graph.permute(flipped, &[1, 0, 2, 3])?;
    let (kh, kw) = (ws.dim(2), ws.dim(3));
    // With a stride, the output's gradient spaced out by it (zeros between), so that
    // the unit-stride formula applies.
    let (n, o, oh, ow) = (gs.dim(0), gs.dim(1), gs.dim(2), gs.dim(3));
    let spaced = if [sy, sx] == [1, 1] {
        g
    } else {
        let split = graph.reshape(g, &[n, o, oh, 1, ow, 1])?;
        let zero = rlx_ir::PadMode::Constant(rlx_ir::F64Bits::new(0.0));
        let pads = [(0, 0), (0, 0), (0, 0), (0, sy - 1), (0, 0), (0, sx - 1)];
        let wide = graph.reshape(graph.pad(split, &pads, zero)?, &[n, o, oh * sy, ow * sx])?;
        let (hd, wd) = (((oh - 1) * sy + 1) as isize, ((ow - 1) * sx + 1) as isize);
        graph.slice_axes(wide, &[(2, 0, hd, 1), (3, 0, wd, 1)])?
    };
    let (hd, wd) = ((oh - 1) * sy + 1, (ow - 1) * sx + 1);
    // Bottom and right padding that give back the input's size (rows the stride
    // skipped get zeros).
    let (h, wi) = (xs.dim(2), xs.dim(3));
    let pad = [kh - 1 - t, kw - 1 - l, h + t - hd, wi + l - wd];
    let dx = graph.conv2d(spaced, turned, None, [1, 1], pad, [1, 1], 1)?;
    // The weights' gradient as one product: the output's gradient [O, N OH OW] by the
    // input's patches [N OH OW, C KH KW], each tap a strided slice of the padded
    // input (rows a stride leaves unread are in no patch).
    let c = xs.dim(1);
    let [top, left, bottom, right] = window.padding;
    let padded = if window.padding == [0; 4] {
        x
    } else {
        let zero = rlx_ir::PadMode::Constant(rlx_ir::F64Bits::new(0.0));
        graph.pad(x, &[(0, 0), (0, 0), (top, bottom), (left, right)], zero)?
    };
    let pixels = oh * ow;
    let mut taps = Vec::with_capacity(kh * kw);
    for i in 0..kh {
        for j in 0..kw {
            let tap = graph.slice_axes(
                padded,
                &[
                    (2, i as isize, (i + hd) as isize, sy as isize),
                    (3, j as isize, (j + wd) as isize, sx as isize),
                ],
            )?;
            taps.push(graph.reshape(tap, &[n, c, pixels])?);
        }
    }
    // [N, T C, P] -> [N P, T C]: whole blocks copied, then one batched transpose.
    let patches = graph.permute(graph.concat(&taps, 1)?, &[0, 2, 1])?;
    let patches = graph.reshape(patches, &[n * pixels, kh * kw * c])?;
    let rows = graph.reshape(graph.permute(g, &[1, 0, 2, 3])?, &[o, n * pixels])?;
    let by_tap = graph.reshape(graph.matmul(rows, patches)?, &[o, kh * kw, c])?;
    let dw = graph.reshape(graph.permute(by_tap, &[0, 2, 1])?, &[o, c, kh, kw])?;
    let mut grads = vec![Some(dx), Some(dw)];
    if operands.len() > 2 {
        let summed = sum_in_runs(graph, g, &[0, 2, 3])?;
        grads.push(Some(graph.reshape(summed, &[graph.shape(g)?.dim(1)])?));
    }
    Ok(grads)
}

/// The VJP of `matmul` with operands of any rank: a 1-D `a` acts as a row `[1, K]`
/// and a 1-D `b` as a column `[K, 1]` (numpy's promotion), whose added axis the
/// result drops; batch dims broadcast and are summed back.
fn matmul_vjp(graph: &Graph, operands: &[NodeId], g: NodeId) -> Result<Vec<Option<NodeId>>> {
    let (a, b) = (operands[0], operands[1]);
    let (a_shape, b_shape) = (graph.shape(a)?, graph.shape(b)?);
    let (a2, b2, g2) = if a_shape.rank() >= 2 && b_shape.rank() >= 2 {
        (a, b, g)
    } else {
        let mut g_dims = graph.shape(g)?.dims().to_vec();
        let a2 = if a_shape.rank() == 1 {
            graph.reshape(a, &[1, a_shape.dim(0)])?
        } else {
            a
        };
        let b2 = if b_shape.rank() == 1 {
            g_dims.push(1);
            graph.reshape(b, &[b_shape.dim(0), 1])?
        } else {
            b
        };
        if a_shape.rank() == 1 {
            g_dims.insert(g_dims.len() - 1, 1);
        }
        (a2, b2, graph.reshape(g, &g_dims)?)
    };
    let da = graph.matmul(g2, graph.transpose(b2, -1, -2)?)?;
    let db = if b_shape.rank() == 2 && a_shape.rank() > 2 {
        // One matrix shared by a batch (a linear layer's weight): its gradient is one
        // product over every row of the batch, `[k, rows] x [rows, n]`, rather than a
        // product per batch element summed afterwards (a batch-sized intermediate and
        // short products).
        let k = a_shape.dim(a_shape.rank() - 1);
        let n = b_shape.dim(1);
        let rows: usize = a_shape.dims()[..a_shape.rank() - 1].iter().product();
        let a_rows = graph.reshape(a2, &[rows, k])?;
        let g_rows = graph.reshape(g2, &[rows, n])?;
        graph.matmul(graph.transpose(a_rows, 0, 1)?, g_rows)?
    } else {
        graph.matmul(graph.transpose(a2, -1, -2)?, g2)?
    };
    let (da, db) = (unbroadcast(graph, da, a2)?, unbroadcast(graph, db, b2)?);
    let back = |t: NodeId, like: &rlx_ir::Shape| -> Result<NodeId> {
        if graph.shape(t)?.dims() == like.dims() {
            Ok(t)
        } else {
            graph.reshape(t, like.dims())
        }
    };
    Ok(vec![Some(back(da, &a_shape)?), Some(back(db, &b_shape)?)])
}

/// The VJP of a product over `axes` of `x`: each element gets `g` times the product
/// of the other elements of its group. Without zeros that is the product over the
/// element; with exactly one zero, the zero gets the product of the rest and the
/// others nothing; with two or more, every element gets nothing.
fn prod_vjp(
    graph: &Graph,
    x: NodeId,
    g: NodeId,
    (axes, keepdims): (&[usize], bool),
) -> Result<NodeId> {
    let dtype = graph.shape(x)?.dtype();
    let (zero, one) = (graph.scalar(0.0, dtype), graph.scalar(1.0, dtype));
    let reduced: Vec<isize> = axes.iter().map(|&a| a as isize).collect();
    let is_zero = graph.binary(BinaryOp::Eq, x, zero)?;
    let zeros = graph.sum(graph.cast(is_zero, dtype)?, &reduced, true)?;
    // The product of the non-zero elements of each group.
    let nonzero = graph.select(is_zero, one, x)?;
    let rest = graph.reduce(ReduceOp::Prod, nonzero, &reduced, true)?;
    let none = graph.binary(BinaryOp::Eq, zeros, zero)?;
    let single = graph.binary(BinaryOp::Eq, zeros, one)?;
    let at_nonzero = graph.select(none, graph.binary(BinaryOp::Div, rest, nonzero)?, zero)?;
    let at_zero = graph.select(single, rest, zero)?;
    let others = graph.select(is_zero, at_zero, at_nonzero)?;
    let g = with_reduced_axes(graph, g, x, (axes, keepdims))?;
    graph.binary(BinaryOp::Mul, others, g)
}

/// The VJP of a strided slice of a tensor of `dims`: `g` put back at the indices the
/// slice read, zeros elsewhere. A backward step reads the same indices as a forward
/// one from the last of them, in the other order, so `g` is first reversed along
/// those axes; steps above 1 put zeros between its values; one pad places the result.
fn slice_vjp(graph: &Graph, axes: &[SliceAxis], dims: &[usize], g: NodeId) -> Result<NodeId> {
    let dtype = graph.shape(g)?.dtype();
    if axes.iter().any(|a| a.len == 0) {
        return zeros(graph, dims, dtype);
    }
    let backward: Vec<(isize, isize, isize, isize)> = (0..axes.len())
        .filter(|&d| axes[d].step < 0)
        .map(|d| (d as isize, -1, isize::MIN, -1))
        .collect();
    let mut spread = if backward.is_empty() {
        g
    } else {
        graph.slice_axes(g, &backward)?
    };
    let mut pads = Vec::with_capacity(axes.len());
    for (d, a) in axes.iter().enumerate() {
        let step = a.step.unsigned_abs();
        let first = if a.step < 0 {
            a.start - (a.len - 1) * step
        } else {
            a.start
        };
        if step > 1 {
            spread = space_out(graph, spread, d, step)?;
        }
        let span = (a.len - 1) * step + 1;
        pads.push((first, dims[d] - first - span));
    }
    graph.pad(spread, &pads, zero_padding())
}

/// `t` with `step - 1` zeros put between consecutive entries along `axis` (and none
/// after the last): a length `n` becomes `(n - 1) step + 1`.
fn space_out(graph: &Graph, t: NodeId, axis: usize, step: usize) -> Result<NodeId> {
    let dims = graph.shape(t)?.dims().to_vec();
    let n = dims[axis];
    let before: usize = dims[..axis].iter().product();
    let after: usize = dims[axis + 1..].iter().product();
    let split = graph.reshape(t, &[before, n, 1, after])?;
    let pads = [(0, 0), (0, 0), (0, step - 1), (0, 0)];
    let wide = graph.reshape(
        graph.pad(split, &pads, zero_padding())?,
        &[before, n * step, after],
    )?;
    let trimmed = graph.slice(wide, 1, 0, ((n - 1) * step + 1) as isize, 1)?;
    let mut spaced = dims;
    spaced[axis] = (n - 1) * step + 1;
    graph.reshape(trimmed, &spaced)
}

/// The VJP of `gather(data, indices, axis)` (numpy `take`) for `data` of `dims`: the
/// gradient of each picked slice added into the slice it came from, as a product
/// with the one-hot of the indices (which counts negative ones from the end, as the
/// gather does, and sums repeated ones).
fn gather_vjp(
    graph: &Graph,
    dims: &[usize],
    axis: usize,
    indices: NodeId,
    g: NodeId,
) -> Result<NodeId> {
    let dtype = graph.shape(g)?.dtype();
    let n = dims[axis];
    let before: usize = dims[..axis].iter().product();
    let after: usize = dims[axis + 1..].iter().product();
    let picks = graph.shape(indices)?.num_elements();
    let flat = graph.reshape(indices, &[picks])?;
    let hot = graph.transpose(graph.one_hot(flat, n, dtype)?, 0, 1)?;
    // [n, picks] by [picks, after], the one-hot broadcast over leading axes.
    let picked = if before == 1 {
        graph.reshape(g, &[picks, after])?
    } else {
        graph.reshape(g, &[before, picks, after])?
    };
    let summed = graph.matmul(hot, picked)?;
    if graph.shape(summed)?.dims() == dims {
        Ok(summed)
    } else {
        graph.reshape(summed, dims)
    }
}

/// The VJP of a pad of `x`: a constant border takes nothing, so the gradient is the
/// middle of `g`; an edge or reflected border copies input elements, so along each
/// padded axis the pad is a gather with constant indices, and `g` goes back through
/// the gather's rule (the copies' gradients adding into their sources).
fn pad_vjp(
    graph: &Graph,
    pads: &[(usize, usize)],
    mode: PadMode,
    x: NodeId,
    g: NodeId,
) -> Result<NodeId> {
    let x_dims = graph.shape(x)?.dims().to_vec();
    if let PadMode::Constant(_) = mode {
        let middle: Vec<(isize, isize, isize, isize)> = pads
            .iter()
            .zip(&x_dims)
            .enumerate()
            .map(|(a, (&(before, _), &d))| (a as isize, before as isize, (before + d) as isize, 1))
            .collect();
        return graph.slice_axes(g, &middle);
    }
    let mut dx = g;
    for (axis, &(before, after)) in pads.iter().enumerate() {
        if before == 0 && after == 0 {
            continue;
        }
        dx = unpad_axis(graph, dx, axis, (before, x_dims[axis], after), mode)?;
    }
    Ok(dx)
}

/// `g` taken back through an edge or reflect pad of `(before, d, after)` along `axis`:
/// the middle, plus each border's gradient added where its values came from. An edge
/// border repeats the end value, so its sum goes there; a reflect border mirrors the
/// values next to the end, so it goes back reversed, one away from the end.
fn unpad_axis(
    graph: &Graph,
    g: NodeId,
    axis: usize,
    (before, d, after): (usize, usize, usize),
    mode: PadMode,
) -> Result<NodeId> {
    let a = axis as isize;
    let (b, e) = (before as isize, (before + d) as isize);
    let mut dx = graph.slice(g, a, b, e, 1)?;
    let rank = graph.shape(g)?.rank();
    // `t` (`len` long along the axis) placed at `at` in a length-`d` axis.
    let place = |t: NodeId, at: usize, len: usize| -> Result<NodeId> {
        let mut pads = vec![(0, 0); rank];
        pads[axis] = (at, d - at - len);
        graph.pad(t, &pads, PadMode::Constant(rlx_ir::F64Bits::new(0.0)))
    };
    let mut add = |t: NodeId| -> Result<()> {
        dx = graph.binary(BinaryOp::Add, dx, t)?;
        Ok(())
    };
    match mode {
        PadMode::Edge => {
            if before > 0 {
                let border = graph.sum(graph.slice(g, a, 0, b, 1)?, &[a], true)?;
                add(place(border, 0, 1)?)?;
            }
            if after > 0 {
                let end = (before + d + after) as isize;
                let border = graph.sum(graph.slice(g, a, e, end, 1)?, &[a], true)?;
                add(place(border, d - 1, 1)?)?;
            }
        }
        _ => {
            // Reflect (the forward keeps each border shorter than the axis): output
            // `before - 1 - t` came from `t + 1`, output `e + u` from `d - 2 - u`.
            if before > 0 {
                // Down to index 0 (a negative end would count from the end).
                let border = graph.slice(g, a, b - 1, isize::MIN, -1)?;
                add(place(border, 1, before)?)?;
            }
            if after > 0 {
                let end = (before + d + after) as isize;
                let border = graph.slice(g, a, end - 1, e - 1, -1)?;
                add(place(border, d - 1 - after, after)?)?;
            }
        }
    }
    Ok(dx)
}

/// The VJP of a tile of `x`: `g` summed over the repetitions, one tiled axis at a
/// time (split into `[repetitions, length]`).
fn tile_vjp(graph: &Graph, reps: &[usize], x: NodeId, g: NodeId) -> Result<NodeId> {
    let x_dims = graph.shape(x)?.dims().to_vec();
    if reps.contains(&0) {
        // Nothing of `x` reaches the (empty) result.
        return zeros_like(graph, x);
    }
    let mut dims = graph.shape(g)?.dims().to_vec();
    let mut dx = g;
    for (axis, &r) in reps.iter().enumerate() {
        if r == 1 {
            continue;
        }
        let before: usize = dims[..axis].iter().product();
        let after: usize = dims[axis + 1..].iter().product();
        let split = graph.reshape(dx, &[before, r, x_dims[axis], after])?;
        dx = graph.sum(split, &[1], false)?;
        dims[axis] = x_dims[axis];
    }
    if graph.shape(dx)?.dims() == x_dims.as_slice() {
        Ok(dx)
    } else {
        graph.reshape(dx, &x_dims)
    }
}

/// The VJP of the values of a top-k of `x` along `axis`: each value's gradient goes
/// to the position it was picked from. The indices are the same selection taken
/// again; their one-hot, weighted by `g` and summed over the `k` picks, scatters it.
fn topk_vjp(
    graph: &Graph,
    x: NodeId,
    (k, axis, largest): (usize, usize, bool),
    g: NodeId,
) -> Result<NodeId> {
    let xs = graph.shape(x)?;
    let dtype = xs.dtype();
    let n = xs.dim(axis);
    let before: usize = xs.dims()[..axis].iter().product();
    let after: usize = xs.dims()[axis + 1..].iter().product();
    let indices = graph.push(
        Op::TopK {
            k,
            axis,
            largest,
            output: rlx_ir::TopKOutput::Indices,
        },
        &[x],
    )?;
    let indices = graph.reshape(indices, &[before, k, after])?;
    let hot = graph.one_hot(indices, n, dtype)?;
    let weights = graph.reshape(g, &[before, k, after, 1])?;
    let scattered = graph.sum(graph.binary(BinaryOp::Mul, hot, weights)?, &[1], false)?;
    let placed = graph.permute(scattered, &[0, 2, 1])?;
    graph.reshape(placed, xs.dims())
}

/// The VJP of any convolution: stride, padding of any size, dilation and groups.
///
/// The input's gradient is the output's, spaced out by the stride, convolved with the
/// flipped weights (dilated alike, each group's `[O/G, C/G]` block transposed) with
/// padding `(k - 1) d - p` at the top and left and what restores the input's size at
/// the bottom and right; a negative padding is a crop of that result. The weights'
/// gradient is, per group, the output's gradient `[O/G, N P]` by the patches of the
/// padded input `[N P, T C/G]` (`T` taps, each a strided slice), one batched product.
fn conv2d_general_vjp(
    graph: &Graph,
    window: &rlx_ir::Window2d,
    groups: usize,
    operands: &[NodeId],
    g: NodeId,
) -> Result<Vec<Option<NodeId>>> {
    let (x, w) = (operands[0], operands[1]);
    let (xs, ws, gs) = (graph.shape(x)?, graph.shape(w)?, graph.shape(g)?);
    let (n, c, h, wi) = (xs.dim(0), xs.dim(1), xs.dim(2), xs.dim(3));
    let (o, cg, kh, kw) = (ws.dim(0), ws.dim(1), ws.dim(2), ws.dim(3));
    let (oh, ow) = (gs.dim(2), gs.dim(3));
    let og = o / groups;
    let [sy, sx] = window.stride;
    let [dy, dx] = window.dilation;
    let [top, left, bottom, right] = window.padding;
    let (hd, wd) = ((oh - 1) * sy + 1, (ow - 1) * sx + 1);
    if xs.num_elements() == 0 || gs.num_elements() == 0 {
        // Nothing flows through an empty convolution.
        return operands
            .iter()
            .map(|&t| Ok(Some(zeros_like(graph, t)?)))
            .collect();
    }

    let mut spaced = g;
    if sy > 1 {
        spaced = space_out(graph, spaced, 2, sy)?;
    }
    if sx > 1 {
        spaced = space_out(graph, spaced, 3, sx)?;
    }
    let flipped = graph.slice_axes(w, &[(2, -1, isize::MIN, -1), (3, -1, isize::MIN, -1)])?;
    let by_group = graph.reshape(flipped, &[groups, og, cg, kh, kw])?;
    let turned = graph.reshape(graph.permute(by_group, &[0, 2, 1, 3, 4])?, &[c, og, kh, kw])?;
    let sides = [
        ((kh - 1) * dy) as isize - top as isize,
        ((kw - 1) * dx) as isize - left as isize,
        (h + top) as isize - hd as isize,
        (wi + left) as isize - wd as isize,
    ];
    let padding = sides.map(|p| p.max(0) as usize);
    let full = graph.conv2d(spaced, turned, None, [1, 1], padding, [dy, dx], groups)?;
    let (crop_top, crop_left) = ((-sides[0]).max(0), (-sides[1]).max(0));
    let d_input = if sides.iter().any(|&p| p < 0) {
        graph.slice_axes(
            full,
            &[
                (2, crop_top, crop_top + h as isize, 1),
                (3, crop_left, crop_left + wi as isize, 1),
            ],
        )?
    } else {
        full
    };

    let padded = if window.padding == [0; 4] {
        x
    } else {
        let pads = [(0, 0), (0, 0), (top, bottom), (left, right)];
        graph.pad(x, &pads, zero_padding())?
    };
    let pixels = oh * ow;
    let taps = kh * kw;
    let mut columns = Vec::with_capacity(taps);
    for i in 0..kh {
        for j in 0..kw {
            let (r, s) = ((i * dy) as isize, (j * dx) as isize);
            let tap = graph.slice_axes(
                padded,
                &[
                    (2, r, r + hd as isize, sy as isize),
                    (3, s, s + wd as isize, sx as isize),
                ],
            )?;
            columns.push(graph.reshape(tap, &[n, c, pixels])?);
        }
    }
    // [N, T C, P] -> [G, N P, T C/G].
    let stacked = graph.reshape(graph.concat(&columns, 1)?, &[n, taps, groups, cg, pixels])?;
    let patches = graph.reshape(
        graph.permute(stacked, &[2, 0, 4, 1, 3])?,
        &[groups, n * pixels, taps * cg],
    )?;
    // [N, O, OH, OW] -> [G, O/G, N P].
    let rows = graph.reshape(g, &[n, groups, og, pixels])?;
    let rows = graph.reshape(
        graph.permute(rows, &[1, 2, 0, 3])?,
        &[groups, og, n * pixels],
    )?;
    let by_tap = graph.reshape(graph.matmul(rows, patches)?, &[groups, og, taps, cg])?;
    let d_weight = graph.reshape(graph.permute(by_tap, &[0, 1, 3, 2])?, &[o, cg, kh, kw])?;
    let mut grads = vec![Some(d_input), Some(d_weight)];
    if operands.len() > 2 {
        let summed = sum_in_runs(graph, g, &[0, 2, 3])?;
        grads.push(Some(graph.reshape(summed, &[o])?));
    }
    Ok(grads)
}

/// The taps of a pooling window over an NCHW input of `dims` padded by the window's
/// padding: for each of the `kh kw` kernel positions, the strided slice of the padded
/// input that it reads at every output position (`out` is `[oh, ow]`).
fn pool_taps(window: &rlx_ir::Window2d, dims: &[usize], out: [usize; 2]) -> Vec<Vec<SliceAxis>> {
    let whole = |len: usize| SliceAxis {
        start: 0,
        step: 1,
        len,
    };
    let mut taps = Vec::with_capacity(window.kernel[0] * window.kernel[1]);
    for i in 0..window.kernel[0] {
        for j in 0..window.kernel[1] {
            let along = |axis: usize, k: usize| SliceAxis {
                start: k * window.dilation[axis],
                step: window.stride[axis] as isize,
                len: out[axis],
            };
            taps.push(vec![
                whole(dims[0]),
                whole(dims[1]),
                along(0, i),
                along(1, j),
            ]);
        }
    }
    taps
}

/// The dims of an NCHW `x` padded by a window's padding.
fn padded_dims(window: &rlx_ir::Window2d, x: &rlx_ir::Shape) -> Vec<usize> {
    let [top, left, bottom, right] = window.padding;
    vec![
        x.dim(0),
        x.dim(1),
        top + x.dim(2) + bottom,
        left + x.dim(3) + right,
    ]
}

/// `t`, of [`padded_dims`], with the window's padding cropped off: `x`'s shape.
fn crop_padding(
    graph: &Graph,
    window: &rlx_ir::Window2d,
    x: &rlx_ir::Shape,
    t: NodeId,
) -> Result<NodeId> {
    if window.padding == [0; 4] {
        return Ok(t);
    }
    let [top, left, _, _] = window.padding;
    let (top, left) = (top as isize, left as isize);
    let (h, w) = (x.dim(2) as isize, x.dim(3) as isize);
    graph.slice_axes(t, &[(2, top, top + h, 1), (3, left, left + w, 1)])
}

/// The VJP of an average pool of any geometry: each output's gradient divided by the
/// count its window divided by (the whole window, or the input elements in it) and
/// added back through every tap's strided slice, then the padding cropped off.
fn avg_pool_vjp(
    graph: &Graph,
    window: &rlx_ir::Window2d,
    count_include_pad: bool,
    x: NodeId,
    g: NodeId,
) -> Result<NodeId> {
    let (xs, gs) = (graph.shape(x)?, graph.shape(g)?);
    let dtype = xs.dtype();
    let out = [gs.dim(2), gs.dim(3)];
    let [kh, kw] = window.kernel;
    let share = if count_include_pad {
        graph.binary(
            BinaryOp::Mul,
            g,
            graph.scalar(1.0 / (kh * kw) as f64, dtype),
        )?
    } else {
        // The taps inside the input, counted on the host: rows times columns.
        let inside = |axis: usize, o: usize| {
            let size = xs.dim(2 + axis) as isize;
            (0..window.kernel[axis])
                .filter(|&k| {
                    let p = (o * window.stride[axis] + k * window.dilation[axis]) as isize
                        - window.padding[axis] as isize;
                    (0..size).contains(&p)
                })
                .count()
        };
        let scale: Vec<f64> = (0..out[0])
            .flat_map(|r| (0..out[1]).map(move |c| (r, c)))
            .map(|(r, c)| 1.0 / (inside(0, r) * inside(1, c)).max(1) as f64)
            .collect();
        let scale = graph.constant(rlx_ir::TensorData::from_f64(dtype, &scale), &out)?;
        graph.binary(BinaryOp::Mul, g, scale)?
    };
    let dims = padded_dims(window, &xs);
    let backs = pool_taps(window, &dims, out)
        .iter()
        .map(|tap| slice_vjp(graph, tap, &dims, share))
        .collect::<Result<Vec<_>>>()?;
    crop_padding(graph, window, &xs, add_all(graph, &backs)?)
}

/// The VJP of a max pool of any geometry: each output's gradient goes to the input
/// elements equal to it in its window, shared evenly between ties, added back through
/// every tap's strided slice, then the padding cropped off. The padding is NaN here,
/// which equals nothing, so it never takes a share. (With dilation a window can hold
/// padding alone; its output is -inf, its share `g / 0` lands only on padding, and
/// the crop drops it.)
fn max_pool_vjp(
    graph: &Graph,
    window: &rlx_ir::Window2d,
    x: NodeId,
    out: NodeId,
    g: NodeId,
) -> Result<NodeId> {
    let (xs, gs) = (graph.shape(x)?, graph.shape(g)?);
    let dtype = xs.dtype();
    let dims = padded_dims(window, &xs);
    let padded = if window.padding == [0; 4] {
        x
    } else {
        let [top, left, bottom, right] = window.padding;
        let nan = PadMode::Constant(rlx_ir::F64Bits::new(f64::NAN));
        graph.pad(x, &[(0, 0), (0, 0), (top, bottom), (left, right)], nan)?
    };
    let taps = pool_taps(window, &dims, [gs.dim(2), gs.dim(3)]);
    let hits = taps
        .iter()
        .map(|tap| {
            let read = graph.push(Op::Slice { axes: tap.clone() }, &[padded])?;
            graph.cast(graph.binary(BinaryOp::Eq, read, out)?, dtype)
        })
        .collect::<Result<Vec<_>>>()?;
    let share = graph.binary(BinaryOp::Div, g, add_all(graph, &hits)?)?;
    let backs = taps
        .iter()
        .zip(&hits)
        .map(|(tap, &hit)| {
            let picked = graph.binary(BinaryOp::Mul, hit, share)?;
            slice_vjp(graph, tap, &dims, picked)
        })
        .collect::<Result<Vec<_>>>()?;
    crop_padding(graph, window, &xs, add_all(graph, &backs)?)
}

/// The sum of `terms` (at least one), added in order.
fn add_all(graph: &Graph, terms: &[NodeId]) -> Result<NodeId> {
    let (&first, rest) = terms
        .split_first()
        .ok_or_else(|| Error::invalid("grad", "a sum of no terms"))?;
    rest.iter()
        .try_fold(first, |sum, &t| graph.binary(BinaryOp::Add, sum, t))
}

/// Constant padding with zeros.
fn zero_padding() -> PadMode {
    PadMode::Constant(rlx_ir::F64Bits::new(0.0))
}

/// Zeros of `dims` and `dtype`.
fn zeros(graph: &Graph, dims: &[usize], dtype: DType) -> Result<NodeId> {
    let one = graph.reshape(graph.scalar(0.0, dtype), &vec![1; dims.len()])?;
    graph.expand(one, dims)
}

/// `t`, the result of reducing `x` over `axes`, with those axes kept as size 1 (a
/// reshape unless `keepdims` kept them already).
fn with_reduced_axes(
    graph: &Graph,
    t: NodeId,
    x: NodeId,
    (axes, keepdims): (&[usize], bool),
) -> Result<NodeId> {
    if keepdims {
        return Ok(t);
    }
    let shape = graph.shape(x)?;
    let kept: Vec<usize> = (0..shape.rank())
        .map(|a| if axes.contains(&a) { 1 } else { shape.dim(a) })
        .collect();
    graph.reshape(t, &kept)
}

/// Whether a pooling window tiles the NCHW input `x`: stride equal to the kernel, no
/// padding or dilation, and the kernel dividing the height and width.
fn tiles(window: &rlx_ir::Window2d, x: &rlx_ir::Shape) -> bool {
    window.kernel == window.stride
        && window.padding == [0; 4]
        && window.dilation == [1, 1]
        && x.dim(2).is_multiple_of(window.kernel[0])
        && x.dim(3).is_multiple_of(window.kernel[1])
}

/// A pooled NCHW tensor `t` spread back over windows of `[kh, kw]` that tile the
/// input: each value repeated over its window.
fn spread_windows(graph: &Graph, t: NodeId, [kh, kw]: [usize; 2]) -> Result<NodeId> {
    let s = graph.shape(t)?;
    let (n, c, h, w) = (s.dim(0), s.dim(1), s.dim(2), s.dim(3));
    let split = graph.reshape(t, &[n, c, h, 1, w, 1])?;
    let wide = graph.expand(split, &[n, c, h, kh, w, kw])?;
    graph.reshape(wide, &[n, c, h * kh, w * kw])
}

/// `erf'(x) = 2 / √π e^(-x²)`.
fn erf_slope(graph: &Graph, x: NodeId, dtype: DType) -> Result<NodeId> {
    let square = graph.binary(BinaryOp::Mul, x, x)?;
    let decay = graph.unary(UnaryOp::Exp, graph.unary(UnaryOp::Neg, square)?)?;
    let scale = graph.scalar(std::f64::consts::FRAC_2_SQRT_PI, dtype);
    graph.binary(BinaryOp::Mul, decay, scale)
}

/// `g` summed over the axes along which `x` was broadcast to `g`'s shape, and shaped
/// like `x`.
fn unbroadcast(graph: &Graph, g: NodeId, x: NodeId) -> Result<NodeId> {
    let (gs, xs) = (graph.shape(g)?, graph.shape(x)?);
    if gs.dims() == xs.dims() {
        return Ok(g);
    }
    let lead = gs.rank() - xs.rank();
    let mut axes: Vec<isize> = (0..lead as isize).collect();
    for (i, &d) in xs.dims().iter().enumerate() {
        if d == 1 && gs.dim(lead + i) != 1 {
            axes.push((lead + i) as isize);
        }
    }
    let axes: Vec<usize> = axes.iter().map(|&a| a as usize).collect();
    graph.reshape(sum_in_runs(graph, g, &axes)?, xs.dims())
}

/// `g` summed over `axes` (sorted), dims kept, one reduction per run of consecutive
/// axes (the last run first): a backend's fast reduction covers consecutive axes.
fn sum_in_runs(graph: &Graph, g: NodeId, axes: &[usize]) -> Result<NodeId> {
    let mut runs: Vec<Vec<isize>> = Vec::new();
    for &a in axes {
        match runs.last_mut() {
            Some(run) if run.last() == Some(&(a as isize - 1)) => run.push(a as isize),
            _ => runs.push(vec![a as isize]),
        }
    }
    let mut summed = g;
    for run in runs.iter().rev() {
        summed = graph.sum(summed, run, true)?;
    }
    Ok(summed)
}

/// Zeros of `id`'s shape and dtype (a float dtype; integers and bools get `f32`).
fn zeros_like(graph: &Graph, id: NodeId) -> Result<NodeId> {
    let shape = graph.shape(id)?;
    let dtype = if shape.dtype().is_float() {
        shape.dtype()
    } else {
        DType::F32
    };
    zeros(graph, shape.dims(), dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlx_ir::reference::{HostTensor, evaluate};
    use rlx_ir::{Shape, Window2d};
    use std::collections::HashMap;

    /// Deterministic values in [-1, 1].
    fn values(n: usize, seed: &mut u64) -> Vec<f64> {
        (0..n)
            .map(|_| {
                *seed = seed
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                (*seed >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
            })
            .collect()
    }

    /// Checks `grad` of `build`'s scalar loss with respect to every input against
    /// central finite differences of the loss, in f64 with the reference evaluator.
    fn check(
        name: &str,
        inputs: &[(&str, &[usize])],
        build: impl Fn(&Graph, &[NodeId]) -> Result<NodeId>,
    ) {
        let graph = Graph::new(name);
        let ids: Vec<NodeId> = inputs
            .iter()
            .map(|(n, d)| graph.input(*n, Shape::new(d, DType::F64)).unwrap())
            .collect();
        let loss = build(&graph, &ids).unwrap();
        let grads = grad(&graph, loss, &ids).unwrap();
        let mut outputs = vec![loss];
        outputs.extend(&grads);
        graph.set_outputs(outputs);
        let mut seed = 7u64;
        let feed: HashMap<String, HostTensor> = inputs
            .iter()
            .map(|(n, d)| {
                let shape = Shape::new(d, DType::F64);
                let data = values(shape.num_elements(), &mut seed);
                (n.to_string(), HostTensor::new(shape, data))
            })
            .collect();
        let results = evaluate(&graph, &mut feed.clone()).unwrap();
        assert_eq!(results.len(), inputs.len() + 1);
        let eps = 1e-6;
        for (k, (input, _)) in inputs.iter().enumerate() {
            let analytic = &results[k + 1].data;
            for (e, &rule) in analytic.iter().enumerate() {
                let at = |delta: f64| {
                    let mut probe = feed.clone();
                    probe.get_mut(*input).unwrap().data[e] += delta;
                    evaluate(&graph, &mut probe).unwrap()[0].data[0]
                };
                let numeric = (at(eps) - at(-eps)) / (2.0 * eps);
                assert!(
                    (rule - numeric).abs() <= 1e-6 * (1.0 + numeric.abs()),
                    "{name}: d loss / d {input}[{e}] = {rule} by the rule, {numeric} by differences"
                );
            }
        }
    }

    #[test]
    fn elementwise_rules_match_finite_differences() {
        let unary = [
            UnaryOp::Neg,
            UnaryOp::Abs,
            UnaryOp::Exp,
            UnaryOp::Tanh,
            UnaryOp::Sigmoid,
            UnaryOp::Relu,
            UnaryOp::Silu,
            UnaryOp::Relu6,
            UnaryOp::HardSwish,
            UnaryOp::Gelu,
            UnaryOp::GeluTanh,
            UnaryOp::Erf,
            UnaryOp::Sin,
            UnaryOp::Cos,
        ];
        for u in unary {
            check(u.name(), &[("x", &[3, 4])], |g, x| {
                let y = g.unary(u, x[0])?;
                g.sum(g.binary(BinaryOp::Mul, y, y)?, &[], false)
            });
        }
        // The clamped activations past their corners too: operands in [-8, 8).
        for u in [UnaryOp::Relu6, UnaryOp::HardSwish] {
            check(u.name(), &[("x", &[4, 5])], |g, x| {
                let wide = g.binary(BinaryOp::Mul, x[0], g.scalar(8.0, DType::F64))?;
                let y = g.unary(u, wide)?;
                g.sum(g.binary(BinaryOp::Mul, y, y)?, &[], false)
            });
        }
        // Positive operands for the ones defined there: exp of the input.
        for u in [
            UnaryOp::Log,
            UnaryOp::Sqrt,
            UnaryOp::Rsqrt,
            UnaryOp::Reciprocal,
        ] {
            check(u.name(), &[("x", &[2, 5])], |g, x| {
                let y = g.unary(u, g.unary(UnaryOp::Exp, x[0])?)?;
                g.sum(y, &[], false)
            });
        }
        for b in [
            BinaryOp::Add,
            BinaryOp::Sub,
            BinaryOp::Mul,
            BinaryOp::Div,
            BinaryOp::Max,
            BinaryOp::Min,
        ] {
            // Broadcasting both ways: [3, 1, 4] against [2, 1].
            check(b.name(), &[("a", &[3, 1, 4]), ("b", &[2, 1])], |g, x| {
                let b_side = if b == BinaryOp::Div {
                    g.unary(UnaryOp::Exp, x[1])?
                } else {
                    x[1]
                };
                let y = g.binary(b, x[0], b_side)?;
                g.sum(g.unary(UnaryOp::Tanh, y)?, &[], false)
            });
        }
    }

    #[test]
    fn matmul_reduce_and_layout_rules_match_finite_differences() {
        check(
            "mlp",
            &[("x", &[3, 4]), ("w", &[4, 5]), ("b", &[5])],
            |g, x| {
                let h = g.binary(BinaryOp::Add, g.matmul(x[0], x[1])?, x[2])?;
                let h = g.unary(UnaryOp::Tanh, h)?;
                g.reduce(ReduceOp::Mean, g.binary(BinaryOp::Mul, h, h)?, &[], false)
            },
        );
        // A batch of matrices against one shared matrix.
        check("batched", &[("a", &[2, 3, 4]), ("w", &[4, 2])], |g, x| {
            let y = g.matmul(x[0], x[1])?;
            let y = g.sum(g.unary(UnaryOp::Sigmoid, y)?, &[1], false)?;
            g.sum(g.binary(BinaryOp::Mul, y, y)?, &[], true)
        });
        // Cross-entropy-like: log_softmax picked by a one-hot, a softmax weighting, a
        // `where` whose condition depends on the input, an expand.
        check(
            "softmax",
            &[("x", &[3, 5]), ("t", &[3, 5]), ("v", &[1, 5])],
            |g, x| {
                let picked = g.binary(BinaryOp::Mul, g.log_softmax(x[0], -1)?, x[1])?;
                let weights = g.softmax(x[0], 0)?;
                let wide = g.expand(x[2], &[3, 5])?;
                let positive = g.binary(BinaryOp::Gt, x[0], g.scalar(0.0, DType::F64))?;
                let chosen = g.select(positive, wide, g.binary(BinaryOp::Mul, x[0], x[0])?)?;
                let mixed = g.binary(BinaryOp::Mul, weights, chosen)?;
                g.sum(g.binary(BinaryOp::Add, picked, mixed)?, &[], false)
            },
        );
        // The losses: cross-entropy with an ignored row and label smoothing, MSE.
        check("losses", &[("x", &[4, 6]), ("y", &[4, 6])], |g, x| {
            let ids = g.constant(rlx_ir::TensorData::I64(vec![5, -100, 0, 3]), &[4])?;
            let options = rlx_ir::CrossEntropy {
                ignore_index: Some(-100),
                label_smoothing: 0.1,
            };
            let ce = g.cross_entropy(x[0], ids, options)?;
            g.binary(BinaryOp::Add, ce, g.mse(x[0], x[1])?)
        });
        // Composites through their decompositions.
        check(
            "norms",
            &[("x", &[3, 8]), ("gamma", &[8]), ("beta", &[8])],
            |g, x| {
                let ln = g.layer_norm(x[0], x[1], x[2], 1e-5)?;
                let rms = g.rms_norm(x[0], x[1], 1e-6)?;
                let y = g.binary(BinaryOp::Mul, ln, g.unary(UnaryOp::Tanh, rms)?)?;
                g.sum(g.binary(BinaryOp::Mul, y, y)?, &[], false)
            },
        );
        check(
            "norms over a 3-D input",
            &[
                ("x", &[2, 3, 5]),
                ("gamma", &[5]),
                ("beta", &[5]),
                ("w", &[2, 3, 5]),
            ],
            |g, x| {
                let ln = g.layer_norm(x[0], x[1], x[2], 1e-3)?;
                let rms = g.rms_norm(x[0], x[1], 1e-3)?;
                let y = g.binary(BinaryOp::Add, ln, g.binary(BinaryOp::Mul, rms, rms)?)?;
                g.sum(g.binary(BinaryOp::Mul, y, x[3])?, &[], false)
            },
        );
        check(
            "attention",
            &[
                ("q", &[1, 2, 3, 4]),
                ("k", &[1, 2, 5, 4]),
                ("v", &[1, 2, 5, 4]),
            ],
            |g, x| {
                let y = g.attention(x[0], x[1], x[2], None, true, None)?;
                g.sum(g.binary(BinaryOp::Mul, y, y)?, &[], false)
            },
        );
        // Its own rule: sequence-major, causal and not, with a given scale.
        check(
            "attention, sequence-major",
            &[
                ("q", &[2, 4, 3, 5]),
                ("k", &[2, 4, 3, 5]),
                ("v", &[2, 4, 3, 2]),
                ("w", &[2, 4, 3, 2]),
            ],
            |g, x| {
                let a = g.attention_seq_major(x[0], x[1], x[2], None, true, None)?;
                let b = g.attention_seq_major(x[0], x[1], x[2], None, false, Some(0.3))?;
                let y = g.binary(BinaryOp::Add, a, g.unary(UnaryOp::Tanh, b)?)?;
                g.sum(g.binary(BinaryOp::Mul, y, x[3])?, &[], false)
            },
        );
        check(
            "attention, bool mask",
            &[
                ("q", &[1, 2, 3, 2]),
                ("k", &[1, 2, 4, 2]),
                ("v", &[1, 2, 4, 3]),
            ],
            |g, x| {
                // The second query sees no key at all.
                let keep = [
                    true, false, true, true, false, false, false, false, true, true, false, false,
                ];
                let mask = g.constant(rlx_ir::TensorData::Bool(keep.to_vec()), &[3, 4])?;
                let y = g.attention(x[0], x[1], x[2], Some(mask), false, None)?;
                g.sum(g.binary(BinaryOp::Mul, y, y)?, &[], false)
            },
        );
        // Causal with more queries than keys: the first queries see no key.
        check(
            "attention, causal with more queries than keys",
            &[
                ("q", &[1, 2, 5, 3]),
                ("k", &[1, 2, 3, 3]),
                ("v", &[1, 2, 3, 2]),
            ],
            |g, x| {
                let y = g.attention(x[0], x[1], x[2], None, true, None)?;
                g.sum(g.binary(BinaryOp::Mul, y, y)?, &[], false)
            },
        );
        // Grouped key/value heads and a float mask (whose gradient is checked too).
        check(
            "attention, grouped heads and a mask",
            &[
                ("q", &[1, 4, 3, 2]),
                ("k", &[1, 2, 3, 2]),
                ("v", &[1, 2, 3, 2]),
                ("mask", &[3, 3]),
            ],
            |g, x| {
                let y = g.attention(x[0], x[1], x[2], Some(x[3]), false, None)?;
                g.sum(g.binary(BinaryOp::Mul, y, y)?, &[], false)
            },
        );
        // An embedding lookup (rows picked twice), slices and a concat.
        check(
            "embedding",
            &[("table", &[5, 3]), ("x", &[2, 6])],
            |g, x| {
                let ids = g.constant(rlx_ir::TensorData::I64(vec![4, 0, 4, 2]), &[2, 2])?;
                let rows = g.gather(x[0], ids, 0)?;
                let left = g.slice(x[1], 1, 1, 4, 1)?;
                let right = g.slice(x[1], 1, 3, 6, 1)?;
                let joined = g.concat(&[left, right], 0)?;
                let picked = g.sum(g.binary(BinaryOp::Mul, rows, rows)?, &[], false)?;
                let mixed = g.sum(g.unary(UnaryOp::Tanh, joined)?, &[], false)?;
                g.binary(BinaryOp::Add, picked, mixed)
            },
        );
        // A power with a positive base, both operands varying.
        check("pow", &[("a", &[2, 3]), ("b", &[3])], |g, x| {
            let y = g.binary(BinaryOp::Pow, g.unary(UnaryOp::Exp, x[0])?, x[1])?;
            g.sum(y, &[], false)
        });
        // An average pool.
        check("avg_pool", &[("x", &[1, 2, 4, 6])], |g, x| {
            let y = g.avg_pool2d(x[0], [2, 3], [2, 3], [0; 4], true)?;
            g.sum(g.binary(BinaryOp::Mul, y, y)?, &[], false)
        });
        // Strided convolutions: one whose stride leaves the last rows unread, one with
        // uneven strides and padding.
        check(
            "strided",
            &[
                ("x", &[2, 2, 7, 8]),
                ("w", &[3, 2, 3, 3]),
                ("w2", &[2, 3, 2, 3]),
            ],
            |g, x| {
                let y = g.conv2d(x[0], x[1], None, [2, 2], [1, 1, 0, 1], [1, 1], 1)?;
                let z = g.conv2d(
                    g.unary(UnaryOp::Tanh, y)?,
                    x[2],
                    None,
                    [1, 2],
                    [1, 0, 0, 2],
                    [1, 1],
                    1,
                )?;
                g.sum(g.binary(BinaryOp::Mul, z, z)?, &[], false)
            },
        );
        // A small CNN: padded and unpadded convolutions with a bias, a max pool.
        check(
            "cnn",
            &[
                ("x", &[2, 3, 6, 6]),
                ("w", &[4, 3, 3, 3]),
                ("b", &[4]),
                ("w2", &[2, 4, 2, 3]),
            ],
            |g, x| {
                let y = g.conv2d(x[0], x[1], Some(x[2]), [1, 1], [1, 1, 1, 1], [1, 1], 1)?;
                let y = g.max_pool2d(g.unary(UnaryOp::Tanh, y)?, [2, 2], [2, 2], [0; 4])?;
                let z = g.conv2d(y, x[3], None, [1, 1], [0, 1, 1, 0], [1, 1], 1)?;
                g.sum(g.binary(BinaryOp::Mul, z, z)?, &[], false)
            },
        );
        check("layout", &[("x", &[2, 3, 4])], |g, x| {
            let p = g.permute(x[0], &[2, 0, 1])?;
            let r = g.reshape(p, &[4, 6])?;
            let m = g.reduce(ReduceOp::Mean, r, &[1], true)?;
            let weighted = g.sum(
                g.binary(BinaryOp::Mul, g.unary(UnaryOp::Exp, m)?, r)?,
                &[],
                false,
            )?;
            // The extremes along each axis, kept and not.
            let high = g.sum(g.reduce_max(r, &[0], false)?, &[], false)?;
            let low = g.sum(g.reduce_min(r, &[1], true)?, &[], false)?;
            let extremes = g.binary(BinaryOp::Sub, high, g.binary(BinaryOp::Mul, low, low)?)?;
            g.binary(BinaryOp::Add, weighted, extremes)
        });
    }

    #[test]
    fn step_atan_and_mod_rules_match_finite_differences() {
        // Steps of 3x times x: the steps are flat, so the derivative is the step.
        for u in [UnaryOp::Floor, UnaryOp::Ceil, UnaryOp::Round, UnaryOp::Sign] {
            check(u.name(), &[("x", &[3, 4])], |g, x| {
                let steps =
                    g.unary(u, g.binary(BinaryOp::Mul, x[0], g.scalar(3.0, DType::F64))?)?;
                let y = g.binary(BinaryOp::Add, g.binary(BinaryOp::Mul, x[0], steps)?, x[0])?;
                g.sum(g.binary(BinaryOp::Mul, y, y)?, &[], false)
            });
        }
        check("atan", &[("x", &[3, 4])], |g, x| {
            let scaled = g.binary(BinaryOp::Mul, x[0], g.scalar(2.5, DType::F64))?;
            let y = g.unary(UnaryOp::Atan, scaled)?;
            g.sum(g.binary(BinaryOp::Mul, y, y)?, &[], false)
        });
        // a = b (k + 1/2 + 0.45 sin t): a / b stays at least 0.05 from an integer
        // (a jump of the modulo) whatever t and b, of either sign; b broadcasts.
        check("mod", &[("t", &[3, 4]), ("b", &[4])], |g, x| {
            let k: Vec<f64> = vec![-3., -2., -1., 0., 1., 2., 3., 4., -4., 5., -1., 2.];
            let k = g.constant(rlx_ir::TensorData::F64(k), &[3, 4])?;
            let wave = g.binary(
                BinaryOp::Mul,
                g.unary(UnaryOp::Sin, x[0])?,
                g.scalar(0.45, DType::F64),
            )?;
            let c = g.binary(
                BinaryOp::Add,
                g.binary(BinaryOp::Add, k, g.scalar(0.5, DType::F64))?,
                wave,
            )?;
            let a = g.binary(BinaryOp::Mul, x[1], c)?;
            let r = g.binary(BinaryOp::Mod, a, x[1])?;
            let y = g.binary(
                BinaryOp::Add,
                g.binary(BinaryOp::Mul, r, r)?,
                g.unary(UnaryOp::Tanh, r)?,
            )?;
            g.sum(y, &[], false)
        });
        // Matrix-vector products: numpy promotes the vector, and drops its axis.
        check(
            "matmul with vectors",
            &[("v", &[4]), ("m", &[2, 4, 3]), ("u", &[3]), ("a", &[5, 4])],
            |g, x| {
                let left = g.matmul(x[0], x[1])?;
                let right = g.matmul(x[3], x[0])?;
                let both = g.matmul(g.matmul(x[1], x[2])?, g.unary(UnaryOp::Tanh, x[0])?)?;
                let dot = g.matmul(x[0], x[0])?;
                let y = g.sum(g.unary(UnaryOp::Tanh, left)?, &[], false)?;
                let y = g.binary(
                    BinaryOp::Add,
                    y,
                    g.sum(g.binary(BinaryOp::Mul, right, right)?, &[], false)?,
                )?;
                let y = g.binary(
                    BinaryOp::Add,
                    y,
                    g.sum(g.unary(UnaryOp::Sin, both)?, &[], false)?,
                )?;
                g.binary(BinaryOp::Add, y, dot)
            },
        );
    }

    #[test]
    fn prod_rule_matches_finite_differences_and_handles_zeros() {
        check("prod", &[("x", &[3, 4, 2])], |g, x| {
            let rows = g.prod(x[0], &[1], false)?;
            let planes = g.prod(x[0], &[0, 2], true)?;
            let all = g.prod(g.unary(UnaryOp::Exp, x[0])?, &[], false)?;
            let y = g.sum(g.unary(UnaryOp::Tanh, rows)?, &[], false)?;
            let y = g.binary(
                BinaryOp::Add,
                y,
                g.sum(g.binary(BinaryOp::Mul, planes, planes)?, &[], false)?,
            )?;
            g.binary(BinaryOp::Add, y, all)
        });
        // Exact values with zeros: one zero gets the product of the rest and the
        // others nothing; with two zeros everything gets nothing.
        let graph = Graph::new("prod zeros");
        let shape = Shape::new(&[3, 3], DType::F64);
        let x = graph.input("x", shape.clone()).unwrap();
        let w = graph
            .constant(rlx_ir::TensorData::F64(vec![2.0, -1.0, 0.5]), &[3])
            .unwrap();
        let rows = graph.prod(x, &[1], false).unwrap();
        let loss = graph
            .sum(graph.binary(BinaryOp::Mul, rows, w).unwrap(), &[], false)
            .unwrap();
        let dx = grad(&graph, loss, &[x]).unwrap()[0];
        graph.set_outputs(vec![dx]);
        let data = vec![2.0, 0.0, 3.0, 0.0, 5.0, 0.0, 2.0, 4.0, 0.5];
        let mut feed = HashMap::from([("x".to_string(), HostTensor::new(shape, data))]);
        let got = evaluate(&graph, &mut feed).unwrap()[0].data.clone();
        let want = vec![0.0, 12.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.5, 4.0];
        assert_eq!(got, want);
    }

    #[test]
    fn max_pool_ties_share_the_gradient_evenly() {
        // Windows that tile the input (the broadcast rule) and overlapping ones (the
        // general rule): the left window's maximum 3 is there twice, the right one's 5
        // three times.
        for stride in [[2, 2], [2, 1]] {
            let graph = Graph::new("max pool ties");
            let shape = Shape::new(&[1, 1, 2, 4], DType::F64);
            let x = graph.input("x", shape.clone()).unwrap();
            let pooled = graph.max_pool2d(x, [2, 2], stride, [0; 4]).unwrap();
            let cols = graph.shape(pooled).unwrap().dim(3);
            let weights: Vec<f64> = (0..cols).map(|i| 2.0 + 4.0 * i as f64).collect();
            let w = graph
                .constant(rlx_ir::TensorData::F64(weights), &[cols])
                .unwrap();
            let loss = graph
                .sum(graph.binary(BinaryOp::Mul, pooled, w).unwrap(), &[], false)
                .unwrap();
            let dx = grad(&graph, loss, &[x]).unwrap()[0];
            graph.set_outputs(vec![dx]);
            let data = vec![1.0, 3.0, 5.0, 5.0, 3.0, 2.0, 5.0, 1.0];
            let mut feed = HashMap::from([("x".to_string(), HostTensor::new(shape, data))]);
            let got = evaluate(&graph, &mut feed).unwrap()[0].data.clone();
            let want = if stride == [2, 2] {
                vec![0.0, 1.0, 2.0, 2.0, 1.0, 0.0, 2.0, 0.0]
            } else {
                // Windows at columns 0, 1 and 2 (weights 2, 6, 10): maxima 3 (twice),
                // 5 (twice) and 5 (three times).
                let third = 10.0 / 3.0;
                vec![0.0, 1.0, 3.0 + third, third, 1.0, 0.0, 3.0 + third, 0.0]
            };
            for (a, b) in got.iter().zip(&want) {
                assert!(
                    (a - b).abs() < 1e-12,
                    "stride {stride:?}: {got:?} against {want:?}"
                );
            }
        }
    }

    #[test]
    fn edge_cases_give_exact_gradients_not_errors_or_nan() {
        let run = |graph: &Graph, feed: Vec<(&str, Shape, Vec<f64>)>| -> Vec<Vec<f64>> {
            let mut feed: HashMap<String, HostTensor> = feed
                .into_iter()
                .map(|(n, s, d)| (n.to_string(), HostTensor::new(s, d)))
                .collect();
            evaluate(graph, &mut feed)
                .unwrap()
                .into_iter()
                .map(|t| t.data)
                .collect()
        };
        // A tiling max pool whose maxima are infinite: the gradient goes to them.
        let graph = Graph::new("infinite maxima");
        let shape = Shape::new(&[1, 1, 2, 4], DType::F64);
        let x = graph.input("x", shape.clone()).unwrap();
        let pooled = graph.max_pool2d(x, [2, 2], [2, 2], [0; 4]).unwrap();
        let loss = graph.sum(pooled, &[], false).unwrap();
        graph.set_outputs(grad(&graph, loss, &[x]).unwrap());
        let inf = f64::INFINITY;
        let data = vec![inf, 0.0, -inf, -inf, 1.0, 2.0, -inf, -inf];
        let got = run(&graph, vec![("x", shape, data)]);
        assert_eq!(got[0], vec![1.0, 0.0, 0.25, 0.25, 0.0, 0.0, 0.25, 0.25]);
        // A product over an empty K, shared by a batch: zeros of the operands' shapes.
        let graph = Graph::new("empty k");
        let (sa, sb) = (
            Shape::new(&[2, 3, 0], DType::F64),
            Shape::new(&[0, 4], DType::F64),
        );
        let a = graph.input("a", sa.clone()).unwrap();
        let b = graph.input("b", sb.clone()).unwrap();
        let loss = graph.sum(graph.matmul(a, b).unwrap(), &[], false).unwrap();
        graph.set_outputs(grad(&graph, loss, &[a, b]).unwrap());
        let got = run(&graph, vec![("a", sa, vec![]), ("b", sb, vec![])]);
        assert!(got.iter().all(Vec::is_empty));
        // A tile repeated zero times: nothing of the input reaches the loss.
        let graph = Graph::new("zero repetitions");
        let shape = Shape::new(&[3, 2], DType::F64);
        let x = graph.input("x", shape.clone()).unwrap();
        let tiled = graph.tile(x, &[0, 2]).unwrap();
        let loss = graph.sum(tiled, &[], false).unwrap();
        graph.set_outputs(grad(&graph, loss, &[x]).unwrap());
        let got = run(&graph, vec![("x", shape, vec![1.0; 6])]);
        assert_eq!(got[0], vec![0.0; 6]);
    }

    #[test]
    fn data_movement_rules_match_finite_differences() {
        // Steps above 1, backward steps, both on one axis, an empty slice.
        check("strided slices", &[("x", &[5, 7, 6])], |g, x| {
            let a = g.slice_axes(
                x[0],
                &[(0, 0, 5, 2), (1, 6, 0, -3), (2, -1, isize::MIN, -1)],
            )?;
            let b = g.slice_axes(x[0], &[(0, 1, 5, 3), (2, 4, -7, -2)])?;
            let c = g.slice(x[0], 1, 1, 7, 4)?;
            let empty = g.slice(x[0], 2, 4, 1, 2)?;
            let c = g.binary(BinaryOp::Add, c, g.sum(empty, &[], false)?)?;
            let y = g.sum(g.binary(BinaryOp::Mul, a, a)?, &[], false)?;
            let y = g.binary(
                BinaryOp::Add,
                y,
                g.sum(
                    g.binary(BinaryOp::Mul, g.unary(UnaryOp::Tanh, b)?, b)?,
                    &[],
                    false,
                )?,
            )?;
            g.binary(
                BinaryOp::Add,
                y,
                g.sum(g.unary(UnaryOp::Exp, c)?, &[], false)?,
            )
        });
        // Any axis, indices of rank 0 to 2, repeated and negative ones.
        check("gather", &[("x", &[3, 5, 4]), ("v", &[6])], |g, x| {
            let i64s = |v: Vec<i64>, d: &[usize]| g.constant(rlx_ir::TensorData::I64(v), d);
            let middle = g.gather(x[0], i64s(vec![4, -1, 0, 2, 4, -5], &[2, 3])?, 1)?;
            let last = g.gather(x[0], i64s(vec![3, -4, 3], &[3])?, 2)?;
            let first = g.gather(x[0], i64s(vec![-2], &[])?, 0)?;
            let flat = g.gather(x[1], i64s(vec![5, 0, -1, 2], &[2, 2])?, 0)?;
            let mut y = g.sum(g.binary(BinaryOp::Mul, middle, middle)?, &[], false)?;
            for t in [last, first, flat] {
                let s = g.sum(
                    g.unary(UnaryOp::Sin, g.binary(BinaryOp::Mul, t, y)?)?,
                    &[],
                    false,
                )?;
                y = g.binary(BinaryOp::Add, y, s)?;
            }
            Ok(y)
        });
        check("pad", &[("x", &[4, 5, 3])], |g, x| {
            let reflect = g.pad(x[0], &[(0, 0), (2, 3), (1, 2)], PadMode::Reflect)?;
            let edge = g.pad(x[0], &[(5, 6), (0, 1), (0, 0)], PadMode::Edge)?;
            let fill = PadMode::Constant(rlx_ir::F64Bits::new(1.5));
            let constant = g.pad(x[0], &[(1, 2), (0, 0), (3, 1)], fill)?;
            let y = g.sum(g.binary(BinaryOp::Mul, reflect, reflect)?, &[], false)?;
            let y = g.binary(
                BinaryOp::Add,
                y,
                g.sum(g.unary(UnaryOp::Sin, edge)?, &[], false)?,
            )?;
            let c = g.binary(BinaryOp::Mul, g.unary(UnaryOp::Tanh, constant)?, constant)?;
            g.binary(BinaryOp::Add, y, g.sum(c, &[], false)?)
        });
        check("tile", &[("x", &[2, 3, 2])], |g, x| {
            let a = g.tile(x[0], &[3, 1, 2])?;
            let b = g.tile(x[0], &[1, 2, 1])?;
            let y = g.sum(g.unary(UnaryOp::Sin, a)?, &[], false)?;
            g.binary(
                BinaryOp::Add,
                y,
                g.sum(g.binary(BinaryOp::Mul, b, b)?, &[], false)?,
            )
        });
        for exclusive in [false, true] {
            for reverse in [false, true] {
                let name = format!("cumsum exclusive {exclusive} reverse {reverse}");
                check(&name, &[("x", &[3, 5])], |g, x| {
                    let across = g.cumsum(x[0], 1, exclusive, reverse)?;
                    let down = g.cumsum(x[0], 0, exclusive, reverse)?;
                    let y = g.binary(BinaryOp::Mul, g.unary(UnaryOp::Tanh, across)?, down)?;
                    g.sum(g.binary(BinaryOp::Mul, y, y)?, &[], false)
                });
            }
        }
        check("topk", &[("x", &[3, 6, 2]), ("w", &[3, 3, 2])], |g, x| {
            let (top, _) = g.topk(x[0], 3, 1, true)?;
            let (low, _) = g.topk(x[0], 2, -1, false)?;
            let (first, _) = g.topk(x[0], 1, 0, true)?;
            let y = g.sum(g.binary(BinaryOp::Mul, top, x[1])?, &[], false)?;
            let y = g.binary(
                BinaryOp::Add,
                y,
                g.sum(g.unary(UnaryOp::Sin, low)?, &[], false)?,
            )?;
            g.binary(
                BinaryOp::Add,
                y,
                g.sum(g.binary(BinaryOp::Mul, first, first)?, &[], false)?,
            )
        });
    }

    #[test]
    fn general_convolution_and_pool_rules_match_finite_differences() {
        // Two groups, a dilation, a stride, padding of the kernel's size or more.
        check(
            "grouped dilated conv",
            &[("x", &[2, 4, 7, 6]), ("w", &[6, 2, 3, 2]), ("b", &[6])],
            |g, x| {
                let y = g.conv2d(x[0], x[1], Some(x[2]), [2, 1], [3, 2, 4, 1], [2, 3], 2)?;
                g.sum(
                    g.binary(BinaryOp::Mul, y, g.unary(UnaryOp::Tanh, y)?)?,
                    &[],
                    false,
                )
            },
        );
        // Depthwise, with bottom and right padding past what the gradient keeps.
        check(
            "depthwise conv",
            &[("x", &[1, 3, 5, 4]), ("w", &[3, 1, 2, 2])],
            |g, x| {
                let y = g.conv2d(x[0], x[1], None, [1, 2], [0, 0, 2, 3], [1, 1], 3)?;
                g.sum(g.binary(BinaryOp::Mul, y, y)?, &[], false)
            },
        );
        // One group, a dilation and large top-left padding.
        check(
            "dilated conv",
            &[("x", &[1, 2, 6, 5]), ("w", &[3, 2, 2, 3])],
            |g, x| {
                let y = g.conv2d(x[0], x[1], None, [1, 1], [4, 5, 0, 1], [3, 1], 1)?;
                g.sum(g.unary(UnaryOp::Sin, y)?, &[], false)
            },
        );
        let dilated = |kernel, stride, padding, dilation| Window2d {
            kernel,
            stride,
            padding,
            dilation,
        };
        check("max pools", &[("x", &[2, 2, 7, 6])], |g, x| {
            // Overlapping windows and padding; then a dilated window.
            let a = g.max_pool2d(x[0], [3, 3], [2, 1], [1, 2, 2, 1])?;
            let window = dilated([2, 3], [1, 2], [1, 0, 1, 2], [2, 1]);
            let b = g.push(Op::MaxPool2d { window }, &[x[0]])?;
            let y = g.sum(g.binary(BinaryOp::Mul, a, a)?, &[], false)?;
            g.binary(
                BinaryOp::Add,
                y,
                g.sum(g.unary(UnaryOp::Sin, b)?, &[], false)?,
            )
        });
        for include in [true, false] {
            check(
                &format!("avg pools {include}"),
                &[("x", &[2, 2, 7, 6])],
                |g, x| {
                    let a = g.avg_pool2d(x[0], [3, 2], [2, 1], [2, 1, 1, 0], include)?;
                    let window = dilated([2, 2], [2, 1], [1, 2, 0, 1], [3, 2]);
                    let b = g.push(
                        Op::AvgPool2d {
                            window,
                            count_include_pad: include,
                        },
                        &[x[0]],
                    )?;
                    let y = g.sum(g.binary(BinaryOp::Mul, a, a)?, &[], false)?;
                    g.binary(
                        BinaryOp::Add,
                        y,
                        g.sum(g.unary(UnaryOp::Sin, b)?, &[], false)?,
                    )
                },
            );
        }
    }

    #[test]
    fn quant_matmul_gradient_is_exact_on_representable_values() {
        // Q8_0 rows of 32 values: an f16 scale 2^-4 and signed bytes. With activations
        // and loss weights in quarters, every product and sum is exact in f32, and the
        // loss is linear in the activations: differences with a step of 1 are exact.
        let (k, n) = (32, 3);
        let mut seed = 11u64;
        let mut packed = Vec::new();
        for _ in 0..n {
            packed.extend(0x2C00u16.to_le_bytes());
            packed.extend(
                values(k, &mut seed)
                    .iter()
                    .map(|v| ((v * 8.0).round() as i8) as u8),
            );
        }
        let graph = Graph::new("quant");
        let a = graph.input("a", Shape::new(&[2, k], DType::F32)).unwrap();
        let w = graph
            .constant(rlx_ir::TensorData::U8(packed), &[n, 34])
            .unwrap();
        let quarters = |m: usize, seed: &mut u64| -> Vec<f64> {
            values(m, seed)
                .iter()
                .map(|v| (v * 8.0).round() / 4.0)
                .collect()
        };
        let c = quarters(2 * n, &mut seed);
        let c_node = graph
            .constant(rlx_ir::TensorData::from_f64(DType::F32, &c), &[2, n])
            .unwrap();
        let y = graph.quant_matmul(a, w, rlx_ir::QuantFormat::Q8_0).unwrap();
        let loss = graph
            .sum(graph.binary(BinaryOp::Mul, y, c_node).unwrap(), &[], false)
            .unwrap();
        let da = grad(&graph, loss, &[a]).unwrap()[0];
        graph.set_outputs(vec![loss, da]);
        let feed = HashMap::from([(
            "a".to_string(),
            HostTensor::new(Shape::new(&[2, k], DType::F32), quarters(2 * k, &mut seed)),
        )]);
        let rule = evaluate(&graph, &mut feed.clone()).unwrap()[1].data.clone();
        for (e, &r) in rule.iter().enumerate() {
            let at = |delta: f64| {
                let mut probe = feed.clone();
                probe.get_mut("a").unwrap().data[e] += delta;
                evaluate(&graph, &mut probe).unwrap()[0].data[0]
            };
            let numeric = (at(1.0) - at(-1.0)) / 2.0;
            assert_eq!(r, numeric, "d loss / d a[{e}]");
        }
    }

    #[test]
    fn ops_without_a_gradient_are_errors_that_name_them() {
        let g = Graph::new("none");
        let f32s = |d: &[usize]| Shape::new(d, DType::F32);
        let x = g.input("x", f32s(&[2, 3])).unwrap();
        let fail = |y: NodeId, names: &[&str]| {
            let y = if g.shape(y).unwrap().dtype().is_float() {
                y
            } else {
                g.cast(y, DType::F32).unwrap()
            };
            let loss = g.sum(y, &[], false).unwrap();
            let err = grad(&g, loss, &[x]).unwrap_err().to_string();
            for name in names {
                assert!(err.contains(&format!("`{name}`")), "{name}: {err}");
            }
        };
        let as_int = g.cast(x, DType::I64).unwrap();
        fail(g.argmax(x, 1, false).unwrap(), &["argmax"]);
        fail(g.argmin(x, 0, true).unwrap(), &["argmin"]);
        fail(g.binary(BinaryOp::Le, x, x).unwrap(), &["le"]);
        fail(g.binary(BinaryOp::Add, as_int, as_int).unwrap(), &["add"]);
        fail(
            g.one_hot(as_int, 4, DType::F32).unwrap(),
            &["one_hot", "cast"],
        );
        fail(g.topk(x, 2, 1, true).unwrap().1, &["topk_indices"]);
        let key = g.sum(as_int, &[], false).unwrap();
        fail(
            g.random_uniform(&[2], DType::F32, 5, key).unwrap(),
            &["random_uniform"],
        );
        let state = g.input("state", f32s(&[4, 3])).unwrap();
        let pos = g.constant(rlx_ir::TensorData::I64(vec![1]), &[1]).unwrap();
        fail(g.write_at(state, x, pos, 0).unwrap(), &["write_at"]);
        let q = g.reshape(x, &[1, 1, 2, 3]).unwrap();
        let cache = g.input("cache", f32s(&[1, 4, 2, 3])).unwrap();
        let attended = g.cached_attention(q, cache, cache, pos, None).unwrap();
        fail(attended, &["cached_attention"]);
    }

    #[test]
    fn forward_mode_matches_finite_differences_along_the_tangent() {
        let graph = Graph::new("jvp");
        let f64s = |d: &[usize]| Shape::new(d, DType::F64);
        let x = graph.input("x", f64s(&[3, 4])).unwrap();
        let w = graph.input("w", f64s(&[4, 5])).unwrap();
        let v = graph.input("v", f64s(&[3, 4])).unwrap();
        let h = graph
            .unary(UnaryOp::Tanh, graph.matmul(x, w).unwrap())
            .unwrap();
        let y = graph
            .softmax(graph.binary(BinaryOp::Mul, h, h).unwrap(), -1)
            .unwrap();
        let jv = jvp(&graph, y, x, v).unwrap();
        assert_eq!(graph.shape(jv).unwrap().dims(), &[3, 5]);
        graph.set_outputs(vec![y, jv]);
        let mut seed = 3u64;
        let mut feed: HashMap<String, HostTensor> = HashMap::new();
        for (name, dims) in [("x", [3, 4]), ("w", [4, 5]), ("v", [3, 4])] {
            let data = values(dims.iter().product(), &mut seed);
            feed.insert(name.to_string(), HostTensor::new(f64s(&dims), data));
        }
        let analytic = evaluate(&graph, &mut feed.clone()).unwrap()[1].data.clone();
        let eps = 1e-6;
        let at = |sign: f64| {
            let mut probe = feed.clone();
            let tangent = probe["v"].data.clone();
            for (value, t) in probe.get_mut("x").unwrap().data.iter_mut().zip(tangent) {
                *value += sign * eps * t;
            }
            evaluate(&graph, &mut probe).unwrap()[0].data.clone()
        };
        let (plus, minus) = (at(1.0), at(-1.0));
        for (e, &rule) in analytic.iter().enumerate() {
            let numeric = (plus[e] - minus[e]) / (2.0 * eps);
            assert!(
                (rule - numeric).abs() <= 1e-6 * (1.0 + numeric.abs()),
                "(J v)[{e}] = {rule} by the rule, {numeric} by differences"
            );
        }
        // A tangent of the wrong shape is an error.
        let err = jvp(&graph, y, x, w).unwrap_err().to_string();
        assert!(err.contains("tangent"), "{err}");
    }

    #[test]
    fn a_loss_that_does_not_depend_on_a_node_gives_zeros() {
        let g = Graph::new("zeros");
        let x = g.input("x", Shape::new(&[2, 3], DType::F32)).unwrap();
        let unused = g.input("u", Shape::new(&[4], DType::F32)).unwrap();
        let loss = g.sum(x, &[], false).unwrap();
        let grads = grad(&g, loss, &[x, unused]).unwrap();
        assert_eq!(g.shape(grads[1]).unwrap().dims(), &[4]);
        g.set_outputs(grads.clone());
        let mut feed = HashMap::new();
        feed.insert(
            "x".to_string(),
            HostTensor::new(Shape::new(&[2, 3], DType::F32), vec![1.0; 6]),
        );
        feed.insert(
            "u".to_string(),
            HostTensor::new(Shape::new(&[4], DType::F32), vec![2.0; 4]),
        );
        let out = evaluate(&g, &mut feed).unwrap();
        assert_eq!(out[0].data, vec![1.0; 6]);
        assert_eq!(out[1].data, vec![0.0; 4]);
    }

    #[test]
    fn bad_requests_are_errors_that_name_the_problem() {
        let g = Graph::new("bad");
        let x = g.input("x", Shape::new(&[2, 3], DType::F32)).unwrap();
        // A loss that is not one element.
        let not_scalar = g.unary(UnaryOp::Exp, x).unwrap();
        let err = grad(&g, not_scalar, &[x]).unwrap_err().to_string();
        assert!(err.contains("one element"), "{err}");
        // An id from elsewhere.
        let loss = g.sum(x, &[], false).unwrap();
        let err = grad(&g, loss, &[NodeId::from_index(999)])
            .unwrap_err()
            .to_string();
        assert!(err.contains("%999"), "{err}");
        // A path through a comparison: no gradient, named.
        let positive = g
            .binary(BinaryOp::Gt, x, g.scalar(0.0, DType::F32))
            .unwrap();
        let counted = g
            .sum(g.cast(positive, DType::F32).unwrap(), &[], false)
            .unwrap();
        let err = grad(&g, counted, &[x]).unwrap_err().to_string();
        assert!(err.contains("`gt`") && err.contains("bool"), "{err}");
        // An op with no gradient on the path: named too.
        let pos = g.constant(rlx_ir::TensorData::I64(vec![0]), &[1]).unwrap();
        let written = g.write_at(x, x, pos, 0).unwrap();
        let total = g.sum(written, &[], false).unwrap();
        let err = grad(&g, total, &[x]).unwrap_err().to_string();
        assert!(err.contains("`write_at`"), "{err}");
        // The graph still works: a valid request after the rejected ones.
        let grads = grad(&g, loss, &[x]).unwrap();
        assert_eq!(g.shape(grads[0]).unwrap().dims(), &[2, 3]);
    }
}
