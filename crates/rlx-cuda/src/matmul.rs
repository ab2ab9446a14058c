//! `MatMul` as one strided-batched cuBLAS product. Row-major `C = A B` is the
//! column-major product `C^T = B^T A^T`, so cuBLAS is called with the operands
//! swapped and nothing transposed. Batch dims that broadcast only partly (`[2, 1]`
//! against `[1, 3]`) cannot be one strided call; those run as one call per output
//! matrix, each with its operands' offsets worked out when the program is built.

use crate::gpu::Gpu;
use crate::lt_matmul::LtGemm;
use crate::program::Arg;
use cudarc::cublas::result as cublas;
use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t, cudaDataType};
use cudarc::driver::sys::CUdeviceptr;
use rlx_ir::{DType, Shape};
use std::ffi::c_void;

/// A library product: cuBLAS, or cuBLASLt with the bias and residual folded in.
pub(crate) enum Product {
    Blas(Gemm),
    Lt(Box<LtGemm>),
}

/// Most pointer arguments of a [`Product`].
pub(crate) const PRODUCT_ARGS: usize = 5;

impl Product {
    /// Its pointer arguments, in the order [`Product::run`] takes their addresses.
    pub fn args(&self) -> Vec<Arg> {
        match self {
            Product::Blas(g) => vec![g.a, g.b, g.c],
            Product::Lt(g) => g.args().collect(),
        }
    }

    /// Queues it on the GPU's stream; `ptrs` are the addresses of
    /// [`Product::args`].
    pub fn run(&self, gpu: &Gpu, ptrs: &[CUdeviceptr]) -> rlx_ir::Result<()> {
        match self {
            Product::Blas(g) => g.run(gpu, ptrs[0], ptrs[1], ptrs[2]),
            Product::Lt(g) => g.run(gpu, ptrs),
        }
    }
}

/// One planned product.
pub(crate) struct Gemm {
    pub a: Arg,
    pub b: Arg,
    pub c: Arg,
    /// Scale of the product.
    alpha: f64,
    /// Whether `b` is stored `[N, K]`.
    b_transposed: bool,
    m: i32,
    n: i32,
    k: i32,
    batch: i32,
    stride_a: i64,
    stride_b: i64,
    stride_c: i64,
    data: cudaDataType,
    compute: cublasComputeType_t,
    /// Bytes of the output, zeroed when the inner dim is empty.
    c_bytes: usize,
    /// Per output matrix, byte offsets into `a`, `b` and `c`, when the batch dims
    /// broadcast partly (else empty: one strided call).
    pieces: Vec<(u64, u64, u64)>,
}

/// `dims` as `(batch dims, rows, cols)`, a 1-D operand promoted as numpy does (a row
/// vector on the left, a column on the right).
fn matrix(dims: &[usize], left: bool) -> (Vec<usize>, usize, usize) {
    match dims.len() {
        0 => (vec![], 1, 1),
        1 if left => (vec![], 1, dims[0]),
        1 => (vec![], dims[0], 1),
        r => (dims[..r - 2].to_vec(), dims[r - 2], dims[r - 1]),
    }
}

fn to_i32(v: usize, what: &str) -> Result<i32, String> {
    i32::try_from(v).map_err(|_| format!("{what} {v} is past cuBLAS's 32-bit sizes"))
}

