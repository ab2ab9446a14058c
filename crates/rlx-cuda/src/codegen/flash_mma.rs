//! The flash attention kernel on tensor cores, for `f16` heads whose widths are
//! multiples of 16 (queries and keys) and 8 (values), up to 256: the shapes of
//! transformer models. Other attentions take the kernel in [`super::flash`].
//!
//! One warp owns 16 query rows, four warps a block. The queries stay in registers as
//! the A operands of `mma.m16n8k16` (f16 in, f32 accumulated). Per tile of keys,
//! staged in shared memory as stored: the scores `Q K^T` come out of the tensor
//! cores into registers, each thread holding two rows' values; the online softmax
//! works on them there, its row maximum and sum taken across the four threads that
//! share a row; the weights, rounded to f16, are already laid out as the A operand of
//! `P V` (FlashAttention's register trick), which accumulates the output in f32.
//! Masks, the causal limit and the all-masked rule are those of the other kernel.

use super::flash::Geometry;
use super::{Grid, Kernel};
use rlx_ir::DType;
use std::fmt::Write;

/// Query rows of a warp (the `m` of the instruction).
const WARP_ROWS: usize = 16;
/// Warps per block.
const WARPS: usize = 4;
/// Shared memory a block may use without opting in to more.
const SHARED_BYTES: usize = 48 * 1024;
/// Halves of padding after each staged key or value row (16 bytes), so the rows
/// that a warp's lanes read start in different banks.
const PAD: usize = 8;

