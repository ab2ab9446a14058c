//! Which decode-step products of a plan run together as one kernel
//! ([`crate::codegen::gemv_group`]).
//!
//! A group is a run of consecutive scheduled nodes: optionally an RMS norm whose
//! only readers are the products that follow it, then two or more products of the
//! same input (or one, after a norm), then optionally an elementwise region whose
//! inputs are exactly those products and which is their only reader. The group's
//! kernel runs in the place of its last node; the other nodes run nothing. Because
//! the nodes are consecutive, no other kernel runs between them, so every value the
//! group reads is still where the plan put it, unless the plan reused its bytes for
//! a value the group writes; such groups are not formed.

use crate::node_runs::{Runs, any_overlap, span};
use rlx_ir::{DType, EwStep, NodeId, Op};
use rlx_opt::Plan;
use std::collections::HashSet;

/// Whether decode steps' nodes are grouped into shared kernels: these product
/// groups and [`crate::rope_writes`] (`RLX_CUDA_GROUPS=0` turns both off, to
/// measure what they save).
pub(crate) fn enabled() -> bool {
    rlx_ir::env::Switch::CudaGroups.enabled()
}

/// The most products in one group (each takes up to three operands).
const MOST_PRODUCTS: usize = 4;

/// An RMS norm computed inside a group's products.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct FoldedNorm {
    /// The norm's input.
    pub x: NodeId,
    /// Its scale, `[K]`.
    pub gamma: NodeId,
    /// Added to the mean square.
    pub eps: f64,
}

/// Nodes that run as one kernel.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct ProductGroup {
    /// The norm whose result the products read, computed inside them.
    pub norm: Option<FoldedNorm>,
    /// The products, in operand order (the combining region's input order).
    pub products: Vec<NodeId>,
    /// The elementwise region applied to the products' results, stored instead of
    /// them.
    pub combine: Option<NodeId>,
}

/// The groups of a plan.
pub(crate) type ProductGroups = Runs<ProductGroup>;

/// The groups of `plan` as the CUDA backend lays it out: products whose weight is a
/// param stored `[N, K]` ([`crate::param_layout`]) and that
/// [`crate::fused_matmul::joins_row_group`] accepts.
pub(crate) fn of_plan(plan: &Plan) -> ProductGroups {
    let transposed = crate::param_layout::transposed_params(plan);
    let param_index = crate::param_layout::param_indices(plan);
    let nodes = plan.graph.nodes();
    find(plan, |id| {
        let node = &nodes[id.index()];
        if !matches!(node.op, Op::MatMul | Op::FusedMatMul { .. }) {
            return false;
        }
        let b_transposed = node
            .inputs
            .get(1)
            .and_then(|b| param_index.get(b))
            .is_some_and(|&i| transposed[i]);
        let shapes: Vec<_> = node.inputs.iter().map(|&x| plan.shape(x).clone()).collect();
        crate::fused_matmul::joins_row_group(
            &shapes,
            &node.shape,
            plan.locations[node.inputs[0].index()],
            b_transposed,
        )
    })
}

