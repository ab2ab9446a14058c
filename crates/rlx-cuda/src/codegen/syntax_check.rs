//! Checks that the generated CUDA C parses, on machines without CUDA: every kind of
//! kernel the generator writes is put in one source, as a program would be, and
//! given to the host C++ compiler (syntax only) behind a shim that declares the CUDA
//! built-ins. NVRTC on the GPU machine remains the real compiler; this catches the
//! typos before a GPU run. `RLX_KEEP_SOURCE=FILE` keeps a copy of the source.

use super::fused::{Epilogue, epilogue_in_place};
use super::gemv::{Gemv, GemvRows, gemv, gemv_rows};
use super::gemv_group::{GroupProduct, GroupTail, RowGroup, gemv_group};
use super::rope_write::{self, RopeJob, RopeWrites, WriteJob};
use super::{PRELUDE, entering_after_predecessor, kernel, kernel_for};
use rlx_ir::{
    ArgReduceOp, BinaryOp, DType, EwStep, F64Bits, Op, PadMode, QuantFormat, ReduceOp, RopeStyle,
    Shape, SliceAxis, TopKOutput, UnaryOp, Window2d,
};
use std::process::Command;

/// Declarations standing in for what NVRTC provides.
const SHIM: &str = r#"
#include <cmath>
#define __global__
#define __device__
#define __forceinline__ inline
#define __restrict__
#define __shared__ static
#define asm(...) (void)0
struct Dim3 { unsigned x, y, z; };
static Dim3 blockIdx, threadIdx, blockDim, gridDim;
unsigned long long atomicCAS(unsigned long long*, unsigned long long, unsigned long long);
float __shfl_xor_sync(unsigned, float, int);
double __shfl_xor_sync(unsigned, double, int);
long long __shfl_xor_sync(unsigned, long long, int);
unsigned __shfl_sync(unsigned, unsigned, int);
float __int_as_float(int);
float __uint_as_float(unsigned);
double __longlong_as_double(long long);
float rsqrtf(float);
double rsqrt(double);
void __syncthreads();
void __syncwarp();
void __threadfence();
unsigned atomicAdd(unsigned*, unsigned);
float __ldcg(const float*);
float fmaf(float, float, float);
struct uint4 { unsigned x, y, z, w; };
struct float4 { float x, y, z, w; };
struct float2 { float x, y; };
#define __launch_bounds__(n)
#define __align__(n)
#define __CUDA_ARCH__ 900
float __expf(float);
using std::fmaxf; using std::fminf; using std::fmax; using std::fmin;
"#;

fn f32s(dims: &[usize]) -> Shape {
    Shape::new(dims, DType::F32)
}

