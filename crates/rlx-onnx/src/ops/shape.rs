//! Shape and data-movement operators: `Shape`, `Reshape`, `Transpose`, `Slice`,
//! `Gather`, `Concat`, `Split`, `Pad`, `Expand`, constants and ranges, and the rest.

use super::{Converter, axes, axis, size, unsupported};
use crate::import::Cx;
use crate::ops::elementwise::cast_to;
use crate::tensor::dtype_from_onnx;
use rlx_ir::{DType, Error, NodeId, PadMode, Result, Shape, TensorData, broadcast_dims};

pub(super) const NAMES: &[&str] = &[
    "Concat",
    "Constant",
    "ConstantOfShape",
    "CumSum",
    "CumProd",
    "CenterCropPad",
    "HannWindow",
    "HammingWindow",
    "BlackmanWindow",
    "DepthToSpace",
    "Expand",
    "EyeLike",
    "Flatten",
    "Gather",
    "GatherElements",
    "GatherND",
    "OneHot",
    "Pad",
    "Range",
    "Reshape",
    "Shape",
    "Size",
    "Slice",
    "SpaceToDepth",
    "Split",
    "Squeeze",
    "Tile",
    "TopK",
    "Transpose",
    "Trilu",
    "Unsqueeze",
];

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "Shape" => shape_of,
        "Size" => |cx| {
            let n = cx.shape(0)?.num_elements() as i64;
            Ok(vec![cx.g.constant(TensorData::I64(vec![n]), &[])?])
        },
        "Reshape" => reshape,
        "Flatten" => flatten,
        "Squeeze" => squeeze,
        "Unsqueeze" => unsqueeze,
        "Transpose" => transpose,
        "Concat" => |cx| {
            let xs = cx.inputs()?;
            let rank = cx.shape(0)?.rank();
            let a = axis(cx.attr_i("axis", 0), rank)?;
            Ok(vec![cx.g.concat(&xs, a as isize)?])
        },
        "Split" => split,
        "Slice" => slice,
        "Gather" => gather,
        "GatherElements" => gather_elements,
        "GatherND" => gather_nd,
        "Expand" => |cx| {
            let target = dims_from(&cx.ints(1)?, "Expand shape")?;
            let x = cx.input(0)?;
            let dims = broadcast_dims(&cx.dims(0)?, &target).ok_or_else(|| {
                Error::invalid(
                    "Expand",
                    format!("{:?} does not broadcast to {target:?}", cx.dims(0)),
                )
            })?;
            Ok(vec![cx.g.expand(x, &dims)?])
        },
        "Tile" => |cx| {
            let reps = dims_from(&cx.ints(1)?, "Tile repeats")?;
            let x = cx.input(0)?;
            Ok(vec![cx.g.tile(x, &reps)?])
        },
        "Pad" => pad,
        "Constant" => constant,
        "ConstantOfShape" => constant_of_shape,
        "Range" => range,
        "EyeLike" => eye_like,
        "Trilu" => trilu,
        "OneHot" => one_hot,
        "CumSum" => |cx| {
            let x = cx.input(0)?;
            let a = cx.ints(1)?.first().copied().unwrap_or(0);
            let a = axis(a, cx.shape(0)?.rank())?;
            let exclusive = cx.attr_i("exclusive", 0) != 0;
            let reverse = cx.attr_i("reverse", 0) != 0;
            Ok(vec![cx.g.cumsum(x, a as isize, exclusive, reverse)?])
        },
        "CumProd" => cumprod,
        "CenterCropPad" => center_crop_pad,
        "HannWindow" => |cx| window(cx, &[0.5, -0.5]),
        "HammingWindow" => |cx| window(cx, &[25.0 / 46.0, -21.0 / 46.0]),
        "BlackmanWindow" => |cx| window(cx, &[0.42, -0.5, 0.08]),
        "TopK" => topk,
        "DepthToSpace" => depth_to_space,
        "SpaceToDepth" => space_to_depth,
        _ => return None,
    })
}

