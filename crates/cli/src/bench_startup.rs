//! `remora bench startup`: the wall-clock time of whole short programs, run natively and under
//! Remora as users run them, each as a ratio against native measured in the same run.
//!
//! ```text
//! remora bench startup --programs list.txt
//!   ├─ phase 1, no Remora server up (modes native, embedded-<t>): a warm-up (every program
//!   │  once in every mode, untimed), then each round, for each program: native,
//!   │  embedded-<t>…, each run a fresh process timed from spawn to exit:
//!   │    native        PROGRAM ARGS                                 (no LD_PRELOAD, REMORA_*)
//!   │    embedded-<t>  remora run --transport <t> -- PROGRAM ARGS   (its own embedded server)
//!   └─ phase 2, standing servers up (modes standing-<t>): the servers started on a private
//!      Unix socket (shm, unix) and on TCP loopback (tcp), a warm-up, then each round, for each
//!      program: native-held, embedded-held-<t>…, standing-<t>…:
//!        native-held        PROGRAM ARGS, natively, while the standing servers hold the GPU
//!        embedded-held-<t>  remora run --transport <t> -- PROGRAM ARGS, likewise
//!        standing-<t>       remora run --server URL --transport <t> -- PROGRAM ARGS
//! ```
//!
//! Two phases because a standing server holds the GPU open (its warm workers' driver and
//! context), and a GPU some process holds starts a native program faster (on an H200, native
//! vecadd 0.21 s held against 0.37 s idle, same machine and session): phase 1 sees the GPU as
//! a program on an otherwise idle host does, phase 2 as on a host where something keeps it
//! initialised (a standing server, another GPU process, or the driver's persistence mode,
//! which many GPU hosts run), and each remoted mode is compared with native in its phase.
//!
//! Figures (the report of `bench launch|copy`, so `bench plot` draws it): `startup.<program>`
//! per mode, the median over rounds, and `whole_run.total` per mode, the median over rounds
//! of the sum of that round's program times; each with its ratio to native's: `embedded-<t>`
//! against native, `embedded-held-<t>` and `standing-<t>` against native-held (native when that
//! was not measured).

use std::collections::HashSet;
use std::ffi::{OsStr, OsString};
use std::io::{Read as _, Seek as _, SeekFrom, Write as _};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, ExitStatus, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use remora_gpubench::median;
use remora_oncrpc::Endpoint;

use crate::bench_gpu::{Figure, Report};
use crate::run::{EmbeddedServer, find_shim};

/// `remora bench startup`'s options.
#[derive(Debug, clap::Args)]
pub(crate) struct Args {
    /// A program to time: its command line, split on spaces (repeatable), e.g.
    /// --program "./vecadd cubin".
    #[arg(long = "program", value_name = "CMD ARGS")]
    program: Vec<String>,
    /// A file of programs to time, one command line a line (blank lines and # comments
    /// ignored); a relative program path with a / in it is taken from the file's directory.
    #[arg(long, value_name = "FILE")]
    programs: Option<PathBuf>,
    /// Modes, comma-separated: native (the program as is), embedded (`remora run`, a fresh
    /// embedded server per run, once per transport) and standing (`remora run --server`
    /// against servers started once, once per transport).
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "native,embedded,standing"
    )]
    modes: Vec<String>,
    /// Transports of the embedded and standing modes, comma-separated: shm, unix, tcp.
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "shm,unix,tcp"
    )]
    transports: Vec<String>,
    /// Rounds; each runs every program in every mode once, interleaved, and figures are
    /// medians over the rounds.
    #[arg(long, default_value_t = 5)]
    rounds: u32,
    /// Remora's shim (default: beside this executable, or REMORA_SHIM).
    #[arg(long, value_name = "PATH")]
    shim: Option<PathBuf>,
    /// An extra argument for every server, embedded and standing (repeatable), e.g.
    /// --serve-arg=--devices=1.
    #[arg(long, value_name = "ARG", allow_hyphen_values = true)]
    serve_arg: Vec<OsString>,
    /// Write the report as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Draw the report as a PNG plot to this file.
    #[arg(long, value_name = "FILE")]
    png: Option<PathBuf>,
    /// Seconds one run may take; a run past it is killed and the benchmark stops with an
    /// error.
    #[arg(long, value_name = "SECS", default_value = TIMEOUT_S, value_parser = crate::parse_secs)]
    timeout_s: Duration,
    /// Idle time before each run, so that what a previous run left the machine doing (a
    /// session worker tearing its context down, a standing server starting a warm worker's
    /// context) does not land in the next run's time: context creation and destruction on
    /// one GPU wait for each other across processes.
    #[arg(long, value_name = "SECS", default_value = SETTLE_S, value_parser = crate::parse_secs)]
    settle_s: Duration,
    /// One more program to time, with its arguments, after `--`.
    #[arg(last = true, value_name = "PROGRAM ARGS")]
    command: Vec<OsString>,
    /// Variables for the servers and the remoted runs (not the native ones): `bench
    /// contention`'s `REMORA_WAIT`.
    #[arg(skip)]
    env: Vec<(String, String)>,
    /// Native runs only beside the standing servers (no phase 1 of native runs alone):
    /// `bench contention`'s program mix, which compares ways of waiting under load.
    #[arg(skip)]
    held_native_only: bool,
}

/// `--timeout-s` and `--settle-s` by default (also the program mix's).
const TIMEOUT_S: &str = "120";
const SETTLE_S: &str = "0.3";

/// A default above as a duration.
fn secs(s: &str) -> Duration {
    crate::parse_secs(s).unwrap_or_default()
}

impl Args {
    /// The options of `bench contention`'s CUDA-program mix: `program`s and the
    /// `programs` file's, natively (when `native`) and against standing servers over
    /// `transports`, `rounds` rounds, the servers and the remoted runs with `env`.
    #[allow(clippy::too_many_arguments)]
    pub(crate) fn for_mix(
        program: Vec<String>,
        programs: Option<PathBuf>,
        transports: Vec<String>,
        native: bool,
        rounds: u32,
        shim: Option<PathBuf>,
        serve_arg: Vec<OsString>,
        env: Vec<(String, String)>,
    ) -> Self {
        let mut modes = vec!["standing".to_owned()];
        if native {
            modes.insert(0, "native".to_owned());
        }
        Self {
            program,
            programs,
            modes,
            transports,
            rounds,
            shim,
            serve_arg,
            json: None,
            png: None,
            timeout_s: secs(TIMEOUT_S),
            settle_s: secs(SETTLE_S),
            command: Vec::new(),
            env,
            held_native_only: true,
        }
    }
}

