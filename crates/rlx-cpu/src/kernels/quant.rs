//! Kernels over block-quantized weights: `quant_matmul` (GEMV for a few rows of
//! activations, the packed-B GEMM for many) and `dequantize` (quantized embeddings),
//! plus attention over a key/value cache.

use super::Ctx;
use crate::gemm::{BFormat, Epilogue, Gemm, sgemm};
use crate::quant::{self, GEMV_MAX_ROWS};
use crate::tensor::{Dst, Src};
use rlx_ir::{Error, QuantFormat, Result};

/// Decodes packed rows (`u8 [..., row_bytes]`) into `f32 [..., K]`.
pub(crate) fn dequantize(format: QuantFormat, x: Src, out: Dst) -> Result<()> {
    let row_bytes = x.shape.dim(x.shape.rank() - 1);
    let k = format.row_len(row_bytes)?;
    let rows = x.len / row_bytes;
    if rows * k != out.len {
        return Err(Error::runtime("dequantize", "output size does not match"));
    }
    // SAFETY: the plan sized `x` as `rows * row_bytes` bytes and `out` as `rows * k`
    // floats; they are distinct values (the output is never placed over a u8 operand).
    let (bytes, values) = unsafe {
        (
            std::slice::from_raw_parts(x.ptr, rows * row_bytes),
            std::slice::from_raw_parts_mut(out.ptr.cast::<f32>(), rows * k),
        )
    };
    for (row, dst) in bytes
        .chunks_exact(row_bytes)
        .zip(values.chunks_exact_mut(k))
    {
        rlx_ir::dequantize_row(format, row, dst)?;
    }
    Ok(())
}

/// `out = a @ dequantize(w)^T` for `a [..., K]` and `w` `[N, row_bytes]`.
pub(crate) fn quant_matmul(format: QuantFormat, a: Src, w: Src, out: Dst, ctx: &Ctx) -> Result<()> {
    let k = a.shape.dim(a.shape.rank() - 1);
    let (n, row_bytes) = (w.shape.dim(0), w.shape.dim(1));
    if format.row_bytes(k)? != row_bytes {
        return Err(Error::runtime(
            "quant_matmul",
            "weight rows do not match the activations",
        ));
    }
    let m = a.len / k.max(1);
    if m * n != out.len {
        return Err(Error::runtime("quant_matmul", "output size does not match"));
    }
    if m <= GEMV_MAX_ROWS {
        // SAFETY: `a` holds m x k floats, `w` n rows of `row_bytes`, `out` m x n floats.
        return unsafe {
            quant::gemv(
                format,
                a.ptr.cast::<f32>(),
                m,
                k,
                w.ptr,
                n,
                out.ptr.cast::<f32>(),
                ctx.pool,
                ctx.gemm.threads(),
            )
        };
    }
    let g = Gemm {
        m,
        n,
        k,
        a: a.ptr.cast::<f32>(),
        lda: k,
        b: w.ptr.cast::<f32>(),
        ldb: k,
        a_transposed: false,
        b_transposed: true,
        b_format: BFormat::Quant(format),
        c: out.ptr.cast::<f32>(),
        ldc: n,
        accumulate: false,
        epilogue: Epilogue::NONE,
    };
    // SAFETY: the operands have the sizes stated in `g`; the output does not overlap
    // them (the planner never runs a matmul in place).
    unsafe { sgemm(&g, ctx.pool, ctx.gemm) }
}
