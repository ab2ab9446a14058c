//! The CPU's kernel table: [`select`] resolves a step (its op, operand shapes and
//! output) to one [`Kernel`] when a program is compiled, after one detection of the
//! CPU's features ([`crate::isa`]); running a step is a call through the resolved
//! function with no matching. Adding a kernel is one function here (or in its
//! family's file) and one arm of [`select`].

use super::{
    Ctx, ReduceGeometry, attention, attention_f32, blocked_conv_f32, blocked_f32, blocked_rows,
    channels_last, conv, conv_f32, conv_pixels_f32, elementwise, fused, layout, matmul, misc, norm,
    norm_f32, quant, reduce, resample, state, transpose,
};
use crate::layout::StepLayout;
use crate::tensor::{Dst, Src};
use rlx_ir::{
    BinaryOp, DType, Error, EwStep, MAX_REGION_INPUTS, Op, PadMode, ReduceOp, Result, Shape,
    fusable_binary, fusable_unary,
};

/// What a kernel is called with: the step's op, its operands and its output.
pub(crate) struct Args<'s, 'a> {
    /// The step's op (its attributes).
    pub op: &'s Op,
    /// How many operands the step has.
    pub n_inputs: usize,
    /// Operand `k`.
    pub src: &'s dyn Fn(usize) -> Src<'a>,
    /// Where the result goes.
    pub out: Dst<'a>,
    /// A reduction's geometry, prepared at compile time.
    pub geometry: Option<&'s ReduceGeometry>,
    /// Which operands and whether the output are channel-blocked.
    pub layout: StepLayout,
}

impl<'a> Args<'_, 'a> {
    /// Operand `k`.
    fn src(&self, k: usize) -> Src<'a> {
        (self.src)(k)
    }

    /// Operand `k` when the step has it.
    fn opt(&self, k: usize) -> Option<Src<'a>> {
        (k < self.n_inputs).then(|| self.src(k))
    }

    /// The error for a kernel called with an op it was not chosen for (a bug).
    fn wrong_op(&self, kernel: &str) -> Error {
        Error::runtime(
            "cpu kernel",
            format!("{kernel} was called for op {}", self.op.name()),
        )
    }
}

/// A kernel's entry point.
pub(crate) type KernelFn = for<'s, 'a, 'c> fn(&Args<'s, 'a>, &mut Ctx<'c>) -> Result<()>;

/// A step's resolved kernel: its name (as `rlx inspect` and profiles show it) and
/// the function that runs it.
#[derive(Clone, Debug)]
pub(crate) struct Kernel {
    /// `cpu.<method>.<op>.<dtype>`; `cpu.ref.*` names kernels that work element by
    /// element at the step's shapes: the scalar reference kernels, and copies whose
    /// contiguous runs are shorter than a vector's worth (a permute that moves the
    /// last axis, rows of fewer than 16 values).
    pub name: String,
    /// Runs the step.
    pub run: KernelFn,
}

impl Kernel {
    fn new(name: String, run: KernelFn) -> Kernel {
        Kernel { name, run }
    }

    /// A scalar reference kernel.
    fn reference(op: &Op, dtype: DType, run: KernelFn) -> Kernel {
        Kernel::new(format!("cpu.ref.{}.{}", op.name(), dtype), run)
    }
}

/// Whether a kernel runs `op` on operands of `inputs` into `out` with the operands
/// and output blocked as `layout` says ([`crate::layout`]): every op does with
/// nothing blocked; with blocks, the convolutions that [`blocked_conv_f32::kind`]
/// takes (a residual in the output's layout), `f32` elementwise ops as
/// [`blocked_elementwise`] says, channel concatenations of parts with the output's
/// block, max and average pools blocked in and out, sums and means over a plane
/// from a blocked value into a plain one, slices, pads and resamplings of the
/// plane as [`blocked_rows::accepts`] says, and permutes between blocked values
/// and plain channels-last ones as [`channels_last::accepts`] says.
pub(crate) fn accepts(op: &Op, inputs: &[Shape], out: &Shape, layout: StepLayout) -> bool {
    if !layout.any() {
        return true;
    }
    match op {
        Op::Conv2d { .. } | Op::FusedConv2d { .. } => blocked_conv_runs(op, inputs, layout),
        Op::Elementwise { .. } => blocked_elementwise(inputs, out, layout),
        Op::Unary(u) if inputs[0].dtype() == DType::F32 && fusable_unary(*u) => {
            blocked_elementwise(inputs, out, layout)
        }
        Op::Binary(b) if fast_binary(*b, inputs[0].dtype(), out) => {
            blocked_elementwise(inputs, out, layout)
        }
        // Whole images of whole blocks: the same bytes move in either layout, when
        // every part but the last is whole blocks of 16 (so each part's blocks are
        // the output's).
        Op::Concat { axis: 1 } => (0..inputs.len()).all(|k| {
            layout.input(k) == layout.output()
                && (!layout.output()
                    || k + 1 == inputs.len()
                    || inputs[k].dim(1).is_multiple_of(crate::layout::BLOCK))
        }),
        Op::MaxPool2d { .. } | Op::AvgPool2d { .. } => {
            inputs[0].dtype() == DType::F32 && layout.input(0) && layout.output()
        }
        Op::Permute { perm } => {
            channels_last::accepts(perm, &inputs[0], layout.input(0), layout.output())
        }
        Op::Slice { .. } | Op::Pad { .. } | Op::Interpolate { .. } => {
            (1..inputs.len()).all(|k| !layout.input(k))
                && blocked_rows::accepts(op, inputs, layout.input(0), layout.output())
        }
        Op::Reduce {
            op: ReduceOp::Sum | ReduceOp::Mean,
            axes,
            ..
        } => {
            inputs[0].dtype() == DType::F32
                && axes.as_slice() == [2, 3]
                && layout.input(0)
                && !layout.output()
        }
        _ => false,
    }
}

