//! Reading an ONNX file: the protobuf, its opsets, and its inputs and outputs with their
//! (possibly symbolic) shapes.

use crate::import::{ImportOptions, ImportedGraph, Importer};
use crate::proto::{ModelProto, ValueInfoProto, type_proto};
use crate::tensor::{dtype_from_onnx, onnx_type_name};
use prost::Message;
use rlx_ir::{DType, Error, Result};
use std::collections::HashSet;
use std::fmt;
use std::path::{Path, PathBuf};

/// One dimension of a declared input or output shape.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Dim {
    /// A fixed size.
    Fixed(usize),
    /// A named size bound at import (`batch`, `sequence`, ...).
    Symbol(String),
    /// A size the model leaves unnamed; only an input's data can give it.
    Unknown,
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Fixed(n) => write!(f, "{n}"),
            Dim::Symbol(s) => f.write_str(s),
            Dim::Unknown => f.write_str("?"),
        }
    }
}

/// A declared graph input or output.
#[derive(Clone, Debug, PartialEq)]
pub struct ValueInfo {
    /// The value's name.
    pub name: String,
    /// Its element type, when it is a tensor of a type RLX supports.
    pub dtype: Option<DType>,
    /// The ONNX type as text (`tensor(float)`, `seq(tensor(int64))`, ...).
    pub type_name: String,
    /// The declared dims, when a shape is declared.
    pub dims: Option<Vec<Dim>>,
    /// For a sequence of tensors: the tensors' element type, when RLX supports it.
    /// Such a value is given and returned as one tensor per element, named
    /// `name[0]`, `name[1]`, ... (see [`sequence_item_name`]).
    pub sequence_of: Option<DType>,
}

/// The name under which element `index` of the sequence input or output `name` is
/// given to or returned from a run: `name[index]`.
pub fn sequence_item_name(name: &str, index: usize) -> String {
    format!("{name}[{index}]")
}

impl fmt::Display for ValueInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.name, self.type_name)?;
        if let Some(dims) = &self.dims {
            let dims: Vec<String> = dims.iter().map(Dim::to_string).collect();
            write!(f, " [{}]", dims.join(", "))?;
        }
        Ok(())
    }
}

pub(crate) fn value_info(v: &ValueInfoProto) -> ValueInfo {
    let name = v.name.clone().unwrap_or_default();
    let mut sequence_of = None;
    let (dtype, type_name, dims) = match v.r#type.as_ref().and_then(|t| t.value.as_ref()) {
        Some(type_proto::Value::TensorType(t)) => {
            let code = t.elem_type.unwrap_or(0);
            let dims =
                t.shape.as_ref().map(|s| {
                    s.dim
                        .iter()
                        .map(|d| match &d.value {
                            Some(crate::proto::tensor_shape_proto::dimension::Value::DimValue(
                                n,
                            )) => usize::try_from(*n).map_or(Dim::Unknown, Dim::Fixed),
                            Some(crate::proto::tensor_shape_proto::dimension::Value::DimParam(
                                s,
                            )) if !s.is_empty() => Dim::Symbol(s.clone()),
                            _ => Dim::Unknown,
                        })
                        .collect()
                });
            (
                dtype_from_onnx(code, &name).ok(),
                format!("tensor({})", onnx_type_name(code).to_lowercase()),
                dims,
            )
        }
        Some(type_proto::Value::SequenceType(seq)) => {
            let elem = seq
                .elem_type
                .as_ref()
                .and_then(|t| t.value.as_ref())
                .and_then(|v| match v {
                    type_proto::Value::TensorType(t) => Some(t.elem_type.unwrap_or(0)),
                    _ => None,
                });
            sequence_of = elem.and_then(|code| dtype_from_onnx(code, &name).ok());
            let inner = match elem {
                Some(code) => format!("tensor({})", onnx_type_name(code).to_lowercase()),
                None => "?".to_string(),
            };
            (None, format!("seq({inner})"), None)
        }
        Some(type_proto::Value::MapType(_)) => (None, "map".to_string(), None),
        Some(type_proto::Value::OptionalType(_)) => (None, "optional".to_string(), None),
        Some(type_proto::Value::SparseTensorType(_)) => (None, "sparse_tensor".to_string(), None),
        None => (None, "unknown".to_string(), None),
    };
    ValueInfo {
        name,
        dtype,
        type_name,
        dims,
        sequence_of,
    }
}

