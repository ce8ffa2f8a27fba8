//! `remora bench contention` (issue 12 §4): launch + synchronize latency and launch
//! throughput of 1..N clients while CPU-burning processes compete for the cores, for each way
//! of waiting (`REMORA_WAIT`: `spin`, pure polling; `block`, no spinning; `adaptive`, the
//! default: spinning first or blocking at once, whichever has been faster lately, with a
//! spin budget that follows the waits seen). The policy is given to the servers the
//! benchmark starts and to every client, so it holds in all the places Remora waits: the
//! client for replies (socket reads, shared-memory rings, completion words) and the server for
//! requests. Each round, each policy in turn is one `bench launch` round
//! (`bench_gpu::measure`, its servers started for it), so that drift of the loaded machine
//! hits every policy alike; native runs once per round and burn level. With `--program`/`--programs`, each pair also times a
//! mix of whole CUDA programs against standing servers that wait that way
//! (`bench_startup::measure`): the figure `mix.total`, the summed wall time of one pass.
//!
//! With `--sharing mps` every cell runs again under MPS (natively too: the benchmark starts
//! the MPS control daemon when none runs, and its servers run with `--gpu-share mps`), as
//! modes `native/mps` and `TRANSPORT/mps`. Without MPS each client, native or remoted, has a
//! GPU context of its own, and the GPU time-slices between the contexts that have work
//! queued; with many clients that, not the waiting, sets a round trip (bench/results,
//! session 41: 16 native clients' empty-kernel launch + synchronize p50 822 µs, 8.9 under
//! MPS).

use std::ffi::OsString;
use std::path::PathBuf;
use std::process::{Child, Command, Stdio};

use anyhow::{Context, Result, bail};

use crate::bench_gpu::{self, Figure, Report, What, Workload};
use crate::bench_startup;
use crate::mps::{MpsDaemon, find_mps_control};

/// `remora bench contention`'s options.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// Remoted transports to measure, comma-separated: shm, unix, tcp.
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "shm,tcp"
    )]
    transports: Vec<String>,
    /// Numbers of concurrent clients (separate processes), comma-separated.
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "1,4,16"
    )]
    clients: Vec<u32>,
    /// CPU-burning processes beside the clients, in multiples of this host's cores,
    /// comma-separated (0: none; 2: two busy processes per core).
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "0,1,2"
    )]
    burn: Vec<u32>,
    /// Waiting policies, comma-separated: spin, block and adaptive (adaptive is compared
    /// with the better of spin and block).
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "spin,block,adaptive"
    )]
    policies: Vec<String>,
    /// Rounds per (burn level, policy); figures are medians.
    #[arg(long, default_value_t = 1)]
    rounds: u32,
    /// Launches per client in the throughput burst.
    #[arg(long, default_value_t = 5_000)]
    launches: u32,
    /// Launch + synchronize round trips per client (with --launches 0 and --syncs 0 only
    /// the program mix is measured).
    #[arg(long, default_value_t = 1_000)]
    syncs: u32,
    /// Every Nth launch + synchronize launches a long kernel instead (0: never): one block
    /// spinning `--long-cycles` SM clock cycles, so that the waits alternate between short
    /// and long ones (whether one learned figure per waiter then costs time, issue 12 §4).
    #[arg(long, default_value_t = 0, value_name = "N")]
    long_every: u32,
    /// SM clock cycles the long kernel of `--long-every` spins (2,000,000: about 1 ms at
    /// 2 GHz).
    #[arg(long, default_value_t = remora_gpubench::LONG_CYCLES, value_name = "CYCLES")]
    long_cycles: u64,
    /// A CUDA program of the mix: its command line, split on spaces (repeatable), e.g.
    /// --program "./vecadd cubin". The mix runs, under each load and way of waiting, every
    /// program once natively (at the first way) and against a standing server per
    /// transport, `--rounds` times after an untimed warm-up, as `remora bench startup`.
    #[arg(long = "program", value_name = "CMD ARGS")]
    program: Vec<String>,
    /// A file of programs for the mix, one command line a line (# comments), as `remora
    /// bench startup --programs` (gpu/startup-programs.txt, in the build directory).
    #[arg(long, value_name = "FILE")]
    programs: Option<PathBuf>,
    /// Skip the native baseline (no ratios).
    #[arg(long)]
    no_native: bool,
    /// Remora's shim (default: beside this executable, or REMORA_SHIM).
    #[arg(long, value_name = "PATH")]
    shim: Option<PathBuf>,
    /// Ways of sharing the GPU, comma-separated: off (the driver's time-slicing between the
    /// clients' contexts) and mps (every cell again under MPS, native clients too: the MPS
    /// control daemon is started when none runs and stopped afterwards, and the servers run
    /// with --gpu-share mps; modes native/mps and TRANSPORT/mps).
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "off"
    )]
    sharing: Vec<String>,
    /// The MPS control program for --sharing mps (default: nvidia-cuda-mps-control on PATH,
    /// else /usr/local/nvidia/bin/nvidia-cuda-mps-control).
    #[arg(long, value_name = "PATH")]
    mps_control: Option<PathBuf>,
    /// An extra argument for the embedded servers (repeatable).
    #[arg(long = "serve-arg", value_name = "ARG", allow_hyphen_values = true)]
    serve_arg: Vec<OsString>,
    /// Write the report as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Draw the report as a PNG plot to this file.
    #[arg(long, value_name = "FILE")]
    png: Option<PathBuf>,
}

