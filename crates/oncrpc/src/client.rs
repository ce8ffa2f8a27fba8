//! The client runtime: pipelined calls over one connection, leader/follower reading.
//!
//! Calls from many threads share one connection. Each call registers a slot under its XID
//! in the pending table, then writes its record (one lock, one vectored write sequence per
//! record). There is no reader thread: the first waiting caller that finds nobody reading
//! becomes the *leader* and reads replies, storing other callers' replies in their slots and
//! waking them; when its own reply arrives (or its deadline passes) it hands the leader role
//! to another waiting caller. A lone caller therefore reads its own reply with no thread hop.

use std::collections::HashMap;
use std::fmt;
use std::io;
use std::net::Shutdown;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use remora_xdr::{Bytes, Decoder, Encoder, XdrDecode};

use crate::auth::{Credential, OpaqueAuth};
use crate::endpoint::{Endpoint, Stream, TransportChoice};
use crate::error::RpcError;
use crate::msg::{
    AcceptStat, MSG_CALL, MSG_REPLY, MsgBody, RPC_VERSION, RejectedReply, ReplyBody, RpcMsg,
};
use crate::record::{MAX_FRAGMENT_SIZE, RecordError, RecordReader, write_record_slices};
use crate::spin::Spinning;
use crate::xdr;
use remora_shm::DataArea;

/// Default maximum record size: 128 MiB plus 4 KiB of headers.
pub const DEFAULT_MAX_RECORD_SIZE: usize = 128 * 1024 * 1024 + 4096;

/// Default per-call timeout, as libtirpc's.
pub const DEFAULT_TIMEOUT: Duration = Duration::from_secs(25);

/// Settings of a [`Client`].
#[derive(Debug, Clone)]
pub struct ClientConfig {
    /// Timeout of calls made with `timeout: None`.
    pub default_timeout: Duration,
    /// Credential sent with every call (AUTH_NONE by default).
    pub credential: Credential,
    /// Largest reply record accepted; a larger one closes the connection.
    pub max_record_size: usize,
    /// Largest fragment sent; larger call records are split.
    pub max_fragment_size: usize,
    /// Bound on establishing a TCP connection (`None`: the system's).
    pub connect_timeout: Option<Duration>,
    /// Batch one-way calls (RFC 5531 batching): `None` writes each at once; `Some(delay)`
    /// queues them and writes the queue in one go before the next normal call, when it grows
    /// large, or at most about `delay` after the first queued call. Order is kept either way.
    pub oneway_batch_delay: Option<Duration>,
    /// How to reach the server: by default (`Auto`) a `unix://` server is asked for shared
    /// memory and used over its socket if it declines, a `tcp://` one over TCP. `Shm`
    /// fails if shared memory cannot be had.
    pub transport: TransportChoice,
    /// Notice a hung or vanished server while calls wait for it, whatever their timeouts
    /// (`None`, the default: only call timeouts). See [`Liveness`].
    pub liveness: Option<Liveness>,
    /// A call made on the fresh connection before anything else, before the move into
    /// shared memory too (e.g. a handshake that authenticates the connection, which a server
    /// may require before it serves anything else). Its reply is kept
    /// ([`Client::opening_reply`]); an RPC error in it (AUTH_ERROR, PROC_UNAVAIL, …) fails
    /// the connection with that error. `None` (the default): no such call.
    pub opening_call: Option<OpeningCall>,
    /// The TLS settings for a `tls://` server (trusted CAs, client certificate); `None`
    /// (the default): [`ClientTls::from_env`](crate::ClientTls::from_env) when connecting
    /// to one (`REMORA_TLS_CA`, `REMORA_TLS_CERT`, `REMORA_TLS_KEY`).
    pub tls: Option<Arc<crate::ClientTls>>,
}

/// A call made first on a new connection ([`ClientConfig::opening_call`]): its program,
/// version and procedure, and its arguments already encoded. `Debug` does not show the
/// arguments (they may hold a secret such as a token).
#[derive(Clone)]
pub struct OpeningCall {
    /// Program number.
    pub program: u32,
    /// Program version.
    pub version: u32,
    /// Procedure number.
    pub procedure: u32,
    /// The XDR-encoded arguments.
    pub args: Bytes,
}

impl fmt::Debug for OpeningCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("OpeningCall")
            .field("program", &self.program)
            .field("version", &self.version)
            .field("procedure", &self.procedure)
            .field("args", &format_args!("<{} bytes>", self.args.len()))
            .finish()
    }
}

/// Largest reply to an [`OpeningCall`] accepted.
const MAX_OPENING_REPLY: usize = 1 << 20;

/// How a client notices a server that is hung (stopped, deadlocked) or gone (host down,
/// network cut) while calls wait, without a per-call timeout that would also cut short a
/// call that legitimately takes long (a synchronize waiting for a kernel that runs for
/// minutes).
///
/// * While some call waits and the server has sent nothing for `probe_after`, the waiting
///   thread sends a NULL call (procedure 0) of the waiting call's program: a server that is
///   alive answers it at once, even while it works on the long call (its connection thread
///   reads calls while other threads work), and any record from the server counts.
/// * When the server has sent nothing for `dead_after`, ping unanswered, the connection is
///   closed and every call fails with [`RpcError::ServerUnresponsive`].
/// * On TCP, keepalive probes (idle `probe_after`, then every second) and `TCP_USER_TIMEOUT`
///   of `dead_after` let the kernel notice a vanished host too.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Liveness {
    /// Silence, while calls wait, after which the server is pinged.
    pub probe_after: Duration,
    /// Silence after which the server is declared hung and the connection closed.
    pub dead_after: Duration,
}

impl Default for Liveness {
    /// Ping after 5 s of silence; give up after 120 s.
    ///
    /// Not shorter: a live server cannot answer a ping while the connection thread that
    /// would read it is itself busy in the driver (a one-way launch waiting for room in a
    /// full launch queue drains at the speed of the kernels ahead of it), and declaring such
    /// a server dead would kill a legitimate program. A vanished host is noticed sooner by
    /// TCP keepalive (probes after `probe_after`, then every second).
    fn default() -> Self {
        Self {
            probe_after: Duration::from_secs(5),
            dead_after: Duration::from_secs(120),
        }
    }
}

