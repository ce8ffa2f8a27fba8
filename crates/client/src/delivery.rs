//! Asynchronous device-to-host copies into ordinary host memory, and when their bytes must be
//! visible.
//!
//! A copy into memory outside the shared data area cannot be written by the server: the
//! server stages it and a later reply carries the bytes (or, through the area, says they are
//! in a lease). The rule Remora keeps is CUDA's: **the host sees a copy's bytes no later than
//! the moment any CUDA call natively guarantees that the copy has completed.** The server
//! puts every copy it finds complete into whatever synchronizing reply it builds, but that
//! alone is not enough: the reply may be another thread's, a reply's copy budget may be full,
//! and whether a copy is covered by a call depends on CUDA's ordering rules, not on timing.
//!
//! So the client tracks those rules itself, from the order of its own calls, as a
//! [`Coverage`]: the copies (by id: ids grow with issue order) that a point in a stream is
//! ordered after.
//! * a stream covers its own earlier copies;
//! * the legacy stream covers the earlier copies of every blocking stream of its context
//!   (an operation in it waits for them), and a blocking stream (also a per-thread default
//!   stream) covers the legacy stream's earlier copies;
//! * `cuStreamWaitEvent` makes a stream's later work cover what the event covered when it
//!   was recorded; an event covers what its stream covered at the record;
//! * a context synchronize covers every copy of the context (and what its streams waited for
//!   in other contexts);
//! * a host callback covers what its stream covered when it was enqueued: the callback
//!   thread settles that coverage before the callback runs.
//!
//! At such a point, [`Delivery::settle`] waits until every covered copy has been written to
//! its destination. A covered copy still pending is fetched at once with
//! `RM_COPIES_COLLECT` (revision 8; older servers: `RM_STREAM_QUERY` on the copy's stream);
//! one whose bytes another thread is writing right now is waited for.
//!
//! A host callback is the exception: nothing on its way may call the server's driver (a call
//! of the session may wait there for this very callback). Its copies are named when it is
//! enqueued (`RM_LAUNCH_HOST_FUNC_COPIES`); the server's host function publishes their bytes
//! before it reports the callback due, and the callback thread takes them with
//! `RM_COPIES_READY` ([`Fetch::Ready`]), which the server answers without the driver.

use std::collections::{HashMap, HashSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Condvar, Mutex, MutexGuard};
use std::time::{Duration, Instant};

use remora_proto::remora::{
    RM_DEVICE_OUTPUT_ID, RM_MAX_COLLECT, RM_STREAM_LEGACY, RemoraV1Client, RmStreamArgs,
    RmSyncReply,
};

use crate::error::{CuError, CuResult, cu};

/// A protocol handle (context, stream, event).
type Handle = u64;

/// Where the data of an asynchronous device-to-host copy goes once a synchronizing call
/// delivers it. Called exactly once, with the bytes (possibly fewer than asked, on error).
pub type CopySink = Box<dyn FnOnce(&[u8]) + Send>;

/// How long a synchronizing call waits for the bytes of the copies it covers (another
/// thread writing them, or the server still completing them) before it fails.
const DELIVERY_WAIT: Duration = Duration::from_secs(60);
/// How long [`Delivery::settle`] waits for another thread's write before it asks the server
/// again.
const FETCH_AFTER: Duration = Duration::from_millis(1);

/// The revision from which a lane serves `RM_COPIES_COLLECT`.
pub(crate) const LANE_COLLECT_REVISION: u32 = 19;

/// Copy data one synchronizing reply carries at most (the server's budget, 32 MiB).
pub(crate) const COLLECT_REPLY_BYTES: u64 = 32 << 20;

/// `CU_STREAM_NON_BLOCKING`.
const STREAM_NON_BLOCKING: u32 = 0x1;

/// The legacy stream's protocol handle.
const LEGACY: Handle = RM_STREAM_LEGACY as Handle;

/// An asynchronous device-to-host copy whose data has not been written to its destination.
struct PendingCopy {
    /// Taken (set to `None`) while a reply's data is being written.
    sink: Option<CopySink>,
    /// Bytes the copy reads.
    bytes: u64,
    ctx: Handle,
    stream: Handle,
    /// Whether its stream synchronizes with the legacy stream (the legacy stream itself,
    /// per-thread streams, streams created without `CU_STREAM_NON_BLOCKING`).
    blocking: bool,
}

