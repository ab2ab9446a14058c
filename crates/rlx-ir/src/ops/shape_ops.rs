//! Data movement: reshape, permute, slice, concat, split, gather, expand,
//! squeeze/unsqueeze, pad and tile.

use super::{broadcast_source, mismatch, ravel, require_int, resolve_axis, unravel};
use crate::reference::HostTensor;
use crate::shape::broadcast_dims;
use crate::{Error, Graph, NodeId, Op, PadMode, Result, Shape, SliceAxis};

impl Graph {
    /// Same data with new dimensions (element counts must agree). A view: no copy.
    pub fn reshape(&self, x: NodeId, dims: &[usize]) -> Result<NodeId> {
        self.push(
            Op::Reshape {
                dims: dims.to_vec(),
            },
            &[x],
        )
    }

    /// Like [`Graph::reshape`], but one entry may be `-1` and is inferred.
    pub fn reshape_infer(&self, x: NodeId, dims: &[isize]) -> Result<NodeId> {
        let shape = self.shape(x)?;
        let known = dims
            .iter()
            .filter(|&&d| d >= 0)
            .try_fold(1usize, |n, &d| n.checked_mul(d as usize))
            .ok_or_else(|| Error::SizeOverflow {
                context: "reshape".into(),
                what: format!("the product of {dims:?}"),
            })?;
        let holes = dims.iter().filter(|&&d| d == -1).count();
        if holes > 1 || dims.iter().any(|&d| d < -1) {
            return Err(Error::invalid(
                "reshape",
                format!("{dims:?}: at most one -1 and no other negative entry"),
            ));
        }
        let fill = if holes == 1 {
            if known == 0 || shape.num_elements() % known != 0 {
                return Err(Error::invalid(
                    "reshape",
                    format!("cannot infer -1 in {dims:?} for {shape}"),
                ));
            }
            shape.num_elements() / known
        } else {
            0
        };
        let resolved: Vec<usize> = dims
            .iter()
            .map(|&d| if d == -1 { fill } else { d as usize })
            .collect();
        self.reshape(x, &resolved)
    }

    /// Reorders axes: output axis `i` is input axis `perm[i]`.
    pub fn permute(&self, x: NodeId, perm: &[usize]) -> Result<NodeId> {
        self.push(
            Op::Permute {
                perm: perm.to_vec(),
            },
            &[x],
        )
    }

    /// Swaps two axes.
    pub fn transpose(&self, x: NodeId, a: isize, b: isize) -> Result<NodeId> {
        let rank = self.shape(x)?.rank();
        let (a, b) = (
            resolve_axis("transpose", a, rank)?,
            resolve_axis("transpose", b, rank)?,
        );
        let mut perm: Vec<usize> = (0..rank).collect();
        perm.swap(a, b);
        self.permute(x, &perm)
    }

    /// Python-style slice `x[start:end:step]` along one axis (negative bounds count
    /// from the end and are clamped; `step` may be negative, not zero).
    pub fn slice(
        &self,
        x: NodeId,
        axis: isize,
        start: isize,
        end: isize,
        step: isize,
    ) -> Result<NodeId> {
        self.slice_axes(x, &[(axis, start, end, step)])
    }

    /// Slices several axes at once: `(axis, start, end, step)` each; other axes are kept.
    pub fn slice_axes(&self, x: NodeId, specs: &[(isize, isize, isize, isize)]) -> Result<NodeId> {
        let shape = self.shape(x)?;
        let mut axes: Vec<SliceAxis> = shape
            .dims()
            .iter()
            .map(|&d| SliceAxis {
                start: 0,
                step: 1,
                len: d,
            })
            .collect();
        let mut seen = vec![false; shape.rank()];
        for &(axis, start, end, step) in specs {
            let a = resolve_axis("slice", axis, shape.rank())?;
            if std::mem::replace(&mut seen[a], true) {
                return Err(Error::invalid("slice", format!("axis {axis} sliced twice")));
            }
            axes[a] = python_slice(shape.dim(a), start, end, step)?;
        }
        self.push(Op::Slice { axes }, &[x])
    }

