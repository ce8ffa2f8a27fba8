//! Polling, then blocking, for socket reads (issue 12 §3, DESIGN decision 11).
//!
//! A blocking `read` on a socket whose data arrives a few microseconds later costs a sleep
//! and a wake-up of the reading thread: on the H100 host a Unix-socket round trip took
//! 16 µs where the two processes do under 3 µs of work. [`Spinning`] first tries
//! non-blocking reads for a spin budget that follows the waits it has seen
//! ([`remora_shm::Waiter`], the same policy as the shared-memory rings): replies and requests
//! that come quickly are caught without a sleep; a connection whose waits are long (an idle
//! client, a long kernel) gets a budget of zero and blocks at once, so it costs no CPU.
//! Shared-memory streams wait in their rings with their own waiter and are read directly.

use std::io::{self, Read, Write};
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use remora_shm::Waiter;

use crate::server::Transport;

/// Longest spin before a socket read blocks: waits up to about this long are caught
/// spinning; slower peers cost a wake-up instead of a core.
pub(crate) const MAX_SPIN: Duration = Duration::from_micros(50);

/// `inner`, read polling then blocking; writes pass through.
#[derive(Debug)]
pub(crate) struct Spinning<S> {
    pub(crate) inner: S,
    waiter: Waiter,
    /// With [`block_when_loaded`] on and the adaptive policy: whether the host has no core
    /// to spare now (then a read that must wait blocks at once).
    loaded: Option<fn() -> bool>,
    /// The next read that must wait spins first at least this long ([`Spinning::hold_next`]).
    hold: Duration,
    /// The stream's read timeout in nanoseconds, 0 for none ([`Spinning::note_read_timeout`]):
    /// a read spins no longer than that before it blocks (within the timeout) or times out.
    timeout_ns: AtomicU64,
}

impl<S: Transport> Spinning<S> {
    pub(crate) fn new(inner: S) -> Self {
        inner.stamp_arrivals();
        // The fixed policies (`REMORA_WAIT=spin|block`, what `bench contention` measures
        // adaptive against) wait as they say, loaded or not.
        let adaptive = remora_shm::WaitPolicy::from_env() == remora_shm::WaitPolicy::Adaptive;
        Self {
            inner,
            waiter: Waiter::new(Duration::ZERO, MAX_SPIN).labeled("socket: readable"),
            loaded: (adaptive && block_when_loaded()).then_some(|| !remora_shm::cores_to_spare()),
            hold: Duration::ZERO,
            timeout_ns: AtomicU64::new(0),
        }
    }

    /// Notes the read timeout the stream was given (its owner sets it on the stream), which
    /// also bounds how long a read spins: without the bound the spin policy's budget (a
    /// second) outlasted a shorter timeout, so a read asked to give up after a server's tick
    /// or a call's deadline spun on past it before it looked again.
    pub(crate) fn note_read_timeout(&self, timeout: Option<Duration>) {
        let ns = timeout.map_or(0, |t| {
            u64::try_from(t.as_nanos()).unwrap_or(u64::MAX).max(1)
        });
        self.timeout_ns.store(ns, Ordering::Relaxed);
    }

    /// The read timeout last noted ([`Spinning::note_read_timeout`]).
    fn read_timeout(&self) -> Option<Duration> {
        match self.timeout_ns.load(Ordering::Relaxed) {
            0 => None,
            ns => Some(Duration::from_nanos(ns)),
        }
    }

    /// Has the next read that must wait spin first for at least `spin`, loaded host or not
    /// ([`remora_shm::Waiter::hold_next`]; a shared-memory stream's own waiter for those):
    /// a service that knows the next call comes soon while its client spins asks for it
    /// ([`crate::CallContext::hold_next_read`]).
    pub(crate) fn hold_next(&mut self, spin: Duration) {
        self.hold = spin;
    }
}

impl Spinning<crate::endpoint::Stream> {
    /// Sets the stream's read timeout and notes it ([`Spinning::note_read_timeout`]).
    pub(crate) fn set_read_timeout(&self, timeout: Option<Duration>) -> io::Result<()> {
        self.inner.set_read_timeout(timeout)?;
        self.note_read_timeout(timeout);
        Ok(())
    }
}

