//! `remora bench fairness` (issue 13 §3): two tenants on one GPU, one greedy (spin kernels
//! that fill every SM, kept queued) and one latency-sensitive (empty-kernel launch +
//! synchronize), under each way of sharing the GPU: `off` (the driver's time slicing between
//! the sessions' contexts) and `mps` (`remora serve --gpu-share mps`, each tenant at
//! `--share` percent of the SMs).
//!
//! For each sharing (and natively, as two plain CUDA processes) it runs four scenarios, each a
//! group of `remora bench gpu-worker` clients started together, each client authenticated as
//! its tenant (alice greedy, bob latency or greedy):
//!
//! * `latency_alone`: bob's launch + synchronize alone;
//! * `greedy_alone`: alice's spin kernels alone;
//! * `with_greedy`: both at once;
//! * `two_greedy`: alice and bob both greedy.
//!
//! A greedy client's *GPU share* is its kernels per second over native alice's alone (the
//! whole GPU): the goal is at least 45% for each of two greedy tenants with equal shares, and
//! the latency tenant's p99 beside a greedy one within 2x of its p99 alone. The benchmark
//! starts and stops the MPS control daemon itself when none runs (`--mps-control`).

use std::ffi::OsString;
use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::process::Command;

use anyhow::{Context, Result, bail};
use remora_gpubench::FairWorkload;
use remora_oncrpc::Endpoint;

use crate::bench_gpu::{self, Figure, Report, What, WorkerResult};
use crate::mps::{MpsDaemon, find_mps_control};
use crate::run::{EmbeddedServer, find_shim};

/// `remora bench fairness`'s options.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Ways of sharing the GPU to measure, comma-separated: off (time slicing between the
    /// sessions' contexts), mps (`remora serve --gpu-share mps`, each tenant at --share).
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "off,mps"
    )]
    sharing: Vec<String>,
    /// Each tenant's gpu-share under mps, in percent of the SMs.
    #[arg(long, value_name = "PERCENT", default_value_t = 50)]
    share: u8,
    /// The transport of the remoted clients: shm, unix or tcp.
    #[arg(long, value_name = "T", default_value = "shm")]
    transport: String,
    #[command(flatten)]
    workload: FairWorkload,
    /// The MPS control program (default: nvidia-cuda-mps-control on PATH, else
    /// /usr/local/nvidia/bin/nvidia-cuda-mps-control), used to start the MPS control daemon
    /// for the mps rows when none runs, and to stop it again afterwards.
    #[arg(long, value_name = "PATH")]
    mps_control: Option<PathBuf>,
    /// Also run the fault scenario, last: bob's kernel stores to an illegal address while
    /// alice's greedy kernels run; reports whether alice's work survived (fault isolation:
    /// under MPS one client's fatal fault may end the others'). A client that hangs then
    /// hangs the benchmark, so it is not run by default.
    #[arg(long)]
    fault: bool,
    /// Skip the native scenarios (then GPU shares are not computed).
    #[arg(long)]
    no_native: bool,
    /// Remora's shim (default: beside this executable, or REMORA_SHIM).
    #[arg(long, value_name = "PATH")]
    shim: Option<PathBuf>,
    /// Write the report as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Draw the report as a PNG plot to this file.
    #[arg(long, value_name = "FILE")]
    png: Option<PathBuf>,
}

/// One scenario: its name and its clients (tenant, what the client does).
const SCENARIOS: [(&str, &[(&str, What)]); 4] = [
    ("latency_alone", &[("bob", What::Latency)]),
    ("greedy_alone", &[("alice", What::Greedy)]),
    (
        "with_greedy",
        &[("alice", What::Greedy), ("bob", What::Latency)],
    ),
    (
        "two_greedy",
        &[("alice", What::Greedy), ("bob", What::Greedy)],
    ),
];

/// The fault scenario's name (`--fault`): alice greedy, bob's kernel faulting.
const FAULT_SCENARIO: &str = "fault_beside_greedy";

