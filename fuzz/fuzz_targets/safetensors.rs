//! safetensors: parse any bytes as a safetensors image and, when they parse, read
//! every tensor at its declared shape (and at a wrong one).
#![no_main]

use libfuzzer_sys::fuzz_target;
use rlx_models::SafeTensorsFile;

fuzz_target!(|data: &[u8]| {
    let Ok(file) = SafeTensorsFile::from_bytes("fuzz.safetensors", data.to_vec()) else {
        return;
    };
    let _ = format!("{file:?}");
    // The loader does not expose shapes (callers name the shape they expect), so
    // take them from the header as the safetensors crate reads it.
    let Ok((_, metadata)) = safetensors::SafeTensors::read_metadata(data) else {
        panic!("SafeTensorsFile accepted a header the safetensors crate rejects");
    };
    let names: Vec<String> = file.names().map(str::to_string).collect();
    for name in &names {
        assert!(file.contains(name));
        let info = metadata.info(name).expect("every name has an info");
        if let Ok(view) = file.tensor(name, &info.shape) {
            let count: usize = view.dims.iter().product();
            assert_eq!(view.bytes.len(), count * view.dtype.size_in_bytes());
        }
        let mut wrong = info.shape.clone();
        wrong.push(1);
        assert!(file.tensor(name, &wrong).is_err());
    }
    assert!(file.tensor("\u{0}missing", &[]).is_err());
});
