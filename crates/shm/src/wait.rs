//! Polling, then blocking, with a spin budget that follows the observed waits.

use std::time::{Duration, Instant};

/// How a wait ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitOutcome {
    /// The condition came true while spinning.
    Spun,
    /// The waiter slept at least once.
    Slept,
}

/// The adaptive spin budget of one waiting side.
///
/// Each wait spins while the condition is false, for at most the current budget, then
/// blocks (the caller's `sleep`, a futex wait). The budget follows an exponentially weighted
/// mean of how long the waits took: when answers come within `max_spin`, spinning a few
/// times the usual wait (`SPIN_FACTOR`, 3) catches most of them without a sleep and a
/// wake-up (which cost microseconds each); when they take longer, spinning is wasted CPU and
/// the budget falls to `min_spin`. An idle side therefore costs a futex sleep, not a spinning
/// core.
#[derive(Debug, Clone)]
pub struct Waiter {
    budget: Duration,
    mean_ns: f64,
    min_spin: Duration,
    max_spin: Duration,
    /// The next wait spins at least this long ([`Waiter::stretch_next`]).
    stretch: Duration,
    /// The next wait spins first, at least this long, whatever the way preferred
    /// ([`Waiter::hold_next`]).
    hold: Duration,
    /// How [`Waiter::hold`] is spun ([`HoldRule`]).
    hold_rule: HoldRule,
    /// The wait in progress was held (its time goes to `held_ns` too).
    held: Option<Duration>,
    /// How long held waits took lately (nanoseconds, each at most its hold); 0: none yet.
    held_ns: f64,
    /// The way the wait in progress was planned ([`Waiter::plan`]): `Some(true)` spinning
    /// first, `Some(false)` blocking at once; `None` outside a wait or with a fixed policy.
    arm: Option<bool>,
    /// How long waits took lately (nanoseconds, capped), spinning first and blocking at once;
    /// 0: not tried yet.
    arm_ns: [f64; 2],
    /// Waits planned, for exploring the way not taken.
    plans: u32,
    /// The plan at which the way not preferred was last taken, and where between half and
    /// 1.5 times [`EXPLORE_EVERY`] (or its eight-fold) after it the next comes, in 1/65536ths
    /// of that range, drawn after each ([`Waiter::choose`]).
    explored_at: u32,
    explore_jitter: u32,
    /// The state of the draws (xorshift32, never 0).
    rng: u32,
    /// Planned waits that spun first, and those of them that gave up spinning and blocked
    /// (for [`UntriedRule::Failing`]).
    spin_first: [u32; 2],
    /// When blocking at once is first tried ([`UntriedRule`]).
    untried: UntriedRule,
    /// What this waiter waits for, for [`WaitStats`] lines.
    label: &'static str,
    /// Its waits end without another thread of this host running: a word the GPU writes
    /// ([`Waiter::ended_by_device`]).
    device_ended: bool,
    stats: WaitStats,
}

/// How a [`Waiter`]'s waits went, counted always (a few integer additions a wait) and logged
/// when the waiter is dropped if `REMORA_WAIT_TRACE` is set (target `remora::wait`, INFO):
/// for finding which waiter sleeps when adaptive waiting is slow (`remora bench contention`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct WaitStats {
    /// Waits whose value was there at the first look (no clock read, not counted below).
    pub at_once: u64,
    /// Waits that ended while spinning.
    pub spun: u64,
    /// Waits that slept at least once.
    pub slept: u64,
    /// Nanoseconds the spun waits took in all.
    pub spun_ns: u64,
    /// Nanoseconds the slept waits took in all (spin included).
    pub slept_ns: u64,
    /// How long the waits took (spun and slept alike), by powers of two of a microsecond:
    /// bucket 0 under 1 µs, bucket i in [2^(i-1), 2^i) µs, the last one 1024 µs and more. The
    /// means above hide what matters under load and at the tail (a few waits of hundreds of
    /// microseconds in thousands); this shows them.
    pub took_us_log2: [u32; WAIT_BUCKETS],
    /// Waits asked to hold ([`Waiter::hold_next`]), whether or not they spun for it.
    pub held: u64,
    /// Of those, the waits planned as any other because the held waits had lately taken too
    /// long for the hold ([`HoldRule::Learned`]).
    pub hold_dropped: u64,
    /// Spun waits whose value was found by the look made after the spin's deadline had been
    /// seen passed ([`Waiter::wait_judged_until`]): a spin preempted across its deadline (a
    /// loaded host) that found the value there when it ran again, or a value that came just
    /// then. Before that look such a wait went to `poll(true)` on a look from before the
    /// preemption and was counted as given up.
    pub last_look: u64,
}

/// Buckets of [`WaitStats::took_us_log2`]: under 1 µs, then up to 1024 µs by doubling, then
/// the rest.
pub const WAIT_BUCKETS: usize = 12;

impl WaitStats {
    /// The bucket of [`WaitStats::took_us_log2`] a wait of `ns` falls in.
    pub fn bucket(ns: u64) -> usize {
        let us = ns / 1000;
        ((u64::BITS - us.leading_zeros()) as usize).min(WAIT_BUCKETS - 1)
    }

    /// Counts one wait that took `took` and ended as `outcome`.
    pub fn count(&mut self, outcome: WaitOutcome, took: Duration) {
        let ns = u64::try_from(took.as_nanos()).unwrap_or(u64::MAX);
        let b = &mut self.took_us_log2[Self::bucket(ns)];
        *b = b.saturating_add(1);
        let (n, sum) = match outcome {
            WaitOutcome::Spun => (&mut self.spun, &mut self.spun_ns),
            WaitOutcome::Slept => (&mut self.slept, &mut self.slept_ns),
        };
        *n += 1;
        *sum = sum.saturating_add(ns);
    }

    /// The histogram as `<1:N <2:N <4:N ... >=1024:N`, buckets with no wait left out.
    pub fn histogram(&self) -> String {
        let mut out = String::new();
        for (i, &n) in self.took_us_log2.iter().enumerate() {
            if n == 0 {
                continue;
            }
            if !out.is_empty() {
                out.push(' ');
            }
            let label = if i == WAIT_BUCKETS - 1 {
                format!(">={}", 1u64 << (i - 1))
            } else {
                format!("<{}", 1u64 << i)
            };
            out.push_str(&format!("{label}:{n}"));
        }
        out
    }
}

/// Whether `REMORA_WAIT_TRACE` asks for [`WaitStats`] lines (read once): a process that keeps
/// long-lived waiters logs them itself before it exits ([`Waiter::trace`]).
pub fn tracing_waits() -> bool {
    static TRACE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *TRACE.get_or_init(|| std::env::var_os("REMORA_WAIT_TRACE").is_some_and(|v| !v.is_empty()))
}

/// The CPU this thread runs on now (`sched_getcpu`): whether two peers share a core.
pub fn current_cpu() -> u32 {
    u32::try_from(rustix::thread::sched_getcpu()).unwrap_or(u32::MAX)
}

/// A switch: `name` is `1` (on) or `0` (off); unset or empty, `default`; anything else is
/// refused with a warning naming what the default does.
fn switch(name: &str, default: bool, default_does: &str) -> bool {
    let v = std::env::var(name).ok();
    let choices = if default {
        [("1", true), ("0", false)]
    } else {
        [("0", false), ("1", true)]
    };
    parse_rule(name, v.as_deref(), &choices, default_does)
}

/// Whether a server's connection thread moves off the core its shared-memory client last
/// took a reply on, when it finds itself there ([`avoid_cpu`]): on unless
/// `REMORA_SERVE_AVOID_PEER_CPU=0` (read once; the client reads it too, and says its CPU for
/// it, [`say_cpu`]).
///
/// Why (issue 12 §4): under CPU contention an adaptive pair whose two threads the scheduler
/// put on one core measures spinning as slow (the spin holds the core the server needs to
/// take the launch) and settles on the full call, and a pair on two cores measures blocking
/// as slow: which way each pair settles follows its placement, not the load (session 44 on
/// the H100: 2-3 of 4 clients settled, p50 x1.6 of spinning's). With the server leaving the
/// client's core, no pair settled on the development machine (emulated, 2 vCPUs, 0x-2x
/// load, two runs of 5 rounds: 0 of 4 clients in every round against 2-4 of 4) and
/// adaptive's p50 was spinning's in every cell (x1.00-x1.02 against x1.05-x15.8), its 4-client
/// mean x0.27-x0.44 of the better way's (x0.86-x1.72 before); pure blocking, which a pair
/// sharing a core serves best, lost (its mean up to 2x), and adaptive's own figure held or
/// fell in every cell. `bench/results/README.md`, session 46.
pub fn avoid_peer_cpu() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| {
        switch(
            "REMORA_SERVE_AVOID_PEER_CPU",
            true,
            "servers move off their shared-memory client's CPU",
        )
    })
}

/// Whether this process says, in the header of each ring it consumes, the CPU it last took a
/// message on: for [`avoid_peer_cpu`] (the default) and while its waits are traced. Read
/// once: every ring pop asks.
pub fn say_cpu() -> bool {
    static SAY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *SAY.get_or_init(|| tracing_waits() || avoid_peer_cpu())
}

