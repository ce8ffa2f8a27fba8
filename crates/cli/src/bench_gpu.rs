//! `remora bench launch|copy`: empty-kernel launches, launch + synchronize and memcpy
//! bandwidth, remoted (shm, unix, tcp) against native CUDA in the same run, with 1..N
//! concurrent clients.
//!
//! Every measurement runs in worker processes (`remora bench gpu-worker`, hidden), one per
//! client, so that clients are as independent as separate applications: each loads a driver
//! library — the real `libcuda.so.1` for the native baseline, Remora's shim for a remoted run
//! — sets up (context, module, stream, buffers), says READY, waits until every worker of its
//! group is ready, measures, and prints one JSON line. The parent interleaves the modes within
//! each round (native, shm, unix, tcp, native, …) so that drift of the machine hits every mode
//! alike, takes the median over rounds, and reports each figure as a ratio against native with
//! the same number of clients.

use std::ffi::OsString;
use std::io::{BufRead, BufReader, Write as _};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
pub(crate) use remora_gpubench::{What, WorkerOptions, WorkerResult, Workload, worker};
use remora_oncrpc::Endpoint;
use serde::{Deserialize, Serialize};

use crate::proc_cpu::TaskSched;
use crate::run::{EmbeddedServer, find_shim};
use remora_gpubench::sched::SchedNs;

/// `remora bench launch|copy` options.
#[derive(Debug, Clone)]
pub(crate) struct Options {
    pub(crate) what: What,
    pub(crate) server: Option<Endpoint>,
    pub(crate) transports: Vec<String>,
    pub(crate) clients: Vec<u32>,
    pub(crate) rounds: u32,
    pub(crate) native: bool,
    pub(crate) workload: Workload,
    pub(crate) shim: Option<PathBuf>,
    pub(crate) serve_args: Vec<OsString>,
    pub(crate) json: Option<PathBuf>,
    pub(crate) png: Option<PathBuf>,
    /// `bench copy`: also measure a plain TCP stream over loopback moving the same bytes
    /// (mode `raw-tcp`), and report each copy figure against it.
    pub(crate) raw_tcp: bool,
    /// Added to the environment of the servers the benchmark starts and of its workers
    /// (`bench contention`: `REMORA_WAIT`).
    pub(crate) env: Vec<(String, String)>,
}

/// The mode of the plain loopback TCP baseline (`--raw-tcp`).
const RAW_TCP: &str = "raw-tcp";

/// One figure of one group (a mode and a number of clients), median over the rounds.
#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
pub(crate) struct Figure {
    pub(crate) mode: String,
    pub(crate) clients: u32,
    pub(crate) metric: String,
    pub(crate) unit: String,
    pub(crate) value: f64,
    /// This figure over native's with the same clients (>1 is slower for us, <1 is slower
    /// for GB/s); absent for native itself or when native did not run.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub(crate) ratio_to_native: Option<f64>,
    /// For copy figures with `--raw-tcp`: this figure over the plain TCP stream's with the
    /// same clients (the same aggregate or per-client kind).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub(crate) ratio_to_raw_tcp: Option<f64>,
    /// The value of each round.
    pub(crate) rounds: Vec<f64>,
}

/// The whole report, as written to `--json`.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub(crate) struct Report {
    pub(crate) benchmark: String,
    pub(crate) date_unix: u64,
    /// The GPU, as the workers' drivers name it (empty when none answered).
    #[serde(default)]
    pub(crate) device: String,
    /// `remora --version`.
    #[serde(default)]
    pub(crate) remora: String,
    /// The commit measured (see [`Report::now`]).
    #[serde(default)]
    pub(crate) commit: String,
    pub(crate) server: String,
    pub(crate) rounds: u32,
    /// What each client measured (`bench launch|copy`; none for `bench startup`).
    #[serde(flatten)]
    pub(crate) workload: Option<Workload>,
    pub(crate) figures: Vec<Figure>,
    pub(crate) notes: Vec<String>,
}