/// The copies a point in the program is ordered after: each entry says "copies with an id
/// below this mark". Empty: none.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub(crate) struct Coverage {
    /// (context, stream) → mark.
    streams: HashMap<(Handle, Handle), u64>,
    /// Context → mark for the copies on its blocking streams (legacy included).
    blocking: HashMap<Handle, u64>,
    /// Context → mark for every copy of the context.
    all: HashMap<Handle, u64>,
}

fn raise(map: &mut HashMap<(Handle, Handle), u64>, key: (Handle, Handle), mark: u64) {
    let m = map.entry(key).or_insert(0);
    *m = (*m).max(mark);
}

fn raise1(map: &mut HashMap<Handle, u64>, key: Handle, mark: u64) {
    let m = map.entry(key).or_insert(0);
    *m = (*m).max(mark);
}

impl Coverage {
    /// Whether copy `id` on (`ctx`, `stream`) is covered.
    fn covers(&self, id: u64, p: &PendingCopy) -> bool {
        let below = |m: Option<&u64>| m.is_some_and(|m| id < *m);
        below(self.streams.get(&(p.ctx, p.stream)))
            || (p.blocking && below(self.blocking.get(&p.ctx)))
            || below(self.all.get(&p.ctx))
    }

    /// Adds what `other` covers.
    fn merge(&mut self, other: &Coverage) {
        for (k, m) in &other.streams {
            raise(&mut self.streams, *k, *m);
        }
        for (k, m) in &other.blocking {
            raise1(&mut self.blocking, *k, *m);
        }
        for (k, m) in &other.all {
            raise1(&mut self.all, *k, *m);
        }
    }

    /// Whether it covers nothing.
    pub(crate) fn is_empty(&self) -> bool {
        self.streams.is_empty() && self.blocking.is_empty() && self.all.is_empty()
    }
}

/// The ordering facts the client knows from its own calls.
#[derive(Default)]
struct Order {
    /// Streams created with `CU_STREAM_NON_BLOCKING`.
    nonblocking: HashSet<Handle>,
    /// (context, stream) → what the stream's later work waits for (`cuStreamWaitEvent`).
    deps: HashMap<(Handle, Handle), Coverage>,
    /// Event → what its last record (outside a capture) covers.
    events: HashMap<Handle, Coverage>,
}

impl Order {
    fn blocking(&self, stream: Handle) -> bool {
        stream == LEGACY || !self.nonblocking.contains(&stream)
    }

    /// What work issued now on (`ctx`, `stream`) is ordered after; `mark` is the copy mark
    /// taken before the call.
    fn frontier(&self, ctx: Handle, stream: Handle, mark: u64) -> Coverage {
        let mut c = Coverage::default();
        raise(&mut c.streams, (ctx, stream), mark);
        if let Some(d) = self.deps.get(&(ctx, stream)) {
            c.merge(d);
        }
        if stream == LEGACY {
            // The legacy stream waits for every blocking stream of its context.
            raise1(&mut c.blocking, ctx, mark);
            for ((cx, s), d) in &self.deps {
                if *cx == ctx && *s != LEGACY && self.blocking(*s) {
                    c.merge(d);
                }
            }
        } else if self.blocking(stream) {
            // A blocking stream waits for the legacy stream's earlier work.
            raise(&mut c.streams, (ctx, LEGACY), mark);
            if let Some(d) = self.deps.get(&(ctx, LEGACY)) {
                c.merge(d);
            }
        }
        c
    }
}

/// How [`Delivery::settle`] asks the server for covered copies that have not arrived.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fetch {
    /// `RM_COPIES_COLLECT`, in order with the session's calls (an application thread).
    Collect,
    /// `RM_COPIES_READY`: what host functions published (the callback thread).
    Ready,
}

/// The client's asynchronous-copy bookkeeping (see the module docs).
pub(crate) struct Delivery {
    rpc: RemoraV1Client,
    /// The session's protocol revision.
    revision: u32,
    next_copy_id: AtomicU64,
    pending: Mutex<HashMap<u64, PendingCopy>>,
    /// Signalled whenever a pending copy has been written to its destination.
    delivered: Condvar,
    order: Mutex<Order>,
    /// Collect calls answered on lanes so far.
    lane_collects: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

impl Delivery {
    pub(crate) fn new(rpc: RemoraV1Client, revision: u32) -> Self {
        Self {
            rpc,
            revision,
            next_copy_id: AtomicU64::new(1),
            pending: Mutex::default(),
            delivered: Condvar::new(),
            order: Mutex::default(),
            lane_collects: AtomicU64::new(0),
        }
    }

    /// The copy-id mark: copies issued before now have smaller ids.
    pub(crate) fn mark(&self) -> u64 {
        self.next_copy_id.load(Ordering::Acquire)
    }