/// CPU-burning processes (`remora bench burn`), killed on drop.
struct Burners(Vec<Child>);

impl Drop for Burners {
    fn drop(&mut self) {
        for c in &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn burners(n: usize) -> Result<Burners> {
    let exe = std::env::current_exe().context("cannot find the remora executable")?;
    let mut b = Burners(Vec::new());
    for _ in 0..n {
        b.0.push(
            Command::new(&exe)
                .args(["bench", "burn"])
                .env(BURN_PARENT, std::process::id().to_string())
                .stdin(Stdio::null())
                .stdout(Stdio::null())
                .spawn()
                .context("cannot start a CPU burner (remora bench burn)")?,
        );
    }
    Ok(b)
}

/// The benchmark's pid, given to its burners: a burner whose parent is no longer that one
/// (the benchmark killed before the burner asked to die with it) stops at once.
const BURN_PARENT: &str = "REMORA_BURN_PARENT";

/// `remora bench burn`: keeps one core busy until killed, or until the benchmark that
/// started it is gone (a benchmark killed by a time limit must not leave its burners
/// taking the host's cores from whatever runs next).
pub(crate) fn burn() -> ! {
    // Die with the benchmark: SIGKILL when the thread that started us ends (burners are
    // started by the benchmark's main thread, which lives as long as the benchmark does).
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::KILL));
    let parent = rustix::process::getppid().map(|p| p.as_raw_nonzero().get());
    if let Some(want) = std::env::var(BURN_PARENT)
        .ok()
        .and_then(|p| p.parse::<i32>().ok())
        && parent != Some(want)
    {
        eprintln!(
            "remora bench burn: the benchmark that started this burner (pid {want}) is gone; exiting"
        );
        std::process::exit(0);
    }
    let mut x = 0u64;
    loop {
        x = std::hint::black_box(x.wrapping_mul(6364136223846793005).wrapping_add(1));
    }
}

/// Runs the benchmark: progress on stderr, a table on stdout, the JSON report and the plot
/// when asked.
pub(crate) fn run(a: &Args) -> Result<Report> {
    for p in &a.policies {
        if !["spin", "block", "adaptive"].contains(&p.as_str()) {
            bail!("unknown policy {p:?}: use spin, block or adaptive (comma-separated)");
        }
    }
    if a.burn.is_empty() || a.burn.iter().any(|&b| b > 8) {
        bail!("--burn takes multiples of the cores from 0 to 8, e.g. 0,1,2");
    }
    let mix = !a.program.is_empty() || a.programs.is_some();
    let loops = a.launches > 0 || a.syncs > 0;
    if !mix && !loops {
        bail!(
            "nothing to measure: --launches 0 and --syncs 0 leave only the program mix, and \
             no program was named (--program \"CMD ARGS\" or --programs FILE)"
        );
    }
    if a.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    if a.sharing.is_empty()
        || a.sharing
            .iter()
            .any(|s| !["off", "mps"].contains(&s.as_str()))
    {
        bail!("--sharing takes off and mps (comma-separated), e.g. off,mps");
    }
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mut figures: Vec<Figure> = Vec::new();
    let mut notes = vec![format!(
        "{cores} cores; burn=Nx runs N CPU-burning processes per core beside the clients"
    )];
    // The waiting knobs the servers and clients inherit (an experiment is measured by setting
    // one for a run): each set one is named, so that a result file says what it measured.
    notes.extend(wait_knobs(std::env::vars()));
    notes.extend(workload_note(a.long_every, a.long_cycles));
    if MpsDaemon::running() {
        notes.push(
            "an MPS control daemon was running before the benchmark: the `off` rows ran under \
             MPS too (their clients' contexts shared as under mps, only the servers' \
             --gpu-share differs)"
                .into(),
        );
    }
    let mut device = String::new();
    for sharing in &a.sharing {
        let suffix = sharing_label(sharing);
        let mut serve_args = a.serve_arg.clone();
        // Stopped (when this benchmark started it) once this sharing's rows are done.
        let _daemon = if suffix.is_empty() {
            None
        } else {
            serve_args.extend(["--gpu-share".into(), "mps".into()]);
            notes.push(
                "sharing mps: native/mps is the native clients under the MPS control daemon, \
                 TRANSPORT/mps the servers with --gpu-share mps (every session's context in the \
                 one MPS server, the whole GPU each)"
                    .into(),
            );
            if MpsDaemon::running() {
                None
            } else {
                Some(MpsDaemon::start(&find_mps_control(
                    a.mps_control.as_deref(),
                )?)?)
            }
        };
        measure_sharing(
            a,
            suffix,
            &serve_args,
            &mut figures,
            &mut notes,
            &mut device,
        )?;
    }
    let report = contention_report(device, figures, notes, a.rounds, a);
    outln!("{}", bench_gpu::table(&report));
    bench_gpu::write_report(&report, a.json.as_deref(), a.png.as_deref())?;
    Ok(report)
}

