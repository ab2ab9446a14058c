//! Symbolic graphs and the bucketed compile cache: specializing at a binding, the
//! errors of bad bindings and bad signatures, padded runs against a plain reference,
//! shared weights, and the cache's bound.

use rlx::prelude::*;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }
    fn values(&mut self, n: usize) -> Vec<f32> {
        (0..n)
            .map(|_| (self.next() % 20001) as f32 / 10000.0 - 1.0)
            .collect()
    }
}

const IN: usize = 5;
const OUT: usize = 3;

fn x_shape() -> SymbolicShape {
    SymbolicShape::new(
        [Dim::sym("batch"), Dim::sym("seq"), Dim::Fixed(IN)],
        DType::F32,
    )
}

fn y_shape() -> SymbolicShape {
    SymbolicShape::new(
        [Dim::sym("batch"), Dim::sym("seq"), Dim::Fixed(OUT)],
        DType::F32,
    )
}

/// `relu(x @ w + b)` over `x [batch, seq, IN]`.
fn build_linear(b: &Bindings) -> Result<Graph> {
    let (batch, seq) = (b.require("batch", "linear")?, b.require("seq", "linear")?);
    let g = Graph::new(format!("linear[{batch}x{seq}]"));
    let x = g.input("x", Shape::new(&[batch, seq, IN], DType::F32))?;
    let w = g.param("w", Shape::new(&[IN, OUT], DType::F32))?;
    let bias = g.param("b", Shape::new(&[OUT], DType::F32))?;
    let y = g.relu(g.add(g.matmul(x, w)?, bias)?)?;
    g.set_outputs(vec![y]);
    Ok(g)
}

fn linear() -> SymbolicGraph {
    SymbolicGraph::new(
        "linear",
        vec![
            SymbolRange::new("batch", 1, 16),
            SymbolRange::new("seq", 1, 64),
        ],
        vec![("x".into(), x_shape())],
        vec![y_shape()],
        build_linear,
    )
    .unwrap()
}

fn reference(x: &[f32], w: &[f32], b: &[f32]) -> Vec<f32> {
    let rows = x.len() / IN;
    let mut out = vec![0.0; rows * OUT];
    for r in 0..rows {
        for o in 0..OUT {
            let mut acc = b[o] as f64;
            for i in 0..IN {
                acc += x[r * IN + i] as f64 * w[i * OUT + o] as f64;
            }
            out[r * OUT + o] = acc.max(0.0) as f32;
        }
    }
    out
}

fn bind(batch: usize, seq: usize) -> Bindings {
    Bindings::new()
        .with("batch", batch)
        .unwrap()
        .with("seq", seq)
        .unwrap()
}

fn new_cache() -> BucketedCompileCache {
    BucketedCompileCache::new(linear(), Session::new(Device::Cpu), CompileOptions::new())
        .unwrap()
        .with_buckets("batch", Buckets::PowersOfTwo)
        .unwrap()
        .with_buckets("seq", Buckets::Multiple(16))
        .unwrap()
}

fn f32s(data: &TensorData) -> &[f32] {
    match data {
        TensorData::F32(v) => v,
        other => panic!("expected f32, got {}", other.dtype()),
    }
}

#[test]
fn specializing_binds_the_signature() {
    let graph = linear();
    assert_eq!(
        graph.to_string(),
        "linear(x: f32[batch, seq, 5]) -> (f32[batch, seq, 3]) batch=1..=16 seq=1..=64"
    );
    let g = graph.specialize(&bind(3, 7)).unwrap();
    assert_eq!(g.inputs()[0].2.dims(), &[3, 7, IN]);
    let x = Shape::new(&[2, 9, IN], DType::F32);
    assert_eq!(graph.bindings_for(&[("x", &x)]).unwrap(), bind(2, 9));
}

