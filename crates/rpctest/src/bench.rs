//! `remora bench rpc`: Remora's ONC RPC against rpcgen/libtirpc, measured in the same run.
//!
//! For each transport (TCP and Unix sockets on loopback) it times, with Remora's Rust client
//! against Remora's Rust server and libtirpc's C client against libtirpc's C server:
//! * the null-call round trip;
//! * 1 MiB and 64 MiB opaque echoes (argument and result both carry the payload).
//!
//! Each server runs in its own process. Every figure is the median of several rounds, and each
//! is reported as a ratio against libtirpc from the same run.

use std::ffi::OsString;
use std::fmt::Write as _;
use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use remora_oncrpc::{Client, Endpoint};
use remora_xdr::Bytes;

use crate::peers::CPeers;
use crate::rpctest::RpctestV1Client;

/// What to run.
#[derive(Debug, Clone)]
pub struct Options {
    /// Directory with prebuilt C peers; built into a temporary directory when `None`.
    pub c_peers: Option<std::path::PathBuf>,
    /// Null calls per round.
    pub null_calls: u32,
    /// The command (program and leading arguments) that starts Remora's rpctest server; it
    /// gets `--listen URL` appended and must print `LISTENING <url>` on its first line.
    pub server_command: Vec<OsString>,
}

/// Rounds per measurement; the median is reported.
const ROUNDS: usize = 3;

/// One measured operation.
#[derive(Debug, Clone)]
pub struct Entry {
    /// "tcp" or "unix".
    pub transport: &'static str,
    /// "null" or "echo".
    pub op: &'static str,
    /// Payload bytes per call (0 for null).
    pub bytes: usize,
    /// Calls per round.
    pub iters: u32,
    /// Remora: median seconds per call.
    pub remora_s: f64,
    /// libtirpc: median seconds per call.
    pub tirpc_s: f64,
}

impl Entry {
    /// libtirpc time over Remora time: above 1 means Remora is faster.
    pub fn speedup(&self) -> f64 {
        self.tirpc_s / self.remora_s
    }
}

