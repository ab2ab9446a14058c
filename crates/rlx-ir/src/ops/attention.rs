//! Scaled dot-product attention and rotary position embedding.

use super::{broadcast_source, mismatch, require_float, same_dtype};
use crate::reference::HostTensor;
use crate::shape::broadcast_dims;
use crate::{DType, Error, F64Bits, Graph, NodeId, Op, Result, RopeStyle, Shape};

impl Graph {
    /// Scaled dot-product attention: `softmax(q k^T * scale + mask) v` per head.
    ///
    /// `q [B, Hq, Sq, D]`, `k [B, Hkv, Sk, D]`, `v [B, Hkv, Sk, Dv]` with `Hq` a
    /// multiple of `Hkv` (query head `h` reads key/value head `h / (Hq / Hkv)`).
    /// `mask` broadcasts to `[B, Hq, Sq, Sk]`: a float mask is added to the scores, a
    /// bool mask keeps positions where it is true. `causal` hides keys after the query
    /// (aligned at the end when `Sq < Sk`). `scale` defaults to `1 / sqrt(D)`.
    pub fn attention(
        &self,
        q: NodeId,
        k: NodeId,
        v: NodeId,
        mask: Option<NodeId>,
        causal: bool,
        scale: Option<f64>,
    ) -> Result<NodeId> {
        self.push_attention([q, k, v], mask, causal, scale, false)
    }

    /// [`attention`](Graph::attention) with `q [B, Sq, Hq, D]`, `k [B, Sk, Hkv, D]`,
    /// `v [B, Sk, Hkv, Dv]` and output `[B, Sq, Hq, Dv]`: the layout a linear
    /// projection reshaped into heads already has, so no transposes are needed. The
    /// mask broadcasts to `[B, Hq, Sq, Sk]` as before.
    pub fn attention_seq_major(
        &self,
        q: NodeId,
        k: NodeId,
        v: NodeId,
        mask: Option<NodeId>,
        causal: bool,
        scale: Option<f64>,
    ) -> Result<NodeId> {
        self.push_attention([q, k, v], mask, causal, scale, true)
    }

    fn push_attention(
        &self,
        [q, k, v]: [NodeId; 3],
        mask: Option<NodeId>,
        causal: bool,
        scale: Option<f64>,
        seq_major: bool,
    ) -> Result<NodeId> {
        let d = self.shape(q)?.dims().last().copied().unwrap_or(1);
        let scale = scale.unwrap_or(1.0 / (d.max(1) as f64).sqrt());
        let mut inputs = vec![q, k, v];
        inputs.extend(mask);
        self.push(
            Op::Attention {
                scale: F64Bits::new(scale),
                causal,
                seq_major,
            },
            &inputs,
        )
    }

    /// Causal attention of `Sq` new queries over a key/value cache (see
    /// [`Op::CachedAttention`]): `q [B, Sq, Hq, D]`, `k_cache [B, Smax, Hkv, D]`,
    /// `v_cache [B, Smax, Hkv, Dv]`, and `pos`, a one-element integer tensor holding
    /// the position of the first query. Query `i` sees cache rows `0 ..= pos + i`.
    /// `scale` defaults to `1 / sqrt(D)`.
    pub fn cached_attention(
        &self,
        q: NodeId,
        k_cache: NodeId,
        v_cache: NodeId,
        pos: NodeId,
        scale: Option<f64>,
    ) -> Result<NodeId> {
        let d = self.shape(q)?.dims().last().copied().unwrap_or(1);
        let scale = scale.unwrap_or(1.0 / (d.max(1) as f64).sqrt());
        self.push(
            Op::CachedAttention {
                scale: F64Bits::new(scale),
            },
            &[q, k_cache, v_cache, pos],
        )
    }

    /// Rotary position embedding of `x [..., S, D]` (even `D`) with `cos` and `sin`
    /// of shape `[..., S, D/2]`, broadcast over `x`'s leading dims. Each pair
    /// `(a, b)` becomes `(a cos - b sin, a sin + b cos)`.
    pub fn rope(&self, x: NodeId, cos: NodeId, sin: NodeId, style: RopeStyle) -> Result<NodeId> {
        self.push(Op::Rope { style }, &[x, cos, sin])
    }
}

/// Swaps axes 1 and 2 of a rank-4 shape (other ranks unchanged).
fn swap_seq_heads(s: &Shape) -> Shape {
    if s.rank() == 4 {
        s.with_dims(&[s.dim(0), s.dim(2), s.dim(1), s.dim(3)])
    } else {
        s.clone()
    }
}

