//! A tiny random Llama written as a Hugging Face checkpoint (config.json +
//! model.safetensors) and as an f32 GGUF file (q/k rows permuted for adjacent rotary
//! pairs, as the GGUF converter does): both load through the same builder and give
//! the logits of a plain f64 forward pass written here from the model's definition.

use rlx_gguf::{GgufBuilder, GgufFile, TensorType, Value};
use rlx_models::llama::{LlamaConfig, LlamaWeights, Llm, LlmOptions};
use safetensors::Dtype;
use safetensors::tensor::TensorView;
use std::collections::BTreeMap;
use std::path::PathBuf;

const VOCAB: usize = 64;
const HIDDEN: usize = 32;
const LAYERS: usize = 2;
const HEADS: usize = 4;
const KV_HEADS: usize = 2;
const HEAD_DIM: usize = 8;
const FFN: usize = 48;
const THETA: f64 = 10_000.0;
const EPS: f64 = 1e-5;

/// HF name -> (rows, cols, values) of every weight, random and deterministic.
fn weights() -> BTreeMap<String, (usize, usize, Vec<f32>)> {
    let mut state = 0x1234_5678u64;
    let mut random = |rows: usize, cols: usize, scale: f32| {
        let values: Vec<f32> = (0..rows * cols)
            .map(|_| {
                state = state
                    .wrapping_mul(6364136223846793005)
                    .wrapping_add(1442695040888963407);
                ((state >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale
            })
            .collect();
        (rows, cols, values)
    };
    let mut w = BTreeMap::new();
    w.insert(
        "model.embed_tokens.weight".into(),
        random(VOCAB, HIDDEN, 1.0),
    );
    w.insert("model.norm.weight".into(), random(1, HIDDEN, 0.5));
    for l in 0..LAYERS {
        let p = |s: &str| format!("model.layers.{l}.{s}.weight");
        let s = 0.3;
        w.insert(p("input_layernorm"), random(1, HIDDEN, 1.0));
        w.insert(p("post_attention_layernorm"), random(1, HIDDEN, 1.0));
        w.insert(p("self_attn.q_proj"), random(HEADS * HEAD_DIM, HIDDEN, s));
        w.insert(
            p("self_attn.k_proj"),
            random(KV_HEADS * HEAD_DIM, HIDDEN, s),
        );
        w.insert(
            p("self_attn.v_proj"),
            random(KV_HEADS * HEAD_DIM, HIDDEN, s),
        );
        w.insert(p("self_attn.o_proj"), random(HIDDEN, HEADS * HEAD_DIM, s));
        w.insert(p("mlp.gate_proj"), random(FFN, HIDDEN, s));
        w.insert(p("mlp.up_proj"), random(FFN, HIDDEN, s));
        w.insert(p("mlp.down_proj"), random(HIDDEN, FFN, s));
    }
    // Norm weights near 1 keep activations in range.
    for (name, (_, _, v)) in w.iter_mut() {
        if name.ends_with("norm.weight") {
            v.iter_mut().for_each(|x| *x = 1.0 + 0.2 * *x);
        }
    }
    w
}

fn matvec(w: &(usize, usize, Vec<f32>), x: &[f64]) -> Vec<f64> {
    let (rows, cols, v) = w;
    (0..*rows)
        .map(|r| (0..*cols).map(|c| f64::from(v[r * cols + c]) * x[c]).sum())
        .collect()
}

fn rms_norm(x: &[f64], w: &[f32]) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let inv = 1.0 / (ms + EPS).sqrt();
    x.iter()
        .zip(w)
        .map(|(v, g)| v * inv * f64::from(*g))
        .collect()
}

/// "Rotate half" rotary embedding of one head at position `p`.
fn rope(head: &mut [f64], p: usize) {
    let half = HEAD_DIM / 2;
    for i in 0..half {
        let angle = p as f64 * THETA.powf(-((2 * i) as f64) / HEAD_DIM as f64);
        let (a, b) = (head[i], head[i + half]);
        head[i] = a * angle.cos() - b * angle.sin();
        head[i + half] = a * angle.sin() + b * angle.cos();
    }
}

/// Logits at every position, in f64, straight from the definition.
fn reference(w: &BTreeMap<String, (usize, usize, Vec<f32>)>, ids: &[u32]) -> Vec<Vec<f64>> {
    let embed = &w["model.embed_tokens.weight"].2;
    let mut xs: Vec<Vec<f64>> = ids
        .iter()
        .map(|&t| {
            (0..HIDDEN)
                .map(|c| f64::from(embed[t as usize * HIDDEN + c]))
                .collect()
        })
        .collect();
    for l in 0..LAYERS {
        let g = |s: &str| &w[&format!("model.layers.{l}.{s}.weight")];
        let (mut qs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
        for (p, x) in xs.iter().enumerate() {
            let h = rms_norm(x, &g("input_layernorm").2);
            let (mut q, mut k) = (
                matvec(g("self_attn.q_proj"), &h),
                matvec(g("self_attn.k_proj"), &h),
            );
            q.chunks_exact_mut(HEAD_DIM).for_each(|head| rope(head, p));
            k.chunks_exact_mut(HEAD_DIM).for_each(|head| rope(head, p));
            qs.push(q);
            ks.push(k);
            vs.push(matvec(g("self_attn.v_proj"), &h));
        }
        for i in 0..xs.len() {
            let mut att = vec![0.0; HEADS * HEAD_DIM];
            for h in 0..HEADS {
                let kh = h / (HEADS / KV_HEADS);
                let dot = |j: usize| {
                    (0..HEAD_DIM)
                        .map(|e| qs[i][h * HEAD_DIM + e] * ks[j][kh * HEAD_DIM + e])
                        .sum::<f64>()
                        / (HEAD_DIM as f64).sqrt()
                };
                let scores: Vec<f64> = (0..=i).map(dot).collect();
                let max = scores.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = scores.iter().map(|s| (s - max).exp()).collect();
                let total: f64 = e.iter().sum();
                for (j, wj) in e.iter().enumerate() {
                    for d in 0..HEAD_DIM {
                        att[h * HEAD_DIM + d] += wj / total * vs[j][kh * HEAD_DIM + d];
                    }
                }
            }
            let o = matvec(g("self_attn.o_proj"), &att);
            xs[i].iter_mut().zip(o).for_each(|(x, o)| *x += o);
            let h = rms_norm(&xs[i], &g("post_attention_layernorm").2);
            let gate = matvec(g("mlp.gate_proj"), &h);
            let up = matvec(g("mlp.up_proj"), &h);
            let act: Vec<f64> = gate
                .iter()
                .zip(&up)
                .map(|(a, b)| a / (1.0 + (-a).exp()) * b)
                .collect();
            let down = matvec(g("mlp.down_proj"), &act);
            xs[i].iter_mut().zip(down).for_each(|(x, d)| *x += d);
        }
    }
    let head = &w["model.embed_tokens.weight"];
    xs.iter()
        .map(|x| matvec(head, &rms_norm(x, &w["model.norm.weight"].2)))
        .collect()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn write_hf(dir: &PathBuf, w: &BTreeMap<String, (usize, usize, Vec<f32>)>) {
    write_hf_as(dir, w, Dtype::F32);
}

/// Every weight rounded to bfloat16.
fn rounded_to_bf16(
    w: &BTreeMap<String, (usize, usize, Vec<f32>)>,
) -> BTreeMap<String, (usize, usize, Vec<f32>)> {
    w.iter()
        .map(|(n, (r, c, v))| {
            let v = v
                .iter()
                .map(|&x| half::bf16::from_f32(x).to_f32())
                .collect();
            (n.clone(), (*r, *c, v))
        })
        .collect()
}

/// The checkpoint with its tensors stored as `dtype` (`F32` or `BF16`).
fn write_hf_as(dir: &PathBuf, w: &BTreeMap<String, (usize, usize, Vec<f32>)>, dtype: Dtype) {
    std::fs::create_dir_all(dir).unwrap();
    let config = serde_json::json!({
        "architectures": ["LlamaForCausalLM"],
        "vocab_size": VOCAB, "hidden_size": HIDDEN, "num_hidden_layers": LAYERS,
        "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
        "intermediate_size": FFN, "rope_theta": THETA, "rms_norm_eps": EPS,
        "max_position_embeddings": 64, "tie_word_embeddings": true
    });
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    let bytes: BTreeMap<String, (Vec<usize>, Vec<u8>)> = w
        .iter()
        .map(|(n, (r, c, v))| {
            let dims = if *r == 1 { vec![*c] } else { vec![*r, *c] };
            let b = if dtype == Dtype::BF16 {
                v.iter()
                    .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes())
                    .collect()
            } else {
                f32_bytes(v)
            };
            (n.clone(), (dims, b))
        })
        .collect();
    let views: Vec<(String, TensorView<'_>)> = bytes
        .iter()
        .map(|(n, (dims, b))| (n.clone(), TensorView::new(dtype, dims.clone(), b).unwrap()))
        .collect();
    safetensors::serialize_to_file(views, None, &dir.join("model.safetensors")).unwrap();
}

/// The GGUF image of the same model: GGUF names, ggml dimension order, and q/k rows
/// permuted from "rotate half" to adjacent pairs.
fn gguf_image(w: &BTreeMap<String, (usize, usize, Vec<f32>)>) -> Vec<u8> {
    let permute = |v: &[f32], heads: usize| -> Vec<f32> {
        let mut out = vec![0f32; v.len()];
        let half = HEAD_DIM / 2;
        for h in 0..heads {
            for j in 0..half {
                for t in 0..2 {
                    let (dst, src) = (h * HEAD_DIM + 2 * j + t, h * HEAD_DIM + t * half + j);
                    out[dst * HIDDEN..(dst + 1) * HIDDEN]
                        .copy_from_slice(&v[src * HIDDEN..(src + 1) * HIDDEN]);
                }
            }
        }
        out
    };
    let mut b = GgufBuilder::new();
    let u = |v: usize| Value::U32(v as u32);
    b.metadata("general.architecture", Value::String("llama".into()))
        .metadata("llama.block_count", u(LAYERS))
        .metadata("llama.context_length", u(64))
        .metadata("llama.embedding_length", u(HIDDEN))
        .metadata("llama.feed_forward_length", u(FFN))
        .metadata("llama.attention.head_count", u(HEADS))
        .metadata("llama.attention.head_count_kv", u(KV_HEADS))
        .metadata("llama.rope.freq_base", Value::F32(THETA as f32))
        .metadata(
            "llama.attention.layer_norm_rms_epsilon",
            Value::F32(EPS as f32),
        )
        .metadata("llama.vocab_size", u(VOCAB));
    let mut add = |name: &str, hf: &str, permute_heads: Option<usize>| {
        let (r, c, v) = &w[hf];
        let v = permute_heads.map_or_else(|| v.clone(), |h| permute(v, h));
        let dims = if *r == 1 { vec![*c] } else { vec![*c, *r] };
        b.tensor(name, &dims, TensorType::F32, f32_bytes(&v))
            .unwrap();
    };
    add("token_embd.weight", "model.embed_tokens.weight", None);
    add("output_norm.weight", "model.norm.weight", None);
    for l in 0..LAYERS {
        let hf = |s: &str| format!("model.layers.{l}.{s}.weight");
        let gg = |s: &str| format!("blk.{l}.{s}.weight");
        add(&gg("attn_norm"), &hf("input_layernorm"), None);
        add(&gg("ffn_norm"), &hf("post_attention_layernorm"), None);
        add(&gg("attn_q"), &hf("self_attn.q_proj"), Some(HEADS));
        add(&gg("attn_k"), &hf("self_attn.k_proj"), Some(KV_HEADS));
        add(&gg("attn_v"), &hf("self_attn.v_proj"), None);
        add(&gg("attn_output"), &hf("self_attn.o_proj"), None);
        add(&gg("ffn_gate"), &hf("mlp.gate_proj"), None);
        add(&gg("ffn_up"), &hf("mlp.up_proj"), None);
        add(&gg("ffn_down"), &hf("mlp.down_proj"), None);
    }
    b.to_bytes()
}

fn assert_close(what: &str, got: &[Vec<f32>], want: &[Vec<f64>]) {
    assert_eq!(got.len(), want.len(), "{what}: rows");
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        for (j, (a, b)) in g.iter().zip(w).enumerate() {
            assert!(
                (f64::from(*a) - b).abs() <= 1e-4 * (1.0 + b.abs()),
                "{what}: position {i} token {j}: {a} vs {b}"
            );
        }
    }
}

#[test]
fn hugging_face_and_gguf_checkpoints_match_the_definition() {
    let w = weights();
    let ids = [3u32, 17, 42, 5, 9, 60, 1, 33, 8];
    let want = reference(&w, &ids);
    let options = || LlmOptions {
        max_context: 32,
        ..LlmOptions::default()
    };

    let dir = std::env::temp_dir().join(format!("rlx-tiny-llama-{}", std::process::id()));
    write_hf(&dir, &w);
    let mut hf = Llm::load_with(dir.to_str().unwrap(), options()).unwrap();
    assert!(
        hf.tokenizer().is_err(),
        "a safetensors checkpoint has no tokenizer"
    );
    assert_close("hf", &hf.logits_all(&ids).unwrap(), &want);
    // Decoding through the cache gives the same last-position logits.
    hf.reset();
    hf.prefill(&ids[..4]).unwrap();
    let mut last = Vec::new();
    for &t in &ids[4..] {
        last = hf.step(t).unwrap();
    }
    assert_close("hf cached", &[last], &want[ids.len() - 1..]);
    std::fs::remove_dir_all(&dir).ok();

    let file = GgufFile::from_bytes("tiny.gguf", gguf_image(&w)).unwrap();
    let config = LlamaConfig::from_gguf(&file).unwrap();
    let weights = LlamaWeights::from_gguf(file, &config).unwrap();
    let mut gguf = Llm::from_parts("tiny.gguf".into(), config, weights, None, options()).unwrap();
    assert_close("gguf", &gguf.logits_all(&ids).unwrap(), &want);
}

#[test]
fn a_bfloat16_checkpoint_keeps_its_linear_weights_as_stored() {
    let w = rounded_to_bf16(&weights());
    let ids = [3u32, 17, 42, 5, 9, 60, 1];
    let want = reference(&w, &ids);
    let dir = std::env::temp_dir().join(format!("rlx-tiny-llama-bf16-{}", std::process::id()));
    write_hf_as(&dir, &w, Dtype::BF16);
    let config = LlamaConfig::from_hf_json(&dir.join("config.json")).unwrap();
    let weights = LlamaWeights::from_safetensors(&dir.join("model.safetensors"), &config).unwrap();
    let dtype = |name: &str| weights.entry(name).unwrap().shape.dtype();
    assert_eq!(dtype("blk.1.ffn_down.weight"), rlx_ir::DType::BF16);
    assert_eq!(dtype("output.weight"), rlx_ir::DType::BF16);
    assert_eq!(dtype("blk.0.attn_norm.weight"), rlx_ir::DType::F32);
    let mut llm = Llm::load_with(
        dir.to_str().unwrap(),
        LlmOptions {
            max_context: 32,
            ..LlmOptions::default()
        },
    )
    .unwrap();
    assert_close("bf16 hf", &llm.logits_all(&ids).unwrap(), &want);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn a_checkpoint_with_a_wrong_shape_is_a_named_error() {
    let mut w = weights();
    w.get_mut("model.layers.1.mlp.up_proj.weight").unwrap().0 = FFN - 1;
    let v = &mut w.get_mut("model.layers.1.mlp.up_proj.weight").unwrap().2;
    v.truncate((FFN - 1) * HIDDEN);
    let dir = std::env::temp_dir().join(format!("rlx-bad-llama-{}", std::process::id()));
    write_hf(&dir, &w);
    let e = Llm::load(dir.to_str().unwrap()).unwrap_err().to_string();
    std::fs::remove_dir_all(&dir).ok();
    assert!(e.contains("model.layers.1.mlp.up_proj.weight"), "{e}");
}

/// A checkpoint written as GGUF by `write_gguf` loads (without a tokenizer) and
/// gives the definition's logits: exactly as f32, within half-precision error as f16;
/// Q8_0 needs rows of whole 32-value blocks, and an error names the tensor that has
/// none (this model's down projection reads 48 values a row).
#[test]
fn a_checkpoint_written_as_gguf_gives_the_same_logits() {
    use rlx_models::llama::{GgufWeights, write_gguf};
    let w = weights();
    let ids = [3u32, 17, 42, 5, 9, 60, 1];
    let want = reference(&w, &ids);
    let dir = std::env::temp_dir().join(format!("rlx-tiny-llama-gguf-{}", std::process::id()));
    write_hf(&dir, &w);
    let options = || LlmOptions {
        max_context: 32,
        ..LlmOptions::default()
    };
    let out = dir.join("tiny-f32.gguf");
    write_gguf(&dir, &out, GgufWeights::F32).unwrap();
    let mut llm = Llm::load_with(out.to_str().unwrap(), options()).unwrap();
    assert!(
        llm.tokenizer().is_err(),
        "the written file has no tokenizer"
    );
    assert_close("gguf f32", &llm.logits_all(&ids).unwrap(), &want);

    let out = dir.join("tiny-f16.gguf");
    write_gguf(&dir, &out, GgufWeights::F16).unwrap();
    let mut llm = Llm::load_with(out.to_str().unwrap(), options()).unwrap();
    let got = llm.logits_all(&ids).unwrap();
    let scale = want.iter().flatten().fold(0f64, |m, v| m.max(v.abs()));
    let err = got
        .iter()
        .flatten()
        .zip(want.iter().flatten())
        .fold(0f64, |m, (a, b)| m.max((f64::from(*a) - b).abs()));
    assert!(err <= 2e-3 * scale, "f16 weights: error {err} over {scale}");

    let e = write_gguf(&dir, &dir.join("tiny-q8.gguf"), GgufWeights::Q8_0).unwrap_err();
    assert!(e.to_string().contains("mlp.down_proj"), "{e}");
    assert!(
        !dir.join("tiny-q8.gguf").exists(),
        "nothing written on error"
    );
    let e = write_gguf(&dir.join("missing"), &dir.join("x.gguf"), GgufWeights::F32).unwrap_err();
    assert!(e.to_string().contains("config.json"), "{e}");
    std::fs::remove_dir_all(&dir).ok();
}
