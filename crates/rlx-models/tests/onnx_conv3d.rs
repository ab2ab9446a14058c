//! 3-D `Conv` (video models), with strides, dilations, padding, groups and a bias,
//! against a reference that visits every window cell; and its errors.

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

/// One 3-D convolution: `x [n, c, d, h, w]`, `w [o, c / groups, kd, kh, kw]`.
struct Conv3 {
    x: [usize; 5],
    o: usize,
    kernel: [usize; 3],
    strides: [usize; 3],
    dilations: [usize; 3],
    pads: [(usize, usize); 3],
    groups: usize,
    bias: bool,
}

impl Conv3 {
    fn out_len(&self, a: usize) -> usize {
        let padded = self.x[2 + a] + self.pads[a].0 + self.pads[a].1;
        let span = (self.kernel[a] - 1) * self.dilations[a] + 1;
        (padded - span) / self.strides[a] + 1
    }

    fn weight_dims(&self) -> [usize; 5] {
        let [kd, kh, kw] = self.kernel;
        [self.o, self.x[1] / self.groups, kd, kh, kw]
    }

    /// The convolution in `f64`, window cell by window cell.
    fn reference(&self, x: &[f32], w: &[f32], b: &[f32]) -> (Vec<usize>, Vec<f32>) {
        let [n, c, d, h, wi] = self.x;
        let outs = [self.out_len(0), self.out_len(1), self.out_len(2)];
        let (cg, og) = (c / self.groups, self.o / self.groups);
        let [kd, kh, kw] = self.kernel;
        let mut y = Vec::new();
        for bi in 0..n {
            for (oc, &bias) in b.iter().enumerate().take(self.o) {
                let g = oc / og;
                for z in 0..outs[0] {
                    for r in 0..outs[1] {
                        for q in 0..outs[2] {
                            let mut acc = if self.bias { f64::from(bias) } else { 0.0 };
                            for ic in 0..cg {
                                for ka in 0..kd {
                                    for kb in 0..kh {
                                        for kc in 0..kw {
                                            let at = |o: usize, k: usize, axis: usize| {
                                                (o * self.strides[axis] + k * self.dilations[axis])
                                                    as i64
                                                    - self.pads[axis].0 as i64
                                            };
                                            let (pz, pr, pq) =
                                                (at(z, ka, 0), at(r, kb, 1), at(q, kc, 2));
                                            if pz < 0 || pr < 0 || pq < 0 {
                                                continue;
                                            }
                                            let (pz, pr, pq) =
                                                (pz as usize, pr as usize, pq as usize);
                                            if pz >= d || pr >= h || pq >= wi {
                                                continue;
                                            }
                                            let xi = (((bi * c + g * cg + ic) * d + pz) * h + pr)
                                                * wi
                                                + pq;
                                            let wi_ =
                                                (((oc * cg + ic) * kd + ka) * kh + kb) * kw + kc;
                                            acc += f64::from(x[xi]) * f64::from(w[wi_]);
                                        }
                                    }
                                }
                            }
                            y.push(acc as f32);
                        }
                    }
                }
            }
        }
        let mut dims = vec![n, self.o];
        dims.extend(outs);
        (dims, y)
    }

    fn onnx(&self, w: &[f32], b: &[f32]) -> Vec<u8> {
        let mut pads: Vec<usize> = self.pads.iter().map(|p| p.0).collect();
        pads.extend(self.pads.iter().map(|p| p.1));
        let attrs = vec![
            ints("kernel_shape", &self.kernel),
            ints("strides", &self.strides),
            ints("dilations", &self.dilations),
            ints("pads", &pads),
            common::onnx::attr_int("group", self.groups as i64),
        ];
        let wd: Vec<i64> = self.weight_dims().iter().map(|&d| d as i64).collect();
        let mut inits = vec![floats("w", &wd, w)];
        let mut inputs = vec!["x", "w"];
        if self.bias {
            inits.push(floats("b", &[self.o as i64], b));
            inputs.push("b");
        }
        let dims: Vec<i64> = self.x.iter().map(|&d| d as i64).collect();
        model(
            17,
            vec![node("Conv", &inputs, &["y"], attrs)],
            inits,
            vec![value("x", FLOAT, Some(&dims))],
            vec![value("y", FLOAT, None)],
        )
    }

