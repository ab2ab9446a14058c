//! Quick GEMM throughput probe: `cargo run --release -p rlx-cpu --example gemm_probe`.
fn main() {
    let peak1 = rlx_cpu::peak_fma_gflops(1, 300);
    let peak2 = rlx_cpu::peak_fma_gflops(2, 300);
    println!(
        "kernel {} peak 1T {peak1:.1} 2T {peak2:.1} GFLOP/s",
        rlx_cpu::gemm_kernel_name()
    );
    for &(m, n, k) in &[
        (1024, 1024, 1024),
        (128, 384, 384),
        (128, 1536, 384),
        (128, 384, 1536),
        (16, 384, 384),
        (4096, 1536, 384),
    ] {
        let a = vec![0.5f32; m * k];
        let b = vec![0.25f32; k * n];
        let mut c = vec![0.0f32; m * n];
        for threads in [1, 2] {
            let mut times = Vec::new();
            for _ in 0..9 {
                let t = std::time::Instant::now();
                rlx_cpu::matmul_f32(&a, &b, &mut c, (m, n, k), threads).unwrap();
                times.push(t.elapsed().as_secs_f64());
            }
            times.sort_by(f64::total_cmp);
            let gf = 2.0 * (m * n * k) as f64 / times[4] / 1e9;
            println!(
                "{m}x{n}x{k} threads {threads}: {:.3} ms {gf:.1} GFLOP/s",
                times[4] * 1e3
            );
        }
    }
}
