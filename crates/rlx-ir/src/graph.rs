//! The graph: nodes in creation order (always topological), outputs, constants.
//!
//! Builder methods take `&self` (the node list sits behind a lock) so that calls nest:
//! `g.gelu(g.add(h, b)?)?`, and a finished graph can be shared between threads.

use crate::{Error, Op, Result, Shape, TensorData};
use std::sync::{RwLock, RwLockReadGuard, RwLockWriteGuard};

/// Identifies a node of one graph (its index in creation order).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct NodeId(pub(crate) u32);

impl NodeId {
    /// The node's index in the graph.
    pub fn index(self) -> usize {
        self.0 as usize
    }

    /// The id of the node at `index` (not checked against any graph).
    pub fn from_index(index: usize) -> NodeId {
        NodeId(index as u32)
    }
}

impl std::fmt::Display for NodeId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "%{}", self.0)
    }
}

/// One operation with its operands and inferred output shape.
#[derive(Clone, Debug, PartialEq)]
pub struct Node {
    /// What it computes.
    pub op: Op,
    /// Operands, all created before this node.
    pub inputs: Vec<NodeId>,
    /// Output dimensions and dtype.
    pub shape: Shape,
}

#[derive(Clone, Debug, Default, PartialEq)]
struct GraphBody {
    nodes: Vec<Node>,
    outputs: Vec<NodeId>,
    constants: Vec<TensorData>,
}

/// A computation graph under construction or ready to compile.
#[derive(Debug)]
pub struct Graph {
    name: String,
    body: RwLock<GraphBody>,
}

impl Clone for Graph {
    fn clone(&self) -> Self {
        Graph {
            name: self.name.clone(),
            body: RwLock::new(self.body().clone()),
        }
    }
}

impl PartialEq for Graph {
    fn eq(&self, other: &Self) -> bool {
        std::ptr::eq(self, other) || (self.name == other.name && *self.body() == *other.body())
    }
}

/// Read access to a graph's nodes (holds the graph's lock while alive).
pub struct NodesRef<'a>(RwLockReadGuard<'a, GraphBody>);

impl std::ops::Deref for NodesRef<'_> {
    type Target = [Node];
    fn deref(&self) -> &[Node] {
        &self.0.nodes
    }
}

/// Read access to a graph's constant table (holds the graph's lock while alive).
pub struct ConstantsRef<'a>(RwLockReadGuard<'a, GraphBody>);

impl std::ops::Deref for ConstantsRef<'_> {
    type Target = [TensorData];
    fn deref(&self) -> &[TensorData] {
        &self.0.constants
    }
}

impl Graph {
    /// An empty graph.
    pub fn new(name: impl Into<String>) -> Graph {
        Graph {
            name: name.into(),
            body: RwLock::new(GraphBody::default()),
        }
    }

    /// The graph's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Declares a run-time input. Names must be unique among inputs and params
    /// (checked by [`Graph::verify`]).
    ///
    /// # Errors
    /// [`Error::SizeOverflow`] when the shape needs more than `isize::MAX` bytes
    /// ([`Shape::check_size`]), [`Error::InvalidArgument`] when its rank exceeds
    /// [`crate::MAX_RANK`]. Nothing is added to the graph then.
    pub fn input(&self, name: impl Into<String>, shape: Shape) -> Result<NodeId> {
        let name = name.into();
        check_source("input", &name, &shape)?;
        Ok(self.push_unchecked(Op::Input { name }, vec![], shape))
    }

    /// Declares a weight, set on the compiled graph with `set_param`.
    ///
    /// # Errors
    /// As for [`Graph::input`]; nothing is added to the graph on an error.
    pub fn param(&self, name: impl Into<String>, shape: Shape) -> Result<NodeId> {
        let name = name.into();
        check_source("param", &name, &shape)?;
        Ok(self.push_unchecked(Op::Param { name }, vec![], shape))
    }

    /// A constant tensor; `data.len()` must equal the product of `dims`.
    pub fn constant(&self, data: TensorData, dims: &[usize]) -> Result<NodeId> {
        let shape = Shape::new(dims, data.dtype());
        shape.check_size("constant")?;
        if data.len() != shape.num_elements() {
            return Err(Error::LengthMismatch {
                kind: "input",
                name: "constant data".into(),
                expected: shape.num_elements(),
                got: data.len(),
                unit: "elements",
            });
        }
        check_rank("constant", &shape)?;
        let id = {
            let mut body = self.body_mut();
            body.constants.push(data);
            body.constants.len() - 1
        };
        Ok(self.push_unchecked(Op::Constant { id }, vec![], shape))
    }

    /// An `f32` constant.
    pub fn constant_f32(&self, data: &[f32], dims: &[usize]) -> Result<NodeId> {
        self.constant(TensorData::F32(data.to_vec()), dims)
    }

    /// A rank-0 constant of `dtype` holding `value` (rounded to the dtype).
    pub fn scalar(&self, value: f64, dtype: crate::DType) -> NodeId {
        let data = TensorData::from_f64(dtype, &[value]);
        let id = {
            let mut body = self.body_mut();
            body.constants.push(data);
            body.constants.len() - 1
        };
        self.push_unchecked(Op::Constant { id }, vec![], Shape::scalar(dtype))
    }