/// One step of each kind, over shapes with broadcasting, odd sizes and halves.
fn samples() -> Vec<(Op, Vec<Shape>, Shape)> {
    let x = f32s(&[2, 3, 5, 7]);
    let h = Shape::new(&[2, 3, 5, 7], DType::F16);
    let i64s = |d: &[usize]| Shape::new(d, DType::I64);
    let win = Window2d {
        kernel: [3, 3],
        stride: [2, 1],
        padding: [1, 1, 1, 0],
        dilation: [1, 2],
    };
    let mut v = vec![
        (Op::Unary(UnaryOp::Gelu), vec![h.clone()], h.clone()),
        (
            Op::Binary(BinaryOp::Pow),
            vec![i64s(&[3, 1]), i64s(&[4])],
            i64s(&[3, 4]),
        ),
        (
            Op::Where,
            vec![Shape::new(&[7], DType::Bool), x.clone(), x.clone()],
            x.clone(),
        ),
        (
            Op::Cast(DType::I32),
            vec![x.clone()],
            Shape::new(x.dims(), DType::I32),
        ),
        (
            Op::Reduce {
                op: ReduceOp::Max,
                axes: vec![1, 3],
                keepdims: false,
            },
            vec![x.clone()],
            f32s(&[2, 5]),
        ),
        (
            Op::Permute {
                perm: vec![3, 0, 2, 1],
            },
            vec![x.clone()],
            f32s(&[7, 2, 5, 3]),
        ),
        (
            Op::Slice {
                axes: vec![
                    SliceAxis {
                        start: 1,
                        step: 1,
                        len: 1,
                    },
                    SliceAxis {
                        start: 2,
                        step: -1,
                        len: 2,
                    },
                    SliceAxis {
                        start: 0,
                        step: 2,
                        len: 3,
                    },
                    SliceAxis {
                        start: 0,
                        step: 1,
                        len: 7,
                    },
                ],
            },
            vec![x.clone()],
            f32s(&[1, 2, 3, 7]),
        ),
        (
            Op::Concat { axis: 1 },
            vec![x.clone(), x.clone()],
            f32s(&[2, 6, 5, 7]),
        ),
        (
            Op::Gather { axis: 1 },
            vec![x.clone(), i64s(&[4, 2])],
            f32s(&[2, 4, 2, 5, 7]),
        ),
        (
            Op::Pad {
                pads: vec![(0, 0), (1, 2), (0, 1), (3, 0)],
                mode: PadMode::Constant(F64Bits::new(f64::NEG_INFINITY)),
            },
            vec![x.clone()],
            f32s(&[2, 6, 6, 10]),
        ),
        (
            Op::Pad {
                pads: vec![(0, 0), (1, 1), (0, 0), (2, 2)],
                mode: PadMode::Reflect,
            },
            vec![h.clone()],
            Shape::new(&[2, 5, 5, 11], DType::F16),
        ),
        (
            Op::Tile {
                reps: vec![1, 2, 1, 3],
            },
            vec![x.clone()],
            f32s(&[2, 6, 5, 21]),
        ),
        (
            Op::Range {
                start: F64Bits::new(2.0),
                step: F64Bits::new(-0.5),
                len: 9,
                dtype: DType::BF16,
            },
            vec![],
            Shape::new(&[9], DType::BF16),
        ),
        (
            Op::RandomUniform {
                seed: 7,
                dims: vec![3, 5],
                dtype: DType::F16,
            },
            vec![Shape::new(&[1], DType::I64)],
            Shape::new(&[3, 5], DType::F16),
        ),
        (
            Op::OneHot {
                depth: 5,
                dtype: DType::F32,
            },
            vec![Shape::new(&[3], DType::I32)],
            f32s(&[3, 5]),
        ),
        (
            Op::Cumsum {
                axis: 2,
                exclusive: true,
                reverse: true,
            },
            vec![i64s(&[2, 3, 5])],
            i64s(&[2, 3, 5]),
        ),
        (
            Op::TopK {
                k: 3,
                axis: 2,
                largest: false,
                output: TopKOutput::Indices,
            },
            vec![x.clone()],
            i64s(&[2, 3, 3, 7]),
        ),
        (
            Op::ArgReduce {
                op: ArgReduceOp::ArgMax,
                axis: 3,
                keepdims: true,
            },
            vec![h.clone()],
            i64s(&[2, 3, 5, 1]),
        ),
        (
            Op::Conv2d {
                window: win,
                groups: 1,
            },
            vec![x.clone(), f32s(&[4, 3, 3, 3]), f32s(&[4])],
            f32s(&[2, 4, 3, 3]),
        ),
        (
            Op::MaxPool2d { window: win },
            vec![x.clone()],
            f32s(&[2, 3, 3, 3]),
        ),
        (
            Op::AvgPool2d {
                window: win,
                count_include_pad: false,
            },
            vec![h.clone()],
            Shape::new(&[2, 3, 3, 3], DType::F16),
        ),
        (
            Op::WriteAt { axis: 1 },
            vec![f32s(&[1, 16, 2, 8]), f32s(&[1, 3, 2, 8]), i64s(&[1])],
            f32s(&[1, 16, 2, 8]),
        ),
        (
            Op::CachedAttention {
                scale: F64Bits::new(0.125),
            },
            vec![
                Shape::new(&[1, 3, 4, 64], DType::BF16),
                Shape::new(&[1, 40, 2, 64], DType::BF16),
                Shape::new(&[1, 40, 2, 64], DType::BF16),
                Shape::new(&[1], DType::I32),
            ],
            Shape::new(&[1, 3, 4, 64], DType::BF16),
        ),
        (
            Op::LayerNorm {
                eps: F64Bits::new(1e-12),
            },
            vec![
                h.clone(),
                Shape::new(&[7], DType::F16),
                Shape::new(&[7], DType::F16),
            ],
            h.clone(),
        ),
        (
            Op::RmsNorm {
                eps: F64Bits::new(1e-5),
            },
            vec![f32s(&[3, 2048]), f32s(&[2048])],
            f32s(&[3, 2048]),
        ),
        // A warp a row.
        (
            Op::LayerNorm {
                eps: F64Bits::new(1e-12),
            },
            vec![
                Shape::new(&[300, 384], DType::F16),
                Shape::new(&[384], DType::F16),
                Shape::new(&[384], DType::F16),
            ],
            Shape::new(&[300, 384], DType::F16),
        ),
        (
            Op::RmsNorm {
                eps: F64Bits::new(1e-5),
            },
            vec![f32s(&[260, 128]), f32s(&[128])],
            f32s(&[260, 128]),
        ),
        (Op::Softmax { axis: 1 }, vec![x.clone()], x.clone()),
        (
            Op::Rope {
                style: RopeStyle::HalfSplit,
            },
            vec![
                f32s(&[1, 3, 4, 64]),
                f32s(&[1, 3, 1, 32]),
                f32s(&[1, 3, 1, 32]),
            ],
            f32s(&[1, 3, 4, 64]),
        ),
        (
            Op::Rope {
                style: RopeStyle::Interleaved,
            },
            vec![
                Shape::new(&[2, 6, 8], DType::BF16),
                Shape::new(&[6, 4], DType::BF16),
                Shape::new(&[6, 4], DType::BF16),
            ],
            Shape::new(&[2, 6, 8], DType::BF16),
        ),
        (
            Op::LogSoftmax { axis: 1 },
            vec![Shape::new(&[4, 9], DType::F64)],
            Shape::new(&[4, 9], DType::F64),
        ),
    ];
    // Attention over whole sequences: masks bool and additive, causal, grouped
    // heads, both layouts, a large value head.
    for (dt, causal, seq_major, mask, dv) in [
        (DType::F16, false, false, Some(DType::Bool), 32),
        (DType::F32, true, true, None, 64),
        (DType::BF16, true, false, Some(DType::BF16), 24),
        (DType::F64, false, true, Some(DType::F64), 520),
    ] {
        let layout = |s: usize, h: usize, d: usize| {
            if seq_major {
                Shape::new(&[2, s, h, d], dt)
            } else {
                Shape::new(&[2, h, s, d], dt)
            }
        };
        let mut ins = vec![layout(7, 4, 40), layout(9, 2, 40), layout(9, 2, dv)];
        ins.extend(mask.map(|m| Shape::new(&[2, 1, 7, 9], m)));
        v.push((
            Op::Attention {
                scale: F64Bits::new(0.125),
                causal,
                seq_major,
            },
            ins,
            layout(7, 4, dv),
        ));
    }
    // Tensor-core attention shapes (f16, widths multiples of 16): grouped and
    // causal with a bool mask, and sequence-major with an additive one.
    for (seq_major, mask) in [(false, DType::Bool), (true, DType::F16)] {
        let h = |d: &[usize]| Shape::new(d, DType::F16);
        let (q, k, o) = if seq_major {
            (h(&[2, 70, 4, 64]), h(&[2, 100, 2, 64]), h(&[2, 70, 4, 32]))
        } else {
            (h(&[2, 4, 70, 64]), h(&[2, 2, 100, 64]), h(&[2, 4, 70, 32]))
        };
        let vdims = if seq_major {
            [2, 100, 2, 32]
        } else {
            [2, 2, 100, 32]
        };
        v.push((
            Op::Attention {
                scale: F64Bits::new(0.125),
                causal: !seq_major,
                seq_major,
            },
            vec![q, k, h(&vdims), Shape::new(&[2, 1, 70, 100], mask)],
            o,
        ));
    }
    // Long reductions take a warp or a block per output, over inner and outer axes.
    for (rop, dt) in [
        (ReduceOp::Mean, DType::F32),
        (ReduceOp::Max, DType::F16),
        (ReduceOp::Sum, DType::I64),
    ] {
        v.push((
            Op::Reduce {
                op: rop,
                axes: vec![1, 3],
                keepdims: false,
            },
            vec![Shape::new(&[2, 9, 3, 70], dt)],
            Shape::new(&[2, 3], dt),
        ));
        // Few outputs from many values each: a block per output.
        v.push((
            Op::Reduce {
                op: rop,
                axes: vec![0, 2],
                keepdims: false,
            },
            vec![Shape::new(&[300, 5, 40], dt)],
            Shape::new(&[5], dt),
        ));
    }
    for dt in [DType::F32, DType::BF16] {
        v.push((
            Op::Elementwise {
                steps: vec![
                    EwStep::Binary(BinaryOp::Mul, 0, 1),
                    EwStep::Unary(UnaryOp::Silu, 2),
                    EwStep::Binary(BinaryOp::Max, 3, 0),
                ],
            },
            vec![Shape::new(&[3, 1, 7], dt), Shape::new(&[5, 1], dt)],
            Shape::new(&[3, 5, 7], dt),
        ));
    }
    for format in QuantFormat::ALL {
        let row = format.row_bytes(512).expect("whole blocks");
        let packed = Shape::new(&[6, row], DType::U8);
        v.push((
            Op::Dequantize { format },
            vec![packed.clone()],
            f32s(&[6, 512]),
        ));
        v.push((
            Op::QuantMatMul { format },
            vec![f32s(&[2, 512]), packed],
            f32s(&[2, 6]),
        ));
    }
    v
}