    /// Joins `xs` along `axis`; all other dimensions must agree.
    pub fn concat(&self, xs: &[NodeId], axis: isize) -> Result<NodeId> {
        let first = xs
            .first()
            .ok_or_else(|| Error::invalid("concat", "needs at least one input"))?;
        let axis = resolve_axis("concat", axis, self.shape(*first)?.rank())?;
        self.push(Op::Concat { axis }, xs)
    }

    /// Splits `x` along `axis` into consecutive pieces of the given sizes (which must
    /// sum to the axis length). Each piece is a slice.
    pub fn split(&self, x: NodeId, axis: isize, sizes: &[usize]) -> Result<Vec<NodeId>> {
        let shape = self.shape(x)?;
        let a = resolve_axis("split", axis, shape.rank())?;
        if sizes.iter().sum::<usize>() != shape.dim(a) {
            return Err(Error::invalid(
                "split",
                format!(
                    "sizes {sizes:?} do not sum to {} (axis {a} of {shape})",
                    shape.dim(a)
                ),
            ));
        }
        let mut start = 0;
        sizes
            .iter()
            .map(|&s| {
                let piece = self.slice(x, a as isize, start as isize, (start + s) as isize, 1);
                start += s;
                piece
            })
            .collect()
    }

    /// numpy `take(data, indices, axis)`: the result has shape
    /// `data[:axis] + indices + data[axis+1:]`. Negative indices count from the end;
    /// an index out of range is a run-time error.
    pub fn gather(&self, data: NodeId, indices: NodeId, axis: isize) -> Result<NodeId> {
        let axis = resolve_axis("gather", axis, self.shape(data)?.rank())?;
        self.push(Op::Gather { axis }, &[data, indices])
    }

    /// numpy `broadcast_to`.
    pub fn expand(&self, x: NodeId, dims: &[usize]) -> Result<NodeId> {
        self.push(
            Op::Expand {
                dims: dims.to_vec(),
            },
            &[x],
        )
    }

    /// Removes the given size-1 axes (all size-1 axes when `axes` is empty).
    pub fn squeeze(&self, x: NodeId, axes: &[isize]) -> Result<NodeId> {
        let shape = self.shape(x)?;
        let drop: Vec<usize> = if axes.is_empty() {
            (0..shape.rank()).filter(|&a| shape.dim(a) == 1).collect()
        } else {
            axes.iter()
                .map(|&a| resolve_axis("squeeze", a, shape.rank()))
                .collect::<Result<_>>()?
        };
        if let Some(&a) = drop.iter().find(|&&a| shape.dim(a) != 1) {
            return Err(Error::invalid(
                "squeeze",
                format!("axis {a} of {shape} is not of size 1"),
            ));
        }
        let dims: Vec<usize> = (0..shape.rank())
            .filter(|a| !drop.contains(a))
            .map(|a| shape.dim(a))
            .collect();
        self.reshape(x, &dims)
    }

    /// Inserts size-1 axes at the given positions of the result.
    pub fn unsqueeze(&self, x: NodeId, axes: &[isize]) -> Result<NodeId> {
        let shape = self.shape(x)?;
        let out_rank = shape.rank() + axes.len();
        let mut at: Vec<usize> = axes
            .iter()
            .map(|&a| resolve_axis("unsqueeze", a, out_rank))
            .collect::<Result<_>>()?;
        at.sort_unstable();
        if at.windows(2).any(|w| w[0] == w[1]) {
            return Err(Error::invalid(
                "unsqueeze",
                format!("axes {axes:?} repeat an axis"),
            ));
        }
        let mut src = shape.dims().iter();
        let dims: Vec<usize> = (0..out_rank)
            .map(|i| {
                if at.contains(&i) {
                    1
                } else {
                    *src.next().unwrap_or(&1)
                }
            })
            .collect();
        self.reshape(x, &dims)
    }

    /// Pads each axis by `(before, after)`.
    pub fn pad(&self, x: NodeId, pads: &[(usize, usize)], mode: PadMode) -> Result<NodeId> {
        self.push(
            Op::Pad {
                pads: pads.to_vec(),
                mode,
            },
            &[x],
        )
    }

