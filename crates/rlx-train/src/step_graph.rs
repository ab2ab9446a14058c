//! Builds the graph of one training step from a model graph and its loss: the
//! trainable params become persistent handles, the gradients are appended by reverse
//! mode, and the optimizer's new param and state values are written back into their
//! handles, so that one run of the graph is one step.

use crate::Optimizer;
use rlx_ir::{BinaryOp, DType, Error, Graph, NodeId, Op, Result, Shape, TensorData, UnaryOp};

/// The input the learning rate is fed through (an `f32` scalar).
pub const LR_INPUT: &str = "train.lr";

/// The input holding the number of steps done before this one (`i64 [1]`; with
/// gradient accumulation, that times the micro-batches per step plus the micro-batch's
/// place in its step). A model may declare it itself to key its random ops (dropout)
/// by it, so that a run resumed from a checkpoint draws the same masks.
pub const STEP_INPUT: &str = "train.step";

/// A named tensor of the step graph.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    /// Its name in the graph (and in checkpoints).
    pub name: String,
    /// Its dims and dtype.
    pub shape: Shape,
}

/// The input of the update graph saying whether every micro-batch's loss was finite
/// (`f32` scalar, 1 or 0).
pub(crate) const OK_INPUT: &str = "train.ok";

/// The step graph and the roles of its named tensors.
pub(crate) struct StepGraph {
    /// One run is one step; with accumulation, one run is one micro-batch, adding its
    /// gradients into the accumulators.
    pub graph: Graph,
    /// With accumulation: the update, from the accumulated gradients (which it then
    /// zeroes).
    pub apply: Option<Graph>,
    /// Trainable params, now handles.
    pub params: Vec<TensorSpec>,
    /// Optimizer state handles, `param.suffix`, param by param.
    pub state: Vec<TensorSpec>,
    /// Gradient accumulators, `param.grad_acc` (with accumulation only).
    pub accumulators: Vec<TensorSpec>,
    /// Params left as params (frozen, or not float).
    pub fixed: Vec<TensorSpec>,
    /// The inputs a batch supplies.
    pub batch: Vec<TensorSpec>,
}

/// What a training step needs to know besides the model.
pub(crate) struct StepSettings<'a> {
    pub frozen: &'a [String],
    pub optimizer: &'a Optimizer,
    pub clip: Option<f64>,
    /// Micro-batches whose gradients are averaged into one update (1: none).
    pub micro_batches: usize,
}

/// Names the trainer's own inputs take, checked against the model's.
struct Names(Vec<String>);

impl Names {
    fn claim(&mut self, name: String) -> Result<String> {
        if self.0.contains(&name) {
            return Err(Error::DuplicateName {
                kind: "input",
                name: format!("{name} (the trainer needs this name for its own state)"),
            });
        }
        self.0.push(name.clone());
        Ok(name)
    }
}

/// What besides the gradient norm decides whether a step's update is written.
enum Check {
    /// A loss: it must be finite.
    Loss(NodeId),
    /// A value that is 0 when all is well.
    Zero(NodeId),
}

