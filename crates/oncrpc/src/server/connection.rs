//! One connection: reading call records, sending replies inline or through the shared
//! [`ReplySink`], deferred replies, one-way calls, and the move into shared memory.

use std::fmt;
use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use remora_xdr::{Bytes, Encoder, XdrEncode};

use super::dispatch::{ConnectionAuth, ConnectionInfo, Outcome, Registry, admitted, process_call};
use super::profile::{Profile, ProfileReport};
use super::{Origin, ServerConfig, lock};
use crate::endpoint::Stream;
use crate::msg::{AcceptStat, RpcMsg};
use crate::record::{RecordError, RecordReader, write_record};
use crate::shm::Setup;
use crate::spin::Spinning;
#[cfg(doc)]
use crate::{CallContext, Service};
use crate::{Peer, RpcError, xdr};
use remora_shm::{DataArea, ShmStream};

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

    /// Reads what has arrived without waiting (`Some(Err(WouldBlock))` when nothing has), so
    /// that a read can poll before it blocks ([`crate::spin::Spinning`]); `None` for streams
    /// that wait their own way (shared memory) or never wait (in memory).
    fn try_read(&mut self, _buf: &mut [u8]) -> Option<io::Result<usize>> {
        None
    }

    /// Something that shuts the connection down from any thread (the connection thread's
    /// read then ends), for a reply that cannot be delivered; `None` for in-memory streams.
    fn closer(&self) -> Option<Arc<dyn Fn() + Send + Sync>> {
        None
    }

    /// Asks the kernel to stamp what arrives (TCP: `SO_TIMESTAMPNS`), for
    /// [`Transport::read_stamped`]; other streams ignore it.
    fn stamp_arrivals(&self) {}

    /// A read that also tells how long ago (at most) the bytes arrived, when the stream knows:
    /// a read that blocked learns its own wake-up lag, which [`crate::spin::Spinning`] keeps
    /// out of its spin budget. `None`: not known (the default).
    fn read_stamped(&mut self, buf: &mut [u8]) -> io::Result<(usize, Option<Duration>)> {
        self.read(buf).map(|n| (n, None))
    }

    /// Has the next read that must wait spin first for at least `spin`, for streams that wait
    /// their own way (shared memory: [`ShmStream::hold_next_read`]); others ignore it (socket
    /// reads are held by [`crate::spin::Spinning`] itself).
    fn hold_next_read(&self, _spin: Duration) {}

    /// The CPU the peer last took a reply on, where it says it (shared memory, for placement
    /// and traces: [`ShmStream::peer_cpu`]); `None` otherwise.
    fn peer_cpu(&self) -> Option<u32> {
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

    fn try_read(&mut self, buf: &mut [u8]) -> Option<io::Result<usize>> {
        (**self).try_read(buf)
    }

    fn closer(&self) -> Option<Arc<dyn Fn() + Send + Sync>> {
        (**self).closer()
    }

    fn stamp_arrivals(&self) {
        (**self).stamp_arrivals()
    }

    fn read_stamped(&mut self, buf: &mut [u8]) -> io::Result<(usize, Option<Duration>)> {
        (**self).read_stamped(buf)
    }

    fn hold_next_read(&self, spin: Duration) {
        (**self).hold_next_read(spin)
    }

    fn peer_cpu(&self) -> Option<u32> {
        (**self).peer_cpu()
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

    fn try_read(&mut self, buf: &mut [u8]) -> Option<io::Result<usize>> {
        Stream::try_read(self, buf)
    }

    fn closer(&self) -> Option<Arc<dyn Fn() + Send + Sync>> {
        let s = self.try_clone().ok()?;
        Some(Arc::new(move || {
            let _ = s.shutdown(std::net::Shutdown::Both);
        }))
    }

    fn stamp_arrivals(&self) {
        if let Stream::Tcp(s) = self
            && let Err(e) = remora_sockstamp::enable(s)
        {
            tracing::debug!(error = %e, "SO_TIMESTAMPNS refused; socket waits learn their wake-ups");
        }
    }

    fn read_stamped(&mut self, buf: &mut [u8]) -> io::Result<(usize, Option<Duration>)> {
        match self {
            Stream::Tcp(s) => remora_sockstamp::read(s, buf),
            _ => self.read(buf).map(|n| (n, None)),
        }
    }

    fn hold_next_read(&self, spin: Duration) {
        if let Stream::Shm(s) = self {
            s.hold_next_read(spin);
        }
    }

    fn peer_cpu(&self) -> Option<u32> {
        match self {
            Stream::Shm(s) => s.peer_cpu(),
            _ => None,
        }
    }
}

/// The writing half of a connection, shared by its thread and its deferred replies. Every
/// reply is written whole under the lock, so replies never interleave. `None` once the
/// connection has ended: later replies are dropped.
///
/// A reply that cannot be written (the peer stopped reading for the write timeout, or went
/// away) ends the connection: the sink drops its writer and shuts the connection down, so
/// that the connection thread stops and the services free what the connection held. A peer
/// that does not read its replies is disconnected, not merely logged.
///
/// One reference count for all of it: every call's context holds a clone (for
/// [`CallContext::defer`]), so a clone is one atomic increment, not one per part.
#[derive(Clone)]
pub(crate) struct ReplySink(Arc<SinkShared>);

/// What the clones of a [`ReplySink`] share.
pub(crate) struct SinkShared {
    writer: Mutex<Option<Box<dyn Write + Send>>>,
    max_fragment_size: usize,
    closer: Option<Arc<dyn Fn() + Send + Sync>>,
    /// Deferred replies not yet sent: calls in flight, which keep the connection from being
    /// idle.
    in_flight: std::sync::atomic::AtomicUsize,
    /// Nanoseconds the connection's next wait for a call spins first at least, asked by a
    /// service ([`CallContext::hold_next_read`]) and taken by the connection thread before
    /// its next read; 0: none.
    pub(crate) read_hold_ns: std::sync::atomic::AtomicU64,
}

impl std::ops::Deref for ReplySink {
    type Target = SinkShared;
    fn deref(&self) -> &SinkShared {
        &self.0
    }
}

impl fmt::Debug for ReplySink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ReplySink").finish_non_exhaustive()
    }
}

