//! `rlx bench onnx`: times a compiled ONNX model in process.

use crate::run_onnx::{parse_shapes, read_inputs};
use anyhow::Result;
use clap::Args;
use rlx::models::onnx::OnnxSession;
use rlx::onnx::{ImportOptions, OnnxModel};
use rlx::runtime::CompileOptions;
use rlx::{DType, TensorData};
use std::path::PathBuf;
use std::time::Instant;

/// Arguments of `rlx bench onnx`.
#[derive(Args)]
pub struct OnnxBenchArgs {
    /// The `.onnx` file.
    model: PathBuf,
    /// A symbolic dim as `SYM=N` (repeatable).
    #[arg(long = "shape", value_name = "SYM=N")]
    shapes: Vec<String>,
    /// An input as `NAME=FILE.npy`; it gives the input its data and dims. Inputs not
    /// given are filled (floats uniform in [-1, 1), integers 1, bools true).
    #[arg(long = "input", value_name = "NAME=FILE.npy")]
    inputs: Vec<String>,
    /// CPU threads (default: all of the runtime's).
    #[arg(long, default_value_t = 0, hide_default_value = true)]
    threads: usize,
    /// Where the model runs: `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: rlx::Device,
    /// Timed runs (the median is reported).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    runs: u32,
    /// Untimed runs first.
    #[arg(long, default_value_t = 3)]
    warmup: u32,
    /// Print one JSON object: `{"median_ms", "runs", "threads"}` and more (with
    /// `--profile`, `"profile"`: the time per kernel, slowest first, and
    /// `"launches"`: every launch in run order).
    #[arg(long)]
    json: bool,
    /// After timing, run as many times again with per-kernel timing and print where
    /// the time goes.
    #[arg(long)]
    profile: bool,
}

/// Data for an input that was not given.
fn filler(dtype: DType, n: usize) -> TensorData {
    let mut state = 0x9e37_79b9_7f4a_7c15u64;
    let values: Vec<f64> = (0..n)
        .map(|_| {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            if dtype.is_float() {
                (state >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0
            } else {
                1.0
            }
        })
        .collect();
    TensorData::from_f64(dtype, &values)
}

/// Runs the benchmark.
pub fn run(args: &OnnxBenchArgs) -> Result<()> {
    let available = rlx::cpu_threads();
    if args.threads > available {
        anyhow::bail!(
            "--threads {} is more than the runtime's {available} threads (set RLX_NUM_THREADS to change the pool size)",
            args.threads
        );
    }
    let threads = if args.threads == 0 {
        available
    } else {
        args.threads
    };
    let started = Instant::now();
    let model = OnnxModel::load(&args.model)?;
    let mut options = ImportOptions::new();
    options.symbols = parse_shapes(&args.shapes)?;
    let given = read_inputs(&args.inputs)?;
    for (name, t) in &given {
        options = options.input_value(name.clone(), t.clone());
    }
    let mut session =
        OnnxSession::on_device(model, args.device, CompileOptions::new().threads(threads));
    let compiled = session.prepare(&options)?;
    let prepare_ms = started.elapsed().as_secs_f64() * 1e3;
    let data: Vec<(String, TensorData)> = compiled
        .inputs
        .iter()
        .map(|(name, shape)| {
            let d = match given.iter().find(|(n, _)| n == name) {
                Some((_, t)) => t.data.clone(),
                None => filler(shape.dtype(), shape.num_elements()),
            };
            (name.clone(), d)
        })
        .collect();
    let feeds: Vec<(&str, rlx::TensorRef)> =
        data.iter().map(|(n, d)| (n.as_str(), d.as_ref())).collect();
    for _ in 0..args.warmup {
        std::hint::black_box(compiled.graph.run_typed(&feeds)?);
    }
    let mut times = Vec::with_capacity(args.runs as usize);
    for _ in 0..args.runs {
        let t = Instant::now();
        std::hint::black_box(compiled.graph.run_typed(&feeds)?);
        times.push(t.elapsed().as_secs_f64() * 1e3);
    }
    let mut sorted = times.clone();
    sorted.sort_by(f64::total_cmp);
    let n = sorted.len();
    let median = if n % 2 == 1 {
        sorted[n / 2]
    } else {
        (sorted[n / 2 - 1] + sorted[n / 2]) / 2.0
    };
    let profile = if args.profile {
        compiled.graph.set_profiling(true);
        for _ in 0..args.runs {
            std::hint::black_box(compiled.graph.run_typed(&feeds)?);
        }
        let p = compiled.graph.profile();
        compiled.graph.set_profiling(false);
        p
    } else {
        None
    };
    if args.json {
        let mut report = serde_json::json!({"median_ms": median, "runs": n, "threads": threads, "min_ms": sorted[0], "prepare_ms": prepare_ms, "times_ms": times});
        if let Some(p) = &profile {
            report["profile"] = crate::bench::profile_json(p);
            report["launches"] = crate::bench::launches_json(p);
        }
        println!("{report}");
        return Ok(());
    } else {
        let shapes: Vec<String> = compiled
            .inputs
            .iter()
            .map(|(n, s)| format!("{n} {s}"))
            .collect();
        println!("{} ({})", args.model.display(), shapes.join(", "));
        println!(
            "median {median:.3} ms, min {:.3} ms over {n} runs on {threads} threads (import + compile {prepare_ms:.0} ms)",
            sorted[0]
        );
    }
    if let Some(p) = profile {
        crate::bench::print_profile(&p, false);
    }
    Ok(())
}
