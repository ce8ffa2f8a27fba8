//! Starting and stopping `remora serve`.

use std::ffi::OsString;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use remora_oncrpc::{
    CallContext, ConnectionHandler, Dispatch, Endpoint, Server, ServerConfig, ServerHandle, Service,
};
use remora_proto::remora::RemoraV1Service;
use remora_xdr::{Decoder, Encoder};

use crate::backend::{Backend, CudaBackend, EmulatedBackend, EmulatedConfig};
use crate::device_output::DeviceOutput;
use crate::driver::{self, GpuInfo, Inventory};
use crate::executor::Executor;
use crate::hello::HelloService;
use crate::tokens::Tokens;
use crate::worker_pool::WorkerPool;

/// Default of [`ServeConfig::warm_workers`].
pub const DEFAULT_WARM_WORKERS: usize = 2;

/// Which backend executes the CUDA calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BackendChoice {
    /// The real CUDA driver (zero devices when it is missing).
    #[default]
    Cuda,
    /// The emulated TEST backend: host memory, no kernels. For CI and tests only.
    Emulated,
}

/// Where sessions run.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isolation {
    /// Every session is a thread of the server process (a sticky CUDA error or a driver crash
    /// in one session reaches every session). For tests and the emulated backend.
    Thread,
    /// Every session is a worker process of its own, started by exec for each connection:
    /// one session's CUDA faults and crashes stay in its process.
    Process,
}

/// The `remora.x` service: the generated dispatcher over the [`Executor`], plus the session
/// cleanup when a connection ends.
pub struct RemoraService {
    service: Arc<RemoraV1Service<Executor>>,
}

impl RemoraService {
    /// Serves `executor`.
    pub fn new(executor: Executor) -> Self {
        Self {
            service: Arc::new(RemoraV1Service::new(executor)),
        }
    }

    /// The executor.
    pub fn executor(&self) -> &Executor {
        self.service.inner()
    }
}

impl Service for RemoraService {
    fn program(&self) -> u32 {
        self.service.program()
    }

    fn version(&self) -> u32 {
        self.service.version()
    }

    /// Once a session has used a host callback, its calls (all but the host-callback
    /// procedures, which the connection thread answers at once) run in order on the session's
    /// ordered thread, and their replies are sent from there: the connection thread must stay
    /// free to read `RM_HOST_CALLBACK_DONE` while a call waits for a stream that a host
    /// callback blocks (see `crate::host_callbacks`).
    fn dispatch(&self, ctx: &CallContext, args: &mut Decoder, reply: &mut Encoder) -> Dispatch {
        // Under authentication every line the session logs while serving the call names its
        // tenant (no span, and no cost, without tokens).
        let _span = ctx.tenant().map(|tenant| {
            tracing::info_span!("session", tenant, connection = ctx.connection).entered()
        });
        use remora_proto::remora::{
            REMORA_HELLO, REMORA_HELLO_AUTH, REMORA_NULL, RM_COPIES_COLLECT, RM_COPIES_READY,
            RM_HOST_CALLBACK_DONE, RM_LAUNCH_KERNEL, RM_MEMCPY_DTOH, RM_MEMCPY_DTOH_STREAM,
            RM_MEMCPY_HTOD, RM_MEMCPY_HTOD_ASYNC, RM_WAIT_HOST_CALLBACKS,
        };
        // A lane (revision 16) runs its session's copies as calls of the session's own
        // connection (revision 17: asynchronous host-to-device copies too, which the client
        // orders with NULL calls, and stream-ordered device-to-host ones; revision 19: the
        // collection of completed asynchronous device-to-host copies, which the client spreads
        // over its lanes when several replies' worth is held); it serves nothing else.
        let lane_call;
        let ctx = match self.service.inner().lane_main(ctx.connection) {
            None => ctx,
            Some(_) if ctx.procedure == REMORA_NULL => ctx,
            Some(main)
                if matches!(
                    ctx.procedure,
                    RM_MEMCPY_HTOD
                        | RM_MEMCPY_DTOH
                        | RM_MEMCPY_HTOD_ASYNC
                        | RM_MEMCPY_DTOH_STREAM
                        | RM_COPIES_COLLECT
                ) =>
            {
                if !self.service.inner().has_session(main) {
                    tracing::info!(
                        connection = ctx.connection,
                        session = main,
                        "a lane call after its session ended; lane closed"
                    );
                    return Dispatch::Close;
                }
                let mut c = ctx.clone();
                c.connection = main;
                lane_call = c;
                &lane_call
            }
            Some(_) => {
                tracing::warn!(
                    connection = ctx.connection,
                    procedure = ctx.procedure,
                    "a lane serves only its session's bulk copies (RM_MEMCPY_HTOD, RM_MEMCPY_DTOH, RM_MEMCPY_HTOD_ASYNC, RM_MEMCPY_DTOH_STREAM, RM_COPIES_COLLECT); PROC_UNAVAIL"
                );
                return Dispatch::ProcUnavail;
            }
        };
        // RM_COPIES_READY too: a host callback's thread takes the copies its callback follows
        // while the ordered thread may wait for that callback.
        let direct = matches!(
            ctx.procedure,
            REMORA_NULL
                | REMORA_HELLO
                | REMORA_HELLO_AUTH
                | RM_WAIT_HOST_CALLBACKS
                | RM_HOST_CALLBACK_DONE
                | RM_COPIES_READY
        );
        // Every call but a launch runs after the launches the client made before it, some of
        // which a launch thread may still be making (`crate::launcher`); the host-callback
        // procedures never wait for the device (a launch may wait for a callback they end).
        if ctx.procedure != RM_LAUNCH_KERNEL
            && !matches!(
                ctx.procedure,
                RM_WAIT_HOST_CALLBACKS | RM_HOST_CALLBACK_DONE | RM_COPIES_READY
            )
        {
            self.service.inner().drain_launches(ctx.connection);
        }
        if !direct && let Some(session) = self.service.inner().ordered_session(ctx.connection) {
            let service = Arc::clone(&self.service);
            let call = ctx.clone();
            let bytes = args.rest();
            let arg_bytes = bytes.len();
            let job: crate::waiters::Job = Box::new(move || {
                let mut dec = Decoder::new(bytes);
                let mut enc = Encoder::new();
                match service.dispatch(&call, &mut dec, &mut enc) {
                    Dispatch::Success => {
                        if let Some(d) = call.defer() {
                            let sent = d.reply(|out| {
                                for chunk in enc.finish() {
                                    out.put_raw(&chunk);
                                }
                                Ok(())
                            });
                            if let Err(e) = sent {
                                tracing::debug!(error = %e, "reply from the ordered thread not delivered");
                            }
                        }
                    }
                    // One-way, or answered through the call's own deferred reply.
                    Dispatch::NoReply | Dispatch::Deferred => {}
                    // The session broke a bound (logged where): as on the connection thread,
                    // no reply, and the connection closes.
                    Dispatch::Close => call.close_connection(),
                    // Answered SYSTEM_ERR by dropping the deferred reply (the runtime's
                    // GARBAGE_ARGS / PROC_UNAVAIL answers are not reachable from here).
                    other => {
                        tracing::debug!(
                            ?other,
                            procedure = call.procedure,
                            "call failed on the ordered thread"
                        );
                        drop(call.defer());
                    }
                }
            });
            return match session.ordered.submit(job, arg_bytes) {
                Ok(()) => Dispatch::Deferred,
                Err(crate::session::Refused::Stopped(job)) => {
                    // The ordered thread has stopped (the session is closing): run it here.
                    job();
                    Dispatch::Deferred
                }
                Err(crate::session::Refused::Full(bytes, calls)) => {
                    remora_oncrpc::audit!(
                        error,
                        limit "ordered_queue",
                        connection = ctx.connection,
                        procedure = ctx.procedure,
                        queued_bytes = bytes,
                        queued_calls = calls,
                        "the session's ordered queue stayed full (its calls wait behind a host callback the client does not complete, or it sends faster than its GPU work drains); refusing the call and closing the connection, whose session is freed"
                    );
                    Dispatch::Close
                }
            };
        }
        self.service.dispatch(ctx, args, reply)
    }

    fn connection_closed(&self, connection: u64) {
        self.service.inner().close_session(connection);
    }

    fn procedure_name(&self, procedure: u32) -> Option<&'static str> {
        self.service.procedure_name(procedure)
    }
}

