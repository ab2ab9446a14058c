//! Which rotary embeddings and cache writes of a plan run as one kernel
//! ([`crate::codegen::rope_write`]): a run of consecutive scheduled `rope` and
//! `write_at` nodes whose rotations share their tables and whose writes share their
//! position (a decode step's q and k rotations and its k and v cache writes). A
//! rotation read only by a write of the run goes straight into that write's cache.
//! The kernel runs in the place of the run's last node; as for
//! [`crate::product_groups`], no other kernel runs between the nodes, and runs
//! whose written bytes overlap their read ones are not formed.

use crate::codegen::gemv_group::GroupTail;
use crate::codegen::rope_write::{RopeJob, RopeWrites, WriteJob};
use crate::node_runs::{Runs, any_overlap, span};
use crate::product_groups::ProductGroup;
use crate::program::Arg;
use rlx_ir::{NodeId, Op};
use rlx_opt::Plan;

/// The most nodes in one run.
const MOST_NODES: usize = 8;

/// A run of rotations and writes.
#[derive(Clone, Debug, PartialEq)]
pub(crate) struct RopeWriteGroup {
    /// The `rope` nodes, in schedule order.
    pub ropes: Vec<NodeId>,
    /// The `write_at` nodes, in schedule order.
    pub writes: Vec<NodeId>,
}

/// The runs of a plan.
pub(crate) type RopeWriteGroups = Runs<RopeWriteGroup>;

/// Finds the runs of `plan`.
pub(crate) fn find(plan: &Plan) -> RopeWriteGroups {
    let nodes = plan.graph.nodes();
    let sched = &plan.schedule;
    let mut groups = RopeWriteGroups::default();
    let mut i = 0;
    while i < sched.len() {
        let mut group = RopeWriteGroup {
            ropes: Vec::new(),
            writes: Vec::new(),
        };
        let mut end = i;
        while end < sched.len() && end - i < MOST_NODES && joins(plan, &group, sched[end]) {
            match nodes[sched[end].index()].op {
                Op::Rope { .. } => group.ropes.push(sched[end]),
                _ => group.writes.push(sched[end]),
            }
            end += 1;
        }
        if end - i < 2 || overlaps(plan, &group) {
            i += 1;
            continue;
        }
        groups.add(&sched[i..end], group);
        i = end;
    }
    groups
}

/// Whether `id` can join `group`: a rotation with the group's tables, or a write at
/// the group's position of the group's row count into a cache of the same length.
fn joins(plan: &Plan, group: &RopeWriteGroup, id: NodeId) -> bool {
    let nodes = plan.graph.nodes();
    let node = &nodes[id.index()];
    match node.op {
        Op::Rope { .. } => group.ropes.first().is_none_or(|&r| {
            let first = &nodes[r.index()];
            first.inputs[1..] == node.inputs[1..]
        }),
        Op::WriteAt { axis } => {
            let rows = |w: &rlx_ir::Node, axis: usize| {
                (
                    plan.shape(w.inputs[1]).dims()[axis],
                    plan.shape(w.inputs[0]).dims()[axis],
                )
            };
            // The kernel writes the target in place, as the planner places it.
            plan.locations[id.index()] == plan.locations[node.inputs[0].index()]
                && group.writes.first().is_none_or(|&w| {
                    let first = &nodes[w.index()];
                    let Op::WriteAt { axis: first_axis } = first.op else {
                        return false;
                    };
                    first.inputs[2] == node.inputs[2] && rows(first, first_axis) == rows(node, axis)
                })
        }
        _ => false,
    }
}

/// For each rotation of `group`, the write (its index) that stores it in a cache,
/// when that write is the rotation's only reader.
fn destinations(plan: &Plan, group: &RopeWriteGroup) -> Vec<Option<usize>> {
    let nodes = plan.graph.nodes();
    group
        .ropes
        .iter()
        .map(|&r| {
            if plan.outputs.contains(&r) {
                return None;
            }
            let readers: Vec<usize> = nodes
                .iter()
                .enumerate()
                .filter(|(_, n)| n.inputs.contains(&r))
                .map(|(k, _)| k)
                .collect();
            let [only] = readers[..] else {
                return None;
            };
            group.writes.iter().position(|&w| {
                let write = &nodes[w.index()];
                w.index() == only && write.inputs[1] == r && write.inputs[0] != r
            })
        })
        .collect()
}

