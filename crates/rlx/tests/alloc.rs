//! Proves the hot path allocates nothing: a counting global allocator wraps the
//! system one, and `run_slots` / `run_read_outputs` are called many times on a graph
//! that exercises most kernels.

use rlx::prelude::*;
use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicUsize, Ordering};

struct Counting;

static ALLOCATIONS: AtomicUsize = AtomicUsize::new(0);

unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::SeqCst);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.alloc(layout) }
    }
    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.dealloc(ptr, layout) }
    }
    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATIONS.fetch_add(1, Ordering::SeqCst);
        // SAFETY: forwarded unchanged to the system allocator.
        unsafe { System.realloc(ptr, layout, new_size) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

fn model() -> Graph {
    let (s, d, h) = (8usize, 16usize, 4usize);
    let g = Graph::new("alloc");
    let x = g.input("x", Shape::new(&[1, s, d], DType::F32)).unwrap();
    let ids = g.input("ids", Shape::new(&[s], DType::I32)).unwrap();
    let emb = g.param("emb", Shape::new(&[10, d], DType::F32)).unwrap();
    let w = g.param("w", Shape::new(&[d, 3 * d], DType::F32)).unwrap();
    let gamma = g.param("gamma", Shape::new(&[d], DType::F32)).unwrap();
    let beta = g.param("beta", Shape::new(&[d], DType::F32)).unwrap();
    let e = g
        .reshape(g.gather(emb, ids, 0).unwrap(), &[1, s, d])
        .unwrap();
    let x = g.add(x, e).unwrap();
    let n = g.layer_norm(x, gamma, beta, 1e-5).unwrap();
    let qkv = g.matmul(n, w).unwrap();
    let parts = g.split(qkv, -1, &[d, d, d]).unwrap();
    let heads = |t: NodeId| {
        g.permute(g.reshape(t, &[1, s, h, d / h]).unwrap(), &[0, 2, 1, 3])
            .unwrap()
    };
    let a = g
        .attention(
            heads(parts[0]),
            heads(parts[1]),
            heads(parts[2]),
            None,
            true,
            None,
        )
        .unwrap();
    let a = g
        .reshape(g.transpose(a, 1, 2).unwrap(), &[1, s, d])
        .unwrap();
    let y = g.gelu(g.add(a, x).unwrap()).unwrap();
    let r = g.rms_norm(y, gamma, 1e-6).unwrap();
    let p = g.softmax(r, -1).unwrap();
    let m = g.mean(p, &[1], false).unwrap();
    let c = g.concat(&[m, m], 0).unwrap();
    let (top, idx) = g.topk(c, 3, -1, true).unwrap();
    let am = g.argmax(r, -1, false).unwrap();
    let padded = g.pad(top, &[(0, 0), (1, 1)], PadMode::Reflect).unwrap();
    let cs = g.cumsum(padded, 1, false, false).unwrap();
    let mask = g.gt(cs, g.scalar(0.5, DType::F32)).unwrap();
    let sel = g.select(mask, cs, g.neg(cs).unwrap()).unwrap();
    g.set_outputs(vec![
        sel,
        g.cast(idx, DType::F32).unwrap(),
        g.cast(am, DType::F32).unwrap(),
    ]);
    g
}

#[test]
fn run_slots_allocates_nothing_after_the_first_run() {
    let mut c = Session::new(Device::Cpu).compile(model()).unwrap();
    for (name, shape) in c.params() {
        let v: Vec<f32> = (0..shape.num_elements())
            .map(|i| ((i * 7 % 13) as f32 - 6.0) / 10.0)
            .collect();
        c.set_param(&name, &v).unwrap();
    }
    let x: Vec<f32> = (0..8 * 16)
        .map(|i| ((i * 5 % 11) as f32 - 5.0) / 7.0)
        .collect();
    let ids: Vec<f32> = (0..8).map(|i| (i % 10) as f32).collect();
    let inputs: [&[f32]; 2] = [&x, &ids];
    let first: Vec<f32> = c.run_slots(&inputs).unwrap().get(0).unwrap().to_vec();
    let mut out0 = vec![0f32; first.len()];
    let mut out1 = vec![0f32; 6];
    let mut out2 = vec![0f32; 8];

    let before = ALLOCATIONS.load(Ordering::SeqCst);
    let mut checksum = 0.0f32;
    for _ in 0..50 {
        let outs = c.run_slots(&inputs).unwrap();
        checksum += outs.get(0).unwrap()[0] + outs.get(1).unwrap()[0];
        c.run_read_outputs(
            &[("x", &x), ("ids", &ids)],
            &mut [&mut out0, &mut out1, &mut out2],
        )
        .unwrap();
    }
    let after = ALLOCATIONS.load(Ordering::SeqCst);
    assert_eq!(
        after - before,
        0,
        "the hot path allocated {} times",
        after - before
    );
    assert_eq!(out0, first);
    assert!(checksum.is_finite());
}
