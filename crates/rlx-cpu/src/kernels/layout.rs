//! Data movement: permute, strided slice, concat, gather, expand, pad and tile.
//! Outputs of these kernels never alias their operands.

use crate::elem::{Elem, with_dtype};
use crate::tensor::{Dst, Src, broadcast_strides, for_each_strided, strides_of};
use rlx_ir::{Error, MAX_RANK, PadMode, Result, SliceAxis};

/// Copies the elements the output index walk selects: `out[i] = x[offset(i)]`, where
/// `offset` is `base` plus the index dotted with `strides` (in elements). The bits are
/// copied as they are, a row of the output at a time (one block copy when the row is
/// contiguous in `x`).
fn copy_strided(x: Src, out: Dst, strides: &[isize; MAX_RANK], base: isize) {
    // SAFETY (all arms): the kernel's callers derive `strides` and `base` from shapes
    // that the builder checked, so every offset lies inside `x`, and `out` holds its
    // shape's elements.
    match x.shape.dtype().size_in_bytes() {
        1 => unsafe { copy_rows::<u8>(x, out, strides, base) },
        2 => unsafe { copy_rows::<u16>(x, out, strides, base) },
        4 => unsafe { copy_rows::<u32>(x, out, strides, base) },
        8 => unsafe { copy_rows::<u64>(x, out, strides, base) },
        _ => with_dtype!(x.shape.dtype(), T => {
            for_each_strided(out.shape.dims(), [strides], [base], |i, [p]| out.set::<T>(i, x.get(p as usize)));
        }),
    }
}

/// [`copy_strided`] for elements of `T`'s size.
///
/// # Safety
/// Every selected offset lies inside `x`; `out` holds its shape's elements and does
/// not overlap `x`.
unsafe fn copy_rows<T: Copy>(x: Src, out: Dst, strides: &[isize; MAX_RANK], base: isize) {
    if out.shape.dims().contains(&0) {
        return;
    }
    let walk = RowWalk::new(out.shape.dims(), strides);
    // SAFETY: forwarded contract.
    unsafe { walk.copy::<T>(x, out, base, 0..walk.blocks) };
}

/// A copy's operands, shared by the tasks that split it.
#[derive(Clone, Copy)]
struct Shared<'a> {
    x: Src<'a>,
    out: Dst<'a>,
}

// SAFETY: the tasks only read `x` and write disjoint blocks of `out`.
unsafe impl Sync for Shared<'_> {}

impl<'a> Shared<'a> {
    fn get(&self) -> (Src<'a>, Dst<'a>) {
        (self.x, self.out)
    }
}

/// How a strided copy walks its output: blocks of `block_rows` rows of `inner`
/// elements, one walk step each.
struct RowWalk {
    dims: [usize; MAX_RANK],
    steps: [isize; MAX_RANK],
    inner: usize,
    step: isize,
    block_rows: usize,
    row_step: isize,
    walked: usize,
    blocks: usize,
}

impl RowWalk {
    fn new(out_dims: &[usize], strides: &[isize; MAX_RANK]) -> RowWalk {
        // Axes the source walks as one are merged first (a permute that keeps inner
        // axes together copies whole blocks).
        let (rank, dims, [steps]) = crate::tensor::coalesce(out_dims, [strides]);
        let (inner, step) = (dims[rank - 1], steps[rank - 1]);
        // Short rows (an expand over a 2-wide window) are copied two axes per walk
        // step, so the walk's per-row cost is paid once per block of rows.
        let (block_rows, row_step, walked) = if rank >= 2 && inner < 16 {
            (dims[rank - 2], steps[rank - 2], rank - 2)
        } else {
            (1, 0, rank - 1)
        };
        RowWalk {
            dims,
            steps,
            inner,
            step,
            block_rows,
            row_step,
            walked,
            blocks: dims[..walked].iter().product(),
        }
    }

