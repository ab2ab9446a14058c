//! `rlx bench llm`: prompt processing and generation speed of a Llama model, measured
//! the way `llama-bench` measures them: `pp` processes a prompt of N tokens in one
//! batch from an empty context; `tg` generates N tokens one at a time from an empty
//! context. Compilation and a warm-up pass are excluded.

use anyhow::Context;
use rlx::models::ModelStore;
use rlx::models::llama::{Llm, LlmOptions};
use serde::Serialize;
use std::time::Instant;

/// Arguments of `rlx bench llm`.
#[derive(clap::Args)]
pub struct LlmArgs {
    /// A packaged model name or a .gguf file.
    #[arg(long, default_value = "smollm2")]
    model: String,
    /// Prompt tokens processed in one batch (0 skips the prompt test).
    #[arg(long, default_value_t = 512)]
    prompt: usize,
    /// Tokens generated one at a time (0 skips the generation test).
    #[arg(long = "gen", default_value_t = 128)]
    generate: usize,
    /// Repetitions of each test (the median is reported).
    #[arg(long, default_value_t = 5, value_parser = clap::value_parser!(u32).range(1..=1000))]
    reps: u32,
    /// CPU threads (default: one per core, or $RLX_NUM_THREADS).
    #[arg(long, default_value_t = 0, hide_default_value = true)]
    threads: usize,
    /// Where the model runs: `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: rlx::Device,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// Time every kernel of the generation test and print where the time goes.
    #[arg(long)]
    profile: bool,
}

#[derive(Serialize)]
struct Test {
    name: String,
    tokens: usize,
    median_tokens_per_s: f64,
    mean_tokens_per_s: f64,
    stdev_tokens_per_s: f64,
    samples_tokens_per_s: Vec<f64>,
}

#[derive(Serialize)]
struct LlmReport {
    model: String,
    threads: usize,
    load_ms: f64,
    weight_bytes: usize,
    tests: Vec<Test>,
}

/// Token ids spread over the vocabulary (deterministic).
fn synthetic(n: usize, vocab: usize) -> Vec<u32> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((state >> 33) as usize % (vocab - 100) + 100) as u32
        })
        .collect()
}

fn summarize(name: String, tokens: usize, seconds: &[f64]) -> Test {
    let mut rates: Vec<f64> = seconds.iter().map(|s| tokens as f64 / s).collect();
    let samples = rates.clone();
    rates.sort_by(f64::total_cmp);
    let n = rates.len();
    let median = if n % 2 == 1 {
        rates[n / 2]
    } else {
        (rates[n / 2 - 1] + rates[n / 2]) / 2.0
    };
    let mean = rates.iter().sum::<f64>() / n as f64;
    let var = rates.iter().map(|r| (r - mean).powi(2)).sum::<f64>() / (n.max(2) - 1) as f64;
    Test {
        name,
        tokens,
        median_tokens_per_s: median,
        mean_tokens_per_s: mean,
        stdev_tokens_per_s: var.sqrt(),
        samples_tokens_per_s: samples,
    }
}

/// Runs the prompt and generation tests.
pub fn run(args: &LlmArgs) -> anyhow::Result<()> {
    let started = Instant::now();
    let threads = if args.threads == 0 {
        rlx::cpu_threads()
    } else {
        args.threads
    };
    if threads > rlx::cpu_threads() {
        anyhow::bail!(
            "--threads {threads} is more than the runtime's {} threads (set RLX_NUM_THREADS)",
            rlx::cpu_threads()
        );
    }
    let options = LlmOptions {
        store: Some(ModelStore::from_env()?.quiet(args.json)),
        max_context: (args.prompt + args.generate)
            .max(args.prompt.max(args.generate))
            .max(1),
        max_chunk: args.prompt.next_power_of_two().max(16),
        threads,
        device: args.device,
    };
    let mut llm = Llm::load_with(&args.model, options)
        .with_context(|| format!("loading model '{}'", args.model))?;
    let load_ms = started.elapsed().as_secs_f64() * 1e3;
    let vocab = llm.config().vocab_size;
    let mut tests = Vec::new();
    if args.prompt > 0 {
        let ids = synthetic(args.prompt, vocab);
        llm.prefill(&ids)?; // compiles the prompt graph, warms caches
        let mut seconds = Vec::new();
        for rep in 0..args.reps {
            llm.reset();
            if rep + 1 == args.reps {
                llm.set_profiling(args.profile);
            }
            let t = Instant::now();
            std::hint::black_box(llm.prefill(&ids)?);
            seconds.push(t.elapsed().as_secs_f64());
        }
        tests.push(summarize(
            format!("pp{}", args.prompt),
            args.prompt,
            &seconds,
        ));
    }
    if args.generate > 0 {
        let ids = synthetic(args.generate, vocab);
        llm.reset();
        for &id in ids.iter().take(4) {
            llm.step(id)?; // warm-up
        }
        let mut seconds = Vec::new();
        for rep in 0..args.reps {
            llm.reset();
            if rep + 1 == args.reps {
                llm.decode_graph().set_profiling(args.profile);
            }
            let t = Instant::now();
            for &id in &ids {
                std::hint::black_box(llm.step(id)?);
            }
            seconds.push(t.elapsed().as_secs_f64());
        }
        tests.push(summarize(
            format!("tg{}", args.generate),
            args.generate,
            &seconds,
        ));
    }
    let report = LlmReport {
        model: args.model.clone(),
        threads,
        load_ms,
        weight_bytes: llm.weight_bytes(),
        tests,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        println!(
            "{} on {threads} thread(s), loaded in {load_ms:.0} ms",
            report.model
        );
        for t in &report.tests {
            println!(
                "  {:<8} {:>9.2} tokens/s median  ({:.2} ± {:.2} mean ± sd over {} reps)",
                t.name,
                t.median_tokens_per_s,
                t.mean_tokens_per_s,
                t.stdev_tokens_per_s,
                t.samples_tokens_per_s.len()
            );
        }
    }
    for (graph, profile) in llm.profiles() {
        println!("{graph}:");
        crate::bench::print_profile(&profile, false);
    }
    Ok(())
}
