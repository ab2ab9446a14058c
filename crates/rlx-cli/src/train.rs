//! `rlx train`: the ready-made training jobs (digits, charlm) with a progress bar,
//! and at the end a loss-curve PNG, the checkpoint and a JSON summary.

use crate::png::loss_chart;
use crate::progress::Progress;
use anyhow::Context;
use rlx::models::ModelStore;
use rlx::train::Trainer;
use rlx::train::jobs::{CharCorpus, CharLmConfig, Digits, DigitsConfig, DigitsModel, JobReport};
use serde_json::{Value, json};
use std::path::{Path, PathBuf};

/// Arguments of `rlx train`.
#[derive(clap::Args)]
pub struct TrainArgs {
    #[command(subcommand)]
    job: Job,
}

#[derive(clap::Subcommand)]
enum Job {
    /// Classify scikit-learn's 8x8 handwritten digits (fetched on first use) with an
    /// MLP or a small CNN; the summary holds `test_accuracy`.
    Digits(DigitsArgs),
    /// Train a character-level GPT on the Python standard library's source (this
    /// machine's interpreter's `Lib/`, split by file); the summary holds `val_loss`
    /// (nats per byte) and a generated `sample`.
    Charlm(CharLmArgs),
}

/// Options every job takes.
#[derive(clap::Args)]
struct Common {
    /// Where to train: `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: rlx::Device,
    /// CPU threads (0: one per core, or $RLX_NUM_THREADS).
    #[arg(long, default_value_t = 0)]
    threads: usize,
    /// Seed of the initial weights and the data order.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// The directory for checkpoint.safetensors, loss.png and summary.json.
    #[arg(long)]
    out: Option<PathBuf>,
    /// Print exactly one JSON object (the summary) on stdout.
    #[arg(long)]
    json: bool,
    /// No progress bar or messages on stderr.
    #[arg(long, short)]
    quiet: bool,
    /// Time every kernel of the steps and print the totals (on stderr with --json).
    #[arg(long)]
    profile: bool,
    /// Round the operands of the f32 matrix products to bfloat16, summing in f32, on a
    /// CPU with AMX tiles (PyTorch's bf16 autocast, for the products); the weights,
    /// gradients and optimizer stay f32. Ignored on other CPUs and on the GPU.
    #[arg(long)]
    bf16: bool,
}

#[derive(clap::Args)]
struct DigitsArgs {
    /// The network.
    #[arg(long, value_enum, default_value = "mlp")]
    model: ModelKind,
    /// Passes over the training set.
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=10_000))]
    epochs: u32,
    /// Images per step.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=1024))]
    batch: u32,
    /// Peak learning rate (AdamW; warmup, then cosine decay).
    #[arg(long, default_value_t = 5e-3, value_parser = positive_rate)]
    lr: f64,
    #[command(flatten)]
    common: Common,
}

#[derive(clap::Args)]
struct CharLmArgs {
    /// Training steps.
    #[arg(long, default_value_t = 2000, value_parser = clap::value_parser!(u64).range(1..))]
    steps: u64,
    /// Sequences per step.
    #[arg(long, default_value_t = 16, value_parser = clap::value_parser!(u32).range(1..=4096))]
    batch: u32,
    /// Stop after this many steps, keeping the schedule of --steps (the start of a
    /// longer run).
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    stop_after: Option<u64>,
    /// Peak learning rate (AdamW; warmup, then cosine decay to a tenth).
    #[arg(long, default_value_t = 2e-3, value_parser = positive_rate)]
    lr: f64,
    /// Transformer layers.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=64))]
    layers: u32,
    /// Model width (a multiple of --heads).
    #[arg(long, default_value_t = 256, value_parser = clap::value_parser!(u32).range(1..=8192))]
    width: u32,
    /// Attention heads.
    #[arg(long, default_value_t = 4, value_parser = clap::value_parser!(u32).range(1..=256))]
    heads: u32,
    /// Bytes of context.
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(1..=8192))]
    context: u32,
    /// Dropout on each block's residual branches while training (0 to 1, exclusive).
    #[arg(long, default_value_t = 0.0)]
    dropout: f64,
    /// The Python interpreter whose standard library is the corpus.
    #[arg(long, default_value = "python3")]
    python: String,
    /// Start from the params in this safetensors file instead of the seeded draw.
    #[arg(long, value_name = "FILE")]
    init: Option<PathBuf>,
    /// Train on the windows in this file (`context + 1` bytes each, `batch` per step,
    /// in order) instead of drawing them from the corpus.
    #[arg(long, value_name = "FILE")]
    batches: Option<PathBuf>,
    #[command(flatten)]
    common: Common,
}

