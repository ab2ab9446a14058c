//! `Resize` and `Upsample`. Interpolation is separable, so each resized axis is done
//! on its own: the importer works out, for every output position, which input
//! positions it reads and with what weight (the shapes are fixed, so this is known at
//! import), and the graph gathers those positions and sums them with constant weights.
//! Nearest-neighbour sampling is a single gather, exact for every dtype.

use super::{Converter, axes, axis, size, unsupported};
use crate::import::Cx;
use rlx_ir::{DType, Error, NodeId, Result, TensorData};

pub(super) const NAMES: &[&str] = &["Resize", "Upsample"];

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "Resize" => resize,
        "Upsample" => resize,
        _ => return None,
    })
}

/// How output coordinates map back to input coordinates.
#[derive(Clone, Copy, PartialEq)]
enum Transform {
    HalfPixel,
    HalfPixelSymmetric,
    PytorchHalfPixel,
    AlignCorners,
    Asymmetric,
    TfCropAndResize,
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Nearest(Rounding),
    Linear,
    Cubic(f64),
}

/// How nearest sampling rounds a fractional coordinate.
#[derive(Clone, Copy, PartialEq)]
enum Rounding {
    PreferFloor,
    PreferCeil,
    Floor,
    Ceil,
}

/// Everything about one resize that does not depend on the axis.
struct Settings {
    mode: Mode,
    transform: Transform,
    antialias: bool,
    exclude_outside: bool,
}

/// The taps of one resized axis: `index[k][o]` is the input position that tap `k`
/// of output `o` reads, `weight[k][o]` its weight; `outside[o]` marks outputs that
/// take the extrapolation value.
struct Taps {
    index: Vec<Vec<i64>>,
    weight: Vec<Vec<f64>>,
    outside: Option<Vec<bool>>,
}

fn resize(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let dims = cx.dims(0)?;
    let rank = dims.len();
    let dt = cx.dtype(0)?;
    let legacy = cx.node.op_type() == "Upsample" || cx.opset < 11;

    let (roi, scales, sizes) = if legacy {
        let scales = if cx.has(1) {
            cx.konst(1)?.to_f64_vec()
        } else {
            cx.attr_floats("scales")
                .ok_or_else(|| Error::invalid("Upsample", "no scales given"))?
                .into_iter()
                .map(f64::from)
                .collect()
        };
        (None, Some(scales), None)
    } else {
        let non_empty = |t: Option<std::rc::Rc<crate::tensor::Tensor>>| t.filter(|t| !t.is_empty());
        let roi = if cx.has(1) {
            non_empty(Some(cx.konst(1)?)).map(|t| t.to_f64_vec())
        } else {
            None
        };
        let scales = if cx.has(2) {
            non_empty(Some(cx.konst(2)?)).map(|t| t.to_f64_vec())
        } else {
            None
        };
        let sizes = if cx.has(3) {
            non_empty(Some(cx.konst(3)?)).map(|t| t.to_i64_vec())
        } else {
            None
        };
        (roi, scales, sizes)
    };
    let list = match cx.attr_ints("axes") {
        Some(a) => {
            // Validated (in range, no repeats) but kept in the given order.
            axes(&a, rank)?;
            a.iter()
                .map(|&v| axis(v, rank))
                .collect::<Result<Vec<_>>>()?
        }
        None => (0..rank).collect(),
    };
    let n = list.len();

    let settings = settings(cx, legacy)?;
    if matches!(settings.mode, Mode::Linear | Mode::Cubic(_)) && !dt.is_float() {
        return Err(unsupported(format!(
            "{} interpolation of {dt} data",
            cx.attr_s("mode", "nearest")
        )));
    }

    // Per-axis scale and output size over the full rank, as the operator defines them.
    let mut scale = vec![1.0f64; rank];
    let mut out = dims.clone();
    match (scales, sizes) {
        (Some(s), None) => {
            if s.len() != n {
                return Err(Error::invalid(
                    "scales",
                    format!("{} values for {n} resized axes", s.len()),
                ));
            }
            for (&a, &v) in list.iter().zip(&s) {
                if !(v > 0.0 && v.is_finite()) {
                    return Err(Error::invalid("scales", format!("{v} must be positive")));
                }
                scale[a] = v;
                out[a] = (v * dims[a] as f64) as usize;
            }
        }
        (None, Some(z)) => {
            if z.len() != n {
                return Err(Error::invalid(
                    "sizes",
                    format!("{} values for {n} resized axes", z.len()),
                ));
            }
            for (&a, &v) in list.iter().zip(&z) {
                out[a] = size(v, "Resize size")?;
                if dims[a] == 0 {
                    return Err(Error::invalid("Resize", format!("axis {a} is empty")));
                }
                scale[a] = out[a] as f64 / dims[a] as f64;
            }
            let policy = cx.attr_s("keep_aspect_ratio_policy", "stretch");
            if policy != "stretch" {
                let pick = list.iter().map(|&a| scale[a]);
                let s = match policy.as_str() {
                    "not_larger" => pick.fold(f64::INFINITY, f64::min),
                    "not_smaller" => pick.fold(f64::NEG_INFINITY, f64::max),
                    other => {
                        return Err(unsupported(format!("keep_aspect_ratio_policy = '{other}'")));
                    }
                };
                for &a in &list {
                    scale[a] = s;
                    out[a] = (s * dims[a] as f64 + 0.5) as usize;
                }
            }
        }
        (Some(_), Some(_)) => {
            return Err(Error::invalid(
                "Resize",
                "both scales and sizes are given; exactly one is allowed",
            ));
        }
        (None, None) => {
            return Err(Error::invalid(
                "Resize",
                "neither scales nor sizes is given",
            ));
        }
    }
    let roi_of = |a: usize| -> Result<(f64, f64)> {
        let roi = roi.as_ref().ok_or_else(|| {
            Error::invalid("Resize", "tf_crop_and_resize needs a region of interest")
        })?;
        let k = list.iter().position(|&b| b == a).unwrap_or(0);
        if roi.len() != 2 * n {
            return Err(Error::invalid(
                "roi",
                format!("{} values for {n} resized axes", roi.len()),
            ));
        }
        Ok((roi[k], roi[n + k]))
    };
    let extrapolation = f64::from(cx.attr_f("extrapolation_value", 0.0));

    let mut x = cx.input(0)?;
    let mut cur = dims.clone();
    for &a in &list {
        let crop = if settings.transform == Transform::TfCropAndResize {
            Some(roi_of(a)?)
        } else {
            None
        };
        let trivial_roi = crop.is_none_or(|(s, e)| s == 0.0 && e == 1.0);
        if (scale[a] - 1.0).abs() < 1e-9 && out[a] == dims[a] && trivial_roi {
            continue;
        }
        let taps = taps(&settings, dims[a], out[a], scale[a], crop);
        x = apply(cx, x, &cur, a, &taps, dt, extrapolation)?;
        cur[a] = out[a];
    }
    Ok(vec![x])
}