impl Report {
    /// A report of `benchmark` made now by this `remora`, naming the commit `REMORA_COMMIT`
    /// gives, else the one it was built from (empty when built outside a git checkout).
    pub(crate) fn now(
        benchmark: &str,
        device: String,
        server: String,
        rounds: u32,
        workload: Option<Workload>,
        figures: Vec<Figure>,
        notes: Vec<String>,
    ) -> Self {
        Self {
            benchmark: benchmark.into(),
            date_unix: std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_secs()),
            device,
            remora: concat!("remora ", env!("CARGO_PKG_VERSION")).into(),
            commit: std::env::var("REMORA_COMMIT")
                .ok()
                .filter(|c| !c.is_empty())
                .unwrap_or_else(|| env!("REMORA_BUILD_COMMIT").into()),
            server,
            rounds,
            workload,
            figures,
            notes,
        }
    }
}

// The parent ------------------------------------------------------------------------------------

/// One aggregate figure of a group: (metric, unit, value).
type Aggregate = (String, String, f64);
/// (mode, clients) with each round's aggregates.
type GroupRounds = ((String, u32), Vec<Vec<Aggregate>>);

/// Everything the group's workers moved or issued in phase `name`, per second of the span
/// from the first worker's start to the last one's end (NaN without spans).
fn span_rate(results: &[WorkerResult], name: &str) -> f64 {
    let spans: Vec<_> = results
        .iter()
        .flat_map(|r| r.spans.iter().filter(|s| s.0 == name))
        .collect();
    let (Some(start), Some(end)) = (
        spans.iter().map(|s| s.1).min(),
        spans.iter().map(|s| s.2).max(),
    ) else {
        return f64::NAN;
    };
    let amount: f64 = spans.iter().map(|s| s.3).sum();
    amount / ((end.saturating_sub(start)).max(1) as f64 / 1e9)
}

/// The per-group aggregate of worker results.
fn aggregate(what: What, results: &[WorkerResult]) -> Vec<Aggregate> {
    let med = |v: Vec<f64>| remora_gpubench::median(&v);
    let mut out = Vec::new();
    match what {
        What::Launch => {
            let per: Vec<f64> = results.iter().filter_map(|r| r.per_launch_us).collect();
            out.push(("launch.per_launch".into(), "us".into(), med(per)));
            out.push((
                "launch.aggregate_rate".into(),
                "Mlaunch/s".into(),
                span_rate(results, "launch") / 1e6,
            ));
            let p50: Vec<f64> = results.iter().filter_map(|r| r.sync_p50_us).collect();
            out.push(("launch_sync.p50".into(), "us".into(), med(p50)));
            let p99 = results
                .iter()
                .filter_map(|r| r.sync_p99_us)
                .fold(f64::NAN, f64::max);
            out.push(("launch_sync.p99_max".into(), "us".into(), p99));
            let mean: Vec<f64> = results.iter().filter_map(|r| r.sync_mean_us).collect();
            if !mean.is_empty() {
                out.push(("launch_sync.mean".into(), "us".into(), med(mean)));
            }
            let cpu: Vec<f64> = results.iter().filter_map(|r| r.sync_cpu_us).collect();
            if !cpu.is_empty() {
                out.push(("launch_sync.client_cpu".into(), "us".into(), med(cpu)));
            }
            let runq: Vec<f64> = results.iter().filter_map(|r| r.sync_runq_us).collect();
            if !runq.is_empty() {
                out.push(("launch_sync.client_runq".into(), "us".into(), med(runq)));
            }
        }
        What::Copy => {
            let mut keys: Vec<&String> = results
                .iter()
                .flat_map(|r| r.copies.iter().map(|(k, _)| k))
                .collect();
            keys.sort();
            keys.dedup();
            for k in keys {
                let v: Vec<f64> = results
                    .iter()
                    .flat_map(|r| r.copies.iter().filter(|(kk, _)| kk == k).map(|(_, g)| *g))
                    .collect();
                out.push((format!("copy.{k}.per_client"), "GB/s".into(), med(v)));
                out.push((
                    format!("copy.{k}.aggregate"),
                    "GB/s".into(),
                    span_rate(results, k) / 1e9,
                ));
            }
        }
        // `bench fairness` reads its workers' results itself.
        What::Greedy | What::Latency | What::Fault => {}
    }
    out
}

/// The workers of one group, started and set up; dropping kills what is left.
struct Group {
    children: Vec<Child>,
}

