//! Fusion: rewrites groups of ops into the fused ops a backend runs as one kernel.
//!
//! - Matmul epilogues: `matmul` followed by a multiply by a constant scalar (its
//!   `alpha`), a bias add (`[N]`), an activation (gelu, gelu_tanh, relu, silu, relu6, hard_swish) and a
//!   residual add (same shape), each only when the
//!   intermediate value has no other reader, become one `FusedMatMul`; a cast of
//!   `f16`/`bf16` weights to `f32` feeding the matmul is absorbed too (the kernel reads
//!   the stored weights), and so (where the backend reads transposed operands) is a
//!   permute that swaps an operand's last two axes.
//! - Convolution epilogues: `conv2d` followed by an activation, a residual add, a
//!   per-channel multiply and add (`[1, C, 1, 1]`: a batch norm after the residual
//!   add) and another activation, under the same rule, become one `FusedConv2d` (the
//!   convolution's own bias stays its bias; the affine is taken with or without a
//!   residual before it, and an activation right after the residual, a ResNet
//!   block's ReLU, rides on an identity affine of constants). A 1x1 unit-stride, unpadded convolution (which reads each
//!   input value once) also takes in the per-channel multiply, add and activation that
//!   make its input, when nothing else reads them.
//! - Elementwise regions: connected float elementwise ops of one output shape whose
//!   intermediate values are read only inside the region become one `Elementwise`.

use crate::rewrite::{Rewriter, consumers, use_counts};
use rlx_ir::{
    BinaryOp, ConvFusion, DType, EwStep, F64Bits, Graph, MAX_REGION_INPUTS, MAX_REGION_REGISTERS,
    Node, NodeId, Op, Shape, UnaryOp, fusable_binary, fusable_unary, per_channel_operand,
};
use std::collections::{BTreeSet, BinaryHeap};

/// The fused forms a backend can run (it declares them; the planner forms only these).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct FusionOptions {
    /// Form `FusedMatMul` nodes.
    pub matmul_epilogue: bool,
    /// Let a `FusedMatMul` read an operand whose last two axes a permute swapped,
    /// with no copy (the permute absorbed when nothing else reads it).
    pub transposed_operands: bool,
    /// Form `FusedConv2d` nodes.
    pub conv_epilogue: bool,
    /// Form `Elementwise` region nodes.
    pub elementwise_regions: bool,
    /// Fold the head transposes around an attention into a sequence-major attention.
    pub attention_layout: bool,
    /// Recognize attention written out as matmul, scale, mask, softmax and matmul.
    pub attention_pattern: bool,
    /// Recognize activations spelled out in primitives (an exact GELU written with
    /// `erf`) as one op.
    pub activations: bool,
    /// Turn products of gathered rows by one weight into one product and gathers
    /// (see [`hoist_gathered_matmuls`](crate::hoist::hoist_gathered_matmuls)), and
    /// products of a reordered whole tensor into a reordering of the product (see
    /// [`hoist_sliced_matmuls`](crate::hoist::hoist_sliced_matmuls)).
    pub hoist_gathered_matmuls: bool,
    /// Place the operands of a concatenation whose leading axes (before the joined
    /// one) have size 1 in its output, where each is a contiguous range: their
    /// producers write there, and the backend's concat skips an operand already in
    /// place (see the planner).
    pub concat_in_place: bool,
}

impl FusionOptions {
    /// Every fused form.
    pub const ALL: FusionOptions = FusionOptions {
        matmul_epilogue: true,
        transposed_operands: true,
        conv_epilogue: true,
        elementwise_regions: true,
        attention_layout: true,
        attention_pattern: true,
        hoist_gathered_matmuls: true,
        activations: true,
        concat_in_place: true,
    };
}

/// A matched `softmax(q @ k^T * scale + mask) @ v`.
struct AttentionMatch {
    q: NodeId,
    k: NodeId,
    /// How the fused node reads `k`: as it is, through a head swap, or reshaped.
    k_form: KeyForm,
    v: NodeId,
    mask: Option<NodeId>,
    scale: f64,
    /// Every node the pattern replaces, the final matmul last.
    nodes: Vec<usize>,
}

/// The single value of a constant node holding one element.
fn scalar_constant(graph: &Graph, node: &Node) -> Option<f64> {
    let Op::Constant { id } = node.op else {
        return None;
    };
    let data = graph.constants().get(id)?.clone();
    (node.shape.num_elements() == 1).then(|| data.as_ref().to_f64_vec().first().copied())?
}

