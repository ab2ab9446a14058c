//! The model description read from a checkpoint directory: the BERT encoder's
//! `config.json` and the sentence-transformers files that say how token vectors
//! become one sentence vector.

use rlx_ir::{Error, Result};
use serde::Deserialize;
use std::path::Path;

/// The activation of the feed-forward block.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Activation {
    /// `x * Φ(x)` with the exact normal CDF (`"gelu"`).
    Gelu,
    /// The tanh approximation (`"gelu_new"`, `"gelu_pytorch_tanh"`).
    GeluTanh,
    /// `max(x, 0)`.
    Relu,
}

/// The hyper-parameters of a BERT encoder (`config.json`).
#[derive(Clone, Debug, PartialEq)]
pub struct BertConfig {
    /// Vocabulary size (rows of the word embedding).
    pub vocab_size: usize,
    /// Width of every token vector.
    pub hidden_size: usize,
    /// Number of encoder layers.
    pub num_layers: usize,
    /// Attention heads per layer (`hidden_size` must be a multiple).
    pub num_heads: usize,
    /// Width of the feed-forward block.
    pub intermediate_size: usize,
    /// Longest sequence the position embedding covers.
    pub max_position_embeddings: usize,
    /// Rows of the token-type embedding.
    pub type_vocab_size: usize,
    /// LayerNorm epsilon.
    pub layer_norm_eps: f64,
    /// Feed-forward activation.
    pub activation: Activation,
}

#[derive(Deserialize)]
struct RawBertConfig {
    vocab_size: usize,
    hidden_size: usize,
    num_hidden_layers: usize,
    num_attention_heads: usize,
    intermediate_size: usize,
    max_position_embeddings: usize,
    #[serde(default = "default_type_vocab")]
    type_vocab_size: usize,
    #[serde(default = "default_eps")]
    layer_norm_eps: f64,
    #[serde(default = "default_act")]
    hidden_act: String,
    #[serde(default)]
    position_embedding_type: Option<String>,
    #[serde(default)]
    model_type: Option<String>,
}

fn default_type_vocab() -> usize {
    2
}
fn default_eps() -> f64 {
    1e-12
}
fn default_act() -> String {
    "gelu".into()
}

impl BertConfig {
    /// Reads and checks `config.json`.
    pub fn from_file(path: &Path) -> Result<BertConfig> {
        let text = read_text(path)?;
        BertConfig::from_json(&text, &path.display().to_string())
    }

    /// Parses and checks the text of a `config.json`; `origin` names it in errors.
    pub fn from_json(text: &str, origin: &str) -> Result<BertConfig> {
        let raw: RawBertConfig = serde_json::from_str(text).map_err(|e| Error::Format {
            path: origin.to_string(),
            message: format!("not a BERT config: {e}"),
        })?;
        let bad = |message: String| Error::Format {
            path: origin.to_string(),
            message,
        };
        if let Some(kind) = raw.model_type.as_deref()
            && kind != "bert"
        {
            return Err(bad(format!(
                "model_type '{kind}' is not a BERT encoder (this builder reads bert)"
            )));
        }
        if let Some(kind) = raw.position_embedding_type.as_deref()
            && kind != "absolute"
        {
            return Err(bad(format!(
                "position_embedding_type '{kind}' is not supported (only 'absolute')"
            )));
        }
        let activation = match raw.hidden_act.as_str() {
            "gelu" => Activation::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" => Activation::GeluTanh,
            "relu" => Activation::Relu,
            other => {
                return Err(bad(format!(
                    "hidden_act '{other}' is not supported (gelu, gelu_new, relu)"
                )));
            }
        };
        for (name, value) in [
            ("vocab_size", raw.vocab_size),
            ("hidden_size", raw.hidden_size),
            ("num_hidden_layers", raw.num_hidden_layers),
            ("num_attention_heads", raw.num_attention_heads),
            ("intermediate_size", raw.intermediate_size),
            ("max_position_embeddings", raw.max_position_embeddings),
            ("type_vocab_size", raw.type_vocab_size),
        ] {
            if value == 0 || value > 1 << 24 {
                return Err(bad(format!("{name} = {value} is out of range")));
            }
        }
        if !raw.hidden_size.is_multiple_of(raw.num_attention_heads) {
            return Err(bad(format!(
                "hidden_size {} is not a multiple of num_attention_heads {}",
                raw.hidden_size, raw.num_attention_heads
            )));
        }
        if !(raw.layer_norm_eps.is_finite() && raw.layer_norm_eps > 0.0) {
            return Err(bad(format!(
                "layer_norm_eps {} must be positive",
                raw.layer_norm_eps
            )));
        }
        Ok(BertConfig {
            vocab_size: raw.vocab_size,
            hidden_size: raw.hidden_size,
            num_layers: raw.num_hidden_layers,
            num_heads: raw.num_attention_heads,
            intermediate_size: raw.intermediate_size,
            max_position_embeddings: raw.max_position_embeddings,
            type_vocab_size: raw.type_vocab_size,
            layer_norm_eps: raw.layer_norm_eps,
            activation,
        })
    }

