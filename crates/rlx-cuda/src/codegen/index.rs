//! Kernels that pick, fill, scan or rank elements: gather, pad, tile, range, random
//! numbers, one-hot,
//! cumulative sums, top-k, argmax/argmin, and writes into a persistent handle.

use super::{
    Grid, Kernel, cast_expr, elements, header, header_with, literal, load, store, strides,
    unravel_code,
};
use rlx_ir::{ArgReduceOp, DType, Op, PadMode, Result, Shape, TopKOutput};
use std::fmt::Write;

/// The kernel for `op`, or `None` when it is not one of this module's.
pub(super) fn kernel(
    name: &str,
    op: &Op,
    inputs: &[Shape],
    out: &Shape,
    fail_code: i32,
) -> Result<Option<Kernel>> {
    Ok(Some(match op {
        Op::Gather { axis } => gather(name, *axis, &inputs[0], &inputs[1], out, fail_code),
        Op::Pad { pads, mode } => pad(name, pads, *mode, &inputs[0], out),
        Op::Tile { .. } => tile(name, &inputs[0], out),
        Op::Range { start, step, .. } => range(name, start.get(), step.get(), out),
        Op::RandomUniform { seed, .. } => random_uniform(name, *seed, &inputs[0], out),
        Op::OneHot { depth, .. } => one_hot(name, *depth, &inputs[0], out),
        Op::Cumsum {
            axis,
            exclusive,
            reverse,
        } => cumsum(name, *axis, *exclusive, *reverse, &inputs[0], out),
        Op::TopK {
            k,
            axis,
            largest,
            output,
        } => topk(name, *k, *axis, *largest, *output, &inputs[0], out),
        Op::ArgReduce { op, axis, .. } => arg_reduce(name, *op, *axis, &inputs[0], out),
        Op::WriteAt { axis } => write_at(name, *axis, inputs, fail_code),
        _ => return Ok(None),
    }))
}

/// Splits `dims` around `axis`: (product before, length, product after).
/// The inner product is at least 1, so it can be written as a divisor.
fn around(dims: &[usize], axis: usize) -> (usize, usize, usize) {
    (
        dims[..axis].iter().product(),
        dims[axis],
        dims[axis + 1..].iter().product::<usize>().max(1),
    )
}

fn gather(name: &str, axis: usize, x: &Shape, idx: &Shape, out: &Shape, code: i32) -> Kernel {
    let (_, n, inner) = around(x.dims(), axis);
    let (ni, no) = (idx.num_elements(), out.num_elements());
    // Divisors written into the source are never zero (an empty side runs nothing).
    let (inner, nd) = (inner.max(1), ni.max(1));
    let mut s = header_with(name, out.dtype(), &[x.dtype(), idx.dtype()], true);
    // Every index is checked, also those an empty result never reads.
    let _ = writeln!(s, "  RLX_LOOP({}LL) {{", ni.max(no));
    let k = load(idx.dtype(), "in1", "i");
    let _ = writeln!(
        s,
        "    if (i < {ni}LL) {{ long long k = {k}; if (k < -{n}LL || k >= {n}LL) rlx_fail(err, {code}, k); }}"
    );
    let _ = writeln!(s, "    if (i < {no}LL) {{");
    let _ = writeln!(
        s,
        "      long long in_ = i % {inner}LL; long long t = i / {inner}LL; long long p = t % {nd}LL; long long outer = t / {nd}LL;"
    );
    let k = load(idx.dtype(), "in1", "p");
    let _ = writeln!(s, "      long long k = {k}; if (k < 0) k += {n}LL;");
    let zero = store(out.dtype(), "0");
    let v = store(
        out.dtype(),
        &load(
            x.dtype(),
            "in0",
            &format!("(outer * {n}LL + k) * {inner}LL + in_"),
        ),
    );
    let _ = writeln!(
        s,
        "      if (k < 0 || k >= {n}LL) out[i] = {zero}; else out[i] = {v};"
    );
    s.push_str("    }\n  }\n}\n");
    Kernel {
        source: s,
        grid: Grid::Elements(ni.max(no)),
        check: Some(format!(
            "gather: index {{value}} out of range for an axis of length {n}"
        )),
    }
}