/// Matches the attention written out in ops, ending at matmul node `end`:
/// `matmul(softmax(s, -1), v)` where `s` is `qk`, `qk * c`, `qk / c`, optionally plus a
/// float mask, and `qk = matmul(q, transpose(k))` with `[B, H, S, D]` queries and
/// values and a key in one of the forms [`key_of_transpose`] reads; every
/// intermediate read only by the next step.
fn match_attention(
    graph: &Graph,
    nodes: &[Node],
    uses: &[usize],
    end: usize,
) -> Option<AttentionMatch> {
    let single = |id: NodeId| uses[id.index()] == 1;
    let node = |id: NodeId| &nodes[id.index()];
    let out = &nodes[end];
    if out.op != Op::MatMul || out.shape.rank() != 4 || !out.shape.dtype().is_float() {
        return None;
    }
    let (mut probs, v) = (out.inputs[0], out.inputs[1]);
    let mut matched = Vec::new();
    // A guard that zeroes NaN probabilities (`where(p != p, 0, p)`, which exporters
    // add for fully masked rows) is dropped: the kernel gives such rows no NaN.
    if node(probs).op == Op::Where && single(probs) {
        let [c, zero, p] = [
            node(probs).inputs[0],
            node(probs).inputs[1],
            node(probs).inputs[2],
        ];
        let is_guard = node(c).op == Op::Binary(BinaryOp::Ne)
            && node(c).inputs[0] == p
            && node(c).inputs[1] == p
            && uses[c.index()] == 1
            && uses[p.index()] == 3
            && scalar_constant(graph, node(zero)) == Some(0.0);
        if !is_guard {
            return None;
        }
        matched.extend([probs.index(), c.index()]);
        probs = p;
    } else if !single(probs) {
        return None;
    }
    let Op::Softmax { axis: 3 } = node(probs).op else {
        return None;
    };
    matched.push(probs.index());
    let mut cur = node(probs).inputs[0];
    let mut mask = None;
    if node(cur).op == Op::Binary(BinaryOp::Add) && single(cur) {
        let [a, b] = [node(cur).inputs[0], node(cur).inputs[1]];
        // The scores: the full [B, H, Sq, Sk] operand computed by a matmul or a scale.
        let scoreish = |x: NodeId| {
            node(x).shape == node(cur).shape
                && matches!(
                    node(x).op,
                    Op::MatMul | Op::Binary(BinaryOp::Mul | BinaryOp::Div)
                )
        };
        let (scores, m) = match (scoreish(a), scoreish(b)) {
            (true, _) => (a, b),
            (false, true) => (b, a),
            _ => return None,
        };
        matched.push(cur.index());
        mask = Some(m);
        cur = scores;
    }
    let mut scale = 1.0;
    if let Op::Binary(op @ (BinaryOp::Mul | BinaryOp::Div)) = node(cur).op
        && single(cur)
    {
        let [a, b] = [node(cur).inputs[0], node(cur).inputs[1]];
        let (scores, c) = match (
            scalar_constant(graph, node(a)),
            scalar_constant(graph, node(b)),
        ) {
            (_, Some(c)) => (a, c),
            (Some(c), None) if op == BinaryOp::Mul => (b, c),
            _ => return None,
        };
        if c == 0.0 || !c.is_finite() {
            return None;
        }
        scale = if op == BinaryOp::Mul { c } else { 1.0 / c };
        matched.push(cur.index());
        cur = scores;
    }
    let qk = node(cur);
    if qk.op != Op::MatMul || !single(cur) {
        return None;
    }
    matched.push(cur.index());
    let (mut q, mut kt) = (qk.inputs[0], qk.inputs[1]);
    // Scales applied to the operands instead of the scores (`(q * a) @ (k^T * b)`).
    for x in [&mut q, &mut kt] {
        if node(*x).op == Op::Binary(BinaryOp::Mul) && single(*x) {
            let [a, b] = [node(*x).inputs[0], node(*x).inputs[1]];
            let (t, c) = match (
                scalar_constant(graph, node(a)),
                scalar_constant(graph, node(b)),
            ) {
                (_, Some(c)) => (a, c),
                (Some(c), None) => (b, c),
                _ => continue,
            };
            if c == 0.0 || !c.is_finite() {
                return None;
            }
            scale *= c;
            matched.push(x.index());
            *x = t;
        }
    }
    let (k, k_form) = key_of_transpose(nodes, kt)?;
    if [q, v].iter().any(|x| node(*x).shape.rank() != 4)
        || (!matches!(k_form, KeyForm::Flat(_)) && node(k).shape.rank() != 4)
    {
        return None;
    }
    let k_shape = match &k_form {
        KeyForm::Heads => node(k).shape.clone(),
        KeyForm::SeqMajor => head_swapped(&node(k).shape),
        KeyForm::Flat(shape) => shape.clone(),
    };
    // The fused node must be a valid attention of the same result (batch dims that
    // the matmuls broadcast, for one, are not).
    let op = Op::Attention {
        scale: F64Bits::new(scale),
        causal: false,
        seq_major: false,
    };
    let mut shapes = vec![&node(q).shape, &k_shape, &node(v).shape];
    if let Some(m) = mask {
        shapes.push(&node(m).shape);
    }
    if rlx_ir::infer_shape(&op, &shapes).ok().as_ref() != Some(&out.shape) {
        return None;
    }
    // The transpose stays for any other reader; it dies with the pattern otherwise.
    matched.push(end);
    Some(AttentionMatch {
        q,
        k,
        k_form,
        v,
        mask,
        scale,
        nodes: matched,
    })
}

/// How the key an attention pattern transposed is laid out.
#[derive(Clone, Debug, PartialEq)]
enum KeyForm {
    /// `[B, H, S, D]`, as the fused node reads it.
    Heads,
    /// `[B, S, H, D]` (its transpose written as one `permute(k, [0, 2, 3, 1])`): read
    /// through a head swap.
    SeqMajor,
    /// `[B * H, S, D]` (heads split into a rank-3 value before the transpose): read
    /// through a reshape to this `[B, H, S, D]` shape.
    Flat(rlx_ir::Shape),
}

/// `[B, S, H, D]` as `[B, H, S, D]` (or back).
fn head_swapped(shape: &rlx_ir::Shape) -> rlx_ir::Shape {
    let d = shape.dims();
    rlx_ir::Shape::new(&[d[0], d[2], d[1], d[3]], shape.dtype())
}

