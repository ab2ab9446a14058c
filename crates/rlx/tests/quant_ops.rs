//! The ops over quantized weights (`quant_matmul`, `dequantize`) for every block
//! format, and `cached_attention`, on every available device against the reference
//! evaluator, on fresh random data (both the GEMV path for a few rows and the packed
//! GEMM path).

use rlx::ir::QuantFormat;
use rlx::ir::reference::{HostTensor, evaluate};
use rlx::prelude::*;
use std::collections::HashMap;

mod common;
use common::test_devices;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        self.0 >> 11
    }

    fn uniform(&mut self) -> f64 {
        self.next() as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
    }
}

/// `rows` random packed rows of `k` values with sane scales (random `f16` bits
/// could be NaN or huge).
fn packed(format: QuantFormat, rows: usize, k: usize, rng: &mut Rng) -> Vec<u8> {
    let row_bytes = format.row_bytes(k).unwrap();
    let mut bytes: Vec<u8> = (0..rows * row_bytes).map(|_| rng.next() as u8).collect();
    for block in bytes.chunks_exact_mut(format.block_bytes()) {
        let mut scale = |at: usize, v: f64| {
            let h = half::f16::from_f64(v).to_bits().to_le_bytes();
            block[at..at + 2].copy_from_slice(&h);
        };
        match format {
            QuantFormat::Q6K => scale(208, 0.01 + 0.01 * rng.uniform().abs()),
            QuantFormat::Q8K => {
                let d = (0.02 * rng.uniform()) as f32;
                block[0..4].copy_from_slice(&d.to_le_bytes());
            }
            _ => {
                scale(0, 0.05 * rng.uniform());
                if matches!(
                    format,
                    QuantFormat::Q4_1 | QuantFormat::Q5_1 | QuantFormat::Q4K | QuantFormat::Q5K
                ) {
                    scale(2, 0.05 * rng.uniform());
                }
            }
        }
    }
    bytes
}

fn host(dims: &[usize], dtype: DType, data: Vec<f64>) -> HostTensor {
    HostTensor::new(Shape::new(dims, dtype), data)
}

