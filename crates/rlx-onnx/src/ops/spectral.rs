//! `DFT` and `STFT` as products with cosine and sine matrices built at import (the
//! transform length is fixed once shapes are), computed in `f64`: a value that is
//! zero in exact arithmetic then comes out within the suite's absolute tolerance.

use super::{Converter, axis, size, unsupported};
use crate::import::Cx;
use rlx_ir::{DType, Error, NodeId, Result, TensorData};

pub(super) const NAMES: &[&str] = &["DFT", "STFT"];

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "DFT" => dft,
        "STFT" => stft,
        _ => return None,
    })
}

/// The largest twiddle matrix built, in elements (a transform of about 4096 points).
const MAX_TWIDDLES: usize = 1 << 24;

/// `[rows, cols]` matrices of `cos` and `sin` of `2 pi r c / n`, reduced mod `n`
/// before the angle is formed.
fn twiddles(cx: &Cx, rows: usize, cols: usize, n: usize) -> Result<(NodeId, NodeId)> {
    if rows.checked_mul(cols).is_none_or(|c| c > MAX_TWIDDLES) {
        return Err(unsupported(format!(
            "a {n}-point transform from {rows} positions (the twiddle matrices would exceed {MAX_TWIDDLES} elements)"
        )));
    }
    let mut cos = Vec::with_capacity(rows * cols);
    let mut sin = Vec::with_capacity(rows * cols);
    for r in 0..rows {
        for c in 0..cols {
            let angle = 2.0 * std::f64::consts::PI * ((r * c) % n) as f64 / n as f64;
            cos.push(angle.cos());
            sin.push(angle.sin());
        }
    }
    Ok((
        cx.g.constant(TensorData::F64(cos), &[rows, cols])?,
        cx.g.constant(TensorData::F64(sin), &[rows, cols])?,
    ))
}

/// `a @ m1 + sign * b @ m2`, where `b` may be absent (zero).
fn combine(
    cx: &Cx,
    a: NodeId,
    m1: NodeId,
    b: Option<NodeId>,
    m2: NodeId,
    sign: f64,
) -> Result<NodeId> {
    let first = cx.g.matmul(a, m1)?;
    let Some(b) = b else { return Ok(first) };
    let second = cx.g.matmul(b, m2)?;
    if sign > 0.0 {
        cx.g.add(first, second)
    } else {
        cx.g.sub(first, second)
    }
}

/// Real and imaginary parts (`[..., 1]` or `[..., 2]` input) as `f64` nodes without
/// the last axis; the imaginary part is `None` for a real signal.
fn parts(cx: &Cx, x: NodeId, dims: &[usize]) -> Result<(NodeId, Option<NodeId>)> {
    let rank = dims.len() as isize;
    let x = cx.g.cast(x, DType::F64)?;
    let re =
        cx.g.squeeze(cx.g.slice(x, rank - 1, 0, 1, 1)?, &[rank - 1])?;
    let im = if dims[dims.len() - 1] == 2 {
        Some(cx.g.squeeze(cx.g.slice(x, rank - 1, 1, 2, 1)?, &[rank - 1])?)
    } else {
        None
    };
    Ok((re, im))
}

/// Puts `[..., 1]` or `[..., 2]` (with the imaginary part) back together in `dt`.
fn assemble(cx: &Cx, re: NodeId, im: Option<NodeId>, dt: DType) -> Result<NodeId> {
    let rank = cx.g.shape(re)?.rank() as isize;
    let re = cx.g.unsqueeze(re, &[rank])?;
    let out = match im {
        Some(im) => {
            let im = cx.g.unsqueeze(im, &[rank])?;
            cx.g.concat(&[re, im], rank)?
        }
        None => re,
    };
    cx.g.cast(out, dt)
}

