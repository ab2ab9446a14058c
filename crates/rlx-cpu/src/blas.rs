//! Public entry points to the CPU's dense kernels, for benchmarks and for programs that
//! want a fast matrix product without building a graph.

use crate::gemm::{
    BFormat, Epilogue, Gemm, GemmScratch, amx_available, best_kernel, pack_b_panels, packed_len,
    sgemm_with_precision,
};
use crate::pool::ThreadPool;
use rlx_ir::{Error, Result};

/// `c = a · b` for row-major `a [m, k]`, `b [k, n]`, `c [m, n]`, on up to `threads`
/// threads of the global pool. Lengths are checked. The packing buffers are kept per
/// calling thread, so repeated calls allocate nothing.
pub fn matmul_f32(
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    dims: (usize, usize, usize),
    threads: usize,
) -> Result<()> {
    product(a, b, c, dims, threads, false)
}

/// [`matmul_f32`] with the operands rounded to bfloat16 and the products summed in
/// `f32`, on AMX tiles where the CPU has them ([`has_amx`]); elsewhere the same as
/// [`matmul_f32`].
pub fn matmul_bf16_products(
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    dims: (usize, usize, usize),
    threads: usize,
) -> Result<()> {
    product(a, b, c, dims, threads, true)
}

/// Whether this CPU has AMX tiles for bfloat16 products (and the OS lets RLX use
/// them): where [`matmul_bf16_products`] and programs compiled with bf16 products
/// allowed run faster than in `f32`.
pub fn has_amx() -> bool {
    amx_available()
}

fn product(
    a: &[f32],
    b: &[f32],
    c: &mut [f32],
    (m, n, k): (usize, usize, usize),
    threads: usize,
    bf16_products: bool,
) -> Result<()> {
    check_lengths(&[
        ("a", a.len(), m * k),
        ("b", b.len(), k * n),
        ("c", c.len(), m * n),
    ])?;
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
        epilogue: Epilogue::NONE,
    };
    // SAFETY: the lengths were checked above; `c` is a distinct mutable borrow.
    unsafe { run_with_thread_scratch(&g, threads, bf16_products) }
}

/// A row-major `[k, n]` matrix packed once into the GEMM kernel's panel layout, for
/// repeated products [`matmul_f32_packed`] that then skip packing and read `B` as one
/// contiguous stream per panel (what a compiled graph does with its weights).
pub struct PackedMatrix {
    data: Vec<f32>,
    k: usize,
    n: usize,
    nr: usize,
}

impl PackedMatrix {
    /// Packs `b` (`k * n` values, checked).
    pub fn new(b: &[f32], k: usize, n: usize) -> Result<PackedMatrix> {
        check_lengths(&[("b", b.len(), k * n)])?;
        let mut data = vec![0.0; packed_len(k, n)];
        let nr = pack_b_panels(b, k, n, &mut data);
        Ok(PackedMatrix { data, k, n, nr })
    }

    /// `(k, n)`: the rows and columns of the matrix it holds.
    pub fn dims(&self) -> (usize, usize) {
        (self.k, self.n)
    }
}

/// `c = a · b` as [`matmul_f32`], with `b` packed ahead by [`PackedMatrix::new`]:
/// `a` is `[m, k]` and `c` `[m, n]` (lengths checked).
pub fn matmul_f32_packed(
    a: &[f32],
    b: &PackedMatrix,
    c: &mut [f32],
    m: usize,
    threads: usize,
) -> Result<()> {
    let (k, n) = b.dims();
    check_lengths(&[("a", a.len(), m * k), ("c", c.len(), m * n)])?;
    let g = Gemm {
        m,
        n,
        k,
        a: a.as_ptr(),
        lda: k,
        b: b.data.as_ptr(),
        ldb: n,
        a_transposed: false,
        b_transposed: false,
        b_format: BFormat::Packed {
            nr: b.nr,
            streamed: true,
        },
        c: c.as_mut_ptr(),
        ldc: n,
        accumulate: false,
        epilogue: Epilogue::NONE,
    };
    // SAFETY: the lengths were checked above and `b` holds its packed panels.
    unsafe { run_with_thread_scratch(&g, threads, false) }
}

fn check_lengths(operands: &[(&str, usize, usize)]) -> Result<()> {
    for &(name, got, want) in operands {
        if got != want {
            return Err(Error::LengthMismatch {
                kind: "matrix",
                name: name.into(),
                expected: want,
                got,
                unit: "elements",
            });
        }
    }
    Ok(())
}

