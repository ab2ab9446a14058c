//! Element types.

use std::fmt;

/// The element type of a tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum DType {
    /// IEEE 754 binary32.
    F32,
    /// IEEE 754 binary16.
    F16,
    /// bfloat16 (8-bit exponent, 7-bit mantissa).
    BF16,
    /// IEEE 754 binary64.
    F64,
    /// Signed 8-bit integer.
    I8,
    /// Signed 32-bit integer.
    I32,
    /// Signed 64-bit integer.
    I64,
    /// Unsigned 8-bit integer.
    U8,
    /// Signed 16-bit integer.
    I16,
    /// Unsigned 16-bit integer.
    U16,
    /// Unsigned 32-bit integer.
    U32,
    /// Unsigned 64-bit integer. Computed in the `i64` domain like every integer, so
    /// values at or above 2^63 order as negative numbers.
    U64,
    /// Boolean, stored as one byte holding 0 or 1.
    Bool,
}

impl DType {
    /// Every dtype, in declaration order.
    pub const ALL: [DType; 13] = [
        DType::F32,
        DType::F16,
        DType::BF16,
        DType::F64,
        DType::I8,
        DType::I32,
        DType::I64,
        DType::U8,
        DType::I16,
        DType::U16,
        DType::U32,
        DType::U64,
        DType::Bool,
    ];

    /// Bytes per element.
    pub const fn size_in_bytes(self) -> usize {
        match self {
            DType::F32 | DType::I32 | DType::U32 => 4,
            DType::F16 | DType::BF16 | DType::I16 | DType::U16 => 2,
            DType::F64 | DType::I64 | DType::U64 => 8,
            DType::I8 | DType::U8 | DType::Bool => 1,
        }
    }

    /// True for the floating-point types.
    pub const fn is_float(self) -> bool {
        matches!(self, DType::F32 | DType::F16 | DType::BF16 | DType::F64)
    }

    /// True for the integer types (not `Bool`).
    pub const fn is_int(self) -> bool {
        matches!(
            self,
            DType::I8
                | DType::I16
                | DType::I32
                | DType::I64
                | DType::U8
                | DType::U16
                | DType::U32
                | DType::U64
        )
    }

    /// True for types that support arithmetic (floats and integers).
    pub const fn is_numeric(self) -> bool {
        self.is_float() || self.is_int()
    }

    /// Short lowercase name, as printed in graphs and errors (`f32`, `bf16`, `bool`).
    pub const fn name(self) -> &'static str {
        match self {
            DType::F32 => "f32",
            DType::F16 => "f16",
            DType::BF16 => "bf16",
            DType::F64 => "f64",
            DType::I8 => "i8",
            DType::I32 => "i32",
            DType::I64 => "i64",
            DType::U8 => "u8",
            DType::I16 => "i16",
            DType::U16 => "u16",
            DType::U32 => "u32",
            DType::U64 => "u64",
            DType::Bool => "bool",
        }
    }

    /// Rounds an `f64` to the nearest value this dtype can hold, returned as `f64`.
    ///
    /// Floats round to nearest even; integers truncate toward zero and wrap to their
    /// width (NaN becomes 0); `Bool` maps non-zero to 1.
    pub fn round_value(self, v: f64) -> f64 {
        match self {
            DType::F64 => v,
            DType::F32 => v as f32 as f64,
            DType::F16 => half::f16::from_f64(v).to_f64(),
            DType::BF16 => half::bf16::from_f64(v).to_f64(),
            DType::Bool => (v != 0.0) as u8 as f64,
            _ => self.wrap_int(if v.is_nan() { 0 } else { v as i64 }) as f64,
        }
    }

    /// Wraps an `i64` to this integer dtype's width (two's complement), as `i64`.
    /// Float dtypes return the value unchanged; `Bool` maps non-zero to 1.
    pub fn wrap_int(self, v: i64) -> i64 {
        match self {
            DType::I8 => v as i8 as i64,
            DType::I32 => v as i32 as i64,
            DType::U8 => v as u8 as i64,
            DType::I16 => v as i16 as i64,
            DType::U16 => v as u16 as i64,
            DType::U32 => v as u32 as i64,
            DType::Bool => (v != 0) as i64,
            _ => v,
        }
    }
}

impl fmt::Display for DType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for DType {
    type Err = crate::Error;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        DType::ALL
            .into_iter()
            .find(|d| d.name() == s)
            .ok_or_else(|| crate::Error::InvalidArgument {
                context: "dtype".into(),
                message: format!("unknown dtype '{s}' (expected one of f32, f16, bf16, f64, i8, i16, i32, i64, u8, u16, u32, u64, bool)"),
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_and_names_round_trip() {
        for d in DType::ALL {
            assert_eq!(d.name().parse::<DType>().unwrap(), d);
            assert!(d.size_in_bytes() >= 1);
        }
        assert!("f8".parse::<DType>().is_err());
    }

    #[test]
    fn rounding_matches_storage() {
        assert_eq!(DType::F16.round_value(1.0009765625 + 1e-6), 1.0009765625);
        assert_eq!(DType::I8.round_value(130.0), -126.0);
        assert_eq!(DType::U8.round_value(-1.0), 255.0);
        assert_eq!(DType::I32.round_value(-2.7), -2.0);
        assert_eq!(DType::Bool.round_value(0.5), 1.0);
    }
}
