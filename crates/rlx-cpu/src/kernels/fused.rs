//! Kernels for the optimizer's fused ops: a matmul with its epilogue in the GEMM's
//! output write, and elementwise regions evaluated chunk by chunk in `f32` with every
//! intermediate in per-thread scratch (one pass over memory).

use super::Ctx;
use crate::elem::{Elem, with_dtype};
use crate::gemm::{Activation, BFormat, Epilogue, Gemm, sgemm_batch};
use crate::tensor::{Dst, Src, broadcast_strides, for_each_strided, strided_offsets};
use crate::vmath;
use rlx_ir::scalar::{binary_f64, unary_f64};
use rlx_ir::{
    BinaryOp, DType, EwStep, MAX_RANK, MAX_REGION_INPUTS, MAX_REGION_REGISTERS, Result, UnaryOp,
};

/// The GEMM epilogue form of a unary op, if it has one.
pub(crate) fn gemm_activation(op: UnaryOp) -> Option<Activation> {
    match op {
        UnaryOp::Gelu => Some(Activation::Gelu),
        UnaryOp::GeluTanh => Some(Activation::GeluTanh),
        UnaryOp::Relu => Some(Activation::Relu),
        UnaryOp::Silu => Some(Activation::Silu),
        UnaryOp::Relu6 => Some(Activation::Relu6),
        UnaryOp::HardSwish => Some(Activation::HardSwish),
        _ => None,
    }
}

/// `act(alpha * (a @ b) + bias) + residual`; operands as in `Op::FusedMatMul`, each
/// with whether it is stored transposed.
#[allow(clippy::too_many_arguments)]
pub(crate) fn fused_matmul(
    alpha: f64,
    activation: Option<UnaryOp>,
    (a, a_transposed): (Src, bool),
    (b, b_transposed): (Src, bool),
    bias: Option<Src>,
    residual: Option<Src>,
    out: Dst,
    ctx: &Ctx,
) -> Result<()> {
    let (m, k, n, a_batch, b_batch) = geometry(&a, &b, [a_transposed, b_transposed]);
    let batch_rank = a_batch.len().max(b_batch.len());
    let out_batch = &out.shape.dims()[..batch_rank];
    let sa = broadcast_strides(a_batch, out_batch);
    let sb = broadcast_strides(b_batch, out_batch);
    if out.shape.dtype() != DType::F32 {
        generic(
            alpha,
            activation,
            (a, b, [a_transposed, b_transposed]),
            bias,
            residual,
            out,
            (m, k, n),
            out_batch,
            [&sa, &sb],
        );
        return Ok(());
    }
    // A transposed A's batch elements are not rows of one taller matrix.
    let (m, a_batch, b_batch, out_batch) = if a_transposed {
        (m, a_batch, b_batch, out_batch)
    } else {
        super::matmul::batch_plan(m, a_batch, b_batch, out_batch)
    };
    let sa = broadcast_strides(a_batch, out_batch);
    let sb = broadcast_strides(b_batch, out_batch);
    let in_gemm = activation.and_then(gemm_activation);
    // Half-precision weights are converted as they are packed.
    // Weights packed ahead are read as they are (B is then one 2-D matrix).
    let packed = if b_transposed {
        None
    } else {
        crate::prepack::operand_for(ctx.packed_b, &b)
    };
    let b_format = match (packed, b.shape.dtype()) {
        (Some((_, format)), _) => format,
        (None, DType::F16) => BFormat::F16,
        (None, DType::BF16) => BFormat::BF16,
        (None, _) => BFormat::F32,
    };
    let b_base = packed.map_or(b.ptr, |(panels, _)| panels.cast::<u8>());
    let b_size = b.shape.dtype().size_in_bytes();
    let (a_base, b_base, c_base) = (a.ptr as usize, b_base as usize, out.ptr as usize);
    let (bias_ptr, residual_ptr) = (
        bias.map(|s| s.ptr as usize),
        residual.map(|r| r.ptr as usize),
    );
    let count: usize = out_batch.iter().product();
    let product = |bi: usize| {
        let [ab, bb] = strided_offsets(out_batch, [&sa, &sb], bi);
        let c_off = bi * m * n;
        // SAFETY: batch elements of A, B, the output and the residual lie inside them.
        unsafe {
            Gemm {
                m,
                n,
                k,
                a: (a_base as *const f32).add(ab as usize * m * k),
                lda: if a_transposed { m } else { k },
                b: (b_base as *const u8)
                    .add(bb as usize * k * n * b_size)
                    .cast::<f32>(),
                ldb: if b_transposed { k } else { n },
                a_transposed,
                b_transposed,
                b_format,
                c: (c_base as *mut f32).add(c_off),
                ldc: n,
                accumulate: false,
                epilogue: Epilogue {
                    alpha: alpha as f32,
                    bias: bias_ptr.map(|p| p as *const f32),
                    row_bias: None,
                    row_affine: None,
                    activation: in_gemm,
                    residual: if activation.is_some() && in_gemm.is_none() {
                        None
                    } else {
                        residual_ptr.map(|r| ((r as *const f32).add(c_off), n))
                    },
                },
            }
        }
    };
    // SAFETY: the plan never places this output over its operands.
    unsafe { sgemm_batch(count, &product, ctx.pool, ctx.gemm, ctx.bf16_products)? };
    if let (Some(act), None) = (activation, in_gemm) {
        // An activation the GEMM does not apply: finish here.
        for i in 0..count * m * n {
            let mut v = f64::from(out.get::<f32>(i));
            v = f64::from(unary_f64(act, v) as f32);
            if let Some(r) = residual {
                v += f64::from(r.get::<f32>(i));
            }
            out.set(i, v as f32);
        }
    }
    Ok(())
}

