//! Synchronize seen in shared memory (issue 12 §3, revision 14): over shared memory,
//! `cuStreamSynchronize` asks the server (one-way, `RM_STREAM_SIGNAL`) to have the stream
//! write a fresh number into a completion word of the session's region when it gets there,
//! and polls the word, instead of waiting for the reply of a full `RM_STREAM_SYNCHRONIZE`
//! (the server's query, its synchronize, the reply's way back). The full call is still made
//! whenever it has something to carry or the word does not come:
//!
//! * here, when copies wait to be delivered, managed or mapped memory needs its pull after
//!   a synchronization, a capture is active or host callbacks are outstanding;
//! * by the server's word (`SIGNAL_FALLBACK`), when it holds a deferred error, device
//!   output or copies, the session uses host callbacks, a capture is in progress, a module
//!   may print from the device, or the stream cannot write the word;
//! * when the word has not come within the spin budget (a long kernel, a faulted context
//!   whose stream stops): the full call then waits on the server and reports any error.
//!
//! The budget follows the waits seen ([`remora_shm::Waiter`]), so long kernels cost a
//! short spin, not a core.
//!
//! The server marks the word (`SIGNAL_QUEUED`) when it queues the stream's write, so the
//! client can tell a wait for the server (a host thread, which may need the core the client
//! spins on) from a wait for the device: how long marks take is learned and traced with
//! `REMORA_WAIT_TRACE` (`waiter="completion word mark"`). Session 41's experiment of looking for the mark only
//! briefly before the full call (`REMORA_WAIT_WORD_ACK=wait`) lost the 1-client cells on the
//! H200 in session 42 and was removed (bench/results/README.md, session 42).

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use remora_proto::remora::{
    REMORA_PROG, REMORA_V1, RM_STREAM_SIGNAL, RmHandle, RmStreamSignalArgs,
};
use remora_shm::{SIGNAL_FALLBACK, SIGNAL_FLAGS, SIGNAL_QUEUED, SIGNAL_SLOTS, Signals, Waiter};
use remora_xdr::XdrEncode as _;

use super::Session;

/// Revision that brought `RM_STREAM_SIGNAL`.
pub(super) const SIGNAL_REVISION: u32 = 14;
/// Shortest spin on a word before the full call.
const MIN_SPIN: Duration = Duration::from_micros(20);
/// Longest spin on a word before the full call.
const MAX_SPIN: Duration = Duration::from_micros(200);

/// The session's completion words and who uses which.
pub(super) struct SignalSync {
    signals: Signals,
    /// Words not in use by a synchronize now.
    free: Mutex<Vec<usize>>,
    /// The last number handed out (numbers stay below `SIGNAL_FALLBACK`).
    seq: AtomicU64,
    waiter: Mutex<Waiter>,
    /// Synchronizes seen complete in shared memory, and those that made the full call after
    /// trying (fallback or late).
    seen: AtomicU64,
    full: AtomicU64,
    /// How long the last synchronize looked at its word before it made the full call.
    spun_first_ns: AtomicU64,
    /// The server marks its words when it queues them (`SIGNAL_QUEUED`): seen once.
    marks_seen: AtomicBool,
    /// How long marks took to come lately (ns, a running mean; 0: none yet).
    mark_ns: AtomicU64,
    /// Synchronizes whose mark was learned (seen, or implied by the number where the server
    /// is known to mark).
    marked: AtomicU64,
    /// Where the server ran against where this thread ran, by how synchronizes ended (traced
    /// waits only).
    cpus: CpuTally,
    /// The synchronize now making its full call planned it at once (for [`CpuTally`]).
    at_once: AtomicBool,
}

/// How a synchronize ended, for [`CpuTally`].
#[derive(Debug, Clone, Copy)]
enum Ended {
    /// The word came within [`FAST`].
    Fast,
    /// The word came later.
    Slow,
    /// No word within the budget (or the server's fallback): the full call followed.
    GaveUp,
    /// The full call at once, with no word.
    AtOnce,
}

/// A word within this came as quickly as a spinning pair's do (11-13 µs on the H100 under
/// load).
const FAST: Duration = Duration::from_micros(32);

