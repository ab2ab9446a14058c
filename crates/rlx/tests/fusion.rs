//! The optimizer's rewrites (constant folding, CSE, matmul epilogues, elementwise
//! regions) against the unfused graph: the rewritten graph must compute the same values
//! under the reference evaluator, and the CPU's fused kernels must match the reference
//! of the original graph, on random data and shapes. The fused graphs also run on
//! every other available device (its own fusions and kernels) against the same
//! reference.

mod common;

use rlx::ir::reference::{HostTensor, evaluate};
use rlx::opt::{FusionOptions, PlanOptions, plan_graph};
use rlx::prelude::*;
use std::collections::HashMap;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
    fn value(&mut self) -> f32 {
        (self.next() % 20001) as f32 / 10000.0 - 1.0
    }
}

/// Random values for every input and param of `g`.
fn feeds(g: &Graph, rng: &mut Rng) -> Vec<(String, Vec<f32>)> {
    g.inputs()
        .into_iter()
        .chain(g.params())
        .map(|(name, _, shape)| {
            (
                name,
                (0..shape.num_elements()).map(|_| rng.value()).collect(),
            )
        })
        .collect()
}

fn reference(g: &Graph, feeds: &[(String, Vec<f32>)]) -> Vec<HostTensor> {
    let mut values: HashMap<String, HostTensor> = HashMap::new();
    for (name, data) in feeds {
        let shape = g
            .inputs()
            .into_iter()
            .chain(g.params())
            .find(|(n, _, _)| n == name)
            .unwrap()
            .2;
        let wide: Vec<f64> = data.iter().map(|&v| f64::from(v)).collect();
        values.insert(
            name.clone(),
            HostTensor::from_data(shape.dims(), &TensorData::from_f64(shape.dtype(), &wide))
                .unwrap(),
        );
    }
    evaluate(g, &mut values).unwrap()
}

fn run_cpu(g: &Graph, feeds: &[(String, Vec<f32>)], optimize: bool) -> Vec<Vec<f32>> {
    run_on(Device::Cpu, g, feeds, optimize)
}

fn run_on(
    device: Device,
    g: &Graph,
    feeds: &[(String, Vec<f32>)],
    optimize: bool,
) -> Vec<Vec<f32>> {
    let c = Session::new(device)
        .compile_with(g, &CompileOptions::new().optimize(optimize))
        .unwrap();
    run_compiled(c, g, feeds)
}

/// The devices besides the CPU that the fused graphs also run on.
fn other_devices() -> Vec<Device> {
    common::test_devices()
        .into_iter()
        .filter(|d| *d != Device::Cpu)
        .collect()
}

/// Checks `got` against the reference `want` within `tol * (1 + |reference|)`.
fn assert_close(want: &[HostTensor], got: &[Vec<f32>], tol: f64, what: &str) {
    for (o, (w, r)) in want.iter().zip(got).enumerate() {
        assert_eq!(w.data.len(), r.len(), "{what}: output {o} length");
        for (i, (a, &b)) in w.data.iter().zip(r).enumerate() {
            assert!(
                (a - f64::from(b)).abs() <= tol * (1.0 + a.abs()),
                "{what}: output {o}[{i}]: {b} vs {a}"
            );
        }
    }
}

/// Sets `g`'s params from `feeds` and runs with the rest as inputs.
fn run_compiled(mut c: CompiledGraph, g: &Graph, feeds: &[(String, Vec<f32>)]) -> Vec<Vec<f32>> {
    run_compiled_again(&mut c, g, feeds)
}

/// [`run_compiled`] on a graph kept for more runs.
fn run_compiled_again(
    c: &mut CompiledGraph,
    g: &Graph,
    feeds: &[(String, Vec<f32>)],
) -> Vec<Vec<f32>> {
    let params: Vec<String> = g.params().into_iter().map(|p| p.0).collect();
    for (name, data) in feeds.iter().filter(|(n, _)| params.contains(n)) {
        c.set_param(name, data).unwrap();
    }
    let inputs: Vec<(&str, &[f32])> = feeds
        .iter()
        .filter(|(n, _)| !params.contains(n))
        .map(|(n, d)| (n.as_str(), d.as_slice()))
        .collect();
    c.run(&inputs).unwrap()
}

fn all_passes() -> PlanOptions {
    PlanOptions {
        fusion: FusionOptions::ALL,
        ..PlanOptions::default()
    }
}

/// Checks `g` three ways and returns how many fused nodes the plan has.
fn check(g: &Graph, rng: &mut Rng, what: &str) -> usize {
    check_within(g, rng, what, 2e-5)
}

/// [`check`] with the CPU results within `tol * (1 + |reference|)` (2e-5 for the
/// GEMM-based kernels, which round like a blocked `f32` sum).
fn check_within(g: &Graph, rng: &mut Rng, what: &str, tol: f64) -> usize {
    let feeds = feeds(g, rng);
    let want = reference(g, &feeds);
    let plan = plan_graph(g, &all_passes()).unwrap();
    // 1. The rewritten graph means the same thing.
    let rewritten = reference(&plan.graph, &feeds);
    for (o, (w, r)) in want.iter().zip(&rewritten).enumerate() {
        assert_eq!(w.shape, r.shape, "{what}: output {o} shape");
        for (i, (a, b)) in w.data.iter().zip(&r.data).enumerate() {
            assert!(
                (a - b).abs() <= 1e-6 * (1.0 + a.abs()),
                "{what}: rewritten graph, output {o}[{i}]: {b} vs {a}\n{}",
                plan.graph
            );
        }
    }
    // 2. The fused kernels match the reference of the original graph.
    let got = run_cpu(g, &feeds, true);
    for (o, (w, r)) in want.iter().zip(&got).enumerate() {
        for (i, (a, &b)) in w.data.iter().zip(r).enumerate() {
            assert!(
                (a - f64::from(b)).abs() <= tol * (1.0 + a.abs()),
                "{what}: fused CPU, output {o}[{i}]: {b} vs {a}\n{}",
                plan.graph
            );
        }
    }
    // 2b. So do the other devices' fused graphs.
    for device in other_devices() {
        let got = run_on(device, g, &feeds, true);
        assert_close(&want, &got, tol, &format!("{what}: fused on {device}"));
    }
    // 3. And the unfused CPU path agrees too.
    let plain = run_cpu(g, &feeds, false);
    for (o, (w, r)) in want.iter().zip(&plain).enumerate() {
        for (i, (a, &b)) in w.data.iter().zip(r).enumerate() {
            assert!(
                (a - f64::from(b)).abs() <= tol * (1.0 + a.abs()),
                "{what}: unfused CPU, output {o}[{i}]"
            );
        }
    }
    plan.fusions.len()
}

#[test]
fn matmul_epilogues_fuse_and_match() {
    let mut rng = Rng(11);
    type Activation = fn(&Graph, NodeId) -> rlx::Result<NodeId>;
    let acts: [Option<Activation>; 5] = [
        None,
        Some(|g, x| g.gelu(x)),
        Some(|g, x| g.gelu_tanh(x)),
        Some(|g, x| g.relu(x)),
        Some(|g, x| g.silu(x)),
    ];
    let mut fused_total = 0;
    for case in 0..40 {
        let batch = [vec![], vec![2], vec![3, 2]][rng.below(3)].clone();
        let (m, k, n) = (1 + rng.below(70), 1 + rng.below(90), 1 + rng.below(130));
        let g = Graph::new("epilogue");
        let mut a_dims = batch.clone();
        a_dims.extend([m, k]);
        let a = g.input("a", Shape::new(&a_dims, DType::F32)).unwrap();
        let w = g.param("w", Shape::new(&[k, n], DType::F32)).unwrap();
        let mut y = g.matmul(a, w).unwrap();
        // A constant scale (attention's `1/sqrt(d)`): the product's alpha.
        if rng.below(3) == 0 {
            y = g.mul(y, g.scalar(0.125, DType::F32)).unwrap();
        }
        let with_bias = rng.below(3) > 0;
        if with_bias {
            let b = g.param("b", Shape::new(&[n], DType::F32)).unwrap();
            // The bias on either side of the add.
            y = if rng.below(2) == 0 {
                g.add(y, b)
            } else {
                g.add(b, y)
            }
            .unwrap();
        }
        let act = acts[rng.below(acts.len())];
        if let Some(f) = act {
            y = f(&g, y).unwrap();
        }
        if rng.below(2) == 0 {
            let mut r_dims = batch.clone();
            r_dims.extend([m, n]);
            let r = g.input("r", Shape::new(&r_dims, DType::F32)).unwrap();
            y = g.add(r, y).unwrap();
        }
        g.set_outputs(vec![y]);
        let fused = check(
            &g,
            &mut rng,
            &format!("case {case} [{m}x{k}x{n}] batch {batch:?}"),
        );
        fused_total += fused;
    }
    assert!(fused_total >= 30, "only {fused_total} fusions formed");
    // The scale becomes the alpha, with nothing left of the multiply.
    let g = Graph::new("scaled");
    let a = g.input("a", Shape::new(&[6, 5], DType::F32)).unwrap();
    let b = g.input("b", Shape::new(&[5, 7], DType::F32)).unwrap();
    let y = g
        .mul(g.matmul(a, b).unwrap(), g.scalar(0.25, DType::F32))
        .unwrap();
    g.set_outputs(vec![y]);
    let plan = plan_graph(&g, &all_passes()).unwrap();
    let nodes = plan.graph.nodes();
    assert!(
        nodes.iter().any(|n| matches!(
            n.op,
            rlx::ir::Op::FusedMatMul { alpha, .. } if alpha.get() == 0.25
        )) && nodes.iter().all(|n| n.op.name() != "mul"),
        "{}",
        plan.graph
    );
}

/// On a GPU a product's bias and residual (and a ReLU with no residual after it)
/// are added by the library product as it stores its result (cuBLASLt's
/// epilogue): no epilogue kernel is left. A GELU is not one of those and keeps its
/// kernel. Every case matches the reference on every device.
#[test]
fn bias_and_residual_are_added_by_the_library_product() {
    let mut rng = Rng(29);
    // (epilogue, whether the library adds all of it)
    let cases: [(&str, bool); 5] = [
        ("bias", true),
        ("residual", true),
        ("bias residual", true),
        ("bias relu", true),
        ("bias gelu residual", false),
    ];
    // With `RLX_CUDA_LT=0` (or no cuBLASLt) the products stay with cuBLAS.
    let library_on = rlx::ir::env::Switch::CudaLt.enabled();
    // A weight param is stored `[N, K]` on a GPU (read transposed); a weight input
    // stays `[K, N]`.
    for (batch, m, k, n, weight_param) in [
        (vec![2], 40, 96, 72, true),
        (vec![], 33, 64, 136, true),
        (vec![3], 24, 48, 40, false),
    ] {
        for (epilogue, folded) in cases {
            let g = Graph::new("library epilogue");
            let mut dims = batch.clone();
            dims.extend([m, k]);
            let a = g.input("a", Shape::new(&dims, DType::F32)).unwrap();
            let w_shape = Shape::new(&[k, n], DType::F32);
            let w = if weight_param {
                g.param("w", w_shape)
            } else {
                g.input("w", w_shape)
            }
            .unwrap();
            let mut y = g.matmul(a, w).unwrap();
            if epilogue.contains("bias") {
                let b = g.param("b", Shape::new(&[n], DType::F32)).unwrap();
                y = g.add(y, b).unwrap();
            }
            if epilogue.contains("relu") {
                y = g.relu(y).unwrap();
            }
            if epilogue.contains("gelu") {
                y = g.gelu(y).unwrap();
            }
            if epilogue.contains("residual") {
                let mut r_dims = batch.clone();
                r_dims.extend([m, n]);
                let r = g.input("r", Shape::new(&r_dims, DType::F32)).unwrap();
                y = g.add(r, y).unwrap();
            }
            g.set_outputs(vec![y]);
            let what = format!("{epilogue}, {batch:?} x {m}x{k}x{n}, weight param {weight_param}");
            let feeds = feeds(&g, &mut rng);
            let want = reference(&g, &feeds);
            for device in common::test_devices() {
                let c = Session::new(device).compile(&g).unwrap();
                if device != Device::Cpu && library_on {
                    let kernels: Vec<String> = c.kernels().into_iter().map(|(_, k)| k).collect();
                    let epilogues = kernels.iter().filter(|k| k.contains("epilogue")).count();
                    let library = kernels.iter().filter(|k| k.contains("cublaslt")).count();
                    assert_eq!(
                        (library, epilogues),
                        if folded { (1, 0) } else { (0, 1) },
                        "{what} on {device}: {kernels:?}"
                    );
                }
                let got = run_compiled(c, &g, &feeds);
                assert_close(&want, &got, 2e-5, &format!("{what} on {device}"));
            }
        }
    }
}

#[test]
fn conv_epilogues_fuse_and_match() {
    let mut rng = Rng(23);
    type Activation = fn(&Graph, NodeId) -> rlx::Result<NodeId>;
    let acts: [Option<Activation>; 4] = [
        None,
        Some(|g, x| g.relu(x)),
        Some(|g, x| g.silu(x)),
        Some(|g, x| g.gelu(x)),
    ];
    let mut fused_total = 0;
    for case in 0..24 {
        let groups = [1, 1, 2][rng.below(3)];
        // Few channels per group (patch rows packed) or many (a product per tap, with
        // the weights regrouped by tap when the param is set).
        let per_group = [1 + rng.below(24), 32 + rng.below(16)][rng.below(2)];
        let (n, c, o) = (
            1 + rng.below(3),
            groups * per_group,
            groups * (1 + rng.below(40)),
        );
        let (h, w) = (3 + rng.below(20), 3 + rng.below(30));
        let (kh, kw) = ([1, 3, 5][rng.below(3)], [1, 3][rng.below(2)]);
        let stride = [1 + rng.below(2), 1 + rng.below(2)];
        let pad = [kh / 2, kw / 2, kh / 2, kw / 2];
        let g = Graph::new("conv epilogue");
        let x = g.input("x", Shape::new(&[n, c, h, w], DType::F32)).unwrap();
        let wt = g
            .param("w", Shape::new(&[o, c / groups, kh, kw], DType::F32))
            .unwrap();
        let bias = (rng.below(2) == 0).then(|| g.param("b", Shape::new(&[o], DType::F32)).unwrap());
        let mut y = g.conv2d(x, wt, bias, stride, pad, [1, 1], groups).unwrap();
        let act = acts[rng.below(acts.len())];
        if let Some(f) = act {
            y = f(&g, y).unwrap();
        }
        let with_residual = rng.below(3) > 0;
        if with_residual {
            let dims = g.shape(y).unwrap().dims().to_vec();
            let r = g.input("r", Shape::new(&dims, DType::F32)).unwrap();
            y = if rng.below(2) == 0 {
                g.add(r, y)
            } else {
                g.add(y, r)
            }
            .unwrap();
        }
        g.set_outputs(vec![y]);
        let fused = check(
            &g,
            &mut rng,
            &format!(
                "case {case} x[{n},{c},{h},{w}] w[{o},{},{kh},{kw}] s{stride:?} g{groups}",
                c / groups
            ),
        );
        assert_eq!(
            fused,
            usize::from(act.is_some() || with_residual),
            "case {case}"
        );
        fused_total += fused;
    }
    assert!(fused_total >= 12, "only {fused_total} fusions formed");
}

#[test]
fn winograd_convolutions_with_weights_transformed_ahead_match() {
    // 3x3 unit-stride convolutions with 32 or more channels (multiples of 8) and 16
    // or more tiles run by Winograd's F(4x4, 3x3); a param's weights are transformed
    // when it is set. Heights and widths leave partial edge tiles; batches put
    // several images' tile rows in one task.
    let mut rng = Rng(31);
    type Activation = fn(&Graph, NodeId) -> rlx::Result<NodeId>;
    let acts: [Option<Activation>; 3] = [None, Some(|g, x| g.relu(x)), Some(|g, x| g.gelu(x))];
    let cases = [
        (2, 32, 32, 15, 40, [1, 1, 1, 1]),
        (3, 64, 40, 12, 20, [1, 1, 1, 1]),
        (4, 48, 32, 11, 18, [0, 0, 0, 0]),
        (4, 40, 56, 11, 13, [2, 0, 1, 1]),
        // 16 tiles: with 2 or more threads, fewer than 16 a thread, so the threads
        // share the output channels (96: two panels).
        (1, 32, 96, 14, 14, [1, 1, 1, 1]),
        // Wider than 64 tiles: rows cut into pieces (68 tiles: two of 34).
        (1, 32, 40, 5, 270, [1, 2, 0, 1]),
        (2, 32, 32, 6, 300, [1, 1, 1, 1]),
    ];
    // Dilated: one undilated convolution per phase of the output.
    let dilated = [
        (1, 32, 40, 30, 28, [2, 2, 2, 2], [2, 2]),
        (2, 40, 32, 17, 19, [3, 1, 3, 1], [3, 1]),
    ];
    let cases = cases
        .into_iter()
        .map(|(n, c, o, h, w, pad)| (n, c, o, h, w, pad, [1, 1]))
        .chain(dilated);
    for (case, (n, c, o, h, w, pad, dilation)) in cases.enumerate() {
        let g = Graph::new("winograd");
        let x = g.input("x", Shape::new(&[n, c, h, w], DType::F32)).unwrap();
        let wt = g.param("w", Shape::new(&[o, c, 3, 3], DType::F32)).unwrap();
        let b = g.param("b", Shape::new(&[o], DType::F32)).unwrap();
        let mut y = g.conv2d(x, wt, Some(b), [1, 1], pad, dilation, 1).unwrap();
        if let Some(f) = acts[case % acts.len()] {
            y = f(&g, y).unwrap();
        }
        if case % 2 == 1 {
            let dims = g.shape(y).unwrap().dims().to_vec();
            let r = g.input("r", Shape::new(&dims, DType::F32)).unwrap();
            y = g.add(y, r).unwrap();
        }
        g.set_outputs(vec![y]);
        // Winograd's method rounds the transformed inputs and each point's sum, then
        // combines the points with weights up to 8, so its rounding does not shrink
        // with the output it lands on: worst 1.5-5.2e-5 of (1 + |ref|) on these
        // cases, against 2-4e-6 for the per-tap GEMMs (3-5 times theirs in absolute
        // terms). It grows like the square root of the sum's length, as the bound
        // `docs/ARCHITECTURE.md` states for it does.
        let what = format!("winograd case {case} x[{n},{c},{h},{w}] o{o} p{pad:?} d{dilation:?}");
        check_within(&g, &mut rng, &what, 5e-6 * ((9 * c) as f64).sqrt());
        let kernels = Session::new(Device::Cpu).compile(&g).unwrap().kernels();
        assert!(
            kernels.iter().any(|(_, k)| k.contains("winograd")),
            "{what}: {kernels:?}"
        );
    }
}

