//! Unary, binary (broadcast), where and cast. These may run in place: element `i` of
//! every same-shaped operand is read before element `i` of the output is written.

use crate::elem::{Elem, with_dtype};
use crate::tensor::{Dst, Src, broadcast_strides, for_each_strided};
use rlx_ir::scalar::{binary_f64, binary_i64, unary_f64, unary_i64};
use rlx_ir::{BinaryOp, UnaryOp};

pub(crate) fn unary(op: UnaryOp, x: Src, out: Dst) {
    with_dtype!(x.shape.dtype(), T => unary_typed::<T>(op, x, out))
}

fn unary_typed<T: Elem>(op: UnaryOp, x: Src, out: Dst) {
    for i in 0..out.shape.num_elements() {
        let v: T = x.get(i);
        let r = if T::FLOAT {
            T::from_f64(unary_f64(op, v.to_f64()))
        } else {
            T::from_i64(unary_i64(op, v.to_i64()))
        };
        out.set(i, r);
    }
}

pub(crate) fn binary(op: BinaryOp, a: Src, b: Src, out: Dst) {
    let in_dtype = a.shape.dtype();
    let out_dtype = out.shape.dtype();
    if in_dtype == rlx_ir::DType::F32 && op.is_comparison() && compare_f32(op, a, b, out) {
        return;
    }
    with_dtype!(in_dtype, T => with_dtype!(out_dtype, U => binary_typed::<T, U>(op, a, b, out)))
}

/// An `f32` comparison with any broadcast, as rows of the coalesced walk (a value per
/// window compared with the window's elements is one row per window), each one loop.
fn compare_f32(op: BinaryOp, a: Src, b: Src, out: Dst) -> bool {
    // One instance per comparison, so the loops hold no branch on the op and
    // vectorize.
    match op {
        BinaryOp::Eq => compare_rows(|p, q| p == q, a, b, out),
        BinaryOp::Ne => compare_rows(|p, q| p != q, a, b, out),
        BinaryOp::Lt => compare_rows(|p, q| p < q, a, b, out),
        BinaryOp::Le => compare_rows(|p, q| p <= q, a, b, out),
        BinaryOp::Gt => compare_rows(|p, q| p > q, a, b, out),
        _ => compare_rows(|p, q| p >= q, a, b, out),
    }
    true
}

/// [`compare_f32`] with the comparison `test`. Rows shorter than 16 (a 2-wide
/// window's) go two axes per walk step, so the walk is paid once per block of rows.
#[inline(always)]
fn compare_rows(test: impl Fn(f32, f32) -> bool, a: Src, b: Src, out: Dst) {
    let dims = out.shape.dims();
    if dims.contains(&0) {
        return;
    }
    let (sa, sb) = (
        broadcast_strides(a.shape.dims(), dims),
        broadcast_strides(b.shape.dims(), dims),
    );
    let (rank, merged, [sa, sb]) = crate::tensor::coalesce(dims, [&sa, &sb]);
    let inner = merged[rank - 1];
    let (ka, kb) = (sa[rank - 1], sb[rank - 1]);
    let (rows, ra, rb, walked) = if rank >= 2 && inner < 16 {
        (merged[rank - 2], sa[rank - 2], sb[rank - 2], rank - 2)
    } else {
        (1, 0, 0, rank - 1)
    };
    let (x, y) = (a.as_slice::<f32>(), b.as_slice::<f32>());
    // SAFETY: the output is `out.len` bools of one byte each.
    let dst = unsafe { std::slice::from_raw_parts_mut(out.ptr, out.len) };
    let block = rows * inner;
    for_each_strided(&merged[..walked], [&sa, &sb], [0, 0], |at, [oa, ob]| {
        let d = &mut dst[at * block..(at + 1) * block];
        for (r, d) in d.chunks_exact_mut(inner).enumerate() {
            let (oa, ob) = (
                (oa + r as isize * ra) as usize,
                (ob + r as isize * rb) as usize,
            );
            match (ka, kb) {
                (1, 1) => {
                    for ((d, &p), &q) in
                        d.iter_mut().zip(&x[oa..oa + inner]).zip(&y[ob..ob + inner])
                    {
                        *d = u8::from(test(p, q));
                    }
                }
                (1, 0) => {
                    let q = y[ob];
                    for (d, &p) in d.iter_mut().zip(&x[oa..oa + inner]) {
                        *d = u8::from(test(p, q));
                    }
                }
                (0, 1) => {
                    let p = x[oa];
                    for (d, &q) in d.iter_mut().zip(&y[ob..ob + inner]) {
                        *d = u8::from(test(p, q));
                    }
                }
                _ => {
                    for (j, d) in d.iter_mut().enumerate() {
                        let (p, q) = (x[oa + j * ka as usize], y[ob + j * kb as usize]);
                        *d = u8::from(test(p, q));
                    }
                }
            }
        }
    });
}