impl Default for ClientConfig {
    fn default() -> Self {
        Self {
            default_timeout: DEFAULT_TIMEOUT,
            credential: Credential::None,
            max_record_size: DEFAULT_MAX_RECORD_SIZE,
            max_fragment_size: MAX_FRAGMENT_SIZE,
            connect_timeout: Some(Duration::from_secs(10)),
            oneway_batch_delay: None,
            transport: TransportChoice::Auto,
            liveness: None,
            opening_call: None,
            tls: None,
        }
    }
}

/// A connection to an ONC RPC server; cheap to clone, usable from many threads at once
/// (calls are pipelined and matched by XID).
///
/// The connection closes when the last clone is dropped or [`Client::close`] is called.
/// Once the connection is lost every call fails at once with [`RpcError::ConnectionLost`];
/// connect again to recover.
#[derive(Clone)]
pub struct Client {
    inner: Arc<Inner>,
}

/// A call sent by [`Client::start_call`] whose reply has not been taken yet. Dropping it
/// without [`PendingCall::finish`] forgets the call (its reply is dropped when it comes).
#[must_use = "a pending call's reply is only seen through finish"]
pub struct PendingCall {
    inner: Arc<Inner>,
    xid: u32,
    cv: Arc<Condvar>,
    timeout: Duration,
    /// Program, version and procedure.
    target: (u32, u32, u32),
    done: bool,
}

impl fmt::Debug for PendingCall {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("PendingCall")
            .field("xid", &self.xid)
            .field("target", &self.target)
            .finish_non_exhaustive()
    }
}

impl PendingCall {
    /// Waits for the reply (within the call's timeout, counted from now) and decodes it with
    /// `result` (trailing bytes are rejected).
    pub fn finish<R>(
        mut self,
        result: impl FnOnce(&mut Decoder) -> xdr::Result<R>,
    ) -> Result<R, RpcError> {
        self.done = true;
        let (program, version, procedure) = self.target;
        let record = self.inner.wait(
            self.xid,
            &self.cv,
            self.timeout,
            PingTarget { program, version },
        )?;
        self.inner.note_waited();
        decode_reply(record, program, version, procedure, result)
    }
}

impl Drop for PendingCall {
    fn drop(&mut self) {
        if !self.done {
            lock(&self.inner.state).pending.remove(&self.xid);
        }
    }
}

struct Inner {
    endpoint: Endpoint,
    config: ClientConfig,
    /// Pre-encoded credential and verifier, appended to every call header.
    auth: Bytes,
    next_xid: AtomicU32,
    writer: Mutex<Stream>,
    /// One-way calls waiting to be written (with `oneway_batch_delay`).
    batch: Arc<Batch>,
    reader: Mutex<ReaderState>,
    state: Mutex<State>,
    /// A handle used only to shut the socket down.
    control: Stream,
    /// The results of [`ClientConfig::opening_call`].
    opening_reply: Option<Bytes>,
    /// Over shared memory, a one-way call after a pause ([`ONEWAY_PAUSE`] without a write,
    /// or a wait for the server since the last write: a reply, or a completion word seen,
    /// [`Client::note_waited`]) is written at once rather than queued: a ring write costs no
    /// system call, and the server starts on it (a launch) while the caller prepares what
    /// follows (a synchronize). Calls in quick succession (a burst of launches) are still
    /// batched. A launch + synchronize loop so queues nothing, and the batch's flusher
    /// thread parks instead of looking at the queue every delay.
    write_after_pause: bool,
    /// When this client last wrote, in nanoseconds since `epoch`.
    last_write: AtomicU64,
    epoch: Instant,
}

/// See [`Inner::write_after_pause`].
const ONEWAY_PAUSE: Duration = Duration::from_micros(5);

/// Queued one-way call records, shared with the flusher thread.
#[derive(Default)]
struct Batch {
    queue: Mutex<BatchQueue>,
    cv: Condvar,
}

#[derive(Default)]
struct BatchQueue {
    records: Vec<remora_xdr::Chunks>,
    bytes: usize,
    closed: bool,
    /// The flusher waits on the condition variable (it has been idle for a while): the next
    /// queued call must wake it. While it is awake it looks again every delay by itself, so
    /// a busy program's calls cost no wake-up (a system call each).
    parked: bool,
}

/// How many delays in a row the flusher looks at an empty queue before it parks.
const FLUSHER_IDLE_ROUNDS: u32 = 20;

/// A batch this large is written at once by the caller that fills it.
const BATCH_MAX_RECORDS: usize = 128;
const BATCH_MAX_BYTES: usize = 256 * 1024;

struct ReaderState {
    records: RecordReader<Spinning<Stream>>,
    timeout: Option<Duration>,
}

#[derive(Default)]
struct State {
    pending: HashMap<u32, Slot>,
    leader: bool,
    dead: bool,
}

struct Slot {
    reply: Option<Bytes>,
    cv: Arc<Condvar>,
    /// Whether its caller is asleep on `cv` now, waiting for the reply (a started call whose
    /// caller has not come to wait yet, or is busy elsewhere, is not: waking it does nothing).
    waiting: bool,
}

/// The program and version a liveness ping calls NULL of (those of the call waiting).
#[derive(Debug, Clone, Copy)]
struct PingTarget {
    program: u32,
    version: u32,
}

enum Lead {
    Mine(Bytes),
    Deadline,
    Dead(RpcError),
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl fmt::Debug for Client {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Client")
            .field("endpoint", &self.inner.endpoint)
            .field("connected", &self.is_connected())
            .finish_non_exhaustive()
    }
}

