//! The BERT encoder with its sentence-embedding head, as one RLX graph for one
//! `[batch, seq]` shape.
//!
//! Inputs: `input_ids`, `token_type_ids` and `attention_mask`, all `i64 [batch, seq]`
//! (mask 1 for real tokens, 0 for padding). Output: `embeddings`, `f32 [batch, hidden]`,
//! pooled over the masked tokens and normalized when the model says so.
//!
//! Params carry the checkpoint's tensor names. Linear weights are stored transposed,
//! `[in, out]`, so the graph multiplies `x @ W` directly; every param keeps the
//! checkpoint's dtype and is cast to `f32` in the graph when it is not `f32`.

use super::config::{Activation, BertConfig, Pooling, SentenceConfig};
use rlx_ir::{DType, Dim, Graph, NodeId, Result, Shape, SymbolicShape};
use rlx_runtime::{SymbolRange, SymbolicGraph};
use std::collections::HashMap;

/// A weight the encoder needs: its checkpoint name, the shape it has in the
/// checkpoint, and whether the graph holds it transposed.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct WeightSpec {
    /// The tensor's name in the checkpoint (without any `bert.` prefix).
    pub name: String,
    /// Its dimensions in the checkpoint.
    pub dims: Vec<usize>,
    /// True for linear weights: the checkpoint's `[out, in]` becomes `[in, out]`.
    pub transposed: bool,
}

impl WeightSpec {
    /// The dimensions of the param in the graph.
    pub fn param_dims(&self) -> Vec<usize> {
        if self.transposed {
            vec![self.dims[1], self.dims[0]]
        } else {
            self.dims.clone()
        }
    }
}

fn spec(name: String, dims: &[usize], transposed: bool) -> WeightSpec {
    WeightSpec {
        name,
        dims: dims.to_vec(),
        transposed,
    }
}

/// Every weight the encoder reads, in a fixed order.
pub fn weight_specs(c: &BertConfig) -> Vec<WeightSpec> {
    let (h, f) = (c.hidden_size, c.intermediate_size);
    let mut specs = vec![
        spec(
            "embeddings.word_embeddings.weight".into(),
            &[c.vocab_size, h],
            false,
        ),
        spec(
            "embeddings.position_embeddings.weight".into(),
            &[c.max_position_embeddings, h],
            false,
        ),
        spec(
            "embeddings.token_type_embeddings.weight".into(),
            &[c.type_vocab_size, h],
            false,
        ),
        spec("embeddings.LayerNorm.weight".into(), &[h], false),
        spec("embeddings.LayerNorm.bias".into(), &[h], false),
    ];
    for l in 0..c.num_layers {
        let p = format!("encoder.layer.{l}");
        let linears = [
            (format!("{p}.attention.self.query"), h, h),
            (format!("{p}.attention.self.key"), h, h),
            (format!("{p}.attention.self.value"), h, h),
            (format!("{p}.attention.output.dense"), h, h),
            (format!("{p}.intermediate.dense"), f, h),
            (format!("{p}.output.dense"), h, f),
        ];
        for (name, out, inp) in linears {
            specs.push(spec(format!("{name}.weight"), &[out, inp], true));
            specs.push(spec(format!("{name}.bias"), &[out], false));
        }
        for norm in ["attention.output.LayerNorm", "output.LayerNorm"] {
            specs.push(spec(format!("{p}.{norm}.weight"), &[h], false));
            specs.push(spec(format!("{p}.{norm}.bias"), &[h], false));
        }
    }
    specs
}

/// Builds the encoder graph for `batch` texts of `seq` tokens. `dtype_of` gives the
/// stored dtype of each weight (by checkpoint name); it must be a float type. The
/// layers compute in `compute` (`f32`, or a half type: see [`compute_dtype`]); the
/// head and the output are `f32` either way.
pub fn build_encoder(
    config: &BertConfig,
    head: &SentenceConfig,
    batch: usize,
    seq: usize,
    dtype_of: &dyn Fn(&str) -> DType,
    compute: DType,
) -> Result<Graph> {
    let (g, x, mask, keep) = encoder_layers(config, batch, seq, dtype_of, compute)?;
    let pooled = pool(&g, x, mask, keep, head.pooling, batch, seq)?;
    let out = if head.normalize {
        // x / max(||x||, 1e-12), as torch.nn.functional.normalize.
        let norm = g.sqrt(g.sum(g.mul(pooled, pooled)?, &[-1], true)?)?;
        g.div(pooled, g.maximum(norm, g.scalar(1e-12, DType::F32))?)?
    } else {
        pooled
    };
    g.set_outputs(vec![out]);
    Ok(g)
}

