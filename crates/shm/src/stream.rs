//! [`ShmStream`]: a byte stream (`Read` + `Write`) over a region's two rings, so that a
//! record-marked ONC RPC connection can move from its Unix socket into shared memory with
//! nothing above the stream noticing.
//!
//! ```text
//!   client                                   server
//!   write ─► chunks ≤ max_chunk ─► request ring ─► read (leftovers kept)
//!   read  ◄─ (leftovers kept)  ◄─ response ring ◄─ chunks ◄─ write
//!   Unix socket of the session: silent, polled for liveness (HUP/EOF = the peer is gone)
//! ```
//!
//! Writes are cut into ring messages of at most a quarter of the ring, so that a large record
//! streams through while the peer drains it. Reads return the bytes of the next message,
//! keeping what does not fit for the next read. Both wait with a [`Waiter`] (spin, then a
//! futex sleep in slices of 50 ms); after each sleep an empty ring makes them ask the
//! session's Unix socket whether the peer is still there, so a dead peer is an end of file
//! (reads) or a broken pipe (writes) within a slice, never a hang. Read and write timeouts
//! behave like the socket options: `WouldBlock` when nothing could be done in time.

use std::io::{self, IoSlice, Read, Write};
use std::os::unix::net::UnixStream;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags};

use crate::region::Region;
use crate::ring::{Consumer, Producer, RingError, SLEEP_SLICE};
use crate::wait::Waiter;

/// Shortest spin before a side sleeps.
const MIN_SPIN: Duration = Duration::from_micros(2);
/// Longest spin before a side sleeps: a colocated round trip well within this is caught
/// spinning; anything slower costs a futex wake-up rather than a core.
const MAX_SPIN: Duration = Duration::from_micros(50);

/// Which side of the session this end is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Side {
    /// Writes requests, reads responses.
    Client,
    /// Reads requests, writes responses.
    Server,
}

struct Tx {
    ring: Producer,
    waiter: Waiter,
}

struct Rx {
    ring: Consumer,
    waiter: Waiter,
    /// The message being read: `msg[pos..]` is still to be handed out.
    msg: Vec<u8>,
    pos: usize,
    /// A corrupt ring stays corrupt.
    failed: bool,
}

struct Conn {
    region: Region,
    side: Side,
    tx: Mutex<Tx>,
    rx: Mutex<Rx>,
    /// The session's Unix socket: nothing travels on it any more, it only tells liveness.
    socket: UnixStream,
    read_closed: AtomicBool,
    write_closed: AtomicBool,
    /// Nanoseconds; `u64::MAX`: none.
    read_timeout: AtomicU64,
    write_timeout: AtomicU64,
    max_chunk: usize,
    /// A watcher thread waits on a duplicate of `socket` ([`ShmStream::watch_peer`]).
    watched: AtomicBool,
    /// Set when [`Conn::alive`] found the peer gone (the watcher stops waking then).
    gone_seen: AtomicBool,
    /// A message written since the last read had to wake the peer.
    woke_peer: AtomicBool,
    /// The peer's usual wake-up lag ([`Consumer::peer_lag`]), kept by reads.
    peer_lag_ns: AtomicU64,
    /// How late the last read noticed its message; said with the next write only
    /// ([`Producer::set_next_lag`]).
    answer_lag: AtomicU64,
}

impl Drop for Conn {
    fn drop(&mut self) {
        // The watcher's duplicate of the socket would keep the session open for the peer:
        // ending our reading makes its poll return, and it exits and closes it.
        if self.watched.load(Ordering::Relaxed) {
            let _ = self.socket.shutdown(std::net::Shutdown::Read);
        }
    }
}

/// One end of a shared-memory session as a byte stream. Clones share the end: reads of all
/// clones consume one stream, writes of all clones produce one stream (each call is atomic
/// with respect to the other clones).
#[derive(Clone)]
pub struct ShmStream {
    conn: Arc<Conn>,
}

impl std::fmt::Debug for ShmStream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ShmStream")
            .field("side", &self.conn.side)
            .field("layout", &self.conn.region.layout())
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn to_nanos(t: Option<Duration>) -> u64 {
    t.map_or(u64::MAX, |d| d.as_nanos().min(u64::MAX as u128 - 1) as u64)
}