/// Traced synchronizes by how they ended, each counted again where the server's CPU (where it
/// last took a call of this session, [`remora_oncrpc::Client::server_cpu`]) was this
/// thread's own at the end: whether a server that answers late was waiting for the core the
/// client held (issue 12 §4's pairs settled on the full call).
#[derive(Default)]
struct CpuTally {
    /// `[all, same CPU]` for [`Ended::Fast`], `Slow`, `GaveUp`, `AtOnce`.
    ended: [[AtomicU64; 2]; 4],
    /// Synchronizes whose server said no CPU.
    unknown: AtomicU64,
    /// Synchronizes whose word was found by the watch's look after its deadline
    /// ([`Watched::SeenLast`]), which gave up and made the full call before that look.
    last_look: AtomicU64,
    /// The full calls after a watch that ended without its word (`[0]`: given up, or the
    /// server's fallback) and at once (`[1]`): how many, their nanoseconds in all, and how
    /// many took 1 ms or more (where a loaded host's wake-ups show: what a given-up watch
    /// costs beyond its spin). Traced waits only.
    full: [FullCalls; 2],
}

/// One kind of full synchronize's count and time, for [`CpuTally`].
#[derive(Default)]
struct FullCalls {
    n: AtomicU64,
    ns: AtomicU64,
    over_1ms: AtomicU64,
}

impl FullCalls {
    fn count(&self, took: Duration) {
        self.n.fetch_add(1, Ordering::Relaxed);
        self.ns.fetch_add(
            u64::try_from(took.as_nanos()).unwrap_or(u64::MAX),
            Ordering::Relaxed,
        );
        if took >= Duration::from_millis(1) {
            self.over_1ms.fetch_add(1, Ordering::Relaxed);
        }
    }

    /// (count, mean µs, count of 1 ms or more).
    fn figures(&self) -> (u64, f64, u64) {
        let n = self.n.load(Ordering::Relaxed);
        let ns = self.ns.load(Ordering::Relaxed);
        let mean = if n == 0 {
            0.0
        } else {
            ns as f64 / n as f64 / 1e3
        };
        (n, mean, self.over_1ms.load(Ordering::Relaxed))
    }
}

impl CpuTally {
    fn count(&self, ended: Ended, server: Option<u32>) {
        let Some(server) = server else {
            self.unknown.fetch_add(1, Ordering::Relaxed);
            return;
        };
        let [all, same] = &self.ended[ended as usize];
        all.fetch_add(1, Ordering::Relaxed);
        if server == remora_shm::current_cpu() {
            same.fetch_add(1, Ordering::Relaxed);
        }
    }

    fn trace(&self) {
        let n = |e: Ended, i: usize| self.ended[e as usize][i].load(Ordering::Relaxed);
        let (gave_up_full, gave_up_full_mean_us, gave_up_full_1ms) = self.full[0].figures();
        let (at_once_full, at_once_full_mean_us, at_once_full_1ms) = self.full[1].figures();
        tracing::info!(
            target: "remora::wait",
            waiter = "completion word cpus",
            fast = n(Ended::Fast, 0),
            fast_same_cpu = n(Ended::Fast, 1),
            slow = n(Ended::Slow, 0),
            slow_same_cpu = n(Ended::Slow, 1),
            gave_up = n(Ended::GaveUp, 0),
            gave_up_same_cpu = n(Ended::GaveUp, 1),
            at_once = n(Ended::AtOnce, 0),
            at_once_same_cpu = n(Ended::AtOnce, 1),
            unknown = self.unknown.load(Ordering::Relaxed),
            last_look = self.last_look.load(Ordering::Relaxed),
            gave_up_full,
            gave_up_full_mean_us,
            gave_up_full_1ms,
            at_once_full,
            at_once_full_mean_us,
            at_once_full_1ms,
            "waits"
        );
    }
}

impl SignalSync {
    /// Logs the completion-word waiter's line (`REMORA_WAIT_TRACE`), unless a wait holds it,
    /// and how the server's marks went.
    pub(super) fn trace_waits(&self) {
        if let Ok(w) = self.waiter.try_lock() {
            w.trace();
        }
        if remora_shm::tracing_waits() {
            self.cpus.trace();
        }
        if remora_shm::tracing_waits() && self.marks_seen.load(Ordering::Relaxed) {
            tracing::info!(
                target: "remora::wait",
                waiter = "completion word mark",
                marked = self.marked.load(Ordering::Relaxed),
                mark_mean_us = self.mark_ns.load(Ordering::Relaxed) as f64 / 1e3,
                "waits"
            );
        }
    }

