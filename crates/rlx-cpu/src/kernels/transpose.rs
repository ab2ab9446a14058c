//! Permutes that are batches of 2-D transposes once the axes that stay adjacent are
//! merged (an NCHW to WNCH reorder, a last-two-axes swap): copied in square tiles, so
//! both the reads and the writes touch whole cache lines, and split over the pool. A
//! walk in output order reads the input one element per cache line instead. 4-byte
//! elements go through 8 x 8 register blocks (3x faster than element copies on the
//! CRNN's reorder).

use super::Ctx;
use crate::tensor::{Dst, Src, strides_of};
use rlx_ir::{MAX_RANK, Result};

/// Side of the tiles copied at once.
const TILE: usize = 16;
/// Fewer elements than this are copied on the calling thread.
const THREADED_ELEMENTS: usize = 1 << 16;

/// `(batch, rows, cols)` when permuting `dims` by `perm` reads the input as `batch`
/// row-major `rows x cols` matrices and writes each one transposed, one after another.
pub(crate) fn as_batched_transpose(
    dims: &[usize],
    perm: &[usize],
) -> Option<(usize, usize, usize)> {
    let (merged, n) = merged_output_axes(dims, perm);
    match merged[..n] {
        [(cols, 1), (rows, s)] if s == cols as isize => Some((1, rows, cols)),
        [(batch, b), (cols, 1), (rows, s)] if s == cols as isize && b == (rows * cols) as isize => {
            Some((batch, rows, cols))
        }
        _ => None,
    }
}

/// The output's axes of permuting `dims` by `perm` as `(size, stride in the input)`,
/// outermost first: size-1 axes dropped, and an axis merged into the one outside it
/// when the two stay adjacent in the input. Returns them and their count.
fn merged_output_axes(dims: &[usize], perm: &[usize]) -> ([(usize, isize); MAX_RANK], usize) {
    let strides = strides_of(dims);
    let mut merged = [(0usize, 0isize); MAX_RANK];
    let mut n = 0;
    for &p in perm {
        let (size, stride) = (dims[p], strides[p]);
        if size == 1 {
            continue;
        }
        if n > 0 && merged[n - 1].1 == stride * size as isize {
            merged[n - 1] = (merged[n - 1].0 * size, stride);
        } else {
            merged[n] = (size, stride);
            n += 1;
        }
    }
    (merged, n)
}

/// Copies `x` into `out` transposed as [`as_batched_transpose`] found, `(batch, rows,
/// cols)`.
pub(crate) fn batched_transpose(
    (batch, rows, cols): (usize, usize, usize),
    x: Src,
    out: Dst,
    ctx: &Ctx,
) -> Result<()> {
    // SAFETY (all arms): `x` and `out` hold `batch * rows * cols` elements of this size
    // and do not overlap (layout outputs never alias their operands).
    match x.shape.dtype().size_in_bytes() {
        1 => unsafe { transpose::<u8>((batch, rows, cols), x, out, ctx) },
        2 => unsafe { transpose::<u16>((batch, rows, cols), x, out, ctx) },
        4 => unsafe { transpose::<u32>((batch, rows, cols), x, out, ctx) },
        _ => unsafe { transpose::<u64>((batch, rows, cols), x, out, ctx) },
    }
}

/// # Safety
/// As [`batched_transpose`], with `T` the elements' size.
unsafe fn transpose<T: Copy>(
    (batch, rows, cols): (usize, usize, usize),
    x: Src,
    out: Dst,
    ctx: &Ctx,
) -> Result<()> {
    let (src, dst) = (x.ptr as usize, out.ptr as usize);
    let total = batch * rows * cols;
    if total == 0 {
        return Ok(());
    }
    let tasks_per_matrix = if total < THREADED_ELEMENTS {
        1
    } else {
        (4 * ctx.gemm.threads())
            .div_ceil(batch)
            .min(rows.div_ceil(TILE))
    };
    let chunk = rows.div_ceil(tasks_per_matrix).next_multiple_of(TILE);
    let chunks = rows.div_ceil(chunk);
    let task = |u: usize, _thread: usize| {
        let (b, first) = (u / chunks, (u % chunks) * chunk);
        let last = (first + chunk).min(rows);
        let (src, dst) = (src as *const T, dst as *mut T);
        let offset = b * rows * cols;
        if size_of::<T>() == 4 {
            // SAFETY: as below; 4-byte elements read as `u32`.
            unsafe {
                let (src, dst) = (src.add(offset).cast::<u32>(), dst.add(offset).cast::<u32>());
                #[cfg(target_arch = "x86_64")]
                if crate::isa::isa().avx512f {
                    transpose_rows_u32_avx512(src, dst, [rows, cols], [first, last]);
                    return;
                }
                transpose_rows_u32(src, dst, [rows, cols], [first, last]);
            }
            return;
        }
        for r0 in (first..last).step_by(TILE) {
            for c0 in (0..cols).step_by(TILE) {
                for r in r0..(r0 + TILE).min(last) {
                    for c in c0..(c0 + TILE).min(cols) {
                        // SAFETY: (r, c) of matrix b, and (c, r) of its transpose, lie
                        // inside the tensors; tasks write disjoint row ranges.
                        unsafe {
                            *dst.add(offset + c * rows + r) = *src.add(offset + r * cols + c)
                        };
                    }
                }
            }
        }
    };
    ctx.pool.run(batch * chunks, ctx.gemm.threads(), &task)
}

