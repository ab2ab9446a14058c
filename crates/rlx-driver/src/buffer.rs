//! Owned host memory and named persistent handles.

use rlx_ir::{DType, Error, Result, Shape};

/// Bytes in a cache line; every [`AlignedBytes`] starts on one.
const ALIGN: usize = 64;

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; ALIGN]);

/// A zero-initialized byte buffer whose start is 64-byte aligned, so kernels may view
/// it as any element type.
#[derive(Clone)]
pub struct AlignedBytes {
    lines: Vec<Line>,
    len: usize,
}

impl AlignedBytes {
    /// `len` zero bytes.
    pub fn zeroed(len: usize) -> AlignedBytes {
        AlignedBytes {
            lines: vec![Line([0; ALIGN]); len.div_ceil(ALIGN)],
            len,
        }
    }

    /// Length in bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True for a zero-length buffer.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The bytes.
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `lines` owns at least `len` initialized bytes, contiguous because
        // `Line` is `repr(C)` with no padding.
        unsafe { std::slice::from_raw_parts(self.lines.as_ptr().cast::<u8>(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr().cast::<u8>(), self.len) }
    }

    /// Start address, for kernels that index through raw pointers.
    pub fn as_ptr(&self) -> *const u8 {
        self.lines.as_ptr().cast()
    }

    /// Start address, mutable.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.lines.as_mut_ptr().cast()
    }
}

impl std::fmt::Debug for AlignedBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "AlignedBytes({} bytes)", self.len)
    }
}

/// A host buffer holding one tensor.
#[derive(Clone, Debug)]
pub struct Buffer {
    shape: Shape,
    bytes: AlignedBytes,
}

impl Buffer {
    /// A zeroed buffer for `shape`.
    pub fn zeroed(shape: Shape) -> Buffer {
        let bytes = AlignedBytes::zeroed(shape.byte_size());
        Buffer { shape, bytes }
    }

    /// A buffer holding `bytes`, which must be exactly `shape.byte_size()` long.
    pub fn from_bytes(shape: Shape, bytes: &[u8]) -> Result<Buffer> {
        let mut buf = Buffer::zeroed(shape);
        buf.write(bytes)?;
        Ok(buf)
    }

    /// The tensor's shape.
    pub fn shape(&self) -> &Shape {
        &self.shape
    }

    /// The raw bytes.
    pub fn bytes(&self) -> &[u8] {
        self.bytes.as_slice()
    }

    /// The raw bytes, mutably.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.bytes.as_mut_slice()
    }

    /// Replaces the contents; `bytes` must be exactly the buffer's size.
    pub fn write(&mut self, bytes: &[u8]) -> Result<()> {
        if bytes.len() != self.bytes.len() {
            return Err(Error::LengthMismatch {
                kind: "destination",
                name: format!("buffer {}", self.shape),
                expected: self.bytes.len(),
                got: bytes.len(),
                unit: "bytes",
            });
        }
        self.bytes.as_mut_slice().copy_from_slice(bytes);
        Ok(())
    }

    /// The underlying aligned storage.
    pub fn storage(&self) -> &AlignedBytes {
        &self.bytes
    }

    /// The underlying aligned storage, mutably.
    pub fn storage_mut(&mut self) -> &mut AlignedBytes {
        &mut self.bytes
    }
}

/// A named tensor of persistent state (a KV cache, optimizer moments) that a compiled
/// graph keeps across runs, outside its arena.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct BufferHandle {
    /// The graph input this handle backs.
    pub name: String,
    /// Its dimensions and dtype.
    pub shape: Shape,
}

impl BufferHandle {
    /// A handle named `name` of the given dimensions and dtype.
    pub fn new(name: impl Into<String>, dims: &[usize], dtype: DType) -> BufferHandle {
        BufferHandle {
            name: name.into(),
            shape: Shape::new(dims, dtype),
        }
    }

    /// Bytes the handle occupies.
    pub fn byte_size(&self) -> usize {
        self.shape.byte_size()
    }

    /// Number of elements.
    pub fn num_elements(&self) -> usize {
        self.shape.num_elements()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aligned_and_checked() {
        let mut b = Buffer::zeroed(Shape::new(&[3, 5], DType::F16));
        assert_eq!(b.bytes().len(), 30);
        assert_eq!(b.storage().as_ptr() as usize % 64, 0);
        assert!(b.write(&[0u8; 29]).is_err());
        b.write(&[7u8; 30]).unwrap();
        assert_eq!(b.bytes()[29], 7);
        let h = BufferHandle::new("kv", &[2, 4, 8], DType::F32);
        assert_eq!((h.num_elements(), h.byte_size()), (64, 256));
    }
}