/// What `remora serve` was asked to do.
#[derive(Debug, Clone, Default)]
pub struct ServeConfig {
    /// Where to listen; empty means [`default_endpoint`].
    pub listen: Vec<Endpoint>,
    /// Real GPU ordinals to expose, in the order clients will see them; `None` exposes all.
    pub devices: Option<Vec<i32>>,
    /// Register with rpcbind, when one runs.
    pub rpcbind: bool,
    /// Largest record a client may send, in bytes; `None` keeps the runtime's default.
    pub max_record_size: Option<usize>,
    /// The backend; the emulated one is a test backend, used only when asked for.
    pub backend: BackendChoice,
    /// Bound of the server-wide kernel image cache; `None`: [`crate::DEFAULT_CACHE_BYTES`].
    pub module_cache_bytes: Option<u64>,
    /// Directory of the kernel image cache shared by the sessions' processes; `None`: a
    /// private temporary directory under process isolation (removed at shutdown), memory
    /// only under thread isolation.
    pub module_cache_dir: Option<PathBuf>,
    /// Threads or processes; `None`: processes for the CUDA backend, threads for the emulated
    /// one.
    pub isolation: Option<Isolation>,
    /// Under process isolation, the program and leading arguments that start a worker
    /// (e.g. `remora serve-worker`); the server appends the [`WorkerConfig`] arguments
    /// ([`WorkerConfig::to_args`]) and gives the connection as standard input. `None`: this
    /// executable with the argument `serve-worker`.
    pub worker_command: Option<Vec<OsString>>,
    /// Log per-connection timing counters when each connection ends
    /// ([`ServerConfig::profile`]).
    pub profile: bool,
    /// Shared memory for clients on this host (docs/protocol.md, SHM_SETUP).
    pub shm: ShmConfig,
    /// Refuse the procedures that call undocumented entry points of the real driver on a
    /// client's behalf (`RM_TOOLS_CTX_QUERY`, which cuBLASLt needs; docs/threat-model.md).
    pub no_private_driver_calls: bool,
    /// Bytes one session may hold staged in asynchronous device-to-host copies it has not
    /// synchronized for; `None`: [`crate::default_max_pending_copy_bytes`].
    pub max_pending_copy_bytes: Option<u64>,
    /// Connections served at once; `None`: the runtime's default
    /// ([`ServerConfig::max_connections`]). Under process isolation, also the most workers.
    pub max_connections: Option<usize>,
    /// Connections served at once from one peer (IP address, or uid on a Unix socket);
    /// `None`: the runtime's default ([`ServerConfig::max_connections_per_peer`]).
    pub max_connections_per_peer: Option<usize>,
    /// Close a connection with no call in flight after this long without a call; `None`:
    /// never (the default: closing a connection frees its session).
    pub idle_timeout: Option<Duration>,
    /// The token file (`TENANT TOKEN` lines, mode 0600; [`crate::tokens`]): every connection
    /// must present one of its tokens in `REMORA_HELLO_AUTH` before anything else is served.
    /// `None`: no authentication, allowed only on Unix sockets and loopback TCP unless
    /// [`ServeConfig::insecure`].
    pub auth_token_file: Option<PathBuf>,
    /// Serve a TCP listener on a non-loopback address without tokens (a trusted network).
    pub insecure: bool,
    /// The certificate and key of `tls://` listeners, and the CA of the client certificates
    /// they require, if any (`--tls-cert`, `--tls-key`, `--tls-client-ca`).
    pub tls: Option<TlsFiles>,
    /// Under process isolation, session workers kept started and waiting for a connection,
    /// each with its driver initialised and a context made on device 0 (which holds that
    /// context's GPU memory while it waits); `None`: [`DEFAULT_WARM_WORKERS`]. 0: a worker
    /// starts when its connection arrives.
    pub warm_workers: Option<usize>,
    /// Start the warm workers once, at start, and do not replace those sessions take
    /// (`remora run`'s embedded server: one program, usually one session).
    pub no_warm_refill: bool,
    /// Under process isolation without `devices`, do not load the driver in the accepting
    /// process to log the GPUs (the session workers load their own): `remora run`'s embedded
    /// server, whose log is quiet and whose worker's driver start is the program's to wait
    /// for, so that no second driver start runs beside it.
    pub no_driver_probe: bool,
    /// Limits per tenant and per session ([`crate::quota::QuotaConfig`], `--tenants FILE`).
    pub tenants_file: Option<PathBuf>,
    /// `--limit` settings over the file (`tenant.KEY=VALUE`, `session.KEY=VALUE`).
    pub limits: Vec<String>,
    /// Unix users mapped to tenants (`--tenant-map FILE`, lines `UID TENANT`).
    pub tenant_map: Option<PathBuf>,
    /// A Prometheus endpoint (`--metrics tcp://HOST:PORT`, `metrics.rs`); a
    /// non-loopback address needs [`ServeConfig::insecure`].
    pub metrics: Option<Endpoint>,
    /// How tenants share GPU time (`--gpu-share`, [`crate::gpu_share`]).
    pub gpu_share: crate::gpu_share::GpuShareMode,
}

/// The PEM files of `tls://` listeners.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct TlsFiles {
    /// The server's certificate chain (`--tls-cert`).
    pub cert: PathBuf,
    /// Its private key (`--tls-key`; mode 0600, refused if group or others may read it).
    pub key: PathBuf,
    /// The CA whose client certificates are required (`--tls-client-ca`); a verified
    /// certificate's subject CN (else first DNS name) is the connection's tenant. `None`:
    /// no client certificates (TLS encrypts, tokens or nothing authenticate).
    pub client_ca: Option<PathBuf>,
}

impl TlsFiles {
    /// Loads and checks the files.
    pub fn load(&self) -> Result<remora_oncrpc::ServerTls, ServeError> {
        Ok(remora_oncrpc::ServerTls::from_pem_files(
            &self.cert,
            &self.key,
            self.client_ca.as_deref(),
        )?)
    }
}

/// Shared-memory sessions: whether they are offered and the size of their data area.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShmConfig {
    /// Offer shared memory to clients on this host (`remora serve --no-shm`: false).
    pub enabled: bool,
    /// Bytes of each session's data area, where copies pass their bytes by (offset,
    /// length); 0: none (copies travel inside the calls). Default 256 MiB.
    pub data_bytes: u64,
    /// Most bytes of data areas page-locked at once over all sessions (the CUDA backend
    /// registers each session's area for DMA); sessions beyond it copy through private
    /// staging buffers. Default [`DEFAULT_SHM_LOCK_MAX`].
    pub lock_max_bytes: u64,
}

/// Default of [`ShmConfig::lock_max_bytes`]: 16 GiB, 64 sessions with the default area.
pub const DEFAULT_SHM_LOCK_MAX: u64 = 16 << 30;

impl Default for ShmConfig {
    fn default() -> Self {
        Self {
            enabled: true,
            data_bytes: ServerConfig::default().shm_data_bytes,
            lock_max_bytes: DEFAULT_SHM_LOCK_MAX,
        }
    }
}

impl ShmConfig {
    fn apply(&self, server: &mut ServerConfig) {
        if !self.enabled {
            server.shm_ring_capacity = 0;
        }
        server.shm_data_bytes = self.data_bytes;
    }
}

impl ServeConfig {
    /// The isolation this configuration gets.
    pub fn effective_isolation(&self) -> Isolation {
        self.isolation.unwrap_or(match self.backend {
            BackendChoice::Cuda => Isolation::Process,
            BackendChoice::Emulated => Isolation::Thread,
        })
    }
}

/// What a session worker (`remora serve-worker`) is told by the server that starts it.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WorkerConfig {
    /// The backend.
    pub backend: BackendChoice,
    /// Real GPU ordinals to expose; `None`: all.
    pub devices: Option<Vec<i32>>,
    /// Largest record the client may send.
    pub max_record_size: Option<usize>,
    /// Bound of the module cache.
    pub module_cache_bytes: Option<u64>,
    /// The shared module cache directory.
    pub module_cache_dir: Option<PathBuf>,
    /// Log the connection's timing counters when it ends.
    pub profile: bool,
    /// Shared memory for the session's client.
    pub shm: ShmConfig,
    /// Refuse calls into undocumented driver entry points ([`ServeConfig::no_private_driver_calls`]).
    pub no_private_driver_calls: bool,
    /// Bytes of data area this worker's session may page-lock: what the server's
    /// [`ShmConfig::lock_max_bytes`] had left when it started the worker; `None`: unlimited.
    pub shm_lock_budget: Option<u64>,
    /// Bound of the session's undelivered asynchronous copies
    /// ([`ServeConfig::max_pending_copy_bytes`]).
    pub max_pending_copy_bytes: Option<u64>,
    /// Idle timeout of the connection ([`ServeConfig::idle_timeout`]).
    pub idle_timeout: Option<Duration>,
    /// The server's token file ([`ServeConfig::auth_token_file`]): the worker loads it and
    /// serves nothing but NULL and `REMORA_HELLO_AUTH` until the client has presented one
    /// of its tokens.
    pub auth_token_file: Option<PathBuf>,
    /// The limits file ([`ServeConfig::tenants_file`]).
    pub tenants_file: Option<PathBuf>,
    /// The `--limit` settings ([`ServeConfig::limits`]).
    pub limits: Vec<String>,
    /// The tenant map ([`ServeConfig::tenant_map`]).
    pub tenant_map: Option<PathBuf>,
    /// The server's limits ledger this worker inherited: (descriptor, slots). The slot of
    /// the worker's session comes with its connection.
    pub ledger: Option<(i32, usize)>,
}

