//! Single-precision GEMM, `C = epilogue(A · B)`, row-major with arbitrary row strides.
//!
//! Goto-style blocking: `B` is packed `kc x nc` at a time into `NR`-wide panels (the
//! block sizes come from [`blocking`]), `A` is read in place `mc x kc` at a time, `MR`
//! rows per kernel call, and a register-blocked micro-kernel
//! (AVX-512, AVX2+FMA or portable, chosen at run time) computes `MR x NR` tiles. The
//! epilogue (scale, bias, activation, residual) is applied to each tile right after its
//! last `K` block, while the tile is still in L1. Work is split across the thread pool
//! by columns (or rows, for tall-thin problems); every thread packs into its own
//! scratch, so nothing is allocated per call.

mod amx;
mod blocking;
mod epilogue;
mod gemv;
pub(crate) use epilogue::{
    RowAffine, activate_and_add, activate_and_add_lanes, affine_scatter_row, has_lanes_form,
};
#[cfg(target_arch = "x86_64")]
pub(crate) use epilogue::{activate_lanes_avx2, activate_lanes_avx512};
mod kernels;
mod pack;

pub(crate) use amx::available as amx_available;
#[cfg(test)]
use kernels::available as available_kernels;
use kernels::{Ahead, KernelFn};
pub(crate) use kernels::{MicroKernel, best as best_kernel};
pub(crate) use pack::transpose_8x8_f32;

use crate::pool::ThreadPool;
use blocking::{Blocking, KC_MAX};
use rlx_ir::Result;
use std::cell::UnsafeCell;

/// Depth of the `K` slices [`packed_few_rows`] walks a panel in: a slice stays in L1
/// while every row tile reads it.
const FEW_ROWS_KC: usize = 192;
/// Up to this many rows of `A` per thread, a row-major `B` is read without packing.
const IN_PLACE_B_MAX_ROWS: usize = 256;

/// An elementwise function applied in the epilogue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Activation {
    /// Exact GELU, `x Φ(x)`.
    Gelu,
    /// Tanh-approximated GELU.
    GeluTanh,
    /// `max(x, 0)`.
    Relu,
    /// `x σ(x)`.
    Silu,
    /// `min(max(x, 0), 6)`.
    Relu6,
    /// `x relu6(x + 3) / 6`.
    HardSwish,
}

/// What happens to each output value `v = (A·B)[i, j]` before it is stored:
/// `post((act(v * alpha + bias[j] + row_bias[i]) + residual[i, j]) * scale[i] +
/// shift[i])`, the last step with `row_affine`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Epilogue {
    pub alpha: f32,
    pub bias: Option<*const f32>,
    /// One value per row of `C` (a convolution's bias: its rows are output
    /// channels).
    pub row_bias: Option<*const f32>,
    /// `(scale, shift, post)`: after the residual, `post(v * scale[i] + shift[i])`
    /// (a batch norm and activation after a convolution's residual add).
    pub row_affine: Option<(*const f32, *const f32, Option<Activation>)>,
    pub activation: Option<Activation>,
    /// `(pointer, row stride)` of an `m x n` matrix added last.
    pub residual: Option<(*const f32, usize)>,
}

impl Epilogue {
    /// Just the product.
    pub const NONE: Epilogue = Epilogue {
        alpha: 1.0,
        bias: None,
        row_bias: None,
        row_affine: None,
        activation: None,
        residual: None,
    };

    fn is_identity(&self) -> bool {
        self.alpha == 1.0
            && self.bias.is_none()
            && self.row_bias.is_none()
            && self.row_affine.is_none()
            && self.activation.is_none()
            && self.residual.is_none()
    }
}

/// The storage format of `B`'s elements.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum BFormat {
    /// `f32`.
    F32,
    /// IEEE half precision.
    F16,
    /// bfloat16.
    BF16,
    /// Rows of blocks in a quantized format: `b` points at the packed bytes, and
    /// `ldb` counts values (a row of `ldb` values takes `format.row_bytes(ldb)`
    /// bytes), so element `(r, c)` of the stored matrix is element `r * ldb + c`.
    Quant(rlx_ir::QuantFormat),
    /// `f32`, already packed by [`pack_b_panels`] for a kernel `nr` columns wide:
    /// the panel of columns `q * nr ..` starts at `b + q * nr * k` and holds `k`
    /// groups of `nr` values (zero past the last column); `ldb` is `n`. Read in
    /// place with no packing pass: one contiguous stream per panel. `streamed` says
    /// the panels come from memory (weights packed ahead), so the kernel prefetches
    /// rows ahead; panels a kernel just packed into its scratch are in cache, and
    /// there the prefetches only take load slots (8x32 tiles in L1: 7% slower).
    Packed { nr: usize, streamed: bool },
    /// Packed like [`BFormat::Packed`], with each value stored as a signed byte `q`
    /// and its column's scale apart: `B[p, j] = q as f32 * scales[j]` (see
    /// [`quantize_b_panels`], which stores only matrices this reproduces bit for
    /// bit). `b` points at the bytes; `scales` holds one value per column of every
    /// panel (zero past `n`). A block is converted into `f32` panels as it is packed,
    /// so the weights stream from memory at a quarter of the bytes.
    PackedI8 { nr: usize, scales: *const f32 },
}

// SAFETY: the scales pointer is only read, like `Gemm`'s operand pointers.
unsafe impl Send for BFormat {}
// SAFETY: as above.
unsafe impl Sync for BFormat {}

/// One GEMM problem. `A[i, p]` is `a[i * lda + p]`, or `a[p * lda + i]` when
/// `a_transposed`; `B[p, j]` is `b[p * ldb + j]`, or `b[j * ldb + p]` when
/// `b_transposed`; `C[i, j]` is `c[i * ldc + j]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Gemm {
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub a: *const f32,
    pub lda: usize,
    /// `A` is stored transposed: each block of it is packed into rows before use.
    pub a_transposed: bool,
    pub b: *const f32,
    pub ldb: usize,
    pub b_transposed: bool,
    /// How `b`'s elements are stored (`b` then points at `u16` values for the half
    /// formats, converted to `f32` as they are packed).
    pub b_format: BFormat,
    pub c: *mut f32,
    pub ldc: usize,
    /// Add the product to `C` instead of overwriting it.
    pub accumulate: bool,
    pub epilogue: Epilogue,
}

// SAFETY: a `Gemm` is a description of memory the caller owns for the duration of the
// call; threads write disjoint tiles of `c` and only read `a`, `b` and the epilogue.
unsafe impl Send for Gemm {}
// SAFETY: as above.
unsafe impl Sync for Gemm {}

/// Per-thread scratch, sized once when a program is compiled: GEMM packing buffers
/// plus `extra` floats for other kernels that run inside pool tasks.
pub(crate) struct GemmScratch {
    /// Each thread's floats (cache-line aligned; huge pages where they are large).
    per_thread: Vec<UnsafeCell<rlx_driver::AlignedBytes>>,
    /// Floats of each thread's GEMM buffer (before `extra`).
    gemm_floats: usize,
    extra: usize,
    /// Whether the buffers are sized for the AMX path (only where the CPU has it).
    amx: bool,
    /// One buffer all threads of a product share: the operand every task reads,
    /// packed once ([`amx::SHARED_BYTES`] with the AMX path, else empty).
    shared: UnsafeCell<rlx_driver::AlignedBytes>,
}

// SAFETY: thread `t` of a pool job only touches `per_thread[t]`, and the pool gives each
// thread index to one thread at a time; the shared buffer serves one product at a
// time, whose threads write disjoint parts of it before any reads it.
unsafe impl Sync for GemmScratch {}

impl Clone for GemmScratch {
    fn clone(&self) -> Self {
        GemmScratch::build(self.per_thread.len(), self.extra, self.amx)
    }
}

/// Floats in a 64-byte cache line.
const LINE_FLOATS: usize = 16;

impl GemmScratch {
    /// Buffers for `threads` threads, each with `extra` more floats, for `f32`
    /// products.
    #[cfg(test)]
    pub fn new(threads: usize, extra: usize) -> GemmScratch {
        Self::build(threads, extra, false)
    }

    /// As [`GemmScratch::new`], with room for bfloat16 products on AMX tiles where
    /// the CPU has them.
    pub fn with_amx(threads: usize, extra: usize) -> GemmScratch {
        Self::build(threads, extra, true)
    }

    fn build(threads: usize, extra: usize, amx: bool) -> GemmScratch {
        let amx = amx && amx::available();
        let gemm_floats = scratch_floats(amx);
        let len = gemm_floats + extra;
        GemmScratch {
            per_thread: (0..threads.max(1))
                .map(|_| UnsafeCell::new(rlx_driver::AlignedBytes::zeroed(len * 4)))
                .collect(),
            gemm_floats,
            extra,
            amx,
            shared: UnsafeCell::new(rlx_driver::AlignedBytes::zeroed(shared_bytes(amx))),
        }
    }

