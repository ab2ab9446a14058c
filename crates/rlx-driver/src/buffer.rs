//! Owned host memory and named persistent handles.

use rlx_ir::{DType, Error, Result, Shape};

/// Bytes in a cache line; every [`AlignedBytes`] starts on one.
const ALIGN: usize = 64;

/// Buffers of at least this many bytes start on a huge-page boundary and ask the
/// kernel for huge pages (Linux's `MADV_HUGEPAGE`), so that the activations and
/// weights a model walks through take few TLB entries.
const HUGE_PAGE: usize = 2 << 20;

/// One cache line: the alignment of an empty buffer's dangling pointer.
#[repr(C, align(64))]
struct Line([u8; ALIGN]);

/// A zero-initialized byte buffer whose start is 64-byte aligned, so kernels may view
/// it as any element type. Buffers of 2 MiB or more are aligned to 2 MiB and backed
/// by huge pages where the system allows it.
pub struct AlignedBytes {
    /// Start of the allocation (dangling and never freed when `len == 0`).
    ptr: std::ptr::NonNull<u8>,
    len: usize,
    /// The allocation's layout, `None` for an empty buffer (nothing allocated).
    layout: Option<std::alloc::Layout>,
}

// SAFETY: `AlignedBytes` owns its allocation exclusively, like a `Vec<u8>`.
unsafe impl Send for AlignedBytes {}
// SAFETY: shared access only reads.
unsafe impl Sync for AlignedBytes {}

impl AlignedBytes {
    /// `len` zero bytes. Aborts, as any Rust allocation does, when the memory is not
    /// available; use [`AlignedBytes::try_zeroed`] for sizes that come from a model.
    pub fn zeroed(len: usize) -> AlignedBytes {
        match Self::layout(len) {
            Some(layout) => Self::try_zeroed(len, "buffer")
                .unwrap_or_else(|_| std::alloc::handle_alloc_error(layout)),
            None => panic!("a buffer of {len} bytes is larger than the address space"),
        }
    }

    /// `len` zero bytes, or [`Error::OutOfMemory`] naming `what` and `len` when the
    /// allocation fails (or `len` is past `isize::MAX`). Never aborts.
    pub fn try_zeroed(len: usize, what: &str) -> Result<AlignedBytes> {
        let out_of_memory = || Error::OutOfMemory {
            tensor: what.to_string(),
            bytes: len,
        };
        if len == 0 {
            return Ok(AlignedBytes {
                ptr: std::ptr::NonNull::<Line>::dangling().cast(),
                len,
                layout: None,
            });
        }
        let layout = Self::layout(len).ok_or_else(out_of_memory)?;
        let ptr = if layout.align() == HUGE_PAGE {
            // SAFETY: `layout` has a non-zero size.
            let ptr = unsafe { std::alloc::alloc(layout) };
            if !ptr.is_null() {
                advise_huge_pages(ptr, layout.size());
                // Zeroing after the advice faults the pages in as huge ones.
                // SAFETY: `ptr` addresses `layout.size()` writable bytes.
                unsafe { std::ptr::write_bytes(ptr, 0, layout.size()) };
            }
            ptr
        } else {
            // SAFETY: `layout` has a non-zero size.
            unsafe { std::alloc::alloc_zeroed(layout) }
        };
        let ptr = std::ptr::NonNull::new(ptr).ok_or_else(out_of_memory)?;
        Ok(AlignedBytes {
            ptr,
            len,
            layout: Some(layout),
        })
    }

    /// The allocation for `len > 0` bytes: whole cache lines, on a huge-page boundary
    /// from [`HUGE_PAGE`] bytes on; `None` past `isize::MAX`.
    fn layout(len: usize) -> Option<std::alloc::Layout> {
        let align = if len >= HUGE_PAGE { HUGE_PAGE } else { ALIGN };
        let size = len.checked_next_multiple_of(ALIGN)?;
        std::alloc::Layout::from_size_align(size, align).ok()
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
        // SAFETY: the allocation holds at least `len` initialized bytes (or `len` is
        // 0 and the pointer is dangling but aligned).
        unsafe { std::slice::from_raw_parts(self.ptr.as_ptr(), self.len) }
    }

    /// The bytes, mutably.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as in `as_slice`, and `&mut self` guarantees exclusive access.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.as_ptr(), self.len) }
    }

    /// Start address, for kernels that index through raw pointers.
    pub fn as_ptr(&self) -> *const u8 {
        self.ptr.as_ptr()
    }

    /// Start address, mutable.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.ptr.as_ptr()
    }
}

