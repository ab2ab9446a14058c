//! Composite ops written in primitives. A composite (softmax, the norms, attention,
//! rotary embedding, the fused forms, the GELU and SiLU activations) has a kernel on a
//! backend that runs it natively; on any other backend the compiler replaces it with
//! the primitives here, so a new backend can start with primitives only and a new
//! composite runs everywhere before anyone writes its kernel.

use crate::{BinaryOp, DType, EwStep, Graph, NodeId, Op, Result, RopeStyle, UnaryOp};

/// `sqrt(2 / pi)`.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;

/// Whether `op` is a composite, that is, has a decomposition into primitives.
pub fn is_composite(op: &Op) -> bool {
    matches!(
        op,
        Op::Softmax { .. }
            | Op::LogSoftmax { .. }
            | Op::LayerNorm { .. }
            | Op::RmsNorm { .. }
            | Op::NormGrad { .. }
            | Op::NormScaleGrad { .. }
            | Op::TiledMaxPoolGrad { .. }
            | Op::Interpolate { .. }
            | Op::Attention { .. }
            | Op::Rope { .. }
            | Op::FusedMatMul { .. }
            | Op::FusedConv2d { .. }
            | Op::Elementwise { .. }
            | Op::Unary(
                UnaryOp::Gelu
                    | UnaryOp::GeluTanh
                    | UnaryOp::Silu
                    | UnaryOp::Relu6
                    | UnaryOp::HardSwish
            )
    )
}

/// A norm's normalized input `x̂` and the reciprocal `r` of its root (one per row,
/// kept as a last axis of 1): `x̂ = (x - mean) r` when `centered`, else `x r`, with
/// `r = 1 / sqrt(var + eps)` (the mean square without centering). Shared by the
/// decompositions of the two norm gradients.
pub fn norm_statistics(g: &Graph, x: NodeId, eps: f64, centered: bool) -> Result<(NodeId, NodeId)> {
    let dtype = g.shape(x)?.dtype();
    let centred = if centered {
        g.sub(x, g.mean(x, &[-1], true)?)?
    } else {
        x
    };
    let variance = g.mean(g.mul(centred, centred)?, &[-1], true)?;
    let r = g.unary(UnaryOp::Rsqrt, g.add(variance, g.scalar(eps, dtype))?)?;
    Ok((g.mul(centred, r)?, r))
}

/// An attention's scores before the softmax, `q kᵀ scale` for head-major `q` and `k`
/// (`k` with as many heads as `q`), with a bool mask's false entries and (if
/// `causal`) the keys after each query's position at -inf, or a float mask added.
/// Query `i` sees key `j` when `j <= i + (sk - sq)`. Shared by the decomposition and
/// the gradient rule, which recomputes the probabilities.
pub fn attention_scores(
    g: &Graph,
    (q, k, scale): (NodeId, NodeId, f64),
    mask: Option<NodeId>,
    causal: bool,
) -> Result<NodeId> {
    let dtype = g.shape(q)?.dtype();
    let (sq, sk) = (g.shape(q)?.dim(2), g.shape(k)?.dim(2));
    let mut s = g.mul(
        g.matmul(q, g.permute(k, &[0, 1, 3, 2])?)?,
        g.scalar(scale, dtype),
    )?;
    let neg = g.scalar(f64::NEG_INFINITY, dtype);
    if let Some(mask) = mask {
        s = if g.shape(mask)?.dtype() == DType::Bool {
            g.select(mask, s, neg)?
        } else {
            g.add(s, mask)?
        };
    }
    if causal {
        let keep: Vec<bool> = (0..sq)
            .flat_map(|i| (0..sk).map(move |j| j + sq <= i + sk))
            .collect();
        let keep = g.constant(crate::TensorData::Bool(keep), &[sq, sk])?;
        s = g.select(keep, s, neg)?;
    }
    Ok(s)
}

