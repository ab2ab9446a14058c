//! A tiny BERT written to a temporary directory (random weights, a hand-made WordPiece
//! tokenizer) checked against a plain f64 forward pass written here, for every pooling
//! mode, with and without normalization, with f32, f16 and bf16 weights, alone and in
//! padded batches; and every kind of broken model directory, each an error.

use rlx_ir::Error;
use rlx_models::bert::Pooling;
use rlx_models::{Embedder, EmbedderOptions, ModelStore};
use safetensors::Dtype;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

const WORDS: &[&str] = &[
    "[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "the", "cat", "sat", "on", "mat", "dog", "a",
    "##s", "run", "fast", "slow", "red", "blue", ".", ",", "and", "is", "big", "small",
];
const HIDDEN: usize = 16;
const HEADS: usize = 4;
const LAYERS: usize = 2;
const FFN: usize = 24;
const MAX_POS: usize = 40;
const EPS: f64 = 1e-12;

fn temp_dir(tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("rlx-tiny-{tag}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// Deterministic values in [-scale, scale).
struct Lcg(u64);
impl Lcg {
    fn next(&mut self, scale: f64) -> f64 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 11) as f64 / (1u64 << 53) as f64 * 2.0 - 1.0) * scale
    }
}

/// The tiny model's weights, by checkpoint name, in checkpoint layout.
type Weights = BTreeMap<String, (Vec<usize>, Vec<f64>)>;

fn random_weights(seed: u64) -> Weights {
    let mut rng = Lcg(seed);
    let mut w = Weights::new();
    let mut add = |name: String, dims: &[usize], scale: f64, offset: f64| {
        let n = dims.iter().product();
        let values = (0..n).map(|_| offset + rng.next(scale)).collect();
        w.insert(name, (dims.to_vec(), values));
    };
    let v = WORDS.len();
    add(
        "embeddings.word_embeddings.weight".into(),
        &[v, HIDDEN],
        1.0,
        0.0,
    );
    add(
        "embeddings.position_embeddings.weight".into(),
        &[MAX_POS, HIDDEN],
        0.5,
        0.0,
    );
    add(
        "embeddings.token_type_embeddings.weight".into(),
        &[2, HIDDEN],
        0.5,
        0.0,
    );
    add("embeddings.LayerNorm.weight".into(), &[HIDDEN], 0.2, 1.0);
    add("embeddings.LayerNorm.bias".into(), &[HIDDEN], 0.2, 0.0);
    for l in 0..LAYERS {
        let p = format!("encoder.layer.{l}");
        for (name, out, inp) in [
            ("attention.self.query", HIDDEN, HIDDEN),
            ("attention.self.key", HIDDEN, HIDDEN),
            ("attention.self.value", HIDDEN, HIDDEN),
            ("attention.output.dense", HIDDEN, HIDDEN),
            ("intermediate.dense", FFN, HIDDEN),
            ("output.dense", HIDDEN, FFN),
        ] {
            add(format!("{p}.{name}.weight"), &[out, inp], 0.5, 0.0);
            add(format!("{p}.{name}.bias"), &[out], 0.2, 0.0);
        }
        for norm in ["attention.output.LayerNorm", "output.LayerNorm"] {
            add(format!("{p}.{norm}.weight"), &[HIDDEN], 0.2, 1.0);
            add(format!("{p}.{norm}.bias"), &[HIDDEN], 0.2, 0.0);
        }
    }
    // Present in real checkpoints, unused by the encoder: must be ignored.
    w.insert(
        "pooler.dense.bias".into(),
        (vec![HIDDEN], vec![0.0; HIDDEN]),
    );
    w
}

/// Rounds weights to what `dtype` stores, so the reference sees the same numbers.
fn stored(weights: &Weights, dtype: Dtype) -> Weights {
    let round = |x: f64| match dtype {
        Dtype::F16 => f64::from(half::f16::from_f64(x)),
        Dtype::BF16 => f64::from(half::bf16::from_f64(x)),
        _ => f64::from(x as f32),
    };
    weights
        .iter()
        .map(|(k, (d, v))| {
            (
                k.clone(),
                (d.clone(), v.iter().map(|&x| round(x)).collect()),
            )
        })
        .collect()
}

