//! The training step on every device: against the reference evaluator of the same
//! step graph, resumed from a checkpoint bit for bit, refusing non-finite steps and
//! bad input while staying usable.

mod common;

use common::test_devices;
use rlx::ir::reference::{HostTensor, evaluate};
use rlx::prelude::*;
use rlx::train::{LR_INPUT, STEP_INPUT};
use std::collections::HashMap;

/// splitmix64, for reproducible test data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    fn uniform(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n)
            .map(|_| ((self.next() >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * scale)
            .collect()
    }

    fn classes(&mut self, n: usize, classes: u64) -> Vec<i64> {
        (0..n).map(|_| (self.next() % classes) as i64).collect()
    }
}

const ROWS: usize = 16;
const FEATURES: usize = 10;
const HIDDEN: usize = 24;
const CLASSES: usize = 5;

/// A two-layer classifier's logits for `x`.
fn logits(g: &Graph, x: NodeId) -> Result<NodeId> {
    let f32s = |dims: &[usize]| Shape::new(dims, DType::F32);
    let w1 = g.param("w1", f32s(&[FEATURES, HIDDEN]))?;
    let b1 = g.param("b1", f32s(&[HIDDEN]))?;
    let w2 = g.param("w2", f32s(&[HIDDEN, CLASSES]))?;
    let h = g.unary(UnaryOp::Tanh, g.add(g.matmul(x, w1)?, b1)?)?;
    g.matmul(h, w2)
}

/// The classifier with a cross-entropy loss; returns the graph and its loss.
fn classifier() -> Result<(Graph, NodeId)> {
    classifier_of(ROWS)
}

/// The classifier for batches of `rows`.
fn classifier_of(rows: usize) -> Result<(Graph, NodeId)> {
    let g = Graph::new("classifier");
    let x = g.input("x", Shape::new(&[rows, FEATURES], DType::F32))?;
    let y = g.input("y", Shape::new(&[rows], DType::I64))?;
    let logits = logits(&g, x)?;
    g.set_outputs(vec![logits]);
    let options = CrossEntropy {
        ignore_index: None,
        label_smoothing: 0.05,
    };
    let loss = g.cross_entropy(logits, y, options)?;
    Ok((g, loss))
}

fn initial_params(seed: u64) -> Vec<(&'static str, Vec<f32>)> {
    let mut rng = Rng(seed);
    vec![
        ("w1", rng.uniform(FEATURES * HIDDEN, 0.4)),
        ("b1", rng.uniform(HIDDEN, 0.1)),
        ("w2", rng.uniform(HIDDEN * CLASSES, 0.4)),
    ]
}

struct Batch {
    x: Vec<f32>,
    y: Vec<i64>,
}

fn batches(seed: u64, n: usize) -> Vec<Batch> {
    let mut rng = Rng(seed);
    (0..n)
        .map(|_| Batch {
            x: rng.uniform(ROWS * FEATURES, 1.0),
            y: rng.classes(ROWS, CLASSES as u64),
        })
        .collect()
}

fn feed(b: &Batch) -> [(&'static str, TensorRef<'_>); 2] {
    [("x", TensorRef::F32(&b.x)), ("y", TensorRef::I64(&b.y))]
}

const SCHEDULE: LrSchedule = LrSchedule::WarmupCosine {
    lr: 0.05,
    min_lr: 0.005,
    warmup: 2,
    total: 6,
};

fn trainer(device: Device, optimizer: Optimizer) -> Result<Trainer> {
    let (g, loss) = classifier()?;
    let options = TrainOptions::new(optimizer)
        .schedule(SCHEDULE)
        .clip_norm(1.0);
    let mut t = Trainer::new(&Session::new(device), &g, loss, options)?;
    for (name, values) in initial_params(7) {
        t.set_param(name, &values)?;
    }
    Ok(t)
}

fn optimizers() -> Vec<Optimizer> {
    vec![
        Optimizer::Sgd(Sgd {
            momentum: 0.9,
            nesterov: true,
            weight_decay: 0.01,
        }),
        Optimizer::Adam(Adam {
            eps: 1e-4,
            ..Adam::default()
        }),
    ]
}

