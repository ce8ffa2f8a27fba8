//! [`Session`] methods for streams, events, host callbacks and per-thread streams.

use super::*;
use crate::host_callbacks::HostCallback;

impl Session {
    revision_calls! {
        /// `cuStreamSetAttribute` (revision 10).
        stream_set_attribute(ctx: RmHandle, stream: RmHandle, value: RmStreamAttr) -> ()
            = 10, "cuStreamSetAttribute": CuError::check,
            rm_stream_set_attribute(&RmStreamAttrArgs { ctx, stream, value });
        /// `cuStreamGetAttribute` of attribute id `kind` (revision 10).
        stream_get_attribute(ctx: RmHandle, stream: RmHandle, kind: i32) -> RmStreamAttr
            = 10, "cuStreamGetAttribute": Reply::value,
            rm_stream_get_attribute(&RmStreamAttrQuery { ctx, stream, kind });
    }

    /// Maps a [`StreamRef`] to a protocol handle; the per-thread stream is created on first
    /// use by each client thread (flags 0, priority 0).
    ///
    /// Approximation: CUDA's per-thread default stream synchronizes with the legacy stream
    /// like a blocking stream and lives as long as its thread; here it is an ordinary
    /// blocking stream created per (client thread, context) and destroyed with the context
    /// or the session, not when the thread exits.
    pub fn stream_handle(&self, ctx: RmHandle, s: StreamRef) -> CuResult<RmHandle> {
        match s {
            StreamRef::Legacy => Ok(u64::from(RM_STREAM_LEGACY)),
            StreamRef::Handle(h) => Ok(h),
            StreamRef::PerThread => {
                let key = (std::thread::current().id(), ctx);
                if let Some(h) = lock(&self.per_thread).get(&key) {
                    return Ok(*h);
                }
                let h = self.stream_create(ctx, 0, 0)?;
                lock(&self.per_thread).insert(key, h);
                Ok(h)
            }
        }
    }

    /// `cuCtxGetStreamPriorityRange`: (least, greatest).
    pub fn ctx_get_stream_priority_range(&self, ctx: RmHandle) -> CuResult<(i32, i32)> {
        pair(call!(self.rm_ctx_get_stream_priority_range(&ctx))?)
    }

    /// `cuStreamCreateWithPriority`.
    pub fn stream_create(&self, ctx: RmHandle, flags: u32, priority: i32) -> CuResult<RmHandle> {
        let h = Reply::value(call!(self.rm_stream_create(&RmStreamCreateArgs {
            ctx,
            flags,
            priority
        }))?)?;
        self.delivery.stream_created(h, flags);
        Ok(h)
    }

    /// `cuStreamDestroy`.
    pub fn stream_destroy(&self, stream: RmHandle) -> CuResult<()> {
        CuError::check(call!(self.rm_stream_destroy(&stream))?)?;
        lock(&self.per_thread).retain(|_, s| *s != stream);
        lock(&self.captures).streams.remove(&stream);
        self.delivery.stream_destroyed(stream);
        Ok(())
    }

    /// `cuStreamSynchronize` (`RM_STREAM_LEGACY` names `ctx`'s legacy stream).
    pub fn stream_synchronize(&self, ctx: RmHandle, stream: RmHandle) -> CuResult<()> {
        if self.signalled_sync(ctx, stream) {
            return Ok(());
        }
        let start = std::time::Instant::now();
        let mark = self.copy_mark();
        let r = call!(self.rm_stream_synchronize(&RmStreamArgs { ctx, stream }))?;
        self.observe_sync(start.elapsed());
        self.finish_sync(r)?;
        self.settle_stream(ctx, stream, mark)
    }

    /// `cuStreamQuery`: `Ok(true)` when done, `Ok(false)` for CUDA_ERROR_NOT_READY.
    pub fn stream_query(&self, ctx: RmHandle, stream: RmHandle) -> CuResult<bool> {
        let mark = self.copy_mark();
        let r = call!(self.rm_stream_query(&RmStreamArgs { ctx, stream }))?;
        let done = ready(self.finish_sync(r))?;
        if done {
            self.settle_stream(ctx, stream, mark)?;
            self.completed("cuStreamQuery");
        }
        Ok(done)
    }