/// Whether bytes the group writes are bytes it reads.
fn overlaps(plan: &Plan, group: &RopeWriteGroup) -> bool {
    let nodes = plan.graph.nodes();
    let span = |id: NodeId| span(plan, id);
    let into = destinations(plan, group);
    let mut written = Vec::new();
    let mut read = Vec::new();
    for (k, &r) in group.ropes.iter().enumerate() {
        if into[k].is_none() {
            written.push(span(r));
        }
        read.extend(nodes[r.index()].inputs.iter().map(|&x| span(x)));
    }
    for &w in &group.writes {
        written.push(span(w));
        let inputs = &nodes[w.index()].inputs;
        // An update is read as a value unless its rotation goes straight into this
        // write (a rotation kept as a value and also written would be read while
        // the kernel writes it: its own bytes overlap).
        let straight = group
            .ropes
            .iter()
            .position(|&r| r == inputs[1])
            .is_some_and(|k| into[k].is_some());
        if !straight {
            read.push(span(inputs[1]));
        }
        read.push(span(inputs[2]));
    }
    any_overlap(&written, &read)
}

/// The error for a group member of the wrong op (a group built for another plan).
fn not_in_group(id: NodeId, want: &str) -> rlx_ir::Error {
    rlx_ir::Error::Unsupported {
        device: "cuda".into(),
        what: format!(
            "%{} in a rotation and cache-write group is not a {want}",
            id.index()
        ),
    }
}

/// A group's kernel description and its operands by kind.
struct Parts {
    spec: RopeWrites,
    /// Each rotation kept as a value.
    rotated: Vec<Arg>,
    caches: Vec<Arg>,
    /// Each rotation's input node.
    inputs: Vec<NodeId>,
    cos: Arg,
    sin: Arg,
    /// For each write, the operand node it writes (`None`: a rotation's result).
    operands: Vec<Option<NodeId>>,
    pos: Arg,
}

fn parts(plan: &Plan, group: &RopeWriteGroup) -> rlx_ir::Result<Parts> {
    let nodes = plan.graph.nodes();
    let at = |id: NodeId| Arg::At(plan.locations[id.index()]);
    let into = destinations(plan, group);
    let from = |w: NodeId| {
        let update = nodes[w.index()].inputs[1];
        group
            .ropes
            .iter()
            .position(|&r| r == update)
            .filter(|&k| into[k].is_some())
    };
    let mut ropes = Vec::new();
    for (k, &r) in group.ropes.iter().enumerate() {
        let Op::Rope { style } = nodes[r.index()].op else {
            return Err(not_in_group(r, "rope"));
        };
        ropes.push(RopeJob {
            x: plan.shape(nodes[r.index()].inputs[0]).clone(),
            style,
            into: into[k],
        });
    }
    let mut writes = Vec::new();
    for &w in &group.writes {
        let Op::WriteAt { axis } = nodes[w.index()].op else {
            return Err(not_in_group(w, "write_at"));
        };
        let inputs = &nodes[w.index()].inputs;
        writes.push(WriteJob {
            target: plan.shape(inputs[0]).clone(),
            update: plan.shape(inputs[1]).clone(),
            axis,
            from: from(w),
        });
    }
    let tables = group.ropes.first().map(|&r| &nodes[r.index()].inputs);
    let pos = group.writes.first().map(|&w| nodes[w.index()].inputs[2]);
    let shape_or_scalar = |id: Option<NodeId>| {
        id.map_or_else(
            || rlx_ir::Shape::new(&[1], rlx_ir::DType::F32),
            |x| plan.shape(x).clone(),
        )
    };
    // Without ropes or writes the tables and position are never read; any live
    // address stands in.
    let stand_in = group
        .writes
        .first()
        .or(group.ropes.first())
        .copied()
        .ok_or_else(|| not_in_group(NodeId::from_index(0), "rope or write_at"))?;
    let table = |k: usize| tables.map_or(at(stand_in), |t| at(t[k]));
    Ok(Parts {
        spec: RopeWrites {
            ropes,
            cos: shape_or_scalar(tables.map(|t| t[1])),
            sin: shape_or_scalar(tables.map(|t| t[2])),
            writes,
            pos: shape_or_scalar(pos),
        },
        rotated: group
            .ropes
            .iter()
            .zip(&into)
            .filter(|(_, into)| into.is_none())
            .map(|(&r, _)| at(r))
            .collect(),
        caches: group.writes.iter().map(|&w| at(w)).collect(),
        inputs: group
            .ropes
            .iter()
            .map(|&r| nodes[r.index()].inputs[0])
            .collect(),
        cos: table(1),
        sin: table(2),
        operands: group
            .writes
            .iter()
            .map(|&w| from(w).is_none().then(|| nodes[w.index()].inputs[1]))
            .collect(),
        pos: pos.map_or(at(stand_in), at),
    })
}

