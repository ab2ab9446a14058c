//! Scalar definitions of the elementwise ops: the meaning of each op, shared by the
//! reference evaluator and the reference CPU kernels. Floats are computed in `f64`,
//! integers in `i64` (wrapping), then rounded to the node's dtype by the caller.

use crate::{BinaryOp, UnaryOp};

/// `sqrt(2 / pi)`, used by the tanh form of GELU.
const SQRT_2_OVER_PI: f64 = 0.797_884_560_802_865_4;

/// A unary op on a floating-point value.
pub fn unary_f64(op: UnaryOp, x: f64) -> f64 {
    match op {
        UnaryOp::Neg => -x,
        UnaryOp::Abs => x.abs(),
        UnaryOp::Exp => x.exp(),
        UnaryOp::Log => x.ln(),
        UnaryOp::Sqrt => x.sqrt(),
        UnaryOp::Rsqrt => 1.0 / x.sqrt(),
        UnaryOp::Reciprocal => 1.0 / x,
        UnaryOp::Tanh => x.tanh(),
        UnaryOp::Sigmoid => sigmoid(x),
        UnaryOp::Relu => {
            if x > 0.0 || x.is_nan() {
                x
            } else {
                0.0
            }
        }
        UnaryOp::Gelu => 0.5 * x * (1.0 + libm::erf(x / std::f64::consts::SQRT_2)),
        UnaryOp::GeluTanh => 0.5 * x * (1.0 + (SQRT_2_OVER_PI * (x + 0.044715 * x * x * x)).tanh()),
        UnaryOp::Silu => x * sigmoid(x),
        UnaryOp::Relu6 => relu6(x),
        UnaryOp::HardSwish => x * relu6(x + 3.0) / 6.0,
        UnaryOp::Erf => libm::erf(x),
        UnaryOp::Sin => x.sin(),
        UnaryOp::Cos => x.cos(),
        UnaryOp::Floor => x.floor(),
        UnaryOp::Ceil => x.ceil(),
        UnaryOp::Round => x.round_ties_even(),
        UnaryOp::Sign => {
            if x > 0.0 {
                1.0
            } else if x < 0.0 {
                -1.0
            } else {
                x
            }
        }
        UnaryOp::Not => (x == 0.0) as u8 as f64,
        UnaryOp::Atan => x.atan(),
        UnaryOp::BitNot => !(x as i64) as f64,
    }
}

/// `min(max(x, 0), 6)`, NaN passing through.
fn relu6(x: f64) -> f64 {
    if x.is_nan() { x } else { x.clamp(0.0, 6.0) }
}

/// A unary op on an integer or bool value (only the ops defined on integers).
pub fn unary_i64(op: UnaryOp, x: i64) -> i64 {
    match op {
        UnaryOp::Neg => x.wrapping_neg(),
        UnaryOp::Abs => x.wrapping_abs(),
        UnaryOp::Relu => x.max(0),
        UnaryOp::Sign => x.signum(),
        UnaryOp::Not => (x == 0) as i64,
        UnaryOp::BitNot => !x,
        // Float-only ops never reach integer data (the builder rejects them); treat the
        // value as exact and apply the float definition.
        other => unary_f64(other, x as f64) as i64,
    }
}

fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

/// A binary op on floating-point values; comparisons and logical ops give 0 or 1.
pub fn binary_f64(op: BinaryOp, a: f64, b: f64) -> f64 {
    match op {
        BinaryOp::Add => a + b,
        BinaryOp::Sub => a - b,
        BinaryOp::Mul => a * b,
        BinaryOp::Div => a / b,
        BinaryOp::Pow => a.powf(b),
        BinaryOp::Max => {
            if a.is_nan() || b.is_nan() {
                f64::NAN
            } else {
                a.max(b)
            }
        }
        BinaryOp::Min => {
            if a.is_nan() || b.is_nan() {
                f64::NAN
            } else {
                a.min(b)
            }
        }
        BinaryOp::Mod => {
            let r = a % b;
            if r != 0.0 && ((r < 0.0) != (b < 0.0)) {
                r + b
            } else {
                r
            }
        }
        BinaryOp::Eq => (a == b) as u8 as f64,
        BinaryOp::Ne => (a != b) as u8 as f64,
        BinaryOp::Lt => (a < b) as u8 as f64,
        BinaryOp::Le => (a <= b) as u8 as f64,
        BinaryOp::Gt => (a > b) as u8 as f64,
        BinaryOp::Ge => (a >= b) as u8 as f64,
        BinaryOp::And => ((a != 0.0) && (b != 0.0)) as u8 as f64,
        BinaryOp::Or => ((a != 0.0) || (b != 0.0)) as u8 as f64,
        BinaryOp::Xor => ((a != 0.0) != (b != 0.0)) as u8 as f64,
        // Bitwise ops never reach float data (the builder rejects them).
        op @ (BinaryOp::BitAnd
        | BinaryOp::BitOr
        | BinaryOp::BitXor
        | BinaryOp::ShiftLeft
        | BinaryOp::ShiftRight) => binary_i64(op, a as i64, b as i64) as f64,
    }
}

