//! `remora serve --metrics tcp://HOST:PORT`: a Prometheus endpoint (`GET /metrics`, text
//! format, prometheus-client) with what the limits ledger knows (issue 13 §5): per tenant its
//! sessions, its use of each limited kind and the charges refused; server-wide the
//! connections served.
//!
//! The endpoint is a small HTTP/1.0 responder on its own thread: one request per connection,
//! a request head of at most 8 KiB read within 2 s, then the answer and close. It answers only
//! `GET /metrics` (and `/`); anything else is 404. Tenant names are visible to whoever reaches
//! it, so a non-loopback address needs `--insecure` (as a TCP listener without tokens does).

use std::io::{Read, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use prometheus_client::encoding::text::encode;
use prometheus_client::metrics::counter::Counter;
use prometheus_client::metrics::family::Family;
use prometheus_client::metrics::gauge::Gauge;
use prometheus_client::registry::Registry;

use crate::quota::{Kind, Ledger};

/// Longest request head read.
const MAX_REQUEST: usize = 8 << 10;
/// How long a scraper may take to send its request.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(2);

/// Server-wide figures the ledger does not hold, read at each scrape.
pub(crate) type ServerFigures =
    Arc<dyn Fn() -> Vec<(&'static str, &'static str, i64)> + Send + Sync>;

/// The running endpoint; stops when dropped.
pub(crate) struct Metrics {
    stop: Arc<AtomicBool>,
    thread: Option<std::thread::JoinHandle<()>>,
    addr: std::net::SocketAddr,
}

impl Metrics {
    /// Listens on `addr` (`HOST:PORT`) and answers scrapes from `ledger` and `figures`.
    pub(crate) fn start(
        addr: &str,
        ledger: Arc<Ledger>,
        figures: ServerFigures,
    ) -> std::io::Result<Self> {
        let listener = TcpListener::bind(addr)?;
        listener.set_nonblocking(true)?;
        let local = listener.local_addr()?;
        let stop = Arc::new(AtomicBool::new(false));
        let thread = {
            let stop = Arc::clone(&stop);
            std::thread::Builder::new()
                .name("remora-metrics".into())
                .spawn(move || {
                    while !stop.load(Ordering::Relaxed) {
                        match listener.accept() {
                            Ok((conn, _)) => answer(conn, &ledger, &figures),
                            Err(e) if e.kind() == std::io::ErrorKind::WouldBlock => {
                                std::thread::sleep(Duration::from_millis(50));
                            }
                            Err(e) => {
                                tracing::debug!(error = %e, "metrics: accept failed");
                                std::thread::sleep(Duration::from_millis(50));
                            }
                        }
                    }
                })?
        };
        tracing::info!("metrics on http://{local}/metrics");
        Ok(Self {
            stop,
            thread: Some(thread),
            addr: local,
        })
    }

    /// The address bound (port 0 resolved).
    pub(crate) fn local_addr(&self) -> std::net::SocketAddr {
        self.addr
    }
}

impl Drop for Metrics {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn answer(mut conn: TcpStream, ledger: &Ledger, figures: &ServerFigures) {
    let _ = conn.set_nonblocking(false);
    let _ = conn.set_read_timeout(Some(REQUEST_TIMEOUT));
    let _ = conn.set_write_timeout(Some(REQUEST_TIMEOUT));
    let mut head = Vec::with_capacity(1024);
    let mut buf = [0u8; 1024];
    while !head.windows(4).any(|w| w == b"\r\n\r\n") && !head.windows(2).any(|w| w == b"\n\n") {
        match conn.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) => head.extend_from_slice(&buf[..n]),
        }
        if head.len() > MAX_REQUEST {
            let _ = conn.write_all(b"HTTP/1.0 431 Request Header Fields Too Large\r\n\r\n");
            return;
        }
    }
    let line = head.split(|&b| b == b'\n').next().unwrap_or_default();
    let line = String::from_utf8_lossy(line);
    let mut parts = line.split_whitespace();
    let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
    let response = if method == "GET" && (path == "/metrics" || path == "/") {
        let body = render(ledger, figures);
        format!(
            "HTTP/1.0 200 OK\r\nContent-Type: application/openmetrics-text; version=1.0.0; charset=utf-8\r\nContent-Length: {}\r\n\r\n{body}",
            body.len()
        )
    } else {
        "HTTP/1.0 404 Not Found\r\nContent-Length: 24\r\n\r\nonly GET /metrics here.\n".to_owned()
    };
    let _ = conn.write_all(response.as_bytes());
}

/// The scrape's text: a registry built from the ledger as it is now.
pub(crate) fn render(ledger: &Ledger, figures: &ServerFigures) -> String {
    let mut registry = Registry::with_prefix("remora");
    let sessions = Family::<Vec<(String, String)>, Gauge>::default();
    let used = Family::<Vec<(String, String)>, Gauge>::default();
    let hits = Family::<Vec<(String, String)>, Counter>::default();
    for (tenant, report) in ledger.report() {
        for kind in Kind::ALL {
            let i = Kind::ALL.iter().position(|k| *k == kind).unwrap_or(0);
            if kind == Kind::Sessions {
                sessions
                    .get_or_create(&vec![("tenant".into(), tenant.clone())])
                    .set(report.used[i] as i64);
            } else {
                used.get_or_create(&vec![
                    ("tenant".into(), tenant.clone()),
                    ("kind".into(), kind.key().replace('-', "_")),
                ])
                .set(report.used[i].min(i64::MAX as u64) as i64);
            }
            if report.hits[i] > 0 {
                hits.get_or_create(&vec![
                    ("tenant".into(), tenant.clone()),
                    ("kind".into(), kind.key().replace('-', "_")),
                ])
                .inc_by(report.hits[i]);
            }
        }
    }
    registry.register("tenant_sessions", "Sessions of each tenant now", sessions);
    registry.register(
        "tenant_usage",
        "What each tenant's sessions use now, by limited kind (bytes for device_memory, pinned_memory and in_flight; objects otherwise)",
        used,
    );
    registry.register(
        "tenant_limit_refusals",
        "Calls refused because they would pass a limit of --tenants/--limit, by tenant and kind",
        hits,
    );
    for (name, help, value) in figures() {
        let g = Gauge::<i64>::default();
        g.set(value);
        registry.register(name, help, g);
    }
    let mut out = String::new();
    if encode(&mut out, &registry).is_err() {
        out = "# the metrics could not be encoded\n".into();
    }
    out
}
