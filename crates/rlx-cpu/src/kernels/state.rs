//! `write_at`: writes rows into a persistent handle at a run-time position.

use crate::elem::{Elem, with_dtype};
use crate::tensor::{Dst, Src};
use rlx_ir::{Error, Result};

/// Copies `update` into `target` along `axis` from the position in `pos`. The target
/// is the output (the handle); the position is checked before anything is written.
pub(crate) fn write_at(axis: usize, update: Src, pos: Src, target: Dst) -> Result<()> {
    let p = with_dtype!(pos.shape.dtype(), I => pos.get::<I>(0).to_i64());
    let (td, ud) = (target.shape.dims(), update.shape.dims());
    let len = ud[axis];
    if p < 0 || p as usize + len > td[axis] {
        return Err(Error::runtime(
            "write_at",
            format!(
                "position {p} + {len} does not fit axis {axis} of length {} (nothing written)",
                td[axis]
            ),
        ));
    }
    let outer: usize = td[..axis].iter().product();
    let inner: usize = td[axis + 1..].iter().product();
    with_dtype!(target.shape.dtype(), T => {
        for o in 0..outer {
            for r in 0..len {
                for e in 0..inner {
                    let src = (o * len + r) * inner + e;
                    let dst = (o * td[axis] + p as usize + r) * inner + e;
                    target.set::<T>(dst, update.get(src));
                }
            }
        }
    });
    Ok(())
}