/// The tensor-core kernel for the attention `g`, or `None` when its shapes or dtype
/// do not fit it.
pub(super) fn kernel(name: &str, dt: DType, g: &Geometry) -> Option<Kernel> {
    let (d, dv) = (g.d, g.dv);
    if dt != DType::F16 || d == 0 || d % 16 != 0 || dv == 0 || dv % 8 != 0 || d > 256 || dv > 256 {
        return None;
    }
    let (ks, vs) = (d + PAD, dv + PAD);
    // Shared bytes a staged key takes: its key and value rows and its mask.
    let per_key = (ks + vs) * 2 + 4;
    let mut k_tile = 64;
    while k_tile > 16 && k_tile * per_key > SHARED_BYTES {
        k_tile /= 2;
    }
    // Keys staged at once: whole tiles, as many as shared memory holds up to the
    // key count, so a short sequence is loaded in one go with every load in flight
    // (a load loop that waits for each load was most of the kernel's time).
    let mut staged = k_tile;
    while staged < g.sk && staged * 2 * per_key <= SHARED_BYTES {
        staged *= 2;
    }
    // A mask that does not vary by query row is staged with the keys.
    let key_mask = g.mask.is_some_and(|(_, st)| st[2] == 0);
    // Query and key positions (up to a tile past the ends) are compared as 32-bit
    // integers.
    if g.sq.saturating_add(g.sk).saturating_add(1024) >= i32::MAX as usize {
        return None;
    }
    let q_tile = WARP_ROWS * WARPS;
    let tiles = g.sq.div_ceil(q_tile).max(1);
    let (sq, sk) = (g.sq, g.sk);
    let [[qb, qh, qs], _, _, [ob, oh, os]] = g.strides;
    let mut s = String::new();
    let mask_param = match g.mask {
        Some((DType::Bool, _)) => ", const unsigned char* __restrict__ in3",
        Some((DType::F16, _)) => ", const unsigned short* __restrict__ in3",
        Some(_) => return None,
        None => "",
    };
    let _ = writeln!(
        s,
        "extern \"C\" __global__ void __launch_bounds__({threads}) {name}(unsigned short* __restrict__ out, const unsigned short* __restrict__ in0, const unsigned short* __restrict__ in1, const unsigned short* __restrict__ in2{mask_param}) {{",
        threads = WARPS * 32
    );
    let _ = writeln!(
        s,
        "  __shared__ __align__(16) unsigned short ksh[{}]; __shared__ __align__(16) unsigned short vsh[{}]; __shared__ __align__(16) float kmask[{staged}];",
        staged * ks,
        staged * vs
    );
    let _ = writeln!(
        s,
        "  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gq = lane >> 2, tq = lane & 3;\n  const long long tile = blockIdx.x % {tiles}LL, bh = blockIdx.x / {tiles}LL;\n  const long long h = bh % {hq}LL, bi = bh / {hq}LL, hk = h / {group}LL;\n  const long long i0 = tile * {q_tile}LL, ra = i0 + warp * {WARP_ROWS} + gq, rb = ra + 8;\n  const int ira = (int)ra, irb = (int)rb;\n  const float scale = __int_as_float({scale_bits});",
        scale_bits = (g.scale as f32).to_bits() as i32,
        hq = g.hq.max(1),
        group = g.group
    );
    // The queries as A fragments: per 16 columns, rows ra/rb, columns tq*2 and +8.
    let q_at = |row: &str, col: &str| {
        format!(
            "({row} < {sq}LL ? *(const unsigned int*)(in0 + bi * {qb}LL + h * {qh}LL + {row} * {qs}LL + {col}) : 0u)"
        )
    };
    let _ = writeln!(
        s,
        "  unsigned int qa[{steps}][4];\n  #pragma unroll\n  for (int t = 0; t < {steps}; ++t) {{ const int c = t * 16 + tq * 2;\n    qa[t][0] = {}; qa[t][1] = {}; qa[t][2] = {}; qa[t][3] = {}; }}",
        q_at("ra", "c"),
        q_at("rb", "c"),
        q_at("ra", "c + 8"),
        q_at("rb", "c + 8"),
        steps = d / 16
    );
    let _ = writeln!(
        s,
        "  float o[{nb}][4];\n  #pragma unroll\n  for (int n = 0; n < {nb}; ++n) {{ o[n][0] = 0; o[n][1] = 0; o[n][2] = 0; o[n][3] = 0; }}\n  float ma = -RLX_INF, mb = -RLX_INF, la = 0, lb = 0;",
        nb = dv / 8
    );
    s.push_str(&super::flash::key_end(g.causal, q_tile, sq, sk));
    let _ = writeln!(
        s,
        "  for (long long js = 0; js < kend; js += {staged}) {{\n    __syncthreads();"
    );
    s.push_str(&stage(g, staged, ks, vs));
    // The key mask of the staged keys.
    let key_value = if key_mask {
        format!(
            " {{ const long long i = 0; float m = 0.f;{} km = m; }}",
            super::flash::mask_code(g, "m", "")
        )
    } else {
        String::new()
    };
    let _ = writeln!(
        s,
        "    for (int t = threadIdx.x; t < {staged}; t += {threads}) {{ const long long j = js + t; float km = -RLX_INF;\n      if (j < {sk}LL){key_value_or_zero} kmask[t] = km; }}",
        threads = WARPS * 32,
        key_value_or_zero = if key_mask {
            key_value
        } else {
            " km = 0.f;".to_string()
        }
    );
    let _ = writeln!(
        s,
        "    __syncthreads();\n    for (int jt = 0; jt < {staged}; jt += {k_tile}) {{\n    const long long j0 = js + jt;\n    if (j0 >= kend) break;\n    const unsigned short* kt = ksh + jt * {ks}; const unsigned short* vt = vsh + jt * {vs};"
    );
    // Scores.
    let _ = writeln!(
        s,
        "    float sc[{nk}][4];\n    #pragma unroll\n    for (int n = 0; n < {nk}; ++n) {{ sc[n][0] = 0; sc[n][1] = 0; sc[n][2] = 0; sc[n][3] = 0;\n      const unsigned short* kr = kt + (n * 8 + gq) * {ks} + tq * 2;\n      #pragma unroll\n      for (int t = 0; t < {steps}; ++t) rlx_mma(sc[n], qa[t], *(const unsigned int*)(kr + t * 16), *(const unsigned int*)(kr + t * 16 + 8)); }}",
        nk = k_tile / 8,
        steps = d / 16
    );
    // Scale, masks, and each row's tile maximum. The staged key mask (0, or -inf
    // past the last key or where a mask that does not vary by query masks the
    // key) is added to every score; only a causal limit or a mask varying by
    // query is worked out per score.
    let mut per_score = String::new();
    if g.causal {
        let _ = write!(
            per_score,
            " {{ const int i = e < 2 ? ira : irb, j = (int)j0 + n * 8 + tq * 2 + (e & 1); if (j + {sq} > i + {sk}) x = -RLX_INF; }}"
        );
    }
    if !key_mask && g.mask.is_some() {
        let _ = write!(
            per_score,
            " {{ const long long i = e < 2 ? ra : rb, j = j0 + n * 8 + tq * 2 + (e & 1); if (i < {sq}LL && j < {sk}LL) {{{}}} }}",
            super::flash::mask_code(g, "x", "")
        );
    }
    let _ = writeln!(
        s,
        "    float ta = -RLX_INF, tb = -RLX_INF;\n    #pragma unroll\n    for (int n = 0; n < {nk}; ++n) {{ const float2 km = *(const float2*)&kmask[jt + n * 8 + tq * 2];\n      #pragma unroll\n      for (int e = 0; e < 4; ++e) {{ float x = sc[n][e] * scale + ((e & 1) ? km.y : km.x);{per_score}\n        sc[n][e] = x; if (e < 2) ta = x > ta ? x : ta; else tb = x > tb ? x : tb; }} }}",
        nk = k_tile / 8,
    );
    let _ = writeln!(
        s,
        "    ta = fmaxf(ta, __shfl_xor_sync(0xffffffffu, ta, 1)); ta = fmaxf(ta, __shfl_xor_sync(0xffffffffu, ta, 2));\n    tb = fmaxf(tb, __shfl_xor_sync(0xffffffffu, tb, 1)); tb = fmaxf(tb, __shfl_xor_sync(0xffffffffu, tb, 2));\n    const float na = ta > ma ? ta : ma, nb2 = tb > mb ? tb : mb;\n    const float ca = ma == -RLX_INF ? 0.f : __expf(ma - na), cb = mb == -RLX_INF ? 0.f : __expf(mb - nb2);\n    const float za = na == -RLX_INF ? 0.f : na, zb = nb2 == -RLX_INF ? 0.f : nb2;"
    );
    // Weights, their row sums, and the weights as A fragments of P V.
    let _ = writeln!(
        s,
        "    float sa = 0, sb = 0;\n    #pragma unroll\n    for (int n = 0; n < {nk}; ++n) {{\n      #pragma unroll\n      for (int e = 0; e < 4; ++e) {{ const float p = __expf(sc[n][e] - (e < 2 ? za : zb)); sc[n][e] = p; if (e < 2) sa += p; else sb += p; }} }}\n    sa += __shfl_xor_sync(0xffffffffu, sa, 1); sa += __shfl_xor_sync(0xffffffffu, sa, 2);\n    sb += __shfl_xor_sync(0xffffffffu, sb, 1); sb += __shfl_xor_sync(0xffffffffu, sb, 2);\n    la = la * ca + sa; lb = lb * cb + sb; ma = na; mb = nb2;",
        nk = k_tile / 8
    );
    let _ = writeln!(
        s,
        "    #pragma unroll\n    for (int n = 0; n < {nb}; ++n) {{ o[n][0] *= ca; o[n][1] *= ca; o[n][2] *= cb; o[n][3] *= cb; }}",
        nb = dv / 8
    );
    let _ = writeln!(
        s,
        "    #pragma unroll\n    for (int t = 0; t < {kk}; ++t) {{\n      unsigned int pa[4] = {{ rlx_pack(sc[2 * t][0], sc[2 * t][1]), rlx_pack(sc[2 * t][2], sc[2 * t][3]), rlx_pack(sc[2 * t + 1][0], sc[2 * t + 1][1]), rlx_pack(sc[2 * t + 1][2], sc[2 * t + 1][3]) }};\n{pv}\n  }}\n  }}",
        kk = k_tile / 16,
        pv = value_products(dv, vs)
    );
    let _ = writeln!(
        s,
        "  #pragma unroll\n  for (int n = 0; n < {nb}; ++n) {{ const int c = n * 8 + tq * 2;\n    if (ra < {sq}LL) {{ unsigned short* d = out + bi * {ob}LL + h * {oh}LL + ra * {os}LL + c; d[0] = f2h(la == 0 ? 0.f : o[n][0] / la); d[1] = f2h(la == 0 ? 0.f : o[n][1] / la); }}\n    if (rb < {sq}LL) {{ unsigned short* d = out + bi * {ob}LL + h * {oh}LL + rb * {os}LL + c; d[0] = f2h(lb == 0 ? 0.f : o[n][2] / lb); d[1] = f2h(lb == 0 ? 0.f : o[n][3] / lb); }} }}\n}}",
        nb = dv / 8
    );
    Some(Kernel {
        source: s,
        grid: Grid::Blocks {
            count: g.b * g.hq * tiles,
            threads: (WARPS * 32) as u32,
        },
        check: None,
    })
}

