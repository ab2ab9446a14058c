//! Linear quantization: `QuantizeLinear`, `DequantizeLinear`, `DynamicQuantizeLinear`
//! and the integer products `MatMulInteger`, `QLinearMatMul`, `ConvInteger`,
//! `QLinearConv`. All are compositions: integers are widened to a float type that holds
//! them exactly, combined there, then rounded (half to even) and saturated.

use super::nn::conv_nodes;
use super::{Converter, axis, size, unsupported};
use crate::import::Cx;
use crate::tensor::dtype_from_onnx;
use rlx_ir::{BinaryOp, DType, Error, NodeId, Op, ReduceOp, Result, TensorData, UnaryOp};

pub(super) const NAMES: &[&str] = &[
    "ConvInteger",
    "DequantizeLinear",
    "DynamicQuantizeLinear",
    "MatMulInteger",
    "QLinearConv",
    "QLinearMatMul",
    "QuantizeLinear",
];

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "QuantizeLinear" => quantize_linear,
        "DequantizeLinear" => dequantize_linear,
        "DynamicQuantizeLinear" => dynamic_quantize_linear,
        "MatMulInteger" => matmul_integer,
        "QLinearMatMul" => qlinear_matmul,
        "ConvInteger" => conv_integer,
        "QLinearConv" => qlinear_conv,
        _ => return None,
    })
}

/// The representable range of an integer quantization dtype.
fn quant_range(dt: DType) -> Result<(f64, f64)> {
    Ok(match dt {
        DType::U8 => (0.0, 255.0),
        DType::I8 => (-128.0, 127.0),
        DType::U16 => (0.0, 65535.0),
        DType::I16 => (-32768.0, 32767.0),
        DType::I32 => (i32::MIN as f64, i32::MAX as f64),
        other => return Err(unsupported(format!("quantization to {other}"))),
    })
}

/// Lines a scale or zero point up with `x` (dims `xd`): a single value becomes a
/// scalar, a vector lies along `axis`, and a blocked tensor repeats each value
/// `block` times along `axis`.
fn align(cx: &Cx, v: NodeId, xd: &[usize], axis_attr: i64, block: usize) -> Result<NodeId> {
    let vd = cx.g.shape(v)?.dims().to_vec();
    let n: usize = vd.iter().product();
    if n == 1 {
        return cx.g.reshape(v, &[]);
    }
    // The axis only matters (and is only checked) for per-axis and blocked parameters.
    let axis = axis(axis_attr, xd.len())?;
    if block == 0 {
        if vd.len() != 1 || xd.get(axis) != Some(&n) {
            return Err(Error::invalid(
                "quantization parameter",
                format!("shape {vd:?} does not match axis {axis} of {xd:?}"),
            ));
        }
        let mut dims = vec![1; xd.len()];
        dims[axis] = n;
        return cx.g.reshape(v, &dims);
    }
    let blocks = xd[axis].div_ceil(block);
    let mut want = xd.to_vec();
    want[axis] = blocks;
    if vd != want {
        return Err(Error::invalid(
            "quantization parameter",
            format!(
                "blocked shape {vd:?} does not match {xd:?} in blocks of {block} along axis {axis}"
            ),
        ));
    }
    let idx: Vec<i64> = (0..xd[axis]).map(|i| (i / block) as i64).collect();
    let idx = cx.g.constant(TensorData::I64(idx), &[xd[axis]])?;
    cx.g.gather(v, idx, axis as isize)
}

fn quant_axis(cx: &Cx) -> Result<(i64, usize)> {
    Ok((
        cx.attr_i("axis", 1),
        size(cx.attr_i("block_size", 0), "block_size")?,
    ))
}

/// `saturate(round(v) + zp)` in `dt`, with `v` and `zp` in `F32`.
fn round_saturate(cx: &Cx, v: NodeId, zp: Option<NodeId>, dt: DType) -> Result<NodeId> {
    let (lo, hi) = quant_range(dt)?;
    let mut r = cx.g.unary(UnaryOp::Round, v)?;
    if let Some(z) = zp {
        r = cx.g.add(r, z)?;
    }
    let r = cx.g.binary(BinaryOp::Max, r, cx.g.scalar(lo, DType::F32))?;
    let r = cx.g.binary(BinaryOp::Min, r, cx.g.scalar(hi, DType::F32))?;
    cx.g.cast(r, dt)
}

fn f32_of(cx: &Cx, v: NodeId) -> Result<NodeId> {
    if cx.g.shape(v)?.dtype() == DType::F32 {
        Ok(v)
    } else {
        cx.g.cast(v, DType::F32)
    }
}