/// The key whose transpose `kt` is, and its form: a `[B, H, S, D]` key as
/// `permute(k, [0, 1, 3, 2])`, or the same spelled `reshape(permute(reshape(k,
/// [B*H, S, D]), [0, 2, 1]), [B, H, D, S])`; a `[B, S, H, D]` key as `permute(k,
/// [0, 2, 3, 1])` (heads split and transposed in one permute, as Whisper's export
/// has it); a `[B*H, S, D]` key as `reshape(permute(k, [0, 2, 1]), [B, H, D, S])`
/// (heads split into a rank-3 value, as ViT's dynamo export has it).
fn key_of_transpose(nodes: &[Node], kt: NodeId) -> Option<(NodeId, KeyForm)> {
    let node = |id: NodeId| &nodes[id.index()];
    if matches!(&node(kt).op, Op::Permute { perm } if perm.as_slice() == [0, 1, 3, 2]) {
        return Some((node(kt).inputs[0], KeyForm::Heads));
    }
    if matches!(&node(kt).op, Op::Permute { perm } if perm.as_slice() == [0, 2, 3, 1]) {
        return Some((node(kt).inputs[0], KeyForm::SeqMajor));
    }
    let Op::Reshape { .. } = node(kt).op else {
        return None;
    };
    let p = node(kt).inputs[0];
    if !matches!(&node(p).op, Op::Permute { perm } if perm.as_slice() == [0, 2, 1]) {
        return None;
    }
    let r = node(p).inputs[0];
    let ktd = node(kt).shape.dims();
    let rd = node(r).shape.dims();
    if ktd.len() != 4 || rd.len() != 3 || rd != [ktd[0] * ktd[1], ktd[3], ktd[2]] {
        return None;
    }
    // The chain stays for any other reader; dead-code elimination removes it otherwise.
    if let Op::Reshape { .. } = node(r).op {
        let k = node(r).inputs[0];
        let kd = node(k).shape.dims();
        if kd == [ktd[0], ktd[1], ktd[3], ktd[2]] {
            return Some((k, KeyForm::Heads));
        }
    }
    let heads = rlx_ir::Shape::new(&[ktd[0], ktd[1], ktd[3], ktd[2]], node(r).shape.dtype());
    Some((r, KeyForm::Flat(heads)))
}

/// Attention written out in ops (`softmax(q @ k^T * scale + mask) @ v`, as exported
/// models spell it) becomes one `attention` node: the fused kernel never materializes
/// the whole score matrix.
pub fn fuse_attention_pattern(graph: &Graph) -> Fused {
    let uses = use_counts(graph);
    let nodes = graph.nodes();
    let mut absorbed = vec![false; nodes.len()];
    let mut at_end: Vec<Option<AttentionMatch>> = (0..nodes.len()).map(|_| None).collect();
    for (end, slot) in at_end.iter_mut().enumerate() {
        if let Some(m) = match_attention(graph, &nodes, &uses, end)
            && m.nodes.iter().all(|&n| !absorbed[n])
        {
            for &n in &m.nodes {
                absorbed[n] = true;
            }
            *slot = Some(m);
        }
    }
    let mut w = Rewriter::new(nodes.len());
    let mut records = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        if let Some(m) = &at_end[i] {
            let k = match &m.k_form {
                KeyForm::Heads => w.map(m.k),
                KeyForm::SeqMajor => {
                    let seq_major = &nodes[m.k.index()].shape;
                    w.insert(Node {
                        op: Op::Permute {
                            perm: HEAD_SWAP.to_vec(),
                        },
                        inputs: vec![m.k],
                        shape: head_swapped(seq_major),
                    })
                }
                KeyForm::Flat(shape) => w.insert(Node {
                    op: Op::Reshape {
                        dims: shape.dims().to_vec(),
                    },
                    inputs: vec![m.k],
                    shape: shape.clone(),
                }),
            };
            let mut inputs = vec![w.map(m.q), k, w.map(m.v)];
            inputs.extend(m.mask.map(|x| w.map(x)));
            w.place_with_new_inputs(
                i,
                Node {
                    op: Op::Attention {
                        scale: F64Bits::new(m.scale),
                        causal: false,
                        seq_major: false,
                    },
                    inputs,
                    shape: node.shape.clone(),
                },
            );
            let mut replaced: Vec<usize> = m.nodes.clone();
            replaced.sort_unstable();
            records.push((
                i,
                replaced
                    .iter()
                    .map(|&n| format!("{} %{n}", nodes[n].op.name()))
                    .collect(),
            ));
        } else if !absorbed[i] {
            w.place(i, node.clone());
        }
    }
    finish(graph, w, records)
}

/// `[B, S, H, D] <-> [B, H, S, D]`.
const HEAD_SWAP: [usize; 4] = [0, 2, 1, 3];

fn is_head_swap(op: &Op) -> bool {
    matches!(op, Op::Permute { perm } if perm.as_slice() == HEAD_SWAP)
}

/// The non-unit axes of `dims` in order, as positions.
fn long_axes(dims: &[usize]) -> Vec<usize> {
    (0..dims.len()).filter(|&a| dims[a] != 1).collect()
}

/// Whether `perm` over `dims` keeps three axes longer than 1 and swaps the first two
/// of them (`[s, h, d]` to `[h, s, d]`, whatever unit axes lie between).
fn swaps_first_two_long_axes(perm: &[usize], dims: &[usize]) -> bool {
    let long = long_axes(dims);
    let moved: Vec<usize> = perm.iter().copied().filter(|&a| dims[a] != 1).collect();
    long.len() == 3 && moved == [long[1], long[0], long[2]]
}

/// Where attention operand `x` (`[b, h, s, d]`) comes from as a sequence-major
/// `[b, s, h, d]` value, and whether that value needs a reshape to those dims: a
/// head-swapping permute's operand; `x` itself where it has one head or one
/// position; or, with `b` 1, through a reshape of a permute that swaps the first
/// two of its three long axes (torchvision's attention splits heads as `[s, h, d]`
/// to `[h, s, d]`, then reshapes to `[1, h, s, d]`).
fn sequence_major_source(nodes: &[Node], x: NodeId) -> Option<(NodeId, bool)> {
    let node = &nodes[x.index()];
    if is_head_swap(&node.op) {
        return Some((node.inputs[0], false));
    }
    let dims = node.shape.dims();
    if dims.len() == 4 && (dims[1] == 1 || dims[2] == 1) {
        // One head (grouped keys and values) or one position: both layouts hold the
        // same order.
        return Some((x, true));
    }
    if !matches!(node.op, Op::Reshape { .. }) || dims.len() != 4 || dims[0] != 1 {
        return None;
    }
    if dims[1..].contains(&1) {
        return None;
    }
    let permute = &nodes[node.inputs[0].index()];
    let Op::Permute { perm } = &permute.op else {
        return None;
    };
    let source = permute.inputs[0];
    let from = nodes[source.index()].shape.dims();
    let long: Vec<usize> = long_axes(from).iter().map(|&a| from[a]).collect();
    (swaps_first_two_long_axes(perm, from) && long == [dims[2], dims[1], dims[3]])
        .then_some((source, true))
}

