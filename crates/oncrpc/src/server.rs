//! The server runtime: one thread per listener, one thread per connection, no async runtime.

use std::collections::{BTreeMap, HashMap};
use std::fmt;
use std::io::{self, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use remora_xdr::{Bytes, Decoder, Encoder, XdrDecode, XdrEncode};

use crate::auth::{AUTH_NONE, AUTH_SYS, AuthStat, AuthSys, Credential, OpaqueAuth};
use crate::endpoint::{Endpoint, Stream};
use crate::msg::{AcceptStat, MSG_CALL, MSG_REPLY, RPC_VERSION, RejectedReply, RpcMsg};
use crate::record::{MAX_FRAGMENT_SIZE, RecordError, RecordReader, write_record};
use crate::rpcbind;
use crate::shm::Setup;
use crate::{CallContext, Dispatch, Peer, RpcError, Service, xdr};
use remora_shm::{DataArea, ShmStream};

/// Stack size of connection threads: decoding deeply nested data recurses.
const CONN_STACK_SIZE: usize = 8 * 1024 * 1024;

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
    /// Longest time a connection may sit idle between records (`None`: forever, the default).
    pub idle_timeout: Option<Duration>,
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
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            max_record_size: crate::client::DEFAULT_MAX_RECORD_SIZE,
            max_connections: 1024,
            stall_timeout: Duration::from_secs(30),
            idle_timeout: None,
            max_fragment_size: MAX_FRAGMENT_SIZE,
            profile: false,
            shm_ring_capacity: 1 << 20,
            shm_data_bytes: 256 << 20,
        }
    }
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
    /// An I/O error while setting the server up.
    #[error("I/O error while starting the server: {0}")]
    Io(#[from] io::Error),
}

/// The registered services, by program then version.
#[derive(Clone, Default)]
pub(crate) struct Registry {
    programs: BTreeMap<u32, BTreeMap<u32, Arc<dyn Service>>>,
}

impl Registry {
    pub(crate) fn add(&mut self, svc: Arc<dyn Service>) {
        self.programs
            .entry(svc.program())
            .or_default()
            .insert(svc.version(), svc);
    }

    fn pairs(&self) -> Vec<(u32, u32)> {
        self.programs
            .iter()
            .flat_map(|(p, vs)| vs.keys().map(move |v| (*p, *v)))
            .collect()
    }
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.pairs()).finish()
    }
}

/// Builder of an ONC RPC server: register services, bind endpoints, then [`Server::start`].
///
/// ```no_run
/// # use std::sync::Arc;
/// # use remora_oncrpc::{Server, ServerConfig, Endpoint, Service};
/// # fn svc() -> Arc<dyn Service> { unimplemented!() }
/// # fn main() -> Result<(), remora_oncrpc::RpcError> {
/// let handle = Server::builder(ServerConfig::default())
///     .service(svc())
///     .listen(&"tcp://127.0.0.1:0".parse().unwrap())?
///     .listen(&"unix:///tmp/remora.sock".parse().unwrap())?
///     .start()?;
/// println!("listening on {:?}", handle.local_endpoints());
/// handle.shutdown();
/// # Ok(()) }
/// ```
#[derive(Default)]
pub struct Server {
    config: ServerConfig,
    registry: Registry,
    /// When set, accepted connections are handed to it instead of being served here.
    handler: Option<Arc<dyn ConnectionHandler>>,
    bound: Vec<(Listener, Endpoint)>,
    /// Unix socket files bound by this builder, removed if it is dropped unstarted.
    unix_paths: Vec<PathBuf>,
}

impl fmt::Debug for Server {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Server")
            .field("config", &self.config)
            .field("registry", &self.registry)
            .field("hand_off", &self.handler.is_some())
            .field("bound", &self.bound)
            .finish_non_exhaustive()
    }
}

/// A connection accepted by a server that hands its connections off
/// ([`Server::hand_off`]): the socket, who is on the other end, and whether the server is
/// shutting down.
pub struct AcceptedConnection {
    stream: Stream,
    peer: Peer,
    id: u64,
    shared: Arc<Shared>,
}

impl fmt::Debug for AcceptedConnection {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("AcceptedConnection")
            .field("peer", &self.peer)
            .field("id", &self.id)
            .finish_non_exhaustive()
    }
}

impl AcceptedConnection {
    /// Who is on the other end.
    pub fn peer(&self) -> &Peer {
        &self.peer
    }

    /// The connection's id, unique for the server's lifetime.
    pub fn id(&self) -> u64 {
        self.id
    }

    /// Whether the server has begun shutting down. The server also shuts down the reading
    /// side of the socket then, so whoever serves it sees end of file.
    pub fn shutting_down(&self) -> bool {
        self.shared.shutting_down.load(Ordering::SeqCst)
    }

    /// A descriptor of the connected socket (blocking mode), e.g. to give to a child process
    /// as its standard input. The server keeps its own descriptor of the socket until
    /// [`ConnectionHandler::handle`] returns.
    pub fn try_clone_fd(&self) -> io::Result<OwnedFd> {
        match &self.stream {
            Stream::Tcp(s) => s.as_fd().try_clone_to_owned(),
            Stream::Unix(s) => s.as_fd().try_clone_to_owned(),
            Stream::Shm(s) => s.socket().as_fd().try_clone_to_owned(),
        }
    }
}

/// Serves connections that a server hands off instead of serving them itself
/// ([`Server::hand_off`]), e.g. by giving each to a process of its own.
pub trait ConnectionHandler: Send + Sync {
    /// Serves `connection`; called on a thread of its own, which the server joins at
    /// shutdown. The connection counts against [`ServerConfig::max_connections`] until this
    /// returns; the server closes its socket then.
    fn handle(&self, connection: AcceptedConnection);
}

