//! `rlx bench`: in-process timings of compiled models (warm-up excluded, medians).

use anyhow::Context;
use rlx::TensorRef;
use rlx::models::{Embedder, EmbedderOptions, ModelStore};
use serde::Serialize;
use std::time::Instant;

/// Arguments of `rlx bench`.
#[derive(clap::Args)]
pub struct BenchArgs {
    #[command(subcommand)]
    what: BenchTarget,
}

#[derive(clap::Subcommand)]
enum BenchTarget {
    /// The MiniLM sentence encoder forward pass (embeddings out) at a fixed shape.
    Minilm(MinilmArgs),
    /// Prompt processing and generation of a Llama model (tokens/s, as llama-bench).
    Llm(crate::bench_llm::LlmArgs),
    /// f32 matrix products (row-major `[m, k] x [k, n]`) against the CPU's measured
    /// peak multiply-add rate.
    Gemm(GemmArgs),
    /// An ONNX model at a binding of its symbolic dims (median of repeated runs).
    Onnx(crate::bench_onnx::OnnxBenchArgs),
}

/// Arguments of `rlx bench gemm`.
#[derive(clap::Args)]
pub struct GemmArgs {
    /// Shapes as `MxNxK` (default: 1024^3 and the MiniLM encoder's products).
    #[arg(long = "shape", value_name = "MxNxK")]
    shapes: Vec<String>,
    /// CPU threads (default: all of the runtime's).
    #[arg(long, default_value_t = 0, hide_default_value = true)]
    threads: usize,
    /// Timed runs per shape and round (each round's median is taken).
    #[arg(long, default_value_t = 20, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    runs: u32,
    /// Rounds over all the shapes, each after a peak measurement: a shape's result is
    /// its best round's median, as the peak is the best of its measurements (on a
    /// shared machine, a round can lose a core to another tenant).
    #[arg(long, default_value_t = 3, value_parser = clap::value_parser!(u32).range(1..=1000))]
    rounds: u32,
    /// Pack `B` ahead into the kernel's panel layout and time only the products, as a
    /// compiled graph runs a product whose `B` is a weight.
    #[arg(long)]
    packed: bool,
    /// Round the operands to bfloat16 and sum the products in `f32` on AMX tiles (as a
    /// program compiled with bf16 products allowed does; `f32` where the CPU has no
    /// AMX). Not with `--packed`.
    #[arg(long, conflicts_with = "packed")]
    bf16: bool,
    /// Cycle through copies of `B` that together exceed the last-level cache (64 MB), so
    /// every product reads `B` from memory, as a model whose weights do not fit in cache
    /// does.
    #[arg(long)]
    cold: bool,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

#[derive(Serialize)]
struct GemmRow {
    m: usize,
    n: usize,
    k: usize,
    /// The best round's median.
    median_ms: f64,
    /// Every round's median, in round order.
    round_medians_ms: Vec<f64>,
    gflops: f64,
    percent_of_peak: f64,
}

#[derive(Serialize)]
struct GemmReport {
    kernel: &'static str,
    /// Whether `B` was packed ahead (`--packed`).
    packed: bool,
    /// Whether each product read a `B` not in cache (`--cold`).
    cold: bool,
    threads: usize,
    runs: usize,
    rounds: usize,
    peak_gflops: f64,
    peak_gflops_one_thread: f64,
    results: Vec<GemmRow>,
}

/// Arguments of `rlx bench minilm`.
#[derive(clap::Args)]
pub struct MinilmArgs {
    /// Texts per forward pass.
    #[arg(long, default_value_t = 1, value_parser = clap::value_parser!(u32).range(1..=1024))]
    batch: u32,
    /// Tokens per text (at most the model's maximum length).
    #[arg(long, default_value_t = 128, value_parser = clap::value_parser!(u32).range(2..=512))]
    seq: u32,
    /// CPU threads (default: one per core, or $RLX_NUM_THREADS).
    #[arg(long, default_value_t = 0, hide_default_value = true)]
    threads: usize,
    /// Where the model runs: `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: rlx::Device,
    /// Timed runs (the median is reported).
    #[arg(long, default_value_t = 10, value_parser = clap::value_parser!(u32).range(1..=100_000))]
    runs: u32,
    /// Untimed runs first.
    #[arg(long, default_value_t = 2)]
    warmup: u32,
    /// The model (packaged name or directory).
    #[arg(long, default_value = "minilm")]
    model: String,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
    /// With --json, also list every timed run (`times_ms`, in run order).
    #[arg(long, requires = "json")]
    all_times: bool,
    /// Time every kernel and print where the time goes (after the other output).
    #[arg(long)]
    profile: bool,
    /// With --json, also include the first text's embedding (`embedding`).
    #[arg(long, requires = "json")]
    print_embedding: bool,
}

#[derive(Serialize)]
struct Report<'a> {
    model: &'a str,
    batch: usize,
    seq: usize,
    threads: usize,
    runs: usize,
    median_ms: f64,
    min_ms: f64,
    max_ms: f64,
    tokens_per_s: f64,
    compile_ms: f64,
    load_ms: f64,
    arena_bytes: usize,
    lower_bound_bytes: usize,
    kernels: usize,
    #[serde(skip_serializing_if = "Option::is_none")]
    times_ms: Option<Vec<f64>>,
    #[serde(skip_serializing_if = "Option::is_none")]
    embedding: Option<Vec<f32>>,
}

