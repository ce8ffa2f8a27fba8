//! Accepting connections: the [`Server`] builder, listeners, the accept loop (one thread per
//! listener), connection limits and the running [`ServerHandle`].

use std::collections::HashMap;
use std::fmt;
use std::io::{self, Write};
use std::net::{Shutdown, SocketAddr, TcpListener, TcpStream, ToSocketAddrs};
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::{UnixListener, UnixStream};
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use super::connection::serve_connection;
use super::dispatch::{Registry, Service};
use super::{Origin, ServerConfig, ServerError, lock};
use crate::endpoint::{Endpoint, Stream};
use crate::rpcbind;
use crate::tls::{self, ServerTls};
use crate::{Peer, RpcError};

/// Stack size of connection threads: decoding deeply nested data recurses.
const CONN_STACK_SIZE: usize = 8 * 1024 * 1024;

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
    /// The certificate and key of `tls://` listeners ([`Server::tls`]).
    tls: Option<Arc<ServerTls>>,
}

impl fmt::Debug for Server {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Server")
            .field("config", &self.config)
            .field("registry", &self.registry)
            .field("hand_off", &self.handler.is_some())
            .field("bound", &self.bound)
            .field("tls", &self.tls)
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
    /// Whether it came over TLS, and the tenant of its client certificate.
    tls: Option<Option<String>>,
    /// What the gate learnt of its first call ([`ServerConfig::first_call_gate`]).
    admission: crate::server::Admission,
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

    /// Whether the connection came over TLS. Its socket ([`AcceptedConnection::try_clone_fd`])
    /// is then the plaintext end of a Unix socket pair whose other end this process's TLS
    /// pump serves until the connection ends; the peer is the TCP peer.
    pub fn is_tls(&self) -> bool {
        self.tls.is_some()
    }

    /// The tenant named by the connection's verified TLS client certificate, when the server
    /// requires them: the connection is authenticated as this tenant.
    pub fn certificate_tenant(&self) -> Option<&str> {
        self.tls.as_ref().and_then(Option::as_deref)
    }

    /// The tenant the connection authenticated as before it was handed off: its client
    /// certificate's, or the one its first call named to [`ServerConfig::first_call_gate`]
    /// (a token). Whoever serves the connection authenticates it again.
    pub fn authenticated_tenant(&self) -> Option<&str> {
        self.certificate_tenant()
            .or(self.admission.tenant.as_deref())
    }

    /// Where the gate said the connection should go ([`crate::server::Admission::route`]).
    pub fn route(&self) -> Option<u64> {
        self.admission.route
    }

