//! Sessions and compile options.

use crate::CompiledGraph;
use crate::registry::backend_for;
use rlx_backend::BackendOptions;
use rlx_driver::{BufferHandle, Device};
use rlx_ir::{Graph, Result};
use rlx_opt::{FusionOptions, PlanOptions, plan_graph};
use std::borrow::Borrow;
use std::sync::Arc;

/// Compiles graphs for one device.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Session {
    device: Device,
}

/// How to compile a graph.
#[derive(Clone, Debug, PartialEq)]
pub struct CompileOptions {
    handles: Vec<BufferHandle>,
    memory_reuse: bool,
    in_place: bool,
    optimize: bool,
    threads: usize,
    primitives_only: bool,
    allow_tf32: bool,
    allow_bf16: bool,
}

impl Default for CompileOptions {
    fn default() -> Self {
        CompileOptions {
            handles: Vec::new(),
            memory_reuse: true,
            in_place: true,
            optimize: true,
            threads: 0,
            primitives_only: false,
            allow_tf32: false,
            allow_bf16: false,
        }
    }
}

impl CompileOptions {
    /// The defaults: memory reuse and in-place execution on, no handles.
    pub fn new() -> CompileOptions {
        CompileOptions::default()
    }

    /// Makes the graph input named `handle.name` persistent state: it lives outside the
    /// arena, is not passed to `run`, keeps its contents across runs, and may be written
    /// by `write_at`. Its shape must equal the input's.
    pub fn bind_handle(mut self, handle: &BufferHandle) -> CompileOptions {
        self.handles.push(handle.clone());
        self
    }

    /// Turns sharing of arena bytes between values on or off (on by default; off helps
    /// rule out the planner when chasing a wrong result).
    pub fn memory_reuse(mut self, on: bool) -> CompileOptions {
        self.memory_reuse = on;
        self
    }

    /// Turns in-place elementwise execution on or off (on by default).
    pub fn in_place(mut self, on: bool) -> CompileOptions {
        self.in_place = on;
        self
    }

    /// Compiles as a backend that runs only primitives would: every composite
    /// (softmax, norms, attention, rotary embedding, GELU/SiLU) is decomposed and
    /// nothing is fused. For checking decompositions on a backend that has every
    /// kernel (off by default).
    pub fn primitives_only(mut self, on: bool) -> CompileOptions {
        self.primitives_only = on;
        self
    }

    /// Turns the graph optimizations on or off (on by default): constant folding,
    /// common-subexpression elimination and the fusions the device runs. Off gives
    /// one kernel per op of the graph as built, for comparison and debugging.
    pub fn optimize(mut self, on: bool) -> CompileOptions {
        self.optimize = on;
        self
    }

    /// The most CPU threads a run may use (0, the default: every thread of the
    /// runtime's pool, which has one per core or `$RLX_NUM_THREADS`).
    pub fn threads(mut self, threads: usize) -> CompileOptions {
        self.threads = threads;
        self
    }

    /// Lets f32 matrix products on a GPU round their operands to TF32 on tensor cores
    /// (faster, near 3e-4 relative error; off by default, so f32 stays f32).
    pub fn allow_tf32(mut self, on: bool) -> CompileOptions {
        self.allow_tf32 = on;
        self
    }

    /// Lets f32 matrix products on a CPU with AMX round their operands to bfloat16 and
    /// sum the products in f32 on its tiles: PyTorch's "medium" matmul precision
    /// (several times faster; each operand off by up to 2^-9 relative, and operands
    /// and products below about 1.2e-38 counted as zero). Off by default, so f32 stays f32; a CPU
    /// without AMX, and the GPU, ignore it.
    pub fn allow_bf16(mut self, on: bool) -> CompileOptions {
        self.allow_bf16 = on;
        self
    }

    /// The handles to bind.
    pub fn handles(&self) -> &[BufferHandle] {
        &self.handles
    }
}

impl Session {
    /// A session for `device`. Compiling fails if the device has no backend here.
    pub fn new(device: Device) -> Session {
        Session { device }
    }

    /// The session's device.
    pub fn device(&self) -> Device {
        self.device
    }

    /// Compiles with default options.
    pub fn compile(&self, graph: impl Borrow<Graph>) -> Result<CompiledGraph> {
        self.compile_with(graph, &CompileOptions::default())
    }

    /// Verifies, optimizes, plans memory and prepares the graph on the device.
    pub fn compile_with(
        &self,
        graph: impl Borrow<Graph>,
        options: &CompileOptions,
    ) -> Result<CompiledGraph> {
        let backend = backend_for(self.device)?;
        let mut seen = std::collections::HashSet::new();
        if let Some(dup) = options
            .handles
            .iter()
            .find(|h| !seen.insert(h.name.as_str()))
        {
            return Err(rlx_ir::Error::DuplicateName {
                kind: "handle",
                name: dup.name.clone(),
            });
        }
        let plan_options = PlanOptions {
            handles: options
                .handles
                .iter()
                .map(|h| (h.name.clone(), h.shape.clone()))
                .collect(),
            memory_reuse: options.memory_reuse,
            in_place: options.in_place,
            simplify: options.optimize,
            fusion: if options.optimize && !options.primitives_only {
                backend.fusion()
            } else {
                FusionOptions::default()
            },
            native: if options.primitives_only {
                rlx_ir::decompose::NativeOps::Primitives
            } else {
                backend.native_ops()
            },
        };
        let plan = Arc::new(plan_graph(graph.borrow(), &plan_options)?);
        let backend_options = BackendOptions {
            threads: options.threads,
            allow_tf32: options.allow_tf32,
            allow_bf16: options.allow_bf16,
            ..BackendOptions::default()
        };
        let exe = backend.compile(plan.clone(), &backend_options)?;
        Ok(CompiledGraph::new(self.device, plan, exe))
    }
}
