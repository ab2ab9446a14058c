//! `write_at`: writes rows into a persistent handle at a run-time position.

use crate::elem::{Elem, with_dtype};
use crate::tensor::{Dst, Src};
use rlx_ir::{Error, Result};

/// Copies `update` into `target` along `axis` from the position in `pos`. The target
/// is the output (the handle); the position is checked before anything is written.
pub(crate) fn write_at(
    axis: usize,
    update: Src,
    pos: Src,
    target: Dst,
    ctx: &super::Ctx,
) -> Result<()> {
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
    // Each outer index writes one contiguous block: `len` rows of `inner` values.
    let size = target.shape.dtype().size_in_bytes();
    let block = len * inner * size;
    assert!(
        update.len * size >= outer * block && target.len * size >= outer * td[axis] * inner * size,
        "write_at block out of bounds"
    );
    for o in 0..outer {
        let from = o * block;
        let to = (o * td[axis] + p as usize) * inner * size;
        // SAFETY: both blocks lie inside their tensors (checked above); the update may
        // share the target's bytes.
        unsafe { super::copy_bytes(target.ptr.add(to), update.ptr.add(from), block, ctx)? };
    }
    Ok(())
}