/// The reader of attention node `a`'s output (`[b, h, s, d]`) that swaps its heads
/// and sequence axes back, and whether its dims differ from `[b, s, h, d]` (then
/// the sequence-major result is reshaped to them): a head-swapping permute, or, with
/// `b` 1, a permute that swaps the first two of the three long axes.
fn sequence_major_reader(
    nodes: &[Node],
    a: usize,
    (uses, readers): (&[usize], &[Vec<usize>]),
) -> Option<(usize, bool)> {
    let [r] = readers[a].as_slice() else {
        return None;
    };
    if uses[a] != 1 {
        return None;
    }
    let op = &nodes[*r].op;
    if is_head_swap(op) {
        return Some((*r, false));
    }
    let dims = nodes[a].shape.dims();
    let swaps = matches!(op, Op::Permute { perm } if dims.len() == 4
        && dims[0] == 1
        && !dims[1..].contains(&1)
        && swaps_first_two_long_axes(perm, dims));
    swaps.then_some((*r, true))
}

/// An attention [`fuse_attention_layout`] folds: its node, its operands'
/// sequence-major sources ([`sequence_major_source`]) and its output's reader
/// ([`sequence_major_reader`]).
#[derive(Clone, Copy)]
struct LayoutFold {
    attention: usize,
    sources: [(NodeId, bool); 3],
    reader: (usize, bool),
}

/// `permute(attention(permute(q), permute(k), permute(v), mask))` with the heads and
/// sequence axes swapped in each permute becomes `attention_seq_major(q, k, v, mask)`:
/// the kernel reads and writes the sequence-major layout directly, and the transposes
/// (copies) disappear. With one batch, a permute that moves unit axes too (and the
/// reshapes around it) counts as the swap: the fused node reads its operand and
/// writes its result through reshapes (views).
pub fn fuse_attention_layout(graph: &Graph) -> Fused {
    let uses = use_counts(graph);
    let readers = consumers(graph);
    let nodes = graph.nodes();
    let mut found: Vec<LayoutFold> = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        let Op::Attention {
            seq_major: false, ..
        } = node.op
        else {
            continue;
        };
        let sources: Vec<(NodeId, bool)> = node.inputs[..3]
            .iter()
            .filter_map(|&x| sequence_major_source(&nodes, x))
            .collect();
        let (Ok(sources), Some(reader)) = (
            <[(NodeId, bool); 3]>::try_from(sources),
            sequence_major_reader(&nodes, i, (&uses, &readers)),
        ) else {
            continue;
        };
        found.push(LayoutFold {
            attention: i,
            sources,
            reader,
        });
    }
    let mut w = Rewriter::new(nodes.len());
    let mut records = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        if found.iter().any(|f| f.attention == i) {
            continue;
        }
        let Some(&LayoutFold {
            attention: a,
            sources,
            reader: (_, reshaped),
        }) = found.iter().find(|f| f.reader.0 == i)
        else {
            w.place(i, node.clone());
            continue;
        };
        let att = &nodes[a];
        let Op::Attention { scale, causal, .. } = att.op else {
            continue;
        };
        let dims = att.shape.dims();
        // Each operand's own `[b, s, h, d]` (keys and values may differ from the
        // queries in heads, length and width).
        let swapped = |d: &[usize]| [d[0], d[2], d[1], d[3]];
        let seq_major = swapped(dims);
        let mut inputs: Vec<NodeId> = sources
            .iter()
            .zip(&att.inputs)
            .map(|(&(source, reshape), &operand)| match reshape {
                false => w.map(source),
                true => {
                    let target = swapped(nodes[operand.index()].shape.dims());
                    w.insert(Node {
                        op: Op::Reshape {
                            dims: target.to_vec(),
                        },
                        inputs: vec![source],
                        shape: Shape::new(&target, nodes[source.index()].shape.dtype()),
                    })
                }
            })
            .collect();
        inputs.extend(att.inputs.get(3).map(|&m| w.map(m)));
        let fused = Node {
            op: Op::Attention {
                scale,
                causal,
                seq_major: true,
            },
            inputs,
            shape: Shape::new(&seq_major, att.shape.dtype()),
        };
        if reshaped {
            // The fused node stands for the attention; its reader becomes a view.
            w.place_with_new_inputs(a, fused);
            w.place_with_new_inputs(
                i,
                Node {
                    op: Op::Reshape {
                        dims: node.shape.dims().to_vec(),
                    },
                    inputs: vec![w.map(NodeId::from_index(a))],
                    shape: node.shape.clone(),
                },
            );
        } else {
            w.place_with_new_inputs(i, fused);
            // Records of earlier passes that name the attention now name its
            // replacement.
            w.alias(a, NodeId::from_index(i));
        }
        let mut replaced: Vec<String> = att.inputs[..3]
            .iter()
            .map(|x| format!("permute %{}", x.index()))
            .collect();
        replaced.push(format!("attention %{a}"));
        replaced.push(format!("permute %{i}"));
        records.push((if reshaped { a } else { i }, replaced));
    }
    finish(graph, w, records)
}

/// A fused node and the ops it replaced (in order, as `op` names with their original
/// node ids), for `rlx inspect`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct FusionRecord {
    /// The fused node in the rewritten graph.
    pub node: NodeId,
    /// The ops it computes, e.g. `["matmul %12", "add %14", "gelu %15"]`.
    pub replaced: Vec<String>,
}

/// The most steps one region holds (the IR allows `MAX_REGION_REGISTERS` registers,
/// inputs included).
const MAX_REGION_STEPS: usize = MAX_REGION_REGISTERS - MAX_REGION_INPUTS;