/// Runs the chosen benchmark.
pub fn run(args: &BenchArgs) -> anyhow::Result<()> {
    match &args.what {
        BenchTarget::Minilm(a) => minilm(a),
        BenchTarget::Gemm(a) => gemm(a),
        BenchTarget::Llm(a) => crate::bench_llm::run(a),
        BenchTarget::Onnx(a) => crate::bench_onnx::run(a),
    }
}

fn minilm(args: &MinilmArgs) -> anyhow::Result<()> {
    let (batch, seq) = (args.batch as usize, args.seq as usize);
    let started = Instant::now();
    let available = rlx::cpu_threads();
    if args.threads > available {
        anyhow::bail!(
            "--threads {} is more than the runtime's {available} threads (set RLX_NUM_THREADS to \
             change the pool size)",
            args.threads
        );
    }
    let threads = if args.threads == 0 {
        available
    } else {
        args.threads
    };
    let options = EmbedderOptions {
        store: Some(ModelStore::from_env()?.quiet(args.json)),
        threads,
        device: args.device,
        ..EmbedderOptions::default()
    };
    let embedder = Embedder::load_with(&args.model, options)
        .with_context(|| format!("loading model '{}'", args.model))?;
    let load_ms = ms(started);
    if seq > embedder.max_seq_length() {
        anyhow::bail!(
            "--seq {seq} is longer than the model's maximum of {} tokens",
            embedder.max_seq_length()
        );
    }
    let started = Instant::now();
    let mut encoder = embedder.compile(batch, seq)?;
    let compile_ms = ms(started);

    let ids = synthetic_ids(batch, seq, embedder.config().vocab_size);
    let types = vec![0i64; batch * seq];
    let mask = vec![1i64; batch * seq];
    let inputs = [
        ("input_ids", TensorRef::I64(&ids)),
        ("token_type_ids", TensorRef::I64(&types)),
        ("attention_mask", TensorRef::I64(&mask)),
    ];
    for _ in 0..args.warmup {
        encoder.run_typed(&inputs)?;
    }
    encoder.set_profiling(args.profile);
    let mut times = Vec::with_capacity(args.runs as usize);
    let mut first_embedding = None;
    for _ in 0..args.runs {
        let started = Instant::now();
        let out = encoder.run_typed(&inputs)?;
        times.push(ms(started));
        if first_embedding.is_none()
            && args.print_embedding
            && let Some(rlx::TensorData::F32(v)) = out.first()
        {
            first_embedding = Some(v[..embedder.dim().min(v.len())].to_vec());
        }
        std::hint::black_box(out);
    }
    let in_order = times.clone();
    times.sort_by(f64::total_cmp);
    let median = median_of_sorted(&times);
    let report = Report {
        model: embedder.name(),
        batch,
        seq,
        threads,
        runs: times.len(),
        median_ms: median,
        min_ms: times[0],
        max_ms: times[times.len() - 1],
        tokens_per_s: (batch * seq) as f64 / (median / 1e3),
        compile_ms,
        load_ms,
        arena_bytes: encoder.memory_stats().arena_bytes,
        lower_bound_bytes: encoder.memory_stats().lower_bound,
        kernels: encoder.kernels().len(),
        times_ms: args.all_times.then_some(in_order),
        embedding: first_embedding,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
    } else {
        print_minilm(&report, median, args.warmup);
    }
    if let Some(profile) = encoder.profile() {
        print_profile(&profile, false);
    }
    Ok(())
}

