//! ONNX operator converters, one file per family. A converter reads its node through
//! [`Cx`] and returns the RLX nodes of the node's outputs, in order. Operators that
//! RLX has no primitive for are written as compositions of primitives.

mod attention;
mod conv_regions;
mod einsum;
mod elementwise;
mod grid;
mod losses;
mod nn;
mod quant;
mod rearrange;
mod recurrent_state;
mod reduce;
mod resize;
mod rnn;
mod scatter;
mod shape;
mod spectral;

use crate::import::Cx;
use rlx_ir::{DType, Error, NodeId, Result};

/// Converts one node.
pub(crate) type Converter = fn(&mut Cx) -> Result<Vec<NodeId>>;

/// The converter for a default-domain operator, if RLX imports it.
pub(crate) fn converter(op_type: &str) -> Option<Converter> {
    elementwise::converter(op_type)
        .or_else(|| shape::converter(op_type))
        .or_else(|| reduce::converter(op_type))
        .or_else(|| nn::converter(op_type))
        .or_else(|| attention::converter(op_type))
        .or_else(|| losses::converter(op_type))
        .or_else(|| rnn::converter(op_type))
        .or_else(|| resize::converter(op_type))
        .or_else(|| quant::converter(op_type))
        .or_else(|| scatter::converter(op_type))
        .or_else(|| recurrent_state::converter(op_type))
        .or_else(|| einsum::converter(op_type))
        .or_else(|| grid::converter(op_type))
        .or_else(|| spectral::converter(op_type))
        .or_else(|| rearrange::converter(op_type))
}

/// Every operator type the importer converts, for listings.
pub fn supported_ops() -> Vec<&'static str> {
    let mut all: Vec<&'static str> = [
        elementwise::NAMES,
        shape::NAMES,
        reduce::NAMES,
        nn::NAMES,
        attention::NAMES,
        losses::NAMES,
        rnn::NAMES,
        resize::NAMES,
        quant::NAMES,
        scatter::NAMES,
        recurrent_state::NAMES,
        einsum::NAMES,
        grid::NAMES,
        spectral::NAMES,
        rearrange::NAMES,
        crate::sequence::NAMES,
        &["If", "Loop", "Scan"],
    ]
    .concat();
    all.sort_unstable();
    all
}

pub(crate) fn unsupported(what: impl Into<String>) -> Error {
    Error::Unsupported {
        device: "onnx import".into(),
        what: what.into(),
    }
}

/// Resolves a possibly negative axis attribute against a rank.
pub(crate) fn axis(a: i64, rank: usize) -> Result<usize> {
    let r = rank as i64;
    let v = if a < 0 { a + r } else { a };
    if !(0..r).contains(&v) {
        return Err(Error::invalid(
            "axis",
            format!("{a} is out of range for rank {rank}"),
        ));
    }
    Ok(v as usize)
}

/// Resolves a list of possibly negative axes (sorted, duplicates rejected).
pub(crate) fn axes(list: &[i64], rank: usize) -> Result<Vec<usize>> {
    let mut out: Vec<usize> = list.iter().map(|&a| axis(a, rank)).collect::<Result<_>>()?;
    out.sort_unstable();
    let n = out.len();
    out.dedup();
    if out.len() != n {
        return Err(Error::invalid("axes", format!("{list:?} repeats an axis")));
    }
    Ok(out)
}

/// A non-negative size from a model value.
pub(crate) fn size(v: i64, what: &str) -> Result<usize> {
    usize::try_from(v).map_err(|_| Error::invalid(what, format!("{v} must not be negative")))
}

/// A scalar constant of `dtype`.
pub(crate) fn scalar(cx: &Cx, v: f64, dtype: DType) -> NodeId {
    cx.g.scalar(v, dtype)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn axes_resolve_against_the_rank() {
        assert_eq!(axis(-1, 3).unwrap(), 2);
        assert_eq!(axis(0, 3).unwrap(), 0);
        assert!(axis(3, 3).is_err() && axis(-4, 3).is_err());
        // A scalar has no axis to name.
        assert!(axis(0, 0).is_err() && axis(-1, 0).is_err());
        assert_eq!(axes(&[-1, 0], 2).unwrap(), vec![0, 1]);
        assert!(axes(&[1, -1], 2).is_err());
    }
}