fn dft(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let xd = cx.dims(0)?;
    let dt = cx.dtype(0)?;
    if xd.len() < 2 || !matches!(xd[xd.len() - 1], 1 | 2) {
        return Err(Error::invalid(
            "DFT",
            format!("input dims {xd:?}: the last axis must hold 1 (real) or 2 (complex) values"),
        ));
    }
    if !matches!(dt, DType::F32 | DType::F64 | DType::F16 | DType::BF16) {
        return Err(unsupported(format!("DFT of {dt} values")));
    }
    let rank = xd.len();
    // Opset 20 takes the axis as an input (default -2), earlier opsets as an
    // attribute (default 1).
    let raw_axis = if cx.opset >= 20 {
        match cx.opt_ints(2)? {
            Some(v) => *v
                .first()
                .ok_or_else(|| Error::invalid("axis", "an empty tensor"))?,
            None => -2,
        }
    } else {
        cx.attr_i("axis", 1)
    };
    let a = axis(raw_axis, rank)?;
    if a == rank - 1 {
        return Err(Error::invalid(
            "axis",
            "the last axis holds the real and imaginary parts and cannot be transformed",
        ));
    }
    let inverse = cx.attr_i("inverse", 0) != 0;
    let onesided = cx.attr_i("onesided", 0) != 0;
    let len = xd[a];
    let n = match cx.opt_ints(1)? {
        Some(v) => size(
            *v.first()
                .ok_or_else(|| Error::invalid("dft_length", "an empty tensor"))?,
            "dft_length",
        )?,
        None if inverse && onesided => 2 * len.saturating_sub(1),
        None => len,
    };
    if n == 0 {
        return Err(Error::invalid(
            "dft_length",
            "the transform length must be positive",
        ));
    }
    let x = cx.input(0)?;
    let (re, im) = parts(cx, x, &xd)?;
    // The transformed axis last.
    let signal_rank = rank - 1;
    let mut perm: Vec<usize> = (0..signal_rank).filter(|&i| i != a).collect();
    perm.push(a);
    let (re, im) = (
        cx.g.permute(re, &perm)?,
        im.map(|i| cx.g.permute(i, &perm)).transpose()?,
    );
    // Rows of the input past the transform length are dropped (zero padding adds
    // nothing); the matrices have one row per used input position.
    let used = len.min(if inverse && onesided { n / 2 + 1 } else { n });
    let take = |v: NodeId| -> Result<NodeId> {
        if used == len {
            Ok(v)
        } else {
            cx.g.slice(v, signal_rank as isize - 1, 0, used as isize, 1)
        }
    };
    let (re, im) = (take(re)?, im.map(take).transpose()?);
    let (out_re, out_im) = if inverse && onesided {
        // A one-sided spectrum of a real signal: each bin but 0 and n/2 stands for
        // itself and its mirror image, and only real parts survive.
        let (cos, sin) = twiddles(cx, used, n, n)?;
        let mut weights = Vec::with_capacity(used);
        for k in 0..used {
            let mirrored = k != 0 && !(n.is_multiple_of(2) && k == n / 2);
            weights.push(if mirrored { 2.0 } else { 1.0 } / n as f64);
        }
        let w = cx.g.constant(TensorData::F64(weights), &[used, 1])?;
        let (cos, sin) = (cx.g.mul(cos, w)?, cx.g.mul(sin, w)?);
        (combine(cx, re, cos, im, sin, -1.0)?, None)
    } else {
        let bins = if onesided && !inverse { n / 2 + 1 } else { n };
        let (cos, sin) = twiddles(cx, used, bins, n)?;
        let (cos, sin) = if inverse {
            let scale = cx.g.scalar(1.0 / n as f64, DType::F64);
            (cx.g.mul(cos, scale)?, cx.g.mul(sin, scale)?)
        } else {
            (cos, sin)
        };
        let sign = if inverse { 1.0 } else { -1.0 };
        // (re + i im)(cos + i sign sin).
        let out_re = combine(cx, re, cos, im, sin, -sign)?;
        let out_im = match im {
            Some(im) => {
                let a =
                    cx.g.mul(cx.g.matmul(re, sin)?, cx.g.scalar(sign, DType::F64))?;
                cx.g.add(a, cx.g.matmul(im, cos)?)?
            }
            None => {
                cx.g.mul(cx.g.matmul(re, sin)?, cx.g.scalar(sign, DType::F64))?
            }
        };
        (out_re, Some(out_im))
    };
    // The transformed axis back in place.
    let mut back = vec![0; signal_rank];
    for (i, &p) in perm.iter().enumerate() {
        back[p] = i;
    }
    let out_re = cx.g.permute(out_re, &back)?;
    let out_im = out_im.map(|i| cx.g.permute(i, &back)).transpose()?;
    Ok(vec![assemble(cx, out_re, out_im, dt)?])
}

