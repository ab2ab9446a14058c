//! Reductions over axes (sum, mean, max, min, prod) and argmax/argmin.

use super::{int_domain, ravel, require_float, require_numeric, resolve_axis, unravel};
use crate::reference::HostTensor;
use crate::{ArgReduceOp, DType, Error, Graph, NodeId, Op, ReduceOp, Result, Shape};

impl Graph {
    /// Reduces `axes` (negative counts from the end; empty means every axis).
    pub fn reduce(
        &self,
        op: ReduceOp,
        x: NodeId,
        axes: &[isize],
        keepdims: bool,
    ) -> Result<NodeId> {
        let shape = self.shape(x)?;
        let name = format!("reduce_{}", op.name());
        let mut resolved = if axes.is_empty() {
            (0..shape.rank()).collect::<Vec<_>>()
        } else {
            axes.iter()
                .map(|&a| resolve_axis(&name, a, shape.rank()))
                .collect::<Result<Vec<_>>>()?
        };
        resolved.sort_unstable();
        if resolved.windows(2).any(|w| w[0] == w[1]) {
            return Err(Error::invalid(
                name,
                format!("axes {axes:?} repeat an axis"),
            ));
        }
        self.push(
            Op::Reduce {
                op,
                axes: resolved,
                keepdims,
            },
            &[x],
        )
    }

    /// Sum over `axes`.
    pub fn sum(&self, x: NodeId, axes: &[isize], keepdims: bool) -> Result<NodeId> {
        self.reduce(ReduceOp::Sum, x, axes, keepdims)
    }

    /// Mean over `axes` (float).
    pub fn mean(&self, x: NodeId, axes: &[isize], keepdims: bool) -> Result<NodeId> {
        self.reduce(ReduceOp::Mean, x, axes, keepdims)
    }

    /// Maximum over `axes`.
    pub fn reduce_max(&self, x: NodeId, axes: &[isize], keepdims: bool) -> Result<NodeId> {
        self.reduce(ReduceOp::Max, x, axes, keepdims)
    }

    /// Minimum over `axes`.
    pub fn reduce_min(&self, x: NodeId, axes: &[isize], keepdims: bool) -> Result<NodeId> {
        self.reduce(ReduceOp::Min, x, axes, keepdims)
    }

    /// Product over `axes`.
    pub fn prod(&self, x: NodeId, axes: &[isize], keepdims: bool) -> Result<NodeId> {
        self.reduce(ReduceOp::Prod, x, axes, keepdims)
    }

    /// Index of the maximum along `axis` (`i64`).
    pub fn argmax(&self, x: NodeId, axis: isize, keepdims: bool) -> Result<NodeId> {
        self.arg_reduce(ArgReduceOp::ArgMax, x, axis, keepdims)
    }

    /// Index of the minimum along `axis` (`i64`).
    pub fn argmin(&self, x: NodeId, axis: isize, keepdims: bool) -> Result<NodeId> {
        self.arg_reduce(ArgReduceOp::ArgMin, x, axis, keepdims)
    }

    fn arg_reduce(
        &self,
        op: ArgReduceOp,
        x: NodeId,
        axis: isize,
        keepdims: bool,
    ) -> Result<NodeId> {
        let shape = self.shape(x)?;
        let axis = resolve_axis("argmax/argmin", axis, shape.rank())?;
        self.push(Op::ArgReduce { op, axis, keepdims }, &[x])
    }
}

fn reduced_dims(dims: &[usize], axes: &[usize], keepdims: bool) -> Vec<usize> {
    dims.iter()
        .enumerate()
        .filter_map(|(i, &d)| match (axes.contains(&i), keepdims) {
            (false, _) => Some(d),
            (true, true) => Some(1),
            (true, false) => None,
        })
        .collect()
}

pub(crate) fn infer_reduce(
    op: ReduceOp,
    axes: &[usize],
    keepdims: bool,
    x: &Shape,
) -> Result<Shape> {
    let name = format!("reduce_{}", op.name());
    if axes.iter().any(|&a| a >= x.rank()) || axes.windows(2).any(|w| w[0] >= w[1]) {
        return Err(Error::invalid(
            name,
            format!("axes {axes:?} invalid for {x}"),
        ));
    }
    match op {
        ReduceOp::Mean => require_float(&name, x)?,
        _ => require_numeric(&name, x)?,
    }
    if matches!(op, ReduceOp::Max | ReduceOp::Min) && axes.iter().any(|&a| x.dim(a) == 0) {
        return Err(Error::invalid(
            name,
            format!("{x}: max/min over an empty axis has no value"),
        ));
    }
    Ok(Shape::new(
        &reduced_dims(x.dims(), axes, keepdims),
        x.dtype(),
    ))
}

