//! BERT encoders: the config, the weights they read, and the graph builder.

mod config;
mod graph;

pub use config::{Activation, BertConfig, Pooling, SentenceConfig};
pub use graph::{
    WeightSpec, build_encoder, build_hidden_states, compute_dtype, symbolic_encoder, weight_specs,
};