impl WorkerConfig {
    /// The command-line arguments `remora serve-worker` takes for this configuration:
    /// `--backend cuda|emulated`, `--devices LIST`, `--max-record-size N`,
    /// `--module-cache-bytes N`, `--module-cache DIR`, `--profile`, `--no-shm`,
    /// `--shm-data-bytes N`, `--no-private-driver-calls`, `--shm-lock-budget N`,
    /// `--max-pending-copy-bytes N`, `--idle-timeout SECS`, `--auth-token-file FILE`,
    /// `--tenants FILE`, `--limit KEY=VALUE`…, `--ledger-fd N --ledger-slots N`.
    pub fn to_args(&self) -> Vec<OsString> {
        let mut args: Vec<OsString> = vec![
            "--backend".into(),
            match self.backend {
                BackendChoice::Cuda => "cuda",
                BackendChoice::Emulated => "emulated",
            }
            .into(),
        ];
        if let Some(devices) = &self.devices {
            let list: Vec<String> = devices.iter().map(i32::to_string).collect();
            args.push("--devices".into());
            args.push(list.join(",").into());
        }
        if let Some(max) = self.max_record_size {
            args.push("--max-record-size".into());
            args.push(max.to_string().into());
        }
        if let Some(bytes) = self.module_cache_bytes {
            args.push("--module-cache-bytes".into());
            args.push(bytes.to_string().into());
        }
        if let Some(dir) = &self.module_cache_dir {
            args.push("--module-cache".into());
            args.push(dir.clone().into_os_string());
        }
        if self.profile {
            args.push("--profile".into());
        }
        if !self.shm.enabled {
            args.push("--no-shm".into());
        }
        args.push("--shm-data-bytes".into());
        args.push(self.shm.data_bytes.to_string().into());
        if self.no_private_driver_calls {
            args.push("--no-private-driver-calls".into());
        }
        if let Some(budget) = self.shm_lock_budget {
            args.push("--shm-lock-budget".into());
            args.push(budget.to_string().into());
        }
        if let Some(bytes) = self.max_pending_copy_bytes {
            args.push("--max-pending-copy-bytes".into());
            args.push(bytes.to_string().into());
        }
        if let Some(idle) = self.idle_timeout {
            args.push("--idle-timeout".into());
            args.push(idle.as_secs_f64().to_string().into());
        }
        if let Some(file) = &self.auth_token_file {
            args.push("--auth-token-file".into());
            args.push(file.clone().into_os_string());
        }
        if let Some(file) = &self.tenants_file {
            args.push("--tenants".into());
            args.push(file.clone().into_os_string());
        }
        for limit in &self.limits {
            args.push("--limit".into());
            args.push(limit.into());
        }
        if let Some(file) = &self.tenant_map {
            args.push("--tenant-map".into());
            args.push(file.clone().into_os_string());
        }
        if let Some((fd, slots)) = self.ledger {
            args.push("--ledger-fd".into());
            args.push(fd.to_string().into());
            args.push("--ledger-slots".into());
            args.push(slots.to_string().into());
        }
        args
    }
}

/// Why the server could not start.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// The device selection names GPUs the driver does not have.
    #[error("{0}")]
    Devices(String),
    /// The runtime directory for the default socket could not be made.
    #[error("cannot create the socket directory {path}: {source}")]
    SocketDir {
        /// The directory.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// Listening or starting the RPC server failed.
    #[error(transparent)]
    Rpc(#[from] remora_oncrpc::RpcError),
    /// The module cache directory could not be made, or is not private.
    #[error("cannot use the module cache directory {path}: {source}")]
    ModuleCache {
        /// The directory.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The executable to start session workers with could not be found.
    #[error("cannot find the remora executable to start session workers with: {0}")]
    WorkerExe(std::io::Error),
    /// A session worker could not get its connection from standard input.
    #[error("the session worker has no connection on standard input: {0}")]
    WorkerStdin(std::io::Error),
    /// The token file cannot be used.
    #[error(transparent)]
    Tokens(#[from] remora_proto::token::SecretFileError),
    /// The TLS certificate, key or client CA cannot be used.
    #[error(transparent)]
    Tls(#[from] remora_oncrpc::TlsError),
    /// A `tls://` listener without a certificate, or TLS files without a `tls://` listener.
    #[error("{0}")]
    TlsSetup(&'static str),
    /// A TCP listener reachable from other hosts was asked for without tokens.
    #[error(
        "refusing to listen on {0} without authentication: the address is reachable from other \
         hosts, and anyone who reaches it could use the GPUs and read other sessions' results. \
         Give --auth-token-file FILE (lines `TENANT TOKEN`, mode 0600), or listen on a loopback \
         address or a Unix socket; on a trusted network, --insecure serves it anyway{hint}",
        hint = tls_exposure_hint(.0)
    )]
    Insecure(Endpoint),
    /// The limits file or a `--limit` cannot be used.
    #[error(transparent)]
    Quota(#[from] crate::quota::QuotaError),
    /// The metrics endpoint cannot be used.
    #[error("{0}")]
    Metrics(String),
    /// The limits ledger could not be made or inherited.
    #[error("cannot set up the limits ledger: {0}")]
    Ledger(std::io::Error),
    /// `--gpu-share` cannot enforce the shares asked for.
    #[error("{0}")]
    GpuShare(String),
}

/// The limits of `file` (if any) with `limits` over them.
pub(crate) fn quota_config(
    file: Option<&Path>,
    limits: &[String],
    tenant_map: Option<&Path>,
) -> Result<crate::quota::QuotaConfig, ServeError> {
    let mut config = match file {
        Some(f) => crate::quota::QuotaConfig::load(f)?,
        None => crate::quota::QuotaConfig::default(),
    };
    for l in limits {
        config.apply_cli(l)?;
    }
    if let Some(map) = tenant_map {
        config.load_tenant_map(map)?;
    }
    if let Some(f) = file {
        tracing::info!(file = %f.display(), tenants = config.named_tenants().count(), "limits per tenant and session loaded");
    }
    Ok(config)
}

/// Starts `--metrics`, if asked for, over `ledger` with `figures`.
fn start_metrics(
    config: &ServeConfig,
    ledger: &Arc<crate::quota::Ledger>,
    figures: crate::metrics::ServerFigures,
) -> Result<Option<crate::metrics::Metrics>, ServeError> {
    let Some(endpoint) = &config.metrics else {
        return Ok(None);
    };
    let Endpoint::Tcp(addr) = endpoint else {
        return Err(ServeError::Metrics(format!(
            "--metrics {endpoint}: the endpoint must be tcp://HOST:PORT"
        )));
    };
    if !is_loopback(addr) && !config.insecure {
        return Err(ServeError::Metrics(format!(
            "--metrics {endpoint}: the address is reachable from other hosts, and the metrics name every tenant and what it uses; listen on a loopback address (and scrape through a tunnel or a local agent), or give --insecure on a trusted network"
        )));
    }
    crate::metrics::Metrics::start(addr, Arc::clone(ledger), figures)
        .map(Some)
        .map_err(|e| ServeError::Metrics(format!("--metrics {endpoint}: {e}")))
}

/// Slots of the ledger of a server with `max_connections` (and `warm` workers waiting).
fn ledger_slots(config: &ServeConfig) -> usize {
    config
        .max_connections
        .unwrap_or(ServerConfig::default().max_connections)
        .saturating_add(config.warm_workers.unwrap_or(0))
        .saturating_add(8)
}

/// What [`ServeError::Insecure`] adds for a `tls://` listener.
fn tls_exposure_hint(endpoint: &Endpoint) -> &'static str {
    if matches!(endpoint, Endpoint::Tls(_)) {
        ". TLS encrypts the connection but does not say who the client is: --tls-client-ca \
         CA.pem requires client certificates signed by CA.pem, which authenticate clients as \
         tokens do"
    } else {
        ""
    }
}

/// The default listener: a Unix socket in the user's runtime directory,
/// `$XDG_RUNTIME_DIR/remora/remora.sock`, or `/tmp/remora-$UID/remora.sock` without one.
pub fn default_endpoint() -> Endpoint {
    Endpoint::default_local()
}

fn ensure_socket_dir(endpoint: &Endpoint) -> Result<(), ServeError> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    let Endpoint::Unix(path) = endpoint else {
        return Ok(());
    };
    let Some(dir) = path.parent() else {
        return Ok(());
    };
    let err = |source| ServeError::SocketDir {
        path: dir.to_owned(),
        source,
    };
    if dir == remora_oncrpc::default_socket_dir() {
        // The default directory may sit in /tmp, where another user could have made it first:
        // use it only if it is ours and closed to others.
        match private_dir(dir, "or choose a socket with --listen unix:///PATH") {
            Ok(()) => return Ok(()),
            Err(e) if e.kind() == std::io::ErrorKind::NotFound => {}
            Err(e) => return Err(err(e)),
        }
    } else if dir.as_os_str().is_empty() || dir.exists() {
        return Ok(());
    }
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .map_err(err)?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700)).map_err(err)
}