/// `(m, k, n)` and the batch dims of A and B, with transposed operands read as
/// [`geometry`](super::matmul::geometry) reads plain ones (both have rank 2 or more).
fn geometry<'a>(
    a: &Src<'a>,
    b: &Src<'a>,
    [a_transposed, b_transposed]: [bool; 2],
) -> (usize, usize, usize, &'a [usize], &'a [usize]) {
    let (m, k, n, a_batch, b_batch) = super::matmul::geometry(a, b);
    let (m, k) = if a_transposed { (k, m) } else { (m, k) };
    let n = if b_transposed {
        b.shape.dims()[b.shape.rank() - 2]
    } else {
        n
    };
    (m, k, n, a_batch, b_batch)
}

/// Any float dtype: the product in `f64`, then each epilogue step rounded to the dtype.
#[allow(clippy::too_many_arguments)]
fn generic(
    alpha: f64,
    activation: Option<UnaryOp>,
    (a, b, [a_transposed, b_transposed]): (Src, Src, [bool; 2]),
    bias: Option<Src>,
    residual: Option<Src>,
    out: Dst,
    (m, k, n): (usize, usize, usize),
    out_batch: &[usize],
    strides: [&[isize; MAX_RANK]; 2],
) {
    with_dtype!(out.shape.dtype(), T => {
        let round = |v: f64| T::from_f64(v).to_f64();
        for_each_strided(out_batch, strides, [0, 0], |bi, [ab, bb]| {
            for i in 0..m {
                for j in 0..n {
                    let mut acc = 0.0;
                    for p in 0..k {
                        let ai = if a_transposed { p * m + i } else { i * k + p };
                        let bi = if b_transposed { j * k + p } else { p * n + j };
                        acc += a.f64::<T>(ab as usize * m * k + ai)
                            * b.f64::<T>(bb as usize * k * n + bi);
                    }
                    let mut v = round(acc);
                    if alpha != 1.0 {
                        v = round(v * alpha);
                    }
                    if let Some(bias) = bias {
                        v = round(v + bias.f64::<T>(j));
                    }
                    if let Some(act) = activation {
                        v = round(unary_f64(act, v));
                    }
                    let o = bi * m * n + i * n + j;
                    if let Some(r) = residual {
                        v = round(v + r.f64::<T>(o));
                    }
                    out.set(o, T::from_f64(v));
                }
            }
        });
    })
}

/// Elements per chunk of an elementwise region: every register of a chunk stays in
/// L1.
const CHUNK: usize = 512;
/// Chunks per pool task: claiming a task per 512 elements cost more than a
/// memory-bound step (a product over 2M values: 1.06 ms with a task per chunk, 0.57
/// ms with tasks of 16 chunks).
const CHUNKS_PER_TASK: usize = 16;

/// Per-thread scratch floats a region with `registers` registers needs.
pub(crate) fn region_scratch_floats(registers: usize) -> usize {
    registers * CHUNK
}

