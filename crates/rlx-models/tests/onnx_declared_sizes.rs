//! A model may declare sizes far past any memory. Converters build what such sizes
//! need (index ranges, masks, coordinate grids, zero states) in the graph rather
//! than on the host, so the import never tries to allocate them: the too-large
//! model is an error from the compile, and the session still runs a small one.

mod common;

use common::onnx::{FLOAT, INT64, attr_int, int64s, model, node, value};
use rlx_ir::TensorData;
use rlx_models::onnx::OnnxSession;
use rlx_onnx::{ImportOptions, OnnxModel, Tensor};
use rlx_runtime::CompileOptions;
use std::collections::BTreeMap;

/// Far past memory, yet every element count fits in `usize`.
const HUGE: i64 = 1 << 20;

fn session(bytes: &[u8]) -> OnnxSession {
    let model = OnnxModel::from_bytes(bytes, None, "test.onnx").expect("the model parses");
    OnnxSession::new(model, CompileOptions::new())
}

fn rejected(bytes: &[u8], what: &str) {
    let mut s = session(bytes);
    let e = s
        .prepare(&ImportOptions::new())
        .map(|_| ())
        .expect_err(what);
    assert!(!e.to_string().is_empty(), "{what}");
}

fn f32s(dims: &[usize], values: Vec<f32>) -> Tensor {
    Tensor {
        dims: dims.to_vec(),
        data: TensorData::F32(values),
    }
}

#[test]
fn affine_grid_of_a_huge_size_is_an_error() {
    let grid = |size: &[i64]| {
        model(
            20,
            vec![node("AffineGrid", &["theta", "size"], &["grid"], vec![])],
            vec![int64s("size", &[4], size)],
            vec![value("theta", FLOAT, Some(&[1, 2, 3]))],
            vec![value("grid", FLOAT, None)],
        )
    };
    rejected(&grid(&[1, 1, HUGE, HUGE]), "a 2^40-point grid");
    // The identity transform of a 2 x 3 grid: the cell centres.
    let mut s = session(&grid(&[1, 1, 2, 3]));
    let theta = f32s(&[1, 2, 3], vec![1.0, 0.0, 0.0, 0.0, 1.0, 0.0]);
    let out = s.run(&[("theta", &theta)], &BTreeMap::new()).unwrap();
    let TensorData::F32(y) = &out[0].1.data else {
        panic!("f32 output expected")
    };
    let third = 2.0 / 3.0;
    let want = [
        -third, -0.5, 0.0, -0.5, third, -0.5, //
        -third, 0.5, 0.0, 0.5, third, 0.5,
    ];
    assert_eq!(out[0].1.dims, [1, 2, 3, 2]);
    for (g, w) in y.iter().zip(want) {
        assert!((g - w).abs() < 1e-6, "{y:?}");
    }
}

#[test]
fn dropout_mask_of_a_huge_input_is_an_error() {
    let bytes = |dims: &[i64]| {
        model(
            13,
            vec![node("Dropout", &["x"], &["y", "mask"], vec![])],
            vec![],
            vec![value("x", FLOAT, Some(dims))],
            vec![value("y", FLOAT, None), value("mask", 9, None)],
        )
    };
    rejected(&bytes(&[HUGE, HUGE]), "a 2^40-element mask");
    let mut s = session(&bytes(&[2, 2]));
    let x = f32s(&[2, 2], vec![1.0, -2.0, 3.0, -4.0]);
    let out = s.run(&[("x", &x)], &BTreeMap::new()).unwrap();
    assert_eq!(out[0].1.data, x.data);
    assert_eq!(out[1].1.data, TensorData::Bool(vec![true; 4]));
}

#[test]
fn reverse_sequence_of_a_huge_input_is_an_error() {
    let bytes = |t: i64, b: i64| {
        model(
            10,
            vec![node(
                "ReverseSequence",
                &["x", "lens"],
                &["y"],
                vec![attr_int("time_axis", 0), attr_int("batch_axis", 1)],
            )],
            vec![],
            vec![
                value("x", FLOAT, Some(&[t, b])),
                value("lens", INT64, Some(&[b])),
            ],
            vec![value("y", FLOAT, None)],
        )
    };
    rejected(&bytes(HUGE, HUGE), "2^20 steps of 2^20 sequences");
    let mut s = session(&bytes(3, 2));
    let x = f32s(&[3, 2], vec![0.0, 10.0, 1.0, 11.0, 2.0, 12.0]);
    let lens = Tensor {
        dims: vec![2],
        data: TensorData::I64(vec![3, 2]),
    };
    let out = s
        .run(&[("x", &x), ("lens", &lens)], &BTreeMap::new())
        .unwrap();
    assert_eq!(
        out[0].1.data,
        TensorData::F32(vec![2.0, 11.0, 1.0, 10.0, 0.0, 12.0])
    );
}

#[test]
fn stft_of_a_huge_signal_is_an_error() {
    let bytes = |len: i64| {
        model(
            17,
            vec![node("STFT", &["x", "step", "", "frame"], &["y"], vec![])],
            vec![int64s("step", &[], &[1]), int64s("frame", &[], &[2])],
            vec![value("x", FLOAT, Some(&[1, len, 1]))],
            vec![value("y", FLOAT, None)],
        )
    };
    rejected(&bytes(1 << 31), "2^31 frames");
    // Frames of two: the sum and the difference of neighbours.
    let mut s = session(&bytes(3));
    let x = f32s(&[1, 3, 1], vec![1.0, 2.0, 4.0]);
    let out = s.run(&[("x", &x)], &BTreeMap::new()).unwrap();
    assert_eq!(out[0].1.dims, [1, 2, 2, 2]);
    let TensorData::F32(y) = &out[0].1.data else {
        panic!("f32 output expected")
    };
    let want = [3.0, 0.0, -1.0, 0.0, 6.0, 0.0, -2.0, 0.0];
    for (g, w) in y.iter().zip(want) {
        assert!((g - w).abs() < 1e-6, "{y:?}");
    }
}

#[test]
fn causal_conv_state_of_huge_channels_is_an_error() {
    let bytes = |c: i64| {
        model(
            27,
            vec![node(
                "CausalConvWithState",
                &["x", "w"],
                &["y", "state"],
                vec![],
            )],
            vec![],
            vec![
                value("x", FLOAT, Some(&[1, c, 1])),
                value("w", FLOAT, Some(&[c, 1, 2])),
            ],
            vec![value("y", FLOAT, None), value("state", FLOAT, None)],
        )
    };
    rejected(&bytes(1 << 36), "a zero state of 2^36 channels");
    // No carried state: the first step sees zeros before it.
    let mut s = session(&bytes(2));
    let x = f32s(&[1, 2, 1], vec![3.0, 5.0]);
    let w = f32s(&[2, 1, 2], vec![7.0, 2.0, 11.0, 0.5]);
    let out = s.run(&[("x", &x), ("w", &w)], &BTreeMap::new()).unwrap();
    assert_eq!(out[0].1.data, TensorData::F32(vec![6.0, 2.5]));
    assert_eq!(out[1].1.data, TensorData::F32(vec![3.0, 5.0]));
}
