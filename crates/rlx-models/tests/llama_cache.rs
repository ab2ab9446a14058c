//! Generation through the key/value cache computes what a full recompute of the
//! prefix computes, and the model object rejects bad input without breaking.

use rlx_models::llama::{GenerateOptions, Llm, LlmOptions, SamplingOptions, StopReason};

/// Largest difference relative to the row's largest magnitude.
fn relative_diff(got: &[f32], want: &[f32]) -> f32 {
    let scale = want.iter().fold(1f32, |m, v| m.max(v.abs()));
    got.iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max)
        / scale
}

#[test]
fn decoding_with_the_cache_matches_a_full_recompute() {
    let mut llm = Llm::load("smollm2").unwrap();
    let ids = llm
        .tokenizer()
        .unwrap()
        .encode("Rust is a language empowering everyone to build reliable and efficient software.")
        .unwrap();
    assert!(ids.len() >= 12, "{ids:?}");
    let full = llm.logits_all(&ids).unwrap();
    assert_eq!(full.len(), ids.len());

    // The prefix through a prefill chunk, then one token at a time.
    llm.reset();
    let split = 5;
    let mut worst = relative_diff(&llm.prefill(&ids[..split]).unwrap(), &full[split - 1]);
    for (i, &id) in ids.iter().enumerate().skip(split) {
        let step = llm.step(id).unwrap();
        worst = worst.max(relative_diff(&step, &full[i]));
    }
    // And the whole prompt one token at a time from an empty cache.
    llm.reset();
    for (i, &id) in ids.iter().enumerate() {
        let step = llm.step(id).unwrap();
        worst = worst.max(relative_diff(&step, &full[i]));
    }
    eprintln!("worst relative difference {worst:e}");
    assert!(
        worst <= 1e-4,
        "cached decoding differs by {worst:e} (relative)"
    );
}

#[test]
fn context_limit_bad_ids_and_options_are_errors_or_clean_stops() {
    let options = LlmOptions {
        max_context: 24,
        ..LlmOptions::default()
    };
    let mut llm = Llm::load_with("smollm2", options).unwrap();
    assert_eq!(llm.max_context(), 24);
    let vocab = llm.config().vocab_size as u32;
    // Out-of-vocabulary ids, an empty prompt, a prompt longer than the context.
    let e = llm.prefill(&[1, vocab]).unwrap_err().to_string();
    assert!(e.contains(&vocab.to_string()), "{e}");
    assert!(llm.prefill(&[]).is_err());
    assert!(llm.prefill(&[5; 25]).is_err());
    assert_eq!(llm.position(), 0, "rejected calls leave the context empty");
    // Bad sampling options are named.
    let bad = GenerateOptions {
        sampling: SamplingOptions {
            top_p: 1.5,
            ..SamplingOptions::default()
        },
        ..GenerateOptions::default()
    };
    let e = llm
        .generate(&[504], &bad, |_| Ok(()))
        .unwrap_err()
        .to_string();
    assert!(e.contains("top_p"), "{e}");
    // Generation that reaches the context limit stops cleanly.
    let mut streamed = Vec::new();
    let run = llm
        .generate(
            &[504, 3575, 282, 4649, 314],
            &GenerateOptions {
                max_tokens: 100,
                sampling: SamplingOptions {
                    temperature: 0.9,
                    seed: 3,
                    ..SamplingOptions::default()
                },
            },
            |id| {
                streamed.push(id);
                Ok(())
            },
        )
        .unwrap();
    assert_eq!(streamed, run.ids);
    if run.stop == StopReason::ContextFull {
        assert_eq!(llm.position(), 24);
    } else {
        assert_eq!(run.stop, StopReason::EndOfSequence);
    }
    // A step past the end is an error, and the model still works after reset.
    while llm.position() < 24 {
        llm.step(5).unwrap();
    }
    assert!(llm.step(5).is_err());
    llm.reset();
    let logits = llm.prefill(&[504, 3575, 282, 4649, 314]).unwrap();
    assert_eq!(logits.len(), vocab as usize);
    assert_eq!(rlx_models::llama::argmax(&logits), 7042, "' Paris'");
}

#[test]
fn a_seed_repeats_sampled_text() {
    let mut llm = Llm::load("smollm2").unwrap();
    let options = GenerateOptions {
        max_tokens: 12,
        sampling: SamplingOptions {
            temperature: 1.0,
            top_k: 40,
            top_p: 0.9,
            seed: 11,
            ..SamplingOptions::default()
        },
    };
    let prompt = [504, 1296, 3003, 4683, 359];
    let a = llm.generate(&prompt, &options, |_| Ok(())).unwrap().ids;
    llm.reset();
    let b = llm.generate(&prompt, &options, |_| Ok(())).unwrap().ids;
    assert_eq!(a, b);
}

/// The kernels of one decoder layer at decode time: 2 RMSNorms, 7 quantized
/// projections (q, k, v, o, gate, up, down), 2 rotary embeddings, 2 cache writes, one
/// cached attention, the SwiGLU product as one region, 2 residual adds. A lost fusion
/// (e.g. the gate's silu and the up product no longer one region) fails this test.
#[test]
fn a_llama_layer_compiles_to_seventeen_kernels() {
    let mut llm = Llm::load("smollm2").unwrap();
    let layers = llm.config().layers;
    let kernels: Vec<String> = llm
        .decode_graph()
        .kernels()
        .into_iter()
        .map(|(_, k)| k)
        .collect();
    let count = |what: &str| kernels.iter().filter(|k| k.contains(what)).count();
    let listing = kernels.join("\n");
    // Per layer, then the rest: the embedding gather and decode, the position
    // arithmetic, the gathered logit rows, the final norm and the head.
    assert_eq!(count("cached_attention"), layers, "{listing}");
    assert_eq!(count("q4_1.matmul"), 7 * layers, "{listing}");
    assert_eq!(count("rope"), 2 * layers, "{listing}");
    assert_eq!(count("write_at"), 2 * layers, "{listing}");
    assert_eq!(count("rms_norm"), 2 * layers + 1, "{listing}");
    assert_eq!(count("region2"), layers, "{listing}");
    assert_eq!(count("region1.add"), 2 * layers, "{listing}");
    assert_eq!(kernels.len(), 17 * layers + 8, "{listing}");
}
