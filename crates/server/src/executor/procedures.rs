//! `impl RemoraV1Server for Executor`: every procedure of `remora.x`. The short ones are
//! answered here; the longer ones call the `Executor` methods of the concern modules.

use super::capture::graph_exec_target;
use super::copies::{memset_target, peer_target};
use super::*;
use remora_proto::cuda::{CuError, cu};

impl RemoraV1Server for Executor {
    // The plain calls, generated from their `@glue` annotations in remora.x.
    remora_proto::executor_glue!();

    fn remora_null(&self, _call: &CallContext) -> ProcResult<()> {
        Ok(())
    }

    fn remora_hello(&self, call: &CallContext, args: HelloArgs) -> ProcResult<HelloReply> {
        tracing::info!(client = %args.client_name, peer = ?call.peer, connection = call.connection, "HELLO");
        let reply = self.inner.hello.answer(&args);
        if let (HelloReply::True(w), Some(out)) = (&reply, self.inner.device_output.get()) {
            out.set_deliver(w.revision >= DELIVERY_REVISION);
        }
        Ok(reply)
    }

    // Devices --------------------------------------------------------------------------------

    fn rm_device_get_count(&self, _call: &CallContext) -> ProcResult<RmIntReply> {
        Ok(int_reply(
            "RM_DEVICE_GET_COUNT",
            self.inner.backend.device_count(),
        ))
    }

    fn rm_device_get_props(&self, call: &CallContext, dev: i32) -> ProcResult<RmDevicePropsReply> {
        self.device_get_props(call, dev)
    }

    fn rm_device_get_attribute(
        &self,
        _call: &CallContext,
        a: RmDeviceAttrArgs,
    ) -> ProcResult<RmIntReply> {
        Ok(int_reply(
            "RM_DEVICE_GET_ATTRIBUTE",
            self.inner.backend.device_attribute(a.attribute, a.device),
        ))
    }

    // Contexts -------------------------------------------------------------------------------

    fn rm_primary_ctx_retain(&self, call: &CallContext, dev: i32) -> ProcResult<RmHandleReply> {
        self.primary_ctx_retain(call, dev)
    }

    fn rm_primary_ctx_release(&self, call: &CallContext, dev: i32) -> ProcResult<CuResult_> {
        let session = self.session(call);
        let mut st = session.lock();
        Ok(code(
            "RM_PRIMARY_CTX_RELEASE",
            self.inner.release_primary(&mut st, dev, false),
        ))
    }

    fn rm_primary_ctx_set_flags(
        &self,
        call: &CallContext,
        a: RmPrimaryFlagsArgs,
    ) -> ProcResult<CuResult_> {
        self.primary_ctx_set_flags(call, a)
    }

    fn rm_primary_ctx_get_state(
        &self,
        call: &CallContext,
        dev: i32,
    ) -> ProcResult<RmPrimaryStateReply> {
        self.primary_ctx_get_state(call, dev)
    }

    fn rm_primary_ctx_reset(&self, call: &CallContext, dev: i32) -> ProcResult<CuResult_> {
        self.primary_ctx_reset(call, dev)
    }

    fn rm_ctx_create(&self, call: &CallContext, a: RmCtxCreateArgs) -> ProcResult<RmHandleReply> {
        self.ctx_create(call, a)
    }

    fn rm_ctx_destroy(&self, call: &CallContext, h: RmHandle) -> ProcResult<CuResult_> {
        self.ctx_destroy(call, h)
    }

    fn rm_ctx_synchronize(&self, call: &CallContext, h: RmHandle) -> ProcResult<RmSyncReply> {
        self.ctx_synchronize(call, h)
    }

    fn rm_ctx_get_stream_priority_range(
        &self,
        call: &CallContext,
        h: RmHandle,
    ) -> ProcResult<RmIntPairReply> {
        let session = self.session(call);
        let raw = session.lock().ctx(h);
        let r = raw.and_then(|c| self.inner.backend.ctx_stream_priority_range(c));
        Ok(int_pair_reply("RM_CTX_GET_STREAM_PRIORITY_RANGE", r))
    }

    fn rm_tools_ctx_query(
        &self,
        call: &CallContext,
        a: RmToolsCtxQueryArgs,
    ) -> ProcResult<RmU64Reply> {
        self.tools_ctx_query(call, a)
    }

    // Memory ---------------------------------------------------------------------------------

