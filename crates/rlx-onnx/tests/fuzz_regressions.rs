//! Inputs the fuzzer (fuzz/, `scripts/fuzz.sh onnx`) found to panic the importer:
//! each must now parse-and-import to an error, as the fuzz target drives it (every
//! symbolic dim bound to 2).

use rlx_onnx::{ImportOptions, OnnxModel};

fn import(bytes: &[u8]) -> rlx_ir::Result<()> {
    let model = OnnxModel::from_bytes(bytes, None, "fuzz.onnx")?;
    let mut options = ImportOptions::new();
    for symbol in model.symbols() {
        options = options.symbol(symbol, 2);
    }
    model.import(&options).map(|_| ())
}

fn assert_error(bytes: &[u8], expected: &str) {
    let message = import(bytes)
        .expect_err("the input must be rejected")
        .to_string();
    assert!(
        message.contains(expected),
        "the error should mention '{expected}': {message}"
    );
}

/// `Attention` with a 3-D Q and a V whose shape has an unknown dim (so rank 2
/// once bound) indexed V's third dim.
#[test]
fn attention_with_v_of_lower_rank() {
    assert_error(
        include_bytes!("data/fuzz/attention_v_rank2.onnx"),
        "Attention",
    );
}

/// `AveragePool` with `ceil_mode` and a stride of 0 divided by the stride.
#[test]
fn pool_with_a_zero_stride() {
    assert_error(
        include_bytes!("data/fuzz/averagepool_zero_stride.onnx"),
        "stride",
    );
}