    /// `cuLaunchHostFunc` / `cuStreamAddCallback`: `cb` runs in this process, on the
    /// session's callback thread, when `stream` (of `ctx`) reaches this point; later work in
    /// the stream waits until it returns. One-way, in order with launches and copies.
    pub fn launch_host_func(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        cb: HostCallback,
    ) -> CuResult<()> {
        self.host_func(ctx, stream, cb, true)
    }

    /// [`Session::launch_host_func`]; `read_back`: whether the function reads managed and
    /// mapped memory (read back on its stream before it runs).
    pub(super) fn host_func(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        cb: HostCallback,
        read_back: bool,
    ) -> CuResult<()> {
        self.need_revision(4, "a host callback")?;
        self.not_captured(stream, "a host callback")?;
        let mirrored = if read_back {
            self.read_mirrors_before(ctx, stream)
        } else {
            Vec::new()
        };
        // The callback must see the bytes of the copies its stream is ordered after: they are
        // named to the server, whose host function publishes them (revision 8), and the
        // callback thread takes them before it runs the callback.
        let cov = self.delivery.frontier(ctx, stream, self.copy_mark());
        let copies = self.delivery.covered_ids(&cov);
        let named = self.delivery.revision() >= 8;
        let delivery = Arc::clone(&self.delivery);
        let mirrors = Arc::clone(&self.mirrors);
        // With managed or mapped memory, device work submitted after this function waits
        // until it has run (or is dropped unrun), so that what it writes is pushed first.
        let gate = crate::mirror::HostFnGate::enter(&self.mirrors);
        let cb: HostCallback = Box::new(move |status| {
            let _gate = gate;
            if named && let Err(e) = delivery.settle(&cov, Fetch::Ready, &[]) {
                tracing::error!(
                    "remora: a host callback runs without the data of copies before it: {e}"
                );
            }
            mirrors.merge_read_back(&mirrored);
            cb(status)
        });
        let id = self.callbacks.register(&self.rpc, cb).map_err(|e| {
            tracing::error!("remora: cannot start the host callback thread: {e}");
            CuError(cu::OUT_OF_MEMORY)
        })?;
        let r = if named {
            call!(self.rm_launch_host_func_copies(&RmHostFuncCopiesArgs {
                ctx,
                stream,
                callback_id: id,
                copies,
            }))
        } else {
            call!(self.rm_launch_host_func(&RmHostFuncArgs {
                ctx,
                stream,
                callback_id: id
            }))
        };
        if r.is_err() {
            self.callbacks.forget(id);
        }
        r
    }

    /// Host callbacks enqueued and not yet run.
    pub fn host_callbacks_outstanding(&self) -> usize {
        self.callbacks.outstanding()
    }

    /// `cuStreamWaitEvent`: one-way.
    pub fn stream_wait_event(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        event: RmHandle,
        flags: u32,
    ) -> CuResult<()> {
        {
            // Waiting for an event recorded in a capture joins the capture.
            let mut caps = lock(&self.captures);
            if let Some(id) = caps.events.get(&event).copied()
                && caps.active.contains_key(&id)
            {
                caps.streams.entry(stream).or_insert(id);
            }
        }
        self.delivery.stream_waits(ctx, stream, event);
        call!(self.rm_stream_wait_event(&RmStreamWaitArgs {
            ctx,
            stream,
            event,
            flags
        }))
    }

