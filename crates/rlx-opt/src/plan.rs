//! From a graph to a [`Plan`]: passes, schedule, and where every value lives.

use crate::fuse::{FusionOptions, FusionRecord};
use crate::lifetimes::{Lifetime, assign_offsets};
use rlx_ir::{Error, Graph, Node, NodeId, Op, Result, Shape, SliceAxis};

/// Byte alignment of every value the planner places in the arena.
pub const ARENA_ALIGN: usize = 64;

/// Which block of memory a value lives in.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Region {
    /// The per-graph arena of transient values (inputs, intermediates, outputs).
    Arena,
    /// The weights region: param number `i` of [`Plan::params`].
    Param(usize),
    /// Constant number `i` of the graph's constant table.
    Constant(usize),
    /// Persistent handle number `i` of [`Plan::handles`].
    Handle(usize),
}

/// Where one value lives: a region and a byte offset inside it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Location {
    /// The region.
    pub region: Region,
    /// Byte offset from the region's start.
    pub offset: usize,
}

/// A named source of data: an input, a param or a handle.
#[derive(Clone, Debug, PartialEq)]
pub struct Source {
    /// Its name in the graph.
    pub name: String,
    /// Its node.
    pub node: NodeId,
    /// Its shape.
    pub shape: Shape,
}

/// What the planner is asked to do.
#[derive(Clone, Debug, PartialEq)]
pub struct PlanOptions {
    /// Inputs that are persistent handles (name and expected shape).
    pub handles: Vec<(String, Shape)>,
    /// Share arena bytes between values whose lifetimes do not overlap.
    pub memory_reuse: bool,
    /// Let elementwise ops overwrite an operand that dies at them.
    pub in_place: bool,
    /// Run constant folding and common-subexpression elimination.
    pub simplify: bool,
    /// The fused forms to build (those the backend runs).
    pub fusion: FusionOptions,
    /// The ops the backend runs natively; other composites are decomposed first.
    pub native: rlx_ir::decompose::NativeOps,
}

impl Default for PlanOptions {
    fn default() -> Self {
        PlanOptions {
            handles: Vec::new(),
            memory_reuse: true,
            in_place: true,
            simplify: true,
            fusion: FusionOptions::default(),
            native: rlx_ir::decompose::NativeOps::All,
        }
    }
}

/// Memory figures of one compiled graph.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct MemoryStats {
    /// Bytes the arena occupies.
    pub arena_bytes: usize,
    /// Sum of the bytes of every transient tensor (what the arena would need with no
    /// reuse, no in-place and no views), saturating at `usize::MAX`.
    pub transient_bytes: usize,
    /// The largest total of simultaneously live bytes under this schedule.
    pub lower_bound: usize,
    /// Values stored as views of another value (no copy).
    pub views: usize,
    /// Values computed in place over a dying operand.
    pub in_place: usize,
}

impl std::fmt::Display for MemoryStats {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "arena {} B, transient total {} B, lower bound {} B, {} views, {} in place",
            self.arena_bytes, self.transient_bytes, self.lower_bound, self.views, self.in_place
        )
    }
}

/// A compiled-ready program: the optimized graph, the order to run it, and where every
/// value lives. Backends lower it node by node; they never re-plan memory.
#[derive(Clone, Debug)]
pub struct Plan {
    /// The graph after passes.
    pub graph: Graph,
    /// Nodes that execute a kernel, in order (sources and views excluded).
    pub schedule: Vec<NodeId>,
    /// Location of every node's value, indexed by node.
    pub locations: Vec<Location>,
    /// Shape of every node's value, indexed by node (a copy of the graph's, readable
    /// without locking the graph).
    pub shapes: Vec<Shape>,
    /// For each node, whether it is a view of its first operand (no kernel runs).
    pub is_view: Vec<bool>,
    /// For each node, whether it overwrites an operand in place.
    pub is_in_place: Vec<bool>,
    /// Run-time inputs (excluding handles), in graph order.
    pub inputs: Vec<Source>,
    /// Params, in graph order.
    pub params: Vec<Source>,
    /// Persistent handles, in graph order.
    pub handles: Vec<Source>,
    /// The graph's outputs.
    pub outputs: Vec<NodeId>,
    /// Fused nodes of `graph` and the ops each replaced.
    pub fusions: Vec<FusionRecord>,
    /// Memory figures.
    pub stats: MemoryStats,
    arena_roots: Vec<(NodeId, Lifetime, usize)>,
}