/// Checks that `dir` is a directory (not a link to one) owned by this process's user and
/// closed to everyone else (mode 0700 or stricter); the error says what it is and, after
/// "remove it, ", `advice`.
fn private_dir(dir: &Path, advice: &str) -> std::io::Result<()> {
    use std::os::unix::fs::MetadataExt;
    let meta = std::fs::symlink_metadata(dir)?;
    let me = std::fs::metadata("/proc/self")
        .map(|m| m.uid())
        .unwrap_or(u32::MAX);
    if !meta.is_dir() || meta.uid() != me || meta.mode() & 0o077 != 0 {
        let what = if meta.is_symlink() {
            "a symbolic link".to_owned()
        } else if meta.is_dir() {
            format!(
                "owned by uid {} with mode {:o}",
                meta.uid(),
                meta.mode() & 0o7777
            )
        } else {
            "not a directory".to_owned()
        };
        return Err(std::io::Error::new(
            std::io::ErrorKind::PermissionDenied,
            format!(
                "it must be a directory owned by uid {me} with mode 0700 (it is {what}); remove it, {advice}"
            ),
        ));
    }
    Ok(())
}

/// A running server.
pub struct Running {
    handle: ServerHandle,
    /// `None` while the accepting process's own driver probe runs beside the server
    /// (process isolation without `--devices`: [`Running::probe`]).
    inventory: Option<Inventory>,
    /// That probe's thread, joined at shutdown.
    probe: Option<std::thread::JoinHandle<()>>,
    /// The executor serving the sessions, under thread isolation.
    service: Option<Arc<RemoraService>>,
    /// The session workers, under process isolation.
    pool: Option<Arc<WorkerPool>>,
    /// The module cache directory this server made, removed at shutdown.
    cache_dir: Option<PrivateDir>,
    /// The Prometheus endpoint (`--metrics`).
    metrics: Option<crate::metrics::Metrics>,
}

impl Running {
    /// The endpoints actually bound (TCP port 0 resolved).
    pub fn endpoints(&self) -> Vec<Endpoint> {
        self.handle.local_endpoints()
    }

    /// What the driver probe found; `None` when this process probes its driver beside the
    /// running server (process isolation without `--devices`: only its log lines say what it
    /// found, and the workers answer HELLO from their own probes).
    pub fn inventory(&self) -> Option<&Inventory> {
        self.inventory.as_ref()
    }

    /// The executor serving every session, under thread isolation (tests inspect its
    /// sessions); `None` under process isolation, where each worker has its own.
    pub fn executor(&self) -> Option<&Executor> {
        self.service.as_deref().map(RemoraService::executor)
    }

    /// Where sessions run.
    pub fn isolation(&self) -> Isolation {
        if self.pool.is_some() {
            Isolation::Process
        } else {
            Isolation::Thread
        }
    }

    /// The process ids of the live session workers, by connection (empty under thread
    /// isolation).
    pub fn worker_pids(&self) -> Vec<u32> {
        self.pool.as_ref().map_or_else(Vec::new, |p| {
            let mut pids: Vec<u32> = p.workers.lock().values().map(|w| w.pid).collect();
            pids.sort_unstable();
            pids
        })
    }

    /// The module cache directory shared by the workers, if any.
    pub fn module_cache_dir(&self) -> Option<&Path> {
        self.cache_dir.as_ref().map(|d| d.path.as_path())
    }

    /// Number of connections being served now.
    pub fn connection_count(&self) -> usize {
        self.handle.connection_count()
    }

    /// Where `--metrics` answers (port 0 resolved), if it was asked for.
    pub fn metrics_addr(&self) -> Option<std::net::SocketAddr> {
        self.metrics
            .as_ref()
            .map(crate::metrics::Metrics::local_addr)
    }

    /// Something to wait on, from another thread while [`Running::shutdown`] runs, for
    /// every session's worker to have released the GPU before it exits
    /// ([`ReleaseWatch::wait`]). Asked for once shutdown has begun (no worker is started
    /// after), and only under process isolation with no warm worker waiting or being started
    /// (`remora run`'s embedded server, whose program took its one warm worker): `None`
    /// otherwise, as a warm worker holds a context of its own until the shutdown ends it,
    /// and under thread isolation the sessions end inside [`Running::shutdown`].
    pub fn release_watch(&self) -> Option<ReleaseWatch> {
        self.pool
            .as_ref()
            .filter(|p| p.no_warm_worker())
            .map(|p| ReleaseWatch(Arc::clone(p)))
    }

    /// Stops accepting, lets calls in flight finish, and joins every thread. Under process
    /// isolation each worker sees its connection end and exits; one still running after
    /// [`WORKER_GRACE`] gets SIGTERM, then SIGKILL after as long again; warm workers without
    /// a session are killed at once (they hold nothing of anyone's). Returns once every worker has been reaped
    /// (and this process's own driver probe has ended, waiting for it at most
    /// [`WORKER_GRACE`]: a process that exits while a thread is inside `cuInit` may hang in
    /// the driver's exit handlers); removes the module cache directory it made.
    pub fn shutdown(self) {
        if let Some(probe) = self.probe {
            let since = Instant::now();
            while !probe.is_finished() && since.elapsed() < WORKER_GRACE {
                std::thread::sleep(Duration::from_millis(5));
            }
            if probe.is_finished() {
                let _ = probe.join();
            } else {
                tracing::warn!("the driver probe is still running at shutdown; not waiting for it");
            }
        }
        drop(self.metrics);
        self.handle.shutdown();
        if let Some(pool) = &self.pool {
            pool.drain();
        }
        drop(self.cache_dir);
    }
}

/// [`Running::release_watch`].
pub struct ReleaseWatch(Arc<WorkerPool>);

impl ReleaseWatch {
    /// Waits until no session's worker holds anything on the GPU: every one has destroyed
    /// its session's contexts and said so, or exited. `remora run` returns on this instead
    /// of on the workers' exits (their driver teardown, ~50 ms on the H200 host).
    pub fn wait(self) {
        self.0.wait_released();
    }
}

/// How long a session worker may take to finish after shutdown begins before it gets
/// SIGTERM (and, as long again after, SIGKILL).
pub const WORKER_GRACE: Duration = Duration::from_secs(5);

/// A 0700 directory this process made, removed with its contents on drop.
struct PrivateDir {
    path: PathBuf,
}

impl PrivateDir {
    fn new() -> Result<Self, ServeError> {
        use std::os::unix::fs::DirBuilderExt;
        let base = std::env::temp_dir();
        let mut last = None;
        for attempt in 0..16u32 {
            let nanos = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.subsec_nanos());
            let path = base.join(format!(
                "remora-modules-{}-{nanos:08x}{attempt}",
                std::process::id()
            ));
            // Not recursive: fails if the name exists, so the directory is ours.
            match std::fs::DirBuilder::new().mode(0o700).create(&path) {
                Ok(()) => return Ok(Self { path }),
                Err(e) if e.kind() == std::io::ErrorKind::AlreadyExists => last = Some(e),
                Err(source) => return Err(ServeError::ModuleCache { path, source }),
            }
        }
        Err(ServeError::ModuleCache {
            path: base,
            source: last.unwrap_or_else(|| std::io::Error::other("no free name")),
        })
    }
}

impl Drop for PrivateDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.path);
    }
}

/// Probes the driver (or sets up the emulated test backend), then starts serving, with the
/// sessions in threads or worker processes as `config` says.
pub fn start(config: ServeConfig) -> Result<Running, ServeError> {
    // Before anything waits: this process's waiters follow REMORA_SERVE_WAIT where set.
    remora_shm::mark_serving();
    match config.effective_isolation() {
        Isolation::Thread => {
            let (backend, inventory) =
                make_backend(config.backend, config.devices.as_deref(), Probe::Server)?;
            start_with_backend(config, backend, inventory)
        }
        Isolation::Process => start_process_isolated(config),
    }
}

/// Who probes the driver: the server (which reports what it found) or a session worker (which
/// finds what its server found and reported at start, and does not say it again for every
/// session).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Probe {
    Server,
    Worker,
}

/// The tracing target of the "serving zero GPUs" warning. `remora run`'s embedded server
/// filters it out (`TARGET=error`): the program's own client reports the server's reason
/// (from HELLO), so the user reads it once.
pub const NO_GPU_LOG_TARGET: &str = "remora_server::no_gpu";

/// The backend and what HELLO reports of it.
fn make_backend(
    choice: BackendChoice,
    devices: Option<&[i32]>,
    probe: Probe,
) -> Result<(Arc<dyn Backend>, Inventory), ServeError> {
    if choice == BackendChoice::Emulated {
        return Ok(emulated_backend(devices, None));
    }
    let inventory = probe_inventory(devices, probe)?;
    // The backend shares the driver the probe opened; without one it is not tried again.
    let loaded = matches!(inventory, Inventory::Ok { .. }).then(|| CudaBackend::load(devices));
    let backend = match loaded {
        Some(Ok(b)) => b,
        Some(Err(reason)) => {
            tracing::warn!(
                "the CUDA executor is unavailable ({reason}); CUDA calls answer CUDA_ERROR_NO_DEVICE"
            );
            CudaBackend::unavailable()
        }
        None => CudaBackend::unavailable(),
    };
    Ok((Arc::new(backend), inventory))
}

/// The name of a thread that a session worker (process isolation) starts once it has its
/// connection, and a waiting warm worker has not: `remora bench` counts the CPU time of the
/// workers serving sessions by it, leaving out warm workers still starting their driver.
pub const SESSION_WORKER_THREAD: &str = "remora-lanes";