thread_local! {
    /// This thread's CPU mask before [`avoid_cpu`] first narrowed it, the CPU it left out
    /// last (`None`: not narrowed) and how many times it moved.
    static AVOIDING: std::cell::RefCell<Option<(rustix::thread::CpuSet, Option<u32>, u64)>> =
        const { std::cell::RefCell::new(None) };
}

/// For [`avoid_peer_cpu`] (a no-op otherwise): when this thread runs on `peer`, the CPU its
/// peer last said, it leaves that CPU out of its affinity (the mask it had first, less
/// `peer`; one CPU left out at a time, so it can run wherever it could before but there)
/// and moves. Returns whether it moved. A thread whose mask holds no other CPU stays.
/// Meant for a server's own connection threads only: a client never changes its program's
/// threads' placement.
pub fn avoid_cpu(peer: Option<u32>) -> bool {
    if !avoid_peer_cpu() {
        return false;
    }
    let Some(peer) = peer else {
        return false;
    };
    if current_cpu() != peer {
        return false;
    }
    let Ok(cpu) = usize::try_from(peer) else {
        return false;
    };
    AVOIDING.with(|a| {
        let mut a = a.borrow_mut();
        if a.is_none() {
            match rustix::thread::sched_getaffinity(None) {
                Ok(mask) => *a = Some((mask, None, 0)),
                Err(e) => {
                    tracing::debug!(error = %e, "sched_getaffinity failed; this thread stays where it runs");
                    return false;
                }
            }
        }
        let Some((first, left_out, moves)) = a.as_mut() else {
            return false;
        };
        if *left_out == Some(peer)
            || cpu >= rustix::thread::CpuSet::MAX_CPU
            || !first.is_set(cpu)
            || first.count() < 2
        {
            return false;
        }
        let mut mask = *first;
        mask.unset(cpu);
        match rustix::thread::sched_setaffinity(None, &mask) {
            Ok(()) => {
                *left_out = Some(peer);
                *moves += 1;
                // Traced at the 1st, 2nd, 4th, 8th... move: bounded however often it chases.
                if tracing_waits() && moves.is_power_of_two() {
                    tracing::info!(
                        target: "remora::wait",
                        waiter = "server avoids its client's cpu",
                        moves = *moves,
                        cpu,
                        "moved off the client's CPU"
                    );
                }
                true
            }
            Err(e) => {
                tracing::debug!(error = %e, cpu, "sched_setaffinity failed; this thread stays where it runs");
                false
            }
        }
    })
}

/// How every [`Waiter`] of this process waits, from `REMORA_WAIT` (read once): `adaptive`
/// (the default: each wait spins first or blocks at once, whichever has been faster lately,
/// and the spin budget follows the waits), `spin` (pure polling: a budget of
/// [`SPIN_FOREVER`] whatever the waits) or `block` (no spinning: block at once). `spin` and
/// `block` exist to measure the adaptive policy against (`remora bench contention`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum WaitPolicy {
    /// Spin for a budget that follows the observed waits, then block; or block at once when
    /// that has been faster ([`Waiter::plan`]).
    Adaptive,
    /// Spin (practically) without end.
    Spin,
    /// Never spin.
    Block,
}

/// The spin budget is this many times the waits' mean (at most `max_spin`). Generous, since
/// the waits learned leave wake-ups out (the rings' and TCP's stamps): a budget just short of
/// the usual wait is the costliest, a spin and then a sleep.
const SPIN_FACTOR: f64 = 3.0;

/// Whether this host has a core to spare now: fewer runnable threads (the running count of
/// `/proc/loadavg`, this one included) than the CPUs this process may use. Read again at most
/// every 10 ms, by whichever wait comes first; `false` when it cannot be read (the choice
/// between spinning and blocking is then measured, as on a loaded host). The server's launch
/// thread asks it too before it starts overlapping launches with reading them.
pub fn cores_to_spare() -> bool {
    use std::sync::OnceLock;
    use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
    static CPUS: OnceLock<usize> = OnceLock::new();
    static LAST_MS: AtomicU64 = AtomicU64::new(0);
    static SPARE: AtomicBool = AtomicBool::new(false);
    // The coarse clock: asked on every launch and wait, where a precise read cost more than
    // the rest of this function, for a figure kept 10 ms.
    let now_ms = coarse_now().as_millis() as u64 + 1;
    let last = LAST_MS.load(Ordering::Relaxed);
    if last != 0 && now_ms < last + 10 {
        return SPARE.load(Ordering::Relaxed);
    }
    // One thread refreshes; the others use the figure they find.
    if LAST_MS
        .compare_exchange(last, now_ms, Ordering::Relaxed, Ordering::Relaxed)
        .is_err()
    {
        return SPARE.load(Ordering::Relaxed);
    }
    let cpus = *CPUS.get_or_init(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let spare = std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| running_threads(&s))
        .is_some_and(|running| running < cpus);
    SPARE.store(spare, Ordering::Relaxed);
    spare
}

/// `CLOCK_MONOTONIC_COARSE` now: a millisecond-grained clock that costs a few nanoseconds (no
/// time-stamp counter read), for deadlines and rate limits of a millisecond or more that are
/// checked on every call.
pub fn coarse_now() -> Duration {
    let t = rustix::time::clock_gettime(rustix::time::ClockId::MonotonicCoarse);
    Duration::new(t.tv_sec as u64, t.tv_nsec as u32)
}

/// The running count of a `/proc/loadavg` line ("0.56 1.26 1.16 3/81 27152": 3).
fn running_threads(loadavg: &str) -> Option<usize> {
    loadavg
        .split_whitespace()
        .nth(3)?
        .split('/')
        .next()?
        .parse()
        .ok()
}

/// How long an adaptive wait spins at least while the host has a core to spare, whatever its
/// budget: [`SPARE_SPIN_DEFAULT`], or `REMORA_WAIT_SPARE_SPIN_US` (microseconds, at most
/// [`SPARE_SPIN_MAX`]; `0` turns it off; read once). With idle cores the unloaded launch +
/// synchronize loops lost 1-3 µs of mean to pure polling from a few dozen waits in 1000-2000
/// that outlast the budget and `max_spin` (a peer's hiccup) and then paid a sleep and a
/// wake-up on an idle core (~60-180 µs). Spinning through such hiccups on a core no one else
/// wants removes that, for at most this much CPU per wait; a loaded host (no core to spare)
/// is unaffected. Measured on an H200 (session 27, `gpu/tools/wait_study.sh`): with 1 ms the
/// unloaded waits that slept went from 4-29 in ~1000 to one (a wait over 1 ms), and the 1-client cells from
/// x0.98-1.02 (x1.07-1.25 in session 26) to x0.98-1.01 of the better fixed policy.
pub fn spare_spin() -> Duration {
    static SPIN: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| spin_from_env("REMORA_WAIT_SPARE_SPIN_US", SPARE_SPIN_DEFAULT))
}

/// How long at most a wait [`Waiter::ended_by_device`] that spins first keeps spinning for as
/// long as blocking at once has lately taken: [`DEVICE_SPIN_DEFAULT`], or
/// `REMORA_WAIT_DEVICE_SPIN_US` (microseconds, at most [`SPARE_SPIN_MAX`]; `0` turns it off;
/// read once). Why: in session 27's traces of shm with 4 clients under 1x load, the
/// completion-word waits spun 20-41 µs (three times their mean) and about one in four then
/// made the full call, which waited 470-850 µs for its reply, where the words themselves came
/// within 256 µs but for a handful; blocking at once took 280-340 µs there. Measured on an
/// H200 (session 30, `bench contention --burn 1,2`, off and at 1 ms in one call): adaptive's
/// launch + synchronize mean over shm went from 284 to 241 µs (4 clients, 1x load), 72 to 62
/// (1 client, 2x) and 294 to 231 (4 clients, 2x), and stayed at 39-40 µs (1 client, 1x).
pub fn device_spin() -> Duration {
    static SPIN: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *SPIN.get_or_init(|| spin_from_env("REMORA_WAIT_DEVICE_SPIN_US", DEVICE_SPIN_DEFAULT))
}

/// How long the server's next wait for a request spins at least, after a completion-word
/// signal (`RM_STREAM_SIGNAL`) it has queued: [`SIGNAL_HOLD_DEFAULT`], or
/// `REMORA_WAIT_SIGNAL_HOLD_US` (microseconds, at most [`SPARE_SPIN_MAX`]; `0` turns it off;
/// read once). The client watches the word, spinning, and sends its next request as soon as
/// the GPU writes it. Under load the server's request waiter, left to itself, learns to block
/// at once (its spins there compete for cores with its own client), and every next request
/// then pays its wake-up: in session 32's traces of shm with 4 clients at 1x load, adaptive's
/// launch + synchronize p50 sat at 17-21 µs against spin's 11-12. Holding the server spinning
/// while the word is outstanding keeps the pair spinning together (issue 12 §4).
pub fn signal_hold() -> Duration {
    static HOLD: std::sync::OnceLock<Duration> = std::sync::OnceLock::new();
    *HOLD.get_or_init(|| spin_from_env("REMORA_WAIT_SIGNAL_HOLD_US", SIGNAL_HOLD_DEFAULT))
}