fn settings(cx: &Cx, legacy: bool) -> Result<Settings> {
    let rounding = if legacy {
        Rounding::Floor
    } else {
        match cx.attr_s("nearest_mode", "round_prefer_floor").as_str() {
            "round_prefer_floor" => Rounding::PreferFloor,
            "round_prefer_ceil" => Rounding::PreferCeil,
            "floor" => Rounding::Floor,
            "ceil" => Rounding::Ceil,
            other => return Err(unsupported(format!("nearest_mode = '{other}'"))),
        }
    };
    let mode = match cx.attr_s("mode", "nearest").as_str() {
        "nearest" => Mode::Nearest(rounding),
        "linear" | "bilinear" | "trilinear" => Mode::Linear,
        "cubic" | "bicubic" => Mode::Cubic(f64::from(cx.attr_f("cubic_coeff_a", -0.75))),
        other => return Err(unsupported(format!("mode = '{other}'"))),
    };
    let transform = if legacy {
        Transform::Asymmetric
    } else {
        match cx
            .attr_s("coordinate_transformation_mode", "half_pixel")
            .as_str()
        {
            "half_pixel" => Transform::HalfPixel,
            "half_pixel_symmetric" => Transform::HalfPixelSymmetric,
            "pytorch_half_pixel" => Transform::PytorchHalfPixel,
            "align_corners" => Transform::AlignCorners,
            "asymmetric" => Transform::Asymmetric,
            "tf_crop_and_resize" => Transform::TfCropAndResize,
            other => {
                return Err(unsupported(format!(
                    "coordinate_transformation_mode = '{other}'"
                )));
            }
        }
    };
    let antialias = cx.attr_i("antialias", 0) != 0;
    if antialias && matches!(mode, Mode::Nearest(_)) {
        return Err(unsupported("antialias with nearest sampling"));
    }
    Ok(Settings {
        mode,
        transform,
        antialias,
        exclude_outside: cx.attr_i("exclude_outside", 0) != 0,
    })
}