/// TEST ONLY: with the emulated backend in a session worker, every context or stream
/// synchronize writes this variable's value to the worker's fd 1, as the driver writes a
/// kernel's printf output, so that CI can test the way device output takes to the client.
pub const EMULATED_DEVICE_PRINTF_ENV: &str = "REMORA_EMULATED_DEVICE_PRINTF";

/// TEST ONLY: with the emulated backend, asynchronous device-to-host copies complete this
/// many milliseconds after they are issued (`EmulatedConfig::copy_latency`), so that tests
/// catch a client that reads a copy's destination before CUDA's rules say it is there.
pub const EMULATED_COPY_LATENCY_ENV: &str = "REMORA_EMULATED_COPY_LATENCY_MS";

/// The emulated test backend (`devices` only counts) and its inventory.
fn emulated_backend(
    devices: Option<&[i32]>,
    device_printf: Option<Vec<u8>>,
) -> (Arc<dyn Backend>, Inventory) {
    let copy_latency = std::env::var(EMULATED_COPY_LATENCY_ENV)
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .map_or(Duration::ZERO, Duration::from_millis);
    let backend = Arc::new(EmulatedBackend::new(EmulatedConfig {
        devices: devices.map_or(1, |d| d.len().max(1)),
        device_printf,
        copy_latency,
        ..EmulatedConfig::default()
    }));
    let inventory = inventory_of(&*backend);
    (backend, inventory)
}

/// Probes the driver, checks the device selection and logs what it found (at debug level in a
/// session worker: its server logged the same at start).
fn probe_inventory(devices: Option<&[i32]>, probe: Probe) -> Result<Inventory, ServeError> {
    let t0 = Instant::now();
    let inventory =
        driver::select_devices(driver::probe(), devices).map_err(ServeError::Devices)?;
    // How long loading the driver and asking it took: under process isolation the server's
    // probe runs beside its warm workers' own start, and beside the listening server unless
    // `--devices` asks for a selection to check first (then it comes before the endpoint is
    // printed, what `remora run` waits for).
    let probe_ms = t0.elapsed().as_millis() as u64;
    tracing::debug!(target: "remora::startup", pid = std::process::id(), ?probe, probe_ms, "driver probed");
    match &inventory {
        Inventory::Ok {
            driver_version,
            devices,
        } => {
            tracing::info!(
                driver_version,
                devices = devices.len(),
                probe_ms,
                "CUDA driver loaded"
            )
        }
        Inventory::NotFound(reason) | Inventory::InitFailed(reason) => match probe {
            Probe::Server => {
                tracing::warn!(target: NO_GPU_LOG_TARGET, "serving zero GPUs: {reason}")
            }
            Probe::Worker => tracing::debug!("session worker: serving zero GPUs: {reason}"),
        },
    }
    Ok(inventory)
}

/// Process isolation: this process accepts and hands every connection to a worker process.
fn start_process_isolated(config: ServeConfig) -> Result<Running, ServeError> {
    check_exposure(&config)?;
    let tls = config.tls.as_ref().map(TlsFiles::load).transpose()?;
    // Loaded here so that a bad file stops the server at start; each worker loads it again
    // and authenticates its connection itself (docs/architecture.md).
    let tokens = load_tokens(config.auth_token_file.as_deref())?;
    // Checked here so that a bad file stops the server; each worker reads it again.
    let quotas = quota_config(
        config.tenants_file.as_deref(),
        &config.limits,
        config.tenant_map.as_deref(),
    )?;
    crate::gpu_share::check_start(config.gpu_share, Isolation::Process, &quotas)?;
    let ledger =
        Arc::new(crate::quota::Ledger::new(ledger_slots(&config)).map_err(ServeError::Ledger)?);
    let (cache_dir, owned_dir) = match &config.module_cache_dir {
        Some(dir) => {
            use std::os::unix::fs::DirBuilderExt;
            std::fs::DirBuilder::new()
                .recursive(true)
                .mode(0o700)
                .create(dir)
                .and_then(|()| {
                    // Images are tenants' code, and files planted there would be loaded: the
                    // directory must be this user's alone (DirBuilder leaves an existing one
                    // as it is).
                    private_dir(
                        dir,
                        "or make it private (chmod 700), or leave --module-cache out for a private temporary one",
                    )
                })
                .map_err(|source| ServeError::ModuleCache {
                    path: dir.clone(),
                    source,
                })?;
            (dir.clone(), None)
        }
        None => {
            let d = PrivateDir::new()?;
            (d.path.clone(), Some(d))
        }
    };
    let command = match &config.worker_command {
        Some(c) if !c.is_empty() => c.clone(),
        _ => {
            let exe = std::env::current_exe().map_err(ServeError::WorkerExe)?;
            vec![exe.into_os_string(), "serve-worker".into()]
        }
    };
    let pool = Arc::new(WorkerPool::new(
        command,
        WorkerConfig {
            backend: config.backend,
            devices: config.devices.clone(),
            max_record_size: config.max_record_size,
            module_cache_bytes: config.module_cache_bytes,
            module_cache_dir: Some(cache_dir.clone()),
            profile: config.profile,
            shm: config.shm,
            no_private_driver_calls: config.no_private_driver_calls,
            shm_lock_budget: None,
            max_pending_copy_bytes: config.max_pending_copy_bytes,
            idle_timeout: config.idle_timeout,
            auth_token_file: config.auth_token_file.clone(),
            tenants_file: config.tenants_file.clone(),
            limits: config.limits.clone(),
            tenant_map: config.tenant_map.clone(),
            ledger: Some((
                std::os::fd::AsRawFd::as_raw_fd(&ledger.fd()),
                ledger.slots(),
            )),
        }
        .to_args(),
        Arc::clone(&ledger),
        (config.shm.data_bytes, config.shm.lock_max_bytes),
        config.warm_workers.unwrap_or(DEFAULT_WARM_WORKERS),
        !config.no_warm_refill,
        (config.gpu_share == crate::gpu_share::GpuShareMode::Mps).then_some(quotas),
    ));
    // The warm workers load and initialise their drivers while this process probes its own.
    pool.fill();
    // The probe checks the device selection and logs the inventory; this process never
    // creates a context, and workers are started by exec, so its driver state reaches no one.
    // With no selection to check it runs beside the listening server instead of before it:
    // the endpoint (what `remora run` waits for before it starts the program) is then printed
    // without waiting for this process's driver start (109-173 ms on an H200), which a
    // program that takes longer than that to reach its first CUDA call (Python importing
    // torch) no longer pays. HELLO is answered by the workers, from their own probes.
    let probe_beside = config.backend == BackendChoice::Cuda && config.devices.is_none();
    let probe_here = probe_beside && !config.no_driver_probe;
    let started = (|| {
        let inventory = match config.backend {
            BackendChoice::Cuda if probe_beside => None,
            BackendChoice::Cuda => Some(probe_inventory(config.devices.as_deref(), Probe::Server)?),
            BackendChoice::Emulated => {
                Some(make_backend(config.backend, config.devices.as_deref(), Probe::Server)?.1)
            }
        };
        tracing::info!(
            module_cache = %cache_dir.display(),
            warm_workers = pool.warm_target,
            "process isolation: one worker process per session"
        );
        // The parent serves no calls; the service is registered so that rpcbind learns the
        // program and version the workers answer.
        let placeholder = Arc::new(RemoraService::new(Executor::new(
            Arc::new(CudaBackend::unavailable()),
            // Never asked: the accepting process answers no HELLO (its workers do).
            HelloService::new(inventory.as_ref().unwrap_or(&Inventory::NotFound(
                "not probed in the accepting process".into(),
            ))),
            0,
        )));
        let handle = listen_and_start(
            &config,
            Server::builder(ServerConfig {
                // Tokens are checked here, before a worker starts for the connection (the
                // worker checks them again as it serves); lanes go to their session's worker.
                first_call_gate: Some(
                    Arc::new(WorkerGate(tokens.clone())) as Arc<dyn remora_oncrpc::FirstCallGate>
                ),
                ..server_config(&config, tokens.as_deref())
            })
            .service(placeholder as Arc<dyn Service>)
            .hand_off(Arc::clone(&pool) as Arc<dyn ConnectionHandler>),
            tls,
        )?;
        Ok((inventory, handle))
    })();
    let started = started.and_then(|(inventory, handle)| {
        let workers = Arc::clone(&pool);
        let metrics = start_metrics(
            &config,
            &ledger,
            Arc::new(move || {
                vec![(
                    "sessions",
                    "Sessions served now (session worker processes with a connection)",
                    workers.workers.lock().len() as i64,
                )]
            }),
        )?;
        Ok((inventory, handle, metrics))
    });
    let (inventory, handle, metrics) = match started {
        Ok(v) => v,
        Err(e) => {
            pool.drain();
            return Err(e);
        }
    };
    let probe = if probe_here {
        let spawned = std::thread::Builder::new()
            .name("remora-probe".into())
            .spawn(|| {
                if let Err(e) = probe_inventory(None, Probe::Server) {
                    tracing::error!("driver probe: {e}");
                }
            });
        match spawned {
            Ok(t) => Some(t),
            Err(e) => {
                tracing::warn!(error = %e, "cannot start the driver probe's thread; the driver is not probed here (the workers probe their own)");
                None
            }
        }
    } else {
        None
    };
    Ok(Running {
        handle,
        inventory,
        probe,
        service: None,
        pool: Some(pool),
        cache_dir: owned_dir,
        metrics,
    })
}