pub(crate) fn infer_arg_reduce(axis: usize, keepdims: bool, x: &Shape) -> Result<Shape> {
    if axis >= x.rank() {
        return Err(Error::invalid(
            "argmax/argmin",
            format!("axis {axis} out of range for {x}"),
        ));
    }
    require_numeric("argmax/argmin", x)?;
    if x.dim(axis) == 0 {
        return Err(Error::invalid(
            "argmax/argmin",
            format!("{x}: axis {axis} is empty"),
        ));
    }
    Ok(Shape::new(
        &reduced_dims(x.dims(), &[axis], keepdims),
        DType::I64,
    ))
}

/// The output position of input index `idx` after reducing `axes`.
fn reduced_position(idx: &[usize], dims: &[usize], axes: &[usize]) -> usize {
    let mut flat = 0;
    for (i, (&k, &d)) in idx.iter().zip(dims).enumerate() {
        if !axes.contains(&i) {
            flat = flat * d + k;
        }
    }
    flat
}

pub(crate) fn eval_reduce(op: ReduceOp, axes: &[usize], x: &HostTensor, out: &Shape) -> HostTensor {
    let n_out = out.num_elements();
    let dtype = x.shape.dtype();
    let int = int_domain(dtype);
    let count: usize = axes.iter().map(|&a| x.shape.dim(a)).product();
    let init = match op {
        ReduceOp::Sum | ReduceOp::Mean => 0.0,
        ReduceOp::Prod => 1.0,
        ReduceOp::Max => f64::NEG_INFINITY,
        ReduceOp::Min => f64::INFINITY,
    };
    let mut acc = vec![init; n_out];
    let mut acc_int = vec![if op == ReduceOp::Prod { 1i64 } else { 0 }; n_out];
    for (i, &v) in x.data.iter().enumerate() {
        let idx = unravel(i, x.shape.dims());
        let o = reduced_position(&idx, x.shape.dims(), axes);
        match op {
            ReduceOp::Sum | ReduceOp::Mean => {
                acc[o] += v;
                acc_int[o] = acc_int[o].wrapping_add(v as i64);
            }
            ReduceOp::Prod => {
                acc[o] *= v;
                acc_int[o] = acc_int[o].wrapping_mul(v as i64);
            }
            ReduceOp::Max => {
                acc[o] = if v.is_nan() || acc[o].is_nan() {
                    f64::NAN
                } else {
                    acc[o].max(v)
                }
            }
            ReduceOp::Min => {
                acc[o] = if v.is_nan() || acc[o].is_nan() {
                    f64::NAN
                } else {
                    acc[o].min(v)
                }
            }
        }
    }
    let data = (0..n_out)
        .map(|o| {
            let v = match op {
                // Narrow in i64 first: a wrapped i64 product does not survive f64.
                ReduceOp::Sum | ReduceOp::Prod if int => dtype.wrap_int(acc_int[o]) as f64,
                ReduceOp::Mean => acc[o] / count as f64,
                _ => acc[o],
            };
            dtype.round_value(v)
        })
        .collect();
    HostTensor::new(out.clone(), data)
}

pub(crate) fn eval_arg_reduce(
    op: ArgReduceOp,
    axis: usize,
    x: &HostTensor,
    out: &Shape,
) -> HostTensor {
    let dims = x.shape.dims();
    let n = dims[axis];
    let mut reduced_dims = dims.to_vec();
    reduced_dims[axis] = 1;
    let count: usize = reduced_dims.iter().product();
    let data = (0..count)
        .map(|o| {
            let mut idx = unravel(o, &reduced_dims);
            let mut best = 0usize;
            let mut best_v = f64::NAN;
            for k in 0..n {
                idx[axis] = k;
                let v = x.data[ravel(&idx, dims)];
                if k == 0 {
                    best_v = v;
                    continue;
                }
                if best_v.is_nan() {
                    break;
                }
                let better = v.is_nan()
                    || match op {
                        ArgReduceOp::ArgMax => v > best_v,
                        ArgReduceOp::ArgMin => v < best_v,
                    };
                if better {
                    best = k;
                    best_v = v;
                }
            }
            best as f64
        })
        .collect();
    HostTensor::new(out.clone(), data)
}
