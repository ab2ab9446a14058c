//! Writing a Hugging Face Llama checkpoint (`config.json` + `model.safetensors`) as a
//! GGUF file, as llama.cpp's converter lays it out: GGUF tensor names, GGML dimension
//! order, query and key rows reordered from "rotate half" to adjacent rotary pairs,
//! and the 2-D weights in `f32`, `f16` or `Q8_0` (norms stay `f32`). The file carries
//! no tokenizer; a model loaded from it takes token ids.

use super::config::LlamaConfig;
use super::weights::{expected_tensors, hf_name, view_f32};
use crate::weights::SafeTensorsFile;
use rlx_gguf::{GgufBuilder, TensorType, Value};
use rlx_ir::{Error, QuantFormat, Result};
use std::path::Path;

/// How the 2-D weights are stored in the written file.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GgufWeights {
    /// IEEE binary32.
    F32,
    /// IEEE binary16.
    F16,
    /// Blocks of 32 values: an f16 scale and 32 signed bytes.
    Q8_0,
}

impl std::str::FromStr for GgufWeights {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s.to_ascii_lowercase().as_str() {
            "f32" => Ok(GgufWeights::F32),
            "f16" => Ok(GgufWeights::F16),
            "q8_0" => Ok(GgufWeights::Q8_0),
            other => Err(format!("'{other}' is not one of f32, f16, q8_0")),
        }
    }
}

/// Writes the checkpoint in `dir` to `out` as GGUF with its 2-D weights as `weights`.
/// Errors name what is missing or malformed; `out` is written only when every
/// tensor converted.
pub fn write_gguf(dir: &Path, out: &Path, weights: GgufWeights) -> Result<()> {
    let config = LlamaConfig::from_hf_json(&dir.join("config.json"))?;
    let file = SafeTensorsFile::open(&dir.join("model.safetensors"))?;
    let mut b = GgufBuilder::new();
    let u = |v: usize| Value::U32(u32::try_from(v).unwrap_or(u32::MAX));
    b.metadata("general.architecture", Value::String("llama".into()))
        .metadata("llama.block_count", u(config.layers))
        .metadata("llama.context_length", u(config.context_length))
        .metadata("llama.embedding_length", u(config.hidden))
        .metadata("llama.feed_forward_length", u(config.ffn))
        .metadata("llama.attention.head_count", u(config.heads))
        .metadata("llama.attention.head_count_kv", u(config.kv_heads))
        .metadata("llama.rope.dimension_count", u(config.head_dim))
        .metadata("llama.rope.freq_base", Value::F32(config.rope_base as f32))
        .metadata(
            "llama.attention.layer_norm_rms_epsilon",
            Value::F32(config.rms_eps as f32),
        )
        .metadata("llama.vocab_size", u(config.vocab_size));
    for (name, rows, cols) in expected_tensors(&config) {
        let hf = hf_name(&name);
        if name == "output.weight" && !file.contains(&hf) {
            // A tied head: readers fall back to the embedding.
            continue;
        }
        let dims = if rows == 1 {
            vec![cols]
        } else {
            vec![rows, cols]
        };
        let view = file.tensor(&hf, &dims)?;
        let mut values = view_f32(&view, file.path())?;
        let heads = if name.ends_with(".attn_q.weight") {
            Some(config.heads)
        } else if name.ends_with(".attn_k.weight") {
            Some(config.kv_heads)
        } else {
            None
        };
        if let Some(heads) = heads {
            values = adjacent_pairs(&values, heads, config.head_dim, cols);
        }
        // GGML order: the contiguous dim first.
        let ggml_dims = if rows == 1 {
            vec![cols]
        } else {
            vec![cols, rows]
        };
        let (ty, bytes) = match weights {
            _ if rows == 1 => (TensorType::F32, f32_bytes(&values)),
            GgufWeights::F32 => (TensorType::F32, f32_bytes(&values)),
            GgufWeights::F16 => (
                TensorType::F16,
                values
                    .iter()
                    .flat_map(|&v| half::f16::from_f32(v).to_le_bytes())
                    .collect(),
            ),
            GgufWeights::Q8_0 => {
                if cols % 32 != 0 {
                    return Err(Error::invalid(
                        "gguf conversion",
                        format!("'{hf}' rows of {cols} values do not fill Q8_0 blocks of 32"),
                    ));
                }
                (TensorType::Quant(QuantFormat::Q8_0), q8_0(&values))
            }
        };
        b.tensor(&name, &ggml_dims, ty, bytes)?;
    }
    std::fs::write(out, b.to_bytes()).map_err(|e| Error::Io {
        path: out.display().to_string(),
        message: e.to_string(),
    })
}

