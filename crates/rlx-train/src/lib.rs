//! Training in RLX: a model graph, its loss and an optimizer compile into one step
//! graph (forward, reverse-mode gradients, the optimizer's update written in place
//! into persistent params and state), so a training step is one run and the weights
//! never cross to the host.
//!
//! ```
//! use rlx_ir::{DType, Graph, Shape, Sgd, TensorRef};
//! use rlx_runtime::Session;
//! use rlx_train::{LrSchedule, Optimizer, TrainOptions, Trainer};
//!
//! // Fit y = 2x with one weight.
//! let g = Graph::new("line");
//! let x = g.input("x", Shape::new(&[4, 1], DType::F32))?;
//! let y = g.input("y", Shape::new(&[4, 1], DType::F32))?;
//! let w = g.param("w", Shape::new(&[1, 1], DType::F32))?;
//! let loss = g.mse(g.matmul(x, w)?, y)?;
//! let sgd = Optimizer::Sgd(Sgd { momentum: 0.0, nesterov: false, weight_decay: 0.0 });
//! let options = TrainOptions::new(sgd).schedule(LrSchedule::Constant(0.1));
//! let mut trainer = Trainer::new(&Session::new(rlx_driver::Device::Cpu), &g, loss, options)?;
//! let (xs, ys) = ([1.0f32, 2.0, 3.0, 4.0], [2.0f32, 4.0, 6.0, 8.0]);
//! for _ in 0..50 {
//!     trainer.step(&[("x", TensorRef::F32(&xs)), ("y", TensorRef::F32(&ys))])?;
//! }
//! assert!((trainer.param("w")?[0] - 2.0).abs() < 1e-3);
//! # Ok::<(), rlx_ir::Error>(())
//! ```

mod checkpoint;
pub mod jobs;
mod layers;
mod optimizer;
mod rng;
mod schedule;
mod step_graph;
mod trainer;

pub use layers::{ModelBuilder, Network};
pub use optimizer::Optimizer;
pub use rng::Rng;
pub use schedule::LrSchedule;
pub use step_graph::{LR_INPUT, STEP_INPUT, TensorSpec};
pub use trainer::{Evaluator, TrainOptions, Trainer};
