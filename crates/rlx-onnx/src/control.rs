//! Control flow: `If`, `Loop` and `Scan` run their subgraphs by importing them in
//! place. Shapes are concrete during import, so a loop whose trip count is known is
//! unrolled, a scan is unrolled over its sequence, and an `If` on a known condition
//! takes its branch (on a run-time condition both branches run and `where` picks).
//! `FlexAttention` (domain `ai.onnx.preview`) runs its score and probability
//! modifiers the same way, in place on the attention's intermediate tensors.

use crate::import::{Importer, Slot};
use crate::ops::unsupported;
use crate::proto::{GraphProto, NodeProto};
use rlx_ir::{DType, Error, NodeId, Result, Shape, TensorData};

/// The most iterations a loop may unroll to.
const MAX_UNROLL: usize = 4096;

/// Imports a control-flow node and returns its output slots.
pub(crate) fn import(imp: &mut Importer, node: &NodeProto) -> Result<Vec<Slot>> {
    match node.op_type.as_deref() {
        Some("If") => import_if(imp, node),
        Some("Loop") => import_loop(imp, node),
        Some("Scan") => import_scan(imp, node),
        Some("FlexAttention") => import_flex_attention(imp, node),
        other => Err(unsupported(format!("control flow {other:?}"))),
    }
}

fn subgraph<'n>(node: &'n NodeProto, name: &str) -> Result<&'n GraphProto> {
    node.attribute
        .iter()
        .find(|a| a.name.as_deref() == Some(name))
        .and_then(|a| a.g.as_ref())
        .ok_or_else(|| Error::invalid("subgraph", format!("attribute '{name}' is missing")))
}

fn operand(imp: &Importer, node: &NodeProto, i: usize) -> Result<Option<Slot>> {
    match node.input.get(i) {
        Some(name) if !name.is_empty() => imp.slot(name).map(Some).ok_or_else(|| {
            Error::invalid(
                "input",
                format!("'{name}' is not a graph input, an initializer or the output of any node"),
            )
        }),
        _ => Ok(None),
    }
}

fn slot_of(imp: &Importer, id: NodeId) -> Result<Slot> {
    Ok(Slot {
        shape: imp.graph().shape(id)?,
        known: None,
        node: Some(id),
        items: None,
    })
}

fn input_names(gp: &GraphProto) -> Vec<String> {
    gp.input
        .iter()
        .map(|v| v.name.clone().unwrap_or_default())
        .collect()
}

fn import_if(imp: &mut Importer, node: &NodeProto) -> Result<Vec<Slot>> {
    let cond = operand(imp, node, 0)?.ok_or_else(|| Error::invalid("If", "no condition"))?;
    let then_g = subgraph(node, "then_branch")?;
    let else_g = subgraph(node, "else_branch")?;
    if let Some(k) = imp.value_of(&node.input[0], &cond) {
        let taken = k.to_i64_vec().first().copied().unwrap_or(0) != 0;
        let branch = if taken { then_g } else { else_g };
        return imp.with_scope(vec![], |imp| imp.import_subgraph(branch));
    }
    let then_out = imp.with_scope(vec![], |imp| imp.import_subgraph(then_g));
    let else_out = imp.with_scope(vec![], |imp| imp.import_subgraph(else_g));
    let (then_out, else_out) = match (then_out, else_out) {
        (Ok(t), Ok(e)) => (t, e),
        (t, e) => {
            // A branch that cannot be imported (its shapes hold only when it is
            // taken, say) is fine if a condition computed from given input values
            // leaves it untaken.
            if let Some(k) = imp.derived_value(&cond) {
                let taken = k.to_i64_vec().first().copied().unwrap_or(0) != 0;
                return if taken { t } else { e };
            }
            // Not both `Ok`: this is the first branch's error.
            return t.and(e);
        }
    };
    if then_out.len() != else_out.len() {
        return Err(Error::invalid(
            "If",
            "the branches have different output counts",
        ));
    }
    if then_out
        .iter()
        .zip(&else_out)
        .any(|(t, e)| t.shape != e.shape)
        && let Some(k) = imp.derived_value(&cond)
    {
        // Branches of different shapes cannot both be computed and one selected: a
        // condition computed from given input values picks one at import instead.
        let taken = k.to_i64_vec().first().copied().unwrap_or(0) != 0;
        return Ok(if taken { then_out } else { else_out });
    }
    let c = imp.node_of("cond", &cond)?;
    let mut out = Vec::new();
    for (k, (t, e)) in then_out.iter().zip(&else_out).enumerate() {
        if t.shape != e.shape {
            return Err(unsupported(format!(
                "If on a run-time condition whose output {k} differs in shape between branches ({} and {})",
                t.shape, e.shape
            )));
        }
        let tn = imp.node_of("then", t)?;
        let en = imp.node_of("else", e)?;
        let id = imp.graph().select(c, tn, en)?;
        out.push(slot_of(imp, id)?);
    }
    Ok(out)
}