    /// Sets the values the compiled graph returns, in order.
    pub fn set_outputs(&self, outputs: Vec<NodeId>) {
        self.body_mut().outputs = outputs;
    }

    /// The declared outputs.
    pub fn outputs(&self) -> Vec<NodeId> {
        self.body().outputs.clone()
    }

    // A panic while holding the lock cannot leave the graph half-written (every
    // mutation is a single push or assignment), so a poisoned lock is still usable.
    fn body(&self) -> RwLockReadGuard<'_, GraphBody> {
        self.body.read().unwrap_or_else(|e| e.into_inner())
    }

    fn body_mut(&self) -> RwLockWriteGuard<'_, GraphBody> {
        self.body.write().unwrap_or_else(|e| e.into_inner())
    }

    /// All nodes, in creation (topological) order. Do not call builder methods while
    /// holding the returned guard.
    pub fn nodes(&self) -> NodesRef<'_> {
        NodesRef(self.body())
    }

    /// Number of nodes.
    pub fn len(&self) -> usize {
        self.body().nodes.len()
    }

    /// True when the graph has no nodes.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// A copy of node `id`, or an error if it is not in this graph.
    pub fn node(&self, id: NodeId) -> Result<Node> {
        let body = self.body();
        body.nodes
            .get(id.index())
            .cloned()
            .ok_or_else(|| self.unknown_node(id, body.nodes.len()))
    }

    /// The output shape of node `id`.
    pub fn shape(&self, id: NodeId) -> Result<Shape> {
        Ok(self.node(id)?.shape)
    }

    /// The constant table.
    pub fn constants(&self) -> ConstantsRef<'_> {
        ConstantsRef(self.body())
    }

    /// Appends a node after checking its operands exist and inferring its shape.
    /// Every builder method goes through here.
    pub fn push(&self, op: Op, inputs: &[NodeId]) -> Result<NodeId> {
        let shapes = self.input_shapes(inputs)?;
        let refs: Vec<&Shape> = shapes.iter().collect();
        let shape = crate::infer::infer_shape(&op, &refs)?;
        check_rank(&op.name(), &shape)?;
        shape.check_size(&op.name())?;
        Ok(self.push_unchecked(op, inputs.to_vec(), shape))
    }

    /// Appends a constant-table entry and returns its id (for passes that fold values).
    pub fn add_constant_data(&self, data: TensorData) -> usize {
        let mut body = self.body_mut();
        body.constants.push(data);
        body.constants.len() - 1
    }

    pub(crate) fn input_shapes(&self, inputs: &[NodeId]) -> Result<Vec<Shape>> {
        let body = self.body();
        inputs
            .iter()
            .map(|&id| {
                body.nodes
                    .get(id.index())
                    .map(|n| n.shape.clone())
                    .ok_or_else(|| self.unknown_node(id, body.nodes.len()))
            })
            .collect()
    }

    fn push_unchecked(&self, op: Op, inputs: Vec<NodeId>, shape: Shape) -> NodeId {
        let mut body = self.body_mut();
        body.nodes.push(Node { op, inputs, shape });
        NodeId((body.nodes.len() - 1) as u32)
    }

    fn unknown_node(&self, id: NodeId, count: usize) -> Error {
        Error::InvalidGraph {
            graph: self.name.clone(),
            node: id.to_string(),
            message: format!(
                "no such node (the graph has {} nodes; was the id made by another graph?)",
                count
            ),
        }
    }

    /// Builds a graph from parts (used by passes that rewrite graphs).
    pub fn from_parts(
        name: impl Into<String>,
        nodes: Vec<Node>,
        outputs: Vec<NodeId>,
        constants: Vec<TensorData>,
    ) -> Graph {
        Graph {
            name: name.into(),
            body: RwLock::new(GraphBody {
                nodes,
                outputs,
                constants,
            }),
        }
    }

    /// Names and shapes of the inputs, in creation order.
    pub fn inputs(&self) -> Vec<(String, NodeId, Shape)> {
        self.sources(|op| match op {
            Op::Input { name } => Some(name.clone()),
            _ => None,
        })
    }

    /// Names and shapes of the params, in creation order.
    pub fn params(&self) -> Vec<(String, NodeId, Shape)> {
        self.sources(|op| match op {
            Op::Param { name } => Some(name.clone()),
            _ => None,
        })
    }

    fn sources(&self, pick: impl Fn(&Op) -> Option<String>) -> Vec<(String, NodeId, Shape)> {
        self.nodes()
            .iter()
            .enumerate()
            .filter_map(|(i, n)| pick(&n.op).map(|name| (name, NodeId(i as u32), n.shape.clone())))
            .collect()
    }
}

fn check_source(kind: &str, name: &str, shape: &Shape) -> Result<()> {
    let context = format!("{kind} '{name}'");
    check_rank(&context, shape)?;
    shape.check_size(&context)
}

pub(crate) fn check_rank(op: &str, shape: &Shape) -> Result<()> {
    if shape.rank() > crate::MAX_RANK {
        return Err(Error::invalid(
            op,
            format!(
                "rank {} exceeds the maximum rank {}",
                shape.rank(),
                crate::MAX_RANK
            ),
        ));
    }
    Ok(())
}