/// A permute whose last output axis is not the input's last (its values lie `stride`
/// apart) but comes right after the input's last axis in the output (a
/// depth-to-space or pixel shuffle, a transposed convolution's phases woven
/// together): each output row interleaves `ways` runs of `run` contiguous input
/// values. `blocks` lists the other output axes (merged where they stay adjacent)
/// as `(size, input stride)`, outermost first.
#[derive(Clone, Copy, Debug, PartialEq)]
pub(crate) struct Interleave {
    blocks: [(usize, isize); MAX_RANK],
    rank: usize,
    run: usize,
    ways: usize,
    stride: isize,
}

impl Interleave {
    /// The other output axes, outermost first.
    fn blocks(&self) -> &[(usize, isize)] {
        &self.blocks[..self.rank]
    }

    /// Where output row `row`'s runs start in the input.
    fn row_offset(&self, mut row: usize) -> isize {
        let mut offset = 0;
        for &(size, stride) in self.blocks().iter().rev() {
            offset += (row % size) as isize * stride;
            row /= size;
        }
        offset
    }
}

/// Most runs one output row interleaves (more go through the element walk).
const MAX_WAYS: usize = 8;

/// The [`Interleave`] that permuting `dims` by `perm` is, if it is one.
pub(crate) fn as_interleave(dims: &[usize], perm: &[usize]) -> Option<Interleave> {
    let (merged, n) = merged_output_axes(dims, perm);
    if n < 2 {
        return None;
    }
    let ((run, one), (ways, stride)) = (merged[n - 2], merged[n - 1]);
    let mut blocks = [(1usize, 0isize); MAX_RANK];
    blocks[..n - 2].copy_from_slice(&merged[..n - 2]);
    (one == 1 && stride != 1 && (2..=MAX_WAYS).contains(&ways)).then_some(Interleave {
        blocks,
        rank: n - 2,
        run,
        ways,
        stride,
    })
}

/// Copies `x` into `out` as the [`Interleave`] `plan` says, blocks of output rows
/// split between the threads when large.
pub(crate) fn interleave(plan: &Interleave, x: Src, out: Dst, ctx: &Ctx) -> Result<()> {
    let rows: usize = plan.blocks().iter().map(|b| b.0).product();
    let row_len = plan.run * plan.ways;
    if rows == 0 || row_len == 0 {
        return Ok(());
    }
    let size = x.shape.dtype().size_in_bytes();
    let (src, dst) = (x.ptr as usize, out.ptr as usize);
    let task = |first: usize, last: usize| {
        for row in first..last {
            let offsets = plan.row_offset(row);
            // SAFETY: row `row` of the output and the runs of `x` it reads (offsets
            // from `x`'s own strides); tasks write disjoint rows.
            unsafe {
                match size {
                    1 => interleave_row::<u8>(src, dst, plan, offsets, row * row_len),
                    2 => interleave_row::<u16>(src, dst, plan, offsets, row * row_len),
                    4 => interleave_row::<u32>(src, dst, plan, offsets, row * row_len),
                    _ => interleave_row::<u64>(src, dst, plan, offsets, row * row_len),
                }
            }
        }
    };
    let threads = ctx.gemm.threads();
    if out.shape.byte_size() < super::PARALLEL_COPY_BYTES || threads < 2 || rows < 2 {
        task(0, rows);
        return Ok(());
    }
    let tasks = (4 * threads).min(rows);
    ctx.pool.run(tasks, threads, &|t, _| {
        task(t * rows / tasks, (t + 1) * rows / tasks)
    })
}

