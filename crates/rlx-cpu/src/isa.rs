//! The CPU's instruction-set features, detected once per process: every kernel
//! family asks [`isa()`] instead of detecting for itself.
//!
//! `RLX_CPU_KERNEL` narrows what the kernels may use (`generic`: portable code only;
//! `avx2`: no AVX-512 or AMX), so one machine can run the code of a smaller CPU.
//! `RLX_NO_AMX` turns the AMX tiles off alone.

use std::sync::OnceLock;

/// What the kernels may use on this CPU.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct Isa {
    /// AVX2 with fused multiply-add.
    pub avx2_fma: bool,
    /// AVX-512 Foundation.
    pub avx512f: bool,
    /// Half-precision conversions (F16C).
    pub f16c: bool,
    /// AMX tiles with bfloat16 products, usable under this OS.
    pub amx_bf16: bool,
}

impl Isa {
    /// The portable subset: no vector extension at all.
    pub const GENERIC: Isa = Isa {
        avx2_fma: false,
        avx512f: false,
        f16c: false,
        amx_bf16: false,
    };

    /// What the hardware has, ignoring the environment switches.
    pub fn hardware() -> Isa {
        #[cfg(target_arch = "x86_64")]
        {
            let avx512f = std::arch::is_x86_feature_detected!("avx512f");
            Isa {
                avx2_fma: std::arch::is_x86_feature_detected!("avx2")
                    && std::arch::is_x86_feature_detected!("fma"),
                avx512f,
                f16c: std::arch::is_x86_feature_detected!("f16c"),
                amx_bf16: avx512f && amx_usable(),
            }
        }
        #[cfg(not(target_arch = "x86_64"))]
        Isa::GENERIC
    }

    /// `self` narrowed by a `RLX_CPU_KERNEL` value (`generic`, `avx2`; anything
    /// else keeps it) and `RLX_NO_AMX` (set: no AMX).
    pub fn narrowed(self, cpu_kernel: Option<&str>, no_amx: bool) -> Isa {
        let mut isa = match cpu_kernel {
            Some("generic") => Isa::GENERIC,
            Some("avx2") => Isa {
                avx512f: false,
                amx_bf16: false,
                ..self
            },
            _ => self,
        };
        if no_amx {
            isa.amx_bf16 = false;
        }
        isa
    }
}

/// Whether this CPU has AMX with bfloat16 and the OS lets this process use its
/// tiles (asks the OS for them; called once).
#[cfg(all(target_arch = "x86_64", target_os = "linux"))]
fn amx_usable() -> bool {
    use std::arch::x86_64::{__cpuid_count, _xgetbv};
    if !std::arch::is_x86_feature_detected!("avx512f") {
        return false;
    }
    // CPUID leaf 7 exists on every CPU with AVX-512.
    let leaf7 = __cpuid_count(7, 0);
    let (amx_bf16, amx_tile) = (leaf7.edx >> 22 & 1 == 1, leaf7.edx >> 24 & 1 == 1);
    if !(amx_bf16 && amx_tile && std::arch::is_x86_feature_detected!("xsave")) {
        return false;
    }
    // SAFETY: XGETBV is available where XSAVE is (checked above).
    let xcr0 = unsafe { _xgetbv(0) };
    const TILE_STATE: u64 = 0b11 << 17; // XTILECFG and XTILEDATA
    if xcr0 & TILE_STATE != TILE_STATE {
        return false;
    }
    const ARCH_REQ_XCOMP_PERM: libc::c_long = 0x1023;
    const XFEATURE_XTILEDATA: libc::c_long = 18;
    // SAFETY: a permission request; it touches no memory of ours.
    unsafe {
        libc::syscall(
            libc::SYS_arch_prctl,
            ARCH_REQ_XCOMP_PERM,
            XFEATURE_XTILEDATA,
        ) == 0
    }
}

#[cfg(not(all(target_arch = "x86_64", target_os = "linux")))]
fn amx_usable() -> bool {
    false
}

/// The features the kernels use: detected on first call, then fixed for the process.
pub fn isa() -> &'static Isa {
    static ISA: OnceLock<Isa> = OnceLock::new();
    ISA.get_or_init(|| {
        Isa::hardware().narrowed(
            rlx_ir::env::Switch::CpuKernel.value().as_deref(),
            rlx_ir::env::Switch::NoAmx.is_set(),
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn narrowing_only_removes_features() {
        let all = Isa {
            avx2_fma: true,
            avx512f: true,
            f16c: true,
            amx_bf16: true,
        };
        assert_eq!(all.narrowed(Some("generic"), false), Isa::GENERIC);
        let avx2 = all.narrowed(Some("avx2"), false);
        assert!(avx2.avx2_fma && avx2.f16c && !avx2.avx512f && !avx2.amx_bf16);
        assert_eq!(all.narrowed(None, false), all);
        assert_eq!(all.narrowed(Some("something else"), false), all);
        assert!(!all.narrowed(None, true).amx_bf16);
        assert_eq!(Isa::GENERIC.narrowed(Some("avx2"), false), Isa::GENERIC);
    }

    #[test]
    fn detection_is_stable_and_within_the_hardware() {
        let hw = Isa::hardware();
        let used = *isa();
        assert_eq!(used, *isa());
        assert!(!used.avx512f || hw.avx512f);
        assert!(!used.avx2_fma || hw.avx2_fma);
        assert!(!used.amx_bf16 || hw.amx_bf16);
    }
}
