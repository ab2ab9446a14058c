//! Training losses, built from primitives (no op of their own): every backend runs them
//! and the reverse mode differentiates them through their steps.

use crate::{BinaryOp, DType, Error, Graph, NodeId, Result, UnaryOp};

/// Options of [`Graph::cross_entropy`]: PyTorch's `ignore_index` and
/// `label_smoothing`.
#[derive(Clone, Copy, Debug, Default, PartialEq)]
pub struct CrossEntropy {
    /// Rows whose target is this class take no part: neither in the sum nor in the
    /// count the mean divides by.
    pub ignore_index: Option<i64>,
    /// The target distribution is `(1 - s)` on the class plus `s / C` on every class,
    /// for `s` in `[0, 1)`.
    pub label_smoothing: f64,
}

impl Graph {
    /// The mean cross-entropy of `logits [N, C]` (float) against class indices
    /// `targets [N]` (integer): `-Σ_c p_c log softmax(logits)_c` per row, with `p` the
    /// one-hot target smoothed as `options` says, averaged over the rows not ignored
    /// (0 when every row is). A scalar of the logits' dtype.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the logits are not a float matrix, the targets
    /// not an integer vector of one class per row, or the smoothing not in `[0, 1)`.
    pub fn cross_entropy(
        &self,
        logits: NodeId,
        targets: NodeId,
        options: CrossEntropy,
    ) -> Result<NodeId> {
        let (ls, ts) = (self.shape(logits)?, self.shape(targets)?);
        if ls.rank() != 2 || !ls.dtype().is_float() {
            return Err(Error::invalid(
                "cross_entropy",
                format!("logits must be a float [rows, classes] matrix, got {ls}"),
            ));
        }
        let integer = !ts.dtype().is_float() && ts.dtype() != DType::Bool;
        if ts.rank() != 1 || !integer || ts.dim(0) != ls.dim(0) {
            return Err(Error::invalid(
                "cross_entropy",
                format!(
                    "targets must be an integer vector of {} class indices, got {ts}",
                    ls.dim(0)
                ),
            ));
        }
        let smoothing = options.label_smoothing;
        if !(0.0..1.0).contains(&smoothing) {
            return Err(Error::invalid(
                "cross_entropy",
                format!("label smoothing must be in [0, 1), got {smoothing}"),
            ));
        }
        let (dtype, classes) = (ls.dtype(), ls.dim(1));
        let log_p = self.log_softmax(logits, -1)?;
        let kept = match options.ignore_index {
            Some(ignored) => Some(self.binary(
                BinaryOp::Ne,
                targets,
                self.scalar(ignored as f64, ts.dtype()),
            )?),
            None => None,
        };
        // An ignored row's index may be out of range: it picks class 0, then counts 0.
        let picked = match kept {
            Some(kept) => self.select(kept, targets, self.scalar(0.0, ts.dtype()))?,
            None => targets,
        };
        let mut target = self.one_hot(picked, classes, dtype)?;
        if smoothing > 0.0 {
            let on = self.binary(BinaryOp::Mul, target, self.scalar(1.0 - smoothing, dtype))?;
            target = self.binary(
                BinaryOp::Add,
                on,
                self.scalar(smoothing / classes as f64, dtype),
            )?;
        }
        let rows = self.unary(
            UnaryOp::Neg,
            self.sum(self.binary(BinaryOp::Mul, target, log_p)?, &[1], false)?,
        )?;
        match kept {
            None => self.reduce(crate::ReduceOp::Mean, rows, &[], false),
            Some(kept) => {
                let weight = self.cast(kept, dtype)?;
                let total = self.sum(self.binary(BinaryOp::Mul, rows, weight)?, &[], false)?;
                let count = self.sum(weight, &[], false)?;
                let count = self.binary(BinaryOp::Max, count, self.scalar(1.0, dtype))?;
                self.binary(BinaryOp::Div, total, count)
            }
        }
    }

