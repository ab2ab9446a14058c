//! The importer: walks an ONNX graph in order and emits RLX nodes.
//!
//! Every dim is concrete during import (symbols are bound by [`ImportOptions`]), so
//! shape arithmetic (`Shape`, `Gather`, `Concat`, ... feeding a `Reshape`) folds to
//! constants as it is met: a node whose inputs are all known is built in a scratch
//! graph and evaluated there with the reference evaluator, and its outputs become
//! known values too. Known values reach the real graph only when a run-time node reads
//! them: small ones as constants, large float ones as params.

use crate::model::{Dim, OnnxModel, ValueInfo, value_info};
use crate::ops::{self, Converter};
use crate::proto::{AttributeProto, GraphProto, NodeProto};
use crate::tensor::{Tensor, decode_tensor};
use rlx_ir::reference::{HostTensor, evaluate};
use rlx_ir::{DType, Error, Graph, NodeId, Result, Shape, TensorData};
use std::collections::{BTreeMap, BTreeSet, HashMap, HashSet};
use std::rc::Rc;

/// How to make a model's dims concrete.
#[derive(Clone, Debug, Default)]
pub struct ImportOptions {
    /// Sizes for symbolic dims (`batch` = 8).
    pub symbols: BTreeMap<String, usize>,
    /// Full dims for named inputs; they win over the declared shape (an input file
    /// gives its input both data and shape, which covers dims a model leaves unnamed).
    pub input_dims: BTreeMap<String, Vec<usize>>,
    /// Values of inputs, for an import that may specialize on them: an input read
    /// where the importer needs a value it knows (a `Reshape` target, reduction axes,
    /// a loop's trip count) takes this value, and [`ImportedGraph::specialized`] names
    /// it. Inputs used only as data stay run-time inputs.
    pub input_values: BTreeMap<String, Rc<Tensor>>,
}

impl ImportOptions {
    /// No bindings.
    pub fn new() -> ImportOptions {
        ImportOptions::default()
    }

    /// Binds a symbolic dim.
    pub fn symbol(mut self, name: impl Into<String>, size: usize) -> ImportOptions {
        self.symbols.insert(name.into(), size);
        self
    }

    /// Parses a binding written `SYM=N` (as on the command line): `N` must be a whole
    /// number of at least 1.
    pub fn parse_binding(text: &str) -> Result<(String, usize)> {
        rlx_ir::Bindings::parse(text)
    }

    /// Gives an input's full dims.
    pub fn input_dims(mut self, name: impl Into<String>, dims: &[usize]) -> ImportOptions {
        self.input_dims.insert(name.into(), dims.to_vec());
        self
    }

    /// Gives an input's value (and so its dims) for specialization.
    pub fn input_value(mut self, name: impl Into<String>, value: Tensor) -> ImportOptions {
        let name = name.into();
        self.input_dims.insert(name.clone(), value.dims.clone());
        self.input_values.insert(name, Rc::new(value));
        self
    }
}

/// The result of an import: a graph to compile and the values of its params.
#[derive(Debug)]
pub struct ImportedGraph {
    /// The RLX graph. Its inputs carry the ONNX input names.
    pub graph: Graph,
    /// Values for every param of `graph` (initializers and what folded from them).
    pub params: Vec<(String, TensorData)>,
    /// The graph's run-time inputs with their concrete shapes, in ONNX order.
    pub inputs: Vec<(String, Shape)>,
    /// The ONNX output names, in order (the graph's outputs follow this order).
    pub outputs: Vec<String>,
    /// Inputs whose given values the graph was specialized on: it is valid only for
    /// runs that give those inputs the same values.
    pub specialized: Vec<String>,
}

/// Float values with more elements than this become params rather than constants.
const PARAM_THRESHOLD: usize = 64;
/// Nodes whose known inputs, or any value their folding computes, hold more
/// elements than this are not folded at import.
pub(crate) const FOLD_LIMIT: usize = 1 << 26;

/// Most nodes, and most elements in any one of them, that [`derived_hint`] evaluates.
const DERIVED_NODES: usize = 512;
const DERIVED_ELEMENTS: usize = 1 << 16;

/// The value of node `id` computed from the values given for the graph inputs it
/// reads, with those inputs' names: when it reads nothing but such inputs and
/// constants, through a few small nodes (shape arithmetic on a given size, say).
fn derived_hint(
    g: &Graph,
    hints: &HashMap<NodeId, Rc<Tensor>>,
    id: NodeId,
) -> Option<(Rc<Tensor>, Vec<String>)> {
    let nodes = g.nodes();
    let mut needed = BTreeMap::new();
    let mut stack = vec![id];
    while let Some(n) = stack.pop() {
        if needed.insert(n.index(), n).is_some() {
            continue;
        }
        let node = nodes.get(n.index())?;
        if needed.len() > DERIVED_NODES || node.shape.num_elements() > DERIVED_ELEMENTS {
            return None;
        }
        match &node.op {
            rlx_ir::Op::Input { .. } if hints.contains_key(&n) => {}
            rlx_ir::Op::Input { .. } | rlx_ir::Op::Param { .. } | rlx_ir::Op::WriteAt { .. } => {
                return None;
            }
            _ => stack.extend(node.inputs.iter().copied()),
        }
    }
    let constants = g.constants();
    let mut values: HashMap<NodeId, rlx_ir::reference::HostTensor> = HashMap::new();
    let mut inputs = Vec::new();
    // Node ids follow creation order, in which operands come first.
    for &n in needed.values() {
        let node = nodes.get(n.index())?;
        let value = match &node.op {
            rlx_ir::Op::Input { name } => {
                inputs.push(name.clone());
                let given = hints.get(&n)?;
                rlx_ir::reference::HostTensor::from_data(&given.dims, &given.data).ok()?
            }
            op => {
                let args: Vec<&rlx_ir::reference::HostTensor> = node
                    .inputs
                    .iter()
                    .map(|a| values.get(a))
                    .collect::<Option<_>>()?;
                rlx_ir::reference::eval_node(op, &args, &node.shape, &constants).ok()?
            }
        };
        values.insert(n, value);
    }
    let value = values.remove(&id)?;
    let dims = value.shape.dims().to_vec();
    Some((
        Rc::new(Tensor {
            dims,
            data: value.to_data(),
        }),
        inputs,
    ))
}

