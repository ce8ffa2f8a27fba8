//! The pump: one thread per TLS connection that moves bytes between the TCP socket
//! (ciphertext, through rustls) and its end of a Unix socket pair (plaintext).
//!
//! Both sockets are non-blocking and waited on together with `poll`. Each direction has a
//! bounded buffer and stops reading its source while the buffer is full, so a side that
//! does not read holds back the other (backpressure) instead of growing memory. End of file
//! travels both ways: the TLS peer's close (close_notify, or TCP EOF) shuts down writing on
//! the plaintext socket, and the plaintext side's close sends close_notify and shuts down
//! writing on TCP. The thread ends once the plaintext side has closed and close_notify has
//! gone out (what the TLS peer sends after could no longer be delivered), or on any error,
//! closing both sockets. TLS output that the TCP peer does not take for `stall` also ends it (a peer
//! that does not read); input that the plaintext side does not take is only backpressure (a
//! server thread busy in a long call).

use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, TcpStream};
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Bytes of plaintext buffered in each direction (and rustls' limit on encrypted output
/// waiting for the socket).
const BUFFER: usize = 256 << 10;

/// Writes to a socket without raising SIGPIPE when the peer is gone (`MSG_NOSIGNAL`): the
/// client side runs inside programs that may not ignore it. Reads pass through.
pub(crate) struct NoSigPipe<'a, S>(pub(crate) &'a mut S);

impl<S: Read> Read for NoSigPipe<'_, S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        self.0.read(buf)
    }
}

impl<S: AsFd> Write for NoSigPipe<'_, S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        rustix::net::send(&*self.0, buf, rustix::net::SendFlags::NOSIGNAL).map_err(io::Error::from)
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        rustix::net::sendmsg(
            &*self.0,
            bufs,
            &mut rustix::net::SendAncillaryBuffer::default(),
            rustix::net::SendFlags::NOSIGNAL,
        )
        .map_err(io::Error::from)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Starts the pump of the established connection `conn` on `tcp`; returns the plaintext
/// socket to use in its place and the pump's thread, which ends once both directions are
/// closed (or on an error), having closed `tcp`. `label` names the connection in logs; on a
/// client, a TLS error from the server (an alert: e.g. a refused client certificate, which
/// TLS 1.3 reports only after the client's handshake is done) is logged as a warning that
/// says what to check, since the program above sees only a closed connection.
pub(crate) fn spawn_pump(
    mut conn: rustls::Connection,
    tcp: TcpStream,
    stall: Duration,
    label: String,
) -> io::Result<(UnixStream, JoinHandle<()>)> {
    let (ours, theirs) = UnixStream::pair()?;
    crate::endpoint::widen_unix_buffers(&ours);
    crate::endpoint::widen_unix_buffers(&theirs);
    ours.set_nonblocking(true)?;
    tcp.set_nonblocking(true)?;
    tcp.set_read_timeout(None)?;
    tcp.set_write_timeout(None)?;
    conn.set_buffer_limit(Some(BUFFER));
    let client = matches!(conn, rustls::Connection::Client(_));
    let handle = std::thread::Builder::new()
        .name("oncrpc-tls".into())
        .spawn(move || {
            let mut pump = Pump {
                conn,
                tcp,
                plain: ours,
                up: Buffer::new(),
                down: Buffer::new(),
                reader_empty: false,
                tcp_eof: false,
                tls_done: false,
                plain_done: false,
                up_shut: false,
                down_shut: false,
                tcp_shut: false,
                blocked_since: None,
                stall,
            };
            match pump.run() {
                Ok(()) => tracing::trace!(%label, "TLS connection closed"),
                Err(e) => match e.get_ref().and_then(|e| e.downcast_ref::<rustls::Error>()) {
                    Some(tls) if client => tracing::warn!(
                        "remora: the TLS connection to {label} failed: {tls}{}",
                        super::hint(tls, false)
                    ),
                    _ => tracing::debug!(%label, error = %e, "TLS connection ended"),
                },
            }
            let _ = pump.tcp.shutdown(Shutdown::Both);
            let _ = pump.plain.shutdown(Shutdown::Both);
        })?;
    Ok((theirs, handle))
}

/// A bounded byte buffer: `data[at..len]` waits to be written.
struct Buffer {
    data: Box<[u8]>,
    at: usize,
    len: usize,
}