/// `CenterCropPad`: each listed axis is cut to a centered window (when longer than
/// the target) or padded with zeros on both sides (when shorter), the extra element of
/// an odd difference going to the end.
fn center_crop_pad(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let dims = cx.dims(0)?;
    let rank = dims.len();
    let target = dims_from(&cx.ints(1)?, "CenterCropPad shape")?;
    let list: Vec<usize> = match cx.attr_ints("axes") {
        Some(a) => a.iter().map(|&v| axis(v, rank)).collect::<Result<_>>()?,
        None => (0..rank).collect(),
    };
    if target.len() != list.len() {
        return Err(Error::invalid(
            "CenterCropPad",
            format!("{} sizes for {} axes", target.len(), list.len()),
        ));
    }
    let mut x = cx.input(0)?;
    let mut pads = vec![(0usize, 0usize); rank];
    for (&a, &t) in list.iter().zip(&target) {
        let d = dims[a];
        if t < d {
            let start = (d - t) / 2;
            x =
                cx.g.slice(x, a as isize, start as isize, (start + t) as isize, 1)?;
        } else if t > d {
            let before = (t - d) / 2;
            pads[a] = (before, t - d - before);
        }
    }
    if pads.iter().any(|&(b, e)| b + e > 0) {
        x = cx.g.pad(
            x,
            &pads,
            rlx_ir::PadMode::Constant(rlx_ir::F64Bits::new(0.0)),
        )?;
    }
    Ok(vec![x])
}

/// A cosine-sum window of length `size`: `sum_k a_k cos(2 pi k n / N)` with `N` the
/// size (periodic, the default) or the size less one (symmetric). It depends only on
/// the size, so it is a constant at import.
fn window(cx: &mut Cx, coefficients: &[f64]) -> Result<Vec<NodeId>> {
    let n = size(
        cx.ints(0)?
            .first()
            .copied()
            .ok_or_else(|| Error::invalid("window size", "must hold one value"))?,
        "window size",
    )?;
    let periodic = cx.attr_i("periodic", 1) != 0;
    let dtype =
        crate::tensor::dtype_from_onnx(cx.attr_i("output_datatype", 1) as i32, "output_datatype")?;
    let denom = if periodic { n as f64 } else { n as f64 - 1.0 };
    let values: Vec<f64> = (0..n)
        .map(|i| {
            coefficients
                .iter()
                .enumerate()
                .map(|(k, a)| a * (2.0 * std::f64::consts::PI * k as f64 * i as f64 / denom).cos())
                .sum()
        })
        .collect();
    Ok(vec![
        cx.g.constant(TensorData::from_f64(dtype, &values), &[n])?,
    ])
}

/// `CumProd` as a doubling scan: after step `k` every position holds the product of
/// the `2^k` values ending at it, so `log2(n)` multiplies cover an axis of `n`.
fn cumprod(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let dims = cx.dims(0)?;
    let dt = cx.dtype(0)?;
    let a = cx.ints(1)?.first().copied().unwrap_or(0);
    let a = axis(a, dims.len())?;
    let exclusive = cx.attr_i("exclusive", 0) != 0;
    let reverse = cx.attr_i("reverse", 0) != 0;
    let n = dims[a];
    let mut x = cx.input(0)?;
    if n == 0 {
        return Ok(vec![x]);
    }
    let reversed: Vec<i64> = (0..n as i64).rev().collect();
    let flip = |x: NodeId| -> Result<NodeId> {
        let idx = cx.g.constant(TensorData::I64(reversed.clone()), &[n])?;
        cx.g.gather(x, idx, a as isize)
    };
    let ones = |k: usize| -> Result<NodeId> {
        let mut d = dims.clone();
        d[a] = k;
        let count: usize = d.iter().product();
        cx.g.constant(TensorData::from_f64(dt, &vec![1.0; count]), &d)
    };
    // The first `n - k` entries along the axis, shifted down by `k` behind ones.
    let shifted = |y: NodeId, k: usize| -> Result<NodeId> {
        let head = cx.g.slice(y, a as isize, 0, (n - k) as isize, 1)?;
        cx.g.concat(&[ones(k)?, head], a as isize)
    };
    if reverse {
        x = flip(x)?;
    }
    if exclusive {
        x = shifted(x, 1)?;
    }
    let mut k = 1;
    while k < n {
        x = cx.g.mul(x, shifted(x, k)?)?;
        k *= 2;
    }
    if reverse {
        x = flip(x)?;
    }
    Ok(vec![x])
}

