//! The training object: a model, its loss and an optimizer compiled into one step
//! graph whose params and optimizer state live on the device across steps.

use crate::step_graph::{self, LR_INPUT, OK_INPUT, STEP_INPUT, StepSettings, TensorSpec};
use crate::{LrSchedule, Optimizer};
use rlx_driver::BufferHandle;
use rlx_ir::{Error, Graph, NodeId, Op, Result, TensorData, TensorRef};
use rlx_runtime::{CompileOptions, CompiledGraph, Session};

/// How to train: the optimizer, the learning-rate schedule, gradient clipping, which
/// params stay fixed, and how to compile.
#[derive(Clone, Debug)]
pub struct TrainOptions {
    optimizer: Optimizer,
    schedule: LrSchedule,
    clip_norm: Option<f64>,
    frozen: Vec<String>,
    compile: CompileOptions,
    micro_batches: usize,
}

impl TrainOptions {
    /// `optimizer` at a constant learning rate of 1e-3, no clipping, every float
    /// param trained, default compile options.
    pub fn new(optimizer: Optimizer) -> TrainOptions {
        TrainOptions {
            optimizer,
            schedule: LrSchedule::Constant(1e-3),
            clip_norm: None,
            frozen: Vec::new(),
            compile: CompileOptions::default(),
            micro_batches: 1,
        }
    }

    /// The learning rate of each step.
    pub fn schedule(mut self, schedule: LrSchedule) -> TrainOptions {
        self.schedule = schedule;
        self
    }

    /// Scales the gradients so their global L2 norm is at most `max_norm`.
    pub fn clip_norm(mut self, max_norm: f64) -> TrainOptions {
        self.clip_norm = Some(max_norm);
        self
    }

    /// Params that keep the values given with [`Trainer::set_param`].
    pub fn freeze(mut self, names: &[&str]) -> TrainOptions {
        self.frozen.extend(names.iter().map(|n| n.to_string()));
        self
    }

    /// Averages the gradients of `n` micro-batches into each update (gradient
    /// accumulation); steps are then taken with [`Trainer::step_accumulated`].
    pub fn accumulate(mut self, n: usize) -> TrainOptions {
        self.micro_batches = n;
        self
    }

    /// Compile options of the step graph (threads, say); the trainer adds its
    /// handles to them.
    pub fn compile_options(mut self, options: CompileOptions) -> TrainOptions {
        self.compile = options;
        self
    }

    /// The optimizer.
    pub fn optimizer(&self) -> &Optimizer {
        &self.optimizer
    }
}

/// A compiled training step. Each [`Trainer::step`] is one run: forward, backward
/// and the optimizer's update, written in place into the params and state, which
/// never leave the device. Params start at zero: set them with
/// [`Trainer::set_param`] or [`Trainer::load_params`].
pub struct Trainer {
    compiled: CompiledGraph,
    /// With accumulation: the update graph, which owns the optimizer state and
    /// borrows the params and accumulators from `compiled` for each update.
    apply: Option<CompiledGraph>,
    step_graph: Graph,
    model_name: String,
    params: Vec<TensorSpec>,
    state: Vec<TensorSpec>,
    accumulators: Vec<TensorSpec>,
    fixed: Vec<TensorSpec>,
    fixed_values: Vec<Option<Vec<f32>>>,
    batch: Vec<TensorSpec>,
    options: TrainOptions,
    steps: u64,
    grad_norm: f32,
}

impl std::fmt::Debug for Trainer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("model", &self.model_name)
            .field("params", &self.params.len())
            .field("steps", &self.steps)
            .finish()
    }
}