    fn rm_mem_alloc(&self, call: &CallContext, a: RmAllocArgs) -> ProcResult<RmU64Reply> {
        self.mem_alloc(call, a)
    }

    fn rm_mem_alloc_pitch(
        &self,
        call: &CallContext,
        a: RmAllocPitchArgs,
    ) -> ProcResult<RmPitchedReply> {
        self.mem_alloc_pitch(call, a)
    }

    fn rm_mem_free(&self, call: &CallContext, a: RmPtrArgs) -> ProcResult<CuResult_> {
        self.mem_free(call, a)
    }

    fn rm_mem_get_info(&self, call: &CallContext, h: RmHandle) -> ProcResult<RmMemInfoReply> {
        self.mem_get_info(call, h)
    }

    fn rm_mem_get_address_range(
        &self,
        call: &CallContext,
        a: RmPtrArgs,
    ) -> ProcResult<RmRangeReply> {
        self.mem_get_address_range(call, a)
    }

    fn rm_memcpy_htod(&self, call: &CallContext, a: RmHtodArgs) -> ProcResult<RmSyncReply> {
        self.memcpy_htod(call, a)
    }

    fn rm_memcpy_dtoh(&self, call: &CallContext, a: RmDtohArgs) -> ProcResult<RmDtohReply> {
        self.memcpy_dtoh(call, a)
    }

    fn rm_memcpy_dtod(&self, call: &CallContext, a: RmDtodArgs) -> ProcResult<RmSyncReply> {
        self.memcpy_dtod(call, a)
    }

    fn rm_memset(&self, call: &CallContext, a: RmMemsetArgs) -> ProcResult<RmSyncReply> {
        self.memset(call, a)
    }

    fn rm_memcpy_htod_async(&self, call: &CallContext, a: RmHtodArgs) -> ProcResult<()> {
        self.memcpy_htod_async(call, a)
    }

    fn rm_memcpy_dtoh_async(&self, call: &CallContext, a: RmDtohArgs) -> ProcResult<()> {
        self.memcpy_dtoh_async(call, a)
    }

