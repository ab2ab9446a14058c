//! [`CompiledGraph`]: a graph compiled for one device, run many times.

use rlx_backend::Executable;
use rlx_driver::convert::{bytes_to_f32, bytes_to_f32_vec, f32_to_bytes, f32_to_vec};
use rlx_driver::{BufferHandle, Device, Profile};
use rlx_ir::{DType, Error, Graph, NodeId, Result, Shape, TensorData, TensorRef};
use rlx_opt::{MemoryStats, Plan, Region};
use std::sync::Arc;

/// Why outputs cannot be read: no run has copied them to the host yet.
const NO_HOST_OUTPUTS: &str =
    "no outputs on the host: the graph has not run yet, or its last run left them on the device";

/// A compiled graph with its own memory. Every fallible call checks its arguments
/// completely before writing anything, so a rejected call leaves the graph usable.
pub struct CompiledGraph {
    device: Device,
    plan: Arc<Plan>,
    exe: Box<dyn Executable>,
    param_set: Vec<bool>,
    pending: bool,
    has_run: bool,
    /// Every node's shape as runs see it: the plan's, or fewer rows after
    /// [`CompiledGraph::set_active_extent`].
    shapes: Vec<Shape>,
    /// The rows set by `set_active_extent`, if any.
    active_rows: Option<usize>,
    /// The inputs they were set for.
    active_inputs: Vec<NodeId>,
}

impl Clone for CompiledGraph {
    fn clone(&self) -> Self {
        CompiledGraph {
            device: self.device,
            plan: self.plan.clone(),
            exe: self.exe.clone_box(),
            param_set: self.param_set.clone(),
            pending: self.pending,
            has_run: self.has_run,
            shapes: self.shapes.clone(),
            active_rows: self.active_rows,
            active_inputs: self.active_inputs.clone(),
        }
    }
}

impl std::fmt::Debug for CompiledGraph {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "CompiledGraph({} on {}, {})",
            self.plan.graph.name(),
            self.device,
            self.plan.stats
        )
    }
}

/// Outputs of [`CompiledGraph::run_slots`], borrowed from the graph's memory.
#[derive(Debug)]
pub struct SlotOutputs<'a> {
    graph: &'a CompiledGraph,
}

impl<'a> SlotOutputs<'a> {
    /// Number of outputs.
    pub fn len(&self) -> usize {
        self.graph.plan.outputs.len()
    }

    /// True when the graph has no outputs.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Output `i` as `f32` values (the output's dtype must be `f32`).
    pub fn get(&self, i: usize) -> Result<&'a [f32]> {
        let shape = self.graph.output_shape(i)?;
        if shape.dtype() != DType::F32 {
            return Err(Error::dtype(
                format!("output {i} (use bytes() for other dtypes)"),
                "f32",
                shape.dtype(),
            ));
        }
        let bytes = self.bytes(i)?;
        // SAFETY: `f32` has no invalid bit patterns; `align_to` only yields the
        // correctly aligned middle part, checked to be the whole slice below.
        let (head, values, tail) = unsafe { bytes.align_to::<f32>() };
        if !head.is_empty() || !tail.is_empty() {
            return Err(Error::runtime(
                "run_slots",
                format!("output {i} is not 4-byte aligned"),
            ));
        }
        Ok(values)
    }

    /// Output `i` as raw little-endian bytes of its dtype.
    pub fn bytes(&self, i: usize) -> Result<&'a [u8]> {
        self.graph.output_bytes(i)
    }

    /// Byte offset of output `i` from [`SlotOutputs::arena_ptr`], when it lives in the
    /// arena.
    pub fn offset(&self, i: usize) -> Option<usize> {
        let node = self.graph.output_node(i).ok()?;
        let loc = self.graph.plan.locations[node.index()];
        (loc.region == Region::Arena).then_some(loc.offset)
    }

    /// Base address of the arena when it is host memory.
    pub fn arena_ptr(&self) -> Option<*const u8> {
        self.graph.exe.arena_ptr()
    }
}

