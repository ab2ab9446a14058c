//! The CPU backend: turns a [`Plan`] into a [`CpuProgram`] that owns the arena, the
//! weights, the constants and the persistent handles, and runs the plan's steps with
//! the reference kernels. Running allocates nothing.

mod backend;
mod blas;
mod elem;
mod gemm;
pub mod isa;
mod kernels;
mod layout;
pub mod pool;
mod prefetch;
mod prepack;
mod quant;
mod tensor;
mod vmath;

pub use backend::CpuBackend;
pub use blas::{
    PackedMatrix, gemm_kernel_name, has_amx, matmul_bf16_products, matmul_f32, matmul_f32_packed,
    peak_fma_gflops,
};
use gemm::GemmScratch;
use kernels::ReduceGeometry;
use pool::ThreadPool;
pub use prepack::PackedParam;
use rlx_driver::{Buffer, DeviceArena, HostArena, KernelTime, Profile};
use rlx_ir::{Error, NodeId, Op, Result, Shape};
use rlx_opt::{Location, Plan, Region};
use std::sync::Arc;
use tensor::{Dst, Src};

/// One kernel invocation, prepared at compile time.
#[derive(Clone, Debug)]
struct Step {
    node: NodeId,
    op: Op,
    inputs: Vec<(Location, Shape)>,
    output: (Location, Shape),
    geometry: Option<ReduceGeometry>,
    kernel: kernels::Kernel,
    /// The param this step reads packed ahead as its right operand.
    packed_b: Option<usize>,
    /// Which operands and whether the output are channel-blocked.
    layout: layout::StepLayout,
}

/// A param's storage as programs share it: the value and, where it is packed ahead
/// for matrix products, the packed panels (shared too, so programs compiled from one
/// model hold one packed copy).
#[derive(Clone, Debug)]
pub struct SharedCpuParam {
    /// The param's value.
    pub buffer: Arc<Buffer>,
    /// Its packed form, if the exporting program keeps one.
    pub packed: Option<PackedParam>,
}

/// A compiled plan on the CPU: memory plus prepared steps.
#[derive(Clone)]
pub struct CpuProgram {
    plan: Arc<Plan>,
    arena: HostArena,
    params: Vec<Arc<Buffer>>,
    /// The form each param is packed ahead into (as products' `B`, or convolution
    /// weights by tap), if any step reads it packed.
    packable: Vec<Option<prepack::PackSpec>>,
    /// Their packed forms, made when their values are set (until then products read
    /// the params unpacked).
    packed: Vec<Option<PackedParam>>,
    constants: Vec<Buffer>,
    handles: Vec<Buffer>,
    steps: Vec<Step>,
    scratch: Vec<f64>,
    gemm: GemmScratch,
    /// Addresses of the handle buffers, refreshed (not reallocated) by every run.
    handle_addrs: Vec<usize>,
    /// Nanoseconds spent in each step over all runs, when profiling.
    step_nanos: Option<Vec<u64>>,
    profiled_runs: u64,
    /// Whether `f32` products may round their operands to bfloat16 (on AMX).
    bf16_products: bool,
}

impl CpuProgram {
    /// Prepares `plan` for execution on up to `threads` threads (0: every thread of
    /// the global pool): allocates the arena once, zeroed params and handles, copies
    /// the constants.
    ///
    /// # Errors
    /// [`Error::InvalidGraph`] when an operand of a step would lie outside its region
    /// (checked for every step, so kernels never address past a buffer), and
    /// [`Error::OutOfMemory`] naming the param, handle, constant, arena or scratch
    /// whose allocation failed (never an abort).
    pub fn new(plan: Arc<Plan>, threads: usize) -> Result<CpuProgram> {
        Self::with_bf16_products(plan, threads, false)
    }

