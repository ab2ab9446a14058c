//! Views of weights, computed once at import. Converters build nodes on the weights
//! they read as on any operand: a dilated convolution's weights sliced to its live
//! taps, a 3-D convolution's weights one depth tap at a time, a transposed
//! convolution's kernel flipped and its channel axes swapped. Left in the graph, each
//! run would copy those weights again (through the generic data-movement kernels) and
//! the convolutions would read operands the backend cannot pack ahead. The weights
//! are known at import, so once the graph is built, every reshape, permute, slice or
//! concat computed from params and constants alone becomes a param holding its value,
//! and the params nothing reads any more are dropped: the same bytes in memory, moved
//! once. (Gathers at constant positions count too: exporters flip a kernel that way.)

use rlx_ir::reference::{HostTensor, eval_node};
use rlx_ir::{Graph, Node, NodeId, Op, Result, TensorData};
use std::collections::{HashMap, HashSet};

/// Whether node `i` only moves values and makes no more of them than it reads (a
/// gather's positions are constants then, as it reads only views and constants).
fn moves_values(nodes: &[Node], i: usize) -> bool {
    let node = &nodes[i];
    match node.op {
        Op::Reshape { .. } | Op::Permute { .. } | Op::Slice { .. } | Op::Concat { .. } => true,
        Op::Gather { .. } => {
            node.shape.num_elements() <= nodes[node.inputs[0].index()].shape.num_elements()
        }
        _ => false,
    }
}

/// Which nodes are views of weights (data movement over params in `known` and
/// constants, reading at least one param, of at most `limit` elements), and which
/// params only views read.
fn weight_views(
    nodes: &[Node],
    known: &HashMap<&str, &TensorData>,
    limit: usize,
) -> (Vec<bool>, Vec<bool>) {
    let n = nodes.len();
    let mut readers: Vec<Vec<usize>> = vec![Vec::new(); n];
    for (i, node) in nodes.iter().enumerate() {
        for a in &node.inputs {
            readers[a.index()].push(i);
        }
    }
    let mut foldable: Vec<bool> = nodes
        .iter()
        .enumerate()
        .map(|(i, node)| {
            !readers[i].is_empty()
                && matches!(&node.op, Op::Param { name } if known.contains_key(name.as_str()))
        })
        .collect();
    loop {
        let mut view = vec![false; n];
        for (i, node) in nodes.iter().enumerate() {
            if !moves_values(nodes, i)
                || node.inputs.is_empty()
                || node.shape.num_elements() > limit
            {
                continue;
            }
            let fixed = node.inputs.iter().all(|a| {
                let a = a.index();
                view[a] || foldable[a] || matches!(nodes[a].op, Op::Constant { .. })
            });
            let reads_param = node
                .inputs
                .iter()
                .any(|a| foldable[a.index()] || view[a.index()]);
            view[i] = fixed && reads_param;
        }
        // A param that something other than a view reads stays a param; views of it
        // would be second copies, so they stay in the graph.
        let mut changed = false;
        for (i, f) in foldable.iter_mut().enumerate() {
            if *f && readers[i].iter().any(|&r| !view[r]) {
                *f = false;
                changed = true;
            }
        }
        if !changed {
            return (view, foldable);
        }
    }
}

