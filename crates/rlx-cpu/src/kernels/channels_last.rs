//! Permutes between a channel-blocked `f32` value ([`crate::layout`]) and the
//! plain channels-last one: `[n, c, h, w]` blocked to `[n, h, w, c]` plain
//! (`perm = [0, 2, 3, 1]`), and back (`[0, 3, 1, 2]`).
//!
//! Models that run their norms and products over channels-last values (a ConvNeXt
//! block: a depthwise convolution, then a permute, a layer norm and two products
//! over the channels, then a permute back) move their values between the two
//! forms twice a block. Blocked, a pixel's channels are already together, 16 to a
//! vector: each pixel's row of the channels-last value is its blocks' vectors one
//! after another, so the permute copies whole vectors, and the convolutions on
//! either side run their blocked kernels.

use super::Ctx;
use crate::layout::Blocks;
use crate::tensor::{Dst, Src};
use rlx_ir::{DType, Error, Result, Shape};

/// The permute that makes a channels-last value of a channels-first one.
const TO_CHANNELS_LAST: [usize; 4] = [0, 2, 3, 1];
/// The permute that makes a channels-first value of a channels-last one.
const TO_CHANNELS_FIRST: [usize; 4] = [0, 3, 1, 2];

/// Whether [`run`] permutes `x` by `perm` with these layouts: blocked `[n, c, h, w]`
/// to plain channels-last, or plain channels-last to blocked `[n, c, h, w]`, of
/// `f32` values.
pub(crate) fn accepts(perm: &[usize], x: &Shape, blocked_in: bool, blocked_out: bool) -> bool {
    x.dtype() == DType::F32
        && x.rank() == 4
        && match (blocked_in, blocked_out) {
            (true, false) => perm == TO_CHANNELS_LAST,
            (false, true) => perm == TO_CHANNELS_FIRST,
            _ => false,
        }
}

/// Permutes `x` into `out` as [`accepts`] says: from blocked `x` into plain
/// channels-last `out` when `blocked_in`, else from plain channels-last `x` into
/// blocked `out`.
pub(crate) fn run(x: Src, out: Dst, blocked_in: bool, ctx: &Ctx) -> Result<()> {
    let first = if blocked_in { x.shape } else { out.shape };
    let last = if blocked_in { out.shape } else { x.shape };
    let [n, c, h, w] = [first.dim(0), first.dim(1), first.dim(2), first.dim(3)];
    if last.dims() != [n, h, w, c] {
        return Err(Error::runtime(
            "permute",
            format!(
                "a channels-last permute between {:?} and {:?}",
                first.dims(),
                last.dims()
            ),
        ));
    }
    let pixels = h * w;
    let rows = n * pixels;
    if rows == 0 || c == 0 {
        return Ok(());
    }
    let blocks = Blocks::new(c, pixels);
    let threads = ctx.gemm.threads();
    // Tasks of whole rows, enough to share the copies out evenly.
    let tasks = rows.min(8 * threads);
    let (x_addr, out_addr) = (x.ptr as usize, out.ptr as usize);
    let task = |t: usize, _thread: usize| {
        for row in t * rows / tasks..(t + 1) * rows / tasks {
            let (image, p) = (row / pixels, row % pixels);
            let image_at = image * c * pixels;
            for k in 0..blocks.count() {
                let lanes = blocks.width(k);
                let blocked_at = image_at + blocks.index(k * crate::layout::BLOCK, p);
                let last_at = row * c + k * crate::layout::BLOCK;
                let (from, to) = if blocked_in {
                    (blocked_at, last_at)
                } else {
                    (last_at, blocked_at)
                };
                // SAFETY: both ranges are `lanes` values of pixel `p`'s channels
                // of block `k` in the image (`Blocks` places each inside a value
                // of `n * c * h * w`), and only this task writes its rows' values.
                unsafe {
                    copy_lanes(
                        (x_addr as *const f32).add(from),
                        (out_addr as *mut f32).add(to),
                        lanes,
                    )
                };
            }
        }
    };
    ctx.pool.run(tasks, threads, &task)
}

