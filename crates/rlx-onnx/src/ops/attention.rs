//! `Attention` (opset 23) and `RotaryEmbedding`, written in primitives: the
//! optimizer's attention fusion turns the common forms back into one kernel.

use super::{Converter, size, unsupported};
use crate::import::Cx;
use rlx_ir::{DType, Error, NodeId, Result, TensorData};

pub(super) const NAMES: &[&str] = &["Attention", "RotaryEmbedding"];

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "Attention" => attention,
        "RotaryEmbedding" => rotary,
        _ => return None,
    })
}

/// `[B, S, H * D]` to `[B, H, S, D]`.
fn split_heads(cx: &Cx, x: NodeId, heads: usize) -> Result<NodeId> {
    let d = cx.g.shape(x)?.dims().to_vec();
    if d.len() != 3 {
        return Err(Error::invalid(
            "Attention",
            format!("3-D Q, K and V expected, found dims {d:?}"),
        ));
    }
    if heads == 0 || !d[2].is_multiple_of(heads) {
        return Err(Error::invalid(
            "Attention",
            format!("hidden size {} is not a multiple of {heads} heads", d[2]),
        ));
    }
    let x = cx.g.reshape(x, &[d[0], d[1], heads, d[2] / heads])?;
    cx.g.permute(x, &[0, 2, 1, 3])
}

/// A `[rows, cols]` additive mask: `-inf` where `j > i + offset`.
fn causal_bias(cx: &Cx, rows: usize, cols: usize, offset: usize, dt: DType) -> Result<NodeId> {
    let v: Vec<f64> = (0..rows * cols)
        .map(|k| {
            if k % cols > k / cols + offset {
                f64::NEG_INFINITY
            } else {
                0.0
            }
        })
        .collect();
    cx.g.constant(TensorData::from_f64(dt, &v), &[rows, cols])
}

/// A boolean mask as an additive one: 0 where true, `-inf` where false.
fn bool_to_bias(cx: &Cx, m: NodeId, dt: DType) -> Result<NodeId> {
    let zero = cx.g.scalar(0.0, dt);
    let ninf = cx.g.scalar(f64::NEG_INFINITY, dt);
    cx.g.select(m, zero, ninf)
}

