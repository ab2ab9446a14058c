//! Attention over whole sequences ([`Op::Attention`]) as one kernel, flash-style: the
//! scores never reach device memory.
//!
//! One block of four warps takes a tile of query rows of one (batch, head); each warp
//! owns `rows` of them. The block walks the keys in tiles staged in shared memory
//! (widened to the accumulator type). For each of its rows a warp scores the tile's
//! keys (one key per lane), folds them into the row's running maximum and sum (the
//! online softmax), and adds the weighted values into the row's outputs, which each
//! lane holds in registers for the output columns it owns. Keys past the causal limit
//! are skipped by whole tiles. Masked scores are `-inf`; a row whose keys are all
//! masked gives zeros, as the decomposition does.

use super::{Grid, Kernel, ctype, f, header, literal, load, store};
use rlx_ir::{DType, Op, Result, Shape};
use std::fmt::Write;

/// Warps per block.
const WARPS: usize = 4;
/// Shared memory a block may use without opting in to more.
const SHARED_BYTES: usize = 48 * 1024;
/// Most accumulators a lane keeps in registers across its rows.
const REGISTER_BUDGET: usize = 64;

/// The sizes of one attention, in head-major terms, and where its operands are.
pub(super) struct Geometry {
    pub b: usize,
    pub hq: usize,
    pub sq: usize,
    pub sk: usize,
    /// Query/key head width.
    pub d: usize,
    /// Value head width.
    pub dv: usize,
    /// Query heads per key/value head.
    pub group: usize,
    /// Batch, head and sequence strides of `q`, `k`, `v` and the output.
    pub strides: [[usize; 3]; 4],
    pub causal: bool,
    pub scale: f64,
    /// The mask's dtype and its strides over `[B, Hq, Sq, Sk]`.
    pub mask: Option<(DType, [i64; 4])>,
}

/// Element strides of the batch, head and sequence axes of a `[B, H, S, D]` tensor
/// (or `[B, S, H, D]` when `seq_major`), given as stored.
fn axis_strides(s: &Shape, seq_major: bool) -> [usize; 3] {
    let [d1, d2, d3] = [s.dim(1), s.dim(2), s.dim(3)];
    let batch = d1 * d2 * d3;
    if seq_major {
        // [B, S, H, D]: heads are D apart, positions H * D.
        [batch, d3, d2 * d3]
    } else {
        [batch, d2 * d3, d3]
    }
}

/// A tile of rows copied into shared memory (widened to the accumulator type), zeros
/// past the last row.
struct Staged<'a> {
    indent: &'a str,
    /// The shared array; row `r` of the tile starts at `r * stride`.
    buf: &'a str,
    /// The variable holding the tile's first row, and the name of a row's index.
    first: &'a str,
    row: &'a str,
    rows: usize,
    width: usize,
    stride: usize,
    /// Rows past this many are zeros.
    limit: usize,
    /// The operand read, its dtype, the offset of its row 0 and its row stride.
    src: &'a str,
    dtype: DType,
    base: String,
    row_stride: usize,
}

/// Writes the loop that stages `t` (all threads of the block share it).
fn stage(s: &mut String, t: &Staged, acc: &str) {
    let w = t.width.max(1);
    let at = if t.stride == t.width {
        "t".to_string()
    } else {
        format!("(t / {w}) * {} + t % {w}", t.stride)
    };
    let _ = writeln!(
        s,
        "{ind}for (int t = threadIdx.x; t < {n}; t += blockDim.x) {{ const long long {r} = {first} + t / {w}; {buf}[{at}] = {r} < {limit}LL ? ({acc}){} : ({acc})0; }}",
        load(
            t.dtype,
            t.src,
            &format!(
                "({} + {r} * {}LL + t % {w})",
                t.base,
                t.row_stride,
                r = t.row
            )
        ),
        ind = t.indent,
        n = t.rows * t.width,
        r = t.row,
        first = t.first,
        buf = t.buf,
        limit = t.limit,
    );
}

