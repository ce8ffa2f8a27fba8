//! A single-producer/single-consumer ring of length-prefixed messages in shared memory.
//!
//! Layout at the ring's offset: a [`RingHeader`] (four cache lines), then `capacity` bytes of
//! message area. A message is a little-endian `u32` length, the bytes, and zero to three
//! padding bytes up to a multiple of four; it may wrap around the end of the area. Since
//! capacity is a power of two and every message is a multiple of four bytes, a length word
//! never straddles the end.
//!
//! `tail` (written by the producer) and `head` (written by the consumer) count bytes ever
//! written and consumed, modulo 2^32. Each side keeps its own index privately and only
//! *reads* the other's from the shared header, so a peer scribbling on the header can lie
//! about its own progress but cannot move ours.

use std::sync::Arc;
use std::sync::atomic::{AtomicU32, AtomicU64, Ordering, fence};
use std::time::{Duration, Instant};

use crate::region::Mapping;
use crate::wait::{WaitOutcome, Waiter};

/// Bytes of the ring header.
pub(crate) const RING_HEADER: usize = 256;

/// Longest message any ring takes (a ring takes at most `capacity - 4`).
pub const MAX_MESSAGE: usize = (1 << 30) - 4;

/// How long a sleeping side waits before it checks that the peer is still alive.
pub(crate) const SLEEP_SLICE: Duration = Duration::from_millis(50);

/// Why a ring operation failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RingError {
    /// The peer wrote indices or a length that cannot be right: the session must be closed.
    #[error("the shared ring is corrupt ({0}); the peer is faulty or hostile")]
    Corrupt(&'static str),
    /// The message does not fit in the ring at all.
    #[error("a message of {len} bytes does not fit a ring of {capacity} bytes")]
    TooLarge {
        /// The message length.
        len: usize,
        /// The ring's capacity.
        capacity: u32,
    },
    /// The peer is gone (the liveness check given to a blocking call said so).
    #[error("the peer of the shared ring is gone")]
    PeerGone,
}

#[repr(C, align(64))]
struct Line(AtomicU32);

/// The producer's cache line: its index, and what the consumer's waiter learns from.
#[repr(C, align(64))]
struct TailLine {
    /// Bytes ever published by the producer (Release after the bytes are written).
    tail: AtomicU32,
    _pad: u32,
    /// `CLOCK_MONOTONIC` nanoseconds of the latest publish (0: a producer that does not say:
    /// an older Remora). Advisory: it only steers the consumer's spin budget.
    posted_ns: AtomicU64,
    /// With the latest message: how late, in nanoseconds, the producer noticed the message
    /// on the other ring that this one answers (0: it was spinning, not asleep, or the
    /// message answers nothing). An answer sent after a wake-up comes that much later than
    /// it would have; the consumer takes it out of what its budget learns. Advisory, like
    /// `posted_ns`.
    lag_ns: AtomicU64,
}

/// The consumer's cache line: its index, and where it last ran.
#[repr(C, align(64))]
struct HeadLine {
    /// Bytes ever consumed (Release after the bytes are copied out).
    head: AtomicU32,
    /// 1 + the CPU the consumer ran on when it last took a message, written unless
    /// `REMORA_SERVE_AVOID_PEER_CPU=0` (without tracing, [`crate::wait::say_cpu`]; 0: not
    /// said, or an older Remora). Advisory ([`Producer::consumer_cpu`]): a server's
    /// connection thread leaves that core ([`crate::wait::avoid_cpu`]), and traces tell
    /// whether a peer that answers late was waiting for the producer's own core.
    cpu: AtomicU32,
}

/// The shared header of a ring. Each index sits on its own cache line, so that the
/// producer's and the consumer's stores do not invalidate each other's lines.
#[repr(C)]
struct RingHeader {
    tail: TailLine,
    head: HeadLine,
    /// 1 while the consumer sleeps (or is about to) on the futex at `tail`.
    consumer_sleeping: Line,
    /// 1 while the producer sleeps (or is about to) on the futex at `head`, waiting for room.
    producer_sleeping: Line,
}

const _: () = assert!(std::mem::size_of::<RingHeader>() == RING_HEADER);

/// Common state of both ends: the mapping, where the ring is, and its capacity.
#[derive(Debug, Clone)]
struct Ends {
    map: Arc<Mapping>,
    off: usize,
    capacity: u32,
}