pub(crate) fn infer_attention(inputs: &[&Shape], seq_major: bool) -> Result<Shape> {
    if seq_major {
        let swapped: Vec<Shape> = inputs[..3].iter().map(|s| swap_seq_heads(s)).collect();
        let mut all: Vec<&Shape> = swapped.iter().collect();
        all.extend(inputs.get(3).copied());
        return infer_attention(&all, false).map(|out| swap_seq_heads(&out));
    }
    let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
    require_float("attention", q)?;
    same_dtype("attention", q, k)?;
    same_dtype("attention", q, v)?;
    for (what, s) in [("q", q), ("k", k), ("v", v)] {
        if s.rank() != 4 {
            return Err(Error::invalid(
                "attention",
                format!("{what} must be [B, H, S, D], got {s}"),
            ));
        }
    }
    let [b, hq, sq, d] = [q.dim(0), q.dim(1), q.dim(2), q.dim(3)];
    if k.dim(0) != b || k.dim(3) != d {
        return Err(mismatch(
            "attention",
            q,
            k,
            "batch and head size must agree",
        ));
    }
    let (hkv, sk) = (k.dim(1), k.dim(2));
    if v.dim(0) != b || v.dim(1) != hkv || v.dim(2) != sk {
        return Err(mismatch(
            "attention",
            k,
            v,
            "v must be [B, Hkv, Sk, Dv] matching k",
        ));
    }
    if hkv == 0 || hq % hkv != 0 {
        return Err(mismatch(
            "attention",
            q,
            k,
            format!("{hq} query heads are not a multiple of {hkv} key/value heads"),
        ));
    }
    if let Some(m) = inputs.get(3) {
        let full = [b, hq, sq, sk];
        if m.rank() > 4 || broadcast_dims(m.dims(), &full).as_deref() != Some(&full[..]) {
            return Err(mismatch(
                "attention",
                q,
                m,
                format!("mask must broadcast to {full:?}"),
            ));
        }
        if m.dtype() != DType::Bool && m.dtype() != q.dtype() {
            return Err(Error::dtype(
                "attention (mask)",
                format!("bool or {}", q.dtype()),
                m.dtype(),
            ));
        }
    }
    Ok(q.with_dims(&[b, hq, sq, v.dim(3)]))
}

pub(crate) fn infer_rope(x: &Shape, cos: &Shape, sin: &Shape) -> Result<Shape> {
    require_float("rope", x)?;
    same_dtype("rope", x, cos)?;
    same_dtype("rope", x, sin)?;
    if x.rank() < 2 || !x.dims()[x.rank() - 1].is_multiple_of(2) {
        return Err(Error::invalid(
            "rope",
            format!("x must be [..., S, D] with even D, got {x}"),
        ));
    }
    let mut half = x.dims().to_vec();
    let last = half.len() - 1;
    half[last] /= 2;
    for t in [cos, sin] {
        if t.rank() > x.rank() || broadcast_dims(t.dims(), &half).as_deref() != Some(&half[..]) {
            return Err(mismatch(
                "rope",
                x,
                t,
                format!("cos/sin must broadcast to {half:?}"),
            ));
        }
    }
    if cos.dims() != sin.dims() {
        return Err(mismatch(
            "rope",
            cos,
            sin,
            "cos and sin must have the same shape",
        ));
    }
    Ok(x.clone())
}