impl Plan {
    /// Shape of a node's value.
    pub fn shape(&self, id: NodeId) -> &Shape {
        &self.shapes[id.index()]
    }

    /// Every value that owns arena bytes, with its lifetime (in steps) and offset;
    /// used to check that no two simultaneously live values overlap.
    pub fn arena_values(&self) -> &[(NodeId, Lifetime, usize)] {
        &self.arena_roots
    }

    /// Bytes of `region`: the arena's size, or the size of the param, constant or
    /// handle; `None` for an index the plan does not have.
    pub fn region_bytes(&self, region: Region) -> Option<usize> {
        match region {
            Region::Arena => Some(self.stats.arena_bytes),
            Region::Param(i) => self.params.get(i).map(|p| p.shape.byte_size()),
            Region::Handle(i) => self.handles.get(i).map(|h| h.shape.byte_size()),
            Region::Constant(i) => self
                .graph
                .constants()
                .get(i)
                .and_then(|c| c.len().checked_mul(c.dtype().size_in_bytes())),
        }
    }

    /// Checks that `shape`'s bytes at `location` lie inside the location's region;
    /// `what` names the operand for the error (for example "%7 (matmul) operand 1").
    /// Backends call this for every operand of every step when they build a program,
    /// so no kernel can address outside its buffer.
    ///
    /// # Errors
    /// [`Error::InvalidGraph`] naming `what`, the byte range and the region.
    pub fn check_range(&self, what: &str, location: Location, shape: &Shape) -> Result<()> {
        let region = self.region_bytes(location.region);
        let end = shape
            .checked_byte_size()
            .and_then(|len| location.offset.checked_add(len));
        match (region, end) {
            (Some(region), Some(end)) if end <= region => Ok(()),
            _ => Err(Error::InvalidGraph {
                graph: self.graph.name().into(),
                node: what.into(),
                message: format!(
                    "{shape} at byte {} of {:?} lies outside the region ({} bytes)",
                    location.offset,
                    location.region,
                    region.map_or("no such region".into(), |r| r.to_string())
                ),
            }),
        }
    }
}

/// A graph-to-graph stage of the compile pipeline. [`Stage::ALL`] lists them in
/// the order they run; a stage that `PlanOptions` turns off leaves the graph as it
/// is. After them come the schedule and the memory plan.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Stage {
    /// Composites the backend does not run natively become primitives.
    Decompose,
    /// Nodes of constant operands are evaluated once.
    Fold,
    /// Equal nodes merge.
    Cse,
    /// Nodes no output needs are removed.
    Dce,
    /// `softmax(q kᵀ c + mask) v` written out in ops becomes one attention.
    FuseAttention,
    /// Head transposes around attention fold into its layout.
    FuseAttentionLayout,
    /// Activations spelled out in ops (GELU, SiLU, ...) become one op.
    FuseActivations,
    /// Products of gathered or sliced rows become one product.
    FuseHoist,
    /// Product and convolution epilogues (bias, activation, residual, ...).
    FuseEpilogue,
    /// Cheap shared elementwise values are copied into each reader.
    FuseShare,
    /// Connected elementwise ops become one region.
    FuseRegions,
    /// Nodes that fusion left unread are removed.
    DceFused,
}

impl Stage {
    /// Every stage, in the order the pipeline runs them.
    pub const ALL: [Stage; 12] = [
        Stage::Decompose,
        Stage::Fold,
        Stage::Cse,
        Stage::Dce,
        Stage::FuseAttention,
        Stage::FuseAttentionLayout,
        Stage::FuseActivations,
        Stage::FuseHoist,
        Stage::FuseEpilogue,
        Stage::FuseShare,
        Stage::FuseRegions,
        Stage::DceFused,
    ];

    /// The stage's name, as `rlx inspect --after` and `RLX_DUMP_AFTER` take it.
    pub fn name(self) -> &'static str {
        match self {
            Stage::Decompose => "decompose",
            Stage::Fold => "fold",
            Stage::Cse => "cse",
            Stage::Dce => "dce",
            Stage::FuseAttention => "fuse.attention",
            Stage::FuseAttentionLayout => "fuse.attention_layout",
            Stage::FuseActivations => "fuse.activations",
            Stage::FuseHoist => "fuse.hoist",
            Stage::FuseEpilogue => "fuse.epilogue",
            Stage::FuseShare => "fuse.share",
            Stage::FuseRegions => "fuse.regions",
            Stage::DceFused => "dce.fused",
        }
    }
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