/// Whether the blocked convolution kernel runs the convolution `op` (`Conv2d` or
/// `FusedConv2d`) with `layout`: [`blocked_conv_f32::kind`] has a kernel for it, and
/// that kernel runs its fusion (a prologue only on the pointwise and dense kernels, a
/// residual in the output's layout, every other extra operand plain).
pub(crate) fn blocked_conv_runs(op: &Op, inputs: &[Shape], layout: StepLayout) -> bool {
    match op {
        Op::Conv2d { window, groups } => {
            blocked_conv_f32::kind(window, *groups, &inputs[0], &inputs[1], layout).is_some()
                && inputs.len() <= 3
                && !layout.input(2)
        }
        Op::FusedConv2d {
            window,
            groups,
            fusion,
        } => {
            let finishes = |act: Option<rlx_ir::UnaryOp>| {
                act.is_none_or(|a| fused::gemm_activation(a).is_some())
            };
            let residual_at = fusion.residual.then(|| fusion.residual_at());
            let kind = blocked_conv_f32::kind(window, *groups, &inputs[0], &inputs[1], layout);
            let channels = inputs[0].dim(1);
            // A prologue is applied to a copy of the input (pointwise) or to the
            // staged input (dense), one value per channel.
            let prologue_kind = matches!(
                kind,
                Some(
                    blocked_conv_f32::BlockedConv::Pointwise | blocked_conv_f32::BlockedConv::Dense
                )
            );
            let prologue_runs = !fusion.has_prologue()
                || (prologue_kind
                    && finishes(fusion.input_activation)
                    && (!fusion.input_affine
                        || (0..2).all(|k| {
                            inputs[fusion.input_scale_at() + k].num_elements() == channels
                        })));
            kind.is_some()
                && prologue_runs
                && finishes(fusion.activation)
                && finishes(fusion.post_activation)
                && (fusion.post_activation.is_none() || fusion.channel_affine)
                && (2..inputs.len()).all(|k| {
                    if Some(k) == residual_at {
                        layout.input(k) == layout.output()
                    } else {
                        !layout.input(k)
                    }
                })
        }
        _ => false,
    }
}

/// Whether an elementwise step runs with `layout`: a plain output with plain
/// operands; a blocked output with each operand of its dims blocked, each
/// per-channel operand (`[1 or n, c, 1, 1]`, `[c, 1, 1]`, only where the channels
/// are whole blocks of 16) and single value plain. [`kernel_shapes`] then gives
/// the kernel shapes under which its broadcasting reads them right.
fn blocked_elementwise(inputs: &[Shape], out: &Shape, layout: StepLayout) -> bool {
    if !layout.output() {
        return (0..inputs.len()).all(|k| !layout.input(k));
    }
    let [n, c] = [out.dim(0), out.dim(1)];
    out.dtype() == DType::F32
        && out.rank() == 4
        && inputs.iter().enumerate().all(|(k, s)| {
            if s.dims() == out.dims() {
                layout.input(k)
            } else {
                let per_channel =
                    s.dims() == [c, 1, 1] || s.dims() == [1, c, 1, 1] || s.dims() == [n, c, 1, 1];
                !layout.input(k)
                    && (s.num_elements() == 1
                        || (per_channel && c.is_multiple_of(crate::layout::BLOCK)))
            }
        })
}

/// Whether `op` is run by the elementwise region kernel.
fn is_region(op: &Op, inputs: &[Shape], out: &Shape) -> bool {
    match op {
        Op::Elementwise { .. } => true,
        Op::Unary(u) => inputs[0].dtype() == DType::F32 && fusable_unary(*u),
        Op::Binary(b) => fast_binary(*b, inputs[0].dtype(), out),
        _ => false,
    }
}

/// The shapes a step's kernel is given, in place of `inputs` and `out`: the same,
/// except for an elementwise step with a blocked output of whole blocks of 16,
/// which sees its values as what they are in memory, `[n, c / 16, h * w, 16]`, and
/// its per-channel operands as `[1 or n, c / 16, 1, 16]`, so that its broadcasting
/// walks them right (with a last block of 8, its operands are all of its dims or
/// single values, which read alike in either layout).
pub(crate) fn kernel_shapes(op: &Op, layout: StepLayout, inputs: &mut [Shape], out: &mut Shape) {
    let block = crate::layout::BLOCK;
    if !layout.output() || !is_region(op, inputs, out) || !out.dim(1).is_multiple_of(block) {
        return;
    }
    let blocks = out.dim(1) / block;
    let blocked = |lead: usize, pixels: usize, dtype: DType| {
        Shape::new(&[lead, blocks, pixels, block], dtype)
    };
    let (n, pixels) = (out.dim(0), out.dim(2) * out.dim(3));
    for (k, s) in inputs.iter_mut().enumerate() {
        if layout.input(k) {
            *s = blocked(n, pixels, s.dtype());
        } else if s.num_elements() != 1 {
            let lead = if s.rank() == 4 { s.dim(0) } else { 1 };
            *s = blocked(lead, 1, s.dtype());
        }
    }
    *out = blocked(n, pixels, out.dtype());
}

/// The kernel that runs `op` on operands of `inputs` into `out` (`products_on_amx`:
/// `f32` products with an `f32` `B` run on AMX tiles; `layout`: which are
/// channel-blocked, as [`accepts`] allowed). The kernel families that have code
/// per instruction set read [`crate::isa::isa`], detected once.
pub(crate) fn select(
    op: &Op,
    inputs: &[Shape],
    out: &Shape,
    products_on_amx: bool,
    layout: StepLayout,
) -> Kernel {
    let mut kernel = select_kernel(op, inputs, out, products_on_amx, layout);
    // Kernels that run either layout unchanged say when they run blocked values.
    if layout.any() && !kernel.name.contains("blocked") {
        kernel.name = kernel.name.replacen("cpu.", "cpu.blocked-", 1);
    }
    kernel
}

