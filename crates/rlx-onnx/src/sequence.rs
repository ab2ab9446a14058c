//! Sequences of tensors (`seq(tensor(...))`). Shapes are concrete during import, and
//! so is every sequence's length: a sequence is a list of tensor slots, and the
//! sequence ops (`SequenceConstruct`, `SequenceInsert`, `SequenceAt`,
//! `SplitToSequence`, `ConcatFromSequence`, `SequenceMap`, ...) rearrange that list at
//! import. Only the tensors' own computations (a split's slices, a concatenation, a
//! mapped body) become graph nodes. A position read at run time specializes the
//! import on the input it comes from, as other values the importer must know do.

use crate::control::scalar_slot;
use crate::import::{Importer, Slot};
use crate::ops::{axis, size, unsupported};
use crate::proto::{GraphProto, NodeProto};
use rlx_ir::{DType, Error, Result};

/// The sequence operators, for listings.
pub(crate) const NAMES: &[&str] = &[
    "ConcatFromSequence",
    "SequenceAt",
    "SequenceConstruct",
    "SequenceEmpty",
    "SequenceErase",
    "SequenceInsert",
    "SequenceLength",
    "SequenceMap",
    "SplitToSequence",
];

/// Whether `node` is a sequence op, or an `Identity` of a sequence.
pub(crate) fn handles(imp: &Importer, node: &NodeProto) -> bool {
    let op = node.op_type.as_deref().unwrap_or("");
    NAMES.contains(&op)
        || (op == "Identity"
            && node
                .input
                .first()
                .and_then(|name| imp.slot(name))
                .is_some_and(|s| s.items.is_some()))
}

/// Imports a sequence op and returns its output slots.
pub(crate) fn import(imp: &mut Importer, node: &NodeProto) -> Result<Vec<Slot>> {
    let op = node.op_type.as_deref().unwrap_or("");
    let out = match op {
        "SequenceEmpty" => Slot::sequence(Vec::new()),
        "SequenceConstruct" => {
            let items = (0..node.input.len())
                .map(|i| tensor(imp, node, i))
                .collect::<Result<Vec<_>>>()?;
            if let Some(first) = items.first() {
                for item in &items[1..] {
                    same_dtype(first, item)?;
                }
            }
            Slot::sequence(items)
        }
        "SequenceInsert" => {
            let mut items = sequence(imp, node, 0)?;
            let item = tensor(imp, node, 1)?;
            if let Some(first) = items.first() {
                same_dtype(first, &item)?;
            }
            let at = match position(imp, node, 2)? {
                Some(p) => index(p, items.len(), true)?,
                None => items.len(),
            };
            items.insert(at, item);
            Slot::sequence(items)
        }
        "SequenceErase" => {
            let mut items = sequence(imp, node, 0)?;
            let p = position(imp, node, 1)?.unwrap_or(-1);
            items.remove(index(p, items.len(), false)?);
            Slot::sequence(items)
        }
        "SequenceAt" => {
            let items = sequence(imp, node, 0)?;
            let p = position(imp, node, 1)?
                .ok_or_else(|| Error::invalid("SequenceAt", "the position is required"))?;
            items[index(p, items.len(), false)?].clone()
        }
        "SequenceLength" => scalar_slot(sequence(imp, node, 0)?.len() as i64, DType::I64),
        "Identity" => Slot::sequence(sequence(imp, node, 0)?),
        "ConcatFromSequence" => concat_from_sequence(imp, node)?,
        "SplitToSequence" => split_to_sequence(imp, node)?,
        "SequenceMap" => return sequence_map(imp, node),
        other => return Err(unsupported(format!("sequence operator {other}"))),
    };
    Ok(vec![out])
}

fn operand(imp: &Importer, node: &NodeProto, i: usize) -> Result<Option<(String, Slot)>> {
    match node.input.get(i) {
        Some(name) if !name.is_empty() => {
            let slot = imp.slot(name).ok_or_else(|| {
                Error::invalid(
                    "input",
                    format!(
                        "'{name}' is not a graph input, an initializer or the output of any node"
                    ),
                )
            })?;
            Ok(Some((name.clone(), slot)))
        }
        _ => Ok(None),
    }
}

fn required(imp: &Importer, node: &NodeProto, i: usize) -> Result<(String, Slot)> {
    operand(imp, node, i)?
        .ok_or_else(|| Error::invalid("operand", format!("input {i} is required")))
}

