//! Optimizer updates as graph nodes, built from primitives: each takes a param, its
//! gradient and its state and gives their next values, by PyTorch's definitions, so a
//! training step can be one graph that writes them back into persistent storage.

use crate::{BinaryOp, Error, Graph, NodeId, Result, UnaryOp};

/// Settings of [`Graph::sgd_step`] (PyTorch's `SGD` with no dampening).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Sgd {
    /// Momentum factor (0 for none).
    pub momentum: f64,
    /// Nesterov momentum.
    pub nesterov: bool,
    /// L2 penalty added to the gradient.
    pub weight_decay: f64,
}

/// Settings of [`Graph::adam_step`] (PyTorch's `Adam`, or `AdamW` when `decoupled`).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct Adam {
    /// Decay of the first moment.
    pub beta1: f64,
    /// Decay of the second moment.
    pub beta2: f64,
    /// Added to the second moment's root.
    pub eps: f64,
    /// Weight decay: added to the gradient (Adam), or taken from the param before the
    /// update (AdamW).
    pub weight_decay: f64,
    /// AdamW's decoupled weight decay.
    pub decoupled: bool,
}

impl Default for Adam {
    /// PyTorch's `AdamW` defaults.
    fn default() -> Adam {
        Adam {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decoupled: true,
        }
    }
}

impl Graph {
    /// One SGD step: `(param', velocity')` from the param, its gradient, its momentum
    /// buffer (`None` without momentum) and the learning rate `lr` (a scalar node, so
    /// a schedule can feed it). With momentum, `velocity' = momentum velocity + g`
    /// (`g` the gradient plus the weight decay term) and the step is `velocity'`, or
    /// `g + momentum velocity'` with Nesterov; a zero buffer is the first step's.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the shapes differ, or momentum is set without a
    /// buffer.
    pub fn sgd_step(
        &self,
        (param, gradient, velocity): (NodeId, NodeId, Option<NodeId>),
        lr: NodeId,
        options: Sgd,
    ) -> Result<(NodeId, Option<NodeId>)> {
        self.same_state("sgd_step", param, &[gradient], velocity)?;
        let dtype = self.shape(param)?.dtype();
        let c = |v: f64| self.scalar(v, dtype);
        let mut g = gradient;
        if options.weight_decay != 0.0 {
            g = self.binary(
                BinaryOp::Add,
                g,
                self.binary(BinaryOp::Mul, param, c(options.weight_decay))?,
            )?;
        }
        let velocity = match (options.momentum, velocity) {
            (0.0, _) => None,
            (m, Some(buffer)) => {
                let next =
                    self.binary(BinaryOp::Add, self.binary(BinaryOp::Mul, buffer, c(m))?, g)?;
                g = if options.nesterov {
                    self.binary(BinaryOp::Add, g, self.binary(BinaryOp::Mul, next, c(m))?)?
                } else {
                    next
                };
                Some(next)
            }
            (_, None) => {
                return Err(Error::invalid(
                    "sgd_step",
                    "momentum needs a velocity buffer",
                ));
            }
        };
        let step = self.binary(BinaryOp::Mul, g, lr)?;
        Ok((self.binary(BinaryOp::Sub, param, step)?, velocity))
    }

    /// One Adam or AdamW step: `(param', m', v')` from the param, its gradient, its
    /// first and second moments, the learning rate `lr` and the step number `t`
    /// (scalar nodes; `t` counts from 1 and sets the bias corrections `1 - beta^t`).
    ///
    /// The corrections are computed in the graph; where `t` is known on the host,
    /// [`Graph::adam_step_corrected`] with corrections computed there in `f64` is more
    /// accurate in the first steps (`1 - beta2^t` cancels badly near `t = 1`).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the shapes differ or a beta is outside `[0, 1)`.
    pub fn adam_step(
        &self,
        (param, gradient, m, v): (NodeId, NodeId, NodeId, NodeId),
        (lr, t): (NodeId, NodeId),
        options: Adam,
    ) -> Result<(NodeId, NodeId, NodeId)> {
        check_betas(&options)?;
        let dtype = self.shape(param)?.dtype();
        let c = |x: f64| self.scalar(x, dtype);
        // 1 - beta^t, as 1 - exp(t ln beta).
        let correction = |beta: f64| -> Result<NodeId> {
            let power = self.unary(UnaryOp::Exp, self.binary(BinaryOp::Mul, t, c(beta.ln()))?)?;
            self.binary(BinaryOp::Sub, c(1.0), power)
        };
        let step_size = self.binary(BinaryOp::Div, lr, correction(options.beta1)?)?;
        let root_correction2 = self.unary(UnaryOp::Sqrt, correction(options.beta2)?)?;
        self.adam_step_corrected(
            (param, gradient, m, v),
            (lr, step_size, root_correction2),
            options,
        )
    }

