//! The GGUF layout, parsed with every read bounds-checked:
//!
//! ```text
//! magic "GGUF" | version u32 | tensor_count u64 | kv_count u64
//! kv_count x (key string | type u32 | value)
//! tensor_count x (name string | n_dims u32 | n_dims x u64 | ggml type u32 | offset u64)
//! padding to the alignment | tensor data (offsets relative to here, aligned)
//! ```
//!
//! Strings are a `u64` length and UTF-8 bytes; arrays are an element type `u32`, a
//! count `u64` and the elements. All integers are little-endian.

use crate::{DEFAULT_ALIGNMENT, MAX_DIMS, TensorInfo, TensorType, Value, ValueType};

/// Deepest nesting of arrays accepted (real files use 1).
const MAX_ARRAY_DEPTH: usize = 4;

/// The parsed header.
pub(crate) struct Parsed {
    pub version: u32,
    pub alignment: usize,
    pub metadata: Vec<(String, Value)>,
    pub tensors: Vec<TensorInfo>,
}

/// A bounds-checked little-endian cursor.
struct Cursor<'a> {
    bytes: &'a [u8],
    at: usize,
}

type Parse<T> = std::result::Result<T, String>;

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.at
    }

    fn take(&mut self, n: usize, what: &str) -> Parse<&'a [u8]> {
        if n > self.remaining() {
            return Err(format!(
                "truncated: {what} needs {n} bytes at offset {}, but the file has {} left",
                self.at,
                self.remaining()
            ));
        }
        let s = &self.bytes[self.at..self.at + n];
        self.at += n;
        Ok(s)
    }

    fn array<const N: usize>(&mut self, what: &str) -> Parse<[u8; N]> {
        let mut out = [0u8; N];
        out.copy_from_slice(self.take(N, what)?);
        Ok(out)
    }

    fn u32(&mut self, what: &str) -> Parse<u32> {
        Ok(u32::from_le_bytes(self.array(what)?))
    }

    fn u64(&mut self, what: &str) -> Parse<u64> {
        Ok(u64::from_le_bytes(self.array(what)?))
    }

    /// A count of items of at least `min_size` bytes each, checked against the bytes
    /// left so that a hostile count cannot make the reader allocate without bound.
    fn count(&mut self, what: &str, min_size: usize) -> Parse<usize> {
        let at = self.at;
        let n = self.u64(what)?;
        let fits = usize::try_from(n).ok().filter(|&n| {
            n.checked_mul(min_size.max(1))
                .is_some_and(|b| b <= self.remaining())
        });
        fits.ok_or_else(|| {
            format!(
                "{what} {n} at offset {at} cannot fit in the {} bytes left",
                self.remaining()
            )
        })
    }

    fn string(&mut self, what: &str) -> Parse<String> {
        let len = self.count(what, 1)?;
        Ok(String::from_utf8_lossy(self.take(len, what)?).into_owned())
    }

    fn value(&mut self, ty: ValueType, key: &str, depth: usize) -> Parse<Value> {
        let what = |kind: &str| format!("{kind} of '{key}'");
        Ok(match ty {
            ValueType::U8 => Value::U8(self.array::<1>(&what("u8"))?[0]),
            ValueType::I8 => Value::I8(self.array::<1>(&what("i8"))?[0] as i8),
            ValueType::U16 => Value::U16(u16::from_le_bytes(self.array(&what("u16"))?)),
            ValueType::I16 => Value::I16(i16::from_le_bytes(self.array(&what("i16"))?)),
            ValueType::U32 => Value::U32(self.u32(&what("u32"))?),
            ValueType::I32 => Value::I32(i32::from_le_bytes(self.array(&what("i32"))?)),
            ValueType::U64 => Value::U64(self.u64(&what("u64"))?),
            ValueType::I64 => Value::I64(i64::from_le_bytes(self.array(&what("i64"))?)),
            ValueType::F32 => Value::F32(f32::from_le_bytes(self.array(&what("f32"))?)),
            ValueType::F64 => Value::F64(f64::from_le_bytes(self.array(&what("f64"))?)),
            ValueType::Bool => {
                let b = self.array::<1>(&what("bool"))?[0];
                if b > 1 {
                    return Err(format!("bool of '{key}' holds {b}, not 0 or 1"));
                }
                Value::Bool(b == 1)
            }
            ValueType::String => Value::String(self.string(&what("string"))?),
            ValueType::Array => {
                if depth >= MAX_ARRAY_DEPTH {
                    return Err(format!(
                        "arrays of '{key}' nest deeper than {MAX_ARRAY_DEPTH}"
                    ));
                }
                let tag = self.u32(&what("array element type"))?;
                let elem = ValueType::from_tag(tag)
                    .ok_or_else(|| format!("array '{key}' has unknown element type {tag}"))?;
                let n = self.count(&what("array length"), elem.min_size())?;
                let mut items = Vec::with_capacity(n);
                for _ in 0..n {
                    items.push(self.value(elem, key, depth + 1)?);
                }
                Value::Array(elem, items)
            }
        })
    }
}

