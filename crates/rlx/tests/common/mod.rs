//! Helpers shared by the integration tests.

use rlx::prelude::*;

/// The devices the suites run on: the CPU, and CUDA GPU 0 when it is available
/// (said once on stderr when it is not).
pub fn test_devices() -> Vec<Device> {
    static CUDA: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let cuda = *CUDA.get_or_init(|| match rlx::device_available(Device::Cuda(0)) {
        Ok(()) => true,
        Err(e) => {
            eprintln!("CUDA cases skipped: {e}");
            false
        }
    });
    let mut devices = vec![Device::Cpu];
    if cuda {
        devices.push(Device::Cuda(0));
    }
    devices
}
