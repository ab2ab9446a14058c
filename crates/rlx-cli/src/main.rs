//! The `rlx` command-line tool.

mod bench;
mod bench_llm;
mod bench_onnx;
mod convert;
mod embed;
mod examples;
mod forward;
mod generate;
mod inspect;
mod onnx_test;
mod png;
mod progress;
mod run_onnx;
mod train;

use clap::{Parser, Subcommand};

/// RLX: an ML compiler and runtime. Build or import a model, compile it once, run it
/// many times.
#[derive(Parser)]
#[command(name = "rlx", version, about, long_about = None, after_help = environment_help())]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The environment switches, for the end of `rlx --help`.
fn environment_help() -> String {
    format!("Environment:\n{}", rlx::ir::env::Switch::help_text())
}

#[derive(Subcommand)]
enum Command {
    /// Embed sentences with a sentence-embedding model (default: minilm, fetched on
    /// first use).
    Embed(embed::EmbedArgs),
    /// Generate text with a Llama-architecture model (default: smollm2, fetched on
    /// first use), streaming tokens to stdout.
    Generate(generate::GenerateArgs),
    /// Time a compiled model in process (median of repeated runs, warm-up excluded).
    Bench(bench::BenchArgs),
    /// Print a graph, its memory plan and the kernel that runs each op.
    Inspect(inspect::InspectArgs),
    /// Run an ONNX model on .npy inputs, or list its inputs and outputs.
    Run(run_onnx::RunArgs),
    /// One forward pass of a BERT or Llama checkpoint on token ids from a .npy file:
    /// the last hidden state or the logits, written as .npy (to compare with another
    /// implementation on the same weights).
    Forward(forward::ForwardArgs),
    /// Run ONNX backend test directories (model.onnx + test_data_set_*) and report
    /// PASS, FAIL or UNSUPPORTED for each.
    OnnxTest(onnx_test::OnnxTestArgs),
    /// Write a Hugging Face Llama checkpoint as a GGUF file (f32, f16 or Q8_0
    /// weights).
    Convert(convert::ConvertArgs),
    /// Train a ready-made job (digits, charlm) with a progress bar; writes the
    /// checkpoint, a loss-curve PNG and a JSON summary.
    Train(train::TrainArgs),
}

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Embed(args) => embed::run(&args),
        Command::Generate(args) => generate::run(&args),
        Command::Bench(args) => bench::run(&args),
        Command::Inspect(args) => inspect::run(&args),
        Command::OnnxTest(args) => onnx_test::run(&args),
        Command::Run(args) => run_onnx::run(&args),
        Command::Forward(args) => forward::run(&args),
        Command::Convert(args) => convert::run(&args),
        Command::Train(args) => train::run(&args),
    };
    match result {
        Ok(()) => std::process::ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            std::process::ExitCode::FAILURE
        }
    }
}
