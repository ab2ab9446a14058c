//! Running ONNX models: import at the shapes of the inputs given, compile once per
//! shape, set the params, run.

pub mod conformance;

use rlx_ir::{Error, Result, Shape, TensorData};
use rlx_onnx::{ImportOptions, OnnxModel, Tensor};
use rlx_runtime::{CompileOptions, CompiledGraph, Session};
use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::rc::Rc;

/// One compiled binding of a model.
pub struct CompiledOnnx {
    /// The compiled graph, params set.
    pub graph: CompiledGraph,
    /// Its inputs with their concrete shapes, in the model's order.
    pub inputs: Vec<(String, Shape)>,
    /// The model's output names, in order.
    pub outputs: Vec<String>,
    /// Inputs whose values the graph was specialized on, with those values.
    pub specialized: Vec<(String, Rc<Tensor>)>,
}

/// What a compiled binding is looked up by: symbol sizes and input dims.
type BindingKey = (Vec<(String, usize)>, Vec<(String, Vec<usize>)>);

/// An ONNX model ready to run at any binding of its symbolic dims. Each distinct
/// binding (and each set of values of inputs the import specialized on) is imported
/// and compiled once and kept.
pub struct OnnxSession {
    model: OnnxModel,
    session: Session,
    options: CompileOptions,
    compiled: HashMap<BindingKey, Vec<CompiledOnnx>>,
}

/// Most specializations kept per binding; the oldest is dropped past this.
const MAX_SPECIALIZATIONS: usize = 8;

impl OnnxSession {
    /// Loads a `.onnx` file for the CPU.
    pub fn load(path: impl AsRef<Path>) -> Result<OnnxSession> {
        Ok(OnnxSession::new(
            OnnxModel::load(path)?,
            CompileOptions::new(),
        ))
    }

    /// A session over a parsed model, compiled with `options`.
    pub fn new(model: OnnxModel, options: CompileOptions) -> OnnxSession {
        OnnxSession {
            model,
            session: Session::new(rlx_driver::Device::Cpu),
            options,
            compiled: HashMap::new(),
        }
    }

    /// The model.
    pub fn model(&self) -> &OnnxModel {
        &self.model
    }

    /// Imports and compiles the model for the binding in `options` (once; later calls
    /// with the same binding, and the same values for any input the import
    /// specialized on, reuse it).
    pub fn prepare(&mut self, options: &ImportOptions) -> Result<&mut CompiledOnnx> {
        let key: BindingKey = (
            options
                .symbols
                .iter()
                .map(|(k, v)| (k.clone(), *v))
                .collect(),
            options
                .input_dims
                .iter()
                .map(|(k, v)| (k.clone(), v.clone()))
                .collect(),
        );
        let entries = self.compiled.entry(key).or_default();
        let fits = |c: &CompiledOnnx| {
            c.specialized.iter().all(|(name, v)| {
                options
                    .input_values
                    .get(name)
                    .is_some_and(|given| given.data == v.data)
            })
        };
        let index = match entries.iter().position(fits) {
            Some(i) => i,
            None => {
                let imported = self.model.import(options)?;
                let mut graph = self.session.compile_with(&imported.graph, &self.options)?;
                for (name, data) in &imported.params {
                    graph.set_param_typed(name, data.as_ref())?;
                }
                let specialized = imported
                    .specialized
                    .iter()
                    .filter_map(|n| options.input_values.get(n).map(|v| (n.clone(), v.clone())))
                    .collect();
                if entries.len() >= MAX_SPECIALIZATIONS {
                    entries.remove(0);
                }
                entries.push(CompiledOnnx {
                    graph,
                    inputs: imported.inputs,
                    outputs: imported.outputs,
                    specialized,
                });
                entries.len() - 1
            }
        };
        Ok(&mut entries[index])
    }

    /// Runs the model on named inputs (their dims bind the model's symbolic dims, and
    /// `symbols` binds any others) and returns the named outputs.
    pub fn run(
        &mut self,
        inputs: &[(&str, &Tensor)],
        symbols: &BTreeMap<String, usize>,
    ) -> Result<Vec<(String, Tensor)>> {
        let mut options = ImportOptions::new();
        options.symbols = symbols.clone();
        for (name, t) in inputs {
            if options.input_values.contains_key(*name) {
                return Err(Error::DuplicateName {
                    kind: "input",
                    name: name.to_string(),
                });
            }
            options = options.input_value(*name, (*t).clone());
        }
        let compiled = self.prepare(&options)?;
        let mut feeds = Vec::with_capacity(inputs.len());
        for (name, shape) in &compiled.inputs {
            let t = inputs
                .iter()
                .find(|(n, _)| n == name)
                .map(|(_, t)| *t)
                .ok_or_else(|| Error::MissingInput {
                    name: name.clone(),
                    shape: shape.clone(),
                })?;
            if t.data.dtype() != shape.dtype() {
                return Err(Error::dtype(
                    format!("input '{name}'"),
                    shape.dtype().name(),
                    t.data.dtype(),
                ));
            }
            feeds.push((name.as_str(), t.data.as_ref()));
        }
        let shapes = compiled.graph.output_shapes();
        let values: Vec<TensorData> = compiled.graph.run_typed(&feeds)?;
        Ok(compiled
            .outputs
            .iter()
            .zip(values)
            .zip(shapes)
            .map(|((name, data), shape)| {
                (
                    name.clone(),
                    Tensor {
                        dims: shape.dims().to_vec(),
                        data,
                    },
                )
            })
            .collect())
    }
}