fn pad(name: &str, pads: &[(usize, usize)], mode: PadMode, x: &Shape, out: &Shape) -> Kernel {
    let (xd, od) = (x.dims(), out.dims());
    let st = strides(xd);
    let n = out.num_elements();
    let mut s = header(name, out.dtype(), &[x.dtype()]);
    let _ = writeln!(s, "  RLX_LOOP({n}LL) {{");
    unravel_code(&mut s, "i", od, "c");
    let _ = writeln!(s, "    long long src = 0; bool fill = false;");
    for (a, &d) in xd.iter().enumerate() {
        let before = pads[a].0;
        let border = match mode {
            PadMode::Constant(_) => "fill = true; p = 0;".to_string(),
            _ if d == 0 => "fill = true; p = 0;".to_string(),
            PadMode::Edge => format!("p = p < 0 ? 0 : {}LL;", d - 1),
            PadMode::Reflect => {
                format!(
                    "p = p < 0 ? -p : {}LL - p; if (p < 0) p = 0; if (p >= {d}LL) p = {}LL;",
                    2 * (d as i64 - 1),
                    d - 1
                )
            }
        };
        let _ = writeln!(
            s,
            "    {{ long long p = c{a} - {before}LL; if (p < 0 || p >= {d}LL) {{ {border} }} src += p * {}LL; }}",
            st[a]
        );
    }
    let fill = match mode {
        PadMode::Constant(v) => literal(v.get(), out.dtype()),
        _ => literal(0.0, out.dtype()),
    };
    let v = load(x.dtype(), "in0", "src");
    let _ = writeln!(
        s,
        "    out[i] = fill ? {} : {};",
        store(out.dtype(), &fill),
        store(out.dtype(), &v)
    );
    s.push_str("  }\n}\n");
    elements(s, n)
}

fn tile(name: &str, x: &Shape, out: &Shape) -> Kernel {
    let (xd, od) = (x.dims(), out.dims());
    let st = strides(xd);
    let n = out.num_elements();
    let mut s = header(name, out.dtype(), &[x.dtype()]);
    let _ = writeln!(s, "  RLX_LOOP({n}LL) {{");
    unravel_code(&mut s, "i", od, "c");
    let terms: Vec<String> = xd
        .iter()
        .enumerate()
        .map(|(a, &d)| format!("(c{a} % {}LL) * {}LL", d.max(1), st[a]))
        .collect();
    let src = if terms.is_empty() {
        "0".to_string()
    } else {
        terms.join(" + ")
    };
    let _ = writeln!(
        s,
        "    out[i] = {};",
        store(out.dtype(), &load(x.dtype(), "in0", &format!("({src})")))
    );
    s.push_str("  }\n}\n");
    elements(s, n)
}

fn range(name: &str, start: f64, step: f64, out: &Shape) -> Kernel {
    let n = out.num_elements();
    let mut s = header(name, out.dtype(), &[]);
    let _ = writeln!(s, "  RLX_LOOP({n}LL) {{");
    let v = format!(
        "({} + (double)i * {})",
        literal(start, DType::F64),
        literal(step, DType::F64)
    );
    let _ = writeln!(
        s,
        "    out[i] = {};",
        store(out.dtype(), &cast_expr(DType::F64, out.dtype(), &v))
    );
    s.push_str("  }\n}\n");
    elements(s, n)
}

fn random_uniform(name: &str, seed: u64, key: &Shape, out: &Shape) -> Kernel {
    let n = out.num_elements();
    let mut s = header(name, out.dtype(), &[key.dtype()]);
    let k = load(key.dtype(), "in0", "0");
    let _ = writeln!(s, "  unsigned int stream = rlx_stream({seed}ULL, {k});");
    let _ = writeln!(s, "  RLX_LOOP({n}LL) {{");
    let v = cast_expr(
        DType::F64,
        out.dtype(),
        "rlx_uniform(stream, (unsigned long long)i)",
    );
    let _ = writeln!(s, "    out[i] = {};", store(out.dtype(), &v));
    s.push_str("  }\n}\n");
    elements(s, n)
}

