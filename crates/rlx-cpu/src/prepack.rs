//! Weights packed ahead: an `f32` param that is the right operand of matrix products
//! is packed into the GEMM's panel layout whenever its value changes, so runs read
//! each panel as one contiguous stream and never pack it again. With few rows on the
//! left (short prompts, decoding) the product is bound by reading the weights, and a
//! contiguous stream is read about twice as fast as rows far apart.

use crate::gemm::{pack_b_panels, packed_len, packed_panel_width};
use crate::tensor::Src;
use rlx_driver::Buffer;
use rlx_ir::{DType, Op, Result, Shape};
use rlx_opt::{Location, Region};
use std::sync::Arc;

/// A `[k, n]` param packed for the GEMM kernel of width `n` (layout of
/// `BFormat::Packed`). Cheap to clone: the panels are shared.
#[derive(Clone, Debug)]
pub struct PackedParam {
    k: usize,
    n: usize,
    nr: usize,
    panels: Arc<Buffer>,
}

impl PackedParam {
    /// Packs `param`, a `[k, n]` `f32` matrix; `what` names it in the
    /// [`rlx_ir::Error::OutOfMemory`] returned when the panels cannot be allocated.
    pub(crate) fn pack(k: usize, n: usize, param: &Buffer, what: &str) -> Result<PackedParam> {
        Ok(PackedParam::pack_into(
            k,
            n,
            param,
            PackedParam::panels(k, n, what)?,
        ))
    }

    /// Zeroed storage for the panels of a `[k, n]` matrix (the fallible part of
    /// packing, done before anything is changed).
    pub(crate) fn panels(k: usize, n: usize, what: &str) -> Result<Buffer> {
        let what = format!("packed panels of {what}");
        Buffer::try_zeroed(Shape::new(&[packed_len(k, n)], DType::F32), &what)
    }

    /// Packs `param` into `panels` (from [`PackedParam::panels`] for the same `k, n`).
    pub(crate) fn pack_into(k: usize, n: usize, param: &Buffer, mut panels: Buffer) -> PackedParam {
        let nr = pack_b_panels(&as_f32(param)[..k * n], k, n, as_f32_mut(&mut panels));
        PackedParam {
            k,
            n,
            nr,
            panels: Arc::new(panels),
        }
    }

    /// Whether it is the packed form a `[k, n]` product on this CPU reads.
    pub(crate) fn fits(&self, k: usize, n: usize) -> bool {
        (self.k, self.n, self.nr) == (k, n, packed_panel_width(n))
    }

    /// `(first panel, panel width)` for the GEMM.
    pub(crate) fn operand(&self) -> (*const f32, usize) {
        (self.panels.storage().as_ptr().cast::<f32>(), self.nr)
    }

    /// Bytes the panels take (for memory reports).
    pub fn bytes(&self) -> usize {
        self.panels.bytes().len()
    }
}

fn as_f32(buffer: &Buffer) -> &[f32] {
    let bytes = buffer.bytes();
    // SAFETY: the storage is 64-byte aligned and holds `len / 4` f32 values, and every
    // bit pattern is a valid f32.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<f32>(), bytes.len() / 4) }
}

fn as_f32_mut(buffer: &mut Buffer) -> &mut [f32] {
    let bytes = buffer.bytes_mut();
    // SAFETY: the storage is 64-byte aligned and holds `len / 4` f32 values, and every
    // bit pattern is a valid f32.
    unsafe { std::slice::from_raw_parts_mut(bytes.as_mut_ptr().cast::<f32>(), bytes.len() / 4) }
}

/// The param a step reads as a packed right operand, with its `(k, n)`: an `f32`
/// matrix product (plain or with an epilogue) whose `B` is a whole 2-D param.
pub(crate) fn packed_operand(
    op: &Op,
    inputs: &[(Location, Shape)],
    params: &[Shape],
) -> Option<(usize, usize, usize)> {
    if !matches!(op, Op::MatMul | Op::FusedMatMul { .. }) || inputs.len() < 2 {
        return None;
    }
    let (a, (b_loc, b)) = (&inputs[0].1, &inputs[1]);
    let Region::Param(index) = b_loc.region else {
        return None;
    };
    let whole = b_loc.offset == 0 && params.get(index) == Some(b);
    (whole && a.dtype() == DType::F32 && b.dtype() == DType::F32 && b.rank() == 2)
        .then(|| (index, b.dim(0), b.dim(1)))
}

/// The packed operand a kernel should read for `b`, when the step has one that
/// matches `b`'s shape.
pub(crate) fn operand_for(packed: Option<&PackedParam>, b: &Src) -> Option<(*const f32, usize)> {
    let packed = packed?;
    let dims = b.shape.dims();
    (dims.len() == 2 && b.shape.dtype() == DType::F32 && packed.fits(dims[0], dims[1]))
        .then(|| packed.operand())
}
