//! The closed set of IR operations. Payloads are plain values with `Eq + Hash`, so
//! passes compare ops by value (CSE, pattern matching, compile caches).

use crate::DType;
use crate::ops::fused::EwStep;
use crate::quant::QuantFormat;

/// An `f64` attribute stored by its bits, so that ops can be hashed and compared.
#[derive(Clone, Copy, PartialEq, Eq, Hash)]
pub struct F64Bits(u64);

impl F64Bits {
    /// Wraps a value.
    pub fn new(v: f64) -> F64Bits {
        F64Bits(v.to_bits())
    }

    /// The value.
    pub fn get(self) -> f64 {
        f64::from_bits(self.0)
    }
}

impl std::fmt::Debug for F64Bits {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.get())
    }
}

/// Elementwise ops of one operand.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum UnaryOp {
    /// `-x`.
    Neg,
    /// `|x|`.
    Abs,
    /// `e^x`.
    Exp,
    /// Natural logarithm.
    Log,
    /// Square root.
    Sqrt,
    /// `1 / sqrt(x)`.
    Rsqrt,
    /// `1 / x`.
    Reciprocal,
    /// Hyperbolic tangent.
    Tanh,
    /// `1 / (1 + e^-x)`.
    Sigmoid,
    /// `max(x, 0)`.
    Relu,
    /// `x * Phi(x)` with the exact normal CDF (erf form).
    Gelu,
    /// The tanh approximation of GELU.
    GeluTanh,
    /// `x * sigmoid(x)` (swish).
    Silu,
    /// `min(max(x, 0), 6)` (MobileNet's ReLU6; NaN passes through).
    Relu6,
    /// `x * relu6(x + 3) / 6` (MobileNetV3's hard swish).
    HardSwish,
    /// The error function.
    Erf,
    /// Sine.
    Sin,
    /// Cosine.
    Cos,
    /// Round toward negative infinity.
    Floor,
    /// Round toward positive infinity.
    Ceil,
    /// Round half to even.
    Round,
    /// -1, 0 or 1 by the sign of `x` (NaN stays NaN).
    Sign,
    /// Logical not (bool only).
    Not,
    /// Arctangent, in radians.
    Atan,
    /// Bitwise complement (integers only).
    BitNot,
}

impl UnaryOp {
    /// Every unary op.
    pub const ALL: [UnaryOp; 25] = [
        UnaryOp::Neg,
        UnaryOp::Abs,
        UnaryOp::Exp,
        UnaryOp::Log,
        UnaryOp::Sqrt,
        UnaryOp::Rsqrt,
        UnaryOp::Reciprocal,
        UnaryOp::Tanh,
        UnaryOp::Sigmoid,
        UnaryOp::Relu,
        UnaryOp::Gelu,
        UnaryOp::GeluTanh,
        UnaryOp::Silu,
        UnaryOp::Relu6,
        UnaryOp::HardSwish,
        UnaryOp::Erf,
        UnaryOp::Sin,
        UnaryOp::Cos,
        UnaryOp::Floor,
        UnaryOp::Ceil,
        UnaryOp::Round,
        UnaryOp::Sign,
        UnaryOp::Not,
        UnaryOp::Atan,
        UnaryOp::BitNot,
    ];

    /// Lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            UnaryOp::Neg => "neg",
            UnaryOp::Abs => "abs",
            UnaryOp::Exp => "exp",
            UnaryOp::Log => "log",
            UnaryOp::Sqrt => "sqrt",
            UnaryOp::Rsqrt => "rsqrt",
            UnaryOp::Reciprocal => "reciprocal",
            UnaryOp::Tanh => "tanh",
            UnaryOp::Sigmoid => "sigmoid",
            UnaryOp::Relu => "relu",
            UnaryOp::Gelu => "gelu",
            UnaryOp::GeluTanh => "gelu_tanh",
            UnaryOp::Silu => "silu",
            UnaryOp::Relu6 => "relu6",
            UnaryOp::HardSwish => "hard_swish",
            UnaryOp::Erf => "erf",
            UnaryOp::Sin => "sin",
            UnaryOp::Cos => "cos",
            UnaryOp::Floor => "floor",
            UnaryOp::Ceil => "ceil",
            UnaryOp::Round => "round",
            UnaryOp::Sign => "sign",
            UnaryOp::Not => "not",
            UnaryOp::Atan => "atan",
            UnaryOp::BitNot => "bit_not",
        }
    }

    /// True for ops defined only on floating-point values.
    pub fn float_only(self) -> bool {
        !matches!(
            self,
            UnaryOp::Neg
                | UnaryOp::Abs
                | UnaryOp::Relu
                | UnaryOp::Sign
                | UnaryOp::Not
                | UnaryOp::BitNot
        )
    }
}

