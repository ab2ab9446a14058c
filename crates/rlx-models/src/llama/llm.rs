//! [`Llm`]: a Llama model compiled for generation. The forward graph is one symbolic
//! graph over the chunk length, kept in a [`BucketedCompileCache`]: the decode graph
//! (one token) owns the weights and the key/value cache, and prefill graphs (chunks
//! of the prompt, by size bucket) share the weights and borrow the cache, which lives
//! in persistent handles that the graphs write in place and hand over without
//! copying.

use super::config::LlamaConfig;
use super::graph::{cache_handles, rope_tables, symbolic_graph};
use super::recommended::RecommendedSampling;
use super::sample::{Sampler, SamplingOptions};
use super::tokenizer::LlmTokenizer;
use super::weights::LlamaWeights;
use crate::ModelStore;
use rlx_driver::Device;
use rlx_gguf::GgufFile;
use rlx_ir::{Bindings, Error, Result, TensorData, TensorRef};
use rlx_runtime::{BucketedCompileCache, CompileOptions, CompiledGraph, Session};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Smallest prefill chunk compiled (shorter prompts are padded up to it).
const MIN_CHUNK: usize = 16;

/// Prefill graphs kept compiled (chunk sizes and logit row counts); the least
/// recently used is dropped past this.
const PREFILL_GRAPHS: usize = 8;

/// How an [`Llm`] is loaded and compiled.
#[derive(Clone, Debug)]
pub struct LlmOptions {
    /// Where packaged models are cached (default: [`ModelStore::from_env`]).
    pub store: Option<ModelStore>,
    /// The device to run on.
    pub device: Device,
    /// Rows of the key/value cache: the longest prompt plus generated text
    /// (capped at the model's trained context).
    pub max_context: usize,
    /// Longest prompt chunk one prefill run processes (a power of two, at least 16).
    pub max_chunk: usize,
    /// Most CPU threads a run uses (0: all of the runtime's).
    pub threads: usize,
}

impl Default for LlmOptions {
    fn default() -> Self {
        LlmOptions {
            store: None,
            device: Device::Cpu,
            max_context: 2048,
            max_chunk: 512,
            threads: 0,
        }
    }
}

/// When and why generation stopped.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum StopReason {
    /// The model produced an end-of-sequence token.
    EndOfSequence,
    /// `max_tokens` were generated.
    MaxTokens,
    /// The key/value cache is full.
    ContextFull,
}

/// The result of [`Llm::generate`].
#[derive(Clone, Debug)]
pub struct Generation {
    /// The generated token ids (a final end-of-sequence token included).
    pub ids: Vec<u32>,
    /// Why it stopped.
    pub stop: StopReason,
    /// Time spent on the prompt (prefill), and its token count.
    pub prefill: (Duration, usize),
    /// Time spent generating after the prompt, and the number of decode steps.
    pub decode: (Duration, usize),
}

impl Generation {
    /// Prompt tokens per second.
    pub fn prefill_tokens_per_s(&self) -> f64 {
        self.prefill.1 as f64 / self.prefill.0.as_secs_f64().max(1e-9)
    }

    /// Generated tokens per second (decode steps only).
    pub fn decode_tokens_per_s(&self) -> f64 {
        self.decode.1 as f64 / self.decode.0.as_secs_f64().max(1e-9)
    }
}

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateOptions {
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// How each token is picked.
    pub sampling: SamplingOptions,
}

impl Default for GenerateOptions {
    fn default() -> Self {
        GenerateOptions {
            max_tokens: 128,
            sampling: SamplingOptions::default(),
        }
    }
}

/// A compiled Llama model with its tokenizer and key/value cache.
pub struct Llm {
    source: PathBuf,
    config: LlamaConfig,
    tokenizer: Option<LlmTokenizer>,
    weights: Arc<LlamaWeights>,
    options: LlmOptions,
    max_seq: usize,
    /// The forward graph at every compiled chunk size. Its owner is the decode graph
    /// (one token), which holds the weights and the cache between runs.
    graphs: BucketedCompileCache,
    /// Tokens in the cache, in order.
    history: Vec<u32>,
    /// Sampling settings the model recommends.
    recommended: RecommendedSampling,
}

impl std::fmt::Debug for Llm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "Llm({}, {} layers, context {})",
            self.source.display(),
            self.config.layers,
            self.max_seq
        )
    }
}

