//! How a session's synchronizes waited for the GPU on the server, for `REMORA_WAIT_TRACE=1`
//! (issue 12 §4): the waiters' own lines (`remora_shm::Waiter::trace`) say how the sockets
//! and rings waited, but a stream or event synchronize waits in two more places no waiter
//! sees: the brief poll of the connection thread (`Executor::poll_briefly`), answered inline
//! when the work ends within it, and otherwise a waiter thread (`crate::waiters`), which must
//! first be woken and get a core, then waits in the driver and replies. On a loaded
//! host that wake-up is where a deferred synchronize can lose its time; this line shows it.
//!
//! The line also says how much of those times the threads ran and how much they waited
//! for a core (the poll: its thread's CPU clock, the rest of the poll counted as waiting,
//! since a poll never sleeps; the waiter thread: `/proc/thread-self/schedstat`, where the
//! kernel keeps it): a poll that missed
//! the end of the work while its thread ran the whole time says the GPU had not finished (an
//! empty kernel's end delayed by the GPU's time-slicing between contexts, say), where one
//! that waited for a core says the host did not let the thread look.
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
    /// Of the deferred synchronizes' polls, those whose thread's scheduler figures were read,
    /// and what the thread ran and waited for a core during them.
    poll_sched: SchedSum,
    /// The same for the deferred synchronizes' time on the waiter thread.
    driver_sched: SchedSum,
}

/// How long threads ran and waited for a core over a number of spans.
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub(crate) struct SchedSum {
    spans: u64,
    on_cpu_ns: u64,
    runq_ns: u64,
}

impl SchedSum {
    fn add(&mut self, d: Option<Sched>) {
        if let Some(d) = d {
            self.spans += 1;
            self.on_cpu_ns = self.on_cpu_ns.saturating_add(d.on_cpu_ns);
            self.runq_ns = self.runq_ns.saturating_add(d.runq_ns);
        }
    }

    /// Mean µs a span ran and waited for a core; zeros without a span.
    fn means(&self) -> (f64, f64) {
        if self.spans == 0 {
            return (0.0, 0.0);
        }
        let n = self.spans as f64 * 1e3;
        (self.on_cpu_ns as f64 / n, self.runq_ns as f64 / n)
    }
}

/// The calling thread's scheduler figures (`/proc/thread-self/schedstat`): nanoseconds it
/// has run and waited on a run queue. `None` where the kernel keeps no schedstat.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Sched {
    on_cpu_ns: u64,
    runq_ns: u64,
}

impl Sched {
    /// The calling thread's figures now.
    pub(crate) fn now() -> Option<Self> {
        parse_schedstat(&std::fs::read_to_string("/proc/thread-self/schedstat").ok()?)
    }

    /// A span of `wall` of which the calling thread ran from `cpu_before`
    /// ([`thread_cpu`]) on, the rest counted as waiting for a core: for a span in which the
    /// thread never blocks (a poll), where reading `schedstat` twice would cost more than
    /// the span's own looks.
    pub(crate) fn polled(wall: Duration, cpu_before: Duration) -> Self {
        let ran = thread_cpu().saturating_sub(cpu_before).min(wall);
        Self {
            on_cpu_ns: ns(ran),
            runq_ns: ns(wall - ran),
        }
    }

    /// What the thread ran and waited since `earlier` (both `None`-safe).
    pub(crate) fn since(earlier: Option<Self>) -> Option<Self> {
        let (a, b) = (earlier?, Self::now()?);
        Some(Self {
            on_cpu_ns: b.on_cpu_ns.saturating_sub(a.on_cpu_ns),
            runq_ns: b.runq_ns.saturating_sub(a.runq_ns),
        })
    }
}

