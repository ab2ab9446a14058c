//! Sizes from a model are checked, never trusted: a shape whose element or byte count
//! overflows, a size past `isize::MAX`, an allocation the machine cannot back and a
//! value placed outside its region are each an `rlx::Error` (never a panic or an
//! abort), and the builder, the session and the compiled graph stay usable afterwards.

use rlx::opt::{PlanOptions, plan_graph};
use rlx::prelude::*;
use std::sync::Arc;

/// `f32[1 << 32, 1 << 32]`: 2^64 elements, more than `usize` counts.
fn overflowing() -> Shape {
    Shape::new(&[1 << 32, 1 << 32], DType::F32)
}

/// `f32[1 << 60]`: 2^62 bytes, a valid size that no allocator can back.
fn unallocatable() -> Shape {
    Shape::new(&[1 << 60], DType::F32)
}

/// Adds `x: f32[3]` and outputs `x + x`, then checks it compiles and runs.
fn finish_and_run(g: &Graph) {
    let x = g.input("x", Shape::new(&[3], DType::F32)).unwrap();
    let y = g.add(x, x).unwrap();
    g.set_outputs(vec![y]);
    let mut c = Session::new(Device::Cpu).compile(g).unwrap();
    assert_eq!(
        c.run(&[("x", &[1.0, 2.0, 3.0])]).unwrap(),
        vec![vec![2.0, 4.0, 6.0]]
    );
}

fn small_graph() -> Graph {
    let g = Graph::new("small");
    finish_and_run(&g);
    g
}

#[test]
fn overflowing_input_is_an_error_and_the_builder_stays_usable() {
    let g = Graph::new("g");
    let err = g.input("x", overflowing()).unwrap_err();
    assert_eq!(
        err,
        Error::SizeOverflow {
            context: "input 'x'".into(),
            what: "f32[4294967296, 4294967296]".into(),
        }
    );
    assert!(
        err.to_string().contains("needs more than isize::MAX bytes"),
        "{err}"
    );
    // Nothing was added: the name is still free and the graph builds and runs.
    assert!(g.is_empty());
    finish_and_run(&g);
}

#[test]
fn size_past_isize_max_is_an_error() {
    let g = Graph::new("g");
    // 2^63 bytes: fits in usize, but no allocation may be larger than isize::MAX.
    let past = Shape::new(&[1 << 61], DType::F32);
    assert_eq!(past.checked_byte_size(), Some(1 << 63));
    let err = g.param("w", past).unwrap_err();
    assert!(
        matches!(&err, Error::SizeOverflow { context, .. } if context == "param 'w'"),
        "{err}"
    );
    // An empty tensor whose other dimensions would overflow a stride.
    let strides = Shape::new(&[0, 1 << 40, 1 << 40], DType::F32);
    assert!(g.input("e", strides).is_err());
    // Constants are checked the same way, before their data is compared.
    assert!(matches!(
        g.constant(TensorData::F32(vec![]), &[0, 1 << 40, 1 << 40]),
        Err(Error::SizeOverflow { .. })
    ));
    assert!(g.is_empty());
    finish_and_run(&g);
}

#[test]
fn ops_whose_output_is_too_large_are_errors() {
    let g = Graph::new("g");
    let col = g
        .input("col", Shape::new(&[1 << 31, 1], DType::F32))
        .unwrap();
    let row = g
        .input("row", Shape::new(&[1, 1 << 31], DType::F32))
        .unwrap();
    let before = g.len();
    // 2^62 elements of 4 bytes: the byte count overflows.
    let err = g.matmul(col, row).unwrap_err();
    assert!(
        matches!(&err, Error::SizeOverflow { context, what }
            if context == "matmul" && what == "f32[2147483648, 2147483648]"),
        "{err}"
    );
    assert!(matches!(g.add(col, row), Err(Error::SizeOverflow { .. })));
    assert!(g.expand(col, &[1 << 40, 1 << 31, 1]).is_err());
    // Attribute arithmetic that would wrap is an error too.
    assert!(matches!(
        g.tile(col, &[usize::MAX, 1]),
        Err(Error::SizeOverflow { .. })
    ));
    assert!(matches!(
        g.pad(
            col,
            &[(usize::MAX, 1), (0, 0)],
            PadMode::Constant(rlx::ir::F64Bits::new(0.0))
        ),
        Err(Error::SizeOverflow { .. })
    ));
    // 2^33 elements along one axis still fit.
    let wide = g.concat(&[row, row, row, row], 1).unwrap();
    assert_eq!(g.shape(wide).unwrap().dims(), &[1, 1 << 33]);
    assert!(g.reshape(col, &[usize::MAX, 2]).is_err());
    assert!(matches!(
        g.reshape_infer(col, &[isize::MAX, 4, -1]),
        Err(Error::SizeOverflow { .. })
    ));
    // Only the concat was added; the inputs are still usable.
    assert_eq!(g.len(), before + 1);
    let s = g.sum(col, &[0], false).unwrap();
    assert_eq!(g.shape(s).unwrap().dims(), &[1]);
}

