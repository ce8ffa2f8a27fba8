//! Logging: tracing to stderr, filtered by `REMORA_LOG` (default `warn`).
//!
//! The CUDA runtime and libraries call the driver from exit handlers and thread-local
//! destructors, and the shim's own waiters' report runs from `atexit`. By then the thread's
//! locals may be gone, among them the buffer `tracing_subscriber`'s formatter writes each
//! line into (using it then panics). [`Guarded`] tells that apart and writes those lines
//! itself, so logging is safe on any thread at any time and no line is lost.

use std::cell::Cell;
use std::fmt::Write as _;
use std::io::Write as _;
use std::sync::Once;
use tracing::field::{Field, Visit};
use tracing::{Event, Subscriber, span};
use tracing_subscriber::layer::{Context, Layer, SubscriberExt as _};
use tracing_subscriber::util::SubscriberInitExt as _;

/// Installs the subscriber once (a host program's own subscriber wins).
pub(crate) fn init() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let filter = tracing_subscriber::EnvFilter::try_from_env("REMORA_LOG")
            .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn"));
        let fmt = tracing_subscriber::fmt::layer()
            .with_writer(std::io::stderr)
            .with_target(false)
            .with_ansi(colours());
        let _ = tracing_subscriber::registry()
            .with(filter)
            .with(Guarded(fmt))
            .try_init();
    });
}

/// Whether the log on standard error gets ANSI colours: only on a terminal, and not when
/// NO_COLOR is set (to anything but the empty string, as no-color.org asks).
fn colours() -> bool {
    std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

/// Where this thread's formatter stands: [`FRESH`], [`FORMATTING`] or [`GONE`]. A `Cell`
/// made at compile time has no destructor, so it can be read on any thread at any time.
const FRESH: u8 = 0;
/// The thread's [`Formatted`] marker exists, and so does its formatter's buffer.
const FORMATTING: u8 = 1;
/// The marker was destroyed: the buffer may be gone too.
const GONE: u8 = 2;

thread_local! {
    static STATE: Cell<u8> = const { Cell::new(FRESH) };
    static FORMATTED: Formatted = const { Formatted };
}

/// Made on a thread right after its formatter first wrote a line, and so after the
/// formatter's thread-local buffer: a thread's locals are destroyed in the reverse order
/// they were made, so this one goes first, and marks the thread [`GONE`] as it does.
struct Formatted;

impl Drop for Formatted {
    fn drop(&mut self) {
        let _ = STATE.try_with(|s| s.set(GONE));
    }
}

/// The formatting layer `L`, handed only events it can format: on a thread whose locals are
/// being (or have been) destroyed, [`write_plain`] writes the line instead.
struct Guarded<L>(L);

impl<S: Subscriber, L: Layer<S>> Layer<S> for Guarded<L> {
    // What spans carry is the formatter's as before (none of its span calls uses the
    // buffer): the lines inside a span show its fields.
    fn on_layer(&mut self, subscriber: &mut S) {
        self.0.on_layer(subscriber);
    }
    fn on_new_span(&self, attrs: &span::Attributes<'_>, id: &span::Id, ctx: Context<'_, S>) {
        self.0.on_new_span(attrs, id, ctx);
    }
    fn on_record(&self, id: &span::Id, values: &span::Record<'_>, ctx: Context<'_, S>) {
        self.0.on_record(id, values, ctx);
    }
    fn on_follows_from(&self, id: &span::Id, follows: &span::Id, ctx: Context<'_, S>) {
        self.0.on_follows_from(id, follows, ctx);
    }
    fn on_enter(&self, id: &span::Id, ctx: Context<'_, S>) {
        self.0.on_enter(id, ctx);
    }
    fn on_exit(&self, id: &span::Id, ctx: Context<'_, S>) {
        self.0.on_exit(id, ctx);
    }
    fn on_close(&self, id: span::Id, ctx: Context<'_, S>) {
        self.0.on_close(id, ctx);
    }
    fn on_id_change(&self, old: &span::Id, new: &span::Id, ctx: Context<'_, S>) {
        self.0.on_id_change(old, new, ctx);
    }

    fn on_event(&self, event: &Event<'_>, ctx: Context<'_, S>) {
        match STATE.try_with(Cell::get) {
            Ok(FORMATTING) => self.0.on_event(event, ctx),
            Ok(FRESH) => {
                self.0.on_event(event, ctx);
                // After the buffer that line made (a thread that never logged until its
                // locals were gone makes both anew, and they work).
                if FORMATTED.try_with(|_| ()).is_ok() {
                    let _ = STATE.try_with(|s| s.set(FORMATTING));
                }
            }
            _ => write_plain(event),
        }
    }
}

/// Writes `event` as one line, `LEVEL message field=value ...`, to standard error without
/// thread-local state.
fn write_plain(event: &Event<'_>) {
    struct Line(String);
    impl Visit for Line {
        fn record_debug(&mut self, field: &Field, value: &dyn std::fmt::Debug) {
            let _ = if field.name() == "message" {
                write!(self.0, " {value:?}")
            } else {
                write!(self.0, " {}={value:?}", field.name())
            };
        }
        fn record_str(&mut self, field: &Field, value: &str) {
            let _ = if field.name() == "message" {
                write!(self.0, " {value}")
            } else {
                write!(self.0, " {}={value:?}", field.name())
            };
        }
    }
    let mut line = Line(format!("{:>5}", event.metadata().level()));
    event.record(&mut line);
    line.0.push('\n');
    let _ = std::io::stderr().write_all(line.0.as_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A line logged from a thread's last destructor (as the CUDA runtime's teardown calls
    /// the driver) neither panics nor is lost.
    #[test]
    fn logging_from_a_dying_thread_is_safe() {
        struct LogsOnDrop;
        impl Drop for LogsOnDrop {
            fn drop(&mut self) {
                tracing::warn!(field = 7, "from a destructor");
            }
        }
        thread_local! {
            static LATE: LogsOnDrop = const { LogsOnDrop };
        }
        init();
        // Lines inside a span still format (the span's calls reach the formatter).
        tracing::warn_span!("a span", id = 3).in_scope(|| tracing::warn!("inside a span"));
        let t = std::thread::spawn(|| {
            // Made first, so destroyed after the formatter's buffer and the marker.
            LATE.with(|_| ());
            tracing::warn!("a first line, which makes the formatter's buffer");
            assert_eq!(STATE.with(Cell::get), FORMATTING);
        });
        assert!(t.join().is_ok(), "the thread panicked while logging");
    }
}