/// Every (burn level, round, policy) of one way of sharing the GPU, its modes' names ending
/// in `suffix` (`/mps`, or nothing for off), its servers started with `serve_args`; figures
/// and notes added to `figures` and `notes` (the report so far, written after each round
/// with --json).
fn measure_sharing(
    a: &Args,
    suffix: &str,
    serve_args: &[OsString],
    figures: &mut Vec<Figure>,
    notes: &mut Vec<String>,
    device: &mut String,
) -> Result<()> {
    let cores = std::thread::available_parallelism().map_or(1, |n| n.get());
    let mix = !a.program.is_empty() || a.programs.is_some();
    let loops = a.launches > 0 || a.syncs > 0;
    let shared = if suffix.is_empty() { "" } else { " under MPS" };
    let mut mix_noted = false;
    for &burn in &a.burn {
        let n = burn as usize * cores;
        let _burners = burners(n)?;
        if mix {
            for (i, policy) in a.policies.iter().enumerate() {
                eprintln!(
                    "== burn={burn}x ({n} burning processes){shared}, {}: program mix",
                    shown_env(policy)
                );
                let r = bench_startup::measure(&bench_startup::Args::for_mix(
                    a.program.clone(),
                    a.programs.clone(),
                    a.transports.clone(),
                    !a.no_native && i == 0,
                    a.rounds,
                    a.shim.clone(),
                    serve_args.to_vec(),
                    policy_env(policy),
                ))?;
                if device.is_empty() {
                    *device = r.device;
                }
                if !mix_noted {
                    // How the mix was run (programs, servers' arguments), once.
                    notes.extend(r.notes.into_iter().map(|n| format!("mix: {n}")));
                    mix_noted = true;
                }
                figures.extend(mix_figures(r.figures, policy, burn, suffix));
            }
        }
        if !loops {
            continue;
        }
        // Rounds outermost and the ways of waiting in turn within each, so that drift of the
        // loaded machine (the burners settling, the clock) hits every way alike: one
        // `bench launch` round per (round, way), its servers started for it.
        let mut rounds: Vec<Figure> = Vec::new();
        for round in 1..=a.rounds {
            for (i, policy) in a.policies.iter().enumerate() {
                eprintln!(
                    "== burn={burn}x ({n} burning processes){shared}, {}, round {round}/{}",
                    shown_env(policy),
                    a.rounds
                );
                let opts = bench_gpu::Options {
                    what: What::Launch,
                    server: None,
                    transports: a.transports.clone(),
                    clients: a.clients.clone(),
                    rounds: 1,
                    native: !a.no_native && i == 0,
                    workload: Workload {
                        launches: a.launches,
                        syncs: a.syncs,
                        bytes: 0,
                        reps: 1,
                        long_every: a.long_every,
                        long_cycles: a.long_cycles,
                    },
                    shim: a.shim.clone(),
                    serve_args: serve_args.to_vec(),
                    json: None,
                    png: None,
                    raw_tcp: false,
                    env: policy_env(policy),
                };
                let r = bench_gpu::measure(&opts)?;
                if device.is_empty() {
                    *device = r.device;
                }
                for note in r.notes {
                    if !notes.contains(&note) {
                        notes.push(note);
                    }
                }
                for mut f in r.figures {
                    f.mode = if f.mode == "native" {
                        format!("native{suffix} burn={burn}x")
                    } else {
                        format!("{}{suffix} {policy} burn={burn}x", f.mode)
                    };
                    f.ratio_to_native = None;
                    rounds.push(f);
                }
            }
            if let Some(path) = &a.json {
                write_partial(path, device, figures, &rounds, notes, a, burn, round)?;
            }
        }
        figures.extend(merge_rounds(rounds));
    }
    Ok(())
}

/// Writes the report so far to `path` (the JSON only), after round `round` of burn level
/// `burn`: `figures` the earlier burn levels', `rounds` this level's rounds so far. The full
/// report replaces it at the end; until then a run cut short (a device call's time limit)
/// still leaves the rounds it finished, marked partial in its notes.
#[allow(clippy::too_many_arguments)]
fn write_partial(
    path: &std::path::Path,
    device: &str,
    figures: &[Figure],
    rounds: &[Figure],
    notes: &[String],
    a: &Args,
    burn: u32,
    round: u32,
) -> Result<()> {
    let mut figs = figures.to_vec();
    figs.extend(merge_rounds(rounds.to_vec()));
    let mut notes = notes.to_vec();
    notes.push(format!(
        "partial: written after round {round}/{} at burn={burn}x (burn levels {:?}); the whole run was not over",
        a.rounds, a.burn
    ));
    let report = contention_report(device.to_owned(), figs, notes, round, a);
    bench_gpu::write_report(&report, Some(path), None)
}

/// The report of `figures` (ratios and the comparison notes filled in by [`compare`]) over
/// `rounds` rounds.
fn contention_report(
    device: String,
    mut figures: Vec<Figure>,
    mut notes: Vec<String>,
    rounds: u32,
    a: &Args,
) -> Report {
    compare(&mut figures, &mut notes, a);
    Report::now(
        "contention",
        device,
        "embedded".into(),
        rounds,
        None,
        figures,
        notes,
    )
}

/// The variables that set `policy` in the servers and the clients: `REMORA_WAIT`.
fn policy_env(policy: &str) -> Vec<(String, String)> {
    vec![("REMORA_WAIT".into(), policy.into())]
}

