//! Operators that move or select elements by computed positions, written in
//! primitives: `ReverseSequence`, `Compress`, `Col2Im`, and `Det` of small matrices.

use super::{Converter, axis, size, unsupported};
use crate::import::Cx;
use rlx_ir::{DType, Error, NodeId, Result, TensorData};

pub(super) const NAMES: &[&str] = &["Col2Im", "Compress", "Det", "ReverseSequence"];

pub(super) fn converter(op: &str) -> Option<Converter> {
    Some(match op {
        "Col2Im" => col2im,
        "Compress" => compress,
        "Det" => det,
        "ReverseSequence" => reverse_sequence,
        _ => return None,
    })
}

/// `ReverseSequence`: along the time axis, the first `sequence_lens[b]` steps of
/// batch entry `b` in reverse order, the rest as they are. The input becomes rows
/// `[time * batch, rest]` and one gather picks each output row, at run-time
/// positions computed from the lengths.
fn reverse_sequence(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let xd = cx.dims(0)?;
    if xd.len() < 2 {
        return Err(Error::invalid(
            "ReverseSequence",
            format!("input of rank {} (at least 2)", xd.len()),
        ));
    }
    let ta = axis(cx.attr_i("time_axis", 0), xd.len())?;
    let ba = axis(cx.attr_i("batch_axis", 1), xd.len())?;
    if ta == ba || ta > 1 || ba > 1 {
        return Err(Error::invalid(
            "ReverseSequence",
            format!("time axis {ta} and batch axis {ba} must be 0 and 1 in some order"),
        ));
    }
    let (t, b) = (xd[ta], xd[ba]);
    if cx.dims(1)? != [b] {
        return Err(Error::invalid(
            "sequence_lens",
            format!("dims {:?}, expected [{b}]", cx.dims(1)?),
        ));
    }
    let rest: usize = xd[2..].iter().product();
    let mut x = cx.input(0)?;
    if ta == 1 {
        x = cx.g.permute(x, &swap01(xd.len()))?;
    }
    let rows = cx.g.reshape(x, &[t * b, rest])?;
    let lens = cx.g.cast(cx.input(1)?, DType::I64)?;
    let lens = cx.g.reshape(lens, &[1, b])?;
    let steps = cx.g.reshape(cx.g.iota(t, DType::I64)?, &[t, 1])?;
    let within = cx.g.lt(steps, lens)?;
    let one = cx.g.scalar(1.0, DType::I64);
    let mirrored = cx.g.sub(cx.g.sub(lens, one)?, steps)?;
    let source = cx.g.select(within, mirrored, steps)?;
    let column = cx.g.reshape(cx.g.iota(b, DType::I64)?, &[1, b])?;
    let width = cx.g.scalar(b as f64, DType::I64);
    let flat = cx.g.add(cx.g.mul(source, width)?, column)?;
    let picked = cx.g.gather(rows, flat, 0)?;
    let mut dims = vec![t, b];
    dims.extend_from_slice(&xd[2..]);
    let mut y = cx.g.reshape(picked, &dims)?;
    if ta == 1 {
        y = cx.g.permute(y, &swap01(xd.len()))?;
    }
    Ok(vec![y])
}

/// The permutation that swaps the first two axes of a rank-`r` tensor.
fn swap01(r: usize) -> Vec<usize> {
    let mut p: Vec<usize> = (0..r).collect();
    p.swap(0, 1);
    p
}

