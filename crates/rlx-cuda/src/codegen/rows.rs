//! Ops that normalize along one axis, each as one kernel: layer and RMS norm over the
//! last axis, softmax and log-softmax over any. One block per row (the elements that
//! share every index but the axis): the block reduces the row in the accumulator type
//! (`float`, `double` for f64), then writes it, reading it again from cache. Half
//! inputs are computed in `float` and rounded once, as their decomposition would.

use super::{Grid, Kernel, ctype, f, header, literal, load, store};
use rlx_ir::{DType, Op, Shape};
use std::fmt::Write;

/// The most threads a row gets.
const MAX_THREADS: usize = 256;

/// Norms of at least this many rows take a warp per row (no block barriers); fewer
/// rows take a block each, to spread one row's work wider.
const WARP_ROWS_FROM: usize = 256;
/// The longest row a warp normalizes alone.
const WARP_ROW_MAX: usize = 4096;

/// Writes the part of a row kernel after the row's base offset is known.
type Body = fn(&mut String, &Op, &[Shape], &str);

/// The kernel for `op`, or `None` when it is not one of this module's.
pub(super) fn kernel(name: &str, op: &Op, inputs: &[Shape], out: &Shape) -> Option<Kernel> {
    let x = inputs.first()?;
    let (axis, body): (usize, Body) = match op {
        Op::LayerNorm { .. } | Op::RmsNorm { .. } => (x.rank().checked_sub(1)?, norm_body),
        Op::Softmax { axis } | Op::LogSoftmax { axis } => (*axis, softmax_body),
        _ => return None,
    };
    let dims = x.dims();
    let len = *dims.get(axis)?;
    let inner: usize = dims[axis + 1..].iter().product();
    let rows = x.num_elements().checked_div(len).unwrap_or(0);
    if let Some(norm) = norm_of(op)
        && rows >= WARP_ROWS_FROM
        && (1..=WARP_ROW_MAX).contains(&len)
    {
        return Some(warp_norm(name, norm, inputs, out, rows, len));
    }
    let acc = ctype(x.dtype()).compute;
    let inputs_dt: Vec<DType> = inputs.iter().map(Shape::dtype).collect();
    let mut s = header(name, out.dtype(), &inputs_dt);
    let _ = writeln!(s, "  __shared__ {acc} red[32];");
    // Row r starts at (r / inner) * len * inner + r % inner; its elements are
    // `inner` apart.
    let _ = writeln!(
        s,
        "  const long long r = blockIdx.x, base = (r / {inner}LL) * {span}LL + r % {inner}LL;",
        inner = inner.max(1),
        span = len * inner.max(1)
    );
    let _ = writeln!(s, "  const long long step = {}LL;", inner.max(1));
    body(&mut s, op, inputs, acc);
    s.push_str("}\n");
    let threads = len.next_power_of_two().clamp(32, MAX_THREADS) as u32;
    Some(Kernel {
        source: s,
        grid: Grid::Blocks {
            count: rows,
            threads,
        },
        check: None,
    })
}

/// `for` over the row's elements owned by this thread, `j` the position along it.
fn each(len: usize) -> String {
    format!("for (int j = threadIdx.x; j < {len}; j += blockDim.x)")
}

/// A norm's epsilon and whether it is a layer norm (else RMS); `None` for other ops.
fn norm_of(op: &Op) -> Option<(f64, bool)> {
    match op {
        Op::LayerNorm { eps } => Some((eps.get(), true)),
        Op::RmsNorm { eps } => Some((eps.get(), false)),
        _ => None,
    }
}

/// A normalized element: `centered` (`x - mean` for layer norm, `x` for RMS norm)
/// times `inv`, scaled by `gamma` (`in1`) and, for layer norm, shifted by `beta`
/// (`in2`), both at `j`.
fn normalized(dt: DType, centered: &str, layer: bool) -> String {
    if layer {
        format!(
            "({centered}) * inv * {} + {}",
            load(dt, "in1", "j"),
            load(dt, "in2", "j")
        )
    } else {
        format!("{centered} * inv * {}", load(dt, "in1", "j"))
    }
}