/// Builds `op` applied to `inputs` out of primitives in `g`, or `None` when `op` is a
/// primitive. The result has the shape and dtype the composite would have.
pub fn decompose(g: &Graph, op: &Op, inputs: &[NodeId]) -> Result<Option<NodeId>> {
    let Some(&first) = inputs.first() else {
        // Every composite has operands; an op without any is a primitive.
        return Ok(None);
    };
    let dtype = g.shape(first)?.dtype();
    let half = |d: crate::DType| matches!(d, crate::DType::F16 | crate::DType::BF16);
    if half(dtype)
        && is_composite(op)
        && !matches!(
            op,
            Op::Elementwise { .. } | Op::FusedMatMul { .. } | Op::FusedConv2d { .. }
        )
    {
        // A half-precision composite is computed in f32 and rounded once, as its own
        // kernel would: rounding after every primitive step loses several bits.
        let wide = inputs
            .iter()
            .map(|&x| {
                if half(g.shape(x)?.dtype()) {
                    g.cast(x, crate::DType::F32)
                } else {
                    Ok(x)
                }
            })
            .collect::<Result<Vec<_>>>()?;
        return match decompose(g, op, &wide)? {
            Some(y) => Ok(Some(g.cast(y, dtype)?)),
            None => Ok(None),
        };
    }
    let c = |v: f64| g.scalar(v, dtype);
    Ok(Some(match op {
        Op::Softmax { axis } => softmax(g, inputs[0], *axis, false)?,
        Op::LogSoftmax { axis } => softmax(g, inputs[0], *axis, true)?,
        Op::LayerNorm { eps } => {
            let x = inputs[0];
            let mean = g.mean(x, &[-1], true)?;
            let d = g.sub(x, mean)?;
            let var = g.mean(g.mul(d, d)?, &[-1], true)?;
            let inv = g.unary(UnaryOp::Rsqrt, g.add(var, c(eps.get()))?)?;
            g.add(g.mul(g.mul(d, inv)?, inputs[1])?, inputs[2])?
        }
        Op::RmsNorm { eps } => {
            let x = inputs[0];
            let ms = g.mean(g.mul(x, x)?, &[-1], true)?;
            let inv = g.unary(UnaryOp::Rsqrt, g.add(ms, c(eps.get()))?)?;
            g.mul(g.mul(x, inv)?, inputs[1])?
        }
        Op::NormGrad { eps, centered } => {
            let (x, gamma, dy) = (inputs[0], inputs[1], inputs[2]);
            let (normed, r) = norm_statistics(g, x, eps.get(), *centered)?;
            let scaled = g.mul(dy, gamma)?;
            let mean = |a| g.mean(a, &[-1], true);
            let mut inner = g.sub(scaled, g.mul(normed, mean(g.mul(scaled, normed)?)?)?)?;
            if *centered {
                inner = g.sub(inner, mean(scaled)?)?;
            }
            g.mul(r, inner)?
        }
        Op::NormScaleGrad { eps, centered } => {
            let (x, dy) = (inputs[0], inputs[1]);
            let (normed, _) = norm_statistics(g, x, eps.get(), *centered)?;
            let rank = g.shape(x)?.rank();
            let terms = g.mul(dy, normed)?;
            if rank == 1 {
                // One row: nothing to sum (a sum over no axes would sum them all).
                terms
            } else {
                let rows: Vec<isize> = (0..rank as isize - 1).collect();
                g.sum(terms, &rows, false)?
            }
        }
        Op::TiledMaxPoolGrad { kernel } => {
            tiled_max_pool_grad(g, *kernel, (inputs[0], inputs[1], inputs[2]))?
        }
        Op::Interpolate { axis } => crate::ops::resample::decompose_interpolate(
            g,
            *axis,
            (inputs[0], inputs[1], inputs[2]),
        )?,
        Op::Unary(
            u @ (UnaryOp::Gelu
            | UnaryOp::GeluTanh
            | UnaryOp::Silu
            | UnaryOp::Relu6
            | UnaryOp::HardSwish),
        ) => activation(g, *u, inputs[0])?,
        Op::FusedMatMul {
            alpha,
            transpose_a,
            transpose_b,
            bias,
            activation: act,
            residual,
        } => {
            // A half-precision weight under an f32 activation (the fused kernel reads
            // it as it is) is widened first: the primitive product takes one dtype.
            let out_dtype = g.shape(inputs[0])?.dtype();
            let w = if g.shape(inputs[1])?.dtype() != out_dtype {
                g.cast(inputs[1], out_dtype)?
            } else {
                inputs[1]
            };
            let read = |x: NodeId, swap: bool| if swap { g.transpose(x, -1, -2) } else { Ok(x) };
            let mut y = g.matmul(read(inputs[0], *transpose_a)?, read(w, *transpose_b)?)?;
            if alpha.get() != 1.0 {
                y = g.mul(y, g.scalar(alpha.get(), out_dtype))?;
            }
            let mut next = 2;
            if *bias {
                y = g.add(y, inputs[next])?;
                next += 1;
            }
            if let Some(a) = act {
                y = activation(g, *a, y)?;
            }
            if *residual {
                y = g.add(y, inputs[next])?;
            }
            y
        }
        Op::FusedConv2d {
            window,
            groups,
            fusion: f,
        } => {
            let mut conv_inputs = inputs[..f.residual_at()].to_vec();
            if f.input_affine {
                let at = f.input_scale_at();
                conv_inputs[0] = g.add(g.mul(conv_inputs[0], inputs[at])?, inputs[at + 1])?;
            }
            if let Some(a) = f.input_activation {
                conv_inputs[0] = activation(g, a, conv_inputs[0])?;
            }
            let conv = Op::Conv2d {
                window: *window,
                groups: *groups,
            };
            let mut y = g.push(conv, &conv_inputs)?;
            if let Some(a) = f.activation {
                y = activation(g, a, y)?;
            }
            if f.residual {
                y = g.add(y, inputs[f.residual_at()])?;
            }
            if f.channel_affine {
                y = g.mul(y, inputs[f.scale_at()])?;
                y = g.add(y, inputs[f.scale_at() + 1])?;
            }
            if let Some(a) = f.post_activation {
                y = activation(g, a, y)?;
            }
            y
        }
        Op::Elementwise { steps } => {
            let mut regs: Vec<NodeId> = inputs.to_vec();
            for step in steps {
                let v = match *step {
                    EwStep::Unary(u, a) => {
                        let x = regs[usize::from(a)];
                        match u {
                            UnaryOp::Gelu
                            | UnaryOp::GeluTanh
                            | UnaryOp::Silu
                            | UnaryOp::Relu6
                            | UnaryOp::HardSwish => activation(g, u, x)?,
                            other => g.unary(other, x)?,
                        }
                    }
                    EwStep::Binary(b, l, r) => {
                        g.binary(b, regs[usize::from(l)], regs[usize::from(r)])?
                    }
                };
                regs.push(v);
            }
            *regs.last().unwrap_or(&inputs[0])
        }
        Op::Attention {
            scale,
            causal,
            seq_major,
        } => attention(g, inputs, scale.get(), *causal, *seq_major)?,
        Op::Rope { style } => rope(g, *style, inputs[0], inputs[1], inputs[2])?,
        _ => return Ok(None),
    }))
}