fn attention(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let qd = cx.dims(0)?;
    let dt = cx.dtype(0)?;
    let rank = qd.len();
    if rank != 3 && rank != 4 {
        return Err(Error::invalid("Attention", format!("Q of rank {rank}")));
    }
    let (mut q, mut k, mut v) = (cx.input(0)?, cx.input(1)?, cx.input(2)?);
    if rank == 3 {
        let hq = size(cx.attr_i("q_num_heads", 0), "q_num_heads")?;
        let hkv = size(cx.attr_i("kv_num_heads", 0), "kv_num_heads")?;
        q = split_heads(cx, q, hq)?;
        k = split_heads(cx, k, hkv)?;
        v = split_heads(cx, v, hkv)?;
    }
    for (name, x) in [("Q", q), ("K", k), ("V", v)] {
        let r = cx.g.shape(x)?.rank();
        if r != 4 {
            return Err(Error::invalid(
                "Attention",
                format!("{name} of rank {r} where Q has rank {rank}"),
            ));
        }
    }
    let qs = cx.g.shape(q)?.dims().to_vec();
    let (batch, hq, sq, head) = (qs[0], qs[1], qs[2], qs[3]);
    let past = cx.opt_input(4)?;
    let past_len = match past {
        Some(p) => match cx.g.shape(p)?.dims() {
            &[_, _, n, _] => n,
            d => {
                return Err(Error::invalid(
                    "Attention",
                    format!("past key of dims {d:?}, not 4-D"),
                ));
            }
        },
        None => 0,
    };
    if let Some(p) = past {
        k = cx.g.concat(&[p, k], 2)?;
    }
    if let Some(p) = cx.opt_input(5)? {
        v = cx.g.concat(&[p, v], 2)?;
    }
    let (present_k, present_v) = (k, v);
    let hkv = cx.g.shape(k)?.dim(1);
    let skv = cx.g.shape(k)?.dim(2);
    // The additive bias on the scores.
    let mut bias: Option<NodeId> = None;
    if let Some(mut m) = cx.opt_input(3)? {
        let md = cx.g.shape(m)?.dims().to_vec();
        let mdt = cx.g.shape(m)?.dtype();
        // A scalar mask broadcasts as it is; a shorter last axis is padded.
        if let Some(&last) = md.last()
            && last < skv
        {
            let mut pads = vec![(0, 0); md.len()];
            pads[md.len() - 1] = (0, skv - last);
            let fill = if mdt == DType::Bool {
                0.0
            } else {
                f64::NEG_INFINITY
            };
            m = cx.g.pad(
                m,
                &pads,
                rlx_ir::PadMode::Constant(rlx_ir::F64Bits::new(fill)),
            )?;
        }
        if mdt == DType::Bool {
            m = bool_to_bias(cx, m, dt)?;
        }
        bias = Some(m);
    }
    if cx.attr_i("is_causal", 0) != 0 {
        let c = causal_bias(cx, sq, skv, past_len, dt)?;
        bias = Some(match bias {
            Some(b) => cx.g.add(b, c)?,
            None => c,
        });
    }
    if let Some(lens) = cx.opt_input(6)? {
        // Keys at or past each batch's length are padding.
        let pos =
            cx.g.constant(TensorData::I64((0..skv as i64).collect()), &[1, skv])?;
        let lens = cx.g.reshape(cx.g.cast(lens, DType::I64)?, &[batch, 1])?;
        let keep = cx.g.lt(pos, lens)?;
        let pad =
            cx.g.reshape(bool_to_bias(cx, keep, dt)?, &[batch, 1, 1, skv])?;
        bias = Some(match bias {
            Some(b) => cx.g.add(b, pad)?,
            None => pad,
        });
    }
    if hq != hkv {
        if hkv == 0 || !hq.is_multiple_of(hkv) {
            return Err(Error::invalid(
                "Attention",
                format!("{hq} query heads over {hkv} key heads"),
            ));
        }
        let reps = hq / hkv;
        let repeat = |x: NodeId| -> Result<NodeId> {
            let d = cx.g.shape(x)?.dims().to_vec();
            let x = cx.g.unsqueeze(x, &[2])?;
            let x = cx.g.expand(x, &[d[0], d[1], reps, d[2], d[3]])?;
            cx.g.reshape(x, &[d[0], d[1] * reps, d[2], d[3]])
        };
        k = repeat(k)?;
        v = repeat(v)?;
    }
    let scale = if cx.has_attr("scale") {
        cx.attr_f("scale", 1.0) as f64
    } else {
        1.0 / (head as f64).sqrt()
    };
    let kt = cx.g.permute(k, &[0, 1, 3, 2])?;
    let mut s = cx.g.mul(cx.g.matmul(q, kt)?, cx.g.scalar(scale, dt))?;
    let softcap = cx.attr_f("softcap", 0.0) as f64;
    if softcap > 0.0 {
        let c = cx.g.scalar(softcap, dt);
        s = cx.g.mul(cx.g.tanh(cx.g.div(s, c)?)?, c)?;
    }
    let capped = s;
    if let Some(b) = bias {
        s = cx.g.add(s, b)?;
    }
    let biased = s;
    let precision = cx.attr_i("softmax_precision", 0);
    let p = if precision != 0 {
        let pdt = crate::tensor::dtype_from_onnx(precision as i32, "softmax_precision")?;
        let p = cx.g.softmax(cx.g.cast(s, pdt)?, -1)?;
        crate::ops::elementwise::cast_to(cx, p, dt)?
    } else {
        cx.g.softmax(s, -1)?
    };
    let mut y = cx.g.matmul(p, v)?;
    if rank == 3 {
        let dv = cx.g.shape(y)?.dim(3);
        y =
            cx.g.reshape(cx.g.permute(y, &[0, 2, 1, 3])?, &[batch, sq, hq * dv])?;
    }
    let qk_out = match cx.attr_i("qk_matmul_output_mode", 0) {
        0 | 1 => capped,
        2 => biased,
        3 => p,
        other => return Err(unsupported(format!("qk_matmul_output_mode {other}"))),
    };
    Ok(vec![y, present_k, present_v, qk_out])
}

