//! Every IR op, compiled for every device available here (the CPU, and CUDA GPU 0
//! where CUDA is present) and run with `run_typed`, against the reference evaluator
//! (`rlx::ir::reference::evaluate`) on fresh random data.
//!
//! Where a device has no kernel yet for an op (`Error::Unsupported` at compile), the
//! case is reported as skipped on that device, with the reason, and counted;
//! `RLX_TEST_STRICT_DEVICES=1` turns those skips into failures.
//!
//! Each case builds a small graph, compiles it twice (default options, and with memory
//! reuse and in-place execution off), runs both on two rounds of random inputs and
//! checks every output against the reference: integers and bools exactly, floats within
//! a tolerance chosen by dtype and by how many terms each output element accumulates.
//! The two compiled variants must agree bit for bit.

use rlx::ir::reference::{HostTensor, evaluate};
use rlx::ir::{BinaryOp, F64Bits, PadMode, ReduceOp, RopeStyle, UnaryOp};
use rlx::{
    BufferHandle, CompileOptions, CompiledGraph, DType, Device, Error, Graph, MemoryStats, NodeId,
    Result, Session, Shape, TensorData, TensorRef,
};
use std::collections::HashMap;

mod common;
use common::test_devices;

// ---------------------------------------------------------------------------------------
// Deterministic random data
// ---------------------------------------------------------------------------------------

/// The splitmix64 finalizer: a good 64-bit mix.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// splitmix64 generator.
struct Rng(u64);

impl Rng {
    fn new(seed: u64) -> Rng {
        Rng(mix(seed))
    }

    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        mix(self.0)
    }

    /// Uniform in `[0, 1)`.
    fn unit(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 / (1u64 << 53) as f64
    }

    fn uniform(&mut self, lo: f64, hi: f64) -> f64 {
        lo + (hi - lo) * self.unit()
    }

    /// Uniform integer in `[lo, hi]`.
    fn int(&mut self, lo: i64, hi: i64) -> i64 {
        let span = (hi - lo) as u64 + 1;
        lo + (self.next_u64() % span) as i64
    }

    fn chance(&mut self, num: u64, den: u64) -> bool {
        self.next_u64() % den < num
    }
}

/// How an input's values are drawn.
#[derive(Clone, Copy, Debug)]
enum Dist {
    /// Floats uniform in [-2, 2]; signed ints in [-5, 5]; u8 in [0, 10]; bools 50/50.
    Default,
    /// Floats uniform in [0.1, 3] (log, sqrt, rsqrt); ints in [0, 5].
    Positive,
    /// Uniform in `[lo, hi]` (integers truncate).
    Uniform(f64, f64),
    /// Integers in `[lo, hi]` for any dtype (bools: non-zero is true).
    Int(i64, i64),
    /// Multiples of 0.5 in [-5, 5] (round-half-even ties, floor/ceil of exact values).
    Halves,
    /// Few distinct values, so ties and equalities are common.
    Ties,
    /// Uniform in [-2, 2] mixed with NaN, +-inf and +-0 (one in six).
    Special,
    /// Mostly zero / false (three in four).
    Sparse,
    /// Uniform in [-1, 1] with -inf one time in three (additive attention masks).
    NegInf,
}

fn gen_value(rng: &mut Rng, dtype: DType, dist: Dist) -> f64 {
    let float = dtype.is_float();
    match dist {
        Dist::Default => match dtype {
            DType::Bool => rng.int(0, 1) as f64,
            DType::U8 => rng.int(0, 10) as f64,
            _ if float => rng.uniform(-2.0, 2.0),
            _ => rng.int(-5, 5) as f64,
        },
        Dist::Positive => {
            if float {
                rng.uniform(0.1, 3.0)
            } else {
                rng.int(0, 5) as f64
            }
        }
        Dist::Uniform(lo, hi) => rng.uniform(lo, hi),
        Dist::Int(lo, hi) => rng.int(lo, hi) as f64,
        Dist::Halves => rng.int(-10, 10) as f64 * 0.5,
        Dist::Ties => {
            if float {
                rng.int(-2, 2) as f64 * 0.5
            } else if dtype == DType::U8 || dtype == DType::Bool {
                rng.int(0, 2) as f64
            } else {
                rng.int(-2, 2) as f64
            }
        }
        Dist::Special => {
            if float && rng.chance(1, 6) {
                [f64::NAN, f64::INFINITY, f64::NEG_INFINITY, 0.0, -0.0][rng.int(0, 4) as usize]
            } else {
                gen_value(rng, dtype, Dist::Default)
            }
        }
        Dist::Sparse => {
            if rng.chance(3, 4) {
                0.0
            } else if dtype == DType::Bool {
                1.0
            } else {
                gen_value(rng, dtype, Dist::Default)
            }
        }
        Dist::NegInf => {
            if rng.chance(1, 3) {
                f64::NEG_INFINITY
            } else {
                rng.uniform(-1.0, 1.0)
            }
        }
    }
}

/// A random tensor of `shape` (values rounded to its dtype).
fn random_tensor(rng: &mut Rng, shape: &Shape, dist: Dist) -> HostTensor {
    let data = (0..shape.num_elements())
        .map(|_| gen_value(rng, shape.dtype(), dist))
        .collect();
    HostTensor::new(shape.clone(), data)
}

// ---------------------------------------------------------------------------------------
// Inputs, tolerances and the checker
// ---------------------------------------------------------------------------------------

/// One graph input: name, shape and how to fill it.
#[derive(Clone, Debug)]
struct In {
    name: String,
    shape: Shape,
    dist: Dist,
}

fn inp(name: &str, dims: &[usize], dtype: DType) -> In {
    In {
        name: name.to_string(),
        shape: Shape::new(dims, dtype),
        dist: Dist::Default,
    }
}

impl In {
    fn dist(mut self, dist: Dist) -> In {
        self.dist = dist;
        self
    }
}

/// Float tolerance: `k` is how many terms each output element accumulates (1 for
/// elementwise ops); rounding error of a sum grows like its square root.
#[derive(Clone, Copy, Debug)]
struct Tol {
    k: usize,
}

const EW: Tol = Tol { k: 1 };

fn acc(k: usize) -> Tol {
    Tol { k }
}

/// `(atol, rtol)` for a float dtype: `|got - ref| <= atol + rtol * |ref|`.
///
/// The CPU kernels compute in `f64` and round once, as the reference does, except the
/// `f32` matmul, which accumulates in `f32`: its error grows like `eps_f32 * sqrt(K)` of
/// the magnitude of the terms, well inside `1e-5 * sqrt(K) * (1 + |ref|)`. For `f16` and
/// `bf16` two units in the last place relative to the reference value; an op that
/// sums `K > 1` terms may also carry the `f32` allowance in absolute terms, since half
/// kernels (a GPU's, like cuBLAS's) accumulate in `f32` before they round, and near
/// zero, where the half spacing is finer than that error, a cancelling sum shows it.
fn tolerance(dtype: DType, tol: Tol) -> (f64, f64) {
    let s = (tol.k.max(1) as f64).sqrt();
    let accumulated = if tol.k > 1 { 1e-5 * s } else { 0.0 };
    match dtype {
        DType::F64 => (1e-12 * s, 1e-12 * s),
        DType::F32 => (1e-5 * s, 1e-5 * s),
        DType::F16 => (2f64.powi(-24).max(accumulated), 2.0 * 2f64.powi(-10)),
        DType::BF16 => (2f64.powi(-133).max(accumulated), 2.0 * 2f64.powi(-7)),
        _ => (0.0, 0.0),
    }
}

/// Panics unless `got` matches the reference output `want`.
fn compare(label: &str, what: &str, got: &TensorData, want: &HostTensor, tol: Tol) {
    let dtype = want.shape.dtype();
    assert_eq!(
        got.dtype(),
        dtype,
        "{label}: {what}: dtype differs from the reference ({})",
        want.shape
    );
    let values = got.as_ref().to_f64_vec();
    assert_eq!(
        values.len(),
        want.data.len(),
        "{label}: {what}: element count differs from the reference ({})",
        want.shape
    );
    let (atol, rtol) = tolerance(dtype, tol);
    let bad: Vec<(usize, f64, f64)> = values
        .iter()
        .zip(&want.data)
        .enumerate()
        .filter(|&(_, (&a, &r))| {
            let ok = if r.is_nan() {
                a.is_nan()
            } else if r.is_infinite() || !dtype.is_float() {
                a == r
            } else {
                (a - r).abs() <= atol + rtol * r.abs()
            };
            !ok
        })
        .map(|(i, (&a, &r))| (i, a, r))
        .collect();
    assert!(
        bad.is_empty(),
        "{label}: {what} ({}): {} of {} elements differ from the reference (index, got, want): {:?}",
        want.shape,
        bad.len(),
        values.len(),
        &bad[..bad.len().min(8)]
    );
}

/// Bytes of every output, for bit-exact comparison between compiled variants.
fn bytes_of(outs: &[TensorData]) -> Vec<Vec<u8>> {
    outs.iter().map(|t| t.as_ref().to_le_bytes()).collect()
}

fn unreused() -> CompileOptions {
    CompileOptions::new().memory_reuse(false).in_place(false)
}

/// Builds the graph over the declared inputs with `build`, compiles it for the CPU
/// (default options, and with reuse and in-place off) and compares both, over two
/// rounds of fresh random data from `seed`, with the reference evaluator.
fn check(
    label: &str,
    seed: u64,
    inputs: &[In],
    tol: Tol,
    build: impl Fn(&Graph, &[NodeId]) -> Result<Vec<NodeId>>,
) -> (MemoryStats, MemoryStats) {
    let g = Graph::new(label);
    let ids: Vec<NodeId> = inputs
        .iter()
        .map(|i| g.input(i.name.clone(), i.shape.clone()).unwrap())
        .collect();
    let outs =
        build(&g, &ids).unwrap_or_else(|e| panic!("{label}: building the graph failed: {e}"));
    assert!(!outs.is_empty(), "{label}: no outputs");
    g.set_outputs(outs);
    let mut stats = None;
    for device in test_devices() {
        let session = Session::new(device);
        let compiled = session.compile(&g).and_then(|fast| {
            let plain = session.compile_with(&g, &unreused())?;
            Ok((fast, plain))
        });
        let (mut fast, mut plain) = match compiled {
            Ok(pair) => pair,
            Err(Error::Unsupported { what, .. })
                if device != Device::Cpu && !rlx::ir::env::Switch::TestStrictDevices.is_set() =>
            {
                eprintln!("SKIP {label} on {device}: {what}");
                continue;
            }
            Err(e) => panic!("{label}: compile for {device} failed: {e}"),
        };
        let label = &format!("{label} on {device}");
        for round in 0..2u64 {
            let mut rng = Rng::new(seed ^ mix(round + 1));
            let mut values = HashMap::new();
            let mut data = Vec::with_capacity(inputs.len());
            for i in inputs {
                let t = random_tensor(&mut rng, &i.shape, i.dist);
                data.push((i.name.as_str(), t.to_data()));
                values.insert(i.name.clone(), t);
            }
            let want = evaluate(&g, &mut values)
                .unwrap_or_else(|e| panic!("{label}: reference failed: {e}"));
            let feed: Vec<(&str, TensorRef<'_>)> =
                data.iter().map(|(n, d)| (*n, d.as_ref())).collect();
            let got = fast
                .run_typed(&feed)
                .unwrap_or_else(|e| panic!("{label}: run failed: {e}"));
            let got_plain = plain
                .run_typed(&feed)
                .unwrap_or_else(|e| panic!("{label}: run (no reuse) failed: {e}"));
            assert_eq!(got.len(), want.len(), "{label}: output count");
            for (k, (a, w)) in got.iter().zip(&want).enumerate() {
                compare(label, &format!("round {round}, output {k}"), a, w, tol);
            }
            assert_eq!(
                bytes_of(&got),
                bytes_of(&got_plain),
                "{label}: round {round}: results differ with memory reuse and in-place off"
            );
        }
        if device == Device::Cpu {
            stats = Some((fast.memory_stats(), plain.memory_stats()));
        }
    }
    stats.expect("the CPU is always tested")
}

/// A test's sequence of cases: each case gets its own seed from the test's constant
/// mixed with the case index.
struct Suite {
    test: u64,
    case: u64,
}

impl Suite {
    fn new(test: u64) -> Suite {
        Suite { test, case: 0 }
    }

    fn check(
        &mut self,
        label: &str,
        inputs: &[In],
        tol: Tol,
        build: impl Fn(&Graph, &[NodeId]) -> Result<Vec<NodeId>>,
    ) -> (MemoryStats, MemoryStats) {
        let seed = mix(self.test.wrapping_mul(0xD6E8_FEB8_6659_FD93) ^ mix(self.case));
        self.case += 1;
        check(
            &format!("{label} [test {:#x} case {}]", self.test, self.case - 1),
            seed,
            inputs,
            tol,
            build,
        )
    }
}

const FLOATS: [DType; 4] = [DType::F32, DType::F64, DType::F16, DType::BF16];

fn one(id: NodeId) -> Result<Vec<NodeId>> {
    Ok(vec![id])
}

// ---------------------------------------------------------------------------------------
// Elementwise
// ---------------------------------------------------------------------------------------

#[test]
fn unary_float_ops() {
    let mut s = Suite::new(0x01);
    let shapes: [&[usize]; 5] = [&[3, 5, 7], &[1, 4, 1], &[], &[2, 0, 3], &[33]];
    for op in UnaryOp::ALL {
        if matches!(op, UnaryOp::Not | UnaryOp::BitNot) {
            continue;
        }
        let base = match op {
            UnaryOp::Log | UnaryOp::Sqrt | UnaryOp::Rsqrt => Dist::Positive,
            _ => Dist::Default,
        };
        let mut dists = vec![base, Dist::Special];
        if matches!(
            op,
            UnaryOp::Round
                | UnaryOp::Floor
                | UnaryOp::Ceil
                | UnaryOp::Sign
                | UnaryOp::Relu
                | UnaryOp::Abs
        ) {
            dists.push(Dist::Halves);
        }
        for dt in FLOATS {
            for dims in shapes {
                s.check(
                    &format!("{} {dt} {dims:?}", op.name()),
                    &[inp("x", dims, dt).dist(base)],
                    EW,
                    |g, x| one(g.unary(op, x[0])?),
                );
            }
            for &dist in &dists[1..] {
                s.check(
                    &format!("{} {dt} {dist:?}", op.name()),
                    &[inp("x", &[4, 9], dt).dist(dist)],
                    EW,
                    |g, x| one(g.unary(op, x[0])?),
                );
            }
        }
    }
}

#[test]
fn unary_integer_and_bool_ops() {
    let mut s = Suite::new(0x02);
    let cases = [
        (DType::I32, Dist::Int(-1000, 1000)),
        (DType::I32, Dist::Int(i32::MIN as i64, i32::MAX as i64)),
        (DType::I64, Dist::Int(-(1 << 40), 1 << 40)),
        (DType::I8, Dist::Int(-128, 127)),
        (DType::U8, Dist::Int(0, 255)),
    ];
    for op in [UnaryOp::Neg, UnaryOp::Abs, UnaryOp::Relu, UnaryOp::Sign] {
        for (dt, dist) in cases {
            for dims in [&[3, 5, 7][..], &[], &[0, 4]] {
                s.check(
                    &format!("{} {dt} {dims:?}", op.name()),
                    &[inp("x", dims, dt).dist(dist)],
                    EW,
                    |g, x| one(g.unary(op, x[0])?),
                );
            }
        }
    }
    for dims in [&[3, 5, 7][..], &[], &[6, 0]] {
        s.check(
            &format!("not {dims:?}"),
            &[inp("x", dims, DType::Bool)],
            EW,
            |g, x| one(g.not(x[0])?),
        );
    }
    // The builder rejects float-only ops on integers and `not` on numbers.
    let g = Graph::new("reject");
    let i = g.input("i", Shape::new(&[3], DType::I32)).unwrap();
    let f = g.input("f", Shape::new(&[3], DType::F32)).unwrap();
    for op in UnaryOp::ALL.into_iter().filter(|o| o.float_only()) {
        assert!(g.unary(op, i).is_err(), "{} accepted i32", op.name());
    }
    assert!(g.not(f).is_err() && g.not(i).is_err());
}

/// Broadcasting operand shape pairs: equal, size-1 dims on both sides, rank
/// differences, scalars, an empty dimension.
const BROADCAST: [(&[usize], &[usize]); 8] = [
    (&[3, 5, 7], &[3, 5, 7]),
    // A value per 2x2 window against the window's elements.
    (&[2, 3, 4, 2, 5, 2], &[2, 3, 4, 1, 5, 1]),
    (&[3, 1, 7], &[5, 1]),
    (&[7], &[3, 5, 7]),
    (&[], &[4, 3]),
    (&[2, 0, 3], &[3]),
    (&[1, 1], &[1]),
    (&[2, 1, 3, 1], &[4, 1, 5]),
];

#[test]
fn binary_float_ops() {
    let mut s = Suite::new(0x03);
    for op in BinaryOp::ALL
        .into_iter()
        .filter(|o| !o.is_logical() && !o.is_bitwise())
    {
        for dt in FLOATS {
            for (a, b) in BROADCAST {
                s.check(
                    &format!("{} {dt} {a:?} {b:?}", op.name()),
                    &[inp("a", a, dt), inp("b", b, dt)],
                    EW,
                    |g, x| one(g.binary(op, x[0], x[1])?),
                );
            }
        }
        for dist in [Dist::Ties, Dist::Special, Dist::Halves] {
            for dt in [DType::F32, DType::F16] {
                s.check(
                    &format!("{} {dt} {dist:?}", op.name()),
                    &[
                        inp("a", &[6, 7], dt).dist(dist),
                        inp("b", &[6, 7], dt).dist(dist),
                    ],
                    EW,
                    |g, x| one(g.binary(op, x[0], x[1])?),
                );
            }
        }
    }
    // Pow with a positive base and larger exponents, mod with negative operands.
    s.check(
        "pow positive base",
        &[
            inp("a", &[5, 6], DType::F32).dist(Dist::Positive),
            inp("b", &[6], DType::F32).dist(Dist::Uniform(-4.0, 4.0)),
        ],
        EW,
        |g, x| one(g.pow(x[0], x[1])?),
    );
    s.check(
        "mod wide",
        &[
            inp("a", &[5, 6], DType::F64).dist(Dist::Uniform(-50.0, 50.0)),
            inp("b", &[5, 1], DType::F64).dist(Dist::Uniform(-7.0, 7.0)),
        ],
        EW,
        |g, x| one(g.modulo(x[0], x[1])?),
    );
}

#[test]
fn binary_integer_ops() {
    let mut s = Suite::new(0x04);
    let arith = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Pow,
        BinaryOp::Max,
        BinaryOp::Min,
        BinaryOp::Mod,
    ];
    let cmp = [
        BinaryOp::Eq,
        BinaryOp::Ne,
        BinaryOp::Lt,
        BinaryOp::Le,
        BinaryOp::Gt,
        BinaryOp::Ge,
    ];
    for op in arith.into_iter().chain(cmp) {
        // Divisors include zero and negative numbers (x / 0 and x mod 0 are defined as 0).
        let (da, db) = match op {
            BinaryOp::Pow => (Dist::Int(-4, 4), Dist::Int(-2, 6)),
            _ => (Dist::Int(-9, 9), Dist::Int(-4, 4)),
        };
        for dt in [DType::I32, DType::I64, DType::I8] {
            for (a, b) in BROADCAST {
                s.check(
                    &format!("{} {dt} {a:?} {b:?}", op.name()),
                    &[inp("a", a, dt).dist(da), inp("b", b, dt).dist(db)],
                    EW,
                    |g, x| one(g.binary(op, x[0], x[1])?),
                );
            }
        }
        s.check(
            &format!("{} u8", op.name()),
            &[
                inp("a", &[4, 5], DType::U8).dist(Dist::Int(0, 255)),
                inp("b", &[5], DType::U8).dist(Dist::Int(0, 4)),
            ],
            EW,
            |g, x| one(g.binary(op, x[0], x[1])?),
        );
    }
    // Wrapping at the type's width.
    for op in [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Mod,
    ] {
        let full = Dist::Int(i32::MIN as i64, i32::MAX as i64);
        s.check(
            &format!("{} i32 full range", op.name()),
            &[
                inp("a", &[8, 9], DType::I32).dist(full),
                inp("b", &[8, 9], DType::I32).dist(full),
            ],
            EW,
            |g, x| one(g.binary(op, x[0], x[1])?),
        );
        s.check(
            &format!("{} i8 full range", op.name()),
            &[
                inp("a", &[8, 9], DType::I8).dist(Dist::Int(-128, 127)),
                inp("b", &[9], DType::I8).dist(Dist::Int(-128, 127)),
            ],
            EW,
            |g, x| one(g.binary(op, x[0], x[1])?),
        );
    }
    // Integer division of i32::MIN by -1 wraps.
    s.check(
        "div i32 min by -1",
        &[
            inp("a", &[4], DType::I32).dist(Dist::Int(i32::MIN as i64, i32::MIN as i64 + 1)),
            inp("b", &[4], DType::I32).dist(Dist::Int(-1, -1)),
        ],
        EW,
        |g, x| Ok(vec![g.div(x[0], x[1])?, g.modulo(x[0], x[1])?]),
    );
}