/// A program to time.
#[derive(Debug, Clone, PartialEq)]
struct Program {
    /// Its figure's name: the program's file name and its arguments, joined with `_`, made
    /// unique.
    name: String,
    argv: Vec<OsString>,
}

impl Program {
    /// Its command line, for messages.
    fn command_line(&self) -> String {
        shown(self.argv.iter().map(OsString::as_os_str))
    }
}

/// Words joined with spaces, for messages.
fn shown<'a>(words: impl Iterator<Item = &'a OsStr>) -> String {
    words
        .map(OsStr::to_string_lossy)
        .collect::<Vec<_>>()
        .join(" ")
}

/// The programs of a `--programs` file whose directory is `dir`: one command line a line;
/// blank lines and comments (from a word starting with `#` to the end of the line) ignored;
/// a relative program path holding a `/` is taken from `dir`.
fn parse_program_file(text: &str, dir: &Path) -> Vec<Vec<OsString>> {
    let mut out = Vec::new();
    for line in text.lines() {
        let words: Vec<&str> = line
            .split_ascii_whitespace()
            .take_while(|w| !w.starts_with('#'))
            .collect();
        let Some((program, args)) = words.split_first() else {
            continue;
        };
        let program = if program.contains('/') && Path::new(program).is_relative() {
            dir.join(program).into_os_string()
        } else {
            OsString::from(program)
        };
        out.push(
            std::iter::once(program)
                .chain(args.iter().map(OsString::from))
                .collect(),
        );
    }
    out
}

/// Names the programs: the program's file name and its arguments joined with `_`; a name
/// already taken gets `#2`, `#3`… added.
fn name_programs(argvs: Vec<Vec<OsString>>) -> Vec<Program> {
    let mut seen = HashSet::new();
    let mut out = Vec::new();
    for argv in argvs {
        let Some((program, args)) = argv.split_first() else {
            continue;
        };
        let file = Path::new(program)
            .file_name()
            .unwrap_or(program.as_os_str())
            .to_string_lossy()
            .into_owned();
        let base = std::iter::once(file)
            .chain(args.iter().map(|a| a.to_string_lossy().into_owned()))
            .collect::<Vec<_>>()
            .join("_");
        let mut name = base.clone();
        let mut n = 2;
        while !seen.insert(name.clone()) {
            name = format!("{base}#{n}");
            n += 1;
        }
        out.push(Program { name, argv });
    }
    out
}

/// The programs the options name: `--program`s, then the `--programs` file's, then the one
/// after `--`.
fn programs(args: &Args) -> Result<Vec<Program>> {
    let mut argvs: Vec<Vec<OsString>> = Vec::new();
    for line in &args.program {
        let argv: Vec<OsString> = line.split_ascii_whitespace().map(OsString::from).collect();
        if argv.is_empty() {
            bail!(
                "--program \"\" names no program: give its command line, e.g. --program \"./app 1024\""
            );
        }
        argvs.push(argv);
    }
    if let Some(file) = &args.programs {
        let text = std::fs::read_to_string(file)
            .with_context(|| format!("cannot read the program list {}", file.display()))?;
        let listed = parse_program_file(&text, file.parent().unwrap_or(Path::new("")));
        if listed.is_empty() {
            bail!(
                "{} lists no program (one command line a line; # starts a comment)",
                file.display()
            );
        }
        argvs.extend(listed);
    }
    if !args.command.is_empty() {
        argvs.push(args.command.clone());
    }
    if argvs.is_empty() {
        bail!(
            "no program to time: name one with --program \"CMD ARGS\", a list with --programs \
             FILE, or one after --, as in `remora bench startup -- ./app 1024`"
        );
    }
    // A program given by its path must be there: a clear error now, not a failed first run.
    for argv in &argvs {
        let program = Path::new(&argv[0]);
        if program.as_os_str().as_encoded_bytes().contains(&b'/') && !program.is_file() {
            bail!(
                "program {} not found (relative paths are taken from the current directory, \
                 or from the list's directory in a --programs file)",
                program.display()
            );
        }
    }
    Ok(name_programs(argvs))
}

/// How one run is started.
#[derive(Debug, Clone, PartialEq, Eq)]
enum Mode {
    Native,
    /// The program natively while the standing servers are up (phase 2).
    NativeHeld,
    /// `remora run --transport T`: a fresh embedded server per run.
    Embedded(String),
    /// The same while the standing servers are up (phase 2).
    EmbeddedHeld(String),
    /// `remora run --server URL --transport T` against a server started once.
    Standing(String),
}

impl std::fmt::Display for Mode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Mode::Native => f.write_str("native"),
            Mode::NativeHeld => f.write_str("native-held"),
            Mode::Embedded(t) => write!(f, "embedded-{t}"),
            Mode::EmbeddedHeld(t) => write!(f, "embedded-held-{t}"),
            Mode::Standing(t) => write!(f, "standing-{t}"),
        }
    }
}

/// The modes `--modes` and `--transports` ask for, in the order each round runs them:
/// native, then `embedded-<t>` and `standing-<t>` in the order of the transports.
fn modes(modes: &[String], transports: &[String]) -> Result<Vec<Mode>> {
    for m in modes {
        if !["native", "embedded", "standing"].contains(&m.as_str()) {
            bail!("unknown mode {m:?}: use native, embedded or standing (comma-separated)");
        }
    }
    let mut ts: Vec<&String> = Vec::new();
    for t in transports {
        if !["shm", "unix", "tcp"].contains(&t.as_str()) {
            bail!("unknown transport {t:?}: use shm, unix or tcp (comma-separated)");
        }
        if !ts.contains(&t) {
            ts.push(t);
        }
    }
    let asked = |m: &str| modes.iter().any(|x| x == m);
    let mut out = Vec::new();
    if asked("native") {
        out.push(Mode::Native);
    }
    if asked("embedded") {
        out.extend(ts.iter().map(|t| Mode::Embedded((*t).clone())));
    }
    if asked("standing") {
        out.extend(ts.iter().map(|t| Mode::Standing((*t).clone())));
    }
    if out.is_empty() {
        bail!("no mode to measure: --modes takes native, embedded and standing (comma-separated)");
    }
    Ok(out)
}

/// The servers of the standing modes, started once and kept up until dropped.
struct Standing {
    /// For shm and unix.
    unix: Option<Endpoint>,
    tcp: Option<Endpoint>,
    _servers: Vec<EmbeddedServer>,
    /// The private directory of the Unix socket (removed after the servers stop).
    dir: tempfile::TempDir,
}