impl Server {
    /// A server with the default [`ServerConfig`] and no services.
    pub fn new() -> Self {
        Self::default()
    }

    /// A server with `config` and no services.
    pub fn builder(config: ServerConfig) -> Self {
        let mut server = Self::default();
        server.config = config;
        server
    }

    /// Registers a service (one program version). Several versions of one program may be
    /// registered; registering the same program and version again replaces the service.
    pub fn service(mut self, service: Arc<dyn Service>) -> Self {
        self.registry.add(service);
        self
    }

    /// Hands every accepted connection to `handler` instead of serving it with the registered
    /// services. Everything else stays: [`ServerConfig::max_connections`] bounds the
    /// connections being handled, and shutdown stops accepting, shuts down the reading side
    /// of each socket and waits for every [`ConnectionHandler::handle`] to return.
    pub fn hand_off(mut self, handler: Arc<dyn ConnectionHandler>) -> Self {
        self.handler = Some(handler);
        self
    }

    /// Serves one already-connected stream socket (Unix or TCP, e.g. one inherited from a
    /// parent process) with the registered services on the calling thread, until the peer
    /// closes it, an error or timeout ends it. Deferred replies work as on accepted
    /// connections; the services hear [`Service::connection_closed`] for connection id 0 when
    /// it ends. The peer is read from the socket (SO_PEERCRED, or the TCP peer address).
    pub fn serve_fd(self, fd: OwnedFd) -> Result<(), RpcError> {
        let domain = socket2::SockRef::from(&fd)
            .local_addr()
            .map_err(ServerError::Io)?
            .domain();
        let (stream, peer) = if domain == socket2::Domain::UNIX {
            let s = UnixStream::from(fd);
            s.set_nonblocking(false).map_err(ServerError::Io)?;
            let peer = unix_peer(&s);
            (Stream::Unix(s), peer)
        } else if domain == socket2::Domain::IPV4 || domain == socket2::Domain::IPV6 {
            let s = TcpStream::from(fd);
            s.set_nonblocking(false).map_err(ServerError::Io)?;
            let _ = s.set_nodelay(true);
            let peer = s.peer_addr().map_or(Peer::Unknown, Peer::Tcp);
            (Stream::Tcp(s), peer)
        } else {
            return Err(ServerError::Io(io::Error::new(
                io::ErrorKind::InvalidInput,
                "serve_fd needs a connected Unix or TCP stream socket",
            ))
            .into());
        };
        tracing::debug!(%peer, "ONC RPC server: serving an inherited connection");
        serve_connection(
            stream,
            &peer,
            0,
            &self.registry,
            &self.config,
            &AtomicBool::new(false),
        );
        Ok(())
    }

    /// Binds `endpoint` now (`tcp://HOST:0` picks a free port; a stale Unix socket file with
    /// nothing listening is replaced). Serving starts with [`Server::start`].
    pub fn listen(mut self, endpoint: &Endpoint) -> Result<Self, RpcError> {
        let (listener, actual) = bind(endpoint)?;
        if let Endpoint::Unix(p) = &actual {
            self.unix_paths.push(p.clone());
        }
        self.bound.push((listener, actual));
        Ok(self)
    }

    /// Starts serving on every bound endpoint.
    pub fn start(mut self) -> Result<ServerHandle, RpcError> {
        if self.bound.is_empty() {
            return Err(ServerError::NoEndpoints.into());
        }
        let (wake_rx, wake_tx) = UnixStream::pair().map_err(ServerError::Io)?;
        let bound = std::mem::take(&mut self.bound);
        let unix_paths = std::mem::take(&mut self.unix_paths);
        let shared = Arc::new(Shared {
            config: std::mem::take(&mut self.config),
            registry: std::mem::take(&mut self.registry),
            handler: self.handler.take(),
            shutting_down: AtomicBool::new(false),
            conns: Mutex::new(ConnTable::default()),
        });
        let local: Vec<Endpoint> = bound.iter().map(|(_, e)| e.clone()).collect();
        let mut handle = ServerHandle {
            shared: Arc::clone(&shared),
            accept_threads: Vec::new(),
            local,
            unix_paths,
            wake_tx,
            _wake_rx: wake_rx.try_clone().map_err(ServerError::Io)?,
            rpcbind_registered: Mutex::new(Vec::new()),
            stopped: false,
        };
        for (listener, ep) in bound {
            let shared = Arc::clone(&shared);
            let wake = wake_rx.try_clone().map_err(ServerError::Io)?;
            let h = std::thread::Builder::new()
                .name(format!("oncrpc-accept {ep}"))
                .spawn(move || accept_loop(listener, wake, shared))
                .map_err(ServerError::Io)?;
            // On error, dropping `handle` stops the threads started so far.
            handle.accept_threads.push(h);
        }
        tracing::info!(endpoints = ?handle.local, services = ?shared.registry, "ONC RPC server started");
        Ok(handle)
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.bound.clear();
        for p in &self.unix_paths {
            let _ = std::fs::remove_file(p);
        }
    }
}

#[derive(Debug)]
enum Listener {
    Tcp(TcpListener),
    Unix(UnixListener),
}

impl AsFd for Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Listener::Tcp(l) => l.as_fd(),
            Listener::Unix(l) => l.as_fd(),
        }
    }
}

fn bind(ep: &Endpoint) -> Result<(Listener, Endpoint), RpcError> {
    bind_inner(ep).map_err(RpcError::from)
}