    /// As [`GemmScratch::new`] (or [`GemmScratch::with_amx`] when `amx`), but a size
    /// that overflows or an allocation that fails is an
    /// [`rlx_ir::Error::OutOfMemory`] ("gemm scratch") instead of an abort.
    pub fn try_new(threads: usize, extra: usize, amx: bool) -> rlx_ir::Result<GemmScratch> {
        let threads = threads.max(1);
        let amx = amx && amx::available();
        let gemm_floats = scratch_floats(amx);
        let len = gemm_floats.checked_add(extra);
        let out_of_memory = |floats: Option<usize>| rlx_ir::Error::OutOfMemory {
            tensor: format!("gemm scratch ({threads} threads)"),
            bytes: floats
                .and_then(|n| n.checked_mul(4 * threads))
                .unwrap_or(usize::MAX),
        };
        let len = len.ok_or_else(|| out_of_memory(None))?;
        let mut per_thread = Vec::new();
        per_thread
            .try_reserve_exact(threads)
            .map_err(|_| out_of_memory(Some(len)))?;
        let bytes = len.checked_mul(4).ok_or_else(|| out_of_memory(None))?;
        for _ in 0..threads {
            let buf = rlx_driver::AlignedBytes::try_zeroed(bytes, "gemm scratch")
                .map_err(|_| out_of_memory(Some(len)))?;
            per_thread.push(UnsafeCell::new(buf));
        }
        let shared = rlx_driver::AlignedBytes::try_zeroed(shared_bytes(amx), "gemm scratch")
            .map_err(|_| rlx_ir::Error::OutOfMemory {
                tensor: "gemm scratch (shared)".into(),
                bytes: shared_bytes(amx),
            })?;
        Ok(GemmScratch {
            per_thread,
            gemm_floats,
            extra,
            amx,
            shared: UnsafeCell::new(shared),
        })
    }

    /// Whether the buffers have room for the AMX path.
    fn has_amx(&self) -> bool {
        self.amx
    }

    /// Floats each thread has beyond its GEMM buffer.
    pub fn extra(&self) -> usize {
        self.extra
    }

    /// The buffer every thread of a product shares, and its length in bytes. Only
    /// one product at a time may use it; its threads write disjoint parts of it, and
    /// read it only after the writes are done.
    fn shared(&self) -> (*mut u8, usize) {
        // SAFETY: only the pointer is taken; the contract governs its use.
        let bytes = unsafe { &mut *self.shared.get() };
        (bytes.as_mut_ptr(), bytes.len())
    }

    /// Threads it has buffers for.
    pub fn threads(&self) -> usize {
        self.per_thread.len()
    }

    /// Thread `t`'s GEMM buffer and its `extra` floats.
    ///
    /// # Safety
    /// Only thread `t` of the running job may call this, and only while no other
    /// reference from an earlier call is alive.
    #[allow(clippy::mut_from_ref)]
    pub unsafe fn parts(&self, t: usize) -> (&mut [f32], &mut [f32]) {
        // SAFETY: per the contract, no other reference to this buffer exists.
        let bytes = unsafe { &mut *self.per_thread[t].get() };
        // SAFETY: the buffer holds `gemm_floats + extra` floats' bytes, starts on a
        // cache line (so packed panels read with full-width vector loads never
        // straddle two lines), and any bytes are a valid f32.
        let all = unsafe {
            std::slice::from_raw_parts_mut(
                bytes.as_mut_ptr().cast::<f32>(),
                self.gemm_floats + self.extra,
            )
        };
        all.split_at_mut(self.gemm_floats)
    }
}

/// Floats of a GEMM buffer's regions: the short-row `A` panel, the packed `B` block,
/// the edge tile and a block of a transposed `A` packed into rows (up to `MC` rows,
/// and a tile's more of zeros), each a multiple of 16 floats so each starts on a cache
/// line.
fn scratch_regions() -> [usize; 4] {
    let (mr, tile) = kernels::largest_tiles();
    [
        (mr * KC_MAX).next_multiple_of(LINE_FLOATS),
        Blocking::max_b_block_floats().next_multiple_of(LINE_FLOATS),
        tile.next_multiple_of(LINE_FLOATS),
        ((blocking::MC + mr) * packed_a_stride(KC_MAX)).next_multiple_of(LINE_FLOATS),
    ]
}

/// The row stride of a block of `A` packed into rows of `kc` values: a cache line
/// more, so that rows a multiple of 1 KiB long do not all fall into one cache set.
fn packed_a_stride(kc: usize) -> usize {
    kc.next_multiple_of(LINE_FLOATS) + LINE_FLOATS
}

fn shared_bytes(amx: bool) -> usize {
    if amx { amx::SHARED_BYTES } else { 0 }
}

/// Floats of a thread's GEMM buffer: the `f32` path's regions, or the AMX path's
/// if it needs more.
fn scratch_floats(amx: bool) -> usize {
    let f32_path: usize = scratch_regions().iter().sum();
    if amx {
        f32_path.max(amx::scratch_floats())
    } else {
        f32_path
    }
}

/// Runs `g` with the best kernel for this CPU on up to `threads` threads of `pool`.
///
/// # Safety
/// The pointers of `g` must address matrices of the stated sizes and strides; `c` must
/// not overlap `a`, `b` or the epilogue's operands.
pub(crate) unsafe fn sgemm(g: &Gemm, pool: &ThreadPool, scratch: &GemmScratch) -> Result<()> {
    let kernel = kernels::for_width(g.n);
    if let BFormat::Packed { nr, .. } | BFormat::PackedI8 { nr, .. } = g.b_format
        && nr != kernel.nr
    {
        return Err(rlx_ir::Error::runtime(
            "matmul",
            format!(
                "B was packed for {nr}-column panels, the kernel for {} columns uses {}",
                g.n, kernel.nr
            ),
        ));
    }
    // SAFETY: forwarded contract.
    unsafe { sgemm_with(g, kernel, pool, scratch) }
}

/// [`sgemm`], or with `bf16_products` on a CPU with AMX and `B` in `f32`, the
/// product of the operands rounded to bfloat16, summed in `f32` on AMX tiles.
///
/// # Safety
/// As [`sgemm`].
pub(crate) unsafe fn sgemm_with_precision(
    g: &Gemm,
    pool: &ThreadPool,
    scratch: &GemmScratch,
    bf16_products: bool,
) -> Result<()> {
    if on_amx(g, scratch, bf16_products) {
        // SAFETY: forwarded contract; AMX is available (the scratch was sized for it)
        // and B is f32.
        unsafe { amx::sgemm(g, pool, scratch) }
    } else {
        // SAFETY: forwarded contract.
        unsafe { sgemm(g, pool, scratch) }
    }
}

/// Whether `g` runs on AMX tiles: bf16 products allowed, `B` in `f32`, and a scratch
/// sized for the AMX path (only where the CPU has it).
fn on_amx(g: &Gemm, scratch: &GemmScratch, bf16_products: bool) -> bool {
    bf16_products && g.b_format == BFormat::F32 && scratch.has_amx()
}

/// Multiply-adds below which one product of a batch is not split between threads:
/// the batch is, each product on one thread (an attention's 64 products of 128 x 128
/// x 64 took 1.45 ms one after another, each split, with two pool jobs apiece).
const BATCH_PARALLEL_MAX: usize = 1 << 22;

/// The `count` products `product(t)` (independent, writing disjoint outputs), as
/// [`sgemm_with_precision`] would run them one after another; small ones run whole
/// on one thread each, the batch spread over the pool.
///
/// # Safety
/// As [`sgemm`], for every product.
pub(crate) unsafe fn sgemm_batch(
    count: usize,
    product: &(dyn Fn(usize) -> Gemm + Sync),
    pool: &ThreadPool,
    scratch: &GemmScratch,
    bf16_products: bool,
) -> Result<()> {
    if count == 0 {
        return Ok(());
    }
    let first = product(0);
    if let BFormat::Packed { nr, .. } | BFormat::PackedI8 { nr, .. } = first.b_format
        && nr != kernels::for_width(first.n).nr
    {
        return Err(rlx_ir::Error::runtime(
            "matmul",
            format!(
                "B was packed for {nr}-column panels, the kernel for {} columns uses {}",
                first.n,
                kernels::for_width(first.n).nr
            ),
        ));
    }
    let threads = scratch.threads().min(pool.threads());
    let work = first.m * first.n * first.k.max(1);
    if count < 2 || threads < 2 || work > BATCH_PARALLEL_MAX {
        for t in 0..count {
            // SAFETY: forwarded contract.
            unsafe { sgemm_with_precision(&product(t), pool, scratch, bf16_products)? };
        }
        return Ok(());
    }
    let task = |t: usize, thread: usize| {
        let g = product(t);
        if g.m == 0 || g.n == 0 {
            return;
        }
        // SAFETY: each thread index runs one task at a time and owns its buffer; the
        // products write disjoint outputs.
        unsafe {
            let buf = scratch.parts(thread).0;
            if on_amx(&g, scratch, bf16_products) {
                amx::serial(&g, buf);
            } else {
                serial(&g, kernels::for_width(g.n), 0..g.m, 0..g.n, buf);
            }
        }
    };
    pool.run(count, threads, &task)
}

