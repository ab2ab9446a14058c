//! Reductions over axes and argmax/argmin.

use crate::elem::{Elem, with_dtype};
use crate::tensor::{Dst, Src, for_each_strided, strides_of};
use rlx_ir::{ArgReduceOp, MAX_RANK, ReduceOp};

/// Kept and reduced axes with their strides, in fixed arrays (no allocation).
#[derive(Clone, Copy, Debug)]
pub(crate) struct ReduceGeometry {
    kept: [usize; MAX_RANK],
    kept_len: usize,
    kept_strides: [isize; MAX_RANK],
    reduced: [usize; MAX_RANK],
    reduced_len: usize,
    reduced_strides: [isize; MAX_RANK],
}

impl ReduceGeometry {
    pub fn new(dims: &[usize], axes: &[usize]) -> ReduceGeometry {
        let strides = strides_of(dims);
        let mut g = ReduceGeometry {
            kept: [0; MAX_RANK],
            kept_len: 0,
            kept_strides: [0; MAX_RANK],
            reduced: [0; MAX_RANK],
            reduced_len: 0,
            reduced_strides: [0; MAX_RANK],
        };
        for (a, &d) in dims.iter().enumerate() {
            if axes.contains(&a) {
                g.reduced[g.reduced_len] = d;
                g.reduced_strides[g.reduced_len] = strides[a];
                g.reduced_len += 1;
            } else {
                g.kept[g.kept_len] = d;
                g.kept_strides[g.kept_len] = strides[a];
                g.kept_len += 1;
            }
        }
        g
    }

    fn kept(&self) -> &[usize] {
        &self.kept[..self.kept_len]
    }

    fn reduced(&self) -> &[usize] {
        &self.reduced[..self.reduced_len]
    }
}

pub(crate) fn reduce(op: ReduceOp, geo: &ReduceGeometry, x: Src, out: Dst) {
    with_dtype!(x.shape.dtype(), T => reduce_typed::<T>(op, geo, x, out))
}

fn reduce_typed<T: Elem>(op: ReduceOp, geo: &ReduceGeometry, x: Src, out: Dst) {
    let count: usize = geo.reduced().iter().product();
    for_each_strided(geo.kept(), [&geo.kept_strides], [0], |o, [base]| {
        let (mut f, mut n) = match op {
            ReduceOp::Sum | ReduceOp::Mean => (0.0f64, 0i64),
            ReduceOp::Prod => (1.0, 1),
            ReduceOp::Max => (f64::NEG_INFINITY, i64::MIN),
            ReduceOp::Min => (f64::INFINITY, i64::MAX),
        };
        let mut nan = false;
        for_each_strided(geo.reduced(), [&geo.reduced_strides], [base], |_, [p]| {
            let v: T = x.get(p as usize);
            if T::FLOAT {
                let v = v.to_f64();
                nan |= v.is_nan();
                f = match op {
                    ReduceOp::Sum | ReduceOp::Mean => f + v,
                    ReduceOp::Prod => f * v,
                    ReduceOp::Max => f.max(v),
                    ReduceOp::Min => f.min(v),
                };
            } else {
                let v = v.to_i64();
                n = match op {
                    ReduceOp::Sum | ReduceOp::Mean => n.wrapping_add(v),
                    ReduceOp::Prod => n.wrapping_mul(v),
                    ReduceOp::Max => n.max(v),
                    ReduceOp::Min => n.min(v),
                };
            }
        });
        let r = if T::FLOAT {
            let f = if nan && matches!(op, ReduceOp::Max | ReduceOp::Min) {
                f64::NAN
            } else {
                f
            };
            T::from_f64(if op == ReduceOp::Mean {
                f / count as f64
            } else {
                f
            })
        } else {
            T::from_i64(n)
        };
        out.set(o, r);
    });
}

pub(crate) fn arg_reduce(op: ArgReduceOp, axis: usize, x: Src, out: Dst) {
    with_dtype!(x.shape.dtype(), T => {
        let geo = ReduceGeometry::new(x.shape.dims(), &[axis]);
        let n = x.shape.dim(axis);
        let stride = geo.reduced_strides[0];
        for_each_strided(geo.kept(), [&geo.kept_strides], [0], |o, [base]| {
            let mut best = 0usize;
            let mut best_v = x.f64::<T>(base as usize);
            for k in 1..n {
                if best_v.is_nan() {
                    break;
                }
                let v = x.f64::<T>((base + k as isize * stride) as usize);
                let better = v.is_nan() || match op {
                    ArgReduceOp::ArgMax => v > best_v,
                    ArgReduceOp::ArgMin => v < best_v,
                };
                if better {
                    best = k;
                    best_v = v;
                }
            }
            out.set(o, best as i64);
        });
    })
}
