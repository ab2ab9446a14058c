//! Kernels for the fused forms the optimizer makes: an elementwise region as one
//! pass, and a matrix product's epilogue (applied in place after cuBLAS, or inside
//! the matrix-vector kernels of [`super::gemv`]).

use super::{
    Kernel, binary_expr, broadcast_strides, ctype, elements, header, load, offset_code, store,
    unary_expr,
};
use rlx_ir::{DType, EwStep, Op, Result, Shape, UnaryOp};
use std::fmt::Write;

/// `v` rounded to `dt` and back to its compute type (nothing for `f32`/`f64`): every
/// step of a fused form is rounded as the unfused op would round it.
pub(super) fn rounded(dt: DType, v: &str) -> String {
    match dt {
        DType::F16 => format!("h2f(f2h({v}))"),
        DType::BF16 => format!("bf2f(f2bf({v}))"),
        _ => v.to_string(),
    }
}

/// An `Elementwise` region: each thread loads its operands (broadcast to the output),
/// runs the steps in registers and stores the last one.
pub(super) fn elementwise(
    name: &str,
    steps: &[EwStep],
    inputs: &[Shape],
    out: &Shape,
) -> Result<Kernel> {
    let dt = out.dtype();
    let c = ctype(dt).compute;
    let in_dts: Vec<DType> = inputs.iter().map(|s| s.dtype()).collect();
    let mut s = header(name, dt, &in_dts);
    let n = out.num_elements();
    let _ = writeln!(s, "  RLX_LOOP({n}LL) {{");
    for (k, shape) in inputs.iter().enumerate() {
        let st = broadcast_strides(shape.dims(), out.dims());
        offset_code(&mut s, &format!("o{k}"), out.dims(), &st);
        let v = load(shape.dtype(), &format!("in{k}"), &format!("o{k}"));
        let _ = writeln!(s, "    const {c} r{k} = {v};");
    }
    let last = region_steps(&mut s, steps, inputs.len(), dt)?;
    let _ = writeln!(s, "    out[i] = {};", store(dt, &last));
    s.push_str("  }\n}\n");
    Ok(elements(s, n))
}

/// Statements computing a region's `steps` in `dt`'s compute type on registers
/// `r0, r1, ...`, the first `first` of which hold its inputs; each step is rounded
/// as the unfused op would round it. Returns the last register defined.
pub(super) fn region_steps(
    s: &mut String,
    steps: &[EwStep],
    first: usize,
    dt: DType,
) -> Result<String> {
    let c = ctype(dt).compute;
    let reg = |r: u16| format!("r{r}");
    for (k, step) in steps.iter().enumerate() {
        let v = match *step {
            EwStep::Unary(op, a) => unary_expr(op, dt, &reg(a))?,
            EwStep::Binary(op, a, b) => binary_expr(op, dt, &reg(a), &reg(b))?,
        };
        let _ = writeln!(s, "    const {c} r{} = {};", first + k, rounded(dt, &v));
    }
    Ok(format!("r{}", (first + steps.len()).saturating_sub(1)))
}

/// What a matrix product applies to each result before storing it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Epilogue {
    /// Scale of the product.
    pub alpha: f64,
    /// Whether a bias `[N]` is added.
    pub bias: bool,
    /// The activation after the bias.
    pub activation: Option<UnaryOp>,
    /// Whether a residual of the output's shape is added last.
    pub residual: bool,
}

impl Epilogue {
    /// The epilogue of a product op (`MatMul` has none); `None` for other ops.
    pub(crate) fn of(op: &Op) -> Option<Epilogue> {
        match op {
            Op::MatMul => Some(Epilogue {
                alpha: 1.0,
                bias: false,
                activation: None,
                residual: false,
            }),
            // This backend never asks for transposed operands (the planner forms
            // them only for backends that declare them): one built by hand has no
            // epilogue here, and so no kernel.
            Op::FusedMatMul {
                alpha,
                transpose_a: false,
                transpose_b: false,
                bias,
                activation,
                residual,
            } => Some(Epilogue {
                alpha: alpha.get(),
                bias: *bias,
                activation: *activation,
                residual: *residual,
            }),
            _ => None,
        }
    }

    /// Whether it changes nothing.
    pub fn is_identity(&self) -> bool {
        self.alpha == 1.0 && !self.bias && self.activation.is_none() && !self.residual
    }

    /// Statements turning `{c} v` (the product at output element `row * N + col`)
    /// into the stored value, reading the bias from `bias` and the residual from `res`.
    pub(super) fn code(
        &self,
        s: &mut String,
        dt: DType,
        row: &str,
        col: &str,
        n: usize,
    ) -> Result<()> {
        self.code_tagged(s, dt, row, col, n, "")
    }

