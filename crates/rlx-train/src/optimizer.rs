//! Which optimizer a trainer runs, the state it keeps per param, and the update
//! nodes it adds to the step graph.

use rlx_ir::{Adam, Graph, NodeId, Result, Sgd};

/// The update rule of a training step (PyTorch's definitions; see
/// [`Graph::sgd_step`] and [`Graph::adam_step_corrected`]).
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum Optimizer {
    /// SGD, with momentum and Nesterov when set.
    Sgd(Sgd),
    /// Adam, or AdamW when `decoupled`.
    Adam(Adam),
}

impl Optimizer {
    /// AdamW with PyTorch's defaults and the given weight decay.
    pub fn adamw(weight_decay: f64) -> Optimizer {
        Optimizer::Adam(Adam {
            weight_decay,
            ..Adam::default()
        })
    }

    /// The suffixes of the state tensors kept per param, named `param.suffix` (as
    /// PyTorch names the entries of an optimizer's state).
    pub fn state_suffixes(&self) -> &'static [&'static str] {
        match self {
            Optimizer::Sgd(s) if s.momentum != 0.0 => &["momentum_buffer"],
            Optimizer::Sgd(_) => &[],
            Optimizer::Adam(_) => &["exp_avg", "exp_avg_sq"],
        }
    }

    /// The names of the scalar inputs the step graph takes besides the learning rate,
    /// worked out on the host each step (Adam's bias corrections, in `f64` as
    /// PyTorch does).
    pub fn scalar_inputs(&self) -> &'static [&'static str] {
        match self {
            Optimizer::Sgd(_) => &[],
            Optimizer::Adam(_) => &["train.adam.step_size", "train.adam.root_correction2"],
        }
    }

    /// The values of [`Optimizer::scalar_inputs`] for step `step` (from 0) at rate `lr`.
    pub fn scalars(&self, step: u64, lr: f64) -> Vec<f32> {
        match self {
            Optimizer::Sgd(_) => Vec::new(),
            Optimizer::Adam(a) => {
                let t = step as f64 + 1.0;
                let correction = |beta: f64| 1.0 - beta.powf(t);
                vec![
                    (lr / correction(a.beta1)) as f32,
                    correction(a.beta2).sqrt() as f32,
                ]
            }
        }
    }

    /// A one-line description, stored in checkpoints.
    pub fn describe(&self) -> String {
        format!("{self:?}")
    }

    /// The next values of a param and its state (in [`Optimizer::state_suffixes`]
    /// order) from its gradient, the learning rate and the nodes of
    /// [`Optimizer::scalar_inputs`].
    pub(crate) fn update(
        &self,
        g: &Graph,
        (param, gradient, state): (NodeId, NodeId, &[NodeId]),
        (lr, scalars): (NodeId, &[NodeId]),
    ) -> Result<(NodeId, Vec<NodeId>)> {
        match *self {
            Optimizer::Sgd(options) => {
                let (p, velocity) =
                    g.sgd_step((param, gradient, state.first().copied()), lr, options)?;
                Ok((p, velocity.into_iter().collect()))
            }
            Optimizer::Adam(options) => {
                let (p, m, v) = g.adam_step_corrected(
                    (param, gradient, state[0], state[1]),
                    (lr, scalars[0], scalars[1]),
                    options,
                )?;
                Ok((p, vec![m, v]))
            }
        }
    }
}