/// Bytes of L2 cache per core, as the blocking uses it.
pub(crate) fn l2_cache_bytes() -> usize {
    blocking::l2_bytes()
}

/// The panel width [`pack_b_panels`] packs for a product `n` columns wide.
pub(crate) fn packed_panel_width(n: usize) -> usize {
    kernels::for_width(n).nr
}

/// Length in floats of `B [k, n]` packed by [`pack_b_panels`].
pub(crate) fn packed_len(k: usize, n: usize) -> usize {
    let nr = packed_panel_width(n);
    // Saturates rather than wraps, so an impossible size fails the allocation's check.
    n.div_ceil(nr).saturating_mul(nr).saturating_mul(k)
}

/// Floats that hold `B [k, w]` packed by [`pack_b_panels`] for every width `w <= n`:
/// the panel width depends on the width (a narrower product may get wider panels).
pub(crate) fn packed_len_up_to(k: usize, n: usize) -> usize {
    // ceil(w / nr) * nr <= n + nr - 1 for every panel width nr.
    k.saturating_mul(n.saturating_add(kernels::widest_nr()))
}

/// Packs a row-major `B [k, n]` into `out` ([`packed_len`] floats) in the layout of
/// [`BFormat::Packed`], for the kernel [`sgemm`] picks for width `n`; returns `nr`.
pub(crate) fn pack_b_panels(b: &[f32], k: usize, n: usize, out: &mut [f32]) -> usize {
    let nr = packed_panel_width(n);
    pack_b_panels_for(nr, b, k, n, out);
    nr
}

/// Packs `B [k, n]` given transposed (row `j` of `bt`, `ldbt` floats apart, holds
/// column `j` of `B`) into `out` ([`packed_len`] floats) as [`pack_b_panels`] does,
/// through the GEMM's register transposes; returns `nr`.
///
/// # Safety
/// `bt` addresses `n` rows of `k` floats, `ldbt` floats apart.
pub(crate) unsafe fn pack_transposed_b_panels(
    bt: *const f32,
    ldbt: usize,
    (k, n): (usize, usize),
    out: &mut [f32],
) -> usize {
    let nr = packed_panel_width(n);
    let g = Gemm {
        m: 0,
        n,
        k,
        a: bt,
        lda: k,
        b: bt,
        ldb: ldbt,
        a_transposed: false,
        b_transposed: true,
        b_format: BFormat::F32,
        c: std::ptr::null_mut(),
        ldc: n,
        accumulate: false,
        epilogue: Epilogue::NONE,
    };
    if k > 0 && n > 0 {
        // SAFETY: the caller's rows are the whole of B; `out` holds the panels.
        unsafe { pack::pack_b(&g, 0, k, 0, n, nr, out) };
    }
    nr
}

/// [`pack_b_panels`] for panels `nr` wide; `out` holds `ceil(n / nr) * nr * k` floats.
fn pack_b_panels_for(nr: usize, b: &[f32], k: usize, n: usize, out: &mut [f32]) {
    if k == 0 {
        return; // an empty inner dim packs nothing
    }
    for (q, panel) in out.chunks_exact_mut(nr * k).enumerate() {
        let (c0, valid) = (q * nr, nr.min(n - q * nr));
        for (p, dst) in panel.chunks_exact_mut(nr).enumerate() {
            dst[..valid].copy_from_slice(&b[p * n + c0..p * n + c0 + valid]);
            dst[valid..].fill(0.0);
        }
    }
}

/// Bytes [`quantize_b_panels`] writes for `B [k, n]`: the signed bytes of every
/// panel, then (from a 64-byte boundary) one `f32` scale per panel column.
pub(crate) fn quantized_len(k: usize, n: usize) -> usize {
    let width = n
        .div_ceil(packed_panel_width(n))
        .saturating_mul(packed_panel_width(n));
    width
        .saturating_mul(k)
        .next_multiple_of(64)
        .saturating_add(width.saturating_mul(4))
}

/// Stores a row-major `B [k, n]` as signed bytes and one scale per column, packed for
/// the kernel [`sgemm`] picks for width `n` ([`BFormat::PackedI8`]), when every
/// column is `q * s` for bytes `q` and the column's scale `s = max |B[., j]| / 127`,
/// exactly, bit for bit (weights quantized per column and dequantized to `f32`, as
/// an int8 model's `Cast` and `Mul` make them). Returns `(nr, offset of the scales
/// in out)`, or `None` (with `out` in any state) when some value is not so.
/// `out` holds [`quantized_len`] bytes, 4-byte aligned.
pub(crate) fn quantize_b_panels(
    b: &[f32],
    k: usize,
    n: usize,
    out: &mut [u8],
) -> Option<(usize, usize)> {
    let nr = packed_panel_width(n);
    let width = n.div_ceil(nr) * nr;
    let scales_at = (width * k).next_multiple_of(64);
    if k == 0 || b.len() < k * n || out.len() < quantized_len(k, n) {
        return None;
    }
    let (bytes, rest) = out.split_at_mut(scales_at);
    // SAFETY: the caller's buffer is 4-byte aligned and 64 is a multiple of 4; `rest`
    // holds `width` f32 values.
    let scales = unsafe { std::slice::from_raw_parts_mut(rest.as_mut_ptr().cast::<f32>(), width) };
    for j in 0..width {
        let (panel, lane) = (j / nr, j % nr);
        let at = |p: usize| panel * nr * k + p * nr + lane;
        if j >= n {
            scales[j] = 0.0;
            (0..k).for_each(|p| bytes[at(p)] = 0);
            continue;
        }
        let column = |p: usize| b[p * n + j];
        let max = (0..k).fold(0.0f32, |m, p| m.max(column(p).abs()));
        // max / 127 rounds, and may miss the quantizer's scale by an ulp or two.
        let near = max / 127.0;
        let scale = [0, 1, -1, 2, -2].into_iter().find_map(|ulps: i32| {
            let scale = f32::from_bits(near.to_bits().checked_add_signed(ulps)?);
            let fits = (0..k).all(|p| byte_for(column(p), scale).is_some());
            (scale.is_finite() && fits).then_some(scale)
        })?;
        for p in 0..k {
            bytes[at(p)] = byte_for(column(p), scale)? as u8;
        }
        scales[j] = scale;
    }
    Some((nr, scales_at))
}

/// The byte `q` with `q as f32 * scale == v` bit for bit (a `-0.0` has none: bytes
/// convert to `+0.0`); a scale of 0 takes only `+0.0`.
fn byte_for(v: f32, scale: f32) -> Option<i8> {
    let q = if scale == 0.0 {
        0.0
    } else {
        (v / scale).round()
    };
    if !(-128.0..=127.0).contains(&q) {
        return None;
    }
    let q = q as i8;
    ((f32::from(q) * scale).to_bits() == v.to_bits()).then_some(q)
}

/// [`sgemm`] with an explicit micro-kernel (tests compare them all).
///
/// # Safety
/// As [`sgemm`]; the kernel must be supported by this CPU.
pub(crate) unsafe fn sgemm_with(
    g: &Gemm,
    kernel: MicroKernel,
    pool: &ThreadPool,
    scratch: &GemmScratch,
) -> Result<()> {
    if g.m == 0 || g.n == 0 {
        return Ok(());
    }
    let threads = scratch.threads().min(pool.threads());
    // Split the larger output dimension into one range per thread, in whole tiles.
    // Columns go in whole panels, or in steps of the narrowest partial kernel where B
    // is packed per call: 1024 columns then split 512 + 512 (ten 48-wide panels and a
    // 32-wide one each) rather than 528 + 496, which left one thread a panel more.
    let col_unit = match (g.b_format, kernel.partial.first()) {
        (BFormat::Packed { .. } | BFormat::PackedI8 { .. }, _) | (_, None) => kernel.nr,
        (_, Some(&(width, _))) => width,
    };
    let (split_cols, unit, extent) = if g.n >= g.m {
        (true, col_unit, g.n)
    } else {
        (false, kernel.mr, g.m)
    };
    let units = extent.div_ceil(unit);
    // Tasks claimed dynamically, shrinking as the work runs out: a core slowed by
    // another process then takes fewer of them, and the last ones claimed are small,
    // so the threads finish close together. Below ~64k multiply-adds a second thread
    // is not worth waking.
    let schedule = if threads > 1 && g.m * g.n * g.k.max(1) >= 1 << 16 {
        Trapezoid::new(units, threads)
    } else {
        Trapezoid::single(units)
    };
    let parts = schedule.tasks;
    let task = |t: usize, thread: usize| {
        let (first, last) = schedule.range(t);
        let (lo, hi) = (first * unit, (last * unit).min(extent));
        if lo >= hi {
            return;
        }
        let (rows, cols) = if split_cols {
            (0..g.m, lo..hi)
        } else {
            (lo..hi, 0..g.n)
        };
        // SAFETY: each thread index runs one task at a time and owns its buffer; tasks
        // write disjoint row or column ranges of C.
        unsafe { serial(g, kernel, rows, cols, scratch.parts(thread).0) };
    };
    if parts == 1 {
        task(0, 0);
        return Ok(());
    }
    pool.run(parts, threads, &task)
}

