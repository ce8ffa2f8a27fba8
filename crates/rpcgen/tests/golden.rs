//! Golden tests: each `tests/golden/*.x` must generate exactly `tests/golden/*.rs`.
//! Run with `UPDATE_GOLDEN=1` to rewrite the expected files.

use std::path::Path;

#[test]
fn golden_files_match() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden");
    let update = std::env::var_os("UPDATE_GOLDEN").is_some_and(|v| v == "1");
    let mut inputs: Vec<_> = std::fs::read_dir(&dir)
        .expect("golden dir")
        .map(|e| e.expect("entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "x"))
        .collect();
    inputs.sort();
    assert!(!inputs.is_empty());
    let mut failures = Vec::new();
    for x in &inputs {
        let code = remora_rpcgen::Generator::new()
            .generate_file(x)
            .unwrap_or_else(|e| panic!("{e}"));
        let expected_path = x.with_extension("rs");
        if update {
            std::fs::write(&expected_path, &code).expect("write golden");
            continue;
        }
        let expected = std::fs::read_to_string(&expected_path).unwrap_or_default();
        if expected != code {
            failures.push(expected_path.display().to_string());
        }
    }
    assert!(
        failures.is_empty(),
        "generated code differs from {failures:?}; rerun with UPDATE_GOLDEN=1 and review the diff"
    );
}