impl std::str::FromStr for Stage {
    type Err = Error;

    /// A stage by its name; an unknown name is an error listing them all.
    fn from_str(name: &str) -> Result<Stage> {
        Stage::ALL
            .into_iter()
            .find(|s| s.name() == name)
            .ok_or_else(|| {
                let names: Vec<&str> = Stage::ALL.iter().map(|s| s.name()).collect();
                Error::invalid(
                    "pipeline stage",
                    format!("'{name}' is not one of {}", names.join(", ")),
                )
            })
    }
}

/// The graph as it stands after pipeline stage `stage`.
pub fn graph_after(graph: &Graph, options: &PlanOptions, stage: Stage) -> Result<Graph> {
    Ok(run_stages(graph, options, Some(stage))?.0)
}

/// Runs the stages (up to and including `stop`, if given), verifying the graph
/// after each one in debug builds. With `RLX_DUMP_AFTER` set to a stage name, the
/// graph after that stage is printed to stderr.
fn run_stages(
    graph: &Graph,
    options: &PlanOptions,
    stop: Option<Stage>,
) -> Result<(Graph, Vec<FusionRecord>)> {
    graph.verify()?;
    let dump = match rlx_ir::env::Switch::DumpAfter.value() {
        Some(name) => Some(name.trim().parse::<Stage>()?),
        None => None,
    };
    let mut graph = graph.clone();
    let mut fusions: Vec<FusionRecord> = Vec::new();
    let f = &options.fusion;
    for stage in Stage::ALL {
        let fused = match stage {
            Stage::Decompose if options.native != rlx_ir::decompose::NativeOps::All => {
                graph = rlx_ir::decompose::decompose_graph(&graph, &|op| options.native.runs(op))?;
                None
            }
            Stage::Fold if options.simplify => {
                graph = crate::cse::fold_constants(&graph);
                None
            }
            Stage::Cse if options.simplify => {
                graph = crate::cse::eliminate_common_subexpressions(&graph);
                None
            }
            Stage::Dce => {
                graph = crate::dce::eliminate_dead_code(&graph).0;
                None
            }
            Stage::FuseAttention if f.attention_pattern => {
                Some(crate::fuse::fuse_attention_pattern(&graph))
            }
            Stage::FuseAttentionLayout if f.attention_layout => {
                Some(crate::fuse::fuse_attention_layout(&graph))
            }
            Stage::FuseActivations if f.activations => {
                absorb(
                    crate::recognize::recognize_activations(&graph, &|op| options.native.runs(op)),
                    &mut graph,
                    &mut fusions,
                );
                absorb(
                    crate::recognize::recognize_rms_norms(&graph, &|op| options.native.runs(op)),
                    &mut graph,
                    &mut fusions,
                );
                Some(crate::recognize::activations_before_reshapes(&graph))
            }
            Stage::FuseHoist if f.hoist_gathered_matmuls => {
                // Gathered products first: the product they hoist may read a slice.
                absorb(
                    crate::hoist::hoist_gathered_matmuls(&graph),
                    &mut graph,
                    &mut fusions,
                );
                // The gathers it replaced still read the slice until they are removed.
                drop_dead(&mut graph, &mut fusions);
                Some(crate::hoist::hoist_sliced_matmuls(&graph))
            }
            Stage::FuseEpilogue if f.matmul_epilogue || f.conv_epilogue => {
                Some(crate::fuse::fuse_epilogues(
                    &graph,
                    f.matmul_epilogue,
                    f.conv_epilogue,
                    f.transposed_operands,
                ))
            }
            Stage::FuseShare if f.elementwise_regions => {
                Some(crate::fuse::duplicate_shared_leaves(&graph))
            }
            Stage::FuseRegions if f.elementwise_regions => {
                Some(crate::fuse::fuse_elementwise_regions(&graph))
            }
            Stage::DceFused => {
                // Transposes whose only reader was fused away are dead now.
                drop_dead(&mut graph, &mut fusions);
                None
            }
            _ => None,
        };
        if let Some(fused) = fused {
            absorb(fused, &mut graph, &mut fusions);
        }
        if cfg!(debug_assertions) {
            graph.verify().map_err(|e| {
                Error::invalid(
                    "pipeline",
                    format!("the graph after stage {stage} does not verify: {e}"),
                )
            })?;
        }
        if dump == Some(stage) {
            eprintln!("after {stage}: {graph}");
        }
        if stop == Some(stage) {
            break;
        }
    }
    Ok((graph, fusions))
}

