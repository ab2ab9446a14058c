//! The Llama hyper-parameters, from GGUF metadata or a Hugging Face `config.json`.

use rlx_gguf::GgufFile;
use rlx_ir::{Error, Result, RopeStyle};
use std::path::Path;

/// The shape of a Llama-architecture model.
#[derive(Clone, Debug, PartialEq)]
pub struct LlamaConfig {
    /// Token embedding rows.
    pub vocab_size: usize,
    /// Width of the residual stream.
    pub hidden: usize,
    /// Transformer blocks.
    pub layers: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads (grouped-query attention when fewer than `heads`).
    pub kv_heads: usize,
    /// Width of one head.
    pub head_dim: usize,
    /// Inner width of the SwiGLU feed-forward.
    pub ffn: usize,
    /// Base of the rotary frequencies.
    pub rope_base: f64,
    /// Which rotary pairing the stored q/k weights expect: GGUF files converted
    /// from Hugging Face checkpoints have their q/k rows permuted for adjacent
    /// pairs; Hugging Face checkpoints use the "rotate half" pairing.
    pub rope_style: RopeStyle,
    /// RMSNorm epsilon.
    pub rms_eps: f64,
    /// The longest context the model was trained for.
    pub context_length: usize,
}

impl LlamaConfig {
    /// Reads `llama.*` metadata from a GGUF file.
    pub fn from_gguf(file: &GgufFile) -> Result<LlamaConfig> {
        let arch = file.get_str("general.architecture")?;
        if arch != "llama" {
            return Err(Error::Format {
                path: file.path().into(),
                message: format!("architecture '{arch}' is not supported (only 'llama')"),
            });
        }
        let key = |k: &str| format!("llama.{k}");
        let hidden = file.get_usize(&key("embedding_length"))?;
        let heads = file.get_usize(&key("attention.head_count"))?;
        let kv_heads = match file.get(&key("attention.head_count_kv")) {
            Some(_) => file.get_usize(&key("attention.head_count_kv"))?,
            None => heads,
        };
        let vocab_size = match file.get(&key("vocab_size")) {
            Some(_) => file.get_usize(&key("vocab_size"))?,
            None => file.get_str_array("tokenizer.ggml.tokens")?.len(),
        };
        let head_dim = match file.get(&key("rope.dimension_count")) {
            Some(_) => file.get_usize(&key("rope.dimension_count"))?,
            None => hidden / heads.max(1),
        };
        let config = LlamaConfig {
            vocab_size,
            hidden,
            layers: file.get_usize(&key("block_count"))?,
            heads,
            kv_heads,
            head_dim,
            ffn: file.get_usize(&key("feed_forward_length"))?,
            rope_base: match file.get(&key("rope.freq_base")) {
                Some(_) => file.get_f64(&key("rope.freq_base"))?,
                None => 10_000.0,
            },
            rope_style: RopeStyle::Interleaved,
            rms_eps: file.get_f64(&key("attention.layer_norm_rms_epsilon"))?,
            context_length: file.get_usize(&key("context_length"))?,
        };
        config.check(file.path())?;
        Ok(config)
    }

    /// Reads a Hugging Face `config.json` of a `LlamaForCausalLM` checkpoint.
    pub fn from_hf_json(path: &Path) -> Result<LlamaConfig> {
        let shown = path.display().to_string();
        let text = std::fs::read_to_string(path).map_err(|e| Error::Io {
            path: shown.clone(),
            message: e.to_string(),
        })?;
        let json: serde_json::Value = serde_json::from_str(&text).map_err(|e| Error::Format {
            path: shown.clone(),
            message: format!("not valid JSON: {e}"),
        })?;
        let field = |k: &str| -> Result<usize> {
            json.get(k)
                .and_then(serde_json::Value::as_u64)
                .and_then(|v| usize::try_from(v).ok())
                .ok_or_else(|| Error::Format {
                    path: shown.clone(),
                    message: format!("'{k}' is missing or not a non-negative integer"),
                })
        };
        let float = |k: &str, default: f64| -> f64 {
            json.get(k)
                .and_then(serde_json::Value::as_f64)
                .unwrap_or(default)
        };
        let hidden = field("hidden_size")?;
        let heads = field("num_attention_heads")?;
        let config = LlamaConfig {
            vocab_size: field("vocab_size")?,
            hidden,
            layers: field("num_hidden_layers")?,
            heads,
            kv_heads: field("num_key_value_heads").unwrap_or(heads),
            head_dim: field("head_dim").unwrap_or(hidden / heads.max(1)),
            ffn: field("intermediate_size")?,
            rope_base: float("rope_theta", 10_000.0),
            rope_style: RopeStyle::HalfSplit,
            rms_eps: float("rms_norm_eps", 1e-6),
            context_length: field("max_position_embeddings").unwrap_or(2048),
        };
        config.check(&shown)?;
        Ok(config)
    }

    /// Rejects shapes the graph cannot be built for.
    fn check(&self, origin: &str) -> Result<()> {
        let bad = |message: String| {
            Err(Error::Format {
                path: origin.into(),
                message,
            })
        };
        if [
            self.vocab_size,
            self.hidden,
            self.layers,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.ffn,
        ]
        .contains(&0)
        {
            return bad(format!("a zero dimension in {self:?}"));
        }
        if !self.heads.is_multiple_of(self.kv_heads) {
            return bad(format!(
                "{} query heads are not a multiple of {} key/value heads",
                self.heads, self.kv_heads
            ));
        }
        if !self.head_dim.is_multiple_of(2) {
            return bad(format!(
                "head width {} is odd (rotary pairs)",
                self.head_dim
            ));
        }
        if !(self.rms_eps > 0.0 && self.rope_base > 1.0) {
            return bad(format!(
                "rms epsilon {} or rope base {} is out of range",
                self.rms_eps, self.rope_base
            ));
        }
        Ok(())
    }

    /// Width of all query heads together.
    pub fn q_width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Width of all key (or value) heads together.
    pub fn kv_width(&self) -> usize {
        self.kv_heads * self.head_dim
    }
}
