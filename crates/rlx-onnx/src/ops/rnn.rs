//! Recurrent layers (`LSTM`, `GRU`, `RNN`), unrolled over the sequence at import. The
//! input projection of every step is one matrix product; each step then adds the
//! recurrent product and applies the gate activations.

use super::{Converter, size, unsupported};
use crate::import::Cx;
use rlx_ir::{BinaryOp, Error, NodeId, Result, UnaryOp};

pub(super) const NAMES: &[&str] = &["GRU", "LSTM", "RNN"];

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "LSTM" => |cx| recurrent(cx, Cell::Lstm),
        "GRU" => |cx| recurrent(cx, Cell::Gru),
        "RNN" => |cx| recurrent(cx, Cell::Rnn),
        _ => return None,
    })
}

#[derive(Clone, Copy, PartialEq)]
enum Cell {
    Lstm,
    Gru,
    Rnn,
}

impl Cell {
    /// Gate blocks in `W` and `R`.
    fn gates(self) -> usize {
        match self {
            Cell::Lstm => 4,
            Cell::Gru => 3,
            Cell::Rnn => 1,
        }
    }

    /// Default activations per direction.
    fn default_activations(self) -> &'static [&'static str] {
        match self {
            Cell::Lstm => &["Sigmoid", "Tanh", "Tanh"],
            Cell::Gru => &["Sigmoid", "Tanh"],
            Cell::Rnn => &["Tanh"],
        }
    }
}

/// An activation named in the `activations` attribute.
#[derive(Clone, Copy)]
enum Act {
    Unary(UnaryOp),
    HardSigmoid(f64, f64),
    LeakyRelu(f64),
    Affine(f64, f64),
}

fn apply(cx: &Cx, act: Act, x: NodeId) -> Result<NodeId> {
    let dt = cx.g.shape(x)?.dtype();
    match act {
        Act::Unary(u) => cx.g.unary(u, x),
        Act::HardSigmoid(a, b) => {
            let y =
                cx.g.add(cx.g.mul(x, cx.g.scalar(a, dt))?, cx.g.scalar(b, dt))?;
            let y = cx.g.binary(BinaryOp::Max, y, cx.g.scalar(0.0, dt))?;
            cx.g.binary(BinaryOp::Min, y, cx.g.scalar(1.0, dt))
        }
        Act::LeakyRelu(a) => {
            let neg = cx.g.lt(x, cx.g.scalar(0.0, dt))?;
            cx.g.select(neg, cx.g.mul(x, cx.g.scalar(a, dt))?, x)
        }
        Act::Affine(a, b) => {
            cx.g.add(cx.g.mul(x, cx.g.scalar(a, dt))?, cx.g.scalar(b, dt))
        }
    }
}

fn activations(cx: &Cx, cell: Cell, dirs: usize) -> Result<Vec<Act>> {
    let names: Vec<String> = match cx.attr_strings("activations") {
        Some(v) if !v.is_empty() => v,
        _ => {
            let d = cell.default_activations();
            (0..dirs)
                .flat_map(|_| d.iter().map(|s| s.to_string()))
                .collect()
        }
    };
    let alphas = cx.attr_floats("activation_alpha").unwrap_or_default();
    let betas = cx.attr_floats("activation_beta").unwrap_or_default();
    let (mut ai, mut bi) = (0, 0);
    let next = |list: &[f32], i: &mut usize, default: f64| {
        let v = list.get(*i).map_or(default, |&x| x as f64);
        *i += 1;
        v
    };
    names
        .iter()
        .map(|n| {
            Ok(match n.to_ascii_lowercase().as_str() {
                "sigmoid" => Act::Unary(UnaryOp::Sigmoid),
                "tanh" => Act::Unary(UnaryOp::Tanh),
                "relu" => Act::Unary(UnaryOp::Relu),
                "hardsigmoid" => {
                    let a = next(&alphas, &mut ai, 0.2);
                    Act::HardSigmoid(a, next(&betas, &mut bi, 0.5))
                }
                "leakyrelu" => Act::LeakyRelu(next(&alphas, &mut ai, 0.01)),
                "affine" => {
                    let a = next(&alphas, &mut ai, 1.0);
                    Act::Affine(a, next(&betas, &mut bi, 0.0))
                }
                other => return Err(unsupported(format!("recurrent activation '{other}'"))),
            })
        })
        .collect()
}

