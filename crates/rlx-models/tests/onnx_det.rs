//! `Det` of batched 3 x 3 and 4 x 4 matrices against Gaussian elimination with
//! partial pivoting; larger matrices are an error that says so.

use prost::Message;
use rlx_ir::TensorData;
use rlx_models::onnx::OnnxSession;
use rlx_onnx::proto::{
    GraphProto, ModelProto, NodeProto, OperatorSetIdProto, TensorShapeProto, TypeProto,
    ValueInfoProto, tensor_shape_proto::Dimension, tensor_shape_proto::dimension, type_proto,
};
use rlx_onnx::{OnnxModel, Tensor};
use rlx_runtime::CompileOptions;
use std::collections::BTreeMap;

fn value(name: &str, dims: &[usize]) -> ValueInfoProto {
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(11),
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

fn det_of(x: &[f64], dims: &[usize]) -> rlx_ir::Result<Vec<f64>> {
    let bytes = ModelProto {
        ir_version: Some(8),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(22),
        }],
        graph: Some(GraphProto {
            name: Some("det".into()),
            node: vec![NodeProto {
                op_type: Some("Det".into()),
                name: Some("det".into()),
                input: vec!["x".into()],
                output: vec!["y".into()],
                ..Default::default()
            }],
            input: vec![value("x", dims)],
            output: vec![value("y", &dims[..dims.len() - 2])],
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec();
    let model = OnnxModel::from_bytes(&bytes, None, "det.onnx")?;
    let mut session = OnnxSession::new(model, CompileOptions::new());
    let t = Tensor {
        dims: dims.to_vec(),
        data: TensorData::F64(x.to_vec()),
    };
    let out = session.run(&[("x", &t)], &BTreeMap::new())?;
    let TensorData::F64(y) = &out[0].1.data else {
        panic!("f64 output expected")
    };
    Ok(y.clone())
}

/// The determinant by elimination with partial pivoting.
fn reference(m: &[f64], n: usize) -> f64 {
    let mut a = m.to_vec();
    let mut det = 1.0;
    for col in 0..n {
        let pivot = (col..n)
            .max_by(|&i, &j| a[i * n + col].abs().total_cmp(&a[j * n + col].abs()))
            .unwrap();
        if pivot != col {
            for j in 0..n {
                a.swap(pivot * n + j, col * n + j);
            }
            det = -det;
        }
        let p = a[col * n + col];
        det *= p;
        if p == 0.0 {
            return 0.0;
        }
        for i in col + 1..n {
            let f = a[i * n + col] / p;
            for j in col..n {
                a[i * n + j] -= f * a[col * n + j];
            }
        }
    }
    det
}

#[test]
fn determinants_match_elimination() {
    for n in [1usize, 3, 4] {
        let batch = 5;
        let x: Vec<f64> = (0..batch * n * n)
            .map(|i| ((i * 7919 + n * 31) % 97) as f64 / 48.0 - 1.0)
            .collect();
        let got = det_of(&x, &[batch, n, n]).unwrap();
        for (b, g) in got.iter().enumerate() {
            let want = reference(&x[b * n * n..(b + 1) * n * n], n);
            assert!(
                (g - want).abs() <= 1e-12 * (1.0 + want.abs()),
                "n {n} matrix {b}: {g} against {want}"
            );
        }
    }
    let err = det_of(&[0.0; 25], &[5, 5]).unwrap_err();
    assert!(err.to_string().contains("Det"), "{err}");
}