impl Ends {
    fn new(map: Arc<Mapping>, off: usize, capacity: u32) -> Self {
        assert!(capacity.is_power_of_two() && capacity >= 8);
        assert!(off.is_multiple_of(64) && off + RING_HEADER + capacity as usize <= map.len());
        Self { map, off, capacity }
    }

    fn header(&self) -> &RingHeader {
        // SAFETY: `off` is 64-aligned and inside the mapping (checked in `new`); the header
        // consists of atomics, which tolerate the peer's concurrent accesses.
        unsafe { &*self.map.base().add(self.off).cast::<RingHeader>() }
    }

    fn area(&self) -> *mut u8 {
        // SAFETY: the message area follows the header inside the mapping (checked in `new`).
        unsafe { self.map.base().add(self.off + RING_HEADER) }
    }

    /// Copies `out.len()` bytes from ring position `pos` (wrapping) into `out`.
    fn read(&self, pos: u32, out: &mut [u8]) {
        let cap = self.capacity as usize;
        let start = pos as usize & (cap - 1);
        let first = out.len().min(cap - start);
        // SAFETY: both ranges lie inside the message area (start < cap, first <= cap - start,
        // and the rest is at most cap bytes since callers bound lengths by the capacity). The
        // peer may write these bytes concurrently; we copy whatever is there into private
        // memory and never read the shared bytes twice.
        unsafe {
            std::ptr::copy_nonoverlapping(self.area().add(start), out.as_mut_ptr(), first);
            std::ptr::copy_nonoverlapping(
                self.area(),
                out.as_mut_ptr().add(first),
                out.len() - first,
            );
        }
    }

    /// Copies `data` to ring position `pos` (wrapping).
    fn write(&self, pos: u32, data: &[u8]) {
        let cap = self.capacity as usize;
        let start = pos as usize & (cap - 1);
        let first = data.len().min(cap - start);
        // SAFETY: as in `read`; the bytes written are free space the consumer has released
        // (the producer checked it against `head`).
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.area().add(start), first);
            std::ptr::copy_nonoverlapping(
                data.as_ptr().add(first),
                self.area(),
                data.len() - first,
            );
        }
    }

    /// Free bytes, or `Corrupt` when the consumer's `head` cannot be right.
    fn free(&self, tail: u32) -> Result<usize, RingError> {
        // Acquire: pairs with the consumer's Release store of `head`, so that its copy-out of
        // the bytes it released happened before we overwrite them.
        let head = self.header().head.head.load(Ordering::Acquire);
        let used = tail.wrapping_sub(head);
        if used > self.capacity || !used.is_multiple_of(4) {
            return Err(RingError::Corrupt("the consumer index is out of range"));
        }
        Ok((self.capacity - used) as usize)
    }

    /// The producer's [`Producer::try_push`], `tail` being its count of bytes published.
    /// `woke` says whether publishing had to wake the consumer. `lag` goes to the header with
    /// the message and is then spent (0; see [`Producer::set_next_lag`]).
    fn push(
        &self,
        tail: &mut u32,
        parts: &[&[u8]],
        woke: &mut bool,
        lag: &mut u64,
    ) -> Result<bool, RingError> {
        let len: usize = parts.iter().map(|p| p.len()).sum();
        let need = padded(len);
        if need > self.capacity as usize || len > MAX_MESSAGE {
            return Err(RingError::TooLarge {
                len,
                capacity: self.capacity,
            });
        }
        if self.free(*tail)? < need {
            return Ok(false);
        }
        let mut pos = *tail;
        self.write(pos, &(len as u32).to_le_bytes());
        pos = pos.wrapping_add(4);
        for p in parts {
            self.write(pos, p);
            pos = pos.wrapping_add(p.len() as u32);
        }
        let pad = need - 4 - len;
        self.write(pos, &[0u8; 3][..pad]);
        *tail = tail.wrapping_add(need as u32);
        let h = self.header();
        h.tail.posted_ns.store(mono_ns(), Ordering::Relaxed);
        let lag = std::mem::take(lag);
        if h.tail.lag_ns.load(Ordering::Relaxed) != lag {
            h.tail.lag_ns.store(lag, Ordering::Relaxed);
        }
        // The message bytes (and the stamp) are visible before the index that publishes them.
        *woke = publish(&h.tail.tail, *tail, &h.consumer_sleeping.0);
        Ok(true)
    }

    /// The consumer's [`Consumer::try_pop`], `head` being its count of bytes consumed.
    fn pop(&self, head: &mut u32, out: &mut Vec<u8>) -> Result<bool, RingError> {
        // Acquire: pairs with the producer's Release store of `tail`, so that the message
        // bytes it published are visible before we read them.
        let tail = self.header().tail.tail.load(Ordering::Acquire);
        let used = tail.wrapping_sub(*head);
        if used > self.capacity || !used.is_multiple_of(4) {
            return Err(RingError::Corrupt("the producer index is out of range"));
        }
        if used == 0 {
            return Ok(false);
        }
        if used < 4 {
            return Err(RingError::Corrupt(
                "a message is shorter than its length word",
            ));
        }
        let mut word = [0u8; 4];
        self.read(*head, &mut word);
        let len = u32::from_le_bytes(word) as usize;
        // The length is read once, into private memory, and bounded by what the producer
        // published before anything is allocated or copied.
        if padded(len) > used as usize {
            return Err(RingError::Corrupt(
                "a message is longer than what was published",
            ));
        }
        out.clear();
        out.resize(len, 0);
        self.read(head.wrapping_add(4), out);
        *head = head.wrapping_add(padded(len) as u32);
        let h = self.header();
        // Our copy-out is complete before the producer may reuse the bytes.
        publish(&h.head.head, *head, &h.producer_sleeping.0);
        if crate::wait::say_cpu() {
            let cpu = crate::wait::current_cpu().saturating_add(1);
            h.head.cpu.store(cpu, Ordering::Relaxed);
        }
        Ok(true)
    }
}

