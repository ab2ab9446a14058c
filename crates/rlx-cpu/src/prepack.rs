//! Weights packed ahead: an `f32` param that is the right operand of matrix products
//! is packed into the GEMM's panel layout whenever its value changes, so runs read
//! each panel as one contiguous stream and never pack it again. With few rows on the
//! left (short prompts, decoding) the product is bound by reading the weights, and a
//! contiguous stream is read about twice as fast as rows far apart. The weights of a
//! convolution that multiplies per tap are regrouped by tap the same way, and those
//! of a 3x3 convolution that runs by Winograd's method are transformed, and those of
//! a strided one with output pixels for rows are transposed into panels.
//!
//! A matrix whose every column is signed bytes times one scale (the weights of an
//! int8 model, dequantized to `f32` by its `Cast` and `Mul`) is stored that way
//! instead, bit-exactly: products then stream a quarter of the bytes and convert
//! each block as they pack it (MiniLM int8 at 1 x 128: 21.2 -> 20.2 ms).

use crate::gemm::{
    BFormat, pack_b_panels, packed_len, packed_panel_width, quantize_b_panels, quantized_len,
};
use crate::kernels::conv_f32::{self, ConvMethod, by_tap, regroup_by_tap};
use crate::kernels::{blocked_conv_f32, conv_pixels_f32, winograd_f32};
use crate::tensor::Src;
use rlx_driver::Buffer;
use rlx_ir::{DType, Op, Result, Shape};
use rlx_opt::{Location, Region};
use std::sync::Arc;

/// The form a param is packed ahead into for the steps that read it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum PackSpec {
    /// The `[k, n]` right operand of matrix products, in the GEMM's panels.
    Panels { k: usize, n: usize },
    /// Convolution weights (`groups * og` filters of `cg` channels by `taps` taps)
    /// regrouped as `[group][tap][og][cg]` for a convolution that multiplies per tap.
    ConvTaps {
        groups: usize,
        og: usize,
        cg: usize,
        taps: usize,
    },
    /// 3x3 convolution weights (`og` filters of `cg` channels) transformed for
    /// Winograd's F(4x4, 3x3): one packed `cg x og` GEMM operand per point.
    Winograd { cg: usize, og: usize },
    /// Weights of `o` filters of `k` values, transposed into panels for a strided
    /// convolution with output pixels for rows, in step order `order` (see
    /// [`conv_pixels_f32`]).
    ConvPixels {
        o: usize,
        k: usize,
        order: conv_pixels_f32::StepOrder,
    },
    /// Depthwise weights (`c` filters of `taps` taps) as a vector per tap for each
    /// block of channels (see [`blocked_conv_f32::pack_depthwise_weights`]).
    ///
    /// [`blocked_conv_f32::pack_depthwise_weights`]: crate::kernels::blocked_conv_f32::pack_depthwise_weights
    DepthwiseTaps { c: usize, taps: usize },
    /// Grouped convolution weights (`o` filters of `cg` channels by `taps` taps)
    /// as 16-channel filters over their block, zero outside their group (see
    /// [`conv_pixels_f32::pack_block_groups`]).
    BlockGroups { o: usize, cg: usize, taps: usize },
}

impl PackSpec {
    /// Floats of the packed form (saturating, so an impossible size fails the
    /// allocation's check).
    fn len(&self) -> usize {
        match *self {
            PackSpec::Panels { k, n } => packed_len(k, n),
            PackSpec::ConvTaps {
                groups,
                og,
                cg,
                taps,
            } => groups
                .saturating_mul(og)
                .saturating_mul(cg)
                .saturating_mul(taps),
            PackSpec::Winograd { cg, og } => winograd_f32::weights_len(cg, og),
            PackSpec::ConvPixels { o, k, .. } => conv_pixels_f32::weights_len(o, k),
            PackSpec::DepthwiseTaps { c, taps } => blocked_conv_f32::depthwise_weights_len(c, taps),
            PackSpec::BlockGroups { o, taps, .. } => {
                conv_pixels_f32::block_groups_weights_len(o, taps)
            }
        }
    }
}

/// A param packed ahead (a `[k, n]` matrix in the layout of `BFormat::Packed` for the
/// GEMM kernel of width `n`, or convolution weights regrouped by tap). Cheap to
/// clone: the packed values are shared.
#[derive(Clone, Debug)]
pub struct PackedParam {
    spec: PackSpec,
    /// Panel width (matrices only).
    nr: usize,
    /// Where the column scales start, in bytes, when a matrix is stored as signed
    /// bytes ([`BFormat::PackedI8`]): it is when that reproduces every value exactly.
    scales_at: Option<usize>,
    panels: Arc<Buffer>,
}