/// The calling thread's CPU time (`CLOCK_THREAD_CPUTIME_ID`).
pub(crate) fn thread_cpu() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::ThreadCPUTime);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// A `schedstat` line ("on-CPU ns, run-queue ns, timeslices").
fn parse_schedstat(line: &str) -> Option<Sched> {
    let mut f = line.split_whitespace().map(str::parse::<u64>);
    Some(Sched {
        on_cpu_ns: f.next()?.ok()?,
        runq_ns: f.next()?.ok()?,
    })
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
    /// waiter thread to start it and spent `driver` there before its reply; `poll_sched` and
    /// `driver_sched`, what the polling and the waiter thread ran and waited for a core in
    /// those spans, where read.
    pub(crate) fn deferred(
        &self,
        polled: Duration,
        wake: Duration,
        driver: Duration,
        poll_sched: Option<Sched>,
        driver_sched: Option<Sched>,
    ) {
        let took = polled + wake + driver;
        self.with(|s| {
            s.took.count(WaitOutcome::Slept, took);
            s.wake.count(WaitOutcome::Slept, wake);
            s.driver_ns = s.driver_ns.saturating_add(ns(driver));
            s.poll_sched.add(poll_sched);
            s.driver_sched.add(driver_sched);
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
            poll: s.poll_sched.means(),
            driver: s.driver_sched.means(),
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
    /// The deferred synchronizes' polls: mean µs their thread ran and waited for a core.
    poll: (f64, f64),
    /// The same for their time on the waiter thread.
    driver: (f64, f64),
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
            missed_poll_cpu_mean_us = s.poll.0,
            missed_poll_runq_mean_us = s.poll.1,
            driver_cpu_mean_us = s.driver.0,
            driver_runq_mean_us = s.driver.1,
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
        t.deferred(us(50), us(300), us(100), None, None);
        let s = t.summary().unwrap();
        assert_eq!((s.inline, s.deferred), (2, 1));
        assert!((s.inline_mean_us - 20.0).abs() < 1e-9);
        assert!((s.deferred_mean_us - 450.0).abs() < 1e-9);
        assert!((s.wake_mean_us - 300.0).abs() < 1e-9);
        assert!((s.driver_mean_us - 100.0).abs() < 1e-9);
        // 10 µs in [8, 16), 30 in [16, 32), 450 in [256, 512); the wake-up in [256, 512).
        assert_eq!(s.took_us, "<16:1 <32:1 <512:1");
        assert_eq!(s.wake_us, "<512:1");
        assert_eq!((s.poll, s.driver), ((0.0, 0.0), (0.0, 0.0)), "none read");
    }

    #[test]
    fn scheduler_figures_are_summed_where_read() {
        let us = Duration::from_micros;
        let t = SyncTrace::default();
        let sched = |on_cpu_us: u64, runq_us: u64| {
            Some(Sched {
                on_cpu_ns: on_cpu_us * 1000,
                runq_ns: runq_us * 1000,
            })
        };
        // A poll that ran its 50 µs and missed, a waiter that ran 400 and queued 200; then
        // one whose figures could not be read, left out of the means.
        t.deferred(us(50), us(300), us(600), sched(50, 0), sched(400, 200));
        t.deferred(us(50), us(300), us(600), sched(30, 20), None);
        t.deferred(us(50), us(300), us(600), None, sched(200, 0));
        let s = t.summary().unwrap();
        assert_eq!(s.poll, (40.0, 10.0));
        assert_eq!(s.driver, (300.0, 100.0));
        assert_eq!(
            parse_schedstat("123456 7890 42\n"),
            Some(Sched {
                on_cpu_ns: 123456,
                runq_ns: 7890
            })
        );
        assert_eq!(parse_schedstat("123"), None);
        assert_eq!(parse_schedstat("x y z"), None);
    }

    #[test]
    fn a_threads_own_figures_grow_while_it_runs() {
        let Some(before) = Sched::now() else {
            eprintln!("skipped: this kernel's /proc has no schedstat");
            return;
        };
        let t0 = std::time::Instant::now();
        while t0.elapsed() < Duration::from_millis(20) {
            std::hint::spin_loop();
        }
        let d = Sched::since(Some(before)).expect("read again");
        assert!(d.on_cpu_ns >= 1_000_000, "{d:?}");
        assert_eq!(Sched::since(None), None);
        // A spin of 5 ms measured by the thread's CPU clock: it ran most of it.
        let (cpu0, t0) = (thread_cpu(), std::time::Instant::now());
        while t0.elapsed() < Duration::from_millis(5) {
            std::hint::spin_loop();
        }
        let p = Sched::polled(t0.elapsed(), cpu0);
        assert!(p.on_cpu_ns + p.runq_ns >= 5_000_000, "{p:?}");
        assert!(p.on_cpu_ns > 0, "{p:?}");
    }
}
