//! Operators of the recurrent layers in state-space and linear-attention models
//! (opset 27): `CausalConvWithState` and `LinearAttention`, each written in
//! primitives, with the carried state as an explicit input and output.

use super::{Converter, size, unsupported};
use crate::import::Cx;
use rlx_ir::{DType, Error, NodeId, Result};

pub(super) const NAMES: &[&str] = &["CausalConvWithState", "LinearAttention"];

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "CausalConvWithState" => causal_conv_with_state,
        "LinearAttention" => linear_attention,
        _ => return None,
    })
}

/// A tensor of zeros: a broadcast scalar, so no declared size is materialized at
/// import.
fn zeros(cx: &Cx, dims: &[usize], dt: DType) -> Result<NodeId> {
    cx.g.expand(cx.g.scalar(0.0, dt), dims)
}

/// Checks that input `i` (named `what`) has dims `want`.
fn expect_dims(cx: &Cx, i: usize, what: &str, want: &[usize]) -> Result<()> {
    let got = cx.dims(i)?;
    if got != want {
        return Err(Error::invalid(
            what,
            format!("dims {got:?}, expected {want:?}"),
        ));
    }
    Ok(())
}

/// `CausalConvWithState`: the carried state (or zeros) joined before the input along
/// time, a depthwise convolution over that with no padding, an optional bias and
/// SiLU; the new state is the last `k - 1` steps of the joined sequence.
fn causal_conv_with_state(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let xd = cx.dims(0)?;
    let wd = cx.dims(1)?;
    let dt = cx.dtype(0)?;
    if xd.len() != 3 {
        return Err(Error::invalid(
            "input",
            format!("dims {xd:?}, expected (batch, channels, length)"),
        ));
    }
    let (b, c, len) = (xd[0], xd[1], xd[2]);
    if wd.len() != 3 || wd[0] != c || wd[1] != 1 || wd[2] == 0 {
        return Err(Error::invalid(
            "weight",
            format!("dims {wd:?}, expected ({c}, 1, k) with k >= 1"),
        ));
    }
    let k = wd[2];
    let activation = cx.attr_s("activation", "none");
    let silu = match activation.as_str() {
        "silu" | "swish" => true,
        "none" => false,
        other => {
            return Err(unsupported(format!(
                "CausalConvWithState activation '{other}' (silu, swish and none are defined)"
            )));
        }
    };
    let x = cx.input(0)?;
    let w = cx.input(1)?;
    let bias = cx.opt_input(2)?;
    if bias.is_some() {
        expect_dims(cx, 2, "bias", &[c])?;
    }
    let joined = if k > 1 {
        let past = match cx.opt_input(3)? {
            Some(p) => {
                expect_dims(cx, 3, "past_state", &[b, c, k - 1])?;
                p
            }
            None => zeros(cx, &[b, c, k - 1], dt)?,
        };
        cx.g.concat(&[past, x], 2)?
    } else {
        x
    };
    let y = cx.g.conv2d(
        cx.g.unsqueeze(joined, &[2])?,
        cx.g.unsqueeze(w, &[2])?,
        bias,
        [1, 1],
        [0; 4],
        [1, 1],
        c,
    )?;
    let mut y = cx.g.squeeze(y, &[2])?;
    if silu {
        y = cx.g.mul(y, cx.g.sigmoid(y)?)?;
    }
    let total = (len + k - 1) as isize;
    let state = if k > 1 {
        cx.g.slice(joined, 2, total - (k as isize - 1), total, 1)?
    } else {
        zeros(cx, &[b, c, 0], dt)?
    };
    Ok(vec![y, state])
}

/// The most time steps `LinearAttention` unrolls to.
const MAX_STEPS: usize = 4096;

/// Which recurrence a `LinearAttention` node runs.
#[derive(Clone, Copy)]
struct Rule {
    /// The state decays by `exp(decay)` each step.
    gated: bool,
    /// The write is the error of the state's own prediction, scaled by `beta`.
    delta: bool,
}