/// Whether an adaptive socket read that must wait blocks at once, without spinning or
/// exploring, while the host has no core to spare ([`remora_shm::cores_to_spare`]): on by
/// default; `REMORA_WAIT_SOCKET_LOADED=adaptive` turns it off (the choice between spinning and
/// blocking is then measured on a loaded host too). The server's brief synchronize poll, the
/// rings and the completion words are unchanged, and so is a host with a core to spare.
///
/// Why (issue 12 §4, H200, tcp, `bench contention --burn 1,2`): in session 30 adaptive's
/// launch + synchronize p50 with 4 clients (46-96 µs) was worse than both fixed ways' (spin
/// 25-26, block 35-46), and at 2x each round trip spent 103-124 µs runnable but not running in
/// the client against blocking's 55-91. A fair scheduler charges a thread for the CPU it spun,
/// so one that spins and then sleeps wakes later than one that slept at once; the spin's cost
/// lands on the waits after it, where measuring each way's own waits (`Waiter::plan`) does not
/// see it. In session 31, blocking at once under load took adaptive's tcp means from 58, 337,
/// 85 and 413 µs (1 and 4 clients at 1x, then at 2x) to 49, 359, 64 and 313: within 2% of the
/// better fixed way at 2x, where it had been 33-35% above it.
fn block_when_loaded() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        let v = std::env::var("REMORA_WAIT_SOCKET_LOADED").ok();
        socket_loaded_setting(v.as_deref())
    })
}

/// `REMORA_WAIT_SOCKET_LOADED`'s value: unset, empty or `block` leaves blocking under load on;
/// `adaptive` turns it off; anything else is logged and leaves it on.
fn socket_loaded_setting(v: Option<&str>) -> bool {
    match v.map(str::trim) {
        None | Some("" | "block") => true,
        Some("adaptive") => false,
        Some(other) => {
            tracing::warn!(
                "REMORA_WAIT_SOCKET_LOADED={other:?} is not block or adaptive; socket reads block at once while the host has no core to spare (the default)"
            );
            true
        }
    }
}

impl<S: Transport> Read for Spinning<S> {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        // Bytes already there (the rest of a large record, a request that came during the
        // last one) need no clock and say nothing about how long waits are.
        let hold = std::mem::take(&mut self.hold);
        loop {
            match self.inner.try_read(buf) {
                None => {
                    if !hold.is_zero() {
                        self.inner.hold_next_read(hold);
                    }
                    return self.inner.read(buf);
                }
                Some(Ok(n)) => {
                    self.waiter.count_at_once();
                    return Ok(n);
                }
                Some(Err(e)) if e.kind() == io::ErrorKind::Interrupted => continue,
                Some(Err(e)) if e.kind() == io::ErrorKind::WouldBlock => break,
                Some(Err(e)) => return Err(e),
            }
        }
        let start = Instant::now();
        let budget = match self.loaded {
            _ if !hold.is_zero() => {
                self.waiter.hold_next(hold);
                self.waiter.plan()
            }
            Some(loaded) if loaded() => Duration::ZERO,
            _ => self.waiter.plan(),
        };
        let budget = self.read_timeout().map_or(budget, |t| budget.min(t));
        while start.elapsed() < budget {
            std::hint::spin_loop();
            match self.inner.try_read(buf) {
                Some(Ok(n)) => {
                    self.waiter
                        .record(remora_shm::WaitOutcome::Spun, start.elapsed());
                    return Ok(n);
                }
                Some(Err(e))
                    if matches!(
                        e.kind(),
                        io::ErrorKind::WouldBlock | io::ErrorKind::Interrupted
                    ) => {}
                Some(Err(e)) => return Err(e),
                None => break,
            }
        }
        // Block (within the socket's read timeout). A timeout, too, tells a long wait. The
        // budget learns the time until the bytes arrived where the socket stamps them (TCP):
        // not this side's own wake-up (`remora_sockstamp`).
        let r = self.inner.read_stamped(buf);
        let took = start.elapsed();
        match &r {
            Ok((n, lag)) if *n > 0 => {
                // A stamp from before the wait began cannot be right for these bytes
                // (a clock step, an odd stamp): learn the wait as it was.
                let lag = lag.filter(|l| *l <= took).unwrap_or_default();
                self.waiter
                    .record_judged(remora_shm::WaitOutcome::Slept, took, took - lag);
            }
            Err(e) if crate::record::is_timeout_kind(e.kind()) => {
                self.waiter.record(remora_shm::WaitOutcome::Slept, took);
            }
            _ => {}
        }
        r.map(|(n, _)| n)
    }
}

impl<S> Spinning<S> {
    /// Logs the waiter's line (`REMORA_WAIT_TRACE`) now, for a connection that lives until
    /// its process exits.
    pub(crate) fn trace_waits(&self) {
        self.waiter.trace();
    }
}