fn deadline(nanos: u64) -> Option<Instant> {
    (nanos != u64::MAX).then(|| Instant::now() + Duration::from_nanos(nanos))
}

impl ShmStream {
    /// This side's end of the session in `region`, whose liveness `socket` (the session's
    /// Unix socket, on which nothing more is sent) tells.
    pub fn new(region: Region, socket: UnixStream, side: Side) -> Self {
        let (tx, rx) = match side {
            Side::Client => (region.request_producer(), region.response_consumer()),
            Side::Server => (region.response_producer(), region.request_consumer()),
        };
        let max_chunk = (tx.capacity() as usize / 4).saturating_sub(4).max(4);
        let (tx_label, rx_label) = match side {
            Side::Client => ("shm client: room for a request", "shm client: a reply"),
            Side::Server => ("shm server: room for a reply", "shm server: a request"),
        };
        Self {
            conn: Arc::new(Conn {
                side,
                rx: Mutex::new(Rx {
                    ring: rx,
                    waiter: Waiter::new(MIN_SPIN, MAX_SPIN).labeled(rx_label),
                    msg: Vec::new(),
                    pos: 0,
                    failed: false,
                }),
                tx: Mutex::new(Tx {
                    ring: tx,
                    waiter: Waiter::new(MIN_SPIN, MAX_SPIN).labeled(tx_label),
                }),
                region,
                socket,
                read_closed: AtomicBool::new(false),
                write_closed: AtomicBool::new(false),
                read_timeout: AtomicU64::new(u64::MAX),
                write_timeout: AtomicU64::new(u64::MAX),
                max_chunk,
                watched: AtomicBool::new(false),
                gone_seen: AtomicBool::new(false),
                woke_peer: AtomicBool::new(false),
                peer_lag_ns: AtomicU64::new(0),
                answer_lag: AtomicU64::new(0),
            }),
        }
    }

    /// Watches the session's Unix socket from a thread of its own, blocked in `poll`, and
    /// wakes this end's waits as soon as the peer is gone (its process ended or it closed the
    /// session): a reader then ends at once instead of at its next sleep slice (50 ms), so a
    /// server frees a finished program's session, and `remora run` returns, that much
    /// sooner. The thread ends with the peer or when this end is dropped.
    pub fn watch_peer(&self) -> io::Result<()> {
        let socket = self.conn.socket.try_clone()?;
        let wakers = (
            lock(&self.conn.rx).ring.waker(),
            lock(&self.conn.tx).ring.waker(),
        );
        let conn = Arc::downgrade(&self.conn);
        self.conn.watched.store(true, Ordering::Relaxed);
        std::thread::Builder::new()
            .name("shm-peer-watch".into())
            .spawn(move || {
                // Nothing is sent on the socket any more: any input or hang-up is its end
                // (or this end dropped: see `Conn::drop`).
                let mut fds = [PollFd::new(&socket, PollFlags::IN | PollFlags::RDHUP)];
                loop {
                    match rustix::event::poll(&mut fds, None) {
                        Ok(_) => break,
                        Err(rustix::io::Errno::INTR) => continue,
                        Err(_) => return,
                    }
                }
                // A wake can come just before a waiter starts its sleep and be lost (the ring
                // index it sleeps on has not moved): wake again each millisecond until a
                // waiter has seen the peer gone, for at most one sleep slice of the rings.
                for _ in 0..SLEEP_SLICE.as_millis() {
                    let Some(conn) = conn.upgrade() else {
                        return;
                    };
                    if conn.gone_seen.load(Ordering::Relaxed) {
                        return;
                    }
                    wakers.0.wake();
                    wakers.1.wake();
                    drop(conn);
                    std::thread::sleep(Duration::from_millis(1));
                }
            })?;
        Ok(())
    }

    /// Whether a message written since the last read (or the last call) had to wake the
    /// sleeping peer: then how late its answer usually comes for it (the peer's wake-up lag,
    /// or half of `MAX_SPIN` until the peer has said one). A waiter for that answer spins
    /// through it once ([`Waiter::stretch_next`]) instead of sleeping, so that the pair does
    /// not stay asleep. Clears the flag.
    pub fn take_peer_woken(&self) -> Option<Duration> {
        if !self.conn.woke_peer.swap(false, Ordering::Relaxed) {
            return None;
        }
        let lag = Duration::from_nanos(self.conn.peer_lag_ns.load(Ordering::Relaxed));
        Some(if lag.is_zero() { MAX_SPIN / 2 } else { lag })
    }