/// `LinearAttention`, unrolled over the time steps: per step, the state
/// `S [B, Hkv, dk, dv]` decays (gated rules), takes the outer product of the step's
/// key and value (for delta rules, of the key and `beta` times the value less what
/// `S` already gives for that key), and is read by the step's queries. Each key/value
/// head serves `Hq / Hkv` consecutive query heads. Computed in `f32`.
fn linear_attention(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let rule = match cx.attr_s("update_rule", "gated_delta").as_str() {
        "linear" => Rule {
            gated: false,
            delta: false,
        },
        "gated" => Rule {
            gated: true,
            delta: false,
        },
        "delta" => Rule {
            gated: false,
            delta: true,
        },
        "gated_delta" => Rule {
            gated: true,
            delta: true,
        },
        other => {
            return Err(unsupported(format!(
                "LinearAttention update_rule '{other}' (linear, gated, delta and gated_delta are defined)"
            )));
        }
    };
    let hq = size(cx.attr_i("q_num_heads", 0), "q_num_heads")?;
    let hkv = size(cx.attr_i("kv_num_heads", 0), "kv_num_heads")?;
    if hq == 0 || hkv == 0 || !hq.is_multiple_of(hkv) {
        return Err(Error::invalid(
            "LinearAttention",
            format!("q_num_heads {hq} must be a positive multiple of kv_num_heads {hkv}"),
        ));
    }
    let (qd, kd, vd) = (cx.dims(0)?, cx.dims(1)?, cx.dims(2)?);
    if qd.len() != 3 || kd.len() != 3 || vd.len() != 3 {
        return Err(Error::invalid(
            "LinearAttention",
            format!("query, key and value must be (B, T, H*D): {qd:?}, {kd:?}, {vd:?}"),
        ));
    }
    let (b, t) = (qd[0], qd[1]);
    if t > MAX_STEPS {
        return Err(unsupported(format!(
            "LinearAttention over {t} steps (it unrolls over time, at most {MAX_STEPS})"
        )));
    }
    if !qd[2].is_multiple_of(hq) || !vd[2].is_multiple_of(hkv) {
        return Err(Error::invalid(
            "LinearAttention",
            format!("query {qd:?} or value {vd:?} does not split into the heads"),
        ));
    }
    let (dk, dv, group) = (qd[2] / hq, vd[2] / hkv, hq / hkv);
    hq.checked_mul(dv)
        .ok_or_else(|| Error::invalid("LinearAttention", "the output width overflows"))?;
    if kd != [b, t, hkv * dk] || vd[..2] != [b, t] {
        return Err(Error::invalid(
            "LinearAttention",
            format!("key {kd:?} or value {vd:?} disagrees with query {qd:?}"),
        ));
    }
    let out_dt = cx.dtype(0)?;
    let f32_of = |cx: &Cx, x: NodeId| -> Result<NodeId> {
        if cx.g.shape(x)?.dtype() == DType::F32 {
            Ok(x)
        } else {
            cx.g.cast(x, DType::F32)
        }
    };
    let (q, k, v) = (cx.input(0)?, cx.input(1)?, cx.input(2)?);
    let (q, k, v) = (f32_of(cx, q)?, f32_of(cx, k)?, f32_of(cx, v)?);
    let state_dims = [b, hkv, dk, dv];
    let (mut state, state_dt) = match cx.opt_input(3)? {
        Some(p) => {
            expect_dims(cx, 3, "past_state", &state_dims)?;
            (f32_of(cx, p)?, cx.dtype(3)?)
        }
        None => (zeros(cx, &state_dims, DType::F32)?, out_dt),
    };
    let decay = cx.opt_input(4)?;
    let beta = cx.opt_input(5)?;
    if decay.is_some() != rule.gated || beta.is_some() != rule.delta {
        return Err(Error::invalid(
            "LinearAttention",
            "decay is given exactly for the gated rules and beta exactly for the delta rules",
        ));
    }
    // Per step, decay reshapes to [B, Hkv, dk or 1, 1] and beta to [B, Hkv or 1, 1, 1].
    let decay = match decay {
        Some(g) => {
            let gd = cx.dims(4)?;
            let per_key = match gd.as_slice() {
                [gb, gt, w] if [*gb, *gt] == [b, t] && *w == hkv * dk => dk,
                [gb, gt, w] if [*gb, *gt] == [b, t] && *w == hkv => 1,
                _ => {
                    return Err(Error::invalid(
                        "decay",
                        format!("dims {gd:?}, expected ({b}, {t}, {hkv} or {})", hkv * dk),
                    ));
                }
            };
            Some((f32_of(cx, g)?, per_key))
        }
        None => None,
    };
    let beta = match beta {
        Some(r) => {
            let rd = cx.dims(5)?;
            let heads = match rd.as_slice() {
                [rb, rt, w] if [*rb, *rt] == [b, t] && (*w == hkv || *w == 1) => *w,
                _ => {
                    return Err(Error::invalid(
                        "beta",
                        format!("dims {rd:?}, expected ({b}, {t}, {hkv} or 1)"),
                    ));
                }
            };
            Some((f32_of(cx, r)?, heads))
        }
        None => None,
    };
    // A scale of 0 (the default) means 1 / sqrt(dk).
    let given = cx.attr_f("scale", 0.0);
    let scale = if given == 0.0 {
        1.0 / (dk as f64).sqrt()
    } else {
        f64::from(given)
    };
    let scale = cx.g.scalar(scale, DType::F32);
    let step = |x: NodeId, i: usize, dims: &[usize]| -> Result<NodeId> {
        let s = cx.g.slice(x, 1, i as isize, i as isize + 1, 1)?;
        cx.g.reshape(s, dims)
    };
    let mut outputs = Vec::with_capacity(t);
    for i in 0..t {
        let k_col = step(k, i, &[b, hkv, dk, 1])?;
        let mut v_row = step(v, i, &[b, hkv, 1, dv])?;
        if let Some((g, per_key)) = decay {
            let g = step(g, i, &[b, hkv, per_key, 1])?;
            state = cx.g.mul(state, cx.g.exp(g)?)?;
        }
        if let Some((r, heads)) = beta {
            let r = step(r, i, &[b, heads, 1, 1])?;
            let k_row = cx.g.reshape(k_col, &[b, hkv, 1, dk])?;
            let predicted = cx.g.matmul(k_row, state)?;
            v_row = cx.g.mul(r, cx.g.sub(v_row, predicted)?)?;
        }
        state = cx.g.add(state, cx.g.mul(k_col, v_row)?)?;
        let q_rows = step(q, i, &[b, hkv, group, dk])?;
        let o = cx.g.mul(cx.g.matmul(q_rows, state)?, scale)?;
        outputs.push(cx.g.reshape(o, &[b, 1, hq * dv])?);
    }
    let mut out = match outputs.as_slice() {
        [] => zeros(cx, &[b, 0, hq * dv], DType::F32)?,
        [one] => *one,
        _ => cx.g.concat(&outputs, 1)?,
    };
    if out_dt != DType::F32 {
        out = cx.g.cast(out, out_dt)?;
    }
    if state_dt != DType::F32 {
        state = cx.g.cast(state, state_dt)?;
    }
    Ok(vec![out, state])
}
