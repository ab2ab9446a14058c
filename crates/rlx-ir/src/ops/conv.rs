//! 2-D convolution and pooling over NCHW tensors.

use super::{mismatch, require_float, require_rank, same_dtype};
use crate::reference::HostTensor;
use crate::{Error, Graph, NodeId, Op, Result, Shape, Window2d};

impl Graph {
    /// 2-D convolution: `x [N, C, H, W]`, `w [O, C / groups, KH, KW]`, optional
    /// `bias [O]`. `padding` is `[top, left, bottom, right]`.
    #[allow(clippy::too_many_arguments)] // mirrors the familiar conv2d signature
    pub fn conv2d(
        &self,
        x: NodeId,
        w: NodeId,
        bias: Option<NodeId>,
        stride: [usize; 2],
        padding: [usize; 4],
        dilation: [usize; 2],
        groups: usize,
    ) -> Result<NodeId> {
        let ws = self.shape(w)?;
        require_rank("conv2d", "weight", &ws, 4)?;
        let kernel = [ws.dim(2), ws.dim(3)];
        // Along an axis one tap wide, the dilation changes nothing: it is stored as 1,
        // so the convolution takes the kernels of undilated ones (an atrous
        // convolution whose outer taps read only padding becomes a dilated 1x1 one).
        let dilation: [usize; 2] = std::array::from_fn(|a| {
            if kernel[a] == 1 && dilation[a] > 0 {
                1
            } else {
                dilation[a]
            }
        });
        let window = Window2d {
            kernel,
            stride,
            padding,
            dilation,
        };
        let mut inputs = vec![x, w];
        inputs.extend(bias);
        self.push(Op::Conv2d { window, groups }, &inputs)
    }

    /// 2-D max pooling (padding never wins the max).
    pub fn max_pool2d(
        &self,
        x: NodeId,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 4],
    ) -> Result<NodeId> {
        let window = Window2d {
            kernel,
            stride,
            padding,
            dilation: [1, 1],
        };
        self.push(Op::MaxPool2d { window }, &[x])
    }

    /// The gradient of the input of `max_pool2d(x, kernel, kernel, [0; 4])` whose
    /// windows tile `x` (the kernel divides its height and width), from the pool's
    /// output `y` and its gradient `g` ([`Op::TiledMaxPoolGrad`]): ties share a
    /// window's gradient evenly.
    pub fn tiled_max_pool_grad(
        &self,
        x: NodeId,
        y: NodeId,
        g: NodeId,
        kernel: [usize; 2],
    ) -> Result<NodeId> {
        self.push(Op::TiledMaxPoolGrad { kernel }, &[x, y, g])
    }

    /// 2-D average pooling; `count_include_pad` divides by the whole window.
    pub fn avg_pool2d(
        &self,
        x: NodeId,
        kernel: [usize; 2],
        stride: [usize; 2],
        padding: [usize; 4],
        count_include_pad: bool,
    ) -> Result<NodeId> {
        let window = Window2d {
            kernel,
            stride,
            padding,
            dilation: [1, 1],
        };
        self.push(
            Op::AvgPool2d {
                window,
                count_include_pad,
            },
            &[x],
        )
    }
}

/// Output height and width of a window sliding over `h x w`, or an error.
pub fn window_output(op: &str, win: &Window2d, h: usize, w: usize) -> Result<[usize; 2]> {
    if win.stride.contains(&0) || win.dilation.contains(&0) || win.kernel.contains(&0) {
        return Err(Error::invalid(
            op,
            format!("{win:?}: kernel, stride and dilation must be non-zero"),
        ));
    }
    let mut out = [0; 2];
    for (a, size) in [h, w].into_iter().enumerate() {
        let padded = size
            .checked_add(win.padding[a])
            .and_then(|p| p.checked_add(win.padding[a + 2]));
        let span = win.dilation[a]
            .checked_mul(win.kernel[a] - 1)
            .and_then(|s| s.checked_add(1));
        let (Some(padded), Some(span)) = (padded, span) else {
            return Err(Error::invalid(
                op,
                format!(
                    "{win:?}: padded extent or window span overflows on axis {}",
                    a + 2
                ),
            ));
        };
        if padded < span {
            return Err(Error::invalid(
                op,
                format!(
                    "window span {span} exceeds padded input extent {padded} on axis {}",
                    a + 2
                ),
            ));
        }
        out[a] = (padded - span) / win.stride[a] + 1;
    }
    Ok(out)
}

