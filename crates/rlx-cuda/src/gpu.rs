//! One GPU as a program uses it: its context, one stream, cuBLAS and cuBLASLt handles, and
//! device allocations that free themselves.

use cudarc::cublas::result as cublas;
use cudarc::cublas::sys::cublasHandle_t;
use cudarc::driver::{CudaContext, CudaStream, result as driver, sys};
use rlx_ir::{Error, Result};
use std::sync::Arc;

/// A driver, NVRTC or cuBLAS failure as an `rlx::Error` naming what was being done.
pub(crate) fn cuda_error(what: &str, e: impl std::fmt::Debug) -> Error {
    Error::Runtime {
        context: "cuda".into(),
        message: format!("{what}: {e:?}"),
    }
}

/// Bytes of cuBLAS's workspace (what it asks for on Hopper).
const BLAS_WORKSPACE: usize = 32 << 20;

/// The context, stream and cuBLAS handle of one GPU.
pub(crate) struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    pub blas: Blas,
    /// cuBLASLt, for products with their bias and residual folded in (`None` where
    /// the library is missing or `RLX_CUDA_LT=0`).
    pub lt: Option<crate::lt_matmul::LtHandle>,
    /// Streaming multiprocessors: kernels size their grids to fill them.
    pub multiprocessors: usize,
    /// Whether the GPU has the `mma.m16n8k16` instructions (compute capability 8.0+).
    pub tensor_cores: bool,
    /// Whether kernels are launched with a programmatic dependency on the kernel
    /// before them (compute capability 9.0+, unless `RLX_CUDA_PDL=0`): a launch is
    /// scheduled while its predecessor finishes, and waits in its first statement.
    pub programmatic_launch: bool,
    /// Held by whoever queues work on the stream or waits for it. A graph capture
    /// records everything queued on the stream, from any thread, so another
    /// program's copies and kernels must not slip into it; this keeps them out.
    stream_lock: std::sync::Mutex<()>,
    /// cuBLAS's workspace, set once so that a captured product allocates nothing.
    workspace_buffer: DeviceBuffer,
}

/// A cuBLAS handle bound to the program's stream.
pub(crate) struct Blas(pub cublasHandle_t);

// The handle is used only by the program that owns it, from one thread at a time.
unsafe impl Send for Blas {}
unsafe impl Sync for Blas {}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle was created by `Gpu::new` and is destroyed once.
        unsafe {
            let _ = cublas::destroy_handle(self.0);
        }
    }
}

