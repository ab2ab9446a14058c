//! The RLX runtime: a [`Session`] compiles a [`Graph`] for one [`Device`] into a
//! [`CompiledGraph`], which is run many times with no allocation on its hot path.
//!
//! ```
//! use rlx_runtime::{Session, Device};
//! use rlx_ir::{DType, Graph, Shape};
//! let g = Graph::new("double");
//! let x = g.input("x", Shape::new(&[3], DType::F32))?;
//! let y = g.add(x, x)?;
//! g.set_outputs(vec![y]);
//! let mut compiled = Session::new(Device::Cpu).compile(g)?;
//! assert_eq!(compiled.run(&[("x", &[1.0, 2.0, 3.0])])?, vec![vec![2.0, 4.0, 6.0]]);
//! # Ok::<(), rlx_ir::Error>(())
//! ```

mod bucketed;
mod compiled;
mod registry;
mod session;
mod symbolic;

pub use bucketed::{BucketedCompileCache, Buckets};
pub use compiled::{CompiledGraph, SlotOutputs};
pub use registry::{backend_for, device_available};
pub use rlx_backend::{Backend, BackendOptions, Executable, HandleStorage, SharedParam};
pub use rlx_driver::{BufferHandle, Device};
pub use rlx_ir::{Error, Graph, Result};
pub use rlx_opt::MemoryStats;
pub use session::{CompileOptions, Session};
pub use symbolic::{GraphBuilder, SymbolRange, SymbolicGraph};
