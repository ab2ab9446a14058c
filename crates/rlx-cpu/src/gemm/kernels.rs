//! Register-blocked micro-kernels: `C[MR x NR] (+)= A[MR x kc] · Bpanel` where `A` is
//! read in place (row `i` at `a + i * lda`) and the B panel is `kc` groups of `NR`
//! values (see `pack`). One kernel per instruction set, chosen once at run time.

/// A micro-kernel: `(kc, a, lda, b, ldb, c, ldc, accumulate, ahead)`.
///
/// # Safety
/// `a` must address `MR` rows of `kc` floats with row stride `lda`, `b` `kc` rows of
/// `NR` floats with row stride `ldb`, and `c` an `MR x NR` tile with row stride `ldc`,
/// not aliased by `a` or `b`. `ahead` may point anywhere (it is only prefetched).
pub(crate) type KernelFn =
    unsafe fn(usize, *const f32, usize, *const f32, usize, *mut f32, usize, bool, Ahead);

/// Cache lines a streaming micro-kernel asks into L2 while it multiplies, spread
/// evenly over its `kc` steps: part of the `B` panel the product reads next.
///
/// A product whose packed weights come from memory reads each panel from memory in
/// the first row tile and from cache in the others. With nothing asked ahead, that
/// first tile waits on memory while the core's other work has already run; asked
/// for during the other tiles, the next panel arrives while they multiply
/// (128 x 3072 x 768 against weights not in cache, in GPT-2: 2.7 -> 2.3 ms).
#[derive(Clone, Copy, Debug)]
pub(crate) struct Ahead {
    /// The first line's address (never read: a prefetch cannot fault).
    pub at: *const u8,
    /// How many consecutive 64-byte lines from `at`.
    pub lines: usize,
}

impl Ahead {
    /// Nothing to ask for: a streaming kernel then prefetches its own panel ahead
    /// where it does so (the AVX-512 one; on AVX2 that measured no better).
    pub const NONE: Ahead = Ahead {
        at: std::ptr::null(),
        lines: 0,
    };

    /// Share `part` of `parts` of the `lines` lines from `at`.
    pub fn share(at: *const u8, lines: usize, (part, parts): (usize, usize)) -> Ahead {
        let (first, end) = (part * lines / parts, (part + 1) * lines / parts);
        Ahead {
            at: at.wrapping_add(first * 64),
            lines: end - first,
        }
    }
}

/// The next line of an [`Ahead`] to ask for at each step: `lines` spread over `kc`
/// steps by a running remainder, so a step asks for none, one or several.
#[cfg(target_arch = "x86_64")]
struct AheadCursor {
    at: *const u8,
    lines: usize,
    kc: usize,
    due: usize,
}

#[cfg(target_arch = "x86_64")]
impl AheadCursor {
    fn new(ahead: Ahead, kc: usize) -> AheadCursor {
        AheadCursor {
            at: ahead.at,
            lines: ahead.lines,
            kc: kc.max(1),
            due: 0,
        }
    }

    /// Asks for this step's lines into L2.
    #[inline(always)]
    fn step(&mut self) {
        use std::arch::x86_64::{_MM_HINT_T1, _mm_prefetch};
        self.due += self.lines;
        while self.due >= self.kc {
            self.due -= self.kc;
            // SAFETY: a prefetch reads nothing architecturally and never faults.
            unsafe { _mm_prefetch::<_MM_HINT_T1>(self.at.cast::<i8>()) };
            self.at = self.at.wrapping_add(64);
        }
    }
}

/// The micro-kernel for this CPU and its tile size.
#[derive(Clone, Copy)]
pub(crate) struct MicroKernel {
    /// For a `B` panel already in cache (packed into scratch, or read in place).
    pub run: KernelFn,
    /// For a `B` panel streamed from memory (weights packed ahead): prefetches the
    /// rows ahead of the ones it multiplies. On a cached panel the prefetches only
    /// take load slots from the multiply-adds.
    pub stream: KernelFn,
    /// For a `B` read in place with rows far apart (a convolution's input planes, a
    /// row-major `B` with few rows of `A`): prefetches the rows ahead, which the
    /// hardware does not for a short run per row.
    pub strided: KernelFn,
    /// `(width, kernel)` for a last panel narrower than `nr` that this width covers
    /// exactly (the panel keeps its `nr`-wide layout): the product then wastes no
    /// multiply-adds on padding and writes `C` directly instead of through a temporary.
    pub partial: &'static [(usize, KernelFn)],
    /// Kernels for a last row tile of `r < mr` rows (entry `r - 1`), full width, `A`
    /// read in place: the edge then needs no packed copy of `A` and no temporary tile.
    pub row_edges: &'static [KernelFn],
    pub mr: usize,
    pub nr: usize,
    pub name: &'static str,
}