#[test]
fn a_batch_norm_after_the_residual_add_folds_into_the_convolution() {
    // ResNet blocks that normalize after the skip add: conv -> + residual -> * scale
    // + shift (per channel) -> relu is one FusedConv2d, on every f32 path: 1x1 packed
    // panels, per-tap products, Winograd, and a strided window with junk columns.
    let mut rng = Rng(37);
    let cases = [
        (2, 48, 64, 9, 10, 1, 1),
        (1, 40, 24, 8, 11, 3, 1),
        (2, 32, 32, 12, 9, 3, 1),
        (1, 16, 24, 11, 13, 3, 2),
    ];
    for (case, (n, c, o, h, w, k, stride)) in cases.into_iter().enumerate() {
        let g = Graph::new("bn after add");
        let x = g.input("x", Shape::new(&[n, c, h, w], DType::F32)).unwrap();
        let wt = g.param("w", Shape::new(&[o, c, k, k], DType::F32)).unwrap();
        let b = g.param("b", Shape::new(&[o], DType::F32)).unwrap();
        let pad = [k / 2; 4];
        let y = g
            .conv2d(x, wt, Some(b), [stride; 2], pad, [1, 1], 1)
            .unwrap();
        let dims = g.shape(y).unwrap().dims().to_vec();
        let r = g.input("r", Shape::new(&dims, DType::F32)).unwrap();
        let scale = g
            .param("scale", Shape::new(&[1, o, 1, 1], DType::F32))
            .unwrap();
        let shift = g
            .param("shift", Shape::new(&[1, o, 1, 1], DType::F32))
            .unwrap();
        let sum = g.add(y, r).unwrap();
        let normalized = g.add(g.mul(sum, scale).unwrap(), shift).unwrap();
        g.set_outputs(vec![g.relu(normalized).unwrap()]);
        let what = format!("bn after add, case {case}");
        let plan = plan_graph(&g, &all_passes()).unwrap();
        let fused: Vec<_> = plan
            .graph
            .nodes()
            .iter()
            .filter(|node| node.op.name() == "fused_conv2d")
            .map(|node| node.op.clone())
            .collect();
        assert!(
            matches!(
                fused[..],
                [rlx::ir::Op::FusedConv2d {
                    fusion: rlx::ir::ConvFusion {
                        residual: true,
                        channel_affine: true,
                        post_activation: Some(UnaryOp::Relu),
                        ..
                    },
                    ..
                }]
            ),
            "{what}: {fused:?}\n{}",
            plan.graph
        );
        // Winograd (case 2) rounds more; the bound its own test states.
        let tol = if case == 2 {
            5e-6 * ((9 * c) as f64).sqrt()
        } else {
            2e-5
        };
        check_within(&g, &mut rng, &what, tol);
    }
}

#[test]
fn a_relu_after_the_residual_add_folds_into_the_convolution() {
    // ResNet blocks without a norm after the skip add: conv -> + residual -> relu is
    // one FusedConv2d (the relu after an identity affine), on the 1x1 packed panels,
    // per-tap products, Winograd and a strided window; a second reader of the sum
    // keeps the relu out.
    let mut rng = Rng(43);
    let cases = [
        (2, 48, 64, 9, 10, 1, 1),
        (1, 40, 24, 8, 11, 3, 1),
        (2, 32, 32, 12, 9, 3, 1),
        (1, 16, 24, 11, 13, 3, 2),
    ];
    for (case, (n, c, o, h, w, k, stride)) in cases.into_iter().enumerate() {
        for shared in [false, true] {
            let g = Graph::new("relu after add");
            let x = g.input("x", Shape::new(&[n, c, h, w], DType::F32)).unwrap();
            let wt = g.param("w", Shape::new(&[o, c, k, k], DType::F32)).unwrap();
            let b = g.param("b", Shape::new(&[o], DType::F32)).unwrap();
            let y = g
                .conv2d(x, wt, Some(b), [stride; 2], [k / 2; 4], [1, 1], 1)
                .unwrap();
            let dims = g.shape(y).unwrap().dims().to_vec();
            let r = g.input("r", Shape::new(&dims, DType::F32)).unwrap();
            let sum = g.add(y, r).unwrap();
            let mut outs = vec![g.relu(sum).unwrap()];
            if shared {
                outs.push(g.neg(sum).unwrap());
            }
            g.set_outputs(outs);
            let what = format!("relu after add, case {case}, shared {shared}");
            let plan = plan_graph(&g, &all_passes()).unwrap();
            let fused: Vec<_> = plan
                .graph
                .nodes()
                .iter()
                .filter(|node| node.op.name() == "fused_conv2d")
                .map(|node| node.op.clone())
                .collect();
            let relu_inside = matches!(
                fused[..],
                [rlx::ir::Op::FusedConv2d {
                    fusion: rlx::ir::ConvFusion {
                        residual: true,
                        channel_affine: true,
                        post_activation: Some(UnaryOp::Relu),
                        ..
                    },
                    ..
                }]
            );
            assert_eq!(relu_inside, !shared, "{what}: {fused:?}\n{}", plan.graph);
            let tol = if case == 2 {
                5e-6 * ((9 * c) as f64).sqrt()
            } else {
                2e-5
            };
            check_within(&g, &mut rng, &what, tol);
        }
    }
}

/// Asserts that the optimized `g` has a fused convolution whose fusion `wanted`
/// accepts.
fn assert_fused_conv(g: &Graph, what: &str, wanted: impl Fn(&rlx::ir::ConvFusion) -> bool) {
    let plan = plan_graph(g, &all_passes()).unwrap();
    assert!(
        plan.graph.nodes().iter().any(|node| matches!(
            &node.op,
            rlx::ir::Op::FusedConv2d { fusion, .. } if wanted(fusion)
        )),
        "{what}:\n{}",
        plan.graph
    );
}

#[test]
fn a_batch_norm_before_a_pointwise_convolution_folds_into_it() {
    // The normalized sum feeds the next block's 1x1 convolution while the residual
    // chain carries the sum itself: the multiply, add and relu become the 1x1
    // convolution's input prologue, applied as its input is packed (or, for a 1x1
    // convolution on the pixel-row kernel, to a copy of its input). The scale and
    // shift are `[1, C, 1, 1]`, or `[C, 1, 1]` as exporters reshape a batch norm's.
    let mut rng = Rng(41);
    let cases = [
        (2, 48, 40, 9, 10, 1, false),
        (1, 64, 32, 7, 13, 2, false),
        (2, 48, 40, 9, 10, 1, true),
        (1, 96, 40, 7, 7, 1, true),
        (2, 128, 24, 5, 6, 1, false),
    ];
    for (case, (n, c, o, h, w, groups, rank3)) in cases.into_iter().enumerate() {
        let g = Graph::new("bn before 1x1");
        let sum = g
            .input("sum", Shape::new(&[n, c, h, w], DType::F32))
            .unwrap();
        let channel_dims: &[usize] = if rank3 { &[c, 1, 1] } else { &[1, c, 1, 1] };
        let scale = g
            .param("scale", Shape::new(channel_dims, DType::F32))
            .unwrap();
        let shift = g
            .param("shift", Shape::new(channel_dims, DType::F32))
            .unwrap();
        let normalized = g.add(g.mul(sum, scale).unwrap(), shift).unwrap();
        // A relu as batch-norm blocks have, and a silu (the packing's other branch).
        let (x, input_act) = if case % 2 == 0 {
            (g.relu(normalized).unwrap(), UnaryOp::Relu)
        } else {
            (g.silu(normalized).unwrap(), UnaryOp::Silu)
        };
        let wt = g
            .param("w", Shape::new(&[o, c / groups, 1, 1], DType::F32))
            .unwrap();
        let b = g.param("b", Shape::new(&[o], DType::F32)).unwrap();
        let y = g
            .conv2d(x, wt, Some(b), [1, 1], [0; 4], [1, 1], groups)
            .unwrap();
        // The sum is read again downstream (the residual chain).
        let skip = g.sum(sum, &[1], true).unwrap();
        g.set_outputs(vec![g.relu(y).unwrap(), skip]);
        let what = format!("bn before 1x1, case {case}");
        assert_fused_conv(&g, &what, |f| {
            f.input_affine
                && f.input_activation == Some(input_act)
                && f.activation == Some(UnaryOp::Relu)
        });
        check(&g, &mut rng, &what);
    }
}

#[test]
fn a_channel_scaling_before_a_pointwise_convolution_folds_into_it() {
    // A squeeze-and-excitation block scales its input's channels by values computed
    // from the input itself and feeds a 1x1 convolution: the multiply becomes the
    // convolution's input prologue (a scale, and a shift of -0, which changes no
    // value), applied while the input is packed, or to a copy on the pixel-row
    // kernel (7 x 7, 96 channels).
    let mut rng = Rng(43);
    for (n, c, o, h, w) in [(1, 48, 40, 9, 10), (1, 96, 24, 7, 7)] {
        let g = Graph::new("channel scaling before 1x1");
        let x = g.input("x", Shape::new(&[n, c, h, w], DType::F32)).unwrap();
        let pooled = g.mean(x, &[2, 3], true).unwrap();
        let scale = g.sigmoid(pooled).unwrap();
        let scaled = g.mul(x, scale).unwrap();
        let wt = g.param("w", Shape::new(&[o, c, 1, 1], DType::F32)).unwrap();
        let b = g.param("b", Shape::new(&[o], DType::F32)).unwrap();
        let y = g
            .conv2d(scaled, wt, Some(b), [1, 1], [0; 4], [1, 1], 1)
            .unwrap();
        g.set_outputs(vec![y]);
        let what = format!("channel scaling before 1x1, {c} channels at {h}x{w}");
        assert_fused_conv(&g, &what, |f| {
            f.input_affine && f.input_activation.is_none()
        });
        check(&g, &mut rng, &what);
    }
}

#[test]
fn a_fused_convolution_built_by_hand_runs_any_activation() {
    // The optimizer forms only activations the GEMM epilogue has; a graph may carry
    // others (tanh, sigmoid after a channel affine), which run after the convolution.
    let mut rng = Rng(29);
    for (groups, affine) in [(1, false), (2, false), (1, true), (2, true)] {
        // With the affine, an input prologue too: on a padded 3x3 window it is applied
        // to a copy of the input (padding stays zero after it).
        let g = Graph::new("fused conv by hand");
        let x = g
            .input("x", Shape::new(&[2, 64, 6, 7], DType::F32))
            .unwrap();
        let w = g
            .param("w", Shape::new(&[8, 64 / groups, 3, 3], DType::F32))
            .unwrap();
        let r = g.input("r", Shape::new(&[2, 8, 6, 7], DType::F32)).unwrap();
        let window = rlx::ir::Window2d {
            kernel: [3, 3],
            stride: [1, 1],
            padding: [1, 1, 1, 1],
            dilation: [1, 1],
        };
        let op = rlx::ir::Op::FusedConv2d {
            window,
            groups,
            fusion: rlx::ir::ConvFusion {
                bias: false,
                activation: Some(UnaryOp::Tanh),
                residual: true,
                channel_affine: affine,
                post_activation: affine.then_some(UnaryOp::Sigmoid),
                input_affine: affine,
                input_activation: affine.then_some(UnaryOp::Tanh),
            },
        };
        let mut operands = vec![x, w, r];
        if affine {
            for name in ["scale", "shift"] {
                operands.push(
                    g.param(name, Shape::new(&[1, 8, 1, 1], DType::F32))
                        .unwrap(),
                );
            }
            for name in ["in_scale", "in_shift"] {
                operands.push(
                    g.param(name, Shape::new(&[1, 64, 1, 1], DType::F32))
                        .unwrap(),
                );
            }
        }
        let y = g.push(op, &operands).unwrap();
        g.set_outputs(vec![y]);
        check(
            &g,
            &mut rng,
            &format!("fused conv tanh groups {groups} affine {affine}"),
        );
    }
}

#[test]
fn an_intermediate_read_twice_is_not_absorbed() {
    let g = Graph::new("shared");
    let a = g.input("a", Shape::new(&[4, 8], DType::F32)).unwrap();
    let w = g.param("w", Shape::new(&[8, 8], DType::F32)).unwrap();
    let b = g.param("b", Shape::new(&[8], DType::F32)).unwrap();
    let h = g.add(g.matmul(a, w).unwrap(), b).unwrap();
    let y = g.gelu(h).unwrap();
    // `h` is read again: the gelu must not be folded into the matmul.
    g.set_outputs(vec![g.add(y, h).unwrap()]);
    let plan = plan_graph(&g, &all_passes()).unwrap();
    let names: Vec<String> = plan.graph.nodes().iter().map(|n| n.op.name()).collect();
    assert!(names.contains(&"gelu".to_string()) || names.contains(&"elementwise".to_string()));
    assert!(
        plan.fusions
            .iter()
            .all(|f| !f.replaced.iter().any(|r| r.starts_with("gelu %5")))
    );
    check(&g, &mut Rng(3), "shared intermediate");
}

#[test]
fn two_matmul_chains_added_together_fuse_once() {
    // An LSTM step: x @ W + b + h @ R + c. The final add is reachable from both
    // chains; one absorbs it as its residual, the other ends before it.
    let g = Graph::new("lstm-step");
    let x = g.input("x", Shape::new(&[3, 5], DType::F32)).unwrap();
    let h = g.input("h", Shape::new(&[3, 4], DType::F32)).unwrap();
    let w = g.param("w", Shape::new(&[5, 8], DType::F32)).unwrap();
    let r = g.param("r", Shape::new(&[4, 8], DType::F32)).unwrap();
    let b = g.param("b", Shape::new(&[8], DType::F32)).unwrap();
    let c = g.param("c", Shape::new(&[8], DType::F32)).unwrap();
    let xw = g.add(g.matmul(x, w).unwrap(), b).unwrap();
    let hr = g.add(g.matmul(h, r).unwrap(), c).unwrap();
    g.set_outputs(vec![g.sigmoid(g.add(xw, hr).unwrap()).unwrap()]);
    let fused = check(&g, &mut Rng(5), "two chains");
    assert!(fused >= 2, "{fused} fusions");
}

#[test]
fn elementwise_regions_fuse_with_broadcasts_and_match() {
    let mut rng = Rng(29);
    let mut fused_total = 0;
    for case in 0..40 {
        let rows = 1 + rng.below(50);
        let cols = 1 + rng.below(700);
        let g = Graph::new("region");
        let x = g
            .input("x", Shape::new(&[2, rows, cols], DType::F32))
            .unwrap();
        let row_vec = g.input("v", Shape::new(&[cols], DType::F32)).unwrap();
        let col_vec = g.input("c", Shape::new(&[rows, 1], DType::F32)).unwrap();
        let scalar = g.input("s", Shape::new(&[1], DType::F32)).unwrap();
        // Per-"channel" values repeated over runs of `cols`, as a [1, C, 1, 1] scale.
        let channel = g.input("k", Shape::new(&[1, rows, 1], DType::F32)).unwrap();
        // One row per batch element, broadcast over the rows between (strided).
        let plane = g.input("p", Shape::new(&[2, 1, cols], DType::F32)).unwrap();
        let mut pool = vec![x];
        let mut y = x;
        for _ in 0..2 + rng.below(8) {
            let other = [
                row_vec,
                col_vec,
                scalar,
                channel,
                plane,
                x,
                pool[rng.below(pool.len())],
            ][rng.below(7)];
            y = match rng.below(10) {
                0 => g.add(y, other),
                1 => g.mul(other, y),
                2 => g.sub(y, other),
                3 => g.div(
                    y,
                    g.add(g.abs(other).unwrap(), g.scalar(1.0, DType::F32))
                        .unwrap(),
                ),
                4 => g.tanh(y),
                5 => g.gelu(y),
                6 => g.exp(g.neg(g.abs(y).unwrap()).unwrap()),
                7 => g.maximum(y, other),
                8 => g.sigmoid(y),
                _ => g.silu(y),
            }
            .unwrap();
            pool.push(y);
        }
        // Sometimes a second output reads an intermediate, which must stay computed.
        let outputs = if rng.below(3) == 0 && pool.len() > 2 {
            vec![y, pool[1 + rng.below(pool.len() - 2)]]
        } else {
            vec![y]
        };
        g.set_outputs(outputs);
        fused_total += check(&g, &mut rng, &format!("case {case} [2x{rows}x{cols}]"));
    }
    assert!(fused_total >= 30, "only {fused_total} regions formed");
    // Pooled values broadcast over their windows, in the 6-D view of the input: the
    // broadcast operand's runs are two wide, and its rows repeat along a middle axis.
    let cases: [(&[usize], &[usize]); 2] = [
        (&[2, 3, 4, 2, 5, 2], &[2, 3, 4, 1, 5, 1]),
        (&[3, 7, 3, 9, 1], &[3, 1, 3, 1, 1]),
    ];
    for (windows, pooled) in cases {
        let g = Graph::new("windows");
        let x = g.input("x", Shape::new(windows, DType::F32)).unwrap();
        let m = g.input("m", Shape::new(pooled, DType::F32)).unwrap();
        let below = g.unary(UnaryOp::Sign, g.sub(m, x).unwrap()).unwrap();
        let y = g
            .mul(g.sub(g.scalar(1.0, DType::F32), below).unwrap(), m)
            .unwrap();
        g.set_outputs(vec![y]);
        assert_eq!(check(&g, &mut rng, &format!("windows {windows:?}")), 1);
    }
}

#[test]
fn a_cheap_value_read_by_two_regions_is_computed_in_each() {
    let mut rng = Rng(37);
    let f32s = |g: &Graph, name: &str, dims: &[usize]| {
        g.input(name, Shape::new(dims, DType::F32)).unwrap()
    };
    // Adam's moments from one clipped gradient: the scaled gradient is read by both
    // updates, and both take a copy of the scaling instead of reading it back.
    let g = Graph::new("moments");
    let (grad, m, v) = (
        f32s(&g, "g", &[48, 33]),
        f32s(&g, "m", &[48, 33]),
        f32s(&g, "v", &[48, 33]),
    );
    let clip = f32s(&g, "clip", &[1]);
    let c = |x: f64| g.scalar(x, DType::F32);
    let clipped = g.mul(grad, clip).unwrap();
    let m_next = g
        .add(g.mul(m, c(0.9)).unwrap(), g.mul(clipped, c(0.1)).unwrap())
        .unwrap();
    let square = g.mul(clipped, clipped).unwrap();
    let v_next = g
        .add(
            g.mul(v, c(0.999)).unwrap(),
            g.mul(square, c(0.001)).unwrap(),
        )
        .unwrap();
    g.set_outputs(vec![m_next, v_next]);
    assert_eq!(check(&g, &mut rng, "moments"), 2);
    let plan = plan_graph(&g, &all_passes()).unwrap();
    let ops: Vec<String> = plan.graph.nodes().iter().map(|n| n.op.name()).collect();
    assert_eq!(
        ops.iter().filter(|o| *o == "elementwise").count(),
        2,
        "{}",
        plan.graph
    );
    assert!(!ops.iter().any(|o| o == "mul"), "{}", plan.graph);
    // Left shared: a value of two full-size operands read by two regions (a copy
    // would read both in each), one that is costly (exp), and a cheap one that is
    // also a graph output (written out anyway).
    for case in 0..3 {
        let g = Graph::new("kept");
        let (a, b) = (f32s(&g, "a", &[20, 30]), f32s(&g, "b", &[20, 30]));
        let shared = match case {
            0 => g.add(a, b).unwrap(),
            1 => g.exp(a).unwrap(),
            _ => g.mul(a, g.scalar(0.5, DType::F32)).unwrap(),
        };
        let first = g.tanh(g.mul(shared, b).unwrap()).unwrap();
        let second = g.sigmoid(g.sub(shared, a).unwrap()).unwrap();
        let mut outputs = vec![first, second];
        if case == 2 {
            outputs.push(shared);
        }
        g.set_outputs(outputs);
        check(&g, &mut rng, &format!("kept {case}"));
        let plan = plan_graph(&g, &all_passes()).unwrap();
        let standalone = plan
            .graph
            .nodes()
            .iter()
            .filter(|n| matches!(n.op.name().as_str(), "add" | "exp" | "mul"))
            .count();
        assert_eq!(standalone, 1, "case {case}: {}", plan.graph);
    }
}