    /// Registers a copy of `bytes` bytes about to be issued on (`ctx`, `stream`); its id goes
    /// in the call.
    pub(crate) fn register(&self, ctx: Handle, stream: Handle, bytes: u64, sink: CopySink) -> u64 {
        let id = self.next_copy_id.fetch_add(1, Ordering::AcqRel);
        let blocking = lock(&self.order).blocking(stream);
        lock(&self.pending).insert(
            id,
            PendingCopy {
                sink: Some(sink),
                bytes,
                ctx,
                stream,
                blocking,
            },
        );
        id
    }

    /// Forgets a copy whose call could not be sent.
    pub(crate) fn forget(&self, id: u64) {
        lock(&self.pending).remove(&id);
        self.delivered.notify_all();
    }

    /// [`Delivery::register`]s `sink` of a copy of `bytes` bytes and issues the copy with
    /// `issue(copy id)`; a copy that could not be issued is forgotten again.
    pub(crate) fn issue<E>(
        &self,
        (ctx, stream, bytes): (Handle, Handle, u64),
        sink: CopySink,
        issue: impl FnOnce(u64) -> Result<(), E>,
    ) -> Result<(), E> {
        let id = self.register(ctx, stream, bytes, sink);
        let r = issue(id);
        if r.is_err() {
            self.forget(id);
        }
        r
    }

    /// Number of asynchronous device-to-host copies not yet delivered.
    pub(crate) fn pending(&self) -> usize {
        lock(&self.pending).len()
    }

    /// Bytes of the asynchronous device-to-host copies not yet delivered.
    pub(crate) fn pending_bytes(&self) -> u64 {
        lock(&self.pending).values().map(|p| p.bytes).sum()
    }

    /// How many collect calls lanes answered ([`Delivery::settle`]).
    pub(crate) fn collects_on_lanes(&self) -> u64 {
        self.lane_collects.load(Ordering::Relaxed)
    }

    /// The contexts that have copies pending (only `ctx`, when given).
    pub(crate) fn pending_in(&self, ctx: Option<Handle>) -> Vec<Handle> {
        let mut ctxs: Vec<Handle> = lock(&self.pending)
            .values()
            .filter(|p| ctx.is_none_or(|c| p.ctx == c))
            .map(|p| p.ctx)
            .collect();
        ctxs.sort_unstable();
        ctxs.dedup();
        ctxs
    }

    // Ordering facts -----------------------------------------------------------------------

    /// A stream was created with `flags`.
    pub(crate) fn stream_created(&self, stream: Handle, flags: u32) {
        if flags & STREAM_NON_BLOCKING != 0 {
            lock(&self.order).nonblocking.insert(stream);
        }
    }

    /// A stream was destroyed.
    pub(crate) fn stream_destroyed(&self, stream: Handle) {
        let mut o = lock(&self.order);
        o.nonblocking.remove(&stream);
        o.deps.retain(|(_, s), _| *s != stream);
    }

    /// A context was destroyed.
    pub(crate) fn ctx_destroyed(&self, ctx: Handle) {
        lock(&self.order).deps.retain(|(c, _), _| *c != ctx);
    }

    /// What work issued now on (`ctx`, `stream`) is ordered after (`mark` taken before).
    pub(crate) fn frontier(&self, ctx: Handle, stream: Handle, mark: u64) -> Coverage {
        lock(&self.order).frontier(ctx, stream, mark)
    }

    /// What a context synchronize covers.
    pub(crate) fn context(&self, ctx: Handle, mark: u64) -> Coverage {
        let o = lock(&self.order);
        let mut c = Coverage::default();
        raise1(&mut c.all, ctx, mark);
        for ((cx, _), d) in &o.deps {
            if *cx == ctx {
                c.merge(d);
            }
        }
        c
    }

    /// `event` was recorded on (`ctx`, `stream`) outside a capture.
    pub(crate) fn event_recorded(&self, event: Handle, ctx: Handle, stream: Handle, mark: u64) {
        let mut o = lock(&self.order);
        let c = o.frontier(ctx, stream, mark);
        o.events.insert(event, c);
    }

    /// `event` was destroyed.
    pub(crate) fn event_destroyed(&self, event: Handle) {
        lock(&self.order).events.remove(&event);
    }

    /// What `event`'s last record covers.
    pub(crate) fn event(&self, event: Handle) -> Coverage {
        lock(&self.order)
            .events
            .get(&event)
            .cloned()
            .unwrap_or_default()
    }

