//! A decode step's rotary embeddings and cache writes as one kernel: q and k are
//! rotated, k straight into its cache, and v copied into its cache, where the ops
//! one by one take four launches. Every value is rounded as the ops would round it:
//! a rotation to its input's dtype, a written element to the cache's.

use super::fused::rounded;
use super::{
    Grid, Kernel, broadcast_strides, ctype, load, offset_code, store, strides, unravel_code,
    unsupported,
};
use rlx_ir::{DType, Result, RopeStyle, Shape};
use std::fmt::Write;

/// One rotation: `x` (rotated pairs along its last dim) and where it goes.
#[derive(Clone, Debug)]
pub(crate) struct RopeJob {
    /// The rotated value's shape (and the result's).
    pub x: Shape,
    /// How the last dim pairs up.
    pub style: RopeStyle,
    /// The write (an index into [`RopeWrites::writes`]) that stores the result in
    /// its cache; `None` stores it as the rope's own value.
    pub into: Option<usize>,
}

/// One write of rows into a cache at the shared position.
#[derive(Clone, Debug)]
pub(crate) struct WriteJob {
    /// The cache.
    pub target: Shape,
    /// The rows written (their shape).
    pub update: Shape,
    /// The axis the rows go along.
    pub axis: usize,
    /// The rotation whose result is written; `None` writes an operand.
    pub from: Option<usize>,
}

/// Rotations sharing their cosine and sine tables, and writes sharing a position.
#[derive(Clone, Debug)]
pub(crate) struct RopeWrites {
    /// The rotations.
    pub ropes: Vec<RopeJob>,
    /// The cosine table, broadcast to each rotation's pairs.
    pub cos: Shape,
    /// The sine table, likewise.
    pub sin: Shape,
    /// The cache writes.
    pub writes: Vec<WriteJob>,
    /// The position (one integer).
    pub pos: Shape,
}

/// The kernel. Operands, in order: the result of each rotation kept as a value,
/// each cache, each rotation's input, cos, sin, each written operand, the position,
/// and the error slots (a position that does not fit is reported as `code`).
pub(crate) fn kernel(name: &str, g: &RopeWrites, code: i32) -> Result<Kernel> {
    check_rows(g)?;
    let mut s = format!("extern \"C\" __global__ void {name}(");
    s.push_str(&params(g, false).join(", "));
    s.push_str(") {\n");
    position_check(&mut s, g, code, "blockIdx.x == 0 && threadIdx.x == 0");
    let mut total = 0usize;
    let mut branches = Vec::new();
    for job in jobs(g)? {
        branches.push((total, total + job.count, job.body));
        total += job.count;
    }
    let _ = writeln!(
        s,
        "  for (long long t = (long long)blockIdx.x * blockDim.x + threadIdx.x; t < {total}LL; t += (long long)gridDim.x * blockDim.x) {{"
    );
    for (k, (start, end, body)) in branches.iter().enumerate() {
        let _ = writeln!(
            s,
            "  {}if (t < {end}LL) {{\n    const long long i = t - {start}LL;\n{body}  }}",
            if k == 0 { "" } else { "else " }
        );
    }
    s.push_str("  }\n}\n");
    Ok(Kernel {
        source: s,
        grid: Grid::Elements(total),
        check: check_message(g),
    })
}

/// Every write takes the same rows into a cache axis of the same length: the one
/// position check (and its message) holds for all of them.
pub(crate) fn check_rows(g: &RopeWrites) -> Result<()> {
    let rows = |w: &WriteJob| (w.update.dims()[w.axis], w.target.dims()[w.axis]);
    match g.writes.first() {
        Some(f) if g.writes.iter().any(|w| rows(w) != rows(f)) => Err(unsupported(
            "cache writes of different lengths in one kernel".into(),
        )),
        _ => Ok(()),
    }
}

