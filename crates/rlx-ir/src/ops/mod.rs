//! Op families. Each file holds, for its ops: the builder methods on [`Graph`], the
//! shape and dtype rule, and the reference evaluation (plain loops that define the op).
//!
//! [`Graph`]: crate::Graph

pub mod attention;
pub mod conv;
pub mod elementwise;
pub mod fused;
pub mod loss;
pub mod matmul;
pub mod misc;
pub mod norm;
pub mod optim;
pub mod quant;
pub mod reduce;
pub mod resample;
pub mod shape_ops;
pub mod state;

use crate::{DType, Error, Result, Shape};

/// Resolves a possibly negative axis for `op`, or an error naming the rank.
pub(crate) fn resolve_axis(op: &str, axis: isize, rank: usize) -> Result<usize> {
    crate::shape::normalize_axis(axis, rank)
        .ok_or_else(|| Error::invalid(op, format!("axis {axis} is out of range for rank {rank}")))
}

/// Errors unless both shapes have the same dtype.
pub(crate) fn same_dtype(op: &str, a: &Shape, b: &Shape) -> Result<()> {
    if a.dtype() != b.dtype() {
        return Err(Error::dtype(
            format!("{op} (operand {b})"),
            a.dtype().name(),
            b.dtype(),
        ));
    }
    Ok(())
}

/// Errors unless the shape's dtype is a float.
pub(crate) fn require_float(op: &str, s: &Shape) -> Result<()> {
    if !s.dtype().is_float() {
        return Err(Error::dtype(
            format!("{op} (operand {s})"),
            "a float type",
            s.dtype(),
        ));
    }
    Ok(())
}

/// Errors unless the shape's dtype is an integer.
pub(crate) fn require_int(op: &str, what: &str, s: &Shape) -> Result<()> {
    if !s.dtype().is_int() {
        return Err(Error::dtype(
            format!("{op} ({what} {s})"),
            "an integer type",
            s.dtype(),
        ));
    }
    Ok(())
}

/// Errors unless the dtype is numeric (not bool).
pub(crate) fn require_numeric(op: &str, s: &Shape) -> Result<()> {
    if !s.dtype().is_numeric() {
        return Err(Error::dtype(
            format!("{op} (operand {s})"),
            "a numeric type",
            s.dtype(),
        ));
    }
    Ok(())
}

/// A shape-mismatch error.
pub(crate) fn mismatch(op: &str, a: &Shape, b: &Shape, reason: impl Into<String>) -> Error {
    Error::ShapeMismatch {
        op: op.into(),
        lhs: a.clone(),
        rhs: b.clone(),
        reason: reason.into(),
    }
}

/// Errors unless the shape has exactly `rank` dimensions.
pub(crate) fn require_rank(op: &str, what: &str, s: &Shape, rank: usize) -> Result<()> {
    if s.rank() != rank {
        return Err(Error::invalid(
            op,
            format!("{what} must have rank {rank}, got {s}"),
        ));
    }
    Ok(())
}

/// Multi-index of a flat row-major position.
pub(crate) fn unravel(mut flat: usize, dims: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; dims.len()];
    for i in (0..dims.len()).rev() {
        if dims[i] > 0 {
            idx[i] = flat % dims[i];
            flat /= dims[i];
        }
    }
    idx
}

/// Flat row-major position of a multi-index.
pub(crate) fn ravel(idx: &[usize], dims: &[usize]) -> usize {
    idx.iter().zip(dims).fold(0, |acc, (&i, &d)| acc * d + i)
}

/// Flat position in an operand of `in_dims` broadcast to the output index `out_idx`.
pub(crate) fn broadcast_source(out_idx: &[usize], in_dims: &[usize]) -> usize {
    let offset = out_idx.len() - in_dims.len();
    let mut flat = 0;
    for (i, &d) in in_dims.iter().enumerate() {
        let k = if d == 1 { 0 } else { out_idx[offset + i] };
        flat = flat * d + k;
    }
    flat
}

/// True if `dtype` values go through integer arithmetic in the reference.
pub(crate) fn int_domain(dtype: DType) -> bool {
    !dtype.is_float()
}
