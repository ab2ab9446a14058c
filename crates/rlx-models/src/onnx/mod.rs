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
    /// A fingerprint of every param's value, so that later bindings can tell which
    /// params they can share with this one.
    fingerprints: HashMap<String, u128>,
}

/// A 128-bit fingerprint of a param's dtype, length and bytes (two independently
/// seeded 64-bit hashes).
fn fingerprint(data: &TensorData) -> u128 {
    use std::hash::{Hash, Hasher};
    let bytes = data.as_ref().to_le_bytes();
    let half = |seed: u64| {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        seed.hash(&mut h);
        data.dtype().hash(&mut h);
        bytes.hash(&mut h);
        h.finish()
    };
    (u128::from(half(0x9e37_79b9_7f4a_7c15)) << 64) | u128::from(half(0x2545_f491_4f6c_dd1d))
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

    /// A session over a parsed model, compiled with `options` for the CPU.
    pub fn new(model: OnnxModel, options: CompileOptions) -> OnnxSession {
        OnnxSession::on_device(model, rlx_driver::Device::Cpu, options)
    }

    /// A session over a parsed model, compiled with `options` for `device` (an
    /// unavailable device is reported when the first binding is compiled).
    pub fn on_device(
        model: OnnxModel,
        device: rlx_driver::Device,
        options: CompileOptions,
    ) -> OnnxSession {
        OnnxSession {
            model,
            session: Session::new(device),
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
        let fits = |c: &CompiledOnnx| {
            c.specialized.iter().all(|(name, v)| {
                options
                    .input_values
                    .get(name)
                    .is_some_and(|given| given.data == v.data)
            })
        };
        let found = self
            .compiled
            .get(&key)
            .and_then(|entries| entries.iter().position(fits));
        let index = match found {
            Some(i) => i,
            None => {
                let compiled = self.import_and_compile(options)?;
                let entries = self.compiled.entry(key.clone()).or_default();
                if entries.len() >= MAX_SPECIALIZATIONS {
                    entries.remove(0);
                }
                entries.push(compiled);
                entries.len() - 1
            }
        };
        let entries = self
            .compiled
            .get_mut(&key)
            .ok_or_else(|| Error::runtime("onnx", "a compiled binding vanished"))?;
        Ok(&mut entries[index])
    }

    /// Imports and compiles one binding, adopting the storage of the params of one
    /// earlier binding (the first whose same-named params have the same shapes) that
    /// hold the same values: one copy of the weights.
    fn import_and_compile(&self, options: &ImportOptions) -> Result<CompiledOnnx> {
        let imported = self.model.import(options)?;
        let mut graph = self.session.compile_with(&imported.graph, &self.options)?;
        let fingerprints: HashMap<String, u128> = imported
            .params
            .iter()
            .map(|(name, data)| (name.clone(), fingerprint(data)))
            .collect();
        let source = self
            .compiled
            .values()
            .flatten()
            .find(|c| graph.share_params_from(&c.graph).is_ok());
        for (name, data) in &imported.params {
            let same = source.is_some_and(|c| {
                c.fingerprints.contains_key(name)
                    && c.fingerprints.get(name) == fingerprints.get(name)
            });
            if !same {
                graph.set_param_typed(name, data.as_ref())?;
            }
        }
        let specialized = imported
            .specialized
            .iter()
            .filter_map(|n| options.input_values.get(n).map(|v| (n.clone(), v.clone())))
            .collect();
        Ok(CompiledOnnx {
            graph,
            inputs: imported.inputs,
            outputs: imported.outputs,
            specialized,
            fingerprints,
        })
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