/// Where each provided named input goes: checked before anything is written.
fn match_named<T>(
    plan: &Plan,
    shapes: &[Shape],
    inputs: &[(&str, T)],
    mut check: impl FnMut(&str, &Shape, &T) -> Result<()>,
) -> Result<()> {
    for (k, (name, value)) in inputs.iter().enumerate() {
        let Some(src) = plan.inputs.iter().find(|s| s.name == *name) else {
            if plan.handles.iter().any(|h| h.name == *name) {
                return Err(Error::invalid(
                    format!("input '{name}'"),
                    "is a persistent handle; use write_handle instead of passing it to run",
                ));
            }
            return Err(Error::UnknownName {
                kind: "input",
                name: name.to_string(),
                known: plan.inputs.iter().map(|s| s.name.clone()).collect(),
            });
        };
        if inputs[..k].iter().any(|(n, _)| n == name) {
            return Err(Error::DuplicateName {
                kind: "input",
                name: name.to_string(),
            });
        }
        check(name, &shapes[src.node.index()], value)?;
    }
    if let Some(missing) = plan
        .inputs
        .iter()
        .find(|s| !inputs.iter().any(|(n, _)| *n == s.name))
    {
        return Err(Error::MissingInput {
            name: missing.name.clone(),
            shape: shapes[missing.node.index()].clone(),
        });
    }
    Ok(())
}

fn check_count(
    kind: &'static str,
    name: &str,
    expected: usize,
    got: usize,
    unit: &'static str,
) -> Result<()> {
    if expected != got {
        return Err(Error::LengthMismatch {
            kind,
            name: name.to_string(),
            expected,
            got,
            unit,
        });
    }
    Ok(())
}

impl CompiledGraph {
    pub(crate) fn new(device: Device, plan: Arc<Plan>, exe: Box<dyn Executable>) -> CompiledGraph {
        let params = plan.params.len();
        let shapes = plan.shapes.clone();
        CompiledGraph {
            device,
            plan,
            exe,
            param_set: vec![false; params],
            pending: false,
            has_run: false,
            shapes,
            active_rows: None,
            active_inputs: Vec::new(),
        }
    }

    /// The device it runs on.
    pub fn device(&self) -> Device {
        self.device
    }

    /// The optimized graph.
    pub fn graph(&self) -> &Graph {
        &self.plan.graph
    }

    /// The execution plan (schedule and memory locations).
    pub fn plan(&self) -> &Plan {
        &self.plan
    }

    /// Memory figures of the plan.
    pub fn memory_stats(&self) -> MemoryStats {
        self.plan.stats
    }

    /// `(node, kernel)` for every kernel a run launches, in order.
    pub fn kernels(&self) -> Vec<(NodeId, String)> {
        self.exe.kernels()
    }

    /// Names and shapes of the run-time inputs, in the order `run_slots` takes them
    /// (with fewer rows after [`CompiledGraph::set_active_extent`]).
    pub fn inputs(&self) -> Vec<(String, Shape)> {
        self.plan
            .inputs
            .iter()
            .map(|s| (s.name.clone(), self.shapes[s.node.index()].clone()))
            .collect()
    }

    /// Names and shapes of the params.
    pub fn params(&self) -> Vec<(String, Shape)> {
        self.plan
            .params
            .iter()
            .map(|s| (s.name.clone(), s.shape.clone()))
            .collect()
    }

    /// Shapes of the outputs, in order (with fewer rows after
    /// [`CompiledGraph::set_active_extent`]).
    pub fn output_shapes(&self) -> Vec<Shape> {
        self.plan
            .outputs
            .iter()
            .map(|&o| self.shapes[o.index()].clone())
            .collect()
    }

