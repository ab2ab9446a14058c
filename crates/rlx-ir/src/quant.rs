//! Block-quantized weight formats (the GGML family) and their reference
//! dequantization.
//!
//! A quantized row of `K` values is `K / block_len` blocks stored back to back; each
//! block holds its own scale (and offset or sub-block scales). The IR carries the
//! format on the ops that read packed weights ([`Op::QuantMatMul`],
//! [`Op::Dequantize`]), so this module defines what those bytes mean. Kernels in
//! backends read the same bytes directly and are tested against [`dequantize_row`].
//!
//! [`Op::QuantMatMul`]: crate::Op::QuantMatMul
//! [`Op::Dequantize`]: crate::Op::Dequantize

use crate::{Error, Result};
use half::f16;

/// A block-quantized storage format.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum QuantFormat {
    /// 32 values: `f16` scale `d`, 4-bit `q`; `x = d * (q - 8)`.
    Q4_0,
    /// 32 values: `f16` scale `d` and minimum `m`, 4-bit `q`; `x = d * q + m`.
    Q4_1,
    /// 32 values: `f16` scale, 5-bit `q` (high bits packed apart); `x = d * (q - 16)`.
    Q5_0,
    /// 32 values: `f16` scale and minimum, 5-bit `q`; `x = d * q + m`.
    Q5_1,
    /// 32 values: `f16` scale, signed 8-bit `q`; `x = d * q`.
    Q8_0,
    /// 256 values in 8 sub-blocks of 32, each with a 6-bit scale and minimum relative
    /// to the block's `f16` super-scales; 4-bit `q`.
    Q4K,
    /// As [`QuantFormat::Q4K`] with 5-bit `q`.
    Q5K,
    /// 256 values in 16 sub-blocks of 16 with signed 8-bit scales; 6-bit `q` centred
    /// at 32.
    Q6K,
    /// 256 values: `f32` scale, signed 8-bit `q`, and per-16 sums (unused here).
    Q8K,
}

impl QuantFormat {
    /// Every format.
    pub const ALL: [QuantFormat; 9] = [
        QuantFormat::Q4_0,
        QuantFormat::Q4_1,
        QuantFormat::Q5_0,
        QuantFormat::Q5_1,
        QuantFormat::Q8_0,
        QuantFormat::Q4K,
        QuantFormat::Q5K,
        QuantFormat::Q6K,
        QuantFormat::Q8K,
    ];

