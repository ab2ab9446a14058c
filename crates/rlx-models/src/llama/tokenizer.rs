//! The byte-level BPE tokenizer stored in GGUF metadata (`tokenizer.ggml.*`), built
//! with the `tokenizers` crate, and the chat template.

use rlx_gguf::GgufFile;
use rlx_ir::{Error, Result};
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, PreTokenizerWrapper, Tokenizer};

/// GGUF token type of control tokens (`<|im_start|>` ...).
const CONTROL: i64 = 3;
/// GGUF token type of user-defined tokens, matched verbatim in text.
const USER_DEFINED: i64 = 4;

/// A model's tokenizer and chat format.
#[derive(Clone)]
pub struct LlmTokenizer {
    inner: Tokenizer,
    vocab_size: usize,
    bos: Option<u32>,
    add_bos: bool,
    stop: Vec<u32>,
    chat: Option<ChatFormat>,
}

impl std::fmt::Debug for LlmTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "LlmTokenizer({} tokens, stop {:?})",
            self.vocab_size, self.stop
        )
    }
}

/// A ChatML conversation format (`<|im_start|>role\n...<|im_end|>\n`).
#[derive(Clone, Debug, PartialEq, Eq)]
struct ChatFormat {
    /// The system message the template inserts when the conversation has none.
    default_system: Option<String>,
}

impl ChatFormat {
    /// Recognizes a ChatML Jinja template and its default system message.
    fn from_template(template: &str) -> Option<ChatFormat> {
        if !template.contains("<|im_start|>") || !template.contains("<|im_end|>") {
            return None;
        }
        let marker = "<|im_start|>system";
        let default_system = template.find(marker).and_then(|at| {
            let rest = &template[at + marker.len()..];
            let rest = rest
                .strip_prefix("\\n")
                .or_else(|| rest.strip_prefix('\n'))?;
            let end = rest.find("<|im_end|>")?;
            let text = &rest[..end];
            (!text.contains("{{") && !text.contains("{%")).then(|| text.replace("\\n", "\n"))
        });
        Some(ChatFormat { default_system })
    }

    fn render(&self, system: Option<&str>, user: &str) -> String {
        let mut out = String::new();
        if let Some(system) = system.or(self.default_system.as_deref()) {
            out.push_str(&format!("<|im_start|>system\n{system}<|im_end|>\n"));
        }
        out.push_str(&format!(
            "<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n"
        ));
        out
    }
}

fn format_error(file: &GgufFile, message: String) -> Error {
    Error::Format {
        path: file.path().into(),
        message,
    }
}