/// What a position that does not fit is reported as.
pub(crate) fn check_message(g: &RopeWrites) -> Option<String> {
    g.writes.first().map(|f| {
        format!(
            "write_at: position {{value}} + {} rows does not fit an axis of length {}",
            f.update.dims()[f.axis],
            f.target.dims()[f.axis]
        )
    })
}

/// The kernel parameters, in operand order. Within a product group's kernel
/// (`in_group`) the rotations' inputs and the written operands are the group's own
/// outputs, not parameters.
pub(crate) fn params(g: &RopeWrites, in_group: bool) -> Vec<String> {
    let mut params = Vec::new();
    for (j, r) in g.ropes.iter().enumerate() {
        if r.into.is_none() {
            params.push(format!(
                "{}* __restrict__ rot{j}",
                ctype(r.x.dtype()).storage
            ));
        }
    }
    for (w, write) in g.writes.iter().enumerate() {
        params.push(format!(
            "{}* __restrict__ cache{w}",
            ctype(write.target.dtype()).storage
        ));
    }
    if !in_group {
        for (j, r) in g.ropes.iter().enumerate() {
            params.push(format!(
                "const {}* __restrict__ x{j}",
                ctype(r.x.dtype()).storage
            ));
        }
    }
    params.push(format!(
        "const {}* __restrict__ cosv",
        ctype(g.cos.dtype()).storage
    ));
    params.push(format!(
        "const {}* __restrict__ sinv",
        ctype(g.sin.dtype()).storage
    ));
    if !in_group {
        for (w, write) in g.writes.iter().enumerate() {
            if write.from.is_none() {
                params.push(format!(
                    "const {}* __restrict__ upd{w}",
                    ctype(write.update.dtype()).storage
                ));
            }
        }
    }
    params.push(format!(
        "const {}* __restrict__ pos",
        ctype(g.pos.dtype()).storage
    ));
    params.push("long long* __restrict__ err".into());
    params
}

/// Declares the position `p` and whether the writes fit (`fits`); where `leader`
/// holds, a position that does not fit is reported as `code`.
pub(crate) fn position_check(s: &mut String, g: &RopeWrites, code: i32, leader: &str) {
    if let Some(f) = g.writes.first() {
        let (len, dim) = (f.update.dims()[f.axis], f.target.dims()[f.axis]);
        let _ = writeln!(
            s,
            "  const long long p = {};\n  const bool fits = p >= 0 && p + {len}LL <= {dim}LL;\n  if (!fits && {leader}) rlx_fail(err, {code}, p);",
            load(g.pos.dtype(), "pos", "0")
        );
    }
}

/// One piece of the kernel's work: `count` items, done by `body` for item `i`.
pub(crate) struct Job {
    /// Items: a rotation's pairs, a write's elements.
    pub count: usize,
    /// Code doing item `i` (after [`position_check`]).
    pub body: String,
}

/// The work of `g`: each rotation's pairs, then each written operand's elements (a
/// rotation written straight into a cache is written by its own job).
pub(crate) fn jobs(g: &RopeWrites) -> Result<Vec<Job>> {
    let mut out = Vec::new();
    for (j, r) in g.ropes.iter().enumerate() {
        let mut body = String::new();
        rope_body(&mut body, j, r, g, None)?;
        out.push(Job {
            count: r.x.num_elements() / 2,
            body,
        });
    }
    for (w, write) in g.writes.iter().enumerate() {
        if write.from.is_some() {
            continue;
        }
        let mut body = String::new();
        write_body(&mut body, w, write, None);
        out.push(Job {
            count: write.update.num_elements(),
            body,
        });
    }
    Ok(out)
}

/// Element `i` of written operand `w` stored in its cache: `value` (a compute-type
/// expression) when given, else the element loaded from `upd{w}`.
pub(crate) fn write_body(s: &mut String, w: usize, write: &WriteJob, value: Option<&str>) {
    unravel_code(s, "i", write.update.dims(), "u");
    let loaded;
    let value = match value {
        Some(v) => v,
        None => {
            loaded = load(write.update.dtype(), &format!("upd{w}"), "i");
            &loaded
        }
    };
    let _ = writeln!(
        s,
        "    if (fits) cache{w}[{}] = {};",
        target_offset(write, "u"),
        store(write.target.dtype(), value)
    );
}

