//! Reference dequantization of every block format: hand-built blocks whose values
//! are known by construction, and random blocks checked against vectors made by an
//! independent implementation (gguf-py's `quants.dequantize`, in `data/`).

use half::f16;
use rlx_gguf::{QuantFormat, dequantize_row};

fn f16_bytes(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_bits().to_le_bytes()
}

fn decode(format: QuantFormat, block: &[u8]) -> Vec<f32> {
    let mut out = vec![0.0; format.block_len()];
    dequantize_row(format, block, &mut out).unwrap();
    out
}

#[test]
fn q4_0_and_q8_0_known_values() {
    let mut block = f16_bytes(0.25).to_vec();
    block.extend((0..16u8).map(|j| j | (15 - j) << 4));
    let v = decode(QuantFormat::Q4_0, &block);
    for j in 0..16 {
        assert_eq!(v[j], 0.25 * (j as f32 - 8.0));
        assert_eq!(v[j + 16], 0.25 * (7.0 - j as f32));
    }
    let mut block = f16_bytes(-2.0).to_vec();
    block.extend((0..32).map(|j| (j as i8 - 16) as u8));
    let v = decode(QuantFormat::Q8_0, &block);
    for (j, x) in v.iter().enumerate() {
        assert_eq!(*x, -2.0 * (j as f32 - 16.0));
    }
}

#[test]
fn q5_known_values() {
    // Quant j (0..32) = j: low nibble in qs, fifth bit in the 32-bit high mask.
    let q: Vec<u32> = (0..32).collect();
    let mut high = 0u32;
    let mut qs = [0u8; 16];
    for j in 0..16 {
        qs[j] = (q[j] & 15) as u8 | ((q[j + 16] & 15) as u8) << 4;
        high |= (q[j] >> 4) << j | (q[j + 16] >> 4) << (j + 16);
    }
    let mut b0 = f16_bytes(0.5).to_vec();
    b0.extend(high.to_le_bytes());
    b0.extend(qs);
    let v = decode(QuantFormat::Q5_0, &b0);
    for (j, x) in v.iter().enumerate() {
        assert_eq!(*x, 0.5 * (j as f32 - 16.0));
    }
    let mut b1 = f16_bytes(0.5).to_vec();
    b1.extend(f16_bytes(3.0));
    b1.extend(high.to_le_bytes());
    b1.extend(qs);
    let v = decode(QuantFormat::Q5_1, &b1);
    for (j, x) in v.iter().enumerate() {
        assert_eq!(*x, 0.5 * j as f32 + 3.0);
    }
}

/// Packs 8 six-bit scales and minimums the way Q4_K and Q5_K store them.
fn pack_k_scales(sc: [u8; 8], mn: [u8; 8]) -> [u8; 12] {
    let mut s = [0u8; 12];
    for j in 0..4 {
        s[j] = sc[j] | (sc[j + 4] >> 4) << 6;
        s[j + 4] = mn[j] | (mn[j + 4] >> 4) << 6;
        s[j + 8] = (sc[j + 4] & 15) | (mn[j + 4] & 15) << 4;
    }
    s
}