fn safetensors_bytes(weights: &Weights, dtype: Dtype, prefix: &str) -> Vec<u8> {
    let encoded: Vec<(String, Vec<usize>, Vec<u8>)> = weights
        .iter()
        .map(|(name, (dims, values))| {
            let bytes = values
                .iter()
                .flat_map(|&x| match dtype {
                    Dtype::F16 => half::f16::from_f64(x).to_le_bytes().to_vec(),
                    Dtype::BF16 => half::bf16::from_f64(x).to_le_bytes().to_vec(),
                    _ => (x as f32).to_le_bytes().to_vec(),
                })
                .collect();
            (format!("{prefix}{name}"), dims.clone(), bytes)
        })
        .collect();
    let views = encoded.iter().map(|(name, dims, bytes)| {
        (
            name.clone(),
            safetensors::tensor::TensorView::new(dtype, dims.clone(), bytes).unwrap(),
        )
    });
    safetensors::serialize(views, None).unwrap()
}

fn tokenizer_json() -> String {
    let vocab: Vec<String> = WORDS
        .iter()
        .enumerate()
        .map(|(i, w)| format!("{w:?}: {i}"))
        .collect();
    let added: Vec<String> = WORDS[..5]
        .iter()
        .enumerate()
        .map(|(i, w)| {
            format!(
                r#"{{"id": {i}, "content": {w:?}, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true}}"#
            )
        })
        .collect();
    format!(
        r###"{{
  "version": "1.0",
  "truncation": {{"max_length": 8, "strategy": "LongestFirst", "stride": 0}},
  "padding": null,
  "added_tokens": [{added}],
  "normalizer": {{"type": "BertNormalizer", "clean_text": true,
    "handle_chinese_chars": true, "strip_accents": null, "lowercase": true}},
  "pre_tokenizer": {{"type": "BertPreTokenizer"}},
  "post_processor": {{"type": "TemplateProcessing",
    "single": [{{"SpecialToken": {{"id": "[CLS]", "type_id": 0}}}},
               {{"Sequence": {{"id": "A", "type_id": 0}}}},
               {{"SpecialToken": {{"id": "[SEP]", "type_id": 0}}}}],
    "pair": [{{"SpecialToken": {{"id": "[CLS]", "type_id": 0}}}},
             {{"Sequence": {{"id": "A", "type_id": 0}}}},
             {{"SpecialToken": {{"id": "[SEP]", "type_id": 0}}}},
             {{"Sequence": {{"id": "B", "type_id": 1}}}},
             {{"SpecialToken": {{"id": "[SEP]", "type_id": 1}}}}],
    "special_tokens": {{
      "[CLS]": {{"id": "[CLS]", "ids": [2], "tokens": ["[CLS]"]}},
      "[SEP]": {{"id": "[SEP]", "ids": [3], "tokens": ["[SEP]"]}}}}}},
  "decoder": null,
  "model": {{"type": "WordPiece", "unk_token": "[UNK]", "continuing_subword_prefix": "##",
    "max_input_chars_per_word": 100, "vocab": {{{vocab}}}}}
}}"###,
        added = added.join(", "),
        vocab = vocab.join(", ")
    )
}

fn config_json() -> String {
    format!(
        r#"{{"architectures": ["BertModel"], "model_type": "bert", "hidden_act": "gelu",
  "hidden_size": {HIDDEN}, "num_attention_heads": {HEADS}, "num_hidden_layers": {LAYERS},
  "intermediate_size": {FFN}, "max_position_embeddings": {MAX_POS}, "type_vocab_size": 2,
  "vocab_size": {}, "layer_norm_eps": {EPS:e}, "pad_token_id": 0}}"#,
        WORDS.len()
    )
}

