//! The ONNX backend-test format: a directory with `model.onnx` and
//! `test_data_set_*/input_*.pb` + `output_*.pb` (serialized `TensorProto`s, or
//! `SequenceProto`s for sequence values). Each test is imported with its inputs'
//! shapes, run on the CPU and compared with the expected outputs (rtol 1e-3, atol
//! 1e-7, unless the test's `data.json` says otherwise). A sequence is given and
//! returned one tensor per element (`name[0]`, `name[1]`, ...).

use super::OnnxSession;
use crate::PackagedModel;
use prost::Message;
use rlx_ir::{Error, Result, TensorData};
use rlx_onnx::proto::{SequenceProto, TensorProto};
use rlx_onnx::{OnnxModel, Tensor, ValueInfo, decode_tensor, sequence_item_name};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The ONNX backend tests: the `onnx` package's `backend/test/data` directory,
/// fetched into the cache like a model. It holds the node tests (`node/`, 1765 in
/// this version), models converted from PyTorch modules (`pytorch-converted/`,
/// `pytorch-operator/`) and small multi-node models (`simple/`); `discover` over it
/// finds them all.
pub const ONNX_BACKEND_TESTS: PackagedModel = PackagedModel {
    name: "onnx-backend-tests",
    package: "onnx",
    version: "1.22.0",
    dir_in_wheel: "onnx/backend/test/data",
    required: &[
        "node/test_abs/model.onnx",
        "node/test_add/test_data_set_0/input_0.pb",
        "pytorch-converted/test_Conv3d/model.onnx",
        "pytorch-operator/test_operator_add_broadcast/model.onnx",
        "simple/test_sequence_model1/model.onnx",
    ],
    description: "the ONNX backend tests of onnx 1.22.0",
    generation: &[],
};

/// How one test ended.
#[derive(Clone, Debug, PartialEq)]
pub enum Outcome {
    /// Every output matched.
    Pass,
    /// It ran and disagreed, or failed for a reason other than missing support.
    Fail(String),
    /// It uses something RLX does not import or run.
    Unsupported(String),
}

/// One test's result.
#[derive(Clone, Debug, PartialEq)]
pub struct CaseResult {
    /// The test directory's name.
    pub name: String,
    /// How it ended.
    pub outcome: Outcome,
}

impl CaseResult {
    /// The line printed for it: `PASS name`, `FAIL name: reason`, `UNSUPPORTED name: reason`.
    pub fn line(&self) -> String {
        match &self.outcome {
            Outcome::Pass => format!("PASS {}", self.name),
            Outcome::Fail(r) => format!("FAIL {}: {}", self.name, one_line(r)),
            Outcome::Unsupported(r) => format!("UNSUPPORTED {}: {}", self.name, one_line(r)),
        }
    }
}

fn one_line(s: &str) -> String {
    s.replace('\n', " ")
}

/// Every test directory under `roots` (a root that holds `model.onnx` is a test
/// itself), sorted by path.
pub fn discover(roots: &[PathBuf]) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for root in roots {
        if !root.is_dir() {
            return Err(Error::Io {
                path: root.display().to_string(),
                message: "not a directory".into(),
            });
        }
        walk(root, 0, &mut out)?;
    }
    out.sort();
    Ok(out)
}

fn walk(dir: &Path, depth: usize, out: &mut Vec<PathBuf>) -> Result<()> {
    if dir.join("model.onnx").is_file() {
        out.push(dir.to_path_buf());
        return Ok(());
    }
    if depth > 8 {
        return Ok(());
    }
    let entries = std::fs::read_dir(dir).map_err(|e| io(dir, e))?;
    for entry in entries {
        let path = entry.map_err(|e| io(dir, e))?.path();
        if path.is_dir() {
            walk(&path, depth + 1, out)?;
        }
    }
    Ok(())
}

fn io(path: &Path, e: std::io::Error) -> Error {
    Error::Io {
        path: path.display().to_string(),
        message: e.to_string(),
    }
}

