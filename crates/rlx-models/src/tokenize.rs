//! Text to token ids with a model's `tokenizer.json` (the `tokenizers` crate), with
//! RLX's own truncation and no padding: the embedder pads whole batches itself.

use rlx_ir::{Error, Result};
use std::path::Path;
use tokenizers::{Tokenizer, TruncationDirection, TruncationParams, TruncationStrategy};

/// One text as the encoder sees it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TokenizedText {
    /// Token ids, special tokens included.
    pub ids: Vec<u32>,
    /// Segment ids (all 0 for a single text).
    pub type_ids: Vec<u32>,
    /// True when the text was longer than the model's maximum and was cut.
    pub truncated: bool,
}

/// A tokenizer that adds the model's special tokens and truncates at `max_len`.
#[derive(Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
    max_len: usize,
    vocab_limit: usize,
    origin: String,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TextTokenizer({}, max {})", self.origin, self.max_len)
    }
}

impl TextTokenizer {
    /// Loads `tokenizer.json`. Texts are truncated to `max_len` tokens (special tokens
    /// included); every id must be below `vocab_limit` (the model's embedding rows).
    pub fn from_file(path: &Path, max_len: usize, vocab_limit: usize) -> Result<TextTokenizer> {
        let origin = path.display().to_string();
        if !path.is_file() {
            return Err(Error::Io {
                path: origin,
                message: "no such file (the model directory needs tokenizer.json)".into(),
            });
        }
        let mut inner = Tokenizer::from_file(path).map_err(|e| Error::Format {
            path: origin.clone(),
            message: format!("not a valid tokenizer: {e}"),
        })?;
        inner.with_padding(None);
        inner
            .with_truncation(Some(TruncationParams {
                direction: TruncationDirection::Right,
                max_length: max_len,
                strategy: TruncationStrategy::LongestFirst,
                stride: 0,
            }))
            .map_err(|e| Error::Format {
                path: origin.clone(),
                message: format!("cannot truncate at {max_len} tokens: {e}"),
            })?;
        Ok(TextTokenizer {
            inner,
            max_len,
            vocab_limit,
            origin,
        })
    }

    /// The most tokens a text keeps.
    pub fn max_len(&self) -> usize {
        self.max_len
    }

    /// Tokenizes one text. `index` names it in errors. A text with no content (empty,
    /// or only whitespace and control characters) is an error.
    pub fn encode(&self, text: &str, index: usize) -> Result<TokenizedText> {
        let what = || format!("text #{index}");
        let encoding = self
            .inner
            .encode(text, true)
            .map_err(|e| Error::invalid(what(), format!("cannot tokenize: {e}")))?;
        let content = encoding
            .get_special_tokens_mask()
            .iter()
            .filter(|&&special| special == 0)
            .count();
        if content == 0 {
            return Err(Error::invalid(
                what(),
                "is empty (nothing but whitespace or control characters); \
                 every text needs at least one token",
            ));
        }
        if let Some(&bad) = encoding
            .get_ids()
            .iter()
            .find(|&&id| id as usize >= self.vocab_limit)
        {
            return Err(Error::Format {
                path: self.origin.clone(),
                message: format!(
                    "token id {bad} (from {}) is outside the model's {} embedding rows; \
                     the tokenizer does not belong to this model",
                    what(),
                    self.vocab_limit
                ),
            });
        }
        Ok(TokenizedText {
            ids: encoding.get_ids().to_vec(),
            type_ids: encoding.get_type_ids().to_vec(),
            truncated: !encoding.get_overflowing().is_empty(),
        })
    }
}