fn norm_body(s: &mut String, op: &Op, inputs: &[Shape], acc: &str) {
    let x = &inputs[0];
    let dt = x.dtype();
    let len = x.dim(x.rank() - 1);
    let at = |p: &str| load(dt, p, "(base + j * step)");
    let n = literal(
        len as f64,
        if acc == "double" {
            DType::F64
        } else {
            DType::F32
        },
    );
    let Some((eps, layer)) = norm_of(op) else {
        return;
    };
    let eps = literal(
        eps,
        if acc == "double" {
            DType::F64
        } else {
            DType::F32
        },
    );
    // Layer norm centers on the mean first; RMS norm scales `x` itself.
    let (init, centered, name) = if layer {
        let _ = writeln!(
            s,
            "  {acc} t = 0; {} t += {};\n  const {acc} mean = block_sum(t, red) / {n};",
            each(len),
            at("in0")
        );
        ("  t = 0;".to_string(), format!("{} - mean", at("in0")), "d")
    } else {
        (format!("  {acc} t = 0;"), at("in0"), "v")
    };
    let _ = writeln!(
        s,
        "{init} {} {{ {acc} {name} = {centered}; t += {name} * {name}; }}\n  const {acc} inv = {}(block_sum(t, red) / {n} + {eps});",
        each(len),
        f("rsqrt", dt)
    );
    let value = normalized(dt, &centered, layer);
    let _ = writeln!(
        s,
        "  {} out[base + j * step] = {};",
        each(len),
        store(dt, &value)
    );
}

fn softmax_body(s: &mut String, op: &Op, inputs: &[Shape], acc: &str) {
    let x = &inputs[0];
    let dt = x.dtype();
    let (axis, log) = match op {
        Op::Softmax { axis } => (*axis, false),
        Op::LogSoftmax { axis } => (*axis, true),
        _ => unreachable!("softmax_body is called for softmax only"),
    };
    let len = x.dim(axis);
    let at = load(dt, "in0", "(base + j * step)");
    let exp = f("exp", dt);
    // The maximum ignores NaN (a NaN still reaches every output through the sum);
    // a row of -inf is shifted by 0, so it gives zeros (log: -inf), not NaN.
    let _ = writeln!(
        s,
        "  {acc} m = -RLX_INF; {} {{ {acc} v = {at}; m = v > m ? v : m; }}\n  m = block_max(m, red); if (m == -RLX_INF) m = 0;",
        each(len)
    );
    let _ = writeln!(
        s,
        "  {acc} t = 0; {} t += {exp}({at} - m);\n  t = block_sum(t, red);",
        each(len)
    );
    let value = if log {
        format!("({at} - m) - {}(t)", f("log", dt))
    } else {
        format!("{exp}({at} - m) / (t == 0 ? ({acc})1 : t)")
    };
    let _ = writeln!(
        s,
        "  {} out[base + j * step] = {};",
        each(len),
        store(dt, &value)
    );
}

/// A layer or RMS norm over the last axis with a warp per row: the row's sums are
/// warp sums, and its elements (read three times for layer norm) stay in L1.
fn warp_norm(
    name: &str,
    (eps, layer): (f64, bool),
    inputs: &[Shape],
    out: &Shape,
    rows: usize,
    len: usize,
) -> Kernel {
    let x = &inputs[0];
    let dt = x.dtype();
    let acc = ctype(dt).compute;
    let acc = if acc == "double" { "double" } else { "float" };
    let lit = |v: f64| {
        literal(
            v,
            if acc == "double" {
                DType::F64
            } else {
                DType::F32
            },
        )
    };
    let inputs_dt: Vec<DType> = inputs.iter().map(Shape::dtype).collect();
    let mut s = header(name, out.dtype(), &inputs_dt);
    let at = load(dt, "in0", "(base + j)");
    let each = format!("for (long long j = lane; j < {len}LL; j += 32)");
    let _ = writeln!(
        s,
        "  const int lane = threadIdx.x & 31;\n  RLX_WARP_LOOP({rows}LL) {{\n    const long long base = w * {len}LL;"
    );
    let centered = if layer {
        let _ = writeln!(
            s,
            "    {acc} t = 0; {each} t += {at};\n    const {acc} mean = warp_sum(t) / {n};",
            n = lit(len as f64)
        );
        format!("{at} - mean")
    } else {
        at.clone()
    };
    let _ = writeln!(
        s,
        "    {acc} q = 0; {each} {{ const {acc} d = {centered}; q += d * d; }}\n    const {acc} inv = {}(warp_sum(q) / {} + {});",
        f("rsqrt", dt),
        lit(len as f64),
        lit(eps)
    );
    let value = normalized(dt, &centered, layer);
    let _ = writeln!(
        s,
        "    {each} out[base + j] = {};\n  }}\n}}",
        store(dt, &value)
    );
    Kernel {
        source: s,
        grid: Grid::Warps(rows),
        check: None,
    }
}