    fn rm_memcpy_dtod_async(&self, call: &CallContext, a: RmDtodArgs) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        self.oneway_on(call, "RM_MEMCPY_DTOD_ASYNC", on, |inner, session| {
            let (c, s) = {
                let st = session.lock();
                st.check_range(a.dst, a.size)?;
                st.check_range(a.src, a.size)?;
                (st.ctx(a.ctx)?, st.stream(a.stream)?)
            };
            inner.backend.memcpy_dtod(c, Some(s), a.dst, a.src, a.size)
        })
    }

    fn rm_memset_async(&self, call: &CallContext, a: RmMemsetArgs) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        self.oneway_on(call, "RM_MEMSET_ASYNC", on, |inner, session| {
            let (c, s) = memset_target(&session.lock(), &a)?;
            inner
                .backend
                .memset(c, Some(s), a.dst, a.value, a.element_size, a.count)
        })
    }

    // Modules and functions -----------------------------------------------------------------

    fn rm_module_load(&self, call: &CallContext, a: RmModuleLoadArgs) -> ProcResult<RmLoadReply> {
        self.module_load(call, a)
    }

    fn rm_module_unload(&self, call: &CallContext, h: RmHandle) -> ProcResult<CuResult_> {
        self.module_unload(call, h)
    }

    fn rm_module_get_global(
        &self,
        call: &CallContext,
        a: RmGetGlobalArgs,
    ) -> ProcResult<RmGlobalReply> {
        self.module_get_global(call, a)
    }

    fn rm_func_get_attribute(
        &self,
        call: &CallContext,
        a: RmFuncAttrArgs,
    ) -> ProcResult<RmIntReply> {
        let session = self.session(call);
        let f = session.lock().function(a.function);
        Ok(int_reply(
            "RM_FUNC_GET_ATTRIBUTE",
            f.and_then(|(raw, c, _)| self.inner.backend.func_get_attribute(c, raw, a.attribute)),
        ))
    }

    fn rm_func_set_attribute(
        &self,
        call: &CallContext,
        a: RmFuncAttrArgs,
    ) -> ProcResult<CuResult_> {
        self.func_set_attribute(call, a)
    }

    fn rm_func_set_cache_config(
        &self,
        call: &CallContext,
        a: RmHandleFlags,
    ) -> ProcResult<CuResult_> {
        let session = self.session(call);
        let f = session.lock().function(a.handle);
        Ok(code(
            "RM_FUNC_SET_CACHE_CONFIG",
            f.and_then(|(raw, c, _)| self.inner.backend.func_set_cache_config(c, raw, a.flags)),
        ))
    }

    fn rm_occupancy_max_active_clusters(
        &self,
        call: &CallContext,
        a: RmLaunchArgs,
    ) -> ProcResult<RmIntReply> {
        self.occupancy_max_active_clusters(call, a)
    }

    fn rm_occupancy_max_potential_block_size(
        &self,
        call: &CallContext,
        a: RmPotentialBlockArgs,
    ) -> ProcResult<RmIntPairReply> {
        self.occupancy_max_potential_block_size(call, a)
    }

    fn rm_occupancy_max_active_blocks(
        &self,
        call: &CallContext,
        a: RmOccupancyArgs,
    ) -> ProcResult<RmIntReply> {
        self.occupancy_max_active_blocks(call, a)
    }

    // Launches -------------------------------------------------------------------------------

    fn rm_launch_kernel(&self, call: &CallContext, a: RmLaunchArgs) -> ProcResult<()> {
        self.launch_kernel(call, a)
    }

    // Streams and events ----------------------------------------------------------------------

    fn rm_stream_create(
        &self,
        call: &CallContext,
        a: RmStreamCreateArgs,
    ) -> ProcResult<RmHandleReply> {
        self.stream_create(call, a)
    }

    fn rm_stream_destroy(&self, call: &CallContext, h: RmHandle) -> ProcResult<CuResult_> {
        self.destroy_in_ctx(
            call,
            h,
            "RM_STREAM_DESTROY",
            |r| match r {
                Resource::Stream { raw, ctx } => Ok((*raw, *ctx)),
                _ => Err(CuError(cu::INVALID_HANDLE)),
            },
            |b, c, raw| b.stream_destroy(c, raw),
        )
    }

    fn rm_stream_synchronize(
        &self,
        call: &CallContext,
        a: RmStreamArgs,
    ) -> ProcResult<RmSyncReply> {
        self.stream_synchronize(call, a)
    }

    fn rm_stream_query(&self, call: &CallContext, a: RmStreamArgs) -> ProcResult<RmSyncReply> {
        let session = self.session(call);
        let target = stream_target(&session.lock(), a.ctx, a.stream);
        let own = target.and_then(|t| self.inner.backend.stream_query(t.ctx, t.stream));
        let mut st = session.lock();
        Ok(self
            .inner
            .sync_reply("RM_STREAM_QUERY", &mut st, own, Scope::Finished))
    }

    fn rm_stream_wait_event(&self, call: &CallContext, a: RmStreamWaitArgs) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        self.oneway_on(call, "RM_STREAM_WAIT_EVENT", on, |inner, session| {
            let (t, (e, _)) = {
                let st = session.lock();
                (stream_target(&st, a.ctx, a.stream)?, st.event(a.event)?)
            };
            inner.backend.stream_wait_event(t.ctx, t.stream, e, a.flags)
        })
    }

    fn rm_event_create(&self, call: &CallContext, a: RmHandleFlags) -> ProcResult<RmHandleReply> {
        let session = self.session(call);
        let raw = session.lock().ctx(a.handle);
        let r = raw.and_then(|c| self.inner.backend.event_create(c, a.flags));
        let mut st = session.lock();
        Ok(handle_reply(
            "RM_EVENT_CREATE",
            r.map(|raw| st.insert(Resource::Event { raw, ctx: a.handle })),
        ))
    }

    fn rm_event_destroy(&self, call: &CallContext, h: RmHandle) -> ProcResult<CuResult_> {
        let session = self.session(call);
        let mut st = session.lock();
        let r = st
            .event(h)
            .and_then(|(e, c)| self.inner.backend.event_destroy(c, e));
        if r.is_ok() || st.event(h).is_ok() {
            st.remove(h);
        }
        Ok(code("RM_EVENT_DESTROY", r))
    }

    fn rm_event_record(&self, call: &CallContext, a: RmEventRecordArgs) -> ProcResult<()> {
        self.event_record(call, a)
    }

    fn rm_event_synchronize(&self, call: &CallContext, h: RmHandle) -> ProcResult<RmSyncReply> {
        let session = self.session(call);
        let ev = session.lock().event(h);
        let done =
            ev.is_ok_and(|(e, c)| self.poll_briefly(|| self.inner.backend.event_query(c, e)));
        self.blocking_unless(call, done, move |inner, session| {
            let ev = session.lock().event(h);
            let own = ev.and_then(|(e, c)| inner.backend.event_synchronize(c, e));
            let mut st = session.lock();
            inner.sync_reply("RM_EVENT_SYNCHRONIZE", &mut st, own, Scope::Finished)
        })
    }

    fn rm_event_query(&self, call: &CallContext, h: RmHandle) -> ProcResult<RmSyncReply> {
        let session = self.session(call);
        let ev = session.lock().event(h);
        let own = ev.and_then(|(e, c)| self.inner.backend.event_query(c, e));
        let mut st = session.lock();
        Ok(self
            .inner
            .sync_reply("RM_EVENT_QUERY", &mut st, own, Scope::Finished))
    }

    fn rm_event_elapsed_time(
        &self,
        call: &CallContext,
        a: RmElapsedArgs,
    ) -> ProcResult<RmFloatReply> {
        self.event_elapsed_time(call, a)
    }

    // 2-D, 3-D and peer copies ------------------------------------------------------------

    fn rm_memcpy_3_d(&self, call: &CallContext, a: RmMemcpy3dArgs) -> ProcResult<RmDtohReply> {
        self.copy_3d(call, a, false)
    }

    fn rm_memcpy_3_d_async(&self, call: &CallContext, a: RmMemcpy3dArgs) -> ProcResult<()> {
        self.copy_3d_async(call, a, false)
    }

    fn rm_memcpy_3_d_peer(&self, call: &CallContext, a: RmMemcpy3dArgs) -> ProcResult<RmDtohReply> {
        self.copy_3d(call, a, true)
    }

    fn rm_memcpy_3_d_peer_async(&self, call: &CallContext, a: RmMemcpy3dArgs) -> ProcResult<()> {
        self.copy_3d_async(call, a, true)
    }

    fn rm_memcpy_peer(&self, call: &CallContext, a: RmMemcpyPeerArgs) -> ProcResult<RmSyncReply> {
        self.memcpy_peer(call, a)
    }

    fn rm_memcpy_peer_async(&self, call: &CallContext, a: RmMemcpyPeerArgs) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        self.oneway_on(call, "RM_MEMCPY_PEER_ASYNC", on, |inner, session| {
            let (c, s, dc, sc) = peer_target(&session.lock(), &a)?;
            inner
                .backend
                .memcpy_peer(c, Some(s), a.dst, dc, a.src, sc, a.size)
        })
    }

    // Device-side printf output -------------------------------------------------------------

    fn rm_device_output_take(&self, _call: &CallContext) -> ProcResult<RmBytes> {
        Ok(self.inner.take_device_output().unwrap_or_default())
    }

    // Host callbacks (see crate::host_callbacks) ---------------------------------------------

    /// One-way: enqueues on the stream a host function that reports callback `callback_id`
    /// due when the stream reaches it and blocks the stream until the client reports it done.
    /// From here on the session's calls run on its ordered thread.
    fn rm_launch_host_func(&self, call: &CallContext, a: RmHostFuncArgs) -> ProcResult<()> {
        self.launch_host_func(call, "RM_LAUNCH_HOST_FUNC", a, Vec::new())
    }

    fn rm_launch_host_func_copies(
        &self,
        call: &CallContext,
        a: RmHostFuncCopiesArgs,
    ) -> ProcResult<()> {
        let args = RmHostFuncArgs {
            ctx: a.ctx,
            stream: a.stream,
            callback_id: a.callback_id,
        };
        self.launch_host_func(call, "RM_LAUNCH_HOST_FUNC_COPIES", args, a.copies)
    }

    fn rm_wait_host_callbacks(&self, call: &CallContext) -> ProcResult<RmHostCallbacksReply> {
        self.wait_host_callbacks(call)
    }

    fn rm_host_callback_done(&self, call: &CallContext, id: u64) -> ProcResult<CuResult_> {
        let session = self.session(call);
        Ok(code("RM_HOST_CALLBACK_DONE", session.callbacks.done(id)))
    }

    /// RM_COPIES_READY (revision 8): the copies host functions published, for the client's
    /// callback thread before it runs a callback. Answered on the connection thread with no
    /// driver call and no lock a driver call may hold (see `PendingCopies`).
    fn rm_copies_ready(&self, call: &CallContext) -> ProcResult<RmSyncReply> {
        let session = self.session(call);
        Ok(RmSyncReply {
            status: cu::SUCCESS,
            copies: session.copies.take_ready(),
        })
    }

    fn rm_copies_collect(&self, call: &CallContext, ids: Vec<u64>) -> ProcResult<RmSyncReply> {
        self.copies_collect(call, ids)
    }

    // Graphs through stream capture (revision 5) ---------------------------------------------

    fn rm_stream_begin_capture(
        &self,
        call: &CallContext,
        a: RmBeginCaptureArgs,
    ) -> ProcResult<RmCaptureBegunReply> {
        self.stream_begin_capture(call, a)
    }

    fn rm_stream_end_capture(
        &self,
        call: &CallContext,
        a: RmStreamArgs,
    ) -> ProcResult<RmEndCaptureReply> {
        self.stream_end_capture(call, a)
    }

    fn rm_stream_get_capture_info(
        &self,
        call: &CallContext,
        a: RmStreamArgs,
    ) -> ProcResult<RmCaptureInfoReply> {
        self.stream_get_capture_info(call, a)
    }

    fn rm_graph_instantiate(
        &self,
        call: &CallContext,
        a: RmGraphInstantiateArgs,
    ) -> ProcResult<RmHandleReply> {
        self.graph_instantiate(call, a)
    }

    fn rm_graph_launch(&self, call: &CallContext, a: RmGraphLaunchArgs) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        self.oneway_on(call, "RM_GRAPH_LAUNCH", on, |inner, session| {
            let (exec, t) = graph_exec_target(&session.lock(), &a)?;
            inner.backend.graph_launch(t.ctx, exec, t.stream)
        })
    }

    fn rm_graph_upload(&self, call: &CallContext, a: RmGraphLaunchArgs) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        self.oneway_on(call, "RM_GRAPH_UPLOAD", on, |inner, session| {
            let (exec, t) = graph_exec_target(&session.lock(), &a)?;
            inner.backend.graph_upload(t.ctx, exec, t.stream)
        })
    }

    fn rm_graph_exec_destroy(&self, call: &CallContext, h: RmHandle) -> ProcResult<CuResult_> {
        self.destroy_in_ctx(
            call,
            h,
            "RM_GRAPH_EXEC_DESTROY",
            |r| match r {
                Resource::GraphExec { raw, ctx } => Ok((*raw, *ctx)),
                _ => Err(CuError(cu::INVALID_HANDLE)),
            },
            |b, c, raw| b.graph_exec_destroy(c, raw),
        )
    }

    fn rm_graph_destroy(&self, call: &CallContext, h: RmHandle) -> ProcResult<CuResult_> {
        self.graph_destroy(call, h)
    }

    fn rm_graph_node_count(&self, call: &CallContext, h: RmHandle) -> ProcResult<RmU64Reply> {
        let session = self.session(call);
        let st = session.lock();
        let r = match st.get(h) {
            Ok(Resource::Graph { raw, ctx, .. }) => st
                .ctx(*ctx)
                .and_then(|c| self.inner.backend.graph_node_count(c, *raw)),
            _ => Err(CuError(cu::INVALID_HANDLE)),
        };
        Ok(u64_reply("RM_GRAPH_NODE_COUNT", r))
    }

    fn rm_area_memcpy_htod(
        &self,
        call: &CallContext,
        a: RmAreaCopyArgs,
    ) -> ProcResult<RmSyncReply> {
        self.area_memcpy_htod(call, a)
    }

    fn rm_area_memcpy_dtoh(
        &self,
        call: &CallContext,
        a: RmAreaCopyArgs,
    ) -> ProcResult<RmSyncReply> {
        self.area_memcpy_dtoh(call, a)
    }

    fn rm_area_memcpy_htod_async(&self, call: &CallContext, a: RmAreaCopyArgs) -> ProcResult<()> {
        self.area_memcpy_htod_async(call, a)
    }

    fn rm_area_memcpy_dtoh_async(&self, call: &CallContext, a: RmAreaCopyArgs) -> ProcResult<()> {
        self.area_memcpy_dtoh_async(call, a)
    }
}