/// Replaces the views of weights in `graph` (of at most `limit` elements) by params
/// holding their values, and drops the params that only views read. Returns the new
/// graph and params.
pub(crate) fn fold_weight_views(
    graph: Graph,
    params: Vec<(String, TensorData)>,
    limit: usize,
) -> Result<(Graph, Vec<(String, TensorData)>)> {
    let mut nodes: Vec<Node> = graph.nodes().to_vec();
    if nodes.iter().any(|n| matches!(n.op, Op::WriteAt { .. })) {
        // A graph that writes state may write a param its views were taken from.
        return Ok((graph, params));
    }
    let constants = graph.constants().to_vec();
    let outputs = graph.outputs();
    let known: HashMap<&str, &TensorData> = params.iter().map(|(n, d)| (n.as_str(), d)).collect();
    let (view, foldable) = weight_views(&nodes, &known, limit);
    if !view.iter().any(|&v| v) {
        return Ok((graph, params));
    }
    // The views that something else reads (or that are outputs) become params.
    let mut root = vec![false; nodes.len()];
    for (i, node) in nodes.iter().enumerate() {
        if !view[i] {
            for a in &node.inputs {
                root[a.index()] |= view[a.index()];
            }
        }
    }
    for o in &outputs {
        root[o.index()] |= view[o.index()];
    }
    let mut values: HashMap<usize, HostTensor> = HashMap::new();
    let mut names: HashSet<String> = params.iter().map(|(n, _)| n.clone()).collect();
    let mut made: Vec<(usize, String, TensorData)> = Vec::new();
    for i in 0..nodes.len() {
        if !view[i] {
            continue;
        }
        for a in &nodes[i].inputs {
            let a = a.index();
            if values.contains_key(&a) {
                continue;
            }
            let data = match &nodes[a].op {
                Op::Param { name } => known.get(name.as_str()).copied(),
                Op::Constant { id } => constants.get(*id),
                _ => None,
            };
            let data = data.ok_or_else(|| {
                rlx_ir::Error::runtime("weight views", "an operand of a view has no value")
            })?;
            values.insert(a, HostTensor::from_data(nodes[a].shape.dims(), data)?);
        }
        let args: Vec<&HostTensor> = nodes[i]
            .inputs
            .iter()
            .map(|a| &values[&a.index()])
            .collect();
        let value = eval_node(&nodes[i].op, &args, &nodes[i].shape, &constants)?;
        if root[i] {
            let base = first_param(&nodes, i).unwrap_or_else(|| "weight".to_string());
            let mut name = format!("{base}.view");
            let mut k = 1;
            while names.contains(&name) {
                name = format!("{base}.view{k}");
                k += 1;
            }
            names.insert(name.clone());
            made.push((i, name, value.to_data()));
        }
        values.insert(i, value);
    }
    drop(values);
    for (i, name, _) in &made {
        nodes[*i].op = Op::Param { name: name.clone() };
        nodes[*i].inputs.clear();
    }
    // Keep what the outputs read, the inputs (the run-time interface) and every param
    // but those only views read.
    let mut live = vec![false; nodes.len()];
    let mut stack: Vec<usize> = outputs.iter().map(|o| o.index()).collect();
    for (i, node) in nodes.iter().enumerate() {
        match node.op {
            Op::Input { .. } => stack.push(i),
            Op::Param { .. } if !foldable[i] => stack.push(i),
            _ => {}
        }
    }
    while let Some(i) = stack.pop() {
        if !std::mem::replace(&mut live[i], true) {
            stack.extend(nodes[i].inputs.iter().map(|a| a.index()));
        }
    }
    let mut remap = vec![None; nodes.len()];
    let mut kept = Vec::new();
    for (i, mut node) in nodes.into_iter().enumerate() {
        if live[i] {
            node.inputs = node
                .inputs
                .iter()
                .map(|a| remap[a.index()].unwrap_or(*a))
                .collect();
            remap[i] = Some(NodeId::from_index(kept.len()));
            kept.push(node);
        }
    }
    let outputs = outputs
        .iter()
        .map(|o| remap[o.index()].unwrap_or(*o))
        .collect();
    let present: HashSet<String> = kept
        .iter()
        .filter_map(|n| match &n.op {
            Op::Param { name } => Some(name.clone()),
            _ => None,
        })
        .collect();
    let mut params: Vec<(String, TensorData)> = params
        .into_iter()
        .filter(|(n, _)| present.contains(n))
        .collect();
    params.extend(made.into_iter().map(|(_, n, d)| (n, d)));
    Ok((
        Graph::from_parts(graph.name(), kept, outputs, constants),
        params,
    ))
}