/// The whole run.
#[derive(Debug, Clone)]
pub struct Report {
    /// The measurements.
    pub entries: Vec<Entry>,
    /// When, where and what was measured.
    pub meta: Vec<(&'static str, String)>,
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

/// Remora's rpctest server in a child process; killed on drop.
struct RustServer {
    child: Child,
    endpoint: Endpoint,
}

impl RustServer {
    fn start(command: &[OsString], listen: &Endpoint) -> Result<Self> {
        let (program, args) = command.split_first().context("empty server command")?;
        let mut child = Command::new(program)
            .args(args)
            .arg("--listen")
            .arg(listen.to_string())
            .stdout(Stdio::piped())
            .spawn()
            .with_context(|| format!("cannot start {}", program.to_string_lossy()))?;
        let stdout = child
            .stdout
            .take()
            .context("no stdout from the Rust server")?;
        let mut line = String::new();
        BufReader::new(stdout).read_line(&mut line)?;
        let Some(url) = line.trim().strip_prefix("LISTENING ") else {
            let _ = child.kill();
            bail!("the Rust rpctest server said {line:?}, expected LISTENING <url>");
        };
        let endpoint = url
            .parse()
            .map_err(|e| anyhow::anyhow!("bad endpoint {url}: {e}"))?;
        Ok(Self { child, endpoint })
    }
}

impl Drop for RustServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Serves rpctest on `listen` until the process is killed, printing `LISTENING <url>` first.
/// This is the body of the hidden `remora bench rpc-server` command.
pub fn serve_forever(listen: &Endpoint) -> Result<()> {
    let handle = remora_oncrpc::Server::builder(remora_oncrpc::ServerConfig::default())
        .service(std::sync::Arc::new(crate::rpctest::RpctestV1Service::new(
            crate::RtService,
        )))
        .listen(listen)?
        .start()?;
    let endpoint = handle
        .local_endpoints()
        .into_iter()
        .next()
        .context("no endpoint bound")?;
    println!("LISTENING {endpoint}");
    loop {
        std::thread::park();
    }
}

fn time_rust_null(client: &RpctestV1Client, n: u32) -> Result<f64> {
    for _ in 0..100 {
        client.rt_null()?;
    }
    let t = Instant::now();
    for _ in 0..n {
        client.rt_null()?;
    }
    Ok(t.elapsed().as_secs_f64() / f64::from(n))
}

fn time_rust_echo(client: &RpctestV1Client, bytes: usize, n: u32) -> Result<f64> {
    let payload = Bytes::from(vec![0x5au8; bytes]);
    let t = Instant::now();
    for _ in 0..n {
        let back = client.rt_echo(&payload)?;
        if back.len() != bytes {
            bail!("echo returned {} bytes, sent {bytes}", back.len());
        }
    }
    Ok(t.elapsed().as_secs_f64() / f64::from(n))
}

fn time_c(peers: &CPeers, addr: &str, args: &[&str]) -> Result<f64> {
    let out = peers.run_client(addr, args)?;
    if !out.status.success() {
        bail!(
            "rpctest_client {args:?} failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8_lossy(&out.stdout);
    let field = |name: &str| -> Option<f64> {
        let start = text.find(&format!("\"{name}\":"))? + name.len() + 3;
        let rest = &text[start..];
        let end = rest.find([',', '}']).unwrap_or(rest.len());
        rest[..end].trim().parse().ok()
    };
    match (field("seconds"), field("iters")) {
        (Some(s), Some(n)) if n > 0.0 => Ok(s / n),
        _ => bail!("cannot parse rpctest_client output {text:?}"),
    }
}

/// Runs every measurement.
pub fn run(opts: &Options) -> Result<Report> {
    let peers = match &opts.c_peers {
        Some(dir) => CPeers::existing(dir)?,
        None => {
            eprintln!("building the libtirpc peers with rpcgen ...");
            CPeers::build()?
        }
    };
    let sockdir = tempfile::tempdir()?;
    let transports: [(&'static str, Endpoint, String); 2] = [
        (
            "tcp",
            Endpoint::Tcp("127.0.0.1:0".into()),
            "tcp:127.0.0.1:0".into(),
        ),
        (
            "unix",
            Endpoint::Unix(sockdir.path().join("remora.sock")),
            format!("unix:{}", sockdir.path().join("tirpc.sock").display()),
        ),
    ];
    let echo_1m = 1usize << 20;
    let echo_64m = 64usize << 20;
    let mut entries = Vec::new();
    for (transport, ours, theirs) in transports {
        eprintln!("[{transport}] starting servers ...");
        let rust_server = RustServer::start(&opts.server_command, &ours)?;
        let c_server = peers.start_server(&theirs)?;
        // The error names the endpoint and the reason.
        let rpc = Client::connect(&rust_server.endpoint)?;
        let client = RpctestV1Client::new(rpc).with_timeout(Duration::from_secs(120));
        let caddr = c_server.address().to_owned();
        let plan: [(&'static str, usize, u32); 3] = [
            ("null", 0, opts.null_calls),
            ("echo", echo_1m, 200),
            ("echo", echo_64m, 4),
        ];
        for (op, bytes, iters) in plan {
            let (mut ours_s, mut theirs_s) = (Vec::new(), Vec::new());
            for round in 0..ROUNDS {
                eprintln!(
                    "[{transport}] {op} {bytes} B x{iters}, round {}/{ROUNDS}",
                    round + 1
                );
                let iters_s = iters.to_string();
                let bytes_s = bytes.to_string();
                if op == "null" {
                    ours_s.push(time_rust_null(&client, iters)?);
                    theirs_s.push(time_c(&peers, &caddr, &["bench", "null", &iters_s])?);
                } else {
                    ours_s.push(time_rust_echo(&client, bytes, iters)?);
                    theirs_s.push(time_c(
                        &peers,
                        &caddr,
                        &["bench", "echo", &bytes_s, &iters_s],
                    )?);
                }
            }
            entries.push(Entry {
                transport,
                op,
                bytes,
                iters,
                remora_s: median(ours_s),
                tirpc_s: median(theirs_s),
            });
        }
        drop(rust_server);
        drop(c_server);
    }
    Ok(Report {
        entries,
        meta: metadata(),
    })
}

fn command_output(cmd: &str, args: &[&str]) -> Option<String> {
    let out = Command::new(cmd).args(args).output().ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_owned())
}

fn metadata() -> Vec<(&'static str, String)> {
    let cpu = std::fs::read_to_string("/proc/cpuinfo")
        .ok()
        .and_then(|s| {
            s.lines()
                .find(|l| l.starts_with("model name"))
                .and_then(|l| l.split_once(':'))
                .map(|(_, v)| v.trim().to_owned())
        })
        .unwrap_or_else(|| "unknown".into());
    vec![
        (
            "date",
            command_output("date", &["-u", "+%Y-%m-%dT%H:%M:%SZ"]).unwrap_or_default(),
        ),
        ("host", command_output("hostname", &[]).unwrap_or_default()),
        ("cpu", cpu),
        (
            "cores",
            std::thread::available_parallelism()
                .map_or(0, |n| n.get())
                .to_string(),
        ),
        (
            "kernel",
            command_output("uname", &["-r"]).unwrap_or_default(),
        ),
        (
            "commit",
            command_output("git", &["rev-parse", "--short=12", "HEAD"]).unwrap_or_default(),
        ),
        ("remora", env!("CARGO_PKG_VERSION").to_owned()),
    ]
}

fn json_string(s: &str) -> String {
    let mut out = String::from("\"");
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

impl Report {
    /// A human-readable table with ratios.
    pub fn table(&self) -> String {
        let mut out = String::new();
        for (k, v) in &self.meta {
            let _ = writeln!(out, "{k:<8} {v}");
        }
        let _ = writeln!(
            out,
            "\n{:<6} {:<6} {:>10} {:>14} {:>14} {:>10}",
            "net", "op", "payload", "remora", "libtirpc", "speedup"
        );
        for e in &self.entries {
            let (ours, theirs) = if e.op == "null" {
                (
                    format!("{:.1} us", e.remora_s * 1e6),
                    format!("{:.1} us", e.tirpc_s * 1e6),
                )
            } else {
                let mibs = |s: f64| e.bytes as f64 / s / f64::from(1u32 << 20);
                (
                    format!("{:.0} MiB/s", mibs(e.remora_s)),
                    format!("{:.0} MiB/s", mibs(e.tirpc_s)),
                )
            };
            let payload = if e.bytes == 0 {
                "-".into()
            } else {
                format!("{} KiB", e.bytes >> 10)
            };
            let _ = writeln!(
                out,
                "{:<6} {:<6} {:>10} {:>14} {:>14} {:>9.2}x",
                e.transport,
                e.op,
                payload,
                ours,
                theirs,
                e.speedup()
            );
        }
        out.push_str(
            "\nspeedup = libtirpc time / Remora time for the same call, same run (>1: Remora faster)",
        );
        out
    }

    /// The results as JSON.
    pub fn json(&self) -> String {
        let mut out = String::from("{\n  \"benchmark\": \"remora bench rpc\",\n");
        for (k, v) in &self.meta {
            let _ = writeln!(out, "  {}: {},", json_string(k), json_string(v));
        }
        out.push_str("  \"results\": [\n");
        for (i, e) in self.entries.iter().enumerate() {
            let _ = write!(
                out,
                "    {{\"transport\": \"{}\", \"op\": \"{}\", \"bytes\": {}, \"iters\": {}, \
                 \"remora_s_per_call\": {:.9}, \"libtirpc_s_per_call\": {:.9}, \
                 \"speedup_vs_libtirpc\": {:.3}}}",
                e.transport,
                e.op,
                e.bytes,
                e.iters,
                e.remora_s,
                e.tirpc_s,
                e.speedup()
            );
            out.push_str(if i + 1 < self.entries.len() {
                ",\n"
            } else {
                "\n"
            });
        }
        out.push_str("  ]\n}\n");
        out
    }
}