/// Makes `call` on the fresh `stream` and returns its results (the bytes after the accepted
/// reply header), reading exactly its reply.
/// Encodes the call's credential (`config.credential`) and an AUTH_NONE verifier.
fn encode_auth(config: &ClientConfig, enc: &mut Encoder) -> Result<(), RpcError> {
    let cred = config
        .credential
        .to_opaque_auth()
        .map_err(RpcError::Encode)?;
    xdr::XdrEncode::encode(&cred, enc).map_err(RpcError::Encode)?;
    xdr::XdrEncode::encode(&OpaqueAuth::NONE, enc).map_err(RpcError::Encode)
}

fn make_opening_call(
    stream: &mut Stream,
    call: &OpeningCall,
    config: &ClientConfig,
) -> Result<Bytes, RpcError> {
    let xid = std::process::id().rotate_left(8) ^ 0x4f50_454e;
    let mut enc = Encoder::with_capacity(64 + call.args.len());
    for w in [
        xid,
        MSG_CALL,
        RPC_VERSION,
        call.program,
        call.version,
        call.procedure,
    ] {
        enc.put_u32(w);
    }
    encode_auth(config, &mut enc)?;
    enc.put_raw(&call.args);
    let timeout = config
        .connect_timeout
        .filter(|t| !t.is_zero())
        .unwrap_or(Duration::from_secs(10));
    stream.set_read_timeout(Some(timeout))?;
    stream.set_write_timeout(Some(timeout))?;
    crate::record::write_record(stream, &enc.finish(), config.max_fragment_size)?;
    // The server sends nothing but this reply until the next call, so the reader takes no
    // byte that is not the reply's.
    let mut reader = RecordReader::new(&mut *stream, MAX_OPENING_REPLY);
    let record = match reader.read_record() {
        Ok(Some(record)) => record,
        Ok(None) => return Err(RpcError::ConnectionLost),
        Err(e) if e.is_timeout() => return Err(RpcError::Timeout { timeout }),
        Err(RecordError::TooLarge { declared, max }) => {
            return Err(RpcError::RecordTooLarge {
                size: declared,
                max,
            });
        }
        Err(_) => return Err(RpcError::ConnectionLost),
    };
    drop(reader);
    stream.set_read_timeout(None)?;
    if record.get(..4) != Some(&xid.to_be_bytes()[..]) {
        return Err(RpcError::MalformedReply(xdr::Error::UnknownDiscriminant {
            type_name: "xid of the opening call's reply",
            value: 0,
        }));
    }
    decode_reply(record, call.program, call.version, call.procedure, |d| {
        d.get_fixed_opaque_bytes(d.remaining())
    })
}

/// Connects to `endpoint` the way `config.transport` asks, making the opening call first
/// when there is one; returns the stream and the opening call's results.
fn connect_transport(
    endpoint: &Endpoint,
    config: &ClientConfig,
) -> Result<(Stream, Option<Bytes>), RpcError> {
    let connect_err = |source| RpcError::Connect {
        endpoint: endpoint.to_string(),
        source,
    };
    let from_env;
    let tls = match (endpoint, &config.tls) {
        (Endpoint::Tls(_), None) => {
            from_env = crate::ClientTls::from_env()
                .map_err(|e| connect_err(io::Error::new(io::ErrorKind::InvalidInput, e)))?;
            Some(&from_env)
        }
        (_, tls) => tls.as_deref(),
    };
    // Unanswered TLS output is given up on when the server is declared dead.
    let stall = config
        .liveness
        .map_or(Duration::from_secs(120), |l| l.dead_after);
    let mut stream =
        Stream::connect(
            endpoint,
            config.connect_timeout,
            tls,
            stall,
            |tcp| match config.liveness {
                Some(live) => set_tcp_liveness(tcp, live).map_err(io::Error::other),
                None => Ok(()),
            },
        )
        .map_err(connect_err)?;
    let opening = match &config.opening_call {
        Some(call) => Some(make_opening_call(&mut stream, call, config)?),
        None => None,
    };
    Ok((continue_transport(endpoint, config, stream)?, opening))
}

/// Moves a connected `stream` into shared memory when `config.transport` asks for it.
fn continue_transport(
    endpoint: &Endpoint,
    config: &ClientConfig,
    stream: Stream,
) -> Result<Stream, RpcError> {
    let connect_err = |source| RpcError::Connect {
        endpoint: endpoint.to_string(),
        source,
    };
    let refuse = |reason: &str| RpcError::Transport {
        transport: config.transport,
        endpoint: endpoint.to_string(),
        reason: reason.to_owned(),
    };
    let want_shm = match (config.transport, endpoint) {
        (TransportChoice::Tcp, Endpoint::Unix(_)) => {
            return Err(refuse("it is a Unix socket: name a tcp://HOST:PORT server"));
        }
        (TransportChoice::Unix, Endpoint::Tcp(_)) => {
            return Err(refuse("it is a TCP address: name a unix:///PATH server"));
        }
        (TransportChoice::Unix, Endpoint::Tls(_)) => {
            return Err(refuse(
                "it is a TLS address: name a unix:///PATH server, or use --transport auto",
            ));
        }
        (TransportChoice::Shm, Endpoint::Tcp(_) | Endpoint::Tls(_)) => {
            return Err(refuse(
                "shared memory needs a server on this host reached by its Unix socket (it is \
                 never offered over TCP or TLS): name a unix:///PATH server, or use \
                 --transport tcp or auto",
            ));
        }
        (TransportChoice::Auto | TransportChoice::Shm, Endpoint::Unix(_)) => true,
        _ => false,
    };
    let Stream::Unix(socket) = stream else {
        return Ok(stream);
    };
    if !want_shm {
        return Ok(Stream::Unix(socket));
    }
    let timeout = config
        .connect_timeout
        .filter(|t| !t.is_zero())
        .unwrap_or(Duration::from_secs(10));
    let setup = crate::shm::client_setup(socket, timeout).map_err(|e| {
        match crate::shm::auth_refused(&e) {
            Some(stat) => RpcError::AuthError { stat },
            None => connect_err(e),
        }
    })?;
    match setup {
        Ok(shm) => {
            tracing::debug!(%endpoint, "RPC client: connection moved into shared memory");
            Ok(Stream::Shm(shm))
        }
        Err((_, reason)) if config.transport == TransportChoice::Shm => Err(refuse(&reason)),
        Err((socket, reason)) => {
            tracing::debug!(%endpoint, reason, "RPC client: no shared memory; staying on the Unix socket");
            Ok(Stream::Unix(socket))
        }
    }
}