impl PackedParam {
    /// Packs `param` into the form `spec`; `what` names it in the
    /// [`rlx_ir::Error::OutOfMemory`] returned when the storage cannot be allocated.
    pub(crate) fn pack(spec: PackSpec, param: &Buffer, what: &str) -> Result<PackedParam> {
        Ok(PackedParam::pack_into(
            spec,
            param,
            PackedParam::panels(spec, what)?,
        ))
    }

    /// Zeroed storage for the form `spec` (the fallible part of packing, done before
    /// anything is changed).
    pub(crate) fn panels(spec: PackSpec, what: &str) -> Result<Buffer> {
        let what = format!("packed form of {what}");
        Buffer::try_zeroed(Shape::new(&[spec.len()], DType::F32), &what)
    }

    /// Packs `param` into `panels` (from [`PackedParam::panels`] for the same spec).
    pub(crate) fn pack_into(spec: PackSpec, param: &Buffer, mut panels: Buffer) -> PackedParam {
        let values = as_f32(param);
        if let PackSpec::Panels { k, n } = spec {
            // The bytes fit in the f32 panels' storage whenever k > 1.
            let bytes = panels.bytes_mut();
            if quantized_len(k, n) <= bytes.len()
                && let Some((nr, scales_at)) = quantize_b_panels(&values[..k * n], k, n, bytes)
            {
                return PackedParam {
                    spec,
                    nr,
                    scales_at: Some(scales_at),
                    panels: Arc::new(panels),
                };
            }
        }
        let out = as_f32_mut(&mut panels);
        let nr = match spec {
            PackSpec::Panels { k, n } => pack_b_panels(&values[..k * n], k, n, out),
            PackSpec::ConvTaps {
                groups,
                og,
                cg,
                taps,
            } => {
                regroup_by_tap(values, [groups, og, cg, taps], out);
                0
            }
            PackSpec::Winograd { cg, og } => {
                winograd_f32::transform_weights(values, cg, og, out);
                packed_panel_width(og)
            }
            PackSpec::ConvPixels { o, k, order } => {
                conv_pixels_f32::pack_weights_in(values, o, k, order, out);
                0
            }
            PackSpec::DepthwiseTaps { c, taps } => {
                blocked_conv_f32::pack_depthwise_weights(&values[..c * taps], taps, out);
                0
            }
            PackSpec::BlockGroups { o, cg, taps } => {
                conv_pixels_f32::pack_block_groups(&values[..o * cg * taps], o, (cg, taps), out);
                0
            }
        };
        PackedParam {
            spec,
            nr,
            scales_at: None,
            panels: Arc::new(panels),
        }
    }

    /// Whether it is the packed form `spec` asks for on this CPU.
    pub(crate) fn fits(&self, spec: PackSpec) -> bool {
        self.spec == spec
            && match spec {
                PackSpec::Panels { n, .. } => self.nr == packed_panel_width(n),
                PackSpec::ConvTaps { .. }
                | PackSpec::ConvPixels { .. }
                | PackSpec::DepthwiseTaps { .. }
                | PackSpec::BlockGroups { .. } => true,
                PackSpec::Winograd { og, .. } => self.nr == packed_panel_width(og),
            }
    }

    /// The packed values.
    pub(crate) fn values(&self) -> &[f32] {
        as_f32(&self.panels)
    }

