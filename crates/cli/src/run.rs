//! `remora run`: run a program against a Remora server through the shim `libcuda.so.1`.
//!
//! ```text
//! remora run [--server URL] [--transport auto|shm|unix|tcp] [--] ./app args…
//!   ├─ --server: checks that a Remora server answers there (NULL call), else fails at once
//!   ├─ no --server: starts `remora serve` (this executable, without the shim) on a private
//!   │  Unix socket (TCP loopback with --transport tcp) for the duration of the command
//!   ├─ makes a private directory holding `libcuda.so.1` → the shim, first on LD_LIBRARY_PATH
//!   └─ runs the program with REMORA_SERVER=URL and REMORA_TRANSPORT=T, returns its exit
//!      status (auto: shared memory with a Unix socket, which the embedded server is)
//! ```

use std::ffi::OsString;
use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use anyhow::{Context, Result, bail};
use remora_oncrpc::{ClientConfig, Endpoint, TransportChoice};
use remora_proto::remora::RemoraV1Client;

/// The file name cargo gives the shim cdylib (`[lib] name = "cuda"`).
const SHIM_FILE: &str = "libcuda.so";

/// What `remora run` was asked to do.
#[derive(Debug)]
pub(crate) struct RunOptions {
    pub(crate) server: Option<Endpoint>,
    pub(crate) transport: TransportChoice,
    /// The client's token file (`--auth-token-file`).
    pub(crate) auth_token_file: Option<PathBuf>,
    /// `--tls-ca`, `--tls-cert`, `--tls-key`: for a `tls://` server.
    pub(crate) tls: crate::ClientTlsArgs,
    pub(crate) shim: Option<PathBuf>,
    pub(crate) serve_args: Vec<OsString>,
    /// `--profile`: the program's calls are profiled (REMORA_CLIENT_PROFILE=1) and so is an
    /// embedded server (`remora serve --profile`, its table logged).
    pub(crate) profile: bool,
    pub(crate) command: Vec<OsString>,
}

