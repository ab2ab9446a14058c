//! Graph passes, scheduling and memory planning: everything between a verified
//! [`rlx_ir::Graph`] and the [`Plan`] a backend compiles.
//!
//! The pipeline ([`plan_graph`]) is: verify, dead-code elimination, verify, schedule
//! (respecting in-place writes to persistent handles), memory plan.

pub mod dce;
pub mod lifetimes;
mod plan;
pub mod schedule;

pub use lifetimes::{Lifetime, OffsetAssignment, assign_offsets};
pub use plan::{Location, MemoryStats, Plan, PlanOptions, Region, Source, plan_graph};