/// [`select`] before the name says the layout.
fn select_kernel(
    op: &Op,
    inputs: &[Shape],
    out: &Shape,
    products_on_amx: bool,
    layout: StepLayout,
) -> Kernel {
    let dtype = inputs.first().map_or(out.dtype(), |s| s.dtype());
    let f32_in = dtype == DType::F32;
    let gemm = if products_on_amx && inputs.get(1).is_some_and(|b| b.dtype() == DType::F32) {
        "amx-bf16"
    } else {
        crate::gemm::best_kernel().name
    };
    match op {
        Op::Input { .. } | Op::Param { .. } | Op::Constant { .. } => {
            Kernel::new(format!("cpu.source.{}", op.name()), nothing)
        }
        Op::Unary(u) if f32_in && fusable_unary(*u) => {
            Kernel::new(format!("cpu.region1.{}.f32", u.name()), unary_region)
        }
        Op::Unary(_) => Kernel::reference(op, dtype, unary),
        Op::Binary(b) if fast_binary(*b, dtype, out) => {
            Kernel::new(format!("cpu.region1.{}.f32", b.name()), binary_region)
        }
        Op::Binary(b) if dtype == DType::F32 && b.is_comparison() => {
            // Rows of the coalesced walk, one loop each (`elementwise::compare_f32`).
            Kernel::new(format!("cpu.rows.{}.f32", b.name()), binary)
        }
        Op::Binary(_) => Kernel::reference(op, dtype, binary),
        Op::Where if matches!(out.dtype().size_in_bytes(), 1 | 2 | 4 | 8) => {
            // Rows of the coalesced walk, split between the threads when large.
            Kernel::new(format!("cpu.rows.where.{}", out.dtype()), select_values)
        }
        Op::Where => Kernel::reference(op, dtype, select_values),
        Op::Cast(_) => Kernel::reference(op, dtype, cast),
        Op::Reduce { .. } if layout.input(0) => {
            Kernel::new(format!("cpu.blocked.{}.f32", op.name()), blocked_plane_sums)
        }
        Op::Reduce {
            op: ReduceOp::Sum | ReduceOp::Mean,
            axes,
            ..
        } if f32_in && consecutive(axes).is_some() => {
            Kernel::new(format!("cpu.axis.{}.f32", op.name()), sum_axes)
        }
        Op::Reduce { .. } => Kernel::reference(op, dtype, reduce_any),
        Op::ArgReduce { .. } => Kernel::reference(op, dtype, arg_reduce),
        Op::Softmax { axis } | Op::LogSoftmax { axis }
            if f32_in && *axis + 1 == inputs[0].rank() =>
        {
            Kernel::new(format!("cpu.rows.{}.f32", op.name()), softmax_rows)
        }
        Op::Softmax { .. } | Op::LogSoftmax { .. } => Kernel::reference(op, dtype, softmax),
        Op::LayerNorm { .. } | Op::RmsNorm { .. } if f32_in => {
            Kernel::new(format!("cpu.rows.{}.f32", op.name()), norm_rows)
        }
        Op::LayerNorm { .. } | Op::RmsNorm { .. } => Kernel::reference(op, dtype, norm_any),
        Op::NormGrad { .. } | Op::NormScaleGrad { .. } if f32_in => {
            Kernel::new(format!("cpu.rows.{}.f32", op.name()), norm_grad_rows)
        }
        Op::NormGrad { .. } | Op::NormScaleGrad { .. } => {
            Kernel::reference(op, dtype, norm_grad_any)
        }
        Op::MatMul if f32_in => Kernel::new(format!("cpu.gemm.{gemm}.matmul.f32"), matmul),
        Op::MatMul => Kernel::reference(op, dtype, matmul),
        Op::FusedMatMul { .. } if f32_in => {
            Kernel::new(format!("cpu.gemm.{gemm}.matmul+epilogue.f32"), fused_matmul)
        }
        Op::FusedMatMul { .. } => Kernel::reference(op, dtype, fused_matmul),
        Op::Reshape { .. } => Kernel::new(format!("cpu.copy.reshape.{dtype}"), reshape),
        Op::Permute { .. } if layout.any() => Kernel::new(
            "cpu.blocked.channels_last.f32".to_string(),
            channels_last_permute,
        ),
        Op::Permute { perm }
            if transpose::as_batched_transpose(inputs[0].dims(), perm).is_some() =>
        {
            Kernel::new(format!("cpu.tiles.transpose.{dtype}"), batched_transpose)
        }
        Op::Permute { perm }
            if perm.last().is_some_and(|&last| last + 1 == perm.len())
                && (row_copies(out) || kept_run(inputs[0].dims(), perm) >= ROW_COPY_MIN) =>
        {
            // The last axis stays: whole rows copied, threaded when large.
            Kernel::new(format!("cpu.rows.permute.{dtype}"), permute)
        }
        Op::Permute { perm } if transpose::as_interleave(inputs[0].dims(), perm).is_some() => {
            Kernel::new(format!("cpu.rows.interleave.{dtype}"), interleave)
        }
        Op::Permute { .. } => Kernel::reference(op, dtype, permute),
        Op::Slice { .. } | Op::Pad { .. } | Op::Interpolate { .. } if layout.output() => {
            Kernel::new(format!("cpu.blocked.{}.f32", op.name()), blocked_plane_rows)
        }
        Op::Slice { axes }
            if axes.last().is_none_or(|a| a.step == 1)
                && (row_copies(out) || sliced_run(inputs[0].dims(), axes) >= ROW_COPY_MIN) =>
        {
            Kernel::new(format!("cpu.rows.slice.{dtype}"), slice)
        }
        Op::Slice { .. } => Kernel::reference(op, dtype, slice),
        Op::Concat { axis }
            if concat_block(inputs, *axis) >= ROW_COPY_MIN || short_rows_masked(out) =>
        {
            Kernel::new(format!("cpu.rows.concat.{dtype}"), concat)
        }
        Op::Concat { .. } => Kernel::reference(op, dtype, concat),
        Op::Gather { axis } if inner_len(&inputs[0], *axis) >= ROW_COPY_MIN => {
            Kernel::new(format!("cpu.rows.gather.{dtype}"), gather)
        }
        Op::Gather { .. } => Kernel::reference(op, dtype, gather),
        Op::Interpolate { .. } if f32_in && inputs[1].dtype() == DType::I64 => {
            Kernel::new("cpu.rows.interpolate.f32".into(), interpolate)
        }
        Op::Interpolate { .. } => Kernel::reference(op, dtype, interpolate),
        Op::Expand { .. } => Kernel::reference(op, dtype, expand),
        Op::Pad {
            mode: PadMode::Constant(_),
            ..
        } if inputs[0].rank() > 0 => Kernel::new(format!("cpu.rows.pad.{dtype}"), pad),
        Op::Pad { .. } => Kernel::reference(op, dtype, pad),
        Op::Tile { .. } => Kernel::reference(op, dtype, tile),
        Op::Range { .. } => Kernel::reference(op, out.dtype(), range),
        Op::RandomUniform { .. } => Kernel::reference(op, out.dtype(), random_uniform),
        Op::Cumsum { .. } => Kernel::reference(op, dtype, cumsum),
        Op::TopK { .. } => Kernel::reference(op, dtype, topk),
        Op::OneHot { .. } => Kernel::reference(op, dtype, one_hot),
        Op::Conv2d { .. } | Op::FusedConv2d { .. }
            if let Some(kind) = super::blocked_conv(op, inputs, layout) =>
        {
            let fused = if matches!(op, Op::FusedConv2d { .. }) {
                "+epilogue"
            } else {
                ""
            };
            Kernel::new(
                format!(
                    "cpu.{}.{}.conv2d{fused}.f32",
                    kind.name(),
                    if crate::isa::isa().avx512f {
                        "avx512"
                    } else {
                        "avx2"
                    }
                ),
                blocked_conv2d,
            )
        }
        Op::Conv2d { window, groups } | Op::FusedConv2d { window, groups, .. } if f32_in => {
            let method = conv_f32::method(window, *groups, &inputs[0], &inputs[1]).name();
            let fused = if matches!(op, Op::FusedConv2d { .. }) {
                "+epilogue"
            } else {
                ""
            };
            let name = format!(
                "cpu.{method}.{}.conv2d{fused}.f32",
                crate::gemm::best_kernel().name
            );
            Kernel::new(name, conv2d)
        }
        Op::Conv2d { .. } | Op::FusedConv2d { .. } => Kernel::reference(op, dtype, conv2d),
        Op::MaxPool2d { .. } | Op::AvgPool2d { .. } if layout.input(0) => {
            Kernel::new(format!("cpu.blocked.{}.f32", op.name()), pool_planes)
        }
        Op::MaxPool2d { .. } | Op::AvgPool2d { .. } if f32_in => {
            Kernel::new(format!("cpu.planes.{}.f32", op.name()), pool_planes)
        }
        Op::MaxPool2d { .. } | Op::AvgPool2d { .. } => Kernel::reference(op, dtype, pool_any),
        Op::TiledMaxPoolGrad { .. } if f32_in => {
            Kernel::new(format!("cpu.planes.{}.f32", op.name()), tiled_max_pool_grad)
        }
        Op::TiledMaxPoolGrad { .. } => Kernel::reference(op, dtype, tiled_max_pool_grad),
        Op::Attention { .. } if f32_in => {
            Kernel::new("cpu.flash.attention.f32".into(), attention_flash)
        }
        Op::Attention { .. } => Kernel::reference(op, dtype, attention_any),
        Op::CachedAttention { .. } => {
            Kernel::new("cpu.flash.cached_attention.f32".into(), cached_attention)
        }
        Op::Rope { .. } => Kernel::reference(op, dtype, rope),
        Op::WriteAt { .. } => Kernel::new(format!("cpu.copy.write_at.{dtype}"), write_at),
        Op::Elementwise { steps } => {
            Kernel::new(format!("cpu.region{}.{}", steps.len(), out.dtype()), region)
        }
        Op::QuantMatMul { format } => {
            Kernel::new(format!("cpu.quant.{format}.matmul"), quant_matmul)
        }
        Op::Dequantize { format } => {
            Kernel::new(format!("cpu.quant.{format}.dequantize"), dequantize)
        }
    }
}

