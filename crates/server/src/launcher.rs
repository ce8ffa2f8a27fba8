//! A session's launch thread (issue 12 §5): during a burst of kernel launches the connection
//! thread reads and resolves each launch (decoding, handle lookups, parameter checks, the
//! function's first load) while a thread of the session's own makes the driver's launch calls,
//! so that reading the next launch overlaps the driver's work on the previous one. The
//! driver's launch call alone takes about as long as a whole native launch (3.1-3.6 µs on the
//! H100 host against 2.9-3.7 µs), so a burst served on one thread is bound by the two added up.
//!
//! Ordering: a launch is queued only behind other queued launches; every other call of the
//! session waits until the queue is empty before it runs ([`Launcher::drain`], called by
//! `RemoraService::dispatch`), so each call sees every launch the client made before it, as
//! on the connection thread alone. A launch that fails in the driver defers its error exactly
//! as a launch run on the connection thread does, and the next synchronizing call (which
//! drains first) reports it.
//!
//! When: only a launch that follows the previous one closely (the client is sending a burst:
//! the next launch was already waiting when the previous finished) and only while the host
//! has a core to spare ([`remora_shm::cores_to_spare`]) starts or wakes the thread; a launch
//! followed by a synchronize (a round trip) runs on the connection thread, with no hand-off.
//! An awake thread takes the next launch that follows closely; after its last launch it spins
//! for [`HOT_SPIN`], then parks. `REMORA_LAUNCH_THREAD=on|off|auto` (auto by default) forces it.
//!
//! The queue is a ring of [`QUEUE_MAX`] reusable slots, each holding a copy of one launch
//! (its parameters copied in, so nothing is allocated or reference-counted across the two
//! threads per launch: each shared cache line moved between cores costs ~0.1 µs, and a
//! queue of boxed closures moved ~8 of them per launch, measured as ~1 µs over the driver's
//! call). A connection thread whose launch does not fit waits, as a native launch waits when
//! the device's queue is full.

use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock, PoisonError};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

use remora_proto::remora::RmLaunchAttr;

/// One queued launch: what the driver call needs, in raw (backend) objects, with its
/// buffers kept between uses.
#[derive(Default, Debug)]
pub(crate) struct LaunchSlot {
    pub(crate) ctx: u64,
    pub(crate) function: u64,
    pub(crate) grid: [u32; 3],
    pub(crate) block: [u32; 3],
    pub(crate) shared_mem_bytes: u32,
    pub(crate) stream: u64,
    pub(crate) params: Vec<u8>,
    pub(crate) layout: Vec<(u32, u32)>,
    pub(crate) attrs: Vec<RmLaunchAttr>,
    /// The call's (context handle, stream handle), for its deferred error.
    pub(crate) on: (u64, u64),
    /// Time the driver call (`remora serve --profile`).
    pub(crate) profile: bool,
}

/// Bytes a slot's buffers keep between launches: larger ones (parameters may take 32 KiB)
/// are given back when a smaller launch reuses the slot, so a session's 256 slots hold at
/// most ~1 MiB after a burst of large launches.
const SLOT_KEEP_BYTES: usize = 4096;

impl LaunchSlot {
    /// Copies `from` into `to`, giving back room beyond [`SLOT_KEEP_BYTES`] it no longer needs.
    pub(crate) fn refill<T: Copy>(to: &mut Vec<T>, from: &[T]) {
        let keep = SLOT_KEEP_BYTES / std::mem::size_of::<T>().max(1);
        to.clear();
        if to.capacity() > keep && from.len() <= keep {
            to.shrink_to(keep);
        }
        to.extend_from_slice(from);
    }
}

/// Makes queued launches, on the launch thread.
pub(crate) trait Runner: Send + 'static {
    /// Makes `slot`'s launch; its error is the runner's to defer.
    fn run(&self, slot: &LaunchSlot);
}

/// Whether sessions overlap reading launches with making them (`REMORA_LAUNCH_THREAD`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LaunchThread {
    /// During bursts, while the host has a core to spare (the default).
    Auto,
    /// Every launch goes through the launch thread (for tests and comparisons).
    Always,
    /// Every launch runs on the thread that read it.
    Never,
}

impl LaunchThread {
    /// `REMORA_LAUNCH_THREAD`: `auto` (or unset), `on`, `off`; anything else is logged and
    /// read as `auto`.
    pub fn from_env() -> Self {
        match std::env::var("REMORA_LAUNCH_THREAD") {
            Err(_) => Self::Auto,
            Ok(v) => Self::parse(&v).unwrap_or_else(|| {
                tracing::warn!(
                    value = %v,
                    "REMORA_LAUNCH_THREAD is auto, on or off; using auto"
                );
                Self::Auto
            }),
        }
    }

