//! Times single convolution layers of the shapes in the CRNN benchmark model (batch
//! 32) on the CPU and prints each one's rate: the convolution kernel's own time (from
//! the profile, so input staging is not counted), best of the runs.
//!
//! ```sh
//! cargo run --release -p rlx --example conv_layers -- [THREADS] [RUNS] [LAYER]
//! ```

use rlx::prelude::*;

/// `(in channels, out channels, height, width, kernel, stride)`, padding `kernel / 2`.
const LAYERS: [(usize, usize, usize, usize, usize, usize); 10] = [
    (64, 64, 15, 40, 3, 1),
    (64, 256, 15, 40, 1, 1),
    (64, 64, 15, 40, 1, 1),
    (3, 64, 60, 160, 7, 2),
    (128, 128, 15, 40, 3, 2),
    (128, 128, 8, 20, 3, 1),
    (128, 512, 8, 20, 1, 1),
    (256, 512, 15, 40, 1, 2),
    (256, 128, 15, 40, 1, 1),
    (512, 128, 8, 20, 1, 1),
];

const BATCH: usize = 32;

fn main() -> rlx::Result<()> {
    let mut args = std::env::args().skip(1);
    let threads: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(2);
    let runs: usize = args.next().and_then(|a| a.parse().ok()).unwrap_or(20);
    // One layer alone (its index in `LAYERS`), for a profiler.
    let only: Option<usize> = args.next().and_then(|a| a.parse().ok());
    println!("conv layers at batch {BATCH}, {threads} thread(s), best of {runs} runs");
    for (index, &(c, o, h, w, k, s)) in LAYERS.iter().enumerate() {
        if only.is_some_and(|i| i != index) {
            continue;
        }
        let g = Graph::new("conv");
        let x = g.input("x", Shape::new(&[BATCH, c, h, w], DType::F32))?;
        let wt = g.param("w", Shape::new(&[o, c, k, k], DType::F32))?;
        let y = g.conv2d(x, wt, None, [s, s], [k / 2; 4], [1, 1], 1)?;
        g.set_outputs(vec![y]);
        let options = CompileOptions::new().threads(threads);
        let mut compiled = Session::new(Device::Cpu).compile_with(&g, &options)?;
        let weights: Vec<f32> = (0..o * c * k * k).map(|i| (i % 7) as f32 * 0.01).collect();
        compiled.set_param("w", &weights)?;
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
            "{c:>4} -> {o:<4} {h:>3}x{w:<4} {k}x{k} stride {s}: {:8.3} ms {:7.1} GFLOP/s",
            best * 1e3,
            flops / best / 1e9
        );
    }
    Ok(())
}
