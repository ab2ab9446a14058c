//! Reference kernels, one file per op family, and the dispatch from a plan step to
//! its kernel. Straightforward loops: correctness first; a later pass makes them fast.

mod attention;
pub(crate) mod attention_f32;
mod conv;
pub(crate) mod conv_f32;
pub(crate) mod conv_pixels_f32;
mod elementwise;
mod fused;
mod layout;
mod matmul;
mod misc;
mod norm;
mod norm_f32;
mod quant;
mod reduce;
mod state;
mod transpose;
pub(crate) mod winograd_f32;

use crate::gemm::GemmScratch;
use crate::pool::ThreadPool;
use crate::tensor::{Dst, Src};
use rlx_ir::{
    BinaryOp, DType, EwStep, MAX_REGION_INPUTS, Op, ReduceOp, Result, Shape, fusable_binary,
};

pub(crate) use reduce::ReduceGeometry;

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

/// `f64` scratch values a step needs (attention keeps one row of scores).
pub(crate) fn scratch_len(op: &Op, inputs: &[Shape]) -> usize {
    match op {
        Op::Attention { seq_major, .. } => inputs[1].dim(if *seq_major { 1 } else { 2 }),
        Op::Conv2d { window, .. } | Op::FusedConv2d { window, .. }
            if inputs[0].dtype() == DType::F32 =>
        {
            conv_f32::scratch_f64(window, &inputs[0], &inputs[1]) + prologue_scratch(op, &inputs[0])
        }
        Op::FusedConv2d { .. } => prologue_scratch(op, &inputs[0]),
        Op::NormScaleGrad { .. } => {
            norm_f32::SCALE_GRAD_PARTS * inputs[0].dims().last().copied().unwrap_or(1)
        }
        _ => 0,
    }
}

/// `f64` scratch a fused convolution needs for a copy of its input with the prologue
/// applied (none when it has no prologue, or applies it while packing).
fn prologue_scratch(op: &Op, x: &Shape) -> usize {
    match op {
        Op::FusedConv2d { window, fusion, .. }
            if fusion.has_prologue()
                && !conv_f32::prologue_while_packing(window, x, fusion.input_activation) =>
        {
            (x.num_elements() * x.dtype().size_in_bytes()).div_ceil(8)
        }
        _ => 0,
    }
}

/// Name of the kernel that runs `op` producing `out`, as shown by `rlx inspect`
/// (`products_on_amx`: `f32` products with an `f32` `B` run on AMX tiles).
pub(crate) fn kernel_name(op: &Op, inputs: &[Shape], out: &Shape, products_on_amx: bool) -> String {
    let dtype = inputs.first().map_or(out.dtype(), |s| s.dtype());
    let gemm = if products_on_amx && inputs.get(1).is_some_and(|b| b.dtype() == DType::F32) {
        "amx-bf16"
    } else {
        crate::gemm::best_kernel().name
    };
    match op {
        Op::MatMul if dtype == DType::F32 => format!("cpu.gemm.{gemm}.matmul.f32"),
        Op::Attention { .. } if dtype == DType::F32 => "cpu.flash.attention.f32".into(),
        Op::Conv2d { window, groups } | Op::FusedConv2d { window, groups, .. }
            if dtype == DType::F32 =>
        {
            let w = &inputs[1];
            let method = if winograd_f32::applies(window, *groups, w.dim(1), w.dim(0) / groups) {
                "winograd"
            } else if conv_pixels_f32::applies(window, *groups, &inputs[0]) {
                "pixels"
            } else {
                "gemm"
            };
            let fused = if matches!(op, Op::FusedConv2d { .. }) {
                "+epilogue"
            } else {
                ""
            };
            format!(
                "cpu.{method}.{}.conv2d{fused}.f32",
                crate::gemm::best_kernel().name
            )
        }
        Op::CachedAttention { .. } => "cpu.flash.cached_attention.f32".into(),
        Op::Permute { perm }
            if transpose::as_batched_transpose(inputs[0].dims(), perm).is_some() =>
        {
            format!("cpu.tiles.transpose.{dtype}")
        }
        Op::MaxPool2d { .. } | Op::AvgPool2d { .. } | Op::TiledMaxPoolGrad { .. }
            if dtype == DType::F32 =>
        {
            format!("cpu.planes.{}.f32", op.name())
        }
        Op::QuantMatMul { format } => format!("cpu.quant.{format}.matmul"),
        Op::Dequantize { format } => format!("cpu.quant.{format}.dequantize"),
        Op::FusedMatMul { .. } if dtype == DType::F32 => {
            format!("cpu.gemm.{gemm}.matmul+epilogue.f32")
        }
        Op::Elementwise { steps } => format!("cpu.region{}.{}", steps.len(), out.dtype()),
        Op::Binary(b) if fast_binary(*b, &inputs[0], out) => {
            format!("cpu.region1.{}.f32", b.name())
        }
        Op::Unary(u) if fast_unary(*u, &inputs[0]) => {
            format!("cpu.region1.{}.f32", u.name())
        }
        Op::Reduce {
            op: ReduceOp::Sum | ReduceOp::Mean,
            axes,
            ..
        } if consecutive(axes).is_some() && dtype == DType::F32 => {
            format!("cpu.axis.{}.f32", op.name())
        }
        _ if inputs.first().is_some_and(|x| fast_rows(op, x)) => {
            format!("cpu.rows.{}.f32", op.name())
        }
        _ => format!("cpu.ref.{}.{}", op.name(), dtype),
    }
}

