//! `rlx convert`: a Hugging Face Llama checkpoint written as a GGUF file.

use anyhow::{Context, Result};
use clap::Args;
use rlx::models::llama::{GgufWeights, write_gguf};
use std::path::PathBuf;

/// Arguments of `rlx convert`.
#[derive(Args)]
pub struct ConvertArgs {
    /// A Llama checkpoint directory (config.json, model.safetensors).
    model: PathBuf,
    /// The GGUF file to write.
    out: PathBuf,
    /// How the 2-D weights are stored: `f32`, `f16` or `q8_0` (norms stay f32).
    #[arg(long, default_value = "f16")]
    weights: GgufWeights,
}

/// Runs the command.
pub fn run(args: &ConvertArgs) -> Result<()> {
    write_gguf(&args.model, &args.out, args.weights).with_context(|| {
        format!(
            "converting {} to {}",
            args.model.display(),
            args.out.display()
        )
    })?;
    println!("wrote {}", args.out.display());
    Ok(())
}