fn padded(len: usize) -> usize {
    4 + len.next_multiple_of(4)
}

/// How long one futex sleep may last: [`SLEEP_SLICE`], less when `deadline` comes first.
/// `None` when the deadline has passed.
fn sleep_slice(deadline: Option<Instant>) -> Option<Duration> {
    match deadline {
        None => Some(SLEEP_SLICE),
        Some(d) => {
            let left = d.saturating_duration_since(Instant::now());
            (!left.is_zero()).then(|| left.min(SLEEP_SLICE))
        }
    }
}

/// Sleeps on the futex word `word` while it still holds `seen`, for at most `slice` (below
/// one second).
fn futex_sleep(word: &AtomicU32, seen: u32, slice: Duration) {
    let timeout = rustix::thread::futex::Timespec {
        tv_sec: 0,
        tv_nsec: slice.min(Duration::from_millis(999)).as_nanos() as _,
    };
    // Not FUTEX_PRIVATE: the word is in memory shared with another process. EAGAIN (the
    // word changed), EINTR and ETIMEDOUT all mean: look again.
    let _ = rustix::thread::futex::wait(
        word,
        rustix::thread::futex::Flags::empty(),
        seen,
        Some(&timeout),
    );
}

fn futex_wake(word: &AtomicU32) {
    let _ = rustix::thread::futex::wake(word, rustix::thread::futex::Flags::empty(), 1);
}

/// Publishes our index `value` in `index` and wakes the peer if it sleeps on it. Release: what
/// the index covers (message bytes written, or copied out) is visible before the index. The
/// SeqCst fence between publishing and reading `peer_sleeping` pairs with the one in
/// [`wait_for`]: without it both sides could miss the other, the peer sleeping on an index
/// that already moved (a lost wake-up).
/// `true` when the peer was asleep (or about to be) and was woken.
fn publish(index: &AtomicU32, value: u32, peer_sleeping: &AtomicU32) -> bool {
    index.store(value, Ordering::Release);
    fence(Ordering::SeqCst);
    let asleep = peer_sleeping.load(Ordering::Relaxed) != 0;
    if asleep {
        futex_wake(index);
    }
    asleep
}

/// The waiting loop of both ends: `attempt()` until it succeeds, spinning then sleeping on the
/// peer's index `word` (announced in `sleeping`) while `blocked(word's value)` says the ring
/// still holds us up. `Ok(false)` when `deadline` passed; `PeerGone` when `alive()` fails
/// after a sleep that did not help.
#[allow(clippy::too_many_arguments)]
fn wait_for(
    waiter: &mut Waiter,
    deadline: Option<Instant>,
    alive: impl Fn() -> bool,
    sleeping: &AtomicU32,
    word: &AtomicU32,
    blocked: impl Fn(u32) -> bool,
    mut attempt: impl FnMut() -> Result<bool, RingError>,
    judge: impl FnOnce(bool, WaitOutcome, Duration) -> Duration,
) -> Result<bool, RingError> {
    waiter
        .wait_judged_until(
            deadline,
            |sleep| {
                if !sleep {
                    return Ok(attempt()?.then_some(true));
                }
                let Some(slice) = sleep_slice(deadline) else {
                    // Timed out, but a gone peer is said as such: a caller that reads again
                    // after each timeout (a server's tick) must not wait on a dead peer.
                    if attempt()? {
                        return Ok(Some(true));
                    }
                    if !alive() {
                        return Err(RingError::PeerGone);
                    }
                    return Ok(Some(false));
                };
                sleeping.store(1, Ordering::SeqCst);
                fence(Ordering::SeqCst);
                let seen = word.load(Ordering::Acquire);
                if blocked(seen) {
                    futex_sleep(word, seen, slice);
                }
                sleeping.store(0, Ordering::Relaxed);
                if attempt()? {
                    return Ok(Some(true));
                }
                if !alive() {
                    return Err(RingError::PeerGone);
                }
                Ok(None)
            },
            |&got, outcome, took| judge(got, outcome, took),
        )
        .map(|(v, _)| v)
}