    /// [`Epilogue::code`] reading the operands named by [`Epilogue::params_tagged`]
    /// with `tag` (one kernel may hold several products' epilogues).
    pub(super) fn code_tagged(
        &self,
        s: &mut String,
        dt: DType,
        row: &str,
        col: &str,
        n: usize,
        tag: &str,
    ) -> Result<()> {
        let residual = load(
            dt,
            &format!("res{tag}"),
            &format!("(({row}) * {n}LL + ({col}))"),
        );
        self.code_with(s, dt, col, &residual, &format!("bias{tag}"))
    }

    /// [`Epilogue::code`] with the residual read by the expression `residual` and the
    /// bias from pointer `bias`.
    fn code_with(
        &self,
        s: &mut String,
        dt: DType,
        col: &str,
        residual: &str,
        bias: &str,
    ) -> Result<()> {
        if self.alpha != 1.0 {
            let a = super::literal(self.alpha, dt);
            let _ = writeln!(s, "      v = {};", rounded(dt, &format!("v * {a}")));
        }
        if self.bias {
            let b = load(dt, bias, col);
            let _ = writeln!(s, "      v = {};", rounded(dt, &format!("v + {b}")));
        }
        if let Some(act) = self.activation {
            let e = unary_expr(act, dt, "v")?;
            let _ = writeln!(s, "      v = {};", rounded(dt, &e));
        }
        if self.residual {
            let _ = writeln!(s, "      v = {};", rounded(dt, &format!("v + {residual}")));
        }
        Ok(())
    }

    /// The pointer parameters for the bias and residual operands.
    pub(super) fn params(&self, dt: DType) -> String {
        self.params_tagged(dt, "")
    }

    /// [`Epilogue::params`] named `bias{tag}` and `res{tag}`.
    pub(super) fn params_tagged(&self, dt: DType, tag: &str) -> String {
        let t = ctype(dt).storage;
        let mut p = String::new();
        if self.bias {
            let _ = write!(p, ", const {t}* __restrict__ bias{tag}");
        }
        if self.residual {
            let _ = write!(p, ", const {t}* __restrict__ res{tag}");
        }
        p
    }
}

/// The epilogue applied in place to a product already in `out` (`[rows, N]` of
/// `dt`); operands are the bias and residual the epilogue takes. With `vector`,
/// each thread takes 16 bytes of a row at once (`N` must fill whole 16-byte
/// pieces, and `out` and the residual must be 16-byte aligned).
pub(crate) fn epilogue_in_place(
    name: &str,
    epilogue: &Epilogue,
    out: &Shape,
    vector: bool,
) -> Result<Kernel> {
    let dt = out.dtype();
    let ct = ctype(dt);
    let n = out.dims().last().copied().unwrap_or(1).max(1);
    let total = out.num_elements();
    let mut s = format!(
        "extern \"C\" __global__ void {name}({}* __restrict__ out{}) {{\n",
        ct.storage,
        epilogue.params(dt)
    );
    let per = 16 / dt.size_in_bytes().max(1);
    if !vector || per <= 1 || n % per != 0 {
        let _ = writeln!(s, "  RLX_LOOP({total}LL) {{");
        let _ = writeln!(s, "      long long row = i / {n}LL, col = i % {n}LL;");
        let _ = writeln!(s, "      {} v = {};", ct.compute, load(dt, "out", "i"));
        epilogue.code(&mut s, dt, "row", "col", n)?;
        let _ = writeln!(s, "      out[i] = {};", store(dt, "v"));
        s.push_str("  }\n}\n");
        return Ok(elements(s, total));
    }
    let pieces = total / per;
    let _ = writeln!(s, "  RLX_LOOP({pieces}LL) {{");
    let _ = writeln!(
        s,
        "    const long long at = i * {per}LL, col0 = at % {n}LL;\n    uint4 pk = *(const uint4*)(out + at); {st}* pv = ({st}*)&pk;",
        st = ct.storage
    );
    if epilogue.residual {
        let _ = writeln!(
            s,
            "    const uint4 rk = *(const uint4*)(res + at); const {st}* rv = (const {st}*)&rk;",
            st = ct.storage
        );
    }
    let _ = writeln!(
        s,
        "    #pragma unroll\n    for (int u = 0; u < {per}; ++u) {{\n      const long long col = col0 + u;\n      {} v = {};",
        ct.compute,
        load(dt, "pv", "u")
    );
    epilogue.code_with(&mut s, dt, "col", &load(dt, "rv", "u"), "bias")?;
    let _ = writeln!(s, "      pv[u] = {};\n    }}", store(dt, "v"));
    s.push_str("    *(uint4*)(out + at) = pk;\n  }\n}\n");
    Ok(elements(s, pieces))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_identity_epilogue_is_recognized() {
        let e = Epilogue {
            alpha: 1.0,
            bias: false,
            activation: None,
            residual: false,
        };
        assert!(e.is_identity());
        assert!(
            !Epilogue {
                residual: true,
                ..e
            }
            .is_identity()
        );
    }
}
