//! The CPU kernels, one file per op family (reference loops for every dtype, fast
//! `f32` paths beside them), and the table (`table`) that resolves each plan step to
//! one of them at compile time.

mod attention;
pub(crate) mod attention_f32;
pub(crate) mod blocked_conv_f32;
mod blocked_f32;
mod blocked_rows;
mod channels_last;
mod conv;
pub(crate) mod conv_f32;
pub(crate) mod conv_pixels_f32;
pub(crate) mod depthwise_f32;
pub(crate) mod depthwise_lanes_f32;
mod elementwise;
mod fused;
mod layout;
mod matmul;
mod misc;
mod norm;
mod norm_f32;
mod quant;
mod reduce;
mod resample;
mod state;
mod table;
mod transpose;
pub(crate) mod winograd_f32;

use crate::gemm::GemmScratch;
use crate::layout::StepLayout;
use crate::pool::ThreadPool;
use rlx_ir::{DType, Op, Result, Shape};

pub(crate) use reduce::ReduceGeometry;
pub(crate) use table::{Args, Kernel, accepts, kernel_shapes, select};

/// Bytes from which [`copy_bytes`] splits a copy between threads.
pub(crate) const PARALLEL_COPY_BYTES: usize = 1 << 20;

/// Copies `bytes` bytes from `src` to `dst` (a no-op when they are the same bytes);
/// large copies that do not overlap are split between the pool's threads.
///
/// # Safety
/// Both ranges must be valid for `bytes` bytes.
pub(crate) unsafe fn copy_bytes(
    dst: *mut u8,
    src: *const u8,
    bytes: usize,
    ctx: &Ctx,
) -> Result<()> {
    if std::ptr::eq(dst.cast_const(), src) || bytes == 0 {
        return Ok(());
    }
    let (d, s) = (dst as usize, src as usize);
    let overlap = d < s + bytes && s < d + bytes;
    let threads = ctx.gemm.threads();
    if overlap || bytes < PARALLEL_COPY_BYTES || threads < 2 {
        // SAFETY: the caller's ranges; `copy` allows overlap.
        unsafe { std::ptr::copy(src, dst, bytes) };
        return Ok(());
    }
    let tasks = 4 * threads;
    let piece = bytes.div_ceil(tasks).next_multiple_of(64);
    ctx.pool.run(tasks, threads, &|t, _| {
        let start = (t * piece).min(bytes);
        let len = piece.min(bytes - start);
        // SAFETY: disjoint pieces of the caller's non-overlapping ranges.
        unsafe {
            std::ptr::copy_nonoverlapping((s + start) as *const u8, (d + start) as *mut u8, len)
        };
    })
}

/// `f64` scratch values a step needs (attention: one row of scores, or its keys
/// packed).
pub(crate) fn scratch_len(op: &Op, inputs: &[Shape], layout: StepLayout) -> usize {
    if let Some(kind) = blocked_conv(op, inputs, layout) {
        return blocked_conv_f32::scratch_f64(kind, &inputs[1]);
    }
    match op {
        // A row of scores (the reference kernel), or the keys packed (`f32`).
        Op::Attention { seq_major, .. } => {
            inputs[1]
                .dim(if *seq_major { 1 } else { 2 })
                .max(attention_f32::packed_keys_f64(
                    &inputs[0], &inputs[1], *seq_major,
                ))
        }
        Op::Conv2d { window, .. } | Op::FusedConv2d { window, .. }
            if inputs[0].dtype() == DType::F32 =>
        {
            conv_f32::scratch_f64(window, &inputs[0], &inputs[1])
                + prologue_scratch(op, &inputs[0], &inputs[1])
        }
        Op::FusedConv2d { .. } => prologue_scratch(op, &inputs[0], &inputs[1]),
        Op::NormScaleGrad { .. } => {
            norm_f32::SCALE_GRAD_PARTS * inputs[0].dims().last().copied().unwrap_or(1)
        }
        _ => 0,
    }
}

