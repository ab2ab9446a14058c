//! Compiling generated CUDA C with NVRTC, with the PTX cached on disk by a hash of
//! the source and the target, so a second start of the same program compiles
//! nothing.

use crate::gpu::{Gpu, cuda_error};
use cudarc::driver::{result as driver, sys};
use rlx_ir::{Error, Result};
use std::collections::hash_map::DefaultHasher;
use std::ffi::CString;
use std::hash::{Hash, Hasher};
use std::path::PathBuf;
use std::sync::atomic::{AtomicUsize, Ordering};

/// Compilations that missed the disk cache in this process (for tests and the
/// "second start compiles nothing" check).
pub static COMPILES: AtomicUsize = AtomicUsize::new(0);

/// Where PTX is cached: `$RLX_CACHE/cuda`, else `$XDG_CACHE_HOME/rlx/cuda`, else
/// `~/.cache/rlx/cuda`.
pub fn cache_dir() -> Option<PathBuf> {
    let base = rlx_ir::env::Switch::Cache
        .value()
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("XDG_CACHE_HOME").map(|d| PathBuf::from(d).join("rlx")))
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache/rlx")))?;
    Some(base.join("cuda"))
}

/// A loaded module; unloaded on drop.
pub(crate) struct Module {
    module: sys::CUmodule,
}

// The module is used by the program that owns it, one thread at a time.
unsafe impl Send for Module {}
unsafe impl Sync for Module {}

impl Module {
    /// Compiles `source` for the GPU's architecture (or takes the cached PTX) and
    /// loads it.
    pub fn compile(gpu: &Gpu, source: &str) -> Result<Module> {
        let (major, minor) = gpu
            .ctx
            .compute_capability()
            .map_err(|e| cuda_error("reading the compute capability", e))?;
        let arch = format!("compute_{major}{minor}");
        let ptx = cached_ptx(source, &arch)?;
        gpu.bind()?;
        let image = CString::new(ptx)
            .map_err(|_| Error::invalid("ptx", "NVRTC output holds a NUL byte"))?;
        // SAFETY: the image is a NUL-terminated PTX string that lives across the call.
        let module = unsafe { driver::module::load_data(image.as_ptr().cast()) }
            .map_err(|e| cuda_error("loading the generated kernels", e))?;
        Ok(Module { module })
    }

    /// The kernel named `name`.
    pub fn function(&self, name: &str) -> Result<sys::CUfunction> {
        let cname = CString::new(name).map_err(|_| Error::invalid("kernel", name))?;
        // SAFETY: the module is loaded and the name is NUL-terminated.
        unsafe { driver::module::get_function(self.module, cname) }
            .map_err(|e| cuda_error(&format!("finding kernel {name}"), e))
    }
}

impl Drop for Module {
    fn drop(&mut self) {
        // SAFETY: loaded once by `compile`, unloaded once.
        unsafe {
            let _ = driver::module::unload(self.module);
        }
    }
}

fn cached_ptx(source: &str, arch: &str) -> Result<String> {
    let mut h = DefaultHasher::new();
    (source, arch, env!("CARGO_PKG_VERSION")).hash(&mut h);
    let file = cache_dir().map(|d| d.join(format!("{:016x}.ptx", h.finish())));
    if let Some(ptx) = file.as_ref().and_then(|f| std::fs::read_to_string(f).ok()) {
        return Ok(ptx);
    }
    COMPILES.fetch_add(1, Ordering::Relaxed);
    let arch: &'static str = Box::leak(arch.to_string().into_boxed_str());
    let options = cudarc::nvrtc::CompileOptions {
        arch: Some(arch),
        options: vec!["--std=c++17".into()],
        ..Default::default()
    };
    let ptx = cudarc::nvrtc::compile_ptx_with_opts(source, options)
        .map_err(|e| cuda_error("compiling the generated kernels with NVRTC", e))?
        .to_src();
    if let Some(file) = file {
        // A cache that cannot be written costs a compile next time, nothing more.
        if let Some(dir) = file.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = file.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &ptx).is_ok() {
            let _ = std::fs::rename(&tmp, &file);
        }
    }
    Ok(ptx)
}
