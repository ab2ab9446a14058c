//! The runtime API end to end on the CPU: results, state, typed data, and errors that
//! leave the compiled graph usable.

use rlx::half::{bf16, f16};
use rlx::prelude::*;

fn gelu(x: f64) -> f64 {
    // Independent of the library: Abramowitz-Stegun is not exact enough, so use the
    // series-free identity erf(x) = 2/sqrt(pi) * integral, evaluated numerically.
    let t = x / std::f64::consts::SQRT_2;
    let steps = 20_000;
    let h = t / steps as f64;
    let integral: f64 = (0..steps)
        .map(|i| (-(((i as f64) + 0.5) * h).powi(2)).exp() * h)
        .sum();
    0.5 * x * (1.0 + 2.0 / std::f64::consts::PI.sqrt() * integral)
}

fn mlp() -> Graph {
    let g = Graph::new("mlp");
    let x = g.input("x", Shape::new(&[2, 4], DType::F32)).unwrap();
    let w = g.param("w", Shape::new(&[4, 3], DType::F32)).unwrap();
    let b = g.param("b", Shape::new(&[3], DType::F32)).unwrap();
    let h = g.matmul(x, w).unwrap();
    let y = g.gelu(g.add(h, b).unwrap()).unwrap();
    g.set_outputs(vec![y]);
    g
}

const W: [f32; 12] = [1., 0., 0., 0., 1., 0., 0., 0., 1., 0., 0., 0.];
const B: [f32; 3] = [0.1, 0.2, 0.3];
const X: [f32; 8] = [1.4, -0.7, -0.3, 5.0, 0.0, 0.0, 0.0, 1.0];

fn compiled_mlp() -> CompiledGraph {
    let mut c = Session::new(Device::Cpu).compile(mlp()).unwrap();
    c.set_param("w", &W).unwrap();
    c.set_param("b", &B).unwrap();
    c
}

#[test]
fn matmul_bias_gelu_end_to_end() {
    let mut c = compiled_mlp();
    let out = c.run(&[("x", &X)]).unwrap();
    assert_eq!(out.len(), 1);
    let y = &out[0];
    assert!((y[0] - 1.399).abs() < 0.01, "gelu(1.5) = {}", y[0]);
    assert!((y[1] + 0.154).abs() < 0.01, "gelu(-0.5) = {}", y[1]);
    assert!(y[2].abs() < 0.01, "gelu(0) = {}", y[2]);
    assert!((y[0] as f64 - gelu(1.5)).abs() < 1e-5);
    let zeros = c.run(&[("x", &[0.0; 8])]).unwrap();
    for (j, &bj) in B.iter().enumerate() {
        assert!((zeros[0][j] as f64 - gelu(bj as f64)).abs() < 1e-6);
        assert!((zeros[0][3 + j] as f64 - gelu(bj as f64)).abs() < 1e-6);
    }
}

#[test]
fn run_variants_agree() {
    let mut c = compiled_mlp();
    let expected = c.run(&[("x", &X)]).unwrap();
    let mut buf = vec![0f32; 6];
    c.run_read_outputs(&[("x", &X)], &mut [&mut buf]).unwrap();
    assert_eq!(buf, expected[0]);
    let slots = c.run_slots(&[&X]).unwrap();
    assert_eq!(slots.len(), 1);
    assert_eq!(slots.get(0).unwrap(), expected[0].as_slice());
    let off = slots.offset(0).unwrap();
    let ptr = slots.arena_ptr().unwrap();
    // SAFETY: offset and length come from the plan for this output.
    let raw = unsafe { std::slice::from_raw_parts(ptr.add(off).cast::<f32>(), 6) };
    assert_eq!(raw, expected[0].as_slice());
    let raw = c
        .run_raw(&[("x", &rlx::driver::convert::f32_to_vec(&X, DType::F32))])
        .unwrap();
    assert_eq!(
        rlx::driver::convert::bytes_to_f32_vec(&raw[0], DType::F32).unwrap(),
        expected[0]
    );
    let mut row = [0f32; 3];
    c.read_output_row(0, 1, &mut row).unwrap();
    assert_eq!(row, expected[0][3..6]);
    assert!(c.read_output_row(0, 2, &mut row).is_err());
    assert!(c.read_output_row(0, 0, &mut [0f32; 2]).is_err());
    // Pipelined: each call returns the previous run's outputs.
    assert!(c.run_pipelined(&[("x", &X)]).unwrap().is_none());
    let prev = c.run_pipelined(&[("x", &[0.0; 8])]).unwrap().unwrap();
    assert_eq!(prev, expected);
    c.sync_pending().unwrap();
    let zeros = c.read_outputs().unwrap();
    assert!((zeros[0][0] as f64 - gelu(0.1)).abs() < 1e-6);
    c.commit_no_wait(&[("x", &X)]).unwrap();
    assert!(
        c.commit_no_wait(&[("x", &X)]).is_err(),
        "second commit before sync is refused"
    );
    c.sync_pending().unwrap();
    assert_eq!(c.read_outputs().unwrap(), expected);
    assert_eq!(c.device(), Device::Cpu);
}