/// How a held wait ([`Waiter::hold_next`]) spins, from `REMORA_WAIT_HOLD_RULE` (read once).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum HoldRule {
    /// The whole hold, unless the answer comes first (`fixed`: what session 34 measured).
    Fixed,
    /// Three times (the spin factor) what held waits have lately taken, at least the budget
    /// (`learned`, the default), or no hold at all when that is more than the hold: the waits
    /// that outlast the usual one by that much (a client preempted by a busy host) then sleep
    /// instead of spinning out the hold, and a program whose next call usually comes later
    /// than a third of the hold (work between a synchronize and its next call) is not held
    /// for (session 35, after its calls; see `Waiter::hold_spin`). Why: in session 34's call
    /// the fixed 1 ms hold raised the server's CPU per round trip of 1 client at 2x load from
    /// 14.4 to 20.7 µs without changing its latency; in session 35's two calls the learned
    /// hold's was 11.7-12.0 µs (off: 13.6-14.4). A held wait teaches how long it took, this
    /// side's wake-up or preemption included: session 43's rule, teaching when the request
    /// came instead, measured against it on the H100 in session 44 and removed (1 client at
    /// 2x load, p50 x1.76 of spinning's against x1.04; as many 4-client pairs settled on the
    /// full call either way).
    Learned,
}

impl HoldRule {
    /// `REMORA_WAIT_HOLD_RULE` of this process: `learned` (or unset, empty) or `fixed`;
    /// anything else is logged and taken as `learned`.
    pub fn from_env() -> Self {
        static RULE: std::sync::OnceLock<HoldRule> = std::sync::OnceLock::new();
        *RULE.get_or_init(|| {
            let v = std::env::var("REMORA_WAIT_HOLD_RULE").ok();
            Self::parse(v.as_deref())
        })
    }

    fn parse(v: Option<&str>) -> Self {
        parse_rule(
            "REMORA_WAIT_HOLD_RULE",
            v,
            &[("learned", HoldRule::Learned), ("fixed", HoldRule::Fixed)],
            "a held wait spins as long as held waits have lately taken",
        )
    }
}

/// [`signal_hold`] when `REMORA_WAIT_SIGNAL_HOLD_US` is not set: 1 ms, spun by the
/// [`HoldRule::Learned`] rule. In session 34's calls (H200, shm) a fixed 1 ms hold brought
/// adaptive's 4-client p50s from 21-27 µs to 13-18 (spin's: 12-13) and its 4-client means down
/// by a third or more, but raised the server's CPU per round trip of 1 client at 2x load from
/// 14.4 to 20.7 µs. In session 35's two calls the learned 1 ms hold brought the 4-client p50s
/// from 18.2-18.3 to 11.8-11.9 µs at 1x load (spin's: 11.4-13.2) and from 16.9-17.1 to
/// 12.9-15.3 at 2x (spin's: 11.0-11.9), and the server's CPU per round trip of 1 client at 2x
/// load was 11.7-12.0 µs against 13.6-14.4 with the hold off (docs/architecture.md).
pub const SIGNAL_HOLD_DEFAULT: Duration = Duration::from_millis(1);

/// [`device_spin`] when `REMORA_WAIT_DEVICE_SPIN_US` is not set.
pub const DEVICE_SPIN_DEFAULT: Duration = Duration::from_millis(1);

/// The spin variable `name` ([`parse_spare_spin`]), `default` when it is unset or (with a
/// warning) not a number of microseconds.
fn spin_from_env(name: &str, default: Duration) -> Duration {
    let Ok(v) = std::env::var(name) else {
        return default;
    };
    parse_spare_spin(&v).unwrap_or_else(|| {
        tracing::warn!(
            "{name}={v:?} is not a number of microseconds; using the default, {} us",
            default.as_micros()
        );
        default
    })
}

/// `REMORA_WAIT_SPARE_SPIN_US`'s (or `REMORA_WAIT_DEVICE_SPIN_US`'s) value as a duration,
/// capped at [`SPARE_SPIN_MAX`]; `None` when it is not a whole number of microseconds.
fn parse_spare_spin(v: &str) -> Option<Duration> {
    let us = v.trim().parse::<u64>().ok()?;
    Some(Duration::from_micros(us).min(SPARE_SPIN_MAX))
}

/// [`spare_spin`] when `REMORA_WAIT_SPARE_SPIN_US` is not set: the waits the H200's traces
/// showed outlasting `max_spin` on an idle host took under 1 ms but a handful in a thousand.
pub const SPARE_SPIN_DEFAULT: Duration = Duration::from_millis(1);

/// The most [`spare_spin`] may be.
pub const SPARE_SPIN_MAX: Duration = Duration::from_millis(10);

/// Every this many waits on average, [`Waiter::plan`] takes the way it does not prefer (eight
/// times as many when that way has been more than 1.5 times as slow): the first time at that
/// plan, then each time half to 1.5 times as many plans after the last, drawn, so that the
/// way is not always looked at in the same place of a program's cycle.
pub const EXPLORE_EVERY: u32 = 16;

/// The value of environment variable `name`, `v`, as one of `choices` by name (trimmed): the
/// first, the default, when unset or empty, and, logged with what the default does
/// (`default_does`), when it names none.
fn parse_rule<T: Copy>(
    name: &str,
    v: Option<&str>,
    choices: &[(&str, T)],
    default_does: &str,
) -> T {
    let (default_name, default) = choices[0];
    let v = v.map_or("", str::trim);
    if v.is_empty() {
        return default;
    }
    if let Some(&(_, rule)) = choices.iter().find(|(n, _)| *n == v) {
        return rule;
    }
    let names: Vec<&str> = choices.iter().map(|(n, _)| *n).collect();
    tracing::warn!(
        "{name}={v:?} is not {}; {default_does} ({default_name})",
        names.join(", ")
    );
    default
}

/// When a [`Waiter`] with no core to spare first tries blocking at once, from
/// `REMORA_WAIT_EXPLORE_UNTRIED` (read once; docs/architecture.md, "Adaptive waiting").
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum UntriedRule {
    /// At the [`EXPLORE_EVERY`]th plan when at least one in [`GIVE_UP_SHARE`] of the waits
    /// that spun first gave up (blocked), else at the eight-fold one (`failing`, the default).
    Failing,
    /// Always at the [`EXPLORE_EVERY`]th plan (`early`: a884805's rule).
    Early,
    /// Always at the eight-fold plan (`late`: the rule before a884805).
    Late,
}

/// Under [`UntriedRule::Failing`], blocking is tried early once this share (one in this
/// many) of the waits that spun first gave up: one in two. In session 42's traces the waits
/// that settled into spinning had given up 9-27% of their first 22 spins on the H200 (1
/// client at 2x load), while those that never would gave up 60-90% there (4 clients) and
/// 97-100% on the 2-core development machine (16 clients' reply waits).
pub const GIVE_UP_SHARE: u32 = 2;

impl UntriedRule {
    /// `REMORA_WAIT_EXPLORE_UNTRIED` of this process: `failing` (or unset, empty), `early`
    /// or `late`; anything else is logged and taken as `failing`.
    pub fn from_env() -> Self {
        static RULE: std::sync::OnceLock<UntriedRule> = std::sync::OnceLock::new();
        *RULE.get_or_init(|| {
            Self::parse(std::env::var("REMORA_WAIT_EXPLORE_UNTRIED").ok().as_deref())
        })
    }

    fn parse(v: Option<&str>) -> Self {
        parse_rule(
            "REMORA_WAIT_EXPLORE_UNTRIED",
            v,
            &[
                ("failing", UntriedRule::Failing),
                ("early", UntriedRule::Early),
                ("late", UntriedRule::Late),
            ],
            "blocking is tried early only where spinning first gives up",
        )
    }
}

/// A fresh waiter's first draw state: a process-wide count of waiters, spread (never 0).
fn seed() -> u32 {
    static WAITERS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let n = WAITERS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    n.wrapping_mul(0x9E37_79B9) | 1
}

/// The spin budget of [`WaitPolicy::Spin`].
pub const SPIN_FOREVER: Duration = Duration::from_secs(1);

/// This process serves (`remora serve` and its workers): [`WaitPolicy::from_env`] reads
/// `REMORA_SERVE_WAIT` before `REMORA_WAIT`.
static SERVING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Marks this process as a server, before anything waits: its waiters then follow
/// `REMORA_SERVE_WAIT` where it is set (`spin`, `block` or `adaptive`), over `REMORA_WAIT`.
/// `remora bench contention` sets `REMORA_WAIT` for its clients and the servers it starts
/// alike, and `REMORA_SERVE_WAIT` splits the two sides (adaptive clients against spinning
/// servers: which side's waiting a cell's figure follows); operators may set it on `remora
/// serve` too (`spin`: a lower median with many shared-memory clients for several times the
/// server's CPU; `remora serve --help`, bench/results/README.md session 49).
pub fn mark_serving() {
    SERVING.store(true, std::sync::atomic::Ordering::Relaxed);
}

