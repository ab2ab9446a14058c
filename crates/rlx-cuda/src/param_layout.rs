//! How weights are laid out on the device.
//!
//! A 2-D param whose every use is as the right operand `b [K, N]` of a matrix
//! product is stored transposed, `[N, K]` (the layout a linear layer's weight has
//! in a checkpoint). A product of a few rows (a decode step) then reads each
//! output's weights as one contiguous row, a warp per output with no partial sums
//! to meet across blocks, which measured 1.2x to 1.7x faster on the decode shapes
//! of a 1B Llama (`gemv_bench`); cuBLAS reads it transposed for larger products.
//! The host always sees the graph's layout: `set_param` takes `[K, N]` bytes.

use rlx_ir::{NodeId, Op};
use rlx_opt::Plan;
use std::collections::HashMap;

/// Each param node's index among the plan's params.
pub(crate) fn param_indices(plan: &Plan) -> HashMap<NodeId, usize> {
    plan.params
        .iter()
        .enumerate()
        .map(|(i, p)| (p.node, i))
        .collect()
}

/// For each of the plan's params (in order), whether it is stored `[N, K]`.
pub(crate) fn transposed_params(plan: &Plan) -> Vec<bool> {
    let index = param_indices(plan);
    let mut transposed: Vec<bool> = plan.params.iter().map(|p| p.shape.rank() == 2).collect();
    let mut used = vec![false; plan.params.len()];
    for node in plan.graph.nodes().iter() {
        let product = matches!(node.op, Op::MatMul | Op::FusedMatMul { .. });
        for (slot, input) in node.inputs.iter().enumerate() {
            if let Some(&i) = index.get(input) {
                used[i] = true;
                if !(product && slot == 1) {
                    transposed[i] = false;
                }
            }
        }
    }
    for output in &plan.outputs {
        if let Some(&i) = index.get(output) {
            transposed[i] = false;
        }
    }
    transposed.iter().zip(used).map(|(&t, u)| t && u).collect()
}

/// `bytes`, a row-major `[rows, cols]` matrix of `elem`-byte elements, transposed to
/// `[cols, rows]` (in tiles, so both sides are read and written in cache-sized runs;
/// a large matrix on several threads, each writing its own output rows: a 1B
/// model's weights are 2.5 GB).
pub(crate) fn transpose(bytes: &[u8], rows: usize, cols: usize, elem: usize) -> Vec<u8> {
    let mut out = vec![0u8; bytes.len()];
    let row_bytes = rows * elem;
    if row_bytes == 0 || cols == 0 {
        return out;
    }
    let threads = if bytes.len() < PARALLEL_FROM {
        1
    } else {
        std::thread::available_parallelism().map_or(1, |n| n.get())
    };
    let per_thread = cols.div_ceil(threads);
    std::thread::scope(|scope| {
        for (i, chunk) in out.chunks_mut(per_thread * row_bytes).enumerate() {
            let first = i * per_thread;
            scope.spawn(move || transpose_columns(bytes, rows, cols, elem, first, chunk));
        }
    });
    out
}

/// Bytes from which [`transpose`] uses several threads.
const PARALLEL_FROM: usize = 8 << 20;

/// Writes output rows `first ..` (input columns) into `out`, which holds whole
/// output rows.
fn transpose_columns(
    bytes: &[u8],
    rows: usize,
    cols: usize,
    elem: usize,
    first: usize,
    out: &mut [u8],
) {
    const TILE: usize = 64;
    let count = out.len() / (rows * elem);
    for c0 in (first..first + count).step_by(TILE) {
        for r0 in (0..rows).step_by(TILE) {
            for c in c0..(c0 + TILE).min(first + count).min(cols) {
                for r in r0..(r0 + TILE).min(rows) {
                    let from = (r * cols + c) * elem;
                    let to = ((c - first) * rows + r) * elem;
                    out[to..to + elem].copy_from_slice(&bytes[from..from + elem]);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rlx_ir::{DType, Graph, Shape};
    use rlx_opt::{PlanOptions, plan_graph};

    #[test]
    fn a_transpose_moves_every_element_to_its_mirror() {
        // A small one on one thread, and one past the size that splits the work.
        for (rows, cols) in [(70, 131), (1031, 4099)] {
            // Every element distinct, so a misplaced one cannot match by chance.
            let values: Vec<u32> = (0..rows * cols).map(|i| i as u32).collect();
            let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
            let t = transpose(&bytes, rows, cols, 4);
            for r in 0..rows {
                for c in 0..cols {
                    let at = (c * rows + r) * 4;
                    assert_eq!(
                        u32::from_le_bytes(t[at..at + 4].try_into().unwrap()),
                        values[r * cols + c],
                        "[{r}, {c}] of {rows} x {cols}"
                    );
                }
            }
        }
        assert!(transpose(&[], 0, 5, 4).is_empty());
    }

    #[test]
    fn only_weights_that_feed_products_alone_are_transposed() {
        let g = Graph::new("layouts");
        let x = g.input("x", Shape::new(&[1, 8], DType::F32)).unwrap();
        let w = g.param("w", Shape::new(&[8, 4], DType::F32)).unwrap();
        let shared = g.param("shared", Shape::new(&[4, 4], DType::F32)).unwrap();
        let bias = g.param("bias", Shape::new(&[4], DType::F32)).unwrap();
        let y = g.matmul(x, w).unwrap();
        let y = g.add(g.matmul(y, shared).unwrap(), bias).unwrap();
        // `shared` is also read as it is: it keeps the graph's layout.
        let z = g.add(y, g.sum(shared, &[0], false).unwrap()).unwrap();
        g.set_outputs(vec![z]);
        let p = plan_graph(&g, &PlanOptions::default()).unwrap();
        let by_name: HashMap<&str, bool> = p
            .params
            .iter()
            .map(|s| s.name.as_str())
            .zip(transposed_params(&p))
            .collect();
        assert!(by_name["w"]);
        assert!(!by_name["shared"]);
        assert!(!by_name["bias"]);
    }
}
