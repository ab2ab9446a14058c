//! RLX: an ML compiler and runtime in Rust.
//!
//! Build a [`Graph`] in code, compile it once for a [`Device`] with a [`Session`], and
//! run the [`CompiledGraph`] many times with no allocation on the hot path.
//!
//! ```
//! use rlx::prelude::*;
//!
//! let g = Graph::new("mlp");
//! let x = g.input("x", Shape::new(&[2, 4], DType::F32))?;
//! let w = g.param("w", Shape::new(&[4, 3], DType::F32))?;
//! let b = g.param("b", Shape::new(&[3], DType::F32))?;
//! let h = g.matmul(x, w)?;
//! let y = g.gelu(g.add(h, b)?)?;
//! g.set_outputs(vec![y]);
//!
//! let mut compiled = Session::new(Device::Cpu).compile(g)?;
//! compiled.set_param("w", &[0.0; 12])?;
//! compiled.set_param("b", &[1.5, -0.5, 0.0])?;
//! let out = compiled.run(&[("x", &[0.0; 8])])?;
//! assert!((out[0][0] - 1.3998).abs() < 1e-3);
//! # Ok::<(), rlx::Error>(())
//! ```

pub use half;
pub use rlx_cpu as cpu;
pub use rlx_driver as driver;
pub use rlx_driver::{BufferHandle, Device};
pub use rlx_gguf as gguf;
pub use rlx_ir as ir;
pub use rlx_ir::{
    Bindings, DType, Dim, Error, Graph, NodeId, Result, Shape, SymbolicShape, TensorData, TensorRef,
};
pub use rlx_models as models;
pub use rlx_models::Embedder;
pub use rlx_models::llama::Llm;
pub use rlx_onnx as onnx;
pub use rlx_opt as opt;
pub use rlx_opt::autodiff::{grad, jvp};
pub use rlx_runtime as runtime;
pub use rlx_runtime::{
    BucketedCompileCache, Buckets, CompileOptions, CompiledGraph, MemoryStats, Session,
    SlotOutputs, SymbolRange, SymbolicGraph, device_available,
};
pub use rlx_train as train;
pub use rlx_train::{LrSchedule, Optimizer, TrainOptions, Trainer};

/// How many threads the CPU backend's pool runs kernels on (one per core, or
/// `$RLX_NUM_THREADS`).
pub fn cpu_threads() -> usize {
    rlx_cpu::pool::ThreadPool::global().threads()
}

/// Everything needed to build, compile and run a graph.
pub mod prelude {
    pub use crate::{
        Bindings, BucketedCompileCache, Buckets, BufferHandle, CompileOptions, CompiledGraph,
        DType, Device, Dim, Error, Graph, NodeId, Result, Session, Shape, SymbolRange,
        SymbolicGraph, SymbolicShape, TensorData, TensorRef, grad, jvp,
    };
    pub use crate::{LrSchedule, Optimizer, TrainOptions, Trainer};
    pub use rlx_ir::{Adam, BinaryOp, CrossEntropy, PadMode, ReduceOp, RopeStyle, Sgd, UnaryOp};
}

/// The README's examples, compiled and run as doc tests.
#[cfg(doctest)]
#[doc = include_str!("../../../README.md")]
mod readme {}
