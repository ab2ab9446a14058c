//! Sequence ops: range/iota, cumsum, top-k and one-hot.

use super::{int_domain, ravel, require_int, require_numeric, resolve_axis, unravel};
use crate::reference::HostTensor;
use crate::{DType, Error, F64Bits, Graph, NodeId, Op, Result, Shape, TopKOutput};

impl Graph {
    /// `[start, start + step, ...)` up to but excluding `end` (numpy `arange`).
    pub fn range(&self, start: f64, end: f64, step: f64, dtype: DType) -> Result<NodeId> {
        if step == 0.0 || !step.is_finite() || !start.is_finite() || !end.is_finite() {
            return Err(Error::invalid(
                "range",
                format!(
                    "start {start}, end {end}, step {step}: need finite values and a non-zero step"
                ),
            ));
        }
        let len = ((end - start) / step).ceil().max(0.0) as usize;
        self.push(
            Op::Range {
                start: F64Bits::new(start),
                step: F64Bits::new(step),
                len,
                dtype,
            },
            &[],
        )
    }

    /// Uniform random numbers in `[0, 1)` of shape `dims` and float `dtype`, drawn from
    /// `seed` and the one-element integer node `key` (the training step, say): the same
    /// seed and key give the same numbers on every backend, and a new key new ones.
    ///
    /// # Errors
    /// [`Error::DTypeMismatch`] when `dtype` is not a float or `key` not an integer;
    /// [`Error::InvalidArgument`] when `key` holds more than one element.
    pub fn random_uniform(
        &self,
        dims: &[usize],
        dtype: DType,
        seed: u64,
        key: NodeId,
    ) -> Result<NodeId> {
        self.push(
            Op::RandomUniform {
                seed,
                dims: dims.to_vec(),
                dtype,
            },
            &[key],
        )
    }

    /// Dropout: each element of `x` kept with probability `1 - p` and scaled by `1 /
    /// (1 - p)`, or zeroed, the mask drawn by [`Graph::random_uniform`] from `seed`
    /// and `key`. `p = 0` returns `x` itself. Build the graph without it for
    /// evaluation.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `p` is not in `[0, 1)` or `x` is not a float.
    pub fn dropout(&self, x: NodeId, p: f64, seed: u64, key: NodeId) -> Result<NodeId> {
        let shape = self.shape(x)?;
        if !(0.0..1.0).contains(&p) {
            return Err(Error::invalid(
                "dropout",
                format!("the drop probability must be in [0, 1), got {p}"),
            ));
        }
        if !shape.dtype().is_float() {
            return Err(Error::dtype("dropout", "a float type", shape.dtype()));
        }
        if p == 0.0 {
            return Ok(x);
        }
        let u = self.random_uniform(shape.dims(), DType::F32, seed, key)?;
        let keep = self.binary(crate::BinaryOp::Ge, u, self.scalar(p, DType::F32))?;
        let scaled = self.binary(
            crate::BinaryOp::Mul,
            x,
            self.scalar(1.0 / (1.0 - p), shape.dtype()),
        )?;
        self.select(keep, scaled, self.scalar(0.0, shape.dtype()))
    }

    /// `0, 1, ..., len - 1`.
    pub fn iota(&self, len: usize, dtype: DType) -> Result<NodeId> {
        self.push(
            Op::Range {
                start: F64Bits::new(0.0),
                step: F64Bits::new(1.0),
                len,
                dtype,
            },
            &[],
        )
    }

    /// Running sum along `axis`; `exclusive` skips the current element, `reverse`
    /// accumulates from the end.
    pub fn cumsum(&self, x: NodeId, axis: isize, exclusive: bool, reverse: bool) -> Result<NodeId> {
        let axis = resolve_axis("cumsum", axis, self.shape(x)?.rank())?;
        self.push(
            Op::Cumsum {
                axis,
                exclusive,
                reverse,
            },
            &[x],
        )
    }

    /// The `k` largest (`largest`) or smallest entries along `axis`, sorted, and their
    /// indices (`i64`). Ties keep the lower index first; NaN sorts as the largest value.
    pub fn topk(
        &self,
        x: NodeId,
        k: usize,
        axis: isize,
        largest: bool,
    ) -> Result<(NodeId, NodeId)> {
        let axis = resolve_axis("topk", axis, self.shape(x)?.rank())?;
        let values = self.push(
            Op::TopK {
                k,
                axis,
                largest,
                output: TopKOutput::Values,
            },
            &[x],
        )?;
        let indices = self.push(
            Op::TopK {
                k,
                axis,
                largest,
                output: TopKOutput::Indices,
            },
            &[x],
        )?;
        Ok((values, indices))
    }

    /// One-hot along a new last axis of length `depth`.
    pub fn one_hot(&self, indices: NodeId, depth: usize, dtype: DType) -> Result<NodeId> {
        self.push(Op::OneHot { depth, dtype }, &[indices])
    }
}

