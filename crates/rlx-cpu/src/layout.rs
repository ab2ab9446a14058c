//! Which values a CPU program stores channel-blocked.
//!
//! A value `[n, c, h, w]` is normally stored as it reads (NCHW). Channel-blocked, it
//! is stored block by block: each image holds its channels' blocks of 16 (one
//! AVX-512 vector of `f32`, two AVX2 ones) in order, each block pixel by pixel with its channels
//! together at each pixel (`[n, c / 16, h, w, 16]` where `c` is a multiple of 16).
//! Where `c` is 8 past a multiple of 16 (MobileNet v3's 40, 72 and 120 channels),
//! the last block has 8 channels, stored 8 a pixel ([`Blocks`]): the value keeps
//! its plain byte size, and every other block is a whole vector. Convolutions between
//! such values read and write whole vectors: a 1x1 convolution broadcasts its input
//! values in place instead of packing them, stores its output tile as it holds it
//! (pixels by channels) instead of transposing it into channel rows, and a depthwise
//! one runs a block of channels per instruction however small its planes are.
//!
//! The layout is chosen per value when a program is built, after the memory plan: a
//! blocked value has the same byte size, so the plan holds as it is. A value is
//! blocked only where every step that touches it has a kernel for that layout
//! ([`crate::kernels::accepts`]); it starts blocked wherever it may be, and a step
//! that refuses its layouts makes plain the least it needs (its output alone, else
//! one operand, from the last, else all its operands, else both), until every step
//! accepts. Operands of a step with more
//! than 64 (which a layout cannot name) are plain. Graph inputs and outputs, params,
//! handles, and values read through views are always plain, so nothing outside a
//! program sees the blocked layout.

use rlx_ir::{DType, NodeId, Op, Shape};
use rlx_opt::{Plan, Region};

/// Channels per block of a channel-blocked value: an AVX-512 vector of `f32`, two
/// AVX2 ones.
pub(crate) const BLOCK: usize = 16;

/// Channels of a last block that is half a vector.
pub(crate) const HALF: usize = BLOCK / 2;

/// The blocks of a blocked value's image: `channels` channels (a multiple of
/// [`HALF`]) over `pixels` pixels, in blocks of [`BLOCK`] channels but for a last
/// one of [`HALF`] when the channels end half a vector past a multiple of 16.
/// Every block but the last is whole, so block `k` starts `k * BLOCK * pixels`
/// floats into the image, whatever the last one's width.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Blocks {
    pub channels: usize,
    pub pixels: usize,
}

impl Blocks {
    /// The blocks of `channels` channels over `pixels` pixels.
    pub(crate) fn new(channels: usize, pixels: usize) -> Blocks {
        Blocks { channels, pixels }
    }

    /// Blocks per image.
    pub(crate) fn count(&self) -> usize {
        self.channels.div_ceil(BLOCK)
    }

    /// Channels of block `k` (values per pixel): [`BLOCK`], or the last block's
    /// fewer.
    pub(crate) fn width(&self, k: usize) -> usize {
        (self.channels - k * BLOCK).min(BLOCK)
    }

    /// Floats from the image's first value to block `k`'s.
    pub(crate) fn start(&self, k: usize) -> usize {
        k * BLOCK * self.pixels
    }

    /// Floats from the image's first value to channel `c`'s value at pixel `p`.
    pub(crate) fn index(&self, c: usize, p: usize) -> usize {
        let k = c / BLOCK;
        self.start(k) + p * self.width(k) + c % BLOCK
    }

    /// Plane `i` of `images * count()` (block `i % count()` of image
    /// `i / count()`): its first float from the value's first, its width, and
    /// its first channel.
    pub(crate) fn plane(&self, i: usize) -> (usize, usize, usize) {
        let (image, k) = (i / self.count(), i % self.count());
        (
            image * self.channels * self.pixels + self.start(k),
            self.width(k),
            k * BLOCK,
        )
    }
}

/// Whether a value of `channels` channels can be channel-blocked: a whole number
/// of half vectors (so a last block of [`HALF`] at most).
pub(crate) fn blockable_channels(channels: usize) -> bool {
    channels > 0 && channels.is_multiple_of(HALF)
}

/// The lanes of a vector that one pixel's block of `lanes` channels fills (the low
/// `lanes` of 16), as an AVX-512 mask.
pub(crate) fn lane_mask(lanes: usize) -> u16 {
    (((1u32 << lanes) - 1) & 0xffff) as u16
}

/// The most operands whose layout a [`StepLayout`] records; operands of a step with
/// more stay plain ([`assign`]).
const MAX_OPERANDS: usize = 64;