fn known_scalar(imp: &mut Importer, name: &str, slot: &Slot) -> Option<i64> {
    imp.value_of(name, slot)
        .and_then(|t| t.to_i64_vec().first().copied())
}

pub(crate) fn scalar_slot(v: i64, dtype: DType) -> Slot {
    let data = TensorData::from_f64(dtype, &[v as f64]);
    Slot {
        shape: Shape::scalar(dtype),
        known: Some(std::rc::Rc::new(crate::tensor::Tensor {
            dims: vec![],
            data,
        })),
        node: None,
        items: None,
    }
}

fn import_loop(imp: &mut Importer, node: &NodeProto) -> Result<Vec<Slot>> {
    let body = subgraph(node, "body")?;
    let trip = operand(imp, node, 0)?;
    let cond = operand(imp, node, 1)?;
    let max_trips = match &trip {
        Some(t) => Some(
            known_scalar(imp, &node.input[0], t)
                .ok_or_else(|| unsupported("a run-time trip count"))?,
        ),
        None => None,
    };
    let mut running = match &cond {
        Some(c) => {
            known_scalar(imp, &node.input[1], c)
                .ok_or_else(|| unsupported("a run-time loop condition"))?
                != 0
        }
        None => true,
    };
    let mut carried: Vec<Slot> = (2..node.input.len())
        .map(|i| {
            operand(imp, node, i)?.ok_or_else(|| Error::invalid("Loop", "empty carried input"))
        })
        .collect::<Result<_>>()?;
    let names = input_names(body);
    if names.len() != carried.len() + 2 {
        return Err(Error::invalid(
            "Loop",
            "body inputs do not match the carried values",
        ));
    }
    if body.output.len() < 1 + carried.len() {
        return Err(Error::invalid(
            "Loop",
            "the body must output the condition and every carried value",
        ));
    }
    let n_scan = body.output.len() - (1 + carried.len());
    let mut scans: Vec<Vec<Slot>> = vec![Vec::new(); n_scan];
    let mut i: i64 = 0;
    while running && max_trips.is_none_or(|m| i < m) {
        if i as usize >= MAX_UNROLL {
            return Err(unsupported(format!(
                "a loop of more than {MAX_UNROLL} iterations"
            )));
        }
        let mut bind = vec![
            (names[0].clone(), scalar_slot(i, DType::I64)),
            (names[1].clone(), scalar_slot(1, DType::Bool)),
        ];
        bind.extend(names[2..].iter().cloned().zip(carried.iter().cloned()));
        let outs = imp.with_scope(bind, |imp| imp.import_subgraph(body))?;
        running = match known_scalar(imp, "cond", &outs[0]) {
            Some(v) => v != 0,
            None if cond.is_none() => true,
            None => return Err(unsupported("a loop condition computed at run time")),
        };
        carried = outs[1..1 + carried.len()].to_vec();
        for (k, s) in outs[1 + carried.len()..].iter().enumerate() {
            scans[k].push(s.clone());
        }
        i += 1;
    }
    let mut out = carried;
    for (k, items) in scans.into_iter().enumerate() {
        if items.is_empty() {
            return Err(unsupported(format!(
                "scan output {k} of a loop that ran zero times"
            )));
        }
        out.push(stack(imp, &items, 0)?);
    }
    Ok(out)
}

/// Stacks slots along a new axis.
fn stack(imp: &mut Importer, items: &[Slot], axis: usize) -> Result<Slot> {
    let mut ids = Vec::with_capacity(items.len());
    for s in items {
        let id = imp.node_of("scan", s)?;
        ids.push(imp.graph().unsqueeze(id, &[axis as isize])?);
    }
    let id = imp.graph().concat(&ids, axis as isize)?;
    slot_of(imp, id)
}

