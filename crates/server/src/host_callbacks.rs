//! Host callbacks of one session (`cuLaunchHostFunc`, `cuStreamAddCallback`): they run in the
//! client process, and the stream waits for them.
//!
//! ```text
//! client app thread        connection thread          driver's host-fn thread    client callback thread
//!  RM_LAUNCH_HOST_FUNC ──► cuLaunchHostFunc(reached)
//!                                                      reached(id): due += id
//!                          RM_WAIT_HOST_CALLBACKS ◄──────────────────────────── (outstanding)
//!                          deferred reply [id] ─────────────────────────────────► runs fn(userData)
//!                                                      blocks until DONE(id)
//!                          RM_HOST_CALLBACK_DONE(id) ◄─────────────────────────── reports
//!                                                      returns: the stream goes on
//! ```
//!
//! While a host function blocks, every driver call that waits for its stream (a synchronize, a
//! synchronous copy, a copy from pageable memory) blocks too. The session therefore stops
//! running calls on the connection thread once it has used a host callback
//! ([`crate::session::Ordered`]): the connection thread only reads calls, answers the two
//! procedures above at once, and hands every other call, in order, to the session's ordered
//! thread. So RM_HOST_CALLBACK_DONE is always read, whatever the other calls wait for.
//!
//! When the session closes, [`HostCallbacks::close`] releases every blocked host function
//! (before the session's streams and contexts are destroyed) and makes later ones return at
//! once, so that a client that dies never leaves a stream blocked.

use remora_proto::cuda::{CuError, CuResult, cu};
use std::collections::{HashMap, VecDeque};
use std::sync::{Condvar, Mutex, MutexGuard, PoisonError};

use remora_oncrpc::DeferredReply;
use remora_proto::remora::{RM_MAX_DUE_CALLBACKS, RmDueCallback, RmHostCallbacksReply};
use remora_xdr::XdrEncode;

#[derive(Default)]
struct State {
    /// Reached by their streams, not yet reported to the client.
    due: VecDeque<RmDueCallback>,
    /// The client's outstanding RM_WAIT_HOST_CALLBACKS.
    waiter: Option<DeferredReply>,
    /// Reached and not yet reported done: their host functions are blocked, by callback id,
    /// each with a ticket per time it was reached (a graph host node may be reached again,
    /// by another executable graph, before it is reported done; done releases the oldest).
    blocked: HashMap<u64, VecDeque<u64>>,
    next_ticket: u64,
    closed: bool,
}

/// The host callbacks of one session.
#[derive(Default)]
pub(crate) struct HostCallbacks {
    state: Mutex<State>,
    released: Condvar,
}

fn send(reply: DeferredReply, status: i32, due: Vec<RmDueCallback>) {
    let r = RmHostCallbacksReply { status, due };
    if let Err(e) = reply.reply(|enc| r.encode(enc)) {
        tracing::debug!(error = %e, "host callbacks: the due list was not delivered");
    }
}

impl State {
    /// Takes at most one reply's worth of due callbacks.
    fn take_due(&mut self) -> Vec<RmDueCallback> {
        let n = self.due.len().min(RM_MAX_DUE_CALLBACKS as usize);
        self.due.drain(..n).collect()
    }
}

impl HostCallbacks {
    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Called on the driver's host-function thread when a stream reaches callback `id`:
    /// reports it due, then blocks until the client reports it done or the session closes.
    pub(crate) fn reached(&self, id: u64, status: i32) {
        let mut st = self.lock();
        if st.closed {
            return;
        }
        st.next_ticket += 1;
        let ticket = st.next_ticket;
        st.blocked.entry(id).or_default().push_back(ticket);
        st.due.push_back(RmDueCallback {
            callback_id: id,
            status,
        });
        if let Some(w) = st.waiter.take() {
            let due = st.take_due();
            drop(st);
            send(w, cu::SUCCESS, due);
            st = self.lock();
        }
        while st.blocked.get(&id).is_some_and(|t| t.contains(&ticket)) && !st.closed {
            st = self
                .released
                .wait(st)
                .unwrap_or_else(PoisonError::into_inner);
        }
    }

    /// RM_WAIT_HOST_CALLBACKS: answers at once when callbacks are due, else keeps `reply` until
    /// one is. A second wait while one is outstanding answers the older one with an empty list.
    pub(crate) fn wait(&self, reply: DeferredReply) {
        let mut st = self.lock();
        if st.closed {
            drop(st);
            send(reply, cu::CONTEXT_IS_DESTROYED, Vec::new());
            return;
        }
        if !st.due.is_empty() {
            let due = st.take_due();
            drop(st);
            send(reply, cu::SUCCESS, due);
            return;
        }
        let older = st.waiter.replace(reply);
        drop(st);
        if let Some(older) = older {
            send(older, cu::SUCCESS, Vec::new());
        }
    }

    /// RM_HOST_CALLBACK_DONE: releases the host function of callback `id`.
    pub(crate) fn done(&self, id: u64) -> CuResult<()> {
        {
            let mut st = self.lock();
            let Some(tickets) = st.blocked.get_mut(&id) else {
                return Err(CuError(cu::INVALID_VALUE));
            };
            tickets.pop_front();
            if tickets.is_empty() {
                st.blocked.remove(&id);
            }
        }
        self.released.notify_all();
        Ok(())
    }

    /// Callbacks reached and not reported done.
    #[cfg(test)]
    pub(crate) fn blocked(&self) -> usize {
        self.lock().blocked.values().map(VecDeque::len).sum()
    }

    /// The session ends: releases every blocked host function, answers the outstanding wait
    /// and makes later host functions return at once.
    pub(crate) fn close(&self) {
        let mut st = self.lock();
        st.closed = true;
        let released: usize = st.blocked.values().map(VecDeque::len).sum();
        st.blocked.clear();
        st.due.clear();
        let waiter = st.waiter.take();
        drop(st);
        self.released.notify_all();
        if released > 0 {
            tracing::debug!(
                released,
                "session closed with host callbacks pending; their streams are released"
            );
        }
        if let Some(w) = waiter {
            send(w, cu::CONTEXT_IS_DESTROYED, Vec::new());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::time::Duration;

    #[test]
    fn a_reached_callback_blocks_until_done_or_close() {
        let cb = Arc::new(HostCallbacks::default());
        let c = Arc::clone(&cb);
        let t = std::thread::spawn(move || c.reached(7, 0));
        while cb.blocked() == 0 {
            std::thread::yield_now();
        }
        std::thread::sleep(Duration::from_millis(20));
        assert!(!t.is_finished(), "the host function waits for the client");
        assert_eq!(cb.done(8), Err(CuError(cu::INVALID_VALUE)));
        assert_eq!(cb.done(7), Ok(()));
        t.join().unwrap();

        let c = Arc::clone(&cb);
        let t = std::thread::spawn(move || c.reached(9, 0));
        while cb.blocked() == 0 {
            std::thread::yield_now();
        }
        cb.close();
        t.join().unwrap();
        // After close, a host function reached later returns at once.
        cb.reached(10, 0);
        assert_eq!(cb.blocked(), 0);
    }
}
