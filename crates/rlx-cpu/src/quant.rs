//! Matrix products against block-quantized weight rows (`[N, row_bytes]`, the GGUF
//! layout of a linear layer), reading the packed blocks directly.
//!
//! - [`gemv`]: a few rows of activations (token-by-token decoding). Each weight block
//!   is decoded once into registers and multiplied with every activation row, so the
//!   packed bytes are streamed from memory exactly once per call.
//! - Many rows go through the `f32` GEMM with `BFormat::Quant`: [`decode_run`] turns
//!   the blocks into `f32` while the GEMM packs its `B` panels, and the panel is then
//!   reused by every row of `A`.

mod simd;

use crate::pool::ThreadPool;
use rlx_ir::{QuantFormat, Result};

/// Up to this many activation rows use [`gemv`]; more use the packed GEMM.
pub(crate) const GEMV_MAX_ROWS: usize = 8;

/// GEMV tasks per thread: a few, claimed dynamically, so a core slowed by another
/// process takes fewer; each a long contiguous run of weight rows, because short runs
/// claimed in turn by two threads cut both memory streams into pieces the hardware
/// prefetchers keep restarting on (32-row tasks read half as fast as 128-row ones).
const TASKS_PER_THREAD: usize = 4;
/// The fewest weight rows a GEMV task takes.
const MIN_TASK_ROWS: usize = 16;

/// Largest block length of any format.
const MAX_BLOCK: usize = 256;

/// The operands of one GEMV, shared by its tasks.
struct Gemv {
    format: QuantFormat,
    a: *const f32,
    m: usize,
    k: usize,
    w: *const u8,
    row_bytes: usize,
    n: usize,
    out: *mut f32,
}

// SAFETY: tasks only read `a` and `w`, and write disjoint columns of `out`.
unsafe impl Sync for Gemv {}

/// `out[i, j] = sum_p a[i, p] * W[j, p]` for `m <= GEMV_MAX_ROWS` rows of `a`.
///
/// # Safety
/// `a` holds `m x k` floats, `w` holds `n` rows of `format.row_bytes(k)` bytes, `out`
/// holds `m x n` floats and overlaps neither.
#[allow(clippy::too_many_arguments)]
pub(crate) unsafe fn gemv(
    format: QuantFormat,
    a: *const f32,
    m: usize,
    k: usize,
    w: *const u8,
    n: usize,
    out: *mut f32,
    pool: &ThreadPool,
    threads: usize,
) -> Result<()> {
    let g = Gemv {
        format,
        a,
        m,
        k,
        w,
        row_bytes: format.row_bytes(k)?,
        n,
        out,
    };
    let per_task = n
        .div_ceil(threads.max(1) * TASKS_PER_THREAD)
        .max(MIN_TASK_ROWS);
    let tasks = n.div_ceil(per_task);
    let task = |t: usize, _thread: usize| {
        let rows = t * per_task..((t + 1) * per_task).min(g.n);
        // SAFETY: the task's rows lie inside W and its columns inside `out`.
        unsafe { gemv_rows(&g, rows) };
    };
    if tasks <= 1 || threads <= 1 {
        for t in 0..tasks {
            task(t, 0);
        }
        return Ok(());
    }
    pool.run(tasks, threads, &task)
}

/// Columns `rows` of the GEMV output.
///
/// # Safety
/// As [`gemv`]; `rows` lies inside `0..g.n`.
unsafe fn gemv_rows(g: &Gemv, rows: std::ops::Range<usize>) {
    // SAFETY: per the contract.
    let a = unsafe { std::slice::from_raw_parts(g.a, g.m * g.k) };
    let end = rows.end;
    for j in rows {
        // SAFETY: row j of W.
        let row = unsafe { std::slice::from_raw_parts(g.w.add(j * g.row_bytes), g.row_bytes) };
        if j + PREFETCH_ROWS < end {
            // SAFETY: row j + PREFETCH_ROWS of W exists.
            crate::prefetch::lines(
                unsafe { g.w.add((j + PREFETCH_ROWS) * g.row_bytes) },
                g.row_bytes,
            );
        }
        let mut sums = [0f32; GEMV_MAX_ROWS];
        if !simd::dot_rows(g.format, row, a, g.m, g.k, &mut sums) {
            dot_rows_generic(g.format, row, a, g.m, g.k, &mut sums);
        }
        for (i, &s) in sums.iter().enumerate().take(g.m) {
            // SAFETY: (i, j) is inside `out`; only this task writes column j.
            unsafe { *g.out.add(i * g.n + j) = s };
        }
    }
}

/// Weight rows ahead of the current one whose bytes are requested from memory.
const PREFETCH_ROWS: usize = 8;

/// `sums[i] = a[i, :] . row` for every format: decode a block, then multiply.
fn dot_rows_generic(
    format: QuantFormat,
    row: &[u8],
    a: &[f32],
    m: usize,
    k: usize,
    sums: &mut [f32; GEMV_MAX_ROWS],
) {
    let (bl, bb) = (format.block_len(), format.block_bytes());
    let mut values = [0f32; MAX_BLOCK];
    for (b, block) in row.chunks_exact(bb).enumerate() {
        let values = &mut values[..bl];
        format.dequantize_block(block, values);
        for (i, sum) in sums.iter_mut().enumerate().take(m) {
            let x = &a[i * k + b * bl..i * k + (b + 1) * bl];
            *sum += dot(x, values);
        }
    }
}

