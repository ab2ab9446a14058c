//! ONNX element types and `TensorProto` decoding (inline typed fields, `raw_data`, or
//! external data files), with every length checked against the declared dims.

use crate::proto::TensorProto;
use half::{bf16, f16};
use rlx_ir::{DType, Error, Result, TensorData};
use std::path::Path;

/// The RLX dtype of an ONNX `TensorProto.DataType` code, or an error naming the type.
pub fn dtype_from_onnx(code: i32, context: &str) -> Result<DType> {
    Ok(match code {
        1 => DType::F32,
        2 => DType::U8,
        3 => DType::I8,
        4 => DType::U16,
        5 => DType::I16,
        6 => DType::I32,
        7 => DType::I64,
        9 => DType::Bool,
        10 => DType::F16,
        11 => DType::F64,
        12 => DType::U32,
        13 => DType::U64,
        16 => DType::BF16,
        other => {
            return Err(Error::Unsupported {
                device: "onnx import".into(),
                what: format!("{context}: element type {}", onnx_type_name(other)),
            });
        }
    })
}

/// The ONNX name of an element type code (`FLOAT`, `INT64`, ...).
pub fn onnx_type_name(code: i32) -> String {
    let name = match code {
        0 => "UNDEFINED",
        1 => "FLOAT",
        2 => "UINT8",
        3 => "INT8",
        4 => "UINT16",
        5 => "INT16",
        6 => "INT32",
        7 => "INT64",
        8 => "STRING",
        9 => "BOOL",
        10 => "FLOAT16",
        11 => "DOUBLE",
        12 => "UINT32",
        13 => "UINT64",
        14 => "COMPLEX64",
        15 => "COMPLEX128",
        16 => "BFLOAT16",
        17 => "FLOAT8E4M3FN",
        18 => "FLOAT8E4M3FNUZ",
        19 => "FLOAT8E5M2",
        20 => "FLOAT8E5M2FNUZ",
        21 => "UINT4",
        22 => "INT4",
        23 => "FLOAT4E2M1",
        24 => "FLOAT8E8M0",
        25 => "UINT2",
        26 => "INT2",
        _ => return format!("code {code}"),
    };
    name.to_string()
}

/// The ONNX element type code of an RLX dtype.
pub fn dtype_to_onnx(dtype: DType) -> i32 {
    match dtype {
        DType::F32 => 1,
        DType::U8 => 2,
        DType::I8 => 3,
        DType::I32 => 6,
        DType::I64 => 7,
        DType::Bool => 9,
        DType::F16 => 10,
        DType::F64 => 11,
        DType::BF16 => 16,
        DType::I16 => 5,
        DType::U16 => 4,
        DType::U32 => 12,
        DType::U64 => 13,
    }
}

/// Checked dims of a tensor: every dim non-negative, the element count and the byte
/// size within `isize::MAX`.
pub fn checked_dims(dims: &[i64], dtype: DType, context: &str) -> Result<Vec<usize>> {
    let mut out = Vec::with_capacity(dims.len());
    let mut count: usize = 1;
    for &d in dims {
        let d = usize::try_from(d)
            .map_err(|_| Error::invalid(context, format!("negative dimension {d} in {dims:?}")))?;
        count = count
            .checked_mul(d)
            .ok_or_else(|| too_large(context, dims))?;
        out.push(d);
    }
    let bytes = count
        .checked_mul(dtype.size_in_bytes())
        .ok_or_else(|| too_large(context, dims))?;
    if bytes > isize::MAX as usize {
        return Err(too_large(context, dims));
    }
    Ok(out)
}

fn too_large(context: &str, dims: &[i64]) -> Error {
    Error::invalid(
        context,
        format!("dimensions {dims:?} describe more bytes than memory can address"),
    )
}

/// A decoded tensor: dims and row-major data.
#[derive(Clone, Debug, PartialEq)]
pub struct Tensor {
    /// Dimensions, outermost first.
    pub dims: Vec<usize>,
    /// The values.
    pub data: TensorData,
}

impl Tensor {
    /// Number of elements.
    pub fn len(&self) -> usize {
        self.data.len()
    }

    /// True when the tensor has no elements.
    pub fn is_empty(&self) -> bool {
        self.data.is_empty()
    }

