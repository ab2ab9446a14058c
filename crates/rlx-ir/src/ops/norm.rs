//! Softmax, log-softmax, LayerNorm and RMSNorm.

use super::{mismatch, ravel, require_float, resolve_axis, same_dtype, unravel};
use crate::reference::HostTensor;
use crate::{Error, F64Bits, Graph, NodeId, Op, Result, Shape};

impl Graph {
    /// `exp(x - max) / sum(exp(x - max))` along `axis`.
    pub fn softmax(&self, x: NodeId, axis: isize) -> Result<NodeId> {
        let axis = resolve_axis("softmax", axis, self.shape(x)?.rank())?;
        self.push(Op::Softmax { axis }, &[x])
    }

    /// `log(softmax(x))` along `axis`, computed stably.
    pub fn log_softmax(&self, x: NodeId, axis: isize) -> Result<NodeId> {
        let axis = resolve_axis("log_softmax", axis, self.shape(x)?.rank())?;
        self.push(Op::LogSoftmax { axis }, &[x])
    }

    /// LayerNorm over the last axis: `(x - mean) / sqrt(var + eps) * gamma + beta`,
    /// with `gamma` and `beta` of shape `[D]` (biased variance, as PyTorch).
    pub fn layer_norm(&self, x: NodeId, gamma: NodeId, beta: NodeId, eps: f64) -> Result<NodeId> {
        self.push(
            Op::LayerNorm {
                eps: F64Bits::new(eps),
            },
            &[x, gamma, beta],
        )
    }

    /// RMSNorm over the last axis: `x / sqrt(mean(x^2) + eps) * gamma`.
    pub fn rms_norm(&self, x: NodeId, gamma: NodeId, eps: f64) -> Result<NodeId> {
        self.push(
            Op::RmsNorm {
                eps: F64Bits::new(eps),
            },
            &[x, gamma],
        )
    }

    /// The gradient of the input of `layer_norm(x, gamma, _, eps)` (`centered`) or
    /// `rms_norm(x, gamma, eps)`, given the gradient `dy` of its output
    /// ([`Op::NormGrad`]); `dy` has `x`'s shape.
    pub fn norm_grad(
        &self,
        x: NodeId,
        gamma: NodeId,
        dy: NodeId,
        eps: f64,
        centered: bool,
    ) -> Result<NodeId> {
        self.push(
            Op::NormGrad {
                eps: F64Bits::new(eps),
                centered,
            },
            &[x, gamma, dy],
        )
    }

    /// The gradient of the scale `gamma` of `layer_norm(x, gamma, _, eps)`
    /// (`centered`) or `rms_norm(x, gamma, eps)`, given the gradient `dy` of its
    /// output ([`Op::NormScaleGrad`]): shape `[D]`, `D` the last axis of `x`.
    pub fn norm_scale_grad(
        &self,
        x: NodeId,
        dy: NodeId,
        eps: f64,
        centered: bool,
    ) -> Result<NodeId> {
        self.push(
            Op::NormScaleGrad {
                eps: F64Bits::new(eps),
                centered,
            },
            &[x, dy],
        )
    }
}

pub(crate) fn infer_softmax(name: &str, axis: usize, x: &Shape) -> Result<Shape> {
    require_float(name, x)?;
    if axis >= x.rank() {
        return Err(Error::invalid(
            name,
            format!("axis {axis} out of range for {x}"),
        ));
    }
    Ok(x.clone())
}

pub(crate) fn infer_norm(name: &str, x: &Shape, params: &[&Shape]) -> Result<Shape> {
    require_float(name, x)?;
    if x.rank() == 0 {
        return Err(Error::invalid(
            name,
            format!("input {x} must have rank >= 1"),
        ));
    }
    let d = x.dim(x.rank() - 1);
    for p in params {
        same_dtype(name, x, p)?;
        if p.dims() != [d] {
            return Err(mismatch(
                name,
                x,
                p,
                format!("scale/shift must have shape [{d}]"),
            ));
        }
    }
    Ok(x.clone())
}

pub(crate) fn infer_norm_grad(x: &Shape, gamma: &Shape, dy: &Shape) -> Result<Shape> {
    infer_norm("norm_grad", x, &[gamma])?;
    if dy != x {
        return Err(mismatch(
            "norm_grad",
            x,
            dy,
            "the output gradient must have the input's shape",
        ));
    }
    Ok(x.clone())
}

