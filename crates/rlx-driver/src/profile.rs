//! Per-kernel timings of a compiled graph, collected while profiling is on.

use rlx_ir::NodeId;
use std::time::Duration;

/// Total time of one kernel launch over the profiled runs.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KernelTime {
    /// The node the kernel computes.
    pub node: NodeId,
    /// The kernel's name (as `rlx inspect` shows it).
    pub kernel: String,
    /// Time spent in it, summed over the runs.
    pub total: Duration,
}

/// Kernel timings over a number of runs.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Profile {
    /// How many runs the totals cover.
    pub runs: u64,
    /// One entry per kernel launch, in execution order.
    pub kernels: Vec<KernelTime>,
}