    /// The values as `i64` (integers and bools exactly, floats truncated).
    pub fn to_i64_vec(&self) -> Vec<i64> {
        match &self.data {
            TensorData::I64(v) => v.clone(),
            TensorData::U64(v) => v.iter().map(|&x| x as i64).collect(),
            TensorData::U32(v) => v.iter().map(|&x| x as i64).collect(),
            TensorData::I16(v) => v.iter().map(|&x| x as i64).collect(),
            TensorData::U16(v) => v.iter().map(|&x| x as i64).collect(),
            TensorData::I32(v) => v.iter().map(|&x| x as i64).collect(),
            TensorData::I8(v) => v.iter().map(|&x| x as i64).collect(),
            TensorData::U8(v) => v.iter().map(|&x| x as i64).collect(),
            TensorData::Bool(v) => v.iter().map(|&x| x as i64).collect(),
            other => other
                .as_ref()
                .to_f64_vec()
                .iter()
                .map(|&x| x as i64)
                .collect(),
        }
    }

    /// The values as `f64`.
    pub fn to_f64_vec(&self) -> Vec<f64> {
        self.data.as_ref().to_f64_vec()
    }
}

/// Decodes a `TensorProto`. `base_dir` is where external data files are looked up
/// (the model file's directory); `context` names the tensor in errors.
pub fn decode_tensor(t: &TensorProto, base_dir: Option<&Path>, context: &str) -> Result<Tensor> {
    let code = t.data_type.unwrap_or(0);
    let dtype = dtype_from_onnx(code, context)?;
    let dims = checked_dims(&t.dims, dtype, context)?;
    let count: usize = dims.iter().product();
    if t.segment.is_some() {
        return Err(Error::Unsupported {
            device: "onnx import".into(),
            what: format!("{context}: segmented tensors"),
        });
    }
    let external = t.data_location == Some(1);
    let data = if external {
        let bytes = read_external(t, base_dir, context)?;
        from_raw(dtype, &bytes, count, context)?
    } else if let Some(raw) = &t.raw_data {
        from_raw(dtype, raw, count, context)?
    } else {
        from_typed_fields(t, dtype, count, context)?
    };
    Ok(Tensor { dims, data })
}

fn length_error(context: &str, expected: usize, got: usize, unit: &'static str) -> Error {
    Error::LengthMismatch {
        kind: "tensor",
        name: context.to_string(),
        expected,
        got,
        unit,
    }
}

fn from_raw(dtype: DType, raw: &[u8], count: usize, context: &str) -> Result<TensorData> {
    let expected = count * dtype.size_in_bytes();
    if raw.len() != expected {
        return Err(length_error(context, expected, raw.len(), "bytes"));
    }
    if dtype == DType::Bool {
        return Ok(TensorData::Bool(raw.iter().map(|&b| b != 0).collect()));
    }
    TensorData::from_le_bytes(dtype, raw)
}

fn check_len(context: &str, count: usize, got: usize) -> Result<()> {
    if got != count {
        return Err(length_error(context, count, got, "elements"));
    }
    Ok(())
}

fn from_typed_fields(
    t: &TensorProto,
    dtype: DType,
    count: usize,
    context: &str,
) -> Result<TensorData> {
    let ints = &t.int32_data;
    let from_ints = |data: TensorData| -> Result<TensorData> {
        check_len(context, count, ints.len())?;
        Ok(data)
    };
    Ok(match dtype {
        DType::F32 => {
            check_len(context, count, t.float_data.len())?;
            TensorData::F32(t.float_data.clone())
        }
        DType::F64 => {
            check_len(context, count, t.double_data.len())?;
            TensorData::F64(t.double_data.clone())
        }
        DType::I64 => {
            check_len(context, count, t.int64_data.len())?;
            TensorData::I64(t.int64_data.clone())
        }
        DType::U32 => {
            check_len(context, count, t.uint64_data.len())?;
            TensorData::U32(t.uint64_data.iter().map(|&x| x as u32).collect())
        }
        DType::U64 => {
            check_len(context, count, t.uint64_data.len())?;
            TensorData::U64(t.uint64_data.clone())
        }
        // The narrower types are stored widened in `int32_data`.
        DType::I32 => from_ints(TensorData::I32(ints.clone()))?,
        DType::I8 => from_ints(TensorData::I8(ints.iter().map(|&v| v as i8).collect()))?,
        DType::I16 => from_ints(TensorData::I16(ints.iter().map(|&v| v as i16).collect()))?,
        DType::U16 => from_ints(TensorData::U16(ints.iter().map(|&v| v as u16).collect()))?,
        DType::U8 => from_ints(TensorData::U8(ints.iter().map(|&v| v as u8).collect()))?,
        DType::Bool => from_ints(TensorData::Bool(ints.iter().map(|&v| v != 0).collect()))?,
        DType::F16 => from_ints(TensorData::F16(
            ints.iter().map(|&v| f16::from_bits(v as u16)).collect(),
        ))?,
        DType::BF16 => from_ints(TensorData::BF16(
            ints.iter().map(|&v| bf16::from_bits(v as u16)).collect(),
        ))?,
    })
}