#[test]
fn k_quants_known_values() {
    let sc = [1, 2, 3, 4, 40, 50, 60, 63];
    let mn = [0, 5, 10, 15, 20, 33, 48, 63];
    let (d, dmin) = (0.5f32, 0.25f32);
    // Value i of sub-block s has quant (i + s) % 16 (Q4_K) / % 32 (Q5_K).
    let mut q4 = f16_bytes(d).to_vec();
    q4.extend(f16_bytes(dmin));
    q4.extend(pack_k_scales(sc, mn));
    let quant = |s: usize, i: usize, modulus: usize| ((i + s) % modulus) as u8;
    let mut qs = [0u8; 128];
    for chunk in 0..4 {
        for l in 0..32 {
            qs[chunk * 32 + l] = quant(2 * chunk, l, 16) | quant(2 * chunk + 1, l, 16) << 4;
        }
    }
    q4.extend(qs);
    let v = decode(QuantFormat::Q4K, &q4);
    for s in 0..8 {
        for i in 0..32 {
            let want = d * sc[s] as f32 * quant(s, i, 16) as f32 - dmin * mn[s] as f32;
            assert_eq!(v[s * 32 + i], want, "q4_k sub-block {s} value {i}");
        }
    }
    let mut q5 = f16_bytes(d).to_vec();
    q5.extend(f16_bytes(dmin));
    q5.extend(pack_k_scales(sc, mn));
    let (mut qh, mut qs) = ([0u8; 32], [0u8; 128]);
    for chunk in 0..4 {
        for l in 0..32 {
            let (a, b) = (quant(2 * chunk, l, 32), quant(2 * chunk + 1, l, 32));
            qs[chunk * 32 + l] = (a & 15) | (b & 15) << 4;
            qh[l] |= (a >> 4) << (2 * chunk) | (b >> 4) << (2 * chunk + 1);
        }
    }
    q5.extend(qh);
    q5.extend(qs);
    let v = decode(QuantFormat::Q5K, &q5);
    for s in 0..8 {
        for i in 0..32 {
            let want = d * sc[s] as f32 * quant(s, i, 32) as f32 - dmin * mn[s] as f32;
            assert_eq!(v[s * 32 + i], want, "q5_k sub-block {s} value {i}");
        }
    }
}

#[test]
fn q6_k_and_q8_k_known_values() {
    // Value i has quant q(i) = i % 64 (6 bits, centred at 32) and scale of sub-block
    // i / 16 equal to (i / 16) - 8.
    let q = |i: usize| (i % 64) as u8;
    let (mut ql, mut qh) = ([0u8; 128], [0u8; 64]);
    for half in 0..2 {
        for l in 0..32 {
            let base = half * 128;
            let [a, b, c, e] = [
                q(base + l),
                q(base + l + 32),
                q(base + l + 64),
                q(base + l + 96),
            ];
            ql[half * 64 + l] = (a & 15) | (c & 15) << 4;
            ql[half * 64 + l + 32] = (b & 15) | (e & 15) << 4;
            qh[half * 32 + l] = (a >> 4) | (b >> 4) << 2 | (c >> 4) << 4 | (e >> 4) << 6;
        }
    }
    let mut block = ql.to_vec();
    block.extend(qh);
    block.extend((0..16).map(|s| (s as i8 - 8) as u8));
    block.extend(f16_bytes(0.125));
    let v = decode(QuantFormat::Q6K, &block);
    for (i, x) in v.iter().enumerate() {
        let want = 0.125 * ((i / 16) as f32 - 8.0) * (q(i) as f32 - 32.0);
        assert_eq!(*x, want, "q6_k value {i}");
    }
    let mut block = 0.75f32.to_le_bytes().to_vec();
    block.extend((0..256).map(|i: i32| (i - 128) as i8 as u8));
    block.extend([0u8; 32]);
    let v = decode(QuantFormat::Q8K, &block);
    for (i, x) in v.iter().enumerate() {
        assert_eq!(*x, 0.75 * (i as f32 - 128.0));
    }
}

#[test]
fn random_blocks_match_an_independent_implementation() {
    let text = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/data/dequant_vectors.json"
    ))
    .unwrap();
    let data: serde_json::Value = serde_json::from_str(&text).unwrap();
    let formats = data["formats"].as_object().unwrap();
    assert_eq!(formats.len(), 8);
    for (name, case) in formats {
        let format = QuantFormat::ALL
            .into_iter()
            .find(|f| f.name() == name)
            .unwrap();
        let hex = case["hex"].as_str().unwrap();
        let bytes: Vec<u8> = (0..hex.len() / 2)
            .map(|i| u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap())
            .collect();
        let want: Vec<f64> = case["values"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_f64().unwrap())
            .collect();
        let mut got = vec![0f32; want.len()];
        dequantize_row(format, &bytes, &mut got).unwrap();
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            assert!(
                (*g as f64 - w).abs() <= 1e-6 * (1.0 + w.abs()),
                "{name} value {i}: {g} vs {w}"
            );
        }
    }
}