/// Takes a fusion pass's result as the graph, with the earlier fusion records moved
/// to the new node ids and the pass's own added.
fn absorb(fused: crate::fuse::Fused, graph: &mut Graph, fusions: &mut Vec<FusionRecord>) {
    for r in fusions.iter_mut() {
        r.node = fused.remap[r.node.index()];
    }
    *graph = fused.graph;
    fusions.extend(fused.records);
}

/// Removes dead nodes, moving the fusion records to the new node ids.
fn drop_dead(graph: &mut Graph, fusions: &mut [FusionRecord]) {
    let (live, remap) = crate::dce::eliminate_dead_code(graph);
    for r in fusions.iter_mut() {
        r.node = remap[r.node.index()].unwrap_or(r.node);
    }
    *graph = live;
}

/// Runs the pipeline on `graph`: verify, constant folding and CSE (if
/// `options.simplify`), dead-code elimination, the fusions in `options.fusion`, verify,
/// schedule, memory plan.
pub fn plan_graph(graph: &Graph, options: &PlanOptions) -> Result<Plan> {
    let (graph, fusions) = run_stages(graph, options, None)?;
    graph.verify()?;
    // What is left must run natively: a primitive the backend lacks is an error.
    if let Some(n) = graph.nodes().iter().find(|n| !options.native.runs(&n.op)) {
        return Err(Error::Unsupported {
            device: "this backend".into(),
            what: format!("op {} (it has no decomposition)", n.op.name()),
        });
    }
    let order = crate::schedule::schedule(&graph)?;
    let mut plan = Planner::new(&graph, options)?.finish(graph.clone(), order)?;
    plan.fusions = fusions;
    Ok(plan)
}

struct Planner<'a> {
    graph: &'a Graph,
    options: &'a PlanOptions,
    inputs: Vec<Source>,
    params: Vec<Source>,
    handles: Vec<Source>,
}

