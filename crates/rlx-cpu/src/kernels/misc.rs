//! Range, random numbers, cumsum, top-k and one-hot.

use super::Ctx;
use crate::elem::{Elem, with_dtype};
use crate::tensor::{Dst, Src};
use rlx_ir::scalar::{random_stream, random_uniform as uniform_at};
use rlx_ir::{DType, Result, TopKOutput};

pub(crate) fn range(start: f64, step: f64, out: Dst) {
    with_dtype!(out.shape.dtype(), T => {
        for i in 0..out.shape.num_elements() {
            out.set(i, T::from_f64(start + i as f64 * step));
        }
    })
}

/// `random_uniform`: the values of [`rlx_ir::scalar::random_uniform`], in chunks
/// split between threads.
pub(crate) fn random_uniform(seed: u64, key: Src, out: Dst, ctx: &Ctx) -> Result<()> {
    let key = with_dtype!(key.shape.dtype(), T => key.get::<T>(0).to_i64());
    let stream = random_stream(seed, key);
    const CHUNK: usize = 1 << 14;
    let n = out.shape.num_elements();
    if out.shape.dtype() != DType::F32 {
        with_dtype!(out.shape.dtype(), T => {
            for i in 0..n {
                out.set(i, T::from_f64(uniform_at(stream, i as u64)));
            }
        });
        return Ok(());
    }
    let threads = if n >= 4 * CHUNK {
        ctx.gemm.threads()
    } else {
        1
    };
    let base = out.ptr as usize;
    let task = |t: usize, _thread: usize| {
        let range = t * CHUNK..((t + 1) * CHUNK).min(n);
        // SAFETY: elements `range` of the `n`-float output belong to this task.
        let dst = unsafe {
            std::slice::from_raw_parts_mut((base as *mut f32).add(range.start), range.len())
        };
        for (d, i) in dst.iter_mut().zip(range) {
            *d = uniform_at(stream, i as u64) as f32;
        }
    };
    ctx.pool.run(n.div_ceil(CHUNK), threads, &task)
}

fn lanes(dims: &[usize], axis: usize) -> (usize, usize, usize) {
    (
        dims[..axis].iter().product(),
        dims[axis],
        dims[axis + 1..].iter().product(),
    )
}

pub(crate) fn cumsum(axis: usize, exclusive: bool, reverse: bool, x: Src, out: Dst) {
    let (outer, n, inner) = lanes(x.shape.dims(), axis);
    with_dtype!(x.shape.dtype(), T => {
        for o in 0..outer {
            for i in 0..inner {
                let (mut f, mut k) = (0.0f64, 0i64);
                for s in 0..n {
                    let j = if reverse { n - 1 - s } else { s };
                    let at = (o * n + j) * inner + i;
                    let v: T = x.get(at);
                    let before = if T::FLOAT { T::from_f64(f) } else { T::from_i64(k) };
                    f += v.to_f64();
                    k = k.wrapping_add(v.to_i64());
                    let after = if T::FLOAT { T::from_f64(f) } else { T::from_i64(k) };
                    out.set(at, if exclusive { before } else { after });
                }
            }
        }
    })
}

/// True if `(va, ia)` comes before `(vb, ib)` in top-k order: larger (or smaller)
/// values first, NaN as the largest value, lower index first among equals.
fn before(largest: bool, (va, ia): (f64, usize), (vb, ib): (f64, usize)) -> bool {
    let ord = match (va.is_nan(), vb.is_nan()) {
        (true, true) => std::cmp::Ordering::Equal,
        (true, false) => std::cmp::Ordering::Greater,
        (false, true) => std::cmp::Ordering::Less,
        _ => va.partial_cmp(&vb).unwrap_or(std::cmp::Ordering::Equal),
    };
    let ord = if largest { ord.reverse() } else { ord };
    ord.is_lt() || (ord.is_eq() && ia < ib)
}

/// Selection without scratch memory: pick `k` times the first entry that comes after
/// the previous pick in top-k order (O(n k)).
pub(crate) fn topk(k: usize, axis: usize, largest: bool, output: TopKOutput, x: Src, out: Dst) {
    let (outer, n, inner) = lanes(x.shape.dims(), axis);
    with_dtype!(x.shape.dtype(), T => {
        for o in 0..outer {
            for i in 0..inner {
                let at = |j: usize| (o * n + j) * inner + i;
                let mut prev: Option<(f64, usize)> = None;
                for r in 0..k {
                    let mut best: Option<(f64, usize)> = None;
                    for j in 0..n {
                        let cand = (x.f64::<T>(at(j)), j);
                        let after_prev = prev.is_none_or(|p| before(largest, p, cand));
                        if after_prev && best.is_none_or(|b| before(largest, cand, b)) {
                            best = Some(cand);
                        }
                    }
                    let Some((_, j)) = best else { break };
                    let dst = (o * k + r) * inner + i;
                    match output {
                        TopKOutput::Values => out.set::<T>(dst, x.get(at(j))),
                        TopKOutput::Indices => out.set::<i64>(dst, j as i64),
                    }
                    prev = best;
                }
            }
        }
    })
}

pub(crate) fn one_hot(depth: usize, idx: Src, out: Dst) {
    with_dtype!(out.shape.dtype(), T => {
        for i in 0..out.shape.num_elements() {
            out.set(i, T::from_f64(0.0));
        }
        with_dtype!(idx.shape.dtype(), I => {
            for i in 0..idx.shape.num_elements() {
                let k = idx.get::<I>(i).to_i64();
                let k = if k < 0 { k + depth as i64 } else { k };
                if (0..depth as i64).contains(&k) {
                    out.set(i * depth + k as usize, T::from_f64(1.0));
                }
            }
        })
    })
}