impl Client {
    /// Connects to `endpoint` with the default [`ClientConfig`] (AUTH_NONE, 25 s timeout).
    pub fn connect(endpoint: &Endpoint) -> Result<Client, RpcError> {
        Self::connect_with(endpoint, ClientConfig::default())
    }

    /// Connects to `endpoint` with `config`.
    pub fn connect_with(endpoint: &Endpoint, config: ClientConfig) -> Result<Client, RpcError> {
        let (stream, opening_reply) = connect_transport(endpoint, &config)?;
        // A write that cannot progress for WRITE_STALL returns, so that the writer can read
        // replies meanwhile (see `Inner::pump`).
        stream.set_write_timeout(Some(WRITE_STALL))?;
        let reader = stream.try_clone()?;
        let control = stream.try_clone()?;
        let mut enc = Encoder::new();
        encode_auth(&config, &mut enc)?;
        let seed = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos() ^ (d.as_secs() as u32).rotate_left(16))
            .unwrap_or(0)
            ^ std::process::id().rotate_left(8);
        let client = Client {
            inner: Arc::new(Inner {
                endpoint: endpoint.clone(),
                auth: enc.to_bytes(),
                next_xid: AtomicU32::new(seed),
                writer: Mutex::new(stream),
                batch: Arc::default(),
                reader: Mutex::new(ReaderState {
                    records: RecordReader::new(Spinning::new(reader), config.max_record_size),
                    timeout: None,
                }),
                state: Mutex::new(State::default()),
                write_after_pause: matches!(control, Stream::Shm(_)),
                control,
                config,
                opening_reply,
                last_write: AtomicU64::new(0),
                epoch: Instant::now(),
            }),
        };
        if let Some(delay) = client.inner.config.oneway_batch_delay {
            let batch = Arc::clone(&client.inner.batch);
            let inner = Arc::downgrade(&client.inner);
            std::thread::Builder::new()
                .name("oncrpc-batch".into())
                .spawn(move || flusher(batch, inner, delay))?;
        }
        Ok(client)
    }

    /// The endpoint this client connected to.
    pub fn endpoint(&self) -> &Endpoint {
        &self.inner.endpoint
    }

    /// The client's settings.
    pub fn config(&self) -> &ClientConfig {
        &self.inner.config
    }

    /// The results of [`ClientConfig::opening_call`] (the reply's bytes after its header),
    /// when one was made.
    pub fn opening_reply(&self) -> Option<&Bytes> {
        self.inner.opening_reply.as_ref()
    }

    /// Logs this connection's waiters (`REMORA_WAIT_TRACE`: the socket reader's, and both
    /// shared-memory rings'), for a client that lives until its process exits. Left out when
    /// another thread holds them (it is reading right now).
    pub fn trace_waits(&self) {
        if let Ok(rd) = self.inner.reader.try_lock() {
            let spinning = rd.records.get_ref();
            spinning.trace_waits();
            if let Stream::Shm(s) = &spinning.inner {
                s.trace_waits();
            }
        }
    }

    /// Whether the connection runs through shared memory (`SHM_SETUP` was granted).
    pub fn is_shm(&self) -> bool {
        matches!(self.inner.control, Stream::Shm(_))
    }

    /// Over shared memory, whether a call written since the last read had to wake the
    /// sleeping server, and then how late its answer usually comes for it
    /// ([`remora_shm::ShmStream::take_peer_woken`]); `None` otherwise and on sockets.
    pub fn take_peer_woken(&self) -> Option<std::time::Duration> {
        match &self.inner.control {
            Stream::Shm(s) => s.take_peer_woken(),
            _ => None,
        }
    }

    /// Over shared memory, the CPU the server ran on when it last took a call of ours, as it
    /// says ([`remora_shm::say_cpu`], [`remora_shm::ShmStream::peer_cpu`]); `None` otherwise.
    pub fn server_cpu(&self) -> Option<u32> {
        match &self.inner.control {
            Stream::Shm(s) => s.peer_cpu(),
            _ => None,
        }
    }

    /// The data area of the connection's shared-memory region: `None` on a socket or when the
    /// server gave none. The server may write it at any time.
    pub fn data_area(&self) -> Option<DataArea> {
        match &self.inner.control {
            Stream::Shm(s) => Some(s.region().data_area()).filter(|a| !a.is_empty()),
            _ => None,
        }
    }

    /// Whether the connection is still usable (no loss detected yet).
    pub fn is_connected(&self) -> bool {
        !lock(&self.inner.state).dead
    }

    /// Closes the connection: pending and later calls fail with
    /// [`RpcError::ConnectionLost`].
    pub fn close(&self) {
        self.inner.fail_all();
    }

    fn encode_call(
        &self,
        xid: u32,
        program: u32,
        version: u32,
        procedure: u32,
        args: impl FnOnce(&mut Encoder) -> xdr::Result<()>,
    ) -> Result<remora_xdr::Chunks, RpcError> {
        // In this thread's encoding buffer, shared with its other calls (crate::scratch).
        let mut enc = crate::scratch::encoder();
        enc.put_u32(xid);
        enc.put_u32(MSG_CALL);
        enc.put_u32(RPC_VERSION);
        enc.put_u32(program);
        enc.put_u32(version);
        enc.put_u32(procedure);
        enc.put_raw(&self.inner.auth);
        args(&mut enc).map_err(RpcError::Encode)?;
        Ok(crate::scratch::finish(enc))
    }

    /// Calls `procedure`, encoding the arguments with `args` and decoding the result with
    /// `result` (trailing bytes are rejected). `timeout` of `None` uses the client's default.
    ///
    /// Many threads may call at once; their calls are pipelined on the connection.
    pub fn call<R>(
        &self,
        program: u32,
        version: u32,
        procedure: u32,
        timeout: Option<Duration>,
        args: impl FnOnce(&mut Encoder) -> xdr::Result<()>,
        result: impl FnOnce(&mut Decoder) -> xdr::Result<R>,
    ) -> Result<R, RpcError> {
        self.start_call(program, version, procedure, timeout, args, &[])?
            .finish(result)
    }

    /// Sends a call and returns without waiting for its reply: [`PendingCall::finish`] waits
    /// for it and decodes it. One thread can so keep several calls in flight (a bulk copy
    /// sends its next chunk while the server still works on the previous one).
    ///
    /// The record is the encoded `args` followed by the `raw` slices, written as they are
    /// (the caller adds what XDR needs around them, e.g. an `opaque<>` length before and its
    /// padding after): a large payload goes from the caller's memory to the socket without
    /// being copied first. The call has been written when this returns.
    pub fn start_call(
        &self,
        program: u32,
        version: u32,
        procedure: u32,
        timeout: Option<Duration>,
        args: impl FnOnce(&mut Encoder) -> xdr::Result<()>,
        raw: &[&[u8]],
    ) -> Result<PendingCall, RpcError> {
        let timeout = timeout.unwrap_or(self.inner.config.default_timeout);
        let xid = self.inner.next_xid.fetch_add(1, Ordering::Relaxed);
        let chunks = self.encode_call(xid, program, version, procedure, args)?;
        let cv = Arc::new(Condvar::new());
        {
            let mut st = lock(&self.inner.state);
            if st.dead {
                return Err(RpcError::ConnectionLost);
            }
            st.pending.insert(
                xid,
                Slot {
                    waiting: false,
                    reply: None,
                    cv: Arc::clone(&cv),
                },
            );
        }
        if let Err(e) = self.inner.send_parts(&chunks, raw) {
            lock(&self.inner.state).pending.remove(&xid);
            return Err(e);
        }
        Ok(PendingCall {
            inner: Arc::clone(&self.inner),
            xid,
            cv,
            timeout,
            target: (program, version, procedure),
            done: false,
        })
    }

    /// A one-way call whose record is the encoded `args` followed by the `raw` slices (as
    /// [`Client::start_call`]), written before this returns (one-way calls queued for a batch
    /// go first, so order is kept): the caller's buffer is never copied.
    pub fn call_oneway_raw(
        &self,
        program: u32,
        version: u32,
        procedure: u32,
        args: impl FnOnce(&mut Encoder) -> xdr::Result<()>,
        raw: &[&[u8]],
    ) -> Result<(), RpcError> {
        let xid = self.inner.next_xid.fetch_add(1, Ordering::Relaxed);
        let chunks = self.encode_call(xid, program, version, procedure, args)?;
        if lock(&self.inner.state).dead {
            return Err(RpcError::ConnectionLost);
        }
        self.inner.send_parts(&chunks, raw)
    }

    /// Says that the caller waited for the server by other means than a reply (a completion
    /// word in shared memory): over shared memory its next one-way call is written at once,
    /// as after a reply, rather than queued for a batch.
    pub fn note_waited(&self) {
        self.inner.note_waited();
    }

    /// Writes the one-way calls queued for a batch now (a caller about to wait for their
    /// effect by other means than a reply, e.g. a completion word in shared memory).
    pub fn flush(&self) -> Result<(), RpcError> {
        self.inner.send(&[])
    }

    /// Sends a one-way call: no reply is awaited (if the server replies anyway, the reply is
    /// dropped). One-way calls are written in order with all other calls of this client.
    pub fn call_oneway(
        &self,
        program: u32,
        version: u32,
        procedure: u32,
        args: impl FnOnce(&mut Encoder) -> xdr::Result<()>,
    ) -> Result<(), RpcError> {
        let xid = self.inner.next_xid.fetch_add(1, Ordering::Relaxed);
        let chunks = self.encode_call(xid, program, version, procedure, args)?;
        if lock(&self.inner.state).dead {
            return Err(RpcError::ConnectionLost);
        }
        if self.inner.config.oneway_batch_delay.is_none() {
            return self.inner.send(&chunks);
        }
        let full = {
            let mut q = lock(&self.inner.batch.queue);
            if self.inner.write_after_pause && q.records.is_empty() && self.inner.paused() {
                drop(q);
                return self.inner.send(&chunks);
            }
            q.bytes += chunks.iter().map(Bytes::len).sum::<usize>();
            q.records.push(chunks);
            if q.records.len() == 1 && q.parked {
                self.inner.batch.cv.notify_one();
            }
            q.records.len() >= BATCH_MAX_RECORDS || q.bytes >= BATCH_MAX_BYTES
        };
        if full { self.inner.send(&[]) } else { Ok(()) }
    }
}