/// `CLOCK_MONOTONIC` now, in nanoseconds: one clock for both processes of a session.
fn mono_ns() -> u64 {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::Monotonic);
    (t.tv_sec as u64)
        .saturating_mul(1_000_000_000)
        .saturating_add(t.tv_nsec as u64)
}

/// What a consumer's wait that took `took` and ended as `outcome` teaches its budget, from
/// the producer's stamps (`posted`, `peer_lag`; `posted` 0: no stamps, `took` itself), and
/// how late this side noticed the message (its wake-up lag: 0 unless it slept).
///
/// The budget should follow how long the peer takes to answer while both sides spin. A
/// wait that slept is longer by this side's own wake-up (the message was there at `posted`,
/// noticed only at the end), and a reply the peer sent after sleeping itself is later by
/// the peer's wake-up (`peer_lag`). Learning those would keep both budgets at their minimum
/// once both sides sleep: each waits a wake-up of the other, which proves the next wait
/// long too. Both are taken out.
fn judged_wait(
    outcome: WaitOutcome,
    took: Duration,
    posted: u64,
    peer_lag: u64,
) -> (Duration, u64) {
    if posted == 0 {
        return (took, 0);
    }
    let now = mono_ns();
    let start = now.saturating_sub(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX));
    let arrival = posted.saturating_sub(start).min(now - start);
    let own_lag = match outcome {
        WaitOutcome::Slept => now.saturating_sub(posted),
        WaitOutcome::Spun => 0,
    };
    (
        Duration::from_nanos(arrival.saturating_sub(peer_lag)),
        own_lag,
    )
}

/// Wakes this process's waits on a ring from another thread ([`Consumer::waker`],
/// [`Producer::waker`]): a waiting end then looks again (and asks whether its peer is still
/// there) instead of sleeping out its slice. Keeps the ring's mapping alive.
#[derive(Debug, Clone)]
pub struct RingWaker(Ends);

impl RingWaker {
    /// Wakes a sleeper on either index of the ring.
    pub fn wake(&self) {
        let h = self.0.header();
        futex_wake(&h.tail.tail);
        futex_wake(&h.head.head);
    }
}

/// The producing end of a ring. One thread at a time (it is `Send`, not `Sync`).
#[derive(Debug)]
pub struct Producer {
    ends: Ends,
    /// Our own count of bytes published; the shared `tail` only mirrors it.
    tail: u32,
    /// See [`Producer::woke_peer`].
    woke: bool,
    /// See [`Producer::set_next_lag`].
    next_lag: u64,
}

impl Producer {
    /// A [`RingWaker`] of this ring.
    pub fn waker(&self) -> RingWaker {
        RingWaker(self.ends.clone())
    }

    pub(crate) fn new(map: Arc<Mapping>, off: usize, capacity: u32) -> Self {
        let ends = Ends::new(map, off, capacity);
        let tail = ends.header().tail.tail.load(Ordering::Acquire);
        Self {
            ends,
            tail,
            woke: false,
            next_lag: 0,
        }
    }

    /// The ring's capacity in bytes.
    pub fn capacity(&self) -> u32 {
        self.ends.capacity
    }

    /// Says, with the next message only, that it comes `ns` nanoseconds late because this
    /// side noticed the message it answers late ([`Consumer::wake_lag`]): the consumer's
    /// budget takes that out (`judged_wait`). Later messages say 0 unless set again.
    pub fn set_next_lag(&mut self, ns: u64) {
        self.next_lag = ns;
    }

