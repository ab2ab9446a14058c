//! A memory-mapped reader for GGUF files (versions 2 and 3): metadata of every value
//! type, tensor infos, alignment, and the tensors' bytes, with every length, offset
//! and count checked against the file's size. A truncated or hostile file gives an
//! [`Error::Format`] naming what was wrong and where, never a panic or an
//! out-of-bounds read.
//!
//! Quantized tensors stay in their stored block format ([`TensorType::Quant`]); the
//! formats and their reference dequantization are [`rlx_ir::quant`], which the IR
//! ops and the CPU kernels share.
//!
//! ```no_run
//! let file = rlx_gguf::GgufFile::open("model.gguf")?;
//! let layers = file.get_u64("llama.block_count")?;
//! let embedding = file.tensor("token_embd.weight")?;
//! println!("{layers} layers; embedding {:?} {}", embedding.dims, embedding.ty);
//! # Ok::<(), rlx_ir::Error>(())
//! ```

mod parse;
mod value;
mod write;

pub use rlx_ir::quant::{QuantFormat, dequantize_row};
use rlx_ir::{Error, Result};
use std::collections::HashMap;
use std::path::Path;
pub use value::{Value, ValueType};
pub use write::GgufBuilder;

/// The largest tensor rank GGUF allows.
pub const MAX_DIMS: usize = 4;

/// The alignment of tensor data when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: usize = 32;

/// How a tensor's elements are stored.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TensorType {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// bfloat16.
    BF16,
    /// Blocks of a quantized format.
    Quant(QuantFormat),
}

impl TensorType {
    /// The type with GGML type id `id`, if RLX reads it.
    pub fn from_ggml(id: u32) -> Option<TensorType> {
        Some(match id {
            0 => TensorType::F32,
            1 => TensorType::F16,
            2 => TensorType::Quant(QuantFormat::Q4_0),
            3 => TensorType::Quant(QuantFormat::Q4_1),
            6 => TensorType::Quant(QuantFormat::Q5_0),
            7 => TensorType::Quant(QuantFormat::Q5_1),
            8 => TensorType::Quant(QuantFormat::Q8_0),
            12 => TensorType::Quant(QuantFormat::Q4K),
            13 => TensorType::Quant(QuantFormat::Q5K),
            14 => TensorType::Quant(QuantFormat::Q6K),
            15 => TensorType::Quant(QuantFormat::Q8K),
            30 => TensorType::BF16,
            _ => return None,
        })
    }

    /// `(values, bytes)` of one storage unit (an element, or a block).
    pub fn unit(self) -> (usize, usize) {
        match self {
            TensorType::F32 => (1, 4),
            TensorType::F16 | TensorType::BF16 => (1, 2),
            TensorType::Quant(f) => (f.block_len(), f.block_bytes()),
        }
    }
}

impl std::fmt::Display for TensorType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            TensorType::F32 => f.write_str("f32"),
            TensorType::F16 => f.write_str("f16"),
            TensorType::BF16 => f.write_str("bf16"),
            TensorType::Quant(q) => f.write_str(q.name()),
        }
    }
}

/// One tensor's description.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorInfo {
    /// The tensor's name.
    pub name: String,
    /// Dimensions in GGML order: `dims[0]` is the contiguous one (a linear layer's
    /// weight `[in, out]` is `out` rows of `in` values).
    pub dims: Vec<usize>,
    /// The storage type.
    pub ty: TensorType,
    /// Byte offset of the data from the file's start (already checked to lie inside
    /// the file).
    pub offset: usize,
    /// Bytes of data.
    pub byte_len: usize,
}

impl TensorInfo {
    /// Number of values.
    pub fn num_elements(&self) -> usize {
        self.dims.iter().product()
    }

    /// Dimensions in row-major order (`dims` reversed): `[out, in]` for a linear
    /// layer's weight.
    pub fn row_major_dims(&self) -> Vec<usize> {
        self.dims.iter().rev().copied().collect()
    }
}

