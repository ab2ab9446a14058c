//! 2-D `Conv` with dilated windows wider than their input (an atrous pyramid's wide
//! rates), where some taps only ever read padding and the importer drops them, or
//! where most products read padding and the importer splits the output into regions
//! that each read their live taps: the result must equal the full window's, cell by
//! cell, with groups and a bias too.

mod common;

use common::onnx::{FLOAT, floats, model, node, value};
use common::values;
use rlx_ir::TensorData;
use rlx_models::onnx::OnnxSession;
use rlx_onnx::proto::AttributeProto;
use rlx_onnx::{OnnxModel, Tensor};
use rlx_runtime::CompileOptions;
use std::collections::BTreeMap;

fn ints(name: &str, v: &[usize]) -> AttributeProto {
    let v: Vec<i64> = v.iter().map(|&x| x as i64).collect();
    common::onnx::attr_ints(name, &v)
}

/// `x [1, c, h, w]` by `w [o, c / groups, k, k]` with the given dilation, padding
/// `[top, left, bottom, right]`, groups and bias (`b[oc] = oc / 4`), window cell by
/// window cell.
fn reference(
    (x, [c, h, wd]): (&[f32], [usize; 3]),
    (w, o, k): (&[f32], usize, usize),
    dilation: usize,
    pads: [usize; 4],
    groups: usize,
) -> Vec<f32> {
    let (cg, og) = (c / groups, o / groups);
    let span = (k - 1) * dilation + 1;
    let oh = h + pads[0] + pads[2] - span + 1;
    let ow = wd + pads[1] + pads[3] - span + 1;
    let mut y = Vec::new();
    for oc in 0..o {
        for r in 0..oh {
            for q in 0..ow {
                let mut acc = bias(oc) as f64;
                for j in 0..cg {
                    let ic = oc / og * cg + j;
                    for ky in 0..k {
                        for kx in 0..k {
                            let pr = (r + ky * dilation) as i64 - pads[0] as i64;
                            let pq = (q + kx * dilation) as i64 - pads[1] as i64;
                            if pr < 0 || pq < 0 || pr >= h as i64 || pq >= wd as i64 {
                                continue;
                            }
                            let xi = (ic * h + pr as usize) * wd + pq as usize;
                            let wi = ((oc * cg + j) * k + ky) * k + kx;
                            acc += f64::from(x[xi]) * f64::from(w[wi]);
                        }
                    }
                }
                y.push(acc as f32);
            }
        }
    }
    y
}

fn bias(oc: usize) -> f32 {
    oc as f32 / 4.0
}

#[test]
fn dilated_windows_wider_than_the_input_match_the_full_window() {
    // (channels, h, w, out channels, kernel, dilation, pads, groups): only the middle
    // tap lives; the middle row but every column lives; asymmetric padding where the
    // first tap dies on one axis only; a window that keeps every tap; then windows
    // split into regions: an atrous pyramid's rate 12 over 16 x 16 (a quarter of the
    // products live), asymmetric sizes and padding, a 5 x 5 window, groups; then
    // windows over many channels, whose weights outweigh the output, summed tap by
    // tap (each a 1x1 convolution of its live rectangle, padded and added), with
    // groups too.
    type Case = (usize, usize, usize, usize, usize, usize, [usize; 4], usize);
    let cases: [Case; 10] = [
        (6, 5, 6, 4, 3, 8, [8, 8, 8, 8], 1),
        (3, 4, 12, 5, 3, 6, [6, 1, 6, 1], 1),
        (4, 7, 7, 3, 3, 5, [5, 2, 1, 2], 1),
        (2, 9, 9, 2, 3, 2, [2, 2, 2, 2], 1),
        (5, 16, 16, 4, 3, 12, [12, 12, 12, 12], 1),
        (3, 10, 13, 5, 3, 7, [7, 3, 7, 5], 1),
        (2, 9, 11, 3, 5, 4, [8, 8, 8, 8], 1),
        (6, 12, 12, 4, 3, 9, [9, 9, 9, 9], 2),
        (128, 8, 8, 8, 3, 6, [6, 6, 6, 6], 1),
        (256, 8, 10, 8, 3, 6, [6, 6, 6, 6], 2),
    ];
    for (i, (c, h, wd, o, k, d, pads, groups)) in cases.into_iter().enumerate() {
        let x = values(c * h * wd, 90 + i as u64);
        let w = values(o * c / groups * k * k, 190 + i as u64);
        let b: Vec<f32> = (0..o).map(bias).collect();
        let want = reference((&x, [c, h, wd]), (&w, o, k), d, pads, groups);
        let attrs = vec![
            ints("kernel_shape", &[k, k]),
            ints("dilations", &[d, d]),
            ints("pads", &[pads[0], pads[1], pads[2], pads[3]]),
            common::onnx::attr_int("group", groups as i64),
        ];
        let wdims = [o as i64, (c / groups) as i64, k as i64, k as i64];
        let bytes = model(
            17,
            vec![node("Conv", &["x", "w", "b"], &["y"], attrs)],
            vec![floats("w", &wdims, &w), floats("b", &[o as i64], &b)],
            vec![value("x", FLOAT, Some(&[1, c as i64, h as i64, wd as i64]))],
            vec![value("y", FLOAT, None)],
        );
        let model = OnnxModel::from_bytes(&bytes, None, "conv.onnx").unwrap();
        let mut s = OnnxSession::new(model, CompileOptions::new());
        let t = Tensor {
            dims: vec![1, c, h, wd],
            data: TensorData::F32(x),
        };
        let out = s.run(&[("x", &t)], &BTreeMap::new()).unwrap();
        let TensorData::F32(got) = &out[0].1.data else {
            panic!("f32 output expected")
        };
        assert_eq!(got.len(), want.len(), "case {i}: output size");
        let tol = 1e-5 * ((c * k * k) as f32).sqrt();
        for (j, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= tol * (1.0 + w.abs()),
                "case {i}: value {j} is {g}, want {w}"
            );
        }
    }
}
