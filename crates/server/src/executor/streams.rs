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
    /// the full synchronize instead, the word gets `a.seq | SIGNAL_FALLBACK` at once. Never
    /// an error of its own (nothing is deferred).
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
        let seq = a.seq & !remora_shm::SIGNAL_FALLBACK;
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
            let budget = session
                .signal_gate
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .budget(t.stream, signal_query_budget());
            self.inner
                .backend
                .stream_signal(t.ctx, t.stream, &signals, (slot, seq), budget)
                .map(|stored| {
                    session
                        .signal_gate
                        .lock()
                        .unwrap_or_else(std::sync::PoisonError::into_inner)
                        .record(t.stream, budget, stored);
                    if self.inner.profiling() {
                        session.count_signal(stored);
                    }
                })
                .map_err(|e| {
                    tracing::debug!(
                        result = e.0,
                        "RM_STREAM_SIGNAL: the stream cannot write the completion word"
                    );
                    "the stream cannot write the word"
                })
        });
        if let Err(why) = r {
            tracing::trace!(
                why,
                "RM_STREAM_SIGNAL: the client makes the full synchronize"
            );
            word.store(
                seq | remora_shm::SIGNAL_FALLBACK,
                std::sync::atomic::Ordering::Release,
            );
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

/// Longest `REMORA_SIGNAL_QUERY_US` taken: a signal's query holds the session's connection
/// thread, so a longer budget would delay the session's other calls for nothing (the stream
/// writes the word anyway once the budget is spent).
const SIGNAL_QUERY_MAX_US: u64 = 200;

/// The default query budget: on the H200 (session 24) an empty kernel's stream was found done
/// within 10 µs for 99.6-99.9% of the signals, and launch + synchronize p50 over shm fell from
/// 12.14 to 11.56 µs (5 µs gave up too often and then paid the write as well).
const SIGNAL_QUERY_DEFAULT_US: u64 = 10;

/// `REMORA_SIGNAL_QUERY_US` (default [`SIGNAL_QUERY_DEFAULT_US`]; 0 turns the query off): how
/// long a completion-word signal asks the stream whether it is done before having it write
/// the word (the `query` of [`crate::Backend::stream_signal`]). Zero under `REMORA_WAIT=block`,
/// which spins nowhere. Read once; [`SignalGate`] skips it on streams where it keeps giving up.
pub(crate) fn signal_query_budget() -> std::time::Duration {
    static BUDGET: std::sync::OnceLock<std::time::Duration> = std::sync::OnceLock::new();
    *BUDGET.get_or_init(|| {
        let us = match std::env::var("REMORA_SIGNAL_QUERY_US") {
            Err(_) => SIGNAL_QUERY_DEFAULT_US,
            Ok(v) => match v.trim().parse::<u64>() {
                Ok(us) if us <= SIGNAL_QUERY_MAX_US => us,
                _ => {
                    tracing::warn!(
                        "REMORA_SIGNAL_QUERY_US={v:?} is not a number of microseconds from 0 to {SIGNAL_QUERY_MAX_US}; using the default, {SIGNAL_QUERY_DEFAULT_US}"
                    );
                    SIGNAL_QUERY_DEFAULT_US
                }
            },
        };
        if us > 0 && remora_shm::WaitPolicy::from_env() == remora_shm::WaitPolicy::Block {
            tracing::info!(
                "REMORA_WAIT=block: completion-word signals never query the stream (REMORA_SIGNAL_QUERY_US={us} ignored)"
            );
            return std::time::Duration::ZERO;
        }
        tracing::debug!(
            "completion-word signals ask the stream for up to {us} us whether it is done before having it write the word (REMORA_SIGNAL_QUERY_US)"
        );
        std::time::Duration::from_micros(us)
    })
}

/// After this many signals in a row on one stream whose query gave up (the stream was still
/// busy at the end of the budget), the stream writes the word at once ...
const SIGNAL_GATE_MISSES: u8 = 2;
/// ... except for every this many signals, which query again (the stream's work may have
/// become short again).
const SIGNAL_GATE_PROBE_EVERY: u32 = 16;
/// Streams remembered per session; the least recently signalled one is forgotten first.
const SIGNAL_GATE_STREAMS: usize = 16;

/// Per session: whether a completion-word signal on a stream should query it first. A query
/// that gives up has spent its budget on the session's connection thread for nothing (the
/// stream then writes the word), so streams whose work outlasts the budget (long kernels)
/// stop querying, apart from a probe every [`SIGNAL_GATE_PROBE_EVERY`] signals.
#[derive(Debug, Default)]
pub(crate) struct SignalGate {
    /// (raw stream, consecutive give-ups, signals written at once since), most recent last.
    streams: Vec<(u64, u8, u32)>,
}

impl SignalGate {
    /// The query budget for a signal on `stream`: `full`, or zero while the stream's queries
    /// keep giving up.
    pub(crate) fn budget(&mut self, stream: u64, full: std::time::Duration) -> std::time::Duration {
        if full.is_zero() {
            return full;
        }
        let Some(i) = self.streams.iter().position(|e| e.0 == stream) else {
            return full;
        };
        let e = self.streams.remove(i);
        let (misses, skipped) = (e.1, e.2);
        let (budget, skipped) = if misses < SIGNAL_GATE_MISSES {
            (full, skipped)
        } else if skipped + 1 >= SIGNAL_GATE_PROBE_EVERY {
            (full, 0)
        } else {
            (std::time::Duration::ZERO, skipped + 1)
        };
        self.streams.push((stream, misses, skipped));
        budget
    }

    /// What a signal on `stream` that was given `budget` came to: `queried`, the stream was
    /// found done within it.
    pub(crate) fn record(&mut self, stream: u64, budget: std::time::Duration, queried: bool) {
        if budget.is_zero() {
            return;
        }
        let misses = match self.streams.iter().position(|e| e.0 == stream) {
            Some(i) => self.streams.remove(i).1,
            None => 0,
        };
        let misses = if queried { 0 } else { misses.saturating_add(1) };
        if self.streams.len() >= SIGNAL_GATE_STREAMS {
            self.streams.remove(0);
        }
        self.streams.push((stream, misses, 0));
    }
}

#[cfg(test)]
mod signal_gate_tests {
    use super::*;
    use std::time::Duration;

    const FULL: Duration = Duration::from_micros(10);

    #[test]
    fn a_stream_whose_queries_give_up_is_written_at_once_but_probed_again() {
        let mut g = SignalGate::default();
        // Short work: every query answers; the budget stays.
        for _ in 0..100 {
            assert_eq!(g.budget(7, FULL), FULL);
            g.record(7, FULL, true);
        }
        // Long work: two give-ups in a row close the gate.
        for _ in 0..SIGNAL_GATE_MISSES {
            assert_eq!(g.budget(7, FULL), FULL);
            g.record(7, FULL, false);
        }
        let budgets: Vec<Duration> = (0..SIGNAL_GATE_PROBE_EVERY)
            .map(|_| {
                let b = g.budget(7, FULL);
                g.record(7, b, false);
                b
            })
            .collect();
        let probes = budgets.iter().filter(|b| **b == FULL).count();
        assert_eq!(probes, 1, "{budgets:?}");
        assert_eq!(budgets.last(), Some(&FULL), "{budgets:?}");
        // The work is short again: the probe answers and the gate opens.
        for _ in 0..SIGNAL_GATE_PROBE_EVERY {
            let b = g.budget(7, FULL);
            g.record(7, b, !b.is_zero());
        }
        for _ in 0..10 {
            assert_eq!(g.budget(7, FULL), FULL);
            g.record(7, FULL, true);
        }
    }

    #[test]
    fn streams_are_gated_apart_and_the_table_stays_bounded() {
        let mut g = SignalGate::default();
        for _ in 0..SIGNAL_GATE_MISSES {
            g.record(1, FULL, false);
        }
        assert_eq!(g.budget(1, FULL), Duration::ZERO);
        assert_eq!(g.budget(2, FULL), FULL);
        for s in 100..100 + 4 * SIGNAL_GATE_STREAMS as u64 {
            g.record(s, FULL, false);
        }
        assert!(g.streams.len() <= SIGNAL_GATE_STREAMS);
        // Stream 1 was forgotten: it queries again.
        assert_eq!(g.budget(1, FULL), FULL);
        // Zero budgets (the query off) are not remembered.
        let mut off = SignalGate::default();
        off.record(3, Duration::ZERO, false);
        assert!(off.streams.is_empty());
        assert_eq!(off.budget(3, Duration::ZERO), Duration::ZERO);
    }
}
