//! The digits job: scikit-learn's 8x8 handwritten digits (fetched from its wheel),
//! a fixed train/test split, and an MLP or a small CNN trained to classify them.

use super::{JobReport, StepEvent, train_loop};
use crate::{LrSchedule, ModelBuilder, Network, Optimizer, Rng, TrainOptions, Trainer};
use rlx_driver::Device;
use rlx_ir::{CrossEntropy, DType, Error, Graph, Result, Shape, TensorRef};
use rlx_models::{ModelStore, packaged_dataset};
use rlx_runtime::{CompileOptions, Session};
use std::path::Path;

/// Pixels per image.
pub const PIXELS: usize = 64;
/// Classes (the digits 0-9).
pub const CLASSES: usize = 10;
/// Images held out for testing (a fifth of the 1797).
pub const TEST_IMAGES: usize = 360;
const SPLIT_SEED: u64 = 0x000d_1617;

/// The digits, split once and for all into train and test sets. Pixels are scaled
/// from 0-16 to 0-1.
#[derive(Clone, Debug)]
pub struct Digits {
    /// Training images, `PIXELS` values each.
    pub train_x: Vec<f32>,
    /// Their labels.
    pub train_y: Vec<i64>,
    /// Test images.
    pub test_x: Vec<f32>,
    /// Their labels.
    pub test_y: Vec<i64>,
}

impl Digits {
    /// Fetches the data once (into the store's cache) and splits it.
    pub fn fetch(store: &ModelStore) -> Result<Digits> {
        let dataset = packaged_dataset("digits")
            .ok_or_else(|| Error::invalid("digits", "the digits dataset is not packaged"))?;
        let dir = store.fetch(dataset)?;
        let csv = store.gunzip(&dir.join("digits.csv.gz"))?;
        Digits::from_csv(&csv)
    }

    /// Reads the CSV (a row per image: 64 pixels then the label) and splits it.
    pub fn from_csv(path: &Path) -> Result<Digits> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        let bad = |line: usize, message: String| Error::Format {
            path: path.display().to_string(),
            message: format!("line {line}: {message}"),
        };
        let mut images = Vec::new();
        for (i, line) in text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
        {
            let fields: Vec<&str> = line.split(',').collect();
            if fields.len() != PIXELS + 1 {
                return Err(bad(
                    i + 1,
                    format!("{} fields, expected {}", fields.len(), PIXELS + 1),
                ));
            }
            let values = fields
                .iter()
                .map(|f| f.trim().parse::<f64>())
                .collect::<std::result::Result<Vec<f64>, _>>()
                .map_err(|e| bad(i + 1, e.to_string()))?;
            if values[..PIXELS].iter().any(|p| !(0.0..=16.0).contains(p)) {
                return Err(bad(i + 1, "a pixel is outside 0-16".into()));
            }
            let label = values[PIXELS];
            if label.fract() != 0.0 || !(0.0..CLASSES as f64).contains(&label) {
                return Err(bad(i + 1, format!("label {label} is not a digit")));
            }
            images.push(values);
        }
        if images.len() <= TEST_IMAGES {
            return Err(bad(0, format!("only {} images", images.len())));
        }
        let mut order: Vec<usize> = (0..images.len()).collect();
        Rng::new(SPLIT_SEED).shuffle(&mut order);
        let (test, train) = order.split_at(TEST_IMAGES);
        let pick = |ids: &[usize]| {
            let x = ids
                .iter()
                .flat_map(|&i| images[i][..PIXELS].iter().map(|p| (p / 16.0) as f32))
                .collect();
            let y = ids.iter().map(|&i| images[i][PIXELS] as i64).collect();
            (x, y)
        };
        let (train_x, train_y) = pick(train);
        let (test_x, test_y) = pick(test);
        Ok(Digits {
            train_x,
            train_y,
            test_x,
            test_y,
        })
    }
}

/// Which network classifies the digits.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DigitsModel {
    /// 64 -> 256 -> 128 -> 10, ReLU between.
    Mlp,
    /// Two 3x3 convolutions (16 and 32 channels, ReLU), a 2x2 max pool, a linear layer.
    Cnn,
}

/// The settings of a digits run.
#[derive(Clone, Debug)]
pub struct DigitsConfig {
    /// The network.
    pub model: DigitsModel,
    /// Passes over the training set.
    pub epochs: usize,
    /// Images per step (the last partial batch of an epoch is dropped).
    pub batch: usize,
    /// Peak learning rate (AdamW, warmup then cosine decay).
    pub lr: f64,
    /// Seed of the initial weights and the data order.
    pub seed: u64,
    /// Where to train.
    pub device: Device,
    /// CPU threads (0: all).
    pub threads: usize,
    /// Time every kernel of the steps ([`Trainer::profile`]).
    pub profile: bool,
    /// Let the f32 products round their operands to bfloat16 on a CPU with AMX
    /// ([`CompileOptions::allow_bf16`]).
    pub bf16_products: bool,
}

impl Default for DigitsConfig {
    fn default() -> DigitsConfig {
        DigitsConfig {
            model: DigitsModel::Mlp,
            epochs: 20,
            batch: 32,
            lr: 5e-3,
            seed: 1,
            device: Device::Cpu,
            threads: 0,
            profile: false,
            bf16_products: false,
        }
    }
}

