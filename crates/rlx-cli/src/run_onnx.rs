//! `rlx run`: runs an ONNX model on `.npy` inputs, or describes its inputs and outputs.

use anyhow::{Context, Result, bail};
use clap::Args;
use rlx::models::npy::{read_npy, write_npy};
use rlx::models::onnx::OnnxSession;
use rlx::onnx::{ImportOptions, OnnxModel, Tensor, ValueInfo};
use rlx::runtime::CompileOptions;
use std::collections::BTreeMap;
use std::path::PathBuf;

/// Arguments of `rlx run`.
#[derive(Args)]
pub struct RunArgs {
    /// The `.onnx` file.
    model: PathBuf,
    /// An input as `NAME=FILE.npy` (repeat for each input); its data also fixes its
    /// dims. Without inputs, the model's inputs and outputs are listed.
    #[arg(long = "input", value_name = "NAME=FILE.npy")]
    inputs: Vec<String>,
    /// A symbolic dim as `SYM=N` (repeatable).
    #[arg(long = "shape", value_name = "SYM=N")]
    shapes: Vec<String>,
    /// Write each output to `DIR/NAME.npy` (created if missing).
    #[arg(long, value_name = "DIR")]
    output_dir: Option<PathBuf>,
    /// CPU threads (default: all of the runtime's).
    #[arg(long, default_value_t = 0, hide_default_value = true)]
    threads: usize,
    /// Where the model runs: `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: rlx::Device,
    /// Print one JSON object instead of text.
    #[arg(long)]
    json: bool,
}

/// Parses `--shape` values.
pub fn parse_shapes(shapes: &[String]) -> Result<BTreeMap<String, usize>> {
    let mut out = BTreeMap::new();
    for s in shapes {
        let (name, n) = ImportOptions::parse_binding(s)?;
        if out.insert(name.clone(), n).is_some() {
            bail!("symbol '{name}' is bound twice");
        }
    }
    Ok(out)
}

/// Parses `--input NAME=FILE.npy` values and reads the files.
pub fn read_inputs(inputs: &[String]) -> Result<Vec<(String, Tensor)>> {
    let mut out: Vec<(String, Tensor)> = Vec::new();
    for spec in inputs {
        let (name, file) = spec
            .split_once('=')
            .with_context(|| format!("--input '{spec}' is not NAME=FILE.npy"))?;
        if out.iter().any(|(n, _)| n == name) {
            bail!("input '{name}' is given twice");
        }
        let (dims, data) = read_npy(file)?;
        out.push((name.to_string(), Tensor { dims, data }));
    }
    Ok(out)
}

fn dims_json(v: &ValueInfo) -> serde_json::Value {
    match &v.dims {
        None => serde_json::Value::Null,
        Some(dims) => dims
            .iter()
            .map(|d| match d {
                rlx::onnx::Dim::Fixed(n) => serde_json::json!(n),
                rlx::onnx::Dim::Symbol(s) => serde_json::json!(s),
                rlx::onnx::Dim::Unknown => serde_json::Value::Null,
            })
            .collect(),
    }
}

fn describe(model: &OnnxModel, json: bool) {
    let info = |v: &ValueInfo| serde_json::json!({"name": v.name, "type": v.type_name, "shape": dims_json(v)});
    if json {
        let inputs: Vec<_> = model.inputs().iter().map(info).collect();
        let outputs: Vec<_> = model.outputs().iter().map(info).collect();
        println!(
            "{}",
            serde_json::json!({"model": model.path(), "opset": model.opset(), "symbols": model.symbols(), "inputs": inputs, "outputs": outputs})
        );
        return;
    }
    println!("{} (opset {})", model.path(), model.opset());
    println!("inputs:");
    for v in model.inputs() {
        println!("  {v}");
    }
    println!("outputs:");
    for v in model.outputs() {
        println!("  {v}");
    }
    let symbols = model.symbols();
    if !symbols.is_empty() {
        println!(
            "symbolic dims: {} (bind with --shape SYM=N, or give the inputs)",
            symbols.join(", ")
        );
    }
}

/// A file name for an output: characters other than letters, digits, `-`, `_` and
/// `.` become `_`.
fn file_name(name: &str) -> String {
    let s: String = name
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || "-_.".contains(c) {
                c
            } else {
                '_'
            }
        })
        .collect();
    if s.is_empty() || s.starts_with('.') {
        format!("output{s}")
    } else {
        s
    }
}

fn preview(t: &Tensor) -> String {
    let v = t.data.as_ref().to_f64_vec();
    let shown: Vec<String> = v.iter().take(8).map(|x| format!("{x:.6}")).collect();
    let more = if v.len() > 8 { ", ..." } else { "" };
    format!("[{}{more}]", shown.join(", "))
}

/// Runs the command.
pub fn run(args: &RunArgs) -> Result<()> {
    let model = OnnxModel::load(&args.model)?;
    let symbols = parse_shapes(&args.shapes)?;
    if args.inputs.is_empty() {
        describe(&model, args.json);
        return Ok(());
    }
    let inputs = read_inputs(&args.inputs)?;
    let declared = model.inputs();
    let missing: Vec<String> = declared
        .iter()
        .filter(|v| !inputs.iter().any(|(n, _)| *n == v.name))
        .map(|v| v.to_string())
        .collect();
    if !missing.is_empty() {
        bail!(
            "missing inputs (give each as --input NAME=FILE.npy): {}",
            missing.join("; ")
        );
    }
    let mut options = CompileOptions::new();
    if args.threads > 0 {
        options = options.threads(args.threads);
    }
    let mut session = OnnxSession::on_device(model, args.device, options);
    let named: Vec<(&str, &Tensor)> = inputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
    let start = std::time::Instant::now();
    let outputs = session.run(&named, &symbols)?;
    let elapsed_ms = start.elapsed().as_secs_f64() * 1e3;
    if let Some(dir) = &args.output_dir {
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
    }
    let mut rows = Vec::new();
    for (name, t) in &outputs {
        let file = match &args.output_dir {
            Some(dir) => {
                let path = dir.join(format!("{}.npy", file_name(name)));
                write_npy(&path, &t.dims, &t.data)?;
                Some(path.display().to_string())
            }
            None => None,
        };
        if !args.json {
            let dims: Vec<String> = t.dims.iter().map(|d| d.to_string()).collect();
            match &file {
                Some(f) => println!("{name}: {}[{}] -> {f}", t.data.dtype(), dims.join(", ")),
                None => println!(
                    "{name}: {}[{}] {}",
                    t.data.dtype(),
                    dims.join(", "),
                    preview(t)
                ),
            }
        }
        rows.push(serde_json::json!({"name": name, "dtype": t.data.dtype().name(), "shape": t.dims, "file": file}));
    }
    if args.json {
        println!(
            "{}",
            serde_json::json!({"outputs": rows, "elapsed_ms": elapsed_ms})
        );
    } else {
        eprintln!("imported, compiled and ran in {elapsed_ms:.1} ms");
    }
    Ok(())
}