/// [`policy_env`] as `K=V K=V`, for progress lines.
fn shown_env(policy: &str) -> String {
    policy_env(policy)
        .iter()
        .map(|(k, v)| format!("{k}={v}"))
        .collect::<Vec<_>>()
        .join(" ")
}

/// The mix's figures of one (burn level, policy) run of `bench startup`: its
/// `whole_run.total` per mode, as `mix.total` of "nativeSUFFIX burn=Nx" or
/// "TRANSPORTSUFFIX POLICY burn=Nx" (the standing modes; `suffix` names the sharing, as
/// [`sharing_suffix`] reads it back).
fn mix_figures(figures: Vec<Figure>, policy: &str, burn: u32, suffix: &str) -> Vec<Figure> {
    figures
        .into_iter()
        .filter(|f| f.metric == "whole_run.total")
        .filter_map(|mut f| {
            // Native runs beside the standing servers: bench_startup's native-held.
            f.mode = if f.mode == "native" || f.mode == "native-held" {
                format!("native{suffix} burn={burn}x")
            } else {
                let t = f.mode.strip_prefix("standing-")?;
                format!("{t}{suffix} {policy} burn={burn}x")
            };
            f.metric = "mix.total".into();
            f.ratio_to_native = None;
            Some(f)
        })
        .collect()
}

/// One figure per (mode, clients, metric) of `figures` (one round each, or a few), its
/// rounds those of all of them in order and its value their median; in the order first seen.
fn merge_rounds(figures: Vec<Figure>) -> Vec<Figure> {
    let mut merged: Vec<Figure> = Vec::new();
    for f in figures {
        match merged
            .iter_mut()
            .find(|m| m.mode == f.mode && m.clients == f.clients && m.metric == f.metric)
        {
            Some(m) => m.rounds.extend(f.rounds),
            None => merged.push(f),
        }
    }
    for m in &mut merged {
        m.value = remora_gpubench::median(&m.rounds);
    }
    merged
}

/// ` [LOW-HIGH]`, the range of a figure's rounds, when it has more than one: one way's rounds
/// can differ by more than the ways do (loaded cells), which a note's ratio alone hides.
fn spread(rounds: &[f64], digits: usize) -> String {
    let lo = rounds.iter().copied().fold(f64::INFINITY, f64::min);
    let hi = rounds.iter().copied().fold(f64::NEG_INFINITY, f64::max);
    if rounds.len() < 2 {
        String::new()
    } else {
        format!(" [{lo:.digits$}-{hi:.digits$}]")
    }
}

/// ` (per round x.. x..)`: adaptive against the better fixed way (the one of spin and block
/// with the lower median) round by round, when there are several rounds. The rounds run the
/// three ways back to back (rounds outermost), so a round's ratio compares ways measured
/// minutes apart at most: where the medians' ratio hides rounds that disagree (a loaded cell
/// whose GPU or scheduler changed regime between rounds), these show it. (Against the lower
/// of the two in each round instead, a noisy cell would favour the fixed ways: the minimum of
/// two noisy figures lies below either's median.)
fn per_round(adaptive: &[f64], better: &[f64]) -> String {
    let ratios = round_ratios(adaptive, better);
    if ratios.len() < 2 {
        return String::new();
    }
    let ratios: Vec<String> = ratios.iter().map(|r| format!("x{r:.2}")).collect();
    format!(" (per round {})", ratios.join(" "))
}

/// Adaptive against the better fixed way, round by round.
fn round_ratios(adaptive: &[f64], better: &[f64]) -> Vec<f64> {
    adaptive.iter().zip(better).map(|(a, b)| a / b).collect()
}

/// Issue 12 §4's goal: adaptive within 10% of the better fixed way.
const GOAL_RATIO: f64 = 1.10;

/// The 1-based order statistics `k` and `n + 1 - k` that bound the median of `n` rounds'
/// ratios, distribution-free, with the interval's coverage `1 - 2 P(Binomial(n, 1/2) < k)`:
/// the narrowest such interval whose coverage is still at least 90%, or the widest (`k` = 1)
/// when even that covers less (fewer than 5 rounds).
fn median_interval(n: usize) -> (usize, f64) {
    let choose = |i: usize| (0..i).fold(1.0, |acc, j| acc * (n - j) as f64 / (j + 1) as f64);
    let cover = |k: usize| 1.0 - 2.0 * (0..k).map(choose).sum::<f64>() / 2f64.powi(n as i32);
    let mut k = 1;
    while k < n / 2 && cover(k + 1) >= 0.9 {
        k += 1;
    }
    (k, cover(k))
}

/// Issue 12 §4's second goal: under 2x oversubscription, pure polling costs at least twice
/// adaptive's CPU per round trip (client and server together).
const POLLING_CPU_GOAL: f64 = 2.0;

/// `; NN% interval of the rounds' median xLO-xHI: met|missed|undecided at x1.10`: whether the
/// rounds decide §4's goal. Met when the interval lies at or below the goal, missed when it
/// lies above, undecided otherwise (the rounds disagree more than the goal's margin). Empty
/// with fewer than 3 rounds.
fn verdict(ratios: &[f64]) -> String {
    verdict_on(ratios, GOAL_RATIO, false)
}

