//! A plan compiled for one GPU: the arena as one device allocation, params and
//! handles in their own allocations, the generated kernels in one module, and the
//! matrix products as cuBLAS calls. Running queues every step on one stream; inputs
//! are copied up from host staging before, outputs down after.

use crate::codegen::{self, Grid};
use crate::gpu::{DeviceBuffer, Gpu, cuda_error};
use crate::matmul::Gemm;
use crate::nvrtc::Module;
use cudarc::driver::{result as driver, sys};
use rlx_backend::{Executable, HandleStorage, SharedParam};
use rlx_driver::{Device, Profile};
use rlx_ir::{Error, NodeId, Op, Result};
use rlx_opt::{Location, Plan, Region};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::Arc;

/// Threads per block of the generated elementwise kernels.
const BLOCK: usize = 256;

/// The name kernels are generated under, replaced by each distinct kernel's own.
const STEP_NAME: &str = "rlx_step";

/// Most pointer arguments of a generated kernel (its output and operands).
const MAX_ARGS: usize = 64;

/// One queued step.
enum Launch {
    /// A generated kernel.
    Kernel {
        function: sys::CUfunction,
        grid: Grid,
        out: Location,
        inputs: Vec<Location>,
        /// Whether it takes the error word as its last argument.
        checked: bool,
    },
    /// A cuBLAS product.
    Gemm(Gemm),
}

/// A compiled plan on one GPU.
pub struct CudaProgram {
    ordinal: usize,
    gpu: Arc<Gpu>,
    plan: Arc<Plan>,
    module: Arc<Module>,
    launches: Arc<Vec<(NodeId, String, Launch)>>,
    arena: DeviceBuffer,
    params: Vec<Arc<DeviceBuffer>>,
    constants: Arc<Vec<DeviceBuffer>>,
    handles: Vec<Option<DeviceBuffer>>,
    staging: Vec<Vec<u8>>,
    outputs: HashMap<NodeId, Vec<u8>>,
    /// The words a kernel's failed run-time check sets (its node index + 1, and the
    /// value that failed), and what each code means; read after every run that has
    /// checked kernels.
    errors: DeviceBuffer,
    checks: Arc<HashMap<i32, String>>,
}

// Raw CUDA handles inside are used by one thread at a time (the program is `Send`,
// not `Sync`, as `Executable` asks).
unsafe impl Send for Launch {}
unsafe impl Sync for Launch {}

fn location_error(plan: &Plan, what: String) -> Error {
    Error::InvalidGraph {
        graph: plan.graph.name().into(),
        node: what,
        message: "the plan has no location for this value".into(),
    }
}