/// Finds the shim: `--shim`, else `REMORA_SHIM`, else beside this executable.
pub(crate) fn find_shim(explicit: Option<&Path>) -> Result<PathBuf> {
    if let Some(path) = explicit {
        return Ok(path.to_owned());
    }
    if let Some(path) = std::env::var_os("REMORA_SHIM") {
        return Ok(PathBuf::from(path));
    }
    let exe = std::env::current_exe().context("cannot find the remora executable")?;
    let dir = exe
        .parent()
        .context("the remora executable has no directory")?;
    for candidate in [dir.join(SHIM_FILE), dir.join("libcuda.so.1")] {
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    bail!(
        "cannot find Remora's {SHIM_FILE} beside {} (build it with `cargo build --release \
         -p remora-shim`), or name it with --shim PATH or REMORA_SHIM",
        exe.display()
    )
}

/// An embedded `remora serve` child; stopped (SIGTERM, then kill) on drop.
pub(crate) struct EmbeddedServer {
    /// `None` once dropped.
    child: Option<Child>,
    /// Receives once the server has printed [`crate::SERVE_RELEASED_LINE`] or
    /// [`crate::SERVE_STOPPED_LINE`], or closed its standard output (exited).
    stopped: std::sync::mpsc::Receiver<&'static str>,
}

impl EmbeddedServer {
    /// The server's process id, while it runs.
    pub(crate) fn pid(&self) -> Option<u32> {
        self.child.as_ref().map(Child::id)
    }

    /// Starts `remora serve --listen LISTEN`; returns it with the endpoint it listens on (the
    /// real port for `tcp://127.0.0.1:0`).
    pub(crate) fn start(
        listen: &Endpoint,
        extra: &[OsString],
        profile: bool,
    ) -> Result<(Self, Endpoint)> {
        Self::start_env(listen, extra, profile, &[])
    }

    /// [`EmbeddedServer::start`] with `env` added to the server's environment.
    pub(crate) fn start_env(
        listen: &Endpoint,
        extra: &[OsString],
        profile: bool,
        env: &[(String, String)],
    ) -> Result<(Self, Endpoint)> {
        let exe = std::env::current_exe().context("cannot find the remora executable")?;
        let profile_log = if profile {
            format!(
                ",remora_oncrpc::server::profile=info,{}=info",
                remora_server::PROFILE_LOG_TARGET
            )
        } else {
            String::new()
        };
        let spawned = Instant::now();
        let mut child = Command::new(exe)
            .arg("serve")
            .arg("--listen")
            .arg(listen.to_string())
            .args(profile.then_some("--profile"))
            .args(extra)
            // The server uses the real driver: never the shim.
            .env_remove("LD_PRELOAD")
            .env_remove("REMORA_SERVER")
            // Quiet by default: the program's own output is what matters; warnings still show,
            // but for "serving zero GPUs", which the program's client reports (with the same
            // reason) when it asks for a GPU.
            .env(
                "REMORA_LOG",
                std::env::var_os("REMORA_LOG").unwrap_or_else(|| {
                    format!(
                        "warn,{}=error{profile_log}",
                        remora_server::NO_GPU_LOG_TARGET
                    )
                    .into()
                }),
            )
            .envs(env.iter().map(|(k, v)| (k, v)))
            .stdout(Stdio::piped())
            .spawn()
            .context("cannot start the embedded remora serve")?;
        let stdout = child.stdout.take().context("no stdout from remora serve")?;
        let mut reader = BufReader::new(stdout);
        let mut line = String::new();
        let deadline = Instant::now() + Duration::from_secs(60);
        let endpoint = loop {
            line.clear();
            let n = reader.read_line(&mut line).unwrap_or(0);
            if n == 0 {
                let status = child.wait().ok();
                bail!("the embedded remora serve exited before listening ({status:?})");
            }
            if let Some((_, url)) = line.split_once("listening on ") {
                let endpoint = url
                    .trim()
                    .parse::<Endpoint>()
                    .with_context(|| format!("the embedded remora serve printed {line:?}"))?;
                // The program starts only now: this is the embedded server's share of its
                // start-up (the server's driver probe is logged as `remora::startup` too).
                tracing::debug!(
                    target: "remora::startup",
                    listening_ms = spawned.elapsed().as_millis() as u64,
                    "embedded server listening; starting the program"
                );
                break endpoint;
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                bail!("the embedded remora serve did not start listening within 60 s");
            }
        };
        // Keep draining its stdout so it never blocks on a full pipe, and tell the drop when
        // its sessions have released the GPU or it has stopped serving.
        let (tx, stopped) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            let mut line = String::new();
            while reader.read_line(&mut line).unwrap_or(0) > 0 {
                match line.trim_end() {
                    l if l == crate::SERVE_RELEASED_LINE => {
                        let _ = tx.send("sessions released the GPU");
                    }
                    l if l == crate::SERVE_STOPPED_LINE => {
                        let _ = tx.send("stopped serving");
                    }
                    _ => {}
                }
                line.clear();
            }
            let _ = tx.send("exited");
        });
        Ok((
            Self {
                child: Some(child),
                stopped,
            },
            endpoint,
        ))
    }
}

impl Drop for EmbeddedServer {
    /// SIGTERM, then waits (at most 10 s, then kills it) until the GPU holds nothing of the
    /// program's: the server says every session's worker has destroyed its contexts
    /// ([`crate::SERVE_RELEASED_LINE`]), or it has stopped serving, every worker reaped
    /// ([`crate::SERVE_STOPPED_LINE`]). What follows is not waited for: the workers' exits
    /// (their driver teardown, ~50 ms on the H200 host) and the server's own; the process is
    /// reaped by a thread of ours if we live on, else by init.
    fn drop(&mut self) {
        let Some(mut child) = self.child.take() else {
            return;
        };
        let stopping = Instant::now();
        let pid = rustix::process::Pid::from_child(&child);
        let _ = rustix::process::kill_process(pid, rustix::process::Signal::TERM);
        let on = match self.stopped.recv_timeout(Duration::from_secs(10)) {
            Ok(what) => {
                if !matches!(child.try_wait(), Ok(Some(_))) {
                    std::thread::spawn(move || {
                        let _ = child.wait();
                    });
                }
                what
            }
            Err(_) => {
                tracing::warn!(
                    "the embedded remora serve did not stop within 10 s of SIGTERM; killed"
                );
                let _ = child.kill();
                let _ = child.wait();
                "killed after 10 s"
            }
        };
        // The embedded server's share of a program's run time after the program exits, and
        // what ended the wait.
        tracing::debug!(
            target: "remora::startup",
            stop_ms = stopping.elapsed().as_millis() as u64,
            on,
            "embedded server stopped"
        );
    }
}

