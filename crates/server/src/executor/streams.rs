//! Procedures on streams, events and host callbacks, and the copy-collection procedures.

use super::*;
use remora_proto::cuda::{CuError, cu};

impl Executor {
    pub(super) fn stream_create(&self, session: &Session, a: RmStreamCreateArgs) -> RmHandleReply {
        self.create_in_ctx(
            session,
            "RM_STREAM_CREATE",
            a.ctx,
            crate::quota::Kind::Streams,
            |b, c| b.stream_create(c, a.flags, a.priority),
            |raw| Resource::Stream { raw, ctx: a.ctx },
        )
    }

    pub(super) fn stream_synchronize(
        &self,
        call: &CallContext,
        a: RmStreamArgs,
    ) -> ProcResult<RmSyncReply> {
        self.synchronizing(
            call,
            |st| stream_target(st, a.ctx, a.stream),
            |b, t| b.stream_query(t.ctx, t.stream),
            move |inner, session| {
                let target = stream_target(&session.lock(), a.ctx, a.stream);
                let (own, scope) = match target {
                    Ok(t) => (
                        inner.backend.stream_synchronize(t.ctx, t.stream),
                        Scope::Stream(t.ctx_handle, t.stream_handle),
                    ),
                    Err(e) => (Err(e), Scope::Finished),
                };
                let mut st = session.lock();
                inner.sync_reply("RM_STREAM_SYNCHRONIZE", &mut st, own, scope)
            },
        )
    }

    /// RM_STREAM_SIGNAL (revision 14): the stream writes `a.seq` into completion word
    /// `a.slot` of the session's region when it gets there; or, when the client must make
    /// the full synchronize instead, the word gets `a.seq | SIGNAL_FALLBACK` at once. Before
    /// it queues the stream's write it stores `a.seq | SIGNAL_QUEUED`, which tells the client
    /// that what is left of its wait is the device's. Never an error of its own (nothing is
    /// deferred).
    pub(super) fn stream_signal(
        &self,
        call: &CallContext,
        a: RmStreamSignalArgs,
    ) -> ProcResult<()> {
        let session = self.session(call);
        let Some(signals) = session
            .area
            .get()
            .and_then(remora_oncrpc::DataArea::signals)
        else {
            tracing::debug!(
                connection = call.connection,
                "RM_STREAM_SIGNAL from a session without a shared region; ignored"
            );
            return Ok(());
        };
        let slot = a.slot as usize;
        let Some(word) = signals.word(slot) else {
            tracing::debug!(slot, "RM_STREAM_SIGNAL names no completion word; ignored");
            return Ok(());
        };
        let seq = a.seq & !remora_shm::SIGNAL_FLAGS;
        // One look under the session lock: what would send the client to the full call,
        // else the stream.
        let target = {
            let st = session.lock();
            if st.has_deferred() {
                Err("an error waits for the synchronize")
            } else if !st.captures.is_empty() {
                Err("a stream capture is in progress")
            } else if !session.copies.is_empty() {
                Err("copies wait to be delivered")
            } else if session.ordered.is_on() {
                Err("the session uses host callbacks")
            } else if session.may_print.load(std::sync::atomic::Ordering::Relaxed) {
                Err("a module may print from the device")
            } else {
                stream_target(&st, a.ctx, a.stream).map_err(|_| "the stream names nothing")
            }
        };
        let r = target.and_then(|t| {
            if self.inner.device_output.get().is_some_and(|o| o.pending()) {
                return Err("device output waits to be delivered");
            }
            // Before the stream's write is queued, so that the stream's number, which may
            // come at once (an idle stream), is never overwritten by it.
            word.store(
                seq | remora_shm::SIGNAL_QUEUED,
                std::sync::atomic::Ordering::Release,
            );
            self.inner
                .backend
                .stream_signal(t.ctx, t.stream, &signals, slot, seq)
                .map_err(|e| {
                    tracing::debug!(
                        result = e.0,
                        "RM_STREAM_SIGNAL: the stream cannot write the completion word"
                    );
                    "the stream cannot write the word"
                })
        });
        match r {
            Ok(()) => {
                // The client watches the word, spinning, and its next call comes as soon as
                // the stream gets there: wait for it spinning too (`signal_hold`).
                let hold = remora_shm::signal_hold();
                if !hold.is_zero() {
                    call.hold_next_read(hold);
                }
            }
            Err(why) => {
                tracing::trace!(
                    why,
                    "RM_STREAM_SIGNAL: the client makes the full synchronize"
                );
                word.store(
                    seq | remora_shm::SIGNAL_FALLBACK,
                    std::sync::atomic::Ordering::Release,
                );
            }
        }
        Ok(())
    }

    pub(super) fn event_record(&self, call: &CallContext, a: RmEventRecordArgs) -> ProcResult<()> {
        self.oneway_on_stream(
            call,
            "RM_EVENT_RECORD",
            (a.ctx, a.stream),
            |st| {
                let (e, event_ctx) = match st.get(a.event)? {
                    Resource::Event { raw, ctx } => (*raw, *ctx),
                    _ => return Err(CuError(cu::INVALID_HANDLE)),
                };
                // The legacy stream of the named context, else of the event's.
                let ctx = if a.ctx == 0 { event_ctx } else { a.ctx };
                Ok((e, stream_target(st, ctx, a.stream)?))
            },
            |b, (e, t)| b.event_record(t.ctx, e, t.stream),
        )
    }