impl<'a> Planner<'a> {
    fn new(graph: &'a Graph, options: &'a PlanOptions) -> Result<Planner<'a>> {
        let mut inputs = Vec::new();
        let mut params = Vec::new();
        let mut handles = Vec::new();
        for (name, node, shape) in graph.inputs() {
            let src = Source {
                name: name.clone(),
                node,
                shape: shape.clone(),
            };
            match options.handles.iter().find(|(n, _)| *n == name) {
                Some((_, hs)) if *hs != shape => {
                    return Err(Error::ShapeMismatch {
                        op: format!("bind_handle '{name}'"),
                        lhs: shape,
                        rhs: hs.clone(),
                        reason: "the handle's shape must equal the input's".into(),
                    });
                }
                Some(_) => handles.push(src),
                None => inputs.push(src),
            }
        }
        for (name, _) in &options.handles {
            if !handles.iter().any(|h| h.name == *name) {
                return Err(Error::UnknownName {
                    kind: "input",
                    name: name.clone(),
                    known: inputs.iter().map(|s| s.name.clone()).collect(),
                });
            }
        }
        for (name, node, shape) in graph.params() {
            params.push(Source { name, node, shape });
        }
        Ok(Planner {
            graph,
            options,
            inputs,
            params,
            handles,
        })
    }

    fn finish(self, graph: Graph, order: Vec<usize>) -> Result<Plan> {
        let nodes = self.graph.nodes();
        let n = nodes.len();
        let end = n + 1;
        let mut time = vec![0usize; n];
        for (pos, &i) in order.iter().enumerate() {
            time[i] = pos + 1;
        }
        let mut consumers: Vec<Vec<usize>> = vec![Vec::new(); n];
        for (i, node) in nodes.iter().enumerate() {
            for id in &node.inputs {
                consumers[id.index()].push(i);
            }
        }
        let is_view: Vec<bool> = nodes
            .iter()
            .map(|node| {
                node.inputs
                    .first()
                    .is_some_and(|x| view_offset(&node.op, &nodes[x.index()].shape).is_some())
            })
            .collect();
        // Last step at which each value is read (through views), or `end` for outputs.
        let outputs = self.graph.outputs();
        let mut last_use = vec![0usize; n];
        for &i in order.iter().rev() {
            let mut last = time[i];
            for &c in &consumers[i] {
                last = last.max(if is_view[c] { last_use[c] } else { time[c] });
            }
            if outputs.iter().any(|o| o.index() == i) {
                last = end;
            }
            last_use[i] = last;
        }

        let placed = if self.options.fusion.concat_in_place {
            placed_in_concats(&nodes, &consumers, &is_view, &outputs)
        } else {
            vec![None; n]
        };
        // A concat with operands placed in it lives from the first one's step.
        let mut first_write: Vec<Option<usize>> = vec![None; n];
        for (i, p) in placed.iter().enumerate() {
            if let Some((c, _)) = *p {
                first_write[c] = Some(first_write[c].map_or(time[i], |t: usize| t.min(time[i])));
            }
        }

        let mut root = vec![0usize; n];
        let mut locations = vec![
            Location {
                region: Region::Arena,
                offset: 0
            };
            n
        ];
        let mut group_last = vec![0usize; n];
        let mut in_place = vec![false; n];
        let mut transient = 0usize;
        for &i in &order {
            let node = &nodes[i];
            let shape = &node.shape;
            let source_region = match &node.op {
                Op::Input { name } => self
                    .handles
                    .iter()
                    .position(|h| h.name == *name)
                    .map(Region::Handle),
                Op::Param { name } => self
                    .params
                    .iter()
                    .position(|p| p.name == *name)
                    .map(Region::Param),
                Op::Constant { id } => Some(Region::Constant(*id)),
                _ => None,
            };
            if let Some(region) = source_region {
                root[i] = i;
                locations[i] = Location { region, offset: 0 };
                continue;
            }
            if matches!(node.op, Op::Input { .. }) {
                root[i] = i;
                group_last[i] = last_use[i];
                transient = transient.saturating_add(shape.byte_size());
                continue;
            }
            if let Op::WriteAt { .. } = node.op {
                let t = node.inputs[0].index();
                if !matches!(locations[t].region, Region::Handle(_)) {
                    return Err(Error::InvalidGraph {
                        graph: graph.name().into(),
                        node: format!("%{i}"),
                        message: "write_at target is not bound as a persistent handle (CompileOptions::bind_handle)".into(),
                    });
                }
                root[i] = root[t];
                locations[i] = locations[t];
                continue;
            }
            if let Some((c, offset)) = placed[i] {
                // Written straight into its range of the concat's output (or, for
                // a hosted concat, already there), which lives as long as it is read.
                root[i] = c;
                group_last[c] = group_last[c].max(last_use[i]);
                locations[i] = Location {
                    region: Region::Arena,
                    offset,
                };
                transient = transient.saturating_add(shape.byte_size());
                continue;
            }
            if is_view[i] {
                let src = node.inputs[0].index();
                let delta = view_offset(&node.op, &nodes[src].shape).unwrap_or(0);
                root[i] = root[src];
                locations[i] = Location {
                    region: locations[src].region,
                    offset: locations[src].offset + delta,
                };
                if locations[i].region == Region::Arena {
                    group_last[root[i]] = group_last[root[i]].max(last_use[i]);
                }
                continue;
            }
            if self.options.in_place && node.op.is_elementwise() {
                let candidate = node.inputs.iter().map(|x| x.index()).find(|&x| {
                    let r = root[x];
                    nodes[x].shape.dims() == shape.dims()
                        && nodes[x].shape.dtype().size_in_bytes() == shape.dtype().size_in_bytes()
                        && locations[x].region == Region::Arena
                        && locations[x].offset == locations[r].offset
                        && nodes[r].shape.byte_size() == shape.byte_size()
                        && group_last[r] <= time[i]
                        // Another operand reading the same bytes at other positions (a
                        // broadcast view of this value) would see overwritten elements.
                        && node.inputs.iter().all(|y| {
                            let y = y.index();
                            root[y] != r || (nodes[y].shape.dims() == shape.dims() && locations[y].offset == locations[x].offset)
                        })
                });
                if let Some(x) = candidate {
                    let r = root[x];
                    root[i] = r;
                    group_last[r] = group_last[r].max(last_use[i]);
                    in_place[i] = true;
                    transient = transient.saturating_add(shape.byte_size());
                    continue;
                }
            }
            root[i] = i;
            group_last[i] = group_last[i].max(last_use[i]);
            transient = transient.saturating_add(shape.byte_size());
        }

        // Place every arena root.
        let arena_roots: Vec<usize> = (0..n)
            .filter(|&i| {
                root[i] == i
                    && locations[i].region == Region::Arena
                    && !is_view[i]
                    && !matches!(nodes[i].op, Op::WriteAt { .. })
            })
            .collect();
        let lifetimes: Vec<Lifetime> = arena_roots
            .iter()
            .map(|&r| {
                let start = if matches!(nodes[r].op, Op::Input { .. }) {
                    0
                } else {
                    first_write[r].map_or(time[r], |t| t.min(time[r]))
                };
                Lifetime {
                    size: nodes[r].shape.byte_size(),
                    start,
                    end: group_last[r].max(start),
                }
            })
            .collect();
        let assignment = assign_offsets(&lifetimes, ARENA_ALIGN, self.options.memory_reuse)?;
        let mut root_offset = vec![0usize; n];
        for (k, &r) in arena_roots.iter().enumerate() {
            root_offset[r] = assignment.offsets[k];
        }
        for &i in &order {
            if locations[i].region == Region::Arena {
                locations[i].offset += root_offset[root[i]];
            }
        }
        let stats = MemoryStats {
            arena_bytes: assignment.arena_bytes,
            transient_bytes: transient,
            lower_bound: assignment.lower_bound,
            views: is_view.iter().filter(|&&v| v).count(),
            in_place: in_place.iter().filter(|&&v| v).count(),
        };
        let schedule = order
            .iter()
            .copied()
            .filter(|&i| !is_view[i] && !nodes[i].op.is_source())
            .map(NodeId::from_index)
            .collect();
        let arena_values = arena_roots
            .iter()
            .enumerate()
            .map(|(k, &r)| (NodeId::from_index(r), lifetimes[k], assignment.offsets[k]))
            .collect();
        let shapes = nodes.iter().map(|n| n.shape.clone()).collect();
        drop(nodes);
        Ok(Plan {
            fusions: Vec::new(),
            shapes,
            outputs: graph.outputs(),
            graph,
            schedule,
            locations,
            is_view,
            is_in_place: in_place,
            inputs: self.inputs,
            params: self.params,
            handles: self.handles,
            stats,
            arena_roots: arena_values,
        })
    }
}