#[test]
fn bad_bindings_are_errors_that_leave_the_graph_usable() {
    let graph = linear();
    let cases = [
        (
            Bindings::new().with("batch", 2).unwrap(),
            "'seq' is not bound",
        ),
        (bind(17, 1), "outside its range 1..=16"),
        (
            bind(1, 1).with("heads", 4).unwrap(),
            "'heads', which is not one of its symbols",
        ),
    ];
    for (b, want) in cases {
        let err = graph.specialize(&b).unwrap_err().to_string();
        assert!(err.contains(want), "{b}: {err}");
    }
    assert!(Bindings::new().with("seq", 0).is_err());
    let err = Bindings::parse("batch=-1").unwrap_err().to_string();
    assert!(err.contains("-1"), "{err}");
    // Shapes that fit no binding.
    let wrong = Shape::new(&[2, 9, IN + 1], DType::F32);
    assert!(graph.bindings_for(&[("x", &wrong)]).is_err());
    assert!(graph.bindings_for(&[]).is_err());
    let x = Shape::new(&[2, 9, IN], DType::F32);
    assert!(graph.bindings_for(&[("y", &x)]).is_err());
    // Still usable.
    assert!(graph.specialize(&bind(16, 64)).is_ok());
}

#[test]
fn signatures_are_checked_once_when_made() {
    let range = || {
        vec![
            SymbolRange::new("batch", 1, 16),
            SymbolRange::new("seq", 1, 64),
        ]
    };
    // The builder fixes seq at 1 although the signature says it varies: the second
    // probe binding catches it.
    let fixed_seq = |b: &Bindings| build_linear(&b.clone().with("seq", 1)?);
    let err = SymbolicGraph::new(
        "linear",
        range(),
        vec![("x".into(), x_shape())],
        vec![y_shape()],
        fixed_seq,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("input 'x' is f32[2, 1, 5]"), "{err}");
    // A wrongly named input, an undeclared symbol, an empty range, a repeated symbol.
    let err = SymbolicGraph::new(
        "linear",
        range(),
        vec![("input".into(), x_shape())],
        vec![y_shape()],
        build_linear,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("no input 'input'"), "{err}");
    let heads = SymbolicShape::new([Dim::sym("heads")], DType::F32);
    let err = SymbolicGraph::new(
        "linear",
        range(),
        vec![("x".into(), x_shape())],
        vec![heads],
        build_linear,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("does not declare"), "{err}");
    for bad in [
        vec![
            SymbolRange::new("batch", 0, 4),
            SymbolRange::new("seq", 1, 4),
        ],
        vec![
            SymbolRange::new("batch", 5, 4),
            SymbolRange::new("seq", 1, 4),
        ],
        vec![
            SymbolRange::new("batch", 1, 4),
            SymbolRange::new("batch", 1, 4),
            SymbolRange::new("seq", 1, 4),
        ],
    ] {
        assert!(
            SymbolicGraph::new(
                "linear",
                bad.clone(),
                vec![("x".into(), x_shape())],
                vec![y_shape()],
                build_linear
            )
            .is_err(),
            "{bad:?}"
        );
    }
}

#[test]
fn padded_runs_match_the_reference_at_every_size() {
    let mut rng = Rng(7);
    let mut cache = new_cache();
    let (w, b) = (rng.values(IN * OUT), rng.values(OUT));
    cache.set_param("w", &w).unwrap();
    cache.set_param("b", &b).unwrap();
    for (batch, seq) in [(1, 1), (3, 5), (4, 16), (5, 17), (16, 64), (2, 33), (3, 5)] {
        let x = rng.values(batch * seq * IN);
        let out = cache
            .run_padded(&bind(batch, seq), &[("x", TensorRef::F32(&x))])
            .unwrap();
        let want = reference(&x, &w, &b);
        let got = f32s(&out[0]);
        assert_eq!(got.len(), want.len(), "[{batch}, {seq}]");
        for (g, w) in got.iter().zip(&want) {
            assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()), "[{batch}, {seq}]");
        }
    }
    // (3, 5) and (4, 16) share the bucket batch=4, seq=16; the last run, at 3
    // rows, ran on 3 rows of it (the active extent), not on 4 padded ones.
    assert_eq!(cache.bucket(&bind(3, 5)).unwrap(), bind(4, 16));
    let mut extent = None;
    cache.for_each_compiled_ref(|b, g| {
        if *b == bind(4, 16) {
            extent = g.active_extent();
        }
    });
    assert_eq!(extent, Some(3));
    // `get` hands the graph out at its compiled shapes.
    assert_eq!(cache.get(&bind(4, 16)).unwrap().active_extent(), None);
    assert_eq!(cache.bucket(&bind(5, 17)).unwrap(), bind(8, 32));
    assert_eq!(cache.bucket(&bind(16, 64)).unwrap(), bind(16, 64));
    assert_eq!(cache.compiled_count(), 6, "{:?}", cache.compiled_bindings());
}