/// Elementwise ops of two operands, with numpy broadcasting.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BinaryOp {
    /// `a + b`.
    Add,
    /// `a - b`.
    Sub,
    /// `a * b`.
    Mul,
    /// `a / b` (integers truncate toward zero; division by zero gives 0).
    Div,
    /// `a ^ b`.
    Pow,
    /// Larger of the two (NaN propagates).
    Max,
    /// Smaller of the two (NaN propagates).
    Min,
    /// Floored modulo: the result has the sign of `b` (integer `x mod 0` gives 0).
    Mod,
    /// `a == b` (bool result).
    Eq,
    /// `a != b` (bool result).
    Ne,
    /// `a < b` (bool result).
    Lt,
    /// `a <= b` (bool result).
    Le,
    /// `a > b` (bool result).
    Gt,
    /// `a >= b` (bool result).
    Ge,
    /// Logical and (bool operands).
    And,
    /// Logical or (bool operands).
    Or,
    /// Logical exclusive or (bool operands).
    Xor,
    /// Bitwise and (integer operands).
    BitAnd,
    /// Bitwise or (integer operands).
    BitOr,
    /// Bitwise exclusive or (integer operands).
    BitXor,
    /// `a << b`, wrapping to the dtype's width; shifts of the width or more give 0.
    ShiftLeft,
    /// `a >> b`, logical (zeros shifted in); shifts of the width or more give 0.
    ShiftRight,
}

impl BinaryOp {
    /// Every binary op.
    pub const ALL: [BinaryOp; 22] = [
        BinaryOp::Add,
        BinaryOp::Sub,
        BinaryOp::Mul,
        BinaryOp::Div,
        BinaryOp::Pow,
        BinaryOp::Max,
        BinaryOp::Min,
        BinaryOp::Mod,
        BinaryOp::Eq,
        BinaryOp::Ne,
        BinaryOp::Lt,
        BinaryOp::Le,
        BinaryOp::Gt,
        BinaryOp::Ge,
        BinaryOp::And,
        BinaryOp::Or,
        BinaryOp::Xor,
        BinaryOp::BitAnd,
        BinaryOp::BitOr,
        BinaryOp::BitXor,
        BinaryOp::ShiftLeft,
        BinaryOp::ShiftRight,
    ];

    /// Lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            BinaryOp::Add => "add",
            BinaryOp::Sub => "sub",
            BinaryOp::Mul => "mul",
            BinaryOp::Div => "div",
            BinaryOp::Pow => "pow",
            BinaryOp::Max => "max",
            BinaryOp::Min => "min",
            BinaryOp::Mod => "mod",
            BinaryOp::Eq => "eq",
            BinaryOp::Ne => "ne",
            BinaryOp::Lt => "lt",
            BinaryOp::Le => "le",
            BinaryOp::Gt => "gt",
            BinaryOp::Ge => "ge",
            BinaryOp::And => "and",
            BinaryOp::Or => "or",
            BinaryOp::Xor => "xor",
            BinaryOp::BitAnd => "bit_and",
            BinaryOp::BitOr => "bit_or",
            BinaryOp::BitXor => "bit_xor",
            BinaryOp::ShiftLeft => "shift_left",
            BinaryOp::ShiftRight => "shift_right",
        }
    }

    /// True for comparisons (numeric operands, bool result).
    pub fn is_comparison(self) -> bool {
        matches!(
            self,
            BinaryOp::Eq | BinaryOp::Ne | BinaryOp::Lt | BinaryOp::Le | BinaryOp::Gt | BinaryOp::Ge
        )
    }

    /// True for logical ops (bool operands and result).
    pub fn is_logical(self) -> bool {
        matches!(self, BinaryOp::And | BinaryOp::Or | BinaryOp::Xor)
    }

    /// True for bitwise ops and shifts (integer operands and result).
    pub fn is_bitwise(self) -> bool {
        matches!(
            self,
            BinaryOp::BitAnd
                | BinaryOp::BitOr
                | BinaryOp::BitXor
                | BinaryOp::ShiftLeft
                | BinaryOp::ShiftRight
        )
    }
}