impl WaitPolicy {
    /// `REMORA_WAIT` of this process, or `REMORA_SERVE_WAIT` in a server's where that is
    /// set ([`mark_serving`]); unknown values: adaptive, with a warning.
    pub fn from_env() -> Self {
        static POLICY: std::sync::OnceLock<WaitPolicy> = std::sync::OnceLock::new();
        *POLICY.get_or_init(|| {
            let serve = SERVING
                .load(std::sync::atomic::Ordering::Relaxed)
                .then(|| std::env::var("REMORA_SERVE_WAIT").ok())
                .flatten()
                .filter(|v| !v.is_empty());
            let (name, v) = match serve {
                Some(v) => ("REMORA_SERVE_WAIT", Some(v)),
                None => ("REMORA_WAIT", std::env::var("REMORA_WAIT").ok()),
            };
            Self::parse(name, v.as_deref())
        })
    }

    /// A policy's name as `name` gave it (`None`, empty: adaptive; unknown: adaptive, with a
    /// warning).
    fn parse(name: &str, v: Option<&str>) -> Self {
        parse_rule(
            name,
            v,
            &[
                ("adaptive", WaitPolicy::Adaptive),
                ("spin", WaitPolicy::Spin),
                ("block", WaitPolicy::Block),
            ],
            "waiting adaptively",
        )
    }
}

impl Waiter {
    /// A waiter spinning at most `max_spin` (and at least `min_spin`) before it sleeps, as
    /// [`WaitPolicy::from_env`] allows.
    pub fn new(min_spin: Duration, max_spin: Duration) -> Self {
        match WaitPolicy::from_env() {
            WaitPolicy::Adaptive => Self::with_bounds(min_spin, max_spin),
            WaitPolicy::Spin => Self::with_bounds(SPIN_FOREVER, SPIN_FOREVER),
            WaitPolicy::Block => Self::with_bounds(Duration::ZERO, Duration::ZERO),
        }
    }

    /// A waiter spinning at most `max_spin` (and at least `min_spin`), whatever the policy.
    pub fn with_bounds(min_spin: Duration, max_spin: Duration) -> Self {
        let min_spin = min_spin.min(max_spin);
        Self {
            budget: max_spin,
            mean_ns: 0.0,
            min_spin,
            max_spin,
            stretch: Duration::ZERO,
            hold: Duration::ZERO,
            hold_rule: HoldRule::Fixed,
            held: None,
            held_ns: 0.0,
            arm: None,
            arm_ns: [0.0; 2],
            plans: 0,
            explored_at: 0,
            explore_jitter: 1 << 15,
            rng: seed(),
            spin_first: [0; 2],
            untried: UntriedRule::from_env(),
            label: "",
            device_ended: false,
            stats: WaitStats::default(),
        }
    }

    /// Marks this waiter's waits as ended by the device itself (a completion word the GPU
    /// writes), not by another thread: a spin then cannot hold a core their end needs, and
    /// unless [`device_spin`] is off, a wait that spins first spins at least as long as
    /// blocking at once has lately taken (see [`Waiter::plan`]).
    pub fn ended_by_device(mut self) -> Self {
        self.device_ended = true;
        self
    }

    /// Names what this waiter waits for (in its [`WaitStats`] line).
    pub fn labeled(mut self, label: &'static str) -> Self {
        self.label = label;
        self
    }

    /// How its waits went so far.
    pub fn stats(&self) -> WaitStats {
        self.stats
    }

    /// Logs [`Waiter::stats`] as the `REMORA_WAIT_TRACE` line (when that is set and it waited).
    pub fn trace(&self) {
        let st = self.stats;
        if st.spun + st.slept == 0 || !tracing_waits() {
            return;
        }
        let mean_us = |ns: u64, n: u64| {
            if n == 0 {
                0.0
            } else {
                ns as f64 / n as f64 / 1e3
            }
        };
        tracing::info!(
            target: "remora::wait",
            waiter = self.label,
            at_once = st.at_once,
            spun = st.spun,
            slept = st.slept,
            spun_mean_us = mean_us(st.spun_ns, st.spun),
            slept_mean_us = mean_us(st.slept_ns, st.slept),
            budget_us = self.budget.as_secs_f64() * 1e6,
            learned_mean_us = self.mean_ns / 1e3,
            spin_first_us = self.arm_ns[0] / 1e3,
            block_at_once_us = self.arm_ns[1] / 1e3,
            spin_first = self.spin_first[0],
            spin_first_gave_up = self.spin_first[1],
            held = st.held,
            hold_dropped = st.hold_dropped,
            held_mean_us = self.held_ns / 1e3,
            last_look = st.last_look,
            took_us = %st.histogram(),
            "waits"
        );
    }

    /// Has the next wait spin at least `spin` (at most `max_spin`), whatever the budget: for a
    /// side that has just woken its sleeping peer, whose answer then comes a wake-up later
    /// than the budget (learned from spinning peers) expects. Spinning through that once puts
    /// the pair back to spinning; sleeping through it would keep both asleep. Nothing under
    /// the block policy (`max_spin` 0).
    pub fn stretch_next(&mut self, spin: Duration) {
        self.stretch = spin.min(self.max_spin);
    }

    /// Has the next wait spin first, for at least `spin` (at most [`SPARE_SPIN_MAX`]), even
    /// where blocking at once has lately been the faster way: for a side told that its
    /// answer comes soon and that its peer spins for it meanwhile (a server whose client
    /// watches a completion word, [`signal_hold`]). Such a wait goes to the spinning way's
    /// figure. Nothing under the block policy (`max_spin` 0) or the spin policy (which spins
    /// anyway).
    ///
    /// How long it spins follows [`HoldRule::from_env`]: the whole hold (`fixed`), or three
    /// times what held waits have lately taken, at most the hold (`learned`).
    pub fn hold_next(&mut self, spin: Duration) {
        self.hold_next_as(spin, HoldRule::from_env());
    }

    /// [`Waiter::hold_next`] by `rule`.
    pub fn hold_next_as(&mut self, spin: Duration, rule: HoldRule) {
        self.hold = spin.min(SPARE_SPIN_MAX);
        self.hold_rule = rule;
    }

    /// How long to spin for an answer from a peer that had to be woken first, whose usual
    /// wake-up lag is `lag`: the budget and 1.5 times that lag, at most `max_spin` (for
    /// [`Waiter::stretch_next`], or a caller that spins by itself).
    pub fn wake_stretch(&self, lag: Duration) -> Duration {
        (self.budget + lag + lag / 2).min(self.max_spin)
    }

    /// The current spin budget.
    pub fn budget(&self) -> Duration {
        self.budget
    }

    /// Waits until `poll` gives a value. `poll(false)` only looks; `poll(true)` may block first
    /// (a futex wait until woken or a timeout; it may fail, e.g. when the peer is gone) and
    /// then looks. It is called with `false` for the spin budget, then with `true`. A value
    /// there at the first look is not counted as a wait.
    pub fn wait<T, E>(
        &mut self,
        poll: impl FnMut(bool) -> Result<Option<T>, E>,
    ) -> Result<(T, WaitOutcome), E> {
        self.wait_judged(poll, |_, _, took| took)
    }

    /// [`Waiter::wait`], with `judge(value, outcome, took)` saying how long the wait would
    /// have lasted had both sides been spinning: that is what the budget learns (the stats
    /// keep `took`). A ring's consumer takes out its own wake-up and the peer's
    /// (the rings' stamps), so that waits stretched by sleeping do not keep the budget down and
    /// both sides asleep (the "slow mode" of adaptive waiting under load).
    pub fn wait_judged<T, E>(
        &mut self,
        poll: impl FnMut(bool) -> Result<Option<T>, E>,
        judge: impl FnOnce(&T, WaitOutcome, Duration) -> Duration,
    ) -> Result<(T, WaitOutcome), E> {
        self.wait_judged_until(None, poll, judge)
    }

    /// [`Waiter::wait_judged`] for a wait that ends at `deadline` (a read timeout): it spins
    /// no later than that, whatever the plan, and then calls `poll(true)`, which is where a
    /// caller notices the deadline (and a dead peer). Without the cap a spin budget longer
    /// than the deadline (the spin policy's second, against a server's tick of at most a
    /// second) made every timed-out wait spin it out and time out without ever looking
    /// whether the peer was still there: a session worker whose client had exited spun on
    /// until its server killed it.
    pub fn wait_judged_until<T, E>(
        &mut self,
        deadline: Option<Instant>,
        mut poll: impl FnMut(bool) -> Result<Option<T>, E>,
        judge: impl FnOnce(&T, WaitOutcome, Duration) -> Duration,
    ) -> Result<(T, WaitOutcome), E> {
        // Ready at the first look (a busy peer): no clock read, and nothing that says how
        // long waits are.
        if let Some(v) = poll(false)? {
            self.count_at_once();
            return Ok((v, WaitOutcome::Spun));
        }
        let start = Instant::now();
        let mut spin_until = start + self.plan();
        if let Some(d) = deadline {
            spin_until = spin_until.min(d);
        }
        let mut outcome = WaitOutcome::Spun;
        // A spin that ran past its deadline looks once more before it gives up, with the
        // deadline already seen passed: the look before may have been made before a
        // preemption (a loaded host takes the core for milliseconds), and a value that came
        // meanwhile is there at once, with no sleep to plan and no wake-up to pay. No spin
        // planned (blocking at once), no second look.
        let mut looked_late = spin_until <= start;
        loop {
            let mut last_look = false;
            if outcome == WaitOutcome::Spun {
                if Instant::now() < spin_until {
                    std::hint::spin_loop();
                } else if !looked_late {
                    looked_late = true;
                    last_look = true;
                } else {
                    outcome = WaitOutcome::Slept;
                }
            }
            if let Some(v) = poll(outcome == WaitOutcome::Slept)? {
                if last_look {
                    self.stats.last_look += 1;
                }
                let took = start.elapsed();
                let learned = judge(&v, outcome, took);
                self.record_judged(outcome, took, learned);
                return Ok((v, outcome));
            }
        }
    }

