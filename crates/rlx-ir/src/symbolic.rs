//! Symbolic dimensions: shapes with named sizes (`batch`, `sequence`) and the
//! bindings that make them concrete.
//!
//! A graph's signature (its inputs and outputs) is written with [`SymbolicShape`]s;
//! compiling binds every symbol to a size with [`Bindings`], and
//! [`SymbolicShape::bind`] turns each signature shape into the concrete [`Shape`] the
//! planner and kernels work with.

use crate::{DType, Error, Result, Shape};
use std::collections::BTreeMap;
use std::fmt;

/// One dimension of a [`SymbolicShape`].
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Dim {
    /// A fixed size.
    Fixed(usize),
    /// A named size, bound at compile time.
    Symbol(String),
}

impl Dim {
    /// A named dimension.
    pub fn sym(name: impl Into<String>) -> Dim {
        Dim::Symbol(name.into())
    }

    /// The symbol's name, if this dimension is symbolic.
    pub fn symbol(&self) -> Option<&str> {
        match self {
            Dim::Fixed(_) => None,
            Dim::Symbol(s) => Some(s),
        }
    }

    /// The size under `bindings`, or an error naming `context` when the symbol is
    /// unbound.
    pub fn bind(&self, bindings: &Bindings, context: &str) -> Result<usize> {
        match self {
            Dim::Fixed(n) => Ok(*n),
            Dim::Symbol(s) => bindings.require(s, context),
        }
    }
}

impl From<usize> for Dim {
    fn from(n: usize) -> Dim {
        Dim::Fixed(n)
    }
}

impl From<&str> for Dim {
    fn from(name: &str) -> Dim {
        Dim::Symbol(name.to_string())
    }
}

impl fmt::Display for Dim {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Dim::Fixed(n) => write!(f, "{n}"),
            Dim::Symbol(s) => f.write_str(s),
        }
    }
}

/// A shape whose dimensions may be named symbols: `f32[batch, sequence, 384]`.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct SymbolicShape {
    dims: Vec<Dim>,
    dtype: DType,
}

impl SymbolicShape {
    /// A shape with the given dimensions (sizes or symbols) and element type.
    pub fn new(dims: impl IntoIterator<Item = Dim>, dtype: DType) -> SymbolicShape {
        SymbolicShape {
            dims: dims.into_iter().collect(),
            dtype,
        }
    }

    /// The dimensions, outermost first.
    pub fn dims(&self) -> &[Dim] {
        &self.dims
    }

    /// The element type.
    pub fn dtype(&self) -> DType {
        self.dtype
    }

    /// Number of dimensions.
    pub fn rank(&self) -> usize {
        self.dims.len()
    }

    /// The symbols this shape names, in order of first appearance.
    pub fn symbols(&self) -> Vec<&str> {
        let mut out: Vec<&str> = Vec::new();
        for s in self.dims.iter().filter_map(Dim::symbol) {
            if !out.contains(&s) {
                out.push(s);
            }
        }
        out
    }

    /// Whether every dimension is fixed.
    pub fn is_static(&self) -> bool {
        self.dims.iter().all(|d| matches!(d, Dim::Fixed(_)))
    }

    /// The concrete shape under `bindings`.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] naming `context` when a symbol is unbound, and
    /// [`Error::SizeOverflow`] when the bound shape cannot be addressed.
    pub fn bind(&self, bindings: &Bindings, context: &str) -> Result<Shape> {
        let dims = self
            .dims
            .iter()
            .map(|d| d.bind(bindings, context))
            .collect::<Result<Vec<_>>>()?;
        let shape = Shape::new(&dims, self.dtype);
        shape.check_size(context)?;
        Ok(shape)
    }