pub(crate) fn infer_topk(k: usize, axis: usize, output: TopKOutput, x: &Shape) -> Result<Shape> {
    require_numeric("topk", x)?;
    if axis >= x.rank() || k > x.dim(axis) {
        return Err(Error::invalid(
            "topk",
            format!("k = {k} along axis {axis} of {x}"),
        ));
    }
    let mut dims = x.dims().to_vec();
    dims[axis] = k;
    Ok(Shape::new(
        &dims,
        if output == TopKOutput::Values {
            x.dtype()
        } else {
            DType::I64
        },
    ))
}

pub(crate) fn infer_one_hot(depth: usize, dtype: DType, idx: &Shape) -> Result<Shape> {
    require_int("one_hot", "indices", idx)?;
    let mut dims = idx.dims().to_vec();
    dims.push(depth);
    Ok(Shape::new(&dims, dtype))
}

pub(crate) fn eval_range(start: f64, step: f64, out: &Shape) -> HostTensor {
    let data = (0..out.num_elements())
        .map(|i| out.dtype().round_value(start + i as f64 * step))
        .collect();
    HostTensor::new(out.clone(), data)
}

pub(crate) fn infer_random_uniform(dims: &[usize], dtype: DType, key: &Shape) -> Result<Shape> {
    if !dtype.is_float() {
        return Err(Error::dtype("random_uniform", "a float type", dtype));
    }
    require_int("random_uniform", "key", key)?;
    if key.num_elements() != 1 {
        return Err(Error::invalid(
            "random_uniform",
            format!("the key must hold one element, got {key}"),
        ));
    }
    Ok(Shape::new(dims, dtype))
}

pub(crate) fn eval_random_uniform(seed: u64, key: &HostTensor, out: &Shape) -> HostTensor {
    let stream = crate::scalar::random_stream(seed, key.data[0] as i64);
    let data = (0..out.num_elements())
        .map(|i| {
            out.dtype()
                .round_value(crate::scalar::random_uniform(stream, i as u64))
        })
        .collect();
    HostTensor::new(out.clone(), data)
}

pub(crate) fn eval_cumsum(
    axis: usize,
    exclusive: bool,
    reverse: bool,
    x: &HostTensor,
) -> HostTensor {
    let dims = x.shape.dims();
    let dt = x.shape.dtype();
    let mut data = vec![0.0; x.data.len()];
    let n = dims[axis];
    for i in 0..x.data.len() {
        let mut idx = unravel(i, dims);
        if idx[axis] != 0 {
            continue;
        }
        let (mut acc, mut acc_i) = (0.0, 0i64);
        for step in 0..n {
            idx[axis] = if reverse { n - 1 - step } else { step };
            let p = ravel(&idx, dims);
            let v = x.data[p];
            if exclusive {
                data[p] = if int_domain(dt) { acc_i as f64 } else { acc };
            }
            acc += v;
            acc_i = acc_i.wrapping_add(v as i64);
            if !exclusive {
                data[p] = if int_domain(dt) { acc_i as f64 } else { acc };
            }
            data[p] = dt.round_value(data[p]);
        }
    }
    HostTensor::new(x.shape.clone(), data)
}

pub(crate) fn eval_topk(
    k: usize,
    axis: usize,
    largest: bool,
    output: TopKOutput,
    x: &HostTensor,
    out: &Shape,
) -> HostTensor {
    let dims = x.shape.dims();
    let n = dims[axis];
    let mut data = vec![0.0; out.num_elements()];
    let mut lanes = dims.to_vec();
    lanes[axis] = 1;
    for l in 0..lanes.iter().product::<usize>() {
        let mut idx = unravel(l, &lanes);
        let mut entries: Vec<(usize, f64)> = (0..n)
            .map(|j| {
                idx[axis] = j;
                (j, x.data[ravel(&idx, dims)])
            })
            .collect();
        // Stable sort keeps lower indices first among equal values.
        entries.sort_by(|a, b| {
            let ord = a.1.total_cmp(&b.1);
            let ord = match (a.1.is_nan(), b.1.is_nan()) {
                (true, true) => std::cmp::Ordering::Equal,
                (true, false) => std::cmp::Ordering::Greater,
                (false, true) => std::cmp::Ordering::Less,
                _ => a.1.partial_cmp(&b.1).unwrap_or(ord),
            };
            if largest { ord.reverse() } else { ord }
        });
        for (j, &(pos, v)) in entries.iter().take(k).enumerate() {
            idx[axis] = j;
            data[ravel(&idx, out.dims())] = if output == TopKOutput::Values {
                v
            } else {
                pos as f64
            };
        }
    }
    HostTensor::new(out.clone(), data)
}

pub(crate) fn eval_one_hot(depth: usize, idx: &HostTensor, out: &Shape) -> HostTensor {
    let mut data = vec![0.0; out.num_elements()];
    for (i, &v) in idx.data.iter().enumerate() {
        let k = v as i64;
        let k = if k < 0 { k + depth as i64 } else { k };
        if (0..depth as i64).contains(&k) {
            data[i * depth + k as usize] = 1.0;
        }
    }
    HostTensor::new(out.clone(), data)
}