/// Operand `i`, which must be a sequence: its elements.
fn sequence(imp: &Importer, node: &NodeProto, i: usize) -> Result<Vec<Slot>> {
    let (name, slot) = required(imp, node, i)?;
    match slot.items {
        Some(items) => Ok(items.as_ref().clone()),
        None => Err(Error::invalid(
            "operand",
            format!("input {i} ('{name}') must be a sequence, not a tensor"),
        )),
    }
}

/// Operand `i`, which must be a tensor.
fn tensor(imp: &Importer, node: &NodeProto, i: usize) -> Result<Slot> {
    let (name, slot) = required(imp, node, i)?;
    if slot.items.is_some() {
        return Err(Error::invalid(
            "operand",
            format!("input {i} ('{name}') must be a tensor, not a sequence"),
        ));
    }
    Ok(slot)
}

fn same_dtype(first: &Slot, item: &Slot) -> Result<()> {
    let (a, b) = (first.shape.dtype(), item.shape.dtype());
    if a != b {
        return Err(Error::dtype("sequence element", a.name(), b));
    }
    Ok(())
}

/// A known integer operand `i` (a position or split sizes), if present: known at
/// import, or computed from given input values (which specializes on them).
fn known_ints(
    imp: &mut Importer,
    node: &NodeProto,
    i: usize,
) -> Result<Option<(Vec<usize>, Vec<i64>)>> {
    let Some((name, slot)) = operand(imp, node, i)? else {
        return Ok(None);
    };
    if slot.items.is_some() {
        return Err(Error::invalid(
            "operand",
            format!("input {i} ('{name}') must be a tensor, not a sequence"),
        ));
    }
    if !slot.shape.dtype().is_int() {
        return Err(Error::dtype(
            format!("input {i} ('{name}')"),
            "an integer type",
            slot.shape.dtype(),
        ));
    }
    let value = match imp.value_of(&name, &slot) {
        Some(v) => v,
        None => imp.derived_value(&slot).ok_or_else(|| {
            unsupported(format!(
                "input {i} ('{name}') must be known when importing (it is computed at run time)"
            ))
        })?,
    };
    Ok(Some((value.dims.clone(), value.to_i64_vec())))
}

/// Operand `i` as a scalar position, if present.
fn position(imp: &mut Importer, node: &NodeProto, i: usize) -> Result<Option<i64>> {
    match known_ints(imp, node, i)? {
        None => Ok(None),
        Some((dims, v)) if v.len() == 1 && dims.iter().all(|&d| d == 1) => Ok(Some(v[0])),
        Some((dims, _)) => Err(Error::invalid(
            "position",
            format!("must be a scalar, not of dims {dims:?}"),
        )),
    }
}

/// A position in a sequence of `len` elements: `-len..len`, or `-len..=len` where an
/// insertion may also append.
fn index(p: i64, len: usize, insert: bool) -> Result<usize> {
    let n = len as i64;
    let end = if insert { n } else { n - 1 };
    if p < -n || p > end {
        let range = if insert { "[-n, n]" } else { "[-n, n - 1]" };
        return Err(Error::invalid(
            "position",
            format!("{p} is outside {range} for a sequence of {len} elements"),
        ));
    }
    Ok(if p < 0 { (p + n) as usize } else { p as usize })
}

fn concat_from_sequence(imp: &mut Importer, node: &NodeProto) -> Result<Slot> {
    let items = sequence(imp, node, 0)?;
    let attr = |name: &str| {
        node.attribute
            .iter()
            .find(|a| a.name.as_deref() == Some(name))
            .and_then(|a| a.i)
    };
    let a =
        attr("axis").ok_or_else(|| Error::invalid("ConcatFromSequence", "'axis' is required"))?;
    let new_axis = attr("new_axis").unwrap_or(0) != 0;
    let first = items
        .first()
        .ok_or_else(|| Error::invalid("ConcatFromSequence", "the sequence is empty"))?;
    let rank = first.shape.rank();
    let at = axis(a, if new_axis { rank + 1 } else { rank })?;
    let mut ids = Vec::with_capacity(items.len());
    for (k, item) in items.iter().enumerate() {
        same_dtype(first, item)?;
        let id = imp.node_of(&format!("element {k}"), item)?;
        ids.push(if new_axis {
            imp.graph().unsqueeze(id, &[at as isize])?
        } else {
            id
        });
    }
    let id = imp.graph().concat(&ids, at as isize)?;
    imp.slot_for(id)
}