#[test]
fn verify_rejects_stored_shapes_that_overflow() {
    // A graph assembled from parts (as passes do) bypasses the builder's checks;
    // the verifier, which every compile runs, catches the shape.
    let node = rlx::ir::Node {
        op: rlx::ir::Op::Input { name: "x".into() },
        inputs: vec![],
        shape: overflowing(),
    };
    let g = Graph::from_parts("parts", vec![node], vec![NodeId::from_index(0)], vec![]);
    assert!(matches!(g.verify(), Err(Error::SizeOverflow { .. })));
    let session = Session::new(Device::Cpu);
    assert!(matches!(
        session.compile(&g),
        Err(Error::SizeOverflow { .. })
    ));
    // The session still compiles a valid graph.
    small_graph();
}

#[test]
fn unallocatable_param_is_out_of_memory_naming_it() {
    let g = Graph::new("g");
    let w = g.param("w", unallocatable()).unwrap();
    let x = g.input("x", Shape::new(&[1], DType::F32)).unwrap();
    let y = g.add(x, x).unwrap();
    g.set_outputs(vec![y]);
    let _ = w;
    let session = Session::new(Device::Cpu);
    let err = session.compile(&g).unwrap_err();
    assert_eq!(
        err,
        Error::OutOfMemory {
            tensor: "param 'w'".into(),
            bytes: 1 << 62,
        }
    );
    assert!(
        err.to_string()
            .contains("cannot allocate 4611686018427387904 bytes for param 'w'"),
        "{err}"
    );
    // The same session compiles and runs a graph that fits.
    let ok = Graph::new("ok");
    finish_and_run(&ok);
    let mut c = session.compile(&ok).unwrap();
    assert_eq!(c.run(&[("x", &[0.5; 3])]).unwrap(), vec![vec![1.0; 3]]);
}

#[test]
fn unallocatable_arena_and_handle_are_out_of_memory() {
    // An input lives in the arena.
    let g = Graph::new("g");
    let x = g.input("x", unallocatable()).unwrap();
    g.set_outputs(vec![g.neg(x).unwrap()]);
    let err = Session::new(Device::Cpu).compile(&g).unwrap_err();
    assert!(
        matches!(&err, Error::OutOfMemory { tensor, bytes } if tensor == "arena" && *bytes >= 1 << 62),
        "{err}"
    );

    // A handle has its own buffer.
    let g = Graph::new("kv");
    let cache = g.input("cache", unallocatable()).unwrap();
    let out = g.slice(cache, 0, 0, 4, 1).unwrap();
    g.set_outputs(vec![g.neg(out).unwrap()]);
    let kv = BufferHandle::new("cache", &[1 << 60], DType::F32);
    let err = Session::new(Device::Cpu)
        .compile_with(&g, &CompileOptions::new().bind_handle(&kv))
        .unwrap_err();
    assert_eq!(
        err,
        Error::OutOfMemory {
            tensor: "handle 'cache'".into(),
            bytes: 1 << 62,
        }
    );
    small_graph();
}

#[test]
fn arena_past_isize_max_is_a_plan_error() {
    // Three inputs of 2^62 bytes, all live while the sum runs: 3 * 2^62 bytes.
    let g = Graph::new("g");
    let xs: Vec<NodeId> = (0..3)
        .map(|i| g.input(format!("x{i}"), unallocatable()).unwrap())
        .collect();
    let s = g.add(g.add(xs[0], xs[1]).unwrap(), xs[2]).unwrap();
    g.set_outputs(vec![s]);
    let err = Session::new(Device::Cpu).compile(&g).unwrap_err();
    assert!(
        matches!(&err, Error::SizeOverflow { context, .. } if context == "memory plan"),
        "{err}"
    );
    small_graph();
}

#[test]
fn values_outside_their_region_are_refused_when_the_program_is_built() {
    let g = Graph::new("g");
    let x = g.input("x", Shape::new(&[4], DType::F32)).unwrap();
    let w = g.param("w", Shape::new(&[4], DType::F32)).unwrap();
    let y = g.mul(x, w).unwrap();
    g.set_outputs(vec![g.exp(y).unwrap()]);
    let plan = plan_graph(&g, &PlanOptions::default()).unwrap();
    assert!(rlx::cpu::CpuProgram::new(Arc::new(plan.clone()), 1).is_ok());

    // The output moved past the end of the arena.
    let mut bad = plan.clone();
    let out = bad.outputs[0].index();
    bad.locations[out].offset = bad.stats.arena_bytes - 4;
    let err = rlx::cpu::CpuProgram::new(Arc::new(bad), 1).err().unwrap();
    assert!(
        matches!(&err, Error::InvalidGraph { message, .. } if message.contains("outside the region")),
        "{err}"
    );

    // The param read one element past its buffer.
    let mut bad = plan.clone();
    bad.locations[w.index()].offset = 4;
    assert!(rlx::cpu::CpuProgram::new(Arc::new(bad), 1).is_err());

    // An offset so large that offset + size wraps.
    let mut bad = plan;
    bad.locations[x.index()].offset = usize::MAX - 2;
    assert!(rlx::cpu::CpuProgram::new(Arc::new(bad), 1).is_err());
}
