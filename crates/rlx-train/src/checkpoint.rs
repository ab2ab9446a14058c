//! Checkpoints: the params, the optimizer state and the step count of a
//! [`Trainer`] in one safetensors file, and params alone read from one (initial
//! weights exported by another framework).

use crate::Trainer;
use crate::step_graph::TensorSpec;
use rlx_ir::{DType, Error, Result};
use safetensors::{Dtype, SafeTensors, tensor::TensorView};
use std::collections::HashMap;
use std::path::Path;

const FORMAT_KEY: &str = "format";
const FORMAT: &str = "rlx-train-checkpoint";
const STEP_KEY: &str = "step";
const MODEL_KEY: &str = "model";
const OPTIMIZER_KEY: &str = "optimizer";

impl Trainer {
    /// Writes the params, the optimizer state and the step count to a safetensors
    /// file (the step, model name and optimizer in its metadata). Loading it with
    /// [`Trainer::load_checkpoint`] continues bit for bit as if never stopped.
    pub fn save_checkpoint(&self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let tensors: Vec<(String, TensorSpec, Vec<u8>)> = self
            .params()
            .iter()
            .chain(self.state())
            .map(|t| Ok((t.name.clone(), t.clone(), self.handle_bytes(&t.name)?)))
            .collect::<Result<_>>()?;
        let views = tensors
            .iter()
            .map(|(name, spec, bytes)| {
                let view = TensorView::new(file_dtype(spec)?, spec.shape.dims().to_vec(), bytes)
                    .map_err(|e| format_error(path, e))?;
                Ok((name.clone(), view))
            })
            .collect::<Result<Vec<_>>>()?;
        let metadata = HashMap::from([
            (FORMAT_KEY.to_string(), FORMAT.to_string()),
            (STEP_KEY.to_string(), self.steps().to_string()),
            (MODEL_KEY.to_string(), self.model_name().to_string()),
            (
                OPTIMIZER_KEY.to_string(),
                self.options().optimizer().describe(),
            ),
        ]);
        let temporary = path.with_extension("partial");
        safetensors::serialize_to_file(views, Some(metadata), &temporary)
            .map_err(|e| io_error(&temporary, e))?;
        std::fs::rename(&temporary, path).map_err(|e| io_error(path, e))
    }

    /// Restores params, optimizer state and step count from a file written by
    /// [`Trainer::save_checkpoint`]. Every tensor is checked before anything is
    /// written, so a rejected file leaves the trainer as it was.
    ///
    /// # Errors
    /// [`Error::Io`] when the file cannot be read; [`Error::Format`] when it is not a
    /// checkpoint, or one of another model (a tensor missing, extra or of another
    /// shape, named) or optimizer.
    pub fn load_checkpoint(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| io_error(path, e))?;
        let (_, header) = SafeTensors::read_metadata(&bytes).map_err(|e| format_error(path, e))?;
        let metadata = header.metadata().clone().unwrap_or_default();
        if metadata.get(FORMAT_KEY).map(String::as_str) != Some(FORMAT) {
            return Err(format_error(
                path,
                "not an RLX training checkpoint (no 'format' metadata); use load_params for weights alone",
            ));
        }
        let optimizer = self.options().optimizer().describe();
        if metadata.get(OPTIMIZER_KEY) != Some(&optimizer) {
            return Err(format_error(
                path,
                format!(
                    "saved with optimizer {:?}, but this trainer runs {optimizer}",
                    metadata.get(OPTIMIZER_KEY)
                ),
            ));
        }
        let steps: u64 = metadata
            .get(STEP_KEY)
            .and_then(|s| s.parse().ok())
            .ok_or_else(|| format_error(path, "the step count is missing or not a number"))?;
        let expected: Vec<TensorSpec> = self.params().iter().chain(self.state()).cloned().collect();
        let file = SafeTensors::deserialize(&bytes).map_err(|e| format_error(path, e))?;
        let values = matched(path, &file, &expected)?;
        for (spec, data) in expected.iter().zip(values) {
            self.set_handle_bytes(&spec.name, data)?;
        }
        self.set_steps(steps);
        Ok(())
    }

    /// Sets the trained params from a safetensors file of tensors named as the
    /// params (initial weights, say from PyTorch's `save_file(model.state_dict())`).
    /// Tensors of the file that are not params are an error, as is a missing param;
    /// the optimizer state and step count are untouched.
    pub fn load_params(&mut self, path: impl AsRef<Path>) -> Result<()> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| io_error(path, e))?;
        let file = SafeTensors::deserialize(&bytes).map_err(|e| format_error(path, e))?;
        let expected = self.params().to_vec();
        let values = matched(path, &file, &expected)?;
        for (spec, data) in expected.iter().zip(values) {
            self.set_handle_bytes(&spec.name, data)?;
        }
        Ok(())
    }
}

/// The bytes of each of `expected` in `file`, checked for dtype and shape; a tensor
/// of the file not expected is an error too.
fn matched<'a>(
    path: &Path,
    file: &SafeTensors<'a>,
    expected: &[TensorSpec],
) -> Result<Vec<&'a [u8]>> {
    if let Some(extra) = file
        .names()
        .into_iter()
        .find(|n| !expected.iter().any(|e| e.name == *n))
    {
        return Err(format_error(
            path,
            format!("tensor '{extra}' is not one of this model's (a file of another model?)"),
        ));
    }
    expected
        .iter()
        .map(|spec| {
            let view = file.tensor(&spec.name).map_err(|_| {
                format_error(
                    path,
                    format!(
                        "tensor '{}' ({}) is missing (a file of another model?)",
                        spec.name, spec.shape
                    ),
                )
            })?;
            let dtype = file_dtype(spec)?;
            if view.dtype() != dtype || view.shape() != spec.shape.dims() {
                return Err(format_error(
                    path,
                    format!(
                        "tensor '{}' is {:?} {:?}, but the model's is {}",
                        spec.name,
                        view.dtype(),
                        view.shape(),
                        spec.shape
                    ),
                ));
            }
            Ok(view.data())
        })
        .collect()
}

fn file_dtype(spec: &TensorSpec) -> Result<Dtype> {
    Ok(match spec.shape.dtype() {
        DType::F32 => Dtype::F32,
        DType::F16 => Dtype::F16,
        DType::BF16 => Dtype::BF16,
        DType::F64 => Dtype::F64,
        other => {
            return Err(Error::invalid(
                format!("checkpoint, tensor '{}'", spec.name),
                format!("no safetensors form for dtype {other}"),
            ));
        }
    })
}

fn io_error(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

fn format_error(path: &Path, e: impl std::fmt::Display) -> Error {
    Error::Format {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}