#[derive(Clone, Copy, clap::ValueEnum)]
enum ModelKind {
    Mlp,
    Cnn,
}

/// Parses a learning rate: a finite number above zero.
fn positive_rate(text: &str) -> Result<f64, String> {
    match text.parse::<f64>() {
        Ok(rate) if rate.is_finite() && rate > 0.0 => Ok(rate),
        Ok(rate) => Err(format!("must be a positive number, got {rate}")),
        Err(e) => Err(e.to_string()),
    }
}

/// Runs the chosen job.
pub fn run(args: &TrainArgs) -> anyhow::Result<()> {
    match &args.job {
        Job::Digits(a) => digits(a),
        Job::Charlm(a) => charlm(a),
    }
}

fn charlm(args: &CharLmArgs) -> anyhow::Result<()> {
    let c = &args.common;
    if !args.width.is_multiple_of(args.heads) {
        anyhow::bail!(
            "--width {} is not a multiple of --heads {}",
            args.width,
            args.heads
        );
    }
    let corpus = CharCorpus::python_stdlib(&args.python).context("reading the corpus")?;
    if !c.quiet {
        eprintln!(
            "rlx: corpus: {} training files ({:.1} MB), {} validation files ({:.1} MB)",
            corpus.files.0,
            corpus.train.len() as f64 / 1e6,
            corpus.files.1,
            corpus.val.len() as f64 / 1e6
        );
    }
    let config = CharLmConfig {
        layers: args.layers as usize,
        width: args.width as usize,
        heads: args.heads as usize,
        context: args.context as usize,
        batch: args.batch as usize,
        steps: args.steps,
        stop_after: args.stop_after,
        lr: args.lr,
        seed: c.seed,
        device: c.device,
        threads: c.threads,
        profile: c.profile,
        bf16_products: c.bf16,
        dropout: args.dropout,
        init: args.init.clone(),
        fixed_batches: match &args.batches {
            Some(path) => {
                Some(std::fs::read(path).with_context(|| format!("reading {}", path.display()))?)
            }
            None => None,
        },
        ..CharLmConfig::default()
    };
    let steps = args.stop_after.unwrap_or(args.steps).min(args.steps);
    let mut bar = Progress::new("charlm", steps, c.quiet);
    let tokens = (config.batch * config.context) as f64;
    let (trainer, report) = rlx::train::jobs::train_charlm(&corpus, &config, &mut |e| {
        bar.update(e.step, e.loss, e.elapsed, ("tokens", tokens));
    })?;
    let settings = json!({
        "layers": config.layers,
        "width": config.width,
        "heads": config.heads,
        "context": config.context,
        "batch": config.batch,
        "lr": config.lr,
        "dropout": config.dropout,
        "bf16_products": bf16_in_effect(config.bf16_products, config.device),
        "seed": config.seed,
        "train_bytes": corpus.train.len(),
        "val_bytes": corpus.val.len(),
        "params": trainer.params().iter().map(|p| p.shape.num_elements()).sum::<usize>(),
    });
    finish("charlm", &trainer, &report, settings, c)
}

fn digits(args: &DigitsArgs) -> anyhow::Result<()> {
    let c = &args.common;
    let store = ModelStore::from_env()?.quiet(c.quiet);
    let data = Digits::fetch(&store).context("loading the digits")?;
    let config = DigitsConfig {
        model: match args.model {
            ModelKind::Mlp => DigitsModel::Mlp,
            ModelKind::Cnn => DigitsModel::Cnn,
        },
        epochs: args.epochs as usize,
        batch: args.batch as usize,
        lr: args.lr,
        seed: c.seed,
        device: c.device,
        threads: c.threads,
        profile: c.profile,
        bf16_products: c.bf16,
    };
    let name = match config.model {
        DigitsModel::Mlp => "digits-mlp",
        DigitsModel::Cnn => "digits-cnn",
    };
    let mut bar = Progress::new(name, 0, c.quiet);
    let batch = config.batch as f64;
    let (trainer, report) = rlx::train::jobs::train_digits(&data, &config, &mut |e| {
        if e.step == 1 {
            bar = Progress::new(name, e.total, c.quiet);
        }
        bar.update(e.step, e.loss, e.elapsed, ("images", batch));
    })?;
    let settings = json!({
        "model": name,
        "epochs": config.epochs,
        "batch": config.batch,
        "lr": config.lr,
        "seed": config.seed,
        "bf16_products": bf16_in_effect(config.bf16_products, config.device),
        "train_images": data.train_y.len(),
        "test_images": data.test_y.len(),
    });
    finish("digits", &trainer, &report, settings, c)
}