#[test]
fn weights_are_shared_and_updates_reach_every_binding() {
    let mut rng = Rng(11);
    let mut cache = new_cache();
    let (w, b) = (rng.values(IN * OUT), rng.values(OUT));
    cache.set_param("w", &w).unwrap();
    cache.set_param("b", &b).unwrap();
    let x = rng.values(2 * 3 * IN);
    cache
        .run_padded(&bind(2, 3), &[("x", TensorRef::F32(&x))])
        .unwrap();
    // New weights after a binding was compiled reach it too.
    let w2 = rng.values(IN * OUT);
    cache.set_param("w", &w2).unwrap();
    let out = cache
        .run_padded(&bind(2, 3), &[("x", TensorRef::F32(&x))])
        .unwrap();
    let want = reference(&x, &w2, &b);
    for (g, w) in f32s(&out[0]).iter().zip(&want) {
        assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()));
    }
    // A graph compiled outside the cache shares the weights as well.
    let mut fresh = cache.compile_uncached(&bind(1, 2)).unwrap();
    let out = fresh.run(&[("x", &x[..2 * IN])]).unwrap();
    let want = reference(&x[..2 * IN], &w2, &b);
    for (g, w) in out[0].iter().zip(&want) {
        assert!((g - w).abs() <= 1e-5 * (1.0 + w.abs()));
    }
}

#[test]
fn the_cache_keeps_at_most_its_capacity() {
    let mut rng = Rng(3);
    let mut cache = new_cache().with_capacity(2).unwrap();
    cache.set_param("w", &rng.values(IN * OUT)).unwrap();
    cache.set_param("b", &rng.values(OUT)).unwrap();
    for batch in [2, 3, 5, 9, 2] {
        let x = rng.values(batch * IN);
        cache
            .run_padded(&bind(batch, 1), &[("x", TensorRef::F32(&x))])
            .unwrap();
        assert!(cache.compiled_count() <= 3);
    }
    // The most recent two buckets stay: batch 16 (from 9) and batch 2.
    assert_eq!(cache.compiled_bindings(), vec![bind(16, 16), bind(2, 16)]);
    assert!(new_cache().with_capacity(0).is_err());
    assert!(new_cache().with_buckets("heads", Buckets::Exact).is_err());
    assert!(
        new_cache()
            .with_buckets("seq", Buckets::Multiple(0))
            .is_err()
    );
}

/// A binding, inputs, and a piece of the error they must give.
type BadRun<'a> = (Bindings, Vec<(&'a str, TensorRef<'a>)>, &'a str);

