//! `f32` pooling over channel-blocked values ([`crate::layout`]: blocks of 16
//! channels, pixel by pixel, a last one of 8 where the channels end there): max
//! and average pooling (blocked in and out) and the sum or mean over a whole plane
//! (blocked in, plain `[n, c]` out, as a global average pool or a
//! squeeze-and-excitation block's first step reads it). Each
//! output pixel is a block of channels, one vector, whatever the plane's width
//! (with AVX-512; elsewhere lane by lane, in loops compiled per instruction set).

use super::Ctx;
use super::conv::inside_taps;
use crate::layout::{BLOCK, Blocks};
use crate::tensor::{Dst, Src};
use crate::vmath::multiversion;
use rlx_ir::{Result, Window2d};

/// What one pooled row needs.
#[derive(Clone, Copy)]
struct PoolRow<'a> {
    win: &'a Window2d,
    max: bool,
    count_include_pad: bool,
    in_hw: [usize; 2],
    ow: usize,
    /// Channels per block.
    lanes: usize,
}

/// Max or average pooling of blocked `x` into blocked `out` (`count_include_pad`:
/// an average divides by the whole window, else by its taps inside the input; a
/// maximum is NaN where any tap is).
pub(crate) fn pool(
    win: &Window2d,
    max: bool,
    count_include_pad: bool,
    x: Src,
    out: Dst,
    ctx: &Ctx,
) -> Result<()> {
    let [n, c, h, w] = super::conv::nchw(x.shape);
    let [oh, ow] = [out.shape.dim(2), out.shape.dim(3)];
    let (x_blocks, out_blocks) = (Blocks::new(c, h * w), Blocks::new(c, oh * ow));
    let planes = n * x_blocks.count();
    if planes == 0 || oh == 0 || ow == 0 {
        return Ok(());
    }
    let rows = planes * oh;
    let threads = ctx.gemm.threads();
    let tasks = rows.min(8 * threads);
    let (x_addr, out_addr) = (x.ptr as usize, out.ptr as usize);
    let task = |t: usize, _thread: usize| {
        for r in t * rows / tasks..(t + 1) * rows / tasks {
            let (plane, oy) = (r / oh, r % oh);
            let ((from, b, _), (to, _, _)) = (x_blocks.plane(plane), out_blocks.plane(plane));
            let row = PoolRow {
                win,
                max,
                count_include_pad,
                in_hw: [h, w],
                ow,
                lanes: b,
            };
            // SAFETY: plane `plane` of `x` (`h * w` pixels of `b` values), and its
            // row `oy` of the output, which only this task writes.
            let (src, dst) = unsafe {
                (
                    std::slice::from_raw_parts((x_addr as *const f32).add(from), h * w * b),
                    std::slice::from_raw_parts_mut(
                        (out_addr as *mut f32).add(to + oy * ow * b),
                        ow * b,
                    ),
                )
            };
            pool_row(row, oy, src, dst);
        }
    };
    ctx.pool.run(tasks, threads, &task)
}