/// Prints per-kernel totals and the slowest launches, on stderr when `to_stderr`.
pub(crate) fn print_profile(profile: &rlx::driver::Profile, to_stderr: bool) {
    let say = |line: String| {
        if to_stderr {
            eprintln!("{line}");
        } else {
            println!("{line}");
        }
    };
    let runs = profile.runs.max(1) as f64;
    let total: f64 = profile
        .kernels
        .iter()
        .map(|k| k.total.as_secs_f64())
        .sum::<f64>()
        / runs
        * 1e3;
    let mut by_kernel: Vec<(String, f64, usize)> = Vec::new();
    for rlx::driver::KernelTime {
        kernel, total: t, ..
    } in &profile.kernels
    {
        let ms = t.as_secs_f64() / runs * 1e3;
        match by_kernel.iter_mut().find(|k| k.0 == *kernel) {
            Some(k) => {
                k.1 += ms;
                k.2 += 1;
            }
            None => by_kernel.push((kernel.clone(), ms, 1)),
        }
    }
    by_kernel.sort_by(|a, b| b.1.total_cmp(&a.1));
    say(format!("profile: {total:.3} ms per run in kernels"));
    for (kernel, ms, count) in by_kernel {
        say(format!(
            "  {kernel:<44} {ms:>8.3} ms {:>5.1}%  ({count} launches)",
            100.0 * ms / total.max(1e-9)
        ));
    }
    let mut launches: Vec<&rlx::driver::KernelTime> = profile.kernels.iter().collect();
    launches.sort_by_key(|k| std::cmp::Reverse(k.total));
    say("slowest launches (node ids as `rlx inspect` prints them):".to_string());
    for k in launches.iter().take(SLOWEST_LAUNCHES) {
        let ms = k.total.as_secs_f64() / runs * 1e3;
        say(format!(
            "  {:<8} {:<44} {ms:>8.3} ms",
            k.node.to_string(),
            k.kernel
        ));
    }
}

/// A profile as JSON: `[{"kernel", "ms" (per run), "percent", "launches"}]`, the
/// kernels' totals slowest first.
pub(crate) fn profile_json(profile: &rlx::driver::Profile) -> serde_json::Value {
    let runs = profile.runs.max(1) as f64;
    let mut by_kernel: Vec<(String, f64, usize)> = Vec::new();
    for k in &profile.kernels {
        let ms = k.total.as_secs_f64() / runs * 1e3;
        match by_kernel.iter_mut().find(|e| e.0 == k.kernel) {
            Some(e) => {
                e.1 += ms;
                e.2 += 1;
            }
            None => by_kernel.push((k.kernel.clone(), ms, 1)),
        }
    }
    by_kernel.sort_by(|a, b| b.1.total_cmp(&a.1));
    let total: f64 = by_kernel.iter().map(|k| k.1).sum::<f64>().max(1e-12);
    by_kernel
        .into_iter()
        .map(|(kernel, ms, launches)| {
            serde_json::json!({"kernel": kernel, "ms": ms, "percent": 100.0 * ms / total, "launches": launches})
        })
        .collect()
}

/// Every launch of a profile in run order as JSON: `[{"node", "kernel", "ms" (per
/// run)}]`, for comparing layer by layer against another runtime's profile.
pub(crate) fn launches_json(profile: &rlx::driver::Profile) -> serde_json::Value {
    let runs = profile.runs.max(1) as f64;
    profile
        .kernels
        .iter()
        .map(|k| {
            serde_json::json!({"node": k.node.to_string(), "kernel": k.kernel, "ms": k.total.as_secs_f64() / runs * 1e3})
        })
        .collect()
}

/// How many single launches the profile lists after the per-kernel totals.
const SLOWEST_LAUNCHES: usize = 40;

