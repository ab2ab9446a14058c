//! `DFT` with a transform length other than the signal's (zero padding, truncation),
//! forward and inverse, full and one-sided, against direct sums.

use prost::Message;
use rlx_ir::TensorData;
use rlx_models::onnx::OnnxSession;
use rlx_onnx::proto::{
    AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorProto,
    TensorShapeProto, TypeProto, ValueInfoProto, tensor_shape_proto::Dimension,
    tensor_shape_proto::dimension, type_proto,
};
use rlx_onnx::{OnnxModel, Tensor};
use rlx_runtime::CompileOptions;
use std::collections::BTreeMap;
use std::f64::consts::PI;

mod common;

fn value(name: &str, dims: Option<&[usize]>) -> ValueInfoProto {
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(11),
                shape: dims.map(|dims| TensorShapeProto {
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

fn flag(name: &str, on: bool) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        i: Some(i64::from(on)),
        r#type: Some(2),
        ..Default::default()
    }
}

/// One `DFT` node (opset 20, axis 1) over a `[2, len, parts]` f64 input.
fn run(x: &[f64], len: usize, parts: usize, n: usize, inverse: bool, onesided: bool) -> Vec<f64> {
    let scalar = |name: &str, v: i64| TensorProto {
        name: Some(name.into()),
        dims: vec![],
        data_type: Some(7),
        int64_data: vec![v],
        ..Default::default()
    };
    let bytes = ModelProto {
        ir_version: Some(9),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(20),
        }],
        graph: Some(GraphProto {
            name: Some("dft".into()),
            node: vec![NodeProto {
                op_type: Some("DFT".into()),
                name: Some("dft".into()),
                input: vec!["x".into(), "n".into(), "axis".into()],
                output: vec!["y".into()],
                attribute: vec![flag("inverse", inverse), flag("onesided", onesided)],
                ..Default::default()
            }],
            initializer: vec![scalar("n", n as i64), scalar("axis", 1)],
            input: vec![value("x", Some(&[2, len, parts]))],
            output: vec![value("y", None)],
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec();
    let model = OnnxModel::from_bytes(&bytes, None, "dft.onnx").unwrap();
    let mut session = OnnxSession::new(model, CompileOptions::new());
    let t = Tensor {
        dims: vec![2, len, parts],
        data: TensorData::F64(x.to_vec()),
    };
    let out = session.run(&[("x", &t)], &BTreeMap::new()).unwrap();
    let TensorData::F64(y) = &out[0].1.data else {
        panic!("f64 output expected")
    };
    y.clone()
}

fn signal(count: usize, seed: u64) -> Vec<f64> {
    (0..count)
        .map(|i| (((i as u64 + 1) * (seed * 7919 + 13)) % 1000) as f64 / 500.0 - 1.0)
        .collect()
}

#[test]
fn transform_lengths_other_than_the_signal_pad_or_truncate() {
    for (len, n) in [(6, 9), (9, 6), (7, 7), (8, 5)] {
        for parts in [1, 2] {
            let x = signal(2 * len * parts, (len * 10 + n + parts) as u64);
            let at = |b: usize, t: usize| -> (f64, f64) {
                if t >= len {
                    return (0.0, 0.0);
                }
                let base = (b * len + t) * parts;
                (x[base], if parts == 2 { x[base + 1] } else { 0.0 })
            };
            for (inverse, onesided) in [(false, false), (false, true), (true, false)] {
                let bins = if onesided { n / 2 + 1 } else { n };
                let got = run(&x, len, parts, n, inverse, onesided);
                assert_eq!(got.len(), 2 * bins * 2, "len {len} n {n}");
                let sign = if inverse { 1.0 } else { -1.0 };
                let scale = if inverse { 1.0 / n as f64 } else { 1.0 };
                for b in 0..2 {
                    for k in 0..bins {
                        let (mut re, mut im) = (0.0, 0.0);
                        for t in 0..n {
                            let (xr, xi) = at(b, t);
                            let angle = sign * 2.0 * PI * ((t * k) % n) as f64 / n as f64;
                            re += xr * angle.cos() - xi * angle.sin();
                            im += xr * angle.sin() + xi * angle.cos();
                        }
                        let o = (b * bins + k) * 2;
                        assert!(
                            (got[o] - re * scale).abs() < 1e-9
                                && (got[o + 1] - im * scale).abs() < 1e-9,
                            "len {len} n {n} parts {parts} inverse {inverse} onesided {onesided} bin {k}"
                        );
                    }
                }
            }
        }
    }
}

#[test]
fn a_one_sided_inverse_rebuilds_the_real_signal() {
    // The one-sided spectrum of a real signal, inverted at the signal's length
    // (odd and even), gives the signal back.
    for len in [7usize, 8] {
        let x = signal(2 * len, len as u64);
        let bins = len / 2 + 1;
        let mut spectrum = Vec::new();
        for b in 0..2 {
            for k in 0..bins {
                let (mut re, mut im) = (0.0, 0.0);
                for t in 0..len {
                    let angle = -2.0 * PI * ((t * k) % len) as f64 / len as f64;
                    re += x[b * len + t] * angle.cos();
                    im += x[b * len + t] * angle.sin();
                }
                spectrum.extend([re, im]);
            }
        }
        let got = run(&spectrum, bins, 2, len, true, true);
        assert_eq!(got.len(), 2 * len);
        for (g, w) in got.iter().zip(&x) {
            assert!((g - w).abs() < 1e-9, "len {len}: {g} against {w}");
        }
    }
}

#[test]
fn stft_without_window_or_frame_length_takes_the_whole_signal_as_one_frame() {
    use common::onnx::{FLOAT, int64s, model, node, value};
    let bytes = model(
        17,
        vec![node("STFT", &["x", "step"], &["y"], vec![])],
        vec![int64s("step", &[], &[1])],
        vec![value("x", FLOAT, Some(&[1, 4, 1]))],
        vec![value("y", FLOAT, None)],
    );
    let mut session = OnnxSession::new(
        OnnxModel::from_bytes(&bytes, None, "stft.onnx").unwrap(),
        CompileOptions::new(),
    );
    let x = Tensor {
        dims: vec![1, 4, 1],
        data: TensorData::F32(vec![1.0, 2.0, 3.0, 4.0]),
    };
    let out = session.run(&[("x", &x)], &BTreeMap::new()).unwrap();
    // One frame of 4, one-sided: bins 0..=2 of the DFT of [1, 2, 3, 4].
    assert_eq!(out[0].1.dims, vec![1, 1, 3, 2]);
    let TensorData::F32(y) = &out[0].1.data else {
        panic!("f32 output expected")
    };
    let want = [10.0, 0.0, -2.0, 2.0, -2.0, 0.0];
    for (g, w) in y.iter().zip(want) {
        assert!((g - w).abs() < 1e-5, "{y:?}");
    }
}