/// Writes a complete tiny model; `max_seq` goes into sentence_bert_config.json.
fn write_model(
    dir: &Path,
    weights: &Weights,
    dtype: Dtype,
    pooling: Pooling,
    normalize: bool,
    max_seq: usize,
) {
    std::fs::write(dir.join("config.json"), config_json()).unwrap();
    std::fs::write(dir.join("tokenizer.json"), tokenizer_json()).unwrap();
    std::fs::write(
        dir.join("model.safetensors"),
        safetensors_bytes(weights, dtype, ""),
    )
    .unwrap();
    let mut modules = vec![
        r#"{"idx": 0, "name": "0", "path": "", "type": "sentence_transformers.models.Transformer"}"#,
        r#"{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}"#,
    ];
    if normalize {
        modules.push(
            r#"{"idx": 2, "name": "2", "path": "2_Normalize", "type": "sentence_transformers.models.Normalize"}"#,
        );
    }
    std::fs::write(dir.join("modules.json"), format!("[{}]", modules.join(","))).unwrap();
    std::fs::create_dir_all(dir.join("1_Pooling")).unwrap();
    let flag = |p: Pooling| pooling == p;
    std::fs::write(
        dir.join("1_Pooling/config.json"),
        format!(
            r#"{{"word_embedding_dimension": {HIDDEN}, "pooling_mode_cls_token": {},
  "pooling_mode_mean_tokens": {}, "pooling_mode_max_tokens": {}}}"#,
            flag(Pooling::Cls),
            flag(Pooling::Mean),
            flag(Pooling::Max)
        ),
    )
    .unwrap();
    std::fs::write(
        dir.join("sentence_bert_config.json"),
        format!(r#"{{"max_seq_length": {max_seq}, "do_lower_case": false}}"#),
    )
    .unwrap();
}

fn load(dir: &Path) -> rlx_ir::Result<Embedder> {
    let options = EmbedderOptions {
        store: Some(ModelStore::new(dir.join("cache")).quiet(true)),
        max_batch: 3,
        max_cached_shapes: 2,
        ..EmbedderOptions::default()
    };
    Embedder::load_with(&dir.to_string_lossy(), options)
}

// ---- the reference forward pass, plain f64 ----

fn get<'a>(w: &'a Weights, name: &str) -> &'a [f64] {
    &w[name].1
}

fn layer_norm(x: &mut [f64], gamma: &[f64], beta: &[f64]) {
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|v| (v - mean).powi(2)).sum::<f64>() / n;
    let inv = 1.0 / (var + EPS).sqrt();
    for (i, v) in x.iter_mut().enumerate() {
        *v = (*v - mean) * inv * gamma[i] + beta[i];
    }
}

/// `x W^T + b` with the checkpoint's `[out, in]` weight.
fn linear(x: &[f64], w: &[f64], b: &[f64]) -> Vec<f64> {
    let inp = x.len();
    b.iter()
        .enumerate()
        .map(|(o, bias)| bias + (0..inp).map(|i| x[i] * w[o * inp + i]).sum::<f64>())
        .collect()
}

fn reference(w: &Weights, ids: &[u32], pooling: Pooling, normalize: bool) -> Vec<f64> {
    let s = ids.len();
    let hd = HIDDEN / HEADS;
    let mut x: Vec<Vec<f64>> = (0..s)
        .map(|t| {
            let mut row: Vec<f64> = (0..HIDDEN)
                .map(|j| {
                    get(w, "embeddings.word_embeddings.weight")[ids[t] as usize * HIDDEN + j]
                        + get(w, "embeddings.position_embeddings.weight")[t * HIDDEN + j]
                        + get(w, "embeddings.token_type_embeddings.weight")[j]
                })
                .collect();
            layer_norm(
                &mut row,
                get(w, "embeddings.LayerNorm.weight"),
                get(w, "embeddings.LayerNorm.bias"),
            );
            row
        })
        .collect();
    for l in 0..LAYERS {
        let p = |n: &str| format!("encoder.layer.{l}.{n}");
        let lin = |x: &[f64], n: &str| {
            linear(
                x,
                get(w, &p(&format!("{n}.weight"))),
                get(w, &p(&format!("{n}.bias"))),
            )
        };
        let q: Vec<Vec<f64>> = x.iter().map(|r| lin(r, "attention.self.query")).collect();
        let k: Vec<Vec<f64>> = x.iter().map(|r| lin(r, "attention.self.key")).collect();
        let v: Vec<Vec<f64>> = x.iter().map(|r| lin(r, "attention.self.value")).collect();
        let mut ctx = vec![vec![0.0; HIDDEN]; s];
        for h in 0..HEADS {
            let cols = h * hd..(h + 1) * hd;
            for i in 0..s {
                let scores: Vec<f64> = (0..s)
                    .map(|j| {
                        cols.clone().map(|c| q[i][c] * k[j][c]).sum::<f64>() / (hd as f64).sqrt()
                    })
                    .collect();
                let max = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|sc| (sc - max).exp()).collect();
                let total: f64 = e.iter().sum();
                for c in cols.clone() {
                    ctx[i][c] = (0..s).map(|j| e[j] / total * v[j][c]).sum();
                }
            }
        }
        for t in 0..s {
            let mut a: Vec<f64> = lin(&ctx[t], "attention.output.dense");
            for (ai, xi) in a.iter_mut().zip(&x[t]) {
                *ai += xi;
            }
            layer_norm(
                &mut a,
                get(w, &p("attention.output.LayerNorm.weight")),
                get(w, &p("attention.output.LayerNorm.bias")),
            );
            let up: Vec<f64> = lin(&a, "intermediate.dense")
                .iter()
                .map(|&u| 0.5 * u * (1.0 + libm::erf(u / std::f64::consts::SQRT_2)))
                .collect();
            let mut d = lin(&up, "output.dense");
            for (di, ai) in d.iter_mut().zip(&a) {
                *di += ai;
            }
            layer_norm(
                &mut d,
                get(w, &p("output.LayerNorm.weight")),
                get(w, &p("output.LayerNorm.bias")),
            );
            x[t] = d;
        }
    }
    let mut pooled: Vec<f64> = match pooling {
        Pooling::Mean => (0..HIDDEN)
            .map(|j| x.iter().map(|r| r[j]).sum::<f64>() / s as f64)
            .collect(),
        Pooling::Cls => x[0].clone(),
        Pooling::Max => (0..HIDDEN)
            .map(|j| x.iter().map(|r| r[j]).fold(f64::NEG_INFINITY, f64::max))
            .collect(),
    };
    if normalize {
        let norm = pooled.iter().map(|v| v * v).sum::<f64>().sqrt().max(1e-12);
        pooled.iter_mut().for_each(|v| *v /= norm);
    }
    pooled
}