    /// RM_EVENT_CREATE_MANY: `a.count` events, all or none (those made before a failure are
    /// destroyed again).
    pub(super) fn event_create_many(
        &self,
        session: &Session,
        a: RmEventBatchArgs,
    ) -> CuResult<Vec<u64>> {
        if a.count == 0 || a.count > RM_MAX_EVENT_BATCH {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let n = u64::from(a.count);
        session.charge(crate::quota::Kind::Events, n, "RM_EVENT_CREATE_MANY")?;
        let r = self.in_ctx(session, a.ctx, |b, c| {
            let mut raw = Vec::with_capacity(a.count as usize);
            for _ in 0..a.count {
                match b.event_create(c, a.flags) {
                    Ok(e) => raw.push(e),
                    Err(err) => {
                        for e in raw {
                            let _ = b.event_destroy(c, e);
                        }
                        return Err(err);
                    }
                }
            }
            let mut st = session.lock();
            Ok(raw
                .into_iter()
                .map(|raw| st.insert(Resource::Event { raw, ctx: a.ctx }))
                .collect())
        });
        if r.is_err() {
            session.uncharge(crate::quota::Kind::Events, n);
        }
        r
    }

    pub(super) fn event_elapsed_time(&self, session: &Session, a: RmElapsedArgs) -> RmFloatReply {
        let r = self.resolved(
            session,
            |st| Ok((st.event(a.start)?, st.event(a.end)?)),
            |b, ((s, c), (e, _))| b.event_elapsed(c, s, e),
        );
        float_reply("RM_EVENT_ELAPSED_TIME", r)
    }

    /// Answered when callbacks are due (a deferred reply), never on the ordered thread.
    pub(super) fn wait_host_callbacks(
        &self,
        call: &CallContext,
    ) -> ProcResult<RmHostCallbacksReply> {
        let session = self.session(call);
        match call.defer() {
            Some(reply) => {
                session.callbacks.wait(reply);
                Err(ProcError::Deferred)
            }
            None => Ok(RmHostCallbacksReply {
                status: cu::NOT_SUPPORTED,
                due: Vec::new(),
            }),
        }
    }

    /// RM_COPIES_COLLECT (revision 8): the completed asynchronous copies, for a client whose
    /// synchronizing point covers copies it has not received (in order with the session's
    /// other calls). The named copies are polled briefly, never waited for, so a wrong guess
    /// by the client cannot block the session.
    pub(super) fn copies_collect(
        &self,
        call: &CallContext,
        ids: Vec<u64>,
    ) -> ProcResult<RmSyncReply> {
        let session = self.session(call);
        let deadline = std::time::Instant::now() + COLLECT_POLL;
        loop {
            let mut status = cu::SUCCESS;
            let copies = session.copies.collect(Scope::Finished, &mut status);
            if !copies.is_empty()
                || !session.copies.any_of(&ids)
                || std::time::Instant::now() >= deadline
            {
                log_failed("RM_COPIES_COLLECT", status);
                return Ok(RmSyncReply { status, copies });
            }
            // Each pass queries every pending copy: a few passes over the poll, not hundreds.
            std::thread::sleep(std::time::Duration::from_micros(200));
        }
    }

    /// RM_LAUNCH_HOST_FUNC(_COPIES): a host function that reports the client's callback due
    /// when the stream reaches it, after publishing the pending copies `copies` (which the
    /// callback is ordered after, so they have completed) for RM_COPIES_READY.
    pub(super) fn launch_host_func(
        &self,
        call: &CallContext,
        what: &'static str,
        a: RmHostFuncArgs,
        copies: Vec<u64>,
    ) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        self.oneway_on(call, what, on, move |inner, session| {
            let (t, capturing) = {
                let st = session.lock();
                (
                    stream_target(&st, a.ctx, a.stream)?,
                    !st.captures.is_empty(),
                )
            };
            // Captured, the host function would run at every graph launch, but the client's
            // callback runs once.
            not_captured(inner, capturing, t.ctx, t.stream)?;
            session.ordered.start(session.connection)?;
            inner
                .any_ordered
                .store(true, std::sync::atomic::Ordering::Release);
            let callbacks = Arc::clone(&session.callbacks);
            // The host function runs on the driver's thread while a call of this session may
            // hold the session lock inside the driver waiting for it (cuMemFree, a
            // synchronous copy): it must not take that lock, nor call the driver. The sticky
            // error is read from its own cell; the copies it publishes are held here.
            let sticky = session.lock().sticky_cell();
            let follows = if copies.is_empty() {
                Vec::new()
            } else {
                session.copies.find(&copies)
            };
            let published = Arc::clone(&session.copies);
            let id = a.callback_id;
            inner.backend.launch_host_func(
                t.ctx,
                t.stream,
                Box::new(move || {
                    published.publish(&follows);
                    drop(follows);
                    let status = sticky.load(std::sync::atomic::Ordering::Acquire);
                    callbacks.reached(id, status);
                }),
            )
        })
    }
}