impl Standing {
    /// Starts the servers `modes` need: one on a Unix socket in a private directory for shm
    /// and unix, one on TCP loopback for tcp; none when no standing mode is asked for.
    fn start(modes: &[Mode], serve_args: &[OsString], env: &[(String, String)]) -> Result<Self> {
        let dir = tempfile::Builder::new()
            .prefix("remora-bench-startup-")
            .tempdir()
            .context("cannot create a private directory")?;
        let mut s = Self {
            unix: None,
            tcp: None,
            _servers: Vec::new(),
            dir,
        };
        let standing = |tcp: bool| {
            modes
                .iter()
                .any(|m| matches!(m, Mode::Standing(t) if (t == "tcp") == tcp))
        };
        if standing(false) {
            let listen = Endpoint::Unix(s.dir.path().join("remora.sock"));
            let (server, endpoint) = EmbeddedServer::start_env(&listen, serve_args, false, env)
                .context("cannot start the standing server on a Unix socket")?;
            s._servers.push(server);
            s.unix = Some(endpoint);
        }
        if standing(true) {
            let listen = Endpoint::Tcp("127.0.0.1:0".into());
            let (server, endpoint) = EmbeddedServer::start_env(&listen, serve_args, false, env)
                .context("cannot start the standing server on TCP loopback")?;
            s._servers.push(server);
            s.tcp = Some(endpoint);
        }
        Ok(s)
    }

    /// Any of the servers, for questions to one.
    fn any(&self) -> Option<&Endpoint> {
        self.unix.as_ref().or(self.tcp.as_ref())
    }
}

/// Starts and times runs.
struct Runner {
    exe: PathBuf,
    /// Remora's shim (absent with native runs only).
    shim: Option<PathBuf>,
    serve_args: Vec<OsString>,
    standing: Standing,
    timeout: Duration,
    /// For the remoted runs ([`Args::env`]).
    env: Vec<(String, String)>,
}

/// How many lines of a failed run's output an error quotes.
const TAIL_LINES: usize = 20;

impl Runner {
    /// The command that runs `program` in `mode`.
    fn command(&self, program: &Program, mode: &Mode) -> Result<Command> {
        let mut cmd = match mode {
            Mode::Native | Mode::NativeHeld => {
                let mut cmd = Command::new(&program.argv[0]);
                cmd.args(&program.argv[1..]);
                // The program as users run it without Remora: nothing of Remora's reaches it.
                for (key, _) in std::env::vars_os() {
                    if key.as_encoded_bytes().starts_with(b"REMORA_") {
                        cmd.env_remove(key);
                    }
                }
                cmd
            }
            Mode::Embedded(t) | Mode::EmbeddedHeld(t) | Mode::Standing(t) => {
                let mut cmd = Command::new(&self.exe);
                cmd.arg("run");
                if let Mode::Standing(_) = mode {
                    let server = if t == "tcp" {
                        self.standing.tcp.as_ref()
                    } else {
                        self.standing.unix.as_ref()
                    }
                    .with_context(|| format!("no standing server for {mode}"))?;
                    cmd.arg("--server").arg(server.to_string());
                }
                cmd.args(["--transport", t]);
                if let Some(shim) = &self.shim {
                    cmd.arg("--shim").arg(shim);
                }
                if let Mode::Embedded(_) | Mode::EmbeddedHeld(_) = mode {
                    for a in &self.serve_args {
                        let mut arg = OsString::from("--serve-arg=");
                        arg.push(a);
                        cmd.arg(arg);
                    }
                }
                cmd.arg("--").args(&program.argv);
                cmd.envs(self.env.iter().map(|(k, v)| (k, v)));
                cmd
            }
        };
        cmd.env_remove("LD_PRELOAD");
        Ok(cmd)
    }

    /// Runs `program` in `mode` once; returns its wall time from spawn to exit. A run that
    /// fails, or lasts past the timeout (it is killed), is an error naming the program, the
    /// mode, how it ended and the last lines of its output.
    fn time(&self, program: &Program, mode: &Mode) -> Result<f64> {
        let mut cmd = self.command(program, mode)?;
        let shown_cmd = shown(std::iter::once(cmd.get_program()).chain(cmd.get_args()));
        let output = tempfile::tempfile().context("cannot create a file for a run's output")?;
        cmd.stdin(Stdio::null())
            .stdout(output.try_clone()?)
            .stderr(output.try_clone()?)
            // Its own process group, so that a run past the timeout is killed whole
            // (`remora run`, its embedded server and the program).
            .process_group(0);
        let start = Instant::now();
        let mut child = cmd
            .spawn()
            .with_context(|| format!("cannot start {} ({mode}): {shown_cmd}", program.name))?;
        let pid = child.id();
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            let status = child.wait();
            let _ = tx.send((status, Instant::now()));
        });
        let ended = match rx.recv_timeout(self.timeout) {
            Ok((status, end)) => Ok((
                status.with_context(|| format!("cannot wait for {} ({mode})", program.name))?,
                end,
            )),
            Err(_) => {
                // SIGKILL to the whole group, then wait for the waiter to see it go.
                let _ = Command::new("kill")
                    .args(["-KILL", "--", &format!("-{pid}")])
                    .stdout(Stdio::null())
                    .stderr(Stdio::null())
                    .status();
                let _ = rx.recv_timeout(Duration::from_secs(10));
                Err(())
            }
        };
        let how = match ended {
            Ok((status, end)) if status.success() => {
                return Ok(end.duration_since(start).as_secs_f64());
            }
            Ok((status, _)) => format!("failed ({})", describe(status)),
            Err(()) => format!(
                "did not finish within {} s (--timeout-s) and was killed",
                self.timeout.as_secs_f64()
            ),
        };
        let tail = tail_lines(output, TAIL_LINES);
        bail!(
            "{} {how} in mode {mode}\n  command: {shown_cmd}\n{}",
            program.name,
            if tail.is_empty() {
                "  (no output)".to_owned()
            } else {
                format!(
                    "  last lines of its output:\n{}",
                    tail.lines()
                        .map(|l| format!("    {l}"))
                        .collect::<Vec<_>>()
                        .join("\n")
                )
            }
        )
    }
}

/// An exit status in words: `exit status 3`, `signal 11`.
fn describe(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt as _;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        _ => status.to_string(),
    }
}