/// Which of a step's operands and whether its output are channel-blocked.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(crate) struct StepLayout {
    /// Bit `k`: operand `k` is blocked.
    inputs: u64,
    output: bool,
}

impl StepLayout {
    /// Whether operand `k` is blocked.
    pub(crate) fn input(&self, k: usize) -> bool {
        k < MAX_OPERANDS && (self.inputs >> k) & 1 == 1
    }

    /// Whether the output is blocked.
    pub(crate) fn output(&self) -> bool {
        self.output
    }

    /// Whether anything is blocked.
    pub(crate) fn any(&self) -> bool {
        self.inputs != 0 || self.output
    }

    /// A layout with the given operands and output blocked (tests and callers that
    /// build one by hand).
    pub(crate) fn new(inputs: &[bool], output: bool) -> StepLayout {
        let inputs = inputs
            .iter()
            .take(MAX_OPERANDS)
            .enumerate()
            .fold(0, |bits, (k, &b)| bits | (u64::from(b) << k));
        StepLayout { inputs, output }
    }
}

/// Pixels below which a value stays plain: a product over a handful of pixels
/// (a squeeze-and-excitation block's `[n, c, 1, 1]`) runs better as the plain
/// layout's GEMV-like kernels, and its two layouts hardly differ.
pub(crate) const MIN_PIXELS: usize = 4;

/// Whether `shape` can be stored blocked: a rank-4 `f32` value whose channels are a
/// multiple of 8 ([`blockable_channels`]), over planes of [`MIN_PIXELS`] or more.
fn blockable(shape: &Shape) -> bool {
    shape.dtype() == DType::F32
        && shape.rank() == 4
        && blockable_channels(shape.dim(1))
        && shape.dim(2) * shape.dim(3) >= MIN_PIXELS
        && shape.num_elements() > 0
}

/// Whether blocked layouts are used at all: on CPUs with AVX-512 or AVX2 and FMA
/// (the blocked kernels' vectors: a block is one AVX-512 vector or two AVX2 ones),
/// unless `RLX_CHANNEL_BLOCKS=0`. Which steps take blocks on which CPU is up to
/// their kernels ([`crate::kernels::accepts`]).
fn enabled() -> bool {
    let isa = crate::isa::isa();
    (isa.avx512f || isa.avx2_fma) && rlx_ir::env::Switch::ChannelBlocks.enabled()
}

/// The layout of every step of `plan.schedule`, in order, given which layouts each
/// step's kernel accepts (`accepts(op, operand shapes, output shape, layout)`).
pub(crate) fn assign(
    plan: &Plan,
    accepts: impl Fn(&Op, &[Shape], &Shape, StepLayout) -> bool,
) -> Vec<StepLayout> {
    let nodes = plan.graph.nodes();
    let count = nodes.len();
    let mut is_step = vec![false; count];
    for id in &plan.schedule {
        is_step[id.index()] = true;
    }
    let mut blocked: Vec<bool> = (0..count)
        .map(|i| {
            enabled()
                && is_step[i]
                && !plan.is_view[i]
                && plan.locations[i].region == Region::Arena
                && blockable(&plan.shapes[i])
        })
        .collect();
    for &out in &plan.outputs {
        blocked[out.index()] = false;
    }
    // A value read by anything but a step (a view of it), or by a step with more
    // operands than a layout names, stays plain.
    for (i, node) in nodes.iter().enumerate() {
        if !is_step[i] || plan.is_view[i] || node.inputs.len() > MAX_OPERANDS {
            for x in &node.inputs {
                blocked[x.index()] = false;
            }
        }
    }
    let layout_of = |blocked: &[bool], id: NodeId| {
        let node = &nodes[id.index()];
        let inputs: Vec<bool> = node.inputs.iter().map(|x| blocked[x.index()]).collect();
        StepLayout::new(&inputs, blocked[id.index()])
    };
    let shapes_of = |id: NodeId| -> Vec<Shape> {
        nodes[id.index()]
            .inputs
            .iter()
            .map(|x| plan.shapes[x.index()].clone())
            .collect()
    };
    // Demotion only ever turns values plain, so this ends.
    loop {
        let mut changed = false;
        for &id in &plan.schedule {
            let layout = layout_of(&blocked, id);
            if !layout.any() {
                continue;
            }
            let node = &nodes[id.index()];
            let (shapes, out) = (shapes_of(id), &plan.shapes[id.index()]);
            if accepts(&node.op, &shapes, out, layout) {
                continue;
            }
            // The least to make plain: the output alone (a convolution whose
            // residual is plain), else one operand or all of them, else the
            // output and the operands.
            let inputs_plain = StepLayout::new(&[], layout.output());
            let with_output_plain = StepLayout {
                output: false,
                ..layout
            };
            let output_alone =
                layout.output() && accepts(&node.op, &shapes, out, with_output_plain);
            if output_alone || !accepts(&node.op, &shapes, out, inputs_plain) {
                blocked[id.index()] = false;
            }
            if !accepts(&node.op, &shapes, out, layout_of(&blocked, id)) {
                // One operand plain, from the last (a convolution's residual in
                // another layout than its output), else all of them.
                let now = layout_of(&blocked, id);
                let one = (0..node.inputs.len()).rev().find(|&k| {
                    now.input(k) && {
                        let mut inputs: Vec<bool> =
                            (0..node.inputs.len()).map(|j| now.input(j)).collect();
                        inputs[k] = false;
                        accepts(
                            &node.op,
                            &shapes,
                            out,
                            StepLayout::new(&inputs, now.output()),
                        )
                    }
                });
                match one {
                    Some(k) => blocked[node.inputs[k].index()] = false,
                    None => {
                        for x in &node.inputs {
                            blocked[x.index()] = false;
                        }
                    }
                }
            }
            changed = true;
        }
        if !changed {
            break;
        }
    }
    plan.schedule
        .iter()
        .map(|&id| layout_of(&blocked, id))
        .collect()
}

