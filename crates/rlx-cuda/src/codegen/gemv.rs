//! Matrix-vector products: a product of a few rows (a decode step) against a 2-D
//! weight, reading the weight as stored (`f16`/`bf16` beside `f32` activations
//! included) once, with the epilogue applied before the store.
//!
//! [`gemv`] takes the weight as `b [K, N]` (the IR's layout): lanes own columns, so
//! `K` is split over blocks whose partial sums meet in a workspace. [`gemv_rows`]
//! takes it as `[N, K]` (a linear layer's stored layout): a warp owns an output and
//! walks its contiguous row, with no partial sums to meet.
//!
//! Both ask L2 for the first part of their weights before waiting for the kernel
//! ahead of them (`RLX_ENTER`), so under a programmatic launch the weights stream
//! in while that kernel finishes.

use super::fused::{Epilogue, rounded};
use super::{Grid, Kernel, ctype, load, store};
use rlx_ir::{DType, Result};
use std::fmt::Write;

/// Threads of a matrix-vector block: 8 warps.
pub(crate) const GEMV_THREADS: u32 = 256;
/// Output columns one [`gemv`] block covers: 32 lanes of 8 columns.
pub(crate) const GEMV_TILE: usize = 256;
/// The most rows a product may have to take the matrix-vector kernel.
pub(crate) const GEMV_MAX_ROWS: usize = 4;
/// Bytes of weights a block prefetches by default.
const PREFETCH_BYTES: usize = 32 << 10;

/// Lanes sharing one 128-byte line when each lane reads 8 elements of `dt`, less one
/// (a lane prefetches when `lane & mask` is 0).
pub(super) fn line_mask(dt: DType) -> usize {
    (128 / (8 * dt.size_in_bytes())).max(1) - 1
}

/// The prefetch of the first rows of a [`gemv`] block's slice, then `RLX_ENTER`.
fn prefetch(s: &mut String, g: &Gemv, bdt: DType) {
    let rows = (g.prefetch_bytes / (GEMV_TILE * bdt.size_in_bytes())).min(g.slice());
    if rows > 0 {
        let _ = writeln!(
            s,
            "  if (col0 < N && (lane & {mask}) == 0) {{\n    const long long p1 = k0 + {rows}LL < k1 ? k0 + {rows}LL : k1;\n    for (long long k = k0 + warp; k < p1; k += 8) rlx_prefetch_l2(b + k * N + col0);\n  }}",
            mask = line_mask(bdt)
        );
    }
    s.push_str("  RLX_ENTER();\n");
}

/// The geometry of a matrix-vector product: `rows` (at most [`GEMV_MAX_ROWS`]) of
/// `a [rows, K]` times `b [K, N]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Gemv {
    pub rows: usize,
    pub k: usize,
    pub n: usize,
    /// Slices of `K` summed by separate blocks (their partial sums meet in the
    /// workspace; the last block of a column tile adds them in order).
    pub splits: usize,
    /// Whether `b`'s rows may be read 16 bytes at a time (`N` a multiple of 8 and
    /// `b` 16-byte aligned).
    pub vector: bool,
    /// Bytes of its slice of `b` each block asks L2 for before it waits for the
    /// kernel ahead of it (0: none). Weights are not written by that kernel, so they
    /// can stream in while it finishes.
    pub prefetch_bytes: usize,
}

impl Gemv {
    /// The split of `K` that gives about `target_blocks` blocks, each slice at least
    /// 64 rows.
    pub fn new(rows: usize, k: usize, n: usize, target_blocks: usize, vector: bool) -> Gemv {
        let tiles = n.div_ceil(GEMV_TILE).max(1);
        let most = k.div_ceil(64).max(1);
        let splits = target_blocks.div_ceil(tiles).clamp(1, most);
        Gemv {
            rows,
            k,
            n,
            splits,
            vector,
            prefetch_bytes: PREFETCH_BYTES,
        }
    }

    /// Column tiles.
    pub fn tiles(&self) -> usize {
        self.n.div_ceil(GEMV_TILE).max(1)
    }

    /// Rows of `K` per split, a multiple of the 8 warps that share them.
    fn slice(&self) -> usize {
        self.k.div_ceil(self.splits).div_ceil(8) * 8
    }

