//! Every environment switch RLX reads, declared once. Code reads a switch through
//! [`Switch::value`] (so an undeclared one cannot be read), and `rlx --help` prints
//! [`Switch::ALL`] with each one's meaning.

/// An environment variable that changes what RLX does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Switch {
    /// Threads of the CPU pool.
    NumThreads,
    /// The instruction sets the CPU kernels may use.
    CpuKernel,
    /// Turns the AMX tiles off.
    NoAmx,
    /// Turns the Winograd 3x3 convolutions off.
    Winograd,
    /// Turns the pixel-row strided convolutions off.
    ConvPixels,
    /// Turns the CPU's channel-blocked values off.
    ChannelBlocks,
    /// Prints the graph after a pipeline stage.
    DumpAfter,
    /// The cache directory.
    Cache,
    /// The Python interpreter that fetches packaged models.
    Python,
    /// Turns CUDA graph replay off.
    CudaGraphs,
    /// Turns the cuBLASLt products off.
    CudaLt,
    /// Turns programmatic dependent launches off.
    CudaPdl,
    /// Turns the CUDA product groups off.
    CudaGroups,
    /// Tests: keeps a copy of the generated CUDA source.
    KeepSource,
    /// Tests: where the golden files are.
    GoldenDir,
    /// Tests: fail instead of skipping the CUDA cases when no GPU is usable.
    TestStrictDevices,
}

impl Switch {
    /// Every switch, in the order `rlx --help` lists them.
    pub const ALL: [Switch; 16] = [
        Switch::NumThreads,
        Switch::CpuKernel,
        Switch::NoAmx,
        Switch::Winograd,
        Switch::ConvPixels,
        Switch::ChannelBlocks,
        Switch::DumpAfter,
        Switch::Cache,
        Switch::Python,
        Switch::CudaGraphs,
        Switch::CudaLt,
        Switch::CudaPdl,
        Switch::CudaGroups,
        Switch::KeepSource,
        Switch::GoldenDir,
        Switch::TestStrictDevices,
    ];

    /// The variable's name.
    pub fn name(self) -> &'static str {
        match self {
            Switch::NumThreads => "RLX_NUM_THREADS",
            Switch::CpuKernel => "RLX_CPU_KERNEL",
            Switch::NoAmx => "RLX_NO_AMX",
            Switch::Winograd => "RLX_WINOGRAD",
            Switch::ConvPixels => "RLX_CONV_PIXELS",
            Switch::ChannelBlocks => "RLX_CHANNEL_BLOCKS",
            Switch::DumpAfter => "RLX_DUMP_AFTER",
            Switch::Cache => "RLX_CACHE",
            Switch::Python => "RLX_PYTHON",
            Switch::CudaGraphs => "RLX_CUDA_GRAPHS",
            Switch::CudaLt => "RLX_CUDA_LT",
            Switch::CudaPdl => "RLX_CUDA_PDL",
            Switch::CudaGroups => "RLX_CUDA_GROUPS",
            Switch::KeepSource => "RLX_KEEP_SOURCE",
            Switch::GoldenDir => "RLX_GOLDEN_DIR",
            Switch::TestStrictDevices => "RLX_TEST_STRICT_DEVICES",
        }
    }

    /// What setting it does.
    pub fn help(self) -> &'static str {
        match self {
            Switch::NumThreads => "N: threads of the CPU pool (default: one per core)",
            Switch::CpuKernel => {
                "generic | avx2: the widest instruction set the CPU kernels use (default: the CPU's)"
            }
            Switch::NoAmx => "set: CPU products never use AMX tiles",
            Switch::Winograd => "0: 3x3 convolutions run without Winograd's transform",
            Switch::ConvPixels => "0: strided convolutions run without the pixel-row kernel",
            Switch::ChannelBlocks => {
                "0: CPU convolutions keep every value in NCHW (no channel blocks)"
            }
            Switch::DumpAfter => "STAGE: print the graph after that pipeline stage to stderr",
            Switch::Cache => "DIR: the cache (packaged models, CUDA kernels; default ~/.cache/rlx)",
            Switch::Python => "PATH: the Python interpreter that fetches packaged models",
            Switch::CudaGraphs => "0: CUDA runs launch step by step instead of replaying a graph",
            Switch::CudaLt => "0: CUDA products with a bias or residual skip cuBLASLt",
            Switch::CudaPdl => "0: CUDA kernels launch without programmatic dependencies",
            Switch::CudaGroups => "0: CUDA decode steps run without product groups",
            Switch::KeepSource => {
                "FILE: (tests) keep a copy of the CUDA source the syntax check parsed"
            }
            Switch::GoldenDir => "DIR: (tests) where the golden outputs are",
            Switch::TestStrictDevices => "set: (tests) a CUDA case with no usable GPU fails",
        }
    }

    /// The variable's value, if set and not empty.
    pub fn value(self) -> Option<String> {
        std::env::var(self.name())
            .ok()
            .filter(|v| !v.trim().is_empty())
    }

    /// Whether the variable is set at all (for switches that a presence turns on).
    pub fn is_set(self) -> bool {
        std::env::var_os(self.name()).is_some()
    }

    /// Whether a feature that this switch turns off with `0` is on.
    pub fn enabled(self) -> bool {
        self.value().is_none_or(|v| v.trim() != "0")
    }

    /// The help lines for every switch: `NAME  meaning`, one a line.
    pub fn help_text() -> String {
        let width = Switch::ALL
            .iter()
            .map(|s| s.name().len())
            .max()
            .unwrap_or(0);
        Switch::ALL
            .iter()
            .map(|s| format!("  {:<width$}  {}", s.name(), s.help()))
            .collect::<Vec<_>>()
            .join("\n")
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::path::Path;

    /// Lines of `.rs` files under `dir` that read an `RLX_` variable directly.
    fn raw_reads(dir: &Path, found: &mut Vec<String>) {
        let Ok(entries) = std::fs::read_dir(dir) else {
            return;
        };
        for entry in entries.flatten() {
            let path = entry.path();
            if path.is_dir() {
                raw_reads(&path, found);
            } else if path.extension().is_some_and(|e| e == "rs") && !path.ends_with("env.rs") {
                let text = std::fs::read_to_string(&path).unwrap_or_default();
                for (i, line) in text.lines().enumerate() {
                    if line.contains("env::var") && line.contains("\"RLX_") {
                        found.push(format!("{}:{}", path.display(), i + 1));
                    }
                }
            }
        }
    }

    #[test]
    fn no_switch_is_read_around_the_list() {
        let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        let mut found = Vec::new();
        raw_reads(&crates, &mut found);
        assert!(
            found.is_empty(),
            "read these through rlx_ir::env::Switch: {found:?}"
        );
    }

    #[test]
    fn every_switch_is_listed_once_with_help() {
        let mut names: Vec<&str> = Switch::ALL.iter().map(|s| s.name()).collect();
        names.sort_unstable();
        names.dedup();
        assert_eq!(names.len(), Switch::ALL.len());
        for s in Switch::ALL {
            assert!(s.name().starts_with("RLX_"));
            assert!(!s.help().is_empty());
            assert!(Switch::help_text().contains(s.name()));
        }
    }
}
