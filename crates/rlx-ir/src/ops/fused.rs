//! Fused ops, formed by the optimizer from ops a backend can run as one kernel:
//!
//! - `FusedMatMul`: `act(alpha * (a @ b) + bias) + residual`, the epilogue applied
//!   while the product is written;
//! - `Elementwise`: a connected region of float elementwise ops computed in one pass.
//!
//! Their reference semantics are exactly the unfused ops' (every step rounded to the
//! dtype), so a fused graph computes what the original did.

use super::conv::{eval_conv2d, infer_conv2d};
use super::matmul::{eval_matmul, infer_matmul};
use super::{broadcast_source, mismatch, require_float, same_dtype, unravel};
use crate::reference::HostTensor;
use crate::scalar::{binary_f64, unary_f64};
use crate::shape::broadcast_dims;
use crate::{BinaryOp, ConvFusion, DType, Error, Result, Shape, UnaryOp, Window2d};

/// One step of an [`Op::Elementwise`](crate::Op::Elementwise) region. Operands are
/// registers: `0..n` are the region's `n` inputs (broadcast to the output shape),
/// register `n + s` is the result of step `s`, and the last step is the output.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum EwStep {
    /// A unary op of one register.
    Unary(UnaryOp, u16),
    /// A binary op of two registers.
    Binary(BinaryOp, u16, u16),
}

/// The most inputs an elementwise region may have.
pub const MAX_REGION_INPUTS: usize = 16;
/// The most registers (inputs plus steps) an elementwise region may use.
pub const MAX_REGION_REGISTERS: usize = 64;

/// Binary ops an elementwise region may hold: the arithmetic ones (no comparisons or
/// logic, whose results are bool).
pub fn fusable_binary(op: BinaryOp) -> bool {
    !op.is_comparison() && !op.is_logical() && !op.is_bitwise()
}

/// Unary ops an elementwise region may hold: those defined on floats.
pub fn fusable_unary(op: UnaryOp) -> bool {
    !matches!(op, UnaryOp::Not | UnaryOp::BitNot)
}

pub(crate) fn infer_fused_matmul(
    transposed: [bool; 2],
    bias: bool,
    residual: bool,
    activation: Option<UnaryOp>,
    inputs: &[&Shape],
) -> Result<Shape> {
    let expected = operand_count("fused_matmul", bias, residual, inputs)?;
    // Transposed operands are checked as the product reads them.
    let read_as = |s: &Shape, swap: bool| -> Result<Shape> {
        if !swap {
            return Ok(s.clone());
        }
        if s.rank() < 2 {
            return Err(Error::invalid(
                "fused_matmul",
                format!("a transposed operand needs two axes or more, got {s}"),
            ));
        }
        let mut dims = s.dims().to_vec();
        let r = dims.len();
        dims.swap(r - 2, r - 1);
        Ok(Shape::new(&dims, s.dtype()))
    };
    let (a_read, b_read) = (
        read_as(inputs[0], transposed[0])?,
        read_as(inputs[1], transposed[1])?,
    );
    // A half-precision `b` with an `f32` `a` is read as `f32` (the weights stay stored
    // as they are; the kernel converts while it packs).
    let (a, b) = (&a_read, &b_read);
    let b_as_a;
    let b = if b.dtype() != a.dtype()
        && a.dtype() == DType::F32
        && matches!(b.dtype(), DType::F16 | DType::BF16)
    {
        b_as_a = b.with_dtype(DType::F32);
        &b_as_a
    } else {
        b
    };
    let out = infer_matmul(a, b)?;
    let residual_shape = residual.then(|| inputs[expected - 1]);
    check_epilogue("fused_matmul", &out, activation, residual_shape)?;
    let n = out.dims().last().copied().unwrap_or(1);
    if bias {
        let b = inputs[2];
        same_dtype("fused_matmul", &out, b)?;
        if b.dims() != [n] {
            return Err(mismatch(
                "fused_matmul",
                &out,
                b,
                format!("bias must be [{n}]"),
            ));
        }
    }
    Ok(out)
}

/// Checks that a fused op has its `2 + bias + residual` operands; returns the count.
fn operand_count(op: &str, bias: bool, residual: bool, inputs: &[&Shape]) -> Result<usize> {
    let expected = 2 + usize::from(bias) + usize::from(residual);
    if inputs.len() != expected {
        return Err(Error::invalid(
            op,
            format!("takes {expected} operands, got {}", inputs.len()),
        ));
    }
    Ok(expected)
}