/// The tolerances a test asks for.
fn tolerances(dir: &Path) -> (f64, f64) {
    let (mut rtol, mut atol) = (1e-3, 1e-7);
    if let Ok(text) = std::fs::read_to_string(dir.join("data.json"))
        && let Ok(v) = serde_json::from_str::<serde_json::Value>(&text)
    {
        rtol = v.get("rtol").and_then(|x| x.as_f64()).unwrap_or(rtol);
        atol = v.get("atol").and_then(|x| x.as_f64()).unwrap_or(atol);
    }
    (rtol, atol)
}

fn read_tensor(path: &Path) -> Result<Tensor> {
    let bytes = std::fs::read(path).map_err(|e| io(path, e))?;
    let proto = TensorProto::decode(bytes.as_slice()).map_err(|e| Error::Format {
        path: path.display().to_string(),
        message: format!("not a TensorProto: {e}"),
    })?;
    decode_tensor(&proto, path.parent(), &path.display().to_string())
}

/// The elements of a serialized `SequenceProto` of tensors.
fn read_sequence(path: &Path) -> Result<Vec<Tensor>> {
    let bytes = std::fs::read(path).map_err(|e| io(path, e))?;
    let proto = SequenceProto::decode(bytes.as_slice()).map_err(|e| Error::Format {
        path: path.display().to_string(),
        message: format!("not a SequenceProto: {e}"),
    })?;
    if !matches!(proto.elem_type, None | Some(0) | Some(1)) {
        return Err(Error::Unsupported {
            device: "onnx import".into(),
            what: format!("a sequence of element kind {:?}", proto.elem_type),
        });
    }
    proto
        .tensor_values
        .iter()
        .enumerate()
        .map(|(i, t)| decode_tensor(t, path.parent(), &format!("{}[{i}]", path.display())))
        .collect()
}

/// The values in `files` for the declared `values` (in order), named as a run takes
/// and returns them: a tensor by its name, a sequence's elements as `name[i]`.
fn read_values(values: &[ValueInfo], files: &[PathBuf]) -> Result<Vec<(String, Tensor)>> {
    let mut out = Vec::new();
    for (v, file) in values.iter().zip(files) {
        if v.sequence_of.is_some() {
            for (i, t) in read_sequence(file)?.into_iter().enumerate() {
                out.push((sequence_item_name(&v.name, i), t));
            }
        } else {
            out.push((v.name.clone(), read_tensor(file)?));
        }
    }
    Ok(out)
}

/// The numbered files `prefix_0.pb`, `prefix_1.pb`, ... in `dir`.
fn numbered(dir: &Path, prefix: &str) -> Vec<PathBuf> {
    (0..)
        .map(|i| dir.join(format!("{prefix}_{i}.pb")))
        .take_while(|p| p.is_file())
        .collect()
}

/// Runs one test directory on the CPU.
pub fn run_case(dir: &Path) -> CaseResult {
    run_case_on(dir, rlx_driver::Device::Cpu)
}

/// Runs one test directory on `device`.
pub fn run_case_on(dir: &Path, device: rlx_driver::Device) -> CaseResult {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| dir.display().to_string());
    let outcome = match try_case(dir, device) {
        Ok(None) => Outcome::Pass,
        Ok(Some(reason)) => Outcome::Fail(reason),
        Err(Error::Unsupported { what, .. }) => Outcome::Unsupported(what),
        Err(e) => Outcome::Fail(e.to_string()),
    };
    CaseResult { name, outcome }
}

