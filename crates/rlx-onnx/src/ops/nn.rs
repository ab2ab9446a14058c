//! Neural-network operators: products, convolution and pooling, normalizations,
//! softmax, dropout.

use super::{Converter, axis, size, unsupported};
use crate::import::Cx;
use rlx_ir::{ArgReduceOp, DType, Error, NodeId, Op, ReduceOp, Result, Window2d};

pub(super) const NAMES: &[&str] = &[
    "AveragePool",
    "BatchNormalization",
    "Conv",
    "ConvTranspose",
    "Dropout",
    "Gemm",
    "GlobalAveragePool",
    "GlobalMaxPool",
    "GroupNormalization",
    "Hardmax",
    "InstanceNormalization",
    "LayerNormalization",
    "LogSoftmax",
    "LRN",
    "LpNormalization",
    "LpPool",
    "GlobalLpPool",
    "MatMul",
    "MaxPool",
    "MeanVarianceNormalization",
    "RMSNormalization",
    "Softmax",
];

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "MatMul" => |cx| {
            let (a, b) = (cx.input(0)?, cx.input(1)?);
            Ok(vec![cx.g.matmul(a, b)?])
        },
        "Gemm" => gemm,
        "Softmax" => |cx| softmax(cx, Soft::Softmax),
        "LogSoftmax" => |cx| softmax(cx, Soft::LogSoftmax),
        "Hardmax" => |cx| softmax(cx, Soft::Hardmax),
        "Conv" => conv,
        "ConvTranspose" => conv_transpose,
        "MaxPool" => |cx| pool(cx, PoolKind::Max),
        "AveragePool" => |cx| pool(cx, PoolKind::Avg),
        "LpPool" => |cx| {
            let p = lp_order(cx)?;
            pool(cx, PoolKind::Lp(p))
        },
        "GlobalLpPool" => global_lp_pool,
        "GlobalAveragePool" => |cx| global_pool(cx, ReduceOp::Mean),
        "GlobalMaxPool" => |cx| global_pool(cx, ReduceOp::Max),
        "BatchNormalization" => batch_norm,
        "InstanceNormalization" => instance_norm,
        "LayerNormalization" => layer_norm,
        "RMSNormalization" => rms_norm,
        "GroupNormalization" => group_norm,
        "LpNormalization" => lp_norm,
        "LRN" => lrn,
        "MeanVarianceNormalization" => mvn,
        "Dropout" => dropout,
        _ => return None,
    })
}

fn scalar(cx: &Cx, v: f64, dt: DType) -> NodeId {
    cx.g.scalar(v, dt)
}

fn gemm(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let dt = cx.dtype(0)?;
    let a = if cx.attr_i("transA", 0) != 0 {
        cx.input_transposed(0)?
    } else {
        cx.input(0)?
    };
    let b = if cx.attr_i("transB", 0) != 0 {
        cx.input_transposed(1)?
    } else {
        cx.input(1)?
    };
    let alpha = cx.attr_f("alpha", 1.0) as f64;
    let beta = cx.attr_f("beta", 1.0) as f64;
    let mut y = cx.g.matmul(a, b)?;
    if alpha != 1.0 {
        y = cx.g.mul(y, scalar(cx, alpha, dt))?;
    }
    if let Some(c) = cx.opt_input(2)? {
        let c = if beta != 1.0 {
            cx.g.mul(c, scalar(cx, beta, dt))?
        } else {
            c
        };
        y = cx.g.add(y, c)?;
    }
    Ok(vec![y])
}

#[derive(Clone, Copy, PartialEq)]
enum Soft {
    Softmax,
    LogSoftmax,
    Hardmax,
}

fn softmax(cx: &mut Cx, kind: Soft) -> Result<Vec<NodeId>> {
    let dims = cx.dims(0)?;
    let rank = dims.len();
    let x = cx.input(0)?;
    let apply = |x: NodeId, a: usize| -> Result<NodeId> {
        match kind {
            Soft::Softmax => cx.g.softmax(x, a as isize),
            Soft::LogSoftmax => cx.g.log_softmax(x, a as isize),
            Soft::Hardmax => {
                let s = cx.g.shape(x)?;
                let idx = cx.g.push(
                    Op::ArgReduce {
                        op: ArgReduceOp::ArgMax,
                        axis: a,
                        keepdims: false,
                    },
                    &[x],
                )?;
                let hot = cx.g.one_hot(idx, s.dim(a), s.dtype())?;
                if a + 1 == s.rank() {
                    return Ok(hot);
                }
                let mut perm: Vec<usize> = (0..s.rank() - 1).collect();
                perm.insert(a, s.rank() - 1);
                cx.g.permute(hot, &perm)
            }
        }
    };
    if cx.opset >= 13 {
        let a = axis(cx.attr_i("axis", -1), rank)?;
        return Ok(vec![apply(x, a)?]);
    }
    // Before opset 13 the input is seen as 2-D: [prod(dims[..axis]), prod(dims[axis..])].
    let a = axis(cx.attr_i("axis", 1), rank.max(1))?;
    let outer: usize = dims[..a].iter().product();
    let inner: usize = dims[a..].iter().product();
    let flat = cx.g.reshape(x, &[outer, inner])?;
    let y = apply(flat, 1)?;
    Ok(vec![cx.g.reshape(y, &dims)?])
}

/// The extent of a window of `kernel` taps `dilation` apart, or an error when a
/// size is zero or the extent overflows.
fn window_span(kernel: usize, dilation: usize) -> Result<usize> {
    if kernel == 0 || dilation == 0 {
        return Err(Error::invalid(
            "kernel_shape",
            format!("kernel {kernel} with dilation {dilation}: both must be at least 1"),
        ));
    }
    (kernel - 1)
        .checked_mul(dilation)
        .and_then(|s| s.checked_add(1))
        .ok_or_else(|| Error::invalid("kernel_shape", "window extent overflows"))
}

/// `(begin, end)` padding per spatial axis from `pads`/`auto_pad`. Strides and
/// dilations of zero, and windows whose extent overflows, are errors.
fn spatial_pads(
    cx: &Cx,
    input: &[usize],
    kernel: &[usize],
    strides: &[usize],
    dilations: &[usize],
) -> Result<Vec<(usize, usize)>> {
    let n = input.len();
    if strides.contains(&0) {
        return Err(Error::invalid(
            "strides",
            format!("{strides:?}: every stride must be at least 1"),
        ));
    }
    for i in 0..n {
        window_span(kernel[i], dilations[i])?;
    }
    let auto = cx.attr_s("auto_pad", "NOTSET");
    match auto.as_str() {
        "NOTSET" => {
            let pads = cx.attr_ints("pads").unwrap_or_else(|| vec![0; 2 * n]);
            if pads.len() != 2 * n {
                return Err(Error::invalid(
                    "pads",
                    format!("{} values for {n} axes", pads.len()),
                ));
            }
            (0..n)
                .map(|i| Ok((size(pads[i], "pads")?, size(pads[i + n], "pads")?)))
                .collect()
        }
        "VALID" => Ok(vec![(0, 0); n]),
        "SAME_UPPER" | "SAME_LOWER" => Ok((0..n)
            .map(|i| {
                let out = input[i].div_ceil(strides[i]);
                let span = (kernel[i] - 1) * dilations[i] + 1;
                let total = out
                    .saturating_sub(1)
                    .saturating_mul(strides[i])
                    .saturating_add(span)
                    .saturating_sub(input[i]);
                let small = total / 2;
                if auto == "SAME_UPPER" {
                    (small, total - small)
                } else {
                    (total - small, small)
                }
            })
            .collect()),
        other => Err(unsupported(format!("auto_pad '{other}'"))),
    }
}

