//! Bounds-checked conversion between host `f32` values and device bytes of any dtype.
//! Lengths are checked before anything is written; nothing writes past a buffer.

use half::{bf16, f16};
use rlx_ir::{DType, Error, Result};

fn check_len(what: &str, dtype: DType, values: usize, bytes: usize) -> Result<()> {
    if values.checked_mul(dtype.size_in_bytes()) != Some(bytes) {
        return Err(Error::LengthMismatch {
            kind: "destination",
            name: format!("{what} ({dtype})"),
            expected: values.saturating_mul(dtype.size_in_bytes()),
            got: bytes,
            unit: "bytes",
        });
    }
    Ok(())
}

/// Encodes `src` as `dtype` into `dst` (which must be exactly `src.len()` elements).
/// Floats round to nearest; integers truncate toward zero, saturate at their range
/// and map NaN to 0; `Bool` is `v != 0`.
pub fn f32_to_bytes(src: &[f32], dtype: DType, dst: &mut [u8]) -> Result<()> {
    check_len("f32_to_bytes", dtype, src.len(), dst.len())?;
    // Fixed-size element chunks: a runtime-sized chunk made every element a `memcpy`
    // call (staging a 4 MB input cost more than the convolution reading it).
    macro_rules! encode {
        ($n:literal, |$v:ident| $bytes:expr) => {{
            let (elements, _) = dst.as_chunks_mut::<$n>();
            for (d, &$v) in elements.iter_mut().zip(src) {
                *d = $bytes;
            }
        }};
    }
    match dtype {
        DType::F32 => encode!(4, |v| v.to_le_bytes()),
        DType::F16 => encode!(2, |v| f16::from_f32(v).to_le_bytes()),
        DType::BF16 => encode!(2, |v| bf16::from_f32(v).to_le_bytes()),
        DType::F64 => encode!(8, |v| f64::from(v).to_le_bytes()),
        DType::I8 => encode!(1, |v| [(v as i8) as u8]),
        DType::I32 => encode!(4, |v| (v as i32).to_le_bytes()),
        DType::I64 => encode!(8, |v| (v as i64).to_le_bytes()),
        DType::U8 => encode!(1, |v| [v as u8]),
        DType::I16 => encode!(2, |v| (v as i16).to_le_bytes()),
        DType::U16 => encode!(2, |v| (v as u16).to_le_bytes()),
        DType::U32 => encode!(4, |v| (v as u32).to_le_bytes()),
        DType::U64 => encode!(8, |v| (v as u64).to_le_bytes()),
        DType::Bool => encode!(1, |v| [u8::from(v != 0.0)]),
    }
    Ok(())
}

/// Decodes `src` bytes of `dtype` into `dst` as `f32` (which must be exactly the
/// number of elements in `src`). Values outside `f32`'s range become infinities;
/// large integers round.
pub fn bytes_to_f32(src: &[u8], dtype: DType, dst: &mut [f32]) -> Result<()> {
    check_len("bytes_to_f32", dtype, dst.len(), src.len())?;
    macro_rules! decode {
        ($n:literal, |$s:ident| $value:expr) => {{
            let (elements, _) = src.as_chunks::<$n>();
            for (&$s, d) in elements.iter().zip(dst.iter_mut()) {
                *d = $value;
            }
        }};
    }
    match dtype {
        DType::F32 => decode!(4, |s| f32::from_le_bytes(s)),
        DType::F16 => decode!(2, |s| f16::from_le_bytes(s).to_f32()),
        DType::BF16 => decode!(2, |s| bf16::from_le_bytes(s).to_f32()),
        DType::F64 => decode!(8, |s| f64::from_le_bytes(s) as f32),
        DType::I8 => decode!(1, |s| f32::from(s[0] as i8)),
        DType::I32 => decode!(4, |s| i32::from_le_bytes(s) as f32),
        DType::I64 => decode!(8, |s| i64::from_le_bytes(s) as f32),
        DType::U8 | DType::Bool => decode!(1, |s| f32::from(s[0])),
        DType::I16 => decode!(2, |s| f32::from(i16::from_le_bytes(s))),
        DType::U16 => decode!(2, |s| f32::from(u16::from_le_bytes(s))),
        DType::U32 => decode!(4, |s| u32::from_le_bytes(s) as f32),
        DType::U64 => decode!(8, |s| u64::from_le_bytes(s) as f32),
    }
    Ok(())
}

/// `f32` values encoded as a fresh byte vector of `dtype`.
pub fn f32_to_vec(src: &[f32], dtype: DType) -> Vec<u8> {
    let mut out = vec![0u8; src.len() * dtype.size_in_bytes()];
    // Sized from `src`, so the length check cannot fail.
    let _ = f32_to_bytes(src, dtype, &mut out);
    out
}

/// Bytes of `dtype` decoded into a fresh `f32` vector; the byte count must be a
/// whole number of elements.
pub fn bytes_to_f32_vec(src: &[u8], dtype: DType) -> Result<Vec<f32>> {
    if !src.len().is_multiple_of(dtype.size_in_bytes()) {
        return Err(Error::invalid(
            "bytes_to_f32",
            format!(
                "{} bytes is not a whole number of {dtype} elements",
                src.len()
            ),
        ));
    }
    let mut out = vec![0f32; src.len() / dtype.size_in_bytes()];
    bytes_to_f32(src, dtype, &mut out)?;
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_checks_lengths() {
        let vals = [0.0f32, 1.5, -2.25, 1024.0];
        for dt in [DType::F32, DType::F16, DType::BF16, DType::F64] {
            let bytes = f32_to_vec(&vals, dt);
            assert_eq!(bytes_to_f32_vec(&bytes, dt).unwrap(), vals, "{dt}");
        }
        let ints = f32_to_vec(&[3.9, -3.9, 300.0], DType::I8);
        assert_eq!(ints, vec![3, (-3i8) as u8, 127]);
        let mut short = [0u8; 7];
        assert!(f32_to_bytes(&vals, DType::F16, &mut short).is_err());
        assert_eq!(short, [0u8; 7], "nothing written on a rejected call");
        let mut dst = [0f32; 3];
        assert!(bytes_to_f32(&[0u8; 8], DType::F32, &mut dst).is_err());
        assert!(bytes_to_f32_vec(&[0u8; 3], DType::F16).is_err());
        assert_eq!(
            f32_to_vec(&[0.1], DType::BF16),
            bf16::from_f32(0.1).to_le_bytes().to_vec()
        );
    }
}