    /// Repeats `x` `reps[i]` times along axis `i`.
    pub fn tile(&self, x: NodeId, reps: &[usize]) -> Result<NodeId> {
        self.push(
            Op::Tile {
                reps: reps.to_vec(),
            },
            &[x],
        )
    }
}

/// Resolves a Python slice `start:end:step` on an axis of length `dim`.
pub fn python_slice(dim: usize, start: isize, end: isize, step: isize) -> Result<SliceAxis> {
    if step == 0 {
        return Err(Error::invalid("slice", "step must not be zero"));
    }
    let d = dim as isize;
    let clamp = |v: isize, lo: isize, hi: isize| v.clamp(lo, hi);
    let norm = |v: isize| if v < 0 { v.saturating_add(d) } else { v };
    let (s, e) = if step > 0 {
        (clamp(norm(start), 0, d), clamp(norm(end), 0, d))
    } else {
        (clamp(norm(start), -1, d - 1), clamp(norm(end), -1, d - 1))
    };
    let len = if step > 0 {
        if e > s { (e - s + step - 1) / step } else { 0 }
    } else if s > e {
        (s - e + (-step) - 1) / (-step)
    } else {
        0
    };
    Ok(SliceAxis {
        start: if len == 0 { 0 } else { s as usize },
        step,
        len: len as usize,
    })
}

pub(crate) fn infer_reshape(dims: &[usize], x: &Shape) -> Result<Shape> {
    let out = x.with_dims(dims);
    if out.num_elements() != x.num_elements() {
        return Err(mismatch("reshape", x, &out, "element counts differ"));
    }
    Ok(out)
}

pub(crate) fn infer_permute(perm: &[usize], x: &Shape) -> Result<Shape> {
    let mut seen = vec![false; x.rank()];
    if perm.len() != x.rank()
        || perm
            .iter()
            .any(|&p| p >= x.rank() || std::mem::replace(&mut seen[p], true))
    {
        return Err(Error::invalid(
            "permute",
            format!("{perm:?} is not a permutation of the axes of {x}"),
        ));
    }
    Ok(x.with_dims(&perm.iter().map(|&p| x.dim(p)).collect::<Vec<_>>()))
}

pub(crate) fn infer_slice(axes: &[SliceAxis], x: &Shape) -> Result<Shape> {
    if axes.len() != x.rank() {
        return Err(Error::invalid(
            "slice",
            format!("{} axis ranges for {x}", axes.len()),
        ));
    }
    for (a, s) in axes.iter().enumerate() {
        // The last index read, `start + (len - 1) * step`, computed without overflow.
        let last = isize::try_from(s.start).ok().and_then(|start| {
            let steps = isize::try_from(s.len.checked_sub(1)?).ok()?;
            start.checked_add(steps.checked_mul(s.step)?)
        });
        let ok = s.step != 0
            && (s.len == 0
                || (s.start < x.dim(a) && last.is_some_and(|l| l >= 0 && (l as usize) < x.dim(a))));
        if !ok {
            return Err(Error::invalid(
                "slice",
                format!("range {s:?} out of bounds for axis {a} of {x}"),
            ));
        }
    }
    Ok(x.with_dims(&axes.iter().map(|s| s.len).collect::<Vec<_>>()))
}

pub(crate) fn infer_concat(axis: usize, xs: &[&Shape]) -> Result<Shape> {
    let first = xs
        .first()
        .ok_or_else(|| Error::invalid("concat", "needs at least one input"))?;
    if axis >= first.rank() {
        return Err(Error::invalid(
            "concat",
            format!("axis {axis} out of range for {first}"),
        ));
    }
    let mut total = 0usize;
    for s in xs {
        super::same_dtype("concat", first, s)?;
        let agree = s.rank() == first.rank()
            && (0..s.rank()).all(|i| i == axis || s.dim(i) == first.dim(i));
        if !agree {
            return Err(mismatch(
                "concat",
                first,
                s,
                format!("dimensions other than axis {axis} must agree"),
            ));
        }
        total = s
            .dim(axis)
            .checked_add(total)
            .ok_or_else(|| Error::SizeOverflow {
                context: "concat".into(),
                what: format!("the sum of {} extents along axis {axis}", xs.len()),
            })?;
    }
    let mut dims = first.dims().to_vec();
    dims[axis] = total;
    Ok(first.with_dims(&dims))
}