const TEXTS: &[&str] = &[
    "the cat sat on the mat.",
    "a dog",
    "the big red dog and the small blue cat run fast , slow",
    "cats",
    "is the mat red ?",
];

fn assert_close(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (k, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (f64::from(*g) - w).abs() <= 2e-5 * (1.0 + w.abs()),
            "{what}: element {k}: got {g}, want {w}"
        );
    }
}

#[test]
fn tiny_bert_matches_the_reference_for_every_head_and_dtype() {
    let weights = random_weights(7);
    for (dtype, pooling, normalize) in [
        (Dtype::F32, Pooling::Mean, true),
        (Dtype::F32, Pooling::Cls, false),
        (Dtype::F32, Pooling::Max, true),
        (Dtype::F16, Pooling::Mean, false),
        (Dtype::BF16, Pooling::Max, false),
    ] {
        let dir = temp_dir("ref");
        write_model(&dir, &weights, dtype, pooling, normalize, 32);
        let exact = stored(&weights, dtype);
        let mut embedder = load(&dir).unwrap();
        assert_eq!(embedder.dim(), HIDDEN);
        let tokens = embedder.tokenize(TEXTS).unwrap();
        // "cats" is "cat" + "##s"; "?" is not in the vocabulary.
        assert_eq!(tokens[3].ids, vec![2, 6, 12, 3]);
        assert_eq!(tokens[4].ids[5], 1);
        let what = format!("{dtype:?} {pooling:?} normalize={normalize}");
        // Batched (max_batch 3: two padded batches) and one at a time.
        let batched = embedder.embed(TEXTS).unwrap();
        // The batch of 3 ran in the bucket of 4 on 3 rows (the active extent), not on
        // a padded fourth.
        let mut three_of_four = false;
        embedder.compile_cache().for_each_compiled(|b, g| {
            three_of_four |= b.get("batch") == Some(4) && g.active_extent() == Some(3);
        });
        assert!(three_of_four, "{what}");
        for (i, t) in tokens.iter().enumerate() {
            let want = reference(&exact, &t.ids, pooling, normalize);
            assert_close(&batched[i], &want, &format!("{what}, batch, text {i}"));
            let alone = embedder.embed(&[TEXTS[i]]).unwrap();
            assert_close(&alone[0], &want, &format!("{what}, alone, text {i}"));
        }
        // At most two compiled shapes are kept.
        assert!(embedder.cached_shapes() <= 2);
    }
}