/// Checks a fused op's epilogue against its output `out`: the activation is one a
/// region can hold, and the residual has the output's shape and dtype.
fn check_epilogue(
    op: &str,
    out: &Shape,
    activation: Option<UnaryOp>,
    residual: Option<&Shape>,
) -> Result<()> {
    if let Some(act) = activation
        && !fusable_unary(act)
    {
        return Err(Error::invalid(
            op,
            format!("{} cannot be an epilogue", act.name()),
        ));
    }
    if let Some(r) = residual {
        same_dtype(op, out, r)?;
        if r.dims() != out.dims() {
            return Err(mismatch(
                op,
                out,
                r,
                "the residual must have the output's shape",
            ));
        }
    }
    Ok(())
}

pub(crate) fn eval_fused_matmul(
    alpha: f64,
    transposed: [bool; 2],
    (bias, activation, residual): (bool, Option<UnaryOp>, bool),
    inputs: &[&HostTensor],
    out: &Shape,
) -> Result<HostTensor> {
    let read_as = |x: &HostTensor, swap: bool| -> HostTensor {
        if !swap {
            return x.clone();
        }
        let r = x.shape.rank();
        let mut perm: Vec<usize> = (0..r).collect();
        perm.swap(r - 2, r - 1);
        let dims: Vec<usize> = perm.iter().map(|&p| x.shape.dim(p)).collect();
        super::shape_ops::eval_permute(&perm, x, &Shape::new(&dims, x.shape.dtype()))
    };
    let (a, b) = (
        read_as(inputs[0], transposed[0]),
        read_as(inputs[1], transposed[1]),
    );
    let mut t = eval_matmul(&a, &b, out)?;
    let dtype = out.dtype();
    let n = out.dims().last().copied().unwrap_or(1).max(1);
    for (i, v) in t.data.iter_mut().enumerate() {
        if alpha != 1.0 {
            *v = dtype.round_value(*v * alpha);
        }
        if bias {
            *v = dtype.round_value(*v + inputs[2].data[i % n]);
        }
        if let Some(act) = activation {
            *v = dtype.round_value(unary_f64(act, *v));
        }
        if residual {
            *v = dtype.round_value(*v + inputs[inputs.len() - 1].data[i]);
        }
    }
    Ok(t)
}

/// Whether `s` holds one value per channel of an NCHW tensor with `channels`
/// channels, broadcast over the rest: `[1, C, 1, 1]`, or a shorter shape that
/// broadcasts the same way (`[C, 1, 1]`, as a batch norm's scale reshaped by an
/// exporter). Either way its values are the `C` per-channel values in order.
pub fn per_channel_operand(s: &Shape, channels: usize) -> bool {
    let dims = s.dims();
    dims.len() <= 4 && {
        let mut padded = [1usize; 4];
        padded[4 - dims.len()..].copy_from_slice(dims);
        padded == [1, channels, 1, 1]
    }
}

/// Checks per-channel operands: `like`'s dtype, one value per channel
/// ([`per_channel_operand`]).
fn check_channel_operands(
    op: &str,
    like: &Shape,
    channels: usize,
    operands: &[&Shape],
) -> Result<()> {
    for s in operands {
        same_dtype(op, like, s)?;
        if !per_channel_operand(s, channels) {
            return Err(mismatch(
                op,
                like,
                s,
                format!(
                    "a channel scale or shift must be [1, {channels}, 1, 1] (or [{channels}, 1, 1])"
                ),
            ));
        }
    }
    Ok(())
}

pub(crate) fn infer_fused_conv2d(
    window: &Window2d,
    groups: usize,
    e: ConvFusion,
    inputs: &[&Shape],
) -> Result<Shape> {
    let op = "fused_conv2d";
    let (residual_at, scale_at, in_scale_at) = (e.residual_at(), e.scale_at(), e.input_scale_at());
    let expected = e.operand_count();
    if inputs.len() != expected {
        return Err(Error::invalid(
            op,
            format!("takes {expected} operands, got {}", inputs.len()),
        ));
    }
    let out = infer_conv2d(window, groups, &inputs[..residual_at])?;
    let residual_shape = e.residual.then(|| inputs[residual_at]);
    check_epilogue(op, &out, e.activation, residual_shape)?;
    check_epilogue(op, &out, e.post_activation, None)?;
    check_epilogue(op, &out, e.input_activation, None)?;
    if e.channel_affine {
        check_channel_operands(op, &out, out.dim(1), &inputs[scale_at..scale_at + 2])?;
    }
    if e.input_affine {
        let x = inputs[0];
        check_channel_operands(op, x, x.dim(1), &inputs[in_scale_at..])?;
    }
    Ok(out)
}

