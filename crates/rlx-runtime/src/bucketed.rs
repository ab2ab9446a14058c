//! A compile cache over the bindings of a [`SymbolicGraph`]: each binding (or the
//! bucket it rounds up to) is compiled once, every compiled shape shares one copy of
//! the weights, and inputs of any size run padded up to their bucket.

use crate::symbolic::SymbolicGraph;
use crate::{CompileOptions, CompiledGraph, Session};
use rlx_ir::{Bindings, Error, Result, Shape, TensorData, TensorRef};
use std::collections::BTreeMap;

/// How a symbol's sizes round up to the sizes that get compiled.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Buckets {
    /// Every size is compiled as it is.
    Exact,
    /// Up to the next multiple of this step.
    Multiple(usize),
    /// Up to the next power of two.
    PowersOfTwo,
    /// Up to the least listed size that holds it (the size itself past the largest).
    Sizes(Vec<usize>),
}

impl Buckets {
    /// The size `n` rounds up to, never past `max` and never below `n`.
    pub fn round(&self, n: usize, max: usize) -> usize {
        let up = match self {
            Buckets::Exact => n,
            Buckets::Multiple(step) => n.div_ceil((*step).max(1)).saturating_mul((*step).max(1)),
            Buckets::PowersOfTwo => n.checked_next_power_of_two().unwrap_or(n),
            Buckets::Sizes(sizes) => sizes.iter().copied().filter(|&s| s >= n).min().unwrap_or(n),
        };
        up.min(max).max(n)
    }
}

struct Entry {
    bindings: Bindings,
    graph: CompiledGraph,
    last_used: u64,
}

/// Compiled shapes of one [`SymbolicGraph`], sharing its weights.
///
/// The graph at the least binding (every symbol at its minimum) is compiled first and
/// owns the params and persistent handles; every other binding is compiled on first
/// use, shares the owner's params without copying, and holds no handle storage of its
/// own: it borrows the owner's for the length of a run (so a graph with persistent
/// handles runs through [`BucketedCompileCache::run_with`] or `run_padded`). At most
/// `capacity` other bindings are kept; the one used least recently is dropped first.
///
/// ```
/// use rlx_ir::{Bindings, DType, Dim, Graph, Shape, SymbolicShape, TensorData, TensorRef};
/// use rlx_runtime::{Buckets, BucketedCompileCache, CompileOptions, Device, Session,
///     SymbolRange, SymbolicGraph};
/// let rows = || SymbolicShape::new([Dim::sym("rows"), Dim::Fixed(2)], DType::F32);
/// let graph = SymbolicGraph::new(
///     "scale",
///     vec![SymbolRange::new("rows", 1, 64)],
///     vec![("x".into(), rows())],
///     vec![rows()],
///     |b: &Bindings| {
///         let g = Graph::new("scale");
///         let x = g.input("x", Shape::new(&[b.require("rows", "scale")?, 2], DType::F32))?;
///         let w = g.param("w", Shape::new(&[2], DType::F32))?;
///         let y = g.mul(x, w)?;
///         g.set_outputs(vec![y]);
///         Ok(g)
///     },
/// )?;
/// let mut cache =
///     BucketedCompileCache::new(graph, Session::new(Device::Cpu), CompileOptions::new())?
///         .with_buckets("rows", Buckets::PowersOfTwo)?;
/// cache.set_param("w", &[10.0, 100.0])?;
/// // Three rows run in the bucket of four; only the three real rows come back.
/// let three = Bindings::new().with("rows", 3)?;
/// let out = cache.run_padded(&three, &[("x", TensorRef::F32(&[1., 2., 3., 4., 5., 6.]))])?;
/// assert_eq!(out[0], TensorData::F32(vec![10., 200., 30., 400., 50., 600.]));
/// assert_eq!(cache.bucket(&three)?.get("rows"), Some(4));
/// # Ok::<(), rlx_ir::Error>(())
/// ```
pub struct BucketedCompileCache {
    graph: SymbolicGraph,
    session: Session,
    options: CompileOptions,
    buckets: BTreeMap<String, Buckets>,
    owner_bindings: Bindings,
    owner: CompiledGraph,
    entries: Vec<Entry>,
    capacity: usize,
    clock: u64,
    /// The symbol every input with a symbolic dimension 0 has there, and those
    /// inputs: runs short of the bucket along it use the active extent, not padding.
    leading: Option<(String, Vec<String>)>,
    /// Buckets whose graphs mix rows of the leading symbol (padded instead).
    mixes_rows: Vec<Bindings>,
}

