//! Dead-code elimination.

use rlx_ir::{Graph, Node, NodeId, Op};

/// Removes nodes that no output depends on. Inputs and params stay (so that a graph's
/// run-time interface does not change), and so do `write_at` nodes, whose effect is on
/// persistent state. Returns the new graph and, for each old node, its new id.
pub fn eliminate_dead_code(graph: &Graph) -> (Graph, Vec<Option<NodeId>>) {
    let nodes = graph.nodes();
    let mut live = vec![false; nodes.len()];
    let mut stack: Vec<usize> = graph.outputs().iter().map(|id| id.index()).collect();
    for (i, n) in nodes.iter().enumerate() {
        if matches!(
            n.op,
            Op::Input { .. } | Op::Param { .. } | Op::WriteAt { .. }
        ) {
            stack.push(i);
        }
    }
    while let Some(i) = stack.pop() {
        if i < live.len() && !std::mem::replace(&mut live[i], true) {
            stack.extend(nodes[i].inputs.iter().map(|id| id.index()));
        }
    }
    let mut remap = vec![None; nodes.len()];
    let mut kept: Vec<Node> = Vec::new();
    for (i, n) in nodes.iter().enumerate() {
        if live[i] {
            let mut n = n.clone();
            n.inputs = n
                .inputs
                .iter()
                .map(|id| remap[id.index()].unwrap_or(*id))
                .collect();
            remap[i] = Some(NodeId::from_index(kept.len()));
            kept.push(n);
        }
    }
    let outputs = graph
        .outputs()
        .iter()
        .map(|id| remap.get(id.index()).copied().flatten().unwrap_or(*id))
        .collect();
    let out = Graph::from_parts(graph.name(), kept, outputs, graph.constants().to_vec());
    (out, remap)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlx_ir::{DType, Shape};

    #[test]
    fn removes_unused_branches_and_keeps_interface() {
        let g = Graph::new("dce");
        let x = g.input("x", Shape::new(&[4], DType::F32)).unwrap();
        let unused_in = g.input("unused", Shape::new(&[2], DType::F32)).unwrap();
        let dead = g.exp(x).unwrap();
        let _dead2 = g.neg(dead).unwrap();
        let y = g.relu(x).unwrap();
        g.set_outputs(vec![y]);
        let (d, remap) = eliminate_dead_code(&g);
        assert_eq!(d.len(), 3);
        assert!(remap[dead.index()].is_none());
        assert!(remap[unused_in.index()].is_some());
        d.verify().unwrap();
        assert_eq!(
            d.node(d.outputs()[0]).unwrap().op,
            Op::Unary(rlx_ir::UnaryOp::Relu)
        );
    }
}