#[test]
fn long_texts_are_truncated_and_empty_texts_are_errors() {
    let weights = random_weights(11);
    let dir = temp_dir("trunc");
    write_model(&dir, &weights, Dtype::F32, Pooling::Mean, true, 8);
    let mut embedder = load(&dir).unwrap();
    assert_eq!(embedder.max_seq_length(), 8);
    let long = "the cat sat on the mat and the dog sat on the mat ".repeat(500);
    let tokens = embedder.tokenize(&[long.as_str()]).unwrap();
    assert_eq!(tokens[0].ids.len(), 8);
    assert!(tokens[0].truncated);
    // Truncation keeps the first six word pieces: the same as the short text.
    let cut = embedder
        .embed(&[long.as_str(), "the cat sat on the mat"])
        .unwrap();
    assert_close(
        &cut[0],
        &cut[1].iter().map(|&x| f64::from(x)).collect::<Vec<_>>(),
        "truncated",
    );
    for empty in ["", "   ", "\n\t "] {
        let err = embedder.embed(&["fine", empty]).unwrap_err();
        let text = err.to_string();
        assert!(text.contains("text #1") && text.contains("empty"), "{text}");
    }
    // The embedder still works after the rejected calls.
    let again = embedder.embed(&["the cat sat on the mat"]).unwrap();
    // Options out of range are errors at load.
    for (max_batch, max_cached_shapes) in [(0, 2), (3, 0), (1 << 17, 2)] {
        let options = EmbedderOptions {
            store: Some(ModelStore::new(dir.join("cache")).quiet(true)),
            max_batch,
            max_cached_shapes,
            ..EmbedderOptions::default()
        };
        let err = Embedder::load_with(&dir.to_string_lossy(), options).unwrap_err();
        assert!(err.to_string().contains("embedder options"), "{err}");
    }
    assert_eq!(again[0], cut[1]);
    // Nothing at all is fine: no texts, no vectors.
    assert!(embedder.embed(&[]).unwrap().is_empty());
}

/// A complete model directory, then one thing broken by `damage`.
fn broken(tag: &str, damage: impl FnOnce(&Path)) -> (PathBuf, Error) {
    let dir = temp_dir(tag);
    write_model(
        &dir,
        &random_weights(3),
        Dtype::F32,
        Pooling::Mean,
        true,
        16,
    );
    damage(&dir);
    let err = load(&dir).unwrap_err();
    (dir, err)
}

#[test]
fn broken_model_directories_are_errors_that_name_the_problem() {
    let missing = temp_dir("missing").join("not-there");
    let err = load(&missing).unwrap_err();
    assert!(matches!(err, Error::Io { .. }), "{err:?}");

    let (_, err) = broken("noconfig", |d| {
        std::fs::remove_file(d.join("config.json")).unwrap()
    });
    assert!(err.to_string().contains("config.json"), "{err}");

    let (_, err) = broken("badconfig", |d| {
        std::fs::write(d.join("config.json"), "{ not json").unwrap()
    });
    assert!(
        matches!(err, Error::Format { .. }) && err.to_string().contains("config.json"),
        "{err}"
    );

    let (_, err) = broken("heads", |d| {
        let text = config_json().replace(
            &format!("\"num_attention_heads\": {HEADS}"),
            "\"num_attention_heads\": 5",
        );
        std::fs::write(d.join("config.json"), text).unwrap()
    });
    assert!(err.to_string().contains("not a multiple"), "{err}");

    let (_, err) = broken("notok", |d| {
        std::fs::remove_file(d.join("tokenizer.json")).unwrap()
    });
    assert!(err.to_string().contains("tokenizer.json"), "{err}");

    let (_, err) = broken("badtok", |d| {
        std::fs::write(d.join("tokenizer.json"), "{\"version\": \"1.0\"}").unwrap()
    });
    assert!(
        matches!(err, Error::Format { .. }) && err.to_string().contains("tokenizer"),
        "{err}"
    );

    let (_, err) = broken("noweights", |d| {
        std::fs::remove_file(d.join("model.safetensors")).unwrap()
    });
    assert!(err.to_string().contains("model.safetensors"), "{err}");

    let (_, err) = broken("truncated", |d| {
        let path = d.join("model.safetensors");
        let bytes = std::fs::read(&path).unwrap();
        std::fs::write(&path, &bytes[..bytes.len() - 100]).unwrap();
    });
    assert!(matches!(err, Error::Format { .. }), "{err:?}");

    let (_, err) = broken("garbage", |d| {
        std::fs::write(d.join("model.safetensors"), [0xffu8; 64]).unwrap()
    });
    assert!(matches!(err, Error::Format { .. }), "{err:?}");

    let (_, err) = broken("empty", |d| {
        std::fs::write(d.join("model.safetensors"), []).unwrap()
    });
    assert!(matches!(err, Error::Format { .. }), "{err:?}");
}