/// Sizes from integers (all non-negative).
fn dims_from(v: &[i64], what: &str) -> Result<Vec<usize>> {
    v.iter().map(|&d| size(d, what)).collect()
}

fn shape_of(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let dims = cx.dims(0)?;
    let r = dims.len() as i64;
    let clamp = |v: i64| {
        let v = if v < 0 { v + r } else { v };
        v.clamp(0, r) as usize
    };
    let (start, end) = if cx.opset >= 15 {
        (clamp(cx.attr_i("start", 0)), clamp(cx.attr_i("end", r)))
    } else {
        (0, dims.len())
    };
    let picked: Vec<i64> = dims[start..end.max(start)]
        .iter()
        .map(|&d| d as i64)
        .collect();
    let n = picked.len();
    Ok(vec![cx.g.constant(TensorData::I64(picked), &[n])?])
}

fn reshape(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let src = cx.dims(0)?;
    let spec = if cx.opset < 5 {
        cx.attr_ints("shape").unwrap_or_default()
    } else {
        cx.ints(1)?
    };
    let allow_zero = cx.attr_i("allowzero", 0) != 0;
    let mut dims = Vec::with_capacity(spec.len());
    let mut infer = None;
    for (i, &d) in spec.iter().enumerate() {
        match d {
            -1 if infer.is_none() => {
                infer = Some(i);
                dims.push(1);
            }
            0 if !allow_zero => dims.push(*src.get(i).ok_or_else(|| {
                Error::invalid(
                    "Reshape",
                    format!("0 at position {i} copies a dim the input lacks"),
                )
            })?),
            d => dims.push(size(d, "Reshape shape")?),
        }
    }
    let total: usize = src.iter().product();
    if let Some(i) = infer {
        // The shape comes from the file: a product that overflows cannot divide
        // `total` (which fits), so it is reported like any other mismatch.
        let known = dims
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .unwrap_or(0);
        if known == 0 || !total.is_multiple_of(known) {
            return Err(Error::invalid(
                "Reshape",
                format!("cannot infer -1 in {spec:?} for {total} elements"),
            ));
        }
        dims[i] = total / known;
    }
    let x = cx.input(0)?;
    Ok(vec![cx.g.reshape(x, &dims)?])
}

fn flatten(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let dims = cx.dims(0)?;
    let r = dims.len() as i64;
    let a = cx.attr_i("axis", 1);
    let a = if a < 0 { a + r } else { a };
    if !(0..=r).contains(&a) {
        return Err(Error::invalid(
            "Flatten",
            format!("axis {a} out of range for rank {r}"),
        ));
    }
    let a = a as usize;
    let outer: usize = dims[..a].iter().product();
    let inner: usize = dims[a..].iter().product();
    let x = cx.input(0)?;
    Ok(vec![cx.g.reshape(x, &[outer, inner])?])
}

fn axes_arg(cx: &mut Cx) -> Result<Option<Vec<i64>>> {
    if cx.opset >= 13 {
        cx.opt_ints(1)
    } else {
        Ok(cx.attr_ints("axes"))
    }
}

fn squeeze(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let list = axes_arg(cx)?.unwrap_or_default();
    let rank = cx.shape(0)?.rank();
    let list: Vec<isize> = axes(&list, rank)?.into_iter().map(|a| a as isize).collect();
    let x = cx.input(0)?;
    Ok(vec![cx.g.squeeze(x, &list)?])
}

fn unsqueeze(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let list = axes_arg(cx)?.ok_or_else(|| Error::invalid("Unsqueeze", "no axes given"))?;
    let list: Vec<isize> = list.iter().map(|&a| a as isize).collect();
    let x = cx.input(0)?;
    Ok(vec![cx.g.unsqueeze(x, &list)?])
}