/// The activation `op` is, when a matmul or convolution epilogue can apply it.
pub(crate) fn epilogue_activation(op: &Op) -> Option<UnaryOp> {
    match op {
        Op::Unary(
            u @ (UnaryOp::Gelu
            | UnaryOp::GeluTanh
            | UnaryOp::Relu
            | UnaryOp::Silu
            | UnaryOp::Relu6
            | UnaryOp::HardSwish),
        ) => Some(*u),
        _ => None,
    }
}

struct Epilogue {
    /// The matmul or convolution the epilogue follows.
    matmul: usize,
    /// A cast of half-precision weights to `f32` feeding `b`, read natively instead.
    b_cast: Option<usize>,
    /// Permutes swapping the last two axes of `a` and of `b`, read transposed instead.
    swaps: [Option<usize>; 2],
    /// The scale of the product (a multiply by a constant scalar right after it).
    alpha: f64,
    last: usize,
    bias: Option<NodeId>,
    activation: Option<UnaryOp>,
    residual: Option<NodeId>,
    /// A per-channel scale and shift after the residual (convolutions only).
    channel_affine: Option<(NodeId, NodeId)>,
    /// An activation right after the residual (no batch norm between) rides on an
    /// identity affine (scale 1, shift 0: exact), the epilogue's one place for an
    /// activation after the residual.
    identity_affine: bool,
    post_activation: Option<UnaryOp>,
    /// The ops that make the input, absorbed.
    prologue: Option<InputPrologue>,
    absorbed: Vec<usize>,
}

/// A convolution's input written as `activation(source * scale + shift)`, or
/// `activation(source * scale)` (a squeeze-and-excitation block's channel scaling):
/// then the shift is a constant `-0`, which adds nothing to any value, `-0`
/// included.
#[derive(Clone, Copy)]
struct InputPrologue {
    source: NodeId,
    scale: NodeId,
    shift: Option<NodeId>,
    activation: Option<UnaryOp>,
}

/// The per-channel affine and activation that make a 1x1 unit-stride convolution's
/// input, when only the convolution reads them, with the nodes they replace.
fn input_prologue(
    nodes: &[Node],
    conv: usize,
    (uses, readers): (&[usize], &[Vec<usize>]),
    claimed: &[bool],
) -> Option<(InputPrologue, Vec<usize>)> {
    let Op::Conv2d { window, .. } = &nodes[conv].op else {
        return None;
    };
    let pointwise = window.kernel == [1, 1] && window.stride == [1, 1] && window.padding == [0; 4];
    let x = nodes[conv].inputs[0].index();
    let shape = &nodes[x].shape;
    if !pointwise || shape.rank() != 4 {
        return None;
    }
    let only_for = |k: usize, reader: usize| uses[k] == 1 && readers[k] == [reader] && !claimed[k];
    let per_channel = |n: NodeId| per_channel_operand(&nodes[n.index()].shape, shape.dim(1));
    let mut absorbed = Vec::new();
    let (activation, add) = match epilogue_activation(&nodes[x].op) {
        Some(act) if only_for(x, conv) => {
            absorbed.push(x);
            (Some(act), nodes[x].inputs[0].index())
        }
        _ => (None, x),
    };
    let add_reader = absorbed.last().copied().unwrap_or(conv);
    if !only_for(add, add_reader) {
        return None;
    }
    let (mul, shift) = if nodes[add].op == Op::Binary(BinaryOp::Add) {
        // The add's operands: the multiply and the shift, in either order.
        let ins = &nodes[add].inputs;
        let (mul, shift) = [(ins[0], ins[1]), (ins[1], ins[0])]
            .into_iter()
            .find(|&(m, s)| nodes[m.index()].op == Op::Binary(BinaryOp::Mul) && per_channel(s))?;
        let mul = mul.index();
        if !only_for(mul, add) || nodes[add].shape != *shape {
            return None;
        }
        absorbed.push(add);
        (mul, Some(shift))
    } else {
        (add, None)
    };
    if nodes[mul].op != Op::Binary(BinaryOp::Mul) || nodes[mul].shape != *shape {
        return None;
    }
    let ins = &nodes[mul].inputs;
    let (source, scale) = [(ins[0], ins[1]), (ins[1], ins[0])]
        .into_iter()
        .find(|&(src, s)| per_channel(s) && nodes[src.index()].shape == *shape)?;
    absorbed.push(mul);
    let prologue = InputPrologue {
        source,
        scale,
        shift,
        activation,
    };
    Some((prologue, absorbed))
}