    /// [`CpuProgram::new`], with the `f32` matrix products allowed to round their
    /// operands to bfloat16 and sum in `f32` on AMX tiles where the CPU has them
    /// (weights are then packed into tiles per product instead of ahead).
    ///
    /// # Errors
    /// As [`CpuProgram::new`].
    pub fn with_bf16_products(
        plan: Arc<Plan>,
        threads: usize,
        bf16_products: bool,
    ) -> Result<CpuProgram> {
        let products_on_amx = bf16_products && gemm::amx_available();
        let graph = &plan.graph;
        let nodes = graph.nodes();
        let mut steps = Vec::with_capacity(plan.schedule.len());
        let mut scratch_len = 0;
        let mut thread_scratch = 0;
        let param_shapes: Vec<Shape> = plan.params.iter().map(|p| p.shape.clone()).collect();
        let mut packable = vec![None; param_shapes.len()];
        // Every value (so every operand and output of every step, inputs and views
        // included) must lie inside its region: kernels address through raw pointers.
        for (i, node) in nodes.iter().enumerate() {
            let location = *plan.locations.get(i).ok_or_else(|| Error::InvalidGraph {
                graph: graph.name().into(),
                node: format!("%{i}"),
                message: "the plan has no location for this node".into(),
            })?;
            plan.check_range(&format!("%{i} ({})", node.op.name()), location, &node.shape)?;
        }
        let layouts = layout::assign(&plan, kernels::accepts);
        for (&id, &layout) in plan.schedule.iter().zip(&layouts) {
            let node = &nodes[id.index()];
            let in_shapes: Vec<Shape> = node
                .inputs
                .iter()
                .map(|x| nodes[x.index()].shape.clone())
                .collect();
            let mut kernel_in = in_shapes.clone();
            let mut kernel_out = node.shape.clone();
            kernels::kernel_shapes(&node.op, layout, &mut kernel_in, &mut kernel_out);
            let inputs: Vec<(Location, Shape)> = node
                .inputs
                .iter()
                .zip(kernel_in)
                .map(|(x, s)| (plan.locations[x.index()], s))
                .collect();
            let packed_b =
                prepack::packed_operand(&node.op, &inputs, &param_shapes, products_on_amx, layout)
                    .map(|(index, spec)| {
                        // A param two kinds of step read is packed for the first; the
                        // other finds the form does not fit and reads the param.
                        packable[index].get_or_insert(spec);
                        index
                    });
            let geometry = match &node.op {
                Op::Reduce { axes, .. } => Some(ReduceGeometry::new(in_shapes[0].dims(), axes)),
                _ => None,
            };
            scratch_len = scratch_len.max(kernels::scratch_len(&node.op, &in_shapes, layout));
            thread_scratch =
                thread_scratch.max(kernels::thread_scratch_floats(&node.op, &in_shapes, layout));
            steps.push(Step {
                node: id,
                op: node.op.clone(),
                kernel: kernels::select(&node.op, &in_shapes, &node.shape, products_on_amx, layout),
                inputs,
                output: (plan.locations[id.index()], kernel_out),
                geometry,
                packed_b,
                layout,
            });
        }
        let constants = graph
            .constants()
            .iter()
            .enumerate()
            .map(|(i, data)| {
                let shape = Shape::new(&[data.len()], data.dtype());
                let mut buffer = Buffer::try_zeroed(shape, &format!("constant #{i}"))?;
                buffer.write(&data.as_ref().to_le_bytes())?;
                Ok(buffer)
            })
            .collect::<Result<Vec<_>>>()?;
        // Every allocation below fails as an error naming what it was for.
        let params = plan
            .params
            .iter()
            .map(|p| {
                Buffer::try_zeroed(p.shape.clone(), &format!("param '{}'", p.name)).map(Arc::new)
            })
            .collect::<Result<Vec<_>>>()?;
        let handles = plan
            .handles
            .iter()
            .map(|h| Buffer::try_zeroed(h.shape.clone(), &format!("handle '{}'", h.name)))
            .collect::<Result<Vec<_>>>()?;
        let arena = HostArena::try_new(plan.stats.arena_bytes)?;
        let mut scratch = Vec::new();
        scratch
            .try_reserve_exact(scratch_len)
            .map_err(|_| Error::OutOfMemory {
                tensor: "kernel scratch".into(),
                bytes: scratch_len.saturating_mul(8),
            })?;
        scratch.resize(scratch_len, 0.0);
        let gemm = GemmScratch::try_new(
            if threads == 0 {
                ThreadPool::global().threads()
            } else {
                threads.min(ThreadPool::global().threads())
            },
            thread_scratch,
            products_on_amx,
        )?;
        let plan_handles = plan.handles.len();
        drop(nodes);
        Ok(CpuProgram {
            arena,
            plan,
            params,
            packed: vec![None; packable.len()],
            packable,
            constants,
            handles,
            steps,
            scratch,
            gemm,
            handle_addrs: vec![0; plan_handles],
            step_nanos: None,
            bf16_products,
            profiled_runs: 0,
        })
    }