impl Drop for Group {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// Runs `clients` workers in `mode`; returns their results and, for launch workers against
/// the benchmark's own servers, the servers' CPU time and run-queue wait per launch +
/// synchronize in µs (all their processes: the accepting one and its session workers).
fn run_group(
    opts: &Options,
    mode: &str,
    clients: u32,
    endpoints: &Endpoints,
    shim: &Path,
) -> Result<(Vec<WorkerResult>, Option<ServerSched>)> {
    let exe = std::env::current_exe().context("cannot find the remora executable")?;
    let mut commands = Vec::new();
    for _ in 0..clients {
        let mut cmd = Command::new(&exe);
        cmd.args(["bench", "gpu-worker"])
            .arg(opts.what.name())
            .args(opts.workload.to_args())
            .envs(opts.env.iter().map(|(k, v)| (k, v)));
        if mode == "native" {
            cmd.arg("--native");
        } else {
            let server = if mode == "tcp" {
                &endpoints.tcp
            } else {
                &endpoints.unix
            };
            cmd.arg("--driver")
                .arg(shim)
                .env("REMORA_SERVER", server.to_string())
                .env("REMORA_TRANSPORT", mode);
        }
        commands.push(cmd);
    }
    let launch = opts.what == What::Launch;
    let roots: Vec<u32> = endpoints
        ._servers
        .iter()
        .filter_map(EmbeddedServer::pid)
        .collect();
    // The accepting processes and the session workers serving a connection; not warm
    // workers, which may be starting their driver in place of the ones sessions took.
    let sample = || crate::proc_cpu::serving_sched(&roots, remora_server::SESSION_WORKER_THREAD);
    let counted = launch && mode != "native" && !roots.is_empty() && opts.workload.syncs > 0;
    let (results, sched) = run_workers(
        commands,
        mode,
        launch,
        counted.then_some(&sample as &dyn Fn() -> TaskSched),
    )?;
    let trips = f64::from(clients) * f64::from(opts.workload.syncs);
    let per = sched.map(|s| ServerSched {
        cpu_us: s.on_cpu as f64 / 1e3 / trips,
        runq_us: s.waiting as f64 / 1e3 / trips,
    });
    Ok((results, per))
}

/// The servers' share of a group's launch + synchronize loops, per round trip.
#[derive(Debug, Clone, Copy)]
pub(crate) struct ServerSched {
    /// CPU time, µs (`launch_sync.server_cpu`).
    cpu_us: f64,
    /// Time their threads were runnable but waited for a core, µs (`launch_sync.server_runq`).
    runq_us: f64,
}

/// Starts a benchmark worker for each of `commands` (`remora bench gpu-worker …`), waits
/// until every one is set up (READY), starts them together (GO) and answers their results in
/// order. `label` names the group in errors. Launch workers (`sync_barrier`) also stop
/// between their burst and their launch + synchronize loop (SYNC): they are started together
/// again, and with `server_sched` (the servers' scheduler times so far) the answer has the
/// servers' times over the loops, from that start to the last result (the workers keep
/// their sessions until their standard input closes, after that reading).
pub(crate) fn run_workers(
    commands: Vec<Command>,
    label: &str,
    sync_barrier: bool,
    server_sched: Option<&dyn Fn() -> TaskSched>,
) -> Result<(Vec<WorkerResult>, Option<SchedNs>)> {
    let mut group = Group {
        children: Vec::new(),
    };
    for mut cmd in commands {
        cmd.env_remove("LD_PRELOAD")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped());
        group.children.push(
            cmd.spawn()
                .context("cannot start a benchmark worker (remora bench gpu-worker)")?,
        );
    }
    // Every worker sets up, then says READY; all start together.
    let mut readers = Vec::new();
    for c in &mut group.children {
        let out = c.stdout.take().context("no stdout from a worker")?;
        let mut r = BufReader::new(out);
        expect_line(c, &mut r, "READY", label, "to set up")?;
        readers.push(r);
    }
    let go = |children: &mut Vec<Child>| -> Result<()> {
        for c in children {
            let stdin = c.stdin.as_mut().context("no stdin to a worker")?;
            stdin.write_all(b"GO\n")?;
            stdin.flush()?;
        }
        Ok(())
    };
    go(&mut group.children)?;
    let mut sched0 = None;
    if sync_barrier {
        for (c, r) in group.children.iter_mut().zip(&mut readers) {
            expect_line(c, r, "SYNC", label, "in its launch burst")?;
        }
        sched0 = server_sched.map(|f| f());
        go(&mut group.children)?;
    }
    let mut lines = Vec::new();
    for (c, r) in group.children.iter_mut().zip(&mut readers) {
        let mut line = String::new();
        r.read_line(&mut line)?;
        if line.trim().is_empty() {
            let status = c.wait()?;
            bail!("a {label} benchmark worker failed while measuring ({status})");
        }
        lines.push(line);
    }
    // Thread by thread: a server thread that exits during the loops (a waiter) takes none of
    // the others' time with it.
    let sched = sched0.zip(server_sched).map(|(s0, f)| f().since(&s0));
    let mut results = Vec::new();
    for (c, line) in group.children.iter_mut().zip(&lines) {
        // Closing its standard input lets a launch worker end its session and exit.
        drop(c.stdin.take());
        let status = c.wait()?;
        if !status.success() {
            bail!(
                "a {label} benchmark worker failed while measuring ({status}) {}",
                line.trim()
            );
        }
        results.push(
            serde_json::from_str(line.trim())
                .with_context(|| format!("a worker printed {:?}", line.trim()))?,
        );
    }
    group.children.clear();
    Ok((results, sched))
}