/// Trapezoid self-scheduling of `units` over threads: task sizes fall linearly from
/// half of each thread's share to a sixteenth of it, about `4 x threads` tasks in
/// all. Each thread re-reads the operand it does not split once per task (at most a
/// few MB, from the shared cache), which the even finish more than repays (MiniLM 8 x
/// 128 on 2 threads: 4-5% against 2 equal tasks).
#[derive(Clone, Copy, Debug)]
struct Trapezoid {
    units: usize,
    tasks: usize,
    /// Size of the first task.
    first: f64,
    /// How much each task is smaller than the one before.
    step: f64,
}

impl Trapezoid {
    fn new(units: usize, threads: usize) -> Trapezoid {
        let first = (units as f64 / (2 * threads) as f64).max(1.0);
        let last = (units as f64 / (16 * threads) as f64).clamp(1.0, first);
        let tasks = ((2 * units) as f64 / (first + last)).ceil().max(1.0) as usize;
        let step = if tasks > 1 {
            (first - last) / (tasks - 1) as f64
        } else {
            0.0
        };
        Trapezoid {
            units,
            tasks,
            first,
            step,
        }
    }

    /// One task over everything.
    fn single(units: usize) -> Trapezoid {
        Trapezoid {
            units,
            tasks: 1,
            first: units as f64,
            step: 0.0,
        }
    }

    /// Where task `t`'s units start.
    fn start(&self, t: usize) -> usize {
        if t >= self.tasks {
            return self.units;
        }
        let t = t as f64;
        let start = t * self.first - self.step * t * (t - 1.0) / 2.0;
        (start as usize).min(self.units)
    }

    /// Task `t`'s units (empty once the sizes have covered everything).
    fn range(&self, t: usize) -> (usize, usize) {
        (self.start(t), self.start(t + 1))
    }
}

/// `g` on the calling thread only (for kernels that already run inside pool tasks),
/// with `buf` from [`GemmScratch::parts`].
///
/// # Safety
/// As [`sgemm`].
pub(crate) unsafe fn sgemm_serial(g: &Gemm, buf: &mut [f32]) {
    if g.m > 0 && g.n > 0 {
        // SAFETY: forwarded contract; `buf` is a full GEMM buffer.
        unsafe { serial(g, kernels::for_width(g.n), 0..g.m, 0..g.n, buf) }
    }
}

/// Columns `cols` of `g` on the calling thread only, with `buf` from
/// [`GemmScratch::parts`]: the kernel is the one for the whole width `g.n` (so `B`
/// packed for it is read as packed), and `cols.start` a multiple of its panel width
/// where `B` is packed.
///
/// # Safety
/// As [`sgemm`]; `cols` lies within `0..g.n`.
pub(crate) unsafe fn sgemm_serial_columns(g: &Gemm, cols: std::ops::Range<usize>, buf: &mut [f32]) {
    let kernel = kernels::for_width(g.n);
    debug_assert!(cols.end <= g.n);
    if let BFormat::Packed { nr, .. } | BFormat::PackedI8 { nr, .. } = g.b_format {
        debug_assert!(nr == kernel.nr && cols.start.is_multiple_of(nr));
    }
    if g.m > 0 && !cols.is_empty() {
        // SAFETY: forwarded contract; `buf` is a full GEMM buffer.
        unsafe { serial(g, kernel, 0..g.m, cols, buf) }
    }
}

/// The blocked loops over one rectangle of `C`.
///
/// # Safety
/// As [`sgemm`]; `buf` holds at least `scratch_floats(false)` floats.
unsafe fn serial(
    g: &Gemm,
    kernel: MicroKernel,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    buf: &mut [f32],
) {
    if gemv::applies(g, &rows, &cols, buf.len()) {
        // SAFETY: forwarded contract; the vector fits `buf`.
        unsafe { gemv::run(g, rows, cols, buf) };
        return;
    }
    let (mr, nr) = (kernel.mr, kernel.nr);
    let blocks = if g.a_transposed {
        Blocking::with_packed_a(rows.len(), cols.len(), g.k, (mr, nr))
    } else {
        Blocking::new(rows.len(), cols.len(), g.k, (mr, nr))
    };
    let (mc_max, nc_max) = (blocks.mc, blocks.nc);
    let [a_floats, b_floats, tile_floats, _] = scratch_regions();
    let (a_edge, rest) = buf.split_at_mut(a_floats);
    let (b_pack, rest) = rest.split_at_mut(b_floats);
    let (tile, a_block) = rest.split_at_mut(tile_floats);
    if g.k == 0 {
        // An empty sum: C (or zeros) goes through the epilogue.
        for i in rows.clone() {
            for j in cols.clone() {
                // SAFETY: (i, j) is inside C.
                unsafe {
                    let c = g.c.add(i * g.ldc + j);
                    *c = if g.accumulate { *c } else { 0.0 };
                }
            }
        }
        // SAFETY: as above.
        unsafe { epilogue::apply(g, rows, cols) };
        return;
    }
    if matches!(g.b_format, BFormat::Packed { .. }) && rows.len() <= mc_max && !g.a_transposed {
        // SAFETY: forwarded contract.
        unsafe { packed_few_rows(g, kernel, rows, cols, a_edge, tile) };
        return;
    }
    let per_tile = epilogue::per_tile_avx2(g, nr);
    let mut jc = cols.start;
    while jc < cols.end {
        let nc = nc_max.min(cols.end - jc);
        let mut pc = 0;
        while pc < g.k {
            let kc = blocks.kc.min(g.k - pc);
            let last_k = pc + kc == g.k;
            let accumulate = pc > 0 || g.accumulate;
            // With few rows of A (up to the MiniLM-sized 128 per thread and a bit),
            // a B panel is reused too little to repay packing:
            // a row-major B is then read in place (only a last partial panel is
            // packed). With more rows, packing turns the strided first read of B into
            // a sequential one and the kernel reads L1-resident panels.
            let prepacked = matches!(g.b_format, BFormat::Packed { .. });
            let in_place = !g.b_transposed
                && g.b_format == BFormat::F32
                && rows.len() <= IN_PLACE_B_MAX_ROWS
                && !aliasing_stride(g.ldb);
            if prepacked {
                // Nothing to pack: the panels are read where they are.
            } else if in_place {
                let full = nc / nr * nr;
                if full < nc {
                    // SAFETY: the partial panel lies inside B; b_pack holds kc x NR.
                    unsafe {
                        pack::pack_b(
                            g,
                            pc,
                            kc,
                            jc + full,
                            nc - full,
                            nr,
                            &mut b_pack[full * kc..],
                        )
                    };
                }
            } else {
                // SAFETY: the block lies inside B; b_pack holds kc x nc floats.
                unsafe { pack::pack_b(g, pc, kc, jc, nc, nr, b_pack) };
            }
            let mut ic = rows.start;
            while ic < rows.end {
                let mc = mc_max.min(rows.end - ic);
                // A transposed A is read from rows packed here, padded with zero rows
                // to whole tiles.
                let a_rows = if g.a_transposed {
                    let padded = mc.next_multiple_of(mr);
                    // SAFETY: rows ic..ic+mc, columns pc..pc+kc lie inside A; the
                    // block region holds (MC + mr) x KC_MAX floats.
                    unsafe {
                        pack::pack_a_transposed(
                            g,
                            (ic, mc),
                            (pc, kc),
                            padded,
                            packed_a_stride(kc),
                            a_block,
                        )
                    };
                    Some((a_block.as_ptr(), ic))
                } else {
                    None
                };
                for jr in (0..nc).step_by(nr) {
                    let nr_eff = nr.min(nc - jr);
                    for ir in (0..mc).step_by(mr) {
                        let mr_eff = mr.min(mc - ir);
                        let (ci, cj) = (ic + ir, jc + jr);
                        let b_panel = if prepacked {
                            // SAFETY: panel (jc+jr)/nr, rows pc.., lies inside the
                            // packed B.
                            (unsafe { g.b.add((jc + jr) / nr * nr * g.k + pc * nr) }, nr)
                        } else if in_place && nr_eff == nr {
                            // SAFETY: rows pc.., columns jc+jr.., lie inside B.
                            (unsafe { g.b.add(pc * g.ldb + jc + jr) }, g.ldb)
                        } else {
                            (b_pack[jr * kc..].as_ptr(), nr)
                        };
                        // While the first row block reads a panel from memory, its
                        // row tiles after the first ask for the next panel's lines.
                        let tiles = mc.div_ceil(mr);
                        let ahead = if streamed(g.b_format) && ic == rows.start && ir > 0 {
                            let next = next_block_panel(
                                g,
                                nr,
                                (jc + jr, jc..jc + nc, cols.end),
                                (pc, kc, blocks.kc),
                            );
                            next.map_or(Ahead::NONE, |(at, lines)| {
                                Ahead::share(at, lines, (ir / mr - 1, tiles - 1))
                            })
                        } else {
                            Ahead::NONE
                        };
                        let step = TileStep {
                            at: (ci, cj),
                            size: (mr_eff, nr_eff),
                            depth: (pc, kc),
                            accumulate,
                            finish: last_k && per_tile,
                            ahead,
                        };
                        // Panels packed ahead come from memory on the first row block;
                        // ones packed here (or by the caller, just before) are in
                        // cache; rows of a B read in place lie far apart, and are
                        // prefetched ahead.
                        let run = if streamed(g.b_format) {
                            kernel.stream
                        } else if in_place && nr_eff == nr {
                            kernel.strided
                        } else {
                            kernel.run
                        };
                        // SAFETY: the tile is inside C and the panel holds kc rows.
                        unsafe {
                            tile_step(g, kernel, run, &step, (b_panel, a_rows), a_edge, tile)
                        };
                    }
                }
                if last_k && !per_tile && !g.epilogue.is_identity() {
                    // The block is final and still in cache: one pass over rows `nc`
                    // wide vectorizes the activation far better than one per tile.
                    // SAFETY: rows ic..ic+mc, columns jc..jc+nc, lie inside C.
                    unsafe { epilogue::apply(g, ic..ic + mc, jc..jc + nc) };
                }
                ic += mc;
            }
            pc += kc;
        }
        jc += nc;
    }
}