fn bind_inner(ep: &Endpoint) -> Result<(Listener, Endpoint), ServerError> {
    let bind_err = |source| ServerError::Bind {
        endpoint: ep.to_string(),
        source,
    };
    match ep {
        Endpoint::Tcp(addr) => {
            let addr: SocketAddr = addr
                .to_socket_addrs()
                .map_err(bind_err)?
                .next()
                .ok_or_else(|| {
                    bind_err(io::Error::new(
                        io::ErrorKind::NotFound,
                        "host name resolved to no address",
                    ))
                })?;
            let sock = socket2::Socket::new(
                socket2::Domain::for_address(addr),
                socket2::Type::STREAM,
                Some(socket2::Protocol::TCP),
            )
            .map_err(bind_err)?;
            sock.set_reuse_address(true).map_err(bind_err)?;
            sock.set_tcp_nodelay(true).map_err(bind_err)?;
            sock.bind(&addr.into()).map_err(bind_err)?;
            sock.listen(1024).map_err(bind_err)?;
            let l: TcpListener = sock.into();
            l.set_nonblocking(true).map_err(bind_err)?;
            let actual = l.local_addr().map_err(bind_err)?;
            Ok((Listener::Tcp(l), Endpoint::from(actual)))
        }
        Endpoint::Unix(path) => {
            if let Ok(meta) = std::fs::symlink_metadata(path) {
                if !meta.file_type().is_socket() {
                    return Err(ServerError::NotASocket(path.clone()));
                }
                match UnixStream::connect(path) {
                    Ok(_) => return Err(ServerError::UnixSocketInUse(path.clone())),
                    Err(e) if e.kind() == io::ErrorKind::ConnectionRefused => {
                        tracing::info!(path = %path.display(), "removing stale Unix socket file");
                        std::fs::remove_file(path).map_err(bind_err)?;
                    }
                    Err(e) => return Err(bind_err(e)),
                }
            }
            let l = UnixListener::bind(path).map_err(bind_err)?;
            l.set_nonblocking(true).map_err(bind_err)?;
            Ok((Listener::Unix(l), ep.clone()))
        }
    }
}

struct Shared {
    config: ServerConfig,
    registry: Registry,
    handler: Option<Arc<dyn ConnectionHandler>>,
    shutting_down: AtomicBool,
    conns: Mutex<ConnTable>,
}

#[derive(Default)]
struct ConnTable {
    next_id: u64,
    /// Handles used to wake connection threads at shutdown.
    streams: HashMap<u64, Stream>,
    threads: HashMap<u64, JoinHandle<()>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn accept_loop(listener: Listener, wake: UnixStream, shared: Arc<Shared>) {
    use rustix::event::{PollFd, PollFlags, poll};
    loop {
        if shared.shutting_down.load(Ordering::SeqCst) {
            return;
        }
        let mut fds = [
            PollFd::new(&listener, PollFlags::IN),
            PollFd::new(&wake, PollFlags::IN),
        ];
        match poll(&mut fds, None) {
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => {
                tracing::error!(error = %e, "ONC RPC server: poll failed; accept loop stops");
                return;
            }
        }
        if shared.shutting_down.load(Ordering::SeqCst) {
            return;
        }
        let accepted = match &listener {
            Listener::Tcp(l) => l.accept().and_then(|(s, addr)| {
                s.set_nonblocking(false)?;
                s.set_nodelay(true)?;
                Ok((Stream::Tcp(s), Peer::Tcp(addr)))
            }),
            Listener::Unix(l) => l.accept().and_then(|(s, _)| {
                s.set_nonblocking(false)?;
                let peer = unix_peer(&s);
                Ok((Stream::Unix(s), peer))
            }),
        };
        match accepted {
            Ok((stream, peer)) => spawn_connection(&shared, stream, peer),
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => {}
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => {
                // Out of file descriptors and the like: back off instead of spinning.
                tracing::warn!(error = %e, "ONC RPC server: accept failed");
                std::thread::sleep(Duration::from_millis(10));
            }
        }
    }
}

/// The kernel-recorded credentials of a Unix socket's peer.
fn unix_peer(s: &UnixStream) -> Peer {
    match rustix::net::sockopt::socket_peercred(s) {
        Ok(c) => Peer::Unix {
            pid: c.pid.as_raw_pid(),
            uid: c.uid.as_raw(),
            gid: c.gid.as_raw(),
        },
        Err(_) => Peer::Unknown,
    }
}

fn spawn_connection(shared: &Arc<Shared>, stream: Stream, peer: Peer) {
    let mut table = lock(&shared.conns);
    // Reap threads that have finished.
    let done: Vec<u64> = table
        .threads
        .iter()
        .filter(|(_, h)| h.is_finished())
        .map(|(id, _)| *id)
        .collect();
    for id in done {
        if let Some(h) = table.threads.remove(&id) {
            let _ = h.join();
        }
    }
    if table.streams.len() >= shared.config.max_connections {
        tracing::warn!(%peer, max = shared.config.max_connections, "ONC RPC server: too many connections; new connection closed");
        let _ = stream.shutdown(Shutdown::Both);
        return;
    }
    let control = match stream.try_clone() {
        Ok(c) => c,
        Err(e) => {
            tracing::warn!(%peer, error = %e, "ONC RPC server: cannot clone the connection's socket; closed");
            return;
        }
    };
    let id = table.next_id;
    table.next_id += 1;
    let shared2 = Arc::clone(shared);
    let res = std::thread::Builder::new()
        .name(format!("oncrpc-conn-{id}"))
        .stack_size(CONN_STACK_SIZE)
        .spawn(move || {
            tracing::debug!(%peer, "ONC RPC server: connection accepted");
            if let Some(handler) = shared2.handler.clone() {
                let conn = AcceptedConnection {
                    stream,
                    peer: peer.clone(),
                    id,
                    shared: Arc::clone(&shared2),
                };
                if catch_unwind(AssertUnwindSafe(|| handler.handle(conn))).is_err() {
                    tracing::error!(%peer, "ONC RPC server: the connection handler panicked");
                }
            } else {
                serve_connection(
                    stream,
                    &peer,
                    id,
                    &shared2.registry,
                    &shared2.config,
                    &shared2.shutting_down,
                );
            }
            let mut table = lock(&shared2.conns);
            if let Some(s) = table.streams.remove(&id) {
                let _ = s.shutdown(Shutdown::Both);
            }
            tracing::debug!(%peer, "ONC RPC server: connection closed");
        });
    match res {
        Ok(h) => {
            table.streams.insert(id, control);
            table.threads.insert(id, h);
        }
        Err(e) => {
            tracing::error!(error = %e, "ONC RPC server: cannot spawn a connection thread; connection closed");
            let _ = control.shutdown(Shutdown::Both);
        }
    }
}

/// A running server. Dropping it shuts the server down as [`ServerHandle::shutdown`] does.
pub struct ServerHandle {
    shared: Arc<Shared>,
    accept_threads: Vec<JoinHandle<()>>,
    local: Vec<Endpoint>,
    unix_paths: Vec<PathBuf>,
    wake_tx: UnixStream,
    _wake_rx: UnixStream,
    rpcbind_registered: Mutex<Vec<(u32, u32)>>,
    stopped: bool,
}

impl fmt::Debug for ServerHandle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerHandle")
            .field("endpoints", &self.local)
            .field("services", &self.shared.registry)
            .finish_non_exhaustive()
    }
}

