//! Kernel-side tensor access: a base address plus the shape the plan gave the value.
//!
//! Kernels read and write through raw pointers because an elementwise output may
//! occupy the same bytes as one of its operands (the planner's in-place reuse); every
//! access is an element index checked against the tensor's length. The addresses come
//! from the plan, whose regions the program allocated with exactly the planned sizes.

use crate::elem::Elem;
use rlx_ir::{MAX_RANK, Shape};

/// A read-only tensor operand.
#[derive(Clone, Copy)]
pub(crate) struct Src<'a> {
    pub ptr: *const u8,
    pub shape: &'a Shape,
    /// `shape.num_elements()`, computed once.
    pub len: usize,
}

/// The tensor a kernel writes.
#[derive(Clone, Copy)]
pub(crate) struct Dst<'a> {
    pub ptr: *mut u8,
    pub shape: &'a Shape,
    /// `shape.num_elements()`, computed once.
    pub len: usize,
}

impl Src<'_> {
    /// Element `i`.
    #[inline]
    pub fn get<T: Elem>(&self, i: usize) -> T {
        assert!(i < self.len, "kernel read out of bounds");
        // SAFETY: `i` is in bounds and `ptr` addresses `num_elements` values of `T`.
        unsafe { self.ptr.cast::<T>().add(i).read_unaligned() }
    }

    /// Element `i` widened to `f64`.
    #[inline]
    pub fn f64<T: Elem>(&self, i: usize) -> f64 {
        self.get::<T>(i).to_f64()
    }
}

impl Dst<'_> {
    /// Element `i` (for kernels that finish their output in a second pass).
    #[inline]
    pub fn get<T: Elem>(&self, i: usize) -> T {
        assert!(i < self.len, "kernel read out of bounds");
        // SAFETY: `i` is in bounds and `ptr` addresses `len` values of `T`.
        unsafe { self.ptr.cast::<T>().add(i).read_unaligned() }
    }

    /// Writes element `i`.
    #[inline]
    pub fn set<T: Elem>(&self, i: usize, v: T) {
        assert!(i < self.len, "kernel write out of bounds");
        // SAFETY: `i` is in bounds and `ptr` addresses `num_elements` values of `T`.
        unsafe { self.ptr.cast::<T>().add(i).write_unaligned(v) }
    }
}

/// Strides (in elements) of an operand of `in_dims` broadcast to `out_rank` dims:
/// 0 on broadcast axes.
pub(crate) fn broadcast_strides(in_dims: &[usize], out_dims: &[usize]) -> [isize; MAX_RANK] {
    let mut strides = [0isize; MAX_RANK];
    let offset = out_dims.len() - in_dims.len();
    let mut s = 1isize;
    for i in (0..in_dims.len()).rev() {
        strides[offset + i] = if in_dims[i] == 1 && out_dims[offset + i] != 1 {
            0
        } else {
            s
        };
        s *= in_dims[i] as isize;
    }
    strides
}

/// Row-major strides of `dims` as a fixed array.
pub(crate) fn strides_of(dims: &[usize]) -> [isize; MAX_RANK] {
    let mut strides = [0isize; MAX_RANK];
    let mut s = 1isize;
    for i in (0..dims.len()).rev() {
        strides[i] = s;
        s *= dims[i] as isize;
    }
    strides
}

/// `dims` with the strides of `N` operands walking them, with adjacent axes merged
/// wherever every operand steps over both as one (`stride[i] == stride[i + 1] *
/// dims[i + 1]`, broadcast axes included) and size-1 axes dropped: the same walk in
/// fewer, longer rows. Returns the rank (at least 1) and the merged dims and strides.
pub(crate) fn coalesce<const N: usize>(
    dims: &[usize],
    strides: [&[isize; MAX_RANK]; N],
) -> (usize, [usize; MAX_RANK], [[isize; MAX_RANK]; N]) {
    let mut merged = [1usize; MAX_RANK];
    let mut steps = [[0isize; MAX_RANK]; N];
    let mut rank = 0;
    for (axis, &d) in dims.iter().enumerate() {
        if d == 1 {
            continue;
        }
        let joins = rank > 0 && (0..N).all(|k| steps[k][rank - 1] == strides[k][axis] * d as isize);
        if joins {
            merged[rank - 1] *= d;
            for k in 0..N {
                steps[k][rank - 1] = strides[k][axis];
            }
        } else {
            merged[rank] = d;
            for k in 0..N {
                steps[k][rank] = strides[k][axis];
            }
            rank += 1;
        }
    }
    (rank.max(1), merged, steps)
}

/// The offsets [`for_each_strided`] gives flat index `flat` (without walking there).
pub(crate) fn strided_offsets<const N: usize>(
    dims: &[usize],
    strides: [&[isize; MAX_RANK]; N],
    mut flat: usize,
) -> [isize; N] {
    let mut offs = [0isize; N];
    for axis in (0..dims.len()).rev() {
        let i = flat % dims[axis].max(1);
        flat /= dims[axis].max(1);
        for k in 0..N {
            offs[k] += i as isize * strides[k][axis];
        }
    }
    offs
}

/// Walks every index of `dims` in row-major order, calling `f(flat, offsets)` where
/// `offsets[k] = base[k] + sum(idx * strides[k])`. No allocation.
pub(crate) fn for_each_strided<const N: usize>(
    dims: &[usize],
    strides: [&[isize; MAX_RANK]; N],
    base: [isize; N],
    mut f: impl FnMut(usize, [isize; N]),
) {
    let total: usize = dims.iter().product();
    if total == 0 {
        return;
    }
    let rank = dims.len();
    let mut idx = [0usize; MAX_RANK];
    let mut offs = base;
    for flat in 0..total {
        f(flat, offs);
        // Advance the odometer.
        let mut axis = rank;
        while axis > 0 {
            axis -= 1;
            idx[axis] += 1;
            for k in 0..N {
                offs[k] += strides[k][axis];
            }
            if idx[axis] < dims[axis] {
                break;
            }
            for k in 0..N {
                offs[k] -= strides[k][axis] * dims[axis] as isize;
            }
            idx[axis] = 0;
        }
    }
}

impl<'a> Src<'a> {
    /// The operand as a typed slice (only for operands never written by the kernel).
    pub fn as_slice<T: Elem>(&self) -> &'a [T] {
        assert_eq!(
            self.ptr as usize % std::mem::align_of::<T>(),
            0,
            "misaligned operand"
        );
        // SAFETY: aligned (checked), sized by the plan, and not written during the kernel.
        unsafe { std::slice::from_raw_parts(self.ptr.cast::<T>(), self.len) }
    }
}
