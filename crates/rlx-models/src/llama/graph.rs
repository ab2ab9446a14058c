//! The Llama forward graph over a persistent key/value cache.
//!
//! One graph processes `seq` new tokens starting at the run-time position `pos`:
//!
//! ```text
//! tokens [S] ─ embed ─┬─ rms_norm ─ q,k,v ─ rope ─ write k,v into the cache at pos
//!                     │             ─ cached attention (causal over rows 0..pos+S)
//!                     │             ─ o_proj ─ + ─ rms_norm ─ SwiGLU ─ + ─ … × layers
//!                     └───────────────────────┘                  …
//! rms_norm ─ gather rows `logit_rows` ─ output head ─ logits [R, vocab]
//! ```
//!
//! Inputs: `tokens` (i64 `[S]`), `pos` (i64 `[1]`), `logit_rows` (i64 `[R]`: which of
//! the `S` positions get logits). Persistent handles `k_cache.{l}` and `v_cache.{l}`
//! (f32 `[1, max_seq, kv_heads, head_dim]`) are written in place. Params: the
//! weights (GGUF names) and the rotary tables `rope.cos` / `rope.sin`
//! (`[max_seq, head_dim / 2]`).

use super::config::LlamaConfig;
use super::weights::LlamaWeights;
use rlx_driver::BufferHandle;
use rlx_ir::{DType, Dim, Graph, NodeId, Result, Shape, SymbolicShape};
use rlx_runtime::{SymbolRange, SymbolicGraph};
use std::sync::Arc;

/// Name of the key cache handle of layer `l`.
pub fn k_cache_name(l: usize) -> String {
    format!("k_cache.{l}")
}

/// Name of the value cache handle of layer `l`.
pub fn v_cache_name(l: usize) -> String {
    format!("v_cache.{l}")
}

/// The persistent handles a graph for `config` with a cache of `max_seq` rows binds.
pub fn cache_handles(config: &LlamaConfig, max_seq: usize) -> Vec<BufferHandle> {
    let dims = [1, max_seq, config.kv_heads, config.head_dim];
    (0..config.layers)
        .flat_map(|l| {
            [
                BufferHandle::new(k_cache_name(l), &dims, DType::F32),
                BufferHandle::new(v_cache_name(l), &dims, DType::F32),
            ]
        })
        .collect()
}

/// The forward graph as a [`SymbolicGraph`] over `seq` (new tokens) and `rows`
/// (positions that get logits), both `1..=max_seq`, with a cache of `max_seq` rows:
/// inputs `tokens i64[seq]`, `pos i64[1]`, `logit_rows i64[rows]` and the cache
/// handles; output `f32[rows, vocab]`.
pub fn symbolic_graph(
    config: &LlamaConfig,
    weights: Arc<LlamaWeights>,
    max_seq: usize,
) -> Result<SymbolicGraph> {
    let mut inputs = vec![
        (
            "tokens".to_string(),
            SymbolicShape::new([Dim::sym("seq")], DType::I64),
        ),
        (
            "pos".into(),
            SymbolicShape::new([Dim::Fixed(1)], DType::I64),
        ),
        (
            "logit_rows".into(),
            SymbolicShape::new([Dim::sym("rows")], DType::I64),
        ),
    ];
    for h in cache_handles(config, max_seq) {
        inputs.push((h.name.clone(), SymbolicShape::from(&h.shape)));
    }
    let config = config.clone();
    SymbolicGraph::new(
        "llama",
        vec![
            SymbolRange::new("seq", 1, max_seq),
            SymbolRange::new("rows", 1, max_seq),
        ],
        inputs,
        vec![SymbolicShape::new(
            [Dim::sym("rows"), Dim::Fixed(config.vocab_size)],
            DType::F32,
        )],
        move |b| {
            build_graph(
                &config,
                &weights,
                b.require("seq", "llama")?,
                max_seq,
                b.require("rows", "llama")?,
            )
        },
    )
}

