//! Direct 2-D convolution and pooling over NCHW tensors: one thread per output
//! element, the window loops written with the geometry as constants.

use super::{Kernel, elements, header, load, store};
use rlx_ir::{DType, Op, Shape, Window2d};
use std::fmt::Write;

/// The kernel for `op`, or `None` when it is not one of this module's.
pub(super) fn kernel(name: &str, op: &Op, inputs: &[Shape], out: &Shape) -> Option<Kernel> {
    Some(match op {
        Op::Conv2d { window, groups } => conv2d(name, window, *groups, inputs, out),
        Op::MaxPool2d { window } => pool(name, window, None, &inputs[0], out),
        Op::AvgPool2d {
            window,
            count_include_pad,
        } => pool(name, window, Some(*count_include_pad), &inputs[0], out),
        _ => return None,
    })
}

/// The float type windows accumulate in: `f32` results in `float`; `f64` and the
/// half types in `double`, so a half result is rounded once, as the reference does
/// (a `float` sum of a few hundred taps that cancel is off by more than a half ulp).
fn acc_type(dt: DType) -> &'static str {
    if dt == DType::F32 { "float" } else { "double" }
}

/// Declares `b`, `oc` (channel), `y`, `xo` of output element `i` over `[N, C, OH, OW]`.
fn output_coords(s: &mut String, out: &Shape) {
    let [c, oh, ow] = [out.dim(1), out.dim(2), out.dim(3)].map(|d| d.max(1));
    let _ = writeln!(
        s,
        "    long long xo = i % {ow}LL; long long y = (i / {ow}LL) % {oh}LL; long long oc = (i / ({ow}LL * {oh}LL)) % {c}LL; long long b = i / ({ow}LL * {oh}LL * {c}LL);"
    );
}

/// Opens the loops over window taps `ky`, `kx` that land inside the `h x w` input,
/// setting `iy`, `ix`; the caller closes two braces.
fn taps(s: &mut String, win: &Window2d, h: usize, w: usize) {
    let [kh, kw] = win.kernel;
    let _ = writeln!(
        s,
        "      for (int ky = 0; ky < {kh}; ++ky) {{ long long iy = y * {}LL + ky * {}LL - {}LL; if (iy < 0 || iy >= {h}LL) continue;",
        win.stride[0], win.dilation[0], win.padding[0]
    );
    let _ = writeln!(
        s,
        "      for (int kx = 0; kx < {kw}; ++kx) {{ long long ix = xo * {}LL + kx * {}LL - {}LL; if (ix < 0 || ix >= {w}LL) continue;",
        win.stride[1], win.dilation[1], win.padding[1]
    );
}

fn conv2d(name: &str, win: &Window2d, groups: usize, inputs: &[Shape], out: &Shape) -> Kernel {
    let (x, w) = (&inputs[0], &inputs[1]);
    let [c, h, wd] = [x.dim(1), x.dim(2), x.dim(3)];
    let o = out.dim(1);
    let (cg, og) = (c / groups.max(1), (o / groups.max(1)).max(1));
    let [kh, kw] = win.kernel;
    let n = out.num_elements();
    let acc = acc_type(out.dtype());
    let dts: Vec<DType> = inputs.iter().map(|s| s.dtype()).collect();
    let mut s = header(name, out.dtype(), &dts);
    let _ = writeln!(s, "  RLX_LOOP({n}LL) {{");
    output_coords(&mut s, out);
    let init = if inputs.len() > 2 {
        load(inputs[2].dtype(), "in2", "oc")
    } else {
        "0".into()
    };
    let _ = writeln!(s, "    {acc} acc = {init}; long long g = oc / {og}LL;");
    let _ = writeln!(s, "    for (long long ic = 0; ic < {cg}LL; ++ic) {{");
    let _ = writeln!(
        s,
        "      const long long xb = ((b * {c}LL + g * {cg}LL + ic) * {h}LL) * {wd}LL; const long long wb = (oc * {cg}LL + ic) * {kh}LL * {kw}LL;"
    );
    taps(&mut s, win, h, wd);
    let _ = writeln!(
        s,
        "        acc += ({acc}){} * ({acc}){};",
        load(x.dtype(), "in0", &format!("(xb + iy * {wd}LL + ix)")),
        load(w.dtype(), "in1", &format!("(wb + ky * {kw}LL + kx)"))
    );
    s.push_str("      }}\n    }\n");
    let _ = writeln!(s, "    out[i] = {};", store(out.dtype(), "acc"));
    s.push_str("  }\n}\n");
    elements(s, n)
}

/// Max pooling when `average` is `None`; else average pooling, dividing by the whole
/// window when `Some(true)` and by the taps inside the input when `Some(false)`.
fn pool(name: &str, win: &Window2d, average: Option<bool>, x: &Shape, out: &Shape) -> Kernel {
    let [h, w] = [x.dim(2), x.dim(3)];
    let n = out.num_elements();
    let acc = acc_type(out.dtype());
    let mut s = header(name, out.dtype(), &[x.dtype()]);
    let _ = writeln!(s, "  RLX_LOOP({n}LL) {{");
    output_coords(&mut s, out);
    // `b` and `oc` together name the input plane.
    let _ = writeln!(
        s,
        "    const long long xb = (b * {}LL + oc) * {h}LL * {w}LL;",
        out.dim(1)
    );
    let init = if average.is_some() { "0" } else { "-RLX_INF" };
    let _ = writeln!(s, "    {acc} acc = {init}; long long count = 0;");
    s.push_str("    {\n");
    taps(&mut s, win, h, w);
    let v = load(x.dtype(), "in0", &format!("(xb + iy * {w}LL + ix)"));
    let step = if average.is_some() {
        format!("acc += ({acc}){v};")
    } else {
        // NaN wins the maximum.
        format!(
            "{{ {acc} v = ({acc}){v}; acc = (v != v || acc != acc) ? (acc + v) : (v > acc ? v : acc); }}"
        )
    };
    let _ = writeln!(s, "        {step} ++count;");
    s.push_str("      }}\n    }\n");
    match average {
        Some(true) => {
            let _ = writeln!(
                s,
                "    acc = acc / ({acc}){};",
                win.kernel[0] * win.kernel[1]
            );
        }
        Some(false) => {
            let _ = writeln!(s, "    acc = acc / ({acc})(count > 0 ? count : 1);");
        }
        None => {}
    }
    let _ = writeln!(s, "    out[i] = {};", store(out.dtype(), "acc"));
    s.push_str("  }\n}\n");
    elements(s, n)
}