impl ServerHandle {
    /// The endpoints actually listened on, in the order given to [`Server::listen`]: TCP
    /// endpoints carry the bound address and port (the real port when port 0 was asked).
    pub fn local_endpoints(&self) -> Vec<Endpoint> {
        self.local.clone()
    }

    /// Number of connections being served now.
    pub fn connection_count(&self) -> usize {
        lock(&self.shared.conns).streams.len()
    }

    /// Registers every served program version with the local rpcbind (PMAP v2 SET over TCP
    /// to 127.0.0.1:111), mapping it to the port of the first TCP endpoint. The mappings are
    /// removed at shutdown. When rpcbind is not reachable this logs a warning and returns the
    /// error; the server keeps serving either way.
    pub fn register_rpcbind(&self) -> Result<(), RpcError> {
        let Some(port) = self.local.iter().find_map(|e| match e {
            Endpoint::Tcp(a) => a.parse::<SocketAddr>().ok().map(|a| a.port()),
            Endpoint::Unix(_) => None,
        }) else {
            tracing::warn!("rpcbind registration skipped: the server has no TCP endpoint");
            return Ok(());
        };
        let pm = match rpcbind::PortMapper::connect_local() {
            Ok(pm) => pm,
            Err(e) => {
                tracing::warn!(error = %e, "rpcbind is not reachable on 127.0.0.1:111; the server keeps serving but is not registered (start rpcbind to register)");
                return Err(e);
            }
        };
        for (prog, vers) in self.shared.registry.pairs() {
            let m = rpcbind::Mapping {
                prog,
                vers,
                prot: rpcbind::IPPROTO_TCP,
                port: u32::from(port),
            };
            let mut ok = pm.set(&m)?;
            if !ok {
                // A stale mapping from an earlier run: replace it.
                pm.unset(prog, vers)?;
                ok = pm.set(&m)?;
            }
            if ok {
                lock(&self.rpcbind_registered).push((prog, vers));
            } else {
                tracing::warn!(prog, vers, port, "rpcbind refused the registration");
            }
        }
        tracing::info!(port, registered = ?lock(&self.rpcbind_registered), "registered with rpcbind");
        Ok(())
    }

    /// Shuts the server down gracefully: stops accepting, lets calls being served finish and
    /// send their replies, closes every connection, joins every thread, removes the Unix
    /// socket files and the rpcbind registrations.
    pub fn shutdown(mut self) {
        self.stop();
    }

    fn stop(&mut self) {
        if self.stopped {
            return;
        }
        self.stopped = true;
        self.shared.shutting_down.store(true, Ordering::SeqCst);
        let _ = (&self.wake_tx).write_all(&[1]);
        for h in self.accept_threads.drain(..) {
            let _ = h.join();
        }
        let threads: Vec<JoinHandle<()>> = {
            let mut table = lock(&self.shared.conns);
            for s in table.streams.values() {
                // Wakes a thread blocked reading; a reply being written still goes out.
                let _ = s.shutdown(Shutdown::Read);
            }
            table.threads.drain().map(|(_, h)| h).collect()
        };
        for h in threads {
            let _ = h.join();
        }
        for p in &self.unix_paths {
            let _ = std::fs::remove_file(p);
        }
        let registered = std::mem::take(&mut *lock(&self.rpcbind_registered));
        if !registered.is_empty()
            && let Ok(pm) = rpcbind::PortMapper::connect_local()
        {
            for (prog, vers) in registered {
                let _ = pm.unset(prog, vers);
            }
        }
        tracing::info!(endpoints = ?self.local, "ONC RPC server stopped");
    }
}

impl Drop for ServerHandle {
    fn drop(&mut self) {
        self.stop();
    }
}

/// A byte stream a connection can be served over: sockets, or in-memory streams in tests.
pub(crate) trait Transport: Read + Write {
    /// Sets the read timeout; in-memory streams ignore it.
    fn set_read_timeout(&mut self, _timeout: Option<Duration>) -> io::Result<()> {
        Ok(())
    }

    /// Sets the write timeout, which also holds for the shared writer (sockets share it
    /// through their file description, shared-memory streams through their connection state);
    /// in-memory streams ignore it.
    fn set_write_timeout(&mut self, _timeout: Option<Duration>) -> io::Result<()> {
        Ok(())
    }