/// The fastest kernel this CPU supports (detected once).
pub(crate) fn best() -> MicroKernel {
    static BEST: std::sync::OnceLock<MicroKernel> = std::sync::OnceLock::new();
    *BEST.get_or_init(detect)
}

fn detect() -> MicroKernel {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = crate::isa::isa();
        if isa.avx512f {
            return x86::AVX512_WIDE;
        }
        if isa.avx2_fma {
            return MicroKernel {
                run: x86::kernel_avx2::<{ x86::AVX2_MR }, false, false>,
                stream: x86::kernel_avx2::<{ x86::AVX2_MR }, false, true>,
                strided: x86::kernel_avx2::<{ x86::AVX2_MR }, true, false>,
                partial: &[],
                row_edges: x86::AVX2_ROW_EDGES,
                mr: x86::AVX2_MR,
                nr: x86::AVX2_NR,
                name: "avx2",
            };
        }
    }
    generic_kernel()
}

/// The widest product the narrow AVX-512 kernel is used for.
#[cfg(target_arch = "x86_64")]
const NARROW_MAX_WIDTH: usize = 256;

/// The kernel for a product `n` columns wide: the best one, or a narrower variant of it
/// when that tiles `n` exactly and the best does not.
pub(crate) fn for_width(n: usize) -> MicroKernel {
    let best = best();
    #[cfg(target_arch = "x86_64")]
    {
        let narrow = x86::AVX512_NARROW;
        // Only for narrow products (attention heads, score blocks): on wide ones the
        // wide kernel's denser tiles win over its one partial panel.
        if best.name == "avx512"
            && n <= NARROW_MAX_WIDTH
            && !n.is_multiple_of(best.nr)
            && n.is_multiple_of(narrow.nr)
        {
            return narrow;
        }
    }
    let _ = n;
    best
}

/// The widest panel (`nr`) of the kernels `for_width` can return.
pub(crate) fn widest_nr() -> usize {
    let best = best();
    #[cfg(target_arch = "x86_64")]
    {
        if best.name == "avx512" {
            return best.nr.max(x86::AVX512_NARROW.nr);
        }
    }
    best.nr
}

/// The largest `(mr, mr * nr)` of the kernels `for_width` can return, for sizing
/// scratch buffers.
pub(crate) fn largest_tiles() -> (usize, usize) {
    let best = best();
    #[cfg(target_arch = "x86_64")]
    {
        if best.name == "avx512" {
            let narrow = x86::AVX512_NARROW;
            return (
                best.mr.max(narrow.mr),
                (best.mr * best.nr).max(narrow.mr * narrow.nr),
            );
        }
    }
    (best.mr, best.mr * best.nr)
}

/// The portable kernel (every CPU; also used to test the SIMD ones).
pub(crate) fn generic_kernel() -> MicroKernel {
    MicroKernel {
        run: kernel_generic,
        stream: kernel_generic,
        strided: kernel_generic,
        partial: &[],
        row_edges: &[],
        mr: GENERIC_MR,
        nr: GENERIC_NR,
        name: "generic",
    }
}

/// Every kernel this CPU can run, for tests.
#[cfg(test)]
pub(crate) fn available() -> Vec<MicroKernel> {
    let mut all = vec![generic_kernel()];
    #[cfg(target_arch = "x86_64")]
    {
        let hardware = crate::isa::Isa::hardware();
        if hardware.avx2_fma {
            all.push(MicroKernel {
                run: x86::kernel_avx2::<{ x86::AVX2_MR }, false, false>,
                stream: x86::kernel_avx2::<{ x86::AVX2_MR }, false, true>,
                strided: x86::kernel_avx2::<{ x86::AVX2_MR }, true, false>,
                partial: &[],
                row_edges: x86::AVX2_ROW_EDGES,
                mr: x86::AVX2_MR,
                nr: x86::AVX2_NR,
                name: "avx2",
            });
        }
        if hardware.avx512f {
            all.push(x86::AVX512_WIDE);
            all.push(x86::AVX512_NARROW);
        }
    }
    all
}