fn transpose(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let rank = cx.shape(0)?.rank();
    let perm: Vec<usize> = match cx.attr_ints("perm") {
        Some(p) => p.iter().map(|&a| axis(a, rank)).collect::<Result<_>>()?,
        None => (0..rank).rev().collect(),
    };
    let x = cx.input(0)?;
    Ok(vec![cx.g.permute(x, &perm)?])
}

fn split(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let dims = cx.dims(0)?;
    if dims.is_empty() {
        return Err(Error::invalid("Split", "cannot split a scalar"));
    }
    let a = axis(cx.attr_i("axis", 0), dims.len())?;
    let len = dims[a];
    let outputs = cx.num_outputs();
    let given = if cx.opset >= 13 {
        cx.opt_ints(1)?
    } else {
        cx.attr_ints("split")
    };
    let sizes: Vec<usize> = match given {
        Some(s) if !s.is_empty() => dims_from(&s, "Split sizes")?,
        _ => {
            let n = if cx.opset >= 18 && cx.has_attr("num_outputs") {
                size(cx.attr_i("num_outputs", 1), "num_outputs")?
            } else {
                outputs
            };
            if n == 0 {
                return Err(Error::invalid("Split", "zero outputs"));
            }
            if n > outputs {
                return Err(Error::invalid(
                    "Split",
                    format!("num_outputs {n}, but the node has {outputs} outputs"),
                ));
            }
            let chunk = len.div_ceil(n);
            let mut left = len;
            (0..n)
                .map(|_| {
                    let s = chunk.min(left);
                    left -= s;
                    s
                })
                .collect()
        }
    };
    let x = cx.input(0)?;
    cx.g.split(x, a as isize, &sizes)
}

fn slice(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let rank = cx.shape(0)?.rank();
    let (starts, ends, list, steps) = if cx.opset < 10 {
        (
            cx.attr_ints("starts").unwrap_or_default(),
            cx.attr_ints("ends").unwrap_or_default(),
            cx.attr_ints("axes"),
            None,
        )
    } else {
        (cx.ints(1)?, cx.ints(2)?, cx.opt_ints(3)?, cx.opt_ints(4)?)
    };
    let list = list.unwrap_or_else(|| (0..starts.len() as i64).collect());
    let steps = steps.unwrap_or_else(|| vec![1; starts.len()]);
    if ends.len() != starts.len() || list.len() != starts.len() || steps.len() != starts.len() {
        return Err(Error::invalid(
            "Slice",
            "starts, ends, axes and steps differ in length",
        ));
    }
    let specs: Vec<(isize, isize, isize, isize)> = (0..starts.len())
        .map(|i| {
            Ok((
                axis(list[i], rank)? as isize,
                starts[i] as isize,
                ends[i] as isize,
                steps[i] as isize,
            ))
        })
        .collect::<Result<_>>()?;
    let x = cx.input(0)?;
    Ok(vec![cx.g.slice_axes(x, &specs)?])
}