    /// Folds one wait that took `took` and ended as `outcome` into the budget
    /// ([`Waiter::observe`]) and the stats ([`Waiter::count`]).
    pub fn record(&mut self, outcome: WaitOutcome, took: Duration) {
        self.record_judged(outcome, took, took);
    }

    /// [`Waiter::record`] for a wait whose budget should learn `learned` rather than `took`
    /// (its own wake-up taken out, as [`Waiter::wait_judged`]'s judge says); the way it was
    /// planned is judged by `took`, what the caller really waited.
    pub fn record_judged(&mut self, outcome: WaitOutcome, took: Duration, learned: Duration) {
        self.learn(learned);
        self.count(outcome, took);
        self.settle(took);
    }

    /// Starts a wait: how long to spin before blocking. Between spinning first (for the
    /// budget) and blocking at once, the way whose waits took less lately, and now and then
    /// ([`EXPLORE_EVERY`]) the other one, so that its figure stays current.
    ///
    /// Which is better depends on more than the peer: when cores are oversubscribed, a spin
    /// can hold the core the peer needs to answer, and waits that spin take longer than waits
    /// that block; when they are not, spinning saves a wake-up. Measuring both, rather than
    /// predicting from the waits alone, makes the choice in either case (issue 12 §4). The
    /// fixed policies (`REMORA_WAIT=spin|block`, or equal bounds) spin for the budget always.
    ///
    /// A waiter [`Waiter::ended_by_device`] that spins first spins, unless [`device_spin`] is
    /// off, at least as long as blocking at once has lately taken (at most that setting): giving
    /// up costs the blocking way's time (under load the full call and two wake-ups on a busy
    /// host), while spinning on costs only this thread's core, and the classic spin-then-block
    /// rule (spin for as long as blocking costs) is within 2x of the best choice made knowing
    /// each wait in advance.
    pub fn plan(&mut self) -> Duration {
        self.plan_with(cores_to_spare, spare_spin(), device_spin())
    }

    /// [`Waiter::plan`], asking `spare` whether the host has a core to spare; with one, an
    /// adaptive wait spins at least `spare_spin` ([`spare_spin`]); the device-ended floor off.
    #[cfg(test)]
    fn plan_on(&mut self, spare: impl FnOnce() -> bool, spare_spin: Duration) -> Duration {
        self.plan_with(spare, spare_spin, Duration::ZERO)
    }

    /// [`Waiter::plan_on`], and for a waiter ended by the device that spins first, at least
    /// the blocking way's figure, at most `device_spin` ([`device_spin`]; zero: off).
    fn plan_with(
        &mut self,
        spare: impl FnOnce() -> bool,
        spare_spin: Duration,
        device_spin: Duration,
    ) -> Duration {
        let stretch = std::mem::take(&mut self.stretch);
        let hold = std::mem::take(&mut self.hold);
        let mut floor = stretch;
        let fixed = self.max_spin.is_zero() || self.min_spin == self.max_spin;
        let mut hold_spin = None;
        if !fixed && !hold.is_zero() {
            // A held wait is counted as such whether or not it spins for the hold.
            self.held = Some(hold);
            self.stats.held += 1;
            hold_spin = self.hold_spin(hold);
            if hold_spin.is_none() {
                self.stats.hold_dropped += 1;
            }
        }
        self.arm = if fixed {
            None
        } else if let Some(spin) = hold_spin {
            floor = floor.max(spin);
            Some(true)
        } else if spare() {
            // With a core to spare, a spin cannot hold the core the peer needs: spinning
            // first is never the slower way, and exploring would only cost wake-ups.
            floor = floor.max(spare_spin);
            Some(true)
        } else {
            Some(self.choose())
        };
        if self.arm == Some(true) && self.device_ended && !device_spin.is_zero() {
            let block = Duration::from_nanos(self.arm_ns[1] as u64);
            floor = floor.max(block.min(device_spin));
        }
        if self.arm == Some(false) {
            Duration::ZERO
        } else {
            self.budget.max(floor)
        }
    }

    /// How long a wait asked to hold `hold` ([`Waiter::hold_next`]) spins at least: none
    /// without a hold; the whole hold by the fixed rule, or while no held wait has been seen;
    /// by the learned rule three times what held waits have lately taken (each counted at
    /// most as the hold), or no hold at all when that is more than the hold: where the next
    /// request usually comes later than a third of the hold (a program that computes between
    /// a synchronize and its next call), holding would spin most of the hold for each one to
    /// save a wake-up, and the wait is planned as any other. Held waits are still counted
    /// then, so the hold comes back once requests come soon again.
    fn hold_spin(&self, hold: Duration) -> Option<Duration> {
        if hold.is_zero() {
            return None;
        }
        match self.hold_rule {
            HoldRule::Learned if self.held_ns > 0.0 => {
                let spin = Duration::from_nanos((self.held_ns * SPIN_FACTOR) as u64);
                (spin <= hold).then_some(spin)
            }
            _ => Some(hold),
        }
    }

    /// Whether this wait spins first (see [`Waiter::plan`]), counting it among the plans.
    fn choose(&mut self) -> bool {
        self.plans = self.plans.wrapping_add(1);
        let [spin_ns, block_ns] = self.arm_ns;
        let prefer_spin = block_ns == 0.0 || spin_ns <= block_ns;
        // A way clearly slower than the other (by half as much again) is looked at again
        // less often: exploring costs that way's time.
        let clear = if spin_ns > 0.0 && block_ns > 0.0 {
            spin_ns > 1.5 * block_ns || block_ns > 1.5 * spin_ns
        } else {
            // A way not tried yet (blocking, as waits spin first until it is): tried early
            // only where spinning first keeps giving up. Under load a pair of spinning sides
            // needs a few dozen waits to settle into answering each other at once: on the
            // H200 (session 42, 1 and 4 clients at 2x load over shm) a first block at the
            // 16th plan, against a spinning figure still holding the first waits' give-ups
            // (3 of 22), set the pair on blocking for the round, p50 x1.83-2.22 of spinning's;
            // tried at the 128th, x1.05-1.16. Where nearly every spin gives up (16 clients
            // on the 2-core development machine) the 128 spins cost adaptive's mean 3x
            // (1404 µs against 418-518).
            let [spun, gave_up] = self.spin_first;
            match self.untried {
                UntriedRule::Early => false,
                UntriedRule::Late => true,
                UntriedRule::Failing => spun == 0 || gave_up.saturating_mul(GIVE_UP_SHARE) < spun,
            }
        };
        let every = if clear {
            EXPLORE_EVERY * 8
        } else {
            EXPLORE_EVERY
        };
        // Not every `every`th plan exactly: a program's waits come in cycles (a step of so
        // many launches and a synchronize, a request and its follow-up), and a fixed period
        // that a cycle divides would take the other way only at the same point of each
        // cycle, so that its figure said how long that one kind of wait takes. With waits
        // alternating 10 and 100 µs whichever way was taken, blocking's figure read 100 µs
        // against spinning's 12-58, and it was looked at every 128th plan (test
        // `exploring_is_not_locked_to_a_programs_cycle`). The first is the `every`th plan;
        // each later one comes half to 1.5 times `every` after the last.
        let gap = every / 2 + ((u64::from(every) * u64::from(self.explore_jitter)) >> 16) as u32;
        let explore = self.plans.wrapping_sub(self.explored_at) >= gap;
        if explore {
            self.explored_at = self.plans;
            self.explore_jitter = self.draw() & 0xFFFF;
        }
        prefer_spin != explore
    }

    /// The next of this waiter's draws (xorshift32).
    fn draw(&mut self) -> u32 {
        let mut x = self.rng;
        x ^= x << 13;
        x ^= x >> 17;
        x ^= x << 5;
        self.rng = x;
        x
    }

    /// Forgets the wait [`Waiter::plan`] started (it did not happen).
    pub fn cancel_plan(&mut self) {
        self.arm = None;
        self.held = None;
    }

