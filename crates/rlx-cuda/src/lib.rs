//! The CUDA backend: compiles a [`Plan`] for one NVIDIA GPU and runs it there.
//!
//! CUDA is loaded at run time (the driver, NVRTC and cuBLAS libraries), so this
//! crate builds everywhere; on a machine without them [`available`] says why and
//! [`CudaBackend::new`] returns that as an error. Matrix products go to cuBLAS; every
//! other step is a kernel generated as CUDA C from the IR ([`codegen`]) and compiled
//! with NVRTC, all of a program's kernels in one module, cached on disk.
//!
//! The backend declares the primitives and the composites it runs (norms, softmax,
//! attention, rotary embeddings, the optimizer's fused forms); other composites are
//! decomposed into primitives before planning, and a graph that still holds an op
//! with no CUDA kernel is a compile error naming it.

mod codegen;
mod fused_matmul;
#[cfg(test)]
mod gemv_bench;
mod gpu;
mod lt_matmul;
mod matmul;
mod node_runs;
mod nvrtc;
mod param_layout;
mod product_groups;
mod program;
mod rope_writes;
mod step_timer;

pub use nvrtc::{COMPILES as NVRTC_COMPILES, cache_dir};
pub use program::{CudaProgram, GRAPH_CAPTURES};

use rlx_backend::{Backend, BackendOptions, Executable};
use rlx_driver::Device;
use rlx_ir::decompose::NativeOps;
use rlx_ir::{BinaryOp, Error, Result, UnaryOp};
use rlx_opt::{FusionOptions, Plan};
use std::sync::{Arc, Mutex, OnceLock};

fn unavailable(ordinal: usize, reason: impl Into<String>) -> Error {
    Error::DeviceUnavailable {
        device: Device::Cuda(ordinal).to_string(),
        reason: reason.into(),
    }
}

/// Whether GPU `ordinal` can run graphs: the CUDA driver, NVRTC and cuBLAS load, and
/// the GPU exists. The error says what is missing.
pub fn available(ordinal: usize) -> Result<()> {
    // SAFETY: these only try to open the libraries.
    let (driver, nvrtc, blas) = unsafe {
        (
            cudarc::driver::sys::is_culib_present(),
            cudarc::nvrtc::sys::is_culib_present(),
            cudarc::cublas::sys::is_culib_present(),
        )
    };
    if !driver {
        return Err(unavailable(
            ordinal,
            "the CUDA driver library (libcuda) is not installed",
        ));
    }
    if !nvrtc {
        return Err(unavailable(
            ordinal,
            "the NVRTC library (libnvrtc) was not found",
        ));
    }
    if !blas {
        return Err(unavailable(
            ordinal,
            "the cuBLAS library (libcublas) was not found",
        ));
    }
    cudarc::driver::result::init()
        .map_err(|e| unavailable(ordinal, format!("the driver failed to start: {e:?}")))?;
    let count = cudarc::driver::CudaContext::device_count()
        .map_err(|e| unavailable(ordinal, format!("counting GPUs failed: {e:?}")))?;
    if ordinal >= count.max(0) as usize {
        return Err(unavailable(
            ordinal,
            format!("this machine has {count} CUDA GPU(s)"),
        ));
    }
    Ok(())
}