fn external_field<'a>(t: &'a TensorProto, key: &str) -> Option<&'a str> {
    t.external_data
        .iter()
        .find(|e| e.key.as_deref() == Some(key))
        .and_then(|e| e.value.as_deref())
}

fn read_external(t: &TensorProto, base_dir: Option<&Path>, context: &str) -> Result<Vec<u8>> {
    let location = external_field(t, "location")
        .ok_or_else(|| Error::invalid(context, "external data without a 'location'"))?;
    let relative = Path::new(location);
    let safe = relative.components().all(|c| {
        matches!(
            c,
            std::path::Component::Normal(_) | std::path::Component::CurDir
        )
    });
    if !safe {
        return Err(Error::invalid(
            context,
            format!(
                "external data location '{location}' must be a relative path inside the model's directory"
            ),
        ));
    }
    let base = base_dir.ok_or_else(|| {
        Error::invalid(
            context,
            "external data needs the model's directory (load the model from a file)",
        )
    })?;
    let path = base.join(relative);
    let parse = |key: &str| -> Result<Option<u64>> {
        external_field(t, key)
            .map(|v| {
                v.parse::<u64>().map_err(|_| {
                    Error::invalid(
                        context,
                        format!("external data {key} '{v}' is not a number"),
                    )
                })
            })
            .transpose()
    };
    let offset = parse("offset")?.unwrap_or(0);
    let length = parse("length")?;
    let io = |e: std::io::Error| Error::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    };
    use std::io::{Read, Seek, SeekFrom};
    let mut file = std::fs::File::open(&path).map_err(io)?;
    let size = file.metadata().map_err(io)?.len();
    let length = length.unwrap_or(size.saturating_sub(offset));
    let end = offset.checked_add(length).filter(|&e| e <= size).ok_or_else(|| Error::Format {
        path: path.display().to_string(),
        message: format!("{context}: bytes {offset}..{offset}+{length} lie past the end of the file ({size} bytes)"),
    })?;
    let len = usize::try_from(end - offset).map_err(|_| too_large(context, &t.dims))?;
    let mut buf = Vec::new();
    buf.try_reserve_exact(len).map_err(|_| {
        Error::invalid(
            context,
            format!("cannot allocate {len} bytes for external data"),
        )
    })?;
    file.seek(SeekFrom::Start(offset)).map_err(io)?;
    file.take(len as u64).read_to_end(&mut buf).map_err(io)?;
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn proto(dtype: i32, dims: &[i64]) -> TensorProto {
        TensorProto {
            data_type: Some(dtype),
            dims: dims.to_vec(),
            ..Default::default()
        }
    }

    #[test]
    fn decodes_raw_and_typed_fields() {
        let mut t = proto(1, &[2]);
        t.raw_data = Some([1.5f32.to_le_bytes(), (-2.0f32).to_le_bytes()].concat());
        assert_eq!(
            decode_tensor(&t, None, "t").unwrap().data,
            TensorData::F32(vec![1.5, -2.0])
        );
        let mut t = proto(10, &[1]);
        t.int32_data = vec![f16::from_f32(0.5).to_bits() as i32];
        assert_eq!(
            decode_tensor(&t, None, "t").unwrap().data,
            TensorData::F16(vec![f16::from_f32(0.5)])
        );
        let mut t = proto(9, &[3]);
        t.int32_data = vec![1, 0, 1];
        assert_eq!(
            decode_tensor(&t, None, "t").unwrap().data,
            TensorData::Bool(vec![true, false, true])
        );
    }

    #[test]
    fn rejects_bad_lengths_dims_and_types() {
        let mut t = proto(7, &[3]);
        t.int64_data = vec![1, 2];
        assert!(matches!(
            decode_tensor(&t, None, "t"),
            Err(Error::LengthMismatch { .. })
        ));
        let t = proto(1, &[-1]);
        assert!(
            decode_tensor(&t, None, "t")
                .unwrap_err()
                .to_string()
                .contains("negative")
        );
        let t = proto(1, &[1 << 32, 1 << 32]);
        assert!(
            decode_tensor(&t, None, "t")
                .unwrap_err()
                .to_string()
                .contains("more bytes")
        );
        let t = proto(8, &[1]);
        assert!(
            decode_tensor(&t, None, "t")
                .unwrap_err()
                .to_string()
                .contains("STRING")
        );
    }

    #[test]
    fn external_data_stays_inside_the_model_directory() {
        let mut t = proto(1, &[1]);
        t.data_location = Some(1);
        t.external_data = vec![crate::proto::StringStringEntryProto {
            key: Some("location".into()),
            value: Some("../secret".into()),
        }];
        let err = decode_tensor(&t, Some(Path::new("/tmp")), "w").unwrap_err();
        assert!(err.to_string().contains("relative path"), "{err}");
    }
}
