//! `rlx forward`: one forward pass of a native model checkpoint on token ids from a
//! `.npy` file, with the raw result written back as `.npy`: a BERT directory's last
//! hidden state, or a Llama checkpoint's logits (and, on request, greedy decoding).
//! It is how RLX's outputs are compared with another implementation's on the same
//! weights.

use anyhow::{Context, Result, bail};
use clap::Args;
use rlx::models::llama::{GenerateOptions, Llm, LlmOptions, SamplingOptions};
use rlx::models::npy::{read_npy, write_npy};
use rlx::models::{ModelStore, compile_hidden_states};
use rlx::runtime::CompileOptions;
use rlx::{Device, TensorData, TensorRef};
use std::path::{Path, PathBuf};

/// Arguments of `rlx forward`.
#[derive(Args)]
pub struct ForwardArgs {
    /// A BERT directory (config.json, model.safetensors), or a Llama checkpoint (a
    /// directory with config.json and model.safetensors, or a .gguf file).
    model: PathBuf,
    /// Token ids, an integer `.npy`: `[batch, seq]` for BERT, `[seq]` (or `[1, seq]`)
    /// for Llama.
    #[arg(long, value_name = "FILE.npy")]
    ids: PathBuf,
    /// Where the result goes (`f32` `.npy`: `[batch, seq, hidden]` for BERT,
    /// `[seq, vocab]` logits for Llama).
    #[arg(long, value_name = "FILE.npy")]
    output: PathBuf,
    /// Llama only: also decode this many tokens greedily after the ids and print
    /// them as a JSON list on stdout.
    #[arg(long, default_value_t = 0)]
    generate: usize,
    /// Where the model runs: `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Allow TF32 tensor cores for f32 matrix products (CUDA).
    #[arg(long)]
    tf32: bool,
    /// BERT only: after the pass that is written, time this many more (after 3
    /// untimed) and print `{"median_ms", "median_ms_to_host", "runs"}` on stdout: the
    /// result left on the device, and copied back.
    #[arg(long, default_value_t = 0)]
    bench: usize,
    /// With --bench: time every kernel over that many more runs and print where the
    /// time goes (after the JSON line).
    #[arg(long, requires = "bench")]
    profile: bool,
}

/// What kind of checkpoint `path` is, from its `config.json` (`model_type`).
fn is_bert(path: &Path) -> Result<bool> {
    if !path.is_dir() {
        return Ok(false);
    }
    let config = path.join("config.json");
    let text = std::fs::read_to_string(&config)
        .with_context(|| format!("reading {}", config.display()))?;
    let json: serde_json::Value =
        serde_json::from_str(&text).with_context(|| format!("parsing {}", config.display()))?;
    Ok(json.get("model_type").and_then(|v| v.as_str()) == Some("bert"))
}

/// The ids as `i64` with their dims.
fn read_ids(path: &Path) -> Result<(Vec<usize>, Vec<i64>)> {
    let (dims, data) = read_npy(path)?;
    let ids: Vec<i64> = match data {
        TensorData::I64(v) => v,
        TensorData::I32(v) => v.into_iter().map(i64::from).collect(),
        other => bail!(
            "{}: token ids must be int32 or int64, not {}",
            path.display(),
            other.dtype()
        ),
    };
    Ok((dims, ids))
}

/// The median time of `runs` calls of `run` in ms, after 3 untimed ones.
fn time_runs(runs: usize, mut run: impl FnMut() -> rlx::Result<()>) -> Result<f64> {
    for _ in 0..3 {
        run()?;
    }
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        let started = std::time::Instant::now();
        run()?;
        times.push(started.elapsed().as_secs_f64() * 1e3);
    }
    times.sort_by(f64::total_cmp);
    Ok(times[times.len() / 2])
}

/// Runs the command.
pub fn run(args: &ForwardArgs) -> Result<()> {
    rlx::device_available(args.device)?;
    let (dims, ids) = read_ids(&args.ids)?;
    if is_bert(&args.model)? {
        let [batch, seq] = dims[..] else {
            bail!("BERT ids must be [batch, seq], not {dims:?}");
        };
        if args.generate > 0 {
            bail!("--generate is for Llama checkpoints");
        }
        let options = CompileOptions::new().allow_tf32(args.tf32);
        let (config, mut graph) =
            compile_hidden_states(&args.model, batch, seq, args.device, None, &options)?;
        let zeros = vec![0i64; ids.len()];
        let ones = vec![1i64; ids.len()];
        let feeds = [
            ("input_ids", TensorRef::I64(&ids)),
            ("token_type_ids", TensorRef::I64(&zeros)),
            ("attention_mask", TensorRef::I64(&ones)),
        ];
        let out = graph.run_typed(&feeds)?;
        let hidden = out
            .into_iter()
            .next()
            .context("the encoder has no output")?;
        write_npy(&args.output, &[batch, seq, config.hidden_size], &hidden)?;
        if args.bench > 0 {
            // As PyTorch is timed: the result stays on the device (inputs still go
            // up from the host). The time with the copy back is reported beside it.
            let on_device = time_runs(args.bench, || graph.run_typed_on_device(&feeds))?;
            let to_host = time_runs(args.bench, || graph.run_typed(&feeds).map(drop))?;
            println!(
                "{}",
                serde_json::json!({
                    "median_ms": on_device,
                    "median_ms_to_host": to_host,
                    "runs": args.bench,
                })
            );
            if args.profile {
                graph.set_profiling(true);
                time_runs(args.bench, || graph.run_typed_on_device(&feeds))?;
                if let Some(profile) = graph.profile() {
                    crate::bench::print_profile(&profile, false);
                }
            }
        }
        return Ok(());
    }
    let seq = match dims[..] {
        [n] | [1, n] => n,
        _ => bail!("Llama ids must be [seq] or [1, seq], not {dims:?}"),
    };
    let ids: Vec<u32> = ids
        .iter()
        .map(|&i| {
            u32::try_from(i).with_context(|| format!("token id {i} is negative or too large"))
        })
        .collect::<Result<_>>()?;
    let options = LlmOptions {
        store: Some(ModelStore::from_env()?.quiet(true)),
        max_context: (seq + args.generate).max(1),
        max_chunk: seq.next_power_of_two().max(16),
        device: args.device,
        ..LlmOptions::default()
    };
    let model = args.model.to_string_lossy();
    let mut llm = Llm::load_with(&model, options).with_context(|| format!("loading {model}"))?;
    let logits = llm.logits_all(&ids)?;
    let vocab = llm.config().vocab_size;
    let flat: Vec<f32> = logits.into_iter().flatten().collect();
    write_npy(&args.output, &[seq, vocab], &TensorData::F32(flat))?;
    if args.generate > 0 {
        llm.reset();
        let mut generated = Vec::with_capacity(args.generate);
        let greedy = SamplingOptions {
            temperature: 0.0,
            ..SamplingOptions::default()
        };
        llm.generate(
            &ids,
            &GenerateOptions {
                max_tokens: args.generate,
                sampling: greedy,
            },
            |id| {
                generated.push(id);
                Ok(())
            },
        )?;
        println!("{}", serde_json::to_string(&generated)?);
    }
    Ok(())
}
