//! Sequences of tensors: sequence inputs and outputs (one tensor per element, named
//! `name[i]`), the sequence ops against plain reference computations, positions read
//! at run time, and the errors for bad positions, bad element names and a sequence
//! where a tensor belongs (after which the session still runs).

mod common;

use common::onnx::{FLOAT, INT64, attr_int, model, node, value};
use common::values;
use rlx_ir::{Error, TensorData};
use rlx_models::onnx::OnnxSession;
use rlx_onnx::proto::{TypeProto, ValueInfoProto, type_proto};
use rlx_onnx::{OnnxModel, Tensor};
use rlx_runtime::CompileOptions;
use std::collections::BTreeMap;

/// A sequence-of-float-tensors value.
fn sequence_value(name: &str) -> ValueInfoProto {
    let elem = value("e", FLOAT, None).r#type.expect("a type");
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::SequenceType(Box::new(
                type_proto::Sequence {
                    elem_type: Some(Box::new(elem)),
                },
            ))),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn floats(dims: &[usize], seed: u64) -> Tensor {
    Tensor {
        dims: dims.to_vec(),
        data: TensorData::F32(values(dims.iter().product(), seed)),
    }
}

fn scalar_i64(v: i64) -> Tensor {
    Tensor {
        dims: vec![],
        data: TensorData::I64(vec![v]),
    }
}

fn session(bytes: &[u8]) -> OnnxSession {
    let m = OnnxModel::from_bytes(bytes, None, "seq.onnx").expect("the model parses");
    OnnxSession::new(m, CompileOptions::new())
}

/// `out = SequenceAt(SequenceInsert(s, t), pos)`, `n = SequenceLength(...)`, and the
/// grown sequence itself as an output.
fn insert_at_model() -> Vec<u8> {
    model(
        17,
        vec![
            node("SequenceInsert", &["s", "t"], &["grown"], vec![]),
            node("SequenceAt", &["grown", "pos"], &["out"], vec![]),
            node("SequenceLength", &["grown"], &["n"], vec![]),
        ],
        vec![],
        vec![
            sequence_value("s"),
            value("t", FLOAT, None),
            value("pos", INT64, Some(&[])),
        ],
        vec![
            value("out", FLOAT, None),
            value("n", INT64, Some(&[])),
            sequence_value("grown"),
        ],
    )
}

#[test]
fn a_sequence_input_grows_and_is_read_at_run_time_positions() {
    let mut s = session(&insert_at_model());
    let (a, b, t) = (floats(&[2, 3], 1), floats(&[4], 2), floats(&[5, 1], 3));
    for (pos, want) in [(0, &a), (1, &b), (2, &t), (-1, &t), (-3, &a)] {
        let p = scalar_i64(pos);
        let out = s
            .run(
                &[("s[0]", &a), ("s[1]", &b), ("t", &t), ("pos", &p)],
                &BTreeMap::new(),
            )
            .expect("the sequence model runs");
        let names: Vec<&str> = out.iter().map(|(n, _)| n.as_str()).collect();
        assert_eq!(names, ["out", "n", "grown[0]", "grown[1]", "grown[2]"]);
        assert_eq!(&out[0].1, want, "SequenceAt at {pos}");
        assert_eq!(out[1].1.data, TensorData::I64(vec![3]));
        assert_eq!((&out[2].1, &out[3].1, &out[4].1), (&a, &b, &t));
    }
    // An empty sequence input: no elements given.
    let p = scalar_i64(0);
    let out = s
        .run(&[("t", &t), ("pos", &p)], &BTreeMap::new())
        .expect("an empty sequence grows to one element");
    assert_eq!(out[0].1, t);
    assert_eq!(out[1].1.data, TensorData::I64(vec![1]));
}

#[test]
fn bad_positions_and_element_names_are_errors_and_the_session_still_runs() {
    let mut s = session(&insert_at_model());
    let (a, t) = (floats(&[3], 4), floats(&[3], 5));
    for pos in [2, -3, 100] {
        let p = scalar_i64(pos);
        let e = s
            .run(&[("s[0]", &a), ("t", &t), ("pos", &p)], &BTreeMap::new())
            .expect_err("a position outside the sequence");
        assert!(matches!(e, Error::InvalidGraph { .. }), "{e}");
        assert!(e.to_string().contains("SequenceAt"), "{e}");
        assert!(e.to_string().contains("outside"), "{e}");
    }
    // Elements must be numbered from 0 without gaps.
    let p = scalar_i64(0);
    let e = s
        .run(&[("s[1]", &a), ("t", &t), ("pos", &p)], &BTreeMap::new())
        .expect_err("an element after a gap");
    assert!(matches!(e, Error::UnknownName { .. }), "{e}");
    let out = s
        .run(&[("s[0]", &a), ("t", &t), ("pos", &p)], &BTreeMap::new())
        .expect("a good request runs after rejected ones");
    assert_eq!(out[0].1, a);
}