impl ReplySink {
    fn send(&self, chunks: &[Bytes]) -> io::Result<()> {
        let mut guard = lock(&self.writer);
        let sent = match guard.as_mut() {
            Some(w) => write_record(w, chunks, self.max_fragment_size),
            None => {
                return Err(io::Error::new(
                    io::ErrorKind::NotConnected,
                    "the connection has ended",
                ));
            }
        };
        if let Err(e) = &sent {
            // Part of a record may have gone out: nothing more can be sent on this stream.
            guard.take();
            drop(guard);
            crate::audit!(warn, limit "stall_timeout", error = %e, "ONC RPC server: a reply could not be written (the peer does not read its replies, or is gone); connection closed");
            self.shut_down();
        }
        sent
    }

    /// Shuts the connection down: its thread stops reading and ends it.
    pub(crate) fn shut_down(&self) {
        if let Some(close) = &self.closer {
            close();
        }
    }

    /// Whether a deferred reply is outstanding.
    fn busy(&self) -> bool {
        self.in_flight.load(Ordering::Acquire) > 0
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
        sink.in_flight.fetch_add(1, Ordering::AcqRel);
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
        let _done = InFlight(&sink);
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

/// Counts a deferred reply as answered when dropped.
struct InFlight<'a>(&'a ReplySink);

impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.in_flight.fetch_sub(1, Ordering::AcqRel);
    }
}