fn attr_sizes(cx: &Cx, name: &str, n: usize, default: usize) -> Result<Vec<usize>> {
    match cx.attr_ints(name) {
        Some(v) if v.len() == n => v.iter().map(|&d| size(d, name)).collect(),
        Some(v) => Err(Error::invalid(
            name,
            format!("{} values for {n} spatial axes", v.len()),
        )),
        None => Ok(vec![default; n]),
    }
}

/// Lifts a 1-D spatial tensor `[N, C, W]` to `[N, C, 1, W]`.
fn lift_1d(cx: &Cx, x: NodeId) -> Result<NodeId> {
    cx.g.unsqueeze(x, &[2])
}

fn conv(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let x = cx.input(0)?;
    let w = cx.input(1)?;
    let bias = cx.opt_input(2)?;
    Ok(vec![conv_nodes(cx, x, w, bias)?])
}

/// A convolution of `x` by `w` with the node's `Conv` attributes (1-D, 2-D or
/// 3-D).
pub(super) fn conv_nodes(
    cx: &Cx,
    mut x: NodeId,
    mut w: NodeId,
    bias: Option<NodeId>,
) -> Result<NodeId> {
    let xd = cx.g.shape(x)?.dims().to_vec();
    let wd = cx.g.shape(w)?.dims().to_vec();
    if xd.len() != wd.len() || !(3..=5).contains(&xd.len()) {
        return Err(unsupported(format!(
            "Conv of a {}-D input with a {}-D weight (1-D, 2-D and 3-D convolutions are supported)",
            xd.len(),
            wd.len()
        )));
    }
    let n = xd.len() - 2;
    let kernel = wd[2..].to_vec();
    if let Some(k) = cx.attr_ints("kernel_shape")
        && k.iter().map(|&v| v as usize).collect::<Vec<_>>() != kernel
    {
        return Err(Error::invalid(
            "kernel_shape",
            format!("{k:?} disagrees with the weight {wd:?}"),
        ));
    }
    let strides = attr_sizes(cx, "strides", n, 1)?;
    let dilations = attr_sizes(cx, "dilations", n, 1)?;
    let pads = spatial_pads(cx, &xd[2..], &kernel, &strides, &dilations)?;
    let groups = size(cx.attr_i("group", 1), "group")?;
    if n == 3 {
        let window = Window3d {
            kernel: [kernel[0], kernel[1], kernel[2]],
            strides: [strides[0], strides[1], strides[2]],
            dilations: [dilations[0], dilations[1], dilations[2]],
            pads: [pads[0], pads[1], pads[2]],
        };
        return conv_3d(cx, x, w, bias, window, groups);
    }
    let (stride, dilation, padding) = if n == 1 {
        x = lift_1d(cx, x)?;
        w = lift_1d(cx, w)?;
        (
            [1, strides[0]],
            [1, dilations[0]],
            [0, pads[0].0, 0, pads[0].1],
        )
    } else {
        (
            [strides[0], strides[1]],
            [dilations[0], dilations[1]],
            [pads[0].0, pads[1].0, pads[0].1, pads[1].1],
        )
    };
    let (w, padding) = drop_dead_taps(cx, x, w, [stride, dilation], padding)?;
    let split =
        super::conv_regions::split_conv(cx, (x, w, bias), [stride, dilation], padding, groups)?;
    let y = match split {
        Some(y) => y,
        None => cx.g.conv2d(x, w, bias, stride, padding, dilation, groups)?,
    };
    if n == 1 { cx.g.squeeze(y, &[2]) } else { Ok(y) }
}

/// The taps `first..=last` along an axis of `n` input positions that some output
/// reads inside the input (a tap that only ever lands in the padding adds zeros).
/// `None` when no tap is live, and for sizes the convolution itself rejects (zero,
/// or too large to compute).
fn live_taps(
    n: usize,
    kernel: usize,
    [stride, dilation]: [usize; 2],
    (begin, end): (usize, usize),
) -> Option<(usize, usize)> {
    if stride == 0 {
        return None;
    }
    let span = window_span(kernel, dilation).ok()?;
    let padded = n.checked_add(begin)?.checked_add(end)?;
    if padded < span || i64::try_from(padded).is_err() {
        return None;
    }
    let out = (padded - span) / stride + 1;
    let live = |k: usize| {
        // Outputs `y` with `0 <= y * stride + k * dilation - begin < n` (every
        // value is at most `padded`, so it fits `i64`).
        let offset = (k * dilation) as i64 - begin as i64;
        let lo = ((-offset).max(0) as usize).div_ceil(stride);
        let hi_reach = n as i64 - offset;
        let hi = if hi_reach <= 0 {
            0
        } else {
            (hi_reach as usize).div_ceil(stride)
        };
        lo < hi.min(out)
    };
    let first = (0..kernel).find(|&k| live(k))?;
    let last = (0..kernel).rev().find(|&k| live(k))?;
    Some((first, last))
}

/// A 2-D convolution's weights and padding without the taps that only read
/// padding: a dilated window larger than its input (the wide rates of an atrous
/// pyramid: dilation 36 over 16 rows leaves only the middle tap) would otherwise
/// multiply zeros and stage a plane mostly of padding. The weights are sliced to the
/// live taps and the padding shrunk by the dead taps' reach, when that leaves it
/// non-negative; anything else is returned as it was. (A dropped tap's product was
/// a weight times a padding zero, so the sums are the same, except that an infinite
/// or NaN weight no longer turns them into NaN.)
fn drop_dead_taps(
    cx: &Cx,
    x: NodeId,
    w: NodeId,
    [stride, dilation]: [[usize; 2]; 2],
    padding: [usize; 4],
) -> Result<(NodeId, [usize; 4])> {
    let xd = cx.g.shape(x)?.dims().to_vec();
    let wd = cx.g.shape(w)?.dims().to_vec();
    let mut keep: Vec<(isize, isize, isize, isize)> = Vec::new();
    let mut pads = padding;
    for a in 0..2 {
        let (k, d) = (wd[2 + a], dilation[a]);
        let (begin, end) = (padding[a], padding[a + 2]);
        let Some((first, last)) = live_taps(xd[2 + a], k, [stride[a], d], (begin, end)) else {
            continue;
        };
        let (cut_begin, cut_end) = (first * d, (k - 1 - last) * d);
        if (first, last) == (0, k - 1) || cut_begin > begin || cut_end > end {
            continue;
        }
        keep.push(((2 + a) as isize, first as isize, last as isize + 1, 1));
        pads[a] = begin - cut_begin;
        pads[a + 2] = end - cut_end;
    }
    if keep.is_empty() {
        return Ok((w, padding));
    }
    // One slice over both axes (weights that are params are sliced on each run).
    Ok((cx.g.slice_axes(w, &keep)?, pads))
}

/// The geometry of a 3-D convolution: per axis `(D, H, W)` the kernel, stride,
/// dilation and `(begin, end)` padding.
struct Window3d {
    kernel: [usize; 3],
    strides: [usize; 3],
    dilations: [usize; 3],
    pads: [(usize, usize); 3],
}

