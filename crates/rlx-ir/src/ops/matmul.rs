//! Matrix multiplication with numpy `matmul` semantics.

use super::{broadcast_source, mismatch, require_float, same_dtype, unravel};
use crate::reference::HostTensor;
use crate::shape::broadcast_dims;
use crate::{Graph, NodeId, Op, Result, Shape};

impl Graph {
    /// numpy `matmul`: `[..., M, K] x [..., K, N] -> [..., M, N]` with broadcast batch
    /// dims; a 1-D left operand is a row vector, a 1-D right operand a column vector,
    /// and the promoted axis is removed from the result.
    pub fn matmul(&self, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.push(Op::MatMul, &[a, b])
    }
}

/// The geometry of one matmul: batch dims of the result and `M, K, N`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct MatMulDims {
    /// Broadcast batch dimensions of the result.
    pub batch: Vec<usize>,
    /// Rows of the left operand.
    pub m: usize,
    /// The contracted dimension.
    pub k: usize,
    /// Columns of the right operand.
    pub n: usize,
    /// Batch dims of the left operand (after 1-D promotion).
    pub a_batch: Vec<usize>,
    /// Batch dims of the right operand (after 1-D promotion).
    pub b_batch: Vec<usize>,
}

/// Computes the matmul geometry of two operand shapes, or a shape error.
pub fn matmul_dims(a: &Shape, b: &Shape) -> Result<MatMulDims> {
    if a.rank() == 0 || b.rank() == 0 {
        return Err(mismatch("matmul", a, b, "operands must have rank >= 1"));
    }
    let ad: Vec<usize> = if a.rank() == 1 {
        vec![1, a.dim(0)]
    } else {
        a.dims().to_vec()
    };
    let bd: Vec<usize> = if b.rank() == 1 {
        vec![b.dim(0), 1]
    } else {
        b.dims().to_vec()
    };
    let (m, k) = (ad[ad.len() - 2], ad[ad.len() - 1]);
    let (k2, n) = (bd[bd.len() - 2], bd[bd.len() - 1]);
    if k != k2 {
        return Err(mismatch(
            "matmul",
            a,
            b,
            format!("contracted dimensions differ ({k} vs {k2})"),
        ));
    }
    let a_batch = ad[..ad.len() - 2].to_vec();
    let b_batch = bd[..bd.len() - 2].to_vec();
    let batch = broadcast_dims(&a_batch, &b_batch)
        .ok_or_else(|| mismatch("matmul", a, b, "batch dimensions do not broadcast"))?;
    Ok(MatMulDims {
        batch,
        m,
        k,
        n,
        a_batch,
        b_batch,
    })
}

pub(crate) fn infer_matmul(a: &Shape, b: &Shape) -> Result<Shape> {
    same_dtype("matmul", a, b)?;
    require_float("matmul", a)?;
    let d = matmul_dims(a, b)?;
    let mut dims = d.batch.clone();
    if a.rank() > 1 {
        dims.push(d.m);
    }
    if b.rank() > 1 {
        dims.push(d.n);
    }
    Ok(Shape::new(&dims, a.dtype()))
}

pub(crate) fn eval_matmul(a: &HostTensor, b: &HostTensor, out: &Shape) -> Result<HostTensor> {
    let d = matmul_dims(&a.shape, &b.shape)?;
    let batches: usize = d.batch.iter().product();
    let mut data = vec![0.0; out.num_elements()];
    for bi in 0..batches {
        let idx = unravel(bi, &d.batch);
        let ab = broadcast_source(&idx, &d.a_batch);
        let bb = broadcast_source(&idx, &d.b_batch);
        for i in 0..d.m {
            for j in 0..d.n {
                let mut acc = 0.0;
                for p in 0..d.k {
                    acc +=
                        a.data[ab * d.m * d.k + i * d.k + p] * b.data[bb * d.k * d.n + p * d.n + j];
                }
                data[bi * d.m * d.n + i * d.n + j] = out.dtype().round_value(acc);
            }
        }
    }
    Ok(HostTensor::new(out.clone(), data))
}
