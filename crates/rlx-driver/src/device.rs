//! Where a compiled graph runs.

use std::fmt;

/// A kind of device RLX can target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// The host CPU.
    Cpu,
    /// An NVIDIA GPU through CUDA.
    Cuda,
    /// A GPU through wgpu (Vulkan, Metal or DX12).
    Gpu,
    /// An Apple GPU through Metal.
    Metal,
    /// Apple silicon through MLX.
    Mlx,
    /// An AMD GPU through ROCm.
    Rocm,
    /// A Google TPU.
    Tpu,
}

impl Device {
    /// Every device kind.
    pub const ALL: [Device; 7] = [
        Device::Cpu,
        Device::Cuda,
        Device::Gpu,
        Device::Metal,
        Device::Mlx,
        Device::Rocm,
        Device::Tpu,
    ];

    /// True when this build has a backend for the device and the device is present.
    /// Only the CPU backend exists so far.
    pub fn is_available(self) -> bool {
        matches!(self, Device::Cpu)
    }

    /// Lowercase name, as accepted on the command line.
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda => "cuda",
            Device::Gpu => "gpu",
            Device::Metal => "metal",
            Device::Mlx => "mlx",
            Device::Rocm => "rocm",
            Device::Tpu => "tpu",
        }
    }
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Device {
    type Err = rlx_ir::Error;

    fn from_str(s: &str) -> Result<Device, Self::Err> {
        Device::ALL
            .into_iter()
            .find(|d| d.name() == s.to_ascii_lowercase())
            .ok_or_else(|| {
                rlx_ir::Error::invalid(
                    "device",
                    format!(
                        "unknown device '{s}' (expected cpu, cuda, gpu, metal, mlx, rocm or tpu)"
                    ),
                )
            })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse_and_cpu_is_available() {
        for d in Device::ALL {
            assert_eq!(d.to_string().parse::<Device>().unwrap(), d);
        }
        assert!(Device::Cpu.is_available());
        assert!("vulkan".parse::<Device>().is_err());
    }
}