/// Folds bias, activation and residual adds into the matmuls that feed them (if
/// `matmuls`), and activations, residual adds and per-channel affines (with their
/// activation) into convolutions, with the per-channel affine and activation that
/// make a 1x1 convolution's input (if `convs`); with `transposes`, a matmul also
/// absorbs permutes that swap its operands' last two axes (even with no epilogue).
pub fn fuse_epilogues(graph: &Graph, matmuls: bool, convs: bool, transposes: bool) -> Fused {
    let uses = use_counts(graph);
    let readers = consumers(graph);
    let nodes = graph.nodes();
    let only_reader = |i: usize| -> Option<usize> {
        (uses[i] == 1 && readers[i].len() == 1).then(|| readers[i][0])
    };
    let mut found: Vec<Epilogue> = Vec::new();
    // An add of two matmul chains is reachable from both; the first chain claims it.
    let mut claimed = vec![false; nodes.len()];
    for (i, node) in nodes.iter().enumerate() {
        let is_matmul = matmuls
            && node.op == Op::MatMul
            && nodes[node.inputs[0].index()].shape.rank() >= 2
            && nodes[node.inputs[1].index()].shape.rank() >= 2;
        let is_conv = convs && matches!(node.op, Op::Conv2d { .. });
        if !is_matmul && !is_conv {
            continue;
        }
        let shape = &node.shape;
        let n = shape.dims().last().copied().unwrap_or(0);
        let b = node.inputs[1];
        let b_cast = match nodes[b.index()].op {
            Op::Cast(DType::F32)
                if is_matmul
                    && uses[b.index()] == 1
                    && node.shape.dtype() == DType::F32
                    && matches!(
                        nodes[nodes[b.index()].inputs[0].index()].shape.dtype(),
                        DType::F16 | DType::BF16
                    ) =>
            {
                Some(b.index())
            }
            _ => None,
        };
        // An operand made by a permute that swaps its last two axes and that nothing
        // else reads: the product reads the permute's input transposed.
        let swapped = |x: NodeId| -> Option<usize> {
            let k = x.index();
            let Op::Permute { perm } = &nodes[k].op else {
                return None;
            };
            let r = perm.len();
            let swaps_last_two = r >= 2
                && perm[..r - 2].iter().enumerate().all(|(a, &p)| a == p)
                && perm[r - 2] == r - 1
                && perm[r - 1] == r - 2;
            (transposes && is_matmul && swaps_last_two && uses[k] == 1 && !claimed[k]).then_some(k)
        };
        let swaps = [
            swapped(node.inputs[0]),
            if b_cast.is_none() { swapped(b) } else { None },
        ];
        let mut e = Epilogue {
            matmul: i,
            b_cast,
            swaps,
            alpha: 1.0,
            last: i,
            bias: None,
            activation: None,
            residual: None,
            channel_affine: None,
            identity_affine: false,
            post_activation: None,
            prologue: None,
            absorbed: vec![i],
        };
        if is_conv
            && let Some((prologue, nodes_in)) =
                input_prologue(&nodes, i, (&uses, &readers), &claimed)
        {
            e.prologue = Some(prologue);
            e.absorbed.extend(nodes_in);
        }
        let other_operand = |j: usize, cur: usize| -> Option<NodeId> {
            let ins = &nodes[j].inputs;
            match (ins[0].index() == cur, ins[1].index() == cur) {
                (true, false) => Some(ins[1]),
                (false, true) => Some(ins[0]),
                _ => None,
            }
        };
        let only_reader = |i: usize| only_reader(i).filter(|&j| !claimed[j]);
        if let Some(j) = only_reader(e.last)
            && is_matmul
            && nodes[j].op == Op::Binary(BinaryOp::Mul)
            && nodes[j].shape == *shape
            && let Some(s) = other_operand(j, e.last)
            && let Some(alpha) = scalar_constant(graph, &nodes[s.index()])
        {
            e.alpha = alpha;
            e.absorbed.push(j);
            e.last = j;
        }
        if let Some(j) = only_reader(e.last)
            && is_matmul
            && nodes[j].op == Op::Binary(BinaryOp::Add)
            && nodes[j].shape == *shape
            && let Some(b) = other_operand(j, e.last)
            && nodes[b.index()].shape.dims() == [n]
        {
            e.bias = Some(b);
            e.absorbed.push(j);
            e.last = j;
        }
        if let Some(j) = only_reader(e.last)
            && let Some(act) = epilogue_activation(&nodes[j].op)
        {
            e.activation = Some(act);
            e.absorbed.push(j);
            e.last = j;
        }
        if let Some(j) = only_reader(e.last)
            && nodes[j].op == Op::Binary(BinaryOp::Add)
            && nodes[j].shape == *shape
            && let Some(r) = other_operand(j, e.last)
            && nodes[r.index()].shape == *shape
        {
            e.residual = Some(r);
            e.absorbed.push(j);
            e.last = j;
        }
        // A batch norm after the residual add: `* scale + shift`, per channel.
        let per_channel = |x: NodeId| {
            shape.rank() == 4 && per_channel_operand(&nodes[x.index()].shape, shape.dim(1))
        };
        if is_conv
            && let Some(j) = only_reader(e.last)
            && nodes[j].op == Op::Binary(BinaryOp::Mul)
            && nodes[j].shape == *shape
            && let Some(scale) = other_operand(j, e.last)
            && per_channel(scale)
            && let Some(k) = only_reader(j)
            && nodes[k].op == Op::Binary(BinaryOp::Add)
            && nodes[k].shape == *shape
            && let Some(shift) = other_operand(k, j)
            && per_channel(shift)
        {
            e.channel_affine = Some((scale, shift));
            e.absorbed.extend([j, k]);
            e.last = k;
            if let Some(a) = only_reader(k)
                && let Some(act) = epilogue_activation(&nodes[a].op)
            {
                e.post_activation = Some(act);
                e.absorbed.push(a);
                e.last = a;
            }
        }
        if is_conv
            && e.residual.is_some()
            && e.channel_affine.is_none()
            && let Some(a) = only_reader(e.last)
            && let Some(act) = epilogue_activation(&nodes[a].op)
        {
            // A ReLU after a residual block's skip add.
            e.identity_affine = true;
            e.post_activation = Some(act);
            e.absorbed.push(a);
            e.last = a;
        }
        if e.absorbed.len() > 1 || e.b_cast.is_some() || e.swaps.iter().any(Option::is_some) {
            for &a in e.absorbed.iter().chain(e.swaps.iter().flatten()) {
                claimed[a] = true;
            }
            found.push(e);
        }
    }
    let mut absorbed_into = vec![None; nodes.len()];
    for (k, e) in found.iter().enumerate() {
        for &a in e
            .absorbed
            .iter()
            .chain(&e.b_cast)
            .chain(e.swaps.iter().flatten())
        {
            absorbed_into[a] = Some(k);
        }
    }
    let mut w = Rewriter::new(nodes.len());
    let mut extra_constants: Vec<rlx_ir::TensorData> = Vec::new();
    let mut records = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        match absorbed_into[i] {
            Some(k) if found[k].last == i => {
                let e = &found[k];
                let mm = &nodes[e.matmul];
                let mut inputs = mm.inputs.clone();
                if let Some(p) = e.prologue {
                    inputs[0] = p.source;
                }
                if let Some(c) = e.b_cast {
                    inputs[1] = nodes[c].inputs[0];
                }
                for (slot, swap) in e.swaps.iter().enumerate() {
                    if let Some(p) = swap {
                        inputs[slot] = nodes[*p].inputs[0];
                    }
                }
                inputs.extend(e.bias);
                inputs.extend(e.residual);
                if let Some((scale, shift)) = e.channel_affine {
                    inputs.extend([scale, shift]);
                }
                let mut inputs: Vec<NodeId> = inputs.iter().map(|&id| w.map(id)).collect();
                // A constant of `shape` filled with `value`, as a new node.
                let mut filled = |w: &mut Rewriter, value: f64, shape: rlx_ir::Shape| {
                    extra_constants.push(rlx_ir::TensorData::from_f64(
                        shape.dtype(),
                        &vec![value; shape.num_elements()],
                    ));
                    let id = graph.constants().len() + extra_constants.len() - 1;
                    w.insert(Node {
                        op: Op::Constant { id },
                        inputs: Vec::new(),
                        shape,
                    })
                };
                if e.identity_affine {
                    let dims = [1, node.shape.dims().get(1).copied().unwrap_or(1), 1, 1];
                    for value in [1.0, 0.0] {
                        let shape = rlx_ir::Shape::new(&dims, node.shape.dtype());
                        inputs.push(filled(&mut w, value, shape));
                    }
                }
                if let Some(p) = e.prologue {
                    inputs.push(w.map(p.scale));
                    inputs.push(match p.shift {
                        Some(shift) => w.map(shift),
                        None => filled(&mut w, -0.0, nodes[p.scale.index()].shape.clone()),
                    });
                }
                let op = match mm.op {
                    Op::Conv2d { window, groups } => Op::FusedConv2d {
                        window,
                        groups,
                        fusion: ConvFusion {
                            bias: mm.inputs.len() > 2,
                            activation: e.activation,
                            residual: e.residual.is_some(),
                            channel_affine: e.channel_affine.is_some() || e.identity_affine,
                            post_activation: e.post_activation,
                            input_affine: e.prologue.is_some(),
                            input_activation: e.prologue.and_then(|p| p.activation),
                        },
                    },
                    _ => Op::FusedMatMul {
                        alpha: F64Bits::new(e.alpha),
                        transpose_a: e.swaps[0].is_some(),
                        transpose_b: e.swaps[1].is_some(),
                        bias: e.bias.is_some(),
                        activation: e.activation,
                        residual: e.residual.is_some(),
                    },
                };
                w.place_with_new_inputs(
                    i,
                    Node {
                        op,
                        inputs,
                        shape: node.shape.clone(),
                    },
                );
                let mut replaced: Vec<usize> = e
                    .absorbed
                    .iter()
                    .chain(&e.b_cast)
                    .chain(e.swaps.iter().flatten())
                    .copied()
                    .collect();
                replaced.sort_unstable();
                records.push((
                    i,
                    replaced
                        .iter()
                        .map(|&a| format!("{} %{a}", nodes[a].op.name()))
                        .collect(),
                ));
            }
            Some(_) => {}
            None => w.place(i, node.clone()),
        }
    }
    finish_with(graph, w, records, extra_constants)
}

