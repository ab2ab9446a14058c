//! Host tensor data in every dtype: owned ([`TensorData`]) and borrowed ([`TensorRef`]).

use crate::{DType, Error, Result};
use half::{bf16, f16};

/// Owned host data of one dtype, in row-major order.
#[derive(Clone, Debug, PartialEq)]
pub enum TensorData {
    /// `f32` values.
    F32(Vec<f32>),
    /// `f16` values.
    F16(Vec<f16>),
    /// `bf16` values.
    BF16(Vec<bf16>),
    /// `f64` values.
    F64(Vec<f64>),
    /// `i8` values.
    I8(Vec<i8>),
    /// `i32` values.
    I32(Vec<i32>),
    /// `i64` values.
    I64(Vec<i64>),
    /// `u8` values.
    U8(Vec<u8>),
    /// `i16` values.
    I16(Vec<i16>),
    /// `u16` values.
    U16(Vec<u16>),
    /// `u32` values.
    U32(Vec<u32>),
    /// `u64` values.
    U64(Vec<u64>),
    /// Booleans.
    Bool(Vec<bool>),
}

/// Borrowed host data of one dtype, in row-major order.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum TensorRef<'a> {
    /// `f32` values.
    F32(&'a [f32]),
    /// `f16` values.
    F16(&'a [f16]),
    /// `bf16` values.
    BF16(&'a [bf16]),
    /// `f64` values.
    F64(&'a [f64]),
    /// `i8` values.
    I8(&'a [i8]),
    /// `i32` values.
    I32(&'a [i32]),
    /// `i64` values.
    I64(&'a [i64]),
    /// `u8` values.
    U8(&'a [u8]),
    /// `i16` values.
    I16(&'a [i16]),
    /// `u16` values.
    U16(&'a [u16]),
    /// `u32` values.
    U32(&'a [u32]),
    /// `u64` values.
    U64(&'a [u64]),
    /// Booleans.
    Bool(&'a [bool]),
}

macro_rules! each_variant {
    ($value:expr, $v:ident => $body:expr) => {
        match $value {
            Self::F32($v) => $body,
            Self::F16($v) => $body,
            Self::BF16($v) => $body,
            Self::F64($v) => $body,
            Self::I8($v) => $body,
            Self::I32($v) => $body,
            Self::I64($v) => $body,
            Self::U8($v) => $body,
            Self::I16($v) => $body,
            Self::U16($v) => $body,
            Self::U32($v) => $body,
            Self::U64($v) => $body,
            Self::Bool($v) => $body,
        }
    };
}

impl TensorData {
    /// The dtype of the data.
    pub fn dtype(&self) -> DType {
        self.as_ref().dtype()
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        each_variant!(self, v => v.len())
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A borrowed view.
    pub fn as_ref(&self) -> TensorRef<'_> {
        match self {
            TensorData::F32(v) => TensorRef::F32(v),
            TensorData::F16(v) => TensorRef::F16(v),
            TensorData::BF16(v) => TensorRef::BF16(v),
            TensorData::F64(v) => TensorRef::F64(v),
            TensorData::I8(v) => TensorRef::I8(v),
            TensorData::I32(v) => TensorRef::I32(v),
            TensorData::I64(v) => TensorRef::I64(v),
            TensorData::U8(v) => TensorRef::U8(v),
            TensorData::I16(v) => TensorRef::I16(v),
            TensorData::U16(v) => TensorRef::U16(v),
            TensorData::U32(v) => TensorRef::U32(v),
            TensorData::U64(v) => TensorRef::U64(v),
            TensorData::Bool(v) => TensorRef::Bool(v),
        }
    }

    /// Converts `f64` values to `dtype`, rounding as [`DType::round_value`] does.
    pub fn from_f64(dtype: DType, values: &[f64]) -> TensorData {
        let it = values.iter().copied();
        match dtype {
            DType::F32 => TensorData::F32(it.map(|v| v as f32).collect()),
            DType::F16 => TensorData::F16(it.map(f16::from_f64).collect()),
            DType::BF16 => TensorData::BF16(it.map(bf16::from_f64).collect()),
            DType::F64 => TensorData::F64(it.collect()),
            DType::I8 => TensorData::I8(it.map(|v| DType::I8.round_value(v) as i8).collect()),
            DType::I32 => TensorData::I32(it.map(|v| DType::I32.round_value(v) as i32).collect()),
            DType::I64 => {
                TensorData::I64(it.map(|v| if v.is_nan() { 0 } else { v as i64 }).collect())
            }
            DType::U8 => TensorData::U8(it.map(|v| DType::U8.round_value(v) as u8).collect()),
            DType::I16 => TensorData::I16(it.map(|v| DType::I16.round_value(v) as i16).collect()),
            DType::U16 => TensorData::U16(it.map(|v| DType::U16.round_value(v) as u16).collect()),
            DType::U32 => TensorData::U32(it.map(|v| DType::U32.round_value(v) as u32).collect()),
            DType::U64 => TensorData::U64(
                it.map(|v| if v.is_nan() { 0 } else { v as i64 as u64 })
                    .collect(),
            ),
            DType::Bool => TensorData::Bool(it.map(|v| v != 0.0).collect()),
        }
    }

    /// Decodes little-endian bytes of `dtype`; the length must be a multiple of the
    /// element size.
    pub fn from_le_bytes(dtype: DType, bytes: &[u8]) -> Result<TensorData> {
        let size = dtype.size_in_bytes();
        if !bytes.len().is_multiple_of(size) {
            return Err(Error::invalid(
                "TensorData::from_le_bytes",
                format!(
                    "{} bytes is not a whole number of {dtype} elements",
                    bytes.len()
                ),
            ));
        }
        // Every number type decodes the same way: one copy of the bytes on a
        // little-endian machine, a conversion per element elsewhere.
        macro_rules! get {
            ($t:ty) => {{
                #[cfg(target_endian = "little")]
                let values = values_from_le_bytes::<$t>(bytes);
                #[cfg(not(target_endian = "little"))]
                let values = bytes
                    .chunks_exact(size)
                    .map(|c| <$t>::from_le_bytes(c.try_into().unwrap_or_default()))
                    .collect();
                values
            }};
        }
        Ok(match dtype {
            DType::F32 => TensorData::F32(get!(f32)),
            DType::F16 => TensorData::F16(get!(f16)),
            DType::BF16 => TensorData::BF16(get!(bf16)),
            DType::F64 => TensorData::F64(get!(f64)),
            DType::I8 => TensorData::I8(get!(i8)),
            DType::I32 => TensorData::I32(get!(i32)),
            DType::I64 => TensorData::I64(get!(i64)),
            DType::U8 => TensorData::U8(bytes.to_vec()),
            DType::I16 => TensorData::I16(get!(i16)),
            DType::U16 => TensorData::U16(get!(u16)),
            DType::U32 => TensorData::U32(get!(u32)),
            DType::U64 => TensorData::U64(get!(u64)),
            DType::Bool => TensorData::Bool(bytes.iter().map(|&b| b != 0).collect()),
        })
    }
}

impl<'a> TensorRef<'a> {
    /// The dtype of the data.
    pub fn dtype(&self) -> DType {
        match self {
            TensorRef::F32(_) => DType::F32,
            TensorRef::F16(_) => DType::F16,
            TensorRef::BF16(_) => DType::BF16,
            TensorRef::F64(_) => DType::F64,
            TensorRef::I8(_) => DType::I8,
            TensorRef::I32(_) => DType::I32,
            TensorRef::I64(_) => DType::I64,
            TensorRef::U8(_) => DType::U8,
            TensorRef::I16(_) => DType::I16,
            TensorRef::U16(_) => DType::U16,
            TensorRef::U32(_) => DType::U32,
            TensorRef::U64(_) => DType::U64,
            TensorRef::Bool(_) => DType::Bool,
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        each_variant!(self, v => v.len())
    }

    /// True when there are no elements.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// An owned copy.
    pub fn to_owned(&self) -> TensorData {
        match *self {
            TensorRef::F32(v) => TensorData::F32(v.to_vec()),
            TensorRef::F16(v) => TensorData::F16(v.to_vec()),
            TensorRef::BF16(v) => TensorData::BF16(v.to_vec()),
            TensorRef::F64(v) => TensorData::F64(v.to_vec()),
            TensorRef::I8(v) => TensorData::I8(v.to_vec()),
            TensorRef::I32(v) => TensorData::I32(v.to_vec()),
            TensorRef::I64(v) => TensorData::I64(v.to_vec()),
            TensorRef::U8(v) => TensorData::U8(v.to_vec()),
            TensorRef::I16(v) => TensorData::I16(v.to_vec()),
            TensorRef::U16(v) => TensorData::U16(v.to_vec()),
            TensorRef::U32(v) => TensorData::U32(v.to_vec()),
            TensorRef::U64(v) => TensorData::U64(v.to_vec()),
            TensorRef::Bool(v) => TensorData::Bool(v.to_vec()),
        }
    }

    /// The values widened to `f64` (exact for every dtype except 64-bit integers beyond
    /// 2^53; `u64` is read through `i64`, as every integer op computes).
    pub fn to_f64_vec(&self) -> Vec<f64> {
        match *self {
            TensorRef::F32(v) => v.iter().map(|&x| x as f64).collect(),
            TensorRef::F16(v) => v.iter().map(|x| x.to_f64()).collect(),
            TensorRef::BF16(v) => v.iter().map(|x| x.to_f64()).collect(),
            TensorRef::F64(v) => v.to_vec(),
            TensorRef::I8(v) => v.iter().map(|&x| x as f64).collect(),
            TensorRef::I32(v) => v.iter().map(|&x| x as f64).collect(),
            TensorRef::I64(v) => v.iter().map(|&x| x as f64).collect(),
            TensorRef::U8(v) => v.iter().map(|&x| x as f64).collect(),
            TensorRef::I16(v) => v.iter().map(|&x| x as f64).collect(),
            TensorRef::U16(v) => v.iter().map(|&x| x as f64).collect(),
            TensorRef::U32(v) => v.iter().map(|&x| x as f64).collect(),
            // The integer domain is i64: u64 values at or above 2^63 read as negative.
            TensorRef::U64(v) => v.iter().map(|&x| x as i64 as f64).collect(),
            TensorRef::Bool(v) => v.iter().map(|&x| x as u8 as f64).collect(),
        }
    }

    /// Writes the values as little-endian bytes into `dst`, which must hold exactly
    /// `len() * dtype().size_in_bytes()` bytes.
    pub fn write_le_bytes(&self, dst: &mut [u8]) -> Result<()> {
        let size = self.dtype().size_in_bytes();
        if dst.len() != self.len() * size {
            return Err(Error::LengthMismatch {
                kind: "destination",
                name: format!("{} buffer", self.dtype()),
                expected: self.len() * size,
                got: dst.len(),
                unit: "bytes",
            });
        }
        // One copy on a little-endian machine (a 4-byte copy per element was a
        // third of a large matrix product's run); a conversion per element elsewhere.
        macro_rules! put {
            ($v:expr) => {{
                #[cfg(target_endian = "little")]
                dst.copy_from_slice(pod_bytes($v));
                #[cfg(not(target_endian = "little"))]
                for (d, x) in dst.chunks_exact_mut(size).zip($v.iter()) {
                    d.copy_from_slice(&x.to_le_bytes());
                }
            }};
        }
        match *self {
            TensorRef::F32(v) => put!(v),
            TensorRef::F16(v) => put!(v),
            TensorRef::BF16(v) => put!(v),
            TensorRef::F64(v) => put!(v),
            TensorRef::I8(v) => put!(v),
            TensorRef::I32(v) => put!(v),
            TensorRef::I64(v) => put!(v),
            TensorRef::U8(v) => dst.copy_from_slice(v),
            TensorRef::I16(v) => put!(v),
            TensorRef::U16(v) => put!(v),
            TensorRef::U32(v) => put!(v),
            TensorRef::U64(v) => put!(v),
            TensorRef::Bool(v) => {
                for (d, &x) in dst.iter_mut().zip(v) {
                    *d = x as u8;
                }
            }
        }
        Ok(())
    }

    /// The values as a fresh little-endian byte vector.
    pub fn to_le_bytes(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.len() * self.dtype().size_in_bytes()];
        // The length is computed from self, so this cannot fail.
        let _ = self.write_le_bytes(&mut out);
        out
    }
}

impl<'a> From<&'a [f32]> for TensorRef<'a> {
    fn from(v: &'a [f32]) -> Self {
        TensorRef::F32(v)
    }
}

/// The bytes of a slice of plain numbers, as they lie in memory.
///
/// Only for the number types of [`TensorRef`]: no padding, no invalid bit patterns.
#[cfg(target_endian = "little")]
fn pod_bytes<T: Copy>(values: &[T]) -> &[u8] {
    // SAFETY: `T` is a plain number type (see above); the byte view covers exactly the
    // slice's memory and borrows it immutably.
    unsafe {
        std::slice::from_raw_parts(values.as_ptr().cast::<u8>(), std::mem::size_of_val(values))
    }
}

/// The values of `T` whose little-endian bytes `bytes` holds (a whole number of
/// them), copied once into a new vector: not zeroed first, which for a large output
/// was a second pass over memory on every run.
#[cfg(target_endian = "little")]
fn values_from_le_bytes<T: Copy>(bytes: &[u8]) -> Vec<T> {
    debug_assert!(bytes.len().is_multiple_of(std::mem::size_of::<T>()));
    let len = bytes.len() / std::mem::size_of::<T>();
    let mut out = Vec::<T>::with_capacity(len);
    // SAFETY: the vector has room for `len` values, `len * size_of::<T>()` bytes,
    // all of them copied; every bit pattern is a valid value of the number types
    // this is used for (not bool), so the copied values are initialized.
    unsafe {
        std::ptr::copy_nonoverlapping(
            bytes.as_ptr(),
            out.as_mut_ptr().cast::<u8>(),
            len * std::mem::size_of::<T>(),
        );
        out.set_len(len);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_round_trip_every_dtype() {
        let vals = [0.0, 1.0, -2.0, 3.0, 100.0];
        for d in DType::ALL {
            let data = TensorData::from_f64(d, &vals);
            let bytes = data.as_ref().to_le_bytes();
            assert_eq!(bytes.len(), vals.len() * d.size_in_bytes());
            assert_eq!(TensorData::from_le_bytes(d, &bytes).unwrap(), data, "{d}");
        }
        // The byte order itself, not only the round trip.
        assert_eq!(
            TensorRef::F32(&[1.0, -2.0]).to_le_bytes(),
            [0, 0, 128, 63, 0, 0, 0, 192]
        );
        assert_eq!(
            TensorRef::I64(&[-2]).to_le_bytes(),
            [254, 255, 255, 255, 255, 255, 255, 255]
        );
        assert_eq!(TensorRef::U16(&[0x1234]).to_le_bytes(), [0x34, 0x12]);
        assert_eq!(
            TensorData::from_le_bytes(DType::I32, &[1, 2, 0, 128]).unwrap(),
            TensorData::I32(vec![i32::from_le_bytes([1, 2, 0, 128])])
        );
        assert_eq!(
            TensorData::from_le_bytes(DType::F16, &[0, 60]).unwrap(),
            TensorData::F16(vec![f16::ONE])
        );
        assert!(TensorData::from_le_bytes(DType::F32, &[0u8; 5]).is_err());
        assert!(
            TensorRef::F32(&[1.0])
                .write_le_bytes(&mut [0u8; 3])
                .is_err()
        );
    }
}