/// Finds the model file of `name_or_path`: a `.gguf` file, a directory with one
/// `.gguf` file, or a directory with `config.json` and `model.safetensors`.
fn locate(store: &ModelStore, name_or_path: &str) -> Result<PathBuf> {
    let path = Path::new(name_or_path);
    if path.is_file() {
        return Ok(path.to_path_buf());
    }
    let dir = store.resolve(name_or_path)?;
    if dir.join("model.safetensors").is_file() && dir.join("config.json").is_file() {
        return Ok(dir);
    }
    let ggufs: Vec<PathBuf> = std::fs::read_dir(&dir)
        .map_err(|e| Error::Io {
            path: dir.display().to_string(),
            message: e.to_string(),
        })?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "gguf"))
        .collect();
    match ggufs.as_slice() {
        [one] => Ok(one.clone()),
        [] => Err(Error::Io {
            path: dir.display().to_string(),
            message: "no .gguf file, and no config.json + model.safetensors".into(),
        }),
        _ => Err(Error::Io {
            path: dir.display().to_string(),
            message: "several .gguf files; pass the one to use".into(),
        }),
    }
}

impl Llm {
    /// Loads a packaged model by name (`smollm2`, fetched on first use), a `.gguf`
    /// file, or a Hugging Face checkpoint directory, with default options.
    pub fn load(name_or_path: &str) -> Result<Llm> {
        Llm::load_with(name_or_path, LlmOptions::default())
    }

    /// [`Llm::load`] with options.
    pub fn load_with(name_or_path: &str, options: LlmOptions) -> Result<Llm> {
        if options.max_context == 0
            || options.max_chunk < MIN_CHUNK
            || !options.max_chunk.is_power_of_two()
        {
            return Err(Error::invalid(
                "llm options",
                "max_context must be at least 1 and max_chunk a power of two of at least 16",
            ));
        }
        let store = match &options.store {
            Some(store) => store.clone(),
            None => ModelStore::from_env()?,
        };
        let source = locate(&store, name_or_path)?;
        // The packaged model's curated settings first, then the file's own.
        let packaged = crate::fetch::packaged_model(name_or_path)
            .filter(|_| !Path::new(name_or_path).is_file())
            .map_or_else(RecommendedSampling::default, |m| {
                RecommendedSampling::from_pairs(m.generation)
            });
        let (config, weights, tokenizer, recommended) = if source.is_dir() {
            let config = LlamaConfig::from_hf_json(&source.join("config.json"))?;
            let weights =
                LlamaWeights::from_safetensors(&source.join("model.safetensors"), &config)?;
            let own = RecommendedSampling::from_generation_config(
                &source.join("generation_config.json"),
            )?;
            (config, weights, None, own)
        } else {
            let file = GgufFile::open(&source)?;
            let own = RecommendedSampling::from_gguf(&file)?;
            let config = LlamaConfig::from_gguf(&file)?;
            // A file without tokenizer metadata (as `write_gguf` makes) takes token
            // ids; one with a broken tokenizer is still an error.
            let tokenizer = match file.get("tokenizer.ggml.model") {
                Some(_) => Some(LlmTokenizer::from_gguf(&file)?),
                None => None,
            };
            let weights = LlamaWeights::from_gguf(file, &config)?;
            (config, weights, tokenizer, own)
        };
        let mut llm = Llm::from_parts(source, config, weights, tokenizer, options)?;
        llm.recommended = packaged.or(recommended);
        Ok(llm)
    }

    /// The sampling settings the model recommends (from the packaged-model table,
    /// the GGUF `general.sampling.*` metadata or `generation_config.json`; empty for
    /// a model built from parts): lay them over [`GENERAL_SAMPLING`] with
    /// [`RecommendedSampling::to_options`].
    ///
    /// [`GENERAL_SAMPLING`]: super::GENERAL_SAMPLING
    pub fn recommended_sampling(&self) -> RecommendedSampling {
        self.recommended
    }

