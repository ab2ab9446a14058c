//! `f32` depthwise convolutions over small planes with sixteen channels in the lanes
//! of each vector (AVX-512).
//!
//! The plane-at-a-time kernel ([`super::depthwise_f32`]) vectorizes along each output
//! row: a 7 x 7 plane fills 7 of 16 lanes, and every plane pays its own staging,
//! offsets and epilogue call for a few hundred products (MobileNet's 960 planes of
//! 7 x 7 took three times ONNX Runtime's blocked-layout kernel). Here sixteen planes
//! at a time are transposed into one padded `[row][column][16]` block, sixteen
//! values at a time through registers; each output pixel is then one vector of
//! sixteen channels, summed over the taps with one load and one multiply-add per
//! tap, eight pixels at a time in registers; the sums are transposed back into the
//! planes. The taps are summed in the same order with the same multiply-adds as the
//! plane kernel, so the values are the same.

use super::conv::extent;
use super::conv_pixels_f32::Finish;
use crate::gemm::Activation;
use crate::pool::ThreadPool;
use crate::tensor::{Dst, Src};
use rlx_ir::{Result, Shape, Window2d};

/// Channels per block: one vector's lanes.
const LANES: usize = 16;

/// The largest output plane this kernel takes. The two transposes cost about a
/// quarter of a shuffle per value each way, on one port: on 14 x 14 planes with a
/// 3x3 window they took longer than the plane kernel's products (384 planes 0.044
/// -> 0.053 ms), on 7 x 7 planes the plane kernel's half-empty vectors and per-plane
/// costs lose (960 planes 0.066 -> 0.040 ms).
const MAX_OUTPUT_PIXELS: usize = 8 * 8;

/// The largest padded input plane staged (its block of sixteen takes 36 KiB): a
/// large input read by few outputs (a big stride or window) stays with the plane
/// kernel rather than transposing all of it.
const MAX_STAGED_PIXELS: usize = 24 * 24;

/// The most taps whose weight vectors are gathered once per block (on the stack).
const MAX_TAPS: usize = 64;

/// Output pixels whose sums are held in registers at once.
const PIXELS_AT_ONCE: usize = 8;

/// Whether this kernel takes a depthwise convolution of `x` with output planes
/// `oh x ow`: AVX-512, small planes in and out, and a window whose weights fit.
pub(crate) fn applies(win: &Window2d, x: &Shape, [oh, ow]: [usize; 2]) -> bool {
    crate::isa::isa().avx512f
        && x.rank() == 4
        && oh * ow <= MAX_OUTPUT_PIXELS
        && win.kernel[0] * win.kernel[1] <= MAX_TAPS
        && {
            let block = Block::new(win, x, ow);
            block.hp * block.wp <= MAX_STAGED_PIXELS
        }
}

/// The padded block: `hp` rows of `wp` pixels, sixteen channels each.
#[derive(Clone, Copy)]
struct Block {
    hp: usize,
    wp: usize,
}

impl Block {
    fn new(win: &Window2d, x: &Shape, ow: usize) -> Block {
        let [top, left, bottom, _] = win.padding;
        // Every column a tap reads: the last output's last tap.
        let span_w =
            (ow.max(1) - 1) * win.stride[1] + (win.kernel[1].max(1) - 1) * win.dilation[1] + 1;
        Block {
            hp: top + x.dim(2) + bottom,
            wp: span_w.max(left + x.dim(3)),
        }
    }

    fn len(&self) -> usize {
        self.hp * self.wp * LANES
    }
}

/// Per-thread floats the kernel needs: the padded input block and the output block.
pub(crate) fn thread_floats(win: &Window2d, x: &Shape) -> usize {
    let (oh, ow) = (extent(win, 0, x.dim(2)), extent(win, 1, x.dim(3)));
    Block::new(win, x, ow).len() + oh * ow * LANES
}