/// `Compress`: the slices along `axis` (of the flattened input without one) whose
/// condition is true. The output's length depends on the condition's values, which
/// must be known at import (a given input value specializes the import on it).
fn compress(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let xd = cx.dims(0)?;
    let condition = cx.konst(1)?.to_i64_vec();
    let mut x = cx.input(0)?;
    let a = if cx.has_attr("axis") {
        axis(cx.attr_i("axis", 0), xd.len())?
    } else {
        x = cx.g.reshape(x, &[xd.iter().product()])?;
        0
    };
    let len = cx.g.shape(x)?.dims()[a];
    if condition.len() > len {
        return Err(Error::invalid(
            "condition",
            format!("{} values for an axis of {len}", condition.len()),
        ));
    }
    let kept: Vec<i64> = (0..condition.len() as i64)
        .filter(|&i| condition[i as usize] != 0)
        .collect();
    if kept.is_empty() {
        return Err(unsupported("Compress that keeps nothing (an empty output)"));
    }
    let n = kept.len();
    let index = cx.g.constant(TensorData::I64(kept), &[n])?;
    Ok(vec![cx.g.gather(x, index, a as isize)?])
}

/// `Col2Im`: every column of every block added into the image position it came
/// from, as one product of `[N * C, K * L]` with a 0/1 matrix `[K * L, pixels]`
/// built at import (`K` positions per block, `L` blocks). Positions in the padding
/// are dropped.
fn col2im(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let xd = cx.dims(0)?;
    let image: Vec<usize> = cx
        .ints(1)?
        .iter()
        .map(|&v| size(v, "image_shape"))
        .collect::<Result<_>>()?;
    let block: Vec<usize> = cx
        .ints(2)?
        .iter()
        .map(|&v| size(v, "block_shape"))
        .collect::<Result<_>>()?;
    let r = image.len();
    if r == 0 || block.len() != r || block.contains(&0) || xd.len() != 3 {
        return Err(Error::invalid(
            "Col2Im",
            format!("input {xd:?}, image {image:?} and block {block:?} do not fit"),
        ));
    }
    let list = |name: &str, default: usize, count: usize| -> Result<Vec<usize>> {
        match cx.attr_ints(name) {
            Some(v) if v.len() == count => v.iter().map(|&d| size(d, name)).collect(),
            Some(v) => Err(Error::invalid(
                name,
                format!("{} values for {r} axes", v.len()),
            )),
            None => Ok(vec![default; count]),
        }
    };
    let strides = list("strides", 1, r)?;
    let dilations = list("dilations", 1, r)?;
    let pads = list("pads", 0, 2 * r)?;
    if strides.contains(&0) || dilations.contains(&0) {
        return Err(Error::invalid(
            "Col2Im",
            "strides and dilations must be positive",
        ));
    }
    let too_big = || Error::invalid("Col2Im", "the block or image extent overflows");
    let mut counts = Vec::with_capacity(r);
    for i in 0..r {
        let span = (block[i] - 1)
            .checked_mul(dilations[i])
            .and_then(|s| s.checked_add(1))
            .ok_or_else(too_big)?;
        let padded = image[i]
            .checked_add(pads[i])
            .and_then(|p| p.checked_add(pads[i + r]))
            .ok_or_else(too_big)?;
        if padded < span {
            return Err(Error::invalid(
                "Col2Im",
                format!("a block of {span} does not fit an axis of {padded}"),
            ));
        }
        counts.push((padded - span) / strides[i] + 1);
    }
    let product = |v: &[usize]| v.iter().try_fold(1usize, |a, &b| a.checked_mul(b));
    let k = product(&block).ok_or_else(too_big)?;
    let l = product(&counts).ok_or_else(too_big)?;
    let pixels = product(&image).ok_or_else(too_big)?;
    if k == 0 || xd[1] % k != 0 || xd[2] != l || k.checked_mul(l).is_none() {
        return Err(Error::invalid(
            "Col2Im",
            format!("input {xd:?} is not [N, C * {k}, {l}]"),
        ));
    }
    let cells = (k * l)
        .checked_mul(pixels)
        .filter(|&c| c <= 1 << 24)
        .ok_or_else(|| {
            unsupported(format!(
                "Col2Im placing {} columns into {pixels} pixels (larger than the placement matrix allows)",
                k * l
            ))
        })?;
    let mut placement = vec![0.0; cells];
    for kk in 0..k {
        for ll in 0..l {
            let (mut kr, mut lr, mut flat, mut inside) = (kk, ll, 0usize, true);
            for i in (0..r).rev() {
                let (bi, ci) = (kr % block[i], lr % counts[i]);
                kr /= block[i];
                lr /= counts[i];
                let pos = (ci * strides[i] + bi * dilations[i]) as i64 - pads[i] as i64;
                if pos < 0 || pos >= image[i] as i64 {
                    inside = false;
                }
                if inside {
                    let stride: usize = image[i + 1..].iter().product();
                    flat += pos as usize * stride;
                }
            }
            if inside {
                placement[(kk * l + ll) * pixels + flat] = 1.0;
            }
        }
    }
    let dt = cx.dtype(0)?;
    let placement =
        cx.g.constant(TensorData::from_f64(dt, &placement), &[k * l, pixels])?;
    let (n, c) = (xd[0], xd[1] / k);
    let x = cx.g.reshape(cx.input(0)?, &[n * c, k * l])?;
    let y = cx.g.matmul(x, placement)?;
    let mut dims = vec![n, c];
    dims.extend_from_slice(&image);
    Ok(vec![cx.g.reshape(y, &dims)?])
}

