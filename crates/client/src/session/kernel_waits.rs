//! A synchronize's wait predicted from the kernel before it (issue 12 §4's "predict the wait
//! from history, per function and grid"), an experiment: off unless `REMORA_WAIT_PER_KERNEL=1`.
//!
//! Each completion-word waiter learns one running mean of its waits ([`remora_shm::Waiter`]).
//! A program whose kernels differ between synchronizes (a long one every few short ones)
//! mixes their waits in that one figure: it spins too long for the long kernels (up to the
//! device-spin limit of a core, then the full call) and, taught by them, too long or too
//! briefly for the short ones. With this on, the session remembers the last kernel launched
//! on each stream, keyed by its function, grid and block, and learns each key's own mean:
//!
//! ```text
//!  launch (function, grid, block) on (ctx, stream) ──► last[(ctx, stream)] = key
//!  synchronize (ctx, stream):  mean[key] > LONG ──► the full call at once; the shared
//!                                                   figure is not taught by it
//!                              otherwise          ──► as without it (the shared figure)
//!  either way ──► mean[key] learns the synchronize's time
//! ```
//!
//! Only kernels are keyed: a copy or memset after the last kernel of a stream counts as that
//! kernel's. `bench launch|contention --long-every N` is the workload that measures it.

use std::collections::HashMap;
use std::sync::{Mutex, OnceLock, PoisonError};
use std::time::Duration;

use remora_proto::remora::{RmDim3, RmHandle};

/// Keys kept at most; when full, all are forgotten (a program that launches that many
/// different configurations learns them again).
const MAX_KEYS: usize = 4096;
/// Each new wait's share of a key's mean.
const LEARN: f64 = 0.25;

/// Whether `REMORA_WAIT_PER_KERNEL=1` (read once).
pub(super) fn enabled() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| match std::env::var("REMORA_WAIT_PER_KERNEL") {
        Ok(v) if v.trim() == "1" => true,
        Ok(v) if v.trim().is_empty() || v.trim() == "0" => false,
        Ok(v) => {
            tracing::warn!(
                "REMORA_WAIT_PER_KERNEL={v:?} is neither 1 nor 0; the per-kernel prediction stays off"
            );
            false
        }
        Err(_) => false,
    })
}

/// A synchronize predicted longer than this makes the full call at once: half the longest
/// a completion-word wait spins ([`remora_shm::device_spin`], at least the waiter's own
/// maximum), so that a spin that would mostly be given up is not spun at all.
pub(super) fn long(max_spin: Duration) -> Duration {
    remora_shm::device_spin().max(max_spin) / 2
}

/// The key of a launch: its function, grid and block, mixed (never 0, which means none).
pub(super) fn key(function: RmHandle, grid: &RmDim3, block: &RmDim3) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for v in [
        function,
        u64::from(grid.x),
        u64::from(grid.y),
        u64::from(grid.z),
        u64::from(block.x),
        u64::from(block.y),
        u64::from(block.z),
    ] {
        h = (h ^ v).wrapping_mul(0x0000_0100_0000_01b3);
    }
    h | 1
}

/// What the session remembers: each stream's last kernel, and each kernel's waits.
#[derive(Default)]
pub(super) struct KernelWaits {
    last: Mutex<HashMap<(RmHandle, RmHandle), u64>>,
    means: Mutex<HashMap<u64, f64>>,
}

impl KernelWaits {
    /// A kernel of key `key` was launched on `(ctx, stream)`.
    pub(super) fn launched(&self, ctx: RmHandle, stream: RmHandle, key: u64) {
        let mut last = self.last.lock().unwrap_or_else(PoisonError::into_inner);
        if last.len() >= MAX_KEYS && !last.contains_key(&(ctx, stream)) {
            last.clear();
        }
        last.insert((ctx, stream), key);
    }

    /// The key of the last kernel launched on `(ctx, stream)`, if one was.
    pub(super) fn last(&self, ctx: RmHandle, stream: RmHandle) -> Option<u64> {
        self.last
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&(ctx, stream))
            .copied()
    }

    /// How long a synchronize after a kernel of key `key` has lately taken.
    pub(super) fn predicted(&self, key: u64) -> Option<Duration> {
        self.means
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(&key)
            .map(|&ns| Duration::from_nanos(ns as u64))
    }

    /// Folds a synchronize after a kernel of key `key` that took `took` into its mean.
    pub(super) fn learn(&self, key: u64, took: Duration) {
        let t = took.as_nanos() as f64;
        let mut means = self.means.lock().unwrap_or_else(PoisonError::into_inner);
        if means.len() >= MAX_KEYS && !means.contains_key(&key) {
            means.clear();
        }
        means
            .entry(key)
            .and_modify(|m| *m = (1.0 - LEARN) * *m + LEARN * t)
            .or_insert(t);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dim(x: u32) -> RmDim3 {
        RmDim3 { x, y: 1, z: 1 }
    }

    #[test]
    fn each_kernel_learns_its_own_waits_per_stream() {
        let us = Duration::from_micros;
        let k = KernelWaits::default();
        let (short, long_k) = (key(7, &dim(1), &dim(32)), key(7, &dim(2), &dim(32)));
        assert_ne!(short, long_k, "the grid is part of the key");
        assert_ne!(short, 0);
        assert_eq!(k.last(1, 2), None);
        k.launched(1, 2, short);
        k.launched(1, 3, long_k);
        assert_eq!(k.last(1, 2), Some(short));
        assert_eq!(k.last(1, 3), Some(long_k));
        assert_eq!(
            k.last(9, 2),
            None,
            "a stream handle of another context is another stream"
        );
        // Alternating waits of 10 µs and 2 ms: each key's figure is its own.
        for _ in 0..20 {
            k.learn(short, us(10));
            k.learn(long_k, us(2000));
        }
        assert_eq!(k.predicted(short), Some(us(10)));
        assert_eq!(k.predicted(long_k), Some(us(2000)));
        // A kernel that gets short: its figure follows within a few waits.
        for _ in 0..10 {
            k.learn(long_k, us(20));
        }
        assert!(k.predicted(long_k).unwrap() < us(200));
    }

    #[test]
    fn the_tables_stay_bounded() {
        let k = KernelWaits::default();
        for i in 0..(MAX_KEYS as u64 + 10) {
            k.launched(1, i, i | 1);
            k.learn(i | 1, Duration::from_micros(5));
        }
        assert!(k.last.lock().unwrap().len() <= MAX_KEYS);
        assert!(k.means.lock().unwrap().len() <= MAX_KEYS);
    }
}