impl Gemm {
    /// Plans `out = alpha a b` for operand shapes `inputs` (`b`'s logical shape,
    /// stored `[N, K]` when `b_transposed`); an error says why cuBLAS cannot run it.
    pub fn new(
        inputs: &[Shape],
        out: &Shape,
        (a, b, c): (Arg, Arg, Arg),
        alpha: f64,
        allow_tf32: bool,
        b_transposed: bool,
    ) -> Result<Gemm, String> {
        let dt = out.dtype();
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
            DType::F64 => (
                cudaDataType::CUDA_R_64F,
                cublasComputeType_t::CUBLAS_COMPUTE_64F,
            ),
            other => return Err(format!("matrix products of {other:?}")),
        };
        let (ba, m, k) = matrix(inputs[0].dims(), true);
        let (bb, k2, n) = matrix(inputs[1].dims(), false);
        if k != k2 {
            return Err(format!("inner dims {k} and {k2} differ"));
        }
        if b_transposed && !bb.is_empty() {
            return Err("a transposed operand must be a matrix".into());
        }
        let batch: usize = out.num_elements() / (m * n).max(1);
        let batch = if m * n == 0 { 0 } else { batch };
        // Each operand's batch is either the whole output batch or a single matrix;
        // anything else runs matrix by matrix.
        let whole = |dims: &[usize]| {
            let count: usize = dims.iter().product();
            count == batch || count == 1
        };
        let stride = |dims: &[usize], size: usize| -> i64 {
            if dims.iter().product::<usize>() == 1 {
                0
            } else {
                size as i64
            }
        };
        let elem = dt.size_in_bytes() as u64;
        let mut pieces = Vec::new();
        if !(whole(&ba) && whole(&bb)) {
            let rank = ba.len().max(bb.len());
            let mut out_batch = vec![1usize; rank];
            for (ax, d) in out_batch.iter_mut().enumerate() {
                let pick = |v: &[usize]| {
                    let lead = rank - v.len();
                    if ax < lead { 1 } else { v[ax - lead] }
                };
                *d = pick(&ba).max(pick(&bb));
            }
            let sa = rlx_ir::contiguous_strides(&ba);
            let sb = rlx_ir::contiguous_strides(&bb);
            for t in 0..batch {
                let (mut r, mut ia, mut ib) = (t, 0usize, 0usize);
                for ax in (0..rank).rev() {
                    let c = r % out_batch[ax];
                    r /= out_batch[ax];
                    let index = |v: &[usize], s: &[usize]| {
                        let lead = rank - v.len();
                        if ax < lead || v[ax - lead] == 1 {
                            0
                        } else {
                            c * s[ax - lead]
                        }
                    };
                    ia += index(&ba, &sa);
                    ib += index(&bb, &sb);
                }
                pieces.push((
                    (ia * m * k) as u64 * elem,
                    (ib * k * n) as u64 * elem,
                    (t * m * n) as u64 * elem,
                ));
            }
        }
        Ok(Gemm {
            a,
            b,
            c,
            alpha,
            b_transposed,
            m: to_i32(m, "rows")?,
            n: to_i32(n, "columns")?,
            k: to_i32(k, "inner dim")?,
            batch: to_i32(batch, "batch")?,
            stride_a: stride(&ba, m * k),
            stride_b: stride(&bb, k * n),
            stride_c: (m * n) as i64,
            data,
            compute,
            c_bytes: out.byte_size(),
            pieces,
        })
    }

    /// Queues the product on the GPU's stream.
    pub fn run(
        &self,
        gpu: &Gpu,
        a: CUdeviceptr,
        b: CUdeviceptr,
        c: CUdeviceptr,
    ) -> rlx_ir::Result<()> {
        if self.batch == 0 || self.m == 0 || self.n == 0 {
            return Ok(());
        }
        if self.k == 0 {
            // A sum of nothing: zeros.
            // SAFETY: the output range was checked against its region.
            return unsafe {
                cudarc::driver::result::memset_d8_async(c, 0, self.c_bytes, gpu.cu_stream())
            }
            .map_err(|e| crate::gpu::cuda_error("zeroing an empty product", e));
        }
        if self.pieces.is_empty() {
            return self.call(gpu, a, b, c, self.batch);
        }
        for &(da, db, dc) in &self.pieces {
            self.call(gpu, a + da, b + db, c + dc, 1)?;
        }
        Ok(())
    }

    /// One strided-batched call over `batch` matrices starting at `a`, `b`, `c`.
    fn call(
        &self,
        gpu: &Gpu,
        a: CUdeviceptr,
        b: CUdeviceptr,
        c: CUdeviceptr,
        batch: i32,
    ) -> rlx_ir::Result<()> {
        let (alpha32, zero32) = (self.alpha as f32, 0.0f32);
        let (alpha64, zero64) = (self.alpha, 0.0f64);
        let (alpha, beta): (*const c_void, *const c_void) =
            if self.compute == cublasComputeType_t::CUBLAS_COMPUTE_64F {
                (
                    (&alpha64 as *const f64).cast(),
                    (&zero64 as *const f64).cast(),
                )
            } else {
                (
                    (&alpha32 as *const f32).cast(),
                    (&zero32 as *const f32).cast(),
                )
            };
        let k = self.k;
        // Row-major `b [K, N]` is column-major `b^T`, cuBLAS's first operand as it
        // stands; stored `[N, K]` it is column-major `b`, read transposed.
        let (op_b, ld_b) = if self.b_transposed {
            (cublasOperation_t::CUBLAS_OP_T, k)
        } else {
            (cublasOperation_t::CUBLAS_OP_N, self.n)
        };
        // SAFETY: pointers address ranges the plan checked; the scalars live across
        // the call (cuBLAS reads host scalars before returning).
        unsafe {
            cublas::gemm_strided_batched_ex(
                gpu.blas.0,
                op_b,
                cublasOperation_t::CUBLAS_OP_N,
                self.n,
                self.m,
                k,
                alpha,
                b as *const c_void,
                self.data,
                ld_b,
                self.stride_b,
                a as *const c_void,
                self.data,
                k,
                self.stride_a,
                beta,
                c as *mut c_void,
                self.data,
                self.n,
                self.stride_c,
                batch,
                self.compute,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| crate::gpu::cuda_error("cuBLAS product", e))
    }
}