    /// Runs later steps on the first `rows` rows of the graph inputs `inputs` (their
    /// dimension 0) instead of the planned rows, with every value's shape from
    /// [`rlx_opt::extent::active_shapes`] (which refuses graphs that mix rows); `rows`
    /// equal to the planned count restores the planned shapes. Kernels read their
    /// shapes from the steps, so memory, packed weights and scratch stay.
    ///
    /// # Errors
    /// Those of `active_shapes`, and [`Error::InvalidArgument`] when a value or a
    /// step's scratch would not fit; nothing changes then.
    pub fn set_active_rows(&mut self, inputs: &[NodeId], rows: usize) -> Result<()> {
        let shapes = rlx_opt::extent::active_shapes(&self.plan, inputs, rows)?;
        self.set_shapes(&shapes)
    }

    /// Swaps every step's shapes for `shapes` (one per node), after checking each
    /// value against its place and each step's scratch. The shapes must come from
    /// `active_shapes`: kernels trust that a step's operand and output shapes agree.
    fn set_shapes(&mut self, shapes: &[Shape]) -> Result<()> {
        let plan = self.plan.clone();
        let nodes = plan.graph.nodes();
        if shapes.len() != nodes.len() {
            return Err(Error::invalid(
                "set_shapes",
                format!("{} shapes for {} nodes", shapes.len(), nodes.len()),
            ));
        }
        for (i, shape) in shapes.iter().enumerate() {
            plan.check_range(&format!("%{i}"), plan.locations[i], shape)?;
        }
        let products_on_amx = self.bf16_products && gemm::amx_available();
        let mut steps = self.steps.clone();
        for step in &mut steps {
            let node = &nodes[step.node.index()];
            let in_shapes: Vec<Shape> = node
                .inputs
                .iter()
                .map(|x| shapes[x.index()].clone())
                .collect();
            if kernels::scratch_len(&node.op, &in_shapes, step.layout) > self.scratch.len()
                || kernels::thread_scratch_floats(&node.op, &in_shapes, step.layout)
                    > self.gemm.extra()
            {
                return Err(Error::invalid(
                    "set_shapes",
                    format!("%{} needs more scratch than was planned", step.node),
                ));
            }
            // The layouts were chosen for the planned shapes: new ones that a blocked
            // step's kernel no longer takes (dims past the rows changed) are refused.
            if !kernels::accepts(
                &node.op,
                &in_shapes,
                &shapes[step.node.index()],
                step.layout,
            ) {
                return Err(Error::invalid(
                    "set_shapes",
                    format!(
                        "%{} keeps channel-blocked values its new shapes do not fit",
                        step.node
                    ),
                ));
            }
            for ((_, shape), new) in step.inputs.iter_mut().zip(in_shapes.iter()) {
                *shape = new.clone();
            }
            step.output.1 = shapes[step.node.index()].clone();
            let mut kernel_in: Vec<Shape> = step.inputs.iter().map(|(_, s)| s.clone()).collect();
            kernels::kernel_shapes(&node.op, step.layout, &mut kernel_in, &mut step.output.1);
            for ((_, shape), new) in step.inputs.iter_mut().zip(kernel_in) {
                *shape = new;
            }
            // Some kernel families are chosen by shape.
            step.kernel = kernels::select(
                &node.op,
                &in_shapes,
                &step.output.1,
                products_on_amx,
                step.layout,
            );
            if let Op::Reduce { axes, .. } = &node.op {
                step.geometry = Some(ReduceGeometry::new(in_shapes[0].dims(), axes));
            }
        }
        drop(nodes);
        self.steps = steps;
        Ok(())
    }