/// The offset in `write`'s cache of the update element whose coordinates are
/// `{c}0, {c}1, ...`, its rows moved to position `p`.
fn target_offset(write: &WriteJob, c: &str) -> String {
    let st = strides(write.target.dims());
    (0..write.update.rank())
        .map(|a| {
            if a == write.axis {
                format!("({c}{a} + p) * {}LL", st[a])
            } else {
                format!("{c}{a} * {}LL", st[a])
            }
        })
        .collect::<Vec<_>>()
        .join(" + ")
}

/// The elements `(ia, ib)` that pair `i` of a rotation over rows of `d` rotates,
/// as expressions of `row` (`i / (d / 2)`) and `k` (`i % (d / 2)`).
pub(crate) fn pair_elements(style: RopeStyle, d: usize) -> (String, String) {
    let half = d / 2;
    match style {
        RopeStyle::HalfSplit => (
            format!("row * {d}LL + k"),
            format!("row * {d}LL + k + {half}LL"),
        ),
        RopeStyle::Interleaved => (
            format!("row * {d}LL + 2 * k"),
            format!("row * {d}LL + 2 * k + 1"),
        ),
    }
}

/// Pair `i` of rotation `j`: both elements rotated by their angle and stored. The
/// elements are loaded from `x{j}`, or are `values` (compute-type expressions) when
/// given.
pub(crate) fn rope_body(
    s: &mut String,
    j: usize,
    r: &RopeJob,
    g: &RopeWrites,
    values: Option<(&str, &str)>,
) -> Result<()> {
    let dims = r.x.dims();
    let d = *dims
        .last()
        .ok_or_else(|| unsupported("a rotation of a scalar".into()))?;
    let half = d / 2;
    let mut half_dims = dims.to_vec();
    if let Some(last) = half_dims.last_mut() {
        *last = half;
    }
    offset_code(
        s,
        "at",
        &half_dims,
        &broadcast_strides(g.cos.dims(), &half_dims),
    );
    let (ia, ib) = pair_elements(r.style, d);
    let dt = r.x.dtype();
    let (va, vb) = match values {
        Some((a, b)) => (a.to_string(), b.to_string()),
        None => (
            load(dt, &format!("x{j}"), "ia"),
            load(dt, &format!("x{j}"), "ib"),
        ),
    };
    let acc = if dt == DType::F64 { "double" } else { "float" };
    let _ = writeln!(
        s,
        "    const long long row = i / {h}LL, k = i % {h}LL;\n    const long long ia = {}, ib = {};\n    const {acc} a = {}, b = {}, cs = {}, sn = {};\n    const {acc} ra = {}, rb = {};",
        ia,
        ib,
        va,
        vb,
        load(g.cos.dtype(), "cosv", "at"),
        load(g.sin.dtype(), "sinv", "at"),
        rounded(dt, "a * cs - b * sn"),
        rounded(dt, "a * sn + b * cs"),
        h = half.max(1)
    );
    match r.into {
        None => {
            let _ = writeln!(
                s,
                "    rot{j}[ia] = {};\n    rot{j}[ib] = {};",
                store(dt, "ra"),
                store(dt, "rb")
            );
        }
        Some(w) => {
            let write = &g.writes[w];
            unravel_code(s, "ia", dims, "ua");
            unravel_code(s, "ib", dims, "ub");
            let tdt = write.target.dtype();
            let _ = writeln!(
                s,
                "    if (fits) {{ cache{w}[{}] = {}; cache{w}[{}] = {}; }}",
                target_offset(write, "ua"),
                store(tdt, "ra"),
                target_offset(write, "ub"),
                store(tdt, "rb")
            );
        }
    }
    Ok(())
}
