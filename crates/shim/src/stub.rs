//! What the generated stubs do: CUDA_ERROR_NOT_SUPPORTED, with the name logged once.
//!
//! # Where the stub table comes from
//!
//! The shim exports every `cu*` entry point of CUDA 13.0's headers. build.rs reads two
//! declared lists and reads no Rust source:
//!
//! - `src/entry_points.txt`, generated from the headers by `tools/list-entry-points.py`:
//!   every name ([`ALL`](crate::generated::ALL)) and the cuGetProcAddress versions
//!   ([`PROC_TABLE`](crate::generated::PROC_TABLE));
//! - `src/implemented.txt`, written by hand: the names `src/exports` defines
//!   ([`IMPLEMENTED`](crate::generated::IMPLEMENTED)). build.rs rejects a name cuda.h does
//!   not declare and a name listed twice.
//!
//! Every other name becomes a `#[no_mangle]` stub in [`crate::generated::stubs`] (listed in
//! [`STUBS`], whose index is the stub's argument to [`not_supported`]), and
//! [`symbol_address`](crate::generated::symbol_address), which cuGetProcAddress resolves
//! through, names `crate::exports::NAME` or `stubs::NAME` for each. The compiler checks the
//! hand-written list against the code both ways:
//!
//! - a listed name that `src/exports` does not define fails to resolve in `symbol_address`;
//! - an export that is not listed gets a stub too, and the two `#[no_mangle]` definitions
//!   clash: rustc stops with "symbol `cuName` is already defined", quoting the stub's line,
//!   which says to list the name.
//!
//! `tests/coverage.rs` checks that the built `libcuda.so` exports exactly the names of
//! [`ALL`](crate::generated::ALL), and renders `docs/shim-coverage.md` from these tables.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use crate::generated::STUBS;

const NOT_SUPPORTED: i32 = 801;

static LOGGED: [AtomicBool; 1024] = [const { AtomicBool::new(false) }; 1024];
static LOG_LINES: AtomicUsize = AtomicUsize::new(0);

/// The body of stub `index` (into [`STUBS`]).
pub fn not_supported(index: usize) -> i32 {
    let first = LOGGED
        .get(index)
        .is_some_and(|f| !f.swap(true, Ordering::Relaxed));
    if first {
        crate::log::init();
        LOG_LINES.fetch_add(1, Ordering::Relaxed);
        let name = STUBS.get(index).copied().unwrap_or("?");
        // Never unwinds out of the extern "C" stub.
        let _ = std::panic::catch_unwind(|| {
            tracing::warn!(
                "remora: {name} is not implemented by the Remora shim yet; returning CUDA_ERROR_NOT_SUPPORTED"
            )
        });
    }
    NOT_SUPPORTED
}

/// How many stub log lines were written (for tests).
pub fn log_lines() -> usize {
    LOG_LINES.load(Ordering::Relaxed)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stubs_fit_and_log_once() {
        assert!(STUBS.len() <= LOGGED.len());
        let i = STUBS
            .iter()
            .position(|s| *s == "cuGraphAddBatchMemOpNode")
            .unwrap();
        let before = log_lines();
        assert_eq!(
            crate::generated::stubs::cuGraphAddBatchMemOpNode(),
            NOT_SUPPORTED
        );
        assert_eq!(log_lines(), before + 1);
        assert_eq!(not_supported(i), NOT_SUPPORTED);
        assert_eq!(
            crate::generated::stubs::cuGraphAddBatchMemOpNode(),
            NOT_SUPPORTED
        );
        assert_eq!(log_lines(), before + 1);
    }
}