pub(crate) fn infer_conv2d(win: &Window2d, groups: usize, inputs: &[&Shape]) -> Result<Shape> {
    let (x, w) = (inputs[0], inputs[1]);
    require_rank("conv2d", "input", x, 4)?;
    require_rank("conv2d", "weight", w, 4)?;
    require_float("conv2d", x)?;
    same_dtype("conv2d", x, w)?;
    let (c, o) = (x.dim(1), w.dim(0));
    if groups == 0 || c % groups != 0 || o % groups != 0 || w.dim(1) * groups != c {
        return Err(mismatch(
            "conv2d",
            x,
            w,
            format!(
                "{groups} groups: weight must be [O, C/groups, KH, KW] with C and O divisible by groups"
            ),
        ));
    }
    if [w.dim(2), w.dim(3)] != win.kernel {
        return Err(mismatch(
            "conv2d",
            x,
            w,
            "kernel size disagrees with the weight",
        ));
    }
    if let Some(b) = inputs.get(2) {
        same_dtype("conv2d", x, b)?;
        if b.dims() != [o] {
            return Err(mismatch(
                "conv2d",
                w,
                b,
                format!("bias must have shape [{o}]"),
            ));
        }
    }
    let [oh, ow] = window_output("conv2d", win, x.dim(2), x.dim(3))?;
    Ok(x.with_dims(&[x.dim(0), o, oh, ow]))
}

pub(crate) fn infer_pool(op: &str, win: &Window2d, x: &Shape) -> Result<Shape> {
    require_rank(op, "input", x, 4)?;
    if op == "max_pool2d" {
        super::require_numeric(op, x)?;
    } else {
        require_float(op, x)?;
    }
    // Padding narrower than the window keeps every undilated window on at least one
    // input element (a dilated one can hold padding alone: a max pool gives -inf
    // there, and an average counts at least one element).
    let span = |a: usize| {
        win.dilation[a]
            .saturating_mul(win.kernel[a].max(1) - 1)
            .saturating_add(1)
    };
    if (0..4).any(|i| win.padding[i] >= span(i % 2)) {
        return Err(Error::invalid(
            op,
            format!(
                "padding {:?} must be smaller than the window {:?} (dilation {:?})",
                win.padding, win.kernel, win.dilation
            ),
        ));
    }
    let [oh, ow] = window_output(op, win, x.dim(2), x.dim(3))?;
    Ok(x.with_dims(&[x.dim(0), x.dim(1), oh, ow]))
}

/// The shape of [`Op::TiledMaxPoolGrad`]: `x`'s, once `x` is a float NCHW tensor
/// that `kernel` tiles and `y` and `g` are its pooled shape, all of one dtype.
pub(crate) fn infer_tiled_max_pool_grad(
    kernel: [usize; 2],
    x: &Shape,
    y: &Shape,
    g: &Shape,
) -> Result<Shape> {
    const OP: &str = "tiled_max_pool_grad";
    require_rank(OP, "input", x, 4)?;
    require_float(OP, x)?;
    same_dtype(OP, x, y)?;
    same_dtype(OP, x, g)?;
    let [kh, kw] = kernel;
    if kh == 0 || kw == 0 || !x.dim(2).is_multiple_of(kh) || !x.dim(3).is_multiple_of(kw) {
        return Err(Error::invalid(
            OP,
            format!("the window {kernel:?} must tile the input {x} (divide its height and width)"),
        ));
    }
    let pooled = x.with_dims(&[x.dim(0), x.dim(1), x.dim(2) / kh, x.dim(3) / kw]);
    for (what, s) in [("pooled output", y), ("output gradient", g)] {
        if s.dims() != pooled.dims() {
            return Err(mismatch(
                OP,
                x,
                s,
                format!("the {what} must have the pooled shape {pooled}"),
            ));
        }
    }
    Ok(x.clone())
}

/// [`Op::TiledMaxPoolGrad`] in `f64`: `hit * (g / ties)` at every input element.
pub(crate) fn eval_tiled_max_pool_grad(
    [kh, kw]: [usize; 2],
    x: &HostTensor,
    y: &HostTensor,
    g: &HostTensor,
) -> HostTensor {
    let (h, w) = (x.shape.dim(2), x.shape.dim(3));
    let (oh, ow) = (h / kh, w / kw);
    let planes = x.shape.dim(0) * x.shape.dim(1);
    let mut data = vec![0.0; x.shape.num_elements()];
    let at = |plane: usize, iy: usize, ix: usize| (plane * h + iy) * w + ix;
    for plane in 0..planes {
        for oy in 0..oh {
            for ox in 0..ow {
                let o = (plane * oh + oy) * ow + ox;
                let window =
                    || (0..kh).flat_map(move |i| (0..kw).map(move |j| (oy * kh + i, ox * kw + j)));
                let ties = window()
                    .filter(|&(iy, ix)| x.data[at(plane, iy, ix)] == y.data[o])
                    .count();
                let share = x.shape.dtype().round_value(g.data[o] / ties as f64);
                for (iy, ix) in window() {
                    let hit = if x.data[at(plane, iy, ix)] == y.data[o] {
                        1.0
                    } else {
                        0.0
                    };
                    data[at(plane, iy, ix)] = x.shape.dtype().round_value(hit * share);
                }
            }
        }
    }
    HostTensor::new(x.shape.clone(), data)
}