    /// Copies blocks `range` of the walk.
    ///
    /// # Safety
    /// As [`copy_rows`].
    unsafe fn copy<T: Copy>(&self, x: Src, out: Dst, base: isize, range: std::ops::Range<usize>) {
        let (src, dst) = (x.ptr.cast::<T>(), out.ptr.cast::<T>());
        let (inner, step, block_rows, row_step) =
            (self.inner, self.step, self.block_rows, self.row_step);
        let block = block_rows * inner;
        // Rows of fewer than 16 four-byte values (a 3x3 filter's nine weights) under a
        // mask on AVX-512: a `memcpy` call per row cost more than the copy (3.5 ms for
        // a 512-channel 3x3x3 filter's depth tap).
        #[cfg(target_arch = "x86_64")]
        let short_rows =
            step == 1 && inner < 16 && std::mem::size_of::<T>() == 4 && crate::isa::isa().avx512f;
        #[cfg(not(target_arch = "x86_64"))]
        let short_rows = false;
        let dims = &self.dims[..self.walked];
        // The odometer starts at block `range.start`.
        let mut idx = [0usize; MAX_RANK];
        let mut rest = range.start;
        for axis in (0..dims.len()).rev() {
            idx[axis] = rest % dims[axis];
            rest /= dims[axis];
        }
        let mut offset = base + crate::tensor::strided_offsets(dims, [&self.steps], range.start)[0];
        for at in range {
            // SAFETY: block `at` of the output, and the elements of `x` it selects.
            unsafe {
                let d = dst.add(at * block);
                #[cfg(target_arch = "x86_64")]
                if short_rows {
                    copy_short_rows_avx512(
                        src.cast::<u32>(),
                        (offset, row_step),
                        (d.cast::<u32>(), inner),
                        (block_rows, inner),
                    );
                }
                for r in (0..block_rows).filter(|_| !short_rows) {
                    let (from, to) = (offset + r as isize * row_step, d.add(r * inner));
                    if step == 1 {
                        std::ptr::copy_nonoverlapping(src.offset(from), to, inner);
                    } else {
                        for j in 0..inner {
                            *to.add(j) = *src.offset(from + j as isize * step);
                        }
                    }
                }
            }
            let mut axis = dims.len();
            while axis > 0 {
                axis -= 1;
                idx[axis] += 1;
                offset += self.steps[axis];
                if idx[axis] < dims[axis] {
                    break;
                }
                offset -= self.steps[axis] * dims[axis] as isize;
                idx[axis] = 0;
            }
        }
    }
}

/// Copies `rows` rows of `inner` (< 16) values, row `r` from `src + offset + r *
/// row_step` to `dst + r * dst_step`, each under a mask.
///
/// # Safety
/// AVX-512F must be available; every row read lies inside the source and the rows
/// written inside the destination.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn copy_short_rows_avx512(
    src: *const u32,
    (offset, row_step): (isize, isize),
    (dst, dst_step): (*mut u32, usize),
    (rows, inner): (usize, usize),
) {
    use std::arch::x86_64::{_mm512_mask_storeu_epi32, _mm512_maskz_loadu_epi32};
    let mask = ((1u32 << inner) - 1) as u16;
    for r in 0..rows {
        // SAFETY: the masked lanes are the row's values (see the contract).
        unsafe {
            let values = _mm512_maskz_loadu_epi32(
                mask,
                src.offset(offset + r as isize * row_step).cast::<i32>(),
            );
            _mm512_mask_storeu_epi32(dst.add(r * dst_step).cast::<i32>(), mask, values);
        }
    }
}

pub(crate) fn permute(perm: &[usize], x: Src, out: Dst, ctx: &super::Ctx) -> Result<()> {
    let src = strides_of(x.shape.dims());
    let mut strides = [0isize; MAX_RANK];
    for (o, &p) in perm.iter().enumerate() {
        strides[o] = src[p];
    }
    copy_strided_threaded(x, out, &strides, 0, ctx)
}