impl<S: Write> Write for Spinning<S> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.inner.write(buf)
    }

    fn write_vectored(&mut self, bufs: &[io::IoSlice<'_>]) -> io::Result<usize> {
        self.inner.write_vectored(bufs)
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::net::UnixStream;

    #[test]
    fn reads_return_what_arrives_and_long_waits_end_the_spinning() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut r = Spinning::new(crate::endpoint::Stream::Unix(a));
        assert_eq!(r.waiter.budget(), MAX_SPIN);
        // Data already there.
        b.write_all(b"x").unwrap();
        let mut buf = [0u8; 8];
        assert_eq!(r.read(&mut buf).unwrap(), 1);
        assert_eq!(buf[0], b'x');
        // Peers that answer after a spin or after a sleep: every byte arrives, in order.
        let t = std::thread::spawn(move || {
            for i in 0..50u8 {
                if i % 10 == 0 {
                    std::thread::sleep(Duration::from_millis(5));
                }
                b.write_all(&[i]).unwrap();
            }
            b
        });
        for i in 0..50u8 {
            assert_eq!(r.read(&mut buf[..1]).unwrap(), 1);
            assert_eq!(buf[0], i);
        }
        let mut b = t.join().unwrap();
        // Waits far beyond the spin budget: the budget falls to nothing (an idle
        // connection costs no CPU).
        for _ in 0..5 {
            let t = std::thread::spawn(move || {
                std::thread::sleep(Duration::from_millis(20));
                b.write_all(b"z").unwrap();
                b
            });
            assert_eq!(r.read(&mut buf).unwrap(), 1);
            b = t.join().unwrap();
        }
        assert_eq!(r.waiter.budget(), Duration::ZERO);
        // The socket's read timeout still holds.
        r.inner
            .set_read_timeout(Some(Duration::from_millis(10)))
            .unwrap();
        let e = r.read(&mut buf).unwrap_err();
        assert!(crate::record::is_timeout_kind(e.kind()), "{e}");
        // End of file reads as 0, as a blocking read would.
        drop(b);
        assert_eq!(r.read(&mut buf).unwrap(), 0);
    }

    #[test]
    fn on_a_loaded_host_an_adaptive_read_blocks_at_once() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut r = Spinning::new(crate::endpoint::Stream::Unix(a));
        r.loaded = Some(|| true);
        let t = std::thread::spawn(move || {
            for i in 0..10u8 {
                std::thread::sleep(Duration::from_micros(200));
                b.write_all(&[i]).unwrap();
            }
            b
        });
        let mut buf = [0u8; 1];
        for i in 0..10u8 {
            assert_eq!(r.read(&mut buf).unwrap(), 1);
            assert_eq!(buf[0], i);
        }
        let _b = t.join().unwrap();
        let st = r.waiter.stats();
        assert_eq!(st.spun, 0, "no wait spun: {st:?}");
        assert_eq!(st.slept + st.at_once, 10, "{st:?}");
    }

    #[test]
    fn a_held_read_spins_first_on_a_loaded_host() {
        let (a, mut b) = UnixStream::pair().unwrap();
        let mut r = Spinning::new(crate::endpoint::Stream::Unix(a));
        r.loaded = Some(|| true);
        let mut buf = [0u8; 1];
        // Held (for 10 ms, the most a hold spins): a byte 2 ms later is caught spinning,
        // though the host is loaded.
        r.hold_next(Duration::from_millis(200));
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(2));
            b.write_all(b"h").unwrap();
            b
        });
        assert_eq!(r.read(&mut buf).unwrap(), 1);
        assert_eq!(buf[0], b'h');
        let mut b = t.join().unwrap();
        let st = r.waiter.stats();
        assert_eq!((st.spun, st.slept), (1, 0), "{st:?}");
        // The hold was for that read only: the next one blocks at once again.
        let t = std::thread::spawn(move || {
            std::thread::sleep(Duration::from_millis(2));
            b.write_all(b"i").unwrap();
            b
        });
        assert_eq!(r.read(&mut buf).unwrap(), 1);
        assert_eq!(buf[0], b'i');
        let _b = t.join().unwrap();
        let st = r.waiter.stats();
        assert_eq!((st.spun, st.slept), (1, 1), "{st:?}");
    }

    #[test]
    fn a_spinning_read_gives_up_at_its_read_timeout() {
        let (a, _b) = UnixStream::pair().unwrap();
        let mut r = Spinning::new(crate::endpoint::Stream::Unix(a));
        // The spin policy's budget: a second of spinning before a read blocks.
        r.waiter = Waiter::with_bounds(remora_shm::SPIN_FOREVER, remora_shm::SPIN_FOREVER);
        r.loaded = None;
        r.set_read_timeout(Some(Duration::from_millis(20))).unwrap();
        let mut buf = [0u8; 1];
        let start = Instant::now();
        let e = r.read(&mut buf).unwrap_err();
        assert!(crate::record::is_timeout_kind(e.kind()), "{e}");
        // 20 ms of spinning, then at most the 20 ms timeout blocked: far from the second.
        let took = start.elapsed();
        assert!(took < Duration::from_millis(500), "{took:?}");
    }

    #[test]
    fn socket_loaded_values() {
        assert!(socket_loaded_setting(Some("block")));
        assert!(socket_loaded_setting(Some(" block ")));
        assert!(socket_loaded_setting(None));
        assert!(socket_loaded_setting(Some("")));
        assert!(!socket_loaded_setting(Some("adaptive")));
        assert!(!socket_loaded_setting(Some(" adaptive")));
        assert!(socket_loaded_setting(Some("spin")));
    }
}