    /// Where the peer last took a message of ours: its CPU, as it says
    /// ([`Producer::consumer_cpu`], [`crate::wait::say_cpu`]); `None` when not said, or while
    /// another thread writes.
    pub fn peer_cpu(&self) -> Option<u32> {
        self.conn.tx.try_lock().ok()?.ring.consumer_cpu()
    }

    /// Has the next read that must wait spin first for at least `spin`, whatever its waiter
    /// prefers ([`Waiter::hold_next`]): for a side that knows its next message comes soon
    /// while its peer spins (a server that has queued a completion-word signal). From any
    /// clone (it waits for a read in progress); a later call replaces an unused hold.
    pub fn hold_next_read(&self, spin: Duration) {
        lock(&self.conn.rx).waiter.hold_next(spin);
    }

    /// The shared region.
    pub fn region(&self) -> &Region {
        &self.conn.region
    }

    /// The session's Unix socket (liveness only).
    pub fn socket(&self) -> &UnixStream {
        &self.conn.socket
    }

    /// Largest ring message a write produces.
    pub fn max_chunk(&self) -> usize {
        self.conn.max_chunk
    }

    /// Logs both rings' waiters (`REMORA_WAIT_TRACE`, [`Waiter::trace`]) now, for a stream that
    /// lives until its process exits. A waiter whose lock another thread holds (it is waiting
    /// right now) is left out rather than waited for.
    pub fn trace_waits(&self) {
        if let Ok(tx) = self.conn.tx.try_lock() {
            tx.waiter.trace();
        }
        if let Ok(rx) = self.conn.rx.try_lock() {
            rx.waiter.trace();
        }
    }

    /// Bounds each read (`None`: wait forever); a read that times out fails with `WouldBlock`.
    pub fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        if t == Some(Duration::ZERO) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a zero timeout is not allowed",
            ));
        }
        self.conn.read_timeout.store(to_nanos(t), Ordering::Relaxed);
        Ok(())
    }

    /// Bounds each write (`None`: wait forever); a write that could not put any byte in the
    /// ring in time fails with `WouldBlock`.
    pub fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        if t == Some(Duration::ZERO) {
            return Err(io::Error::new(
                io::ErrorKind::InvalidInput,
                "a zero timeout is not allowed",
            ));
        }
        self.conn
            .write_timeout
            .store(to_nanos(t), Ordering::Relaxed);
        Ok(())
    }

    /// Shuts this end down like a socket: reads then end (end of file) and/or writes fail, in
    /// this process within one sleep slice. `Both` also shuts the Unix socket down, which
    /// ends the session for the peer.
    pub fn shutdown(&self, how: std::net::Shutdown) -> io::Result<()> {
        use std::net::Shutdown;
        if matches!(how, Shutdown::Read | Shutdown::Both) {
            self.conn.read_closed.store(true, Ordering::SeqCst);
        }
        if matches!(how, Shutdown::Write | Shutdown::Both) {
            self.conn.write_closed.store(true, Ordering::SeqCst);
        }
        if how == Shutdown::Both {
            return self.conn.socket.shutdown(Shutdown::Both);
        }
        Ok(())
    }
}

impl Conn {
    /// Whether the peer may still be there, by polling the session's Unix socket without
    /// waiting. A reader gives up on any sign of the read side ending (the peer closed or shut
    /// down, or this side shut its reading down); a writer only when the connection hung up.
    fn alive(&self, reading: bool) -> bool {
        if reading && self.read_closed.load(Ordering::Relaxed)
            || !reading && self.write_closed.load(Ordering::Relaxed)
        {
            return false;
        }
        let mut fds = [PollFd::new(&self.socket, PollFlags::IN | PollFlags::RDHUP)];
        let zero = rustix::event::Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        let alive = match rustix::event::poll(&mut fds, Some(&zero)) {
            Ok(0) => true,
            Ok(_) => {
                let r = fds[0].revents();
                if r.intersects(PollFlags::HUP | PollFlags::ERR | PollFlags::NVAL) {
                    false
                } else {
                    // Nothing is sent on the socket once the session is in shared memory:
                    // input there is an end of file or a peer breaking the protocol.
                    !(reading && r.intersects(PollFlags::IN | PollFlags::RDHUP))
                }
            }
            Err(rustix::io::Errno::INTR) => true,
            Err(_) => false,
        };
        if !alive {
            self.gone_seen.store(true, Ordering::Relaxed);
        }
        alive
    }
}

