//! The sampling settings a model's authors recommend: read from a GGUF file's
//! `general.sampling.*` metadata, a Hugging Face checkpoint's
//! `generation_config.json`, or the packaged-model table, and laid over RLX's
//! general defaults for whatever the model leaves unsaid. A user's explicit choice
//! wins over all of them.

use super::SamplingOptions;
use rlx_gguf::GgufFile;
use rlx_ir::{Error, Result};
use std::path::Path;

/// Sampling values a model recommends; `None` where it says nothing.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct RecommendedSampling {
    /// Softmax temperature (0: greedy).
    pub temperature: Option<f32>,
    /// Keep only the K most likely tokens (0: all).
    pub top_k: Option<usize>,
    /// Keep the most likely tokens whose probabilities add up to P.
    pub top_p: Option<f32>,
    /// Repetition penalty (1: off).
    pub repetition_penalty: Option<f32>,
}

/// RLX's own defaults, for what a model does not recommend: temperature 0.8,
/// top-k 40, top-p 0.95, no repetition penalty.
pub const GENERAL_SAMPLING: RecommendedSampling = RecommendedSampling {
    temperature: Some(0.8),
    top_k: Some(40),
    top_p: Some(0.95),
    repetition_penalty: Some(1.0),
};

impl RecommendedSampling {
    /// `self`'s values, with `fallback`'s where `self` has none.
    pub fn or(self, fallback: RecommendedSampling) -> RecommendedSampling {
        RecommendedSampling {
            temperature: self.temperature.or(fallback.temperature),
            top_k: self.top_k.or(fallback.top_k),
            top_p: self.top_p.or(fallback.top_p),
            repetition_penalty: self.repetition_penalty.or(fallback.repetition_penalty),
        }
    }

    /// Whether it says nothing at all.
    pub fn is_empty(&self) -> bool {
        *self == RecommendedSampling::default()
    }

    /// Sampling options from these values (over [`GENERAL_SAMPLING`] for any left
    /// out) and a seed, validated.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming a value out of its range (a model file can
    /// recommend nonsense).
    pub fn to_options(self, seed: u64) -> Result<SamplingOptions> {
        let all = self.or(GENERAL_SAMPLING);
        let options = SamplingOptions {
            temperature: all.temperature.unwrap_or(0.8),
            top_k: all.top_k.unwrap_or(40),
            top_p: all.top_p.unwrap_or(0.95),
            repetition_penalty: all.repetition_penalty.unwrap_or(1.0),
            seed,
        };
        options.validate()?;
        Ok(options)
    }

    /// The `general.sampling.*` keys of a GGUF file (`temp`, `top_k`, `top_p`,
    /// `penalty_repeat`). A top-k of 0 or less means no limit.
    ///
    /// # Errors
    /// [`Error::Format`] when a key holds something other than a number.
    pub fn from_gguf(file: &GgufFile) -> Result<RecommendedSampling> {
        let number = |key: &str| -> Result<Option<f64>> {
            match file.get(key) {
                None => Ok(None),
                Some(_) => file.get_f64(key).map(Some),
            }
        };
        Ok(RecommendedSampling {
            temperature: number("general.sampling.temp")?.map(|v| v as f32),
            top_k: number("general.sampling.top_k")?.map(|v| v.max(0.0) as usize),
            top_p: number("general.sampling.top_p")?.map(|v| v as f32),
            repetition_penalty: number("general.sampling.penalty_repeat")?.map(|v| v as f32),
        })
    }

    /// Settings given as `generation_config.json` keys and values (a packaged
    /// model's table); other keys are ignored.
    pub fn from_pairs(pairs: &[(&str, f64)]) -> RecommendedSampling {
        let get = |key: &str| pairs.iter().find(|(k, _)| *k == key).map(|&(_, v)| v);
        RecommendedSampling {
            temperature: get("temperature").map(|v| v as f32),
            top_k: get("top_k").map(|v| v.max(0.0) as usize),
            top_p: get("top_p").map(|v| v as f32),
            repetition_penalty: get("repetition_penalty").map(|v| v as f32),
        }
    }