impl LlmTokenizer {
    /// Builds the tokenizer from `tokenizer.ggml.*` metadata (model `gpt2`: byte-level
    /// BPE with merges).
    pub fn from_gguf(file: &GgufFile) -> Result<LlmTokenizer> {
        let model = file.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(format_error(
                file,
                format!("tokenizer model '{model}' is not supported (only byte-level BPE, 'gpt2')"),
            ));
        }
        let tokens = file.get_str_array("tokenizer.ggml.tokens")?;
        let merges = file.get_str_array("tokenizer.ggml.merges")?;
        let types = match file.get("tokenizer.ggml.token_type") {
            Some(_) => file.get_i64_array("tokenizer.ggml.token_type")?,
            None => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(format_error(
                file,
                format!("{} token types for {} tokens", types.len(), tokens.len()),
            ));
        }
        let vocab: Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), i as u32))
            .collect();
        let merges = merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_string(), b.to_string()))
                    .ok_or_else(|| format_error(file, format!("merge '{m}' is not two tokens")))
            })
            .collect::<Result<Vec<_>>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| format_error(file, format!("cannot build the BPE model: {e}")))?;
        let mut inner = Tokenizer::new(bpe);
        let byte_level = ByteLevel::new(false, true, true);
        let pre = file.get_str("tokenizer.ggml.pre").unwrap_or("default");
        // Pre-tokenizers that split digits one by one before the GPT-2 pattern.
        if matches!(
            pre,
            "smollm" | "llama3" | "llama-bpe" | "qwen2" | "deepseek-llm"
        ) {
            inner.with_pre_tokenizer(Some(Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                PreTokenizerWrapper::ByteLevel(byte_level),
            ])));
        } else {
            inner.with_pre_tokenizer(Some(byte_level));
        }
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let special: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, ty)| **ty == CONTROL || **ty == USER_DEFINED)
            .map(|(t, ty)| AddedToken::from(t.to_string(), *ty == CONTROL))
            .collect();
        inner.add_special_tokens(&special);
        let id = |key: &str| -> Result<Option<u32>> {
            match file.get(key) {
                None => Ok(None),
                Some(_) => {
                    let v = file.get_u64(key)?;
                    if v as usize >= tokens.len() {
                        return Err(format_error(
                            file,
                            format!("{key} = {v} is outside the {} tokens", tokens.len()),
                        ));
                    }
                    Ok(Some(v as u32))
                }
            }
        };
        let bos = id("tokenizer.ggml.bos_token_id")?;
        let eos = id("tokenizer.ggml.eos_token_id")?;
        let eot = id("tokenizer.ggml.eot_token_id")?;
        let mut stop: Vec<u32> = eos.into_iter().chain(eot).collect();
        // The chat end marker and the document end stop generation too.
        for marker in ["<|im_end|>", "<|endoftext|>", "<|eot_id|>"] {
            if let Some(i) = tokens.iter().position(|t| *t == marker) {
                let i = i as u32;
                if !stop.contains(&i) {
                    stop.push(i);
                }
            }
        }
        let chat = file
            .get_str("tokenizer.chat_template")
            .ok()
            .and_then(ChatFormat::from_template);
        Ok(LlmTokenizer {
            inner,
            vocab_size: tokens.len(),
            bos,
            add_bos: file
                .get_bool("tokenizer.ggml.add_bos_token")
                .unwrap_or(false),
            stop,
            chat,
        })
    }

    /// Token ids of `text`. Special tokens written in the text (`<|im_start|>`) are
    /// matched; a beginning-of-sequence token is added when the model asks for one.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let encoding = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::invalid("tokenize", e.to_string()))?;
        let mut ids = Vec::with_capacity(encoding.len() + 1);
        if self.add_bos
            && let Some(bos) = self.bos
        {
            ids.push(bos);
        }
        ids.extend_from_slice(encoding.get_ids());
        Ok(ids)
    }

    /// The text of `ids` (special tokens included as written). Ids outside the
    /// vocabulary are an error.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some(bad) = ids.iter().find(|&&i| i as usize >= self.vocab_size) {
            return Err(Error::invalid(
                "detokenize",
                format!("token id {bad} is outside the {} tokens", self.vocab_size),
            ));
        }
        self.inner
            .decode(ids, false)
            .map_err(|e| Error::invalid("detokenize", e.to_string()))
    }

    /// Wraps a user message (and an optional system message) in the model's chat
    /// format, ending where the assistant's reply begins.
    pub fn chat_prompt(&self, user: &str, system: Option<&str>) -> Result<String> {
        let chat = self.chat.as_ref().ok_or_else(|| {
            Error::invalid(
                "chat",
                "the model has no chat template RLX understands (ChatML)",
            )
        })?;
        Ok(chat.render(system, user))
    }

    /// Tokens that end generation.
    pub fn stop_tokens(&self) -> &[u32] {
        &self.stop
    }

    /// Number of tokens.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn chatml_template_and_default_system() {
        let t = "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system\nBe brief.<|im_end|>\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}";
        let chat = ChatFormat::from_template(t).unwrap();
        assert_eq!(chat.default_system.as_deref(), Some("Be brief."));
        assert_eq!(
            chat.render(None, "Hi"),
            "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n"
        );
        assert!(
            chat.render(Some("X"), "Hi")
                .starts_with("<|im_start|>system\nX<|im_end|>")
        );
        assert!(ChatFormat::from_template("{{ bos_token }}{{ message }}").is_none());
    }
}
