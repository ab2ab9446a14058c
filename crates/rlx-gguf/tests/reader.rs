//! The GGUF reader on hand-built files: every value type, tensor infos, alignment,
//! and hostile input (truncation at every length, bit flips, absurd counts) that must
//! give errors, never panics.

use half::f16;
use rlx_gguf::{GgufBuilder, GgufFile, QuantFormat, TensorType, Value, ValueType};

/// Writes GGUF images for tests.
struct Writer {
    kv: Vec<u8>,
    kv_count: u64,
    tensors: Vec<(String, Vec<u64>, u32, Vec<u8>)>,
    alignment: usize,
}

fn string(out: &mut Vec<u8>, s: &str) {
    out.extend((s.len() as u64).to_le_bytes());
    out.extend(s.as_bytes());
}

impl Writer {
    fn new() -> Writer {
        Writer {
            kv: Vec::new(),
            kv_count: 0,
            tensors: Vec::new(),
            alignment: 32,
        }
    }

    fn kv(&mut self, key: &str, tag: u32, value: &[u8]) -> &mut Self {
        string(&mut self.kv, key);
        self.kv.extend(tag.to_le_bytes());
        self.kv.extend(value);
        self.kv_count += 1;
        self
    }

    fn tensor(&mut self, name: &str, dims: &[u64], ggml_type: u32, data: Vec<u8>) -> &mut Self {
        self.tensors
            .push((name.into(), dims.to_vec(), ggml_type, data));
        self
    }

    fn build(&self) -> Vec<u8> {
        let mut out = b"GGUF".to_vec();
        out.extend(3u32.to_le_bytes());
        out.extend((self.tensors.len() as u64).to_le_bytes());
        out.extend(self.kv_count.to_le_bytes());
        out.extend(&self.kv);
        let mut offset = 0u64;
        let mut offsets = Vec::new();
        for (name, dims, ty, data) in &self.tensors {
            string(&mut out, name);
            out.extend((dims.len() as u32).to_le_bytes());
            for d in dims {
                out.extend(d.to_le_bytes());
            }
            out.extend(ty.to_le_bytes());
            out.extend(offset.to_le_bytes());
            offsets.push(offset);
            offset += (data.len() as u64).div_ceil(self.alignment as u64) * self.alignment as u64;
        }
        for (_, _, _, data) in &self.tensors {
            while !out.len().is_multiple_of(self.alignment) {
                out.push(0);
            }
            out.extend(data);
        }
        out
    }
}

fn f16_bytes(v: f32) -> [u8; 2] {
    f16::from_f32(v).to_bits().to_le_bytes()
}

/// A small model-like file: metadata of every type and three tensors.
fn sample() -> Vec<u8> {
    let mut w = Writer::new();
    let mut strings = Vec::new();
    strings.extend(9u32.to_le_bytes()); // array
    strings.extend(8u32.to_le_bytes()); // of strings
    strings.extend(2u64.to_le_bytes());
    string(&mut strings, "<s>");
    string(&mut strings, "hé");
    let mut ints = Vec::new();
    ints.extend(5u32.to_le_bytes());
    ints.extend(3u64.to_le_bytes());
    for v in [1i32, -2, 3] {
        ints.extend(v.to_le_bytes());
    }
    let mut name = Vec::new();
    string(&mut name, "llama");
    w.kv("general.architecture", 8, &name)
        .kv("u8", 0, &[200])
        .kv("i8", 1, &[0xfe])
        .kv("u16", 2, &500u16.to_le_bytes())
        .kv("i16", 3, &(-500i16).to_le_bytes())
        .kv("u32", 4, &70000u32.to_le_bytes())
        .kv("i32", 5, &(-70000i32).to_le_bytes())
        .kv("f32", 6, &1.5f32.to_le_bytes())
        .kv("bool", 7, &[1])
        .kv("u64", 10, &(1u64 << 40).to_le_bytes())
        .kv("i64", 11, &(-1i64 << 40).to_le_bytes())
        .kv("f64", 12, &0.25f64.to_le_bytes())
        .kv("tokens", 9, &strings[4..])
        .kv("ints", 9, &ints);
    // A Q8_0 tensor of 2 rows of 32: d = 0.5, q = -16..16.
    let mut q8 = Vec::new();
    for _ in 0..2 {
        q8.extend(f16_bytes(0.5));
        q8.extend((-16i8..16).map(|q| q as u8));
    }
    let f32s: Vec<u8> = (0..6)
        .flat_map(|i| (i as f32 * 0.5).to_le_bytes())
        .collect();
    let f16s: Vec<u8> = (0..4).flat_map(|i| f16_bytes(i as f32 - 1.0)).collect();
    w.tensor("q8", &[32, 2], 8, q8)
        .tensor("norm", &[6], 0, f32s)
        .tensor("half", &[2, 2], 1, f16s);
    w.build()
}