/// Where the clients of one sharing mode run.
enum Target<'a> {
    Native,
    Remote {
        endpoint: &'a Endpoint,
        shim: &'a Path,
        transport: &'a str,
        tokens: &'a [(String, String)],
    },
}

/// Runs one scenario's clients together.
fn run_scenario(
    target: &Target,
    clients: &[(&str, What)],
    workload: &FairWorkload,
    label: &str,
) -> Result<Vec<WorkerResult>> {
    let exe = std::env::current_exe().context("cannot find the remora executable")?;
    let mut commands = Vec::new();
    for (tenant, what) in clients {
        let mut cmd = Command::new(&exe);
        cmd.args(["bench", "gpu-worker", what.name()])
            .args(workload.to_args());
        match target {
            Target::Native => {
                cmd.arg("--native");
            }
            Target::Remote {
                endpoint,
                shim,
                transport,
                tokens,
            } => {
                let token = tokens
                    .iter()
                    .find(|(t, _)| t == tenant)
                    .map(|(_, k)| k.as_str())
                    .unwrap_or_default();
                cmd.arg("--driver")
                    .arg(shim)
                    .env("REMORA_SERVER", endpoint.to_string())
                    .env("REMORA_TRANSPORT", transport)
                    .env("REMORA_AUTH_TOKEN", token);
            }
        }
        commands.push(cmd);
    }
    bench_gpu::run_workers(commands, label, false, None).map(|(r, _)| r)
}

/// A random token (32 hex digits) for one of the benchmark's tenants.
fn token() -> Result<String> {
    let mut bytes = [0u8; 16];
    let n = rustix::rand::getrandom(&mut bytes, rustix::rand::GetRandomFlags::empty())
        .context("cannot make a token (getrandom)")?;
    if n != bytes.len() {
        bail!("cannot make a token: getrandom gave {n} bytes");
    }
    Ok(bytes.iter().map(|b| format!("{b:02x}")).collect())
}

