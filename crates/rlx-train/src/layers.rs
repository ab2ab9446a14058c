//! Building trainable models: params declared in a graph together with their initial
//! values, drawn as PyTorch's layers draw theirs by default (uniform within
//! `1/sqrt(fan_in)` for linear and convolution weights and biases).

use crate::Rng;
use rlx_ir::{DType, Graph, NodeId, Result, Shape};

/// A model graph, the node of its output, and the initial value of each param.
pub struct Network {
    /// The graph (its outputs set to `output`).
    pub graph: Graph,
    /// The output node (logits).
    pub output: NodeId,
    /// Initial param values, by name.
    pub init: Vec<(String, Vec<f32>)>,
}

/// A graph under construction with the initial value of each param it declares.
pub struct ModelBuilder<'g> {
    /// The graph.
    pub g: &'g Graph,
    rng: Rng,
    init: Vec<(String, Vec<f32>)>,
}

impl<'g> ModelBuilder<'g> {
    /// Declares params in `g`, drawing their values from `seed`.
    pub fn new(g: &'g Graph, seed: u64) -> ModelBuilder<'g> {
        ModelBuilder {
            g,
            rng: Rng::new(seed),
            init: Vec::new(),
        }
    }

    /// Declares an `f32` param with the given values.
    pub fn param(&mut self, name: &str, dims: &[usize], values: Vec<f32>) -> Result<NodeId> {
        let id = self.g.param(name, Shape::new(dims, DType::F32))?;
        self.init.push((name.to_string(), values));
        Ok(id)
    }

    /// A param drawn uniformly from `[-bound, bound)`.
    pub fn uniform(&mut self, name: &str, dims: &[usize], bound: f64) -> Result<NodeId> {
        let n = dims.iter().product();
        let values = (0..n).map(|_| self.rng.symmetric(bound) as f32).collect();
        self.param(name, dims, values)
    }

    /// A param drawn from a normal distribution of standard deviation `std`.
    pub fn normal(&mut self, name: &str, dims: &[usize], std: f64) -> Result<NodeId> {
        let n = dims.iter().product();
        let values = (0..n).map(|_| (self.rng.normal() * std) as f32).collect();
        self.param(name, dims, values)
    }

    /// A param filled with `value`.
    pub fn filled(&mut self, name: &str, dims: &[usize], value: f32) -> Result<NodeId> {
        let n = dims.iter().product();
        self.param(name, dims, vec![value; n])
    }

    /// `x @ w + b` over the last axis of `x`, with `w: [inputs, outputs]` named
    /// `{name}.weight` and `b` `{name}.bias`.
    pub fn linear(&mut self, name: &str, x: NodeId, outputs: usize, bias: bool) -> Result<NodeId> {
        let shape = self.g.shape(x)?;
        let Some(&inputs) = shape.dims().last() else {
            return Err(rlx_ir::Error::invalid(
                format!("linear '{name}'"),
                format!("the input needs at least one axis, got {shape}"),
            ));
        };
        let bound = 1.0 / (inputs as f64).sqrt();
        let w = self.uniform(&format!("{name}.weight"), &[inputs, outputs], bound)?;
        let y = self.g.matmul(x, w)?;
        if !bias {
            return Ok(y);
        }
        let b = self.uniform(&format!("{name}.bias"), &[outputs], bound)?;
        self.g.add(y, b)
    }

    /// A `k x k` convolution of NCHW `x` to `channels` outputs with a bias, stride 1,
    /// padding `pad` on every side; `{name}.weight` is `[channels, C, k, k]`.
    pub fn conv2d(
        &mut self,
        name: &str,
        x: NodeId,
        channels: usize,
        k: usize,
        pad: usize,
    ) -> Result<NodeId> {
        let shape = self.g.shape(x)?;
        if shape.rank() != 4 {
            return Err(rlx_ir::Error::invalid(
                format!("conv2d '{name}'"),
                format!("the input must be NCHW, got {shape}"),
            ));
        }
        let inputs = shape.dim(1);
        let bound = 1.0 / ((inputs * k * k) as f64).sqrt();
        let w = self.uniform(&format!("{name}.weight"), &[channels, inputs, k, k], bound)?;
        let b = self.uniform(&format!("{name}.bias"), &[channels], bound)?;
        self.g
            .conv2d(x, w, Some(b), [1, 1], [pad, pad, pad, pad], [1, 1], 1)
    }

    /// The initial values of the params declared so far, by name.
    pub fn initial_values(&self) -> &[(String, Vec<f32>)] {
        &self.init
    }

    /// Takes the initial values.
    pub fn into_initial_values(self) -> Vec<(String, Vec<f32>)> {
        self.init
    }
}