fn ring_error(e: RingError) -> io::Error {
    match e {
        RingError::PeerGone => io::Error::new(io::ErrorKind::BrokenPipe, e),
        RingError::Corrupt(_) | RingError::TooLarge { .. } => {
            io::Error::new(io::ErrorKind::InvalidData, e)
        }
    }
}

fn timed_out(what: &str) -> io::Error {
    io::Error::new(
        io::ErrorKind::WouldBlock,
        format!("shared-memory {what} timed out"),
    )
}

impl Read for ShmStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        (&*self).read(buf)
    }
}

impl Read for &ShmStream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        if buf.is_empty() {
            return Ok(0);
        }
        let conn = &*self.conn;
        let mut rx = lock(&conn.rx);
        let rx = &mut *rx;
        if rx.failed {
            return Err(io::Error::new(
                io::ErrorKind::InvalidData,
                "the shared ring is corrupt",
            ));
        }
        let until = deadline(conn.read_timeout.load(Ordering::Relaxed));
        loop {
            if rx.pos < rx.msg.len() {
                let n = buf.len().min(rx.msg.len() - rx.pos);
                buf[..n].copy_from_slice(&rx.msg[rx.pos..rx.pos + n]);
                rx.pos += n;
                return Ok(n);
            }
            if conn.read_closed.load(Ordering::Relaxed) {
                return Ok(0);
            }
            if let Some(lag) = self.take_peer_woken() {
                // Our last message woke the peer: its answer comes a wake-up late. Spin
                // through that once rather than sleep (see `Waiter::stretch_next`).
                let spin = rx.waiter.wake_stretch(lag);
                rx.waiter.stretch_next(spin);
            }
            match rx
                .ring
                .pop_until(&mut rx.msg, &mut rx.waiter, || conn.alive(true), until)
            {
                // An empty message carries nothing: wait for the next one.
                Ok(true) => {
                    rx.pos = 0;
                    // What we send next comes that much later: the peer's budget takes
                    // it out (`ring::judged_wait`).
                    conn.answer_lag.store(rx.ring.wake_lag(), Ordering::Relaxed);
                    conn.peer_lag_ns
                        .store(rx.ring.peer_lag(), Ordering::Relaxed);
                }
                Ok(false) => return Err(timed_out("read")),
                Err(RingError::PeerGone) => return Ok(0),
                Err(e) => {
                    rx.failed = true;
                    return Err(ring_error(e));
                }
            }
        }
    }
}

