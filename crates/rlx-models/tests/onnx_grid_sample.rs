//! `GridSample` (2-D) for every mode, padding mode and corner alignment against a
//! plain per-pixel reference, on a grid that reaches well outside `[-1, 1]`.

use prost::Message;
use rlx_ir::TensorData;
use rlx_models::onnx::OnnxSession;
use rlx_onnx::proto::{
    AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorShapeProto,
    TypeProto, ValueInfoProto, tensor_shape_proto::Dimension, tensor_shape_proto::dimension,
    type_proto,
};
use rlx_onnx::{OnnxModel, Tensor};
use rlx_runtime::CompileOptions;
use std::collections::BTreeMap;

mod common;
use common::values;

fn value(name: &str, dims: &[usize]) -> ValueInfoProto {
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(1),
                shape: Some(TensorShapeProto {
                    dim: dims
                        .iter()
                        .map(|&d| Dimension {
                            value: Some(dimension::Value::DimValue(d as i64)),
                            ..Default::default()
                        })
                        .collect(),
                }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn text(name: &str, v: &str) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        s: Some(v.as_bytes().to_vec()),
        r#type: Some(3),
        ..Default::default()
    }
}

fn model(x: &[usize], grid: &[usize], mode: &str, padding: &str, align: bool) -> Vec<u8> {
    let y = [x[0], x[1], grid[1], grid[2]];
    ModelProto {
        ir_version: Some(8),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(20),
        }],
        graph: Some(GraphProto {
            name: Some("gs".into()),
            node: vec![NodeProto {
                op_type: Some("GridSample".into()),
                name: Some("gs".into()),
                input: vec!["x".into(), "grid".into()],
                output: vec!["y".into()],
                attribute: vec![
                    text("mode", mode),
                    text("padding_mode", padding),
                    AttributeProto {
                        name: Some("align_corners".into()),
                        i: Some(i64::from(align)),
                        r#type: Some(2),
                        ..Default::default()
                    },
                ],
                ..Default::default()
            }],
            input: vec![value("x", x), value("grid", grid)],
            output: vec![value("y", &y)],
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

/// Folds `x` back into `[lo, hi]` by reflecting at the ends.
fn reflect(x: f64, lo: f64, hi: f64) -> f64 {
    let range = hi - lo;
    if range <= 0.0 {
        return lo;
    }
    if x < lo {
        let d = lo - x;
        let n = (d / range).floor();
        let r = d - n * range;
        if n % 2.0 == 0.0 { lo + r } else { hi - r }
    } else if x > hi {
        let d = x - hi;
        let n = (d / range).floor();
        let r = d - n * range;
        if n % 2.0 == 0.0 { hi - r } else { lo + r }
    } else {
        x
    }
}

/// The reference: one output pixel of one channel plane `[h, w]`.
fn sample(
    plane: &[f32],
    (h, w): (usize, usize),
    (gx, gy): (f64, f64),
    mode: &str,
    padding: &str,
    align: bool,
) -> f64 {
    let bounds = |len: usize| {
        if align {
            (0.0, len as f64 - 1.0)
        } else {
            (-0.5, len as f64 - 0.5)
        }
    };
    let place = |g: f64, len: usize| {
        let mut v = if align {
            (g + 1.0) / 2.0 * (len as f64 - 1.0)
        } else {
            ((g + 1.0) * len as f64 - 1.0) / 2.0
        };
        if mode == "nearest" {
            v = v.round_ties_even();
        }
        let (lo, hi) = bounds(len);
        if v < lo || v > hi {
            v = match padding {
                "border" => v.clamp(0.0, len as f64 - 1.0),
                "reflection" => reflect(v, lo, hi),
                _ => v,
            };
        }
        v
    };
    let pixel = |i: i64, j: i64| -> f64 {
        let fix = |t: i64, len: usize| -> Option<usize> {
            match padding {
                "zeros" => (0..len as i64).contains(&t).then_some(t as usize),
                "border" => Some(t.clamp(0, len as i64 - 1) as usize),
                _ => {
                    let (lo, hi) = bounds(len);
                    Some((reflect(t as f64, lo, hi) as i64).clamp(0, len as i64 - 1) as usize)
                }
            }
        };
        match (fix(i, h), fix(j, w)) {
            (Some(i), Some(j)) => f64::from(plane[i * w + j]),
            _ => 0.0,
        }
    };
    let (y, x) = (place(gy, h), place(gx, w));
    let cubic = |d: f64| -> [f64; 4] {
        let a = -0.75;
        let far = |t: f64| ((a * t - 5.0 * a) * t + 8.0 * a) * t - 4.0 * a;
        let near = |t: f64| ((a + 2.0) * t - (a + 3.0)) * t * t + 1.0;
        [far(d + 1.0), near(d), near(1.0 - d), far(2.0 - d)]
    };
    match mode {
        "nearest" => pixel(y as i64, x as i64),
        "linear" => {
            let (y0, x0) = (y.floor(), x.floor());
            let (fy, fx) = (y - y0, x - x0);
            let (y0, x0) = (y0 as i64, x0 as i64);
            pixel(y0, x0) * (1.0 - fy) * (1.0 - fx)
                + pixel(y0, x0 + 1) * (1.0 - fy) * fx
                + pixel(y0 + 1, x0) * fy * (1.0 - fx)
                + pixel(y0 + 1, x0 + 1) * fy * fx
        }
        _ => {
            let (y0, x0) = (y.floor(), x.floor());
            let (wy, wx) = (cubic(y - y0), cubic(x - x0));
            let (y0, x0) = (y0 as i64, x0 as i64);
            let mut total = 0.0;
            for (a, wa) in wy.iter().enumerate() {
                for (b, wb) in wx.iter().enumerate() {
                    total += wa * wb * pixel(y0 - 1 + a as i64, x0 - 1 + b as i64);
                }
            }
            total
        }
    }
}

#[test]
fn grid_sample_matches_the_reference_in_every_mode() {
    let (n, c, h, w) = (2, 3, 5, 6);
    let (oh, ow) = (4, 7);
    let x = values(n * c * h * w, 1);
    // Coordinates in [-1.7, 1.7): many outside the input, some far outside.
    let grid: Vec<f32> = values(n * oh * ow * 2, 2).iter().map(|v| v * 1.7).collect();
    for mode in ["nearest", "linear", "cubic"] {
        for padding in ["zeros", "border", "reflection"] {
            for align in [false, true] {
                let bytes = model(&[n, c, h, w], &[n, oh, ow, 2], mode, padding, align);
                let m = OnnxModel::from_bytes(&bytes, None, "gs.onnx").unwrap();
                let mut session = OnnxSession::new(m, CompileOptions::new());
                let xt = Tensor {
                    dims: vec![n, c, h, w],
                    data: TensorData::F32(x.clone()),
                };
                let gt = Tensor {
                    dims: vec![n, oh, ow, 2],
                    data: TensorData::F32(grid.clone()),
                };
                let out = session
                    .run(&[("x", &xt), ("grid", &gt)], &BTreeMap::new())
                    .unwrap();
                let TensorData::F32(got) = &out[0].1.data else {
                    panic!("f32 output expected")
                };
                for b in 0..n {
                    for ch in 0..c {
                        let plane = &x[(b * c + ch) * h * w..][..h * w];
                        for i in 0..oh {
                            for j in 0..ow {
                                let g = ((b * oh + i) * ow + j) * 2;
                                let want = sample(
                                    plane,
                                    (h, w),
                                    (f64::from(grid[g]), f64::from(grid[g + 1])),
                                    mode,
                                    padding,
                                    align,
                                );
                                let got = f64::from(got[((b * c + ch) * oh + i) * ow + j]);
                                assert!(
                                    (got - want).abs() <= 1e-5 * (1.0 + want.abs()),
                                    "{mode} {padding} align={align} at ({b}, {ch}, {i}, {j}): {got} against {want}"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}
