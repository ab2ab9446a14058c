//! Elementwise ops: unary, binary (numpy broadcasting), where, cast.

use super::{broadcast_source, int_domain, mismatch, require_numeric, same_dtype, unravel};
use crate::reference::HostTensor;
use crate::scalar::{binary_f64, binary_i64, unary_f64, unary_i64};
use crate::shape::broadcast_dims;
use crate::{BinaryOp, DType, Error, Graph, NodeId, Op, Result, Shape, UnaryOp};

macro_rules! unary_builders {
    ($($(#[$doc:meta])* $name:ident => $op:ident),* $(,)?) => {
        impl Graph {
            $($(#[$doc])* pub fn $name(&self, x: NodeId) -> Result<NodeId> {
                self.unary(UnaryOp::$op, x)
            })*
        }
    };
}

macro_rules! binary_builders {
    ($($(#[$doc:meta])* $name:ident => $op:ident),* $(,)?) => {
        impl Graph {
            $($(#[$doc])* pub fn $name(&self, a: NodeId, b: NodeId) -> Result<NodeId> {
                self.binary(BinaryOp::$op, a, b)
            })*
        }
    };
}

unary_builders! {
    /// `-x`.
    neg => Neg,
    /// `|x|`.
    abs => Abs,
    /// `e^x` (float).
    exp => Exp,
    /// Natural log (float).
    log => Log,
    /// Square root (float).
    sqrt => Sqrt,
    /// `1/sqrt(x)` (float).
    rsqrt => Rsqrt,
    /// `1/x` (float).
    reciprocal => Reciprocal,
    /// tanh (float).
    tanh => Tanh,
    /// Logistic sigmoid (float).
    sigmoid => Sigmoid,
    /// `max(x, 0)`.
    relu => Relu,
    /// GELU with the exact erf form (float).
    gelu => Gelu,
    /// GELU, tanh approximation (float).
    gelu_tanh => GeluTanh,
    /// `x * sigmoid(x)` (float).
    silu => Silu,
    /// Error function (float).
    erf => Erf,
    /// Sine (float).
    sin => Sin,
    /// Cosine (float).
    cos => Cos,
    /// Round down (float).
    floor => Floor,
    /// Round up (float).
    ceil => Ceil,
    /// Round half to even (float).
    round => Round,
    /// Sign: -1, 0 or 1.
    sign => Sign,
    /// Logical not (bool).
    not => Not,
}

binary_builders! {
    /// `a + b`, broadcast.
    add => Add,
    /// `a - b`, broadcast.
    sub => Sub,
    /// `a * b`, broadcast.
    mul => Mul,
    /// `a / b`, broadcast (integers truncate; `x / 0` is 0 for integers).
    div => Div,
    /// `a ^ b`, broadcast.
    pow => Pow,
    /// Elementwise maximum, broadcast (NaN propagates).
    maximum => Max,
    /// Elementwise minimum, broadcast (NaN propagates).
    minimum => Min,
    /// Floored modulo (sign of `b`), broadcast.
    modulo => Mod,
    /// `a == b` (bool).
    eq => Eq,
    /// `a != b` (bool).
    ne => Ne,
    /// `a < b` (bool).
    lt => Lt,
    /// `a <= b` (bool).
    le => Le,
    /// `a > b` (bool).
    gt => Gt,
    /// `a >= b` (bool).
    ge => Ge,
    /// Logical and (bool operands).
    and => And,
    /// Logical or (bool operands).
    or => Or,
    /// Logical xor (bool operands).
    xor => Xor,
}

impl Graph {
    /// Any unary op.
    pub fn unary(&self, op: UnaryOp, x: NodeId) -> Result<NodeId> {
        self.push(Op::Unary(op), &[x])
    }

    /// Any binary op.
    pub fn binary(&self, op: BinaryOp, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.push(Op::Binary(op), &[a, b])
    }

    /// numpy `where`: `cond ? a : b`, all three broadcast; `cond` is bool.
    pub fn select(&self, cond: NodeId, a: NodeId, b: NodeId) -> Result<NodeId> {
        self.push(Op::Where, &[cond, a, b])
    }

    /// Converts to `dtype` (floats to integers truncate toward zero and wrap).
    pub fn cast(&self, x: NodeId, dtype: DType) -> Result<NodeId> {
        self.push(Op::Cast(dtype), &[x])
    }
}

pub(crate) fn infer_unary(op: UnaryOp, x: &Shape) -> Result<Shape> {
    let name = op.name();
    if op == UnaryOp::BitNot {
        require_integer(name, x)?;
    } else if op == UnaryOp::Not {
        if x.dtype() != DType::Bool {
            return Err(Error::dtype(
                format!("{name} (operand {x})"),
                "bool",
                x.dtype(),
            ));
        }
    } else if op.float_only() {
        super::require_float(name, x)?;
    } else {
        require_numeric(name, x)?;
    }
    Ok(x.clone())
}

pub(crate) fn infer_binary(op: BinaryOp, a: &Shape, b: &Shape) -> Result<Shape> {
    let name = op.name();
    same_dtype(name, a, b)?;
    let out_dtype = if op.is_logical() {
        if a.dtype() != DType::Bool {
            return Err(Error::dtype(
                format!("{name} (operand {a})"),
                "bool",
                a.dtype(),
            ));
        }
        DType::Bool
    } else if op.is_bitwise() {
        require_integer(name, a)?;
        a.dtype()
    } else if op.is_comparison() {
        if !matches!(op, BinaryOp::Eq | BinaryOp::Ne) {
            require_numeric(name, a)?;
        }
        DType::Bool
    } else {
        require_numeric(name, a)?;
        a.dtype()
    };
    let dims = broadcast_dims(a.dims(), b.dims())
        .ok_or_else(|| mismatch(name, a, b, "dimensions do not broadcast"))?;
    Ok(Shape::new(&dims, out_dtype))
}

fn require_integer(name: &str, x: &Shape) -> Result<()> {
    if x.dtype().is_float() || x.dtype() == DType::Bool {
        return Err(Error::dtype(
            format!("{name} (operand {x})"),
            "an integer",
            x.dtype(),
        ));
    }
    Ok(())
}

pub(crate) fn infer_where(c: &Shape, a: &Shape, b: &Shape) -> Result<Shape> {
    if c.dtype() != DType::Bool {
        return Err(Error::dtype(
            format!("where (condition {c})"),
            "bool",
            c.dtype(),
        ));
    }
    same_dtype("where", a, b)?;
    let ab = broadcast_dims(a.dims(), b.dims())
        .ok_or_else(|| mismatch("where", a, b, "branches do not broadcast"))?;
    let dims = broadcast_dims(c.dims(), &ab).ok_or_else(|| {
        mismatch(
            "where",
            c,
            a,
            "condition does not broadcast with the branches",
        )
    })?;
    Ok(Shape::new(&dims, a.dtype()))
}

pub(crate) fn eval_unary(op: UnaryOp, x: &HostTensor) -> HostTensor {
    let dtype = x.shape.dtype();
    let data = x
        .data
        .iter()
        .map(|&v| {
            let r = if int_domain(dtype) {
                unary_i64(op, v as i64) as f64
            } else {
                unary_f64(op, v)
            };
            dtype.round_value(r)
        })
        .collect();
    HostTensor::new(x.shape.clone(), data)
}

pub(crate) fn eval_binary(op: BinaryOp, a: &HostTensor, b: &HostTensor, out: &Shape) -> HostTensor {
    let int = int_domain(a.shape.dtype());
    let data = (0..out.num_elements())
        .map(|i| {
            let idx = unravel(i, out.dims());
            let x = a.data[broadcast_source(&idx, a.shape.dims())];
            let y = b.data[broadcast_source(&idx, b.shape.dims())];
            let r = if int {
                // Narrow to the output width in i64: the full product of two i32 values
                // does not survive a round trip through f64.
                out.dtype().wrap_int(binary_i64(op, x as i64, y as i64)) as f64
            } else {
                binary_f64(op, x, y)
            };
            out.dtype().round_value(r)
        })
        .collect();
    HostTensor::new(out.clone(), data)
}

pub(crate) fn eval_where(
    c: &HostTensor,
    a: &HostTensor,
    b: &HostTensor,
    out: &Shape,
) -> HostTensor {
    let data = (0..out.num_elements())
        .map(|i| {
            let idx = unravel(i, out.dims());
            if c.data[broadcast_source(&idx, c.shape.dims())] != 0.0 {
                a.data[broadcast_source(&idx, a.shape.dims())]
            } else {
                b.data[broadcast_source(&idx, b.shape.dims())]
            }
        })
        .collect();
    HostTensor::new(out.clone(), data)
}

pub(crate) fn eval_cast(x: &HostTensor, dtype: DType) -> HostTensor {
    let data = x.data.iter().map(|&v| dtype.round_value(v)).collect();
    HostTensor::new(x.shape.with_dtype(dtype), data)
}

#[cfg(test)]
mod tests {
    use crate::{DType, Error, Graph, Shape};

    #[test]
    fn broadcasting_and_errors() {
        let g = Graph::new("t");
        let a = g.input("a", Shape::new(&[2, 1, 4], DType::F32)).unwrap();
        let b = g.input("b", Shape::new(&[3, 1], DType::F32)).unwrap();
        let c = g.add(a, b).unwrap();
        assert_eq!(g.shape(c).unwrap(), Shape::new(&[2, 3, 4], DType::F32));
        let d = g.input("d", Shape::new(&[5], DType::F32)).unwrap();
        let err = g.mul(a, d).unwrap_err();
        assert!(matches!(err, Error::ShapeMismatch { ref op, .. } if op == "mul"));
        assert!(err.to_string().contains("f32[2, 1, 4]") && err.to_string().contains("f32[5]"));
        let i = g.input("i", Shape::new(&[4], DType::I32)).unwrap();
        assert!(matches!(g.add(a, i), Err(Error::DTypeMismatch { .. })));
        assert!(matches!(g.exp(i), Err(Error::DTypeMismatch { .. })));
        let m = g.lt(a, b).unwrap();
        assert_eq!(g.shape(m).unwrap().dtype(), DType::Bool);
        assert!(g.not(m).is_ok());
        assert!(g.not(a).is_err());
        assert!(g.select(m, a, b).is_ok());
        assert!(g.select(a, a, b).is_err());
    }
}