/// Input coordinate of window tap `k` at output position `o`, if inside the input.
fn tap(win: &Window2d, axis: usize, o: usize, k: usize, size: usize) -> Option<usize> {
    let p = (o * win.stride[axis] + k * win.dilation[axis]) as isize - win.padding[axis] as isize;
    (0..size as isize).contains(&p).then_some(p as usize)
}

pub(crate) fn eval_conv2d(
    win: &Window2d,
    groups: usize,
    inputs: &[&HostTensor],
    out: &Shape,
) -> HostTensor {
    let (x, w) = (inputs[0], inputs[1]);
    let [n, c, h, wd] = [
        x.shape.dim(0),
        x.shape.dim(1),
        x.shape.dim(2),
        x.shape.dim(3),
    ];
    let [o, oh, ow] = [out.dim(1), out.dim(2), out.dim(3)];
    let (cg, og) = (c / groups, o / groups);
    let [kh, kw] = win.kernel;
    let mut data = vec![0.0; out.num_elements()];
    for b in 0..n {
        for oc in 0..o {
            let g = oc / og;
            for y in 0..oh {
                for xo in 0..ow {
                    let mut acc = inputs.get(2).map_or(0.0, |bias| bias.data[oc]);
                    for ic in 0..cg {
                        for ky in 0..kh {
                            let Some(iy) = tap(win, 0, y, ky, h) else {
                                continue;
                            };
                            for kx in 0..kw {
                                let Some(ix) = tap(win, 1, xo, kx, wd) else {
                                    continue;
                                };
                                let xv = x.data[((b * c + g * cg + ic) * h + iy) * wd + ix];
                                let wv = w.data[((oc * cg + ic) * kh + ky) * kw + kx];
                                acc += xv * wv;
                            }
                        }
                    }
                    data[((b * o + oc) * oh + y) * ow + xo] = out.dtype().round_value(acc);
                }
            }
        }
    }
    HostTensor::new(out.clone(), data)
}

pub(crate) fn eval_pool(
    win: &Window2d,
    max: bool,
    include_pad: bool,
    x: &HostTensor,
    out: &Shape,
) -> HostTensor {
    let [n, c, h, w] = [
        x.shape.dim(0),
        x.shape.dim(1),
        x.shape.dim(2),
        x.shape.dim(3),
    ];
    let [oh, ow] = [out.dim(2), out.dim(3)];
    let mut data = vec![0.0; out.num_elements()];
    for plane in 0..n * c {
        for y in 0..oh {
            for xo in 0..ow {
                let (mut acc, mut count) = (if max { f64::NEG_INFINITY } else { 0.0 }, 0usize);
                for ky in 0..win.kernel[0] {
                    for kx in 0..win.kernel[1] {
                        let (iy, ix) = (tap(win, 0, y, ky, h), tap(win, 1, xo, kx, w));
                        if let (Some(iy), Some(ix)) = (iy, ix) {
                            let v = x.data[(plane * h + iy) * w + ix];
                            acc = if max {
                                if v.is_nan() || acc.is_nan() {
                                    f64::NAN
                                } else {
                                    acc.max(v)
                                }
                            } else {
                                acc + v
                            };
                            count += 1;
                        }
                    }
                }
                let window_len = win.kernel[0] * win.kernel[1];
                let v = if max {
                    acc
                } else {
                    acc / (if include_pad {
                        window_len
                    } else {
                        count.max(1)
                    }) as f64
                };
                data[(plane * oh + y) * ow + xo] = out.dtype().round_value(v);
            }
        }
    }
    HostTensor::new(out.clone(), data)
}

#[cfg(test)]
mod tests {
    use crate::{DType, Graph, Op, Shape};

    #[test]
    fn a_dilation_along_an_axis_one_tap_wide_is_stored_as_one() {
        let g = Graph::new("conv");
        let x = g
            .input("x", Shape::new(&[1, 8, 20, 20], DType::F32))
            .unwrap();
        let dilations = |kernel: [usize; 2], dilation: [usize; 2]| {
            let w = g
                .param("w", Shape::new(&[4, 8, kernel[0], kernel[1]], DType::F32))
                .unwrap();
            let y = g.conv2d(x, w, None, [1, 1], [0; 4], dilation, 1).unwrap();
            match g.node(y).unwrap().op {
                Op::Conv2d { window, .. } => window.dilation,
                op => panic!("a convolution, not {op:?}"),
            }
        };
        assert_eq!(dilations([1, 1], [24, 24]), [1, 1]);
        assert_eq!(dilations([3, 1], [2, 3]), [2, 1]);
        assert_eq!(dilations([3, 3], [2, 3]), [2, 3]);
        // A dilation of 0 is left for the shape check to reject.
        let w = g.param("w", Shape::new(&[4, 8, 1, 1], DType::F32)).unwrap();
        assert!(g.conv2d(x, w, None, [1, 1], [0; 4], [0, 1], 1).is_err());
    }
}
