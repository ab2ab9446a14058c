//! Softmax, log-softmax, LayerNorm and RMSNorm.

use crate::elem::{Elem, with_dtype};
use crate::tensor::{Dst, Src};

/// Lanes along `axis`: (outer count, axis length, inner count).
fn lanes(dims: &[usize], axis: usize) -> (usize, usize, usize) {
    (
        dims[..axis].iter().product(),
        dims[axis],
        dims[axis + 1..].iter().product(),
    )
}

pub(crate) fn softmax(axis: usize, log: bool, x: Src, out: Dst) {
    let (outer, n, inner) = lanes(x.shape.dims(), axis);
    with_dtype!(x.shape.dtype(), T => {
        for o in 0..outer {
            for i in 0..inner {
                let at = |k: usize| (o * n + k) * inner + i;
                let max = (0..n).map(|k| x.f64::<T>(at(k))).fold(f64::NEG_INFINITY, f64::max);
                let sum: f64 = (0..n).map(|k| (x.f64::<T>(at(k)) - max).exp()).sum();
                for k in 0..n {
                    let v = x.f64::<T>(at(k)) - max;
                    out.set(at(k), T::from_f64(if log { v - sum.ln() } else { v.exp() / sum }));
                }
            }
        }
    })
}

/// LayerNorm (with `beta`) or RMSNorm (without) over the last axis.
pub(crate) fn norm(x: Src, gamma: Src, beta: Option<Src>, eps: f64, out: Dst) {
    let d = *x.shape.dims().last().unwrap_or(&1);
    let rows = x.shape.num_elements().checked_div(d).unwrap_or(0);
    with_dtype!(x.shape.dtype(), T => {
        for r in 0..rows {
            let at = |j: usize| r * d + j;
            let (mean, denom) = if beta.is_some() {
                let mean = (0..d).map(|j| x.f64::<T>(at(j))).sum::<f64>() / d as f64;
                let var = (0..d).map(|j| (x.f64::<T>(at(j)) - mean).powi(2)).sum::<f64>() / d as f64;
                (mean, (var + eps).sqrt())
            } else {
                (0.0, ((0..d).map(|j| x.f64::<T>(at(j)).powi(2)).sum::<f64>() / d as f64 + eps).sqrt())
            };
            for j in 0..d {
                let shift = beta.map_or(0.0, |b| b.f64::<T>(j));
                let v = (x.f64::<T>(at(j)) - mean) / denom * gamma.f64::<T>(j) + shift;
                out.set(at(j), T::from_f64(v));
            }
        }
    })
}

/// `Op::NormGrad` (with `gamma`: the input's gradient) or `Op::NormScaleGrad`
/// (without: the scale's gradient, summed over the rows), in `f64`.
pub(crate) fn norm_grad(x: Src, gamma: Option<Src>, dy: Src, eps: f64, centered: bool, out: Dst) {
    let d = *x.shape.dims().last().unwrap_or(&1);
    let rows = x.shape.num_elements().checked_div(d).unwrap_or(0);
    with_dtype!(x.shape.dtype(), T => {
        let mut scale_grad = vec![0.0f64; if gamma.is_none() { d } else { 0 }];
        for r in 0..rows {
            let at = |j: usize| r * d + j;
            let mean = if centered {
                (0..d).map(|j| x.f64::<T>(at(j))).sum::<f64>() / d as f64
            } else {
                0.0
            };
            let var = (0..d).map(|j| (x.f64::<T>(at(j)) - mean).powi(2)).sum::<f64>() / d as f64;
            let inv = 1.0 / (var + eps).sqrt();
            let normed = |j: usize| (x.f64::<T>(at(j)) - mean) * inv;
            match gamma {
                Some(gamma) => {
                    let scaled = |j: usize| dy.f64::<T>(at(j)) * gamma.f64::<T>(j);
                    let mean_scaled = (0..d).map(scaled).sum::<f64>() / d as f64;
                    let mean_dot = (0..d).map(|j| scaled(j) * normed(j)).sum::<f64>() / d as f64;
                    let centre = if centered { mean_scaled } else { 0.0 };
                    for j in 0..d {
                        let v = inv * (scaled(j) - centre - normed(j) * mean_dot);
                        out.set(at(j), T::from_f64(v));
                    }
                }
                None => {
                    for (j, acc) in scale_grad.iter_mut().enumerate() {
                        *acc += dy.f64::<T>(at(j)) * normed(j);
                    }
                }
            }
        }
        for (j, &v) in scale_grad.iter().enumerate() {
            out.set(j, T::from_f64(v));
        }
    })
}