/// Where the file's bytes live.
enum Storage {
    Mapped(memmap2::Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mapped(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// An open GGUF file.
pub struct GgufFile {
    path: String,
    storage: Storage,
    version: u32,
    alignment: usize,
    metadata: Vec<(String, Value)>,
    keys: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    by_name: HashMap<String, usize>,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("metadata", &self.metadata.len())
            .field("tensors", &self.tensors.len())
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and parses the file at `path`.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile> {
        let path = path.as_ref();
        let shown = path.display().to_string();
        let io = |e: std::io::Error| Error::Io {
            path: shown.clone(),
            message: e.to_string(),
        };
        let file = std::fs::File::open(path).map_err(io)?;
        // SAFETY: the map is read-only; like every memory-mapped reader, this assumes
        // the file is not truncated by another process while it is open.
        let map = unsafe { memmap2::Mmap::map(&file) }.map_err(io)?;
        GgufFile::parse(shown, Storage::Mapped(map))
    }

    /// Parses a GGUF image held in memory (`name` is used in errors).
    pub fn from_bytes(name: impl Into<String>, bytes: Vec<u8>) -> Result<GgufFile> {
        GgufFile::parse(name.into(), Storage::Owned(bytes))
    }

    fn parse(path: String, storage: Storage) -> Result<GgufFile> {
        let parsed = parse::parse(storage.bytes()).map_err(|message| Error::Format {
            path: path.clone(),
            message,
        })?;
        let keys = parsed
            .metadata
            .iter()
            .enumerate()
            .map(|(i, (k, _))| (k.clone(), i))
            .collect();
        let by_name = parsed
            .tensors
            .iter()
            .enumerate()
            .map(|(i, t)| (t.name.clone(), i))
            .collect();
        Ok(GgufFile {
            path,
            storage,
            version: parsed.version,
            alignment: parsed.alignment,
            metadata: parsed.metadata,
            keys,
            tensors: parsed.tensors,
            by_name,
        })
    }

    /// The path (or name) the file was opened from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The format version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// The alignment of the tensor data.
    pub fn alignment(&self) -> usize {
        self.alignment
    }

    /// Every metadata entry, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The value of `key`, if present.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.keys.get(key).map(|&i| &self.metadata[i].1)
    }

    /// Every tensor's description, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    fn format_error(&self, message: String) -> Error {
        Error::Format {
            path: self.path.clone(),
            message,
        }
    }

    /// The value of `key`, or an error naming the missing key.
    pub fn require(&self, key: &str) -> Result<&Value> {
        self.get(key)
            .ok_or_else(|| self.format_error(format!("metadata key '{key}' is missing")))
    }

    fn typed<T>(&self, key: &str, what: &str, read: impl Fn(&Value) -> Option<T>) -> Result<T> {
        let v = self.require(key)?;
        read(v).ok_or_else(|| {
            self.format_error(format!(
                "metadata key '{key}' should be {what}, found {:?}",
                v.value_type()
            ))
        })
    }

    /// A non-negative integer value.
    pub fn get_u64(&self, key: &str) -> Result<u64> {
        self.typed(key, "a non-negative integer", Value::as_u64)
    }

    /// A non-negative integer value that fits `usize`.
    pub fn get_usize(&self, key: &str) -> Result<usize> {
        let v = self.get_u64(key)?;
        usize::try_from(v).map_err(|_| self.format_error(format!("'{key}' = {v} is too large")))
    }

    /// A number.
    pub fn get_f64(&self, key: &str) -> Result<f64> {
        self.typed(key, "a number", Value::as_f64)
    }

    /// A bool.
    pub fn get_bool(&self, key: &str) -> Result<bool> {
        self.typed(key, "a bool", Value::as_bool)
    }

    /// A string.
    pub fn get_str(&self, key: &str) -> Result<&str> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| {
            self.format_error(format!(
                "metadata key '{key}' should be a string, found {:?}",
                v.value_type()
            ))
        })
    }

    /// An array of strings.
    pub fn get_str_array(&self, key: &str) -> Result<Vec<&str>> {
        let v = self.require(key)?;
        v.as_array()
            .and_then(|items| items.iter().map(Value::as_str).collect::<Option<Vec<_>>>())
            .ok_or_else(|| {
                self.format_error(format!(
                    "metadata key '{key}' should be an array of strings"
                ))
            })
    }

    /// An array of integers.
    pub fn get_i64_array(&self, key: &str) -> Result<Vec<i64>> {
        let v = self.require(key)?;
        v.as_array()
            .and_then(|items| items.iter().map(Value::as_i64).collect::<Option<Vec<_>>>())
            .ok_or_else(|| {
                self.format_error(format!(
                    "metadata key '{key}' should be an array of integers"
                ))
            })
    }

    /// The description of tensor `name`, or an error naming it.
    pub fn tensor(&self, name: &str) -> Result<&TensorInfo> {
        self.by_name
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| self.format_error(format!("tensor '{name}' is missing")))
    }

    /// The stored bytes of tensor `name`.
    pub fn tensor_bytes(&self, name: &str) -> Result<&[u8]> {
        let t = self.tensor(name)?;
        self.storage
            .bytes()
            .get(t.offset..t.offset + t.byte_len)
            .ok_or_else(|| self.format_error(format!("tensor '{name}' lies outside the file")))
    }

    /// Tensor `name` decoded to `f32` (any stored type), for small tensors such as
    /// norm weights and for tests; large quantized weights are read packed instead.
    pub fn tensor_f32(&self, name: &str) -> Result<Vec<f32>> {
        let t = self.tensor(name)?;
        let bytes = self.tensor_bytes(name)?;
        let mut out = vec![0f32; t.num_elements()];
        match t.ty {
            TensorType::F32 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
            TensorType::F16 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = half::f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32();
                }
            }
            TensorType::BF16 => {
                for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                    *o = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
                }
            }
            TensorType::Quant(f) => dequantize_row(f, bytes, &mut out)?,
        }
        Ok(out)
    }
}
