//! The memory planner on real graphs: reuse on deep chains, no overlap between
//! simultaneously live values on random graphs, and identical results with and
//! without reuse.

use rlx::ir::reference::{HostTensor, evaluate};
use rlx::opt::lifetimes::find_overlap;
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
        (self.next() % 2001) as f32 / 1000.0 - 1.0
    }
}

fn assert_no_overlap(c: &CompiledGraph) {
    let values = c.plan().arena_values();
    let lifetimes: Vec<_> = values.iter().map(|v| v.1).collect();
    let offsets: Vec<_> = values.iter().map(|v| v.2).collect();
    assert!(
        find_overlap(&lifetimes, &offsets).is_none(),
        "two live values share bytes"
    );
    let stats = c.memory_stats();
    for (_, lt, off) in values {
        assert!(off + lt.size <= stats.arena_bytes);
    }
    assert!(stats.arena_bytes >= stats.lower_bound);
}

#[test]
fn deep_chain_reuses_memory() {
    let g = Graph::new("chain");
    let n = 256;
    let x = g.input("x", Shape::new(&[n], DType::F32)).unwrap();
    let w = g.param("w", Shape::new(&[n, n], DType::F32)).unwrap();
    let mut h = x;
    for i in 0..40 {
        // A matmul cannot run in place, so every step needs a fresh buffer.
        h = g.matmul(g.reshape(h, &[1, n]).unwrap(), w).unwrap();
        h = g.reshape(h, &[n]).unwrap();
        h = if i % 2 == 0 {
            g.tanh(h).unwrap()
        } else {
            g.sin(h).unwrap()
        };
    }
    g.set_outputs(vec![h]);
    let mut c = Session::new(Device::Cpu).compile(&g).unwrap();
    let s = c.memory_stats();
    assert!(s.arena_bytes * 10 < s.transient_bytes, "{s}");
    assert!(s.arena_bytes as f64 <= 1.5 * s.lower_bound as f64, "{s}");
    assert_eq!(s.in_place, 40, "every activation runs in place: {s}");
    assert_eq!(s.views, 80, "{s}");
    assert_no_overlap(&c);

    let wv: Vec<f32> = (0..n * n)
        .map(|i| ((i * 31 % 17) as f32 - 8.0) / 64.0)
        .collect();
    let xv: Vec<f32> = (0..n).map(|i| (i as f32 / n as f32) - 0.5).collect();
    c.set_param("w", &wv).unwrap();
    let got = c.run(&[("x", &xv)]).unwrap();
    let mut plain = Session::new(Device::Cpu)
        .compile_with(
            &g,
            &CompileOptions::new().memory_reuse(false).in_place(false),
        )
        .unwrap();
    let p = plain.memory_stats();
    assert!(
        p.arena_bytes >= p.transient_bytes && p.in_place == 0,
        "no reuse: {p}"
    );
    plain.set_param("w", &wv).unwrap();
    assert_eq!(plain.run(&[("x", &xv)]).unwrap(), got);
}

/// Builds a random graph of elementwise ops, matmuls, views, transposes and
/// reductions over a few same-shaped values.
fn random_graph(rng: &mut Rng, inputs: usize, ops: usize) -> Graph {
    let g = Graph::new("random");
    let (r, c) = (4 + rng.below(5), 4 + rng.below(5));
    let mut pool: Vec<NodeId> = (0..inputs)
        .map(|i| {
            g.input(format!("in{i}"), Shape::new(&[r, c], DType::F32))
                .unwrap()
        })
        .collect();
    let w = g.param("w", Shape::new(&[c, c], DType::F32)).unwrap();
    for _ in 0..ops {
        let a = pool[rng.below(pool.len())];
        let b = pool[rng.below(pool.len())];
        let v = match rng.below(9) {
            0 => g.add(a, b),
            1 => g.mul(a, b),
            2 => g.tanh(a),
            3 => g.matmul(a, w),
            4 => g.reshape(g.reshape(a, &[r * c]).unwrap(), &[r, c]),
            5 => {
                let top = g.slice(a, 0, 0, 1, 1).unwrap();
                g.sub(a, top)
            }
            6 => g.transpose(g.transpose(a, 0, 1).unwrap(), 0, 1),
            7 => g.mean(a, &[-1], true).and_then(|m| g.sub(a, m)),
            _ => g.select(g.gt(a, b).unwrap(), a, g.neg(b).unwrap()),
        }
        .unwrap();
        pool.push(v);
    }
    let n_out = 1 + rng.below(3);
    let outs: Vec<NodeId> = (0..n_out)
        .map(|_| pool[inputs + rng.below(pool.len() - inputs)])
        .collect();
    g.set_outputs(outs);
    g
}

#[test]
fn random_graphs_never_overlap_and_match_the_reference() {
    let mut rng = Rng(0x5eed_1234);
    for case in 0..60 {
        let inputs = 1 + rng.below(3);
        let ops = 5 + rng.below(25);
        let g = random_graph(&mut rng, inputs, ops);
        let mut values: HashMap<String, HostTensor> = HashMap::new();
        let mut feeds: Vec<(String, Vec<f32>)> = Vec::new();
        for (name, _, shape) in g.inputs().into_iter().chain(g.params()) {
            let data: Vec<f32> = (0..shape.num_elements()).map(|_| rng.value()).collect();
            values.insert(
                name.clone(),
                HostTensor::from_data(shape.dims(), &TensorData::F32(data.clone())).unwrap(),
            );
            feeds.push((name, data));
        }
        let expected = evaluate(&g, &mut values).unwrap();
        for options in [
            CompileOptions::new(),
            CompileOptions::new().memory_reuse(false).in_place(false),
        ] {
            let mut c = Session::new(Device::Cpu)
                .compile_with(&g, &options)
                .unwrap();
            assert_no_overlap(&c);
            let w = &feeds.iter().find(|(n, _)| n == "w").unwrap().1;
            c.set_param("w", w).unwrap();
            let named: Vec<(&str, &[f32])> = feeds
                .iter()
                .filter(|(n, _)| n != "w")
                .map(|(n, d)| (n.as_str(), d.as_slice()))
                .collect();
            let got = c.run(&named).unwrap();
            for (o, (exp, got)) in expected.iter().zip(&got).enumerate() {
                for (i, (&e, &v)) in exp.data.iter().zip(got).enumerate() {
                    let tol = 1e-4 * (1.0 + e.abs());
                    assert!(
                        (e - v as f64).abs() <= tol,
                        "case {case} output {o}[{i}]: {v} vs {e} ({options:?})\n{g}"
                    );
                }
            }
        }
    }
}