    /// Runs later calls on the first `rows` rows (dimension 0) of the inputs named,
    /// instead of the rows they were compiled with: inputs then take, and outputs
    /// computed from them give, that many rows, and kernels do that much work in the
    /// same memory. It works when every value computed from those inputs keeps its
    /// rows apart (a batch: no reduction, slice or concatenation along dimension 0;
    /// products by weights, or batched products of two values of the same batch);
    /// `rows` equal to the compiled count restores the compiled shapes. Outputs of
    /// an earlier run are no longer readable afterwards (their shapes changed).
    ///
    /// # Errors
    /// An unknown input, inputs with different first dims, `rows` of 0 or above the
    /// compiled count, or a node that mixes rows (named with its op); a backend that
    /// cannot change shapes. Nothing changes then.
    pub fn set_active_extent(&mut self, inputs: &[&str], rows: usize) -> Result<()> {
        let mut ids = Vec::with_capacity(inputs.len());
        for name in inputs {
            let src = self
                .plan
                .inputs
                .iter()
                .find(|s| s.name == *name)
                .ok_or_else(|| Error::UnknownName {
                    kind: "input",
                    name: name.to_string(),
                    known: self.plan.inputs.iter().map(|s| s.name.clone()).collect(),
                })?;
            ids.push(src.node);
        }
        if self.active_rows == Some(rows) && self.active_inputs == ids {
            return Ok(());
        }
        let shapes = rlx_opt::extent::active_shapes(&self.plan, &ids, rows)?;
        self.exe.set_active_rows(&ids, rows)?;
        self.active_rows = (self.planned_rows(&ids) != Some(rows)).then_some(rows);
        self.active_inputs = if self.active_rows.is_some() {
            ids
        } else {
            Vec::new()
        };
        self.shapes = shapes;
        // Outputs of an earlier run had other shapes.
        self.has_run = false;
        Ok(())
    }

    /// Back to the compiled shapes after [`CompiledGraph::set_active_extent`].
    ///
    /// # Errors
    /// A backend that cannot change shapes (only when an extent is set).
    pub fn clear_active_extent(&mut self) -> Result<()> {
        if self.active_rows.is_none() {
            return Ok(());
        }
        let inputs = std::mem::take(&mut self.active_inputs);
        let planned = self.planned_rows(&inputs).unwrap_or(0);
        if let Err(e) = self.exe.set_active_rows(&inputs, planned) {
            self.active_inputs = inputs;
            return Err(e);
        }
        self.shapes = self.plan.shapes.clone();
        self.active_rows = None;
        self.has_run = false;
        Ok(())
    }

    /// The rows `inputs` were compiled with (dimension 0 of the first).
    fn planned_rows(&self, inputs: &[NodeId]) -> Option<usize> {
        inputs
            .first()
            .and_then(|id| self.plan.shape(*id).dims().first().copied())
    }

    /// The rows set by [`CompiledGraph::set_active_extent`], while fewer than compiled.
    pub fn active_extent(&self) -> Option<usize> {
        self.active_rows
    }

    /// Output `i`'s bytes as runs see its shape.
    fn output_bytes(&self, i: usize) -> Result<&[u8]> {
        let node = self.output_node(i)?;
        let bytes = self.exe.value_bytes(node)?;
        let len = self.shapes[node.index()].byte_size();
        bytes.get(..len).ok_or_else(|| {
            Error::runtime("output", format!("output {i} is shorter than its shape"))
        })
    }

    fn output_node(&self, i: usize) -> Result<NodeId> {
        self.plan
            .outputs
            .get(i)
            .copied()
            .ok_or_else(|| Error::UnknownName {
                kind: "output",
                name: i.to_string(),
                known: (0..self.plan.outputs.len())
                    .map(|k| k.to_string())
                    .collect(),
            })
    }

    fn output_shape(&self, i: usize) -> Result<&Shape> {
        Ok(&self.shapes[self.output_node(i)?.index()])
    }

    fn param_index(&self, name: &str) -> Result<usize> {
        self.plan
            .params
            .iter()
            .position(|p| p.name == name)
            .ok_or_else(|| Error::UnknownName {
                kind: "param",
                name: name.to_string(),
                known: self.plan.params.iter().map(|p| p.name.clone()).collect(),
            })
    }

