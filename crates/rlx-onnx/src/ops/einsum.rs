//! `Einsum` in primitives: diagonals as strided slices, sums over indices that one
//! operand alone carries, then each further operand contracted into the running
//! result with one batched matrix product, and a final transpose to the output order.

use super::{Converter, unsupported};
use crate::import::Cx;
use rlx_ir::{Error, NodeId, Result};

pub(super) const NAMES: &[&str] = &["Einsum"];

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "Einsum" => einsum,
        _ => return None,
    })
}

/// An index of the equation: a letter's code, or `ELLIPSIS + j` for the `j`-th of
/// the broadcast dimensions an ellipsis stands for (counted from the left of the
/// widest one).
type Index = u32;
const ELLIPSIS: Index = 1 << 16;

/// One side of a term: its letters, with the position of `...` if it has one.
struct Term {
    letters: Vec<Index>,
    ellipsis_at: Option<usize>,
}

fn bad(what: impl Into<String>) -> Error {
    Error::invalid("Einsum equation", what.into())
}

fn parse_term(text: &str) -> Result<Term> {
    let mut letters = Vec::new();
    let mut ellipsis_at = None;
    let mut rest = text.trim();
    while !rest.is_empty() {
        if let Some(after) = rest.strip_prefix("...") {
            if ellipsis_at.replace(letters.len()).is_some() {
                return Err(bad(format!("'{text}' has two ellipses")));
            }
            rest = after;
            continue;
        }
        let c = rest.chars().next().unwrap_or(' ');
        if c.is_ascii_alphabetic() {
            letters.push(c as Index);
        } else if c != ' ' {
            return Err(bad(format!("'{c}' in '{text}' is not a letter")));
        }
        rest = &rest[c.len_utf8()..];
    }
    Ok(Term {
        letters,
        ellipsis_at,
    })
}

impl Term {
    /// The indices of an operand of `rank` dims, with `widest` the most dims any
    /// ellipsis stands for.
    fn indices(&self, rank: usize, widest: usize) -> Result<Vec<Index>> {
        let Some(at) = self.ellipsis_at else {
            if rank != self.letters.len() {
                return Err(bad(format!(
                    "a term of {} letters for an operand of rank {rank}",
                    self.letters.len()
                )));
            }
            return Ok(self.letters.clone());
        };
        let covered = rank.checked_sub(self.letters.len()).ok_or_else(|| {
            bad(format!(
                "a term of {} letters for an operand of rank {rank}",
                self.letters.len()
            ))
        })?;
        let mut out = self.letters[..at].to_vec();
        out.extend((widest - covered..widest).map(|j| ELLIPSIS + j as Index));
        out.extend_from_slice(&self.letters[at..]);
        Ok(out)
    }

    /// How many dims the ellipsis of an operand of `rank` dims stands for.
    fn ellipsis_dims(&self, rank: usize) -> usize {
        match self.ellipsis_at {
            Some(_) => rank.saturating_sub(self.letters.len()),
            None => 0,
        }
    }
}

/// An intermediate operand: a node and the index of each of its dims.
#[derive(Clone)]
struct Operand {
    node: NodeId,
    indices: Vec<Index>,
}