/// Elements a copy kernel moves at once from which it counts as a row copy (one
/// `memcpy` of a vector's worth or more) rather than an element loop.
const ROW_COPY_MIN: usize = 16;

/// Whether a strided copy into `out` whose rows are contiguous in the source copies
/// whole rows: rows of a vector's worth or more, or shorter rows of 4-byte values,
/// which AVX-512 copies one row per masked load and store.
fn row_copies(out: &Shape) -> bool {
    out.dims().last().is_none_or(|&d| d >= ROW_COPY_MIN) || short_rows_masked(out)
}

/// Whether rows of `out`'s elements shorter than [`ROW_COPY_MIN`] are copied one
/// masked load and store each (4-byte values on AVX-512).
fn short_rows_masked(out: &Shape) -> bool {
    out.dtype().size_in_bytes() == 4 && crate::isa::isa().avx512f
}

/// Elements of the longest run a permute keeps together at the end: the input's
/// last axes that `perm` leaves in place (ShuffleNet's channel shuffle of
/// `[n, 2, c, h, w]` keeps rows of `h * w`, whose copy walks them as one).
fn kept_run(dims: &[usize], perm: &[usize]) -> usize {
    let kept = perm
        .iter()
        .rev()
        .enumerate()
        .take_while(|&(i, &p)| p + 1 + i == perm.len())
        .count();
    dims[dims.len() - kept..].iter().product()
}

/// Elements of the longest contiguous run a slice copies: the input's last axes
/// that it takes whole, then the next axis's taken length when it steps by one (a
/// slice of whole 14 x 14 planes copies runs of 196 however narrow the rows are).
fn sliced_run(dims: &[usize], axes: &[rlx_ir::SliceAxis]) -> usize {
    let mut run = 1;
    for (&dim, axis) in dims.iter().zip(axes).rev() {
        if axis.step != 1 {
            break;
        }
        run *= axis.len;
        if axis.start != 0 || axis.len != dim {
            break;
        }
    }
    run
}

/// Elements after `axis` in `shape`.
fn inner_len(shape: &Shape, axis: usize) -> usize {
    shape.dims()[axis + 1..].iter().product()
}

/// The smallest contiguous block a concatenation along `axis` copies.
fn concat_block(inputs: &[Shape], axis: usize) -> usize {
    inputs
        .iter()
        .map(|s| s.dim(axis) * inner_len(s, axis))
        .min()
        .unwrap_or(0)
}

/// The first and last of `axes` when they are consecutive (sorted, as reductions
/// keep them) and not empty.
pub(crate) fn consecutive(axes: &[usize]) -> Option<(usize, usize)> {
    let (&first, &last) = (axes.first()?, axes.last()?);
    (last - first + 1 == axes.len()).then_some((first, last))
}

/// Whether a binary op runs on the vectorized region kernel: `f32` arithmetic.
pub(crate) fn fast_binary(op: BinaryOp, dtype: DType, out: &Shape) -> bool {
    dtype == DType::F32 && out.dtype() == DType::F32 && fusable_binary(op)
}

fn nothing(_: &Args, _: &mut Ctx) -> Result<()> {
    Ok(())
}

fn unary_region(a: &Args, ctx: &mut Ctx) -> Result<()> {
    let Op::Unary(u) = a.op else {
        return Err(a.wrong_op("unary_region"));
    };
    fused::elementwise(&[EwStep::Unary(*u, 0)], &[a.src(0)], a.out, ctx)
}

fn unary(a: &Args, _: &mut Ctx) -> Result<()> {
    let Op::Unary(u) = a.op else {
        return Err(a.wrong_op("unary"));
    };
    elementwise::unary(*u, a.src(0), a.out);
    Ok(())
}

fn binary_region(a: &Args, ctx: &mut Ctx) -> Result<()> {
    let Op::Binary(b) = a.op else {
        return Err(a.wrong_op("binary_region"));
    };
    // One arithmetic op on f32: the region kernel, with a one-step program.
    fused::elementwise(
        &[EwStep::Binary(*b, 0, 1)],
        &[a.src(0), a.src(1)],
        a.out,
        ctx,
    )
}

fn binary(a: &Args, _: &mut Ctx) -> Result<()> {
    let Op::Binary(b) = a.op else {
        return Err(a.wrong_op("binary"));
    };
    elementwise::binary(*b, a.src(0), a.src(1), a.out);
    Ok(())
}

fn select_values(a: &Args, ctx: &mut Ctx) -> Result<()> {
    elementwise::select(a.src(0), a.src(1), a.src(2), a.out, ctx)
}

fn cast(a: &Args, _: &mut Ctx) -> Result<()> {
    elementwise::cast(a.src(0), a.out);
    Ok(())
}

