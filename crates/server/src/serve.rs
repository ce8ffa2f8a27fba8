//! Starting and stopping `remora serve`.

use std::path::PathBuf;
use std::sync::Arc;

use remora_oncrpc::{CallContext, Dispatch, Endpoint, Server, ServerConfig, ServerHandle, Service};
use remora_proto::remora::RemoraV1Service;
use remora_xdr::{Decoder, Encoder};

use crate::backend::{Backend, CudaBackend, EmulatedBackend, EmulatedConfig};
use crate::driver::{self, GpuInfo, Inventory};
use crate::executor::Executor;
use crate::hello::HelloService;

/// Which backend executes the CUDA calls.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum BackendChoice {
    /// The real CUDA driver (zero devices when it is missing).
    #[default]
    Cuda,
    /// The emulated TEST backend: host memory, no kernels. For CI and tests only.
    Emulated,
}

/// The `remora.x` service: the generated dispatcher over the [`Executor`], plus the session
/// cleanup when a connection ends.
pub struct RemoraService {
    service: RemoraV1Service<Executor>,
}

impl RemoraService {
    /// Serves `executor`.
    pub fn new(executor: Executor) -> Self {
        Self {
            service: RemoraV1Service::new(executor),
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

    fn dispatch(&self, ctx: &CallContext, args: &mut Decoder, reply: &mut Encoder) -> Dispatch {
        self.service.dispatch(ctx, args, reply)
    }

    fn connection_closed(&self, connection: u64) {
        self.service.inner().close_session(connection);
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
}

/// The default listener: a Unix socket in the user's runtime directory,
/// `$XDG_RUNTIME_DIR/remora/remora.sock`, or `/tmp/remora-$UID/remora.sock` without one.
pub fn default_endpoint() -> Endpoint {
    Endpoint::Unix(default_socket_dir().join("remora.sock"))
}

fn default_socket_dir() -> PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if !dir.is_empty() => PathBuf::from(dir).join("remora"),
        _ => {
            use std::os::unix::fs::MetadataExt;
            let uid = std::fs::metadata("/proc/self")
                .map(|m| m.uid())
                .unwrap_or(0);
            PathBuf::from(format!("/tmp/remora-{uid}"))
        }
    }
}

fn ensure_socket_dir(endpoint: &Endpoint) -> Result<(), ServeError> {
    use std::os::unix::fs::{DirBuilderExt, MetadataExt, PermissionsExt};
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
    if dir == default_socket_dir() {
        // The default directory may sit in /tmp, where another user could have made it first:
        // use it only if it is ours and closed to others.
        match std::fs::symlink_metadata(dir) {
            Ok(meta) => {
                let me = std::fs::metadata("/proc/self")
                    .map(|m| m.uid())
                    .unwrap_or(u32::MAX);
                if !meta.is_dir() || meta.uid() != me || meta.mode() & 0o077 != 0 {
                    return Err(err(std::io::Error::new(
                        std::io::ErrorKind::PermissionDenied,
                        format!(
                            "it must be a directory owned by uid {me} with mode 0700 (it is \
                             owned by uid {} with mode {:o}); remove it, or choose a socket \
                             with --listen unix:///PATH",
                            meta.uid(),
                            meta.mode() & 0o7777
                        ),
                    )));
                }
                return Ok(());
            }
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

/// A running server.
pub struct Running {
    handle: ServerHandle,
    inventory: Inventory,
    service: Arc<RemoraService>,
}

impl Running {
    /// The endpoints actually bound (TCP port 0 resolved).
    pub fn endpoints(&self) -> Vec<Endpoint> {
        self.handle.local_endpoints()
    }

    /// What the driver probe found.
    pub fn inventory(&self) -> &Inventory {
        &self.inventory
    }

    /// The executor (tests inspect its sessions).
    pub fn executor(&self) -> &Executor {
        self.service.executor()
    }

    /// Number of connections being served now.
    pub fn connection_count(&self) -> usize {
        self.handle.connection_count()
    }

    /// Stops accepting, lets calls in flight finish, and joins every thread.
    pub fn shutdown(self) {
        self.handle.shutdown();
    }
}

/// Probes the driver (or sets up the emulated test backend), then starts serving.
pub fn start(config: ServeConfig) -> Result<Running, ServeError> {
    if config.backend == BackendChoice::Emulated {
        let devices = config.devices.as_ref().map_or(1, |d| d.len().max(1));
        let backend = Arc::new(EmulatedBackend::new(EmulatedConfig {
            devices,
            ..EmulatedConfig::default()
        }));
        let inventory = inventory_of(&*backend);
        return start_with_backend(config, backend, inventory);
    }
    let inventory = driver::select_devices(driver::probe(), config.devices.as_deref())
        .map_err(ServeError::Devices)?;
    match &inventory {
        Inventory::Ok {
            driver_version,
            devices,
        } => {
            tracing::info!(
                driver_version,
                devices = devices.len(),
                "CUDA driver loaded"
            )
        }
        Inventory::NotFound(reason) | Inventory::InitFailed(reason) => {
            tracing::warn!("serving zero GPUs: {reason}")
        }
    }
    let backend = match (&inventory, CudaBackend::load(config.devices.as_deref())) {
        (Inventory::Ok { .. }, Ok(b)) => b,
        (Inventory::Ok { .. }, Err(reason)) => {
            tracing::warn!(
                "the CUDA executor is unavailable ({reason}); CUDA calls answer CUDA_ERROR_NO_DEVICE"
            );
            CudaBackend::unavailable()
        }
        _ => CudaBackend::unavailable(),
    };
    start_with_backend(config, Arc::new(backend), inventory)
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

/// Starts serving with `backend` executing the CUDA calls and `inventory` reported by HELLO.
pub fn start_with_backend(
    config: ServeConfig,
    backend: Arc<dyn Backend>,
    inventory: Inventory,
) -> Result<Running, ServeError> {
    tracing::info!(backend = backend.kind(), "CUDA executor ready");
    let listen = if config.listen.is_empty() {
        vec![default_endpoint()]
    } else {
        config.listen
    };
    let mut server_config = ServerConfig::default();
    if let Some(max) = config.max_record_size {
        server_config.max_record_size = max;
    }
    let executor = Executor::new(
        backend,
        HelloService::new(&inventory),
        config
            .module_cache_bytes
            .unwrap_or(crate::module_cache::DEFAULT_CACHE_BYTES),
    );
    let service = Arc::new(RemoraService::new(executor));
    let mut builder =
        Server::builder(server_config).service(Arc::clone(&service) as Arc<dyn Service>);
    for endpoint in &listen {
        ensure_socket_dir(endpoint)?;
        if let Endpoint::Tcp(addr) = endpoint
            && !is_loopback(addr)
        {
            tracing::warn!(
                "listening on {endpoint}, which is not a loopback address: Remora has no \
                 authentication yet, so expose it only on a trusted network"
            );
        }
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
    Ok(Running {
        handle,
        inventory,
        service,
    })
}

fn is_loopback(addr: &str) -> bool {
    use std::net::ToSocketAddrs;
    addr.to_socket_addrs()
        .map(|mut addrs| addrs.all(|a| a.ip().is_loopback()))
        .unwrap_or(false)
}