    /// `auto`, `on`/`always`, `off`/`never`.
    pub fn parse(s: &str) -> Option<Self> {
        match s.trim() {
            "auto" | "" => Some(Self::Auto),
            "on" | "always" => Some(Self::Always),
            "off" | "never" => Some(Self::Never),
            _ => None,
        }
    }

    pub(crate) fn to_u8(self) -> u8 {
        match self {
            Self::Auto => 0,
            Self::Always => 1,
            Self::Never => 2,
        }
    }

    pub(crate) fn from_u8(v: u8) -> Self {
        match v {
            1 => Self::Always,
            2 => Self::Never,
            _ => Self::Auto,
        }
    }
}

/// Launches queued at most; the connection thread waits for room past it.
pub(crate) const QUEUE_MAX: usize = 256;
/// How long the launch thread spins for the next launch before it parks.
pub(crate) const HOT_SPIN: Duration = Duration::from_micros(50);
/// A launch read within this long of the previous one (its end when run on the connection
/// thread, its queueing otherwise) continues a burst; a synchronize's round trip between two
/// launches takes longer.
const BURST_GAP_NS: u64 = 2_000;
/// Launches in a row continuing a burst before the thread is woken (its wake-up costs the
/// connection thread a system call, worth it only when more launches follow).
const BURST_STREAK: u32 = 3;

/// An executor's counts over all its sessions' launch threads.
#[derive(Default)]
pub(crate) struct LaunchCounts {
    /// Launches queued and not yet made: while none is, no call needs to look for its
    /// session's queue.
    pub(crate) pending: AtomicUsize,
    /// Launches ever queued.
    pub(crate) queued: AtomicU64,
}

/// A value alone on its cache lines (two, for the adjacent-line prefetcher).
#[repr(align(128))]
#[derive(Default)]
struct Padded<T>(T);

struct Ring {
    slots: Box<[Padded<Mutex<LaunchSlot>>]>,
    /// Launches queued so far (the next slot the connection thread fills is `head % len`).
    head: Padded<AtomicUsize>,
    /// Launches made so far.
    tail: Padded<AtomicUsize>,
    /// The thread is parked, or about to be: a submitter must unpark it.
    parked: Padded<AtomicBool>,
    closing: AtomicBool,
    /// The executor's counts.
    all: Arc<LaunchCounts>,
}

impl Ring {
    fn slot(&self, n: usize) -> MutexGuard<'_, LaunchSlot> {
        self.slots[n % self.slots.len()]
            .0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    fn pending(&self) -> usize {
        let tail = self.tail.0.load(Ordering::Acquire);
        self.head.0.load(Ordering::Acquire).wrapping_sub(tail)
    }
}

struct Running {
    ring: Arc<Ring>,
    thread: Thread,
    handle: Mutex<Option<JoinHandle<()>>>,
    /// The connection thread's side: the head it publishes (the lock makes a second
    /// submitter wait instead of breaking the ring).
    producer: Mutex<usize>,
}

/// Where a launch runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Route {
    /// On the thread that read it, now.
    Here,
    /// Through [`Launcher::submit`].
    Queue,
}

/// A session's launch thread, started at its first burst.
pub(crate) struct Launcher {
    name: String,
    policy: AtomicU8,
    all: Arc<LaunchCounts>,
    running: OnceLock<Running>,
    /// The thread could not be started (logged once): launches run where they are read.
    failed: AtomicBool,
    epoch: Instant,
    /// When the last launch was queued, or ended when run on the connection thread (ns since
    /// `epoch`): a launch read within [`BURST_GAP_NS`] of it continues a burst.
    last_seen: AtomicU64,
    /// Launches in a row that continued a burst.
    streak: AtomicU32,
}

impl Launcher {
    /// A launcher whose thread is named `name`, counting its launches in `all` too.
    pub(crate) fn new(name: String, policy: LaunchThread, all: Arc<LaunchCounts>) -> Self {
        Self {
            name,
            policy: AtomicU8::new(policy.to_u8()),
            all,
            running: OnceLock::new(),
            failed: AtomicBool::new(false),
            epoch: Instant::now(),
            last_seen: AtomicU64::new(0),
            streak: AtomicU32::new(0),
        }
    }

    fn now_ns(&self) -> u64 {
        self.epoch.elapsed().as_nanos() as u64 + 1
    }

