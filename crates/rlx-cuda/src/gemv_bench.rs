//! A benchmark of the matrix-vector kernels on the GPU (an ignored test: it asserts
//! each kernel's result against a host reference and prints what each took):
//!
//! `unit-rlx_cuda --ignored --nocapture gemv_bandwidth` (the rlx-cuda unit-test
//! binary that `scripts/gpu-check.sh build` carries).
//!
//! For the decode products of a ~1B Llama (bf16 weights, one f32 row), each kernel
//! variant is launched back to back over enough copies of the weight that none is
//! still in L2 when it comes round again, as in a decode step where every weight is
//! read once; CUDA events around the launches give the time per product and the
//! weight bytes over it the bandwidth.

use crate::codegen::fused::Epilogue;
use crate::codegen::gemv::{GEMV_ROW_ELEMENTS, Gemv, GemvRows, gemv, gemv_rows};
use crate::codegen::gemv_group::{GroupProduct, RowGroup, gemv_group};
use crate::codegen::{Kernel, entering_after_predecessor};
use crate::gpu::{DeviceBuffer, Gpu, launch};
use crate::nvrtc::Module;
use cudarc::driver::{result as driver, sys};
use rlx_ir::{BinaryOp, DType, EwStep, UnaryOp};
use std::ffi::c_void;

/// Products `(K, N)`: q/o, k/v, q+k+v, gate/up, down, gate+up, the tied head.
const SHAPES: [(usize, usize); 7] = [
    (2048, 2048),
    (2048, 512),
    (2048, 3072),
    (2048, 8192),
    (8192, 2048),
    (2048, 16384),
    (2048, 128_256),
];

/// Launches timed per variant.
const LAUNCHES: usize = 200;

/// Bytes of weight copies cycled through (past L2).
const CYCLE_BYTES: usize = 1 << 30;

fn bf16_bits(v: f32) -> u16 {
    // Round to nearest even, as the converter on the device does.
    let b = v.to_bits();
    ((b + 0x7fff + ((b >> 16) & 1)) >> 16) as u16
}

fn bf16_value(h: u16) -> f64 {
    f64::from(f32::from_bits(u32::from(h) << 16))
}

/// A small deterministic generator (no dependency for random numbers).
struct Lcg(u64);