/// Copies `lanes` values from `from` to `to`: a whole block or a half one as one
/// fixed-size move (a call to `memcpy` per block took twice as long).
///
/// # Safety
/// `lanes` values are readable at `from` and writable at `to`, apart.
#[inline(always)]
unsafe fn copy_lanes(from: *const f32, to: *mut f32, lanes: usize) {
    use crate::layout::{BLOCK, HALF};
    // SAFETY: the caller's contract.
    unsafe {
        match lanes {
            BLOCK => to
                .cast::<[f32; BLOCK]>()
                .write_unaligned(from.cast::<[f32; BLOCK]>().read_unaligned()),
            HALF => to
                .cast::<[f32; HALF]>()
                .write_unaligned(from.cast::<[f32; HALF]>().read_unaligned()),
            _ => std::ptr::copy_nonoverlapping(from, to, lanes),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::kernels::with_test_ctx;
    use crate::layout::{from_blocked, to_blocked};

    /// `[n, c, h, w]` values permuted to `[n, h, w, c]`, plainly.
    fn channels_last(x: &[f32], [n, c, h, w]: [usize; 4]) -> Vec<f32> {
        let mut out = vec![0.0; x.len()];
        for i in 0..n {
            for ch in 0..c {
                for p in 0..h * w {
                    out[(i * h * w + p) * c + ch] = x[(i * c + ch) * h * w + p];
                }
            }
        }
        out
    }

    #[test]
    fn permutes_between_blocked_and_channels_last_values() {
        // Whole blocks, a last block of 8, one image and several, odd planes.
        for [n, c, h, w] in [[1, 32, 5, 7], [2, 40, 3, 4], [3, 8, 2, 3], [1, 96, 9, 9]] {
            let len = n * c * h * w;
            let x: Vec<f32> = (0..len).map(|i| (i as f32 * 0.37).sin()).collect();
            let want = channels_last(&x, [n, c, h, w]);
            // Blocked per image, as a program stores each of its images.
            let blocked: Vec<f32> = x
                .chunks(c * h * w)
                .flat_map(|image| to_blocked(image, c, h * w))
                .collect();
            let first = Shape::new(&[n, c, h, w], DType::F32);
            let last = Shape::new(&[n, h, w, c], DType::F32);
            for threads in [1, 2, 3] {
                with_test_ctx(threads, |ctx| {
                    let mut got = vec![f32::NAN; len];
                    let src = Src {
                        ptr: blocked.as_ptr().cast(),
                        shape: &first,
                        len,
                    };
                    let dst = Dst {
                        ptr: got.as_mut_ptr().cast(),
                        shape: &last,
                        len,
                    };
                    run(src, dst, true, ctx).unwrap();
                    assert_eq!(
                        got, want,
                        "{n}x{c}x{h}x{w} to channels-last, {threads} threads"
                    );

                    let mut back = vec![f32::NAN; len];
                    let src = Src {
                        ptr: want.as_ptr().cast(),
                        shape: &last,
                        len,
                    };
                    let dst = Dst {
                        ptr: back.as_mut_ptr().cast(),
                        shape: &first,
                        len,
                    };
                    run(src, dst, false, ctx).unwrap();
                    let plain: Vec<f32> = back
                        .chunks(c * h * w)
                        .flat_map(|image| from_blocked(image, c, h * w))
                        .collect();
                    assert_eq!(plain, x, "{n}x{c}x{h}x{w} back, {threads} threads");
                });
            }
        }
    }

    #[test]
    fn only_the_channels_last_permutes_of_f32_values_are_taken() {
        let x = Shape::new(&[1, 16, 4, 4], DType::F32);
        assert!(accepts(&TO_CHANNELS_LAST, &x, true, false));
        assert!(accepts(&TO_CHANNELS_FIRST, &x, false, true));
        assert!(!accepts(&TO_CHANNELS_LAST, &x, false, true));
        assert!(!accepts(&TO_CHANNELS_FIRST, &x, true, false));
        assert!(!accepts(&TO_CHANNELS_LAST, &x, true, true));
        assert!(!accepts(&[0, 1, 3, 2], &x, true, false));
        let half = Shape::new(&[1, 16, 4, 4], DType::F16);
        assert!(!accepts(&TO_CHANNELS_LAST, &half, true, false));
        let rank3 = Shape::new(&[16, 4, 4], DType::F32);
        assert!(!accepts(&[1, 2, 0], &rank3, true, false));
        assert!(!accepts(&[2, 0, 1], &rank3, false, true));
    }

    #[test]
    fn a_mismatched_output_is_an_error() {
        with_test_ctx(1, |ctx| {
            let x = vec![0.0f32; 64];
            let mut out = vec![0.0f32; 64];
            let first = Shape::new(&[1, 16, 2, 2], DType::F32);
            let wrong = Shape::new(&[1, 2, 16, 2], DType::F32);
            let src = Src {
                ptr: x.as_ptr().cast(),
                shape: &first,
                len: 64,
            };
            let dst = Dst {
                ptr: out.as_mut_ptr().cast(),
                shape: &wrong,
                len: 64,
            };
            assert!(run(src, dst, true, ctx).is_err());
        });
    }
}