impl CudaProgram {
    /// Generates and compiles the plan's kernels and allocates its memory on `gpu`.
    pub(crate) fn new(
        gpu: Arc<Gpu>,
        ordinal: usize,
        plan: Arc<Plan>,
        allow_tf32: bool,
    ) -> Result<CudaProgram> {
        let graph = &plan.graph;
        let nodes = graph.nodes();
        for (i, node) in nodes.iter().enumerate() {
            let location = *plan
                .locations
                .get(i)
                .ok_or_else(|| location_error(&plan, format!("%{i}")))?;
            plan.check_range(&format!("%{i} ({})", node.op.name()), location, &node.shape)?;
        }
        let mut source = String::from(codegen::PRELUDE);
        // (node, kernel name or gemm) in schedule order.
        enum Pending {
            Kernel(String, Grid, bool),
            Gemm(Gemm),
        }
        let mut checks = HashMap::new();
        // Steps with the same kernel text (the same op over the same shapes, as in
        // every layer of a model) share one compiled function: a 30-layer model
        // compiles about one layer's kernels.
        let mut written: HashMap<String, String> = HashMap::new();
        let mut pending = Vec::with_capacity(plan.schedule.len());
        for &id in &plan.schedule {
            let node = &nodes[id.index()];
            let in_shapes: Vec<_> = node
                .inputs
                .iter()
                .map(|x| nodes[x.index()].shape.clone())
                .collect();
            let inputs: Vec<Location> = node
                .inputs
                .iter()
                .map(|x| plan.locations[x.index()])
                .collect();
            let out = plan.locations[id.index()];
            let what = || format!("%{} ({})", id.index(), node.op.name());
            if node.op == Op::MatMul {
                let gemm = Gemm::new(
                    &in_shapes,
                    &node.shape,
                    inputs[0],
                    inputs[1],
                    out,
                    allow_tf32,
                )
                .map_err(|e| Error::Unsupported {
                    device: "cuda".into(),
                    what: format!("{}: {e}", what()),
                })?;
                pending.push((
                    id,
                    format!("cuda.cublas.matmul.{:?}", node.shape.dtype()).to_lowercase(),
                    Pending::Gemm(gemm),
                    inputs,
                    out,
                ));
                continue;
            }
            if inputs.len() + 2 > MAX_ARGS {
                return Err(Error::Unsupported {
                    device: "cuda".into(),
                    what: format!("{}: more than {} operands", what(), MAX_ARGS - 2),
                });
            }
            let code = i32::try_from(id.index() + 1).unwrap_or(i32::MAX);
            if let Op::WriteAt { .. } = node.op {
                // The kernel writes only the update's rows: the result must be the
                // target itself, as the planner places it.
                if out != inputs[0] {
                    return Err(location_error(&plan, what()));
                }
            }
            match codegen::kernel(STEP_NAME, &node.op, &in_shapes, &node.shape, code)? {
                Some(k) => {
                    if let Grid::Blocks { count, .. } = k.grid
                        && count > i32::MAX as usize
                    {
                        return Err(Error::Unsupported {
                            device: "cuda".into(),
                            what: format!("{}: {count} blocks, past CUDA's grid limit", what()),
                        });
                    }
                    let fresh = format!("k{}", written.len());
                    let name = written
                        .entry(k.source.clone())
                        .or_insert_with(|| {
                            source.push_str(&k.source.replace(STEP_NAME, &fresh));
                            fresh
                        })
                        .clone();
                    let checked = k.check.is_some();
                    if let Some(message) = k.check {
                        checks.insert(code, format!("{}: {message}", what()));
                    }
                    pending.push((
                        id,
                        format!("cuda.nvrtc.{}.{:?}", node.op.name(), node.shape.dtype())
                            .to_lowercase(),
                        Pending::Kernel(name, k.grid, checked),
                        inputs,
                        out,
                    ));
                }
                None => {
                    return Err(Error::Unsupported {
                        device: "cuda".into(),
                        what: format!("{}: no CUDA kernel for this op yet", what()),
                    });
                }
            }
        }
        let module = Module::compile(&gpu, &source)?;
        let mut launches = Vec::with_capacity(pending.len());
        for (id, kernel, p, inputs, out) in pending {
            let launch = match p {
                Pending::Kernel(name, grid, checked) => Launch::Kernel {
                    function: module.function(&name)?,
                    grid,
                    out,
                    inputs,
                    checked,
                },
                Pending::Gemm(g) => Launch::Gemm(g),
            };
            launches.push((id, kernel, launch));
        }
        let constants = graph
            .constants()
            .iter()
            .enumerate()
            .map(|(i, data)| {
                DeviceBuffer::from_bytes(
                    &gpu,
                    &data.as_ref().to_le_bytes(),
                    &format!("constant #{i}"),
                )
            })
            .collect::<Result<Vec<_>>>()?;
        let params = plan
            .params
            .iter()
            .map(|p| {
                DeviceBuffer::new(&gpu, p.shape.byte_size(), &format!("param '{}'", p.name))
                    .map(Arc::new)
            })
            .collect::<Result<Vec<_>>>()?;
        let handles = plan
            .handles
            .iter()
            .map(|h| {
                let buffer =
                    DeviceBuffer::new(&gpu, h.shape.byte_size(), &format!("handle '{}'", h.name))?;
                // Handles start as zeros, as on the CPU.
                buffer.upload(&gpu, 0, &vec![0u8; h.shape.byte_size()])?;
                Ok(Some(buffer))
            })
            .collect::<Result<Vec<_>>>()?;
        drop(nodes);
        let arena = DeviceBuffer::new(&gpu, plan.stats.arena_bytes, "the arena")?;
        let errors = DeviceBuffer::from_bytes(&gpu, &[0u8; 16], "the error words")?;
        let staging = plan
            .inputs
            .iter()
            .map(|i| vec![0u8; i.shape.byte_size()])
            .collect();
        let outputs = plan
            .outputs
            .iter()
            .map(|&o| (o, vec![0u8; plan.shape(o).byte_size()]))
            .collect();
        Ok(CudaProgram {
            ordinal,
            gpu,
            plan,
            module: Arc::new(module),
            launches: Arc::new(launches),
            arena,
            params,
            constants: Arc::new(constants),
            handles,
            staging,
            outputs,
            errors,
            checks: Arc::new(checks),
        })
    }

    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    /// The device address of a location.
    fn address(&self, at: Location) -> Result<sys::CUdeviceptr> {
        let base = match at.region {
            Region::Arena => self.arena.ptr(),
            Region::Param(i) => self.params[i].ptr(),
            Region::Constant(i) => self.constants[i].ptr(),
            Region::Handle(i) => self.handles[i]
                .as_ref()
                .ok_or_else(|| {
                    Error::invalid("handle", format!("#{i} was taken and not put back"))
                })?
                .ptr(),
        };
        Ok(base + at.offset as u64)
    }