/// `Det` of `[..., n, n]` matrices up to `n = 4`, as the sum over permutations of
/// signed products of entries.
fn det(cx: &mut Cx) -> Result<Vec<NodeId>> {
    let xd = cx.dims(0)?;
    let r = xd.len();
    if r < 2 || xd[r - 1] != xd[r - 2] {
        return Err(Error::invalid(
            "Det",
            format!("input {xd:?} is not square matrices"),
        ));
    }
    let n = xd[r - 1];
    if n == 0 || n > 4 {
        return Err(unsupported(format!(
            "Det of {n} x {n} matrices (1 to 4 are supported)"
        )));
    }
    let batch = &xd[..r - 2];
    let rows: usize = batch.iter().product();
    let x = cx.g.reshape(cx.input(0)?, &[rows, n * n])?;
    let entry = |i: usize, j: usize| -> Result<NodeId> {
        let at = (i * n + j) as isize;
        cx.g.slice(x, 1, at, at + 1, 1)
    };
    let mut total: Option<NodeId> = None;
    for (perm, sign) in permutations(n) {
        let mut term = entry(0, perm[0])?;
        for (i, &j) in perm.iter().enumerate().skip(1) {
            term = cx.g.mul(term, entry(i, j)?)?;
        }
        total = Some(match (total, sign) {
            (None, 1) => term,
            (None, _) => cx.g.neg(term)?,
            (Some(t), 1) => cx.g.add(t, term)?,
            (Some(t), _) => cx.g.sub(t, term)?,
        });
    }
    let total = total.ok_or_else(|| Error::invalid("Det", "empty matrix"))?;
    Ok(vec![cx.g.reshape(total, batch)?])
}

/// Every permutation of `0..n` with its sign (1 or -1).
fn permutations(n: usize) -> Vec<(Vec<usize>, i32)> {
    if n == 1 {
        return vec![(vec![0], 1)];
    }
    let mut out = Vec::new();
    for (p, s) in permutations(n - 1) {
        // Inserting n - 1 at position i moves it past n - 1 - i elements.
        for i in 0..n {
            let mut q = p.clone();
            q.insert(i, n - 1);
            let sign = if (n - 1 - i).is_multiple_of(2) { s } else { -s };
            out.push((q, sign));
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::permutations;

    #[test]
    fn permutations_carry_their_signs() {
        for n in 1..=4 {
            let all = permutations(n);
            assert_eq!(all.len(), (1..=n).product::<usize>());
            for (p, s) in &all {
                let inversions = (0..n)
                    .flat_map(|i| (i + 1..n).map(move |j| (i, j)))
                    .filter(|&(i, j)| p[i] > p[j])
                    .count();
                assert_eq!(
                    *s,
                    if inversions.is_multiple_of(2) { 1 } else { -1 },
                    "{p:?}"
                );
            }
        }
    }
}
