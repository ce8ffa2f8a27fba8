//! [`Session`] methods for graphs through stream capture (revision 5).

use super::*;

impl Session {
    /// CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (logged) when `stream` takes part in a capture
    /// this client knows of: copies to or from host memory and host callbacks cannot be put
    /// into a graph that runs in the server. The capture is marked failed: ending it returns
    /// the error (natively an invalid call invalidates the capture).
    pub(super) fn not_captured(&self, stream: RmHandle, what: &str) -> CuResult<()> {
        let mut caps = lock(&self.captures);
        let Some(id) = caps.streams.get(&stream).copied() else {
            return Ok(());
        };
        if let Some(c) = caps.active.get_mut(&id) {
            c.error.get_or_insert(cu::STREAM_CAPTURE_UNSUPPORTED);
        }
        tracing::error!(
            "remora: {what} on a capturing stream cannot be captured (the graph runs in the \
             server, the host memory is here); returning CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
        );
        Err(CuError(cu::STREAM_CAPTURE_UNSUPPORTED))
    }

    /// `cuStreamBeginCapture_v2` with `CUstreamCaptureMode` `mode`. The server captures in
    /// relaxed mode (its threads are not the program's); the mode is kept here for the
    /// thread rule of `cuStreamEndCapture`.
    pub fn stream_begin_capture(&self, ctx: RmHandle, stream: RmHandle, mode: i32) -> CuResult<()> {
        self.need_revision(5, "stream capture")?;
        if !(0..=2).contains(&mode) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let r = call!(self.rm_stream_begin_capture(&RmBeginCaptureArgs { ctx, stream, mode }))?;
        let begun = match r {
            RmCaptureBegunReply::Case0(b) => b,
            RmCaptureBegunReply::Default { discriminant } => {
                return Err(CuError(nonzero(discriminant)));
            }
        };
        let mut caps = lock(&self.captures);
        caps.active.insert(
            begun.id,
            ClientCapture {
                origin: stream,
                mode,
                thread: std::thread::current().id(),
                error: None,
            },
        );
        caps.streams.insert(stream, begun.id);
        Ok(())
    }

    /// `cuStreamEndCapture`: the captured graph's handle.
    pub fn stream_end_capture(&self, ctx: RmHandle, stream: RmHandle) -> CuResult<RmHandle> {
        self.need_revision(5, "stream capture")?;
        let known = {
            let caps = lock(&self.captures);
            let id = caps.streams.get(&stream).copied();
            if let Some(c) = id.and_then(|id| caps.active.get(&id))
                && c.origin == stream
                && c.mode != CAPTURE_MODE_RELAXED
                && c.thread != std::thread::current().id()
            {
                return Err(CuError(cu::STREAM_CAPTURE_WRONG_THREAD));
            }
            id
        };
        let r = call!(self.rm_stream_end_capture(&RmStreamArgs { ctx, stream }))?;
        let ended = known.filter(|_| !r.still_capturing);
        let error = {
            let mut caps = lock(&self.captures);
            let error = known
                .and_then(|id| caps.active.get(&id))
                .and_then(|c| c.error);
            if !r.still_capturing
                && let Some(id) = known
            {
                caps.end(id);
            }
            error
        };
        if let Some(id) = ended {
            let ok = r.status == cu::SUCCESS && error.is_none();
            self.graph_capture_ended(id, if ok { r.graph } else { 0 });
        }
        CuError::check(r.status)?;
        if let Some(e) = error {
            // A call the client refused during the capture: the graph lacks it.
            let _ = self.graph_destroy(r.graph);
            return Err(CuError(e));
        }
        Ok(r.graph)
    }

    /// `cuStreamGetCaptureInfo` / `cuStreamIsCapturing`. Answered locally for a stream that
    /// takes part in no capture (see `Captures`), else by the server.
    pub fn stream_capture_info(&self, ctx: RmHandle, stream: RmHandle) -> CuResult<CaptureInfo> {
        let ask = {
            let caps = lock(&self.captures);
            caps.streams.contains_key(&stream)
                || (stream == u64::from(RM_STREAM_LEGACY) && !caps.active.is_empty())
        };
        if !ask {
            return Ok(CaptureInfo::default());
        }
        let info = call!(self.rm_stream_get_capture_info(&RmStreamArgs { ctx, stream }))?;
        Reply::value(info).map(|i| CaptureInfo {
            status: i.status,
            id: i.id,
            graph: i.graph,
            dependencies: i.dependencies,
        })
    }

    /// Whether `stream` takes part in a capture this client began (no round trip).
    pub fn stream_may_capture(&self, stream: RmHandle) -> bool {
        lock(&self.captures).streams.contains_key(&stream)
    }

    /// `cuGraphInstantiateWithFlags`.
    pub fn graph_instantiate(
        &self,
        ctx: RmHandle,
        graph: RmHandle,
        flags: u64,
    ) -> CuResult<RmHandle> {
        self.need_revision(5, "a CUDA graph")?;
        let h = Reply::value(call!(self.rm_graph_instantiate(&RmGraphInstantiateArgs {
            ctx,
            graph,
            flags
        }))?)?;
        lock(&self.captures).execs.insert(h);
        if let Err(e) = self.graph_exec_from(h, graph) {
            let _ = self.graph_exec_destroy(h);
            return Err(e);
        }
        Ok(h)
    }

    /// `cuGraphLaunch`: one-way. An executable graph this client does not know (destroyed)
    /// is CUDA_ERROR_INVALID_HANDLE at once.
    pub fn graph_launch(&self, ctx: RmHandle, exec: RmHandle, stream: RmHandle) -> CuResult<()> {
        if !lock(&self.captures).execs.contains(&exec) {
            return Err(CuError(cu::INVALID_HANDLE));
        }
        // Pageable host sides: their bytes move around the launch (session/graph_host.rs).
        let outs = self.graph_launch_prologue(ctx, exec, stream)?;
        call!(self.rm_graph_launch(&RmGraphLaunchArgs { ctx, exec, stream }))?;
        self.graph_launch_epilogue(ctx, exec, stream, outs)?;
        self.gate_graph_host_nodes(ctx, exec, stream)
    }

    /// `cuGraphUpload`: one-way.
    pub fn graph_upload(&self, ctx: RmHandle, exec: RmHandle, stream: RmHandle) -> CuResult<()> {
        if !lock(&self.captures).execs.contains(&exec) {
            return Err(CuError(cu::INVALID_HANDLE));
        }
        call!(self.rm_graph_upload(&RmGraphLaunchArgs { ctx, exec, stream }))
    }

    /// `cuGraphExecDestroy`.
    pub fn graph_exec_destroy(&self, exec: RmHandle) -> CuResult<()> {
        self.need_revision(5, "a CUDA graph")?;
        lock(&self.captures).execs.remove(&exec);
        let r = CuError::check(call!(self.rm_graph_exec_destroy(&exec))?);
        self.graph_exec_forget(exec);
        r
    }

    /// `cuGraphDestroy`.
    pub fn graph_destroy(&self, graph: RmHandle) -> CuResult<()> {
        self.need_revision(5, "a CUDA graph")?;
        CuError::check(call!(self.rm_graph_destroy(&graph))?)?;
        self.graph_forget(graph);
        Ok(())
    }

    revision_calls! {
        /// `cuGraphGetNodes` with a NULL array: the number of nodes.
        graph_node_count(graph: RmHandle) -> u64
            = 5, "a CUDA graph": Reply::value, rm_graph_node_count(&graph);
    }
}
