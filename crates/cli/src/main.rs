//! `remora`: the command-line front end. Each subcommand is a thin layer over a library crate.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use remora_oncrpc::{Endpoint, TransportChoice};

/// `println!` for the command's output, without the panic when stdout is a closed pipe
/// (`remora bench null | head -1`): the process exits as a SIGPIPE'd Unix tool would (141).
macro_rules! outln {
    ($($arg:tt)*) => {
        $crate::write_out(format_args!($($arg)*))
    };
}

/// What [`outln!`] does.
pub(crate) fn write_out(args: std::fmt::Arguments<'_>) {
    use std::io::Write as _;
    if let Err(e) = writeln!(std::io::stdout().lock(), "{args}")
        && e.kind() == std::io::ErrorKind::BrokenPipe
    {
        std::process::exit(141);
    }
}

/// Connects to the Remora server at `server`. A connection that cannot be made is one line
/// naming the URL, the system's reason and what to check; the `io::Error` stays the error's
/// cause.
/// The client configuration's opening call: HELLO_AUTH with `hello` and `token`, or none
/// without a token.
pub(crate) fn opening_call(
    hello: &remora_proto::remora::HelloArgs,
    token: Option<&str>,
) -> Result<Option<remora_oncrpc::OpeningCall>> {
    token
        .map(|t| remora_proto::token::hello_auth_call(hello, t.as_bytes()))
        .transpose()
        .context("cannot encode HELLO_AUTH")
}

pub(crate) fn connect(
    server: &Endpoint,
    config: remora_oncrpc::ClientConfig,
) -> Result<remora_oncrpc::Client> {
    let with_token = config.opening_call.is_some();
    remora_oncrpc::Client::connect_with(server, config).map_err(|e| match e {
        remora_oncrpc::RpcError::Connect { endpoint, source } => {
            let line = format!(
                "cannot connect to {endpoint}: {source}; check that `remora serve` is running \
                 there and that the address is right"
            );
            anyhow::Error::new(source).context(line)
        }
        e => auth_error(e, server, with_token),
    })
}

/// The client's token: from `file` (a private file holding just the token), else
/// REMORA_AUTH_TOKEN, else REMORA_AUTH_TOKEN_FILE; `None` when none is given. A token that
/// cannot be used is an error that never quotes it.
pub(crate) fn client_token(file: Option<&std::path::Path>) -> Result<Option<String>> {
    use remora_proto::token::{read_token_file, token_problem};
    if let Some(file) = file {
        return Ok(Some(read_token_file(file)?));
    }
    if let Some(v) = std::env::var_os("REMORA_AUTH_TOKEN").filter(|v| !v.is_empty()) {
        let token = v.to_str().map(str::trim).unwrap_or_default();
        if let Some(problem) = token_problem(token.as_bytes()) {
            bail!("REMORA_AUTH_TOKEN is not a valid token: {problem}");
        }
        return Ok(Some(token.to_owned()));
    }
    match std::env::var_os("REMORA_AUTH_TOKEN_FILE").filter(|v| !v.is_empty()) {
        Some(path) => Ok(Some(
            read_token_file(std::path::Path::new(&path)).context("REMORA_AUTH_TOKEN_FILE")?,
        )),
        None => Ok(None),
    }
}

/// A client's TLS options (`remora run`, `remora info`), for a `tls://` server. Each one not
/// given falls back to its environment variable.
#[derive(Debug, Default, clap::Args)]
pub(crate) struct ClientTlsArgs {
    /// For a tls:// server: the CA certificate(s), PEM, that signed the server's certificate
    /// (default: REMORA_TLS_CA, else the system's CA certificates). The certificate must
    /// name the URL's host (a DNS name, or an IP address as an IP SAN).
    #[arg(long, value_name = "FILE")]
    tls_ca: Option<PathBuf>,
    /// For a tls:// server that requires client certificates: this client's certificate
    /// chain, PEM (default: REMORA_TLS_CERT). Its subject CN (else first DNS name) is the
    /// tenant the server serves it as. Needs --tls-key.
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The private key of --tls-cert, PEM, mode 0600: refused if group or others may read
    /// or write it (default: REMORA_TLS_KEY).
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
}

impl ClientTlsArgs {
    /// Whether any option was given.
    pub(crate) fn given(&self) -> bool {
        self.tls_ca.is_some() || self.tls_cert.is_some()
    }