pub(crate) fn infer_norm_scale_grad(x: &Shape, dy: &Shape) -> Result<Shape> {
    infer_norm("norm_scale_grad", x, &[])?;
    if dy != x {
        return Err(mismatch(
            "norm_scale_grad",
            x,
            dy,
            "the output gradient must have the input's shape",
        ));
    }
    Ok(Shape::new(&[x.dim(x.rank() - 1)], x.dtype()))
}

/// Calls `f` with the flat positions of each lane along `axis`.
fn for_each_lane(dims: &[usize], axis: usize, mut f: impl FnMut(&[usize])) {
    let mut outer = dims.to_vec();
    outer[axis] = 1;
    let lanes: usize = outer.iter().product();
    for l in 0..lanes {
        let mut idx = unravel(l, &outer);
        let positions: Vec<usize> = (0..dims[axis])
            .map(|k| {
                idx[axis] = k;
                ravel(&idx, dims)
            })
            .collect();
        f(&positions);
    }
}

pub(crate) fn eval_softmax(x: &HostTensor, axis: usize, log: bool) -> HostTensor {
    let mut data = vec![0.0; x.data.len()];
    let dt = x.shape.dtype();
    for_each_lane(x.shape.dims(), axis, |pos| {
        let max = pos
            .iter()
            .map(|&p| x.data[p])
            .fold(f64::NEG_INFINITY, f64::max);
        let sum: f64 = pos.iter().map(|&p| (x.data[p] - max).exp()).sum();
        for &p in pos {
            let v = if log {
                x.data[p] - max - sum.ln()
            } else {
                (x.data[p] - max).exp() / sum
            };
            data[p] = dt.round_value(v);
        }
    });
    HostTensor::new(x.shape.clone(), data)
}

/// [`Op::NormGrad`] (with `gamma`) or [`Op::NormScaleGrad`] (without), in `f64`,
/// rounded to the dtype at the end.
pub(crate) fn eval_norm_grad(
    x: &HostTensor,
    gamma: Option<&HostTensor>,
    dy: &HostTensor,
    eps: f64,
    centered: bool,
    out: &Shape,
) -> HostTensor {
    let d = x.shape.dim(x.shape.rank() - 1);
    let dt = x.shape.dtype();
    let mut data = vec![0.0; out.num_elements()];
    if d > 0 {
        for (r, (row, g)) in x.data.chunks(d).zip(dy.data.chunks(d)).enumerate() {
            let mean = if centered {
                row.iter().sum::<f64>() / d as f64
            } else {
                0.0
            };
            let var = row.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / d as f64;
            let inv = 1.0 / (var + eps).sqrt();
            let normed: Vec<f64> = row.iter().map(|v| (v - mean) * inv).collect();
            match gamma {
                Some(gamma) => {
                    let scaled: Vec<f64> = g.iter().zip(&gamma.data).map(|(g, s)| g * s).collect();
                    let mean_scaled = scaled.iter().sum::<f64>() / d as f64;
                    let mean_dot =
                        scaled.iter().zip(&normed).map(|(s, n)| s * n).sum::<f64>() / d as f64;
                    for j in 0..d {
                        let centre = if centered { mean_scaled } else { 0.0 };
                        data[r * d + j] = inv * (scaled[j] - centre - normed[j] * mean_dot);
                    }
                }
                None => {
                    for j in 0..d {
                        data[j] += g[j] * normed[j];
                    }
                }
            }
        }
    }
    for v in &mut data {
        *v = dt.round_value(*v);
    }
    HostTensor::new(out.clone(), data)
}

pub(crate) fn eval_layer_norm(
    x: &HostTensor,
    gamma: &HostTensor,
    beta: Option<&HostTensor>,
    eps: f64,
) -> HostTensor {
    let d = x.shape.dim(x.shape.rank() - 1);
    let dt = x.shape.dtype();
    let mut data = vec![0.0; x.data.len()];
    if d > 0 {
        for (row_in, row_out) in x.data.chunks(d).zip(data.chunks_mut(d)) {
            let (mean, denom) = match beta {
                Some(_) => {
                    let mean = row_in.iter().sum::<f64>() / d as f64;
                    let var =
                        row_in.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / d as f64;
                    (mean, (var + eps).sqrt())
                }
                None => (
                    0.0,
                    (row_in.iter().map(|v| v * v).sum::<f64>() / d as f64 + eps).sqrt(),
                ),
            };
            for j in 0..d {
                let shift = beta.map_or(0.0, |b| b.data[j]);
                row_out[j] = dt.round_value((row_in[j] - mean) / denom * gamma.data[j] + shift);
            }
        }
    }
    HostTensor::new(x.shape.clone(), data)
}
