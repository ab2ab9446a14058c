//! `rlx embed` and `rlx bench minilm` end to end with the packaged MiniLM model:
//! a fresh cache is filled on first use and reused after; `--json` prints exactly one
//! object; stdin texts; and clear errors for bad input.

use std::io::Write;
use std::path::PathBuf;
use std::process::{Command, Stdio};

struct Run {
    ok: bool,
    stdout: String,
    stderr: String,
}

fn rlx_with(args: &[&str], cache: Option<&PathBuf>, stdin: Option<&str>) -> Run {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rlx"));
    cmd.args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(dir) = cache {
        cmd.env("RLX_CACHE", dir);
    }
    let mut child = cmd.spawn().expect("the rlx binary runs");
    if let Some(text) = stdin {
        child
            .stdin
            .take()
            .unwrap()
            .write_all(text.as_bytes())
            .unwrap();
    }
    let out = child.wait_with_output().unwrap();
    Run {
        ok: out.status.success(),
        stdout: String::from_utf8_lossy(&out.stdout).into(),
        stderr: String::from_utf8_lossy(&out.stderr).into(),
    }
}

fn rlx(args: &[&str]) -> Run {
    rlx_with(args, None, None)
}

/// Parses stdout as exactly one JSON object and returns its embeddings.
fn embeddings(run: &Run) -> Vec<Vec<f64>> {
    assert!(run.ok, "{}", run.stderr);
    let value: serde_json::Value = serde_json::from_str(run.stdout.trim())
        .unwrap_or_else(|e| panic!("stdout is not one JSON object ({e}): {}", run.stdout));
    let obj = value.as_object().expect("a JSON object");
    assert_eq!(obj.len(), 3, "{obj:?}");
    assert_eq!(obj["model"], "minilm");
    assert_eq!(obj["dim"], 384);
    obj["embeddings"]
        .as_array()
        .unwrap()
        .iter()
        .map(|row| {
            let v: Vec<f64> = row
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap())
                .collect();
            assert_eq!(v.len(), 384);
            let norm = v.iter().map(|x| x * x).sum::<f64>().sqrt();
            assert!((norm - 1.0).abs() < 1e-5, "norm {norm}");
            v
        })
        .collect()
}

#[test]
fn embed_json_works_on_a_fresh_cache_and_reuses_it() {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .as_nanos();
    let cache = std::env::temp_dir().join(format!("rlx-cli-cache-{}-{nanos}", std::process::id()));
    let first = rlx_with(&["embed", "--json", "some text"], Some(&cache), None);
    assert_eq!(embeddings(&first).len(), 1);
    assert!(
        first.stderr.contains("fetching model 'minilm'"),
        "{}",
        first.stderr
    );
    let second = rlx_with(&["embed", "--json", "some text"], Some(&cache), None);
    assert!(!second.stderr.contains("fetching"), "{}", second.stderr);
    assert_eq!(embeddings(&second), embeddings(&first));
    std::fs::remove_dir_all(&cache).ok();
}

#[test]
fn texts_from_arguments_and_stdin_keep_their_order() {
    let mixed = rlx_with(
        &["embed", "--json", "first", "-", "last"],
        None,
        Some("from stdin one\nfrom stdin two\n"),
    );
    let all = embeddings(&mixed);
    assert_eq!(all.len(), 4);
    for (i, text) in ["first", "from stdin one", "from stdin two", "last"]
        .iter()
        .enumerate()
    {
        let alone = embeddings(&rlx(&["embed", "--json", text]));
        let diff = alone[0]
            .iter()
            .zip(&all[i])
            .map(|(a, b)| (a - b).abs())
            .fold(0.0, f64::max);
        assert!(diff < 1e-5, "text {i}: {diff}");
    }
}

#[test]
fn the_readable_summary_shows_similarities() {
    let run = rlx(&[
        "embed",
        "The cat sat on the mat.",
        "A cat was sitting on a mat.",
    ]);
    assert!(run.ok, "{}", run.stderr);
    assert!(run.stdout.contains("384 dims") && run.stdout.contains("cosine similarity"));
    assert!(run.stdout.contains("(9 tokens)"), "{}", run.stdout);
}

#[test]
fn long_texts_are_truncated_with_a_warning() {
    let long = "word ".repeat(2000);
    let run = rlx(&["embed", "--json", &long]);
    assert_eq!(embeddings(&run).len(), 1);
    assert!(run.stderr.contains("truncated"), "{}", run.stderr);
}

#[test]
fn bad_input_is_a_clear_error() {
    let run = rlx(&["embed", "fine", ""]);
    assert!(!run.ok && run.stderr.contains("text #1") && run.stderr.contains("empty"));
    assert!(run.stdout.is_empty());

    let run = rlx(&["embed", "--model", "/no/such/model/dir", "hi"]);
    assert!(
        !run.ok && run.stderr.contains("/no/such/model/dir"),
        "{}",
        run.stderr
    );

    let run = rlx(&["embed", "--model", "nosuchmodel", "hi"]);
    assert!(!run.ok && run.stderr.contains("minilm"), "{}", run.stderr);

    let run = rlx(&["embed"]);
    assert!(!run.ok && run.stderr.contains("TEXT"), "{}", run.stderr);

    let run = rlx_with(&["embed", "-"], None, Some(""));
    assert!(!run.ok && run.stderr.contains("no texts"), "{}", run.stderr);

    let run = rlx(&["embed", "--batch-size", "0", "hi"]);
    assert!(
        !run.ok && run.stderr.contains("batch-size"),
        "{}",
        run.stderr
    );
}

#[test]
fn bench_minilm_reports_json() {
    let run = rlx(&[
        "bench", "minilm", "--batch", "2", "--seq", "16", "--runs", "3", "--warmup", "1", "--json",
    ]);
    assert!(run.ok, "{}", run.stderr);
    let v: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap();
    assert_eq!(v["runs"], 3);
    assert_eq!(v["batch"], 2);
    assert_eq!(v["seq"], 16);
    assert!(v["threads"].as_u64().unwrap() >= 1);
    for key in ["median_ms", "min_ms", "compile_ms"] {
        assert!(v[key].as_f64().unwrap() > 0.0, "{key}: {v}");
    }
    let run = rlx(&["bench", "minilm", "--seq", "300"]);
    assert!(!run.ok && run.stderr.contains("256"), "{}", run.stderr);
}
