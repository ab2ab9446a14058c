//! A small tool for passes that rebuild a graph: nodes are copied in order, each
//! either kept (with its operands remapped), replaced by another node, or dropped
//! because a later fused node absorbed it.

use rlx_ir::{Graph, Node, NodeId};

/// Builds the rewritten node list.
pub(crate) struct Rewriter {
    nodes: Vec<Node>,
    remap: Vec<Option<NodeId>>,
}

impl Rewriter {
    /// A rewriter for a graph of `len` nodes.
    pub fn new(len: usize) -> Rewriter {
        Rewriter {
            nodes: Vec::with_capacity(len),
            remap: vec![None; len],
        }
    }

    /// The new id of old node `old` (which must already be placed).
    pub fn map(&self, old: NodeId) -> NodeId {
        self.remap[old.index()].unwrap_or(old)
    }

    /// Places `node` (operands given as old ids) as the new form of old node `old`.
    pub fn place(&mut self, old: usize, mut node: Node) {
        node.inputs = node.inputs.iter().map(|&id| self.map(id)).collect();
        self.remap[old] = Some(NodeId::from_index(self.nodes.len()));
        self.nodes.push(node);
    }

    /// Adds a node that has no old counterpart (operands given as old ids) and
    /// returns its new id.
    pub fn insert(&mut self, mut node: Node) -> NodeId {
        node.inputs = node.inputs.iter().map(|&id| self.map(id)).collect();
        self.nodes.push(node);
        NodeId::from_index(self.nodes.len() - 1)
    }

    /// Places `node`, whose operands are already new ids, as the new form of `old`.
    pub fn place_with_new_inputs(&mut self, old: usize, node: Node) {
        self.remap[old] = Some(NodeId::from_index(self.nodes.len()));
        self.nodes.push(node);
    }

    /// Makes old node `old` an alias of old node `target` (already placed; `target`
    /// is an old id, not a new one).
    pub fn alias(&mut self, old: usize, target: NodeId) {
        self.remap[old] = Some(self.map(target));
    }

    /// The finished graph, with outputs remapped.
    pub fn finish(self, original: &Graph, constants: Vec<rlx_ir::TensorData>) -> Graph {
        let outputs = original.outputs().iter().map(|&o| self.map(o)).collect();
        Graph::from_parts(original.name(), self.nodes, outputs, constants)
    }
}

/// For each node, how many times it is read (as an operand or as a graph output).
pub(crate) fn use_counts(graph: &Graph) -> Vec<usize> {
    let nodes = graph.nodes();
    let mut uses = vec![0usize; nodes.len()];
    for n in nodes.iter() {
        for id in &n.inputs {
            uses[id.index()] += 1;
        }
    }
    for o in graph.outputs() {
        uses[o.index()] += 1;
    }
    uses
}

/// For each node, the nodes that read it (each reader once per operand slot).
pub(crate) fn consumers(graph: &Graph) -> Vec<Vec<usize>> {
    let nodes = graph.nodes();
    let mut out = vec![Vec::new(); nodes.len()];
    for (i, n) in nodes.iter().enumerate() {
        for id in &n.inputs {
            out[id.index()].push(i);
        }
    }
    out
}
