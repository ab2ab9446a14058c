//! Batched matrix multiplication (numpy `matmul`), batch dims broadcast.

use super::Ctx;
use crate::elem::{Elem, with_dtype};
use crate::gemm::{BFormat, Epilogue, Gemm, sgemm_batch};
use crate::tensor::{Dst, Src, broadcast_strides, for_each_strided, strided_offsets};
use rlx_ir::{DType, Result};

/// `(m, k, n)` and the batch dims of the output, from operand ranks (1-D promoted).
pub(super) fn geometry<'a>(
    a: &Src<'a>,
    b: &Src<'a>,
) -> (usize, usize, usize, &'a [usize], &'a [usize]) {
    let (ad, bd) = (a.shape.dims(), b.shape.dims());
    let (m, k) = if ad.len() == 1 {
        (1, ad[0])
    } else {
        (ad[ad.len() - 2], ad[ad.len() - 1])
    };
    let n = if bd.len() == 1 { 1 } else { bd[bd.len() - 1] };
    let a_batch = &ad[..ad.len().saturating_sub(2)];
    let b_batch = &bd[..bd.len().saturating_sub(2)];
    (m, k, n, a_batch, b_batch)
}

/// The products a batched matmul runs: `(rows of each, A's, B's and the output's batch
/// dims to loop over)`. When every batch element multiplies the same `B` (a weight
/// matrix, as in every linear layer), the batch folds into the rows of one product:
/// `[batch, m, k] x [k, n]` is `[batch * m, k] x [k, n]`, since A and the output are
/// contiguous. One tall product blocks and threads far better than many short ones.
pub(super) fn batch_plan<'a>(
    m: usize,
    a_batch: &'a [usize],
    b_batch: &'a [usize],
    out_batch: &'a [usize],
) -> (usize, &'a [usize], &'a [usize], &'a [usize]) {
    if b_batch.iter().all(|&d| d == 1) {
        (m * out_batch.iter().product::<usize>(), &[], &[], &[])
    } else {
        (m, a_batch, b_batch, out_batch)
    }
}

pub(crate) fn matmul(a: Src, b: Src, out: Dst, ctx: &Ctx) -> Result<()> {
    let (m, k, n, a_batch, b_batch) = geometry(&a, &b);
    let batch_rank = a_batch.len().max(b_batch.len());
    let out_batch = &out.shape.dims()[..batch_rank];
    if out.shape.dtype() == DType::F32 {
        let (m, a_batch, b_batch, out_batch) = batch_plan(m, a_batch, b_batch, out_batch);
        let sa = broadcast_strides(a_batch, out_batch);
        let sb = broadcast_strides(b_batch, out_batch);
        // Weights packed ahead are read as they are (B is then one 2-D matrix).
        let (b_ptr, b_format) = match crate::prepack::operand_for(ctx.packed_b, &b) {
            Some(packed) => packed,
            None => (b.ptr.cast::<f32>(), BFormat::F32),
        };
        let (a_base, b_base, c_base) = (a.ptr as usize, b_ptr as usize, out.ptr as usize);
        let count: usize = out_batch.iter().product();
        let product = |bi: usize| {
            let [ab, bb] = strided_offsets(out_batch, [&sa, &sb], bi);
            // SAFETY: batch element `ab` of A holds m*k floats inside A; likewise for B
            // and the output.
            unsafe {
                Gemm {
                    m,
                    n,
                    k,
                    a: (a_base as *const f32).add(ab as usize * m * k),
                    lda: k,
                    b: (b_base as *const f32).add(bb as usize * k * n),
                    ldb: n,
                    a_transposed: false,
                    b_transposed: false,
                    b_format,
                    c: (c_base as *mut f32).add(bi * m * n),
                    ldc: n,
                    accumulate: false,
                    epilogue: Epilogue::NONE,
                }
            }
        };
        // SAFETY: the plan never places a matmul's output over its operands.
        return unsafe { sgemm_batch(count, &product, ctx.pool, ctx.gemm, ctx.bf16_products) };
    }
    let sa = broadcast_strides(a_batch, out_batch);
    let sb = broadcast_strides(b_batch, out_batch);
    with_dtype!(out.shape.dtype(), T => {
        for_each_strided(out_batch, [&sa, &sb], [0, 0], |bi, [ab, bb]| {
            let a_off = ab as usize * m * k;
            let b_off = bb as usize * k * n;
            let o_off = bi * m * n;
            matmul_generic::<T>(&a, &b, &out, (a_off, b_off, o_off), (m, k, n));
        });
    });
    Ok(())
}

fn matmul_generic<T: Elem>(
    a: &Src,
    b: &Src,
    out: &Dst,
    (ao, bo, oo): (usize, usize, usize),
    (m, k, n): (usize, usize, usize),
) {
    for i in 0..m {
        for j in 0..n {
            let mut acc = 0.0f64;
            for p in 0..k {
                acc += a.f64::<T>(ao + i * k + p) * b.f64::<T>(bo + p * n + j);
            }
            out.set(oo + i * n + j, T::from_f64(acc));
        }
    }
}