/// Runs the benchmark: progress on stderr, a table on stdout, the JSON report and the plot
/// when asked.
pub(crate) fn run(a: &Args) -> Result<Report> {
    for s in &a.sharing {
        if !["off", "mps"].contains(&s.as_str()) {
            bail!("unknown sharing {s:?}: use off or mps (comma-separated)");
        }
    }
    if !(1..=100).contains(&a.share) {
        bail!("--share is a percentage from 1 to 100");
    }
    if !["shm", "unix", "tcp"].contains(&a.transport.as_str()) {
        bail!("unknown transport {:?}: use shm, unix or tcp", a.transport);
    }
    let shim = find_shim(a.shim.as_deref())?;
    let mut notes = vec![format!(
        "tenants alice (greedy: spin kernels of 2 blocks x 1024 threads per SM, {} cycles each, \
         two batches of 8 queued) and bob (latency: empty kernel + cuStreamSynchronize, or \
         greedy in two_greedy); {} ms per scenario; remoted over {}; gpu_share = spin blocks/s \
         over native alice alone (blocks x cycles is SM time; under MPS a client sees only its \
         share of the SMs and sizes its kernels to them: greedy.sms figures)",
        a.workload.spin_cycles, a.workload.millis, a.transport
    )];
    let mps_before = MpsDaemon::running();
    if mps_before {
        notes.push(
            "an MPS control daemon was running before the benchmark: native and `off` rows \
             ran under MPS too"
                .into(),
        );
    }
    let mut results: Vec<(String, &str, Vec<WorkerResult>)> = Vec::new();
    let mut device = String::new();
    let fault_clients: &[(&str, What)] = &[("alice", What::Greedy), ("bob", What::Fault)];
    let fault_workload = FairWorkload {
        report_errors: true,
        ..a.workload
    };
    let mut measure = |mode: &str, target: &Target| -> Result<()> {
        let fault = a.fault.then_some((FAULT_SCENARIO, fault_clients));
        for (scenario, clients) in SCENARIOS.into_iter().chain(fault) {
            let workload = if scenario == FAULT_SCENARIO {
                &fault_workload
            } else {
                &a.workload
            };
            eprint!("[{mode}] {scenario} ... ");
            let _ = std::io::stderr().flush();
            let r = run_scenario(target, clients, workload, &format!("{mode} {scenario}"));
            let r = match r {
                Ok(r) => r,
                Err(e) => {
                    eprintln!("failed");
                    return Err(e);
                }
            };
            eprintln!("{}", summary(&r));
            if device.is_empty()
                && let Some(d) = r.iter().find(|r| !r.device.is_empty())
            {
                device.clone_from(&d.device);
            }
            results.push((mode.to_owned(), scenario, r));
        }
        Ok(())
    };
    if !a.no_native {
        measure("native", &Target::Native)?;
    }
    let dir = tempfile::Builder::new()
        .prefix("remora-bench-fairness-")
        .tempdir()
        .context("cannot create a private directory")?;
    let tokens = vec![("alice".to_owned(), token()?), ("bob".to_owned(), token()?)];
    let token_file = dir.path().join("tokens");
    write_private(
        &token_file,
        &tokens
            .iter()
            .map(|(t, k)| format!("{t} {k}\n"))
            .collect::<String>(),
    )?;
    for sharing in &a.sharing {
        let mut serve_args: Vec<OsString> =
            vec!["--auth-token-file".into(), token_file.clone().into()];
        let mut daemon = None;
        let mode = if sharing == "mps" {
            let tenants = dir.path().join("tenants.toml");
            write_private(&tenants, &format!("[tenant]\ngpu-share = {}\n", a.share))?;
            serve_args.extend([
                "--gpu-share".into(),
                "mps".into(),
                "--tenants".into(),
                tenants.into(),
            ]);
            if !MpsDaemon::running() {
                daemon = Some(MpsDaemon::start(&find_mps_control(
                    a.mps_control.as_deref(),
                )?)?);
            }
            format!("mps {}%", a.share)
        } else {
            "off".to_owned()
        };
        let listen = if a.transport == "tcp" {
            Endpoint::Tcp("127.0.0.1:0".into())
        } else {
            Endpoint::Unix(dir.path().join(format!("{sharing}.sock")))
        };
        let (server, endpoint) = EmbeddedServer::start(&listen, &serve_args, false)?;
        let target = Target::Remote {
            endpoint: &endpoint,
            shim: &shim,
            transport: &a.transport,
            tokens: &tokens,
        };
        measure(&mode, &target)?;
        drop(server);
        drop(daemon);
    }
    let (figures, goal_notes) = figures(&results);
    notes.extend(goal_notes);
    let report = Report::now(
        "fairness",
        device,
        "embedded".into(),
        1,
        None,
        figures,
        notes,
    );
    outln!("{}", bench_gpu::table(&report));
    for n in &report.notes {
        outln!("note: {n}");
    }
    bench_gpu::write_report(&report, a.json.as_deref(), a.png.as_deref())?;
    Ok(report)
}

fn write_private(path: &Path, text: &str) -> Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("cannot create {}", path.display()))?;
    f.write_all(text.as_bytes())?;
    Ok(())
}

fn summary(r: &[WorkerResult]) -> String {
    r.iter()
        .map(|w| {
            match (
                w.kernels_per_s,
                w.sync_p50_us,
                w.sync_p99_us,
                w.fault_status,
            ) {
                (Some(k), ..) => format!(
                    "{k:.0} kernels/s{}",
                    w.error
                        .as_ref()
                        .map_or(String::new(), |e| format!(" until: {e}"))
                ),
                (None, Some(p50), Some(p99), _) => format!("p50 {p50:.1} us, p99 {p99:.1} us"),
                (.., Some(rc)) => format!("fault: CUDA error {rc}"),
                _ => "?".into(),
            }
        })
        .collect::<Vec<_>>()
        .join("; ")
}