/// A parsed ONNX model, ready to import at any binding of its symbolic dims.
#[derive(Clone, Debug)]
pub struct OnnxModel {
    /// The model with its graph taken out (into `graph`).
    pub(crate) proto: ModelProto,
    graph: crate::proto::GraphProto,
    pub(crate) base_dir: Option<PathBuf>,
    pub(crate) path: String,
}

impl OnnxModel {
    /// Reads and parses a `.onnx` file. External data files are looked up next to it.
    pub fn load(path: impl AsRef<Path>) -> Result<OnnxModel> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| Error::Io {
            path: path.display().to_string(),
            message: e.to_string(),
        })?;
        OnnxModel::from_bytes(&bytes, path.parent(), &path.display().to_string())
    }

    /// Parses a model from bytes; `base_dir` is where external data lives, `name`
    /// names the model in errors.
    pub fn from_bytes(bytes: &[u8], base_dir: Option<&Path>, name: &str) -> Result<OnnxModel> {
        let mut proto = ModelProto::decode(bytes).map_err(|e| Error::Format {
            path: name.to_string(),
            message: format!("not an ONNX model protobuf: {e}"),
        })?;
        let graph = proto.graph.take().ok_or_else(|| Error::Format {
            path: name.to_string(),
            message: "the model has no graph".into(),
        })?;
        Ok(OnnxModel {
            proto,
            graph,
            base_dir: base_dir.map(Path::to_path_buf),
            path: name.to_string(),
        })
    }

    /// The file (or name) the model came from.
    pub fn path(&self) -> &str {
        &self.path
    }

    /// The opset version of the default (`ai.onnx`) domain.
    pub fn opset(&self) -> i64 {
        opset_of(&self.proto.opset_import, "")
    }

    /// The runtime inputs (graph inputs that are not initializers), in order.
    pub fn inputs(&self) -> Vec<ValueInfo> {
        let graph = self.graph();
        let init: HashSet<&str> = graph
            .initializer
            .iter()
            .filter_map(|t| t.name.as_deref())
            .collect();
        graph
            .input
            .iter()
            .filter(|v| !init.contains(v.name.as_deref().unwrap_or("")))
            .map(value_info)
            .collect()
    }

    /// The graph outputs, in order.
    pub fn outputs(&self) -> Vec<ValueInfo> {
        self.graph().output.iter().map(value_info).collect()
    }

    /// The symbolic dim names the inputs use, in first-use order.
    pub fn symbols(&self) -> Vec<String> {
        let mut out: Vec<String> = Vec::new();
        for v in self.inputs() {
            for d in v.dims.into_iter().flatten() {
                if let Dim::Symbol(s) = d
                    && !out.contains(&s)
                {
                    out.push(s);
                }
            }
        }
        out
    }

    /// Imports the model as an RLX graph with every dim made concrete by `options`.
    pub fn import(&self, options: &ImportOptions) -> Result<ImportedGraph> {
        Importer::new(self, options)?.run()
    }

    pub(crate) fn graph(&self) -> &crate::proto::GraphProto {
        &self.graph
    }
}

/// The version a model imports for `domain` (`""` and `ai.onnx` are the same domain),
/// or 0 when it imports none.
pub(crate) fn opset_of(imports: &[crate::proto::OperatorSetIdProto], domain: &str) -> i64 {
    let norm = |d: &str| if d == "ai.onnx" { "" } else { d }.to_string();
    imports
        .iter()
        .find(|o| norm(o.domain.as_deref().unwrap_or("")) == norm(domain))
        .and_then(|o| o.version)
        .unwrap_or(0)
}