/// Runs `g` on the global pool with packing buffers kept per calling thread and
/// thread count, so repeated calls allocate nothing after the first, as a compiled
/// graph's runs do.
///
/// # Safety
/// As [`sgemm`].
unsafe fn run_with_thread_scratch(g: &Gemm, threads: usize, bf16_products: bool) -> Result<()> {
    thread_local! {
        static SCRATCH: std::cell::RefCell<Option<GemmScratch>> = const { std::cell::RefCell::new(None) };
    }
    let threads = threads.max(1);
    SCRATCH.with(|cell| {
        let mut slot = cell.borrow_mut();
        if slot.as_ref().is_none_or(|s| s.threads() != threads) {
            // Sized for the AMX path too: the same thread may ask for either.
            *slot = Some(GemmScratch::with_amx(threads, 0));
        }
        let scratch = slot
            .as_ref()
            .ok_or_else(|| Error::runtime("matmul_f32", "no scratch"))?;
        // SAFETY: forwarded contract.
        unsafe { sgemm_with_precision(g, ThreadPool::global(), scratch, bf16_products) }
    })
}

/// The name of the GEMM micro-kernel this CPU uses (`avx512`, `avx2` or `generic`).
pub fn gemm_kernel_name() -> &'static str {
    best_kernel().name
}

/// Measures the CPU's peak `f32` multiply-add rate in GFLOP/s (2 flops per FMA) with
/// independent FMA chains in registers, on `threads` threads at once, for about
/// `millis` milliseconds.
pub fn peak_fma_gflops(threads: usize, millis: u64) -> f64 {
    let threads = threads.max(1);
    let results: Vec<f64> = std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| s.spawn(move || single_core_peak(millis)))
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or(0.0))
            .collect()
    });
    results.iter().sum()
}

fn single_core_peak(millis: u64) -> f64 {
    let deadline = std::time::Duration::from_millis(millis);
    let start = std::time::Instant::now();
    let mut flops = 0.0f64;
    let mut sink = 0.0f32;
    while start.elapsed() < deadline {
        let (f, s) = fma_burst(1 << 16);
        flops += f;
        sink += s;
    }
    std::hint::black_box(sink);
    flops / start.elapsed().as_secs_f64() / 1e9
}

/// Runs `iters` rounds of independent FMAs; returns (flops, a value to keep).
fn fma_burst(iters: usize) -> (f64, f32) {
    #[cfg(target_arch = "x86_64")]
    {
        let isa = crate::isa::isa();
        if isa.avx512f {
            // SAFETY: AVX-512F is available.
            return unsafe { x86::burst_avx512(iters) };
        }
        if isa.avx2_fma {
            // SAFETY: AVX2 and FMA are available.
            return unsafe { x86::burst_avx2(iters) };
        }
    }
    let mut acc = [1.0f32; 16];
    for _ in 0..iters {
        for a in acc.iter_mut() {
            *a = a.mul_add(0.999_999, 1e-7);
        }
    }
    ((iters * 16 * 2) as f64, acc.iter().sum())
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    const CHAINS: usize = 12;

    #[target_feature(enable = "avx512f")]
    pub unsafe fn burst_avx512(iters: usize) -> (f64, f32) {
        let mut acc = [_mm512_set1_ps(1.0); CHAINS];
        let m = _mm512_set1_ps(0.999_999);
        let a = _mm512_set1_ps(1e-7);
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm512_fmadd_ps(*x, m, a);
            }
        }
        let mut total = _mm512_setzero_ps();
        for x in acc {
            total = _mm512_add_ps(total, x);
        }
        (
            (iters * CHAINS * 16 * 2) as f64,
            _mm512_reduce_add_ps(total),
        )
    }

    #[target_feature(enable = "avx2,fma")]
    pub unsafe fn burst_avx2(iters: usize) -> (f64, f32) {
        let mut acc = [_mm256_set1_ps(1.0); CHAINS];
        let m = _mm256_set1_ps(0.999_999);
        let a = _mm256_set1_ps(1e-7);
        for _ in 0..iters {
            for x in acc.iter_mut() {
                *x = _mm256_fmadd_ps(*x, m, a);
            }
        }
        let mut lanes = [0.0f32; 8];
        let mut total = _mm256_setzero_ps();
        for x in acc {
            total = _mm256_add_ps(total, x);
        }
        // SAFETY: `lanes` holds 8 floats.
        unsafe { _mm256_storeu_ps(lanes.as_mut_ptr(), total) };
        ((iters * CHAINS * 8 * 2) as f64, lanes.iter().sum())
    }
}