#[test]
fn bad_padded_inputs_are_errors_and_the_cache_still_runs() {
    let mut rng = Rng(5);
    let mut cache = new_cache();
    let (w, b) = (rng.values(IN * OUT), rng.values(OUT));
    cache.set_param("w", &w).unwrap();
    cache.set_param("b", &b).unwrap();
    let x = rng.values(2 * 3 * IN);
    let short = &x[1..];
    let ids = vec![0i64; 2 * 3 * IN];
    let bad: Vec<BadRun> = vec![
        (
            bind(2, 3),
            vec![("x", TensorRef::F32(short))],
            "expected 30 elements",
        ),
        (
            bind(2, 3),
            vec![("x", TensorRef::I64(&ids))],
            "expected dtype f32",
        ),
        (
            bind(2, 3),
            vec![("z", TensorRef::F32(&x))],
            "unknown input 'z'",
        ),
        (
            bind(2, 3),
            vec![("x", TensorRef::F32(&x)), ("x", TensorRef::F32(&x))],
            "given more than once",
        ),
        (bind(2, 3), vec![], "missing input 'x'"),
        (
            bind(2, 65),
            vec![("x", TensorRef::F32(&x))],
            "outside its range",
        ),
    ];
    for (b, inputs, want) in bad {
        let err = cache.run_padded(&b, &inputs).unwrap_err().to_string();
        assert!(err.contains(want), "{want}: {err}");
    }
    let out = cache
        .run_padded(&bind(2, 3), &[("x", TensorRef::F32(&x))])
        .unwrap();
    assert_eq!(f32s(&out[0]).len(), 2 * 3 * OUT);
}

#[test]
fn handles_are_lent_to_every_binding() {
    // A running sum over calls, kept in a persistent handle of the owner, updated by
    // graphs of different row counts.
    let graph = SymbolicGraph::new(
        "accumulate",
        vec![SymbolRange::new("rows", 1, 8)],
        vec![
            (
                "x".into(),
                SymbolicShape::new([Dim::sym("rows"), Dim::Fixed(2)], DType::F32),
            ),
            (
                "total".into(),
                SymbolicShape::new([Dim::Fixed(1), Dim::Fixed(2)], DType::F32),
            ),
            ("at".into(), SymbolicShape::new([Dim::Fixed(1)], DType::I64)),
        ],
        vec![SymbolicShape::new(
            [Dim::Fixed(1), Dim::Fixed(2)],
            DType::F32,
        )],
        |b: &Bindings| {
            let g = Graph::new("accumulate");
            let rows = b.require("rows", "accumulate")?;
            let x = g.input("x", Shape::new(&[rows, 2], DType::F32))?;
            let total = g.input("total", Shape::new(&[1, 2], DType::F32))?;
            let at = g.input("at", Shape::new(&[1], DType::I64))?;
            let sum = g.add(g.sum(x, &[0], true)?, total)?;
            let updated = g.write_at(total, sum, at, 0)?;
            g.set_outputs(vec![updated]);
            Ok(g)
        },
    )
    .unwrap();
    let handle = BufferHandle::new("total", &[1, 2], DType::F32);
    let mut cache = BucketedCompileCache::new(
        graph,
        Session::new(Device::Cpu),
        CompileOptions::new().bind_handle(&handle),
    )
    .unwrap();
    let at = [0i64];
    for (rows, x) in [(1, vec![1.0, 2.0]), (3, vec![1.0; 6]), (2, vec![0.5; 4])] {
        let b = Bindings::new().with("rows", rows).unwrap();
        cache
            .run_with(&b, |g| {
                g.run_typed(&[("x", TensorRef::F32(&x)), ("at", TensorRef::I64(&at))])
            })
            .unwrap();
    }
    assert_eq!(cache.owner().read_handle("total").unwrap(), vec![5.0, 6.0]);
    // The other bindings keep no storage of their own: run outside `run_with`, a
    // graph refuses, and the owner's state is untouched.
    let three = Bindings::new().with("rows", 3).unwrap();
    let x = [0.0f32; 6];
    let err = cache
        .get(&three)
        .unwrap()
        .run_typed(&[("x", TensorRef::F32(&x)), ("at", TensorRef::I64(&at))])
        .unwrap_err()
        .to_string();
    assert!(err.contains("handle 'total'"), "{err}");
    assert_eq!(cache.owner().read_handle("total").unwrap(), vec![5.0, 6.0]);
}

const VOCAB: usize = 50;
const HIDDEN: usize = 16;
const HEADS: usize = 2;