/// The last `n` lines of a run's output (stdout and stderr together, in the order written),
/// from the last 64 KiB of it.
fn tail_lines(mut file: std::fs::File, n: usize) -> String {
    const MAX: u64 = 64 << 10;
    let len = file.metadata().map_or(0, |m| m.len());
    let mut bytes = Vec::new();
    if file.seek(SeekFrom::Start(len.saturating_sub(MAX))).is_err()
        || file.read_to_end(&mut bytes).is_err()
    {
        return String::new();
    }
    let text = String::from_utf8_lossy(&bytes);
    let lines: Vec<&str> = text.trim_end().lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}

/// The figures of the timings `times[program][mode][round]` (seconds): per program and mode
/// `startup.<name>`, the median over rounds; per mode `whole_run.total`, the median over
/// rounds of the sum of that round's program times; each with its ratio to native's when
/// `modes` has native.
fn figures(names: &[String], modes: &[String], times: &[Vec<Vec<f64>>]) -> Vec<Figure> {
    let figure = |mode: &str, metric: String, rounds: Vec<f64>| Figure {
        mode: mode.to_owned(),
        clients: 1,
        metric,
        unit: "s".into(),
        value: median(&rounds),
        ratio_to_native: None,
        ratio_to_raw_tcp: None,
        rounds,
    };
    let mut figs = Vec::new();
    for (name, per_mode) in names.iter().zip(times) {
        for (mode, rounds) in modes.iter().zip(per_mode) {
            figs.push(figure(mode, format!("startup.{name}"), rounds.clone()));
        }
    }
    for (m, mode) in modes.iter().enumerate() {
        let rounds = times.first().map_or(0, |p| p.get(m).map_or(0, Vec::len));
        let totals: Vec<f64> = (0..rounds)
            .map(|r| {
                times
                    .iter()
                    .map(|p| p.get(m).and_then(|v| v.get(r)).copied().unwrap_or(f64::NAN))
                    .sum()
            })
            .collect();
        figs.push(figure(mode, "whole_run.total".into(), totals));
    }
    // The baseline of a mode's figure: native-held for the modes run beside the standing
    // servers (standing, embedded-held), else native.
    let value = |mode: &str, metric: &str| {
        figs.iter()
            .find(|f| f.mode == mode && f.metric == metric)
            .map(|f| f.value)
            .filter(|n| *n > 0.0 && n.is_finite())
    };
    let baselines: Vec<Option<f64>> = figs
        .iter()
        .map(|f| match f.mode.as_str() {
            "native" => None,
            m if m.starts_with("standing-") || m.starts_with("embedded-held-") => {
                value("native-held", &f.metric).or_else(|| value("native", &f.metric))
            }
            _ => value("native", &f.metric),
        })
        .collect();
    for (f, n) in figs.iter_mut().zip(baselines) {
        if let Some(n) = n {
            f.ratio_to_native = Some((f.value / n * 1000.0).round() / 1000.0);
        }
    }
    figs
}

/// The report as a text table: program, mode, seconds, ratio to native.
fn table(r: &Report) -> String {
    use std::fmt::Write as _;
    let label = |f: &Figure| match f.metric.strip_prefix("startup.") {
        Some(name) => name.to_owned(),
        None => "whole run".to_owned(),
    };
    let width = r
        .figures
        .iter()
        .map(|f| label(f).chars().count())
        .max()
        .unwrap_or(0)
        .max("program".len());
    let mut s = format!(
        "remora bench startup on {} ({} round{}, median)\n{:<width$} {:<14} {:>10} {:>10}\n",
        if r.device.is_empty() { "?" } else { &r.device },
        r.rounds,
        if r.rounds == 1 { "" } else { "s" },
        "program",
        "mode",
        "seconds",
        "vs native",
    );
    for f in &r.figures {
        let _ = writeln!(
            s,
            "{:<width$} {:<14} {:>10.3} {:>10}",
            label(f),
            f.mode,
            f.value,
            f.ratio_to_native
                .map_or_else(|| "-".to_owned(), |x| format!("x{x:.3}"))
        );
    }
    for n in &r.notes {
        let _ = writeln!(s, "note: {n}");
    }
    s
}

/// The GPU the servers use, as their driver names it; empty (with a note) when none answers.
fn device_name(standing: &Standing, serve_args: &[OsString], notes: &mut Vec<String>) -> String {
    let ask = |server: &Endpoint| -> Result<String> {
        let token = crate::client_token(None)?;
        let reply = crate::info::hello(server, token.as_deref())?;
        crate::info::first_device_name(&reply).context("the server serves no GPU")
    };
    let answer = match standing.any() {
        Some(server) => ask(server),
        // No standing server: one for the question alone.
        None => (|| {
            let dir = tempfile::Builder::new()
                .prefix("remora-bench-startup-")
                .tempdir()?;
            let listen = Endpoint::Unix(dir.path().join("remora.sock"));
            let (_server, endpoint) = EmbeddedServer::start(&listen, serve_args, false)?;
            ask(&endpoint)
        })(),
    };
    answer.unwrap_or_else(|e| {
        notes.push(format!("the GPU's name is unknown: {e:#}"));
        String::new()
    })
}

/// Runs the benchmark: progress on stderr, a table on stdout; writes the JSON report and the
/// PNG plot when asked.
pub(crate) fn run(args: Args) -> Result<Report> {
    let report = measure(&args)?;
    outln!("{}", table(&report));
    crate::bench_gpu::write_report(&report, args.json.as_deref(), args.png.as_deref())?;
    Ok(report)
}

