//! Small graphs built in code, for `rlx inspect` until model files are supported.

use rlx::prelude::*;

/// A built-in example graph.
#[derive(Clone, Copy, Debug, PartialEq, Eq, clap::ValueEnum)]
pub enum Example {
    /// matmul + bias + GELU, the README's quickstart.
    Mlp,
    /// One pre-norm transformer encoder block (attention + feed-forward).
    Transformer,
    /// A small convolutional classifier.
    Cnn,
}

impl Example {
    /// Builds the graph.
    pub fn build(self) -> Result<Graph> {
        match self {
            Example::Mlp => mlp(),
            Example::Transformer => transformer(),
            Example::Cnn => cnn(),
        }
    }
}

fn f32s(dims: &[usize]) -> Shape {
    Shape::new(dims, DType::F32)
}

fn mlp() -> Result<Graph> {
    let g = Graph::new("mlp");
    let x = g.input("x", f32s(&[2, 4]))?;
    let w = g.param("w", f32s(&[4, 3]))?;
    let b = g.param("b", f32s(&[3]))?;
    let y = g.gelu(g.add(g.matmul(x, w)?, b)?)?;
    g.set_outputs(vec![y]);
    Ok(g)
}

fn transformer() -> Result<Graph> {
    let (seq, dim, heads, ffn) = (16usize, 64usize, 4usize, 256usize);
    let hd = dim / heads;
    let g = Graph::new("transformer_block");
    let x = g.input("x", f32s(&[1, seq, dim]))?;
    let mask = g.input("mask", f32s(&[1, 1, 1, seq]))?;
    let ln = |name: &str, v: NodeId| -> Result<NodeId> {
        let gamma = g.param(format!("{name}.gamma"), f32s(&[dim]))?;
        let beta = g.param(format!("{name}.beta"), f32s(&[dim]))?;
        g.layer_norm(v, gamma, beta, 1e-5)
    };
    let linear = |name: &str, v: NodeId, i: usize, o: usize| -> Result<NodeId> {
        let w = g.param(format!("{name}.weight"), f32s(&[i, o]))?;
        let b = g.param(format!("{name}.bias"), f32s(&[o]))?;
        g.add(g.matmul(v, w)?, b)
    };
    let heads_of = |v: NodeId| -> Result<NodeId> {
        g.permute(g.reshape(v, &[1, seq, heads, hd])?, &[0, 2, 1, 3])
    };
    let h = ln("ln1", x)?;
    let q = heads_of(linear("q", h, dim, dim)?)?;
    let k = heads_of(linear("k", h, dim, dim)?)?;
    let v = heads_of(linear("v", h, dim, dim)?)?;
    let a = g.attention(q, k, v, Some(mask), false, None)?;
    let a = g.reshape(g.permute(a, &[0, 2, 1, 3])?, &[1, seq, dim])?;
    let x = g.add(x, linear("o", a, dim, dim)?)?;
    let h = ln("ln2", x)?;
    let f = linear("fc2", g.gelu(linear("fc1", h, dim, ffn)?)?, ffn, dim)?;
    let y = g.add(x, f)?;
    g.set_outputs(vec![y]);
    Ok(g)
}

fn cnn() -> Result<Graph> {
    let g = Graph::new("cnn");
    let x = g.input("image", f32s(&[1, 3, 32, 32]))?;
    let w1 = g.param("conv1.weight", f32s(&[8, 3, 3, 3]))?;
    let b1 = g.param("conv1.bias", f32s(&[8]))?;
    let w2 = g.param("conv2.weight", f32s(&[16, 8, 3, 3]))?;
    let h = g.relu(g.conv2d(x, w1, Some(b1), [1, 1], [1, 1, 1, 1], [1, 1], 1)?)?;
    let h = g.max_pool2d(h, [2, 2], [2, 2], [0, 0, 0, 0])?;
    let h = g.relu(g.conv2d(h, w2, None, [2, 2], [1, 1, 1, 1], [1, 1], 1)?)?;
    let h = g.avg_pool2d(h, [8, 8], [8, 8], [0, 0, 0, 0], false)?;
    let h = g.reshape(h, &[1, 16])?;
    let wc = g.param("classifier.weight", f32s(&[16, 10]))?;
    let logits = g.matmul(h, wc)?;
    let probs = g.softmax(logits, -1)?;
    g.set_outputs(vec![probs]);
    Ok(g)
}