/// Whether `--bf16` changes the products: on the CPU, and only where it has AMX.
fn bf16_in_effect(asked: bool, device: rlx::Device) -> bool {
    asked && device == rlx::Device::Cpu && rlx::cpu::has_amx()
}

/// Writes the checkpoint, the loss curve and the summary, and prints the summary.
fn finish(
    job: &str,
    trainer: &Trainer,
    report: &JobReport,
    settings: Value,
    c: &Common,
) -> anyhow::Result<()> {
    let dir = c
        .out
        .clone()
        .unwrap_or_else(|| PathBuf::from(format!("rlx-train-{job}")));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    if let Some(profile) = trainer.profile().filter(|_| c.profile) {
        crate::bench::print_profile(&profile, c.json);
    }
    let checkpoint = dir.join("checkpoint.safetensors");
    trainer.save_checkpoint(&checkpoint)?;
    let plot = dir.join("loss.png");
    write_plot(&plot, report)?;

    let mut summary = json!({
        "job": job,
        "device": c.device.to_string(),
        "steps": trainer.steps(),
        "final_loss": report.losses.last().copied().unwrap_or(f32::NAN),
        "train_seconds": report.train_seconds,
        "steps_per_second": trainer.steps() as f64 / report.train_seconds.max(1e-9),
        "checkpoint": checkpoint.display().to_string(),
        "loss_plot": plot.display().to_string(),
        "settings": settings,
        "step_seconds_median": median(&report.step_seconds),
        "peak_rss_bytes": peak_rss_bytes(),
        "losses": report.losses,
        "step_seconds": report.step_seconds,
    });
    for (name, value) in &report.metrics {
        summary[name] = json!(value);
    }
    for (name, value) in &report.texts {
        summary[name] = json!(value);
    }
    let text = serde_json::to_string_pretty(&summary)?;
    let summary_path = dir.join("summary.json");
    std::fs::write(&summary_path, &text)
        .with_context(|| format!("writing {}", summary_path.display()))?;
    if c.json {
        println!("{}", serde_json::to_string(&summary)?);
    } else {
        for (name, value) in &report.metrics {
            println!("{name}: {value:.4}");
        }
        for (name, value) in &report.texts {
            println!("{name}:\n{value}");
        }
        println!(
            "{} steps in {:.1} s; wrote {}, {} and {}",
            trainer.steps(),
            report.train_seconds,
            checkpoint.display(),
            plot.display(),
            summary_path.display()
        );
    }
    Ok(())
}

/// The loss per step (faint) and its running mean over a window of steps (dark).
fn write_plot(path: &Path, report: &JobReport) -> anyhow::Result<()> {
    let raw: Vec<(f64, f64)> = report
        .losses
        .iter()
        .enumerate()
        .map(|(i, &l)| ((i + 1) as f64, l as f64))
        .collect();
    let window = (raw.len() / 50).max(1);
    let smooth: Vec<(f64, f64)> = raw
        .chunks(window)
        .map(|c| {
            let n = c.len() as f64;
            (
                c.iter().map(|p| p.0).sum::<f64>() / n,
                c.iter().map(|p| p.1).sum::<f64>() / n,
            )
        })
        .collect();
    let chart = loss_chart(
        &[(&raw, [180, 200, 235]), (&smooth, [20, 60, 160])],
        640,
        400,
    );
    std::fs::write(path, chart.to_png()).with_context(|| format!("writing {}", path.display()))
}

fn median(xs: &[f64]) -> f64 {
    let mut v = xs.to_vec();
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
}

/// The process's peak resident memory (Linux: `VmHWM`), if known.
fn peak_rss_bytes() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let kib: u64 = line.split_whitespace().nth(1)?.parse().ok()?;
    Some(kib * 1024)
}