impl Buffer {
    fn new() -> Self {
        Self {
            data: vec![0; BUFFER].into_boxed_slice(),
            at: 0,
            len: 0,
        }
    }

    fn is_empty(&self) -> bool {
        self.at == self.len
    }

    fn pending(&self) -> &[u8] {
        &self.data[self.at..self.len]
    }

    fn consume(&mut self, n: usize) {
        self.at += n;
        if self.at == self.len {
            self.at = 0;
            self.len = 0;
        }
    }

    /// Free room at the end, after moving pending bytes to the front when that makes room.
    fn room(&mut self) -> &mut [u8] {
        if self.at > 0 && self.len == self.data.len() {
            self.data.copy_within(self.at..self.len, 0);
            self.len -= self.at;
            self.at = 0;
        }
        &mut self.data[self.len..]
    }

    fn has_room(&self) -> bool {
        self.len < self.data.len() || self.at > 0
    }
}

struct Pump {
    conn: rustls::Connection,
    tcp: TcpStream,
    plain: UnixStream,
    /// Plaintext from the TLS peer, waiting for the plaintext socket.
    up: Buffer,
    /// Plaintext from the plaintext socket, waiting for rustls to take it.
    down: Buffer,
    /// rustls holds no received plaintext (reading TCP again is safe: rustls refuses input
    /// while its plaintext buffer is full).
    reader_empty: bool,
    /// TCP gave end of file.
    tcp_eof: bool,
    /// No more plaintext will come from the TLS peer.
    tls_done: bool,
    /// No more plaintext will come from the plaintext socket.
    plain_done: bool,
    /// Writing on the plaintext socket has been shut down (after `tls_done`).
    up_shut: bool,
    /// close_notify has been queued (after `plain_done`).
    down_shut: bool,
    /// Writing on TCP has been shut down (after close_notify went out).
    tcp_shut: bool,
    /// Since when TLS output has waited for a TCP peer that takes none.
    blocked_since: Option<Instant>,
    stall: Duration,
}