    /// One Adam or AdamW step as PyTorch computes it, from scalar nodes worked out
    /// beforehand: `lr` (for the decoupled weight decay), `step_size = lr / (1 -
    /// beta1^t)` and `root_correction2 = sqrt(1 - beta2^t)`. The update is `param -
    /// step_size m' / (sqrt(v') / root_correction2 + eps)`.
    ///
    /// # Errors
    /// As [`Graph::adam_step`].
    pub fn adam_step_corrected(
        &self,
        (param, gradient, m, v): (NodeId, NodeId, NodeId, NodeId),
        (lr, step_size, root_correction2): (NodeId, NodeId, NodeId),
        options: Adam,
    ) -> Result<(NodeId, NodeId, NodeId)> {
        self.same_state("adam_step", param, &[gradient, m], Some(v))?;
        check_betas(&options)?;
        let dtype = self.shape(param)?.dtype();
        let c = |x: f64| self.scalar(x, dtype);
        let mul = |a, b| self.binary(BinaryOp::Mul, a, b);
        let add = |a, b| self.binary(BinaryOp::Add, a, b);
        let (mut p, mut g) = (param, gradient);
        if options.weight_decay != 0.0 {
            if options.decoupled {
                let keep = self.binary(BinaryOp::Sub, c(1.0), mul(lr, c(options.weight_decay))?)?;
                p = mul(p, keep)?;
            } else {
                g = add(g, mul(param, c(options.weight_decay))?)?;
            }
        }
        let m = add(mul(m, c(options.beta1))?, mul(g, c(1.0 - options.beta1))?)?;
        let v = add(
            mul(v, c(options.beta2))?,
            mul(mul(g, g)?, c(1.0 - options.beta2))?,
        )?;
        let root = self.binary(
            BinaryOp::Div,
            self.unary(UnaryOp::Sqrt, v)?,
            root_correction2,
        )?;
        let denominator = add(root, c(options.eps))?;
        let step = mul(self.binary(BinaryOp::Div, m, denominator)?, step_size)?;
        Ok((self.binary(BinaryOp::Sub, p, step)?, m, v))
    }

    /// The gradients scaled so that their global L2 norm is at most `max_norm`
    /// (PyTorch's `clip_grad_norm_`: the factor is `max_norm / (norm + 1e-6)`, capped
    /// at 1), and that norm, as a scalar node.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] for no gradients or a `max_norm` that is not positive.
    pub fn clip_by_global_norm(
        &self,
        gradients: &[NodeId],
        max_norm: f64,
    ) -> Result<(Vec<NodeId>, NodeId)> {
        let Some(&first) = gradients.first() else {
            return Err(Error::invalid("clip_by_global_norm", "no gradients given"));
        };
        if max_norm.is_nan() || max_norm <= 0.0 {
            return Err(Error::invalid(
                "clip_by_global_norm",
                format!("max_norm must be positive, got {max_norm}"),
            ));
        }
        let dtype = self.shape(first)?.dtype();
        let squares = |g: NodeId| self.sum(self.binary(BinaryOp::Mul, g, g)?, &[], false);
        let mut total = squares(first)?;
        for &g in &gradients[1..] {
            total = self.binary(BinaryOp::Add, total, squares(g)?)?;
        }
        let norm = self.unary(UnaryOp::Sqrt, total)?;
        let denominator = self.binary(BinaryOp::Add, norm, self.scalar(1e-6, dtype))?;
        let factor = self.binary(BinaryOp::Div, self.scalar(max_norm, dtype), denominator)?;
        let factor = self.binary(BinaryOp::Min, factor, self.scalar(1.0, dtype))?;
        let clipped = gradients
            .iter()
            .map(|&g| self.binary(BinaryOp::Mul, g, factor))
            .collect::<Result<Vec<_>>>()?;
        Ok((clipped, norm))
    }

    /// Checks that `param`, `others` and `state` (if any) share one float shape.
    fn same_state(
        &self,
        op: &str,
        param: NodeId,
        others: &[NodeId],
        state: Option<NodeId>,
    ) -> Result<()> {
        let shape = self.shape(param)?;
        if !shape.dtype().is_float() {
            return Err(Error::invalid(
                op,
                format!("the param must be a float tensor, got {shape}"),
            ));
        }
        for &x in others.iter().chain(state.iter()) {
            let other = self.shape(x)?;
            if other != shape {
                return Err(Error::invalid(
                    op,
                    format!("the param is {shape}, but its gradient or state is {other}"),
                ));
            }
        }
        Ok(())
    }
}

