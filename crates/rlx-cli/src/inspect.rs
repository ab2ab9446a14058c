//! `rlx inspect`: shows what the compiler made of a graph.

use crate::examples::Example;
use anyhow::Context;
use rlx::prelude::*;

/// Arguments of `rlx inspect`.
#[derive(clap::Args)]
pub struct InspectArgs {
    /// An `.onnx` file to import and inspect instead of a built-in example.
    model: Option<std::path::PathBuf>,
    /// With a model: a symbolic dim as `SYM=N` (repeatable).
    #[arg(long = "shape", value_name = "SYM=N")]
    shapes: Vec<String>,
    /// With a model: an input as `NAME=FILE.npy` (gives its dims, and its value to
    /// converters that need one).
    #[arg(long = "input", value_name = "NAME=FILE.npy")]
    inputs: Vec<String>,
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
    /// Print only the graph after this pipeline stage: `import` or `specialize` (as
    /// built, or imported with its symbolic dims bound by `--shape`/`--input`) or one of the compiler's stages (decompose, fold, cse, dce, fuse.attention,
    /// fuse.attention_layout, fuse.activations, fuse.hoist, fuse.epilogue, fuse.share, fuse.regions, dce.fused).
    /// `RLX_DUMP_AFTER=STAGE` prints the same to stderr during any compile.
    #[arg(long, value_name = "STAGE")]
    after: Option<String>,
}

/// Builds the example, compiles it and prints graph, memory plan and kernels.
pub fn run(args: &InspectArgs) -> anyhow::Result<()> {
    let device: Device = args.device.parse()?;
    let graph = match &args.model {
        Some(path) => {
            let model = rlx::onnx::OnnxModel::load(path)?;
            let mut options = rlx::onnx::ImportOptions::new();
            options.symbols = crate::run_onnx::parse_shapes(&args.shapes)?;
            for (name, t) in crate::run_onnx::read_inputs(&args.inputs)? {
                options = options.input_value(name, t);
            }
            let imported = model.import(&options)?;
            println!(
                "{}: opset {}, {} nodes after import, {} params",
                path.display(),
                model.opset(),
                imported.graph.len(),
                imported.params.len()
            );
            imported.graph
        }
        None => args.example.build().context("building the example graph")?,
    };
    if let Some(stage) = &args.after {
        if stage == "import" || stage == "specialize" {
            println!("{graph}");
            return Ok(());
        }
        let plan_options = rlx::opt::PlanOptions {
            simplify: !args.no_optimize,
            fusion: if args.no_optimize {
                rlx::opt::FusionOptions::default()
            } else {
                rlx::opt::FusionOptions::ALL
            },
            ..Default::default()
        };
        let after = rlx::opt::graph_after(&graph, &plan_options, stage.parse()?)?;
        println!("after {stage}: {after}");
        return Ok(());
    }
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
