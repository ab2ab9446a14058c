//! Inputs the fuzzer (fuzz/, `scripts/fuzz.sh onnx`) found to panic the importer:
//! each must now parse-and-import to an error, as the fuzz target drives it (every
//! symbolic dim bound to 2).

use rlx_onnx::{ImportOptions, OnnxModel};

fn import(bytes: &[u8]) -> rlx_ir::Result<()> {
    let model = OnnxModel::from_bytes(bytes, None, "fuzz.onnx")?;
    let mut options = ImportOptions::new();
    for symbol in model.symbols() {
        options = options.symbol(symbol, 2);
    }
    model.import(&options).map(|_| ())
}

fn assert_error(bytes: &[u8], expected: &str) {
    let message = import(bytes)
        .expect_err("the input must be rejected")
        .to_string();
    assert!(
        message.contains(expected),
        "the error should mention '{expected}': {message}"
    );
}

/// `Attention` with a 3-D Q and a V whose shape has an unknown dim (so rank 2
/// once bound) indexed V's third dim.
#[test]
fn attention_with_v_of_lower_rank() {
    assert_error(
        include_bytes!("data/fuzz/attention_v_rank2.onnx"),
        "Attention",
    );
}

/// `AveragePool` with `ceil_mode` and a stride of 0 divided by the stride.
#[test]
fn pool_with_a_zero_stride() {
    assert_error(
        include_bytes!("data/fuzz/averagepool_zero_stride.onnx"),
        "stride",
    );
}

/// `Scan` over a scalar input (axis 0 of rank 0) read the input's first dim.
#[test]
fn scan_over_a_scalar() {
    assert_error(include_bytes!("data/fuzz/scan_scalar_input.onnx"), "scalar");
}

/// `Split` (opset 18) with `num_outputs` of 301 million on a node of two outputs
/// built that many slices: a hang, then out of memory.
#[test]
fn split_with_more_parts_than_outputs() {
    assert_error(
        include_bytes!("data/fuzz/split_huge_num_outputs.onnx"),
        "num_outputs",
    );
}

/// `Attention` with a scalar mask took the mask's last axis to be 0 and padded
/// axis `rank - 1` of a rank-0 tensor (a subtraction overflow). A scalar mask
/// broadcasts as it is, and the model imports.
#[test]
fn attention_with_a_scalar_mask() {
    import(include_bytes!("data/fuzz/attention_scalar_mask.onnx"))
        .expect("a scalar mask broadcasts");
}

/// `InstanceNormalization` of a 1-D input indexed the channel axis of its
/// `[N, C, ...]` broadcast shape, which a rank-1 input does not have.
#[test]
fn instance_norm_of_rank_one() {
    assert_error(
        include_bytes!("data/fuzz/instancenorm_rank1.onnx"),
        "rank 2 or more",
    );
}

/// `ConstantOfShape` of a 1.6 TB shape from a small known input was computed at
/// import (an allocation abort). A node whose folding would make a value past
/// the fold limit goes into the graph instead, and so does a large
/// `ConstantOfShape`.
#[test]
fn constant_of_shape_too_large_to_fold() {
    let _ = import(include_bytes!("data/fuzz/constantofshape_huge.onnx"));
}

/// `Split` of a scalar (axis 0 of rank 0) read the scalar's first dim.
#[test]
fn split_of_a_scalar() {
    assert_error(include_bytes!("data/fuzz/split_scalar.onnx"), "scalar");
}

/// Pooling with `ceil_mode` where the last window would start in the padding took
/// the ceil output count below the floor one and subtracted with overflow.
#[test]
fn pool_ceil_mode_window_in_padding() {
    let _ = import(include_bytes!("data/fuzz/pool_ceil_mode_underflow.onnx"));
}

/// `ConvTranspose` whose padding crops more than the whole output subtracted with
/// overflow.
#[test]
fn conv_transpose_cropping_past_the_output() {
    assert_error(
        include_bytes!("data/fuzz/convtranspose_crop_past_output.onnx"),
        "ConvTranspose",
    );
}

mod control_flow_bodies {
    //! Bodies with fewer outputs than the node carries indexed past their outputs
    //! (the same unchecked count as the scalar scan above).

    use super::assert_error;
    use prost::Message;
    use rlx_onnx::proto::{
        AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorProto,
        TensorShapeProto, TypeProto, ValueInfoProto, attribute_proto::AttributeType,
        tensor_shape_proto::Dimension, tensor_shape_proto::dimension, type_proto,
    };

    fn value(name: &str, elem: i32, dims: &[i64]) -> ValueInfoProto {
        ValueInfoProto {
            name: Some(name.into()),
            r#type: Some(TypeProto {
                value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                    elem_type: Some(elem),
                    shape: Some(TensorShapeProto {
                        dim: dims
                            .iter()
                            .map(|&n| Dimension {
                                value: Some(dimension::Value::DimValue(n)),
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

    /// A model running `op` (`Loop` or `Scan`) over input `x: f32[3, 2]` with a body
    /// that has the right inputs but no outputs, giving `y`.
    fn model(op: &str, inputs: &[&str], attrs: Vec<AttributeProto>) -> Vec<u8> {
        let body = GraphProto {
            name: Some("body".into()),
            input: if op == "Loop" {
                vec![
                    value("i", 7, &[]),
                    value("cond", 9, &[]),
                    value("c", 1, &[3, 2]),
                ]
            } else {
                vec![value("state", 1, &[3, 2]), value("row", 1, &[2])]
            },
            ..Default::default()
        };
        let mut attribute = vec![AttributeProto {
            name: Some("body".into()),
            r#type: Some(AttributeType::Graph as i32),
            g: Some(body),
            ..Default::default()
        }];
        attribute.extend(attrs);
        ModelProto {
            ir_version: Some(8),
            opset_import: vec![OperatorSetIdProto {
                domain: Some(String::new()),
                version: Some(17),
            }],
            graph: Some(GraphProto {
                name: Some("g".into()),
                node: vec![NodeProto {
                    op_type: Some(op.into()),
                    input: inputs.iter().map(|s| s.to_string()).collect(),
                    output: vec!["y".into()],
                    attribute,
                    ..Default::default()
                }],
                initializer: vec![TensorProto {
                    name: Some("trips".into()),
                    data_type: Some(7),
                    int64_data: vec![2],
                    ..Default::default()
                }],
                input: vec![value("x", 1, &[3, 2])],
                output: vec![value("y", 1, &[3, 2])],
                ..Default::default()
            }),
            ..Default::default()
        }
        .encode_to_vec()
    }

    #[test]
    fn loop_body_without_outputs() {
        assert_error(&model("Loop", &["trips", "", "x"], vec![]), "Loop");
    }

    #[test]
    fn scan_body_without_outputs() {
        let scan_inputs = AttributeProto {
            name: Some("num_scan_inputs".into()),
            r#type: Some(AttributeType::Int as i32),
            i: Some(1),
            ..Default::default()
        };
        assert_error(&model("Scan", &["x", "x"], vec![scan_inputs]), "Scan");
    }
}

/// A recurrent op whose W is a scalar (was an index panic reading its first dim).
#[test]
fn recurrent_with_a_scalar_weight() {
    assert!(import(include_bytes!("data/fuzz/rnn_scalar_weight.onnx")).is_err());
}