/// Refuses a transport that cannot reach `server`, before anything starts.
pub(crate) fn check_transport(server: &Endpoint, transport: TransportChoice) -> Result<()> {
    match (transport, server) {
        (TransportChoice::Tcp, Endpoint::Unix(_)) => {
            bail!("--transport tcp needs a tcp://HOST:PORT server, not {server}")
        }
        (TransportChoice::Shm, Endpoint::Tcp(_) | Endpoint::Tls(_)) => bail!(
            "--transport shm needs a server on this host reached by its Unix socket \
             (unix:///PATH), not {server} (shared memory is never offered over TCP or TLS); \
             use --transport tcp or auto for a TCP or TLS server"
        ),
        (TransportChoice::Unix, Endpoint::Tcp(_) | Endpoint::Tls(_)) => {
            bail!("--transport unix needs a unix:///PATH server, not {server}")
        }
        _ => Ok(()),
    }
}

/// How long `remora run --server URL` waits for the server to accept the probe's connection.
const PROBE_CONNECT_TIMEOUT: Duration = Duration::from_secs(5);
/// How long it waits for the probe's NULL call: as long as the shim waits for HELLO (a session
/// worker may be loading its driver first).
const PROBE_CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Checks that a Remora server answers at `server` (connect, then the NULL procedure), so that
/// `remora run` fails before starting the program rather than the program's cuInit.
/// With `token`, the probe is the program's own handshake (HELLO_AUTH), so that a missing or
/// wrong token is reported before the program starts.
pub(crate) fn probe(
    server: &Endpoint,
    token: Option<&str>,
    tls: Option<std::sync::Arc<remora_oncrpc::ClientTls>>,
) -> Result<()> {
    let hello = remora_proto::remora::HelloArgs {
        min_revision: 1,
        max_revision: remora_proto::remora::REMORA_PROTOCOL_REVISION,
        client_name: concat!("remora run ", env!("CARGO_PKG_VERSION")).into(),
        capabilities: 0,
    };
    let config = ClientConfig {
        opening_call: crate::opening_call(&hello, token)?,
        // The socket alone: a probe needs no shared memory.
        transport: match server {
            Endpoint::Unix(_) => TransportChoice::Unix,
            Endpoint::Tcp(_) | Endpoint::Tls(_) => TransportChoice::Tcp,
        },
        connect_timeout: Some(PROBE_CONNECT_TIMEOUT),
        tls,
        ..ClientConfig::default()
    };
    let rpc = crate::connect(server, config)?;
    RemoraV1Client::new(rpc)
        .with_timeout(PROBE_CALL_TIMEOUT)
        .remora_null()
        .map_err(|e| crate::auth_error(e, server, token.is_some()))
        .with_context(|| format!("{server} does not answer as a Remora server"))?;
    Ok(())
}

