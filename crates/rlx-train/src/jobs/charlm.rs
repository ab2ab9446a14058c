//! The character-level GPT job: a small pre-norm transformer trained to predict the
//! next byte of the Python standard library's own source, split into train and
//! validation by file.

use super::{JobReport, StepEvent, train_loop};
use crate::{LrSchedule, ModelBuilder, Network, Optimizer, Rng, STEP_INPUT, TrainOptions, Trainer};
use rlx_driver::Device;
use rlx_ir::{CrossEntropy, DType, Error, Graph, NodeId, Result, Shape, TensorRef, UnaryOp};
use rlx_runtime::{CompileOptions, Session};
use std::path::{Path, PathBuf};

/// Symbols: the model reads and predicts bytes.
pub const VOCAB: usize = 256;

/// Text split into training and validation bytes.
#[derive(Clone, Debug)]
pub struct CharCorpus {
    /// Training text (the training files, concatenated).
    pub train: Vec<u8>,
    /// Validation text.
    pub val: Vec<u8>,
    /// How many files went to each.
    pub files: (usize, usize),
}

impl CharCorpus {
    /// The `.py` files of the standard library of the interpreter `python` (its
    /// `Lib/` directory, tests included, site-packages left out).
    pub fn python_stdlib(python: &str) -> Result<CharCorpus> {
        let out = std::process::Command::new(python)
            .args([
                "-c",
                "import sysconfig; print(sysconfig.get_paths()['stdlib'])",
            ])
            .output()
            .map_err(|e| Error::Io {
                path: python.to_string(),
                message: format!("cannot run it to find the standard library: {e}"),
            })?;
        if !out.status.success() {
            return Err(Error::Io {
                path: python.to_string(),
                message: "could not report its standard library directory".into(),
            });
        }
        let dir = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
        CharCorpus::from_dir(&dir)
    }

    /// Every `.py` file under `dir` (sorted by path, `site-packages` skipped): each
    /// tenth to validation, the rest to training.
    pub fn from_dir(dir: &Path) -> Result<CharCorpus> {
        let mut files = Vec::new();
        collect_py(dir, &mut files)?;
        files.sort();
        if files.len() < 10 {
            return Err(Error::Io {
                path: dir.display().to_string(),
                message: format!("only {} .py files; need at least 10", files.len()),
            });
        }
        let mut corpus = CharCorpus {
            train: Vec::new(),
            val: Vec::new(),
            files: (0, 0),
        };
        for (i, path) in files.iter().enumerate() {
            let bytes = std::fs::read(path).map_err(|e| Error::Io {
                path: path.display().to_string(),
                message: e.to_string(),
            })?;
            if i % 10 == 9 {
                corpus.val.extend_from_slice(&bytes);
                corpus.files.1 += 1;
            } else {
                corpus.train.extend_from_slice(&bytes);
                corpus.files.0 += 1;
            }
        }
        Ok(corpus)
    }
}

fn collect_py(dir: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    let entries = std::fs::read_dir(dir).map_err(|e| Error::Io {
        path: dir.display().to_string(),
        message: e.to_string(),
    })?;
    for entry in entries.flatten() {
        let path = entry.path();
        let Ok(kind) = entry.file_type() else {
            continue;
        };
        if kind.is_dir() {
            if path
                .file_name()
                .is_some_and(|n| n != "site-packages" && n != "__pycache__")
            {
                collect_py(&path, out)?;
            }
        } else if kind.is_file() && path.extension().is_some_and(|e| e == "py") {
            out.push(path);
        }
    }
    Ok(())
}

/// The shape of the model and how to train it.
#[derive(Clone, Debug)]
pub struct CharLmConfig {
    /// Transformer layers.
    pub layers: usize,
    /// Model width.
    pub width: usize,
    /// Attention heads.
    pub heads: usize,
    /// Bytes of context.
    pub context: usize,
    /// Sequences per step.
    pub batch: usize,
    /// Training steps (the schedule's length).
    pub steps: u64,
    /// Stop after this many steps, the schedule still that of `steps` (the start of a
    /// longer run, to compare with another framework's).
    pub stop_after: Option<u64>,
    /// Peak learning rate (AdamW; warmup, then cosine decay to a tenth).
    pub lr: f64,
    /// Seed of the initial weights and the batches.
    pub seed: u64,
    /// Where to train.
    pub device: Device,
    /// CPU threads (0: all).
    pub threads: usize,
    /// Validation batches (of `batch` sequences) averaged for `val_loss`.
    pub val_batches: usize,
    /// Bytes of sample text generated at the end.
    pub sample_bytes: usize,
    /// Dropout on each block's two residual branches while training (0: none), its
    /// masks keyed by the step.
    pub dropout: f64,
    /// Time every kernel of the steps ([`Trainer::profile`]).
    pub profile: bool,
    /// Let the f32 products round their operands to bfloat16 on a CPU with AMX
    /// ([`CompileOptions::allow_bf16`]).
    pub bf16_products: bool,
    /// Initial params from a safetensors file (names as [`charlm_network`] gives
    /// them) instead of the seeded draw.
    pub init: Option<PathBuf>,
    /// The training windows, `context + 1` bytes each, `batch` of them per step in
    /// order, instead of drawing them from the corpus (to train on exactly the batches
    /// another framework trains on).
    pub fixed_batches: Option<Vec<u8>>,
}