    /// A second handle that writes to the same peer, shared by the connection thread and
    /// deferred replies; `None` (in-memory streams) disables deferred replies.
    fn shared_writer(&self) -> Option<Box<dyn Write + Send>> {
        None
    }

    /// The Unix socket this transport is, if it is one: only those may move into shared
    /// memory.
    fn unix_socket(&self) -> Option<&UnixStream> {
        None
    }
}

impl<T: Transport + ?Sized> Transport for &mut T {
    fn set_read_timeout(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        (**self).set_read_timeout(timeout)
    }

    fn set_write_timeout(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        (**self).set_write_timeout(timeout)
    }

    fn shared_writer(&self) -> Option<Box<dyn Write + Send>> {
        (**self).shared_writer()
    }

    fn unix_socket(&self) -> Option<&UnixStream> {
        (**self).unix_socket()
    }
}

impl Transport for Stream {
    fn set_read_timeout(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        Stream::set_read_timeout(self, timeout)
    }

    fn set_write_timeout(&mut self, timeout: Option<Duration>) -> io::Result<()> {
        Stream::set_write_timeout(self, timeout)
    }

    fn shared_writer(&self) -> Option<Box<dyn Write + Send>> {
        self.try_clone()
            .ok()
            .map(|s| Box::new(s) as Box<dyn Write + Send>)
    }

    fn unix_socket(&self) -> Option<&UnixStream> {
        Stream::unix_socket(self)
    }
}

/// The writing half of a connection, shared by its thread and its deferred replies. Every
/// reply is written whole under the lock, so replies never interleave. `None` once the
/// connection has ended: later replies are dropped.
#[derive(Clone)]
pub(crate) struct ReplySink {
    writer: Arc<Mutex<Option<Box<dyn Write + Send>>>>,
    max_fragment_size: usize,
}

impl fmt::Debug for ReplySink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplySink").finish_non_exhaustive()
    }
}

impl ReplySink {
    fn send(&self, chunks: &[Bytes]) -> io::Result<()> {
        let mut guard = lock(&self.writer);
        match guard.as_mut() {
            Some(w) => write_record(w, chunks, self.max_fragment_size),
            None => Err(io::Error::new(
                io::ErrorKind::NotConnected,
                "the connection has ended",
            )),
        }
    }

    fn close(&self) {
        lock(&self.writer).take();
    }
}

/// The reply to a call whose handler deferred it ([`CallContext::defer`]). Send it with
/// [`DeferredReply::reply`] from any thread; dropped unsent, it answers SYSTEM_ERR.
#[derive(Debug)]
pub struct DeferredReply {
    xid: u32,
    sink: Option<ReplySink>,
}

impl DeferredReply {
    pub(crate) fn new(xid: u32, sink: ReplySink) -> Self {
        Self {
            xid,
            sink: Some(sink),
        }
    }

    /// The XID of the call this answers.
    pub fn xid(&self) -> u32 {
        self.xid
    }

    /// Sends the SUCCESS reply with the results `encode` writes. If `encode` fails the call is
    /// answered SYSTEM_ERR instead and its error returned. Fails when the connection has
    /// ended or the write fails (the reply is then lost, as the peer is gone).
    pub fn reply(
        mut self,
        encode: impl FnOnce(&mut Encoder) -> xdr::Result<()>,
    ) -> Result<(), RpcError> {
        let Some(sink) = self.sink.take() else {
            return Ok(());
        };
        let mut enc = Encoder::with_capacity(256);
        let encoded = RpcMsg::accepted(self.xid, AcceptStat::Success)
            .encode(&mut enc)
            .and_then(|()| encode(&mut enc));
        if let Err(e) = encoded {
            let _ = Self::send_stat(&sink, self.xid, AcceptStat::SystemErr);
            return Err(RpcError::Encode(e));
        }
        sink.send(&enc.finish()).map_err(RpcError::from)
    }

    fn send_stat(sink: &ReplySink, xid: u32, stat: AcceptStat) -> io::Result<()> {
        let mut enc = Encoder::with_capacity(32);
        RpcMsg::accepted(xid, stat)
            .encode(&mut enc)
            .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
        sink.send(&enc.finish())
    }
}

impl Drop for DeferredReply {
    fn drop(&mut self) {
        if let Some(sink) = self.sink.take() {
            tracing::warn!(
                xid = self.xid,
                "ONC RPC server: a deferred reply was dropped unsent; SYSTEM_ERR"
            );
            let _ = Self::send_stat(&sink, self.xid, AcceptStat::SystemErr);
        }
    }
}

/// Serves one connection until the peer closes it, an error occurs, a timeout expires or
/// the server shuts down. Calls are processed in order. When it ends, every service hears of
/// it ([`Service::connection_closed`]).
pub(crate) fn serve_connection<S: Transport>(
    stream: S,
    peer: &Peer,
    connection: u64,
    registry: &Registry,
    config: &ServerConfig,
    shutting_down: &AtomicBool,
) {
    let sink = stream.shared_writer().map(|w| ReplySink {
        writer: Arc::new(Mutex::new(Some(w))),
        max_fragment_size: config.max_fragment_size,
    });
    let moved = serve_records(
        stream,
        peer,
        connection,
        sink.as_ref(),
        registry,
        config,
        shutting_down,
        None,
    );
    if let Some(shm) = moved {
        tracing::debug!(%peer, connection, "ONC RPC server: connection moved into shared memory");
        // Same connection, same services and sink (already writing to the rings).
        let area = Some(shm.region().data_area()).filter(|a| !a.is_empty());
        serve_records(
            Stream::Shm(shm),
            peer,
            connection,
            sink.as_ref(),
            registry,
            config,
            shutting_down,
            area,
        );
    }
    for versions in registry.programs.values() {
        for service in versions.values() {
            if catch_unwind(AssertUnwindSafe(|| service.connection_closed(connection))).is_err() {
                tracing::error!(%peer, connection, "ONC RPC server: connection_closed panicked");
            }
        }
    }
    if let Some(sink) = sink {
        sink.close();
    }
}