fn pad(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let rank = cx.shape(0)?.rank();
    let dt = cx.dtype(0)?;
    let mode = cx.attr_s("mode", "constant");
    let (pads, value, list) = if cx.opset < 11 {
        let pads = cx
            .attr_ints("pads")
            .or_else(|| cx.attr_ints("paddings"))
            .unwrap_or_default();
        (pads, cx.attr_f("value", 0.0) as f64, None)
    } else {
        let value = match cx.known(2) {
            Some(t) if !t.is_empty() => t.to_f64_vec()[0],
            Some(_) => 0.0,
            None if cx.has(2) => return Err(unsupported("a run-time pad value")),
            None => 0.0,
        };
        (
            cx.ints(1)?,
            value,
            if cx.opset >= 18 {
                cx.opt_ints(3)?
            } else {
                None
            },
        )
    };
    let list: Vec<usize> = match list {
        Some(l) => l.iter().map(|&a| axis(a, rank)).collect::<Result<_>>()?,
        None => (0..rank).collect(),
    };
    if pads.len() != 2 * list.len() {
        return Err(Error::invalid(
            "Pad",
            format!("{} pads for {} axes", pads.len(), list.len()),
        ));
    }
    let n = list.len();
    let mut grow = vec![(0usize, 0usize); rank];
    let mut crop = vec![(0i64, 0i64); rank];
    for (k, &a) in list.iter().enumerate() {
        let (b, e) = (pads[k], pads[k + n]);
        grow[a] = (b.max(0) as usize, e.max(0) as usize);
        crop[a] = ((-b).max(0), (-e).max(0));
    }
    let mode = match mode.as_str() {
        "constant" => PadMode::Constant(rlx_ir::F64Bits::new(value)),
        "reflect" => PadMode::Reflect,
        "edge" => PadMode::Edge,
        other => return Err(unsupported(format!("pad mode '{other}'"))),
    };
    let mut x = cx.input(0)?;
    if crop.iter().any(|&(b, e)| b > 0 || e > 0) {
        let dims = cx.dims(0)?;
        let specs: Vec<(isize, isize, isize, isize)> = crop
            .iter()
            .enumerate()
            .map(|(a, &(b, e))| (a as isize, b as isize, dims[a] as isize - e as isize, 1))
            .collect();
        x = cx.g.slice_axes(x, &specs)?;
    }
    let _ = dt;
    Ok(vec![cx.g.pad(x, &grow, mode)?])
}

fn constant(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let t = if let Some(t) = cx.attr_tensor("value")? {
        t
    } else if cx.has_attr("value_float") {
        crate::tensor::Tensor {
            dims: vec![],
            data: TensorData::F32(vec![cx.attr_f("value_float", 0.0)]),
        }
    } else if let Some(v) = cx
        .attr_floats("value_floats")
        .filter(|_| cx.has_attr("value_floats"))
    {
        crate::tensor::Tensor {
            dims: vec![v.len()],
            data: TensorData::F32(v),
        }
    } else if cx.has_attr("value_int") {
        crate::tensor::Tensor {
            dims: vec![],
            data: TensorData::I64(vec![cx.attr_i("value_int", 0)]),
        }
    } else if let Some(v) = cx.attr_ints("value_ints") {
        crate::tensor::Tensor {
            dims: vec![v.len()],
            data: TensorData::I64(v),
        }
    } else {
        return Err(unsupported("a Constant without a numeric tensor value"));
    };
    Ok(vec![cx.constant(&t)?])
}

fn constant_of_shape(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let dims = dims_from(&cx.ints(0)?, "ConstantOfShape shape")?;
    let fill = cx.attr_tensor("value")?;
    let (dtype, v) = match fill {
        Some(t) if !t.is_empty() => (t.data.dtype(), t.to_f64_vec()[0]),
        Some(t) => (t.data.dtype(), 0.0),
        None => (DType::F32, 0.0),
    };
    let n = crate::tensor::checked_dims(
        &dims.iter().map(|&d| d as i64).collect::<Vec<_>>(),
        dtype,
        "ConstantOfShape",
    )?
    .iter()
    .product();
    if n > crate::import::FOLD_LIMIT {
        // Too large to hold at import: the fill value broadcast to the shape.
        return Ok(vec![cx.g.expand(cx.g.scalar(v, dtype), &dims)?]);
    }
    let data = TensorData::from_f64(dtype, &vec![v; n]);
    Ok(vec![cx.g.constant(data, &dims)?])
}

fn range(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let dt = cx.dtype(0)?;
    let mut first = |i: usize| -> Result<f64> {
        cx.konst(i)?
            .to_f64_vec()
            .first()
            .copied()
            .ok_or_else(|| Error::invalid("Range", format!("input {i} is empty")))
    };
    let (start, limit, delta) = (first(0)?, first(1)?, first(2)?);
    if delta == 0.0 {
        return Err(Error::invalid("Range", "delta is zero"));
    }
    let n = ((limit - start) / delta).ceil().max(0.0);
    if n > (1u64 << 32) as f64 {
        return Err(Error::invalid("Range", format!("{n} elements is too many")));
    }
    let values: Vec<f64> = (0..n as usize).map(|i| start + i as f64 * delta).collect();
    let len = values.len();
    Ok(vec![
        cx.g.constant(TensorData::from_f64(dt, &values), &[len])?,
    ])
}

