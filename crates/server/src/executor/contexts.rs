//! Procedures on devices, contexts and primary contexts (the limit and cache-config calls
//! are generated: `executor_glue!` in `procedures.rs`).

use super::*;
use remora_proto::cuda::{CuError, cu};

impl Executor {
    pub(super) fn device_get_props(
        &self,
        _call: &CallContext,
        dev: i32,
    ) -> ProcResult<RmDevicePropsReply> {
        let r = self.inner.backend.device_props(dev).map(|p| RmDeviceProps {
            name: truncate(p.name, REMORA_MAX_NAME),
            uuid: p.uuid,
            total_memory: p.total_memory,
            pci_bus_id: truncate(p.pci_bus_id, REMORA_MAX_NAME),
            attributes: p
                .attributes
                .into_iter()
                .take(RM_MAX_ATTRIBUTES as usize)
                .map(|(attribute, value)| RmAttribute { attribute, value })
                .collect(),
        });
        Ok(reply!("RM_DEVICE_GET_PROPS", RmDevicePropsReply, r))
    }

    /// What the client calls the device's primary context is a context of this session's own
    /// (cuCtxCreate on the first retain, destroyed when the session's count reaches zero, by
    /// RM_PRIMARY_CTX_RESET or at session end). Sharing the server process's real primary
    /// context let one client's sticky error (an illegal address in a kernel) poison every
    /// later session: CUDA keeps such an error in the context for good.
    pub(super) fn primary_ctx_retain(&self, session: &Session, dev: i32) -> RmHandleReply {
        let mut st = session.lock();
        if let Some((h, refs)) = st.primary.get(&dev).copied() {
            st.primary.insert(dev, (h, refs + 1));
            return RmHandleReply::Case0(h);
        }
        let flags = st.primary_flags.get(&dev).copied().unwrap_or(0);
        handle_reply(
            "RM_PRIMARY_CTX_RETAIN",
            self.inner.backend.ctx_create(flags, dev).map(|raw| {
                let h = st.insert(Resource::Context {
                    raw,
                    device: dev,
                    primary: true,
                });
                st.primary.insert(dev, (h, 1));
                h
            }),
        )
    }

    /// The flags apply when the session's primary context is next created (after a reset, or
    /// on the first retain); a context already active keeps its own.
    pub(super) fn primary_ctx_set_flags(
        &self,
        call: &CallContext,
        a: RmPrimaryFlagsArgs,
    ) -> ProcResult<CuResult_> {
        let r = self.inner.check_device(a.device);
        if r.is_ok() {
            let session = self.session(call);
            session.lock().primary_flags.insert(a.device, a.flags);
        }
        Ok(code("RM_PRIMARY_CTX_SET_FLAGS", r))
    }

    pub(super) fn primary_ctx_get_state(
        &self,
        call: &CallContext,
        dev: i32,
    ) -> ProcResult<RmPrimaryStateReply> {
        let r = self.inner.check_device(dev).map(|()| {
            let session = self.session(call);
            let st = session.lock();
            (
                st.primary_flags.get(&dev).copied().unwrap_or(0),
                i32::from(st.primary.contains_key(&dev)),
            )
        });
        Ok(
            match r.inspect_err(|e| log_failed("RM_PRIMARY_CTX_GET_STATE", e.0)) {
                Ok((flags, active)) => RmPrimaryStateReply::Case0(RmPrimaryState { flags, active }),
                Err(e) => RmPrimaryStateReply::Default {
                    discriminant: nz(e),
                },
            },
        )
    }

    pub(super) fn primary_ctx_reset(&self, session: &Session, dev: i32) -> CuResult_ {
        // The session's primary context is its own: it is destroyed, with everything in it,
        // and the next retain creates a fresh one (a sticky error goes with it).
        let mut st = session.lock();
        if !st.primary.contains_key(&dev) {
            return code("RM_PRIMARY_CTX_RESET", self.inner.check_device(dev));
        }
        code(
            "RM_PRIMARY_CTX_RESET",
            self.inner.release_primary(&mut st, dev, true),
        )
    }

    pub(super) fn ctx_create(&self, session: &Session, a: RmCtxCreateArgs) -> RmHandleReply {
        let r = self.inner.backend.ctx_create(a.flags, a.device);
        let mut st = session.lock();
        handle_reply(
            "RM_CTX_CREATE",
            r.map(|raw| {
                st.insert(Resource::Context {
                    raw,
                    device: a.device,
                    primary: false,
                })
            }),
        )
    }

    pub(super) fn ctx_destroy(&self, session: &Session, h: RmHandle) -> CuResult_ {
        let mut st = session.lock();
        let raw = match st.get(h) {
            Ok(Resource::Context {
                raw,
                primary: false,
                ..
            }) => *raw,
            Ok(Resource::Context { primary: true, .. }) => return cu::INVALID_CONTEXT,
            _ => return cu::INVALID_HANDLE,
        };
        st.drop_ctx_resources(&*self.inner.backend, h);
        st.remove(h);
        st.clear_sticky();
        code("RM_CTX_DESTROY", self.inner.backend.ctx_destroy(raw))
    }

    pub(super) fn ctx_synchronize(
        &self,
        call: &CallContext,
        h: RmHandle,
    ) -> ProcResult<RmSyncReply> {
        self.ctx_synchronize_then(call, h, "RM_CTX_SYNCHRONIZE", |_, _, _| Ok(Vec::new()))
    }