    /// The files to use: each option, else its environment variable.
    fn files(&self) -> [(&'static str, Option<PathBuf>); 3] {
        use remora_oncrpc::tls::{ENV_CA, ENV_CERT, ENV_KEY};
        let or_env = |given: &Option<PathBuf>, var: &str| {
            given.clone().or_else(|| {
                std::env::var_os(var)
                    .filter(|v| !v.is_empty())
                    .map(PathBuf::from)
            })
        };
        [
            (ENV_CA, or_env(&self.tls_ca, ENV_CA)),
            (ENV_CERT, or_env(&self.tls_cert, ENV_CERT)),
            (ENV_KEY, or_env(&self.tls_key, ENV_KEY)),
        ]
    }

    /// The TLS settings the options name (checked now: files readable, the key private);
    /// `None` when no option was given (a `tls://` connection then reads the environment).
    pub(crate) fn load(&self) -> Result<Option<std::sync::Arc<remora_oncrpc::ClientTls>>> {
        if !self.given() {
            return Ok(None);
        }
        let [(_, ca), (_, cert), (_, key)] = self.files();
        let identity = match (&cert, &key) {
            (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
            _ => None,
        };
        let tls = remora_oncrpc::ClientTls::from_pem_files(ca.as_deref(), identity)?;
        Ok(Some(std::sync::Arc::new(tls)))
    }

    /// The environment a program started with these options gets: the absolute paths of the
    /// files given (none when no option was).
    pub(crate) fn env(&self) -> Result<Vec<(&'static str, PathBuf)>> {
        if !self.given() {
            return Ok(Vec::new());
        }
        let mut env = Vec::new();
        for (var, file) in self.files() {
            if let Some(file) = file {
                let file = std::path::absolute(&file)
                    .with_context(|| format!("cannot resolve {}", file.display()))?;
                env.push((var, file));
            }
        }
        Ok(env)
    }
}

/// An error of connecting to `server` as a clear line when authentication caused it
/// (`with_token`: a token was presented), else as it is.
pub(crate) fn auth_error(
    e: remora_oncrpc::RpcError,
    server: &Endpoint,
    with_token: bool,
) -> anyhow::Error {
    match remora_proto::token::auth_problem(&e, server, with_token) {
        Some(line) => anyhow::anyhow!("{}", line.trim_start_matches("remora: ")),
        None => anyhow::Error::new(e),
    }
}

/// An error and its causes on one line, as `{:#}` writes them but without a cause whose text
/// an earlier message already quotes (errors that say what their cause said, and return it as
/// their source as well, would repeat it).
fn error_line(e: &anyhow::Error) -> String {
    let mut line = String::new();
    for cause in e.chain() {
        let text = cause.to_string();
        if line.contains(&text) {
            continue;
        }
        if !line.is_empty() {
            line.push_str(": ");
        }
        line.push_str(&text);
    }
    line
}

mod bench_contention;
mod bench_fairness;
mod bench_gpu;
mod bench_null;
mod bench_plot;
mod bench_startup;
mod info;
mod mps;
mod proc_cpu;
mod run;
mod status;

/// Remora: use a GPU that sits somewhere else as if it were local.
///
/// `remora serve` runs on the GPU host; programs reach it over ONC RPC on a Unix socket or TCP.
#[derive(Debug, Parser)]
#[command(name = "remora", version = env!("REMORA_VERSION_LINE"), about, long_about = None, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

/// The examples at the end of `remora run --help`.
const RUN_EXAMPLES: &str = "Examples:
  Run ./app on this host's GPUs, through an embedded server:
    remora run -- ./app --size 1024
  Run it on the GPUs of a `remora serve` on another host:
    remora run --server tcp://gpu-host:7446 -- ./app
  The same with its large copies striped over 7 more connections (default 3; 0: one):
    REMORA_LANES=7 remora run --server tcp://gpu-host:7446 -- ./app
  Run it with the shim's and the embedded server's debug log:
    REMORA_LOG=debug remora run -- ./app";

/// The options `remora serve` hands on to each session's worker process (`serve-worker`).
#[derive(Debug, clap::Args)]
struct SessionArgs {
    /// GPUs to expose, by the real driver's ordinal, in the order clients will see them
    /// (e.g. --devices 1,0). Default: all.
    #[arg(long, value_name = "LIST", value_delimiter = ',')]
    devices: Option<Vec<i32>>,
    /// Largest record a client may send, in bytes (default 128 MiB + 4 KiB).
    #[arg(long, value_name = "BYTES")]
    max_record_size: Option<usize>,
    /// What executes the CUDA calls: `cuda`, the real driver (default), or `emulated`, a
    /// TEST backend for machines without a GPU (host memory, CPU versions of a few test
    /// kernels; never for real work).
    #[arg(long, value_name = "BACKEND", default_value = "cuda", value_parser = ["cuda", "emulated"])]
    backend: String,
    /// Directory of the kernel image cache shared by the sessions (created 0700 if
    /// missing; kept at exit). It must be this user's alone (mode 0700, not a link): the
    /// server refuses to start otherwise. Only regular files in it are read. Default: a private temporary directory, removed at exit,
    /// under process isolation; memory only under thread isolation.
    #[arg(long, value_name = "DIR")]
    module_cache: Option<PathBuf>,
    /// Log, when each connection ends, where its server thread spent its time: calls and
    /// mean/max time per procedure, time waiting for input, time sending replies (INFO
    /// level, on standard error). For finding bottlenecks; costs two clock reads per call.
    #[arg(long)]
    profile: bool,
    /// Do not offer shared memory to clients on this host: they stay on the Unix socket.
    #[arg(long)]
    no_shm: bool,
    /// Bytes of each shared-memory session's data area, through which copies pass their
    /// bytes and where clients' pinned host memory lives (rounded up to 4096; 0: none,
    /// copies travel inside the calls). On a GPU the area is page-locked once per session
    /// for direct DMA, so each session holds this much locked memory.
    #[arg(long, value_name = "BYTES", default_value_t = 256 << 20)]
    shm_data_bytes: u64,
    /// Refuse the calls that make this server run undocumented entry points of its CUDA
    /// driver for a client (today only the private query cuBLASLt makes, so cublasGemmEx
    /// and larger cublasSgemm calls fail with an error); see docs/threat-model.md.
    #[arg(long)]
    no_private_driver_calls: bool,
    /// Most bytes one session may hold on the server in asynchronous device-to-host copies
    /// (cudaMemcpyAsync to host) it has not yet synchronized for. A copy past it fails: the
    /// program's next synchronizing call returns CUDA_ERROR_OUT_OF_MEMORY, and the server
    /// logs the limit. Bounds what a program that never synchronizes makes the server hold.
    /// Default: a quarter of this host's memory, between 4 GiB and 64 GiB.
    #[arg(long, value_name = "BYTES")]
    max_pending_copy_bytes: Option<u64>,
    /// Close a connection after this many seconds without a call while none is in flight
    /// (fractions allowed). Closing a connection ends its session and frees its GPU memory,
    /// so an idle program loses its GPU state: use it to reclaim sessions of clients that
    /// hold connections they no longer use. Default: never.
    #[arg(long, value_name = "SECS", value_parser = parse_secs)]
    idle_timeout: Option<std::time::Duration>,
    /// Require a token from every client: FILE lists one `TENANT TOKEN` a line (blank lines
    /// and # comments allowed; tenant names of A-Z a-z 0-9 _ . -, at most 64; tokens of at
    /// least 16 printable characters without spaces, e.g. from `openssl rand -hex 32`) and
    /// must be private (mode 0600: a file group or others may read or write is refused).
    /// Clients present their token with REMORA_AUTH_TOKEN or `remora run --auth-token-file`;
    /// nothing else is served on a connection before it has. Needed for a TCP listener on a
    /// non-loopback address (or --insecure).
    #[arg(long, value_name = "FILE")]
    auth_token_file: Option<PathBuf>,
    /// Limits per tenant and per session (TOML): `[tenant]` (each tenant as a whole: all its
    /// sessions together), `[session]` (each session), `[tenants.NAME]` and
    /// `[tenants.NAME.session]` (one tenant's own), with the keys device-memory,
    /// pinned-memory, in-flight (sizes such as "8GiB"), streams, events, modules and, for
    /// tenants, sessions and gpu-share (percent of the SMs, with --gpu-share mps);
    /// "unlimited" lifts one. A tenant is the name its token gives;
    /// without tokens, `uid:N` for a local user and `anonymous` for TCP clients. Past a
    /// limit the call fails with CUDA_ERROR_OUT_OF_MEMORY (a session past `sessions` is
    /// refused at HELLO), logged on the remora::audit target. Defaults: no memory limits;
    /// per session 16384 streams, 262144 events, 65536 modules; 256 sessions per tenant.
    /// See docs/threat-model.md.
    #[arg(long, value_name = "FILE")]
    tenants: Option<PathBuf>,
    /// A limit over --tenants' `[tenant]` or `[session]` defaults, e.g. --limit
    /// session.device-memory=8GiB --limit tenant.sessions=4 --limit tenant.gpu-share=50
    /// (repeatable).
    #[arg(long = "limit", value_name = "LEVEL.KEY=VALUE")]
    limits: Vec<String>,
    /// Map Unix users to tenants: FILE lists `UID TENANT` a line (# comments allowed). A
    /// client on a Unix socket whose user is listed, and who presents no token, is that
    /// tenant (limits, status, module cache); unlisted users are the tenant `uid:N`.
    #[arg(long, value_name = "FILE")]
    tenant_map: Option<PathBuf>,
}

/// A duration in seconds (`30`, `0.5`), for `--idle-timeout`.
fn parse_secs(s: &str) -> std::result::Result<std::time::Duration, String> {
    let secs: f64 = s
        .parse()
        .map_err(|_| format!("`{s}` is not a number of seconds (e.g. 300 or 0.5)"))?;
    std::time::Duration::try_from_secs_f64(secs)
        .ok()
        .filter(|d| !d.is_zero())
        .ok_or_else(|| format!("`{s}` must be a positive number of seconds"))
}

/// What `remora serve-worker`'s arguments ask for.
fn worker_config(
    module_cache_bytes: Option<u64>,
    shm_lock_budget: Option<u64>,
    ledger: Option<(i32, usize)>,
    s: SessionArgs,
) -> remora_server::WorkerConfig {
    remora_server::WorkerConfig {
        backend: backend_choice(&s.backend),
        devices: s.devices,
        max_record_size: s.max_record_size,
        module_cache_bytes,
        module_cache_dir: s.module_cache,
        profile: s.profile,
        shm: remora_server::ShmConfig {
            enabled: !s.no_shm,
            data_bytes: s.shm_data_bytes,
            ..remora_server::ShmConfig::default()
        },
        no_private_driver_calls: s.no_private_driver_calls,
        shm_lock_budget,
        max_pending_copy_bytes: s.max_pending_copy_bytes,
        idle_timeout: s.idle_timeout,
        auth_token_file: s.auth_token_file,
        tenants_file: s.tenants,
        limits: s.limits,
        tenant_map: s.tenant_map,
        ledger,
    }
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Run a program against a Remora server through Remora's libcuda.so.1.
    ///
    /// The program loads the shim instead of NVIDIA's driver (it is put first on
    /// LD_LIBRARY_PATH) and reaches the server named by --server. With no --server, an embedded
    /// `remora serve` runs on a private Unix socket for the duration of the command: when the
    /// program exits it is stopped, and the command returns once the program's sessions have
    /// released the GPU (their contexts destroyed; the session workers' own process exits
    /// are not waited for). The exit status is the program's.
    #[command(after_long_help = RUN_EXAMPLES)]
    Run {
        /// The server: tcp://HOST:PORT, tls://HOST:PORT or unix:///PATH, which must answer
        /// before the program starts (default: start an embedded one).
        #[arg(long, value_name = "URL")]
        server: Option<Endpoint>,
        /// How the program reaches the server: auto (shared memory with a unix:// server,
        /// which the embedded one is; TCP with a tcp:// one), shm, unix or tcp (tcp with no
        /// --server: the embedded server listens on TCP loopback). Given to the program as
        /// REMORA_TRANSPORT.
        #[arg(long, value_name = "T", default_value = "auto")]
        transport: TransportChoice,
        /// The shim library (default: libcuda.so beside this executable, or REMORA_SHIM).
        #[arg(long, value_name = "PATH")]
        shim: Option<PathBuf>,
        /// An extra argument for the embedded server (repeatable), e.g. --serve-arg=--devices=1.
        #[arg(long, value_name = "ARG", allow_hyphen_values = true)]
        serve_arg: Vec<std::ffi::OsString>,
        /// A file holding the token for a server started with --auth-token-file (just the
        /// token; mode 0600, refused if group or others may read or write it). Checked with
        /// the server before the program starts, and given to the program as
        /// REMORA_AUTH_TOKEN_FILE. Without it, the program uses REMORA_AUTH_TOKEN or
        /// REMORA_AUTH_TOKEN_FILE from the environment, if set.
        #[arg(long, value_name = "FILE")]
        auth_token_file: Option<PathBuf>,
        /// TLS for a tls:// server; given to the program as REMORA_TLS_CA, REMORA_TLS_CERT
        /// and REMORA_TLS_KEY.
        #[command(flatten)]
        tls: ClientTlsArgs,
        /// Say where the time goes: at exit the program prints on standard error its remote
        /// calls by procedure (count, total, mean and maximum time; REMORA_CLIENT_PROFILE=1),
        /// and an embedded server logs its own table per connection (`remora serve
        /// --profile`). Costs two clock reads per call.
        #[arg(long)]
        profile: bool,
        /// The program and its arguments: `remora run ./app --its-flag`, or with `--` first,
        /// `remora run -- ./app --its-flag` (needed when the program's name starts with -).
        #[arg(required = true, trailing_var_arg = true, value_name = "CMD")]
        command: Vec<std::ffi::OsString>,
    },
    /// Serve the local GPUs to Remora clients.
    ///
    /// With no --listen, listens on a Unix socket in the user's runtime directory
    /// ($XDG_RUNTIME_DIR/remora/remora.sock, else /tmp/remora-$UID/remora.sock). TCP is used
    /// only when asked for, e.g. --listen tcp://127.0.0.1:7446. A TCP address other hosts can
    /// reach (e.g. tcp://0.0.0.0:7446) needs --auth-token-file (or --insecure): without tokens
    /// only this host's users are served. TLS: --listen tls://0.0.0.0:7447 --tls-cert
    /// CERT.pem --tls-key KEY.pem, with --tls-client-ca CA.pem to require client
    /// certificates (which then authenticate clients; otherwise tokens or --insecure are
    /// still needed). Shared memory is never offered over TCP or TLS. Stop with Ctrl-C or SIGTERM: calls in flight finish
    /// first, and once every session has ended it prints "remora serve: stopped" on its
    /// standard output before exiting (under process isolation with no warm worker left, as
    /// in `remora run`'s embedded server, "remora serve: sessions released the GPU" comes
    /// first, once every session's worker has destroyed its contexts). Log level: REMORA_LOG (e.g. REMORA_LOG=debug). With the CUDA backend the server
    /// re-executes itself once with the bottom-up address layout (as `setarch -L` does), so the
    /// driver's device ranges stay clear of clients' own mappings (unified addressing);
    /// REMORA_SERVE_LAYOUT=default keeps the usual layout. During a burst of kernel launches
    /// a session's launches are made by a thread of its own while its connection thread reads
    /// the next (only while the host has a core to spare); REMORA_LAUNCH_THREAD=off keeps
    /// every launch on the connection thread, =on sends every launch through that thread.
    /// Waiting: the server's threads wait for requests and for the GPU adaptively (spinning
    /// while answers have come quickly, blocking otherwise; REMORA_WAIT, as clients do);
    /// REMORA_SERVE_WAIT=spin|block|adaptive gives the server a way of its own. With many
    /// shared-memory clients under MPS, spin takes ~3 us off a launch + synchronize's median
    /// for 4-20 times the server's CPU (bench/results/README.md, session 49).
    Serve {
        /// Where to listen: tcp://HOST:PORT, tls://HOST:PORT (needs --tls-cert and
        /// --tls-key) or unix:///PATH. Repeat for several listeners.
        #[arg(long, value_name = "URL")]
        listen: Vec<Endpoint>,
        /// The certificate chain (PEM) of the tls:// listeners; its first certificate must
        /// name the host clients connect to (DNS name, or IP address as an IP SAN).
        #[arg(long, value_name = "CERT.pem", requires = "tls_key")]
        tls_cert: Option<PathBuf>,
        /// The private key (PEM) of --tls-cert; it must be private (mode 0600: a file group
        /// or others may read or write is refused).
        #[arg(long, value_name = "KEY.pem", requires = "tls_cert")]
        tls_key: Option<PathBuf>,
        /// Require every tls:// client to present a certificate signed by this CA (PEM). Its
        /// subject CN (else its first DNS name; A-Z a-z 0-9 _ . -, at most 64) is the
        /// client's tenant, as a token's tenant is: such a client needs no token, and a
        /// token of another tenant is refused. With it, a tls:// listener other hosts can
        /// reach needs neither --auth-token-file nor --insecure (TLS without it encrypts but
        /// does not authenticate clients).
        #[arg(long, value_name = "CA.pem", requires = "tls_cert")]
        tls_client_ca: Option<PathBuf>,
        /// Register with rpcbind when one runs (clients can then find the TCP port by
        /// program number). The server works without rpcbind.
        #[arg(long)]
        rpcbind: bool,
        /// Where sessions run: `process`, a worker process of its own per connection (the
        /// default with --backend cuda: a CUDA fault or crash in one session cannot reach
        /// another), or `thread`, threads of this process (the default with the emulated
        /// backend).
        #[arg(long, value_name = "MODE", value_parser = ["thread", "process"])]
        isolation: Option<String>,
        /// Most bytes of shared-memory data areas page-locked at once over all sessions; a
        /// session past it still gets its area, but its copies go through private staging
        /// buffers (slower, logged). Bounds the locked memory that many local clients can
        /// make the server hold.
        #[arg(long, value_name = "BYTES", default_value_t = remora_server::DEFAULT_SHM_LOCK_MAX)]
        shm_lock_max: u64,
        /// Most connections served at once; further ones are closed at once. Under process
        /// isolation each is a worker process.
        #[arg(long, value_name = "N", default_value_t = remora_oncrpc::ServerConfig::default().max_connections)]
        max_connections: usize,
        /// Most connections served at once from one peer: one IP address over TCP, one user
        /// (uid) on a Unix socket; further ones from it are closed at once, so that one peer
        /// cannot take every connection.
        #[arg(long, value_name = "N", default_value_t = remora_oncrpc::ServerConfig::default().max_connections_per_peer)]
        max_connections_per_peer: usize,
        /// Serve a TCP listener on a non-loopback address without --auth-token-file: anyone
        /// who reaches the port may use the GPUs. Only for a network you trust completely.
        #[arg(long)]
        insecure: bool,
        /// Serve Prometheus metrics at http://HOST:PORT/metrics (--metrics tcp://HOST:PORT):
        /// per tenant its sessions, its use of each limited kind (device and page-locked
        /// memory, bytes in flight, streams, events, modules) and the calls refused at a
        /// limit; the sessions served. The metrics name every tenant, so a non-loopback
        /// address needs --insecure.
        #[arg(long, value_name = "URL")]
        metrics: Option<Endpoint>,
        /// How tenants share GPU time. off (default): the driver time-slices between the
        /// sessions' contexts, so a tenant that keeps a GPU busy delays everyone else's
        /// kernels and takes as much of it as it asks for, and with many sessions busy at once
        /// even short kernels wait for the others' slices (16 clients' empty-kernel launch +
        /// synchronize: 822 us p50 on an H200, natively as through Remora; 9-40 us under MPS;
        /// the server says so once at 4 sessions). mps: sessions run side by side
        /// under NVIDIA MPS, and each tenant's sessions get at most its `gpu-share` (percent of
        /// the SMs, from --tenants `[tenants.NAME] gpu-share = 50` or --limit
        /// tenant.gpu-share=50). Needs process isolation and the MPS control daemon running
        /// for this server's user (`nvidia-cuda-mps-control -d`); under MPS a fatal GPU fault
        /// of one client can end the other clients on that GPU (docs/threat-model.md). A
        /// gpu-share without --gpu-share mps refuses to start.
        #[arg(long, value_name = "off|mps", default_value = "off")]
        gpu_share: remora_server::gpu_share::GpuShareMode,
        /// Under process isolation, session workers kept started ahead of their connections,
        /// with the driver initialised and a context made on the first GPU, so that a
        /// program's session starts at once (each holds one context's GPU memory while it
        /// waits). 0: start each worker when its connection arrives. A replacement started
        /// while another still waits makes its context only once the session that took its
        /// predecessor ends or has run 1 s (a context made beside a session slows its driver
        /// calls about twofold).
        #[arg(long, value_name = "N", default_value_t = remora_server::DEFAULT_WARM_WORKERS)]
        warm_workers: usize,
        /// Start the --warm-workers once, at start, and do not replace those that sessions
        /// take (what `remora run`'s embedded server does: one program, one session).
        #[arg(long)]
        no_warm_refill: bool,
        /// Under process isolation, do not load the CUDA driver in this accepting process
        /// to log the GPUs (each session worker loads its own and reports them in HELLO), so
        /// that no second driver start runs beside the first worker's. What `remora run`'s
        /// embedded server does. Ignored with --devices, whose selection is checked before
        /// the server listens.
        #[arg(long)]
        no_driver_probe: bool,
        #[command(flatten)]
        session: SessionArgs,
    },
    /// Serve one session: the connection the server passes over standard input, a control
    /// socket (started by `remora serve` under process isolation).
    #[command(hide = true)]
    ServeWorker {
        #[arg(long, value_name = "BYTES")]
        module_cache_bytes: Option<u64>,
        #[arg(long, value_name = "BYTES")]
        shm_lock_budget: Option<u64>,
        /// The server's limits ledger, inherited as this descriptor.
        #[arg(long, value_name = "FD", requires = "ledger_slots")]
        ledger_fd: Option<i32>,
        #[arg(long, value_name = "N")]
        ledger_slots: Option<usize>,
        #[command(flatten)]
        session: SessionArgs,
    },
    /// Ask a server who it is: protocol revision, host, driver and GPUs.
    Info {
        /// The server: tcp://HOST:PORT, tls://HOST:PORT or unix:///PATH (default: the local
        /// default socket).
        #[arg(long, value_name = "URL")]
        server: Option<Endpoint>,
        /// A file holding the token for a server started with --auth-token-file (mode
        /// 0600). Default: REMORA_AUTH_TOKEN or REMORA_AUTH_TOKEN_FILE, if set.
        #[arg(long, value_name = "FILE")]
        auth_token_file: Option<PathBuf>,
        #[command(flatten)]
        tls: ClientTlsArgs,
    },
    /// Show what a server's sessions use, per tenant: sessions, device and page-locked
    /// memory, bytes in flight, streams, events, modules and calls refused at a limit, beside
    /// the server's GPUs (like nvidia-smi for Remora). A server that authenticates its
    /// clients shows each client its own tenant only. The status call is itself a session
    /// of your tenant while it runs.
    Status {
        /// The server: tcp://HOST:PORT, tls://HOST:PORT or unix:///PATH (default: the local
        /// default socket).
        #[arg(long, value_name = "URL")]
        server: Option<Endpoint>,
        /// A file holding the token for a server started with --auth-token-file (mode
        /// 0600). Default: REMORA_AUTH_TOKEN or REMORA_AUTH_TOKEN_FILE, if set.
        #[arg(long, value_name = "FILE")]
        auth_token_file: Option<PathBuf>,
        #[command(flatten)]
        tls: ClientTlsArgs,
    },
    /// Generate a Rust crate (types, client, server trait) from an ONC RPC .x file.
    ///
    /// The crate depends on Remora's XDR and ONC RPC runtime crates by path. Procedures whose
    /// declaration is preceded by a /* @oneway */ comment become one-way (no reply).
    Rpcgen {
        /// The RPCL (.x) file.
        file: PathBuf,
        /// Directory to write the crate into (created; refused if it holds other files).
        #[arg(short, long, value_name = "DIR")]
        output: PathBuf,
        /// Path of a Remora source tree whose crates/xdr and crates/oncrpc the crate uses
        /// (default: the tree this remora was built from).
        #[arg(long, value_name = "PATH")]
        runtime: Option<PathBuf>,
        /// Define a preprocessor symbol for #if/#ifdef in the .x (NAME or NAME=VALUE).
        #[arg(short = 'D', value_name = "NAME[=VALUE]")]
        define: Vec<String>,
    },
    /// Benchmark programs (not tests); results are ratios against a baseline run alongside.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// Remora's ONC RPC against rpcgen/libtirpc: null-call round trip and 1 MiB / 64 MiB echo
    /// over TCP and Unix sockets on loopback.
    Rpc {
        /// Directory holding the libtirpc peers (rpctest_server, rpctest_client) built by
        /// crates/rpctest/c/build.sh; built into a temporary directory when omitted.
        #[arg(long, value_name = "DIR")]
        c_peers: Option<PathBuf>,
        /// Number of null calls per measurement.
        #[arg(long, default_value_t = 20_000)]
        null_calls: u32,
        /// Write the results as JSON to this file as well as printing a table.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
    },
    /// Round trip of Remora's NULL procedure (no work on the server: transport and RPC
    /// runtime alone) against a running `remora serve`; prints p50/p99/mean/min. Needs no GPU.
    Null {
        /// The server: tcp://HOST:PORT or unix:///PATH (default: the local default socket).
        #[arg(long, value_name = "URL")]
        server: Option<Endpoint>,
        /// The transport: auto (shared memory for a unix:// server, TCP for a tcp:// one),
        /// shm, unix or tcp.
        #[arg(long, value_name = "T", default_value = "auto")]
        transport: TransportChoice,
        /// Number of timed calls (a tenth as many warm-up calls go first).
        #[arg(long, default_value_t = 100_000)]
        calls: u32,
        /// Write the results as JSON to this file as well.
        #[arg(long, value_name = "FILE")]
        json: Option<PathBuf>,
    },
    /// Empty-kernel launch throughput (per launch) and launch + synchronize latency, remoted
    /// over shm, unix and tcp against native CUDA in the same run, with 1, 4 and 16
    /// concurrent clients (separate processes). Needs a GPU; starts its own servers unless
    /// --server names one. Prints a table; --json and --png write the report and a plot.
    Launch(GpuBenchArgs),
    /// Synchronous memcpy bandwidth (pinned and pageable host memory, both directions),
    /// remoted against native, with concurrent clients; as `bench launch`.
    Copy(GpuBenchArgs),
    /// Wall-clock time of whole short programs, natively and under `remora run`, as ratios
    /// against native in the same run.
    ///
    /// Modes: native, embedded (a fresh embedded server per run) and standing (servers
    /// started once), the last two per transport. Each run is a fresh process timed from
    /// spawn to exit, start-up included. Two phases: native and embedded with no Remora
    /// server up, then the standing servers beside native-held and embedded-held (native and
    /// embedded runs while they hold the GPU, as persistence mode would; their baseline is
    /// native-held); each phase has an untimed warm-up, then rounds that interleave its modes. Needs a GPU for CUDA programs. Prints a table; --json and
    /// --png write the report and a plot.
    Startup(bench_startup::Args),
    /// Launch + synchronize latency, the CPU time each round trip costs the clients and the
    /// servers, and launch throughput of 1, 4 and 16 clients while CPU-burning processes
    /// (0, 1 and 2 per core) compete for the cores, for each way of waiting: spin (pure
    /// polling), block (no spinning) and adaptive (Remora's default: a spin budget that
    /// follows the waits seen), set with REMORA_WAIT in the servers it starts and in every
    /// client; with --program or --programs, also the wall time of a mix of whole CUDA
    /// programs run against standing servers under each load and way.
    /// Ratios against native at the same load; notes compare adaptive with the better of
    /// spin and block, by the rounds' medians and round by round (the ways run back to back
    /// within a round), and say whether the rounds decide the goal of x1.10 (met, missed or
    /// undecided, from an interval of the per-round ratios' median). Needs a GPU.
    Contention(bench_contention::Args),
    /// Two tenants on one GPU, one greedy (kernels that fill every SM, always queued) and
    /// one latency-sensitive (launch + synchronize), natively and through `remora serve`
    /// with each way of sharing the GPU: off (time slicing) and mps (--gpu-share mps with
    /// each tenant at --share percent). Reports each greedy tenant's share of the GPU and
    /// the latency tenant's p50/p99 alone and beside the greedy one, against the goals
    /// (>= 45% each for two greedy tenants; p99 within 2x of alone). Starts and stops the
    /// MPS control daemon when none runs. Needs a GPU.
    Fairness(bench_fairness::Args),
    /// Keep one core busy until killed (`bench contention`'s CPU burner).
    #[command(hide = true)]
    Burn,
    /// Draw the PNG plot of a `bench launch|copy|startup|contention` JSON report again.
    Plot {
        /// The JSON report (`bench launch|copy|startup --json`).
        #[arg(long, value_name = "FILE")]
        json: PathBuf,
        /// The PNG file to write.
        #[arg(long, value_name = "FILE")]
        png: PathBuf,
    },
    /// One client of `bench launch|copy` (started by it).
    #[command(hide = true)]
    GpuWorker {
        what: bench_gpu::What,
        /// Remora's shim; absent: the native driver (libcuda.so.1 from the system).
        #[arg(long, value_name = "PATH", conflicts_with = "native")]
        driver: Option<PathBuf>,
        #[arg(long)]
        native: bool,
        #[command(flatten)]
        workload: bench_gpu::Workload,
        #[command(flatten)]
        fair: remora_gpubench::FairWorkload,
    },
    /// Serve rpctest.x on one endpoint until killed (used by `bench rpc`).
    #[command(hide = true)]
    RpcServer {
        #[arg(long, value_name = "URL")]
        listen: Endpoint,
    },
}

/// Options of `remora bench launch|copy`.
#[derive(Debug, clap::Args)]
struct GpuBenchArgs {
    /// A running server to measure (tcp://HOST:PORT or unix:///PATH); by default the
    /// benchmark starts its own on a private Unix socket and on TCP loopback.
    #[arg(long, value_name = "URL")]
    server: Option<Endpoint>,
    /// The remoted transports to measure, comma-separated: shm, unix, tcp.
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "shm,unix,tcp"
    )]
    transports: Vec<String>,
    /// Numbers of concurrent clients, comma-separated.
    #[arg(
        long,
        value_name = "LIST",
        value_delimiter = ',',
        default_value = "1,4,16"
    )]
    clients: Vec<u32>,
    /// Rounds; each round runs every mode once, interleaved, and figures are medians.
    #[arg(long, default_value_t = 3)]
    rounds: u32,
    /// Skip the native baseline (a client host without a GPU); no ratios are reported.
    #[arg(long)]
    no_native: bool,
    #[command(flatten)]
    workload: bench_gpu::Workload,
    /// Remora's shim (default: beside this executable, or REMORA_SHIM).
    #[arg(long, value_name = "PATH")]
    shim: Option<PathBuf>,
    /// An extra argument for the embedded servers (repeatable).
    #[arg(long, value_name = "ARG", allow_hyphen_values = true)]
    serve_arg: Vec<std::ffi::OsString>,
    /// Write the report as JSON to this file.
    #[arg(long, value_name = "FILE")]
    json: Option<PathBuf>,
    /// Draw the report as a PNG plot to this file.
    #[arg(long, value_name = "FILE")]
    png: Option<PathBuf>,
    /// bench copy: also measure a plain TCP stream over loopback moving the same bytes in the
    /// same run (mode raw-tcp), and report every copy against it ("vs raw tcp").
    #[arg(long)]
    raw_tcp: bool,
}