/// The primitives the CUDA backend runs (names as `Op::name` gives them).
fn native_ops() -> NativeOps {
    use BinaryOp as B;
    use UnaryOp as U;
    let unary = [
        U::Neg,
        U::Abs,
        U::Exp,
        U::Log,
        U::Sqrt,
        U::Rsqrt,
        U::Reciprocal,
        U::Tanh,
        U::Sigmoid,
        U::Relu,
        U::Erf,
        U::Sin,
        U::Cos,
        U::Floor,
        U::Ceil,
        U::Round,
        U::Sign,
        U::Not,
        U::Atan,
        U::BitNot,
    ];
    let binary = [
        B::Add,
        B::Sub,
        B::Mul,
        B::Div,
        B::Pow,
        B::Max,
        B::Min,
        B::Mod,
        B::Eq,
        B::Ne,
        B::Lt,
        B::Le,
        B::Gt,
        B::Ge,
        B::And,
        B::Or,
        B::Xor,
        B::BitAnd,
        B::BitOr,
        B::BitXor,
        B::ShiftLeft,
        B::ShiftRight,
    ];
    let mut names: std::collections::BTreeSet<String> = unary
        .iter()
        .map(|u| u.name().to_string())
        .chain(binary.iter().map(|b| b.name().to_string()))
        .collect();
    for op in [
        "gelu",
        "gelu_tanh",
        "silu",
        "relu6",
        "hard_swish",
        "where",
        "cast",
        "matmul",
        "reshape",
        "permute",
        "slice",
        "concat",
        "expand",
        "reduce_sum",
        "reduce_mean",
        "reduce_max",
        "reduce_min",
        "reduce_prod",
        "argmax",
        "argmin",
        "gather",
        "pad",
        "tile",
        "range",
        "random_uniform",
        "cumsum",
        "topk_values",
        "topk_indices",
        "one_hot",
        "conv2d",
        "max_pool2d",
        "avg_pool2d",
        "write_at",
        "cached_attention",
        "attention",
        "layer_norm",
        "rms_norm",
        "rope",
        "softmax",
        "log_softmax",
        "dequantize",
        "quant_matmul",
        "fused_matmul",
        "elementwise",
    ] {
        names.insert(op.to_string());
    }
    NativeOps::Only(names)
}

/// The optimizer's fusions for this backend: products with their epilogues (and half
/// weights read as stored), elementwise regions as one generated kernel each, and
/// attention as one op (spelled-out attention recognized, head transposes folded into
/// its layout) for the flash kernel.
fn fusion() -> FusionOptions {
    FusionOptions {
        matmul_epilogue: true,
        elementwise_regions: true,
        activations: true,
        attention_layout: true,
        attention_pattern: true,
        ..FusionOptions::default()
    }
}

/// One GPU's context, shared by every program compiled for it in this process.
fn shared_gpu(ordinal: usize) -> Result<Arc<gpu::Gpu>> {
    type Opened = Mutex<Vec<(usize, Arc<gpu::Gpu>)>>;
    static GPUS: OnceLock<Opened> = OnceLock::new();
    let mut gpus = GPUS
        .get_or_init(|| Mutex::new(Vec::new()))
        .lock()
        .unwrap_or_else(|p| p.into_inner());
    if let Some((_, g)) = gpus.iter().find(|(o, _)| *o == ordinal) {
        return Ok(g.clone());
    }
    let g = Arc::new(gpu::Gpu::new(ordinal)?);
    gpus.push((ordinal, g.clone()));
    Ok(g)
}

/// Runs plans on one NVIDIA GPU.
pub struct CudaBackend {
    ordinal: usize,
    gpu: Arc<gpu::Gpu>,
}

impl CudaBackend {
    /// The backend for GPU `ordinal`; an error when CUDA or the GPU is missing.
    pub fn new(ordinal: usize) -> Result<CudaBackend> {
        available(ordinal)?;
        Ok(CudaBackend {
            ordinal,
            gpu: shared_gpu(ordinal)?,
        })
    }
}

impl Backend for CudaBackend {
    fn device(&self) -> Device {
        Device::Cuda(self.ordinal)
    }

    fn fusion(&self) -> FusionOptions {
        fusion()
    }

    fn native_ops(&self) -> NativeOps {
        native_ops()
    }

    fn compile(&self, plan: Arc<Plan>, options: &BackendOptions) -> Result<Box<dyn Executable>> {
        Ok(Box::new(CudaProgram::new(
            self.gpu.clone(),
            self.ordinal,
            plan,
            options.allow_tf32,
        )?))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_gpu_is_an_error_not_a_panic() {
        // On a machine with CUDA this asks for a GPU far past any real count.
        let e = available(4096).expect_err("no machine has 4097 GPUs");
        assert!(matches!(e, Error::DeviceUnavailable { .. }), "{e}");
        assert!(CudaBackend::new(4096).is_err());
    }

    #[test]
    fn the_native_set_holds_the_primitives_the_generator_writes() {
        let NativeOps::Only(names) = native_ops() else {
            panic!("an explicit set")
        };
        for name in ["add", "exp", "matmul", "reduce_sum", "where", "cast"] {
            assert!(names.contains(name), "{name}");
        }
        assert!(!names.contains("fused_conv2d"), "composites decompose");
    }
}