impl Default for CharLmConfig {
    fn default() -> CharLmConfig {
        CharLmConfig {
            layers: 4,
            width: 256,
            heads: 4,
            context: 128,
            batch: 16,
            steps: 2000,
            stop_after: None,
            lr: 2e-3,
            seed: 1,
            device: Device::Cpu,
            threads: 0,
            profile: false,
            bf16_products: false,
            val_batches: 8,
            sample_bytes: 300,
            dropout: 0.0,
            init: None,
            fixed_batches: None,
        }
    }
}

impl CharLmConfig {
    fn check(&self) -> Result<()> {
        if !(0.0..1.0).contains(&self.dropout) {
            return Err(Error::invalid(
                "charlm",
                format!("dropout must be in [0, 1), got {}", self.dropout),
            ));
        }
        let fits = self.layers > 0
            && self.heads > 0
            && self.width.is_multiple_of(self.heads)
            && self.context > 0
            && self.batch > 0
            && self.val_batches > 0;
        if !fits {
            return Err(Error::invalid(
                "charlm",
                format!(
                    "layers, heads, context, batch and val batches must be positive and the \
                     width a multiple of the heads: {self:?}"
                ),
            ));
        }
        Ok(())
    }
}

/// The GPT's logits `[rows * context, VOCAB]` for `tokens: i64 [rows, context]`:
/// byte and position embeddings, `layers` pre-norm blocks (causal attention, a GELU
/// MLP four times as wide), a final layer norm and an output projection. Param names
/// follow a PyTorch module of the same structure. With `training` and a dropout
/// rate, each residual branch is dropped out, keyed by the trainer's
/// [`STEP_INPUT`].
pub fn charlm_network(
    config: &CharLmConfig,
    rows: usize,
    seed: u64,
    training: bool,
) -> Result<Network> {
    config.check()?;
    let (t, d, h) = (config.context, config.width, config.heads);
    let g = Graph::new("charlm");
    let tokens = g.input("tokens", Shape::new(&[rows, t], DType::I64))?;
    let mut m = ModelBuilder::new(&g, seed);
    let table = m.normal("tok_emb.weight", &[VOCAB, d], 0.02)?;
    let pos = m.normal("pos_emb", &[t, d], 0.02)?;
    let mut x = g.add(g.gather(table, tokens, 0)?, pos)?;
    let key = if training && config.dropout > 0.0 {
        Some(g.input(STEP_INPUT, Shape::new(&[1], DType::I64))?)
    } else {
        None
    };
    let drop = |x: NodeId, which: u64| match key {
        Some(key) => g.dropout(x, config.dropout, which, key),
        None => Ok(x),
    };
    for l in 0..config.layers {
        let p = format!("blocks.{l}");
        let a = layer_norm(&mut m, &format!("{p}.ln1"), x)?;
        let heads = |x: NodeId| g.reshape(x, &[rows, t, h, d / h]);
        let q = heads(m.linear(&format!("{p}.attn.q"), a, d, true)?)?;
        let k = heads(m.linear(&format!("{p}.attn.k"), a, d, true)?)?;
        let v = heads(m.linear(&format!("{p}.attn.v"), a, d, true)?)?;
        let att = g.attention_seq_major(q, k, v, None, true, None)?;
        let att = g.reshape(att, &[rows, t, d])?;
        let branch = m.linear(&format!("{p}.attn.proj"), att, d, true)?;
        x = g.add(x, drop(branch, 2 * l as u64)?)?;
        let f = layer_norm(&mut m, &format!("{p}.ln2"), x)?;
        let f = g.unary(
            UnaryOp::Gelu,
            m.linear(&format!("{p}.mlp.fc"), f, 4 * d, true)?,
        )?;
        let branch = m.linear(&format!("{p}.mlp.proj"), f, d, true)?;
        x = g.add(x, drop(branch, 2 * l as u64 + 1)?)?;
    }
    let x = layer_norm(&mut m, "ln_f", x)?;
    let logits = m.linear("head", x, VOCAB, false)?;
    let logits = g.reshape(logits, &[rows * t, VOCAB])?;
    g.set_outputs(vec![logits]);
    let init = m.into_initial_values();
    Ok(Network {
        graph: g,
        output: logits,
        init,
    })
}