    /// The plan this program runs.
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// `(node, kernel name)` for every step, in execution order.
    pub fn kernels(&self) -> Vec<(NodeId, String)> {
        self.steps
            .iter()
            .map(|s| (s.node, s.kernel.name.clone()))
            .collect()
    }

    /// Replaces param `index`'s bytes (exactly its size). Memory it needs (a private
    /// copy of a shared param, the packed panels) is allocated before anything
    /// changes: [`Error::OutOfMemory`] leaves the param as it was.
    pub fn set_param(&mut self, index: usize, bytes: &[u8]) -> Result<()> {
        let what = self.param_label(index);
        let buf = self
            .params
            .get(index)
            .ok_or_else(|| Error::invalid("set_param", format!("no param #{index}")))?;
        if bytes.len() != buf.bytes().len() {
            return Err(Error::LengthMismatch {
                kind: "param",
                name: format!("#{index}"),
                expected: buf.bytes().len(),
                got: bytes.len(),
                unit: "bytes",
            });
        }
        let packing = match self.packable.get(index) {
            Some(&Some(spec)) => Some((spec, PackedParam::panels(spec, &what)?)),
            _ => None,
        };
        let shared = Arc::strong_count(buf) > 1 || Arc::weak_count(buf) > 0;
        let fresh = if shared {
            Some(Buffer::try_zeroed(buf.shape().clone(), &what)?)
        } else {
            None
        };
        let slot = &mut self.params[index];
        if let Some(fresh) = fresh {
            *slot = Arc::new(fresh);
        }
        // Unique now, so this never copies.
        Arc::make_mut(slot).write(bytes)?;
        if let Some((spec, panels)) = packing {
            self.packed[index] = Some(PackedParam::pack_into(spec, slot, panels));
        }
        Ok(())
    }

    /// `param 'name'`, for errors.
    fn param_label(&self, index: usize) -> String {
        self.plan.params.get(index).map_or_else(
            || format!("param #{index}"),
            |p| format!("param '{}'", p.name),
        )
    }

    /// Bytes of the params packed ahead for matrix products (on top of the params).
    pub fn packed_param_bytes(&self) -> usize {
        self.packed.iter().flatten().map(PackedParam::bytes).sum()
    }

    /// Param `index`'s storage, to share with another program (no copy).
    pub fn shared_param(&self, index: usize) -> Result<SharedCpuParam> {
        let buffer = self
            .params
            .get(index)
            .cloned()
            .ok_or_else(|| Error::invalid("param", format!("no param #{index}")))?;
        Ok(SharedCpuParam {
            buffer,
            packed: self.packed[index].clone(),
        })
    }

