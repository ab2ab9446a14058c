//! Elementwise operators: math, comparisons, logic, casts, and the activations that
//! are compositions of those.

use super::{Converter, scalar, unsupported};
use crate::import::Cx;
use crate::tensor::dtype_from_onnx;
use rlx_ir::{BinaryOp, DType, NodeId, Result, UnaryOp};

pub(super) const NAMES: &[&str] = &[
    "Abs",
    "Add",
    "And",
    "Cast",
    "CastLike",
    "Ceil",
    "Celu",
    "Clip",
    "Cos",
    "Cosh",
    "Div",
    "Elu",
    "Equal",
    "Erf",
    "Exp",
    "Floor",
    "Gelu",
    "Greater",
    "GreaterOrEqual",
    "HardSigmoid",
    "HardSwish",
    "Identity",
    "IsInf",
    "IsNaN",
    "LeakyRelu",
    "Less",
    "LessOrEqual",
    "Log",
    "Max",
    "Mean",
    "Min",
    "Mish",
    "Mod",
    "Mul",
    "Neg",
    "Not",
    "Or",
    "Pow",
    "PRelu",
    "Reciprocal",
    "Relu",
    "Round",
    "Selu",
    "Shrink",
    "Sigmoid",
    "Sign",
    "Sin",
    "Sinh",
    "Softplus",
    "Softsign",
    "Sqrt",
    "Sub",
    "Sum",
    "Swish",
    "Tan",
    "Tanh",
    "ThresholdedRelu",
    "Where",
    "Xor",
    "Asinh",
    "Acosh",
    "Atanh",
    "Atan",
    "Asin",
    "Acos",
    "BitwiseAnd",
    "BitwiseOr",
    "BitwiseXor",
    "BitwiseNot",
    "BitShift",
];

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "Identity" => |cx| Ok(vec![cx.input(0)?]),
        "Abs" => |cx| unary(cx, UnaryOp::Abs),
        "Neg" => |cx| unary(cx, UnaryOp::Neg),
        "Exp" => |cx| unary(cx, UnaryOp::Exp),
        "Log" => |cx| unary(cx, UnaryOp::Log),
        "Sqrt" => |cx| unary(cx, UnaryOp::Sqrt),
        "Reciprocal" => |cx| unary(cx, UnaryOp::Reciprocal),
        "Tanh" => |cx| unary(cx, UnaryOp::Tanh),
        "Sigmoid" => |cx| unary(cx, UnaryOp::Sigmoid),
        "Relu" => |cx| unary(cx, UnaryOp::Relu),
        "Erf" => |cx| unary(cx, UnaryOp::Erf),
        "Sin" => |cx| unary(cx, UnaryOp::Sin),
        "Cos" => |cx| unary(cx, UnaryOp::Cos),
        "Floor" => |cx| unary(cx, UnaryOp::Floor),
        "Ceil" => |cx| unary(cx, UnaryOp::Ceil),
        "Round" => |cx| unary(cx, UnaryOp::Round),
        "Sign" => |cx| unary(cx, UnaryOp::Sign),
        "Not" => |cx| unary(cx, UnaryOp::Not),
        "Atan" => |cx| unary(cx, UnaryOp::Atan),
        "Asin" => |cx| {
            // atan(x / sqrt(1 - x^2)); x = ±1 gives atan(±inf) = ±pi/2.
            let x = cx.input(0)?;
            let dt = cx.dtype(0)?;
            let c = cx.g.sqrt(cx.g.sub(scalar(cx, 1.0, dt), cx.g.mul(x, x)?)?)?;
            Ok(vec![cx.g.unary(UnaryOp::Atan, cx.g.div(x, c)?)?])
        },
        "Acos" => |cx| {
            // 2 atan(sqrt((1 - x) / (1 + x))), accurate near x = 1 where pi/2 - asin is not.
            let x = cx.input(0)?;
            let dt = cx.dtype(0)?;
            let one = scalar(cx, 1.0, dt);
            let q = cx.g.div(cx.g.sub(one, x)?, cx.g.add(one, x)?)?;
            let t = cx.g.unary(UnaryOp::Atan, cx.g.sqrt(q)?)?;
            Ok(vec![cx.g.mul(t, scalar(cx, 2.0, dt))?])
        },
        "BitwiseAnd" => |cx| binary(cx, BinaryOp::BitAnd),
        "BitwiseOr" => |cx| binary(cx, BinaryOp::BitOr),
        "BitwiseXor" => |cx| binary(cx, BinaryOp::BitXor),
        "BitwiseNot" => |cx| unary(cx, UnaryOp::BitNot),
        "BitShift" => |cx| match cx.attr_s("direction", "").as_str() {
            "LEFT" => binary(cx, BinaryOp::ShiftLeft),
            "RIGHT" => binary(cx, BinaryOp::ShiftRight),
            other => Err(unsupported(format!(
                "direction = '{other}' (expected LEFT or RIGHT)"
            ))),
        },
        "Add" => |cx| match super::nn::fold_channel_affine(cx, BinaryOp::Add)? {
            Some(y) => Ok(vec![y]),
            None => binary(cx, BinaryOp::Add),
        },
        "Sub" => |cx| binary(cx, BinaryOp::Sub),
        "Mul" => |cx| match super::nn::fold_channel_affine(cx, BinaryOp::Mul)? {
            Some(y) => Ok(vec![y]),
            None => binary(cx, BinaryOp::Mul),
        },
        "Div" => |cx| binary(cx, BinaryOp::Div),
        "Equal" => |cx| compare(cx, BinaryOp::Eq),
        "Less" => |cx| compare(cx, BinaryOp::Lt),
        "LessOrEqual" => |cx| compare(cx, BinaryOp::Le),
        "Greater" => |cx| compare(cx, BinaryOp::Gt),
        "GreaterOrEqual" => |cx| compare(cx, BinaryOp::Ge),
        "And" => |cx| binary(cx, BinaryOp::And),
        "Or" => |cx| binary(cx, BinaryOp::Or),
        "Xor" => |cx| binary(cx, BinaryOp::Xor),
        "Pow" => pow,
        "Mod" => modulo,
        "Max" => |cx| variadic(cx, BinaryOp::Max, false),
        "Min" => |cx| variadic(cx, BinaryOp::Min, false),
        "Sum" => |cx| variadic(cx, BinaryOp::Add, false),
        "Mean" => |cx| variadic(cx, BinaryOp::Add, true),
        "Where" => |cx| {
            let (c, a, b) = (cx.input(0)?, cx.input(1)?, cx.input(2)?);
            Ok(vec![cx.g.select(c, a, b)?])
        },
        "Cast" => cast,
        "CastLike" => |cx| {
            let (x, to) = (cx.input(0)?, cx.dtype(1)?);
            Ok(vec![cast_to(cx, x, to)?])
        },
        "Clip" => clip,
        "LeakyRelu" => |cx| {
            let alpha = cx.attr_f("alpha", 0.01) as f64;
            negative_slope(cx, alpha)
        },
        "PRelu" => prelu,
        "Elu" => |cx| {
            let alpha = cx.attr_f("alpha", 1.0) as f64;
            elu(cx, alpha, 1.0)
        },
        "Selu" => |cx| {
            let alpha = cx.attr_f("alpha", 1.673_263_2) as f64;
            let gamma = cx.attr_f("gamma", 1.050_701) as f64;
            elu(cx, alpha, gamma)
        },
        "Celu" => celu,
        "HardSigmoid" => |cx| {
            let alpha = cx.attr_f("alpha", 0.2) as f64;
            let beta = cx.attr_f("beta", 0.5) as f64;
            let x = cx.input(0)?;
            Ok(vec![hard_sigmoid(cx, x, alpha, beta)?])
        },
        "HardSwish" => |cx| {
            let x = cx.input(0)?;
            if cx.dtype(0)?.is_float() {
                return Ok(vec![cx.g.unary(UnaryOp::HardSwish, x)?]);
            }
            let h = hard_sigmoid(cx, x, 1.0 / 6.0, 0.5)?;
            Ok(vec![cx.g.mul(x, h)?])
        },
        "Softplus" => |cx| {
            let x = cx.input(0)?;
            Ok(vec![softplus(cx, x)?])
        },
        "Softsign" => |cx| {
            let x = cx.input(0)?;
            let dt = cx.dtype(0)?;
            let d = cx.g.add(cx.g.abs(x)?, scalar(cx, 1.0, dt))?;
            Ok(vec![cx.g.div(x, d)?])
        },
        "Mish" => |cx| {
            let x = cx.input(0)?;
            let t = cx.g.tanh(softplus(cx, x)?)?;
            Ok(vec![cx.g.mul(x, t)?])
        },
        "Swish" => |cx| {
            let x = cx.input(0)?;
            let alpha = cx.attr_f("alpha", 1.0) as f64;
            let ax = cx.g.mul(x, scalar(cx, alpha, cx.dtype(0)?))?;
            Ok(vec![cx.g.mul(x, cx.g.sigmoid(ax)?)?])
        },
        "ThresholdedRelu" => |cx| {
            let x = cx.input(0)?;
            let dt = cx.dtype(0)?;
            let alpha = cx.attr_f("alpha", 1.0) as f64;
            let keep = cx.g.gt(x, scalar(cx, alpha, dt))?;
            Ok(vec![cx.g.select(keep, x, scalar(cx, 0.0, dt))?])
        },
        "Shrink" => shrink,
        "Gelu" => |cx| match cx.attr_s("approximate", "none").as_str() {
            "none" => unary(cx, UnaryOp::Gelu),
            "tanh" => unary(cx, UnaryOp::GeluTanh),
            other => Err(unsupported(format!("approximate = '{other}'"))),
        },
        "IsNaN" => |cx| {
            let x = cx.input(0)?;
            Ok(vec![cx.g.binary(BinaryOp::Ne, x, x)?])
        },
        "IsInf" => is_inf,
        "Tan" => |cx| {
            let x = cx.input(0)?;
            Ok(vec![cx.g.div(cx.g.sin(x)?, cx.g.cos(x)?)?])
        },
        "Sinh" => |cx| hyperbolic(cx, -1.0),
        "Cosh" => |cx| hyperbolic(cx, 1.0),
        "Asinh" => |cx| inverse_hyperbolic(cx, 1.0),
        "Acosh" => |cx| inverse_hyperbolic(cx, -1.0),
        "Atanh" => |cx| {
            // 0.5 * log((1 + x) / (1 - x))
            let x = cx.input(0)?;
            let dt = cx.dtype(0)?;
            let one = scalar(cx, 1.0, dt);
            let q = cx.g.div(cx.g.add(one, x)?, cx.g.sub(one, x)?)?;
            Ok(vec![cx.g.mul(cx.g.log(q)?, scalar(cx, 0.5, dt))?])
        },
        _ => return None,
    })
}