fn einsum(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let equation = cx.attr_s("equation", "");
    let (lhs, rhs) = match equation.split_once("->") {
        Some((l, r)) => (l, Some(r)),
        None => (equation.as_str(), None),
    };
    let terms: Vec<Term> = lhs.split(',').map(parse_term).collect::<Result<_>>()?;
    if terms.len() != cx.len() {
        return Err(bad(format!(
            "'{equation}' has {} terms for {} inputs",
            terms.len(),
            cx.len()
        )));
    }
    let mut widest = 0;
    let mut ranks = Vec::with_capacity(terms.len());
    for (i, term) in terms.iter().enumerate() {
        let rank = cx.dims(i)?.len();
        widest = widest.max(term.ellipsis_dims(rank));
        ranks.push(rank);
    }
    let mut operands = Vec::with_capacity(terms.len());
    for (i, term) in terms.iter().enumerate() {
        operands.push(Operand {
            node: cx.input(i)?,
            indices: term.indices(ranks[i], widest)?,
        });
    }
    let output: Vec<Index> = match rhs {
        Some(r) => {
            // Without an ellipsis on the right, the broadcast dims are summed away.
            let term = parse_term(r)?;
            let rank = term.letters.len() + term.ellipsis_at.map_or(0, |_| widest);
            term.indices(rank, widest)?
        }
        None => {
            // The broadcast dims first, then the letters used once, in code order.
            let mut counts = std::collections::BTreeMap::<Index, usize>::new();
            for t in &terms {
                for &l in &t.letters {
                    *counts.entry(l).or_default() += 1;
                }
            }
            let mut out: Vec<Index> = (0..widest).map(|j| ELLIPSIS + j as Index).collect();
            out.extend(counts.iter().filter(|&(_, &n)| n == 1).map(|(&l, _)| l));
            out
        }
    };
    let mut seen = std::collections::HashSet::new();
    for &o in &output {
        if !seen.insert(o) {
            return Err(bad(format!("'{equation}' repeats an output index")));
        }
        if !operands.iter().any(|op| op.indices.contains(&o)) {
            return Err(bad(format!(
                "'{equation}' has an output index no input carries"
            )));
        }
    }
    let sizes = index_sizes(cx, &operands)?;
    for op in &mut operands {
        *op = take_diagonals(cx, op.clone())?;
        *op = broadcast(cx, op.clone(), &sizes)?;
    }
    let mut result: Option<Operand> = None;
    for i in 0..operands.len() {
        let needed = |skip_through: usize| -> Vec<Index> {
            let mut keep = output.clone();
            for later in &operands[skip_through + 1..] {
                keep.extend_from_slice(&later.indices);
            }
            keep
        };
        let keep = needed(i);
        let own = sum_unneeded(cx, operands[i].clone(), &keep, result.as_ref())?;
        result = Some(match result {
            None => own,
            Some(acc) => contract(cx, acc, own, &keep)?,
        });
    }
    let result = result.ok_or_else(|| bad("no operands"))?;
    let result = sum_unneeded(cx, result, &output, None)?;
    let perm: Vec<usize> = output
        .iter()
        .map(|o| result.indices.iter().position(|i| i == o))
        .collect::<Option<_>>()
        .ok_or_else(|| unsupported("Einsum output index lost in contraction"))?;
    let node = if perm.iter().enumerate().all(|(i, &p)| i == p) {
        result.node
    } else {
        cx.g.permute(result.node, &perm)?
    };
    Ok(vec![node])
}

/// The size of every index; a size of 1 broadcasts against a larger one.
fn index_sizes(cx: &Cx, operands: &[Operand]) -> Result<std::collections::HashMap<Index, usize>> {
    let mut sizes = std::collections::HashMap::new();
    for op in operands {
        let dims = cx.g.shape(op.node)?.dims().to_vec();
        for (&i, &d) in op.indices.iter().zip(&dims) {
            let s = sizes.entry(i).or_insert(d);
            if *s != d {
                if *s == 1 {
                    *s = d;
                } else if d != 1 {
                    return Err(bad(format!("an index has sizes {s} and {d}")));
                }
            }
        }
    }
    Ok(sizes)
}

/// Replaces every index repeated within the operand by its diagonal: the two axes
/// moved last and flattened, then every `(n + 1)`-th element.
fn take_diagonals(cx: &Cx, mut op: Operand) -> Result<Operand> {
    loop {
        let Some((a, b)) = (0..op.indices.len()).find_map(|a| {
            (a + 1..op.indices.len())
                .find(|&b| op.indices[b] == op.indices[a])
                .map(|b| (a, b))
        }) else {
            return Ok(op);
        };
        let dims = cx.g.shape(op.node)?.dims().to_vec();
        let n = dims[a];
        if dims[b] != n {
            return Err(bad(format!(
                "a repeated index has sizes {n} and {}",
                dims[b]
            )));
        }
        let mut perm: Vec<usize> = (0..dims.len()).filter(|&i| i != a && i != b).collect();
        let mut new_dims: Vec<usize> = perm.iter().map(|&i| dims[i]).collect();
        let mut indices: Vec<Index> = perm.iter().map(|&i| op.indices[i]).collect();
        perm.extend([a, b]);
        let moved = cx.g.permute(op.node, &perm)?;
        let mut flat = new_dims.clone();
        flat.push(n * n);
        let flat = cx.g.reshape(moved, &flat)?;
        let last = new_dims.len() as isize;
        let diagonal =
            cx.g.slice(flat, last, 0, (n * n) as isize, n as isize + 1)?;
        new_dims.push(n);
        indices.push(op.indices[a]);
        op = Operand {
            node: cx.g.reshape(diagonal, &new_dims)?,
            indices,
        };
    }
}

