//! How a session's synchronizes waited for the GPU on the server, for `REMORA_WAIT_TRACE=1`
//! (issue 12 §4): the waiters' own lines (`remora_shm::Waiter::trace`) say how the sockets
//! and rings waited, but a stream or event synchronize waits in two more places no waiter
//! sees: the brief poll of the connection thread (`Executor::poll_briefly`), answered inline
//! when the work ends within it, and otherwise a waiter thread (`crate::waiters`), which must
//! first be woken and get a core, then waits in the driver and replies. On a loaded
//! host that wake-up is where a deferred synchronize can lose its time; this line shows it.
//!
//! Nothing is measured unless tracing is on ([`remora_shm::tracing_waits`]); the line is
//! logged (target `remora::wait`, info) when the session ends.

use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use remora_shm::{WaitOutcome, WaitStats};

/// A session's synchronize figures (see the module's documentation).
#[derive(Debug, Default)]
pub(crate) struct SyncTrace {
    stats: Mutex<SyncStats>,
}

#[derive(Debug, Default, Clone, PartialEq)]
struct SyncStats {
    /// Synchronizes answered on the connection thread after the poll: `spun` counts them,
    /// `slept` the deferred ones; `took_us_log2` is the whole wait of both (poll, wake-up,
    /// driver and reply).
    took: WaitStats,
    /// The deferred synchronizes' time from the end of the poll to the waiter thread's
    /// start (its wake-up): `slept`, `slept_ns` and the histogram.
    wake: WaitStats,
    /// The deferred synchronizes' time on the waiter thread, up to the reply (the driver's
    /// wait, then what the call does after it).
    driver_ns: u64,
}

fn ns(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

impl SyncTrace {
    fn with(&self, f: impl FnOnce(&mut SyncStats)) {
        f(&mut self.stats.lock().unwrap_or_else(PoisonError::into_inner));
    }

    /// A synchronize answered inline, `took` after its poll began.
    pub(crate) fn inline(&self, took: Duration) {
        self.with(|s| s.took.count(WaitOutcome::Spun, took));
    }

    /// A synchronize sent to a waiter thread: it polled for `polled`, waited `wake` for the
    /// waiter thread to start it and spent `driver` there before its reply.
    pub(crate) fn deferred(&self, polled: Duration, wake: Duration, driver: Duration) {
        let took = polled + wake + driver;
        self.with(|s| {
            s.took.count(WaitOutcome::Slept, took);
            s.wake.count(WaitOutcome::Slept, wake);
            s.driver_ns = s.driver_ns.saturating_add(ns(driver));
        });
    }

    /// The log line's fields; `None` with nothing counted.
    fn summary(&self) -> Option<Summary> {
        let s = self
            .stats
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone();
        if s.took.spun + s.took.slept == 0 {
            return None;
        }
        let mean = |ns: u64, n: u64| {
            if n == 0 {
                0.0
            } else {
                ns as f64 / n as f64 / 1e3
            }
        };
        Some(Summary {
            inline: s.took.spun,
            deferred: s.took.slept,
            inline_mean_us: mean(s.took.spun_ns, s.took.spun),
            deferred_mean_us: mean(s.took.slept_ns, s.took.slept),
            wake_mean_us: mean(s.wake.slept_ns, s.wake.slept),
            driver_mean_us: mean(s.driver_ns, s.took.slept),
            took_us: s.took.histogram(),
            wake_us: s.wake.histogram(),
        })
    }
}

#[derive(Debug, PartialEq)]
struct Summary {
    inline: u64,
    deferred: u64,
    inline_mean_us: f64,
    deferred_mean_us: f64,
    wake_mean_us: f64,
    driver_mean_us: f64,
    took_us: String,
    wake_us: String,
}

impl Drop for SyncTrace {
    fn drop(&mut self) {
        let Some(s) = self.summary() else {
            return;
        };
        tracing::info!(
            target: "remora::wait",
            waiter = "server: synchronize",
            inline = s.inline,
            deferred = s.deferred,
            inline_mean_us = s.inline_mean_us,
            deferred_mean_us = s.deferred_mean_us,
            wake_mean_us = s.wake_mean_us,
            driver_mean_us = s.driver_mean_us,
            took_us = %s.took_us,
            wake_us = %s.wake_us,
            "waits"
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn counts_inline_and_deferred_synchronizes_apart() {
        let us = Duration::from_micros;
        let t = SyncTrace::default();
        assert_eq!(t.summary(), None, "nothing counted, nothing logged");
        t.inline(us(10));
        t.inline(us(30));
        t.deferred(us(50), us(300), us(100));
        let s = t.summary().unwrap();
        assert_eq!((s.inline, s.deferred), (2, 1));
        assert!((s.inline_mean_us - 20.0).abs() < 1e-9);
        assert!((s.deferred_mean_us - 450.0).abs() < 1e-9);
        assert!((s.wake_mean_us - 300.0).abs() < 1e-9);
        assert!((s.driver_mean_us - 100.0).abs() < 1e-9);
        // 10 µs in [8, 16), 30 in [16, 32), 450 in [256, 512); the wake-up in [256, 512).
        assert_eq!(s.took_us, "<16:1 <32:1 <512:1");
        assert_eq!(s.wake_us, "<512:1");
    }
}