/// Statements copying keys `js..js + staged` of `g`'s `k` and `v` into `ksh` and
/// `vsh` (rows `ks` and `vs` halves apart), zeros past the last key. Every thread
/// issues its loads (up to four of each tensor) before storing any, so they are in
/// flight together; 16 bytes a load where the operands' strides allow and their
/// addresses turn out aligned, else 4.
fn stage(g: &Geometry, staged: usize, ks: usize, vs: usize) -> String {
    let threads = WARPS * 32;
    let [_, [kb, kh, kst], [vb, vh, vst], _] = g.strides;
    let sk = g.sk;
    let tensors = [
        ("ksh", "in1", g.d, ks, [kb, kh, kst]),
        ("vsh", "in2", g.dv, vs, [vb, vh, vst]),
    ];
    // One copy loop over `unit`-half pieces (`ty`: the C type of one).
    let copy = |unit: usize, ty: &str, zero: &str| {
        let chunks = tensors.map(|(_, _, width, ..)| staged * width / unit);
        let per = chunks[0].max(chunks[1]).div_ceil(threads);
        let mut c = format!(
            "    #pragma unroll\n    for (int u0 = 0; u0 < {per}; u0 += 4) {{\n      {ty} kx[4], vx[4];\n      #pragma unroll\n      for (int u = 0; u < 4; ++u) {{ const int t = threadIdx.x + (u0 + u) * {threads};\n"
        );
        for ((buf, src, width, _, [sb, sh, sst]), count) in tensors.iter().zip(chunks) {
            let x = &buf[..1];
            let _ = writeln!(
                c,
                "        {{ const int r = t / {w}, c = (t % {w}) * {unit}; const long long j = js + r;\n          {x}x[u] = u0 + u < {per} && t < {count} && j < {sk}LL ? *(const {ty}*)({src} + bi * {sb}LL + hk * {sh}LL + j * {sst}LL + c) : {zero}; }}",
                w = width / unit
            );
        }
        c.push_str(&format!(
            "      }}\n      #pragma unroll\n      for (int u = 0; u < 4; ++u) {{ const int t = threadIdx.x + (u0 + u) * {threads};\n"
        ));
        for ((buf, _, width, stride, _), count) in tensors.iter().zip(chunks) {
            let x = &buf[..1];
            let _ = writeln!(
                c,
                "        if (u0 + u < {per} && t < {count}) {{ const int r = t / {w}, c = (t % {w}) * {unit}; *({ty}*)&{buf}[r * {stride} + c] = {x}x[u]; }}",
                w = width / unit
            );
        }
        c.push_str("      }\n    }\n");
        c
    };
    let vector = [g.d, g.dv, kb, kh, kst, vb, vh, vst]
        .iter()
        .all(|s| s.is_multiple_of(8));
    let narrow = copy(2, "unsigned int", "0u");
    if !vector {
        return narrow;
    }
    format!(
        "    if (((((unsigned long long)in1) | ((unsigned long long)in2)) & 15ull) == 0ull) {{\n{}    }} else {{\n{narrow}    }}\n",
        copy(8, "uint4", "rlx_zero4()")
    )
}

