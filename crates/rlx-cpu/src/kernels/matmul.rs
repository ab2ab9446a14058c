//! Batched matrix multiplication (numpy `matmul`), batch dims broadcast.

use crate::elem::{Elem, with_dtype};
use crate::tensor::{Dst, Src, broadcast_strides, for_each_strided};

/// `(m, k, n)` and the batch dims of the output, from operand ranks (1-D promoted).
fn geometry<'a>(a: &Src<'a>, b: &Src<'a>) -> (usize, usize, usize, &'a [usize], &'a [usize]) {
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

pub(crate) fn matmul(a: Src, b: Src, out: Dst) {
    let (m, k, n, a_batch, b_batch) = geometry(&a, &b);
    let batch_rank = a_batch.len().max(b_batch.len());
    let out_batch = &out.shape.dims()[..batch_rank];
    let sa = broadcast_strides(a_batch, out_batch);
    let sb = broadcast_strides(b_batch, out_batch);
    with_dtype!(out.shape.dtype(), T => {
        for_each_strided(out_batch, [&sa, &sb], [0, 0], |bi, [ab, bb]| {
            let a_off = ab as usize * m * k;
            let b_off = bb as usize * k * n;
            let o_off = bi * m * n;
            if std::any::TypeId::of::<T>() == std::any::TypeId::of::<f32>() {
                matmul_f32(&a, &b, &out, (a_off, b_off, o_off), (m, k, n));
            } else {
                matmul_generic::<T>(&a, &b, &out, (a_off, b_off, o_off), (m, k, n));
            }
        });
    })
}

/// Row-by-row `f32` kernel (i-p-j order, so the inner loop is contiguous).
fn matmul_f32(
    a: &Src,
    b: &Src,
    out: &Dst,
    (ao, bo, oo): (usize, usize, usize),
    (m, k, n): (usize, usize, usize),
) {
    let a_all: &[f32] = a.as_slice();
    let b_all: &[f32] = b.as_slice();
    let o_all: &mut [f32] = out.as_mut_slice();
    for i in 0..m {
        let row = &mut o_all[oo + i * n..oo + (i + 1) * n];
        row.fill(0.0);
        for p in 0..k {
            let av = a_all[ao + i * k + p];
            let b_row = &b_all[bo + p * n..bo + (p + 1) * n];
            for (o, &bv) in row.iter_mut().zip(b_row) {
                *o += av * bv;
            }
        }
    }
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
