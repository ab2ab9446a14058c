//! Devices and memory: [`Device`], the [`DeviceArena`] trait, owned [`Buffer`]s,
//! persistent [`BufferHandle`]s, and bounds-checked conversion between host `f32` and
//! every dtype.

mod arena;
mod buffer;
pub mod convert;
mod device;
mod profile;

pub use arena::{DeviceArena, HostArena};
pub use buffer::{AlignedBytes, Buffer, BufferHandle};
pub use device::Device;
pub use profile::{KernelTime, Profile};
pub use rlx_ir::{DType, Error, Result, Shape};