/// Output row `oy` of one plane: each output pixel's block of channels in one
/// vector (a block of 8 under a lane mask), its taps inside the input read as
/// whole vectors.
fn pool_row(row: PoolRow, oy: usize, src: &[f32], dst: &mut [f32]) {
    let ([h, w], lanes) = (row.in_hw, row.lanes);
    assert!(
        src.len() >= h * w * lanes && dst.len() >= row.ow * lanes && lanes <= BLOCK,
        "a blocked pool row's planes"
    );
    #[cfg(target_arch = "x86_64")]
    if crate::isa::isa().avx512f {
        // SAFETY: AVX-512F; the plane and the row hold what the assert checked.
        unsafe { pool_row_avx512(row, oy, src, dst) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::isa::isa().avx2_fma && lanes.is_multiple_of(8) {
        // SAFETY: AVX2; the plane and the row hold what the assert checked, in
        // pixels of 8 or 16 values.
        unsafe {
            match lanes {
                8 => pool_row_avx2::<1>(row, oy, src, dst),
                _ => pool_row_avx2::<2>(row, oy, src, dst),
            }
        };
        return;
    }
    pool_row_lanes(row, oy, src, dst);
}

/// [`pool_row`] on AVX2 for blocks of `L` vectors of 8 (`row.lanes == 8 * L`), as
/// [`pool_row_avx512`] runs it: inner pixels read their taps from offsets listed
/// once, over two running results; a maximum's NaN lanes are collected apart.
///
/// # Safety
/// AVX2 is available; `src` holds the plane's `h * w` pixels of `8 * L` values,
/// `dst` the row's `ow`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn pool_row_avx2<const L: usize>(row: PoolRow, oy: usize, src: &[f32], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let PoolRow {
        win,
        max,
        count_include_pad,
        in_hw: [h, w],
        ow,
        lanes,
    } = row;
    let (y0, ny) = inside_taps(win, 0, oy, h);
    let window = win.kernel[0] * win.kernel[1];
    let (dx, sx) = (win.dilation[1], win.stride[1]);
    let RowTaps {
        inner_range,
        offsets,
        listed,
    } = row_taps(&row, (y0, ny));
    let init = _mm256_set1_ps(if max { f32::NEG_INFINITY } else { 0.0 });
    type State<const L: usize> = ([__m256; L], [__m256; L], [__m256; L]);
    // Two running results over alternate taps; `max_ps` keeps its second operand
    // (the running maximum) where either is NaN, and NaN lanes are kept apart.
    // SAFETY (each use): the tap's pixel lies inside the plane.
    let step = |(acc, other, nan): State<L>, at: usize| unsafe {
        let t: [__m256; L] = std::array::from_fn(|l| _mm256_loadu_ps(src.as_ptr().add(at + 8 * l)));
        if max {
            let nan = std::array::from_fn(|l| {
                _mm256_or_ps(nan[l], _mm256_cmp_ps::<_CMP_UNORD_Q>(t[l], t[l]))
            });
            (
                other,
                std::array::from_fn(|l| _mm256_max_ps(t[l], acc[l])),
                nan,
            )
        } else {
            (
                other,
                std::array::from_fn(|l| _mm256_add_ps(acc[l], t[l])),
                nan,
            )
        }
    };
    for ox in 0..ow {
        let mut state: State<L> = ([init; L], [init; L], [_mm256_setzero_ps(); L]);
        let taps;
        if inner_range.contains(&ox) && listed <= MAX_LISTED_TAPS {
            let base = (ox * sx - win.padding[1]) * lanes;
            for &offset in &offsets[..listed] {
                state = step(state, base + offset);
            }
            taps = listed;
        } else {
            let (x0, nx) = inside_taps(win, 1, ox, w);
            for ty in 0..ny {
                let iy = y0 + ty * win.dilation[0];
                for tx in 0..nx {
                    state = step(state, (iy * w + x0 + tx * dx) * lanes);
                }
            }
            taps = ny * nx;
        }
        let (acc, other, nan) = state;
        let scale = _mm256_set1_ps(
            1.0 / if count_include_pad {
                window
            } else {
                taps.max(1)
            } as f32,
        );
        for l in 0..L {
            let value = if max {
                _mm256_blendv_ps(
                    _mm256_max_ps(acc[l], other[l]),
                    _mm256_set1_ps(f32::NAN),
                    nan[l],
                )
            } else {
                _mm256_mul_ps(_mm256_add_ps(acc[l], other[l]), scale)
            };
            // SAFETY: pixel `ox` of the row.
            unsafe { _mm256_storeu_ps(dst.as_mut_ptr().add(ox * lanes + 8 * l), value) };
        }
    }
}

