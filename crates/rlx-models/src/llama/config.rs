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
        // Newer checkpoints keep the rotary settings in `rope_parameters` (older ones
        // at the top level, with any scaling in `rope_scaling`). Only plain rotary
        // embeddings are built; a scaled variant would silently give other logits.
        let rope = json.get("rope_parameters");
        let rope_base = rope
            .and_then(|r| r.get("rope_theta"))
            .and_then(serde_json::Value::as_f64)
            .unwrap_or_else(|| float("rope_theta", 10_000.0));
        for scaling in [rope, json.get("rope_scaling")].into_iter().flatten() {
            let kind = scaling
                .get("rope_type")
                .or_else(|| scaling.get("type"))
                .and_then(serde_json::Value::as_str)
                .unwrap_or("default");
            if !scaling.is_null() && kind != "default" {
                return Err(Error::Unsupported {
                    device: "llama checkpoint".into(),
                    what: format!("{shown}: rotary embeddings of type '{kind}'"),
                });
            }
        }
        let config = LlamaConfig {
            vocab_size: field("vocab_size")?,
            hidden,
            layers: field("num_hidden_layers")?,
            heads,
            kv_heads: field("num_key_value_heads").unwrap_or(heads),
            head_dim: field("head_dim").unwrap_or(hidden / heads.max(1)),
            ffn: field("intermediate_size")?,
            rope_base,
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

#[cfg(test)]
mod tests {
    use super::*;

    fn config_file(extra: &str) -> std::path::PathBuf {
        static NEXT: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let path =
            std::env::temp_dir().join(format!("rlx-llama-config-{}-{n}.json", std::process::id()));
        let text = format!(
            r#"{{"vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
                "num_attention_heads": 4, "num_key_value_heads": 2,
                "intermediate_size": 48, "rms_norm_eps": 1e-5{extra}}}"#
        );
        std::fs::write(&path, text).unwrap();
        path
    }

    #[test]
    fn the_rotary_base_is_read_where_each_generation_of_checkpoints_keeps_it() {
        let old = config_file(r#", "rope_theta": 500000.0, "rope_scaling": null"#);
        assert_eq!(LlamaConfig::from_hf_json(&old).unwrap().rope_base, 500000.0);
        let new =
            config_file(r#", "rope_parameters": {"rope_theta": 100000.0, "rope_type": "default"}"#);
        assert_eq!(LlamaConfig::from_hf_json(&new).unwrap().rope_base, 100000.0);
        let none = config_file("");
        assert_eq!(LlamaConfig::from_hf_json(&none).unwrap().rope_base, 10000.0);
        for p in [old, new, none] {
            let _ = std::fs::remove_file(p);
        }
    }

    #[test]
    fn scaled_rotary_embeddings_are_refused_not_ignored() {
        for extra in [
            r#", "rope_scaling": {"rope_type": "llama3", "factor": 32.0}"#,
            r#", "rope_parameters": {"rope_theta": 500000.0, "rope_type": "yarn"}"#,
            r#", "rope_scaling": {"type": "linear", "factor": 2.0}"#,
        ] {
            let path = config_file(extra);
            let e = LlamaConfig::from_hf_json(&path).unwrap_err();
            assert!(matches!(e, Error::Unsupported { .. }), "{extra}: {e}");
            let _ = std::fs::remove_file(path);
        }
    }
}
