//! Where a program's time goes on the client side: with `REMORA_CLIENT_PROFILE=1` (set by
//! `remora run --profile`), every remote call of the session is counted and timed by
//! procedure, and the shim prints the table on standard error when the program exits.
//!
//! A one-way call's time is what submitting it cost the program (queueing, or writing when
//! batching is off); a synchronous call's time is the whole round trip, including what the
//! server waited for (a synchronize waits for the GPU). The managed-memory hooks' copies run
//! inside the call that needed them and are counted in it as well as in their own rows; the
//! rows "(within calls: mirror push)" and "(within calls: mirror pull)" time the whole
//! coherence work (comparisons included) and are left out of the total.

use std::collections::HashMap;
use std::fmt::Write as _;
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// Whether `REMORA_CLIENT_PROFILE` asks for a profile (set, not empty, not `0`).
pub(crate) fn enabled_from_env() -> bool {
    std::env::var("REMORA_CLIENT_PROFILE").is_ok_and(|v| !v.is_empty() && v != "0")
}

#[derive(Debug, Default, Clone, Copy)]
struct Row {
    calls: u64,
    total: Duration,
    max: Duration,
}

/// Calls counted and timed by procedure.
#[derive(Debug)]
pub(crate) struct CallProfile {
    started: Instant,
    rows: Mutex<HashMap<&'static str, Row>>,
}

impl CallProfile {
    pub(crate) fn new() -> Self {
        Self {
            started: Instant::now(),
            rows: Mutex::new(HashMap::new()),
        }
    }

    /// One call of `proc` that took `took`.
    pub(crate) fn record(&self, proc: &'static str, took: Duration) {
        let mut rows = self.rows.lock().unwrap_or_else(|e| e.into_inner());
        let row = rows.entry(proc).or_default();
        row.calls += 1;
        row.total += took;
        row.max = row.max.max(took);
    }

    /// The table: one line per procedure, most time first, and a total.
    pub(crate) fn report(&self) -> String {
        let wall = self.started.elapsed();
        let mut rows: Vec<(&'static str, Row)> = self
            .rows
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .iter()
            .map(|(k, v)| (*k, *v))
            .collect();
        rows.sort_by(|a, b| b.1.total.cmp(&a.1.total).then(a.0.cmp(b.0)));
        // Rows named "(within calls: ...)" time part of other calls: not counted twice.
        let counted = || rows.iter().filter(|r| !r.0.starts_with('('));
        let calls: u64 = counted().map(|r| r.1.calls).sum();
        let total: Duration = counted().map(|r| r.1.total).sum();
        let share = |d: Duration| 100.0 * d.as_secs_f64() / wall.as_secs_f64().max(1e-9);
        let mut out = format!(
            "remora client profile: {calls} calls, {:.1} ms in calls ({:.1}% of {:.1} ms since connecting)\n{:<36} {:>9} {:>11} {:>10} {:>10} {:>6}\n",
            total.as_secs_f64() * 1e3,
            share(total),
            wall.as_secs_f64() * 1e3,
            "procedure",
            "calls",
            "total ms",
            "mean us",
            "max us",
            "wall%"
        );
        for (proc, r) in rows {
            let mean = r.total.as_secs_f64() * 1e6 / r.calls.max(1) as f64;
            let _ = writeln!(
                out,
                "{proc:<36} {:>9} {:>11.2} {:>10.1} {:>10.1} {:>6.1}",
                r.calls,
                r.total.as_secs_f64() * 1e3,
                mean,
                r.max.as_secs_f64() * 1e6,
                share(r.total)
            );
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn report_orders_by_total_time_and_counts_every_call() {
        let p = CallProfile::new();
        p.record("rm_launch_kernel", Duration::from_micros(2));
        p.record("rm_launch_kernel", Duration::from_micros(4));
        p.record("rm_stream_synchronize", Duration::from_millis(3));
        let r = p.report();
        let lines: Vec<&str> = r.lines().collect();
        assert!(
            lines[0].starts_with("remora client profile: 3 calls"),
            "{r}"
        );
        assert!(lines[2].starts_with("rm_stream_synchronize"), "{r}");
        assert!(lines[3].starts_with("rm_launch_kernel"), "{r}");
        let cols: Vec<&str> = lines[3].split_whitespace().collect();
        assert_eq!(cols[1], "2", "{r}");
        assert_eq!(cols[3], "3.0", "mean of 2 and 4 us: {r}");
        assert_eq!(cols[4], "4.0", "{r}");
    }
}
