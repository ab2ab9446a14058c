//! `CompileOptions::allow_bf16`: f32 products whose operands are rounded to bfloat16
//! and summed in f32 (on AMX tiles where the CPU has them; exactly f32 elsewhere).

use rlx::prelude::*;

/// `x` rounded to the nearest bfloat16 (ties to even), as a float.
fn bf16(x: f32) -> f64 {
    let bits = x.to_bits();
    let rounded = bits.wrapping_add(0x7fff + (bits >> 16 & 1)) & 0xffff_0000;
    f64::from(f32::from_bits(rounded))
}

fn values(len: usize, seed: u64) -> Vec<f32> {
    let mut s = seed;
    (0..len)
        .map(|_| {
            s = s
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((s >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

/// `relu(x · w + b)` and `xᵀ · y` (the transposed product a weight gradient takes),
/// with `w` a param (which f32 programs pack ahead) and the rest inputs.
fn products(m: usize, k: usize, n: usize) -> Result<Graph> {
    let g = Graph::new("products");
    let x = g.input("x", Shape::new(&[m, k], DType::F32))?;
    let y = g.input("y", Shape::new(&[m, n], DType::F32))?;
    let w = g.param("w", Shape::new(&[k, n], DType::F32))?;
    let b = g.param("b", Shape::new(&[n], DType::F32))?;
    let dense = g.relu(g.add(g.matmul(x, w)?, b)?)?;
    let gram = g.matmul(g.permute(x, &[1, 0])?, y)?;
    g.set_outputs(vec![dense, gram]);
    Ok(g)
}

#[test]
fn bf16_products_round_their_operands_and_sum_in_f32() -> Result<()> {
    let (m, k, n) = (70, 300, 45);
    let (x, y, w, b) = (
        values(m * k, 1),
        values(m * n, 2),
        values(k * n, 3),
        values(n, 4),
    );
    let g = products(m, k, n)?;
    let session = Session::new(Device::Cpu);
    let run = |options: CompileOptions| -> Result<(Vec<Vec<f32>>, Vec<String>)> {
        let mut model = session.compile_with(&g, &options)?;
        model.set_param("w", &w)?;
        model.set_param("b", &b)?;
        let out = model.run(&[("x", &x), ("y", &y)])?;
        Ok((out, model.kernels().into_iter().map(|(_, k)| k).collect()))
    };
    let (exact, exact_kernels) = run(CompileOptions::new())?;
    let (rounded, rounded_kernels) = run(CompileOptions::new().allow_bf16(true))?;
    assert!(
        exact_kernels.iter().all(|k| !k.contains("amx")),
        "{exact_kernels:?}"
    );

    // References in f64: the sums of the bfloat16-rounded terms, and of the terms'
    // sizes (the scale of the f32 summation's rounding).
    let dense = |i: usize, j: usize, round: &dyn Fn(f32) -> f64| {
        let (mut sum, mut size) = (0.0, 0.0);
        for p in 0..k {
            let t = round(x[i * k + p]) * round(w[p * n + j]);
            (sum, size) = (sum + t, size + t.abs());
        }
        ((sum + f64::from(b[j])).max(0.0), size)
    };
    let gram = |i: usize, j: usize, round: &dyn Fn(f32) -> f64| {
        let (mut sum, mut size) = (0.0, 0.0);
        for r in 0..m {
            let t = round(x[r * k + i]) * round(y[r * n + j]);
            (sum, size) = (sum + t, size + t.abs());
        }
        (sum, size)
    };
    let amx = rlx::cpu::has_amx();
    let mut largest_change = 0.0f64;
    for (out, rows, cols, reference, depth) in [
        (
            0,
            m,
            n,
            &dense as &dyn Fn(usize, usize, &dyn Fn(f32) -> f64) -> (f64, f64),
            k,
        ),
        (1, k, n, &gram, m),
    ] {
        for i in 0..rows {
            for j in 0..cols {
                let at = i * cols + j;
                let (want, size) = reference(i, j, &|v| f64::from(v));
                let exact_value = f64::from(exact[out][at]);
                let tol = (depth as f64 + 2.0) * 1.2e-7 * (size + 1e-3);
                assert!(
                    (exact_value - want).abs() <= tol,
                    "f32 output {out} ({i}, {j})"
                );
                let got = f64::from(rounded[out][at]);
                if amx {
                    let (want, size) = reference(i, j, &bf16);
                    let tol = (depth as f64 + 2.0) * 1.2e-7 * (size + 1e-3);
                    assert!(
                        (got - want).abs() <= tol,
                        "bf16 output {out} ({i}, {j}): {got} vs {want}"
                    );
                } else {
                    assert_eq!(got, exact_value, "without AMX the option changes nothing");
                }
                largest_change = largest_change.max((got - exact_value).abs());
            }
        }
    }
    if amx {
        // The rounding shows (the products did run in bfloat16), and is named.
        assert!(largest_change > 1e-4, "largest change {largest_change}");
        let on_tiles = rounded_kernels.iter().filter(|k| k.contains("amx-bf16"));
        assert_eq!(on_tiles.count(), 2, "{rounded_kernels:?}");
    } else {
        eprintln!("no AMX here: checked that allow_bf16 leaves f32 products exact");
    }
    Ok(())
}
