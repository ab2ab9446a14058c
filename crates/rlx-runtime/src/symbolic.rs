//! Graphs with symbolic dims: a signature written with named sizes plus the builder
//! that specializes the graph for one binding of them.

use rlx_ir::{Bindings, Error, Graph, Result, Shape, SymbolicShape};
use std::fmt;
use std::sync::Arc;

/// A symbol a [`SymbolicGraph`] is written over, with the sizes it may take.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SymbolRange {
    /// The symbol's name (`batch`, `sequence`, ...).
    pub name: String,
    /// The smallest size it may be bound to (at least 1).
    pub min: usize,
    /// The largest.
    pub max: usize,
}

impl SymbolRange {
    /// A symbol taking sizes `min..=max`.
    pub fn new(name: impl Into<String>, min: usize, max: usize) -> SymbolRange {
        SymbolRange {
            name: name.into(),
            min,
            max,
        }
    }
}

/// Builds the concrete graph for one binding of the symbols.
pub type GraphBuilder = dyn Fn(&Bindings) -> Result<Graph> + Send + Sync;

/// A graph whose inputs and outputs have symbolic dims.
///
/// It is checked once, when made: the builder runs at two bindings (every symbol at
/// its least size, then one more where the range allows) and each result must match
/// the declared signature, so a dim that should have been symbolic, or a builder that
/// names its inputs differently, is an error here and not at the first run.
/// [`SymbolicGraph::specialize`] is the pipeline's first stage: it binds the symbols
/// and runs the builder, which sees plain sizes (so shape arithmetic is ordinary
/// integer arithmetic there, and the ONNX importer folds shape computations to
/// constants as it builds), then checks the result against the signature again.
#[derive(Clone)]
pub struct SymbolicGraph {
    name: String,
    symbols: Vec<SymbolRange>,
    inputs: Vec<(String, SymbolicShape)>,
    outputs: Vec<SymbolicShape>,
    build: Arc<GraphBuilder>,
}

impl fmt::Debug for SymbolicGraph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{self}")
    }
}

impl fmt::Display for SymbolicGraph {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}(", self.name)?;
        for (i, (name, shape)) in self.inputs.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{name}: {shape}")?;
        }
        f.write_str(") -> (")?;
        for (i, shape) in self.outputs.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{shape}")?;
        }
        f.write_str(")")?;
        for s in &self.symbols {
            write!(f, " {}={}..={}", s.name, s.min, s.max)?;
        }
        Ok(())
    }
}

impl SymbolicGraph {
    /// A symbolic graph with the given symbols, signature and builder, checked as the
    /// type's documentation says.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when a symbol's range is empty or starts at 0, a
    /// shape names an undeclared symbol, a symbol is declared twice, or an input
    /// name repeats; any error of the builder; and [`Error::InvalidGraph`] when a
    /// built graph does not match the signature.
    pub fn new(
        name: impl Into<String>,
        symbols: Vec<SymbolRange>,
        inputs: Vec<(String, SymbolicShape)>,
        outputs: Vec<SymbolicShape>,
        build: impl Fn(&Bindings) -> Result<Graph> + Send + Sync + 'static,
    ) -> Result<SymbolicGraph> {
        let name = name.into();
        for (i, s) in symbols.iter().enumerate() {
            if s.min == 0 || s.min > s.max {
                return Err(Error::invalid(
                    format!("symbol '{}' of {name}", s.name),
                    format!(
                        "range {}..={} is empty or allows 0; symbolic dims are at least 1",
                        s.min, s.max
                    ),
                ));
            }
            if symbols[..i].iter().any(|t| t.name == s.name) {
                return Err(Error::DuplicateName {
                    kind: "symbol",
                    name: s.name.clone(),
                });
            }
        }
        let declared = |shape: &SymbolicShape, what: &str| -> Result<()> {
            match shape
                .symbols()
                .into_iter()
                .find(|s| !symbols.iter().any(|d| d.name == *s))
            {
                Some(s) => Err(Error::invalid(
                    format!("{what} of {name}"),
                    format!("names symbol '{s}', which the graph does not declare"),
                )),
                None => Ok(()),
            }
        };
        for (i, (input, shape)) in inputs.iter().enumerate() {
            declared(shape, &format!("input '{input}'"))?;
            if inputs[..i].iter().any(|(other, _)| other == input) {
                return Err(Error::DuplicateName {
                    kind: "input",
                    name: input.clone(),
                });
            }
        }
        for (i, shape) in outputs.iter().enumerate() {
            declared(shape, &format!("output {i}"))?;
        }
        let graph = SymbolicGraph {
            name,
            symbols,
            inputs,
            outputs,
            build: Arc::new(build),
        };
        let least = graph.least_binding();
        graph.specialize(&least)?;
        let mut next = Bindings::new();
        for s in &graph.symbols {
            next.set(&s.name, s.min.saturating_add(1).min(s.max))?;
        }
        if next != least {
            graph.specialize(&next)?;
        }
        Ok(graph)
    }