impl GpuBenchArgs {
    fn options(self, what: bench_gpu::What) -> bench_gpu::Options {
        bench_gpu::Options {
            what,
            server: self.server,
            transports: self.transports,
            clients: self.clients,
            rounds: self.rounds,
            native: !self.no_native,
            workload: self.workload,
            shim: self.shim,
            serve_args: self.serve_arg,
            json: self.json,
            png: self.png,
            raw_tcp: self.raw_tcp,
            env: Vec::new(),
        }
    }
}

fn init_logging(default: &str) {
    let filter = tracing_subscriber::EnvFilter::try_from_env("REMORA_LOG")
        .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new(default));
    tracing_subscriber::fmt()
        .with_env_filter(filter)
        .with_writer(std::io::stderr)
        .with_ansi(log_colours())
        .init();
}

/// Whether the log on standard error gets ANSI colours: only on a terminal, and not when
/// NO_COLOR is set (to anything but the empty string, as no-color.org asks).
fn log_colours() -> bool {
    std::io::IsTerminal::is_terminal(&std::io::stderr())
        && std::env::var_os("NO_COLOR").is_none_or(|v| v.is_empty())
}

fn backend_choice(backend: &str) -> remora_server::BackendChoice {
    if backend == "emulated" {
        remora_server::BackendChoice::Emulated
    } else {
        remora_server::BackendChoice::Cuda
    }
}