    /// What a process that serves this connection elsewhere needs to know of it
    /// ([`Server::serve_fd_as`]): its peer, whether it is TLS, its certificate's tenant.
    pub fn origin(&self) -> Origin {
        Origin {
            peer: Some(self.peer.clone()),
            tls: self.is_tls(),
            tenant: self.certificate_tenant().map(str::to_owned),
        }
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

    /// The certificate and key (and the client CA, if any) of the `tls://` endpoints; call it
    /// before [`Server::listen`] names one.
    pub fn tls(mut self, tls: ServerTls) -> Self {
        self.tls = Some(Arc::new(tls));
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
        self.serve_fd_as(fd, Origin::default())
    }

    /// [`Server::serve_fd`] for a connection that another process accepted and described
    /// ([`AcceptedConnection::origin`]): its peer (when given) replaces the socket's own, a
    /// TLS connection is never offered shared memory, and a certificate's tenant
    /// authenticates the connection from its first call.
    pub fn serve_fd_as(self, fd: OwnedFd, origin: Origin) -> Result<(), RpcError> {
        serve_inherited(
            fd,
            &origin,
            0,
            &self.registry,
            &self.config,
            &AtomicBool::new(false),
        )
    }

    /// [`Server::serve_fd_as`] for `fd`, and for each further connection `more` yields
    /// (connections another process hands over later, such as more connections of the same
    /// session) the same on a thread of its own, with connection ids 1, 2, …. Returns when the
    /// first connection ends; the others are served until they end or the process exits.
    pub fn serve_fds_as(
        mut self,
        fd: OwnedFd,
        origin: Origin,
        more: std::sync::mpsc::Receiver<(OwnedFd, Origin)>,
    ) -> Result<(), RpcError> {
        let shared = Arc::new((
            std::mem::take(&mut self.registry),
            std::mem::take(&mut self.config),
            AtomicBool::new(false),
        ));
        let for_more = Arc::clone(&shared);
        std::thread::Builder::new()
            .name("rpc-more-conns".into())
            .spawn(move || {
                for (id, (fd, origin)) in (1u64..).zip(more.iter()) {
                    let shared = Arc::clone(&for_more);
                    let spawned = std::thread::Builder::new()
                        .name(format!("rpc-conn-{id}"))
                        .spawn(move || {
                            if let Err(e) =
                                serve_inherited(fd, &origin, id, &shared.0, &shared.1, &shared.2)
                            {
                                tracing::warn!(connection = id, error = %e, "ONC RPC server: cannot serve a handed-over connection");
                            }
                        });
                    if let Err(e) = spawned {
                        tracing::error!(error = %e, "ONC RPC server: cannot spawn a connection thread; connection closed");
                    }
                }
            })
            .map_err(ServerError::Io)?;
        let r = serve_inherited(fd, &origin, 0, &shared.0, &shared.1, &shared.2);
        shared.2.store(true, Ordering::SeqCst);
        r
    }

    /// Binds `endpoint` now (`tcp://HOST:0` picks a free port; a stale Unix socket file with
    /// nothing listening is replaced). Serving starts with [`Server::start`].
    pub fn listen(mut self, endpoint: &Endpoint) -> Result<Self, RpcError> {
        let (listener, actual) = bind(endpoint, self.tls.as_ref())?;
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
    /// TCP whose connections start with a TLS handshake.
    Tls(TcpListener, Arc<ServerTls>),
}

impl AsFd for Listener {
    fn as_fd(&self) -> BorrowedFd<'_> {
        match self {
            Listener::Tcp(l) | Listener::Tls(l, _) => l.as_fd(),
            Listener::Unix(l) => l.as_fd(),
        }
    }
}

fn bind(ep: &Endpoint, tls: Option<&Arc<ServerTls>>) -> Result<(Listener, Endpoint), RpcError> {
    bind_inner(ep, tls).map_err(RpcError::from)
}

fn bind_inner(
    ep: &Endpoint,
    tls: Option<&Arc<ServerTls>>,
) -> Result<(Listener, Endpoint), ServerError> {
    let bind_err = |source| ServerError::Bind {
        endpoint: ep.to_string(),
        source,
    };
    match ep {
        Endpoint::Tls(addr) => {
            let tls = tls.ok_or_else(|| ServerError::TlsNotConfigured(ep.clone()))?;
            let (l, _) = bind_inner(&Endpoint::Tcp(addr.clone()), None)?;
            let Listener::Tcp(l) = l else {
                unreachable!("a TCP endpoint binds a TCP listener")
            };
            let actual = l.local_addr().map_err(bind_err)?;
            Ok((
                Listener::Tls(l, Arc::clone(tls)),
                Endpoint::Tls(actual.to_string()),
            ))
        }
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
    /// Connections being served, by peer ([`ServerConfig::max_connections_per_peer`]).
    per_peer: HashMap<PeerKey, usize>,
}

/// Who a connection counts against for [`ServerConfig::max_connections_per_peer`]: the IP
/// address of a TCP peer (any port), the uid of a Unix-socket peer.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
enum PeerKey {
    Ip(std::net::IpAddr),
    Uid(u32),
    Unknown,
}

impl PeerKey {
    fn of(peer: &Peer) -> Self {
        match peer {
            Peer::Tcp(addr) => PeerKey::Ip(addr.ip()),
            Peer::Unix { uid, .. } => PeerKey::Uid(*uid),
            _ => PeerKey::Unknown,
        }
    }
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
            Listener::Tcp(l) | Listener::Tls(l, _) => l.accept().and_then(|(s, addr)| {
                s.set_nonblocking(false)?;
                s.set_nodelay(true)?;
                Ok((Stream::Tcp(s), Peer::Tcp(addr)))
            }),
            Listener::Unix(l) => l.accept().and_then(|(s, _)| {
                s.set_nonblocking(false)?;
                crate::endpoint::widen_unix_buffers(&s);
                let peer = unix_peer(&s);
                Ok((Stream::Unix(s), peer))
            }),
        };
        let tls = match &listener {
            Listener::Tls(_, tls) => Some(Arc::clone(tls)),
            _ => None,
        };
        match accepted {
            Ok((stream, peer)) => spawn_connection(&shared, stream, peer, tls),
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

fn spawn_connection(shared: &Arc<Shared>, stream: Stream, peer: Peer, tls: Option<Arc<ServerTls>>) {
    let accepted_at = Instant::now();
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
        crate::audit!(warn, limit "max_connections", %peer, max = shared.config.max_connections, "ONC RPC server: too many connections; new connection closed");
        let _ = stream.shutdown(Shutdown::Both);
        return;
    }
    let key = PeerKey::of(&peer);
    let from_peer = table.per_peer.get(&key).copied().unwrap_or(0);
    if from_peer >= shared.config.max_connections_per_peer {
        crate::audit!(warn, limit "max_connections_per_peer", %peer, max = shared.config.max_connections_per_peer, "ONC RPC server: too many connections from this peer (its IP address, or its uid on a Unix socket); new connection closed (raise --max-connections-per-peer if this peer needs more)");
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
    let key2 = key.clone();
    let res = std::thread::Builder::new()
        .name(format!("oncrpc-conn-{id}"))
        .stack_size(CONN_STACK_SIZE)
        .spawn(move || {
            tracing::debug!(%peer, "ONC RPC server: connection accepted");
            let mut origin = Origin {
                peer: Some(peer.clone()),
                ..Origin::default()
            };
            let (stream, pump) = match tls {
                None => (stream, None),
                Some(tls) => match start_tls(&shared2, stream, &peer, id, &tls, accepted_at) {
                    Some((plain, tenant, pump)) => {
                        origin.tls = true;
                        origin.tenant = tenant;
                        (Stream::Unix(plain), Some(pump))
                    }
                    None => {
                        let mut table = lock(&shared2.conns);
                        forget(&mut table, id, &key2);
                        return;
                    }
                },
            };
            // Ends the connection: its socket is shut down, then the TLS pump (if any) sends
            // what is left, says close_notify and ends.
            let finish = |pump: Option<JoinHandle<()>>| {
                forget(&mut lock(&shared2.conns), id, &key2);
                if let Some(pump) = pump {
                    let _ = pump.join();
                }
            };
            if let Some(handler) = shared2.handler.clone() {
                // Nothing is started for a connection (a worker process) before it has sent
                // its first call record whole, within the HELLO deadline and size. A
                // connection a client certificate authenticated still passes the gate, which
                // only routes it.
                let gate = shared2.config.first_call_gate.as_deref();
                let admission = match await_first_record(
                    &stream,
                    &shared2.config,
                    &shared2.shutting_down,
                    &shared2.registry,
                    accepted_at,
                    gate.map(|g| (g, &peer, origin.tenant.is_some())),
                ) {
                    Ok(admission) => admission,
                    Err(why) => {
                        tracing::info!(%peer, "ONC RPC server: {why}; connection closed");
                        drop(stream);
                        finish(pump);
                        return;
                    }
                };
                let conn = AcceptedConnection {
                    stream,
                    peer: peer.clone(),
                    id,
                    shared: Arc::clone(&shared2),
                    tls: origin.tls.then(|| origin.tenant.clone()),
                    admission,
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
                    &origin,
                    accepted_at,
                );
            }
            finish(pump);
            tracing::debug!(%peer, "ONC RPC server: connection closed");
        });
    match res {
        Ok(h) => {
            table.streams.insert(id, control);
            table.threads.insert(id, h);
            *table.per_peer.entry(key).or_insert(0) += 1;
        }
        Err(e) => {
            tracing::error!(error = %e, "ONC RPC server: cannot spawn a connection thread; connection closed");
            let _ = control.shutdown(Shutdown::Both);
        }
    }
}

/// Serves inherited connection `fd` (a connected Unix or TCP stream socket) as connection
/// `id` on this thread until it ends.
fn serve_inherited(
    fd: OwnedFd,
    origin: &Origin,
    id: u64,
    registry: &Registry,
    config: &ServerConfig,
    shutting_down: &AtomicBool,
) -> Result<(), RpcError> {
    let domain = socket2::SockRef::from(&fd)
        .local_addr()
        .map_err(ServerError::Io)?
        .domain();
    let (stream, peer) = if domain == socket2::Domain::UNIX {
        let s = UnixStream::from(fd);
        s.set_nonblocking(false).map_err(ServerError::Io)?;
        crate::endpoint::widen_unix_buffers(&s);
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
    let peer = origin.peer.clone().unwrap_or(peer);
    tracing::debug!(%peer, connection = id, tls = origin.tls, "ONC RPC server: serving an inherited connection");
    serve_connection(
        stream,
        &peer,
        id,
        registry,
        config,
        shutting_down,
        origin,
        Instant::now(),
    );
    Ok(())
}

/// Runs the TLS handshake of connection `id` on `stream` (TCP) within the HELLO deadline
/// and starts its pump: the plaintext socket to serve, the tenant of its client certificate
/// (when the server requires them), and the pump's thread. `None` when the handshake fails
/// (logged; a refused client certificate is an `auth_failed` audit event).
fn start_tls(
    shared: &Shared,
    stream: Stream,
    peer: &Peer,
    id: u64,
    tls: &ServerTls,
    accepted_at: Instant,
) -> Option<(UnixStream, Option<String>, JoinHandle<()>)> {
    let Stream::Tcp(mut tcp) = stream else {
        return None;
    };
    let config = &shared.config;
    let accepted = match tls::accept(tls, &mut tcp, accepted_at + config.hello_timeout) {
        Ok(a) => a,
        Err(tls::AcceptError::Handshake(tls::HandshakeError::Timeout)) => {
            crate::audit!(info, limit "hello_timeout", %peer, connection = id, timeout = ?config.hello_timeout, "ONC RPC server: no TLS handshake within hello_timeout; connection closed");
            return None;
        }
        Err(tls::AcceptError::Handshake(e)) if e.is_certificate() => {
            crate::audit!(warn, "auth_failed", %peer, connection = id, "ONC RPC server: TLS client certificate refused ({e}); connection closed");
            return None;
        }
        Err(tls::AcceptError::Handshake(e)) => {
            tracing::debug!(%peer, connection = id, error = %e, "ONC RPC server: TLS handshake failed; connection closed");
            return None;
        }
        Err(tls::AcceptError::Tenant(why)) => {
            crate::audit!(warn, "auth_failed", %peer, connection = id, "ONC RPC server: TLS client certificate refused: {why}; connection closed");
            return None;
        }
    };
    if let Some(tenant) = &accepted.tenant {
        crate::audit!(info, "auth_ok", %peer, connection = id, tenant = tenant.as_str(), "authenticated by a TLS client certificate");
    }
    let (plain, pump) = match tls::spawn_pump(
        accepted.conn,
        tcp,
        config.stall_timeout,
        format!("{peer} connection {id}"),
    ) {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(%peer, error = %e, "ONC RPC server: cannot start a TLS connection's pump; closed");
            return None;
        }
    };
    // From now on the plaintext socket is the one shutdown wakes and closes: its pump then
    // ends the TLS connection properly.
    if let Ok(control) = plain.try_clone() {
        let mut table = lock(&shared.conns);
        if table.streams.contains_key(&id) {
            table.streams.insert(id, Stream::Unix(control));
        }
    }
    if shared.shutting_down.load(Ordering::SeqCst) {
        let _ = plain.shutdown(Shutdown::Read);
    }
    Some((plain, accepted.tenant, pump))
}

/// Removes connection `id` of peer `key` from the table and shuts its socket down.
fn forget(table: &mut ConnTable, id: u64, key: &PeerKey) {
    if let Some(s) = table.streams.remove(&id) {
        let _ = s.shutdown(Shutdown::Both);
        if let Some(n) = table.per_peer.get_mut(key) {
            *n -= 1;
            if *n == 0 {
                table.per_peer.remove(key);
            }
        }
    }
}

/// The reply record (marked, one fragment) to `record` (without its record mark) when it is
/// a whole call of the NULL procedure (no arguments) of a program and version `registry`
/// serves.
fn null_reply(record: &[u8], registry: &Registry) -> Option<Vec<u8>> {
    use crate::msg::{AcceptStat, MsgBody, RPC_VERSION, RpcMsg};
    let mut dec = crate::xdr::Decoder::new(crate::xdr::Bytes::copy_from_slice(record));
    let msg: RpcMsg = crate::xdr::XdrDecode::decode(&mut dec).ok()?;
    let MsgBody::Call(call) = &msg.body else {
        return None;
    };
    let served = registry
        .programs
        .get(&call.prog)
        .is_some_and(|v| v.contains_key(&call.vers));
    if call.rpcvers != RPC_VERSION || call.proc != 0 || !served || dec.remaining() != 0 {
        return None;
    }
    let mut enc = crate::xdr::Encoder::new();
    crate::xdr::XdrEncode::encode(&RpcMsg::accepted(msg.xid, AcceptStat::Success), &mut enc)
        .ok()?;
    let body = enc.to_bytes();
    let mut out = ((body.len() as u32) | 0x8000_0000).to_be_bytes().to_vec();
    out.extend_from_slice(&body);
    Some(out)
}

/// The xid, program, procedure and argument bytes of a call record (without its mark).
fn first_call(record: &[u8]) -> Option<(u32, u32, u32, &[u8])> {
    use crate::msg::{MsgBody, RPC_VERSION, RpcMsg};
    let mut dec = crate::xdr::Decoder::new(crate::xdr::Bytes::copy_from_slice(record));
    let msg: RpcMsg = crate::xdr::XdrDecode::decode(&mut dec).ok()?;
    let MsgBody::Call(call) = &msg.body else {
        return None;
    };
    if call.rpcvers != RPC_VERSION {
        return None;
    }
    let args = &record[record.len() - dec.remaining()..];
    Some((msg.xid, call.prog, call.proc, args))
}

/// An AUTH_ERROR reply record (marked, one fragment) to call `xid`.
fn auth_error_record(xid: u32, stat: crate::AuthStat) -> Vec<u8> {
    use crate::msg::{RejectedReply, RpcMsg};
    let mut enc = crate::xdr::Encoder::new();
    let _ = crate::xdr::XdrEncode::encode(
        &RpcMsg::denied(xid, RejectedReply::AuthError(stat)),
        &mut enc,
    );
    let body = enc.to_bytes();
    let mut out = ((body.len() as u32) | 0x8000_0000).to_be_bytes().to_vec();
    out.extend_from_slice(&body);
    out
}

/// Waits, without reading it, until the first record of a connection that is handed off is
/// complete in the socket's receive queue: within [`ServerConfig::hello_timeout`] of being
/// accepted and at most [`ServerConfig::max_first_record_size`] long (its first fragment, if
/// it has several). Whoever serves the connection then reads it from the socket as usual.
/// Why not, when it does not come. Calls of the NULL procedure (a ping, such as `remora run
/// --server`'s check that the server answers) are answered here, so that they cost no
/// worker process; they do not extend the deadline.
fn await_first_record(
    stream: &Stream,
    config: &ServerConfig,
    shutting_down: &AtomicBool,
    registry: &Registry,
    accepted_at: Instant,
    gate: Option<(&dyn crate::server::FirstCallGate, &Peer, bool)>,
) -> Result<crate::server::Admission, String> {
    use rustix::event::{PollFd, PollFlags, Timespec, poll};
    use rustix::net::{RecvFlags, recv};
    let fd = match stream {
        Stream::Tcp(s) => s.as_fd(),
        Stream::Unix(s) => s.as_fd(),
        Stream::Shm(_) => return Ok(Default::default()),
    };
    let max = config
        .max_first_record_size
        .map_or(config.max_record_size, |m| m.min(config.max_record_size));
    let deadline = accepted_at + config.hello_timeout;
    let mut buf = vec![0u8; 4 + max];
    let mut last = usize::MAX;
    loop {
        if shutting_down.load(Ordering::SeqCst) {
            return Err("the server is shutting down".into());
        }
        let left = deadline.saturating_duration_since(std::time::Instant::now());
        if left.is_zero() {
            return Err(format!(
                "no complete first call (HELLO) within hello_timeout ({:?})",
                config.hello_timeout
            ));
        }
        let wait = left.min(Duration::from_millis(100));
        let ts = Timespec::try_from(wait).unwrap_or(Timespec {
            tv_sec: 0,
            tv_nsec: 100_000_000,
        });
        let mut fds = [PollFd::new(&fd, PollFlags::IN)];
        match poll(&mut fds, Some(&ts)) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(format!("poll failed: {e}")),
        }
        let n = match recv(fd, &mut buf[..], RecvFlags::PEEK | RecvFlags::DONTWAIT) {
            Ok((n, _)) => n,
            Err(rustix::io::Errno::AGAIN | rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(format!("cannot read from the connection: {e}")),
        };
        if n == 0 {
            return Err("the peer closed the connection before its first call".into());
        }
        if n >= 4 {
            let len = (u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]) & 0x7FFF_FFFF) as usize;
            if len > max {
                return Err(format!(
                    "the first record ({len} bytes) exceeds max_first_record_size ({max} bytes)"
                ));
            }
            let last_fragment = buf[0] & 0x80 != 0;
            if n >= 4 + len {
                let Some(reply) = last_fragment
                    .then(|| null_reply(&buf[4..4 + len], registry))
                    .flatten()
                else {
                    let Some((gate, peer, authenticated)) = gate else {
                        return Ok(Default::default());
                    };
                    // Checked here, before any process starts for the connection; the
                    // record stays queued for whoever serves it.
                    let checked = match first_call(&buf[4..4 + len]) {
                        Some((xid, program, procedure, args)) if last_fragment => gate
                            .check(peer, authenticated, program, procedure, args)
                            .map_err(|stat| (xid, stat)),
                        Some((xid, ..)) => Err((xid, crate::AuthStat::TooWeak)),
                        None => return Err("the first record is not a call".into()),
                    };
                    let (xid, stat) = match checked {
                        Ok(admission) => return Ok(admission),
                        Err(refused) => refused,
                    };
                    let reply = auth_error_record(xid, stat);
                    let _ = rustix::net::send(fd, &reply, rustix::net::SendFlags::NOSIGNAL);
                    return Err(format!(
                        "its first call was refused before a session started (AUTH_ERROR {stat:?})"
                    ));
                };
                // Consume the call (it lies whole in the queue), answer it, wait for more.
                let taken = recv(fd, &mut buf[..4 + len], RecvFlags::WAITALL)
                    .map_err(|e| format!("cannot read from the connection: {e}"))?;
                if taken.0 != 4 + len {
                    return Err("the connection lost part of a queued call".into());
                }
                let mut sent = 0;
                while sent < reply.len() {
                    sent += rustix::net::send(fd, &reply[sent..], rustix::net::SendFlags::NOSIGNAL)
                        .map_err(|e| format!("cannot answer a NULL call: {e}"))?;
                }
                last = usize::MAX;
                continue;
            }
        }
        if n == last {
            // Part of the record is queued and readable, so poll would not wait: pace the
            // peeking instead of spinning.
            std::thread::sleep(Duration::from_millis(10));
        }
        last = n;
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
            Endpoint::Unix(_) | Endpoint::Tls(_) => None,
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