    /// (`ctx`, `stream`) waits for `event` (`cuStreamWaitEvent`).
    pub(crate) fn stream_waits(&self, ctx: Handle, stream: Handle, event: Handle) {
        let mut o = lock(&self.order);
        if let Some(c) = o.events.get(&event).cloned() {
            o.deps.entry((ctx, stream)).or_default().merge(&c);
        }
    }

    // Delivery -----------------------------------------------------------------------------

    /// Writes the copies of a sync reply to their sinks, then returns its status.
    ///
    /// A copy stays listed as pending until its bytes are written, so that another thread's
    /// synchronizing call that covers it waits for the write ([`Delivery::settle`]).
    /// Device-side printf output (the entry `RM_DEVICE_OUTPUT_ID`, revision 4) is written to
    /// this process's standard output before the call returns.
    pub(crate) fn finish(&self, reply: RmSyncReply) -> CuResult<()> {
        for c in reply.copies {
            if c.copy_id == RM_DEVICE_OUTPUT_ID {
                crate::stdout::write_device_output(&c.data);
                continue;
            }
            let sink = lock(&self.pending)
                .get_mut(&c.copy_id)
                .and_then(|p| p.sink.take());
            match sink {
                Some(sink) => sink(&c.data),
                None => tracing::warn!(
                    "remora: the server delivered data for unknown async copy {}",
                    c.copy_id
                ),
            }
            lock(&self.pending).remove(&c.copy_id);
            self.delivered.notify_all();
        }
        CuError::check(reply.status)
    }

    /// The pending copies `cov` covers (named to a host callback's server side).
    pub(crate) fn covered_ids(&self, cov: &Coverage) -> Vec<u64> {
        let mut ids: Vec<u64> = lock(&self.pending)
            .iter()
            .filter(|(id, p)| cov.covers(**id, p))
            .map(|(id, _)| *id)
            .collect();
        ids.sort_unstable();
        ids.truncate(RM_MAX_COLLECT as usize);
        ids
    }

    /// The protocol revision of the session.
    pub(crate) fn revision(&self) -> u32 {
        self.revision
    }

    /// Waits until every copy `cov` covers has been written to its destination, fetching the
    /// ones the server still holds (`how`). Call it after the call that guarantees their
    /// completion has returned successfully.
    ///
    /// `lanes` (revision 19, [`Fetch::Collect`]): the session's lanes, when it has some and the
    /// held copies are large. A reply carries at most 32 MiB of copy data, so a large
    /// asynchronous read comes back one reply at a time; with lanes, the held copies are
    /// collected on the session's connection and its lanes at once, one collect each (the
    /// server hands each completed copy to one of them).
    pub(crate) fn settle(
        &self,
        cov: &Coverage,
        how: Fetch,
        lanes: &[RemoraV1Client],
    ) -> CuResult<()> {
        if cov.is_empty() {
            return Ok(());
        }
        let deadline = Instant::now() + DELIVERY_WAIT;
        let mut ask = true;
        loop {
            // The covered copies still pending, and those of them the server still holds
            // (no thread is writing their bytes).
            let (missing, held) = {
                let pending = lock(&self.pending);
                let mut missing = 0usize;
                let mut held = Vec::new();
                for (id, p) in pending.iter() {
                    if cov.covers(*id, p) {
                        missing += 1;
                        if p.sink.is_some() {
                            held.push((*id, p.ctx, p.stream, p.bytes));
                        }
                    }
                }
                (missing, held)
            };
            if missing == 0 {
                return Ok(());
            }
            if Instant::now() >= deadline {
                tracing::error!(
                    "remora: a synchronizing call returned but the data of {missing} \
                     asynchronous device-to-host cop{} it covers never arrived",
                    if missing == 1 { "y" } else { "ies" }
                );
                return Err(CuError(cu::UNKNOWN));
            }
            if ask && !held.is_empty() {
                self.fetch(&held, how, lanes);
            }
            // Wait a moment for a write in progress (another thread's reply) or for the
            // server to complete the copy, then ask again.
            let pending = lock(&self.pending);
            let (pending, waited) = self
                .delivered
                .wait_timeout(pending, FETCH_AFTER)
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            drop(pending);
            ask = waited.timed_out();
        }
    }

