//! Where a compiled graph runs.

use std::fmt;

/// A kind of device RLX can target.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Device {
    /// The host CPU.
    Cpu,
    /// An NVIDIA GPU through CUDA, by ordinal (0 is the first).
    Cuda(usize),
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
        Device::Cuda(0),
        Device::Gpu,
        Device::Metal,
        Device::Mlx,
        Device::Rocm,
        Device::Tpu,
    ];

    /// Lowercase name of the kind, as accepted on the command line (without the
    /// ordinal).
    pub fn name(self) -> &'static str {
        match self {
            Device::Cpu => "cpu",
            Device::Cuda(_) => "cuda",
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
        match self {
            Device::Cuda(n) if *n > 0 => write!(f, "cuda:{n}"),
            _ => f.write_str(self.name()),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = rlx_ir::Error;

    fn from_str(s: &str) -> Result<Device, Self::Err> {
        let lower = s.to_ascii_lowercase();
        let unknown = || {
            rlx_ir::Error::invalid(
                "device",
                format!(
                    "unknown device '{s}' (expected cpu, cuda, cuda:N, gpu, metal, mlx, rocm or tpu)"
                ),
            )
        };
        if let Some(n) = lower.strip_prefix("cuda:") {
            return n.parse().map(Device::Cuda).map_err(|_| unknown());
        }
        Device::ALL
            .into_iter()
            .find(|d| d.name() == lower)
            .ok_or_else(unknown)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_parse() {
        for d in Device::ALL {
            assert_eq!(d.to_string().parse::<Device>().unwrap(), d);
        }
        assert_eq!("cuda:2".parse::<Device>().unwrap(), Device::Cuda(2));
        assert_eq!(Device::Cuda(2).to_string(), "cuda:2");
        assert!("vulkan".parse::<Device>().is_err());
        assert!("cuda:x".parse::<Device>().is_err());
    }
}