/// How one region input maps output positions to its own.
#[derive(Clone, Copy)]
enum Access {
    /// Same shape as the output.
    Same,
    /// Output position `p` reads value `(p / inner) % len`: the input's dims, less
    /// leading and trailing 1s, equal a run of the output's dims, and `inner` is the
    /// product of the output dims after that run (1 for a suffix such as a bias,
    /// the pixels of a plane for a per-channel `[1, C, 1, 1]` scale).
    Blocks { len: usize, inner: usize },
    /// Output position `p` reads value `((p / (row * repeat)) * row + p % row) %
    /// len`: a run of `row` values (the last axis) repeated `repeat` times along
    /// the axes before it, then the next run (a blocked value's per-channel
    /// operand, `[1, c / 16, 1, 16]`: a block's 16 values at each of its pixels).
    Rows {
        len: usize,
        row: usize,
        repeat: usize,
    },
    /// Anything else: the output's dims with adjacent axes merged where the input
    /// walks them as one (see [`crate::tensor::coalesce`]), and the input's strides
    /// along them.
    Strided {
        rank: usize,
        dims: [usize; MAX_RANK],
        strides: [isize; MAX_RANK],
    },
}

/// A region's operands, shared by its chunk tasks.
struct Region<'a, 'b> {
    inputs: &'b [Src<'a>],
    out: Dst<'a>,
    access: [Access; MAX_REGION_INPUTS],
}

// SAFETY: tasks read the inputs and write disjoint chunks of the output.
unsafe impl Sync for Region<'_, '_> {}

/// Evaluates an `Op::Elementwise` region.
pub(crate) fn elementwise(steps: &[EwStep], inputs: &[Src], out: Dst, ctx: &Ctx) -> Result<()> {
    if out.shape.dtype() != DType::F32 {
        elementwise_generic(steps, inputs, out);
        return Ok(());
    }
    let dims = out.shape.dims();
    let total = out.len;
    let mut access = [Access::Same; MAX_REGION_INPUTS];
    let n_in = inputs.len();
    for (slot, x) in access.iter_mut().zip(inputs) {
        *slot = if x.len == total {
            Access::Same
        } else if let Some(inner) = block_inner(x.shape.dims(), dims) {
            Access::Blocks {
                len: x.len.max(1),
                inner,
            }
        } else if let Some((row, repeat)) = repeated_rows(x.shape.dims(), dims) {
            Access::Rows {
                len: x.len,
                row,
                repeat,
            }
        } else {
            let strides = broadcast_strides(x.shape.dims(), dims);
            let (rank, dims, [strides]) = crate::tensor::coalesce(dims, [&strides]);
            Access::Strided {
                rank,
                dims,
                strides,
            }
        };
    }
    let chunks = total.div_ceil(CHUNK);
    // A one-value operand is read as a scalar by the binary steps that take it with a
    // full register, rather than filled into a register of its own each chunk (a
    // region of many constants then kept too many registers for L1).
    let mut scalar = [None; MAX_REGION_INPUTS];
    for (slot, x) in scalar.iter_mut().zip(inputs) {
        if x.len == 1 {
            *slot = Some(x.get::<f32>(0));
        }
    }
    let scalar_of = |r: u16| scalar.get(usize::from(r)).copied().flatten();
    let mut filled = [false; MAX_REGION_INPUTS];
    for (r, f) in filled.iter_mut().enumerate().take(n_in) {
        *f = scalar[r].is_none();
    }
    for step in steps {
        match *step {
            EwStep::Unary(_, a) => {
                if usize::from(a) < n_in {
                    filled[usize::from(a)] = true;
                }
            }
            EwStep::Binary(_, a, b) => {
                if scalar_of(a).is_some() && scalar_of(b).is_some() {
                    filled[usize::from(a)] = true;
                    filled[usize::from(b)] = true;
                }
            }
        }
    }
    let region = Region {
        inputs,
        out,
        access,
    };
    let task = |t: usize, thread: usize| {
        let Region {
            inputs,
            out,
            access,
        } = &region;
        // SAFETY: one task per thread index at a time.
        let (_, regs) = unsafe { ctx.gemm.parts(thread) };
        for chunk in t * CHUNKS_PER_TASK..((t + 1) * CHUNKS_PER_TASK).min(chunks) {
            let start = chunk * CHUNK;
            let len = CHUNK.min(total - start);
            for (r, x) in inputs.iter().enumerate() {
                if filled[r] {
                    load(x, access[r], start, &mut regs[r * CHUNK..r * CHUNK + len]);
                }
            }
            for (s, step) in steps.iter().enumerate() {
                let (before, after) = regs.split_at_mut((n_in + s) * CHUNK);
                let dst = &mut after[..len];
                let reg = |i: u16| &before[usize::from(i) * CHUNK..usize::from(i) * CHUNK + len];
                match *step {
                    EwStep::Unary(op, a) => unary_chunk(op, reg(a), dst),
                    EwStep::Binary(op, a, b) => match (scalar_of(a), scalar_of(b)) {
                        (None, Some(y)) => binary_scalar_chunk(op, reg(a), y, false, dst),
                        (Some(x), None) => binary_scalar_chunk(op, reg(b), x, true, dst),
                        _ => binary_chunk(op, reg(a), reg(b), dst),
                    },
                }
            }
            let last = (n_in + steps.len() - 1) * CHUNK;
            // SAFETY: chunk `chunk` of the output; every read of the inputs for this
            // chunk is done (an input may share the output's bytes when the op runs
            // in place).
            unsafe {
                std::ptr::copy_nonoverlapping(
                    regs[last..].as_ptr(),
                    out.ptr.cast::<f32>().add(start),
                    len,
                )
            };
        }
    };
    let threads = if total >= 1 << 15 {
        ctx.gemm.threads()
    } else {
        1
    };
    ctx.pool
        .run(chunks.div_ceil(CHUNKS_PER_TASK), threads, &task)
}