/// The depthwise convolution: pool tasks take runs of sixteen-channel blocks; each
/// block's planes get the finish once they are stored.
pub(crate) fn conv2d(
    win: &Window2d,
    [x, w]: [Src; 2],
    finish: Finish,
    out: Dst,
    (gemm, pool): (&crate::gemm::GemmScratch, &ThreadPool),
) -> Result<()> {
    let [n, c, h, wd] = [
        x.shape.dim(0),
        x.shape.dim(1),
        x.shape.dim(2),
        x.shape.dim(3),
    ];
    let [o, oh, ow] = [out.shape.dim(1), out.shape.dim(2), out.shape.dim(3)];
    let pixels = oh * ow;
    if n == 0 || o == 0 || pixels == 0 {
        return Ok(());
    }
    let multiplier = (o / c.max(1)).max(1);
    let taps = win.kernel[0] * win.kernel[1];
    let block = Block::new(win, x.shape, ow);
    // SAFETY: f32 tensors of their lengths; the plan never places the output over
    // an operand.
    let (xs, ws) = unsafe {
        (
            std::slice::from_raw_parts(x.ptr.cast::<f32>(), x.len),
            std::slice::from_raw_parts(w.ptr.cast::<f32>(), w.len),
        )
    };
    let out_addr = out.ptr as usize;
    let residual_addr = finish.residual.map(|r| r.ptr as usize);
    let groups = o.div_ceil(LANES);
    let units = n * groups;
    let threads = gemm.threads();
    let tasks = units.min(8 * threads);
    let geometry = Geometry {
        h,
        w: wd,
        oh,
        ow,
        block,
    };
    // Without a residual or channel affine, the bias and activation are applied to
    // the sums in registers (one vector per sixteen channels) instead of once per
    // plane afterwards.
    let in_registers = finish.residual.is_none()
        && finish.affine.is_none()
        && matches!(
            finish.activation,
            None | Some(
                Activation::Relu | Activation::Relu6 | Activation::HardSwish | Activation::Silu
            )
        );
    let per_channel = finish.per_channel();
    let one_block = |unit: usize, thread: usize| {
        let (image, first) = (unit / groups, unit % groups * LANES);
        let lanes = LANES.min(o - first);
        // Input plane of each lane (a channel multiplier maps several output
        // channels to one input channel).
        let sources: [&[f32]; LANES] = std::array::from_fn(|l| {
            let ic = (first + l.min(lanes - 1)) / multiplier;
            &xs[(image * c + ic) * h * wd..][..h * wd]
        });
        let mut weights = [[0.0f32; LANES]; MAX_TAPS];
        for (t, row) in weights.iter_mut().enumerate().take(taps) {
            for (l, v) in row.iter_mut().enumerate().take(lanes) {
                *v = ws[(first + l) * taps + t];
            }
        }
        // SAFETY: one task per thread index at a time.
        let scratch = unsafe { gemm.parts(thread) }.1;
        let (staged, rest) = scratch.split_at_mut(block.len());
        let sums = &mut rest[..pixels * LANES];
        let at = (image * o + first) * pixels;
        // SAFETY: output planes `first..first + lanes` of `image`; only this task
        // writes them.
        let planes = unsafe {
            std::slice::from_raw_parts_mut((out_addr as *mut f32).add(at), lanes * pixels)
        };
        let finish_sums = in_registers.then(|| SumsFinish {
            bias: std::array::from_fn(|l| match finish.bias {
                Some(b) if l < lanes => b[first + l],
                _ => 0.0,
            }),
            activation: finish.activation,
        });
        #[cfg(target_arch = "x86_64")]
        // SAFETY: AVX-512F was detected ([`applies`]); the buffers have the sizes
        // `thread_floats` gives for this window.
        unsafe {
            stage_avx512(&sources, lanes, win, geometry, staged);
            sums_avx512(staged, &weights[..taps], win, geometry, finish_sums, sums);
            unstage_avx512(sums, lanes, geometry, planes);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = (&sources, &weights, staged, sums, finish_sums);
        if in_registers {
            return;
        }
        for (l, values) in planes.chunks_exact_mut(pixels).enumerate() {
            let oc = first + l;
            // SAFETY: the residual has the output's shape.
            let residual = residual_addr.map(|a| unsafe {
                std::slice::from_raw_parts((a as *const f32).add(at + l * pixels), pixels)
            });
            per_channel.apply(oc, values, residual);
        }
    };
    let task = |t: usize, thread: usize| {
        for unit in t * units / tasks..(t + 1) * units / tasks {
            one_block(unit, thread);
        }
    };
    pool.run(tasks, threads, &task)
}

/// What [`sums_avx512`] applies to each vector of sums before storing it: the
/// channels' biases and an activation, as the epilogue's `row` computes them (a bias
/// of zero is not added, so a sum of -0 stays -0 before the activation).
#[derive(Clone, Copy)]
struct SumsFinish {
    bias: [f32; LANES],
    activation: Option<Activation>,
}

/// The planes' sizes and the padded block's.
#[derive(Clone, Copy)]
struct Geometry {
    h: usize,
    w: usize,
    oh: usize,
    ow: usize,
    block: Block,
}

/// Transposes sixteen vectors: lane `j` of output `i` is lane `i` of input `j`.
///
/// # Safety
/// AVX-512F must be available.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn transpose16(r: [std::arch::x86_64::__m512; 16]) -> [std::arch::x86_64::__m512; 16] {
    use std::arch::x86_64::*;
    // Within each 128-bit lane: pairs of rows interleaved by 32 bits, then pairs of
    // those by 64 bits, so register `4k + m` holds, in 128-bit lane `q`, column
    // `4q + m` of rows `4k..4k + 4`.
    let a: [__m512; 16] = std::array::from_fn(|i| {
        let (lo, hi) = (r[i / 2 * 2], r[i / 2 * 2 + 1]);
        if i % 2 == 0 {
            _mm512_unpacklo_ps(lo, hi)
        } else {
            _mm512_unpackhi_ps(lo, hi)
        }
    });
    let b: [__m512; 16] = std::array::from_fn(|i| {
        let (k, m) = (i / 4, i % 4);
        let (x, y) = (
            _mm512_castps_pd(a[4 * k + m / 2]),
            _mm512_castps_pd(a[4 * k + m / 2 + 2]),
        );
        _mm512_castpd_ps(if m % 2 == 0 {
            _mm512_unpacklo_pd(x, y)
        } else {
            _mm512_unpackhi_pd(x, y)
        })
    });
    // Then the 4 x 4 grid of 128-bit lanes: column `4q + m` gathers lane `q` of
    // registers `m, 4 + m, 8 + m, 12 + m`.
    let mut out = [_mm512_setzero_ps(); 16];
    for m in 0..4 {
        let e0 = _mm512_shuffle_f32x4::<0x44>(b[m], b[4 + m]);
        let e1 = _mm512_shuffle_f32x4::<0xEE>(b[m], b[4 + m]);
        let e2 = _mm512_shuffle_f32x4::<0x44>(b[8 + m], b[12 + m]);
        let e3 = _mm512_shuffle_f32x4::<0xEE>(b[8 + m], b[12 + m]);
        out[m] = _mm512_shuffle_f32x4::<0x88>(e0, e2);
        out[4 + m] = _mm512_shuffle_f32x4::<0xDD>(e0, e2);
        out[8 + m] = _mm512_shuffle_f32x4::<0x88>(e1, e3);
        out[12 + m] = _mm512_shuffle_f32x4::<0xDD>(e1, e3);
    }
    out
}