/// The first and last of `axes` when they are consecutive (sorted, as reductions
/// keep them) and not empty.
fn consecutive(axes: &[usize]) -> Option<(usize, usize)> {
    let (&first, &last) = (axes.first()?, axes.last()?);
    (last - first + 1 == axes.len()).then_some((first, last))
}

/// Whether a row-wise op (norms, last-axis softmax) on `x` has an `f32` fast kernel.
fn fast_rows(op: &Op, x: &Shape) -> bool {
    x.dtype() == DType::F32
        && match op {
            Op::LayerNorm { .. }
            | Op::RmsNorm { .. }
            | Op::NormGrad { .. }
            | Op::NormScaleGrad { .. } => true,
            Op::Softmax { axis } | Op::LogSoftmax { axis } => *axis + 1 == x.rank(),
            _ => false,
        }
}

/// Whether a binary op runs on the vectorized region kernel: `f32` arithmetic.
fn fast_binary(op: BinaryOp, a: &Shape, out: &Shape) -> bool {
    a.dtype() == DType::F32 && out.dtype() == DType::F32 && fusable_binary(op)
}

/// A lone `f32` unary op runs as a one-step region (vectorized, threaded).
fn fast_unary(op: rlx_ir::UnaryOp, x: &Shape) -> bool {
    x.dtype() == DType::F32 && rlx_ir::fusable_unary(op)
}

