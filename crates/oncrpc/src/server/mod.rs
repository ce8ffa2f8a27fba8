//! The server runtime: one thread per listener, one thread per connection, no async runtime.
//!
//! * [`accept`]: the [`Server`] builder, listeners, the accept loop, connection limits and
//!   the running [`ServerHandle`].
//! * [`connection`]: serving one connection: reading records, sending replies, deferred
//!   replies, the move into shared memory.
//! * [`dispatch`]: the [`Service`] trait, [`CallContext`], [`Dispatch`] and routing a call
//!   record (header, auth) to its service.
//! * [`profile`]: per-procedure timing ([`ServerConfig::profile`]).

use std::io;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::Duration;

use crate::record::MAX_FRAGMENT_SIZE;

mod accept;
mod connection;
mod dispatch;
mod profile;

pub use accept::{AcceptedConnection, ConnectionHandler, Server, ServerHandle};
pub use connection::DeferredReply;
pub(crate) use connection::{Transport, serve_connection};
pub(crate) use dispatch::Registry;
pub use dispatch::{CallContext, Dispatch, ProcError, ProcResult, Service};

/// Settings of a [`Server`]; the defaults suit trusted and untrusted clients alike.
#[derive(Debug, Clone)]
pub struct ServerConfig {
    /// Largest call record accepted (headers excluded); a client declaring more is
    /// disconnected before more of its data is read. Default 128 MiB + 4 KiB.
    pub max_record_size: usize,
    /// Most connections served at once; further ones are accepted and closed at once.
    /// Default 1024.
    pub max_connections: usize,
    /// Longest time a partially received record may go without new bytes, and longest time
    /// a reply write may wait for a peer that does not read (full socket buffer or response
    /// ring); the connection is closed after. Default 30 s.
    pub stall_timeout: Duration,
    /// Longest time a connection may sit idle between records with no call in flight (no
    /// deferred reply outstanding); `None`: forever, the default, because a connection's
    /// service state (a Remora session and its GPU memory) lives as long as it does.
    pub idle_timeout: Option<Duration>,
    /// Most connections served at once from one peer: one IP address for TCP, one uid
    /// (`SO_PEERCRED`) for Unix sockets. Further ones are accepted and closed at once, so one
    /// peer cannot take every slot of [`ServerConfig::max_connections`]. Default 128.
    pub max_connections_per_peer: usize,
    /// Longest time from accepting a connection to its first call record (for Remora,
    /// HELLO) being complete; the connection is closed after. Default 10 s.
    pub hello_timeout: Duration,
    /// Largest record accepted before the connection's first call was served (a HELLO, and
    /// `SHM_SETUP` before it, are small); [`ServerConfig::max_record_size`] applies after.
    /// `None` (the default: a generic ONC RPC client may well start with a large call):
    /// [`ServerConfig::max_record_size`] from the start. `remora serve` sets 64 KiB.
    pub max_first_record_size: Option<usize>,
    /// Least average rate, in bytes per second, at which a record must arrive once begun:
    /// a record in progress for longer than [`ServerConfig::stall_timeout`] plus its bytes
    /// at this rate is a trickle (slowloris) and the connection is closed. Default 64 KiB/s.
    pub min_record_rate: u64,
    /// Largest fragment sent in replies. Default 2^31 - 1.
    pub max_fragment_size: usize,
    /// Keep per-connection timing counters (time waiting for input, time in each procedure,
    /// time sending replies) and log them at INFO level when the connection ends. Costs two
    /// clock reads per call. Default off.
    pub profile: bool,
    /// Largest ring (bytes, a power of two) of a shared-memory session that a Unix peer may
    /// ask for with `SHM_SETUP` (see `docs/protocol.md`); 0 refuses shared memory. Each such
    /// session holds two rings of this size in a memfd. Default 1 MiB.
    pub shm_ring_capacity: u32,
    /// Bytes of the data area of each shared-memory session (rounded up to 4096; 0: none),
    /// where copies pass their bytes by (offset, length). The client may write it at any
    /// time. Default 256 MiB.
    pub shm_data_bytes: u64,
    /// `None` (the default): no authentication. `Some(open)`: every connection must
    /// authenticate before it is served: until a service calls
    /// [`CallContext::authenticate`] on one of its calls, only calls of these
    /// (program, procedure) pairs (e.g. NULL and an authenticating handshake) are
    /// dispatched; any other call, `SHM_SETUP` included, is answered AUTH_ERROR
    /// (AUTH_TOOWEAK) and the connection is closed. The connection stays held to
    /// [`ServerConfig::hello_timeout`] and [`ServerConfig::max_first_record_size`] until it
    /// has authenticated.
    pub auth_open_procedures: Option<Vec<(u32, u32)>>,
    /// Memory the partial records of all this server's connections may hold together beyond
    /// [`crate::record::BUDGET_FREE`] each (default [`DEFAULT_RECORD_BUDGET`]): a connection
    /// whose record needs more stops reading until there is room, and is closed after
    /// `stall_timeout` without it. Shared by every connection of servers built from clones
    /// of one configuration.
    pub record_budget: std::sync::Arc<crate::record::RecordBudget>,
    /// Under hand-off ([`Server::hand_off`]) with [`ServerConfig::auth_open_procedures`]:
    /// checks a connection's first call (other than NULL) in the accepting process, before
    /// the handler (a worker process) gets the connection. Refused: the call is answered
    /// AUTH_ERROR with the returned status and the connection closed, and no handler runs.
    /// Not asked for connections a TLS client certificate authenticated.
    pub first_call_gate: Option<std::sync::Arc<dyn FirstCallGate>>,
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            max_record_size: crate::client::DEFAULT_MAX_RECORD_SIZE,
            max_connections: 1024,
            stall_timeout: Duration::from_secs(30),
            idle_timeout: None,
            max_connections_per_peer: 128,
            hello_timeout: Duration::from_secs(10),
            max_first_record_size: None,
            min_record_rate: 64 << 10,
            max_fragment_size: MAX_FRAGMENT_SIZE,
            profile: false,
            shm_ring_capacity: 1 << 20,
            shm_data_bytes: 256 << 20,
            auth_open_procedures: None,
            record_budget: crate::record::RecordBudget::new(DEFAULT_RECORD_BUDGET),
            first_call_gate: None,
        }
    }
}