    /// Ends the planned wait: its time goes to the figure of the way it took.
    fn settle(&mut self, took: Duration) {
        if let Some(hold) = self.held.take() {
            // A held wait longer than its hold says only that: it outlasted the hold.
            self.held_ns = running_mean(self.held_ns, took.min(hold).as_nanos() as f64, 0.8);
        }
        let Some(spin) = self.arm.take() else {
            return;
        };
        // Capped: a rare long wait (a preemption, a long kernel) says little about which
        // way is faster, and would take the figure away from it for long. Also clipped at
        // twice the way's figure (a winsorized mean, so each sample moves it by 15% at
        // most): under load 1 spin in 20 or so is preempted for milliseconds, and one such
        // sample at the cap lifted the spinning figure 3-4 times over, above blocking's, for
        // hundreds of waits (the H100's loaded shm cells settled on spinning in some rounds,
        // 14.5-15.6 µs, and on blocking in others, 22-29 µs). A lasting change still comes
        // through: a way twice as slow as its figure doubles it in five waits.
        let cap = (self.max_spin * 4).as_nanos() as f64;
        let m = &mut self.arm_ns[usize::from(!spin)];
        let mut t = (took.as_nanos() as f64).min(cap);
        if *m > 0.0 {
            t = t.min(2.0 * *m);
        }
        *m = running_mean(*m, t, 0.85);
    }

    /// Counts one wait that took `took` and ended as `outcome` in [`Waiter::stats`] (done by
    /// [`Waiter::wait`]; for a caller that spins and blocks by itself, before the wait's
    /// [`Waiter::observe`], so that a planned wait that spun first and gave up is counted as
    /// one: [`UntriedRule::Failing`]).
    pub fn count(&mut self, outcome: WaitOutcome, took: Duration) {
        self.stats.count(outcome, took);
        if self.arm == Some(true) {
            let [spun, gave_up] = &mut self.spin_first;
            *spun = spun.saturating_add(1);
            if outcome == WaitOutcome::Slept {
                *gave_up = gave_up.saturating_add(1);
            }
        }
    }

    /// Counts a wait whose value was there at the first look (see [`WaitStats::at_once`]).
    pub fn count_at_once(&mut self) {
        self.stats.at_once += 1;
    }

    /// Folds one observed wait into the budget, and into the figure of the way it was
    /// planned ([`Waiter::plan`]).
    pub fn observe(&mut self, took: Duration) {
        self.learn(took);
        self.settle(took);
    }

    /// Folds one wait into the budget only.
    fn learn(&mut self, took: Duration) {
        self.mean_ns = running_mean(self.mean_ns, took.as_nanos() as f64, 0.8);
        let max = self.max_spin.as_nanos() as f64;
        self.budget = if self.mean_ns <= max {
            Duration::from_nanos((self.mean_ns * SPIN_FACTOR).min(max) as u64).max(self.min_spin)
        } else {
            self.min_spin
        };
    }
}

/// An exponentially weighted mean `mean` (0: no sample yet) with sample `t` folded in,
/// keeping `keep` of the old mean.
fn running_mean(mean: f64, t: f64, keep: f64) -> f64 {
    if mean == 0.0 {
        t
    } else {
        keep * mean + (1.0 - keep) * t
    }
}

