//! ONNX: parse any bytes as a model and, when they parse, import the model with
//! every symbolic dim bound to 2. Parsing and import must answer `Ok` or `Err`:
//! never panic, abort, run out of memory or hang.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rlx_onnx::{ImportOptions, OnnxModel};

fuzz_target!(|data: &[u8]| {
    // No base directory: external data is an error, never a file read.
    let Ok(model) = OnnxModel::from_bytes(data, None, "fuzz.onnx") else {
        return;
    };
    let _ = model.opset();
    for v in model.inputs().iter().chain(&model.outputs()) {
        let _ = v.to_string();
    }
    let mut options = ImportOptions::new();
    for symbol in model.symbols() {
        options = options.symbol(symbol, 2);
    }
    if let Ok(imported) = model.import(&options) {
        let _ = imported.graph.len();
    }
});