#[test]
fn a_sequence_where_a_tensor_belongs_is_an_error() {
    let bytes = model(
        17,
        vec![
            node("SequenceConstruct", &["x", "x"], &["s"], vec![]),
            node("Relu", &["s"], &["y"], vec![]),
        ],
        vec![],
        vec![value("x", FLOAT, Some(&[2]))],
        vec![value("y", FLOAT, None)],
    );
    let mut s = session(&bytes);
    let x = floats(&[2], 6);
    let e = s
        .run(&[("x", &x)], &BTreeMap::new())
        .expect_err("Relu of a sequence");
    assert!(e.to_string().contains("a sequence"), "{e}");
}

/// `SplitToSequence` then `ConcatFromSequence` against slicing and stacking by hand,
/// with split sizes given as a run-time input, as a scalar chunk size, and not given.
#[test]
fn split_and_concat_match_slicing_and_stacking() {
    let (rows, cols) = (5usize, 7usize);
    let x = floats(&[rows, cols], 7);
    let xv = match &x.data {
        TensorData::F32(v) => v.clone(),
        _ => unreachable!(),
    };
    let column = |c: usize| -> Vec<f32> { (0..rows).map(|r| xv[r * cols + c]).collect() };

    // Not given, keepdims 0: one [rows] tensor per column; stacked on a new axis 0
    // they make the transpose.
    let bytes = model(
        17,
        vec![
            node(
                "SplitToSequence",
                &["x"],
                &["cols"],
                vec![attr_int("axis", 1), attr_int("keepdims", 0)],
            ),
            node(
                "ConcatFromSequence",
                &["cols"],
                &["t"],
                vec![attr_int("axis", 0), attr_int("new_axis", 1)],
            ),
        ],
        vec![],
        vec![value("x", FLOAT, Some(&[rows as i64, cols as i64]))],
        vec![value("t", FLOAT, None), sequence_value("cols")],
    );
    let out = session(&bytes)
        .run(&[("x", &x)], &BTreeMap::new())
        .expect("split and stack");
    let transposed: Vec<f32> = (0..cols).flat_map(column).collect();
    assert_eq!(out[0].1.dims, [cols, rows]);
    assert_eq!(out[0].1.data, TensorData::F32(transposed));
    assert_eq!(out.len(), 1 + cols);
    for (c, (name, t)) in out[1..].iter().enumerate() {
        assert_eq!(name, &format!("cols[{c}]"));
        assert_eq!(
            (t.dims.as_slice(), &t.data),
            (&[rows][..], &TensorData::F32(column(c)))
        );
    }

    // Sizes from a run-time input, and a scalar chunk size (the last piece shorter):
    // concatenated back along the split axis, they give the input.
    let bytes = model(
        17,
        vec![
            node(
                "SplitToSequence",
                &["x", "split"],
                &["parts"],
                vec![attr_int("axis", 1)],
            ),
            node("SequenceLength", &["parts"], &["n"], vec![]),
            node(
                "ConcatFromSequence",
                &["parts"],
                &["back"],
                vec![attr_int("axis", -1)],
            ),
        ],
        vec![],
        vec![
            value("x", FLOAT, Some(&[rows as i64, cols as i64])),
            value("split", INT64, None),
        ],
        vec![
            value("back", FLOAT, None),
            value("n", INT64, Some(&[])),
            sequence_value("parts"),
        ],
    );
    let mut s = session(&bytes);
    for (split, widths) in [
        (
            Tensor {
                dims: vec![3],
                data: TensorData::I64(vec![2, 0, 5]),
            },
            vec![2, 0, 5],
        ),
        (scalar_i64(3), vec![3, 3, 1]),
    ] {
        let out = s
            .run(&[("x", &x), ("split", &split)], &BTreeMap::new())
            .expect("split by sizes");
        assert_eq!(out[0].1, x);
        assert_eq!(out[1].1.data, TensorData::I64(vec![widths.len() as i64]));
        let mut start = 0;
        for (k, &w) in widths.iter().enumerate() {
            let piece = &out[2 + k].1;
            assert_eq!(piece.dims, [rows, w]);
            let want: Vec<f32> = (0..rows)
                .flat_map(|r| xv[r * cols + start..r * cols + start + w].to_vec())
                .collect();
            assert_eq!(piece.data, TensorData::F32(want));
            start += w;
        }
    }
    let bad = Tensor {
        dims: vec![2],
        data: TensorData::I64(vec![2, 2]),
    };
    let e = s
        .run(&[("x", &x), ("split", &bad)], &BTreeMap::new())
        .expect_err("sizes that do not sum to the axis");
    assert!(e.to_string().contains("does not sum"), "{e}");
}