/// The batch flusher: writes queued one-way calls at most about `delay` after they were
/// queued, unless a normal call or a full batch has written them already. It stays awake,
/// looking every `delay`, while calls keep coming, and parks after
/// [`FLUSHER_IDLE_ROUNDS`] empty looks. Ends with the connection.
fn flusher(batch: Arc<Batch>, inner: std::sync::Weak<Inner>, delay: Duration) {
    let mut idle = 0u32;
    loop {
        {
            let mut q = lock(&batch.queue);
            if q.records.is_empty() && !q.closed {
                if idle < FLUSHER_IDLE_ROUNDS {
                    idle += 1;
                } else {
                    q.parked = true;
                    while q.records.is_empty() && !q.closed {
                        q = batch.cv.wait(q).unwrap_or_else(PoisonError::into_inner);
                    }
                    q.parked = false;
                    idle = 0;
                }
            } else {
                idle = 0;
            }
            if q.closed {
                return;
            }
        }
        std::thread::sleep(delay);
        if lock(&batch.queue).records.is_empty() {
            continue;
        }
        let Some(inner) = inner.upgrade() else { return };
        if inner.send(&[]).is_err() {
            return;
        }
    }
}

impl Drop for Inner {
    fn drop(&mut self) {
        // Queued one-way calls still go out; then the flusher stops.
        let _ = self.send(&[]);
        lock(&self.batch.queue).closed = true;
        self.batch.cv.notify_all();
    }
}

