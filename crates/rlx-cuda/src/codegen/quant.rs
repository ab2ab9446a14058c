//! The GGUF block formats on the GPU: a device function per format decoding one
//! value of a block, and the two ops that read packed rows: [`Op::Dequantize`] (one
//! thread per value) and [`Op::QuantMatMul`] (one warp per output, the lanes walking
//! the row's values and decoding them as they go, so the weights are read once, in
//! their packed size).

use super::{Grid, Kernel, elements, header};
use rlx_ir::{Op, QuantFormat, Shape};
use std::fmt::Write;

/// The body of `float dq_{format}(const unsigned char* b, int j)`: value `j` of the
/// block at `b`, laid out as `QuantFormat::dequantize_block` reads it.
fn decoder_body(format: QuantFormat) -> &'static str {
    match format {
        QuantFormat::Q4_0 => {
            "int q = b[2 + (j & 15)]; q = j < 16 ? (q & 15) : (q >> 4); return half_at(b, 0) * (float)(q - 8);"
        }
        QuantFormat::Q4_1 => {
            "int q = b[4 + (j & 15)]; q = j < 16 ? (q & 15) : (q >> 4); return half_at(b, 0) * (float)q + half_at(b, 2);"
        }
        QuantFormat::Q5_0 => {
            "unsigned int hi = b[2] | (b[3] << 8) | (b[4] << 16) | ((unsigned int)b[5] << 24); int q = b[6 + (j & 15)]; q = (j < 16 ? (q & 15) : (q >> 4)) | (((hi >> j) & 1) << 4); return half_at(b, 0) * (float)(q - 16);"
        }
        QuantFormat::Q5_1 => {
            "unsigned int hi = b[4] | (b[5] << 8) | (b[6] << 16) | ((unsigned int)b[7] << 24); int q = b[8 + (j & 15)]; q = (j < 16 ? (q & 15) : (q >> 4)) | (((hi >> j) & 1) << 4); return half_at(b, 0) * (float)q + half_at(b, 2);"
        }
        QuantFormat::Q8_0 => "return half_at(b, 0) * (float)(signed char)b[2 + j];",
        QuantFormat::Q4K => {
            "int chunk = j >> 6, w = j & 63, l = w & 31, sub = 2 * chunk + (w >> 5); int s, m; k_scale_min(b + 4, sub, &s, &m); int q = b[16 + chunk * 32 + l]; q = w < 32 ? (q & 15) : (q >> 4); return half_at(b, 0) * (float)s * (float)q - half_at(b, 2) * (float)m;"
        }
        QuantFormat::Q5K => {
            "int chunk = j >> 6, w = j & 63, l = w & 31, sub = 2 * chunk + (w >> 5); int s, m; k_scale_min(b + 4, sub, &s, &m); int q = b[48 + chunk * 32 + l]; q = (w < 32 ? (q & 15) : (q >> 4)) + (((b[16 + l] >> sub) & 1) << 4); return half_at(b, 0) * (float)s * (float)q - half_at(b, 2) * (float)m;"
        }
        QuantFormat::Q6K => {
            "int half = j >> 7, w = j & 127, quarter = w >> 5, l = w & 31; int lo = b[half * 64 + l + 32 * (quarter & 1)]; lo = quarter < 2 ? (lo & 15) : (lo >> 4); int hb = (b[128 + half * 32 + l] >> (2 * quarter)) & 3; int q = (lo | (hb << 4)) - 32; float s = half_at(b, 208) * (float)(signed char)b[192 + half * 8 + (l >> 4) + 2 * quarter]; return s * (float)q;"
        }
        QuantFormat::Q8K => {
            "float d = __uint_as_float(b[0] | (b[1] << 8) | (b[2] << 16) | ((unsigned int)b[3] << 24)); return d * (float)(signed char)b[4 + j];"
        }
    }
}