#[test]
fn bitwise_and_shift_ops() {
    let mut s = Suite::new(0x05);
    let cases = [
        (DType::U8, Dist::Int(0, 255)),
        (DType::I8, Dist::Int(-128, 127)),
        (DType::U16, Dist::Int(0, 65535)),
        (DType::I16, Dist::Int(-32768, 32767)),
        (DType::I32, Dist::Int(i32::MIN as i64, i32::MAX as i64)),
        (DType::U32, Dist::Int(0, u32::MAX as i64)),
        (DType::I64, Dist::Int(-(1 << 40), 1 << 40)),
        (DType::U64, Dist::Int(0, 1 << 40)),
    ];
    for op in [BinaryOp::BitAnd, BinaryOp::BitOr, BinaryOp::BitXor] {
        for (dt, dist) in cases {
            for (a, b) in BROADCAST {
                s.check(
                    &format!("{} {dt} {a:?} {b:?}", op.name()),
                    &[inp("a", a, dt).dist(dist), inp("b", b, dt).dist(dist)],
                    EW,
                    |g, x| one(g.binary(op, x[0], x[1])?),
                );
            }
        }
    }
    // Shift amounts past the width give 0.
    for op in [BinaryOp::ShiftLeft, BinaryOp::ShiftRight] {
        for (dt, dist, width) in [
            (DType::U8, Dist::Int(0, 255), 8),
            (DType::U16, Dist::Int(0, 65535), 16),
            (DType::U32, Dist::Int(0, u32::MAX as i64), 32),
            (DType::U64, Dist::Int(0, 1 << 40), 64),
        ] {
            s.check(
                &format!("{} {dt}", op.name()),
                &[
                    inp("a", &[5, 7], dt).dist(dist),
                    inp("b", &[7], dt).dist(Dist::Int(0, width + 2)),
                ],
                EW,
                |g, x| one(g.binary(op, x[0], x[1])?),
            );
        }
    }
    for (dt, dist) in cases {
        s.check(
            &format!("bit_not {dt}"),
            &[inp("x", &[3, 5, 7], dt).dist(dist)],
            EW,
            |g, x| one(g.unary(UnaryOp::BitNot, x[0])?),
        );
    }
    // Known values, independent of the shared scalar definitions.
    let g = Graph::new("bits");
    let a = g
        .constant(TensorData::U8(vec![0b1100_1010, 255, 1]), &[3])
        .unwrap();
    let b = g
        .constant(TensorData::U8(vec![0b1010_0110, 3, 9]), &[3])
        .unwrap();
    let outs = [
        g.binary(BinaryOp::BitAnd, a, b).unwrap(),
        g.binary(BinaryOp::BitOr, a, b).unwrap(),
        g.binary(BinaryOp::BitXor, a, b).unwrap(),
        g.binary(BinaryOp::ShiftLeft, a, b).unwrap(),
        g.binary(BinaryOp::ShiftRight, a, b).unwrap(),
        g.unary(UnaryOp::BitNot, a).unwrap(),
    ];
    g.set_outputs(outs.to_vec());
    let got = evaluate(&g, &mut HashMap::new()).unwrap();
    let want: [[f64; 3]; 6] = [
        [0b1000_0010 as f64, 3.0, 1.0],
        [0b1110_1110 as f64, 255.0, 9.0],
        [0b0110_1100 as f64, 252.0, 8.0],
        [0.0, 248.0, 0.0],
        [0.0, 31.0, 0.0],
        [0b0011_0101 as f64, 0.0, 254.0],
    ];
    for (t, w) in got.iter().zip(want) {
        assert_eq!(t.data, w, "{:?}", t.shape);
    }
    // Floats and bools are rejected.
    let f = g.input("f", Shape::new(&[3], DType::F32)).unwrap();
    let t = g.input("t", Shape::new(&[3], DType::Bool)).unwrap();
    for x in [f, t] {
        assert!(g.binary(BinaryOp::BitAnd, x, x).is_err());
        assert!(g.unary(UnaryOp::BitNot, x).is_err());
    }
}

#[test]
fn maximum_rank() {
    let mut s = Suite::new(0x1F);
    let a: &[usize] = &[2, 1, 2, 1, 2, 1, 2, 3];
    let b: &[usize] = &[2, 1, 2, 1, 2, 1, 3];
    for op in [BinaryOp::Add, BinaryOp::Mul, BinaryOp::Lt] {
        s.check(
            &format!("{} rank 8", op.name()),
            &[inp("a", a, DType::F32), inp("b", b, DType::F32)],
            EW,
            |g, x| one(g.binary(op, x[0], x[1])?),
        );
    }
    s.check(
        "rank 8 reduce/permute/slice/softmax",
        &[inp("x", &[2, 3, 1, 2, 2, 1, 3, 2], DType::F32)],
        acc(24),
        |g, x| {
            Ok(vec![
                g.sum(x[0], &[0, 3, -1], true)?,
                g.reduce_max(x[0], &[1, 6], false)?,
                g.permute(x[0], &[7, 0, 6, 1, 5, 2, 4, 3])?,
                g.slice(x[0], 6, 2, 0, -1)?,
                g.softmax(x[0], 1)?,
                g.cumsum(x[0], -2, true, false)?,
                g.expand(g.slice(x[0], 0, 0, 1, 1)?, &[2, 3, 4, 2, 2, 5, 3, 2])?,
            ])
        },
    );
    s.check(
        "rank 8 pad/tile/concat",
        &[inp("x", &[1, 2, 1, 2, 1, 2, 1, 2], DType::I32)],
        EW,
        |g, x| {
            let pads = [
                (0, 1),
                (1, 0),
                (0, 0),
                (1, 1),
                (0, 0),
                (0, 1),
                (1, 0),
                (0, 0),
            ];
            Ok(vec![
                g.pad(x[0], &pads, PadMode::Edge)?,
                g.tile(x[0], &[2, 1, 2, 1, 1, 1, 2, 1])?,
                g.concat(&[x[0], x[0]], 4)?,
            ])
        },
    );
}

#[test]
fn logical_and_bool_ops() {
    let mut s = Suite::new(0x05);
    for op in [
        BinaryOp::And,
        BinaryOp::Or,
        BinaryOp::Xor,
        BinaryOp::Eq,
        BinaryOp::Ne,
    ] {
        for (a, b) in BROADCAST {
            s.check(
                &format!("{} bool {a:?} {b:?}", op.name()),
                &[inp("a", a, DType::Bool), inp("b", b, DType::Bool)],
                EW,
                |g, x| one(g.binary(op, x[0], x[1])?),
            );
        }
    }
    s.check(
        "logic chain",
        &[
            inp("a", &[4, 6], DType::F32),
            inp("b", &[6], DType::F32),
            inp("m", &[4, 1], DType::Bool),
        ],
        EW,
        |g, x| {
            let lt = g.lt(x[0], x[1])?;
            let ge = g.ge(x[0], x[1])?;
            let any = g.or(lt, x[2])?;
            let both = g.and(any, g.not(ge)?)?;
            Ok(vec![g.xor(both, x[2])?, g.eq(lt, g.not(ge)?)?])
        },
    );
}

#[test]
fn select_where() {
    let mut s = Suite::new(0x06);
    let shapes: [(&[usize], &[usize], &[usize]); 9] = [
        (&[3, 5, 7], &[3, 5, 7], &[3, 5, 7]),
        // A mask over the last axes, broadcast over the leading ones (a causal mask
        // over heads), and one broadcast along inner axes.
        (&[6, 9], &[2, 3, 6, 9], &[]),
        (&[2, 1, 4, 1], &[2, 3, 4, 5], &[3, 1, 5]),
        (&[3, 1, 7], &[5, 7], &[]),
        (&[7], &[3, 5, 1], &[3, 1, 7]),
        (&[2, 0, 3], &[3], &[1]),
        (&[], &[4, 4], &[4, 1]),
        // One condition for whole operands (a guarded update).
        (&[1], &[3, 4], &[3, 4]),
        (&[], &[2, 3, 5], &[2, 3, 5]),
    ];
    for dt in [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::I8,
        DType::U8,
        DType::Bool,
    ] {
        for (c, a, b) in shapes {
            s.check(
                &format!("where {dt} {c:?} {a:?} {b:?}"),
                &[inp("c", c, DType::Bool), inp("a", a, dt), inp("b", b, dt)],
                EW,
                |g, x| one(g.select(x[0], x[1], x[2])?),
            );
        }
    }
    // A guarded update over a megabyte, which the CPU copies on several threads; the
    // two rounds draw the condition afresh, so both branches are likely taken.
    for dt in [DType::F32, DType::I64] {
        s.check(
            &format!("large guarded where {dt}"),
            &[
                inp("c", &[], DType::Bool),
                inp("a", &[600, 500], dt),
                inp("b", &[600, 500], dt),
            ],
            EW,
            |g, x| one(g.select(x[0], x[1], x[2])?),
        );
    }
    // Large masked selects, which the CPU runs in pieces of rows on its threads: a
    // causal mask broadcast over batch and heads with one value for the hidden
    // entries (either side), rows longer than a piece, and a mask along columns.
    type LargeWhere = (&'static [usize], &'static [usize], &'static [usize]);
    let large: [LargeWhere; 5] = [
        (&[128, 128], &[3, 4, 128, 128], &[]),
        (&[128, 128], &[], &[3, 4, 128, 128]),
        (&[1, 40000], &[3, 40000], &[1]),
        (&[300, 1], &[300, 400], &[300, 400]),
        (&[2, 1, 300, 200], &[2, 3, 300, 200], &[3, 1, 200]),
    ];
    for dt in [DType::F32, DType::F16, DType::I64, DType::U8] {
        for (c, a, b) in large {
            s.check(
                &format!("large where {dt} {c:?} {a:?} {b:?}"),
                &[inp("c", c, DType::Bool), inp("a", a, dt), inp("b", b, dt)],
                EW,
                |g, x| one(g.select(x[0], x[1], x[2])?),
            );
        }
    }
    s.check(
        "where with NaN branches",
        &[
            inp("c", &[5, 6], DType::Bool),
            inp("a", &[5, 6], DType::F32).dist(Dist::Special),
            inp("b", &[6], DType::F32).dist(Dist::Special),
        ],
        EW,
        |g, x| one(g.select(x[0], x[1], x[2])?),
    );
}

#[test]
fn cast_between_dtypes() {
    let mut s = Suite::new(0x07);
    for from in DType::ALL {
        let dists: Vec<Dist> = match from {
            DType::F32 | DType::F64 | DType::F16 | DType::BF16 => vec![
                Dist::Default,
                Dist::Uniform(-300.0, 300.0),
                Dist::Special,
                Dist::Halves,
            ],
            DType::I32 => vec![
                Dist::Int(-100_000, 100_000),
                Dist::Int(i32::MIN as i64, i32::MAX as i64),
            ],
            DType::I64 => vec![Dist::Int(-100_000, 100_000), Dist::Int(-(1 << 50), 1 << 50)],
            DType::I8 => vec![Dist::Int(-128, 127)],
            DType::U8 => vec![Dist::Int(0, 255)],
            DType::I16 => vec![Dist::Int(-32768, 32767)],
            DType::U16 => vec![Dist::Int(0, 65535)],
            DType::U32 => vec![Dist::Int(0, u32::MAX as i64)],
            DType::U64 => vec![Dist::Int(0, 1 << 50)],
            DType::Bool => vec![Dist::Default],
        };
        for to in DType::ALL {
            for &dist in &dists {
                s.check(
                    &format!("cast {from} -> {to} {dist:?}"),
                    &[inp("x", &[4, 6], from).dist(dist)],
                    EW,
                    |g, x| one(g.cast(x[0], to)?),
                );
            }
        }
    }
    s.check(
        "cast empty",
        &[inp("x", &[0, 3], DType::F32)],
        EW,
        |g, x| one(g.cast(x[0], DType::I8)?),
    );
    s.check(
        "cast round trip",
        &[inp("x", &[5, 5], DType::F32).dist(Dist::Uniform(-1000.0, 1000.0))],
        EW,
        |g, x| {
            let i = g.cast(x[0], DType::I32)?;
            let h = g.cast(i, DType::F16)?;
            Ok(vec![g.cast(h, DType::F64)?, g.cast(i, DType::U8)?])
        },
    );
}

// ---------------------------------------------------------------------------------------
// Reductions and normalizations
// ---------------------------------------------------------------------------------------

fn reduced_count(dims: &[usize], axes: &[isize]) -> usize {
    if axes.is_empty() {
        return dims.iter().product();
    }
    axes.iter()
        .map(|&a| {
            dims[if a < 0 {
                (a + dims.len() as isize) as usize
            } else {
                a as usize
            }]
        })
        .product()
}

#[test]
fn reductions() {
    let mut s = Suite::new(0x08);
    let ops = [
        ReduceOp::Sum,
        ReduceOp::Mean,
        ReduceOp::Max,
        ReduceOp::Min,
        ReduceOp::Prod,
    ];
    let axes_sets: [&[isize]; 7] = [&[0], &[1], &[-1], &[0, 2], &[-1, 0], &[], &[1, -1]];
    let dims = [3, 5, 7];
    for op in ops {
        for dt in FLOATS {
            for axes in axes_sets {
                for keepdims in [false, true] {
                    let tol = acc(reduced_count(&dims, axes));
                    s.check(
                        &format!("reduce_{} {dt} {axes:?} keep={keepdims}", op.name()),
                        &[inp("x", &dims, dt)],
                        tol,
                        |g, x| one(g.reduce(op, x[0], axes, keepdims)?),
                    );
                }
            }
        }
        for dt in [DType::I32, DType::I64, DType::I8, DType::U8] {
            if op == ReduceOp::Mean {
                continue;
            }
            let dist = if dt == DType::I8 {
                Dist::Int(-128, 127)
            } else {
                Dist::Default
            };
            for axes in axes_sets {
                s.check(
                    &format!("reduce_{} {dt} {axes:?}", op.name()),
                    &[inp("x", &dims, dt).dist(dist)],
                    EW,
                    |g, x| one(g.reduce(op, x[0], axes, axes.len() == 1)?),
                );
            }
        }
        // Integer results wider than f64's 53-bit mantissa before wrapping to i32.
        if op != ReduceOp::Mean {
            s.check(
                &format!("reduce_{} i32 wide", op.name()),
                &[inp("x", &[4, 7], DType::I32).dist(Dist::Int(-100_000, 100_000))],
                EW,
                |g, x| {
                    Ok(vec![
                        g.reduce(op, x[0], &[1], false)?,
                        g.reduce(op, x[0], &[], false)?,
                    ])
                },
            );
        }
        // Long reductions over inner, middle and outer axes: a warp per output on
        // CUDA, and a block per output for few outputs from thousands of values each
        // (a whole tensor into one value, column sums, a middle axis).
        // (label, dims, dtypes, reductions, the count the tolerance allows for)
        type Long = (
            &'static str,
            [usize; 3],
            [DType; 3],
            &'static [&'static [isize]],
            usize,
        );
        let longs: [Long; 2] = [
            (
                "long",
                [2, 100, 3],
                [DType::F32, DType::F16, DType::I64],
                &[&[1], &[-1, 1], &[]],
                300,
            ),
            (
                "few outputs",
                [3, 1500, 50],
                [DType::F32, DType::F64, DType::I64],
                &[&[], &[0, 1], &[1], &[-1, 1]],
                3 * 1500 * 50,
            ),
        ];
        for (what, dims, dtypes, axes_sets, count) in longs {
            for dt in dtypes {
                if op == ReduceOp::Mean && dt == DType::I64 {
                    continue;
                }
                s.check(
                    &format!("reduce_{} {dt} {what}", op.name()),
                    &[inp("x", &dims, dt)],
                    if dt == DType::I64 { EW } else { acc(count) },
                    |g, x| {
                        axes_sets
                            .iter()
                            .enumerate()
                            .map(|(k, axes)| g.reduce(op, x[0], axes, k % 2 == 1))
                            .collect()
                    },
                );
            }
        }
        // NaN and infinities among tens of thousands of values per output (a block of
        // 512 threads per output on CUDA, combining its warps' partials).
        s.check(
            &format!("reduce_{} special few outputs", op.name()),
            &[inp("x", &[4, 20000], DType::F32).dist(Dist::Special)],
            acc(20000),
            |g, x| one(g.reduce(op, x[0], &[1], false)?),
        );
        // Consecutive axes run as one: column sums over leading axes and row sums over
        // trailing ones, both large enough to be split between threads.
        if matches!(op, ReduceOp::Sum | ReduceOp::Mean) {
            s.check(
                &format!("reduce_{} f32 consecutive axes", op.name()),
                &[inp("x", &[6, 64, 130], DType::F32)],
                acc(6 * 64),
                |g, x| {
                    Ok(vec![
                        g.reduce(op, x[0], &[0, 1], true)?,
                        g.reduce(op, x[0], &[1, 2], false)?,
                        g.reduce(op, x[0], &[0, 1, 2], false)?,
                        g.reduce(op, x[0], &[1], false)?,
                    ])
                },
            );
        }
        s.check(
            &format!("reduce_{} special long", op.name()),
            &[inp("x", &[3, 90], DType::F32).dist(Dist::Special)],
            acc(90),
            |g, x| one(g.reduce(op, x[0], &[1], false)?),
        );
        // NaN and infinities propagate.
        s.check(
            &format!("reduce_{} special", op.name()),
            &[inp("x", &[6, 5], DType::F32).dist(Dist::Special)],
            acc(5),
            |g, x| {
                Ok(vec![
                    g.reduce(op, x[0], &[1], false)?,
                    g.reduce(op, x[0], &[0], true)?,
                ])
            },
        );
        // Size-1 and empty dimensions. Max and min are not defined over an empty set.
        s.check(
            &format!("reduce_{} size-1", op.name()),
            &[inp("x", &[1, 4, 1], DType::F32)],
            acc(4),
            |g, x| {
                Ok(vec![
                    g.reduce(op, x[0], &[0, 2], false)?,
                    g.reduce(op, x[0], &[], true)?,
                ])
            },
        );
        s.check(
            &format!("reduce_{} empty kept axis", op.name()),
            &[inp("x", &[3, 0, 4], DType::F32)],
            acc(3),
            |g, x| one(g.reduce(op, x[0], &[0], false)?),
        );
        if matches!(op, ReduceOp::Max | ReduceOp::Min) {
            let g = Graph::new("empty max");
            let x = g.input("x", Shape::new(&[3, 0, 4], DType::F32)).unwrap();
            assert!(g.reduce(op, x, &[1], false).is_err());
        } else {
            s.check(
                &format!("reduce_{} over empty axis", op.name()),
                &[inp("x", &[3, 0, 4], DType::F32)],
                EW,
                |g, x| {
                    Ok(vec![
                        g.reduce(op, x[0], &[1], false)?,
                        g.reduce(op, x[0], &[], true)?,
                    ])
                },
            );
            if op != ReduceOp::Mean {
                s.check(
                    &format!("reduce_{} i32 over empty axis", op.name()),
                    &[inp("x", &[0, 5], DType::I32)],
                    EW,
                    |g, x| one(g.reduce(op, x[0], &[0], false)?),
                );
            }
        }
    }
    s.check(
        "reduce scalar",
        &[inp("x", &[], DType::F32), inp("i", &[], DType::I64)],
        EW,
        |g, x| {
            Ok(vec![
                g.sum(x[0], &[], true)?,
                g.reduce_max(x[0], &[], false)?,
                g.prod(x[1], &[], false)?,
            ])
        },
    );
    // A long reduction.
    s.check(
        "sum long",
        &[inp("x", &[4, 4096], DType::F32)],
        acc(4096),
        |g, x| one(g.sum(x[0], &[-1], false)?),
    );
    s.check(
        "mean long f16",
        &[inp("x", &[3, 1000], DType::F16)],
        acc(1000),
        |g, x| one(g.mean(x[0], &[1], true)?),
    );
}