/// A 3-D convolution as 2-D ones: the depth axis is padded and moved next to the
/// batch, and each depth tap `k` is a 2-D convolution of the frames it reads
/// (frames `t * stride + k * dilation`, a strided slice, folded into the batch) by
/// the weights' `k`-th depth slice; the taps' results add up (each sum after the
/// first is the next convolution's residual, which the convolution epilogue fuses).
fn conv_3d(
    cx: &Cx,
    x: NodeId,
    w: NodeId,
    bias: Option<NodeId>,
    win: Window3d,
    groups: usize,
) -> Result<NodeId> {
    let xd = cx.g.shape(x)?.dims().to_vec();
    let wd = cx.g.shape(w)?.dims().to_vec();
    let [n, c, _, h, wi] = [xd[0], xd[1], xd[2], xd[3], xd[4]];
    let o = wd[0];
    let (pd0, pd1) = win.pads[0];
    let x = if pd0 + pd1 > 0 {
        let mut pads = vec![(0, 0); 5];
        pads[2] = (pd0, pd1);
        cx.g.pad(
            x,
            &pads,
            rlx_ir::PadMode::Constant(rlx_ir::F64Bits::new(0.0)),
        )?
    } else {
        x
    };
    let depth = cx.g.shape(x)?.dim(2);
    let span = window_span(win.kernel[0], win.dilations[0])?;
    if depth < span {
        return Err(Error::invalid(
            "Conv",
            format!("a depth window of {span} over {depth} padded frames"),
        ));
    }
    let od = (depth - span) / win.strides[0] + 1;
    // [N, D, C, H, W]: a run of frames is a run of whole images.
    let frames = cx.g.permute(x, &[0, 2, 1, 3, 4])?;
    let padding = [win.pads[1].0, win.pads[2].0, win.pads[1].1, win.pads[2].1];
    let mut sum: Option<NodeId> = None;
    for k in 0..win.kernel[0] {
        let start = k * win.dilations[0];
        let end = start + (od - 1) * win.strides[0] + 1;
        let taken = cx.g.slice(
            frames,
            1,
            start as isize,
            end as isize,
            win.strides[0] as isize,
        )?;
        let images = cx.g.reshape(taken, &[n * od, c, h, wi])?;
        let wk = cx.g.slice(w, 2, k as isize, k as isize + 1, 1)?;
        let wk = cx.g.reshape(wk, &[o, wd[1], wd[3], wd[4]])?;
        let y = cx.g.conv2d(
            images,
            wk,
            if k == 0 { bias } else { None },
            [win.strides[1], win.strides[2]],
            padding,
            [win.dilations[1], win.dilations[2]],
            groups,
        )?;
        sum = Some(match sum {
            Some(s) => cx.g.add(y, s)?,
            None => y,
        });
    }
    let y = sum.ok_or_else(|| Error::invalid("Conv", "a depth kernel of 0"))?;
    let yd = cx.g.shape(y)?.dims().to_vec();
    let y = cx.g.reshape(y, &[n, od, o, yd[2], yd[3]])?;
    cx.g.permute(y, &[0, 2, 1, 3, 4])
}

/// `ConvTranspose` as a convolution: the input with `stride - 1` zeros between its
/// elements, padded by the dilated kernel span less the given padding, convolved with
/// the kernel flipped and its channel axes swapped (per group). Padding beyond the
/// span crops the result instead.
fn conv_transpose(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let xd = cx.dims(0)?;
    let wd = cx.dims(1)?;
    if xd.len() != wd.len() || !(3..=4).contains(&xd.len()) {
        return Err(unsupported(format!(
            "ConvTranspose of a {}-D input (1-D and 2-D are supported)",
            xd.len()
        )));
    }
    let n = xd.len() - 2;
    let groups = size(cx.attr_i("group", 1), "group")?;
    let (c, m_per) = (wd[0], wd[1]);
    if groups == 0 || xd[1] != c || c % groups != 0 {
        return Err(Error::invalid(
            "ConvTranspose",
            format!("input {xd:?}, weight {wd:?} and group {groups} do not fit"),
        ));
    }
    let kernel = wd[2..].to_vec();
    let strides = attr_sizes(cx, "strides", n, 1)?;
    let dilations = attr_sizes(cx, "dilations", n, 1)?;
    let mut extra = match cx.attr_ints("output_padding") {
        Some(v) if v.len() == n => v
            .iter()
            .map(|&d| size(d, "output_padding"))
            .collect::<Result<Vec<_>>>()?,
        Some(v) => {
            return Err(Error::invalid(
                "output_padding",
                format!("{} values for {n} axes", v.len()),
            ));
        }
        None => vec![0; n],
    };
    if kernel.contains(&0) || strides.contains(&0) || dilations.contains(&0) || xd[2..].contains(&0)
    {
        return Err(Error::invalid(
            "ConvTranspose",
            format!(
                "input {xd:?}, kernel {kernel:?}, strides {strides:?} and dilations {dilations:?} must all be positive"
            ),
        ));
    }
    let overflow = || Error::invalid("ConvTranspose", "the output extent overflows");
    let span: Vec<usize> = (0..n)
        .map(|i| window_span(kernel[i], dilations[i]))
        .collect::<Result<_>>()?;
    // The full output extent before padding is taken off.
    let full: Vec<usize> = (0..n)
        .map(|i| {
            strides[i]
                .checked_mul(xd[2 + i] - 1)
                .and_then(|v| v.checked_add(extra[i]))
                .and_then(|v| v.checked_add(span[i]))
                .ok_or_else(overflow)
        })
        .collect::<Result<_>>()?;
    let auto = cx.attr_s("auto_pad", "NOTSET");
    let pads: Vec<(usize, usize)> = if let Some(shape) = cx.attr_ints("output_shape") {
        let out: Vec<usize> = shape[shape.len().saturating_sub(n)..]
            .iter()
            .map(|&d| size(d, "output_shape"))
            .collect::<Result<_>>()?;
        if out.len() != n {
            return Err(Error::invalid(
                "output_shape",
                format!("{shape:?} for {n} spatial axes"),
            ));
        }
        (0..n)
            .map(|i| {
                // A larger output than the full extent grows at the end (zeros from
                // the input side, so the kernel's tail reaches it).
                if out[i] > full[i] {
                    extra[i] += out[i] - full[i];
                    return (0, 0);
                }
                let total = full[i] - out[i];
                if auto == "SAME_LOWER" {
                    (total - total / 2, total / 2)
                } else {
                    (total / 2, total - total / 2)
                }
            })
            .collect()
    } else {
        match auto.as_str() {
            "NOTSET" | "VALID" => {
                let p = cx.attr_ints("pads").unwrap_or_else(|| vec![0; 2 * n]);
                if p.len() != 2 * n || auto == "VALID" && p.iter().any(|&v| v != 0) {
                    return Err(Error::invalid("pads", format!("{p:?} for {n} axes")));
                }
                (0..n)
                    .map(|i| Ok((size(p[i], "pads")?, size(p[i + n], "pads")?)))
                    .collect::<Result<_>>()?
            }
            "SAME_UPPER" | "SAME_LOWER" => (0..n)
                .map(|i| {
                    let total = full[i].saturating_sub(xd[2 + i] * strides[i]);
                    if auto == "SAME_UPPER" {
                        (total / 2, total - total / 2)
                    } else {
                        (total - total / 2, total / 2)
                    }
                })
                .collect(),
            other => return Err(unsupported(format!("auto_pad '{other}'"))),
        }
    };
    let mut x = cx.input(0)?;
    let mut w = cx.input(1)?;
    let bias = cx.opt_input(2)?;
    if n == 1 {
        x = lift_1d(cx, x)?;
        w = lift_1d(cx, w)?;
    }
    let (kk, st, dl, ex, pd) = if n == 1 {
        (
            [1, kernel[0]],
            [1, strides[0]],
            [1, dilations[0]],
            [0, extra[0]],
            [(0, 0), pads[0]],
        )
    } else {
        (
            [kernel[0], kernel[1]],
            [strides[0], strides[1]],
            [dilations[0], dilations[1]],
            [extra[0], extra[1]],
            [pads[0], pads[1]],
        )
    };
    // By phase when every phase has a tap (a stride past the kernel would make
    // stride^2 branches, most of them the bias alone).
    if dl == [1, 1] && st != [1, 1] && st[0] <= kk[0] && st[1] <= kk[1] {
        let y = conv_transpose_phases(cx, [x, w], bias, [kk, st, ex], pd, groups)?;
        return Ok(vec![if n == 1 { cx.g.squeeze(y, &[2])? } else { y }]);
    }
    // Zeros between the input's elements along each spatial axis.
    for (a, &s) in st.iter().enumerate() {
        if s == 1 {
            continue;
        }
        let dims = cx.g.shape(x)?.dims().to_vec();
        let axis = 2 + a;
        let mut split = dims.clone();
        split.insert(axis + 1, 1);
        let y = cx.g.reshape(x, &split)?;
        let mut pads = vec![(0, 0); split.len()];
        pads[axis + 1] = (0, s - 1);
        let y = cx.g.pad(
            y,
            &pads,
            rlx_ir::PadMode::Constant(rlx_ir::F64Bits::new(0.0)),
        )?;
        let mut merged = dims.clone();
        merged[axis] = dims[axis] * s;
        let y = cx.g.reshape(y, &merged)?;
        x =
            cx.g.slice(y, axis as isize, 0, ((dims[axis] - 1) * s + 1) as isize, 1)?;
    }
    // The kernel flipped along both spatial axes, in/out channels swapped per group.
    let k = cx.g.shape(w)?.dims().to_vec();
    for a in [2usize, 3] {
        let rev: Vec<i64> = (0..k[a] as i64).rev().collect();
        let idx = cx.g.constant(rlx_ir::TensorData::I64(rev), &[k[a]])?;
        w = cx.g.gather(w, idx, a as isize)?;
    }
    let cg = c / groups;
    let w = cx.g.reshape(w, &[groups, cg, m_per, k[2], k[3]])?;
    let w = cx.g.permute(w, &[0, 2, 1, 3, 4])?;
    let w = cx.g.reshape(w, &[groups * m_per, cg, k[2], k[3]])?;
    // Padding: the dilated span less the given padding (and the output padding at
    // the end); where the given padding exceeds the span, crop afterwards.
    let mut conv_pad = [0usize; 4];
    let mut crop = [(0usize, 0usize); 2];
    for a in 0..2 {
        let reach = (kk[a] - 1) * dl[a];
        let (b, e) = pd[a];
        if b <= reach {
            conv_pad[a] = reach - b;
        } else {
            crop[a].0 = b - reach;
        }
        let end = reach + ex[a];
        if e <= end {
            conv_pad[a + 2] = end - e;
        } else {
            crop[a].1 = e - end;
        }
    }
    let mut y =
        cx.g.conv2d(x, w, bias, [1, 1], conv_pad, [dl[0], dl[1]], groups)?;
    for (a, &(b, e)) in crop.iter().enumerate() {
        if b + e > 0 {
            let len = cx.g.shape(y)?.dim(2 + a);
            if b.saturating_add(e) >= len {
                return Err(Error::invalid(
                    "pads",
                    format!("padding {b} + {e} leaves nothing of an output of {len}"),
                ));
            }
            y =
                cx.g.slice(y, (2 + a) as isize, b as isize, (len - e) as isize, 1)?;
        }
    }
    if n == 1 {
        y = cx.g.squeeze(y, &[2])?;
    }
    Ok(vec![y])
}

