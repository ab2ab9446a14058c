//! Element types as Rust types, and dispatch from a runtime [`DType`] to them.

use half::{bf16, f16};

/// A stored element: converts to and from the two compute domains (`f64` for floats,
/// `i64` for integers and bools) with the rounding the IR defines.
pub(crate) trait Elem: Copy + Send + Sync + 'static {
    /// True for floating-point types.
    const FLOAT: bool;
    fn to_f64(self) -> f64;
    fn from_f64(v: f64) -> Self;
    fn to_i64(self) -> i64;
    fn from_i64(v: i64) -> Self;
}

/// A bool stored as one byte (0 or 1).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
#[repr(transparent)]
pub(crate) struct Bool8(pub u8);

macro_rules! float_elem {
    ($t:ty, $to:expr, $from:expr) => {
        impl Elem for $t {
            const FLOAT: bool = true;
            #[inline]
            fn to_f64(self) -> f64 {
                $to(self)
            }
            #[inline]
            fn from_f64(v: f64) -> Self {
                $from(v)
            }
            #[inline]
            fn to_i64(self) -> i64 {
                let v = $to(self);
                if v.is_nan() { 0 } else { v as i64 }
            }
            #[inline]
            fn from_i64(v: i64) -> Self {
                $from(v as f64)
            }
        }
    };
}

float_elem!(f32, |x: f32| x as f64, |v: f64| v as f32);
float_elem!(f64, |x: f64| x, |v: f64| v);
float_elem!(f16, |x: f16| x.to_f64(), f16::from_f64);
float_elem!(bf16, |x: bf16| x.to_f64(), bf16::from_f64);

macro_rules! int_elem {
    ($t:ty) => {
        impl Elem for $t {
            const FLOAT: bool = false;
            #[inline]
            fn to_f64(self) -> f64 {
                self as f64
            }
            #[inline]
            fn from_f64(v: f64) -> Self {
                (if v.is_nan() { 0 } else { v as i64 }) as $t
            }
            #[inline]
            fn to_i64(self) -> i64 {
                self as i64
            }
            #[inline]
            fn from_i64(v: i64) -> Self {
                v as $t
            }
        }
    };
}

int_elem!(i8);
int_elem!(i32);
int_elem!(i64);
int_elem!(u8);
int_elem!(i16);
int_elem!(u16);
int_elem!(u32);
int_elem!(u64);

impl Elem for Bool8 {
    const FLOAT: bool = false;
    fn to_f64(self) -> f64 {
        (self.0 != 0) as u8 as f64
    }
    fn from_f64(v: f64) -> Self {
        Bool8((v != 0.0) as u8)
    }
    fn to_i64(self) -> i64 {
        (self.0 != 0) as i64
    }
    fn from_i64(v: i64) -> Self {
        Bool8((v != 0) as u8)
    }
}

/// Runs `$body` with `$T` bound to the Rust type of `$dtype`.
macro_rules! with_dtype {
    ($dtype:expr, $T:ident => $body:expr) => {
        match $dtype {
            rlx_ir::DType::F32 => {
                type $T = f32;
                $body
            }
            rlx_ir::DType::F16 => {
                type $T = half::f16;
                $body
            }
            rlx_ir::DType::BF16 => {
                type $T = half::bf16;
                $body
            }
            rlx_ir::DType::F64 => {
                type $T = f64;
                $body
            }
            rlx_ir::DType::I8 => {
                type $T = i8;
                $body
            }
            rlx_ir::DType::I32 => {
                type $T = i32;
                $body
            }
            rlx_ir::DType::I64 => {
                type $T = i64;
                $body
            }
            rlx_ir::DType::U8 => {
                type $T = u8;
                $body
            }
            rlx_ir::DType::I16 => {
                type $T = i16;
                $body
            }
            rlx_ir::DType::U16 => {
                type $T = u16;
                $body
            }
            rlx_ir::DType::U32 => {
                type $T = u32;
                $body
            }
            rlx_ir::DType::U64 => {
                type $T = u64;
                $body
            }
            rlx_ir::DType::Bool => {
                type $T = $crate::elem::Bool8;
                $body
            }
        }
    };
}
pub(crate) use with_dtype;