impl Trainer {
    /// Compiles the training step of `model` minimizing `loss` (a one-element float
    /// node of `model`) on the session's device.
    ///
    /// # Errors
    /// When the loss is not a one-element float node of the model, a path from a
    /// param to it has no gradient (the op is named), a frozen name is not a param,
    /// the schedule or optimizer settings are invalid, or compiling fails.
    pub fn new(
        session: &Session,
        model: &Graph,
        loss: NodeId,
        options: TrainOptions,
    ) -> Result<Trainer> {
        options.schedule.validate()?;
        if let Some(max) = options.clip_norm
            && !(max > 0.0 && max.is_finite())
        {
            return Err(Error::invalid(
                "clip_norm",
                format!("the norm must be positive and finite, got {max}"),
            ));
        }
        let built = step_graph::build(
            model,
            loss,
            &StepSettings {
                frozen: &options.frozen,
                optimizer: &options.optimizer,
                clip: options.clip_norm,
                micro_batches: options.micro_batches,
            },
        )?;
        let bind = |tensors: &[&[TensorSpec]]| {
            tensors
                .iter()
                .flat_map(|t| t.iter())
                .fold(options.compile.clone(), |c, t| {
                    c.bind_handle(&BufferHandle {
                        name: t.name.clone(),
                        shape: t.shape.clone(),
                    })
                })
        };
        let (compiled, apply) = match &built.apply {
            None => (
                session.compile_with(&built.graph, &bind(&[&built.params, &built.state]))?,
                None,
            ),
            Some(apply) => {
                let micro = bind(&[&built.params, &built.accumulators]);
                let update = bind(&[&built.params, &built.accumulators, &built.state]);
                // The update borrows the params and accumulators for each run (its
                // own copies are dropped at the first).
                let apply = session.compile_with(apply, &update)?;
                (session.compile_with(&built.graph, &micro)?, Some(apply))
            }
        };
        Ok(Trainer {
            compiled,
            apply,
            step_graph: built.graph,
            model_name: model.name().to_string(),
            fixed_values: vec![None; built.fixed.len()],
            params: built.params,
            state: built.state,
            accumulators: built.accumulators,
            fixed: built.fixed,
            batch: built.batch,
            options,
            steps: 0,
            grad_norm: 0.0,
        })
    }

