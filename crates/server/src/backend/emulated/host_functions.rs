//! Host functions of the emulated **test** backend (`cuLaunchHostFunc`, host nodes): one
//! thread per context runs them in the order they were enqueued, and [`HostPending`] counts
//! those not yet returned per stream.

use std::collections::HashMap;
use std::sync::mpsc;
use std::sync::{Arc, Condvar, Mutex, MutexGuard, PoisonError};

use remora_proto::cuda::{CuError, CuResult, cu};

use super::{EmulatedBackend, HostFn};

/// The queue of a context's host-function thread: (context, stream) and the function.
pub(super) type HostQueue = mpsc::Sender<((u64, u64), HostFn)>;

/// Host functions enqueued and not yet returned, by (context, stream).
#[derive(Default)]
pub(super) struct HostPending {
    busy: Mutex<HashMap<(u64, u64), usize>>,
    changed: Condvar,
}

impl HostPending {
    pub(super) fn lock(&self) -> MutexGuard<'_, HashMap<(u64, u64), usize>> {
        self.busy.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Waits until no host function of `ctx` (of `stream` only, if given) is pending.
    pub(super) fn wait_idle(&self, ctx: u64, stream: Option<u64>) {
        let mut busy = self.lock();
        while busy
            .iter()
            .any(|(&(c, s), &n)| n > 0 && c == ctx && stream.is_none_or(|st| st == s))
        {
            busy = self
                .changed
                .wait(busy)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// Waits until no host function is pending anywhere.
    pub(super) fn wait_none(&self) {
        let mut busy = self.lock();
        while !busy.is_empty() {
            busy = self
                .changed
                .wait(busy)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    pub(super) fn finished(&self, key: (u64, u64)) {
        let mut busy = self.lock();
        if let Some(n) = busy.get_mut(&key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                busy.remove(&key);
            }
        }
        drop(busy);
        self.changed.notify_all();
    }
}

impl EmulatedBackend {
    /// The queue of `ctx`'s host-function thread, started on first use.
    pub(super) fn host_thread(&self, ctx: u64) -> CuResult<HostQueue> {
        let mut threads = self
            .host_threads
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        if let Some(tx) = threads.get(&ctx) {
            return Ok(tx.clone());
        }
        let (tx, rx) = mpsc::channel::<((u64, u64), HostFn)>();
        let pending = Arc::clone(&self.host_pending);
        std::thread::Builder::new()
            .name("remora-emu-hostfn".into())
            .spawn(move || {
                while let Ok((key, f)) = rx.recv() {
                    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
                        tracing::error!("emulated backend: a host function panicked");
                    }
                    pending.finished(key);
                }
            })
            .map_err(|_| CuError(cu::OUT_OF_MEMORY))?;
        threads.insert(ctx, tx.clone());
        Ok(tx)
    }
}
