//! `Einsum` nodes against a plain reference (a sum over every assignment of the
//! indices): products, batches, diagonals, traces, full sums, three operands,
//! broadcast ellipses and implicit outputs; malformed equations are errors.

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

const FLOAT: i32 = 1;

/// An input's dims and values.
type Input = (Vec<usize>, Vec<f32>);

fn value(name: &str, dims: Option<&[usize]>) -> ValueInfoProto {
    ValueInfoProto {
        name: Some(name.into()),
        r#type: Some(TypeProto {
            value: Some(type_proto::Value::TensorType(type_proto::Tensor {
                elem_type: Some(FLOAT),
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

/// A model of one `Einsum` node over inputs `x0, x1, ...` of the given dims.
fn model(equation: &str, dims: &[&[usize]]) -> Vec<u8> {
    let names: Vec<String> = (0..dims.len()).map(|i| format!("x{i}")).collect();
    ModelProto {
        ir_version: Some(8),
        opset_import: vec![OperatorSetIdProto {
            domain: Some(String::new()),
            version: Some(12),
        }],
        graph: Some(GraphProto {
            name: Some("einsum".into()),
            node: vec![NodeProto {
                op_type: Some("Einsum".into()),
                name: Some("e".into()),
                input: names.clone(),
                output: vec!["y".into()],
                attribute: vec![AttributeProto {
                    name: Some("equation".into()),
                    s: Some(equation.as_bytes().to_vec()),
                    r#type: Some(3),
                    ..Default::default()
                }],
                ..Default::default()
            }],
            input: names
                .iter()
                .zip(dims)
                .map(|(n, d)| value(n, Some(d)))
                .collect(),
            output: vec![value("y", None)],
            ..Default::default()
        }),
        ..Default::default()
    }
    .encode_to_vec()
}

/// `equation` (explicit, letters only) evaluated by summing over every assignment
/// of its letters; a dim of size 1 broadcasts. Returns the output dims and values.
fn reference(equation: &str, inputs: &[Input]) -> (Vec<usize>, Vec<f64>) {
    let (lhs, rhs) = equation.split_once("->").unwrap();
    let terms: Vec<Vec<char>> = lhs.split(',').map(|t| t.chars().collect()).collect();
    let out: Vec<char> = rhs.chars().collect();
    let mut letters: Vec<char> = Vec::new();
    let mut size = BTreeMap::new();
    for (term, (dims, _)) in terms.iter().zip(inputs) {
        for (&c, &d) in term.iter().zip(dims) {
            if !letters.contains(&c) {
                letters.push(c);
            }
            let s = size.entry(c).or_insert(d);
            *s = (*s).max(d);
        }
    }
    let out_dims: Vec<usize> = out.iter().map(|c| size[c]).collect();
    let mut result = vec![0.0f64; out_dims.iter().product()];
    let total: usize = letters.iter().map(|c| size[c]).product();
    for flat in 0..total {
        let mut at = BTreeMap::new();
        let mut rest = flat;
        for c in letters.iter().rev() {
            at.insert(*c, rest % size[c]);
            rest /= size[c];
        }
        let mut product = 1.0f64;
        for (term, (dims, data)) in terms.iter().zip(inputs) {
            let mut offset = 0;
            for (&c, &d) in term.iter().zip(dims) {
                offset = offset * d + if d == 1 { 0 } else { at[&c] };
            }
            product *= f64::from(data[offset]);
        }
        let o = out.iter().fold(0, |o, c| o * size[c] + at[c]);
        result[o] += product;
    }
    (out_dims, result)
}

fn run(equation: &str, inputs: &[Input]) -> rlx_ir::Result<(Vec<usize>, Vec<f32>)> {
    let dims: Vec<&[usize]> = inputs.iter().map(|(d, _)| d.as_slice()).collect();
    let bytes = model(equation, &dims);
    let model = OnnxModel::from_bytes(&bytes, None, "einsum.onnx")?;
    let mut session = OnnxSession::new(model, CompileOptions::new());
    let tensors: Vec<(String, Tensor)> = inputs
        .iter()
        .enumerate()
        .map(|(i, (d, v))| {
            (
                format!("x{i}"),
                Tensor {
                    dims: d.clone(),
                    data: TensorData::F32(v.clone()),
                },
            )
        })
        .collect();
    let feeds: Vec<(&str, &Tensor)> = tensors.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let out = session.run(&feeds, &BTreeMap::new())?;
    let TensorData::F32(v) = &out[0].1.data else {
        panic!("f32 output expected")
    };
    Ok((out[0].1.dims.clone(), v.clone()))
}

#[test]
fn einsum_matches_the_reference_sum() {
    // (equation as given to the node, the same written out for the reference, dims)
    let cases: &[(&str, &str, &[&[usize]])] = &[
        ("ij,jk->ik", "ij,jk->ik", &[&[3, 4], &[4, 5]]),
        ("ij,jk", "ij,jk->ik", &[&[3, 4], &[4, 5]]),
        (
            "bhqd,bhkd->bhqk",
            "bhqd,bhkd->bhqk",
            &[&[2, 3, 4, 5], &[2, 3, 6, 5]],
        ),
        ("ij,jk,kl->il", "ij,jk,kl->il", &[&[2, 3], &[3, 4], &[4, 5]]),
        ("ii", "ii->", &[&[4, 4]]),
        ("ii->i", "ii->i", &[&[4, 4]]),
        ("bii->bi", "bii->bi", &[&[3, 4, 4]]),
        (" ijk -> ", "ijk->", &[&[2, 3, 4]]),
        ("i,j->ij", "i,j->ij", &[&[3], &[4]]),
        ("ijk,ikl->jl", "ijk,ikl->jl", &[&[2, 3, 4], &[2, 4, 5]]),
        ("Aij,jA->iA", "Aij,jA->iA", &[&[2, 3, 4], &[4, 2]]),
        (
            "...ij,...jk->...ik",
            "abij,bjk->abik",
            &[&[2, 1, 3, 4], &[5, 4, 6]],
        ),
        ("...ij->...ji", "abij->abji", &[&[2, 3, 4, 5]]),
        ("ba,ab", "ba,ab->", &[&[3, 4], &[4, 3]]),
        ("ij,ij->ij", "ij,ij->ij", &[&[3, 4], &[3, 4]]),
    ];
    for (k, &(equation, written, dims)) in cases.iter().enumerate() {
        let inputs: Vec<Input> = dims
            .iter()
            .enumerate()
            .map(|(i, d)| {
                (
                    d.to_vec(),
                    values(d.iter().product(), (k * 10 + i) as u64 + 1),
                )
            })
            .collect();
        let (want_dims, want) = reference(written, &inputs);
        let (dims, got) = run(equation, &inputs).unwrap_or_else(|e| panic!("{equation}: {e}"));
        assert_eq!(dims, want_dims, "{equation}");
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (f64::from(*g) - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{equation}: element {i}: {g} against {w}"
            );
        }
    }
}

#[test]
fn malformed_equations_are_errors() {
    let a = (vec![3, 4], values(12, 1));
    let b = (vec![4, 5], values(20, 2));
    let cases: &[(&str, Vec<Input>)] = &[
        ("ij,jk->ik", vec![a.clone()]),
        ("ijk->i", vec![a.clone()]),
        ("ij->k", vec![a.clone()]),
        ("ij->ii", vec![a.clone()]),
        ("i1->i", vec![a.clone()]),
        ("...i...->i", vec![a.clone()]),
        ("ij,ik->jk", vec![a.clone(), b.clone()]),
        ("ii->i", vec![a.clone()]),
    ];
    for (equation, inputs) in cases {
        let err = run(equation, inputs).expect_err(equation);
        assert!(err.to_string().contains("Einsum"), "{equation}: {err}");
    }
    // The same inputs with a well-formed equation still run.
    assert!(run("ij,jk->ik", &[a, b]).is_ok());
}