fn unary(cx: &mut Cx, op: UnaryOp) -> Result<Vec<NodeId>> {
    let x = cx.input(0)?;
    Ok(vec![cx.g.unary(op, x)?])
}

fn binary(cx: &mut Cx, op: BinaryOp) -> Result<Vec<NodeId>> {
    let (a, b) = (cx.input(0)?, cx.input(1)?);
    Ok(vec![cx.g.binary(op, a, b)?])
}

/// Comparisons; booleans compare as bytes.
fn compare(cx: &mut Cx, op: BinaryOp) -> Result<Vec<NodeId>> {
    let (mut a, mut b) = (cx.input(0)?, cx.input(1)?);
    if cx.dtype(0)? == DType::Bool {
        a = cx.g.cast(a, DType::U8)?;
        b = cx.g.cast(b, DType::U8)?;
    }
    Ok(vec![cx.g.binary(op, a, b)?])
}

fn pow(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let (a, mut b) = (cx.input(0)?, cx.input(1)?);
    let dt = cx.dtype(0)?;
    if cx.dtype(1)? != dt {
        b = cx.g.cast(b, dt)?;
    }
    Ok(vec![cx.g.pow(a, b)?])
}

fn modulo(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let (a, b) = (cx.input(0)?, cx.input(1)?);
    let dt = cx.dtype(0)?;
    if cx.attr_i("fmod", 0) == 0 {
        if dt.is_float() {
            return Err(crate::ops::unsupported("Mod with fmod = 0 on floats"));
        }
        return Ok(vec![cx.g.binary(BinaryOp::Mod, a, b)?]);
    }
    // C fmod: the remainder of the quotient truncated toward zero.
    let q = cx.g.div(a, b)?;
    let t = if dt.is_float() {
        let neg = cx.g.lt(q, scalar(cx, 0.0, dt))?;
        cx.g.select(neg, cx.g.ceil(q)?, cx.g.floor(q)?)?
    } else {
        q
    };
    Ok(vec![cx.g.sub(a, cx.g.mul(t, b)?)?])
}