/// The input coordinate that output position `y` samples; `None` when it lies
/// outside a crop-and-resize region (the output is the extrapolation value).
fn source_coordinate(
    t: Transform,
    y: f64,
    scale: f64,
    input: usize,
    output: usize,
    crop: Option<(f64, f64)>,
) -> Option<f64> {
    let inw = input as f64;
    let outw = scale * inw;
    Some(match t {
        Transform::AlignCorners if outw == 1.0 => 0.0,
        Transform::AlignCorners => y * (inw - 1.0) / (outw - 1.0),
        Transform::Asymmetric => y / scale,
        Transform::TfCropAndResize => {
            let (s, e) = crop.unwrap_or((0.0, 1.0));
            let x = if outw == 1.0 {
                (e - s) * (inw - 1.0) / 2.0
            } else {
                y * (e - s) * (inw - 1.0) / (outw - 1.0)
            } + s * (inw - 1.0);
            if x < 0.0 || x > inw - 1.0 {
                return None;
            }
            x
        }
        Transform::PytorchHalfPixel if outw == 1.0 => -0.5,
        Transform::PytorchHalfPixel | Transform::HalfPixel => (y + 0.5) / scale - 0.5,
        Transform::HalfPixelSymmetric => {
            let adjustment = output as f64 / outw;
            let offset = inw / 2.0 * (1.0 - adjustment);
            offset + (y + 0.5) / scale - 0.5
        }
    })
}

/// The cubic convolution kernel with parameter `a`, at distance `x`.
fn cubic_kernel(x: f64, a: f64) -> f64 {
    let x = x.abs();
    if x <= 1.0 {
        ((a + 2.0) * x - (a + 3.0)) * x * x + 1.0
    } else if x < 2.0 {
        ((a * x - 5.0 * a) * x + 8.0 * a) * x - 4.0 * a
    } else {
        0.0
    }
}

/// The weights of the taps around a coordinate whose distance past its left
/// neighbour is `ratio` (in `(0, 1]`), leftmost tap first.
fn coefficients(s: &Settings, ratio: f64, scale: f64) -> Vec<f64> {
    match s.mode {
        Mode::Nearest(r) => {
            let right = if ratio == 1.0 {
                true
            } else {
                match r {
                    Rounding::PreferFloor => ratio > 0.5,
                    Rounding::PreferCeil => ratio >= 0.5,
                    Rounding::Floor => false,
                    Rounding::Ceil => true,
                }
            };
            vec![f64::from(u8::from(!right)), f64::from(u8::from(right))]
        }
        Mode::Linear if s.antialias => {
            // The triangle filter stretched by 1 / scale when shrinking.
            let sc = scale.min(1.0);
            let start = (-1.0 / sc).floor() as i64 + 1;
            let footprint = 2 - 2 * start;
            let w: Vec<f64> = (start..start + footprint)
                .map(|i| (1.0 - ((i as f64 - ratio) * sc).abs()).clamp(0.0, 1.0))
                .collect();
            normalized(w)
        }
        Mode::Linear => vec![1.0 - ratio, ratio],
        Mode::Cubic(a) if s.antialias => {
            let sc = scale.min(1.0);
            let start = (-2.0 / sc).floor() as i64 + 1;
            let w: Vec<f64> = (start..2 - start)
                .map(|i| cubic_kernel(sc * (i as f64 - ratio), a))
                .collect();
            normalized(w)
        }
        Mode::Cubic(a) => [1.0 + ratio, ratio, 1.0 - ratio, 2.0 - ratio]
            .iter()
            .map(|&d| cubic_kernel(d, a))
            .collect(),
    }
}

fn normalized(w: Vec<f64>) -> Vec<f64> {
    let sum: f64 = w.iter().sum();
    w.into_iter().map(|v| v / sum).collect()
}

fn taps(s: &Settings, input: usize, output: usize, scale: f64, crop: Option<(f64, f64)>) -> Taps {
    let mut index: Vec<Vec<i64>> = Vec::new();
    let mut weight: Vec<Vec<f64>> = Vec::new();
    let mut outside = vec![false; output];
    for o in 0..output {
        let Some(x) = source_coordinate(s.transform, o as f64, scale, input, output, crop) else {
            outside[o] = true;
            continue;
        };
        let ratio = if x == x.floor() { 1.0 } else { x - x.floor() };
        let mut w = coefficients(s, ratio, scale);
        let n = w.len();
        if index.len() < n {
            index.resize(n, vec![0; output]);
            weight.resize(n, vec![0.0; output]);
        }
        // The n positions nearest x, ties to the left, found on the edge-padded axis.
        let pad = n.div_ceil(2) as f64;
        let xp = x + pad;
        let p = xp.floor();
        let frac = xp - p;
        let half = (n / 2) as i64;
        let offset = if n.is_multiple_of(2) {
            if frac == 0.0 { -half } else { -half + 1 }
        } else {
            let base = -(((n - 1) / 2) as i64);
            if frac <= 0.5 { base } else { base + 1 }
        };
        let start = p as i64 + offset - pad as i64;
        let idx: Vec<i64> = (0..n as i64).map(|k| start + k).collect();
        if s.exclude_outside {
            for (wk, &i) in w.iter_mut().zip(&idx) {
                if i < 0 || i >= input as i64 {
                    *wk = 0.0;
                }
            }
            let sum: f64 = w.iter().sum();
            let sum = if sum == 0.0 { 1.0 } else { sum };
            w.iter_mut().for_each(|v| *v /= sum);
        }
        for k in 0..n {
            index[k][o] = idx[k].clamp(0, input as i64 - 1);
            weight[k][o] = w[k];
        }
    }
    Taps {
        index,
        weight,
        outside: outside.iter().any(|&b| b).then_some(outside),
    }
}