    /// Makes param `index` use `shared`'s storage (copied only if later written),
    /// and its packed panels where they fit this program's products (packing anew
    /// otherwise). The shape and dtype must be the param's.
    pub fn set_shared_param(&mut self, index: usize, shared: &SharedCpuParam) -> Result<()> {
        let slot = self
            .params
            .get_mut(index)
            .ok_or_else(|| Error::invalid("set_param", format!("no param #{index}")))?;
        let buffer = &shared.buffer;
        if buffer.shape() != slot.shape() {
            return Err(Error::ShapeMismatch {
                op: format!("share param #{index}"),
                lhs: slot.shape().clone(),
                rhs: buffer.shape().clone(),
                reason: "a shared param must have the same shape and dtype".into(),
            });
        }
        let packed = match self.packable.get(index) {
            Some(&Some(spec)) => Some(match &shared.packed {
                Some(theirs) if theirs.fits(spec) => theirs.clone(),
                _ => PackedParam::pack(spec, buffer, &format!("param #{index}"))?,
            }),
            _ => None,
        };
        *slot = buffer.clone();
        if packed.is_some() {
            self.packed[index] = packed;
        }
        Ok(())
    }

    /// The arena bytes of run-time input `index`, to be filled before [`execute`].
    ///
    /// [`execute`]: CpuProgram::execute
    pub fn input_bytes_mut(&mut self, index: usize) -> Result<&mut [u8]> {
        let src = self
            .plan
            .inputs
            .get(index)
            .ok_or_else(|| Error::invalid("input", format!("no input #{index}")))?;
        let loc = self.plan.locations[src.node.index()];
        let len = src.shape.byte_size();
        Ok(&mut self.arena.bytes_mut()[loc.offset..loc.offset + len])
    }

    /// The bytes of any node's value (after a run, for outputs). A value between
    /// steps may be stored channel-blocked (`layout`); outputs never are.
    pub fn value_bytes(&self, node: NodeId) -> Result<&[u8]> {
        let loc = *self
            .plan
            .locations
            .get(node.index())
            .ok_or_else(|| Error::invalid("value", format!("no node {node}")))?;
        let len = self.plan.shape(node).byte_size();
        let region: &[u8] = match loc.region {
            Region::Arena => self.arena.host_bytes().unwrap_or(&[]),
            Region::Param(i) => self.params[i].bytes(),
            Region::Constant(i) => self.constants[i].bytes(),
            Region::Handle(i) => self.handles[i].bytes(),
        };
        region
            .get(loc.offset..loc.offset + len)
            .ok_or_else(|| Error::invalid("value", format!("{node} lies outside its region")))
    }

    /// The bytes of persistent handle `index`.
    pub fn handle_bytes(&self, index: usize) -> Result<&[u8]> {
        self.handles
            .get(index)
            .map(|h| h.bytes())
            .ok_or_else(|| Error::invalid("handle", format!("no handle #{index}")))
    }

    /// Replaces persistent handle `index`'s bytes (exactly its size).
    pub fn write_handle(&mut self, index: usize, bytes: &[u8]) -> Result<()> {
        self.handles
            .get_mut(index)
            .ok_or_else(|| Error::invalid("handle", format!("no handle #{index}")))?
            .write(bytes)
    }

    /// Moves persistent handle `index`'s buffer out, leaving an empty one: the
    /// program must get a buffer back through [`CpuProgram::put_handle`] before it
    /// runs again (a run with an empty handle is refused).
    pub fn take_handle(&mut self, index: usize) -> Result<Buffer> {
        let slot = self
            .handles
            .get_mut(index)
            .ok_or_else(|| Error::invalid("handle", format!("no handle #{index}")))?;
        let empty = Buffer::zeroed(Shape::new(&[0], slot.shape().dtype()));
        Ok(std::mem::replace(slot, empty))
    }

    /// Installs `buffer` as persistent handle `index`; its shape and dtype must be the
    /// handle's.
    pub fn put_handle(&mut self, index: usize, buffer: Buffer) -> Result<()> {
        let expected = &self
            .plan
            .handles
            .get(index)
            .ok_or_else(|| Error::invalid("handle", format!("no handle #{index}")))?
            .shape;
        if buffer.shape() != expected {
            return Err(Error::ShapeMismatch {
                op: format!("put_handle #{index}"),
                lhs: expected.clone(),
                rhs: buffer.shape().clone(),
                reason: "the storage must have the handle's shape and dtype".into(),
            });
        }
        self.handles[index] = buffer;
        Ok(())
    }