    /// Bytes of partial sums in the workspace.
    pub fn partial_bytes(&self) -> usize {
        if self.splits == 1 {
            0
        } else {
            self.splits * self.rows * self.n * 4
        }
    }
}

/// `out [rows, N] = epilogue(a [rows, K] @ b [K, N])` for a few rows: each block
/// takes 256 columns and one slice of `K`; within it, 32 lanes of 8 columns and 8
/// warps over the rows. Operands: `a`, `b`, the bias and residual if taken, then the
/// workspace's partial sums and per-tile counters (each counter is back to zero when
/// the kernel ends).
pub(crate) fn gemv(
    name: &str,
    g: &Gemv,
    epilogue: &Epilogue,
    adt: DType,
    bdt: DType,
) -> Result<Kernel> {
    let (m, k, n) = (g.rows, g.k, g.n);
    let tiles = g.tiles();
    let mut s = format!(
        "extern \"C\" __global__ void __launch_bounds__({GEMV_THREADS}) {name}({}* __restrict__ out, const {}* __restrict__ a, const {}* __restrict__ b{}, float* __restrict__ part, unsigned int* __restrict__ count) {{\n",
        ctype(adt).storage,
        ctype(adt).storage,
        ctype(bdt).storage,
        epilogue.params(adt)
    );
    let _ = writeln!(
        s,
        "  const long long K = {k}LL, N = {n}LL;\n  const int tile = blockIdx.x % {tiles}, split = blockIdx.x / {tiles};\n  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;\n  const long long col0 = (long long)tile * {GEMV_TILE} + lane * 8;\n  const long long k0 = (long long)split * {slice}LL;\n  const long long k1 = k0 + {slice}LL < K ? k0 + {slice}LL : K;\n  float acc[{m}][8];\n  #pragma unroll\n  for (int r = 0; r < {m}; ++r) {{ for (int j = 0; j < 8; ++j) acc[r][j] = 0.f; }}",
        slice = g.slice()
    );
    prefetch(&mut s, g, bdt);
    let _ = writeln!(
        s,
        "  if (col0 < N) {{\n    #pragma unroll 4\n    for (long long k = k0 + warp; k < k1; k += 8) {{"
    );
    if g.vector {
        row_chunk(&mut s, bdt, "b + k * N + col0", "");
    } else {
        let _ = writeln!(s, "      float w[8];");
        let _ = writeln!(
            s,
            "      #pragma unroll\n      for (int j = 0; j < 8; ++j) w[j] = col0 + j < N ? {} : 0.f;",
            load(bdt, "b", "k * N + col0 + j")
        );
    }
    let _ = writeln!(
        s,
        "      #pragma unroll\n      for (int r = 0; r < {m}; ++r) {{\n        const float x = {};\n        #pragma unroll\n        for (int j = 0; j < 8; ++j) acc[r][j] = fmaf(x, w[j], acc[r][j]);\n      }}\n    }}\n  }}",
        load(adt, "a", "r * K + k")
    );
    // Sum the 8 warps' partial sums through shared memory: thread t owns column t of
    // the tile.
    let _ = writeln!(
        s,
        "  __shared__ float red[{size}];\n  #pragma unroll\n  for (int r = 0; r < {m}; ++r) {{ for (int j = 0; j < 8; ++j) red[(warp * {m} + r) * {GEMV_TILE} + lane * 8 + j] = acc[r][j]; }}\n  __syncthreads();\n  const int t = threadIdx.x;\n  const long long col = (long long)tile * {GEMV_TILE} + t;\n  float sum[{m}];\n  #pragma unroll\n  for (int r = 0; r < {m}; ++r) {{ float v = 0.f; for (int w = 0; w < 8; ++w) v += red[(w * {m} + r) * {GEMV_TILE} + t]; sum[r] = v; }}",
        size = 8 * m * GEMV_TILE
    );
    let c = ctype(adt).compute;
    let mut finish = String::new();
    let _ = writeln!(finish, "    for (int r = 0; r < {m}; ++r) {{");
    let _ = writeln!(finish, "      {c} v = {};", rounded(adt, "total[r]"));
    epilogue.code(&mut finish, adt, "r", "col", n)?;
    let _ = writeln!(
        finish,
        "      out[r * N + col] = {};\n    }}",
        store(adt, "v")
    );
    if g.splits == 1 {
        let _ = writeln!(
            s,
            "  if (col < N) {{\n    const float* total = sum;\n{finish}  }}"
        );
    } else {
        // The last block to finish a tile (counted on its counter after a fence that
        // makes its partial sums visible) adds every split's sums in split order, so
        // the result does not depend on which block finished when.
        let splits = g.splits;
        let _ = writeln!(
            s,
            "  if (col < N) {{ for (int r = 0; r < {m}; ++r) part[((long long)split * {m} + r) * N + col] = sum[r]; }}\n  __threadfence();\n  __syncthreads();\n  __shared__ unsigned int last;\n  if (t == 0) last = atomicAdd(&count[tile], 1u) == {splits}u - 1u;\n  __syncthreads();\n  if (!last) return;\n  __threadfence();\n  if (col < N) {{\n    float total[{m}];\n    for (int r = 0; r < {m}; ++r) {{ float v = 0.f; for (int p = 0; p < {splits}; ++p) v += __ldcg(&part[((long long)p * {m} + r) * N + col]); total[r] = v; }}\n{finish}  }}\n  if (t == 0) count[tile] = 0u;"
        );
    }
    s.push_str("}\n");
    Ok(Kernel {
        source: s,
        grid: Grid::Blocks {
            count: tiles * g.splits,
            threads: GEMV_THREADS,
        },
        check: None,
    })
}

