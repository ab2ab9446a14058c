//! Learning-rate schedules, evaluated on the host in `f64` for each step and fed to
//! the step graph as a scalar (as PyTorch's schedulers compute the rate in Python).

use rlx_ir::{Error, Result};

/// The learning rate as a function of the step number.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum LrSchedule {
    /// The same rate at every step.
    Constant(f64),
    /// A linear warmup from `lr / warmup` to `lr` over the first `warmup` steps, then a
    /// cosine decay from `lr` to `min_lr` that reaches it at step `total`, and stays.
    WarmupCosine {
        /// The peak rate.
        lr: f64,
        /// The rate the decay ends at.
        min_lr: f64,
        /// Steps of linear warmup (0 for none).
        warmup: u64,
        /// The step at which the decay ends.
        total: u64,
    },
}

impl LrSchedule {
    /// The rate at `step` (counting from 0).
    pub fn at(&self, step: u64) -> f64 {
        match *self {
            LrSchedule::Constant(lr) => lr,
            LrSchedule::WarmupCosine {
                lr,
                min_lr,
                warmup,
                total,
            } => {
                if step < warmup {
                    return lr * (step + 1) as f64 / warmup as f64;
                }
                if step >= total {
                    return min_lr;
                }
                let progress = (step - warmup) as f64 / (total - warmup).max(1) as f64;
                min_lr + 0.5 * (lr - min_lr) * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        }
    }

    /// Checks that the rates are finite and not negative and the warmup ends by `total`.
    pub fn validate(&self) -> Result<()> {
        let (rates, order) = match *self {
            LrSchedule::Constant(lr) => (vec![lr], true),
            LrSchedule::WarmupCosine {
                lr,
                min_lr,
                warmup,
                total,
            } => (vec![lr, min_lr], warmup <= total),
        };
        if let Some(bad) = rates.iter().find(|r| !r.is_finite() || **r < 0.0) {
            return Err(Error::invalid(
                "learning-rate schedule",
                format!("rates must be finite and not negative, got {bad}"),
            ));
        }
        if !order {
            return Err(Error::invalid(
                "learning-rate schedule",
                "the warmup must end by the total step count",
            ));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_to_the_floor() {
        let s = LrSchedule::WarmupCosine {
            lr: 1.0,
            min_lr: 0.1,
            warmup: 4,
            total: 14,
        };
        assert_eq!(s.at(0), 0.25);
        assert_eq!(s.at(3), 1.0);
        assert_eq!(s.at(4), 1.0);
        assert!((s.at(9) - 0.55).abs() < 1e-12, "halfway: {}", s.at(9));
        assert!((s.at(14) - 0.1).abs() < 1e-12);
        assert_eq!(s.at(1000), 0.1);
        let decay: Vec<f64> = (4..15).map(|t| s.at(t)).collect();
        assert!(decay.windows(2).all(|w| w[1] <= w[0]), "{decay:?}");
        assert_eq!(LrSchedule::Constant(0.3).at(77), 0.3);
    }

    #[test]
    fn bad_schedules_are_errors() {
        assert!(LrSchedule::Constant(f64::NAN).validate().is_err());
        assert!(LrSchedule::Constant(-1.0).validate().is_err());
        let late = LrSchedule::WarmupCosine {
            lr: 1.0,
            min_lr: 0.0,
            warmup: 10,
            total: 5,
        };
        assert!(late.validate().unwrap_err().to_string().contains("warmup"));
        assert!(LrSchedule::Constant(0.1).validate().is_ok());
    }
}