/// The check of a connection's first call in the accepting process under process isolation:
/// a `REMORA_LANE_ATTACH` goes to the worker that serves its session (the key's route; that
/// worker checks the secret); with tokens, only a `REMORA_HELLO_AUTH` with a known token gets
/// a worker, which learns the tenant here too.
#[derive(Debug)]
struct WorkerGate(Option<Arc<Tokens>>);

impl remora_oncrpc::FirstCallGate for WorkerGate {
    fn check(
        &self,
        peer: &remora_oncrpc::Peer,
        authenticated: bool,
        program: u32,
        procedure: u32,
        args: &[u8],
    ) -> Result<remora_oncrpc::Admission, remora_oncrpc::AuthStat> {
        use remora_proto::remora::{
            HelloAuthArgs, LaneKey, REMORA_HELLO_AUTH, REMORA_LANE_ATTACH, REMORA_PROG,
        };
        let decode = |args: &[u8]| {
            remora_oncrpc::xdr::Decoder::new(remora_xdr::Bytes::copy_from_slice(args))
        };
        if program == REMORA_PROG && procedure == REMORA_LANE_ATTACH {
            let key: Option<LaneKey> =
                remora_oncrpc::xdr::XdrDecode::decode(&mut decode(args)).ok();
            return match key {
                Some(k) => Ok(remora_oncrpc::Admission {
                    tenant: None,
                    route: Some(k.route),
                }),
                None => {
                    remora_oncrpc::audit!(warn, "auth_failed", %peer,
                        "a lane with an undecodable key; AUTH_ERROR (AUTH_BADCRED), connection closed");
                    Err(remora_oncrpc::AuthStat::BadCred)
                }
            };
        }
        // A client certificate authenticated the connection already (its tenant travels in
        // the hand-off), or there are no tokens to check.
        let Some(tokens) = self.0.as_ref().filter(|_| !authenticated) else {
            return Ok(remora_oncrpc::Admission::default());
        };
        if program != REMORA_PROG || procedure != REMORA_HELLO_AUTH {
            remora_oncrpc::audit!(info, "auth_required", %peer, program, procedure,
                "a first call other than REMORA_HELLO_AUTH on a server with tokens; AUTH_ERROR (AUTH_TOOWEAK), connection closed before a session worker started");
            return Err(remora_oncrpc::AuthStat::TooWeak);
        }
        let hello: Option<HelloAuthArgs> =
            remora_oncrpc::xdr::XdrDecode::decode(&mut decode(args)).ok();
        match hello.as_ref().and_then(|h| tokens.tenant_of(&h.token)) {
            Some(tenant) => Ok(remora_oncrpc::Admission {
                tenant: Some(tenant.to_owned()),
                route: None,
            }),
            None => {
                remora_oncrpc::audit!(warn, "auth_failed", %peer,
                    "authentication failed: HELLO_AUTH with a token the server does not know; AUTH_ERROR (AUTH_BADCRED), connection closed before a session worker started");
                Err(remora_oncrpc::AuthStat::BadCred)
            }
        }
    }
}

/// The calls a connection may make before it has authenticated, when the server has tokens:
/// NULL (liveness pings), `REMORA_HELLO_AUTH` and `REMORA_LANE_ATTACH` (a session's key).
fn auth_open_procedures(tokens: Option<&Tokens>) -> Option<Vec<(u32, u32)>> {
    use remora_proto::remora::{REMORA_HELLO_AUTH, REMORA_LANE_ATTACH, REMORA_NULL, REMORA_PROG};
    // A lane authenticates with its session's key (lanes.rs).
    tokens.map(|_| {
        vec![
            (REMORA_PROG, REMORA_NULL),
            (REMORA_PROG, REMORA_HELLO_AUTH),
            (REMORA_PROG, REMORA_LANE_ATTACH),
        ]
    })
}

/// Loads the token file of `path`, if there is one, and logs how many tenants it names.
fn load_tokens(path: Option<&Path>) -> Result<Option<Arc<Tokens>>, ServeError> {
    let Some(path) = path else {
        return Ok(None);
    };
    let tokens = Tokens::load(path)?;
    tracing::debug!(tenants = tokens.len(), file = %path.display(), "authentication tokens loaded");
    Ok(Some(Arc::new(tokens)))
}

fn server_config(config: &ServeConfig, tokens: Option<&Tokens>) -> ServerConfig {
    let mut server_config = ServerConfig {
        auth_open_procedures: auth_open_procedures(tokens),
        ..ServerConfig::default()
    };
    if let Some(max) = config.max_record_size {
        server_config.max_record_size = max;
    }
    server_config.profile = config.profile;
    config.shm.apply(&mut server_config);
    if let Some(max) = config.max_connections {
        server_config.max_connections = max;
    }
    if let Some(max) = config.max_connections_per_peer {
        server_config.max_connections_per_peer = max;
    }
    server_config.idle_timeout = config.idle_timeout;
    server_config.max_first_record_size = Some(MAX_HELLO_RECORD);
    server_config
}

/// Largest record a connection may send before its first call (HELLO, and `SHM_SETUP`
/// before it): both are well under 1 KiB. 128 MiB records are accepted only after.
pub(crate) const MAX_HELLO_RECORD: usize = 64 << 10;

/// The endpoints `config` listens on: its own, or the default one.
fn endpoints(config: &ServeConfig) -> Vec<Endpoint> {
    if config.listen.is_empty() {
        vec![default_endpoint()]
    } else {
        config.listen.clone()
    }
}

/// Refuses a TCP listener reachable from other hosts when the server has no tokens, unless
/// `--insecure` says the network is trusted; notes when a local listener runs without
/// authentication. Called before anything is loaded or bound.
fn check_exposure(config: &ServeConfig) -> Result<(), ServeError> {
    let any_tls = endpoints(config)
        .iter()
        .any(|e| matches!(e, Endpoint::Tls(_)));
    match (&config.tls, any_tls) {
        (None, true) => {
            return Err(ServeError::TlsSetup(
                "a tls:// listener needs the server's certificate and private key: give \
                 --tls-cert CERT.pem and --tls-key KEY.pem (PEM files; the key of mode 0600)",
            ));
        }
        (Some(_), false) => {
            return Err(ServeError::TlsSetup(
                "--tls-cert, --tls-key and --tls-client-ca are for tls:// listeners, and \
                 none is given: add --listen tls://HOST:PORT, or leave the TLS options out",
            ));
        }
        _ => {}
    }
    if config.auth_token_file.is_some() {
        return Ok(());
    }
    let client_certs = config.tls.as_ref().is_some_and(|t| t.client_ca.is_some());
    for endpoint in endpoints(config) {
        match &endpoint {
            Endpoint::Tls(_) if client_certs => tracing::info!(
                "{endpoint}: clients are authenticated by their TLS certificates \
                 (--tls-client-ca)"
            ),
            Endpoint::Tcp(addr) | Endpoint::Tls(addr) if !is_loopback(addr) => {
                if !config.insecure {
                    return Err(ServeError::Insecure(endpoint));
                }
                tracing::warn!(
                    "listening on {endpoint}, which is not a loopback address, WITHOUT \
                     authentication (--insecure): anyone who reaches it may use the GPUs; \
                     expose it only on a trusted network, or give --auth-token-file"
                );
            }
            _ => tracing::info!(
                "no --auth-token-file: {endpoint} is served without authentication (it is \
                 reachable only from this host{})",
                if matches!(endpoint, Endpoint::Unix(_)) {
                    ", by those whom the socket's permissions let in"
                } else {
                    ""
                }
            ),
        }
    }
    Ok(())
}

/// Binds every endpoint of `config` (the default one when none) and starts `builder`.
fn listen_and_start(
    config: &ServeConfig,
    mut builder: Server,
    tls: Option<remora_oncrpc::ServerTls>,
) -> Result<ServerHandle, ServeError> {
    if let Some(tls) = tls {
        builder = builder.tls(tls);
    }
    for endpoint in &endpoints(config) {
        ensure_socket_dir(endpoint)?;
        builder = builder.listen(endpoint)?;
    }
    let handle = builder.start()?;
    if config.rpcbind
        && let Err(e) = handle.register_rpcbind()
    {
        tracing::warn!("not registered with rpcbind ({e}); clients must name the port");
    }
    for endpoint in handle.local_endpoints() {
        tracing::info!("listening on {endpoint}");
    }
    Ok(handle)
}

/// The executor options the server and a session worker both take from their configuration.
struct ExecutorOptions {
    module_cache_bytes: Option<u64>,
    module_cache_dir: Option<PathBuf>,
    profile: bool,
    no_private_driver_calls: bool,
    area_lock_budget: u64,
    max_pending_copy_bytes: Option<u64>,
    tokens: Option<Arc<Tokens>>,
}

