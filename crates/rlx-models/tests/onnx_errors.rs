//! Bad ONNX input is answered with an error that says what is wrong, and the session
//! that rejected it still runs a good request afterwards.

use prost::Message;
use rlx_ir::{Error, TensorData};
use rlx_models::onnx::OnnxSession;
use rlx_onnx::proto::{
    GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorShapeProto, TypeProto,
    ValueInfoProto, tensor_shape_proto::Dimension, tensor_shape_proto::dimension, type_proto,
};
use rlx_onnx::{ImportOptions, OnnxModel, Tensor};
use rlx_runtime::CompileOptions;
use std::collections::BTreeMap;

const FLOAT: i32 = 1;

/// A dim: a number, or a symbol name.
enum D {
    N(i64),
    S(&'static str),
}

fn value(name: &str, dims: &[D]) -> ValueInfoProto {
    let dim = dims
        .iter()
        .map(|d| Dimension {
            value: Some(match d {
                D::N(n) => dimension::Value::DimValue(*n),
                D::S(s) => dimension::Value::DimParam(s.to_string()),
            }),
            ..Default::default()
        })
        .collect();
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(FLOAT),
                shape: Some(TensorShapeProto { dim }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn node(op: &str, inputs: &[&str], outputs: &[&str]) -> NodeProto {
    NodeProto {
        op_type: Some(op.into()),
        name: Some(format!("{op}_{}", outputs.join("_"))),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        ..Default::default()
    }
}

fn model_bytes(
    nodes: Vec<NodeProto>,
    inputs: Vec<ValueInfoProto>,
    outputs: Vec<ValueInfoProto>,
) -> Vec<u8> {
    ModelProto {
        ir_version: Some(8),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(17),
        }],
        graph: Some(GraphProto {
            name: Some("g".into()),
            node: nodes,
            input: inputs,
            output: outputs,
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

fn parse(bytes: &[u8]) -> rlx_ir::Result<OnnxModel> {
    OnnxModel::from_bytes(bytes, None, "test.onnx")
}

/// `y = relu(x) + x` over `x: [batch, 3]`.
fn good_model() -> OnnxModel {
    let bytes = model_bytes(
        vec![
            node("Relu", &["x"], &["r"]),
            node("Add", &["r", "x"], &["y"]),
        ],
        vec![value("x", &[D::S("batch"), D::N(3)])],
        vec![value("y", &[D::S("batch"), D::N(3)])],
    );
    parse(&bytes).expect("the good model parses")
}

fn tensor(dims: &[usize], values: Vec<f32>) -> Tensor {
    Tensor {
        dims: dims.to_vec(),
        data: TensorData::F32(values),
    }
}

/// Runs the good model at batch 2 and checks the result.
fn assert_still_runs(session: &mut OnnxSession) {
    let x = tensor(&[2, 3], vec![-1.0, 2.0, -3.0, 4.0, 0.5, -0.5]);
    let out = session
        .run(&[("x", &x)], &BTreeMap::new())
        .expect("a good request runs after a rejected one");
    assert_eq!(
        out[0].1.data,
        TensorData::F32(vec![-1.0, 4.0, -3.0, 8.0, 1.0, -0.5])
    );
}

fn session() -> OnnxSession {
    OnnxSession::new(good_model(), CompileOptions::new())
}

fn message(e: &Error) -> String {
    e.to_string()
}

#[test]
fn malformed_protobuf_is_an_error() {
    let good = model_bytes(
        vec![node("Relu", &["x"], &["y"])],
        vec![value("x", &[D::N(2)])],
        vec![value("y", &[D::N(2)])],
    );
    for bad in [
        &b"not a model at all"[..],
        &good[..good.len() / 2],
        &[0x0a, 0xff, 0xff, 0xff, 0xff, 0x0f][..],
    ] {
        let e = parse(bad)
            .map(|_| ())
            .expect_err("malformed bytes are rejected");
        assert!(message(&e).contains("test.onnx"), "{e}");
    }
    // A model without a graph parses as protobuf but is not a model.
    let empty = ModelProto::default().encode_to_vec();
    assert!(parse(&empty).is_err());
    assert!(parse(&good).is_ok());
}

#[test]
fn graph_with_a_cycle_is_an_error() {
    let bytes = model_bytes(
        vec![
            node("Add", &["x", "b"], &["a"]),
            node("Relu", &["a"], &["b"]),
        ],
        vec![value("x", &[D::N(2)])],
        vec![value("b", &[D::N(2)])],
    );
    let model = parse(&bytes).expect("parses");
    let e = model
        .import(&ImportOptions::new())
        .map(|_| ())
        .expect_err("a cycle is rejected");
    let m = message(&e);
    assert!(m.contains("cycle") && m.contains('b'), "{m}");
}

#[test]
fn dangling_input_name_is_an_error() {
    let bytes = model_bytes(
        vec![node("Add", &["x", "nowhere"], &["y"])],
        vec![value("x", &[D::N(2)])],
        vec![value("y", &[D::N(2)])],
    );
    let model = parse(&bytes).expect("parses");
    let e = model
        .import(&ImportOptions::new())
        .map(|_| ())
        .expect_err("rejected");
    let m = message(&e);
    assert!(m.contains("nowhere"), "{m}");
    // An output that nothing produces.
    let bytes = model_bytes(
        vec![node("Relu", &["x"], &["y"])],
        vec![value("x", &[D::N(2)])],
        vec![value("missing", &[D::N(2)])],
    );
    let e = parse(&bytes)
        .unwrap()
        .import(&ImportOptions::new())
        .map(|_| ())
        .expect_err("rejected");
    assert!(message(&e).contains("missing"), "{e}");
}

#[test]
fn shape_contradictions_are_errors() {
    // Operands that do not broadcast.
    let bytes = model_bytes(
        vec![node("Add", &["a", "b"], &["y"])],
        vec![
            value("a", &[D::N(2), D::N(3)]),
            value("b", &[D::N(4), D::N(5)]),
        ],
        vec![value("y", &[D::N(2), D::N(3)])],
    );
    let e = parse(&bytes)
        .unwrap()
        .import(&ImportOptions::new())
        .map(|_| ())
        .expect_err("rejected");
    let m = message(&e);
    assert!(m.contains("Add") && m.contains("broadcast"), "{m}");
    // A declared output shape the graph does not produce.
    let bytes = model_bytes(
        vec![node("Relu", &["x"], &["y"])],
        vec![value("x", &[D::N(2), D::N(3)])],
        vec![value("y", &[D::N(4)])],
    );
    let e = parse(&bytes)
        .unwrap()
        .import(&ImportOptions::new())
        .map(|_| ())
        .expect_err("rejected");
    assert!(message(&e).contains('y'), "{e}");
    // An input whose data disagrees with a fixed dim, or with itself.
    let mut s = session();
    let wrong = tensor(&[2, 4], vec![0.0; 8]);
    let e = s
        .run(&[("x", &wrong)], &BTreeMap::new())
        .map(|_| ())
        .expect_err("rejected");
    assert!(message(&e).contains('x'), "{e}");
    let torn = tensor(&[2, 3], vec![0.0; 5]);
    assert!(s.run(&[("x", &torn)], &BTreeMap::new()).is_err());
    assert_still_runs(&mut s);
}

#[test]
fn symbols_unbound_zero_or_negative_are_errors() {
    let mut s = session();
    // Unbound: nothing gives `batch` a size.
    let e = s
        .prepare(&ImportOptions::new())
        .map(|_| ())
        .expect_err("unbound symbol rejected");
    assert!(message(&e).contains("batch"), "{e}");
    assert_still_runs(&mut s);
    // Bound to zero.
    let e = s
        .prepare(&ImportOptions::new().symbol("batch", 0))
        .map(|_| ())
        .expect_err("zero rejected");
    assert!(message(&e).contains("batch"), "{e}");
    assert_still_runs(&mut s);
    // Negative, zero and malformed bindings from text (the CLI's --shape).
    for text in ["batch=-1", "batch=0", "batch", "=3", "batch=x"] {
        assert!(ImportOptions::parse_binding(text).is_err(), "{text}");
    }
    assert_eq!(
        ImportOptions::parse_binding("batch=4").unwrap(),
        ("batch".to_string(), 4)
    );
    // A binding that contradicts the data given.
    let x = tensor(&[2, 3], vec![0.0; 6]);
    let mut symbols = BTreeMap::new();
    symbols.insert("batch".to_string(), 5);
    let e = s
        .run(&[("x", &x)], &symbols)
        .map(|_| ())
        .expect_err("contradiction rejected");
    assert!(message(&e).contains("batch"), "{e}");
    assert_still_runs(&mut s);
}

#[test]
fn oversized_shapes_are_errors() {
    let big = 1i64 << 32;
    let bytes = model_bytes(
        vec![node("Relu", &["x"], &["y"])],
        vec![value("x", &[D::N(big), D::N(big)])],
        vec![value("y", &[D::N(big), D::N(big)])],
    );
    let model = parse(&bytes).expect("parses");
    let mut s = OnnxSession::new(model, CompileOptions::new());
    let e = s
        .prepare(&ImportOptions::new())
        .map(|_| ())
        .expect_err("oversized shape rejected");
    assert!(message(&e).contains('x'), "{e}");
    // A symbol bound past what memory can hold.
    let mut s = session();
    let e = s
        .prepare(&ImportOptions::new().symbol("batch", usize::MAX / 2))
        .map(|_| ())
        .expect_err("oversized binding rejected");
    assert!(!message(&e).is_empty());
    assert_still_runs(&mut s);
}

#[test]
fn nodes_listed_out_of_order_still_import() {
    // The file lists the consumer first; the importer orders nodes by their inputs.
    let bytes = model_bytes(
        vec![
            node("Add", &["r", "x"], &["y"]),
            node("Relu", &["x"], &["r"]),
        ],
        vec![value("x", &[D::S("batch"), D::N(3)])],
        vec![value("y", &[D::S("batch"), D::N(3)])],
    );
    let mut s = OnnxSession::new(parse(&bytes).unwrap(), CompileOptions::new());
    assert_still_runs(&mut s);
}
