//! Which backend runs which device: the one place the runtime names device crates.

use rlx_backend::Backend;
use rlx_driver::Device;
use rlx_ir::{Error, Result};

/// The backend for `device`: an error when this build has none for its kind, or the
/// device is not present (no driver, no such GPU).
pub fn backend_for(device: Device) -> Result<Box<dyn Backend>> {
    match device {
        Device::Cpu => Ok(Box::new(rlx_cpu::CpuBackend)),
        Device::Cuda(ordinal) => Ok(Box::new(rlx_cuda::CudaBackend::new(ordinal)?)),
        other => Err(Error::DeviceUnavailable {
            device: other.to_string(),
            reason: "this build of RLX has no backend for it".into(),
        }),
    }
}

/// Whether `device` can run graphs here; the error says why not.
pub fn device_available(device: Device) -> Result<()> {
    match device {
        Device::Cuda(ordinal) => rlx_cuda::available(ordinal),
        other => backend_for(other).map(|_| ()),
    }
}