/// For each node, the concat whose output it lives in and its byte offset there.
///
/// A concat qualifies when its axes before the joined one have size 1, so each
/// operand is one contiguous range of its output. A concat whose operands are a
/// contiguous run of a larger one's (DenseNet's `cat(x0, x1)`, `cat(x0, x1, x2)`,
/// ...) is hosted by the one with the most operands that holds them: its operands
/// are placed there, and it lives there too when all of them are, so its step
/// copies nothing. Each other qualifying concat hosts itself.
///
/// An operand is placed in the host of the first concat that reads it, when a
/// kernel computes it (not a source, a view or another concat) and it is not a
/// graph output; its other readers, concats hosted elsewhere included, read it
/// there. A concat that reads one operand twice copies the second.
fn placed_in_concats(
    nodes: &[Node],
    consumers: &[Vec<usize>],
    is_view: &[bool],
    outputs: &[NodeId],
) -> Vec<Option<(usize, usize)>> {
    let is_output = |i: usize| outputs.iter().any(|o| o.index() == i);
    // The joined axis of a concat whose operands are contiguous ranges.
    let joins = |c: usize| -> Option<usize> {
        let Op::Concat { axis } = nodes[c].op else {
            return None;
        };
        let dims = nodes[c].shape.dims();
        (!is_view[c] && dims[..axis].iter().all(|&d| d == 1)).then_some(axis)
    };
    // Byte offset of operand `k`'s range in concat `c` (joined along `axis`).
    let offset_of = |c: usize, axis: usize, k: usize| -> usize {
        let node = &nodes[c];
        let inner: usize = node.shape.dims()[axis + 1..].iter().product();
        let before: usize = node.inputs[..k]
            .iter()
            .map(|x| {
                nodes[x.index()]
                    .shape
                    .dims()
                    .get(axis)
                    .copied()
                    .unwrap_or(0)
            })
            .sum();
        before * inner * node.shape.dtype().size_in_bytes()
    };
    // Each qualifying concat's host and the operand of the host its run starts at.
    let mut home: Vec<Option<(usize, usize)>> = vec![None; nodes.len()];
    for (d, node) in nodes.iter().enumerate() {
        let Some(axis) = joins(d) else {
            continue;
        };
        home[d] = Some((d, 0));
        let run = node.inputs.as_slice();
        if is_output(d) || run.is_empty() {
            continue;
        }
        // Any concat holding the run reads its first operand.
        for &e in &consumers[run[0].index()] {
            let bigger = &nodes[e];
            let larger_than_best =
                home[d].is_none_or(|(h, _)| bigger.inputs.len() > nodes[h].inputs.len());
            if e == d
                || joins(e) != Some(axis)
                || bigger.shape.dtype() != node.shape.dtype()
                || !larger_than_best
            {
                continue;
            }
            if let Some(j) = bigger.inputs.windows(run.len()).position(|w| w == run) {
                home[d] = Some((e, j));
            }
        }
    }
    let mut placed = vec![None; nodes.len()];
    for (c, node) in nodes.iter().enumerate() {
        let Some((host, first)) = home[c] else {
            continue;
        };
        let axis = joins(c).unwrap_or(0);
        for (k, x) in node.inputs.iter().enumerate() {
            let x = x.index();
            let operand = &nodes[x];
            let fits = !operand.op.is_source()
                && !matches!(operand.op, Op::Concat { .. } | Op::WriteAt { .. })
                && !is_view[x]
                && operand.shape.dtype() == node.shape.dtype()
                && placed[x].is_none()
                && !is_output(x);
            if fits {
                placed[x] = Some((host, offset_of(host, axis, first + k)));
            }
        }
    }
    // A hosted concat lives in its host when each of its operands lies there at
    // its place in the run.
    for (d, node) in nodes.iter().enumerate() {
        let Some((host, first)) = home[d] else {
            continue;
        };
        if host == d {
            continue;
        }
        let axis = joins(d).unwrap_or(0);
        let all_in_place = node
            .inputs
            .iter()
            .enumerate()
            .all(|(k, x)| placed[x.index()] == Some((host, offset_of(host, axis, first + k))));
        if all_in_place {
            placed[d] = Some((host, offset_of(host, axis, first)));
        }
    }
    placed
}