/// Reads a worker's next line; anything but `want` ends the group with an error that says
/// the worker failed `doing`, with its exit status and what it printed.
fn expect_line(
    c: &mut Child,
    r: &mut BufReader<std::process::ChildStdout>,
    want: &str,
    label: &str,
    doing: &str,
) -> Result<()> {
    let mut line = String::new();
    r.read_line(&mut line)?;
    if line.trim() == want {
        return Ok(());
    }
    let status = c.wait().ok();
    bail!(
        "a {label} benchmark worker failed {doing} ({}){}",
        status.map_or("?".into(), |s| s.to_string()),
        if line.is_empty() {
            String::new()
        } else {
            format!(": {}", line.trim())
        }
    );
}

/// The servers the remoted modes use.
struct Endpoints {
    unix: Endpoint,
    tcp: Endpoint,
    /// Embedded servers (none when `--server` named one).
    _servers: Vec<EmbeddedServer>,
    _dir: Option<tempfile::TempDir>,
}

fn endpoints(opts: &Options) -> Result<Endpoints> {
    if let Some(s) = &opts.server {
        return Ok(Endpoints {
            unix: s.clone(),
            tcp: s.clone(),
            _servers: Vec::new(),
            _dir: None,
        });
    }
    let dir = tempfile::Builder::new()
        .prefix("remora-bench-")
        .tempdir()
        .context("cannot create a private directory")?;
    let mut servers = Vec::new();
    let mut unix = Endpoint::Unix(dir.path().join("remora.sock"));
    let mut tcp = Endpoint::Tcp("127.0.0.1:0".into());
    if opts.transports.iter().any(|t| t != "tcp") {
        let (s, e) = EmbeddedServer::start_env(&unix, &opts.serve_args, false, &opts.env)?;
        servers.push(s);
        unix = e;
    }
    if opts.transports.iter().any(|t| t == "tcp") {
        let (s, e) = EmbeddedServer::start_env(&tcp, &opts.serve_args, false, &opts.env)?;
        servers.push(s);
        tcp = e;
    }
    Ok(Endpoints {
        unix,
        tcp,
        _servers: servers,
        _dir: Some(dir),
    })
}

/// Runs the benchmark: prints progress on stderr and a table on stdout; writes the JSON
/// report and the PNG plot when asked.
pub(crate) fn run(opts: &Options) -> Result<Report> {
    let report = measure(opts)?;
    outln!("{}", table(&report));
    write_report(&report, opts.json.as_deref(), opts.png.as_deref())?;
    Ok(report)
}