fn one_hot(name: &str, depth: usize, idx: &Shape, out: &Shape) -> Kernel {
    let n = out.num_elements();
    let depth = depth.max(1); // zero depth: an empty result, nothing runs
    let mut s = header(name, out.dtype(), &[idx.dtype()]);
    let _ = writeln!(s, "  RLX_LOOP({n}LL) {{");
    let k = load(idx.dtype(), "in0", &format!("(i / {depth}LL)"));
    let _ = writeln!(
        s,
        "    long long k = {k}; if (k < 0) k += {depth}LL; long long c = i % {depth}LL;"
    );
    let _ = writeln!(
        s,
        "    out[i] = (k == c) ? {} : {};",
        store(out.dtype(), &literal(1.0, out.dtype())),
        store(out.dtype(), &literal(0.0, out.dtype()))
    );
    s.push_str("  }\n}\n");
    elements(s, n)
}

/// The accumulator type of sums over `dt` (floats in double, as the reference sums).
fn sum_type(dt: DType) -> &'static str {
    if dt.is_float() { "double" } else { "long long" }
}

fn cumsum(
    name: &str,
    axis: usize,
    exclusive: bool,
    reverse: bool,
    x: &Shape,
    out: &Shape,
) -> Kernel {
    let (outer, n, inner) = around(x.dims(), axis);
    let lanes = outer * inner;
    let dt = x.dtype();
    let acc_t = sum_type(dt);
    let mut s = header(name, out.dtype(), &[dt]);
    let _ = writeln!(s, "  RLX_LOOP({lanes}LL) {{");
    let _ = writeln!(
        s,
        "    long long base = (i / {inner}LL) * {n}LL * {inner}LL + i % {inner}LL;"
    );
    let _ = writeln!(s, "    {acc_t} acc = 0;");
    let _ = writeln!(s, "    for (long long t = 0; t < {n}LL; ++t) {{");
    let j = if reverse {
        format!("({}LL - t)", n as i64 - 1)
    } else {
        "t".into()
    };
    let _ = writeln!(s, "      long long off = base + {j} * {inner}LL;");
    let v = load(dt, "in0", "off");
    // Integers wrap as two's complement.
    let add = if dt.is_float() {
        format!("acc += {v};")
    } else {
        format!("acc = (long long)((unsigned long long)acc + (unsigned long long){v});")
    };
    let write = format!("out[off] = {};", store(out.dtype(), "acc"));
    if exclusive {
        let before = store(out.dtype(), "v_");
        let _ = writeln!(
            s,
            "      {{ {acc_t} v_ = acc; {add} out[off] = {before}; }}"
        );
    } else {
        let _ = writeln!(s, "      {add} {write}");
    }
    s.push_str("    }\n  }\n}\n");
    elements(s, lanes)
}

/// `a` (at index `i`) comes before `b` (at `j`) in top-k order: NaN ranks above every
/// number, and equal values keep the lower index first.
fn before(dt: DType, largest: bool) -> String {
    if dt.is_float() {
        let nan = "(a != a)";
        let bnan = "(b != b)";
        let cmp = if largest {
            format!("(({nan} && !{bnan}) || (!{nan} && !{bnan} && a > b))")
        } else {
            format!("((!{nan} && {bnan}) || (a < b))")
        };
        format!("({cmp} || ((({nan} && {bnan}) || a == b) && ii < jj))")
    } else {
        let o = if largest { ">" } else { "<" };
        format!("((a {o} b) || (a == b && ii < jj))")
    }
}