/// Expands the operand's dims of size 1 whose index is larger elsewhere.
fn broadcast(
    cx: &Cx,
    op: Operand,
    sizes: &std::collections::HashMap<Index, usize>,
) -> Result<Operand> {
    let dims = cx.g.shape(op.node)?.dims().to_vec();
    let full: Vec<usize> = op.indices.iter().map(|i| sizes[i]).collect();
    if full == dims {
        return Ok(op);
    }
    Ok(Operand {
        node: cx.g.expand(op.node, &full)?,
        indices: op.indices,
    })
}

/// Sums the operand over the indices that neither `keep` nor `other` carries.
fn sum_unneeded(cx: &Cx, op: Operand, keep: &[Index], other: Option<&Operand>) -> Result<Operand> {
    let gone: Vec<usize> = (0..op.indices.len())
        .filter(|&a| {
            let i = op.indices[a];
            !keep.contains(&i) && !other.is_some_and(|o| o.indices.contains(&i))
        })
        .collect();
    if gone.is_empty() {
        return Ok(op);
    }
    let axes: Vec<isize> = gone.iter().map(|&a| a as isize).collect();
    Ok(Operand {
        node: cx.g.sum(op.node, &axes, false)?,
        indices: (0..op.indices.len())
            .filter(|a| !gone.contains(a))
            .map(|a| op.indices[a])
            .collect(),
    })
}

/// `a` times `b` summed over the indices both carry that `keep` does not, as one
/// batched product `[batch, a's own, summed] x [batch, summed, b's own]`.
fn contract(cx: &Cx, a: Operand, b: Operand, keep: &[Index]) -> Result<Operand> {
    let a = sum_unneeded(cx, a, keep, Some(&b))?;
    let b = sum_unneeded(cx, b, keep, Some(&a))?;
    let shared = |i: &Index| b.indices.contains(i);
    let batch: Vec<Index> = a
        .indices
        .iter()
        .copied()
        .filter(|i| shared(i) && keep.contains(i))
        .collect();
    let summed: Vec<Index> = a
        .indices
        .iter()
        .copied()
        .filter(|i| shared(i) && !keep.contains(i))
        .collect();
    let a_own: Vec<Index> = a.indices.iter().copied().filter(|i| !shared(i)).collect();
    let b_own: Vec<Index> = b
        .indices
        .iter()
        .copied()
        .filter(|i| !a.indices.contains(i))
        .collect();
    let a_dims = cx.g.shape(a.node)?.dims().to_vec();
    let b_dims = cx.g.shape(b.node)?.dims().to_vec();
    let size_of = |op: &Operand, dims: &[usize], i: Index| -> usize {
        dims[op.indices.iter().position(|&x| x == i).unwrap_or(0)]
    };
    let product = |op: &Operand, dims: &[usize], group: &[Index]| -> usize {
        group.iter().map(|&i| size_of(op, dims, i)).product()
    };
    let arrange = |op: &Operand, order: &[&[Index]], shape: [usize; 3]| -> Result<NodeId> {
        let perm: Vec<usize> = order
            .iter()
            .flat_map(|g| g.iter())
            .map(|i| op.indices.iter().position(|x| x == i).unwrap_or(0))
            .collect();
        let moved = if perm.iter().enumerate().all(|(i, &p)| i == p) {
            op.node
        } else {
            cx.g.permute(op.node, &perm)?
        };
        cx.g.reshape(moved, &shape)
    };
    let (nb, nm, nk) = (
        product(&a, &a_dims, &batch),
        product(&a, &a_dims, &a_own),
        product(&a, &a_dims, &summed),
    );
    let nn = product(&b, &b_dims, &b_own);
    let lhs = arrange(&a, &[&batch, &a_own, &summed], [nb, nm, nk])?;
    let rhs = arrange(&b, &[&batch, &summed, &b_own], [nb, nk, nn])?;
    let product_node = cx.g.matmul(lhs, rhs)?;
    let mut dims: Vec<usize> = batch.iter().map(|&i| size_of(&a, &a_dims, i)).collect();
    dims.extend(a_own.iter().map(|&i| size_of(&a, &a_dims, i)));
    dims.extend(b_own.iter().map(|&i| size_of(&b, &b_dims, i)));
    let mut indices = batch;
    indices.extend(a_own);
    indices.extend(b_own);
    Ok(Operand {
        node: cx.g.reshape(product_node, &dims)?,
        indices,
    })
}