impl Drop for Waiter {
    fn drop(&mut self) {
        self.trace();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn policies_parse_by_name_and_unknown_ones_wait_adaptively() {
        for (name, v, policy) in [
            ("REMORA_WAIT", None, WaitPolicy::Adaptive),
            ("REMORA_WAIT", Some(""), WaitPolicy::Adaptive),
            ("REMORA_WAIT", Some("adaptive"), WaitPolicy::Adaptive),
            ("REMORA_SERVE_WAIT", Some("spin"), WaitPolicy::Spin),
            ("REMORA_SERVE_WAIT", Some("block"), WaitPolicy::Block),
            ("REMORA_WAIT", Some("poll"), WaitPolicy::Adaptive),
        ] {
            assert_eq!(WaitPolicy::parse(name, v), policy, "{name}={v:?}");
        }
    }

    /// A waiter bounded to [`min`, `max`] µs that has seen 50 waits of `each` µs.
    fn trained(min: u64, max: u64, each: u64) -> Waiter {
        let mut w = Waiter::with_bounds(Duration::from_micros(min), Duration::from_micros(max));
        for _ in 0..50 {
            w.observe(Duration::from_micros(each));
        }
        w
    }

    #[test]
    fn budget_follows_short_waits_and_drops_for_long_ones() {
        let mut w = Waiter::new(Duration::from_micros(1), Duration::from_micros(50));
        for _ in 0..20 {
            w.observe(Duration::from_micros(10));
        }
        let b = w.budget();
        assert!(
            b >= Duration::from_micros(29) && b <= Duration::from_micros(31),
            "{b:?}"
        );
        for _ in 0..20 {
            w.observe(Duration::from_millis(5));
        }
        assert_eq!(w.budget(), Duration::from_micros(1));
        // Answers get fast again: the budget comes back.
        for _ in 0..60 {
            w.observe(Duration::from_micros(4));
        }
        assert!(w.budget() >= Duration::from_micros(5), "{:?}", w.budget());
    }

    /// The plan at which `w` first blocks at once, each wait that spun first taking 400 µs
    /// and giving up (blocking) when `gives_up` says so for its number (from 1).
    fn first_block(w: &mut Waiter, gives_up: impl Fn(u32) -> bool) -> Option<u32> {
        let us = Duration::from_micros;
        (1..=EXPLORE_EVERY * 8).find(|&i| {
            let spin = !w.plan_on(|| false, Duration::ZERO).is_zero();
            let outcome = if !spin || gives_up(i) {
                WaitOutcome::Slept
            } else {
                WaitOutcome::Spun
            };
            w.count(outcome, us(400));
            w.observe(if spin { us(400) } else { us(10) });
            !spin
        })
    }

    #[test]
    fn blocking_untried_is_tried_early_only_where_spinning_first_gives_up() {
        let fresh = |rule| {
            let mut w = Waiter::with_bounds(Duration::from_micros(2), Duration::from_micros(50));
            w.untried = rule;
            w
        };
        // Every spin gives up: blocking is tried at the 16th plan.
        let mut w = fresh(UntriedRule::Failing);
        assert_eq!(first_block(&mut w, |_| true), Some(EXPLORE_EVERY));
        assert_eq!(w.spin_first, [EXPLORE_EVERY - 1, EXPLORE_EVERY - 1]);
        // Every other one does (8 of the first 15): still early.
        let mut w = fresh(UntriedRule::Failing);
        assert_eq!(first_block(&mut w, |i| i % 2 == 1), Some(EXPLORE_EVERY));
        // One in three (a spinning pair settling, as in session 42's H200 traces): at the
        // 128th plan.
        let mut w = fresh(UntriedRule::Failing);
        assert_eq!(first_block(&mut w, |i| i % 3 == 0), Some(EXPLORE_EVERY * 8));
        // The fixed rules, whatever the waits.
        let mut w = fresh(UntriedRule::Early);
        assert_eq!(first_block(&mut w, |_| false), Some(EXPLORE_EVERY));
        let mut w = fresh(UntriedRule::Late);
        assert_eq!(first_block(&mut w, |_| true), Some(EXPLORE_EVERY * 8));
    }

    #[test]
    fn exploring_is_not_locked_to_a_programs_cycle() {
        let us = Duration::from_micros;
        // Over 64 fixed draw states (a waiter's own comes from how many waiters the process
        // made before it, which tests running at once make vary).
        const SEEDS: u32 = 64;
        for period in [2u32, 4, 8] {
            let mut fair = 0;
            for seed in 0..SEEDS {
                let mut w = Waiter::with_bounds(us(2), us(50));
                w.rng = seed.wrapping_mul(0x9E37_79B9) | 1;
                w.untried = UntriedRule::Early;
                let mut blocked = 0;
                for i in 0..4000u32 {
                    let spin = !w.plan_on(|| false, Duration::ZERO).is_zero();
                    blocked += u32::from(!spin);
                    // How long a wait takes depends on where in the cycle it falls, not on
                    // the way.
                    let t = if i % period == period - 1 {
                        us(100)
                    } else {
                        us(10)
                    };
                    w.count(WaitOutcome::Spun, t);
                    w.observe(t);
                }
                // Both ways saw the whole cycle: neither figure is clearly above the other,
                // and blocking was not left to every 128th plan. With a fixed period of 16,
                // which each of these cycles divides, no draw state did: blocking's figure
                // read 100 µs against spinning's 12-58, taken 28-33 times. Drawn, a way's
                // figure from its sparse samples still wanders, and now and then stays
                // above 1.5 times the other's for a while (a third of the draw states at
                // period 4 over 4000 waits).
                let [spin_ns, block_ns] = w.arm_ns;
                if spin_ns < 1.5 * block_ns
                    && block_ns < 1.5 * spin_ns
                    && blocked > 4000 / EXPLORE_EVERY
                {
                    fair += 1;
                }
            }
            assert!(
                fair * 2 > SEEDS,
                "period {period}: fair in {fair} of {SEEDS} draw states"
            );
        }
    }

    #[test]
    fn untried_rule_values() {
        assert_eq!(UntriedRule::parse(None), UntriedRule::Failing);
        assert_eq!(UntriedRule::parse(Some(" ")), UntriedRule::Failing);
        assert_eq!(UntriedRule::parse(Some("failing")), UntriedRule::Failing);
        assert_eq!(UntriedRule::parse(Some("early")), UntriedRule::Early);
        assert_eq!(UntriedRule::parse(Some("late")), UntriedRule::Late);
        assert_eq!(UntriedRule::parse(Some("soon")), UntriedRule::Failing);
    }

    #[test]
    fn a_held_wait_spins_first_where_blocking_has_been_faster() {
        let us = Duration::from_micros;
        let mut w = trained(2, 50, 5);
        // Blocking at once has been the faster way: waits block, but for the explored few.
        for _ in 0..200 {
            let spin = w.plan_on(|| false, Duration::ZERO);
            w.settle(if spin.is_zero() { us(10) } else { us(40) });
        }
        let blocked = (0..16)
            .filter(|_| {
                let spin = w.plan_on(|| false, Duration::ZERO);
                w.settle(if spin.is_zero() { us(10) } else { us(40) });
                spin.is_zero()
            })
            .count();
        assert!(blocked >= 15, "{blocked} of 16 blocked");
        let before = w.arm_ns[0];
        // A held wait spins first, for the hold (beyond max_spin), once.
        w.hold_next_as(us(300), HoldRule::Fixed);
        assert_eq!(w.plan_on(|| false, Duration::ZERO), us(300));
        // It counts for the spinning way: a held wait that took 12 µs lowers its figure.
        w.settle(us(12));
        assert!(w.arm_ns[0] < before, "{} !< {before}", w.arm_ns[0]);
        // The next wait is planned as before, and a hold is capped at SPARE_SPIN_MAX.
        let next = w.plan_on(|| false, Duration::ZERO);
        w.cancel_plan();
        assert!(next < us(300), "{next:?}");
        w.hold_next_as(Duration::from_secs(5), HoldRule::Fixed);
        assert_eq!(w.plan_on(|| false, Duration::ZERO), SPARE_SPIN_MAX);
        w.cancel_plan();
        // The block policy (no spin at all) ignores a hold.
        let mut block = Waiter::with_bounds(Duration::ZERO, Duration::ZERO);
        block.hold_next_as(us(300), HoldRule::Fixed);
        assert_eq!(block.plan_on(|| false, Duration::ZERO), Duration::ZERO);
    }

    #[test]
    fn a_learned_hold_spins_three_times_the_held_waits_at_most_the_hold() {
        let us = Duration::from_micros;
        // `n` held waits (of a 1000 µs hold, learned) that each took `took`.
        let held = |w: &mut Waiter, n: usize, took: Duration| {
            for _ in 0..n {
                w.hold_next_as(us(1000), HoldRule::Learned);
                w.plan_on(|| false, Duration::ZERO);
                w.settle(took);
            }
        };
        let mut w = trained(2, 50, 5);
        assert_eq!(w.budget(), us(15));
        // No held wait seen yet: the whole hold.
        w.hold_next_as(us(1000), HoldRule::Learned);
        assert_eq!(w.plan_on(|| false, Duration::ZERO), us(1000));
        w.settle(us(40));
        // Held waits of 40 µs: spin 120 µs of a 1000 µs hold.
        held(&mut w, 30, us(40));
        w.hold_next_as(us(1000), HoldRule::Learned);
        let spin = w.plan_on(|| false, Duration::ZERO);
        assert!(spin >= us(119) && spin <= us(121), "{spin:?}");
        // A held wait far longer than the hold counts as the hold: waits of 5 s bring the
        // figure up to the hold, not beyond. Requests that late are not held for: the wait is
        // planned as any other (here, with the budget of 15 µs).
        w.settle(Duration::from_secs(5));
        held(&mut w, 40, Duration::from_secs(5));
        assert!(w.held_ns <= 1_000_000.0, "{}", w.held_ns);
        w.hold_next_as(us(1000), HoldRule::Learned);
        assert!(w.plan_on(|| false, Duration::ZERO) < us(100));
        w.cancel_plan();
        // Held waits of 300 µs (a third of the hold would be 333): held for three times that.
        held(&mut w, 40, us(300));
        w.hold_next_as(us(1000), HoldRule::Learned);
        let spin = w.plan_on(|| false, Duration::ZERO);
        assert!(spin >= us(899) && spin <= us(901), "{spin:?}");
        w.cancel_plan();
        // Never less than the budget; the fixed rule spins the whole hold whatever was seen.
        held(&mut w, 60, us(1));
        w.hold_next_as(us(1000), HoldRule::Learned);
        assert_eq!(w.plan_on(|| false, Duration::ZERO), w.budget().max(us(3)));
        w.cancel_plan();
        w.hold_next_as(us(1000), HoldRule::Fixed);
        assert_eq!(w.plan_on(|| false, Duration::ZERO), us(1000));
        w.cancel_plan();
        assert_eq!(HoldRule::parse(None), HoldRule::Learned);
        assert_eq!(HoldRule::parse(Some("")), HoldRule::Learned);
        assert_eq!(HoldRule::parse(Some(" learned ")), HoldRule::Learned);
        assert_eq!(HoldRule::parse(Some(" fixed")), HoldRule::Fixed);
        assert_eq!(HoldRule::parse(Some("always")), HoldRule::Learned);
    }

    #[test]
    fn a_learned_hold_is_dropped_once_a_third_of_the_held_waits_are_preempted() {
        let us = Duration::from_micros;
        // Held waits (of a 1000 µs hold) taking 10 µs, but every third one 5 ms (a client
        // preempted by a busy host): each preempted one counts as the whole hold, three times
        // the figure passes the hold, and most held waits are planned as any other, counted
        // as dropped (session 38's traces, kept by the stats).
        let mut w = trained(2, 50, 5);
        for i in 0..300 {
            w.hold_next_as(us(1000), HoldRule::Learned);
            w.plan_on(|| false, Duration::ZERO);
            w.settle(if i % 3 == 2 { us(5000) } else { us(10) });
        }
        w.hold_next_as(us(1000), HoldRule::Learned);
        let spin = w.plan_on(|| false, Duration::ZERO);
        w.cancel_plan();
        assert!(spin < us(100), "{spin:?}");
        let st = w.stats();
        assert_eq!(st.held, 301);
        assert!(st.hold_dropped > 100, "{st:?}");
    }

    #[test]
    fn a_learned_hold_learns_how_long_held_waits_took() {
        let us = Duration::from_micros;
        // 100 held waits (of a 1000 µs hold) that took `took`, however soon their request
        // came (`arrival`, what session 43's removed rule learned); then the next held
        // wait's spin.
        let held = |w: &mut Waiter, took: u64, arrival: u64| {
            for _ in 0..100 {
                w.hold_next_as(us(1000), HoldRule::Learned);
                w.plan_on(|| false, Duration::ZERO);
                w.record_judged(WaitOutcome::Slept, us(took), us(arrival));
            }
            w.hold_next_as(us(1000), HoldRule::Learned);
            let spin = w.plan_on(|| false, Duration::ZERO);
            w.cancel_plan();
            spin
        };
        // Held waits of 400 µs (this side slept or was preempted, the request there after
        // 10): three times that passes the hold, which is dropped.
        let mut w = trained(2, 50, 5);
        let spin = held(&mut w, 400, 10);
        assert!(spin < us(100), "{spin:?}");
        assert!(w.stats().hold_dropped > 90, "{:?}", w.stats());
        // It comes back once held waits are short again.
        let spin = held(&mut w, 8, 8);
        assert!(spin >= us(23) && spin <= us(25), "{spin:?}");
    }

    #[test]
    fn the_running_count_is_read_from_loadavg() {
        assert_eq!(running_threads("0.56 1.26 1.16 3/81 27152\n"), Some(3));
        assert_eq!(running_threads("0.56 1.26 1.16"), None);
        assert_eq!(running_threads("a b c x/81 1"), None);
    }

    #[test]
    fn a_wait_takes_the_way_that_has_been_faster_and_now_and_then_the_other() {
        let us = Duration::from_micros;
        // Learn short waits: the budget is 3x their mean.
        let mut w = trained(2, 50, 5);
        assert_eq!(w.budget(), us(15));
        // Spinning first takes 40 µs a wait, blocking at once 10 µs (as when a spin holds the
        // core the peer needs): after both were tried, blocking wins, the other way is still
        // tried now and then.
        let mut plans = Vec::new();
        for _ in 0..400 {
            let spin = w.plan_on(|| false, Duration::ZERO);
            w.settle(if spin.is_zero() { us(10) } else { us(40) });
            plans.push(spin);
        }
        let spun = plans[200..].iter().filter(|d| !d.is_zero()).count();
        assert!((1..=4).contains(&spun), "{spun} of 200 spun");
        // The other way round: spinning wins.
        for _ in 0..400 {
            let spin = w.plan_on(|| false, Duration::ZERO);
            w.settle(if spin.is_zero() { us(40) } else { us(10) });
            plans.push(spin);
        }
        let blocked = plans[600..].iter().filter(|d| d.is_zero()).count();
        assert!((1..=4).contains(&blocked), "{blocked} of 200 blocked");
        // Spinning first usually takes 10 µs and blocking 20, but 1 spin in 20 is preempted
        // (200 µs, the cap): a rare outlier does not hand the choice to blocking.
        let spun = spun_of_last_1000(&mut w, us(20), us(10), 20, us(200));
        assert!(spun >= 900, "{spun} of 1000 spun");
        // A one-shot stretch spins longer than the budget, at most max_spin.
        w.stretch_next(us(500));
        let next = w.plan_on(|| false, Duration::ZERO);
        assert!(next == us(50) || next.is_zero(), "{next:?}");
        // With a core to spare every wait spins first, whatever the figures say.
        assert!((0..100).all(|_| !w.plan_on(|| true, Duration::ZERO).is_zero()));
        // ... and at least the spare spin when one is asked for, not without a spare core.
        assert_eq!(w.plan_on(|| true, us(700)), us(700));
        let without = w.plan_on(|| false, us(700));
        assert!(without < us(700), "{without:?}");
        w.cancel_plan();
        // Fixed policies never choose: equal bounds always spin for the budget.
        let mut fixed = Waiter::with_bounds(us(7), us(7));
        assert!((0..100).all(|_| fixed.plan_on(|| false, Duration::ZERO) == us(7)));
        assert_eq!(
            fixed.plan_on(|| true, us(700)),
            us(7),
            "not the fixed policies"
        );
    }

    #[test]
    fn a_device_ended_wait_that_spins_first_spins_as_long_as_blocking_takes() {
        let us = Duration::from_micros;
        let mut w = Waiter::with_bounds(us(20), us(200)).ended_by_device();
        for _ in 0..50 {
            w.observe(us(10));
        }
        assert_eq!(w.budget(), us(30));
        // Blocking at once has taken 300 µs, spinning first 40: spinning first wins.
        w.arm_ns = [40_000.0, 300_000.0];
        let spin = w.plan_with(|| false, Duration::ZERO, us(1000));
        assert_eq!(
            spin,
            us(300),
            "the blocking way's figure, over the 200 µs max_spin"
        );
        w.cancel_plan();
        // At most the setting.
        assert_eq!(w.plan_with(|| false, Duration::ZERO, us(250)), us(250));
        w.cancel_plan();
        // Off (`REMORA_WAIT_DEVICE_SPIN_US=0`), or a waiter its peer ends: the budget.
        assert_eq!(
            w.plan_with(|| false, Duration::ZERO, Duration::ZERO),
            us(30)
        );
        w.cancel_plan();
        let mut peer = trained(20, 200, 10);
        peer.arm_ns = [40_000.0, 300_000.0];
        assert_eq!(peer.plan_with(|| false, Duration::ZERO, us(1000)), us(30));
        peer.cancel_plan();
        // Blocking not measured yet: no floor.
        let mut fresh = Waiter::with_bounds(us(20), us(200)).ended_by_device();
        fresh.arm_ns = [40_000.0, 0.0];
        assert_eq!(fresh.plan_with(|| false, Duration::ZERO, us(1000)), us(200));
        fresh.cancel_plan();
        // Blocking at once chosen: no spin at all.
        w.arm_ns = [300_000.0, 40_000.0];
        let blocked = (0..10)
            .filter(|_| {
                let d = w.plan_with(|| false, Duration::ZERO, us(1000));
                w.cancel_plan();
                d.is_zero()
            })
            .count();
        assert!(blocked >= 9, "{blocked} of 10 blocked");
    }

    #[test]
    fn spare_spin_values() {
        assert_eq!(parse_spare_spin("250"), Some(Duration::from_micros(250)));
        assert_eq!(
            parse_spare_spin(" 0 "),
            Some(Duration::ZERO),
            "0 turns it off"
        );
        assert_eq!(parse_spare_spin("99999999"), Some(SPARE_SPIN_MAX), "capped");
        assert_eq!(parse_spare_spin("1ms"), None);
        assert_eq!(parse_spare_spin("-5"), None);
        assert!(SPARE_SPIN_DEFAULT <= SPARE_SPIN_MAX);
    }

    /// Plans and settles 2000 waits on `w`: blocking at once takes `blocked`, spinning
    /// first `spun`, but every `every`th spin is preempted and takes `preempted`. Answers how
    /// many of the last 1000 spun first.
    fn spun_of_last_1000(
        w: &mut Waiter,
        blocked: Duration,
        spun: Duration,
        every: u32,
        preempted: Duration,
    ) -> usize {
        let (mut spins, mut first) = (0u32, 0);
        for i in 0..2000 {
            let spin = w.plan_on(|| false, Duration::ZERO);
            let took = if spin.is_zero() {
                blocked
            } else {
                spins += 1;
                if spins.is_multiple_of(every) {
                    preempted
                } else {
                    spun
                }
            };
            w.settle(took);
            if i >= 1000 && !spin.is_zero() {
                first += 1;
            }
        }
        first
    }

    #[test]
    fn waits_are_counted_by_how_they_ended() {
        let mut w = Waiter::with_bounds(Duration::ZERO, Duration::ZERO).labeled("test");
        w.wait(|_| -> Result<Option<()>, ()> { Ok(Some(())) })
            .unwrap();
        let mut looks = 0;
        w.wait(|_| -> Result<Option<()>, ()> {
            looks += 1;
            Ok((looks >= 2).then_some(()))
        })
        .unwrap();
        let st = w.stats();
        assert_eq!((st.at_once, st.spun, st.slept), (1, 0, 1));
        assert!(st.slept_ns > 0);
        assert_eq!(
            st.took_us_log2.iter().sum::<u32>(),
            1,
            "the timed wait, not the first"
        );
    }

    #[test]
    fn waits_are_binned_by_powers_of_two_of_a_microsecond() {
        let us = |n: u64| n * 1000;
        assert_eq!(WaitStats::bucket(999), 0);
        assert_eq!(WaitStats::bucket(us(1)), 1);
        assert_eq!(WaitStats::bucket(us(3)), 2);
        assert_eq!(WaitStats::bucket(us(4)), 3);
        assert_eq!(WaitStats::bucket(us(50)), 6);
        assert_eq!(WaitStats::bucket(us(1023)), 10);
        assert_eq!(WaitStats::bucket(us(1024)), 11);
        assert_eq!(WaitStats::bucket(u64::MAX), 11);
        let mut w = Waiter::with_bounds(Duration::ZERO, Duration::ZERO);
        for t in [us(0), us(5), us(6), us(200), us(5000)] {
            w.count(WaitOutcome::Slept, Duration::from_nanos(t));
        }
        assert_eq!(w.stats().histogram(), "<1:1 <8:2 <256:1 >=1024:1");
    }

    #[test]
    fn wait_spins_then_sleeps_until_ready() {
        let mut w = Waiter::new(Duration::ZERO, Duration::ZERO);
        let mut looks = 0;
        let mut sleeps = 0;
        let (v, how) = w
            .wait(|sleep| -> Result<Option<u32>, ()> {
                if sleep {
                    sleeps += 1;
                }
                looks += 1;
                Ok((looks >= 3).then_some(looks))
            })
            .unwrap();
        assert_eq!((v, how), (3, WaitOutcome::Slept));
        assert_eq!(sleeps, 2);
        // A failing sleep ends the wait with its error.
        let r = w.wait(|sleep| {
            if sleep {
                Err("gone")
            } else {
                Ok::<Option<()>, _>(None)
            }
        });
        assert_eq!(r.unwrap_err(), "gone");
    }

    #[test]
    fn a_spin_preempted_past_its_deadline_looks_again_before_it_blocks() {
        let ms = Duration::from_millis;
        // A spin whose last look came just before it lost its core (the poll itself sleeps
        // past the 20 ms budget, as a preemption would) and whose value came meanwhile: the
        // look after the deadline finds it, a spun wait, with no blocking poll. (A budget of
        // milliseconds, so that the test's own thread is not preempted past it first.)
        let mut w = Waiter::with_bounds(ms(20), ms(20));
        let mut polls = Vec::new();
        let (v, outcome) = w
            .wait(|block| {
                polls.push(block);
                match polls.len() {
                    1 => Ok::<_, ()>(None),
                    2 => {
                        std::thread::sleep(ms(40));
                        Ok(None)
                    }
                    _ => Ok(Some(7)),
                }
            })
            .unwrap();
        assert_eq!((v, outcome), (7, WaitOutcome::Spun));
        assert_eq!(polls, [false, false, false]);
        let st = w.stats();
        assert_eq!((st.last_look, st.spun, st.slept), (1, 1, 0));
        // A value that does not come: after the deadline one more look, then the blocking
        // poll.
        polls.clear();
        let (_, outcome) = w
            .wait(|block| {
                polls.push(block);
                if block {
                    return Ok::<_, ()>(Some(()));
                }
                std::thread::sleep(ms(1));
                Ok(None)
            })
            .unwrap();
        assert_eq!(outcome, WaitOutcome::Slept);
        let n = polls.len();
        assert!(n >= 3, "{polls:?}");
        assert_eq!(&polls[n - 2..], &[false, true]);
        assert_eq!(polls.iter().filter(|b| **b).count(), 1);
        assert_eq!(w.stats().last_look, 1);
        // Blocking at once (no spin planned): no second look before the blocking poll.
        let mut block = Waiter::with_bounds(Duration::ZERO, Duration::ZERO);
        polls.clear();
        let (_, outcome) = block
            .wait(|b| {
                polls.push(b);
                Ok::<_, ()>(b.then_some(()))
            })
            .unwrap();
        assert_eq!(
            (outcome, polls.as_slice()),
            (WaitOutcome::Slept, &[false, true][..])
        );
        assert_eq!(block.stats().last_look, 0);
    }
}
