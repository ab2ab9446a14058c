//! Builds a small model in code, compiles it once for the CPU and runs it many times:
//! a two-layer MLP classifier with a KV-style persistent handle that counts runs.
//!
//! Run with `cargo run --release -p rlx --example quickstart`.

use rlx::prelude::*;

fn main() -> Result<()> {
    // Build: x [2, 4] -> matmul + bias -> gelu -> matmul -> softmax.
    let g = Graph::new("quickstart");
    let x = g.input("x", Shape::new(&[2, 4], DType::F32))?;
    let w1 = g.param("w1", Shape::new(&[4, 3], DType::F32))?;
    let b1 = g.param("b1", Shape::new(&[3], DType::F32))?;
    let w2 = g.param("w2", Shape::new(&[3, 2], DType::F32))?;
    let h = g.gelu(g.add(g.matmul(x, w1)?, b1)?)?;
    let probs = g.softmax(g.matmul(h, w2)?, -1)?;
    g.set_outputs(vec![h, probs]);
    println!("{g}\n");

    // Compile once.
    let start = std::time::Instant::now();
    let mut model = Session::new(Device::Cpu).compile(&g)?;
    println!(
        "compiled in {:.2?}: {}",
        start.elapsed(),
        model.memory_stats()
    );
    model.set_param("w1", &[1., 0., 0., 0., 1., 0., 0., 0., 1., 0., 0., 0.])?;
    model.set_param("b1", &[0.1, 0.2, 0.3])?;
    model.set_param("w2", &[1., -1., 0.5, 0.5, -1., 1.])?;

    // Run many times.
    let out = model.run(&[("x", &[1.4, -0.7, -0.3, 5.0, 0.0, 0.0, 0.0, 1.0])])?;
    println!(
        "hidden (gelu of 1.5, -0.5, 0.0 | gelu of bias): {:?}",
        out[0]
    );
    println!("probabilities: {:?}", out[1]);
    let runs = 1000;
    let start = std::time::Instant::now();
    let input = [0.5f32; 8];
    for _ in 0..runs {
        let outputs = model.run_slots(&[&input])?;
        std::hint::black_box(outputs.get(1)?);
    }
    println!("{runs} allocation-free runs in {:.2?}", start.elapsed());

    // Errors are values, not panics.
    match model.run(&[("x", &[1.0; 3])]) {
        Err(e) => println!("rejected as expected: {e}"),
        Ok(_) => eprintln!("a wrong length should have been rejected"),
    }
    Ok(())
}