fn quantize_linear(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let xd = cx.dims(0)?;
    let (a, block) = quant_axis(cx)?;
    let out_dt = if cx.has(2) {
        cx.dtype(2)?
    } else if cx.attr_i("output_dtype", 0) != 0 {
        dtype_from_onnx(cx.attr_i("output_dtype", 0) as i32, "output_dtype")?
    } else {
        DType::U8
    };
    quant_range(out_dt)?;
    let x = cx.input(0)?;
    let x = f32_of(cx, x)?;
    let scale = cx.input(1)?;
    let scale = f32_of(cx, align(cx, scale, &xd, a, block)?)?;
    let zp = match cx.opt_input(2)? {
        Some(z) => Some(f32_of(cx, align(cx, z, &xd, a, block)?)?),
        None => None,
    };
    let v = cx.g.div(x, scale)?;
    Ok(vec![round_saturate(cx, v, zp, out_dt)?])
}

fn dequantize_linear(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let xd = cx.dims(0)?;
    let (a, block) = quant_axis(cx)?;
    let in_dt = cx.dtype(0)?;
    if !matches!(
        in_dt,
        DType::U8 | DType::I8 | DType::U16 | DType::I16 | DType::I32
    ) {
        return Err(unsupported(format!("dequantization of {in_dt}")));
    }
    let out_dt = if cx.attr_i("output_dtype", 0) != 0 {
        dtype_from_onnx(cx.attr_i("output_dtype", 0) as i32, "output_dtype")?
    } else {
        cx.dtype(1)?
    };
    let x = cx.input(0)?;
    let mut x = f32_of(cx, x)?;
    if let Some(z) = cx.opt_input(2)? {
        x = cx.g.sub(x, f32_of(cx, align(cx, z, &xd, a, block)?)?)?;
    }
    let scale = cx.input(1)?;
    let scale = f32_of(cx, align(cx, scale, &xd, a, block)?)?;
    let y = cx.g.mul(x, scale)?;
    Ok(vec![if out_dt == DType::F32 {
        y
    } else {
        cx.g.cast(y, out_dt)?
    }])
}

fn reduce_all(cx: &Cx, x: NodeId, op: ReduceOp) -> Result<NodeId> {
    let rank = cx.g.shape(x)?.rank();
    if rank == 0 {
        return Ok(x);
    }
    cx.g.push(
        Op::Reduce {
            op,
            axes: (0..rank).collect(),
            keepdims: false,
        },
        &[x],
    )
}

fn dynamic_quantize_linear(cx: &mut Cx) -> Result<Vec<NodeId>> {
    if cx.dtype(0)? != DType::F32 {
        return Err(unsupported(format!(
            "DynamicQuantizeLinear of {}",
            cx.dtype(0)?
        )));
    }
    if cx.shape(0)?.num_elements() == 0 {
        return Err(Error::invalid(
            "DynamicQuantizeLinear",
            "the input is empty",
        ));
    }
    let x = cx.input(0)?;
    let f = |v: f64| cx.g.scalar(v, DType::F32);
    let hi =
        cx.g.binary(BinaryOp::Max, reduce_all(cx, x, ReduceOp::Max)?, f(0.0))?;
    let lo =
        cx.g.binary(BinaryOp::Min, reduce_all(cx, x, ReduceOp::Min)?, f(0.0))?;
    // scale = (hi - lo) / 255, or 1 / 255 when the range is empty.
    let range = cx.g.sub(hi, lo)?;
    let flat = cx.g.binary(BinaryOp::Eq, hi, lo)?;
    let range = cx.g.select(flat, f(1.0), range)?;
    let scale = cx.g.div(range, f(255.0))?;
    let zp = cx.g.sub(f(0.0), cx.g.div(lo, scale)?)?;
    let zp = cx.g.binary(
        BinaryOp::Min,
        cx.g.binary(BinaryOp::Max, zp, f(0.0))?,
        f(255.0),
    )?;
    let zp = cx.g.unary(UnaryOp::Round, zp)?;
    let y = round_saturate(cx, cx.g.div(x, scale)?, Some(zp), DType::U8)?;
    Ok(vec![y, scale, cx.g.cast(zp, DType::U8)?])
}

/// `x - zp` in `F64` (exact for every integer of 32 bits or less); `zp_rows` lines a
/// per-row zero point up with the second-to-last axis.
fn centered(cx: &Cx, x: NodeId, zp: Option<NodeId>, zp_rows: bool) -> Result<NodeId> {
    let x = cx.g.cast(x, DType::F64)?;
    let Some(z) = zp else { return Ok(x) };
    let z = cx.g.cast(z, DType::F64)?;
    let zd = cx.g.shape(z)?.dims().to_vec();
    let n: usize = zd.iter().product();
    let z = if n == 1 {
        cx.g.reshape(z, &[])?
    } else if zp_rows && zd.len() == 1 {
        cx.g.reshape(z, &[n, 1])?
    } else {
        z
    };
    cx.g.sub(x, z)
}

fn check_int_operand(cx: &Cx, i: usize) -> Result<()> {
    let dt = cx.dtype(i)?;
    if !matches!(dt, DType::U8 | DType::I8) {
        return Err(unsupported(format!("integer product of {dt} operands")));
    }
    Ok(())
}

