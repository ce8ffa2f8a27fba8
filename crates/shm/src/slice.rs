//! The kernel time slice a latency-bound thread asks for (issue 12 §4): how soon a thread
//! woken from a futex sleep gets a busy core back.
//!
//! Linux's EEVDF scheduler (6.6 and later) gives each runnable thread a slice (by default
//! `base_slice_ns`, 0.75 ms times 1 + log2 of the CPUs, capped at 8: 3.75 ms on 16 cores)
//! and, since 6.12, lets a thread ask for a shorter one with `sched_setattr`
//! (`sched_runtime` of a `SCHED_OTHER` thread, 0.1-100 ms, no privilege needed). A thread
//! woken on a core whose current thread still has slice left waits for it unless the woken
//! one's slice is shorter (`PREEMPT_SHORT`). Its share of the CPU does not change (its
//! weight, its nice value, stays): only how finely it is cut. A server connection thread that
//! sleeps between a client's requests and is woken by the next one is the thread this is for.

use std::time::Duration;

/// The slice the kernel takes at least (`NSEC_PER_MSEC / 10`).
pub const SLICE_MIN: Duration = Duration::from_micros(100);
/// The slice the kernel takes at most (`NSEC_PER_MSEC * 100`).
pub const SLICE_MAX: Duration = Duration::from_millis(100);

/// The slice a server's shared-memory connection threads ask for, from
/// `REMORA_SERVE_SLICE_US` (microseconds, 100-100000; `0`, unset or empty: the kernel's
/// default, nothing asked; read once; anything else is refused with a warning).
pub fn serve_slice() -> Option<Duration> {
    static SLICE: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *SLICE.get_or_init(|| {
        let v = std::env::var("REMORA_SERVE_SLICE_US").ok()?;
        parse_slice(&v).unwrap_or_else(|| {
            tracing::warn!(
                "REMORA_SERVE_SLICE_US={v:?} is not 0 or a number of microseconds from 100 to \
                 100000; server threads keep the kernel's default slice"
            );
            None
        })
    })
}

/// The slice every thread that sleeps on a ring's futex asks for before its first sleep
/// (a client's program thread included, for the rest of its life), from
/// `REMORA_WAIT_SLICE_US` (as [`serve_slice`]; read once). An experiment: a client never
/// changes its program's threads' scheduling by default.
pub fn wait_slice() -> Option<Duration> {
    static SLICE: std::sync::OnceLock<Option<Duration>> = std::sync::OnceLock::new();
    *SLICE.get_or_init(|| {
        let v = std::env::var("REMORA_WAIT_SLICE_US").ok()?;
        parse_slice(&v).unwrap_or_else(|| {
            tracing::warn!(
                "REMORA_WAIT_SLICE_US={v:?} is not 0 or a number of microseconds from 100 to \
                 100000; sleeping threads keep the kernel's default slice"
            );
            None
        })
    })
}

thread_local! {
    /// This thread has asked for [`wait_slice`] (or been refused it).
    static ASKED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// Before a futex sleep on a ring: asks for [`wait_slice`] when it is set and this thread has
/// not asked yet.
pub(crate) fn before_sleep() {
    let Some(slice) = wait_slice() else {
        return;
    };
    if ASKED.with(|a| a.replace(true)) {
        return;
    }
    take_slice(slice, "REMORA_WAIT_SLICE_US", "waiter slice");
}

/// `REMORA_SERVE_SLICE_US`'s value: `Some(None)` for empty or `0` (the kernel's default),
/// `Some(Some(slice))` within [`SLICE_MIN`]..=[`SLICE_MAX`], `None` otherwise.
fn parse_slice(v: &str) -> Option<Option<Duration>> {
    let v = v.trim();
    if v.is_empty() {
        return Some(None);
    }
    let us = v.parse::<u64>().ok()?;
    if us == 0 {
        return Some(None);
    }
    let d = Duration::from_micros(us);
    (SLICE_MIN..=SLICE_MAX).contains(&d).then_some(Some(d))
}

/// Asks the kernel to cut this thread's CPU time into slices of `slice` (its policy and nice
/// value unchanged). Fails on kernels without custom slices for `SCHED_OTHER` threads (before
/// 6.12 the value is accepted and ignored: not an error) or where `sched_setattr` is refused
/// (seccomp).
pub fn ask_slice(slice: Duration) -> std::io::Result<()> {
    let ns = u64::try_from(slice.clamp(SLICE_MIN, SLICE_MAX).as_nanos()).unwrap_or(u64::MAX);
    // SAFETY: getpriority reads no memory of ours; `0` is the calling thread.
    let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, 0) };
    let attr = libc::sched_attr {
        size: std::mem::size_of::<libc::sched_attr>() as u32,
        sched_policy: libc::SCHED_OTHER as u32,
        // SCHED_FLAG_KEEP_POLICY: a thread its program made SCHED_BATCH stays so.
        sched_flags: 0x08,
        sched_nice: nice,
        sched_priority: 0,
        sched_runtime: ns,
        sched_deadline: 0,
        sched_period: 0,
    };
    // SAFETY: `attr` is a valid, initialised `sched_attr` of the size it says, alive for the
    // call; pid 0 is the calling thread; flags 0.
    let r = unsafe {
        libc::syscall(
            libc::SYS_sched_setattr,
            0,
            &attr as *const libc::sched_attr,
            0,
        )
    };
    if r == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// This thread's slice as the kernel reports it (`sched_getattr`'s `sched_runtime`): the one