/// If `op` applied to a value of `src` shape can be a view, its byte offset into the
/// source: reshapes always, slices when the selected elements are contiguous, and
/// permutes that move only axes of size 1 (a `[1, 197, 768]` to `[197, 1, 768]`
/// between a batch-first model and its sequence-first attention), whose values
/// keep their order.
pub fn view_offset(op: &Op, src: &Shape) -> Option<usize> {
    match op {
        Op::Reshape { .. } => Some(0),
        Op::Slice { axes } => contiguous_slice_offset(axes, src),
        Op::Permute { perm } if moves_only_unit_axes(perm, src) => Some(0),
        _ => None,
    }
}

/// Whether permuting `src` by `perm` keeps its axes longer than 1 in order.
pub(crate) fn moves_only_unit_axes(perm: &[usize], src: &Shape) -> bool {
    let dims = src.dims();
    perm.len() == dims.len()
        && perm
            .iter()
            .filter(|&&axis| dims.get(axis).is_some_and(|&d| d != 1))
            .is_sorted()
}

fn contiguous_slice_offset(axes: &[SliceAxis], src: &Shape) -> Option<usize> {
    if axes.iter().any(|a| a.len == 0) {
        return Some(0);
    }
    let dims = src.dims();
    // Contiguous iff: single indices on the leading axes, then one axis with step 1,
    // then whole axes.
    if let Some(p) = axes.iter().position(|a| a.len != 1) {
        let whole = |k: usize| axes[k].start == 0 && axes[k].len == dims[k] && axes[k].step == 1;
        if axes[p].step != 1 || !(p + 1..axes.len()).all(whole) {
            return None;
        }
    }
    let strides = src.strides();
    let elems: usize = axes.iter().zip(&strides).map(|(a, s)| a.start * s).sum();
    Some(elems * src.dtype().size_in_bytes())
}