/// What `remora serve` prints on its standard output once it has stopped serving (every
/// session worker reaped), before its process exits.
pub(crate) const SERVE_STOPPED_LINE: &str = "remora serve: stopped";
/// What `remora serve` prints on its standard output, while it shuts down under process
/// isolation with no warm worker left (`remora run`'s embedded server), once every session's
/// worker has destroyed its contexts: before [`SERVE_STOPPED_LINE`], which waits for the
/// workers' exits too (their driver teardown, ~50 ms on the H200 host).
pub(crate) const SERVE_RELEASED_LINE: &str = "remora serve: sessions released the GPU";

fn serve(config: remora_server::ServeConfig) -> Result<()> {
    // Installed before the endpoints are printed: a SIGTERM sent as soon as they are (a
    // supervisor, `remora run`, a test) must stop the server cleanly, not kill it.
    let (tx, rx) = std::sync::mpsc::channel();
    ctrlc::set_handler(move || {
        let _ = tx.send(());
    })
    .context("cannot install the Ctrl-C/SIGTERM handler")?;
    let running = remora_server::start(config).context("remora serve could not start")?;
    for endpoint in running.endpoints() {
        say(&format!("remora serve: listening on {endpoint}"));
    }
    let _ = rx.recv();
    tracing::info!("shutting down (letting calls in flight finish)");
    let stopping = std::time::Instant::now();
    // Said as soon as it holds, from a thread of its own, while the shutdown waits for the
    // workers' exits; joined after, so that it never follows the stopped line.
    let released = running.release_watch().map(|watch| {
        std::thread::spawn(move || {
            watch.wait();
            tracing::debug!(
                target: "remora::startup",
                released_ms = stopping.elapsed().as_millis() as u64,
                "every session's worker released the GPU"
            );
            say(SERVE_RELEASED_LINE);
        })
    });
    running.shutdown();
    if let Some(thread) = released {
        let _ = thread.join();
    }
    tracing::debug!(
        target: "remora::startup",
        shutdown_ms = stopping.elapsed().as_millis() as u64,
        "server stopped"
    );
    // Every session worker has been reaped and the endpoints removed: what is left is this
    // process's own exit, which unloads the driver its probe initialised if it made one
    // (40-70 ms on the H100 host). `remora run` returns on this line (or the released one)
    // instead of waiting for that.
    say(SERVE_STOPPED_LINE);
    Ok(())
}