#[test]
fn constants_fold_and_duplicates_merge() {
    let g = Graph::new("simplify");
    let x = g.input("x", Shape::new(&[3, 5], DType::F32)).unwrap();
    let c1 = g.constant_f32(&[1.0, 2.0, 3.0, 4.0, 5.0], &[5]).unwrap();
    let c2 = g.constant_f32(&[0.5; 5], &[5]).unwrap();
    // exp(c1) * c2 + range: folded to one constant.
    let r = g.range(0.0, 5.0, 1.0, DType::F32).unwrap();
    let folded = g.add(g.mul(g.exp(c1).unwrap(), c2).unwrap(), r).unwrap();
    // The same subexpression twice.
    let t1 = g.tanh(x).unwrap();
    let t2 = g.tanh(x).unwrap();
    let y = g
        .add(g.mul(t1, folded).unwrap(), g.mul(t2, folded).unwrap())
        .unwrap();
    g.set_outputs(vec![y]);
    let plan = plan_graph(&g, &PlanOptions::default()).unwrap();
    let ops: Vec<String> = plan.graph.nodes().iter().map(|n| n.op.name()).collect();
    assert_eq!(ops.iter().filter(|o| *o == "tanh").count(), 1, "{ops:?}");
    assert_eq!(ops.iter().filter(|o| *o == "mul").count(), 1, "{ops:?}");
    assert!(
        !ops.contains(&"exp".to_string()) && !ops.contains(&"range".to_string()),
        "{ops:?}"
    );
    check(&g, &mut Rng(5), "folding and CSE");
}

#[test]
fn write_at_is_never_merged_or_folded() {
    let g = Graph::new("state");
    let cache = g.input("cache", Shape::new(&[4, 2], DType::F32)).unwrap();
    let row = g.input("row", Shape::new(&[1, 2], DType::F32)).unwrap();
    let pos = g.constant(TensorData::I64(vec![1]), &[1]).unwrap();
    let w1 = g.write_at(cache, row, pos, 0).unwrap();
    g.set_outputs(vec![g.sum(w1, &[0], false).unwrap()]);
    let plan = plan_graph(
        &g,
        &PlanOptions {
            handles: vec![("cache".into(), Shape::new(&[4, 2], DType::F32))],
            ..PlanOptions::default()
        },
    )
    .unwrap();
    assert!(plan.graph.nodes().iter().any(|n| n.op.name() == "write_at"));
}

/// Whether `nodes` hold an attention that reads and writes the sequence-major
/// layout.
fn has_sequence_major_attention(nodes: &[rlx::ir::Node]) -> bool {
    nodes.iter().any(|n| {
        matches!(
            n.op,
            rlx::ir::Op::Attention {
                seq_major: true,
                ..
            }
        )
    })
}

#[test]
fn attention_head_transposes_fold_into_a_sequence_major_attention() {
    let mut rng = Rng(41);
    for (b, s, heads, d, causal) in [
        (1, 7, 2, 4, false),
        (2, 70, 3, 8, true),
        (1, 130, 4, 16, false),
    ] {
        let g = Graph::new("heads");
        let h = heads * d;
        let x = g.input("x", Shape::new(&[b, s, h], DType::F32)).unwrap();
        let mask = g
            .input("mask", Shape::new(&[b, 1, 1, s], DType::F32))
            .unwrap();
        let split = |t: NodeId| {
            g.permute(g.reshape(t, &[b, s, heads, d]).unwrap(), &[0, 2, 1, 3])
                .unwrap()
        };
        let wq = g.param("wq", Shape::new(&[h, h], DType::F32)).unwrap();
        let q = split(g.matmul(x, wq).unwrap());
        let k = split(g.tanh(x).unwrap());
        let v = split(x);
        let a = g.attention(q, k, v, Some(mask), causal, None).unwrap();
        let merged = g
            .reshape(g.permute(a, &[0, 2, 1, 3]).unwrap(), &[b, s, h])
            .unwrap();
        g.set_outputs(vec![merged]);
        let plan = plan_graph(&g, &all_passes()).unwrap();
        let nodes = plan.graph.nodes();
        assert!(
            nodes.iter().all(|n| n.op.name() != "permute"),
            "{}",
            plan.graph
        );
        assert!(has_sequence_major_attention(&nodes), "{}", plan.graph);
        drop(nodes);
        check(&g, &mut rng, &format!("attention layout b={b} s={s}"));
    }
}

/// torchvision's attention (sequence-first inside a batch-first model): one
/// product makes queries, keys and values, split by slicing `[3, s, 1, d]`, and
/// heads split as `[s, h, dh]` to `[h, s, dh]` before a reshape to `[1, h, s, dh]`;
/// the result goes back as `[s, 1, h, dh]`. The head transposes fold into a
/// sequence-major attention that reads and writes through reshapes; the batch-first
/// permutes of unit axes are views.
#[test]
fn sequence_first_attention_head_transposes_fold_too() {
    let mut rng = Rng(0x5f1);
    for (s, heads, dh) in [(9, 2, 8), (70, 3, 16)] {
        let d = heads * dh;
        let g = Graph::new("sequence first attention");
        let x = g.input("x", Shape::new(&[1, s, d], DType::F32)).unwrap();
        let w = g.param("w", Shape::new(&[d, 3 * d], DType::F32)).unwrap();
        let seq_first = g.permute(x, &[1, 0, 2]).unwrap();
        let qkv = g.matmul(seq_first, w).unwrap();
        let qkv = g.reshape(qkv, &[s, 1, 3, d]).unwrap();
        let qkv = g.reshape(qkv, &[1, s, 1, 3, d]).unwrap();
        let qkv = g.permute(qkv, &[3, 1, 2, 0, 4]).unwrap();
        let qkv = g.reshape(qkv, &[3, s, 1, d]).unwrap();
        let split = |i: isize| {
            let t = g.slice(qkv, 0, i, i + 1, 1).unwrap();
            let t = g.reshape(t, &[s, heads, dh]).unwrap();
            let t = g.permute(t, &[1, 0, 2]).unwrap();
            g.reshape(t, &[1, heads, s, dh]).unwrap()
        };
        let (q, k, v) = (split(0), split(1), split(2));
        let a = g.attention(q, k, v, None, false, None).unwrap();
        let merged = g.permute(a, &[2, 0, 1, 3]).unwrap();
        let merged = g.reshape(merged, &[s, 1, d]).unwrap();
        let batch_first = g.permute(merged, &[1, 0, 2]).unwrap();
        g.set_outputs(vec![g.add(batch_first, x).unwrap()]);
        let plan = plan_graph(&g, &all_passes()).unwrap();
        let nodes = plan.graph.nodes();
        // Left to copy: the one permute that moves the 3 of q, k and v first.
        let copies = (0..nodes.len())
            .filter(|&i| nodes[i].op.name() == "permute" && !plan.is_view[i])
            .count();
        assert_eq!(copies, 1, "{}", plan.graph);
        assert!(has_sequence_major_attention(&nodes), "{}", plan.graph);
        drop(nodes);
        check(&g, &mut rng, &format!("sequence-first attention s={s}"));
    }
}

/// The same layout with keys and values of their own length and head count
/// (cross-attention over another sequence, grouped heads): each operand is read
/// through a reshape to its own sequence-major dims.
#[test]
fn sequence_first_cross_and_grouped_attention_fold_too() {
    let mut rng = Rng(0xc205);
    for (s, heads, sk, kv_heads, dh) in [(9, 2, 13, 2, 8), (11, 4, 6, 2, 8), (7, 2, 5, 1, 16)] {
        let what = format!("s {s} heads {heads}, keys {sk} heads {kv_heads}");
        let g = Graph::new("sequence first cross attention");
        let x = g
            .input("x", Shape::new(&[1, s, heads * dh], DType::F32))
            .unwrap();
        let y = g
            .input("y", Shape::new(&[1, sk, kv_heads * dh], DType::F32))
            .unwrap();
        // `[1, n, h * dh]` batch first to `[1, h, n, dh]` as torchvision splits heads.
        let split = |t: NodeId, n: usize, h: usize, name: &str| {
            let w = g
                .param(name, Shape::new(&[h * dh, h * dh], DType::F32))
                .unwrap();
            let t = g.permute(t, &[1, 0, 2]).unwrap();
            let t = g.matmul(t, w).unwrap();
            let t = g.reshape(t, &[n, h, dh]).unwrap();
            let t = g.permute(t, &[1, 0, 2]).unwrap();
            g.reshape(t, &[1, h, n, dh]).unwrap()
        };
        let q = split(x, s, heads, "wq");
        let k = split(y, sk, kv_heads, "wk");
        let v = split(g.tanh(y).unwrap(), sk, kv_heads, "wv");
        let a = g.attention(q, k, v, None, false, None).unwrap();
        let merged = g.permute(a, &[2, 0, 1, 3]).unwrap();
        let merged = g.reshape(merged, &[s, 1, heads * dh]).unwrap();
        g.set_outputs(vec![g.permute(merged, &[1, 0, 2]).unwrap()]);
        let plan = plan_graph(&g, &all_passes()).unwrap();
        let nodes = plan.graph.nodes();
        assert!(
            has_sequence_major_attention(&nodes),
            "{what}\n{}",
            plan.graph
        );
        drop(nodes);
        check(&g, &mut rng, &what);
    }
}

#[test]
fn attention_written_out_in_ops_becomes_one_attention() {
    let mut rng = Rng(57);
    // (batch, heads, sq, sk, d, scale form, masked)
    for (b, h, sq, sk, d, form, masked) in [
        (1, 2, 5, 7, 4, 0, false),
        (2, 3, 70, 300, 8, 1, true),
        (1, 4, 16, 16, 16, 2, true),
        (2, 1, 9, 9, 4, 0, true),
    ] {
        let g = Graph::new("spelled-out attention");
        let q = g
            .input("q", Shape::new(&[b, h, sq, d], DType::F32))
            .unwrap();
        let k = g
            .input("k", Shape::new(&[b, h, sk, d], DType::F32))
            .unwrap();
        let v = g
            .input("v", Shape::new(&[b, h, sk, d], DType::F32))
            .unwrap();
        let mask = g
            .input("mask", Shape::new(&[b, 1, 1, sk], DType::F32))
            .unwrap();
        let qk = g.matmul(q, g.transpose(k, -1, -2).unwrap()).unwrap();
        let c = (d as f64).sqrt();
        let scaled = match form {
            0 => g.div(qk, g.scalar(c, DType::F32)),
            1 => g.mul(qk, g.scalar(1.0 / c, DType::F32)),
            _ => g.mul(g.scalar(0.3, DType::F32), qk),
        }
        .unwrap();
        let scores = if masked {
            g.add(mask, scaled).unwrap()
        } else {
            scaled
        };
        let out = g.matmul(g.softmax(scores, -1).unwrap(), v).unwrap();
        g.set_outputs(vec![out]);
        let plan = plan_graph(&g, &all_passes()).unwrap();
        let ops: Vec<String> = plan.graph.nodes().iter().map(|n| n.op.name()).collect();
        assert!(
            ops.contains(&"attention".to_string()) && !ops.contains(&"softmax".to_string()),
            "{}",
            plan.graph
        );
        check(
            &g,
            &mut rng,
            &format!("attention pattern b={b} h={h} sq={sq} sk={sk}"),
        );
    }
    // A softmax over another axis, or scores read twice, is left alone.
    let g = Graph::new("not attention");
    let q = g.input("q", Shape::new(&[1, 2, 4, 4], DType::F32)).unwrap();
    let qk = g.matmul(q, g.transpose(q, -1, -2).unwrap()).unwrap();
    let p = g.softmax(qk, 2).unwrap();
    g.set_outputs(vec![g.matmul(p, q).unwrap(), qk]);
    let plan = plan_graph(&g, &all_passes()).unwrap();
    assert!(plan.graph.nodes().iter().any(|n| n.op.name() == "softmax"));
    check(&g, &mut rng, "not attention");
}