/// Serves records until the connection ends (`None`) or moves into shared memory (the stream
/// to go on with).
#[expect(
    clippy::too_many_arguments,
    reason = "the connection's state, passed down once per connection"
)]
fn serve_records<S: Transport>(
    mut stream: S,
    peer: &Peer,
    connection: u64,
    sink: Option<&ReplySink>,
    registry: &Registry,
    config: &ServerConfig,
    shutting_down: &AtomicBool,
    area: Option<DataArea>,
) -> Option<ShmStream> {
    let tick = match config.idle_timeout {
        Some(idle) => idle.min(config.stall_timeout),
        None => config.stall_timeout,
    };
    let tick = tick.max(Duration::from_millis(1));
    if let Err(e) = stream.set_read_timeout(Some(tick)) {
        tracing::warn!(%peer, error = %e, "ONC RPC server: cannot set the read timeout; connection closed");
        return None;
    }
    // A peer that stops reading its replies (a full socket buffer or response ring) stalls
    // a reply write for at most stall_timeout; the write then fails and the connection ends,
    // freeing the session, instead of holding this thread forever.
    if let Err(e) =
        stream.set_write_timeout(Some(config.stall_timeout.max(Duration::from_millis(1))))
    {
        tracing::warn!(%peer, error = %e, "ONC RPC server: cannot set the write timeout; connection closed");
        return None;
    }
    let mut reader = RecordReader::new(stream, config.max_record_size);
    let mut last_progress = Instant::now();
    let mut seen = 0u64;
    let mut profile = config.profile.then(Profile::new);
    let _report = ProfileReport {
        profile: &mut profile,
        peer,
        connection,
        registry,
    };
    // The report reads `profile` when the loop ends, however it ends.
    let profile = &mut *_report.profile;
    loop {
        if shutting_down.load(Ordering::Relaxed) {
            return None;
        }
        let read_start = profile.as_ref().map(|_| Instant::now());
        let read = reader.read_record();
        if let (Some(p), Some(t)) = (profile.as_mut(), read_start) {
            p.reading += t.elapsed();
        }
        match read {
            Ok(Some(record)) => {
                last_progress = Instant::now();
                seen = reader.bytes_read();
                let key = profile.as_ref().map(|_| Profile::key(&record));
                let outcome = match crate::shm::setup_request(&record) {
                    Some(req) => match crate::shm::serve_setup(
                        &req,
                        reader.get_ref().unix_socket(),
                        peer,
                        !reader.in_record(),
                        config.shm_ring_capacity,
                        config.shm_data_bytes,
                    ) {
                        Setup::Refuse(reply) => Outcome::Reply(reply),
                        Setup::Accept { reply, stream } => {
                            return grant_shm(reader.get_ref(), peer, sink, &reply, stream);
                        }
                    },
                    None => process_call(record, peer, connection, sink, registry, area.as_ref()),
                };
                if let (Some(p), Some(k)) = (profile.as_mut(), key) {
                    p.call(k, last_progress.elapsed());
                }
                match outcome {
                    Outcome::Reply(chunks) => {
                        let send_start = profile.as_ref().map(|_| Instant::now());
                        let sent = match sink {
                            Some(sink) => sink.send(&chunks),
                            None => {
                                write_record(reader.get_mut(), &chunks, config.max_fragment_size)
                            }
                        };
                        if let (Some(p), Some(t)) = (profile.as_mut(), send_start) {
                            p.replying += t.elapsed();
                        }
                        if let Err(e) = sent {
                            tracing::debug!(%peer, error = %e, "ONC RPC server: cannot send a reply; connection closed");
                            return None;
                        }
                    }
                    Outcome::NoReply => {}
                    Outcome::Close => return None,
                }
            }
            Ok(None) => return None,
            Err(e) if e.is_timeout() => {
                let now = Instant::now();
                if reader.bytes_read() != seen {
                    // Bytes arrived during this read, then nothing for a whole tick.
                    seen = reader.bytes_read();
                    last_progress = now.checked_sub(tick).unwrap_or(now);
                }
                let quiet = now.saturating_duration_since(last_progress);
                if reader.in_record() {
                    if quiet >= config.stall_timeout {
                        tracing::warn!(%peer, stalled = ?quiet, buffered = reader.buffered_record_bytes(), "ONC RPC server: partial record stalled past stall_timeout; connection closed");
                        return None;
                    }
                } else if config.idle_timeout.is_some_and(|idle| quiet >= idle) {
                    tracing::debug!(%peer, "ONC RPC server: idle timeout; connection closed");
                    return None;
                }
            }
            Err(RecordError::TooLarge { declared, max }) => {
                tracing::warn!(%peer, declared, max, "ONC RPC server: call record exceeds max_record_size; connection closed");
                return None;
            }
            Err(RecordError::TruncatedRecord { received }) => {
                tracing::debug!(%peer, received, "ONC RPC server: peer closed the connection mid-record");
                return None;
            }
            Err(e) => {
                tracing::debug!(%peer, error = %e, "ONC RPC server: read failed; connection closed");
                return None;
            }
        }
    }
}

