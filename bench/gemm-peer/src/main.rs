//! RLX's f32 GEMM against the `gemm` crate: same shapes, same thread count, rounds
//! alternating between the two, medians over all rounds, and the FMA peak measured
//! in the same run. Prints a Markdown table.

use std::time::Instant;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 { v[n / 2] } else { (v[n / 2 - 1] + v[n / 2]) / 2.0 }
}

fn time_rlx(a: &[f32], b: &[f32], c: &mut [f32], (m, n, k): (usize, usize, usize), threads: usize, runs: usize) -> Vec<f64> {
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            if let Err(e) = rlx_cpu::matmul_f32(a, b, c, (m, n, k), threads) {
                eprintln!("rlx matmul failed: {e}");
                std::process::exit(1);
            }
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect()
}

fn time_gemm_crate(a: &[f32], b: &[f32], c: &mut [f32], (m, n, k): (usize, usize, usize), threads: usize, runs: usize) -> Vec<f64> {
    let parallelism = if threads > 1 { gemm::Parallelism::Rayon(threads) } else { gemm::Parallelism::None };
    (0..runs)
        .map(|_| {
            let t = Instant::now();
            // SAFETY: row-major m x k, k x n and m x n buffers of exactly those sizes.
            unsafe {
                gemm::gemm(
                    m, n, k,
                    c.as_mut_ptr(), 1, n as isize,
                    false,
                    a.as_ptr(), 1, k as isize,
                    b.as_ptr(), 1, n as isize,
                    0.0, 1.0,
                    false, false, false,
                    parallelism,
                );
            }
            t.elapsed().as_secs_f64() * 1e3
        })
        .collect()
}

fn main() {
    let threads: usize = std::env::var("THREADS").ok().and_then(|t| t.parse().ok()).unwrap_or(2);
    let rounds = 5;
    let peak = (0..3).map(|_| rlx_cpu::peak_fma_gflops(threads, 300)).fold(0.0, f64::max);
    println!("f32 GEMM, {threads} threads, RLX kernel {}, measured FMA peak {peak:.0} GFLOP/s", rlx_cpu::gemm_kernel_name());
    println!();
    println!("| m x n x k | RLX | gemm crate | RLX / gemm time | RLX % of peak | gemm % of peak |");
    println!("|---|---|---|---|---|---|");
    for &(m, n, k) in &[(1024, 1024, 1024), (128, 384, 384), (128, 1536, 384), (128, 384, 1536), (16, 384, 384), (4096, 384, 384), (4096, 1536, 384), (4096, 384, 1536)] {
        let a: Vec<f32> = (0..m * k).map(|i| ((i % 97) as f32 - 48.0) / 97.0).collect();
        let b: Vec<f32> = (0..k * n).map(|i| ((i % 89) as f32 - 44.0) / 89.0).collect();
        let mut c1 = vec![0.0f32; m * n];
        let mut c2 = vec![0.0f32; m * n];
        let runs = if m * n * k > 1 << 30 { 10 } else { 40 };
        let (mut r, mut g) = (Vec::new(), Vec::new());
        time_rlx(&a, &b, &mut c1, (m, n, k), threads, 3);
        time_gemm_crate(&a, &b, &mut c2, (m, n, k), threads, 3);
        for _ in 0..rounds {
            r.extend(time_rlx(&a, &b, &mut c1, (m, n, k), threads, runs));
            g.extend(time_gemm_crate(&a, &b, &mut c2, (m, n, k), threads, runs));
        }
        let max_diff = c1.iter().zip(&c2).map(|(x, y)| (x - y).abs()).fold(0.0f32, f32::max);
        assert!(max_diff <= 1e-3 * (k as f32).sqrt(), "results differ by {max_diff}");
        let (rm, gm) = (median(r), median(g));
        let gf = |ms: f64| 2.0 * (m * n * k) as f64 / (ms / 1e3) / 1e9;
        println!(
            "| {m}x{n}x{k} | {rm:.3} ms ({:.0} GFLOP/s) | {gm:.3} ms ({:.0} GFLOP/s) | {:.2} | {:.0}% | {:.0}% |",
            gf(rm), gf(gm), rm / gm, 100.0 * gf(rm) / peak, 100.0 * gf(gm) / peak
        );
    }
}