    /// The mean squared error of `prediction` against `target` (same shape and float
    /// dtype): `mean((prediction - target)²)`, a scalar.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the shapes differ or are not float.
    pub fn mse(&self, prediction: NodeId, target: NodeId) -> Result<NodeId> {
        let (ps, ts) = (self.shape(prediction)?, self.shape(target)?);
        if ps != ts || !ps.dtype().is_float() {
            return Err(Error::invalid(
                "mse",
                format!(
                    "prediction and target must be float tensors of one shape, got {ps} and {ts}"
                ),
            ));
        }
        let error = self.binary(BinaryOp::Sub, prediction, target)?;
        let square = self.binary(BinaryOp::Mul, error, error)?;
        self.reduce(crate::ReduceOp::Mean, square, &[], false)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reference::{HostTensor, evaluate};
    use crate::{Shape, TensorData};
    use std::collections::HashMap;

    /// The loss by the definition, in plain loops.
    fn by_hand(logits: &[f64], classes: usize, targets: &[i64], options: CrossEntropy) -> f64 {
        let (mut total, mut count) = (0.0, 0.0);
        for (row, &t) in logits.chunks(classes).zip(targets) {
            if options.ignore_index == Some(t) {
                continue;
            }
            let max = row.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let log_sum = row.iter().map(|v| (v - max).exp()).sum::<f64>().ln() + max;
            let s = options.label_smoothing;
            for (c, v) in row.iter().enumerate() {
                let p = if c as i64 == t { 1.0 - s } else { 0.0 } + s / classes as f64;
                total -= p * (v - log_sum);
            }
            count += 1.0;
        }
        if count == 0.0 { 0.0 } else { total / count }
    }

    #[test]
    fn cross_entropy_matches_its_definition() {
        let logits: Vec<f64> = (0..20)
            .map(|i| ((i * 37) % 11) as f64 * 0.3 - 1.4)
            .collect();
        let targets = [2i64, -100, 0, 4];
        for options in [
            CrossEntropy::default(),
            CrossEntropy {
                ignore_index: Some(-100),
                label_smoothing: 0.0,
            },
            CrossEntropy {
                ignore_index: Some(-100),
                label_smoothing: 0.1,
            },
            CrossEntropy {
                ignore_index: Some(2),
                label_smoothing: 0.25,
            },
        ] {
            // Without an ignore index, -100 is no class: use 1 there instead.
            let t: Vec<i64> = targets
                .iter()
                .map(|&v| {
                    if v < 0 && options.ignore_index.is_none() {
                        1
                    } else {
                        v
                    }
                })
                .collect();
            let g = Graph::new("ce");
            let x = g.input("x", Shape::new(&[4, 5], DType::F64)).unwrap();
            let ids = g.constant(TensorData::I64(t.clone()), &[4]).unwrap();
            let loss = g.cross_entropy(x, ids, options).unwrap();
            g.set_outputs(vec![loss]);
            let mut feed = HashMap::new();
            feed.insert(
                "x".to_string(),
                HostTensor::new(Shape::new(&[4, 5], DType::F64), logits.clone()),
            );
            let got = evaluate(&g, &mut feed).unwrap()[0].data[0];
            let want = by_hand(&logits, 5, &t, options);
            assert!((got - want).abs() < 1e-12, "{options:?}: {got} vs {want}");
        }
    }

    #[test]
    fn every_row_ignored_gives_zero_and_mse_is_the_mean_square() {
        let g = Graph::new("edge");
        let x = g.input("x", Shape::new(&[2, 3], DType::F32)).unwrap();
        let y = g.input("y", Shape::new(&[2, 3], DType::F32)).unwrap();
        let ids = g.constant(TensorData::I64(vec![-1, -1]), &[2]).unwrap();
        let options = CrossEntropy {
            ignore_index: Some(-1),
            label_smoothing: 0.0,
        };
        let none = g.cross_entropy(x, ids, options).unwrap();
        let mse = g.mse(x, y).unwrap();
        g.set_outputs(vec![none, mse]);
        let mut feed = HashMap::new();
        let shape = Shape::new(&[2, 3], DType::F32);
        feed.insert(
            "x".into(),
            HostTensor::new(shape.clone(), vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]),
        );
        feed.insert(
            "y".into(),
            HostTensor::new(shape, vec![1.0, 0.0, 3.0, 4.0, 5.0, 9.0]),
        );
        let out = evaluate(&g, &mut feed).unwrap();
        assert_eq!(out[0].data[0], 0.0);
        // f32 values: the mean rounded to f32.
        assert_eq!(out[1].data[0], f64::from((4.0f32 + 9.0) / 6.0));
    }

    #[test]
    fn bad_losses_are_errors_that_say_what_was_expected() {
        let g = Graph::new("bad");
        let x = g.input("x", Shape::new(&[4, 5], DType::F32)).unwrap();
        let floats = g.input("f", Shape::new(&[4], DType::F32)).unwrap();
        let short = g.constant(TensorData::I64(vec![0, 1, 2]), &[3]).unwrap();
        let ids = g.constant(TensorData::I64(vec![0, 1, 2, 3]), &[4]).unwrap();
        let expect = |r: Result<NodeId>, what: &str| {
            let e = r.unwrap_err().to_string();
            assert!(e.contains(what), "{e}");
        };
        expect(
            g.cross_entropy(x, floats, CrossEntropy::default()),
            "integer vector of 4",
        );
        expect(
            g.cross_entropy(x, short, CrossEntropy::default()),
            "integer vector of 4",
        );
        expect(
            g.cross_entropy(ids, ids, CrossEntropy::default()),
            "float [rows, classes]",
        );
        let smooth = CrossEntropy {
            ignore_index: None,
            label_smoothing: 1.0,
        };
        expect(g.cross_entropy(x, ids, smooth), "label smoothing");
        expect(g.mse(x, floats), "one shape");
        // The graph still builds after the rejected calls.
        assert!(g.cross_entropy(x, ids, CrossEntropy::default()).is_ok());
    }
}