fn rotary(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let xd = cx.dims(0)?;
    let rank = xd.len();
    let mut x = cx.input(0)?;
    // Work in [B, S, H, D].
    if rank == 4 {
        x = cx.g.permute(x, &[0, 2, 1, 3])?;
    } else if rank == 3 {
        let heads = size(cx.attr_i("num_heads", 0), "num_heads")?;
        if heads == 0 || !xd[2].is_multiple_of(heads) {
            return Err(Error::invalid(
                "RotaryEmbedding",
                "num_heads must divide the hidden size",
            ));
        }
        x = cx.g.reshape(x, &[xd[0], xd[1], heads, xd[2] / heads])?;
    } else {
        return Err(Error::invalid(
            "RotaryEmbedding",
            format!("input of rank {rank}"),
        ));
    }
    let d = cx.g.shape(x)?.dims().to_vec();
    let head = d[3];
    let rot = match size(cx.attr_i("rotary_embedding_dim", 0), "rotary_embedding_dim")? {
        0 => head,
        r => r,
    };
    if rot > head || rot % 2 != 0 {
        return Err(Error::invalid(
            "RotaryEmbedding",
            format!("rotary dim {rot} for head size {head}"),
        ));
    }
    let (mut cos, mut sin) = (cx.input(1)?, cx.input(2)?);
    if let Some(pos) = cx.opt_input(3)? {
        cos = cx.g.gather(cos, pos, 0)?;
        sin = cx.g.gather(sin, pos, 0)?;
    }
    let cos = cx.g.unsqueeze(cos, &[2])?;
    let sin = cx.g.unsqueeze(sin, &[2])?;
    let xr = cx.g.slice(x, 3, 0, rot as isize, 1)?;
    let interleaved = cx.attr_i("interleaved", 0) != 0;
    let (x1, x2) = if interleaved {
        (
            cx.g.slice(xr, 3, 0, rot as isize, 2)?,
            cx.g.slice(xr, 3, 1, rot as isize, 2)?,
        )
    } else {
        let h = (rot / 2) as isize;
        (
            cx.g.slice(xr, 3, 0, h, 1)?,
            cx.g.slice(xr, 3, h, rot as isize, 1)?,
        )
    };
    let real = cx.g.sub(cx.g.mul(cos, x1)?, cx.g.mul(sin, x2)?)?;
    let imag = cx.g.add(cx.g.mul(sin, x1)?, cx.g.mul(cos, x2)?)?;
    let rotated = if interleaved {
        let r = cx.g.unsqueeze(real, &[-1])?;
        let i = cx.g.unsqueeze(imag, &[-1])?;
        let both = cx.g.concat(&[r, i], -1)?;
        cx.g.reshape(both, &[d[0], d[1], d[2], rot])?
    } else {
        cx.g.concat(&[real, imag], -1)?
    };
    let mut y = if rot < head {
        let rest = cx.g.slice(x, 3, rot as isize, head as isize, 1)?;
        cx.g.concat(&[rotated, rest], -1)?
    } else {
        rotated
    };
    y = if rank == 4 {
        cx.g.permute(y, &[0, 2, 1, 3])?
    } else {
        cx.g.reshape(y, &xd)?
    };
    Ok(vec![y])
}