fn print_minilm(report: &Report, median: f64, warmup: u32) {
    {
        println!(
            "{} encoder, batch {} x {} tokens, {} thread(s)",
            report.model, report.batch, report.seq, report.threads
        );
        println!(
            "  latency  median {:.2} ms  (min {:.2}, max {:.2}, {} runs after {} warm-up)",
            median, report.min_ms, report.max_ms, report.runs, warmup
        );
        println!("  throughput  {:.0} tokens/s", report.tokens_per_s);
        println!(
            "  compile  {:.1} ms   load  {:.0} ms",
            report.compile_ms, report.load_ms
        );
        println!(
            "  arena  {} bytes ({:.2}x the lower bound {}), {} kernels",
            report.arena_bytes,
            report.arena_bytes as f64 / report.lower_bound_bytes.max(1) as f64,
            report.lower_bound_bytes,
            report.kernels
        );
    }
}

fn parse_shape(text: &str) -> anyhow::Result<(usize, usize, usize)> {
    let parts: Vec<&str> = text.split(['x', 'X']).collect();
    let bad = || {
        anyhow::anyhow!(
            "--shape '{text}': expected MxNxK with positive integers, e.g. 128x384x1536"
        )
    };
    if parts.len() != 3 {
        return Err(bad());
    }
    let mut dims = [0usize; 3];
    for (d, p) in dims.iter_mut().zip(&parts) {
        *d = p.trim().parse().map_err(|_| bad())?;
        if *d == 0 || *d > 1 << 16 {
            return Err(bad());
        }
    }
    Ok((dims[0], dims[1], dims[2]))
}

/// Bytes of `B` copies `bench gemm --cold` cycles through: more than any last-level
/// cache of the machines it runs on.
const COLD_BYTES: usize = 64 << 20;