    /// Whether `shape` is this shape under some binding consistent with `bindings`:
    /// same rank and dtype, fixed dims equal, and each symbol bound in `bindings` to
    /// the size `shape` has there. Symbols absent from `bindings` are added to it (so
    /// reading several shapes infers the symbols they imply); a contradiction is an
    /// error naming `context`.
    pub fn unify(&self, shape: &Shape, bindings: &mut Bindings, context: &str) -> Result<()> {
        let mismatch = |why: String| {
            Error::invalid(
                context,
                format!("shape {shape} does not match {self}: {why}"),
            )
        };
        if shape.dtype() != self.dtype {
            return Err(Error::dtype(context, self.dtype.to_string(), shape.dtype()));
        }
        if shape.rank() != self.rank() {
            return Err(mismatch(format!(
                "rank {} vs {}",
                shape.rank(),
                self.rank()
            )));
        }
        for (axis, (d, &n)) in self.dims.iter().zip(shape.dims()).enumerate() {
            match d {
                Dim::Fixed(f) if *f != n => {
                    return Err(mismatch(format!("dim {axis} is {n}, expected {f}")));
                }
                Dim::Fixed(_) => {}
                Dim::Symbol(s) => match bindings.get(s) {
                    Some(bound) if bound != n => {
                        return Err(mismatch(format!("dim {axis} is {n}, but '{s}' is {bound}")));
                    }
                    Some(_) => {}
                    None => bindings.set(s, n)?,
                },
            }
        }
        Ok(())
    }
}

impl From<&Shape> for SymbolicShape {
    fn from(shape: &Shape) -> SymbolicShape {
        SymbolicShape::new(shape.dims().iter().map(|&n| Dim::Fixed(n)), shape.dtype())
    }
}

impl fmt::Display for SymbolicShape {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        crate::shape::write_shape(f, self.dtype, &self.dims)
    }
}

/// Sizes for named symbols. Every size is at least 1: a symbolic dim bound to zero
/// (or, when parsed, a negative number) is an error, as is reading a symbol that was
/// never bound.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct Bindings {
    sizes: BTreeMap<String, usize>,
}

impl Bindings {
    /// No symbols bound.
    pub fn new() -> Bindings {
        Bindings::default()
    }

    /// Binds `name` to `size` (builder style).
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `size` is 0 or the name is empty.
    pub fn with(mut self, name: &str, size: usize) -> Result<Bindings> {
        self.set(name, size)?;
        Ok(self)
    }

    /// Binds `name` to `size`, replacing an earlier binding.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when `size` is 0 or the name is empty.
    pub fn set(&mut self, name: &str, size: usize) -> Result<()> {
        if name.is_empty() {
            return Err(Error::invalid("binding", "a symbol needs a name"));
        }
        if size == 0 {
            return Err(Error::invalid(
                format!("symbol '{name}'"),
                "bound to 0; a symbolic dim must be at least 1",
            ));
        }
        self.sizes.insert(name.to_string(), size);
        Ok(())
    }

    /// Parses `SYM=N` (as written on a command line) and binds it.
    ///
    /// # Errors
    /// [`Error::InvalidArgument`] when the text is not `SYM=N` or `N` is not a whole
    /// number of at least 1 (negative numbers and zero are named as such).
    pub fn parse_into(&mut self, text: &str) -> Result<()> {
        let (name, n) = Bindings::parse(text)?;
        self.set(&name, n)
    }

    /// Parses `SYM=N` into its name and size, checking the size as
    /// [`Bindings::parse_into`] does.
    pub fn parse(text: &str) -> Result<(String, usize)> {
        let (name, value) = text
            .split_once('=')
            .ok_or_else(|| Error::invalid("binding", format!("'{text}' is not SYM=N")))?;
        let name = name.trim();
        if name.is_empty() {
            return Err(Error::invalid(
                "binding",
                format!("'{text}' has no symbol name"),
            ));
        }
        let n: i64 = value.trim().parse().map_err(|_| {
            Error::invalid(
                format!("symbol '{name}'"),
                format!("'{value}' is not a whole number"),
            )
        })?;
        if n < 1 {
            return Err(Error::invalid(
                format!("symbol '{name}'"),
                format!("bound to {n}; a symbolic dim must be at least 1"),
            ));
        }
        let n = usize::try_from(n)
            .map_err(|_| Error::invalid(format!("symbol '{name}'"), "too large"))?;
        Ok((name.to_string(), n))
    }

    /// The size bound to `name`, if any.
    pub fn get(&self, name: &str) -> Option<usize> {
        self.sizes.get(name).copied()
    }

