//! Times the fused attention op alone at MiniLM's shape (12 heads of 32, an additive
//! mask per batch row) on the CPU: the kernel's own time from the profile, median and
//! best of the runs.
//!
//! ```sh
//! cargo run --release -p rlx --example attention -- [THREADS] [RUNS] [BATCH] [SEQ]
//! ```

use rlx::prelude::*;

const HEADS: usize = 12;
const HEAD_DIM: usize = 32;

fn main() -> rlx::Result<()> {
    let mut args = std::env::args().skip(1);
    let mut next =
        |default: usize| -> usize { args.next().and_then(|a| a.parse().ok()).unwrap_or(default) };
    let (threads, runs, batch, seq) = (next(2), next(50), next(8), next(128));
    let g = Graph::new("attention");
    let dims = [batch, seq, HEADS, HEAD_DIM];
    let q = g.input("q", Shape::new(&dims, DType::F32))?;
    let k = g.input("k", Shape::new(&dims, DType::F32))?;
    let v = g.input("v", Shape::new(&dims, DType::F32))?;
    let mask = g.input("mask", Shape::new(&[batch, 1, seq, seq], DType::F32))?;
    let y = g.attention_seq_major(q, k, v, Some(mask), false, None)?;
    g.set_outputs(vec![y]);
    let options = CompileOptions::new().threads(threads);
    let mut compiled = Session::new(Device::Cpu).compile_with(&g, &options)?;
    let len = dims.iter().product::<usize>();
    let data = |seed: usize| -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7919 + seed * 104729) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    };
    let (qd, kd, vd) = (data(1), data(2), data(3));
    // The last eighth of each row's keys is padding, as in a batch of unequal lengths.
    let md: Vec<f32> = (0..batch * seq * seq)
        .map(|i| if i % seq >= seq - seq / 8 { -1e9 } else { 0.0 })
        .collect();
    let inputs = [("q", &qd[..]), ("k", &kd), ("v", &vd), ("mask", &md)];
    compiled.run(&inputs)?;
    let mut times = Vec::with_capacity(runs);
    for _ in 0..runs {
        compiled.set_profiling(false);
        compiled.set_profiling(true);
        compiled.run(&inputs)?;
        if let Some(profile) = compiled.profile() {
            let seconds: f64 = profile
                .kernels
                .iter()
                .filter(|t| t.kernel.contains("attention"))
                .map(|t| t.total.as_secs_f64())
                .sum();
            times.push(seconds * 1e3);
        }
    }
    times.sort_by(f64::total_cmp);
    let flops = 4.0 * (batch * HEADS * seq * seq * HEAD_DIM) as f64;
    let median = times[times.len() / 2];
    println!(
        "attention {batch} x {seq} x {HEADS} heads of {HEAD_DIM}, {threads} thread(s): median {median:.3} ms, best {:.3} ms ({:.1} GFLOP/s at the best)",
        times[0],
        flops / times[0] / 1e6
    );
    Ok(())
}
