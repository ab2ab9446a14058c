//! `rlx generate` end to end with the packaged SmolLM2 model: greedy output matches
//! the reference continuation, `--json` prints exactly one object with the promised
//! keys, streaming text equals the JSON text, chat mode, the README's chat at the
//! default settings, stdin prompts, and clear errors for bad arguments.

use std::io::Write;
use std::process::{Command, Stdio};

struct Run {
    ok: bool,
    stdout: String,
    stderr: String,
}

fn rlx(args: &[&str], stdin: Option<&str>) -> Run {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_rlx"));
    cmd.arg("generate")
        .args(args)
        .stdin(if stdin.is_some() {
            Stdio::piped()
        } else {
            Stdio::null()
        })
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    let mut child = cmd.spawn().unwrap();
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

#[test]
fn greedy_json_and_streaming_agree_with_the_reference() {
    let json = rlx(
        &[
            "--temperature",
            "0",
            "--max-tokens",
            "3",
            "--json",
            "-q",
            "The capital of France is",
        ],
        None,
    );
    assert!(json.ok, "{}", json.stderr);
    let v: serde_json::Value = serde_json::from_str(json.stdout.trim()).unwrap();
    let obj = v.as_object().unwrap();
    let mut keys: Vec<&str> = obj.keys().map(String::as_str).collect();
    keys.sort_unstable();
    assert_eq!(
        keys,
        [
            "decode_tokens_per_s",
            "generated_ids",
            "prefill_tokens_per_s",
            "prompt_ids",
            "text"
        ]
    );
    let ids = |k: &str| -> Vec<u64> {
        obj[k]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap())
            .collect()
    };
    assert_eq!(ids("prompt_ids"), [504, 3575, 282, 4649, 314]);
    // The reference greedy continuation starts " Paris.\n".
    assert_eq!(ids("generated_ids"), [7042, 30, 198]);
    assert_eq!(obj["text"], " Paris.\n");
    assert!(obj["prefill_tokens_per_s"].as_f64().unwrap() > 0.0);
    assert!(obj["decode_tokens_per_s"].as_f64().unwrap() > 0.0);

    // Streaming prints the same text (and a final newline); the prompt comes on stdin.
    let streamed = rlx(
        &["--temperature", "0", "--max-tokens", "3", "-"],
        Some("The capital of France is"),
    );
    assert!(streamed.ok, "{}", streamed.stderr);
    assert_eq!(streamed.stdout, " Paris.\n\n");
    assert!(streamed.stderr.contains("tok/s"), "{}", streamed.stderr);
}

#[test]
fn chat_mode_stops_at_the_end_of_the_turn() {
    let run = rlx(
        &[
            "--chat",
            "--temperature",
            "0",
            "--max-tokens",
            "40",
            "--json",
            "-q",
            "What is 2+2?",
        ],
        None,
    );
    assert!(run.ok, "{}", run.stderr);
    let v: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap();
    // The chat prompt is the reference's ChatML prompt with the default system text.
    assert_eq!(v["prompt_ids"].as_array().unwrap().len(), 37);
    let generated = v["generated_ids"].as_array().unwrap();
    assert_eq!(
        generated.last().and_then(|x| x.as_u64()),
        Some(2),
        "ends with <|im_end|>"
    );
    let text = v["text"].as_str().unwrap();
    assert!(text.contains('4') && !text.contains("<|im_end|>"), "{text}");
}

/// The README's first command, at the packaged model's default settings, gives a
/// sensible answer whatever the seed (at the model card's sampling settings about 4
/// seeds in 10 answered in broken French on these 4-bit weights).
#[test]
fn the_readme_chat_answers_sensibly_at_the_defaults() {
    let mut answers = Vec::new();
    for seed in ["1", "3", "4", "5"] {
        let run = rlx(
            &[
                "--chat",
                "--seed",
                seed,
                "--max-tokens",
                "24",
                "--json",
                "-q",
                "What is the capital of France?",
            ],
            None,
        );
        assert!(run.ok, "{}", run.stderr);
        let v: serde_json::Value = serde_json::from_str(run.stdout.trim()).unwrap();
        let text = v["text"].as_str().unwrap().to_string();
        assert!(
            text.starts_with("The capital of France is Paris"),
            "seed {seed}: {text}"
        );
        answers.push(text);
    }
    // The default is greedy: the seed does not change the answer.
    assert!(answers.windows(2).all(|w| w[0] == w[1]), "{answers:?}");
}

#[test]
fn bad_arguments_are_clear_errors() {
    for (args, needle) in [
        (vec!["--top-p", "0", "hi"], "top_p"),
        (vec!["--temperature=-1", "hi"], "temperature"),
        (vec!["--max-tokens", "0", "hi"], "max-tokens"),
        (
            vec!["--model", "/nonexistent/model.gguf", "hi"],
            "/nonexistent",
        ),
        (vec![""], "empty"),
        (
            vec![
                "--ctx",
                "4",
                "a long prompt that does not fit in four tokens of context",
            ],
            "context",
        ),
    ] {
        let run = rlx(&args, None);
        assert!(!run.ok, "{args:?} should fail");
        assert!(run.stderr.contains(needle), "{args:?}: {}", run.stderr);
    }
}
