//! Execution order: topological, in creation order where free, with the extra rule
//! that every other reader of a `write_at` target runs before the write.

use rlx_ir::{Error, Graph, Op, Result};
use std::cmp::Reverse;
use std::collections::BinaryHeap;

/// Orders all nodes of `graph` for execution. Fails if a node must read a handle both
/// before and after it is written, or if an output is a handle (or a view of one) that
/// is written.
pub fn schedule(graph: &Graph) -> Result<Vec<usize>> {
    let outputs = graph.outputs();
    let nodes = graph.nodes();
    let n = nodes.len();
    let mut succ: Vec<Vec<usize>> = vec![Vec::new(); n];
    let mut indegree = vec![0usize; n];
    let mut add_edge = |from: usize, to: usize, succ: &mut Vec<Vec<usize>>| {
        succ[from].push(to);
        indegree[to] += 1;
    };
    let mut consumers: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, node) in nodes.iter().enumerate() {
        for id in &node.inputs {
            add_edge(id.index(), i, &mut succ);
            consumers[id.index()].push(i);
        }
    }
    for (w, node) in nodes.iter().enumerate() {
        if let Op::WriteAt { .. } = node.op {
            // Readers of the target, and of views of it (which share its bytes and run
            // no kernel), all read the state from before the write.
            let mut reads = vec![node.inputs[0].index()];
            while let Some(t) = reads.pop() {
                // An output is read after the whole run, so it would show the new state.
                if outputs.iter().any(|o| o.index() == t) {
                    return Err(Error::InvalidGraph {
                        graph: graph.name().into(),
                        node: format!("%{t}"),
                        message: "an output is a handle (or a view of one) that a write_at overwrites in the same run; output the write_at result instead".into(),
                    });
                }
                for &c in &consumers[t] {
                    if c != w {
                        add_edge(c, w, &mut succ);
                        if crate::plan::view_offset(&nodes[c].op, &nodes[t].shape).is_some() {
                            reads.push(c);
                        }
                    }
                }
            }
        }
    }
    let mut ready: BinaryHeap<Reverse<usize>> =
        (0..n).filter(|&i| indegree[i] == 0).map(Reverse).collect();
    let mut order = Vec::with_capacity(n);
    while let Some(Reverse(i)) = ready.pop() {
        order.push(i);
        for &s in &succ[i] {
            indegree[s] -= 1;
            if indegree[s] == 0 {
                ready.push(Reverse(s));
            }
        }
    }
    if order.len() != n {
        let stuck = (0..n).find(|&i| indegree[i] > 0).unwrap_or(0);
        return Err(Error::InvalidGraph {
            graph: graph.name().into(),
            node: format!("%{stuck}"),
            message: "a handle is read both before and after a write_at to it; read the write_at result instead".into(),
        });
    }
    Ok(order)
}