    /// `cuEventCreate`. From revision 13 events come from this session's pool of fresh events
    /// of that context and flags, refilled 16 at a time (`RM_EVENT_CREATE_MANY`):
    /// a fresh event is what a creation would make, so most creations ask nothing.
    pub fn event_create(&self, ctx: RmHandle, flags: u32) -> CuResult<RmHandle> {
        if self.welcome.revision < 13 {
            return Reply::value(call!(
                self.rm_event_create(&RmHandleFlags { handle: ctx, flags })
            )?);
        }
        let pooled = lock(&self.events)
            .fresh
            .get_mut(&(ctx, flags))
            .and_then(Vec::pop);
        let event = match pooled {
            Some(e) => e,
            None => {
                let args = RmEventBatchArgs {
                    ctx,
                    flags,
                    count: EVENT_BATCH,
                };
                let mut made = match call!(self.rm_event_create_many(&args))? {
                    RmHandlesReply::Case0(h) if !h.is_empty() => h,
                    RmHandlesReply::Case0(_) => return Err(CuError(cu::UNKNOWN)),
                    RmHandlesReply::Default { discriminant } => {
                        return Err(CuError(nonzero(discriminant)));
                    }
                };
                let event = made.pop().unwrap_or_default();
                lock(&self.events)
                    .fresh
                    .entry((ctx, flags))
                    .or_default()
                    .extend(made);
                event
            }
        };
        lock(&self.events).live.insert(event, ctx);
        Ok(event)
    }

    /// `cuEventDestroy`: one-way for an event this session knows is live (revision 13),
    /// else a round trip that answers the server's verdict.
    pub fn event_destroy(&self, event: RmHandle) -> CuResult<()> {
        if lock(&self.events).live.remove(&event).is_some() {
            call!(self.rm_event_destroy_async(&event))?;
        } else {
            CuError::check(call!(self.rm_event_destroy(&event))?)?;
        }
        self.delivery.event_destroyed(event);
        Ok(())
    }

    /// Forgets the pooled and live events and the live stream-ordered allocations of the
    /// contexts `gone` says are gone (destroyed, or a primary context released or reset):
    /// the server dropped them with the context, so a later use must get its verdict.
    pub(super) fn forget_events_of(&self, gone: impl Fn(RmHandle) -> bool) {
        {
            let mut events = lock(&self.events);
            events.fresh.retain(|(ctx, _), _| !gone(*ctx));
            events.live.retain(|_, ctx| !gone(*ctx));
        }
        lock(&self.stream_allocs).retain(|_, ctx| !gone(*ctx));
    }

    /// `cuEventRecord`: one-way.
    pub fn event_record(&self, ctx: RmHandle, event: RmHandle, stream: RmHandle) -> CuResult<()> {
        let capturing = {
            let mut caps = lock(&self.captures);
            match caps.streams.get(&stream).copied() {
                Some(id) => {
                    caps.events.insert(event, id);
                    true
                }
                None => {
                    caps.events.remove(&event);
                    false
                }
            }
        };
        // A record captured into a graph does not change the event outside it: the copies
        // its synchronize waits for stay those of its last record outside a capture.
        if !capturing {
            self.delivery
                .event_recorded(event, ctx, stream, self.copy_mark());
        }
        call!(self.rm_event_record(&RmEventRecordArgs { ctx, event, stream }))
    }

    /// Waits for the copies an event covers: those its stream was ordered after at its record.
    fn settle_event(&self, event: RmHandle) -> CuResult<()> {
        self.delivery.settle(
            &self.delivery.event(event),
            Fetch::Collect,
            self.collect_lanes(),
        )
    }

    /// `cuEventSynchronize`.
    pub fn event_synchronize(&self, event: RmHandle) -> CuResult<()> {
        let r = call!(self.rm_event_synchronize(&event))?;
        self.finish_sync(r)?;
        self.settle_event(event)
    }

    /// `cuEventQuery`: `Ok(true)` when complete.
    pub fn event_query(&self, event: RmHandle) -> CuResult<bool> {
        let r = call!(self.rm_event_query(&event))?;
        let done = ready(self.finish_sync(r))?;
        if done {
            self.settle_event(event)?;
            self.completed("cuEventQuery");
        }
        Ok(done)
    }

    /// `cuEventElapsedTime` in milliseconds.
    pub fn event_elapsed_time(&self, start: RmHandle, end: RmHandle) -> CuResult<f32> {
        Reply::value(call!(
            self.rm_event_elapsed_time(&RmElapsedArgs { start, end })
        )?)
    }
}