impl std::fmt::Debug for BucketedCompileCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "BucketedCompileCache({}, {} compiled)",
            self.graph,
            self.entries.len() + 1
        )
    }
}

/// Other bindings kept compiled by default.
const DEFAULT_CAPACITY: usize = 8;

impl BucketedCompileCache {
    /// A cache over `graph`, compiling the least binding now (it owns the weights).
    pub fn new(
        graph: SymbolicGraph,
        session: Session,
        options: CompileOptions,
    ) -> Result<BucketedCompileCache> {
        let owner_bindings = graph.least_binding();
        let owner = session.compile_with(graph.specialize(&owner_bindings)?, &options)?;
        let leading = leading_symbol(&graph);
        Ok(BucketedCompileCache {
            graph,
            session,
            options,
            buckets: BTreeMap::new(),
            owner_bindings,
            owner,
            entries: Vec::new(),
            capacity: DEFAULT_CAPACITY,
            clock: 0,
            leading,
            mixes_rows: Vec::new(),
        })
    }

    /// Sets how `symbol` rounds up (every symbol is [`Buckets::Exact`] until set).
    pub fn with_buckets(mut self, symbol: &str, buckets: Buckets) -> Result<Self> {
        if !self.graph.symbols().iter().any(|s| s.name == symbol) {
            return Err(Error::UnknownName {
                kind: "symbol",
                name: symbol.to_string(),
                known: self
                    .graph
                    .symbols()
                    .iter()
                    .map(|s| s.name.clone())
                    .collect(),
            });
        }
        if matches!(buckets, Buckets::Multiple(0)) {
            return Err(Error::invalid(
                format!("buckets of '{symbol}'"),
                "a multiple of 0",
            ));
        }
        self.buckets.insert(symbol.to_string(), buckets);
        Ok(self)
    }

    /// Keeps at most `capacity` bindings compiled besides the owner (at least 1).
    pub fn with_capacity(mut self, capacity: usize) -> Result<Self> {
        if capacity == 0 {
            return Err(Error::invalid(
                "compile cache capacity",
                "must be at least 1",
            ));
        }
        self.capacity = capacity;
        self.entries.truncate(capacity);
        Ok(self)
    }

    /// The symbolic graph.
    pub fn graph(&self) -> &SymbolicGraph {
        &self.graph
    }

    /// The binding the owner graph was compiled at.
    pub fn owner_bindings(&self) -> &Bindings {
        &self.owner_bindings
    }

    /// The graph that owns the params and handles (compiled at the least binding).
    pub fn owner(&mut self) -> &mut CompiledGraph {
        &mut self.owner
    }

    /// How many bindings are compiled now, the owner included.
    pub fn compiled_count(&self) -> usize {
        self.entries.len() + 1
    }

    /// The bindings compiled now besides the owner, least recently used first.
    pub fn compiled_bindings(&self) -> Vec<Bindings> {
        let mut entries: Vec<&Entry> = self.entries.iter().collect();
        entries.sort_by_key(|e| e.last_used);
        entries.into_iter().map(|e| e.bindings.clone()).collect()
    }

    /// Calls `f` with every compiled graph and its binding, the owner first.
    pub fn for_each_compiled(&mut self, mut f: impl FnMut(&Bindings, &mut CompiledGraph)) {
        f(&self.owner_bindings, &mut self.owner);
        for e in &mut self.entries {
            f(&e.bindings, &mut e.graph);
        }
    }