multiversion! {
    /// [`pool_row`] lane by lane (for CPUs without AVX-512; compiled per instruction
    /// set, the lanes' loops vectorize): each output pixel's taps inside the input
    /// reduced into a block of sums.
    fn pool_row_lanes(row: PoolRow, oy: usize, src: &[f32], dst: &mut [f32]) {
        let PoolRow { win, max, count_include_pad, in_hw: [h, w], ow, lanes } = row;
        let (y0, ny) = inside_taps(win, 0, oy, h);
        let window = win.kernel[0] * win.kernel[1];
        for ox in 0..ow {
            let (x0, nx) = inside_taps(win, 1, ox, w);
            let mut acc = [if max { f32::NEG_INFINITY } else { 0.0 }; BLOCK];
            let mut nan = [false; BLOCK];
            for ty in 0..ny {
                let iy = y0 + ty * win.dilation[0];
                for tx in 0..nx {
                    let ix = x0 + tx * win.dilation[1];
                    let tap = &src[(iy * w + ix) * lanes..][..lanes];
                    for j in 0..lanes {
                        let t = tap[j];
                        if max {
                            nan[j] |= t.is_nan();
                            acc[j] = if t > acc[j] { t } else { acc[j] };
                        } else {
                            acc[j] += t;
                        }
                    }
                }
            }
            let count = if count_include_pad { window } else { (ny * nx).max(1) };
            let out = &mut dst[ox * lanes..][..lanes];
            for j in 0..lanes {
                out[j] = if !max {
                    acc[j] * (1.0 / count as f32)
                } else if nan[j] {
                    f32::NAN
                } else {
                    acc[j]
                };
            }
        }
    }
}

/// [`pool_row`] on AVX-512.
///
/// # Safety
/// AVX-512F is available; `src` holds the plane's `h * w` pixels of `lanes`
/// values, `dst` the row's `ow`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn pool_row_avx512(row: PoolRow, oy: usize, src: &[f32], dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let PoolRow {
        win,
        max,
        count_include_pad,
        in_hw: [h, w],
        ow,
        lanes,
    } = row;
    let mask: __mmask16 = crate::layout::lane_mask(lanes);
    let (y0, ny) = inside_taps(win, 0, oy, h);
    let window = win.kernel[0] * win.kernel[1];
    let (dx, sx) = (win.dilation[1], win.stride[1]);
    let RowTaps {
        inner_range,
        offsets,
        listed,
    } = row_taps(&row, (y0, ny));
    let finish = |acc: __m512, other: __m512, nan: __mmask16, taps: usize| {
        if max {
            _mm512_mask_blend_ps(nan, _mm512_max_ps(acc, other), _mm512_set1_ps(f32::NAN))
        } else {
            let count = if count_include_pad {
                window
            } else {
                taps.max(1)
            };
            _mm512_mul_ps(
                _mm512_add_ps(acc, other),
                _mm512_set1_ps(1.0 / count as f32),
            )
        }
    };
    let init = _mm512_set1_ps(if max { f32::NEG_INFINITY } else { 0.0 });
    // Two running results over alternate taps, so each waits on half of them; a
    // maximum's NaN lanes are collected apart (`max_ps` keeps its second operand
    // where either is NaN: the running maximum, never `t`), so the chain is one
    // instruction a tap.
    let step = |(acc, other, nan): (__m512, __m512, __mmask16), t: __m512| {
        if max {
            let nan = nan | _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(t, t);
            (other, _mm512_max_ps(t, acc), nan)
        } else {
            (other, _mm512_add_ps(acc, t), nan)
        }
    };
    for ox in 0..ow {
        let mut state = (init, init, 0 as __mmask16);
        let taps;
        if inner_range.contains(&ox) && listed <= MAX_LISTED_TAPS {
            let base = (ox * sx - win.padding[1]) * lanes;
            for &offset in &offsets[..listed] {
                // SAFETY: every tap of an inner pixel lies inside the plane.
                let t = unsafe { _mm512_maskz_loadu_ps(mask, src.as_ptr().add(base + offset)) };
                state = step(state, t);
            }
            taps = listed;
        } else {
            let (x0, nx) = inside_taps(win, 1, ox, w);
            for ty in 0..ny {
                let iy = y0 + ty * win.dilation[0];
                for tx in 0..nx {
                    let ix = x0 + tx * dx;
                    // SAFETY: pixel `(iy, ix)` lies inside the plane (`inside_taps`).
                    let t = unsafe {
                        _mm512_maskz_loadu_ps(mask, src.as_ptr().add((iy * w + ix) * lanes))
                    };
                    state = step(state, t);
                }
            }
            taps = ny * nx;
        }
        let acc = finish(state.0, state.1, state.2, taps);
        // SAFETY: pixel `ox` of the row.
        unsafe { _mm512_mask_storeu_ps(dst.as_mut_ptr().add(ox * lanes), mask, acc) };
    }
}

