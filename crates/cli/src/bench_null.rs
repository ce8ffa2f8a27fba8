//! `remora bench null`: the round trip of Remora's NULL procedure against a running server.
//!
//! The NULL procedure does no work on the server, so this measures the transport and the RPC
//! runtime alone: client encode, write, server read/decode/dispatch/reply, client wake-up.

use std::fmt::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use remora_oncrpc::{ClientConfig, Endpoint, TransportChoice};
use remora_proto::remora::RemoraV1Client;

/// The measured round trips, in microseconds.
#[derive(Debug, Clone, PartialEq)]
pub(crate) struct NullReport {
    pub(crate) server: String,
    /// The transport used: shm, unix or tcp.
    pub(crate) transport: String,
    pub(crate) calls: u32,
    pub(crate) p50_us: f64,
    pub(crate) p99_us: f64,
    pub(crate) mean_us: f64,
    pub(crate) min_us: f64,
}

impl NullReport {
    /// From per-call times (any order; at least one).
    pub(crate) fn from_times(server: &Endpoint, transport: &str, mut times_us: Vec<f64>) -> Self {
        times_us.sort_by(f64::total_cmp);
        let n = times_us.len().max(1);
        let at = |q: f64| {
            times_us
                .get(((n - 1) as f64 * q) as usize)
                .copied()
                .unwrap_or(0.0)
        };
        Self {
            server: server.to_string(),
            transport: transport.to_owned(),
            calls: times_us.len() as u32,
            p50_us: at(0.5),
            p99_us: at(0.99),
            mean_us: times_us.iter().sum::<f64>() / n as f64,
            min_us: times_us.first().copied().unwrap_or(0.0),
        }
    }

    pub(crate) fn text(&self) -> String {
        format!(
            "NULL round trip to {} over {}: p50 {:.2} us, p99 {:.2} us, mean {:.2} us, min {:.2} us ({} calls)",
            self.server,
            self.transport,
            self.p50_us,
            self.p99_us,
            self.mean_us,
            self.min_us,
            self.calls
        )
    }

    pub(crate) fn json(&self) -> String {
        let mut s = String::from("{\n");
        let _ = writeln!(s, "  \"benchmark\": \"null\",");
        let _ = writeln!(s, "  \"server\": \"{}\",", self.server.replace('"', "\\\""));
        let _ = writeln!(s, "  \"transport\": \"{}\",", self.transport);
        let _ = writeln!(s, "  \"calls\": {},", self.calls);
        let _ = writeln!(s, "  \"p50_us\": {:.3},", self.p50_us);
        let _ = writeln!(s, "  \"p99_us\": {:.3},", self.p99_us);
        let _ = writeln!(s, "  \"mean_us\": {:.3},", self.mean_us);
        let _ = writeln!(s, "  \"min_us\": {:.3}", self.min_us);
        s.push('}');
        s
    }
}

/// Connects to `server` over `transport` and times `calls` NULL calls (after `calls / 10`
/// warm-up calls).
pub(crate) fn run(
    server: &Endpoint,
    transport: TransportChoice,
    calls: u32,
    json: Option<&Path>,
) -> Result<NullReport> {
    if calls == 0 {
        bail!("--calls must be at least 1");
    }
    crate::run::check_transport(server, transport)?;
    let config = ClientConfig {
        transport,
        ..ClientConfig::default()
    };
    let rpc = crate::connect(server, config)?;
    let used = match server {
        _ if rpc.is_shm() => "shm",
        Endpoint::Unix(_) => "unix",
        Endpoint::Tcp(_) => "tcp",
        Endpoint::Tls(_) => "tls",
    };
    let client = RemoraV1Client::new(rpc).with_timeout(Duration::from_secs(10));
    for _ in 0..calls / 10 {
        client
            .remora_null()
            .with_context(|| format!("NULL call to {server} failed"))?;
    }
    let mut times = Vec::with_capacity(calls as usize);
    for _ in 0..calls {
        let t = Instant::now();
        client
            .remora_null()
            .with_context(|| format!("NULL call to {server} failed"))?;
        times.push(t.elapsed().as_secs_f64() * 1e6);
    }
    // REMORA_WAIT_TRACE: how this side's waits went.
    client.rpc().trace_waits();
    let report = NullReport::from_times(server, used, times);
    outln!("{}", report.text());
    if let Some(path) = json {
        std::fs::write(path, report.json())
            .with_context(|| format!("cannot write {}", path.display()))?;
        outln!("results written to {}", path.display());
    }
    Ok(report)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn percentiles_of_known_times() {
        let ep: Endpoint = "unix:///tmp/x.sock".parse().unwrap();
        let r = NullReport::from_times(&ep, "shm", (1..=100).rev().map(f64::from).collect());
        assert_eq!(r.calls, 100);
        assert_eq!(r.min_us, 1.0);
        assert_eq!(r.p50_us, 50.0);
        assert_eq!(r.p99_us, 99.0);
        assert!((r.mean_us - 50.5).abs() < 1e-9);
        let j = r.json();
        assert!(j.contains("\"p50_us\": 50.000"), "{j}");
        assert!(j.contains("\"server\": \"unix:///tmp/x.sock\""), "{j}");
        assert!(j.contains("\"transport\": \"shm\""), "{j}");
    }
}
