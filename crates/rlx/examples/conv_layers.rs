//! Times single convolution layers of the shapes in the CRNN benchmark model (batch
//! 32) on the CPU and prints each one's rate: the convolution kernel's own time (from
//! the profile, so input staging is not counted), best of the runs.
//!
//! ```sh
//! cargo run --release -p rlx --example conv_layers -- [THREADS] [RUNS] [LAYER]
//! ```

use rlx::prelude::*;

/// `(in channels, out channels, height, width, kernel, stride, prologue)`, padding
/// `kernel / 2`; with `prologue`, the input goes through a per-channel scale, shift and
/// ReLU first (a batch norm before the convolution, fused into it as it packs).
type Layer = (usize, usize, usize, usize, usize, usize, bool);

const LAYERS: [Layer; 12] = [
    (64, 64, 15, 40, 3, 1, false),
    (64, 256, 15, 40, 1, 1, false),
    (64, 64, 15, 40, 1, 1, false),
    (3, 64, 60, 160, 7, 2, false),
    (128, 128, 15, 40, 3, 2, false),
    (128, 128, 8, 20, 3, 1, false),
    (128, 512, 8, 20, 1, 1, false),
    (256, 512, 15, 40, 1, 2, false),
    (256, 128, 15, 40, 1, 1, false),
    (512, 128, 8, 20, 1, 1, false),
    (256, 64, 15, 40, 1, 1, true),
    (512, 128, 8, 20, 1, 1, true),
];

const BATCH: usize = 32;

fn main() -> rlx::Result<()> {
    let mut args = std::env::args().skip(1);
    let threads: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2);
    let runs: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(20);
    // One layer alone (its index in `LAYERS`), for a profiler.
    let only: Option<usize> = args.next().and_then(|a| a.parse().ok());
    println!("conv layers at batch {BATCH}, {threads} thread(s), best of {runs} runs");
    for (index, &(c, o, h, w, k, s, prologue)) in LAYERS.iter().enumerate() {
        if only.is_some_and(|i| i != index) {
            continue;
        }
        let g = Graph::new("conv");
        let mut x = g.input("x", Shape::new(&[BATCH, c, h, w], DType::F32))?;
        let channel = Shape::new(&[1, c, 1, 1], DType::F32);
        if prologue {
            let scale = g.param("scale", channel.clone())?;
            let shift = g.param("shift", channel.clone())?;
            x = g.relu(g.add(g.mul(x, scale)?, shift)?)?;
        }
        let wt = g.param("w", Shape::new(&[o, c, k, k], DType::F32))?;
        let y = g.conv2d(x, wt, None, [s, s], [k / 2; 4], [1, 1], 1)?;
        g.set_outputs(vec![y]);
        let options = CompileOptions::new().threads(threads);
        let mut compiled = Session::new(Device::Cpu).compile_with(&g, &options)?;
        let weights: Vec<f32> = (0..o * c * k * k).map(|i| (i % 7) as f32 * 0.01).collect();
        compiled.set_param("w", &weights)?;
        if prologue {
            let scale: Vec<f32> = (0..c).map(|i| 0.5 + (i % 5) as f32 * 0.1).collect();
            let shift: Vec<f32> = (0..c).map(|i| (i % 3) as f32 * 0.1 - 0.1).collect();
            compiled.set_param("scale", &scale)?;
            compiled.set_param("shift", &shift)?;
        }
        let input: Vec<f32> = (0..BATCH * c * h * w)
            .map(|i| (i % 11) as f32 * 0.1)
            .collect();
        let out_dims = g.shape(y)?.dims().to_vec();
        let flops = 2.0 * (out_dims.iter().product::<usize>() * c * k * k) as f64;
        compiled.run(&[("x", &input)])?;
        let mut best = f64::MAX;
        for _ in 0..runs {
            // Restarting the profile keeps one run's times.
            compiled.set_profiling(false);
            compiled.set_profiling(true);
            compiled.run(&[("x", &input)])?;
            if let Some(profile) = compiled.profile() {
                let seconds: f64 = profile
                    .kernels
                    .iter()
                    .filter(|t| t.kernel.contains("conv2d"))
                    .map(|t| t.total.as_secs_f64())
                    .sum();
                best = best.min(seconds);
            }
        }
        println!(
            "{c:>4} -> {o:<4} {h:>3}x{w:<4} {k}x{k} stride {s}{}: {:8.3} ms {:7.1} GFLOP/s",
            if prologue { " (bn+relu first)" } else { "" },
            best * 1e3,
            flops / best / 1e9
        );
    }
    Ok(())
}
