//! The ONNX protobuf messages (`ModelProto`, `GraphProto`, `NodeProto`, ...), decoded
//! with `prost`. `onnx.rs` is generated from the schema by `tools/onnx-proto-gen`
//! and committed, so building needs no `protoc`.

#![allow(missing_docs, clippy::all)]

include!("onnx.rs");