/// An undilated, strided 2-D `ConvTranspose` by output phase: output rows `q * sy +
/// ry` and columns `q * sx + rx` take only the kernel taps `ry, ry + sy, ..` and `rx,
/// rx + sx, ..`, so phase `(ry, rx)` is a unit-stride convolution of the input
/// itself with those taps (flipped, channel axes swapped per group), and no product
/// meets the zeros a spaced-out input would have (a stride-2 transpose did four
/// times the products that way). The phases, each with the bias, are stacked,
/// interleaved by a permute, and cropped by the padding `pd`. The window is `[kernel,
/// strides, output padding]`.
fn conv_transpose_phases(
    cx: &Cx,
    [x, w]: [NodeId; 2],
    bias: Option<NodeId>,
    [kk, st, ex]: [[usize; 2]; 3],
    pd: [(usize, usize); 2],
    groups: usize,
) -> Result<NodeId> {
    let xd = cx.g.shape(x)?.dims().to_vec();
    let wd = cx.g.shape(w)?.dims().to_vec();
    let (n, c, m_per) = (xd[0], xd[1], wd[1]);
    let (cg, o) = (c / groups, groups * m_per);
    let input = [xd[2], xd[3]];
    // The uncropped output (the output padding included) and rows per phase.
    let full: [usize; 2] = std::array::from_fn(|a| (input[a] - 1) * st[a] + kk[a] + ex[a]);
    let q: [usize; 2] = std::array::from_fn(|a| full[a].div_ceil(st[a]));
    let dtype = cx.g.shape(x)?.dtype();
    // The weights of phase `r`: its taps, flipped, channel axes swapped per group.
    let phase_weights = |r: [usize; 2], taps: [usize; 2]| -> Result<NodeId> {
        let mut wr = w;
        for a in 0..2 {
            let axis = (2 + a) as isize;
            wr =
                cx.g.slice(wr, axis, r[a] as isize, kk[a] as isize, st[a] as isize)?;
            let rev: Vec<i64> = (0..taps[a] as i64).rev().collect();
            let idx = cx.g.constant(rlx_ir::TensorData::I64(rev), &[taps[a]])?;
            wr = cx.g.gather(wr, idx, axis)?;
        }
        let wr = cx.g.reshape(wr, &[groups, cg, m_per, taps[0], taps[1]])?;
        let wr = cx.g.permute(wr, &[0, 2, 1, 3, 4])?;
        cx.g.reshape(wr, &[o, cg, taps[0], taps[1]])
    };
    let woven = if groups == 1 && kk[0] % st[0] == 0 && kk[1] % st[1] == 0 {
        // Every phase has the same taps: one convolution computes them all, its
        // output channels phase-major.
        let taps = [kk[0] / st[0], kk[1] / st[1]];
        let mut ws = Vec::with_capacity(st[0] * st[1]);
        for ry in 0..st[0] {
            for rx in 0..st[1] {
                ws.push(phase_weights([ry, rx], taps)?);
            }
        }
        let all = cx.g.concat(&ws, 0)?;
        let biases = match bias {
            Some(b) => Some(cx.g.concat(&vec![b; st[0] * st[1]], 0)?),
            None => None,
        };
        let pad = [taps[0] - 1, taps[1] - 1, q[0] - input[0], q[1] - input[1]];
        let y = cx.g.conv2d(x, all, biases, [1, 1], pad, [1, 1], 1)?;
        let y = cx.g.reshape(y, &[n, st[0], st[1], o, q[0], q[1]])?;
        cx.g.permute(y, &[0, 3, 4, 1, 5, 2])?
    } else {
        phase_by_phase(
            cx,
            x,
            bias,
            &phase_weights,
            [kk, st, q],
            [n, o, groups],
            dtype,
        )?
    };
    let mut y = cx.g.reshape(woven, &[n, o, q[0] * st[0], q[1] * st[1]])?;
    for a in 0..2 {
        let (begin, end) = pd[a];
        let len = full[a];
        if begin + end >= len {
            return Err(Error::invalid(
                "pads",
                format!("padding {begin} + {end} leaves nothing of an output of {len}"),
            ));
        }
        if begin > 0 || len - end < q[a] * st[a] {
            y =
                cx.g.slice(y, (2 + a) as isize, begin as isize, (len - end) as isize, 1)?;
        }
    }
    Ok(y)
}