/// The encoder without the sentence head: the last hidden state, `f32 [batch, seq,
/// hidden]`, of `batch` texts of `seq` tokens (inputs as [`build_encoder`]'s).
pub fn build_hidden_states(
    config: &BertConfig,
    batch: usize,
    seq: usize,
    dtype_of: &dyn Fn(&str) -> DType,
    compute: DType,
) -> Result<Graph> {
    let (g, x, _, _) = encoder_layers(config, batch, seq, dtype_of, compute)?;
    g.set_outputs(vec![x]);
    Ok(g)
}

/// The embeddings and every layer: the graph, the last hidden state (`f32`), the
/// mask input and the mask as bool.
fn encoder_layers(
    config: &BertConfig,
    batch: usize,
    seq: usize,
    dtype_of: &dyn Fn(&str) -> DType,
    compute: DType,
) -> Result<(Graph, NodeId, NodeId, NodeId)> {
    if !compute.is_float() {
        return Err(rlx_ir::Error::dtype(
            "bert encoder",
            "a float type",
            compute,
        ));
    }
    if seq == 0 || seq > config.max_position_embeddings || batch == 0 {
        return Err(rlx_ir::Error::invalid(
            "bert encoder",
            format!(
                "shape [{batch}, {seq}] is out of range (batch >= 1, 1 <= seq <= {})",
                config.max_position_embeddings
            ),
        ));
    }
    let g = Graph::new(format!("bert[{batch}x{seq}]"));
    let b = Builder {
        g: &g,
        config,
        dtype_of,
        compute,
    };
    let (h, heads, hd) = (config.hidden_size, config.num_heads, config.head_dim());
    let ids_shape = Shape::new(&[batch, seq], DType::I64);
    let ids = g.input("input_ids", ids_shape.clone())?;
    let types = g.input("token_type_ids", ids_shape.clone())?;
    let mask = g.input("attention_mask", ids_shape)?;

    // Embeddings: word + position + token type, then LayerNorm.
    let words = g.gather(
        b.weight("embeddings.word_embeddings.weight", &[config.vocab_size, h])?,
        ids,
        0,
    )?;
    let positions = g.slice(
        b.weight(
            "embeddings.position_embeddings.weight",
            &[config.max_position_embeddings, h],
        )?,
        0,
        0,
        seq as isize,
        1,
    )?;
    let type_rows = g.gather(
        b.weight(
            "embeddings.token_type_embeddings.weight",
            &[config.type_vocab_size, h],
        )?,
        types,
        0,
    )?;
    let summed = g.add(g.add(words, positions)?, type_rows)?;
    let mut x = b.layer_norm(summed, "embeddings.LayerNorm")?;

    // Padding mask for attention: [batch, 1, 1, seq], true where a key is real.
    let keep = g.cast(mask, DType::Bool)?;
    let key_mask = g.reshape(keep, &[batch, 1, 1, seq])?;
    for l in 0..config.num_layers {
        let p = format!("encoder.layer.{l}");
        let split_heads = |t: NodeId| -> Result<NodeId> {
            g.permute(g.reshape(t, &[batch, seq, heads, hd])?, &[0, 2, 1, 3])
        };
        let q = split_heads(b.linear(x, &format!("{p}.attention.self.query"), h, h)?)?;
        let k = split_heads(b.linear(x, &format!("{p}.attention.self.key"), h, h)?)?;
        let v = split_heads(b.linear(x, &format!("{p}.attention.self.value"), h, h)?)?;
        let ctx = g.attention(q, k, v, Some(key_mask), false, None)?;
        let ctx = g.reshape(g.permute(ctx, &[0, 2, 1, 3])?, &[batch, seq, h])?;
        let attn_out = b.linear(ctx, &format!("{p}.attention.output.dense"), h, h)?;
        x = b.layer_norm(
            g.add(attn_out, x)?,
            &format!("{p}.attention.output.LayerNorm"),
        )?;
        let f = config.intermediate_size;
        let up = b.linear(x, &format!("{p}.intermediate.dense"), h, f)?;
        let act = match config.activation {
            Activation::Gelu => g.gelu(up)?,
            Activation::GeluTanh => g.gelu_tanh(up)?,
            Activation::Relu => g.relu(up)?,
        };
        let down = b.linear(act, &format!("{p}.output.dense"), f, h)?;
        x = b.layer_norm(g.add(down, x)?, &format!("{p}.output.LayerNorm"))?;
    }
    if compute != DType::F32 {
        x = g.cast(x, DType::F32)?;
    }
    Ok((g, x, mask, keep))
}