fn sum_axes(a: &Args, ctx: &mut Ctx) -> Result<()> {
    let Op::Reduce { op, axes, .. } = a.op else {
        return Err(a.wrong_op("sum_axes"));
    };
    let span = consecutive(axes).ok_or_else(|| a.wrong_op("sum_axes"))?;
    norm_f32::sum_axes(*op == ReduceOp::Mean, a.src(0), span, a.out, ctx)
}

fn reduce_any(a: &Args, _: &mut Ctx) -> Result<()> {
    let Op::Reduce { op, .. } = a.op else {
        return Err(a.wrong_op("reduce"));
    };
    let fallback;
    let geometry = match a.geometry {
        Some(g) => g,
        None => {
            fallback = ReduceGeometry::new(a.src(0).shape.dims(), &[]);
            &fallback
        }
    };
    reduce::reduce(*op, geometry, a.src(0), a.out);
    Ok(())
}

fn arg_reduce(a: &Args, _: &mut Ctx) -> Result<()> {
    let Op::ArgReduce { op, axis, .. } = a.op else {
        return Err(a.wrong_op("arg_reduce"));
    };
    reduce::arg_reduce(*op, *axis, a.src(0), a.out);
    Ok(())
}

fn softmax_rows(a: &Args, ctx: &mut Ctx) -> Result<()> {
    norm_f32::softmax_last(matches!(a.op, Op::LogSoftmax { .. }), a.src(0), a.out, ctx)
}

fn softmax(a: &Args, _: &mut Ctx) -> Result<()> {
    match a.op {
        Op::Softmax { axis } => norm::softmax(*axis, false, a.src(0), a.out),
        Op::LogSoftmax { axis } => norm::softmax(*axis, true, a.src(0), a.out),
        _ => return Err(a.wrong_op("softmax")),
    }
    Ok(())
}

fn norm_rows(a: &Args, ctx: &mut Ctx) -> Result<()> {
    match a.op {
        Op::LayerNorm { eps } => {
            norm_f32::norm(a.src(0), a.src(1), Some(a.src(2)), eps.get(), a.out, ctx)
        }
        Op::RmsNorm { eps } => norm_f32::norm(a.src(0), a.src(1), None, eps.get(), a.out, ctx),
        _ => Err(a.wrong_op("norm_rows")),
    }
}

fn norm_any(a: &Args, _: &mut Ctx) -> Result<()> {
    match a.op {
        Op::LayerNorm { eps } => norm::norm(a.src(0), a.src(1), Some(a.src(2)), eps.get(), a.out),
        Op::RmsNorm { eps } => norm::norm(a.src(0), a.src(1), None, eps.get(), a.out),
        _ => return Err(a.wrong_op("norm")),
    }
    Ok(())
}

fn norm_grad_rows(a: &Args, ctx: &mut Ctx) -> Result<()> {
    match a.op {
        Op::NormGrad { eps, centered } => norm_f32::norm_grad(
            a.src(0),
            a.src(1),
            a.src(2),
            (eps.get(), *centered),
            a.out,
            ctx,
        ),
        Op::NormScaleGrad { eps, centered } => {
            norm_f32::norm_scale_grad(a.src(0), a.src(1), (eps.get(), *centered), a.out, ctx)
        }
        _ => Err(a.wrong_op("norm_grad_rows")),
    }
}

fn norm_grad_any(a: &Args, _: &mut Ctx) -> Result<()> {
    match a.op {
        Op::NormGrad { eps, centered } => norm::norm_grad(
            a.src(0),
            Some(a.src(1)),
            a.src(2),
            eps.get(),
            *centered,
            a.out,
        ),
        Op::NormScaleGrad { eps, centered } => {
            norm::norm_grad(a.src(0), None, a.src(1), eps.get(), *centered, a.out)
        }
        _ => return Err(a.wrong_op("norm_grad")),
    }
    Ok(())
}

fn matmul(a: &Args, ctx: &mut Ctx) -> Result<()> {
    matmul::matmul(a.src(0), a.src(1), a.out, ctx)
}

fn fused_matmul(a: &Args, ctx: &mut Ctx) -> Result<()> {
    let Op::FusedMatMul {
        alpha,
        transpose_a,
        transpose_b,
        bias,
        activation,
        residual,
    } = a.op
    else {
        return Err(a.wrong_op("fused_matmul"));
    };
    let bias_src = bias.then(|| a.src(2));
    let residual_src = residual.then(|| a.src(a.n_inputs - 1));
    fused::fused_matmul(
        alpha.get(),
        *activation,
        (a.src(0), *transpose_a),
        (a.src(1), *transpose_b),
        bias_src,
        residual_src,
        a.out,
        ctx,
    )
}

/// The planner makes every reshape a view; run as a copy if one ever is not.
fn reshape(a: &Args, _: &mut Ctx) -> Result<()> {
    layout::copy_flat(a.src(0), a.out);
    Ok(())
}

fn interleave(a: &Args, ctx: &mut Ctx) -> Result<()> {
    let Op::Permute { perm } = a.op else {
        return Err(a.wrong_op("interleave"));
    };
    let x = a.src(0);
    match transpose::as_interleave(x.shape.dims(), perm) {
        Some(plan) => transpose::interleave(&plan, x, a.out, ctx),
        None => Err(a.wrong_op("interleave")),
    }
}

fn batched_transpose(a: &Args, ctx: &mut Ctx) -> Result<()> {
    let Op::Permute { perm } = a.op else {
        return Err(a.wrong_op("batched_transpose"));
    };
    let x = a.src(0);
    match transpose::as_batched_transpose(x.shape.dims(), perm) {
        Some(geometry) => transpose::batched_transpose(geometry, x, a.out, ctx),
        None => layout::permute(perm, x, a.out, ctx),
    }
}

/// A permute between a blocked value and a plain channels-last one
/// ([`channels_last`]).
fn channels_last_permute(a: &Args, ctx: &mut Ctx) -> Result<()> {
    channels_last::run(a.src(0), a.out, a.layout.input(0), ctx)
}

fn permute(a: &Args, ctx: &mut Ctx) -> Result<()> {
    let Op::Permute { perm } = a.op else {
        return Err(a.wrong_op("permute"));
    };
    layout::permute(perm, a.src(0), a.out, ctx)
}

fn slice(a: &Args, ctx: &mut Ctx) -> Result<()> {
    let Op::Slice { axes } = a.op else {
        return Err(a.wrong_op("slice"));
    };
    layout::slice(axes, a.src(0), a.out, ctx)
}