    fn check(&self, seed: u64) {
        let x = values(self.x.iter().product(), seed);
        let w = values(self.weight_dims().iter().product(), seed + 1);
        let b = values(self.o, seed + 2);
        let (want_dims, want) = self.reference(&x, &w, &b);
        let model = OnnxModel::from_bytes(&self.onnx(&w, &b), None, "conv3d.onnx").unwrap();
        let mut s = OnnxSession::new(model, CompileOptions::new());
        let t = Tensor {
            dims: self.x.to_vec(),
            data: TensorData::F32(x),
        };
        let out = s.run(&[("x", &t)], &BTreeMap::new()).unwrap();
        assert_eq!(out[0].1.dims, want_dims, "{:?}", self.x);
        let TensorData::F32(got) = &out[0].1.data else {
            panic!("f32 output expected")
        };
        let k = (self.x[1] / self.groups) * self.kernel.iter().product::<usize>();
        let tol = 1e-5 * (k as f32).sqrt();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (g - w).abs() <= tol * (1.0 + w.abs()),
                "{:?} k{:?} s{:?} d{:?} p{:?} g{}: value {i} is {g}, want {w}",
                self.x,
                self.kernel,
                self.strides,
                self.dilations,
                self.pads,
                self.groups
            );
        }
    }
}

#[test]
fn conv3d_matches_a_cell_by_cell_reference() {
    let cases = [
        // A video stem: 3 x 7 x 7, stride (1, 2, 2), padding (1, 3, 3).
        Conv3 {
            x: [1, 3, 5, 12, 13],
            o: 8,
            kernel: [3, 7, 7],
            strides: [1, 2, 2],
            dilations: [1, 1, 1],
            pads: [(1, 1), (3, 3), (3, 3)],
            groups: 1,
            bias: true,
        },
        // Downsampling in time, two images, no bias.
        Conv3 {
            x: [2, 4, 7, 6, 5],
            o: 6,
            kernel: [3, 3, 3],
            strides: [2, 2, 1],
            dilations: [1, 1, 1],
            pads: [(1, 0), (1, 1), (0, 2)],
            groups: 1,
            bias: false,
        },
        // Dilated in depth, grouped, a 1 x 1 x 1 tail.
        Conv3 {
            x: [1, 6, 9, 5, 4],
            o: 4,
            kernel: [2, 2, 1],
            strides: [1, 1, 2],
            dilations: [3, 1, 1],
            pads: [(0, 0), (0, 1), (0, 0)],
            groups: 2,
            bias: true,
        },
        Conv3 {
            x: [1, 4, 3, 4, 4],
            o: 5,
            kernel: [1, 1, 1],
            strides: [2, 2, 2],
            dilations: [1, 1, 1],
            pads: [(0, 0), (0, 0), (0, 0)],
            groups: 1,
            bias: true,
        },
    ];
    for (i, case) in cases.iter().enumerate() {
        case.check(40 + 3 * i as u64);
    }
}

#[test]
fn conv3d_with_a_window_longer_than_the_input_is_an_error() {
    let case = Conv3 {
        x: [1, 2, 2, 4, 4],
        o: 2,
        kernel: [3, 1, 1],
        strides: [1, 1, 1],
        dilations: [1, 1, 1],
        pads: [(0, 0), (0, 0), (0, 0)],
        groups: 1,
        bias: false,
    };
    let w = values(case.weight_dims().iter().product(), 1);
    let model = OnnxModel::from_bytes(&case.onnx(&w, &[]), None, "conv3d.onnx").unwrap();
    let mut s = OnnxSession::new(model, CompileOptions::new());
    let t = Tensor {
        dims: case.x.to_vec(),
        data: TensorData::F32(values(64, 2)),
    };
    let err = s.run(&[("x", &t)], &BTreeMap::new()).unwrap_err();
    assert!(err.to_string().contains("Conv"), "{err}");
    // The model itself is bad: a second run reports the same error.
    let again = s.run(&[("x", &t)], &BTreeMap::new()).unwrap_err();
    assert_eq!(err.to_string(), again.to_string());
}