/// The encoder as a [`SymbolicGraph`] over `batch` (`1..=max_batch`) and `seq` (up to
/// the longest text the model takes): inputs `i64 [batch, seq]`, output
/// `f32 [batch, hidden]`. `dtypes` gives each weight's dtype (`f32` when absent).
pub fn symbolic_encoder(
    config: &BertConfig,
    head: &SentenceConfig,
    max_batch: usize,
    dtypes: HashMap<String, DType>,
    compute: DType,
) -> Result<SymbolicGraph> {
    let ids = || SymbolicShape::new([Dim::sym("batch"), Dim::sym("seq")], DType::I64);
    let max_seq = head.max_seq_length.min(config.max_position_embeddings);
    let (config, head) = (config.clone(), *head);
    SymbolicGraph::new(
        "bert",
        vec![
            SymbolRange::new("batch", 1, max_batch.max(1)),
            SymbolRange::new("seq", 1, max_seq.max(1)),
        ],
        vec![
            ("input_ids".into(), ids()),
            ("token_type_ids".into(), ids()),
            ("attention_mask".into(), ids()),
        ],
        vec![SymbolicShape::new(
            [Dim::sym("batch"), Dim::Fixed(config.hidden_size)],
            DType::F32,
        )],
        move |b| {
            build_encoder(
                &config,
                &head,
                b.require("batch", "bert")?,
                b.require("seq", "bert")?,
                &|n| dtypes.get(n).copied().unwrap_or(DType::F32),
                compute,
            )
        },
    )
}

/// Pools `x [batch, seq, hidden]` into `[batch, hidden]` over the real tokens.
fn pool(
    g: &Graph,
    x: NodeId,
    mask: NodeId,
    keep: NodeId,
    pooling: Pooling,
    batch: usize,
    seq: usize,
) -> Result<NodeId> {
    match pooling {
        Pooling::Mean => {
            let weights = g.reshape(g.cast(mask, DType::F32)?, &[batch, seq, 1])?;
            let total = g.sum(g.mul(x, weights)?, &[1], false)?;
            let count = g.sum(weights, &[1], false)?;
            // At least 1e-9, as sentence-transformers clamps the token count.
            g.div(total, g.maximum(count, g.scalar(1e-9, DType::F32))?)
        }
        Pooling::Cls => g.squeeze(g.slice(x, 1, 0, 1, 1)?, &[1]),
        Pooling::Max => {
            // Padding positions become -1e9 before the maximum, as sentence-transformers.
            let keep = g.reshape(keep, &[batch, seq, 1])?;
            let masked = g.select(keep, x, g.scalar(-1e9, DType::F32))?;
            g.reduce_max(masked, &[1], false)
        }
    }
}

/// The dtype the encoder's layers compute in: a GPU computes in the weights' half
/// type when every weight is stored in it (as PyTorch runs a model converted with
/// `.half()`); otherwise, and always on the CPU, `f32`.
pub fn compute_dtype(config: &BertConfig, dtype_of: &dyn Fn(&str) -> DType, on_gpu: bool) -> DType {
    let mut stored = weight_specs(config).into_iter().map(|s| dtype_of(&s.name));
    match stored.next() {
        Some(first @ (DType::F16 | DType::BF16)) if on_gpu && stored.all(|d| d == first) => first,
        _ => DType::F32,
    }
}

struct Builder<'a> {
    g: &'a Graph,
    config: &'a BertConfig,
    dtype_of: &'a dyn Fn(&str) -> DType,
    compute: DType,
}

impl Builder<'_> {
    /// The param `name` in the compute dtype (cast in the graph when stored
    /// otherwise).
    fn weight(&self, name: &str, dims: &[usize]) -> Result<NodeId> {
        let dtype = (self.dtype_of)(name);
        let p = self.g.param(name, Shape::new(dims, dtype))?;
        if dtype == self.compute {
            Ok(p)
        } else {
            self.g.cast(p, self.compute)
        }
    }

    /// `x @ W + b` with `W` stored `[input, output]`.
    fn linear(&self, x: NodeId, name: &str, input: usize, output: usize) -> Result<NodeId> {
        let w = self.weight(&format!("{name}.weight"), &[input, output])?;
        let bias = self.weight(&format!("{name}.bias"), &[output])?;
        self.g.add(self.g.matmul(x, w)?, bias)
    }

    fn layer_norm(&self, x: NodeId, name: &str) -> Result<NodeId> {
        let h = self.config.hidden_size;
        let gamma = self.weight(&format!("{name}.weight"), &[h])?;
        let beta = self.weight(&format!("{name}.bias"), &[h])?;
        self.g
            .layer_norm(x, gamma, beta, self.config.layer_norm_eps)
    }
}