/// One output row of an [`Interleave`]: `out[at + j * ways + w] = x[offset + w *
/// stride + j]`.
///
/// # Safety
/// The row and the runs it reads lie inside the tensors, which do not overlap.
unsafe fn interleave_row<T: Copy>(
    src: usize,
    dst: usize,
    plan: &Interleave,
    offset: isize,
    at: usize,
) {
    let (run, ways) = (plan.run, plan.ways);
    // SAFETY: the caller's contract.
    unsafe {
        let d = std::slice::from_raw_parts_mut((dst as *mut T).add(at), run * ways);
        let base = (src as *const T).offset(offset);
        let mut runs: [&[T]; MAX_WAYS] = [&[]; MAX_WAYS];
        for (w, r) in runs.iter_mut().enumerate().take(ways) {
            *r = std::slice::from_raw_parts(base.offset(w as isize * plan.stride), run);
        }
        match ways {
            2 => weave::<T, 2>(d, &runs),
            3 => weave::<T, 3>(d, &runs),
            4 => weave::<T, 4>(d, &runs),
            _ => {
                for (j, chunk) in d.chunks_exact_mut(ways).enumerate() {
                    for (w, v) in chunk.iter_mut().enumerate() {
                        *v = runs[w][j];
                    }
                }
            }
        }
    }
}

/// `d[j * W + w] = runs[w][j]` with `W` known, so the loop stores whole chunks.
#[inline(always)]
fn weave<T: Copy, const W: usize>(d: &mut [T], runs: &[&[T]; MAX_WAYS]) {
    let runs: [&[T]; W] = std::array::from_fn(|w| runs[w]);
    let (chunks, _) = d.as_chunks_mut::<W>();
    for (j, chunk) in chunks.iter_mut().enumerate() {
        for w in 0..W {
            chunk[w] = runs[w][j];
        }
    }
}

/// Side of the register blocks of 4-byte elements.
const BLOCK: usize = 8;
/// Columns of the strips the 4-byte transpose walks down (a multiple of `BLOCK`).
const STRIP: usize = 64;

crate::vmath::multiversion! {
    /// Rows `first..last` of a row-major `rows x cols` matrix of 4-byte elements at
    /// `src`, written transposed to `dst`: 8 x 8 blocks go through registers (8 loads
    /// and 8 stores of 8 elements), the edges element by element.
    fn transpose_rows_u32(src: *const u32, dst: *mut u32, dims: [usize; 2], range: [usize; 2]) {
        let ([rows, cols], [first, last]) = (dims, range);
        let whole_rows = first + (last - first) / BLOCK * BLOCK;
        let whole_cols = cols / BLOCK * BLOCK;
        // SAFETY (all blocks): every (r, c) read lies inside the matrix and every
        // (c, r) written inside its transpose; the caller owns rows first..last.
        let block = |r0: usize, c0: usize| {
            let mut block = [[0u32; BLOCK]; BLOCK];
            for (i, row) in block.iter_mut().enumerate() {
                *row = unsafe { src.add((r0 + i) * cols + c0).cast::<[u32; BLOCK]>().read_unaligned() };
            }
            let mut turned = [[0u32; BLOCK]; BLOCK];
            for (i, row) in block.iter().enumerate() {
                for (j, &v) in row.iter().enumerate() {
                    turned[j][i] = v;
                }
            }
            for (j, row) in turned.iter().enumerate() {
                unsafe { dst.add((c0 + j) * rows + r0).cast::<[u32; BLOCK]>().write_unaligned(*row) };
            }
        };
        // Column strips, and every row block down a strip before the next: the
        // strip's output rows are written in order, each cache line filled by
        // consecutive blocks. Walking a whole row of blocks instead touches one line
        // of every output row, each `rows` floats apart, and leaves half of each for
        // the next row of blocks: 2048x1024 took 3.2 ms that way, 2.4 ms in strips
        // (one thread; strips of 8 to 64 and square tiles of 16 to 64 measured).
        for s0 in (0..whole_cols).step_by(STRIP) {
            for r0 in (first..whole_rows).step_by(BLOCK) {
                for c0 in (s0..(s0 + STRIP).min(whole_cols)).step_by(BLOCK) {
                    block(r0, c0);
                }
            }
        }
        for r0 in (first..whole_rows).step_by(BLOCK) {
            for c in whole_cols..cols {
                for r in r0..r0 + BLOCK {
                    unsafe { *dst.add(c * rows + r) = *src.add(r * cols + c) };
                }
            }
        }
        for r in whole_rows..last {
            for c in 0..cols {
                unsafe { *dst.add(c * rows + r) = *src.add(r * cols + c) };
            }
        }
    }
}