/// The taps one output row's inner pixels share ([`row_taps`]).
struct RowTaps {
    /// The pixels whose window lies inside the row (all its taps).
    inner_range: std::ops::Range<usize>,
    /// Each tap's offset from an inner pixel's first tap, in floats (the first
    /// `listed`, when they fit).
    offsets: [usize; MAX_LISTED_TAPS],
    /// Taps of the window inside the plane's rows.
    listed: usize,
}

/// The taps of output row `oy` (its rows of taps inside the plane from input row
/// `y0`, `ny` of them): the pixels whose window lies inside the row read the same
/// offsets from their first tap, listed once, so no pixel checks bounds (a
/// division and a loop of unknown length per pixel ran a 3x3 pool 1.5 times ORT's
/// time). They are one range, found from each end, testing only the edge pixels.
fn row_taps(row: &PoolRow, (y0, ny): (usize, usize)) -> RowTaps {
    let (win, [_, w], ow, lanes) = (row.win, row.in_hw, row.ow, row.lanes);
    let (kw, dx) = (win.kernel[1], win.dilation[1]);
    let whole = |ox: usize| inside_taps(win, 1, ox, w).1 == kw;
    let inner_range = match (0..ow).find(|&ox| whole(ox)) {
        Some(first) => {
            first
                ..(first..ow)
                    .rev()
                    .find(|&ox| whole(ox))
                    .map_or(first, |last| last + 1)
        }
        None => 0..0,
    };
    let mut offsets = [0usize; MAX_LISTED_TAPS];
    let listed = ny * kw;
    if listed <= MAX_LISTED_TAPS {
        for ty in 0..ny {
            for tx in 0..kw {
                offsets[ty * kw + tx] = ((y0 + ty * win.dilation[0]) * w + tx * dx) * lanes;
            }
        }
    }
    RowTaps {
        inner_range,
        offsets,
        listed,
    }
}

/// Taps of one row's window that [`row_taps`] lists as offsets for its
/// inner pixels (a wider window reads each tap with bounds).
const MAX_LISTED_TAPS: usize = 64;

/// The sum (or mean) over each plane of blocked `x`, into plain `out` (`[n, c]`
/// values, however its dims are written).
pub(crate) fn plane_sums(mean: bool, x: Src, out: Dst, ctx: &Ctx) -> Result<()> {
    let [n, c] = [x.shape.dim(0), x.shape.dim(1)];
    let pixels = x.shape.dim(2) * x.shape.dim(3);
    let blocks = Blocks::new(c, pixels);
    let planes = n * blocks.count();
    if planes == 0 {
        return Ok(());
    }
    let scale = if mean && pixels > 0 {
        1.0 / pixels as f64
    } else {
        1.0
    };
    let threads = ctx.gemm.threads();
    let tasks = planes.min(4 * threads);
    let (x_addr, out_addr) = (x.ptr as usize, out.ptr as usize);
    let task = |t: usize, _thread: usize| {
        for plane in t * planes / tasks..(t + 1) * planes / tasks {
            let (from, b, first) = blocks.plane(plane);
            let image = plane / blocks.count();
            // SAFETY: plane `plane` of `x`, and its `b` channels of the output, which
            // only this task writes.
            let (src, dst) = unsafe {
                (
                    std::slice::from_raw_parts((x_addr as *const f32).add(from), pixels * b),
                    std::slice::from_raw_parts_mut(
                        (out_addr as *mut f32).add(image * c + first),
                        b,
                    ),
                )
            };
            sum_pixels(src, scale, dst);
        }
    };
    ctx.pool.run(tasks, threads, &task)
}