    /// RM_CTX_SYNCHRONIZE_READ: [`Executor::ctx_synchronize`], then each range read back
    /// into the reply's copies (only when the synchronize succeeded).
    pub(super) fn ctx_synchronize_read(
        &self,
        call: &CallContext,
        a: RmCtxSyncReadArgs,
    ) -> ProcResult<RmSyncReply> {
        let total = a
            .ranges
            .iter()
            .try_fold(0u64, |sum, r| sum.checked_add(r.size))
            .filter(|&t| t <= u64::from(RM_MAX_READ_BYTES));
        if total.is_none() || a.ranges.iter().any(|r| r.id == RM_DEVICE_OUTPUT_ID) {
            return Ok(RmSyncReply {
                status: cu::INVALID_VALUE,
                copies: Vec::new(),
            });
        }
        self.ctx_synchronize_then(
            call,
            a.ctx,
            "RM_CTX_SYNCHRONIZE_READ",
            move |inner, session, raw| {
                let st = session.lock();
                a.ranges
                    .iter()
                    .try_for_each(|r| st.check_range(r.ptr, r.size))?;
                drop(st);
                a.ranges
                    .iter()
                    .map(|r| {
                        let mut data = vec![0u8; r.size as usize];
                        inner.backend.memcpy_dtoh(raw, &mut data, r.ptr)?;
                        Ok(RmCopyData {
                            copy_id: r.id,
                            data: data.into(),
                        })
                    })
                    .collect()
            },
        )
    }

    /// Synchronizes context handle `h` (idle once its legacy stream and every stream the
    /// session made in it are), then runs `then(inner, session, raw context)`, whose entries
    /// join the reply's copies when both succeeded; its failure is the call's.
    fn ctx_synchronize_then(
        &self,
        call: &CallContext,
        h: RmHandle,
        what: &'static str,
        then: impl FnOnce(&Inner, &Session, u64) -> CuResult<Vec<RmCopyData>> + Send + 'static,
    ) -> ProcResult<RmSyncReply> {
        self.synchronizing(
            call,
            |st| st.ctx(h).map(|raw| (raw, st.streams_in(h))),
            |b, (raw, streams)| {
                std::iter::once(crate::backend::LEGACY_STREAM)
                    .chain(streams.iter().copied())
                    .try_for_each(|s| b.stream_query(*raw, s))
            },
            move |inner, session| {
                let own = session.lock().ctx(h);
                let read = own
                    .and_then(|raw| inner.backend.ctx_synchronize(raw).map(|()| raw))
                    .and_then(|raw| then(inner, session, raw));
                let (own, read) = match read {
                    Ok(read) => (Ok(()), read),
                    Err(e) => (Err(e), Vec::new()),
                };
                let mut st = session.lock();
                let mut reply = inner.sync_reply(what, &mut st, own, Scope::Context(h));
                if reply.status == 0 {
                    reply.copies.extend(read);
                }
                reply
            },
        )
    }

    pub(super) fn tools_ctx_query(
        &self,
        call: &CallContext,
        a: RmToolsCtxQueryArgs,
    ) -> ProcResult<RmU64Reply> {
        let ctx = |st: &SessionState| Ok((st.ctx(a.ctx)?, 0));
        self.tools_query(call, "RM_TOOLS_CTX_QUERY", ctx, a.mask, a.flag)
    }

    /// RM_TOOLS_STREAM_QUERY: the TOOLS_CONTEXT query about one of the session's streams.
    pub(super) fn tools_stream_query(
        &self,
        call: &CallContext,
        a: RmToolsStreamQueryArgs,
    ) -> ProcResult<RmU64Reply> {
        let stream = |st: &SessionState| {
            let t = stream_target(st, a.ctx, a.stream)?;
            Ok((t.ctx, t.stream))
        };
        self.tools_query(call, "RM_TOOLS_STREAM_QUERY", stream, a.mask, a.flag)
    }

    /// The TOOLS_CONTEXT query `what` (RM_TOOLS_CTX_QUERY or RM_TOOLS_STREAM_QUERY) about the
    /// (raw context, raw stream or 0) that `resolve` finds, unless private driver calls are
    /// refused. The mask and flag are passed on as the library gave them: they may be
    /// register leftovers of a three-argument function (observed values: 0x7ffffffeffff and
    /// 1, then other low bytes in later runs), so no value is refused; they are plain
    /// integers, never dereferenced by Remora.
    fn tools_query(
        &self,
        call: &CallContext,
        what: &str,
        resolve: impl FnOnce(&SessionState) -> CuResult<(u64, u64)>,
        mask: u64,
        flag: u32,
    ) -> ProcResult<RmU64Reply> {
        if let Some(refused) = self.private_calls_refused(what) {
            return Ok(refused);
        }
        let r = self.resolved(&self.session(call), resolve, |b, (c, s)| {
            b.tools_ctx_query(c, s, mask, flag & 0xff)
        });
        Ok(u64_reply(what, r))
    }

    /// The refusal of a private driver query when the server runs with
    /// `--no-private-driver-calls` (logged once), else `None`.
    fn private_calls_refused(&self, what: &str) -> Option<RmU64Reply> {
        if !self
            .inner
            .private_driver_calls
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(|| {
                tracing::warn!(
                    "{what} (a private driver query cuBLAS makes) refused: this server runs with --no-private-driver-calls; the client's library call fails with CUDA_ERROR_NOT_SUPPORTED"
                );
            });
            return Some(u64_reply(what, Err(CuError(cu::NOT_SUPPORTED))));
        }
        None
    }
}
