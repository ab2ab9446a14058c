//! A product whose bias and residual cuBLASLt adds as it stores the result:
//! `d = alpha a b + bias + residual` (or `relu(alpha a b + bias)`), one launch where
//! cuBLAS and an epilogue kernel were two, and the product's result is written once
//! instead of written, read back and written again.
//!
//! Row-major `d [M, N] = a [M, K] b [K, N]` is the column-major `d^T = b^T a^T`, so
//! cuBLASLt's first operand is `b` and its second `a`; its bias runs along the rows
//! of the column-major `d^T`, the columns of `d`. The residual is cuBLASLt's `c`,
//! added with `beta = 1`. `a`'s batch dims are rows (`b` is a matrix).

use crate::codegen::fused::Epilogue;
use crate::gpu::{Gpu, cuda_error};
use crate::program::Arg;
use cudarc::cublas::sys::cublasOperation_t;
use cudarc::cublaslt::result as lt;
use cudarc::cublaslt::sys::{
    self, cublasComputeType_t, cublasLtEpilogue_t, cublasLtMatmulAlgo_t,
    cublasLtMatmulDescAttributes_t as DescAttribute,
    cublasLtMatmulPreferenceAttributes_t as PrefAttribute, cudaDataType,
};
use cudarc::driver::sys::CUdeviceptr;
use rlx_ir::{DType, Shape, UnaryOp};
use rlx_opt::Location;
use std::ffi::c_void;
use std::sync::Mutex;

/// A cuBLASLt handle, owned by the [`Gpu`] that created it.
pub(crate) struct LtHandle(pub sys::cublasLtHandle_t);

// The handle is only used under the GPU's stream lock or at program build, and
// cuBLASLt handles may be shared between threads.
unsafe impl Send for LtHandle {}
unsafe impl Sync for LtHandle {}

impl LtHandle {
    /// A handle when the library loads (dynamic loading: a machine may lack it) and
    /// `RLX_CUDA_LT` is not `0`; `None` leaves every product to cuBLAS.
    pub fn open() -> Option<LtHandle> {
        if !rlx_ir::env::Switch::CudaLt.enabled() {
            return None;
        }
        // SAFETY: only probes for the library file.
        if !unsafe { sys::is_culib_present() } {
            return None;
        }
        lt::create_handle().ok().map(LtHandle)
    }
}

impl Drop for LtHandle {
    fn drop(&mut self) {
        // SAFETY: created by `open`, destroyed once.
        unsafe {
            let _ = lt::destroy_handle(self.0);
        }
    }
}

/// A matrix layout descriptor, destroyed on drop.
struct Layout(sys::cublasLtMatrixLayout_t);

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created by `Layout::new`, destroyed once.
        unsafe {
            let _ = lt::destroy_matrix_layout(self.0);
        }
    }
}

impl Layout {
    /// A column-major `rows x cols` matrix with leading dimension `ld`.
    fn new(data: cudaDataType, rows: usize, cols: usize, ld: usize) -> Result<Layout, String> {
        lt::create_matrix_layout(data, rows as u64, cols as u64, ld as i64)
            .map(Layout)
            .map_err(|e| format!("cuBLASLt layout: {e:?}"))
    }
}

/// A matmul descriptor, destroyed on drop.
struct Desc(sys::cublasLtMatmulDesc_t);

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by `Desc::new`, destroyed once.
        unsafe {
            let _ = lt::destroy_matmul_desc(self.0);
        }
    }
}

impl Desc {
    /// Sets one attribute to `value`.
    fn set<T>(&self, attribute: DescAttribute, value: &T) -> Result<(), String> {
        // SAFETY: the descriptor is live; `value` is read during the call.
        unsafe {
            lt::set_matmul_desc_attribute(
                self.0,
                attribute,
                (value as *const T).cast(),
                std::mem::size_of::<T>(),
            )
        }
        .map_err(|e| format!("cuBLASLt attribute {attribute:?}: {e:?}"))
    }
}

/// A preference descriptor, destroyed on drop.
struct Preference(sys::cublasLtMatmulPreference_t);

impl Drop for Preference {
    fn drop(&mut self) {
        // SAFETY: created by `lt::create_matmul_pref`, destroyed once.
        unsafe {
            let _ = lt::destroy_matmul_pref(self.0);
        }
    }
}

impl Preference {
    fn set<T>(&self, attribute: PrefAttribute, value: &T) -> Result<(), String> {
        // SAFETY: the descriptor is live; `value` is read during the call.
        unsafe {
            lt::set_matmul_pref_attribute(
                self.0,
                attribute,
                (value as *const T).cast(),
                std::mem::size_of::<T>(),
            )
        }
        .map_err(|e| format!("cuBLASLt preference {attribute:?}: {e:?}"))
    }
}