/// Fills the padded block from the lanes' input planes (zero in the padding and in
/// lanes past `lanes`), sixteen pixels of a row at a time through [`transpose16`].
///
/// # Safety
/// AVX-512F must be available; every source holds `h x w` values and `staged` the
/// block's floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn stage_avx512(
    sources: &[&[f32]; LANES],
    lanes: usize,
    win: &Window2d,
    g: Geometry,
    staged: &mut [f32],
) {
    use std::arch::x86_64::*;
    let [top, left, _, _] = win.padding;
    let Block { hp, wp } = g.block;
    let row_floats = wp * LANES;
    // The padding: whole rows above and below, columns left and right.
    staged[..top * row_floats].fill(0.0);
    staged[(top + g.h) * row_floats..hp * row_floats].fill(0.0);
    for y in 0..g.h {
        let row = &mut staged[(top + y) * row_floats..(top + y + 1) * row_floats];
        row[..left * LANES].fill(0.0);
        row[(left + g.w) * LANES..].fill(0.0);
        let mut x = 0;
        while x < g.w {
            let count = LANES.min(g.w - x);
            let mask = crate::vmath::first_lanes(count);
            let rows: [__m512; 16] = std::array::from_fn(|l| {
                if l < lanes {
                    // SAFETY: columns x..x+count of row y lie inside the plane.
                    unsafe { _mm512_maskz_loadu_ps(mask, sources[l].as_ptr().add(y * g.w + x)) }
                } else {
                    _mm512_setzero_ps()
                }
            });
            // SAFETY: AVX-512F is available.
            let pixels = unsafe { transpose16(rows) };
            for (j, &v) in pixels.iter().enumerate().take(count) {
                // SAFETY: pixel (y, left + x + j) lies inside the block's row.
                unsafe { _mm512_storeu_ps(row.as_mut_ptr().add((left + x + j) * LANES), v) };
            }
            x += LANES;
        }
    }
}

