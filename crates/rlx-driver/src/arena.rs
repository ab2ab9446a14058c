//! The arena: one block of device memory per compiled graph holding every transient
//! value at the offset the memory planner chose.

use crate::{AlignedBytes, Device};
use rlx_ir::{Error, Result};

/// One contiguous block of memory on a device. Offsets come from the memory plan;
/// every access is bounds-checked. A host-memory arena can also lend its bytes
/// directly ([`DeviceArena::host_bytes`]); a discrete-GPU arena returns `None` there
/// and is read and written through copies.
pub trait DeviceArena: Send {
    /// The device the memory lives on.
    fn device(&self) -> Device;
    /// Size in bytes.
    fn len(&self) -> usize;
    /// True for an empty arena.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// Copies host bytes into the arena at `offset`.
    fn write(&mut self, offset: usize, src: &[u8]) -> Result<()>;
    /// Copies arena bytes at `offset` into `dst`.
    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()>;
    /// The arena's bytes, when it lives in host memory.
    fn host_bytes(&self) -> Option<&[u8]>;
}

/// An arena in host memory (64-byte aligned).
#[derive(Clone, Debug)]
pub struct HostArena {
    bytes: AlignedBytes,
}

impl HostArena {
    /// A zeroed arena of `len` bytes. Aborts when the memory is not available; see
    /// [`HostArena::try_new`].
    pub fn new(len: usize) -> HostArena {
        HostArena {
            bytes: AlignedBytes::zeroed(len),
        }
    }

    /// A zeroed arena of `len` bytes, or [`Error::OutOfMemory`] (tensor "arena") when
    /// the allocation fails.
    pub fn try_new(len: usize) -> Result<HostArena> {
        Ok(HostArena {
            bytes: AlignedBytes::try_zeroed(len, "arena")?,
        })
    }

    /// Base address (for kernels that address values by plan offset).
    pub fn as_ptr(&self) -> *const u8 {
        self.bytes.as_ptr()
    }

    /// Base address, mutable.
    pub fn as_mut_ptr(&mut self) -> *mut u8 {
        self.bytes.as_mut_ptr()
    }

    /// The bytes, mutably.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        self.bytes.as_mut_slice()
    }

    fn range(&self, offset: usize, len: usize) -> Result<std::ops::Range<usize>> {
        let end = offset
            .checked_add(len)
            .filter(|&e| e <= self.bytes.len())
            .ok_or_else(|| {
                Error::invalid(
                    "arena",
                    format!(
                        "range {offset}..+{len} exceeds the arena of {} bytes",
                        self.bytes.len()
                    ),
                )
            })?;
        Ok(offset..end)
    }
}

impl DeviceArena for HostArena {
    fn device(&self) -> Device {
        Device::Cpu
    }

    fn len(&self) -> usize {
        self.bytes.len()
    }

    fn write(&mut self, offset: usize, src: &[u8]) -> Result<()> {
        let r = self.range(offset, src.len())?;
        self.bytes.as_mut_slice()[r].copy_from_slice(src);
        Ok(())
    }

    fn read(&self, offset: usize, dst: &mut [u8]) -> Result<()> {
        let r = self.range(offset, dst.len())?;
        dst.copy_from_slice(&self.bytes.as_slice()[r]);
        Ok(())
    }

    fn host_bytes(&self) -> Option<&[u8]> {
        Some(self.bytes.as_slice())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_and_writes_are_bounds_checked() {
        let mut a = HostArena::new(16);
        a.write(12, &[1, 2, 3, 4]).unwrap();
        assert!(a.write(13, &[1, 2, 3, 4]).is_err());
        assert!(a.write(usize::MAX, &[1]).is_err());
        let mut out = [0u8; 2];
        a.read(14, &mut out).unwrap();
        assert_eq!(out, [3, 4]);
        assert!(a.read(15, &mut out).is_err());
        assert_eq!(a.host_bytes().unwrap().len(), 16);
    }
}
