//! The ONNX protobuf messages (`ModelProto`, `GraphProto`, `NodeProto`, ...), decoded
//! with `prost`. `onnx.rs` is generated from the schema by `tools/onnx-proto-gen`
//! and committed, so building needs no `protoc`.

#![allow(missing_docs, clippy::all)]

include!("onnx.rs");

/// A sequence value as `onnx-data.proto` stores one (the ONNX backend tests keep
/// sequence inputs and outputs in this form). Written by hand: only the fields for a
/// sequence of tensors.
#[derive(Clone, PartialEq, ::prost::Message)]
pub struct SequenceProto {
    #[prost(string, optional, tag = "1")]
    pub name: ::core::option::Option<::prost::alloc::string::String>,
    /// What the elements are: 1 for tensors (0 undefined, 2 sparse tensors, 3
    /// sequences, 4 maps, 5 optionals).
    #[prost(int32, optional, tag = "2")]
    pub elem_type: ::core::option::Option<i32>,
    #[prost(message, repeated, tag = "3")]
    pub tensor_values: ::prost::alloc::vec::Vec<TensorProto>,
}