/// Reductions over a set of axes.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ReduceOp {
    /// Sum (0 over an empty set).
    Sum,
    /// Arithmetic mean (float only).
    Mean,
    /// Maximum (NaN propagates; not defined over an empty set).
    Max,
    /// Minimum (NaN propagates; not defined over an empty set).
    Min,
    /// Product (1 over an empty set).
    Prod,
}

impl ReduceOp {
    /// Lowercase name.
    pub fn name(self) -> &'static str {
        match self {
            ReduceOp::Sum => "sum",
            ReduceOp::Mean => "mean",
            ReduceOp::Max => "max",
            ReduceOp::Min => "min",
            ReduceOp::Prod => "prod",
        }
    }
}

/// Index-of-extreme reductions along one axis (result `i64`; ties pick the first index,
/// NaN counts as the extreme).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ArgReduceOp {
    /// Index of the maximum.
    ArgMax,
    /// Index of the minimum.
    ArgMin,
}

/// How [`Op::Pad`] fills the border.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PadMode {
    /// A constant value.
    Constant(F64Bits),
    /// Mirror without repeating the edge (`[1,2,3]` padded by 2 on the left: `3,2,1,2,3`).
    Reflect,
    /// Repeat the edge value.
    Edge,
}

/// One axis of a [`Op::Slice`]: `len` elements starting at `start`, `step` apart.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct SliceAxis {
    /// First index taken (always in range when `len > 0`).
    pub start: usize,
    /// Distance between taken indices (non-zero; negative walks backwards).
    pub step: isize,
    /// Number of indices taken.
    pub len: usize,
}

/// Which result of a top-k selection a [`Op::TopK`] node yields.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TopKOutput {
    /// The selected values, sorted.
    Values,
    /// Their indices along the axis (`i64`).
    Indices,
}

/// Rotary embedding pairing convention.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum RopeStyle {
    /// Pairs `(x[i], x[i + d/2])` ("rotate half", Hugging Face Llama / GPT-NeoX).
    HalfSplit,
    /// Pairs `(x[2i], x[2i + 1])` (GPT-J, GGUF-converted Llama weights).
    Interleaved,
}

/// 2-D window geometry shared by convolution and pooling.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub struct Window2d {
    /// Kernel height and width.
    pub kernel: [usize; 2],
    /// Stride along height and width (non-zero).
    pub stride: [usize; 2],
    /// Padding: top, left, bottom, right.
    pub padding: [usize; 4],
    /// Dilation along height and width (non-zero).
    pub dilation: [usize; 2],
}

/// What an [`Op::FusedConv2d`] applies around its convolution; each flag adds the
/// operands its doc names, in field order after `x` and `w`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Hash)]
pub struct ConvFusion {
    /// Whether a bias operand (`[O]`) follows `w`.
    pub bias: bool,
    /// Applied after the bias.
    pub activation: Option<UnaryOp>,
    /// Whether a residual operand (the output's shape) follows.
    pub residual: bool,
    /// Whether per-output-channel `scale` and `shift` operands follow.
    pub channel_affine: bool,
    /// Applied after the channel affine (or the residual).
    pub post_activation: Option<UnaryOp>,
    /// Whether per-input-channel `in_scale` and `in_shift` operands come last.
    pub input_affine: bool,
    /// Applied to the input after its affine.
    pub input_activation: Option<UnaryOp>,
}

impl ConvFusion {
    /// Where the residual operand is (when there is one).
    pub fn residual_at(&self) -> usize {
        2 + usize::from(self.bias)
    }