pub(crate) fn decode_reply<R>(
    record: Bytes,
    program: u32,
    version: u32,
    procedure: u32,
    result: impl FnOnce(&mut Decoder) -> xdr::Result<R>,
) -> Result<R, RpcError> {
    let mut dec = Decoder::new(record);
    let msg = RpcMsg::decode(&mut dec).map_err(RpcError::MalformedReply)?;
    let body = match msg.body {
        MsgBody::Reply(body) => body,
        MsgBody::Call(_) => {
            return Err(RpcError::MalformedReply(xdr::Error::UnknownDiscriminant {
                type_name: "msg_type",
                value: i64::from(MSG_CALL),
            }));
        }
    };
    match body {
        ReplyBody::Accepted(a) => match a.stat {
            AcceptStat::Success => {
                let decode_err = |source| RpcError::Decode {
                    program,
                    version,
                    procedure,
                    source,
                };
                let r = result(&mut dec).map_err(decode_err)?;
                dec.finish().map_err(decode_err)?;
                Ok(r)
            }
            AcceptStat::ProgUnavail => Err(RpcError::ProgUnavail { program }),
            AcceptStat::ProgMismatch { low, high } => Err(RpcError::ProgMismatch {
                program,
                version,
                low,
                high,
            }),
            AcceptStat::ProcUnavail => Err(RpcError::ProcUnavail {
                program,
                version,
                procedure,
            }),
            AcceptStat::GarbageArgs => Err(RpcError::GarbageArgs {
                program,
                version,
                procedure,
            }),
            AcceptStat::SystemErr => Err(RpcError::SystemErr {
                program,
                version,
                procedure,
            }),
        },
        ReplyBody::Denied(RejectedReply::RpcMismatch { low, high }) => {
            Err(RpcError::RpcMismatch { low, high })
        }
        ReplyBody::Denied(RejectedReply::AuthError(stat)) => Err(RpcError::AuthError { stat }),
    }
}

/// How long a blocked write waits before the writer reads replies instead.
const WRITE_STALL: Duration = Duration::from_millis(2);

/// The connection's writer, as the record writer sees it: a write that stalls because the
/// socket is full lets the writing thread read replies (so that the server, which may itself be
/// blocked writing replies to us, can go on reading our calls), then retries. Without this,
/// many threads sending large calls while nobody reads could deadlock with the server.
struct PumpingWriter<'a> {
    inner: &'a Inner,
    stream: &'a mut Stream,
}

impl std::io::Write for PumpingWriter<'_> {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.write_vectored(&[std::io::IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[std::io::IoSlice<'_>]) -> std::io::Result<usize> {
        loop {
            match self.stream.write_vectored(bufs) {
                Err(e)
                    if matches!(
                        e.kind(),
                        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
                    ) =>
                {
                    if lock(&self.inner.state).dead {
                        return Err(e);
                    }
                    self.inner.pump();
                }
                other => return other,
            }
        }
    }

    fn flush(&mut self) -> std::io::Result<()> {
        self.stream.flush()
    }
}

impl Inner {
    /// Reads and dispatches the replies that have arrived, unless another thread is already
    /// the reader (then it is making progress and this one just yields briefly).
    fn pump(&self) {
        {
            let mut st = lock(&self.state);
            if st.leader || st.dead {
                drop(st);
                std::thread::sleep(Duration::from_micros(200));
                return;
            }
            st.leader = true;
        }
        {
            let mut rd = lock(&self.reader);
            if rd.adjust_timeout(Some(Duration::from_millis(1))).is_ok() {
                loop {
                    match rd.records.read_record() {
                        Ok(Some(rec)) => self.dispatch(rec),
                        Err(e) if e.is_timeout() => break,
                        // Anything else: leave it to the next regular reader to report.
                        _ => break,
                    }
                }
            }
        }
        let mut st = lock(&self.state);
        st.leader = false;
        if let Some((_, slot)) = st.pending.iter().find(|(_, s)| s.reply.is_none()) {
            slot.cv.notify_one();
        }
    }

    /// Hands a reply read by `pump` or by a leader to its waiting caller; drops (and logs)
    /// what is not a reply to a call in flight.
    fn dispatch(&self, rec: Bytes) {
        if rec.len() < 8 {
            tracing::warn!(endpoint = %self.endpoint, len = rec.len(), "RPC client: record too short for a reply header; dropped");
            return;
        }
        let rxid = u32::from_be_bytes([rec[0], rec[1], rec[2], rec[3]]);
        let mtype = u32::from_be_bytes([rec[4], rec[5], rec[6], rec[7]]);
        if mtype != MSG_REPLY {
            if mtype == MSG_CALL {
                tracing::warn!(endpoint = %self.endpoint, xid = rxid, "RPC client: protocol error: the server sent a CALL message to the client; dropped");
            } else {
                tracing::warn!(endpoint = %self.endpoint, xid = rxid, msg_type = mtype, "RPC client: message of unknown type dropped");
            }
            return;
        }
        let mut st = lock(&self.state);
        match st.pending.get_mut(&rxid) {
            Some(slot) => {
                slot.reply = Some(rec);
                slot.cv.notify_one();
            }
            None => {
                tracing::debug!(endpoint = %self.endpoint, xid = rxid, "RPC client: reply with unknown XID (timed out or one-way call) dropped");
            }
        }
    }

    /// The caller waited for the server: the next one-way call starts a new burst
    /// ([`Inner::write_after_pause`]).
    fn note_waited(&self) {
        if self.write_after_pause {
            self.last_write.store(0, Ordering::Relaxed);
        }
    }