/// Runs the command; returns its exit status.
pub(crate) fn run(opts: RunOptions) -> Result<ExitStatus> {
    let Some((program, args)) = opts.command.split_first() else {
        bail!("nothing to run: give the program after --, as in `remora run -- ./app`");
    };
    // The token file is checked (present, private, a valid token) before anything starts.
    let token = match &opts.auth_token_file {
        Some(file) => Some(crate::client_token(Some(file))?),
        None => None,
    }
    .flatten();
    if opts.tls.given() && !matches!(opts.server, Some(Endpoint::Tls(_))) {
        bail!("--tls-ca, --tls-cert and --tls-key are for a --server tls://HOST:PORT");
    }
    // The TLS files are checked (readable, a private key) before anything starts too.
    let tls = opts.tls.load()?;
    // A named server must answer before anything starts.
    if let Some(server) = &opts.server {
        check_transport(server, opts.transport)?;
        let env_token = match &token {
            Some(_) => None,
            None => crate::client_token(None)?,
        };
        probe(server, token.as_deref().or(env_token.as_deref()), tls)?;
    }
    let shim = find_shim(opts.shim.as_deref())?;
    let shim = shim
        .canonicalize()
        .with_context(|| format!("the shim {} does not exist", shim.display()))?;
    let private = tempfile::Builder::new()
        .prefix("remora-run-")
        .tempdir()
        .context("cannot create a private directory")?;
    let libdir = private.path().join("lib");
    std::fs::create_dir(&libdir)?;
    std::os::unix::fs::symlink(&shim, libdir.join("libcuda.so.1"))?;
    std::os::unix::fs::symlink(&shim, libdir.join("libcuda.so"))?;

    let (_server, endpoint) = match opts.server {
        Some(endpoint) => (None, endpoint),
        None => {
            let listen = match opts.transport {
                TransportChoice::Tcp => Endpoint::Tcp("127.0.0.1:0".into()),
                _ => Endpoint::Unix(private.path().join("remora.sock")),
            };
            // One program, one session (more only if it starts CUDA processes of its own,
            // whose workers then start on demand): one warm worker, started with the server
            // and not replaced, instead of the standing server's default. Its log is quiet,
            // so the server does not load the driver only to log the GPUs beside the worker's
            // own driver start, which the program waits for.
            let mut serve_args = opts.serve_args.clone();
            if !serve_args
                .iter()
                .any(|a| a.to_string_lossy().starts_with("--warm-workers"))
            {
                serve_args.extend([
                    "--warm-workers".into(),
                    "1".into(),
                    "--no-warm-refill".into(),
                ]);
            }
            if !serve_args.iter().any(|a| a == "--no-driver-probe") {
                serve_args.push("--no-driver-probe".into());
            }
            let (server, endpoint) = EmbeddedServer::start(&listen, &serve_args, opts.profile)?;
            (Some(server), endpoint)
        }
    };

    let mut library_path = OsString::from(&libdir);
    if let Some(old) = std::env::var_os("LD_LIBRARY_PATH").filter(|p| !p.is_empty()) {
        library_path.push(":");
        library_path.push(old);
    }
    let mut cmd = Command::new(program);
    if let Some(file) = &opts.auth_token_file {
        // The program reads the file itself (the token stays out of its environment); a
        // REMORA_AUTH_TOKEN inherited from here would win over it, so it goes.
        let file = std::path::absolute(file)
            .with_context(|| format!("cannot resolve {}", file.display()))?;
        cmd.env("REMORA_AUTH_TOKEN_FILE", file)
            .env_remove("REMORA_AUTH_TOKEN");
    }
    if opts.profile {
        cmd.env("REMORA_CLIENT_PROFILE", "1");
    }
    // The program's TLS files: those given here, else what it inherits.
    for (var, file) in opts.tls.env()? {
        cmd.env(var, file);
    }
    let status = cmd
        .args(args)
        .env("LD_LIBRARY_PATH", library_path)
        .env("REMORA_SERVER", endpoint.to_string())
        .env("REMORA_TRANSPORT", opts.transport.to_string())
        .status()
        .with_context(|| format!("cannot run {}", program.to_string_lossy()))?;
    tracing::debug!(target: "remora::startup", ?status, "program exited");
    Ok(status)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The error of `remora run` with `shim` and `command` and nothing else set.
    fn run_error(shim: &str, command: &[&str]) -> String {
        run(RunOptions {
            server: None,
            transport: TransportChoice::Auto,
            shim: Some(shim.into()),
            serve_args: vec![],
            profile: false,
            auth_token_file: None,
            tls: crate::ClientTlsArgs::default(),
            command: command.iter().map(|c| (*c).into()).collect(),
        })
        .unwrap_err()
        .to_string()
    }

    #[test]
    fn missing_program_is_a_clear_error() {
        let err = run_error("/nonexistent", &[]);
        assert!(err.contains("remora run -- ./app"), "{err}");
    }

    #[test]
    fn missing_shim_is_a_clear_error() {
        let err = run_error("/nonexistent/libcuda.so", &["true"]);
        assert!(err.contains("/nonexistent/libcuda.so"), "{err}");
    }
}