/// A small encoder over `ids [batch, seq]` and a 0/1 `mask [batch, seq]`: embedding,
/// layer norm, masked self-attention, a GELU projection and a masked mean over the
/// sequence, giving `[batch, HIDDEN]`.
fn encoder(batch: usize, seq: usize) -> Graph {
    let g = Graph::new(format!("encoder[{batch}x{seq}]"));
    let build = || -> Result<()> {
        let ids = g.input("ids", Shape::new(&[batch, seq], DType::I64))?;
        let mask = g.input("mask", Shape::new(&[batch, seq], DType::F32))?;
        let table = g.param("table", Shape::new(&[VOCAB, HIDDEN], DType::F32))?;
        let gamma = g.param("gamma", Shape::new(&[HIDDEN], DType::F32))?;
        let beta = g.param("beta", Shape::new(&[HIDDEN], DType::F32))?;
        let x = g.layer_norm(g.gather(table, ids, 0)?, gamma, beta, 1e-5)?;
        let hd = HIDDEN / HEADS;
        let heads = |name: &str| -> Result<NodeId> {
            let w = g.param(name, Shape::new(&[HIDDEN, HIDDEN], DType::F32))?;
            g.permute(
                g.reshape(g.matmul(x, w)?, &[batch, seq, HEADS, hd])?,
                &[0, 2, 1, 3],
            )
        };
        let (q, k, v) = (heads("wq")?, heads("wk")?, heads("wv")?);
        // Additive mask: 0 where kept, -1e9 where padded, [batch, 1, 1, seq].
        let additive = g.mul(
            g.sub(
                g.reshape(mask, &[batch, 1, 1, seq])?,
                g.scalar(1.0, DType::F32),
            )?,
            g.scalar(1e9, DType::F32),
        )?;
        let ctx = g.attention(q, k, v, Some(additive), false, None)?;
        let ctx = g.reshape(g.permute(ctx, &[0, 2, 1, 3])?, &[batch, seq, HIDDEN])?;
        let wo = g.param("wo", Shape::new(&[HIDDEN, HIDDEN], DType::F32))?;
        let y = g.gelu(g.add(g.matmul(ctx, wo)?, x)?)?;
        let weights = g.reshape(mask, &[batch, seq, 1])?;
        let pooled = g.div(
            g.sum(g.mul(y, weights)?, &[1], false)?,
            g.sum(weights, &[1], false)?,
        )?;
        g.set_outputs(vec![pooled]);
        Ok(())
    };
    build().unwrap();
    g
}

fn encoder_params(rng: &mut Rng) -> Vec<(&'static str, Vec<f32>)> {
    let mut params = vec![
        ("table", rng.values(VOCAB * HIDDEN)),
        ("gamma", rng.values(HIDDEN)),
        ("beta", rng.values(HIDDEN)),
    ];
    for w in ["wq", "wk", "wv", "wo"] {
        params.push((w, rng.values(HIDDEN * HIDDEN)));
    }
    params
}

fn encoder_inputs(rng: &mut Rng, batch: usize, seq: usize) -> (Vec<f32>, Vec<f32>) {
    let ids = (0..batch * seq)
        .map(|_| (rng.next() % VOCAB as u64) as f32)
        .collect();
    // Row r keeps its first seq - r % seq tokens (at least one).
    let mask = (0..batch * seq)
        .map(|i| {
            if i % seq < seq - (i / seq) % seq {
                1.0
            } else {
                0.0
            }
        })
        .collect();
    (ids, mask)
}

fn compiled(g: &Graph, params: &[(&str, Vec<f32>)]) -> CompiledGraph {
    let mut c = Session::new(Device::Cpu).compile(g).unwrap();
    for (name, values) in params {
        c.set_param(name, values).unwrap();
    }
    c
}