fn eye_like(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let dims = cx.dims(0)?;
    if dims.len() != 2 {
        return Err(Error::invalid("EyeLike", "input must be 2-D"));
    }
    let dtype = if cx.has_attr("dtype") {
        dtype_from_onnx(cx.attr_i("dtype", 1) as i32, "EyeLike dtype")?
    } else {
        cx.dtype(0)?
    };
    let k = cx.attr_i("k", 0);
    let (r, c) = (dims[0], dims[1]);
    let v: Vec<f64> = (0..r * c)
        .map(|i| (((i % c) as i64 - (i / c) as i64) == k) as u8 as f64)
        .collect();
    Ok(vec![cx.g.constant(TensorData::from_f64(dtype, &v), &dims)?])
}

fn trilu(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let dims = cx.dims(0)?;
    if dims.len() < 2 {
        return Err(Error::invalid("Trilu", "input must have rank 2 or more"));
    }
    let k = match cx.opt_ints(1)? {
        Some(v) => v.first().copied().unwrap_or(0),
        None => 0,
    };
    let upper = cx.attr_i("upper", 1) != 0;
    let (r, c) = (dims[dims.len() - 2], dims[dims.len() - 1]);
    let keep: Vec<bool> = (0..r * c)
        .map(|i| {
            let d = (i % c) as i64 - (i / c) as i64;
            if upper { d >= k } else { d <= k }
        })
        .collect();
    let mask = cx.g.constant(TensorData::Bool(keep), &[r, c])?;
    let x = cx.input(0)?;
    let zero = cx.g.scalar(0.0, cx.dtype(0)?);
    Ok(vec![cx.g.select(mask, x, zero)?])
}

fn one_hot(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let depth = cx.konst(1)?.to_f64_vec().first().copied().unwrap_or(0.0);
    let depth = size(depth as i64, "OneHot depth")?;
    let vdt = cx.dtype(2)?;
    let rank = cx.shape(0)?.rank();
    let a = cx.attr_i("axis", -1);
    let a = if a < 0 { a + rank as i64 + 1 } else { a };
    if !(0..=rank as i64).contains(&a) {
        return Err(Error::invalid("OneHot", format!("axis {a} out of range")));
    }
    let mut idx = cx.input(0)?;
    if cx.dtype(0)?.is_float() {
        idx = cx.g.cast(idx, DType::I64)?;
    }
    let values = cx.input(2)?;
    let hot = cx.g.one_hot(idx, depth, DType::Bool)?;
    let off = cx.g.slice(values, 0, 0, 1, 1)?;
    let on = cx.g.slice(values, 0, 1, 2, 1)?;
    let mut y = cx.g.select(hot, on, off)?;
    if a as usize != rank {
        let mut perm: Vec<usize> = (0..rank).collect();
        perm.insert(a as usize, rank);
        y = cx.g.permute(y, &perm)?;
    }
    let _ = vdt;
    Ok(vec![y])
}

fn topk(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let k = if cx.opset < 10 {
        cx.attr_i("k", 0)
    } else {
        cx.ints(1)?.first().copied().unwrap_or(0)
    };
    let k = size(k, "TopK k")?;
    let rank = cx.shape(0)?.rank();
    let a = axis(cx.attr_i("axis", -1), rank)?;
    let largest = cx.attr_i("largest", 1) != 0;
    if cx.attr_i("sorted", 1) == 0 {
        // Any order is allowed; sorted is one of them.
    }
    let x = cx.input(0)?;
    let (v, i) = cx.g.topk(x, k, a as isize, largest)?;
    Ok(vec![v, i])
}