/// One named value during import.
#[derive(Clone, Debug)]
pub(crate) struct Slot {
    pub shape: Shape,
    pub known: Option<Rc<Tensor>>,
    pub node: Option<NodeId>,
    /// For a sequence value, its elements (a sequence's length is known at import);
    /// `shape`, `known` and `node` then describe nothing.
    pub items: Option<Rc<Vec<Slot>>>,
}

impl Slot {
    /// A sequence of `items`.
    pub fn sequence(items: Vec<Slot>) -> Slot {
        Slot {
            shape: Shape::scalar(DType::F32),
            known: None,
            node: None,
            items: Some(Rc::new(items)),
        }
    }
}

/// Where a converter's known operands become nodes.
pub(crate) struct Sink<'a> {
    params: &'a mut Vec<(String, TensorData)>,
    param_names: &'a mut HashSet<String>,
    specialized: &'a mut BTreeSet<String>,
    /// Nodes made from known values (e.g. a transposed weight), by the value's
    /// address and what was made, so every reader shares one.
    derived: &'a mut HashMap<(usize, &'static str), NodeId>,
    /// Scratch graphs for folding take every known value as a constant.
    folding: bool,
    /// The values given for graph inputs, by node (none while folding), from which
    /// [`Cx::konst`] computes a value it must know.
    hints: Option<&'a HashMap<NodeId, Rc<Tensor>>>,
}

/// An operand of the node being converted.
#[derive(Clone)]
pub(crate) struct Operand {
    pub name: String,
    pub slot: Slot,
    /// The value given for the graph input this operand is, if any.
    pub hint: Option<Rc<Tensor>>,
}

/// What a converter sees: the graph to build in, the node, its operands.
pub(crate) struct Cx<'a> {
    /// The graph nodes are added to.
    pub g: &'a Graph,
    /// The ONNX node.
    pub node: &'a NodeProto,
    /// The default-domain opset the model imports.
    pub opset: i64,
    operands: Vec<Option<Operand>>,
    sink: Sink<'a>,
}

fn unsupported(what: impl Into<String>) -> Error {
    Error::Unsupported {
        device: "onnx import".into(),
        what: what.into(),
    }
}

impl<'a> Cx<'a> {
    /// Number of operand positions (omitted optional ones included).
    pub fn len(&self) -> usize {
        self.operands.len()
    }

    /// Whether operand `i` is present.
    pub fn has(&self, i: usize) -> bool {
        self.operands.get(i).is_some_and(Option::is_some)
    }

    fn operand(&self, i: usize) -> Result<&Operand> {
        self.operands
            .get(i)
            .and_then(Option::as_ref)
            .ok_or_else(|| Error::invalid("operand", format!("input {i} is required")))
    }

    /// Operand `i`'s shape.
    pub fn shape(&self, i: usize) -> Result<Shape> {
        Ok(self.operand(i)?.slot.shape.clone())
    }

    /// Operand `i`'s dims.
    pub fn dims(&self, i: usize) -> Result<Vec<usize>> {
        Ok(self.operand(i)?.slot.shape.dims().to_vec())
    }

    /// Operand `i`'s dtype.
    pub fn dtype(&self, i: usize) -> Result<DType> {
        Ok(self.operand(i)?.slot.shape.dtype())
    }

    /// Operand `i`'s value, when it is known at import (or given for an input, which
    /// specializes the import on it).
    pub fn known(&mut self, i: usize) -> Option<Rc<Tensor>> {
        let op = self.operands.get(i)?.as_ref()?;
        if let Some(k) = &op.slot.known {
            return Some(k.clone());
        }
        let hint = op.hint.clone()?;
        self.sink.specialized.insert(op.name.clone());
        Some(hint)
    }

    /// Operand `i`'s value when the model itself fixes it (an initializer, a constant,
    /// or computed from those); never a value given for a graph input.
    pub fn fixed(&self, i: usize) -> Option<Rc<Tensor>> {
        self.operands.get(i)?.as_ref()?.slot.known.clone()
    }