impl Gpu {
    /// The primary context of GPU `ordinal`, a new stream on it and a cuBLAS handle.
    pub fn new(ordinal: usize) -> Result<Gpu> {
        let ctx = CudaContext::new(ordinal).map_err(|e| cuda_error("creating a context", e))?;
        let stream = ctx
            .new_stream()
            .map_err(|e| cuda_error("creating a stream", e))?;
        let handle = cublas::create_handle().map_err(|e| cuda_error("creating cuBLAS", e))?;
        let blas = Blas(handle);
        // SAFETY: both handles are live; the stream outlives the cuBLAS handle's use.
        unsafe { cublas::set_stream(blas.0, stream.cu_stream() as _) }
            .map_err(|e| cuda_error("binding cuBLAS to the stream", e))?;
        let multiprocessors = ctx
            .attribute(sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(|e| cuda_error("reading the multiprocessor count", e))?
            .max(1) as usize;
        let (major, _) = ctx
            .compute_capability()
            .map_err(|e| cuda_error("reading the compute capability", e))?;
        let bytes = BLAS_WORKSPACE;
        ctx.bind_to_thread()
            .map_err(|e| cuda_error("binding the context", e))?;
        // SAFETY: the context is current; the size is non-zero.
        let ptr = unsafe { driver::malloc_sync(bytes) }
            .map_err(|e| cuda_error("allocating cuBLAS's workspace", e))?;
        let workspace = DeviceBuffer {
            ctx: ctx.clone(),
            ptr,
            bytes,
        };
        // SAFETY: the handle is live and the buffer outlives it (dropped after it).
        unsafe {
            cudarc::cublas::sys::cublasSetWorkspace_v2(blas.0, ptr as *mut _, bytes).result()
        }
        .map_err(|e| cuda_error("setting cuBLAS's workspace", e))?;
        Ok(Gpu {
            ctx,
            stream,
            blas,
            lt: crate::lt_matmul::LtHandle::open(),
            multiprocessors,
            tensor_cores: major >= 8,
            programmatic_launch: major >= 9 && rlx_ir::env::Switch::CudaPdl.enabled(),
            stream_lock: std::sync::Mutex::new(()),
            workspace_buffer: workspace,
        })
    }

    /// cuBLAS's workspace (shared with cuBLASLt: both queue on the one stream): its
    /// address and size.
    pub fn blas_workspace(&self) -> (sys::CUdeviceptr, usize) {
        (self.workspace_buffer.ptr(), self.workspace_buffer.len())
    }

    /// Makes the context current on the calling thread (every driver call needs it).
    pub fn bind(&self) -> Result<()> {
        self.ctx
            .bind_to_thread()
            .map_err(|e| cuda_error("binding the context", e))
    }

    /// The raw stream.
    pub fn cu_stream(&self) -> sys::CUstream {
        self.stream.cu_stream()
    }

    /// Exclusive use of the stream until the guard drops.
    pub fn lock_stream(&self) -> std::sync::MutexGuard<'_, ()> {
        self.stream_lock.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Waits for everything queued on the stream.
    pub fn synchronize(&self) -> Result<()> {
        let _stream = self.lock_stream();
        self.stream
            .synchronize()
            .map_err(|e| cuda_error("waiting for the stream", e))
    }
}

/// One device allocation, freed on drop.
pub(crate) struct DeviceBuffer {
    ctx: Arc<CudaContext>,
    ptr: sys::CUdeviceptr,
    bytes: usize,
}

impl DeviceBuffer {
    /// `bytes` of device memory (at least one byte is allocated, so every buffer has
    /// an address); `what` names it in the error when the device is out of memory.
    pub fn new(gpu: &Gpu, bytes: usize, what: &str) -> Result<DeviceBuffer> {
        gpu.bind()?;
        // SAFETY: the context is current; the size is non-zero.
        let ptr = unsafe { driver::malloc_sync(bytes.max(1)) }.map_err(|e| {
            if e.0 == sys::cudaError_enum::CUDA_ERROR_OUT_OF_MEMORY {
                Error::OutOfMemory {
                    tensor: format!("{what} (device memory)"),
                    bytes,
                }
            } else {
                cuda_error(&format!("allocating {bytes} bytes for {what}"), e)
            }
        })?;
        Ok(DeviceBuffer {
            ctx: gpu.ctx.clone(),
            ptr,
            bytes,
        })
    }

    /// A buffer holding `data`.
    pub fn from_bytes(gpu: &Gpu, data: &[u8], what: &str) -> Result<DeviceBuffer> {
        let buffer = DeviceBuffer::new(gpu, data.len(), what)?;
        buffer.upload(gpu, 0, data)?;
        Ok(buffer)
    }