/// `sums[pixel] = Σ taps weights[t] * staged[pixel's tap t]`, sixteen channels per
/// vector, eight output pixels of a row at a time, the taps in row-major order (the
/// first one's product rounded alone, as a multiply-add into zero).
///
/// # Safety
/// AVX-512F must be available; `staged` holds the block, `sums` `oh x ow x 16`
/// floats.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn sums_avx512(
    staged: &[f32],
    weights: &[[f32; LANES]],
    win: &Window2d,
    g: Geometry,
    finish: Option<SumsFinish>,
    sums: &mut [f32],
) {
    use std::arch::x86_64::*;
    let (zero, six) = (_mm512_setzero_ps(), _mm512_set1_ps(6.0));
    // `min(6, max(0, x))` keeps a NaN (these return their second operand then), as
    // `clamp` does.
    let relu6 = |x: __m512| _mm512_min_ps(six, _mm512_max_ps(zero, x));
    let (bias, with_bias) = match finish {
        // SAFETY: 16 values.
        Some(f) => (unsafe { _mm512_loadu_ps(f.bias.as_ptr()) }, {
            let mut m = 0u16;
            for (l, &b) in f.bias.iter().enumerate() {
                m |= u16::from(b != 0.0) << l;
            }
            m
        }),
        None => (zero, 0),
    };
    let finished = |x: __m512| -> __m512 {
        let Some(f) = finish else { return x };
        let x = _mm512_mask_add_ps(x, with_bias, x, bias);
        match f.activation {
            None => x,
            Some(Activation::Relu) => _mm512_max_ps(zero, _mm512_add_ps(x, zero)),
            Some(Activation::Relu6) => relu6(x),
            Some(Activation::HardSwish) => _mm512_mul_ps(
                _mm512_mul_ps(x, relu6(_mm512_add_ps(x, _mm512_set1_ps(3.0)))),
                _mm512_set1_ps(1.0 / 6.0),
            ),
            // SAFETY: AVX-512F is available.
            Some(_) => unsafe { crate::vmath::logistic_lanes_avx512::<true>(x) },
        }
    };
    let ([sy, sx], [dy, dx]) = (win.stride, win.dilation);
    let kw = win.kernel[1];
    let wp = g.block.wp;
    let base = staged.as_ptr();
    for oy in 0..g.oh {
        let mut ox = 0;
        while ox < g.ow {
            let count = PIXELS_AT_ONCE.min(g.ow - ox);
            let mut acc = [_mm512_setzero_ps(); PIXELS_AT_ONCE];
            for (t, w) in weights.iter().enumerate() {
                // SAFETY: 16 weights per tap.
                let wv = unsafe { _mm512_loadu_ps(w.as_ptr()) };
                let (ky, kx) = (t / kw, t % kw);
                let first = (oy * sy + ky * dy) * wp + ox * sx + kx * dx;
                for (p, a) in acc.iter_mut().enumerate().take(count) {
                    // SAFETY: the tap's pixel lies inside the block (see `Block`).
                    let v = unsafe { _mm512_loadu_ps(base.add((first + p * sx) * LANES)) };
                    *a = _mm512_fmadd_ps(v, wv, *a);
                }
            }
            for (p, &a) in acc.iter().enumerate().take(count) {
                // SAFETY: output pixel (oy, ox + p) lies inside `sums`.
                unsafe {
                    _mm512_storeu_ps(
                        sums.as_mut_ptr().add((oy * g.ow + ox + p) * LANES),
                        finished(a),
                    )
                };
            }
            ox += count;
        }
    }
}