/// Columns `[k * h, (k + 1) * h)` of the last axis.
fn block(cx: &Cx, x: NodeId, k: usize, h: usize) -> Result<NodeId> {
    let rank = cx.g.shape(x)?.rank() as isize;
    cx.g.slice(x, rank - 1, (k * h) as isize, ((k + 1) * h) as isize, 1)
}

/// Row `d` of a per-direction tensor `[dirs, ...]`, without that axis.
fn direction(cx: &Cx, x: NodeId, d: usize) -> Result<NodeId> {
    let piece = cx.g.slice(x, 0, d as isize, d as isize + 1, 1)?;
    cx.g.squeeze(piece, &[0])
}

fn clip(cx: &Cx, x: NodeId, limit: Option<f64>) -> Result<NodeId> {
    match limit {
        None => Ok(x),
        Some(c) => {
            let dt = cx.g.shape(x)?.dtype();
            let y = cx.g.binary(BinaryOp::Max, x, cx.g.scalar(-c, dt))?;
            cx.g.binary(BinaryOp::Min, y, cx.g.scalar(c, dt))
        }
    }
}

fn recurrent(cx: &mut Cx, cell: Cell) -> Result<Vec<NodeId>> {
    let layout = cx.attr_i("layout", 0);
    let mut x = cx.input(0)?;
    if layout != 0 {
        x = cx.g.permute(x, &[1, 0, 2])?;
    }
    let xd = cx.g.shape(x)?.dims().to_vec();
    if xd.len() != 3 {
        return Err(Error::invalid(
            "recurrent",
            format!("X must be 3-D, got {xd:?}"),
        ));
    }
    let (seq, batch, input) = (xd[0], xd[1], xd[2]);
    let dt = cx.dtype(0)?;
    let h = size(cx.attr_i("hidden_size", 0), "hidden_size")?;
    let wd = cx.dims(1)?;
    let dirs = wd.first().copied().unwrap_or(0); // a W of rank 0 fails the check below
    let g = cell.gates();
    if wd != [dirs, g * h, input] || h == 0 {
        return Err(Error::invalid(
            "recurrent",
            format!("W {wd:?} for hidden size {h} and input {input}"),
        ));
    }
    let mode = cx.attr_s("direction", "forward");
    let reverse_dirs: Vec<bool> = match (mode.as_str(), dirs) {
        ("forward", 1) => vec![false],
        ("reverse", 1) => vec![true],
        ("bidirectional", 2) => vec![false, true],
        _ => {
            return Err(Error::invalid(
                "recurrent",
                format!("direction '{mode}' with {dirs} weight sets"),
            ));
        }
    };
    if cx.has(4) {
        // Per-batch lengths change which steps count; only full lengths are supported.
        let lens = cx
            .known(4)
            .ok_or_else(|| unsupported("run-time sequence_lens"))?;
        if lens.to_i64_vec().iter().any(|&l| l != seq as i64) {
            return Err(unsupported("sequence_lens shorter than the sequence"));
        }
    }
    if cx.attr_i("input_forget", 0) != 0 {
        return Err(unsupported("LSTM input_forget"));
    }
    let acts = activations(cx, cell, dirs)?;
    let per_dir = cell.default_activations().len();
    if acts.len() != per_dir * dirs {
        return Err(Error::invalid(
            "recurrent",
            format!("{} activations for {dirs} directions", acts.len()),
        ));
    }
    let limit = cx.has_attr("clip").then(|| cx.attr_f("clip", 0.0) as f64);
    let linear_before_reset = cx.attr_i("linear_before_reset", 0) != 0;
    let (w, r) = (cx.input(1)?, cx.input(2)?);
    let b = cx.opt_input(3)?;
    let h0 = cx.opt_input(5)?;
    let c0 = if cell == Cell::Lstm {
        cx.opt_input(6)?
    } else {
        None
    };
    let peep = if cell == Cell::Lstm {
        cx.opt_input(7)?
    } else {
        None
    };
    let zeros = cx.g.constant(
        rlx_ir::TensorData::from_f64(dt, &vec![0.0; batch * h]),
        &[batch, h],
    )?;
    let mut ys = Vec::with_capacity(dirs);
    let mut hs = Vec::with_capacity(dirs);
    let mut cs = Vec::with_capacity(dirs);
    let flat_x = cx.g.reshape(x, &[seq * batch, input])?;
    for (d, &rev) in reverse_dirs.iter().enumerate() {
        let act = &acts[d * per_dir..(d + 1) * per_dir];
        let wt = cx.g.permute(direction(cx, w, d)?, &[1, 0])?; // [input, g*h]
        let rt = cx.g.permute(direction(cx, r, d)?, &[1, 0])?; // [h, g*h]
        let mut xw = cx.g.matmul(flat_x, wt)?; // [seq*batch, g*h]
        let (wb, rb) = match b {
            Some(b) => {
                let bd = direction(cx, b, d)?;
                (
                    Some(block2(cx, bd, 0, g * h)?),
                    Some(block2(cx, bd, 1, g * h)?),
                )
            }
            None => (None, None),
        };
        if let Some(wb) = wb {
            xw = cx.g.add(xw, wb)?;
        }
        // LSTM and RNN add R's bias like W's; GRU keeps it per gate.
        let rb = match rb {
            Some(rb) if cell != Cell::Gru => {
                xw = cx.g.add(xw, rb)?;
                None
            }
            other => other,
        };
        let xw = cx.g.reshape(xw, &[seq, batch, g * h])?;
        let mut hprev = match h0 {
            Some(h0) => direction(cx, h0, d)?,
            None => zeros,
        };
        let mut cprev = match c0 {
            Some(c0) => direction(cx, c0, d)?,
            None => zeros,
        };
        let p = match peep {
            Some(p) => Some(direction(cx, p, d)?),
            None => None,
        };
        let mut outs = vec![zeros; seq];
        for step in 0..seq {
            let t = if rev { seq - 1 - step } else { step };
            let xt =
                cx.g.squeeze(cx.g.slice(xw, 0, t as isize, t as isize + 1, 1)?, &[0])?;
            let hr = cx.g.matmul(hprev, rt)?; // [batch, g*h]
            match cell {
                Cell::Rnn => {
                    let mut z = cx.g.add(xt, hr)?;
                    if let Some(rb) = rb {
                        z = cx.g.add(z, rb)?;
                    }
                    hprev = apply(cx, act[0], clip(cx, z, limit)?)?;
                }
                Cell::Lstm => {
                    let mut z = cx.g.add(xt, hr)?;
                    if let Some(rb) = rb {
                        z = cx.g.add(z, rb)?;
                    }
                    let (mut zi, zo, mut zf, zc) = (
                        block(cx, z, 0, h)?,
                        block(cx, z, 1, h)?,
                        block(cx, z, 2, h)?,
                        block(cx, z, 3, h)?,
                    );
                    if let Some(p) = p {
                        zi = cx.g.add(zi, cx.g.mul(block(cx, p, 0, h)?, cprev)?)?;
                        zf = cx.g.add(zf, cx.g.mul(block(cx, p, 2, h)?, cprev)?)?;
                    }
                    let i = apply(cx, act[0], clip(cx, zi, limit)?)?;
                    let f = apply(cx, act[0], clip(cx, zf, limit)?)?;
                    let c = apply(cx, act[1], clip(cx, zc, limit)?)?;
                    let ct = cx.g.add(cx.g.mul(f, cprev)?, cx.g.mul(i, c)?)?;
                    let mut zo = zo;
                    if let Some(p) = p {
                        zo = cx.g.add(zo, cx.g.mul(block(cx, p, 1, h)?, ct)?)?;
                    }
                    let o = apply(cx, act[0], clip(cx, zo, limit)?)?;
                    hprev = cx.g.mul(o, apply(cx, act[2], ct)?)?;
                    cprev = ct;
                }
                Cell::Gru => {
                    let (xz, xr, xh) = (
                        block(cx, xt, 0, h)?,
                        block(cx, xt, 1, h)?,
                        block(cx, xt, 2, h)?,
                    );
                    let (mut hz, mut hrr) = (block(cx, hr, 0, h)?, block(cx, hr, 1, h)?);
                    let rbh = match rb {
                        Some(rb) => {
                            hz = cx.g.add(hz, block(cx, rb, 0, h)?)?;
                            hrr = cx.g.add(hrr, block(cx, rb, 1, h)?)?;
                            Some(block(cx, rb, 2, h)?)
                        }
                        None => None,
                    };
                    let zt = apply(cx, act[0], clip(cx, cx.g.add(xz, hz)?, limit)?)?;
                    let rt_ = apply(cx, act[0], clip(cx, cx.g.add(xr, hrr)?, limit)?)?;
                    let rh = if linear_before_reset {
                        let mut hh = block(cx, hr, 2, h)?;
                        if let Some(rbh) = rbh {
                            hh = cx.g.add(hh, rbh)?;
                        }
                        cx.g.mul(rt_, hh)?
                    } else {
                        let rh = block(cx, rt, 2, h)?;
                        let mut hh = cx.g.matmul(cx.g.mul(rt_, hprev)?, rh)?;
                        if let Some(rbh) = rbh {
                            hh = cx.g.add(hh, rbh)?;
                        }
                        hh
                    };
                    let ht = apply(cx, act[1], clip(cx, cx.g.add(xh, rh)?, limit)?)?;
                    let one = cx.g.scalar(1.0, dt);
                    let keep = cx.g.mul(zt, hprev)?;
                    hprev = cx.g.add(cx.g.mul(cx.g.sub(one, zt)?, ht)?, keep)?;
                }
            }
            outs[t] = hprev;
        }
        let stacked: Vec<NodeId> = outs
            .iter()
            .map(|&o| cx.g.unsqueeze(o, &[0]))
            .collect::<Result<_>>()?;
        ys.push(cx.g.concat(&stacked, 0)?); // [seq, batch, h]
        hs.push(cx.g.unsqueeze(hprev, &[0])?);
        cs.push(cx.g.unsqueeze(cprev, &[0])?);
    }
    let ys: Vec<NodeId> = ys
        .iter()
        .map(|&y| cx.g.unsqueeze(y, &[1]))
        .collect::<Result<_>>()?;
    let mut y = cx.g.concat(&ys, 1)?; // [seq, dirs, batch, h]
    let mut yh = cx.g.concat(&hs, 0)?; // [dirs, batch, h]
    let mut yc = cx.g.concat(&cs, 0)?;
    if layout != 0 {
        y = cx.g.permute(y, &[2, 0, 1, 3])?;
        yh = cx.g.permute(yh, &[1, 0, 2])?;
        yc = cx.g.permute(yc, &[1, 0, 2])?;
    }
    Ok(match cell {
        Cell::Lstm => vec![y, yh, yc],
        _ => vec![y, yh],
    })
}

/// Half `k` (0 or 1) of a bias row `[2 * n]`.
fn block2(cx: &Cx, b: NodeId, k: usize, n: usize) -> Result<NodeId> {
    cx.g.slice(b, 0, (k * n) as isize, ((k + 1) * n) as isize, 1)
}