/// Sends the reply granting shared memory (with the region's descriptor) and points the
/// connection's reply sink at the rings, under the sink's lock so that no deferred reply goes
/// out between the two. Returns the stream to serve on, or `None` when the socket failed.
fn grant_shm<S: Transport>(
    transport: &S,
    peer: &Peer,
    sink: Option<&ReplySink>,
    reply: &[u8],
    stream: ShmStream,
) -> Option<ShmStream> {
    let socket = transport.unix_socket()?;
    let mut guard = sink.map(|s| lock(&s.writer));
    if let Err(e) = crate::shm::send_grant(socket, reply, &stream) {
        tracing::debug!(%peer, error = %e, "ONC RPC server: cannot send the shared-memory grant; connection closed");
        return None;
    }
    if let Some(w) = guard.as_deref_mut().and_then(Option::as_mut) {
        *w = Box::new(stream.clone());
    }
    Some(stream)
}

/// Timing counters of one connection (see [`ServerConfig::profile`]).
struct Profile {
    started: Instant,
    /// Time spent in `read_record`: waiting for input and reading it.
    reading: Duration,
    /// Time spent sending replies inline.
    replying: Duration,
    /// By (program, version, procedure): calls, total and longest time in `process_call`.
    procs: BTreeMap<(u32, u32, u32), (u64, Duration, Duration)>,
}

impl Profile {
    fn new() -> Self {
        Self {
            started: Instant::now(),
            reading: Duration::ZERO,
            replying: Duration::ZERO,
            procs: BTreeMap::new(),
        }
    }

    /// (program, version, procedure) of a call record, read without decoding it; zeros when
    /// the record is too short.
    fn key(record: &[u8]) -> (u32, u32, u32) {
        let word = |i: usize| {
            record
                .get(i..i + 4)
                .map_or(0, |b| u32::from_be_bytes([b[0], b[1], b[2], b[3]]))
        };
        (word(12), word(16), word(20))
    }

    fn call(&mut self, key: (u32, u32, u32), took: Duration) {
        let e = self
            .procs
            .entry(key)
            .or_insert((0, Duration::ZERO, Duration::ZERO));
        e.0 += 1;
        e.1 += took;
        e.2 = e.2.max(took);
    }

    /// The report: one line per procedure, busiest first.
    fn render(&self, registry: &Registry) -> String {
        let wall = self.started.elapsed();
        let busy: Duration = self.procs.values().map(|v| v.1).sum();
        let calls: u64 = self.procs.values().map(|v| v.0).sum();
        let mut out = format!(
            "{calls} calls in {:.3} s: {:.3} s in procedures, {:.3} s reading input (waiting included), {:.3} s sending replies",
            wall.as_secs_f64(),
            busy.as_secs_f64(),
            self.reading.as_secs_f64(),
            self.replying.as_secs_f64()
        );
        let mut rows: Vec<_> = self.procs.iter().collect();
        rows.sort_by_key(|r| std::cmp::Reverse(r.1.1));
        for (&(prog, vers, proc_), &(n, total, max)) in rows {
            let name = registry
                .programs
                .get(&prog)
                .and_then(|v| v.get(&vers))
                .and_then(|svc| svc.procedure_name(proc_))
                .map_or_else(|| format!("{prog}/{vers}/{proc_}"), str::to_owned);
            let mean_us = total.as_secs_f64() * 1e6 / n as f64;
            out.push_str(&format!(
                "\n  {name:<32} {n:>9} calls  mean {mean_us:>9.2} us  max {:>10.1} us  total {:>9.3} s",
                max.as_secs_f64() * 1e6,
                total.as_secs_f64()
            ));
        }
        out
    }
}

/// Logs a connection's profile when dropped (the connection loop has many exits).
struct ProfileReport<'a> {
    profile: &'a mut Option<Profile>,
    peer: &'a Peer,
    connection: u64,
    registry: &'a Registry,
}

impl Drop for ProfileReport<'_> {
    fn drop(&mut self) {
        if let Some(p) = self.profile.as_ref() {
            tracing::info!(
                peer = %self.peer,
                connection = self.connection,
                "ONC RPC server profile: {}",
                p.render(self.registry)
            );
        }
    }
}

/// What to do after a record.
pub(crate) enum Outcome {
    Reply(Vec<Bytes>),
    NoReply,
    Close,
}

fn reply_header(msg: &RpcMsg) -> Outcome {
    let mut enc = Encoder::with_capacity(32);
    match msg.encode(&mut enc) {
        Ok(()) => Outcome::Reply(enc.finish()),
        Err(_) => Outcome::Close,
    }
}

fn accepted(xid: u32, stat: AcceptStat) -> Outcome {
    reply_header(&RpcMsg::accepted(xid, stat))
}

fn auth_error(xid: u32, stat: AuthStat) -> Outcome {
    reply_header(&RpcMsg::denied(xid, RejectedReply::AuthError(stat)))
}

fn read_auth(dec: &mut Decoder) -> Result<OpaqueAuth, AuthOrGarbage> {
    OpaqueAuth::decode(dec).map_err(|e| match e {
        xdr::Error::LengthExceedsBound { .. } => AuthOrGarbage::Auth,
        _ => AuthOrGarbage::Garbage,
    })
}

enum AuthOrGarbage {
    Auth,
    Garbage,
}