fn region_member(node: &Node) -> bool {
    node.shape.dtype().is_float()
        && match node.op {
            Op::Unary(u) => fusable_unary(u),
            Op::Binary(b) => fusable_binary(b),
            _ => false,
        }
}

/// Whether a region member is cheap enough to compute again in every reader's region
/// rather than once into memory: a negation, an absolute value, or arithmetic other
/// than a division or power.
fn cheap_to_repeat(op: &Op) -> bool {
    matches!(
        op,
        Op::Unary(UnaryOp::Neg | UnaryOp::Abs)
            | Op::Binary(
                BinaryOp::Add | BinaryOp::Sub | BinaryOp::Mul | BinaryOp::Max | BinaryOp::Min
            )
    )
}

/// Gives every elementwise reader of a cheap shared elementwise op a copy of its own
/// (a gradient scaled by the clipping factor, read by both of Adam's moment updates),
/// so that region fusion takes a copy into each reader's region and the shared value
/// is never written out and read back. Only an op with at most one operand of its
/// own size (the others broadcast: a scalar, a row) is copied, so the copies read no
/// more than the readers would have: that one operand instead of the shared value.
/// (A reader whose region is already at its input or step limit leaves its copy
/// outside, written out like the shared value was; regions that large are rare.)
pub fn duplicate_shared_leaves(graph: &Graph) -> Fused {
    let readers = consumers(graph);
    let outputs: BTreeSet<usize> = graph.outputs().iter().map(|o| o.index()).collect();
    let nodes = graph.nodes();
    let copied: Vec<bool> = (0..nodes.len())
        .map(|i| {
            let n = &nodes[i];
            let full: BTreeSet<usize> = n
                .inputs
                .iter()
                .map(|x| x.index())
                .filter(|&x| nodes[x].shape.num_elements() == n.shape.num_elements())
                .collect();
            let distinct: BTreeSet<usize> = readers[i].iter().copied().collect();
            cheap_to_repeat(&n.op)
                && region_member(n)
                && !outputs.contains(&i)
                && distinct.len() >= 2
                && full.len() <= 1
                && distinct
                    .iter()
                    .all(|&r| region_member(&nodes[r]) && nodes[r].shape == n.shape)
        })
        .collect();
    let mut w = Rewriter::new(nodes.len());
    for (i, node) in nodes.iter().enumerate() {
        if !node.inputs.iter().any(|x| copied[x.index()]) {
            w.place(i, node.clone());
            continue;
        }
        // One copy per reader, however many of its operands read the shared value.
        let mut copies: Vec<(NodeId, NodeId)> = Vec::new();
        let mut inputs = Vec::with_capacity(node.inputs.len());
        for &x in &node.inputs {
            if !copied[x.index()] {
                inputs.push(w.map(x));
                continue;
            }
            let copy = match copies.iter().find(|(shared, _)| *shared == x) {
                Some(&(_, copy)) => copy,
                None => {
                    let copy = w.insert(nodes[x.index()].clone());
                    copies.push((x, copy));
                    copy
                }
            };
            inputs.push(copy);
        }
        w.place_with_new_inputs(
            i,
            Node {
                inputs,
                ..node.clone()
            },
        );
    }
    // No records: the readers are region members, which the region pass absorbs (its
    // records name the copies among their members).
    finish(graph, w, Vec::new())
}

