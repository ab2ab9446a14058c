//! The seam between the runtime and a device: a [`Backend`] compiles a [`Plan`] into
//! an [`Executable`]. Each device crate (`rlx-cpu`, `rlx-cuda`) implements these
//! traits itself; `rlx-runtime` only picks the backend for a device. Nothing here
//! assumes the arena is host memory: inputs go through a host staging area, outputs
//! are made host-visible by [`Executable::sync_outputs`].

use rlx_driver::{Device, Profile};
use rlx_ir::{NodeId, Result};
use rlx_opt::{FusionOptions, Plan};
use std::any::Any;
use std::sync::Arc;

/// A device backend.
pub trait Backend: Send + Sync {
    /// The device it runs on.
    fn device(&self) -> Device;
    /// The fused forms it runs natively; the planner forms only these.
    fn fusion(&self) -> FusionOptions;
    /// The ops it runs natively. Composites outside the set are decomposed into
    /// primitives when compiling; a primitive outside it is a compile error naming it.
    fn native_ops(&self) -> rlx_ir::decompose::NativeOps {
        rlx_ir::decompose::NativeOps::All
    }
    /// Prepares a plan for execution (allocates the arena, weights and handles once).
    fn compile(&self, plan: Arc<Plan>, options: &BackendOptions) -> Result<Box<dyn Executable>>;
}

/// Device-level settings a backend compiles with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct BackendOptions {
    /// Most CPU threads a run may use; 0 means all the runtime's threads.
    pub threads: usize,
    /// Which GPU of its kind a device backend runs on (0 is the first).
    pub ordinal: usize,
    /// Whether f32 products may round their operands to TF32 on tensor cores
    /// (faster, about 3e-4 relative error); off by default.
    pub allow_tf32: bool,
    /// Whether f32 products on a CPU with AMX may round their operands to bfloat16
    /// and sum in f32 on its tiles (each operand off by up to 2^-9 relative); off by
    /// default.
    pub allow_bf16: bool,
}

/// One compiled plan on one device, with its memory.
pub trait Executable: Send {
    /// `(node, kernel name)` for every kernel launched, in order.
    fn kernels(&self) -> Vec<(NodeId, String)>;
    /// Replaces param `index` (in plan order) with `bytes` of its dtype.
    fn set_param(&mut self, index: usize, bytes: &[u8]) -> Result<()>;
    /// Param `index`'s storage as an opaque handle another executable of the same
    /// backend can adopt with [`Executable::import_param`] without copying.
    fn export_param(&self, index: usize) -> Result<SharedParam>;
    /// Makes param `index` use storage exported by another executable of this backend.
    /// Shared storage is copied only when one of its users writes it.
    fn import_param(&mut self, index: usize, param: &SharedParam) -> Result<()>;
    /// Host-visible bytes where run-time input `index` is staged before a run.
    fn input_staging(&mut self, index: usize) -> Result<&mut [u8]>;
    /// Starts a run with the staged inputs; may return before it finishes.
    fn submit(&mut self) -> Result<()>;
    /// [`Executable::submit`] with the outputs' copies to the host queued behind
    /// the run, so that [`Executable::sync_outputs`] after [`Executable::wait`] has
    /// nothing left to wait for. By default a plain submit.
    fn submit_with_outputs(&mut self) -> Result<()> {
        self.submit()
    }
    /// Waits for the last submitted run.
    fn wait(&mut self) -> Result<()>;
    /// Makes every output readable on the host (a copy from device memory where the
    /// arena is not host memory; nothing on the CPU).
    fn sync_outputs(&mut self) -> Result<()>;
    /// Host-visible bytes of a node's value; for outputs, valid after `sync_outputs`.
    fn value_bytes(&self, node: NodeId) -> Result<&[u8]>;
    /// Copies persistent handle `index` to the host.
    fn read_handle(&self, index: usize, dst: &mut [u8]) -> Result<()>;
    /// Replaces persistent handle `index`.
    fn write_handle(&mut self, index: usize, bytes: &[u8]) -> Result<()>;
    /// Moves persistent handle `index`'s storage out (leaving it empty until a
    /// [`Executable::put_handle`]), so that another executable can adopt it.
    fn take_handle(&mut self, index: usize) -> Result<HandleStorage>;
    /// Installs storage taken from an executable of this backend as handle `index`;
    /// its shape and dtype must be the handle's.
    fn put_handle(&mut self, index: usize, storage: HandleStorage) -> Result<()>;
    /// Base address of the arena when it is host memory.
    fn arena_ptr(&self) -> Option<*const u8>;
    /// Turns per-kernel timing on (clearing earlier totals) or off.
    fn set_profiling(&mut self, on: bool);
    /// With profiling on: per-kernel times over the profiled runs.
    fn profile(&self) -> Option<Profile>;
    /// An independent copy with its own arena and handles (params may be shared until
    /// written).
    fn clone_box(&self) -> Box<dyn Executable>;
    /// Runs later steps on the first `rows` rows (dimension 0) of the graph inputs
    /// `inputs`, with the shapes `rlx_opt::extent::active_shapes` gives every value;
    /// the planned row count restores the planned shapes. Backends that cannot say so.
    fn set_active_rows(&mut self, inputs: &[NodeId], rows: usize) -> Result<()> {
        let _ = (inputs, rows);
        Err(rlx_ir::Error::Unsupported {
            device: "this backend".into(),
            what: "running on fewer rows than planned (set_active_extent)".into(),
        })
    }
}

/// A param's storage, exported by one executable for others of the same device.
#[derive(Clone)]
pub struct SharedParam {
    device: Device,
    storage: Arc<dyn Any + Send + Sync>,
}

impl SharedParam {
    /// Wraps backend-specific storage (e.g. `Arc<Buffer>` on the CPU).
    pub fn new<T: Any + Send + Sync>(device: Device, storage: T) -> SharedParam {
        SharedParam {
            device,
            storage: Arc::new(storage),
        }
    }

    /// The device whose memory holds it.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The storage, when it is of type `T`.
    pub fn storage<T: Any>(&self) -> Option<&T> {
        self.storage.downcast_ref::<T>()
    }
}

impl std::fmt::Debug for SharedParam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "SharedParam(on {})", self.device)
    }
}

/// A persistent handle's storage, moved between executables of one device (a KV
/// cache handed from a prefill graph to a decode graph without a copy).
pub struct HandleStorage {
    device: Device,
    storage: Box<dyn Any + Send>,
}

impl HandleStorage {
    /// Wraps backend-specific storage (a `Buffer` on the CPU).
    pub fn new<T: Any + Send>(device: Device, storage: T) -> HandleStorage {
        HandleStorage {
            device,
            storage: Box::new(storage),
        }
    }

    /// The device whose memory holds it.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The storage, when it is of type `T` (else `self` back).
    pub fn into_inner<T: Any>(self) -> std::result::Result<T, HandleStorage> {
        let device = self.device;
        self.storage
            .downcast::<T>()
            .map(|b| *b)
            .map_err(|storage| HandleStorage { device, storage })
    }
}

impl std::fmt::Debug for HandleStorage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "HandleStorage(on {})", self.device)
    }
}
