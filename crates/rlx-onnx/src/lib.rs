//! ONNX import for RLX.
//!
//! [`OnnxModel::load`] parses a `.onnx` file (external data files are read from its
//! directory); [`OnnxModel::import`] turns it into an RLX [`Graph`](rlx_ir::Graph)
//! with every symbolic dim bound, plus the values of its params. Shape arithmetic
//! folds to constants during import, so the graph has the fixed shapes the compiler
//! plans memory for. An operator or attribute RLX cannot import is an error that names
//! the node, its type, domain and opset.
//!
//! ```no_run
//! use rlx_onnx::{ImportOptions, OnnxModel};
//! let model = OnnxModel::load("model.onnx")?;
//! for input in model.inputs() {
//!     println!("{input}"); // e.g. "input_ids: tensor(int64) [batch, sequence]"
//! }
//! let imported = model.import(&ImportOptions::new().symbol("batch", 1).symbol("sequence", 128))?;
//! println!("{} nodes, {} params", imported.graph.len(), imported.params.len());
//! # Ok::<(), rlx_ir::Error>(())
//! ```

mod control;
mod import;
mod model;
mod ops;
pub mod proto;
mod sequence;
mod tensor;
mod weight_views;

pub use import::{ImportOptions, ImportedGraph};
pub use model::{Dim, OnnxModel, ValueInfo, sequence_item_name};
pub use ops::supported_ops;
pub use tensor::{
    Tensor, checked_dims, decode_tensor, dtype_from_onnx, dtype_to_onnx, onnx_type_name,
};
