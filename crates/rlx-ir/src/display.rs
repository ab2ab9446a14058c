//! Human-readable printing of graphs.

use crate::{Graph, Op};
use std::fmt;

/// The attribute part of an op, as printed after its name.
pub fn op_attributes(op: &Op) -> String {
    match op {
        Op::Input { name } | Op::Param { name } => format!("\"{name}\""),
        Op::Constant { id } => format!("#{id}"),
        Op::Unary(_) | Op::Binary(_) | Op::Where | Op::MatMul => String::new(),
        Op::Cast(d) => format!("to={d}"),
        Op::Reduce { axes, keepdims, .. } => format!("axes={axes:?} keepdims={keepdims}"),
        Op::ArgReduce { axis, keepdims, .. } => format!("axis={axis} keepdims={keepdims}"),
        Op::Softmax { axis }
        | Op::LogSoftmax { axis }
        | Op::Concat { axis }
        | Op::Gather { axis }
        | Op::Interpolate { axis }
        | Op::WriteAt { axis } => {
            format!("axis={axis}")
        }
        Op::LayerNorm { eps } | Op::RmsNorm { eps } => format!("eps={}", eps.get()),
        Op::NormGrad { eps, centered } | Op::NormScaleGrad { eps, centered } => {
            format!(
                "eps={} {}",
                eps.get(),
                if *centered { "layer" } else { "rms" }
            )
        }
        Op::Reshape { dims } | Op::Expand { dims } => format!("dims={dims:?}"),
        Op::Permute { perm } => format!("perm={perm:?}"),
        Op::Slice { axes } => {
            let parts: Vec<String> = axes
                .iter()
                .map(|s| format!("{}+{}x{}", s.start, s.len, s.step))
                .collect();
            format!("[{}]", parts.join(", "))
        }
        Op::Pad { pads, mode } => format!("pads={pads:?} mode={mode:?}"),
        Op::Tile { reps } => format!("reps={reps:?}"),
        Op::Range {
            start, step, len, ..
        } => format!("start={:?} step={:?} len={len}", start, step),
        Op::RandomUniform { seed, dims, .. } => format!("seed={seed} dims={dims:?}"),
        Op::Cumsum {
            axis,
            exclusive,
            reverse,
        } => format!("axis={axis} exclusive={exclusive} reverse={reverse}"),
        Op::TopK {
            k, axis, largest, ..
        } => format!("k={k} axis={axis} largest={largest}"),
        Op::OneHot { depth, .. } => format!("depth={depth}"),
        Op::Conv2d { window, groups } => format!(
            "stride={:?} pad={:?} dilation={:?} groups={groups}",
            window.stride, window.padding, window.dilation
        ),
        Op::TiledMaxPoolGrad { kernel } => format!("kernel={kernel:?}"),
        Op::MaxPool2d { window } => format!(
            "kernel={:?} stride={:?} pad={:?}",
            window.kernel, window.stride, window.padding
        ),
        Op::AvgPool2d {
            window,
            count_include_pad,
        } => format!(
            "kernel={:?} stride={:?} pad={:?} count_include_pad={count_include_pad}",
            window.kernel, window.stride, window.padding
        ),
        Op::Attention {
            scale,
            causal,
            seq_major,
        } => format!(
            "scale={:.6} causal={causal}{}",
            scale.get(),
            if *seq_major { " seq_major" } else { "" }
        ),
        Op::Rope { style } => format!("style={style:?}"),
        Op::QuantMatMul { format } | Op::Dequantize { format } => format!("format={format}"),
        Op::CachedAttention { scale } => format!("scale={:.6}", scale.get()),
        Op::FusedMatMul {
            alpha,
            transpose_a,
            transpose_b,
            bias,
            activation,
            residual,
        } => {
            let mut parts = Vec::new();
            if *transpose_a {
                parts.push("a^T".to_string());
            }
            if *transpose_b {
                parts.push("b^T".to_string());
            }
            if alpha.get() != 1.0 {
                parts.push(format!("alpha={}", alpha.get()));
            }
            if *bias {
                parts.push("+bias".to_string());
            }
            if let Some(act) = activation {
                parts.push(act.name().to_string());
            }
            if *residual {
                parts.push("+residual".to_string());
            }
            parts.join(" ")
        }
        Op::FusedConv2d {
            window,
            groups,
            fusion: f,
        } => {
            let mut text = format!(
                "stride={:?} pad={:?} dilation={:?} groups={groups}",
                window.stride, window.padding, window.dilation
            );
            if f.input_affine {
                text.push_str(" input*scale+shift");
            }
            if let Some(act) = f.input_activation {
                text.push_str(" input ");
                text.push_str(act.name());
            }
            if f.bias {
                text.push_str(" +bias");
            }
            if let Some(act) = f.activation {
                text.push(' ');
                text.push_str(act.name());
            }
            if f.residual {
                text.push_str(" +residual");
            }
            if f.channel_affine {
                text.push_str(" *scale+shift");
            }
            if let Some(act) = f.post_activation {
                text.push(' ');
                text.push_str(act.name());
            }
            text
        }
        Op::Elementwise { steps } => {
            let parts: Vec<String> = steps
                .iter()
                .map(|s| match s {
                    crate::EwStep::Unary(op, a) => format!("{}(r{a})", op.name()),
                    crate::EwStep::Binary(op, a, b) => format!("{}(r{a},r{b})", op.name()),
                })
                .collect();
            parts.join("; ")
        }
    }
}

impl fmt::Display for Graph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "graph \"{}\" ({} nodes)", self.name(), self.len())?;
        for (i, node) in self.nodes().iter().enumerate() {
            let args: Vec<String> = node.inputs.iter().map(|a| a.to_string()).collect();
            let attrs = op_attributes(&node.op);
            write!(f, "  %{i:<4} = {}", node.op.name())?;
            if !args.is_empty() {
                write!(f, "({})", args.join(", "))?;
            }
            if !attrs.is_empty() {
                write!(f, " {attrs}")?;
            }
            writeln!(f, " : {}", node.shape)?;
        }
        let outs: Vec<String> = self.outputs().iter().map(|o| o.to_string()).collect();
        write!(f, "  outputs: {}", outs.join(", "))
    }
}