    /// Compiles a model from already loaded parts (tests build tiny models this way).
    pub fn from_parts(
        source: PathBuf,
        config: LlamaConfig,
        weights: LlamaWeights,
        tokenizer: Option<LlmTokenizer>,
        options: LlmOptions,
    ) -> Result<Llm> {
        let max_seq = options.max_context.min(config.context_length).max(1);
        let weights = Arc::new(weights);
        let mut graphs = BucketedCompileCache::new(
            symbolic_graph(&config, weights.clone(), max_seq)?,
            Session::new(options.device),
            compile_options(&config, max_seq, &options),
        )?
        .with_capacity(PREFILL_GRAPHS)?;
        for entry in weights.entries() {
            graphs.set_param_bytes(&entry.name, weights.bytes(entry)?)?;
        }
        let (cos, sin) = rope_tables(&config, max_seq);
        graphs.set_param("rope.cos", &cos)?;
        graphs.set_param("rope.sin", &sin)?;
        Ok(Llm {
            source,
            config,
            tokenizer,
            weights,
            options,
            max_seq,
            graphs,
            history: Vec::new(),
            recommended: RecommendedSampling::default(),
        })
    }

    /// The model's hyper-parameters.
    pub fn config(&self) -> &LlamaConfig {
        &self.config
    }

    /// The tokenizer (GGUF models carry one; safetensors checkpoints do not).
    pub fn tokenizer(&self) -> Result<&LlmTokenizer> {
        self.tokenizer.as_ref().ok_or_else(|| {
            Error::invalid(
                "llm",
                "this model has no tokenizer (pass token ids instead)",
            )
        })
    }

    /// Bytes of the weights as the graphs hold them (packed where quantized).
    pub fn weight_bytes(&self) -> usize {
        self.weights.total_bytes()
    }

    /// Rows of the key/value cache.
    pub fn max_context(&self) -> usize {
        self.max_seq
    }

    /// Tokens currently in the cache.
    pub fn position(&self) -> usize {
        self.history.len()
    }

    /// Forgets the cached context (the next prompt starts at position 0).
    pub fn reset(&mut self) {
        self.history.clear();
    }

    /// The decode graph (for inspection).
    pub fn decode_graph(&mut self) -> &mut CompiledGraph {
        self.graphs.owner()
    }

    /// Turns per-kernel timing on or off for the decode graph and every prefill graph
    /// (those compiled later start with it off).
    pub fn set_profiling(&mut self, on: bool) {
        self.graphs.for_each_compiled(|_, g| g.set_profiling(on));
    }

    /// Per-kernel times of each graph with profiling on: `("decode", ...)` and
    /// `("prefill N", ...)` for chunks of N tokens.
    pub fn profiles(&self) -> Vec<(String, rlx_driver::Profile)> {
        let mut out = Vec::new();
        self.graphs.for_each_compiled_ref(|b, g| {
            let Some(p) = g.profile() else { return };
            let seq = b.get("seq").unwrap_or(0);
            let rows = b.get("rows").unwrap_or(0);
            let name = if seq == 1 && rows == 1 {
                "decode".to_string()
            } else {
                format!("prefill {seq}")
            };
            out.push((name, p));
        });
        out
    }

    fn check_ids(&self, ids: &[u32]) -> Result<()> {
        if let Some(bad) = ids.iter().find(|&&t| t as usize >= self.config.vocab_size) {
            return Err(Error::invalid(
                "llm",
                format!(
                    "token id {bad} is outside the vocabulary of {}",
                    self.config.vocab_size
                ),
            ));
        }
        if self.history.len() + ids.len() > self.max_seq {
            return Err(Error::invalid(
                "llm",
                format!(
                    "{} cached + {} new tokens exceed the context of {} (LlmOptions::max_context)",
                    self.history.len(),
                    ids.len(),
                    self.max_seq
                ),
            ));
        }
        Ok(())
    }

    /// Runs `ids` (already checked to fit) through a graph of `size` positions,
    /// padded, returning the logits of positions `rows`.
    fn run_chunk(&mut self, ids: &[u32], size: usize, rows: &[usize]) -> Result<Vec<f32>> {
        let pos = self.history.len() as i64;
        let mut tokens = vec![0i64; size];
        for (t, &id) in tokens.iter_mut().zip(ids) {
            *t = i64::from(id);
        }
        let rows: Vec<i64> = rows.iter().map(|&r| r as i64).collect();
        let inputs = [
            ("tokens", TensorRef::I64(&tokens)),
            ("pos", TensorRef::I64(&[pos])),
            ("logit_rows", TensorRef::I64(&rows)),
        ];
        let binding = Bindings::new()
            .with("seq", size)?
            .with("rows", rows.len())?;
        let outputs = self.graphs.run_with(&binding, |g| g.run_typed(&inputs))?;
        self.history.extend_from_slice(ids);
        match outputs.into_iter().next() {
            Some(TensorData::F32(v)) => Ok(v),
            _ => Err(Error::runtime(
                "llm",
                "the graph did not produce f32 logits",
            )),
        }
    }