/// Rows of a `[heads * head_dim, cols]` projection reordered so that each head's
/// rotary pairs are adjacent (`(i, i + half)` becomes `(2i, 2i + 1)`), as GGUF stores
/// query and key weights.
fn adjacent_pairs(v: &[f32], heads: usize, head_dim: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; v.len()];
    let half = head_dim / 2;
    for h in 0..heads {
        for j in 0..half {
            for t in 0..2 {
                let (dst, src) = (h * head_dim + 2 * j + t, h * head_dim + t * half + j);
                out[dst * cols..(dst + 1) * cols].copy_from_slice(&v[src * cols..(src + 1) * cols]);
            }
        }
    }
    out
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// `Q8_0` blocks of `v` (a multiple of 32 values): per block the scale
/// `max |x| / 127` as f16, then each value divided by it, rounded to a byte.
fn q8_0(v: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(v.len() / 32 * 34);
    for block in v.chunks_exact(32) {
        let amax = block.iter().fold(0f32, |m, x| m.max(x.abs()));
        let d = amax / 127.0;
        let inv = if d > 0.0 { 1.0 / d } else { 0.0 };
        out.extend(half::f16::from_f32(d).to_le_bytes());
        out.extend(
            block
                .iter()
                .map(|x| (x * inv).round().clamp(-127.0, 127.0) as i8 as u8),
        );
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn q8_0_blocks_decode_to_within_half_a_step() {
        let v: Vec<f32> = (0..96)
            .map(|i| ((i * 37 % 101) as f32 - 50.0) / 7.0)
            .collect();
        let bytes = q8_0(&v);
        assert_eq!(bytes.len(), 3 * 34);
        let mut back = vec![0f32; 96];
        for (b, o) in bytes.chunks_exact(34).zip(back.chunks_exact_mut(32)) {
            QuantFormat::Q8_0.dequantize_block(b, o);
        }
        for (block, got) in v.chunks_exact(32).zip(back.chunks_exact(32)) {
            let step = block.iter().fold(0f32, |m, x| m.max(x.abs())) / 127.0;
            for (a, b) in block.iter().zip(got) {
                // Half a step of rounding, plus the scale's own f16 rounding.
                assert!((a - b).abs() <= 0.5 * step + a.abs() * 1e-3, "{a} vs {b}");
            }
        }
        assert!(q8_0(&[0.0; 32]).iter().skip(2).all(|&q| q == 0));
    }

    #[test]
    fn rotary_rows_become_adjacent_pairs() {
        // One head of 4 rows (pairs (0, 2) and (1, 3)), 2 columns.
        let v = [0., 0., 1., 1., 2., 2., 3., 3.];
        assert_eq!(
            adjacent_pairs(&v, 1, 4, 2),
            vec![0., 0., 2., 2., 1., 1., 3., 3.]
        );
    }

    #[test]
    fn weight_types_parse_and_unknown_ones_are_errors() {
        assert_eq!("Q8_0".parse::<GgufWeights>(), Ok(GgufWeights::Q8_0));
        assert_eq!("f16".parse::<GgufWeights>(), Ok(GgufWeights::F16));
        assert!("q4_k".parse::<GgufWeights>().unwrap_err().contains("q4_k"));
    }
}