/// Parses a whole GGUF image.
pub(crate) fn parse(bytes: &[u8]) -> Parse<Parsed> {
    let mut c = Cursor { bytes, at: 0 };
    let magic = c.array::<4>("the magic")?;
    if &magic != b"GGUF" {
        return Err(format!(
            "not a GGUF file (magic {magic:02x?}, expected \"GGUF\")"
        ));
    }
    let version = c.u32("the version")?;
    if !(2..=3).contains(&version) {
        return Err(format!(
            "GGUF version {version} is not supported (versions 2 and 3 are)"
        ));
    }
    // A tensor info takes at least 8 (name) + 4 + 4 + 8 bytes; a kv at least 8 + 4 + 1.
    let tensor_count = c.count("tensor count", 24)?;
    let kv_count = c.count("metadata count", 13)?;
    let mut metadata = Vec::with_capacity(kv_count);
    for i in 0..kv_count {
        let key = c.string(&format!("key of metadata entry {i}"))?;
        let tag = c.u32(&format!("type of '{key}'"))?;
        let ty = ValueType::from_tag(tag)
            .ok_or_else(|| format!("metadata '{key}' has unknown value type {tag}"))?;
        let value = c.value(ty, &key, 0)?;
        metadata.push((key, value));
    }
    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, v)) => {
            let a = v
                .as_u64()
                .and_then(|a| usize::try_from(a).ok())
                .ok_or("general.alignment is not a non-negative integer")?;
            if a == 0 || !a.is_power_of_two() || a > 1 << 20 {
                return Err(format!(
                    "general.alignment {a} is not a power of two up to 1 MiB"
                ));
            }
            a
        }
    };
    let mut infos = Vec::with_capacity(tensor_count);
    for i in 0..tensor_count {
        let name = c.string(&format!("name of tensor {i}"))?;
        let n_dims = c.u32(&format!("rank of tensor '{name}'"))? as usize;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(format!(
                "tensor '{name}' has rank {n_dims} (1 to {MAX_DIMS} allowed)"
            ));
        }
        let mut dims = Vec::with_capacity(n_dims);
        for _ in 0..n_dims {
            let d = c.u64(&format!("dimensions of tensor '{name}'"))?;
            dims.push(
                usize::try_from(d).map_err(|_| format!("tensor '{name}' dim {d} too large"))?,
            );
        }
        let id = c.u32(&format!("type of tensor '{name}'"))?;
        let ty = TensorType::from_ggml(id).ok_or_else(|| {
            format!("tensor '{name}' has GGML type {id}, which RLX does not read")
        })?;
        let offset = c.u64(&format!("offset of tensor '{name}'"))?;
        infos.push((name, dims, ty, offset));
    }
    let data_start =
        c.at.div_ceil(alignment)
            .checked_mul(alignment)
            .ok_or("data offset overflows")?;
    if data_start > bytes.len() && tensor_count > 0 {
        return Err(format!(
            "truncated: tensor data would start at {data_start}, past the end ({})",
            bytes.len()
        ));
    }
    let mut tensors = Vec::with_capacity(tensor_count);
    let mut seen = std::collections::HashSet::new();
    for (name, dims, ty, offset) in infos {
        if !seen.insert(name.clone()) {
            return Err(format!("tensor '{name}' appears twice"));
        }
        let elements = dims
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .ok_or_else(|| format!("tensor '{name}' {dims:?} has too many elements"))?;
        let (unit_values, unit_bytes) = ty.unit();
        if !dims[0].is_multiple_of(unit_values) {
            return Err(format!(
                "tensor '{name}' rows of {} values are not whole {ty} blocks of {unit_values}",
                dims[0]
            ));
        }
        let byte_len = (elements / unit_values)
            .checked_mul(unit_bytes)
            .ok_or_else(|| format!("tensor '{name}' is too large"))?;
        let offset = usize::try_from(offset)
            .ok()
            .filter(|o| o % alignment == 0)
            .ok_or_else(|| {
                format!("tensor '{name}' offset {offset} is not aligned to {alignment}")
            })?;
        let start = data_start
            .checked_add(offset)
            .filter(|&s| s.checked_add(byte_len).is_some_and(|end| end <= bytes.len()))
            .ok_or_else(|| {
                format!(
                    "truncated: tensor '{name}' ({byte_len} bytes at data offset {offset}) ends past the file's {} bytes",
                    bytes.len()
                )
            })?;
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            offset: start,
            byte_len,
        });
    }
    Ok(Parsed {
        version,
        alignment,
        metadata,
        tensors,
    })
}
