//! `C = epilogue(A · B)` on Intel AMX tiles, the operands rounded to bfloat16 and the
//! products summed in `f32`: the reduced-precision path a program compiled with
//! bf16 products allowed takes on CPUs that have AMX (about sixteen times the
//! multiply-adds per cycle of AVX-512 in `f32`).
//!
//! Blocks of `A` and `B` are converted as they are packed (round to nearest even,
//! NaN kept quiet) into the tiles' layouts: a block of `A` as 16-row tiles of 32
//! values, a block of `B` as 16-column tiles in pairs of rows (each 32-bit lane holds
//! `B[2p, j]` and `B[2p + 1, j]`). Both are padded with zeros to whole 32 x 32 output
//! blocks and 32-deep steps. Each output block is four accumulator tiles, loaded from
//! `C` (or zeroed) before a `K` block and stored after it; edge tiles go through a
//! buffer. The epilogue then runs over each finished block of `C` while it is in
//! cache, as on the `f32` path. The tiles count denormal operands and products
//! (magnitudes below about 1.2e-38) as zero (measured on this CPU: a bfloat16 of
//! 9.2e-40 times 1 gives 0, and 1e-20 times 1e-20 gives 0).

use super::{Gemm, GemmScratch, Trapezoid, epilogue};
// SAFETY: the tiles are only read while the product that packed them runs.
unsafe impl Send for Prepacked {}
// SAFETY: as above.
unsafe impl Sync for Prepacked {}
use crate::pool::ThreadPool;
use rlx_ir::Result;

/// Depth of one packed `K` block (a multiple of 32): a weight gradient's 2048 rows
/// in one block, so `C` is loaded and stored once.
const KC: usize = 2048;
/// Columns of `B` packed at once (a multiple of 32).
const NC: usize = 512;
/// Rows of `A` packed at once (a multiple of 32).
const MC: usize = 128;
/// `u16` values in one tile (16 rows of 64 bytes).
const TILE_U16: usize = 512;
/// Bytes from one 32-deep step of a packed panel to the next.
const STEP_BYTES: usize = TILE_U16 * 2;

/// Floats of per-thread scratch the AMX path needs: the packed `B` and `A` blocks and
/// four edge tiles of `C`.
pub(super) const fn scratch_floats() -> usize {
    (KC * NC + MC * KC) / 2 + 4 * 256
}

/// Whether the products may use AMX tiles ([`crate::isa`]: the CPU has them, the OS
/// lets this process use them, and no switch turned them off).
pub(crate) fn available() -> bool {
    crate::isa::isa().amx_bf16
}

/// Bytes of the buffer the threads of one product share: the operand every task
/// reads (all of `A` when the tasks split the columns, all of `B` when they split the
/// rows) is packed there once, when it fits, instead of once per task.
pub(super) const SHARED_BYTES: usize = 4 << 20;

/// An operand packed whole, shared by every task: its 16-wide panels lie `steps`
/// tiles apart, each holding its 32-deep steps in order.
#[derive(Clone, Copy)]
pub(super) struct Prepacked {
    tiles: *const u16,
    steps: usize,
}

/// Which operand, if any, is packed once for all tasks.
#[derive(Clone, Copy)]
pub(super) enum Shared {
    None,
    A(Prepacked),
    B(Prepacked),
}

/// Runs `g` on AMX tiles on up to `threads` threads of `pool`.
///
/// # Safety
/// As [`super::sgemm`]; [`available`] must be true, and `g.b_format` must be `F32`.
pub(super) unsafe fn sgemm(g: &Gemm, pool: &ThreadPool, scratch: &GemmScratch) -> Result<()> {
    if g.m == 0 || g.n == 0 {
        return Ok(());
    }
    let threads = scratch.threads().min(pool.threads());
    let (split_cols, extent) = if g.n >= g.m {
        (true, g.n)
    } else {
        (false, g.m)
    };
    let unit = 32;
    let units = extent.div_ceil(unit);
    let schedule = if threads > 1 && g.m * g.n * g.k.max(1) >= 1 << 18 {
        Trapezoid::new(units, threads)
    } else {
        Trapezoid::single(units)
    };
    // The operand every task reads whole is packed once, in parallel, when it fits.
    let steps = g.k.div_ceil(32);
    let panels = if split_cols { g.m } else { g.n }.div_ceil(32) * 2;
    let (shared_ptr, shared_len) = scratch.shared();
    let shared = if schedule.tasks > 1 && g.k > 0 && panels * steps * TILE_U16 * 2 <= shared_len {
        let tiles = shared_ptr.cast::<u16>() as usize;
        let pack_panels = |first: usize, last: usize| {
            let tiles = tiles as *mut u16;
            // SAFETY: panels first..last lie inside the shared buffer (checked above),
            // and no other task writes them.
            unsafe {
                x86::pack_panels(
                    g,
                    split_cols,
                    (first..last, 0..steps),
                    tiles.add(first * steps * TILE_U16),
                    steps,
                )
            }
        };
        let per_task = panels.div_ceil(2 * threads).max(1);
        let tasks = panels.div_ceil(per_task);
        pool.run(tasks, threads, &|t, _| {
            pack_panels(t * per_task, ((t + 1) * per_task).min(panels))
        })?;
        let packed = Prepacked {
            tiles: tiles as *const u16,
            steps,
        };
        if split_cols {
            Shared::A(packed)
        } else {
            Shared::B(packed)
        }
    } else {
        Shared::None
    };
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
        // write disjoint row or column ranges of C and only read the shared operand.
        unsafe { x86::serial(g, rows, cols, shared, scratch.parts(thread).0) };
    };
    if schedule.tasks == 1 {
        task(0, 0);
        return Ok(());
    }
    pool.run(schedule.tasks, threads, &task)
}

