//! The ops that real models use (the model zoo's, at small shapes) plan fast CPU
//! kernels, never the scalar reference kernels (`cpu.ref.*`): the test fails when one
//! of them plans a reference kernel.

mod common;

use common::onnx::{FLOAT, attr_float, attr_int, floats, int64s, model, node, value};
use rlx_models::onnx::OnnxSession;
use rlx_onnx::proto::{AttributeProto, TensorProto};
use rlx_onnx::{ImportOptions, OnnxModel};
use rlx_runtime::CompileOptions;

fn ints(name: &str, v: &[i64]) -> AttributeProto {
    common::onnx::attr_ints(name, v)
}

fn string(name: &str, v: &str) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        s: Some(v.as_bytes().to_vec()),
        r#type: Some(3),
        ..Default::default()
    }
}

/// One single-node model: its label, the node, its initializers and the float
/// input `x`'s dims.
struct Case {
    label: &'static str,
    op: &'static str,
    inputs: &'static [&'static str],
    attrs: Vec<AttributeProto>,
    inits: Vec<TensorProto>,
    x: &'static [i64],
}

fn weights(name: &str, dims: &[i64]) -> TensorProto {
    let n: i64 = dims.iter().product();
    floats(name, dims, &common::values(n as usize, 7))
}

/// The kernels the CPU plans for `case`.
fn planned(case: &Case) -> Vec<String> {
    let bytes = model(
        18,
        vec![node(case.op, case.inputs, &["y"], case.attrs.clone())],
        case.inits.clone(),
        vec![value("x", FLOAT, Some(case.x))],
        vec![value("y", FLOAT, None)],
    );
    let model = OnnxModel::from_bytes(&bytes, None, "case.onnx").unwrap();
    let mut session = OnnxSession::new(model, CompileOptions::new());
    let compiled = session
        .prepare(&ImportOptions::new())
        .unwrap_or_else(|e| panic!("{}: {e}", case.label));
    compiled
        .graph
        .kernels()
        .into_iter()
        .map(|(_, k)| k)
        .collect()
}