pub(crate) fn infer_gather(axis: usize, data: &Shape, idx: &Shape) -> Result<Shape> {
    require_int("gather", "indices", idx)?;
    if axis >= data.rank() {
        return Err(Error::invalid(
            "gather",
            format!("axis {axis} out of range for {data}"),
        ));
    }
    let mut dims = data.dims()[..axis].to_vec();
    dims.extend_from_slice(idx.dims());
    dims.extend_from_slice(&data.dims()[axis + 1..]);
    Ok(data.with_dims(&dims))
}

pub(crate) fn infer_expand(dims: &[usize], x: &Shape) -> Result<Shape> {
    let target = x.with_dims(dims);
    match broadcast_dims(x.dims(), dims) {
        Some(b) if b == dims => Ok(target),
        _ => Err(mismatch(
            "expand",
            x,
            &target,
            "input does not broadcast to the target",
        )),
    }
}

pub(crate) fn infer_pad(pads: &[(usize, usize)], mode: PadMode, x: &Shape) -> Result<Shape> {
    if pads.len() != x.rank() {
        return Err(Error::invalid(
            "pad",
            format!("{} pad pairs for {x}", pads.len()),
        ));
    }
    for (a, &(before, after)) in pads.iter().enumerate() {
        let d = x.dim(a);
        let bad = match mode {
            PadMode::Reflect => (before > 0 || after > 0) && (before >= d || after >= d),
            PadMode::Edge => (before > 0 || after > 0) && d == 0,
            PadMode::Constant(_) => false,
        };
        if bad {
            return Err(Error::invalid(
                "pad",
                format!("{mode:?} padding ({before}, {after}) too large for axis {a} of {x}"),
            ));
        }
    }
    Ok(x.with_dims(
        &pads
            .iter()
            .zip(x.dims())
            .map(|(&(b, a), &d)| b.checked_add(d)?.checked_add(a))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| Error::SizeOverflow {
                context: "pad".into(),
                what: format!("{x} padded by {pads:?}"),
            })?,
    ))
}

pub(crate) fn infer_tile(reps: &[usize], x: &Shape) -> Result<Shape> {
    if reps.len() != x.rank() {
        return Err(Error::invalid(
            "tile",
            format!("{} repetitions for {x}", reps.len()),
        ));
    }
    Ok(x.with_dims(
        &reps
            .iter()
            .zip(x.dims())
            .map(|(r, d)| r.checked_mul(*d))
            .collect::<Option<Vec<_>>>()
            .ok_or_else(|| Error::SizeOverflow {
                context: "tile".into(),
                what: format!("{x} tiled {reps:?} times"),
            })?,
    ))
}

/// Maps every output element to a source position with `f(out_index) -> source flat`.
fn gather_by(x: &HostTensor, out: &Shape, f: impl Fn(&[usize]) -> usize) -> HostTensor {
    let data = (0..out.num_elements())
        .map(|i| x.data[f(&unravel(i, out.dims()))])
        .collect();
    HostTensor::new(out.clone(), data)
}

pub(crate) fn eval_permute(perm: &[usize], x: &HostTensor, out: &Shape) -> HostTensor {
    gather_by(x, out, |idx| {
        let mut src = vec![0; idx.len()];
        for (o, &p) in perm.iter().enumerate() {
            src[p] = idx[o];
        }
        ravel(&src, x.shape.dims())
    })
}

pub(crate) fn eval_slice(axes: &[SliceAxis], x: &HostTensor, out: &Shape) -> HostTensor {
    gather_by(x, out, |idx| {
        let src: Vec<usize> = idx
            .iter()
            .zip(axes)
            .map(|(&i, s)| (s.start as isize + i as isize * s.step) as usize)
            .collect();
        ravel(&src, x.shape.dims())
    })
}