/// The condition under which query row `i` scores key `j`: both exist (a tile's
/// rows past the last query read no mask element), and under a causal mask the key
/// is not after the query.
pub(super) fn visible(causal: bool, sq: usize, sk: usize) -> String {
    let both = format!("i < {sq}LL && j < {sk}LL");
    if causal {
        format!("{both} && j + {sq}LL <= i + {sk}LL")
    } else {
        both
    }
}

/// Statements applying `g`'s mask to the score `var` of query `i`, key `j`: a `false`
/// bool masks it to `-inf`, an additive mask is added (read through `cast`).
pub(super) fn mask_code(g: &Geometry, var: &str, cast: &str) -> String {
    let Some((dtype, st)) = g.mask else {
        return String::new();
    };
    let off = format!(
        "(bi * ({}LL) + h * ({}LL) + i * ({}LL) + j * ({}LL))",
        st[0], st[1], st[2], st[3]
    );
    if dtype == DType::Bool {
        format!(" if (!in3[{off}]) {var} = -RLX_INF;")
    } else {
        format!(" {var} += {cast}{};", load(dtype, "in3", &off))
    }
}

/// `kend`: the keys a block of `q_tile` query rows from `i0` can see (under a causal
/// mask, up to its last row's limit).
pub(super) fn key_end(causal: bool, q_tile: usize, sq: usize, sk: usize) -> String {
    if causal {
        format!(
            "  const long long last = (i0 + {q_tile}LL < {sq}LL ? i0 + {q_tile}LL : {sq}LL) - 1;\n  const long long kend = last + {sk}LL - {sq}LL + 1 < {sk}LL ? last + {sk}LL - {sq}LL + 1 : {sk}LL;\n"
        )
    } else {
        format!("  const long long kend = {sk}LL;\n")
    }
}