/// One planned cuBLASLt product with its epilogue.
pub(crate) struct LtGemm {
    a: Arg,
    b: Arg,
    d: Arg,
    bias: Option<Arg>,
    residual: Option<Arg>,
    alpha: f32,
    /// The descriptor; its bias pointer is set by each call (the program's copies
    /// run against their own arenas), so calls take it in turn.
    desc: Mutex<Desc>,
    /// cuBLASLt's `a` (our `b`), `b` (our `a`) and `c`/`d`.
    layouts: [Layout; 3],
    algo: cublasLtMatmulAlgo_t,
}

// The descriptors are plain host objects used under the mutex or read-only.
unsafe impl Send for LtGemm {}
unsafe impl Sync for LtGemm {}

/// The largest power of two (up to 256) dividing `offset`: the alignment of an
/// address at `offset` in a region (every region starts 256-byte aligned).
fn alignment(offset: usize) -> u32 {
    if offset == 0 {
        256
    } else {
        (1u32 << offset.trailing_zeros().min(8)).min(256)
    }
}

/// The operands one product passes: `a`, `b`, the output, and the bias and residual
/// where the epilogue takes them.
pub(crate) struct LtOperands<'a> {
    /// Shapes of `a`, `b`, then the bias and residual, as the node takes them.
    pub shapes: &'a [Shape],
    /// Their locations.
    pub inputs: &'a [Location],
    /// The output's shape and location.
    pub out: (&'a Shape, Location),
    /// Whether `b` is stored `[N, K]`.
    pub b_transposed: bool,
}

impl LtGemm {
    /// Plans `epilogue` over `operands` as one cuBLASLt call; `None` where it
    /// does not fit (an activation other than ReLU, ReLU before a residual, mixed
    /// dtypes, a batched `b`, unaligned operands, no algorithm found), leaving the
    /// product to cuBLAS and the epilogue kernel.
    pub fn plan(
        handle: &LtHandle,
        epilogue: &Epilogue,
        operands: &LtOperands<'_>,
        allow_tf32: bool,
        workspace_bytes: usize,
    ) -> Option<LtGemm> {
        // A descriptor cuBLASLt refuses leaves the product to cuBLAS as well.
        Self::build(handle, epilogue, operands, allow_tf32, workspace_bytes)
            .ok()
            .flatten()
    }