    fn launch_all(&self) -> Result<()> {
        self.gpu.bind()?;
        let stream = self.gpu.cu_stream();
        for (id, _, launch) in self.launches.iter() {
            match launch {
                Launch::Kernel {
                    function,
                    grid,
                    out,
                    inputs,
                    checked,
                } => {
                    if grid.is_empty() {
                        continue;
                    }
                    // Kernel arguments on the stack: no allocation per launch.
                    let count = inputs.len() + 1 + usize::from(*checked);
                    let mut args = [0u64; MAX_ARGS];
                    args[0] = self.address(*out)?;
                    for (slot, &i) in args[1..].iter_mut().zip(inputs) {
                        *slot = self.address(i)?;
                    }
                    if *checked {
                        args[count - 1] = self.errors.ptr();
                    }
                    let mut pointers = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
                    for (p, a) in pointers.iter_mut().zip(args.iter_mut()) {
                        *p = (a as *mut u64).cast();
                    }
                    let params = &mut pointers[..count];
                    let (blocks, threads) = match *grid {
                        Grid::Elements(n) => (n.div_ceil(BLOCK).min(1 << 20), BLOCK as u32),
                        Grid::Warps(n) => (n.div_ceil(BLOCK / 32).min(1 << 20), BLOCK as u32),
                        Grid::Blocks { count, threads } => (count, threads),
                    };
                    // SAFETY: the kernel's parameters are device pointers, one per
                    // operand, as the generator wrote them; every range was checked
                    // against its region when the program was built.
                    unsafe {
                        driver::launch_kernel(
                            *function,
                            (blocks as u32, 1, 1),
                            (threads, 1, 1),
                            0,
                            stream,
                            params,
                        )
                    }
                    .map_err(|e| cuda_error(&format!("launching %{}", id.index()), e))?;
                }
                Launch::Gemm(g) => {
                    let a = self.address(g.a)?;
                    let b = self.address(g.b)?;
                    let c = self.address(g.c)?;
                    g.run(&self.gpu, a, b, c).map_err(|e| {
                        cuda_error(&format!("the matrix product %{}", id.index()), e)
                    })?;
                }
            }
        }
        Ok(())
    }

    /// Handle `index`'s buffer, checked to hold `len` bytes.
    fn handle_of_len(&self, index: usize, len: usize) -> Result<&DeviceBuffer> {
        let buffer = self.handle_buffer(index)?;
        if buffer.len() != len {
            return Err(Error::LengthMismatch {
                kind: "handle",
                name: format!("#{index}"),
                expected: buffer.len(),
                got: len,
                unit: "bytes",
            });
        }
        Ok(buffer)
    }