/// [`verdict`] against `goal`, met at or below it, or with `at_least`, met at or above it.
fn verdict_on(ratios: &[f64], goal: f64, at_least: bool) -> String {
    let n = ratios.len();
    if n < 3 {
        return String::new();
    }
    let mut r = ratios.to_vec();
    r.sort_by(f64::total_cmp);
    let (k, cover) = median_interval(n);
    let (lo, hi) = (r[k - 1], r[n - k]);
    let (met, missed) = if at_least {
        (lo >= goal, hi < goal)
    } else {
        (hi <= goal, lo > goal)
    };
    let word = if met {
        "met"
    } else if missed {
        "missed"
    } else {
        "undecided"
    };
    format!(
        "; {:.0}% interval of the rounds' median x{lo:.2}-x{hi:.2}: {word} at x{goal:.2}",
        cover * 100.0
    )
}

/// Client plus server CPU per round trip, round by round, of one way's figures.
fn cpu_rounds(client: &Figure, server: &Figure) -> Vec<f64> {
    client
        .rounds
        .iter()
        .zip(&server.rounds)
        .map(|(c, s)| c + s)
        .collect()
}

/// The note on §4's second goal for one cell: pure polling's CPU per round trip (client and
/// server) against adaptive's, from the per-round sums; judged (`verdict_on`, at least
/// [`POLLING_CPU_GOAL`]) under 2x load and more, where the goal applies. None without both
/// ways' client and server figures.
fn polling_cpu_note(
    cell: &str,
    burn: u32,
    spin: (&Figure, &Figure),
    adaptive: (&Figure, &Figure),
) -> Option<String> {
    let sp = cpu_rounds(spin.0, spin.1);
    let ad = cpu_rounds(adaptive.0, adaptive.1);
    if sp.is_empty() || ad.is_empty() {
        return None;
    }
    let (sp_med, ad_med) = (remora_gpubench::median(&sp), remora_gpubench::median(&ad));
    // Polling over adaptive, round by round (the ways of a round run back to back).
    let ratios = round_ratios(&sp, &ad);
    let judged = if burn >= 2 {
        verdict_on(&ratios, POLLING_CPU_GOAL, true)
    } else {
        String::new()
    };
    Some(format!(
        "{cell} CPU per round trip (client + server): spin {sp_med:.2} us{}, adaptive {ad_med:.2}{}: spin / adaptive = x{:.2}{}{judged}",
        spread(&sp, 2),
        spread(&ad, 2),
        sp_med / ad_med.max(f64::MIN_POSITIVE),
        per_round(&sp, &ad),
    ))
}

/// The sharing a mode's name ends its first word with: `/mps` for "shm/mps adaptive
/// burn=2x" and "native/mps burn=2x", nothing for the rows without MPS.
fn sharing_suffix(mode: &str) -> &str {
    let first = mode.split(' ').next().unwrap_or_default();
    first.find('/').map_or("", |i| &first[i..])
}

/// The suffix a way of sharing (`off`, `mps`) gives its modes' names, as [`sharing_suffix`]
/// reads it back.
fn sharing_label(sharing: &str) -> &'static str {
    if sharing == "mps" { "/mps" } else { "" }
}

/// The figure of `mode` with `clients` clients named `metric`.
fn find<'a>(figs: &'a [Figure], mode: &str, clients: u32, metric: &str) -> Option<&'a Figure> {
    figs.iter()
        .find(|f| f.mode == mode && f.clients == clients && f.metric == metric)
}

/// The `REMORA_WAIT_*` variables among `vars` other than `REMORA_WAIT_TRACE` (the policy,
/// `REMORA_WAIT`, is set per run by the benchmark itself), `REMORA_SERVE_AVOID_PEER_CPU`
/// (server placement, which the servers and clients it starts read too) and
/// `REMORA_SERVE_WAIT` (the servers' way of waiting over the run's), as notes, sorted.
fn wait_knobs(vars: impl Iterator<Item = (String, String)>) -> Vec<String> {
    let mut knobs: Vec<String> = vars
        .filter(|(k, _)| {
            (k.starts_with("REMORA_WAIT_") && k != "REMORA_WAIT_TRACE")
                || k == "REMORA_SERVE_AVOID_PEER_CPU"
                || k == "REMORA_SERVE_WAIT"
        })
        .map(|(k, v)| format!("environment: {k}={v}"))
        .collect();
    knobs.sort();
    knobs
}