#[test]
fn generated_kernels_parse_as_cxx() {
    let mut source = String::from(SHIM);
    source.push_str(PRELUDE);
    for (i, (op, inputs, out)) in samples().iter().enumerate() {
        let k = kernel(&format!("k{i}"), op, inputs, out, i as i32 + 1)
            .unwrap_or_else(|e| panic!("{}: {e}", op.name()))
            .unwrap_or_else(|| panic!("{}: no kernel", op.name()));
        source.push_str(&entering_after_predecessor(&k.source));
        // With tensor cores, where a kernel differs (f16 attention).
        let t = kernel_for(&format!("t{i}"), op, inputs, out, i as i32 + 1, true)
            .unwrap_or_else(|e| panic!("{}: {e}", op.name()))
            .unwrap_or_else(|| panic!("{}: no kernel", op.name()));
        if t.source.replace(&format!("t{i}("), &format!("k{i}(")) != k.source {
            source.push_str(&entering_after_predecessor(&t.source));
        }
    }
    // The fused products' pieces, with and without every epilogue operand.
    let full = Epilogue {
        alpha: 0.5,
        bias: true,
        activation: Some(UnaryOp::Gelu),
        residual: true,
    };
    let bare = Epilogue {
        alpha: 1.0,
        bias: false,
        activation: None,
        residual: false,
    };
    let mut more = vec![
        epilogue_in_place("e0", &full, &f32s(&[5, 24]), false).unwrap(),
        epilogue_in_place("e1", &full, &Shape::new(&[5, 24], DType::F16), false).unwrap(),
        epilogue_in_place("e2", &full, &f32s(&[5, 24]), true).unwrap(),
        epilogue_in_place("e3", &full, &Shape::new(&[5, 24], DType::BF16), true).unwrap(),
    ];
    let shapes = [
        (1, 2048, 512, true),
        (3, 100, 37, false),
        (4, 8192, 64, true),
    ];
    for (i, &(rows, k, n, vector)) in shapes.iter().enumerate() {
        for (j, bdt) in [DType::F32, DType::F16, DType::BF16]
            .into_iter()
            .enumerate()
        {
            let g = Gemv::new(rows, k, n, 400, vector);
            let e = if j == 1 { &bare } else { &full };
            more.push(gemv(&format!("g{i}_{j}"), &g, e, DType::F32, bdt).unwrap());
        }
    }
    more.push(
        gemv(
            "gh",
            &Gemv::new(2, 64, 16, 400, true),
            &full,
            DType::BF16,
            DType::BF16,
        )
        .unwrap(),
    );
    for (i, &(rows, k, n, vector)) in shapes.iter().enumerate() {
        for (j, wdt) in [DType::F32, DType::F16, DType::BF16]
            .into_iter()
            .enumerate()
        {
            let g = GemvRows::new(rows, k, n, 2112, vector);
            let e = if j == 1 { &bare } else { &full };
            more.push(gemv_rows(&format!("w{i}_{j}"), &g, e, DType::F32, wdt).unwrap());
        }
    }
    more.push(
        gemv_rows(
            "wh",
            &GemvRows::new(2, 64, 16, 2112, true),
            &full,
            DType::BF16,
            DType::BF16,
        )
        .unwrap(),
    );
    // Row groups: q/k/v after a folded norm, gate/up combined by SwiGLU, and a
    // group of half activations with every epilogue operand.
    let product = |n: usize, epilogue: Epilogue| GroupProduct { n, epilogue };
    let silu_mul = vec![
        EwStep::Unary(UnaryOp::Silu, 0),
        EwStep::Binary(BinaryOp::Mul, 2, 1),
    ];
    let groups = [
        (
            RowGroup {
                rows: 1,
                k: 2048,
                products: vec![product(2048, bare), product(512, full), product(512, bare)],
                combine: None,
                norm: Some(1e-5),
                max_blocks: 2112,
                staged: false,
                pairs: false,
                tail: None,
            },
            DType::F32,
        ),
        (
            RowGroup {
                rows: 3,
                k: 256,
                products: vec![product(72, bare), product(72, full)],
                combine: Some(silu_mul),
                norm: Some(1e-6),
                max_blocks: 2112,
                staged: false,
                pairs: false,
                tail: None,
            },
            DType::F32,
        ),
        (
            RowGroup {
                rows: 2,
                k: 64,
                products: vec![product(16, full), product(23, full)],
                combine: None,
                norm: None,
                max_blocks: 2112,
                staged: false,
                pairs: true,
                tail: None,
            },
            DType::BF16,
        ),
    ];
    for (i, (g, adt)) in groups.iter().enumerate() {
        for (j, wdt) in [DType::F32, DType::F16, DType::BF16]
            .into_iter()
            .enumerate()
        {
            for (l, staged) in [false, true].into_iter().enumerate() {
                let g = RowGroup {
                    staged,
                    ..g.clone()
                };
                more.push(gemv_group(&format!("rg{i}_{j}_{l}"), &g, *adt, wdt).unwrap());
            }
        }
    }
    // A decode step's rotations and cache writes, f32 and f16.
    for (i, dt) in [DType::F32, DType::F16].into_iter().enumerate() {
        let shape = |d: &[usize]| Shape::new(d, dt);
        let cache = shape(&[1, 8, 2, 16]);
        let spec = RopeWrites {
            ropes: vec![
                RopeJob {
                    x: shape(&[1, 1, 4, 16]),
                    style: RopeStyle::HalfSplit,
                    into: None,
                },
                RopeJob {
                    x: shape(&[1, 1, 2, 16]),
                    style: RopeStyle::Interleaved,
                    into: Some(0),
                },
            ],
            cos: f32s(&[1, 1, 1, 8]),
            sin: f32s(&[1, 1, 1, 8]),
            writes: vec![
                WriteJob {
                    target: cache.clone(),
                    update: shape(&[1, 1, 2, 16]),
                    axis: 1,
                    from: Some(1),
                },
                WriteJob {
                    target: cache,
                    update: shape(&[1, 1, 2, 16]),
                    axis: 1,
                    from: None,
                },
            ],
            pos: Shape::new(&[1], DType::I64),
        };
        more.push(rope_write::kernel(&format!("rw{i}"), &spec, 3).unwrap());
        // The same rotations and writes done by the q/k/v products' kernel.
        let tail = GroupTail {
            spec,
            reader: vec![Some(Ok(0)), Some(Ok(1)), Some(Err(1))],
            code: 3,
        };
        for (l, staged) in [false, true].into_iter().enumerate() {
            let g = RowGroup {
                rows: 1,
                k: 64,
                products: vec![product(64, bare), product(32, bare), product(32, bare)],
                combine: None,
                norm: (dt == DType::F32).then_some(1e-5),
                max_blocks: 2112,
                staged,
                pairs: true,
                tail: Some(tail.clone()),
            };
            more.push(gemv_group(&format!("rgt{i}_{l}"), &g, dt, DType::BF16).unwrap());
        }
    }
    for k in more {
        source.push_str(&entering_after_predecessor(&k.source));
    }
    let dir = std::env::temp_dir().join(format!("rlx-cuda-syntax-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("a temporary directory");
    let file = dir.join("program.cpp");
    std::fs::write(&file, &source).expect("writing the source");
    let run = Command::new("g++")
        .args(["-fsyntax-only", "-std=c++17", "-Wno-unused", "-x", "c++"])
        .arg(&file)
        .output();
    let Ok(result) = run else {
        eprintln!("SKIP generated_kernels_parse_as_cxx: no g++ on this machine");
        return;
    };
    let errors = String::from_utf8_lossy(&result.stderr);
    assert!(
        result.status.success(),
        "the generated source does not parse ({}):\n{errors}",
        file.display()
    );
    if let Some(keep) = rlx_ir::env::Switch::KeepSource.value() {
        std::fs::copy(&file, keep).unwrap();
    }
    let _ = std::fs::remove_dir_all(&dir);
}