fn layer_norm(m: &mut ModelBuilder<'_>, name: &str, x: NodeId) -> Result<NodeId> {
    let d = m.g.shape(x)?.dims().last().copied().unwrap_or(1);
    let gamma = m.filled(&format!("{name}.weight"), &[d], 1.0)?;
    let beta = m.filled(&format!("{name}.bias"), &[d], 0.0)?;
    m.g.layer_norm(x, gamma, beta, 1e-5)
}

/// The network with its next-byte cross-entropy loss over `targets: i64 [rows *
/// context]`.
pub fn charlm_loss_graph(
    config: &CharLmConfig,
    rows: usize,
    seed: u64,
    training: bool,
) -> Result<(Network, NodeId)> {
    let net = charlm_network(config, rows, seed, training)?;
    let targets = net
        .graph
        .input("targets", Shape::new(&[rows * config.context], DType::I64))?;
    let loss = net
        .graph
        .cross_entropy(net.output, targets, CrossEntropy::default())?;
    Ok((net, loss))
}

/// Fills `tokens` and `targets` with `rows` windows of `text` starting at `starts`.
fn windows(text: &[u8], starts: &[usize], context: usize, tokens: &mut [i64], targets: &mut [i64]) {
    for (r, &s) in starts.iter().enumerate() {
        for i in 0..context {
            tokens[r * context + i] = text[s + i] as i64;
            targets[r * context + i] = text[s + i + 1] as i64;
        }
    }
}

/// The batch of step `step`: random windows of the training text, drawn from the
/// seed and the step alone (so a resumed run sees the same batches).
pub fn training_starts(config: &CharLmConfig, text_len: usize, step: u64) -> Vec<usize> {
    let mut rng = Rng::new(config.seed.wrapping_mul(0x1000_0001) ^ step.wrapping_mul(0x9E37_79B9));
    let span = text_len.saturating_sub(config.context + 1).max(1);
    (0..config.batch).map(|_| rng.below(span)).collect()
}

/// Trains the GPT and reports `val_loss` (mean nats per byte over fixed validation
/// windows) and a `sample` of generated text.
pub fn train_charlm(
    corpus: &CharCorpus,
    config: &CharLmConfig,
    on_step: &mut dyn FnMut(&StepEvent),
) -> Result<(Trainer, JobReport)> {
    config.check()?;
    let need = config.context + 2;
    if corpus.train.len() < need || corpus.val.len() < need {
        return Err(Error::invalid(
            "charlm",
            format!("the training and validation texts need at least {need} bytes each"),
        ));
    }
    let session = Session::new(config.device);
    let (net, loss) = charlm_loss_graph(config, config.batch, config.seed, true)?;
    let options = TrainOptions::new(Optimizer::adamw(0.01))
        .schedule(LrSchedule::WarmupCosine {
            lr: config.lr,
            min_lr: config.lr * 0.1,
            warmup: (config.steps / 20).min(200),
            total: config.steps,
        })
        .clip_norm(1.0)
        .compile_options(
            CompileOptions::new()
                .threads(config.threads)
                .allow_bf16(config.bf16_products),
        );
    let mut trainer = Trainer::new(&session, &net.graph, loss, options)?;
    trainer.set_profiling(config.profile);
    match &config.init {
        Some(path) => trainer.load_params(path)?,
        None => {
            for (name, values) in &net.init {
                trainer.set_param(name, values)?;
            }
        }
    }
    let row = config.context + 1;
    let steps = config.stop_after.unwrap_or(config.steps).min(config.steps);
    if let Some(fixed) = &config.fixed_batches {
        let need = steps as usize * config.batch * row;
        if fixed.len() < need {
            return Err(Error::invalid(
                "charlm",
                format!(
                    "the fixed batches hold {} bytes; {} steps of {} windows of {row} bytes need {need}",
                    fixed.len(),
                    steps,
                    config.batch
                ),
            ));
        }
    }
    let cells = config.batch * config.context;
    let (mut tokens, mut targets) = (vec![0i64; cells], vec![0i64; cells]);
    let mut report = train_loop(&mut trainer, steps, on_step, |t, step| {
        match &config.fixed_batches {
            Some(fixed) => {
                let block = &fixed[step as usize * config.batch * row..][..config.batch * row];
                let starts: Vec<usize> = (0..config.batch).map(|r| r * row).collect();
                windows(block, &starts, config.context, &mut tokens, &mut targets);
            }
            None => {
                let starts = training_starts(config, corpus.train.len(), step);
                windows(
                    &corpus.train,
                    &starts,
                    config.context,
                    &mut tokens,
                    &mut targets,
                );
            }
        }
        t.step(&[
            ("tokens", TensorRef::I64(&tokens)),
            ("targets", TensorRef::I64(&targets)),
        ])
    })?;
    let val = validation_loss(&mut trainer, &session, corpus, config)?;
    report.metrics.push(("val_loss".into(), val));
    let sample = sample(&mut trainer, &session, config, b"def ", 0.8)?;
    report.texts.push(("sample".into(), sample));
    Ok((trainer, report))
}