fn host(shape: &Shape, values: Vec<f64>) -> HostTensor {
    HostTensor::new(shape.clone(), values)
}

#[test]
fn steps_match_the_reference_evaluator_on_every_device() -> Result<()> {
    let data = batches(11, 5);
    for optimizer in optimizers() {
        // The step graph run by the reference evaluator in f64, with the params and
        // state persisting in its value map as handles do.
        let reference = trainer(Device::Cpu, optimizer)?;
        let g = reference.step_graph().clone();
        let mut values: HashMap<String, HostTensor> = HashMap::new();
        for (name, init) in initial_params(7) {
            let spec = reference.params().iter().find(|p| p.name == name).unwrap();
            values.insert(
                name.into(),
                host(&spec.shape, init.iter().map(|&v| v as f64).collect()),
            );
        }
        for s in reference.state() {
            values.insert(
                s.name.clone(),
                host(&s.shape, vec![0.0; s.shape.num_elements()]),
            );
        }
        let mut expected_losses = Vec::new();
        for (step, b) in data.iter().enumerate() {
            values.insert(
                "x".into(),
                host(
                    &Shape::new(&[ROWS, FEATURES], DType::F32),
                    b.x.iter().map(|&v| v as f64).collect(),
                ),
            );
            values.insert(
                "y".into(),
                host(
                    &Shape::new(&[ROWS], DType::I64),
                    b.y.iter().map(|&v| v as f64).collect(),
                ),
            );
            let rate = SCHEDULE.at(step as u64);
            values.insert(
                LR_INPUT.into(),
                host(&Shape::scalar(DType::F32), vec![rate as f32 as f64]),
            );
            values.insert(
                STEP_INPUT.into(),
                host(&Shape::new(&[1], DType::I64), vec![step as f64]),
            );
            let scalars = optimizer.scalars(step as u64, rate);
            for (name, value) in optimizer.scalar_inputs().iter().zip(scalars) {
                values.insert(
                    name.to_string(),
                    host(&Shape::scalar(DType::F32), vec![value as f64]),
                );
            }
            let out = evaluate(&g, &mut values)?;
            expected_losses.push(out[0].data[0]);
        }

        for device in test_devices() {
            let mut t = trainer(device, optimizer)?;
            for (step, b) in data.iter().enumerate() {
                let loss = t.step(&feed(b))? as f64;
                let want = expected_losses[step];
                assert!(
                    (loss - want).abs() <= 1e-5 * want.abs().max(1.0),
                    "{optimizer:?} on {device}: step {step} loss {loss}, reference {want}"
                );
            }
            assert_eq!(t.steps(), data.len() as u64);
            for p in t.params().iter().chain(t.state()) {
                let got = t.tensor(&p.name)?;
                let want = &values[&p.name].data;
                let worst = got
                    .iter()
                    .zip(want)
                    .map(|(&a, &b)| (a as f64 - b).abs() / b.abs().max(1e-2))
                    .fold(0.0, f64::max);
                assert!(
                    worst < 1e-4,
                    "{optimizer:?} on {device}: '{}' differs from the reference by {worst:e} (relative)",
                    p.name
                );
            }
        }
    }
    Ok(())
}

fn bits(t: &Trainer) -> Result<Vec<Vec<u32>>> {
    t.params()
        .iter()
        .chain(t.state())
        .map(|p| Ok(t.tensor(&p.name)?.iter().map(|v| v.to_bits()).collect()))
        .collect()
}