    /// The size bound to `name`, or an error naming `context` and the symbol.
    pub fn require(&self, name: &str, context: &str) -> Result<usize> {
        self.get(name).ok_or_else(|| {
            Error::invalid(
                context,
                format!("symbolic dim '{name}' is not bound (bind it, e.g. {name}=8)"),
            )
        })
    }

    /// The bound symbols and their sizes, by name.
    pub fn iter(&self) -> impl Iterator<Item = (&str, usize)> {
        self.sizes.iter().map(|(k, &v)| (k.as_str(), v))
    }

    /// How many symbols are bound.
    pub fn len(&self) -> usize {
        self.sizes.len()
    }

    /// Whether no symbol is bound.
    pub fn is_empty(&self) -> bool {
        self.sizes.is_empty()
    }
}

impl fmt::Display for Bindings {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let parts: Vec<String> = self.iter().map(|(k, v)| format!("{k}={v}")).collect();
        f.write_str(&parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bert_ids() -> SymbolicShape {
        SymbolicShape::new([Dim::sym("batch"), Dim::sym("seq")], DType::I64)
    }

    #[test]
    fn binding_makes_shapes_concrete() {
        let s = SymbolicShape::new(
            [Dim::sym("batch"), Dim::sym("seq"), Dim::Fixed(384)],
            DType::F32,
        );
        assert_eq!(s.to_string(), "f32[batch, seq, 384]");
        assert_eq!(s.symbols(), vec!["batch", "seq"]);
        assert!(!s.is_static());
        let b = Bindings::new()
            .with("batch", 8)
            .unwrap()
            .with("seq", 128)
            .unwrap();
        assert_eq!(b.to_string(), "batch=8, seq=128");
        assert_eq!(s.bind(&b, "x").unwrap().dims(), &[8, 128, 384]);
    }

    #[test]
    fn unbound_zero_and_negative_symbols_are_errors() {
        let b = Bindings::new().with("batch", 2).unwrap();
        let err = bert_ids().bind(&b, "input 'ids'").unwrap_err().to_string();
        assert!(
            err.contains("input 'ids'") && err.contains("'seq' is not bound"),
            "{err}"
        );
        assert!(Bindings::new().with("seq", 0).is_err());
        let neg = Bindings::parse("seq=-3").unwrap_err().to_string();
        assert!(neg.contains("bound to -3"), "{neg}");
        assert!(Bindings::parse("seq").is_err());
        assert!(Bindings::parse("=3").is_err());
        assert!(Bindings::parse("seq=x").is_err());
        assert_eq!(Bindings::parse(" seq = 7 ").unwrap(), ("seq".into(), 7));
        let huge = SymbolicShape::new([Dim::sym("n"), Dim::sym("n")], DType::F32);
        let b = Bindings::new().with("n", 1 << 40).unwrap();
        assert!(matches!(
            huge.bind(&b, "x"),
            Err(Error::SizeOverflow { .. })
        ));
    }

    #[test]
    fn unify_infers_and_checks_symbols() {
        let mut b = Bindings::new();
        let ids = Shape::new(&[3, 17], DType::I64);
        bert_ids().unify(&ids, &mut b, "ids").unwrap();
        assert_eq!((b.get("batch"), b.get("seq")), (Some(3), Some(17)));
        // A second input must agree with what the first implied.
        let mask = Shape::new(&[3, 16], DType::I64);
        let err = bert_ids()
            .unify(&mask, &mut b, "mask")
            .unwrap_err()
            .to_string();
        assert!(err.contains("'seq' is 17"), "{err}");
        assert!(
            bert_ids()
                .unify(&Shape::new(&[3, 17], DType::I32), &mut b, "m")
                .is_err()
        );
        assert!(
            bert_ids()
                .unify(&Shape::new(&[3], DType::I64), &mut b, "m")
                .is_err()
        );
        let fixed = SymbolicShape::from(&Shape::new(&[2, 5], DType::F32));
        assert!(fixed.is_static());
        assert!(
            fixed
                .unify(&Shape::new(&[2, 6], DType::F32), &mut b, "w")
                .is_err()
        );
        // A zero-sized dim cannot bind a symbol.
        let mut fresh = Bindings::new();
        assert!(
            bert_ids()
                .unify(&Shape::new(&[0, 4], DType::I64), &mut fresh, "ids")
                .is_err()
        );
    }
}