/// The geometry of [`gemv_rows`]: `rows` of `a [rows, K]` against `w [N, K]`.
#[derive(Clone, Copy, Debug)]
pub(crate) struct GemvRows {
    pub rows: usize,
    pub k: usize,
    pub n: usize,
    /// Warps that share one output's row (1, 2, 4 or 8), each taking every
    /// `split`-th 8-element piece; their sums meet in shared memory.
    pub split: usize,
    /// Blocks launched (each block takes `8 / split` outputs at a time).
    pub blocks: usize,
    /// Whether rows may be read 16 bytes at a time (`K` a multiple of 8, `w` and `a`
    /// 16-byte aligned).
    pub vector: bool,
    /// Whether each warp asks L2 for its part of its first row before it waits.
    pub prefetch: bool,
}

/// Rows longer than this are shared by several warps.
pub(crate) const GEMV_ROW_ELEMENTS: usize = 4096;

impl GemvRows {
    /// One warp per output for rows up to [`GEMV_ROW_ELEMENTS`], prefetching its
    /// row; longer rows shared by up to 8 warps (about 1024 elements each) without
    /// the prefetch. Measured with `gemv_bench` on an H100 (bf16, programmatic
    /// launches): 2048 x 2048 in 3.9 us with one warp and the prefetch (4.4 us
    /// without); 8192 x 2048 in 13.3 us with 8 warps, 16.2 us with one, and slower
    /// with the prefetch (its 16 KiB per row crowd out the loads).
    pub fn new(rows: usize, k: usize, n: usize, max_blocks: usize, vector: bool) -> GemvRows {
        let split = if k <= GEMV_ROW_ELEMENTS {
            1
        } else {
            (k / 1024).next_power_of_two()
        };
        let mut g = GemvRows::with_split(rows, k, n, max_blocks, vector, split);
        g.prefetch = g.split == 1;
        g
    }

    /// With `split` warps per output (a power of two up to 8; 1 unless `vector`).
    pub fn with_split(
        rows: usize,
        k: usize,
        n: usize,
        max_blocks: usize,
        vector: bool,
        split: usize,
    ) -> GemvRows {
        let split = if vector {
            split.clamp(1, 8).next_power_of_two()
        } else {
            1
        };
        GemvRows {
            rows,
            k,
            n,
            split,
            blocks: n.div_ceil(8 / split).clamp(1, max_blocks.max(1)),
            vector,
            prefetch: true,
        }
    }
}