fn import_scan(imp: &mut Importer, node: &NodeProto) -> Result<Vec<Slot>> {
    if imp.opset() < 9 {
        return Err(unsupported("Scan before opset 9 (with a batch axis)"));
    }
    let body = subgraph(node, "body")?;
    let attr_ints = |name: &str| {
        node.attribute
            .iter()
            .find(|a| a.name.as_deref() == Some(name))
            .map(|a| a.ints.clone())
    };
    let n_scan_in =
        node.attribute
            .iter()
            .find(|a| a.name.as_deref() == Some("num_scan_inputs"))
            .and_then(|a| a.i)
            .ok_or_else(|| Error::invalid("Scan", "num_scan_inputs is missing"))? as usize;
    let n_in = node.input.len();
    if n_scan_in > n_in {
        return Err(Error::invalid("Scan", "more scan inputs than inputs"));
    }
    let n_state = n_in - n_scan_in;
    let mut states: Vec<Slot> = (0..n_state)
        .map(|i| operand(imp, node, i)?.ok_or_else(|| Error::invalid("Scan", "empty state")))
        .collect::<Result<_>>()?;
    let scan_in: Vec<Slot> = (n_state..n_in)
        .map(|i| operand(imp, node, i)?.ok_or_else(|| Error::invalid("Scan", "empty scan input")))
        .collect::<Result<_>>()?;
    let in_axes = attr_ints("scan_input_axes").unwrap_or_else(|| vec![0; n_scan_in]);
    let in_dirs = attr_ints("scan_input_directions").unwrap_or_else(|| vec![0; n_scan_in]);
    if body.output.len() < n_state {
        return Err(Error::invalid(
            "Scan",
            "the body has fewer outputs than state variables",
        ));
    }
    let n_scan_out = body.output.len() - n_state;
    let out_axes = attr_ints("scan_output_axes").unwrap_or_else(|| vec![0; n_scan_out]);
    let out_dirs = attr_ints("scan_output_directions").unwrap_or_else(|| vec![0; n_scan_out]);
    if in_axes.len() != n_scan_in
        || in_dirs.len() != n_scan_in
        || out_axes.len() != n_scan_out
        || out_dirs.len() != n_scan_out
    {
        return Err(Error::invalid(
            "Scan",
            "axis or direction lists do not match the scan counts",
        ));
    }
    let mut in_ids = Vec::new();
    let mut seq_len = None;
    for (k, s) in scan_in.iter().enumerate() {
        if s.shape.rank() == 0 {
            return Err(Error::invalid(
                "Scan",
                format!("scan input {k} is a scalar"),
            ));
        }
        let a = crate::ops::axis(in_axes[k], s.shape.rank())?;
        let len = s.shape.dim(a);
        if seq_len.is_some_and(|l| l != len) {
            return Err(Error::invalid(
                "Scan",
                "scan inputs differ in sequence length",
            ));
        }
        seq_len = Some(len);
        in_ids.push((imp.node_of("scan", s)?, a));
    }
    let seq_len = seq_len.unwrap_or(0);
    if seq_len > MAX_UNROLL {
        return Err(unsupported(format!(
            "a scan of more than {MAX_UNROLL} steps"
        )));
    }
    let names = input_names(body);
    if names.len() != n_state + n_scan_in {
        return Err(Error::invalid(
            "Scan",
            "body inputs do not match states and scan inputs",
        ));
    }
    let mut outs_per_step: Vec<Vec<Slot>> = vec![Vec::new(); n_scan_out];
    for t in 0..seq_len {
        let mut bind: Vec<(String, Slot)> = names[..n_state]
            .iter()
            .cloned()
            .zip(states.iter().cloned())
            .collect();
        for (k, &(id, a)) in in_ids.iter().enumerate() {
            let idx = if in_dirs[k] != 0 { seq_len - 1 - t } else { t };
            let g = imp.graph();
            let piece = g.slice(id, a as isize, idx as isize, idx as isize + 1, 1)?;
            let piece = g.squeeze(piece, &[a as isize])?;
            bind.push((names[n_state + k].clone(), slot_of(imp, piece)?));
        }
        let outs = imp.with_scope(bind, |imp| imp.import_subgraph(body))?;
        states = outs[..n_state].to_vec();
        for (k, s) in outs[n_state..].iter().enumerate() {
            outs_per_step[k].push(s.clone());
        }
    }
    let mut out = states;
    for (k, mut items) in outs_per_step.into_iter().enumerate() {
        if items.is_empty() {
            return Err(unsupported("a scan over an empty sequence"));
        }
        if out_dirs[k] != 0 {
            items.reverse();
        }
        let rank = items[0].shape.rank() + 1;
        let a = crate::ops::axis(out_axes[k], rank)?;
        out.push(stack(imp, &items, a)?);
    }
    Ok(out)
}

/// The subgraph attribute `name`, if the node has it.
fn optional_subgraph<'n>(node: &'n NodeProto, name: &str) -> Option<&'n GraphProto> {
    node.attribute
        .iter()
        .find(|a| a.name.as_deref() == Some(name))
        .and_then(|a| a.g.as_ref())
}