    /// Publishes one message made of `parts`, if there is room now; `Ok(false)` when full.
    pub fn try_push(&mut self, parts: &[&[u8]]) -> Result<bool, RingError> {
        self.ends
            .push(&mut self.tail, parts, &mut self.woke, &mut self.next_lag)
    }

    /// Whether the last message published had to wake the consumer (it was asleep, and will
    /// answer a wake-up later than if it had been spinning).
    pub fn woke_peer(&self) -> bool {
        self.woke
    }

    /// The CPU the consumer ran on when it last took a message, as it says
    /// ([`crate::wait::say_cpu`]; `None`: not said). Advisory: the peer writes it, so it
    /// serves traces and placement at most (a server thread leaving its client's core).
    pub fn consumer_cpu(&self) -> Option<u32> {
        self.ends
            .header()
            .head
            .cpu
            .load(Ordering::Relaxed)
            .checked_sub(1)
    }

    /// Publishes one message, waiting for room (spin, then futex) while `alive()` holds.
    pub fn push(
        &mut self,
        parts: &[&[u8]],
        waiter: &mut Waiter,
        alive: impl Fn() -> bool,
    ) -> Result<(), RingError> {
        self.push_until(parts, waiter, alive, None).map(drop)
    }

    /// Publishes one message, waiting for room (spin, then futex) while `alive()` holds and
    /// `deadline` (if any) has not passed: `Ok(false)` when it passed with no room.
    /// `alive()` is asked after each sleep, so a dead consumer is noticed within a
    /// `SLEEP_SLICE`.
    pub fn push_until(
        &mut self,
        parts: &[&[u8]],
        waiter: &mut Waiter,
        alive: impl Fn() -> bool,
        deadline: Option<Instant>,
    ) -> Result<bool, RingError> {
        let need = padded(parts.iter().map(|p| p.len()).sum());
        let (ends, tail, woke) = (&self.ends, &mut self.tail, &mut self.woke);
        let next_lag = &mut self.next_lag;
        let (capacity, seen_tail) = (ends.capacity as usize, *tail);
        let h = ends.header();
        wait_for(
            waiter,
            deadline,
            alive,
            &h.producer_sleeping.0,
            &h.head.head,
            |head| {
                let used = seen_tail.wrapping_sub(head) as usize;
                used <= capacity && capacity - used < need
            },
            || ends.push(tail, parts, woke, next_lag),
            |_, _, took| took,
        )
    }
}

/// The consuming end of a ring. One thread at a time (it is `Send`, not `Sync`).
#[derive(Debug)]
pub struct Consumer {
    ends: Ends,
    /// Our own count of bytes consumed; the shared `head` only mirrors it.
    head: u32,
    /// See [`Consumer::wake_lag`].
    wake_lag: u64,
    /// See [`Consumer::peer_lag`].
    peer_lag: u64,
}

impl Consumer {
    /// A [`RingWaker`] of this ring.
    pub fn waker(&self) -> RingWaker {
        RingWaker(self.ends.clone())
    }

    pub(crate) fn new(map: Arc<Mapping>, off: usize, capacity: u32) -> Self {
        let ends = Ends::new(map, off, capacity);
        let head = ends.header().head.head.load(Ordering::Acquire);
        Self {
            ends,
            head,
            wake_lag: 0,
            peer_lag: 0,
        }
    }

    /// The ring's capacity in bytes.
    pub fn capacity(&self) -> u32 {
        self.ends.capacity
    }

    /// Takes the next message into `out` (replacing its contents) if one is there.
    pub fn try_pop(&mut self, out: &mut Vec<u8>) -> Result<bool, RingError> {
        self.ends.pop(&mut self.head, out)
    }

    /// Takes the next message, waiting (spin, then futex) while `alive()` holds.
    pub fn pop(
        &mut self,
        out: &mut Vec<u8>,
        waiter: &mut Waiter,
        alive: impl Fn() -> bool,
    ) -> Result<(), RingError> {
        self.pop_until(out, waiter, alive, None).map(drop)
    }