fn covered() -> Vec<Case> {
    vec![
        Case {
            label: "depthwise conv, stride 2",
            op: "Conv",
            inputs: &["x", "w"],
            attrs: vec![
                attr_int("group", 8),
                ints("strides", &[2, 2]),
                ints("pads", &[1, 1, 1, 1]),
            ],
            inits: vec![weights("w", &[8, 1, 3, 3])],
            x: &[1, 8, 14, 14],
        },
        Case {
            label: "grouped conv",
            op: "Conv",
            inputs: &["x", "w", "b"],
            attrs: vec![attr_int("group", 4), ints("pads", &[1, 1, 1, 1])],
            inits: vec![weights("w", &[8, 2, 3, 3]), weights("b", &[8])],
            x: &[1, 8, 10, 10],
        },
        Case {
            label: "dilated conv",
            op: "Conv",
            inputs: &["x", "w"],
            attrs: vec![ints("dilations", &[2, 2]), ints("pads", &[2, 2, 2, 2])],
            inits: vec![weights("w", &[6, 4, 3, 3])],
            x: &[1, 4, 12, 12],
        },
        Case {
            label: "1-D conv",
            op: "Conv",
            inputs: &["x", "w"],
            attrs: vec![ints("strides", &[2])],
            inits: vec![weights("w", &[6, 4, 5])],
            x: &[1, 4, 20],
        },
        Case {
            label: "max pool with padding",
            op: "MaxPool",
            inputs: &["x"],
            attrs: vec![
                ints("kernel_shape", &[3, 3]),
                ints("strides", &[2, 2]),
                ints("pads", &[1, 1, 1, 1]),
            ],
            inits: vec![],
            x: &[1, 4, 9, 9],
        },
        Case {
            label: "average pool with padding",
            op: "AveragePool",
            inputs: &["x"],
            attrs: vec![ints("kernel_shape", &[3, 3]), ints("pads", &[1, 1, 1, 1])],
            inits: vec![],
            x: &[1, 4, 9, 9],
        },
        Case {
            label: "nearest resize",
            op: "Resize",
            inputs: &["x", "", "scales"],
            attrs: vec![string("mode", "nearest")],
            inits: vec![floats("scales", &[4], &[1.0, 1.0, 2.0, 2.0])],
            x: &[1, 4, 6, 7],
        },
        Case {
            label: "bilinear resize",
            op: "Resize",
            inputs: &["x", "", "scales"],
            attrs: vec![
                string("mode", "linear"),
                string("coordinate_transformation_mode", "half_pixel"),
            ],
            inits: vec![floats("scales", &[4], &[1.0, 1.0, 2.0, 2.0])],
            x: &[1, 4, 6, 7],
        },
        Case {
            label: "cubic resize, align corners",
            op: "Resize",
            inputs: &["x", "", "", "sizes"],
            attrs: vec![
                string("mode", "cubic"),
                string("coordinate_transformation_mode", "align_corners"),
            ],
            inits: vec![int64s("sizes", &[4], &[1, 4, 9, 5])],
            x: &[1, 4, 6, 7],
        },
        Case {
            // Frames as wide as a row copy needs (16 values): the moves of frames
            // between the batch and channel axes copy whole rows; each depth tap's
            // weights are sliced once, at import.
            label: "3-D conv",
            op: "Conv",
            inputs: &["x", "w"],
            attrs: vec![ints("pads", &[0, 1, 1, 0, 1, 1])],
            inits: vec![weights("w", &[4, 3, 3, 3, 3])],
            x: &[1, 3, 5, 4, 20],
        },
        Case {
            // Phases woven together by a permute that moves the last axis; the
            // kernel flipped once, at import.
            label: "ConvTranspose",
            op: "ConvTranspose",
            inputs: &["x", "w"],
            attrs: vec![ints("strides", &[2, 2])],
            inits: vec![weights("w", &[4, 3, 2, 2])],
            x: &[1, 4, 6, 6],
        },
        Case {
            // An atrous pyramid's branch: output regions of input slices, joined by
            // concatenations (of rows of 16 values or more).
            label: "dilated conv split into regions",
            op: "Conv",
            inputs: &["x", "w"],
            attrs: vec![ints("dilations", &[6, 16]), ints("pads", &[6, 16, 6, 16])],
            inits: vec![weights("w", &[4, 3, 3, 3])],
            x: &[1, 3, 8, 64],
        },
        Case {
            label: "hard swish",
            op: "HardSwish",
            inputs: &["x"],
            attrs: vec![],
            inits: vec![],
            x: &[2, 8, 5, 5],
        },
        Case {
            label: "hard sigmoid",
            op: "HardSigmoid",
            inputs: &["x"],
            attrs: vec![attr_float("alpha", 0.2)],
            inits: vec![],
            x: &[2, 8, 5, 5],
        },
    ]
}

/// Cases whose rows are shorter than a vector: copied one masked row at a time
/// where AVX-512 is available.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn short_row_cases() -> Vec<Case> {
    vec![
        Case {
            // A channel shuffle's transpose of rows of 7 values.
            label: "transpose of short rows",
            op: "Transpose",
            inputs: &["x"],
            attrs: vec![ints("perm", &[0, 2, 1, 3, 4])],
            inits: vec![],
            x: &[1, 2, 3, 7, 7],
        },
        Case {
            // Regions 4 and 8 outputs wide.
            label: "dilated conv split into narrow regions",
            op: "Conv",
            inputs: &["x", "w"],
            attrs: vec![
                ints("dilations", &[12, 12]),
                ints("pads", &[12, 12, 12, 12]),
            ],
            inits: vec![weights("w", &[4, 3, 3, 3])],
            x: &[1, 3, 16, 16],
        },
    ]
}

#[test]
fn zoo_ops_plan_no_reference_kernel() {
    let mut slow = Vec::new();
    let mut cases = covered();
    #[cfg(target_arch = "x86_64")]
    if std::arch::is_x86_feature_detected!("avx512f") {
        cases.extend(short_row_cases());
    }
    for case in cases {
        let kernels = planned(&case);
        assert!(!kernels.is_empty(), "{}: nothing planned", case.label);
        if let Some(k) = kernels.iter().find(|k| k.starts_with("cpu.ref.")) {
            slow.push(format!("{}: {k} (of {kernels:?})", case.label));
        }
    }
    assert!(
        slow.is_empty(),
        "reference kernels planned:\n{}",
        slow.join("\n")
    );
}
