//! Helpers shared by the `remora` binary's integration tests.
#![allow(unreachable_pub)]

use std::path::{Path, PathBuf};

/// Remora's shim `libcuda.so` built beside the `remora` binary under test, if any. `cargo
/// test` refreshes the cdylib under deps/ but may leave an older copy beside the binaries:
/// the newest of the two.
pub fn shim() -> Option<PathBuf> {
    let target = Path::new(env!("CARGO_BIN_EXE_remora")).parent()?;
    [target.join("libcuda.so"), target.join("deps/libcuda.so")]
        .into_iter()
        .filter_map(|p| Some((std::fs::metadata(&p).ok()?.modified().ok()?, p)))
        .max()
        .map(|(_, p)| p)
}