    /// Operand `i`'s value, which must be known at import. A value computed at run
    /// time from graph inputs whose values were given is computed here from them,
    /// specializing the import on those inputs.
    pub fn konst(&mut self, i: usize) -> Result<Rc<Tensor>> {
        if let Some(k) = self.known(i) {
            return Ok(k);
        }
        let op = self.operand(i)?;
        if let (Some(hints), Some(id)) = (self.sink.hints, op.slot.node)
            && let Some((value, inputs)) = derived_hint(self.g, hints, id)
        {
            self.sink.specialized.extend(inputs);
            return Ok(value);
        }
        op.slot.known.clone().ok_or_else(|| {
            unsupported(format!(
                "input {i} ('{}') must be known when importing (it is computed at run time)",
                op.name
            ))
        })
    }

    /// Operand `i` as integers known at import.
    pub fn ints(&mut self, i: usize) -> Result<Vec<i64>> {
        Ok(self.konst(i)?.to_i64_vec())
    }

    /// Operand `i` as integers if present.
    pub fn opt_ints(&mut self, i: usize) -> Result<Option<Vec<i64>>> {
        if self.has(i) {
            self.ints(i).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Operand `i` as a node of the graph being built.
    pub fn input(&mut self, i: usize) -> Result<NodeId> {
        let g = self.g;
        let op = self
            .operands
            .get_mut(i)
            .and_then(Option::as_mut)
            .ok_or_else(|| Error::invalid("operand", format!("input {i} is required")))?;
        if let Some(id) = op.slot.node {
            return Ok(id);
        }
        let known = op
            .slot
            .known
            .clone()
            .ok_or_else(|| Error::invalid("operand", format!("'{}' has no value", op.name)))?;
        let id = materialize(g, &mut self.sink, &op.name, &known)?;
        op.slot.node = Some(id);
        Ok(id)
    }

    /// Operand `i` (a matrix) transposed, as a node. A value known at import (a
    /// weight) is transposed once here, so runs do not repeat it.
    pub fn input_transposed(&mut self, i: usize) -> Result<NodeId> {
        let known = self.operand(i)?.slot.known.clone();
        match known {
            Some(t) if t.dims.len() == 2 && t.data.dtype().is_float() => {
                let key = (Rc::as_ptr(&t) as usize, "transposed");
                if let Some(&id) = self.sink.derived.get(&key) {
                    return Ok(id);
                }
                let (r, c) = (t.dims[0], t.dims[1]);
                let v = t.to_f64_vec();
                let mut out = vec![0.0; v.len()];
                for y in 0..r {
                    for x in 0..c {
                        out[x * r + y] = v[y * c + x];
                    }
                }
                let tt = Tensor {
                    dims: vec![c, r],
                    data: TensorData::from_f64(t.data.dtype(), &out),
                };
                let name = format!("{}.T", self.operand(i)?.name);
                let id = materialize(self.g, &mut self.sink, &name, &tt)?;
                self.sink.derived.insert(key, id);
                Ok(id)
            }
            _ => {
                let x = self.input(i)?;
                self.g.permute(x, &[1, 0])
            }
        }
    }

    /// The value of graph node `id` when it is a constant or a param made during this
    /// import (so its data is at hand), as `f64`s.
    pub fn node_value(&self, id: NodeId) -> Option<Vec<f64>> {
        match self.g.node(id).ok()?.op {
            rlx_ir::Op::Constant { id } => {
                Some(self.g.constants().get(id)?.clone().as_ref().to_f64_vec())
            }
            rlx_ir::Op::Param { name } => self
                .sink
                .params
                .iter()
                .find(|(n, _)| *n == name)
                .map(|(_, d)| d.as_ref().to_f64_vec()),
            _ => None,
        }
    }

    /// A value computed at import as a new node (a constant, or a param when large).
    pub fn add_value(&mut self, name: &str, t: &Tensor) -> Result<NodeId> {
        materialize(self.g, &mut self.sink, name, t)
    }

    /// Operand `i` as a node, if present.
    pub fn opt_input(&mut self, i: usize) -> Result<Option<NodeId>> {
        if self.has(i) {
            self.input(i).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Every present operand as a node.
    pub fn inputs(&mut self) -> Result<Vec<NodeId>> {
        let present: Vec<usize> = (0..self.len()).filter(|&i| self.has(i)).collect();
        present.into_iter().map(|i| self.input(i)).collect()
    }

    /// Number of outputs the node declares.
    pub fn num_outputs(&self) -> usize {
        self.node.output.len()
    }

    /// Whether output `i` is used (declared with a non-empty name).
    pub fn wants_output(&self, i: usize) -> bool {
        self.node.output.get(i).is_some_and(|n| !n.is_empty())
    }

    fn attr(&self, name: &str) -> Option<&'a AttributeProto> {
        self.node
            .attribute
            .iter()
            .find(|a| a.name.as_deref() == Some(name))
    }

    /// Whether attribute `name` is set.
    pub fn has_attr(&self, name: &str) -> bool {
        self.attr(name).is_some()
    }

    /// An integer attribute, or `default`.
    pub fn attr_i(&self, name: &str, default: i64) -> i64 {
        self.attr(name).and_then(|a| a.i).unwrap_or(default)
    }

    /// A float attribute, or `default`.
    pub fn attr_f(&self, name: &str, default: f32) -> f32 {
        self.attr(name).and_then(|a| a.f).unwrap_or(default)
    }

    /// A string attribute, or `default`.
    pub fn attr_s(&self, name: &str, default: &str) -> String {
        self.attr(name)
            .and_then(|a| a.s.as_ref())
            .map(|s| String::from_utf8_lossy(s).into_owned())
            .unwrap_or_else(|| default.to_string())
    }

    /// An integer-list attribute, if set.
    pub fn attr_ints(&self, name: &str) -> Option<Vec<i64>> {
        self.attr(name).map(|a| a.ints.clone())
    }

    /// A string-list attribute, if set.
    pub fn attr_strings(&self, name: &str) -> Option<Vec<String>> {
        self.attr(name).map(|a| {
            a.strings
                .iter()
                .map(|s| String::from_utf8_lossy(s).into_owned())
                .collect()
        })
    }

    /// A float-list attribute, if set.
    pub fn attr_floats(&self, name: &str) -> Option<Vec<f32>> {
        self.attr(name).map(|a| a.floats.clone())
    }

    /// A tensor attribute, decoded.
    pub fn attr_tensor(&self, name: &str) -> Result<Option<Tensor>> {
        self.attr(name)
            .and_then(|a| a.t.as_ref())
            .map(|t| decode_tensor(t, None, &format!("attribute '{name}'")))
            .transpose()
    }

    /// A known tensor as a new node (constant, or param when large).
    pub fn constant(&mut self, t: &Tensor) -> Result<NodeId> {
        self.g.constant(t.data.clone(), &t.dims)
    }
}

fn materialize(g: &Graph, sink: &mut Sink, name: &str, t: &Tensor) -> Result<NodeId> {
    let big_float = t.data.dtype().is_float() && t.len() > PARAM_THRESHOLD;
    if sink.folding || !big_float {
        return g.constant(t.data.clone(), &t.dims);
    }
    let mut pname = if name.is_empty() {
        "param".to_string()
    } else {
        name.to_string()
    };
    if sink.param_names.contains(&pname) {
        let base = pname.clone();
        let mut k = 1;
        while sink.param_names.contains(&pname) {
            pname = format!("{base}.{k}");
            k += 1;
        }
    }
    sink.param_names.insert(pname.clone());
    sink.params.push((pname.clone(), t.data.clone()));
    g.param(pname, Shape::new(&t.dims, t.data.dtype()))
}

/// Ops never folded at import (their result is not a function of their inputs).
const NO_FOLD: &[&str] = &[
    "RandomNormal",
    "RandomUniform",
    "RandomNormalLike",
    "RandomUniformLike",
    "Bernoulli",
    "Multinomial",
];

/// The importer's state for one import.
pub(crate) struct Importer<'m> {
    model: &'m OnnxModel,
    options: &'m ImportOptions,
    graph: Graph,
    opset: i64,
    scopes: Vec<HashMap<String, Slot>>,
    params: Vec<(String, TensorData)>,
    param_names: HashSet<String>,
    inputs: Vec<(String, Shape)>,
    /// Given values of graph inputs, by their node.
    hints: HashMap<NodeId, Rc<Tensor>>,
    specialized: BTreeSet<String>,
    derived: HashMap<(usize, &'static str), NodeId>,
}

impl<'m> Importer<'m> {
    pub(crate) fn new(model: &'m OnnxModel, options: &'m ImportOptions) -> Result<Importer<'m>> {
        let opset = model.opset();
        let name = model.graph().name.clone().unwrap_or_else(|| "onnx".into());
        Ok(Importer {
            model,
            options,
            graph: Graph::new(name),
            opset,
            scopes: vec![HashMap::new()],
            params: Vec::new(),
            param_names: HashSet::new(),
            inputs: Vec::new(),
            hints: HashMap::new(),
            specialized: BTreeSet::new(),
            derived: HashMap::new(),
        })
    }

    pub(crate) fn run(mut self) -> Result<ImportedGraph> {
        let model = self.model;
        let gp = model.graph();
        self.add_initializers(gp)?;
        self.add_inputs(gp)?;
        self.check_unused_bindings()?;
        self.import_nodes(gp)?;
        let mut outputs = Vec::new();
        let mut names = Vec::new();
        for out in &gp.output {
            let name = out.name.clone().unwrap_or_default();
            let items = self.lookup(&name).and_then(|s| s.items.clone());
            if let Some(items) = items {
                // A sequence output is returned as one output per element.
                for (i, item) in items.iter().enumerate() {
                    let item_name = crate::model::sequence_item_name(&name, i);
                    outputs.push(self.node_of(&item_name, item)?);
                    names.push(item_name);
                }
                continue;
            }
            let id = self.output_node(&name)?;
            check_declared(&self.graph, id, &value_info(out), "output")?;
            outputs.push(id);
            names.push(name);
        }
        self.graph.set_outputs(outputs);
        let (graph, params) =
            crate::weight_views::fold_weight_views(self.graph, self.params, FOLD_LIMIT)?;
        graph.verify()?;
        Ok(ImportedGraph {
            graph,
            params,
            inputs: self.inputs,
            outputs: names,
            specialized: self.specialized.into_iter().collect(),
        })
    }

    fn lookup(&self, name: &str) -> Option<&Slot> {
        self.scopes.iter().rev().find_map(|s| s.get(name))
    }

    fn define(&mut self, name: &str, slot: Slot) {
        if let Some(scope) = self.scopes.last_mut() {
            scope.insert(name.to_string(), slot);
        }
    }

    fn add_initializers(&mut self, gp: &GraphProto) -> Result<()> {
        for t in &gp.initializer {
            let name = t.name.clone().unwrap_or_default();
            let tensor = decode_tensor(
                t,
                self.model.base_dir.as_deref(),
                &format!("initializer '{name}'"),
            )?;
            let shape = Shape::new(&tensor.dims, tensor.data.dtype());
            self.define(
                &name,
                Slot {
                    shape,
                    known: Some(Rc::new(tensor)),
                    node: None,
                    items: None,
                },
            );
        }
        if !gp.sparse_initializer.is_empty() {
            return Err(unsupported("sparse initializers"));
        }
        Ok(())
    }

    fn add_inputs(&mut self, gp: &GraphProto) -> Result<()> {
        let init: HashSet<&str> = gp
            .initializer
            .iter()
            .filter_map(|t| t.name.as_deref())
            .collect();
        let mut seen = HashSet::new();
        for v in &gp.input {
            let info = value_info(v);
            if init.contains(info.name.as_str()) {
                continue;
            }
            if !seen.insert(info.name.clone()) {
                return Err(Error::DuplicateName {
                    kind: "input",
                    name: info.name,
                });
            }
            if let Some(dtype) = info.sequence_of {
                let items = self.add_sequence_input(&info.name, dtype, &mut seen)?;
                self.define(&info.name, Slot::sequence(items));
                continue;
            }
            let dtype = info.dtype.ok_or_else(|| {
                unsupported(format!("input '{}' of type {}", info.name, info.type_name))
            })?;
            let dims = self.input_dims(&info)?;
            let shape = Shape::new(&dims, dtype);
            crate::tensor::checked_dims(
                &dims.iter().map(|&d| d as i64).collect::<Vec<_>>(),
                dtype,
                &format!("input '{}'", info.name),
            )?;
            let id = self.graph.input(info.name.clone(), shape.clone())?;
            if let Some(v) = self.options.input_values.get(&info.name) {
                if v.data.dtype() != dtype {
                    return Err(Error::dtype(
                        format!("input '{}'", info.name),
                        dtype.name(),
                        v.data.dtype(),
                    ));
                }
                self.hints.insert(id, v.clone());
            }
            self.inputs.push((info.name.clone(), shape.clone()));
            self.define(
                &info.name,
                Slot {
                    shape,
                    known: None,
                    node: Some(id),
                    items: None,
                },
            );
        }
        for name in self.options.input_dims.keys() {
            if !seen.contains(name) {
                return Err(Error::UnknownName {
                    kind: "input",
                    name: name.clone(),
                    known: seen.iter().cloned().collect(),
                });
            }
        }
        Ok(())
    }

    /// The elements of the sequence input `name`: one graph input per element given
    /// as `name[0]`, `name[1]`, ... (none given: the empty sequence).
    fn add_sequence_input(
        &mut self,
        name: &str,
        dtype: DType,
        seen: &mut HashSet<String>,
    ) -> Result<Vec<Slot>> {
        let mut items = Vec::new();
        loop {
            let item = crate::model::sequence_item_name(name, items.len());
            let Some(dims) = self.options.input_dims.get(&item).cloned() else {
                break;
            };
            crate::tensor::checked_dims(
                &dims.iter().map(|&d| d as i64).collect::<Vec<_>>(),
                dtype,
                &format!("input '{item}'"),
            )?;
            let shape = Shape::new(&dims, dtype);
            let id = self.graph.input(item.clone(), shape.clone())?;
            if let Some(v) = self.options.input_values.get(&item) {
                if v.data.dtype() != dtype {
                    return Err(Error::dtype(
                        format!("input '{item}'"),
                        dtype.name(),
                        v.data.dtype(),
                    ));
                }
                self.hints.insert(id, v.clone());
            }
            self.inputs.push((item.clone(), shape.clone()));
            seen.insert(item);
            items.push(Slot {
                shape,
                known: None,
                node: Some(id),
                items: None,
            });
        }
        Ok(items)
    }

    fn input_dims(&self, info: &ValueInfo) -> Result<Vec<usize>> {
        let declared = info.dims.clone();
        if let Some(given) = self.options.input_dims.get(&info.name) {
            if let Some(declared) = &declared {
                let fits = declared.len() == given.len()
                    && declared.iter().zip(given).all(|(d, &g)| match d {
                        Dim::Fixed(n) => *n == g,
                        Dim::Symbol(s) => self.options.symbols.get(s).is_none_or(|&b| b == g),
                        Dim::Unknown => true,
                    });
                if !fits {
                    let shown: Vec<String> = declared.iter().map(Dim::to_string).collect();
                    return Err(Error::invalid(
                        format!("input '{}'", info.name),
                        format!(
                            "given dims {given:?} do not fit the declared [{}]",
                            shown.join(", ")
                        ),
                    ));
                }
            }
            return Ok(given.clone());
        }
        let declared = declared.ok_or_else(|| {
            Error::invalid(
                format!("input '{}'", info.name),
                "the model declares no shape for it: give its data (and so its dims)",
            )
        })?;
        declared
            .iter()
            .enumerate()
            .map(|(axis, d)| match d {
                Dim::Fixed(n) => Ok(*n),
                Dim::Symbol(s) => self.options.symbols.get(s).copied().ok_or_else(|| {
                    Error::invalid(
                        format!("input '{}'", info.name),
                        format!("dim {axis} is the symbol '{s}', which is not bound (bind it with {s}=N)"),
                    )
                }),
                Dim::Unknown => Err(Error::invalid(
                    format!("input '{}'", info.name),
                    format!("dim {axis} has no size or name: give the input's data to fix it"),
                )),
            })
            .collect()
    }

    fn check_unused_bindings(&self) -> Result<()> {
        let used = self.model.symbols();
        for (name, &size) in &self.options.symbols {
            if size == 0 {
                return Err(Error::invalid(
                    format!("symbol '{name}'"),
                    "bound to 0; a symbolic dim must be at least 1",
                ));
            }
            if !used.contains(name) {
                return Err(Error::UnknownName {
                    kind: "symbol",
                    name: name.clone(),
                    known: used.clone(),
                });
            }
        }
        Ok(())
    }

    fn import_nodes(&mut self, gp: &GraphProto) -> Result<()> {
        for i in topological_order(&gp.node)? {
            let node = &gp.node[i];
            self.import_node(node)
                .map_err(|e| node_error(node, self.opset, e))?;
        }
        Ok(())
    }

    fn import_node(&mut self, node: &NodeProto) -> Result<()> {
        let domain = node.domain.as_deref().unwrap_or("");
        let op_type = node.op_type.as_deref().unwrap_or("");
        let preview = domain == "ai.onnx.preview" && op_type == "FlexAttention";
        if !(domain.is_empty() || domain == "ai.onnx" || preview) {
            return Err(unsupported(format!("domain '{domain}'")));
        }
        if self.opset == 0 {
            return Err(Error::Format {
                path: self.model.path.clone(),
                message: "the model imports no version of the default (ai.onnx) opset".into(),
            });
        }
        let outputs = match op_type {
            "If" | "Loop" | "Scan" | "FlexAttention" => crate::control::import(self, node)?,
            _ if crate::sequence::handles(self, node) => crate::sequence::import(self, node)?,
            _ => {
                let conv = ops::converter(op_type)
                    .ok_or_else(|| unsupported(format!("operator {op_type}")))?;
                self.convert(node, conv)?
            }
        };
        self.bind_outputs(node, outputs)
    }

    pub(crate) fn bind_outputs(&mut self, node: &NodeProto, outputs: Vec<Slot>) -> Result<()> {
        for (i, name) in node.output.iter().enumerate() {
            if name.is_empty() {
                continue;
            }
            let slot = outputs.get(i).cloned().ok_or_else(|| {
                unsupported(format!(
                    "output {i} ('{name}') is not produced by this importer"
                ))
            })?;
            self.define(name, slot);
        }
        Ok(())
    }

    fn operands(&self, node: &NodeProto) -> Result<Vec<Option<Operand>>> {
        node.input
            .iter()
            .map(|name| {
                if name.is_empty() {
                    return Ok(None);
                }
                let slot = self.lookup(name).cloned().ok_or_else(|| {
                    Error::invalid(
                        "input",
                        format!(
                            "'{name}' is not a graph input, an initializer or the output of any node"
                        ),
                    )
                })?;
                let hint = match (&slot.known, slot.node) {
                    (None, Some(id)) => self.hints.get(&id).cloned(),
                    _ => None,
                };
                Ok(Some(Operand {
                    name: name.clone(),
                    slot,
                    hint,
                }))
            })
            .collect()
    }

    /// Converts a node: folded if every operand is known, else into the graph.
    pub(crate) fn convert(&mut self, node: &NodeProto, conv: Converter) -> Result<Vec<Slot>> {
        let operands = self.operands(node)?;
        let op_type = node.op_type.as_deref().unwrap_or("");
        if let Some(o) = operands.iter().flatten().find(|o| o.slot.items.is_some()) {
            return Err(unsupported(format!(
                "'{}', a sequence, as an operand of {op_type}",
                o.name
            )));
        }
        let all_known = operands.iter().flatten().all(|o| o.slot.known.is_some());
        let known_elems: usize = operands
            .iter()
            .flatten()
            .map(|o| o.slot.shape.num_elements())
            .sum();
        if all_known
            && known_elems <= FOLD_LIMIT
            && !NO_FOLD.contains(&op_type)
            && let Some(slots) = self.fold(node, conv, operands.clone())?
        {
            return Ok(slots);
        }
        let mut cx = Cx {
            g: &self.graph,
            node,
            opset: self.opset,
            operands,
            sink: Sink {
                params: &mut self.params,
                param_names: &mut self.param_names,
                specialized: &mut self.specialized,
                derived: &mut self.derived,
                folding: false,
                hints: Some(&self.hints),
            },
        };
        let ids = conv(&mut cx)?;
        // Keep the nodes made for known operands, so later readers reuse them.
        let made: Vec<(String, NodeId)> = cx
            .operands
            .iter()
            .flatten()
            .filter(|o| o.slot.known.is_some())
            .filter_map(|o| o.slot.node.map(|id| (o.name.clone(), id)))
            .collect();
        for (name, id) in made {
            for scope in self.scopes.iter_mut().rev() {
                if let Some(slot) = scope.get_mut(&name) {
                    slot.node.get_or_insert(id);
                    break;
                }
            }
        }
        ids.into_iter().map(|id| self.slot_for(id)).collect()
    }

    /// The slot of a node just built; a constant node's value is known.
    pub(crate) fn slot_for(&self, id: NodeId) -> Result<Slot> {
        let node = self.graph.node(id)?;
        let known = match node.op {
            rlx_ir::Op::Constant { id: c } => self.graph.constants().get(c).map(|data| {
                Rc::new(Tensor {
                    dims: node.shape.dims().to_vec(),
                    data: data.clone(),
                })
            }),
            _ => None,
        };
        Ok(Slot {
            shape: node.shape,
            known,
            node: Some(id),
            items: None,
        })
    }

    fn fold(
        &mut self,
        node: &NodeProto,
        conv: Converter,
        mut operands: Vec<Option<Operand>>,
    ) -> Result<Option<Vec<Slot>>> {
        // Nodes made in the real graph for these values do not exist in the scratch one.
        for op in operands.iter_mut().flatten() {
            op.slot.node = None;
        }
        let scratch = Graph::new("fold");
        let mut params = Vec::new();
        let mut names = HashSet::new();
        let mut derived = HashMap::new();
        let mut cx = Cx {
            g: &scratch,
            node,
            opset: self.opset,
            operands,
            sink: Sink {
                params: &mut params,
                param_names: &mut names,
                specialized: &mut self.specialized,
                derived: &mut derived,
                folding: true,
                hints: None,
            },
        };
        let ids = conv(&mut cx)?;
        // Small inputs can make a large value (ConstantOfShape, Expand, Tile, ...):
        // such a node goes into the graph instead of being computed at import.
        if scratch
            .nodes()
            .iter()
            .any(|n| n.shape.num_elements() > FOLD_LIMIT)
        {
            return Ok(None);
        }
        scratch.set_outputs(ids);
        let values = evaluate(&scratch, &mut HashMap::new())?;
        Ok(Some(values.into_iter().map(known_slot).collect()))
    }

    fn output_node(&mut self, name: &str) -> Result<NodeId> {
        let slot = self
            .lookup(name)
            .cloned()
            .ok_or_else(|| Error::invalid("graph output", format!("'{name}' is never computed")))?;
        if let Some(id) = slot.node {
            return Ok(id);
        }
        let known = slot
            .known
            .ok_or_else(|| Error::invalid("graph output", format!("'{name}' has no value")))?;
        self.graph.constant(known.data.clone(), &known.dims)
    }

    /// The opset, the model, the graph being built: for the control-flow importer.
    pub(crate) fn opset(&self) -> i64 {
        self.opset
    }

    pub(crate) fn graph(&self) -> &Graph {
        &self.graph
    }

    pub(crate) fn slot(&self, name: &str) -> Option<Slot> {
        self.lookup(name).cloned()
    }

    /// A slot's value known at import, or the given value of the input it is (which
    /// specializes the import on that input).
    pub(crate) fn value_of(&mut self, name: &str, slot: &Slot) -> Option<Rc<Tensor>> {
        if let Some(k) = &slot.known {
            return Some(k.clone());
        }
        let hint = self.hints.get(&slot.node?)?.clone();
        self.specialized.insert(name.to_string());
        Some(hint)
    }

    /// A slot's value computed from the values given for the graph inputs it reads
    /// (see [`derived_hint`]), specializing the import on those inputs.
    pub(crate) fn derived_value(&mut self, slot: &Slot) -> Option<Rc<Tensor>> {
        let (value, inputs) = derived_hint(&self.graph, &self.hints, slot.node?)?;
        self.specialized.extend(inputs);
        Some(value)
    }

    /// Materializes a slot as a node of the graph.
    pub(crate) fn node_of(&mut self, name: &str, slot: &Slot) -> Result<NodeId> {
        if slot.items.is_some() {
            return Err(unsupported(format!(
                "'{name}', a sequence, where a tensor is expected"
            )));
        }
        if let Some(id) = slot.node {
            return Ok(id);
        }
        let known = slot
            .known
            .clone()
            .ok_or_else(|| Error::invalid("value", format!("'{name}' has no value")))?;
        let mut sink = Sink {
            params: &mut self.params,
            param_names: &mut self.param_names,
            specialized: &mut self.specialized,
            derived: &mut self.derived,
            folding: false,
            hints: None,
        };
        materialize(&self.graph, &mut sink, name, &known)
    }

    /// Runs `body` with a fresh innermost scope holding `bindings`.
    pub(crate) fn with_scope<T>(
        &mut self,
        bindings: Vec<(String, Slot)>,
        body: impl FnOnce(&mut Self) -> Result<T>,
    ) -> Result<T> {
        self.scopes.push(bindings.into_iter().collect());
        let out = body(self);
        self.scopes.pop();
        out
    }

    /// Imports a subgraph's nodes into the current scope and returns its outputs.
    pub(crate) fn import_subgraph(&mut self, gp: &GraphProto) -> Result<Vec<Slot>> {
        for t in &gp.initializer {
            let name = t.name.clone().unwrap_or_default();
            let tensor = decode_tensor(
                t,
                self.model.base_dir.as_deref(),
                &format!("initializer '{name}'"),
            )?;
            let shape = Shape::new(&tensor.dims, tensor.data.dtype());
            self.define(&name, known_slot_from(shape, tensor));
        }
        self.import_nodes(gp)?;
        gp.output
            .iter()
            .map(|o| {
                let name = o.name.clone().unwrap_or_default();
                self.lookup(&name).cloned().ok_or_else(|| {
                    Error::invalid("subgraph output", format!("'{name}' is never computed"))
                })
            })
            .collect()
    }
}

fn known_slot_from(shape: Shape, t: Tensor) -> Slot {
    Slot {
        shape,
        known: Some(Rc::new(t)),
        node: None,
        items: None,
    }
}

/// A slot for a value computed at import.
pub(crate) fn known_slot(v: HostTensor) -> Slot {
    let data = v.to_data();
    let dims = v.shape.dims().to_vec();
    known_slot_from(v.shape, Tensor { dims, data })
}

/// Checks a graph output's inferred shape against the model's declaration.
fn check_declared(g: &Graph, id: NodeId, info: &ValueInfo, kind: &str) -> Result<()> {
    let shape = g.shape(id)?;
    if let Some(dtype) = info.dtype
        && dtype != shape.dtype()
    {
        return Err(Error::invalid(
            format!("{kind} '{}'", info.name),
            format!("declared as {} but computes {}", info.type_name, shape),
        ));
    }
    if let Some(dims) = &info.dims {
        let fits = dims.len() == shape.rank()
            && dims
                .iter()
                .zip(shape.dims())
                .all(|(d, &n)| !matches!(d, Dim::Fixed(m) if *m != n));
        if !fits {
            let shown: Vec<String> = dims.iter().map(Dim::to_string).collect();
            return Err(Error::invalid(
                format!("{kind} '{}'", info.name),
                format!(
                    "declared with dims [{}] but computes {}",
                    shown.join(", "),
                    shape
                ),
            ));
        }
    }
    Ok(())
}

/// Adds the node's identity to an error.
/// The names a node reads: its inputs, and those its subgraphs read (a superset of
/// the outer names they capture).
fn names_read(node: &NodeProto, out: &mut Vec<String>) {
    out.extend(node.input.iter().filter(|n| !n.is_empty()).cloned());
    for a in &node.attribute {
        for g in a.g.iter().chain(&a.graphs) {
            for n in &g.node {
                names_read(n, out);
            }
        }
    }
}

/// The nodes in an order where each comes after the nodes it reads from, keeping the
/// file's order where it already is one. A cycle is an error naming its nodes.
pub(crate) fn topological_order(nodes: &[NodeProto]) -> Result<Vec<usize>> {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let mut producer: HashMap<&str, usize> = HashMap::new();
    for (i, n) in nodes.iter().enumerate() {
        for o in n.output.iter().filter(|o| !o.is_empty()) {
            producer.entry(o.as_str()).or_insert(i);
        }
    }
    let mut waiting = vec![0usize; nodes.len()];
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); nodes.len()];
    for (i, n) in nodes.iter().enumerate() {
        let mut read = Vec::new();
        names_read(n, &mut read);
        let mut deps: Vec<usize> = read
            .iter()
            .filter_map(|name| producer.get(name.as_str()).copied())
            .collect();
        deps.sort_unstable();
        deps.dedup();
        waiting[i] = deps.len();
        for d in deps {
            readers[d].push(i);
        }
    }
    let mut ready: BinaryHeap<Reverse<usize>> = (0..nodes.len())
        .filter(|&i| waiting[i] == 0)
        .map(Reverse)
        .collect();
    let mut order = Vec::with_capacity(nodes.len());
    while let Some(Reverse(i)) = ready.pop() {
        order.push(i);
        for &r in &readers[i] {
            waiting[r] -= 1;
            if waiting[r] == 0 {
                ready.push(Reverse(r));
            }
        }
    }
    if order.len() < nodes.len() {
        let stuck: Vec<String> = (0..nodes.len())
            .filter(|&i| waiting[i] > 0)
            .take(8)
            .map(|i| {
                let n = &nodes[i];
                format!(
                    "'{}' ({} -> {})",
                    n.name.as_deref().unwrap_or(""),
                    n.op_type.as_deref().unwrap_or(""),
                    n.output.join(", ")
                )
            })
            .collect();
        return Err(Error::invalid(
            "graph",
            format!(
                "it has a cycle: these nodes wait on each other: {}",
                stuck.join(", ")
            ),
        ));
    }
    Ok(order)
}

pub(crate) fn node_error(node: &NodeProto, opset: i64, e: Error) -> Error {
    let op_type = node.op_type.as_deref().unwrap_or("");
    let domain = node.domain.as_deref().unwrap_or("");
    let name = match node.name.as_deref() {
        Some(n) if !n.is_empty() => n.to_string(),
        _ => node.output.first().cloned().unwrap_or_default(),
    };
    let context = format!("node '{name}' ({op_type}, domain '{domain}', opset {opset})");
    match e {
        // Already wrapped by an inner (subgraph) node.
        Error::Unsupported { what, .. } if what.starts_with("node '") => unsupported(what),
        Error::Unsupported { what, .. } => unsupported(format!("{context}: {what}")),
        Error::InvalidGraph { message, .. } if message.starts_with("node '") => {
            Error::InvalidGraph {
                graph: "onnx".into(),
                node: "-".into(),
                message,
            }
        }
        other => Error::InvalidGraph {
            graph: "onnx".into(),
            node: "-".into(),
            message: format!("{context}: {other}"),
        },
    }
}