#[test]
fn transposed_operands_are_read_by_the_product_without_a_copy() {
    let mut rng = Rng(91);
    // (batch dims, m, k, n, transpose a, transpose b, bias): a weight gradient's
    // `xᵀ dy` (k long), an input gradient's `dy wᵀ`, both at once under a batch, and
    // edges that are not whole tiles.
    type Case = (&'static [usize], usize, usize, usize, bool, bool, bool);
    let cases: [Case; 6] = [
        (&[], 64, 300, 48, true, false, false),
        (&[], 37, 19, 70, false, true, true),
        (&[3], 20, 33, 17, true, true, false),
        (&[2, 2], 9, 8, 40, true, false, true),
        (&[], 130, 64, 200, true, true, true),
        (&[4], 16, 128, 16, false, true, false),
    ];
    for (batch, m, k, n, ta, tb, with_bias) in cases {
        let g = Graph::new("transposed operands");
        let stored = |rows: usize, cols: usize, swap: bool| {
            let mut dims = batch.to_vec();
            dims.extend(if swap { [cols, rows] } else { [rows, cols] });
            Shape::new(&dims, DType::F32)
        };
        let a = g.input("a", stored(m, k, ta)).unwrap();
        let b = g.input("b", stored(k, n, tb)).unwrap();
        let read = |x: NodeId, swap: bool| {
            if swap {
                g.transpose(x, -1, -2).unwrap()
            } else {
                x
            }
        };
        let mut y = g.matmul(read(a, ta), read(b, tb)).unwrap();
        if with_bias {
            let bias = g.input("bias", Shape::new(&[n], DType::F32)).unwrap();
            y = g.add(y, bias).unwrap();
        }
        g.set_outputs(vec![y]);
        let what = format!("{batch:?} {m}x{k}x{n} a^T={ta} b^T={tb} bias={with_bias}");
        let plan = plan_graph(&g, &all_passes()).unwrap();
        let nodes = plan.graph.nodes();
        assert!(
            nodes.iter().all(|n| n.op.name() != "permute"),
            "{what}: {}",
            plan.graph
        );
        assert!(
            nodes.iter().any(|n| matches!(
                n.op,
                rlx::ir::Op::FusedMatMul { transpose_a, transpose_b, .. }
                    if transpose_a == ta && transpose_b == tb
            )),
            "{what}: {}",
            plan.graph
        );
        check(&g, &mut rng, &what);
    }
    // A transpose that something else also reads stays a copy, read by both.
    let g = Graph::new("shared transpose");
    let a = g.input("a", Shape::new(&[24, 10], DType::F32)).unwrap();
    let b = g.input("b", Shape::new(&[24, 6], DType::F32)).unwrap();
    let at = g.transpose(a, 0, 1).unwrap();
    let y = g.matmul(at, b).unwrap();
    g.set_outputs(vec![y, g.exp(at).unwrap()]);
    let plan = plan_graph(&g, &all_passes()).unwrap();
    assert!(
        plan.graph.nodes().iter().any(|n| n.op.name() == "permute"),
        "{}",
        plan.graph
    );
    check(&g, &mut rng, "shared transpose");
    // Built by hand, it decomposes into a transpose and a product.
    let g = Graph::new("transposed by hand");
    let a = g.input("a", Shape::new(&[2, 7, 5], DType::F32)).unwrap();
    let b = g.input("b", Shape::new(&[2, 3, 7], DType::F32)).unwrap();
    let op = rlx::ir::Op::FusedMatMul {
        alpha: rlx::ir::F64Bits::new(0.5),
        transpose_a: true,
        transpose_b: true,
        bias: false,
        activation: None,
        residual: false,
    };
    let y = g.push(op, &[a, b]).unwrap();
    assert_eq!(g.shape(y).unwrap().dims(), [2, 5, 3]);
    g.set_outputs(vec![y]);
    check_decomposed(&g, &mut rng, "transposed by hand");
}

#[test]
fn half_precision_weights_are_read_by_the_matmul_without_a_cast() {
    let mut rng = Rng(77);
    for dtype in [DType::F16, DType::BF16] {
        // A decode row read 16 bytes at a time, a few rows read one element at a
        // time, and a product for the BLAS.
        for (m, k, n) in [(1, 256, 72), (3, 17, 40), (64, 96, 130)] {
            let g = Graph::new("half weights");
            let x = g.input("x", Shape::new(&[m, k], DType::F32)).unwrap();
            let w = g.param("w", Shape::new(&[k, n], dtype)).unwrap();
            let b = g.param("b", Shape::new(&[n], DType::F32)).unwrap();
            let y = g
                .gelu(
                    g.add(g.matmul(x, g.cast(w, DType::F32).unwrap()).unwrap(), b)
                        .unwrap(),
                )
                .unwrap();
            g.set_outputs(vec![y]);
            let plan = plan_graph(&g, &all_passes()).unwrap();
            {
                let nodes = plan.graph.nodes();
                let fused = nodes
                    .iter()
                    .find(|n| n.op.name() == "fused_matmul")
                    .expect("a fused matmul");
                assert_eq!(
                    nodes[fused.inputs[1].index()].shape.dtype(),
                    dtype,
                    "{}",
                    plan.graph
                );
                assert!(
                    nodes.iter().all(|n| n.op.name() != "cast"),
                    "{}",
                    plan.graph
                );
            }
            // Values exact in both half formats (multiples of 1/128 in [-1, 1]), so the
            // reference, which reads the f32 feeds, sees the stored weights.
            let mut feeds = feeds(&g, &mut rng);
            for (_, data) in &mut feeds {
                data.iter_mut()
                    .for_each(|v| *v = (*v * 128.0).round() / 128.0);
            }
            let want = reference(&g, &feeds);
            for device in common::test_devices() {
                let got = run_on(device, &g, &feeds, true);
                assert_close(
                    &want,
                    &got,
                    2e-5,
                    &format!("{dtype} {m}x{k}x{n} on {device}"),
                );
            }
        }
    }
}

/// A decode layer's products (a GPU runs products of one input as one kernel, the
/// norm before them folded in, gate and up combined by the SwiGLU product): norm,
/// q/k/v (k with a bias), the output projection with a residual, norm, gate and up,
/// down with a residual; half and f32 weights, one and three rows.
#[test]
fn a_decode_layers_products_match_the_reference() {
    let mut rng = Rng(91);
    for dtype in [DType::BF16, DType::F16, DType::F32] {
        for (rows, hidden, kv, ffn) in [(1, 256, 64, 384), (3, 64, 24, 136)] {
            let g = Graph::new("decode layer");
            let f32s = |d: &[usize]| Shape::new(d, DType::F32);
            let weight = |name: &str, k: usize, n: usize| {
                let w = g.param(name, Shape::new(&[k, n], dtype)).unwrap();
                if dtype == DType::F32 {
                    w
                } else {
                    g.cast(w, DType::F32).unwrap()
                }
            };
            let x = g.input("x", f32s(&[rows, hidden])).unwrap();
            let h = g
                .rms_norm(x, g.param("g1", f32s(&[hidden])).unwrap(), 1e-5)
                .unwrap();
            let q = g.matmul(h, weight("wq", hidden, hidden)).unwrap();
            let k = g
                .add(
                    g.matmul(h, weight("wk", hidden, kv)).unwrap(),
                    g.param("bk", f32s(&[kv])).unwrap(),
                )
                .unwrap();
            let v = g.matmul(h, weight("wv", hidden, kv)).unwrap();
            let o = g
                .add(x, g.matmul(q, weight("wo", hidden, hidden)).unwrap())
                .unwrap();
            let h2 = g
                .rms_norm(o, g.param("g2", f32s(&[hidden])).unwrap(), 1e-5)
                .unwrap();
            let gate = g.matmul(h2, weight("wg", hidden, ffn)).unwrap();
            let up = g.matmul(h2, weight("wu", hidden, ffn)).unwrap();
            let act = g.mul(g.silu(gate).unwrap(), up).unwrap();
            let down = g
                .add(o, g.matmul(act, weight("wd", ffn, hidden)).unwrap())
                .unwrap();
            g.set_outputs(vec![k, v, down]);
            // Values exact in both half formats, so the reference sees the stored
            // weights; weights scaled by 1/16 so every value stays near 1 and f32
            // sums stay within the tolerance.
            let mut feeds = feeds(&g, &mut rng);
            for (name, data) in &mut feeds {
                let scale = if name.starts_with('w') { 16.0 } else { 1.0 };
                data.iter_mut()
                    .for_each(|v| *v = (*v * 128.0).round() / 128.0 / scale);
            }
            let want = reference(&g, &feeds);
            for device in common::test_devices() {
                let got = run_on(device, &g, &feeds, true);
                assert_close(
                    &want,
                    &got,
                    2e-5,
                    &format!("{dtype} {rows}x{hidden} on {device}"),
                );
            }
        }
    }
}

fn as_f32(d: &TensorData) -> Vec<f32> {
    d.as_ref().to_f64_vec().iter().map(|&v| v as f32).collect()
}

/// A decode step's q/k/v products after a norm, then rotations, cache writes and
/// attention over the cache (the CUDA backend does the rotations and writes inside
/// the products' kernel: no rotation kernel is left). The attention, the rotated q
/// and both caches match the reference over several positions; a position past the
/// cache is an error that writes neither cache, and the graph runs on after it.
#[test]
fn a_decode_steps_projections_rotate_into_their_caches() {
    use rlx::ir::RopeStyle;
    let (hidden, heads, kv_heads, dim, max_seq) = (128, 4, 2, 32, 8);
    let mut rng = Rng(0x51);
    for dtype in [DType::BF16, DType::F32] {
        for style in [RopeStyle::HalfSplit, RopeStyle::Interleaved] {
            let label = format!("{dtype} {style:?}");
            let g = Graph::new("decode projections");
            let f32s = |d: &[usize]| Shape::new(d, DType::F32);
            let weight = |name: &str, k: usize, n: usize| {
                let w = g.param(name, Shape::new(&[k, n], dtype)).unwrap();
                if dtype == DType::F32 {
                    w
                } else {
                    g.cast(w, DType::F32).unwrap()
                }
            };
            let x = g.input("x", f32s(&[1, hidden])).unwrap();
            let h = g
                .rms_norm(x, g.param("g1", f32s(&[hidden])).unwrap(), 1e-5)
                .unwrap();
            let project = |name: &str, n: usize| {
                let p = g.matmul(h, weight(name, hidden, n * dim)).unwrap();
                g.reshape(p, &[1, 1, n, dim]).unwrap()
            };
            let (q, k, v) = (
                project("wq", heads),
                project("wk", kv_heads),
                project("wv", kv_heads),
            );
            let cos = g.input("cos", f32s(&[1, 1, 1, dim / 2])).unwrap();
            let sin = g.input("sin", f32s(&[1, 1, 1, dim / 2])).unwrap();
            let pos = g.input("pos", Shape::new(&[1], DType::I64)).unwrap();
            let cache = f32s(&[1, max_seq, kv_heads, dim]);
            let k_cache = g.input("k_cache", cache.clone()).unwrap();
            let v_cache = g.input("v_cache", cache.clone()).unwrap();
            let q = g.rope(q, cos, sin, style).unwrap();
            let k = g.rope(k, cos, sin, style).unwrap();
            let k_all = g.write_at(k_cache, k, pos, 1).unwrap();
            let v_all = g.write_at(v_cache, v, pos, 1).unwrap();
            let att = g.cached_attention(q, k_all, v_all, pos, None).unwrap();
            // The residual keeps x live past the products, as in a layer.
            let out = g.add(x, g.reshape(att, &[1, hidden]).unwrap()).unwrap();
            g.set_outputs(vec![out, q]);
            // Weights exact in bf16 and scaled so the sums stay near 1.
            let params: Vec<(String, Vec<f32>)> = g
                .params()
                .into_iter()
                .map(|(name, _, shape)| {
                    let scale = if name.starts_with('w') { 16.0 } else { 1.0 };
                    let data = (0..shape.num_elements())
                        .map(|_| (rng.value() * 128.0).round() / 128.0 / scale)
                        .collect();
                    (name, data)
                })
                .collect();
            let tensor = |shape: &Shape, data: &[f32]| {
                let wide: Vec<f64> = data.iter().map(|&v| f64::from(v)).collect();
                HostTensor::from_data(shape.dims(), &TensorData::from_f64(shape.dtype(), &wide))
                    .unwrap()
            };
            let shape_of = |name: &str| {
                g.inputs()
                    .into_iter()
                    .chain(g.params())
                    .find(|i| i.0 == name)
                    .unwrap()
                    .2
            };
            let mut values: HashMap<String, HostTensor> = params
                .iter()
                .map(|(n, d)| (n.clone(), tensor(&shape_of(n), d)))
                .collect();
            let start: Vec<f32> = (0..cache.num_elements()).map(|_| rng.value()).collect();
            for name in ["k_cache", "v_cache"] {
                values.insert(name.into(), tensor(&cache, &start));
            }
            let handles = [
                BufferHandle::new("k_cache", cache.dims(), DType::F32),
                BufferHandle::new("v_cache", cache.dims(), DType::F32),
            ];
            let mut runs = Vec::new();
            for device in common::test_devices() {
                let options = CompileOptions::new()
                    .bind_handle(&handles[0])
                    .bind_handle(&handles[1]);
                let mut c = Session::new(device).compile_with(&g, &options).unwrap();
                for (name, data) in &params {
                    c.set_param(name, data).unwrap();
                }
                for name in ["k_cache", "v_cache"] {
                    c.write_handle(name, &start).unwrap();
                }
                if device != Device::Cpu {
                    let rotations = c
                        .kernels()
                        .iter()
                        .filter(|(_, k)| k.contains("rope"))
                        .count();
                    assert_eq!(rotations, 0, "{label} on {device}: {:?}", c.kernels());
                }
                runs.push((device, c));
            }
            let step = |rng: &mut Rng, p: i64| -> Vec<(String, TensorData)> {
                let mut feeds: Vec<(String, TensorData)> = ["x", "cos", "sin"]
                    .iter()
                    .map(|&n| {
                        let count = shape_of(n).num_elements();
                        (
                            n.to_string(),
                            TensorData::F32((0..count).map(|_| rng.value()).collect()),
                        )
                    })
                    .collect();
                feeds.push(("pos".into(), TensorData::I64(vec![p])));
                feeds
            };
            let caches_match =
                |c: &CompiledGraph, values: &HashMap<String, HostTensor>, what: &str| {
                    for name in ["k_cache", "v_cache"] {
                        let got = c.read_handle(name).unwrap();
                        let want = &values[name].data;
                        let worst = got
                            .iter()
                            .zip(want)
                            .map(|(a, b)| (f64::from(*a) - b).abs())
                            .fold(0.0, f64::max);
                        assert!(worst < 1e-5, "{label} {what}: {name} off by {worst}");
                    }
                };
            // Then a position past the cache (an error, neither cache written), then
            // a step that runs as before.
            let bad = max_seq as i64;
            for p in [0i64, 3, 7, 4, bad, 5] {
                let feeds = step(&mut rng, p);
                let refs: Vec<(&str, TensorRef)> = feeds
                    .iter()
                    .map(|(n, d)| (n.as_str(), d.as_ref()))
                    .collect();
                if p == bad {
                    for (device, c) in runs.iter_mut() {
                        let err = c.run_typed(&refs);
                        assert!(
                            matches!(err, Err(Error::Runtime { .. })),
                            "{label} on {device}: position {p} gave {err:?}"
                        );
                        caches_match(c, &values, &format!("{label} on {device} after pos {p}"));
                    }
                    continue;
                }
                for (name, data) in &feeds {
                    values.insert(
                        name.clone(),
                        HostTensor::from_data(shape_of(name).dims(), data).unwrap(),
                    );
                }
                let want = evaluate(&g, &mut values).unwrap();
                for (device, c) in runs.iter_mut() {
                    let got: Vec<Vec<f32>> =
                        c.run_typed(&refs).unwrap().iter().map(as_f32).collect();
                    let what = format!("{label} on {device}, pos {p}");
                    assert_close(&want, &got, 5e-5, &what);
                    caches_match(c, &values, &what);
                }
            }
        }
    }
}

#[test]
fn a_region_built_by_hand_is_checked() {
    use rlx::ir::{BinaryOp, EwStep, Op};
    let g = Graph::new("hand-made region");
    let inputs: Vec<NodeId> = (0..17)
        .map(|i| {
            g.input(format!("x{i}"), Shape::new(&[4], DType::F32))
                .unwrap()
        })
        .collect();
    let add = |a: u16, b: u16| EwStep::Binary(BinaryOp::Add, a, b);
    // Too many inputs.
    let err = g
        .push(
            Op::Elementwise {
                steps: vec![add(0, 1)],
            },
            &inputs,
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("at most 16 inputs"), "{err}");
    // A register read before it is defined.
    let err = g
        .push(
            Op::Elementwise {
                steps: vec![add(0, 5)],
            },
            &inputs[..2],
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("not yet defined"), "{err}");
    // A comparison cannot be in a region.
    let err = g
        .push(
            Op::Elementwise {
                steps: vec![EwStep::Binary(BinaryOp::Lt, 0, 1)],
            },
            &inputs[..2],
        )
        .unwrap_err()
        .to_string();
    assert!(err.contains("cannot be fused"), "{err}");
    // A valid hand-made region runs and matches its definition.
    let g = Graph::new("hand-made region");
    let x0 = g.input("x0", Shape::new(&[4], DType::F32)).unwrap();
    let x1 = g.input("x1", Shape::new(&[4], DType::F32)).unwrap();
    let y = g
        .push(
            Op::Elementwise {
                steps: vec![add(0, 1), add(2, 2)],
            },
            &[x0, x1],
        )
        .unwrap();
    g.set_outputs(vec![y]);
    let mut c = Session::new(Device::Cpu).compile(&g).unwrap();
    let out = c
        .run(&[("x0", &[1.0, 2.0, 3.0, 4.0]), ("x1", &[0.5; 4])])
        .unwrap();
    assert_eq!(out[0], vec![3.0, 5.0, 7.0, 9.0]);
}

#[test]
fn attention_as_exporters_spell_it_becomes_one_attention() {
    // Scales on both operands, the key transposed through a rank-3 view, and a guard
    // that zeroes NaN probabilities: the spelling of a BERT exported to ONNX.
    let mut rng = Rng(58);
    for (b, h, s, d, fully_masked) in [(1, 3, 20, 8, false), (1, 2, 33, 16, true)] {
        let g = Graph::new("exported attention");
        let q = g.input("q", Shape::new(&[b, h, s, d], DType::F32)).unwrap();
        let k = g.input("k", Shape::new(&[b, h, s, d], DType::F32)).unwrap();
        let v = g.input("v", Shape::new(&[b, h, s, d], DType::F32)).unwrap();
        // Every third key hidden; with `fully_masked`, every key.
        let keep_values: Vec<f32> = (0..b * s)
            .map(|i| if fully_masked || i % 3 == 0 { 0.0 } else { 1.0 })
            .collect();
        let keep = g
            .constant(TensorData::F32(keep_values), &[b, 1, 1, s])
            .unwrap();
        let kt = g
            .reshape(
                g.permute(g.reshape(k, &[b * h, s, d]).unwrap(), &[0, 2, 1])
                    .unwrap(),
                &[b, h, d, s],
            )
            .unwrap();
        let c = g.scalar(1.0 / (d as f64).sqrt().sqrt(), DType::F32);
        let scores = g
            .matmul(g.mul(q, c).unwrap(), g.mul(kt, c).unwrap())
            .unwrap();
        // keep > 0.5 -> 0, else a large negative (or -inf: every key hidden).
        let hide = if fully_masked {
            f64::NEG_INFINITY
        } else {
            -1e4
        };
        let visible = g.gt(keep, g.scalar(0.5, DType::F32)).unwrap();
        let mask = g
            .select(
                visible,
                g.scalar(0.0, DType::F32),
                g.scalar(hide, DType::F32),
            )
            .unwrap();
        let p = g.softmax(g.add(scores, mask).unwrap(), -1).unwrap();
        let guarded = g
            .select(
                g.binary(BinaryOp::Ne, p, p).unwrap(),
                g.scalar(0.0, DType::F32),
                p,
            )
            .unwrap();
        g.set_outputs(vec![g.matmul(guarded, v).unwrap()]);
        let plan = plan_graph(&g, &all_passes()).unwrap();
        let ops: Vec<String> = plan.graph.nodes().iter().map(|n| n.op.name()).collect();
        assert!(
            ops.contains(&"attention".to_string()) && !ops.contains(&"softmax".to_string()),
            "{}",
            plan.graph
        );
        check(&g, &mut rng, &format!("exported attention s={s} d={d}"));
    }
}

#[test]
fn attention_with_a_sequence_major_key_transpose_becomes_one_attention() {
    // Whisper's export: heads split from `[B, S, H * D]`, the key transposed in one
    // `permute(k, [0, 2, 3, 1])`, scales on both operands, and a reshape to the same
    // shape before the heads are merged again.
    let mut rng = Rng(67);
    let (b, s, h, d) = (1, 37, 3, 16);
    let g = Graph::new("whisper attention");
    let x = g
        .input("x", Shape::new(&[b, s, h * d], DType::F32))
        .unwrap();
    let heads = |name: &str| {
        let w = g
            .param(name, Shape::new(&[h * d, h * d], DType::F32))
            .unwrap();
        g.reshape(g.matmul(x, w).unwrap(), &[b, s, h, d]).unwrap()
    };
    let (q, k, v) = (heads("wq"), heads("wk"), heads("wv"));
    let q = g.permute(q, &[0, 2, 1, 3]).unwrap();
    let kt = g.permute(k, &[0, 2, 3, 1]).unwrap();
    let v = g.permute(v, &[0, 2, 1, 3]).unwrap();
    let c = g.scalar(1.0 / (d as f64).sqrt().sqrt(), DType::F32);
    let scores = g
        .matmul(g.mul(q, c).unwrap(), g.mul(kt, c).unwrap())
        .unwrap();
    let att = g.matmul(g.softmax(scores, -1).unwrap(), v).unwrap();
    let same = g.reshape(att, &[b, h, s, d]).unwrap();
    let merged = g
        .reshape(g.permute(same, &[0, 2, 1, 3]).unwrap(), &[b, s, h * d])
        .unwrap();
    g.set_outputs(vec![merged]);
    let plan = plan_graph(&g, &all_passes()).unwrap();
    let ops: Vec<String> = plan.graph.nodes().iter().map(|n| n.op.name()).collect();
    assert!(
        ops.iter().any(|o| o.starts_with("attention"))
            && !ops.iter().any(|o| o == "softmax" || o == "permute"),
        "{}",
        plan.graph
    );
    check(&g, &mut rng, "whisper attention");
}

#[test]
fn attention_with_heads_split_into_rank_3_values_becomes_one_attention() {
    // ViT's dynamo export: each of q, k, v is `[S, H * D]` reshaped to `[S, H, D]`
    // and permuted to `[H, S, D]`; q and v get a batch axis back by a reshape, the
    // key is transposed as `[H, D, S]` before its reshape, and both operands are
    // scaled by one constant.
    let mut rng = Rng(71);
    for (s, h, d) in [(37, 3, 16), (20, 2, 8)] {
        let g = Graph::new("vit attention");
        let x = g.input("x", Shape::new(&[s, h * d], DType::F32)).unwrap();
        let heads = |name: &str| {
            let w = g
                .param(name, Shape::new(&[h * d, h * d], DType::F32))
                .unwrap();
            let split = g.reshape(g.matmul(x, w).unwrap(), &[s, h, d]).unwrap();
            g.permute(split, &[1, 0, 2]).unwrap()
        };
        let (q, k, v) = (heads("wq"), heads("wk"), heads("wv"));
        let q = g.reshape(q, &[1, h, s, d]).unwrap();
        let v = g.reshape(v, &[1, h, s, d]).unwrap();
        let kt = g
            .reshape(g.permute(k, &[0, 2, 1]).unwrap(), &[1, h, d, s])
            .unwrap();
        let c = g.scalar(1.0 / (d as f64).sqrt().sqrt(), DType::F32);
        let scores = g
            .matmul(g.mul(q, c).unwrap(), g.mul(kt, c).unwrap())
            .unwrap();
        let att = g.matmul(g.softmax(scores, -1).unwrap(), v).unwrap();
        let merged = g
            .reshape(g.permute(att, &[2, 0, 1, 3]).unwrap(), &[s, h * d])
            .unwrap();
        g.set_outputs(vec![merged]);
        let plan = plan_graph(&g, &all_passes()).unwrap();
        let ops: Vec<String> = plan.graph.nodes().iter().map(|n| n.op.name()).collect();
        assert!(
            ops.iter().any(|o| o.starts_with("attention")) && !ops.iter().any(|o| o == "softmax"),
            "{}",
            plan.graph
        );
        check(&g, &mut rng, &format!("vit attention s={s} h={h} d={d}"));
    }
}

#[test]
fn products_of_gathered_rows_by_one_weight_become_one_product() {
    // An unrolled recurrence: each step multiplies its row of the sequence by the same
    // weight and feeds the previous step's result in.
    let mut rng = Rng(59);
    let (steps, features, width) = (6, 40, 24);
    let g = Graph::new("unrolled");
    let x = g
        .input("x", Shape::new(&[steps, 2, features], DType::F32))
        .unwrap();
    let w = g
        .param("w", Shape::new(&[features, width], DType::F32))
        .unwrap();
    let r = g
        .param("r", Shape::new(&[width, width], DType::F32))
        .unwrap();
    let mut h: Option<NodeId> = None;
    for t in 0..steps {
        let idx = g.constant(TensorData::I64(vec![t as i64]), &[]).unwrap();
        let row = g.gather(x, idx, 0).unwrap();
        let mut y = g.matmul(row, w).unwrap();
        if let Some(prev) = h {
            y = g.add(y, g.matmul(prev, r).unwrap()).unwrap();
        }
        h = Some(g.tanh(y).unwrap());
    }
    g.set_outputs(vec![h.unwrap()]);
    let plan = plan_graph(&g, &all_passes()).unwrap();
    let products = plan
        .graph
        .nodes()
        .iter()
        .filter(|n| n.op.name().contains("matmul") && n.shape.dims()[0] == steps)
        .count();
    assert_eq!(products, 1, "{}", plan.graph);
    check(&g, &mut rng, "hoisted gathered products");
    // Too few rows taken (one step of six): left alone.
    let g = Graph::new("one row");
    let x = g
        .input("x", Shape::new(&[steps, features], DType::F32))
        .unwrap();
    let w = g
        .param("w", Shape::new(&[features, width], DType::F32))
        .unwrap();
    let idx = g.constant(TensorData::I64(vec![2]), &[1]).unwrap();
    g.set_outputs(vec![g.matmul(g.gather(x, idx, 0).unwrap(), w).unwrap()]);
    let plan = plan_graph(&g, &all_passes()).unwrap();
    let nodes = plan.graph.nodes();
    assert!(
        nodes
            .iter()
            .any(|n| n.op.name() == "gather" && nodes[n.inputs[0].index()].op.name() == "input"),
        "{}",
        plan.graph
    );
    check(&g, &mut rng, "one gathered row");
}

#[test]
fn a_product_of_a_reversed_sequence_becomes_a_reversed_product() {
    // A backward recurrence as exported: the whole sequence flipped along time, then
    // each step's row gathered and multiplied by one weight (hoisted into one product
    // of the flipped sequence, which then becomes a flip of the narrower product).
    let mut rng = Rng(61);
    let (steps, features, width) = (5, 48, 20);
    let g = Graph::new("reversed");
    let x = g
        .input("x", Shape::new(&[steps, 3, features], DType::F32))
        .unwrap();
    let w = g
        .param("w", Shape::new(&[features, width], DType::F32))
        .unwrap();
    let flipped = g.slice(x, 0, -1, -(steps as isize) - 1, -1).unwrap();
    let mut outs = Vec::new();
    for t in 0..steps {
        let idx = g.constant(TensorData::I64(vec![t as i64]), &[]).unwrap();
        outs.push(
            g.tanh(g.matmul(g.gather(flipped, idx, 0).unwrap(), w).unwrap())
                .unwrap(),
        );
    }
    g.set_outputs(outs);
    let plan = plan_graph(&g, &all_passes()).unwrap();
    let nodes = plan.graph.nodes();
    let wide_slices = nodes
        .iter()
        .filter(|n| n.op.name() == "slice" && n.shape.dims().last() == Some(&features))
        .count();
    let product_reads_input = nodes
        .iter()
        .any(|n| n.op.name().contains("matmul") && nodes[n.inputs[0].index()].op.name() == "input");
    assert!(wide_slices == 0 && product_reads_input, "{}", plan.graph);
    check(&g, &mut rng, "reversed sequence product");
    // Part of the sequence taken (the product would do more work), or a weight wider
    // than it is deep (the slice would copy more): left alone.
    for (rows, cols) in [(steps - 2, width), (steps, features * 2)] {
        let g = Graph::new("left alone");
        let x = g
            .input("x", Shape::new(&[steps, 3, features], DType::F32))
            .unwrap();
        let w = g
            .param("w", Shape::new(&[features, cols], DType::F32))
            .unwrap();
        let part = g
            .slice(x, 0, rows as isize - 1, -(steps as isize) - 1, -1)
            .unwrap();
        g.set_outputs(vec![g.matmul(part, w).unwrap()]);
        let plan = plan_graph(&g, &all_passes()).unwrap();
        let nodes = plan.graph.nodes();
        assert!(
            nodes
                .iter()
                .any(|n| n.op.name() == "slice" && nodes[n.inputs[0].index()].op.name() == "input"),
            "{}",
            plan.graph
        );
        check(
            &g,
            &mut rng,
            &format!("sliced product rows={rows} cols={cols}"),
        );
    }
}

#[test]
fn the_graph_after_each_named_stage() {
    let g = Graph::new("stages");
    let x = g.input("x", Shape::new(&[4, 8], DType::F32)).unwrap();
    let w = g.param("w", Shape::new(&[8, 3], DType::F32)).unwrap();
    let b = g.param("b", Shape::new(&[3], DType::F32)).unwrap();
    let y = g.relu(g.add(g.matmul(x, w).unwrap(), b).unwrap()).unwrap();
    g.set_outputs(vec![y]);
    let options = all_passes();
    let names = |g: &Graph| -> Vec<String> { g.nodes().iter().map(|n| n.op.name()).collect() };
    use rlx::opt::Stage;
    let before = rlx::opt::graph_after(&g, &options, Stage::Dce).unwrap();
    assert!(names(&before).contains(&"matmul".to_string()));
    let fused = rlx::opt::graph_after(&g, &options, Stage::FuseEpilogue).unwrap();
    assert!(
        names(&fused).contains(&"fused_matmul".to_string())
            && !names(&fused).contains(&"relu".to_string()),
        "{fused}"
    );
    // The last stage's graph is the planned one.
    let last = Stage::ALL[Stage::ALL.len() - 1];
    let plan = plan_graph(&g, &options).unwrap();
    assert_eq!(
        names(&rlx::opt::graph_after(&g, &options, last).unwrap()),
        names(&plan.graph)
    );
    for stage in Stage::ALL {
        assert_eq!(stage.name().parse::<Stage>().unwrap(), stage);
    }
    let e = "fuse.everything".parse::<Stage>().unwrap_err();
    assert!(e.to_string().contains("fuse.everything") && e.to_string().contains("fuse.regions"));
}

/// Runs `g` on the CPU compiled as a primitives-only backend would compile it, after
/// checking that no composite is left in the plan.
fn run_primitives(g: &Graph, feeds: &[(String, Vec<f32>)]) -> Vec<Vec<f32>> {
    let c = Session::new(Device::Cpu)
        .compile_with(g, &CompileOptions::new().primitives_only(true))
        .unwrap();
    if let Some(n) = c
        .plan()
        .graph
        .nodes()
        .iter()
        .find(|n| rlx::ir::decompose::is_composite(&n.op))
    {
        panic!("{} left in {}", n.op.name(), c.plan().graph);
    }
    run_compiled(c, g, feeds)
}

fn check_decomposed(g: &Graph, rng: &mut Rng, what: &str) {
    let feeds = feeds(g, rng);
    let want = reference(g, &feeds);
    let got = run_primitives(g, &feeds);
    for (o, (w, r)) in want.iter().zip(&got).enumerate() {
        assert_eq!(w.data.len(), r.len(), "{what}: output {o}");
        for (i, (a, &b)) in w.data.iter().zip(r).enumerate() {
            assert!(
                (a - f64::from(b)).abs() <= 2e-5 * (1.0 + a.abs()),
                "{what}: output {o}[{i}]: {b} vs {a}"
            );
        }
    }
}

#[test]
fn composites_decompose_into_primitives_that_match() {
    use rlx::ir::RopeStyle;
    let mut rng = Rng(61);
    let f32s = |g: &Graph, name: &str, dims: &[usize]| {
        g.input(name, Shape::new(dims, DType::F32)).unwrap()
    };
    // Softmax and log-softmax over inner and outer axes.
    for (axis, log) in [(-1, false), (1, false), (-1, true), (0, true)] {
        let g = Graph::new("softmax");
        let x = f32s(&g, "x", &[3, 5, 7]);
        let y = if log {
            g.log_softmax(x, axis).unwrap()
        } else {
            g.softmax(x, axis).unwrap()
        };
        g.set_outputs(vec![y]);
        check_decomposed(&g, &mut rng, &format!("softmax axis {axis} log {log}"));
    }
    // Norms with params.
    let g = Graph::new("norms");
    let x = f32s(&g, "x", &[4, 6, 16]);
    let gamma = g.param("gamma", Shape::new(&[16], DType::F32)).unwrap();
    let beta = g.param("beta", Shape::new(&[16], DType::F32)).unwrap();
    g.set_outputs(vec![
        g.layer_norm(x, gamma, beta, 1e-5).unwrap(),
        g.rms_norm(x, gamma, 1e-6).unwrap(),
    ]);
    check_decomposed(&g, &mut rng, "norms");
    // The norms' gradients.
    let g = Graph::new("norm gradients");
    let x = f32s(&g, "x", &[4, 6, 16]);
    let dy = f32s(&g, "dy", &[4, 6, 16]);
    let gamma = f32s(&g, "gamma", &[16]);
    g.set_outputs(vec![
        g.norm_grad(x, gamma, dy, 1e-5, true).unwrap(),
        g.norm_grad(x, gamma, dy, 1e-6, false).unwrap(),
        g.norm_scale_grad(x, dy, 1e-5, true).unwrap(),
        g.norm_scale_grad(x, dy, 1e-6, false).unwrap(),
    ]);
    check_decomposed(&g, &mut rng, "norm gradients");
    // A tiling max pool's gradient.
    let g = Graph::new("max pool gradient");
    let x = f32s(&g, "x", &[2, 3, 6, 4]);
    let dy = f32s(&g, "dy", &[2, 3, 2, 2]);
    let y = g.max_pool2d(x, [3, 2], [3, 2], [0; 4]).unwrap();
    g.set_outputs(vec![g.tiled_max_pool_grad(x, y, dy, [3, 2]).unwrap()]);
    check_decomposed(&g, &mut rng, "tiled max pool gradient");
    // Activations.
    let g = Graph::new("activations");
    let x = f32s(&g, "x", &[33]);
    g.set_outputs(
        [UnaryOp::Gelu, UnaryOp::GeluTanh, UnaryOp::Silu]
            .into_iter()
            .map(|u| g.unary(u, x).unwrap())
            .collect(),
    );
    check_decomposed(&g, &mut rng, "activations");
    // Attention: grouped heads, float and bool masks, causal, both layouts.
    for (seq_major, causal, bool_mask) in [
        (false, false, false),
        (false, true, true),
        (true, true, false),
        (true, false, true),
    ] {
        let g = Graph::new("attention");
        let (b, hq, hkv, sq, sk, d) = (2, 4, 2, 5, 7, 8);
        let qd = if seq_major {
            [b, sq, hq, d]
        } else {
            [b, hq, sq, d]
        };
        let kd = if seq_major {
            [b, sk, hkv, d]
        } else {
            [b, hkv, sk, d]
        };
        let q = f32s(&g, "q", &qd);
        let k = f32s(&g, "k", &kd);
        let v = f32s(&g, "v", &kd);
        let m = f32s(&g, "m", &[b, 1, sq, sk]);
        let mask = if bool_mask {
            g.gt(m, g.scalar(-0.5, DType::F32)).unwrap()
        } else {
            m
        };
        let y = if seq_major {
            g.attention_seq_major(q, k, v, Some(mask), causal, None)
        } else {
            g.attention(q, k, v, Some(mask), causal, None)
        }
        .unwrap();
        g.set_outputs(vec![y]);
        check_decomposed(
            &g,
            &mut rng,
            &format!("attention seq_major {seq_major} causal {causal} bool {bool_mask}"),
        );
    }
    // Rotary embeddings, both pairings.
    for style in [RopeStyle::HalfSplit, RopeStyle::Interleaved] {
        let g = Graph::new("rope");
        let x = f32s(&g, "x", &[2, 6, 3, 8]);
        let cos = f32s(&g, "cos", &[6, 1, 4]);
        let sin = f32s(&g, "sin", &[6, 1, 4]);
        g.set_outputs(vec![g.rope(x, cos, sin, style).unwrap()]);
        check_decomposed(&g, &mut rng, &format!("rope {style:?}"));
    }
    // The fused forms the CPU builds (matmul epilogues, elementwise regions) written
    // back in primitives mean the same.
    let g = Graph::new("fused");
    let x = f32s(&g, "x", &[5, 12]);
    let w = g.param("w", Shape::new(&[12, 9], DType::F32)).unwrap();
    let bias = g.param("b", Shape::new(&[9], DType::F32)).unwrap();
    let r = f32s(&g, "r", &[5, 9]);
    let h = g
        .gelu(g.add(g.matmul(x, w).unwrap(), bias).unwrap())
        .unwrap();
    let y = g.add(h, r).unwrap();
    let z = g.mul(g.exp(y).unwrap(), g.scalar(0.5, DType::F32)).unwrap();
    let xc = f32s(&g, "xc", &[2, 3, 6, 7]);
    let wc = g
        .param("wc", Shape::new(&[4, 3, 3, 3], DType::F32))
        .unwrap();
    let bc = g.param("bc", Shape::new(&[4], DType::F32)).unwrap();
    let rc = f32s(&g, "rc", &[2, 4, 6, 7]);
    let conv = g
        .conv2d(xc, wc, Some(bc), [1, 1], [1, 1, 1, 1], [1, 1], 1)
        .unwrap();
    let conv = g.add(g.relu(conv).unwrap(), rc).unwrap();
    // A batch norm and relu after the residual add fold in too.
    let scale = g
        .param("sc", Shape::new(&[1, 4, 1, 1], DType::F32))
        .unwrap();
    let shift = g
        .param("sh", Shape::new(&[1, 4, 1, 1], DType::F32))
        .unwrap();
    let conv = g.add(g.mul(conv, scale).unwrap(), shift).unwrap();
    let conv = g.relu(conv).unwrap();
    // And one before a 1x1 convolution, as its input prologue.
    let sc2 = g
        .param("sc2", Shape::new(&[1, 4, 1, 1], DType::F32))
        .unwrap();
    let sh2 = g
        .param("sh2", Shape::new(&[1, 4, 1, 1], DType::F32))
        .unwrap();
    let w1 = g
        .param("w1", Shape::new(&[5, 4, 1, 1], DType::F32))
        .unwrap();
    let pre = g
        .relu(g.add(g.mul(rc, sc2).unwrap(), sh2).unwrap())
        .unwrap();
    let pointwise = g.conv2d(pre, w1, None, [1, 1], [0; 4], [1, 1], 1).unwrap();
    g.set_outputs(vec![g.sub(z, y).unwrap(), conv, pointwise]);
    let fused = plan_graph(&g, &all_passes()).unwrap().graph;
    assert!(fused.nodes().iter().any(|n| n.op.name() == "fused_matmul"));
    assert!(fused.nodes().iter().any(|n| matches!(
        n.op,
        rlx::ir::Op::FusedConv2d {
            fusion: rlx::ir::ConvFusion {
                channel_affine: true,
                post_activation: Some(UnaryOp::Relu),
                ..
            },
            ..
        }
    )));
    assert!(fused.nodes().iter().any(|n| matches!(
        n.op,
        rlx::ir::Op::FusedConv2d {
            fusion: rlx::ir::ConvFusion {
                input_affine: true,
                input_activation: Some(UnaryOp::Relu),
                ..
            },
            ..
        }
    )));
    assert!(fused.nodes().iter().any(|n| n.op.name() == "elementwise"));
    let back =
        rlx::ir::decompose::decompose_graph(&fused, &|op| !rlx::ir::decompose::is_composite(op))
            .unwrap();
    assert!(
        back.nodes()
            .iter()
            .all(|n| !rlx::ir::decompose::is_composite(&n.op)),
        "{back}"
    );
    let feeds = feeds(&g, &mut rng);
    let want = reference(&g, &feeds);
    let got = reference(&back, &feeds);
    // Both are f32 graphs; the fused matmul rounds to f32 once after its epilogue, the
    // decomposition after each step, so they differ by a few f32 roundings.
    for (want, got) in want.iter().zip(&got) {
        for (a, b) in want.data.iter().zip(&got.data) {
            assert!((a - b).abs() <= 1e-6 * (1.0 + a.abs()), "{a} vs {b}");
        }
    }
}

#[test]
fn a_primitive_the_backend_lacks_is_a_compile_error_naming_it() {
    let g = Graph::new("needs matmul");
    let x = g.input("x", Shape::new(&[2, 3], DType::F32)).unwrap();
    let w = g.param("w", Shape::new(&[3, 4], DType::F32)).unwrap();
    g.set_outputs(vec![g.softmax(g.matmul(x, w).unwrap(), -1).unwrap()]);
    // A backend with the ops a softmax decomposes into, but no matmul.
    let names = [
        "reduce_max",
        "eq",
        "where",
        "sub",
        "exp",
        "reduce_sum",
        "div",
    ];
    let native = rlx::ir::decompose::NativeOps::Only(names.iter().map(|s| s.to_string()).collect());
    let options = PlanOptions {
        native,
        ..PlanOptions::default()
    };
    let e = plan_graph(&g, &options).unwrap_err();
    assert!(e.to_string().contains("matmul"), "{e}");
}

#[test]
fn gelu_spelled_with_erf_becomes_one_activation() {
    let mut rng = Rng(62);
    for form in 0..3 {
        let g = Graph::new("spelled gelu");
        let a = g.input("a", Shape::new(&[6, 10], DType::F32)).unwrap();
        let w = g.param("w", Shape::new(&[10, 12], DType::F32)).unwrap();
        let x = g.matmul(a, w).unwrap();
        let c = |v: f64| g.scalar(v, DType::F32);
        let t = match form {
            0 => g.div(x, c(std::f64::consts::SQRT_2)),
            _ => g.mul(c(std::f64::consts::FRAC_1_SQRT_2), x),
        }
        .unwrap();
        let plus = g.add(g.erf(t).unwrap(), c(1.0)).unwrap();
        let y = match form {
            0 => g.mul(x, g.mul(c(0.5), plus).unwrap()),
            1 => g.mul(g.mul(x, c(0.5)).unwrap(), plus),
            _ => g.mul(plus, g.mul(c(0.5), x).unwrap()),
        }
        .unwrap();
        g.set_outputs(vec![y]);
        let plan = plan_graph(&g, &all_passes()).unwrap();
        let ops: Vec<String> = plan.graph.nodes().iter().map(|n| n.op.name()).collect();
        assert!(
            ops.contains(&"fused_matmul".to_string())
                && !ops
                    .iter()
                    .any(|o| o == "erf" || o == "elementwise" || o == "mul"),
            "form {form}: {}",
            plan.graph
        );
        check(&g, &mut rng, &format!("spelled gelu form {form}"));
    }
    // A product that only looks alike (0.4 instead of 0.5) is left alone.
    let g = Graph::new("not gelu");
    let x = g.input("x", Shape::new(&[7], DType::F32)).unwrap();
    let c = |v: f64| g.scalar(v, DType::F32);
    let t = g.div(x, c(std::f64::consts::SQRT_2)).unwrap();
    let plus = g.add(g.erf(t).unwrap(), c(1.0)).unwrap();
    g.set_outputs(vec![g.mul(x, g.mul(c(0.4), plus).unwrap()).unwrap()]);
    let plan = plan_graph(&g, &all_passes()).unwrap();
    assert!(!plan.graph.nodes().iter().any(|n| n.op.name() == "gelu"));
    check(&g, &mut rng, "not gelu");
}

#[test]
fn gelu_spelled_with_tanh_becomes_one_activation() {
    let mut rng = Rng(64);
    for form in 0..3 {
        let g = Graph::new("spelled tanh gelu");
        let a = g.input("a", Shape::new(&[6, 10], DType::F32)).unwrap();
        let w = g.param("w", Shape::new(&[10, 12], DType::F32)).unwrap();
        let x = g.matmul(a, w).unwrap();
        let c = |v: f64| g.scalar(v, DType::F32);
        // GPT-2's `gelu_new` cubes with `pow`; PyTorch's tanh GELU as products.
        let cube = match form {
            0 => g.pow(x, c(3.0)).unwrap(),
            1 => g.mul(g.mul(x, x).unwrap(), x).unwrap(),
            _ => g.mul(x, g.mul(x, x).unwrap()).unwrap(),
        };
        let inner = match form {
            0 => g.add(x, g.mul(cube, c(0.044715)).unwrap()),
            _ => g.add(g.mul(c(0.044715), cube).unwrap(), x),
        }
        .unwrap();
        let t = g
            .mul(c((2.0 / std::f64::consts::PI).sqrt()), inner)
            .unwrap();
        let plus = match form {
            0 => g.add(g.tanh(t).unwrap(), c(1.0)),
            _ => g.add(c(1.0), g.tanh(t).unwrap()),
        }
        .unwrap();
        let y = match form {
            0 => g.mul(g.mul(x, c(0.5)).unwrap(), plus),
            1 => g.mul(x, g.mul(c(0.5), plus).unwrap()),
            _ => g.mul(plus, g.mul(c(0.5), x).unwrap()),
        }
        .unwrap();
        g.set_outputs(vec![y]);
        let plan = plan_graph(&g, &all_passes()).unwrap();
        let ops: Vec<String> = plan.graph.nodes().iter().map(|n| n.op.name()).collect();
        assert!(
            ops.contains(&"fused_matmul".to_string())
                && !ops
                    .iter()
                    .any(|o| ["tanh", "pow", "elementwise", "mul"].contains(&o.as_str())),
            "form {form}: {}",
            plan.graph
        );
        check(&g, &mut rng, &format!("spelled tanh gelu form {form}"));
    }
    // Another coefficient on the cube, or a cube read again, is left alone.
    for variant in 0..2 {
        let g = Graph::new("not tanh gelu");
        let x = g.input("x", Shape::new(&[9], DType::F32)).unwrap();
        let c = |v: f64| g.scalar(v, DType::F32);
        let cube = g.pow(x, c(3.0)).unwrap();
        let k = if variant == 0 { 0.05 } else { 0.044715 };
        let inner = g.add(x, g.mul(cube, c(k)).unwrap()).unwrap();
        let t = g
            .mul(inner, c((2.0 / std::f64::consts::PI).sqrt()))
            .unwrap();
        let plus = g.add(g.tanh(t).unwrap(), c(1.0)).unwrap();
        let y = g.mul(g.mul(x, c(0.5)).unwrap(), plus).unwrap();
        let outputs = if variant == 0 { vec![y] } else { vec![y, cube] };
        g.set_outputs(outputs);
        let plan = plan_graph(&g, &all_passes()).unwrap();
        assert!(
            !plan
                .graph
                .nodes()
                .iter()
                .any(|n| n.op.name() == "gelu_tanh"),
            "variant {variant}: {}",
            plan.graph
        );
        check(&g, &mut rng, &format!("not tanh gelu, variant {variant}"));
    }
}

#[test]
fn an_activation_after_a_reshape_joins_the_product() {
    // A 2-D `Gemm` reshaped back to `[batch, tokens, features]` before its GELU, as
    // exporters write GPT-2's MLP.
    let mut rng = Rng(66);
    let g = Graph::new("gemm, reshape, gelu");
    let a = g.input("a", Shape::new(&[6, 10], DType::F32)).unwrap();
    let w = g.param("w", Shape::new(&[10, 12], DType::F32)).unwrap();
    let b = g.param("b", Shape::new(&[12], DType::F32)).unwrap();
    let y = g.add(g.matmul(a, w).unwrap(), b).unwrap();
    let r = g.reshape(y, &[2, 3, 12]).unwrap();
    g.set_outputs(vec![g.gelu_tanh(r).unwrap()]);
    let plan = plan_graph(&g, &all_passes()).unwrap();
    let ops: Vec<String> = plan.graph.nodes().iter().map(|n| n.op.name()).collect();
    assert!(
        ops.contains(&"fused_matmul".to_string())
            && ops.contains(&"reshape".to_string())
            && !ops.iter().any(|o| o == "gelu_tanh" || o == "elementwise"),
        "{}",
        plan.graph
    );
    check(&g, &mut rng, "gemm, reshape, gelu");
    // A reshape read by something else as well stays before the activation.
    let g = Graph::new("shared reshape");
    let a = g.input("a", Shape::new(&[6, 10], DType::F32)).unwrap();
    let w = g.param("w", Shape::new(&[10, 12], DType::F32)).unwrap();
    let r = g.reshape(g.matmul(a, w).unwrap(), &[2, 3, 12]).unwrap();
    g.set_outputs(vec![g.relu(r).unwrap(), r]);
    let plan = plan_graph(&g, &all_passes()).unwrap();
    assert!(
        plan.graph.nodes().iter().any(|n| n.op.name() == "relu"),
        "{}",
        plan.graph
    );
    check(&g, &mut rng, "shared reshape");
}

#[test]
fn rms_norm_spelled_out_becomes_one_op() {
    // T5's and Llama exports' spellings: the square as a power or a product, the
    // inverse root as rsqrt, reciprocal of sqrt, 1 / sqrt or a division by sqrt.
    let mut rng = Rng(68);
    for form in 0..4 {
        let g = Graph::new("spelled rms norm");
        let x = g.input("x", Shape::new(&[2, 5, 24], DType::F32)).unwrap();
        let w = g.param("w", Shape::new(&[24], DType::F32)).unwrap();
        let c = |v: f64| g.scalar(v, DType::F32);
        let sq = if form % 2 == 0 {
            g.pow(x, c(2.0)).unwrap()
        } else {
            g.mul(x, x).unwrap()
        };
        let s = g.add(g.mean(sq, &[-1], true).unwrap(), c(1e-6)).unwrap();
        let normed = match form {
            0 => g.mul(x, g.rsqrt(s).unwrap()),
            1 => g.mul(g.reciprocal(g.sqrt(s).unwrap()).unwrap(), x),
            2 => g.mul(x, g.div(c(1.0), g.sqrt(s).unwrap()).unwrap()),
            _ => g.div(x, g.sqrt(s).unwrap()),
        }
        .unwrap();
        let y = if form < 2 {
            g.mul(w, normed)
        } else {
            g.mul(normed, w)
        }
        .unwrap();
        g.set_outputs(vec![y]);
        let plan = plan_graph(&g, &all_passes()).unwrap();
        let ops: Vec<String> = plan.graph.nodes().iter().map(|n| n.op.name()).collect();
        assert!(
            ops.contains(&"rms_norm".to_string())
                && !ops.iter().any(|o| o == "reduce_mean" || o == "elementwise"),
            "form {form}: {}",
            plan.graph
        );
        check(&g, &mut rng, &format!("spelled rms norm form {form}"));
    }
    // A mean over another axis, or a root read again, is left alone.
    for variant in 0..2 {
        let g = Graph::new("not rms norm");
        let x = g.input("x", Shape::new(&[4, 6, 6], DType::F32)).unwrap();
        let w = g.param("w", Shape::new(&[6], DType::F32)).unwrap();
        let c = |v: f64| g.scalar(v, DType::F32);
        let axis = if variant == 0 { 1 } else { -1 };
        let s = g
            .add(
                g.mean(g.mul(x, x).unwrap(), &[axis], true).unwrap(),
                c(1e-5),
            )
            .unwrap();
        let r = g.rsqrt(s).unwrap();
        let y = g.mul(g.mul(x, r).unwrap(), w).unwrap();
        g.set_outputs(if variant == 0 { vec![y] } else { vec![y, r] });
        let plan = plan_graph(&g, &all_passes()).unwrap();
        assert!(
            !plan.graph.nodes().iter().any(|n| n.op.name() == "rms_norm"),
            "variant {variant}: {}",
            plan.graph
        );
        check(&g, &mut rng, &format!("not rms norm, variant {variant}"));
    }
}

#[test]
fn small_integer_powers_match_the_reference() {
    // Squares, cubes and fourth powers run as products; other exponents (and a
    // power whose base is the scalar) as the general power.
    let mut rng = Rng(65);
    for exponent in [1.0, 2.0, 3.0, 4.0, 0.5, -2.0, 2.5] {
        let g = Graph::new("power");
        let x = g.input("x", Shape::new(&[3, 1000], DType::F32)).unwrap();
        let c = g.scalar(exponent, DType::F32);
        let base = g.abs(x).unwrap();
        let y = g
            .pow(if exponent.fract() != 0.0 { base } else { x }, c)
            .unwrap();
        let z = g.pow(g.scalar(1.5, DType::F32), x).unwrap();
        g.set_outputs(vec![y, z]);
        check(&g, &mut rng, &format!("x ^ {exponent}"));
    }
}

#[test]
fn silu_spelled_with_sigmoid_joins_the_convolution() {
    let mut rng = Rng(63);
    for sigmoid_first in [false, true] {
        let g = Graph::new("spelled silu");
        let x = g.input("x", Shape::new(&[2, 6, 9, 7], DType::F32)).unwrap();
        let w = g
            .param("w", Shape::new(&[10, 6, 3, 3], DType::F32))
            .unwrap();
        let b = g.param("b", Shape::new(&[10], DType::F32)).unwrap();
        let y = g
            .conv2d(x, w, Some(b), [1, 1], [1, 1, 1, 1], [1, 1], 1)
            .unwrap();
        let s = g.sigmoid(y).unwrap();
        let out = if sigmoid_first {
            g.mul(s, y)
        } else {
            g.mul(y, s)
        }
        .unwrap();
        g.set_outputs(vec![out]);
        let plan = plan_graph(&g, &all_passes()).unwrap();
        let ops: Vec<String> = plan.graph.nodes().iter().map(|n| n.op.name()).collect();
        assert!(
            ops.contains(&"fused_conv2d".to_string())
                && !ops
                    .iter()
                    .any(|o| o == "sigmoid" || o == "elementwise" || o == "mul"),
            "sigmoid first {sigmoid_first}: {}",
            plan.graph
        );
        check(
            &g,
            &mut rng,
            &format!("spelled silu, sigmoid first {sigmoid_first}"),
        );
    }
    // A sigmoid read again, or of another value, stays as it is.
    let g = Graph::new("not silu");
    let x = g.input("x", Shape::new(&[4, 5], DType::F32)).unwrap();
    let z = g.input("z", Shape::new(&[4, 5], DType::F32)).unwrap();
    let s = g.sigmoid(x).unwrap();
    let shared = g.mul(x, s).unwrap();
    let other = g.mul(z, g.sigmoid(x).unwrap()).unwrap();
    g.set_outputs(vec![shared, s, other]);
    let plan = plan_graph(&g, &all_passes()).unwrap();
    assert!(
        plan.fusions
            .iter()
            .all(|f| !f.replaced.iter().any(|r| r.starts_with("sigmoid"))),
        "{:?}",
        plan.fusions
    );
    check(&g, &mut rng, "not silu");
}

#[test]
fn a_clamp_to_relu6_joins_the_convolution() {
    let mut rng = Rng(64);
    for (form, bounds) in [(0, (0.0, 6.0)), (1, (0.0, 6.0)), (2, (0.0, 5.0))] {
        let g = Graph::new("clamped conv");
        // 64 channels deep, so that both bounds clip some values.
        let x = g
            .input("x", Shape::new(&[1, 64, 8, 9], DType::F32))
            .unwrap();
        let w = g
            .param("w", Shape::new(&[7, 64, 1, 1], DType::F32))
            .unwrap();
        let b = g.param("b", Shape::new(&[7], DType::F32)).unwrap();
        let y = g
            .conv2d(x, w, Some(b), [1, 1], [0, 0, 0, 0], [1, 1], 1)
            .unwrap();
        let (lo, hi) = (
            g.scalar(bounds.0, DType::F32),
            g.scalar(bounds.1, DType::F32),
        );
        let clamped = match form {
            // As ONNX's Clip imports, and the other nesting with operands swapped.
            0 => g.binary(BinaryOp::Min, g.binary(BinaryOp::Max, y, lo).unwrap(), hi),
            _ => g.binary(BinaryOp::Max, lo, g.binary(BinaryOp::Min, hi, y).unwrap()),
        }
        .unwrap();
        g.set_outputs(vec![clamped]);
        let plan = plan_graph(&g, &all_passes()).unwrap();
        let relu6 = plan.graph.nodes().iter().any(|n| match &n.op {
            rlx::ir::Op::FusedConv2d { fusion, .. } => {
                fusion.activation == Some(rlx::ir::UnaryOp::Relu6)
            }
            _ => false,
        });
        assert_eq!(
            relu6,
            bounds.1 == 6.0,
            "form {form} {bounds:?}: {}",
            plan.graph
        );
        check(&g, &mut rng, &format!("clamp form {form} to {bounds:?}"));
        // A backend without relu6 keeps the clamp as it is.
        let names = ["conv2d", "fused_conv2d", "max", "min", "elementwise"];
        let without = PlanOptions {
            native: rlx::ir::decompose::NativeOps::Only(
                names.iter().map(|s| s.to_string()).collect(),
            ),
            ..all_passes()
        };
        let plan = plan_graph(&g, &without).unwrap();
        assert!(
            !plan.graph.nodes().iter().any(|n| n.op.name() == "relu6"),
            "{}",
            plan.graph
        );
    }
}

#[test]
fn a_fused_convolution_with_misshapen_operands_is_an_error() {
    let g = Graph::new("bad fused conv");
    let x = g.input("x", Shape::new(&[1, 8, 5, 5], DType::F32)).unwrap();
    let w = g.param("w", Shape::new(&[4, 8, 1, 1], DType::F32)).unwrap();
    let per_channel = |name: &str, c: usize| {
        g.param(name, Shape::new(&[1, c, 1, 1], DType::F32))
            .unwrap()
    };
    let (s4, t4, s8, t8, s3) = (
        per_channel("s4", 4),
        per_channel("t4", 4),
        per_channel("s8", 8),
        per_channel("t8", 8),
        per_channel("s3", 3),
    );
    let op = |channel_affine: bool, input_affine: bool| rlx::ir::Op::FusedConv2d {
        window: rlx::ir::Window2d {
            kernel: [1, 1],
            stride: [1, 1],
            padding: [0; 4],
            dilation: [1, 1],
        },
        groups: 1,
        fusion: rlx::ir::ConvFusion {
            bias: false,
            activation: None,
            residual: false,
            channel_affine,
            post_activation: None,
            input_affine,
            input_activation: None,
        },
    };
    // An output-channel scale of the wrong size, an input scale sized for the output,
    // and a missing operand are errors that name the op and the shape it wants.
    for (affine, input, operands, want) in [
        (true, false, vec![x, w, s3, t4], "[1, 4, 1, 1]"),
        (false, true, vec![x, w, s4, t4], "[1, 8, 1, 1]"),
        (true, true, vec![x, w, s4, t4, s8], "takes 6 operands"),
    ] {
        let e = g.push(op(affine, input), &operands).unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("fused_conv2d") && text.contains(want),
            "{text}"
        );
    }
    // The graph takes the well-formed op afterwards and runs it.
    let y = g.push(op(true, true), &[x, w, s4, t4, s8, t8]).unwrap();
    g.set_outputs(vec![y]);
    let mut rng = Rng(43);
    check(&g, &mut rng, "fused conv after rejected ones");
}