pub(crate) fn eval_fused_conv2d(
    window: &Window2d,
    groups: usize,
    e: ConvFusion,
    inputs: &[&HostTensor],
    out: &Shape,
) -> HostTensor {
    let (residual_at, scale_at) = (e.residual_at(), e.scale_at());
    let prologue;
    let mut conv_inputs = inputs[..residual_at].to_vec();
    if e.has_prologue() {
        prologue = eval_input_prologue(&e, inputs);
        conv_inputs[0] = &prologue;
    }
    let mut t = eval_conv2d(window, groups, &conv_inputs, out);
    let dtype = out.dtype();
    let (channels, pixels) = (out.dim(1), out.dim(2) * out.dim(3));
    for (i, v) in t.data.iter_mut().enumerate() {
        if let Some(act) = e.activation {
            *v = dtype.round_value(unary_f64(act, *v));
        }
        if e.residual {
            *v = dtype.round_value(*v + inputs[residual_at].data[i]);
        }
        if e.channel_affine {
            let c = i / pixels.max(1) % channels.max(1);
            *v = dtype.round_value(*v * inputs[scale_at].data[c]);
            *v = dtype.round_value(*v + inputs[scale_at + 1].data[c]);
        }
        if let Some(act) = e.post_activation {
            *v = dtype.round_value(unary_f64(act, *v));
        }
    }
    t
}

/// `pre(x * in_scale + in_shift)`, each step rounded to the dtype.
fn eval_input_prologue(e: &ConvFusion, inputs: &[&HostTensor]) -> HostTensor {
    let x = inputs[0];
    let mut t = x.clone();
    let dtype = x.shape.dtype();
    let (channels, pixels) = (
        x.shape.dim(1).max(1),
        (x.shape.dim(2) * x.shape.dim(3)).max(1),
    );
    let at = e.input_scale_at();
    for (i, v) in t.data.iter_mut().enumerate() {
        if e.input_affine {
            let c = i / pixels % channels;
            *v = dtype.round_value(*v * inputs[at].data[c]);
            *v = dtype.round_value(*v + inputs[at + 1].data[c]);
        }
        if let Some(act) = e.input_activation {
            *v = dtype.round_value(unary_f64(act, *v));
        }
    }
    t
}

pub(crate) fn infer_elementwise(steps: &[EwStep], inputs: &[&Shape]) -> Result<Shape> {
    let Some(first) = inputs.first() else {
        return Err(Error::invalid(
            "elementwise",
            "a region needs at least one input",
        ));
    };
    require_float("elementwise", first)?;
    let mut dims = first.dims().to_vec();
    for s in &inputs[1..] {
        same_dtype("elementwise", first, s)?;
        dims = broadcast_dims(&dims, s.dims())
            .ok_or_else(|| mismatch("elementwise", first, s, "inputs do not broadcast"))?;
    }
    if steps.is_empty() {
        return Err(Error::invalid(
            "elementwise",
            "a region needs at least one step",
        ));
    }
    if inputs.len() > MAX_REGION_INPUTS || inputs.len() + steps.len() > MAX_REGION_REGISTERS {
        return Err(Error::invalid(
            "elementwise",
            format!(
                "a region takes at most {MAX_REGION_INPUTS} inputs and {MAX_REGION_REGISTERS} \
                 registers, got {} inputs and {} steps",
                inputs.len(),
                steps.len()
            ),
        ));
    }
    for (k, step) in steps.iter().enumerate() {
        let available = inputs.len() + k;
        let (ok_op, r1, r2) = match *step {
            EwStep::Unary(op, a) => (fusable_unary(op), a, a),
            EwStep::Binary(op, a, b) => (fusable_binary(op), a, b),
        };
        if !ok_op {
            return Err(Error::invalid(
                "elementwise",
                format!("step {k}: {step:?} cannot be fused"),
            ));
        }
        if usize::from(r1.max(r2)) >= available {
            return Err(Error::invalid(
                "elementwise",
                format!("step {k} reads a register that is not yet defined"),
            ));
        }
    }
    Ok(Shape::new(&dims, first.dtype()))
}

pub(crate) fn eval_elementwise(
    steps: &[EwStep],
    inputs: &[&HostTensor],
    out: &Shape,
) -> HostTensor {
    let dtype = out.dtype();
    let mut regs = vec![0.0f64; inputs.len() + steps.len()];
    let data = (0..out.num_elements())
        .map(|i| {
            let idx = unravel(i, out.dims());
            for (r, x) in inputs.iter().enumerate() {
                regs[r] = x.data[broadcast_source(&idx, x.shape.dims())];
            }
            for (k, step) in steps.iter().enumerate() {
                let v = match *step {
                    EwStep::Unary(op, a) => unary_f64(op, regs[usize::from(a)]),
                    EwStep::Binary(op, a, b) => {
                        binary_f64(op, regs[usize::from(a)], regs[usize::from(b)])
                    }
                };
                regs[inputs.len() + k] = dtype.round_value(v);
            }
            regs[regs.len() - 1]
        })
        .collect();
    HostTensor::new(out.clone(), data)
}