/// Per-thread `f32` scratch a step needs beyond the GEMM buffers.
pub(crate) fn thread_scratch_floats(op: &Op, inputs: &[Shape]) -> usize {
    match op {
        Op::Attention { .. } | Op::CachedAttention { .. } if inputs[0].dtype() == DType::F32 => {
            attention_f32::scratch_floats(inputs[2].dim(3))
        }
        Op::Elementwise { steps } => fused::region_scratch_floats(inputs.len() + steps.len()),
        Op::Binary(b) if fast_binary(*b, &inputs[0], &inputs[0]) => fused::region_scratch_floats(3),
        Op::Unary(u) if fast_unary(*u, &inputs[0]) => fused::region_scratch_floats(2),
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

/// Runs one step. `src(k)` gives operand `k`; `n_inputs` is how many there are.
pub(crate) fn run<'a>(
    op: &Op,
    n_inputs: usize,
    src: &dyn Fn(usize) -> Src<'a>,
    out: Dst<'a>,
    geometry: Option<&ReduceGeometry>,
    ctx: &mut Ctx,
) -> Result<()> {
    let opt = |k: usize| (k < n_inputs).then(|| src(k));
    match op {
        Op::Unary(u) if fast_unary(*u, src(0).shape) => {
            fused::elementwise(&[EwStep::Unary(*u, 0)], &[src(0)], out, ctx)?
        }
        Op::Unary(u) => elementwise::unary(*u, src(0), out),
        Op::Binary(b) if fast_binary(*b, src(0).shape, out.shape) => {
            // One arithmetic op on f32: the region kernel, with a one-step program.
            fused::elementwise(&[EwStep::Binary(*b, 0, 1)], &[src(0), src(1)], out, ctx)?
        }
        Op::Binary(b) => elementwise::binary(*b, src(0), src(1), out),
        Op::Where => elementwise::select(src(0), src(1), src(2), out, ctx)?,
        Op::Cast(_) => elementwise::cast(src(0), out),
        Op::Reduce {
            op: op @ (ReduceOp::Sum | ReduceOp::Mean),
            axes,
            ..
        } if src(0).shape.dtype() == DType::F32
            && let Some(span) = consecutive(axes) =>
        {
            norm_f32::sum_axes(*op == ReduceOp::Mean, src(0), span, out, ctx)?
        }
        Op::Reduce { op, .. } => {
            let fallback;
            let geo = match geometry {
                Some(g) => g,
                None => {
                    fallback = ReduceGeometry::new(src(0).shape.dims(), &[]);
                    &fallback
                }
            };
            reduce::reduce(*op, geo, src(0), out)
        }
        Op::ArgReduce { op, axis, .. } => reduce::arg_reduce(*op, *axis, src(0), out),
        Op::Softmax { axis } | Op::LogSoftmax { axis }
            if fast_rows(op, src(0).shape) && *axis + 1 == src(0).shape.rank() =>
        {
            norm_f32::softmax_last(matches!(op, Op::LogSoftmax { .. }), src(0), out, ctx)?
        }
        Op::Softmax { axis } => norm::softmax(*axis, false, src(0), out),
        Op::LogSoftmax { axis } => norm::softmax(*axis, true, src(0), out),
        Op::LayerNorm { eps } if fast_rows(op, src(0).shape) => {
            norm_f32::norm(src(0), src(1), Some(src(2)), eps.get(), out, ctx)?
        }
        Op::RmsNorm { eps } if fast_rows(op, src(0).shape) => {
            norm_f32::norm(src(0), src(1), None, eps.get(), out, ctx)?
        }
        Op::MatMul => matmul::matmul(src(0), src(1), out, ctx)?,
        Op::NormGrad { eps, centered } if fast_rows(op, src(0).shape) => {
            norm_f32::norm_grad(src(0), src(1), src(2), (eps.get(), *centered), out, ctx)?
        }
        Op::NormScaleGrad { eps, centered } if fast_rows(op, src(0).shape) => {
            norm_f32::norm_scale_grad(src(0), src(1), (eps.get(), *centered), out, ctx)?
        }
        Op::NormGrad { eps, centered } => {
            norm::norm_grad(src(0), Some(src(1)), src(2), eps.get(), *centered, out)
        }
        Op::NormScaleGrad { eps, centered } => {
            norm::norm_grad(src(0), None, src(1), eps.get(), *centered, out)
        }
        Op::LayerNorm { eps } => norm::norm(src(0), src(1), Some(src(2)), eps.get(), out),
        Op::RmsNorm { eps } => norm::norm(src(0), src(1), None, eps.get(), out),
        // The planner makes every reshape a view; run as a copy if one ever is not.
        Op::Reshape { .. } => layout::copy_flat(src(0), out),
        Op::Permute { perm } => match transpose::as_batched_transpose(src(0).shape.dims(), perm) {
            Some(geometry) => transpose::batched_transpose(geometry, src(0), out, ctx)?,
            None => layout::permute(perm, src(0), out, ctx)?,
        },
        Op::Slice { axes } => layout::slice(axes, src(0), out),
        Op::Concat { axis } => {
            let mut start = 0;
            for k in 0..n_inputs {
                let x = src(k);
                layout::concat_one(*axis, x, start, out);
                start += x.shape.dim(*axis);
            }
        }
        Op::Gather { axis } => layout::gather(*axis, src(0), src(1), out)?,
        Op::Expand { .. } => layout::expand(src(0), out),
        Op::Pad { pads, mode } => layout::pad(pads, *mode, src(0), out),
        Op::Tile { .. } => layout::tile(src(0), out),
        Op::Range { start, step, .. } => misc::range(start.get(), step.get(), out),
        Op::RandomUniform { seed, .. } => misc::random_uniform(*seed, src(0), out, ctx)?,
        Op::Cumsum {
            axis,
            exclusive,
            reverse,
        } => misc::cumsum(*axis, *exclusive, *reverse, src(0), out),
        Op::TopK {
            k,
            axis,
            largest,
            output,
        } => misc::topk(*k, *axis, *largest, *output, src(0), out),
        Op::OneHot { depth, .. } => misc::one_hot(*depth, src(0), out),
        Op::Conv2d { window, groups } if src(0).shape.dtype() == DType::F32 => {
            let epilogue = conv::ConvEpilogue::default();
            conv_f32::conv2d(
                window,
                *groups,
                [src(0), src(1)],
                opt(2),
                epilogue,
                out,
                ctx,
            )?
        }
        Op::FusedConv2d {
            window,
            groups,
            fusion: f,
        } => {
            let pair = |at: usize| (src(at), src(at + 1));
            let mut epilogue = conv::ConvEpilogue {
                activation: f.activation,
                residual: f.residual.then(|| src(f.residual_at())),
                channel_affine: f.channel_affine.then(|| pair(f.scale_at())),
                post_activation: f.post_activation,
                input_affine: f.input_affine.then(|| pair(f.input_scale_at())),
                input_activation: f.input_activation,
            };
            let bias = f.bias.then(|| src(2));
            let mut x = src(0);
            // The convolution's own scratch first, then room for the changed input.
            let own_scratch = if x.shape.dtype() == DType::F32 {
                conv_f32::scratch_f64(window, x.shape, src(1).shape)
            } else {
                0
            };
            let (scratch, copy) = ctx.scratch.split_at_mut(own_scratch);
            let mut inner = Ctx {
                scratch,
                gemm: ctx.gemm,
                pool: ctx.pool,
                packed_b: ctx.packed_b,
                bf16_products: ctx.bf16_products,
            };
            if f.has_prologue()
                && !conv_f32::prologue_while_packing(window, x.shape, f.input_activation)
            {
                // Anything but the f32 1x1 convolution (which applies it while packing
                // its input): the changed input into scratch first.
                // SAFETY: `prologue_scratch` asked for room for all of `x`.
                let bytes = unsafe {
                    std::slice::from_raw_parts_mut(copy.as_mut_ptr().cast::<u8>(), copy.len() * 8)
                };
                conv::apply_prologue(&epilogue, x, bytes);
                x = Src {
                    ptr: bytes.as_ptr(),
                    shape: x.shape,
                    len: x.len,
                };
                epilogue.input_affine = None;
                epilogue.input_activation = None;
            }
            if x.shape.dtype() == DType::F32 {
                conv_f32::conv2d(
                    window,
                    *groups,
                    [x, src(1)],
                    bias,
                    epilogue,
                    out,
                    &mut inner,
                )?
            } else {
                conv::conv2d(window, *groups, x, src(1), bias, out);
                conv::apply_epilogue(epilogue, out);
            }
        }
        Op::Conv2d { window, groups } => conv::conv2d(window, *groups, src(0), src(1), opt(2), out),
        Op::MaxPool2d { window } if src(0).shape.dtype() == DType::F32 => {
            return conv::pool_f32(window, true, false, src(0), out, ctx);
        }
        Op::AvgPool2d {
            window,
            count_include_pad,
        } if src(0).shape.dtype() == DType::F32 => {
            return conv::pool_f32(window, false, *count_include_pad, src(0), out, ctx);
        }
        Op::MaxPool2d { window } => conv::pool(window, true, false, src(0), out),
        Op::TiledMaxPoolGrad { kernel } if src(0).shape.dtype() == DType::F32 => {
            return conv::tiled_max_pool_grad_f32(*kernel, (src(0), src(1), src(2)), out, ctx);
        }
        Op::TiledMaxPoolGrad { kernel } => {
            conv::tiled_max_pool_grad(*kernel, (src(0), src(1), src(2)), out)
        }
        Op::AvgPool2d {
            window,
            count_include_pad,
        } => conv::pool(window, false, *count_include_pad, src(0), out),
        Op::Attention {
            scale,
            causal,
            seq_major,
        } if src(0).shape.dtype() == DType::F32 => attention_f32::attention(
            scale.get(),
            *causal,
            *seq_major,
            src(0),
            src(1),
            src(2),
            opt(3),
            None,
            out,
            ctx,
        )?,
        Op::Attention {
            scale,
            causal,
            seq_major,
        } => attention::attention(
            scale.get(),
            *causal,
            *seq_major,
            src(0),
            src(1),
            src(2),
            opt(3),
            out,
            ctx.scratch,
        ),
        Op::Rope { style } => attention::rope(*style, src(0), src(1), src(2), out),
        Op::WriteAt { axis } => state::write_at(*axis, src(1), src(2), out, ctx)?,
        Op::FusedMatMul {
            alpha,
            transpose_a,
            transpose_b,
            bias,
            activation,
            residual,
        } => {
            let bias_src = bias.then(|| src(2));
            let residual_src = residual.then(|| src(n_inputs - 1));
            fused::fused_matmul(
                alpha.get(),
                *activation,
                (src(0), *transpose_a),
                (src(1), *transpose_b),
                bias_src,
                residual_src,
                out,
                ctx,
            )?
        }
        Op::Elementwise { steps } => {
            let mut inputs = [src(0); MAX_REGION_INPUTS];
            for (k, slot) in inputs.iter_mut().enumerate().take(n_inputs).skip(1) {
                *slot = src(k);
            }
            fused::elementwise(steps, &inputs[..n_inputs], out, ctx)?
        }
        Op::QuantMatMul { format } => quant::quant_matmul(*format, src(0), src(1), out, ctx)?,
        Op::Dequantize { format } => quant::dequantize(*format, src(0), out)?,
        Op::CachedAttention { scale } => attention_f32::cached_attention(
            scale.get(),
            [src(0), src(1), src(2)],
            src(3),
            out,
            ctx,
        )?,
        Op::Input { .. } | Op::Param { .. } | Op::Constant { .. } => {}
    }
    Ok(())
}