#[test]
fn reads_every_value_type_and_tensor() {
    let file = GgufFile::from_bytes("sample", sample()).unwrap();
    assert_eq!(file.version(), 3);
    assert_eq!(file.alignment(), 32);
    assert_eq!(file.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(file.get("u8"), Some(&Value::U8(200)));
    assert_eq!(file.get("i8"), Some(&Value::I8(-2)));
    assert_eq!(file.get("u16"), Some(&Value::U16(500)));
    assert_eq!(file.get("i16"), Some(&Value::I16(-500)));
    assert_eq!(file.get_u64("u32").unwrap(), 70000);
    assert_eq!(file.get("i32").and_then(Value::as_i64), Some(-70000));
    assert_eq!(file.get_f64("f32").unwrap(), 1.5);
    assert!(file.get_bool("bool").unwrap());
    assert_eq!(file.get_u64("u64").unwrap(), 1 << 40);
    assert_eq!(file.get("i64").and_then(Value::as_i64), Some(-1 << 40));
    assert_eq!(file.get_f64("f64").unwrap(), 0.25);
    assert_eq!(file.get_str_array("tokens").unwrap(), ["<s>", "hé"]);
    assert_eq!(file.get_i64_array("ints").unwrap(), [1, -2, 3]);
    assert_eq!(
        file.get("ints").map(Value::value_type),
        Some(ValueType::Array)
    );

    let q8 = file.tensor("q8").unwrap();
    assert_eq!(q8.dims, [32, 2]);
    assert_eq!(q8.row_major_dims(), [2, 32]);
    assert_eq!(q8.ty, TensorType::Quant(QuantFormat::Q8_0));
    assert_eq!(q8.byte_len, 68);
    assert_eq!(q8.offset % 32, 0);
    let values = file.tensor_f32("q8").unwrap();
    let want: Vec<f32> = (0..2)
        .flat_map(|_| (-16..16).map(|q| q as f32 * 0.5))
        .collect();
    assert_eq!(values, want);
    assert_eq!(
        file.tensor_f32("norm").unwrap(),
        [0.0, 0.5, 1.0, 1.5, 2.0, 2.5]
    );
    assert_eq!(file.tensor_f32("half").unwrap(), [-1.0, 0.0, 1.0, 2.0]);
    assert_eq!(file.tensor_bytes("norm").unwrap().len(), 24);
}

#[test]
fn missing_keys_and_wrong_types_are_named_errors() {
    let file = GgufFile::from_bytes("sample", sample()).unwrap();
    let e = file.get_u64("llama.block_count").unwrap_err().to_string();
    assert!(
        e.contains("llama.block_count") && e.contains("missing"),
        "{e}"
    );
    let e = file.get_str("u32").unwrap_err().to_string();
    assert!(e.contains("'u32'") && e.contains("string"), "{e}");
    assert!(file.get_u64("i8").is_err(), "a negative value is not a u64");
    let e = file.tensor("nope").unwrap_err().to_string();
    assert!(e.contains("'nope'"), "{e}");
    // The file still answers after rejected calls.
    assert_eq!(file.get_u64("u32").unwrap(), 70000);
}

#[test]
fn every_truncation_is_an_error() {
    let bytes = sample();
    for len in 0..bytes.len() {
        let cut = bytes[..len].to_vec();
        assert!(
            GgufFile::from_bytes("cut", cut).is_err(),
            "a file cut to {len} of {} bytes was accepted",
            bytes.len()
        );
    }
    assert!(GgufFile::from_bytes("whole", bytes).is_ok());
}

/// Reads everything a parsed file offers, so that a bad value cannot hide behind
/// lazy access.
fn touch_everything(file: &GgufFile) {
    for (key, _) in file.metadata() {
        let _ = file.get_str_array(key);
        let _ = file.get_i64_array(key);
        let _ = file.get_f64(key);
    }
    for t in file.tensors() {
        let _ = file.tensor_f32(&t.name);
    }
}

#[test]
fn bit_flips_give_errors_or_valid_files_never_panics() {
    let bytes = sample();
    let mut seed = 0x9e3779b97f4a7c15u64;
    let mut rejected = 0;
    for _ in 0..20_000 {
        seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        let mut flipped = bytes.clone();
        let at = (seed >> 33) as usize % flipped.len();
        flipped[at] ^= 1 << ((seed >> 20) % 8);
        match GgufFile::from_bytes("flipped", flipped) {
            Ok(file) => touch_everything(&file),
            Err(_) => rejected += 1,
        }
    }
    assert!(rejected > 1000, "only {rejected} flips were rejected");
}

#[test]
fn hostile_headers_are_rejected() {
    let header = |version: u32, tensors: u64, kvs: u64| {
        let mut b = b"GGUF".to_vec();
        b.extend(version.to_le_bytes());
        b.extend(tensors.to_le_bytes());
        b.extend(kvs.to_le_bytes());
        b
    };
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (b"GGML\x03\0\0\0".to_vec(), "not a GGUF"),
        (header(1, 0, 0), "version 1"),
        (header(4, 0, 0), "version 4"),
        (header(3, u64::MAX, 0), "tensor count"),
        (header(3, 0, 1 << 60), "metadata count"),
    ];
    for (bytes, needle) in cases {
        let e = GgufFile::from_bytes("bad", bytes).unwrap_err().to_string();
        assert!(e.contains(needle), "{needle}: {e}");
    }
    // A string longer than the file, an array of 2^62 values, an unknown value type.
    let mut w = Writer::new();
    let mut long = Vec::new();
    long.extend((1u64 << 50).to_le_bytes());
    w.kv("s", 8, &long);
    assert!(GgufFile::from_bytes("bad", w.build()).is_err());
    let mut w = Writer::new();
    let mut arr = 4u32.to_le_bytes().to_vec();
    arr.extend((1u64 << 62).to_le_bytes());
    w.kv("a", 9, &arr);
    assert!(GgufFile::from_bytes("bad", w.build()).is_err());
    let mut w = Writer::new();
    w.kv("x", 13, &[0; 8]);
    assert!(GgufFile::from_bytes("bad", w.build()).is_err());
    // Tensors: a rank of 5, dims whose product overflows, an unknown type, data past
    // the end, a misaligned offset, a duplicate name, a row that is not whole blocks.
    let bad_tensor = |dims: &[u64], ty: u32, data: Vec<u8>| {
        let mut w = Writer::new();
        w.tensor("t", dims, ty, data);
        GgufFile::from_bytes("bad", w.build())
    };
    assert!(bad_tensor(&[1, 1, 1, 1, 1], 0, vec![0; 4]).is_err());
    assert!(bad_tensor(&[1 << 40, 1 << 40], 0, vec![]).is_err());
    assert!(bad_tensor(&[4], 99, vec![0; 16]).is_err());
    assert!(bad_tensor(&[64], 0, vec![0; 16]).is_err());
    assert!(bad_tensor(&[33], 8, vec![0; 64]).is_err());
    let mut w = Writer::new();
    w.tensor("t", &[4], 0, vec![0; 16])
        .tensor("t", &[4], 0, vec![0; 16]);
    assert!(GgufFile::from_bytes("bad", w.build()).is_err());
    let mut bytes = {
        let mut w = Writer::new();
        w.tensor("t", &[4], 0, vec![0; 16]);
        w.build()
    };
    // The offset field is the 8 bytes before the padding: make it 4 (misaligned).
    let info_end = 24 + 8 + 1 + 4 + 8 + 4 + 8;
    bytes[info_end - 8] = 4;
    let e = GgufFile::from_bytes("bad", bytes).unwrap_err().to_string();
    assert!(e.contains("aligned"), "{e}");
    // An unreadable path is an I/O error naming it.
    let e = GgufFile::open("/nonexistent/model.gguf")
        .unwrap_err()
        .to_string();
    assert!(e.contains("/nonexistent/model.gguf"), "{e}");
}

