//! Compile tests: generate crates and build them with one cargo invocation.
//!
//! * `tests/golden/gpuv.x` becomes a crate with `tests/fixtures/gpuv_roundtrip.rs` as its
//!   test (every generated type round-trips through XdrEncode/XdrDecode);
//! * every `.x` in `/usr/include/rpcsvc/` (Debian rpcsvc-proto) becomes a crate, generated
//!   with `-D RPC_HDR` as `rpcgen -h` does.
//!
//! All crates are members of one temporary workspace built by a single `cargo test
//! --offline` with a target directory kept under `CARGO_TARGET_TMPDIR`.

use std::path::{Path, PathBuf};
use std::process::Command;

use remora_rpcgen::{CrateOptions, generate_crate};

const CORPUS: &str = "/usr/include/rpcsvc";

#[test]
fn generated_crates_build_and_roundtrip() {
    let manifest = Path::new(env!("CARGO_MANIFEST_DIR"));
    let ws = tempfile::tempdir().expect("tempdir");
    let mut members = Vec::new();

    let gpuv = ws.path().join("gpuv");
    generate_crate(
        &CrateOptions::new(manifest.join("tests/golden/gpuv.x"), &gpuv).standalone(false),
    )
    .unwrap_or_else(|e| panic!("{e}"));
    std::fs::create_dir_all(gpuv.join("tests")).expect("mkdir");
    std::fs::copy(
        manifest.join("tests/fixtures/gpuv_roundtrip.rs"),
        gpuv.join("tests/roundtrip.rs"),
    )
    .expect("copy fixture");
    members.push("gpuv".to_owned());

    let corpus = Path::new(CORPUS);
    if corpus.is_dir() {
        let mut files: Vec<PathBuf> = std::fs::read_dir(corpus)
            .expect("read corpus")
            .map(|e| e.expect("entry").path())
            .filter(|p| p.extension().is_some_and(|e| e == "x"))
            .collect();
        files.sort();
        assert!(!files.is_empty(), "{CORPUS} has no .x files");
        for f in &files {
            let stem = f.file_stem().expect("stem").to_string_lossy().into_owned();
            let dir = ws.path().join(format!("rpcsvc-{stem}"));
            let report = generate_crate(
                &CrateOptions::new(f, &dir)
                    .define("RPC_HDR", None)
                    .crate_name(format!("rpcsvc-{}", stem.replace('_', "-")))
                    .standalone(false),
            )
            .unwrap_or_else(|e| panic!("generating {}: {e}", f.display()));
            assert!(report.sources.contains(f));
            members.push(format!("rpcsvc-{stem}"));
        }
    } else {
        eprintln!(
            "SKIPPED corpus part of the compile test: {CORPUS} does not exist (install Debian's rpcsvc-proto to run it)"
        );
    }

    let list = members
        .iter()
        .map(|m| format!("\"{m}\""))
        .collect::<Vec<_>>()
        .join(", ");
    std::fs::write(
        ws.path().join("Cargo.toml"),
        format!("[workspace]\nresolver = \"3\"\nmembers = [{list}]\n"),
    )
    .expect("write workspace");
    // Reuse this workspace's lock file so the offline build resolves the same versions.
    let lock = manifest.join("../../Cargo.lock");
    if lock.is_file() {
        std::fs::copy(&lock, ws.path().join("Cargo.lock")).expect("copy lock");
    }
    let target = Path::new(env!("CARGO_TARGET_TMPDIR")).join("rpcgen-compile");
    let out = Command::new(std::env::var("CARGO").unwrap_or_else(|_| "cargo".into()))
        .args(["test", "--offline", "--workspace", "-q"])
        .current_dir(ws.path())
        .env("CARGO_TARGET_DIR", &target)
        .env("RUSTFLAGS", "-D warnings")
        .output()
        .expect("run cargo");
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "cargo test in the generated workspace failed\n--- stdout\n{stdout}\n--- stderr\n{stderr}"
    );
    assert!(stdout.contains("every_type_roundtrips") || stdout.contains("test result: ok"));
}
