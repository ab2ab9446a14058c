//! Llama-architecture language models: configuration, weights (GGUF or Hugging Face
//! safetensors), the forward graph over a key/value cache, the tokenizer from GGUF
//! metadata, sampling, and generation ([`Llm`]); and writing a safetensors
//! checkpoint as GGUF ([`write_gguf`]).

mod config;
mod convert;
mod graph;
mod llm;
mod recommended;
mod sample;
mod tokenizer;
mod weights;

pub use config::LlamaConfig;
pub use convert::{GgufWeights, write_gguf};
pub use graph::{
    build_graph, cache_handles, k_cache_name, rope_tables, symbolic_graph, v_cache_name,
};
pub use llm::{GenerateOptions, Generation, Llm, LlmOptions, StopReason};
pub use recommended::{GENERAL_SAMPLING, RecommendedSampling};
pub use sample::{Sampler, SamplingOptions, argmax};
pub use tokenizer::LlmTokenizer;
pub use weights::{LlamaWeights, WeightEntry};