#[test]
fn an_active_extent_runs_fewer_rows_as_a_graph_compiled_for_them() {
    let mut rng = Rng(17);
    let params = encoder_params(&mut rng);
    let (planned, seq) = (6, 7);
    let mut big = compiled(&encoder(planned, seq), &params);
    for rows in [4, 1, 6, 5] {
        let mut exact = compiled(&encoder(rows, seq), &params);
        let (ids, mask) = encoder_inputs(&mut rng, rows, seq);
        let inputs = [("ids", ids.as_slice()), ("mask", mask.as_slice())];
        let want = exact.run(&inputs).unwrap();
        big.set_active_extent(&["ids", "mask"], rows).unwrap();
        assert_eq!(big.active_extent(), (rows < planned).then_some(rows));
        assert_eq!(big.output_shapes()[0].dims(), &[rows, HIDDEN]);
        assert_eq!(big.inputs()[0].1.dims(), &[rows, seq]);
        let got = big.run(&inputs).unwrap();
        assert_eq!(got[0].len(), rows * HIDDEN);
        for (g, w) in got[0].iter().zip(&want[0]) {
            assert!(
                (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{rows} rows: {g} vs {w}"
            );
        }
        // The allocation-free path sees the same shapes.
        let slots = big.run_slots(&[&ids, &mask]).unwrap();
        assert_eq!(slots.get(0).unwrap(), got[0].as_slice());
    }
    // Back to the compiled rows.
    big.set_active_extent(&["ids", "mask"], 3).unwrap();
    big.clear_active_extent().unwrap();
    assert_eq!(big.active_extent(), None);
    let (ids, mask) = encoder_inputs(&mut rng, planned, seq);
    assert_eq!(
        big.run(&[("ids", &ids), ("mask", &mask)]).unwrap()[0].len(),
        planned * HIDDEN
    );
}

#[test]
fn an_active_extent_is_refused_where_rows_mix_and_changes_nothing() {
    let mut rng = Rng(23);
    let params = encoder_params(&mut rng);
    let mut c = compiled(&encoder(4, 5), &params);
    let (ids, mask) = encoder_inputs(&mut rng, 4, 5);
    let before = c.run(&[("ids", &ids), ("mask", &mask)]).unwrap();
    let cases: [(&[&str], usize, &str); 4] = [
        (&["ids", "mask"], 0, "0 rows"),
        (&["ids", "mask"], 5, "planned for 1..=4"),
        (&["ids", "nope"], 2, "unknown input 'nope'"),
        // Rows of `ids` with a mask of all rows would mix in the attention.
        (&["ids"], 2, "cannot run on fewer rows"),
    ];
    for (names, rows, want) in cases {
        let err = c.set_active_extent(names, rows).unwrap_err().to_string();
        assert!(err.contains(want), "{want}: {err}");
        assert_eq!(c.active_extent(), None);
        assert_eq!(c.run(&[("ids", &ids), ("mask", &mask)]).unwrap(), before);
    }
    // A sum over the batch mixes rows: refused, naming the op.
    let g = Graph::new("total");
    let x = g.input("x", Shape::new(&[4, 3], DType::F32)).unwrap();
    let total = g.sum(g.relu(x).unwrap(), &[0], false).unwrap();
    g.set_outputs(vec![total]);
    let mut c = Session::new(Device::Cpu).compile(&g).unwrap();
    let err = c.set_active_extent(&["x"], 2).unwrap_err().to_string();
    assert!(err.contains("reduces over dimension 0"), "{err}");
    // Inputs of the planned size are refused while the extent is set.
    let g = Graph::new("double");
    let x = g.input("x", Shape::new(&[4, 3], DType::F32)).unwrap();
    g.set_outputs(vec![g.add(x, x).unwrap()]);
    let mut c = Session::new(Device::Cpu).compile(&g).unwrap();
    c.set_active_extent(&["x"], 2).unwrap();
    assert!(matches!(
        c.run(&[("x", &[1.0; 12])]),
        Err(Error::LengthMismatch { expected: 6, .. })
    ));
    assert_eq!(c.run(&[("x", &[1.0; 6])]).unwrap(), vec![vec![2.0; 6]]);
}

#[test]
fn a_symbol_beyond_the_first_dim_is_padded_not_cut_short() {
    // y[i, j] = x[i] + x[j]: the batch is also a column count, so running on fewer
    // rows would change the columns; run_padded pads instead.
    let graph = SymbolicGraph::new(
        "pairs",
        vec![SymbolRange::new("batch", 1, 8)],
        vec![(
            "x".into(),
            SymbolicShape::new([Dim::sym("batch"), Dim::Fixed(1)], DType::F32),
        )],
        vec![SymbolicShape::new(
            [Dim::sym("batch"), Dim::sym("batch")],
            DType::F32,
        )],
        |b: &Bindings| {
            let n = b.require("batch", "pairs")?;
            let g = Graph::new("pairs");
            let x = g.input("x", Shape::new(&[n, 1], DType::F32))?;
            let y = g.add(x, g.reshape(x, &[1, n])?)?;
            g.set_outputs(vec![y]);
            Ok(g)
        },
    )
    .unwrap();
    let mut cache =
        BucketedCompileCache::new(graph, Session::new(Device::Cpu), CompileOptions::new())
            .unwrap()
            .with_buckets("batch", Buckets::PowersOfTwo)
            .unwrap();
    let x = [1.0f32, 10.0, 100.0];
    let out = cache
        .run_padded(
            &Bindings::new().with("batch", 3).unwrap(),
            &[("x", TensorRef::F32(&x))],
        )
        .unwrap();
    let want: Vec<f32> = x
        .iter()
        .flat_map(|a| x.iter().map(move |b| a + b))
        .collect();
    assert_eq!(out[0], TensorData::F32(want));
}

/// A MobileNet-style block (1x1 expansion, depthwise, 1x1 projection with a
/// residual, a global mean) of `rows` images, whose values between the
/// convolutions the CPU keeps channel-blocked.
fn inverted_residual(rows: usize) -> Graph {
    let g = Graph::new("inverted residual");
    let x = g
        .input("x", Shape::new(&[rows, 24, 9, 10], DType::F32))
        .unwrap();
    let param = |name: &str, dims: &[usize]| g.param(name, Shape::new(dims, DType::F32)).unwrap();
    let e = g
        .conv2d(
            x,
            param("w1", &[64, 24, 1, 1]),
            Some(param("b1", &[64])),
            [1, 1],
            [0; 4],
            [1, 1],
            1,
        )
        .unwrap();
    let e = g.relu(e).unwrap();
    let d = g
        .conv2d(
            e,
            param("wd", &[64, 1, 3, 3]),
            None,
            [1, 1],
            [1; 4],
            [1, 1],
            64,
        )
        .unwrap();
    let p = g
        .conv2d(
            d,
            param("w2", &[24, 64, 1, 1]),
            None,
            [1, 1],
            [0; 4],
            [1, 1],
            1,
        )
        .unwrap();
    let y = g.add(p, x).unwrap();
    let m = g.mean(y, &[2, 3], false).unwrap();
    g.set_outputs(vec![m]);
    g
}

#[test]
fn an_active_extent_runs_channel_blocked_convolutions_on_fewer_images() {
    let mut rng = Rng(29);
    let dims = [("w1", 64 * 24), ("b1", 64), ("wd", 64 * 9), ("w2", 24 * 64)];
    let params: Vec<(&str, Vec<f32>)> = dims
        .iter()
        .map(|&(name, len)| (name, rng.values(len)))
        .collect();
    let planned = 4;
    let mut big = compiled(&inverted_residual(planned), &params);
    if rlx::cpu::isa::isa().avx512f {
        assert!(big.kernels().iter().any(|(_, k)| k.contains("blocked")));
    }
    for rows in [3, 1, 4] {
        let mut exact = compiled(&inverted_residual(rows), &params);
        let x = rng.values(rows * 24 * 90);
        let want = exact.run(&[("x", &x)]).unwrap();
        big.set_active_extent(&["x"], rows).unwrap();
        let got = big.run(&[("x", &x)]).unwrap();
        assert_eq!(got[0].len(), rows * 24);
        for (g, w) in got[0].iter().zip(&want[0]) {
            assert!(
                (g - w).abs() <= 1e-5 * (1.0 + w.abs()),
                "{rows} rows: {g} vs {w}"
            );
        }
    }
}
