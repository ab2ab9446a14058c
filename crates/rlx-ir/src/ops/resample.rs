//! Resampling along an axis ([`Op::Interpolate`]): each output position is a
//! weighted sum of a few input positions along one axis, `y[.., o, ..] = Σ_k
//! weight[k, o] x[.., index[k, o], ..]`. Nearest, linear and cubic interpolation
//! (image resizing, upsampling) are this with one, two and four taps; a resize of
//! several axes is one per axis. A composite: its decomposition gathers each tap
//! and sums the weighted gathers.

use super::{mismatch, require_float, require_int, resolve_axis, same_dtype};
use crate::reference::HostTensor;
use crate::{Error, Graph, NodeId, Op, Result, Shape};

impl Graph {
    /// `y[.., o, ..] = Σ_k weight[k, o] x[.., index[k, o], ..]` along `axis`:
    /// `index` is an integer `[taps, out]` tensor of positions along the axis
    /// (negative ones count from the end; out of range is a run-time error), and
    /// `weight` a `[taps, out]` tensor of `x`'s float dtype. The output is `x` with
    /// `out` positions along the axis.
    pub fn interpolate(
        &self,
        x: NodeId,
        index: NodeId,
        weight: NodeId,
        axis: isize,
    ) -> Result<NodeId> {
        let axis = resolve_axis("interpolate", axis, self.shape(x)?.rank())?;
        self.push(Op::Interpolate { axis }, &[x, index, weight])
    }
}

/// The shape of [`Op::Interpolate`].
pub(crate) fn infer_interpolate(
    axis: usize,
    x: &Shape,
    index: &Shape,
    weight: &Shape,
) -> Result<Shape> {
    require_float("interpolate", x)?;
    require_int("interpolate", "index", index)?;
    same_dtype("interpolate", x, weight)?;
    if axis >= x.rank() {
        return Err(Error::invalid(
            "interpolate",
            format!("axis {axis} out of range for {x}"),
        ));
    }
    if index.rank() != 2 || index.dims() != weight.dims() {
        return Err(mismatch(
            "interpolate",
            index,
            weight,
            "index and weight must both be [taps, out]",
        ));
    }
    let mut dims = x.dims().to_vec();
    dims[axis] = index.dim(1);
    Ok(x.with_dims(&dims))
}

/// [`Op::Interpolate`] in `f64`: the weighted sum of the taps in order (zero with
/// no taps).
pub(crate) fn eval_interpolate(
    axis: usize,
    x: &HostTensor,
    index: &HostTensor,
    weight: &HostTensor,
    out: &Shape,
) -> Result<HostTensor> {
    let n = x.shape.dim(axis);
    let (taps, width) = (index.shape.dim(0), index.shape.dim(1));
    let positions = resolve_positions(&index.data, n)?;
    let outer: usize = x.shape.dims()[..axis].iter().product();
    let inner: usize = x.shape.dims()[axis + 1..].iter().product();
    let mut data = vec![0.0; out.num_elements()];
    for o in 0..outer {
        for j in 0..width {
            for i in 0..inner {
                let term = |k: usize| {
                    let p = positions[k * width + j];
                    weight.data[k * width + j] * x.data[(o * n + p) * inner + i]
                };
                // The first term as it is (a weight of 1 keeps a -0), then the rest.
                data[(o * width + j) * inner + i] =
                    (1..taps).fold(if taps == 0 { 0.0 } else { term(0) }, |s, k| s + term(k));
            }
        }
    }
    Ok(HostTensor::new(out.clone(), data))
}

/// The positions `index` names along an axis of length `n`, negative ones counted
/// from the end; any outside the axis is an error naming it.
pub fn resolve_positions(index: &[f64], n: usize) -> Result<Vec<usize>> {
    index
        .iter()
        .enumerate()
        .map(|(at, &k)| {
            let k = k as i64;
            let p = if k < 0 { k + n as i64 } else { k };
            if p < 0 || p >= n as i64 {
                Err(Error::runtime(
                    "interpolate",
                    format!("index {k} at position {at} is out of range for an axis of length {n}"),
                ))
            } else {
                Ok(p as usize)
            }
        })
        .collect()
}

/// [`Op::Interpolate`] in primitives: one gather per tap, scaled by its weights
/// lined up with the axis, summed in tap order.
pub(crate) fn decompose_interpolate(
    g: &Graph,
    axis: usize,
    (x, index, weight): (NodeId, NodeId, NodeId),
) -> Result<NodeId> {
    let xs = g.shape(x)?;
    let (taps, width) = {
        let s = g.shape(index)?;
        (s.dim(0), s.dim(1))
    };
    let mut along = vec![1usize; xs.rank()];
    along[axis] = width;
    let mut sum: Option<NodeId> = None;
    for k in 0..taps {
        let at = k as isize;
        let idx = g.reshape(g.slice(index, 0, at, at + 1, 1)?, &[width])?;
        let w = g.reshape(g.slice(weight, 0, at, at + 1, 1)?, &along)?;
        let term = g.mul(g.gather(x, idx, axis as isize)?, w)?;
        sum = Some(match sum {
            Some(s) => g.add(s, term)?,
            None => term,
        });
    }
    match sum {
        Some(s) => Ok(s),
        // No taps: every output is zero.
        None => {
            let mut dims = xs.dims().to_vec();
            dims[axis] = width;
            g.expand(g.scalar(0.0, xs.dtype()), &dims)
        }
    }
}