    /// [`BucketedCompileCache::for_each_compiled`] for reading.
    pub fn for_each_compiled_ref(&self, mut f: impl FnMut(&Bindings, &CompiledGraph)) {
        f(&self.owner_bindings, &self.owner);
        for e in &self.entries {
            f(&e.bindings, &e.graph);
        }
    }

    /// The bucket `bindings` runs in: each symbol rounded up by its [`Buckets`],
    /// never past its range.
    pub fn bucket(&self, bindings: &Bindings) -> Result<Bindings> {
        self.graph.check_bindings(bindings)?;
        let mut out = Bindings::new();
        for s in self.graph.symbols() {
            let n = bindings.require(&s.name, self.graph.name())?;
            let rounded = self.buckets.get(&s.name).map_or(n, |b| b.round(n, s.max));
            out.set(&s.name, rounded)?;
        }
        Ok(out)
    }

    /// Sets a param of the owner from `f32` values; every compiled binding shares it.
    pub fn set_param(&mut self, name: &str, values: &[f32]) -> Result<()> {
        self.owner.set_param(name, values)?;
        self.reshare()
    }

    /// Sets a param of the owner from data of its own dtype.
    pub fn set_param_typed(&mut self, name: &str, values: TensorRef<'_>) -> Result<()> {
        self.owner.set_param_typed(name, values)?;
        self.reshare()
    }

    /// Sets a param of the owner from raw little-endian bytes.
    pub fn set_param_bytes(&mut self, name: &str, bytes: &[u8]) -> Result<()> {
        self.owner.set_param_bytes(name, bytes)?;
        self.reshare()
    }

    fn reshare(&mut self) -> Result<()> {
        for e in &mut self.entries {
            e.graph.share_params_from(&self.owner)?;
        }
        Ok(())
    }

    /// Compiles the graph for exactly `bindings`, sharing the owner's params, without
    /// keeping it in the cache.
    pub fn compile_uncached(&self, bindings: &Bindings) -> Result<CompiledGraph> {
        let mut graph = self
            .session
            .compile_with(self.graph.specialize(bindings)?, &self.options)?;
        graph.share_params_from(&self.owner)?;
        Ok(graph)
    }

    /// The graph compiled for exactly `bindings` (compiled on first use), at its
    /// compiled shapes. A graph with persistent handles holds none outside
    /// [`BucketedCompileCache::run_with`].
    pub fn get(&mut self, bindings: &Bindings) -> Result<&mut CompiledGraph> {
        let graph = match self.entry(bindings)? {
            None => &mut self.owner,
            Some(i) => &mut self.entries[i].graph,
        };
        // At its compiled shapes, whatever `run_padded` left it at.
        graph.clear_active_extent()?;
        Ok(graph)
    }

    /// Index of the entry for `bindings` (`None` for the owner's binding), compiling
    /// it and dropping the least recently used entry when full.
    fn entry(&mut self, bindings: &Bindings) -> Result<Option<usize>> {
        self.graph.check_bindings(bindings)?;
        if *bindings == self.owner_bindings {
            return Ok(None);
        }
        self.clock += 1;
        if let Some(i) = self.entries.iter().position(|e| e.bindings == *bindings) {
            self.entries[i].last_used = self.clock;
            return Ok(Some(i));
        }
        let mut graph = self.compile_uncached(bindings)?;
        // It runs on the owner's handles (lent by `run_with`), so it keeps none.
        graph.release_handles()?;
        if self.entries.len() >= self.capacity
            && let Some(oldest) = (0..self.entries.len()).min_by_key(|&i| self.entries[i].last_used)
        {
            self.entries.swap_remove(oldest);
        }
        self.entries.push(Entry {
            bindings: bindings.clone(),
            graph,
            last_used: self.clock,
        });
        Ok(Some(self.entries.len() - 1))
    }

