//! Import-time folding gives the same results as the unfolded graph: a per-channel
//! multiply and add after a convolution (a batch norm as exporters write it), and a
//! BatchNormalization node, fold into the convolution's weights and bias.

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

mod common;
use common::values;

const FLOAT: i32 = 1;

fn value(name: &str, dims: &[i64]) -> ValueInfoProto {
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(FLOAT),
                shape: Some(TensorShapeProto {
                    dim: dims
                        .iter()
                        .map(|&d| Dimension {
                            value: Some(dimension::Value::DimValue(d)),
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

fn init(name: &str, dims: &[i64], values: &[f32]) -> TensorProto {
    TensorProto {
        name: Some(name.into()),
        dims: dims.to_vec(),
        data_type: Some(FLOAT),
        float_data: values.to_vec(),
        ..Default::default()
    }
}

fn node(op: &str, inputs: &[&str], output: &str, attrs: Vec<AttributeProto>) -> NodeProto {
    NodeProto {
        op_type: Some(op.into()),
        name: Some(output.into()),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: vec![output.into()],
        attribute: attrs,
        ..Default::default()
    }
}

fn ints(name: &str, v: &[i64]) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        ints: v.to_vec(),
        r#type: Some(7),
        ..Default::default()
    }
}

/// Conv (3 -> 5 channels, 3x3, pad 1) with bias, then `tail`, then Relu. The
/// per-channel tensors are initializers when `known`, graph inputs otherwise.
fn model(tail: &str, known: bool) -> (Vec<u8>, Vec<(String, Tensor)>) {
    let c = 5i64;
    let per: Vec<(&str, Vec<i64>, Vec<f32>)> = match tail {
        "affine" => vec![
            (
                "s",
                vec![1, c, 1, 1],
                values(5, 3).iter().map(|v| v + 1.5).collect(),
            ),
            ("t", vec![c, 1, 1], values(5, 4)),
        ],
        _ => vec![
            (
                "gamma",
                vec![c],
                values(5, 5).iter().map(|v| v + 1.5).collect(),
            ),
            ("beta", vec![c], values(5, 6)),
            ("mean", vec![c], values(5, 7)),
            (
                "var",
                vec![c],
                values(5, 8).iter().map(|v| v + 1.5).collect(),
            ),
        ],
    };
    let mut initializer = vec![
        init("w", &[c, 3, 3, 3], &values(5 * 27, 1)),
        init("b", &[c], &values(5, 2)),
    ];
    let mut inputs = vec![value("x", &[2, 3, 6, 7])];
    let mut feeds = Vec::new();
    for (name, dims, v) in &per {
        if known {
            initializer.push(init(name, dims, v));
        } else {
            inputs.push(value(name, dims));
            feeds.push((
                name.to_string(),
                Tensor {
                    dims: dims.iter().map(|&d| d as usize).collect(),
                    data: TensorData::F32(v.clone()),
                },
            ));
        }
    }
    let conv = node(
        "Conv",
        &["x", "w", "b"],
        "conv",
        vec![ints("pads", &[1, 1, 1, 1]), ints("kernel_shape", &[3, 3])],
    );
    let mut nodes = vec![conv];
    let last = if tail == "affine" {
        nodes.push(node("Mul", &["conv", "s"], "scaled", vec![]));
        nodes.push(node("Add", &["t", "scaled"], "shifted", vec![]));
        "shifted"
    } else {
        nodes.push(node(
            "BatchNormalization",
            &["conv", "gamma", "beta", "mean", "var"],
            "normed",
            vec![],
        ));
        "normed"
    };
    nodes.push(node("Relu", &[last], "y", vec![]));
    let bytes = ModelProto {
        ir_version: Some(8),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(17),
        }],
        graph: Some(GraphProto {
            name: Some("g".into()),
            node: nodes,
            initializer,
            input: inputs,
            output: vec![value("y", &[2, c, 6, 7])],
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec();
    (bytes, feeds)
}

/// The output, and the op names of the imported graph.
fn run(bytes: &[u8], extra: &[(String, Tensor)]) -> (Vec<f32>, Vec<String>) {
    let model = OnnxModel::from_bytes(bytes, None, "fold.onnx").unwrap();
    let mut session = OnnxSession::new(model, CompileOptions::new());
    let x = Tensor {
        dims: vec![2, 3, 6, 7],
        data: TensorData::F32(values(2 * 3 * 42, 9)),
    };
    let mut feeds: Vec<(&str, &Tensor)> = vec![("x", &x)];
    feeds.extend(extra.iter().map(|(n, t)| (n.as_str(), t)));
    let out = session.run(&feeds, &BTreeMap::new()).unwrap();
    let TensorData::F32(v) = &out[0].1.data else {
        panic!("f32 output expected")
    };
    let mut options = rlx_onnx::ImportOptions::new();
    for (n, t) in &feeds {
        options = options.input_value(*n, (*t).clone());
    }
    let imported = OnnxModel::from_bytes(bytes, None, "fold.onnx")
        .unwrap()
        .import(&options)
        .unwrap();
    let ops = imported.graph.nodes().iter().map(|n| n.op.name()).collect();
    (v.clone(), ops)
}

#[test]
fn per_channel_affine_and_batch_norm_fold_into_the_convolution() {
    for tail in ["affine", "batchnorm"] {
        let (folded_model, _) = model(tail, true);
        let (plain_model, feeds) = model(tail, false);
        let (folded, folded_ops) = run(&folded_model, &[]);
        let (plain, plain_ops) = run(&plain_model, &feeds);
        assert_eq!(folded.len(), plain.len());
        for (i, (a, b)) in folded.iter().zip(&plain).enumerate() {
            assert!(
                (a - b).abs() <= 1e-5 * (1.0 + b.abs()),
                "{tail}: element {i}: folded {a} vs {b}"
            );
        }
        assert!(folded.iter().any(|&v| v > 0.0) && folded.contains(&0.0));
        // Folded: no per-channel arithmetic left after the convolution.
        let arithmetic = |ops: &[String]| ops.iter().filter(|o| *o == "mul" || *o == "add").count();
        assert_eq!(arithmetic(&folded_ops), 0, "{tail}: {folded_ops:?}");
        assert!(arithmetic(&plain_ops) > 0, "{tail}: {plain_ops:?}");
    }
}

/// `model` with the batch of `x` and `y` symbolic.
fn symbolic_batch(bytes: &[u8]) -> Vec<u8> {
    let mut m = ModelProto::decode(bytes).unwrap();
    let graph = m.graph.as_mut().unwrap();
    for v in graph.input.iter_mut().chain(graph.output.iter_mut()) {
        if let Some(type_proto::Value::TensorType(t)) =
            v.r#type.as_mut().and_then(|t| t.value.as_mut())
            && let Some(shape) = t.shape.as_mut()
        {
            shape.dim[0].value = Some(dimension::Value::DimParam("batch".into()));
        }
    }
    m.encode_to_vec()
}

#[test]
fn bindings_of_one_session_share_weights_and_match_fresh_sessions() {
    let (bytes, _) = model("batchnorm", true);
    let bytes = symbolic_batch(&bytes);
    let load = || {
        OnnxSession::new(
            OnnxModel::from_bytes(&bytes, None, "fold.onnx").unwrap(),
            CompileOptions::new(),
        )
    };
    let mut shared = load();
    for (batch, seed) in [(2, 11), (3, 12), (1, 13), (3, 14)] {
        let x = Tensor {
            dims: vec![batch, 3, 6, 7],
            data: TensorData::F32(values(batch * 3 * 42, seed)),
        };
        let got = shared.run(&[("x", &x)], &BTreeMap::new()).unwrap();
        let want = load().run(&[("x", &x)], &BTreeMap::new()).unwrap();
        assert_eq!(got[0].1.dims, vec![batch, 5, 6, 7]);
        assert_eq!(got[0].1.data, want[0].1.data, "batch {batch}");
    }
}

/// `Expand(x [2, 1], Concat([2], n))`: the target shape is computed from the graph
/// input `n`, so each value of `n` is a specialization of its own.
fn expand_by_input() -> Vec<u8> {
    let int_value = |name: &str, dims: &[i64]| {
        let mut v = value(name, dims);
        if let Some(type_proto::Value::TensorType(t)) =
            v.r#type.as_mut().and_then(|t| t.value.as_mut())
        {
            t.elem_type = Some(7);
        }
        v
    };
    let two = TensorProto {
        name: Some("two".into()),
        dims: vec![1],
        data_type: Some(7),
        int64_data: vec![2],
        ..Default::default()
    };
    ModelProto {
        ir_version: Some(8),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(17),
        }],
        graph: Some(GraphProto {
            name: Some("g".into()),
            node: vec![
                NodeProto {
                    attribute: vec![AttributeProto {
                        name: Some("axis".into()),
                        i: Some(0),
                        r#type: Some(2),
                        ..Default::default()
                    }],
                    ..node("Concat", &["two", "n"], "shape", vec![])
                },
                node("Expand", &["x", "shape"], "y", vec![]),
            ],
            initializer: vec![two],
            input: vec![value("x", &[2, 1]), int_value("n", &[1])],
            output: vec![value("y", &[2, -1])],
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

#[test]
fn a_shape_computed_from_a_given_input_specializes_on_its_value() {
    let bytes = expand_by_input();
    let mut session = OnnxSession::new(
        OnnxModel::from_bytes(&bytes, None, "expand.onnx").unwrap(),
        CompileOptions::new(),
    );
    let x = Tensor {
        dims: vec![2, 1],
        data: TensorData::F32(vec![1.5, -2.0]),
    };
    for n in [3i64, 5, 3] {
        let count = Tensor {
            dims: vec![1],
            data: TensorData::I64(vec![n]),
        };
        let out = session
            .run(&[("x", &x), ("n", &count)], &BTreeMap::new())
            .unwrap();
        let n = n as usize;
        assert_eq!(out[0].1.dims, vec![2, n]);
        let mut want = vec![1.5f32; n];
        want.extend(vec![-2.0f32; n]);
        assert_eq!(out[0].1.data, TensorData::F32(want), "n = {n}");
    }
    // Without a value for `n`, the shape cannot be known: an error, not a panic.
    let mut blind = OnnxSession::new(
        OnnxModel::from_bytes(&bytes, None, "expand.onnx").unwrap(),
        CompileOptions::new(),
    );
    let mut options = rlx_onnx::ImportOptions::new();
    options = options.input_dims("n", &[1]);
    assert!(blind.prepare(&options).is_err());
}

/// `If (n > 2)` over `x: [4]`: the then-branch reshapes to `[2, 2]`, the else-branch
/// to `[3, -1]`, which no 4 elements fit. The condition is computed from the given
/// `n`, so only the taken branch has to import.
fn if_with_a_branch_that_cannot_import() -> Vec<u8> {
    use common::onnx::{INT64, int64s, model, node as onnx_node, value as onnx_value};
    let branch = |name: &str, shape: &[i64]| GraphProto {
        name: Some(name.into()),
        node: vec![onnx_node("Reshape", &["x", "shape"], &["out"], vec![])],
        initializer: vec![int64s("shape", &[2], shape)],
        output: vec![onnx_value("out", FLOAT, None)],
        ..Default::default()
    };
    let subgraph = |name: &str, g: GraphProto| AttributeProto {
        name: Some(name.into()),
        g: Some(g),
        r#type: Some(5),
        ..Default::default()
    };
    model(
        17,
        vec![
            onnx_node("Greater", &["n", "two"], &["cond"], vec![]),
            onnx_node(
                "If",
                &["cond"],
                &["y"],
                vec![
                    subgraph("then_branch", branch("then", &[2, 2])),
                    subgraph("else_branch", branch("else", &[3, -1])),
                ],
            ),
        ],
        vec![int64s("two", &[1], &[2])],
        vec![
            onnx_value("x", FLOAT, Some(&[4])),
            onnx_value("n", INT64, Some(&[1])),
        ],
        vec![onnx_value("y", FLOAT, None)],
    )
}

#[test]
fn a_branch_left_untaken_by_a_given_input_need_not_import() {
    let bytes = if_with_a_branch_that_cannot_import();
    let mut session = OnnxSession::new(
        OnnxModel::from_bytes(&bytes, None, "if.onnx").unwrap(),
        CompileOptions::new(),
    );
    let x = Tensor {
        dims: vec![4],
        data: TensorData::F32(vec![1.0, 2.0, 3.0, 4.0]),
    };
    let n = |v: i64| Tensor {
        dims: vec![1],
        data: TensorData::I64(vec![v]),
    };
    let out = session
        .run(&[("x", &x), ("n", &n(5))], &BTreeMap::new())
        .expect("the then-branch is taken");
    assert_eq!(out[0].1.dims, vec![2, 2]);
    assert_eq!(out[0].1.data, x.data);
    // Taking the branch that cannot import is the branch's error.
    let e = session
        .run(&[("x", &x), ("n", &n(1))], &BTreeMap::new())
        .expect_err("the else-branch cannot reshape 4 elements to [3, -1]");
    assert!(e.to_string().contains("Reshape"), "{e}");
    // And the session still runs the good case.
    assert!(
        session
            .run(&[("x", &x), ("n", &n(3))], &BTreeMap::new())
            .is_ok()
    );
}
