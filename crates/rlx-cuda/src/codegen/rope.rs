//! Rotary position embeddings ([`Op::Rope`]) as one kernel: a thread per rotated
//! pair reads both elements and their angle's cosine and sine (broadcast as the op
//! defines) and writes the pair, instead of the slices, products and concatenation
//! the op decomposes into.

use super::{Kernel, broadcast_strides, elements, header, load, offset_code, store};
use rlx_ir::{DType, Op, RopeStyle, Shape};
use std::fmt::Write;

/// The kernel for `op`, or `None` when it is not a rotary embedding.
pub(super) fn kernel(name: &str, op: &Op, inputs: &[Shape], out: &Shape) -> Option<Kernel> {
    let Op::Rope { style } = op else {
        return None;
    };
    let (x, cos, sin) = (inputs.first()?, inputs.get(1)?, inputs.get(2)?);
    let d = *x.dims().last()?;
    let half = d / 2;
    // Pair `i` has the coordinates of `x` with the last dim halved; cos and sin are
    // read at those coordinates, broadcast.
    let mut half_dims = x.dims().to_vec();
    *half_dims.last_mut()? = half;
    let pairs = x.num_elements() / 2;
    let dt = x.dtype();
    let acc = if dt == DType::F64 { "double" } else { "float" };
    let mut s = header(name, out.dtype(), &[dt, cos.dtype(), sin.dtype()]);
    let _ = writeln!(s, "  RLX_LOOP({pairs}LL) {{");
    offset_code(
        &mut s,
        "at",
        &half_dims,
        &broadcast_strides(cos.dims(), &half_dims),
    );
    let _ = writeln!(
        s,
        "    const long long row = i / {h}LL, j = i % {h}LL;",
        h = half.max(1)
    );
    let (first, second) = match style {
        RopeStyle::HalfSplit => (
            format!("row * {d}LL + j"),
            format!("row * {d}LL + j + {half}LL"),
        ),
        RopeStyle::Interleaved => (
            format!("row * {d}LL + 2 * j"),
            format!("row * {d}LL + 2 * j + 1"),
        ),
    };
    let _ = writeln!(
        s,
        "    const long long ia = {first}, ib = {second};\n    const {acc} a = {}, b = {}, c = {}, sn = {};",
        load(dt, "in0", "ia"),
        load(dt, "in0", "ib"),
        load(cos.dtype(), "in1", "at"),
        load(sin.dtype(), "in2", "at"),
    );
    let _ = writeln!(
        s,
        "    out[ia] = {};\n    out[ib] = {};\n  }}\n}}",
        store(out.dtype(), "(a * c - b * sn)"),
        store(out.dtype(), "(a * sn + b * c)")
    );
    Some(elements(s, pairs))
}
