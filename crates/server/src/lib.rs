//! `remora serve`: the GPU-side server of Remora.
//!
//! ```text
//! client ──ONC RPC──► remora-oncrpc Server ──► RemoraService ──► Executor ──► Backend
//!                     (one thread per          (sessions, one     (CudaBackend: the real
//!                      connection, deferred     per connection)    libcuda.so.1; or the
//!                      replies)                                    EmulatedBackend, for tests)
//! ```
//!
//! Under process isolation (the default with the CUDA driver) the listening process only
//! accepts: each connection is served by a worker process of its own (`remora serve-worker`,
//! [`serve_worker`]) running the same executor for that one session, so a CUDA fault or a crash
//! stays in its session.
//!
//! The server answers `REMORA_NULL`, `REMORA_HELLO` (protocol negotiation, server identity
//! and the GPU list), `REMORA_HELLO_AUTH` (the same with a token: with `remora serve
//! --auth-token-file` nothing else is served before it succeeds, see [`tokens`]) and every CUDA driver procedure of `remora.x` revision 4. Under process
//! isolation a worker captures its standard output, where the driver writes device-side
//! `printf`, and returns it to the client in synchronizing replies (`device_output.rs`).

pub mod address_layout;
pub mod backend;
mod device_output;
pub mod driver;
mod executor;
pub mod gpu_share;
mod hello;
mod host_callbacks;
mod launcher;
mod metrics;
mod module_cache;
mod printf_scan;
pub mod quota;
mod serve;
mod session;
mod sync_trace;
pub mod tokens;
mod waiters;
mod worker_pool;

pub use backend::{Backend, CudaBackend, EmulatedBackend, EmulatedConfig, LiveCounts};
pub use executor::Executor;
pub use launcher::LaunchThread;

/// The tracing target of the per-session profile lines of `remora serve --profile` (kernel
/// launches' and bulk copies' time in the driver), logged when a session ends. `remora run
/// --profile` turns it on in its embedded server.
pub const PROFILE_LOG_TARGET: &str = "remora_server::profile";
pub use hello::{HelloService, SERVER_VERSION};
pub use module_cache::DEFAULT_CACHE_BYTES;
pub use serve::{
    BackendChoice, DEFAULT_SHM_LOCK_MAX, DEFAULT_WARM_WORKERS, EMULATED_COPY_LATENCY_ENV,
    EMULATED_DEVICE_PRINTF_ENV, Isolation, NO_GPU_LOG_TARGET, ReleaseWatch, RemoraService, Running,
    SESSION_WORKER_THREAD, ServeConfig, ServeError, ShmConfig, TlsFiles, WORKER_GRACE,
    WorkerConfig, default_endpoint, inventory_of, serve_worker, start, start_with_backend,
    start_with_inventory,
};
pub use session::{
    ORDERED_CALL_OVERHEAD, OrderedLimits, default_max_pending_copy_bytes, set_ordered_limits,
};
pub use tokens::Tokens;