/// `dst[j] = scale * Σ_p src[p][j]` over the pixels of one blocked plane (of
/// `dst.len()` channels, at most [`BLOCK`]), summed in `f64` as the plain kernel
/// sums.
fn sum_pixels(src: &[f32], scale: f64, dst: &mut [f32]) {
    assert!(
        dst.len() <= BLOCK && src.len().is_multiple_of(dst.len().max(1)),
        "a blocked plane's pixels"
    );
    #[cfg(target_arch = "x86_64")]
    if crate::isa::isa().avx512f {
        // SAFETY: AVX-512F; the plane holds whole pixels of `dst.len()` values
        // (checked above).
        unsafe { sum_pixels_avx512(src, scale, dst) };
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if crate::isa::isa().avx2_fma && matches!(dst.len(), 8 | 16) {
        // SAFETY: AVX2; the plane holds whole pixels of 8 or 16 values.
        unsafe {
            match dst.len() {
                8 => sum_pixels_avx2::<1>(src, scale, dst),
                _ => sum_pixels_avx2::<2>(src, scale, dst),
            }
        };
        return;
    }
    sum_pixels_lanes(src, scale, dst);
}

/// [`sum_pixels`] on AVX2 for blocks of `L` vectors of 8 (`dst.len() == 8 * L`):
/// each pixel's values widened to `f64` four at a time, two pixels at a time into
/// two sets of sums.
///
/// # Safety
/// AVX2 is available; `src` holds whole pixels of `8 * L` values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
unsafe fn sum_pixels_avx2<const L: usize>(src: &[f32], scale: f64, dst: &mut [f32]) {
    use std::arch::x86_64::*;
    let lanes = 8 * L;
    let pixels = src.len() / lanes;
    // Pixel `p`'s values added, as `f64`, to `sums` (its quarters of 4 lanes).
    let add = |sums: &mut [[__m256d; 2]; L], p: usize| {
        for (l, pair) in sums.iter_mut().enumerate() {
            // SAFETY: pixel `p < pixels` lies inside `src`.
            let v = unsafe { _mm256_loadu_ps(src.as_ptr().add(p * lanes + 8 * l)) };
            pair[0] = _mm256_add_pd(pair[0], _mm256_cvtps_pd(_mm256_castps256_ps128(v)));
            pair[1] = _mm256_add_pd(pair[1], _mm256_cvtps_pd(_mm256_extractf128_ps::<1>(v)));
        }
    };
    let zero = [[_mm256_setzero_pd(); 2]; L];
    let (mut even, mut odd) = (zero, zero);
    for p in (0..pixels / 2 * 2).step_by(2) {
        add(&mut even, p);
        add(&mut odd, p + 1);
    }
    if pixels % 2 == 1 {
        add(&mut even, pixels - 1);
    }
    let mut all = [0.0f64; BLOCK];
    for l in 0..L {
        for h in 0..2 {
            // SAFETY: `all` holds 16 values.
            unsafe {
                _mm256_storeu_pd(
                    all.as_mut_ptr().add(8 * l + 4 * h),
                    _mm256_add_pd(even[l][h], odd[l][h]),
                )
            };
        }
    }
    for (d, a) in dst.iter_mut().zip(all) {
        *d = (a * scale) as f32;
    }
}

multiversion! {
    /// [`sum_pixels`] lane by lane (for CPUs without AVX-512; compiled per
    /// instruction set), in `f64`, two pixels at a time into two sets of sums.
    fn sum_pixels_lanes(src: &[f32], scale: f64, dst: &mut [f32]) {
        let lanes = dst.len();
        let mut sums = [[0.0f64; BLOCK]; 2];
        let mut pairs = src.chunks_exact(2 * lanes.max(1));
        for pair in &mut pairs {
            for (set, pixel) in sums.iter_mut().zip(pair.chunks_exact(lanes)) {
                for (sum, &v) in set.iter_mut().zip(pixel) {
                    *sum += f64::from(v);
                }
            }
        }
        for (sum, &v) in sums[0].iter_mut().zip(pairs.remainder()) {
            *sum += f64::from(v);
        }
        for (j, d) in dst.iter_mut().enumerate() {
            *d = ((sums[0][j] + sums[1][j]) * scale) as f32;
        }
    }
}

/// [`sum_pixels`] on AVX-512: four pixels at a time into four sets of `f64` sums
/// (one set's chain of additions waited on each addition's latency, 4 cycles a
/// pixel: EfficientNet's 17 plane sums took 0.40 ms).
///
/// # Safety
/// AVX-512F is available; `src` holds whole pixels of `dst.len()` (at most 16)
/// values.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sum_pixels_avx512(src: &[f32], scale: f64, dst: &mut [f32]) {
    use std::arch::x86_64::*;
    const SETS: usize = 4;
    let lanes = dst.len();
    let mask = crate::layout::lane_mask(lanes);
    let pixels = src.len() / lanes.max(1);
    // Pixel `p`'s values as two vectors of 8 `f64` (its lanes past `lanes` zero).
    // SAFETY (each use): pixel `p < pixels` lies inside `src`.
    let load = |p: usize| unsafe {
        let v = _mm512_maskz_loadu_ps(mask, src.as_ptr().add(p * lanes));
        let low = _mm512_cvtps_pd(_mm512_castps512_ps256(v));
        let high = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd::<1>(
            _mm512_castps_pd(v),
        )));
        (low, high)
    };
    let mut sums = [(_mm512_setzero_pd(), _mm512_setzero_pd()); SETS];
    let whole = pixels / SETS * SETS;
    for p in (0..whole).step_by(SETS) {
        for (k, (low, high)) in sums.iter_mut().enumerate() {
            let (l, h) = load(p + k);
            *low = _mm512_add_pd(*low, l);
            *high = _mm512_add_pd(*high, h);
        }
    }
    for (k, p) in (whole..pixels).enumerate() {
        let (l, h) = load(p);
        sums[k].0 = _mm512_add_pd(sums[k].0, l);
        sums[k].1 = _mm512_add_pd(sums[k].1, h);
    }
    let (mut low, mut high) = sums[0];
    for &(l, h) in &sums[1..] {
        low = _mm512_add_pd(low, l);
        high = _mm512_add_pd(high, h);
    }
    let mut all = [0.0f64; BLOCK];
    // SAFETY: `all` holds 16 values.
    unsafe {
        _mm512_storeu_pd(all.as_mut_ptr(), low);
        _mm512_storeu_pd(all.as_mut_ptr().add(8), high);
    }
    for (d, a) in dst.iter_mut().zip(all) {
        *d = (a * scale) as f32;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::gemm::tests::lcg;
    use crate::kernels::conv::{extent, pool as plain_pool};
    use crate::kernels::with_test_ctx;
    use crate::layout::{from_blocked, to_blocked};
    use rlx_ir::{DType, Shape};

    fn src<'a>(values: &'a [f32], shape: &'a Shape) -> Src<'a> {
        Src {
            ptr: values.as_ptr().cast(),
            shape,
            len: values.len(),
        }
    }

    fn dst<'a>(values: &'a mut [f32], shape: &'a Shape) -> Dst<'a> {
        Dst {
            ptr: values.as_mut_ptr().cast(),
            shape,
            len: values.len(),
        }
    }

    #[test]
    fn blocked_pools_match_the_plain_reference() {
        // (threads, x dims, kernel, stride, padding, dilation): ResNet's 3x3
        // stride-2 max pool, windows past the edge, dilation, and a plane whose
        // windows are all partial.
        let cases = [
            (2, [2, 32, 9, 11], [3, 3], [2, 2], [1, 1, 1, 1], [1, 1]),
            (3, [1, 16, 7, 7], [2, 2], [2, 2], [0, 0, 1, 1], [1, 1]),
            (1, [1, 48, 10, 6], [3, 3], [1, 1], [2, 2, 2, 2], [2, 2]),
            (2, [1, 16, 2, 3], [5, 5], [1, 1], [2, 2, 2, 2], [1, 1]),
            (2, [2, 24, 9, 7], [3, 3], [2, 2], [1, 1, 1, 1], [1, 1]),
            (1, [1, 40, 6, 6], [2, 2], [2, 2], [0; 4], [1, 1]),
            (2, [2, 8, 5, 6], [3, 3], [1, 1], [1, 1, 1, 1], [1, 1]),
        ];
        let mut seed = 5;
        for &(threads, [n, c, h, w], kernel, stride, padding, dilation) in &cases {
            let win = Window2d {
                kernel,
                stride,
                padding,
                dilation,
            };
            let (oh, ow) = (extent(&win, 0, h), extent(&win, 1, w));
            let mut x: Vec<f32> = (0..n * c * h * w).map(|_| lcg(&mut seed)).collect();
            x[7] = f32::NAN;
            let xs = Shape::new(&[n, c, h, w], DType::F32);
            let os = Shape::new(&[n, c, oh, ow], DType::F32);
            let blocked_x = to_blocked(&x, c, h * w);
            for (max, include) in [(true, false), (false, false), (false, true)] {
                let mut want = vec![0.0; n * c * oh * ow];
                plain_pool(&win, max, include, src(&x, &xs), dst(&mut want, &os));
                let mut got = vec![f32::NAN; want.len()];
                with_test_ctx(threads, |ctx| {
                    pool(
                        &win,
                        max,
                        include,
                        src(&blocked_x, &xs),
                        dst(&mut got, &os),
                        ctx,
                    )
                    .unwrap()
                });
                let got = from_blocked(&got, c, oh * ow);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g.is_nan() && w.is_nan()) || (g - w).abs() <= 1e-6 * (1.0 + w.abs()),
                        "{win:?} max {max} include {include}: output {i}: {g} vs {w}"
                    );
                }
            }
        }
    }

    #[test]
    fn plane_sums_match_a_plain_sum() {
        let mut seed = 9;
        for &(threads, [n, c, h, w]) in &[
            (2, [2, 48, 7, 7]),
            (3, [1, 16, 5, 3]),
            (1, [3, 32, 1, 9]),
            (2, [2, 40, 6, 5]),
            (1, [1, 24, 3, 3]),
            (2, [2, 8, 4, 4]),
        ] {
            let x: Vec<f32> = (0..n * c * h * w).map(|_| lcg(&mut seed)).collect();
            let xs = Shape::new(&[n, c, h, w], DType::F32);
            let os = Shape::new(&[n, c, 1, 1], DType::F32);
            let blocked_x = to_blocked(&x, c, h * w);
            for mean in [false, true] {
                let mut got = vec![f32::NAN; n * c];
                with_test_ctx(threads, |ctx| {
                    plane_sums(mean, src(&blocked_x, &xs), dst(&mut got, &os), ctx).unwrap()
                });
                for (plane, &g) in got.iter().enumerate() {
                    let sum: f64 = x[plane * h * w..(plane + 1) * h * w]
                        .iter()
                        .map(|&v| f64::from(v))
                        .sum();
                    let want = if mean { sum / (h * w) as f64 } else { sum };
                    assert!(
                        (f64::from(g) - want).abs() <= 1e-5 * (1.0 + want.abs()),
                        "mean {mean}: plane {plane}: {g} vs {want}"
                    );
                }
            }
        }
    }
}