/// Runs a one-input, one-output modifier subgraph on `x`; its output must keep the
/// shape.
fn modify(imp: &mut Importer, gp: &GraphProto, x: NodeId, what: &str) -> Result<NodeId> {
    let names = input_names(gp);
    let [name] = names.as_slice() else {
        return Err(Error::invalid(
            what,
            format!("a modifier takes 1 input, this one {}", names.len()),
        ));
    };
    let slot = slot_of(imp, x)?;
    let outs = imp.with_scope(vec![(name.clone(), slot.clone())], |imp| {
        imp.import_subgraph(gp)
    })?;
    let [out] = outs.as_slice() else {
        return Err(Error::invalid(
            what,
            format!("a modifier gives 1 output, this one {}", outs.len()),
        ));
    };
    if out.shape != slot.shape {
        return Err(Error::invalid(
            what,
            format!("changes the shape {} to {}", slot.shape, out.shape),
        ));
    }
    imp.node_of(name, out)
}

/// `FlexAttention`: `softmax(q k^T * scale)` with the optional `score_mod` applied
/// to the scores and `prob_mod` to the probabilities (in the softmax precision:
/// `f64` for `f64` inputs, else `f32`), times `v`; each key/value head serves
/// `Hq / Hkv` consecutive query heads.
fn import_flex_attention(imp: &mut Importer, node: &NodeProto) -> Result<Vec<Slot>> {
    let mut qkv = Vec::with_capacity(3);
    for (i, name) in ["Q", "K", "V"].iter().enumerate() {
        let slot = operand(imp, node, i)?
            .ok_or_else(|| Error::invalid("FlexAttention", format!("{name} is required")))?;
        let id = imp.node_of(name, &slot)?;
        qkv.push((id, slot.shape));
    }
    let [(q, qs), (k, ks), (v, vs)] = [qkv[0].clone(), qkv[1].clone(), qkv[2].clone()];
    let (qd, kd, vd) = (qs.dims(), ks.dims(), vs.dims());
    if qd.len() != 4
        || kd.len() != 4
        || vd.len() != 4
        || kd[0] != qd[0]
        || vd[0] != qd[0]
        || kd[3] != qd[3]
        || vd[1] != kd[1]
        || vd[2] != kd[2]
        || kd[1] == 0
        || !qd[1].is_multiple_of(kd[1])
    {
        return Err(Error::invalid(
            "FlexAttention",
            format!("Q {qd:?}, K {kd:?} and V {vd:?} do not fit together"),
        ));
    }
    let dt = qs.dtype();
    let precision = match node
        .attribute
        .iter()
        .find(|a| a.name.as_deref() == Some("softmax_precision"))
        .and_then(|a| a.i)
    {
        Some(code) => crate::tensor::dtype_from_onnx(code as i32, "softmax_precision")?,
        None if dt == DType::F64 => DType::F64,
        None => DType::F32,
    };
    if !precision.is_float() {
        return Err(Error::invalid(
            "softmax_precision",
            format!("{precision:?} is not a floating-point type"),
        ));
    }
    let scale = node
        .attribute
        .iter()
        .find(|a| a.name.as_deref() == Some("scale"))
        .and_then(|a| a.f)
        .map_or(1.0 / (qd[3] as f64).sqrt(), f64::from);
    let g = imp.graph();
    let group = qd[1] / kd[1];
    // Key and value heads repeated for their groups of query heads.
    let widen = |x: NodeId, d: &[usize]| -> Result<NodeId> {
        if group == 1 {
            return Ok(x);
        }
        let x = g.reshape(x, &[d[0], d[1], 1, d[2], d[3]])?;
        let x = g.expand(x, &[d[0], d[1], group, d[2], d[3]])?;
        g.reshape(x, &[d[0], d[1] * group, d[2], d[3]])
    };
    let (k, v) = (widen(k, kd)?, widen(v, vd)?);
    let to = |x: NodeId| -> Result<NodeId> {
        if g.shape(x)?.dtype() == precision {
            Ok(x)
        } else {
            g.cast(x, precision)
        }
    };
    let kt = g.permute(k, &[0, 1, 3, 2])?;
    let scores = g.matmul(to(q)?, to(kt)?)?;
    let mut scores = g.mul(scores, g.scalar(scale, precision))?;
    if let Some(gp) = optional_subgraph(node, "score_mod") {
        scores = modify(imp, gp, scores, "score_mod")?;
    }
    let g = imp.graph();
    let mut probs = g.softmax(scores, -1)?;
    if let Some(gp) = optional_subgraph(node, "prob_mod") {
        probs = modify(imp, gp, probs, "prob_mod")?;
    }
    let g = imp.graph();
    let v = if g.shape(v)?.dtype() == precision {
        v
    } else {
        g.cast(v, precision)?
    };
    let mut y = g.matmul(probs, v)?;
    if precision != dt {
        y = g.cast(y, dt)?;
    }
    Ok(vec![slot_of(imp, y)?])
}