    /// Takes the next message, waiting (spin, then futex) while `alive()` holds and
    /// `deadline` (if any) has not passed: `Ok(false)` when it passed with nothing there.
    /// Messages the peer published before it went away are still delivered: `alive()` is
    /// asked only when the ring is empty after a sleep.
    pub fn pop_until(
        &mut self,
        out: &mut Vec<u8>,
        waiter: &mut Waiter,
        alive: impl Fn() -> bool,
        deadline: Option<Instant>,
    ) -> Result<bool, RingError> {
        let (ends, head) = (&self.ends, &mut self.head);
        let seen_head = *head;
        let h = ends.header();
        let mut lag = 0;
        let mut peer_lag = self.peer_lag;
        let r = wait_for(
            waiter,
            deadline,
            alive,
            &h.consumer_sleeping.0,
            &h.tail.tail,
            |tail| tail == seen_head,
            || ends.pop(head, out),
            |got, outcome, took| {
                if !got {
                    return took;
                }
                let posted = h.tail.posted_ns.load(Ordering::Relaxed);
                // The peer's word, bounded (a second: no wake-up is longer) so that no
                // arithmetic on it can overflow, whatever a hostile peer writes.
                let said = h.tail.lag_ns.load(Ordering::Relaxed).min(1_000_000_000);
                let (learn, own) = judged_wait(outcome, took, posted, said);
                if said != 0 {
                    peer_lag = if peer_lag == 0 {
                        said
                    } else {
                        (peer_lag * 3 + said) / 4
                    };
                }
                lag = own;
                learn
            },
        );
        self.wake_lag = lag;
        self.peer_lag = peer_lag;
        r
    }

    /// How late the producer usually notices a message when it sleeps (a running mean of the
    /// wake-up lags it said, in nanoseconds; 0 until it said one).
    pub fn peer_lag(&self) -> u64 {
        self.peer_lag
    }

    /// How late (nanoseconds) the last wait noticed its message because it slept (0 when it
    /// spun, found it at once, or the producer does not stamp): for the peer's budget, with
    /// the answer on the session's other ring ([`Producer::set_next_lag`]).
    pub fn wake_lag(&self) -> u64 {
        self.wake_lag
    }
}