#[test]
fn a_fused_product_over_a_half_weight_decomposes_with_the_weight_widened() {
    let g = Graph::new("half weight");
    let x = g.input("x", Shape::new(&[3, 8], DType::F32)).unwrap();
    let w = g.param("w", Shape::new(&[8, 5], DType::F16)).unwrap();
    let b = g.param("b", Shape::new(&[5], DType::F32)).unwrap();
    let y = g
        .add(g.matmul(x, g.cast(w, DType::F32).unwrap()).unwrap(), b)
        .unwrap();
    g.set_outputs(vec![g.relu(y).unwrap()]);
    let fused = plan_graph(&g, &all_passes()).unwrap().graph;
    let product = fused
        .nodes()
        .iter()
        .find(|n| n.op.name() == "fused_matmul")
        .map(|n| n.inputs[1])
        .expect("the product and its epilogue fuse");
    assert_eq!(fused.shape(product).unwrap().dtype(), DType::F16);
    let back =
        rlx::ir::decompose::decompose_graph(&fused, &|op| !rlx::ir::decompose::is_composite(op))
            .unwrap();
    let mut rng = Rng(0x4A1F);
    let feeds = feeds(&g, &mut rng);
    for (want, got) in reference(&g, &feeds).iter().zip(&reference(&back, &feeds)) {
        for (a, b) in want.data.iter().zip(&got.data) {
            assert!((a - b).abs() <= 1e-6 * (1.0 + a.abs()), "{a} vs {b}");
        }
    }
}

