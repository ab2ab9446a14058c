//! Writes the small seed corpora of the fuzz targets into `fuzz/seeds/TARGET/`:
//! a few tiny valid ONNX models (built from the prost structs), GGUF files (from the
//! project's GGUF writer) and safetensors files. Run it from `fuzz/` with
//! `cargo run -p rlx-fuzz-seedgen`; the seeds are committed, so only a change of
//! seeds needs it.

use prost::Message;
use rlx_gguf::{GgufBuilder, QuantFormat, TensorType, Value, ValueType};
use rlx_onnx::proto::{
    AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorProto,
    TensorShapeProto, TypeProto, ValueInfoProto, attribute_proto::AttributeType,
    tensor_shape_proto::Dimension, tensor_shape_proto::dimension, type_proto,
};
use std::path::Path;

const FLOAT: i32 = 1;
const INT64: i32 = 7;

enum D {
    N(i64),
    S(&'static str),
}

fn value(name: &str, elem: i32, dims: &[D]) -> ValueInfoProto {
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
                elem_type: Some(elem),
                shape: Some(TensorShapeProto { dim }),
            })),
            ..Default::default()
        }),
        ..Default::default()
    }
}

fn node(op: &str, inputs: &[&str], outputs: &[&str], attrs: Vec<AttributeProto>) -> NodeProto {
    NodeProto {
        op_type: Some(op.into()),
        name: Some(format!("{op}_{}", outputs.join("_"))),
        input: inputs.iter().map(|s| s.to_string()).collect(),
        output: outputs.iter().map(|s| s.to_string()).collect(),
        attribute: attrs,
        ..Default::default()
    }
}

fn attr_i(name: &str, i: i64) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Int as i32),
        i: Some(i),
        ..Default::default()
    }
}

fn attr_f(name: &str, f: f32) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Float as i32),
        f: Some(f),
        ..Default::default()
    }
}

fn attr_ints(name: &str, ints: &[i64]) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Ints as i32),
        ints: ints.to_vec(),
        ..Default::default()
    }
}

fn attr_t(name: &str, t: TensorProto) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        r#type: Some(AttributeType::Tensor as i32),
        t: Some(t),
        ..Default::default()
    }
}

/// A float initializer stored as `raw_data`.
fn floats_raw(name: &str, dims: &[i64], values: &[f32]) -> TensorProto {
    TensorProto {
        name: Some(name.into()),
        dims: dims.to_vec(),
        data_type: Some(FLOAT),
        raw_data: Some(values.iter().flat_map(|v| v.to_le_bytes()).collect()),
        ..Default::default()
    }
}

/// A float initializer stored in `float_data`.
fn floats(name: &str, dims: &[i64], values: &[f32]) -> TensorProto {
    TensorProto {
        name: Some(name.into()),
        dims: dims.to_vec(),
        data_type: Some(FLOAT),
        float_data: values.to_vec(),
        ..Default::default()
    }
}

fn ints(name: &str, dims: &[i64], values: &[i64]) -> TensorProto {
    TensorProto {
        name: Some(name.into()),
        dims: dims.to_vec(),
        data_type: Some(INT64),
        int64_data: values.to_vec(),
        ..Default::default()
    }
}