fn stft(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let sd = cx.dims(0)?;
    let dt = cx.dtype(0)?;
    if sd.len() != 3 || !matches!(sd[2], 1 | 2) {
        return Err(Error::invalid(
            "signal",
            format!("dims {sd:?}, expected [batch, length, 1 or 2]"),
        ));
    }
    let (batch, len) = (sd[0], sd[1]);
    let step = size(
        *cx.ints(1)?
            .first()
            .ok_or_else(|| Error::invalid("frame_step", "an empty tensor"))?,
        "frame_step",
    )?;
    let window = cx.opt_input(2)?;
    let window_len = match window {
        Some(_) => {
            let wd = cx.dims(2)?;
            if wd.len() != 1 {
                return Err(Error::invalid(
                    "window",
                    format!("dims {wd:?}, expected 1-D"),
                ));
            }
            Some(wd[0])
        }
        None => None,
    };
    let frame = match (cx.opt_ints(3)?, window_len) {
        (Some(v), _) => size(
            *v.first()
                .ok_or_else(|| Error::invalid("frame_length", "an empty tensor"))?,
            "frame_length",
        )?,
        (None, Some(w)) => w,
        // Neither: one frame spans the whole signal.
        (None, None) => len,
    };
    if window_len.is_some_and(|w| w != frame) {
        return Err(Error::invalid(
            "window",
            format!("length {window_len:?} differs from the frame length {frame}"),
        ));
    }
    if step == 0 || frame == 0 || frame > len {
        return Err(Error::invalid(
            "STFT",
            format!("frame length {frame} and step {step} do not fit a signal of {len}"),
        ));
    }
    let frames = (len - frame) / step + 1;
    let onesided = cx.attr_i("onesided", 1) != 0;
    let bins = if onesided { frame / 2 + 1 } else { frame };
    let x = cx.input(0)?;
    let (re, im) = parts(cx, x, &sd)?;
    // Frame f holds positions f * step + t.
    let starts = cx.g.mul(
        cx.g.iota(frames, DType::I64)?,
        cx.g.scalar(step as f64, DType::I64),
    )?;
    let starts = cx.g.reshape(starts, &[frames, 1])?;
    let offsets = cx.g.reshape(cx.g.iota(frame, DType::I64)?, &[1, frame])?;
    let index = cx.g.add(starts, offsets)?;
    let mut re = cx.g.gather(re, index, 1)?;
    let mut im = im.map(|i| cx.g.gather(i, index, 1)).transpose()?;
    if let Some(w) = window {
        let w = cx.g.cast(w, DType::F64)?;
        re = cx.g.mul(re, w)?;
        im = im.map(|i| cx.g.mul(i, w)).transpose()?;
    }
    let (cos, sin) = twiddles(cx, frame, bins, frame)?;
    let out_re = combine(cx, re, cos, im, sin, 1.0)?;
    let minus = cx.g.scalar(-1.0, DType::F64);
    let out_im = match im {
        Some(im) => cx.g.sub(cx.g.matmul(im, cos)?, cx.g.matmul(re, sin)?)?,
        None => cx.g.mul(cx.g.matmul(re, sin)?, minus)?,
    };
    debug_assert_eq!(cx.g.shape(out_re)?.dims(), [batch, frames, bins]);
    Ok(vec![assemble(cx, out_re, Some(out_im), dt)?])
}