fn binary_typed<T: Elem, U: Elem>(op: BinaryOp, a: Src, b: Src, out: Dst) {
    let dims = out.shape.dims();
    let sa = broadcast_strides(a.shape.dims(), dims);
    let sb = broadcast_strides(b.shape.dims(), dims);
    for_each_strided(dims, [&sa, &sb], [0, 0], |i, [oa, ob]| {
        let (x, y): (T, T) = (a.get(oa as usize), b.get(ob as usize));
        let r = if T::FLOAT {
            U::from_f64(binary_f64(op, x.to_f64(), y.to_f64()))
        } else {
            U::from_i64(binary_i64(op, x.to_i64(), y.to_i64()))
        };
        out.set(i, r);
    });
}

pub(crate) fn select(c: Src, a: Src, b: Src, out: Dst, ctx: &super::Ctx) -> rlx_ir::Result<()> {
    // One condition for the whole tensor (a guarded update): copy the chosen operand
    // when it already has the output's dims.
    if c.len == 1 {
        let chosen = if c.get::<crate::elem::Bool8>(0).0 != 0 {
            a
        } else {
            b
        };
        if chosen.shape.dims() == out.shape.dims() {
            // SAFETY: both hold `out.len` elements of the output's dtype (an in-place
            // select, the same bytes, copies nothing).
            return unsafe { super::copy_bytes(out.ptr, chosen.ptr, out.shape.byte_size(), ctx) };
        }
    }
    let dims = out.shape.dims();
    if dims.contains(&0) {
        return Ok(());
    }
    let (sc, sa, sb) = (
        broadcast_strides(c.shape.dims(), dims),
        broadcast_strides(a.shape.dims(), dims),
        broadcast_strides(b.shape.dims(), dims),
    );
    // SAFETY (all arms): the strides come from the operands' own dims broadcast to the
    // output's, so every offset lies inside its operand.
    match out.shape.dtype().size_in_bytes() {
        1 => unsafe { select_rows::<u8>((c, a, b, out), [&sc, &sa, &sb], ctx)? },
        2 => unsafe { select_rows::<u16>((c, a, b, out), [&sc, &sa, &sb], ctx)? },
        4 => unsafe { select_rows::<u32>((c, a, b, out), [&sc, &sa, &sb], ctx)? },
        8 => unsafe { select_rows::<u64>((c, a, b, out), [&sc, &sa, &sb], ctx)? },
        _ => with_dtype!(out.shape.dtype(), T => {
            for_each_strided(dims, [&sc, &sa, &sb], [0, 0, 0], |i, [oc, oa, ob]| {
                let keep = c.get::<crate::elem::Bool8>(oc as usize).0 != 0;
                let v: T = if keep { a.get(oa as usize) } else { b.get(ob as usize) };
                out.set(i, v);
            });
        }),
    }
    Ok(())
}