/// Finds the groups of `plan`. `row_product` says whether a node is a product that
/// a group kernel can compute (a few rows against a weight stored `[N, K]`).
pub(crate) fn find(plan: &Plan, row_product: impl Fn(NodeId) -> bool) -> ProductGroups {
    let nodes = plan.graph.nodes();
    let mut users: Vec<Vec<NodeId>> = vec![Vec::new(); nodes.len()];
    for (i, node) in nodes.iter().enumerate() {
        for x in &node.inputs {
            users[x.index()].push(NodeId::from_index(i));
        }
    }
    let is_output = |id: NodeId| plan.outputs.contains(&id);
    let sched = &plan.schedule;
    let mut groups = ProductGroups::default();
    let mut i = 0;
    while i < sched.len() {
        let first = sched[i];
        let mut norm = None;
        let mut start = i;
        if let Op::RmsNorm { eps } = &nodes[first.index()].op {
            let readers = &users[first.index()];
            let inputs = &nodes[first.index()].inputs;
            let following: HashSet<NodeId> = sched
                .iter()
                .skip(i + 1)
                .take(readers.len())
                .copied()
                .collect();
            let f32s = std::iter::once(first)
                .chain(inputs.iter().copied())
                .all(|x| plan.shape(x).dtype() == DType::F32);
            let gamma_flat = inputs.len() == 2 && plan.shape(inputs[1]).rank() == 1;
            // The kernel reads both 16 bytes at a time.
            let aligned = inputs
                .iter()
                .all(|&x| crate::fused_matmul::aligned16(plan.locations[x.index()]));
            if f32s
                && gamma_flat
                && aligned
                && !is_output(first)
                && !readers.is_empty()
                && readers.len() <= MOST_PRODUCTS
                && readers.iter().all(|&r| {
                    row_product(r) && nodes[r.index()].inputs[1..].iter().all(|&x| x != first)
                })
                && following.len() == readers.len()
                && readers.iter().all(|r| following.contains(r))
            {
                norm = Some(FoldedNorm {
                    x: inputs[0],
                    gamma: inputs[1],
                    eps: eps.get(),
                });
                start = i + 1;
            }
        }
        // The run of products of one input from `start`.
        let mut products = Vec::new();
        if start < sched.len() && row_product(sched[start]) {
            let lead = &nodes[sched[start].index()];
            let weight_dtype = |id: NodeId| plan.shape(nodes[id.index()].inputs[1]).dtype();
            for &p in sched[start..].iter().take(MOST_PRODUCTS) {
                let node = &nodes[p.index()];
                if !row_product(p)
                    || node.inputs[0] != lead.inputs[0]
                    || weight_dtype(p) != weight_dtype(sched[start])
                    || plan.shape(p).dtype() != plan.shape(sched[start]).dtype()
                {
                    break;
                }
                products.push(p);
            }
            if norm.is_some() && products.len() != users[first.index()].len() {
                products.clear();
            }
        }
        if products.is_empty() || (norm.is_none() && products.len() < 2) {
            i += 1;
            continue;
        }
        let after = start + products.len();
        let combine = sched
            .get(after)
            .copied()
            .filter(|&e| combines(plan, &users, e, &products, &is_output));
        if let Some(e) = combine {
            // Operand order is the region's input order.
            products = nodes[e.index()].inputs.clone();
        }
        let group = ProductGroup {
            norm,
            products,
            combine,
        };
        if overlaps(plan, &group) {
            i += 1;
            continue;
        }
        let end = after + usize::from(combine.is_some());
        groups.add(&sched[i..end], group);
        i = end;
    }
    groups
}

/// The steps of an op that can combine a group's results: an elementwise region, or
/// one arithmetic op of two operands.
pub(crate) fn combining_steps(op: &Op) -> Option<Vec<EwStep>> {
    use rlx_ir::BinaryOp as B;
    match op {
        Op::Elementwise { steps } => Some(steps.clone()),
        Op::Binary(b @ (B::Add | B::Sub | B::Mul | B::Div | B::Max | B::Min)) => {
            Some(vec![EwStep::Binary(*b, 0, 1)])
        }
        _ => None,
    }
}

/// Whether node `e`, an elementwise region or arithmetic op, reads exactly `products`, each once and all of its
/// own shape, and is the only reader of each.
fn combines(
    plan: &Plan,
    users: &[Vec<NodeId>],
    e: NodeId,
    products: &[NodeId],
    is_output: &impl Fn(NodeId) -> bool,
) -> bool {
    let node = &plan.graph.nodes()[e.index()];
    if combining_steps(&node.op).is_none() {
        return false;
    }
    let distinct: HashSet<NodeId> = node.inputs.iter().copied().collect();
    products.len() >= 2
        && node.inputs.len() == products.len()
        && distinct.len() == products.len()
        && products.iter().all(|p| {
            distinct.contains(p)
                && users[p.index()] == [e]
                && !is_output(*p)
                && plan.shape(*p) == plan.shape(e)
        })
}

