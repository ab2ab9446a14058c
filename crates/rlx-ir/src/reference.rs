//! The reference evaluator: runs a graph on the host with plain loops in `f64`.
//!
//! It defines what every op means; backends are tested against it. It allocates
//! freely and is slow by design.

use crate::ops::{
    attention, conv, elementwise, fused, matmul, misc, norm, quant, reduce, resample, shape_ops,
    state,
};
use crate::{Error, Graph, Op, Result, Shape, TensorData};
use std::collections::HashMap;

/// A host tensor for the reference evaluator: values widened to `f64` (and already
/// rounded to the shape's dtype).
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    /// Dimensions and dtype.
    pub shape: Shape,
    /// Row-major values.
    pub data: Vec<f64>,
}

impl HostTensor {
    /// A tensor from values (rounded to the dtype on construction).
    pub fn new(shape: Shape, data: Vec<f64>) -> HostTensor {
        let dt = shape.dtype();
        let data = data.into_iter().map(|v| dt.round_value(v)).collect();
        HostTensor { shape, data }
    }

    /// A tensor from typed host data.
    pub fn from_data(dims: &[usize], data: &TensorData) -> Result<HostTensor> {
        let shape = Shape::new(dims, data.dtype());
        if data.len() != shape.num_elements() {
            return Err(Error::LengthMismatch {
                kind: "input",
                name: "host tensor".into(),
                expected: shape.num_elements(),
                got: data.len(),
                unit: "elements",
            });
        }
        Ok(HostTensor::new(shape, data.as_ref().to_f64_vec()))
    }

    /// The values in the shape's dtype.
    pub fn to_data(&self) -> TensorData {
        TensorData::from_f64(self.shape.dtype(), &self.data)
    }
}

/// Evaluates one node given its operands (already evaluated) and its output shape.
pub fn eval_node(
    op: &Op,
    inputs: &[&HostTensor],
    out: &Shape,
    constants: &[TensorData],
) -> Result<HostTensor> {
    let x = || inputs[0];
    Ok(match op {
        Op::Input { name } | Op::Param { name } => {
            return Err(Error::invalid(
                "reference",
                format!("source '{name}' has no value"),
            ));
        }
        Op::Constant { id } => {
            let data = constants
                .get(*id)
                .ok_or_else(|| Error::invalid("reference", format!("no constant #{id}")))?;
            HostTensor::from_data(out.dims(), data)?
        }
        Op::Unary(u) => elementwise::eval_unary(*u, x()),
        Op::Binary(b) => elementwise::eval_binary(*b, inputs[0], inputs[1], out),
        Op::Where => elementwise::eval_where(inputs[0], inputs[1], inputs[2], out),
        Op::Cast(dtype) => elementwise::eval_cast(x(), *dtype),
        Op::Reduce { op, axes, .. } => reduce::eval_reduce(*op, axes, x(), out),
        Op::ArgReduce { op, axis, .. } => reduce::eval_arg_reduce(*op, *axis, x(), out),
        Op::Softmax { axis } => norm::eval_softmax(x(), *axis, false),
        Op::LogSoftmax { axis } => norm::eval_softmax(x(), *axis, true),
        Op::MatMul => matmul::eval_matmul(inputs[0], inputs[1], out)?,
        Op::LayerNorm { eps } => norm::eval_layer_norm(x(), inputs[1], Some(inputs[2]), eps.get()),
        Op::RmsNorm { eps } => norm::eval_layer_norm(x(), inputs[1], None, eps.get()),
        Op::NormGrad { eps, centered } => {
            norm::eval_norm_grad(x(), Some(inputs[1]), inputs[2], eps.get(), *centered, out)
        }
        Op::NormScaleGrad { eps, centered } => {
            norm::eval_norm_grad(x(), None, inputs[1], eps.get(), *centered, out)
        }
        Op::Reshape { .. } => HostTensor::new(out.clone(), x().data.clone()),
        Op::Permute { perm } => shape_ops::eval_permute(perm, x(), out),
        Op::Slice { axes } => shape_ops::eval_slice(axes, x(), out),
        Op::Concat { axis } => shape_ops::eval_concat(*axis, inputs, out),
        Op::Gather { axis } => shape_ops::eval_gather(*axis, inputs[0], inputs[1], out)?,
        Op::Interpolate { axis } => {
            resample::eval_interpolate(*axis, inputs[0], inputs[1], inputs[2], out)?
        }
        Op::Expand { .. } => shape_ops::eval_expand(x(), out),
        Op::Pad { pads, mode } => shape_ops::eval_pad(pads, *mode, x(), out),
        Op::Tile { .. } => shape_ops::eval_tile(x(), out),
        Op::Range { start, step, .. } => misc::eval_range(start.get(), step.get(), out),
        Op::RandomUniform { seed, .. } => misc::eval_random_uniform(*seed, x(), out),
        Op::Cumsum {
            axis,
            exclusive,
            reverse,
        } => misc::eval_cumsum(*axis, *exclusive, *reverse, x()),
        Op::TopK {
            k,
            axis,
            largest,
            output,
        } => misc::eval_topk(*k, *axis, *largest, *output, x(), out),
        Op::OneHot { depth, .. } => misc::eval_one_hot(*depth, x(), out),
        Op::Conv2d { window, groups } => conv::eval_conv2d(window, *groups, inputs, out),
        Op::MaxPool2d { window } => conv::eval_pool(window, true, false, x(), out),
        Op::TiledMaxPoolGrad { kernel } => {
            conv::eval_tiled_max_pool_grad(*kernel, x(), inputs[1], inputs[2])
        }
        Op::AvgPool2d {
            window,
            count_include_pad,
        } => conv::eval_pool(window, false, *count_include_pad, x(), out),
        Op::Attention {
            scale,
            causal,
            seq_major,
        } => attention::eval_attention(scale.get(), *causal, *seq_major, inputs, out),
        Op::Rope { style } => attention::eval_rope(*style, inputs[0], inputs[1], inputs[2]),
        Op::WriteAt { axis } => state::eval_write_at(*axis, inputs[0], inputs[1], inputs[2])?,
        Op::FusedMatMul {
            alpha,
            transpose_a,
            transpose_b,
            bias,
            activation,
            residual,
        } => fused::eval_fused_matmul(
            alpha.get(),
            [*transpose_a, *transpose_b],
            (*bias, *activation, *residual),
            inputs,
            out,
        )?,
        Op::FusedConv2d {
            window,
            groups,
            fusion,
        } => fused::eval_fused_conv2d(window, *groups, *fusion, inputs, out),
        Op::Elementwise { steps } => fused::eval_elementwise(steps, inputs, out),
        Op::QuantMatMul { format } => quant::eval_quant_matmul(*format, inputs[0], inputs[1], out)?,
        Op::Dequantize { format } => quant::eval_dequantize(*format, x(), out)?,
        Op::CachedAttention { scale } => {
            attention::eval_cached_attention(scale.get(), inputs, out)?
        }
    })
}