fn variadic(cx: &mut Cx, op: BinaryOp, mean: bool) -> Result<Vec<NodeId>> {
    let xs = cx.inputs()?;
    let (first, rest) = xs
        .split_first()
        .ok_or_else(|| rlx_ir::Error::invalid("operands", "needs at least one input"))?;
    let mut acc = *first;
    for &x in rest {
        acc = cx.g.binary(op, acc, x)?;
    }
    if mean {
        let n = scalar(cx, xs.len() as f64, cx.dtype(0)?);
        acc = cx.g.div(acc, n)?;
    }
    Ok(vec![acc])
}

fn cast(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let to = cx.attr_i("to", 0);
    let dt = dtype_from_onnx(to as i32, "Cast 'to'")?;
    let x = cx.input(0)?;
    Ok(vec![cast_to(cx, x, dt)?])
}

/// A cast that is a no-op when the dtype already matches.
pub(crate) fn cast_to(cx: &Cx, x: NodeId, to: DType) -> Result<NodeId> {
    if cx.g.shape(x)?.dtype() == to {
        return Ok(x);
    }
    cx.g.cast(x, to)
}

fn clip(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let mut x = cx.input(0)?;
    let dt = cx.dtype(0)?;
    let (lo, hi) = if cx.opset < 11 {
        let lo = cx
            .has_attr("min")
            .then(|| scalar(cx, cx.attr_f("min", 0.0) as f64, dt));
        let hi = cx
            .has_attr("max")
            .then(|| scalar(cx, cx.attr_f("max", 0.0) as f64, dt));
        (lo, hi)
    } else {
        (cx.opt_input(1)?, cx.opt_input(2)?)
    };
    if let Some(lo) = lo {
        x = cx.g.binary(BinaryOp::Max, x, lo)?;
    }
    if let Some(hi) = hi {
        x = cx.g.binary(BinaryOp::Min, x, hi)?;
    }
    Ok(vec![x])
}