/// Whether a value the group writes shares bytes with one it reads.
fn overlaps(plan: &Plan, group: &ProductGroup) -> bool {
    let nodes = plan.graph.nodes();
    let span = |id: NodeId| span(plan, id);
    let written: Vec<_> = match group.combine {
        Some(e) => vec![span(e)],
        None => group.products.iter().map(|&p| span(p)).collect(),
    };
    let mut read: Vec<_> = Vec::new();
    if let Some(norm) = group.norm {
        read.push(span(norm.x));
        read.push(span(norm.gamma));
    }
    for &p in &group.products {
        let inputs = &nodes[p.index()].inputs;
        let skip = usize::from(group.norm.is_some());
        read.extend(inputs[skip..].iter().map(|&x| span(x)));
    }
    any_overlap(&written, &read)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlx_ir::{Graph, Shape};
    use rlx_opt::{PlanOptions, plan_graph};

    /// A decode layer's shape of work: norm, q/k/v, an output projection with a
    /// residual, norm, gate and up under SwiGLU, down with a residual.
    fn layer(norm_is_output: bool) -> Graph {
        let g = Graph::new("layer");
        let f32s = |d: &[usize]| Shape::new(d, DType::F32);
        let weight = |name: &str, k: usize, n: usize| {
            let w = g.param(name, Shape::new(&[k, n], DType::BF16)).unwrap();
            g.cast(w, DType::F32).unwrap()
        };
        let x = g.input("x", f32s(&[1, 64])).unwrap();
        let h = g
            .rms_norm(x, g.param("g1", f32s(&[64])).unwrap(), 1e-5)
            .unwrap();
        let q = g.matmul(h, weight("wq", 64, 64)).unwrap();
        let k = g.matmul(h, weight("wk", 64, 16)).unwrap();
        let v = g.matmul(h, weight("wv", 64, 16)).unwrap();
        let o = g
            .add(x, g.matmul(q, weight("wo", 64, 64)).unwrap())
            .unwrap();
        let h2 = g
            .rms_norm(o, g.param("g2", f32s(&[64])).unwrap(), 1e-5)
            .unwrap();
        let gate = g.matmul(h2, weight("wg", 64, 96)).unwrap();
        let up = g.matmul(h2, weight("wu", 64, 96)).unwrap();
        let act = g.mul(g.silu(gate).unwrap(), up).unwrap();
        let down = g
            .add(o, g.matmul(act, weight("wd", 96, 64)).unwrap())
            .unwrap();
        let mut outputs = vec![k, v, down];
        if norm_is_output {
            outputs.push(h);
        }
        g.set_outputs(outputs);
        g
    }

    fn plan(g: &Graph) -> Plan {
        let options = PlanOptions {
            fusion: crate::fusion(),
            native: crate::native_ops(),
            ..PlanOptions::default()
        };
        plan_graph(g, &options).unwrap()
    }

    fn op(plan: &Plan, id: NodeId) -> String {
        plan.graph.nodes()[id.index()].op.name()
    }

    #[test]
    fn a_decode_layer_groups_its_norms_and_sibling_products() {
        let plan = plan(&layer(false));
        let groups = of_plan(&plan);
        let mut found: Vec<&ProductGroup> = groups.at.values().collect();
        found.sort_by_key(|g| g.products[0].index());
        assert_eq!(found.len(), 2, "{:?}\n{}", groups, plan.graph);
        let (attention, mlp) = (found[0], found[1]);
        assert!(attention.norm.is_some() && attention.combine.is_none());
        assert_eq!(attention.products.len(), 3);
        let widths: Vec<usize> = attention
            .products
            .iter()
            .map(|&p| plan.shape(p).dims()[1])
            .collect();
        assert_eq!(widths, [64, 16, 16]);
        let e = mlp.combine.unwrap_or_else(|| {
            panic!(
                "gate and up combined: {:?} {:?}\n{}",
                mlp, plan.schedule, plan.graph
            )
        });
        assert_eq!(op(&plan, e), "mul");
        assert!(mlp.norm.is_some());
        assert_eq!(mlp.products, plan.graph.nodes()[e.index()].inputs);
        // Everything but the anchors runs nothing: two norms, two of q/k/v, gate
        // and up.
        assert_eq!(groups.absorbed.len(), 6);
        let absorbed_norms = groups
            .absorbed
            .iter()
            .filter(|&&id| op(&plan, id) == "rms_norm")
            .count();
        assert_eq!(absorbed_norms, 2);
        // The output projection and down stay alone.
        let products = plan
            .schedule
            .iter()
            .filter(|&&id| op(&plan, id) == "fused_matmul")
            .count();
        assert_eq!(products, 7);
    }

    #[test]
    fn a_norm_that_is_also_an_output_still_runs() {
        let plan = plan(&layer(true));
        let groups = of_plan(&plan);
        let attention = groups
            .at
            .values()
            .find(|g| g.products.len() == 3)
            .expect("q/k/v grouped");
        assert_eq!(attention.norm, None);
        let absorbed_norms = groups
            .absorbed
            .iter()
            .filter(|&&id| op(&plan, id) == "rms_norm")
            .count();
        assert_eq!(absorbed_norms, 1, "only the second norm is folded");
    }

    #[test]
    fn a_region_that_reads_more_than_the_products_is_not_combined() {
        let g = Graph::new("not swiglu");
        let x = g.input("x", Shape::new(&[2, 32], DType::F32)).unwrap();
        let w = |name: &str| g.param(name, Shape::new(&[32, 24], DType::F32)).unwrap();
        let a = g.matmul(x, w("wa")).unwrap();
        let b = g.matmul(x, w("wb")).unwrap();
        let y = g
            .mul(g.mul(g.silu(a).unwrap(), b).unwrap(), x_bias(&g))
            .unwrap();
        g.set_outputs(vec![y]);
        let plan = plan(&g);
        let groups = of_plan(&plan);
        let group = groups
            .at
            .values()
            .next()
            .unwrap_or_else(|| panic!("a and b grouped: {:?}\n{}", plan.schedule, plan.graph));
        assert_eq!(group.combine, None);
        assert_eq!(group.products.len(), 2);
    }

    fn x_bias(g: &Graph) -> NodeId {
        g.input("z", Shape::new(&[2, 24], DType::F32)).unwrap()
    }
}