/// Runs the benchmark with progress on stderr, and answers its report.
pub(crate) fn measure(args: &Args) -> Result<Report> {
    let programs = programs(args)?;
    let modes = modes(&args.modes, &args.transports)?;
    if args.rounds == 0 {
        bail!("--rounds must be at least 1");
    }
    let remoted = modes.iter().any(|m| *m != Mode::Native);
    let shim = if remoted {
        let shim = find_shim(args.shim.as_deref())?;
        Some(
            shim.canonicalize()
                .with_context(|| format!("the shim {} does not exist", shim.display()))?,
        )
    } else {
        None
    };
    let mut runner = Runner {
        exe: std::env::current_exe().context("cannot find the remora executable")?,
        shim,
        // Phase 2 starts them.
        standing: Standing::start(&[], &args.serve_arg, &args.env)?,
        serve_args: args.serve_arg.clone(),
        timeout: args.timeout_s,
        env: args.env.clone(),
    };
    let mut notes = Vec::new();
    // Asked before phase 1, of a server that stops before it.
    let device = device_name(&runner.standing, &args.serve_arg, &mut notes);
    let phases = phases(&modes, args.held_native_only);
    let all: Vec<&Mode> = phases.iter().flatten().collect();
    let labels: Vec<String> = all.iter().map(|m| m.to_string()).collect();
    let names: Vec<String> = programs.iter().map(|p| p.name.clone()).collect();
    // times[program][mode][round], the modes of every phase in order
    let mut times = vec![vec![Vec::new(); all.len()]; programs.len()];
    let mut first = 0;
    for (k, phase) in phases.iter().enumerate() {
        if with_standing(phase) {
            runner.standing = Standing::start(phase, &args.serve_arg, &args.env)?;
        }
        eprintln!(
            "phase {}/{}: {} ({})",
            k + 1,
            phases.len(),
            if with_standing(phase) {
                "standing servers up"
            } else {
                "no Remora server up"
            },
            shown_modes(phase)
        );
        run_phase(args, &runner, &programs, phase, |p, m, secs| {
            times[p][first + m].push(secs);
        })?;
        first += phase.len();
    }
    let figures = figures(&names, &labels, &times);
    notes.extend(run_notes(args, &programs, &phases, &runner.standing));
    let mut servers = Vec::new();
    if modes.iter().any(|m| matches!(m, Mode::Embedded(_))) {
        servers.push("embedded: a fresh one per run".to_owned());
    }
    for e in [&runner.standing.unix, &runner.standing.tcp]
        .into_iter()
        .flatten()
    {
        servers.push(format!("standing: {e}"));
    }
    let report = Report::now(
        "startup",
        device,
        if servers.is_empty() {
            "none (native only)".into()
        } else {
            servers.join("; ")
        },
        args.rounds,
        None,
        figures,
        notes,
    );
    Ok(report)
}

/// The modes of each phase, in the order run: phase 1 the native and embedded modes, with no
/// Remora server up; phase 2, while the standing servers are up, native-held (when native
/// is asked), embedded-held (the embedded modes again) and the standing modes. With
/// `held_native_only`, native runs only in phase 2. A phase with no mode is left out.
fn phases(modes: &[Mode], held_native_only: bool) -> Vec<Vec<Mode>> {
    let native = modes.contains(&Mode::Native);
    let standing: Vec<Mode> = modes
        .iter()
        .filter(|m| matches!(m, Mode::Standing(_)))
        .cloned()
        .collect();
    let mut alone: Vec<Mode> = modes
        .iter()
        .filter(|m| matches!(m, Mode::Embedded(_)))
        .cloned()
        .collect();
    // Native runs alone too, unless only beside the standing servers is asked for.
    if native && (!held_native_only || standing.is_empty()) {
        alone.insert(0, Mode::Native);
    }
    let mut held = Vec::new();
    if !standing.is_empty() {
        if native {
            held.push(Mode::NativeHeld);
        }
        held.extend(modes.iter().filter_map(|m| match m {
            Mode::Embedded(t) => Some(Mode::EmbeddedHeld(t.clone())),
            _ => None,
        }));
        held.extend(standing);
    }
    [alone, held]
        .into_iter()
        .filter(|p| !p.is_empty())
        .collect()
}

/// Whether `phase` is the one run beside the standing servers.
fn with_standing(phase: &[Mode]) -> bool {
    phase.iter().any(|m| matches!(m, Mode::Standing(_)))
}