/// The [`ExecutorOptions`] of a [`ServeConfig`] or a [`WorkerConfig`] (same field names),
/// with the data-area lock budget `budget`.
macro_rules! executor_options {
    ($config:expr, $budget:expr, $tokens:expr) => {
        ExecutorOptions {
            module_cache_bytes: $config.module_cache_bytes,
            module_cache_dir: $config.module_cache_dir.clone(),
            profile: $config.profile,
            no_private_driver_calls: $config.no_private_driver_calls,
            area_lock_budget: $budget,
            max_pending_copy_bytes: $config.max_pending_copy_bytes,
            tokens: $tokens,
        }
    };
}

fn new_executor(backend: Arc<dyn Backend>, inventory: &Inventory, o: ExecutorOptions) -> Executor {
    let executor = Executor::with_module_cache_dir(
        backend,
        HelloService::new(inventory).with_tokens(o.tokens),
        o.module_cache_bytes
            .unwrap_or(crate::module_cache::DEFAULT_CACHE_BYTES),
        o.module_cache_dir,
    );
    executor.set_profile(o.profile);
    executor.set_private_driver_calls(!o.no_private_driver_calls);
    executor.set_area_lock_budget(o.area_lock_budget);
    executor.set_max_pending_copy_bytes(
        o.max_pending_copy_bytes
            .unwrap_or_else(crate::default_max_pending_copy_bytes),
    );
    executor
}

/// Runs one session worker (`remora serve-worker`): serves the connection on standard input
/// with a full executor of its own until it closes. The worker dies with SIGTERM when the
/// server thread that started it goes away.
/// What a gated worker's control socket brought first.
enum Gate {
    /// The server closed it (shutdown, or a smaller pool).
    Closed,
    /// [`crate::worker_pool::GO`]: make the context now.
    Go,
    /// Its session's hand-off, whole (its length in the buffer, its descriptor), before any go.
    Session(usize, std::os::fd::OwnedFd),
}

/// Waits for a gated worker's first message. It reads one byte first, so that a go is never
/// taken together with a hand-off sent after it; a hand-off's descriptor comes with its first
/// byte, and the rest of its one message is read next.
fn gate(
    control: &std::os::unix::net::UnixStream,
    message: &mut [u8; crate::worker_pool::MAX_HANDOFF],
) -> Result<Gate, ServeError> {
    let (n, fd) =
        remora_shm::recv_with_fd(control, &mut message[..1]).map_err(ServeError::WorkerStdin)?;
    match (n, fd) {
        (0, _) => Ok(Gate::Closed),
        (_, None) if message[0] == crate::worker_pool::GO => {
            tracing::debug!(target: "remora::startup", "gated session worker: the server's go came; making its context");
            Ok(Gate::Go)
        }
        (_, Some(fd)) => {
            let (rest, extra) = remora_shm::recv_with_fd(control, &mut message[1..])
                .map_err(ServeError::WorkerStdin)?;
            drop(extra);
            tracing::debug!(target: "remora::startup", "gated session worker: its session came before the go; no context made ahead");
            Ok(Gate::Session(1 + rest, fd))
        }
        (_, None) => Err(ServeError::WorkerStdin(std::io::Error::other(
            "the server sent a gated worker something other than its go or a hand-off",
        ))),
    }
}

pub fn serve_worker(config: WorkerConfig) -> Result<(), ServeError> {
    use std::os::fd::AsFd;
    remora_shm::mark_serving();
    // Die with the server: SIGTERM when the thread that started us ends. If the server is
    // already gone (we were re-parented before this took effect), stop now.
    let _ = rustix::process::set_parent_process_death_signal(Some(rustix::process::Signal::TERM));
    if let Some(server) = std::env::var("REMORA_SERVE_PID")
        .ok()
        .and_then(|p| p.parse::<i32>().ok())
        && rustix::process::getppid().map(|p| p.as_raw_nonzero().get()) != Some(server)
    {
        tracing::warn!("the server that started this session worker is gone; exiting");
        return Ok(());
    }
    let tokens = load_tokens(config.auth_token_file.as_deref())?;
    let quotas = quota_config(
        config.tenants_file.as_deref(),
        &config.limits,
        config.tenant_map.as_deref(),
    )?;
    let share_problem = crate::gpu_share::worker_share_problem();
    let ledger = match config.ledger {
        Some((fd, slots)) => Some(Arc::new(
            crate::quota::Ledger::inherited(fd, slots).map_err(ServeError::Ledger)?,
        )),
        None => None,
    };
    // Standard input is this worker's control socket to the server, which passes the
    // session's connection over it once one arrives (crate::worker_pool).
    let control: std::os::unix::net::UnixStream = std::io::stdin()
        .as_fd()
        .try_clone_to_owned()
        .map_err(ServeError::WorkerStdin)?
        .into();
    // Before the driver is loaded: what it writes to fd 1 (device-side printf) is this one
    // session's, and goes back to its client in synchronizing replies.
    let device_output = match DeviceOutput::capture_stdout() {
        Ok(out) => Some(out),
        Err(e) => {
            tracing::warn!(error = %e, "cannot capture standard output: device printf output stays in the worker");
            None
        }
    };
    let t0 = Instant::now();
    let (backend, inventory) = match config.backend {
        BackendChoice::Emulated => emulated_backend(
            config.devices.as_deref(),
            std::env::var_os(EMULATED_DEVICE_PRINTF_ENV).map(|t| t.into_encoded_bytes()),
        ),
        BackendChoice::Cuda => {
            make_backend(config.backend, config.devices.as_deref(), Probe::Worker)?
        }
    };
    let driver_ms = t0.elapsed().as_millis() as u64;
    if let Inventory::InitFailed(reason) = &inventory
        && std::env::var_os(crate::worker_pool::WARM_ENV).is_some()
        && crate::worker_pool::withdraw(&control)
    {
        tracing::info!(
            "the CUDA driver failed to initialise in a warm session worker ({reason}); it exits, \
             and the next session gets a worker started for it (an MPS server that is starting \
             or stopping answers so for a moment)"
        );
        return Ok(());
    }
    let mut message = [0u8; crate::worker_pool::MAX_HANDOFF];
    // A gated replacement (worker_pool::GATE_ENV) makes its context on the server's go; a
    // connection that comes first finds none made ahead (its session makes its own).
    let early = if std::env::var_os(crate::worker_pool::GATE_ENV).is_some() {
        match gate(&control, &mut message)? {
            Gate::Closed => return Ok(()),
            Gate::Go => None,
            Gate::Session(n, fd) => Some((n, Some(fd))),
        }
    } else {
        None
    };
    if early.is_none() {
        backend.prewarm();
    }
    tracing::debug!(
        target: "remora::startup",
        worker_pid = std::process::id(),
        backend = backend.kind(),
        driver_ms,
        prewarm_ms = t0.elapsed().as_millis() as u64 - driver_ms,
        context_ahead = early.is_none(),
        "session worker ready; waiting for its connection"
    );
    // Tell the server: it starts this worker's replacement only now (see worker_pool.rs).
    let _ = std::io::Write::write_all(&mut &control, &[crate::worker_pool::READY]);
    let received = match early {
        Some(first) => Ok(first),
        None => remora_shm::recv_with_fd(&control, &mut message),
    };
    let (fd, budget, peer, slot, origin) = match received {
        // The server closed the control socket: it is shutting down or shrinking its pool.
        Ok((0, _)) => return Ok(()),
        Ok((n, Some(fd))) => match crate::worker_pool::parse_message(&message[..n]) {
            Some(crate::worker_pool::Message::Session(h)) => {
                (fd, h.budget, h.peer, h.slot, h.origin)
            }
            _ => {
                return Err(ServeError::WorkerStdin(std::io::Error::other(
                    "the server sent a hand-off this worker does not understand",
                )));
            }
        },
        Ok((_, None)) => {
            return Err(ServeError::WorkerStdin(std::io::Error::other(
                "the server's hand-off came without a connection",
            )));
        }
        Err(e) => return Err(ServeError::WorkerStdin(e)),
    };
    // Where this worker says it has released the GPU, once its session is over.
    let release_to = control.try_clone().ok();
    // The session's lanes (revision 16) come over the control socket later, each served on
    // a thread of its own, until the server closes it or this worker ends.
    let (lane_tx, lane_rx) = std::sync::mpsc::channel();
    std::thread::Builder::new()
        .name(SESSION_WORKER_THREAD.into())
        .spawn(move || {
            let mut message = [0u8; crate::worker_pool::MAX_HANDOFF];
            loop {
                match remora_shm::recv_with_fd(&control, &mut message) {
                    Ok((n, Some(fd))) if n > 0 => match crate::worker_pool::parse_message(&message[..n]) {
                        Some(crate::worker_pool::Message::Lane(h)) => {
                            if lane_tx.send((fd, h.origin)).is_err() {
                                return;
                            }
                        }
                        _ => tracing::warn!("the server sent this session worker a message it does not understand; ignored"),
                    },
                    Ok((0, _)) | Err(_) => return,
                    Ok(_) => tracing::warn!("a lane hand-off without a connection; ignored"),
                }
            }
        })
        .map_err(ServeError::WorkerStdin)?;
    tracing::debug!(target: "remora::startup", %peer, tls = origin.tls, "session worker got its connection");
    let executor = new_executor(
        Arc::clone(&backend),
        &inventory,
        executor_options!(
            config,
            config.shm_lock_budget.unwrap_or(budget),
            tokens.clone()
        ),
    );
    if let Some(out) = &device_output {
        executor.deliver_device_output(Arc::clone(out));
    }
    if let Some(why) = share_problem {
        executor.refuse_sessions(why);
    }
    match (ledger, slot) {
        (Some(ledger), slot) if slot < ledger.slots() => {
            executor.set_quotas(quotas, ledger, Some(slot));
        }
        (None, _) => {
            // Started without the server's ledger (a worker command of its own): limits
            // per session only, counted here.
            tracing::warn!(
                "session worker without the server's limits ledger: tenant-wide limits do not include this session"
            );
            executor.set_quotas(
                quotas,
                Arc::new(crate::quota::Ledger::new(1).map_err(ServeError::Ledger)?),
                Some(0),
            );
        }
        (Some(_), _) => {
            return Err(ServeError::WorkerStdin(std::io::Error::other(
                "the server's hand-off named no valid limits slot",
            )));
        }
    }
    let mut server_config = ServerConfig::default();
    if let Some(max) = config.max_record_size {
        server_config.max_record_size = max;
    }
    server_config.profile = config.profile;
    config.shm.apply(&mut server_config);
    server_config.idle_timeout = config.idle_timeout;
    server_config.max_first_record_size = Some(MAX_HELLO_RECORD);
    server_config.auth_open_procedures = auth_open_procedures(tokens.as_deref());
    Server::builder(server_config)
        .service(Arc::new(RemoraService::new(executor)) as Arc<dyn Service>)
        .serve_fds_as(fd, origin, lane_rx)?;
    tracing::debug!(target: "remora::startup", "session worker served its session");
    if let Some(dropped) = device_output.map(|o| o.dropped()).filter(|&d| d > 0) {
        tracing::warn!(
            dropped,
            "bytes of device printf output were dropped because the client did not synchronize in time"
        );
    }
    // The session's contexts were destroyed when it closed; a context made ahead that it
    // never took goes too. Then the GPU holds nothing of this worker's but its process's
    // driver state, which its exit tears down (~50 ms on the H200 host): a server shutting
    // down need not wait for that (worker_pool::RELEASED).
    backend.discard_warm();
    // Logged first: the server's lines that follow the byte come after this one.
    tracing::debug!(target: "remora::startup", "session worker released the GPU; exiting");
    if let Some(control) = &release_to {
        let _ = std::io::Write::write_all(&mut &*control, &[crate::worker_pool::RELEASED]);
    }
    Ok(())
}