/// Merges connected elementwise ops into `Elementwise` regions.
pub fn fuse_elementwise_regions(graph: &Graph) -> Fused {
    let uses = use_counts(graph);
    let readers = consumers(graph);
    let outputs: BTreeSet<usize> = graph.outputs().iter().map(|o| o.index()).collect();
    let nodes = graph.nodes();
    let mut region_of = vec![None::<usize>; nodes.len()];
    // Per region: its members (in order), its external inputs, and its program.
    let mut regions: Vec<(Vec<usize>, Vec<NodeId>, Vec<EwStep>)> = Vec::new();
    for root in (0..nodes.len()).rev() {
        if region_of[root].is_some() || !region_member(&nodes[root]) {
            continue;
        }
        let id = regions.len();
        let mut members = vec![root];
        region_of[root] = Some(id);
        let mut candidates: BinaryHeap<usize> =
            nodes[root].inputs.iter().map(|x| x.index()).collect();
        while let Some(p) = candidates.pop() {
            if region_of[p].is_some()
                || !region_member(&nodes[p])
                || nodes[p].shape != nodes[root].shape
                || outputs.contains(&p)
                || members.len() >= MAX_REGION_STEPS
                || readers[p].len() != uses[p]
                || !readers[p].iter().all(|&r| region_of[r] == Some(id))
            {
                continue;
            }
            region_of[p] = Some(id);
            members.push(p);
            candidates.extend(nodes[p].inputs.iter().map(|x| x.index()));
            if external_inputs(&nodes, &members, &region_of, id).len() > MAX_REGION_INPUTS {
                region_of[p] = None;
                members.pop();
            }
        }
        members.sort_unstable();
        let inputs = external_inputs(&nodes, &members, &region_of, id);
        let program = (members.len() >= 2)
            .then(|| region_program(&nodes, &members, &inputs))
            .flatten();
        let Some(steps) = program else {
            for &m in &members {
                region_of[m] = None;
            }
            continue;
        };
        regions.push((members, inputs, steps));
    }
    let mut w = Rewriter::new(nodes.len());
    let mut records = Vec::new();
    for (i, node) in nodes.iter().enumerate() {
        let Some(id) = region_of[i] else {
            w.place(i, node.clone());
            continue;
        };
        let (members, inputs, steps) = &regions[id];
        if members.last() != Some(&i) {
            continue;
        }
        w.place(
            i,
            Node {
                op: Op::Elementwise {
                    steps: steps.clone(),
                },
                inputs: inputs.clone(),
                shape: node.shape.clone(),
            },
        );
        records.push((
            i,
            members
                .iter()
                .map(|&m| format!("{} %{m}", nodes[m].op.name()))
                .collect(),
        ));
    }
    finish(graph, w, records)
}

/// The register program of a region: inputs are registers `0..inputs.len()`, member
/// `k` (in order) is register `inputs.len() + k`. `None` if a member is not a unary or
/// binary op or reads a value that is neither an input nor an earlier member.
fn region_program(nodes: &[Node], members: &[usize], inputs: &[NodeId]) -> Option<Vec<EwStep>> {
    let register = |x: NodeId| -> Option<u16> {
        let r = match members.iter().position(|&m| m == x.index()) {
            Some(k) => inputs.len() + k,
            None => inputs.iter().position(|&y| y == x)?,
        };
        u16::try_from(r).ok()
    };
    members
        .iter()
        .map(|&m| {
            let ins = &nodes[m].inputs;
            match nodes[m].op {
                Op::Unary(u) => Some(EwStep::Unary(u, register(ins[0])?)),
                Op::Binary(b) => Some(EwStep::Binary(b, register(ins[0])?, register(ins[1])?)),
                _ => None,
            }
        })
        .collect()
}

/// Operands of region `id` computed outside it, in order of first use.
fn external_inputs(
    nodes: &[Node],
    members: &[usize],
    region_of: &[Option<usize>],
    id: usize,
) -> Vec<NodeId> {
    let mut sorted = members.to_vec();
    sorted.sort_unstable();
    let mut inputs: Vec<NodeId> = Vec::new();
    for &m in &sorted {
        for &x in &nodes[m].inputs {
            if region_of[x.index()] != Some(id) && !inputs.contains(&x) {
                inputs.push(x);
            }
        }
    }
    inputs
}

/// The result of a fusion pass: the new graph, its fused nodes, and for every old node
/// its new id (absorbed nodes map to themselves and must not be looked up).
pub struct Fused {
    /// The rewritten graph.
    pub graph: Graph,
    /// Fused nodes, with the ops they replaced.
    pub records: Vec<FusionRecord>,
    /// New id of each old node.
    pub remap: Vec<NodeId>,
}

pub(crate) fn finish(graph: &Graph, w: Rewriter, records: Vec<(usize, Vec<String>)>) -> Fused {
    finish_with(graph, w, records, Vec::new())
}

/// [`finish`] for a pass that added constants (`extra`, numbered after the graph's).
fn finish_with(
    graph: &Graph,
    w: Rewriter,
    records: Vec<(usize, Vec<String>)>,
    extra: Vec<rlx_ir::TensorData>,
) -> Fused {
    let records = records
        .into_iter()
        .map(|(old, replaced)| FusionRecord {
            node: w.map(NodeId::from_index(old)),
            replaced,
        })
        .collect();
    let remap = (0..graph.len())
        .map(|i| w.map(NodeId::from_index(i)))
        .collect();
    let mut constants = graph.constants().to_vec();
    constants.extend(extra);
    Fused {
        graph: w.finish(graph, constants),
        records,
        remap,
    }
}