/// A slice, pad or resampling over the planes of a blocked value.
fn blocked_plane_rows(a: &Args, ctx: &mut Ctx) -> Result<()> {
    let extra = [1, 2].map(|k| (k < a.n_inputs).then(|| a.src(k)));
    blocked_rows::run(a.op, (a.src(0), a.layout.input(0)), extra, a.out, ctx)
}

fn concat(a: &Args, _: &mut Ctx) -> Result<()> {
    let Op::Concat { axis } = a.op else {
        return Err(a.wrong_op("concat"));
    };
    let mut start = 0;
    for k in 0..a.n_inputs {
        let x = a.src(k);
        layout::concat_one(*axis, x, start, a.out);
        start += x.shape.dim(*axis);
    }
    Ok(())
}

fn gather(a: &Args, _: &mut Ctx) -> Result<()> {
    let Op::Gather { axis } = a.op else {
        return Err(a.wrong_op("gather"));
    };
    layout::gather(*axis, a.src(0), a.src(1), a.out)
}

fn interpolate(a: &Args, ctx: &mut Ctx) -> Result<()> {
    let Op::Interpolate { axis } = a.op else {
        return Err(a.wrong_op("interpolate"));
    };
    resample::interpolate(*axis, a.src(0), a.src(1), a.src(2), a.out, ctx)
}

fn expand(a: &Args, _: &mut Ctx) -> Result<()> {
    layout::expand(a.src(0), a.out);
    Ok(())
}

fn pad(a: &Args, _: &mut Ctx) -> Result<()> {
    let Op::Pad { pads, mode } = a.op else {
        return Err(a.wrong_op("pad"));
    };
    layout::pad(pads, *mode, a.src(0), a.out);
    Ok(())
}

fn tile(a: &Args, _: &mut Ctx) -> Result<()> {
    layout::tile(a.src(0), a.out);
    Ok(())
}

fn range(a: &Args, _: &mut Ctx) -> Result<()> {
    let Op::Range { start, step, .. } = a.op else {
        return Err(a.wrong_op("range"));
    };
    misc::range(start.get(), step.get(), a.out);
    Ok(())
}

fn random_uniform(a: &Args, ctx: &mut Ctx) -> Result<()> {
    let Op::RandomUniform { seed, .. } = a.op else {
        return Err(a.wrong_op("random_uniform"));
    };
    misc::random_uniform(*seed, a.src(0), a.out, ctx)
}

fn cumsum(a: &Args, _: &mut Ctx) -> Result<()> {
    let Op::Cumsum {
        axis,
        exclusive,
        reverse,
    } = a.op
    else {
        return Err(a.wrong_op("cumsum"));
    };
    misc::cumsum(*axis, *exclusive, *reverse, a.src(0), a.out);
    Ok(())
}

fn topk(a: &Args, _: &mut Ctx) -> Result<()> {
    let Op::TopK {
        k,
        axis,
        largest,
        output,
    } = a.op
    else {
        return Err(a.wrong_op("topk"));
    };
    misc::topk(*k, *axis, *largest, *output, a.src(0), a.out);
    Ok(())
}

fn one_hot(a: &Args, _: &mut Ctx) -> Result<()> {
    let Op::OneHot { depth, .. } = a.op else {
        return Err(a.wrong_op("one_hot"));
    };
    misc::one_hot(*depth, a.src(0), a.out);
    Ok(())
}

fn conv2d(a: &Args, ctx: &mut Ctx) -> Result<()> {
    match a.op {
        Op::Conv2d { window, groups } if a.src(0).shape.dtype() == DType::F32 => {
            let epilogue = conv::ConvEpilogue::default();
            conv_f32::conv2d(
                window,
                *groups,
                [a.src(0), a.src(1)],
                a.opt(2),
                epilogue,
                a.out,
                ctx,
            )
        }
        Op::Conv2d { window, groups } => {
            conv::conv2d(window, *groups, a.src(0), a.src(1), a.opt(2), a.out);
            Ok(())
        }
        Op::FusedConv2d { .. } => fused_conv2d(a, ctx),
        _ => Err(a.wrong_op("conv2d")),
    }
}

