//! A plan compiled for one GPU: the arena as one device allocation, params and
//! handles in their own allocations, the generated kernels in one module, and the
//! matrix products as cuBLAS calls. Running queues every step on one stream; inputs
//! are copied up from host staging before, outputs down after.

use crate::codegen::fused::Epilogue;
use crate::codegen::gemv_group::GroupTail;
use crate::codegen::{self, Grid, STEP_NAME};
use crate::gpu::{self, DeviceBuffer, Gpu, HostBuffer, cuda_error};
use crate::matmul::{PRODUCT_ARGS, Product};
use crate::nvrtc::Module;
use crate::param_layout;
use crate::step_timer::StepTimer;
use cudarc::driver::{result as driver, sys};
use rlx_backend::{Executable, HandleStorage, SharedParam};
use rlx_driver::{Device, KernelTime, Profile};
use rlx_ir::{Error, NodeId, Op, Result};
use rlx_opt::{Location, Plan, Region};
use std::collections::{HashMap, HashSet};
use std::ffi::c_void;
use std::sync::Arc;

/// Threads per block of the generated elementwise kernels.
const BLOCK: usize = 256;

/// Most pointer arguments of a generated kernel (its output and operands).
const MAX_ARGS: usize = 64;

/// What a kernel or product argument points at.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Arg {
    /// A value of the plan.
    At(Location),
    /// The program's workspace at this byte offset (partial sums, widened weights).
    Workspace(usize),
    /// The error words.
    Errors,
}

/// Bytes at the start of the workspace for the matrix-vector kernels' per-tile
/// counters; the rest holds data.
pub(crate) const COUNTERS: usize = 64 * 1024;

/// One queued step.
enum Launch {
    /// A generated kernel; `args` are its pointer parameters in order.
    Kernel {
        function: sys::CUfunction,
        grid: Grid,
        args: Vec<Arg>,
    },
    /// A cuBLAS or cuBLASLt product and its pointer arguments.
    Gemm(Product, Vec<Arg>),
}

/// A step as planned for one node, before its kernel is named.
pub(crate) enum Step {
    /// A generated kernel and its arguments.
    Kernel {
        kernel: codegen::Kernel,
        args: Vec<Arg>,
    },
    /// A cuBLAS or cuBLASLt product.
    Gemm(Product),
}

/// A step with its kernel named in the program's source.
enum Pending {
    Kernel {
        function: String,
        grid: Grid,
        args: Vec<Arg>,
    },
    Gemm(Product),
}

/// A CUDA graph of every step of `run`, replayed while the buffers stay put.
struct Captured {
    graph: sys::CUgraph,
    exec: sys::CUgraphExec,
}

// The graph is launched only by the program that owns it, one thread at a time.
unsafe impl Send for Captured {}

impl Drop for Captured {
    fn drop(&mut self) {
        // SAFETY: both were created by `capture` and are destroyed once.
        unsafe {
            let _ = driver::graph::exec_destroy(self.exec);
            let _ = driver::graph::destroy(self.graph);
        }
    }
}