/// [`conv_transpose_phases`] with one convolution per phase (phases with different
/// taps, or groups), stacked and woven into `[n, o, q0, s0, q1, s1]`.
fn phase_by_phase(
    cx: &Cx,
    x: NodeId,
    bias: Option<NodeId>,
    phase_weights: &dyn Fn([usize; 2], [usize; 2]) -> Result<NodeId>,
    [kk, st, q]: [[usize; 2]; 3],
    [n, o, groups]: [usize; 3],
    dtype: rlx_ir::DType,
) -> Result<NodeId> {
    let input = {
        let d = cx.g.shape(x)?;
        [d.dim(2), d.dim(3)]
    };
    let mut phases = Vec::with_capacity(st[0] * st[1]);
    for ry in 0..st[0] {
        for rx in 0..st[1] {
            let r = [ry, rx];
            let taps: [usize; 2] =
                std::array::from_fn(|a| kk[a].saturating_sub(r[a]).div_ceil(st[a]));
            let y = if taps.contains(&0) {
                // No tap lands here: the bias alone.
                let zeros = cx.g.expand(cx.g.scalar(0.0, dtype), &[n, o, q[0], q[1]])?;
                match bias {
                    Some(b) => cx.g.add(zeros, cx.g.reshape(b, &[1, o, 1, 1])?)?,
                    None => zeros,
                }
            } else {
                let wr = phase_weights(r, taps)?;
                let pad = [taps[0] - 1, taps[1] - 1, q[0] - input[0], q[1] - input[1]];
                cx.g.conv2d(x, wr, bias, [1, 1], pad, [1, 1], groups)?
            };
            phases.push(cx.g.reshape(y, &[1, n, o, q[0], q[1]])?);
        }
    }
    let stacked = cx.g.concat(&phases, 0)?;
    let stacked = cx.g.reshape(stacked, &[st[0], st[1], n, o, q[0], q[1]])?;
    cx.g.permute(stacked, &[2, 3, 4, 0, 5, 1])
}

#[derive(Clone, Copy, PartialEq)]
enum PoolKind {
    Max,
    Avg,
    /// `(sum |x|^p)^(1/p)` over the window.
    Lp(i64),
}

/// `MaxPool`, `AveragePool` and `LpPool` over 1, 2 or 3 spatial axes. Three axes run
/// as two 2-D pools, over `(H, W)` and then over `D`: a maximum, a sum and a count of
/// the cells inside the input are each a product of one factor per axis, so the
/// window of the whole is the windows of its axes in turn.
fn pool(cx: &mut Cx, kind: PoolKind) -> Result<Vec<NodeId>> {
    if cx.wants_output(1) {
        return Err(unsupported("MaxPool's Indices output"));
    }
    let xd = cx.dims(0)?;
    if !(3..=5).contains(&xd.len()) {
        return Err(unsupported(format!(
            "pooling over {} spatial axes",
            xd.len().saturating_sub(2)
        )));
    }
    let n = xd.len() - 2;
    let kernel = attr_sizes(cx, "kernel_shape", n, 0)?;
    if kernel.contains(&0) {
        return Err(Error::invalid("kernel_shape", "missing or zero"));
    }
    let strides = attr_sizes(cx, "strides", n, 1)?;
    let dilations = attr_sizes(cx, "dilations", n, 1)?;
    let mut pads = spatial_pads(cx, &xd[2..], &kernel, &strides, &dilations)?;
    let declared = pads.clone();
    if cx.attr_i("ceil_mode", 0) != 0 {
        // Extra end padding so the last, partial window is counted; a window that
        // would start in the end padding is not added.
        for i in 0..n {
            let span = window_span(kernel[i], dilations[i])?;
            let padded = xd[2 + i]
                .checked_add(pads[i].0)
                .and_then(|p| p.checked_add(pads[i].1))
                .ok_or_else(|| Error::invalid("pads", "padded size overflows"))?;
            if padded < span {
                continue;
            }
            let floor_out = (padded - span) / strides[i] + 1;
            let mut ceil_out = (padded - span).div_ceil(strides[i]) + 1;
            if (ceil_out - 1) * strides[i] >= xd[2 + i] + pads[i].0 {
                ceil_out -= 1;
            }
            if ceil_out > floor_out {
                // Just enough end padding for the last window to fit.
                pads[i].1 += ((ceil_out - 1) * strides[i] + span) - padded;
            }
        }
    }
    let mut x = cx.input(0)?;
    let dt = cx.dtype(0)?;
    if let PoolKind::Lp(p) = kind {
        x = lp_power(cx, x, p, dt)?;
    }
    let mut count_include_pad = cx.attr_i("count_include_pad", 0) != 0;
    if matches!(kind, PoolKind::Avg) && count_include_pad && pads != declared {
        // The declared padding counts in a window's size, the extra end padding of
        // `ceil_mode` does not: the declared padding becomes zeros in the input, and
        // only the cells inside that count.
        let mut all = vec![(0, 0); 2];
        all.extend(declared.iter().copied());
        x = cx.g.pad(
            x,
            &all,
            rlx_ir::PadMode::Constant(rlx_ir::F64Bits::new(0.0)),
        )?;
        for (p, d) in pads.iter_mut().zip(&declared) {
            *p = (0, p.1 - d.1);
        }
        count_include_pad = false;
    }
    // One axis of the window: (kernel, stride, (pad begin, pad end), dilation).
    let axis = |i: usize| (kernel[i], strides[i], pads[i], dilations[i]);
    let unit = (1, 1, (0, 0), 1);
    let y = match n {
        1 => {
            let y = pool_2d(
                cx,
                kind,
                count_include_pad,
                lift_1d(cx, x)?,
                [unit, axis(0)],
            )?;
            cx.g.squeeze(y, &[2])?
        }
        2 => pool_2d(cx, kind, count_include_pad, x, [axis(0), axis(1)])?,
        _ => {
            // The dims of `x` as it is now: declared padding may have been applied.
            let xs = cx.g.shape(x)?.dims().to_vec();
            let [b, c, d, h, w] = [xs[0], xs[1], xs[2], xs[3], xs[4]];
            let planes = cx.g.reshape(x, &[b, c * d, h, w])?;
            let y = pool_2d(cx, kind, count_include_pad, planes, [axis(1), axis(2)])?;
            let yd = cx.g.shape(y)?.dims().to_vec();
            let (oh, ow) = (yd[2], yd[3]);
            let columns = cx.g.reshape(y, &[b, c, d, oh * ow])?;
            let y = pool_2d(cx, kind, count_include_pad, columns, [axis(0), unit])?;
            let od = cx.g.shape(y)?.dims()[2];
            cx.g.reshape(y, &[b, c, od, oh, ow])?
        }
    };
    let y = if let PoolKind::Lp(p) = kind {
        let count: f64 = kernel.iter().map(|&k| k as f64).product();
        let y = cx.g.mul(y, scalar(cx, count, dt))?;
        lp_root(cx, y, p, dt)?
    } else {
        y
    };
    Ok(vec![y])
}