    /// `(first panel, format)` for the GEMM.
    pub(crate) fn operand(&self) -> (*const f32, BFormat) {
        let base = self.panels.storage().as_ptr();
        let format = match self.scales_at {
            Some(at) => BFormat::PackedI8 {
                nr: self.nr,
                // SAFETY: the scales lie inside the storage, from `at`.
                scales: unsafe { base.add(at) }.cast::<f32>(),
            },
            None => BFormat::Packed {
                nr: self.nr,
                streamed: true,
            },
        };
        (base.cast::<f32>(), format)
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

/// The param a step reads packed ahead, with the form: the right operand of an `f32`
/// matrix product (plain or with an epilogue) that is a whole 2-D param, or the
/// weights of an `f32` convolution (per tap, Winograd, pixel rows, or a blocked
/// depthwise one's vector per tap), when a whole param.
pub(crate) fn packed_operand(
    op: &Op,
    inputs: &[(Location, Shape)],
    params: &[Shape],
    products_on_amx: bool,
    layout: crate::layout::StepLayout,
) -> Option<(usize, PackSpec)> {
    if inputs.len() < 2 {
        return None;
    }
    let (a, (b_loc, b)) = (&inputs[0].1, &inputs[1]);
    let Region::Param(index) = b_loc.region else {
        return None;
    };
    let whole = b_loc.offset == 0 && params.get(index) == Some(b);
    if !whole || a.dtype() != DType::F32 || b.dtype() != DType::F32 {
        return None;
    }
    let shapes: Vec<Shape> = inputs.iter().map(|(_, shape)| shape.clone()).collect();
    let blocked = crate::kernels::blocked_conv(op, &shapes, layout);
    let spec = match op {
        Op::Conv2d { .. } | Op::FusedConv2d { .. }
            if blocked == Some(blocked_conv_f32::BlockedConv::Depthwise) =>
        {
            PackSpec::DepthwiseTaps {
                c: b.dim(0),
                taps: b.dim(2) * b.dim(3),
            }
        }
        Op::Conv2d { .. } | Op::FusedConv2d { .. }
            if blocked == Some(blocked_conv_f32::BlockedConv::Grouped) =>
        {
            PackSpec::BlockGroups {
                o: b.dim(0),
                cg: b.dim(1),
                taps: b.dim(2) * b.dim(3),
            }
        }
        Op::Conv2d { .. } | Op::FusedConv2d { .. }
            if blocked == Some(blocked_conv_f32::BlockedConv::Pointwise) =>
        {
            PackSpec::ConvPixels {
                o: b.dim(0),
                k: b.dim(1) * b.dim(2) * b.dim(3),
                order: conv_pixels_f32::StepOrder::NATURAL,
            }
        }
        Op::Conv2d { .. } | Op::FusedConv2d { .. }
            if blocked == Some(blocked_conv_f32::BlockedConv::Dense) =>
        {
            PackSpec::ConvPixels {
                o: b.dim(0),
                k: b.dim(1) * b.dim(2) * b.dim(3),
                order: conv_pixels_f32::StepOrder::of(
                    layout.input(0),
                    b.dim(1),
                    b.dim(2) * b.dim(3),
                ),
            }
        }
        // Products on AMX tiles pack their weights per call, into tiles.
        Op::MatMul
        | Op::FusedMatMul {
            transpose_b: false, ..
        } if b.rank() == 2 && !products_on_amx => PackSpec::Panels {
            k: b.dim(0),
            n: b.dim(1),
        },
        Op::Conv2d { window, groups } | Op::FusedConv2d { window, groups, .. }
            if b.rank() == 4 && conv_f32::method(window, *groups, a, b) == ConvMethod::Winograd =>
        {
            PackSpec::Winograd {
                cg: b.dim(1),
                og: b.dim(0),
            }
        }
        Op::Conv2d { window, groups } | Op::FusedConv2d { window, groups, .. }
            if b.rank() == 4 && conv_f32::method(window, *groups, a, b) == ConvMethod::Pixels =>
        {
            PackSpec::ConvPixels {
                o: b.dim(0),
                k: b.dim(1) * b.dim(2) * b.dim(3),
                order: conv_pixels_f32::StepOrder::NATURAL,
            }
        }
        Op::Conv2d { window, groups } | Op::FusedConv2d { window, groups, .. }
            if b.rank() == 4 && by_tap(window, b.dim(1)) =>
        {
            PackSpec::ConvTaps {
                groups: *groups,
                og: b.dim(0) / groups,
                cg: b.dim(1),
                taps: b.dim(2) * b.dim(3),
            }
        }
        _ => return None,
    };
    Some((index, spec))
}

/// The packed operand a kernel should read for `b`, when the step has one that
/// matches `b`'s shape.
pub(crate) fn operand_for(packed: Option<&PackedParam>, b: &Src) -> Option<(*const f32, BFormat)> {
    let packed = packed?;
    let dims = b.shape.dims();
    (dims.len() == 2
        && b.shape.dtype() == DType::F32
        && packed.fits(PackSpec::Panels {
            k: dims[0],
            n: dims[1],
        }))
    .then(|| packed.operand())
}