/// Runs a whole graph. `values` supplies every input and param by name; inputs that
/// are written by `write_at` are updated in `values` so that state persists across
/// calls, as a bound handle does on a compiled graph.
pub fn evaluate(
    graph: &Graph,
    values: &mut HashMap<String, HostTensor>,
) -> Result<Vec<HostTensor>> {
    graph.verify()?;
    let nodes = graph.nodes();
    let constants = graph.constants();
    let mut results: Vec<Option<HostTensor>> = vec![None; nodes.len()];
    for (i, node) in nodes.iter().enumerate() {
        let value = match &node.op {
            Op::Input { name } | Op::Param { name } => {
                let v = values.get(name).ok_or_else(|| Error::MissingInput {
                    name: name.clone(),
                    shape: node.shape.clone(),
                })?;
                if v.shape != node.shape {
                    return Err(Error::invalid(
                        name.clone(),
                        format!("expected {}, got {}", node.shape, v.shape),
                    ));
                }
                v.clone()
            }
            op => {
                let args: Vec<&HostTensor> = node
                    .inputs
                    .iter()
                    .map(|id| {
                        results[id.index()]
                            .as_ref()
                            .ok_or_else(|| Error::invalid("reference", "operand not evaluated"))
                    })
                    .collect::<Result<_>>()?;
                let out = eval_node(op, &args, &node.shape, &constants)?;
                if let Op::WriteAt { .. } = op
                    && let Op::Input { name } = &nodes[node.inputs[0].index()].op
                {
                    values.insert(name.clone(), out.clone());
                }
                out
            }
        };
        results[i] = Some(value);
    }
    graph
        .outputs()
        .iter()
        .map(|id| {
            results
                .get(id.index())
                .cloned()
                .flatten()
                .ok_or_else(|| Error::invalid("reference", format!("output {id} missing")))
        })
        .collect()
}