    /// The device address.
    pub fn ptr(&self) -> sys::CUdeviceptr {
        self.ptr
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Copies `data` to `offset` and waits for it (with the work queued before it).
    /// Queued on the program's stream, not as a plain synchronous copy: that goes
    /// through the legacy default stream, which a non-blocking stream does not wait
    /// for, and from pageable memory it returns before the transfer lands, so a
    /// kernel queued next could read the old bytes.
    pub fn upload(&self, gpu: &Gpu, offset: usize, data: &[u8]) -> Result<()> {
        self.upload_queued(gpu, offset, data)?;
        gpu.synchronize()
    }

    /// Queues a copy of `data` to `offset` on the program's stream and returns
    /// without waiting: kernels queued after it read the new bytes. `data` may be
    /// reused at once: from pageable memory the driver has copied it to its own
    /// staging before returning.
    pub fn upload_queued(&self, gpu: &Gpu, offset: usize, data: &[u8]) -> Result<()> {
        self.check(offset, data.len())?;
        if data.is_empty() {
            return Ok(());
        }
        gpu.bind()?;
        let _stream = gpu.lock_stream();
        // SAFETY: the range was checked against the allocation; a pageable source is
        // staged by the driver before the call returns (a `HostBuffer` is never
        // passed here: its bytes would be read later, when the copy runs).
        unsafe { driver::memcpy_htod_async(self.ptr + offset as u64, data, gpu.cu_stream()) }
            .map_err(|e| cuda_error("copying to the device", e))
    }

    /// Queues a copy from `offset` into `dst` after the queued work and returns
    /// without waiting (when `dst` is page-locked; from pageable memory the driver
    /// waits). `dst` holds the bytes once the stream has been synchronized.
    pub fn download_queued(&self, gpu: &Gpu, offset: usize, dst: &mut HostBuffer) -> Result<()> {
        self.check(offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        gpu.bind()?;
        let _stream = gpu.lock_stream();
        // SAFETY: the range was checked; `dst` is owned by the program, which reads
        // or frees it only after synchronizing the stream (`HostBuffer` waits for
        // the stream on drop when it is page-locked).
        unsafe {
            driver::memcpy_dtoh_async(
                dst.as_mut_slice(),
                self.ptr + offset as u64,
                gpu.cu_stream(),
            )
        }
        .map_err(|e| cuda_error("copying from the device", e))
    }

    /// Copies bytes from `offset` into `dst` (after the queued work finishes).
    pub fn download(&self, gpu: &Gpu, offset: usize, dst: &mut [u8]) -> Result<()> {
        self.check(offset, dst.len())?;
        if dst.is_empty() {
            return Ok(());
        }
        gpu.bind()?;
        let _stream = gpu.lock_stream();
        // Queued after the kernels that write this memory (see `upload`).
        // SAFETY: the range was checked; `dst` outlives the copy because the stream is
        // drained before returning.
        unsafe {
            driver::memcpy_dtoh_async(dst, self.ptr + offset as u64, gpu.cu_stream())
                .and_then(|_| driver::stream::synchronize(gpu.cu_stream()))
        }
        .map_err(|e| cuda_error("copying from the device", e))
    }

    fn check(&self, offset: usize, len: usize) -> Result<()> {
        match offset.checked_add(len) {
            Some(end) if end <= self.bytes => Ok(()),
            _ => Err(Error::invalid(
                "device copy",
                format!(
                    "{len} bytes at {offset} pass the end of a {}-byte buffer",
                    self.bytes
                ),
            )),
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: the pointer came from `malloc_sync` and is freed once.
            unsafe {
                let _ = driver::free_sync(self.ptr);
            }
        }
    }
}

/// Queues `function` on `stream` with `blocks` blocks of `threads` threads; with
/// `programmatic`, the launch may begin while the kernel before it on the stream
/// finishes (the kernel waits for it in its first statement: `RLX_ENTER`).
///
/// # Safety
/// `params` must hold one pointer per kernel parameter, each to a value of the
/// parameter's type, valid until the call returns.
pub(crate) unsafe fn launch(
    function: sys::CUfunction,
    (blocks, threads): (u32, u32),
    stream: sys::CUstream,
    params: &mut [*mut std::ffi::c_void],
    programmatic: bool,
) -> std::result::Result<(), cudarc::driver::DriverError> {
    if !programmatic {
        // SAFETY: as the caller promises.
        return unsafe {
            driver::launch_kernel(function, (blocks, 1, 1), (threads, 1, 1), 0, stream, params)
        };
    }
    // SAFETY: the attribute union is plain data; zeroed is a valid value.
    let mut attribute: sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
    attribute.id = sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
    attribute.value.programmaticStreamSerializationAllowed = 1;
    let config = sys::CUlaunchConfig {
        gridDimX: blocks,
        gridDimY: 1,
        gridDimZ: 1,
        blockDimX: threads,
        blockDimY: 1,
        blockDimZ: 1,
        sharedMemBytes: 0,
        hStream: stream,
        attrs: &mut attribute,
        numAttrs: 1,
    };
    // SAFETY: the configuration and its one attribute live through the call; the
    // parameters are as the caller promises.
    unsafe {
        sys::cuLaunchKernelEx(&config, function, params.as_mut_ptr(), std::ptr::null_mut()).result()
    }
}

/// Host memory that device copies land in: page-locked where the driver grants it
/// (a copy into it is a DMA that runs queued, at full link speed), else an ordinary
/// allocation (the copy then waits, and goes through the driver's staging).
pub(crate) struct HostBuffer {
    memory: HostMemory,
    bytes: usize,
}

enum HostMemory {
    Locked { gpu: Arc<Gpu>, ptr: *mut u8 },
    Pageable(Vec<u8>),
}

// The memory is plain bytes owned by the buffer, as a `Vec` is; the raw pointer is
// only what the allocation call returned.
unsafe impl Send for HostBuffer {}
unsafe impl Sync for HostBuffer {}

impl HostBuffer {
    /// `bytes` zeroed bytes, page-locked when possible.
    pub fn new(gpu: &Arc<Gpu>, bytes: usize) -> HostBuffer {
        let locked = gpu.bind().ok().and_then(|()| {
            // Page-locking may synchronize the device, which would break a graph
            // capture of the (shared) stream in another thread: captures hold the
            // stream's lock, so this waits for them.
            let _stream = gpu.lock_stream();
            // SAFETY: the context is current; the size is non-zero.
            unsafe { driver::malloc_host(bytes.max(1), 0) }.ok()
        });
        let memory = match locked {
            Some(ptr) => {
                let ptr = ptr.cast::<u8>();
                // SAFETY: the allocation holds at least `bytes` bytes.
                unsafe { std::ptr::write_bytes(ptr, 0, bytes) };
                HostMemory::Locked {
                    gpu: gpu.clone(),
                    ptr,
                }
            }
            None => HostMemory::Pageable(vec![0u8; bytes]),
        };
        HostBuffer { memory, bytes }
    }

    /// Its size in bytes.
    pub fn len(&self) -> usize {
        self.bytes
    }

    /// Whether it holds no bytes.
    pub fn is_empty(&self) -> bool {
        self.bytes == 0
    }

    /// The bytes (what the last synchronized copy left).
    pub fn as_slice(&self) -> &[u8] {
        match &self.memory {
            // SAFETY: the allocation holds `bytes` initialized bytes for the
            // buffer's life.
            HostMemory::Locked { ptr, .. } => unsafe {
                std::slice::from_raw_parts(*ptr, self.bytes)
            },
            HostMemory::Pageable(v) => v,
        }
    }

    /// The bytes, writable.
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        match &mut self.memory {
            // SAFETY: as `as_slice`, borrowed mutably.
            HostMemory::Locked { ptr, .. } => unsafe {
                std::slice::from_raw_parts_mut(*ptr, self.bytes)
            },
            HostMemory::Pageable(v) => v,
        }
    }
}

impl Drop for HostBuffer {
    fn drop(&mut self) {
        if let HostMemory::Locked { gpu, ptr } = &self.memory
            && gpu.bind().is_ok()
        {
            // A queued copy may still be writing here: let it land first (under the
            // stream's lock, as in `new`).
            let _stream = gpu.lock_stream();
            let _ = gpu.stream.synchronize();
            // SAFETY: the pointer came from `malloc_host` and is freed once.
            unsafe {
                let _ = driver::free_host(ptr.cast());
            }
        }
    }
}
