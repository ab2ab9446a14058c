//! Graph passes, scheduling and memory planning: everything between a verified
//! [`rlx_ir::Graph`] and the [`Plan`] a backend compiles.
//!
//! The pipeline ([`plan_graph`]) is: verify, dead-code elimination, verify, schedule
//! (respecting in-place writes to persistent handles), memory plan.

pub mod dce;
pub mod lifetimes;
mod plan;
pub mod schedule;

pub use lifetimes::{assign_offsets, Lifetime, OffsetAssignment};
pub use plan::{plan_graph, Location, MemoryStats, Plan, PlanOptions, Region, Source};
