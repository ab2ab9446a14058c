//! Tensor shapes: dimensions plus element type.

use crate::DType;
use std::fmt;

/// The largest tensor rank the IR accepts. Kernels index with fixed-size arrays of
/// this length, so they never allocate.
pub const MAX_RANK: usize = 8;

/// A tensor's dimensions (row-major, outermost first) and element type.
///
/// Dimensions are static today. The fields are private so that symbolic dimensions
/// (a named extent with an upper bound) can be added later: `dims()` will then return
/// the upper bounds, and new accessors will expose the symbols, without breaking callers.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct Shape {
    dims: Vec<usize>,
    dtype: DType,
}

impl Shape {
    /// A shape with the given dimensions and element type. `&[]` is a scalar.
    pub fn new(dims: &[usize], dtype: DType) -> Shape {
        Shape {
            dims: dims.to_vec(),
            dtype,
        }
    }

    /// A rank-0 (scalar) shape.
    pub fn scalar(dtype: DType) -> Shape {
        Shape::new(&[], dtype)
    }

    /// The dimensions, outermost first.
    pub fn dims(&self) -> &[usize] {
        &self.dims
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.dims.len()
    }

    /// Size of dimension `axis` (which must be `< rank`).
    pub fn dim(&self, axis: usize) -> usize {
        self.dims[axis]
    }

    /// Number of elements (1 for a scalar, 0 if any dimension is 0).
    pub fn num_elements(&self) -> usize {
        self.dims.iter().product()
    }

    /// Bytes needed to store the tensor densely.
    pub fn byte_size(&self) -> usize {
        self.num_elements() * self.dtype.size_in_bytes()
    }

    /// The same dimensions with another element type.
    pub fn with_dtype(&self, dtype: DType) -> Shape {
        Shape {
            dims: self.dims.clone(),
            dtype,
        }
    }

    /// Other dimensions with the same element type.
    pub fn with_dims(&self, dims: &[usize]) -> Shape {
        Shape::new(dims, self.dtype)
    }

    /// Row-major strides in elements (the last axis has stride 1).
    pub fn strides(&self) -> Vec<usize> {
        contiguous_strides(&self.dims)
    }
}

/// Row-major strides, in elements, of a dense tensor with these dimensions.
pub fn contiguous_strides(dims: &[usize]) -> Vec<usize> {
    let mut strides = vec![1; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1] * dims[i + 1];
    }
    strides
}

/// Resolves a possibly negative axis against a rank, or `None` if out of range.
pub fn normalize_axis(axis: isize, rank: usize) -> Option<usize> {
    let r = rank as isize;
    let a = if axis < 0 { axis + r } else { axis };
    (0..r).contains(&a).then_some(a as usize)
}

/// The numpy broadcast of two dimension lists, or `None` if they are incompatible.
pub fn broadcast_dims(a: &[usize], b: &[usize]) -> Option<Vec<usize>> {
    let rank = a.len().max(b.len());
    let mut out = vec![0; rank];
    for i in 0..rank {
        let da = if i + a.len() >= rank {
            a[i + a.len() - rank]
        } else {
            1
        };
        let db = if i + b.len() >= rank {
            b[i + b.len() - rank]
        } else {
            1
        };
        out[i] = match (da, db) {
            (x, y) if x == y => x,
            (1, y) => y,
            (x, 1) => x,
            _ => return None,
        };
    }
    Some(out)
}

impl fmt::Display for Shape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}[", self.dtype)?;
        for (i, d) in self.dims.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{d}")?;
        }
        f.write_str("]")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn broadcasting_follows_numpy() {
        assert_eq!(broadcast_dims(&[2, 1, 4], &[3, 1]), Some(vec![2, 3, 4]));
        assert_eq!(broadcast_dims(&[], &[5]), Some(vec![5]));
        assert_eq!(broadcast_dims(&[0, 1], &[1, 3]), Some(vec![0, 3]));
        assert_eq!(broadcast_dims(&[2, 3], &[3, 2]), None);
    }

    #[test]
    fn axes_and_strides() {
        assert_eq!(normalize_axis(-1, 3), Some(2));
        assert_eq!(normalize_axis(3, 3), None);
        assert_eq!(normalize_axis(-4, 3), None);
        assert_eq!(contiguous_strides(&[2, 3, 4]), vec![12, 4, 1]);
        let s = Shape::new(&[2, 3], DType::F16);
        assert_eq!((s.num_elements(), s.byte_size()), (6, 12));
        assert_eq!(s.to_string(), "f16[2, 3]");
    }
}