    fn handle_buffer(&self, index: usize) -> Result<&DeviceBuffer> {
        self.handles
            .get(index)
            .ok_or_else(|| Error::invalid("handle", format!("no handle #{index}")))?
            .as_ref()
            .ok_or_else(|| Error::invalid("handle", format!("#{index} was taken and not put back")))
    }
}

impl Executable for CudaProgram {
    fn kernels(&self) -> Vec<(NodeId, String)> {
        self.launches
            .iter()
            .map(|(id, name, _)| (*id, name.clone()))
            .collect()
    }

    fn set_param(&mut self, index: usize, bytes: &[u8]) -> Result<()> {
        let source = self
            .plan
            .params
            .get(index)
            .ok_or_else(|| Error::invalid("param", format!("no param #{index}")))?;
        if bytes.len() != source.shape.byte_size() {
            return Err(Error::LengthMismatch {
                kind: "param",
                name: source.name.clone(),
                expected: source.shape.byte_size(),
                got: bytes.len(),
                unit: "bytes",
            });
        }
        // Storage shared with another program gets its own copy first.
        if Arc::strong_count(&self.params[index]) > 1 {
            self.params[index] = Arc::new(DeviceBuffer::new(
                &self.gpu,
                bytes.len(),
                &format!("param '{}'", source.name),
            )?);
        }
        self.params[index].upload(&self.gpu, 0, bytes)
    }

    fn export_param(&self, index: usize) -> Result<SharedParam> {
        let p = self
            .params
            .get(index)
            .ok_or_else(|| Error::invalid("param", format!("no param #{index}")))?;
        Ok(SharedParam::new(self.device(), p.clone()))
    }

    fn import_param(&mut self, index: usize, param: &SharedParam) -> Result<()> {
        let buffer = param
            .storage::<Arc<DeviceBuffer>>()
            .filter(|_| param.device() == self.device())
            .ok_or_else(|| {
                Error::invalid(
                    "share param",
                    format!(
                        "storage from {} cannot be used on {}",
                        param.device(),
                        self.device()
                    ),
                )
            })?;
        let want = self
            .plan
            .params
            .get(index)
            .ok_or_else(|| Error::invalid("param", format!("no param #{index}")))?
            .shape
            .byte_size();
        if buffer.len() != want {
            return Err(Error::invalid(
                "share param",
                format!(
                    "#{index} holds {want} bytes, the shared storage {}",
                    buffer.len()
                ),
            ));
        }
        self.params[index] = buffer.clone();
        Ok(())
    }

    fn input_staging(&mut self, index: usize) -> Result<&mut [u8]> {
        self.staging
            .get_mut(index)
            .map(|v| v.as_mut_slice())
            .ok_or_else(|| Error::invalid("input", format!("no input #{index}")))
    }

    fn submit(&mut self) -> Result<()> {
        for (source, bytes) in self.plan.inputs.iter().zip(&self.staging) {
            let at = self.plan.locations[source.node.index()];
            debug_assert_eq!(at.region, Region::Arena);
            self.arena.upload(&self.gpu, at.offset, bytes)?;
        }
        self.launch_all()
    }

    fn wait(&mut self) -> Result<()> {
        self.gpu.synchronize()?;
        if self.checks.is_empty() {
            return Ok(());
        }
        let mut words = [0u8; 16];
        self.errors.download(&self.gpu, 0, &mut words)?;
        let word = |at: usize| {
            let mut b = [0u8; 8];
            b.copy_from_slice(&words[at..at + 8]);
            i64::from_le_bytes(b)
        };
        let (code, value) = (word(0), word(8));
        if code == 0 {
            return Ok(());
        }
        // Cleared, so the next run starts clean.
        self.errors.upload(&self.gpu, 0, &[0u8; 16])?;
        let message = i32::try_from(code)
            .ok()
            .and_then(|c| self.checks.get(&c))
            .map(|m| m.replace("{value}", &value.to_string()))
            .unwrap_or_else(|| format!("a kernel failed its check (code {code})"));
        Err(Error::runtime("cuda", message))
    }