fn gemm(args: &GemmArgs) -> anyhow::Result<()> {
    let available = rlx::cpu_threads();
    if args.threads > available {
        anyhow::bail!(
            "--threads {} is more than the runtime's {available} threads",
            args.threads
        );
    }
    let threads = if args.threads == 0 {
        available
    } else {
        args.threads
    };
    let shapes = if args.shapes.is_empty() {
        vec![
            (1024, 1024, 1024),
            (128, 384, 384),
            (128, 1536, 384),
            (128, 384, 1536),
            (16, 384, 384),
            (4096, 384, 384),
            (4096, 1536, 384),
            (4096, 384, 1536),
        ]
    } else {
        args.shapes
            .iter()
            .map(|s| parse_shape(s))
            .collect::<anyhow::Result<_>>()?
    };
    // The peak is the best of several short measurements, before and after the
    // products: on a shared machine a single one can catch another tenant's burst.
    let measure_peak = |t: usize| {
        (0..3)
            .map(|_| rlx::cpu::peak_fma_gflops(t, 150))
            .fold(0.0, f64::max)
    };
    let peak_one = measure_peak(1);
    let mut peak = 0.0f64;
    let operands: Vec<(Vec<f32>, Vec<f32>)> = shapes
        .iter()
        .map(|&(m, n, k)| {
            let a = (0..m * k)
                .map(|i| ((i % 97) as f32 - 48.0) / 97.0)
                .collect();
            let b = (0..k * n)
                .map(|i| ((i % 89) as f32 - 44.0) / 89.0)
                .collect();
            (a, b)
        })
        .collect();
    let mut round_medians = vec![Vec::new(); shapes.len()];
    for _ in 0..args.rounds {
        peak = peak.max(measure_peak(threads));
        for (s, (&(m, n, k), (a, b))) in shapes.iter().zip(&operands).enumerate() {
            let mut c = vec![0.0f32; m * n];
            // Enough copies of B that the ones a product does not use push it out of
            // cache before its next turn.
            let copies = if args.cold {
                (COLD_BYTES / (4 * k * n)).max(2)
            } else {
                1
            };
            let packed = if args.packed {
                (0..copies)
                    .map(|_| rlx::cpu::PackedMatrix::new(b, k, n))
                    .collect::<Result<Vec<_>, _>>()?
            } else {
                Vec::new()
            };
            let plain: Vec<Vec<f32>> = if args.packed {
                Vec::new()
            } else {
                (0..copies).map(|_| b.clone()).collect()
            };
            let product = |c: &mut [f32], copy: usize| {
                if args.packed {
                    rlx::cpu::matmul_f32_packed(a, &packed[copy], c, m, threads)
                } else if args.bf16 {
                    rlx::cpu::matmul_bf16_products(a, &plain[copy], c, (m, n, k), threads)
                } else {
                    rlx::cpu::matmul_f32(a, &plain[copy], c, (m, n, k), threads)
                }
            };
            product(&mut c, 0)?;
            let mut times = Vec::with_capacity(args.runs as usize);
            for run in 0..args.runs as usize {
                let copy = (run + 1) % copies;
                let started = Instant::now();
                product(&mut c, copy)?;
                times.push(ms(started));
            }
            std::hint::black_box(&c);
            times.sort_by(f64::total_cmp);
            round_medians[s].push(median_of_sorted(&times));
        }
    }
    peak = peak.max(measure_peak(threads));
    let results = shapes
        .iter()
        .zip(round_medians)
        .map(|(&(m, n, k), medians)| {
            let best = medians.iter().copied().fold(f64::INFINITY, f64::min);
            let gflops = 2.0 * (m * n * k) as f64 / (best / 1e3) / 1e9;
            GemmRow {
                m,
                n,
                k,
                median_ms: best,
                round_medians_ms: medians,
                gflops,
                percent_of_peak: 100.0 * gflops / peak,
            }
        })
        .collect();
    let report = GemmReport {
        kernel: if args.bf16 && rlx::cpu::has_amx() {
            "amx-bf16"
        } else {
            rlx::cpu::gemm_kernel_name()
        },
        packed: args.packed,
        cold: args.cold,
        threads,
        runs: args.runs as usize,
        rounds: args.rounds as usize,
        peak_gflops: peak,
        peak_gflops_one_thread: peak_one,
        results,
    };
    if args.json {
        println!("{}", serde_json::to_string(&report)?);
        return Ok(());
    }
    println!(
        "f32 GEMM, {} kernel, {}{threads} thread(s); measured FMA peak {:.1} GFLOP/s ({:.1} on one thread)",
        report.kernel,
        match (report.packed, report.cold) {
            (true, true) => "B packed ahead and read from memory, ",
            (true, false) => "B packed ahead, ",
            (false, true) => "B read from memory, ",
            (false, false) => "",
        },
        peak,
        peak_one
    );
    println!(
        "median of {} runs, best of {} rounds",
        report.runs, report.rounds
    );
    println!(
        "{:>18} {:>10} {:>10} {:>8}",
        "m x n x k", "median", "GFLOP/s", "of peak"
    );
    for r in &report.results {
        println!(
            "{:>18} {:>7.3} ms {:>10.1} {:>7.1}%",
            format!("{}x{}x{}", r.m, r.n, r.k),
            r.median_ms,
            r.gflops,
            r.percent_of_peak
        );
    }
    Ok(())
}

/// Deterministic token ids: `[CLS]`-like first, `[SEP]`-like last, the rest spread
/// over the vocabulary.
fn synthetic_ids(batch: usize, seq: usize, vocab: usize) -> Vec<i64> {
    let mut state = 0x2545_f491_4f6c_dd1du64;
    let mut ids = Vec::with_capacity(batch * seq);
    for _ in 0..batch {
        for k in 0..seq {
            state = state
                .wrapping_mul(6_364_136_223_846_793_005)
                .wrapping_add(1_442_695_040_888_963_407);
            let id = match k {
                0 => 101.min(vocab - 1),
                k if k == seq - 1 => 102.min(vocab - 1),
                _ => {
                    ((state >> 33) as usize % vocab.saturating_sub(1000).max(1))
                        + 999.min(vocab - 1)
                }
            };
            ids.push(id as i64);
        }
    }
    ids
}

fn median_of_sorted(times: &[f64]) -> f64 {
    let n = times.len();
    if n % 2 == 1 {
        times[n / 2]
    } else {
        (times[n / 2 - 1] + times[n / 2]) / 2.0
    }
}

fn ms(since: Instant) -> f64 {
    since.elapsed().as_secs_f64() * 1e3
}
