//! Host callbacks (`cuLaunchHostFunc`, `cuStreamAddCallback`) run in this process.
//!
//! Each callback gets an id and stays here with its closure; `RM_LAUNCH_HOST_FUNC` (one-way,
//! in order with launches and copies) asks the server to block the stream at that point. A
//! thread of this module, started at the first callback, keeps one `RM_WAIT_HOST_CALLBACKS`
//! outstanding; the server answers it when streams reach callbacks, and the thread runs them
//! in the order reached and reports each with `RM_HOST_CALLBACK_DONE`, which lets the stream
//! go on. A callback must not call CUDA (CUDA forbids it): the shim answers every entry point
//! called from this thread while a callback runs with `CUDA_ERROR_NOT_PERMITTED`
//! ([`in_host_callback`]) instead of letting it wait for the stream that waits for it.

use std::cell::Cell;
use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use remora_oncrpc::RpcError;
use remora_proto::remora::RemoraV1Client;

/// A callback: called once on the callback thread with the status CUDA passes to stream
/// callbacks (`CUDA_SUCCESS`, or the context's sticky error).
pub type HostCallback = Box<dyn FnOnce(i32) + Send + 'static>;

/// A callback that runs every time the server reports it due (a graph host node, at every
/// launch of a graph made from it); kept for the session's lifetime.
pub type RepeatedCallback = Arc<dyn Fn() + Send + Sync + 'static>;

thread_local! {
    static IN_CALLBACK: Cell<bool> = const { Cell::new(false) };
}

/// Whether the calling thread is running a host callback (where CUDA calls are not permitted).
pub fn in_host_callback() -> bool {
    IN_CALLBACK.try_with(Cell::get).unwrap_or(false)
}

#[derive(Default)]
pub(crate) struct HostCallbacks {
    next: AtomicU64,
    pending: Mutex<HashMap<u64, HostCallback>>,
    repeated: Mutex<HashMap<u64, RepeatedCallback>>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl HostCallbacks {
    fn pending(&self) -> MutexGuard<'_, HashMap<u64, HostCallback>> {
        self.pending.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Keeps repeated callback `cb` under a fresh id, starting the callback thread if needed.
    pub(crate) fn register_repeated(
        self: &Arc<Self>,
        rpc: &RemoraV1Client,
        cb: RepeatedCallback,
    ) -> std::io::Result<u64> {
        let id = self.register(rpc, Box::new(|_| {}))?;
        self.pending().remove(&id);
        lock(&self.repeated).insert(id, cb);
        Ok(id)
    }

    /// Keeps `cb` under a fresh id, starting the callback thread if needed.
    pub(crate) fn register(
        self: &Arc<Self>,
        rpc: &RemoraV1Client,
        cb: HostCallback,
    ) -> std::io::Result<u64> {
        {
            let mut thread = self.thread.lock().unwrap_or_else(PoisonError::into_inner);
            if thread.is_none() {
                let me = Arc::clone(self);
                let rpc = rpc.clone();
                *thread = Some(
                    std::thread::Builder::new()
                        .name("remora-host-callbacks".into())
                        .spawn(move || me.serve(&rpc))?,
                );
            }
        }
        let id = self.next.fetch_add(1, Ordering::Relaxed) + 1;
        self.pending().insert(id, cb);
        Ok(id)
    }

    /// Forgets a callback that never reached the server.
    pub(crate) fn forget(&self, id: u64) {
        self.pending().remove(&id);
    }

    /// Callbacks registered and not yet run.
    pub(crate) fn outstanding(&self) -> usize {
        self.pending().len()
    }

    /// The callback thread: waits for due callbacks, runs them, reports them done. Ends when
    /// the connection does, dropping the callbacks that can no longer run.
    fn serve(&self, rpc: &RemoraV1Client) {
        self.serve_until_closed(rpc);
        let unrun: Vec<HostCallback> = self.pending().drain().map(|(_, cb)| cb).collect();
        drop(unrun);
    }

    fn serve_until_closed(&self, rpc: &RemoraV1Client) {
        loop {
            let reply = match rpc.rm_wait_host_callbacks() {
                Ok(r) => r,
                Err(RpcError::Timeout { .. }) => continue,
                Err(e) => {
                    tracing::debug!(error = %e, "remora: host callback thread ends");
                    return;
                }
            };
            if reply.status != 0 {
                tracing::debug!(
                    status = reply.status,
                    "remora: the server stopped host callbacks"
                );
                return;
            }
            for due in reply.due {
                let cb = self.pending().remove(&due.callback_id);
                let repeated = match cb {
                    Some(_) => None,
                    None => lock(&self.repeated).get(&due.callback_id).cloned(),
                };
                let cb: Option<HostCallback> = match (cb, repeated) {
                    (Some(cb), _) => Some(cb),
                    (None, Some(r)) => Some(Box::new(move |_| r())),
                    (None, None) => None,
                };
                match cb {
                    Some(cb) => {
                        let _ = IN_CALLBACK.try_with(|c| c.set(true));
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            cb(due.status)
                        }));
                        let _ = IN_CALLBACK.try_with(|c| c.set(false));
                        if r.is_err() {
                            tracing::error!("remora: a host callback panicked");
                        }
                    }
                    None => tracing::warn!(
                        id = due.callback_id,
                        "remora: the server reported an unknown host callback due"
                    ),
                }
                match rpc.rm_host_callback_done(&due.callback_id) {
                    Ok(0) => {}
                    Ok(code) => tracing::warn!(code, "remora: RM_HOST_CALLBACK_DONE refused"),
                    Err(e) => {
                        tracing::debug!(error = %e, "remora: host callback thread ends");
                        return;
                    }
                }
            }
        }
    }
}
