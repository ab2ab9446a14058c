//! Adapters from device crates to the [`crate::Backend`] trait.

pub mod cpu;
