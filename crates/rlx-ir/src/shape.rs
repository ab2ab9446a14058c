//! Tensor shapes: dimensions plus element type.

use crate::{DType, Error, Result};
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
    ///
    /// Exact for every shape in a graph (the builder checks sizes, see
    /// [`Shape::check_size`]); for a shape whose count overflows it saturates at
    /// `usize::MAX` rather than panicking. Use [`Shape::checked_num_elements`] where the
    /// shape has not been checked.
    pub fn num_elements(&self) -> usize {
        self.checked_num_elements().unwrap_or(usize::MAX)
    }

    /// Bytes needed to store the tensor densely. Exact for a checked shape, saturating
    /// at `usize::MAX` otherwise (see [`Shape::num_elements`]).
    pub fn byte_size(&self) -> usize {
        self.checked_byte_size().unwrap_or(usize::MAX)
    }

    /// Number of elements, or `None` if the product of the dimensions overflows
    /// `usize`. A shape with a zero dimension has 0 elements whatever the others are.
    pub fn checked_num_elements(&self) -> Option<usize> {
        if self.dims.contains(&0) {
            return Some(0);
        }
        self.dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d))
    }

    /// Bytes needed to store the tensor densely, or `None` if that overflows `usize`.
    pub fn checked_byte_size(&self) -> Option<usize> {
        self.checked_num_elements()?
            .checked_mul(self.dtype.size_in_bytes())
    }

    /// Checks that the tensor can be addressed: the product of its non-zero dimensions
    /// times the element size is at most `isize::MAX` bytes (the largest allocation
    /// Rust allows). Zero dimensions count as 1 so that strides of an empty tensor
    /// cannot overflow either. After this check, element counts, byte sizes, strides
    /// and byte offsets of the shape are computed without overflow.
    ///
    /// # Errors
    /// [`Error::SizeOverflow`] naming `context` (the input, param or op) and the shape.
    pub fn check_size(&self, context: &str) -> Result<()> {
        let fits = self
            .dims
            .iter()
            .try_fold(self.dtype.size_in_bytes(), |n, &d| n.checked_mul(d.max(1)))
            .is_some_and(|bytes| bytes <= isize::MAX as usize);
        if fits {
            Ok(())
        } else {
            Err(Error::SizeOverflow {
                context: context.to_string(),
                what: self.to_string(),
            })
        }
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

/// Row-major strides, in elements, of a dense tensor with these dimensions. Exact for
/// a shape that passed [`Shape::check_size`]; saturating otherwise.
pub fn contiguous_strides(dims: &[usize]) -> Vec<usize> {
    let mut strides = vec![1usize; dims.len()];
    for i in (0..dims.len().saturating_sub(1)).rev() {
        strides[i] = strides[i + 1].saturating_mul(dims[i + 1]);
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
        write_shape(f, self.dtype, &self.dims)
    }
}

/// Writes `dtype[d0, d1, ...]`, the form every shape prints in.
pub(crate) fn write_shape<D: fmt::Display>(
    f: &mut fmt::Formatter<'_>,
    dtype: DType,
    dims: &[D],
) -> fmt::Result {
    write!(f, "{dtype}[")?;
    for (i, d) in dims.iter().enumerate() {
        if i > 0 {
            f.write_str(", ")?;
        }
        write!(f, "{d}")?;
    }
    f.write_str("]")
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

    #[test]
    fn sizes_are_checked() {
        let huge = Shape::new(&[1 << 32, 1 << 32], DType::F32);
        assert_eq!(huge.checked_num_elements(), None);
        assert_eq!(huge.checked_byte_size(), None);
        assert_eq!(huge.num_elements(), usize::MAX);
        let err = huge.check_size("input 'x'").unwrap_err();
        assert!(
            matches!(&err, Error::SizeOverflow { context, what }
                if context == "input 'x'" && what == "f32[4294967296, 4294967296]"),
            "{err}"
        );
        // Fits in usize but not in isize::MAX bytes.
        let past_isize = Shape::new(&[1 << 62], DType::F32);
        assert_eq!(past_isize.checked_byte_size(), None);
        assert!(past_isize.check_size("p").is_err());
        let just_past = Shape::new(&[(isize::MAX as usize) / 2 + 1], DType::U16);
        assert!(just_past.checked_byte_size().is_some());
        assert!(just_past.check_size("p").is_err());
        let largest = Shape::new(&[isize::MAX as usize], DType::U8);
        assert!(largest.check_size("p").is_ok());
        // Empty tensors: zero elements, but the other dimensions still bound strides.
        let empty = Shape::new(&[0, 1 << 40], DType::F32);
        assert_eq!(empty.checked_num_elements(), Some(0));
        assert!(empty.check_size("e").is_ok());
        assert!(
            Shape::new(&[0, 1 << 40, 1 << 40], DType::F32)
                .check_size("e")
                .is_err()
        );
        assert!(Shape::scalar(DType::F64).check_size("s").is_ok());
    }
}