/// Fills each remoted figure's ratio to native at the same burn level and client count, and
/// notes, per (transport, burn, clients), adaptive against the better of spin and block.
fn compare(figures: &mut [Figure], notes: &mut Vec<String>, a: &Args) {
    let snapshot = figures.to_vec();
    for f in figures.iter_mut() {
        let Some(burn) = f.mode.rsplit(' ').next().map(str::to_owned) else {
            continue;
        };
        if f.mode.starts_with("native") {
            continue;
        }
        let sfx = sharing_suffix(&f.mode);
        let native = find(
            &snapshot,
            &format!("native{sfx} {burn}"),
            f.clients,
            &f.metric,
        )
        .map(|n| n.value);
        f.ratio_to_native = native
            .filter(|n| *n > 0.0)
            .map(|n| (f.value / n * 1000.0).round() / 1000.0);
    }
    // (clients, metric) pairs to compare; the mix runs one program at a time.
    let mut cells: Vec<(u32, &str)> = Vec::new();
    for &clients in &a.clients {
        for metric in [
            "launch_sync.p50",
            "launch_sync.mean",
            "launch_sync.client_cpu",
            "launch_sync.server_cpu",
            "launch_sync.client_runq",
            "launch_sync.server_runq",
            "launch.per_launch",
        ] {
            cells.push((clients, metric));
        }
    }
    cells.push((1, "mix.total"));
    let labels: Vec<String> = a
        .sharing
        .iter()
        .flat_map(|s| {
            let sfx = sharing_label(s);
            a.transports.iter().map(move |t| format!("{t}{sfx}"))
        })
        .collect();
    for t in &labels {
        for &burn in &a.burn {
            for &(clients, metric) in &cells {
                let get =
                    |p: &str| find(&snapshot, &format!("{t} {p} burn={burn}x"), clients, metric);
                let (Some(ad), Some(sp), Some(bl)) = (get("adaptive"), get("spin"), get("block"))
                else {
                    continue;
                };
                let (unit, digits) = if metric == "mix.total" {
                    ("s", 3)
                } else {
                    ("us", 2)
                };
                // The better fixed way: the one with the lower median.
                let better = if sp.value <= bl.value {
                    &sp.rounds
                } else {
                    &bl.rounds
                };
                // The goal is about latency: the verdict goes with those figures only.
                let judged = matches!(metric, "launch_sync.mean" | "launch_sync.p50" | "mix.total")
                    .then(|| verdict(&round_ratios(&ad.rounds, better)))
                    .unwrap_or_default();
                notes.push(format!(
                    "{t} burn={burn}x {clients} client(s) {metric}: adaptive {:.digits$} {unit}{}, spin {:.digits$}{}, block {:.digits$}{}: adaptive / better = x{:.2}{}, spin / adaptive = x{:.2}{judged}",
                    ad.value,
                    spread(&ad.rounds, digits),
                    sp.value,
                    spread(&sp.rounds, digits),
                    bl.value,
                    spread(&bl.rounds, digits),
                    ad.value / sp.value.min(bl.value),
                    per_round(&ad.rounds, better),
                    sp.value / ad.value
                ));
            }
            for &clients in &a.clients {
                let get = |p: &str, metric: &str| {
                    find(&snapshot, &format!("{t} {p} burn={burn}x"), clients, metric)
                };
                let pair = |p: &str| {
                    Some((
                        get(p, "launch_sync.client_cpu")?,
                        get(p, "launch_sync.server_cpu")?,
                    ))
                };
                let (Some(spin), Some(adaptive)) = (pair("spin"), pair("adaptive")) else {
                    continue;
                };
                let cell = format!("{t} burn={burn}x {clients} client(s)");
                notes.extend(polling_cpu_note(&cell, burn, spin, adaptive));
            }
        }
    }
}

/// The report's note on a workload other than the plain loop (`--long-every`), which
/// `gpu/tools/issue12_goals.py` keeps apart from the plain loop's cells.
fn workload_note(long_every: u32, long_cycles: u64) -> Option<String> {
    (long_every > 0).then(|| {
        format!(
            "workload: every {long_every}th launch + synchronize launches the long kernel \
             (--long-every {long_every}, one block spinning {long_cycles} SM clock cycles)"
        )
    })
}

#[cfg(test)]
mod tests {
    use super::{
        Args, Figure, compare, median_interval, merge_rounds, mix_figures, per_round,
        polling_cpu_note, sharing_suffix, spread, verdict, verdict_on, wait_knobs, workload_note,
        write_partial,
    };

    fn args(extra: &[&str]) -> Args {
        #[derive(clap::Parser)]
        struct Cli {
            #[command(flatten)]
            a: Args,
        }
        let mut argv = vec!["contention"];
        argv.extend(extra);
        <Cli as clap::Parser>::parse_from(argv).a
    }

    #[test]
    fn a_long_kernel_workload_is_named_in_the_notes() {
        assert_eq!(workload_note(0, 2_000_000), None);
        let note = workload_note(4, 2_000_000).unwrap();
        assert!(
            note.starts_with("workload: every 4th launch + synchronize"),
            "{note}"
        );
        assert!(
            note.contains("--long-every 4") && note.contains("2000000"),
            "{note}"
        );
    }

    #[test]
    fn the_mps_rows_compare_with_native_under_mps_and_apart_from_the_others() {
        let a = args(&[
            "--transports=shm",
            "--clients=16",
            "--burn=2",
            "--sharing=off,mps",
        ]);
        let m = "launch_sync.p50";
        let mut figures = vec![
            fig("native burn=2x", 16, m, &[800.0]),
            fig("native/mps burn=2x", 16, m, &[9.0]),
            fig("shm spin burn=2x", 16, m, &[10.0]),
            fig("shm block burn=2x", 16, m, &[900.0]),
            fig("shm adaptive burn=2x", 16, m, &[950.0]),
            fig("shm/mps spin burn=2x", 16, m, &[9.0]),
            fig("shm/mps block burn=2x", 16, m, &[36.0]),
            fig("shm/mps adaptive burn=2x", 16, m, &[18.0]),
        ];
        let mut notes = Vec::new();
        compare(&mut figures, &mut notes, &a);
        let ratio = |mode: &str| {
            figures
                .iter()
                .find(|f| f.mode == mode)
                .unwrap()
                .ratio_to_native
        };
        // Each against native in its own way of sharing.
        assert_eq!(ratio("shm adaptive burn=2x"), Some(1.188));
        assert_eq!(ratio("shm/mps adaptive burn=2x"), Some(2.0));
        assert_eq!(ratio("native/mps burn=2x"), None);
        let note = |prefix: &str| {
            notes
                .iter()
                .find(|n| n.starts_with(prefix))
                .unwrap_or_else(|| panic!("no note {prefix:?} in {notes:?}"))
                .clone()
        };
        // Adaptive against the better of its own sharing's fixed ways.
        assert!(note("shm burn=2x 16 client(s) launch_sync.p50").contains("x95.00"));
        assert!(note("shm/mps burn=2x 16 client(s) launch_sync.p50").contains("x2.00"));
        assert_eq!(sharing_suffix("shm/mps adaptive burn=2x"), "/mps");
        assert_eq!(sharing_suffix("native burn=1x"), "");
    }