/// `Ok(None)` when every data set matched, `Ok(Some(why))` on a mismatch.
fn try_case(dir: &Path, device: rlx_driver::Device) -> Result<Option<String>> {
    let model = OnnxModel::load(dir.join("model.onnx"))?;
    let declared = model.inputs();
    let declared_outputs = model.outputs();
    let supported = |v: &&ValueInfo| v.dtype.is_some() || v.sequence_of.is_some();
    if let Some(v) = declared.iter().find(|v| !supported(v)) {
        return Err(Error::Unsupported {
            device: "onnx import".into(),
            what: format!("input '{}' of type {}", v.name, v.type_name),
        });
    }
    if let Some(v) = declared_outputs.iter().find(|v| !supported(v)) {
        return Err(Error::Unsupported {
            device: "onnx import".into(),
            what: format!("output '{}' of type {}", v.name, v.type_name),
        });
    }
    let (rtol, atol) = tolerances(dir);
    let mut sets: Vec<PathBuf> = std::fs::read_dir(dir)
        .map_err(|e| io(dir, e))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| {
            p.is_dir()
                && p.file_name()
                    .is_some_and(|n| n.to_string_lossy().starts_with("test_data_set_"))
        })
        .collect();
    sets.sort();
    if sets.is_empty() {
        return Err(Error::invalid(
            dir.display().to_string(),
            "no test_data_set_* directory",
        ));
    }
    let mut session = OnnxSession::on_device(model, device, rlx_runtime::CompileOptions::new());
    for set in sets {
        let input_files = numbered(&set, "input");
        let output_files = numbered(&set, "output");
        if input_files.len() != declared.len() {
            return Err(Error::invalid(
                set.display().to_string(),
                format!(
                    "{} input files for {} model inputs",
                    input_files.len(),
                    declared.len()
                ),
            ));
        }
        if output_files.len() != declared_outputs.len() {
            return Err(Error::invalid(
                set.display().to_string(),
                format!(
                    "{} output files for {} model outputs",
                    output_files.len(),
                    declared_outputs.len()
                ),
            ));
        }
        let inputs = read_values(&declared, &input_files)?;
        let expected = read_values(&declared_outputs, &output_files)?;
        let named: Vec<(&str, &Tensor)> = inputs.iter().map(|(n, t)| (n.as_str(), t)).collect();
        let got = session.run(&named, &BTreeMap::new())?;
        if got.len() != expected.len() {
            return Ok(Some(format!(
                "{} outputs, expected {}",
                got.len(),
                expected.len()
            )));
        }
        for (k, ((name, g), (want_name, e))) in got.iter().zip(&expected).enumerate() {
            if name != want_name {
                return Ok(Some(format!(
                    "output {k} is '{name}', expected '{want_name}'"
                )));
            }
            if let Some(why) = compare(g, e, rtol, atol) {
                return Ok(Some(format!("output {k} ('{name}'): {why}")));
            }
        }
    }
    Ok(None)
}

/// Why `got` is not close to `want`, or `None` when it is (numpy `assert_allclose`
/// semantics: NaN equals NaN, infinities must match exactly).
pub fn compare(got: &Tensor, want: &Tensor, rtol: f64, atol: f64) -> Option<String> {
    if got.dims != want.dims {
        return Some(format!("dims {:?}, expected {:?}", got.dims, want.dims));
    }
    if got.data.dtype() != want.data.dtype() {
        return Some(format!(
            "dtype {}, expected {}",
            got.data.dtype(),
            want.data.dtype()
        ));
    }
    let exact = !matches!(
        want.data,
        TensorData::F32(_) | TensorData::F64(_) | TensorData::F16(_) | TensorData::BF16(_)
    );
    if exact {
        let (g, w) = (got.to_i64_vec(), want.to_i64_vec());
        return g
            .iter()
            .zip(&w)
            .position(|(a, b)| a != b)
            .map(|i| format!("element {i} is {}, expected {}", g[i], w[i]));
    }
    let (g, w) = (got.to_f64_vec(), want.to_f64_vec());
    let mut worst: Option<(usize, f64)> = None;
    let mut bad = 0usize;
    for (i, (&a, &b)) in g.iter().zip(&w).enumerate() {
        let ok = if a.is_nan() || b.is_nan() {
            a.is_nan() && b.is_nan()
        } else if a.is_infinite() || b.is_infinite() {
            a == b
        } else {
            (a - b).abs() <= atol + rtol * b.abs()
        };
        if !ok {
            bad += 1;
            let err = (a - b).abs();
            if worst.is_none_or(|(_, e)| err > e || err.is_nan()) {
                worst = Some((i, err));
            }
        }
    }
    worst.map(|(i, _)| {
        format!(
            "{bad} of {} elements differ; element {i} is {}, expected {}",
            g.len(),
            g[i],
            w[i]
        )
    })
}