/// Writes the sums of the first `lanes` channels back into their planes, sixteen
/// pixels at a time through [`transpose16`].
///
/// # Safety
/// AVX-512F must be available; `sums` holds `oh x ow x 16` floats and `planes`
/// `lanes` planes of `oh x ow`.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f")]
unsafe fn unstage_avx512(sums: &[f32], lanes: usize, g: Geometry, planes: &mut [f32]) {
    use std::arch::x86_64::*;
    let pixels = g.oh * g.ow;
    let mut p = 0;
    while p < pixels {
        let count = LANES.min(pixels - p);
        let mask = crate::vmath::first_lanes(count);
        let columns: [__m512; 16] = std::array::from_fn(|j| {
            if j < count {
                // SAFETY: pixel p + j lies inside `sums`.
                unsafe { _mm512_loadu_ps(sums.as_ptr().add((p + j) * LANES)) }
            } else {
                _mm512_setzero_ps()
            }
        });
        // SAFETY: AVX-512F is available.
        let rows = unsafe { transpose16(columns) };
        for (l, &v) in rows.iter().enumerate().take(lanes) {
            // SAFETY: pixels p..p+count of plane l lie inside `planes`.
            unsafe { _mm512_mask_storeu_ps(planes.as_mut_ptr().add(l * pixels + p), mask, v) };
        }
        p += LANES;
    }
}

#[cfg(all(test, target_arch = "x86_64"))]
mod tests {
    use super::transpose16;

    #[test]
    fn sixteen_vectors_transpose() {
        if !crate::isa::isa().avx512f {
            return;
        }
        let m: Vec<f32> = (0..256).map(|i| i as f32).collect();
        // SAFETY: AVX-512F was detected; every load reads 16 values of `m`.
        let out = unsafe {
            use std::arch::x86_64::*;
            let rows: [__m512; 16] =
                std::array::from_fn(|i| _mm512_loadu_ps(m.as_ptr().add(16 * i)));
            transpose16(rows)
        };
        for (i, v) in out.iter().enumerate() {
            let mut lanes = [0.0f32; 16];
            // SAFETY: 16 floats.
            unsafe { std::arch::x86_64::_mm512_storeu_ps(lanes.as_mut_ptr(), *v) };
            for (j, &x) in lanes.iter().enumerate() {
                assert_eq!(x, m[16 * j + i], "output {i} lane {j}");
            }
        }
    }
}