fn model(
    nodes: Vec<NodeProto>,
    inputs: Vec<ValueInfoProto>,
    outputs: Vec<ValueInfoProto>,
    initializer: Vec<TensorProto>,
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
            initializer,
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

fn ramp(n: usize) -> Vec<f32> {
    (0..n).map(|i| i as f32 * 0.25 - 1.0).collect()
}

fn onnx_seeds() -> Vec<(&'static str, Vec<u8>)> {
    vec![
        // y = relu(x) + x over [batch, 3].
        (
            "relu_add.onnx",
            model(
                vec![
                    node("Relu", &["x"], &["r"], vec![]),
                    node("Add", &["r", "x"], &["y"], vec![]),
                ],
                vec![value("x", FLOAT, &[D::S("batch"), D::N(3)])],
                vec![value("y", FLOAT, &[D::S("batch"), D::N(3)])],
                vec![],
            ),
        ),
        // A linear layer: MatMul by a raw_data weight, bias Add, Softmax.
        (
            "matmul_softmax.onnx",
            model(
                vec![
                    node("MatMul", &["x", "w"], &["m"], vec![]),
                    node("Add", &["m", "b"], &["a"], vec![]),
                    node("Softmax", &["a"], &["y"], vec![attr_i("axis", -1)]),
                ],
                vec![value("x", FLOAT, &[D::S("batch"), D::N(4)])],
                vec![value("y", FLOAT, &[D::S("batch"), D::N(2)])],
                vec![
                    floats_raw("w", &[4, 2], &ramp(8)),
                    floats("b", &[2], &[0.5, -0.5]),
                ],
            ),
        ),
        // Gemm with transB and alpha, then Sigmoid.
        (
            "gemm.onnx",
            model(
                vec![
                    node(
                        "Gemm",
                        &["x", "w", "c"],
                        &["g"],
                        vec![attr_i("transB", 1), attr_f("alpha", 0.5)],
                    ),
                    node("Sigmoid", &["g"], &["y"], vec![]),
                ],
                vec![value("x", FLOAT, &[D::N(2), D::N(3)])],
                vec![value("y", FLOAT, &[D::N(2), D::N(4)])],
                vec![floats("w", &[4, 3], &ramp(12)), floats("c", &[4], &ramp(4))],
            ),
        ),
        // Shape arithmetic folded at import: Shape, Gather, Concat feeding Reshape.
        (
            "shape_reshape.onnx",
            model(
                vec![
                    node("Shape", &["x"], &["s"], vec![]),
                    node("Gather", &["s", "i0"], &["n"], vec![attr_i("axis", 0)]),
                    node(
                        "Concat",
                        &["n", "minus1"],
                        &["target"],
                        vec![attr_i("axis", 0)],
                    ),
                    node("Reshape", &["x", "target"], &["r"], vec![]),
                    node(
                        "Transpose",
                        &["r"],
                        &["y"],
                        vec![attr_ints("perm", &[1, 0])],
                    ),
                ],
                vec![value("x", FLOAT, &[D::S("batch"), D::N(2), D::N(3)])],
                vec![value("y", FLOAT, &[D::N(6), D::S("batch")])],
                vec![ints("i0", &[1], &[0]), ints("minus1", &[1], &[-1])],
            ),
        ),
        // A 2-D convolution with padding and a Constant node, then MaxPool.
        (
            "conv_pool.onnx",
            model(
                vec![
                    node(
                        "Constant",
                        &[],
                        &["b"],
                        vec![attr_t("value", floats("", &[2], &[0.1, -0.1]))],
                    ),
                    node(
                        "Conv",
                        &["x", "w", "b"],
                        &["c"],
                        vec![
                            attr_ints("pads", &[1, 1, 1, 1]),
                            attr_ints("kernel_shape", &[3, 3]),
                        ],
                    ),
                    node(
                        "MaxPool",
                        &["c"],
                        &["y"],
                        vec![
                            attr_ints("kernel_shape", &[2, 2]),
                            attr_ints("strides", &[2, 2]),
                        ],
                    ),
                ],
                vec![value("x", FLOAT, &[D::N(1), D::N(1), D::N(4), D::N(4)])],
                vec![value("y", FLOAT, &[D::N(1), D::N(2), D::N(2), D::N(2)])],
                vec![floats_raw("w", &[2, 1, 3, 3], &ramp(18))],
            ),
        ),
        // Normalization and reductions: LayerNormalization, ReduceMean, Cast.
        (
            "layernorm_reduce.onnx",
            model(
                vec![
                    node(
                        "LayerNormalization",
                        &["x", "gamma", "beta"],
                        &["n"],
                        vec![attr_i("axis", -1), attr_f("epsilon", 1e-5)],
                    ),
                    node(
                        "ReduceMean",
                        &["n"],
                        &["m"],
                        vec![attr_ints("axes", &[-1]), attr_i("keepdims", 0)],
                    ),
                    node("Cast", &["m"], &["y"], vec![attr_i("to", INT64.into())]),
                ],
                vec![value("x", FLOAT, &[D::S("batch"), D::S("seq"), D::N(4)])],
                vec![value("y", INT64, &[D::S("batch"), D::S("seq")])],
                vec![
                    floats("gamma", &[4], &[1.0; 4]),
                    floats("beta", &[4], &[0.0; 4]),
                ],
            ),
        ),
    ]
}

fn le(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

fn gguf_seeds() -> Vec<(&'static str, Vec<u8>)> {
    let mut small = GgufBuilder::new();
    small
        .metadata("general.architecture", Value::String("llama".into()))
        .metadata("llama.block_count", Value::U32(1))
        .metadata("llama.rope.freq_base", Value::F32(10000.0))
        .metadata("general.flag", Value::Bool(true))
        .metadata(
            "tokenizer.ggml.tokens",
            Value::Array(
                ValueType::String,
                vec![Value::String("<s>".into()), Value::String("a".into())],
            ),
        )
        .metadata(
            "tokenizer.ggml.token_type",
            Value::Array(ValueType::I32, vec![Value::I32(3), Value::I32(1)]),
        );
    small
        .tensor("norm.weight", &[4], TensorType::F32, le(&ramp(4)))
        .unwrap()
        .tensor(
            "half.weight",
            &[2, 2],
            TensorType::F16,
            [0x00u8, 0x3c, 0x00, 0x40, 0x00, 0xc0, 0x00, 0x00].to_vec(),
        )
        .unwrap()
        .tensor(
            "bf.weight",
            &[2],
            TensorType::BF16,
            vec![0x80, 0x3f, 0x00, 0x40],
        )
        .unwrap();

    let mut quant = GgufBuilder::new();
    // The writer always aligns to 32, so the alignment key states that.
    quant.metadata("general.alignment", Value::U32(32));
    for (name, f) in [
        ("q4_0", QuantFormat::Q4_0),
        ("q8_0", QuantFormat::Q8_0),
        ("q4_k", QuantFormat::Q4K),
        ("q6_k", QuantFormat::Q6K),
    ] {
        let bytes: Vec<u8> = (0..f.block_bytes()).map(|i| (i * 37 % 251) as u8).collect();
        quant
            .tensor(name, &[f.block_len()], TensorType::Quant(f), bytes)
            .unwrap();
    }

    let mut empty = GgufBuilder::new();
    empty.metadata("general.name", Value::String("empty".into()));
    vec![
        ("small.gguf", small.to_bytes()),
        ("quant.gguf", quant.to_bytes()),
        ("empty.gguf", empty.to_bytes()),
    ]
}

fn safetensors_seeds() -> Vec<(&'static str, Vec<u8>)> {
    use safetensors::{Dtype, tensor::TensorView};
    let a = le(&ramp(6));
    let b: Vec<u8> = [1i64, -2, 3].iter().flat_map(|v| v.to_le_bytes()).collect();
    let c = vec![0x00u8, 0x3c, 0x00, 0xbc];
    let d = vec![1u8, 0, 1];
    let two = vec![
        (
            "embeddings.weight",
            TensorView::new(Dtype::F32, vec![2, 3], &a).unwrap(),
        ),
        ("ids", TensorView::new(Dtype::I64, vec![3], &b).unwrap()),
    ];
    let mixed = vec![
        ("h", TensorView::new(Dtype::F16, vec![2], &c).unwrap()),
        ("mask", TensorView::new(Dtype::BOOL, vec![3], &d).unwrap()),
        (
            "scalar",
            TensorView::new(Dtype::F32, vec![], &a[..4]).unwrap(),
        ),
    ];
    let meta = Some(std::collections::HashMap::from([(
        "format".to_string(),
        "pt".to_string(),
    )]));
    vec![
        (
            "two.safetensors",
            safetensors::serialize(two, meta).unwrap(),
        ),
        (
            "mixed.safetensors",
            safetensors::serialize(mixed, None).unwrap(),
        ),
        (
            "empty.safetensors",
            safetensors::serialize(Vec::<(&str, TensorView)>::new(), None).unwrap(),
        ),
    ]
}

/// Every seed is valid: it parses, and an ONNX seed imports.
fn check(target: &str, name: &str, bytes: &[u8]) {
    match target {
        "onnx" => {
            let model = rlx_onnx::OnnxModel::from_bytes(bytes, None, name).unwrap();
            let mut options = rlx_onnx::ImportOptions::new();
            for symbol in model.symbols() {
                options = options.symbol(symbol, 2);
            }
            if let Err(e) = model.import(&options) {
                panic!("{name} does not import: {e}");
            }
        }
        "gguf" => {
            let file = rlx_gguf::GgufFile::from_bytes(name, bytes.to_vec()).unwrap();
            for t in file.tensors() {
                file.tensor_f32(&t.name).unwrap();
            }
        }
        _ => {
            safetensors::SafeTensors::deserialize(bytes).unwrap();
        }
    }
}

fn main() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../seeds");
    for (target, seeds) in [
        ("onnx", onnx_seeds()),
        ("gguf", gguf_seeds()),
        ("safetensors", safetensors_seeds()),
    ] {
        let dir = root.join(target);
        std::fs::create_dir_all(&dir).unwrap();
        for (name, bytes) in seeds {
            assert!(bytes.len() < 20 * 1024, "{name} is over 20 KB");
            check(target, name, &bytes);
            std::fs::write(dir.join(name), &bytes).unwrap();
            println!("{target}/{name}: {} bytes", bytes.len());
        }
    }
}