/// How many times a program captured its steps as a CUDA graph in this process
/// (a program captures once, and again only after a param or handle moved).
pub static GRAPH_CAPTURES: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// A compiled plan on one GPU.
pub struct CudaProgram {
    ordinal: usize,
    gpu: Arc<Gpu>,
    plan: Arc<Plan>,
    module: Arc<Module>,
    launches: Arc<Vec<(NodeId, String, Launch)>>,
    arena: DeviceBuffer,
    params: Vec<Arc<DeviceBuffer>>,
    /// Per param, whether it is stored `[N, K]` ([`param_layout`]).
    transposed: Arc<Vec<bool>>,
    constants: Arc<Vec<DeviceBuffer>>,
    handles: Vec<Option<DeviceBuffer>>,
    staging: Vec<Vec<u8>>,
    /// Where outputs are copied to (page-locked: the copies run queued, at full
    /// link speed).
    outputs: HashMap<NodeId, HostBuffer>,
    /// Whether the last submit queued the outputs' copies, and whether a wait has
    /// seen them land since.
    outputs_queued: bool,
    waited: bool,
    /// The words a kernel's failed run-time check sets (its node index + 1, and the
    /// value that failed), and what each code means; copied to `error_words` after
    /// every run that has checked kernels, queued behind it.
    errors: DeviceBuffer,
    error_words: HostBuffer,
    checks: Arc<HashMap<i32, String>>,
    /// Scratch memory of the fused products, `COUNTERS` zeroed bytes first.
    workspace: DeviceBuffer,
    /// The steps as a CUDA graph, captured on the first run (`None` before it, or
    /// after a buffer moved).
    captured: Option<Captured>,
    /// Whether to capture at all (`RLX_CUDA_GRAPHS=0` launches step by step).
    use_graphs: bool,
    /// Per-step timings while profiling is on (runs then launch step by step).
    timer: Option<StepTimer>,
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
        let mut checks = HashMap::new();
        // Steps with the same kernel text (the same op over the same shapes, as in
        // every layer of a model) share one compiled function: a 30-layer model
        // compiles about one layer's kernels.
        let mut written: HashMap<String, String> = HashMap::new();
        let mut workspace_data = 0usize;
        let products = crate::fused_matmul::ProductOptions {
            allow_tf32,
            target_blocks: gpu.multiprocessors * 3,
            row_blocks: gpu.multiprocessors * 16,
            lt: gpu.lt.as_ref().map(|h| (h, gpu.blas_workspace().1)),
        };
        let transposed = param_layout::transposed_params(&plan);
        let param_index = param_layout::param_indices(&plan);
        // Whether a product's `b` (input 1) is a param stored `[N, K]`.
        let b_transposed = |inputs: &[NodeId]| {
            inputs
                .get(1)
                .and_then(|b| param_index.get(b))
                .is_some_and(|&i| transposed[i])
        };
        let (groups, rope_groups) = if crate::product_groups::enabled() {
            (
                crate::product_groups::of_plan(&plan),
                crate::rope_writes::find(&plan),
            )
        } else {
            Default::default()
        };
        // A rotation/write group scheduled right after a product group is done by the
        // products' kernel (by the rope group's last node: its code and message).
        let tails: HashMap<NodeId, (NodeId, GroupTail, Vec<Arg>)> = groups
            .at
            .iter()
            .filter_map(|(&id, group)| {
                let next = plan.schedule.iter().position(|&s| s == id)? + 1;
                let (&at, rope) = rope_groups.at.iter().find(|(_, r)| {
                    r.ropes
                        .iter()
                        .chain(&r.writes)
                        .any(|&m| Some(&m) == plan.schedule.get(next))
                })?;
                let code = i32::try_from(at.index() + 1).unwrap_or(i32::MAX);
                let (tail, args) = crate::rope_writes::as_tail(&plan, rope, group, code)?;
                Some((id, (at, tail, args)))
            })
            .collect();
        let folded: HashSet<NodeId> = tails.values().map(|(at, ..)| *at).collect();
        // (node, kernel table name, the function's name or the product) in order.
        let mut pending: Vec<(NodeId, String, Pending)> = Vec::with_capacity(plan.schedule.len());
        for &id in &plan.schedule {
            if groups.absorbed.contains(&id)
                || rope_groups.absorbed.contains(&id)
                || folded.contains(&id)
            {
                continue;
            }
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
            let unsupported = |e: String| Error::Unsupported {
                device: "cuda".into(),
                what: format!("{}: {e}", what()),
            };
            let table = |kind: &str| {
                format!("cuda.{kind}.{}.{:?}", node.op.name(), node.shape.dtype()).to_lowercase()
            };
            if inputs.len() + 4 > MAX_ARGS {
                return Err(unsupported(format!("more than {} operands", MAX_ARGS - 4)));
            }
            let code = i32::try_from(id.index() + 1).unwrap_or(i32::MAX);
            let steps: Vec<(String, Step)> = match &node.op {
                _ if groups.at.contains_key(&id) => {
                    let group = &groups.at[&id];
                    let tail = tails.get(&id).map(|(at, tail, args)| {
                        if let Some(message) = crate::codegen::rope_write::check_message(&tail.spec)
                        {
                            let last = &nodes[at.index()];
                            checks.insert(
                                tail.code,
                                format!("%{} ({}): {message}", at.index(), last.op.name()),
                            );
                        }
                        (tail.clone(), args.clone())
                    });
                    crate::fused_matmul::plan_group(&plan, group, products.row_blocks, tail)
                        .map_err(unsupported)?
                        .into_iter()
                        .map(|(kind, step)| (table(kind), step))
                        .collect()
                }
                _ if rope_groups.at.contains_key(&id) => {
                    let (kernel, args) =
                        crate::rope_writes::plan_group(&plan, &rope_groups.at[&id], code)?;
                    if let Some(message) = &kernel.check {
                        checks.insert(code, format!("{}: {message}", what()));
                    }
                    vec![(table("rope_write"), Step::Kernel { kernel, args })]
                }
                Op::MatMul | Op::FusedMatMul { .. } => {
                    let epilogue = Epilogue::of(&node.op).ok_or_else(|| {
                        unsupported("a product reading a transposed operand".into())
                    })?;
                    let (steps, data) = crate::fused_matmul::plan(
                        &epilogue,
                        &in_shapes,
                        &node.shape,
                        &inputs,
                        out,
                        products,
                        b_transposed(&node.inputs),
                    )
                    .map_err(unsupported)?;
                    workspace_data = workspace_data.max(data);
                    steps
                        .into_iter()
                        .map(|(kind, step)| (table(kind), step))
                        .collect()
                }
                op => {
                    if let Op::WriteAt { .. } = op {
                        // The kernel writes only the update's rows: the result must
                        // be the target itself, as the planner places it.
                        if out != inputs[0] {
                            return Err(location_error(&plan, what()));
                        }
                    }
                    let Some(kernel) = codegen::kernel_for(
                        STEP_NAME,
                        op,
                        &in_shapes,
                        &node.shape,
                        code,
                        gpu.tensor_cores,
                    )?
                    else {
                        return Err(unsupported("no CUDA kernel for this op yet".into()));
                    };
                    let mut args = vec![Arg::At(out)];
                    args.extend(inputs.iter().map(|&i| Arg::At(i)));
                    if let Some(message) = &kernel.check {
                        checks.insert(code, format!("{}: {message}", what()));
                        args.push(Arg::Errors);
                    }
                    vec![(table("nvrtc"), Step::Kernel { kernel, args })]
                }
            };
            for (name, step) in steps {
                let step = match step {
                    Step::Gemm(g) => Pending::Gemm(g),
                    Step::Kernel { kernel, args } => {
                        if let Grid::Blocks { count, .. } = kernel.grid
                            && count > i32::MAX as usize
                        {
                            return Err(unsupported(format!(
                                "{count} blocks, past CUDA's grid limit"
                            )));
                        }
                        let fresh = format!("k{}", written.len());
                        let function = written
                            .entry(kernel.source.clone())
                            .or_insert_with(|| {
                                source.push_str(&codegen::entering_after_predecessor(
                                    &kernel.source.replace(STEP_NAME, &fresh),
                                ));
                                fresh
                            })
                            .clone();
                        Pending::Kernel {
                            function,
                            grid: kernel.grid,
                            args,
                        }
                    }
                };
                pending.push((id, name, step));
            }
        }
        let module = Module::compile(&gpu, &source)?;
        let mut launches = Vec::with_capacity(pending.len());
        for (id, name, step) in pending {
            let launch = match step {
                Pending::Kernel {
                    function,
                    grid,
                    args,
                } => Launch::Kernel {
                    function: module.function(&function)?,
                    grid,
                    args,
                },
                Pending::Gemm(g) => {
                    let args = g.args();
                    Launch::Gemm(g, args)
                }
            };
            launches.push((id, name, launch));
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
        let workspace = new_workspace(&gpu, COUNTERS + workspace_data)?;
        let staging = plan
            .inputs
            .iter()
            .map(|i| vec![0u8; i.shape.byte_size()])
            .collect();
        let outputs = output_buffers(&gpu, &plan);
        let error_words = HostBuffer::new(&gpu, 16);
        Ok(CudaProgram {
            ordinal,
            gpu,
            plan,
            module: Arc::new(module),
            launches: Arc::new(launches),
            arena,
            params,
            transposed: Arc::new(transposed),
            constants: Arc::new(constants),
            handles,
            staging,
            outputs,
            outputs_queued: false,
            waited: false,
            errors,
            error_words,
            checks: Arc::new(checks),
            workspace,
            captured: None,
            use_graphs: rlx_ir::env::Switch::CudaGraphs.enabled(),
            timer: None,
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

    /// The device address an argument points at.
    fn arg_address(&self, arg: Arg) -> Result<sys::CUdeviceptr> {
        match arg {
            Arg::At(at) => self.address(at),
            Arg::Workspace(offset) => Ok(self.workspace.ptr() + offset as u64),
            Arg::Errors => Ok(self.errors.ptr()),
        }
    }

    /// Queues every step: the captured graph when there is one, else each launch
    /// (captured into a graph first, when graphs are on).
    fn queue_run(&mut self) -> Result<()> {
        self.gpu.bind()?;
        let gpu = self.gpu.clone();
        let _stream = gpu.lock_stream();
        let stream = self.gpu.cu_stream();
        if let Some(mut timer) = self.timer.take() {
            let queued = self.launch_all(Some(&mut timer));
            self.timer = Some(timer);
            return queued;
        }
        if self.captured.is_none() && self.use_graphs {
            self.captured = Some(self.capture()?);
        }
        match &self.captured {
            // SAFETY: the graph was instantiated on this context from this stream's
            // steps; every buffer it points at is still the one captured (a moved
            // buffer drops the graph).
            Some(c) => unsafe { driver::graph::launch(c.exec, stream) }
                .map_err(|e| cuda_error("launching the captured graph", e)),
            None => self.launch_all(None),
        }
    }

    /// Records every step into a CUDA graph (nothing runs while recording).
    fn capture(&self) -> Result<Captured> {
        let stream = self.gpu.cu_stream();
        // SAFETY: the stream is this program's; capture ends below on every path.
        unsafe {
            driver::stream::begin_capture(
                stream,
                sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
            )
        }
        .map_err(|e| cuda_error("starting a graph capture", e))?;
        let queued = self.launch_all(None);
        // SAFETY: capture was begun on this stream above.
        let ended = unsafe { driver::stream::end_capture(stream) };
        queued?;
        let graph = ended.map_err(|e| cuda_error("ending a graph capture", e))?;
        // SAFETY: the graph was just captured and is destroyed with the exec.
        match unsafe { driver::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)) } {
            Ok(exec) => {
                GRAPH_CAPTURES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
                Ok(Captured { graph, exec })
            }
            Err(e) => {
                // SAFETY: created above, not used again.
                unsafe {
                    let _ = driver::graph::destroy(graph);
                }
                Err(cuda_error("instantiating the captured graph", e))
            }
        }
    }

    /// Queues each step on the stream, with an event after each when `timer` is
    /// given.
    fn launch_all(&self, mut timer: Option<&mut StepTimer>) -> Result<()> {
        let stream = self.gpu.cu_stream();
        if let Some(t) = timer.as_deref_mut() {
            t.mark(0, stream)?;
        }
        for (step, (id, _, launch)) in self.launches.iter().enumerate() {
            if let Some(t) = timer.as_deref_mut()
                && step > 0
            {
                t.mark(step, stream)?;
            }
            match launch {
                Launch::Kernel {
                    function,
                    grid,
                    args,
                } => {
                    if grid.is_empty() {
                        continue;
                    }
                    // Kernel arguments on the stack: no allocation per launch.
                    let mut values = [0u64; MAX_ARGS];
                    for (slot, &a) in values.iter_mut().zip(args) {
                        *slot = self.arg_address(a)?;
                    }
                    let mut pointers = [std::ptr::null_mut::<c_void>(); MAX_ARGS];
                    for (p, a) in pointers.iter_mut().zip(values.iter_mut()) {
                        *p = (a as *mut u64).cast();
                    }
                    let params = &mut pointers[..args.len()];
                    let (blocks, threads) = match *grid {
                        Grid::Elements(n) => (n.div_ceil(BLOCK).min(1 << 20), BLOCK as u32),
                        Grid::Warps(n) => (n.div_ceil(BLOCK / 32).min(1 << 20), BLOCK as u32),
                        Grid::Blocks { count, threads } => (count, threads),
                    };
                    // SAFETY: the kernel's parameters are device pointers, one per
                    // argument, as the generator wrote them; every range was checked
                    // against its region when the program was built.
                    unsafe {
                        gpu::launch(
                            *function,
                            (blocks as u32, threads),
                            stream,
                            params,
                            self.gpu.programmatic_launch,
                        )
                    }
                    .map_err(|e| cuda_error(&format!("launching %{}", id.index()), e))?;
                }
                Launch::Gemm(g, args) => {
                    let mut ptrs = [0; PRODUCT_ARGS];
                    for (ptr, &arg) in ptrs.iter_mut().zip(args) {
                        *ptr = self.arg_address(arg)?;
                    }
                    g.run(&self.gpu, &ptrs[..args.len()]).map_err(|e| {
                        cuda_error(&format!("the matrix product %{}", id.index()), e)
                    })?;
                }
            }
        }
        if let Some(t) = timer {
            t.mark(self.launches.len(), stream)?;
        }
        Ok(())
    }

    /// Queues the copy of every output to its host buffer.
    fn queue_outputs(&mut self) -> Result<()> {
        let mut outputs = std::mem::take(&mut self.outputs);
        let result = outputs.iter_mut().try_for_each(|(node, host)| {
            let at = self.plan.locations[node.index()];
            let source = match at.region {
                Region::Arena => &self.arena,
                Region::Param(i) => &*self.params[i],
                Region::Constant(i) => &self.constants[i],
                Region::Handle(i) => self.handle_buffer(i)?,
            };
            source.download_queued(&self.gpu, at.offset, host)
        });
        self.outputs = outputs;
        result
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
            self.captured = None;
            self.params[index] = Arc::new(DeviceBuffer::new(
                &self.gpu,
                bytes.len(),
                &format!("param '{}'", source.name),
            )?);
        }
        if self.transposed[index] {
            let dims = source.shape.dims();
            let elem = source.shape.dtype().size_in_bytes();
            let stored = param_layout::transpose(bytes, dims[0], dims[1], elem);
            return self.params[index].upload(&self.gpu, 0, &stored);
        }
        self.params[index].upload(&self.gpu, 0, bytes)
    }