/// [`Op::TiledMaxPoolGrad`] in primitives: in the view `[n, c, oh, kh, ow, kw]` of
/// the input the pooled values broadcast over their windows, so the hits, their
/// count and the shares are a comparison and ops on broadcast operands, with no
/// copies of the spread maxima. (A float form such as `1 - sign(max - x)` would be
/// NaN at an infinite maximum.)
fn tiled_max_pool_grad(
    g: &Graph,
    [kh, kw]: [usize; 2],
    (x, y, dy): (NodeId, NodeId, NodeId),
) -> Result<NodeId> {
    let xs = g.shape(x)?;
    let (n, c, h, w) = (xs.dim(0), xs.dim(1), xs.dim(2), xs.dim(3));
    let (oh, ow) = (h / kh, w / kw);
    let windows = g.reshape(x, &[n, c, oh, kh, ow, kw])?;
    let pooled = |t: NodeId| g.reshape(t, &[n, c, oh, 1, ow, 1]);
    let hit = g.cast(g.binary(BinaryOp::Eq, windows, pooled(y)?)?, xs.dtype())?;
    let ties = g.sum(g.sum(hit, &[5], true)?, &[3], true)?;
    let share = g.binary(BinaryOp::Div, pooled(dy)?, ties)?;
    let dx = g.mul(hit, share)?;
    g.reshape(dx, &[n, c, h, w])
}

