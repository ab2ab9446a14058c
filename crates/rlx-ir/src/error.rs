//! The one error type of RLX. Every fallible public function returns [`Result`].

use crate::{DType, Shape};

/// Shorthand for `std::result::Result<T, rlx::Error>`.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// What went wrong, with the node, name, shapes or file involved.
#[derive(Debug, thiserror::Error, Clone, PartialEq)]
#[non_exhaustive]
pub enum Error {
    /// Operand shapes are incompatible for an op (build time).
    #[error("{op}: incompatible shapes {lhs} and {rhs}: {reason}")]
    ShapeMismatch {
        /// The op being built.
        op: String,
        /// First operand shape.
        lhs: Shape,
        /// Second operand shape.
        rhs: Shape,
        /// Why they do not fit.
        reason: String,
    },
    /// An operand has a dtype the op does not accept, or dtypes disagree.
    #[error("{context}: expected dtype {expected}, got {got}")]
    DTypeMismatch {
        /// Where the mismatch was found (op, input or param name).
        context: String,
        /// What was expected (a dtype or a class such as "float").
        expected: String,
        /// What was given.
        got: DType,
    },
    /// An argument (axis, permutation, size, attribute) is out of range or malformed.
    #[error("{context}: {message}")]
    InvalidArgument {
        /// Where: the op, function or option.
        context: String,
        /// What was wrong.
        message: String,
    },
    /// A name (input, param, handle, output) is not known to the graph.
    #[error("unknown {kind} '{name}'; known {kind}s: [{}]", known.join(", "))]
    UnknownName {
        /// "input", "param", "handle" or "output".
        kind: &'static str,
        /// The name given.
        name: String,
        /// The names that exist.
        known: Vec<String>,
    },
    /// A buffer has the wrong number of elements or bytes.
    #[error("{kind} '{name}': expected {expected} {unit}, got {got}")]
    LengthMismatch {
        /// "input", "param", "handle", "output" or "destination".
        kind: &'static str,
        /// Its name.
        name: String,
        /// Expected count.
        expected: usize,
        /// Given count.
        got: usize,
        /// "elements" or "bytes".
        unit: &'static str,
    },
    /// A required input was not supplied to a run.
    #[error("missing input '{name}' (expected {shape})")]
    MissingInput {
        /// The input's name.
        name: String,
        /// Its declared shape.
        shape: Shape,
    },
    /// The same name was given twice.
    #[error("{kind} '{name}' given more than once")]
    DuplicateName {
        /// "input", "param" or "handle".
        kind: &'static str,
        /// The repeated name.
        name: String,
    },
    /// A param was never set before running.
    #[error("param '{name}' ({shape}) has not been set; call set_param before run")]
    ParamNotSet {
        /// The param's name.
        name: String,
        /// Its declared shape.
        shape: Shape,
    },
    /// The graph is malformed (found by the verifier or a pass).
    #[error("invalid graph '{graph}': node {node}: {message}")]
    InvalidGraph {
        /// Graph name.
        graph: String,
        /// Node index, or `-` for graph-level problems.
        node: String,
        /// What is wrong.
        message: String,
    },
    /// A valid request that this device or build does not support.
    #[error("unsupported on {device}: {what}")]
    Unsupported {
        /// The device or component.
        device: String,
        /// What was asked for.
        what: String,
    },
    /// The requested device is not present on this machine or not built in.
    #[error("device {device} is not available: {reason}")]
    DeviceUnavailable {
        /// The device.
        device: String,
        /// Why.
        reason: String,
    },
    /// A value met at run time is out of range (for example a gather index).
    #[error("run-time error in {context}: {message}")]
    Runtime {
        /// Node or kernel.
        context: String,
        /// What happened.
        message: String,
    },
    /// A tensor, region or file section is larger than can be addressed: its element
    /// or byte count overflows, or it needs more than `isize::MAX` bytes. Found when the
    /// graph is built, planned or read, never by a panic.
    #[error("{context}: {what} needs more than isize::MAX bytes")]
    SizeOverflow {
        /// Where: the input, param, op, region or file.
        context: String,
        /// What is too large: a shape such as `f32[4294967296, 4294967296]`, or a sum
        /// of sizes.
        what: String,
    },
    /// An allocation failed: the memory asked for is not available.
    #[error("cannot allocate {bytes} bytes for {tensor}: out of memory")]
    OutOfMemory {
        /// The tensor or buffer: a param, input, handle or the arena.
        tensor: String,
        /// The bytes asked for.
        bytes: usize,
    },
    /// A file could not be read.
    #[error("{path}: {message}")]
    Io {
        /// The file.
        path: String,
        /// The OS error, as text.
        message: String,
    },
    /// A file was read but its contents are malformed.
    #[error("{path}: malformed: {message}")]
    Format {
        /// The file.
        path: String,
        /// What is wrong, with byte offsets or names where known.
        message: String,
    },
    /// A packaged model could not be fetched into the local cache.
    #[error("cannot fetch model '{name}': {message}")]
    Fetch {
        /// The model's short name.
        name: String,
        /// What failed, and how to use local files instead.
        message: String,
    },
}

impl Error {
    /// Shorthand for [`Error::InvalidArgument`].
    pub fn invalid(context: impl Into<String>, message: impl Into<String>) -> Error {
        Error::InvalidArgument {
            context: context.into(),
            message: message.into(),
        }
    }

    /// Shorthand for [`Error::Runtime`].
    pub fn runtime(context: impl Into<String>, message: impl Into<String>) -> Error {
        Error::Runtime {
            context: context.into(),
            message: message.into(),
        }
    }

    /// Shorthand for [`Error::DTypeMismatch`].
    pub fn dtype(context: impl Into<String>, expected: impl Into<String>, got: DType) -> Error {
        Error::DTypeMismatch {
            context: context.into(),
            expected: expected.into(),
            got,
        }
    }
}