/// One 2-D pool of `x [N, C, H, W]` with per-axis `(kernel, stride, pads, dilation)`;
/// an `Lp` pool takes the mean over the whole window (its sum divided by the size).
fn pool_2d(
    cx: &Cx,
    kind: PoolKind,
    count_include_pad: bool,
    x: NodeId,
    [h, w]: [(usize, usize, (usize, usize), usize); 2],
) -> Result<NodeId> {
    let window = Window2d {
        kernel: [h.0, w.0],
        stride: [h.1, w.1],
        padding: [h.2.0, w.2.0, h.2.1, w.2.1],
        dilation: [h.3, w.3],
    };
    let op = match kind {
        PoolKind::Max => Op::MaxPool2d { window },
        PoolKind::Avg => Op::AvgPool2d {
            window,
            count_include_pad,
        },
        // The window sum is the mean over the whole window, padding included, times
        // its size (padding adds zero).
        PoolKind::Lp(_) => Op::AvgPool2d {
            window,
            count_include_pad: true,
        },
    };
    cx.g.push(op, &[x])
}

fn lp_order(cx: &Cx) -> Result<i64> {
    match cx.attr_i("p", 2) {
        p if p >= 1 => Ok(p),
        p => Err(Error::invalid("p", format!("{p} must be 1 or more"))),
    }
}

/// `|x|^p`.
fn lp_power(cx: &Cx, x: NodeId, p: i64, dt: DType) -> Result<NodeId> {
    let a = cx.g.abs(x)?;
    match p {
        1 => Ok(a),
        2 => cx.g.mul(a, a),
        p => {
            cx.g.binary(rlx_ir::BinaryOp::Pow, a, scalar(cx, p as f64, dt))
        }
    }
}

/// `s^(1/p)`.
fn lp_root(cx: &Cx, s: NodeId, p: i64, dt: DType) -> Result<NodeId> {
    match p {
        1 => Ok(s),
        2 => cx.g.sqrt(s),
        p => {
            cx.g.binary(rlx_ir::BinaryOp::Pow, s, scalar(cx, 1.0 / p as f64, dt))
        }
    }
}

/// `LRN`: `x / (bias + alpha / size * s)^beta`, where `s` sums the squares of `x` over
/// a window of `size` channels around each one (`(size - 1) / 2` before, the rest
/// after), as a mean pool over the channel axis of `x^2` times the window size.
fn lrn(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let xd = cx.dims(0)?;
    let dt = cx.dtype(0)?;
    let window = size(cx.attr_i("size", 0), "size")?;
    if window == 0 {
        return Err(Error::invalid(
            "size",
            "LRN needs a window of at least 1 channel",
        ));
    }
    if xd.len() < 2 {
        return Err(Error::invalid(
            "LRN",
            format!("input of rank {} has no channel axis", xd.len()),
        ));
    }
    let (alpha, beta, bias) = (
        f64::from(cx.attr_f("alpha", 1e-4)),
        f64::from(cx.attr_f("beta", 0.75)),
        f64::from(cx.attr_f("bias", 1.0)),
    );
    let x = cx.input(0)?;
    let rest: usize = xd[2..].iter().product();
    let squares = cx.g.mul(x, x)?;
    let columns = cx.g.reshape(squares, &[xd[0], 1, xd[1], rest])?;
    let before = (window - 1) / 2;
    let mean = cx.g.push(
        Op::AvgPool2d {
            window: Window2d {
                kernel: [window, 1],
                stride: [1, 1],
                padding: [before, 0, window - 1 - before, 0],
                dilation: [1, 1],
            },
            count_include_pad: true,
        },
        &[columns],
    )?;
    let mean = cx.g.reshape(mean, &xd)?;
    // alpha / size * (mean * size) = alpha * mean.
    let scaled = cx.g.mul(mean, scalar(cx, alpha, dt))?;
    let base = cx.g.add(scaled, scalar(cx, bias, dt))?;
    let denominator =
        cx.g.binary(rlx_ir::BinaryOp::Pow, base, scalar(cx, beta, dt))?;
    Ok(vec![cx.g.div(x, denominator)?])
}

fn global_lp_pool(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let p = lp_order(cx)?;
    let rank = cx.shape(0)?.rank();
    let dt = cx.dtype(0)?;
    let x = cx.input(0)?;
    let s = cx.g.push(
        Op::Reduce {
            op: ReduceOp::Sum,
            axes: (2..rank).collect(),
            keepdims: true,
        },
        &[lp_power(cx, x, p, dt)?],
    )?;
    Ok(vec![lp_root(cx, s, p, dt)?])
}

fn global_pool(cx: &mut Cx, op: ReduceOp) -> Result<Vec<NodeId>> {
    let rank = cx.shape(0)?.rank();
    let x = cx.input(0)?;
    let list: Vec<usize> = (2..rank).collect();
    Ok(vec![cx.g.push(
        Op::Reduce {
            op,
            axes: list,
            keepdims: true,
        },
        &[x],
    )?])
}

/// A per-channel vector `[C]` reshaped to broadcast against `[N, C, ...]`.
fn per_channel(cx: &Cx, v: NodeId, rank: usize) -> Result<NodeId> {
    if rank < 2 {
        return Err(Error::invalid(
            "input",
            format!("per-channel values need an input of rank 2 or more [N, C, ...], not {rank}"),
        ));
    }
    let c = cx.g.shape(v)?.num_elements();
    let mut dims = vec![1; rank - 1];
    dims[0] = c;
    cx.g.reshape(v, &dims)
}

fn batch_norm(cx: &mut Cx) -> Result<Vec<NodeId>> {
    if cx.attr_i("training_mode", 0) != 0 {
        return batch_norm_training(cx);
    }
    if cx.num_outputs() > 1 && cx.wants_output(1) {
        return Err(unsupported(
            "BatchNormalization's running statistics outside training mode",
        ));
    }
    let rank = cx.shape(0)?.rank();
    let dt = cx.dtype(0)?;
    let eps = cx.attr_f("epsilon", 1e-5) as f64;
    let x = cx.input(0)?;
    if let Some(y) = fold_into_conv(cx, x, eps)? {
        return Ok(vec![y]);
    }
    let (scale, bias, mean, var) = (cx.input(1)?, cx.input(2)?, cx.input(3)?, cx.input(4)?);
    let inv = cx.g.div(
        scale,
        cx.g.sqrt(cx.g.add(var, scalar(cx, eps, cx.dtype(4)?))?)?,
    )?;
    let shift = cx.g.sub(bias, cx.g.mul(mean, inv)?)?;
    let inv = per_channel(cx, inv, rank)?;
    let shift = per_channel(cx, shift, rank)?;
    let _ = dt;
    Ok(vec![cx.g.add(cx.g.mul(x, inv)?, shift)?])
}