/// Turns one call record into the reply to send (or none).
pub(crate) fn process_call(
    record: Bytes,
    peer: &Peer,
    connection: u64,
    sink: Option<&ReplySink>,
    registry: &Registry,
    area: Option<&DataArea>,
) -> Outcome {
    let mut dec = Decoder::new(record);
    let Ok(xid) = dec.get_u32() else {
        tracing::warn!(%peer, "ONC RPC server: record too short to hold an XID; connection closed");
        return Outcome::Close;
    };
    let garbage = |what: &str| {
        tracing::debug!(%peer, xid, what, "ONC RPC server: undecodable call header; GARBAGE_ARGS");
        accepted(xid, AcceptStat::GarbageArgs)
    };
    match dec.get_u32() {
        Ok(MSG_CALL) => {}
        Ok(MSG_REPLY) => {
            tracing::warn!(%peer, xid, "ONC RPC server: protocol error: a REPLY message was sent to the server; connection closed");
            return Outcome::Close;
        }
        Ok(_) => return garbage("unknown msg_type"),
        Err(_) => return garbage("msg_type"),
    }
    let Ok(rpcvers) = dec.get_u32() else {
        return garbage("rpcvers");
    };
    if rpcvers != RPC_VERSION {
        tracing::debug!(%peer, xid, rpcvers, "ONC RPC server: wrong RPC version; RPC_MISMATCH");
        return reply_header(&RpcMsg::denied(
            xid,
            RejectedReply::RpcMismatch {
                low: RPC_VERSION,
                high: RPC_VERSION,
            },
        ));
    }
    let (Ok(program), Ok(version), Ok(procedure)) = (dec.get_u32(), dec.get_u32(), dec.get_u32())
    else {
        return garbage("prog/vers/proc");
    };
    let cred = match read_auth(&mut dec) {
        Ok(c) => c,
        Err(AuthOrGarbage::Auth) => return auth_error(xid, AuthStat::BadCred),
        Err(AuthOrGarbage::Garbage) => return garbage("credential"),
    };
    match read_auth(&mut dec) {
        Ok(_) => {}
        Err(AuthOrGarbage::Auth) => return auth_error(xid, AuthStat::BadVerf),
        Err(AuthOrGarbage::Garbage) => return garbage("verifier"),
    }
    let credential = match cred.flavor {
        AUTH_NONE => Credential::None,
        AUTH_SYS => match AuthSys::from_body(cred.body) {
            Ok(sys) => Credential::Sys(sys),
            Err(e) => {
                tracing::debug!(%peer, xid, error = %e, "ONC RPC server: malformed AUTH_SYS credential; AUTH_BADCRED");
                return auth_error(xid, AuthStat::BadCred);
            }
        },
        flavor => {
            tracing::debug!(%peer, xid, flavor, "ONC RPC server: unsupported credential flavour; AUTH_REJECTEDCRED");
            return auth_error(xid, AuthStat::RejectedCred);
        }
    };
    let Some(versions) = registry.programs.get(&program) else {
        tracing::debug!(%peer, xid, program, "ONC RPC server: unknown program; PROG_UNAVAIL");
        return accepted(xid, AcceptStat::ProgUnavail);
    };
    let Some(service) = versions.get(&version) else {
        let low = versions.keys().next().copied().unwrap_or(0);
        let high = versions.keys().next_back().copied().unwrap_or(0);
        tracing::debug!(%peer, xid, program, version, "ONC RPC server: unknown version; PROG_MISMATCH");
        return accepted(xid, AcceptStat::ProgMismatch { low, high });
    };
    let ctx = CallContext {
        xid,
        program,
        version,
        procedure,
        credential,
        peer: peer.clone(),
        connection,
        reply_sink: sink.cloned(),
        data_area: area.cloned(),
    };
    let mut reply = Encoder::with_capacity(256);
    if RpcMsg::accepted(xid, AcceptStat::Success)
        .encode(&mut reply)
        .is_err()
    {
        return Outcome::Close;
    }
    let dispatched = catch_unwind(AssertUnwindSafe(|| {
        service.dispatch(&ctx, &mut dec, &mut reply)
    }));
    match dispatched {
        Ok(Dispatch::Success) => Outcome::Reply(reply.finish()),
        Ok(Dispatch::NoReply) | Ok(Dispatch::Deferred) => Outcome::NoReply,
        Ok(Dispatch::ProcUnavail) => accepted(xid, AcceptStat::ProcUnavail),
        Ok(Dispatch::GarbageArgs) => accepted(xid, AcceptStat::GarbageArgs),
        Ok(Dispatch::SystemErr) => accepted(xid, AcceptStat::SystemErr),
        Err(_) => {
            tracing::error!(%peer, xid, program, version, procedure, "ONC RPC server: the procedure panicked; SYSTEM_ERR");
            accepted(xid, AcceptStat::SystemErr)
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct Named;
    impl Service for Named {
        fn program(&self) -> u32 {
            7
        }
        fn version(&self) -> u32 {
            1
        }
        fn dispatch(&self, _: &CallContext, _: &mut Decoder, _: &mut Encoder) -> Dispatch {
            Dispatch::Success
        }
        fn procedure_name(&self, procedure: u32) -> Option<&'static str> {
            (procedure == 3).then_some("PING")
        }
    }

    #[test]
    fn profile_names_procedures_and_orders_by_total_time() {
        let mut registry = Registry::default();
        registry.add(Arc::new(Named));
        let mut record = vec![0u8; 40];
        record[12..16].copy_from_slice(&7u32.to_be_bytes());
        record[16..20].copy_from_slice(&1u32.to_be_bytes());
        record[20..24].copy_from_slice(&3u32.to_be_bytes());
        let mut p = Profile::new();
        assert_eq!(Profile::key(&record), (7, 1, 3));
        assert_eq!(Profile::key(&record[..10]), (0, 0, 0));
        p.call((7, 1, 3), Duration::from_micros(10));
        p.call((7, 1, 3), Duration::from_micros(30));
        p.call((7, 1, 9), Duration::from_millis(1));
        let text = p.render(&registry);
        assert!(text.starts_with("3 calls in "), "{text}");
        let lines: Vec<&str> = text.lines().collect();
        assert_eq!(lines.len(), 3, "{text}");
        assert!(lines[1].trim_start().starts_with("7/1/9"), "{text}");
        assert!(lines[2].trim_start().starts_with("PING"), "{text}");
        assert!(lines[2].contains("mean     20.00 us"), "{text}");
        assert!(lines[2].contains("max       30.0 us"), "{text}");
    }
}