fn split_to_sequence(imp: &mut Importer, node: &NodeProto) -> Result<Slot> {
    let x = tensor(imp, node, 0)?;
    let attr = |name: &str, default: i64| {
        node.attribute
            .iter()
            .find(|a| a.name.as_deref() == Some(name))
            .and_then(|a| a.i)
            .unwrap_or(default)
    };
    let dims = x.shape.dims().to_vec();
    if dims.is_empty() {
        return Err(Error::invalid("SplitToSequence", "cannot split a scalar"));
    }
    let a = axis(attr("axis", 0), dims.len())?;
    let len = dims[a];
    let split = known_ints(imp, node, 1)?;
    let keep = split.is_some() || attr("keepdims", 1) != 0;
    let sizes: Vec<usize> = match split {
        None => vec![1; len],
        Some((d, v)) if d.is_empty() => {
            let chunk = size(v[0], "split")?;
            if chunk == 0 {
                return Err(Error::invalid("SplitToSequence", "a split of size 0"));
            }
            (0..len.div_ceil(chunk))
                .map(|k| chunk.min(len - k * chunk))
                .collect()
        }
        Some((d, v)) if d.len() == 1 => {
            let sizes: Vec<usize> = v.iter().map(|&s| size(s, "split")).collect::<Result<_>>()?;
            if sizes.iter().sum::<usize>() != len {
                return Err(Error::invalid(
                    "SplitToSequence",
                    format!("split {sizes:?} does not sum to {len} (axis {a} of {dims:?})"),
                ));
            }
            sizes
        }
        Some((d, _)) => {
            return Err(Error::invalid(
                "SplitToSequence",
                format!("split must be a scalar or 1-D, not of dims {d:?}"),
            ));
        }
    };
    let id = imp.node_of("input", &x)?;
    let mut items = Vec::with_capacity(sizes.len());
    let mut start = 0;
    for s in sizes {
        let mut piece =
            imp.graph()
                .slice(id, a as isize, start as isize, (start + s) as isize, 1)?;
        if !keep {
            piece = imp.graph().squeeze(piece, &[a as isize])?;
        }
        start += s;
        items.push(imp.slot_for(piece)?);
    }
    Ok(Slot::sequence(items))
}

fn body(node: &NodeProto) -> Result<&GraphProto> {
    node.attribute
        .iter()
        .find(|a| a.name.as_deref() == Some("body"))
        .and_then(|a| a.g.as_ref())
        .ok_or_else(|| Error::invalid("SequenceMap", "attribute 'body' is missing"))
}

/// Runs the body once per element: element `i` of every sequence operand (and every
/// tensor operand whole) in, element `i` of every output sequence out.
fn sequence_map(imp: &mut Importer, node: &NodeProto) -> Result<Vec<Slot>> {
    let body = body(node)?;
    let mut operands = Vec::with_capacity(node.input.len());
    for i in 0..node.input.len() {
        operands.push(required(imp, node, i)?.1);
    }
    let len = match operands.first().and_then(|s| s.items.as_ref()) {
        Some(items) => items.len(),
        None => {
            return Err(Error::invalid("SequenceMap", "input 0 must be a sequence"));
        }
    };
    for (i, s) in operands.iter().enumerate() {
        if let Some(items) = &s.items
            && items.len() != len
        {
            return Err(Error::invalid(
                "SequenceMap",
                format!("input {i} has {} elements, input 0 has {len}", items.len()),
            ));
        }
    }
    let names: Vec<String> = body
        .input
        .iter()
        .map(|v| v.name.clone().unwrap_or_default())
        .collect();
    if names.len() != operands.len() {
        return Err(Error::invalid(
            "SequenceMap",
            format!(
                "the body has {} inputs for {} operands",
                names.len(),
                operands.len()
            ),
        ));
    }
    if body.output.len() != node.output.len() {
        return Err(Error::invalid(
            "SequenceMap",
            format!(
                "the body has {} outputs for {} sequences",
                body.output.len(),
                node.output.len()
            ),
        ));
    }
    let mut outputs: Vec<Vec<Slot>> = vec![Vec::with_capacity(len); node.output.len()];
    for i in 0..len {
        let bind: Vec<(String, Slot)> = names
            .iter()
            .zip(&operands)
            .map(|(name, s)| {
                let slot = match &s.items {
                    Some(items) => items[i].clone(),
                    None => s.clone(),
                };
                (name.clone(), slot)
            })
            .collect();
        let outs = imp.with_scope(bind, |imp| imp.import_subgraph(body))?;
        for (k, out) in outs.into_iter().enumerate() {
            if out.items.is_some() {
                return Err(Error::invalid(
                    "SequenceMap",
                    format!("body output {k} is a sequence; it must be a tensor"),
                ));
            }
            outputs[k].push(out);
        }
    }
    Ok(outputs.into_iter().map(Slot::sequence).collect())
}