/// Products of one to four rows (a decode step) over weights of every float dtype,
/// wide and narrow, with and without epilogues: on CUDA these take the
/// matrix-vector kernel that reads the weights as stored and splits the inner dim.
#[test]
fn few_row_products_over_stored_weights_match() {
    let mut rng = Rng(91);
    let shapes = [
        (1, 2048, 256),
        (1, 64, 24),
        (2, 700, 37),
        (3, 1536, 520),
        (4, 96, 8),
        (1, 0, 16),
    ];
    for (case, &(rows, k, n)) in shapes.iter().enumerate() {
        for wdt in [DType::F32, DType::F16, DType::BF16] {
            let g = Graph::new("decode product");
            let x = g.input("x", Shape::new(&[rows, k], DType::F32)).unwrap();
            let w = g.param("w", Shape::new(&[k, n], wdt)).unwrap();
            let w = if wdt == DType::F32 {
                w
            } else {
                g.cast(w, DType::F32).unwrap()
            };
            let mut y = g.matmul(x, w).unwrap();
            if case % 2 == 0 {
                let b = g.param("b", Shape::new(&[n], DType::F32)).unwrap();
                y = g.silu(g.add(y, b).unwrap()).unwrap();
            }
            if case % 3 != 2 {
                let r = g.input("r", Shape::new(&[rows, n], DType::F32)).unwrap();
                y = g.add(r, y).unwrap();
            }
            g.set_outputs(vec![y]);
            // Values exact in the half formats, so the reference reads the stored
            // weights.
            let mut feeds = feeds(&g, &mut rng);
            for (_, data) in &mut feeds {
                data.iter_mut()
                    .for_each(|v| *v = (*v * 128.0).round() / 128.0);
            }
            let want = reference(&g, &feeds);
            for device in common::test_devices() {
                let mut c = Session::new(device).compile(&g).unwrap();
                // Twice: on CUDA the second run replays the graph the first captured.
                for round in 0..2 {
                    let got = run_compiled_again(&mut c, &g, &feeds);
                    assert_close(
                        &want,
                        &got,
                        2e-5,
                        &format!("{rows}x{k}x{n} {wdt} on {device}, round {round}"),
                    );
                }
            }
        }
    }
}

