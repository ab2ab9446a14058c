//! Shape and dtype inference: the one dispatch from an op to its family's rule.

use crate::ops::{
    attention, conv, elementwise, fused, matmul, misc, norm, quant, reduce, resample, shape_ops,
    state,
};
use crate::{Error, Op, Result, Shape};

/// The operand counts an op accepts (inclusive range).
fn arity(op: &Op) -> (usize, usize) {
    match op {
        Op::Input { .. } | Op::Param { .. } | Op::Constant { .. } | Op::Range { .. } => (0, 0),
        Op::Binary(_)
        | Op::MatMul
        | Op::Gather { .. }
        | Op::RmsNorm { .. }
        | Op::NormScaleGrad { .. } => (2, 2),
        Op::Where
        | Op::LayerNorm { .. }
        | Op::Rope { .. }
        | Op::WriteAt { .. }
        | Op::NormGrad { .. }
        | Op::TiledMaxPoolGrad { .. }
        | Op::Interpolate { .. } => (3, 3),
        Op::Conv2d { .. } => (2, 3),
        Op::Attention { .. } => (3, 4),
        Op::QuantMatMul { .. } => (2, 2),
        Op::CachedAttention { .. } => (4, 4),
        Op::Concat { .. } | Op::Elementwise { .. } => (1, usize::MAX),
        Op::FusedMatMul { .. } => (2, 4),
        Op::FusedConv2d { .. } => (2, 8),
        _ => (1, 1),
    }
}

/// Infers the output shape of `op` applied to operands of the given shapes, or an
/// error naming the op and the offending shapes.
pub fn infer_shape(op: &Op, inputs: &[&Shape]) -> Result<Shape> {
    let (lo, hi) = arity(op);
    if inputs.len() < lo || inputs.len() > hi {
        return Err(Error::invalid(
            op.name(),
            format!("takes {lo}..={hi} operands, got {}", inputs.len()),
        ));
    }
    let x = || inputs[0];
    match op {
        Op::Input { .. } | Op::Param { .. } | Op::Constant { .. } => Err(Error::invalid(
            op.name(),
            "source nodes are created with input/param/constant, not push",
        )),
        Op::Unary(u) => elementwise::infer_unary(*u, x()),
        Op::Binary(b) => elementwise::infer_binary(*b, inputs[0], inputs[1]),
        Op::Where => elementwise::infer_where(inputs[0], inputs[1], inputs[2]),
        Op::Cast(dtype) => Ok(x().with_dtype(*dtype)),
        Op::Reduce { op, axes, keepdims } => reduce::infer_reduce(*op, axes, *keepdims, x()),
        Op::ArgReduce { axis, keepdims, .. } => reduce::infer_arg_reduce(*axis, *keepdims, x()),
        Op::Softmax { axis } => norm::infer_softmax("softmax", *axis, x()),
        Op::LogSoftmax { axis } => norm::infer_softmax("log_softmax", *axis, x()),
        Op::MatMul => matmul::infer_matmul(inputs[0], inputs[1]),
        Op::LayerNorm { .. } => norm::infer_norm("layer_norm", x(), &inputs[1..]),
        Op::RmsNorm { .. } => norm::infer_norm("rms_norm", x(), &inputs[1..]),
        Op::NormGrad { .. } => norm::infer_norm_grad(inputs[0], inputs[1], inputs[2]),
        Op::NormScaleGrad { .. } => norm::infer_norm_scale_grad(inputs[0], inputs[1]),
        Op::Reshape { dims } => shape_ops::infer_reshape(dims, x()),
        Op::Permute { perm } => shape_ops::infer_permute(perm, x()),
        Op::Slice { axes } => shape_ops::infer_slice(axes, x()),
        Op::Concat { axis } => shape_ops::infer_concat(*axis, inputs),
        Op::Gather { axis } => shape_ops::infer_gather(*axis, inputs[0], inputs[1]),
        Op::Interpolate { axis } => {
            resample::infer_interpolate(*axis, inputs[0], inputs[1], inputs[2])
        }
        Op::Expand { dims } => shape_ops::infer_expand(dims, x()),
        Op::Pad { pads, mode } => shape_ops::infer_pad(pads, *mode, x()),
        Op::Tile { reps } => shape_ops::infer_tile(reps, x()),
        Op::Range { len, dtype, .. } => {
            if !dtype.is_numeric() {
                return Err(Error::dtype("range", "a numeric type", *dtype));
            }
            Ok(Shape::new(&[*len], *dtype))
        }
        Op::RandomUniform { dims, dtype, .. } => misc::infer_random_uniform(dims, *dtype, x()),
        Op::Cumsum { axis, .. } => {
            crate::ops::require_numeric("cumsum", x())?;
            if *axis >= x().rank() {
                return Err(Error::invalid(
                    "cumsum",
                    format!("axis {axis} out of range for {}", x()),
                ));
            }
            Ok(x().clone())
        }
        Op::TopK {
            k, axis, output, ..
        } => misc::infer_topk(*k, *axis, *output, x()),
        Op::OneHot { depth, dtype } => misc::infer_one_hot(*depth, *dtype, x()),
        Op::Conv2d { window, groups } => conv::infer_conv2d(window, *groups, inputs),
        Op::MaxPool2d { window } => conv::infer_pool("max_pool2d", window, x()),
        Op::TiledMaxPoolGrad { kernel } => {
            conv::infer_tiled_max_pool_grad(*kernel, inputs[0], inputs[1], inputs[2])
        }
        Op::AvgPool2d { window, .. } => conv::infer_pool("avg_pool2d", window, x()),
        Op::Attention { seq_major, .. } => attention::infer_attention(inputs, *seq_major),
        Op::FusedMatMul {
            transpose_a,
            transpose_b,
            bias,
            residual,
            activation,
            ..
        } => fused::infer_fused_matmul(
            [*transpose_a, *transpose_b],
            *bias,
            *residual,
            *activation,
            inputs,
        ),
        Op::FusedConv2d {
            window,
            groups,
            fusion,
        } => fused::infer_fused_conv2d(window, *groups, *fusion, inputs),
        Op::Elementwise { steps } => fused::infer_elementwise(steps, inputs),
        Op::Rope { .. } => attention::infer_rope(inputs[0], inputs[1], inputs[2]),
        Op::WriteAt { axis } => state::infer_write_at(*axis, inputs[0], inputs[1], inputs[2]),
        Op::QuantMatMul { format } => quant::infer_quant_matmul(*format, inputs[0], inputs[1]),
        Op::Dequantize { format } => quant::infer_dequantize(*format, x()),
        Op::CachedAttention { .. } => attention::infer_cached_attention(inputs),
    }
}