/// `u(x)`, the activations with a definition in primitives written out.
fn activation(g: &Graph, u: UnaryOp, x: NodeId) -> Result<NodeId> {
    let dtype = g.shape(x)?.dtype();
    let c = |v: f64| g.scalar(v, dtype);
    match u {
        UnaryOp::Gelu => {
            let e = g.unary(UnaryOp::Erf, g.mul(x, c(std::f64::consts::FRAC_1_SQRT_2))?)?;
            g.mul(g.mul(x, c(0.5))?, g.add(e, c(1.0))?)
        }
        UnaryOp::GeluTanh => {
            let cube = g.mul(g.mul(x, x)?, x)?;
            let inner = g.mul(g.add(x, g.mul(cube, c(0.044715))?)?, c(SQRT_2_OVER_PI))?;
            let t = g.unary(UnaryOp::Tanh, inner)?;
            g.mul(g.mul(x, c(0.5))?, g.add(t, c(1.0))?)
        }
        UnaryOp::Silu => g.mul(x, g.unary(UnaryOp::Sigmoid, x)?),
        UnaryOp::Relu6 => g.binary(BinaryOp::Min, g.binary(BinaryOp::Max, x, c(0.0))?, c(6.0)),
        UnaryOp::HardSwish => {
            let gate = activation(g, UnaryOp::Relu6, g.add(x, c(3.0))?)?;
            g.mul(x, g.div(gate, c(6.0))?)
        }
        other => g.unary(other, x),
    }
}

/// Softmax (or log-softmax) along `axis`, shifted by the maximum. A slice that is all
/// `-inf` gives zeros (log-softmax: `-inf`) instead of NaN.
fn softmax(g: &Graph, x: NodeId, axis: usize, log: bool) -> Result<NodeId> {
    let shape = g.shape(x)?;
    let dtype = shape.dtype();
    if shape.num_elements() == 0 {
        // Nothing to compute, and no maximum to shift by over an empty axis: the
        // result is as empty as `x`.
        return g.reshape(x, shape.dims());
    }
    let a = axis as isize;
    let m = g.reduce_max(x, &[a], true)?;
    let none = g.binary(BinaryOp::Eq, m, g.scalar(f64::NEG_INFINITY, dtype))?;
    let m = g.select(none, g.scalar(0.0, dtype), m)?;
    let shifted = g.sub(x, m)?;
    let e = g.exp(shifted)?;
    let s = g.sum(e, &[a], true)?;
    if log {
        return g.sub(shifted, g.log(s)?);
    }
    let empty = g.binary(BinaryOp::Eq, s, g.scalar(0.0, dtype))?;
    let s = g.select(empty, g.scalar(1.0, dtype), s)?;
    g.div(e, s)
}

/// `[B, S, H, D] <-> [B, H, S, D]`.
const HEAD_SWAP: [usize; 4] = [0, 2, 1, 3];

fn attention(
    g: &Graph,
    inputs: &[NodeId],
    scale: f64,
    causal: bool,
    seq_major: bool,
) -> Result<NodeId> {
    let head_major = |x: NodeId| {
        if seq_major {
            g.permute(x, &HEAD_SWAP)
        } else {
            Ok(x)
        }
    };
    let (q, mut k, mut v) = (
        head_major(inputs[0])?,
        head_major(inputs[1])?,
        head_major(inputs[2])?,
    );
    let (hq, hkv) = (g.shape(q)?.dim(1), g.shape(k)?.dim(1));
    if hq != hkv {
        // Each key/value head serves `hq / hkv` query heads.
        let group = hq / hkv.max(1);
        let heads: Vec<i64> = (0..hq).map(|h| (h / group) as i64).collect();
        let idx = g.constant(crate::TensorData::I64(heads), &[hq])?;
        k = g.gather(k, idx, 1)?;
        v = g.gather(v, idx, 1)?;
    }
    let s = attention_scores(g, (q, k, scale), inputs.get(3).copied(), causal)?;
    let p = softmax(g, s, 3, false)?;
    let out = g.matmul(p, v)?;
    if seq_major {
        g.permute(out, &HEAD_SWAP)
    } else {
        Ok(out)
    }
}

