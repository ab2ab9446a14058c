//! The `rlx` binary: help, version, inspect, and errors for bad arguments.

use std::process::Command;

fn rlx(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_rlx"))
        .args(args)
        .output()
        .expect("the rlx binary runs");
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into(),
        String::from_utf8_lossy(&out.stderr).into(),
    )
}

#[test]
fn help_and_version() {
    let (ok, out, _) = rlx(&["--help"]);
    assert!(ok && out.contains("inspect"), "{out}");
    let (ok, out, _) = rlx(&["--version"]);
    assert!(ok && out.contains(env!("CARGO_PKG_VERSION")), "{out}");
}

#[test]
fn inspect_prints_graph_plan_and_kernels() {
    for example in ["mlp", "transformer", "cnn"] {
        let (ok, out, err) = rlx(&["inspect", "--example", example]);
        assert!(ok, "{err}");
        assert!(
            out.contains("graph \"") && out.contains("memory plan") && out.contains("lower bound"),
            "{out}"
        );
        assert!(out.contains("cpu."), "{out}");
    }
    // The MLP's matmul, bias add and gelu become one kernel; without optimization
    // every op keeps its own.
    let (_, out, _) = rlx(&["inspect", "--example", "mlp"]);
    assert!(
        out.contains("fused_matmul [+bias gelu] <- matmul %3, add %4, gelu %5")
            && out.contains("matmul+epilogue"),
        "{out}"
    );
    let (_, out, _) = rlx(&["inspect", "--example", "mlp", "--no-optimize"]);
    assert!(
        out.contains("fusions: none") && out.contains("cpu.region1.gelu"),
        "{out}"
    );
    let (_, out, _) = rlx(&["inspect", "--example", "transformer"]);
    assert!(
        out.contains("cpu.flash.attention.f32") && out.contains("+bias +residual"),
        "{out}"
    );
    let (_, out, _) = rlx(&["inspect", "--example", "transformer", "--no-optimize"]);
    assert!(
        out.contains("attention")
            && out.contains("(in place)")
            && out.contains("views (no kernel)"),
        "{out}"
    );
}

#[test]
fn bad_arguments_fail_cleanly() {
    let (ok, _, err) = rlx(&["inspect", "--example", "nope"]);
    assert!(!ok && err.contains("nope"), "{err}");
    let (ok, _, err) = rlx(&["inspect", "--device", "cuda"]);
    assert!(
        !ok && err.contains("cuda") && err.contains("not available"),
        "{err}"
    );
    let (ok, _, err) = rlx(&["inspect", "--device", "abacus"]);
    assert!(!ok && err.contains("unknown device"), "{err}");
    let (ok, _, _) = rlx(&["frobnicate"]);
    assert!(!ok);
}

#[test]
fn bench_gemm_reports_every_round_and_rejects_bad_shapes() {
    let (ok, out, err) = rlx(&[
        "bench", "gemm", "--shape", "40x72x33", "--shape", "3x5x7", "--runs", "2", "--rounds", "3",
        "--json",
    ]);
    assert!(ok, "{err}");
    let report: serde_json::Value = serde_json::from_str(&out).expect("one JSON object");
    assert_eq!(report["rounds"], 3, "{out}");
    assert!(
        report["peak_gflops"].as_f64().is_some_and(|p| p > 0.0),
        "{out}"
    );
    let results = report["results"].as_array().expect("results");
    assert_eq!(results.len(), 2, "{out}");
    for r in results {
        let rounds: Vec<f64> = r["round_medians_ms"]
            .as_array()
            .expect("round medians")
            .iter()
            .filter_map(|v| v.as_f64())
            .collect();
        assert_eq!(rounds.len(), 3, "{out}");
        // The reported median is the best round's.
        let best = rounds.iter().copied().fold(f64::INFINITY, f64::min);
        assert_eq!(r["median_ms"].as_f64(), Some(best), "{out}");
        assert!(r["gflops"].as_f64().is_some_and(|g| g > 0.0), "{out}");
    }
    let (ok, _, err) = rlx(&["bench", "gemm", "--shape", "4x4", "--runs", "1"]);
    assert!(!ok && err.contains("4x4"), "{err}");
    let (ok, _, err) = rlx(&["bench", "gemm", "--rounds", "0"]);
    assert!(!ok && err.contains("rounds"), "{err}");
}