/// Fuzzing: `data` is a script of ring operations on one 64-byte ring in private memory —
/// pushes of arbitrary messages, arbitrary writes of the shared indices and of message bytes
/// (what a hostile peer can do), and pops. The consumer and producer must never panic, read
/// or write outside the ring, or allocate more than the ring holds; they may only fail with
/// [`RingError`].
pub fn fuzz_consumer(data: &[u8]) {
    const CAP: u32 = 64;
    let Ok(map) = Mapping::anonymous(4096) else {
        return;
    };
    let map = Arc::new(map);
    let mut prod = Producer::new(Arc::clone(&map), 0, CAP);
    let mut cons = Consumer::new(Arc::clone(&map), 0, CAP);
    let mut out = Vec::new();
    let mut it = data.iter().copied();
    while let Some(op) = it.next() {
        let arg = |it: &mut dyn Iterator<Item = u8>| {
            u32::from_le_bytes([
                it.next().unwrap_or(0),
                it.next().unwrap_or(0),
                it.next().unwrap_or(0),
                it.next().unwrap_or(0),
            ])
        };
        match op % 6 {
            0 => {
                let n = it.next().unwrap_or(0) as usize % 80;
                let msg: Vec<u8> = (&mut it).take(n).collect();
                let _ = prod.try_push(&[&msg]);
            }
            1 => {
                if let Ok(true) = cons.try_pop(&mut out) {
                    assert!(out.len() <= CAP as usize);
                }
            }
            2 => {
                let v = arg(&mut it);
                cons.ends.header().tail.tail.store(v, Ordering::Release);
            }
            3 => {
                let v = arg(&mut it);
                prod.ends.header().head.head.store(v, Ordering::Release);
            }
            4 => {
                let pos = it.next().unwrap_or(0) as u32;
                let v = arg(&mut it);
                prod.ends.write(pos & !3, &v.to_le_bytes());
            }
            _ => {
                let _ = cons.try_pop(&mut out);
                let _ = prod.try_push(&[b"abc", b"defgh"]);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pair(cap: u32) -> (Producer, Consumer) {
        let map = Arc::new(Mapping::anonymous(RING_HEADER + cap as usize).unwrap());
        (
            Producer::new(Arc::clone(&map), 0, cap),
            Consumer::new(map, 0, cap),
        )
    }

    #[test]
    fn the_consumer_cpu_is_what_the_consumer_said_or_none() {
        let (p, c) = pair(64);
        assert_eq!(
            p.consumer_cpu(),
            None,
            "not said: an older peer, or waits not traced"
        );
        c.ends.header().head.cpu.store(1, Ordering::Relaxed);
        assert_eq!(p.consumer_cpu(), Some(0));
        // Whatever a hostile peer writes is only a number for traces.
        c.ends.header().head.cpu.store(u32::MAX, Ordering::Relaxed);
        assert_eq!(p.consumer_cpu(), Some(u32::MAX - 1));
    }

    #[test]
    fn messages_wrap_around_and_keep_their_bytes() {
        let (mut p, mut c) = pair(64);
        let mut out = Vec::new();
        for i in 0..200u32 {
            let len = (i as usize * 7) % 41;
            let msg: Vec<u8> = (0..len).map(|k| (k as u32 * 31 + i) as u8).collect();
            assert!(p.try_push(&[&msg[..len / 2], &msg[len / 2..]]).unwrap());
            assert!(c.try_pop(&mut out).unwrap());
            assert_eq!(out, msg, "message {i}");
        }
        assert!(!c.try_pop(&mut out).unwrap());
    }

    #[test]
    fn a_full_ring_refuses_until_the_consumer_frees_room() {
        let (mut p, mut c) = pair(64);
        // 4 + 28 = 32 bytes each: two fit, a third does not.
        assert!(p.try_push(&[&[1u8; 28]]).unwrap());
        assert!(p.try_push(&[&[2u8; 28]]).unwrap());
        assert!(!p.try_push(&[&[3u8; 28]]).unwrap());
        let mut out = Vec::new();
        assert!(c.try_pop(&mut out).unwrap());
        assert_eq!(out, [1u8; 28]);
        assert!(p.try_push(&[&[3u8; 28]]).unwrap());
        assert_eq!(
            p.try_push(&[&[0u8; 61]]),
            Err(RingError::TooLarge {
                len: 61,
                capacity: 64
            })
        );
    }

    #[test]
    fn hostile_indices_and_lengths_are_corrupt_not_crashes() {
        let (mut p, mut c) = pair(64);
        let mut out = Vec::new();
        // tail - head > size.
        c.ends.header().tail.tail.store(65, Ordering::Release);
        assert!(matches!(c.try_pop(&mut out), Err(RingError::Corrupt(_))));
        c.ends.header().tail.tail.store(6, Ordering::Release);
        assert!(matches!(c.try_pop(&mut out), Err(RingError::Corrupt(_))));
        // A length word larger than what was published.
        p.ends.write(0, &1000u32.to_le_bytes());
        c.ends.header().tail.tail.store(8, Ordering::Release);
        assert!(matches!(c.try_pop(&mut out), Err(RingError::Corrupt(_))));
        // A consumer index moved past the producer's.
        p.ends.header().head.head.store(100, Ordering::Release);
        assert!(matches!(p.try_push(&[b"x"]), Err(RingError::Corrupt(_))));
    }

    #[test]
    fn threads_exchange_a_million_messages_with_spin_then_sleep() {
        let (mut p, mut c) = pair(4096);
        let n = 200_000u32;
        let t = std::thread::spawn(move || {
            let mut w = Waiter::new(Duration::from_micros(1), Duration::from_micros(20));
            let mut out = Vec::new();
            let mut sum = 0u64;
            for i in 0..n {
                c.pop(&mut out, &mut w, || true).unwrap();
                assert_eq!(out.len(), (i % 100) as usize + 4);
                assert_eq!(&out[..4], &i.to_le_bytes());
                sum += out.len() as u64;
            }
            sum
        });
        let mut w = Waiter::new(Duration::from_micros(1), Duration::from_micros(20));
        let mut expect = 0u64;
        for i in 0..n {
            let pad = vec![7u8; (i % 100) as usize];
            p.push(&[&i.to_le_bytes(), &pad], &mut w, || true).unwrap();
            expect += pad.len() as u64 + 4;
        }
        assert_eq!(t.join().unwrap(), expect);
    }

    #[test]
    fn a_wait_learns_what_it_would_have_taken_had_both_sides_spun() {
        let us = Duration::from_micros;
        // No stamps (an older producer): the wait as it was.
        assert_eq!(judged_wait(WaitOutcome::Slept, us(300), 0, 0), (us(300), 0));
        // Slept 110 µs; the message was posted ~10 µs in, and the peer had woken 5 µs late
        // before it answered: the budget learns at most 5 µs, and we were ~100 µs late.
        let t0 = mono_ns();
        let posted = t0 - 100_000;
        let (learn, own) = judged_wait(WaitOutcome::Slept, us(110), posted, 5_000);
        assert!(learn <= us(5), "{learn:?}");
        assert!(own >= 100_000, "{own}");
        // Spun: no lag of our own; a message "posted" before the wait began counts as 0.
        let (learn, own) = judged_wait(WaitOutcome::Spun, us(3), mono_ns() - 1_000_000, 0);
        assert_eq!((learn, own), (Duration::ZERO, 0));
    }

    #[test]
    fn hostile_stamps_only_bound_the_budget() {
        let (mut p, mut c) = pair(64);
        let t = std::thread::spawn(move || {
            let mut w = Waiter::with_bounds(Duration::from_micros(2), Duration::from_micros(50));
            let mut out = Vec::new();
            for _ in 0..3 {
                // Each message comes while this side waits, so its stamps are judged.
                c.pop(&mut out, &mut w, || true).unwrap();
                assert!(w.budget() <= Duration::from_micros(50));
                assert!(c.peer_lag() <= 1_000_000_000);
            }
        });
        for lag in [u64::MAX, u64::MAX - 1, 3] {
            std::thread::sleep(Duration::from_millis(5));
            p.set_next_lag(lag);
            assert!(p.try_push(&[b"x"]).unwrap());
            p.ends
                .header()
                .tail
                .posted_ns
                .store(u64::MAX, Ordering::Relaxed);
        }
        t.join().unwrap();
    }

    #[test]
    fn a_consumer_that_slept_reports_its_lag_and_the_producer_stamps() {
        let (mut p, mut c) = pair(64);
        let t = std::thread::spawn(move || {
            let mut w = Waiter::with_bounds(Duration::ZERO, Duration::ZERO);
            let mut out = Vec::new();
            c.pop(&mut out, &mut w, || true).unwrap();
            (
                c.wake_lag(),
                c.ends.header().tail.posted_ns.load(Ordering::Relaxed),
            )
        });
        std::thread::sleep(Duration::from_millis(20));
        let mut w = Waiter::with_bounds(Duration::ZERO, Duration::ZERO);
        p.push(&[b"x"], &mut w, || true).unwrap();
        let (wake_lag, posted) = t.join().unwrap();
        assert!(posted > 0);
        // It slept on the futex: noticed after the publish, by a measured amount.
        assert!(wake_lag > 0 && wake_lag < 1_000_000_000, "{wake_lag}");
        // A lag goes with the next message only.
        p.set_next_lag(wake_lag);
        assert!(p.try_push(&[b"y"]).unwrap());
        assert_eq!(
            p.ends.header().tail.lag_ns.load(Ordering::Relaxed),
            wake_lag
        );
        assert!(p.try_push(&[b"z"]).unwrap());
        assert_eq!(p.ends.header().tail.lag_ns.load(Ordering::Relaxed), 0);
    }

    #[test]
    fn a_sleeping_consumer_notices_a_dead_peer() {
        let (_p, mut c) = pair(64);
        let mut w = Waiter::new(Duration::ZERO, Duration::ZERO);
        let start = std::time::Instant::now();
        let mut out = Vec::new();
        assert_eq!(c.pop(&mut out, &mut w, || false), Err(RingError::PeerGone));
        assert!(start.elapsed() < Duration::from_secs(2));
    }

    #[test]
    fn a_spinning_consumer_keeps_its_deadline_and_notices_a_dead_peer() {
        let (_p, mut c) = pair(64);
        // The spin policy's bounds: a second of spinning per wait.
        let mut w = Waiter::with_bounds(Duration::from_secs(1), Duration::from_secs(1));
        let mut out = Vec::new();
        // A live peer: the wait ends at its deadline, not after the second's spin.
        let start = std::time::Instant::now();
        let deadline = Some(start + Duration::from_millis(30));
        assert_eq!(c.pop_until(&mut out, &mut w, || true, deadline), Ok(false));
        assert!(
            start.elapsed() < Duration::from_millis(500),
            "{:?}",
            start.elapsed()
        );
        // A dead one, with the deadline already passed at the sleep: said as gone.
        let start = std::time::Instant::now();
        let deadline = Some(start + Duration::from_millis(30));
        assert_eq!(
            c.pop_until(&mut out, &mut w, || false, deadline),
            Err(RingError::PeerGone)
        );
        assert!(
            start.elapsed() < Duration::from_millis(500),
            "{:?}",
            start.elapsed()
        );
    }

    #[test]
    fn fuzz_script_smoke() {
        fuzz_consumer(&[
            0, 5, 1, 2, 3, 4, 5, 1, 2, 200, 0, 0, 0, 1, 3, 9, 9, 9, 9, 5, 4, 3, 1, 2, 3, 4, 1,
        ]);
        let bytes: Vec<u8> = (0..4096u32)
            .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
            .collect();
        fuzz_consumer(&bytes);
    }
}
