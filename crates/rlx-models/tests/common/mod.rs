//! Helpers shared by the ONNX model-building tests.

// Each test binary uses its own subset of these.
#![allow(dead_code)]

/// Deterministic values in [-1, 1) (an xorshift stream from `seed`).
pub fn values(n: usize, seed: u64) -> Vec<f32> {
    let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            (s >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        })
        .collect()
}

/// Building small ONNX models in tests.
pub mod onnx {
    use prost::Message;
    use rlx_onnx::proto::{
        AttributeProto, GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorProto,
        TensorShapeProto, TypeProto, ValueInfoProto, tensor_shape_proto::Dimension,
        tensor_shape_proto::dimension, type_proto,
    };

    /// ONNX element type codes.
    pub const FLOAT: i32 = 1;
    pub const INT64: i32 = 7;
    pub const BOOL: i32 = 9;
    pub const DOUBLE: i32 = 11;

    /// A tensor value of `elem_type`; `dims` of `None` leaves the shape undeclared.
    pub fn value(name: &str, elem_type: i32, dims: Option<&[i64]>) -> ValueInfoProto {
        ValueInfoProto {
            name: Some(name.into()),
            r#type: Some(TypeProto {
                value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                    elem_type: Some(elem_type),
                    shape: dims.map(|dims| TensorShapeProto {
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

    /// An integer attribute.
    pub fn attr_int(name: &str, v: i64) -> AttributeProto {
        AttributeProto {
            name: Some(name.into()),
            i: Some(v),
            r#type: Some(2),
            ..Default::default()
        }
    }

    /// An integer-list attribute.
    pub fn attr_ints(name: &str, v: &[i64]) -> AttributeProto {
        AttributeProto {
            name: Some(name.into()),
            ints: v.to_vec(),
            r#type: Some(7),
            ..Default::default()
        }
    }

    /// A float attribute.
    pub fn attr_float(name: &str, v: f32) -> AttributeProto {
        AttributeProto {
            name: Some(name.into()),
            f: Some(v),
            r#type: Some(1),
            ..Default::default()
        }
    }

    /// A node of the default domain.
    pub fn node(
        op: &str,
        inputs: &[&str],
        outputs: &[&str],
        attribute: Vec<AttributeProto>,
    ) -> NodeProto {
        NodeProto {
            op_type: Some(op.into()),
            name: Some(format!("{op}_{}", outputs.join("_"))),
            input: inputs.iter().map(|s| s.to_string()).collect(),
            output: outputs.iter().map(|s| s.to_string()).collect(),
            attribute,
            ..Default::default()
        }
    }

    /// An int64 initializer.
    pub fn int64s(name: &str, dims: &[i64], values: &[i64]) -> TensorProto {
        TensorProto {
            name: Some(name.into()),
            dims: dims.to_vec(),
            data_type: Some(INT64),
            int64_data: values.to_vec(),
            ..Default::default()
        }
    }

    /// A float initializer.
    pub fn floats(name: &str, dims: &[i64], values: &[f32]) -> TensorProto {
        TensorProto {
            name: Some(name.into()),
            dims: dims.to_vec(),
            data_type: Some(FLOAT),
            float_data: values.to_vec(),
            ..Default::default()
        }
    }

    /// The encoded model of one graph at `opset` of the default domain.
    pub fn model(
        opset: i64,
        node: Vec<NodeProto>,
        initializer: Vec<TensorProto>,
        input: Vec<ValueInfoProto>,
        output: Vec<ValueInfoProto>,
    ) -> Vec<u8> {
        ModelProto {
            ir_version: Some(9),
            opset_import: vec![OperatorSetIdProto {
                domain: Some(String::new()),
                version: Some(opset),
            }],
            graph: Some(GraphProto {
                name: Some("test".into()),
                node,
                initializer,
                input,
                output,
                ..Default::default()
            }),
            ..Default::default()
        }
        .encode_to_vec()
    }
}