/// `BatchNormalization` in training mode: normalized by the batch's own mean and
/// (population) variance per channel, with the running statistics moved toward
/// them by `1 - momentum` as the second and third outputs.
fn batch_norm_training(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let rank = cx.shape(0)?.rank();
    if rank < 2 {
        return Err(Error::invalid(
            "BatchNormalization",
            format!("input of rank {rank} has no channel axis"),
        ));
    }
    let dt = cx.dtype(0)?;
    let eps = f64::from(cx.attr_f("epsilon", 1e-5));
    let momentum = f64::from(cx.attr_f("momentum", 0.9));
    let x = cx.input(0)?;
    let (scale, bias, mean, var) = (cx.input(1)?, cx.input(2)?, cx.input(3)?, cx.input(4)?);
    let axes: Vec<isize> = (0..rank as isize).filter(|&a| a != 1).collect();
    let batch_mean = cx.g.mean(x, &axes, true)?;
    let centred = cx.g.sub(x, batch_mean)?;
    let batch_var = cx.g.mean(cx.g.mul(centred, centred)?, &axes, true)?;
    let inv = cx.g.unary(
        rlx_ir::UnaryOp::Rsqrt,
        cx.g.add(batch_var, scalar(cx, eps, dt))?,
    )?;
    let y = cx.g.mul(centred, inv)?;
    let y = cx.g.add(
        cx.g.mul(y, per_channel(cx, scale, rank)?)?,
        per_channel(cx, bias, rank)?,
    )?;
    let mut out = vec![y];
    let channels = [cx.dims(0)?[1]];
    for (running, batch) in [(mean, batch_mean), (var, batch_var)] {
        if out.len() >= cx.num_outputs() {
            break;
        }
        let batch = cx.g.reshape(batch, &channels)?;
        let kept = cx.g.mul(running, scalar(cx, momentum, dt))?;
        let moved = cx.g.mul(batch, scalar(cx, 1.0 - momentum, dt))?;
        out.push(cx.g.add(kept, moved)?);
    }
    Ok(out)
}

/// A new convolution computing `conv(x) * scale + shift` per output channel, with
/// `scale` folded into the weights and both into the bias, when `x` is a float
/// convolution whose weights and bias are at hand (the old one dies unless something
/// else reads it). `None` when it is not such a convolution or the sizes disagree.
fn rescale_conv(
    cx: &mut Cx,
    x: NodeId,
    scale: Option<&[f64]>,
    shift: &[f64],
) -> Result<Option<NodeId>> {
    let node = cx.g.node(x)?;
    let Op::Conv2d { window, groups } = node.op.clone() else {
        return Ok(None);
    };
    let dt = node.shape.dtype();
    let channels = node.shape.dim(1);
    if !dt.is_float() || shift.len() != channels || scale.is_some_and(|s| s.len() != channels) {
        return Ok(None);
    }
    let (xin, w) = (node.inputs[0], node.inputs[1]);
    let bias = match node.inputs.get(2) {
        Some(&b) => match cx.node_value(b) {
            Some(v) => v,
            None => return Ok(None),
        },
        None => vec![0.0; channels],
    };
    let name = cx.node.name.clone().unwrap_or_default();
    let w2 = match scale {
        None => w,
        Some(s) => {
            let Some(wv) = cx.node_value(w) else {
                return Ok(None);
            };
            if wv.len() % channels.max(1) != 0 {
                return Ok(None);
            }
            let per = (wv.len() / channels.max(1)).max(1);
            let folded: Vec<f64> = wv
                .iter()
                .enumerate()
                .map(|(i, &v)| v * s[i / per])
                .collect();
            let wshape = cx.g.shape(w)?;
            cx.add_value(
                &format!("{name}.folded_weight"),
                &crate::tensor::Tensor {
                    dims: wshape.dims().to_vec(),
                    data: rlx_ir::TensorData::from_f64(wshape.dtype(), &folded),
                },
            )?
        }
    };
    let b2: Vec<f64> = (0..channels)
        .map(|c| bias[c] * scale.map_or(1.0, |s| s[c]) + shift[c])
        .collect();
    let b2 = cx.add_value(
        &format!("{name}.folded_bias"),
        &crate::tensor::Tensor {
            dims: vec![channels],
            data: rlx_ir::TensorData::from_f64(dt, &b2),
        },
    )?;
    Ok(Some(
        cx.g.push(Op::Conv2d { window, groups }, &[xin, w2, b2])?,
    ))
}

/// An inference batch norm right after a convolution whose weights are at hand folds
/// into them: `s = gamma / sqrt(var + eps)` scales each output channel and
/// `beta - mean * s` shifts it.
fn fold_into_conv(cx: &mut Cx, x: NodeId, eps: f64) -> Result<Option<NodeId>> {
    let Some(known) = (1..=4)
        .map(|i| cx.fixed(i).map(|t| t.to_f64_vec()))
        .collect::<Option<Vec<_>>>()
    else {
        return Ok(None);
    };
    let [gamma, beta, mean, var] = [&known[0], &known[1], &known[2], &known[3]];
    if [beta, mean, var].iter().any(|v| v.len() != gamma.len()) {
        return Ok(None);
    }
    let s: Vec<f64> = gamma
        .iter()
        .zip(var)
        .map(|(g, v)| g / (v + eps).sqrt())
        .collect();
    let shift: Vec<f64> = (0..s.len()).map(|c| beta[c] - mean[c] * s[c]).collect();
    rescale_conv(cx, x, Some(&s), &shift)
}

/// `conv(x) * c` or `conv(x) + c` with `c` a known per-output-channel value (a batch
/// norm exported as a multiply and an add) folds into the convolution's weights or
/// bias: a new convolution replaces the product or sum.
pub(super) fn fold_channel_affine(cx: &mut Cx, op: rlx_ir::BinaryOp) -> Result<Option<NodeId>> {
    for (conv_at, c_at) in [(0, 1), (1, 0)] {
        let Some(c) = cx.fixed(c_at) else { continue };
        if cx.fixed(conv_at).is_some() {
            return Ok(None);
        }
        let x = cx.input(conv_at)?;
        let node = cx.g.node(x)?;
        if !matches!(node.op, Op::Conv2d { .. }) {
            continue;
        }
        // c must broadcast as one value per channel: dims [C, 1, 1] or [1, C, 1, 1].
        let channels = node.shape.dim(1);
        let cd = &c.dims;
        let per_channel = c.len() == channels
            && (3..=4).contains(&cd.len())
            && cd[cd.len() - 3] == channels
            && cd[cd.len() - 2..].iter().all(|&d| d == 1)
            && cd[..cd.len() - 3].iter().all(|&d| d == 1);
        if !per_channel {
            return Ok(None);
        }
        let cv = c.to_f64_vec();
        return if op == rlx_ir::BinaryOp::Mul {
            rescale_conv(cx, x, Some(&cv), &vec![0.0; channels])
        } else {
            rescale_conv(cx, x, None, &cv)
        };
    }
    Ok(None)
}

/// `(x - mean) / sqrt(var + eps)` over `axes` (kept as size 1).
fn normalize(cx: &Cx, x: NodeId, axes: &[usize], eps: f64) -> Result<NodeId> {
    let dt = cx.g.shape(x)?.dtype();
    let mean = cx.g.push(
        Op::Reduce {
            op: ReduceOp::Mean,
            axes: axes.to_vec(),
            keepdims: true,
        },
        &[x],
    )?;
    let d = cx.g.sub(x, mean)?;
    let var = cx.g.push(
        Op::Reduce {
            op: ReduceOp::Mean,
            axes: axes.to_vec(),
            keepdims: true,
        },
        &[cx.g.mul(d, d)?],
    )?;
    let std = cx.g.sqrt(cx.g.add(var, scalar(cx, eps, dt))?)?;
    cx.g.div(d, std)
}