    /// The format's usual name (`q4_1`, `q6_k`, ...).
    pub fn name(self) -> &'static str {
        match self {
            QuantFormat::Q4_0 => "q4_0",
            QuantFormat::Q4_1 => "q4_1",
            QuantFormat::Q5_0 => "q5_0",
            QuantFormat::Q5_1 => "q5_1",
            QuantFormat::Q8_0 => "q8_0",
            QuantFormat::Q4K => "q4_k",
            QuantFormat::Q5K => "q5_k",
            QuantFormat::Q6K => "q6_k",
            QuantFormat::Q8K => "q8_k",
        }
    }

    /// Values per block.
    pub const fn block_len(self) -> usize {
        match self {
            QuantFormat::Q4_0
            | QuantFormat::Q4_1
            | QuantFormat::Q5_0
            | QuantFormat::Q5_1
            | QuantFormat::Q8_0 => 32,
            QuantFormat::Q4K | QuantFormat::Q5K | QuantFormat::Q6K | QuantFormat::Q8K => 256,
        }
    }

    /// Bytes per block.
    pub const fn block_bytes(self) -> usize {
        match self {
            QuantFormat::Q4_0 => 18,
            QuantFormat::Q4_1 => 20,
            QuantFormat::Q5_0 => 22,
            QuantFormat::Q5_1 => 24,
            QuantFormat::Q8_0 => 34,
            QuantFormat::Q4K => 144,
            QuantFormat::Q5K => 176,
            QuantFormat::Q6K => 210,
            QuantFormat::Q8K => 292,
        }
    }

    /// Bytes of one row of `k` values, or an error when `k` is not a whole number of
    /// blocks.
    pub fn row_bytes(self, k: usize) -> Result<usize> {
        if k == 0 || !k.is_multiple_of(self.block_len()) {
            return Err(Error::invalid(
                self.name(),
                format!(
                    "a row of {k} values is not a whole number of {}-value blocks",
                    self.block_len()
                ),
            ));
        }
        (k / self.block_len())
            .checked_mul(self.block_bytes())
            .ok_or_else(|| Error::SizeOverflow {
                context: self.name().into(),
                what: format!("a row of {k} values"),
            })
    }

    /// Values in a row of `bytes` bytes, or an error when that is not whole blocks.
    pub fn row_len(self, bytes: usize) -> Result<usize> {
        if bytes == 0 || !bytes.is_multiple_of(self.block_bytes()) {
            return Err(Error::invalid(
                self.name(),
                format!(
                    "a row of {bytes} bytes is not a whole number of {}-byte blocks",
                    self.block_bytes()
                ),
            ));
        }
        (bytes / self.block_bytes())
            .checked_mul(self.block_len())
            .ok_or_else(|| Error::SizeOverflow {
                context: self.name().into(),
                what: format!("a row of {bytes} bytes"),
            })
    }

    /// Decodes one block (`block_bytes()` bytes) into `block_len()` values.
    ///
    /// # Panics
    /// When `block` or `out` has the wrong length (callers slice whole blocks).
    pub fn dequantize_block(self, block: &[u8], out: &mut [f32]) {
        assert_eq!(block.len(), self.block_bytes(), "one whole block");
        assert_eq!(out.len(), self.block_len(), "room for one block");
        match self {
            QuantFormat::Q4_0 => {
                let d = half_at(block, 0);
                for j in 0..16 {
                    let q = block[2 + j];
                    out[j] = d * ((q & 0x0f) as f32 - 8.0);
                    out[j + 16] = d * ((q >> 4) as f32 - 8.0);
                }
            }
            QuantFormat::Q4_1 => {
                let (d, m) = (half_at(block, 0), half_at(block, 2));
                for j in 0..16 {
                    let q = block[4 + j];
                    out[j] = d * (q & 0x0f) as f32 + m;
                    out[j + 16] = d * (q >> 4) as f32 + m;
                }
            }
            QuantFormat::Q5_0 => {
                let d = half_at(block, 0);
                let high = u32::from_le_bytes([block[2], block[3], block[4], block[5]]);
                for j in 0..16 {
                    let q = block[6 + j];
                    let lo = (q & 0x0f) as u32 | ((high >> j) & 1) << 4;
                    let hi = (q >> 4) as u32 | ((high >> (j + 16)) & 1) << 4;
                    out[j] = d * (lo as f32 - 16.0);
                    out[j + 16] = d * (hi as f32 - 16.0);
                }
            }
            QuantFormat::Q5_1 => {
                let (d, m) = (half_at(block, 0), half_at(block, 2));
                let high = u32::from_le_bytes([block[4], block[5], block[6], block[7]]);
                for j in 0..16 {
                    let q = block[8 + j];
                    let lo = (q & 0x0f) as u32 | ((high >> j) & 1) << 4;
                    let hi = (q >> 4) as u32 | ((high >> (j + 16)) & 1) << 4;
                    out[j] = d * lo as f32 + m;
                    out[j + 16] = d * hi as f32 + m;
                }
            }
            QuantFormat::Q8_0 => {
                let d = half_at(block, 0);
                for (o, &q) in out.iter_mut().zip(&block[2..34]) {
                    *o = d * (q as i8) as f32;
                }
            }
            QuantFormat::Q4K => {
                let (d, dmin) = (half_at(block, 0), half_at(block, 2));
                let scales = &block[4..16];
                let qs = &block[16..144];
                for chunk in 0..4 {
                    let (s0, m0) = k_scale_min(scales, 2 * chunk);
                    let (s1, m1) = k_scale_min(scales, 2 * chunk + 1);
                    let q = &qs[chunk * 32..chunk * 32 + 32];
                    let o = &mut out[chunk * 64..chunk * 64 + 64];
                    for l in 0..32 {
                        o[l] = d * s0 as f32 * (q[l] & 0x0f) as f32 - dmin * m0 as f32;
                        o[l + 32] = d * s1 as f32 * (q[l] >> 4) as f32 - dmin * m1 as f32;
                    }
                }
            }
            QuantFormat::Q5K => {
                let (d, dmin) = (half_at(block, 0), half_at(block, 2));
                let scales = &block[4..16];
                let qh = &block[16..48];
                let qs = &block[48..176];
                for chunk in 0..4 {
                    let (s0, m0) = k_scale_min(scales, 2 * chunk);
                    let (s1, m1) = k_scale_min(scales, 2 * chunk + 1);
                    let q = &qs[chunk * 32..chunk * 32 + 32];
                    let o = &mut out[chunk * 64..chunk * 64 + 64];
                    let (bit0, bit1) = (1u8 << (2 * chunk), 1u8 << (2 * chunk + 1));
                    for l in 0..32 {
                        let lo = (q[l] & 0x0f) + if qh[l] & bit0 != 0 { 16 } else { 0 };
                        let hi = (q[l] >> 4) + if qh[l] & bit1 != 0 { 16 } else { 0 };
                        o[l] = d * s0 as f32 * lo as f32 - dmin * m0 as f32;
                        o[l + 32] = d * s1 as f32 * hi as f32 - dmin * m1 as f32;
                    }
                }
            }
            QuantFormat::Q6K => {
                let ql = &block[0..128];
                let qh = &block[128..192];
                let scales = &block[192..208];
                let d = half_at(block, 208);
                for half in 0..2 {
                    let ql = &ql[half * 64..half * 64 + 64];
                    let qh = &qh[half * 32..half * 32 + 32];
                    let sc = &scales[half * 8..half * 8 + 8];
                    let o = &mut out[half * 128..half * 128 + 128];
                    for l in 0..32 {
                        let is = l / 16;
                        let q1 = ((ql[l] & 0x0f) | (qh[l] & 3) << 4) as i32 - 32;
                        let q2 = ((ql[l + 32] & 0x0f) | ((qh[l] >> 2) & 3) << 4) as i32 - 32;
                        let q3 = ((ql[l] >> 4) | ((qh[l] >> 4) & 3) << 4) as i32 - 32;
                        let q4 = ((ql[l + 32] >> 4) | ((qh[l] >> 6) & 3) << 4) as i32 - 32;
                        let s = |i: usize| d * (sc[i] as i8) as f32;
                        o[l] = s(is) * q1 as f32;
                        o[l + 32] = s(is + 2) * q2 as f32;
                        o[l + 64] = s(is + 4) * q3 as f32;
                        o[l + 96] = s(is + 6) * q4 as f32;
                    }
                }
            }
            QuantFormat::Q8K => {
                let d = f32::from_le_bytes([block[0], block[1], block[2], block[3]]);
                for (o, &q) in out.iter_mut().zip(&block[4..260]) {
                    *o = d * (q as i8) as f32;
                }
            }
        }
    }
}

