//! What the generated stubs do: CUDA_ERROR_NOT_SUPPORTED, with the name logged once.

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
    if first && crate::log::usable() {
        crate::log::init();
        LOG_LINES.fetch_add(1, Ordering::Relaxed);
        let name = STUBS.get(index).copied().unwrap_or("?");
        // Never unwinds out of the extern "C" stub (logging from an exit handler can panic).
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
        let i = STUBS.iter().position(|s| *s == "cuGraphCreate").unwrap();
        let before = log_lines();
        assert_eq!(crate::generated::stubs::cuGraphCreate(), NOT_SUPPORTED);
        assert_eq!(log_lines(), before + 1);
        assert_eq!(not_supported(i), NOT_SUPPORTED);
        assert_eq!(crate::generated::stubs::cuGraphCreate(), NOT_SUPPORTED);
        assert_eq!(log_lines(), before + 1);
    }
}