/// [`copy_strided`], with the walk's blocks split between the threads from
/// [`super::PARALLEL_COPY_BYTES`] of output.
fn copy_strided_threaded(
    x: Src,
    out: Dst,
    strides: &[isize; MAX_RANK],
    base: isize,
    ctx: &super::Ctx,
) -> Result<()> {
    let threads = ctx.gemm.threads();
    if out.shape.byte_size() < super::PARALLEL_COPY_BYTES
        || threads < 2
        || x.shape.dtype().size_in_bytes() > 8
        || out.shape.dims().contains(&0)
    {
        copy_strided(x, out, strides, base);
        return Ok(());
    }
    // A large permute: blocks of the walk split between the threads.
    let walk = RowWalk::new(out.shape.dims(), strides);
    let tasks = (4 * threads).min(walk.blocks.max(1));
    let per_task = walk.blocks.div_ceil(tasks);
    let size = x.shape.dtype().size_in_bytes();
    let operands = Shared { x, out };
    ctx.pool.run(tasks, threads, &|t, _| {
        let (x, out) = operands.get();
        let range = (t * per_task).min(walk.blocks)..((t + 1) * per_task).min(walk.blocks);
        // SAFETY (all arms): the strides come from the input's dims, so every offset
        // lies inside it; tasks write disjoint blocks of the output.
        match size {
            1 => unsafe { walk.copy::<u8>(x, out, base, range) },
            2 => unsafe { walk.copy::<u16>(x, out, base, range) },
            4 => unsafe { walk.copy::<u32>(x, out, base, range) },
            _ => unsafe { walk.copy::<u64>(x, out, base, range) },
        }
    })
}

/// A slice: a strided copy of rows, split between the threads when large.
pub(crate) fn slice(axes: &[SliceAxis], x: Src, out: Dst, ctx: &super::Ctx) -> Result<()> {
    let src = strides_of(x.shape.dims());
    let mut strides = [0isize; MAX_RANK];
    let mut base = 0isize;
    for (a, s) in axes.iter().enumerate() {
        strides[a] = src[a] * s.step;
        base += src[a] * s.start as isize;
    }
    copy_strided_threaded(x, out, &strides, base, ctx)
}

pub(crate) fn expand(x: Src, out: Dst) {
    let strides = broadcast_strides(x.shape.dims(), out.shape.dims());
    copy_strided(x, out, &strides, 0);
}

pub(crate) fn tile(x: Src, out: Dst) {
    with_dtype!(x.shape.dtype(), T => {
        let (xd, od) = (x.shape.dims(), out.shape.dims());
        let xs = strides_of(xd);
        let mut idx = [0usize; MAX_RANK];
        for i in 0..out.shape.num_elements() {
            let mut rem = i;
            for a in (0..od.len()).rev() {
                idx[a] = rem % od[a];
                rem /= od[a];
            }
            let p: isize = (0..xd.len()).map(|a| (idx[a] % xd[a]) as isize * xs[a]).sum();
            out.set::<T>(i, x.get(p as usize));
        }
    })
}

/// Copies one concat operand into the output, starting `start` elements into each
/// outer block along the axis.
pub(crate) fn concat_one(axis: usize, x: Src, start: usize, out: Dst) {
    let od = out.shape.dims();
    let outer: usize = od[..axis].iter().product();
    let inner: usize = od[axis + 1..].iter().product();
    let len = x.shape.dim(axis) * inner;
    let size = x.shape.dtype().size_in_bytes();
    if len == 0 || outer == 0 {
        return;
    }
    if outer == 1 && std::ptr::eq(x.ptr, out.ptr.wrapping_add(start * inner * size)) {
        // The planner placed this operand in its range of the output: its producer
        // wrote it there.
        return;
    }
    // Each outer index copies one contiguous block of `len` elements.
    assert!(
        outer * len <= x.len && (outer - 1) * od[axis] * inner + start * inner + len <= out.len,
        "concat block out of bounds"
    );
    #[cfg(target_arch = "x86_64")]
    if len < 16 && size == 4 && crate::isa::isa().avx512f {
        // SAFETY: AVX-512F is available; the blocks lie inside `x` and the output
        // (checked above).
        unsafe {
            copy_short_rows_avx512(
                x.ptr.cast::<u32>(),
                (0, len as isize),
                (out.ptr.cast::<u32>().add(start * inner), od[axis] * inner),
                (outer, len),
            )
        };
        return;
    }
    for o in 0..outer {
        // SAFETY: the block lies inside `x` and inside the output (checked above);
        // the output never aliases an operand.
        unsafe {
            std::ptr::copy_nonoverlapping(
                x.ptr.add(o * len * size),
                out.ptr.add((o * od[axis] * inner + start * inner) * size),
                len * size,
            );
        }
    }
}

/// Index `i` of an integer tensor of any integer dtype.
pub(crate) fn index_at(idx: &Src, i: usize) -> i64 {
    with_dtype!(idx.shape.dtype(), I => idx.get::<I>(i).to_i64())
}