/// `f64` scratch a fused convolution needs for a copy of its input with the prologue
/// applied (none when it has no prologue, or applies it while packing).
fn prologue_scratch(op: &Op, x: &Shape, w: &Shape) -> usize {
    match op {
        Op::FusedConv2d { window, fusion, .. }
            if fusion.has_prologue()
                && !conv_f32::prologue_while_packing(window, (x, w), fusion.input_activation) =>
        {
            (x.num_elements() * x.dtype().size_in_bytes()).div_ceil(8)
        }
        _ => 0,
    }
}

/// Per-thread `f32` scratch a step needs beyond the GEMM buffers.
pub(crate) fn thread_scratch_floats(op: &Op, inputs: &[Shape], layout: StepLayout) -> usize {
    if let (Some(kind), Op::Conv2d { window, .. } | Op::FusedConv2d { window, .. }) =
        (blocked_conv(op, inputs, layout), op)
    {
        let prologue = matches!(op, Op::FusedConv2d { fusion, .. } if fusion.has_prologue());
        return blocked_conv_f32::thread_floats(kind, window, [&inputs[0], &inputs[1]], prologue);
    }
    match op {
        Op::Attention { .. } | Op::CachedAttention { .. } if inputs[0].dtype() == DType::F32 => {
            attention_f32::scratch_floats(inputs[2].dim(3))
        }
        Op::Elementwise { steps } => fused::region_scratch_floats(inputs.len() + steps.len()),
        Op::Binary(b) if table::fast_binary(*b, inputs[0].dtype(), &inputs[0]) => {
            fused::region_scratch_floats(3)
        }
        Op::Unary(u) if inputs[0].dtype() == DType::F32 && rlx_ir::fusable_unary(*u) => {
            fused::region_scratch_floats(2)
        }
        // Each thread's phase planes, packed panels and block product.
        Op::Conv2d { window, .. } | Op::FusedConv2d { window, .. }
            if inputs[0].dtype() == DType::F32 =>
        {
            conv_f32::thread_floats(window, &inputs[0], &inputs[1])
        }
        Op::MaxPool2d { .. } | Op::AvgPool2d { .. } if inputs[0].dtype() == DType::F32 => {
            conv::pool_floats(&inputs[0])
        }
        _ => 0,
    }
}

/// The blocked kernel of a convolution step with `layout`, if it runs the step (with
/// nothing blocked, a pointwise convolution over few pixels takes one too).
pub(crate) fn blocked_conv(
    op: &Op,
    inputs: &[Shape],
    layout: StepLayout,
) -> Option<blocked_conv_f32::BlockedConv> {
    match op {
        Op::Conv2d { window, groups } | Op::FusedConv2d { window, groups, .. }
            if table::blocked_conv_runs(op, inputs, layout) =>
        {
            blocked_conv_f32::kind(window, *groups, &inputs[0], &inputs[1], layout)
        }
        _ => None,
    }
}

/// Runs `f` with a context of `threads` threads and no scratch, as a kernel's
/// tests call it.
#[cfg(test)]
pub(crate) fn with_test_ctx(threads: usize, f: impl FnOnce(&Ctx)) {
    let pool = Box::leak(Box::new(ThreadPool::new(threads)));
    let gemm = GemmScratch::new(threads, 0);
    let mut scratch = [];
    let ctx = Ctx {
        scratch: &mut scratch,
        gemm: &gemm,
        pool,
        packed_b: None,
        bf16_products: false,
    };
    f(&ctx);
}

/// What kernels share during one run: scratch memory and the threads.
pub(crate) struct Ctx<'a> {
    /// `f64` scratch (`scratch_len` values at least).
    pub scratch: &'a mut [f64],
    /// Per-thread GEMM packing buffers.
    pub gemm: &'a GemmScratch,
    /// The pool kernels split work over.
    pub pool: &'static ThreadPool,
    /// This step's right operand packed ahead, if it has one.
    pub packed_b: Option<&'a crate::prepack::PackedParam>,
    /// Products may round their operands to bfloat16 on AMX tiles.
    pub bf16_products: bool,
}
