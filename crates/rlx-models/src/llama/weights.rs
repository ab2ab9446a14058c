//! Llama weights from a GGUF file (quantized tensors kept packed) or a Hugging Face
//! safetensors checkpoint, under one naming (GGUF's) so one graph builder serves both.

use super::config::LlamaConfig;
use crate::SafeTensorsFile;
use rlx_gguf::{GgufFile, QuantFormat, TensorType};
use rlx_ir::{DType, Error, Result, Shape};
use std::collections::HashMap;
use std::path::Path;

/// Where a weight's bytes are.
enum Data {
    /// Tensor bytes inside the memory-mapped GGUF file, used as stored.
    File(String),
    /// Bytes converted at load time (little-endian, in the param's dtype).
    Owned(Vec<u8>),
}

/// One weight as the graph sees it.
pub struct WeightEntry {
    /// Param name (GGUF naming, e.g. `blk.3.attn_q.weight`).
    pub name: String,
    /// The param's shape: `u8 [N, row_bytes]` for packed rows, `[K, N]` for a
    /// dense linear weight (`f32`, or `f16`/`bf16` as a checkpoint stores it), `f32 [len]` for norms, `f32 [rows, width]` for an
    /// embedding table.
    pub shape: Shape,
    /// The block format of packed rows, if the weight is quantized.
    pub format: Option<QuantFormat>,
    data: Data,
}

/// Every weight of a Llama model.
pub struct LlamaWeights {
    gguf: Option<GgufFile>,
    entries: Vec<WeightEntry>,
    index: HashMap<String, usize>,
}

/// Whether a GGUF tensor name is a linear layer's weight (used as `x @ W^T`).
fn is_linear(name: &str) -> bool {
    [
        "attn_q",
        "attn_k",
        "attn_v",
        "attn_output",
        "ffn_gate",
        "ffn_up",
        "ffn_down",
    ]
    .iter()
    .any(|part| name.ends_with(&format!(".{part}.weight")))
        || name == "output.weight"
}

/// `f32` values as little-endian bytes.
fn f32_bytes(values: &[f32]) -> Vec<u8> {
    values.iter().flat_map(|v| v.to_le_bytes()).collect()
}