impl Drop for DeferredReply {
    fn drop(&mut self) {
        if let Some(sink) = self.sink.take() {
            let _done = InFlight(&sink);
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
/// it ([`Service::connection_closed`]). `origin` says whether it came over TLS (no shared
/// memory then) and the tenant its client certificate authenticated; `since` is when it was
/// accepted, from which its HELLO deadline counts.
#[expect(
    clippy::too_many_arguments,
    reason = "the connection's state, passed down once per connection"
)]
pub(crate) fn serve_connection<S: Transport>(
    stream: S,
    peer: &Peer,
    connection: u64,
    registry: &Registry,
    config: &ServerConfig,
    shutting_down: &AtomicBool,
    origin: &Origin,
    since: Instant,
) {
    let sink = stream.shared_writer().map(|w| {
        ReplySink(Arc::new(SinkShared {
            writer: Mutex::new(Some(w)),
            max_fragment_size: config.max_fragment_size,
            closer: stream.closer(),
            in_flight: Default::default(),
            read_hold_ns: Default::default(),
        }))
    });
    let auth = ConnectionAuth::default();
    if let Some(tenant) = &origin.tenant {
        let _ = auth.set(tenant.clone());
    }
    let mut opened = Opened {
        since,
        first_call: false,
        auth,
        tls: origin.tls,
    };
    macro_rules! serve {
        ($stream:expr, $area:expr) => {
            serve_records(
                $stream,
                peer,
                connection,
                sink.as_ref(),
                registry,
                config,
                shutting_down,
                $area,
                &mut opened,
            )
        };
    }
    if let Some(shm) = serve!(stream, None) {
        tracing::debug!(%peer, connection, "ONC RPC server: connection moved into shared memory");
        // Same connection, same services and sink (already writing to the rings).
        let area = Some(shm.region().data_area()).filter(|a| !a.is_empty());
        serve!(Stream::Shm(shm), area);
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

/// Whether a connection has been served its first call yet, and since when it exists: before
/// its first call (for Remora, HELLO) a connection is held to [`ServerConfig::hello_timeout`]
/// and [`ServerConfig::max_first_record_size`]. When the server requires authentication
/// ([`ServerConfig::auth_open_procedures`]) the first call is the one that authenticated it:
/// until then the connection stays held, whatever open calls (NULL) it makes.
struct Opened {
    since: Instant,
    first_call: bool,
    /// Who the connection authenticated as; kept across the move into shared memory.
    auth: ConnectionAuth,
    /// It came over TLS: never offered shared memory.
    tls: bool,
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
    opened: &mut Opened,
) -> Option<ShmStream> {
    let mut tick = match config.idle_timeout {
        Some(idle) => idle.min(config.stall_timeout),
        None => config.stall_timeout,
    };
    if !opened.first_call {
        tick = tick.min(config.hello_timeout);
    }
    // The trickle check below needs a look at least every second or so.
    let tick = tick
        .min(Duration::from_secs(1))
        .max(Duration::from_millis(1));
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
    let first_max = config
        .max_first_record_size
        .map_or(config.max_record_size, |m| m.min(config.max_record_size));
    let spinning = Spinning::new(stream);
    spinning.note_read_timeout(Some(tick));
    let mut reader = RecordReader::new(
        Paced {
            inner: spinning,
            yield_at: remora_shm::coarse_now() + tick,
            forced: false,
        },
        if opened.first_call {
            config.max_record_size
        } else {
            first_max
        },
    )
    .with_budget(std::sync::Arc::clone(&config.record_budget));
    let mut last_progress = Instant::now();
    let mut seen = 0u64;
    // Where the record in progress began: the bytes read when the last record ended, and
    // about when its first byte was seen (within a tick).
    let mut record_base = 0u64;
    let mut record_since: Option<Instant> = None;
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
        reader.get_mut().yield_at = remora_shm::coarse_now() + tick;
        // A plain load first: most calls ask no hold, and a swap would write the line.
        if let Some(s) = sink
            && s.read_hold_ns.load(Ordering::Relaxed) != 0
        {
            let hold = s.read_hold_ns.swap(0, Ordering::Relaxed);
            reader.get_mut().inner.hold_next(Duration::from_nanos(hold));
        }
        let read = reader.read_record();
        if let (Some(p), Some(t)) = (profile.as_mut(), read_start) {
            p.reading += t.elapsed();
        }
        match read {
            Ok(Some(record)) => {
                // Off the core the client said it last ran on, before serving what it
                // asked (unless REMORA_SERVE_AVOID_PEER_CPU=0; issue 12 §4).
                if remora_shm::avoid_peer_cpu() {
                    remora_shm::avoid_cpu(reader.get_ref().inner.inner.peer_cpu());
                }
                last_progress = Instant::now();
                seen = reader.bytes_read();
                record_base = seen;
                record_since = None;
                let key = profile.as_ref().map(|_| Profile::key(&record));
                let open = config.auth_open_procedures.as_deref();
                // Before authentication SHM_SETUP is not served (no region for a stranger):
                // the record goes to `process_call`, which refuses it like any closed call.
                let setup = if !opened.tls
                    && admitted(
                        open,
                        &opened.auth,
                        crate::shm::SHM_PROGRAM,
                        crate::shm::SHM_SETUP,
                    ) {
                    crate::shm::setup_request(&record)
                } else {
                    None
                };
                let outcome = match setup {
                    Some(req) => match crate::shm::serve_setup(
                        &req,
                        reader.get_ref().inner.inner.unix_socket(),
                        peer,
                        !reader.in_record(),
                        config.shm_ring_capacity,
                        config.shm_data_bytes,
                    ) {
                        Setup::Refuse(reply) => Outcome::Reply(reply),
                        Setup::Accept { reply, stream } => {
                            return grant_shm(
                                &reader.get_ref().inner.inner,
                                peer,
                                sink,
                                &reply,
                                stream,
                            );
                        }
                    },
                    None => {
                        let info = ConnectionInfo {
                            peer,
                            connection,
                            sink,
                            area: area.as_ref(),
                            auth: &opened.auth,
                            open,
                        };
                        let outcome = process_call(record, &info, registry);
                        if !opened.first_call
                            && matches!(outcome, Outcome::Reply(_) | Outcome::NoReply)
                            && (open.is_none() || opened.auth.get().is_some())
                        {
                            // The connection said HELLO (or made any other call), and
                            // authenticated where that is required: records up to the full
                            // size from now on.
                            opened.first_call = true;
                            reader.set_max_record_size(config.max_record_size);
                        }
                        outcome
                    }
                };
                if let (Some(p), Some(k)) = (profile.as_mut(), key) {
                    p.call(k, last_progress.elapsed());
                }
                let close_after = matches!(outcome, Outcome::ReplyThenClose(_));
                match outcome {
                    Outcome::Reply(chunks) | Outcome::ReplyThenClose(chunks) => {
                        let send_start = profile.as_ref().map(|_| Instant::now());
                        let sent = match sink {
                            Some(sink) => sink.send(&chunks),
                            None => write_record(
                                &mut reader.get_mut().inner.inner,
                                &chunks,
                                config.max_fragment_size,
                            ),
                        };
                        if let (Some(p), Some(t)) = (profile.as_mut(), send_start) {
                            p.replying += t.elapsed();
                        }
                        if let Err(e) = sent {
                            tracing::debug!(%peer, error = %e, "ONC RPC server: cannot send a reply; connection closed");
                            return None;
                        }
                        if close_after {
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
                let forced = std::mem::take(&mut reader.get_mut().forced);
                if reader.bytes_read() != seen {
                    seen = reader.bytes_read();
                    last_progress = if forced {
                        // Bytes kept arriving until the tick was up.
                        now
                    } else {
                        // Bytes arrived during this read, then nothing for a whole tick.
                        now.checked_sub(tick).unwrap_or(now)
                    };
                }
                let quiet = now.saturating_duration_since(last_progress);
                if !opened.first_call
                    && now.saturating_duration_since(opened.since) >= config.hello_timeout
                {
                    crate::audit!(info, limit "hello_timeout", %peer, timeout = ?config.hello_timeout, "ONC RPC server: no first call (HELLO) within hello_timeout; connection closed");
                    return None;
                }
                if reader.in_record() {
                    if quiet >= config.stall_timeout {
                        crate::audit!(warn, limit "stall_timeout", %peer, stalled = ?quiet, buffered = reader.buffered_record_bytes(), "ONC RPC server: partial record stalled past stall_timeout; connection closed");
                        return None;
                    }
                    // A trickle (slowloris): bytes keep coming, too few to ever finish.
                    let since = *record_since.get_or_insert(now);
                    let got = reader.bytes_read().saturating_sub(record_base);
                    let allowed = config.stall_timeout
                        + Duration::from_secs_f64(
                            got as f64 / config.min_record_rate.max(1) as f64,
                        );
                    let took = now.saturating_duration_since(since);
                    if took > allowed {
                        crate::audit!(warn, limit "min_record_rate", %peer, took = ?took, received = got, min_rate = config.min_record_rate, "ONC RPC server: a record arrives slower than min_record_rate bytes/s; connection closed");
                        return None;
                    }
                } else if config.idle_timeout.is_some_and(|idle| quiet >= idle)
                    && !sink.is_some_and(ReplySink::busy)
                {
                    tracing::debug!(%peer, "ONC RPC server: idle timeout; connection closed");
                    return None;
                }
            }
            Err(RecordError::TooLarge { declared, max }) => {
                if opened.first_call {
                    crate::audit!(warn, limit "max_record_size", %peer, declared, max, "ONC RPC server: call record exceeds max_record_size; connection closed");
                } else {
                    crate::audit!(warn, limit "max_first_record_size", %peer, declared, max, "ONC RPC server: a record before the connection's first call (HELLO) exceeds max_first_record_size; connection closed");
                }
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

/// The connection's stream as its record reader sees it: a read after `yield_at` fails with
/// `TimedOut` without reading (the reader keeps its partial record), so that the connection
/// thread looks at its deadlines at least once a tick even while bytes trickle in: a socket's
/// read timeout only fires when nothing at all arrives.
struct Paced<S> {
    inner: S,
    /// On the coarse clock ([`remora_shm::coarse_now`]): read on every call's record, where a
    /// precise clock read cost more than its share, for a tick of a millisecond or more.
    yield_at: Duration,
    /// Set when a read was refused for the time (not a real timeout).
    forced: bool,
}

impl<S: Read> Read for Paced<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if remora_shm::coarse_now() >= self.yield_at {
            self.forced = true;
            return Err(io::ErrorKind::TimedOut.into());
        }
        self.inner.read(buf)
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
