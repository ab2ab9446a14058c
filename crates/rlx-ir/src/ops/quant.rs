//! Ops over block-quantized weights: a matmul that reads packed rows, and
//! dequantization of packed rows (a quantized embedding is `gather` + `dequantize`).

use super::{mismatch, require_int};
use crate::quant::QuantFormat;
use crate::reference::HostTensor;
use crate::{DType, Error, Graph, NodeId, Op, Result, Shape};

impl Graph {
    /// `a @ dequantize(w)^T`: `a [..., K]` is `f32`, `w` is a `u8` tensor `[N,
    /// row_bytes]` holding `N` rows of `K` values in `format` (a linear layer's weight
    /// as GGUF stores it). Returns `[..., N]` in `f32`.
    pub fn quant_matmul(&self, a: NodeId, w: NodeId, format: QuantFormat) -> Result<NodeId> {
        self.push(Op::QuantMatMul { format }, &[a, w])
    }

    /// Decodes packed rows: `x` is `u8 [..., row_bytes]` in `format`; the result is
    /// `f32 [..., K]`.
    pub fn dequantize(&self, x: NodeId, format: QuantFormat) -> Result<NodeId> {
        self.push(Op::Dequantize { format }, &[x])
    }
}

/// Checks that `w` is `u8 [N, row_bytes]` for rows of `k` values and returns `N`.
fn packed_rows(op: &str, format: QuantFormat, w: &Shape, k: usize) -> Result<usize> {
    if w.dtype() != DType::U8 || w.rank() != 2 {
        return Err(Error::invalid(
            op,
            format!("packed weights must be a u8 matrix [N, row_bytes], got {w}"),
        ));
    }
    let row = format.row_bytes(k)?;
    if w.dim(1) != row {
        return Err(Error::invalid(
            op,
            format!(
                "rows of {k} {format} values take {row} bytes, but the weight {w} has rows of {}",
                w.dim(1)
            ),
        ));
    }
    Ok(w.dim(0))
}

pub(crate) fn infer_quant_matmul(format: QuantFormat, a: &Shape, w: &Shape) -> Result<Shape> {
    if a.dtype() != DType::F32 || a.rank() == 0 {
        return Err(mismatch(
            "quant_matmul",
            a,
            w,
            "the activations must be f32 with rank >= 1",
        ));
    }
    let k = a.dim(a.rank() - 1);
    let n = packed_rows("quant_matmul", format, w, k)?;
    let mut dims = a.dims().to_vec();
    let last = dims.len() - 1;
    dims[last] = n;
    Ok(Shape::new(&dims, DType::F32))
}

pub(crate) fn infer_dequantize(format: QuantFormat, x: &Shape) -> Result<Shape> {
    require_int("dequantize", "packed rows", x)?;
    if x.dtype() != DType::U8 || x.rank() == 0 {
        return Err(Error::invalid(
            "dequantize",
            format!("packed rows must be u8 with rank >= 1, got {x}"),
        ));
    }
    let mut dims = x.dims().to_vec();
    let last = dims.len() - 1;
    dims[last] = format.row_len(dims[last])?;
    Ok(Shape::new(&dims, DType::F32))
}

/// The packed bytes of a reference tensor (its values are bytes widened to `f64`).
fn bytes_of(t: &HostTensor) -> Vec<u8> {
    t.data.iter().map(|&v| v as u8).collect()
}

/// Decodes every row of a reference `u8 [rows, row_bytes]` tensor into `f64`.
fn dequantize_rows(format: QuantFormat, t: &HostTensor) -> Result<Vec<f64>> {
    let row_bytes = t.shape.dim(t.shape.rank() - 1);
    let k = format.row_len(row_bytes)?;
    let bytes = bytes_of(t);
    let mut values = vec![0f32; bytes.len() / row_bytes * k];
    for (row, out) in bytes
        .chunks_exact(row_bytes)
        .zip(values.chunks_exact_mut(k))
    {
        crate::quant::dequantize_row(format, row, out)?;
    }
    Ok(values.into_iter().map(f64::from).collect())
}

pub(crate) fn eval_quant_matmul(
    format: QuantFormat,
    a: &HostTensor,
    w: &HostTensor,
    out: &Shape,
) -> Result<HostTensor> {
    let weights = dequantize_rows(format, w)?;
    let k = a.shape.dim(a.shape.rank() - 1);
    let n = w.shape.dim(0);
    let rows = a.shape.num_elements() / k.max(1);
    let mut data = vec![0.0; rows * n];
    for r in 0..rows {
        let x = &a.data[r * k..(r + 1) * k];
        for (j, y) in data[r * n..(r + 1) * n].iter_mut().enumerate() {
            *y = x
                .iter()
                .zip(&weights[j * k..(j + 1) * k])
                .map(|(p, q)| p * q)
                .sum();
        }
    }
    Ok(HostTensor::new(out.clone(), data))
}

pub(crate) fn eval_dequantize(
    format: QuantFormat,
    x: &HostTensor,
    out: &Shape,
) -> Result<HostTensor> {
    Ok(HostTensor::new(out.clone(), dequantize_rows(format, x)?))
}