impl Drop for AlignedBytes {
    fn drop(&mut self) {
        if let Some(layout) = self.layout {
            // SAFETY: allocated in `try_zeroed` with this layout.
            unsafe { std::alloc::dealloc(self.ptr.as_ptr(), layout) };
        }
    }
}

impl Clone for AlignedBytes {
    fn clone(&self) -> AlignedBytes {
        let mut copy = AlignedBytes::zeroed(self.len);
        copy.as_mut_slice().copy_from_slice(self.as_slice());
        copy
    }
}

/// Asks the kernel to back `len` bytes from `ptr` (a huge-page boundary) with huge
/// pages. Only a hint: where transparent huge pages are off, nothing changes.
#[cfg(target_os = "linux")]
fn advise_huge_pages(ptr: *mut u8, len: usize) {
    // SAFETY: the range is one allocation this process owns; the advice changes no
    // contents. Its result is ignored, as the advice is optional.
    unsafe { libc::madvise(ptr.cast(), len, libc::MADV_HUGEPAGE) };
}

#[cfg(not(target_os = "linux"))]
fn advise_huge_pages(_: *mut u8, _: usize) {}

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

    /// A zeroed buffer for `shape`, or an error instead of an abort:
    /// [`Error::SizeOverflow`] when the shape needs more than `isize::MAX` bytes,
    /// [`Error::OutOfMemory`] naming `what` (such as `param 'w'`) and the bytes when
    /// the allocation fails.
    pub fn try_zeroed(shape: Shape, what: &str) -> Result<Buffer> {
        shape.check_size(what)?;
        let bytes = AlignedBytes::try_zeroed(shape.byte_size(), what)?;
        Ok(Buffer { shape, bytes })
    }

    /// A buffer holding `bytes`, which must be exactly `shape.byte_size()` long.
    /// Fails as [`Buffer::try_zeroed`] does (with `what` "buffer" and the shape) when
    /// the memory cannot be had.
    pub fn from_bytes(shape: Shape, bytes: &[u8]) -> Result<Buffer> {
        let what = format!("buffer {shape}");
        let mut buf = Buffer::try_zeroed(shape, &what)?;
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

    #[test]
    fn failed_allocations_are_errors() {
        let a = AlignedBytes::try_zeroed(100, "t").unwrap();
        assert_eq!(a.len(), 100);
        assert_eq!(a.as_ptr() as usize % 64, 0);
        assert!(a.as_slice().iter().all(|&b| b == 0));
        assert!(AlignedBytes::try_zeroed(0, "t").unwrap().is_empty());
        // Past isize::MAX: the layout itself is refused.
        let err = AlignedBytes::try_zeroed(usize::MAX, "big").unwrap_err();
        assert_eq!(
            err,
            Error::OutOfMemory {
                tensor: "big".into(),
                bytes: usize::MAX
            }
        );
        // 2^62 bytes is a valid layout no machine can back.
        let err = Buffer::try_zeroed(Shape::new(&[1 << 60], DType::F32), "param 'w'").unwrap_err();
        assert_eq!(
            err,
            Error::OutOfMemory {
                tensor: "param 'w'".into(),
                bytes: 1 << 62
            }
        );
        assert!(matches!(
            Buffer::try_zeroed(Shape::new(&[1 << 62], DType::F32), "p"),
            Err(Error::SizeOverflow { .. })
        ));
    }

    #[test]
    fn large_buffers_start_on_a_huge_page_and_clone_their_bytes() {
        let len = HUGE_PAGE + 100;
        let mut a = AlignedBytes::try_zeroed(len, "big").unwrap();
        assert_eq!(a.as_ptr() as usize % HUGE_PAGE, 0);
        assert_eq!(a.len(), len);
        assert!(a.as_slice().iter().all(|&b| b == 0));
        a.as_mut_slice()[len - 1] = 9;
        a.as_mut_slice()[3] = 4;
        let b = a.clone();
        assert_eq!(b.as_ptr() as usize % HUGE_PAGE, 0);
        assert_eq!(b.as_slice(), a.as_slice());
        drop(a);
        assert_eq!((b.as_slice()[3], b.as_slice()[len - 1]), (4, 9));
        let small = AlignedBytes::zeroed(HUGE_PAGE - 1);
        assert_eq!(small.as_ptr() as usize % 64, 0);
        let empty = AlignedBytes::zeroed(0).clone();
        assert!(empty.as_slice().is_empty());
    }
}