/// The network's logits for a batch of `rows` images, with its initial weights.
pub fn digits_network(model: DigitsModel, rows: usize, seed: u64) -> Result<Network> {
    let g = Graph::new(match model {
        DigitsModel::Mlp => "digits-mlp",
        DigitsModel::Cnn => "digits-cnn",
    });
    let x = g.input("x", Shape::new(&[rows, PIXELS], DType::F32))?;
    let mut m = ModelBuilder::new(&g, seed);
    let relu = |x| g.unary(rlx_ir::UnaryOp::Relu, x);
    let logits = match model {
        DigitsModel::Mlp => {
            let h = relu(m.linear("fc1", x, 256, true)?)?;
            let h = relu(m.linear("fc2", h, 128, true)?)?;
            m.linear("out", h, CLASSES, true)?
        }
        DigitsModel::Cnn => {
            let image = g.reshape(x, &[rows, 1, 8, 8])?;
            let h = relu(m.conv2d("conv1", image, 16, 3, 1)?)?;
            let h = relu(m.conv2d("conv2", h, 32, 3, 1)?)?;
            let h = g.max_pool2d(h, [2, 2], [2, 2], [0; 4])?;
            let h = g.reshape(h, &[rows, 32 * 16])?;
            m.linear("out", h, CLASSES, true)?
        }
    };
    g.set_outputs(vec![logits]);
    let init = m.into_initial_values();
    Ok(Network {
        graph: g,
        output: logits,
        init,
    })
}

/// Trains on the digits and reports the test accuracy (metric `test_accuracy`);
/// `on_step` sees every step.
pub fn train_digits(
    data: &Digits,
    config: &DigitsConfig,
    on_step: &mut dyn FnMut(&StepEvent),
) -> Result<(Trainer, JobReport)> {
    let whole = |x: &[f32], y: &[i64]| x.len() == y.len() * PIXELS;
    if !whole(&data.train_x, &data.train_y) || !whole(&data.test_x, &data.test_y) {
        return Err(Error::invalid(
            "digits",
            format!("each image needs {PIXELS} pixels and one label; the sets disagree in length"),
        ));
    }
    if config.batch == 0 || config.batch > data.train_y.len() {
        return Err(Error::invalid(
            "digits",
            format!(
                "the batch must hold 1 to {} images, got {}",
                data.train_y.len(),
                config.batch
            ),
        ));
    }
    let session = Session::new(config.device);
    let Network {
        graph: g,
        output: logits,
        init,
    } = digits_network(config.model, config.batch, config.seed)?;
    let y = g.input("y", Shape::new(&[config.batch], DType::I64))?;
    let loss = g.cross_entropy(logits, y, CrossEntropy::default())?;
    let per_epoch = data.train_y.len() / config.batch;
    let total = (per_epoch * config.epochs) as u64;
    let options = TrainOptions::new(Optimizer::adamw(1e-4))
        .schedule(LrSchedule::WarmupCosine {
            lr: config.lr,
            min_lr: config.lr * 0.01,
            warmup: (total / 20).min(100),
            total,
        })
        .compile_options(
            CompileOptions::new()
                .threads(config.threads)
                .allow_bf16(config.bf16_products),
        );
    let mut trainer = Trainer::new(&session, &g, loss, options)?;
    trainer.set_profiling(config.profile);
    for (name, values) in &init {
        trainer.set_param(name, values)?;
    }

    let mut rng = Rng::new(config.seed ^ 0x5eed);
    let mut order: Vec<usize> = (0..data.train_y.len()).collect();
    let (mut xs, mut ys) = (vec![0f32; config.batch * PIXELS], vec![0i64; config.batch]);
    let mut next_batch = |step: u64, xs: &mut [f32], ys: &mut [i64]| {
        let within = step as usize % per_epoch;
        if within == 0 {
            rng.shuffle(&mut order);
        }
        for (r, &i) in order[within * config.batch..][..config.batch]
            .iter()
            .enumerate()
        {
            xs[r * PIXELS..][..PIXELS].copy_from_slice(&data.train_x[i * PIXELS..][..PIXELS]);
            ys[r] = data.train_y[i];
        }
    };
    let mut report = train_loop(&mut trainer, total, on_step, |t, step| {
        next_batch(step, &mut xs, &mut ys);
        t.step(&[("x", TensorRef::F32(&xs)), ("y", TensorRef::I64(&ys))])
    })?;

    let accuracy = test_accuracy(&mut trainer, &session, data, config.model)?;
    report.metrics.push(("test_accuracy".into(), accuracy));
    Ok((trainer, report))
}

/// The share of test images the trainer's current params classify correctly.
pub fn test_accuracy(
    trainer: &mut Trainer,
    session: &Session,
    data: &Digits,
    model: DigitsModel,
) -> Result<f64> {
    let rows = data.test_y.len();
    let forward = digits_network(model, rows, 0)?;
    let mut eval = trainer.evaluator(session, &forward.graph)?;
    let logits = eval.run(trainer, &[("x", TensorRef::F32(&data.test_x))])?;
    let logits = logits[0].as_ref().to_f64_vec();
    let correct = logits
        .chunks(CLASSES)
        .zip(&data.test_y)
        .filter(|(row, label)| {
            let best = row
                .iter()
                .enumerate()
                .fold(0, |b, (i, &v)| if v > row[b] { i } else { b });
            best as i64 == **label
        })
        .count();
    Ok(correct as f64 / rows as f64)
}