/// asked for with [`ask_slice`], else the default; `None` where the kernel says 0 (before
/// 6.12) or refuses.
pub fn slice_now() -> Option<Duration> {
    // SAFETY: an all-zero `sched_attr` is a valid value of this plain C struct.
    let mut attr: libc::sched_attr = unsafe { std::mem::zeroed() };
    // SAFETY: `attr` is writable for the size passed; pid 0 is the calling thread; flags 0.
    let r = unsafe {
        libc::syscall(
            libc::SYS_sched_getattr,
            0,
            &mut attr as *mut libc::sched_attr,
            std::mem::size_of::<libc::sched_attr>() as u32,
            0,
        )
    };
    (r == 0 && attr.sched_runtime != 0).then(|| Duration::from_nanos(attr.sched_runtime))
}

/// For a server's shared-memory connection thread: asks [`serve_slice`] when it is set, and
/// says so (at DEBUG, or at INFO under `REMORA_WAIT_TRACE`); a refusal is logged once a
/// process, at WARN, and the thread keeps the kernel's default.
pub fn take_serve_slice() {
    if let Some(slice) = serve_slice() {
        take_slice(slice, "REMORA_SERVE_SLICE_US", "server slice");
    }
}

/// Asks for `slice` for this thread, as `var` says; traced as `waiter`.
fn take_slice(slice: Duration, var: &str, waiter: &'static str) {
    let slice_us = slice.as_micros() as u64;
    match ask_slice(slice) {
        Ok(()) => {
            if crate::wait::tracing_waits() {
                tracing::info!(target: "remora::wait", waiter, slice_us, "asked the kernel for a short slice");
            } else {
                tracing::debug!(slice_us, "{var}: asked the kernel for a short slice");
            }
        }
        Err(e) => {
            static SAID: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
            if !SAID.swap(true, std::sync::atomic::Ordering::Relaxed) {
                tracing::warn!(error = %e, slice_us, "{var}: sched_setattr refused; this process's threads keep the kernel's default slice");
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_parse_within_the_kernels_bounds() {
        assert_eq!(parse_slice(""), Some(None));
        assert_eq!(parse_slice("0"), Some(None));
        assert_eq!(parse_slice(" 250 "), Some(Some(Duration::from_micros(250))));
        assert_eq!(parse_slice("100"), Some(Some(SLICE_MIN)));
        assert_eq!(parse_slice("100000"), Some(Some(SLICE_MAX)));
        assert_eq!(parse_slice("99"), None);
        assert_eq!(parse_slice("100001"), None);
        assert_eq!(parse_slice("1ms"), None);
    }

    #[test]
    fn a_thread_may_ask_for_a_short_slice() {
        // Unprivileged and harmless: the thread's share is unchanged. Kernels that refuse
        // (seccomp) are reported, not failed: the server then keeps the default.
        let t = std::thread::spawn(|| {
            let before = slice_now();
            (before, ask_slice(Duration::from_micros(200)), slice_now())
        });
        let (before, asked, after) = t.join().expect("thread");
        match (asked, after) {
            (Err(e), _) => eprintln!("skipped: sched_setattr refused here ({e})"),
            (Ok(()), None) => eprintln!("skipped: this kernel reports no slice (before 6.12)"),
            (Ok(()), Some(after)) => {
                assert_eq!(after, Duration::from_micros(200), "before: {before:?}");
                // The main thread keeps its own.
                assert_ne!(slice_now(), Some(Duration::from_micros(200)));
            }
        }
    }
}