/// A float tensor's values as `f32`.
pub(super) fn view_f32(view: &crate::TensorView<'_>, origin: &str) -> Result<Vec<f32>> {
    let b = view.bytes;
    Ok(match view.dtype {
        DType::F32 => b
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
            .collect(),
        DType::F16 => b
            .chunks_exact(2)
            .map(|c| half::f16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        DType::BF16 => b
            .chunks_exact(2)
            .map(|c| half::bf16::from_le_bytes([c[0], c[1]]).to_f32())
            .collect(),
        other => {
            return Err(Error::Format {
                path: origin.into(),
                message: format!("a weight has dtype {other}; f32, f16 or bf16 expected"),
            });
        }
    })
}

/// `[rows, cols]` row-major to `[cols, rows]`.
fn transpose(values: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    let mut out = vec![0f32; values.len()];
    for r in 0..rows {
        for c in 0..cols {
            out[c * rows + r] = values[r * cols + c];
        }
    }
    out
}

/// `[rows, cols]` row-major 2-byte elements (little-endian bytes) to `[cols, rows]`.
fn transpose_u16(bytes: &[u8], rows: usize, cols: usize) -> Vec<u8> {
    let mut out = vec![0u8; bytes.len()];
    for r in 0..rows {
        for c in 0..cols {
            let (from, to) = (2 * (r * cols + c), 2 * (c * rows + r));
            out[to..to + 2].copy_from_slice(&bytes[from..from + 2]);
        }
    }
    out
}

impl LlamaWeights {
    fn from_entries(gguf: Option<GgufFile>, entries: Vec<WeightEntry>) -> LlamaWeights {
        let index = entries
            .iter()
            .enumerate()
            .map(|(i, e)| (e.name.clone(), i))
            .collect();
        LlamaWeights {
            gguf,
            entries,
            index,
        }
    }

    /// Takes the weights of `file` (which stays open: packed tensors are read from
    /// the mapping when params are set), checking every expected tensor's shape.
    pub fn from_gguf(file: GgufFile, config: &LlamaConfig) -> Result<LlamaWeights> {
        let mut entries = Vec::new();
        for (name, rows, cols) in expected_tensors(config) {
            let Ok(info) = file.tensor(&name) else {
                if name == "output.weight" {
                    continue; // tied to the token embedding
                }
                file.tensor(&name)?;
                continue;
            };
            if info.row_major_dims() != [rows, cols] && !(rows == 1 && info.dims == [cols]) {
                return Err(Error::Format {
                    path: file.path().into(),
                    message: format!(
                        "tensor '{name}' is {:?} (GGML order), expected [{cols}, {rows}]",
                        info.dims
                    ),
                });
            }
            let linear = is_linear(&name);
            let entry = match info.ty {
                TensorType::Quant(format) => WeightEntry {
                    name: name.clone(),
                    shape: Shape::new(&[rows, format.row_bytes(cols)?], DType::U8),
                    format: Some(format),
                    data: Data::File(name.clone()),
                },
                TensorType::F32 if !linear => WeightEntry {
                    name: name.clone(),
                    shape: if rows == 1 {
                        Shape::new(&[cols], DType::F32)
                    } else {
                        Shape::new(&[rows, cols], DType::F32)
                    },
                    format: None,
                    data: Data::File(name.clone()),
                },
                _ => {
                    let values = file.tensor_f32(&name)?;
                    let (dims, values) = if linear {
                        (vec![cols, rows], transpose(&values, rows, cols))
                    } else if rows == 1 {
                        (vec![cols], values)
                    } else {
                        (vec![rows, cols], values)
                    };
                    WeightEntry {
                        name: name.clone(),
                        shape: Shape::new(&dims, DType::F32),
                        format: None,
                        data: Data::Owned(f32_bytes(&values)),
                    }
                }
            };
            entries.push(entry);
        }
        let dense_embedding = entries
            .first()
            .is_some_and(|e| e.name == "token_embd.weight" && e.format.is_none());
        if dense_embedding && !entries.iter().any(|e| e.name == "output.weight") {
            // A tied head over a dense embedding needs it as a [hidden, vocab] matrix.
            let values = file.tensor_f32("token_embd.weight")?;
            entries.push(WeightEntry {
                name: "output.weight".into(),
                shape: Shape::new(&[config.hidden, config.vocab_size], DType::F32),
                format: None,
                data: Data::Owned(f32_bytes(&transpose(
                    &values,
                    config.vocab_size,
                    config.hidden,
                ))),
            });
        }
        Ok(LlamaWeights::from_entries(Some(file), entries))
    }

    /// Loads a Hugging Face `LlamaForCausalLM` checkpoint's `model.safetensors`
    /// (f32, f16 or bf16), renaming to GGUF names. Linear weights are transposed to
    /// `[K, N]` and kept in their stored dtype; the rest are converted to `f32`.
    pub fn from_safetensors(path: &Path, config: &LlamaConfig) -> Result<LlamaWeights> {
        let file = SafeTensorsFile::open(path)?;
        let mut entries = Vec::new();
        for (name, rows, cols) in expected_tensors(config) {
            let hf = hf_name(&name);
            // A tied head reads the embedding, transposed once here like every
            // dense linear weight.
            let hf = if name == "output.weight" && !file.contains("lm_head.weight") {
                "model.embed_tokens.weight".to_string()
            } else {
                hf
            };
            let dims: Vec<usize> = if rows == 1 {
                vec![cols]
            } else {
                vec![rows, cols]
            };
            let view = file.tensor(&hf, &dims)?;
            if is_linear(&name) && matches!(view.dtype, DType::F16 | DType::BF16) {
                // Half-precision linear weights stay as stored (half the memory, and
                // half the bytes a decode step reads); the product widens them.
                entries.push(WeightEntry {
                    name,
                    shape: Shape::new(&[cols, rows], view.dtype),
                    format: None,
                    data: Data::Owned(transpose_u16(view.bytes, rows, cols)),
                });
                continue;
            }
            let values = view_f32(&view, file.path())?;
            let (dims, values) = if is_linear(&name) {
                (vec![cols, rows], transpose(&values, rows, cols))
            } else {
                (dims, values)
            };
            entries.push(WeightEntry {
                name,
                shape: Shape::new(&dims, DType::F32),
                format: None,
                data: Data::Owned(f32_bytes(&values)),
            });
        }
        Ok(LlamaWeights::from_entries(None, entries))
    }

    /// The weight called `name`, or an error naming it.
    pub fn entry(&self, name: &str) -> Result<&WeightEntry> {
        self.index
            .get(name)
            .map(|&i| &self.entries[i])
            .ok_or_else(|| Error::invalid("llama weights", format!("no weight '{name}'")))
    }

    /// Whether the model has a separate output head (else it is tied to the token
    /// embedding).
    pub fn has_output_head(&self) -> bool {
        self.index.contains_key("output.weight")
    }

    /// Every weight.
    pub fn entries(&self) -> &[WeightEntry] {
        &self.entries
    }

    /// The bytes of `entry`, in its param's dtype.
    pub fn bytes<'a>(&'a self, entry: &'a WeightEntry) -> Result<&'a [u8]> {
        match &entry.data {
            Data::Owned(bytes) => Ok(bytes),
            Data::File(name) => self
                .gguf
                .as_ref()
                .ok_or_else(|| Error::invalid("llama weights", "no file is open"))?
                .tensor_bytes(name),
        }
    }

    /// Total bytes of all weights as stored.
    pub fn total_bytes(&self) -> usize {
        self.entries.iter().map(|e| e.shape.byte_size()).sum()
    }
}

/// `(name, rows, cols)` of every tensor a Llama model has (`rows` = 1 for vectors),
/// in GGUF naming and row-major order: a linear layer is `[out, in]`.
pub(super) fn expected_tensors(c: &LlamaConfig) -> Vec<(String, usize, usize)> {
    let mut t = vec![("token_embd.weight".to_string(), c.vocab_size, c.hidden)];
    for l in 0..c.layers {
        let p = |s: &str| format!("blk.{l}.{s}.weight");
        t.push((p("attn_norm"), 1, c.hidden));
        t.push((p("attn_q"), c.q_width(), c.hidden));
        t.push((p("attn_k"), c.kv_width(), c.hidden));
        t.push((p("attn_v"), c.kv_width(), c.hidden));
        t.push((p("attn_output"), c.hidden, c.q_width()));
        t.push((p("ffn_norm"), 1, c.hidden));
        t.push((p("ffn_gate"), c.ffn, c.hidden));
        t.push((p("ffn_up"), c.ffn, c.hidden));
        t.push((p("ffn_down"), c.hidden, c.ffn));
    }
    t.push(("output_norm.weight".into(), 1, c.hidden));
    t.push(("output.weight".into(), c.vocab_size, c.hidden));
    t
}

/// The Hugging Face name of a GGUF-named tensor.
pub(super) fn hf_name(name: &str) -> String {
    match name {
        "token_embd.weight" => return "model.embed_tokens.weight".into(),
        "output_norm.weight" => return "model.norm.weight".into(),
        "output.weight" => return "lm_head.weight".into(),
        _ => {}
    }
    let rest = name.strip_prefix("blk.").unwrap_or(name);
    let (layer, part) = rest.split_once('.').unwrap_or(("0", rest));
    let part = part.strip_suffix(".weight").unwrap_or(part);
    let hf = match part {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "ffn_norm" => "post_attention_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        _ => "mlp.down_proj",
    };
    format!("model.layers.{layer}.{hf}.weight")
}
