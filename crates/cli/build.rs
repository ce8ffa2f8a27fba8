//! Records the commit this `remora` was built from (`REMORA_BUILD_COMMIT`, empty outside a git
//! checkout), so that benchmark reports and `remora --version` name it without being told
//! (`REMORA_COMMIT` still wins in reports when set). A build from a tree whose sources differ
//! from that commit (tracked files under `crates/`, `Cargo.toml`, `Cargo.lock`) names it with
//! `+dirty` (`abc1234+dirty`), so that a measurement of uncommitted code never passes for the
//! commit.

use std::path::PathBuf;
use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
}

fn main() {
    let manifest = PathBuf::from(std::env::var("CARGO_MANIFEST_DIR").unwrap_or_default());
    let root = manifest.join("../..").canonicalize().unwrap_or(manifest);
    let sources = [
        root.join("crates"),
        root.join("Cargo.toml"),
        root.join("Cargo.lock"),
    ];
    let mut commit = git(&["rev-parse", "--short=7", "HEAD"]).unwrap_or_default();
    if !commit.is_empty() {
        let mut args = vec![
            "status".to_string(),
            "--porcelain".into(),
            "--untracked-files=no".into(),
            "--".into(),
        ];
        args.extend(sources.iter().map(|p| p.display().to_string()));
        let args: Vec<&str> = args.iter().map(String::as_str).collect();
        if git(&args).is_some() {
            commit.push_str("+dirty");
        }
    }
    println!("cargo:rustc-env=REMORA_BUILD_COMMIT={commit}");
    // `remora --version`: "0.1.0 (abc1234)", "0.1.0 (abc1234+dirty)", or the bare version
    // outside a checkout.
    let version = std::env::var("CARGO_PKG_VERSION").unwrap_or_default();
    let line = if commit.is_empty() {
        version
    } else {
        format!("{version} ({commit})")
    };
    println!("cargo:rustc-env=REMORA_VERSION_LINE={line}");
    // Built again when HEAD moves: HEAD itself, the branch it names, packed refs. Only files
    // that exist: a missing one would make cargo run this script, and build the crate, every
    // time.
    if let Some(dir) = git(&["rev-parse", "--git-dir"]).map(PathBuf::from) {
        let common = git(&["rev-parse", "--git-common-dir"]).map_or(dir.clone(), PathBuf::from);
        let mut watch = vec![dir.join("HEAD"), common.join("packed-refs")];
        if let Some(head) = git(&["symbolic-ref", "-q", "HEAD"]) {
            watch.push(common.join(head));
        }
        for f in watch.iter().filter(|f| f.exists()) {
            println!("cargo:rerun-if-changed={}", f.display());
        }
    }
    // And again when a source changes (whether it makes the tree dirty or clean again).
    for p in sources.iter().filter(|p| p.exists()) {
        println!("cargo:rerun-if-changed={}", p.display());
    }
    println!("cargo:rerun-if-changed=build.rs");
}