#[test]
fn a_tensor_of_the_wrong_shape_or_dtype_is_named() {
    let mut weights = random_weights(5);
    let name = "encoder.layer.1.intermediate.dense.weight";
    weights.insert(
        name.into(),
        (vec![FFN + 1, HIDDEN], vec![0.0; (FFN + 1) * HIDDEN]),
    );
    let dir = temp_dir("shape");
    write_model(&dir, &weights, Dtype::F32, Pooling::Mean, true, 16);
    let err = load(&dir).unwrap_err().to_string();
    assert!(
        err.contains(name) && err.contains("[25, 16]") && err.contains("[24, 16]"),
        "{err}"
    );

    let mut weights = random_weights(5);
    weights.remove("embeddings.LayerNorm.bias");
    let dir = temp_dir("absent");
    write_model(&dir, &weights, Dtype::F32, Pooling::Mean, true, 16);
    let err = load(&dir).unwrap_err().to_string();
    assert!(
        err.contains("missing tensor 'embeddings.LayerNorm.bias'"),
        "{err}"
    );

    // Integer weights are refused by name.
    let dir = temp_dir("dtype");
    write_model(
        &dir,
        &random_weights(5),
        Dtype::F32,
        Pooling::Mean,
        true,
        16,
    );
    let mut ints = random_weights(5);
    ints.retain(|k, _| k == "embeddings.word_embeddings.weight");
    let (dims, values) = &ints["embeddings.word_embeddings.weight"];
    let as_i32: Vec<u8> = values
        .iter()
        .flat_map(|&v| (v as i32).to_le_bytes())
        .collect();
    let mut all: Vec<(String, Vec<usize>, Vec<u8>, Dtype)> = random_weights(5)
        .into_iter()
        .filter(|(k, _)| k != "embeddings.word_embeddings.weight")
        .map(|(k, (d, v))| {
            let b = v.iter().flat_map(|&x| (x as f32).to_le_bytes()).collect();
            (k, d, b, Dtype::F32)
        })
        .collect();
    all.push((
        "embeddings.word_embeddings.weight".into(),
        dims.clone(),
        as_i32,
        Dtype::I32,
    ));
    let views = all.iter().map(|(k, d, b, t)| {
        (
            k.clone(),
            safetensors::tensor::TensorView::new(*t, d.clone(), b).unwrap(),
        )
    });
    std::fs::write(
        dir.join("model.safetensors"),
        safetensors::serialize(views, None).unwrap(),
    )
    .unwrap();
    let err = load(&dir).unwrap_err().to_string();
    assert!(
        err.contains("embeddings.word_embeddings.weight") && err.contains("floating point"),
        "{err}"
    );
}

#[test]
fn checkpoints_with_a_bert_prefix_load() {
    let weights = random_weights(9);
    let dir = temp_dir("prefix");
    write_model(&dir, &weights, Dtype::F32, Pooling::Cls, false, 16);
    std::fs::write(
        dir.join("model.safetensors"),
        safetensors_bytes(&weights, Dtype::F32, "bert."),
    )
    .unwrap();
    let mut embedder = load(&dir).unwrap();
    let tokens = embedder.tokenize(&["a red cat"]).unwrap();
    let got = embedder.embed(&["a red cat"]).unwrap();
    let want = reference(
        &stored(&weights, Dtype::F32),
        &tokens[0].ids,
        Pooling::Cls,
        false,
    );
    assert_close(&got[0], &want, "bert. prefix");
}