/// Statements loading the 8 consecutive weights at address `at` (16-byte aligned) as
/// `float w{tag}[8]`.
pub(super) fn row_chunk(s: &mut String, wdt: DType, at: &str, tag: &str) {
    match wdt {
        DType::F32 => {
            let _ = writeln!(
                s,
                "        const float4 qa{tag} = *reinterpret_cast<const float4*>({at}), qb{tag} = *reinterpret_cast<const float4*>({at} + 4);\n        const float w{tag}[8] = {{qa{tag}.x, qa{tag}.y, qa{tag}.z, qa{tag}.w, qb{tag}.x, qb{tag}.y, qb{tag}.z, qb{tag}.w}};"
            );
        }
        _ => {
            let cvt = if wdt == DType::F16 { "h2f" } else { "bf2f" };
            let _ = writeln!(
                s,
                "        const uint4 q{tag} = *reinterpret_cast<const uint4*>({at});\n        const unsigned int u{tag}[4] = {{q{tag}.x, q{tag}.y, q{tag}.z, q{tag}.w}};\n        float w{tag}[8];\n        #pragma unroll\n        for (int j = 0; j < 4; ++j) {{ w{tag}[2 * j] = {cvt}((unsigned short)(u{tag}[j] & 0xffffu)); w{tag}[2 * j + 1] = {cvt}((unsigned short)(u{tag}[j] >> 16)); }}"
            );
        }
    }
}

