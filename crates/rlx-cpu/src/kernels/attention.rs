//! Scaled dot-product attention and rotary embedding.

use crate::elem::{Bool8, Elem, with_dtype};
use crate::tensor::{Dst, Src, broadcast_strides};
use rlx_ir::{DType, RopeStyle};

/// `scores` must hold at least `Sk` values (the program's scratch).
#[allow(clippy::too_many_arguments)] // q, k, v, mask, output and scratch are all distinct
pub(crate) fn attention(
    scale: f64,
    causal: bool,
    seq_major: bool,
    q: Src,
    k: Src,
    v: Src,
    mask: Option<Src>,
    out: Dst,
    scores: &mut [f64],
) {
    let (hd, sd) = if seq_major { (2, 1) } else { (1, 2) };
    let [b, hq, sq, d] = [
        q.shape.dim(0),
        q.shape.dim(hd),
        q.shape.dim(sd),
        q.shape.dim(3),
    ];
    let (hkv, sk, dv) = (k.shape.dim(hd), k.shape.dim(sd), v.shape.dim(3));
    let group = hq / hkv;
    // Offset of row (batch, head, position) of a tensor with `heads` heads, `len`
    // positions and rows of `width`.
    let row = |bi: usize, h: usize, i: usize, heads: usize, len: usize, width: usize| {
        if seq_major {
            ((bi * len + i) * heads + h) * width
        } else {
            ((bi * heads + h) * len + i) * width
        }
    };
    let full = [b, hq, sq, sk];
    let ms = mask.map(|m| broadcast_strides(m.shape.dims(), &full));
    let scores = &mut scores[..sk];
    with_dtype!(q.shape.dtype(), T => {
        for bi in 0..b {
            for h in 0..hq {
                let kh = h / group;
                for i in 0..sq {
                    let q_row = row(bi, h, i, hq, sq, d);
                    let mut max = f64::NEG_INFINITY;
                    for (j, score) in scores.iter_mut().enumerate() {
                        *score = f64::NEG_INFINITY;
                        if causal && j + sq > i + sk {
                            continue;
                        }
                        let k_row = row(bi, kh, j, hkv, sk, d);
                        let mut s = 0.0;
                        for p in 0..d {
                            s += q.f64::<T>(q_row + p) * k.f64::<T>(k_row + p);
                        }
                        s *= scale;
                        if let (Some(m), Some(st)) = (mask, ms.as_ref()) {
                            let at = (bi as isize * st[0] + h as isize * st[1] + i as isize * st[2] + j as isize * st[3]) as usize;
                            if m.shape.dtype() == DType::Bool {
                                if m.get::<Bool8>(at).0 == 0 {
                                    continue;
                                }
                            } else {
                                s += m.f64::<T>(at);
                            }
                        }
                        *score = s;
                        max = max.max(s);
                    }
                    let o_row = row(bi, h, i, hq, sq, dv);
                    if max == f64::NEG_INFINITY {
                        for e in 0..dv {
                            out.set(o_row + e, T::from_f64(0.0));
                        }
                        continue;
                    }
                    let mut total = 0.0;
                    for s in scores.iter_mut() {
                        *s = (*s - max).exp();
                        total += *s;
                    }
                    for e in 0..dv {
                        let mut acc = 0.0;
                        for (j, &w) in scores.iter().enumerate() {
                            acc += w * v.f64::<T>(row(bi, kh, j, hkv, sk, dv) + e);
                        }
                        out.set(o_row + e, T::from_f64(acc / total));
                    }
                }
            }
        }
    })
}

pub(crate) fn rope(style: RopeStyle, x: Src, cos: Src, sin: Src, out: Dst) {
    let dims = x.shape.dims();
    let d = dims[dims.len() - 1];
    let half = d / 2;
    let mut half_dims = [0usize; rlx_ir::MAX_RANK];
    half_dims[..dims.len()].copy_from_slice(dims);
    half_dims[dims.len() - 1] = half;
    let half_dims = &half_dims[..dims.len()];
    let cs = broadcast_strides(cos.shape.dims(), half_dims);
    let rows = x.shape.num_elements().checked_div(d).unwrap_or(0);
    with_dtype!(x.shape.dtype(), T => {
        crate::tensor::for_each_strided(half_dims, [&cs], [0], |flat, [c_at]| {
            let (r, i) = (flat / half.max(1), flat % half.max(1));
            debug_assert!(r < rows);
            let (c, s) = (cos.f64::<T>(c_at as usize), sin.f64::<T>(c_at as usize));
            let (ia, ib) = match style {
                RopeStyle::HalfSplit => (r * d + i, r * d + i + half),
                RopeStyle::Interleaved => (r * d + 2 * i, r * d + 2 * i + 1),
            };
            let (a, b) = (x.f64::<T>(ia), x.f64::<T>(ib));
            out.set(ia, T::from_f64(a * c - b * s));
            out.set(ib, T::from_f64(a * s + b * c));
        });
    })
}
