//! `rlx onnx-test`: runs ONNX backend test directories and reports each test.

use anyhow::Result;
use clap::Args;
use rlx::Device;
use rlx::models::onnx::conformance::{CaseResult, Outcome, discover, run_case_on};
use std::path::PathBuf;

/// Arguments of `rlx onnx-test`.
#[derive(Args)]
pub struct OnnxTestArgs {
    /// Print one JSON object (counts and every test) instead of lines.
    #[arg(long)]
    json: bool,
    /// Only tests whose directory name contains this text.
    #[arg(long)]
    filter: Option<String>,
    /// Where the tests run: `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: Device,
    /// Test directories (each with model.onnx and test_data_set_*), or directories
    /// that hold such directories at any depth.
    #[arg(required = true)]
    dirs: Vec<PathBuf>,
}

/// Runs one case, turning a panic into a failure so one bad test cannot end the run.
fn run_guarded(dir: &std::path::Path, device: Device) -> CaseResult {
    match std::panic::catch_unwind(|| run_case_on(dir, device)) {
        Ok(r) => r,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
                .unwrap_or_default();
            CaseResult {
                name: dir
                    .file_name()
                    .map(|n| n.to_string_lossy().into_owned())
                    .unwrap_or_default(),
                outcome: Outcome::Fail(format!("panicked: {msg}")),
            }
        }
    }
}

/// Runs the command. Fails (exit status 1) when any test did not pass.
pub fn run(args: &OnnxTestArgs) -> Result<()> {
    rlx::device_available(args.device)?;
    let mut dirs = discover(&args.dirs)?;
    if let Some(f) = &args.filter {
        dirs.retain(|d| {
            d.file_name()
                .is_some_and(|n| n.to_string_lossy().contains(f.as_str()))
        });
    }
    if !args.json {
        // Panics are reported as failures; keep their default message off the output.
        std::panic::set_hook(Box::new(|_| {}));
    }
    let mut results = Vec::with_capacity(dirs.len());
    for dir in &dirs {
        let r = run_guarded(dir, args.device);
        if !args.json {
            println!("{}", r.line());
        }
        results.push(r);
    }
    let passed = results
        .iter()
        .filter(|r| r.outcome == Outcome::Pass)
        .count();
    let failed = results.len() - passed;
    if args.json {
        let tests: Vec<serde_json::Value> = results
            .iter()
            .map(|r| {
                let (status, reason) = match &r.outcome {
                    Outcome::Pass => ("pass", None),
                    Outcome::Fail(why) => ("fail", Some(why.clone())),
                    Outcome::Unsupported(why) => ("unsupported", Some(why.clone())),
                };
                serde_json::json!({"name": r.name, "status": status, "reason": reason})
            })
            .collect();
        println!(
            "{}",
            serde_json::json!({"passed": passed, "failed": failed, "tests": tests})
        );
    } else {
        println!("{passed} passed, {failed} failed");
    }
    if failed > 0 {
        std::process::exit(1);
    }
    Ok(())
}