impl Lcg {
    fn next(&mut self) -> f32 {
        self.0 = self
            .0
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((self.0 >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
    }
}

/// What a variant's kernel takes after its output and activation row.
#[derive(Clone, Copy, PartialEq)]
enum Operands {
    /// The weight.
    Weight,
    /// The weight, then the workspace's partial sums and counters.
    WeightAndWorkspace,
    /// A norm scale of ones, then the weight: the result is the product of the
    /// RMS-normalized row.
    NormThenWeight,
    /// Two weights (two copies of the same values): the result is
    /// `silu(p) * p` of the product `p`.
    TwoWeightsGated,
    /// Both: the norm scale, then two weights.
    NormThenTwoWeightsGated,
}

/// One kernel variant and the layout of the weight it reads.
struct Variant {
    label: String,
    kernel: Kernel,
    /// The weight as `[N, K]` (else `[K, N]`).
    rows_layout: bool,
    /// Workspace bytes (partial sums after 4 KiB of zeroed counters).
    workspace: usize,
    programmatic: bool,
    operands: Operands,
}

/// The epsilon of the benchmarked folded norm.
const NORM_EPS: f64 = 1e-5;

fn variants(k: usize, n: usize, sms: usize) -> Vec<Variant> {
    let identity = Epilogue {
        alpha: 1.0,
        bias: false,
        activation: None,
        residual: false,
    };
    let mut v = Vec::new();
    for programmatic in [false, true] {
        let launch = if programmatic { "pdl" } else { "plain" };
        for prefetch in [0, 32 << 10] {
            let mut g = Gemv::new(1, k, n, 3 * sms, true);
            g.prefetch_bytes = prefetch;
            let kernel = gemv("bench", &g, &identity, DType::F32, DType::BF16).unwrap();
            v.push(Variant {
                label: format!(
                    "[K,N] split {} prefetch {}K {launch}",
                    g.splits,
                    prefetch >> 10
                ),
                kernel,
                rows_layout: false,
                workspace: g.partial_bytes(),
                programmatic,
                operands: Operands::WeightAndWorkspace,
            });
        }
        v.push(Variant {
            label: format!("[N,K] first version, prefetch row {launch}"),
            kernel: first_row_kernel(k, n, 16 * sms),
            rows_layout: true,
            workspace: 0,
            programmatic,
            operands: Operands::Weight,
        });
        for split in [1, 2, 4, 8] {
            for prefetch in [false, true] {
                let mut g = GemvRows::with_split(1, k, n, 16 * sms, true, split);
                g.prefetch = prefetch;
                let kernel = gemv_rows("bench", &g, &identity, DType::F32, DType::BF16).unwrap();
                let chosen = GemvRows::new(1, k, n, 16 * sms, true).split == split;
                v.push(Variant {
                    label: format!(
                        "[N,K] warps/row {split} blocks {} prefetch {} {launch}{}",
                        g.blocks,
                        if prefetch { "row" } else { "none" },
                        if chosen { " (default split)" } else { "" }
                    ),
                    kernel,
                    rows_layout: true,
                    workspace: 0,
                    programmatic,
                    operands: Operands::Weight,
                });
            }
        }
        if k > GEMV_ROW_ELEMENTS {
            continue;
        }
        // The group kernel: one product with the norm folded in, and two combined
        // (each product reads the bytes of one weight; the gated one twice that).
        let product = GroupProduct {
            n,
            epilogue: identity,
        };
        let silu_mul = vec![
            EwStep::Unary(UnaryOp::Silu, 0),
            EwStep::Binary(BinaryOp::Mul, 2, 1),
        ];
        let group = |pair: bool, norm: bool, staged: bool| RowGroup {
            rows: 1,
            k,
            products: vec![product; 1 + usize::from(pair)],
            combine: pair.then(|| silu_mul.clone()),
            norm: norm.then_some(NORM_EPS),
            max_blocks: 16 * sms,
            staged,
            pairs: false,
            tail: None,
        };
        let mut add = |label: String, g: RowGroup, operands| {
            v.push(Variant {
                label: format!(
                    "[N,K] {label}, {} blocks{} {launch}",
                    g.blocks(),
                    if g.staged { ", staged" } else { "" }
                ),
                kernel: gemv_group("bench", &g, DType::F32, DType::BF16).unwrap(),
                rows_layout: true,
                workspace: 0,
                programmatic,
                operands,
            });
        };
        for staged in [false, true] {
            add(
                "group of 1".into(),
                group(false, false, staged),
                Operands::Weight,
            );
            add(
                "group of 1, norm folded".into(),
                group(false, true, staged),
                Operands::NormThenWeight,
            );
        }
        // Two rows a warp (as the q/k/v kernel walks them for its rotations).
        add(
            "group of 1, norm folded, rows in pairs".into(),
            RowGroup {
                pairs: true,
                ..group(false, true, true)
            },
            Operands::NormThenWeight,
        );
        // Gated pairs read twice the bytes of the row above.
        for (norm, staged) in [(false, false), (true, false), (true, true)] {
            add(
                format!(
                    "pair silu(a) * b{}",
                    if norm { ", norm folded" } else { "" }
                ),
                group(true, norm, staged),
                if norm {
                    Operands::NormThenTwoWeightsGated
                } else {
                    Operands::TwoWeightsGated
                },
            );
        }
    }
    v
}

/// The first row-layout kernel measured (a warp per output, bf16 weights, an f32
/// row, `K` a multiple of 256), kept beside the generated one to tell a change in
/// the kernel from a change in the machine.
fn first_row_kernel(k: usize, n: usize, max_blocks: usize) -> Kernel {
    let source = format!(
        r#"extern "C" __global__ void __launch_bounds__(256) bench(float* __restrict__ out, const float* __restrict__ a, const unsigned short* __restrict__ b) {{
  const long long K = {k}LL, N = {n}LL;
  const int lane = threadIdx.x & 31;
  const long long first = (long long)blockIdx.x * 8 + (threadIdx.x >> 5), warps = (long long)gridDim.x * 8;
  if (first < N && (lane & 7) == 0) {{ for (long long k = lane * 8; k < K; k += 256) rlx_prefetch_l2(b + first * K + k); }}
  RLX_ENTER();
  for (long long col = first; col < N; col += warps) {{
    const unsigned short* row = b + col * K;
    float acc = 0.f;
    #pragma unroll 8
    for (long long k = lane * 8; k < K; k += 256) {{
      const uint4 q = *reinterpret_cast<const uint4*>(row + k);
      const unsigned int u[4] = {{q.x, q.y, q.z, q.w}};
      float w[8];
      #pragma unroll
      for (int j = 0; j < 4; ++j) {{ w[2 * j] = bf2f((unsigned short)(u[j] & 0xffffu)); w[2 * j + 1] = bf2f((unsigned short)(u[j] >> 16)); }}
      const float4 x0 = *reinterpret_cast<const float4*>(a + k), x1 = *reinterpret_cast<const float4*>(a + k + 4);
      acc = fmaf(x0.x, w[0], fmaf(x0.y, w[1], fmaf(x0.z, w[2], fmaf(x0.w, w[3], fmaf(x1.x, w[4], fmaf(x1.y, w[5], fmaf(x1.z, w[6], fmaf(x1.w, w[7], acc))))))));
    }}
    acc = warp_sum(acc);
    if (lane == 0) out[col] = acc;
  }}
}}
"#
    );
    Kernel {
        source,
        grid: crate::codegen::Grid::Blocks {
            count: n.div_ceil(8).clamp(1, max_blocks),
            threads: 256,
        },
        check: None,
    }
}