/// Profiling times every kernel of a run on every device, and a profiled run
/// computes what an unprofiled one does (on CUDA it launches step by step instead
/// of replaying the captured graph).
#[test]
fn profiling_times_every_kernel_and_changes_no_result() {
    let mut rng = Rng(17);
    let g = Graph::new("profiled");
    let x = g.input("x", Shape::new(&[6, 40], DType::F32)).unwrap();
    let w = g.param("w", Shape::new(&[40, 24], DType::F32)).unwrap();
    let b = g.param("b", Shape::new(&[24], DType::F32)).unwrap();
    let y = g.gelu(g.add(g.matmul(x, w).unwrap(), b).unwrap()).unwrap();
    let y = g.softmax(y, -1).unwrap();
    g.set_outputs(vec![y]);
    let feeds = feeds(&g, &mut rng);
    let want = reference(&g, &feeds);
    for device in common::test_devices() {
        let mut c = Session::new(device).compile(&g).unwrap();
        assert!(
            c.profile().is_none(),
            "{device}: no profile before it is asked for"
        );
        let plain = run_compiled_again(&mut c, &g, &feeds);
        c.set_profiling(true);
        for round in 0..3 {
            let got = run_compiled_again(&mut c, &g, &feeds);
            assert_eq!(got, plain, "{device}: profiled run {round}");
        }
        let profile = c.profile().expect("profiling is on");
        assert_eq!(profile.runs, 3, "{device}");
        let kernels = c.kernels();
        assert_eq!(profile.kernels.len(), kernels.len(), "{device}");
        for (timed, (node, name)) in profile.kernels.iter().zip(&kernels) {
            assert_eq!((timed.node, &timed.kernel), (*node, name), "{device}");
        }
        let total: std::time::Duration = profile.kernels.iter().map(|k| k.total).sum();
        assert!(total > std::time::Duration::ZERO, "{device}: {profile:?}");
        c.set_profiling(false);
        assert!(c.profile().is_none(), "{device}");
        assert_close(
            &want,
            &run_compiled_again(&mut c, &g, &feeds),
            1e-5,
            &format!("{device} after profiling"),
        );
    }
}

/// A run that leaves its outputs on the device copies nothing back: reading them is
/// an error until a run that copies them, which then gives the same values.
#[test]
fn a_run_on_the_device_leaves_outputs_unread_until_a_copying_run() {
    let mut rng = Rng(23);
    let g = Graph::new("device run");
    let x = g.input("x", Shape::new(&[5, 12], DType::F32)).unwrap();
    let w = g.param("w", Shape::new(&[12, 7], DType::F32)).unwrap();
    g.set_outputs(vec![g.relu(g.matmul(x, w).unwrap()).unwrap()]);
    let feeds = feeds(&g, &mut rng);
    let want = reference(&g, &feeds);
    for device in common::test_devices() {
        let mut c = Session::new(device).compile(&g).unwrap();
        c.set_param("w", &feeds[1].1).unwrap();
        let xs = &feeds[0].1;
        c.run_typed_on_device(&[("x", TensorRef::F32(xs))]).unwrap();
        let e = c.read_outputs().unwrap_err();
        assert!(e.to_string().contains("on the device"), "{device}: {e}");
        // A wrong input is still rejected, and the graph still runs after it.
        assert!(
            c.run_typed_on_device(&[("x", TensorRef::F32(&xs[1..]))])
                .is_err()
        );
        let got = c.run(&[("x", xs)]).unwrap();
        assert_close(&want, &got, 1e-5, &format!("{device}"));
        assert_eq!(c.read_outputs().unwrap(), got, "{device}");
    }
}

#[test]
fn concat_operands_are_written_in_place_where_they_can_be() {
    // Two convolutions joined along channels (a fire module's expand layers) at batch
    // 1: both are written straight into the concat's output, even one that another
    // step also reads (it reads it there). At batch 2 an operand's range is not
    // contiguous; an operand that is an input or a graph output keeps its copy.
    let mut rng = Rng(47);
    for (n, extra_reader, output_operand) in [
        (1, false, false),
        (2, false, false),
        (1, true, false),
        (1, false, true),
    ] {
        let g = Graph::new("fire");
        let x = g
            .input("x", Shape::new(&[n, 8, 9, 11], DType::F32))
            .unwrap();
        let w1 = g
            .param("w1", Shape::new(&[16, 8, 1, 1], DType::F32))
            .unwrap();
        let w3 = g
            .param("w3", Shape::new(&[12, 8, 3, 3], DType::F32))
            .unwrap();
        let a = g.conv2d(x, w1, None, [1, 1], [0; 4], [1, 1], 1).unwrap();
        let a = g.relu(a).unwrap();
        let b = g.conv2d(x, w3, None, [1, 1], [1; 4], [1, 1], 1).unwrap();
        let b = g.relu(b).unwrap();
        let joined = g.concat(&[a, b, x], 1).unwrap();
        let mut outs = vec![g.neg(joined).unwrap()];
        if extra_reader {
            outs.push(g.exp(a).unwrap());
        }
        if output_operand {
            outs.push(b);
        }
        g.set_outputs(outs);
        let what = format!("n {n}, extra reader {extra_reader}, output operand {output_operand}");
        let plan = plan_graph(&g, &all_passes()).unwrap();
        let nodes = plan.graph.nodes();
        let concat = nodes
            .iter()
            .position(|node| matches!(node.op, rlx::ir::Op::Concat { .. }))
            .expect("a concat");
        let at = |id: NodeId| plan.locations[id.index()];
        let inside: Vec<bool> = nodes[concat]
            .inputs
            .iter()
            .map(|&o| {
                let (lo, here) = (at(NodeId::from_index(concat)), at(o));
                let size = nodes[concat].shape.byte_size();
                here.region == lo.region
                    && here.offset >= lo.offset
                    && here.offset < lo.offset + size
            })
            .collect();
        let want = [n == 1, n == 1 && !output_operand, false];
        assert_eq!(inside, want, "{what}\n{}", plan.graph);
        drop(nodes);
        check_within(&g, &mut rng, &what, 2e-5);
    }
}

/// A dense block (DenseNet's, with 1x1 layers): layer `i` reads `cat(x0, ..., xi)`
/// and adds `x{i+1}`,
/// so every feature is an operand of every later concat. All of them live in the
/// last concat, which holds the others' operands as runs: each feature is written
/// once, where that concat keeps it, and no concat copies. Cases: channel counts
/// that keep the blocked layout (16-channel growth) and ones that do not (12), a
/// block whose first feature is the graph's input (never placed, so the concats
/// that read it copy), and two blocks that share a prefix (its features live in
/// one of them, and the other copies them).
#[test]
fn dense_block_concats_share_one_buffer() {
    let mut rng = Rng(0xde5e);
    for (growth, input_first, forked) in [
        (16, false, false),
        (12, false, false),
        (16, true, false),
        (16, false, true),
    ] {
        let what = format!("growth {growth}, input first {input_first}, forked {forked}");
        let g = Graph::new("dense block");
        let x = g
            .input("x", Shape::new(&[1, 16, 7, 9], DType::F32))
            .unwrap();
        let stem = g
            .param("stem", Shape::new(&[32, 16, 3, 3], DType::F32))
            .unwrap();
        let x0 = if input_first {
            x
        } else {
            let y = g.conv2d(x, stem, None, [1, 1], [1; 4], [1, 1], 1).unwrap();
            g.relu(y).unwrap()
        };
        let mut features = vec![x0];
        let mut joined = Vec::new();
        let mut channels = g.shape(x0).unwrap().dim(1);
        for layer in 0..4 {
            let cat = g.concat(&features, 1).unwrap();
            joined.push(cat);
            let act = g.relu(cat).unwrap();
            let w = g
                .param(
                    format!("w{layer}"),
                    Shape::new(&[growth, channels, 1, 1], DType::F32),
                )
                .unwrap();
            let y = g.conv2d(act, w, None, [1, 1], [0; 4], [1, 1], 1).unwrap();
            features.push(y);
            channels += growth;
        }
        let last = g.concat(&features, 1).unwrap();
        let mut outs = vec![g.neg(last).unwrap()];
        if forked {
            // A second block over the first three features.
            let w = g
                .param(
                    "fork",
                    Shape::new(&[growth, 32 + 2 * growth, 1, 1], DType::F32),
                )
                .unwrap();
            let other = g
                .conv2d(joined[2], w, None, [1, 1], [0; 4], [1, 1], 1)
                .unwrap();
            let mut fork = features[..3].to_vec();
            fork.push(g.relu(other).unwrap());
            outs.push(g.concat(&fork, 1).unwrap());
        }
        g.set_outputs(outs);
        let plan = plan_graph(&g, &all_passes()).unwrap();
        let nodes = plan.graph.nodes();
        let concats: Vec<usize> = (0..nodes.len())
            .filter(|&i| matches!(nodes[i].op, rlx::ir::Op::Concat { .. }))
            .collect();
        let host = *concats
            .iter()
            .max_by_key(|&&c| (nodes[c].inputs.len(), c))
            .unwrap();
        let at = |i: usize| plan.locations[i];
        let inside = |i: usize| {
            let (lo, here) = (at(host), at(i));
            here.region == lo.region
                && here.offset >= lo.offset
                && here.offset + nodes[i].shape.byte_size()
                    <= lo.offset + nodes[host].shape.byte_size()
        };
        // Every feature the graph computes lives in the largest concat, and so does
        // every concat of the block whose operands all do.
        for &f in &nodes[host].inputs {
            let computed = !nodes[f.index()].op.is_source();
            assert_eq!(
                inside(f.index()),
                computed,
                "{what}: feature {f}\n{}",
                plan.graph
            );
        }
        let hosted = concats.iter().filter(|&&c| c != host && inside(c)).count();
        // The four concats the layers read; the fork's holds a feature the block's
        // largest does not, so it has its own buffer.
        let want = if input_first { 0 } else { 4 };
        assert_eq!(
            hosted, want,
            "{what}: concats in the largest\n{}",
            plan.graph
        );
        drop(nodes);
        check_within(&g, &mut rng, &what, 2e-5);
    }
}

/// MobileNet-style inverted residual blocks (1x1 expansion, depthwise, 1x1
/// projection, residual), with elementwise ops between: on AVX-512 the CPU keeps
/// the values between these steps channel-blocked (`[n, c / 16, h, w, 16]`), and the
/// results must match the reference of the original graph. Channel counts that are
/// not whole blocks, views and the graph's output stay plain.
#[test]
fn channel_blocked_convolution_chains_match_the_reference() {
    let mut rng = Rng(0xb10c);
    let mut blocked_steps = 0;
    for case in 0..10 {
        let n = 1 + rng.below(2);
        let c = [16, 24, 32][rng.below(3)];
        let e = 16 * (1 + rng.below(4));
        let (h, w) = (4 + rng.below(12), 4 + rng.below(12));
        let k = [3, 5][rng.below(2)];
        let stride = 1 + rng.below(2);
        let dilation = if stride == 1 { 1 + rng.below(2) } else { 1 };
        let pad = dilation * (k / 2);
        let g = Graph::new("inverted residual");
        let x = g.input("x", Shape::new(&[n, c, h, w], DType::F32)).unwrap();
        let param =
            |name: &str, dims: &[usize]| g.param(name, Shape::new(dims, DType::F32)).unwrap();
        let expand = g
            .conv2d(
                x,
                param("w1", &[e, c, 1, 1]),
                Some(param("b1", &[e])),
                [1, 1],
                [0; 4],
                [1, 1],
                1,
            )
            .unwrap();
        let expand = g.unary(UnaryOp::Relu6, expand).unwrap();
        let depthwise = g
            .conv2d(
                expand,
                param("wd", &[e, 1, k, k]),
                Some(param("bd", &[e])),
                [stride, stride],
                [pad; 4],
                [dilation, dilation],
                e,
            )
            .unwrap();
        // An elementwise op of its own (and one with a scalar operand) between
        // blocked convolutions.
        let depthwise = g.unary(UnaryOp::HardSwish, depthwise).unwrap();
        let half = g.scalar(0.5, DType::F32);
        let depthwise = g.mul(depthwise, half).unwrap();
        let project = g
            .conv2d(
                depthwise,
                param("w2", &[c, e, 1, 1]),
                Some(param("b2", &[c])),
                [1, 1],
                [0; 4],
                [1, 1],
                1,
            )
            .unwrap();
        let y = if stride == 1 {
            g.add(project, x).unwrap()
        } else {
            project
        };
        let out = g
            .conv2d(
                y,
                param("w3", &[e, c, 1, 1]),
                None,
                [1, 1],
                [0; 4],
                [1, 1],
                1,
            )
            .unwrap();
        let out = g.relu(out).unwrap();
        g.set_outputs(vec![out]);
        check(
            &g,
            &mut rng,
            &format!("case {case} x[{n},{c},{h},{w}] e{e} k{k} s{stride} d{dilation}"),
        );
        blocked_steps += Session::new(Device::Cpu)
            .compile(&g)
            .unwrap()
            .kernels()
            .iter()
            .filter(|(_, k)| k.contains("blocked"))
            .count();
    }
    if blocks_enabled() {
        assert!(blocked_steps >= 20, "only {blocked_steps} blocked steps");
    }
}

/// Channel-blocked 1x1 convolutions between blocked values, in the shapes that
/// split their work differently: a plane whose input fills more than a block a
/// thread (each task runs every group of output channels), many input channels
/// over few pixels (the weights asked ahead, each block of 16 of the input
/// asking for the next one's lines, pixel blocks of unequal whole tiles), a
/// residual in the blocked layout, and channel counts with a last block of 8.
#[test]
fn blocked_pointwise_convolutions_over_many_pixels_or_channels_match() {
    let mut rng = Rng(0x1a1a);
    for (c, e, (h, w), residual) in [
        (16, 64, (72, 72), false),
        (96, 576, (13, 13), true),
        (40, 200, (9, 17), true),
        (160, 960, (7, 7), true),
    ] {
        let what = format!("x[1,{c},{h},{w}] -> {e} -> {c}, residual {residual}");
        let g = Graph::new("pointwise chain");
        let x = g.input("x", Shape::new(&[1, c, h, w], DType::F32)).unwrap();
        let param =
            |name: &str, dims: &[usize]| g.param(name, Shape::new(dims, DType::F32)).unwrap();
        let pointwise = |name: &str, x: NodeId, from: usize, to: usize| {
            let weights = param(name, &[to, from, 1, 1]);
            let bias = param(&format!("{name}.bias"), &[to]);
            g.conv2d(x, weights, Some(bias), [1, 1], [0; 4], [1, 1], 1)
                .unwrap()
        };
        // Blocked from here: the graph's input is plain.
        let start = pointwise("w0", x, c, c);
        let expand = pointwise("w1", start, c, e);
        let expand = g.relu(expand).unwrap();
        let mut project = pointwise("w2", expand, e, c);
        if residual {
            project = g.add(project, start).unwrap();
        }
        // Read blocked into a plain plane mean: the graph's output. (A fourth
        // product, of sums over 576 channels of sums over 96, rounds past the
        // check's bound for values of this size.)
        let out = g.mean(project, &[2, 3], true).unwrap();
        g.set_outputs(vec![out]);
        check(&g, &mut rng, &what);
        if blocks_enabled() {
            let kernels = Session::new(Device::Cpu).compile(&g).unwrap().kernels();
            let pointwise = kernels
                .iter()
                .filter(|(_, k)| k.contains("blocked-pointwise"))
                .count();
            assert!(pointwise >= 2, "{what}: {kernels:?}");
        }
    }
}

/// Slices, constant pads and resamplings of the plane between blocked
/// convolutions run on the blocked values (each run of equal-width blocks as a
/// plain `[blocks, h, w, lanes]` tensor), and a pooled `[n, c, 1, 1]` branch is
/// resampled from plain into blocked: channel counts with and without a last block
/// of 8, two images, strided and backward slices, uneven pads, negative indices. The split
/// dilated convolution's pattern (a convolution adding a padded product of a slice
/// of its own input, into a plain output) keeps the shared input blocked: only the
/// residual turns plain.
#[test]
fn slices_pads_and_resamplings_of_blocked_planes_match() {
    let mut rng = Rng(0x51ce);
    for c in [24, 32] {
        let what = format!("{c} channels");
        let g = Graph::new("blocked planes");
        let x = g.input("x", Shape::new(&[2, c, 9, 7], DType::F32)).unwrap();
        let a = scaled_conv(&g, x, "a", [c, c, 1], [1, 0, 1]);
        let sliced = g.slice_axes(a, &[(2, 1, 8, 2), (3, 2, 7, 1)]).unwrap();
        let sliced = scaled_conv(&g, sliced, "s", [c, 16, 1], [1, 0, 1]);
        // Backwards along the rows.
        let reversed = g.slice_axes(a, &[(2, 7, 1, -1), (3, 1, 6, 2)]).unwrap();
        let reversed = scaled_conv(&g, reversed, "r", [c, 16, 1], [1, 0, 1]);
        let padded = g
            .pad(
                a,
                &[(0, 0), (0, 0), (1, 2), (3, 0)],
                PadMode::Constant(rlx::ir::F64Bits::new(0.5)),
            )
            .unwrap();
        let padded = scaled_conv(&g, padded, "p", [c, 16, 1], [1, 0, 1]);
        // Bilinear-like taps along each axis, one index counted from the end.
        let taps = |g: &Graph, n: usize, out: usize, rng: &mut Rng| {
            let index: Vec<i64> = (0..2 * out)
                .map(|i| {
                    let k = ((i * 7 + 3) % n) as i64;
                    if i == 1 { k - n as i64 } else { k }
                })
                .collect();
            let weight: Vec<f32> = (0..2 * out).map(|_| rng.value()).collect();
            (
                g.constant(TensorData::I64(index), &[2, out]).unwrap(),
                g.constant_f32(&weight, &[2, out]).unwrap(),
            )
        };
        let (i2, w2) = taps(&g, 9, 14, &mut rng);
        let (i3, w3) = taps(&g, 7, 11, &mut rng);
        let up = g.interpolate(a, i2, w2, 2).unwrap();
        let up = g.interpolate(up, i3, w3, 3).unwrap();
        let up = scaled_conv(&g, up, "u", [c, 16, 1], [1, 0, 1]);
        let pooled = g.mean(a, &[2, 3], true).unwrap();
        let (p2, q2) = taps(&g, 1, 5, &mut rng);
        let (p3, q3) = taps(&g, 1, 4, &mut rng);
        let spread = g.interpolate(pooled, p2, q2, 2).unwrap();
        let spread = g.interpolate(spread, p3, q3, 3).unwrap();
        let spread = scaled_conv(&g, spread, "m", [c, 16, 1], [1, 0, 1]);
        // A corner of `a` by its own weights, padded back to the plane and added
        // to the whole plane's product: the graph's output.
        let corner = g.slice_axes(a, &[(2, 0, 4, 1), (3, 0, 4, 1)]).unwrap();
        let corner = scaled_conv(&g, corner, "c", [c, 16, 1], [1, 0, 1]);
        let corner = g
            .pad(
                corner,
                &[(0, 0), (0, 0), (5, 0), (3, 0)],
                PadMode::Constant(rlx::ir::F64Bits::new(0.0)),
            )
            .unwrap();
        let whole = scaled_conv(&g, a, "w", [c, 16, 1], [1, 0, 1]);
        let summed = g.add(whole, corner).unwrap();
        g.set_outputs(vec![sliced, reversed, padded, up, spread, summed]);
        check(&g, &mut rng, &what);
        if blocks_enabled() {
            let kernels = Session::new(Device::Cpu).compile(&g).unwrap().kernels();
            // The three slices (the corner's too: its input stays blocked), the pad
            // between blocked values (the corner's pad, the plain output's
            // residual, is plain), and all four resamplings.
            for (name, least) in [
                ("cpu.blocked.slice", 3),
                ("cpu.blocked.pad", 1),
                ("cpu.blocked.interpolate", 4),
            ] {
                let count = kernels.iter().filter(|(_, k)| k.starts_with(name)).count();
                assert!(count >= least, "{what}: {name} {count} times: {kernels:?}");
            }
        }
    }
}