    fn sync_outputs(&mut self) -> Result<()> {
        let mut outputs = std::mem::take(&mut self.outputs);
        let result = outputs.iter_mut().try_for_each(|(node, host)| {
            let at = self.plan.locations[node.index()];
            match at.region {
                Region::Arena => self.arena.download(&self.gpu, at.offset, host),
                Region::Param(i) => self.params[i].download(&self.gpu, at.offset, host),
                Region::Constant(i) => self.constants[i].download(&self.gpu, at.offset, host),
                Region::Handle(i) => self.handle_buffer(i)?.download(&self.gpu, at.offset, host),
            }
        });
        self.outputs = outputs;
        result
    }

    fn value_bytes(&self, node: NodeId) -> Result<&[u8]> {
        self.outputs
            .get(&node)
            .map(|v| v.as_slice())
            .ok_or_else(|| {
                Error::invalid(
                    "value",
                    format!(
                        "%{} is not an output; on CUDA only outputs are copied to the host",
                        node.index()
                    ),
                )
            })
    }

    fn read_handle(&self, index: usize, dst: &mut [u8]) -> Result<()> {
        self.handle_of_len(index, dst.len())?
            .download(&self.gpu, 0, dst)
    }

    fn write_handle(&mut self, index: usize, bytes: &[u8]) -> Result<()> {
        self.handle_of_len(index, bytes.len())?
            .upload(&self.gpu, 0, bytes)
    }

    fn take_handle(&mut self, index: usize) -> Result<HandleStorage> {
        self.handle_buffer(index)?;
        let buffer = self.handles[index].take().expect("checked above");
        Ok(HandleStorage::new(self.device(), buffer))
    }

    fn put_handle(&mut self, index: usize, storage: HandleStorage) -> Result<()> {
        let want = self
            .plan
            .handles
            .get(index)
            .ok_or_else(|| Error::invalid("handle", format!("no handle #{index}")))?
            .shape
            .byte_size();
        let device = self.device();
        let buffer = storage.into_inner::<DeviceBuffer>().map_err(|s| {
            Error::invalid(
                "put_handle",
                format!("storage from {} is not a buffer of {device}", s.device()),
            )
        })?;
        if buffer.len() != want {
            return Err(Error::invalid(
                "put_handle",
                format!(
                    "handle #{index} holds {want} bytes, the storage {}",
                    buffer.len()
                ),
            ));
        }
        self.handles[index] = Some(buffer);
        Ok(())
    }

    fn arena_ptr(&self) -> Option<*const u8> {
        None
    }

    fn set_profiling(&mut self, _on: bool) {}

    fn profile(&self) -> Option<Profile> {
        None
    }

    fn clone_box(&self) -> Box<dyn Executable> {
        // A copy with its own arena and handles; params and kernels shared.
        let copy = (|| -> Result<CudaProgram> {
            let arena = DeviceBuffer::new(&self.gpu, self.plan.stats.arena_bytes, "the arena")?;
            let handles = self
                .handles
                .iter()
                .enumerate()
                .map(|(i, h)| {
                    let bytes = self.plan.handles[i].shape.byte_size();
                    let copy = DeviceBuffer::new(&self.gpu, bytes, "a handle")?;
                    if let Some(h) = h {
                        let mut host = vec![0u8; bytes];
                        h.download(&self.gpu, 0, &mut host)?;
                        copy.upload(&self.gpu, 0, &host)?;
                    }
                    Ok(Some(copy))
                })
                .collect::<Result<Vec<_>>>()?;
            Ok(CudaProgram {
                ordinal: self.ordinal,
                gpu: self.gpu.clone(),
                plan: self.plan.clone(),
                module: self.module.clone(),
                launches: self.launches.clone(),
                arena,
                params: self.params.clone(),
                constants: self.constants.clone(),
                handles,
                staging: self.staging.clone(),
                outputs: self.outputs.clone(),
                errors: DeviceBuffer::from_bytes(&self.gpu, &[0u8; 16], "the error words")?,
                checks: self.checks.clone(),
            })
        })();
        Box::new(copy.expect("device memory for a clone of a compiled graph"))
    }
}
