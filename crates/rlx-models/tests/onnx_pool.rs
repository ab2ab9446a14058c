//! `MaxPool` and `AveragePool` over 1, 2 and 3 spatial axes, with padding, strides,
//! `ceil_mode` and `count_include_pad`, against a reference that visits every
//! window cell.

mod common;

use common::onnx::{FLOAT, model, node, value};
use rlx_ir::TensorData;
use rlx_models::onnx::OnnxSession;
use rlx_onnx::proto::AttributeProto;
use rlx_onnx::{OnnxModel, Tensor};
use rlx_runtime::CompileOptions;
use std::collections::BTreeMap;

fn ints(name: &str, v: &[usize]) -> AttributeProto {
    AttributeProto {
        name: Some(name.into()),
        ints: v.iter().map(|&x| x as i64).collect(),
        r#type: Some(7),
        ..Default::default()
    }
}

/// One pooling configuration; every per-axis list has one entry per spatial axis.
struct Pool<'a> {
    max: bool,
    dims: &'a [usize],
    kernel: &'a [usize],
    strides: &'a [usize],
    pads: &'a [(usize, usize)],
    ceil: bool,
    count_include_pad: bool,
}

impl Pool<'_> {
    fn out_len(&self, a: usize) -> usize {
        let len = self.dims[2 + a];
        let padded = len + self.pads[a].0 + self.pads[a].1;
        let reach = padded - self.kernel[a];
        let s = self.strides[a];
        let mut out = if self.ceil {
            reach.div_ceil(s) + 1
        } else {
            reach / s + 1
        };
        // A last window may not start in the end padding.
        if self.ceil && (out - 1) * s >= len + self.pads[a].0 {
            out -= 1;
        }
        out
    }

    /// The pool by visiting each output position's window.
    fn reference(&self, x: &[f32]) -> (Vec<usize>, Vec<f32>) {
        let r = self.dims.len() - 2;
        let spatial = &self.dims[2..];
        let outs: Vec<usize> = (0..r).map(|a| self.out_len(a)).collect();
        let planes = self.dims[0] * self.dims[1];
        let in_size: usize = spatial.iter().product();
        let out_size: usize = outs.iter().product();
        let mut y = Vec::with_capacity(planes * out_size);
        for plane in 0..planes {
            for o in 0..out_size {
                let at = unravel(o, &outs);
                let (mut best, mut sum, mut inside, mut counted) =
                    (f32::NEG_INFINITY, 0.0f64, 0usize, 0usize);
                for k in 0..self.kernel.iter().product() {
                    let kk = unravel(k, self.kernel);
                    let mut idx = 0usize;
                    let mut valid = true;
                    let mut in_padded = true;
                    for a in 0..r {
                        let p = (at[a] * self.strides[a] + kk[a]) as i64 - self.pads[a].0 as i64;
                        let len = spatial[a] as i64;
                        valid &= p >= 0 && p < len;
                        in_padded &= p < len + self.pads[a].1 as i64;
                        idx = idx * spatial[a] + p.clamp(0, len - 1) as usize;
                    }
                    if in_padded {
                        counted += 1;
                    }
                    if valid {
                        let v = x[plane * in_size + idx];
                        best = best.max(v);
                        sum += f64::from(v);
                        inside += 1;
                    }
                }
                y.push(if self.max {
                    best
                } else {
                    let n = if self.count_include_pad {
                        counted
                    } else {
                        inside
                    };
                    (sum / n as f64) as f32
                });
            }
        }
        let mut dims = self.dims[..2].to_vec();
        dims.extend(outs);
        (dims, y)
    }

    fn run(&self, x: &[f32]) -> (Vec<usize>, Vec<f32>) {
        let mut pads: Vec<usize> = self.pads.iter().map(|p| p.0).collect();
        pads.extend(self.pads.iter().map(|p| p.1));
        let mut attrs = vec![
            ints("kernel_shape", self.kernel),
            ints("strides", self.strides),
            ints("pads", &pads),
            common::onnx::attr_int("ceil_mode", i64::from(self.ceil)),
        ];
        if !self.max {
            attrs.push(common::onnx::attr_int(
                "count_include_pad",
                i64::from(self.count_include_pad),
            ));
        }
        let op = if self.max { "MaxPool" } else { "AveragePool" };
        let dims: Vec<i64> = self.dims.iter().map(|&d| d as i64).collect();
        let bytes = model(
            19,
            vec![node(op, &["x"], &["y"], attrs)],
            vec![],
            vec![value("x", FLOAT, Some(&dims))],
            vec![value("y", FLOAT, None)],
        );
        let model = OnnxModel::from_bytes(&bytes, None, "pool.onnx").unwrap();
        let mut s = OnnxSession::new(model, CompileOptions::new());
        let t = Tensor {
            dims: self.dims.to_vec(),
            data: TensorData::F32(x.to_vec()),
        };
        let out = s.run(&[("x", &t)], &BTreeMap::new()).unwrap_or_else(|e| {
            panic!(
                "{op} {:?} k{:?} s{:?} p{:?}: {e}",
                self.dims, self.kernel, self.strides, self.pads
            )
        });
        assert_eq!(out.len(), 1);
        let TensorData::F32(y) = &out[0].1.data else {
            panic!("f32 output expected")
        };
        (out[0].1.dims.clone(), y.clone())
    }
}

/// Row-major coordinates of flat index `i` in `dims`.
fn unravel(mut i: usize, dims: &[usize]) -> Vec<usize> {
    let mut at = vec![0; dims.len()];
    for a in (0..dims.len()).rev() {
        at[a] = i % dims[a];
        i /= dims[a];
    }
    at
}

#[test]
fn pools_match_a_window_by_window_reference() {
    // (input dims, kernel, strides, pads per spatial axis)
    type Case = (
        &'static [usize],
        &'static [usize],
        &'static [usize],
        &'static [(usize, usize)],
    );
    let cases: &[Case] = &[
        (&[1, 2, 7], &[2], &[3], &[(0, 0)]),
        (&[2, 1, 9], &[3], &[2], &[(1, 0)]),
        (&[1, 2, 7, 6], &[3, 2], &[2, 3], &[(1, 1), (0, 1)]),
        (
            &[1, 2, 5, 7, 6],
            &[2, 3, 2],
            &[2, 2, 3],
            &[(1, 0), (1, 1), (0, 1)],
        ),
        (
            &[1, 1, 6, 5, 7],
            &[3, 2, 2],
            &[3, 1, 2],
            &[(1, 1), (0, 0), (1, 0)],
        ),
    ];
    let mut seed = 1;
    for &(dims, kernel, strides, pads) in cases {
        for max in [true, false] {
            for ceil in [false, true] {
                for count_include_pad in [false, true] {
                    if max && count_include_pad {
                        continue;
                    }
                    let pool = Pool {
                        max,
                        dims,
                        kernel,
                        strides,
                        pads,
                        ceil,
                        count_include_pad,
                    };
                    seed += 1;
                    let x = common::values(dims.iter().product(), seed);
                    let (want_dims, want) = pool.reference(&x);
                    let (got_dims, got) = pool.run(&x);
                    let label = format!(
                        "max {max} ceil {ceil} count_include_pad {count_include_pad} {dims:?} k{kernel:?} s{strides:?} p{pads:?}"
                    );
                    assert_eq!(got_dims, want_dims, "{label}");
                    for (g, w) in got.iter().zip(&want) {
                        assert!((g - w).abs() <= 1e-5, "{label}: {got:?} vs {want:?}");
                    }
                }
            }
        }
    }
}