/// Builds the step graph. Its outputs are the loss and the gradients' global L2 norm
/// (before clipping). A step whose loss or norm is not finite writes back the old
/// values, so nothing is trained through it. With micro-batches, the step graph
/// outputs the loss and adds the gradients into accumulators, and the update graph
/// outputs the norm of their mean.
pub(crate) fn build(model: &Graph, loss: NodeId, settings: &StepSettings<'_>) -> Result<StepGraph> {
    model.shape(loss)?;
    let params = model.params();
    if let Some(name) = settings
        .frozen
        .iter()
        .find(|f| !params.iter().any(|p| &p.0 == *f))
    {
        return Err(Error::UnknownName {
            kind: "param",
            name: name.clone(),
            known: params.iter().map(|p| p.0.clone()).collect(),
        });
    }
    if settings.micro_batches == 0 {
        return Err(Error::invalid(
            "trainer",
            "gradient accumulation needs at least one micro-batch",
        ));
    }
    let (trainable, fixed): (Vec<_>, Vec<_>) = params
        .into_iter()
        .partition(|(name, _, shape)| shape.dtype().is_float() && !settings.frozen.contains(name));
    if trainable.is_empty() {
        return Err(Error::invalid(
            "trainer",
            "the model has no trainable params (float params not frozen)",
        ));
    }
    if let Some((name, _, shape)) = trainable.iter().find(|p| p.2.rank() == 0) {
        return Err(Error::invalid(
            format!("trainer, param '{name}'"),
            format!("trainable params need at least one axis, got {shape}"),
        ));
    }

    let mut nodes = model.nodes().to_vec();
    for (name, id, _) in &trainable {
        nodes[id.index()].op = Op::Input { name: name.clone() };
    }
    let g = Graph::from_parts(model.name(), nodes, Vec::new(), model.constants().to_vec());
    let batch: Vec<TensorSpec> = model
        .inputs()
        .into_iter()
        .filter(|(name, _, _)| name != STEP_INPUT)
        .map(|(name, _, shape)| TensorSpec { name, shape })
        .collect();
    let mut names = Names(g.inputs().into_iter().map(|i| i.0).collect());
    names.0.extend(fixed.iter().map(|p| p.0.clone()));
    step_input(&g)?;
    let ids: Vec<NodeId> = trainable.iter().map(|p| p.1).collect();
    let gradients = rlx_opt::autodiff::grad(&g, loss, &ids)?;
    let spec = |(name, _, shape): &(String, NodeId, Shape)| TensorSpec {
        name: name.clone(),
        shape: shape.clone(),
    };
    let params: Vec<TensorSpec> = trainable.iter().map(spec).collect();
    let fixed: Vec<TensorSpec> = fixed.iter().map(spec).collect();

    if settings.micro_batches == 1 {
        let (state, norm) = update(
            &g,
            (&ids, &params, &gradients),
            Check::Loss(loss),
            settings,
            &mut names,
        )?;
        g.set_outputs(vec![loss, norm]);
        return Ok(StepGraph {
            graph: g,
            apply: None,
            params,
            state,
            accumulators: Vec::new(),
            fixed,
            batch,
        });
    }

    // The micro-batch graph: its gradients added into the accumulators.
    let at_start = g.constant(TensorData::I64(vec![0]), &[1])?;
    let mut accumulators = Vec::new();
    for (p, gradient) in params.iter().zip(&gradients) {
        let name = names.claim(format!("{}.grad_acc", p.name))?;
        let acc = g.input(name.clone(), p.shape.clone())?;
        let sum = g.binary(BinaryOp::Add, acc, *gradient)?;
        g.write_at(acc, sum, at_start, 0)?;
        accumulators.push(TensorSpec {
            name,
            shape: p.shape.clone(),
        });
    }
    g.set_outputs(vec![loss]);

    // The update graph: the mean of the accumulated gradients, then zeroed.
    let apply = Graph::new(format!("{}.apply", model.name()));
    let mut apply_ids = Vec::new();
    let mut acc_ids = Vec::new();
    let mut means = Vec::new();
    let scale = 1.0 / settings.micro_batches as f64;
    for (p, a) in params.iter().zip(&accumulators) {
        apply_ids.push(apply.input(p.name.clone(), p.shape.clone())?);
        let acc = apply.input(a.name.clone(), a.shape.clone())?;
        acc_ids.push(acc);
        means.push(apply.binary(BinaryOp::Mul, acc, apply.scalar(scale, p.shape.dtype()))?);
    }
    let ok = apply.input(
        names.claim(OK_INPUT.to_string())?,
        Shape::scalar(DType::F32),
    )?;
    // 1 - ok is 0 exactly when every micro-batch's loss was finite.
    let not_ok = apply.binary(BinaryOp::Sub, apply.scalar(1.0, DType::F32), ok)?;
    let (state, norm) = update(
        &apply,
        (&apply_ids, &params, &means),
        Check::Zero(not_ok),
        settings,
        &mut names,
    )?;
    let at_start = apply.constant(TensorData::I64(vec![0]), &[1])?;
    for (a, &acc) in accumulators.iter().zip(&acc_ids) {
        let ones = vec![1; a.shape.rank()];
        let zero = apply.constant(TensorData::from_f64(a.shape.dtype(), &[0.0]), &ones)?;
        apply.write_at(acc, apply.expand(zero, a.shape.dims())?, at_start, 0)?;
    }
    apply.set_outputs(vec![norm]);
    Ok(StepGraph {
        graph: g,
        apply: Some(apply),
        params,
        state,
        accumulators,
        fixed,
        batch,
    })
}