    /// Width of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_heads
    }
}

/// How token vectors become one sentence vector.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Pooling {
    /// Mean over the real (unpadded) tokens.
    Mean,
    /// The first token (`[CLS]`).
    Cls,
    /// Elementwise maximum over the real tokens.
    Max,
}

/// The sentence-embedding head: pooling, normalization and the longest input.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SentenceConfig {
    /// The pooling mode.
    pub pooling: Pooling,
    /// Whether the pooled vector is scaled to unit length.
    pub normalize: bool,
    /// Texts are truncated to this many tokens, `[CLS]` and `[SEP]` included.
    pub max_seq_length: usize,
}

#[derive(Deserialize)]
struct RawPooling {
    #[serde(default)]
    pooling_mode_cls_token: bool,
    #[serde(default)]
    pooling_mode_mean_tokens: bool,
    #[serde(default)]
    pooling_mode_max_tokens: bool,
    #[serde(default)]
    pooling_mode_mean_sqrt_len_tokens: bool,
}

#[derive(Deserialize)]
struct RawModule {
    #[serde(rename = "type")]
    kind: String,
    #[serde(default)]
    path: String,
}

#[derive(Deserialize)]
struct RawSentenceBert {
    max_seq_length: Option<usize>,
}

impl SentenceConfig {
    /// Reads the sentence-transformers files of `dir` when present
    /// (`modules.json`, the pooling module's `config.json`,
    /// `sentence_bert_config.json`). Without them: mean pooling, no normalization,
    /// the encoder's full length, as sentence-transformers does for a plain encoder.
    pub fn from_dir(dir: &Path, encoder: &BertConfig) -> Result<SentenceConfig> {
        let mut config = SentenceConfig {
            pooling: Pooling::Mean,
            normalize: false,
            max_seq_length: encoder.max_position_embeddings,
        };
        let modules_path = dir.join("modules.json");
        if modules_path.is_file() {
            let modules: Vec<RawModule> = parse_json(&modules_path)?;
            config.normalize = modules.iter().any(|m| m.kind.ends_with(".Normalize"));
            if let Some(pool) = modules.iter().find(|m| m.kind.ends_with(".Pooling")) {
                let pool_path = dir.join(&pool.path).join("config.json");
                if pool_path.is_file() {
                    config.pooling = pooling_mode(&parse_json(&pool_path)?, &pool_path)?;
                }
            }
        }
        let sbert_path = dir.join("sentence_bert_config.json");
        if sbert_path.is_file() {
            let raw: RawSentenceBert = parse_json(&sbert_path)?;
            if let Some(len) = raw.max_seq_length {
                if len < 4 || len > encoder.max_position_embeddings {
                    return Err(Error::Format {
                        path: sbert_path.display().to_string(),
                        message: format!(
                            "max_seq_length {len} must be in 4..={}",
                            encoder.max_position_embeddings
                        ),
                    });
                }
                config.max_seq_length = len;
            }
        }
        Ok(config)
    }
}

fn pooling_mode(raw: &RawPooling, path: &Path) -> Result<Pooling> {
    let chosen = [
        (raw.pooling_mode_mean_tokens, Pooling::Mean),
        (raw.pooling_mode_cls_token, Pooling::Cls),
        (raw.pooling_mode_max_tokens, Pooling::Max),
    ];
    let on: Vec<Pooling> = chosen.iter().filter(|(b, _)| *b).map(|c| c.1).collect();
    if raw.pooling_mode_mean_sqrt_len_tokens || on.len() != 1 {
        return Err(Error::Format {
            path: path.display().to_string(),
            message: "exactly one of pooling_mode_mean_tokens, pooling_mode_cls_token and \
                      pooling_mode_max_tokens must be set (combined modes are not supported)"
                .into(),
        });
    }
    Ok(on[0])
}

/// Reads a whole text file, with the path in the error.
pub(crate) fn read_text(path: &Path) -> Result<String> {
    std::fs::read_to_string(path).map_err(|e| Error::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}

fn parse_json<T: for<'de> Deserialize<'de>>(path: &Path) -> Result<T> {
    serde_json::from_str(&read_text(path)?).map_err(|e| Error::Format {
        path: path.display().to_string(),
        message: e.to_string(),
    })
}