fn depth_to_space(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let d = cx.dims(0)?;
    let b = size(cx.attr_i("blocksize", 0), "blocksize")?;
    if d.len() != 4 || b == 0 || !d[1].is_multiple_of(b * b) {
        return Err(Error::invalid(
            "DepthToSpace",
            format!("input {d:?}, blocksize {b}"),
        ));
    }
    let (n, c, h, w) = (d[0], d[1], d[2], d[3]);
    let x = cx.input(0)?;
    let crd = cx.attr_s("mode", "DCR") == "CRD";
    let (split, perm) = if crd {
        (vec![n, c / (b * b), b, b, h, w], [0, 1, 4, 2, 5, 3])
    } else {
        (vec![n, b, b, c / (b * b), h, w], [0, 3, 4, 1, 5, 2])
    };
    let y = cx.g.permute(cx.g.reshape(x, &split)?, &perm)?;
    Ok(vec![cx.g.reshape(y, &[n, c / (b * b), h * b, w * b])?])
}

fn space_to_depth(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let d = cx.dims(0)?;
    let b = size(cx.attr_i("blocksize", 0), "blocksize")?;
    if d.len() != 4 || b == 0 || !d[2].is_multiple_of(b) || !d[3].is_multiple_of(b) {
        return Err(Error::invalid(
            "SpaceToDepth",
            format!("input {d:?}, blocksize {b}"),
        ));
    }
    let (n, c, h, w) = (d[0], d[1], d[2], d[3]);
    let x = cx.input(0)?;
    let y = cx.g.reshape(x, &[n, c, h / b, b, w / b, b])?;
    let y = cx.g.permute(y, &[0, 3, 5, 1, 2, 4])?;
    Ok(vec![cx.g.reshape(y, &[n, c * b * b, h / b, w / b])?])
}

#[allow(dead_code)]
fn same_dtype(cx: &Cx, x: NodeId, like: &Shape) -> Result<NodeId> {
    cast_to(cx, x, like.dtype())
}

/// Integer indices as `i64` with negative ones counted from the end of `dims`
/// (broadcast against the indices' last axis when `dims` has several entries).
/// For every element of a `dims`-shaped index tensor, its flat offset into a
/// `data`-shaped tensor counting every coordinate except the one along `axis` (the
/// constant part of a gather or scatter along `axis`).
pub(super) fn offsets_off_axis(dims: &[usize], data: &[usize], axis: usize) -> Vec<i64> {
    let strides = rlx_ir::contiguous_strides(data);
    let own = rlx_ir::contiguous_strides(dims);
    let n: usize = dims.iter().product();
    (0..n)
        .map(|flat| {
            (0..dims.len())
                .filter(|&k| k != axis)
                .map(|k| ((flat / own[k]) % dims[k].max(1) * strides[k]) as i64)
                .sum()
        })
        .collect()
}

pub(super) fn wrap_indices(cx: &Cx, idx: NodeId, dims: &[usize]) -> Result<NodeId> {
    let idx = cast_to(cx, idx, DType::I64)?;
    let d = if dims.len() == 1 {
        cx.g.scalar(dims[0] as f64, DType::I64)
    } else {
        let v: Vec<i64> = dims.iter().map(|&x| x as i64).collect();
        cx.g.constant(TensorData::I64(v), &[dims.len()])?
    };
    let neg = cx.g.lt(idx, cx.g.scalar(0.0, DType::I64))?;
    cx.g.select(neg, cx.g.add(idx, d)?, idx)
}

/// `Gather`. One index that the model fixes is a slice of one entry, reshaped to
/// the output's dims: a view where the entry is contiguous (torchvision's attention
/// picks its queries, keys and values out of one product this way), where a gather
/// copies it.
fn gather(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let data = cx.input(0)?;
    let dims = cx.dims(0)?;
    let a = axis(cx.attr_i("axis", 0), dims.len())?;
    if let Some(index) = cx
        .fixed(1)
        .filter(|k| k.len() == 1 && k.data.dtype().is_int())
    {
        let n = dims[a] as i64;
        let i = index.to_i64_vec()[0];
        let i = if i < 0 { i + n } else { i };
        if (0..n).contains(&i) {
            let entry =
                cx.g.slice(data, a as isize, i as isize, i as isize + 1, 1)?;
            let out: Vec<usize> = dims[..a]
                .iter()
                .chain(&index.dims)
                .chain(&dims[a + 1..])
                .copied()
                .collect();
            return Ok(vec![cx.g.reshape(entry, &out)?]);
        }
    }
    let idx = cx.input(1)?;
    Ok(vec![cx.g.gather(data, idx, a as isize)?])
}

