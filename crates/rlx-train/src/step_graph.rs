//! Builds the graph of one training step from a model graph and its loss: the
//! trainable params become persistent handles, the gradients are appended by reverse
//! mode, and the optimizer's new param and state values are written back into their
//! handles, so that one run of the graph is one step.

use crate::Optimizer;
use rlx_ir::{BinaryOp, DType, Error, Graph, NodeId, Op, Result, Shape, TensorData, UnaryOp};

/// The input the learning rate is fed through (an `f32` scalar).
pub const LR_INPUT: &str = "train.lr";

/// The input holding the number of steps done before this one (`i64 [1]`). A model
/// may declare it itself to key its random ops (dropout) by the step, so that a run
/// resumed from a checkpoint draws the same masks.
pub const STEP_INPUT: &str = "train.step";

/// A named tensor of the step graph.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorSpec {
    /// Its name in the graph (and in checkpoints).
    pub name: String,
    /// Its dims and dtype.
    pub shape: Shape,
}

/// The step graph and the roles of its named tensors.
pub(crate) struct StepGraph {
    pub graph: Graph,
    /// Trainable params, now handles.
    pub params: Vec<TensorSpec>,
    /// Optimizer state handles, `param.suffix`, param by param.
    pub state: Vec<TensorSpec>,
    /// Params left as params (frozen, or not float).
    pub fixed: Vec<TensorSpec>,
    /// The inputs a batch supplies.
    pub batch: Vec<TensorSpec>,
}

/// Builds the step graph. Its outputs are the loss and the gradients' global L2 norm
/// (before clipping). A step whose loss or norm is not finite writes back the old
/// values, so nothing is trained through it.
pub(crate) fn build(
    model: &Graph,
    loss: NodeId,
    frozen: &[String],
    optimizer: &Optimizer,
    clip: Option<f64>,
) -> Result<StepGraph> {
    model.shape(loss)?;
    let params = model.params();
    if let Some(name) = frozen.iter().find(|f| !params.iter().any(|p| &p.0 == *f)) {
        return Err(Error::UnknownName {
            kind: "param",
            name: name.clone(),
            known: params.iter().map(|p| p.0.clone()).collect(),
        });
    }
    let (trainable, fixed): (Vec<_>, Vec<_>) = params
        .into_iter()
        .partition(|(name, _, shape)| shape.dtype().is_float() && !frozen.contains(name));
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

    let mut taken: Vec<String> = g.inputs().into_iter().map(|i| i.0).collect();
    taken.extend(fixed.iter().map(|p| p.0.clone()));
    let mut claim = |name: String| -> Result<String> {
        if taken.contains(&name) {
            return Err(Error::DuplicateName {
                kind: "input",
                name: format!("{name} (the trainer needs this name for its own state)"),
            });
        }
        taken.push(name.clone());
        Ok(name)
    };

    let lr = g.input(claim(LR_INPUT.to_string())?, Shape::scalar(DType::F32))?;
    step_input(&g)?;
    let scalars = optimizer
        .scalar_inputs()
        .iter()
        .map(|name| g.input(claim(name.to_string())?, Shape::scalar(DType::F32)))
        .collect::<Result<Vec<_>>>()?;

    let ids: Vec<NodeId> = trainable.iter().map(|p| p.1).collect();
    let gradients = rlx_opt::autodiff::grad(&g, loss, &ids)?;
    let (gradients, norm) = match clip {
        Some(max_norm) => g.clip_by_global_norm(&gradients, max_norm)?,
        None => (gradients.clone(), global_norm(&g, &gradients)?),
    };

    // loss * 0 + norm * 0 is 0 exactly when both are finite.
    let zero_if_finite = g.binary(
        BinaryOp::Add,
        times_zero(&g, loss)?,
        g.cast(times_zero(&g, norm)?, g.shape(loss)?.dtype())?,
    )?;
    let finite = g.binary(
        BinaryOp::Eq,
        zero_if_finite,
        g.scalar(0.0, g.shape(loss)?.dtype()),
    )?;
    let at_start = g.constant(TensorData::I64(vec![0]), &[1])?;

    let mut state = Vec::new();
    for ((name, param, shape), gradient) in trainable.iter().zip(&gradients) {
        let dtype = shape.dtype();
        let mut handles = Vec::new();
        for suffix in optimizer.state_suffixes() {
            let state_name = claim(format!("{name}.{suffix}"))?;
            handles.push(g.input(state_name.clone(), shape.clone())?);
            state.push(TensorSpec {
                name: state_name,
                shape: shape.clone(),
            });
        }
        let lr = as_dtype(&g, lr, dtype)?;
        let scalars = scalars
            .iter()
            .map(|&s| as_dtype(&g, s, dtype))
            .collect::<Result<Vec<_>>>()?;
        let (next, next_state) =
            optimizer.update(&g, (*param, *gradient, &handles), (lr, &scalars))?;
        for (target, value) in
            std::iter::once((*param, next)).chain(handles.into_iter().zip(next_state))
        {
            let kept = g.select(finite, value, target)?;
            g.write_at(target, kept, at_start, 0)?;
        }
    }
    g.set_outputs(vec![loss, norm]);
    let spec = |(name, _, shape): (String, NodeId, Shape)| TensorSpec { name, shape };
    Ok(StepGraph {
        graph: g,
        params: trainable.into_iter().map(spec).collect(),
        state,
        fixed: fixed.into_iter().map(spec).collect(),
        batch,
    })
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