fn int_product(cx: &mut Cx, a: usize, azp: usize, b: usize, bzp: usize) -> Result<NodeId> {
    check_int_operand(cx, a)?;
    check_int_operand(cx, b)?;
    let (x, zx) = (cx.input(a)?, cx.opt_input(azp)?);
    let (y, zy) = (cx.input(b)?, cx.opt_input(bzp)?);
    let x = centered(cx, x, zx, true)?;
    let y = centered(cx, y, zy, false)?;
    cx.g.matmul(x, y)
}

fn matmul_integer(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let p = int_product(cx, 0, 2, 1, 3)?;
    Ok(vec![cx.g.cast(p, DType::I32)?])
}

/// `saturate(round(p * a_scale * b_scale / y_scale) + y_zp)`, the requantization of
/// an integer product `p` (in `F64`).
fn requantize(
    cx: &mut Cx,
    p: NodeId,
    scales: [usize; 3],
    y_zp: usize,
    channel_axis: Option<usize>,
) -> Result<NodeId> {
    // The scale ratio is formed in the scales' own dtype, as the operator's
    // reference does, then applied in F64.
    let mut s = Vec::new();
    for i in scales {
        let v = cx.input(i)?;
        let n = cx.shape(i)?.num_elements();
        s.push(match (n, channel_axis) {
            (1, _) => cx.g.reshape(v, &[])?,
            (n, Some(rank)) => {
                // Per output channel: axis 1 of an NCHW result.
                let mut dims = vec![1; rank];
                dims[1] = n;
                cx.g.reshape(v, &dims)?
            }
            (_, None) => v,
        });
    }
    let m = cx.g.div(cx.g.mul(s[0], s[1])?, s[2])?;
    let v = cx.g.mul(p, cx.g.cast(m, DType::F64)?)?;
    let out_dt = if cx.has(y_zp) {
        cx.dtype(y_zp)?
    } else {
        cx.dtype(0)?
    };
    let (lo, hi) = quant_range(out_dt)?;
    let mut r = cx.g.unary(UnaryOp::Round, v)?;
    if cx.has(y_zp) {
        let z = cx.g.cast(cx.input(y_zp)?, DType::F64)?;
        let z = if cx.shape(y_zp)?.num_elements() == 1 {
            cx.g.reshape(z, &[])?
        } else {
            z
        };
        r = cx.g.add(r, z)?;
    }
    let r = cx.g.binary(BinaryOp::Max, r, cx.g.scalar(lo, DType::F64))?;
    let r = cx.g.binary(BinaryOp::Min, r, cx.g.scalar(hi, DType::F64))?;
    cx.g.cast(r, out_dt)
}

fn qlinear_matmul(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let p = int_product(cx, 0, 2, 3, 5)?;
    Ok(vec![requantize(cx, p, [1, 4, 6], 7, None)?])
}

/// The centered integer convolution, in `F64`.
fn int_conv(cx: &mut Cx, x: usize, xzp: usize, w: usize, wzp: usize) -> Result<NodeId> {
    check_int_operand(cx, x)?;
    check_int_operand(cx, w)?;
    let (xv, zx) = (cx.input(x)?, cx.opt_input(xzp)?);
    let xv = centered(cx, xv, zx, false)?;
    let wv = cx.g.cast(cx.input(w)?, DType::F64)?;
    let wv = match cx.opt_input(wzp)? {
        Some(z) => {
            let rank = cx.shape(w)?.rank();
            let n = cx.shape(wzp)?.num_elements();
            let z = cx.g.cast(z, DType::F64)?;
            // Per output channel: axis 0 of the weight.
            let mut dims = vec![1; rank];
            dims[0] = n;
            let z = if n == 1 {
                cx.g.reshape(z, &[])?
            } else {
                cx.g.reshape(z, &dims)?
            };
            cx.g.sub(wv, z)?
        }
        None => wv,
    };
    conv_nodes(cx, xv, wv, None)
}

fn conv_integer(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let y = int_conv(cx, 0, 2, 1, 3)?;
    Ok(vec![cx.g.cast(y, DType::I32)?])
}

fn qlinear_conv(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let mut y = int_conv(cx, 0, 2, 3, 5)?;
    if let Some(b) = cx.opt_input(8)? {
        // The int32 bias is in the product's scale: add it before requantizing.
        let b = cx.g.cast(b, DType::F64)?;
        let n = cx.shape(8)?.num_elements();
        let rank = cx.shape(0)?.rank();
        let mut dims = vec![1; rank];
        dims[1] = n;
        y = cx.g.add(y, cx.g.reshape(b, &dims)?)?;
    }
    let rank = cx.shape(0)?.rank();
    Ok(vec![requantize(cx, y, [1, 4, 6], 7, Some(rank))?])
}