    /// Where the next launch runs; called by the connection thread, before each launch.
    /// `runner` makes the thread's [`Runner`] if this starts it.
    pub(crate) fn route(&self, runner: impl FnOnce() -> Box<dyn Runner>) -> Route {
        let now = self.now_ns();
        let running = self.running.get();
        if running.is_some_and(|r| r.ring.pending() > 0) {
            // Behind queued launches: order.
            self.last_seen.store(now, Ordering::Relaxed);
            return Route::Queue;
        }
        if self.failed.load(Ordering::Relaxed) {
            return Route::Here;
        }
        let route = match LaunchThread::from_u8(self.policy.load(Ordering::Relaxed)) {
            LaunchThread::Never => Route::Here,
            LaunchThread::Always => self.queue_if_started(runner),
            LaunchThread::Auto => {
                let last = self.last_seen.load(Ordering::Relaxed);
                let close = last != 0 && now.saturating_sub(last) < BURST_GAP_NS;
                let streak = if close {
                    self.streak.load(Ordering::Relaxed).saturating_add(1)
                } else {
                    0
                };
                self.streak.store(streak, Ordering::Relaxed);
                // An awake thread costs no wake-up: one close launch is enough for it. Either
                // way only with a core to spare: on a busy host the two threads would take
                // turns on one core, and a call waiting for the queue would wait for that.
                let awake = running.is_some_and(|r| !r.ring.parked.0.load(Ordering::Relaxed));
                let needed = if awake { 1 } else { BURST_STREAK };
                if streak >= needed && remora_shm::cores_to_spare() {
                    self.queue_if_started(runner)
                } else {
                    Route::Here
                }
            }
        };
        if route == Route::Queue {
            self.last_seen.store(now, Ordering::Relaxed);
        }
        route
    }

    /// A launch run [`Route::Here`] has ended.
    pub(crate) fn ran_here(&self) {
        self.last_seen.store(self.now_ns(), Ordering::Relaxed);
    }

    fn queue_if_started(&self, runner: impl FnOnce() -> Box<dyn Runner>) -> Route {
        if self.start(runner).is_some() {
            Route::Queue
        } else {
            Route::Here
        }
    }

    fn start(&self, runner: impl FnOnce() -> Box<dyn Runner>) -> Option<&Running> {
        if let Some(r) = self.running.get() {
            return Some(r);
        }
        let ring = Arc::new(Ring {
            slots: (0..QUEUE_MAX).map(|_| Padded::default()).collect(),
            head: Padded::default(),
            tail: Padded::default(),
            parked: Padded(AtomicBool::new(true)),
            closing: AtomicBool::new(false),
            all: Arc::clone(&self.all),
        });
        let r = Arc::clone(&ring);
        let runner = runner();
        match std::thread::Builder::new()
            .name(self.name.clone())
            .spawn(move || run(&r, &*runner))
        {
            Ok(handle) => {
                let thread = handle.thread().clone();
                // Only the connection thread starts it: the cell is empty here.
                let _ = self.running.set(Running {
                    ring,
                    thread,
                    handle: Mutex::new(Some(handle)),
                    producer: Mutex::new(0),
                });
                tracing::debug!(thread = %self.name, "launch thread started");
                self.running.get()
            }
            Err(e) => {
                self.failed.store(true, Ordering::Relaxed);
                tracing::warn!(error = %e, "cannot start a launch thread; launches run on the connection thread");
                None
            }
        }
    }

    /// Queues a launch routed [`Route::Queue`], written into its slot by `fill`: it is made
    /// after every launch queued before it. Waits while [`QUEUE_MAX`] launches are queued.
    /// False when the thread was never started or is closing: the caller makes the launch
    /// itself (the queued ones are made by then).
    pub(crate) fn submit(&self, fill: impl FnOnce(&mut LaunchSlot)) -> bool {
        let Some(r) = self.running.get() else {
            return false;
        };
        let ring = &r.ring;
        if ring.closing.load(Ordering::Acquire) {
            self.drain();
            return false;
        }
        let mut head = r.producer.lock().unwrap_or_else(PoisonError::into_inner);
        if head.wrapping_sub(ring.tail.0.load(Ordering::Acquire)) >= QUEUE_MAX {
            let mut backoff = Backoff::new();
            while head.wrapping_sub(ring.tail.0.load(Ordering::Acquire)) >= QUEUE_MAX {
                backoff.wait("room in the session's launch queue");
            }
        }
        fill(&mut ring.slot(*head));
        *head = head.wrapping_add(1);
        ring.all.pending.fetch_add(1, Ordering::SeqCst);
        ring.all.queued.fetch_add(1, Ordering::Relaxed);
        // Published SeqCst against the thread's `parked`: either the thread sees the launch
        // before it parks, or this sees it parked and wakes it.
        ring.head.0.store(*head, Ordering::SeqCst);
        if ring.parked.0.load(Ordering::SeqCst) {
            r.thread.unpark();
        }
        true
    }