/// Prints `line` on `remora serve`'s standard output at once, for whoever reads it (a
/// supervisor, `remora run`). Not `outln!`: a server whose reader has gone (it took the
/// first line and closed the pipe: `remora serve | head -1`) goes on serving.
fn say(line: &str) {
    use std::io::Write as _;
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "{line}");
    let _ = out.flush();
}

fn rpcgen(
    file: PathBuf,
    output: PathBuf,
    runtime: Option<PathBuf>,
    define: Vec<String>,
) -> Result<()> {
    let mut options = remora_rpcgen::CrateOptions::new(&file, &output);
    if let Some(runtime) = runtime {
        options = options.runtime(runtime);
    }
    for d in &define {
        let (name, value) = match d.split_once('=') {
            Some((name, value)) => (name, Some(value)),
            None => (d.as_str(), None),
        };
        if name.is_empty() {
            bail!("-D needs a name, as in -D NAME or -D NAME=VALUE");
        }
        options = options.define(name, value);
    }
    let report = remora_rpcgen::generate_crate(&options).map_err(|e| anyhow::anyhow!("{e}"))?;
    outln!(
        "generated crate {} in {} (runtime: {})",
        report.crate_name,
        report.dir.display(),
        report.runtime.display()
    );
    for path in &report.written {
        outln!("  wrote {}", path.display());
    }
    outln!(
        "build it with: cargo build --manifest-path {}",
        report.dir.join("Cargo.toml").display()
    );
    Ok(())
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        Command::Serve {
            listen,
            tls_cert,
            tls_key,
            tls_client_ca,
            rpcbind,
            isolation,
            shm_lock_max,
            max_connections,
            max_connections_per_peer,
            insecure,
            metrics,
            gpu_share,
            warm_workers,
            no_warm_refill,
            no_driver_probe,
            session: s,
        } => {
            init_logging("info");
            if backend_choice(&s.backend) == remora_server::BackendChoice::Cuda {
                // Device ranges away from the clients' own mappings (unified addressing);
                // returns only when no re-execution was needed or possible.
                remora_server::address_layout::reexec_bottom_up();
            }
            let exe = std::env::current_exe().context("cannot find the remora executable")?;
            serve(remora_server::ServeConfig {
                listen,
                devices: s.devices,
                rpcbind,
                max_record_size: s.max_record_size,
                backend: backend_choice(&s.backend),
                module_cache_bytes: None,
                module_cache_dir: s.module_cache,
                isolation: isolation.map(|i| {
                    if i == "thread" {
                        remora_server::Isolation::Thread
                    } else {
                        remora_server::Isolation::Process
                    }
                }),
                worker_command: Some(vec![exe.into_os_string(), "serve-worker".into()]),
                profile: s.profile,
                shm: remora_server::ShmConfig {
                    enabled: !s.no_shm,
                    data_bytes: s.shm_data_bytes,
                    lock_max_bytes: shm_lock_max,
                },
                no_private_driver_calls: s.no_private_driver_calls,
                max_pending_copy_bytes: s.max_pending_copy_bytes,
                max_connections: Some(max_connections),
                max_connections_per_peer: Some(max_connections_per_peer),
                idle_timeout: s.idle_timeout,
                auth_token_file: s.auth_token_file,
                tenants_file: s.tenants,
                limits: s.limits,
                tenant_map: s.tenant_map,
                metrics,
                gpu_share,
                insecure,
                tls: tls_cert
                    .zip(tls_key)
                    .map(|(cert, key)| remora_server::TlsFiles {
                        cert,
                        key,
                        client_ca: tls_client_ca,
                    }),
                warm_workers: Some(warm_workers),
                no_warm_refill,
                no_driver_probe,
            })
        }
        Command::ServeWorker {
            module_cache_bytes,
            shm_lock_budget,
            ledger_fd,
            ledger_slots,
            session: s,
        } => {
            init_logging("info");
            let ledger = ledger_fd.zip(ledger_slots);
            remora_server::serve_worker(worker_config(
                module_cache_bytes,
                shm_lock_budget,
                ledger,
                s,
            ))
            .context("remora serve-worker failed")
        }
        Command::Status {
            server,
            auth_token_file,
            tls,
        } => {
            init_logging("warn");
            let token = client_token(auth_token_file.as_deref())?;
            status::run(
                &server.unwrap_or_else(remora_server::default_endpoint),
                token.as_deref(),
                tls.load()?,
            )
        }
        Command::Info {
            server,
            auth_token_file,
            tls,
        } => {
            init_logging("warn");
            let token = client_token(auth_token_file.as_deref())?;
            info::run(
                &server.unwrap_or_else(remora_server::default_endpoint),
                token.as_deref(),
                tls.load()?,
            )
        }
        Command::Run {
            server,
            transport,
            shim,
            serve_arg,
            auth_token_file,
            tls,
            profile,
            command,
        } => {
            init_logging("warn");
            let status = run::run(run::RunOptions {
                server,
                transport,
                shim,
                serve_args: serve_arg,
                auth_token_file,
                tls,
                profile,
                command,
            })?;
            use std::os::unix::process::ExitStatusExt;
            let code = status
                .code()
                .unwrap_or_else(|| 128 + status.signal().unwrap_or(0));
            std::process::exit(code);
        }
        Command::Rpcgen {
            file,
            output,
            runtime,
            define,
        } => {
            init_logging("warn");
            rpcgen(file, output, runtime, define)
        }
        Command::Bench(BenchCommand::Rpc {
            c_peers,
            null_calls,
            json,
        }) => {
            init_logging("warn");
            let exe = std::env::current_exe().context("cannot find the remora executable")?;
            let report = remora_rpctest::bench::run(&remora_rpctest::bench::Options {
                c_peers,
                null_calls,
                server_command: vec![exe.into(), "bench".into(), "rpc-server".into()],
            })?;
            outln!("{}", report.table());
            if let Some(path) = json {
                std::fs::write(&path, report.json())
                    .with_context(|| format!("cannot write {}", path.display()))?;
                outln!("results written to {}", path.display());
            }
            Ok(())
        }
        Command::Bench(BenchCommand::Null {
            server,
            transport,
            calls,
            json,
        }) => {
            init_logging("warn");
            let server = server.unwrap_or_else(remora_server::default_endpoint);
            bench_null::run(&server, transport, calls, json.as_deref()).map(drop)
        }
        Command::Bench(BenchCommand::Launch(args)) => {
            init_logging("warn");
            bench_gpu::run(&args.options(bench_gpu::What::Launch)).map(drop)
        }
        Command::Bench(BenchCommand::Copy(args)) => {
            init_logging("warn");
            bench_gpu::run(&args.options(bench_gpu::What::Copy)).map(drop)
        }
        Command::Bench(BenchCommand::Startup(args)) => {
            init_logging("warn");
            bench_startup::run(args).map(drop)
        }
        Command::Bench(BenchCommand::Contention(args)) => {
            init_logging("warn");
            bench_contention::run(&args).map(drop)
        }
        Command::Bench(BenchCommand::Fairness(args)) => {
            init_logging("warn");
            bench_fairness::run(&args).map(|_| ())
        }
        Command::Bench(BenchCommand::Burn) => bench_contention::burn(),
        Command::Bench(BenchCommand::Plot { json, png }) => {
            init_logging("warn");
            let text = std::fs::read_to_string(&json)
                .with_context(|| format!("cannot read {}", json.display()))?;
            let report: bench_gpu::Report = serde_json::from_str(&text).with_context(|| {
                format!(
                    "{} is not a `remora bench launch|copy|startup` report",
                    json.display()
                )
            })?;
            bench_plot::plot(&report, &png)?;
            outln!("plot written to {}", png.display());
            Ok(())
        }
        Command::Bench(BenchCommand::GpuWorker {
            what,
            driver,
            native: _,
            workload,
            fair,
        }) => {
            init_logging("warn");
            bench_gpu::worker(&bench_gpu::WorkerOptions {
                what,
                driver,
                workload,
                fair,
            })
        }
        Command::Bench(BenchCommand::RpcServer { listen }) => {
            init_logging("warn");
            remora_rpctest::bench::serve_forever(&listen)
        }
    }
}