/// Index of `[n, c, h, w]`'s element `(n, c, p)` (`p` the pixel `y * w + x`) in the
/// blocked layout of a value with `channels` channels and `pixels` pixels.
#[cfg(test)]
pub(crate) fn blocked_index(n: usize, c: usize, p: usize, channels: usize, pixels: usize) -> usize {
    assert!(blockable_channels(channels), "a blockable channel count");
    n * channels * pixels + Blocks::new(channels, pixels).index(c, p)
}

/// `plain` (`[n, c, pixels]`) in the blocked layout.
#[cfg(test)]
pub(crate) fn to_blocked(plain: &[f32], channels: usize, pixels: usize) -> Vec<f32> {
    relayout(plain, channels, pixels, true)
}

/// A blocked value in the plain layout (`[n, c, pixels]`).
#[cfg(test)]
pub(crate) fn from_blocked(blocked: &[f32], channels: usize, pixels: usize) -> Vec<f32> {
    relayout(blocked, channels, pixels, false)
}

/// `values` moved from the plain layout to the blocked one (`to_blocked`), or back.
#[cfg(test)]
fn relayout(values: &[f32], channels: usize, pixels: usize, to_blocked: bool) -> Vec<f32> {
    let mut out = vec![0.0; values.len()];
    let images = values.len() / (channels * pixels).max(1);
    for n in 0..images {
        for c in 0..channels {
            for p in 0..pixels {
                let (plain, blocked) = (
                    (n * channels + c) * pixels + p,
                    blocked_index(n, c, p, channels, pixels),
                );
                let (to, from) = if to_blocked {
                    (blocked, plain)
                } else {
                    (plain, blocked)
                };
                out[to] = values[from];
            }
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn blocks_place_every_value_once_within_the_plain_size() {
        for channels in [8, 16, 24, 40, 72, 128, 200] {
            for pixels in [1, 5, 13] {
                let blocks = Blocks::new(channels, pixels);
                let mut seen = vec![false; channels * pixels];
                for c in 0..channels {
                    for p in 0..pixels {
                        let at = blocks.index(c, p);
                        assert!(!seen[at], "{channels} x {pixels}: ({c}, {p}) lands twice");
                        seen[at] = true;
                    }
                }
                assert!(seen.iter().all(|&s| s), "{channels} x {pixels}: a gap");
                // Every block but a last one of 8 is a whole vector, and each
                // plane starts where its block's channels do.
                for k in 0..blocks.count() {
                    let whole = k + 1 < blocks.count() || channels.is_multiple_of(BLOCK);
                    assert_eq!(blocks.width(k), if whole { BLOCK } else { HALF });
                    let (start, width, first) = blocks.plane(blocks.count() + k);
                    assert_eq!(start, channels * pixels + blocks.index(first, 0));
                    assert_eq!(width, blocks.width(k));
                }
            }
        }
    }

    #[test]
    fn only_whole_half_vectors_of_channels_block() {
        assert!(blockable_channels(8) && blockable_channels(24) && blockable_channels(4096));
        assert!(!blockable_channels(0) && !blockable_channels(12) && !blockable_channels(3));
    }
}