    /// The chunk size for `n` remaining prompt tokens: the smallest power of two of
    /// at least [`MIN_CHUNK`] that holds them (up to `max_chunk`) and still fits the
    /// cache; `n` itself when no bucket fits.
    fn chunk_size(&self, n: usize) -> usize {
        let room = self.max_seq - self.history.len();
        let bucket = n
            .next_power_of_two()
            .max(MIN_CHUNK)
            .min(self.options.max_chunk);
        if bucket <= room { bucket } else { n.min(room) }
    }

    /// Appends `ids` to the context and returns the logits after the last of them.
    pub fn prefill(&mut self, ids: &[u32]) -> Result<Vec<f32>> {
        if ids.is_empty() {
            return Err(Error::invalid("llm", "prefill needs at least one token"));
        }
        self.check_ids(ids)?;
        let mut logits = Vec::new();
        let mut rest = ids;
        while !rest.is_empty() {
            let size = self.chunk_size(rest.len());
            let take = size.min(rest.len());
            logits = if take == 1 {
                self.run_chunk(&rest[..1], 1, &[0])?
            } else {
                self.run_chunk(&rest[..take], size, &[take - 1])?
            };
            rest = &rest[take..];
        }
        Ok(logits)
    }

    /// Appends one token and returns the logits after it.
    pub fn step(&mut self, id: u32) -> Result<Vec<f32>> {
        self.check_ids(&[id])?;
        self.run_chunk(&[id], 1, &[0])
    }

    /// Logits at every position of `ids`, starting from an empty context (the cache
    /// is reset first and holds `ids` afterwards). Returns `ids.len()` rows.
    pub fn logits_all(&mut self, ids: &[u32]) -> Result<Vec<Vec<f32>>> {
        self.reset();
        if ids.is_empty() {
            return Err(Error::invalid("llm", "logits_all needs at least one token"));
        }
        self.check_ids(ids)?;
        let size = ids
            .len()
            .next_power_of_two()
            .max(MIN_CHUNK)
            .min(self.max_seq);
        if size < ids.len() {
            return Err(Error::invalid("llm", "the tokens do not fit one chunk"));
        }
        let rows: Vec<usize> = (0..ids.len()).collect();
        let flat = self.run_chunk(ids, size, &rows)?;
        Ok(flat
            .chunks_exact(self.config.vocab_size)
            .map(<[f32]>::to_vec)
            .collect())
    }

    /// Generates up to `options.max_tokens` tokens after `prompt` (appended to the
    /// current context), calling `on_token` with each new id as it is produced.
    /// Stops at an end-of-sequence token, the token limit, or a full context.
    pub fn generate(
        &mut self,
        prompt: &[u32],
        options: &GenerateOptions,
        mut on_token: impl FnMut(u32) -> Result<()>,
    ) -> Result<Generation> {
        let mut sampler = Sampler::new(options.sampling.clone())?;
        let stop_tokens: Vec<u32> = self
            .tokenizer
            .as_ref()
            .map(|t| t.stop_tokens().to_vec())
            .unwrap_or_default();
        let started = Instant::now();
        let mut logits = self.prefill(prompt)?;
        let prefill = (started.elapsed(), prompt.len());
        let decode_started = Instant::now();
        let mut ids = Vec::new();
        let mut steps = 0;
        let stop = loop {
            if ids.len() >= options.max_tokens {
                break StopReason::MaxTokens;
            }
            let next = sampler.sample(&mut logits, &self.history);
            ids.push(next);
            on_token(next)?;
            if stop_tokens.contains(&next) {
                break StopReason::EndOfSequence;
            }
            if ids.len() >= options.max_tokens {
                break StopReason::MaxTokens;
            }
            if self.history.len() >= self.max_seq {
                break StopReason::ContextFull;
            }
            logits = self.step(next)?;
            steps += 1;
        };
        Ok(Generation {
            ids,
            stop,
            prefill,
            decode: (decode_started.elapsed(), steps),
        })
    }
}

/// Compile options binding every cache handle.
fn compile_options(config: &LlamaConfig, max_seq: usize, options: &LlmOptions) -> CompileOptions {
    cache_handles(config, max_seq)
        .iter()
        .fold(CompileOptions::new().threads(options.threads), |o, h| {
            o.bind_handle(h)
        })
}
