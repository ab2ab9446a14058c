//! The verifier: checks a whole graph before it is compiled or evaluated.

use crate::{Error, Graph, Op, Result};
use std::collections::HashMap;

impl Graph {
    /// Checks that every operand precedes its user, every stored shape matches what
    /// inference gives, every shape fits in `isize::MAX` bytes ([`crate::Shape::check_size`]:
    /// [`Error::SizeOverflow`]), constants match their shapes, source names are unique,
    /// outputs exist, and `write_at` targets inputs.
    pub fn verify(&self) -> Result<()> {
        let nodes = self.nodes();
        let constants = self.constants();
        let fail = |node: String, message: String| Error::InvalidGraph {
            graph: self.name().to_string(),
            node,
            message,
        };
        let mut names: HashMap<&str, usize> = HashMap::new();
        for (i, node) in nodes.iter().enumerate() {
            let at = format!("%{i} ({})", node.op.name());
            if let Some(bad) = node.inputs.iter().find(|id| id.index() >= i) {
                return Err(fail(
                    at,
                    format!("operand {bad} is not defined before its use"),
                ));
            }
            crate::graph::check_rank(&node.op.name(), &node.shape)
                .map_err(|e| fail(at.clone(), e.to_string()))?;
            node.shape.check_size(&at)?;
            match &node.op {
                Op::Input { name } | Op::Param { name } => {
                    if name.is_empty() {
                        return Err(fail(at, "empty name".into()));
                    }
                    if let Some(prev) = names.insert(name, i) {
                        return Err(fail(
                            at,
                            format!("name '{name}' is already used by %{prev}"),
                        ));
                    }
                }
                Op::Constant { id } => {
                    let data = constants.get(*id).ok_or_else(|| {
                        fail(at.clone(), format!("constant #{id} does not exist"))
                    })?;
                    if data.dtype() != node.shape.dtype() || data.len() != node.shape.num_elements()
                    {
                        return Err(fail(
                            at,
                            format!(
                                "constant #{id} holds {} {} values, shape is {}",
                                data.len(),
                                data.dtype(),
                                node.shape
                            ),
                        ));
                    }
                }
                op => {
                    let shapes: Vec<&crate::Shape> = node
                        .inputs
                        .iter()
                        .map(|id| &nodes[id.index()].shape)
                        .collect();
                    let inferred = crate::infer::infer_shape(op, &shapes)
                        .map_err(|e| fail(at.clone(), e.to_string()))?;
                    if inferred != node.shape {
                        return Err(fail(
                            at,
                            format!("stored shape {} but inference gives {inferred}", node.shape),
                        ));
                    }
                    if let Op::WriteAt { .. } = op
                        && !matches!(nodes[node.inputs[0].index()].op, Op::Input { .. })
                    {
                        return Err(fail(
                            at,
                            "write_at target must be an input bound as a persistent handle".into(),
                        ));
                    }
                }
            }
        }
        let outputs = self.outputs();
        if outputs.is_empty() {
            return Err(fail("-".into(), "no outputs; call set_outputs".into()));
        }
        if let Some(bad) = outputs.iter().find(|id| id.index() >= nodes.len()) {
            return Err(fail("-".into(), format!("output {bad} does not exist")));
        }
        Ok(())
    }
}