    /// Whether nothing has been written for [`ONEWAY_PAUSE`] (or the caller waited since).
    fn paused(&self) -> bool {
        let now = self.epoch.elapsed().as_nanos() as u64;
        now.saturating_sub(self.last_write.load(Ordering::Relaxed))
            >= ONEWAY_PAUSE.as_nanos() as u64
    }

    /// Writes the queued one-way calls, then the record `chunks` (none if empty), in order.
    fn send(&self, chunks: &[Bytes]) -> Result<(), RpcError> {
        self.send_parts(chunks, &[])
    }

    /// [`Inner::send`] of the record made of `chunks` followed by the borrowed `tail` slices,
    /// which are written as they are, never copied.
    fn send_parts(&self, chunks: &[Bytes], tail: &[&[u8]]) -> Result<(), RpcError> {
        let res = {
            let mut w = lock(&self.writer);
            let queued = {
                let mut q = lock(&self.batch.queue);
                q.bytes = 0;
                std::mem::take(&mut q.records)
            };
            let mut pumping = PumpingWriter {
                inner: self,
                stream: &mut w,
            };
            // Nothing queued and a record of a few parts: no lists to allocate.
            let mut few: [&[u8]; 4] = [&[]; 4];
            let r = if queued.is_empty() && chunks.len() + tail.len() <= few.len() {
                let n = chunks.len() + tail.len();
                for (f, part) in few
                    .iter_mut()
                    .zip(chunks.iter().map(|b| &b[..]).chain(tail.iter().copied()))
                {
                    *f = part;
                }
                if n == 0 {
                    return Ok(());
                }
                write_record_slices(&mut pumping, &[&few[..n]], self.config.max_fragment_size)
            } else {
                self.write_queued_then(&mut pumping, &queued, chunks, tail)
            };
            if self.write_after_pause {
                self.last_write
                    .store(self.epoch.elapsed().as_nanos() as u64, Ordering::Relaxed);
            }
            r
        };
        res.map_err(|e| {
            tracing::debug!(endpoint = %self.endpoint, error = %e, "RPC client: write failed; connection lost");
            self.fail_all();
            RpcError::ConnectionLost
        })
    }

    /// Writes the `queued` one-way calls, then the record of `chunks` and `tail` (none if both
    /// are empty), together.
    fn write_queued_then(
        &self,
        w: &mut impl std::io::Write,
        queued: &[remora_xdr::Chunks],
        chunks: &[Bytes],
        tail: &[&[u8]],
    ) -> std::io::Result<()> {
        // Every record's parts in one list, and each record a slice of it: a few allocations
        // per batch, not one per record.
        let mut parts: Vec<&[u8]> = Vec::with_capacity(
            queued.iter().map(|r| r.len()).sum::<usize>() + chunks.len() + tail.len(),
        );
        let mut ends: Vec<usize> = Vec::with_capacity(queued.len() + 1);
        for r in queued {
            parts.extend(r.iter().map(|b| &b[..]));
            ends.push(parts.len());
        }
        if !chunks.is_empty() || !tail.is_empty() {
            parts.extend(chunks.iter().map(|b| &b[..]).chain(tail.iter().copied()));
            ends.push(parts.len());
        }
        if ends.is_empty() {
            return Ok(());
        }
        let records: Vec<&[&[u8]]> = std::iter::once(0)
            .chain(ends.iter().copied())
            .zip(&ends)
            .map(|(start, &end)| &parts[start..end])
            .collect();
        write_record_slices(w, &records, self.config.max_fragment_size)
    }

    /// Sends a NULL call of `target`'s program as a liveness ping. Its reply, like any record
    /// from the server, shows the server is alive; it is then dropped as a reply nobody waits
    /// for.
    fn ping(&self, target: PingTarget) -> Result<(), RpcError> {
        let xid = self.next_xid.fetch_add(1, Ordering::Relaxed);
        let mut enc = Encoder::with_capacity(64);
        enc.put_u32(xid);
        enc.put_u32(MSG_CALL);
        enc.put_u32(RPC_VERSION);
        enc.put_u32(target.program);
        enc.put_u32(target.version);
        enc.put_u32(0);
        enc.put_raw(&self.auth);
        tracing::debug!(endpoint = %self.endpoint, xid, "RPC client: the server has been silent while calls wait; liveness ping");
        self.send(&enc.finish())
    }

    /// Marks the connection dead, wakes every waiter and shuts the socket down.
    fn fail_all(&self) {
        let mut st = lock(&self.state);
        if !st.dead {
            st.dead = true;
            let _ = self.control.shutdown(Shutdown::Both);
        }
        for slot in st.pending.values() {
            slot.cv.notify_one();
        }
    }

    fn wait(
        &self,
        xid: u32,
        cv: &Condvar,
        timeout: Duration,
        ping: PingTarget,
    ) -> Result<Bytes, RpcError> {
        let start = Instant::now();
        let deadline = start.checked_add(timeout);
        let mut st = lock(&self.state);
        loop {
            let slot = st.pending.get_mut(&xid);
            if let Some(rec) = slot.and_then(|s| s.reply.take()) {
                st.pending.remove(&xid);
                return Ok(rec);
            }
            if st.dead {
                st.pending.remove(&xid);
                return Err(RpcError::ConnectionLost);
            }
            let now = Instant::now();
            let remaining = deadline.map(|d| d.saturating_duration_since(now));
            if remaining == Some(Duration::ZERO) {
                st.pending.remove(&xid);
                return Err(RpcError::Timeout { timeout });
            }
            if !st.leader {
                st.leader = true;
                drop(st);
                let res = self.lead(xid, deadline, ping);
                st = lock(&self.state);
                st.leader = false;
                // Hand the reader role to a caller asleep waiting for its reply. Only such a
                // caller: a call started by a thread that is not waiting for it now (a copy's
                // window of calls, the thread busy with an earlier reply or waiting on
                // another connection) would not wake, and the replies of those asleep would
                // then sit unread until that thread came back — or forever, if it was waiting
                // for them. With none asleep, the next caller to wait takes the role itself.
                if let Some(next) = st
                    .pending
                    .iter()
                    .find(|(k, s)| **k != xid && s.reply.is_none() && s.waiting)
                {
                    next.1.cv.notify_one();
                }
                match res {
                    Lead::Mine(rec) => {
                        st.pending.remove(&xid);
                        return Ok(rec);
                    }
                    Lead::Deadline => {}
                    Lead::Dead(e) => {
                        st.pending.remove(&xid);
                        return Err(e);
                    }
                }
            } else {
                if let Some(s) = st.pending.get_mut(&xid) {
                    s.waiting = true;
                }
                st = match remaining {
                    Some(r) => {
                        cv.wait_timeout(st, r)
                            .unwrap_or_else(PoisonError::into_inner)
                            .0
                    }
                    None => cv.wait(st).unwrap_or_else(PoisonError::into_inner),
                };
                if let Some(s) = st.pending.get_mut(&xid) {
                    s.waiting = false;
                }
            }
        }
    }