    /// Runs `f` on the graph for exactly `bindings`, with the owner's persistent
    /// handles lent to it for the call (so state such as a key/value cache carries
    /// across bindings).
    pub fn run_with<T>(
        &mut self,
        bindings: &Bindings,
        f: impl FnOnce(&mut CompiledGraph) -> Result<T>,
    ) -> Result<T> {
        self.lend(bindings, |g| {
            g.clear_active_extent()?;
            f(g)
        })
    }

    /// [`BucketedCompileCache::run_with`] without restoring the compiled shapes.
    fn lend<T>(
        &mut self,
        bindings: &Bindings,
        f: impl FnOnce(&mut CompiledGraph) -> Result<T>,
    ) -> Result<T> {
        let Some(i) = self.entry(bindings)? else {
            return f(&mut self.owner);
        };
        let graph = &mut self.entries[i].graph;
        graph.borrow_handles(&mut self.owner)?;
        let result = f(graph);
        graph.return_handles(&mut self.owner)?;
        result
    }

    /// Runs inputs of the sizes in `actual` in their bucket: each input is padded
    /// with zeros along its symbolic dims up to the bucket's sizes, and each output
    /// comes back cut to the sizes under `actual`. Inputs are named, each of its
    /// input's dtype and holding exactly the elements its shape under `actual` has.
    ///
    /// When every input with a symbolic first dim has the same symbol there (a
    /// batch) and the bucket's graph keeps those rows apart, the graph runs on the
    /// actual rows instead ([`CompiledGraph::set_active_extent`]): no padded rows are
    /// computed. Other dims are padded either way.
    pub fn run_padded(
        &mut self,
        actual: &Bindings,
        inputs: &[(&str, TensorRef<'_>)],
    ) -> Result<Vec<TensorData>> {
        let bucket = self.bucket(actual)?;
        for (i, (name, value)) in inputs.iter().enumerate() {
            let (_, symbolic) = self.graph.input(name)?;
            if inputs[..i].iter().any(|(other, _)| other == name) {
                return Err(Error::DuplicateName {
                    kind: "input",
                    name: name.to_string(),
                });
            }
            let context = format!("input '{name}'");
            let real = symbolic.bind(actual, &context)?;
            if value.dtype() != real.dtype() {
                return Err(Error::dtype(context, real.dtype().name(), value.dtype()));
            }
            if value.len() != real.num_elements() {
                return Err(Error::LengthMismatch {
                    kind: "input",
                    name: name.to_string(),
                    expected: real.num_elements(),
                    got: value.len(),
                    unit: "elements",
                });
            }
        }
        // The sizes the graph runs at: the bucket's, or the actual rows of the leading
        // symbol where the active extent applies.
        let extent = self.leading.clone().filter(|(symbol, _)| {
            actual.get(symbol) < bucket.get(symbol) && !self.mixes_rows.contains(&bucket)
        });
        let signature_inputs = self.graph.inputs().to_vec();
        let signature_outputs = self.graph.outputs().to_vec();
        let (raw, run_at, mixes) = self.lend(&bucket, |g| {
            let mut run_at = bucket.clone();
            let mut mixes = false;
            match &extent {
                Some((symbol, names)) => {
                    let rows = actual.require(symbol, "run_padded")?;
                    let names: Vec<&str> = names.iter().map(String::as_str).collect();
                    run_at.set(symbol, rows)?;
                    // The graph's shapes at the extent must be the signature's at
                    // `run_at`; anything else pads instead.
                    let fits = g.set_active_extent(&names, rows).is_ok()
                        && signature_matches(g, &signature_inputs, &signature_outputs, &run_at);
                    if !fits {
                        mixes = true;
                        run_at = bucket.clone();
                        g.clear_active_extent()?;
                    }
                }
                None => g.clear_active_extent()?,
            }
            let mut padded: Vec<(String, Vec<u8>)> = Vec::with_capacity(inputs.len());
            for (name, value) in inputs {
                let Some((_, symbolic)) = signature_inputs.iter().find(|(n, _)| n == name) else {
                    continue;
                };
                let real = symbolic.bind(actual, name)?;
                let full = symbolic.bind(&run_at, name)?;
                padded.push((name.to_string(), pad(&value.to_le_bytes(), &real, &full)?));
            }
            let named: Vec<(&str, &[u8])> = padded
                .iter()
                .map(|(n, b)| (n.as_str(), b.as_slice()))
                .collect();
            Ok((g.run_raw(&named)?, run_at, mixes))
        })?;
        if mixes {
            self.mixes_rows.push(bucket);
        }
        let mut out = Vec::with_capacity(raw.len());
        for (k, (bytes, symbolic)) in raw.iter().zip(&signature_outputs).enumerate() {
            let context = format!("output {k}");
            let full = symbolic.bind(&run_at, &context)?;
            let real = symbolic.bind(actual, &context)?;
            out.push(TensorData::from_le_bytes(
                real.dtype(),
                &crop(bytes, &full, &real)?,
            )?);
        }
        Ok(out)
    }
}

/// The symbol every input with a symbolic first dim has there, with those inputs;
/// `None` when there are none or they disagree.
fn leading_symbol(graph: &SymbolicGraph) -> Option<(String, Vec<String>)> {
    let mut symbol: Option<&str> = None;
    let mut names = Vec::new();
    for (name, shape) in graph.inputs() {
        let Some(s) = shape.dims().first().and_then(rlx_ir::Dim::symbol) else {
            continue;
        };
        if symbol.is_some_and(|t| t != s) {
            return None;
        }
        symbol = Some(s);
        names.push(name.clone());
    }
    let symbol = symbol?;
    // Only dimension 0 may follow it: the active extent scales nothing else.
    let shapes = graph.inputs().iter().map(|(_, s)| s).chain(graph.outputs());
    for shape in shapes {
        if shape
            .dims()
            .iter()
            .skip(1)
            .any(|d| d.symbol() == Some(symbol))
        {
            return None;
        }
    }
    Some((symbol.to_string(), names))
}

/// Whether `g`'s input and output shapes are the signature's under `bindings`.
fn signature_matches(
    g: &CompiledGraph,
    inputs: &[(String, rlx_ir::SymbolicShape)],
    outputs: &[rlx_ir::SymbolicShape],
    bindings: &Bindings,
) -> bool {
    let ins = g.inputs();
    let inputs_match = inputs.iter().all(|(name, symbolic)| {
        match ins.iter().find(|(n, _)| n == name) {
            // Persistent handles are not run-time inputs.
            None => true,
            Some((_, shape)) => symbolic.bind(bindings, name).is_ok_and(|s| s == *shape),
        }
    });
    let outs = g.output_shapes();
    inputs_match
        && outs.len() == outputs.len()
        && outs
            .iter()
            .zip(outputs)
            .all(|(shape, symbolic)| symbolic.bind(bindings, "output").is_ok_and(|s| s == *shape))
}

/// Visits every innermost row of a tensor with dims `dims`, calling `f(row_index)`
/// with the multi-index of the row (all axes but the last).
fn for_each_row(dims: &[usize], mut f: impl FnMut(&[usize])) {
    let outer = &dims[..dims.len().saturating_sub(1)];
    if outer.contains(&0) {
        return;
    }
    let mut index = vec![0usize; outer.len()];
    loop {
        f(&index);
        let mut axis = outer.len();
        loop {
            if axis == 0 {
                return;
            }
            axis -= 1;
            index[axis] += 1;
            if index[axis] < outer[axis] {
                break;
            }
            index[axis] = 0;
        }
    }
}

/// Byte offset of the row at `index` in a dense tensor of `dims` with `elem`-byte
/// elements.
fn row_offset(index: &[usize], dims: &[usize], elem: usize) -> usize {
    let strides = rlx_ir::contiguous_strides(dims);
    index
        .iter()
        .zip(&strides)
        .map(|(i, s)| i * s)
        .sum::<usize>()
        * elem
}

/// `data` (dense, shaped `real`) placed at the origin of a zeroed tensor shaped `full`
/// (every dim at least as large).
fn pad(data: &[u8], real: &Shape, full: &Shape) -> Result<Vec<u8>> {
    check_corner(data, real, real, full)?;
    Ok(copy_corner(data, real, real, full))
}

/// The `real`-shaped corner at the origin of `data` (dense, shaped `full`).
fn crop(data: &[u8], full: &Shape, real: &Shape) -> Result<Vec<u8>> {
    check_corner(data, full, real, full)?;
    Ok(copy_corner(data, full, real, real))
}

/// Copies the `real` corner at the origin of `data` (dense, shaped `from`) to the
/// origin of a zeroed tensor shaped `to`; one of `from` and `to` is `real`.
fn copy_corner(data: &[u8], from: &Shape, real: &Shape, to: &Shape) -> Vec<u8> {
    if from == to {
        return data.to_vec();
    }
    let elem = real.dtype().size_in_bytes();
    let mut out = vec![0u8; to.byte_size()];
    let row = real.dims().last().copied().unwrap_or(1) * elem;
    for_each_row(real.dims(), |index| {
        let src = row_offset(index, from.dims(), elem);
        let dst = row_offset(index, to.dims(), elem);
        out[dst..dst + row].copy_from_slice(&data[src..src + row]);
    });
    out
}

/// Checks that `data` holds a dense `shape` and that `real` fits inside `full`.
fn check_corner(data: &[u8], shape: &Shape, real: &Shape, full: &Shape) -> Result<()> {
    let fits = real.rank() == full.rank()
        && real.dtype() == full.dtype()
        && real.dims().iter().zip(full.dims()).all(|(r, f)| r <= f);
    if data.len() != shape.byte_size() || !fits {
        return Err(Error::runtime(
            "run_padded",
            format!(
                "{} bytes for {shape}, padding {real} to {full}: the graph's shapes do not follow its signature",
                data.len()
            ),
        ));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlx_ir::DType;

    #[test]
    fn buckets_round_up_within_range() {
        assert_eq!(Buckets::Exact.round(5, 64), 5);
        assert_eq!(Buckets::Multiple(32).round(5, 512), 32);
        assert_eq!(Buckets::Multiple(32).round(500, 512), 512);
        assert_eq!(Buckets::Multiple(32).round(64, 512), 64);
        assert_eq!(Buckets::PowersOfTwo.round(5, 64), 8);
        assert_eq!(Buckets::PowersOfTwo.round(40, 48), 48);
        assert_eq!(Buckets::Sizes(vec![16, 4, 64]).round(5, 100), 16);
        assert_eq!(Buckets::Sizes(vec![16, 4, 64]).round(65, 100), 65);
    }

    #[test]
    fn pad_and_crop_are_inverse_on_the_corner() {
        let real = Shape::new(&[2, 3, 2], DType::I32);
        let full = Shape::new(&[3, 4, 5], DType::I32);
        let values: Vec<i32> = (1..=12).collect();
        let bytes = TensorRef::I32(&values).to_le_bytes();
        let padded = pad(&bytes, &real, &full).unwrap();
        let wide = TensorData::from_le_bytes(DType::I32, &padded).unwrap();
        let TensorData::I32(wide) = wide else {
            panic!("dtype")
        };
        // Element [1, 2, 1] of the real tensor sits at [1, 2, 1] of the padded one.
        assert_eq!(wide[20 + 2 * 5 + 1], values[6 + 2 * 2 + 1]);
        assert_eq!(wide.iter().filter(|&&v| v != 0).count(), 12);
        assert_eq!(crop(&padded, &full, &real).unwrap(), bytes);
        let scalar = Shape::scalar(DType::I32);
        assert_eq!(
            pad(&bytes[..4], &scalar, &scalar).unwrap(),
            bytes[..4].to_vec()
        );
        // Data that is not the shape it claims, or a corner larger than the whole.
        assert!(pad(&bytes[..8], &real, &full).is_err());
        assert!(crop(&padded, &real, &full).is_err());
    }
}