#[test]
fn clones_are_independent() {
    let mut a = compiled_mlp();
    let mut b = a.clone();
    b.set_param("b", &[0.0, 0.0, 0.0]).unwrap();
    let ya = a.run(&[("x", &[0.0; 8])]).unwrap();
    let yb = b.run(&[("x", &[0.0; 8])]).unwrap();
    assert!((ya[0][0] as f64 - gelu(0.1)).abs() < 1e-6);
    assert_eq!(yb[0][0], 0.0);
}

#[test]
fn bad_input_is_an_error_and_nothing_changes() {
    let mut c = compiled_mlp();
    let good = c.run(&[("x", &X)]).unwrap();

    let e = c.run(&[("y", &X)]).unwrap_err();
    assert!(
        matches!(&e, Error::UnknownName { kind: "input", name, .. } if name == "y"),
        "{e}"
    );
    assert!(
        e.to_string().contains("unknown input 'y'") && e.to_string().contains("x"),
        "{e}"
    );

    let e = c.run(&[("x", &[1.0; 7])]).unwrap_err();
    assert!(
        matches!(
            e,
            Error::LengthMismatch {
                expected: 8,
                got: 7,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("input 'x'"), "{e}");

    let e = c.run(&[]).unwrap_err();
    assert!(
        matches!(&e, Error::MissingInput { name, .. } if name == "x"),
        "{e}"
    );

    let e = c.run(&[("x", &X), ("x", &X)]).unwrap_err();
    assert!(matches!(e, Error::DuplicateName { .. }), "{e}");

    let e = c.run_slots(&[&X[..4]]).unwrap_err();
    assert!(matches!(e, Error::LengthMismatch { .. }), "{e}");

    let halfs = vec![f16::ZERO; 8];
    let e = c.run_typed(&[("x", TensorRef::F16(&halfs))]).unwrap_err();
    assert!(
        matches!(
            e,
            Error::DTypeMismatch {
                got: DType::F16,
                ..
            }
        ),
        "{e}"
    );
    assert!(e.to_string().contains("expected dtype f32, got f16"), "{e}");

    let e = c.set_param("nope", &W).unwrap_err();
    assert!(
        matches!(&e, Error::UnknownName { kind: "param", .. }),
        "{e}"
    );
    let e = c.set_param("w", &W[..11]).unwrap_err();
    assert!(
        matches!(
            e,
            Error::LengthMismatch {
                expected: 12,
                got: 11,
                ..
            }
        ),
        "{e}"
    );
    let e = c
        .set_param_typed("b", TensorRef::BF16(&[bf16::ONE; 3]))
        .unwrap_err();
    assert!(matches!(e, Error::DTypeMismatch { .. }), "{e}");

    let mut buf = vec![0f32; 5];
    let e = c
        .run_read_outputs(&[("x", &X)], &mut [&mut buf])
        .unwrap_err();
    assert!(matches!(e, Error::LengthMismatch { .. }), "{e}");

    // Nothing was written: the last good outputs are intact and the params unchanged.
    assert_eq!(c.read_outputs().unwrap(), good);
    assert_eq!(c.run(&[("x", &X)]).unwrap(), good);
}

#[test]
fn running_before_params_are_set_is_an_error() {
    let mut c = Session::new(Device::Cpu).compile(mlp()).unwrap();
    c.set_param("w", &W).unwrap();
    let e = c.run(&[("x", &X)]).unwrap_err();
    assert!(
        matches!(&e, Error::ParamNotSet { name, .. } if name == "b"),
        "{e}"
    );
    assert!(e.to_string().contains("param 'b'"), "{e}");
    assert!(c.read_outputs().is_err(), "no run has happened");
    c.set_param("b", &B).unwrap();
    let y = c.run(&[("x", &X)]).unwrap();
    assert!((y[0][0] - 1.3998).abs() < 1e-3);
}

#[test]
fn shape_mismatch_at_build_time_names_op_and_shapes() {
    let g = Graph::new("bad");
    let a = g.input("a", Shape::new(&[2, 3], DType::F32)).unwrap();
    let b = g.input("b", Shape::new(&[4, 5], DType::F32)).unwrap();
    let e = g.matmul(a, b).unwrap_err();
    assert!(
        matches!(&e, Error::ShapeMismatch { op, .. } if op == "matmul"),
        "{e}"
    );
    let msg = e.to_string();
    assert!(
        msg.contains("f32[2, 3]") && msg.contains("f32[4, 5]"),
        "{msg}"
    );
    let e = g.add(a, b).unwrap_err();
    assert!(e.to_string().starts_with("add:"), "{e}");
    // The graph is still usable after rejected builder calls.
    let c = g.add(a, a).unwrap();
    g.set_outputs(vec![c]);
    let mut compiled = Session::new(Device::Cpu).compile(&g).unwrap();
    let out = compiled
        .run(&[("a", &[1., 2., 3., 4., 5., 6.]), ("b", &[0.0; 20])])
        .unwrap();
    assert_eq!(out[0], vec![2., 4., 6., 8., 10., 12.]);
}

#[test]
fn invalid_graphs_and_devices_are_errors() {
    let g = Graph::new("dup");
    let a = g.input("a", Shape::new(&[2], DType::F32)).unwrap();
    let _ = g.input("a", Shape::new(&[2], DType::F32)).unwrap();
    g.set_outputs(vec![a]);
    let e = Session::new(Device::Cpu).compile(&g).unwrap_err();
    assert!(
        matches!(e, Error::InvalidGraph { .. }) && e.to_string().contains("'a'"),
        "{e}"
    );
    let g = Graph::new("no outputs");
    let _ = g.input("a", Shape::new(&[2], DType::F32)).unwrap();
    assert!(Session::new(Device::Cpu).compile(&g).is_err());
    let g = mlp();
    let e = Session::new(Device::Tpu).compile(&g).unwrap_err();
    assert!(matches!(e, Error::DeviceUnavailable { .. }), "{e}");
    let e = g.exp(rlx::NodeId::from_index(1000)).unwrap_err();
    assert!(
        matches!(e, Error::InvalidGraph { .. }) && e.to_string().contains("%1000"),
        "{e}"
    );
}

fn kv_graph(rows: usize, dim: usize) -> Graph {
    let g = Graph::new("kv");
    let cache = g
        .input("cache", Shape::new(&[rows, dim], DType::F32))
        .unwrap();
    let row = g.input("row", Shape::new(&[1, dim], DType::F32)).unwrap();
    let pos = g.input("pos", Shape::new(&[1], DType::I64)).unwrap();
    let updated = g.write_at(cache, row, pos, 0).unwrap();
    let total = g.sum(updated, &[0], false).unwrap();
    g.set_outputs(vec![total]);
    g
}

#[test]
fn kv_cache_handle_accumulates_rows() {
    let (n, dim) = (6, 4);
    let kv = BufferHandle::new("cache", &[n, dim], DType::F32);
    let opts = CompileOptions::new().bind_handle(&kv);
    let mut c = Session::new(Device::Cpu)
        .compile_with(kv_graph(n, dim), &opts)
        .unwrap();
    assert_eq!(
        c.inputs()
            .iter()
            .map(|(n, _)| n.as_str())
            .collect::<Vec<_>>(),
        ["row", "pos"]
    );
    let mut expected = vec![0f32; n * dim];
    for step in 0..n {
        let row: Vec<f32> = (0..dim).map(|j| (step * 10 + j) as f32).collect();
        let out = c.run(&[("row", &row), ("pos", &[step as f32])]).unwrap();
        expected[step * dim..(step + 1) * dim].copy_from_slice(&row);
        let col_sums: Vec<f32> = (0..dim)
            .map(|j| (0..n).map(|r| expected[r * dim + j]).sum())
            .collect();
        assert_eq!(
            out[0], col_sums,
            "the graph reads the updated cache in the same run"
        );
    }
    assert_eq!(c.read_handle("cache").unwrap(), expected);

    // A position past the end is a run-time error that writes nothing.
    let e = c
        .run(&[("row", &[9.0; 4]), ("pos", &[n as f32])])
        .unwrap_err();
    assert!(matches!(e, Error::Runtime { .. }), "{e}");
    assert_eq!(c.read_handle("cache").unwrap(), expected);
    // Passing the handle as an input is refused.
    assert!(
        c.run(&[("row", &[0.0; 4]), ("pos", &[0.0]), ("cache", &[0.0; 24])])
            .is_err()
    );

    // Rebinding resets it; wrong shapes and names are refused.
    let wrong = BufferHandle::new("cache", &[n + 1, dim], DType::F32);
    let e = c.bind_handle(&wrong).unwrap_err();
    assert!(
        matches!(e, Error::ShapeMismatch { .. }) && e.to_string().contains("cache"),
        "{e}"
    );
    assert_eq!(
        c.read_handle("cache").unwrap(),
        expected,
        "a rejected bind changes nothing"
    );
    assert!(matches!(
        c.bind_handle(&BufferHandle::new("kv", &[n, dim], DType::F32)),
        Err(Error::UnknownName { kind: "handle", .. })
    ));
    c.bind_handle(&kv).unwrap();
    assert_eq!(c.read_handle("cache").unwrap(), vec![0.0; n * dim]);
    c.write_handle("cache", &expected).unwrap();
    assert_eq!(c.read_handle("cache").unwrap(), expected);
    assert!(c.write_handle("cache", &expected[1..]).is_err());

    // Binding a handle of the wrong size at compile time is an error.
    let e = Session::new(Device::Cpu)
        .compile_with(kv_graph(n, dim), &CompileOptions::new().bind_handle(&wrong))
        .unwrap_err();
    assert!(matches!(e, Error::ShapeMismatch { .. }), "{e}");
    let e = Session::new(Device::Cpu)
        .compile_with(
            kv_graph(n, dim),
            &CompileOptions::new().bind_handle(&BufferHandle::new("nope", &[1], DType::F32)),
        )
        .unwrap_err();
    assert!(matches!(e, Error::UnknownName { .. }), "{e}");
    // write_at into an input that is not a handle is refused at compile time.
    let e = Session::new(Device::Cpu)
        .compile(kv_graph(n, dim))
        .unwrap_err();
    assert!(e.to_string().contains("handle"), "{e}");
}

#[test]
fn f16_and_bf16_round_trip_exactly() {
    for dtype in [DType::F16, DType::BF16] {
        let g = Graph::new("typed");
        let x = g.input("x", Shape::new(&[4], dtype)).unwrap();
        let w = g.param("w", Shape::new(&[4], dtype)).unwrap();
        let y = g.mul(x, w).unwrap();
        let w_out = g.reshape(w, &[2, 2]).unwrap();
        g.set_outputs(vec![y, w_out]);
        let mut c = Session::new(Device::Cpu).compile(&g).unwrap();
        let wv = [1.5f32, -2.0, 0.25, 3.0];
        let xv = [2.0f32, 0.5, 4.0, -1.0];
        let product = [3.0f32, -1.0, 1.0, -3.0];
        let out = if dtype == DType::F16 {
            let w16: Vec<f16> = wv.iter().map(|&v| f16::from_f32(v)).collect();
            let x16: Vec<f16> = xv.iter().map(|&v| f16::from_f32(v)).collect();
            c.set_param_typed("w", TensorRef::F16(&w16)).unwrap();
            let out = c.run_typed(&[("x", TensorRef::F16(&x16))]).unwrap();
            assert_eq!(out[1], TensorData::F16(w16));
            out
        } else {
            let w16: Vec<bf16> = wv.iter().map(|&v| bf16::from_f32(v)).collect();
            let x16: Vec<bf16> = xv.iter().map(|&v| bf16::from_f32(v)).collect();
            c.set_param_typed("w", TensorRef::BF16(&w16)).unwrap();
            let out = c.run_typed(&[("x", TensorRef::BF16(&x16))]).unwrap();
            assert_eq!(out[1], TensorData::BF16(w16));
            out
        };
        assert_eq!(out[0], TensorData::from_f64(dtype, &product.map(f64::from)));
        // f32 entry points convert to and from the stored dtype.
        let f = c.run(&[("x", &xv)]).unwrap();
        assert_eq!(f[0], product);
        // A value that is not representable rounds to nearest.
        c.set_param("w", &[0.1, 1.0, 1.0, 1.0]).unwrap();
        let f = c.run(&[("x", &[1.0, 0.0, 0.0, 0.0])]).unwrap();
        let expect = if dtype == DType::F16 {
            f16::from_f32(0.1).to_f32()
        } else {
            bf16::from_f32(0.1).to_f32()
        };
        assert_eq!(f[0][0], expect);
    }
}

#[test]
fn runtime_errors_leave_the_graph_usable() {
    let g = Graph::new("gather");
    let table = g.param("table", Shape::new(&[5, 2], DType::F32)).unwrap();
    let ids = g.input("ids", Shape::new(&[3], DType::I32)).unwrap();
    let rows = g.gather(table, ids, 0).unwrap();
    g.set_outputs(vec![rows]);
    let mut c = Session::new(Device::Cpu).compile(&g).unwrap();
    let t: Vec<f32> = (0..10).map(|v| v as f32).collect();
    c.set_param("table", &t).unwrap();
    let e = c.run(&[("ids", &[0.0, 5.0, 1.0])]).unwrap_err();
    assert!(
        matches!(e, Error::Runtime { .. }) && e.to_string().contains("index 5"),
        "{e}"
    );
    let out = c.run(&[("ids", &[4.0, -1.0, 0.0])]).unwrap();
    assert_eq!(out[0], vec![8., 9., 8., 9., 0., 1.]);
}

/// The same two-layer model at batch `rows`: params `w` [4, 3] and `b` [3].
fn mlp_rows(rows: usize) -> Graph {
    let g = Graph::new("mlp_rows");
    let x = g.input("x", Shape::new(&[rows, 4], DType::F32)).unwrap();
    let w = g.param("w", Shape::new(&[4, 3], DType::F32)).unwrap();
    let b = g.param("b", Shape::new(&[3], DType::F32)).unwrap();
    let y = g.add(g.matmul(x, w).unwrap(), b).unwrap();
    g.set_outputs(vec![y]);
    g
}

#[test]
fn graphs_of_one_model_share_params_without_copying() {
    let session = Session::new(Device::Cpu);
    let mut one = session.compile(mlp_rows(1)).unwrap();
    one.set_param("w", &W).unwrap();
    one.set_param("b", &B).unwrap();
    let mut three = session.compile(mlp_rows(3)).unwrap();
    // Before sharing, `three` has no params set.
    assert!(matches!(
        three.run(&[("x", &[0.0; 12])]),
        Err(Error::ParamNotSet { .. })
    ));
    assert_eq!(three.share_params_from(&one).unwrap(), 2);
    let x3 = [1.0, 2.0, 3.0, 4.0, 0.5, 0.0, -1.0, 0.0, 0.0, 0.0, 0.0, 0.0];
    let out = three.run(&[("x", &x3)]).unwrap();
    let expected = [1.1, 2.2, 3.3, 0.6, 0.2, -0.7, 0.1, 0.2, 0.3];
    for (a, b) in out[0].iter().zip(expected) {
        assert!((a - b).abs() < 1e-6, "{:?}", out[0]);
    }
    // Writing a shared param in one graph leaves the other's values alone.
    three.set_param("b", &[0.0; 3]).unwrap();
    let first = one.run(&[("x", &x3[..4])]).unwrap();
    assert_eq!(first[0], vec![1.1, 2.2, 3.3]);
    let second = three.run(&[("x", &x3)]).unwrap();
    assert_eq!(&second[0][..3], &[1.0, 2.0, 3.0]);
}

/// `x [rows, 300] @ w [300, 130] + b` and its `f64` reference.
fn wide_linear(rows: usize) -> Graph {
    let g = Graph::new("wide_linear");
    let x = g.input("x", Shape::new(&[rows, 300], DType::F32)).unwrap();
    let w = g.param("w", Shape::new(&[300, 130], DType::F32)).unwrap();
    let b = g.param("b", Shape::new(&[130], DType::F32)).unwrap();
    g.set_outputs(vec![g.add(g.matmul(x, w).unwrap(), b).unwrap()]);
    g
}

fn wide_linear_reference(x: &[f32], w: &[f32], b: &[f32]) -> Vec<f64> {
    let rows = x.len() / 300;
    let mut out = vec![0.0; rows * 130];
    for i in 0..rows {
        for j in 0..130 {
            out[i * 130 + j] = f64::from(b[j])
                + (0..300)
                    .map(|p| f64::from(x[i * 300 + p]) * f64::from(w[p * 130 + j]))
                    .sum::<f64>();
        }
    }
    out
}

fn assert_close(got: &[f32], want: &[f64], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}");
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        assert!((f64::from(g) - w).abs() < 1e-4, "{what} at {i}: {g} vs {w}");
    }
}