    /// Where the output-channel scale is (its shift follows).
    pub fn scale_at(&self) -> usize {
        self.residual_at() + usize::from(self.residual)
    }

    /// Where the input-channel scale is (its shift follows).
    pub fn input_scale_at(&self) -> usize {
        self.scale_at() + 2 * usize::from(self.channel_affine)
    }

    /// How many operands the op takes.
    pub fn operand_count(&self) -> usize {
        self.input_scale_at() + 2 * usize::from(self.input_affine)
    }

    /// Whether the input is changed before the convolution.
    pub fn has_prologue(&self) -> bool {
        self.input_affine || self.input_activation.is_some()
    }
}

/// One IR operation. The node's inputs are listed in the graph; the op holds only
/// attributes. Axes are stored normalized (non-negative).
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub enum Op {
    /// A value supplied on every run (or bound as a persistent handle).
    Input {
        /// Unique name.
        name: String,
    },
    /// A weight set once with `set_param`.
    Param {
        /// Unique name.
        name: String,
    },
    /// A constant whose data lives in the graph's constant table.
    Constant {
        /// Index into the graph's constant table.
        id: usize,
    },
    /// Elementwise op of one operand.
    Unary(UnaryOp),
    /// Elementwise op of two broadcast operands.
    Binary(BinaryOp),
    /// `cond ? a : b`, all three broadcast; `cond` is bool.
    Where,
    /// Converts to another dtype (floats to integers truncate toward zero).
    Cast(DType),
    /// Reduces the given axes (sorted, unique).
    Reduce {
        /// Which reduction.
        op: ReduceOp,
        /// Axes reduced.
        axes: Vec<usize>,
        /// Keep reduced axes as size 1.
        keepdims: bool,
    },
    /// Index of the maximum or minimum along one axis.
    ArgReduce {
        /// Which one.
        op: ArgReduceOp,
        /// The axis.
        axis: usize,
        /// Keep the axis as size 1.
        keepdims: bool,
    },
    /// `exp(x) / sum(exp(x))` along an axis.
    Softmax {
        /// The axis.
        axis: usize,
    },
    /// `log(softmax(x))` along an axis.
    LogSoftmax {
        /// The axis.
        axis: usize,
    },
    /// numpy `matmul`: batched, batch dims broadcast, 1-D operands promoted.
    MatMul,
    /// Normalizes the last axis: `(x - mean) / sqrt(var + eps) * gamma + beta`.
    LayerNorm {
        /// Added to the variance.
        eps: F64Bits,
    },
    /// `x / sqrt(mean(x^2) + eps) * gamma` over the last axis.
    RmsNorm {
        /// Added to the mean square.
        eps: F64Bits,
    },
    /// The gradient of a layer norm's (`centered`) or RMS norm's input, from its
    /// operands `x`, `gamma` and the output's gradient `g`: `r (gγ - mean(gγ) - x̂
    /// mean(gγ x̂))` over the last axis (no first mean for RMS), with `x̂ = (x -
    /// mean) r` (`x r` for RMS) and `r = 1 / sqrt(var + eps)` (the mean square for
    /// RMS). A composite: one pass over the rows where a backend runs it natively.
    NormGrad {
        /// The norm's epsilon.
        eps: F64Bits,
        /// A layer norm (`true`) or an RMS norm.
        centered: bool,
    },
    /// The gradient of a norm's scale, `Σ g x̂` over every axis but the last, from
    /// `x` and the output's gradient `g` (`x̂` as in [`Op::NormGrad`]): shape `[D]`.
    NormScaleGrad {
        /// The norm's epsilon.
        eps: F64Bits,
        /// A layer norm (`true`) or an RMS norm.
        centered: bool,
    },
    /// Same data, new dimensions (a view: no copy).
    Reshape {
        /// The new dimensions.
        dims: Vec<usize>,
    },
    /// Reorders axes: output axis `i` is input axis `perm[i]`.
    Permute {
        /// The permutation.
        perm: Vec<usize>,
    },
    /// Strided slice, one entry per axis.
    Slice {
        /// Per-axis ranges.
        axes: Vec<SliceAxis>,
    },
    /// Joins inputs along an axis.
    Concat {
        /// The axis.
        axis: usize,
    },
    /// numpy `take`: picks entries of `data` along `axis` by an integer index tensor
    /// (negative indices count from the end; out-of-range is a run-time error).
    Gather {
        /// The axis of `data`.
        axis: usize,
    },
    /// Resampling along an axis, from `x`, an integer `index [taps, out]` and a
    /// `weight [taps, out]` of `x`'s dtype: `y[.., o, ..] = Σ_k weight[k, o]
    /// x[.., index[k, o], ..]` (interpolation with one, two or four taps; negative
    /// indices count from the end, out of range is a run-time error). A composite:
    /// one pass over the output where a backend runs it natively.
    Interpolate {
        /// The resampled axis of `x`.
        axis: usize,
    },
    /// Broadcasts to larger dimensions (numpy `broadcast_to`).
    Expand {
        /// Target dimensions.
        dims: Vec<usize>,
    },
    /// Pads each axis by `(before, after)` elements.
    Pad {
        /// Per-axis padding.
        pads: Vec<(usize, usize)>,
        /// How the border is filled.
        mode: PadMode,
    },
    /// Repeats the tensor `reps[i]` times along axis `i`.
    Tile {
        /// Repetitions per axis.
        reps: Vec<usize>,
    },
    /// `start + i * step` for `i in 0..len` (no inputs).
    Range {
        /// First value.
        start: F64Bits,
        /// Increment.
        step: F64Bits,
        /// Number of values.
        len: usize,
        /// Element type of the result.
        dtype: DType,
    },
    /// Uniform random numbers in `[0, 1)` of the given dims and float dtype, a pure
    /// function of `seed`, the run-time integer `key` (its one operand, such as the
    /// training step) and each element's index: the same key gives the same numbers on
    /// every backend ([`crate::scalar::random_uniform`]).
    RandomUniform {
        /// Fixed part of the stream (one per use, such as one per dropout layer).
        seed: u64,
        /// Dimensions of the result.
        dims: Vec<usize>,
        /// Float type of the result.
        dtype: DType,
    },
    /// Running sum along an axis.
    Cumsum {
        /// The axis.
        axis: usize,
        /// Exclude the current element.
        exclusive: bool,
        /// Accumulate from the end.
        reverse: bool,
    },
    /// The `k` largest (or smallest) entries along an axis, sorted; ties keep the lower
    /// index first.
    TopK {
        /// How many.
        k: usize,
        /// The axis.
        axis: usize,
        /// Largest (true) or smallest (false).
        largest: bool,
        /// Which result this node yields.
        output: TopKOutput,
    },
    /// One-hot encoding along a new last axis; indices outside `[-depth, depth)` give an
    /// all-zero row, negative ones count from the end.
    OneHot {
        /// Length of the new axis.
        depth: usize,
        /// Element type of the result.
        dtype: DType,
    },
    /// 2-D convolution, NCHW input, OIHW weight, optional bias.
    Conv2d {
        /// Window geometry (kernel size comes from the weight).
        window: Window2d,
        /// Channel groups.
        groups: usize,
    },
    /// 2-D max pooling over NCHW (padding counts as -infinity).
    MaxPool2d {
        /// Window geometry.
        window: Window2d,
    },
    /// The gradient of a max pool whose windows tile its NCHW input (stride equal to
    /// the kernel, no padding or dilation, the kernel dividing the height and
    /// width), from the input `x`, the pool's output `y` and `y`'s gradient `g`:
    /// each window's gradient shared evenly among its inputs equal to the maximum
    /// (`hit * (g / ties)`, so a window whose maximum is NaN is NaN throughout, and
    /// an infinite `g` makes the window's other inputs NaN, `0 * inf`, where PyTorch
    /// gives them zero). A composite: one pass over the input where a backend runs
    /// it natively.
    TiledMaxPoolGrad {
        /// The window `[kh, kw]`, which is also the stride.
        kernel: [usize; 2],
    },
    /// 2-D average pooling over NCHW.
    AvgPool2d {
        /// Window geometry.
        window: Window2d,
        /// Divide by the full window size, padding included (else by the valid count).
        count_include_pad: bool,
    },
    /// Scaled dot-product attention over `q [B,Hq,Sq,D]`, `k [B,Hkv,Sk,D]`,
    /// `v [B,Hkv,Sk,Dv]` and an optional mask broadcastable to `[B,Hq,Sq,Sk]`
    /// (additive if float, keep-where-true if bool). `Hq` is a multiple of `Hkv`
    /// (grouped-query attention). Rows with every key masked give zeros.
    Attention {
        /// Multiplies `q . k` before the mask.
        scale: F64Bits,
        /// Masks key `j` for query `i` when `j > i + (Sk - Sq)`.
        causal: bool,
        /// `q`, `k`, `v` and the output are `[B, S, H, D]` (sequence before heads)
        /// instead of `[B, H, S, D]`; the mask is indexed `[B, H, Sq, Sk]` either way.
        seq_major: bool,
    },
    /// Rotary position embedding of `x [..., S, D]` with `cos`, `sin` of shape
    /// `[..., S, D/2]` (broadcast against `x`'s leading dims).
    Rope {
        /// Pairing convention.
        style: RopeStyle,
    },
    /// Writes `update` into `target` (a persistent handle) along `axis` starting at the
    /// run-time index `pos` (a scalar integer). The result is the updated target.
    WriteAt {
        /// The axis written along.
        axis: usize,
    },
    /// `act(alpha * (a @ b) + bias) + residual`: a matmul with its epilogue, formed by
    /// the optimizer. Operands: `a`, `b`, then `bias` (`[N]`) if `bias`, then the
    /// residual (the output's shape) if `residual`. With an `f32` `a`, `b` may be `f16`
    /// or `bf16` (read as `f32`: stored weights need no conversion pass). A transposed
    /// operand is given with its last two axes swapped (`a` as `[.., k, m]`, `b` as
    /// `[.., n, k]`) and read that way by the product, with no transposed copy.
    FusedMatMul {
        /// Scale of the product.
        alpha: F64Bits,
        /// `a` is stored transposed (`[.., k, m]`).
        transpose_a: bool,
        /// `b` is stored transposed (`[.., n, k]`).
        transpose_b: bool,
        /// Whether a bias operand follows `b`.
        bias: bool,
        /// Applied after the bias.
        activation: Option<UnaryOp>,
        /// Whether a residual operand comes last.
        residual: bool,
    },
    /// `post(((act(conv2d(pre(x * in_scale + in_shift), w) + bias) + residual) * scale
    /// + shift)`: a convolution with its prologue and epilogue, formed by the optimizer
    /// (the per-channel affines and their activations are batch norms around it).
    /// Operands: `x`, `w`, then `bias` (`[O]`) if `bias`, then the residual (the
    /// output's shape) if `residual`, then `scale` and `shift` (`[1, O, 1, 1]`) if
    /// `channel_affine`, then `in_scale` and `in_shift` (`[1, C, 1, 1]`) if
    /// `input_affine`. Padding is zero after the prologue.
    FusedConv2d {
        /// Window geometry (kernel size comes from the weight).
        window: Window2d,
        /// Channel groups.
        groups: usize,
        /// What is applied around the convolution, and so which operands follow `w`.
        fusion: ConvFusion,
    },
    /// A region of float elementwise ops computed in one pass (see [`EwStep`]),
    /// formed by the optimizer.
    Elementwise {
        /// The steps, in order; the last one is the output.
        steps: Vec<EwStep>,
    },
    /// `a @ dequantize(w)^T` with `a [..., K]` (`f32`) and `w` packed weights: a `u8`
    /// tensor `[N, row_bytes]` whose rows are `K` values in `format`'s blocks (the
    /// GGUF layout of a linear layer). The result is `[..., N]` `f32`.
    QuantMatMul {
        /// The block format of `w`'s rows.
        format: QuantFormat,
    },
    /// Decodes packed rows: `u8 [..., row_bytes]` in `format` to `f32 [..., K]`.
    Dequantize {
        /// The block format of the rows.
        format: QuantFormat,
    },
    /// Causal attention of new queries over a key/value cache, sequence-major:
    /// `q [B, Sq, Hq, D]`, `k [B, Smax, Hkv, D]`, `v [B, Smax, Hkv, Dv]` and a
    /// one-element integer `pos`. Query `i` sits at position `pos + i` and sees keys
    /// `0 ..= pos + i`; cache rows after `pos + Sq` are never read. `pos + Sq > Smax`
    /// is a run-time error. The result is `[B, Sq, Hq, Dv]`.
    CachedAttention {
        /// Multiplies `q . k`.
        scale: F64Bits,
    },
}

