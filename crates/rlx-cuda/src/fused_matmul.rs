//! How a product (`MatMul`, or `FusedMatMul`: `act(alpha * a @ b + bias) +
//! residual`) runs on the GPU.
//!
//! - A product of a few rows (a decode step) with a 2-D weight is one matrix-vector
//!   kernel that reads the weight as stored, `f16`/`bf16` beside `f32` activations
//!   included, and writes the epilogue's result: the weight's bytes are read once.
//!   A weight stored transposed (`[N, K]`, see `program`) takes the kernel with a
//!   warp per output ([`gemv_rows`]); a `[K, N]` operand the split-`K` one.
//! - Anything larger with a bias or residual and no other activation than ReLU
//!   is one cuBLASLt call with both folded in ([`LtGemm`]), where it fits.
//! - The rest is cuBLAS, after widening a half-precision weight into the
//!   workspace when the activations are `f32`, followed by the epilogue as one
//!   in-place kernel when there is one.
//! - A group of products ([`crate::product_groups`]) is one [`gemv_group`] kernel
//!   ([`plan_group`]).

use crate::codegen::fused::{Epilogue, epilogue_in_place};
use crate::codegen::gemv::{GEMV_MAX_ROWS, GEMV_ROW_ELEMENTS, Gemv, GemvRows, gemv, gemv_rows};
use crate::codegen::gemv_group::{
    GROUP_INPUT_FLOATS, GroupProduct, GroupTail, RowGroup, gemv_group,
};
use crate::codegen::{self, Kernel};
use crate::lt_matmul::{LtGemm, LtHandle, LtOperands};
use crate::matmul::{Gemm, Product};
use crate::product_groups::ProductGroup;
use crate::program::{Arg, COUNTERS, Step};
use rlx_ir::{DType, NodeId, Op, Shape};
use rlx_opt::{Location, Plan};

/// Where workspace data starts (after the counters).
const DATA: usize = COUNTERS;