#[test]
fn weights_packed_ahead_follow_every_set_param_and_stay_per_graph() {
    // Matrix products read `w` packed ahead; the packed copy must track each write and,
    // once shared, never leak one graph's write into the other.
    let values = |seed: u32, len: usize| -> Vec<f32> {
        (0..len as u32)
            .map(|i| ((i.wrapping_mul(2654435761) ^ seed) % 1000) as f32 / 500.0 - 1.0)
            .collect()
    };
    let (w1, w2, b) = (values(1, 300 * 130), values(2, 300 * 130), values(3, 130));
    let session = Session::new(Device::Cpu);
    // 5 rows: the few-rows path; 120 rows: the blocked path.
    let mut few = session.compile(wide_linear(5)).unwrap();
    let mut many = session.compile(wide_linear(120)).unwrap();
    let (x5, x120) = (values(4, 5 * 300), values(5, 120 * 300));
    few.set_param("w", &w1).unwrap();
    few.set_param("b", &b).unwrap();
    let out = few.run(&[("x", &x5)]).unwrap();
    assert_close(
        &out[0],
        &wide_linear_reference(&x5, &w1, &b),
        "few rows, w1",
    );
    assert_eq!(many.share_params_from(&few).unwrap(), 2);
    let out = many.run(&[("x", &x120)]).unwrap();
    assert_close(
        &out[0],
        &wide_linear_reference(&x120, &w1, &b),
        "many rows, shared w1",
    );
    // A rejected write leaves the packed weights as they were.
    assert!(few.set_param("w", &w2[..100]).is_err());
    let out = few.run(&[("x", &x5)]).unwrap();
    assert_close(
        &out[0],
        &wide_linear_reference(&x5, &w1, &b),
        "few rows after a bad write",
    );
    // A new value is packed again in the graph written, and only there.
    few.set_param("w", &w2).unwrap();
    let out = few.run(&[("x", &x5)]).unwrap();
    assert_close(
        &out[0],
        &wide_linear_reference(&x5, &w2, &b),
        "few rows, w2",
    );
    let out = many.run(&[("x", &x120)]).unwrap();
    assert_close(
        &out[0],
        &wide_linear_reference(&x120, &w1, &b),
        "many rows, still w1",
    );
}