/// Runs the benchmark, printing progress on stderr, and answers its report.
pub(crate) fn measure(opts: &Options) -> Result<Report> {
    for t in &opts.transports {
        if !["shm", "unix", "tcp"].contains(&t.as_str()) {
            bail!("unknown transport {t:?}: use shm, unix or tcp (comma-separated)");
        }
    }
    if opts.clients.is_empty() || opts.clients.iter().any(|&c| c == 0 || c > 256) {
        bail!("--clients takes numbers from 1 to 256, e.g. 1,4,16");
    }
    if opts.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let shim = find_shim(opts.shim.as_deref())?;
    let mut notes = Vec::new();
    // A named server is reached over what its URL allows: tcp:// only over tcp, unix:// over
    // shm or unix.
    let transports: Vec<String> = match &opts.server {
        None => opts.transports.clone(),
        Some(server) => {
            let tcp = matches!(server, Endpoint::Tcp(_));
            let (kept, dropped): (Vec<String>, Vec<String>) = opts
                .transports
                .iter()
                .cloned()
                .partition(|t| (t == "tcp") == tcp);
            if !dropped.is_empty() {
                let note = format!(
                    "{server} cannot be reached over {}: not measured",
                    dropped.join(", ")
                );
                eprintln!("remora: {note}");
                notes.push(note);
            }
            if kept.is_empty() {
                bail!(
                    "none of the transports {} reaches {server} (tcp:// servers take tcp, unix:// servers shm and unix)",
                    opts.transports.join(",")
                );
            }
            kept
        }
    };
    let opts = &Options {
        transports,
        ..opts.clone()
    };
    let endpoints = endpoints(opts)?;
    let mut modes: Vec<String> = Vec::new();
    if opts.native {
        modes.push("native".into());
    }
    modes.extend(opts.transports.iter().cloned());
    if opts.raw_tcp {
        if opts.what == What::Copy {
            modes.push(RAW_TCP.into());
        } else {
            notes.push("--raw-tcp applies to bench copy only: not measured".into());
        }
    }
    // (mode, clients) → per round, the aggregate figures.
    let mut per_round: Vec<GroupRounds> = Vec::new();
    let total = opts.rounds as usize * opts.clients.len() * modes.len();
    let mut step = 0;
    let mut native_failed = false;
    let mut device = String::new();
    for round in 1..=opts.rounds {
        for &clients in &opts.clients {
            for mode in &modes {
                step += 1;
                if mode == "native" && native_failed {
                    continue;
                }
                eprint!(
                    "[{step}/{total}] round {round}: {mode}, {clients} client{} ... ",
                    if clients == 1 { "" } else { "s" }
                );
                let _ = std::io::stderr().flush();
                let t0 = Instant::now();
                let measured = if mode == RAW_TCP {
                    raw_tcp_group(clients, &opts.workload).map(|r| (r, None))
                } else {
                    match run_group(opts, mode, clients, &endpoints, &shim) {
                        // Once more, said in the report: a long run is not lost to a moment's
                        // failure (an MPS server starting or stopping refused a session's
                        // driver on the H200, session 43).
                        Err(e) if mode != "native" => {
                            eprintln!("failed ({e:#}); trying it once more in 2 s");
                            notes.push(format!(
                                "round {round}, {mode}, {clients} client(s): the first try failed ({e:#}); the figures are the second's"
                            ));
                            std::thread::sleep(Duration::from_secs(2));
                            eprint!("[{step}/{total}] round {round}: {mode}, again ... ");
                            let _ = std::io::stderr().flush();
                            run_group(opts, mode, clients, &endpoints, &shim)
                        }
                        m => m,
                    }
                };
                let (results, server_sched) = match measured {
                    Ok(r) => r,
                    Err(e) if mode == "native" => {
                        eprintln!("failed");
                        let note = format!(
                            "native baseline unavailable ({e:#}); ratios are omitted. Use --no-native where the client host has no GPU."
                        );
                        eprintln!("remora: {note}");
                        notes.push(note);
                        native_failed = true;
                        continue;
                    }
                    Err(e) => {
                        eprintln!("failed");
                        return Err(e);
                    }
                };
                if device.is_empty()
                    && let Some(d) = results.iter().find(|r| !r.device.is_empty())
                {
                    device.clone_from(&d.device);
                }
                let mut agg = aggregate(opts.what, &results);
                if let Some(s) = server_sched {
                    agg.push(("launch_sync.server_cpu".into(), "us".into(), s.cpu_us));
                    agg.push(("launch_sync.server_runq".into(), "us".into(), s.runq_us));
                }
                eprintln!(
                    "{:.1} s: {}",
                    t0.elapsed().as_secs_f64(),
                    agg.iter()
                        .filter(|(m, ..)| !m.ends_with("per_client"))
                        .map(|(m, u, v)| format!("{m} {v:.2} {u}"))
                        .collect::<Vec<_>>()
                        .join(", ")
                );
                let key = (mode.clone(), clients);
                match per_round.iter_mut().find(|(k, _)| *k == key) {
                    Some((_, v)) => v.push(agg),
                    None => per_round.push((key, vec![agg])),
                }
            }
        }
    }
    let figures = figures(&per_round);
    let report = Report::now(
        opts.what.name(),
        device,
        match &opts.server {
            Some(s) => s.to_string(),
            None => "embedded".into(),
        },
        opts.rounds,
        Some(opts.workload),
        figures,
        notes,
    );
    Ok(report)
}