#[test]
fn argmax_argmin() {
    let mut s = Suite::new(0x09);
    for dt in [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::I8,
        DType::U8,
    ] {
        for dist in [Dist::Default, Dist::Ties, Dist::Special] {
            for axis in [0isize, 1, 2, -1, -2] {
                for keepdims in [false, true] {
                    s.check(
                        &format!("argmax/argmin {dt} {dist:?} axis {axis} keep={keepdims}"),
                        &[inp("x", &[3, 5, 7], dt).dist(dist)],
                        EW,
                        |g, x| {
                            Ok(vec![
                                g.argmax(x[0], axis, keepdims)?,
                                g.argmin(x[0], axis, keepdims)?,
                            ])
                        },
                    );
                }
            }
        }
    }
    s.check(
        "argmax size-1 axis",
        &[inp("x", &[4, 1], DType::F32)],
        EW,
        |g, x| Ok(vec![g.argmax(x[0], 1, false)?, g.argmin(x[0], -1, true)?]),
    );
    s.check(
        "argmax rank 1",
        &[inp("x", &[9], DType::F32).dist(Dist::Ties)],
        EW,
        |g, x| Ok(vec![g.argmax(x[0], 0, false)?, g.argmin(x[0], 0, true)?]),
    );
    s.check(
        "argmax empty outer",
        &[inp("x", &[0, 4], DType::F32)],
        EW,
        |g, x| one(g.argmax(x[0], 1, false)?),
    );
}

#[test]
fn softmax_and_log_softmax() {
    let mut s = Suite::new(0x0A);
    let dims = [3, 5, 7];
    for dt in FLOATS {
        for axis in [0isize, 1, 2, -1, -2, -3] {
            let n = dims[(axis.rem_euclid(3)) as usize];
            s.check(
                &format!("softmax {dt} axis {axis}"),
                &[inp("x", &dims, dt).dist(Dist::Uniform(-6.0, 6.0))],
                acc(n),
                |g, x| Ok(vec![g.softmax(x[0], axis)?, g.log_softmax(x[0], axis)?]),
            );
        }
    }
    s.check(
        "softmax size-1 axis",
        &[inp("x", &[4, 1], DType::F32)],
        EW,
        |g, x| Ok(vec![g.softmax(x[0], 1)?, g.log_softmax(x[0], -1)?]),
    );
    s.check(
        "softmax empty",
        &[inp("x", &[0, 6], DType::F32)],
        EW,
        |g, x| Ok(vec![g.softmax(x[0], 1)?, g.log_softmax(x[0], 0)?]),
    );
    s.check(
        "softmax -inf",
        &[inp("x", &[4, 6], DType::F32).dist(Dist::NegInf)],
        acc(6),
        |g, x| Ok(vec![g.softmax(x[0], 1)?, g.log_softmax(x[0], 1)?]),
    );
    s.check(
        "softmax rows wider than a block",
        &[inp("x", &[3, 1500], DType::F16).dist(Dist::Uniform(-6.0, 6.0))],
        acc(1500),
        |g, x| Ok(vec![g.softmax(x[0], -1)?, g.log_softmax(x[0], 0)?]),
    );
    s.check(
        "softmax large",
        &[inp("x", &[2, 300], DType::F32).dist(Dist::Uniform(-80.0, 80.0))],
        acc(300),
        |g, x| Ok(vec![g.softmax(x[0], -1)?, g.log_softmax(x[0], -1)?]),
    );
}

#[test]
fn layer_norm_and_rms_norm() {
    let mut s = Suite::new(0x0B);
    // Rows wider than a block's threads (1000, 2048) too, and enough rows for a GPU
    // to give each its own warp (300 x 384, 260 x 4096, the widest a warp takes).
    let shapes: [&[usize]; 8] = [
        &[3, 5, 16],
        &[7],
        &[4, 1],
        &[0, 8],
        &[2, 1000],
        &[3, 2048],
        &[3, 100, 384],
        &[260, 4096],
    ];
    for dt in FLOATS {
        for dims in shapes {
            let d = dims[dims.len() - 1];
            let ins = [
                inp("x", dims, dt).dist(Dist::Uniform(-3.0, 3.0)),
                inp("gamma", &[d], dt),
                inp("beta", &[d], dt),
            ];
            s.check(
                &format!("layer_norm {dt} {dims:?}"),
                &ins,
                acc(d),
                |g, x| {
                    Ok(vec![
                        g.layer_norm(x[0], x[1], x[2], 1e-5)?,
                        g.rms_norm(x[0], x[1], 1e-6)?,
                    ])
                },
            );
        }
    }
    s.check(
        "layer_norm large eps",
        &[
            inp("x", &[6, 32], DType::F32),
            inp("gamma", &[32], DType::F32),
            inp("beta", &[32], DType::F32),
        ],
        acc(32),
        |g, x| {
            Ok(vec![
                g.layer_norm(x[0], x[1], x[2], 0.5)?,
                g.rms_norm(x[0], x[1], 0.25)?,
            ])
        },
    );
    s.check(
        "layer_norm offset input",
        &[
            inp("x", &[5, 64], DType::F32).dist(Dist::Uniform(10.0, 12.0)),
            inp("gamma", &[64], DType::F32),
            inp("beta", &[64], DType::F32),
        ],
        acc(64),
        |g, x| one(g.layer_norm(x[0], x[1], x[2], 1e-5)?),
    );
}

#[test]
fn norm_gradients() {
    let mut s = Suite::new(0x3B);
    // Rows narrower and wider than 16 lanes with ragged tails, fewer rows than the
    // scale gradient's row blocks, and the character GPT's 2048 x 256.
    let shapes: [&[usize]; 7] = [
        &[3, 5, 16],
        &[7],
        &[4, 1],
        &[0, 8],
        &[5, 33],
        &[2, 1000],
        &[16, 128, 256],
    ];
    // The gradient rules emit these ops in f32 and f64; a half-precision graph that
    // builds them by hand runs a backend's decomposition, which rounds every step.
    let build = |g: &Graph, x: &[NodeId]| {
        Ok(vec![
            g.norm_grad(x[0], x[1], x[2], 1e-5, true)?,
            g.norm_grad(x[0], x[1], x[2], 1e-6, false)?,
            g.norm_scale_grad(x[0], x[2], 1e-5, true)?,
            g.norm_scale_grad(x[0], x[2], 0.25, false)?,
        ])
    };
    let inputs = |dims: &[usize], dt: DType| {
        [
            inp("x", dims, dt).dist(Dist::Uniform(-3.0, 3.0)),
            inp("gamma", &[dims[dims.len() - 1]], dt),
            inp("dy", dims, dt),
        ]
    };
    let tol = |dims: &[usize]| acc(dims.iter().copied().max().unwrap_or(1));
    for dt in [DType::F32, DType::F64] {
        for dims in shapes {
            let label = format!("norm gradients {dt} {dims:?}");
            s.check(&label, &inputs(dims, dt), tol(dims), build);
        }
    }
    // The decompositions, which a backend without the row kernels runs, on the CPU.
    for dims in shapes {
        check_decomposed_on_cpu(
            &format!("norm gradients decomposed {dims:?}"),
            mix(0x3B00 + dims.len() as u64),
            &inputs(dims, DType::F32),
            tol(dims),
            build,
        );
    }
}