    /// Launches queued and not finished.
    #[cfg(test)]
    pub(crate) fn pending(&self) -> usize {
        self.running.get().map_or(0, |r| r.ring.pending())
    }

    /// Waits until every queued launch has been made (their effects, deferred errors
    /// included, are visible to the caller).
    pub(crate) fn drain(&self) {
        let Some(r) = self.running.get() else {
            return;
        };
        // Never on the launch thread itself (its launch in progress counts as pending): a
        // launch that held the session's last reference would wait for itself.
        if r.ring.pending() == 0 || std::thread::current().id() == r.thread.id() {
            return;
        }
        let mut backoff = Backoff::new();
        while r.ring.pending() != 0 {
            backoff.wait("the session's queued launches");
        }
    }

    /// Makes the queued launches, then stops the thread (joined unless this is it). Later
    /// submissions are refused.
    pub(crate) fn close(&self) {
        let Some(r) = self.running.get() else {
            return;
        };
        self.drain();
        r.ring.closing.store(true, Ordering::SeqCst);
        r.thread.unpark();
        let handle = r
            .handle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(h) = handle {
            crate::waiters::join_unless_current(h);
        }
    }
}

impl Drop for Launcher {
    fn drop(&mut self) {
        self.close();
    }
}

/// Spins, then yields, then sleeps: waits that are usually a launch or two long, but may be
/// as long as the device takes to make room in its own queue. Logs once past 10 s.
struct Backoff {
    start: Instant,
    logged: bool,
}

impl Backoff {
    fn new() -> Self {
        Self {
            start: Instant::now(),
            logged: false,
        }
    }

    fn wait(&mut self, what: &str) {
        let waited = self.start.elapsed();
        if waited < Duration::from_micros(50) {
            std::hint::spin_loop();
        } else if waited < Duration::from_millis(1) {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(50));
            if !self.logged && waited > Duration::from_secs(10) {
                self.logged = true;
                tracing::warn!(
                    waited_s = waited.as_secs(),
                    "still waiting for {what}: the device is not taking launches (a kernel that does not end?)"
                );
            }
        }
    }
}