/// `out[p] = data[p with p[axis] = indices[p]]`: one flat gather at offsets made of
/// a constant part (the other coordinates) plus the index times the axis stride.
fn gather_elements(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let dd = cx.dims(0)?;
    let id = cx.dims(1)?;
    let rank = dd.len();
    if id.len() != rank {
        return Err(Error::invalid(
            "GatherElements",
            format!("indices {id:?} and data {dd:?} differ in rank"),
        ));
    }
    let a = axis(cx.attr_i("axis", 0), rank)?;
    if id
        .iter()
        .zip(&dd)
        .enumerate()
        .any(|(k, (i, d))| k != a && i > d)
    {
        return Err(Error::invalid(
            "GatherElements",
            format!("indices {id:?} exceed data {dd:?}"),
        ));
    }
    let strides = rlx_ir::contiguous_strides(&dd);
    let base = offsets_off_axis(&id, &dd, a);
    let (data, idx) = (cx.input(0)?, cx.input(1)?);
    let idx = wrap_indices(cx, idx, &[dd[a]])?;
    let base = cx.g.constant(TensorData::I64(base), &id)?;
    let lin = cx.g.add(
        cx.g.mul(idx, cx.g.scalar(strides[a] as f64, DType::I64))?,
        base,
    )?;
    let total: usize = dd.iter().product();
    let flat = cx.g.reshape(data, &[total])?;
    Ok(vec![cx.g.gather(flat, lin, 0)?])
}

/// `GatherND`: each index row addresses a slice of `data`; the rows become offsets
/// into `data` with its first `batch_dims + k` axes flattened.
fn gather_nd(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let dd = cx.dims(0)?;
    let id = cx.dims(1)?;
    let b = size(cx.attr_i("batch_dims", 0), "batch_dims")?;
    let k = *id
        .last()
        .ok_or_else(|| Error::invalid("GatherND", "indices must have rank 1 or more"))?;
    if b + k > dd.len() || b >= id.len() || id[..b] != dd[..b] {
        return Err(Error::invalid(
            "GatherND",
            format!("indices {id:?} do not address data {dd:?} with batch_dims {b}"),
        ));
    }
    let rows: Vec<usize> = id[..id.len() - 1].to_vec();
    let n_rows: usize = rows.iter().product();
    let addressed = &dd[b..b + k];
    let span: usize = addressed.iter().product();
    let mut strides = vec![1i64; k];
    for j in (0..k.saturating_sub(1)).rev() {
        strides[j] = strides[j + 1] * addressed[j + 1] as i64;
    }
    // Batch offset of each row: its position among the batch dims times the span.
    let per_batch: usize = rows[b..].iter().product();
    let base: Vec<i64> = (0..n_rows)
        .map(|r| ((r / per_batch.max(1)) * span) as i64)
        .collect();
    let (data, idx) = (cx.input(0)?, cx.input(1)?);
    let idx = wrap_indices(cx, idx, addressed)?;
    let lin = if k == 0 {
        cx.g.constant(TensorData::I64(vec![0; n_rows]), &rows)?
    } else {
        let s = cx.g.constant(TensorData::I64(strides), &[k])?;
        cx.g.sum(cx.g.mul(idx, s)?, &[-1], false)?
    };
    let lin =
        cx.g.add(lin, cx.g.constant(TensorData::I64(base), &rows)?)?;
    let lead: usize = dd[..b + k].iter().product();
    let mut flat_dims = vec![lead];
    flat_dims.extend_from_slice(&dd[b + k..]);
    let flat = cx.g.reshape(data, &flat_dims)?;
    Ok(vec![cx.g.gather(flat, lin, 0)?])
}