/// `x < 0 ? alpha * x : x`.
fn negative_slope(cx: &mut Cx, alpha: f64) -> Result<Vec<NodeId>> {
    let x = cx.input(0)?;
    let dt = cx.dtype(0)?;
    let neg = cx.g.lt(x, scalar(cx, 0.0, dt))?;
    let scaled = cx.g.mul(x, scalar(cx, alpha, dt))?;
    Ok(vec![cx.g.select(neg, scaled, x)?])
}

fn prelu(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let (x, mut slope) = (cx.input(0)?, cx.input(1)?);
    let dt = cx.dtype(0)?;
    let (x_dims, slope_dims) = (cx.dims(0)?, cx.dims(1)?);
    // Before opset 7 there was no numpy broadcasting: a 1-D slope with one value per
    // channel applies along axis 1 (as older exporters wrote per-channel PReLU).
    if cx.opset < 7 && x_dims.len() >= 2 && slope_dims.len() == 1 && slope_dims[0] == x_dims[1] {
        let mut dims = vec![1; x_dims.len() - 1];
        dims[0] = x_dims[1];
        slope = cx.g.reshape(slope, &dims)?;
    }
    let neg = cx.g.lt(x, scalar(cx, 0.0, dt))?;
    Ok(vec![cx.g.select(neg, cx.g.mul(x, slope)?, x)?])
}

/// `gamma * (x > 0 ? x : alpha * (e^x - 1))` (Elu has gamma 1).
fn elu(cx: &mut Cx, alpha: f64, gamma: f64) -> Result<Vec<NodeId>> {
    let x = cx.input(0)?;
    let dt = cx.dtype(0)?;
    let pos = cx.g.gt(x, scalar(cx, 0.0, dt))?;
    let em1 = cx.g.sub(cx.g.exp(x)?, scalar(cx, 1.0, dt))?;
    let neg = cx.g.mul(em1, scalar(cx, alpha, dt))?;
    let mut y = cx.g.select(pos, x, neg)?;
    if gamma != 1.0 {
        y = cx.g.mul(y, scalar(cx, gamma, dt))?;
    }
    Ok(vec![y])
}