/// `out [rows, N] = epilogue(a [rows, K] @ w^T)` with `w [N, K]`: `split` warps per
/// output, their lanes taking 8 consecutive elements of the row at a time, summed
/// across each warp and then (when `split > 1`) across the warps. Operands: `a`,
/// `w`, then the bias and residual if taken.
pub(crate) fn gemv_rows(
    name: &str,
    g: &GemvRows,
    epilogue: &Epilogue,
    adt: DType,
    wdt: DType,
) -> Result<Kernel> {
    let (m, k, n) = (g.rows, g.k, g.n);
    let split = g.split;
    let outputs = 8 / split;
    let mut s = format!(
        "extern \"C\" __global__ void __launch_bounds__({GEMV_THREADS}) {name}({}* __restrict__ out, const {}* __restrict__ a, const {}* __restrict__ b{}) {{\n",
        ctype(adt).storage,
        ctype(adt).storage,
        ctype(wdt).storage,
        epilogue.params(adt)
    );
    let _ = writeln!(
        s,
        "  const long long K = {k}LL, N = {n}LL;\n  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, part = warp % {split}, group = warp / {split};\n  const long long stride = (long long)gridDim.x * {outputs};"
    );
    // Piece `p` of a warp's walk starts at element `(p * split + part) * 32 + lane`
    // pieces of 8 (or single elements).
    let (start, step, elems) = if g.vector && split == 1 {
        ("lane * 8", 256, 8)
    } else if g.vector {
        ("(part * 32 + lane) * 8", 256 * split, 8)
    } else {
        ("lane", 32, 1)
    };
    if g.prefetch {
        let mask = if g.vector { line_mask(wdt) } else { 0 };
        let _ = writeln!(
            s,
            "  const long long first = (long long)blockIdx.x * {outputs} + group;\n  if (first < N && (lane & {mask}) == 0) {{ for (long long k = {start}; k < K; k += {step}) rlx_prefetch_l2(b + first * K + k); }}"
        );
    }
    s.push_str("  RLX_ENTER();\n");
    if split > 1 {
        let _ = writeln!(s, "  __shared__ float red[{}];", 8 * m);
    }
    // One warp per output walks its outputs directly; warps that share an output
    // step through the block's outputs together, so all of them reach every
    // barrier. (The direct walk measured 1.5x faster for 2048 x 2048 in
    // `gemv_bench` than the shared walk with one warp per output.)
    let wt = ctype(wdt).storage;
    if split == 1 {
        let _ = writeln!(
            s,
            "  for (long long col = (long long)blockIdx.x * 8 + warp; col < N; col += stride) {{\n    float acc[{m}];\n    #pragma unroll\n    for (int r = 0; r < {m}; ++r) acc[r] = 0.f;\n    {{\n      const {wt}* row = b + col * K;"
        );
    } else {
        let _ = writeln!(
            s,
            "  for (long long base = (long long)blockIdx.x * {outputs}; base < N; base += stride) {{\n    const long long col = base + group;\n    float acc[{m}];\n    #pragma unroll\n    for (int r = 0; r < {m}; ++r) acc[r] = 0.f;\n    if (col < N) {{\n      const {wt}* row = b + col * K;"
        );
    }
    let _ = writeln!(
        s,
        "      #pragma unroll 8\n      for (long long k = {start}; k < K; k += {step}) {{"
    );
    if g.vector {
        row_chunk(&mut s, wdt, "row + k", "");
        let _ = writeln!(
            s,
            "        #pragma unroll\n        for (int r = 0; r < {m}; ++r) {{"
        );
        if adt == DType::F32 {
            let _ = writeln!(
                s,
                "          const float4 x0 = *reinterpret_cast<const float4*>(a + r * K + k), x1 = *reinterpret_cast<const float4*>(a + r * K + k + 4);\n          acc[r] = fmaf(x0.x, w[0], fmaf(x0.y, w[1], fmaf(x0.z, w[2], fmaf(x0.w, w[3], fmaf(x1.x, w[4], fmaf(x1.y, w[5], fmaf(x1.z, w[6], fmaf(x1.w, w[7], acc[r]))))))));"
            );
        } else {
            let _ = writeln!(
                s,
                "          #pragma unroll\n          for (int j = 0; j < {elems}; ++j) acc[r] = fmaf({}, w[j], acc[r]);",
                load(adt, "a", "r * K + k + j")
            );
        }
        s.push_str("        }\n      }\n    }\n");
    } else {
        let _ = writeln!(
            s,
            "        const float w = {};\n        #pragma unroll\n        for (int r = 0; r < {m}; ++r) acc[r] = fmaf({}, w, acc[r]);\n      }}\n    }}",
            load(wdt, "row", "k"),
            load(adt, "a", "r * K + k")
        );
    }
    let _ = writeln!(
        s,
        "    #pragma unroll\n    for (int r = 0; r < {m}; ++r) acc[r] = warp_sum(acc[r]);"
    );
    if split > 1 {
        // The group's warps meet in shared memory; its first warp adds their sums
        // in order. Every warp of the block passes both barriers on every step.
        let _ = writeln!(
            s,
            "    if (lane == 0) {{ for (int r = 0; r < {m}; ++r) red[warp * {m} + r] = acc[r]; }}\n    __syncthreads();\n    if (part == 0) {{ for (int r = 0; r < {m}; ++r) {{ float t = 0.f; for (int p = 0; p < {split}; ++p) t += red[(warp + p) * {m} + r]; acc[r] = t; }} }}\n    __syncthreads();"
        );
    }
    let c = ctype(adt).compute;
    let _ = writeln!(
        s,
        "    if (lane == 0 && part == 0 && col < N) {{\n      for (int r = 0; r < {m}; ++r) {{\n      {c} v = {};",
        rounded(adt, "acc[r]")
    );
    epilogue.code(&mut s, adt, "r", "col", n)?;
    let _ = writeln!(
        s,
        "      out[r * N + col] = {};\n      }}\n    }}\n  }}\n}}",
        store(adt, "v")
    );
    Ok(Kernel {
        source: s,
        grid: Grid::Blocks {
            count: g.blocks,
            threads: GEMV_THREADS,
        },
        check: None,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_split_of_k_keeps_slices_of_at_least_64_rows() {
        let g = Gemv::new(1, 2048, 2048, 400, true);
        assert_eq!(g.tiles(), 8);
        assert_eq!(g.splits, 32);
        assert_eq!(g.slice(), 64);
        // A wide product needs no split.
        let wide = Gemv::new(1, 2048, 128_256, 400, true);
        assert_eq!(wide.splits, 1);
        assert_eq!(wide.partial_bytes(), 0);
        // Slices cover K.
        let odd = Gemv::new(3, 1000, 100, 400, false);
        assert!(odd.slice() * odd.splits >= 1000);
    }

    #[test]
    fn row_products_take_about_4k_of_a_row_per_warp_within_the_block_limit() {
        let g = GemvRows::new(1, 2048, 2048, 2112, true);
        assert_eq!((g.split, g.blocks), (1, 256));
        let head = GemvRows::new(1, 2048, 128_256, 2112, true);
        assert_eq!(head.blocks, 2112);
        // Long rows are shared by several warps.
        let down = GemvRows::new(1, 8192, 2048, 2112, true);
        assert_eq!((down.split, down.blocks, down.prefetch), (8, 2048, false));
        assert_eq!(GemvRows::new(1, 64, 3, 2112, false).blocks, 1);
    }
}