impl Write for ShmStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        (&*self).write(buf)
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        (&*self).write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl Write for &ShmStream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.write_vectored(&[IoSlice::new(buf)])
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        let conn = &*self.conn;
        if conn.write_closed.load(Ordering::Relaxed) {
            return Err(io::Error::new(
                io::ErrorKind::BrokenPipe,
                "the shared-memory stream is shut down for writing",
            ));
        }
        // One ring message of at most `max_chunk` bytes, gathered from the slices uncopied;
        // the usual few slices (a record's header and parts) listed on the stack.
        let mut few: [&[u8]; 8] = [&[]; 8];
        let mut many: Vec<&[u8]> = Vec::new();
        let (mut n, mut total) = (0, 0);
        for b in bufs {
            if total == conn.max_chunk {
                break;
            }
            let take = b.len().min(conn.max_chunk - total);
            if take > 0 {
                if n < few.len() {
                    few[n] = &b[..take];
                } else {
                    if many.is_empty() {
                        many.extend_from_slice(&few);
                    }
                    many.push(&b[..take]);
                }
                n += 1;
                total += take;
            }
        }
        if total == 0 {
            return Ok(0);
        }
        let parts: &[&[u8]] = if many.is_empty() { &few[..n] } else { &many };
        let until = deadline(conn.write_timeout.load(Ordering::Relaxed));
        let mut tx = lock(&conn.tx);
        let tx = &mut *tx;
        let lag = conn.answer_lag.swap(0, Ordering::Relaxed);
        if lag != 0 {
            tx.ring.set_next_lag(lag);
        }
        match tx
            .ring
            .push_until(parts, &mut tx.waiter, || conn.alive(false), until)
        {
            Ok(true) => {
                if tx.ring.woke_peer() {
                    conn.woke_peer.store(true, Ordering::Relaxed);
                }
                Ok(total)
            }
            Ok(false) => Err(timed_out("write")),
            Err(e) => Err(ring_error(e)),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// Sends `bytes` on `socket` with `fd` attached (SCM_RIGHTS) to the first of them.
pub fn send_with_fd(
    socket: &UnixStream,
    bytes: &[u8],
    fd: std::os::fd::BorrowedFd<'_>,
) -> io::Result<()> {
    use rustix::net::{SendAncillaryBuffer, SendAncillaryMessage, SendFlags};
    use std::mem::MaybeUninit;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
    let mut control = SendAncillaryBuffer::new(&mut space);
    let fds = [fd];
    if !control.push(SendAncillaryMessage::ScmRights(&fds)) {
        return Err(io::Error::other("no room for the descriptor"));
    }
    let sent = loop {
        match rustix::net::sendmsg(
            socket,
            &[IoSlice::new(bytes)],
            &mut control,
            SendFlags::NOSIGNAL,
        ) {
            Ok(n) => break n,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    (&*socket).write_all(&bytes[sent..])
}

/// Receives bytes into `buf` from `socket`, with the descriptor passed alongside them if
/// any (further descriptors are closed). `Ok((0, None))` is end of file.
pub fn recv_with_fd(
    socket: &UnixStream,
    buf: &mut [u8],
) -> io::Result<(usize, Option<std::os::fd::OwnedFd>)> {
    use rustix::net::{RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags};
    use std::mem::MaybeUninit;
    let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(4))];
    let mut control = RecvAncillaryBuffer::new(&mut space);
    let msg = loop {
        match rustix::net::recvmsg(
            socket,
            &mut [io::IoSliceMut::new(buf)],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        ) {
            Ok(m) => break m,
            Err(rustix::io::Errno::INTR) => continue,
            Err(e) => return Err(e.into()),
        }
    };
    let mut fd = None;
    for m in control.drain() {
        if let RecvAncillaryMessage::ScmRights(fds) = m {
            for f in fds {
                if fd.is_none() {
                    fd = Some(f);
                }
            }
        }
    }
    Ok((msg.bytes, fd))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::Layout;

    fn pair(ring: u32) -> (ShmStream, ShmStream) {
        let layout = Layout {
            ring_capacity: ring,
            data_size: 0,
        };
        let server = Region::create("remora-stream-test", layout).unwrap();
        let client = Region::open(server.fd().try_clone().unwrap(), layout).unwrap();
        let (a, b) = UnixStream::pair().unwrap();
        (
            ShmStream::new(client, a, Side::Client),
            ShmStream::new(server, b, Side::Server),
        )
    }

    #[test]
    fn bytes_cross_in_both_directions_with_leftovers_kept() {
        let (mut c, mut s) = pair(4096);
        let data: Vec<u8> = (0..100_000u32).map(|i| (i * 7) as u8).collect();
        let expect = data.clone();
        let t = std::thread::spawn(move || {
            let mut got = Vec::new();
            let mut small = [0u8; 333];
            while got.len() < expect.len() {
                let n = s.read(&mut small).unwrap();
                assert!(n > 0);
                got.extend_from_slice(&small[..n]);
            }
            assert_eq!(got, expect);
            s.write_all(b"done").unwrap();
        });
        c.write_all(&data).unwrap();
        let mut done = [0u8; 4];
        c.read_exact(&mut done).unwrap();
        assert_eq!(&done, b"done");
        t.join().unwrap();
    }

    #[test]
    fn a_held_read_spins_first_once() {
        let (mut c, mut s) = pair(4096);
        let stats = |s: &ShmStream| lock(&s.conn.rx).waiter.stats();
        // Held for 10 ms (the most a hold spins): a request 2 ms later (past any budget or
        // spare spin) is caught spinning; one 20 ms after that, unheld, is slept for.
        s.hold_next_read(Duration::from_millis(500));
        let t = std::thread::spawn(move || {
            for (m, ms) in [(b"one", 2), (b"two", 20)] {
                std::thread::sleep(Duration::from_millis(ms));
                c.write_all(m).unwrap();
            }
            c
        });
        let mut buf = [0u8; 3];
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"one");
        let st = stats(&s);
        assert_eq!((st.spun, st.slept), (1, 0), "{st:?}");
        // The hold was for one wait: the next one sleeps.
        s.read_exact(&mut buf).unwrap();
        assert_eq!(&buf, b"two");
        let st = stats(&s);
        assert_eq!((st.spun, st.slept), (1, 1), "{st:?}");
        let _c = t.join().unwrap();
    }

    #[test]
    fn gathered_writes_of_few_and_many_slices_arrive_in_order() {
        let (c, mut s) = pair(1 << 16);
        let data: Vec<u8> = (0..4000u32).map(|i| (i * 13) as u8).collect();
        let mut sent = Vec::new();
        // 1, 8 (the stack list's size), 9 and 30 slices, some empty.
        for n in [1usize, 8, 9, 30] {
            let step = data.len() / n;
            let slices: Vec<IoSlice<'_>> = (0..n)
                .flat_map(|i| {
                    let part = &data[i * step..(i + 1) * step];
                    [IoSlice::new(part), IoSlice::new(&[])]
                })
                .collect();
            let mut left = &mut slices.clone()[..];
            while !left.is_empty() {
                let wrote = (&c).write_vectored(left).unwrap();
                assert!(wrote > 0);
                IoSlice::advance_slices(&mut left, wrote);
            }
            for i in 0..n {
                sent.extend_from_slice(&data[i * step..(i + 1) * step]);
            }
        }
        let mut got = vec![0u8; sent.len()];
        s.read_exact(&mut got).unwrap();
        assert_eq!(got, sent);
    }

    #[test]
    fn read_timeout_then_end_of_file_when_the_peer_goes() {
        let (c, s) = pair(4096);
        s.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let mut buf = [0u8; 8];
        let e = (&s).read(&mut buf).unwrap_err();
        assert_eq!(e.kind(), io::ErrorKind::WouldBlock);
        (&c).write_all(b"last").unwrap();
        drop(c);
        // What was sent before the peer left still arrives, then end of file.
        assert_eq!((&s).read(&mut buf).unwrap(), 4);
        s.set_read_timeout(None).unwrap();
        let start = Instant::now();
        assert_eq!((&s).read(&mut buf).unwrap(), 0);
        assert!(start.elapsed() < Duration::from_secs(2));
        // Writing to a gone peer fails rather than waiting for room forever.
        let big = vec![0u8; 1 << 20];
        assert_eq!(
            (&s).write_all(&big).unwrap_err().kind(),
            io::ErrorKind::BrokenPipe
        );
    }

    #[test]
    fn a_full_ring_times_out_a_write() {
        let (c, _s) = pair(4096);
        c.set_write_timeout(Some(Duration::from_millis(10)))
            .unwrap();
        let mut wrote = 0;
        let err = loop {
            match (&c).write(&[1u8; 1000]) {
                Ok(n) => wrote += n,
                Err(e) => break e,
            }
        };
        assert_eq!(err.kind(), io::ErrorKind::WouldBlock);
        assert!(wrote > 0 && wrote <= 4096, "{wrote}");
    }

    #[test]
    fn the_descriptor_travels_with_the_bytes() {
        let (a, b) = UnixStream::pair().unwrap();
        let region = Region::create(
            "remora-pass",
            Layout {
                ring_capacity: 4096,
                data_size: 0,
            },
        )
        .unwrap();
        send_with_fd(&a, b"hello", std::os::fd::AsFd::as_fd(region.fd())).unwrap();
        let mut buf = [0u8; 16];
        let (n, fd) = recv_with_fd(&b, &mut buf).unwrap();
        assert_eq!(&buf[..n], b"hello");
        Region::open(fd.unwrap(), region.layout()).unwrap();
    }
}