fn instance_norm(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let rank = cx.shape(0)?.rank();
    let eps = cx.attr_f("epsilon", 1e-5) as f64;
    let x = cx.input(0)?;
    let (scale, bias) = (cx.input(1)?, cx.input(2)?);
    let list: Vec<usize> = (2..rank).collect();
    let y = normalize(cx, x, &list, eps)?;
    let y = cx.g.mul(y, per_channel(cx, scale, rank)?)?;
    Ok(vec![cx.g.add(y, per_channel(cx, bias, rank)?)?])
}

fn layer_norm(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let dims = cx.dims(0)?;
    let rank = dims.len();
    let dt = cx.dtype(0)?;
    let a = axis(cx.attr_i("axis", -1), rank)?;
    let eps = cx.attr_f("epsilon", 1e-5) as f64;
    let x = cx.input(0)?;
    let scale = cx.input(1)?;
    let bias = cx.opt_input(2)?;
    let last_only = a + 1 == rank
        && cx.dims(1)? == [dims[rank - 1]]
        && (!cx.has(2) || cx.dims(2)? == [dims[rank - 1]]);
    let wants_stats = cx.wants_output(1) || cx.wants_output(2);
    if last_only && !wants_stats && dt.is_float() {
        let bias = match bias {
            Some(b) => b,
            None => cx.g.constant(
                rlx_ir::TensorData::from_f64(dt, &vec![0.0; dims[rank - 1]]),
                &[dims[rank - 1]],
            )?,
        };
        return Ok(vec![cx.g.layer_norm(x, scale, bias, eps)?]);
    }
    let list: Vec<usize> = (a..rank).collect();
    let mean = cx.g.push(
        Op::Reduce {
            op: ReduceOp::Mean,
            axes: list.clone(),
            keepdims: true,
        },
        &[x],
    )?;
    let d = cx.g.sub(x, mean)?;
    let var = cx.g.push(
        Op::Reduce {
            op: ReduceOp::Mean,
            axes: list,
            keepdims: true,
        },
        &[cx.g.mul(d, d)?],
    )?;
    let inv = cx.g.rsqrt(cx.g.add(var, scalar(cx, eps, dt))?)?;
    let mut y = cx.g.mul(cx.g.mul(d, inv)?, scale)?;
    if let Some(b) = bias {
        y = cx.g.add(y, b)?;
    }
    Ok(vec![y, mean, inv])
}

fn rms_norm(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let dims = cx.dims(0)?;
    let rank = dims.len();
    let dt = cx.dtype(0)?;
    let a = axis(cx.attr_i("axis", -1), rank)?;
    let eps = cx.attr_f("epsilon", 1e-5) as f64;
    let x = cx.input(0)?;
    let scale = cx.input(1)?;
    if a + 1 == rank && cx.dims(1)? == [dims[rank - 1]] && dt.is_float() {
        return Ok(vec![cx.g.rms_norm(x, scale, eps)?]);
    }
    let list: Vec<usize> = (a..rank).collect();
    let ms = cx.g.push(
        Op::Reduce {
            op: ReduceOp::Mean,
            axes: list,
            keepdims: true,
        },
        &[cx.g.mul(x, x)?],
    )?;
    let inv = cx.g.rsqrt(cx.g.add(ms, scalar(cx, eps, dt))?)?;
    Ok(vec![cx.g.mul(cx.g.mul(x, inv)?, scale)?])
}

fn group_norm(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let dims = cx.dims(0)?;
    let rank = dims.len();
    if rank < 2 {
        return Err(Error::invalid(
            "GroupNormalization",
            "input must have rank 2 or more",
        ));
    }
    let g = size(cx.attr_i("num_groups", 0), "num_groups")?;
    let (n, c) = (dims[0], dims[1]);
    if g == 0 || !c.is_multiple_of(g) {
        return Err(Error::invalid(
            "GroupNormalization",
            format!("{c} channels in {g} groups"),
        ));
    }
    let eps = cx.attr_f("epsilon", 1e-5) as f64;
    let x = cx.input(0)?;
    let (scale, bias) = (cx.input(1)?, cx.input(2)?);
    let rest: usize = dims[1..].iter().product::<usize>() / g;
    let grouped = cx.g.reshape(x, &[n, g, rest])?;
    let y = normalize(cx, grouped, &[2], eps)?;
    let y = cx.g.reshape(y, &dims)?;
    let (scale, bias) = if cx.opset < 21 {
        // Per-group scale and bias: repeat each over its channels.
        let per = c / g;
        let s =
            cx.g.reshape(cx.g.expand(cx.g.reshape(scale, &[g, 1])?, &[g, per])?, &[c])?;
        let b =
            cx.g.reshape(cx.g.expand(cx.g.reshape(bias, &[g, 1])?, &[g, per])?, &[c])?;
        (s, b)
    } else {
        (scale, bias)
    };
    let y = cx.g.mul(y, per_channel(cx, scale, rank)?)?;
    Ok(vec![cx.g.add(y, per_channel(cx, bias, rank)?)?])
}

fn lp_norm(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let rank = cx.shape(0)?.rank();
    let a = axis(cx.attr_i("axis", -1), rank)?;
    let p = cx.attr_i("p", 2);
    let x = cx.input(0)?;
    let norm = match p {
        1 => cx.g.push(
            Op::Reduce {
                op: ReduceOp::Sum,
                axes: vec![a],
                keepdims: true,
            },
            &[cx.g.abs(x)?],
        )?,
        2 => {
            let s = cx.g.push(
                Op::Reduce {
                    op: ReduceOp::Sum,
                    axes: vec![a],
                    keepdims: true,
                },
                &[cx.g.mul(x, x)?],
            )?;
            cx.g.sqrt(s)?
        }
        other => return Err(unsupported(format!("LpNormalization with p = {other}"))),
    };
    // A zero vector stays zero (instead of 0 / 0).
    let dt = cx.dtype(0)?;
    let zero =
        cx.g.binary(rlx_ir::BinaryOp::Eq, norm, scalar(cx, 0.0, dt))?;
    let safe = cx.g.select(zero, scalar(cx, 1.0, dt), norm)?;
    Ok(vec![cx.g.div(x, safe)?])
}

fn mvn(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let rank = cx.shape(0)?.rank();
    let list = cx.attr_ints("axes").unwrap_or_else(|| vec![0, 2, 3]);
    let list = super::axes(&list, rank)?;
    let x = cx.input(0)?;
    Ok(vec![normalize(cx, x, &list, 1e-9)?])
}

fn dropout(cx: &mut Cx) -> Result<Vec<NodeId>> {
    // Training mode drops nothing at a ratio of 0; at any other ratio its mask is
    // random, which RLX does not generate.
    let ratio_zero = |cx: &mut Cx| {
        cx.known(1)
            .is_some_and(|r| r.to_f64_vec().first().copied() == Some(0.0))
    };
    let training = cx.attr_i("training_mode", 0) != 0
        || cx
            .known(2)
            .is_some_and(|t| t.to_i64_vec().first().copied().unwrap_or(0) != 0);
    if training && !ratio_zero(cx) {
        return Err(unsupported("Dropout in training mode"));
    }
    if cx.has(2) && cx.known(2).is_none() {
        return Err(unsupported("Dropout with a run-time training_mode"));
    }
    let x = cx.input(0)?;
    let mut out = vec![x];
    if cx.wants_output(1) {
        let dims = cx.dims(0)?;
        let keep = cx.g.scalar(1.0, DType::Bool);
        out.push(cx.g.expand(keep, &dims)?);
    }
    Ok(out)
}