    /// Folds how long a mark took into its figure.
    fn learn_mark(&self, took: Duration) {
        let t = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        let m = self.mark_ns.load(Ordering::Relaxed);
        let next = if m == 0 { t } else { (m / 5) * 4 + t / 5 };
        self.mark_ns.store(next, Ordering::Relaxed);
        self.marks_seen.store(true, Ordering::Relaxed);
        self.marked.fetch_add(1, Ordering::Relaxed);
    }

    /// For a session in shared memory whose server speaks revision 14 or later.
    pub(super) fn new(area: Option<&remora_oncrpc::DataArea>, revision: u32) -> Option<Self> {
        if revision < SIGNAL_REVISION || std::env::var_os("REMORA_NO_SIGNAL_SYNC").is_some() {
            return None;
        }
        let signals = area?.signals()?;
        Some(Self {
            signals,
            free: Mutex::new((0..SIGNAL_SLOTS).rev().collect()),
            seq: AtomicU64::new(0),
            waiter: Mutex::new(
                Waiter::new(MIN_SPIN, MAX_SPIN)
                    .labeled("completion word")
                    .ended_by_device(),
            ),
            seen: AtomicU64::new(0),
            full: AtomicU64::new(0),
            spun_first_ns: AtomicU64::new(0),
            marks_seen: AtomicBool::new(false),
            mark_ns: AtomicU64::new(0),
            marked: AtomicU64::new(0),
            cpus: CpuTally::default(),
            at_once: AtomicBool::new(false),
        })
    }

    fn take_slot(&self) -> Option<usize> {
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop()
    }

    fn give_slot(&self, slot: usize) {
        self.free
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(slot);
    }

    /// Starts a synchronize: how long to look at the word ([`Waiter::plan`]; zero: make the
    /// full call at once).
    fn plan(&self) -> Duration {
        self.waiter
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .plan()
    }

    /// Counts a synchronize in the waiter's [`remora_shm::WaitStats`]: seen in shared memory
    /// (spun), or sent to the full call (counted as slept, with the time spun first).
    fn count(&self, seen: bool, took: Duration) {
        let outcome = if seen {
            remora_shm::WaitOutcome::Spun
        } else {
            remora_shm::WaitOutcome::Slept
        };
        self.waiter
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .count(outcome, took);
    }

    /// [`Waiter::wake_stretch`]: how long to look at a word whose signal woke the server.
    fn wake_stretch(&self, lag: Duration) -> Duration {
        self.waiter
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .wake_stretch(lag)
    }

    /// Forgets a planned synchronize that did not happen (no free word).
    fn cancel_plan(&self) {
        self.waiter
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .cancel_plan();
    }

    /// Folds a synchronize's time, however it ended, into the spin budget.
    fn observe(&self, took: Duration) {
        self.waiter
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .observe(took);
    }
}

/// How [`watch`] ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Watched {
    /// The stream wrote the number.
    Seen,
    /// The stream wrote the number, found by the look made after the deadline was seen
    /// passed (a watch preempted across its deadline, or a word that came just then).
    SeenLast,
    /// The server wrote the fallback: make the full call.
    Fallback,
    /// Nothing within the budget.
    Late,
}

/// Looks at `word` for `seq` from `start` until `until`. `on_mark` learns how long the
/// server's mark (`seq | SIGNAL_QUEUED`) took: when it is seen, or, where the server is known
/// to mark (`marks_known`), when the number comes with the mark missed between two looks.
fn watch(
    word: &AtomicU64,
    seq: u64,
    start: Instant,
    until: Instant,
    marks_known: bool,
    mut on_mark: impl FnMut(Duration),
) -> Watched {
    let mut marked = false;
    loop {
        // The clock before the look: the watch gives up only on a look made after it saw its
        // deadline pass. Looking first, a watch preempted between its look and the clock (a
        // loaded host takes the core for milliseconds) gave up on a look from before the
        // preemption and made the full call for a word that had come meanwhile.
        let late = Instant::now() >= until;
        let v = word.load(Ordering::Acquire);
        if v == seq {
            if !marked && marks_known {
                on_mark(start.elapsed());
            }
            return if late {
                Watched::SeenLast
            } else {
                Watched::Seen
            };
        }
        if v == seq | SIGNAL_FALLBACK {
            return Watched::Fallback;
        }
        if !marked && v == seq | SIGNAL_QUEUED {
            marked = true;
            on_mark(start.elapsed());
        }
        if late {
            return Watched::Late;
        }
        std::hint::spin_loop();
    }
}