pub(crate) fn gather(axis: usize, x: Src, idx: Src, out: Dst) -> Result<()> {
    let xd = x.shape.dims();
    let n = xd[axis] as i64;
    let count = idx.shape.num_elements();
    for i in 0..count {
        let k = index_at(&idx, i);
        if k < -n || k >= n {
            return Err(Error::runtime(
                "gather",
                format!("index {k} at position {i} is out of range for an axis of length {n}"),
            ));
        }
    }
    let outer: usize = xd[..axis].iter().product();
    let inner: usize = xd[axis + 1..].iter().product();
    // Whole rows of `inner` elements are copied as bytes (gather never runs in place).
    let row_bytes = inner * x.shape.dtype().size_in_bytes();
    for o in 0..outer {
        for i in 0..count {
            let k = index_at(&idx, i);
            let k = if k < 0 { k + n } else { k } as usize;
            let (from, to) = ((o * xd[axis] + k) * inner, (o * count + i) * inner);
            assert!(
                from + inner <= x.len && to + inner <= out.len,
                "gather row out of bounds"
            );
            // SAFETY: both rows are in bounds (checked) and the tensors do not overlap.
            unsafe {
                std::ptr::copy_nonoverlapping(
                    x.ptr.add(from * x.shape.dtype().size_in_bytes()),
                    out.ptr.add(to * x.shape.dtype().size_in_bytes()),
                    row_bytes,
                )
            };
        }
    }
    Ok(())
}

pub(crate) fn pad(pads: &[(usize, usize)], mode: PadMode, x: Src, out: Dst) {
    if let PadMode::Constant(v) = mode
        && x.shape.rank() > 0
    {
        pad_constant(pads, v.get(), x, out);
        return;
    }
    with_dtype!(x.shape.dtype(), T => {
        let (xd, od) = (x.shape.dims(), out.shape.dims());
        let xs = strides_of(xd);
        let fill = match mode {
            PadMode::Constant(v) => T::from_f64(v.get()),
            _ => T::from_f64(0.0),
        };
        for i in 0..out.shape.num_elements() {
            let mut rem = i;
            let mut p = 0isize;
            let mut outside = false;
            for a in (0..od.len()).rev() {
                let o = (rem % od[a]) as isize;
                rem /= od[a];
                let d = xd[a] as isize;
                let mut s = o - pads[a].0 as isize;
                if !(0..d).contains(&s) {
                    match mode {
                        PadMode::Constant(_) => outside = true,
                        PadMode::Edge => s = s.clamp(0, d - 1),
                        PadMode::Reflect => s = if s < 0 { -s } else { 2 * (d - 1) - s },
                    }
                }
                p += s * xs[a];
            }
            out.set::<T>(i, if outside { fill } else { x.get(p as usize) });
        }
    })
}

/// A constant pad: the output filled with the value, then each row of the input
/// copied into its interior.
fn pad_constant(pads: &[(usize, usize)], value: f64, x: Src, out: Dst) {
    with_dtype!(x.shape.dtype(), T => {
        let fill = T::from_f64(value);
        // SAFETY: the output holds `out.len` values of `T` and aliases no operand.
        let dst = unsafe { std::slice::from_raw_parts_mut(out.ptr.cast::<T>(), out.len) };
        dst.fill(fill);
        let (xd, od) = (x.shape.dims(), out.shape.dims());
        if xd.contains(&0) {
            return;
        }
        let rank = xd.len();
        let os = strides_of(od);
        let base: isize = pads.iter().zip(os.iter()).map(|(p, s)| p.0 as isize * s).sum();
        let inner = xd[rank - 1];
        // SAFETY: the input holds `x.len` values of `T`.
        let src = unsafe { std::slice::from_raw_parts(x.ptr.cast::<T>(), x.len) };
        // Each input row lands whole in its padded row.
        for_each_strided(&xd[..rank - 1], [&os], [base], |row, [o]| {
            let o = o as usize;
            dst[o..o + inner].copy_from_slice(&src[row * inner..(row + 1) * inner]);
        });
    })
}

/// Copies every element in order (a reshape materialized).
pub(crate) fn copy_flat(x: Src, out: Dst) {
    with_dtype!(x.shape.dtype(), T => {
        for i in 0..out.shape.num_elements() {
            out.set::<T>(i, x.get(i));
        }
    })
}