pub(crate) fn eval_concat(axis: usize, xs: &[&HostTensor], out: &Shape) -> HostTensor {
    let mut data = Vec::with_capacity(out.num_elements());
    for i in 0..out.num_elements() {
        let mut idx = unravel(i, out.dims());
        let mut k = idx[axis];
        for x in xs {
            if k < x.shape.dim(axis) {
                idx[axis] = k;
                data.push(x.data[ravel(&idx, x.shape.dims())]);
                break;
            }
            k -= x.shape.dim(axis);
        }
    }
    HostTensor::new(out.clone(), data)
}

pub(crate) fn eval_gather(
    axis: usize,
    x: &HostTensor,
    idx: &HostTensor,
    out: &Shape,
) -> Result<HostTensor> {
    let n = x.shape.dim(axis) as i64;
    // Every index is checked, also when the result is empty (as numpy `take` does).
    if let Some(&k) = idx.data.iter().find(|&&k| !(-n..n).contains(&(k as i64))) {
        return Err(Error::runtime(
            "gather",
            format!("index {k} out of range for axis of length {n}"),
        ));
    }
    let mut data = Vec::with_capacity(out.num_elements());
    let ir = idx.shape.rank();
    for i in 0..out.num_elements() {
        let o = unravel(i, out.dims());
        let k = idx.data[ravel(&o[axis..axis + ir], idx.shape.dims())] as i64;
        let k = if k < 0 { k + n } else { k };
        if k < 0 || k >= n {
            return Err(Error::runtime(
                "gather",
                format!("index {k} out of range for axis of length {n}"),
            ));
        }
        let mut src = o[..axis].to_vec();
        src.push(k as usize);
        src.extend_from_slice(&o[axis + ir..]);
        data.push(x.data[ravel(&src, x.shape.dims())]);
    }
    Ok(HostTensor::new(out.clone(), data))
}

pub(crate) fn eval_expand(x: &HostTensor, out: &Shape) -> HostTensor {
    gather_by(x, out, |idx| broadcast_source(idx, x.shape.dims()))
}

pub(crate) fn eval_pad(
    pads: &[(usize, usize)],
    mode: PadMode,
    x: &HostTensor,
    out: &Shape,
) -> HostTensor {
    let fill = match mode {
        PadMode::Constant(v) => out.dtype().round_value(v.get()),
        _ => 0.0,
    };
    let data = (0..out.num_elements())
        .map(|i| {
            let idx = unravel(i, out.dims());
            let mut src = Vec::with_capacity(idx.len());
            for (a, &o) in idx.iter().enumerate() {
                let d = x.shape.dim(a) as isize;
                let p = o as isize - pads[a].0 as isize;
                let s = if (0..d).contains(&p) {
                    p
                } else {
                    match mode {
                        PadMode::Constant(_) => return fill,
                        PadMode::Edge => p.clamp(0, d - 1),
                        PadMode::Reflect => {
                            if p < 0 {
                                -p
                            } else {
                                2 * (d - 1) - p
                            }
                        }
                    }
                };
                src.push(s as usize);
            }
            x.data[ravel(&src, x.shape.dims())]
        })
        .collect();
    HostTensor::new(out.clone(), data)
}

pub(crate) fn eval_tile(x: &HostTensor, out: &Shape) -> HostTensor {
    gather_by(x, out, |idx| {
        let src: Vec<usize> = idx
            .iter()
            .zip(x.shape.dims())
            .map(|(&i, &d)| i % d)
            .collect();
        ravel(&src, x.shape.dims())
    })
}

#[cfg(test)]
mod tests {
    use super::python_slice;
    use crate::SliceAxis;

    #[test]
    fn python_slices() {
        assert_eq!(
            python_slice(5, 1, 4, 1).unwrap(),
            SliceAxis {
                start: 1,
                step: 1,
                len: 3
            }
        );
        assert_eq!(
            python_slice(5, -1, isize::MIN, -1).unwrap(),
            SliceAxis {
                start: 4,
                step: -1,
                len: 5
            }
        );
        assert_eq!(
            python_slice(5, 0, 100, 2).unwrap(),
            SliceAxis {
                start: 0,
                step: 2,
                len: 3
            }
        );
        assert_eq!(python_slice(5, 3, 1, 1).unwrap().len, 0);
        assert_eq!(python_slice(0, 0, 1, 1).unwrap().len, 0);
        assert!(python_slice(5, 0, 1, 0).is_err());
    }
}