impl Session {
    /// `cuStreamSynchronize` through a completion word: `true` when the stream was seen
    /// complete in shared memory (nothing else to do), `false` when the full
    /// `RM_STREAM_SYNCHRONIZE` must be made.
    pub(super) fn signalled_sync(&self, ctx: RmHandle, stream: RmHandle) -> bool {
        let Some(sig) = &self.signals else {
            return false;
        };
        if self.delivery.pending() != 0
            || self.mirrors.active()
            || self.callbacks.outstanding() != 0
            || !self
                .captures
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .active
                .is_empty()
        {
            return false;
        }
        // Blocking at once, as waiting has been faster that way lately (see `Waiter::plan`):
        // the full call, with no word.
        let budget = sig.plan();
        if budget.is_zero() {
            sig.full.fetch_add(1, Ordering::Relaxed);
            // Counted when the full call has ended (`observe_sync`): no word was watched.
            if remora_shm::tracing_waits() {
                sig.at_once.store(true, Ordering::Relaxed);
            }
            return false;
        }
        let Some(slot) = sig.take_slot() else {
            sig.cancel_plan();
            return false;
        };
        let seq = sig.seq.fetch_add(1, Ordering::Relaxed).wrapping_add(1) & !SIGNAL_FLAGS;
        let start = Instant::now();
        let args = RmStreamSignalArgs {
            ctx,
            stream,
            slot: slot as u32,
            seq,
        };
        // Written now, after the one-way calls queued before it (the launches): never
        // queued itself, so that a launch + synchronize loop leaves the one-way batch empty
        // and its flusher thread parked (queued and flushed at once, it kept the flusher
        // looking every 50 µs: a fifth of a core on the development machine).
        let sent = self
            .coherent("rm_stream_signal", || {
                self.rpc.rpc().call_oneway_raw(
                    REMORA_PROG,
                    REMORA_V1,
                    RM_STREAM_SIGNAL,
                    |enc| args.encode(enc),
                    &[],
                )
            })
            .is_ok();
        // Done when the stream wrote our number; the server's fallback word, or no word
        // within the budget (the full call then waits, and its time teaches the budget),
        // send the caller to the full call.
        // When the call had to wake the sleeping server, the word comes a wake-up late:
        // spin through that too (as the rings do), or the pair stays asleep under load.
        // (`REMORA_WAIT=spin`'s budget stays as it is.)
        let woken = self.rpc.rpc().take_peer_woken();
        let budget = match woken {
            Some(lag) => budget.max(sig.wake_stretch(lag)),
            None => budget,
        };
        let watched = if sent {
            sig.signals.word(slot).map(|word| {
                // Marks' time is only traced: learned only when waits are
                // (`REMORA_WAIT_TRACE`), so a synchronize does no shared writes for it otherwise.
                let tracing = remora_shm::tracing_waits();
                let marks_known = tracing && sig.marks_seen.load(Ordering::Relaxed);
                watch(word, seq, start, start + budget, marks_known, |t| {
                    if tracing {
                        sig.learn_mark(t);
                    }
                })
            })
        } else {
            None
        };
        let done = matches!(watched, Some(Watched::Seen | Watched::SeenLast));
        sig.give_slot(slot);
        // One reading of the clock for everything this synchronize teaches and counts.
        let took = start.elapsed();
        sig.count(done, took);
        if remora_shm::tracing_waits() {
            let ended = match (done, took <= FAST) {
                (true, true) => Ended::Fast,
                (true, false) => Ended::Slow,
                (false, _) => Ended::GaveUp,
            };
            sig.cpus.count(ended, self.rpc.rpc().server_cpu());
            if watched == Some(Watched::SeenLast) {
                sig.cpus.last_look.fetch_add(1, Ordering::Relaxed);
            }
        }
        if done {
            // A wait for the server, as a reply is: the next launch goes out at once.
            self.rpc.rpc().note_waited();
            sig.seen.fetch_add(1, Ordering::Relaxed);
            sig.observe(took);
            if let Some(p) = &self.profile {
                p.record("(stream synchronize seen in shared memory)", took);
            }
        } else {
            sig.full.fetch_add(1, Ordering::Relaxed);
            // The full call's time is added to this when it ends (`observe_sync`).
            sig.spun_first_ns.store(
                u64::try_from(took.as_nanos()).unwrap_or(u64::MAX),
                Ordering::Relaxed,
            );
        }
        done
    }