/// A convolution with a channel-blocked operand or output
/// ([`blocked_conv_f32`]).
fn blocked_conv2d(a: &Args, ctx: &mut Ctx) -> Result<()> {
    let (window, groups, fusion) = match a.op {
        Op::Conv2d { window, groups } => (
            window,
            *groups,
            rlx_ir::ConvFusion {
                bias: a.n_inputs > 2,
                ..Default::default()
            },
        ),
        Op::FusedConv2d {
            window,
            groups,
            fusion,
        } => (window, *groups, *fusion),
        _ => return Err(a.wrong_op("blocked_conv2d")),
    };
    let (x, w) = (a.src(0), a.src(1));
    let kind = blocked_conv_f32::kind(window, groups, x.shape, w.shape, a.layout)
        .ok_or_else(|| a.wrong_op("blocked_conv2d"))?;
    let floats = |s: Src<'_>| {
        // SAFETY: an f32 tensor of `s.len` values, alive for the step.
        unsafe { std::slice::from_raw_parts(s.ptr.cast::<f32>(), s.len) }
    };
    let finish = conv_pixels_f32::Finish {
        bias: fusion.bias.then(|| floats(a.src(2))),
        activation: fusion.activation.and_then(fused::gemm_activation),
        residual: fusion.residual.then(|| a.src(fusion.residual_at())),
        affine: fusion.channel_affine.then(|| {
            (
                floats(a.src(fusion.scale_at())),
                floats(a.src(fusion.scale_at() + 1)),
                fusion.post_activation.and_then(fused::gemm_activation),
            )
        }),
    };
    let prologue = fusion.has_prologue().then(|| blocked_conv_f32::Prologue {
        affine: fusion.input_affine.then(|| {
            (
                floats(a.src(fusion.input_scale_at())),
                floats(a.src(fusion.input_scale_at() + 1)),
            )
        }),
        activation: fusion.input_activation.and_then(fused::gemm_activation),
    });
    let blocks = conv_pixels_f32::BlockedIo {
        input: a.layout.input(0),
        output: a.layout.output(),
    };
    match kind {
        blocked_conv_f32::BlockedConv::Winograd => conv_f32::winograd(
            window,
            [x, w],
            fusion.bias.then(|| a.src(2)),
            (finish.activation, finish.residual, finish.affine),
            (a.out, blocks),
            ctx,
        ),
        blocked_conv_f32::BlockedConv::Depthwise => {
            let (c, taps) = (w.shape.dim(0), w.shape.dim(2) * w.shape.dim(3));
            let packed = ctx
                .packed_b
                .filter(|p| p.fits(crate::prepack::PackSpec::DepthwiseTaps { c, taps }))
                .map(crate::prepack::PackedParam::values);
            blocked_conv_f32::depthwise(window, [x, w], packed, finish, a.out, (ctx.gemm, ctx.pool))
        }
        blocked_conv_f32::BlockedConv::Grouped => {
            let (o, cg, taps) = (
                w.shape.dim(0),
                w.shape.dim(1),
                w.shape.dim(2) * w.shape.dim(3),
            );
            let spec = crate::prepack::PackSpec::BlockGroups { o, cg, taps };
            let packed = match ctx.packed_b.filter(|p| p.fits(spec)) {
                Some(packed) => packed.values(),
                None => {
                    let len = conv_pixels_f32::block_groups_weights_len(o, taps);
                    // SAFETY: the step asked for `scratch_f64`: room for `len` f32
                    // values (f64 storage is aligned for f32); an f32 tensor of
                    // `w.len` values, alive for the step.
                    let (values, ws) = unsafe {
                        (
                            std::slice::from_raw_parts_mut(
                                ctx.scratch.as_mut_ptr().cast::<f32>(),
                                len,
                            ),
                            std::slice::from_raw_parts(w.ptr.cast::<f32>(), w.len),
                        )
                    };
                    conv_pixels_f32::pack_block_groups(ws, o, (cg, taps), values);
                    &*values
                }
            };
            conv_pixels_f32::conv2d_block_groups(
                window,
                x,
                packed,
                finish,
                a.out,
                (ctx.gemm, ctx.pool),
            )
        }
        blocked_conv_f32::BlockedConv::Dense => {
            let order = conv_pixels_f32::StepOrder::of(
                a.layout.input(0),
                w.shape.dim(1),
                w.shape.dim(2) * w.shape.dim(3),
            );
            let (packed, _) = conv_f32::pixel_weights(w, order, ctx.packed_b, ctx.scratch);
            conv_pixels_f32::conv2d(
                window,
                x,
                packed,
                (finish, prologue),
                a.out,
                blocks,
                (ctx.gemm, ctx.pool),
            )
        }
        blocked_conv_f32::BlockedConv::Pointwise => {
            let (o, c) = (w.shape.dim(0), w.shape.dim(1));
            let pixels = x.shape.dim(2) * x.shape.dim(3);
            let all_pixels = x.shape.dim(0) * pixels;
            let fold = prologue
                .filter(|p| blocked_conv_f32::folds_prologue(p, o, all_pixels, ctx.gemm.threads()))
                .and_then(|p| p.affine);
            let (packed, rest, folded_bias) = match fold {
                None => {
                    let (packed, rest) = conv_f32::pixel_weights(
                        w,
                        conv_pixels_f32::StepOrder::NATURAL,
                        ctx.packed_b,
                        ctx.scratch,
                    );
                    (packed, rest, None)
                }
                Some(affine) => {
                    let (ahead, packed, rest) =
                        conv_f32::pixel_weights_room(w, ctx.packed_b, ctx.scratch);
                    let (offsets, bias) = rest.split_at_mut(c.div_ceil(2));
                    // SAFETY: the step asked for `scratch_f64`: a bias of a value
                    // per packed filter after the offsets (f64 storage is aligned
                    // for f32).
                    let bias = unsafe {
                        std::slice::from_raw_parts_mut(
                            bias.as_mut_ptr().cast::<f32>(),
                            o.div_ceil(conv_pixels_f32::NR) * conv_pixels_f32::NR,
                        )
                    };
                    let has_bias = blocked_conv_f32::fold_prologue(
                        affine,
                        (ahead, packed, c),
                        finish.bias,
                        bias,
                        (ctx.pool, ctx.gemm.threads()),
                    )?;
                    (&*packed, offsets, has_bias.then_some(&*bias))
                }
            };
            // SAFETY: and room for `c` u32 offsets after them.
            let offsets =
                unsafe { std::slice::from_raw_parts_mut(rest.as_mut_ptr().cast::<u32>(), c) };
            blocked_conv_f32::channel_offsets(pixels, a.layout.input(0), offsets);
            let (prologue, finish) = match fold {
                None => (prologue, finish),
                Some(_) => (
                    None,
                    conv_pixels_f32::Finish {
                        bias: folded_bias,
                        ..finish
                    },
                ),
            };
            blocked_conv_f32::pointwise(
                x,
                (packed, offsets),
                prologue,
                finish,
                a.out,
                a.layout,
                (ctx.gemm, ctx.pool),
            )
        }
    }
}