/// What a backend's devices look like to HELLO.
pub fn inventory_of(backend: &dyn Backend) -> Inventory {
    let count = backend.device_count().unwrap_or(0);
    let devices = (0..count)
        .filter_map(|ordinal| {
            let p = backend.device_props(ordinal).ok()?;
            let attr = |a: i32| {
                p.attributes
                    .iter()
                    .find(|(k, _)| *k == a)
                    .map_or(0, |(_, v)| *v)
            };
            Some(GpuInfo {
                ordinal,
                name: p.name.clone(),
                uuid: p.uuid,
                total_memory: p.total_memory,
                compute_major: attr(75),
                compute_minor: attr(76),
                multiprocessor_count: attr(16),
                pci_bus_id: p.pci_bus_id.clone(),
            })
        })
        .collect();
    Inventory::Ok {
        driver_version: backend.driver_version().unwrap_or(0),
        devices,
    }
}

/// Starts serving with an inventory the caller already has and no CUDA executor behind it
/// (HELLO tests use this): CUDA calls answer CUDA_ERROR_NO_DEVICE.
pub fn start_with_inventory(
    config: ServeConfig,
    inventory: Inventory,
) -> Result<Running, ServeError> {
    start_with_backend(config, Arc::new(CudaBackend::unavailable()), inventory)
}

/// Starts serving with `backend` executing the CUDA calls and `inventory` reported by HELLO,
/// every session a thread of this process (thread isolation).
pub fn start_with_backend(
    config: ServeConfig,
    backend: Arc<dyn Backend>,
    inventory: Inventory,
) -> Result<Running, ServeError> {
    tracing::info!(backend = backend.kind(), "CUDA executor ready");
    tracing::info!(
        "thread isolation: device-side printf output is not delivered to clients (sessions \
         share this process's standard output); it goes to the server's standard output"
    );
    check_exposure(&config)?;
    let tls = config.tls.as_ref().map(TlsFiles::load).transpose()?;
    let tokens = load_tokens(config.auth_token_file.as_deref())?;
    let executor = new_executor(
        backend,
        &inventory,
        executor_options!(config, config.shm.lock_max_bytes, tokens.clone()),
    );
    let ledger =
        Arc::new(crate::quota::Ledger::new(ledger_slots(&config)).map_err(ServeError::Ledger)?);
    let quotas = quota_config(
        config.tenants_file.as_deref(),
        &config.limits,
        config.tenant_map.as_deref(),
    )?;
    crate::gpu_share::check_start(config.gpu_share, Isolation::Thread, &quotas)?;
    executor.set_quotas(quotas, Arc::clone(&ledger), None);
    let service = Arc::new(RemoraService::new(executor));
    let metrics = {
        let service = Arc::clone(&service);
        start_metrics(
            &config,
            &ledger,
            Arc::new(move || {
                vec![(
                    "sessions",
                    "Sessions served now",
                    service.executor().session_count() as i64,
                )]
            }),
        )?
    };
    let handle = listen_and_start(
        &config,
        Server::builder(server_config(&config, tokens.as_deref()))
            .service(Arc::clone(&service) as Arc<dyn Service>),
        tls,
    )?;
    Ok(Running {
        handle,
        inventory: Some(inventory),
        probe: None,
        service: Some(service),
        pool: None,
        cache_dir: None,
        metrics,
    })
}

fn is_loopback(addr: &str) -> bool {
    use std::net::ToSocketAddrs;
    addr.to_socket_addrs()
        .map(|mut addrs| addrs.all(|a| a.ip().is_loopback()))
        .unwrap_or(false)
}

#[cfg(test)]
mod tests {
    use super::private_dir;
    use super::{Gate, gate};

    #[test]
    fn a_gated_worker_tells_a_go_from_a_hand_off() {
        use std::os::fd::AsFd;
        use std::os::unix::net::UnixStream;
        let mut message = [0u8; crate::worker_pool::MAX_HANDOFF];
        // The go, even with a hand-off queued right behind it: one byte only.
        let (server, worker) = UnixStream::pair().unwrap();
        std::io::Write::write_all(&mut &server, &[crate::worker_pool::GO]).unwrap();
        let (conn, _peer) = UnixStream::pair().unwrap();
        let handoff = crate::worker_pool::handoff_message(
            7,
            1,
            &remora_oncrpc::Origin::default(),
            "unix pid 1",
        );
        remora_shm::send_with_fd(&server, &handoff, conn.as_fd()).unwrap();
        assert!(matches!(gate(&worker, &mut message), Ok(Gate::Go)));
        let (n, fd) = remora_shm::recv_with_fd(&worker, &mut message).unwrap();
        assert_eq!(&message[..n], &handoff[..]);
        assert!(fd.is_some());
        // A hand-off before any go: the whole message and its descriptor.
        let (server, worker) = UnixStream::pair().unwrap();
        remora_shm::send_with_fd(&server, &handoff, conn.as_fd()).unwrap();
        match gate(&worker, &mut message) {
            Ok(Gate::Session(n, _)) => {
                let h = crate::worker_pool::parse_handoff(&message[..n]).unwrap();
                assert_eq!((h.budget, h.slot, h.peer.as_str()), (7, 1, "unix pid 1"));
            }
            Ok(_) => panic!("expected the session"),
            Err(e) => panic!("expected the session, got {e}"),
        }
        // The server closed the socket; or sent something else.
        let (server, worker) = UnixStream::pair().unwrap();
        drop(server);
        assert!(matches!(gate(&worker, &mut message), Ok(Gate::Closed)));
        let (server, worker) = UnixStream::pair().unwrap();
        std::io::Write::write_all(&mut &server, b"x").unwrap();
        assert!(gate(&worker, &mut message).is_err());
    }

    /// The module cache and default socket directories: private directories only.
    #[test]
    fn private_dir_refuses_open_directories_and_links() {
        use std::os::unix::fs::PermissionsExt;
        let base = tempfile::tempdir().unwrap();
        let dir = base.path().join("cache");
        std::fs::create_dir(&dir).unwrap();
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        assert!(private_dir(&dir, "advice").is_ok());
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o777)).unwrap();
        let e = private_dir(&dir, "or chmod it").unwrap_err().to_string();
        assert!(e.contains("mode 777") && e.contains("or chmod it"), "{e}");
        std::fs::set_permissions(&dir, std::fs::Permissions::from_mode(0o700)).unwrap();
        let link = base.path().join("link");
        std::os::unix::fs::symlink(&dir, &link).unwrap();
        let e = private_dir(&link, "advice").unwrap_err().to_string();
        assert!(e.contains("symbolic link"), "{e}");
        let file = base.path().join("file");
        std::fs::write(&file, b"").unwrap();
        let e = private_dir(&file, "advice").unwrap_err().to_string();
        assert!(e.contains("not a directory"), "{e}");
    }
}