    fn export_param(&self, index: usize) -> Result<SharedParam> {
        let p = self
            .params
            .get(index)
            .ok_or_else(|| Error::invalid("param", format!("no param #{index}")))?;
        Ok(SharedParam::new(
            self.device(),
            StoredParam {
                buffer: p.clone(),
                transposed: self.transposed[index],
            },
        ))
    }

    fn import_param(&mut self, index: usize, param: &SharedParam) -> Result<()> {
        let stored = param
            .storage::<StoredParam>()
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
        if stored.transposed != self.transposed[index] {
            return Err(Error::invalid(
                "share param",
                format!(
                    "#{index} is stored {} here and {} in the shared storage (a weight \
                     that only feeds products in one program and is read otherwise in the \
                     other)",
                    layout_name(self.transposed[index]),
                    layout_name(stored.transposed)
                ),
            ));
        }
        let buffer = &stored.buffer;
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
        self.captured = None;
        Ok(())
    }

    fn input_staging(&mut self, index: usize) -> Result<&mut [u8]> {
        self.staging
            .get_mut(index)
            .map(|v| v.as_mut_slice())
            .ok_or_else(|| Error::invalid("input", format!("no input #{index}")))
    }

    fn submit(&mut self) -> Result<()> {
        self.outputs_queued = false;
        self.waited = false;
        // Inputs, kernels and the error words' copy are queued in stream order with
        // no wait between them: one synchronization a run, in `wait`.
        for (source, bytes) in self.plan.inputs.iter().zip(&self.staging) {
            let at = self.plan.locations[source.node.index()];
            debug_assert_eq!(at.region, Region::Arena);
            self.arena.upload_queued(&self.gpu, at.offset, bytes)?;
        }
        self.queue_run()?;
        if !self.checks.is_empty() {
            self.errors
                .download_queued(&self.gpu, 0, &mut self.error_words)?;
        }
        Ok(())
    }