    /// A Hugging Face `generation_config.json` (`temperature`, `top_k`, `top_p`,
    /// `repetition_penalty`; `do_sample: false` means greedy). Without `do_sample`
    /// the file's sampling values are taken as they are (transformers would decode
    /// greedily, but a file that gives a temperature means it, as llama.cpp's
    /// converter and serving tools read it). A missing file says nothing.
    ///
    /// # Errors
    /// [`Error::Format`] naming the file when it is not a JSON object or a value is
    /// not a number.
    pub fn from_generation_config(path: &Path) -> Result<RecommendedSampling> {
        let bad = |message: String| Error::Format {
            path: path.display().to_string(),
            message,
        };
        let text = match std::fs::read_to_string(path) {
            Ok(text) => text,
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
                return Ok(RecommendedSampling::default());
            }
            Err(e) => return Err(bad(format!("cannot be read: {e}"))),
        };
        let json: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        let object = json
            .as_object()
            .ok_or_else(|| bad("not a JSON object".into()))?;
        let number = |key: &str| -> Result<Option<f64>> {
            match object.get(key) {
                None | Some(serde_json::Value::Null) => Ok(None),
                Some(v) => v
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| bad(format!("'{key}' should be a number, found {v}"))),
            }
        };
        let greedy = object.get("do_sample") == Some(&serde_json::Value::Bool(false));
        Ok(RecommendedSampling {
            temperature: if greedy {
                Some(0.0)
            } else {
                number("temperature")?.map(|v| v as f32)
            },
            top_k: number("top_k")?.map(|v| v.max(0.0) as usize),
            top_p: number("top_p")?.map(|v| v as f32),
            repetition_penalty: number("repetition_penalty")?.map(|v| v as f32),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_model_value_wins_over_the_general_default() {
        let model = RecommendedSampling {
            temperature: Some(0.2),
            top_p: Some(0.9),
            ..Default::default()
        };
        let o = model.to_options(7).unwrap();
        assert_eq!((o.temperature, o.top_k, o.top_p, o.seed), (0.2, 40, 0.9, 7));
        assert!(RecommendedSampling::default().is_empty());
        assert!(!model.is_empty());
        let bad = RecommendedSampling {
            top_p: Some(1.5),
            ..Default::default()
        };
        assert!(bad.to_options(0).unwrap_err().to_string().contains("top_p"));
    }

    #[test]
    fn generation_config_is_read_and_checked() {
        let dir = std::env::temp_dir().join(format!("rlx-gencfg-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("generation_config.json");
        std::fs::write(
            &path,
            r#"{"temperature": 0.6, "top_p": 0.9, "top_k": 20, "bos_token_id": 1}"#,
        )
        .unwrap();
        let r = RecommendedSampling::from_generation_config(&path).unwrap();
        assert_eq!(r.temperature, Some(0.6));
        assert_eq!(r.top_k, Some(20));
        assert_eq!(r.repetition_penalty, None);
        std::fs::write(&path, r#"{"do_sample": false, "temperature": 0.6}"#).unwrap();
        let r = RecommendedSampling::from_generation_config(&path).unwrap();
        assert_eq!(r.temperature, Some(0.0));
        std::fs::write(&path, r#"{"temperature": "hot"}"#).unwrap();
        let e = RecommendedSampling::from_generation_config(&path).unwrap_err();
        assert!(e.to_string().contains("temperature"), "{e}");
        std::fs::write(&path, "[1, 2]").unwrap();
        assert!(RecommendedSampling::from_generation_config(&path).is_err());
        let missing = dir.join("absent.json");
        assert!(
            RecommendedSampling::from_generation_config(&missing)
                .unwrap()
                .is_empty()
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
