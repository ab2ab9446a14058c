//! Writes into persistent state (a KV cache row at a run-time position).

use super::{mismatch, ravel, require_int, same_dtype, unravel};
use crate::reference::HostTensor;
use crate::{Error, Graph, NodeId, Op, Result, Shape};

impl Graph {
    /// Writes `update` into `target` along `axis`, starting at the run-time index held
    /// by the one-element integer tensor `pos`, and returns the updated target.
    ///
    /// `target` must be an input bound as a persistent handle when compiling; the write
    /// happens in place and persists across runs. `update` has `target`'s shape except
    /// along `axis`. A position that would write past the end is a run-time error and
    /// writes nothing.
    pub fn write_at(
        &self,
        target: NodeId,
        update: NodeId,
        pos: NodeId,
        axis: isize,
    ) -> Result<NodeId> {
        let axis = super::resolve_axis("write_at", axis, self.shape(target)?.rank())?;
        self.push(Op::WriteAt { axis }, &[target, update, pos])
    }
}

pub(crate) fn infer_write_at(
    axis: usize,
    target: &Shape,
    update: &Shape,
    pos: &Shape,
) -> Result<Shape> {
    same_dtype("write_at", target, update)?;
    require_int("write_at", "position", pos)?;
    if pos.num_elements() != 1 {
        return Err(Error::invalid(
            "write_at",
            format!("position must hold one element, got {pos}"),
        ));
    }
    let fits = update.rank() == target.rank()
        && axis < target.rank()
        && (0..target.rank()).all(|a| {
            if a == axis {
                update.dim(a) <= target.dim(a)
            } else {
                update.dim(a) == target.dim(a)
            }
        });
    if !fits {
        return Err(mismatch(
            "write_at",
            target,
            update,
            format!(
                "update must match the target except along axis {axis}, where it may be shorter"
            ),
        ));
    }
    Ok(target.clone())
}

/// The start position of `op`, checked so that `len` rows fit along an axis of `dim`.
pub(crate) fn checked_position(op: &str, pos: f64, len: usize, dim: usize) -> Result<usize> {
    let p = pos as i64;
    if p < 0 || p as usize + len > dim {
        return Err(Error::runtime(
            op,
            format!("position {p} + {len} rows does not fit an axis of length {dim}"),
        ));
    }
    Ok(p as usize)
}

pub(crate) fn eval_write_at(
    axis: usize,
    target: &HostTensor,
    update: &HostTensor,
    pos: &HostTensor,
) -> Result<HostTensor> {
    let p = checked_position(
        "write_at",
        pos.data[0],
        update.shape.dim(axis),
        target.shape.dim(axis),
    )?;
    let mut data = target.data.clone();
    for (i, &v) in update.data.iter().enumerate() {
        let mut idx = unravel(i, update.shape.dims());
        idx[axis] += p;
        data[ravel(&idx, target.shape.dims())] = v;
    }
    Ok(HostTensor::new(target.shape.clone(), data))
}