/// A binary op on integer or bool values (wrapping; `x / 0` and `x mod 0` give 0).
pub fn binary_i64(op: BinaryOp, a: i64, b: i64) -> i64 {
    match op {
        BinaryOp::Add => a.wrapping_add(b),
        BinaryOp::Sub => a.wrapping_sub(b),
        BinaryOp::Mul => a.wrapping_mul(b),
        BinaryOp::Div => {
            if b == 0 {
                0
            } else {
                a.wrapping_div(b)
            }
        }
        BinaryOp::Pow => int_pow(a, b),
        BinaryOp::Max => a.max(b),
        BinaryOp::Min => a.min(b),
        BinaryOp::Mod => {
            if b == 0 {
                0
            } else {
                let r = a.wrapping_rem(b);
                if r != 0 && ((r < 0) != (b < 0)) {
                    r + b
                } else {
                    r
                }
            }
        }
        BinaryOp::Eq => (a == b) as i64,
        BinaryOp::Ne => (a != b) as i64,
        BinaryOp::Lt => (a < b) as i64,
        BinaryOp::Le => (a <= b) as i64,
        BinaryOp::Gt => (a > b) as i64,
        BinaryOp::Ge => (a >= b) as i64,
        BinaryOp::And => ((a != 0) && (b != 0)) as i64,
        BinaryOp::Or => ((a != 0) || (b != 0)) as i64,
        BinaryOp::Xor => ((a != 0) != (b != 0)) as i64,
        BinaryOp::BitAnd => a & b,
        BinaryOp::BitOr => a | b,
        BinaryOp::BitXor => a ^ b,
        // The caller wraps the result to the dtype's width.
        BinaryOp::ShiftLeft => u32::try_from(b)
            .ok()
            .and_then(|s| (a as u64).checked_shl(s))
            .map_or(0, |v| v as i64),
        // Operands are unsigned values held in i64 (u64 as its bit pattern).
        BinaryOp::ShiftRight => u32::try_from(b)
            .ok()
            .and_then(|s| (a as u64).checked_shr(s))
            .map_or(0, |v| v as i64),
    }
}

/// Integer power with wrapping; negative exponents give the truncated result
/// (`1`, `±1` for a base of `-1`, else `0`).
fn int_pow(base: i64, exp: i64) -> i64 {
    if exp < 0 {
        return match base {
            1 => 1,
            -1 => {
                if exp % 2 == 0 {
                    1
                } else {
                    -1
                }
            }
            _ => 0,
        };
    }
    let (mut result, mut b, mut e) = (1i64, base, exp as u64);
    while e > 0 {
        if e & 1 == 1 {
            result = result.wrapping_mul(b);
        }
        b = b.wrapping_mul(b);
        e >>= 1;
    }
    result
}

/// A 32-bit integer hash with good avalanche (two multiply-xorshift rounds).
fn mix32(mut x: u32) -> u32 {
    x ^= x >> 16;
    x = x.wrapping_mul(0x7FEB_352D);
    x ^= x >> 15;
    x = x.wrapping_mul(0x846C_A68B);
    x ^ (x >> 16)
}

/// The stream key of `random_uniform` for `seed` and the run-time `key`.
pub fn random_stream(seed: u64, key: i64) -> u32 {
    let key = key as u64;
    mix32(
        mix32(seed as u32 ^ mix32((seed >> 32) as u32))
            ^ mix32(key as u32 ^ mix32((key >> 32) as u32)),
    )
}

/// Element `index` of `random_uniform` with stream key `stream` (from
/// [`random_stream`]): 24 random bits as a value in `[0, 1)`, exact in `f32`. Every
/// backend computes this same function.
pub fn random_uniform(stream: u32, index: u64) -> f64 {
    let h = mix32((index as u32).wrapping_mul(0x9E37_79B9) ^ stream ^ mix32((index >> 32) as u32));
    (h >> 8) as f64 / (1u32 << 24) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gelu_known_values() {
        assert!((unary_f64(UnaryOp::Gelu, 1.5) - 1.399_789).abs() < 1e-5);
        assert!((unary_f64(UnaryOp::Gelu, -0.5) + 0.154_269).abs() < 1e-5);
        assert_eq!(unary_f64(UnaryOp::Gelu, 0.0), 0.0);
        assert!((unary_f64(UnaryOp::GeluTanh, 1.5) - 1.399_572).abs() < 1e-5);
    }

    #[test]
    fn rounding_and_modulo() {
        assert_eq!(unary_f64(UnaryOp::Round, 2.5), 2.0);
        assert_eq!(unary_f64(UnaryOp::Round, -1.5), -2.0);
        assert_eq!(binary_f64(BinaryOp::Mod, -7.0, 3.0), 2.0);
        assert_eq!(binary_f64(BinaryOp::Mod, 7.0, -3.0), -2.0);
        assert_eq!(binary_i64(BinaryOp::Mod, -7, 3), 2);
        assert_eq!(binary_i64(BinaryOp::Div, -7, 2), -3);
        assert_eq!(binary_i64(BinaryOp::Div, 5, 0), 0);
        assert_eq!(binary_i64(BinaryOp::Pow, 3, 4), 81);
        assert_eq!(binary_i64(BinaryOp::Pow, 2, -1), 0);
        assert!(binary_f64(BinaryOp::Max, f64::NAN, 1.0).is_nan());
    }

    #[test]
    fn random_numbers_are_pinned() {
        // The values every backend must reproduce; a change to the hash changes
        // every dropout mask and so what a checkpoint resumes into.
        let stream = random_stream(5, 7);
        let first: Vec<f64> = (0..3).map(|i| random_uniform(stream, i)).collect();
        assert_eq!(
            first,
            [0.33469128608703613, 0.8433941602706909, 0.2765868902206421]
        );
        assert_ne!(random_stream(5, 7), random_stream(5, 8));
        assert_ne!(random_stream(5, 7), random_stream(6, 7));
        assert_ne!(random_stream(5, 1), random_stream(5, 1 << 32));
    }
}