/// Writes a bench report as JSON to `json` and its plot to `png`, when asked, saying so.
pub(crate) fn write_report(report: &Report, json: Option<&Path>, png: Option<&Path>) -> Result<()> {
    if let Some(path) = json {
        let text = serde_json::to_string_pretty(report)?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("cannot write {}", path.display()))?;
        outln!("report written to {}", path.display());
    }
    if let Some(path) = png {
        crate::bench_plot::plot(report, path)?;
        outln!("plot written to {}", path.display());
    }
    Ok(())
}

/// Medians over rounds, with ratios to native at the same number of clients.
fn figures(per_round: &[GroupRounds]) -> Vec<Figure> {
    let mut figs: Vec<Figure> = Vec::new();
    for ((mode, clients), rounds) in per_round {
        let Some(first) = rounds.first() else {
            continue;
        };
        for (metric, unit, _) in first {
            let raw: Vec<f64> = rounds
                .iter()
                .filter_map(|r| r.iter().find(|(m, ..)| m == metric).map(|x| x.2))
                .collect();
            figs.push(Figure {
                mode: mode.clone(),
                clients: *clients,
                metric: metric.clone(),
                unit: unit.clone(),
                value: remora_gpubench::median(&raw),
                ratio_to_native: None,
                ratio_to_raw_tcp: None,
                rounds: raw,
            });
        }
    }
    let natives: Vec<(u32, String, f64)> = figs
        .iter()
        .filter(|f| f.mode == "native")
        .map(|f| (f.clients, f.metric.clone(), f.value))
        .collect();
    for f in figs.iter_mut().filter(|f| f.mode != "native") {
        if let Some((_, _, n)) = natives
            .iter()
            .find(|(c, m, _)| *c == f.clients && *m == f.metric)
            && *n > 0.0
            && n.is_finite()
        {
            f.ratio_to_native = Some((f.value / n * 1000.0).round() / 1000.0);
        }
    }
    // copy.<mem>.<dir>.<kind> against copy.raw.send.<kind> of the plain TCP stream.
    let raws: Vec<(u32, String, f64)> = figs
        .iter()
        .filter(|f| f.mode == RAW_TCP)
        .filter_map(|f| Some((f.clients, f.metric.rsplit('.').next()?.to_owned(), f.value)))
        .collect();
    for f in figs
        .iter_mut()
        .filter(|f| f.mode != RAW_TCP && f.metric.starts_with("copy."))
    {
        let kind = f.metric.rsplit('.').next().unwrap_or_default();
        if let Some((_, _, r)) = raws.iter().find(|(c, k, _)| *c == f.clients && k == kind)
            && *r > 0.0
            && r.is_finite()
        {
            f.ratio_to_raw_tcp = Some((f.value / r * 1000.0).round() / 1000.0);
        }
    }
    figs
}

/// The `--raw-tcp` baseline: `clients` plain TCP streams over loopback at once, each moving
/// `workload.reps` times `workload.bytes` from one buffer to another (after one warm-up
/// transfer that maps both buffers), each transfer timed until the receiver has all of it
/// and says so with one byte. Results are shaped like the workers' (`raw.send`).
fn raw_tcp_group(clients: u32, workload: &Workload) -> Result<Vec<WorkerResult>> {
    let bytes = usize::try_from(workload.bytes).context("--bytes too large")?;
    let reps = workload.reps.max(1);
    let threads: Vec<_> = (0..clients)
        .map(|_| std::thread::spawn(move || raw_tcp_stream(bytes, reps)))
        .collect();
    threads
        .into_iter()
        .map(|t| {
            t.join()
                .map_err(|_| anyhow::anyhow!("a raw TCP baseline thread panicked"))?
        })
        .collect()
}