fn main() -> ExitCode {
    match run(Cli::parse()) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("remora: error: {}", error_line(&e));
            ExitCode::FAILURE
        }
    }
}

#[cfg(test)]
mod tests {
    use clap::CommandFactory;

    use super::*;

    #[test]
    fn cli_definition_is_consistent() {
        Cli::command().debug_assert();
    }

    #[test]
    fn help_names_every_command_in_its_first_line_and_its_list() {
        let mut cli = Cli::command();
        let help = cli.render_help().to_string();
        let first = help.lines().next().unwrap();
        let commands: Vec<String> = cli
            .get_subcommands()
            .filter(|c| !c.is_hide_set() && c.get_name() != "help")
            .map(|c| c.get_name().to_owned())
            .collect();
        assert!(commands.iter().any(|c| c == "run"), "{commands:?}");
        for name in &commands {
            assert!(
                first.contains(name.as_str()),
                "{name} missing from {first:?}"
            );
            assert!(
                help.lines()
                    .any(|l| l.trim_start().starts_with(&format!("{name} "))),
                "{name} missing from the command list:\n{help}"
            );
        }
        let run = cli.find_subcommand_mut("run").unwrap().render_long_help();
        assert!(run.to_string().contains("Examples:"), "{run}");
    }

    /// `remora run ARGS…`'s program and arguments.
    fn run_command(args: &[&str]) -> Vec<String> {
        let cli = Cli::try_parse_from(["remora", "run"].iter().chain(args)).unwrap();
        let Command::Run { command, .. } = cli.command else {
            panic!()
        };
        command
            .into_iter()
            .map(|a| a.into_string().unwrap())
            .collect()
    }