/// Steps of one node, each with the kind its kernel-table name takes.
pub(crate) type Steps = Vec<(&'static str, Step)>;

/// How the GPU's products are sized and what they may use.
#[derive(Clone, Copy)]
pub(crate) struct ProductOptions<'a> {
    /// Whether f32 products may round their inputs to TF32.
    pub allow_tf32: bool,
    /// Blocks a split-`K` matrix-vector kernel aims for.
    pub target_blocks: usize,
    /// The most blocks of a row-layout matrix-vector kernel.
    pub row_blocks: usize,
    /// cuBLASLt and the workspace bytes its products may use, where loaded.
    pub lt: Option<(&'a LtHandle, usize)>,
}

/// The steps of one fused product and the workspace data bytes they need. `inputs`
/// are the operands' locations (`a`, `b`, then the bias and residual the epilogue
/// takes); `b` is stored `[N, K]` when `b_transposed`.
pub(crate) fn plan(
    epilogue: &Epilogue,
    shapes: &[Shape],
    out_shape: &Shape,
    inputs: &[Location],
    out: Location,
    options: ProductOptions<'_>,
    b_transposed: bool,
) -> Result<(Steps, usize), String> {
    if out_shape.num_elements() == 0 {
        return Ok((Vec::new(), 0));
    }
    let (a, b) = (&shapes[0], &shapes[1]);
    let (adt, bdt) = (a.dtype(), b.dtype());
    let float = |d: DType| matches!(d, DType::F32 | DType::F16 | DType::BF16);
    let k = a.dims().last().copied().unwrap_or(1);
    let n = out_shape.dims().last().copied().unwrap_or(1);
    // Not empty (checked above), so `n` is not zero.
    let rows = out_shape.num_elements() / n;
    let extra: Vec<Arg> = inputs[2..].iter().map(|&l| Arg::At(l)).collect();
    if b_transposed && rows <= GEMV_MAX_ROWS && float(adt) && float(bdt) {
        let vector = k % 8 == 0 && aligned16(inputs[0]) && aligned16(inputs[1]);
        let g = GemvRows::new(rows, k, n, options.row_blocks, vector);
        let kernel =
            gemv_rows(codegen::STEP_NAME, &g, epilogue, adt, bdt).map_err(|e| e.to_string())?;
        let mut args = vec![Arg::At(out), Arg::At(inputs[0]), Arg::At(inputs[1])];
        args.extend(extra);
        return Ok((vec![("gemv", Step::Kernel { kernel, args })], 0));
    }
    let g = Gemv::new(
        rows,
        k,
        n,
        options.target_blocks,
        n % 8 == 0 && aligned16(inputs[1]),
    );
    // Past the workspace's per-tile counters, cuBLAS takes it.
    if b.rank() == 2
        && rows <= GEMV_MAX_ROWS
        && float(adt)
        && float(bdt)
        && g.tiles() * 4 <= COUNTERS
    {
        let kernel = gemv(codegen::STEP_NAME, &g, epilogue, adt, bdt).map_err(|e| e.to_string())?;
        let mut args = vec![Arg::At(out), Arg::At(inputs[0]), Arg::At(inputs[1])];
        args.extend(extra);
        args.push(Arg::Workspace(DATA));
        args.push(Arg::Workspace(0));
        return Ok((
            vec![("gemv", Step::Kernel { kernel, args })],
            g.partial_bytes(),
        ));
    }
    if let Some((handle, workspace)) = options.lt {
        let operands = LtOperands {
            shapes,
            inputs,
            out: (out_shape, out),
            b_transposed,
        };
        if let Some(g) = LtGemm::plan(handle, epilogue, &operands, options.allow_tf32, workspace) {
            return Ok((vec![("cublaslt", Step::Gemm(Product::Lt(Box::new(g))))], 0));
        }
    }
    let mut steps = Vec::new();
    let mut data = 0;
    let mut b_arg = Arg::At(inputs[1]);
    let mut b_shape = b.clone();
    if bdt != adt {
        // The product takes one dtype: the stored weight is widened once per run.
        let wide = b.with_dtype(adt);
        let kernel = codegen::kernel(
            codegen::STEP_NAME,
            &Op::Cast(adt),
            std::slice::from_ref(b),
            &wide,
            0,
        )
        .map_err(|e| e.to_string())?
        .ok_or("no cast kernel")?;
        steps.push((
            "widen",
            Step::Kernel {
                kernel,
                args: vec![Arg::Workspace(DATA), Arg::At(inputs[1])],
            },
        ));
        data = wide.byte_size();
        b_arg = Arg::Workspace(DATA);
        b_shape = wide;
    }
    let gemm = Gemm::new(
        &[a.clone(), b_shape],
        out_shape,
        (Arg::At(inputs[0]), b_arg, Arg::At(out)),
        epilogue.alpha,
        options.allow_tf32,
        b_transposed,
    )?;
    steps.push(("cublas", Step::Gemm(Product::Blas(gemm))));
    let rest = Epilogue {
        alpha: 1.0,
        ..*epilogue
    };
    if !rest.is_identity() {
        // Every allocation starts 256-byte aligned; arena values at the plan's
        // offsets.
        let aligned = std::iter::once(out)
            .chain(
                inputs
                    .get(2 + usize::from(rest.bias))
                    .copied()
                    .filter(|_| rest.residual),
            )
            .all(|l| l.offset.is_multiple_of(16));
        let kernel: Kernel = epilogue_in_place(codegen::STEP_NAME, &rest, out_shape, aligned)
            .map_err(|e| e.to_string())?;
        let mut args = vec![Arg::At(out)];
        args.extend(extra);
        steps.push(("epilogue", Step::Kernel { kernel, args }));
    }
    Ok((steps, data))
}

/// Whether a product can be computed by a row group kernel ([`gemv_group`]): a few
/// rows of float `a` (16-byte aligned) against a 2-D float weight stored `[N, K]`,
/// with `K` a multiple of 8 and short enough for one warp to walk a row, and the
/// rows few enough for a block to keep in shared memory.
pub(crate) fn joins_row_group(
    shapes: &[Shape],
    out_shape: &Shape,
    a_at: Location,
    b_transposed: bool,
) -> bool {
    let [a, b, ..] = shapes else {
        return false;
    };
    let float = |d: DType| matches!(d, DType::F32 | DType::F16 | DType::BF16);
    let k = a.dims().last().copied().unwrap_or(0);
    let n = out_shape.dims().last().copied().unwrap_or(0);
    let rows = out_shape.num_elements().checked_div(n).unwrap_or(0);
    b_transposed
        && b.rank() == 2
        && (1..=GEMV_MAX_ROWS).contains(&rows)
        && float(a.dtype())
        && float(b.dtype())
        && out_shape.dtype() == a.dtype()
        && k % 8 == 0
        && (8..=GEMV_ROW_ELEMENTS).contains(&k)
        && rows * k <= GROUP_INPUT_FLOATS
        && aligned16(a_at)
}

/// Whether 16-byte loads may start at `l`: every region starts 256-byte aligned (the
/// arena, each param, constant, input and handle its own allocation), so the offset
/// decides (a view's may be any).
pub(crate) fn aligned16(l: Location) -> bool {
    l.offset.is_multiple_of(16)
}

/// The one kernel of a [`ProductGroup`] of `plan`, with its operands; `tail` (and
/// its operands) adds rotations and cache writes of the outputs
/// ([`crate::rope_writes::as_tail`]).
pub(crate) fn plan_group(
    plan: &Plan,
    group: &ProductGroup,
    max_blocks: usize,
    tail: Option<(GroupTail, Vec<Arg>)>,
) -> Result<Steps, String> {
    let nodes = plan.graph.nodes();
    let at = |id: NodeId| Arg::At(plan.locations[id.index()]);
    let lead = &nodes[group.products[0].index()];
    let a = group.norm.map_or(lead.inputs[0], |n| n.x);
    let (a_shape, w_shape) = (plan.shape(lead.inputs[0]), plan.shape(lead.inputs[1]));
    let k = a_shape.dims().last().copied().unwrap_or(0);
    let mut products = Vec::new();
    let mut args: Vec<Arg> = match group.combine {
        Some(e) => vec![at(e)],
        None => group.products.iter().map(|&p| at(p)).collect(),
    };
    args.push(at(a));
    if let Some(norm) = group.norm {
        args.push(at(norm.gamma));
    }
    for &p in &group.products {
        let node = &nodes[p.index()];
        let epilogue =
            Epilogue::of(&node.op).ok_or_else(|| format!("%{} is not a product", p.index()))?;
        let n = plan.shape(p).dims().last().copied().unwrap_or(0);
        products.push(GroupProduct { n, epilogue });
        args.extend(node.inputs[1..].iter().map(|&x| at(x)));
    }
    let out = plan.shape(group.products[0]);
    let rows = out.num_elements() / products[0].n.max(1);
    let combine = match group.combine {
        Some(e) => Some(
            crate::product_groups::combining_steps(&nodes[e.index()].op)
                .ok_or_else(|| format!("%{} cannot combine products", e.index()))?,
        ),
        None => None,
    };
    // Staging the input (normalized once a block) measured faster for a folded
    // norm before a gate/up pair (gemv_bench on an H100, one bf16 row, 2048 x
    // 8192 each: 26.2 against 28.5 us) and a 2048 x 3072 product (the q/k/v shape:
    // 7.8 against 9.0 us), slower for a single 2048 x 8192 one (17.0 against 15.4).
    let staged = group.norm.is_some() && products.len() > 1;
    let tail = tail.map(|(tail, tail_args)| {
        args.extend(tail_args);
        tail
    });
    let g = RowGroup {
        rows,
        k,
        products,
        combine,
        norm: group.norm.map(|n| n.eps),
        max_blocks,
        staged,
        pairs: tail.is_some(),
        tail,
    };
    let kernel = gemv_group(codegen::STEP_NAME, &g, a_shape.dtype(), w_shape.dtype())
        .map_err(|e| e.to_string())?;
    Ok(vec![("gemv_group", Step::Kernel { kernel, args })])
}
