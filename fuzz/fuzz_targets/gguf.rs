//! GGUF: parse any bytes as a GGUF image and, when they parse, read every metadata
//! value through each typed getter and every tensor's bytes and `f32` values.
#![no_main]

use libfuzzer_sys::fuzz_target;
use rlx_gguf::GgufFile;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = GgufFile::from_bytes("fuzz.gguf", data.to_vec()) else {
        return;
    };
    let _ = (file.version(), file.alignment(), format!("{file:?}"));
    for (key, value) in file.metadata() {
        let _ = value.value_type();
        let _ = file.get_u64(key);
        let _ = file.get_usize(key);
        let _ = file.get_f64(key);
        let _ = file.get_bool(key);
        let _ = file.get_str(key);
        let _ = file.get_str_array(key);
        let _ = file.get_i64_array(key);
    }
    for t in file.tensors() {
        let _ = (t.num_elements(), t.row_major_dims(), t.ty.to_string());
        let bytes = file
            .tensor_bytes(&t.name)
            .expect("a parsed tensor lies inside the file");
        assert_eq!(bytes.len(), t.byte_len);
        if let Ok(values) = file.tensor_f32(&t.name) {
            assert_eq!(values.len(), t.num_elements());
        }
    }
});
