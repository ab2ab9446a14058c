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
        out.contains("fusions: none") && out.contains("cpu.ref.gelu"),
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