/// Runs `g` on every available device and with the reference evaluator on the same
/// inputs; checks every output element within `1e-5 * sqrt(k) * (1 + |ref|)`.
fn check(label: &str, g: &Graph, inputs: Vec<(&str, HostTensor)>, k: usize) {
    let data: Vec<(&str, TensorData)> = inputs.iter().map(|(n, t)| (*n, t.to_data())).collect();
    let feed: Vec<(&str, TensorRef<'_>)> = data.iter().map(|(n, d)| (*n, d.as_ref())).collect();
    let mut values: HashMap<String, HostTensor> = inputs
        .into_iter()
        .map(|(n, t)| (n.to_string(), t))
        .collect();
    let want = evaluate(g, &mut values).unwrap_or_else(|e| panic!("{label}: reference: {e}"));
    let tol = 1e-5 * (k.max(1) as f64).sqrt();
    for device in test_devices() {
        let mut compiled = Session::new(device)
            .compile(g)
            .unwrap_or_else(|e| panic!("{label} on {device}: {e}"));
        let got = compiled
            .run_typed(&feed)
            .unwrap_or_else(|e| panic!("{label} on {device}: {e}"));
        for (a, w) in got.iter().zip(&want) {
            let a = a.as_ref().to_f64_vec();
            assert_eq!(a.len(), w.data.len(), "{label} on {device}");
            for (i, (x, y)) in a.iter().zip(&w.data).enumerate() {
                assert!(
                    (x - y).abs() <= tol * (1.0 + y.abs()),
                    "{label} on {device}: element {i}: {x} vs {y}"
                );
            }
        }
    }
}

#[test]
fn quant_matmul_every_format_gemv_and_gemm() {
    let mut rng = Rng(0x5eed);
    for format in QuantFormat::ALL {
        let k = 2 * format.block_len().max(64);
        let n = 53;
        // Rows of activations: the GEMV path (<= 8) and the packed GEMM (more).
        for rows in [1, 3, 8, 9, 37] {
            let g = Graph::new("qmm");
            let a = g.input("a", Shape::new(&[rows, k], DType::F32)).unwrap();
            let w = g
                .input(
                    "w",
                    Shape::new(&[n, format.row_bytes(k).unwrap()], DType::U8),
                )
                .unwrap();
            let y = g.quant_matmul(a, w, format).unwrap();
            g.set_outputs(vec![y]);
            let a_data = (0..rows * k).map(|_| rng.uniform()).collect();
            let w_data = packed(format, n, k, &mut rng);
            check(
                &format!("quant_matmul {format} rows={rows}"),
                &g,
                vec![
                    ("a", host(&[rows, k], DType::F32, a_data)),
                    (
                        "w",
                        host(
                            &[n, w_data.len() / n],
                            DType::U8,
                            w_data.iter().map(|&b| f64::from(b)).collect(),
                        ),
                    ),
                ],
                k,
            );
        }
    }
}

#[test]
fn quant_matmul_with_batch_dims_and_dequantize() {
    let mut rng = Rng(77);
    let format = QuantFormat::Q4_1;
    let (k, n) = (96, 20);
    let g = Graph::new("qmm3");
    let a = g.input("a", Shape::new(&[2, 6, k], DType::F32)).unwrap();
    let w = g
        .input(
            "w",
            Shape::new(&[n, format.row_bytes(k).unwrap()], DType::U8),
        )
        .unwrap();
    let rows = g
        .input(
            "rows",
            Shape::new(&[3, 2, format.row_bytes(k).unwrap()], DType::U8),
        )
        .unwrap();
    let y = g.quant_matmul(a, w, format).unwrap();
    let d = g.dequantize(rows, format).unwrap();
    assert_eq!(g.shape(y).unwrap().dims(), &[2, 6, n]);
    assert_eq!(g.shape(d).unwrap().dims(), &[3, 2, k]);
    g.set_outputs(vec![y, d]);
    let w_data = packed(format, n, k, &mut rng);
    let r_data = packed(format, 6, k, &mut rng);
    let b = |v: Vec<u8>| v.into_iter().map(f64::from).collect::<Vec<_>>();
    check(
        "quant_matmul batch + dequantize",
        &g,
        vec![
            (
                "a",
                host(
                    &[2, 6, k],
                    DType::F32,
                    (0..12 * k).map(|_| rng.uniform()).collect(),
                ),
            ),
            ("w", host(&[n, 60], DType::U8, b(w_data))),
            ("rows", host(&[3, 2, 60], DType::U8, b(r_data))),
        ],
        k,
    );
}

#[test]
fn quant_ops_reject_bad_shapes() {
    let g = Graph::new("bad");
    let a = g.input("a", Shape::new(&[2, 96], DType::F32)).unwrap();
    let wrong_row = g.input("w", Shape::new(&[4, 61], DType::U8)).unwrap();
    let e = g
        .quant_matmul(a, wrong_row, QuantFormat::Q4_1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("60") && e.contains("61"), "{e}");
    let not_u8 = g.input("f", Shape::new(&[4, 60], DType::F32)).unwrap();
    assert!(g.quant_matmul(a, not_u8, QuantFormat::Q4_1).is_err());
    let odd_k = g.input("a2", Shape::new(&[2, 100], DType::F32)).unwrap();
    let w = g.input("w2", Shape::new(&[4, 60], DType::U8)).unwrap();
    assert!(g.quant_matmul(odd_k, w, QuantFormat::Q4_1).is_err());
    let rows = g.input("r", Shape::new(&[3, 19], DType::U8)).unwrap();
    assert!(g.dequantize(rows, QuantFormat::Q4_1).is_err());
    // The graph still builds after the rejected calls.
    assert!(g.quant_matmul(a, w, QuantFormat::Q4_1).is_ok());
}

#[test]
fn cached_attention_over_a_prefix_of_the_cache() {
    let mut rng = Rng(99);
    let (smax, hq, hkv, d) = (40, 6, 2, 8);
    for (sq, pos) in [(1, 0), (1, 17), (5, 0), (5, 12), (7, 33), (70 - 40 + 3, 5)] {
        let g = Graph::new("cached");
        let q = g
            .input("q", Shape::new(&[1, sq, hq, d], DType::F32))
            .unwrap();
        let k = g
            .input("k", Shape::new(&[1, smax, hkv, d], DType::F32))
            .unwrap();
        let v = g
            .input("v", Shape::new(&[1, smax, hkv, d], DType::F32))
            .unwrap();
        let p = g.input("pos", Shape::new(&[1], DType::I64)).unwrap();
        let y = g.cached_attention(q, k, v, p, None).unwrap();
        g.set_outputs(vec![y]);
        let r = |n: usize, rng: &mut Rng| (0..n).map(|_| rng.uniform()).collect::<Vec<_>>();
        check(
            &format!("cached_attention sq={sq} pos={pos}"),
            &g,
            vec![
                (
                    "q",
                    host(&[1, sq, hq, d], DType::F32, r(sq * hq * d, &mut rng)),
                ),
                (
                    "k",
                    host(&[1, smax, hkv, d], DType::F32, r(smax * hkv * d, &mut rng)),
                ),
                (
                    "v",
                    host(&[1, smax, hkv, d], DType::F32, r(smax * hkv * d, &mut rng)),
                ),
                ("pos", host(&[1], DType::I64, vec![pos as f64])),
            ],
            smax * d,
        );
    }
    // A long cache (a GPU splits each row's keys over several blocks whose partial
    // sums meet in its workspace), grouped and plain heads, values wider than keys,
    // two batch entries, one and three new queries, positions from the first row to
    // the last.
    for (hq, hkv, d, dv) in [(8, 2, 64, 48), (3, 3, 32, 32)] {
        let (b, smax) = (2, 300);
        for (sq, pos) in [(1, 0), (1, 150), (1, 299), (3, 40), (3, 297)] {
            let g = Graph::new("cached long");
            let f32s = |dims: &[usize]| Shape::new(dims, DType::F32);
            let q = g.input("q", f32s(&[b, sq, hq, d])).unwrap();
            let k = g.input("k", f32s(&[b, smax, hkv, d])).unwrap();
            let v = g.input("v", f32s(&[b, smax, hkv, dv])).unwrap();
            let p = g.input("pos", Shape::new(&[1], DType::I64)).unwrap();
            let y = g.cached_attention(q, k, v, p, None).unwrap();
            g.set_outputs(vec![y]);
            let r = |n: usize, rng: &mut Rng| (0..n).map(|_| rng.uniform()).collect::<Vec<_>>();
            check(
                &format!("cached_attention hq={hq} hkv={hkv} sq={sq} pos={pos}"),
                &g,
                vec![
                    (
                        "q",
                        host(&[b, sq, hq, d], DType::F32, r(b * sq * hq * d, &mut rng)),
                    ),
                    (
                        "k",
                        host(
                            &[b, smax, hkv, d],
                            DType::F32,
                            r(b * smax * hkv * d, &mut rng),
                        ),
                    ),
                    (
                        "v",
                        host(
                            &[b, smax, hkv, dv],
                            DType::F32,
                            r(b * smax * hkv * dv, &mut rng),
                        ),
                    ),
                    ("pos", host(&[1], DType::I64, vec![pos as f64])),
                ],
                smax * d,
            );
        }
    }
    // A position past the cache is a run-time error, and the graph runs afterwards.
    let g = Graph::new("cached_bad");
    let q = g.input("q", Shape::new(&[1, 4, 2, 4], DType::F32)).unwrap();
    let k = g
        .input("k", Shape::new(&[1, 10, 1, 4], DType::F32))
        .unwrap();
    let p = g.input("pos", Shape::new(&[1], DType::I64)).unwrap();
    let y = g.cached_attention(q, k, k, p, None).unwrap();
    g.set_outputs(vec![y]);
    let (qd, kd) = (vec![0.5f32; 32], vec![0.25f32; 40]);
    let run = |c: &mut CompiledGraph, pos: i64| {
        c.run_typed(&[
            ("q", TensorRef::F32(&qd)),
            ("k", TensorRef::F32(&kd)),
            ("pos", TensorRef::I64(&[pos])),
        ])
    };
    for device in test_devices() {
        let mut c = Session::new(device).compile(&g).unwrap();
        let e = run(&mut c, 7).unwrap_err().to_string();
        assert!(e.contains("position 7"), "{device}: {e}");
        assert!(run(&mut c, -1).is_err(), "{device}");
        let ok = run(&mut c, 6).unwrap();
        assert!(
            ok[0]
                .as_ref()
                .to_f64_vec()
                .iter()
                .all(|x| (x - 0.25).abs() < 1e-6),
            "{device}"
        );
    }
}