/// Whether rows `ldb` floats apart fall into few L1 sets: with a stride of a multiple
/// of 1 KiB the rows of a panel read in place share a quarter of the sets or fewer
/// (a multiple of 4 KiB: one), and the panel thrashes the cache. Measured with two
/// threads: 256x1024x2048 ran at 28% of peak in place and 62% packed; 256x256x2048
/// at 56% and 64%.
fn aliasing_stride(ldb: usize) -> bool {
    ldb.is_multiple_of(256)
}

/// [`serial`] for a packed `B` and rows that fit one block of `A`: each panel is
/// walked once from top to bottom, so `B` streams from memory in address order (the
/// product is bound by reading `B` when there are few rows), and every `FEW_ROWS_KC`
/// slice of it serves all row tiles from L1.
///
/// # Safety
/// As [`serial`]; `g.b_format` is `Packed` with the kernel's `nr`.
unsafe fn packed_few_rows(
    g: &Gemm,
    kernel: MicroKernel,
    rows: std::ops::Range<usize>,
    cols: std::ops::Range<usize>,
    a_edge: &mut [f32],
    tile: &mut [f32],
) {
    let (mr, nr) = (kernel.mr, kernel.nr);
    let per_tile = epilogue::per_tile_avx2(g, nr);
    let run = if streamed(g.b_format) {
        kernel.stream
    } else {
        kernel.run
    };
    let tiles = rows.len().div_ceil(mr);
    for jr in cols.clone().step_by(nr) {
        let nr_eff = nr.min(cols.end - jr);
        // SAFETY: panel jr / nr lies inside the packed B.
        let panel = unsafe { g.b.add(jr / nr * nr * g.k) };
        let mut pc = 0;
        while pc < g.k {
            let kc = FEW_ROWS_KC.min(g.k - pc);
            let accumulate = pc > 0 || g.accumulate;
            // The slice read after this one: further down the panel, or the top of
            // the next panel.
            let next = if pc + kc < g.k {
                Some((
                    panel.wrapping_add((pc + kc) * nr),
                    FEW_ROWS_KC.min(g.k - pc - kc),
                ))
            } else {
                (jr + nr < cols.end).then(|| (panel.wrapping_add(nr * g.k), FEW_ROWS_KC.min(g.k)))
            };
            for ci in rows.clone().step_by(mr) {
                let t = (ci - rows.start) / mr;
                // The first row tile reads the slice from memory, the others ask for
                // the next one's lines meanwhile.
                let ahead = match next {
                    Some((at, depth)) if streamed(g.b_format) && t > 0 => {
                        Ahead::share(at.cast::<u8>(), depth * nr * 4 / 64, (t - 1, tiles - 1))
                    }
                    _ => Ahead::NONE,
                };
                let step = TileStep {
                    at: (ci, jr),
                    size: (mr.min(rows.end - ci), nr_eff),
                    depth: (pc, kc),
                    accumulate,
                    finish: per_tile && pc + kc == g.k,
                    ahead,
                };
                // SAFETY: rows pc..pc+kc of the panel; the tile is inside C.
                let b_panel = (unsafe { panel.add(pc * nr) }, nr);
                // SAFETY: as above.
                unsafe { tile_step(g, kernel, run, &step, (b_panel, None), a_edge, tile) };
            }
            pc += kc;
        }
    }
    if !per_tile && !g.epilogue.is_identity() {
        // SAFETY: the rectangle lies inside C (at most MC rows: in L2 still).
        unsafe { epilogue::apply(g, rows, cols) };
    }
}

/// The packed `B` slice the blocked loops read after the panel at column `col`,
/// rows `pc..pc + kc`, in the column block `block` of a rectangle whose columns end
/// at `cols_end`, with `K` blocks `kc_max` deep: its first address and its 64-byte
/// lines. That is the block's next panel; after its last, the block's first panel
/// one `K` block down; after the last `K` block, the next block's first panel.
fn next_block_panel(
    g: &Gemm,
    nr: usize,
    (col, block, cols_end): (usize, std::ops::Range<usize>, usize),
    (pc, kc, kc_max): (usize, usize, usize),
) -> Option<(*const u8, usize)> {
    let panel_at = |col: usize, row: usize| g.b.wrapping_add(col / nr * nr * g.k + row * nr);
    let (at, depth) = if col + nr < block.end {
        (panel_at(col + nr, pc), kc)
    } else if pc + kc < g.k {
        (panel_at(block.start, pc + kc), kc_max.min(g.k - pc - kc))
    } else if block.end < cols_end {
        (panel_at(block.end, 0), kc_max.min(g.k))
    } else {
        return None;
    };
    Some((at.cast::<u8>(), depth * nr * 4 / 64))
}

/// Whether `B` is packed panels that come from memory (see [`BFormat::Packed`]).
fn streamed(format: BFormat) -> bool {
    matches!(format, BFormat::Packed { streamed: true, .. })
}

/// One micro-kernel call's place in the product.
struct TileStep {
    /// `(row, column)` of the tile's first element in `C`.
    at: (usize, usize),
    /// `(rows, columns)` of it that lie inside `C`.
    size: (usize, usize),
    /// `(first, count)` of the `K` range it multiplies.
    depth: (usize, usize),
    accumulate: bool,
    /// Whether the epilogue runs on this tile once it is stored (its last `K` range,
    /// in a product whose epilogue runs per tile).
    finish: bool,
    /// Lines of the `B` read next that the kernel asks for meanwhile.
    ahead: Ahead,
}

/// Multiplies rows `step.at.0..` of `A` over the step's `K` range by `b_panel`
/// (`(first row, row stride)`) into the tile of `C` at `step.at`: full row panels of
/// `A` are read in place and a short one is copied into zero-padded rows; a partial
/// tile goes through `tile`; the epilogue follows the last `K` range. `a_rows`, when
/// given, is a block of `A` already packed into rows of the step's `kc` values,
/// starting at the given row and padded with zero rows to whole tiles (a transposed
/// `A`), and is read instead of `A`.
///
/// # Safety
/// As [`serial`]; the panel holds the step's `kc` rows of `nr` values and the tile
/// lies inside `C`; a packed block holds the tile's rows.
#[allow(clippy::type_complexity)]
unsafe fn tile_step(
    g: &Gemm,
    kernel: MicroKernel,
    run: KernelFn,
    step: &TileStep,
    ((b_panel, ldb), a_rows): ((*const f32, usize), Option<(*const f32, usize)>),
    a_edge: &mut [f32],
    tile: &mut [f32],
) {
    let (mr, nr) = (kernel.mr, kernel.nr);
    let ((ci, cj), (mr_eff, nr_eff), (pc, kc)) = (step.at, step.size, step.depth);
    // A full-width edge of fewer rows has a kernel of its own that reads A in place.
    let row_edge = (mr_eff < mr && nr_eff == nr)
        .then(|| kernel.row_edges.get(mr_eff - 1).copied())
        .flatten();
    let (a_panel, lda) = if let Some((block, first_row)) = a_rows {
        // SAFETY: the block holds rows first_row.. of A's K range, padded to tiles.
        let stride = packed_a_stride(kc);
        (unsafe { block.add((ci - first_row) * stride) }, stride)
    } else if mr_eff == mr || row_edge.is_some() {
        // SAFETY: rows ci..ci+mr_eff (all the kernel reads), columns pc.., lie inside A.
        (unsafe { g.a.add(ci * g.lda + pc) }, g.lda)
    } else {
        // SAFETY: rows ci..ci+mr_eff lie inside A.
        unsafe { pack::pack_a_rows(g, ci, mr_eff, pc, kc, mr, a_edge) };
        (a_edge.as_ptr(), kc)
    };
    // SAFETY: A rows and the B panel hold kc values each; the tile is inside C (or the
    // temporary tile for edges).
    unsafe {
        let c_tile = g.c.add(ci * g.ldc + cj);
        if step.finish {
            // The next row tile's residual, while this one multiplies: the rows of a
            // tile are too many streams for the hardware prefetcher.
            epilogue::prefetch_residual(g, (ci + mr, cj), mr);
        }
        // A whole tile, or all rows of a last panel one of the partial kernels covers,
        // goes straight to C; any other edge goes through the temporary tile.
        let direct = if mr_eff < mr {
            row_edge
        } else if nr_eff == nr {
            Some(run)
        } else {
            kernel
                .partial
                .iter()
                .find(|&&(width, _)| width == nr_eff)
                .map(|&(_, narrow)| narrow)
        };
        if let Some(kernel_fn) = direct {
            kernel_fn(
                kc,
                a_panel,
                lda,
                b_panel,
                ldb,
                c_tile,
                g.ldc,
                step.accumulate,
                step.ahead,
            );
        } else {
            let edge = Edge {
                mr_eff,
                nr_eff,
                accumulate: step.accumulate,
            };
            edge_tile(
                kernel,
                kc,
                (a_panel, lda),
                (b_panel, ldb),
                (c_tile, g.ldc),
                edge,
                tile,
            );
        }
        if step.finish {
            #[cfg(target_arch = "x86_64")]
            if nr_eff == 16 {
                // The tile was just stored and is in L1; `per_tile` checked AVX2.
                epilogue::tile_avx2(g, (ci, cj), mr_eff);
                return;
            }
            // A last panel narrower than the kernel's.
            epilogue::apply(g, ci..ci + mr_eff, cj..cj + nr_eff);
        }
    }
}