impl std::fmt::Display for QuantFormat {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// The little-endian `f16` at `at`, widened.
#[inline(always)]
fn half_at(block: &[u8], at: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([block[at], block[at + 1]])).to_f32()
}

/// The 6-bit scale and minimum of sub-block `j` (0..8) of a Q4_K / Q5_K block, packed
/// in 12 bytes: sub-blocks 0..4 in the low 6 bits of bytes `j` and `j + 4`, sub-blocks
/// 4..8 split between a nibble of bytes 8..12 and the top 2 bits of bytes 0..8.
#[inline(always)]
fn k_scale_min(scales: &[u8], j: usize) -> (u8, u8) {
    if j < 4 {
        (scales[j] & 63, scales[j + 4] & 63)
    } else {
        (
            (scales[j + 4] & 0x0f) | (scales[j - 4] >> 6) << 4,
            (scales[j + 4] >> 4) | (scales[j] >> 6) << 4,
        )
    }
}

/// Decodes a whole row: `bytes` must be whole blocks and `out` exactly their values.
pub fn dequantize_row(format: QuantFormat, bytes: &[u8], out: &mut [f32]) -> Result<()> {
    let len = format.row_len(bytes.len())?;
    if out.len() != len {
        return Err(Error::LengthMismatch {
            kind: "destination",
            name: format!("{format} row"),
            expected: len,
            got: out.len(),
            unit: "values",
        });
    }
    for (block, values) in bytes
        .chunks_exact(format.block_bytes())
        .zip(out.chunks_exact_mut(format.block_len()))
    {
        format.dequantize_block(block, values);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f16_bytes(v: f32) -> [u8; 2] {
        f16::from_f32(v).to_bits().to_le_bytes()
    }

    #[test]
    fn sizes_and_row_checks() {
        assert_eq!(QuantFormat::Q4_1.row_bytes(576).ok(), Some(18 * 20));
        assert!(QuantFormat::Q4_1.row_bytes(33).is_err());
        assert!(QuantFormat::Q6K.row_len(209).is_err());
        assert_eq!(QuantFormat::Q6K.row_len(420).ok(), Some(512));
        let mut out = [0.0; 31];
        assert!(dequantize_row(QuantFormat::Q8_0, &[0; 34], &mut out).is_err());
    }

    #[test]
    fn q4_1_known_values() {
        let mut block = Vec::new();
        block.extend(f16_bytes(0.5));
        block.extend(f16_bytes(-1.0));
        block.extend((0..16u8).map(|j| j | (15 - j) << 4));
        let mut out = [0.0; 32];
        QuantFormat::Q4_1.dequantize_block(&block, &mut out);
        for j in 0..16 {
            assert_eq!(out[j], 0.5 * j as f32 - 1.0);
            assert_eq!(out[j + 16], 0.5 * (15 - j) as f32 - 1.0);
        }
    }
}