#[test]
fn sharing_params_of_another_shape_is_an_error_and_changes_nothing() {
    let session = Session::new(Device::Cpu);
    let mut a = session.compile(mlp_rows(1)).unwrap();
    a.set_param("w", &W).unwrap();
    a.set_param("b", &B).unwrap();
    let other = Graph::new("wide");
    let x = other.input("x", Shape::new(&[1, 4], DType::F32)).unwrap();
    let w = other.param("w", Shape::new(&[4, 3], DType::F32)).unwrap();
    let b = other.param("b", Shape::new(&[1, 3], DType::F32)).unwrap();
    other.set_outputs(vec![other.add(other.matmul(x, w).unwrap(), b).unwrap()]);
    let mut wide = session.compile(other).unwrap();
    let err = wide.share_params_from(&a).unwrap_err();
    let text = err.to_string();
    assert!(text.contains("'b'") && text.contains("[1, 3]"), "{text}");
    // Nothing was shared, not even the matching `w`.
    assert!(matches!(
        wide.run(&[("x", &[0.0; 4])]),
        Err(Error::ParamNotSet { .. })
    ));
    // Both graphs still work.
    wide.set_param("w", &W).unwrap();
    wide.set_param("b", &B).unwrap();
    assert_eq!(
        wide.run(&[("x", &[1.0, 0.0, 0.0, 0.0])]).unwrap()[0],
        vec![1.1, 0.2, 0.3]
    );
    assert_eq!(
        a.run(&[("x", &[1.0, 0.0, 0.0, 0.0])]).unwrap()[0],
        vec![1.1, 0.2, 0.3]
    );
}
