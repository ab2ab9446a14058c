//! Writing GGUF (version 3) images: metadata and tensors already in their stored
//! format. Used to save models and to build test files.

use crate::{DEFAULT_ALIGNMENT, TensorType, Value, ValueType};
use rlx_ir::{Error, Result};

/// Collects metadata and tensors, then lays them out as a GGUF file.
#[derive(Clone, Debug, Default)]
pub struct GgufBuilder {
    metadata: Vec<(String, Value)>,
    tensors: Vec<(String, Vec<usize>, TensorType, Vec<u8>)>,
}

/// The GGML type id of a tensor type.
fn ggml_id(ty: TensorType) -> u32 {
    use rlx_ir::QuantFormat as Q;
    match ty {
        TensorType::F32 => 0,
        TensorType::F16 => 1,
        TensorType::BF16 => 30,
        TensorType::Quant(Q::Q4_0) => 2,
        TensorType::Quant(Q::Q4_1) => 3,
        TensorType::Quant(Q::Q5_0) => 6,
        TensorType::Quant(Q::Q5_1) => 7,
        TensorType::Quant(Q::Q8_0) => 8,
        TensorType::Quant(Q::Q4K) => 12,
        TensorType::Quant(Q::Q5K) => 13,
        TensorType::Quant(Q::Q6K) => 14,
        TensorType::Quant(Q::Q8K) => 15,
    }
}

fn tag(ty: ValueType) -> u32 {
    match ty {
        ValueType::U8 => 0,
        ValueType::I8 => 1,
        ValueType::U16 => 2,
        ValueType::I16 => 3,
        ValueType::U32 => 4,
        ValueType::I32 => 5,
        ValueType::F32 => 6,
        ValueType::Bool => 7,
        ValueType::String => 8,
        ValueType::Array => 9,
        ValueType::U64 => 10,
        ValueType::I64 => 11,
        ValueType::F64 => 12,
    }
}

fn put_string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend(x.to_le_bytes()),
        Value::I16(x) => out.extend(x.to_le_bytes()),
        Value::U32(x) => out.extend(x.to_le_bytes()),
        Value::I32(x) => out.extend(x.to_le_bytes()),
        Value::U64(x) => out.extend(x.to_le_bytes()),
        Value::I64(x) => out.extend(x.to_le_bytes()),
        Value::F32(x) => out.extend(x.to_le_bytes()),
        Value::F64(x) => out.extend(x.to_le_bytes()),
        Value::Bool(x) => out.push(u8::from(*x)),
        Value::String(s) => put_string(out, s),
        Value::Array(ty, items) => {
            out.extend(tag(*ty).to_le_bytes());
            out.extend((items.len() as u64).to_le_bytes());
            for item in items {
                put_value(out, item);
            }
        }
    }
}

impl GgufBuilder {
    /// An empty file.
    pub fn new() -> GgufBuilder {
        GgufBuilder::default()
    }

    /// Adds a metadata entry.
    pub fn metadata(&mut self, key: &str, value: Value) -> &mut Self {
        self.metadata.push((key.to_string(), value));
        self
    }

    /// Adds a tensor: `dims` in GGML order (`dims[0]` contiguous) and `bytes` in the
    /// stored format, which must be exactly the tensor's size.
    pub fn tensor(
        &mut self,
        name: &str,
        dims: &[usize],
        ty: TensorType,
        bytes: Vec<u8>,
    ) -> Result<&mut Self> {
        let (unit_values, unit_bytes) = ty.unit();
        // Every product checked: dims come from the caller, possibly from a file.
        let needed = dims
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .and_then(|elements| (elements / unit_values.max(1)).checked_mul(unit_bytes))
            .filter(|&b| b <= isize::MAX as usize)
            .ok_or_else(|| Error::SizeOverflow {
                context: format!("gguf writer: tensor '{name}'"),
                what: format!("{dims:?} of {ty}"),
            })?;
        if dims.is_empty() || !dims[0].is_multiple_of(unit_values) || needed != bytes.len() {
            return Err(Error::invalid(
                "gguf writer",
                format!(
                    "tensor '{name}' {dims:?} of {ty} needs {needed} bytes, got {}",
                    bytes.len()
                ),
            ));
        }
        self.tensors
            .push((name.to_string(), dims.to_vec(), ty, bytes));
        Ok(self)
    }

    /// The file's bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let align = DEFAULT_ALIGNMENT;
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend((self.metadata.len() as u64).to_le_bytes());
        for (key, value) in &self.metadata {
            put_string(&mut out, key);
            out.extend(tag(value.value_type()).to_le_bytes());
            put_value(&mut out, value);
        }
        let mut offset = 0usize;
        for (name, dims, ty, bytes) in &self.tensors {
            put_string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for &d in dims {
                out.extend((d as u64).to_le_bytes());
            }
            out.extend(ggml_id(*ty).to_le_bytes());
            out.extend((offset as u64).to_le_bytes());
            offset += bytes.len().div_ceil(align) * align;
        }
        for (_, _, _, bytes) in &self.tensors {
            out.resize(out.len().div_ceil(align) * align, 0);
            out.extend(bytes);
        }
        out
    }
}