fn raw_tcp_stream(bytes: usize, reps: u32) -> Result<WorkerResult> {
    use std::io::Read as _;
    use std::net::{TcpListener, TcpStream};
    let now_ns = || {
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos())
    };
    let listener =
        TcpListener::bind("127.0.0.1:0").context("cannot listen on TCP loopback for --raw-tcp")?;
    let addr = listener.local_addr()?;
    let receiver = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        let mut buf = vec![0u8; bytes];
        for _ in 0..=reps {
            s.read_exact(&mut buf)?;
            s.write_all(&[1])?;
        }
        Ok(())
    });
    let mut s = TcpStream::connect(addr).context("cannot connect over TCP loopback")?;
    s.set_nodelay(true)?;
    let data = vec![0x5au8; bytes];
    let mut ack = [0u8; 1];
    s.write_all(&data)?;
    s.read_exact(&mut ack)?;
    let w0 = now_ns();
    let mut gbps = Vec::new();
    for _ in 0..reps {
        let t = Instant::now();
        s.write_all(&data)?;
        s.read_exact(&mut ack)?;
        gbps.push(bytes as f64 / t.elapsed().as_secs_f64() / 1e9);
    }
    let w1 = now_ns();
    receiver
        .join()
        .map_err(|_| anyhow::anyhow!("the raw TCP receiver panicked"))?
        .context("the raw TCP receiver failed")?;
    Ok(WorkerResult {
        copies: vec![("raw.send".into(), remora_gpubench::median(&gbps))],
        spans: vec![("raw.send".into(), w0, w1, bytes as f64 * f64::from(reps))],
        ..Default::default()
    })
}