/// The kernel for `op`, or `None` when it is not one of this module's.
/// `tensor_cores`: the GPU has the instructions of [`super::flash_mma`].
pub(super) fn kernel(
    name: &str,
    op: &Op,
    inputs: &[Shape],
    out: &Shape,
    tensor_cores: bool,
) -> Result<Option<Kernel>> {
    let Op::Attention {
        scale,
        causal,
        seq_major,
    } = op
    else {
        return Ok(None);
    };
    let (q, k, v) = (&inputs[0], &inputs[1], &inputs[2]);
    let mask = inputs.get(3);
    let head_major = |s: &Shape| -> [usize; 4] {
        if *seq_major {
            [s.dim(0), s.dim(2), s.dim(1), s.dim(3)]
        } else {
            [s.dim(0), s.dim(1), s.dim(2), s.dim(3)]
        }
    };
    let [b, hq, sq, d] = head_major(q);
    let [_, hkv, sk, _] = head_major(k);
    let dv = head_major(v)[3];
    let group = (hq / hkv.max(1)).max(1);
    let dt = q.dtype();
    let geometry = Geometry {
        b,
        hq,
        sq,
        sk,
        d,
        dv,
        group,
        strides: [q, k, v, out].map(|s| axis_strides(s, *seq_major)),
        causal: *causal,
        scale: scale.get(),
        mask: mask.map(|m| {
            let st = super::broadcast_strides(m.dims(), &[b, hq, sq, sk]);
            (m.dtype(), [st[0], st[1], st[2], st[3]])
        }),
    };
    if tensor_cores
        && out.num_elements() > 0
        && let Some(k) = super::flash_mma::kernel(name, dt, &geometry)
    {
        return Ok(Some(k));
    }
    let acc = ctype(dt).compute;
    let acc_size = if acc == "double" { 8 } else { 4 };
    let per_lane = dv.div_ceil(32).max(1);
    if per_lane > REGISTER_BUDGET {
        return Err(super::unsupported(format!(
            "attention with value heads of {dv} (at most {})",
            REGISTER_BUDGET * 32
        )));
    }
    let rows = (REGISTER_BUDGET / per_lane).clamp(1, 4);
    let q_tile = rows * WARPS;
    // Key rows are padded to an odd stride, so lanes reading one column of
    // different keys hit different banks.
    let k_stride = d | 1;
    let shared = |kt: usize| (q_tile * d + kt * (k_stride + dv) + q_tile * kt) * acc_size;
    let mut k_tile = 64;
    while k_tile > 1 && shared(k_tile) > SHARED_BYTES {
        k_tile /= 2;
    }
    if shared(k_tile) > SHARED_BYTES {
        return Err(super::unsupported(format!(
            "attention with heads of {d} and {dv}: too large for one block's shared memory"
        )));
    }
    let tiles = sq.div_ceil(q_tile).max(1);
    let [[qb, qh, qs], [kb, kh, ks], [vb, vh, vs], [ob, oh, os]] = geometry.strides;
    let fdt = if acc == "double" {
        DType::F64
    } else {
        DType::F32
    };
    let exp = f("exp", fdt);
    let mut ins: Vec<DType> = vec![q.dtype(), k.dtype(), v.dtype()];
    ins.extend(mask.map(Shape::dtype));
    let mut s = header(name, out.dtype(), &ins);
    let _ = writeln!(
        s,
        "  __shared__ {acc} qsh[{}]; __shared__ {acc} ksh[{}]; __shared__ {acc} vsh[{}]; __shared__ {acc} psh[{}];",
        (q_tile * d).max(1),
        (k_tile * k_stride).max(1),
        (k_tile * dv).max(1),
        WARPS * rows * k_tile
    );
    let _ = writeln!(
        s,
        "  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;\n  const long long tile = blockIdx.x % {tiles}LL, bh = blockIdx.x / {tiles}LL;\n  const long long h = bh % {hq}LL, bi = bh / {hq}LL, hk = h / {group}LL;\n  const long long i0 = tile * {q_tile}LL;",
        hq = hq.max(1)
    );
    stage(
        &mut s,
        &Staged {
            indent: "  ",
            buf: "qsh",
            first: "i0",
            row: "i",
            rows: q_tile,
            width: d,
            stride: d,
            limit: sq,
            src: "in0",
            dtype: q.dtype(),
            base: format!("bi * {qb}LL + h * {qh}LL"),
            row_stride: qs,
        },
        acc,
    );
    let _ = writeln!(
        s,
        "  {acc} m[{rows}], l[{rows}], o[{rows}][{per_lane}];\n  #pragma unroll\n  for (int r = 0; r < {rows}; ++r) {{ m[r] = -RLX_INF; l[r] = 0;\n    #pragma unroll\n    for (int e = 0; e < {per_lane}; ++e) o[r][e] = 0; }}"
    );
    s.push_str(&key_end(*causal, q_tile, sq, sk));
    let _ = writeln!(
        s,
        "  for (long long j0 = 0; j0 < kend; j0 += {k_tile}) {{\n    __syncthreads();"
    );
    for (buf, src, dtype, width, stride, row_stride, base) in [
        (
            "ksh",
            "in1",
            k.dtype(),
            d,
            k_stride,
            ks,
            format!("bi * {kb}LL + hk * {kh}LL"),
        ),
        (
            "vsh",
            "in2",
            v.dtype(),
            dv,
            dv,
            vs,
            format!("bi * {vb}LL + hk * {vh}LL"),
        ),
    ] {
        stage(
            &mut s,
            &Staged {
                indent: "    ",
                buf,
                first: "j0",
                row: "j",
                rows: k_tile,
                width,
                stride,
                limit: sk,
                src,
                dtype,
                base,
                row_stride,
            },
            acc,
        );
    }
    s.push_str("    __syncthreads();\n");
    // Scores: one key per lane, for all of the warp's rows at once (each key
    // element read from shared memory once for every row).
    let visible = visible(*causal, sq, sk);
    let mask_code = mask_code(&geometry, "sc", &format!("({acc})"));
    let _ = writeln!(
        s,
        "    {acc}* p = psh + warp * {rows} * {k_tile};\n    for (int jj = lane; jj < {k_tile}; jj += 32) {{\n      const long long j = j0 + jj; {acc} t[{rows}];\n      #pragma unroll\n      for (int r = 0; r < {rows}; ++r) t[r] = 0;\n      const {acc}* kr = ksh + jj * {k_stride}; const {acc}* qr = qsh + warp * {rows} * {d};\n      for (int c = 0; c < {d}; ++c) {{ const {acc} kv = kr[c];\n        #pragma unroll\n        for (int r = 0; r < {rows}; ++r) t[r] += qr[r * {d} + c] * kv; }}\n      #pragma unroll\n      for (int r = 0; r < {rows}; ++r) {{ const long long i = i0 + warp * {rows} + r; {acc} sc = -RLX_INF;\n        if ({visible}) {{ sc = t[r] * {};{mask_code} }}\n        p[r * {k_tile} + jj] = sc; }}\n    }}\n    __syncwarp();",
        literal(scale.get(), fdt)
    );
    // The online softmax, row by row: rescale what was summed so far to the new
    // maximum and turn the tile's scores into weights.
    let _ = writeln!(
        s,
        "    #pragma unroll\n    for (int r = 0; r < {rows}; ++r) {{\n      {acc}* pr = p + r * {k_tile};\n      {acc} tm = -RLX_INF; for (int jj = lane; jj < {k_tile}; jj += 32) tm = pr[jj] > tm ? pr[jj] : tm;\n      tm = warp_max(tm);\n      const {acc} mn = tm > m[r] ? tm : m[r];\n      if (mn == -RLX_INF) {{ for (int jj = lane; jj < {k_tile}; jj += 32) pr[jj] = 0; continue; }}\n      const {acc} corr = m[r] == -RLX_INF ? ({acc})0 : {exp}(m[r] - mn);\n      {acc} ts = 0; for (int jj = lane; jj < {k_tile}; jj += 32) {{ const {acc} e = pr[jj] == -RLX_INF ? ({acc})0 : {exp}(pr[jj] - mn); pr[jj] = e; ts += e; }}\n      ts = warp_sum(ts);\n      l[r] = l[r] * corr + ts; m[r] = mn;\n      #pragma unroll\n      for (int e = 0; e < {per_lane}; ++e) o[r][e] *= corr;\n    }}\n    __syncwarp();"
    );
    // Weighted values: each value element read once for every row.
    let _ = writeln!(
        s,
        "    const int kn = kend - j0 < {k_tile} ? (int)(kend - j0) : {k_tile};\n    for (int jj = 0; jj < kn; ++jj) {{ const {acc}* vr = vsh + jj * {dv};\n      #pragma unroll\n      for (int e = 0; e < {per_lane}; ++e) {{ const int c = lane + 32 * e; const {acc} vv = c < {dv} ? vr[c] : ({acc})0;\n        #pragma unroll\n        for (int r = 0; r < {rows}; ++r) o[r][e] += p[r * {k_tile} + jj] * vv; }} }}\n    __syncwarp();\n  }}"
    );
    let _ = writeln!(
        s,
        "  #pragma unroll\n  for (int r = 0; r < {rows}; ++r) {{ const long long i = i0 + warp * {rows} + r; if (i >= {sq}LL) continue;\n    #pragma unroll\n    for (int e = 0; e < {per_lane}; ++e) {{ const int c = lane + 32 * e; if (c < {dv}) out[bi * {ob}LL + h * {oh}LL + i * {os}LL + c] = {}; }} }}",
        store(out.dtype(), "(l[r] == 0 ? 0 : o[r][e] / l[r])")
    );
    s.push_str("}\n");
    let count = if out.num_elements() == 0 {
        0
    } else {
        b * hq * tiles
    };
    Ok(Some(Kernel {
        source: s,
        grid: Grid::Blocks {
            count,
            threads: (WARPS * 32) as u32,
        },
        check: None,
    }))
}