    fn submit_with_outputs(&mut self) -> Result<()> {
        self.submit()?;
        self.queue_outputs()?;
        self.outputs_queued = true;
        Ok(())
    }

    fn wait(&mut self) -> Result<()> {
        self.gpu.synchronize()?;
        self.waited = true;
        if let Some(timer) = &mut self.timer {
            timer.collect()?;
        }
        if self.checks.is_empty() {
            return Ok(());
        }
        let words = self.error_words.as_slice();
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
        self.error_words.as_mut_slice().fill(0);
        let message = i32::try_from(code)
            .ok()
            .and_then(|c| self.checks.get(&c))
            .map(|m| m.replace("{value}", &value.to_string()))
            .unwrap_or_else(|| format!("a kernel failed its check (code {code})"));
        Err(Error::runtime("cuda", message))
    }

    fn sync_outputs(&mut self) -> Result<()> {
        if self.outputs_queued {
            // Copied behind the run: landed when the wait returned.
            return if self.waited {
                Ok(())
            } else {
                self.gpu.synchronize()
            };
        }
        // Every copy queued, then one wait.
        let queued = self.queue_outputs();
        let waited = self.gpu.synchronize();
        queued.and(waited)
    }

    fn value_bytes(&self, node: NodeId) -> Result<&[u8]> {
        self.outputs
            .get(&node)
            .map(HostBuffer::as_slice)
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
        let buffer = self.handles[index].take().ok_or_else(|| {
            Error::invalid("handle", format!("#{index} was taken and not put back"))
        })?;
        self.captured = None;
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
        self.captured = None;
        Ok(())
    }