/// The valid part of a partial tile.
struct Edge {
    mr_eff: usize,
    nr_eff: usize,
    accumulate: bool,
}

/// A partial tile: computed in `tile` at full size, then the valid part copied.
///
/// # Safety
/// As the micro-kernel; `c` addresses an `mr_eff x nr_eff` region with stride `ldc`.
unsafe fn edge_tile(
    kernel: MicroKernel,
    kc: usize,
    (a, lda): (*const f32, usize),
    (b, ldb): (*const f32, usize),
    (c, ldc): (*mut f32, usize),
    edge: Edge,
    tile: &mut [f32],
) {
    let Edge {
        mr_eff,
        nr_eff,
        accumulate,
    } = edge;
    let nr = kernel.nr;
    let tile = &mut tile[..kernel.mr * nr];
    tile.fill(0.0);
    for i in 0..mr_eff {
        for j in 0..nr_eff {
            // SAFETY: inside the valid region of C.
            tile[i * nr + j] = if accumulate {
                unsafe { *c.add(i * ldc + j) }
            } else {
                0.0
            };
        }
    }
    // The narrowest kernel that covers the valid columns: a 49-wide product's last
    // panel of one column then costs one vector of multiply-adds per row, not three.
    let run = kernel
        .partial
        .iter()
        .filter(|&&(width, _)| width >= nr_eff)
        .min_by_key(|&&(width, _)| width)
        .map_or(kernel.run, |&(_, narrow)| narrow);
    // SAFETY: `tile` is MR x NR with stride NR; a narrower kernel reads and writes
    // its leading columns.
    unsafe {
        run(
            kc,
            a,
            lda,
            b,
            ldb,
            tile.as_mut_ptr(),
            nr,
            accumulate,
            Ahead::NONE,
        )
    };
    for i in 0..mr_eff {
        for j in 0..nr_eff {
            // SAFETY: inside the valid region of C.
            unsafe { *c.add(i * ldc + j) = tile[i * nr + j] };
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// A uniform value in [-1, 1) from a linear congruential step of `seed`.
    pub(crate) fn lcg(seed: &mut u64) -> f32 {
        *seed = seed
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }

    fn reference(m: usize, n: usize, k: usize, a: &[f32], b: &[f32], bt: bool) -> Vec<f64> {
        let mut c = vec![0.0f64; m * n];
        for i in 0..m {
            for j in 0..n {
                let mut s = 0.0f64;
                for p in 0..k {
                    let bv = if bt { b[j * k + p] } else { b[p * n + j] };
                    s += f64::from(a[i * k + p]) * f64::from(bv);
                }
                c[i * n + j] = s;
            }
        }
        c
    }

    #[test]
    fn trapezoid_tasks_cover_every_unit_once_and_shrink() {
        for threads in [2, 3, 4, 8, 16, 64] {
            for units in [1, 2, 5, 7, 24, 96, 171, 1000, 4096] {
                let s = Trapezoid::new(units, threads);
                assert!(s.tasks >= 1 && s.tasks <= 4 * threads + 1, "{s:?}");
                let mut next = 0;
                let mut sizes = Vec::new();
                for t in 0..s.tasks {
                    let (lo, hi) = s.range(t);
                    assert_eq!(lo, next, "{s:?} task {t}");
                    assert!(hi >= lo);
                    sizes.push(hi - lo);
                    next = hi;
                }
                assert_eq!(next, units, "{s:?}");
                // Sizes never grow by more than the rounding of one unit, and the
                // first is about half a thread's share.
                assert!(sizes.windows(2).all(|w| w[1] <= w[0] + 1), "{sizes:?}");
                assert!(sizes[0] <= units.div_ceil(2 * threads).max(1), "{sizes:?}");
            }
        }
        let one = Trapezoid::single(10);
        assert_eq!((one.tasks, one.range(0)), (1, (0, 10)));
    }

    #[test]
    fn the_bound_for_any_width_holds_every_narrower_packing() {
        for n in 1..300 {
            for w in 1..=n {
                assert!(packed_len(7, w) <= packed_len_up_to(7, n), "{w} <= {n}");
            }
        }
    }

    #[test]
    fn every_kernel_matches_the_reference_on_awkward_shapes() {
        let pool = ThreadPool::new(3);
        let mut seed = 42u64;
        let shapes = [
            (1, 1, 1),
            (1, 384, 384),
            (7, 33, 5),
            (16, 384, 384),
            (13, 17, 300),
            (97, 65, 257),
            (128, 1536, 384),
            (200, 40, 600),
            (3, 1100, 70),
            (5, 7, 0),
            (50, 70, 512),
            (300, 500, 200),
            // Deeper than the deepest K block: the blocks accumulate into C.
            (37, 100, 3100),
            // Last panels 16 and 32 wide, for the partial-width kernels.
            (40, 112, 50),
            (64, 160, 70),
            (24, 1024, 40),
            // Last panels 8 and 24 wide (a masked last vector with AVX-512), one
            // accumulating over two K blocks.
            (40, 56, 30),
            (24, 600, 64),
            (30, 120, 1700),
        ];
        for kernel in available_kernels() {
            for &(m, n, k) in &shapes {
                for (at, bt) in [(false, false), (false, true), (true, false), (true, true)] {
                    let a: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
                    let b: Vec<f32> = (0..k * n).map(|_| lcg(&mut seed)).collect();
                    // A transposed A is stored as [k, m]: the same values moved.
                    let stored: Vec<f32> = if at {
                        (0..k * m).map(|q| a[(q % m) * k + q / m]).collect()
                    } else {
                        a.clone()
                    };
                    let want = reference(m, n, k, &a, &b, bt);
                    for threads in [1, 3] {
                        let mut c = vec![f32::NAN; m * n];
                        let g = Gemm {
                            m,
                            n,
                            k,
                            a: stored.as_ptr(),
                            lda: if at { m } else { k },
                            b: b.as_ptr(),
                            ldb: if bt { k } else { n },
                            a_transposed: at,
                            b_transposed: bt,
                            b_format: BFormat::F32,
                            c: c.as_mut_ptr(),
                            ldc: n,
                            accumulate: false,
                            epilogue: Epilogue::NONE,
                        };
                        let scratch = GemmScratch::new(threads, 0);
                        // SAFETY: all buffers match the stated sizes.
                        unsafe { sgemm_with(&g, kernel, &pool, &scratch) }.unwrap();
                        for (idx, (&got, &w)) in c.iter().zip(&want).enumerate() {
                            let tol = 1e-5 * (k as f64).sqrt().max(1.0) * 4.0;
                            assert!(
                                (f64::from(got) - w).abs() <= tol,
                                "{} {m}x{n}x{k} at={at} bt={bt} threads={threads} at {idx}: {got} vs {w}",
                                kernel.name
                            );
                        }
                    }
                }
            }
        }
    }

    #[test]
    fn ahead_shares_cover_the_lines_once_in_order() {
        let base = 4096usize as *const u8;
        for (lines, parts) in [(0, 3), (7, 3), (2, 5), (576, 7), (2304, 1)] {
            let (mut next, mut total) = (base, 0);
            for part in 0..parts {
                let share = Ahead::share(base, lines, (part, parts));
                assert_eq!(share.at, next, "{lines} lines in {parts}: part {part}");
                next = share.at.wrapping_add(share.lines * 64);
                total += share.lines;
            }
            assert_eq!(total, lines);
        }
    }

    #[test]
    fn the_next_panel_is_the_one_the_blocked_loops_read_next() {
        let (k, n, nr): (usize, usize, usize) = (3000, 200, 48);
        let packed = vec![0.0f32; n.div_ceil(nr) * nr * k];
        let mut c = vec![0.0f32; n];
        let g = Gemm {
            m: 1,
            n,
            k,
            a: packed.as_ptr(),
            lda: k,
            b: packed.as_ptr(),
            ldb: n,
            a_transposed: false,
            b_transposed: false,
            b_format: BFormat::Packed { nr, streamed: true },
            c: c.as_mut_ptr(),
            ldc: n,
            accumulate: false,
            epilogue: Epilogue::NONE,
        };
        let at = |panel: usize, row: usize| {
            packed
                .as_ptr()
                .wrapping_add(panel * nr * k + row * nr)
                .cast::<u8>()
        };
        let lines = |depth: usize| depth * nr * 4 / 64;
        // The block's next panel, at the same depth.
        assert_eq!(
            next_block_panel(&g, nr, (0, 0..96, n), (0, 1500, 1500)),
            Some((at(1, 0), lines(1500)))
        );
        // After the block's last panel: its first, one K block down.
        assert_eq!(
            next_block_panel(&g, nr, (48, 0..96, n), (0, 1500, 1500)),
            Some((at(0, 1500), lines(1500)))
        );
        // After the last K block: the next block's first panel, at the top.
        assert_eq!(
            next_block_panel(&g, nr, (48, 0..96, n), (1500, 1500, 1500)),
            Some((at(2, 0), lines(1500)))
        );
        // Nothing after the rectangle's last panel.
        assert_eq!(
            next_block_panel(&g, nr, (192, 192..200, n), (1500, 1500, 1500)),
            None
        );
    }

    #[test]
    fn b_packed_ahead_gives_the_same_products_with_epilogue_and_accumulation() {
        let pool = ThreadPool::new(3);
        let mut seed = 5u64;
        // Few rows (one block of A: panels walked top to bottom) and many (blocked).
        let shapes = [
            (1, 384, 384),
            (7, 33, 5),
            (16, 1536, 384),
            (13, 100, 450),
            (96, 96, 200),
            (97, 65, 257),
            (200, 130, 600),
            (120, 100, 1700),
            // Last panels 8 and 24 wide.
            (50, 104, 300),
            (120, 120, 1700),
        ];
        let shapes: [(usize, usize, usize); 10] = shapes;
        for kernel in available_kernels() {
            for &(m, n, k) in &shapes {
                let a: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
                let b: Vec<f32> = (0..k * n).map(|_| lcg(&mut seed)).collect();
                let bias: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
                let start: Vec<f32> = (0..m * n).map(|_| lcg(&mut seed)).collect();
                let mut packed = vec![f32::NAN; n.div_ceil(kernel.nr) * kernel.nr * k];
                pack_b_panels_for(kernel.nr, &b, k, n, &mut packed);
                let product = reference(m, n, k, &a, &b, false);
                // The last case (scale 1, bias and ReLU) takes the per-tile epilogue on
                // AVX2.
                let cases = [
                    (false, false, false),
                    (true, false, false),
                    (false, true, false),
                    (true, true, true),
                ];
                for (accumulate, with_bias, relu) in cases {
                    let alpha = if with_bias && !relu { 0.5 } else { 1.0 };
                    for threads in [1, 3] {
                        let mut c = start.clone();
                        let g = Gemm {
                            m,
                            n,
                            k,
                            a: a.as_ptr(),
                            lda: k,
                            b: packed.as_ptr(),
                            ldb: n,
                            a_transposed: false,
                            b_transposed: false,
                            b_format: BFormat::Packed {
                                nr: kernel.nr,
                                streamed: true,
                            },
                            c: c.as_mut_ptr(),
                            ldc: n,
                            accumulate,
                            epilogue: Epilogue {
                                alpha,
                                bias: with_bias.then_some(bias.as_ptr()),
                                row_bias: None,
                                row_affine: None,
                                activation: relu.then_some(Activation::Relu),
                                residual: None,
                            },
                        };
                        // SAFETY: all buffers match the stated sizes and layouts.
                        unsafe { sgemm_with(&g, kernel, &pool, &GemmScratch::new(threads, 0)) }
                            .unwrap();
                        for (idx, &got) in c.iter().enumerate() {
                            let mut want = product[idx];
                            if accumulate {
                                want += f64::from(start[idx]);
                            }
                            if with_bias {
                                want = want * f64::from(alpha) + f64::from(bias[idx % n]);
                            }
                            if relu {
                                want = want.max(0.0);
                            }
                            let tol = 1e-5 * (k as f64).sqrt().max(1.0) * 4.0;
                            assert!(
                                (f64::from(got) - want).abs() <= tol,
                                "{} {m}x{n}x{k} acc={accumulate} bias={with_bias} \
                                 threads={threads} at {idx}: {got} vs {want}",
                                kernel.name
                            );
                        }
                    }
                }
            }
        }
    }

    /// `B [k, n]` whose column `j` is bytes times a scale, with a byte of 127 or -127
    /// in every column (as per-column quantization makes them).
    fn column_quantized(k: usize, n: usize, seed: &mut u64) -> Vec<f32> {
        let scales: Vec<f32> = (0..n).map(|_| (lcg(seed) + 1.5) * 0.01).collect();
        let mut b: Vec<f32> = (0..k * n)
            .map(|i| f32::from((lcg(seed) * 127.0).round() as i8) * scales[i % n])
            .collect();
        for j in 0..n {
            let p = j * 7 % k;
            b[p * n + j] = if j % 2 == 0 { 127.0 } else { -127.0 } * scales[j];
        }
        b
    }

    #[test]
    fn b_stored_as_bytes_gives_the_products_of_its_values() {
        let pool = ThreadPool::new(3);
        let mut seed = 17u64;
        let kernel = kernels::best();
        // Few rows and many, K deeper than one block, widths that end in a partial
        // panel, the MiniLM shapes.
        let shapes = [
            (1, 384, 384),
            (7, 33, 5),
            (128, 1536, 384),
            (128, 384, 1536),
            (97, 65, 257),
            (200, 130, 600),
            (37, 100, 3100),
        ];
        for &(m, n, k) in &shapes {
            let nr = packed_panel_width(n);
            let a: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
            let b = column_quantized(k, n, &mut seed);
            let bias: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
            // 4-byte aligned storage for the bytes and scales.
            let mut storage = vec![0u32; quantized_len(k, n).div_ceil(4)];
            // SAFETY: the u32 storage viewed as its bytes.
            let bytes = unsafe {
                std::slice::from_raw_parts_mut(storage.as_mut_ptr().cast::<u8>(), storage.len() * 4)
            };
            let (got_nr, scales_at) = quantize_b_panels(&b, k, n, bytes).expect("quantized");
            assert_eq!(got_nr, nr);
            // SAFETY: the scales lie inside the storage.
            let format = BFormat::PackedI8 {
                nr,
                scales: unsafe { bytes.as_ptr().add(scales_at) }.cast::<f32>(),
            };
            let product = |c: &mut [f32], bias: Option<*const f32>| Gemm {
                m,
                n,
                k,
                a: a.as_ptr(),
                lda: k,
                b: bytes.as_ptr().cast::<f32>(),
                ldb: n,
                a_transposed: false,
                b_transposed: false,
                b_format: format,
                c: c.as_mut_ptr(),
                ldc: n,
                accumulate: false,
                epilogue: Epilogue {
                    bias,
                    ..Epilogue::NONE
                },
            };
            let want = reference(m, n, k, &a, &b, false);
            for (with_bias, threads) in [(false, 1), (true, 3)] {
                let mut c = vec![f32::NAN; m * n];
                let g = product(&mut c, with_bias.then_some(bias.as_ptr()));
                // SAFETY: all buffers match the stated sizes and layouts.
                unsafe { sgemm_with(&g, kernel, &pool, &GemmScratch::new(threads, 0)) }.unwrap();
                for (idx, &got) in c.iter().enumerate() {
                    let mut want = want[idx];
                    if with_bias {
                        want += f64::from(bias[idx % n]);
                    }
                    let tol = 1e-5 * (k as f64).sqrt().max(1.0) * 4.0;
                    assert!(
                        (f64::from(got) - want).abs() <= tol,
                        "{m}x{n}x{k} threads={threads} at {idx}: {got} vs {want}"
                    );
                }
            }
            // Read back element by element, the same values as the f32 matrix.
            let g = product(&mut [], None);
            let mut row = vec![0.0f32; n];
            for p in [0, k / 2, k - 1] {
                // SAFETY: row p lies inside B.
                unsafe { pack::read_b_run(&g, p * n, &mut row) };
                assert_eq!(row, b[p * n..(p + 1) * n], "row {p} of {k}x{n}");
            }
        }
    }

    #[test]
    fn only_values_that_bytes_and_a_scale_reproduce_exactly_are_stored_as_bytes() {
        let (k, n) = (40, 20);
        let mut seed = 9u64;
        let mut out = vec![0u32; quantized_len(k, n).div_ceil(4)];
        // SAFETY: the u32 storage viewed as its bytes.
        let out =
            unsafe { std::slice::from_raw_parts_mut(out.as_mut_ptr().cast::<u8>(), out.len() * 4) };
        let b = column_quantized(k, n, &mut seed);
        assert!(quantize_b_panels(&b, k, n, out).is_some());
        // A column of zeros is bytes of 0 at scale 0.
        let mut zeros = b.clone();
        (0..k).for_each(|p| zeros[p * n + 3] = 0.0);
        assert!(quantize_b_panels(&zeros, k, n, out).is_some());
        // Plain floats, a value off the grid by one ulp, a negative zero, a NaN, an
        // infinity: all stay f32.
        let plain: Vec<f32> = (0..k * n).map(|_| lcg(&mut seed)).collect();
        assert!(quantize_b_panels(&plain, k, n, out).is_none());
        for (at, value) in [
            (5 * n + 2, f32::from_bits(b[5 * n + 2].to_bits() + 1)),
            (7 * n + 3, -0.0),
            (1, f32::NAN),
            (n + 1, f32::INFINITY),
        ] {
            let mut off = if value == 0.0 {
                zeros.clone()
            } else {
                b.clone()
            };
            off[at] = value;
            assert!(
                quantize_b_panels(&off, k, n, out).is_none(),
                "{value} at {at}"
            );
        }
    }

    #[test]
    fn a_packed_b_reads_back_element_by_element() {
        let (k, n, nr): (usize, usize, usize) = (9, 70, 32);
        let mut seed = 3u64;
        let b: Vec<f32> = (0..k * n).map(|_| lcg(&mut seed)).collect();
        let mut packed = vec![f32::NAN; n.div_ceil(nr) * nr * k];
        pack_b_panels_for(nr, &b, k, n, &mut packed);
        let mut g = Gemm {
            m: 1,
            n,
            k,
            a: std::ptr::null(),
            lda: k,
            b: packed.as_ptr(),
            ldb: n,
            a_transposed: false,
            b_transposed: false,
            b_format: BFormat::Packed { nr, streamed: true },
            c: std::ptr::null_mut(),
            ldc: n,
            accumulate: false,
            epilogue: Epilogue::NONE,
        };
        let (mut from_packed, mut from_plain) = (vec![0.0; 40 * 5], vec![0.0; 40 * 5]);
        // SAFETY: the block lies inside B in both layouts.
        unsafe { pack::pack_b(&g, 2, 5, 20, 40, 4, &mut from_packed) };
        g.b = b.as_ptr();
        g.b_format = BFormat::F32;
        // SAFETY: as above.
        unsafe { pack::pack_b(&g, 2, 5, 20, 40, 4, &mut from_plain) };
        assert_eq!(from_packed, from_plain);
    }

    #[test]
    fn half_precision_b_is_converted_while_packing() {
        let pool = ThreadPool::new(2);
        let mut seed = 99u64;
        for &(m, n, k) in &[
            (5, 70, 33),
            (130, 100, 200),
            (300, 50, 400),
            (100, 60, 1600),
        ] {
            let a: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
            let b32: Vec<f32> = (0..k * n).map(|_| lcg(&mut seed)).collect();
            let halves: Vec<half::f16> = b32.iter().map(|&x| half::f16::from_f32(x)).collect();
            let brains: Vec<half::bf16> = b32.iter().map(|&x| half::bf16::from_f32(x)).collect();
            let cases: [(BFormat, *const f32, Vec<f32>); 2] = [
                (
                    BFormat::F16,
                    halves.as_ptr().cast(),
                    halves.iter().map(|h| h.to_f32()).collect(),
                ),
                (
                    BFormat::BF16,
                    brains.as_ptr().cast(),
                    brains.iter().map(|h| h.to_f32()).collect(),
                ),
            ];
            for (format, ptr, exact) in cases {
                for bt in [false, true] {
                    // The transposed layout of the same values.
                    let (ptr, exact, ldb, _keep16, _keepb) = if bt {
                        let t16: Vec<half::f16> =
                            (0..n * k).map(|i| halves[(i % k) * n + i / k]).collect();
                        let tb: Vec<half::bf16> =
                            (0..n * k).map(|i| brains[(i % k) * n + i / k]).collect();
                        let texact: Vec<f32> =
                            (0..n * k).map(|i| exact[(i % k) * n + i / k]).collect();
                        let p: *const f32 = if format == BFormat::F16 {
                            t16.as_ptr().cast()
                        } else {
                            tb.as_ptr().cast()
                        };
                        (p, texact, k, t16, tb)
                    } else {
                        (ptr, exact.clone(), n, Vec::new(), Vec::new())
                    };
                    let want = reference(m, n, k, &a, &exact, bt);
                    let mut c = vec![0.0f32; m * n];
                    let g = Gemm {
                        m,
                        n,
                        k,
                        a: a.as_ptr(),
                        lda: k,
                        b: ptr,
                        ldb,
                        a_transposed: false,
                        b_transposed: bt,
                        b_format: format,
                        c: c.as_mut_ptr(),
                        ldc: n,
                        accumulate: false,
                        epilogue: Epilogue::NONE,
                    };
                    // SAFETY: all buffers match the stated sizes and formats.
                    unsafe { sgemm(&g, &pool, &GemmScratch::new(2, 0)) }.unwrap();
                    for (idx, (&got, &w)) in c.iter().zip(&want).enumerate() {
                        assert!(
                            (f64::from(got) - w).abs() <= 1e-5 * (k as f64).sqrt() * 4.0,
                            "{format:?} bt={bt} {m}x{n}x{k} at {idx}: {got} vs {w}"
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn the_epilogue_scales_adds_bias_activates_and_adds_the_residual() {
        let pool = ThreadPool::new(2);
        let mut seed = 7u64;
        let (m, n, k) = (37, 70, 45);
        let a: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
        let b: Vec<f32> = (0..k * n).map(|_| lcg(&mut seed)).collect();
        let bias: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
        let res: Vec<f32> = (0..m * n).map(|_| lcg(&mut seed)).collect();
        let row_bias: Vec<f32> = (0..m).map(|_| lcg(&mut seed)).collect();
        let (scale, shift): (Vec<f32>, Vec<f32>) =
            (0..m).map(|_| (lcg(&mut seed), lcg(&mut seed))).unzip();
        let base = reference(m, n, k, &a, &b, false);
        // A scale of 1 with ReLU or nothing takes the per-tile path on AVX2; 0.5 (or
        // GELU) the pass over blocks. Both with and without a batch norm after the
        // residual.
        let cases = [0.5f32, 1.0]
            .into_iter()
            .flat_map(|alpha| {
                [None, Some(Activation::Relu), Some(Activation::Gelu)].map(|act| (alpha, act))
            })
            .flat_map(|(alpha, act)| [None, Some(Activation::Relu)].map(|post| (alpha, act, post)))
            .flat_map(|case| [false, true].map(|affine| (case, affine)));
        for kernel in available_kernels() {
            for ((alpha, act, post), affine) in cases.clone() {
                let mut c = vec![0.0f32; m * n];
                let g = Gemm {
                    m,
                    n,
                    k,
                    a: a.as_ptr(),
                    lda: k,
                    b: b.as_ptr(),
                    ldb: n,
                    a_transposed: false,
                    b_transposed: false,
                    b_format: BFormat::F32,
                    c: c.as_mut_ptr(),
                    ldc: n,
                    accumulate: false,
                    epilogue: Epilogue {
                        alpha,
                        bias: Some(bias.as_ptr()),
                        row_bias: Some(row_bias.as_ptr()),
                        row_affine: affine.then_some((scale.as_ptr(), shift.as_ptr(), post)),
                        activation: act,
                        residual: Some((res.as_ptr(), n)),
                    },
                };
                let scratch = GemmScratch::new(2, 0);
                // SAFETY: all buffers match the stated sizes.
                unsafe { sgemm_with(&g, kernel, &pool, &scratch) }.unwrap();
                for i in 0..m {
                    for j in 0..n {
                        let mut v = base[i * n + j] * f64::from(alpha)
                            + f64::from(bias[j])
                            + f64::from(row_bias[i]);
                        v = match act {
                            None => v,
                            Some(Activation::Relu) => v.max(0.0),
                            Some(_) => 0.5 * v * (1.0 + libm::erf(v / std::f64::consts::SQRT_2)),
                        };
                        v += f64::from(res[i * n + j]);
                        if affine {
                            v = v * f64::from(scale[i]) + f64::from(shift[i]);
                            if post.is_some() {
                                v = v.max(0.0);
                            }
                        }
                        let got = f64::from(c[i * n + j]);
                        assert!(
                            (got - v).abs() < 1e-4,
                            "{} alpha {alpha} {act:?} affine {affine} {post:?} ({i},{j}): {got} vs {v}",
                            kernel.name
                        );
                    }
                }
            }
        }
    }
}
