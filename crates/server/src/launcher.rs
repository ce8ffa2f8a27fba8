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
//! The queue is bounded ([`QUEUE_MAX`]): a connection thread whose launch does not fit waits,
//! as a native launch waits when the device's queue is full.

use std::collections::VecDeque;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::atomic::{AtomicBool, AtomicU8, AtomicU32, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, OnceLock, PoisonError};
use std::thread::{JoinHandle, Thread};
use std::time::{Duration, Instant};

/// One launch, deferring its own error.
pub(crate) type Job = Box<dyn FnOnce() + Send + 'static>;

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

struct Shared {
    jobs: Mutex<VecDeque<Job>>,
    /// Launches submitted and not finished (set before a launch is pushed).
    pending: AtomicUsize,
    /// The thread is parked, or about to be: a submitter must unpark it.
    parked: AtomicBool,
    closing: AtomicBool,
    /// The executor's counts.
    all: Arc<LaunchCounts>,
}

struct Running {
    shared: Arc<Shared>,
    thread: Thread,
    handle: Mutex<Option<JoinHandle<()>>>,
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
    pub(crate) fn route(&self) -> Route {
        let now = self.now_ns();
        let running = self.running.get();
        if running.is_some_and(|r| r.shared.pending.load(Ordering::Acquire) > 0) {
            // Behind queued launches: order.
            self.last_seen.store(now, Ordering::Relaxed);
            return Route::Queue;
        }
        if self.failed.load(Ordering::Relaxed) {
            return Route::Here;
        }
        let route = match LaunchThread::from_u8(self.policy.load(Ordering::Relaxed)) {
            LaunchThread::Never => Route::Here,
            LaunchThread::Always => self.queue_if_started(),
            LaunchThread::Auto => {
                let last = self.last_seen.load(Ordering::Relaxed);
                let close = last != 0 && now.saturating_sub(last) < BURST_GAP_NS;
                let streak = if close {
                    self.streak.load(Ordering::Relaxed).saturating_add(1)
                } else {
                    0
                };
                self.streak.store(streak, Ordering::Relaxed);
                // An awake thread costs no wake-up: one close launch is enough for it.
                let awake = running.is_some_and(|r| !r.shared.parked.load(Ordering::Relaxed));
                let needed = if awake { 1 } else { BURST_STREAK };
                if streak >= needed && (awake || remora_shm::cores_to_spare()) {
                    self.queue_if_started()
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

    fn queue_if_started(&self) -> Route {
        if self.start().is_some() {
            Route::Queue
        } else {
            Route::Here
        }
    }

    fn start(&self) -> Option<&Running> {
        if let Some(r) = self.running.get() {
            return Some(r);
        }
        let shared = Arc::new(Shared {
            jobs: Mutex::new(VecDeque::with_capacity(QUEUE_MAX)),
            pending: AtomicUsize::new(0),
            parked: AtomicBool::new(true),
            closing: AtomicBool::new(false),
            all: Arc::clone(&self.all),
        });
        let s = Arc::clone(&shared);
        match std::thread::Builder::new()
            .name(self.name.clone())
            .spawn(move || run(&s))
        {
            Ok(handle) => {
                let thread = handle.thread().clone();
                // Only the connection thread starts it: the cell is empty here.
                let _ = self.running.set(Running {
                    shared,
                    thread,
                    handle: Mutex::new(Some(handle)),
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

    /// Queues `job` (a launch routed [`Route::Queue`]): it runs after every launch queued
    /// before it. Waits while [`QUEUE_MAX`] launches are queued. Runs `job` here when the
    /// thread was never started or is closing (after the launches queued before it).
    pub(crate) fn submit(&self, job: Job) {
        let Some(r) = self.running.get() else {
            job();
            return;
        };
        let s = &r.shared;
        if s.closing.load(Ordering::Acquire) {
            self.drain();
            job();
            return;
        }
        if s.pending.load(Ordering::Acquire) >= QUEUE_MAX {
            let mut backoff = Backoff::new();
            while s.pending.load(Ordering::Acquire) >= QUEUE_MAX {
                backoff.wait("room in the session's launch queue");
            }
        }
        // Counted before pushed, SeqCst with the thread's `parked`: either the thread sees
        // the count before it parks, or this sees it parked and wakes it.
        s.pending.fetch_add(1, Ordering::SeqCst);
        s.all.pending.fetch_add(1, Ordering::SeqCst);
        s.all.queued.fetch_add(1, Ordering::Relaxed);
        s.jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push_back(job);
        if s.parked.load(Ordering::SeqCst) {
            r.thread.unpark();
        }
    }

    /// Launches queued and not finished.
    #[cfg(test)]
    pub(crate) fn pending(&self) -> usize {
        self.running
            .get()
            .map_or(0, |r| r.shared.pending.load(Ordering::Acquire))
    }

    /// Waits until every queued launch has been made (their effects, deferred errors
    /// included, are visible to the caller).
    pub(crate) fn drain(&self) {
        let Some(r) = self.running.get() else {
            return;
        };
        if r.shared.pending.load(Ordering::Acquire) == 0 {
            return;
        }
        let mut backoff = Backoff::new();
        while r.shared.pending.load(Ordering::Acquire) != 0 {
            backoff.wait("the session's queued launches");
        }
    }

    /// Makes the queued launches, then stops the thread (joined unless this is it). Later
    /// submissions run on the submitting thread.
    pub(crate) fn close(&self) {
        let Some(r) = self.running.get() else {
            return;
        };
        self.drain();
        r.shared.closing.store(true, Ordering::SeqCst);
        r.thread.unpark();
        let handle = r
            .handle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(h) = handle
            && h.thread().id() != std::thread::current().id()
        {
            let _ = h.join();
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

fn run(s: &Shared) {
    let mut idle_since: Option<Instant> = None;
    loop {
        let job = s
            .jobs
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop_front();
        if let Some(job) = job {
            if catch_unwind(AssertUnwindSafe(job)).is_err() {
                tracing::error!("a kernel launch panicked on the launch thread");
            }
            s.pending.fetch_sub(1, Ordering::Release);
            s.all.pending.fetch_sub(1, Ordering::Release);
            idle_since = None;
            continue;
        }
        if s.closing.load(Ordering::Acquire) && s.pending.load(Ordering::Acquire) == 0 {
            return;
        }
        let since = *idle_since.get_or_insert_with(Instant::now);
        if since.elapsed() < HOT_SPIN || s.pending.load(Ordering::Acquire) > 0 {
            // Hot, or a launch counted and being pushed.
            std::hint::spin_loop();
            continue;
        }
        s.parked.store(true, Ordering::SeqCst);
        if s.pending.load(Ordering::SeqCst) == 0 && !s.closing.load(Ordering::SeqCst) {
            // A wake-up is never lost (the count is checked after `parked` is set, and an
            // unpark before the park makes it return); the timeout is a second guard.
            std::thread::park_timeout(Duration::from_millis(100));
        }
        s.parked.store(false, Ordering::SeqCst);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn launcher(policy: LaunchThread) -> (Launcher, Arc<LaunchCounts>) {
        let all = Arc::new(LaunchCounts::default());
        (
            Launcher::new("test-launch".into(), policy, Arc::clone(&all)),
            all,
        )
    }

    #[test]
    fn queued_launches_run_in_order_and_drain_waits_for_them() {
        let (l, all) = launcher(LaunchThread::Always);
        let seen = Arc::new(Mutex::new(Vec::new()));
        for round in 0..20 {
            for i in 0..(QUEUE_MAX * 2) {
                assert_eq!(l.route(), Route::Queue);
                let seen = Arc::clone(&seen);
                l.submit(Box::new(move || {
                    if i % 64 == 0 {
                        std::thread::sleep(Duration::from_micros(200));
                    }
                    seen.lock().unwrap().push(i);
                }));
                assert!(l.pending() <= QUEUE_MAX, "the queue is bounded");
            }
            l.drain();
            assert_eq!(l.pending(), 0);
            assert_eq!(all.pending.load(Ordering::SeqCst), 0);
            let got = std::mem::take(&mut *seen.lock().unwrap());
            assert_eq!(got, (0..QUEUE_MAX * 2).collect::<Vec<_>>(), "round {round}");
            assert_eq!(
                all.queued.load(Ordering::SeqCst),
                ((round + 1) * QUEUE_MAX * 2) as u64
            );
            if round % 5 == 4 {
                // Let the thread park; the next launch must wake it.
                std::thread::sleep(HOT_SPIN * 4);
            }
        }
        l.close();
        // Closed: a late launch runs on the caller's thread.
        let ran = Arc::new(AtomicBool::new(false));
        let r = Arc::clone(&ran);
        l.submit(Box::new(move || r.store(true, Ordering::SeqCst)));
        assert!(ran.load(Ordering::SeqCst));
    }

    #[test]
    fn a_parked_thread_is_woken_every_time() {
        let (l, _) = launcher(LaunchThread::Always);
        let count = Arc::new(AtomicUsize::new(0));
        for n in 1..=200 {
            let c = Arc::clone(&count);
            assert_eq!(l.route(), Route::Queue);
            l.submit(Box::new(move || {
                c.fetch_add(1, Ordering::SeqCst);
            }));
            let start = Instant::now();
            l.drain();
            assert!(
                start.elapsed() < Duration::from_millis(90),
                "woken by the submission, not by the park's timeout"
            );
            assert_eq!(count.load(Ordering::SeqCst), n);
            if n % 20 == 0 {
                std::thread::sleep(HOT_SPIN * 3);
            }
        }
    }

    #[test]
    fn never_and_isolated_launches_stay_on_the_reading_thread() {
        let (l, _) = launcher(LaunchThread::Never);
        for _ in 0..10 {
            assert_eq!(l.route(), Route::Here);
            l.ran_here();
        }
        assert!(l.running.get().is_none(), "no thread started");
        // Auto: launches far apart (a launch, then a synchronize's round trip) never queue.
        let (l, _) = launcher(LaunchThread::Auto);
        for _ in 0..10 {
            assert_eq!(l.route(), Route::Here);
            l.ran_here();
            std::thread::sleep(Duration::from_micros(100));
        }
        assert!(l.running.get().is_none(), "no thread started");
    }

    #[test]
    fn a_panicking_launch_does_not_stop_the_queue() {
        let (l, all) = launcher(LaunchThread::Always);
        assert_eq!(l.route(), Route::Queue);
        l.submit(Box::new(|| panic!("boom")));
        let ran = Arc::new(AtomicBool::new(false));
        let r = Arc::clone(&ran);
        l.submit(Box::new(move || r.store(true, Ordering::SeqCst)));
        l.drain();
        assert!(ran.load(Ordering::SeqCst));
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
