//! Logging: tracing to stderr, filtered by `REMORA_LOG` (default `warn`).

use std::sync::Once;

/// Installs the subscriber once (a host program's own subscriber wins).
pub(crate) fn init() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_env("REMORA_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let _ = tracing_subscriber::fmt()
            .with_env_filter(filter)
            .with_writer(std::io::stderr)
            .with_target(false)
            .with_ansi(colours())
            .try_init();
    });
}

/// Whether the log on standard error gets ANSI colours: only on a terminal, and not when
/// NO_COLOR is set (to anything but the empty string, as no-color.org asks).
fn colours() -> bool {
    std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

struct Alive;

impl Drop for Alive {
    fn drop(&mut self) {}
}

thread_local! {
    static ALIVE: Alive = const { Alive };
}

/// Whether this thread may log: false once its thread-local storage is being destroyed (the
/// CUDA runtime calls the driver from exit handlers, after the main thread's thread-local
/// destructors ran, and the log subscriber's thread-local buffer is gone by then).
pub(crate) fn usable() -> bool {
    ALIVE.try_with(|_| ()).is_ok()
}