    /// Reads replies until `xid`'s arrives, the deadline passes or the connection fails;
    /// with [`ClientConfig::liveness`], pings a silent server and gives up on a hung one.
    fn lead(&self, xid: u32, deadline: Option<Instant>, ping: PingTarget) -> Lead {
        let mut rd = lock(&self.reader);
        let live = self.config.liveness;
        // Silence is counted from when this thread started reading (or last saw a byte).
        let mut heard = Instant::now();
        let mut seen = rd.records.bytes_read();
        let mut pinged = false;
        loop {
            let now = Instant::now();
            if rd.records.bytes_read() != seen {
                seen = rd.records.bytes_read();
                heard = now;
                pinged = false;
            }
            let remaining = match deadline {
                Some(d) => {
                    let r = d.saturating_duration_since(now);
                    if r.is_zero() {
                        return Lead::Deadline;
                    }
                    Some(r)
                }
                None => None,
            };
            let remaining = match live {
                Some(l) => {
                    let silent = now.saturating_duration_since(heard);
                    if silent >= l.dead_after {
                        tracing::error!(endpoint = %self.endpoint, silent = ?silent, "RPC client: the server sent nothing and did not answer a liveness ping; it is hung or unreachable; closing the connection");
                        self.fail_all();
                        return Lead::Dead(RpcError::ServerUnresponsive { silent });
                    }
                    if silent >= l.probe_after && !pinged {
                        pinged = true;
                        if let Err(e) = self.ping(ping) {
                            return Lead::Dead(e);
                        }
                    }
                    // Look again at the next probe or give-up time.
                    let next = if pinged { l.dead_after } else { l.probe_after };
                    let tick = next.saturating_sub(silent).max(Duration::from_millis(1));
                    Some(remaining.map_or(tick, |r| r.min(tick)))
                }
                None => remaining,
            };
            if let Err(e) = rd.adjust_timeout(remaining) {
                tracing::debug!(error = %e, "RPC client: cannot set the read timeout");
                self.fail_all();
                return Lead::Dead(RpcError::Io(e));
            }
            match rd.records.read_record() {
                Ok(Some(rec)) => {
                    // The header starts with the XID and the message type.
                    let word = |i: usize| rec.get(i..i + 4).map(|b| [b[0], b[1], b[2], b[3]]);
                    let mine = word(0).map(u32::from_be_bytes) == Some(xid)
                        && word(4).map(u32::from_be_bytes) == Some(MSG_REPLY);
                    if mine {
                        return Lead::Mine(rec);
                    }
                    self.dispatch(rec);
                }
                Ok(None) => {
                    tracing::debug!(endpoint = %self.endpoint, "RPC client: server closed the connection");
                    self.fail_all();
                    return Lead::Dead(RpcError::ConnectionLost);
                }
                Err(e) if e.is_timeout() => {}
                Err(RecordError::TooLarge { declared, max }) => {
                    tracing::warn!(endpoint = %self.endpoint, declared, max, "RPC client: reply record too large; closing the connection");
                    self.fail_all();
                    return Lead::Dead(RpcError::RecordTooLarge {
                        size: declared,
                        max,
                    });
                }
                Err(e) => {
                    tracing::debug!(endpoint = %self.endpoint, error = %e, "RPC client: connection lost while reading");
                    self.fail_all();
                    return Lead::Dead(RpcError::ConnectionLost);
                }
            }
        }
    }
}

/// TCP keepalive (idle `probe_after`, probes every second, given up after `dead_after`) and
/// `TCP_USER_TIMEOUT` (`dead_after`): the kernel notices a vanished host.
fn set_tcp_liveness(tcp: &std::net::TcpStream, live: Liveness) -> Result<(), RpcError> {
    let sock = socket2::SockRef::from(tcp);
    let interval = Duration::from_secs(1);
    let retries =
        u32::try_from((live.dead_after.saturating_sub(live.probe_after).as_secs()).clamp(1, 60))
            .unwrap_or(10);
    let keepalive = socket2::TcpKeepalive::new()
        .with_time(live.probe_after.max(Duration::from_secs(1)))
        .with_interval(interval)
        .with_retries(retries);
    sock.set_tcp_keepalive(&keepalive)?;
    sock.set_tcp_user_timeout(Some(live.dead_after))?;
    Ok(())
}

impl ReaderState {
    /// Sets the socket read timeout to about `remaining`, skipping the system call when the
    /// current setting is close enough (a slightly early wake-up just loops).
    fn adjust_timeout(&mut self, remaining: Option<Duration>) -> std::io::Result<()> {
        let keep = match (self.timeout, remaining) {
            (None, None) => true,
            (Some(cur), Some(rem)) => {
                let slack = Duration::from_millis(1) + rem / 1000;
                cur <= rem + slack && cur >= rem / 2
            }
            _ => false,
        };
        if !keep {
            self.records.get_ref().set_read_timeout(remaining)?;
            self.timeout = remaining;
        }
        Ok(())
    }
}