crate::vmath::multiversion! {
    /// A plain dot product in 16 lanes.
    fn dot(x: &[f32], y: &[f32]) -> f32 {
        let mut lanes = [0f32; 16];
        for (cx, cy) in x.chunks_exact(16).zip(y.chunks_exact(16)) {
            for l in 0..16 {
                lanes[l] += cx[l] * cy[l];
            }
        }
        let tail = x.len() / 16 * 16;
        let mut s: f32 = x[tail..].iter().zip(&y[tail..]).map(|(p, q)| p * q).sum();
        for l in lanes {
            s += l;
        }
        s
    }
}

/// Decodes values `start .. start + dst.len()` of one packed row into `dst`.
///
/// # Safety
/// `row` addresses a whole row that holds those values.
pub(crate) unsafe fn decode_run(
    format: QuantFormat,
    row: *const u8,
    start: usize,
    dst: &mut [f32],
) {
    let (bl, bb) = (format.block_len(), format.block_bytes());
    let end = start + dst.len();
    let mut values = [0f32; MAX_BLOCK];
    let mut b = start / bl;
    while b * bl < end {
        // SAFETY: block b holds values inside the row.
        let block = unsafe { std::slice::from_raw_parts(row.add(b * bb), bb) };
        let (lo, hi) = ((b * bl).max(start), ((b + 1) * bl).min(end));
        if lo == b * bl && hi == (b + 1) * bl {
            let whole = &mut dst[lo - start..hi - start];
            if !simd::decode_block32(format, block, 0, whole) {
                format.dequantize_block(block, whole);
            }
        } else {
            format.dequantize_block(block, &mut values[..bl]);
            dst[lo - start..hi - start].copy_from_slice(&values[lo - b * bl..hi - b * bl]);
        }
        b += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Random whole blocks with sane scales (random `f16` bits could be NaN).
    fn random_row(format: QuantFormat, k: usize, seed: &mut u64) -> Vec<u8> {
        let mut bytes = vec![0u8; format.row_bytes(k).unwrap_or(0)];
        for b in bytes.iter_mut() {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            *b = (*seed >> 56) as u8;
        }
        let scale = |v: f32| half::f16::from_f32(v).to_bits().to_le_bytes();
        for block in bytes.chunks_exact_mut(format.block_bytes()) {
            match format {
                QuantFormat::Q6K => block[208..210].copy_from_slice(&scale(0.01)),
                QuantFormat::Q8K => block[0..4].copy_from_slice(&0.02f32.to_le_bytes()),
                _ => {
                    block[0..2].copy_from_slice(&scale(0.03));
                    if matches!(
                        format,
                        QuantFormat::Q4_1 | QuantFormat::Q5_1 | QuantFormat::Q4K | QuantFormat::Q5K
                    ) {
                        block[2..4].copy_from_slice(&scale(-0.02));
                    }
                }
            }
        }
        bytes
    }

    #[test]
    fn gemv_matches_dequantize_then_dot() {
        let pool = ThreadPool::global();
        let mut seed = 7u64;
        for format in QuantFormat::ALL {
            let mut shapes = vec![(1, 512, 70), (3, 768, 33), (8, 256, 5)];
            if format.block_len() == 32 {
                // Odd block counts (the tail of the alternating accumulators), and
                // enough rows for several tasks per thread.
                shapes.extend([(1, 96, 300), (2, 160, 17), (4, 224, 9), (1, 32, 3)]);
            }
            for (m, k, n) in shapes {
                let w: Vec<u8> = (0..n)
                    .flat_map(|_| random_row(format, k, &mut seed))
                    .collect();
                let a: Vec<f32> = (0..m * k)
                    .map(|i| ((i * 37 % 101) as f32 - 50.0) / 40.0)
                    .collect();
                let mut out = vec![0f32; m * n];
                // SAFETY: sizes as stated.
                unsafe {
                    gemv(
                        format,
                        a.as_ptr(),
                        m,
                        k,
                        w.as_ptr(),
                        n,
                        out.as_mut_ptr(),
                        pool,
                        2,
                    )
                }
                .unwrap();
                let rb = format.row_bytes(k).unwrap();
                let mut row = vec![0f32; k];
                for j in 0..n {
                    rlx_ir::dequantize_row(format, &w[j * rb..(j + 1) * rb], &mut row).unwrap();
                    for i in 0..m {
                        let want: f64 = (0..k).map(|p| a[i * k + p] as f64 * row[p] as f64).sum();
                        let got = out[i * n + j] as f64;
                        assert!(
                            (got - want).abs() <= 1e-4 * (1.0 + want.abs()),
                            "{format} m={m} k={k} ({i},{j}): {got} vs {want}"
                        );
                    }
                }
                // Partial runs decode the same values as whole rows.
                let mut part = vec![0f32; k.min(113) - 13];
                // SAFETY: values 13..13 + part.len() lie inside row 0.
                unsafe { decode_run(format, w.as_ptr(), 13, &mut part) };
                rlx_ir::dequantize_row(format, &w[..rb], &mut row).unwrap();
                assert_eq!(part, row[13..13 + part.len()]);
            }
        }
    }
}