impl Pump {
    fn run(&mut self) -> io::Result<()> {
        use rustix::event::{PollFd, PollFlags, Timespec, poll};
        loop {
            let mut moved = self.tls_to_up()?;
            moved |= self.up_to_plain()?;
            moved |= self.plain_to_tls()?;
            moved |= self.tls_to_tcp()?;
            moved |= self.tcp_to_tls()?;
            // Once the plaintext side has closed and close_notify has gone out, nothing the
            // TLS peer still sends could be delivered: done, without waiting for its close
            // (a client that keeps its connection open must not hold a server's shutdown).
            if self.tcp_shut {
                return Ok(());
            }
            if let Some(since) = self.blocked_since
                && since.elapsed() >= self.stall
            {
                return Err(io::Error::new(
                    io::ErrorKind::TimedOut,
                    format!(
                        "the TLS peer took no data for {:?} (it does not read)",
                        self.stall
                    ),
                ));
            }
            if moved {
                continue;
            }
            let mut tcp_events = PollFlags::empty();
            if !self.tls_done && !self.tcp_eof && self.reader_empty && self.up.has_room() {
                tcp_events |= PollFlags::IN;
            }
            if self.conn.wants_write() {
                tcp_events |= PollFlags::OUT;
            }
            let mut plain_events = PollFlags::empty();
            if !self.plain_done && self.down.is_empty() {
                plain_events |= PollFlags::IN;
            }
            if !self.up.is_empty() {
                plain_events |= PollFlags::OUT;
            }
            // A socket with nothing asked of it stays out of the set: its hang-up would
            // otherwise wake the poll at once, again and again.
            let mut fds = Vec::with_capacity(2);
            if !tcp_events.is_empty() {
                fds.push(PollFd::new(&self.tcp, tcp_events));
            }
            if !plain_events.is_empty() {
                fds.push(PollFd::new(&self.plain, plain_events));
            }
            if fds.is_empty() {
                return Err(io::Error::other("the TLS pump has nothing to wait for"));
            }
            let tick = Timespec {
                tv_sec: 1,
                tv_nsec: 0,
            };
            match poll(&mut fds, Some(&tick)) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
    }

    /// Moves received plaintext out of rustls into `up`.
    fn tls_to_up(&mut self) -> io::Result<bool> {
        let mut moved = false;
        self.reader_empty = false;
        while !self.tls_done && self.up.has_room() {
            let room = self.up.room();
            match self.conn.reader().read(room) {
                Ok(0) => {
                    self.tls_done = true;
                    moved = true;
                }
                Ok(n) => {
                    self.up.len += n;
                    moved = true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if self.tcp_eof {
                        self.tls_done = true;
                        moved = true;
                    } else {
                        self.reader_empty = true;
                    }
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::UnexpectedEof => {
                    // TCP closed without close_notify: record marking above notices a cut
                    // record, so this is an ordinary end of file here.
                    self.tls_done = true;
                    moved = true;
                }
                Err(e) => return Err(e),
            }
        }
        Ok(moved)
    }

    /// Writes `up` to the plaintext socket; shuts its writing down once the TLS peer is done.
    fn up_to_plain(&mut self) -> io::Result<bool> {
        let mut moved = false;
        while !self.up.is_empty() {
            match rustix::net::send(
                &self.plain,
                self.up.pending(),
                rustix::net::SendFlags::NOSIGNAL,
            ) {
                Ok(n) => {
                    self.up.consume(n);
                    moved = true;
                }
                Err(rustix::io::Errno::AGAIN) => break,
                Err(rustix::io::Errno::INTR) => {}
                Err(e) => return Err(e.into()),
            }
        }
        if self.up.is_empty() && self.tls_done && !self.up_shut {
            let _ = self.plain.shutdown(Shutdown::Write);
            self.up_shut = true;
            moved = true;
        }
        Ok(moved)
    }

    /// Reads the plaintext socket into `down` and hands `down` to rustls; queues close_notify
    /// once the plaintext side is done.
    fn plain_to_tls(&mut self) -> io::Result<bool> {
        let mut moved = false;
        loop {
            if !self.down.is_empty() {
                let n = self.conn.writer().write(self.down.pending())?;
                if n == 0 {
                    break;
                }
                self.down.consume(n);
                moved = true;
                continue;
            }
            if self.plain_done {
                break;
            }
            match (&self.plain).read(self.down.room()) {
                Ok(0) => {
                    self.plain_done = true;
                    moved = true;
                }
                Ok(n) => {
                    self.down.len += n;
                    moved = true;
                }
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if self.plain_done && self.down.is_empty() && !self.down_shut {
            self.conn.send_close_notify();
            self.down_shut = true;
            moved = true;
        }
        Ok(moved)
    }

    /// Writes rustls' output to TCP; shuts TCP's writing down after close_notify went out.
    fn tls_to_tcp(&mut self) -> io::Result<bool> {
        let mut moved = false;
        while self.conn.wants_write() {
            match self.conn.write_tls(&mut NoSigPipe(&mut self.tcp)) {
                Ok(0) => break,
                Ok(_) => moved = true,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => break,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) => return Err(e),
            }
        }
        if self.conn.wants_write() {
            if moved || self.blocked_since.is_none() {
                self.blocked_since = Some(Instant::now());
            }
        } else {
            self.blocked_since = None;
            if self.down_shut && !self.tcp_shut {
                let _ = self.tcp.shutdown(Shutdown::Write);
                self.tcp_shut = true;
                moved = true;
            }
        }
        Ok(moved)
    }

    /// Reads TCP into rustls and decrypts, while there is room for the plaintext.
    fn tcp_to_tls(&mut self) -> io::Result<bool> {
        if self.tls_done || self.tcp_eof || !self.reader_empty || !self.up.has_room() {
            return Ok(false);
        }
        match self.conn.read_tls(&mut self.tcp) {
            Ok(0) => self.tcp_eof = true,
            Ok(_) => {}
            Err(e) if e.kind() == io::ErrorKind::WouldBlock => return Ok(false),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => return Ok(false),
            Err(e) => return Err(e),
        }
        if let Err(e) = self.conn.process_new_packets() {
            // Send the alert rustls queued, best effort, then end.
            let _ = self.conn.write_tls(&mut NoSigPipe(&mut self.tcp));
            return Err(io::Error::new(io::ErrorKind::InvalidData, e));
        }
        self.reader_empty = false;
        Ok(true)
    }
}