/// The `inner` of [`Access::Blocks`] for an input of dims `xd` broadcast to `dims`, if
/// it has that form.
fn block_inner(xd: &[usize], dims: &[usize]) -> Option<usize> {
    if xd.len() > dims.len() {
        return None;
    }
    // Align right, as broadcasting does; missing leading dims are 1.
    let pad = dims.len() - xd.len();
    let dim = |i: usize| if i < pad { 1 } else { xd[i - pad] };
    let Some(first) = (0..dims.len()).find(|&i| dim(i) != 1) else {
        // One value for every position.
        return Some(dims.iter().product::<usize>().max(1));
    };
    let last = (0..dims.len()).rev().find(|&i| dim(i) != 1)?;
    if (first..=last).any(|i| dim(i) != dims[i]) {
        return None;
    }
    Some(dims[last + 1..].iter().product())
}

/// The `row` and `repeat` of [`Access::Rows`] for an input of dims `xd` broadcast
/// to `dims`, if it has that form: its last axis whole, then axes of 1 that the
/// output repeats it along, then a run of whole axes after leading 1s.
fn repeated_rows(xd: &[usize], dims: &[usize]) -> Option<(usize, usize)> {
    if xd.len() > dims.len() || dims.len() < 2 {
        return None;
    }
    let pad = dims.len() - xd.len();
    let dim = |i: usize| if i < pad { 1 } else { xd[i - pad] };
    let last = dims.len() - 1;
    let row = dims[last];
    if dim(last) != row || row == 0 {
        return None;
    }
    let mut axis = last;
    let mut repeat = 1;
    while axis > 0 && dim(axis - 1) == 1 {
        repeat *= dims[axis - 1];
        axis -= 1;
    }
    // Before the repeated axes: whole axes back to the input's first non-1 one.
    let first = (0..axis).find(|&i| dim(i) != 1).unwrap_or(axis);
    let whole = (first..axis).all(|i| dim(i) == dims[i]);
    (repeat > 1 && whole).then_some((row, repeat))
}

