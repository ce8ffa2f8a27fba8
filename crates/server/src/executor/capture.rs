//! Procedures on graphs through stream capture (revision 5).

use super::*;
use remora_proto::cuda::{CuError, CuResult, cu};

impl Executor {
    pub(super) fn stream_begin_capture(
        &self,
        st: &mut SessionState,
        a: RmBeginCaptureArgs,
    ) -> CuResult<RmCaptureBegun> {
        if !(0..=2).contains(&a.mode) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let t = stream_target(st, a.ctx, a.stream)?;
        let info = self.inner.backend.stream_begin_capture(t.ctx, t.stream)?;
        let graph = st.insert(Resource::Graph {
            raw: info.graph,
            ctx: t.ctx_handle,
            capture: Some(t.stream),
        });
        st.captures.insert(info.id, Capture { graph, error: None });
        Ok(RmCaptureBegun { id: info.id, graph })
    }

    pub(super) fn stream_end_capture(
        &self,
        session: &Session,
        a: RmStreamArgs,
    ) -> RmEndCaptureReply {
        let backend = &*self.inner.backend;
        let t = match stream_target(&session.lock(), a.ctx, a.stream) {
            Ok(t) => t,
            Err(e) => {
                return RmEndCaptureReply {
                    status: e.0,
                    graph: 0,
                    still_capturing: false,
                };
            }
        };
        let before = backend.stream_capture_info(t.ctx, t.stream);
        let r = backend.stream_end_capture(t.ctx, t.stream);
        let still_capturing = backend
            .stream_capture_info(t.ctx, t.stream)
            .is_ok_and(|i| i.status != capture_status::NONE);
        let mut st = session.lock();
        let ended = match before {
            Ok(i) if i.status != capture_status::NONE && !still_capturing => {
                st.captures.remove(&i.id)
            }
            _ => None,
        };
        let r = match (r, ended) {
            (Ok(raw), Some(cap)) => {
                if let Ok(Resource::Graph {
                    raw: g, capture, ..
                }) = st.get_mut(cap.graph)
                {
                    *g = raw;
                    *capture = None;
                }
                match cap.error {
                    Some(e) => {
                        // A captured call failed: natively the capture was invalidated.
                        st.remove(cap.graph);
                        let _ = backend.graph_destroy(t.ctx, raw);
                        Err(CuError(e))
                    }
                    None => Ok(cap.graph),
                }
            }
            (Ok(raw), None) => Ok(st.insert(Resource::Graph {
                raw,
                ctx: t.ctx_handle,
                capture: None,
            })),
            (Err(e), Some(cap)) => {
                // The driver freed the graph of the capture it ended with an error.
                st.remove(cap.graph);
                Err(e)
            }
            (Err(e), None) => Err(e),
        };
        let (status, graph) = match r {
            Ok(g) => (cu::SUCCESS, g),
            Err(e) => {
                log_failed("RM_STREAM_END_CAPTURE", nz(e));
                (nz(e), 0)
            }
        };
        RmEndCaptureReply {
            status,
            graph,
            still_capturing,
        }
    }

    pub(super) fn stream_get_capture_info(
        &self,
        session: &Session,
        a: RmStreamArgs,
    ) -> RmCaptureInfoReply {
        let st = session.lock();
        let r = stream_target(&st, a.ctx, a.stream)
            .and_then(|t| self.inner.backend.stream_capture_info(t.ctx, t.stream));
        let r = r.map(|i| RmCaptureInfo {
            status: i.status,
            id: if i.status == capture_status::NONE {
                0
            } else {
                i.id
            },
            graph: capture_graph(&st, &i),
            dependencies: i.dependencies,
        });
        reply!("RM_STREAM_GET_CAPTURE_INFO", RmCaptureInfoReply, r)
    }

    pub(super) fn graph_instantiate(
        &self,
        st: &mut SessionState,
        a: RmGraphInstantiateArgs,
    ) -> CuResult<RmHandle> {
        let (raw, graph_ctx) = match st.get(a.graph)? {
            Resource::Graph {
                raw,
                ctx,
                capture: None,
            } => (*raw, *ctx),
            // Still being captured.
            Resource::Graph { .. } => return Err(CuError(cu::INVALID_VALUE)),
            _ => return Err(CuError(cu::INVALID_HANDLE)),
        };
        let ctx = if a.ctx == 0 { graph_ctx } else { a.ctx };
        let c = st.ctx(ctx)?;
        let exec = self.inner.backend.graph_instantiate(c, raw, a.flags)?;
        let h = st.insert(Resource::GraphExec { raw: exec, ctx });
        st.share_graph_mem(a.graph, h);
        Ok(h)
    }

    pub(super) fn graph_destroy(&self, session: &Session, h: RmHandle) -> CuResult_ {
        let r = self.destroy_in_ctx(
            session,
            h,
            "RM_GRAPH_DESTROY",
            Resource::explicit_graph,
            |b, c, raw| b.graph_destroy(c, raw),
        );
        // Its node handles go with it (revision 11).
        let mut st = session.lock();
        st.forget_nodes_of(h);
        if st.get(h).is_err() {
            st.graph_mem_released_by(h);
        }
        drop(st);
        r
    }
}

/// The backend executable graph and the stream a graph launch or upload names.
pub(super) fn graph_exec_target(
    st: &SessionState,
    a: &RmGraphLaunchArgs,
) -> CuResult<(u64, StreamTarget)> {
    let (exec, exec_ctx) = st.graph_exec(a.exec)?;
    let ctx = if a.ctx == 0 { exec_ctx } else { a.ctx };
    Ok((exec, stream_target(st, ctx, a.stream)?))
}

/// The session handle of the graph a capture is building, if known.
fn capture_graph(st: &SessionState, info: &CaptureInfo) -> u64 {
    if info.status == capture_status::ACTIVE {
        st.captures.get(&info.id).map_or(0, |c| c.graph)
    } else {
        0
    }
}