/// The modes of a phase, comma-separated.
fn shown_modes(phase: &[Mode]) -> String {
    phase
        .iter()
        .map(Mode::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// One phase: an untimed warm-up of every program in every mode of `modes`, then the rounds,
/// each program in every mode one after another; `record(program, mode, seconds)` for each
/// timed run (indices into `programs` and `modes`). Progress on stderr.
fn run_phase(
    args: &Args,
    runner: &Runner,
    programs: &[Program],
    modes: &[Mode],
    mut record: impl FnMut(usize, usize, f64),
) -> Result<()> {
    // One line per program: `PREFIX: NAME: MODE T s, MODE T s, ...`.
    let line = |prefix: &str, p: &Program, times: &mut Vec<f64>| -> Result<()> {
        eprint!("{prefix}: {}:", p.name);
        for (i, mode) in modes.iter().enumerate() {
            let _ = std::io::stderr().flush();
            std::thread::sleep(args.settle_s);
            match runner.time(p, mode) {
                Ok(t) => {
                    eprint!("{} {mode} {t:.3} s", if i == 0 { "" } else { "," });
                    times.push(t);
                }
                Err(e) => {
                    eprintln!(" {mode} failed");
                    return Err(e.context(prefix.to_owned()));
                }
            }
        }
        eprintln!();
        Ok(())
    };
    eprintln!(
        "warm-up: every program once in every mode, untimed ({} program{}, {} mode{})",
        programs.len(),
        if programs.len() == 1 { "" } else { "s" },
        modes.len(),
        if modes.len() == 1 { "" } else { "s" }
    );
    for p in programs {
        line("warm-up", p, &mut Vec::new())?;
    }
    for round in 1..=args.rounds {
        let prefix = format!("round {round}/{}", args.rounds);
        let mut totals = vec![0.0; modes.len()];
        for (p, program) in programs.iter().enumerate() {
            let mut t = Vec::new();
            line(&prefix, program, &mut t)?;
            for (m, secs) in t.into_iter().enumerate() {
                record(p, m, secs);
                totals[m] += secs;
            }
        }
        if programs.len() > 1 {
            eprintln!(
                "{prefix}: whole run of {} programs: {}",
                programs.len(),
                modes
                    .iter()
                    .zip(&totals)
                    .map(|(m, t)| format!("{m} {t:.3} s"))
                    .collect::<Vec<_>>()
                    .join(", ")
            );
        }
    }
    Ok(())
}

/// The notes that say how the report's figures were measured.
fn run_notes(
    args: &Args,
    programs: &[Program],
    phases: &[Vec<Mode>],
    standing: &Standing,
) -> Vec<String> {
    let modes: Vec<&Mode> = phases.iter().flatten().collect();
    let shown_phases = phases
        .iter()
        .map(|p| {
            format!(
                "{} ({})",
                if with_standing(p) {
                    "with the standing servers up"
                } else {
                    "with no Remora server up"
                },
                shown_modes(p)
            )
        })
        .collect::<Vec<_>>()
        .join(", then ");
    let mut notes = vec![
        format!(
            "each figure: the wall time of a whole run, a fresh process timed from spawn to exit, \
             median over {} round{}; {} phase{}: {shown_phases}; every round of a phase runs \
             each program in every mode of the phase, one after another",
            args.rounds,
            if args.rounds == 1 { "" } else { "s" },
            phases.len(),
            if phases.len() == 1 { "" } else { "s" },
        ),
        "warm-up: before a phase's timed rounds every program ran once in every mode of the \
         phase, untimed (fills the standing servers' module cache, pages in binaries and \
         libraries)"
            .to_owned(),
        format!(
            "whole_run.programs = {}: whole_run.total is, per mode, the median over rounds of \
             the sum of that round's program times",
            programs.len()
        ),
    ];
    if modes.contains(&&Mode::Native) {
        notes.push(
            "native: the program as is, without LD_PRELOAD and REMORA_* variables, with no \
             Remora server up; ratio_to_native: a mode's median over native's (embedded-held-<t> \
             and standing-<t>: over native-held's)"
                .to_owned(),
        );
    }
    if modes.contains(&&Mode::NativeHeld) {
        notes.push(
            "native-held: the program as natively, while the standing servers are up: they hold \
             the GPU open (driver, warm workers' contexts), which starts a native program \
             faster than on an idle GPU, as on a host in persistence mode; the ratios of \
             embedded-held-<t> and standing-<t> are against it"
                .to_owned(),
        );
    }
    if modes.iter().any(|m| matches!(m, Mode::EmbeddedHeld(_))) {
        notes.push(
            "embedded-held-<t>: embedded-<t> again while the standing servers are up (a \
             fresh embedded server per run beside them)"
                .to_owned(),
        );
    }
    if !modes.contains(&&Mode::Native) && !modes.contains(&&Mode::NativeHeld) {
        notes.push("native not measured: no ratios".to_owned());
    }
    if modes.iter().any(|m| matches!(m, Mode::Embedded(_))) {
        notes.push(
            "embedded-<t>: `remora run --transport <t> -- PROGRAM`, a fresh embedded server \
             per run (its start and stop included)"
                .to_owned(),
        );
    }
    if standing.any().is_some() {
        notes.push(format!(
            "standing-<t>: `remora run --server URL --transport <t> -- PROGRAM` against servers \
             started once before their phase's warm-up (shm and unix: {}; tcp: {})",
            standing
                .unix
                .as_ref()
                .map_or("-".to_owned(), |e| e.to_string()),
            standing
                .tcp
                .as_ref()
                .map_or("-".to_owned(), |e| e.to_string()),
        ));
    }
    if !args.serve_arg.is_empty() {
        notes.push(format!(
            "server arguments: {}",
            shown(args.serve_arg.iter().map(OsString::as_os_str))
        ));
    }
    notes.push(format!(
        "each run's limit: {} s; {} s idle before each run (--settle-s)",
        args.timeout_s.as_secs_f64(),
        args.settle_s.as_secs_f64()
    ));
    for p in programs {
        notes.push(format!("program {}: {}", p.name, p.command_line()));
    }
    notes
}

#[cfg(test)]
mod tests {
    use clap::Parser as _;

    use super::*;

    fn argvs(v: &[&[&str]]) -> Vec<Vec<OsString>> {
        v.iter()
            .map(|a| a.iter().map(OsString::from).collect())
            .collect()
    }

    /// `remora bench startup ARGS…`'s options.
    fn parse(args: &[&str]) -> std::result::Result<Args, clap::Error> {
        let cli = crate::Cli::try_parse_from(["remora", "bench", "startup"].iter().chain(args))?;
        match cli.command {
            crate::Command::Bench(crate::BenchCommand::Startup(a)) => Ok(a),
            other => panic!("{other:?}"),
        }
    }

    #[test]
    fn options_parse_with_their_defaults() {
        let a = parse(&["--program", "./vecadd  cubin", "--", "./app", "-x", "--y"]).unwrap();
        assert_eq!(a.program, ["./vecadd  cubin"]);
        assert_eq!(a.command, ["./app", "-x", "--y"]);
        assert_eq!(a.modes, ["native", "embedded", "standing"]);
        assert_eq!(a.transports, ["shm", "unix", "tcp"]);
        assert_eq!(a.rounds, 5);
        assert_eq!(a.timeout_s, Duration::from_secs(120));
        let a = parse(&[
            "--modes=native,standing",
            "--transports",
            "tcp",
            "--serve-arg=--backend",
            "--serve-arg",
            "emulated",
            "--timeout-s=0.5",
            "--rounds=2",
        ])
        .unwrap();
        assert_eq!(a.modes, ["native", "standing"]);
        assert_eq!(a.serve_arg, ["--backend", "emulated"]);
        assert_eq!(a.timeout_s, Duration::from_millis(500));
        assert!(parse(&["--timeout-s=0"]).is_err());
        assert!(parse(&["--timeout-s=soon"]).is_err());
    }

    #[test]
    fn program_files_skip_comments_and_blank_lines_and_resolve_relative_paths() {
        let text = "# programs\n\n  ./vecadd cubin   # the cubin one\nbin/matmul\n\
                    /abs/histogram 64\ntrue\n   # indented comment\n\tsleep\t0.1\n";
        assert_eq!(
            parse_program_file(text, Path::new("/lists")),
            argvs(&[
                &["/lists/./vecadd", "cubin"],
                &["/lists/bin/matmul"],
                &["/abs/histogram", "64"],
                &["true"],
                &["sleep", "0.1"],
            ])
        );
        // A list in the current directory keeps its relative paths.
        assert_eq!(
            parse_program_file("./a\n", Path::new("")),
            argvs(&[&["./a"]])
        );
    }

    #[test]
    fn names_are_file_name_and_arguments_made_unique() {
        let names: Vec<String> = name_programs(argvs(&[
            &["./build/vecadd", "cubin"],
            &["/other/vecadd", "cubin"],
            &["vecadd"],
            &["/x/vecadd", "cubin"],
            &["./t", "--size=4", "a/b"],
        ]))
        .into_iter()
        .map(|p| p.name)
        .collect();
        assert_eq!(
            names,
            [
                "vecadd_cubin",
                "vecadd_cubin#2",
                "vecadd",
                "vecadd_cubin#3",
                "t_--size=4_a/b"
            ]
        );
    }

    #[test]
    fn programs_come_from_every_source_and_none_is_a_clear_error() {
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("prog"), "").unwrap();
        let list = dir.path().join("list.txt");
        std::fs::write(&list, "# one\n./prog 1\n").unwrap();
        let list_arg = format!("--programs={}", list.display());
        let a = parse(&["--program", "true a", &list_arg, "--", "false"]).unwrap();
        let p = programs(&a).unwrap();
        let names: Vec<&str> = p.iter().map(|p| p.name.as_str()).collect();
        assert_eq!(names, ["true_a", "prog_1", "false"]);
        assert_eq!(p[1].argv[0], dir.path().join("./prog"));
        assert_eq!(
            p[1].command_line(),
            format!("{} 1", dir.path().join("./prog").display())
        );

        let err = programs(&parse(&[]).unwrap()).unwrap_err().to_string();
        assert!(
            err.contains("--program") && err.contains("--programs") && err.contains("-- ./app"),
            "{err}"
        );
        let err = programs(&parse(&["--program", "  "]).unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("names no program"), "{err}");
        std::fs::write(&list, "# nothing\n\n").unwrap();
        let err = programs(&parse(&[&list_arg]).unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("lists no program"), "{err}");
        let err = programs(&parse(&["--programs=/nonexistent/list"]).unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("/nonexistent/list"), "{err}");
        let err = programs(&parse(&["--program", "./not-here 1"]).unwrap())
            .unwrap_err()
            .to_string();
        assert!(err.contains("./not-here not found"), "{err}");
    }

    #[test]
    fn modes_expand_per_transport_and_unknown_names_are_errors() {
        let s = |v: &[&str]| v.iter().map(|x| (*x).to_owned()).collect::<Vec<_>>();
        let m = modes(
            &s(&["standing", "native", "embedded"]),
            &s(&["tcp", "shm", "tcp"]),
        )
        .unwrap();
        let labels: Vec<String> = m.iter().map(Mode::to_string).collect();
        assert_eq!(
            labels,
            [
                "native",
                "embedded-tcp",
                "embedded-shm",
                "standing-tcp",
                "standing-shm"
            ]
        );
        assert_eq!(
            modes(&s(&["native"]), &s(&["unix"])).unwrap(),
            [Mode::Native]
        );
        let err = modes(&s(&["native", "remote"]), &s(&["shm"]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"remote\"") && err.contains("native, embedded or standing"),
            "{err}"
        );
        let err = modes(&s(&["native"]), &s(&["rdma"]))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains("\"rdma\"") && err.contains("shm, unix or tcp"),
            "{err}"
        );
    }

    #[test]
    fn figures_are_medians_with_whole_run_sums_per_round_and_ratios() {
        let names = ["a".to_owned(), "b".to_owned()];
        let modes = ["native".to_owned(), "embedded-shm".to_owned()];
        // times[program][mode][round]
        let times = vec![
            vec![vec![1.0, 3.0, 2.0], vec![2.0, 6.0, 4.0]],
            vec![vec![10.0, 1.0, 4.0], vec![5.0, 5.0, 8.0]],
        ];
        let figs = figures(&names, &modes, &times);
        let get = |mode: &str, metric: &str| {
            figs.iter()
                .find(|f| f.mode == mode && f.metric == metric)
                .unwrap()
                .clone()
        };
        let a = get("native", "startup.a");
        assert_eq!((a.value, a.unit.as_str(), a.clients), (2.0, "s", 1));
        assert_eq!(a.rounds, [1.0, 3.0, 2.0]);
        assert_eq!(a.ratio_to_native, None);
        assert_eq!(get("embedded-shm", "startup.a").ratio_to_native, Some(2.0));
        assert_eq!(get("embedded-shm", "startup.b").ratio_to_native, Some(1.25));
        // Round sums: native 11, 4, 6 → 6 (not 2 + 4, the sum of the medians);
        // embedded 7, 11, 12 → 11.
        let w = get("native", "whole_run.total");
        assert_eq!((w.value, w.rounds.clone()), (6.0, vec![11.0, 4.0, 6.0]));
        let w = get("embedded-shm", "whole_run.total");
        assert_eq!(w.value, 11.0);
        assert_eq!(w.ratio_to_native, Some(1.833));
        assert_eq!(figs.len(), 2 * 2 + 2);
        // An even number of rounds: the mean of the middle two.
        assert_eq!(median(&[4.0, 1.0, 3.0, 2.0]), 2.5);
        assert!(median(&[]).is_nan());
        // No native: no ratios.
        let figs = figures(&names[..1], &modes[1..], &[vec![vec![1.0]]]);
        assert!(figs.iter().all(|f| f.ratio_to_native.is_none()));
    }

    #[test]
    fn standing_modes_are_compared_with_native_beside_the_same_servers() {
        let names = ["a".to_owned()];
        let modes = [
            "native".to_owned(),
            "embedded-shm".to_owned(),
            "native-held".to_owned(),
            "embedded-held-shm".to_owned(),
            "standing-shm".to_owned(),
        ];
        let times = vec![vec![vec![4.0], vec![3.0], vec![2.0], vec![3.0], vec![1.0]]];
        let figs = figures(&names, &modes, &times);
        let ratio = |mode: &str| {
            figs.iter()
                .find(|f| f.mode == mode && f.metric == "startup.a")
                .unwrap()
                .ratio_to_native
        };
        assert_eq!(ratio("native"), None);
        assert_eq!(ratio("embedded-shm"), Some(0.75));
        // How much faster a held GPU starts the program natively.
        assert_eq!(ratio("native-held"), Some(0.5));
        assert_eq!(ratio("embedded-held-shm"), Some(1.5));
        assert_eq!(ratio("standing-shm"), Some(0.5));
        // Without native-held, standing is compared with native.
        let figs = figures(
            &names,
            &[modes[0].clone(), modes[4].clone()],
            &[vec![vec![4.0], vec![1.0]]],
        );
        assert_eq!(figs[1].mode, "standing-shm");
        assert_eq!(figs[1].ratio_to_native, Some(0.25));
    }

    #[test]
    fn native_and_embedded_runs_come_before_the_standing_servers_start() {
        let all = modes(
            &["native".into(), "embedded".into(), "standing".into()],
            &["shm".into(), "tcp".into()],
        )
        .unwrap();
        let shown = |phases: Vec<Vec<Mode>>| -> Vec<Vec<String>> {
            phases
                .iter()
                .map(|p| p.iter().map(Mode::to_string).collect())
                .collect()
        };
        assert_eq!(
            shown(phases(&all, false)),
            [
                vec!["native", "embedded-shm", "embedded-tcp"],
                vec![
                    "native-held",
                    "embedded-held-shm",
                    "embedded-held-tcp",
                    "standing-shm",
                    "standing-tcp"
                ]
            ]
        );
        // bench contention's mix: native only beside the standing servers.
        let mix = modes(&["native".into(), "standing".into()], &["shm".into()]).unwrap();
        assert_eq!(
            shown(phases(&mix, true)),
            [vec!["native-held", "standing-shm"]]
        );
        assert_eq!(
            shown(phases(&mix, false)),
            [vec!["native"], vec!["native-held", "standing-shm"]]
        );
        // Native alone; embedded alone.
        assert_eq!(shown(phases(&all[..1], true)), [vec!["native"]]);
        assert_eq!(shown(phases(&all[1..2], false)), [vec!["embedded-shm"]]);
        assert_eq!(
            shown(phases(&all[3..], false)),
            [vec!["standing-shm", "standing-tcp"]]
        );
    }

    fn native_runner(timeout: Duration) -> Runner {
        Runner {
            exe: "/nonexistent/remora".into(),
            shim: None,
            serve_args: Vec::new(),
            standing: Standing::start(&[Mode::Native], &[], &[]).unwrap(),
            timeout,
            env: Vec::new(),
        }
    }

    #[test]
    fn a_failed_run_names_program_mode_status_and_its_last_lines() {
        let runner = native_runner(Duration::from_secs(30));
        let program = name_programs(argvs(&[&[
            "sh",
            "-c",
            "for i in $(seq 30); do echo line$i; done; echo oops >&2; exit 3",
        ]]))
        .remove(0);
        let err = runner
            .time(&program, &Mode::Native)
            .unwrap_err()
            .to_string();
        assert!(err.starts_with("sh_-c_"), "{err}");
        assert!(
            err.contains("failed (exit status 3) in mode native"),
            "{err}"
        );
        assert!(err.contains("command: sh -c for i in"), "{err}");
        assert!(
            err.contains("    oops") && err.contains("    line30"),
            "{err}"
        );
        assert!(!err.contains("line10\n"), "only the last lines: {err}");
        let ok = name_programs(argvs(&[&["true"]])).remove(0);
        let t = runner.time(&ok, &Mode::Native).unwrap();
        assert!(t > 0.0 && t < 30.0, "{t}");
    }

    #[test]
    fn a_run_past_the_timeout_is_killed_and_reported() {
        let runner = native_runner(Duration::from_millis(300));
        // The shell's child (sleep) is in the run's process group and dies with it.
        let program =
            name_programs(argvs(&[&["sh", "-c", "echo started; sleep 30; true"]])).remove(0);
        let t0 = Instant::now();
        let err = runner
            .time(&program, &Mode::Native)
            .unwrap_err()
            .to_string();
        assert!(t0.elapsed() < Duration::from_secs(10), "{:?}", t0.elapsed());
        assert!(err.contains("did not finish within 0.3 s"), "{err}");
        assert!(err.contains("    started"), "{err}");
    }

    #[test]
    fn native_runs_are_the_program_alone_and_remoted_runs_go_through_remora_run() {
        let program = name_programs(argvs(&[&["./app", "1"]])).remove(0);
        let mut runner = native_runner(Duration::from_secs(1));
        runner.exe = "/r/remora".into();
        runner.shim = Some("/r/libcuda.so".into());
        runner.serve_args = vec!["--backend".into(), "emulated".into()];
        runner.standing.tcp = Some(Endpoint::Tcp("127.0.0.1:9".into()));
        let args = |mode: &Mode| {
            let cmd = runner.command(&program, mode).unwrap();
            shown(std::iter::once(cmd.get_program()).chain(cmd.get_args()))
        };
        assert_eq!(args(&Mode::Native), "./app 1");
        // Neither LD_PRELOAD nor any REMORA_* variable of ours reaches a native run.
        let native = runner.command(&program, &Mode::Native).unwrap();
        let removed: Vec<&OsStr> = native
            .get_envs()
            .filter(|(_, v)| v.is_none())
            .map(|(k, _)| k)
            .collect();
        assert!(removed.contains(&OsStr::new("LD_PRELOAD")), "{removed:?}");
        for (key, _) in std::env::vars_os() {
            if key.to_string_lossy().starts_with("REMORA_") {
                assert!(removed.contains(&key.as_os_str()), "{key:?}");
            }
        }
        assert_eq!(
            args(&Mode::Embedded("shm".into())),
            "/r/remora run --transport shm --shim /r/libcuda.so --serve-arg=--backend \
             --serve-arg=emulated -- ./app 1"
        );
        assert_eq!(
            args(&Mode::Standing("tcp".into())),
            "/r/remora run --server tcp://127.0.0.1:9 --transport tcp --shim /r/libcuda.so -- ./app 1"
        );
        // No standing server on a Unix socket was started.
        assert!(
            runner
                .command(&program, &Mode::Standing("unix".into()))
                .is_err()
        );
        // `bench contention`'s variables go to the remoted runs, never to a native one.
        runner.env = vec![("REMORA_WAIT".into(), "block".into())];
        let set = |mode: &Mode| {
            let cmd = runner.command(&program, mode).unwrap();
            cmd.get_envs()
                .any(|(k, v)| k == "REMORA_WAIT" && v == Some(OsStr::new("block")))
        };
        assert!(set(&Mode::Standing("tcp".into())));
        assert!(set(&Mode::Embedded("shm".into())));
        assert!(!set(&Mode::Native));
    }

    #[test]
    fn the_table_lists_programs_modes_seconds_and_ratios() {
        let names = ["vecadd_cubin".to_owned()];
        let modes = ["native".to_owned(), "standing-tcp".to_owned()];
        let report = Report {
            benchmark: "startup".into(),
            date_unix: 0,
            device: "GPU".into(),
            remora: String::new(),
            commit: String::new(),
            server: String::new(),
            rounds: 1,
            workload: None,
            figures: figures(&names, &modes, &[vec![vec![0.2], vec![0.3]]]),
            notes: vec!["n".into()],
        };
        let t = table(&report);
        assert!(
            t.contains("vecadd_cubin standing-tcp        0.300     x1.500"),
            "{t}"
        );
        assert!(t.contains("whole run"), "{t}");
        assert!(t.contains("note: n"), "{t}");
        // The JSON has the shape of bench launch|copy's report, without a workload.
        let json = serde_json::to_value(&report).unwrap();
        assert!(json.get("launches").is_none(), "{json}");
        let back: Report = serde_json::from_value(json).unwrap();
        assert_eq!(back.workload, None);
        assert_eq!(back.figures, report.figures);
    }
}