/// `max(0, x) + min(0, alpha * (e^(x / alpha) - 1))`.
fn celu(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let x = cx.input(0)?;
    let dt = cx.dtype(0)?;
    let alpha = cx.attr_f("alpha", 1.0) as f64;
    let zero = scalar(cx, 0.0, dt);
    let e = cx.g.exp(cx.g.div(x, scalar(cx, alpha, dt))?)?;
    let neg =
        cx.g.mul(cx.g.sub(e, scalar(cx, 1.0, dt))?, scalar(cx, alpha, dt))?;
    let a = cx.g.binary(BinaryOp::Max, x, zero)?;
    let b = cx.g.binary(BinaryOp::Min, neg, zero)?;
    Ok(vec![cx.g.add(a, b)?])
}

fn hard_sigmoid(cx: &Cx, x: NodeId, alpha: f64, beta: f64) -> Result<NodeId> {
    let dt = cx.g.shape(x)?.dtype();
    let y =
        cx.g.add(cx.g.mul(x, scalar(cx, alpha, dt))?, scalar(cx, beta, dt))?;
    let y = cx.g.binary(BinaryOp::Max, y, scalar(cx, 0.0, dt))?;
    cx.g.binary(BinaryOp::Min, y, scalar(cx, 1.0, dt))
}

fn softplus(cx: &Cx, x: NodeId) -> Result<NodeId> {
    let dt = cx.g.shape(x)?.dtype();
    cx.g.log(cx.g.add(cx.g.exp(x)?, scalar(cx, 1.0, dt))?)
}

fn shrink(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let x = cx.input(0)?;
    let dt = cx.dtype(0)?;
    let bias = cx.attr_f("bias", 0.0) as f64;
    let lambd = cx.attr_f("lambd", 0.5) as f64;
    let lo = cx.g.lt(x, scalar(cx, -lambd, dt))?;
    let hi = cx.g.gt(x, scalar(cx, lambd, dt))?;
    let plus = cx.g.add(x, scalar(cx, bias, dt))?;
    let minus = cx.g.sub(x, scalar(cx, bias, dt))?;
    let zero = scalar(cx, 0.0, dt);
    let y = cx.g.select(hi, minus, zero)?;
    Ok(vec![cx.g.select(lo, plus, y)?])
}

fn is_inf(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let x = cx.input(0)?;
    let dt = cx.dtype(0)?;
    let pos =
        cx.g.binary(BinaryOp::Eq, x, scalar(cx, f64::INFINITY, dt))?;
    let neg =
        cx.g.binary(BinaryOp::Eq, x, scalar(cx, f64::NEG_INFINITY, dt))?;
    let y = match (
        cx.attr_i("detect_positive", 1) != 0,
        cx.attr_i("detect_negative", 1) != 0,
    ) {
        (true, true) => cx.g.binary(BinaryOp::Or, pos, neg)?,
        (true, false) => pos,
        (false, true) => neg,
        (false, false) => cx.g.binary(BinaryOp::And, pos, neg)?,
    };
    Ok(vec![y])
}

/// `(e^x + sign * e^-x) / 2`: cosh with sign 1, sinh with sign -1.
fn hyperbolic(cx: &mut Cx, sign: f64) -> Result<Vec<NodeId>> {
    let x = cx.input(0)?;
    let dt = cx.dtype(0)?;
    let a = cx.g.exp(x)?;
    let b = cx.g.exp(cx.g.neg(x)?)?;
    let s = cx.g.add(a, cx.g.mul(b, scalar(cx, sign, dt))?)?;
    Ok(vec![cx.g.mul(s, scalar(cx, 0.5, dt))?])
}

/// `log(x + sqrt(x^2 + sign))`: asinh with sign 1, acosh with sign -1.
fn inverse_hyperbolic(cx: &mut Cx, sign: f64) -> Result<Vec<NodeId>> {
    let x = cx.input(0)?;
    let dt = cx.dtype(0)?;
    let r =
        cx.g.sqrt(cx.g.add(cx.g.mul(x, x)?, scalar(cx, sign, dt))?)?;
    Ok(vec![cx.g.log(cx.g.add(x, r)?)?])
}