/// Side of the AVX-512 register blocks of 4-byte elements.
const WIDE_BLOCK: usize = 16;

/// [`transpose_rows_u32`] in 16 x 16 blocks through AVX-512 shuffles (16 loads, 64
/// shuffles and 16 stores a block): the 8 x 8 blocks' element copies were not
/// vectorized, and a ConvNeXt stage's 96 x 3136 reorders took 0.13-0.20 ms each.
/// The edges go through [`transpose_rows_u32`].
///
/// # Safety
/// As [`transpose_rows_u32`]; AVX-512F is available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose_rows_u32_avx512(
    src: *const u32,
    dst: *mut u32,
    [rows, cols]: [usize; 2],
    [first, last]: [usize; 2],
) {
    let whole_rows = first + (last - first) / WIDE_BLOCK * WIDE_BLOCK;
    let whole_cols = cols / WIDE_BLOCK * WIDE_BLOCK;
    // Strips down the rows, as the narrow form walks (see there).
    for s0 in (0..whole_cols).step_by(STRIP) {
        for r0 in (first..whole_rows).step_by(WIDE_BLOCK) {
            for c0 in (s0..(s0 + STRIP).min(whole_cols)).step_by(WIDE_BLOCK) {
                // SAFETY: rows r0..r0 + 16 of the caller's and columns c0..c0 + 16
                // lie inside the matrix; their transposes inside the output.
                unsafe {
                    transpose_block_avx512(
                        (src.add(r0 * cols + c0), cols),
                        (dst.add(c0 * rows + r0), rows),
                    )
                };
            }
        }
    }
    // SAFETY: the caller's contract, for the rest.
    unsafe {
        if whole_cols < cols {
            // The last columns of the whole row blocks: a matrix of their own
            // (`cols` apart) written `rows` apart.
            for r in first..whole_rows {
                for c in whole_cols..cols {
                    *dst.add(c * rows + r) = *src.add(r * cols + c);
                }
            }
        }
        if whole_rows < last {
            transpose_rows_u32(src, dst, [rows, cols], [whole_rows, last]);
        }
    }
}