    fn handle_index(&self, name: &str) -> Result<usize> {
        self.plan
            .handles
            .iter()
            .position(|h| h.name == name)
            .ok_or_else(|| Error::UnknownName {
                kind: "handle",
                name: name.to_string(),
                known: self.plan.handles.iter().map(|h| h.name.clone()).collect(),
            })
    }

    /// Sets a param from `f32` values, converted to the param's dtype.
    pub fn set_param(&mut self, name: &str, values: &[f32]) -> Result<()> {
        let i = self.param_index(name)?;
        let shape = &self.plan.params[i].shape;
        check_count(
            "param",
            name,
            shape.num_elements(),
            values.len(),
            "elements",
        )?;
        let bytes = f32_to_vec(values, shape.dtype());
        self.exe.set_param(i, &bytes)?;
        self.param_set[i] = true;
        Ok(())
    }

    /// Sets a param from data of exactly its dtype (no conversion).
    pub fn set_param_typed(&mut self, name: &str, values: TensorRef<'_>) -> Result<()> {
        let i = self.param_index(name)?;
        let shape = &self.plan.params[i].shape;
        if values.dtype() != shape.dtype() {
            return Err(Error::dtype(
                format!("param '{name}'"),
                shape.dtype().name(),
                values.dtype(),
            ));
        }
        check_count(
            "param",
            name,
            shape.num_elements(),
            values.len(),
            "elements",
        )?;
        self.exe.set_param(i, &values.to_le_bytes())?;
        self.param_set[i] = true;
        Ok(())
    }

    /// Sets a param from raw little-endian bytes of its dtype.
    pub fn set_param_bytes(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        let i = self.param_index(name)?;
        check_count(
            "param",
            name,
            self.plan.params[i].shape.byte_size(),
            bytes.len(),
            "bytes",
        )?;
        self.exe.set_param(i, bytes)?;
        self.param_set[i] = true;
        Ok(())
    }

    /// Turns per-kernel timing on (clearing earlier totals) or off. Profiling adds a
    /// clock read around every kernel; it allocates nothing per run.
    pub fn set_profiling(&mut self, on: bool) {
        self.exe.set_profiling(on)
    }

    /// With profiling on: the time of every kernel launch over the profiled runs.
    /// `None` when profiling is off.
    pub fn profile(&self) -> Option<Profile> {
        self.exe.profile()
    }

    /// Makes every param of this graph that `other` also has (same name) use
    /// `other`'s storage instead of its own, without copying: graphs compiled from
    /// one model at different shapes hold its weights once. A later `set_param` on
    /// either graph copies first, so the other is unaffected. Returns how many params
    /// are now shared. Fails, changing nothing, when a same-named param differs in
    /// shape or dtype or the graphs are on different devices.
    pub fn share_params_from(&mut self, other: &CompiledGraph) -> Result<usize> {
        self.same_device(other, "share_params_from")?;
        let mut pairs = Vec::new();
        for (i, mine) in self.plan.params.iter().enumerate() {
            let Some(j) = other.plan.params.iter().position(|p| p.name == mine.name) else {
                continue;
            };
            let theirs = &other.plan.params[j].shape;
            if *theirs != mine.shape {
                return Err(Error::ShapeMismatch {
                    op: format!("share_params_from (param '{}')", mine.name),
                    lhs: mine.shape.clone(),
                    rhs: theirs.clone(),
                    reason: "a shared param must have the same shape and dtype".into(),
                });
            }
            pairs.push((i, other.exe.export_param(j)?, other.param_set[j]));
        }
        for (i, param, set) in &pairs {
            self.exe.import_param(*i, param)?;
            self.param_set[*i] = *set;
        }
        Ok(pairs.len())
    }