    /// The graph's name.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The symbols and their ranges.
    pub fn symbols(&self) -> &[SymbolRange] {
        &self.symbols
    }

    /// The inputs with their symbolic shapes.
    pub fn inputs(&self) -> &[(String, SymbolicShape)] {
        &self.inputs
    }

    /// The outputs' symbolic shapes, in order.
    pub fn outputs(&self) -> &[SymbolicShape] {
        &self.outputs
    }

    /// Every symbol at its least size.
    pub fn least_binding(&self) -> Bindings {
        let mut b = Bindings::new();
        for s in &self.symbols {
            // Ranges were checked to start at 1 or more.
            let _ = b.set(&s.name, s.min);
        }
        b
    }

    /// Checks that `bindings` binds exactly the declared symbols, each inside its
    /// range.
    pub fn check_bindings(&self, bindings: &Bindings) -> Result<()> {
        for s in &self.symbols {
            let n = bindings.require(&s.name, &self.name)?;
            if n < s.min || n > s.max {
                return Err(Error::invalid(
                    format!("symbol '{}' of {}", s.name, self.name),
                    format!("bound to {n}, outside its range {}..={}", s.min, s.max),
                ));
            }
        }
        if let Some((extra, _)) = bindings
            .iter()
            .find(|(k, _)| !self.symbols.iter().any(|s| s.name == *k))
        {
            let known: Vec<&str> = self.symbols.iter().map(|s| s.name.as_str()).collect();
            return Err(Error::invalid(
                &self.name,
                format!(
                    "binds '{extra}', which is not one of its symbols [{}]",
                    known.join(", ")
                ),
            ));
        }
        Ok(())
    }

    /// The binding implied by concrete input shapes (every input named once, all
    /// agreeing on each symbol).
    ///
    /// # Errors
    /// An unknown or missing input name, a shape that fits no binding, or a symbol no
    /// input fixes.
    pub fn bindings_for(&self, shapes: &[(&str, &Shape)]) -> Result<Bindings> {
        let mut b = Bindings::new();
        for (name, shape) in shapes {
            let (_, declared) = self.input(name)?;
            declared.unify(shape, &mut b, &format!("input '{name}' of {}", self.name))?;
        }
        if let Some((missing, shape)) = self
            .inputs
            .iter()
            .find(|(n, _)| !shapes.iter().any(|(m, _)| m == n))
        {
            return Err(Error::MissingInput {
                name: missing.clone(),
                shape: shape.bind(&self.least_binding(), missing)?,
            });
        }
        self.check_bindings(&b)?;
        Ok(b)
    }

    /// The input called `name`, with its position.
    pub fn input(&self, name: &str) -> Result<(usize, &SymbolicShape)> {
        self.inputs
            .iter()
            .position(|(n, _)| n == name)
            .map(|i| (i, &self.inputs[i].1))
            .ok_or_else(|| Error::UnknownName {
                kind: "input",
                name: name.to_string(),
                known: self.inputs.iter().map(|(n, _)| n.clone()).collect(),
            })
    }

    /// The concrete graph for `bindings`, checked against the signature.
    pub fn specialize(&self, bindings: &Bindings) -> Result<Graph> {
        self.check_bindings(bindings)?;
        let graph = (self.build)(bindings)?;
        let mismatch = |message: String| Error::InvalidGraph {
            graph: format!("{} at {bindings}", self.name),
            node: "-".into(),
            message,
        };
        let built = graph.inputs();
        if built.len() != self.inputs.len() {
            return Err(mismatch(format!(
                "the builder made {} inputs, the signature declares {}",
                built.len(),
                self.inputs.len()
            )));
        }
        for (name, symbolic) in &self.inputs {
            let expected = symbolic.bind(bindings, name)?;
            match built.iter().find(|(n, _, _)| n == name) {
                None => {
                    return Err(mismatch(format!(
                        "the builder made no input '{name}' ({expected})"
                    )));
                }
                Some((_, _, shape)) if *shape != expected => {
                    return Err(mismatch(format!(
                        "input '{name}' is {shape}, the signature says {symbolic} = {expected}"
                    )));
                }
                Some(_) => {}
            }
        }
        let outputs = graph.outputs();
        if outputs.len() != self.outputs.len() {
            return Err(mismatch(format!(
                "the builder made {} outputs, the signature declares {}",
                outputs.len(),
                self.outputs.len()
            )));
        }
        for (i, (&id, symbolic)) in outputs.iter().zip(&self.outputs).enumerate() {
            let expected = symbolic.bind(bindings, &format!("output {i}"))?;
            let shape = graph.shape(id)?;
            if shape != expected {
                return Err(mismatch(format!(
                    "output {i} is {shape}, the signature says {symbolic} = {expected}"
                )));
            }
        }
        Ok(graph)
    }
}