    /// Asks the server for completed copies, naming the `(id, ctx, stream, bytes)` waited for;
    /// on `lanes` too when more than one reply's worth is held (see [`Delivery::settle`]).
    fn fetch(&self, held: &[(u64, Handle, Handle, u64)], how: Fetch, lanes: &[RemoraV1Client]) {
        let reply = if how == Fetch::Ready {
            self.rpc.rm_copies_ready()
        } else if self.revision >= 8 {
            let ids: Vec<u64> = held
                .iter()
                .take(RM_MAX_COLLECT as usize)
                .map(|(id, ..)| *id)
                .collect();
            let bytes: u64 = held.iter().map(|h| h.3).sum();
            // One more connection for each further reply's worth of held bytes.
            let extra = usize::try_from(bytes.saturating_sub(1) / COLLECT_REPLY_BYTES)
                .unwrap_or(usize::MAX)
                .min(held.len().saturating_sub(1));
            // (The caller passes lanes only to a server that serves collects on them.)
            let lanes = &lanes[..extra.min(lanes.len())];
            if !lanes.is_empty() {
                std::thread::scope(|scope| {
                    for lane in lanes {
                        let ids = &ids;
                        scope.spawn(move || {
                            if self.take(lane.rm_copies_collect(ids)) {
                                self.lane_collects.fetch_add(1, Ordering::Relaxed);
                            }
                        });
                    }
                    self.take(self.rpc.rm_copies_collect(&ids));
                });
                return;
            }
            self.rpc.rm_copies_collect(&ids)
        } else {
            // Older servers: a stream query collects the completed copies too. Its status is
            // the stream's (NOT_READY while later work runs), not this call's.
            let (_, ctx, stream, _) = held[0];
            self.rpc.rm_stream_query(&RmStreamArgs { ctx, stream })
        };
        self.take(reply);
    }

    /// Writes the copies a collecting call's reply delivered; false when the call failed.
    fn take(&self, reply: Result<RmSyncReply, remora_oncrpc::RpcError>) -> bool {
        match reply {
            Ok(r) => {
                if let Err(e) = self.finish(r) {
                    tracing::debug!("remora: collecting completed copies: {e}");
                }
                true
            }
            Err(e) => {
                tracing::debug!("remora: collecting completed copies failed: {e}");
                false
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn copy(ctx: Handle, stream: Handle, blocking: bool) -> PendingCopy {
        PendingCopy {
            sink: None,
            bytes: 0,
            ctx,
            stream,
            blocking,
        }
    }

    #[test]
    fn a_stream_covers_its_earlier_copies_only() {
        let o = Order::default();
        let c = o.frontier(1, 10, 5);
        assert!(c.covers(4, &copy(1, 10, true)));
        assert!(!c.covers(5, &copy(1, 10, true)), "issued after the point");
        assert!(!c.covers(4, &copy(1, 11, true)), "another stream");
        assert!(!c.covers(4, &copy(2, 10, true)), "another context");
    }

    #[test]
    fn the_legacy_stream_covers_blocking_streams_not_nonblocking_ones() {
        let mut o = Order::default();
        o.nonblocking.insert(12);
        let c = o.frontier(1, LEGACY, 9);
        assert!(c.covers(3, &copy(1, 11, true)));
        assert!(!c.covers(3, &copy(1, 12, false)));
        assert!(
            !c.covers(3, &copy(2, 11, true)),
            "another context's streams"
        );
        // A blocking stream covers the legacy stream's earlier copies.
        let b = o.frontier(1, 11, 9);
        assert!(b.covers(3, &copy(1, LEGACY, true)));
        assert!(!o.frontier(1, 12, 9).covers(3, &copy(1, LEGACY, true)));
    }

    #[test]
    fn wait_event_chains_carry_coverage() {
        let mut o = Order::default();
        o.nonblocking.extend([20, 21, 22]);
        // copy 3 on A(20); event E recorded on A at mark 4; B(21) waits E; event F on B at 7;
        // C(22) waits F: C's later work covers copy 3, not copy 5 (on A after the record).
        let e = o.frontier(1, 20, 4);
        o.events.insert(100, e);
        let ev = o.events[&100].clone();
        o.deps.entry((1, 21)).or_default().merge(&ev);
        let f = o.frontier(1, 21, 7);
        o.deps.entry((1, 22)).or_default().merge(&f);
        let c = o.frontier(1, 22, 8);
        assert!(c.covers(3, &copy(1, 20, false)));
        assert!(!c.covers(5, &copy(1, 20, false)));
    }

    #[test]
    fn merge_keeps_the_higher_mark() {
        let mut a = Coverage::default();
        raise(&mut a.streams, (1, 2), 5);
        let mut b = Coverage::default();
        raise(&mut b.streams, (1, 2), 3);
        raise1(&mut b.all, 7, 2);
        a.merge(&b);
        assert_eq!(a.streams[&(1, 2)], 5);
        assert_eq!(a.all[&7], 2);
    }
}