/// All of `g` on the calling thread, packing both operands itself.
///
/// # Safety
/// As [`sgemm`]; `buf` is the thread's buffer from [`GemmScratch::parts`].
pub(super) unsafe fn serial(g: &Gemm, buf: &mut [f32]) {
    // SAFETY: forwarded contract.
    unsafe { x86::serial(g, 0..g.m, 0..g.n, Shared::None, buf) }
}

/// `x` rounded to the nearest bfloat16, ties to even, NaN kept a (quiet) NaN: the
/// conversion the packing does, for tests and references.
#[cfg(test)]
pub(crate) fn round_to_bf16(x: f32) -> f32 {
    f32::from_bits(u32::from(bf16_bits(x)) << 16)
}

#[cfg(test)]
fn bf16_bits(x: f32) -> u16 {
    let bits = x.to_bits();
    if x.is_nan() {
        return (bits >> 16) as u16 | 0x40;
    }
    (bits.wrapping_add(0x7fff + (bits >> 16 & 1)) >> 16) as u16
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::*;
    use std::arch::asm;
    use std::arch::x86_64::*;

    /// The tile configuration (palette 1): tiles 0-3 accumulate a 32 x 32 block of
    /// `C`, 4-5 hold two 16-row tiles of `A`, 6-7 two 16-column tiles of `B`; all 16
    /// rows of 64 bytes.
    #[repr(C, align(64))]
    struct TileConfig([u8; 64]);

    impl TileConfig {
        fn new() -> TileConfig {
            let mut bytes = [0u8; 64];
            bytes[0] = 1;
            for t in 0..8 {
                bytes[16 + 2 * t] = 64;
                bytes[48 + t] = 16;
            }
            TileConfig(bytes)
        }
    }

    /// Where a 16 x 16 dword tile's lines come from: `Direct` lines are its rows,
    /// `Transposed` lines its columns.
    #[derive(Clone, Copy, PartialEq, Eq)]
    enum Lines {
        Direct,
        Transposed,
    }

    /// The operand's element `(row, col)` (of the logical `rows x cols` matrix)
    /// lies at `base + row * row_stride + col * col_stride`.
    #[derive(Clone, Copy)]
    struct View {
        base: *const f32,
        row_stride: usize,
        col_stride: usize,
        rows: usize,
        cols: usize,
    }

    impl View {
        fn a(g: &Gemm) -> View {
            let (row_stride, col_stride) = if g.a_transposed {
                (1, g.lda)
            } else {
                (g.lda, 1)
            };
            View {
                base: g.a,
                row_stride,
                col_stride,
                rows: g.m,
                cols: g.k,
            }
        }

        /// The same elements with rows and columns swapped.
        fn transposed(&self) -> View {
            View {
                base: self.base,
                row_stride: self.col_stride,
                col_stride: self.row_stride,
                rows: self.cols,
                cols: self.rows,
            }
        }

        fn b(g: &Gemm) -> View {
            let (row_stride, col_stride) = if g.b_transposed {
                (1, g.ldb)
            } else {
                (g.ldb, 1)
            };
            View {
                base: g.b,
                row_stride,
                col_stride,
                rows: g.k,
                cols: g.n,
            }
        }
    }

    /// Sixteen `f32` values from `ptr` on (the first `count`, zeros after), rounded
    /// to bfloat16, one per 32-bit lane's low half.
    #[target_feature(enable = "avx512f")]
    unsafe fn bf16_lanes(ptr: *const f32, count: usize) -> __m512i {
        let x = if count >= 16 {
            // SAFETY: the caller's sixteen values are readable.
            unsafe { _mm512_loadu_ps(ptr) }
        } else if count == 0 {
            return _mm512_setzero_si512();
        } else {
            // SAFETY: the first `count` values are readable; masked lanes are not read.
            unsafe { _mm512_maskz_loadu_ps((1u16 << count) - 1, ptr) }
        };
        let bits = _mm512_castps_si512(x);
        let high = _mm512_srli_epi32::<16>(bits);
        let odd = _mm512_and_si512(high, _mm512_set1_epi32(1));
        let bias = _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff));
        let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(bits, bias));
        let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(x, x);
        let quiet = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
        _mm512_mask_mov_epi32(rounded, nan, quiet)
    }

    /// Sixteen values sixteen apart in memory would be slow; these read `count`
    /// values `stride` apart into a buffer first.
    #[target_feature(enable = "avx512f")]
    unsafe fn bf16_lanes_strided(ptr: *const f32, stride: usize, count: usize) -> __m512i {
        if stride == 1 {
            // SAFETY: forwarded.
            return unsafe { bf16_lanes(ptr, count) };
        }
        let mut values = [0.0f32; 16];
        for (i, v) in values.iter_mut().enumerate().take(count.min(16)) {
            // SAFETY: the caller's `count` values are readable.
            *v = unsafe { *ptr.add(i * stride) };
        }
        // SAFETY: `values` holds sixteen floats.
        unsafe { bf16_lanes(values.as_ptr(), 16) }
    }

    /// One line of 16 dwords made of 32 consecutive values along the operand's
    /// columns from `(row, col)`: dword `q` holds columns `col + 2q` (low half) and
    /// `col + 2q + 1`.
    #[target_feature(enable = "avx512f")]
    unsafe fn pairs_along(v: &View, row: usize, col: usize) -> __m512i {
        if row >= v.rows || col >= v.cols {
            return _mm512_setzero_si512();
        }
        let count = (v.cols - col).min(32);
        // SAFETY: row `row`, columns col..col+count, lie inside the operand.
        unsafe {
            let at = v.base.add(row * v.row_stride + col * v.col_stride);
            let low = bf16_lanes_strided(at, v.col_stride, count);
            let high = bf16_lanes_strided(
                at.wrapping_add(16 * v.col_stride),
                v.col_stride,
                count.saturating_sub(16),
            );
            let low = _mm512_cvtepi32_epi16(low);
            let high = _mm512_cvtepi32_epi16(high);
            _mm512_inserti64x4::<1>(_mm512_castsi256_si512(low), high)
        }
    }

    /// One line of 16 dwords pairing rows `row` (low halves) and `row + 1` (high),
    /// each read along 16 columns from `col`.
    #[target_feature(enable = "avx512f")]
    unsafe fn pairs_across(v: &View, row: usize, col: usize) -> __m512i {
        if row >= v.rows || col >= v.cols {
            return _mm512_setzero_si512();
        }
        let count = (v.cols - col).min(16);
        // SAFETY: rows row and row+1 (when it exists), columns col..col+count, lie
        // inside the operand.
        unsafe {
            let at = v.base.add(row * v.row_stride + col * v.col_stride);
            let low = bf16_lanes_strided(at, v.col_stride, count);
            if row + 1 >= v.rows {
                return low;
            }
            let high = bf16_lanes_strided(at.add(v.row_stride), v.col_stride, count);
            _mm512_or_si512(low, _mm512_slli_epi32::<16>(high))
        }
    }

    /// Writes 16 lines as a tile's rows or (transposed) columns.
    #[target_feature(enable = "avx512f")]
    unsafe fn store_tile(lines: &[__m512i; 16], how: Lines, out: *mut u16) {
        let out = out.cast::<u32>();
        match how {
            Lines::Direct => {
                for (r, line) in lines.iter().enumerate() {
                    // SAFETY: the tile holds 16 rows of 16 dwords.
                    unsafe { _mm512_storeu_si512(out.add(16 * r).cast(), *line) };
                }
            }
            Lines::Transposed => {
                let rows = transpose_16x16(lines);
                for (r, row) in rows.iter().enumerate() {
                    // SAFETY: as above.
                    unsafe { _mm512_storeu_si512(out.add(16 * r).cast(), *row) };
                }
            }
        }
    }

    /// The 16 x 16 dword matrix whose rows are `r` (row `i` is `r[i]`), transposed:
    /// pairs of rows interleaved by dwords, then by quadwords (so 128-bit lane `L`
    /// of the second stage's vector `4i + j` holds column `4L + j` of rows `4i..4i +
    /// 4`), then those lanes transposed as a 4 x 4 matrix.
    #[target_feature(enable = "avx512f")]
    fn transpose_16x16(r: &[__m512i; 16]) -> [__m512i; 16] {
        let mut t = [_mm512_setzero_si512(); 16];
        for i in 0..8 {
            t[2 * i] = _mm512_unpacklo_epi32(r[2 * i], r[2 * i + 1]);
            t[2 * i + 1] = _mm512_unpackhi_epi32(r[2 * i], r[2 * i + 1]);
        }
        let mut u = [_mm512_setzero_si512(); 16];
        for i in 0..4 {
            u[4 * i] = _mm512_unpacklo_epi64(t[4 * i], t[4 * i + 2]);
            u[4 * i + 1] = _mm512_unpackhi_epi64(t[4 * i], t[4 * i + 2]);
            u[4 * i + 2] = _mm512_unpacklo_epi64(t[4 * i + 1], t[4 * i + 3]);
            u[4 * i + 3] = _mm512_unpackhi_epi64(t[4 * i + 1], t[4 * i + 3]);
        }
        let mut out = [_mm512_setzero_si512(); 16];
        for j in 0..4 {
            let v0 = _mm512_shuffle_i32x4::<0b01_00_01_00>(u[j], u[4 + j]);
            let v1 = _mm512_shuffle_i32x4::<0b11_10_11_10>(u[j], u[4 + j]);
            let v2 = _mm512_shuffle_i32x4::<0b01_00_01_00>(u[8 + j], u[12 + j]);
            let v3 = _mm512_shuffle_i32x4::<0b11_10_11_10>(u[8 + j], u[12 + j]);
            out[j] = _mm512_shuffle_i32x4::<0b10_00_10_00>(v0, v2);
            out[4 + j] = _mm512_shuffle_i32x4::<0b11_01_11_01>(v0, v2);
            out[8 + j] = _mm512_shuffle_i32x4::<0b10_00_10_00>(v1, v3);
            out[12 + j] = _mm512_shuffle_i32x4::<0b11_01_11_01>(v1, v3);
        }
        out
    }

    /// How a tile's 16 lines are read: each from one row (32 values along it, in
    /// pairs) or from two rows (16 values of each, paired lane by lane).
    #[derive(Clone, Copy)]
    enum Pairs {
        /// Line `l` is [`pairs_along`] row `first + l`.
        Along,
        /// Line `l` is [`pairs_across`] rows `first + 2l` and `first + 2l + 1`.
        Across,
    }

    /// Packs one tile of 16 lines of `v`, starting at row `first` and column `at`,
    /// stored `how`.
    #[target_feature(enable = "avx512f")]
    unsafe fn pack_tile(
        v: &View,
        (first, at): (usize, usize),
        pairs: Pairs,
        how: Lines,
        out: *mut u16,
    ) {
        let mut lines = [_mm512_setzero_si512(); 16];
        for (l, line) in lines.iter_mut().enumerate() {
            // SAFETY: reads inside the operand (checked by the pair readers).
            *line = unsafe {
                match pairs {
                    Pairs::Along => pairs_along(v, first + l, at),
                    Pairs::Across => pairs_across(v, first + 2 * l, at),
                }
            };
        }
        // SAFETY: `out` holds one tile.
        unsafe { store_tile(&lines, how, out) };
    }

    /// Packs the `A` tile of rows `i..i + 16`, depth `p..p + 32`: row `r` of the tile
    /// holds `A[i + r, p..p + 32]`. A transposed `A` is read as column pairs along
    /// its rows in memory, transposed into the tile.
    #[target_feature(enable = "avx512f")]
    unsafe fn pack_a_tile(a: &View, i: usize, p: usize, out: *mut u16) {
        // SAFETY (both): forwarded.
        if a.col_stride == 1 {
            unsafe { pack_tile(a, (i, p), Pairs::Along, Lines::Direct, out) }
        } else {
            unsafe {
                pack_tile(
                    &a.transposed(),
                    (p, i),
                    Pairs::Across,
                    Lines::Transposed,
                    out,
                )
            }
        }
    }

    /// Packs the `B` tile of depth `p..p + 32`, columns `j..j + 16`: row `q` of the
    /// tile holds the pairs `(B[p + 2q, j + c], B[p + 2q + 1, j + c])`. A transposed
    /// `B` has each column as a row in memory, read along.
    #[target_feature(enable = "avx512f")]
    unsafe fn pack_b_tile(b: &View, p: usize, j: usize, out: *mut u16) {
        // SAFETY (both): forwarded.
        if b.col_stride == 1 {
            unsafe { pack_tile(b, (p, j), Pairs::Across, Lines::Direct, out) }
        } else {
            unsafe {
                pack_tile(
                    &b.transposed(),
                    (j, p),
                    Pairs::Along,
                    Lines::Transposed,
                    out,
                )
            }
        }
    }

    /// Packs tiles `(panel, step)` of `A` (16-row panels; `is_a`) or `B` (16-column
    /// panels) for the panels and 32-deep steps given, tile `(p, q)` at `out + ((p -
    /// first panel) * panel_stride + q - first step) * 512`.
    ///
    /// # Safety
    /// `out` must hold every tile so addressed; AVX-512 must be available.
    pub(super) unsafe fn pack_panels(
        g: &Gemm,
        is_a: bool,
        (panels, steps): (std::ops::Range<usize>, std::ops::Range<usize>),
        out: *mut u16,
        panel_stride: usize,
    ) {
        let view = if is_a { View::a(g) } else { View::b(g) };
        let tile = |pi: usize, panel: usize, qi: usize, step: usize| {
            // SAFETY: the tile lies inside `out` (the caller's contract).
            unsafe {
                let tile = out.add((pi * panel_stride + qi) * TILE_U16);
                if is_a {
                    pack_a_tile(&view, 16 * panel, 32 * step, tile);
                } else {
                    pack_b_tile(&view, 32 * step, 16 * panel, tile);
                }
            }
        };
        // Where the depth runs down the rows of memory (a row-major B, a transposed
        // A), a tile reads 64 bytes of each of 32 rows: the steps go outermost, so the
        // panels of one step read those rows whole, in order.
        let depth_along_rows = if is_a {
            view.col_stride != 1
        } else {
            view.col_stride == 1
        };
        if depth_along_rows {
            for (qi, step) in steps.enumerate() {
                for (pi, panel) in panels.clone().enumerate() {
                    tile(pi, panel, qi, step);
                }
            }
        } else {
            for (pi, panel) in panels.enumerate() {
                for (qi, step) in steps.clone().enumerate() {
                    tile(pi, panel, qi, step);
                }
            }
        }
    }

    /// A 16 x 16 tile of `C` at `(i, j)`: where it is read and written, and how
    /// much of it lies inside the task's rectangle.
    struct CTile {
        ptr: *mut f32,
        stride_bytes: usize,
        edge: Option<(*mut f32, usize, usize)>,
    }

    impl CTile {
        /// The tile at `(i, j)` of `C`, through `buffer` when it is not whole.
        fn new(
            g: &Gemm,
            (i, j): (usize, usize),
            (rows_end, cols_end): (usize, usize),
            buffer: *mut f32,
        ) -> CTile {
            let (valid_rows, valid_cols) = (
                rows_end.saturating_sub(i).min(16),
                cols_end.saturating_sub(j).min(16),
            );
            if valid_rows == 16 && valid_cols == 16 {
                return CTile {
                    // SAFETY: (i, j) is inside C.
                    ptr: unsafe { g.c.add(i * g.ldc + j) },
                    stride_bytes: g.ldc * 4,
                    edge: None,
                };
            }
            let origin = if valid_rows > 0 && valid_cols > 0 {
                // SAFETY: as above.
                unsafe { g.c.add(i * g.ldc + j) }
            } else {
                std::ptr::null_mut()
            };
            CTile {
                ptr: buffer,
                stride_bytes: 64,
                edge: Some((origin, valid_rows, valid_cols)),
            }
        }

        /// Before an edge tile is loaded: its part of `C` (or zeros) into the buffer.
        unsafe fn stage(&self, g: &Gemm, from_c: bool) {
            if let Some((origin, rows, cols)) = self.edge {
                for r in 0..16 {
                    for c in 0..16 {
                        let v = if from_c && r < rows && c < cols {
                            // SAFETY: inside the valid part of C.
                            unsafe { *origin.add(r * g.ldc + c) }
                        } else {
                            0.0
                        };
                        // SAFETY: the buffer holds 256 floats.
                        unsafe { *self.ptr.add(r * 16 + c) = v };
                    }
                }
            }
        }

        /// After an edge tile is stored: its valid part back into `C`.
        unsafe fn unstage(&self, g: &Gemm) {
            if let Some((origin, rows, cols)) = self.edge {
                for r in 0..rows {
                    for c in 0..cols {
                        // SAFETY: as in `stage`.
                        unsafe { *origin.add(r * g.ldc + c) = *self.ptr.add(r * 16 + c) };
                    }
                }
            }
        }
    }

    macro_rules! tile_io {
        ($load:ident, $store:ident, $tmm:literal) => {
            /// Loads one accumulator tile, or zeroes it (`ptr` unread) when `zero`.
            #[inline(always)]
            unsafe fn $load(ptr: *const f32, stride: usize, zero: bool) {
                if zero {
                    // SAFETY: touches the tile only.
                    unsafe { asm!(concat!("tilezero tmm", $tmm), options(nostack, nomem)) };
                    return;
                }
                // SAFETY: 16 rows of 64 bytes from ptr, `stride` bytes apart.
                unsafe {
                    asm!(concat!("tileloadd tmm", $tmm, ", [{p} + {s}*1]"),
                        p = in(reg) ptr, s = in(reg) stride, options(nostack, readonly))
                }
            }
            /// Stores one accumulator tile.
            #[inline(always)]
            unsafe fn $store(ptr: *mut f32, stride: usize) {
                // SAFETY: as above, written.
                unsafe {
                    asm!(concat!("tilestored [{p} + {s}*1], tmm", $tmm),
                        p = in(reg) ptr, s = in(reg) stride, options(nostack))
                }
            }
        };
    }
    tile_io!(load0, store0, "0");
    tile_io!(load1, store1, "1");
    tile_io!(load2, store2, "2");
    tile_io!(load3, store3, "3");

    /// `kq` steps of the 32 x 32 block: tiles 0-3 += two 16-row tiles of `A` (from
    /// `a` and `a2`) times two 16-column tiles of `B` (from `b` and `b2`), each step's
    /// tiles [`STEP_BYTES`] after the last.
    #[inline(always)]
    unsafe fn multiply(a: [*const u16; 2], b: [*const u16; 2], kq: usize) {
        // SAFETY: `kq` steps of two A and two B tiles lie at the pointers.
        unsafe {
            asm!(
                "2:",
                "tileloadd tmm4, [{a} + {s}*1]",
                "tileloadd tmm6, [{b} + {s}*1]",
                "tileloadd tmm5, [{a2} + {s}*1]",
                "tdpbf16ps tmm0, tmm4, tmm6",
                "tileloadd tmm7, [{b2} + {s}*1]",
                "tdpbf16ps tmm2, tmm5, tmm6",
                "tdpbf16ps tmm1, tmm4, tmm7",
                "tdpbf16ps tmm3, tmm5, tmm7",
                "add {a}, {step}",
                "add {a2}, {step}",
                "add {b}, {step}",
                "add {b2}, {step}",
                "dec {n}",
                "jnz 2b",
                a = inout(reg) a[0] => _,
                a2 = inout(reg) a[1] => _,
                b = inout(reg) b[0] => _,
                b2 = inout(reg) b[1] => _,
                n = inout(reg) kq => _,
                s = in(reg) 64usize,
                step = const STEP_BYTES,
                options(nostack, readonly),
            )
        }
    }

    /// The blocked loops over one rectangle of `C`.
    ///
    /// # Safety
    /// As [`super::sgemm`]; `buf` holds at least [`scratch_floats`] floats.
    pub(super) unsafe fn serial(
        g: &Gemm,
        rows: std::ops::Range<usize>,
        cols: std::ops::Range<usize>,
        shared: Shared,
        buf: &mut [f32],
    ) {
        assert!(buf.len() >= scratch_floats(), "AMX scratch too small");
        let base = buf.as_mut_ptr();
        let b_pack = base.cast::<u16>();
        // SAFETY: the three regions lie inside `buf` (scratch_floats).
        let (a_pack, edges) = unsafe {
            let a = base.add(KC * NC / 2).cast::<u16>();
            (a, base.add((KC * NC + MC * KC) / 2))
        };
        let config = TileConfig::new();
        // SAFETY: AMX is available (the caller checked) and the OS granted the tiles.
        unsafe { asm!("ldtilecfg [{0}]", in(reg) config.0.as_ptr(), options(nostack, readonly)) };
        if g.k == 0 {
            for i in rows.clone() {
                for j in cols.clone() {
                    // SAFETY: (i, j) is inside C.
                    unsafe {
                        let c = g.c.add(i * g.ldc + j);
                        *c = if g.accumulate { *c } else { 0.0 };
                    }
                }
            }
        }
        let mut jc = cols.start;
        while jc < cols.end {
            let nc = NC.min(cols.end - jc);
            let col_tiles = nc.div_ceil(32) * 2;
            let mut pc = 0;
            while pc < g.k {
                let kc = KC.min(g.k - pc);
                let (q0, kq) = (pc / 32, kc.div_ceil(32));
                // Tiles of the B block: (first tile, tiles from one panel to the next).
                let (b_tiles, b_stride) = match shared {
                    // SAFETY: the shared B holds every panel and step.
                    Shared::B(p) => unsafe {
                        (p.tiles.add((jc / 16 * p.steps + q0) * TILE_U16), p.steps)
                    },
                    _ => {
                        let panels = jc / 16..jc / 16 + col_tiles;
                        // SAFETY: b_pack holds col_tiles x kq tiles (NC x KC).
                        unsafe { pack_panels(g, false, (panels, q0..q0 + kq), b_pack, kq) };
                        (b_pack.cast_const(), kq)
                    }
                };
                let from_c = pc > 0 || g.accumulate;
                let mut ic = rows.start;
                while ic < rows.end {
                    let mc = MC.min(rows.end - ic);
                    let row_tiles = mc.div_ceil(32) * 2;
                    let (a_tiles, a_stride) = match shared {
                        // SAFETY: the shared A holds every panel and step.
                        Shared::A(p) => unsafe {
                            (p.tiles.add((ic / 16 * p.steps + q0) * TILE_U16), p.steps)
                        },
                        _ => {
                            let panels = ic / 16..ic / 16 + row_tiles;
                            // SAFETY: a_pack holds row_tiles x kq tiles (MC x KC).
                            unsafe { pack_panels(g, true, (panels, q0..q0 + kq), a_pack, kq) };
                            (a_pack.cast_const(), kq)
                        }
                    };
                    let ends = (rows.end, cols.end);
                    for rt in (0..row_tiles).step_by(2) {
                        for ct in (0..col_tiles).step_by(2) {
                            let (i, j) = (ic + 16 * rt, jc + 16 * ct);
                            // SAFETY: each edge buffer holds 256 floats.
                            let tiles = unsafe {
                                [
                                    CTile::new(g, (i, j), ends, edges),
                                    CTile::new(g, (i, j + 16), ends, edges.add(256)),
                                    CTile::new(g, (i + 16, j), ends, edges.add(512)),
                                    CTile::new(g, (i + 16, j + 16), ends, edges.add(768)),
                                ]
                            };
                            // SAFETY: tiles address C or their buffers; the packed
                            // panels hold kq steps.
                            unsafe {
                                for t in &tiles {
                                    t.stage(g, from_c);
                                }
                                // Whole tiles start from zero without reading
                                // C; edge tiles from their staged buffers.
                                let zero = |t: &CTile| !from_c && t.edge.is_none();
                                let [t0, t1, t2, t3] = &tiles;
                                load0(t0.ptr, t0.stride_bytes, zero(t0));
                                load1(t1.ptr, t1.stride_bytes, zero(t1));
                                load2(t2.ptr, t2.stride_bytes, zero(t2));
                                load3(t3.ptr, t3.stride_bytes, zero(t3));
                                multiply(
                                    [
                                        a_tiles.add(rt * a_stride * TILE_U16),
                                        a_tiles.add((rt + 1) * a_stride * TILE_U16),
                                    ],
                                    [
                                        b_tiles.add(ct * b_stride * TILE_U16),
                                        b_tiles.add((ct + 1) * b_stride * TILE_U16),
                                    ],
                                    kq,
                                );
                                store0(tiles[0].ptr, tiles[0].stride_bytes);
                                store1(tiles[1].ptr, tiles[1].stride_bytes);
                                store2(tiles[2].ptr, tiles[2].stride_bytes);
                                store3(tiles[3].ptr, tiles[3].stride_bytes);
                                for t in &tiles {
                                    t.unstage(g);
                                }
                            }
                        }
                    }
                    if pc + kc == g.k && !g.epilogue.is_identity() {
                        // SAFETY: rows ic..ic+mc, columns jc..jc+nc, lie inside C.
                        unsafe { epilogue::apply(g, ic..ic + mc, jc..jc + nc) };
                    }
                    ic += mc;
                }
                pc += kc;
            }
            if g.k == 0 && !g.epilogue.is_identity() {
                // SAFETY: as above.
                unsafe { epilogue::apply(g, rows.clone(), jc..jc + nc) };
            }
            jc += nc;
        }
        // SAFETY: returns the tiles to their initial state (cheaper context switches).
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod x86 {
    use super::Gemm;

    pub(super) unsafe fn serial(
        _g: &Gemm,
        _rows: std::ops::Range<usize>,
        _cols: std::ops::Range<usize>,
        _shared: super::Shared,
        _buf: &mut [f32],
    ) {
        unreachable!("AMX is only detected on x86_64");
    }

    pub(super) unsafe fn pack_panels(
        _g: &Gemm,
        _is_a: bool,
        _ranges: (std::ops::Range<usize>, std::ops::Range<usize>),
        _out: *mut u16,
        _panel_stride: usize,
    ) {
        unreachable!("AMX is only detected on x86_64");
    }
}

#[cfg(test)]
mod tests {
    use super::super::tests::lcg;
    use super::super::{Activation, BFormat, Epilogue, Gemm, GemmScratch};
    use super::*;

    #[test]
    fn rounding_to_bf16_is_to_nearest_even() {
        let one = 1.0f32.to_bits();
        // Halfway between 1 and the next bfloat16 goes to 1 (even); above, up.
        assert_eq!(round_to_bf16(f32::from_bits(one + 0x8000)), 1.0);
        assert_eq!(
            round_to_bf16(f32::from_bits(one + 0x8001)).to_bits(),
            one + 0x1_0000
        );
        // Halfway above an odd bfloat16 goes up to the even one.
        let odd = one + 0x1_0000;
        assert_eq!(
            round_to_bf16(f32::from_bits(odd + 0x8000)).to_bits(),
            odd + 0x1_0000
        );
        assert_eq!(round_to_bf16(f32::MAX), f32::INFINITY);
        assert_eq!(round_to_bf16(-0.0).to_bits(), (-0.0f32).to_bits());
        assert!(round_to_bf16(f32::from_bits(0x7f80_0001)).is_nan());
        assert_eq!(round_to_bf16(f32::NEG_INFINITY), f32::NEG_INFINITY);
    }

    /// `C = epilogue(A · B)` in f64 from operands rounded to bfloat16 (element `(i,
    /// p)` of A is `a[i * k + p]`, of B `b[p * n + j]`), with each entry's sum of
    /// absolute terms (the scale of its rounding error).
    fn reference(m: usize, n: usize, k: usize, a: &[f32], b: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let mut c = vec![0.0; m * n];
        let mut scale = vec![0.0; m * n];
        for i in 0..m {
            for j in 0..n {
                for p in 0..k {
                    let t = f64::from(round_to_bf16(a[i * k + p]))
                        * f64::from(round_to_bf16(b[p * n + j]));
                    c[i * n + j] += t;
                    scale[i * n + j] += t.abs();
                }
            }
        }
        (c, scale)
    }

    fn transpose(x: &[f32], rows: usize, cols: usize) -> Vec<f32> {
        (0..rows * cols)
            .map(|t| x[(t % rows) * cols + t / rows])
            .collect()
    }

    #[test]
    fn tiles_match_the_rounded_reference_on_awkward_shapes() {
        if !available() {
            eprintln!("skipped: this CPU (or OS) has no AMX");
            return;
        }
        let pool = ThreadPool::new(2);
        let scratch = GemmScratch::with_amx(2, 0);
        let mut seed = 7u64;
        for &(m, n, k) in &[
            (1, 1, 1),
            (16, 16, 32),
            (17, 33, 31),
            (100, 70, 65),
            (40, 600, 700),
            (530, 45, 1100),
            // Deeper than one K block: C is stored and reloaded between blocks.
            (33, 40, 2100),
            (64, 48, 0),
        ] {
            let a: Vec<f32> = (0..m * k).map(|_| lcg(&mut seed)).collect();
            let b: Vec<f32> = (0..k * n).map(|_| lcg(&mut seed)).collect();
            let bias: Vec<f32> = (0..n).map(|_| lcg(&mut seed)).collect();
            let old: Vec<f32> = (0..m * n).map(|_| lcg(&mut seed)).collect();
            let (want, scale) = reference(m, n, k, &a, &b);
            let (at, bt) = (transpose(&a, m, k), transpose(&b, k, n));
            for (a_transposed, b_transposed, accumulate, epilogue) in [
                (false, false, false, false),
                (true, false, false, false),
                (false, true, true, false),
                (true, true, false, true),
            ] {
                let mut c = old.clone();
                let g = Gemm {
                    m,
                    n,
                    k,
                    a: if a_transposed {
                        at.as_ptr()
                    } else {
                        a.as_ptr()
                    },
                    lda: if a_transposed { m } else { k },
                    a_transposed,
                    b: if b_transposed {
                        bt.as_ptr()
                    } else {
                        b.as_ptr()
                    },
                    ldb: if b_transposed { k } else { n },
                    b_transposed,
                    b_format: BFormat::F32,
                    c: c.as_mut_ptr(),
                    ldc: n,
                    accumulate,
                    epilogue: if epilogue {
                        Epilogue {
                            alpha: 0.5,
                            bias: Some(bias.as_ptr()),
                            activation: Some(Activation::Relu),
                            ..Epilogue::NONE
                        }
                    } else {
                        Epilogue::NONE
                    },
                };
                // SAFETY: the buffers match the stated sizes; AMX is available.
                unsafe { sgemm(&g, &pool, &scratch) }.unwrap();
                for i in 0..m {
                    for (j, &bias_j) in bias.iter().enumerate() {
                        let at = i * n + j;
                        let mut w = want[at];
                        if accumulate {
                            w += f64::from(old[at]);
                        }
                        if epilogue {
                            w = (w * 0.5 + f64::from(bias_j)).max(0.0);
                        }
                        // f32 sums: at most k roundings of partial sums.
                        let tol = (k as f64 + 2.0) * 1.2e-7 * (scale[at] + w.abs() + 1e-3);
                        let got = f64::from(c[at]);
                        assert!(
                            (got - w).abs() <= tol,
                            "{m}x{n}x{k} at=({i},{j}) transposed {a_transposed}/{b_transposed}: \
                             {got} vs {w} (tol {tol:e})"
                        );
                    }
                }
            }
        }
    }
}