    /// Base address of the arena (outputs are at their plan offsets from it).
    pub fn arena_ptr(&self) -> *const u8 {
        self.arena.as_ptr()
    }

    /// Turns per-step timing on (clearing earlier totals) or off.
    pub fn set_profiling(&mut self, on: bool) {
        self.step_nanos = on.then(|| vec![0; self.steps.len()]);
        self.profiled_runs = 0;
    }

    /// With profiling on: the time of every step over the profiled runs.
    pub fn profile(&self) -> Option<Profile> {
        let nanos = self.step_nanos.as_ref()?;
        let kernels = self
            .steps
            .iter()
            .zip(nanos)
            .map(|(s, &n)| KernelTime {
                node: s.node,
                kernel: s.kernel.name.clone(),
                total: std::time::Duration::from_nanos(n),
            })
            .collect();
        Some(Profile {
            runs: self.profiled_runs,
            kernels,
        })
    }

    /// Runs every step in order. Allocation-free.
    pub fn execute(&mut self) -> Result<()> {
        let CpuProgram {
            plan,
            arena,
            params,
            packed,
            constants,
            handles,
            steps,
            scratch,
            gemm,
            handle_addrs,
            step_nanos,
            profiled_runs,
            bf16_products,
            ..
        } = self;
        if let Some(i) = handles
            .iter()
            .zip(&plan.handles)
            .position(|(h, p)| h.shape() != &p.shape)
        {
            return Err(Error::runtime(
                "run",
                format!(
                    "handle '{}' was moved out (take_handle) and not put back",
                    plan.handles[i].name
                ),
            ));
        }
        if step_nanos.is_some() {
            *profiled_runs += 1;
        }
        let mut ctx = kernels::Ctx {
            scratch,
            gemm,
            pool: ThreadPool::global(),
            packed_b: None,
            bf16_products: *bf16_products,
        };
        let arena_base = arena.as_mut_ptr();
        for (addr, h) in handle_addrs.iter_mut().zip(handles.iter_mut()) {
            *addr = h.storage_mut().as_mut_ptr() as usize;
        }
        for (k, step) in steps.iter().enumerate() {
            let started = step_nanos.as_ref().map(|_| std::time::Instant::now());
            let base = |region: Region| -> *mut u8 {
                match region {
                    Region::Arena => arena_base,
                    Region::Param(i) => params[i].storage().as_ptr().cast_mut(),
                    Region::Constant(i) => constants[i].storage().as_ptr().cast_mut(),
                    Region::Handle(i) => handle_addrs[i] as *mut u8,
                }
            };
            let src = |k: usize| {
                let (loc, shape) = &step.inputs[k];
                // SAFETY: the plan placed this value inside its region.
                Src {
                    ptr: unsafe { base(loc.region).add(loc.offset) },
                    shape,
                    len: shape.num_elements(),
                }
            };
            let (loc, shape) = &step.output;
            // SAFETY: as above; outputs only live in the arena or a handle, which this
            // program owns mutably for the duration of `execute`.
            let out = Dst {
                ptr: unsafe { base(loc.region).add(loc.offset) },
                shape,
                len: shape.num_elements(),
            };
            ctx.packed_b = step.packed_b.and_then(|i| packed[i].as_ref());
            let args = kernels::Args {
                op: &step.op,
                n_inputs: step.inputs.len(),
                src: &src,
                out,
                geometry: step.geometry.as_ref(),
                layout: step.layout,
            };
            (step.kernel.run)(&args, &mut ctx)?;
            if let (Some(nanos), Some(t)) = (step_nanos.as_mut(), started) {
                nanos[k] += t.elapsed().as_nanos() as u64;
            }
        }
        Ok(())
    }
}
