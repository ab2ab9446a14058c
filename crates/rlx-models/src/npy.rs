//! NumPy `.npy` files (format versions 1, 2 and 3): one array, little-endian, C order.

use rlx_ir::{DType, Error, Result, TensorData};
use std::path::Path;

const MAGIC: &[u8] = b"\x93NUMPY";

/// The `descr` code of a dtype (`<f4`, `|b1`, ...).
fn descr(dtype: DType) -> &'static str {
    match dtype {
        DType::F32 => "<f4",
        DType::F16 => "<f2",
        DType::F64 => "<f8",
        DType::BF16 => "<V2",
        DType::I8 => "|i1",
        DType::I16 => "<i2",
        DType::I32 => "<i4",
        DType::I64 => "<i8",
        DType::U8 => "|u1",
        DType::U16 => "<u2",
        DType::U32 => "<u4",
        DType::U64 => "<u8",
        DType::Bool => "|b1",
    }
}

fn dtype_of(code: &str, path: &str) -> Result<DType> {
    let code = code.trim_start_matches('=');
    Ok(match code {
        "<f4" => DType::F32,
        "<f2" => DType::F16,
        "<f8" => DType::F64,
        "|i1" | "<i1" | "i1" => DType::I8,
        "<i2" => DType::I16,
        "<i4" => DType::I32,
        "<i8" => DType::I64,
        "|u1" | "<u1" | "u1" => DType::U8,
        "<u2" => DType::U16,
        "<u4" => DType::U32,
        "<u8" => DType::U64,
        "|b1" | "<b1" | "b1" => DType::Bool,
        other => {
            return Err(Error::Format {
                path: path.to_string(),
                message: format!(
                    "array dtype '{other}' is not supported (little-endian floats, integers and bools are)"
                ),
            });
        }
    })
}

/// Reads an array: its dims and data.
pub fn read_npy(path: impl AsRef<Path>) -> Result<(Vec<usize>, TensorData)> {
    let path = path.as_ref();
    let bytes = std::fs::read(path).map_err(|e| Error::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    })?;
    parse_npy(&bytes, &path.display().to_string())
}

/// Parses the bytes of an `.npy` file; `name` names it in errors.
pub fn parse_npy(bytes: &[u8], name: &str) -> Result<(Vec<usize>, TensorData)> {
    let bad = |m: String| Error::Format {
        path: name.to_string(),
        message: m,
    };
    if bytes.len() < 10 || &bytes[..6] != MAGIC {
        return Err(bad("not an .npy file (no \\x93NUMPY header)".into()));
    }
    let (header_len, start): (usize, usize) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 => {
            if bytes.len() < 12 {
                return Err(bad("truncated header".into()));
            }
            (
                u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]) as usize,
                12,
            )
        }
        v => return Err(bad(format!("format version {v} is not supported"))),
    };
    let end = start
        .checked_add(header_len)
        .filter(|&e| e <= bytes.len())
        .ok_or_else(|| bad("header runs past the end of the file".into()))?;
    let header =
        std::str::from_utf8(&bytes[start..end]).map_err(|_| bad("header is not text".into()))?;
    let field = |key: &str| -> Result<&str> {
        let at = header
            .find(&format!("'{key}'"))
            .ok_or_else(|| bad(format!("header has no '{key}'")))?;
        let rest = &header[at + key.len() + 2..];
        let colon = rest
            .find(':')
            .ok_or_else(|| bad(format!("'{key}' has no value")))?;
        Ok(rest[colon + 1..].trim_start())
    };
    let descr_text = field("descr")?;
    let code = descr_text
        .strip_prefix('\'')
        .and_then(|s| s.split('\'').next())
        .ok_or_else(|| bad("descr is not a string".into()))?;
    let dtype = dtype_of(code, name)?;
    if field("fortran_order")?.starts_with("True") {
        return Err(bad("Fortran-ordered arrays are not supported".into()));
    }
    let shape_text = field("shape")?;
    let close = shape_text
        .find(')')
        .ok_or_else(|| bad("shape is not a tuple".into()))?;
    let inner = shape_text
        .strip_prefix('(')
        .ok_or_else(|| bad("shape is not a tuple".into()))?;
    let dims: Vec<usize> = inner[..close - 1]
        .split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(|s| {
            s.parse::<usize>()
                .map_err(|_| bad(format!("bad dimension '{s}' in shape")))
        })
        .collect::<Result<_>>()?;
    let count = dims
        .iter()
        .try_fold(1usize, |a, &d| a.checked_mul(d))
        .ok_or_else(|| bad(format!("shape {dims:?} is too large")))?;
    let want = count
        .checked_mul(dtype.size_in_bytes())
        .ok_or_else(|| bad(format!("shape {dims:?} is too large")))?;
    let body = &bytes[end..];
    if body.len() != want {
        return Err(bad(format!(
            "{} data bytes for shape {dims:?} of {dtype}, expected {want}",
            body.len()
        )));
    }
    let data = if dtype == DType::Bool {
        TensorData::Bool(body.iter().map(|&b| b != 0).collect())
    } else {
        TensorData::from_le_bytes(dtype, body)?
    };
    Ok((dims, data))
}