/// The group's kernel and its operands; a position that does not fit is reported as
/// `code`.
pub(crate) fn plan_group(
    plan: &Plan,
    group: &RopeWriteGroup,
    code: i32,
) -> rlx_ir::Result<(crate::codegen::Kernel, Vec<Arg>)> {
    let parts = parts(plan, group)?;
    let kernel = crate::codegen::rope_write::kernel(crate::codegen::STEP_NAME, &parts.spec, code)?;
    let at = |id: NodeId| Arg::At(plan.locations[id.index()]);
    let mut args = parts.rotated;
    args.extend(parts.caches);
    args.extend(parts.inputs.iter().map(|&x| at(x)));
    args.extend([parts.cos, parts.sin]);
    args.extend(parts.operands.iter().flatten().map(|&x| at(x)));
    args.extend([parts.pos, Arg::Errors]);
    Ok((kernel, args))
}

/// `group` done by the kernel of `products` (which runs just before it), when
/// every rotation's input and every written operand is one of the products'
/// outputs (one row each) and nothing the group writes is anything the products'
/// kernel reads or writes (it writes while other warps still compute). Returns the
/// tail and its operands, after the group's own.
pub(crate) fn as_tail(
    plan: &Plan,
    group: &RopeWriteGroup,
    products: &ProductGroup,
    code: i32,
) -> Option<(GroupTail, Vec<Arg>)> {
    if products.combine.is_some() {
        return None;
    }
    let parts = parts(plan, group).ok()?;
    let nodes = plan.graph.nodes();
    // The product whose output `x` is: the same bytes, the same element count.
    let product_of = |x: NodeId| {
        products.products.iter().position(|&p| {
            plan.locations[p.index()] == plan.locations[x.index()]
                && plan.shape(p).num_elements() == plan.shape(x).num_elements()
                && plan.shape(p).dtype() == plan.shape(x).dtype()
        })
    };
    let mut reader = vec![None; products.products.len()];
    let mut claim = |p: usize, job| {
        let free = reader[p].is_none();
        reader[p] = Some(job);
        free
    };
    for (j, &x) in parts.inputs.iter().enumerate() {
        if !claim(product_of(x)?, Ok(j)) {
            return None;
        }
    }
    for (w, operand) in parts.operands.iter().enumerate() {
        if let Some(x) = *operand
            && !claim(product_of(x)?, Err(w))
        {
            return None;
        }
    }
    // Everything the products' kernel touches, against what the tail writes.
    // (A folded norm's result is never stored: the products read its input.)
    let mut touched: Vec<_> = products.products.iter().map(|&p| span(plan, p)).collect();
    for &p in &products.products {
        let inputs = &nodes[p.index()].inputs;
        let skip = usize::from(products.norm.is_some());
        touched.extend(inputs[skip..].iter().map(|&x| span(plan, x)));
    }
    if let Some(norm) = products.norm {
        touched.extend([span(plan, norm.x), span(plan, norm.gamma)]);
    }
    let into = destinations(plan, group);
    let mut written: Vec<_> = group
        .ropes
        .iter()
        .zip(&into)
        .filter(|(_, into)| into.is_none())
        .map(|(&r, _)| span(plan, r))
        .collect();
    written.extend(group.writes.iter().map(|&w| span(plan, w)));
    if any_overlap(&written, &touched) {
        return None;
    }
    let mut args = parts.rotated;
    args.extend(parts.caches);
    args.extend([parts.cos, parts.sin, parts.pos, Arg::Errors]);
    Some((
        GroupTail {
            spec: parts.spec,
            reader,
            code,
        },
        args,
    ))
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlx_ir::{DType, Graph, RopeStyle, Shape};
    use rlx_opt::{PlanOptions, plan_graph};

    /// A decode step's rotations, cache writes and attention; `k_is_output` also
    /// returns the rotated k.
    fn plan(k_is_output: bool) -> Plan {
        let g = Graph::new("decode attention");
        let f32s = |d: &[usize]| Shape::new(d, DType::F32);
        let q = g.input("q", f32s(&[1, 1, 4, 16])).unwrap();
        let k = g.input("k", f32s(&[1, 1, 2, 16])).unwrap();
        let v = g.input("v", f32s(&[1, 1, 2, 16])).unwrap();
        let (att, k) = attend(&g, q, k, v);
        g.set_outputs(if k_is_output { vec![att, k] } else { vec![att] });
        plan_with_caches(&g)
    }

    /// q/k/v products of a normalized row, rotated and written as a decode step.
    fn projected_plan() -> Plan {
        let g = Graph::new("decode projections");
        let f32s = |d: &[usize]| Shape::new(d, DType::F32);
        let x = g.input("x", f32s(&[1, 64])).unwrap();
        let h = g
            .rms_norm(x, g.param("g1", f32s(&[64])).unwrap(), 1e-5)
            .unwrap();
        let project = |name: &str, heads: usize| {
            let w = g.param(name, f32s(&[64, heads * 16])).unwrap();
            g.reshape(g.matmul(h, w).unwrap(), &[1, 1, heads, 16])
                .unwrap()
        };
        let (q, k, v) = (project("wq", 4), project("wk", 2), project("wv", 2));
        let (att, _) = attend(&g, q, k, v);
        // The residual keeps x live past the products, as in a layer.
        let out = g.add(x, g.reshape(att, &[1, 64]).unwrap()).unwrap();
        g.set_outputs(vec![out]);
        plan_with_caches(&g)
    }

    /// The cache shape of the test graphs: 8 positions of 2 heads of 16.
    fn cache() -> Shape {
        Shape::new(&[1, 8, 2, 16], DType::F32)
    }

    /// q and k rotated, k and v written into the caches at `pos`, and attention
    /// over them; returns the attention and the rotated k.
    fn attend(g: &Graph, q: NodeId, k: NodeId, v: NodeId) -> (NodeId, NodeId) {
        let f32s = |d: &[usize]| Shape::new(d, DType::F32);
        let cos = g.input("cos", f32s(&[1, 1, 1, 8])).unwrap();
        let sin = g.input("sin", f32s(&[1, 1, 1, 8])).unwrap();
        let pos = g.input("pos", Shape::new(&[1], DType::I64)).unwrap();
        let k_cache = g.input("k_cache", cache()).unwrap();
        let v_cache = g.input("v_cache", cache()).unwrap();
        let q = g.rope(q, cos, sin, RopeStyle::HalfSplit).unwrap();
        let k = g.rope(k, cos, sin, RopeStyle::HalfSplit).unwrap();
        let k_all = g.write_at(k_cache, k, pos, 1).unwrap();
        let v_all = g.write_at(v_cache, v, pos, 1).unwrap();
        (g.cached_attention(q, k_all, v_all, pos, None).unwrap(), k)
    }

    /// `g` planned as the CUDA backend plans it, the caches bound as handles.
    fn plan_with_caches(g: &Graph) -> Plan {
        let options = PlanOptions {
            handles: vec![("k_cache".into(), cache()), ("v_cache".into(), cache())],
            fusion: crate::fusion(),
            native: crate::native_ops(),
            ..PlanOptions::default()
        };
        plan_graph(g, &options).unwrap()
    }

    #[test]
    fn rotations_of_the_products_just_before_are_their_kernels_tail() {
        let plan = projected_plan();
        let products = crate::product_groups::of_plan(&plan);
        let ropes = find(&plan);
        assert_eq!(
            (products.at.len(), ropes.at.len()),
            (1, 1),
            "{}",
            plan.graph
        );
        let (group, rope) = (
            products.at.values().next().unwrap(),
            ropes.at.values().next().unwrap(),
        );
        assert!(group.norm.is_some());
        let (tail, args) = as_tail(&plan, rope, group, 9).unwrap();
        // q rotated and kept, k rotated into its cache, v written.
        assert_eq!(tail.reader, [Some(Ok(0)), Some(Ok(1)), Some(Err(1))]);
        // q's result, two caches, cos, sin, pos, errors.
        assert_eq!(args.len(), 7);
        // A combined group (gate/up) takes no tail.
        let combined = ProductGroup {
            combine: Some(group.products[0]),
            ..group.clone()
        };
        assert!(as_tail(&plan, rope, &combined, 9).is_none());
    }

    fn op(plan: &Plan, id: NodeId) -> String {
        plan.graph.nodes()[id.index()].op.name()
    }

    #[test]
    fn a_decode_steps_rotations_and_writes_are_one_run() {
        let plan = plan(false);
        let groups = find(&plan);
        assert_eq!(groups.at.len(), 1, "{:?}\n{}", groups, plan.graph);
        let group = groups.at.values().next().unwrap();
        assert_eq!((group.ropes.len(), group.writes.len()), (2, 2));
        // q is kept as a value, k goes straight into its cache.
        assert_eq!(destinations(&plan, group), [None, Some(0)]);
        assert_eq!(groups.absorbed.len(), 3);
        let (kernel, args) = plan_group(&plan, group, 7).unwrap();
        // q's result, two caches, two rotated inputs, cos, sin, v, pos, errors.
        assert_eq!(args.len(), 10);
        assert!(kernel.check.is_some());
    }

    #[test]
    fn a_rotation_kept_as_an_output_and_written_is_not_grouped_with_its_write() {
        let plan = plan(true);
        let groups = find(&plan);
        let kinds: Vec<Vec<String>> = groups
            .at
            .values()
            .map(|g| {
                g.ropes
                    .iter()
                    .chain(&g.writes)
                    .map(|&id| op(&plan, id))
                    .collect()
            })
            .collect();
        // The rotated k is read by its write while the kernel would write it, so
        // only the two writes share a kernel.
        assert_eq!(kinds, [["write_at", "write_at"]], "{}", plan.graph);
    }
}
