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

use super::dispatch::{Outcome, Registry, process_call};
use super::profile::{Profile, ProfileReport};
use super::{ServerConfig, lock};
use crate::endpoint::Stream;
use crate::msg::{AcceptStat, RpcMsg};
use crate::record::{RecordError, RecordReader, write_record};
use crate::shm::Setup;
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