/// The rotary tables for positions `0..max_seq`: `(cos, sin)`, each
/// `[max_seq, head_dim / 2]`. Frequencies and angles are formed in `f32` (as the
/// reference implementations do), the cosine and sine in `f64`.
pub fn rope_tables(config: &LlamaConfig, max_seq: usize) -> (Vec<f32>, Vec<f32>) {
    let half = config.head_dim / 2;
    let inv_freq: Vec<f32> = (0..half)
        .map(|i| {
            let exponent = (2 * i) as f32 / config.head_dim as f32;
            1.0 / (config.rope_base as f32).powf(exponent)
        })
        .collect();
    let mut cos = Vec::with_capacity(max_seq * half);
    let mut sin = Vec::with_capacity(max_seq * half);
    for p in 0..max_seq {
        for &f in &inv_freq {
            let angle = f64::from(p as f32 * f);
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

/// Adds `x @ W^T` for the linear weight `name` (packed rows or a dense `[K, N]`).
fn linear(g: &Graph, weights: &LlamaWeights, x: NodeId, name: &str) -> Result<NodeId> {
    let entry = weights.entry(name)?;
    let w = g.param(name, entry.shape.clone())?;
    match entry.format {
        Some(format) => g.quant_matmul(x, w, format),
        // Half-precision weights are widened for the product (the optimizer folds
        // the cast into a fused product that reads them as stored).
        None if entry.shape.dtype() != DType::F32 => g.matmul(x, g.cast(w, DType::F32)?),
        None => g.matmul(x, w),
    }
}

/// Builds the graph for `seq` new tokens, a cache of `max_seq` rows, and logits for
/// `logit_rows` of the positions.
pub fn build_graph(
    config: &LlamaConfig,
    weights: &LlamaWeights,
    seq: usize,
    max_seq: usize,
    logit_rows: usize,
) -> Result<Graph> {
    let c = config;
    let g = Graph::new(format!("llama_s{seq}"));
    let tokens = g.input("tokens", Shape::new(&[seq], DType::I64))?;
    let pos = g.input("pos", Shape::new(&[1], DType::I64))?;
    let rows = g.input("logit_rows", Shape::new(&[logit_rows], DType::I64))?;
    let half = c.head_dim / 2;

    // Token embedding: packed rows are gathered, then decoded.
    let embd = weights.entry("token_embd.weight")?;
    let table = g.param("token_embd.weight", embd.shape.clone())?;
    let picked = g.gather(table, tokens, 0)?;
    let mut x = match embd.format {
        Some(format) => g.dequantize(picked, format)?,
        None => picked,
    };

    // Rotary tables for positions pos .. pos + seq, shaped to broadcast over heads.
    let positions = g.add(
        g.range(0.0, seq as f64, 1.0, DType::I64)?,
        g.reshape(pos, &[1])?,
    )?;
    let table_shape = Shape::new(&[max_seq, half], DType::F32);
    let rope = |name: &str| -> Result<NodeId> {
        let t = g.param(name, table_shape.clone())?;
        g.reshape(g.gather(t, positions, 0)?, &[1, seq, 1, half])
    };
    let (cos, sin) = (rope("rope.cos")?, rope("rope.sin")?);

    let eps = c.rms_eps;
    for l in 0..c.layers {
        let p = |s: &str| format!("blk.{l}.{s}.weight");
        let norm_w = |s: &str| g.param(p(s), Shape::new(&[c.hidden], DType::F32));
        let h = g.rms_norm(x, norm_w("attn_norm")?, eps)?;
        let q = g.reshape(
            linear(&g, weights, h, &p("attn_q"))?,
            &[1, seq, c.heads, c.head_dim],
        )?;
        let k = g.reshape(
            linear(&g, weights, h, &p("attn_k"))?,
            &[1, seq, c.kv_heads, c.head_dim],
        )?;
        let v = g.reshape(
            linear(&g, weights, h, &p("attn_v"))?,
            &[1, seq, c.kv_heads, c.head_dim],
        )?;
        let q = g.rope(q, cos, sin, c.rope_style)?;
        let k = g.rope(k, cos, sin, c.rope_style)?;
        let cache_shape = Shape::new(&[1, max_seq, c.kv_heads, c.head_dim], DType::F32);
        let k_cache = g.input(k_cache_name(l), cache_shape.clone())?;
        let v_cache = g.input(v_cache_name(l), cache_shape)?;
        let k_all = g.write_at(k_cache, k, pos, 1)?;
        let v_all = g.write_at(v_cache, v, pos, 1)?;
        let att = g.cached_attention(q, k_all, v_all, pos, None)?;
        let att = g.reshape(att, &[seq, c.q_width()])?;
        x = g.add(x, linear(&g, weights, att, &p("attn_output"))?)?;

        let h = g.rms_norm(x, norm_w("ffn_norm")?, eps)?;
        let gate = linear(&g, weights, h, &p("ffn_gate"))?;
        let up = linear(&g, weights, h, &p("ffn_up"))?;
        let act = g.mul(g.silu(gate)?, up)?;
        x = g.add(x, linear(&g, weights, act, &p("ffn_down"))?)?;
    }
    let final_norm = g.param("output_norm.weight", Shape::new(&[c.hidden], DType::F32))?;
    let last = g.gather(x, rows, 0)?;
    let h = g.rms_norm(last, final_norm, eps)?;
    let logits = if weights.has_output_head() {
        linear(&g, weights, h, "output.weight")?
    } else {
        // Without a separate head, packed embedding rows serve as the head directly
        // (dense embeddings get a transposed `output.weight` at load).
        let format = embd.format.ok_or_else(|| {
            rlx_ir::Error::invalid("llama", "a dense tied embedding needs output.weight")
        })?;
        g.quant_matmul(h, table, format)?
    };
    g.set_outputs(vec![logits]);
    Ok(g)
}