    #[test]
    fn the_mix_of_a_sharing_is_named_for_it() {
        let mut total = fig("standing-shm", 1, "whole_run.total", &[2.0]);
        total.value = 2.0;
        let held = fig("native-held", 1, "whole_run.total", &[1.5]);
        let modes: Vec<String> = mix_figures(vec![total, held], "block", 1, "/mps")
            .into_iter()
            .map(|f| format!("{} {}", f.mode, f.metric))
            .collect();
        assert_eq!(
            modes,
            [
                "shm/mps block burn=1x mix.total",
                "native/mps burn=1x mix.total"
            ]
        );
    }

    #[test]
    fn an_unknown_sharing_is_refused_before_anything_starts() {
        let a = args(&["--sharing=off,vgpu", "--no-native"]);
        let e = super::run(&a).unwrap_err().to_string();
        assert!(e.contains("--sharing takes off and mps"), "{e}");
    }

    #[test]
    fn a_partial_report_holds_the_rounds_so_far_and_says_so() {
        let a = args(&[
            "--transports=shm",
            "--clients=1",
            "--burn=1,2",
            "--rounds=3",
        ]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("partial.json");
        let earlier = [fig(
            "shm spin burn=1x",
            1,
            "launch_sync.mean",
            &[10.0, 11.0, 12.0],
        )];
        let rounds = [
            fig("shm spin burn=2x", 1, "launch_sync.mean", &[20.0]),
            fig("shm block burn=2x", 1, "launch_sync.mean", &[30.0]),
            fig("shm adaptive burn=2x", 1, "launch_sync.mean", &[25.0]),
        ];
        let notes = vec!["environment: REMORA_WAIT_HOLD_RULE=fixed".to_owned()];
        write_partial(&path, "H200", &earlier, &rounds, &notes, &a, 2, 1).unwrap();
        let report: serde_json::Value =
            serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
        let notes = report["notes"].as_array().unwrap();
        assert!(
            notes.iter().any(|n| n
                .as_str()
                .unwrap()
                .starts_with("partial: written after round 1/3 at burn=2x")),
            "{notes:?}"
        );
        assert!(
            notes
                .iter()
                .any(|n| n.as_str().unwrap().contains("environment:"))
        );
        // This level's round compared (adaptive against the better of spin and block).
        assert!(
            notes.iter().any(|n| n
                .as_str()
                .unwrap()
                .contains("burn=2x 1 client(s) launch_sync.mean: adaptive 25.00")),
            "{notes:?}"
        );
        assert_eq!(report["figures"].as_array().unwrap().len(), 4);
    }

    #[test]
    fn the_median_interval_is_the_narrowest_covering_90_percent() {
        // 4 rounds: only min-max, which covers 87.5%.
        let (k, c) = median_interval(4);
        assert_eq!(k, 1);
        assert!((c - 0.875).abs() < 1e-9);
        // 8 rounds: the 2nd and 7th cover 1 - 2 * 9/256.
        let (k, c) = median_interval(8);
        assert_eq!(k, 2);
        assert!((c - (1.0 - 18.0 / 256.0)).abs() < 1e-9);
        // 12 rounds: the 3rd and 10th (96.1%); the 4th and 9th would cover 85.4%.
        assert_eq!(median_interval(12).0, 3);
    }

    #[test]
    fn the_verdict_says_met_missed_or_undecided() {
        assert_eq!(
            verdict(&[0.9, 1.05, 0.8, 1.0]),
            "; 88% interval of the rounds' median x0.80-x1.05: met at x1.10"
        );
        assert!(verdict(&[1.2, 1.5, 1.3, 1.11]).ends_with("x1.11-x1.50: missed at x1.10"));
        assert!(verdict(&[0.82, 3.27, 0.99, 1.53]).ends_with("undecided at x1.10"));
        // Too few rounds to say anything.
        assert_eq!(verdict(&[1.0, 1.0]), "");
    }

    #[test]
    fn the_polling_cpu_goal_is_met_at_or_above_twice_adaptives() {
        assert!(verdict_on(&[2.5, 3.0, 2.0, 4.0, 2.2], 2.0, true).ends_with(": met at x2.00"));
        assert!(verdict_on(&[1.5, 1.9, 1.2, 1.0], 2.0, true).ends_with(": missed at x2.00"));
        assert!(verdict_on(&[1.5, 9.0, 3.0, 2.5], 2.0, true).ends_with(": undecided at x2.00"));
    }

    #[test]
    fn the_polling_cpu_note_sums_client_and_server_round_by_round() {
        let cpu = |way: &str, side: &str, rounds: &[f64]| {
            let metric = format!("launch_sync.{side}_cpu");
            fig(&format!("shm {way} burn=2x"), 1, &metric, rounds)
        };
        let sc = cpu("spin", "client", &[20.0, 30.0, 200.0]);
        let ss = cpu("spin", "server", &[20.0, 30.0, 200.0]);
        let ac = cpu("adaptive", "client", &[10.0, 12.0, 10.0]);
        let asv = cpu("adaptive", "server", &[10.0, 13.0, 10.0]);
        let note = polling_cpu_note("shm burn=2x 1 client(s)", 2, (&sc, &ss), (&ac, &asv));
        assert_eq!(
            note.as_deref(),
            Some(
                "shm burn=2x 1 client(s) CPU per round trip (client + server): spin 60.00 us \
                 [40.00-400.00], adaptive 20.00 [20.00-25.00]: spin / adaptive = x3.00 (per round \
                 x2.00 x2.40 x20.00); 75% interval of the rounds' median x2.00-x20.00: met at x2.00"
            )
        );
        // Under 1x load the goal does not apply: the figures without a verdict.
        let note = polling_cpu_note("shm burn=1x 1 client(s)", 1, (&sc, &ss), (&ac, &asv));
        assert!(note.unwrap().ends_with("(per round x2.00 x2.40 x20.00)"));
    }

    #[test]
    fn per_round_ratios_pair_the_ways_round_by_round() {
        assert_eq!(
            per_round(&[10.0, 30.0, 22.0], &[8.0, 40.0, 11.0]),
            " (per round x1.25 x0.75 x2.00)"
        );
        // One round, or a way with none: nothing to add.
        assert_eq!(per_round(&[10.0], &[8.0]), "");
        assert_eq!(per_round(&[10.0, 11.0], &[]), "");
    }

    fn fig(mode: &str, clients: u32, metric: &str, rounds: &[f64]) -> Figure {
        Figure {
            mode: mode.into(),
            clients,
            metric: metric.into(),
            unit: "us".into(),
            value: rounds[0],
            ratio_to_native: None,
            ratio_to_raw_tcp: None,
            rounds: rounds.to_vec(),
        }
    }

    #[test]
    fn rounds_measured_apart_become_one_figure_each() {
        let merged = merge_rounds(vec![
            fig("shm spin burn=2x", 1, "launch_sync.mean", &[10.0]),
            fig("shm spin burn=2x", 4, "launch_sync.mean", &[40.0]),
            fig("shm block burn=2x", 1, "launch_sync.mean", &[20.0]),
            fig("shm spin burn=2x", 1, "launch_sync.mean", &[30.0]),
            fig("shm block burn=2x", 1, "launch_sync.mean", &[5.0]),
            fig("shm spin burn=2x", 1, "launch_sync.mean", &[12.0]),
            fig("shm spin burn=2x", 1, "launch_sync.p50", &[7.0]),
        ]);
        let got: Vec<(&str, u32, &str, f64, Vec<f64>)> = merged
            .iter()
            .map(|f| {
                (
                    f.mode.as_str(),
                    f.clients,
                    f.metric.as_str(),
                    f.value,
                    f.rounds.clone(),
                )
            })
            .collect();
        assert_eq!(
            got,
            [
                (
                    "shm spin burn=2x",
                    1,
                    "launch_sync.mean",
                    12.0,
                    vec![10.0, 30.0, 12.0]
                ),
                ("shm spin burn=2x", 4, "launch_sync.mean", 40.0, vec![40.0]),
                (
                    "shm block burn=2x",
                    1,
                    "launch_sync.mean",
                    12.5,
                    vec![20.0, 5.0]
                ),
                ("shm spin burn=2x", 1, "launch_sync.p50", 7.0, vec![7.0]),
            ]
        );
    }

    #[test]
    fn the_waiting_knobs_set_are_named_in_the_notes() {
        let vars = [
            ("REMORA_WAIT_SPARE_SPIN_US", "0"),
            ("PATH", "/bin"),
            ("REMORA_WAIT_TRACE", "1"),
            ("REMORA_WAIT", "spin"),
            ("REMORA_WAIT_BLOCK_AT", "1.5"),
            ("REMORA_SERVE_AVOID_PEER_CPU", "0"),
            ("REMORA_SERVE_OTHER", "x"),
            ("REMORA_SERVE_WAIT", "spin"),
        ]
        .map(|(k, v)| (k.to_string(), v.to_string()));
        assert_eq!(
            wait_knobs(vars.into_iter()),
            [
                "environment: REMORA_SERVE_AVOID_PEER_CPU=0",
                "environment: REMORA_SERVE_WAIT=spin",
                "environment: REMORA_WAIT_BLOCK_AT=1.5",
                "environment: REMORA_WAIT_SPARE_SPIN_US=0"
            ]
        );
    }

    #[test]
    fn a_figure_of_several_rounds_shows_their_range() {
        assert_eq!(spread(&[336.2, 254.1], 1), " [254.1-336.2]");
        assert_eq!(spread(&[3.0, 1.0, 2.0], 2), " [1.00-3.00]");
        assert_eq!(spread(&[7.0], 2), "");
        assert_eq!(spread(&[], 2), "");
    }
}