fn check_betas(options: &Adam) -> Result<()> {
    for beta in [options.beta1, options.beta2] {
        if !(0.0..1.0).contains(&beta) {
            return Err(Error::invalid(
                "adam_step",
                format!("betas must be in [0, 1), got {beta}"),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{HostTensor, evaluate};
    use crate::{DType, Shape};
    use std::collections::HashMap;

    fn run(g: &Graph, feed: &[(&str, Vec<f64>)]) -> Vec<Vec<f64>> {
        let mut values: HashMap<String, HostTensor> = HashMap::new();
        for (name, data) in feed {
            let id = g.inputs().into_iter().find(|(n, _, _)| n == name).unwrap();
            values.insert(name.to_string(), HostTensor::new(id.2, data.clone()));
        }
        evaluate(g, &mut values)
            .unwrap()
            .into_iter()
            .map(|t| t.data)
            .collect()
    }

    /// Three steps of each optimizer against PyTorch's update written out in loops.
    #[test]
    fn updates_match_their_definitions_over_steps() {
        let f = |d: &[usize]| Shape::new(d, DType::F64);
        let p0 = vec![0.5, -1.0, 2.0, 0.25];
        let grads = [
            vec![0.1, -0.2, 0.3, 0.0],
            vec![-0.4, 0.1, 0.2, 0.5],
            vec![0.3, 0.3, -0.1, -0.2],
        ];
        let lr = 0.05;
        for options in [
            Adam::default(),
            Adam {
                decoupled: false,
                weight_decay: 0.1,
                ..Adam::default()
            },
        ] {
            let g = Graph::new("adam");
            let [p, gr, m, v] = ["p", "g", "m", "v"].map(|n| g.input(n, f(&[4])).unwrap());
            let (lr_n, t_n) = (
                g.input("lr", f(&[])).unwrap(),
                g.input("t", f(&[])).unwrap(),
            );
            let (p2, m2, v2) = g.adam_step((p, gr, m, v), (lr_n, t_n), options).unwrap();
            // The same step from corrections worked out on the host.
            let (ss, rc) = (
                g.input("ss", f(&[])).unwrap(),
                g.input("rc", f(&[])).unwrap(),
            );
            let (p3, m3, v3) = g
                .adam_step_corrected((p, gr, m, v), (lr_n, ss, rc), options)
                .unwrap();
            g.set_outputs(vec![p2, m2, v2, p3, m3, v3]);
            let (mut pv, mut mv, mut vv) = (p0.clone(), vec![0.0; 4], vec![0.0; 4]);
            let (mut pw, mut mw, mut vw) = (p0.clone(), vec![0.0; 4], vec![0.0; 4]);
            for (step, grad) in grads.iter().enumerate() {
                let t = (step + 1) as f64;
                let out = run(
                    &g,
                    &[
                        ("p", pv),
                        ("g", grad.clone()),
                        ("m", mv),
                        ("v", vv),
                        ("lr", vec![lr]),
                        ("t", vec![t]),
                        ("ss", vec![lr / (1.0 - options.beta1.powf(t))]),
                        ("rc", vec![(1.0 - options.beta2.powf(t)).sqrt()]),
                    ],
                );
                for (a, b) in out[..3].iter().zip(&out[3..]) {
                    for (x, y) in a.iter().zip(b) {
                        assert!((x - y).abs() < 1e-12, "{options:?} step {t}: {x} vs {y}");
                    }
                }
                (pv, mv, vv) = (out[0].clone(), out[1].clone(), out[2].clone());
                for i in 0..4 {
                    let mut gi = grad[i];
                    if options.decoupled {
                        pw[i] *= 1.0 - lr * options.weight_decay;
                    } else {
                        gi += options.weight_decay * pw[i];
                    }
                    mw[i] = options.beta1 * mw[i] + (1.0 - options.beta1) * gi;
                    vw[i] = options.beta2 * vw[i] + (1.0 - options.beta2) * gi * gi;
                    let m_hat = mw[i] / (1.0 - options.beta1.powf(t));
                    let v_hat = vw[i] / (1.0 - options.beta2.powf(t));
                    pw[i] -= lr * m_hat / (v_hat.sqrt() + options.eps);
                }
                for i in 0..4 {
                    assert!(
                        (pv[i] - pw[i]).abs() < 1e-12,
                        "{options:?} step {t} p[{i}]: {} vs {}",
                        pv[i],
                        pw[i]
                    );
                    assert!((mv[i] - mw[i]).abs() < 1e-12 && (vv[i] - vw[i]).abs() < 1e-12);
                }
            }
        }
        for (momentum, nesterov) in [(0.0, false), (0.9, false), (0.9, true)] {
            let options = Sgd {
                momentum,
                nesterov,
                weight_decay: 0.01,
            };
            let g = Graph::new("sgd");
            let [p, gr, b] = ["p", "g", "b"].map(|n| g.input(n, f(&[4])).unwrap());
            let lr_n = g.input("lr", f(&[])).unwrap();
            let (p2, b2) = g.sgd_step((p, gr, Some(b)), lr_n, options).unwrap();
            g.set_outputs(vec![p2, b2.unwrap_or(b)]);
            let (mut pv, mut bv) = (p0.clone(), vec![0.0; 4]);
            let (mut pw, mut bw) = (p0.clone(), vec![0.0; 4]);
            for grad in &grads {
                let out = run(
                    &g,
                    &[("p", pv), ("g", grad.clone()), ("b", bv), ("lr", vec![lr])],
                );
                (pv, bv) = (out[0].clone(), out[1].clone());
                for i in 0..4 {
                    let mut gi = grad[i] + options.weight_decay * pw[i];
                    if momentum != 0.0 {
                        bw[i] = momentum * bw[i] + gi;
                        gi = if nesterov {
                            gi + momentum * bw[i]
                        } else {
                            bw[i]
                        };
                    }
                    pw[i] -= lr * gi;
                }
                for i in 0..4 {
                    assert!(
                        (pv[i] - pw[i]).abs() < 1e-12,
                        "sgd {momentum} {nesterov} p[{i}]"
                    );
                }
            }
        }
    }

    #[test]
    fn clipping_scales_only_past_the_norm() {
        let f = |d: &[usize]| Shape::new(d, DType::F64);
        let g = Graph::new("clip");
        let a = g.input("a", f(&[2])).unwrap();
        let b = g.input("b", f(&[1])).unwrap();
        let (clipped, norm) = g.clip_by_global_norm(&[a, b], 1.0).unwrap();
        let (kept, _) = g.clip_by_global_norm(&[a, b], 10.0).unwrap();
        g.set_outputs(vec![clipped[0], clipped[1], norm, kept[0]]);
        let out = run(&g, &[("a", vec![3.0, 0.0]), ("b", vec![4.0])]);
        assert_eq!(out[2], vec![5.0]);
        let factor = 1.0 / (5.0 + 1e-6);
        assert!(
            (out[0][0] - 3.0 * factor).abs() < 1e-15 && (out[1][0] - 4.0 * factor).abs() < 1e-15
        );
        assert_eq!(out[3], vec![3.0, 0.0]);
    }

    #[test]
    fn bad_settings_and_shapes_are_errors() {
        let g = Graph::new("bad");
        let p = g.input("p", Shape::new(&[4], DType::F32)).unwrap();
        let other = g.input("q", Shape::new(&[3], DType::F32)).unwrap();
        let lr = g.input("lr", Shape::new(&[], DType::F32)).unwrap();
        let sgd = Sgd {
            momentum: 0.9,
            nesterov: false,
            weight_decay: 0.0,
        };
        let e = g
            .sgd_step((p, other, None), lr, sgd)
            .unwrap_err()
            .to_string();
        assert!(e.contains("gradient or state"), "{e}");
        let e = g.sgd_step((p, p, None), lr, sgd).unwrap_err().to_string();
        assert!(e.contains("velocity"), "{e}");
        let bad_beta = Adam {
            beta1: 1.0,
            ..Adam::default()
        };
        let e = g
            .adam_step((p, p, p, p), (lr, lr), bad_beta)
            .unwrap_err()
            .to_string();
        assert!(e.contains("betas"), "{e}");
        let e = g.clip_by_global_norm(&[], 1.0).unwrap_err().to_string();
        assert!(e.contains("no gradients"), "{e}");
        let e = g.clip_by_global_norm(&[p], 0.0).unwrap_err().to_string();
        assert!(e.contains("positive"), "{e}");
        // Still usable.
        assert!(g.adam_step((p, p, p, p), (lr, lr), Adam::default()).is_ok());
    }
}