    #[test]
    fn run_takes_the_program_with_or_without_double_dash() {
        assert_eq!(run_command(&["./app"]), ["./app"]);
        assert_eq!(
            run_command(&["./app", "--flag", "-x"]),
            ["./app", "--flag", "-x"]
        );
        assert_eq!(run_command(&["--", "./app", "--flag"]), ["./app", "--flag"]);
        // Options after the program are the program's, even ones `remora run` has.
        assert_eq!(
            run_command(&["--transport", "tcp", "./app", "--server", "x", "--", "y"]),
            ["./app", "--server", "x", "--", "y"]
        );
        assert_eq!(run_command(&["--", "--weird-name"]), ["--weird-name"]);
        // A typo in remora run's own options is still an error, not a program name.
        assert!(Cli::try_parse_from(["remora", "run", "--servr", "x", "./app"]).is_err());
        assert!(Cli::try_parse_from(["remora", "run"]).is_err());
    }

    #[test]
    fn serve_parses_several_listeners_and_devices() {
        let cli = Cli::try_parse_from([
            "remora",
            "serve",
            "--listen",
            "tcp://127.0.0.1:7446",
            "--listen",
            "unix:///tmp/x.sock",
            "--devices",
            "1,0",
        ])
        .unwrap();
        let Command::Serve {
            listen, session, ..
        } = cli.command
        else {
            panic!()
        };
        assert_eq!(listen.len(), 2);
        assert_eq!(session.devices, Some(vec![1, 0]));
    }