    /// Stream synchronizes seen complete through a completion word, and those that tried
    /// and then made the full call; `None` when the session has no completion words (not in
    /// shared memory, a server older than revision 14, or `REMORA_NO_SIGNAL_SYNC` set).
    pub fn signal_sync_counts(&self) -> Option<(u64, u64)> {
        self.signals.as_ref().map(|s| {
            (
                s.seen.load(Ordering::Relaxed),
                s.full.load(Ordering::Relaxed),
            )
        })
    }

    /// With waits traced (`REMORA_WAIT_TRACE`): the completion-word synchronizes by how they
    /// ended, `[all, with the server on this thread's CPU]` for a word within 32 µs, a later
    /// word, a watch given up for the full call and the full call at once, and those whose
    /// server said no CPU; `None` without completion words.
    pub fn signal_cpu_counts(&self) -> Option<([[u64; 2]; 4], u64)> {
        let c = &self.signals.as_ref()?.cpus;
        let ended =
            std::array::from_fn(|e| std::array::from_fn(|i| c.ended[e][i].load(Ordering::Relaxed)));
        Some((ended, c.unknown.load(Ordering::Relaxed)))
    }

    /// After a full synchronize that a signal did not catch (or that did not try): its time
    /// teaches the spin budget.
    pub(super) fn observe_sync(&self, took: Duration) {
        if let Some(sig) = &self.signals {
            let spun = Duration::from_nanos(sig.spun_first_ns.swap(0, Ordering::Relaxed));
            sig.observe(took + spun);
            if remora_shm::tracing_waits() {
                if sig.at_once.swap(false, Ordering::Relaxed) {
                    sig.cpus.count(Ended::AtOnce, self.rpc.rpc().server_cpu());
                    sig.cpus.full[1].count(took);
                } else if !spun.is_zero() {
                    sig.cpus.full[0].count(took);
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::{SIGNAL_FALLBACK, SIGNAL_QUEUED, Watched, watch};
    use std::sync::atomic::{AtomicU64, Ordering};
    use std::time::{Duration, Instant};

    #[test]
    fn a_watch_ends_on_its_number_the_fallback_or_the_budget_and_learns_the_mark() {
        let ms = Duration::from_millis;
        let word = AtomicU64::new(0);
        let t0 = Instant::now();
        // The number: seen, and with a server known to mark, its mark learned then.
        word.store(7, Ordering::Release);
        let mut marks = Vec::new();
        let end = watch(&word, 7, t0, t0 + ms(100), true, |t| marks.push(t));
        assert_eq!((end, marks.len()), (Watched::Seen, 1));
        // A server not known to mark teaches nothing.
        assert_eq!(
            watch(&word, 7, t0, t0 + ms(100), false, |_| panic!()),
            Watched::Seen
        );
        word.store(8 | SIGNAL_FALLBACK, Ordering::Release);
        assert_eq!(
            watch(&word, 8, t0, t0 + ms(100), false, |_| {}),
            Watched::Fallback
        );
        // Another number (a stale one, or a mark of another) is not ours: late.
        let t1 = Instant::now();
        assert_eq!(
            watch(&word, 9, t1, t1 + ms(2), false, |_| {}),
            Watched::Late
        );
        // Marked: the mark is learned once, and the watch goes on until the number comes.
        word.store(10 | SIGNAL_QUEUED, Ordering::Release);
        std::thread::scope(|s| {
            s.spawn(|| {
                std::thread::sleep(ms(20));
                word.store(10, Ordering::Release);
            });
            let t3 = Instant::now();
            let mut marks = 0;
            let end = watch(&word, 10, t3, t3 + ms(10_000), true, |_| marks += 1);
            assert_eq!((end, marks), (Watched::Seen, 1));
        });
        // A watch that runs again only after its deadline (preempted across it) looks once
        // more before it gives up: a word that came meanwhile is seen, as such.
        word.store(11, Ordering::Release);
        let t4 = Instant::now() - ms(5);
        assert_eq!(
            watch(&word, 11, t4, t4 + ms(1), false, |_| {}),
            Watched::SeenLast
        );
        assert_eq!(
            watch(&word, 12, t4, t4 + ms(1), false, |_| {}),
            Watched::Late
        );
    }
}