fn load(x: &Src, access: Access, start: usize, reg: &mut [f32]) {
    let base = x.ptr.cast::<f32>();
    match access {
        Access::Same => {
            // SAFETY: positions start.. of an input of the output's size.
            unsafe { std::ptr::copy_nonoverlapping(base.add(start), reg.as_mut_ptr(), reg.len()) };
        }
        Access::Blocks { len, inner: 1 } => {
            // Contiguous stretches of the input, wrapping at its end.
            let mut at = start % len;
            let mut done = 0;
            while done < reg.len() {
                let n = (len - at).min(reg.len() - done);
                // SAFETY: positions at..at + n of an input of `len` values.
                unsafe { std::ptr::copy_nonoverlapping(base.add(at), reg[done..].as_mut_ptr(), n) };
                done += n;
                at = 0;
            }
        }
        Access::Blocks { len, inner } => {
            // Runs of one repeated value.
            let mut block = start / inner;
            let mut offset = start % inner;
            let mut done = 0;
            while done < reg.len() {
                let n = (inner - offset).min(reg.len() - done);
                reg[done..done + n].fill(x.get::<f32>(block % len));
                done += n;
                block += 1;
                offset = 0;
            }
        }
        Access::Rows { len, row, repeat } => {
            // Where `start` falls: value `j` of repetition `r` of row `q`; then
            // row by row, with no division.
            let rows = len / row;
            let mut j = start % row;
            let mut r = (start / row) % repeat;
            let mut q = (start / (row * repeat)) % rows;
            let mut done = 0;
            while done < reg.len() {
                let n = (row - j).min(reg.len() - done);
                // SAFETY: values `q * row + j..` up to the row's end, inside the
                // input's `rows * row`.
                let src = unsafe { std::slice::from_raw_parts(base.add(q * row + j), n) };
                reg[done..done + n].copy_from_slice(src);
                done += n;
                j = 0;
                r += 1;
                if r == repeat {
                    r = 0;
                    q = if q + 1 == rows { 0 } else { q + 1 };
                }
            }
        }
        Access::Strided {
            rank,
            dims,
            strides,
        } => {
            // Runs along the last (merged) axis: a fill where it is broadcast, a copy
            // where it is contiguous; the odometer moves once per run.
            let (dims, strides) = (&dims[..rank], &strides[..rank]);
            let last = rank - 1;
            let mut idx = [0usize; MAX_RANK];
            let mut rest = start;
            let mut offset = 0isize;
            for axis in (0..rank).rev() {
                idx[axis] = rest % dims[axis];
                offset += idx[axis] as isize * strides[axis];
                rest /= dims[axis];
            }
            let (row_len, step) = (dims[last], strides[last]);
            let mut done = 0;
            while done < reg.len() {
                let run = (row_len - idx[last]).min(reg.len() - done);
                let dst = &mut reg[done..done + run];
                match step {
                    0 => dst.fill(x.get::<f32>(offset as usize)),
                    1 => {
                        assert!(offset as usize + run <= x.len, "region read out of bounds");
                        // SAFETY: positions offset..offset + run lie inside the input
                        // (checked).
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                base.offset(offset),
                                dst.as_mut_ptr(),
                                run,
                            )
                        };
                    }
                    _ => {
                        for (j, v) in dst.iter_mut().enumerate() {
                            *v = x.get::<f32>((offset + j as isize * step) as usize);
                        }
                    }
                }
                done += run;
                idx[last] += run;
                offset += run as isize * step;
                let mut axis = last;
                while idx[axis] == dims[axis] {
                    offset -= strides[axis] * dims[axis] as isize;
                    idx[axis] = 0;
                    if axis == 0 {
                        break;
                    }
                    axis -= 1;
                    idx[axis] += 1;
                    offset += strides[axis];
                }
            }
        }
    }
}

vmath::multiversion! {
    /// `out = op(a)` over one chunk, vectorized for the CPU's widest instruction set.
    fn unary_chunk(op: UnaryOp, a: &[f32], out: &mut [f32]) {
        unary_body(op, a, out)
    }
}