fn rope(g: &Graph, style: RopeStyle, x: NodeId, cos: NodeId, sin: NodeId) -> Result<NodeId> {
    let dims = g.shape(x)?.dims().to_vec();
    let d = *dims.last().unwrap_or(&0);
    let half = d / 2;
    let last = dims.len() as isize - 1;
    let rotate = |a: NodeId, b: NodeId, c: NodeId, s: NodeId| -> Result<(NodeId, NodeId)> {
        Ok((
            g.sub(g.mul(a, c)?, g.mul(b, s)?)?,
            g.add(g.mul(a, s)?, g.mul(b, c)?)?,
        ))
    };
    match style {
        RopeStyle::HalfSplit => {
            let a = g.slice(x, last, 0, half as isize, 1)?;
            let b = g.slice(x, last, half as isize, d as isize, 1)?;
            let (ra, rb) = rotate(a, b, cos, sin)?;
            g.concat(&[ra, rb], last)
        }
        RopeStyle::Interleaved => {
            let mut pairs = dims.clone();
            *pairs.last_mut().unwrap_or(&mut 0) = half;
            pairs.push(2);
            let xp = g.reshape(x, &pairs)?;
            let end = pairs.len() as isize - 1;
            let a = g.slice(xp, end, 0, 1, 1)?;
            let b = g.slice(xp, end, 1, 2, 1)?;
            let (c, s) = (g.unsqueeze(cos, &[-1])?, g.unsqueeze(sin, &[-1])?);
            let (ra, rb) = rotate(a, b, c, s)?;
            g.reshape(g.concat(&[ra, rb], end)?, &dims)
        }
    }
}

/// Every node of `graph` whose op `keep` rejects and that decomposes, replaced by its
/// decomposition; everything else copied as it is. The result reads the same inputs
/// and params and computes the same outputs.
pub fn decompose_graph(graph: &Graph, keep: &dyn Fn(&Op) -> bool) -> Result<Graph> {
    let g = Graph::new(graph.name());
    let nodes = graph.nodes();
    let constants = graph.constants();
    let mut map: Vec<NodeId> = Vec::with_capacity(nodes.len());
    for n in nodes.iter() {
        let inputs: Vec<NodeId> = n.inputs.iter().map(|i| map[i.index()]).collect();
        let id = match &n.op {
            Op::Input { name } => g.input(name.clone(), n.shape.clone())?,
            Op::Param { name } => g.param(name.clone(), n.shape.clone())?,
            Op::Constant { id } => {
                let data = constants.get(*id).ok_or_else(|| {
                    crate::Error::invalid("constant", format!("#{id} is missing"))
                })?;
                g.constant(data.clone(), n.shape.dims())?
            }
            op if !keep(op) => match decompose(&g, op, &inputs)? {
                Some(id) => id,
                None => g.push(op.clone(), &inputs)?,
            },
            op => g.push(op.clone(), &inputs)?,
        };
        map.push(id);
    }
    g.set_outputs(graph.outputs().iter().map(|o| map[o.index()]).collect());
    Ok(g)
}

/// The ops a backend runs natively; the compiler decomposes the composites outside
/// this set, and a primitive outside it is a compile error.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum NativeOps {
    /// Every op (the CPU).
    #[default]
    All,
    /// The primitives only: every composite is decomposed.
    Primitives,
    /// The ops named (as [`Op::name`] gives them) and nothing else.
    Only(std::collections::BTreeSet<String>),
}

impl NativeOps {
    /// Whether `op` runs natively.
    pub fn runs(&self, op: &Op) -> bool {
        match self {
            NativeOps::All => true,
            NativeOps::Primitives => !is_composite(op),
            NativeOps::Only(names) => {
                matches!(
                    op,
                    Op::Input { .. } | Op::Param { .. } | Op::Constant { .. }
                ) || names.contains(&op.name())
            }
        }
    }
}