impl Op {
    /// A short name for printing and kernel tables.
    pub fn name(&self) -> String {
        match self {
            Op::Input { .. } => "input".into(),
            Op::Param { .. } => "param".into(),
            Op::Constant { .. } => "constant".into(),
            Op::Unary(u) => u.name().into(),
            Op::Binary(b) => b.name().into(),
            Op::Where => "where".into(),
            Op::Cast(_) => "cast".into(),
            Op::Reduce { op, .. } => format!("reduce_{}", op.name()),
            Op::ArgReduce {
                op: ArgReduceOp::ArgMax,
                ..
            } => "argmax".into(),
            Op::ArgReduce {
                op: ArgReduceOp::ArgMin,
                ..
            } => "argmin".into(),
            Op::Softmax { .. } => "softmax".into(),
            Op::LogSoftmax { .. } => "log_softmax".into(),
            Op::MatMul => "matmul".into(),
            Op::LayerNorm { .. } => "layer_norm".into(),
            Op::RmsNorm { .. } => "rms_norm".into(),
            Op::NormGrad { .. } => "norm_grad".into(),
            Op::NormScaleGrad { .. } => "norm_scale_grad".into(),
            Op::Reshape { .. } => "reshape".into(),
            Op::Permute { .. } => "permute".into(),
            Op::Slice { .. } => "slice".into(),
            Op::Concat { .. } => "concat".into(),
            Op::Gather { .. } => "gather".into(),
            Op::Interpolate { .. } => "interpolate".into(),
            Op::Expand { .. } => "expand".into(),
            Op::Pad { .. } => "pad".into(),
            Op::Tile { .. } => "tile".into(),
            Op::Range { .. } => "range".into(),
            Op::RandomUniform { .. } => "random_uniform".into(),
            Op::Cumsum { .. } => "cumsum".into(),
            Op::TopK {
                output: TopKOutput::Values,
                ..
            } => "topk_values".into(),
            Op::TopK {
                output: TopKOutput::Indices,
                ..
            } => "topk_indices".into(),
            Op::OneHot { .. } => "one_hot".into(),
            Op::Conv2d { .. } => "conv2d".into(),
            Op::MaxPool2d { .. } => "max_pool2d".into(),
            Op::TiledMaxPoolGrad { .. } => "tiled_max_pool_grad".into(),
            Op::AvgPool2d { .. } => "avg_pool2d".into(),
            Op::Attention { .. } => "attention".into(),
            Op::Rope { .. } => "rope".into(),
            Op::WriteAt { .. } => "write_at".into(),
            Op::FusedMatMul { .. } => "fused_matmul".into(),
            Op::FusedConv2d { .. } => "fused_conv2d".into(),
            Op::Elementwise { .. } => "elementwise".into(),
            Op::QuantMatMul { .. } => "quant_matmul".into(),
            Op::Dequantize { .. } => "dequantize".into(),
            Op::CachedAttention { .. } => "cached_attention".into(),
        }
    }

    /// True for nodes that hold data rather than compute it.
    pub fn is_source(&self) -> bool {
        matches!(
            self,
            Op::Input { .. } | Op::Param { .. } | Op::Constant { .. }
        )
    }

    /// True for ops where output element `i` depends only on input elements `i` of
    /// same-shaped operands, so the output may overwrite such an operand in place.
    pub fn is_elementwise(&self) -> bool {
        matches!(
            self,
            Op::Unary(_) | Op::Binary(_) | Op::Where | Op::Cast(_) | Op::Elementwise { .. }
        )
    }
}