/// The name of the first param node `i` reads, depth first.
fn first_param(nodes: &[Node], i: usize) -> Option<String> {
    let mut stack = vec![i];
    let mut seen = HashSet::new();
    while let Some(j) = stack.pop() {
        if !seen.insert(j) {
            continue;
        }
        if let Op::Param { name } = &nodes[j].op {
            return Some(name.clone());
        }
        stack.extend(nodes[j].inputs.iter().rev().map(|a| a.index()));
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlx_ir::reference::evaluate;
    use rlx_ir::{DType, Shape};

    fn values(n: usize, seed: u64) -> Vec<f32> {
        let mut s = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..n)
            .map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                (s % 2001) as f32 / 1000.0 - 1.0
            })
            .collect()
    }

    fn run(g: &Graph, params: &[(String, TensorData)], x: &[f32]) -> Vec<f64> {
        let mut feed: HashMap<String, HostTensor> = params
            .iter()
            .map(|(n, d)| {
                let (_, id, shape) = g
                    .params()
                    .into_iter()
                    .find(|(p, _, _)| p == n)
                    .expect("every param listed is in the graph");
                let _ = id;
                (n.clone(), HostTensor::from_data(shape.dims(), d).unwrap())
            })
            .collect();
        feed.insert(
            "x".into(),
            HostTensor::from_data(&[3, 4], &TensorData::F32(x.to_vec())).unwrap(),
        );
        evaluate(g, &mut feed).unwrap().remove(0).data
    }

    /// `x [3, 4] @ reshape(slice(w)) + x @ permute(slice(w, step -1))`, and `v` read
    /// directly as well as through a view.
    fn model() -> (Graph, Vec<(String, TensorData)>) {
        let g = Graph::new("views");
        let x = g.input("x", Shape::new(&[3, 4], DType::F32)).unwrap();
        let w = g.param("w", Shape::new(&[2, 4, 5], DType::F32)).unwrap();
        let v = g.param("v", Shape::new(&[5, 4], DType::F32)).unwrap();
        let w0 = g.slice(w, 0, 0, 1, 1).unwrap();
        let w0 = g.reshape(w0, &[4, 5]).unwrap();
        let w1 = g.slice(w, 0, -1, -3, -1).unwrap();
        let w1 = g.slice(w1, 0, 0, 1, 1).unwrap();
        let w1 = g.reshape(w1, &[4, 5]).unwrap();
        let y = g
            .add(g.matmul(x, w0).unwrap(), g.matmul(x, w1).unwrap())
            .unwrap();
        let vt = g.permute(v, &[1, 0]).unwrap();
        let y = g.add(y, g.matmul(x, vt).unwrap()).unwrap();
        let y = g
            .add(y, g.matmul(x, g.reshape(v, &[4, 5]).unwrap()).unwrap())
            .unwrap();
        // `v` is also read by a product directly: its views stay.
        let direct = g.matmul(
            g.reshape(x, &[3, 4]).unwrap(),
            g.permute(v, &[1, 0]).unwrap(),
        );
        let y = g.add(y, direct.unwrap()).unwrap();
        let y = g.add(y, g.matmul(x, vt).unwrap()).unwrap();
        let _ = g.neg(v).unwrap();
        g.set_outputs(vec![y]);
        let params = vec![
            ("w".to_string(), TensorData::F32(values(40, 1))),
            ("v".to_string(), TensorData::F32(values(20, 2))),
        ];
        (g, params)
    }

    #[test]
    fn views_of_params_become_params_and_the_result_is_unchanged() {
        let (g, params) = model();
        let x = values(12, 3);
        let before = run(&g, &params, &x);
        let (folded, folded_params) = fold_weight_views(g.clone(), params, 1 << 20).unwrap();
        folded.verify().unwrap();
        let after = run(&folded, &folded_params, &x);
        assert_eq!(before, after);
        let names: Vec<&str> = folded_params.iter().map(|(n, _)| n.as_str()).collect();
        // `w` is read only through views: gone, two views in its place. `v` is read
        // by a node that is not a view (`neg`), so it and its views stay.
        assert!(!names.contains(&"w"), "{names:?}");
        assert_eq!(
            names.iter().filter(|n| n.starts_with("w.view")).count(),
            2,
            "{names:?}"
        );
        assert!(names.contains(&"v") && !names.iter().any(|n| n.starts_with("v.view")));
        let nodes = folded.nodes();
        assert!(
            !nodes.iter().any(|n| matches!(n.op, Op::Slice { .. })),
            "no slice is left"
        );
        assert_eq!(folded.params().len(), folded_params.len());
    }

    #[test]
    fn a_graph_without_views_or_over_the_limit_is_left_as_it_was() {
        let (g, params) = model();
        let (same, same_params) = fold_weight_views(g.clone(), params.clone(), 4).unwrap();
        assert!(same == g);
        assert_eq!(same_params, params);
    }
}