/// Adds to `g` the learning-rate and optimizer inputs, the gradients' global norm
/// (clipped as set), the optimizer's update of each param (`ids`, `params`) from its
/// gradient, and the guarded writes of the new params and state: nothing is written
/// unless `check` holds and the norm is finite. Returns the state handles and the
/// norm.
fn update(
    g: &Graph,
    (ids, params, gradients): (&[NodeId], &[TensorSpec], &[NodeId]),
    check: Check,
    settings: &StepSettings<'_>,
    names: &mut Names,
) -> Result<(Vec<TensorSpec>, NodeId)> {
    let optimizer = settings.optimizer;
    let lr = g.input(
        names.claim(LR_INPUT.to_string())?,
        Shape::scalar(DType::F32),
    )?;
    let scalars = optimizer
        .scalar_inputs()
        .iter()
        .map(|name| g.input(names.claim(name.to_string())?, Shape::scalar(DType::F32)))
        .collect::<Result<Vec<_>>>()?;
    let (gradients, norm) = match settings.clip {
        Some(max_norm) => g.clip_by_global_norm(gradients, max_norm)?,
        None => (gradients.to_vec(), global_norm(g, gradients)?),
    };
    // x * 0 is 0 exactly when x is finite.
    let norm_dtype = g.shape(norm)?.dtype();
    let check = match check {
        Check::Loss(loss) => times_zero(g, loss)?,
        Check::Zero(x) => x,
    };
    let zero_if_finite = g.binary(
        BinaryOp::Add,
        as_dtype(g, check, norm_dtype)?,
        times_zero(g, norm)?,
    )?;
    let finite = g.binary(BinaryOp::Eq, zero_if_finite, g.scalar(0.0, norm_dtype))?;
    let at_start = g.constant(TensorData::I64(vec![0]), &[1])?;

    let mut state = Vec::new();
    for ((param, spec), gradient) in ids.iter().zip(params).zip(&gradients) {
        let dtype = spec.shape.dtype();
        let mut handles = Vec::new();
        for suffix in optimizer.state_suffixes() {
            let state_name = names.claim(format!("{}.{suffix}", spec.name))?;
            handles.push(g.input(state_name.clone(), spec.shape.clone())?);
            state.push(TensorSpec {
                name: state_name,
                shape: spec.shape.clone(),
            });
        }
        let lr = as_dtype(g, lr, dtype)?;
        let scalars = scalars
            .iter()
            .map(|&s| as_dtype(g, s, dtype))
            .collect::<Result<Vec<_>>>()?;
        let (next, next_state) =
            optimizer.update(g, (*param, *gradient, &handles), (lr, &scalars))?;
        for (target, value) in
            std::iter::once((*param, next)).chain(handles.into_iter().zip(next_state))
        {
            let kept = g.select(finite, value, target)?;
            g.write_at(target, kept, at_start, 0)?;
        }
    }
    Ok((state, norm))
}

/// The model's own step input, checked to be `i64 [1]`, or a new one.
fn step_input(g: &Graph) -> Result<NodeId> {
    let wanted = Shape::new(&[1], DType::I64);
    match g.inputs().into_iter().find(|i| i.0 == STEP_INPUT) {
        Some((_, id, shape)) if shape == wanted => Ok(id),
        Some((_, _, shape)) => Err(Error::invalid(
            format!("trainer, input '{STEP_INPUT}'"),
            format!("the step input must be {wanted}, got {shape}"),
        )),
        None => g.input(STEP_INPUT, wanted),
    }
}

/// The L2 norm of all the gradients together, in `f32`.
fn global_norm(g: &Graph, gradients: &[NodeId]) -> Result<NodeId> {
    let mut total: Option<NodeId> = None;
    for &x in gradients {
        let x = as_dtype(g, x, DType::F32)?;
        let squares = g.sum(g.binary(BinaryOp::Mul, x, x)?, &[], false)?;
        total = Some(match total {
            Some(t) => g.binary(BinaryOp::Add, t, squares)?,
            None => squares,
        });
    }
    let total = total.ok_or_else(|| Error::invalid("trainer", "no gradients"))?;
    g.unary(UnaryOp::Sqrt, total)
}

fn times_zero(g: &Graph, x: NodeId) -> Result<NodeId> {
    let dtype = g.shape(x)?.dtype();
    g.binary(BinaryOp::Mul, x, g.scalar(0.0, dtype))
}

fn as_dtype(g: &Graph, x: NodeId, dtype: DType) -> Result<NodeId> {
    if g.shape(x)?.dtype() == dtype {
        Ok(x)
    } else {
        g.cast(x, dtype)
    }
}