fn topk(
    name: &str,
    k: usize,
    axis: usize,
    largest: bool,
    output: TopKOutput,
    x: &Shape,
    out: &Shape,
) -> Kernel {
    let (outer, n, inner) = around(x.dims(), axis);
    let items = outer * n * inner;
    let dt = x.dtype();
    let comp = super::ctype(dt).compute;
    let mut s = header(name, out.dtype(), &[dt]);
    // One thread per element: its rank is how many elements of its lane come first.
    let _ = writeln!(s, "  RLX_LOOP({items}LL) {{");
    let _ = writeln!(
        s,
        "    long long in_ = i % {inner}LL; long long t = i / {inner}LL; long long jj = t % {nd}LL; long long o = t / {nd}LL;",
        nd = n.max(1)
    );
    let _ = writeln!(s, "    long long base = o * {n}LL * {inner}LL + in_;");
    let _ = writeln!(
        s,
        "    {comp} b = {}; long long rank = 0;",
        load(dt, "in0", &format!("(base + jj * {inner}LL)"))
    );
    let _ = writeln!(
        s,
        "    for (long long ii = 0; ii < {n}LL && rank < {k}LL; ++ii) {{ {comp} a = {}; if ({}) ++rank; }}",
        load(dt, "in0", &format!("(base + ii * {inner}LL)")),
        before(dt, largest)
    );
    let value = match output {
        TopKOutput::Values => store(out.dtype(), "b"),
        TopKOutput::Indices => store(out.dtype(), "jj"),
    };
    let _ = writeln!(
        s,
        "    if (rank < {k}LL) out[(o * {k}LL + rank) * {inner}LL + in_] = {value};"
    );
    s.push_str("  }\n}\n");
    elements(s, items)
}

fn arg_reduce(name: &str, op: ArgReduceOp, axis: usize, x: &Shape, out: &Shape) -> Kernel {
    let (outer, n, inner) = around(x.dims(), axis);
    let lanes = outer * inner;
    let dt = x.dtype();
    let comp = super::ctype(dt).compute;
    let o = match op {
        ArgReduceOp::ArgMax => ">",
        ArgReduceOp::ArgMin => "<",
    };
    let mut s = header(name, out.dtype(), &[dt]);
    let _ = writeln!(s, "  RLX_LOOP({lanes}LL) {{");
    let _ = writeln!(
        s,
        "    long long base = (i / {inner}LL) * {n}LL * {inner}LL + i % {inner}LL;"
    );
    // The first NaN wins; otherwise the first extreme value.
    let _ = writeln!(
        s,
        "    long long best = 0; {comp} bv = {};",
        load(dt, "in0", "base")
    );
    let _ = writeln!(
        s,
        "    for (long long t = 1; t < {n}LL && bv == bv; ++t) {{ {comp} v = {}; if (v != v || v {o} bv) {{ best = t; bv = v; }} }}",
        load(dt, "in0", &format!("(base + t * {inner}LL)"))
    );
    let _ = writeln!(s, "    out[i] = {};", store(out.dtype(), "best"));
    s.push_str("  }\n}\n");
    elements(s, lanes)
}

/// Writes `update` into the target in place (the plan puts the result where the
/// target handle is), starting at the run-time position along `axis`.
fn write_at(name: &str, axis: usize, inputs: &[Shape], code: i32) -> Kernel {
    let (target, update, pos) = (&inputs[0], &inputs[1], &inputs[2]);
    let (ud, td) = (update.dims(), target.dims());
    let (len, dim) = (ud[axis], td[axis]);
    let n = update.num_elements();
    let tst = strides(td);
    let mut s = header_with(
        name,
        target.dtype(),
        &[target.dtype(), update.dtype(), pos.dtype()],
        true,
    );
    let _ = writeln!(s, "  long long p = {};", load(pos.dtype(), "in2", "0"));
    let _ = writeln!(
        s,
        "  if (p < 0 || p + {len}LL > {dim}LL) {{ if (blockIdx.x == 0 && threadIdx.x == 0) rlx_fail(err, {code}, p); return; }}"
    );
    let _ = writeln!(s, "  RLX_LOOP({n}LL) {{");
    unravel_code(&mut s, "i", ud, "c");
    let terms: Vec<String> = (0..ud.len())
        .map(|a| {
            if a == axis {
                format!("(c{a} + p) * {}LL", tst[a])
            } else {
                format!("c{a} * {}LL", tst[a])
            }
        })
        .collect();
    let _ = writeln!(
        s,
        "    out[{}] = {};",
        terms.join(" + "),
        store(target.dtype(), &load(update.dtype(), "in1", "i"))
    );
    s.push_str("  }\n}\n");
    Kernel {
        source: s,
        grid: Grid::Elements(n),
        check: Some(format!(
            "write_at: position {{value}} + {len} rows does not fit an axis of length {dim}"
        )),
    }
}