    /// [`LtGemm::plan`], with cuBLASLt's refusals as errors.
    fn build(
        handle: &LtHandle,
        epilogue: &Epilogue,
        operands: &LtOperands<'_>,
        allow_tf32: bool,
        workspace_bytes: usize,
    ) -> Result<Option<LtGemm>, String> {
        let LtOperands {
            shapes,
            inputs,
            out: (out_shape, out),
            b_transposed,
        } = *operands;
        if !epilogue.bias && !epilogue.residual {
            return Ok(None);
        }
        let fold = match (epilogue.activation, epilogue.bias, epilogue.residual) {
            (None, true, _) => cublasLtEpilogue_t::CUBLASLT_EPILOGUE_BIAS,
            (None, false, _) => cublasLtEpilogue_t::CUBLASLT_EPILOGUE_DEFAULT,
            (Some(UnaryOp::Relu), true, false) => cublasLtEpilogue_t::CUBLASLT_EPILOGUE_RELU_BIAS,
            _ => return Ok(None),
        };
        let dt = out_shape.dtype();
        let (data, compute) = match dt {
            DType::F32 if allow_tf32 => (
                cudaDataType::CUDA_R_32F,
                cublasComputeType_t::CUBLAS_COMPUTE_32F_FAST_TF32,
            ),
            DType::F32 => (
                cudaDataType::CUDA_R_32F,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            DType::F16 => (
                cudaDataType::CUDA_R_16F,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            DType::BF16 => (
                cudaDataType::CUDA_R_16BF,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
            ),
            _ => return Ok(None),
        };
        let (a, b) = (&shapes[0], &shapes[1]);
        if a.rank() < 2 || b.rank() != 2 || shapes.iter().any(|s| s.dtype() != dt) {
            return Ok(None);
        }
        let k = a.dims()[a.rank() - 1];
        let n = b.dims()[1];
        let m = a.num_elements() / k.max(1);
        if k == 0
            || m == 0
            || n == 0
            || b.dims()[0] != k
            || m.checked_mul(n) != Some(out_shape.num_elements())
        {
            return Ok(None);
        }
        let bias_at = usize::from(epilogue.bias);
        if epilogue.bias && shapes[2].num_elements() != n {
            return Ok(None);
        }
        if epilogue.residual && shapes[2 + bias_at].dims() != out_shape.dims() {
            return Ok(None);
        }
        if [m, n, k].iter().any(|&v| v > i32::MAX as usize) {
            return Ok(None);
        }
        let aligned = |l: Location| alignment(l.offset) >= 16;
        if !inputs.iter().all(|&l| aligned(l)) || !aligned(out) {
            return Ok(None);
        }
        let desc = lt::create_matmul_desc(compute, cudaDataType::CUDA_R_32F)
            .map(Desc)
            .map_err(|e| format!("cuBLASLt descriptor: {e:?}"))?;
        let trans_a = if b_transposed {
            cublasOperation_t::CUBLAS_OP_T
        } else {
            cublasOperation_t::CUBLAS_OP_N
        };
        desc.set(DescAttribute::CUBLASLT_MATMUL_DESC_TRANSA, &trans_a)?;
        desc.set(
            DescAttribute::CUBLASLT_MATMUL_DESC_TRANSB,
            &cublasOperation_t::CUBLAS_OP_N,
        )?;
        desc.set(DescAttribute::CUBLASLT_MATMUL_DESC_EPILOGUE, &fold)?;
        let lt_a = if b_transposed {
            Layout::new(data, k, n, k)?
        } else {
            Layout::new(data, n, k, n)?
        };
        let layouts = [
            lt_a,
            Layout::new(data, k, m, k)?,
            Layout::new(data, n, m, n)?,
        ];
        let preference = lt::create_matmul_pref()
            .map(Preference)
            .map_err(|e| format!("cuBLASLt preference: {e:?}"))?;
        preference.set(
            PrefAttribute::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
            &(workspace_bytes as u64),
        )?;
        let residual_at = inputs.get(2 + bias_at).filter(|_| epilogue.residual);
        for (attribute, at) in [
            (
                PrefAttribute::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                inputs[1],
            ),
            (
                PrefAttribute::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                inputs[0],
            ),
            (
                PrefAttribute::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                *residual_at.unwrap_or(&out),
            ),
            (
                PrefAttribute::CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                out,
            ),
        ] {
            preference.set(attribute, &alignment(at.offset))?;
        }
        // SAFETY: every descriptor is live.
        let found = unsafe {
            lt::get_matmul_algo_heuristic(
                handle.0,
                desc.0,
                layouts[0].0,
                layouts[1].0,
                layouts[2].0,
                layouts[2].0,
                preference.0,
            )
        };
        let Ok(found) = found else {
            return Ok(None);
        };
        Ok(Some(LtGemm {
            a: Arg::At(inputs[0]),
            b: Arg::At(inputs[1]),
            d: Arg::At(out),
            bias: epilogue.bias.then(|| Arg::At(inputs[2])),
            residual: residual_at.map(|&l| Arg::At(l)),
            alpha: epilogue.alpha as f32,
            desc: Mutex::new(desc),
            layouts,
            algo: found.algo,
        }))
    }

    /// The pointer arguments a call takes, in the order [`LtGemm::run`] reads them:
    /// `a`, `b`, the output, then the bias and the residual where there are.
    pub fn args(&self) -> impl Iterator<Item = Arg> + '_ {
        [self.a, self.b, self.d]
            .into_iter()
            .chain(self.bias)
            .chain(self.residual)
    }

    /// Queues the product on the GPU's stream; `ptrs` are the addresses of
    /// [`LtGemm::args`].
    pub fn run(&self, gpu: &Gpu, ptrs: &[CUdeviceptr]) -> rlx_ir::Result<()> {
        let (a, b, d) = (ptrs[0], ptrs[1], ptrs[2]);
        let mut rest = ptrs[3..].iter().copied();
        let bias = self.bias.and_then(|_| rest.next());
        let residual = self.residual.and_then(|_| rest.next());
        let handle = gpu
            .lt
            .as_ref()
            .ok_or_else(|| cuda_error("a cuBLASLt product", "the library is not loaded"))?;
        let (workspace, workspace_bytes) = gpu.blas_workspace();
        let desc = self.desc.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(bias) = bias {
            desc.set(DescAttribute::CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias)
                .map_err(|e| cuda_error("a cuBLASLt product", e))?;
        }
        let beta = if residual.is_some() { 1.0f32 } else { 0.0 };
        // SAFETY: the descriptors are live; the pointers address ranges the plan
        // checked; the scalars are read before the call returns; the workspace is
        // the GPU's, used by one call at a time on its one stream.
        unsafe {
            lt::matmul(
                handle.0,
                desc.0,
                (&self.alpha as *const f32).cast(),
                (&beta as *const f32).cast(),
                b as *const c_void,
                self.layouts[0].0,
                a as *const c_void,
                self.layouts[1].0,
                residual.unwrap_or(d) as *const c_void,
                self.layouts[2].0,
                d as *mut c_void,
                self.layouts[2].0,
                &self.algo,
                workspace as *mut c_void,
                workspace_bytes,
                gpu.cu_stream() as sys::cudaStream_t,
            )
        }
        .map_err(|e| cuda_error("cuBLASLt product", e))
    }
}

#[cfg(test)]
mod tests {
    use super::alignment;

    #[test]
    fn alignment_is_the_largest_power_of_two_up_to_a_region_start() {
        assert_eq!(alignment(0), 256);
        assert_eq!(alignment(4096), 256);
        assert_eq!(alignment(48), 16);
        assert_eq!(alignment(6), 2);
        assert_eq!(alignment(7), 1);
    }
}
