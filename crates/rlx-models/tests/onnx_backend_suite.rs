//! The ONNX backend tests (onnx 1.22.0: the node tests, the models converted from
//! PyTorch and the small multi-node models; fetched into the cache on first use) run
//! against the committed list of tests expected to pass: a listed test that stops
//! passing fails this test; tests that newly pass are reported so the list can grow.

use rlx_models::ModelStore;
use rlx_models::onnx::conformance::{ONNX_BACKEND_TESTS, Outcome, discover, run_case};
use std::collections::BTreeSet;

#[test]
fn onnx_backend_suite_keeps_every_expected_pass() {
    let store = ModelStore::from_env().expect("cache directory").quiet(true);
    let root = store
        .fetch(&ONNX_BACKEND_TESTS)
        .expect("fetch the onnx backend tests");
    let listed = include_str!("data/onnx_backend_expected_pass.txt");
    let expected: BTreeSet<&str> = listed
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .collect();
    let dirs = discover(&[root]).expect("list the tests");
    assert!(
        dirs.len() >= 1765 + 82 + 35 + 23,
        "only {} tests found",
        dirs.len()
    );
    let mut regressions = Vec::new();
    let mut newly = Vec::new();
    let mut passed = 0;
    for dir in &dirs {
        let r = run_case(dir);
        let listed = expected.contains(r.name.as_str());
        match (&r.outcome, listed) {
            (Outcome::Pass, true) => passed += 1,
            (Outcome::Pass, false) => {
                passed += 1;
                newly.push(r.name.clone());
            }
            (_, true) => regressions.push(r.line()),
            (_, false) => {}
        }
    }
    let found: BTreeSet<String> = dirs
        .iter()
        .filter_map(|d| d.file_name().map(|n| n.to_string_lossy().into_owned()))
        .collect();
    let missing: Vec<&&str> = expected.iter().filter(|n| !found.contains(**n)).collect();
    println!("onnx backend tests: {passed} of {} pass", dirs.len());
    if !newly.is_empty() {
        println!("newly passing (add them to tests/data/onnx_backend_expected_pass.txt):");
        for n in &newly {
            println!("  {n}");
        }
    }
    assert!(
        missing.is_empty(),
        "listed tests not in the suite: {missing:?}"
    );
    assert!(
        regressions.is_empty(),
        "{} listed tests no longer pass:\n{}",
        regressions.len(),
        regressions.join("\n")
    );
}