pub(crate) fn eval_attention(
    scale: f64,
    causal: bool,
    seq_major: bool,
    inputs: &[&HostTensor],
    out: &Shape,
) -> HostTensor {
    if seq_major {
        let swap = |t: &HostTensor| {
            super::shape_ops::eval_permute(&[0, 2, 1, 3], t, &swap_seq_heads(&t.shape))
        };
        let swapped: Vec<HostTensor> = inputs[..3].iter().map(|t| swap(t)).collect();
        let mut all: Vec<&HostTensor> = swapped.iter().collect();
        all.extend(inputs.get(3).copied());
        let head_major = eval_attention(scale, causal, false, &all, &swap_seq_heads(out));
        return swap(&head_major);
    }
    let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
    let [b, hq, sq, d] = [
        q.shape.dim(0),
        q.shape.dim(1),
        q.shape.dim(2),
        q.shape.dim(3),
    ];
    let (hkv, sk, dv) = (k.shape.dim(1), k.shape.dim(2), v.shape.dim(3));
    let group = hq / hkv;
    let mut data = vec![0.0; out.num_elements()];
    for bi in 0..b {
        for h in 0..hq {
            let kh = h / group;
            for i in 0..sq {
                let mut scores = vec![f64::NEG_INFINITY; sk];
                for (j, score) in scores.iter_mut().enumerate() {
                    if causal && j + sq > i + sk {
                        continue;
                    }
                    let mut s = 0.0;
                    for p in 0..d {
                        s += q.data[((bi * hq + h) * sq + i) * d + p]
                            * k.data[((bi * hkv + kh) * sk + j) * d + p];
                    }
                    s *= scale;
                    if let Some(m) = inputs.get(3) {
                        let mv = m.data[broadcast_source(&[bi, h, i, j], m.shape.dims())];
                        if m.shape.dtype() == DType::Bool {
                            if mv == 0.0 {
                                continue;
                            }
                        } else {
                            s += mv;
                        }
                    }
                    *score = s;
                }
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                if max == f64::NEG_INFINITY {
                    continue;
                }
                let weights: Vec<f64> = scores.iter().map(|&s| (s - max).exp()).collect();
                let total: f64 = weights.iter().sum();
                for e in 0..dv {
                    let acc: f64 = (0..sk)
                        .map(|j| weights[j] * v.data[((bi * hkv + kh) * sk + j) * dv + e])
                        .sum();
                    data[((bi * hq + h) * sq + i) * dv + e] = out.dtype().round_value(acc / total);
                }
            }
        }
    }
    HostTensor::new(out.clone(), data)
}

pub(crate) fn eval_rope(
    style: RopeStyle,
    x: &HostTensor,
    cos: &HostTensor,
    sin: &HostTensor,
) -> HostTensor {
    let dims = x.shape.dims();
    let d = dims[dims.len() - 1];
    let half = d / 2;
    let mut half_dims = dims.to_vec();
    let last = half_dims.len() - 1;
    half_dims[last] = half;
    let mut data = x.data.clone();
    let rows = x.data.len().checked_div(d).unwrap_or(0);
    for r in 0..rows {
        for i in 0..half {
            let idx = super::unravel(r * half + i, &half_dims);
            let c = cos.data[broadcast_source(&idx, cos.shape.dims())];
            let s = sin.data[broadcast_source(&idx, sin.shape.dims())];
            let (ia, ib) = match style {
                RopeStyle::HalfSplit => (r * d + i, r * d + i + half),
                RopeStyle::Interleaved => (r * d + 2 * i, r * d + 2 * i + 1),
            };
            let (a, b) = (x.data[ia], x.data[ib]);
            data[ia] = x.shape.dtype().round_value(a * c - b * s);
            data[ib] = x.shape.dtype().round_value(a * s + b * c);
        }
    }
    HostTensor::new(x.shape.clone(), data)
}

pub(crate) fn infer_cached_attention(inputs: &[&Shape]) -> Result<Shape> {
    let (q, k, v, pos) = (inputs[0], inputs[1], inputs[2], inputs[3]);
    super::require_int("cached_attention", "position", pos)?;
    if pos.num_elements() != 1 {
        return Err(Error::invalid(
            "cached_attention",
            format!("position must hold one element, got {pos}"),
        ));
    }
    let out = infer_attention(&[q, k, v], true)?;
    if q.dim(1) > k.dim(1) {
        return Err(mismatch(
            "cached_attention",
            q,
            k,
            "more new queries than cache rows",
        ));
    }
    Ok(out)
}

pub(crate) fn eval_cached_attention(
    scale: f64,
    inputs: &[&HostTensor],
    out: &Shape,
) -> Result<HostTensor> {
    let (q, k, v) = (inputs[0], inputs[1], inputs[2]);
    let [sq, smax] = [q.shape.dim(1), k.shape.dim(1)];
    let pos = super::state::checked_position("cached_attention", inputs[3].data[0], sq, smax)?;
    let len = pos + sq;
    let prefix = |t: &HostTensor| {
        let axes = (0..4)
            .map(|a| crate::SliceAxis {
                start: 0,
                len: if a == 1 { len } else { t.shape.dim(a) },
                step: 1,
            })
            .collect::<Vec<_>>();
        let mut dims = t.shape.dims().to_vec();
        dims[1] = len;
        let shape = Shape::new(&dims, t.shape.dtype());
        super::shape_ops::eval_slice(&axes, t, &shape)
    };
    let (k, v) = (prefix(k), prefix(v));
    Ok(eval_attention(scale, true, true, &[q, &k, &v], out))
}