    /// Runs one step on a batch (every input of the model, by name) and returns the
    /// loss, computed before the update.
    ///
    /// # Errors
    /// A missing, unknown or misshapen batch input (nothing runs), or a loss or
    /// gradient norm that is not finite: then the params and state keep their values
    /// from before the step, the step count does not advance, and the error names
    /// the step.
    pub fn step(&mut self, batch: &[(&str, TensorRef<'_>)]) -> Result<f32> {
        if self.apply.is_some() {
            return Err(Error::invalid(
                "training step",
                format!(
                    "this trainer averages {} micro-batches per update; call step_accumulated",
                    self.options.micro_batches
                ),
            ));
        }
        if let Some((name, _)) = batch
            .iter()
            .find(|(name, _)| !self.batch.iter().any(|b| b.name == *name))
        {
            return Err(Error::UnknownName {
                kind: "input",
                name: name.to_string(),
                known: self.batch.iter().map(|b| b.name.clone()).collect(),
            });
        }
        let rate = self.options.schedule.at(self.steps);
        let lr = [rate as f32];
        let step = [self.steps as i64];
        let scalars = self.options.optimizer.scalars(self.steps, rate);
        let mut inputs: Vec<(&str, TensorRef<'_>)> = batch.to_vec();
        inputs.push((LR_INPUT, TensorRef::F32(&lr)));
        inputs.push((STEP_INPUT, TensorRef::I64(&step)));
        for (name, value) in self.options.optimizer.scalar_inputs().iter().zip(&scalars) {
            inputs.push((name, TensorRef::F32(std::slice::from_ref(value))));
        }
        let out = self.compiled.run_typed(&inputs)?;
        let loss = scalar(&out[0]);
        let norm = scalar(&out[1]);
        if !(loss.is_finite() && norm.is_finite()) {
            return Err(Error::runtime(
                format!("training step {}", self.steps),
                format!(
                    "the loss is {loss} and the gradient norm {norm}; the params and \
                     optimizer state were left as they were before this step"
                ),
            ));
        }
        self.steps = self.steps.saturating_add(1);
        self.grad_norm = norm as f32;
        Ok(loss as f32)
    }

    /// Runs one update from `micro_batches` (as many as [`TrainOptions::accumulate`]
    /// set, each a batch as [`Trainer::step`] takes): the gradients of each are
    /// added up on the device, and their mean updates the params once. Returns the
    /// mean of the micro-batches' losses.
    ///
    /// # Errors
    /// The wrong number of micro-batches, or one with a missing, unknown or
    /// misshapen input (checked before any runs); a loss or gradient norm that is not
    /// finite, which writes nothing (as [`Trainer::step`]). The accumulators are
    /// empty again after any error.
    pub fn step_accumulated(&mut self, micro_batches: &[&[(&str, TensorRef<'_>)]]) -> Result<f32> {
        let n = self.options.micro_batches;
        if micro_batches.len() != n {
            return Err(Error::invalid(
                "training step",
                format!("expected {n} micro-batches, got {}", micro_batches.len()),
            ));
        }
        if self.apply.is_none() {
            return self.step(micro_batches[0]);
        }
        for batch in micro_batches {
            self.check_batch(batch)?;
        }
        let mut losses = Vec::with_capacity(n);
        for (i, batch) in micro_batches.iter().enumerate() {
            // Each micro-batch draws its own random numbers (dropout masks), keyed by
            // the step and its place in it, so a resumed run draws them again.
            let key = [(self.steps as i64)
                .wrapping_mul(n as i64)
                .wrapping_add(i as i64)];
            let mut inputs: Vec<(&str, TensorRef<'_>)> = batch.to_vec();
            inputs.push((STEP_INPUT, TensorRef::I64(&key)));
            match self.compiled.run_typed(&inputs) {
                Ok(out) => losses.push(scalar(&out[0])),
                Err(e) => {
                    // The first error is the one to report.
                    let _ = self.clear_accumulators();
                    return Err(e);
                }
            }
        }
        let ok = [if losses.iter().all(|l| l.is_finite()) {
            1.0f32
        } else {
            0.0
        }];
        let rate = self.options.schedule.at(self.steps);
        let lr = [rate as f32];
        let scalars = self.options.optimizer.scalars(self.steps, rate);
        let mut inputs: Vec<(&str, TensorRef<'_>)> = vec![
            (LR_INPUT, TensorRef::F32(&lr)),
            (OK_INPUT, TensorRef::F32(&ok)),
        ];
        for (name, value) in self.options.optimizer.scalar_inputs().iter().zip(&scalars) {
            inputs.push((name, TensorRef::F32(std::slice::from_ref(value))));
        }
        let mut apply = self
            .apply
            .take()
            .ok_or_else(|| Error::invalid("training step", "no update graph"))?;
        let out = match apply.borrow_handles(&mut self.compiled) {
            Ok(_) => {
                let out = apply.run_typed(&inputs);
                let back = apply.return_handles(&mut self.compiled);
                back.and(out)
            }
            Err(e) => Err(e),
        };
        self.apply = Some(apply);
        let norm = match out {
            Ok(out) => scalar(&out[0]),
            Err(e) => {
                let _ = self.clear_accumulators();
                return Err(e);
            }
        };
        let loss = losses.iter().sum::<f64>() / n as f64;
        if !(loss.is_finite() && norm.is_finite()) {
            return Err(Error::runtime(
                format!("training step {}", self.steps),
                format!(
                    "the mean loss is {loss} and the gradient norm {norm}; the params and \
                     optimizer state were left as they were before this step"
                ),
            ));
        }
        self.steps = self.steps.saturating_add(1);
        self.grad_norm = norm as f32;
        Ok(loss as f32)
    }

    /// Checks a batch's names, dtypes and sizes against the model's inputs.
    fn check_batch(&self, batch: &[(&str, TensorRef<'_>)]) -> Result<()> {
        for (name, value) in batch {
            let spec =
                self.batch
                    .iter()
                    .find(|b| b.name == *name)
                    .ok_or_else(|| Error::UnknownName {
                        kind: "input",
                        name: name.to_string(),
                        known: self.batch.iter().map(|b| b.name.clone()).collect(),
                    })?;
            if value.dtype() != spec.shape.dtype() {
                return Err(Error::dtype(
                    format!("input '{name}'"),
                    spec.shape.dtype().name(),
                    value.dtype(),
                ));
            }
            if value.len() != spec.shape.num_elements() {
                return Err(Error::LengthMismatch {
                    kind: "input",
                    name: name.to_string(),
                    expected: spec.shape.num_elements(),
                    got: value.len(),
                    unit: "elements",
                });
            }
        }
        if let Some(missing) = self
            .batch
            .iter()
            .find(|b| !batch.iter().any(|(n, _)| *n == b.name))
        {
            return Err(Error::MissingInput {
                name: missing.name.clone(),
                shape: missing.shape.clone(),
            });
        }
        Ok(())
    }

    fn clear_accumulators(&mut self) -> Result<()> {
        for a in &self.accumulators {
            self.compiled
                .write_handle_bytes(&a.name, &vec![0u8; a.shape.byte_size()])?;
        }
        Ok(())
    }

    /// The current values of a trained param or an optimizer state tensor, as `f32`.
    pub fn tensor(&self, name: &str) -> Result<Vec<f32>> {
        self.holder(name).read_handle(name)
    }

    /// The compiled graph that holds handle `name`: the update graph for optimizer
    /// state when accumulating, else the step graph.
    fn holder(&self, name: &str) -> &CompiledGraph {
        match &self.apply {
            Some(apply) if self.state.iter().any(|s| s.name == name) => apply,
            _ => &self.compiled,
        }
    }

    /// Steps done (the next step's number, from 0).
    pub fn steps(&self) -> u64 {
        self.steps
    }

    /// The gradients' global L2 norm (before clipping) at the last step.
    pub fn grad_norm(&self) -> f32 {
        self.grad_norm
    }

    /// The learning rate the next step uses.
    pub fn learning_rate(&self) -> f64 {
        self.options.schedule.at(self.steps)
    }

    /// The trained params, in the model's order.
    pub fn params(&self) -> &[TensorSpec] {
        &self.params
    }

    /// The optimizer state tensors (`param.exp_avg`, ...).
    pub fn state(&self) -> &[TensorSpec] {
        &self.state
    }

    /// The inputs a batch supplies.
    pub fn batch_inputs(&self) -> &[TensorSpec] {
        &self.batch
    }

    /// The options the trainer was built with.
    pub fn options(&self) -> &TrainOptions {
        &self.options
    }

    /// The model's name.
    pub fn model_name(&self) -> &str {
        &self.model_name
    }

    /// The step graph as built, before optimization: its inputs are the batch,
    /// [`LR_INPUT`], [`STEP_INPUT`] and the optimizer's scalars, its handles the
    /// params and state, its outputs the loss and the gradient norm. (When
    /// accumulating, the micro-batch graph: the loss out, the gradients added into
    /// the `param.grad_acc` handles.)
    pub fn step_graph(&self) -> &Graph {
        &self.step_graph
    }

    /// The compiled step graph (for its memory statistics and kernels).
    pub fn compiled(&self) -> &CompiledGraph {
        &self.compiled
    }

    /// Turns per-kernel timing of the steps on or off.
    pub fn set_profiling(&mut self, on: bool) {
        self.compiled.set_profiling(on);
    }

    /// Kernel timings of the steps run while profiling was on.
    pub fn profile(&self) -> Option<rlx_driver::Profile> {
        self.compiled.profile()
    }

    /// Sets a param (trained or fixed) from `f32` values.
    pub fn set_param(&mut self, name: &str, values: &[f32]) -> Result<()> {
        if let Some(i) = self.fixed.iter().position(|f| f.name == name) {
            self.compiled.set_param(name, values)?;
            self.fixed_values[i] = Some(values.to_vec());
            return Ok(());
        }
        self.trained_index(name)?;
        self.compiled.write_handle(name, values)
    }

    /// A param's current values as `f32`.
    pub fn param(&self, name: &str) -> Result<Vec<f32>> {
        if let Some(i) = self.fixed.iter().position(|f| f.name == name) {
            return self.fixed_values[i]
                .clone()
                .ok_or_else(|| Error::ParamNotSet {
                    name: name.to_string(),
                    shape: self.fixed[i].shape.clone(),
                });
        }
        self.trained_index(name)?;
        self.compiled.read_handle(name)
    }

    /// Resets the optimizer state to zeros and the step count to 0 (the params stay).
    pub fn reset_optimizer(&mut self) -> Result<()> {
        for s in self.state.clone() {
            self.set_handle_bytes(&s.name, &vec![0u8; s.shape.byte_size()])?;
        }
        self.steps = 0;
        Ok(())
    }

    pub(crate) fn trained_index(&self, name: &str) -> Result<usize> {
        self.params
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| Error::UnknownName {
                kind: "param",
                name: name.to_string(),
                known: self
                    .params
                    .iter()
                    .chain(&self.fixed)
                    .map(|p| p.name.clone())
                    .collect(),
            })
    }

    pub(crate) fn handle_bytes(&self, name: &str) -> Result<Vec<u8>> {
        self.holder(name).read_handle_bytes(name)
    }

    pub(crate) fn set_handle_bytes(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        match &mut self.apply {
            Some(apply) if self.state.iter().any(|s| s.name == name) => {
                apply.write_handle_bytes(name, bytes)
            }
            _ => self.compiled.write_handle_bytes(name, bytes),
        }
    }

    pub(crate) fn set_steps(&mut self, steps: u64) {
        self.steps = steps;
    }

    /// Compiles `graph` (a forward graph over the same params: an evaluation or
    /// inference form of the model) to run on this trainer's params in place.
    ///
    /// # Errors
    /// When a float param of `graph` is not one the trainer has with the same shape,
    /// or compiling fails.
    pub fn evaluator(&self, session: &Session, graph: &Graph) -> Result<Evaluator> {
        let mut nodes = graph.nodes().to_vec();
        let mut options = self.options.compile.clone();
        let mut fixed = Vec::new();
        for (name, id, shape) in graph.params() {
            if let Some(i) = self.fixed.iter().position(|f| f.name == name) {
                fixed.push((name, i));
                continue;
            }
            let i = self.trained_index(&name)?;
            if self.params[i].shape != shape {
                return Err(Error::ShapeMismatch {
                    op: format!("evaluator, param '{name}'"),
                    lhs: self.params[i].shape.clone(),
                    rhs: shape,
                    reason: "the evaluated graph's param must match the trained one".into(),
                });
            }
            nodes[id.index()].op = Op::Input { name: name.clone() };
            options = options.bind_handle(&BufferHandle { name, shape });
        }
        let g = Graph::from_parts(
            graph.name(),
            nodes,
            graph.outputs(),
            graph.constants().to_vec(),
        );
        let mut compiled = session.compile_with(&g, &options)?;
        compiled.release_handles()?;
        for (name, i) in fixed {
            let values = self.fixed_values[i]
                .as_ref()
                .ok_or_else(|| Error::ParamNotSet {
                    name: name.clone(),
                    shape: self.fixed[i].shape.clone(),
                })?;
            compiled.set_param(&name, values)?;
        }
        Ok(Evaluator { compiled })
    }
}

/// A forward graph running on a trainer's params (see [`Trainer::evaluator`]).
pub struct Evaluator {
    compiled: CompiledGraph,
}

impl Evaluator {
    /// Runs on `trainer`'s current params and returns the graph's outputs. The
    /// params are lent for the run and given back, also when it fails.
    pub fn run(
        &mut self,
        trainer: &mut Trainer,
        inputs: &[(&str, TensorRef<'_>)],
    ) -> Result<Vec<TensorData>> {
        self.compiled.borrow_handles(&mut trainer.compiled)?;
        let out = self.compiled.run_typed(inputs);
        self.compiled.return_handles(&mut trainer.compiled)?;
        out
    }
}

fn scalar(t: &TensorData) -> f64 {
    t.as_ref().to_f64_vec().first().copied().unwrap_or(f64::NAN)
}
