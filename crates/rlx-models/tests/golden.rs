//! all-MiniLM-L6-v2 against the golden embeddings made with sentence-transformers
//! (fp32): identical token ids, and every embedding within cosine 0.99999 and max
//! abs difference 1e-4, embedding each text alone and all of them in one padded batch.
//! The packaged model is fetched into the cache on first use.

use rlx_models::Embedder;
use serde::Deserialize;
use std::path::PathBuf;

#[derive(Deserialize)]
struct Golden {
    max_seq_length: usize,
    cases: Vec<Case>,
}

#[derive(Deserialize)]
struct Case {
    text: String,
    input_ids: Vec<u32>,
    embedding: Vec<f32>,
}

fn golden() -> Golden {
    let dir = rlx_ir::env::Switch::GoldenDir
        .value()
        .map(PathBuf::from)
        .unwrap_or_else(|| {
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../../shared/golden")
        });
    let path = dir.join("minilm_embeddings.json");
    let text = std::fs::read_to_string(&path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    serde_json::from_str(&text).unwrap()
}

/// Checks one embedding; returns its (cosine, max abs difference).
fn compare(what: &str, got: &[f32], want: &[f32]) -> (f64, f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let dot: f64 = got
        .iter()
        .zip(want)
        .map(|(a, b)| f64::from(*a) * f64::from(*b))
        .sum();
    let norm = |v: &[f32]| v.iter().map(|x| f64::from(*x).powi(2)).sum::<f64>().sqrt();
    let cosine = dot / (norm(got) * norm(want));
    let max_abs = got
        .iter()
        .zip(want)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(
        cosine >= 0.99999 && max_abs <= 1e-4,
        "{what}: cosine {cosine:.7}, max abs diff {max_abs:e}"
    );
    (cosine, max_abs)
}

/// The lowest cosine and the largest difference over all texts.
fn worst(stats: &[(f64, f32)]) -> (f64, f32) {
    let cosine = stats.iter().map(|s| s.0).reduce(f64::min).unwrap_or(1.0);
    let diff = stats.iter().map(|s| s.1).reduce(f32::max).unwrap_or(0.0);
    (cosine, diff)
}

#[test]
fn minilm_matches_sentence_transformers() {
    let golden = golden();
    let mut embedder = Embedder::load("minilm").unwrap();
    assert_eq!(embedder.dim(), 384);
    assert_eq!(embedder.max_seq_length(), golden.max_seq_length);
    let texts: Vec<&str> = golden.cases.iter().map(|c| c.text.as_str()).collect();

    let tokens = embedder.tokenize(&texts).unwrap();
    for (case, t) in golden.cases.iter().zip(&tokens) {
        assert_eq!(t.ids, case.input_ids, "token ids of {:?}", case.text);
        assert!(!t.truncated);
    }

    let mut alone_stats = Vec::new();
    for case in &golden.cases {
        let alone = embedder.embed(&[case.text.as_str()]).unwrap();
        alone_stats.push(compare(
            &format!("alone: {:?}", case.text),
            &alone[0],
            &case.embedding,
        ));
    }

    let batch = embedder.embed(&texts).unwrap();
    assert_eq!(batch.len(), golden.cases.len());
    let batch_stats: Vec<_> = golden
        .cases
        .iter()
        .zip(&batch)
        .map(|(case, got)| compare(&format!("batch: {:?}", case.text), got, &case.embedding))
        .collect();
    let (a, b) = (worst(&alone_stats), worst(&batch_stats));
    eprintln!(
        "golden minilm, worst over {} texts: alone cosine {:.8} max|d| {:.2e}; \
         batch cosine {:.8} max|d| {:.2e}",
        golden.cases.len(),
        a.0,
        a.1,
        b.0,
        b.1
    );
}
