//! The per-procedure profile ([`ServerConfig::profile`], `--profile`): timing counters of a
//! connection, logged when it ends.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

#[cfg(doc)]
use super::ServerConfig;
use super::dispatch::Registry;
use crate::Peer;

/// Timing counters of one connection (see [`ServerConfig::profile`]).
pub(super) struct Profile {
    started: Instant,
    /// Time spent in `read_record`: waiting for input and reading it.
    pub(super) reading: Duration,
    /// Time spent sending replies inline.
    pub(super) replying: Duration,
    /// By (program, version, procedure): calls, total and longest time in `process_call`.
    procs: BTreeMap<(u32, u32, u32), (u64, Duration, Duration)>,
}

impl Profile {
    pub(super) fn new() -> Self {
        Self {
            started: Instant::now(),
            reading: Duration::ZERO,
            replying: Duration::ZERO,
            procs: BTreeMap::new(),
        }
    }

    /// (program, version, procedure) of a call record, read without decoding it; zeros when
    /// the record is too short.
    pub(super) fn key(record: &[u8]) -> (u32, u32, u32) {
        let word = |i: usize| {
            record
                .get(i..i + 4)
                .map_or(0, |b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
        };
        (word(12), word(16), word(20))
    }

    pub(super) fn call(&mut self, key: (u32, u32, u32), took: Duration) {
        let e = self
            .procs
            .entry(key)
            .or_insert((0, Duration::ZERO, Duration::ZERO));
        e.0 += 1;
        e.1 += took;
        e.2 = e.2.max(took);
    }

    /// The report: one line per procedure, busiest first.
    fn render(&self, registry: &Registry) -> String {
        let wall = self.started.elapsed();
        let busy: Duration = self.procs.values().map(|v| v.1).sum();
        let calls: u64 = self.procs.values().map(|v| v.0).sum();
        let mut out = format!(
            "{calls} calls in {:.3} s: {:.3} s in procedures, {:.3} s reading input (waiting included), {:.3} s sending replies",
            wall.as_secs_f64(),
            busy.as_secs_f64(),
            self.reading.as_secs_f64(),
            self.replying.as_secs_f64()
        );
        let mut rows: Vec<_> = self.procs.iter().collect();
        rows.sort_by_key(|r| std::cmp::Reverse(r.1.1));
        for (&(prog, vers, proc_), &(n, total, max)) in rows {
            let name = registry
                .programs
                .get(&prog)
                .and_then(|v| v.get(&vers))
                .and_then(|svc| svc.procedure_name(proc_))
                .map_or_else(|| format!("{prog}/{vers}/{proc_}"), str::to_owned);
            let mean_us = total.as_secs_f64() * 1e6 / n as f64;
            out.push_str(&format!(
                "\n  {name:<32} {n:>9} calls  mean {mean_us:>9.2} us  max {:>10.1} us  total {:>9.3} s",
                max.as_secs_f64() * 1e6,
                total.as_secs_f64()
            ));
        }
        out
    }
}

/// Logs a connection's profile when dropped (the connection loop has many exits).
pub(super) struct ProfileReport<'a> {
    pub(super) profile: &'a mut Option<Profile>,
    pub(super) peer: &'a Peer,
    pub(super) connection: u64,
    pub(super) registry: &'a Registry,
}

impl Drop for ProfileReport<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.profile.as_ref() {
            tracing::info!(
                peer = %self.peer,
                connection = self.connection,
                "ONC RPC server profile: {}",
                p.render(self.registry)
            );
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use remora_xdr::{Decoder, Encoder};

    use super::*;
    use crate::{CallContext, Dispatch, Service};

    struct Named;
    impl Service for Named {
        fn program(&self) -> u32 {
            7
        }
        fn version(&self) -> u32 {
            1
        }
        fn dispatch(&self, _: &CallContext, _: &mut Decoder, _: &mut Encoder) -> Dispatch {
            Dispatch::Success
        }
        fn procedure_name(&self, procedure: u32) -> Option<&'static str> {
            (procedure == 3).then_some("PING")
        }
    }

    #[test]
    fn profile_names_procedures_and_orders_by_total_time() {
        let mut registry = Registry::default();
        registry.add(Arc::new(Named));
        let mut record = vec![0u8; 40];
        record[12..16].copy_from_slice(&7u32.to_be_bytes());
        record[16..20].copy_from_slice(&1u32.to_be_bytes());
        record[20..24].copy_from_slice(&3u32.to_be_bytes());
        let mut p = Profile::new();
        assert_eq!(Profile::key(&record), (7, 1, 3));
        assert_eq!(Profile::key(&record[..10]), (0, 0, 0));
        p.call((7, 1, 3), Duration::from_micros(10));
        p.call((7, 1, 3), Duration::from_micros(30));
        p.call((7, 1, 9), Duration::from_millis(1));
        let text = p.render(&registry);
        assert!(text.starts_with("3 calls in "), "{text}");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines[1].trim_start().starts_with("7/1/9"), "{text}");
        assert!(lines[2].trim_start().starts_with("PING"), "{text}");
        assert!(lines[2].contains("mean     20.00 us"), "{text}");
        assert!(lines[2].contains("max       30.0 us"), "{text}");
    }
}