/// Shared by the K formats: the 6-bit scale and minimum of sub-block `j`.
const K_SCALE_MIN: &str = "__device__ __forceinline__ void k_scale_min(const unsigned char* q, int j, int* s, int* m) {\n  if (j < 4) { *s = q[j] & 63; *m = q[j + 4] & 63; }\n  else { *s = (q[j + 4] & 15) | ((q[j - 4] >> 6) << 4); *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4); }\n}\n";

/// The decoder of `format`, named `dq_{kernel name}` (each kernel carries its own, so
/// a program's source never defines one twice).
fn decoder(kernel: &str, format: QuantFormat) -> String {
    let mut s = String::new();
    if matches!(format, QuantFormat::Q4K | QuantFormat::Q5K) {
        s.push_str(&K_SCALE_MIN.replace("k_scale_min", &format!("ksm_{kernel}")));
    }
    let body = decoder_body(format).replace("k_scale_min", &format!("ksm_{kernel}"));
    let _ = writeln!(
        s,
        "__device__ __forceinline__ float dq_{kernel}(const unsigned char* b, int j) {{ {body} }}"
    );
    s
}

/// The kernel for `op`, or `None` when it is not one of this module's.
pub(super) fn kernel(name: &str, op: &Op, inputs: &[Shape], out: &Shape) -> Option<Kernel> {
    match op {
        Op::Dequantize { format } => Some(dequantize(name, *format, &inputs[0], out)),
        Op::QuantMatMul { format } => Some(quant_matmul(name, *format, inputs, out)),
        _ => None,
    }
}

fn dequantize(name: &str, format: QuantFormat, packed: &Shape, out: &Shape) -> Kernel {
    let k = out.dims().last().copied().unwrap_or(1).max(1);
    let row_bytes = packed.dims().last().copied().unwrap_or(0);
    let (bl, bb) = (format.block_len(), format.block_bytes());
    let n = out.num_elements();
    let mut s = decoder(name, format);
    s.push_str(&header(name, out.dtype(), &[packed.dtype()]));
    let _ = writeln!(s, "  RLX_LOOP({n}LL) {{");
    let _ = writeln!(
        s,
        "    long long row = i / {k}LL; int j = (int)(i % {k}LL);\n    out[i] = dq_{name}(in0 + row * {row_bytes}LL + (j / {bl}) * {bb}LL, j % {bl});"
    );
    s.push_str("  }\n}\n");
    elements(s, n)
}

fn quant_matmul(name: &str, format: QuantFormat, inputs: &[Shape], out: &Shape) -> Kernel {
    let (a, w) = (&inputs[0], &inputs[1]);
    let k = a.dims().last().copied().unwrap_or(1);
    let (nrows, row_bytes) = (w.dim(0).max(1), w.dim(1));
    let (bl, bb) = (format.block_len(), format.block_bytes());
    let outputs = out.num_elements();
    let mut s = decoder(name, format);
    s.push_str(&header(name, out.dtype(), &[a.dtype(), w.dtype()]));
    let _ = writeln!(s, "  const int lane = threadIdx.x & 31;");
    let _ = writeln!(s, "  RLX_WARP_LOOP({outputs}LL) {{");
    let _ = writeln!(
        s,
        "    const long long m = w / {nrows}LL, n = w % {nrows}LL;\n    const float* x = in0 + m * {k}LL;\n    const unsigned char* row = in1 + n * {row_bytes}LL;\n    float t = 0;"
    );
    let _ = writeln!(
        s,
        "    for (int j = lane; j < {k}; j += 32) t += x[j] * dq_{name}(row + (j / {bl}) * {bb}LL, j % {bl});"
    );
    let _ = writeln!(s, "    t = warp_sum(t);\n    if (lane == 0) out[w] = t;");
    s.push_str("  }\n}\n");
    Kernel {
        source: s,
        grid: Grid::Warps(outputs),
        check: None,
    }
}
