//! The RLX intermediate representation.
//!
//! A [`Graph`] is built node by node; every builder method infers and checks the
//! output shape and dtype (numpy broadcasting) and returns an [`Error`] naming the op
//! and the shapes when they do not fit. [`Graph::verify`] checks a whole graph,
//! `Display` prints it, and [`reference::evaluate`] runs it with plain loops, defining
//! what each op means.
//!
//! ```
//! use rlx_ir::{DType, Graph, Shape};
//! let g = Graph::new("mlp");
//! let x = g.input("x", Shape::new(&[2, 4], DType::F32))?;
//! let w = g.param("w", Shape::new(&[4, 3], DType::F32))?;
//! let b = g.param("b", Shape::new(&[3], DType::F32))?;
//! let y = g.gelu(g.add(g.matmul(x, w)?, b)?)?;
//! g.set_outputs(vec![y]);
//! assert_eq!(g.shape(y)?.dims(), &[2, 3]);
//! # Ok::<(), rlx_ir::Error>(())
//! ```

pub mod decompose;
mod display;
mod dtype;
pub mod env;
mod error;
mod graph;
mod infer;
mod op;
pub mod ops;
pub mod quant;
pub mod reference;
pub mod scalar;
mod shape;
mod symbolic;
mod tensor;
mod verify;

pub use display::op_attributes;
pub use dtype::DType;
pub use error::{Error, Result};
pub use graph::{ConstantsRef, Graph, Node, NodeId, NodesRef};
pub use infer::infer_shape;
pub use op::{
    ArgReduceOp, BinaryOp, ConvFusion, F64Bits, Op, PadMode, ReduceOp, RopeStyle, SliceAxis,
    TopKOutput, UnaryOp, Window2d,
};
pub use ops::fused::{
    EwStep, MAX_REGION_INPUTS, MAX_REGION_REGISTERS, fusable_binary, fusable_unary,
    per_channel_operand,
};
pub use ops::loss::CrossEntropy;
pub use ops::matmul::{MatMulDims, matmul_dims};
pub use ops::optim::{Adam, Sgd};
pub use quant::{QuantFormat, dequantize_row};
pub use shape::{MAX_RANK, Shape, broadcast_dims, contiguous_strides, normalize_axis};
pub use symbolic::{Bindings, Dim, SymbolicShape};
pub use tensor::{TensorData, TensorRef};