/// One loop per op with the math written in place: a function value passed down
/// would be called per element, compiled without the caller's instruction set.
#[inline(always)]
fn unary_body(op: UnaryOp, a: &[f32], out: &mut [f32]) {
    macro_rules! each {
        (|$x:ident| $e:expr) => {
            for (o, &$x) in out.iter_mut().zip(a) {
                *o = $e;
            }
        };
    }
    match op {
        UnaryOp::Neg => each!(|x| -x),
        UnaryOp::Abs => each!(|x| x.abs()),
        UnaryOp::Exp => each!(|x| vmath::exp(x)),
        UnaryOp::Sqrt => each!(|x| x.sqrt()),
        UnaryOp::Rsqrt => each!(|x| 1.0 / x.sqrt()),
        UnaryOp::Reciprocal => each!(|x| 1.0 / x),
        UnaryOp::Tanh => each!(|x| vmath::tanh(x)),
        UnaryOp::Sigmoid => {
            out.copy_from_slice(a);
            vmath::sigmoid_in_place(out);
        }
        // NaN passes through, as the scalar definition has it.
        UnaryOp::Relu => each!(|x| if x < 0.0 { 0.0 } else { x }),
        UnaryOp::Gelu => each!(|x| vmath::gelu(x)),
        UnaryOp::GeluTanh => each!(|x| vmath::gelu_tanh(x)),
        UnaryOp::Silu => {
            out.copy_from_slice(a);
            vmath::silu_in_place(out);
        }
        UnaryOp::Relu6 => each!(|x| vmath::relu6(x)),
        UnaryOp::HardSwish => each!(|x| vmath::hard_swish(x)),
        UnaryOp::Erf => each!(|x| vmath::erf(x)),
        // Zero (of either sign) and NaN pass through, as the scalar definition has it.
        UnaryOp::Sign => each!(|x| if x > 0.0 {
            1.0
        } else if x < 0.0 {
            -1.0
        } else {
            x
        }),
        UnaryOp::Floor => each!(|x| x.floor()),
        UnaryOp::Ceil => each!(|x| x.ceil()),
        UnaryOp::Round => each!(|x| x.round_ties_even()),
        // The rest are rare in hot regions: the exact scalar definitions.
        other => each!(|x| unary_f64(other, f64::from(x)) as f32),
    }
}

vmath::multiversion! {
    /// `out = op(a, b)` over one chunk, vectorized for the CPU's widest instruction set.
    fn binary_chunk(op: BinaryOp, a: &[f32], b: &[f32], out: &mut [f32]) {
        binary_body(op, a, b, out)
    }
}

/// The match over the binary ops, each arm a loop written by the caller's `$each`
/// macro (`each!(|x, y| expr)`), so every loop form shares one list of ops.
macro_rules! binary_ops {
    ($op:expr, $each:ident) => {
        match $op {
            BinaryOp::Add => $each!(|x, y| x + y),
            BinaryOp::Sub => $each!(|x, y| x - y),
            BinaryOp::Mul => $each!(|x, y| x * y),
            BinaryOp::Div => $each!(|x, y| x / y),
            // NaN from either operand, as the scalar definition has it.
            BinaryOp::Max => $each!(|x, y| if x.is_nan() || y.is_nan() {
                f32::NAN
            } else {
                x.max(y)
            }),
            BinaryOp::Min => $each!(|x, y| if x.is_nan() || y.is_nan() {
                f32::NAN
            } else {
                x.min(y)
            }),
            other => $each!(|x, y| binary_f64(other, f64::from(x), f64::from(y)) as f32),
        }
    };
}

vmath::multiversion! {
    /// `out = op(a, s)`, or `op(s, a)` when `scalar_first`, over one chunk.
    fn binary_scalar_chunk(op: BinaryOp, a: &[f32], s: f32, scalar_first: bool, out: &mut [f32]) {
        if op == BinaryOp::Pow && !scalar_first && small_power(a, s, out) {
            return;
        }
        if scalar_first {
            binary_scalar_body(op, a, s, |v, s| (s, v), out)
        } else {
            binary_scalar_body(op, a, s, |v, s| (v, s), out)
        }
    }
}

/// [`binary_body`] with one operand a scalar; `order` puts the pair in the op's
/// order.
#[inline(always)]
fn binary_scalar_body(
    op: BinaryOp,
    a: &[f32],
    s: f32,
    order: impl Fn(f32, f32) -> (f32, f32),
    out: &mut [f32],
) {
    macro_rules! each {
        (|$x:ident, $y:ident| $e:expr) => {
            for (o, &v) in out.iter_mut().zip(a) {
                let ($x, $y) = order(v, s);
                *o = $e;
            }
        };
    }
    binary_ops!(op, each)
}

/// `out = a^s` as products when `s` is 1, 2, 3 or 4 (exported RMS norms square,
/// GPT-2's GELU cubes): the general power goes through `f64` per element, 40 times
/// slower. `x * x` is the correctly rounded square, as `powf` gives; the cube and
/// fourth power round twice, within an ulp of it. False for any other exponent.
#[inline(always)]
fn small_power(a: &[f32], s: f32, out: &mut [f32]) -> bool {
    let pairs = out.iter_mut().zip(a);
    match s {
        1.0 => out.copy_from_slice(a),
        2.0 => pairs.for_each(|(o, &x)| *o = x * x),
        3.0 => pairs.for_each(|(o, &x)| *o = x * x * x),
        4.0 => pairs.for_each(|(o, &x)| {
            let x2 = x * x;
            *o = x2 * x2
        }),
        _ => return false,
    }
    true
}