/// A ConvNeXt-style block: a depthwise 7x7 convolution, a permute to channels
/// last, a layer norm and two products over the channels, a permute back, a
/// per-channel scale and the residual. The permutes move values between the
/// blocked layout and plain channels-last ones (whole vectors per pixel), so the
/// convolutions on either side stay blocked: channel counts with and without a
/// last block of 8, two images, an odd plane.
#[test]
fn channels_last_blocks_between_blocked_convolutions_match() {
    let mut rng = Rng(0xc0e7);
    // A plane 16 high: the channels-last side, `[n, 16, w, c]`, could itself be
    // blocked along its second axis, and is made plain by the steps around it.
    for (c, h) in [(24, 9), (32, 9), (48, 9), (32, 16)] {
        let what = format!("{c} channels, {h} rows");
        let g = Graph::new("channels-last block");
        let x = g.input("x", Shape::new(&[2, c, h, 7], DType::F32)).unwrap();
        let param =
            |name: &str, dims: &[usize]| g.param(name, Shape::new(dims, DType::F32)).unwrap();
        let a = scaled_conv(&g, x, "a", [c, c, 1], [1, 0, 1]);
        // Weights as they are (a param), as the blocked depthwise kernel packs them.
        let taps = param("dw", &[c, 1, 7, 7]);
        let dw = g
            .conv2d(
                a,
                taps,
                Some(param("dw.b", &[c])),
                [1, 1],
                [3; 4],
                [1, 1],
                c,
            )
            .unwrap();
        let last = g.permute(dw, &[0, 2, 3, 1]).unwrap();
        let normed = g
            .layer_norm(last, param("ln.g", &[c]), param("ln.b", &[c]), 1e-6)
            .unwrap();
        let scale_by = |x: NodeId, k: usize| {
            g.mul(x, g.scalar(1.0 / (k as f64).sqrt(), DType::F32))
                .unwrap()
        };
        let up = g
            .matmul(normed, scale_by(param("up", &[c, 2 * c]), c))
            .unwrap();
        let up = g.gelu(g.add(up, param("up.b", &[2 * c])).unwrap()).unwrap();
        let down = g
            .matmul(up, scale_by(param("down", &[2 * c, c]), 2 * c))
            .unwrap();
        let first = g.permute(down, &[0, 3, 1, 2]).unwrap();
        // A blocked per-channel operand needs whole blocks: with a last block of
        // 8, the block ends at the residual alone.
        let scaled = if c % 16 == 0 {
            g.mul(param("gamma", &[c, 1, 1]), first).unwrap()
        } else {
            first
        };
        let block = g.add(scaled, a).unwrap();
        let out = scaled_conv(&g, block, "out", [c, 16, 1], [1, 0, 1]);
        g.set_outputs(vec![out]);
        check(&g, &mut rng, &what);
        if blocks_enabled() {
            let kernels = Session::new(Device::Cpu).compile(&g).unwrap().kernels();
            for (name, count) in [
                ("cpu.blocked.channels_last", 2),
                ("cpu.blocked-depthwise", 1),
            ] {
                let found = kernels.iter().filter(|(_, k)| k.starts_with(name)).count();
                assert_eq!(found, count, "{what}: {name}: {kernels:?}");
            }
        }
    }
}

/// A 1-D convolution whose one row of staged input overflows half of L2 (520
/// channels, 3 taps), reading a channel-blocked input with a last block of 8: the
/// pixel kernel stages it in blocks of columns, the first one's left padding and
/// the last one's right padding included, strided and not.
#[test]
fn blocked_one_d_convolutions_in_blocks_of_columns_match() {
    let mut rng = Rng(0xc01);
    for (stride, pad) in [(2, [0, 1, 0, 1]), (1, [0, 2, 0, 3])] {
        let what = format!("stride {stride}, pad {pad:?}");
        let g = Graph::new("1-D features");
        let (c, w) = (520, 900);
        let x = g.input("x", Shape::new(&[1, c, 1, w], DType::F32)).unwrap();
        let mix = g
            .param("mix", Shape::new(&[c, c, 1, 1], DType::F32))
            .unwrap();
        let mixed = g.conv2d(x, mix, None, [1, 1], [0; 4], [1, 1], 1).unwrap();
        let taps = g
            .param("taps", Shape::new(&[16, c, 1, 3], DType::F32))
            .unwrap();
        let y = g
            .conv2d(mixed, taps, None, [1, stride], pad, [1, 1], 1)
            .unwrap();
        let out = g.mean(y, &[2, 3], true).unwrap();
        g.set_outputs(vec![out]);
        check(&g, &mut rng, &what);
        if blocks_enabled() {
            let kernels = Session::new(Device::Cpu).compile(&g).unwrap().kernels();
            assert!(
                kernels.iter().any(|(_, k)| k.contains("blocked-direct")),
                "{what}: {kernels:?}"
            );
        }
    }
}

/// Permutes that move only axes of size 1 (a batch-first model around a
/// sequence-first attention block: `[1, s, d]` to `[s, 1, d]` and back) become
/// reshapes, so the fusions see through them, and are views in a plan without the
/// simplifying passes too; one that reorders longer axes still copies.
#[test]
fn permutes_of_unit_axes_are_views() {
    let mut rng = Rng(0x7e57);
    let g = Graph::new("sequence first");
    let x = g.input("x", Shape::new(&[1, 9, 16], DType::F32)).unwrap();
    let w = g.param("w", Shape::new(&[16, 16], DType::F32)).unwrap();
    let seq_first = g.permute(x, &[1, 0, 2]).unwrap();
    let y = g.matmul(seq_first, w).unwrap();
    let y = g.relu(y).unwrap();
    let batch_first = g.permute(y, &[1, 0, 2]).unwrap();
    let sum = g.add(batch_first, x).unwrap();
    let swapped = g.permute(sum, &[0, 2, 1]).unwrap();
    g.set_outputs(vec![g.neg(swapped).unwrap()]);
    let plan = plan_graph(&g, &all_passes()).unwrap();
    let nodes = plan.graph.nodes();
    let views: Vec<(Vec<usize>, bool)> = nodes
        .iter()
        .enumerate()
        .filter_map(|(i, node)| match &node.op {
            rlx::ir::Op::Permute { perm } => Some((perm.clone(), plan.is_view[i])),
            _ => None,
        })
        .collect();
    assert_eq!(views, [(vec![0, 2, 1], false)], "{}", plan.graph);
    drop(nodes);
    let unsimplified = PlanOptions {
        simplify: false,
        ..all_passes()
    };
    let plan = plan_graph(&g, &unsimplified).unwrap();
    let nodes = plan.graph.nodes();
    let views: Vec<(Vec<usize>, bool)> = nodes
        .iter()
        .enumerate()
        .filter_map(|(i, node)| match &node.op {
            rlx::ir::Op::Permute { perm } => Some((perm.clone(), plan.is_view[i])),
            _ => None,
        })
        .collect();
    assert_eq!(
        views,
        [
            (vec![1, 0, 2], true),
            (vec![1, 0, 2], true),
            (vec![0, 2, 1], false)
        ],
        "{}",
        plan.graph
    );
    drop(nodes);
    check(&g, &mut rng, "permutes of unit axes");
}

/// Squeeze-and-excitation blocks, pooling and channel concatenation between
/// channel-blocked convolutions: the plane mean reads a blocked value into a plain
/// `[n, c, 1, 1]`, the gate's multiply folds into the next 1x1 convolution as its
/// input prologue (applied to a blocked copy), and max and average pools and a
/// concatenation of whole blocks keep the layout.
#[test]
fn squeeze_excitation_pools_and_concatenation_on_blocked_values_match() {
    let mut rng = Rng(0x5e5e);
    let mut blocked: HashMap<String, usize> = HashMap::new();
    for case in 0..8 {
        let n = 1 + rng.below(2);
        let (c, e) = (16 * (1 + rng.below(3)), 16 * (2 + rng.below(3)));
        let (h, w) = (6 + rng.below(10), 6 + rng.below(10));
        let g = Graph::new("squeeze and excitation");
        let x = g.input("x", Shape::new(&[n, c, h, w], DType::F32)).unwrap();
        let param =
            |name: &str, dims: &[usize]| g.param(name, Shape::new(dims, DType::F32)).unwrap();
        // Weights scaled by 1 / sqrt(fan-in), as models initialize them: with
        // uniform [-1, 1] weights the values grew through six layers until f32
        // rounding of their sums (the plain kernels' as much as the blocked ones')
        // reached the tolerance on outputs near zero.
        let one = |g: &Graph, x, name: &str, cin: usize, cout: usize| {
            let wt = g
                .param(name, Shape::new(&[cout, cin, 1, 1], DType::F32))
                .unwrap();
            let scale = g.scalar(1.0 / (cin as f64).sqrt(), DType::F32);
            let wt = g.mul(wt, scale).unwrap();
            g.conv2d(x, wt, None, [1, 1], [0; 4], [1, 1], 1).unwrap()
        };
        let expand = one(&g, x, "w1", c, e);
        let expand = g.silu(expand).unwrap();
        let dw = g
            .conv2d(
                expand,
                param("wd", &[e, 1, 3, 3]),
                Some(param("bd", &[e])),
                [1, 1],
                [1; 4],
                [1, 1],
                e,
            )
            .unwrap();
        let dw = g.silu(dw).unwrap();
        // The squeeze and the excitation, as exporters write them.
        let squeezed = g.mean(dw, &[2, 3], true).unwrap();
        let reduced = one(&g, squeezed, "wr", e, 8);
        let reduced = g.relu(reduced).unwrap();
        let gate = one(&g, reduced, "we", 8, e);
        let gate = g.unary(UnaryOp::Sigmoid, gate).unwrap();
        let excited = g.mul(dw, gate).unwrap();
        let project = one(&g, excited, "w2", e, c);
        let pooled = if rng.below(2) == 0 {
            g.max_pool2d(project, [3, 3], [2, 2], [1; 4]).unwrap()
        } else {
            g.avg_pool2d(project, [2, 2], [2, 2], [0, 0, 1, 1], rng.below(2) == 0)
                .unwrap()
        };
        let branch = one(&g, pooled, "w3", c, 16);
        let joined = g.concat(&[pooled, branch], 1).unwrap();
        let out = one(&g, joined, "w4", c + 16, 8);
        g.set_outputs(vec![out]);
        check(
            &g,
            &mut rng,
            &format!("case {case} x[{n},{c},{h},{w}] e{e}"),
        );
        count_blocked_kinds(&g, &mut blocked);
    }
    if blocks_enabled() {
        // Every kind of step ran blocked somewhere: the convolutions, the pools, the
        // plane mean, the concatenation and the gate's multiply where it did not fold
        // (a gate per image).
        for kind in [
            "blocked-pointwise",
            "blocked-depthwise",
            "blocked",
            "blocked-rows",
            "blocked-region1",
        ] {
            assert!(blocked.contains_key(kind), "no {kind} step: {blocked:?}");
        }
    }
}

#[test]
fn stems_and_fire_modules_on_blocked_values_match() {
    let mut rng = Rng(0xf12e);
    let mut blocked: HashMap<String, usize> = HashMap::new();
    for case in 0..8 {
        let n = 1 + rng.below(2);
        let (h, w) = (9 + rng.below(16), 9 + rng.below(16));
        let stem = [16, 24][rng.below(2)];
        let squeeze = [8, 16][rng.below(2)];
        let e = [16, 32][rng.below(2)];
        let g = Graph::new("stem and fire module");
        let x = g.input("x", Shape::new(&[n, 3, h, w], DType::F32)).unwrap();
        let conv = |g: &Graph, x, name: &str, sizes: [usize; 3], (stride, pad, dil)| {
            scaled_conv(g, x, name, sizes, [stride, pad, dil])
        };
        let k = [3, 7][rng.below(2)];
        let y = conv(&g, x, "stem", [3, stem, k], (2, k / 2, 1));
        let y = g.relu(y).unwrap();
        // Ceil-mode pooling, as exporters write it: padding on the far side only.
        let y = g.max_pool2d(y, [3, 3], [2, 2], [0, 0, 1, 1]).unwrap();
        let s = conv(&g, y, "squeeze", [stem, squeeze, 1], (1, 0, 1));
        let s = g.relu(s).unwrap();
        let e1 = conv(&g, s, "expand1", [squeeze, e, 1], (1, 0, 1));
        let e1 = g.relu(e1).unwrap();
        let e3 = conv(&g, s, "expand3", [squeeze, e, 3], (1, 1, 1));
        let e3 = g.relu(e3).unwrap();
        let joined = g.concat(&[e1, e3], 1).unwrap();
        // A batch norm and ReLU before a 3x3 convolution (DenseNet's order), then a
        // strided 1x1 one.
        let bn_scale = g
            .param("bn.scale", Shape::new(&[1, 2 * e, 1, 1], DType::F32))
            .unwrap();
        let bn_shift = g
            .param("bn.shift", Shape::new(&[1, 2 * e, 1, 1], DType::F32))
            .unwrap();
        let normed = g.add(g.mul(joined, bn_scale).unwrap(), bn_shift).unwrap();
        let normed = g.relu(normed).unwrap();
        let dil = 1 + rng.below(2);
        let z = conv(&g, normed, "dense", [2 * e, 16, 3], (1, dil, dil));
        let out = conv(&g, z, "shortcut", [16, 16, 1], (2, 0, 1));
        g.set_outputs(vec![out]);
        check(
            &g,
            &mut rng,
            &format!("case {case} x[{n},3,{h},{w}] stem{stem} k{k} s{squeeze} e{e} d{dil}"),
        );
        count_blocked_kinds(&g, &mut blocked);
    }
    if blocks_enabled() {
        for kind in [
            "blocked-direct",
            "blocked-pointwise",
            "blocked",
            "blocked-rows",
        ] {
            assert!(blocked.contains_key(kind), "no {kind} step: {blocked:?}");
        }
        assert!(
            blocked["blocked-direct"] >= 16,
            "too few blocked direct convolutions: {blocked:?}"
        );
    }
}

#[test]
fn residual_blocks_of_winograd_convolutions_on_blocked_values_match() {
    let mut rng = Rng(0x3a3a);
    let mut blocked: HashMap<String, usize> = HashMap::new();
    for case in 0..4 {
        let n = 1 + rng.below(2);
        let (h, w) = (16 + rng.below(9), 16 + rng.below(9));
        let c = [64, 72][rng.below(2)];
        let g = Graph::new("residual block");
        let x = g.input("x", Shape::new(&[n, c, h, w], DType::F32)).unwrap();
        let conv = |g: &Graph, x, name: &str, sizes: [usize; 3]| {
            scaled_conv(g, x, name, sizes, [1, sizes[2] / 2, 1])
        };
        let a = conv(&g, x, "reduce", [c, 64, 1]);
        let a = g.relu(a).unwrap();
        let b = conv(&g, a, "first", [64, 64, 3]);
        let b = g.relu(b).unwrap();
        let b = conv(&g, b, "second", [64, 64, 3]);
        let b = g.relu(g.add(b, a).unwrap()).unwrap();
        let out = conv(&g, b, "project", [64, 32, 1]);
        g.set_outputs(vec![out]);
        check(&g, &mut rng, &format!("case {case} x[{n},{c},{h},{w}]"));
        count_blocked_kinds(&g, &mut blocked);
    }
    let winograd = rlx::ir::env::Switch::Winograd.enabled();
    if blocks_enabled() && winograd {
        assert!(
            blocked.get("blocked-winograd").copied().unwrap_or(0) >= 8,
            "too few blocked Winograd convolutions: {blocked:?}"
        );
    }
}

/// Adds to `into` how many steps of each blocked kernel kind (`cpu.<kind>.…`) the
/// CPU runs `g` with.
fn count_blocked_kinds(g: &Graph, into: &mut HashMap<String, usize>) {
    let kernels = Session::new(Device::Cpu).compile(g).unwrap().kernels();
    for (_, k) in kernels.iter().filter(|(_, k)| k.contains("blocked")) {
        *into
            .entry(k.split('.').nth(1).unwrap_or("").to_string())
            .or_insert(0) += 1;
    }
}

/// A biased convolution of `x` by `cout` filters of `cin x k x k` (stride, padding on
/// every side and dilation as given), its weights scaled by 1 / sqrt(fan-in) as
/// models initialize them (uniform [-1, 1] weights grew through a few layers until
/// f32 rounding reached the tolerance on outputs near zero).
fn scaled_conv(
    g: &Graph,
    x: NodeId,
    name: &str,
    [cin, cout, k]: [usize; 3],
    [stride, pad, dil]: [usize; 3],
) -> NodeId {
    let wt = g
        .param(name, Shape::new(&[cout, cin, k, k], DType::F32))
        .unwrap();
    let scale = g.scalar(1.0 / ((cin * k * k) as f64).sqrt(), DType::F32);
    let wt = g.mul(wt, scale).unwrap();
    let bias = g
        .param(format!("{name}.b"), Shape::new(&[cout], DType::F32))
        .unwrap();
    g.conv2d(x, wt, Some(bias), [stride, stride], [pad; 4], [dil, dil], 1)
        .unwrap()
}

/// Whether the CPU keeps values channel-blocked here: AVX-512, and not turned off
/// with `RLX_CHANNEL_BLOCKS=0`.
fn blocks_enabled() -> bool {
    rlx::cpu::isa::isa().avx512f && rlx::ir::env::Switch::ChannelBlocks.enabled()
}