    #[test]
    fn serve_worker_parses_what_the_server_passes() {
        let config = remora_server::WorkerConfig {
            backend: remora_server::BackendChoice::Emulated,
            devices: Some(vec![1, 0]),
            max_record_size: Some(4096),
            module_cache_bytes: Some(1 << 20),
            module_cache_dir: Some("/tmp/m".into()),
            profile: true,
            shm: remora_server::ShmConfig {
                enabled: false,
                data_bytes: 1 << 20,
                ..remora_server::ShmConfig::default()
            },
            no_private_driver_calls: true,
            shm_lock_budget: Some(3 << 20),
            max_pending_copy_bytes: Some(5 << 20),
            idle_timeout: Some(std::time::Duration::from_millis(2500)),
            auth_token_file: Some("/etc/remora/tokens".into()),
            tenants_file: Some("/etc/remora/tenants.toml".into()),
            limits: vec!["session.streams=5".into(), "tenant.sessions=2".into()],
            tenant_map: Some("/etc/remora/uids".into()),
            ledger: Some((7, 1032)),
        };
        let mut args: Vec<std::ffi::OsString> = vec!["remora".into(), "serve-worker".into()];
        args.extend(config.to_args());
        let cli = Cli::try_parse_from(args).unwrap();
        let Command::ServeWorker {
            module_cache_bytes,
            shm_lock_budget,
            ledger_fd,
            ledger_slots,
            session,
        } = cli.command
        else {
            panic!()
        };
        assert_eq!(
            worker_config(
                module_cache_bytes,
                shm_lock_budget,
                ledger_fd.zip(ledger_slots),
                session
            ),
            config
        );
    }

    #[test]
    fn a_refused_connection_is_one_line_with_the_reason_once() {
        let dir = tempfile::tempdir().unwrap();
        let server = Endpoint::Unix(dir.path().join("none.sock"));
        let err = connect(&server, remora_oncrpc::ClientConfig::default()).unwrap_err();
        let line = error_line(&err);
        assert!(
            line.starts_with(&format!("cannot connect to {server}: ")),
            "{line}"
        );
        assert!(line.contains("`remora serve` is running there"), "{line}");
        assert_eq!(
            line.matches("No such file or directory").count(),
            1,
            "{line}"
        );
        assert!(!line.contains('\n'), "{line}");
        // The system's error is still the cause, for callers that look at its kind.
        let io = err.downcast_ref::<std::io::Error>().unwrap();
        assert_eq!(io.kind(), std::io::ErrorKind::NotFound);
        // Context added on top still reads as one line, each message once.
        let wrapped = err.context("remora info failed");
        let line = error_line(&wrapped);
        assert!(
            line.starts_with("remora info failed: cannot connect to "),
            "{line}"
        );
        assert_eq!(
            line.matches("No such file or directory").count(),
            1,
            "{line}"
        );
    }

    #[test]
    fn error_line_keeps_distinct_causes() {
        let err = anyhow::anyhow!("inner").context("middle").context("outer");
        assert_eq!(error_line(&err), "outer: middle: inner");
    }

    #[test]
    fn bad_listen_url_is_a_clear_error() {
        let err = Cli::try_parse_from(["remora", "serve", "--listen", "http://x"]).unwrap_err();
        let msg = err.to_string();
        assert!(msg.contains("tcp://") && msg.contains("unix://"), "{msg}");
    }
}