#[test]
fn a_resumed_run_is_bit_identical() -> Result<()> {
    let data = batches(21, 6);
    let dir = std::env::temp_dir().join(format!("rlx-resume-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| Error::invalid("test", e.to_string()))?;
    for device in test_devices() {
        for optimizer in optimizers() {
            let mut straight = trainer(device, optimizer)?;
            let straight_losses: Vec<u32> = data
                .iter()
                .map(|b| Ok(straight.step(&feed(b))?.to_bits()))
                .collect::<Result<_>>()?;

            let path = dir.join("half-way.safetensors");
            let mut first = trainer(device, optimizer)?;
            let mut losses = Vec::new();
            for b in &data[..3] {
                losses.push(first.step(&feed(b))?.to_bits());
            }
            first.save_checkpoint(&path)?;
            drop(first);
            // A new trainer, its params set to something else, then resumed.
            let mut resumed = trainer(device, optimizer)?;
            resumed.step(&feed(&data[5]))?;
            resumed.load_checkpoint(&path)?;
            assert_eq!(resumed.steps(), 3);
            for b in &data[3..] {
                losses.push(resumed.step(&feed(b))?.to_bits());
            }
            assert_eq!(losses, straight_losses, "{optimizer:?} on {device}: losses");
            assert!(
                bits(&resumed)? == bits(&straight)?,
                "{optimizer:?} on {device}: params or state differ after resuming"
            );
        }
    }
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

#[test]
fn a_non_finite_step_changes_nothing_and_names_its_step() -> Result<()> {
    let data = batches(31, 3);
    for device in test_devices() {
        let mut t = trainer(device, optimizers()[1])?;
        t.step(&feed(&data[0]))?;
        let before = bits(&t)?;
        let mut poisoned = Batch {
            x: data[1].x.clone(),
            y: data[1].y.clone(),
        };
        poisoned.x[5] = f32::NAN;
        let err = t.step(&feed(&poisoned)).unwrap_err().to_string();
        assert!(
            err.contains("training step 1") && err.contains("NaN"),
            "on {device}: {err}"
        );
        poisoned.x[5] = f32::INFINITY;
        assert!(
            t.step(&feed(&poisoned)).is_err(),
            "on {device}: an infinite input trained"
        );
        assert_eq!(t.steps(), 1);
        assert!(
            bits(&t)? == before,
            "on {device}: a rejected step wrote its update"
        );
        let loss = t.step(&feed(&data[1]))?;
        assert!(loss.is_finite() && t.steps() == 2);
    }
    Ok(())
}

#[test]
fn bad_input_is_an_error_and_the_trainer_still_works() -> Result<()> {
    let session = Session::new(Device::Cpu);
    let adam = Optimizer::adamw(0.01);
    let (g, loss) = classifier()?;

    // The loss must be one element.
    let logits = g.outputs()[0];
    let err = Trainer::new(&session, &g, logits, TrainOptions::new(adam)).unwrap_err();
    assert!(err.to_string().contains("one element"), "{err}");
    // A frozen name that is not a param.
    let err = Trainer::new(&session, &g, loss, TrainOptions::new(adam).freeze(&["w9"]))
        .unwrap_err()
        .to_string();
    assert!(err.contains("w9") && err.contains("w1"), "{err}");
    // A path with no gradient: the loss reaches the weights only through an argmax.
    let h = Graph::new("argmax");
    let x = h.input("x", Shape::new(&[4, 3], DType::F32))?;
    let w = h.param("w", Shape::new(&[3, 3], DType::F32))?;
    let picked = h.argmax(h.matmul(x, w)?, -1, false)?;
    let bad = h.sum(h.cast(picked, DType::F32)?, &[], false)?;
    let err = Trainer::new(&session, &h, bad, TrainOptions::new(adam))
        .unwrap_err()
        .to_string();
    assert!(err.contains("argmax"), "{err}");
    // Bad settings.
    let err = Trainer::new(&session, &g, loss, TrainOptions::new(adam).clip_norm(0.0))
        .unwrap_err()
        .to_string();
    assert!(err.contains("clip_norm"), "{err}");

    let mut t = trainer(Device::Cpu, adam)?;
    let data = batches(41, 2);
    let b = &data[0];
    // Mismatched batch shapes, a missing input, an unknown one, a wrong dtype.
    let err = t
        .step(&[
            ("x", TensorRef::F32(&b.x[..20])),
            ("y", TensorRef::I64(&b.y)),
        ])
        .unwrap_err()
        .to_string();
    assert!(err.contains("'x'") && err.contains("160"), "{err}");
    let err = t
        .step(&[("x", TensorRef::F32(&b.x))])
        .unwrap_err()
        .to_string();
    assert!(err.contains("'y'"), "{err}");
    let err = t
        .step(&[
            ("x", TensorRef::F32(&b.x)),
            ("y", TensorRef::I64(&b.y)),
            ("z", TensorRef::F32(&b.x)),
        ])
        .unwrap_err()
        .to_string();
    assert!(err.contains("'z'"), "{err}");
    let err = t
        .step(&[
            ("x", TensorRef::F32(&b.x)),
            ("y", TensorRef::F32(&b.x[..ROWS])),
        ])
        .unwrap_err()
        .to_string();
    assert!(err.contains("'y'") && err.contains("i64"), "{err}");
    // Params: unknown names and wrong lengths.
    assert!(
        t.set_param("w7", &[0.0])
            .unwrap_err()
            .to_string()
            .contains("w7")
    );
    assert!(t.set_param("w1", &[0.0; 3]).is_err());
    assert!(t.param("nope").is_err());

    // A checkpoint of another model, and files that are not checkpoints.
    let dir = std::env::temp_dir().join(format!("rlx-bad-ckpt-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| Error::invalid("test", e.to_string()))?;
    let other_model = {
        let o = Graph::new("other");
        let x = o.input("x", Shape::new(&[ROWS, FEATURES], DType::F32))?;
        let w1 = o.param("w1", Shape::new(&[FEATURES, 3], DType::F32))?;
        let loss = o.sum(o.matmul(x, w1)?, &[], false)?;
        Trainer::new(&session, &o, loss, TrainOptions::new(adam))?
    };
    let other = dir.join("other.safetensors");
    other_model.save_checkpoint(&other)?;
    let err = t.load_checkpoint(&other).unwrap_err().to_string();
    assert!(err.contains("w1"), "{err}");
    let garbage = dir.join("garbage.safetensors");
    std::fs::write(&garbage, b"not a safetensors file at all").unwrap();
    assert!(t.load_checkpoint(&garbage).is_err());
    assert!(t.load_params(&garbage).is_err());
    assert!(t.load_checkpoint(dir.join("missing.safetensors")).is_err());
    let sgd_trainer = trainer(Device::Cpu, optimizers()[0])?;
    let sgd_file = dir.join("sgd.safetensors");
    sgd_trainer.save_checkpoint(&sgd_file)?;
    let err = t.load_checkpoint(&sgd_file).unwrap_err().to_string();
    assert!(err.contains("optimizer"), "{err}");

    // Still trains, from where it was.
    assert_eq!(t.steps(), 0);
    let first = t.step(&feed(&data[0]))?;
    let second = t.step(&feed(&data[0]))?;
    assert!(
        second < first,
        "the loss did not fall: {first} then {second}"
    );
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

#[test]
fn an_evaluator_runs_on_the_trained_params() -> Result<()> {
    let data = batches(51, 4);
    for device in test_devices() {
        let session = Session::new(device);
        let mut t = trainer(device, Optimizer::adamw(0.0))?;
        for b in &data {
            t.step(&feed(b))?;
        }
        let forward = Graph::new("forward");
        let out = logits(
            &forward,
            forward.input("x", Shape::new(&[ROWS, FEATURES], DType::F32))?,
        )?;
        forward.set_outputs(vec![out]);
        let mut eval = t.evaluator(&session, &forward)?;
        let x = [("x", TensorRef::F32(&data[0].x))];
        let logits = eval.run(&mut t, &x)?[0].as_ref().to_f64_vec();

        // The same forward graph compiled on its own with the params read back.
        let mut plain = session.compile(&forward)?;
        for p in t.params() {
            plain.set_param(&p.name, &t.param(&p.name)?)?;
        }
        let want = plain.run(&[("x", &data[0].x)])?;
        for (a, b) in logits.iter().zip(&want[0]) {
            assert!((a - *b as f64).abs() < 1e-5, "on {device}: {a} vs {b}");
        }
        // A failed run gives the params back: the trainer goes on.
        assert!(
            eval.run(&mut t, &[("x", TensorRef::F32(&data[0].x[..3]))])
                .is_err()
        );
        t.step(&feed(&data[1]))?;
        eval.run(&mut t, &x)?;
    }
    Ok(())
}

/// The classifier with dropout on its hidden layer, keyed by the trainer's step.
fn dropout_trainer(device: Device) -> Result<Trainer> {
    let g = Graph::new("dropout classifier");
    let x = g.input("x", Shape::new(&[ROWS, FEATURES], DType::F32))?;
    let y = g.input("y", Shape::new(&[ROWS], DType::I64))?;
    let key = g.input(STEP_INPUT, Shape::new(&[1], DType::I64))?;
    let w1 = g.param("w1", Shape::new(&[FEATURES, HIDDEN], DType::F32))?;
    let b1 = g.param("b1", Shape::new(&[HIDDEN], DType::F32))?;
    let w2 = g.param("w2", Shape::new(&[HIDDEN, CLASSES], DType::F32))?;
    let h = g.unary(UnaryOp::Tanh, g.add(g.matmul(x, w1)?, b1)?)?;
    let h = g.dropout(h, 0.5, 3, key)?;
    let loss = g.cross_entropy(g.matmul(h, w2)?, y, CrossEntropy::default())?;
    let mut t = Trainer::new(
        &Session::new(device),
        &g,
        loss,
        TrainOptions::new(Optimizer::adamw(0.0)).schedule(LrSchedule::Constant(0.01)),
    )?;
    for (name, values) in initial_params(7) {
        t.set_param(name, &values)?;
    }
    Ok(t)
}

#[test]
fn dropout_masks_follow_the_step_so_a_resumed_run_matches() -> Result<()> {
    let data = batches(61, 4);
    let dir = std::env::temp_dir().join(format!("rlx-dropout-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| Error::invalid("test", e.to_string()))?;
    for device in test_devices() {
        let mut straight = dropout_trainer(device)?;
        let losses: Vec<u32> = data
            .iter()
            .map(|b| Ok(straight.step(&feed(b))?.to_bits()))
            .collect::<Result<_>>()?;
        let mut first = dropout_trainer(device)?;
        let mut again = Vec::new();
        for b in &data[..2] {
            again.push(first.step(&feed(b))?.to_bits());
        }
        let path = dir.join("dropout.safetensors");
        first.save_checkpoint(&path)?;
        let mut resumed = dropout_trainer(device)?;
        resumed.load_checkpoint(&path)?;
        for b in &data[2..] {
            again.push(resumed.step(&feed(b))?.to_bits());
        }
        assert_eq!(
            again, losses,
            "on {device}: the resumed run drew other masks"
        );
        // The mask changes with the step: the same batch at two steps, with the
        // params reset in between, gives two losses.
        let mut t = dropout_trainer(device)?;
        let at_0 = t.step(&feed(&data[0]))?;
        for (name, values) in initial_params(7) {
            t.set_param(name, &values)?;
        }
        let at_1 = t.step(&feed(&data[0]))?;
        assert_ne!(at_0, at_1, "on {device}: the same mask at steps 0 and 1");
    }
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}

fn accumulating(device: Device, optimizer: Optimizer, micro: usize) -> Result<Trainer> {
    let (g, loss) = classifier_of(ROWS / micro)?;
    let options = TrainOptions::new(optimizer)
        .schedule(SCHEDULE)
        .clip_norm(1.0)
        .accumulate(micro);
    let mut t = Trainer::new(&Session::new(device), &g, loss, options)?;
    for (name, values) in initial_params(7) {
        t.set_param(name, &values)?;
    }
    Ok(t)
}

/// A batch's two halves, as micro-batches.
fn halves(b: &Batch) -> [Batch; 2] {
    let (rows, cut) = (ROWS / 2, ROWS / 2 * FEATURES);
    [
        Batch {
            x: b.x[..cut].to_vec(),
            y: b.y[..rows].to_vec(),
        },
        Batch {
            x: b.x[cut..].to_vec(),
            y: b.y[rows..].to_vec(),
        },
    ]
}

#[test]
fn accumulated_micro_batches_update_as_their_whole_batch() -> Result<()> {
    let data = batches(71, 3);
    for device in test_devices() {
        for optimizer in optimizers() {
            let mut whole = trainer(device, optimizer)?;
            let mut parts = accumulating(device, optimizer, 2)?;
            for b in &data {
                let full = whole.step(&feed(b))?;
                let [first, second] = halves(b);
                let mean = parts.step_accumulated(&[&feed(&first), &feed(&second)])?;
                assert!(
                    (full - mean).abs() < 1e-5,
                    "{optimizer:?} on {device}: loss {full} whole, {mean} in halves"
                );
            }
            assert_eq!(parts.steps(), 3);
            for p in whole.params().iter().chain(whole.state()) {
                let (a, b) = (whole.tensor(&p.name)?, parts.tensor(&p.name)?);
                let worst = a
                    .iter()
                    .zip(&b)
                    .map(|(x, y)| (x - y).abs())
                    .fold(0.0, f32::max);
                assert!(
                    worst < 1e-5,
                    "{optimizer:?} on {device}: '{}' differs by {worst}",
                    p.name
                );
            }
        }
    }
    Ok(())
}

#[test]
fn accumulation_refuses_bad_micro_batches_and_resumes_bit_for_bit() -> Result<()> {
    let data = batches(81, 4);
    let adam = optimizers()[1];
    let dir = std::env::temp_dir().join(format!("rlx-accumulate-{}", std::process::id()));
    std::fs::create_dir_all(&dir).map_err(|e| Error::invalid("test", e.to_string()))?;
    for device in test_devices() {
        let mut t = accumulating(device, adam, 2)?;
        let [a, b] = halves(&data[0]);
        // step() is the wrong call; the count must match; a bad second micro-batch
        // is found before the first runs.
        assert!(
            t.step(&feed(&a))
                .unwrap_err()
                .to_string()
                .contains("step_accumulated")
        );
        assert!(
            t.step_accumulated(&[&feed(&a)])
                .unwrap_err()
                .to_string()
                .contains("2 micro-batches")
        );
        let short = [
            ("x", TensorRef::F32(&b.x[..7])),
            ("y", TensorRef::I64(&b.y)),
        ];
        assert!(t.step_accumulated(&[&feed(&a), &short]).is_err());
        let before = bits(&t)?;
        // A non-finite micro-batch: nothing written, and the accumulators are empty
        // again, so the next step is as a fresh trainer's.
        let mut poisoned = Batch {
            x: b.x.clone(),
            y: b.y.clone(),
        };
        poisoned.x[3] = f32::NAN;
        let err = t
            .step_accumulated(&[&feed(&a), &feed(&poisoned)])
            .unwrap_err();
        assert!(
            err.to_string().contains("training step 0"),
            "on {device}: {err}"
        );
        assert!(
            bits(&t)? == before,
            "on {device}: a rejected step wrote its update"
        );
        let mut fresh = accumulating(device, adam, 2)?;
        let want = fresh.step_accumulated(&[&feed(&a), &feed(&b)])?;
        assert_eq!(
            t.step_accumulated(&[&feed(&a), &feed(&b)])?.to_bits(),
            want.to_bits()
        );
        assert!(
            bits(&t)? == bits(&fresh)?,
            "on {device}: the accumulators kept something"
        );

        // Resuming from a checkpoint (the optimizer state lives in the update graph).
        let path = dir.join("accumulated.safetensors");
        t.save_checkpoint(&path)?;
        let mut resumed = accumulating(device, adam, 2)?;
        resumed.load_checkpoint(&path)?;
        for batch in &data[1..] {
            let [x, y] = halves(batch);
            let one = t.step_accumulated(&[&feed(&x), &feed(&y)])?;
            let two = resumed.step_accumulated(&[&feed(&x), &feed(&y)])?;
            assert_eq!(one.to_bits(), two.to_bits(), "on {device}");
        }
        assert!(
            bits(&t)? == bits(&resumed)?,
            "on {device}: the resumed run differs"
        );
    }
    std::fs::remove_dir_all(&dir).ok();
    Ok(())
}
