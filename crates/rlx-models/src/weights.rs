//! Memory-mapped safetensors weight files: the header is parsed and checked by the
//! `safetensors` crate, tensors are borrowed straight from the mapping.

use memmap2::Mmap;
use rlx_ir::{DType, Error, Result};
use safetensors::{Dtype, SafeTensors};
use std::collections::BTreeMap;
use std::path::Path;

/// One tensor of a [`SafeTensorsFile`], borrowed from the mapping.
#[derive(Clone, Copy, Debug)]
pub struct TensorView<'a> {
    /// Its element type.
    pub dtype: DType,
    /// Its dimensions.
    pub dims: &'a [usize],
    /// Its little-endian bytes (exactly `dims` elements of `dtype`).
    pub bytes: &'a [u8],
}

/// Where a file's bytes live.
enum Storage {
    Mapped(Mmap),
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

struct Entry {
    dtype: std::result::Result<DType, String>,
    dims: Vec<usize>,
    start: usize,
    end: usize,
}

/// A safetensors file opened by memory mapping (or held in memory); nothing is read
/// until a tensor is used.
pub struct SafeTensorsFile {
    path: String,
    storage: Storage,
    entries: BTreeMap<String, Entry>,
}

impl std::fmt::Debug for SafeTensorsFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "SafeTensorsFile({}, {} tensors)",
            self.path,
            self.entries.len()
        )
    }
}

impl SafeTensorsFile {
    /// Maps `path` and checks its header: every tensor's offsets must lie inside the
    /// file and match its shape and dtype.
    pub fn open(path: &Path) -> Result<SafeTensorsFile> {
        let shown = path.display().to_string();
        let io = |message: String| Error::Io {
            path: shown.clone(),
            message,
        };
        let file = std::fs::File::open(path).map_err(|e| io(e.to_string()))?;
        // SAFETY: the mapping is read-only; a file changed underneath it by another
        // process gives wrong numbers, not undefined behaviour in this program's
        // bounds checks, which all happen on lengths fixed at open time.
        let map = unsafe { Mmap::map(&file) }.map_err(|e| io(format!("cannot map: {e}")))?;
        SafeTensorsFile::parse(shown, Storage::Mapped(map))
    }

    /// Parses a safetensors image held in memory, with the same checks as
    /// [`SafeTensorsFile::open`]; `name` names it in errors. A truncated or hostile
    /// buffer gives an [`Error::Format`], never a panic.
    pub fn from_bytes(name: impl Into<String>, bytes: Vec<u8>) -> Result<SafeTensorsFile> {
        SafeTensorsFile::parse(name.into(), Storage::Owned(bytes))
    }

    fn parse(shown: String, storage: Storage) -> Result<SafeTensorsFile> {
        let map = storage.bytes();
        let (header_len, metadata) =
            SafeTensors::read_metadata(map).map_err(|e| Error::Format {
                path: shown.clone(),
                message: format!("not a valid safetensors file: {e}"),
            })?;
        let data_start = 8 + header_len;
        let mut entries = BTreeMap::new();
        for (name, info) in metadata.tensors() {
            let (start, end) = info.data_offsets;
            let (start, end) = (data_start + start, data_start + end);
            if start > end || end > map.len() {
                return Err(Error::Format {
                    path: shown,
                    message: format!("tensor '{name}' lies outside the file"),
                });
            }
            entries.insert(
                name,
                Entry {
                    dtype: dtype_of(info.dtype),
                    dims: info.shape.clone(),
                    start,
                    end,
                },
            );
        }
        Ok(SafeTensorsFile {
            path: shown,
            storage,
            entries,
        })
    }

    /// The file's path, as shown in errors.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// Every tensor name, sorted.
    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.entries.keys().map(String::as_str)
    }

    /// Whether the file has a tensor called `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.entries.contains_key(name)
    }

    /// The tensor `name`, which must have exactly the dimensions `dims`.
    pub fn tensor(&self, name: &str, dims: &[usize]) -> Result<TensorView<'_>> {
        let entry = self.entries.get(name).ok_or_else(|| Error::Format {
            path: self.path.clone(),
            message: format!("missing tensor '{name}' (expected shape {dims:?})"),
        })?;
        let dtype = entry.dtype.clone().map_err(|got| Error::Format {
            path: self.path.clone(),
            message: format!("tensor '{name}' has dtype {got}, which RLX does not read"),
        })?;
        if entry.dims != dims {
            return Err(Error::Format {
                path: self.path.clone(),
                message: format!(
                    "tensor '{name}' has shape {:?}, but the model config expects {dims:?}",
                    entry.dims
                ),
            });
        }
        let bytes = self
            .storage
            .bytes()
            .get(entry.start..entry.end)
            .ok_or_else(|| Error::Format {
                path: self.path.clone(),
                message: format!("tensor '{name}' lies outside the file"),
            })?;
        let expected = dims
            .iter()
            .try_fold(dtype.size_in_bytes(), |n, &d| n.checked_mul(d));
        if expected != Some(bytes.len()) {
            return Err(Error::Format {
                path: self.path.clone(),
                message: format!("tensor '{name}' has the wrong number of bytes"),
            });
        }
        Ok(TensorView {
            dtype,
            dims: &entry.dims,
            bytes,
        })
    }
}

fn dtype_of(dtype: Dtype) -> std::result::Result<DType, String> {
    Ok(match dtype {
        Dtype::F32 => DType::F32,
        Dtype::F16 => DType::F16,
        Dtype::BF16 => DType::BF16,
        Dtype::F64 => DType::F64,
        Dtype::I64 => DType::I64,
        Dtype::I32 => DType::I32,
        Dtype::I8 => DType::I8,
        Dtype::U8 => DType::U8,
        Dtype::BOOL => DType::Bool,
        other => return Err(format!("{other:?}")),
    })
}