fn fused_conv2d(a: &Args, ctx: &mut Ctx) -> Result<()> {
    let Op::FusedConv2d {
        window,
        groups,
        fusion: f,
    } = a.op
    else {
        return Err(a.wrong_op("fused_conv2d"));
    };
    let pair = |at: usize| (a.src(at), a.src(at + 1));
    let mut epilogue = conv::ConvEpilogue {
        activation: f.activation,
        residual: f.residual.then(|| a.src(f.residual_at())),
        channel_affine: f.channel_affine.then(|| pair(f.scale_at())),
        post_activation: f.post_activation,
        input_affine: f.input_affine.then(|| pair(f.input_scale_at())),
        input_activation: f.input_activation,
    };
    let bias = f.bias.then(|| a.src(2));
    let mut x = a.src(0);
    // The convolution's own scratch first, then room for the changed input.
    let own_scratch = if x.shape.dtype() == DType::F32 {
        conv_f32::scratch_f64(window, x.shape, a.src(1).shape)
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
        && !conv_f32::prologue_while_packing(window, (x.shape, a.src(1).shape), f.input_activation)
    {
        // Anything but the f32 1x1 convolution (which applies it while packing its
        // input): the changed input into scratch first, vectorized for f32.
        // SAFETY: `prologue_scratch` asked for room for all of `x` (f64 storage:
        // 8-byte aligned, twice as many f32 values).
        let floats = unsafe {
            std::slice::from_raw_parts_mut(copy.as_mut_ptr().cast::<f32>(), copy.len() * 2)
        };
        if !conv::apply_prologue_f32(&epilogue, x, floats, ctx.pool)? {
            // SAFETY: as above, as bytes.
            let bytes = unsafe {
                std::slice::from_raw_parts_mut(copy.as_mut_ptr().cast::<u8>(), copy.len() * 8)
            };
            conv::apply_prologue(&epilogue, x, bytes);
        }
        x = Src {
            ptr: copy.as_ptr().cast::<u8>(),
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
            [x, a.src(1)],
            bias,
            epilogue,
            a.out,
            &mut inner,
        )
    } else {
        conv::conv2d(window, *groups, x, a.src(1), bias, a.out);
        conv::apply_epilogue(epilogue, a.out);
        Ok(())
    }
}

/// `f32` pooling: of planes, or of a blocked value ([`blocked_f32::pool`]).
fn pool_planes(a: &Args, ctx: &mut Ctx) -> Result<()> {
    let (window, max, count_include_pad) = match a.op {
        Op::MaxPool2d { window } => (window, true, false),
        Op::AvgPool2d {
            window,
            count_include_pad,
        } => (window, false, *count_include_pad),
        _ => return Err(a.wrong_op("pool_planes")),
    };
    if a.layout.input(0) {
        blocked_f32::pool(window, max, count_include_pad, a.src(0), a.out, ctx)
    } else {
        conv::pool_f32(window, max, count_include_pad, a.src(0), a.out, ctx)
    }
}

/// A sum or mean over the planes of a blocked value ([`blocked_f32::plane_sums`]).
fn blocked_plane_sums(a: &Args, ctx: &mut Ctx) -> Result<()> {
    match a.op {
        Op::Reduce { op, .. } if matches!(op, ReduceOp::Sum | ReduceOp::Mean) => {
            blocked_f32::plane_sums(*op == ReduceOp::Mean, a.src(0), a.out, ctx)
        }
        _ => Err(a.wrong_op("blocked_plane_sums")),
    }
}

fn pool_any(a: &Args, _: &mut Ctx) -> Result<()> {
    match a.op {
        Op::MaxPool2d { window } => conv::pool(window, true, false, a.src(0), a.out),
        Op::AvgPool2d {
            window,
            count_include_pad,
        } => conv::pool(window, false, *count_include_pad, a.src(0), a.out),
        _ => return Err(a.wrong_op("pool")),
    }
    Ok(())
}

fn tiled_max_pool_grad(a: &Args, ctx: &mut Ctx) -> Result<()> {
    let Op::TiledMaxPoolGrad { kernel } = a.op else {
        return Err(a.wrong_op("tiled_max_pool_grad"));
    };
    let operands = (a.src(0), a.src(1), a.src(2));
    if operands.0.shape.dtype() == DType::F32 {
        conv::tiled_max_pool_grad_f32(*kernel, operands, a.out, ctx)
    } else {
        conv::tiled_max_pool_grad(*kernel, operands, a.out);
        Ok(())
    }
}

fn attention_flash(a: &Args, ctx: &mut Ctx) -> Result<()> {
    let Op::Attention {
        scale,
        causal,
        seq_major,
    } = a.op
    else {
        return Err(a.wrong_op("attention_flash"));
    };
    attention_f32::attention(
        scale.get(),
        *causal,
        *seq_major,
        a.src(0),
        a.src(1),
        a.src(2),
        a.opt(3),
        None,
        a.out,
        ctx,
    )
}

fn attention_any(a: &Args, ctx: &mut Ctx) -> Result<()> {
    let Op::Attention {
        scale,
        causal,
        seq_major,
    } = a.op
    else {
        return Err(a.wrong_op("attention"));
    };
    attention::attention(
        scale.get(),
        *causal,
        *seq_major,
        a.src(0),
        a.src(1),
        a.src(2),
        a.opt(3),
        a.out,
        ctx.scratch,
    );
    Ok(())
}

fn cached_attention(a: &Args, ctx: &mut Ctx) -> Result<()> {
    let Op::CachedAttention { scale } = a.op else {
        return Err(a.wrong_op("cached_attention"));
    };
    attention_f32::cached_attention(
        scale.get(),
        [a.src(0), a.src(1), a.src(2)],
        a.src(3),
        a.out,
        ctx,
    )
}

fn rope(a: &Args, _: &mut Ctx) -> Result<()> {
    let Op::Rope { style } = a.op else {
        return Err(a.wrong_op("rope"));
    };
    attention::rope(*style, a.src(0), a.src(1), a.src(2), a.out);
    Ok(())
}

fn write_at(a: &Args, ctx: &mut Ctx) -> Result<()> {
    let Op::WriteAt { axis } = a.op else {
        return Err(a.wrong_op("write_at"));
    };
    state::write_at(*axis, a.src(1), a.src(2), a.out, ctx)
}

fn region(a: &Args, ctx: &mut Ctx) -> Result<()> {
    let Op::Elementwise { steps } = a.op else {
        return Err(a.wrong_op("region"));
    };
    let mut inputs = [a.src(0); MAX_REGION_INPUTS];
    for (k, slot) in inputs.iter_mut().enumerate().take(a.n_inputs).skip(1) {
        *slot = a.src(k);
    }
    fused::elementwise(steps, &inputs[..a.n_inputs], a.out, ctx)
}

fn quant_matmul(a: &Args, ctx: &mut Ctx) -> Result<()> {
    let Op::QuantMatMul { format } = a.op else {
        return Err(a.wrong_op("quant_matmul"));
    };
    quant::quant_matmul(*format, a.src(0), a.src(1), a.out, ctx)
}

fn dequantize(a: &Args, _: &mut Ctx) -> Result<()> {
    let Op::Dequantize { format } = a.op else {
        return Err(a.wrong_op("dequantize"));
    };
    quant::dequantize(*format, a.src(0), a.out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn kept_runs_are_the_trailing_axes_left_in_place() {
        // ShuffleNet's shuffle keeps each 7 x 7 plane whole.
        assert_eq!(kept_run(&[1, 2, 232, 7, 7], &[0, 2, 1, 3, 4]), 49);
        assert_eq!(kept_run(&[2, 3, 4], &[1, 0, 2]), 4);
        // Only a tail that is in place counts.
        assert_eq!(kept_run(&[2, 3, 4, 5], &[0, 1, 3, 2]), 1);
        assert_eq!(kept_run(&[2, 3, 4], &[0, 1, 2]), 24);
        assert_eq!(kept_run(&[], &[]), 1);
    }

    #[test]
    fn sliced_runs_end_at_the_first_axis_not_taken_whole() {
        let axis = |start, step, len| rlx_ir::SliceAxis { start, step, len };
        // Channels 4..12 of whole 7 x 7 planes: runs of 8 planes.
        let planes = [axis(0, 1, 1), axis(4, 1, 8), axis(0, 1, 7), axis(0, 1, 7)];
        assert_eq!(sliced_run(&[1, 16, 7, 7], &planes), 8 * 49);
        // Columns cut short: runs of the columns taken.
        let cols = [axis(0, 1, 3), axis(0, 1, 7), axis(1, 1, 5)];
        assert_eq!(sliced_run(&[3, 7, 7], &cols), 5);
        // A strided axis ends the run above it.
        let strided = [axis(0, 2, 4), axis(0, 1, 7), axis(0, 1, 7)];
        assert_eq!(sliced_run(&[8, 7, 7], &strided), 49);
    }
}