/// The kernels of one encoder layer: fused q, k, v projections (one GEMM each, bias in
/// the epilogue), one flash attention reading the heads in place, the output
/// projection with bias and residual, layer norm, the up projection with bias and GELU,
/// the down projection with bias and residual, layer norm. A lost fusion adds kernels
/// and fails this test.
#[test]
fn a_bert_layer_compiles_to_nine_kernels() {
    let weights = random_weights(5);
    let dir = temp_dir("kernels");
    write_model(&dir, &weights, Dtype::F32, Pooling::Mean, true, 32);
    let kernels = |dir: &Path| -> Vec<String> {
        let embedder = load(dir).unwrap();
        let compiled = embedder.compile(2, 16).unwrap();
        compiled.kernels().into_iter().map(|(_, k)| k).collect()
    };
    let two = kernels(&dir);
    // The same model cut to one layer (the second layer's weights go unread).
    let one_layer = config_json().replace(
        &format!("\"num_hidden_layers\": {LAYERS}"),
        "\"num_hidden_layers\": 1",
    );
    assert_ne!(one_layer, config_json());
    std::fs::write(dir.join("config.json"), one_layer).unwrap();
    let one = kernels(&dir);
    assert_eq!(LAYERS, 2);
    let per_layer = two.len() - one.len();
    let count = |ks: &[String], what: &str| ks.iter().filter(|k| k.contains(what)).count();
    assert_eq!(
        per_layer,
        9,
        "one layer:\n{}\ntwo layers:\n{}",
        one.join("\n"),
        two.join("\n")
    );
    assert_eq!(count(&two, "attention") - count(&one, "attention"), 1);
    assert_eq!(
        count(&two, "matmul+epilogue") - count(&one, "matmul+epilogue"),
        6
    );
    assert_eq!(count(&two, "layer_norm") - count(&one, "layer_norm"), 2);
    for k in &two {
        assert!(!k.contains("permute") && !k.contains("softmax"), "{k}");
    }
}

/// Layers computing in half precision (as a GPU runs half checkpoints) stay within
/// half-precision error of the f64 reference on the stored weights, on the CPU and,
/// when there is one, on a GPU; `compute` must be a float type.
#[test]
fn half_precision_compute_matches_the_reference_within_half_tolerance() {
    use rlx_driver::Device;
    let weights = random_weights(11);
    let mut devices = vec![Device::Cpu];
    if rlx_runtime::device_available(Device::Cuda(0)).is_ok() {
        devices.push(Device::Cuda(0));
    } else {
        eprintln!("SKIP half compute on cuda: no usable CUDA device");
    }
    for (dtype, compute) in [
        (Dtype::F16, rlx_ir::DType::F16),
        (Dtype::BF16, rlx_ir::DType::BF16),
    ] {
        let dir = temp_dir("half-compute");
        write_model(&dir, &weights, dtype, Pooling::Mean, false, 32);
        let exact = stored(&weights, dtype);
        for &device in &devices {
            let options = EmbedderOptions {
                store: Some(ModelStore::new(dir.join("cache")).quiet(true)),
                device,
                compute: Some(compute),
                ..EmbedderOptions::default()
            };
            let mut embedder = Embedder::load_with(&dir.to_string_lossy(), options).unwrap();
            let tokens = embedder.tokenize(TEXTS).unwrap();
            let got = embedder.embed(TEXTS).unwrap();
            for (i, t) in tokens.iter().enumerate() {
                let want = reference(&exact, &t.ids, Pooling::Mean, false);
                let scale = want.iter().fold(0f64, |m, v| m.max(v.abs()));
                let err = got[i]
                    .iter()
                    .zip(&want)
                    .fold(0f64, |m, (g, w)| m.max((f64::from(*g) - w).abs()));
                // bf16 keeps 8 bits of mantissa, f16 11: 2e-2 and 4e-3 of the largest
                // value.
                let tol = if compute == rlx_ir::DType::BF16 {
                    2e-2
                } else {
                    4e-3
                };
                assert!(
                    err <= tol * scale,
                    "{compute} on {device}, text {i}: error {err} over {scale}"
                );
            }
        }
        let options = EmbedderOptions {
            store: Some(ModelStore::new(dir.join("cache")).quiet(true)),
            compute: Some(rlx_ir::DType::I32),
            ..EmbedderOptions::default()
        };
        let e = match Embedder::load_with(&dir.to_string_lossy(), options) {
            Ok(mut embedder) => embedder.embed(TEXTS).unwrap_err(),
            Err(e) => e,
        };
        assert!(e.to_string().contains("float"), "{e}");
    }
}
