//! Graph passes, scheduling and memory planning: everything between a verified
//! [`rlx_ir::Graph`] and the [`Plan`] a backend compiles.
//!
//! The pipeline ([`plan_graph`]) is: verify, constant folding, common-subexpression
//! elimination, dead-code elimination, the fusions the backend runs (matmul
//! epilogues, then elementwise regions), verify, schedule (respecting in-place writes
//! to persistent handles), memory plan.

pub mod autodiff;
pub mod cse;
pub mod dce;
pub mod extent;
pub mod fuse;
pub mod hoist;
pub mod lifetimes;
mod plan;
pub mod recognize;
mod rewrite;
pub mod schedule;

pub use fuse::{FusionOptions, FusionRecord};
pub use lifetimes::{Lifetime, OffsetAssignment, assign_offsets};
pub use plan::{
    Location, MemoryStats, Plan, PlanOptions, Region, Source, Stage, graph_after, plan_graph,
};
