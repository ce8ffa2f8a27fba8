//! Starting and stopping `remora serve`.

use std::path::PathBuf;
use std::sync::Arc;

use remora_oncrpc::{Endpoint, Server, ServerConfig, ServerHandle};
use remora_proto::remora::RemoraV1Service;

use crate::driver::{self, Inventory};
use crate::hello::HelloService;

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

    /// Stops accepting, lets calls in flight finish, and joins every thread.
    pub fn shutdown(self) {
        self.handle.shutdown();
    }
}

/// Probes the driver, then starts serving.
pub fn start(config: ServeConfig) -> Result<Running, ServeError> {
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
    start_with_inventory(config, inventory)
}

/// Starts serving with an inventory the caller already has (tests use this).
pub fn start_with_inventory(
    config: ServeConfig,
    inventory: Inventory,
) -> Result<Running, ServeError> {
    let listen = if config.listen.is_empty() {
        vec![default_endpoint()]
    } else {
        config.listen
    };
    let mut server_config = ServerConfig::default();
    if let Some(max) = config.max_record_size {
        server_config.max_record_size = max;
    }
    let mut builder = Server::builder(server_config).service(Arc::new(RemoraV1Service::new(
        HelloService::new(&inventory),
    )));
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
    Ok(Running { handle, inventory })
}

fn is_loopback(addr: &str) -> bool {
    use std::net::ToSocketAddrs;
    addr.to_socket_addrs()
        .map(|mut addrs| addrs.all(|a| a.ip().is_loopback()))
        .unwrap_or(false)
}
