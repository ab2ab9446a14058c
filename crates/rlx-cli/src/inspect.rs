//! `rlx inspect`: shows what the compiler made of a graph.

use crate::examples::Example;
use anyhow::Context;
use rlx::prelude::*;

/// Arguments of `rlx inspect`.
#[derive(clap::Args)]
pub struct InspectArgs {
    /// Which built-in graph to inspect.
    #[arg(long, value_enum, default_value_t = Example::Mlp)]
    example: Example,
    /// Device to compile for.
    #[arg(long, default_value = "cpu")]
    device: String,
    /// Plan memory without sharing bytes between values (for comparison).
    #[arg(long)]
    no_reuse: bool,
    /// Compile the graph as built: no folding, CSE or fusion (for comparison).
    #[arg(long)]
    no_optimize: bool,
}

/// Builds the example, compiles it and prints graph, memory plan and kernels.
pub fn run(args: &InspectArgs) -> anyhow::Result<()> {
    let device: Device = args.device.parse()?;
    let graph = args.example.build().context("building the example graph")?;
    let options = CompileOptions::new()
        .memory_reuse(!args.no_reuse)
        .optimize(!args.no_optimize);
    let compiled = Session::new(device)
        .compile_with(&graph, &options)
        .context("compiling")?;
    println!("{graph}");
    println!();
    let plan = compiled.plan();
    if plan.fusions.is_empty() {
        println!("fusions: none");
    } else {
        println!("fusions ({}):", plan.fusions.len());
        let nodes = plan.graph.nodes();
        for f in &plan.fusions {
            let node = &nodes[f.node.index()];
            let attrs = rlx::ir::op_attributes(&node.op);
            println!(
                "  %{:<4} {} [{attrs}] <- {}",
                f.node.index(),
                node.op.name(),
                f.replaced.join(", ")
            );
        }
    }
    println!();
    if plan.graph.len() != graph.len() || !plan.fusions.is_empty() {
        println!("after passes: {}", plan.graph);
    }
    let stats = compiled.memory_stats();
    println!("memory plan ({device}):");
    println!("  arena            {:>10} bytes", stats.arena_bytes);
    println!(
        "  transient total  {:>10} bytes (no reuse)",
        stats.transient_bytes
    );
    println!(
        "  lower bound      {:>10} bytes (peak live)",
        stats.lower_bound
    );
    println!("  views            {:>10}", stats.views);
    println!("  in place         {:>10}", stats.in_place);
    println!();
    println!("kernels ({} launches):", compiled.kernels().len());
    let nodes = plan.graph.nodes();
    for (node, kernel) in compiled.kernels() {
        let n = &nodes[node.index()];
        let loc = plan.locations[node.index()];
        let note = if plan.is_in_place[node.index()] {
            " (in place)"
        } else {
            ""
        };
        println!(
            "  {node:<5} {:<14} -> {kernel:<28} {} at {:?}+{}{note}",
            n.op.name(),
            n.shape,
            loc.region,
            loc.offset
        );
    }
    let views: Vec<String> = (0..nodes.len())
        .filter(|&i| plan.is_view[i])
        .map(|i| format!("%{i} ({})", nodes[i].op.name()))
        .collect();
    if !views.is_empty() {
        println!("views (no kernel): {}", views.join(", "));
    }
    Ok(())
}