/// [`select`] on elements of `T`'s size, copied as bits: the walk coalesced into rows
/// (a mask broadcast over leading axes makes one row of its whole size), each row one
/// loop, which vectorizes where every operand is contiguous along it or one value (a
/// causal mask's `-inf`). Large selects run in pieces of rows on the threads.
///
/// # Safety
/// `strides` are the condition's, `a`'s and `b`'s strides over the output's dims, each
/// keeping its offsets inside its operand; the output holds its shape's elements of
/// `T`'s size.
unsafe fn select_rows<T: Copy>(
    (c, a, b, out): (Src, Src, Src, Dst),
    strides: [&[isize; rlx_ir::MAX_RANK]; 3],
    ctx: &super::Ctx,
) -> rlx_ir::Result<()> {
    let (rank, dims, steps) = crate::tensor::coalesce(out.shape.dims(), strides);
    let inner = dims[rank - 1];
    let along = [steps[0][rank - 1], steps[1][rank - 1], steps[2][rank - 1]];
    let addresses = [
        c.ptr as usize,
        a.ptr as usize,
        b.ptr as usize,
        out.ptr as usize,
    ];
    let outer = &dims[..rank - 1];
    let [sc, sa, sb] = &steps;
    let threads = ctx.gemm.threads();
    if threads < 2 || out.len < PARALLEL_SELECT_FROM {
        for_each_strided(outer, [sc, sa, sb], [0, 0, 0], |row, offsets| {
            // SAFETY: row `row` of the output and the elements of each operand it
            // reads (the caller's contract).
            unsafe { select_run::<T>(addresses, offsets, along, row * inner..(row + 1) * inner) }
        });
        return Ok(());
    }
    // Pieces of at most `SELECT_PIECE` elements of one row, a run of them per task.
    let pieces_per_row = inner.div_ceil(SELECT_PIECE);
    let pieces = outer.iter().product::<usize>() * pieces_per_row;
    let per_task = pieces.div_ceil(4 * threads);
    ctx.pool
        .run(pieces.div_ceil(per_task), threads, &|task, _| {
            for piece in task * per_task..((task + 1) * per_task).min(pieces) {
                let (row, part) = (piece / pieces_per_row, piece % pieces_per_row);
                let mut offsets = crate::tensor::strided_offsets(outer, [sc, sa, sb], row);
                let start = part * SELECT_PIECE;
                let range = row * inner + start..row * inner + (start + SELECT_PIECE).min(inner);
                for (o, k) in offsets.iter_mut().zip(along) {
                    *o += start as isize * k;
                }
                // SAFETY: as above; the pieces are disjoint parts of the output, and an
                // in-place operand (the output's own shape) is read only in its piece.
                unsafe { select_run::<T>(addresses, offsets, along, range) }
            }
        })
}

/// Selects from a condition and two operands whose elements in the output range
/// `range` begin at `offsets` (condition, `a`, `b`) and step by `along` (each 0, 1
/// or any stride); `addresses` are the condition's, `a`'s, `b`'s and the output's.
///
/// # Safety
/// Every element read lies inside its operand and `range` inside the output; no
/// other thread writes `range`, and an operand that overlaps the output has the
/// output's layout (it is read at an element only before that element is written).
#[inline(always)]
unsafe fn select_run<T: Copy>(
    [cp, ap, bp, dst]: [usize; 4],
    [oc, oa, ob]: [isize; 3],
    along: [isize; 3],
    range: std::ops::Range<usize>,
) {
    let n = range.len();
    // SAFETY (all arms): the caller's contract.
    unsafe {
        let d = (dst as *mut T).add(range.start);
        let cs = (cp as *const u8).offset(oc);
        let (xs, ys) = ((ap as *const T).offset(oa), (bp as *const T).offset(ob));
        match along {
            [1, 1, 1] => {
                for j in 0..n {
                    *d.add(j) = if *cs.add(j) != 0 {
                        *xs.add(j)
                    } else {
                        *ys.add(j)
                    };
                }
            }
            [1, 1, 0] => {
                let y = *ys;
                for j in 0..n {
                    *d.add(j) = if *cs.add(j) != 0 { *xs.add(j) } else { y };
                }
            }
            [1, 0, 1] => {
                let x = *xs;
                for j in 0..n {
                    *d.add(j) = if *cs.add(j) != 0 { x } else { *ys.add(j) };
                }
            }
            [kc, ka, kb] => {
                for j in 0..n as isize {
                    *d.offset(j) = if *cs.offset(j * kc) != 0 {
                        *xs.offset(j * ka)
                    } else {
                        *ys.offset(j * kb)
                    };
                }
            }
        }
    }
}

/// Elements from which a select runs on the threads.
const PARALLEL_SELECT_FROM: usize = 1 << 16;

/// The longest run of one row a select task takes at a time.
const SELECT_PIECE: usize = 1 << 14;

pub(crate) fn cast(x: Src, out: Dst) {
    let (from, to) = (x.shape.dtype(), out.shape.dtype());
    if from == rlx_ir::DType::Bool && to == rlx_ir::DType::F32 {
        // A mask as weights: one loop.
        let flags = x.as_slice::<crate::elem::Bool8>();
        // SAFETY: the output holds `out.len` floats and does not overlap the flags
        // (a cast changes the element size, so it never runs in place).
        let dst = unsafe { std::slice::from_raw_parts_mut(out.ptr.cast::<f32>(), out.len) };
        for (d, f) in dst.iter_mut().zip(flags) {
            *d = if f.0 != 0 { 1.0 } else { 0.0 };
        }
        return;
    }
    with_dtype!(from, T => with_dtype!(to, U => {
        for i in 0..out.shape.num_elements() {
            let v: T = x.get(i);
            let r = if T::FLOAT || U::FLOAT { U::from_f64(v.to_f64()) } else { U::from_i64(v.to_i64()) };
            out.set(i, r);
        }
    }))
}