/// The report's figures, and the notes that hold them against the goals.
fn figures(results: &[(String, &str, Vec<WorkerResult>)]) -> (Vec<Figure>, Vec<String>) {
    // Spin blocks per second: SM time, whatever size the client's kernels had.
    let blocks_per_s = |w: &WorkerResult| {
        w.kernels_per_s
            .map(|k| k * f64::from(w.spin_blocks.unwrap_or(1)))
    };
    let native_rate = results
        .iter()
        .find(|(m, s, _)| m == "native" && *s == "greedy_alone")
        .and_then(|(_, _, r)| r.first())
        .and_then(blocks_per_s);
    let mut figures = Vec::new();
    let fig = |mode: &str, clients: usize, metric: String, unit: &str, value: f64| Figure {
        mode: mode.to_owned(),
        clients: clients as u32,
        metric,
        unit: unit.to_owned(),
        value,
        ratio_to_native: None,
        ratio_to_raw_tcp: None,
        rounds: vec![value],
    };
    let mut notes = Vec::new();
    for (mode, scenario, r) in results {
        if *scenario == FAULT_SCENARIO {
            let greedy = r.first();
            let rc = r.get(1).and_then(|w| w.fault_status);
            notes.push(format!(
                "{mode}: bob's kernel faulted ({}); alice's greedy kernels beside it {}",
                rc.map_or("no status".into(), |rc| format!("CUDA error {rc}")),
                match greedy {
                    Some(WorkerResult { error: Some(e), .. }) => format!("were ended too: {e}"),
                    Some(w) => format!(
                        "survived ({:.0} kernels/s)",
                        w.kernels_per_s.unwrap_or(f64::NAN)
                    ),
                    None => "did not report".into(),
                }
            ));
            continue;
        }
        let clients = r.len();
        for (i, w) in r.iter().enumerate() {
            // Who this client was: the scenario's tenant at the same place.
            let tenant = SCENARIOS
                .iter()
                .find(|(s, _)| s == scenario)
                .and_then(|(_, c)| c.get(i))
                .map_or("?", |(t, _)| *t);
            let role = if scenario.starts_with("two_greedy") {
                tenant
            } else if w.kernels_per_s.is_some() {
                "greedy"
            } else {
                "latency"
            };
            if let Some(k) = w.kernels_per_s {
                figures.push(fig(
                    mode,
                    clients,
                    format!("{scenario}.{role}.kernels_per_s"),
                    "1/s",
                    k,
                ));
                if let Some(b) = w.spin_blocks {
                    figures.push(fig(
                        mode,
                        clients,
                        format!("{scenario}.{role}.sms"),
                        "SMs seen",
                        f64::from(b / 2),
                    ));
                }
                if let (Some(n), Some(b)) = (native_rate, blocks_per_s(w)) {
                    figures.push(fig(
                        mode,
                        clients,
                        format!("{scenario}.{role}.gpu_share"),
                        "fraction",
                        b / n,
                    ));
                }
            }
            if let (Some(p50), Some(p99)) = (w.sync_p50_us, w.sync_p99_us) {
                figures.push(fig(
                    mode,
                    clients,
                    format!("{scenario}.{role}.p50"),
                    "us",
                    p50,
                ));
                figures.push(fig(
                    mode,
                    clients,
                    format!("{scenario}.{role}.p99"),
                    "us",
                    p99,
                ));
            }
        }
    }
    // Latencies against native's in the same scenario.
    let snapshot = figures.clone();
    for f in &mut figures {
        if f.mode == "native" || f.unit != "us" {
            continue;
        }
        f.ratio_to_native = snapshot
            .iter()
            .find(|n| n.mode == "native" && n.metric == f.metric)
            .filter(|n| n.value > 0.0)
            .map(|n| (f.value / n.value * 1000.0).round() / 1000.0);
    }
    let mut modes: Vec<&str> = Vec::new();
    for (m, ..) in results {
        if !modes.contains(&m.as_str()) {
            modes.push(m);
        }
    }
    let get = |mode: &str, metric: &str| {
        figures
            .iter()
            .find(|f| f.mode == mode && f.metric == metric)
            .map(|f| f.value)
    };
    for mode in modes {
        if let (Some(a), Some(b)) = (
            get(mode, "two_greedy.alice.gpu_share"),
            get(mode, "two_greedy.bob.gpu_share"),
        ) {
            notes.push(format!(
                "{mode}: two greedy tenants get {:.1}% and {:.1}% of the GPU (goal: at least 45% each): {}",
                a * 100.0,
                b * 100.0,
                if a.min(b) >= 0.45 { "met" } else { "NOT met" }
            ));
        }
        if let (Some(together), Some(alone)) = (
            get(mode, "with_greedy.latency.p99"),
            get(mode, "latency_alone.latency.p99"),
        ) {
            let x = together / alone;
            notes.push(format!(
                "{mode}: the latency tenant's launch + synchronize p99 beside a greedy tenant is {together:.1} us against {alone:.1} us alone, x{x:.2} (goal: at most 2x): {}",
                if x <= 2.0 { "met" } else { "NOT met" }
            ));
        }
        if let Some(g) = get(mode, "with_greedy.greedy.gpu_share") {
            notes.push(format!(
                "{mode}: the greedy tenant beside the latency one gets {:.1}% of the GPU",
                g * 100.0
            ));
        }
    }
    (figures, notes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn greedy(k: f64) -> WorkerResult {
        WorkerResult {
            kernels_per_s: Some(k),
            ..WorkerResult::default()
        }
    }

    fn latency(p50: f64, p99: f64) -> WorkerResult {
        WorkerResult {
            sync_p50_us: Some(p50),
            sync_p99_us: Some(p99),
            ..WorkerResult::default()
        }
    }

    #[test]
    fn shares_are_against_native_alone_and_goals_are_judged() {
        let results = vec![
            (
                "native".to_owned(),
                "latency_alone",
                vec![latency(8.0, 10.0)],
            ),
            ("native".to_owned(), "greedy_alone", vec![greedy(1000.0)]),
            (
                "native".to_owned(),
                "with_greedy",
                vec![greedy(990.0), latency(900.0, 2000.0)],
            ),
            (
                "native".to_owned(),
                "two_greedy",
                vec![greedy(500.0), greedy(500.0)],
            ),
            (
                "mps 50%".to_owned(),
                "latency_alone",
                vec![latency(14.0, 20.0)],
            ),
            ("mps 50%".to_owned(), "greedy_alone", vec![greedy(500.0)]),
            (
                "mps 50%".to_owned(),
                "with_greedy",
                vec![greedy(495.0), latency(15.0, 30.0)],
            ),
            (
                "mps 50%".to_owned(),
                "two_greedy",
                vec![greedy(480.0), greedy(440.0)],
            ),
        ];
        let (figures, notes) = figures(&results);
        let get = |mode: &str, metric: &str| {
            figures
                .iter()
                .find(|f| f.mode == mode && f.metric == metric)
                .unwrap_or_else(|| panic!("no {mode} {metric}"))
        };
        assert_eq!(get("mps 50%", "two_greedy.alice.gpu_share").value, 0.48);
        assert_eq!(get("mps 50%", "two_greedy.bob.gpu_share").value, 0.44);
        assert_eq!(get("mps 50%", "with_greedy.latency.p99").value, 30.0);
        assert_eq!(
            get("mps 50%", "with_greedy.latency.p99").ratio_to_native,
            Some(0.015)
        );
        assert_eq!(get("native", "greedy_alone.greedy.gpu_share").value, 1.0);
        let note = |prefix: &str| {
            notes
                .iter()
                .find(|n| n.starts_with(prefix))
                .unwrap_or_else(|| panic!("no note {prefix}: {notes:?}"))
                .clone()
        };
        assert!(note("mps 50%: two greedy").ends_with("NOT met"));
        assert!(note("mps 50%: the latency tenant").contains("x1.50"));
        assert!(note("mps 50%: the latency tenant").ends_with(": met"));
        assert!(note("native: the latency tenant").ends_with("NOT met"));
        assert!(note("native: two greedy").ends_with(": met"));
        // The plot draws the shares and latencies per mode.
        let dir = tempfile::tempdir().unwrap();
        let png = dir.path().join("fairness.png");
        let report = Report::now(
            "fairness",
            "GPU".into(),
            "embedded".into(),
            1,
            None,
            figures,
            notes,
        );
        crate::bench_plot::plot(&report, &png).unwrap();
        assert!(std::fs::metadata(&png).unwrap().len() > 1000);
    }

    #[test]
    fn shares_count_blocks_when_mps_shrinks_the_kernels() {
        // Under a 50% MPS share the client sees half the SMs and launches half the blocks:
        // as many kernels per second as alone is then half the GPU, not all of it.
        let sized = |k: f64, blocks: u32| WorkerResult {
            spin_blocks: Some(blocks),
            ..greedy(k)
        };
        let results = vec![
            (
                "native".to_owned(),
                "greedy_alone",
                vec![sized(1000.0, 264)],
            ),
            (
                "mps 50%".to_owned(),
                "two_greedy",
                vec![sized(950.0, 132), sized(940.0, 132)],
            ),
        ];
        let (figures, notes) = figures(&results);
        let get = |metric: &str| {
            figures
                .iter()
                .find(|f| f.mode == "mps 50%" && f.metric == metric)
                .unwrap_or_else(|| panic!("no {metric}"))
                .value
        };
        assert_eq!(get("two_greedy.alice.gpu_share"), 0.475);
        assert_eq!(get("two_greedy.bob.gpu_share"), 0.47);
        assert_eq!(get("two_greedy.alice.sms"), 66.0);
        assert!(
            notes.iter().any(|n| n
                == "mps 50%: two greedy tenants get 47.5% and 47.0% of the GPU (goal: at least 45% each): met"),
            "{notes:?}"
        );
    }

    #[test]
    fn the_fault_scenario_says_whether_the_neighbour_survived() {
        let fault = WorkerResult {
            fault_status: Some(700),
            ..WorkerResult::default()
        };
        let ended = WorkerResult {
            kernels_per_s: Some(10.0),
            error: Some("cuEventSynchronize failed with CUDA error 700".into()),
            ..WorkerResult::default()
        };
        let results = vec![
            (
                "off".to_owned(),
                FAULT_SCENARIO,
                vec![greedy(500.0), fault.clone()],
            ),
            ("mps 50%".to_owned(), FAULT_SCENARIO, vec![ended, fault]),
        ];
        let (figures, notes) = figures(&results);
        assert!(figures.is_empty(), "{figures:?}");
        assert_eq!(
            notes,
            [
                "off: bob's kernel faulted (CUDA error 700); alice's greedy kernels beside it survived (500 kernels/s)",
                "mps 50%: bob's kernel faulted (CUDA error 700); alice's greedy kernels beside it were ended too: cuEventSynchronize failed with CUDA error 700",
            ]
        );
    }

    #[test]
    fn bad_options_are_refused_with_what_to_use() {
        let args = |sharing: &str, share: u8, transport: &str| Args {
            sharing: vec![sharing.into()],
            share,
            transport: transport.into(),
            workload: FairWorkload::default(),
            fault: false,
            mps_control: None,
            no_native: true,
            shim: Some("/nonexistent".into()),
            json: None,
            png: None,
        };
        let e = run(&args("time", 50, "shm")).unwrap_err().to_string();
        assert!(e.contains("use off or mps"), "{e}");
        let e = run(&args("mps", 0, "shm")).unwrap_err().to_string();
        assert!(e.contains("1 to 100"), "{e}");
        let e = run(&args("off", 50, "rdma")).unwrap_err().to_string();
        assert!(e.contains("shm, unix or tcp"), "{e}");
    }
}