fn run(ring: &Ring, runner: &dyn Runner) {
    let mut tail = 0usize;
    let mut idle_since: Option<Instant> = None;
    loop {
        let head = ring.head.0.load(Ordering::Acquire);
        if head != tail {
            while tail != head {
                let slot = ring.slot(tail);
                if catch_unwind(AssertUnwindSafe(|| runner.run(&slot))).is_err() {
                    tracing::error!("a kernel launch panicked on the launch thread");
                }
                drop(slot);
                tail = tail.wrapping_add(1);
                ring.tail.0.store(tail, Ordering::Release);
                ring.all.pending.fetch_sub(1, Ordering::Release);
            }
            idle_since = None;
            continue;
        }
        if ring.closing.load(Ordering::Acquire) {
            return;
        }
        let since = *idle_since.get_or_insert_with(Instant::now);
        if since.elapsed() < HOT_SPIN {
            std::hint::spin_loop();
            continue;
        }
        ring.parked.0.store(true, Ordering::SeqCst);
        if ring.head.0.load(Ordering::SeqCst) == tail && !ring.closing.load(Ordering::SeqCst) {
            // A wake-up is never lost (the head is read after `parked` is set, and an unpark
            // before the park makes it return); the timeout is a second guard.
            std::thread::park_timeout(Duration::from_millis(100));
        }
        ring.parked.0.store(false, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Records the `function` of each launch it makes; sleeps 200 µs for function 64·k and
    /// panics for `u64::MAX`.
    struct Recorder(Arc<Mutex<Vec<u64>>>);

    impl Runner for Recorder {
        fn run(&self, slot: &LaunchSlot) {
            if slot.function == u64::MAX {
                panic!("boom");
            }
            if slot.function.is_multiple_of(64) {
                std::thread::sleep(Duration::from_micros(200));
            }
            assert_eq!(
                slot.params[slot.params.len() - 8..],
                slot.function.to_le_bytes(),
                "the slot's own bytes"
            );
            self.0.lock().unwrap().push(slot.function);
        }
    }

    fn launcher(policy: LaunchThread) -> (Launcher, Arc<LaunchCounts>, Arc<Mutex<Vec<u64>>>) {
        let all = Arc::new(LaunchCounts::default());
        (
            Launcher::new("test-launch".into(), policy, Arc::clone(&all)),
            all,
            Arc::default(),
        )
    }

    fn queue(l: &Launcher, seen: &Arc<Mutex<Vec<u64>>>, function: u64) {
        let s = Arc::clone(seen);
        assert_eq!(l.route(|| Box::new(Recorder(s))), Route::Queue);
        assert!(l.submit(|slot| {
            slot.function = function;
            // Every 100th launch a large one, so that slots grow and give room back.
            let big = vec![0u8; if function % 100 == 1 { 32 << 10 } else { 0 }];
            LaunchSlot::refill(&mut slot.params, &big);
            slot.params.extend_from_slice(&function.to_le_bytes());
            if function % 100 != 1 {
                assert!(slot.params.capacity() <= SLOT_KEEP_BYTES, "room given back");
            }
        }));
    }

    #[test]
    fn queued_launches_run_in_order_and_drain_waits_for_them() {
        let (l, all, seen) = launcher(LaunchThread::Always);
        let n = (QUEUE_MAX * 2) as u64;
        for round in 0..20u64 {
            for i in 0..n {
                queue(&l, &seen, i);
                assert!(l.pending() <= QUEUE_MAX, "the queue is bounded");
            }
            l.drain();
            assert_eq!(l.pending(), 0);
            assert_eq!(all.pending.load(Ordering::SeqCst), 0);
            let got = std::mem::take(&mut *seen.lock().unwrap());
            assert_eq!(got, (0..n).collect::<Vec<_>>(), "round {round}");
            assert_eq!(all.queued.load(Ordering::SeqCst), (round + 1) * n);
            if round % 5 == 4 {
                // Let the thread park; the next launch must wake it.
                std::thread::sleep(HOT_SPIN * 4);
            }
        }
        l.close();
        assert!(!l.submit(|_| {}), "closed: the caller makes the launch");
    }

    #[test]
    fn a_parked_thread_is_woken_every_time() {
        let (l, _, seen) = launcher(LaunchThread::Always);
        for n in 1..=200u64 {
            queue(&l, &seen, n);
            let start = Instant::now();
            l.drain();
            assert!(
                start.elapsed() < Duration::from_millis(90),
                "woken by the submission, not by the park's timeout"
            );
            assert_eq!(seen.lock().unwrap().len() as u64, n);
            if n % 20 == 0 {
                std::thread::sleep(HOT_SPIN * 3);
            }
        }
    }

    #[test]
    fn never_and_isolated_launches_stay_on_the_reading_thread() {
        let (l, _, seen) = launcher(LaunchThread::Never);
        for _ in 0..10 {
            let s = Arc::clone(&seen);
            assert_eq!(l.route(|| Box::new(Recorder(s))), Route::Here);
            l.ran_here();
        }
        assert!(l.running.get().is_none(), "no thread started");
        assert!(!l.submit(|_| {}), "no thread: the caller makes the launch");
        // Auto: launches far apart (a launch, then a synchronize's round trip) never queue.
        let (l, _, seen) = launcher(LaunchThread::Auto);
        for _ in 0..10 {
            let s = Arc::clone(&seen);
            assert_eq!(l.route(|| Box::new(Recorder(s))), Route::Here);
            l.ran_here();
            std::thread::sleep(Duration::from_micros(100));
        }
        assert!(l.running.get().is_none(), "no thread started");
    }

    #[test]
    fn a_panicking_launch_does_not_stop_the_queue() {
        let (l, all, seen) = launcher(LaunchThread::Always);
        queue(&l, &seen, u64::MAX);
        queue(&l, &seen, 7);
        l.drain();
        assert_eq!(*seen.lock().unwrap(), [7]);
        assert_eq!(all.pending.load(Ordering::SeqCst), 0);
    }

    #[test]
    fn the_policy_is_read_from_its_names() {
        assert_eq!(LaunchThread::parse("auto"), Some(LaunchThread::Auto));
        assert_eq!(LaunchThread::parse("on"), Some(LaunchThread::Always));
        assert_eq!(LaunchThread::parse("off"), Some(LaunchThread::Never));
        assert_eq!(LaunchThread::parse("sometimes"), None);
        for p in [
            LaunchThread::Auto,
            LaunchThread::Always,
            LaunchThread::Never,
        ] {
            assert_eq!(LaunchThread::from_u8(p.to_u8()), p);
        }
    }
}