const GENERIC_MR: usize = 4;
const GENERIC_NR: usize = 8;

/// # Safety
/// See [`KernelFn`].
#[allow(clippy::too_many_arguments)] // the micro-kernel ABI: operands, strides, mode
unsafe fn kernel_generic(
    kc: usize,
    a: *const f32,
    lda: usize,
    b: *const f32,
    ldb: usize,
    c: *mut f32,
    ldc: usize,
    accumulate: bool,
    _ahead: Ahead,
) {
    let mut acc = [[0.0f32; GENERIC_NR]; GENERIC_MR];
    for p in 0..kc {
        // SAFETY: the B panel holds `kc` rows of NR values.
        let bv = unsafe { std::slice::from_raw_parts(b.add(p * ldb), GENERIC_NR) };
        for (i, row) in acc.iter_mut().enumerate() {
            // SAFETY: row `i` of A has `kc` values.
            let x = unsafe { *a.add(i * lda + p) };
            for (o, &y) in row.iter_mut().zip(bv) {
                *o = x.mul_add(y, *o);
            }
        }
    }
    for (i, row) in acc.iter().enumerate() {
        for (j, &v) in row.iter().enumerate() {
            // SAFETY: the tile is MR x NR with row stride `ldc`.
            unsafe {
                let dst = c.add(i * ldc + j);
                *dst = if accumulate { *dst + v } else { v };
            }
        }
    }
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    pub const AVX512_MR: usize = 8;
    pub const AVX512_NR: usize = 48;
    /// The narrow variant, for products whose width is a multiple of 32 but not 48
    /// (attention heads of 32 or 64).
    pub const AVX512_NARROW_MR: usize = 8;
    pub const AVX512_NARROW_NR: usize = 32;
    pub const AVX2_MR: usize = 6;
    /// The main AVX-512 kernel.
    pub const AVX512_WIDE: super::MicroKernel = super::MicroKernel {
        run: kernel_avx512::<AVX512_MR, { AVX512_NR / 16 }, false, false, 16>,
        stream: kernel_avx512::<AVX512_MR, { AVX512_NR / 16 }, true, true, 16>,
        strided: kernel_avx512::<AVX512_MR, { AVX512_NR / 16 }, false, false, 16>,
        // The first width also sets the unit columns are split in between threads.
        // Widths that are not whole vectors store their last vector under a mask (a
        // 15 x 40 image's 600 pixels leave a last panel of 24).
        partial: &[
            (16, kernel_avx512::<AVX512_MR, 1, false, false, 16>),
            (32, kernel_avx512::<AVX512_MR, 2, false, false, 16>),
            (8, kernel_avx512::<AVX512_MR, 1, false, false, 8>),
            (24, kernel_avx512::<AVX512_MR, 2, false, false, 8>),
            (40, kernel_avx512::<AVX512_MR, 3, false, false, 8>),
        ],
        row_edges: &[],
        mr: AVX512_MR,
        nr: AVX512_NR,
        name: "avx512",
    };
    /// The AVX-512 kernel for widths that are multiples of 32.
    pub const AVX512_NARROW: super::MicroKernel = super::MicroKernel {
        run: kernel_avx512::<AVX512_NARROW_MR, { AVX512_NARROW_NR / 16 }, false, false, 16>,
        stream: kernel_avx512::<AVX512_NARROW_MR, { AVX512_NARROW_NR / 16 }, true, true, 16>,
        strided: kernel_avx512::<AVX512_NARROW_MR, { AVX512_NARROW_NR / 16 }, false, false, 16>,
        partial: &[(16, kernel_avx512::<AVX512_NARROW_MR, 1, false, false, 16>)],
        row_edges: &[],
        mr: AVX512_NARROW_MR,
        nr: AVX512_NARROW_NR,
        name: "avx512",
    };
    /// How many B rows ahead the AVX-512 kernel prefetches.
    const PREFETCH_ROWS: usize = 24;
    pub const AVX2_NR: usize = 16;
    /// How many B rows ahead the streaming AVX2 kernel prefetches.
    const AVX2_PREFETCH_ROWS: usize = 8;
    /// The AVX2 kernel for 1 to 5 rows.
    pub const AVX2_ROW_EDGES: &[super::KernelFn] = &[
        kernel_avx2::<1, false, false>,
        kernel_avx2::<2, false, false>,
        kernel_avx2::<3, false, false>,
        kernel_avx2::<4, false, false>,
        kernel_avx2::<5, false, false>,
    ];

    /// Brings the cache lines of an `MR x width` tile of `C` into L1 before the
    /// multiply-adds start, so that the stores at the end find them: a product that
    /// writes a `C` not in cache (one `K` block over a large output) otherwise stalls
    /// on the stores' line fills at every tile (10-15% of a 1024 x 1536 x 384 product
    /// on AMD Zen 3). A line no other core holds arrives writable.
    #[inline(always)]
    fn prefetch_tile_for_write<const MR: usize>(c: *mut f32, ldc: usize, width: usize) {
        for i in 0..MR {
            let row = c.wrapping_add(i * ldc);
            // One prefetch per 16 floats and one for the last value: a row not
            // aligned to a line straddles one line more.
            let mut j = 0;
            while j < width {
                // SAFETY: a prefetch never faults.
                unsafe { _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(j).cast::<i8>()) };
                j += 16;
            }
            // SAFETY: as above.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(row.wrapping_add(width - 1).cast::<i8>()) };
        }
    }

    /// `MR x 16 NV` tile in `MR * NV` zmm accumulators. With `AHEAD`, the lines of
    /// `ahead` are asked for; where it has none (or without `AHEAD`), with
    /// `PREFETCH`, B rows further down the panel are. Only the first `LAST` lanes of
    /// each row's last vector are read and written in `C` (the panel is computed
    /// whole: packed panels are zero past the last column).
    ///
    /// # Safety
    /// AVX-512F must be available; pointers as in `KernelFn`, with rows of C
    /// `16 (NV - 1) + LAST` wide.
    #[target_feature(enable = "avx512f")]
    #[allow(clippy::too_many_arguments)] // the micro-kernel ABI
    pub unsafe fn kernel_avx512<
        const MR: usize,
        const NV: usize,
        const PREFETCH: bool,
        const AHEAD: bool,
        const LAST: u32,
    >(
        kc: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        accumulate: bool,
        ahead: super::Ahead,
    ) {
        let mut acc = [[_mm512_setzero_ps(); NV]; MR];
        prefetch_tile_for_write::<MR>(c, ldc, 16 * NV);
        let (mut a, mut b) = (a, b);
        // One step: one column of the MR rows of A times one row of the B panel, after
        // `$prefetch` (given the row's address).
        macro_rules! steps {
            ($prefetch:expr) => {
                for _ in 0..kc {
                    // SAFETY: each step reads one column of the MR rows of A and NR
                    // values of the B panel.
                    unsafe {
                        let mut bv = [_mm512_setzero_ps(); NV];
                        for (v, x) in bv.iter_mut().enumerate() {
                            *x = _mm512_loadu_ps(b.add(16 * v));
                        }
                        $prefetch(b);
                        for (i, row) in acc.iter_mut().enumerate() {
                            let x = _mm512_set1_ps(*a.add(i * lda));
                            for v in 0..NV {
                                row[v] = _mm512_fmadd_ps(x, bv[v], row[v]);
                            }
                        }
                        a = a.add(1);
                        b = b.add(ldb);
                    }
                }
            };
        }
        if AHEAD && ahead.lines > 0 {
            let mut cursor = super::AheadCursor::new(ahead, kc);
            steps!(|_| cursor.step());
        } else if PREFETCH {
            // A prefetch never faults, so running past the panel is harmless.
            steps!(|row: *const f32| for v in 0..NV {
                _mm_prefetch::<_MM_HINT_T0>(
                    row.wrapping_add(PREFETCH_ROWS * ldb + 16 * v).cast::<i8>(),
                );
                _mm_prefetch::<_MM_HINT_T1>(
                    row.wrapping_add(4 * PREFETCH_ROWS * ldb + 16 * v)
                        .cast::<i8>(),
                );
            });
        } else {
            steps!(|_| ());
        }
        let last: __mmask16 = ((1u32 << LAST) - 1) as __mmask16;
        for (i, row) in acc.iter().enumerate() {
            for (v, &value) in row.iter().enumerate() {
                // SAFETY: the tile is MR x NR with row stride `ldc` (the last vector
                // masked to the lanes inside C).
                unsafe {
                    let dst = c.add(i * ldc + 16 * v);
                    if LAST < 16 && v + 1 == NV {
                        let value = if accumulate {
                            _mm512_add_ps(value, _mm512_maskz_loadu_ps(last, dst))
                        } else {
                            value
                        };
                        _mm512_mask_storeu_ps(dst, last, value);
                        continue;
                    }
                    let value = if accumulate {
                        _mm512_add_ps(value, _mm512_loadu_ps(dst))
                    } else {
                        value
                    };
                    _mm512_storeu_ps(dst, value);
                }
            }
        }
    }

    /// `MR x 16` tile in `2 MR` ymm accumulators (6 x 16 for whole tiles, fewer rows
    /// for a last row tile). With `AHEAD`, the lines of `ahead` are asked for; where
    /// it has none (or without `AHEAD`), with `PREFETCH`, B rows further down the
    /// panel are.
    ///
    /// # Safety
    /// AVX2 and FMA must be available; pointers as in `KernelFn`.
    #[target_feature(enable = "avx2,fma")]
    #[allow(clippy::too_many_arguments)] // the micro-kernel ABI
    pub unsafe fn kernel_avx2<const MR: usize, const PREFETCH: bool, const AHEAD: bool>(
        kc: usize,
        a: *const f32,
        lda: usize,
        b: *const f32,
        ldb: usize,
        c: *mut f32,
        ldc: usize,
        accumulate: bool,
        ahead: super::Ahead,
    ) {
        let mut acc = [[_mm256_setzero_ps(); 2]; MR];
        prefetch_tile_for_write::<MR>(c, ldc, 16);
        let (mut a, mut b) = (a, b);
        // One step: one column of the MR rows of A times one row of the B panel, after
        // `$prefetch` (given the row's address).
        macro_rules! steps {
            ($prefetch:expr) => {
                for _ in 0..kc {
                    // SAFETY: each step reads one column of the MR rows of A and NR
                    // values of the B panel.
                    unsafe {
                        let b0 = _mm256_loadu_ps(b);
                        let b1 = _mm256_loadu_ps(b.add(8));
                        $prefetch(b);
                        for (i, row) in acc.iter_mut().enumerate() {
                            let x = _mm256_set1_ps(*a.add(i * lda));
                            row[0] = _mm256_fmadd_ps(x, b0, row[0]);
                            row[1] = _mm256_fmadd_ps(x, b1, row[1]);
                        }
                        a = a.add(1);
                        b = b.add(ldb);
                    }
                }
            };
        }
        if AHEAD && ahead.lines > 0 {
            let mut cursor = super::AheadCursor::new(ahead, kc);
            steps!(|_| cursor.step());
        } else if PREFETCH {
            // A prefetch never faults, so running past the panel is harmless; the
            // second covers a row that straddles two lines.
            steps!(|row: *const f32| {
                let ahead = row.wrapping_add(AVX2_PREFETCH_ROWS * ldb);
                _mm_prefetch::<_MM_HINT_T0>(ahead.cast::<i8>());
                _mm_prefetch::<_MM_HINT_T0>(ahead.wrapping_add(15).cast::<i8>());
            });
        } else {
            steps!(|_| ());
        }
        for (i, row) in acc.iter().enumerate() {
            // SAFETY: the tile is MR x NR with row stride `ldc`.
            unsafe {
                let dst = c.add(i * ldc);
                let (mut v0, mut v1) = (row[0], row[1]);
                if accumulate {
                    v0 = _mm256_add_ps(v0, _mm256_loadu_ps(dst));
                    v1 = _mm256_add_ps(v1, _mm256_loadu_ps(dst.add(8)));
                }
                _mm256_storeu_ps(dst, v0);
                _mm256_storeu_ps(dst.add(8), v1);
            }
        }
    }
}