#[test]
fn custom_alignment_is_honoured() {
    let mut w = Writer::new();
    w.alignment = 64;
    w.kv("general.alignment", 4, &64u32.to_le_bytes())
        .tensor("a", &[3], 0, vec![1; 12])
        .tensor("b", &[5], 0, vec![2; 20]);
    let file = GgufFile::from_bytes("aligned", w.build()).unwrap();
    assert_eq!(file.alignment(), 64);
    for t in file.tensors() {
        assert_eq!(t.offset % 64, 0);
    }
    assert_eq!(file.tensor_bytes("b").unwrap(), &[2; 20]);
    let mut w = Writer::new();
    w.kv("general.alignment", 4, &48u32.to_le_bytes());
    assert!(GgufFile::from_bytes("bad", w.build()).is_err());
}

#[test]
fn the_builder_round_trips_through_the_reader() {
    let mut b = GgufBuilder::new();
    b.metadata("name", Value::String("tiny".into()))
        .metadata("n", Value::U32(7))
        .metadata("x", Value::F64(-2.5))
        .metadata(
            "list",
            Value::Array(ValueType::I32, vec![Value::I32(-1), Value::I32(4)]),
        );
    let q8: Vec<u8> = f16_bytes(1.0).into_iter().chain(0..32u8).collect();
    b.tensor("w", &[32, 1], TensorType::Quant(QuantFormat::Q8_0), q8)
        .unwrap();
    b.tensor("v", &[3], TensorType::F32, vec![0; 12]).unwrap();
    assert!(b.tensor("bad", &[3], TensorType::F32, vec![0; 11]).is_err());
    // Dimensions whose product overflows are an error, not a wrapped size.
    let err = b
        .tensor("huge", &[1 << 32, 1 << 32], TensorType::F32, vec![0; 16])
        .err()
        .unwrap();
    assert!(matches!(err, rlx_ir::Error::SizeOverflow { .. }), "{err}");
    assert!(
        b.tensor("past", &[1 << 62], TensorType::F32, vec![])
            .is_err()
    );
    let file = GgufFile::from_bytes("built", b.to_bytes()).unwrap();
    assert_eq!(file.get_str("name").unwrap(), "tiny");
    assert_eq!(file.get_u64("n").unwrap(), 7);
    assert_eq!(file.get_f64("x").unwrap(), -2.5);
    assert_eq!(file.get_i64_array("list").unwrap(), [-1, 4]);
    let w = file.tensor_f32("w").unwrap();
    assert_eq!(w, (0..32).map(|i| i as f32).collect::<Vec<_>>());
    assert_eq!(file.tensor("v").unwrap().dims, [3]);
}