    /// Errors unless `other` runs on this graph's device (for calls that share
    /// storage between graphs).
    fn same_device(&self, other: &CompiledGraph, op: &str) -> Result<()> {
        if other.device != self.device {
            return Err(Error::invalid(
                op,
                format!(
                    "graphs are on different devices ({} and {})",
                    self.device, other.device
                ),
            ));
        }
        Ok(())
    }

    fn check_params(&self) -> Result<()> {
        if let Some(i) = self.param_set.iter().position(|&s| !s) {
            let p = &self.plan.params[i];
            return Err(Error::ParamNotSet {
                name: p.name.clone(),
                shape: p.shape.clone(),
            });
        }
        Ok(())
    }

    fn execute(&mut self) -> Result<()> {
        self.exe.submit_with_outputs()?;
        self.exe.wait()?;
        self.exe.sync_outputs()?;
        self.has_run = true;
        Ok(())
    }

    /// Validates every named input with `check`, then writes each into its staging
    /// area with `write(value, dtype, staging)`. Nothing is written unless all pass.
    fn stage<T>(
        &mut self,
        inputs: &[(&str, T)],
        check: impl FnMut(&str, &Shape, &T) -> Result<()>,
        write: impl Fn(&T, DType, &mut [u8]) -> Result<()>,
    ) -> Result<()> {
        self.check_params()?;
        match_named(&self.plan, &self.shapes, inputs, check)?;
        for (name, value) in inputs {
            let slot = self
                .plan
                .inputs
                .iter()
                .position(|s| s.name == *name)
                .ok_or_else(|| {
                    Error::invalid("stage", format!("input '{name}' vanished after validation"))
                })?;
            let dtype = self.plan.inputs[slot].shape.dtype();
            write(value, dtype, self.staging(slot)?)?;
        }
        Ok(())
    }

    /// The staging bytes of input `slot` that its current shape covers.
    fn staging(&mut self, slot: usize) -> Result<&mut [u8]> {
        let len = self.shapes[self.plan.inputs[slot].node.index()].byte_size();
        self.exe
            .input_staging(slot)?
            .get_mut(..len)
            .ok_or_else(|| Error::runtime("stage", "an input's staging area is too small"))
    }

    fn stage_f32(&mut self, inputs: &[(&str, &[f32])]) -> Result<()> {
        self.stage(
            inputs,
            |name, shape, v| check_count("input", name, shape.num_elements(), v.len(), "elements"),
            |v, dtype, dst| f32_to_bytes(v, dtype, dst),
        )
    }

    /// Runs with named `f32` inputs (converted to each input's dtype) and returns every
    /// output as `f32`.
    pub fn run(&mut self, inputs: &[(&str, &[f32])]) -> Result<Vec<Vec<f32>>> {
        self.stage_f32(inputs)?;
        self.execute()?;
        self.read_outputs()
    }