/// Runs `build` over `inputs` on the CPU compiled as a primitives-only backend
/// (every composite decomposed: none may name a kernel) and compares each output
/// with the reference evaluator on fresh random data drawn from `seed`.
fn check_decomposed_on_cpu(
    label: &str,
    seed: u64,
    inputs: &[In],
    tol: Tol,
    build: impl Fn(&Graph, &[NodeId]) -> Result<Vec<NodeId>>,
) {
    let g = Graph::new(label);
    let ids: Vec<NodeId> = inputs
        .iter()
        .map(|i| g.input(i.name.clone(), i.shape.clone()).unwrap())
        .collect();
    g.set_outputs(build(&g, &ids).unwrap());
    let options = CompileOptions::new().primitives_only(true);
    let mut model = Session::new(Device::Cpu)
        .compile_with(&g, &options)
        .unwrap();
    let composites: Vec<String> = model
        .plan()
        .graph
        .nodes()
        .iter()
        .filter(|n| rlx::ir::decompose::is_composite(&n.op))
        .map(|n| n.op.name())
        .collect();
    assert!(composites.is_empty(), "{label}: left {composites:?}");
    let mut rng = Rng::new(seed);
    let mut values = HashMap::new();
    let mut data = Vec::new();
    for i in inputs {
        let t = random_tensor(&mut rng, &i.shape, i.dist);
        data.push((i.name.as_str(), t.to_data()));
        values.insert(i.name.clone(), t);
    }
    let want = evaluate(&g, &mut values).unwrap();
    let feed: Vec<(&str, TensorRef<'_>)> = data.iter().map(|(n, d)| (*n, d.as_ref())).collect();
    let got = model.run_typed(&feed).unwrap();
    for (k, (a, w)) in got.iter().zip(&want).enumerate() {
        compare(label, &format!("output {k}"), a, w, tol);
    }
}

#[test]
fn norm_gradients_reject_mismatched_shapes() {
    let g = Graph::new("norm_grad_errors");
    let x = g.input("x", Shape::new(&[4, 8], DType::F32)).unwrap();
    let gamma = g.input("gamma", Shape::new(&[8], DType::F32)).unwrap();
    let short = g.input("short", Shape::new(&[4, 7], DType::F32)).unwrap();
    let wide = g.input("wide", Shape::new(&[7], DType::F32)).unwrap();
    let err = g.norm_grad(x, gamma, short, 1e-5, true).unwrap_err();
    assert!(err.to_string().contains("norm_grad"), "{err}");
    let err = g.norm_grad(x, wide, x, 1e-5, true).unwrap_err();
    assert!(err.to_string().contains("[8]"), "{err}");
    let err = g.norm_scale_grad(x, short, 1e-5, false).unwrap_err();
    assert!(err.to_string().contains("norm_scale_grad"), "{err}");
    // The graph still builds after the rejected calls.
    let ok = g.norm_scale_grad(x, x, 1e-5, false).unwrap();
    assert_eq!(g.shape(ok).unwrap().dims(), &[8]);
}

#[test]
fn matmul_shapes() {
    let mut s = Suite::new(0x0C);
    let shapes: [(&[usize], &[usize]); 14] = [
        (&[4, 6], &[6, 5]),
        (&[2, 4, 6], &[2, 6, 5]),
        (&[2, 1, 4, 6], &[3, 6, 5]),
        (&[4, 6], &[3, 6, 5]),
        (&[2, 3, 4, 6], &[6, 5]),
        // B's batch dims are all 1: the batch folds into the rows of one product.
        (&[2, 3, 4, 6], &[1, 6, 5]),
        (&[5, 6], &[1, 1, 6, 5]),
        (&[6], &[2, 6, 5]),
        (&[2, 4, 6], &[6]),
        (&[6], &[6]),
        (&[1, 1], &[1, 1]),
        (&[3, 0], &[0, 4]),
        (&[0, 5], &[5, 3]),
        (&[2, 0, 4, 3], &[3, 2]),
    ];
    for dt in FLOATS {
        for (a, b) in shapes {
            let k = a[a.len() - 1];
            s.check(
                &format!("matmul {dt} {a:?} x {b:?}"),
                &[inp("a", a, dt), inp("b", b, dt)],
                acc(k),
                |g, x| one(g.matmul(x[0], x[1])?),
            );
        }
    }
    for dt in [DType::F32, DType::F64] {
        s.check(
            &format!("matmul {dt} K=257"),
            &[inp("a", &[9, 257], dt), inp("b", &[257, 11], dt)],
            acc(257),
            |g, x| one(g.matmul(x[0], x[1])?),
        );
    }
    s.check(
        "matmul with constant operands",
        &[inp("a", &[3, 4], DType::F32)],
        acc(4),
        |g, x| {
            let w: Vec<f32> = (0..8).map(|i| i as f32 * 0.25 - 1.0).collect();
            let c = g.constant_f32(&w, &[4, 2])?;
            let v = g.constant_f32(&[0.5, -1.5, 2.0], &[3])?;
            Ok(vec![
                g.matmul(x[0], c)?,
                g.matmul(v, x[0])?,
                g.matmul(g.slice(x[0], 0, 1, 3, 1)?, c)?,
            ])
        },
    );
    // Operands that are views (transposed copies, slices) and a matmul feeding a matmul.
    s.check(
        "matmul of transposes",
        &[
            inp("a", &[6, 4], DType::F32),
            inp("b", &[3, 5, 6], DType::F32),
        ],
        acc(36),
        |g, x| {
            let at = g.transpose(x[0], 0, 1)?;
            let bt = g.transpose(x[1], -1, -2)?;
            let first = g.slice(x[1], 0, 1, 2, 1)?;
            let chained = g.matmul(g.matmul(x[1], x[0])?, at)?;
            Ok(vec![g.matmul(at, bt)?, g.matmul(first, x[0])?, chained])
        },
    );
}

// ---------------------------------------------------------------------------------------
// Data movement
// ---------------------------------------------------------------------------------------

#[test]
fn reshape_squeeze_unsqueeze() {
    let mut s = Suite::new(0x0D);
    for dt in [DType::F32, DType::I64, DType::Bool, DType::F16] {
        s.check(
            &format!("reshape {dt}"),
            &[inp("x", &[3, 5, 4], dt)],
            EW,
            |g, x| {
                Ok(vec![
                    g.reshape(x[0], &[15, 4])?,
                    g.reshape_infer(x[0], &[-1, 6])?,
                    g.reshape_infer(x[0], &[2, -1, 5, 1])?,
                    g.reshape(x[0], &[60])?,
                ])
            },
        );
    }
    s.check(
        "reshape then compute",
        &[
            inp("x", &[3, 5, 4], DType::F32),
            inp("y", &[4, 15], DType::F32),
        ],
        EW,
        |g, x| {
            let r = g.reshape(x[0], &[4, 15])?;
            let z = g.add(r, x[1])?;
            let back = g.reshape_infer(z, &[3, -1])?;
            Ok(vec![g.exp(back)?, back])
        },
    );
    s.check(
        "reshape empty",
        &[inp("x", &[2, 0, 3], DType::F32)],
        EW,
        |g, x| {
            Ok(vec![
                g.reshape(x[0], &[0, 6])?,
                g.reshape_infer(x[0], &[-1, 3])?,
            ])
        },
    );
    s.check(
        "reshape scalar",
        &[inp("x", &[], DType::F32)],
        EW,
        |g, x| {
            Ok(vec![
                g.reshape(x[0], &[1, 1])?,
                g.reshape(g.neg(x[0])?, &[1])?,
            ])
        },
    );
    s.check(
        "squeeze/unsqueeze",
        &[inp("x", &[1, 3, 1, 4], DType::F32)],
        EW,
        |g, x| {
            let a = g.squeeze(x[0], &[])?;
            let b = g.squeeze(x[0], &[0])?;
            let c = g.squeeze(x[0], &[-2, 0])?;
            let d = g.unsqueeze(a, &[0, -1])?;
            let e = g.unsqueeze(c, &[1])?;
            Ok(vec![a, b, c, g.sin(d)?, e])
        },
    );
    let g = Graph::new("bad squeeze");
    let x = g.input("x", Shape::new(&[1, 3], DType::F32)).unwrap();
    assert!(g.squeeze(x, &[1]).is_err());
    assert!(g.reshape(x, &[4]).is_err());
    assert!(g.reshape_infer(x, &[-1, -1]).is_err());
}

#[test]
fn permute_and_transpose() {
    let mut s = Suite::new(0x0E);
    let perms: [&[usize]; 5] = [
        &[0, 1, 2, 3],
        &[3, 2, 1, 0],
        &[0, 2, 1, 3],
        &[1, 3, 0, 2],
        &[2, 0, 3, 1],
    ];
    for dt in [DType::F32, DType::F64, DType::I8, DType::Bool, DType::BF16] {
        for perm in perms {
            s.check(
                &format!("permute {dt} {perm:?}"),
                &[inp("x", &[2, 3, 4, 5], dt)],
                EW,
                |g, x| one(g.permute(x[0], perm)?),
            );
        }
    }
    // Large enough for the tiled transpose to split over threads, with edges that are
    // not whole tiles: a rotation of the axes and a batched swap of the last two.
    for dt in [DType::F32, DType::F16, DType::U8, DType::I64] {
        for (dims, perm) in [
            (&[3usize, 70, 20, 33][..], &[3usize, 0, 1, 2][..]),
            (&[2, 5, 70, 99][..], &[0, 1, 3, 2][..]),
        ] {
            s.check(
                &format!("tiled transpose {dt} {dims:?} {perm:?}"),
                &[inp("x", dims, dt)],
                EW,
                |g, x| one(g.permute(x[0], perm)?),
            );
        }
    }
    // Over a megabyte: the CPU splits the copy's blocks between threads (the head
    // swap of an attention's gradient, and a rotation with short rows).
    for dt in [DType::F32, DType::F16, DType::I64] {
        for (dims, perm) in [
            (&[16usize, 130, 4, 66][..], &[0usize, 2, 1, 3][..]),
            (&[9, 7, 2500, 3][..], &[2, 0, 3, 1][..]),
        ] {
            s.check(
                &format!("large permute {dt} {dims:?} {perm:?}"),
                &[inp("x", dims, dt)],
                EW,
                |g, x| one(g.permute(x[0], perm)?),
            );
        }
    }
    // A channel shuffle: planes of 7 x 7 and 5 x 3 move whole (rows of 49 and 15
    // values, each narrower than a vector's worth on its own axis).
    for dt in [DType::F32, DType::F16, DType::I64] {
        for dims in [&[1usize, 2, 9, 7, 7][..], &[2, 3, 4, 5, 3][..]] {
            s.check(
                &format!("channel shuffle {dt} {dims:?}"),
                &[inp("x", dims, dt)],
                EW,
                |g, x| one(g.permute(x[0], &[0, 2, 1, 3, 4])?),
            );
        }
    }
    // The last output axis taken from an outer input axis, right after the input's
    // last axis (phases woven together, a depth-to-space): 2 and 3 ways, 5 ways (the
    // general loop), 4 ways past size-1 axes, and over a megabyte (threads).
    for dt in [DType::F32, DType::F16, DType::I8, DType::I64] {
        for (dims, perm) in [
            (&[2usize, 2, 2, 3, 5, 17][..], &[0usize, 3, 4, 1, 5, 2][..]),
            (&[1, 3, 3, 4, 6, 9][..], &[0, 3, 4, 1, 5, 2][..]),
            (&[2, 2, 5, 3, 7][..], &[0, 3, 1, 4, 2][..]),
            (&[2, 1, 4, 3, 1, 10][..], &[0, 3, 1, 4, 5, 2][..]),
            (&[1, 2, 2, 64, 32, 128][..], &[0, 3, 4, 1, 5, 2][..]),
        ] {
            s.check(
                &format!("interleave {dt} {dims:?} {perm:?}"),
                &[inp("x", dims, dt)],
                EW,
                |g, x| one(g.permute(x[0], perm)?),
            );
        }
    }
    s.check(
        "transpose",
        &[inp("x", &[3, 1, 6], DType::F32)],
        EW,
        |g, x| {
            Ok(vec![
                g.transpose(x[0], 0, -1)?,
                g.transpose(x[0], -2, -3)?,
                g.transpose(g.transpose(x[0], 0, 2)?, 2, 0)?,
            ])
        },
    );
    s.check(
        "permute empty",
        &[inp("x", &[2, 0, 3], DType::F32)],
        EW,
        |g, x| one(g.permute(x[0], &[2, 0, 1])?),
    );
    s.check(
        "permute then elementwise",
        &[inp("x", &[4, 6], DType::F32), inp("y", &[6, 4], DType::F32)],
        EW,
        |g, x| {
            let t = g.transpose(x[0], 0, 1)?;
            one(g.mul(g.add(t, x[1])?, t)?)
        },
    );
}

#[test]
fn slices() {
    let mut s = Suite::new(0x0F);
    // (axis, start, end, step) on [6, 7, 8].
    let specs: [(isize, isize, isize, isize); 12] = [
        (0, 1, 4, 1),
        (0, 2, 3, 1),
        (1, 0, 7, 2),
        (2, -3, 100, 1),
        (2, -1, isize::MIN, -1),
        (1, 5, 1, -2),
        (0, -2, -6, -1),
        (2, 3, 3, 1),
        (-1, 7, 2, -3),
        (-3, 0, 6, 4),
        (1, -100, 100, 3),
        (0, 5, 4, 1),
    ];
    for dt in [DType::F32, DType::I32, DType::F16, DType::Bool] {
        for (axis, start, end, step) in specs {
            s.check(
                &format!("slice {dt} axis {axis} {start}:{end}:{step}"),
                &[inp("x", &[6, 7, 8], dt)],
                EW,
                |g, x| one(g.slice(x[0], axis, start, end, step)?),
            );
        }
    }
    // Slices of a megabyte or more: the rows split between the threads, from an
    // offset start, with a step across rows and a reversed axis.
    for (label, axes) in [
        (
            "rows from an offset",
            vec![(1isize, 7isize, 290isize, 1isize)],
        ),
        (
            "every other plane, reversed rows",
            vec![(0, 0, 4, 2), (1, 299, 0, -1)],
        ),
        ("a column window", vec![(2, 13, 270, 1), (1, 2, 298, 1)]),
    ] {
        s.check(
            &format!("large slice {label}"),
            &[inp("x", &[4, 300, 300], DType::F32)],
            EW,
            move |g, x| one(g.slice_axes(x[0], &axes)?),
        );
    }
    // One depth tap of 3x3x3 filters: rows of nine values (copied under a mask with
    // AVX-512), in four-byte and other element sizes.
    for dt in [DType::F32, DType::I32, DType::F64] {
        s.check(
            &format!("slice of short rows {dt}"),
            &[inp("x", &[7, 5, 3, 3, 3], dt)],
            EW,
            |g, x| one(g.slice(x[0], 2, 1, 2, 1)?),
        );
    }
    // Several axes at once, and contiguous slices (views) feeding elementwise ops.
    s.check(
        "slice_axes",
        &[inp("x", &[6, 7, 8], DType::F32)],
        EW,
        |g, x| {
            Ok(vec![
                g.slice_axes(x[0], &[(0, 1, 5, 2), (2, 7, 0, -2)])?,
                g.slice_axes(x[0], &[(0, 2, 3, 1), (1, 1, 4, 1)])?,
                g.slice_axes(x[0], &[(-1, 0, 8, 1), (0, 0, 6, 1), (1, 0, 7, 1)])?,
                g.slice_axes(x[0], &[(0, 3, 4, 1), (1, 6, 7, 1), (2, 2, 3, 1)])?,
            ])
        },
    );
    s.check(
        "contiguous slice views",
        &[
            inp("x", &[6, 7, 8], DType::F32),
            inp("y", &[2, 7, 8], DType::F32),
        ],
        EW,
        |g, x| {
            let rows = g.slice(x[0], 0, 2, 4, 1)?;
            let one_row = g.slice_axes(x[0], &[(0, 5, 6, 1), (1, 2, 5, 1)])?;
            let a = g.add(rows, x[1])?;
            let b = g.exp(one_row)?;
            Ok(vec![a, b, rows, g.tanh(g.slice(a, 1, 3, 4, 1)?)?])
        },
    );
    s.check(
        "slice of slice",
        &[inp("x", &[10, 9], DType::F64)],
        EW,
        |g, x| {
            let a = g.slice(x[0], 0, 8, 0, -1)?;
            let b = g.slice(a, 1, 1, 8, 3)?;
            let c = g.slice(g.slice(x[0], 0, 2, 9, 1)?, 0, 1, 3, 1)?;
            Ok(vec![b, g.neg(c)?])
        },
    );
    s.check(
        "slice empty input",
        &[inp("x", &[0, 5], DType::F32)],
        EW,
        |g, x| one(g.slice(x[0], 1, 1, 4, 1)?),
    );
}

#[test]
fn concat_and_split() {
    let mut s = Suite::new(0x10);
    for dt in [DType::F32, DType::I64, DType::Bool, DType::F16, DType::I8] {
        s.check(
            &format!("concat middle axis {dt}"),
            &[
                inp("a", &[2, 3, 4], dt),
                inp("b", &[2, 1, 4], dt),
                inp("c", &[2, 5, 4], dt),
            ],
            EW,
            |g, x| {
                Ok(vec![
                    g.concat(&[x[0], x[1], x[2]], 1)?,
                    g.concat(&[x[2], x[0]], -2)?,
                ])
            },
        );
    }
    s.check(
        "concat axis 0 and -1",
        &[
            inp("a", &[2, 3], DType::F32),
            inp("b", &[4, 3], DType::F32),
            inp("c", &[2, 5], DType::F32),
        ],
        EW,
        |g, x| {
            Ok(vec![
                g.concat(&[x[0], x[1], x[0]], 0)?,
                g.concat(&[x[0], x[2], x[0]], -1)?,
                g.concat(&[x[1]], 1)?,
            ])
        },
    );
    s.check(
        "concat with empty",
        &[
            inp("a", &[2, 0, 4], DType::F32),
            inp("b", &[2, 3, 4], DType::F32),
            inp("c", &[2, 0, 4], DType::F32),
        ],
        EW,
        |g, x| {
            Ok(vec![
                g.concat(&[x[0], x[1], x[2]], 1)?,
                g.concat(&[x[0], x[2]], 1)?,
            ])
        },
    );
    s.check(
        "concat of computed values",
        &[inp("a", &[3, 4], DType::F32), inp("b", &[3, 2], DType::F32)],
        EW,
        |g, x| {
            let e = g.exp(x[0])?;
            let t = g.slice(x[0], 1, 0, 2, 1)?;
            Ok(vec![g.concat(&[e, x[1], t], 1)?])
        },
    );
    s.check(
        "concat of views",
        &[inp("x", &[6, 4], DType::F32)],
        EW,
        |g, x| {
            let a = g.slice(x[0], 0, 4, 6, 1)?;
            let b = g.reshape(g.slice(x[0], 0, 1, 2, 1)?, &[1, 4])?;
            Ok(vec![g.concat(&[a, b, a], 0)?, g.concat(&[b, x[0]], -2)?])
        },
    );
    for dt in [DType::F32, DType::I32] {
        s.check(
            &format!("split {dt}"),
            &[inp("x", &[3, 9, 4], dt)],
            EW,
            |g, x| {
                let mut outs = g.split(x[0], 1, &[2, 3, 4])?;
                outs.extend(g.split(x[0], -1, &[1, 0, 3])?);
                outs.extend(g.split(x[0], 0, &[3])?);
                Ok(outs)
            },
        );
    }
    s.check(
        "split then compute",
        &[inp("x", &[6, 4], DType::F32)],
        EW,
        |g, x| {
            let parts = g.split(x[0], 0, &[2, 2, 2])?;
            let y = g.mul(g.add(parts[0], parts[1])?, parts[2])?;
            Ok(vec![y, g.concat(&[parts[2], parts[0]], 0)?])
        },
    );
    let g = Graph::new("bad split");
    let x = g.input("x", Shape::new(&[3, 4], DType::F32)).unwrap();
    assert!(g.split(x, 1, &[2, 3]).is_err());
}

#[test]
fn gather_take() {
    let mut s = Suite::new(0x11);
    for idx_dt in [DType::I32, DType::I64, DType::I8, DType::U8] {
        let signed = idx_dt != DType::U8;
        for dt in [DType::F32, DType::I64, DType::F16, DType::Bool] {
            // data [5, 6, 4]; indices of several shapes along axes 0, 1 (middle), -1.
            for (axis, n) in [(0isize, 5i64), (1, 6), (-1, 4)] {
                let dist = if signed {
                    Dist::Int(-n, n - 1)
                } else {
                    Dist::Int(0, n - 1)
                };
                for idx_dims in [&[3][..], &[2, 3], &[], &[0]] {
                    s.check(
                        &format!("gather {dt} by {idx_dt} axis {axis} idx {idx_dims:?}"),
                        &[
                            inp("data", &[5, 6, 4], dt),
                            inp("idx", idx_dims, idx_dt).dist(dist),
                        ],
                        EW,
                        |g, x| one(g.gather(x[0], x[1], axis)?),
                    );
                }
            }
        }
    }
    s.check(
        "gather embedding then matmul",
        &[
            inp("table", &[10, 8], DType::F32),
            inp("ids", &[2, 5], DType::I64).dist(Dist::Int(-10, 9)),
            inp("w", &[8, 3], DType::F32),
        ],
        acc(8),
        |g, x| {
            let e = g.gather(x[0], x[1], 0)?;
            Ok(vec![e, g.matmul(e, x[2])?])
        },
    );
}

#[test]
fn expand_pad_tile() {
    let mut s = Suite::new(0x12);
    for dt in [DType::F32, DType::I32, DType::Bool, DType::F64] {
        s.check(
            &format!("expand {dt}"),
            &[
                inp("x", &[3, 1, 5], dt),
                inp("s", &[], dt),
                inp("w", &[2, 3, 4, 1, 5, 1], dt),
            ],
            EW,
            |g, x| {
                Ok(vec![
                    g.expand(x[0], &[2, 3, 4, 5])?,
                    // Rows two wide: a pooled value spread over its 2x2 window.
                    g.expand(x[2], &[2, 3, 4, 2, 5, 2])?,
                    g.expand(x[2], &[2, 3, 4, 3, 5, 17])?,
                    g.expand(x[0], &[3, 1, 5])?,
                    g.expand(x[1], &[2, 3])?,
                    g.expand(x[0], &[3, 0, 5])?,
                ])
            },
        );
    }
    let modes = [
        PadMode::Constant(F64Bits::new(1.5)),
        PadMode::Constant(F64Bits::new(-7.0)),
        PadMode::Reflect,
        PadMode::Edge,
    ];
    let pads: [&[(usize, usize)]; 4] = [
        &[(1, 2), (0, 0), (2, 1)],
        &[(0, 0), (3, 3), (0, 4)],
        &[(2, 2), (1, 0), (0, 0)],
        &[(0, 0), (0, 0), (0, 0)],
    ];
    for dt in [DType::F32, DType::I32, DType::F16, DType::U8] {
        for mode in modes {
            for p in pads {
                s.check(
                    &format!("pad {dt} {mode:?} {p:?}"),
                    &[inp("x", &[3, 4, 5], dt)],
                    EW,
                    |g, x| one(g.pad(x[0], p, mode)?),
                );
            }
        }
    }
    s.check(
        "pad constant around empty",
        &[inp("x", &[2, 0], DType::F32)],
        EW,
        |g, x| {
            one(g.pad(
                x[0],
                &[(1, 0), (2, 1)],
                PadMode::Constant(F64Bits::new(3.0)),
            )?)
        },
    );
    s.check(
        "pad reflect size-2 axis",
        &[inp("x", &[2, 3], DType::F64)],
        EW,
        |g, x| one(g.pad(x[0], &[(1, 1), (2, 2)], PadMode::Reflect)?),
    );
    s.check(
        "pad edge size-1 axis",
        &[inp("x", &[1, 3], DType::F32)],
        EW,
        |g, x| one(g.pad(x[0], &[(2, 3), (1, 0)], PadMode::Edge)?),
    );
    {
        let g = Graph::new("bad pad");
        let x = g.input("x", Shape::new(&[2, 3], DType::F32)).unwrap();
        assert!(g.pad(x, &[(2, 0), (0, 0)], PadMode::Reflect).is_err());
    }
    for dt in [DType::F32, DType::I8, DType::Bool] {
        s.check(
            &format!("tile {dt}"),
            &[inp("x", &[2, 3, 1], dt)],
            EW,
            |g, x| {
                Ok(vec![
                    g.tile(x[0], &[2, 1, 3])?,
                    g.tile(x[0], &[1, 1, 1])?,
                    g.tile(x[0], &[3, 0, 2])?,
                ])
            },
        );
    }
    s.check(
        "tile scalar-like and rank 1",
        &[inp("x", &[4], DType::F32)],
        EW,
        |g, x| one(g.tile(x[0], &[3])?),
    );
}

// ---------------------------------------------------------------------------------------
// Sequence ops
// ---------------------------------------------------------------------------------------

#[test]
fn random_numbers_and_dropout() {
    let mut s = Suite::new(0x4B);
    // The same numbers as the reference's definition on every device, for random keys
    // (negative and past 32 bits too), several dtypes and a size split between threads.
    for dt in FLOATS {
        s.check(
            &format!("random_uniform {dt}"),
            &[inp("key", &[1], DType::I64).dist(Dist::Int(-(1 << 40), 1 << 40))],
            EW,
            |g, x| {
                Ok(vec![
                    g.random_uniform(&[3, 5, 7], dt, 11, x[0])?,
                    g.random_uniform(&[1 << 17], dt, u64::MAX - 3, x[0])?,
                    g.random_uniform(&[0, 4], dt, 11, x[0])?,
                ])
            },
        );
    }
    // Dropout on a float input with an i32 key, and its gradient.
    s.check(
        "dropout and its gradient",
        &[
            inp("x", &[4, 33], DType::F32),
            inp("key", &[1], DType::I32).dist(Dist::Int(0, 1000)),
        ],
        EW,
        |g, x| {
            let y = g.dropout(x[0], 0.3, 5, x[1])?;
            let loss = g.sum(g.mul(y, y)?, &[], false)?;
            let mut outs = vec![y];
            outs.extend(rlx::grad(g, loss, &[x[0]])?);
            Ok(outs)
        },
    );

    // The numbers themselves: uniform, new for a new key or seed, the same for the
    // same ones; dropout keeps about 1 - p and scales what it keeps.
    let g = Graph::new("random");
    let key = g.input("key", Shape::new(&[1], DType::I64)).unwrap();
    let n = 1 << 16;
    let a = g.random_uniform(&[n], DType::F32, 1, key).unwrap();
    let b = g.random_uniform(&[n], DType::F32, 2, key).unwrap();
    let x = g.input("x", Shape::new(&[n], DType::F32)).unwrap();
    let d = g.dropout(x, 0.25, 9, key).unwrap();
    g.set_outputs(vec![a, b, d]);
    for device in test_devices() {
        let mut c = Session::new(device).compile(&g).unwrap();
        let ones = vec![1.0f32; n];
        let run = |c: &mut CompiledGraph, k: i64| {
            c.run_typed(&[("key", TensorRef::I64(&[k])), ("x", TensorRef::F32(&ones))])
                .unwrap()
                .iter()
                .map(|t| t.as_ref().to_f64_vec())
                .collect::<Vec<_>>()
        };
        let (first, again, next) = (run(&mut c, 7), run(&mut c, 7), run(&mut c, 8));
        assert_eq!(first, again, "on {device}: the same key gave other numbers");
        assert_ne!(
            first[0], next[0],
            "on {device}: a new key gave the same numbers"
        );
        assert_ne!(
            first[0], first[1],
            "on {device}: two seeds gave the same numbers"
        );
        let u = &first[0];
        assert!(u.iter().all(|v| (0.0..1.0).contains(v)));
        let mean = u.iter().sum::<f64>() / n as f64;
        let below = u.iter().filter(|&&v| v < 0.1).count() as f64 / n as f64;
        assert!(
            (mean - 0.5).abs() < 0.01 && (below - 0.1).abs() < 0.01,
            "{mean} {below}"
        );
        let kept = first[2].iter().filter(|&&v| v != 0.0).count() as f64 / n as f64;
        assert!(
            (kept - 0.75).abs() < 0.01,
            "on {device}: dropout kept {kept}"
        );
        assert!(
            first[2]
                .iter()
                .all(|&v| v == 0.0 || (v - 1.0 / 0.75).abs() < 1e-6)
        );
    }
    // Bad settings.
    let e = g.dropout(x, 1.0, 0, key).unwrap_err().to_string();
    assert!(e.contains("[0, 1)"), "{e}");
    let fkey = g.input("fkey", Shape::new(&[1], DType::F32)).unwrap();
    assert!(g.random_uniform(&[2], DType::F32, 0, fkey).is_err());
    let wide = g.input("wide", Shape::new(&[2], DType::I64)).unwrap();
    assert!(g.random_uniform(&[2], DType::F32, 0, wide).is_err());
    assert!(g.random_uniform(&[2], DType::I32, 0, key).is_err());
    assert_eq!(g.dropout(x, 0.0, 0, key).unwrap(), x);
}

#[test]
fn range_and_iota() {
    let mut s = Suite::new(0x13);
    for dt in [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::I32,
        DType::I64,
        DType::I8,
        DType::U8,
    ] {
        s.check(&format!("range {dt}"), &[inp("x", &[7], dt)], EW, |g, x| {
            let it = g.iota(7, dt)?;
            let r = g.range(0.5, 7.0, 0.75, dt)?;
            let down = g.range(10.0, -3.0, -2.0, dt)?;
            let empty = g.range(3.0, 1.0, 1.0, dt)?;
            Ok(vec![g.add(it, x[0])?, r, down, empty, g.iota(0, dt)?])
        });
    }
    // A graph with no inputs at all.
    s.check("range without inputs", &[], EW, |g, _| {
        Ok(vec![
            g.range(-1.0, 1.0, 0.125, DType::F32)?,
            g.iota(5, DType::I64)?,
        ])
    });
    assert!(Graph::new("bad").range(0.0, 1.0, 0.0, DType::F32).is_err());
}

#[test]
fn cumsum_variants() {
    let mut s = Suite::new(0x14);
    let dims = [3, 5, 7];
    for dt in [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::I8,
    ] {
        let dist = if dt == DType::I8 {
            Dist::Int(-128, 127)
        } else {
            Dist::Default
        };
        for axis in [0isize, 1, 2, -1, -3] {
            let n = dims[axis.rem_euclid(3) as usize];
            s.check(
                &format!("cumsum {dt} axis {axis}"),
                &[inp("x", &dims, dt).dist(dist)],
                acc(n),
                |g, x| {
                    let mut outs = Vec::new();
                    for exclusive in [false, true] {
                        for reverse in [false, true] {
                            outs.push(g.cumsum(x[0], axis, exclusive, reverse)?);
                        }
                    }
                    Ok(outs)
                },
            );
        }
    }
    s.check(
        "cumsum empty and size-1",
        &[inp("x", &[0, 3], DType::F32), inp("y", &[4, 1], DType::F32)],
        EW,
        |g, x| {
            Ok(vec![
                g.cumsum(x[0], 0, false, false)?,
                g.cumsum(x[0], 1, true, true)?,
                g.cumsum(x[1], 1, true, false)?,
                g.cumsum(x[1], 0, false, true)?,
            ])
        },
    );
    s.check(
        "cumsum long",
        &[inp("x", &[2, 2000], DType::F32)],
        acc(2000),
        |g, x| {
            Ok(vec![
                g.cumsum(x[0], 1, false, false)?,
                g.cumsum(x[0], 1, true, true)?,
            ])
        },
    );
}

#[test]
fn topk_values_and_indices() {
    let mut s = Suite::new(0x15);
    let dims = [3, 8, 5];
    for dt in [
        DType::F32,
        DType::F64,
        DType::F16,
        DType::BF16,
        DType::I32,
        DType::I64,
        DType::I8,
        DType::U8,
    ] {
        for dist in [Dist::Default, Dist::Ties, Dist::Special] {
            for (axis, k) in [(1isize, 3usize), (-1, 5), (0, 1), (-2, 8), (1, 0)] {
                for largest in [true, false] {
                    s.check(
                        &format!("topk {dt} {dist:?} axis {axis} k {k} largest={largest}"),
                        &[inp("x", &dims, dt).dist(dist)],
                        EW,
                        |g, x| {
                            let (v, i) = g.topk(x[0], k, axis, largest)?;
                            Ok(vec![v, i])
                        },
                    );
                }
            }
        }
    }
    s.check(
        "topk all ties",
        &[inp("x", &[2, 6], DType::F32).dist(Dist::Int(1, 1))],
        EW,
        |g, x| {
            let (v, i) = g.topk(x[0], 4, 1, true)?;
            let (v2, i2) = g.topk(x[0], 4, 1, false)?;
            Ok(vec![v, i, v2, i2])
        },
    );
    s.check(
        "topk rank 1 feeding gather",
        &[inp("x", &[10], DType::F32), inp("y", &[10, 3], DType::F32)],
        EW,
        |g, x| {
            let (v, i) = g.topk(x[0], 4, 0, true)?;
            Ok(vec![v, g.gather(x[1], i, 0)?])
        },
    );
    s.check(
        "topk empty outer",
        &[inp("x", &[0, 5], DType::F32)],
        EW,
        |g, x| {
            let (v, i) = g.topk(x[0], 2, 1, true)?;
            Ok(vec![v, i])
        },
    );
}

#[test]
fn one_hot_encoding() {
    let mut s = Suite::new(0x16);
    for idx_dt in [DType::I32, DType::I64, DType::I8, DType::U8] {
        for dt in [DType::F32, DType::I32, DType::Bool, DType::F16, DType::I64] {
            // Out-of-range (all-zero rows) and negative (from the end) indices.
            let dist = if idx_dt == DType::U8 {
                Dist::Int(0, 6)
            } else {
                Dist::Int(-6, 6)
            };
            for idx_dims in [&[3, 5][..], &[], &[0, 2]] {
                s.check(
                    &format!("one_hot {idx_dt} -> {dt} {idx_dims:?}"),
                    &[inp("i", idx_dims, idx_dt).dist(dist)],
                    EW,
                    |g, x| {
                        Ok(vec![
                            g.one_hot(x[0], 4, dt)?,
                            g.one_hot(x[0], 1, dt)?,
                            g.one_hot(x[0], 0, dt)?,
                        ])
                    },
                );
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Convolution and pooling
// ---------------------------------------------------------------------------------------

#[test]
fn conv2d_variants() {
    let mut s = Suite::new(0x17);
    // (x dims, w dims, stride, padding [t, l, b, r], dilation, groups)
    type ConvCase = (
        [usize; 4],
        [usize; 4],
        [usize; 2],
        [usize; 4],
        [usize; 2],
        usize,
    );
    let cases: [ConvCase; 47] = [
        // f32 3x3 unit-stride with 32 or more channels, multiples of 8, and 16 or
        // more tiles: Winograd F(4x4, 3x3), with edge tiles in both directions,
        // asymmetric padding, tiles of several images in one task, and dilated (one
        // undilated convolution per phase of the output).
        (
            [2, 32, 13, 18],
            [40, 32, 3, 3],
            [1, 1],
            [1, 1, 1, 1],
            [1, 1],
            1,
        ),
        (
            [4, 48, 17, 7],
            [32, 48, 3, 3],
            [1, 1],
            [0, 2, 1, 0],
            [1, 1],
            1,
        ),
        (
            [1, 32, 26, 30],
            [32, 32, 3, 3],
            [1, 1],
            [2, 2, 2, 2],
            [2, 2],
            1,
        ),
        (
            [3, 64, 12, 20],
            [64, 64, 3, 3],
            [1, 1],
            [1, 1, 1, 1],
            [1, 1],
            1,
        ),
        // f32 runs as GEMMs over phase planes: one per tap from 32 channels per group
        // (strided, dilated, grouped, padded), else one over packed (channel, tap) rows.
        (
            [1, 40, 9, 11],
            [12, 40, 3, 3],
            [2, 2],
            [1, 1, 1, 1],
            [1, 1],
            1,
        ),
        (
            [1, 64, 8, 9],
            [8, 32, 3, 3],
            [1, 2],
            [2, 1, 0, 2],
            [2, 1],
            2,
        ),
        ([2, 8, 9, 10], [6, 8, 1, 1], [2, 2], [0, 0, 0, 0], [1, 1], 1),
        (
            [1, 33, 10, 7],
            [5, 33, 2, 3],
            [3, 1],
            [0, 2, 1, 0],
            [1, 1],
            1,
        ),
        // Large enough for several GEMM blocks even with an image per thread
        // (1760 pixels against about 800 a block).
        (
            [2, 16, 40, 44],
            [40, 16, 3, 3],
            [1, 1],
            [1, 1, 1, 1],
            [1, 1],
            1,
        ),
        (
            [1, 64, 10, 12],
            [48, 64, 1, 1],
            [1, 1],
            [0, 0, 0, 0],
            [1, 1],
            1,
        ),
        // A strided 1-D convolution whose one row of staged input overflows half of
        // L2 (512 channels x 701 samples): the pixel kernel in blocks of columns.
        (
            [1, 512, 1, 1403],
            [24, 512, 1, 3],
            [1, 2],
            [0, 1, 0, 1],
            [1, 1],
            1,
        ),
        // The same over a dilated window padded on both sides: the first block of
        // columns stages left padding, the last right padding.
        (
            [1, 520, 1, 1100],
            [20, 520, 1, 3],
            [1, 1],
            [0, 2, 0, 3],
            [1, 2],
            1,
        ),
        // A 1-D convolution (one output row) with many filters (33 panels, the last
        // half full): its threads split the filters (up to 4 threads).
        (
            [1, 24, 1, 300],
            [520, 24, 1, 3],
            [1, 1],
            [0, 1, 0, 1],
            [1, 1],
            1,
        ),
        // A 1x1 convolution over few pixels and many channels, plain in and out: the
        // pointwise kernel (AVX-512), a last pixel tile and panel group short.
        (
            [1, 160, 11, 13],
            [72, 160, 1, 1],
            [1, 1],
            [0, 0, 0, 0],
            [1, 1],
            1,
        ),
        // One image cut into several blocks that its threads share evenly (1600
        // pixels, about 500 a block by L2).
        (
            [1, 256, 40, 40],
            [24, 256, 1, 1],
            [1, 1],
            [0, 0, 0, 0],
            [1, 1],
            1,
        ),
        ([2, 3, 7, 8], [4, 3, 3, 3], [1, 1], [0, 0, 0, 0], [1, 1], 1),
        ([2, 3, 7, 8], [4, 3, 3, 3], [1, 1], [1, 1, 1, 1], [1, 1], 1),
        // f32 strided with several taps and one group: output pixels for rows, 6 of
        // them (running on across rows) by 16 channels a tile. A stem-like 7x7 with a
        // short last tile and a partial channel panel; a depth of several blocks
        // (40 channels x 9 taps above, 70 x 9 here) with dilation; an input whose
        // staged rows overflow half of L2, so an image takes several blocks.
        (
            [2, 3, 29, 37],
            [20, 3, 7, 7],
            [2, 2],
            [3, 3, 3, 3],
            [1, 1],
            1,
        ),
        (
            [1, 70, 11, 13],
            [33, 70, 3, 3],
            [2, 3],
            [1, 0, 2, 1],
            [2, 1],
            1,
        ),
        (
            [1, 8, 200, 120],
            [16, 8, 5, 5],
            [2, 2],
            [2, 2, 2, 2],
            [1, 1],
            1,
        ),
        // With AVX-512 a tile covers up to 4 panels: 72 channels make a group of 4
        // and a partial fifth panel alone, over two depth blocks (140 x 9 steps).
        (
            [1, 140, 9, 11],
            [72, 140, 3, 3],
            [2, 2],
            [1, 1, 1, 1],
            [1, 1],
            1,
        ),
        ([3, 5, 6, 9], [7, 5, 2, 2], [2, 2], [0, 0, 0, 0], [1, 1], 1),
        ([2, 4, 7, 8], [6, 2, 3, 3], [2, 1], [1, 0, 2, 1], [1, 2], 2),
        ([1, 4, 9, 9], [4, 1, 3, 3], [2, 2], [1, 1, 1, 1], [1, 1], 4),
        ([1, 4, 9, 9], [8, 1, 3, 2], [1, 3], [0, 2, 1, 0], [2, 1], 4),
        ([2, 3, 5, 5], [5, 3, 1, 1], [1, 1], [0, 0, 0, 0], [1, 1], 1),
        ([1, 2, 4, 4], [3, 2, 4, 4], [1, 1], [0, 0, 0, 0], [1, 1], 1),
        ([1, 6, 6, 7], [6, 2, 2, 3], [3, 2], [2, 1, 0, 2], [2, 2], 3),
        // Depthwise (one input channel per group): a stencil per plane over a staged
        // copy split by stride phase. MobileNet's strided 3x3 on a large plane, a
        // ConvNeXt-like 7x7, a 5x5 with stride 2 on odd sizes and a multiplier of 2
        // with asymmetric padding and dilation.
        (
            [1, 16, 57, 60],
            [16, 1, 3, 3],
            [2, 2],
            [0, 0, 1, 1],
            [1, 1],
            16,
        ),
        (
            [2, 24, 14, 13],
            [24, 1, 7, 7],
            [1, 1],
            [3, 3, 3, 3],
            [1, 1],
            24,
        ),
        (
            [1, 12, 11, 9],
            [12, 1, 5, 5],
            [2, 2],
            [2, 2, 2, 2],
            [1, 1],
            12,
        ),
        (
            [1, 5, 10, 12],
            [10, 1, 3, 3],
            [1, 2],
            [2, 0, 1, 3],
            [2, 3],
            5,
        ),
        // Output planes smaller than one AVX2 vector (2 x 2 and 1 x 3): stores must
        // stay inside each plane.
        ([2, 4, 6, 6], [4, 1, 3, 3], [2, 2], [0, 0, 0, 0], [1, 1], 4),
        ([1, 3, 3, 7], [6, 1, 3, 3], [1, 2], [0, 0, 0, 0], [1, 1], 3),
        // Depthwise over planes of at most 64 outputs: sixteen channels in the lanes
        // of each vector. Channels past a whole block (37 = 16 + 16 + 5), two
        // images, a 5x5 window at stride 2, a multiplier of 2 with dilation, and
        // input rows longer than one transpose with asymmetric padding.
        (
            [2, 37, 7, 7],
            [37, 1, 3, 3],
            [1, 1],
            [1, 1, 1, 1],
            [1, 1],
            37,
        ),
        (
            [1, 40, 14, 13],
            [40, 1, 5, 5],
            [2, 2],
            [2, 2, 2, 2],
            [1, 1],
            40,
        ),
        (
            [1, 20, 8, 8],
            [40, 1, 3, 3],
            [1, 1],
            [1, 1, 1, 1],
            [2, 2],
            20,
        ),
        (
            [1, 17, 4, 20],
            [17, 1, 3, 3],
            [1, 2],
            [1, 0, 1, 2],
            [1, 1],
            17,
        ),
        // Unit column stride over rows of several vectors: padding on one side more
        // than the other, so staged rows start mid-vector (3 x 5 taps), and no
        // padding at all with a channel multiplier and dilation.
        (
            [1, 6, 30, 37],
            [6, 1, 3, 5],
            [1, 1],
            [1, 2, 0, 3],
            [1, 1],
            6,
        ),
        (
            [1, 3, 20, 33],
            [6, 1, 3, 3],
            [1, 1],
            [0, 0, 0, 0],
            [1, 2],
            3,
        ),
        // Rows of several vectors with a partial last one (eight vectors at a time
        // then span rows), a stride of 3 (three column phases), and a 9x9 window,
        // past the taps the phase kernel keeps offsets for.
        (
            [1, 3, 13, 150],
            [3, 1, 3, 3],
            [1, 1],
            [1, 1, 1, 1],
            [1, 1],
            3,
        ),
        (
            [2, 4, 11, 70],
            [8, 1, 5, 3],
            [2, 3],
            [2, 1, 2, 1],
            [1, 2],
            4,
        ),
        (
            [1, 2, 12, 12],
            [2, 1, 9, 9],
            [1, 1],
            [4, 4, 4, 4],
            [1, 1],
            2,
        ),
        // Few pixels, many output channels: threads split the channels (a 1x1 with
        // a last panel one column wide, and a grouped 3x3 multiplied per tap).
        (
            [1, 40, 7, 7],
            [72, 40, 1, 1],
            [1, 1],
            [0, 0, 0, 0],
            [1, 1],
            1,
        ),
        (
            [1, 64, 9, 9],
            [64, 32, 3, 3],
            [1, 1],
            [1, 1, 1, 1],
            [1, 1],
            2,
        ),
        // Weights far larger than one image's input: threads split the output
        // channels (250: a partial last panel).
        (
            [1, 8, 6, 5],
            [250, 8, 3, 3],
            [1, 1],
            [1, 1, 1, 1],
            [1, 1],
            1,
        ),
        // Many taps over many channels (a positional convolution's): packed rows, not
        // a product per tap; 49 pixels in one block.
        (
            [1, 64, 1, 49],
            [64, 32, 1, 30],
            [1, 1],
            [0, 15, 0, 14],
            [1, 1],
            2,
        ),
    ];
    for dt in FLOATS {
        for (xd, wd, stride, padding, dilation, groups) in cases {
            let k = wd[1] * wd[2] * wd[3] + 1;
            for bias in [false, true] {
                let mut ins = vec![inp("x", &xd, dt), inp("w", &wd, dt)];
                if bias {
                    ins.push(inp("b", &[wd[0]], dt));
                }
                s.check(&format!("conv2d {dt} x{xd:?} w{wd:?} s{stride:?} p{padding:?} d{dilation:?} g{groups} bias={bias}"), &ins, acc(k), |g, x| {
                    one(g.conv2d(x[0], x[1], x.get(2).copied(), stride, padding, dilation, groups)?)
                });
            }
        }
    }
    // Fused forms in every float dtype: f32 through the GEMM epilogue, the others
    // through the direct loop and the generic epilogue.
    for dt in FLOATS {
        s.check(
            &format!("conv2d + relu + residual {dt}"),
            &[
                inp("x", &[2, 5, 7, 6], dt),
                inp("w", &[4, 5, 3, 3], dt),
                inp("b", &[4], dt),
                inp("r", &[2, 4, 7, 6], dt),
            ],
            acc(46),
            |g, x| {
                let y = g.conv2d(x[0], x[1], Some(x[2]), [1, 1], [1, 1, 1, 1], [1, 1], 1)?;
                one(g.add(g.relu(y)?, x[3])?)
            },
        );
    }
    // A depthwise convolution of rows with no values: all padding, the output its
    // bias.
    for stride in [[1, 1], [1, 2]] {
        s.check(
            &format!("depthwise conv2d of zero-width rows, stride {stride:?}"),
            &[
                inp("x", &[1, 2, 3, 0], DType::F32),
                inp("w", &[2, 1, 1, 3], DType::F32),
                inp("b", &[2], DType::F32),
            ],
            acc(4),
            move |g, x| one(g.conv2d(x[0], x[1], Some(x[2]), stride, [0, 2, 0, 2], [1, 1], 2)?),
        );
    }
    // Output channels split between threads, with a bias, ReLU and residual: by the
    // per-pixel kernel, then by the GEMM.
    s.check(
        "conv2d 3x3 by channel parts + relu + residual",
        &[
            inp("x", &[1, 6, 5, 4], DType::F32),
            inp("w", &[200, 6, 3, 3], DType::F32),
            inp("b", &[200], DType::F32),
            inp("r", &[1, 200, 5, 4], DType::F32),
        ],
        acc(55),
        |g, x| {
            let y = g.conv2d(x[0], x[1], Some(x[2]), [1, 1], [1, 1, 1, 1], [1, 1], 1)?;
            one(g.add(g.relu(y)?, x[3])?)
        },
    );
    s.check(
        "conv2d 1x1 by channel parts + relu + residual",
        &[
            inp("x", &[1, 24, 5, 6], DType::F32),
            inp("w", &[40, 24, 1, 1], DType::F32),
            inp("b", &[40], DType::F32),
            inp("r", &[1, 40, 5, 6], DType::F32),
        ],
        acc(25),
        |g, x| {
            let y = g.conv2d(x[0], x[1], Some(x[2]), [1, 1], [0, 0, 0, 0], [1, 1], 1)?;
            one(g.add(g.relu(y)?, x[3])?)
        },
    );
    // 1x1 convolutions over 7 x 7 outputs (49 pixels) with enough channels run on
    // the pixel-row kernel: unit stride with a bias, ReLU and residual; stride 2 over
    // two images; and one behind a per-channel affine and ReLU (not applied while
    // packing there).
    s.check(
        "conv2d 1x1 over 7x7 + bias + relu + residual",
        &[
            inp("x", &[1, 96, 7, 7], DType::F32),
            inp("w", &[80, 96, 1, 1], DType::F32),
            inp("b", &[80], DType::F32),
            inp("r", &[1, 80, 7, 7], DType::F32),
        ],
        acc(96),
        |g, x| {
            let y = g.conv2d(x[0], x[1], Some(x[2]), [1, 1], [0, 0, 0, 0], [1, 1], 1)?;
            one(g.add(g.relu(y)?, x[3])?)
        },
    );
    // Over one pixel (a squeeze-and-excitation block's): a matrix-vector product.
    s.check(
        "conv2d 1x1 over one pixel + bias + relu",
        &[
            inp("x", &[1, 96, 1, 1], DType::F32),
            inp("w", &[40, 96, 1, 1], DType::F32),
            inp("b", &[40], DType::F32),
        ],
        acc(96),
        |g, x| {
            let y = g.conv2d(x[0], x[1], Some(x[2]), [1, 1], [0, 0, 0, 0], [1, 1], 1)?;
            one(g.relu(y)?)
        },
    );
    s.check(
        "conv2d 1x1 stride 2 to 7x7",
        &[
            inp("x", &[2, 64, 13, 13], DType::F32),
            inp("w", &[40, 64, 1, 1], DType::F32),
        ],
        acc(64),
        |g, x| one(g.conv2d(x[0], x[1], None, [2, 2], [0, 0, 0, 0], [1, 1], 1)?),
    );
    s.check(
        "affine + relu then conv2d 1x1 over 7x7",
        &[
            inp("x", &[1, 72, 7, 7], DType::F32),
            inp("scale", &[1, 72, 1, 1], DType::F32),
            inp("shift", &[1, 72, 1, 1], DType::F32),
            inp("w", &[33, 72, 1, 1], DType::F32),
        ],
        acc(72),
        |g, x| {
            let y = g.relu(g.add(g.mul(x[0], x[1])?, x[2])?)?;
            one(g.conv2d(y, x[3], None, [1, 1], [0, 0, 0, 0], [1, 1], 1)?)
        },
    );
    // A per-channel affine in front of a 1x1 depthwise convolution that only the
    // convolution reads (the fused convolution's input prologue), its source read
    // by another op too.
    for xd in [[1, 8, 1, 1], [2, 8, 6, 5]] {
        s.check(
            &format!("affine then 1x1 depthwise conv2d x{xd:?}"),
            &[
                inp("x", &xd, DType::F32),
                inp("scale", &[1, 8, 1, 1], DType::F32),
                inp("shift", &[1, 8, 1, 1], DType::F32),
                inp("w", &[8, 1, 1, 1], DType::F32),
            ],
            acc(2),
            |g, x| {
                let y = g.add(g.mul(x[0], x[1])?, x[2])?;
                let c = g.conv2d(y, x[3], None, [1, 1], [0, 0, 0, 0], [1, 1], 8)?;
                Ok(vec![c, g.add(x[0], x[0])?])
            },
        );
    }
    // Planes small enough for channels in vector lanes, the bias and activation
    // applied to the sums in registers (35 channels: a partial last block; a zero
    // bias among them).
    for act in [
        None,
        Some(UnaryOp::Relu),
        Some(UnaryOp::Relu6),
        Some(UnaryOp::HardSwish),
        Some(UnaryOp::Silu),
    ] {
        s.check(
            &format!("depthwise conv2d 7x7 planes + bias + {act:?}"),
            &[
                inp("x", &[2, 35, 7, 7], DType::F32).dist(Dist::Uniform(-4.0, 4.0)),
                inp("w", &[35, 1, 3, 3], DType::F32),
                inp("b", &[35], DType::F32),
            ],
            acc(10),
            move |g, x| {
                // Channel 3's bias is zero: b * (1 - onehot(3)).
                let keep = g.constant(
                    TensorData::F32((0..35).map(|c| if c == 3 { 0.0 } else { 1.0 }).collect()),
                    &[35],
                )?;
                let b = g.mul(x[2], keep)?;
                let y = g.conv2d(x[0], x[1], Some(b), [1, 1], [1, 1, 1, 1], [1, 1], 35)?;
                one(match act {
                    Some(op) => g.unary(op, y)?,
                    None => y,
                })
            },
        );
    }
    // The same with a residual: the epilogue then runs per plane (35 channels: a
    // partial last block).
    s.check(
        "depthwise conv2d 7x7 planes + bias + relu + residual",
        &[
            inp("x", &[1, 35, 7, 7], DType::F32),
            inp("w", &[35, 1, 3, 3], DType::F32),
            inp("b", &[35], DType::F32),
            inp("r", &[1, 35, 7, 7], DType::F32),
        ],
        acc(10),
        |g, x| {
            let y = g.conv2d(x[0], x[1], Some(x[2]), [1, 1], [1, 1, 1, 1], [1, 1], 35)?;
            one(g.add(g.relu(y)?, x[3])?)
        },
    );
    for dt in [DType::F32, DType::F64] {
        s.check(
            &format!("depthwise conv2d + bias + relu + residual {dt}"),
            &[
                inp("x", &[2, 8, 9, 10], dt),
                inp("w", &[8, 1, 3, 3], dt),
                inp("b", &[8], dt),
                inp("r", &[2, 8, 9, 10], dt),
            ],
            acc(10),
            |g, x| {
                let y = g.conv2d(x[0], x[1], Some(x[2]), [1, 1], [1, 1, 1, 1], [1, 1], 8)?;
                one(g.add(g.relu(y)?, x[3])?)
            },
        );
    }
    s.check(
        "conv2d empty batch",
        &[
            inp("x", &[0, 2, 5, 5], DType::F32),
            inp("w", &[3, 2, 3, 3], DType::F32),
        ],
        EW,
        |g, x| one(g.conv2d(x[0], x[1], None, [1, 1], [1, 1, 1, 1], [1, 1], 1)?),
    );
    s.check(
        "conv2d chain",
        &[
            inp("x", &[1, 2, 8, 8], DType::F32),
            inp("w1", &[4, 2, 3, 3], DType::F32),
            inp("b1", &[4], DType::F32),
            inp("w2", &[2, 4, 1, 1], DType::F32),
        ],
        acc(40),
        |g, x| {
            let h = g.relu(g.conv2d(x[0], x[1], Some(x[2]), [1, 1], [1, 1, 1, 1], [1, 1], 1)?)?;
            one(g.conv2d(h, x[3], None, [1, 1], [0, 0, 0, 0], [1, 1], 1)?)
        },
    );
}

#[test]
fn pooling() {
    let mut s = Suite::new(0x18);
    // (kernel, stride, padding [t, l, b, r])
    type PoolCase = ([usize; 2], [usize; 2], [usize; 4]);
    let cases: [PoolCase; 8] = [
        ([2, 2], [2, 2], [0, 0, 0, 0]),
        // 3x3 stride 2, max pooling's own path: with and without padding.
        ([3, 3], [2, 2], [0, 0, 0, 0]),
        ([3, 3], [2, 2], [1, 1, 1, 1]),
        ([3, 2], [2, 1], [1, 1, 1, 0]),
        ([3, 3], [1, 1], [1, 1, 1, 1]),
        ([1, 1], [1, 1], [0, 0, 0, 0]),
        ([2, 3], [3, 2], [1, 0, 0, 1]),
        ([4, 4], [4, 4], [2, 2, 2, 2]),
    ];
    for dt in FLOATS {
        for (kernel, stride, padding) in cases {
            let k = kernel[0] * kernel[1];
            s.check(
                &format!("pool {dt} k{kernel:?} s{stride:?} p{padding:?}"),
                &[inp("x", &[2, 3, 7, 8], dt)],
                acc(k),
                |g, x| {
                    Ok(vec![
                        g.max_pool2d(x[0], kernel, stride, padding)?,
                        g.avg_pool2d(x[0], kernel, stride, padding, true)?,
                        g.avg_pool2d(x[0], kernel, stride, padding, false)?,
                    ])
                },
            );
        }
    }
    s.check(
        "max_pool special",
        &[inp("x", &[1, 2, 6, 6], DType::F32).dist(Dist::Special)],
        acc(4),
        |g, x| {
            Ok(vec![
                g.max_pool2d(x[0], [2, 2], [1, 1], [1, 1, 0, 0])?,
                g.avg_pool2d(x[0], [2, 2], [2, 2], [0, 0, 0, 0], false)?,
            ])
        },
    );
    // Long rows through the 3x3 stride-2 path, NaN and infinities among the values,
    // odd and even widths.
    for width in [37, 40] {
        s.check(
            &format!("max_pool 3x3/2 special, width {width}"),
            &[inp("x", &[1, 3, 9, width], DType::F32).dist(Dist::Special)],
            acc(9),
            |g, x| {
                Ok(vec![
                    g.max_pool2d(x[0], [3, 3], [2, 2], [1, 1, 1, 1])?,
                    g.max_pool2d(x[0], [3, 3], [2, 2], [0, 0, 0, 0])?,
                ])
            },
        );
    }
    s.check(
        "max_pool negative values with padding",
        &[inp("x", &[1, 1, 5, 5], DType::F32).dist(Dist::Uniform(-5.0, -1.0))],
        acc(9),
        |g, x| one(g.max_pool2d(x[0], [3, 3], [2, 2], [1, 1, 1, 1])?),
    );
    let g = Graph::new("bad pool");
    let x = g.input("x", Shape::new(&[1, 1, 5, 5], DType::F32)).unwrap();
    assert!(g.max_pool2d(x, [2, 2], [1, 1], [2, 0, 0, 0]).is_err());
}

/// `max_pool2d(x)` over windows that tile `x`, then the input's gradient from `g`.
fn pool_then_gradient(kernel: [usize; 2]) -> impl Fn(&Graph, &[NodeId]) -> Result<Vec<NodeId>> {
    move |g: &Graph, x: &[NodeId]| {
        let y = g.max_pool2d(x[0], kernel, kernel, [0; 4])?;
        Ok(vec![g.tiled_max_pool_grad(x[0], y, x[1], kernel)?])
    }
}

#[test]
fn tiled_max_pool_gradient() {
    let mut s = Suite::new(0x3C);
    // The usual 2x2, a 3x2 and a 1x3; few planes and the digits CNN's 32 x 32 planes
    // of 8 x 8 (on threads); values with many ties, plain, and NaN and infinities.
    let cases: [(&[usize], [usize; 2]); 4] = [
        (&[2, 3, 4, 6], [2, 2]),
        (&[1, 2, 6, 4], [3, 2]),
        (&[3, 1, 2, 9], [1, 3]),
        (&[32, 32, 8, 8], [2, 2]),
    ];
    let pooled = |d: &[usize], [kh, kw]: [usize; 2]| [d[0], d[1], d[2] / kh, d[3] / kw];
    for dt in FLOATS {
        for (dims, kernel) in cases {
            for dist in [Dist::Ties, Dist::Default, Dist::Special] {
                s.check(
                    &format!("tiled_max_pool_grad {dt} {dims:?} k{kernel:?} {dist:?}"),
                    &[
                        inp("x", dims, dt).dist(dist),
                        inp("g", &pooled(dims, kernel), dt),
                    ],
                    EW,
                    pool_then_gradient(kernel),
                );
            }
        }
    }
    // No windows: a zero width (which the pool itself refuses, but the op accepts).
    s.check(
        "tiled_max_pool_grad zero width",
        &[
            inp("x", &[1, 2, 4, 0], DType::F32),
            inp("y", &[1, 2, 2, 0], DType::F32),
            inp("g", &[1, 2, 2, 0], DType::F32),
        ],
        EW,
        |g, x| one(g.tiled_max_pool_grad(x[0], x[1], x[2], [2, 2])?),
    );
    // The decomposition, which a backend without the kernel runs, on the CPU.
    for (dims, kernel) in cases {
        for dist in [Dist::Ties, Dist::Special] {
            check_decomposed_on_cpu(
                &format!("tiled max pool gradient decomposed {dims:?} {dist:?}"),
                mix(0x3C00 + dims[3] as u64),
                &[
                    inp("x", dims, DType::F32).dist(dist),
                    inp("g", &pooled(dims, kernel), DType::F32),
                ],
                EW,
                pool_then_gradient(kernel),
            );
        }
    }
}

#[test]
fn tiled_max_pool_gradient_rejects_bad_operands() {
    let g = Graph::new("tiled_max_pool_grad errors");
    let f = |name: &str, dims: &[usize], dt: DType| g.input(name, Shape::new(dims, dt)).unwrap();
    let x = f("x", &[2, 3, 4, 6], DType::F32);
    let y = f("y", &[2, 3, 2, 3], DType::F32);
    let wrong = f("wrong", &[2, 3, 2, 2], DType::F32);
    let half = f("half", &[2, 3, 2, 3], DType::F16);
    let ints = f("ints", &[2, 3, 4, 6], DType::I32);
    let flat = f("flat", &[6, 4, 6], DType::F32);
    let cases = [
        (g.tiled_max_pool_grad(x, y, y, [3, 2]), "tile"),
        (g.tiled_max_pool_grad(x, y, y, [0, 2]), "tile"),
        (g.tiled_max_pool_grad(x, wrong, y, [2, 2]), "pooled output"),
        (
            g.tiled_max_pool_grad(x, y, wrong, [2, 2]),
            "output gradient",
        ),
        (g.tiled_max_pool_grad(x, y, half, [2, 2]), "f16"),
        (g.tiled_max_pool_grad(ints, y, y, [2, 2]), "float"),
        (g.tiled_max_pool_grad(flat, y, y, [2, 2]), "rank 4"),
    ];
    for (result, needle) in cases {
        let err = result.unwrap_err().to_string();
        assert!(err.contains(needle), "{needle:?} not in {err:?}");
    }
    // The graph still builds after the rejected calls.
    let ok = g.tiled_max_pool_grad(x, y, y, [2, 2]).unwrap();
    assert_eq!(g.shape(ok).unwrap(), Shape::new(&[2, 3, 4, 6], DType::F32));
}

// ---------------------------------------------------------------------------------------
// Attention and rotary embedding
// ---------------------------------------------------------------------------------------

#[test]
fn attention_variants() {
    let mut s = Suite::new(0x19);
    // Grouped-query heads (Hq = 4, Hkv = 2), Sq != Sk, Dv != D.
    let (b, hq, hkv, sq, sk, d, dv) = (2, 4, 2, 5, 7, 8, 6);
    let qkv = |dt: DType| {
        vec![
            inp("q", &[b, hq, sq, d], dt),
            inp("k", &[b, hkv, sk, d], dt),
            inp("v", &[b, hkv, sk, dv], dt),
        ]
    };
    for dt in FLOATS {
        let tol = acc(sk * d);
        for causal in [false, true] {
            s.check(
                &format!("attention {dt} causal={causal}"),
                &qkv(dt),
                tol,
                |g, x| one(g.attention(x[0], x[1], x[2], None, causal, None)?),
            );
            s.check(
                &format!("attention {dt} causal={causal} scale"),
                &qkv(dt),
                tol,
                |g, x| one(g.attention(x[0], x[1], x[2], None, causal, Some(0.7))?),
            );
            let masks: [(&[usize], DType, Dist); 7] = [
                (&[b, 1, sq, sk], dt, Dist::Default),
                (&[sq, sk], dt, Dist::NegInf),
                (&[b, hq, sq, sk], dt, Dist::NegInf),
                (&[b, hq, sq, sk], DType::Bool, Dist::Default),
                (&[1, 1, sq, sk], DType::Bool, Dist::Sparse),
                (&[sk], DType::Bool, Dist::Default),
                (&[b, 1, 1, sk], DType::Bool, Dist::Int(0, 0)),
            ];
            for (mdims, mdt, mdist) in masks {
                let mut ins = qkv(dt);
                ins.push(inp("mask", mdims, mdt).dist(mdist));
                s.check(
                    &format!("attention {dt} causal={causal} mask {mdt} {mdims:?} {mdist:?}"),
                    &ins,
                    tol,
                    |g, x| one(g.attention(x[0], x[1], x[2], Some(x[3]), causal, None)?),
                );
            }
        }
    }
    // More than one block of queries (64) over several blocks of keys (512): the
    // keys transposed once for every block of queries, grouped heads, a scale, and
    // a mask (the scale then applied with it).
    for (sq, sk) in [(130, 600), (65, 520)] {
        let ins = [
            inp("q", &[2, 4, sq, 16], DType::F32),
            inp("k", &[2, 2, sk, 16], DType::F32),
            inp("v", &[2, 2, sk, 12], DType::F32),
        ];
        for causal in [false, true] {
            s.check(
                &format!("attention sq={sq} sk={sk} causal={causal} scale"),
                &ins,
                acc(sk * 16),
                |g, x| one(g.attention(x[0], x[1], x[2], None, causal, Some(0.3))?),
            );
        }
        let mut masked = ins.to_vec();
        masked.push(inp("mask", &[sq, sk], DType::F32));
        s.check(
            &format!("attention sq={sq} sk={sk} mask"),
            &masked,
            acc(sk * 16),
            |g, x| one(g.attention(x[0], x[1], x[2], Some(x[3]), false, None)?),
        );
    }
    // Sq > Sk with causal (early rows fully masked), Sq = 1 decode step, single head.
    for (sq, sk) in [(7, 4), (1, 9), (6, 6)] {
        let ins = [
            inp("q", &[1, 3, sq, 4], DType::F32),
            inp("k", &[1, 1, sk, 4], DType::F32),
            inp("v", &[1, 1, sk, 5], DType::F32),
        ];
        for causal in [false, true] {
            s.check(
                &format!("attention sq={sq} sk={sk} causal={causal}"),
                &ins,
                acc(sk * 4),
                |g, x| one(g.attention(x[0], x[1], x[2], None, causal, None)?),
            );
        }
    }
    // Sequence-major layout ([B, S, H, D]), with grouped heads, masks and causal.
    for (sq, sk, causal, dt) in [
        (5, 7, false, DType::F32),
        (5, 7, true, DType::F32),
        (70, 300, true, DType::F32),
        // Three blocks of queries: the keys packed once, read through their strides.
        (130, 300, true, DType::F32),
        (130, 260, false, DType::F32),
        (5, 7, true, DType::F64),
    ] {
        let (hq, hkv) = (4, 2);
        let ins = [
            inp("q", &[2, sq, hq, 8], dt),
            inp("k", &[2, sk, hkv, 8], dt),
            inp("v", &[2, sk, hkv, 6], dt),
            inp("mask", &[2, 1, 1, sk], DType::Bool).dist(Dist::Sparse),
        ];
        s.check(
            &format!("attention seq_major {dt} sq={sq} sk={sk} causal={causal}"),
            &ins[..3],
            acc(sk * 8),
            |g, x| one(g.attention_seq_major(x[0], x[1], x[2], None, causal, None)?),
        );
        s.check(
            &format!("attention seq_major {dt} sq={sq} sk={sk} causal={causal} mask"),
            &ins,
            acc(sk * 8),
            |g, x| one(g.attention_seq_major(x[0], x[1], x[2], Some(x[3]), causal, None)?),
        );
    }
    // Long sequences: several query blocks (64) and key blocks (512) of the blocked
    // f32 kernel, with the online softmax across key blocks, causal and masked.
    for (sq, sk, causal) in [
        (150, 600, false),
        (70, 300, true),
        (300, 300, true),
        (130, 1100, true),
    ] {
        let ins = [
            inp("q", &[1, 2, sq, 16], DType::F32),
            inp("k", &[1, 1, sk, 16], DType::F32),
            inp("v", &[1, 1, sk, 12], DType::F32),
            inp("mask", &[1, 1, 1, sk], DType::Bool).dist(Dist::Sparse),
        ];
        s.check(
            &format!("attention long sq={sq} sk={sk} causal={causal}"),
            &ins,
            acc(sk * 16),
            |g, x| one(g.attention(x[0], x[1], x[2], Some(x[3]), causal, None)?),
        );
        s.check(
            &format!("attention long sq={sq} sk={sk} causal={causal} float mask"),
            &[
                ins[0].clone(),
                ins[1].clone(),
                ins[2].clone(),
                inp("mask", &[sq, sk], DType::F32),
            ],
            acc(sk * 16),
            |g, x| one(g.attention(x[0], x[1], x[2], Some(x[3]), causal, None)?),
        );
    }
    // Model shapes in half precision: BERT heads (32 wide) under a key mask, and
    // Llama prefill heads (128 wide, grouped, causal), several query tiles each.
    for (dt, hq, hkv, seq, d, causal) in [
        (DType::F16, 12, 12, 128, 32, false),
        (DType::BF16, 8, 2, 67, 128, true),
    ] {
        let ins = [
            inp("q", &[2, hq, seq, d], dt),
            inp("k", &[2, hkv, seq, d], dt),
            inp("v", &[2, hkv, seq, d], dt),
            inp("mask", &[2, 1, 1, seq], DType::Bool).dist(Dist::Sparse),
        ];
        s.check(
            &format!("attention model {dt} heads {hq}/{hkv} seq {seq} dim {d} causal={causal}"),
            &ins,
            acc(seq * d),
            |g, x| one(g.attention(x[0], x[1], x[2], Some(x[3]), causal, None)?),
        );
    }
    // Tensor-core shapes on a GPU (f16, widths multiples of 16): grouped heads,
    // queries not a whole number of tiles, more keys than queries, causal with an
    // additive mask, the sequence-major layout, and more keys than one pass of
    // staging holds (several passes, the last partial).
    for (causal, seq_major, sk) in [
        (true, false, 100),
        (false, true, 100),
        (true, true, 100),
        (false, false, 300),
    ] {
        let layout = |s: usize, h: usize, d: usize| {
            if seq_major {
                vec![2, s, h, d]
            } else {
                vec![2, h, s, d]
            }
        };
        let ins = [
            inp("q", &layout(70, 4, 64), DType::F16),
            inp("k", &layout(sk, 2, 64), DType::F16),
            inp("v", &layout(sk, 2, 32), DType::F16),
            inp("mask", &[2, 1, 70, sk], DType::F16).dist(Dist::NegInf),
        ];
        s.check(
            &format!("attention f16 tiles causal={causal} seq_major={seq_major} keys {sk}"),
            &ins,
            acc(sk * 64),
            |g, x| {
                let f = if seq_major {
                    Graph::attention_seq_major
                } else {
                    Graph::attention
                };
                one(f(g, x[0], x[1], x[2], Some(x[3]), causal, None)?)
            },
        );
    }
    // A mask that varies by head but not by query (staged with the keys by the
    // tensor-core kernel), additive, about a third of the keys masked; value heads
    // of three 8-wide column blocks (two from one transposing load, one not).
    let ins = [
        inp("q", &[2, 4, 40, 32], DType::F16),
        inp("k", &[2, 4, 90, 32], DType::F16),
        inp("v", &[2, 4, 90, 24], DType::F16),
        inp("mask", &[2, 4, 1, 90], DType::F16).dist(Dist::NegInf),
    ];
    s.check(
        "attention f16 key mask by head",
        &ins,
        acc(90 * 32),
        |g, x| one(g.attention(x[0], x[1], x[2], Some(x[3]), false, None)?),
    );
    s.check(
        "attention no keys",
        &[
            inp("q", &[1, 2, 3, 4], DType::F32),
            inp("k", &[1, 1, 0, 4], DType::F32),
            inp("v", &[1, 1, 0, 5], DType::F32),
        ],
        EW,
        |g, x| one(g.attention(x[0], x[1], x[2], None, false, None)?),
    );
    s.check(
        "attention empty seq",
        &[
            inp("q", &[1, 2, 0, 4], DType::F32),
            inp("k", &[1, 2, 3, 4], DType::F32),
            inp("v", &[1, 2, 3, 4], DType::F32),
        ],
        EW,
        |g, x| one(g.attention(x[0], x[1], x[2], None, true, None)?),
    );
}

#[test]
fn rope_variants() {
    let mut s = Suite::new(0x1A);
    let cs_shapes: [&[usize]; 4] = [&[6, 4], &[1, 6, 4], &[2, 1, 6, 4], &[2, 3, 6, 4]];
    for dt in FLOATS {
        for style in [RopeStyle::HalfSplit, RopeStyle::Interleaved] {
            for cs in cs_shapes {
                s.check(
                    &format!("rope {dt} {style:?} cos{cs:?}"),
                    &[
                        inp("x", &[2, 3, 6, 8], dt),
                        inp("cos", cs, dt),
                        inp("sin", cs, dt),
                    ],
                    acc(2),
                    |g, x| one(g.rope(x[0], x[1], x[2], style)?),
                );
            }
        }
    }
    for style in [RopeStyle::HalfSplit, RopeStyle::Interleaved] {
        // Llama's layout: `[batch, seq, heads, head_dim]` with one angle per
        // position, broadcast over the heads.
        s.check(
            &format!("rope llama layout {style:?}"),
            &[
                inp("x", &[1, 3, 5, 64], DType::F32),
                inp("cos", &[1, 3, 1, 32], DType::F32),
                inp("sin", &[1, 3, 1, 32], DType::F32),
            ],
            acc(2),
            |g, x| one(g.rope(x[0], x[1], x[2], style)?),
        );
        s.check(
            &format!("rope rank 2 {style:?}"),
            &[
                inp("x", &[5, 2], DType::F32),
                inp("cos", &[5, 1], DType::F32),
                inp("sin", &[5, 1], DType::F32),
            ],
            acc(2),
            |g, x| one(g.rope(x[0], x[1], x[2], style)?),
        );
        s.check(
            &format!("rope then attention {style:?}"),
            &[
                inp("q", &[1, 2, 4, 6], DType::F32),
                inp("k", &[1, 2, 4, 6], DType::F32),
                inp("v", &[1, 2, 4, 6], DType::F32),
                inp("cos", &[4, 3], DType::F32),
                inp("sin", &[4, 3], DType::F32),
            ],
            acc(24),
            |g, x| {
                let q = g.rope(x[0], x[3], x[4], style)?;
                let k = g.rope(x[1], x[3], x[4], style)?;
                one(g.attention(q, k, x[2], None, true, None)?)
            },
        );
    }
    let g = Graph::new("bad rope");
    let x = g.input("x", Shape::new(&[4, 5], DType::F32)).unwrap();
    let c = g.input("c", Shape::new(&[4, 2], DType::F32)).unwrap();
    assert!(g.rope(x, c, c, RopeStyle::HalfSplit).is_err());
}

// ---------------------------------------------------------------------------------------
// Chains, planner settings and state
// ---------------------------------------------------------------------------------------

#[test]
fn elementwise_chains_in_place_and_views() {
    let mut s = Suite::new(0x1B);
    let (fast, plain) = s.check(
        "long chain",
        &[
            inp("x", &[4, 6, 8], DType::F32),
            inp("y", &[6, 1], DType::F32),
            inp("c", &[4, 6, 8], DType::Bool),
        ],
        EW,
        |g, x| {
            let a = g.exp(g.neg(x[0])?)?;
            let b = g.mul(a, x[1])?;
            let d = g.add(b, x[0])?;
            let e = g.tanh(d)?;
            let f = g.select(x[2], e, x[0])?;
            let h = g.cast(f, DType::I32)?;
            let k = g.cast(h, DType::F32)?;
            let out = g.sub(k, f)?;
            Ok(vec![out, e])
        },
    );
    assert!(
        fast.in_place >= 3 && fast.arena_bytes < plain.arena_bytes,
        "{fast} vs {plain}"
    );
    assert_eq!(plain.in_place, 0, "{plain}");
    s.check("diamond", &[inp("x", &[5, 7], DType::F32)], EW, |g, x| {
        let a = g.sigmoid(x[0])?;
        let b = g.neg(a)?;
        let c = g.mul(a, b)?;
        let d = g.add(c, a)?;
        let e = g.sub(d, g.sqrt(g.abs(b)?)?)?;
        Ok(vec![g.maximum(e, x[0])?])
    });
    let (fast, _) = s.check(
        "chain through views",
        &[inp("x", &[4, 6, 8], DType::F32)],
        EW,
        |g, x| {
            let r = g.reshape(x[0], &[24, 8])?;
            let top = g.slice(r, 0, 2, 10, 1)?;
            let t = g.sigmoid(top)?;
            let u = g.add(t, g.slice(r, 0, 12, 20, 1)?)?;
            let v = g.reshape(u, &[2, 4, 8])?;
            let w = g.mul(v, v)?;
            Ok(vec![w, g.relu(g.reshape_infer(w, &[-1])?)?, g.exp(r)?])
        },
    );
    assert!(fast.views >= 5 && fast.in_place >= 1, "{fast}");
    // Operands that are views of the same bytes as the value being overwritten: a row
    // of `x` broadcast against `x` itself, and a shifted window of the same buffer.
    s.check(
        "broadcast operand aliasing the in-place target",
        &[inp("x", &[3, 4], DType::F32)],
        EW,
        |g, x| {
            let row = g.slice(x[0], 0, 1, 2, 1)?;
            one(g.add(x[0], row)?)
        },
    );
    s.check(
        "broadcast operand aliasing a computed target",
        &[inp("x", &[5, 4], DType::F32)],
        EW,
        |g, x| {
            let e = g.exp(x[0])?;
            let last = g.slice(e, 0, 4, 5, 1)?;
            let first = g.reshape(g.slice(e, 0, 0, 1, 1)?, &[4])?;
            let z = g.mul(e, last)?;
            Ok(vec![g.sub(z, first)?])
        },
    );
    s.check(
        "reshaped operand of the same buffer",
        &[inp("x", &[6], DType::F32)],
        EW,
        |g, x| {
            let r = g.reshape(x[0], &[1, 6])?;
            one(g.mul(x[0], r)?)
        },
    );
    s.check(
        "where and compares in place",
        &[inp("a", &[6, 5], DType::I32), inp("b", &[6, 5], DType::I32)],
        EW,
        |g, x| {
            let lt = g.lt(x[0], x[1])?;
            let m = g.select(lt, x[0], x[1])?;
            let n = g.neg(m)?;
            let c = g.cast(lt, DType::I8)?;
            Ok(vec![g.add(n, x[0])?, g.cast(c, DType::Bool)?])
        },
    );
    s.check(
        "inputs and repeated values as outputs",
        &[inp("x", &[3, 4], DType::F32), inp("y", &[4], DType::I32)],
        EW,
        |g, x| {
            let e = g.exp(x[0])?;
            let r = g.reshape(x[0], &[12])?;
            Ok(vec![x[0], e, x[0], e, r, x[1], g.neg(x[1])?])
        },
    );
    s.check(
        "mixed dtypes",
        &[inp("x", &[8, 3], DType::F16), inp("y", &[8, 3], DType::F32)],
        EW,
        |g, x| {
            let a = g.cast(x[0], DType::F32)?;
            let b = g.add(a, x[1])?;
            let c = g.cast(b, DType::BF16)?;
            let d = g.exp(c)?;
            Ok(vec![g.cast(d, DType::F64)?, g.cast(b, DType::I32)?])
        },
    );
    s.check(
        "mlp block",
        &[
            inp("x", &[4, 16], DType::F32),
            inp("w1", &[16, 32], DType::F32),
            inp("w2", &[32, 16], DType::F32),
            inp("g", &[16], DType::F32),
            inp("bt", &[16], DType::F32),
        ],
        acc(64),
        |g, x| {
            let h = g.gelu(g.matmul(x[0], x[1])?)?;
            let o = g.add(g.matmul(h, x[2])?, x[0])?;
            let n = g.layer_norm(o, x[3], x[4], 1e-5)?;
            Ok(vec![g.softmax(n, -1)?, g.argmax(n, -1, false)?])
        },
    );
}

#[test]
fn params_and_constants() {
    let g = Graph::new("params");
    let x = g.input("x", Shape::new(&[3, 4], DType::F32)).unwrap();
    let w = g.param("w", Shape::new(&[4, 2], DType::F32)).unwrap();
    let c = g.constant_f32(&[0.5, -1.0], &[2]).unwrap();
    let k = g.scalar(2.0, DType::F32);
    let y = g
        .add(g.mul(g.matmul(x, w).unwrap(), k).unwrap(), c)
        .unwrap();
    let r = g.reshape(w, &[8]).unwrap();
    g.set_outputs(vec![y, r, g.slice(c, 0, 1, 2, 1).unwrap()]);
    let mut rng = Rng::new(0x1C);
    let wt = random_tensor(&mut rng, &Shape::new(&[4, 2], DType::F32), Dist::Default);
    for (device, opts) in test_devices()
        .into_iter()
        .flat_map(|d| [(d, CompileOptions::new()), (d, unreused())])
    {
        let mut compiled = Session::new(device).compile_with(&g, &opts).unwrap();
        compiled
            .set_param_typed("w", wt.to_data().as_ref())
            .unwrap();
        for _ in 0..2 {
            let xt = random_tensor(&mut rng, &Shape::new(&[3, 4], DType::F32), Dist::Default);
            let mut values =
                HashMap::from([("x".to_string(), xt.clone()), ("w".to_string(), wt.clone())]);
            let want = evaluate(&g, &mut values).unwrap();
            let xd = xt.to_data();
            let got = compiled.run_typed(&[("x", xd.as_ref())]).unwrap();
            for (k, (a, w)) in got.iter().zip(&want).enumerate() {
                compare("params", &format!("output {k}"), a, w, acc(4));
            }
        }
    }
}

/// Weights that are bytes times a per-column scale (an int8 model's dequantized
/// weights), which the CPU keeps as bytes: the products, plain and fused with a bias
/// and GELU, match the reference on every device, and setting plain floats after them
/// (which are not bytes) still gives the right products.
#[test]
fn products_with_weights_quantized_per_column() {
    let (m, k, n) = (37, 200, 70);
    let g = Graph::new("int8 weights");
    let x = g.input("x", Shape::new(&[m, k], DType::F32)).unwrap();
    let w = g.param("w", Shape::new(&[k, n], DType::F32)).unwrap();
    let bias = g.param("bias", Shape::new(&[n], DType::F32)).unwrap();
    let product = g.matmul(x, w).unwrap();
    let fused = g
        .gelu(g.add(g.matmul(x, w).unwrap(), bias).unwrap())
        .unwrap();
    g.set_outputs(vec![product, fused]);
    let mut rng = Rng::new(0x18);
    let scales: Vec<f64> = (0..n).map(|_| rng.uniform(0.001, 0.02)).collect();
    let quantized: Vec<f64> = (0..k * n)
        .map(|i| {
            let q = if i / n == i % n % k {
                127.0
            } else {
                rng.int(-127, 127) as f64
            };
            f64::from(q as f32 * scales[i % n] as f32)
        })
        .collect();
    let wq = HostTensor::new(Shape::new(&[k, n], DType::F32), quantized);
    let plain = random_tensor(&mut rng, &Shape::new(&[k, n], DType::F32), Dist::Default);
    let bt = random_tensor(&mut rng, &Shape::new(&[n], DType::F32), Dist::Default);
    for device in test_devices() {
        let mut compiled = Session::new(device).compile(&g).unwrap();
        compiled
            .set_param_typed("bias", bt.to_data().as_ref())
            .unwrap();
        for wt in [&wq, &plain, &wq] {
            compiled
                .set_param_typed("w", wt.to_data().as_ref())
                .unwrap();
            let xt = random_tensor(&mut rng, &Shape::new(&[m, k], DType::F32), Dist::Default);
            let mut values = HashMap::from([
                ("x".to_string(), xt.clone()),
                ("w".to_string(), wt.clone()),
                ("bias".to_string(), bt.clone()),
            ]);
            let want = evaluate(&g, &mut values).unwrap();
            let got = compiled.run_typed(&[("x", xt.to_data().as_ref())]).unwrap();
            for (i, (a, w)) in got.iter().zip(&want).enumerate() {
                compare("int8 weights", &format!("output {i}"), a, w, acc(k));
            }
        }
    }
}

fn handle_graph(
    axis: isize,
    pos_dtype: DType,
    cache: &[usize],
    update: &[usize],
    views: bool,
) -> Graph {
    let g = Graph::new("kv");
    let c = g.input("cache", Shape::new(cache, DType::F32)).unwrap();
    let u = g.input("upd", Shape::new(update, DType::F32)).unwrap();
    let p = g.input("pos", Shape::new(&[], pos_dtype)).unwrap();
    let mut outs = Vec::new();
    // Reads of the old state through views of the handle, created before the write.
    let (flat, first) = if views {
        (
            Some(g.reshape(c, &[cache.iter().product()]).unwrap()),
            Some(g.slice(c, 0, 0, 1, 1).unwrap()),
        )
    } else {
        (None, None)
    };
    let w = g.write_at(c, u, p, axis).unwrap();
    outs.push(w);
    outs.push(g.sum(w, &[-1], false).unwrap());
    if let (Some(flat), Some(first)) = (flat, first) {
        // Consumers of the views created after the write: they must still see the
        // state from before it, as the reference evaluator does.
        outs.push(g.mul(flat, g.scalar(2.0, DType::F32)).unwrap());
        outs.push(g.neg(first).unwrap());
    }
    g.set_outputs(outs);
    g
}

/// Runs `write_at` at several positions and checks outputs and the handle's contents
/// against the reference after every run.
fn check_write_at(label: &str, seed: u64, g: &Graph, positions: &[i64]) {
    let (cache, update, pos_dtype) = {
        let inputs = g.inputs();
        (
            inputs[0].2.clone(),
            inputs[1].2.clone(),
            inputs[2].2.dtype(),
        )
    };
    let handle = BufferHandle::new("cache", cache.dims(), DType::F32);
    let mut rng = Rng::new(seed);
    let init = random_tensor(&mut rng, &cache, Dist::Default);
    let init_f32: Vec<f32> = init.data.iter().map(|&v| v as f32).collect();
    let mut runs: Vec<(String, CompiledGraph)> = Vec::new();
    for device in test_devices() {
        for (name, opts) in [("default", CompileOptions::new()), ("no reuse", unreused())] {
            let mut compiled = Session::new(device)
                .compile_with(g, &opts.bind_handle(&handle))
                .unwrap_or_else(|e| panic!("{label}: compile for {device} failed: {e}"));
            compiled.write_handle("cache", &init_f32).unwrap();
            runs.push((format!("{name} on {device}"), compiled));
        }
    }
    let mut values = HashMap::from([("cache".to_string(), init)]);
    for &p in positions {
        let upd = random_tensor(&mut rng, &update, Dist::Default);
        let pos = HostTensor::new(Shape::new(&[], pos_dtype), vec![p as f64]);
        values.insert("upd".into(), upd.clone());
        values.insert("pos".into(), pos.clone());
        let want =
            evaluate(g, &mut values).unwrap_or_else(|e| panic!("{label}: reference failed: {e}"));
        let (ud, pd) = (upd.to_data(), pos.to_data());
        for (name, compiled) in runs.iter_mut() {
            let got = compiled
                .run_typed(&[("upd", ud.as_ref()), ("pos", pd.as_ref())])
                .unwrap_or_else(|e| panic!("{label} ({name}): run failed: {e}"));
            for (k, (a, w)) in got.iter().zip(&want).enumerate() {
                compare(
                    label,
                    &format!("{name}, pos {p}, output {k}"),
                    a,
                    w,
                    acc(cache.dims()[cache.rank() - 1]),
                );
            }
            let state = compiled.read_handle("cache").unwrap();
            let state: Vec<f64> = state.iter().map(|&v| v as f64).collect();
            assert_eq!(
                state, values["cache"].data,
                "{label} ({name}): handle after writing at {p}"
            );
        }
    }
    // A position that does not fit is an error and writes nothing; the graph still works.
    let before: Vec<Vec<f32>> = runs
        .iter()
        .map(|(_, c)| c.read_handle("cache").unwrap())
        .collect();
    let upd = random_tensor(&mut rng, &update, Dist::Default).to_data();
    let axis_len = g.nodes().iter().find_map(|n| match n.op {
        rlx::ir::Op::WriteAt { axis } => Some(cache.dims()[axis]),
        _ => None,
    });
    let axis_len = axis_len.expect("graph has a write_at") as i64;
    for bad in [-1i64, axis_len] {
        let pd = HostTensor::new(Shape::new(&[], pos_dtype), vec![bad as f64]).to_data();
        for ((name, compiled), old) in runs.iter_mut().zip(&before) {
            let err = compiled.run_typed(&[("upd", upd.as_ref()), ("pos", pd.as_ref())]);
            assert!(
                matches!(err, Err(Error::Runtime { .. })),
                "{label} ({name}): position {bad} gave {err:?}"
            );
            assert_eq!(
                &compiled.read_handle("cache").unwrap(),
                old,
                "{label} ({name}): a failed write changed the handle"
            );
        }
    }
}

#[test]
fn write_at_persistent_state() {
    check_write_at(
        "write_at axis 1 i32",
        0x1D01,
        &handle_graph(1, DType::I32, &[2, 8, 4], &[2, 3, 4], false),
        &[0, 3, 5, 2],
    );
    check_write_at(
        "write_at axis 0 i64",
        0x1D02,
        &handle_graph(0, DType::I64, &[6, 3], &[2, 3], false),
        &[4, 0, 1],
    );
    check_write_at(
        "write_at axis -1",
        0x1D03,
        &handle_graph(-1, DType::I32, &[2, 3, 10], &[2, 3, 1], false),
        &[9, 0, 4, 4],
    );
    check_write_at(
        "write_at full length",
        0x1D04,
        &handle_graph(1, DType::I64, &[3, 4], &[3, 4], false),
        &[0, 0],
    );
    check_write_at(
        "write_at with views of the old state",
        0x1D05,
        &handle_graph(1, DType::I32, &[2, 8, 4], &[2, 2, 4], true),
        &[0, 6, 3],
    );
    // Blocks of a megabyte and more, which the CPU copies on several threads: the
    // whole handle at once, and two outer blocks of rows.
    check_write_at(
        "write_at large whole",
        0x1D06,
        &handle_graph(0, DType::I64, &[700, 400], &[700, 400], false),
        &[0, 0],
    );
    check_write_at(
        "write_at large blocks",
        0x1D07,
        &handle_graph(1, DType::I32, &[2, 900, 300], &[2, 880, 300], false),
        &[20, 0, 7],
    );
}

/// A decode step's attention: q and k rotated (k into its cache), v into its cache,
/// attention over the caches (a GPU runs the rotations and writes as one kernel).
/// Checked against the reference at several positions, caches included, and a
/// position past the cache is an error that leaves both caches as they were.
#[test]
fn rotated_keys_and_values_go_into_their_caches() {
    let (seq, heads, kv_heads, dim, max_seq) = (1, 4, 2, 16, 8);
    for style in [RopeStyle::HalfSplit, RopeStyle::Interleaved] {
        let label = format!("decode attention {style:?}");
        let g = Graph::new("decode attention");
        let f32s = |d: &[usize]| Shape::new(d, DType::F32);
        let q = g.input("q", f32s(&[1, seq, heads, dim])).unwrap();
        let k = g.input("k", f32s(&[1, seq, kv_heads, dim])).unwrap();
        let v = g.input("v", f32s(&[1, seq, kv_heads, dim])).unwrap();
        let cos = g.input("cos", f32s(&[1, seq, 1, dim / 2])).unwrap();
        let sin = g.input("sin", f32s(&[1, seq, 1, dim / 2])).unwrap();
        let pos = g.input("pos", Shape::new(&[1], DType::I64)).unwrap();
        let cache = f32s(&[1, max_seq, kv_heads, dim]);
        let k_cache = g.input("k_cache", cache.clone()).unwrap();
        let v_cache = g.input("v_cache", cache.clone()).unwrap();
        let q = g.rope(q, cos, sin, style).unwrap();
        let k = g.rope(k, cos, sin, style).unwrap();
        let k_all = g.write_at(k_cache, k, pos, 1).unwrap();
        let v_all = g.write_at(v_cache, v, pos, 1).unwrap();
        let att = g.cached_attention(q, k_all, v_all, pos, None).unwrap();
        g.set_outputs(vec![att, q]);
        let handles = [
            BufferHandle::new("k_cache", cache.dims(), DType::F32),
            BufferHandle::new("v_cache", cache.dims(), DType::F32),
        ];
        let mut rng = Rng::new(0x2F0 + style as u64);
        let mut values: HashMap<String, HostTensor> = HashMap::new();
        let mut runs: Vec<(String, CompiledGraph)> = Vec::new();
        for name in ["k_cache", "v_cache"] {
            values.insert(name.into(), random_tensor(&mut rng, &cache, Dist::Default));
        }
        for device in test_devices() {
            let options = CompileOptions::new()
                .bind_handle(&handles[0])
                .bind_handle(&handles[1]);
            let mut compiled = Session::new(device).compile_with(&g, &options).unwrap();
            for name in ["k_cache", "v_cache"] {
                let init: Vec<f32> = values[name].data.iter().map(|&v| v as f32).collect();
                compiled.write_handle(name, &init).unwrap();
            }
            runs.push((device.to_string(), compiled));
        }
        let fresh = |rng: &mut Rng, name: &str| {
            let shape = g.inputs().into_iter().find(|i| i.0 == name).unwrap().2;
            random_tensor(rng, &shape, Dist::Default)
        };
        for p in [0i64, 3, 7, 4] {
            for name in ["q", "k", "v", "cos", "sin"] {
                values.insert(name.into(), fresh(&mut rng, name));
            }
            values.insert(
                "pos".into(),
                HostTensor::new(Shape::new(&[1], DType::I64), vec![p as f64]),
            );
            let want = evaluate(&g, &mut values).unwrap();
            let feeds: Vec<(String, TensorData)> = ["q", "k", "v", "cos", "sin", "pos"]
                .iter()
                .map(|&n| (n.to_string(), values[n].to_data()))
                .collect();
            let feeds: Vec<(&str, TensorRef)> = feeds
                .iter()
                .map(|(n, d)| (n.as_str(), d.as_ref()))
                .collect();
            for (name, compiled) in runs.iter_mut() {
                let got = compiled.run_typed(&feeds).unwrap();
                for (o, (a, w)) in got.iter().zip(&want).enumerate() {
                    compare(
                        &label,
                        &format!("{name}, pos {p}, output {o}"),
                        a,
                        w,
                        acc(dim * max_seq),
                    );
                }
                for cache_name in ["k_cache", "v_cache"] {
                    let state = compiled.read_handle(cache_name).unwrap();
                    let state: Vec<f64> = state.iter().map(|&v| f64::from(v)).collect();
                    let want = &values[cache_name].data;
                    let worst = state
                        .iter()
                        .zip(want)
                        .map(|(a, b)| (a - b).abs())
                        .fold(0.0, f64::max);
                    assert!(
                        worst < 1e-5,
                        "{label} ({name}): {cache_name} after pos {p} off by {worst}"
                    );
                }
            }
        }
        // A position past the cache is an error and writes neither cache.
        let bad: Vec<(String, TensorData)> = ["q", "k", "v", "cos", "sin"]
            .iter()
            .map(|&n| (n.to_string(), values[n].to_data()))
            .chain(std::iter::once((
                "pos".to_string(),
                HostTensor::new(Shape::new(&[1], DType::I64), vec![max_seq as f64]).to_data(),
            )))
            .collect();
        let bad: Vec<(&str, TensorRef)> =
            bad.iter().map(|(n, d)| (n.as_str(), d.as_ref())).collect();
        for (name, compiled) in runs.iter_mut() {
            let before: Vec<Vec<f32>> = ["k_cache", "v_cache"]
                .iter()
                .map(|c| compiled.read_handle(c).unwrap())
                .collect();
            let err = compiled.run_typed(&bad);
            assert!(
                matches!(err, Err(Error::Runtime { .. })),
                "{label} ({name}): position {max_seq} gave {err:?}"
            );
            for (c, old) in ["k_cache", "v_cache"].iter().zip(&before) {
                assert_eq!(
                    &compiled.read_handle(c).unwrap(),
                    old,
                    "{label} ({name}): {c} changed"
                );
            }
        }
    }
}

#[test]
fn handle_outputs_overwritten_by_write_at_are_refused() {
    // An output that is the handle, or a view of it, would be read after the write and
    // show the new state, where the reference gives the old one: compiling refuses it.
    for view in [false, true] {
        let g = Graph::new("handle output");
        let c = g.input("cache", Shape::new(&[4, 2], DType::F32)).unwrap();
        let u = g.input("upd", Shape::new(&[1, 2], DType::F32)).unwrap();
        let p = g.input("pos", Shape::new(&[], DType::I32)).unwrap();
        let out = if view {
            g.slice(g.reshape(c, &[8]).unwrap(), 0, 2, 6, 1).unwrap()
        } else {
            c
        };
        let w = g.write_at(c, u, p, 0).unwrap();
        g.set_outputs(vec![out, w]);
        let handle = BufferHandle::new("cache", &[4, 2], DType::F32);
        let err = Session::new(Device::Cpu)
            .compile_with(&g, &CompileOptions::new().bind_handle(&handle))
            .unwrap_err();
        assert!(matches!(err, Error::InvalidGraph { .. }), "{err}");
    }
}

#[test]
fn interpolate_along_every_axis() {
    let mut s = Suite::new(0x1F);
    // (x dims, axis, taps, outputs): rows resized (inner > 1), the last axis (each
    // output gathers its taps), no taps, one tap, and outputs large enough to be
    // split between threads.
    let cases: [(&[usize], isize, usize, usize); 8] = [
        (&[2, 3, 5, 7], 2, 2, 9),
        (&[2, 3, 5, 7], -1, 2, 13),
        (&[4, 6], 0, 4, 11),
        (&[3, 5], 1, 1, 10),
        (&[3, 5], 1, 0, 4),
        (&[6], 0, 3, 6),
        (&[2, 8, 32, 64], 2, 2, 64),
        (&[2, 8, 64, 32], 3, 2, 64),
    ];
    for (dims, axis, taps, width) in cases {
        let n = dims[if axis < 0 {
            dims.len() - 1
        } else {
            axis as usize
        }] as i64;
        for dt in [DType::F32, DType::F64, DType::F16] {
            for idx_dt in [DType::I64, DType::I32] {
                let inputs = [
                    inp("x", dims, dt).dist(Dist::Special),
                    inp("index", &[taps, width], idx_dt).dist(Dist::Int(-n, n - 1)),
                    inp("weight", &[taps, width], dt),
                ];
                s.check(
                    &format!("interpolate {dt} {dims:?} axis {axis} taps {taps} by {idx_dt}"),
                    &inputs,
                    acc(taps.max(1)),
                    |g, x| one(g.interpolate(x[0], x[1], x[2], axis)?),
                );
            }
        }
        check_decomposed_on_cpu(
            &format!("interpolate decomposed {dims:?} axis {axis} taps {taps}"),
            mix(0x1F00 + taps as u64 + width as u64),
            &[
                inp("x", dims, DType::F32),
                inp("index", &[taps, width], DType::I64).dist(Dist::Int(-n, n - 1)),
                inp("weight", &[taps, width], DType::F32),
            ],
            acc(taps.max(1)),
            |g, x| one(g.interpolate(x[0], x[1], x[2], axis)?),
        );
    }
}

#[test]
fn interpolate_rejects_bad_operands_and_indices() {
    let g = Graph::new("interpolate errors");
    let x = g.input("x", Shape::new(&[2, 5, 3], DType::F32)).unwrap();
    let idx = g.input("idx", Shape::new(&[2, 4], DType::I64)).unwrap();
    let w = g.input("w", Shape::new(&[2, 4], DType::F32)).unwrap();
    let flat = g.input("flat", Shape::new(&[4], DType::I64)).unwrap();
    let w64 = g.input("w64", Shape::new(&[2, 4], DType::F64)).unwrap();
    let ints = g.input("ints", Shape::new(&[2, 5], DType::I32)).unwrap();
    for (what, result) in [
        ("a flat index", g.interpolate(x, flat, w, 1)),
        ("weights of another dtype", g.interpolate(x, idx, w64, 1)),
        ("an integer input", g.interpolate(ints, idx, idx, 1)),
        ("float indices", g.interpolate(x, w, w, 1)),
        ("an axis past the rank", g.interpolate(x, idx, w, 3)),
    ] {
        let err = result.unwrap_err();
        assert!(err.to_string().contains("interpolate"), "{what}: {err}");
    }
    // The graph still builds, and indices past the axis fail at run time.
    let y = g.interpolate(x, idx, w, 1).unwrap();
    g.set_outputs(vec![y]);
    let xs = vec![1.0f32; 30];
    let ws = vec![0.5f32; 8];
    for device in test_devices() {
        let mut compiled = Session::new(device).compile(&g).unwrap();
        for bad in [[0i64, 5, 1, 2, 0, 0, 0, 0], [0, 0, 0, 0, -6, 0, 0, 0]] {
            let err = compiled.run_typed(&[
                ("x", TensorRef::F32(&xs)),
                ("idx", TensorRef::I64(&bad)),
                ("w", TensorRef::F32(&ws)),
                ("flat", TensorRef::I64(&[0; 4])),
                ("w64", TensorRef::F64(&[0.0; 8])),
                ("ints", TensorRef::I32(&[0; 10])),
            ]);
            assert!(
                matches!(err, Err(Error::Runtime { .. })),
                "{device}: {err:?}"
            );
        }
        let good = [0i64, 4, -1, 2, 1, 1, 1, 1];
        let out = compiled
            .run_typed(&[
                ("x", TensorRef::F32(&xs)),
                ("idx", TensorRef::I64(&good)),
                ("w", TensorRef::F32(&ws)),
                ("flat", TensorRef::I64(&[0; 4])),
                ("w64", TensorRef::F64(&[0.0; 8])),
                ("ints", TensorRef::I32(&[0; 10])),
            ])
            .unwrap();
        assert!(
            out[0].as_ref().to_f64_vec().iter().all(|&v| v == 1.0),
            "{device}: {:?}",
            out[0]
        );
    }
}

#[test]
fn gather_out_of_range_is_an_error() {
    let g = Graph::new("gather oob");
    let data = g.input("data", Shape::new(&[5, 3], DType::F32)).unwrap();
    let idx = g.input("idx", Shape::new(&[4], DType::I32)).unwrap();
    let e = g.exp(data).unwrap();
    let y = g.gather(e, idx, 0).unwrap();
    let z = g.add(y, g.scalar(1.0, DType::F32)).unwrap();
    g.set_outputs(vec![z]);
    let mut rng = Rng::new(0x1E);
    for (device, opts) in test_devices()
        .into_iter()
        .flat_map(|d| [(d, CompileOptions::new()), (d, unreused())])
    {
        let mut compiled = Session::new(device).compile_with(&g, &opts).unwrap();
        for round in 0..3 {
            let dt = random_tensor(&mut rng, &Shape::new(&[5, 3], DType::F32), Dist::Default);
            let d = dt.to_data();
            for bad in [
                [0, 5, 1, 2],
                [-6, 0, 0, 0],
                [1, 2, 3, i32::MAX],
                [i32::MIN, 0, 0, 0],
            ] {
                let err =
                    compiled.run_typed(&[("data", d.as_ref()), ("idx", TensorRef::I32(&bad))]);
                assert!(
                    matches!(err, Err(Error::Runtime { .. })),
                    "round {round}: index {bad:?} gave {err:?}"
                );
            }
            let good = [round - 1, 4, -5, 2];
            let mut values = HashMap::from([
                ("data".to_string(), dt.clone()),
                (
                    "idx".to_string(),
                    HostTensor::new(
                        Shape::new(&[4], DType::I32),
                        good.iter().map(|&v| v as f64).collect(),
                    ),
                ),
            ]);
            let want = evaluate(&g, &mut values).unwrap();
            let got = compiled
                .run_typed(&[("data", d.as_ref()), ("idx", TensorRef::I32(&good))])
                .unwrap();
            compare("gather after error", "output 0", &got[0], &want[0], EW);
        }
    }
    // An out-of-range index is an error even when the result is empty.
    let g = Graph::new("gather oob empty");
    let data = g.input("data", Shape::new(&[5, 0], DType::F32)).unwrap();
    let idx = g.input("idx", Shape::new(&[2], DType::I64)).unwrap();
    g.set_outputs(vec![g.gather(data, idx, 0).unwrap()]);
    for device in test_devices() {
        let mut compiled = Session::new(device).compile(&g).unwrap();
        let err = compiled.run_typed(&[
            ("data", TensorRef::F32(&[])),
            ("idx", TensorRef::I64(&[1, 5])),
        ]);
        assert!(
            matches!(err, Err(Error::Runtime { .. })),
            "{device}: {err:?}"
        );
        let ok = compiled
            .run_typed(&[
                ("data", TensorRef::F32(&[])),
                ("idx", TensorRef::I64(&[1, -5])),
            ])
            .unwrap();
        assert_eq!(ok, vec![TensorData::F32(vec![])], "{device}");
    }
    let mut values = HashMap::from([
        (
            "data".to_string(),
            HostTensor::new(Shape::new(&[5, 0], DType::F32), vec![]),
        ),
        (
            "idx".to_string(),
            HostTensor::new(Shape::new(&[2], DType::I64), vec![1.0, 5.0]),
        ),
    ]);
    assert!(matches!(
        evaluate(&g, &mut values),
        Err(Error::Runtime { .. })
    ));
    // The reference rejects the same index.
    let mut values = HashMap::from([
        (
            "data".to_string(),
            HostTensor::new(Shape::new(&[5, 3], DType::F32), vec![0.0; 15]),
        ),
        (
            "idx".to_string(),
            HostTensor::new(Shape::new(&[4], DType::I32), vec![0.0, 5.0, 0.0, 0.0]),
        ),
    ]);
    assert!(evaluate(&g, &mut values).is_err());
}

/// Random dimensions of rank `0..=max_rank`, each in `0..=max_dim` (zero rarely).
fn random_dims(rng: &mut Rng, max_rank: i64, max_dim: i64) -> Vec<usize> {
    let rank = rng.int(0, max_rank) as usize;
    (0..rank)
        .map(|_| {
            if rng.chance(1, 12) {
                0
            } else {
                rng.int(1, max_dim) as usize
            }
        })
        .collect()
}

/// A shape that broadcasts to `dims`: some axes set to 1, some leading axes dropped.
fn broadcastable(rng: &mut Rng, dims: &[usize]) -> Vec<usize> {
    let drop = rng.int(0, dims.len() as i64) as usize;
    dims[drop..]
        .iter()
        .map(|&d| if rng.chance(1, 3) { 1 } else { d })
        .collect()
}

#[test]
fn random_shapes() {
    let mut s = Suite::new(0x20);
    let mut rng = Rng::new(0x20);
    for case in 0..300 {
        let dims = random_dims(&mut rng, 5, 4);
        let rank = dims.len();
        // `a` has the full shape, so every result has `dims`.
        let a = dims.clone();
        let b = broadcastable(&mut rng, &dims);
        let c = broadcastable(&mut rng, &dims);
        let dt = [DType::F32, DType::F64, DType::I32, DType::F16][case % 4];
        let op = [BinaryOp::Add, BinaryOp::Mul, BinaryOp::Max, BinaryOp::Sub][(case / 4) % 4];
        // A random subset of axes (as negative or positive numbers) to reduce.
        let mut axes: Vec<isize> = Vec::new();
        for a in 0..rank {
            if rng.chance(1, 2) {
                axes.push(if rng.chance(1, 2) {
                    a as isize - rank as isize
                } else {
                    a as isize
                });
            }
        }
        let keepdims = rng.chance(1, 2);
        let mut perm: Vec<usize> = (0..rank).collect();
        for i in (1..rank).rev() {
            perm.swap(i, rng.int(0, i as i64) as usize);
        }
        // A random Python slice on a random axis.
        let slice = (rank > 0).then(|| {
            let axis = rng.int(0, rank as i64 - 1) as isize;
            let step = [1, 2, -1, -2, 3][rng.int(0, 4) as usize];
            (axis, rng.int(-6, 6) as isize, rng.int(-6, 6) as isize, step)
        });
        let pads: Vec<(usize, usize)> = dims
            .iter()
            .map(|_| (rng.int(0, 2) as usize, rng.int(0, 2) as usize))
            .collect();
        let reps: Vec<usize> = dims.iter().map(|_| rng.int(0, 2) as usize).collect();
        let count = if axes.is_empty() {
            dims.iter().product()
        } else {
            axes.iter()
                .map(|&a| dims[a.rem_euclid(rank.max(1) as isize) as usize])
                .product()
        };
        let label = format!(
            "random {dt} {dims:?}: {} {a:?} {b:?}, where {c:?}, sum {axes:?}, perm {perm:?}, slice {slice:?}",
            op.name()
        );
        let ins = [
            inp("a", &a, dt),
            inp("b", &b, dt),
            inp("c", &c, DType::Bool),
        ];
        s.check(&label, &ins, acc(count), |g, x| {
            // The broadcast operand on either side.
            let y = if case % 2 == 1 {
                g.binary(op, x[1], x[0])?
            } else {
                g.binary(op, x[0], x[1])?
            };
            let z = g.select(x[2], y, x[0])?;
            let mut outs = vec![
                y,
                z,
                g.sum(z, &axes, keepdims)?,
                g.permute(z, &perm)?,
                g.tile(z, &reps)?,
            ];
            outs.push(g.pad(z, &pads, PadMode::Constant(F64Bits::new(0.5)))?);
            if let Some((axis, start, end, step)) = slice {
                let sl = g.slice(z, axis, start, end, step)?;
                outs.push(sl);
                outs.push(g.add(sl, g.slice(y, axis, start, end, step)?)?);
            }
            Ok(outs)
        });
    }
}

/// Says on stderr whether the CUDA cases of the suites run here, and why not (CI
/// shows it with `--nocapture`); on a machine with a GPU, that the device answers.
#[test]
fn gradient_graphs_run_on_every_device() {
    let mut s = Suite::new(0x4A);
    for dt in [DType::F32, DType::F64] {
        // A two-layer classifier with a cross-entropy loss against soft targets: the
        // loss and the gradient of every weight, as `grad` appends them.
        s.check(
            &format!("mlp cross-entropy gradients {dt}"),
            &[
                inp("x", &[8, 6], dt),
                inp("w1", &[6, 16], dt),
                inp("b1", &[16], dt),
                inp("w2", &[16, 4], dt),
                inp("logits", &[8, 4], dt),
            ],
            acc(16),
            |g, x| {
                let h = g.unary(UnaryOp::Tanh, g.add(g.matmul(x[0], x[1])?, x[2])?)?;
                let out = g.matmul(h, x[3])?;
                let target = g.softmax(x[4], -1)?;
                let picked = g.mul(g.log_softmax(out, -1)?, target)?;
                let loss = g.unary(
                    UnaryOp::Neg,
                    g.reduce(ReduceOp::Mean, g.sum(picked, &[1], false)?, &[], false)?,
                )?;
                let mut outs = vec![loss];
                outs.extend(rlx::grad(g, loss, &[x[1], x[2], x[3]])?);
                Ok(outs)
            },
        );
        // An embedding, a layer norm (through its decomposition) and a ReLU.
        s.check(
            &format!("embedding and layer norm gradients {dt}"),
            &[
                inp("table", &[10, 8], dt),
                inp("gamma", &[8], dt),
                inp("beta", &[8], dt),
            ],
            acc(8),
            |g, x| {
                let ids = g.constant(TensorData::I64(vec![3, 7, 3, 0, 9, 1]), &[2, 3])?;
                let rows = g.gather(x[0], ids, 0)?;
                let normed = g.layer_norm(rows, x[1], x[2], 1e-5)?;
                let y = g.unary(UnaryOp::Relu, normed)?;
                let loss = g.sum(g.mul(y, y)?, &[], false)?;
                let mut outs = vec![loss];
                outs.extend(rlx::grad(g, loss, &[x[0], x[1], x[2]])?);
                Ok(outs)
            },
        );
        // The cross-entropy loss with an ignored row and label smoothing.
        s.check(
            &format!("cross-entropy gradients {dt}"),
            &[inp("logits", &[6, 7], dt)],
            acc(7),
            |g, x| {
                let ids = g.constant(TensorData::I64(vec![6, 0, -100, 3, 3, 1]), &[6])?;
                let options = rlx::ir::CrossEntropy {
                    ignore_index: Some(-100),
                    label_smoothing: 0.1,
                };
                let loss = g.cross_entropy(x[0], ids, options)?;
                let mut outs = vec![loss];
                outs.extend(rlx::grad(g, loss, &[x[0]])?);
                Ok(outs)
            },
        );
        // A convolution with a bias and a ReLU, then a max pool.
        s.check(
            &format!("cnn gradients {dt}"),
            &[
                inp("x", &[2, 3, 8, 8], dt),
                inp("w", &[5, 3, 3, 3], dt),
                inp("b", &[5], dt),
                inp("w2", &[4, 5, 3, 3], dt),
            ],
            acc(128),
            |g, x| {
                let y = g.conv2d(x[0], x[1], Some(x[2]), [1, 1], [1, 1, 1, 1], [1, 1], 1)?;
                let y = g.max_pool2d(g.unary(UnaryOp::Relu, y)?, [2, 2], [2, 2], [0; 4])?;
                // A stride-2 convolution after the pool.
                let y = g.conv2d(y, x[3], None, [2, 2], [1, 1, 1, 1], [1, 1], 1)?;
                let loss = g.sum(g.mul(y, y)?, &[], false)?;
                let mut outs = vec![loss];
                outs.extend(rlx::grad(g, loss, &[x[0], x[1], x[2], x[3]])?);
                Ok(outs)
            },
        );
        // A grouped, dilated, strided convolution padded by more than its kernel, then
        // overlapping padded max and average pools (dilated ones too).
        s.check(
            &format!("grouped conv and overlapping pool gradients {dt}"),
            &[
                inp("x", &[2, 4, 9, 8], dt),
                inp("w", &[6, 2, 3, 2], dt),
                inp("b", &[6], dt),
            ],
            acc(256),
            |g, x| {
                let y = g.conv2d(x[0], x[1], Some(x[2]), [2, 1], [3, 2, 4, 1], [2, 3], 2)?;
                let y = g.unary(UnaryOp::Tanh, y)?;
                let top = g.max_pool2d(y, [3, 3], [2, 1], [1, 1, 1, 1])?;
                let mean = g.avg_pool2d(y, [2, 3], [1, 2], [1, 1, 0, 2], false)?;
                let window = rlx::ir::Window2d {
                    kernel: [2, 2],
                    stride: [1, 1],
                    padding: [1, 0, 0, 1],
                    dilation: [2, 2],
                };
                let spread = g.push(
                    rlx::ir::Op::AvgPool2d {
                        window,
                        count_include_pad: true,
                    },
                    &[y],
                )?;
                let mut loss = g.sum(g.mul(top, top)?, &[], false)?;
                for t in [mean, spread] {
                    loss = g.add(loss, g.sum(g.mul(t, t)?, &[], false)?)?;
                }
                let mut outs = vec![loss];
                outs.extend(rlx::grad(g, loss, &[x[0], x[1], x[2]])?);
                Ok(outs)
            },
        );
        // Data movement: a strided backward slice, a gather on axis 1 with negative
        // and repeated indices, reflect and edge pads, a tile, a reversed exclusive
        // cumsum, top-k values and a product.
        s.check(
            &format!("data movement gradients {dt}"),
            &[inp("x", &[4, 6, 5], dt)],
            acc(64),
            |g, x| {
                let x = x[0];
                let sliced = g.slice_axes(x, &[(0, 3, isize::MIN, -2), (1, 0, 6, 2)])?;
                let ids = g.constant(TensorData::I64(vec![5, -1, 0, 2]), &[2, 2])?;
                let gathered = g.gather(x, ids, 1)?;
                let reflect = g.pad(x, &[(1, 2), (2, 1), (0, 3)], rlx::ir::PadMode::Reflect)?;
                let edge = g.pad(x, &[(0, 0), (3, 0), (2, 2)], rlx::ir::PadMode::Edge)?;
                let tiled = g.tile(x, &[2, 1, 3])?;
                let running = g.cumsum(x, 1, true, true)?;
                let (top, _) = g.topk(x, 2, -1, true)?;
                let product = g.prod(x, &[2], false)?;
                let mut loss = g.sum(g.mul(sliced, sliced)?, &[], false)?;
                for t in [gathered, reflect, edge, tiled, running, top, product] {
                    let term = g.mul(g.unary(UnaryOp::Sin, t)?, t)?;
                    loss = g.add(loss, g.sum(term, &[], false)?)?;
                }
                let mut outs = vec![loss];
                outs.extend(rlx::grad(g, loss, &[x])?);
                Ok(outs)
            },
        );
    }
}

#[test]
fn cuda_availability_is_reported() {
    match rlx::device_available(Device::Cuda(0)) {
        Ok(()) => {
            eprintln!("CUDA cases run on cuda:0");
            assert!(test_devices().contains(&Device::Cuda(0)));
        }
        Err(e) => {
            eprintln!("SKIP every CUDA case of the op, quant and handle suites: {e}");
            assert!(matches!(e, Error::DeviceUnavailable { .. }), "{e}");
            assert_eq!(test_devices(), vec![Device::Cpu]);
        }
    }
}