/// The bytes of an `.npy` file (version 1) holding `data` with `dims`.
pub fn npy_bytes(dims: &[usize], data: &TensorData) -> Result<Vec<u8>> {
    let count = dims.iter().try_fold(1usize, |n, &d| n.checked_mul(d));
    if count != Some(data.len()) {
        return Err(Error::LengthMismatch {
            kind: "output",
            name: "npy array".into(),
            expected: count.unwrap_or(usize::MAX),
            got: data.len(),
            unit: "elements",
        });
    }
    if data.dtype() == DType::BF16 {
        return Err(Error::Unsupported {
            device: "npy".into(),
            what: "bf16 arrays (NumPy has no bfloat16)".into(),
        });
    }
    let shape = match dims {
        [d] => format!("({d},)"),
        _ => format!(
            "({})",
            dims.iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header = format!(
        "{{'descr': '{}', 'fortran_order': False, 'shape': {shape}, }}",
        descr(data.dtype())
    );
    // The header, with its 10-byte preamble, ends in a newline on a 64-byte boundary.
    let total = (10 + header.len() + 1).div_ceil(64) * 64;
    while 10 + header.len() + 1 < total {
        header.push(' ');
    }
    header.push('\n');
    let mut out = Vec::with_capacity(total + data.len() * data.dtype().size_in_bytes());
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&[1, 0]);
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(&data.as_ref().to_le_bytes());
    Ok(out)
}

/// Writes an array to an `.npy` file.
pub fn write_npy(path: impl AsRef<Path>, dims: &[usize], data: &TensorData) -> Result<()> {
    let path = path.as_ref();
    std::fs::write(path, npy_bytes(dims, data)?).map_err(|e| Error::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_every_dtype_numpy_has() {
        for dtype in DType::ALL {
            if dtype == DType::BF16 {
                continue;
            }
            for dims in [vec![], vec![3], vec![2, 3]] {
                let n: usize = dims.iter().product();
                let values: Vec<f64> = (0..n).map(|i| i as f64 - 1.0).collect();
                let data = TensorData::from_f64(dtype, &values);
                let bytes = npy_bytes(&dims, &data).unwrap();
                assert_eq!(
                    (10 + u16::from_le_bytes([bytes[8], bytes[9]]) as usize) % 64,
                    0
                );
                assert_eq!(
                    parse_npy(&bytes, "t").unwrap(),
                    (dims.clone(), data),
                    "{dtype} {dims:?}"
                );
            }
        }
    }

    #[test]
    fn reads_what_numpy_writes() {
        // np.save of np.arange(6, dtype=np.int32).reshape(2, 3)
        let mut b =
            b"\x93NUMPY\x01\x00v\x00{'descr': '<i4', 'fortran_order': False, 'shape': (2, 3), }"
                .to_vec();
        while b.len() < 127 {
            b.push(b' ');
        }
        b.push(b'\n');
        for i in 0..6i32 {
            b.extend_from_slice(&i.to_le_bytes());
        }
        assert_eq!(
            parse_npy(&b, "t").unwrap(),
            (vec![2, 3], TensorData::I32((0..6).collect()))
        );
    }

    #[test]
    fn rejects_malformed_files() {
        assert!(parse_npy(b"hello", "t").is_err());
        let good = npy_bytes(&[2], &TensorData::F32(vec![1.0, 2.0])).unwrap();
        assert!(
            parse_npy(&good[..good.len() - 1], "t")
                .unwrap_err()
                .to_string()
                .contains("data bytes")
        );
        let swap = |from: &[u8], to: &[u8]| {
            let mut b = good.clone();
            let at = b.windows(from.len()).position(|w| w == from).unwrap();
            b[at..at + to.len()].copy_from_slice(to);
            b
        };
        let big = swap(b"'<f4'", b"'>f4'");
        assert!(
            parse_npy(&big, "t")
                .unwrap_err()
                .to_string()
                .contains("not supported")
        );
        let fortran = swap(b"False", b"True ");
        assert!(
            parse_npy(&fortran, "t")
                .unwrap_err()
                .to_string()
                .contains("Fortran")
        );
    }
}