/// The mean loss over `val_batches` batches of validation windows spread evenly over
/// the validation text.
pub fn validation_loss(
    trainer: &mut Trainer,
    session: &Session,
    corpus: &CharCorpus,
    config: &CharLmConfig,
) -> Result<f64> {
    if corpus.val.len() < config.context + 2 {
        return Err(Error::invalid(
            "charlm",
            format!(
                "the validation text needs at least {} bytes",
                config.context + 2
            ),
        ));
    }
    let (net, loss) = charlm_loss_graph(config, config.batch, 0, false)?;
    net.graph.set_outputs(vec![loss]);
    let mut eval = trainer.evaluator(session, &net.graph)?;
    let windows_total = config.batch * config.val_batches;
    let span = corpus.val.len() - config.context - 1;
    let cells = config.batch * config.context;
    let (mut tokens, mut targets) = (vec![0i64; cells], vec![0i64; cells]);
    let mut total = 0.0;
    for b in 0..config.val_batches {
        let starts: Vec<usize> = (0..config.batch)
            .map(|r| (b * config.batch + r) * span / windows_total)
            .collect();
        windows(
            &corpus.val,
            &starts,
            config.context,
            &mut tokens,
            &mut targets,
        );
        let out = eval.run(
            trainer,
            &[
                ("tokens", TensorRef::I64(&tokens)),
                ("targets", TensorRef::I64(&targets)),
            ],
        )?;
        total += out[0].as_ref().to_f64_vec()[0];
    }
    Ok(total / config.val_batches as f64)
}

/// `config.sample_bytes` bytes generated after `prompt`, each drawn from the
/// softmax of the logits at `temperature` (seeded by the config's seed).
pub fn sample(
    trainer: &mut Trainer,
    session: &Session,
    config: &CharLmConfig,
    prompt: &[u8],
    temperature: f64,
) -> Result<String> {
    if !(temperature > 0.0 && temperature.is_finite()) {
        return Err(Error::invalid(
            "charlm sample",
            format!("the temperature must be positive, got {temperature}"),
        ));
    }
    let net = charlm_network(config, 1, 0, false)?;
    let mut eval = trainer.evaluator(session, &net.graph)?;
    let mut rng = Rng::new(config.seed ^ 0x5A3D);
    let mut text = prompt.to_vec();
    let t = config.context;
    let mut window = vec![b'\n' as i64; t];
    for _ in 0..config.sample_bytes {
        // The last `t` bytes, right-aligned so the newest is at the last position.
        let tail = &text[text.len().saturating_sub(t)..];
        for (i, w) in window.iter_mut().enumerate() {
            let from_end = t - i;
            *w = if from_end <= tail.len() {
                tail[tail.len() - from_end] as i64
            } else {
                b'\n' as i64
            };
        }
        let logits = eval.run(trainer, &[("tokens", TensorRef::I64(&window))])?;
        let logits = logits[0].as_ref().to_f64_vec();
        let last = &logits[(t - 1) * VOCAB..t * VOCAB];
        let top = last.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
        let weights: Vec<f64> = last
            .iter()
            .map(|&l| ((l - top) / temperature).exp())
            .collect();
        let mut pick = rng.unit() * weights.iter().sum::<f64>();
        let mut byte = VOCAB - 1;
        for (i, w) in weights.iter().enumerate() {
            if pick < *w {
                byte = i;
                break;
            }
            pick -= w;
        }
        text.push(byte as u8);
    }
    Ok(String::from_utf8_lossy(&text).into_owned())
}