    /// Runs with named inputs of exactly their dtypes; outputs come back in their own
    /// dtypes.
    pub fn run_typed(&mut self, inputs: &[(&str, TensorRef<'_>)]) -> Result<Vec<TensorData>> {
        self.stage_typed(inputs)?;
        self.execute()?;
        (0..self.plan.outputs.len())
            .map(|i| {
                let dtype = self.output_shape(i)?.dtype();
                TensorData::from_le_bytes(dtype, self.output_bytes(i)?)
            })
            .collect()
    }

    /// Runs with named inputs of exactly their dtypes and leaves the outputs where the
    /// device computed them: nothing is copied back (on the CPU they stay in memory).
    /// For results that a later step reads on the device, and for timing the
    /// device's work the way a framework returning device tensors is timed. The
    /// outputs are not readable on the host until a run that copies them.
    pub fn run_typed_on_device(&mut self, inputs: &[(&str, TensorRef<'_>)]) -> Result<()> {
        self.stage_typed(inputs)?;
        self.exe.submit()?;
        self.exe.wait()?;
        self.has_run = false;
        Ok(())
    }

    /// Stages named inputs of exactly their dtypes.
    fn stage_typed(&mut self, inputs: &[(&str, TensorRef<'_>)]) -> Result<()> {
        self.stage(
            inputs,
            |name, shape, v| {
                if v.dtype() != shape.dtype() {
                    return Err(Error::dtype(
                        format!("input '{name}'"),
                        shape.dtype().name(),
                        v.dtype(),
                    ));
                }
                check_count("input", name, shape.num_elements(), v.len(), "elements")
            },
            |v, _, dst| v.write_le_bytes(dst),
        )
    }

    /// Runs with named inputs as raw little-endian bytes; returns raw output bytes.
    pub fn run_raw(&mut self, inputs: &[(&str, &[u8])]) -> Result<Vec<Vec<u8>>> {
        self.stage(
            inputs,
            |name, shape, v| check_count("input", name, shape.byte_size(), v.len(), "bytes"),
            |v, _, dst| {
                dst.copy_from_slice(v);
                Ok(())
            },
        )?;
        self.execute()?;
        (0..self.plan.outputs.len())
            .map(|i| Ok(self.output_bytes(i)?.to_vec()))
            .collect()
    }

    /// The hot path: inputs by position (the order of [`CompiledGraph::inputs`]) as
    /// `f32`, outputs borrowed from the graph's memory. Allocates nothing.
    pub fn run_slots(&mut self, inputs: &[&[f32]]) -> Result<SlotOutputs<'_>> {
        self.check_params()?;
        check_count(
            "input",
            "(slots)",
            self.plan.inputs.len(),
            inputs.len(),
            "elements",
        )?;
        for (src, values) in self.plan.inputs.iter().zip(inputs) {
            check_count(
                "input",
                &src.name,
                self.shapes[src.node.index()].num_elements(),
                values.len(),
                "elements",
            )?;
        }
        for (k, values) in inputs.iter().enumerate() {
            let dtype = self.plan.inputs[k].shape.dtype();
            f32_to_bytes(values, dtype, self.staging(k)?)?;
        }
        self.execute()?;
        Ok(SlotOutputs { graph: self })
    }

    /// Runs and writes every output into the caller's buffers (each exactly the
    /// output's element count). Allocates nothing.
    pub fn run_read_outputs(
        &mut self,
        inputs: &[(&str, &[f32])],
        outputs: &mut [&mut [f32]],
    ) -> Result<()> {
        check_count(
            "output",
            "(buffers)",
            self.plan.outputs.len(),
            outputs.len(),
            "elements",
        )?;
        for (i, dst) in outputs.iter().enumerate() {
            let expected = self.output_shape(i)?.num_elements();
            if expected != dst.len() {
                return Err(Error::LengthMismatch {
                    kind: "output",
                    name: i.to_string(),
                    expected,
                    got: dst.len(),
                    unit: "elements",
                });
            }
        }
        self.stage_f32(inputs)?;
        self.execute()?;
        for (i, dst) in outputs.iter_mut().enumerate() {
            let dtype = self.plan.shape(self.plan.outputs[i]).dtype();
            bytes_to_f32(self.output_bytes(i)?, dtype, dst)?;
        }
        Ok(())
    }

    /// Every output of the last run as `f32`.
    pub fn read_outputs(&self) -> Result<Vec<Vec<f32>>> {
        if !self.has_run {
            return Err(Error::invalid("read_outputs", NO_HOST_OUTPUTS));
        }
        (0..self.plan.outputs.len())
            .map(|i| bytes_to_f32_vec(self.output_bytes(i)?, self.output_shape(i)?.dtype()))
            .collect()
    }

    /// Reads row `row` (an index into the first dimension) of output `output` from the
    /// last run into `dst`, which must hold exactly one row.
    pub fn read_output_row(&self, output: usize, row: usize, dst: &mut [f32]) -> Result<()> {
        let shape = self.output_shape(output)?;
        if !self.has_run {
            return Err(Error::invalid("read_output_row", NO_HOST_OUTPUTS));
        }
        let rows = *shape.dims().first().ok_or_else(|| {
            Error::invalid(
                "read_output_row",
                format!("output {output} is a scalar ({shape})"),
            )
        })?;
        if row >= rows {
            return Err(Error::invalid(
                "read_output_row",
                format!("row {row} out of range for output {output} {shape}"),
            ));
        }
        let row_len = shape.num_elements().checked_div(rows).unwrap_or(0);
        check_count("destination", "row", row_len, dst.len(), "elements")?;
        let size = shape.dtype().size_in_bytes();
        let bytes = self.output_bytes(output)?;
        bytes_to_f32(
            &bytes[row * row_len * size..(row + 1) * row_len * size],
            shape.dtype(),
            dst,
        )
    }

    /// Starts a run and returns without waiting for it (on the CPU the run completes
    /// before returning). Collect it with [`CompiledGraph::sync_pending`].
    pub fn commit_no_wait(&mut self, inputs: &[(&str, &[f32])]) -> Result<()> {
        if self.pending {
            return Err(Error::invalid(
                "commit_no_wait",
                "a run is already pending; call sync_pending first",
            ));
        }
        self.stage_f32(inputs)?;
        self.exe.submit_with_outputs()?;
        self.pending = true;
        Ok(())
    }

    /// Waits for the pending run, if any, and makes its outputs readable.
    pub fn sync_pending(&mut self) -> Result<()> {
        if std::mem::replace(&mut self.pending, false) {
            self.exe.wait()?;
            self.exe.sync_outputs()?;
            self.has_run = true;
        }
        Ok(())
    }

    /// Pipelined running: waits for the previous pending run, reads its outputs, then
    /// commits this one. Returns the previous run's outputs (`None` on the first call).
    pub fn run_pipelined(&mut self, inputs: &[(&str, &[f32])]) -> Result<Option<Vec<Vec<f32>>>> {
        let previous = if self.pending {
            self.sync_pending()?;
            Some(self.read_outputs()?)
        } else {
            None
        };
        self.commit_no_wait(inputs)?;
        Ok(previous)
    }

    /// Resets a persistent handle to zeros. `handle` must be one bound at compile time
    /// (same name and shape).
    pub fn bind_handle(&mut self, handle: &BufferHandle) -> Result<()> {
        let i = self.handle_index(&handle.name)?;
        let expected = &self.plan.handles[i].shape;
        if *expected != handle.shape {
            return Err(Error::ShapeMismatch {
                op: format!("bind_handle '{}'", handle.name),
                lhs: expected.clone(),
                rhs: handle.shape.clone(),
                reason: "the handle's shape must equal the one it was compiled with".into(),
            });
        }
        self.exe.write_handle(i, &vec![0u8; expected.byte_size()])
    }

    /// Replaces a persistent handle's contents with `f32` values (converted).
    pub fn write_handle(&mut self, name: &str, values: &[f32]) -> Result<()> {
        let i = self.handle_index(name)?;
        let shape = &self.plan.handles[i].shape;
        check_count(
            "handle",
            name,
            shape.num_elements(),
            values.len(),
            "elements",
        )?;
        self.exe.write_handle(i, &f32_to_vec(values, shape.dtype()))
    }

    /// Exchanges the storage of every persistent handle this graph shares a name with
    /// in `other` (no copy): a KV cache filled by a prefill graph moves to the decode
    /// graph and back. Returns how many handles were exchanged. Fails, changing
    /// nothing, when a same-named handle differs in shape or dtype or the graphs are
    /// on different devices.
    pub fn swap_handles(&mut self, other: &mut CompiledGraph) -> Result<usize> {
        let pairs = self.handle_pairs(other, "swap_handles")?;
        for &(i, j) in &pairs {
            let mine = self.exe.take_handle(i)?;
            let theirs = other.exe.take_handle(j)?;
            self.exe.put_handle(i, theirs)?;
            other.exe.put_handle(j, mine)?;
        }
        Ok(pairs.len())
    }

    /// Frees the storage of every persistent handle. The graph then refuses to run
    /// until handles are lent to it with [`CompiledGraph::borrow_handles`]: graphs
    /// that only ever run on another graph's state (a key/value cache) need no copy
    /// of their own.
    pub fn release_handles(&mut self) -> Result<()> {
        for i in 0..self.plan.handles.len() {
            drop(self.exe.take_handle(i)?);
        }
        Ok(())
    }

    /// Moves the storage of every handle `owner` shares a name with into this graph
    /// (no copy), after checking all their shapes; give it back with
    /// [`CompiledGraph::return_handles`]. Returns how many were moved. Fails,
    /// changing nothing, when a same-named handle differs in shape or dtype.
    pub fn borrow_handles(&mut self, owner: &mut CompiledGraph) -> Result<usize> {
        let pairs = self.handle_pairs(owner, "borrow_handles")?;
        for &(i, j) in &pairs {
            let storage = owner.exe.take_handle(j)?;
            self.exe.put_handle(i, storage)?;
        }
        Ok(pairs.len())
    }

    /// Moves borrowed handles back to `owner` (see
    /// [`CompiledGraph::borrow_handles`]); this graph is left without storage.
    pub fn return_handles(&mut self, owner: &mut CompiledGraph) -> Result<usize> {
        let pairs = self.handle_pairs(owner, "return_handles")?;
        for &(i, j) in &pairs {
            let storage = self.exe.take_handle(i)?;
            owner.exe.put_handle(j, storage)?;
        }
        Ok(pairs.len())
    }

    /// `(mine, theirs)` indices of the handles this graph shares a name with in
    /// `other`, all checked to have the same shape and dtype.
    fn handle_pairs(&self, other: &CompiledGraph, op: &str) -> Result<Vec<(usize, usize)>> {
        self.same_device(other, op)?;
        let mut pairs = Vec::new();
        for (i, mine) in self.plan.handles.iter().enumerate() {
            let Some(j) = other.plan.handles.iter().position(|h| h.name == mine.name) else {
                continue;
            };
            if other.plan.handles[j].shape != mine.shape {
                return Err(Error::ShapeMismatch {
                    op: format!("{op} (handle '{}')", mine.name),
                    lhs: mine.shape.clone(),
                    rhs: other.plan.handles[j].shape.clone(),
                    reason: "paired handles must have the same shape and dtype".into(),
                });
            }
            pairs.push((i, j));
        }
        Ok(pairs)
    }

    /// A persistent handle's contents as raw little-endian bytes of its dtype.
    pub fn read_handle_bytes(&self, name: &str) -> Result<Vec<u8>> {
        let i = self.handle_index(name)?;
        let mut bytes = vec![0u8; self.plan.handles[i].shape.byte_size()];
        self.exe.read_handle(i, &mut bytes)?;
        Ok(bytes)
    }

    /// Replaces a persistent handle's contents with raw little-endian bytes of its
    /// dtype (exactly its byte size).
    pub fn write_handle_bytes(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        let i = self.handle_index(name)?;
        let size = self.plan.handles[i].shape.byte_size();
        check_count("handle", name, size, bytes.len(), "bytes")?;
        self.exe.write_handle(i, bytes)
    }

    /// The names and shapes of the persistent handles.
    pub fn handles(&self) -> Vec<(String, Shape)> {
        self.plan
            .handles
            .iter()
            .map(|h| (h.name.clone(), h.shape.clone()))
            .collect()
    }

    /// A persistent handle's contents as `f32`.
    pub fn read_handle(&self, name: &str) -> Result<Vec<f32>> {
        let i = self.handle_index(name)?;
        let shape = &self.plan.handles[i].shape;
        let mut bytes = vec![0u8; shape.byte_size()];
        self.exe.read_handle(i, &mut bytes)?;
        bytes_to_f32_vec(&bytes, shape.dtype())
    }
}