/// Writes the 16 x 16 block of 4-byte values at `src` (rows `src_stride` apart)
/// transposed at `dst` (rows `dst_stride` apart).
///
/// # Safety
/// Both blocks lie inside their buffers; AVX-512F is available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose_block_avx512(
    (src, src_stride): (*const u32, usize),
    (dst, dst_stride): (*mut u32, usize),
) {
    use std::arch::x86_64::*;
    const N: usize = WIDE_BLOCK;
    // SAFETY: the caller's blocks.
    let r: [__m512; N] =
        std::array::from_fn(|i| unsafe { _mm512_loadu_ps(src.add(i * src_stride).cast()) });
    // Within each 128-bit lane `l`, after the 32- and 64-bit interleaves, u[4i + j]
    // holds column 4l + j of rows 4i..4i + 4.
    let mut t = [_mm512_setzero_ps(); N];
    for i in 0..N / 2 {
        t[2 * i] = _mm512_unpacklo_ps(r[2 * i], r[2 * i + 1]);
        t[2 * i + 1] = _mm512_unpackhi_ps(r[2 * i], r[2 * i + 1]);
    }
    let pd = _mm512_castps_pd;
    let ps = _mm512_castpd_ps;
    let mut u = [_mm512_setzero_ps(); N];
    for i in 0..N / 4 {
        let [a, b, c, d] = [t[4 * i], t[4 * i + 1], t[4 * i + 2], t[4 * i + 3]];
        u[4 * i] = ps(_mm512_unpacklo_pd(pd(a), pd(c)));
        u[4 * i + 1] = ps(_mm512_unpackhi_pd(pd(a), pd(c)));
        u[4 * i + 2] = ps(_mm512_unpacklo_pd(pd(b), pd(d)));
        u[4 * i + 3] = ps(_mm512_unpackhi_pd(pd(b), pd(d)));
    }
    // Output row 4l + j is lane l of u[j], u[4 + j], u[8 + j], u[12 + j]: lanes 0
    // and 1 of each pair gathered first, then lanes 0 and 2 (or 1 and 3) of those.
    for j in 0..4 {
        let low = _mm512_shuffle_f32x4::<0x44>(u[j], u[4 + j]);
        let high = _mm512_shuffle_f32x4::<0xee>(u[j], u[4 + j]);
        let low2 = _mm512_shuffle_f32x4::<0x44>(u[8 + j], u[12 + j]);
        let high2 = _mm512_shuffle_f32x4::<0xee>(u[8 + j], u[12 + j]);
        let rows = [
            _mm512_shuffle_f32x4::<0x88>(low, low2),
            _mm512_shuffle_f32x4::<0xdd>(low, low2),
            _mm512_shuffle_f32x4::<0x88>(high, high2),
            _mm512_shuffle_f32x4::<0xdd>(high, high2),
        ];
        for (l, row) in rows.into_iter().enumerate() {
            // SAFETY: output row 4l + j of the caller's block.
            unsafe { _mm512_storeu_ps(dst.add((4 * l + j) * dst_stride).cast(), row) };
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn transposes_are_recognized_after_merging_axes() {
        // NCHW -> WNCH: the CRNN's reorder before its LSTM.
        assert_eq!(
            as_batched_transpose(&[32, 512, 8, 20], &[3, 0, 1, 2]),
            Some((1, 32 * 512 * 8, 20))
        );
        // A swap of the last two axes under a batch.
        assert_eq!(
            as_batched_transpose(&[2, 3, 4, 5], &[0, 1, 3, 2]),
            Some((6, 4, 5))
        );
        // Size-1 axes do not matter.
        assert_eq!(
            as_batched_transpose(&[1, 7, 1, 9], &[3, 2, 0, 1]),
            Some((1, 7, 9))
        );
        // Not transposes: the identity, and a permute of three separated axes.
        assert_eq!(as_batched_transpose(&[2, 3, 4], &[0, 1, 2]), None);
        assert_eq!(
            as_batched_transpose(&[2, 3, 4], &[2, 0, 1]),
            Some((1, 6, 4))
        );
        assert_eq!(as_batched_transpose(&[2, 3, 4], &[1, 0, 2]), None);
        assert_eq!(as_batched_transpose(&[2, 3, 4, 5], &[3, 1, 2, 0]), None);
    }

    #[test]
    fn wide_transposes_match_an_element_walk() {
        if !crate::isa::isa().avx512f {
            return;
        }
        // Whole 16 x 16 blocks, the last columns and rows outside them, and a row
        // range that starts inside the matrix.
        for (rows, cols, first) in [(96, 3136 / 4, 0), (37, 53, 0), (64, 16, 16), (33, 130, 5)] {
            let src: Vec<u32> = (0..rows * cols)
                .map(|i| (i as u32).wrapping_mul(2654435761))
                .collect();
            let mut got = vec![u32::MAX; rows * cols];
            // SAFETY: the matrix and its transpose; AVX-512F checked above.
            unsafe {
                transpose_rows_u32_avx512(
                    src.as_ptr(),
                    got.as_mut_ptr(),
                    [rows, cols],
                    [first, rows],
                )
            };
            for r in 0..rows {
                for c in 0..cols {
                    let want = if r >= first {
                        src[r * cols + c]
                    } else {
                        u32::MAX
                    };
                    assert_eq!(
                        got[c * rows + r],
                        want,
                        "{rows} x {cols} from {first}: ({r}, {c})"
                    );
                }
            }
        }
    }

    #[test]
    fn interleaves_are_recognized_after_merging_axes() {
        // A transposed convolution's phases `[n, sy, sx, o, h, w]` woven into
        // `[n, o, h, sy, w, sx]`: `o` and `h` merge; rows of `w` values, 2 ways.
        let plan = as_interleave(&[1, 2, 2, 8, 5, 7], &[0, 3, 4, 1, 5, 2]).unwrap();
        assert_eq!((plan.run, plan.ways, plan.stride), (7, 2, 8 * 5 * 7));
        assert_eq!(plan.blocks(), [(40, 7), (2, 2 * 8 * 5 * 7)]);
        assert_eq!(plan.row_offset(41), 20 * 7 + 2 * 8 * 5 * 7);
        // The last axis staying, too many ways, and a last axis from the middle of
        // the output are not interleaves.
        assert!(as_interleave(&[2, 3, 4], &[1, 0, 2]).is_none());
        assert!(as_interleave(&[9, 5], &[1, 0]).is_none());
        assert!(as_interleave(&[3, 4, 5], &[1, 0, 2]).is_none());
        assert!(as_interleave(&[3, 4, 5], &[0, 2, 1]).is_some());
    }
}