/// Resamples axis `a` of `x` (dims `cur`) through `taps`.
fn apply(
    cx: &Cx,
    x: NodeId,
    cur: &[usize],
    a: usize,
    taps: &Taps,
    dt: DType,
    extrapolation: f64,
) -> Result<NodeId> {
    let out = taps
        .outside
        .as_ref()
        .map_or_else(|| taps.index.first().map_or(0, Vec::len), Vec::len);
    // Shape that lines a per-output vector up with axis `a`.
    let mut along = vec![1usize; cur.len()];
    along[a] = out;
    let y = if taps.index.is_empty() || out == 0 {
        // Every output is outside the crop (or there are none): only the fill remains.
        let mut d = cur.to_vec();
        d[a] = out;
        let n: usize = d.iter().product();
        cx.g.constant(TensorData::from_f64(dt, &vec![extrapolation; n]), &d)?
    } else if dt.is_float() {
        // Every tap in one pass: positions and weights as `[taps, out]` constants
        // (a nearest pick is one tap of weight 1, exact).
        let (mut index, mut weight) = (Vec::new(), Vec::new());
        let mut count = 0;
        let single;
        let rows: Vec<(&Vec<i64>, &Vec<f64>)> =
            if taps.weight.len() == 2 && is_selection(&taps.weight) {
                single = (
                    (0..out)
                        .map(|o| taps.index[usize::from(taps.weight[1][o] > 0.5)][o])
                        .collect::<Vec<i64>>(),
                    vec![1.0; out],
                );
                vec![(&single.0, &single.1)]
            } else {
                taps.index
                    .iter()
                    .zip(&taps.weight)
                    .filter(|(_, w)| w.iter().any(|&v| v != 0.0))
                    .collect()
            };
        for (i, w) in rows {
            index.extend_from_slice(i);
            weight.extend_from_slice(w);
            count += 1;
        }
        let index = cx.g.constant(TensorData::I64(index), &[count, out])?;
        let weight =
            cx.g.constant(TensorData::from_f64(dt, &weight), &[count, out])?;
        cx.g.interpolate(x, index, weight, a as isize)?
    } else if matches!(taps.weight.len(), 2) && is_selection(&taps.weight) {
        // Nearest: one of the two taps has weight 1 at every output.
        let pick: Vec<i64> = (0..out)
            .map(|o| {
                if taps.weight[1][o] > 0.5 {
                    taps.index[1][o]
                } else {
                    taps.index[0][o]
                }
            })
            .collect();
        let idx = cx.g.constant(TensorData::I64(pick), &[out])?;
        cx.g.gather(x, idx, a as isize)?
    } else {
        let mut sum: Option<NodeId> = None;
        for (index, weight) in taps.index.iter().zip(&taps.weight) {
            if weight.iter().all(|&w| w == 0.0) {
                continue;
            }
            let idx = cx.g.constant(TensorData::I64(index.clone()), &[out])?;
            let w = cx.g.constant(TensorData::from_f64(dt, weight), &along)?;
            let term = cx.g.mul(cx.g.gather(x, idx, a as isize)?, w)?;
            sum = Some(match sum {
                Some(s) => cx.g.add(s, term)?,
                None => term,
            });
        }
        match sum {
            Some(s) => s,
            None => {
                let mut d = cur.to_vec();
                d[a] = out;
                let n: usize = d.iter().product();
                cx.g.constant(TensorData::from_f64(dt, &vec![0.0; n]), &d)?
            }
        }
    };
    match &taps.outside {
        Some(mask) => {
            let m = cx.g.constant(TensorData::Bool(mask.clone()), &along)?;
            cx.g.select(m, cx.g.scalar(extrapolation, dt), y)
        }
        None => Ok(y),
    }
}

/// Whether two-tap weights pick exactly one tap (weight 1) at every output.
fn is_selection(w: &[Vec<f64>]) -> bool {
    w[0].iter()
        .zip(&w[1])
        .all(|(&l, &r)| (l == 1.0 && r == 0.0) || (l == 0.0 && r == 1.0))
}