#[inline(always)]
fn binary_body(op: BinaryOp, a: &[f32], b: &[f32], out: &mut [f32]) {
    macro_rules! each {
        (|$x:ident, $y:ident| $e:expr) => {
            for (o, (&$x, &$y)) in out.iter_mut().zip(a.iter().zip(b)) {
                *o = $e;
            }
        };
    }
    binary_ops!(op, each)
}

/// Any float dtype, element by element in `f64` with each step rounded.
fn elementwise_generic(steps: &[EwStep], inputs: &[Src], out: Dst) {
    let dims = out.shape.dims();
    let mut strides = [[0isize; MAX_RANK]; MAX_REGION_INPUTS];
    for (st, x) in strides.iter_mut().zip(inputs) {
        *st = broadcast_strides(x.shape.dims(), dims);
    }
    with_dtype!(out.shape.dtype(), T => {
        let mut regs = [0.0f64; MAX_REGION_REGISTERS];
        let mut idx = [0usize; MAX_RANK];
        for o in 0..out.len {
            let mut rest = o;
            for axis in (0..dims.len()).rev() {
                idx[axis] = rest % dims[axis].max(1);
                rest /= dims[axis].max(1);
            }
            for (r, x) in inputs.iter().enumerate() {
                let at: isize = (0..dims.len()).map(|a| idx[a] as isize * strides[r][a]).sum();
                regs[r] = x.f64::<T>(at as usize);
            }
            for (s, step) in steps.iter().enumerate() {
                let v = match *step {
                    EwStep::Unary(op, a) => unary_f64(op, regs[usize::from(a)]),
                    EwStep::Binary(op, a, b) => binary_f64(op, regs[usize::from(a)], regs[usize::from(b)]),
                };
                regs[inputs.len() + s] = T::from_f64(v).to_f64();
            }
            out.set(o, T::from_f64(regs[inputs.len() + steps.len() - 1]));
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlx_ir::Shape;

    #[test]
    fn repeated_rows_are_found_only_in_their_form() {
        // A blocked per-channel operand, of one image's blocks and of two.
        assert_eq!(
            repeated_rows(&[1, 3, 1, 16], &[2, 3, 10, 16]),
            Some((16, 10))
        );
        assert_eq!(
            repeated_rows(&[2, 3, 1, 16], &[2, 3, 10, 16]),
            Some((16, 10))
        );
        assert_eq!(repeated_rows(&[3, 1, 16], &[2, 3, 10, 16]), Some((16, 10)));
        // Not repeated, or not whole between.
        assert_eq!(repeated_rows(&[2, 3, 10, 16], &[2, 3, 10, 16]), None);
        assert_eq!(repeated_rows(&[1, 2, 1, 16], &[2, 3, 10, 16]), None);
        assert_eq!(repeated_rows(&[1, 3, 1, 8], &[2, 3, 10, 16]), None);
        assert_eq!(repeated_rows(&[16], &[2, 16]), Some((16, 2)));
    }

    #[test]
    fn repeated_rows_load_as_broadcasting_says() {
        // `[1, 3, 1, 4]` over `[2, 3, 5, 4]`, from every start and length.
        let (dims, xd) = ([2, 3, 5, 4], [1, 3, 1, 4]);
        let values: Vec<f32> = (0..12).map(|i| i as f32).collect();
        let shape = Shape::new(&xd, rlx_ir::DType::F32);
        let x = Src {
            ptr: values.as_ptr().cast(),
            shape: &shape,
            len: values.len(),
        };
        let (row, repeat) = repeated_rows(&xd, &dims).unwrap();
        let access = Access::Rows {
            len: values.len(),
            row,
            repeat,
        };
        let total: usize = dims.iter().product();
        let want: Vec<f32> = (0..total)
            .map(|p| {
                let (j, k) = (p % 4, (p / 20) % 3);
                values[k * 4 + j]
            })
            .collect();
        for start in 0..total {
            for len in [1, 3, 4, 7, 21, total - start] {
                let len = len.min(total - start);
                let mut reg = vec![f32::NAN; len];
                load(&x, access, start, &mut reg);
                assert_eq!(reg, want[start..start + len], "from {start}, {len} values");
            }
        }
    }
}