/// The check of a connection's first call before it is handed off
/// ([`ServerConfig::first_call_gate`]).
pub trait FirstCallGate: Send + Sync + std::fmt::Debug {
    /// Whether the first call, procedure `procedure` of `program` with XDR arguments `args`,
    /// from `peer`, may go on to the handler, and what the gate learnt of it (kept in the
    /// [`AcceptedConnection`](crate::AcceptedConnection)); `Err`: the AUTH_ERROR status to
    /// answer. `authenticated`: the connection's TLS client certificate has already
    /// authenticated it (the gate only routes it then).
    fn check(
        &self,
        peer: &crate::Peer,
        authenticated: bool,
        program: u32,
        procedure: u32,
        args: &[u8],
    ) -> Result<Admission, crate::AuthStat>;
}

/// What a [`FirstCallGate`] learnt of a connection's first call.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Admission {
    /// The tenant the call authenticates as (a token it presents), if any.
    pub tenant: Option<String>,
    /// Where the connection should go, in the handler's own terms (e.g. the process that
    /// already serves the session the call joins); `None`: wherever a new connection goes.
    pub route: Option<u64>,
}

/// Default of [`ServerConfig::record_budget`]: 1 GiB.
pub const DEFAULT_RECORD_BUDGET: usize = 1 << 30;

/// What the process that accepted a connection knew of it, for a process that serves it
/// ([`Server::serve_fd_as`], from [`AcceptedConnection::origin`]).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Origin {
    /// The peer as accepted (for TLS, the TCP peer, while the descriptor is a socket pair's
    /// plaintext end); `None`: read it from the socket.
    pub peer: Option<crate::Peer>,
    /// The connection came over TLS: it is never offered shared memory.
    pub tls: bool,
    /// The tenant named by the connection's verified TLS client certificate: the connection
    /// is authenticated as this tenant from its first call, as a token would have done.
    pub tenant: Option<String>,
}

/// Why a server could not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum ServerError {
    /// [`Server::listen`] was never called.
    #[error("the server has no endpoint to listen on: call Server::listen before Server::start")]
    NoEndpoints,
    /// Binding or listening on an endpoint failed.
    #[error("cannot listen on {endpoint}: {source}")]
    Bind {
        /// The endpoint, as text.
        endpoint: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// Another process is listening on the Unix socket path.
    #[error("another server is already listening on {0}: stop it or choose another socket path")]
    UnixSocketInUse(PathBuf),
    /// The Unix socket path exists and is not a socket; it is left alone.
    #[error("{0} exists and is not a socket: remove it or choose another socket path")]
    NotASocket(PathBuf),
    /// A `tls://` endpoint was named before [`Server::tls`] gave a certificate and key.
    #[error(
        "cannot listen on {0}: a tls:// endpoint needs the server's certificate and private key \
         (remora serve --tls-cert CERT.pem --tls-key KEY.pem)"
    )]
    TlsNotConfigured(crate::Endpoint),
    /// An I/O error while setting the server up.
    #[error("I/O error while starting the server: {0}")]
    Io(#[from] io::Error),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