/// The weight `[N, K]` (as bf16 bits) and the activation row.
fn data(k: usize, n: usize) -> (Vec<u16>, Vec<f32>) {
    let mut rng = Lcg(0x5eed ^ (k * 31 + n) as u64);
    let w = (0..n * k).map(|_| bf16_bits(rng.next() * 0.05)).collect();
    let a = (0..k).map(|_| rng.next()).collect();
    (w, a)
}

fn bytes_of(v: &[u16]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Times `variant` over the copies, launched one by one and as a captured graph;
/// returns microseconds per launch for each, and the result.
fn time(
    gpu: &Gpu,
    variant: &Variant,
    copies: &[DeviceBuffer],
    a: &DeviceBuffer,
    ones: &DeviceBuffer,
    n: usize,
) -> (f64, f64, Vec<f32>) {
    let name = "gemv_bench";
    let source = format!(
        "{}{}",
        crate::codegen::PRELUDE,
        entering_after_predecessor(&variant.kernel.source.replace("bench", name))
    );
    let module = Module::compile(gpu, &source).expect("the kernel compiles");
    let function = module.function(name).expect("the kernel is there");
    let out = DeviceBuffer::new(gpu, n * 4, "bench output").unwrap();
    let workspace = DeviceBuffer::new(gpu, 4096 + variant.workspace, "bench workspace").unwrap();
    workspace.upload(gpu, 0, &[0u8; 4096]).unwrap();
    let crate::codegen::Grid::Blocks { count, threads } = variant.kernel.grid else {
        panic!("matrix-vector kernels launch whole blocks")
    };
    let stream = gpu.cu_stream();
    let run = |i: usize| {
        let copy = &copies[i % copies.len()];
        let mut values: Vec<u64> = vec![out.ptr(), a.ptr()];
        match variant.operands {
            Operands::Weight => values.push(copy.ptr()),
            Operands::WeightAndWorkspace => {
                values.extend([copy.ptr(), workspace.ptr() + 4096, workspace.ptr()])
            }
            Operands::NormThenWeight => values.extend([ones.ptr(), copy.ptr()]),
            Operands::TwoWeightsGated => {
                values.extend([copy.ptr(), copies[(i + 1) % copies.len()].ptr()])
            }
            Operands::NormThenTwoWeightsGated => {
                values.extend([ones.ptr(), copy.ptr(), copies[(i + 1) % copies.len()].ptr()])
            }
        }
        let mut params: Vec<*mut c_void> =
            values.iter_mut().map(|v| (v as *mut u64).cast()).collect();
        // SAFETY: one pointer per kernel parameter, each a live device address.
        unsafe {
            launch(
                function,
                (count as u32, threads),
                stream,
                &mut params,
                variant.programmatic,
            )
        }
        .expect("the launch is queued");
    };
    for i in 0..4 {
        run(i);
    }
    let event = || driver::event::create(sys::CUevent_flags::CU_EVENT_DEFAULT).unwrap();
    let (start, stop) = (event(), event());
    // SAFETY: events created above, recorded and read on the bench's own stream,
    // then destroyed once.
    let ms = unsafe {
        driver::event::record(start, stream).unwrap();
        for i in 0..LAUNCHES {
            run(i);
        }
        driver::event::record(stop, stream).unwrap();
        driver::event::synchronize(stop).unwrap();
        let ms = driver::event::elapsed(start, stop).unwrap();
        driver::event::destroy(start).unwrap();
        driver::event::destroy(stop).unwrap();
        ms
    };
    // The same launches captured as one CUDA graph and replayed, as a program runs.
    // SAFETY: the capture is begun and ended on the bench's stream; the graph and
    // its instance are destroyed once, after the stream is drained.
    let graph_ms = unsafe {
        driver::stream::begin_capture(
            stream,
            sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL,
        )
        .unwrap();
        for i in 0..LAUNCHES {
            run(i);
        }
        let graph = driver::stream::end_capture(stream).unwrap();
        let exec = driver::graph::instantiate(graph, sys::CUgraphInstantiate_flags(0)).unwrap();
        driver::graph::launch(exec, stream).unwrap();
        let (start, stop) = (event(), event());
        driver::event::record(start, stream).unwrap();
        driver::graph::launch(exec, stream).unwrap();
        driver::event::record(stop, stream).unwrap();
        driver::event::synchronize(stop).unwrap();
        let ms = driver::event::elapsed(start, stop).unwrap();
        driver::event::destroy(start).unwrap();
        driver::event::destroy(stop).unwrap();
        driver::graph::exec_destroy(exec).unwrap();
        driver::graph::destroy(graph).unwrap();
        ms
    };
    let mut bytes = vec![0u8; n * 4];
    out.download(gpu, 0, &mut bytes).unwrap();
    let result = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    let per_launch = |ms: f32| f64::from(ms) * 1e3 / LAUNCHES as f64;
    (per_launch(ms), per_launch(graph_ms), result)
}

#[test]
#[ignore = "a benchmark for the GPU machine: --ignored --nocapture gemv_bandwidth"]
fn gemv_bandwidth() {
    if let Err(e) = crate::available(0) {
        eprintln!("SKIP gemv_bandwidth on cuda: {e}");
        return;
    }
    let gpu = Gpu::new(0).unwrap();
    println!("matrix-vector products, bf16 weights, one f32 row, {LAUNCHES} launches each");
    println!(
        "{:>6} {:>7} {:>9} {:>8} {:>8}  variant",
        "K", "N", "MB", "us", "GB/s"
    );
    for (k, n) in SHAPES {
        let (w, a) = data(k, n);
        let want: Vec<f64> = (0..n)
            .map(|j| {
                (0..k)
                    .map(|i| bf16_value(w[j * k + i]) * f64::from(a[i]))
                    .sum::<f64>()
            })
            .collect();
        let inv_rms = 1.0
            / (a.iter().map(|&x| f64::from(x).powi(2)).sum::<f64>() / k as f64 + NORM_EPS).sqrt();
        let mut transposed = vec![0u16; n * k];
        for j in 0..n {
            for i in 0..k {
                transposed[i * n + j] = w[j * k + i];
            }
        }
        let weight_bytes = n * k * 2;
        let count = CYCLE_BYTES.div_ceil(weight_bytes).clamp(2, 64);
        let a_buffer = DeviceBuffer::from_bytes(
            &gpu,
            &a.iter().flat_map(|x| x.to_le_bytes()).collect::<Vec<u8>>(),
            "bench activation",
        )
        .unwrap();
        let ones =
            DeviceBuffer::from_bytes(&gpu, &1.0f32.to_le_bytes().repeat(k), "bench norm scale")
                .unwrap();
        for rows_layout in [false, true] {
            let host = bytes_of(if rows_layout { &w } else { &transposed });
            let copies: Vec<DeviceBuffer> = (0..count)
                .map(|_| DeviceBuffer::from_bytes(&gpu, &host, "bench weight").unwrap())
                .collect();
            for variant in variants(k, n, gpu.multiprocessors)
                .iter()
                .filter(|v| v.rows_layout == rows_layout)
            {
                let (us, graph_us, got) = time(&gpu, variant, &copies, &a_buffer, &ones, n);
                let expected: Vec<f64> = match variant.operands {
                    Operands::NormThenWeight => want.iter().map(|w| w * inv_rms).collect(),
                    Operands::TwoWeightsGated => {
                        want.iter().map(|&w| w / (1.0 + (-w).exp()) * w).collect()
                    }
                    Operands::NormThenTwoWeightsGated => want
                        .iter()
                        .map(|&w| {
                            let w = w * inv_rms;
                            w / (1.0 + (-w).exp()) * w
                        })
                        .collect(),
                    _ => want.clone(),
                };
                let scale = expected.iter().fold(0.0f64, |m, v| m.max(v.abs()));
                let err = got
                    .iter()
                    .zip(&expected)
                    .map(|(g, w)| (f64::from(*g) - w).abs())
                    .fold(0.0, f64::max)
                    / scale;
                assert!(err < 1e-4, "{}: relative error {err:.2e}", variant.label);
                println!(
                    "{k:>6} {n:>7} {:>9.1} {us:>8.2} {:>8.0} {graph_us:>8.2} {:>8.0}  {}",
                    weight_bytes as f64 / 1e6,
                    weight_bytes as f64 / us / 1e3,
                    weight_bytes as f64 / graph_us / 1e3,
                    variant.label
                );
            }
        }
    }
}