/// The `P V` products of one 16-key step `t` into the accumulators `o`, the weights
/// in `pa`: the value fragments of two 8-wide column blocks come from one
/// transposing matrix load (`rlx_ldmatrix_t4`), a last odd block from four
/// 16-bit loads.
fn value_products(dv: usize, vs: usize) -> String {
    let blocks = dv / 8;
    let mut s = format!(
        "      const unsigned short* vrow = vt + (t * 16 + (lane & 7) + ((lane >> 3) & 1) * 8) * {vs} + (lane >> 4) * 8;\n      #pragma unroll\n      for (int n = 0; n + 1 < {blocks}; n += 2) {{ unsigned int vb[4]; rlx_ldmatrix_t4(vb, vrow + n * 8);\n        rlx_mma(o[n], pa, vb[0], vb[1]); rlx_mma(o[n + 1], pa, vb[2], vb[3]); }}"
    );
    if blocks % 2 == 1 {
        let n = blocks - 1;
        let _ = write!(
            s,
            "\n      {{ const unsigned short* vr = vt + (t * 16 + tq * 2) * {vs} + gq + {n} * 8;\n        rlx_mma(o[{n}], pa, (unsigned int)vr[0] | ((unsigned int)vr[{vs}] << 16), (unsigned int)vr[8 * {vs}] | ((unsigned int)vr[9 * {vs}] << 16)); }}"
        );
    }
    s.push_str(" }");
    s
}