/// The report as a text table.
pub(crate) fn table(r: &Report) -> String {
    use std::fmt::Write as _;
    let mut s = format!(
        "remora bench {} on {} ({} round{}, median)\n{:<32} {:>7} {:>8} {:>20} {:>10} {:>11}\n",
        r.benchmark,
        if r.device.is_empty() { "?" } else { &r.device },
        r.rounds,
        if r.rounds == 1 { "" } else { "s" },
        "metric",
        "clients",
        "mode",
        "value",
        "vs native",
        "vs raw tcp"
    );
    for f in &r.figures {
        let _ = writeln!(
            s,
            "{:<32} {:>7} {:>8} {:>10.3} {:<9} {:>10} {:>11}",
            f.metric,
            f.clients,
            f.mode,
            f.value,
            f.unit,
            f.ratio_to_native
                .map_or_else(|| "-".to_owned(), |x| format!("x{x:.3}")),
            f.ratio_to_raw_tcp
                .map_or_else(|| "-".to_owned(), |x| format!("x{x:.3}"))
        );
    }
    for n in &r.notes {
        let _ = writeln!(s, "note: {n}");
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn groups_aggregate_and_ratios_compare_the_same_clients() {
        // Three clients of 1000 launches each over spans covering 0..4 ms in all.
        let w = |p: f64, s: f64, start: u128, end: u128| WorkerResult {
            per_launch_us: Some(p),
            sync_p50_us: Some(s),
            sync_p99_us: Some(s * 2.0),
            sync_mean_us: Some(s * 1.5),
            spans: vec![("launch".into(), start, end, 1000.0)],
            ..Default::default()
        };
        let native = aggregate(What::Launch, &[w(4.0, 8.0, 0, 4_000_000)]);
        let shm = aggregate(
            What::Launch,
            &[
                w(5.0, 10.0, 0, 3_000_000),
                w(5.0, 12.0, 1_000_000, 4_000_000),
                w(6.0, 11.0, 500_000, 2_000_000),
            ],
        );
        let rate = shm
            .iter()
            .find(|x| x.0 == "launch.aggregate_rate")
            .unwrap()
            .2;
        assert!((rate - 3000.0 / 4e-3 / 1e6).abs() < 1e-9, "{rate}");
        assert_eq!(
            shm.iter().find(|x| x.0 == "launch_sync.p50").unwrap().2,
            11.0
        );
        assert_eq!(
            shm.iter().find(|x| x.0 == "launch_sync.p99_max").unwrap().2,
            24.0
        );
        // The mean of a round trip: the median over the clients of each one's mean.
        assert_eq!(
            shm.iter().find(|x| x.0 == "launch_sync.mean").unwrap().2,
            16.5
        );
        let figs = figures(&[
            (("native".into(), 1), vec![native.clone(), native]),
            (("shm".into(), 1), vec![shm.clone()]),
            (("shm".into(), 4), vec![shm]),
        ]);
        let f = figs
            .iter()
            .find(|f| f.mode == "shm" && f.clients == 1 && f.metric == "launch.per_launch")
            .unwrap();
        assert_eq!(f.value, 5.0);
        assert_eq!(f.ratio_to_native, Some(1.25));
        // No native run with 4 clients: no ratio rather than a wrong one.
        assert!(
            figs.iter()
                .filter(|f| f.clients == 4)
                .all(|f| f.ratio_to_native.is_none())
        );
    }

    #[test]
    fn copies_compare_with_the_raw_tcp_stream_of_the_same_kind() {
        let agg = |k: &str, g: f64| {
            vec![
                (format!("copy.{k}.per_client"), "GB/s".to_owned(), g),
                (format!("copy.{k}.aggregate"), "GB/s".to_owned(), g * 2.0),
            ]
        };
        let figs = figures(&[
            (("tcp".into(), 1), vec![agg("pinned.htod", 3.0)]),
            ((RAW_TCP.into(), 1), vec![agg("raw.send", 6.0)]),
            (("tcp".into(), 4), vec![agg("pinned.htod", 3.0)]),
        ]);
        let get = |mode: &str, c: u32, m: &str| {
            figs.iter()
                .find(|f| f.mode == mode && f.clients == c && f.metric == m)
                .unwrap()
                .ratio_to_raw_tcp
        };
        assert_eq!(get("tcp", 1, "copy.pinned.htod.per_client"), Some(0.5));
        assert_eq!(get("tcp", 1, "copy.pinned.htod.aggregate"), Some(0.5));
        assert_eq!(get(RAW_TCP, 1, "copy.raw.send.aggregate"), None);
        // No raw stream measured with 4 clients: no ratio.
        assert_eq!(get("tcp", 4, "copy.pinned.htod.per_client"), None);
        assert!(
            table(&Report {
                benchmark: "copy".into(),
                date_unix: 0,
                device: String::new(),
                remora: String::new(),
                commit: String::new(),
                server: "embedded".into(),
                rounds: 1,
                workload: Some(Workload {
                    launches: 1,
                    syncs: 1,
                    bytes: 1,
                    reps: 1,
                    ..Default::default()
                }),
                figures: figs.clone(),
                notes: Vec::new(),
            })
            .contains("x0.500")
        );
    }

    #[test]
    fn raw_tcp_stream_moves_the_bytes() {
        let r = raw_tcp_group(
            2,
            &Workload {
                launches: 1,
                syncs: 1,
                bytes: 1 << 20,
                reps: 3,
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(r.len(), 2);
        assert!(
            r.iter()
                .all(|w| w.copies[0].0 == "raw.send" && w.copies[0].1 > 0.0)
        );
        assert_eq!(r[0].spans[0].3, 3.0 * f64::from(1u32 << 20));
    }

    #[test]
    fn copies_aggregate_per_kind() {
        // Two clients moving 1 GB each; their pinned phases do not overlap (1 s and 1 s in a
        // 2 s span), their pageable phases do (both in the same 1 s).
        let w = |g: f64, start: u128| WorkerResult {
            copies: vec![("pinned.htod".into(), g), ("pageable.dtoh".into(), g / 2.0)],
            spans: vec![
                ("pinned.htod".into(), start, start + 1_000_000_000, 1e9),
                ("pageable.dtoh".into(), 5_000_000_000, 6_000_000_000, 1e9),
            ],
            ..Default::default()
        };
        let a = aggregate(What::Copy, &[w(10.0, 0), w(20.0, 1_000_000_000)]);
        let get = |m: &str| a.iter().find(|x| x.0 == m).unwrap().2;
        assert_eq!(get("copy.pinned.htod.aggregate"), 1.0, "not 2: no overlap");
        assert_eq!(
            get("copy.pinned.htod.per_client"),
            15.0,
            "the median of two: their mean"
        );
        assert_eq!(get("copy.pageable.dtoh.aggregate"), 2.0);
    }
}