    fn arena_ptr(&self) -> Option<*const u8> {
        None
    }

    fn set_profiling(&mut self, on: bool) {
        // A timer that cannot be made (no events left) leaves profiling off; the
        // profile then reads as absent, as on a backend without one.
        self.timer = if on && self.gpu.bind().is_ok() {
            StepTimer::new(self.launches.len()).ok()
        } else {
            None
        };
    }

    fn profile(&self) -> Option<Profile> {
        let timer = self.timer.as_ref()?;
        let kernels = self
            .launches
            .iter()
            .zip(timer.totals())
            .map(|((node, name, _), &total)| KernelTime {
                node: *node,
                kernel: name.clone(),
                total,
            })
            .collect();
        Some(Profile {
            runs: timer.runs,
            kernels,
        })
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
                transposed: self.transposed.clone(),
                constants: self.constants.clone(),
                handles,
                staging: self.staging.clone(),
                outputs: output_buffers(&self.gpu, &self.plan),
                outputs_queued: false,
                waited: false,
                errors: DeviceBuffer::from_bytes(&self.gpu, &[0u8; 16], "the error words")?,
                error_words: HostBuffer::new(&self.gpu, 16),
                checks: self.checks.clone(),
                workspace: new_workspace(&self.gpu, self.workspace.len())?,
                captured: None,
                use_graphs: self.use_graphs,
                timer: None,
            })
        })();
        Box::new(copy.expect("device memory for a clone of a compiled graph"))
    }
}

/// Host buffers for the plan's outputs.
fn output_buffers(gpu: &Arc<Gpu>, plan: &Plan) -> HashMap<NodeId, HostBuffer> {
    plan.outputs
        .iter()
        .map(|&o| (o, HostBuffer::new(gpu, plan.shape(o).byte_size())))
        .collect()
}

/// A param's device storage as shared between programs, with its layout.
struct StoredParam {
    buffer: Arc<DeviceBuffer>,
    /// Stored `[N, K]` ([`param_layout`]).
    transposed: bool,
}

fn layout_name(transposed: bool) -> &'static str {
    if transposed {
        "transposed ([N, K])"
    } else {
        "as the graph has it"
    }
}

/// A workspace of `bytes`, its counters zeroed.
fn new_workspace(gpu: &Gpu, bytes: usize) -> Result<DeviceBuffer> {
    let workspace = DeviceBuffer::new(gpu, bytes, "the workspace")?;
    workspace.upload(gpu, 0, &vec![0u8; COUNTERS.min(bytes)])?;
    Ok(workspace)
}
