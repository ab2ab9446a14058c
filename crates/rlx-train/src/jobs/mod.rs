//! Ready-made training jobs with their data: the digits classifier and the
//! character-level GPT. Each reports its losses and metrics; the caller shows the
//! progress and writes the files.

mod charlm;
mod digits;

pub use charlm::{
    CharCorpus, CharLmConfig, VOCAB, charlm_loss_graph, charlm_network, sample, train_charlm,
    training_starts, validation_loss,
};

pub use digits::{
    CLASSES, Digits, DigitsConfig, DigitsModel, PIXELS, TEST_IMAGES, digits_network, test_accuracy,
    train_digits,
};

use crate::Trainer;
use rlx_ir::Result;
use std::time::Instant;

/// What a job says after each step.
#[derive(Clone, Debug, PartialEq)]
pub struct StepEvent {
    /// Steps done, this one included.
    pub step: u64,
    /// Steps the job runs.
    pub total: u64,
    /// This step's loss.
    pub loss: f32,
    /// The learning rate it used.
    pub lr: f64,
    /// Seconds since the job's first step began.
    pub elapsed: f64,
}

/// The outcome of a job.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct JobReport {
    /// The loss of every step.
    pub losses: Vec<f32>,
    /// Seconds spent in the steps.
    pub train_seconds: f64,
    /// Seconds each step took.
    pub step_seconds: Vec<f64>,
    /// Named results (`test_accuracy`, `val_loss`, ...).
    pub metrics: Vec<(String, f64)>,
    /// Named text results (`sample`).
    pub texts: Vec<(String, String)>,
}

impl JobReport {
    /// A named metric.
    pub fn metric(&self, name: &str) -> Option<f64> {
        self.metrics.iter().find(|m| m.0 == name).map(|m| m.1)
    }
}

/// Runs `step(trainer, n)` from the trainer's current step until `total`, telling
/// `on_step` after each.
pub(crate) fn train_loop(
    trainer: &mut Trainer,
    total: u64,
    on_step: &mut dyn FnMut(&StepEvent),
    mut step: impl FnMut(&mut Trainer, u64) -> Result<f32>,
) -> Result<JobReport> {
    let start = Instant::now();
    let mut report = JobReport::default();
    while trainer.steps() < total {
        let n = trainer.steps();
        let lr = trainer.learning_rate();
        let began = Instant::now();
        let loss = step(trainer, n)?;
        report.step_seconds.push(began.elapsed().as_secs_f64());
        report.losses.push(loss);
        on_step(&StepEvent {
            step: n + 1,
            total,
            loss,
            lr,
            elapsed: start.elapsed().as_secs_f64(),
        });
    }
    report.train_seconds = start.elapsed().as_secs_f64();
    Ok(report)
}
