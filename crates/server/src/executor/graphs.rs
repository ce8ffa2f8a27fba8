//! Procedures of explicit CUDA graphs (revision 11): `cuGraphCreate`, `cuGraphAdd*Node`,
//! node queries and parameters, dependencies, `cuGraphClone`, `cuGraphExec*SetParams` and
//! `cuGraphExecUpdate`. Nodes are session handles ([`Resource::GraphNode`]); every address a
//! node names is checked against the session (device ranges) or its data area before the
//! backend sees it. Graph calls never wait for a stream, so the session lock is held across
//! each (two threads cannot race a node's handle against its graph's destruction).

use super::copies::side_span;
use super::*;
use crate::backend::graphs::{
    CopySideOut, Edges, GraphCopySide, GraphMem, GraphMemOut, GraphNode, HostNode, KernelNode,
    MemAllocNode, MemcpyNode, MemsetNode, NewNode, NodeInfo, NodeParams, NodeUpdate,
};
use crate::session::SessionState;
use remora_proto::cuda::{CuError, cu};
use remora_proto::pool_access;

fn invalid() -> CuError {
    CuError(cu::INVALID_VALUE)
}

/// A node list for a reply: refused loudly past what the protocol carries.
fn node_list(what: &str, n: usize) -> CuResult<()> {
    if n > RM_MAX_GRAPH_NODES as usize {
        tracing::warn!(
            call = what,
            nodes = n,
            "remora: a graph has more nodes or edges than one reply carries ({RM_MAX_GRAPH_NODES}); returning CUDA_ERROR_NOT_SUPPORTED"
        );
        return Err(CuError(cu::NOT_SUPPORTED));
    }
    Ok(())
}

fn list_reply(what: &str, r: CuResult<Vec<u64>>) -> RmNodeListReply {
    reply!(what, RmNodeListReply, r)
}

/// Checks a 2-D memset node against the session's ranges.
fn memset_node(st: &SessionState, ctx: u64, m: &RmMemsetNode) -> CuResult<MemsetNode> {
    if !matches!(m.element_size, 1 | 2 | 4) || m.width == 0 || m.height == 0 {
        return Err(invalid());
    }
    let row = m
        .width
        .checked_mul(u64::from(m.element_size))
        .ok_or_else(invalid)?;
    if m.height > 1 && m.pitch < row {
        return Err(invalid());
    }
    let span = (m.height - 1)
        .checked_mul(m.pitch)
        .and_then(|s| s.checked_add(row))
        .ok_or_else(invalid)?;
    st.check_range(m.dst, span)?;
    Ok(MemsetNode::new(ctx, m))
}

/// Checks one side of a memcpy node: the bytes it touches lie in one range of the session
/// or inside the data area.
fn copy_side(
    st: &SessionState,
    area: Option<&remora_oncrpc::DataArea>,
    s: &RmGraphCopySide,
    c: &RmMemcpyNode,
) -> CuResult<GraphCopySide> {
    // The pitch counts only between rows and the height only between slices: a 1-D copy
    // (cudaGraphAddMemcpyNode1D) leaves both 0.
    if (c.height > 1 || c.depth > 1) && s.pitch < c.width_bytes
        || (c.depth > 1 && s.height < c.height)
    {
        return Err(invalid());
    }
    let (start, len) = side_span(
        s.addr,
        [s.x_bytes, s.y, s.z],
        (s.pitch, s.height),
        (c.width_bytes, c.height, c.depth),
    )?;
    let mem = match s.kind {
        RmGraphMemKind::RmGraphMemDevice => {
            st.check_range(start, len)?;
            GraphMem::Device(s.addr)
        }
        RmGraphMemKind::RmGraphMemArea => {
            let area = area.ok_or_else(|| {
                tracing::warn!(
                    "remora: a graph memcpy node names the data area of a session that has none"
                );
                invalid()
            })?;
            if area.check(start, len).is_err() {
                return Err(invalid());
            }
            GraphMem::Area(area.clone(), s.addr)
        }
    };
    Ok(GraphCopySide {
        mem,
        pitch: s.pitch,
        height: s.height,
        x_bytes: s.x_bytes,
        y: s.y,
        z: s.z,
    })
}

fn memcpy_node(
    st: &SessionState,
    area: Option<&remora_oncrpc::DataArea>,
    ctx: u64,
    c: &RmMemcpyNode,
) -> CuResult<MemcpyNode> {
    if c.width_bytes == 0 || c.height == 0 || c.depth == 0 {
        return Err(invalid());
    }
    Ok(MemcpyNode {
        ctx,
        src: copy_side(st, area, &c.src, c)?,
        dst: copy_side(st, area, &c.dst, c)?,
        width: c.width_bytes,
        height: c.height,
        depth: c.depth,
    })
}

impl Executor {
    /// The backend form of node parameters from the wire, checked against the session.
    /// `ctx` is the backend context memset and memcpy nodes run in.
    fn node_params(
        &self,
        call: &CallContext,
        session: &Session,
        st: &SessionState,
        ctx: u64,
        p: &RmNodeParams,
    ) -> CuResult<NodeParams> {
        Ok(match p {
            RmNodeParams::RmNodeKernel(k) => {
                let FunctionTarget {
                    raw: function,
                    layout,
                    ..
                } = {
                    let t = st.function(k.function)?;
                    t.ensure_loaded(&*self.inner.backend)?;
                    t
                };
                let needed = layout
                    .iter()
                    .map(|&(o, s)| u64::from(o) + u64::from(s))
                    .max()
                    .unwrap_or(0);
                if (k.params.len() as u64) < needed {
                    return Err(invalid());
                }
                NodeParams::Kernel(KernelNode {
                    function,
                    grid: [k.grid.x, k.grid.y, k.grid.z],
                    block: [k.block.x, k.block.y, k.block.z],
                    shared_mem_bytes: k.shared_mem_bytes,
                    params: k.params.to_vec(),
                    layout,
                })
            }
            RmNodeParams::RmNodeMemset(m) => NodeParams::Memset(memset_node(st, ctx, m)?),
            RmNodeParams::RmNodeMemcpy(c) => {
                let area = call.data_area().filter(|a| !a.is_empty()).cloned();
                NodeParams::Memcpy(memcpy_node(st, area.as_ref(), ctx, c)?)
            }
            RmNodeParams::RmNodeHost(id) => {
                // The node runs at every launch: it reports the client's callback due and
                // waits for it, as a host function does (crate::host_callbacks); from now on
                // the session's calls run on its ordered thread.
                session.ordered.start(session.connection)?;
                self.inner
                    .any_ordered
                    .store(true, std::sync::atomic::Ordering::Release);
                let callbacks = Arc::clone(&session.callbacks);
                let sticky = st.sticky_cell();
                let id = *id;
                NodeParams::Host(Arc::new(HostNode(Box::new(move || {
                    let status = sticky.load(std::sync::atomic::Ordering::Acquire);
                    callbacks.reached(id, status);
                }))))
            }
            RmNodeParams::RmNodeGraph(g) => NodeParams::Child(st.explicit_graph(*g)?.0),
            RmNodeParams::RmNodeEmpty => NodeParams::Empty,
            RmNodeParams::RmNodeEventWait(e) => NodeParams::EventWait(st.event(*e)?.0),
            RmNodeParams::RmNodeEventRecord(e) => NodeParams::EventRecord(st.event(*e)?.0),
            RmNodeParams::RmNodeMemFree(p) => {
                // Only a graph allocation of this session (natively: of a graph, any graph).
                if !st.graph_mem.contains_key(p) {
                    return Err(invalid());
                }
                NodeParams::MemFree(*p)
            }
            // Added with RM_GRAPH_ADD_MEM_ALLOC_NODE, which answers the address.
            RmNodeParams::RmNodeMemAlloc(_) => return Err(invalid()),
        })
    }

    /// The backend graph, the backend context and the backend dependencies of a node to add
    /// to graph handle `graph` after node handles `deps`, all of that graph.
    fn node_target(
        st: &SessionState,
        graph: RmHandle,
        deps: &[RmHandle],
    ) -> CuResult<(u64, u64, u64, Vec<u64>)> {
        let (raw, graph_ctx) = st.explicit_graph(graph)?;
        let gctx = st.ctx(graph_ctx)?;
        let deps = deps
            .iter()
            .map(|d| match st.graph_node(*d)? {
                (raw, g) if g == graph => Ok(raw),
                _ => Err(invalid()),
            })
            .collect::<CuResult<Vec<_>>>()?;
        Ok((raw, graph_ctx, gctx, deps))
    }

    pub(super) fn graph_add_mem_alloc_node(
        &self,
        st: &mut SessionState,
        a: RmAddNodeArgs,
    ) -> CuResult<RmMemAllocNodeAdded> {
        let RmNodeParams::RmNodeMemAlloc(m) = &a.params else {
            return Err(invalid());
        };
        let (graph, graph_ctx, gctx, deps) = Self::node_target(st, a.graph, &a.dependencies)?;
        let node = mem_alloc_node(m)?;
        let (raw, dptr) = self.inner.backend.graph_add_mem_alloc_node(NewNode {
            ctx: gctx,
            graph,
            deps: &deps,
            params: &node,
        })?;
        st.add_graph_mem(dptr, node.bytesize, graph_ctx, a.graph);
        let node = st.insert(Resource::GraphNode {
            raw,
            graph: a.graph,
        });
        Ok(RmMemAllocNodeAdded { node, dptr })
    }

    pub(super) fn graph_create(&self, session: &Session, a: RmGraphCreateArgs) -> RmHandleReply {
        let mut st = session.lock();
        let r = st.ctx(a.ctx).and_then(|c| {
            let raw = self.inner.backend.graph_create(c, a.flags)?;
            Ok(st.insert(Resource::Graph {
                raw,
                ctx: a.ctx,
                capture: None,
            }))
        });
        handle_reply("RM_GRAPH_CREATE", r)
    }

    pub(super) fn graph_add_node(
        &self,
        call: &CallContext,
        a: RmAddNodeArgs,
    ) -> ProcResult<RmHandleReply> {
        let session = self.session(call);
        let mut st = session.lock();
        let r = (|| {
            let (graph, graph_ctx, gctx, deps) = Self::node_target(&st, a.graph, &a.dependencies)?;
            let ctx = st.ctx(if a.ctx == 0 { graph_ctx } else { a.ctx })?;
            let params = self.node_params(call, &session, &st, ctx, &a.params)?;
            if let NodeParams::MemFree(p) = params
                && !st.is_graph_mem(p)
            {
                // A free node may name only a graph allocation of this session (made by this
                // graph or another: CUDA allows both).
                return Err(invalid());
            }
            let raw = self.inner.backend.graph_add_node(NewNode {
                ctx: gctx,
                graph,
                deps: &deps,
                params: &params,
            })?;
            match params {
                NodeParams::Host(h) => st.host_nodes.push(h),
                NodeParams::MemFree(p) => st.graph_mem_freed_by_node(p, a.graph),
                NodeParams::Child(_) => {
                    if let RmNodeParams::RmNodeGraph(child) = a.params {
                        st.share_graph_mem(child, a.graph);
                    }
                }
                _ => {}
            }
            Ok(st.insert(Resource::GraphNode {
                raw,
                graph: a.graph,
            }))
        })();
        Ok(handle_reply("RM_GRAPH_ADD_NODE", r))
    }

    /// `run(backend, backend context, backend node, graph handle)` for node handle `h`.
    fn in_node<T>(
        &self,
        st: &SessionState,
        h: RmHandle,
        run: impl FnOnce(&dyn Backend, u64, u64, u64) -> CuResult<T>,
    ) -> CuResult<T> {
        let (node, graph) = st.graph_node(h)?;
        let (_, ctx) = st.explicit_graph(graph)?;
        run(&*self.inner.backend, st.ctx(ctx)?, node, graph)
    }

    pub(super) fn graph_destroy_node(&self, session: &Session, h: RmHandle) -> CuResult_ {
        let mut st = session.lock();
        let r = self.in_node(&st, h, |b, c, n, _| b.graph_destroy_node(c, n));
        if r.is_ok() {
            st.remove(h);
        }
        code("RM_GRAPH_DESTROY_NODE", r)
    }

    /// RM_GRAPH_ADD_DEPENDENCIES (`add`) or RM_GRAPH_REMOVE_DEPENDENCIES.
    pub(super) fn edges_change(
        &self,
        session: &Session,
        a: RmGraphEdgesArgs,
        add: bool,
    ) -> CuResult_ {
        let what = if add {
            "RM_GRAPH_ADD_DEPENDENCIES"
        } else {
            "RM_GRAPH_REMOVE_DEPENDENCIES"
        };
        code(what, self.edges_changed(session, a, add))
    }

    fn edges_changed(&self, session: &Session, a: RmGraphEdgesArgs, add: bool) -> CuResult<()> {
        let st = session.lock();
        let (graph, ctx) = st.explicit_graph(a.graph)?;
        if a.from.len() != a.to.len() {
            return Err(invalid());
        }
        let raw = |h: &u64| -> CuResult<u64> {
            match st.graph_node(*h)? {
                (n, g) if g == a.graph => Ok(n),
                _ => Err(invalid()),
            }
        };
        let from = a.from.iter().map(raw).collect::<CuResult<Vec<_>>>()?;
        let to = a.to.iter().map(raw).collect::<CuResult<Vec<_>>>()?;
        self.inner
            .backend
            .graph_edges_change(st.ctx(ctx)?, Edges::new(graph, &from, &to)?, add)
    }

    /// The handles of backend nodes `raw` of graph handle `graph`.
    fn handles(st: &mut SessionState, raw: Vec<u64>, graph: u64) -> Vec<u64> {
        raw.into_iter().map(|n| st.node_handle(n, graph)).collect()
    }

    /// RM_GRAPH_GET_NODES, or RM_GRAPH_GET_ROOT_NODES (`roots`), named `what`.
    pub(super) fn graph_node_list(
        &self,
        session: &Session,
        h: RmHandle,
        roots: bool,
        what: &str,
    ) -> RmNodeListReply {
        let mut st = session.lock();
        let r = (|| {
            let (graph, ctx) = st.explicit_graph(h)?;
            let raw = self.inner.backend.graph_nodes(st.ctx(ctx)?, graph, roots)?;
            node_list(what, raw.len())?;
            Ok(Self::handles(&mut st, raw, h))
        })();
        list_reply(what, r)
    }

    pub(super) fn graph_get_edges(
        &self,
        st: &mut SessionState,
        h: RmHandle,
    ) -> CuResult<RmGraphEdges> {
        let (graph, ctx) = st.explicit_graph(h)?;
        let (from, to) = self.inner.backend.graph_edges(st.ctx(ctx)?, graph)?;
        node_list("RM_GRAPH_GET_EDGES", from.len())?;
        Ok(RmGraphEdges {
            from: Self::handles(st, from, h),
            to: Self::handles(st, to, h),
        })
    }

    pub(super) fn graph_node_get_type(&self, session: &Session, h: RmHandle) -> RmIntReply {
        let st = session.lock();
        let r = self.in_node(&st, h, |b, c, n, _| b.graph_node_type(c, n));
        int_reply("RM_GRAPH_NODE_GET_TYPE", r)
    }

    /// RM_GRAPH_NODE_GET_DEPENDENCIES, or RM_GRAPH_NODE_GET_DEPENDENT_NODES (`dependents`),
    /// named `what`.
    pub(super) fn node_links(
        &self,
        session: &Session,
        h: RmHandle,
        dependents: bool,
        what: &str,
    ) -> RmNodeListReply {
        let mut st = session.lock();
        let r = self
            .in_node(&st, h, |b, c, n, g| {
                Ok((b.graph_node_links(c, n, dependents)?, g))
            })
            .and_then(|(raw, g)| {
                node_list(what, raw.len())?;
                Ok(Self::handles(&mut st, raw, g))
            });
        list_reply(what, r)
    }

    pub(super) fn graph_node_get_params(
        &self,
        call: &CallContext,
        h: RmHandle,
    ) -> ProcResult<RmNodeParamsReply> {
        let session = self.session(call);
        let st = session.lock();
        let area = call.data_area().cloned();
        let r = self
            .in_node(&st, h, |b, c, n, _| {
                let layout = |raw: u64| {
                    st.table_functions()
                        .find(|(f, _)| *f == raw)
                        .map(|(_, l)| l)
                };
                b.graph_node_get_params(GraphNode { ctx: c, node: n }, &layout)
            })
            .and_then(|info| wire_params(&st, area.as_ref(), info));
        Ok(reply!("RM_GRAPH_NODE_GET_PARAMS", RmNodeParamsReply, r))
    }

    /// `cuGraph*NodeSetParams` of node handle `node`, or with `exec`
    /// `cuGraphExec*NodeSetParams` of that node in executable graph handle `exec`.
    pub(super) fn node_set_params(
        &self,
        call: &CallContext,
        exec: Option<RmHandle>,
        node: RmHandle,
        params: &RmNodeParams,
    ) -> CuResult<()> {
        let session = self.session(call);
        let st = session.lock();
        if !settable(params) {
            return Err(invalid());
        }
        let (exec, ctx, node) = match exec {
            None => {
                let (node, graph) = st.graph_node(node)?;
                (None, st.explicit_graph(graph)?.1, node)
            }
            Some(h) => {
                let (exec, ctx) = st.graph_exec(h)?;
                (Some(exec), ctx, st.graph_node(node)?.0)
            }
        };
        let c = st.ctx(ctx)?;
        let params = self.node_params(call, &session, &st, c, params)?;
        self.inner.backend.graph_node_set_params(NodeUpdate {
            ctx: c,
            exec,
            node,
            params: &params,
        })
    }

    pub(super) fn graph_clone(&self, st: &mut SessionState, h: RmHandle) -> CuResult<RmHandle> {
        let (graph, ctx) = st.explicit_graph(h)?;
        let raw = self.inner.backend.graph_clone(st.ctx(ctx)?, graph)?;
        let clone = st.insert(Resource::Graph {
            raw,
            ctx,
            capture: None,
        });
        st.share_graph_mem(h, clone);
        Ok(clone)
    }

    pub(super) fn graph_exec_update(
        &self,
        session: &Session,
        a: RmExecUpdateArgs,
    ) -> RmExecUpdateReply {
        let mut st = session.lock();
        let r = (|| {
            let (exec, ectx) = st.graph_exec(a.exec)?;
            let (graph, _) = st.explicit_graph(a.graph)?;
            Ok(self
                .inner
                .backend
                .graph_exec_update(st.ctx(ectx)?, exec, graph))
        })();
        let (status, result, error_node) = match r {
            Err(e) => (nz(e), 0, 0),
            Ok((r, info)) => {
                if r.is_ok() {
                    st.share_graph_mem(a.graph, a.exec);
                }
                let node = match info.error_node {
                    0 => 0,
                    raw => st.node_handle(raw, a.graph),
                };
                (r.err().map_or(cu::SUCCESS, nz), info.result, node)
            }
        };
        log_failed("RM_GRAPH_EXEC_UPDATE", status);
        RmExecUpdateReply {
            status,
            result,
            error_node,
        }
    }
}

/// A memory allocation node from the wire: pinned device memory, as natively.
fn mem_alloc_node(m: &RmMemAllocNode) -> CuResult<MemAllocNode> {
    if m.bytesize == 0 || m.dptr != 0 {
        return Err(invalid());
    }
    Ok(MemAllocNode {
        location: pool_access::location_to_abi(&m.location),
        access: m.access.iter().map(pool_access::access_to_abi).collect(),
        bytesize: m.bytesize,
    })
}

/// The node types whose parameters can be set (kernel, memset, memcpy).
fn settable(p: &RmNodeParams) -> bool {
    matches!(
        p,
        RmNodeParams::RmNodeKernel(_)
            | RmNodeParams::RmNodeMemset(_)
            | RmNodeParams::RmNodeMemcpy(_)
    )
}

/// A node's parameters read back, for the wire: functions by their session handle, host
/// sides as offsets into the data area.
fn wire_params(
    st: &SessionState,
    area: Option<&remora_oncrpc::DataArea>,
    info: NodeInfo,
) -> CuResult<RmNodeParams> {
    let dim = |d: [u32; 3]| RmDim3 {
        x: d[0],
        y: d[1],
        z: d[2],
    };
    Ok(match info {
        NodeInfo::MemAlloc { node, dptr } => {
            RmNodeParams::RmNodeMemAlloc(RmMemAllocNode {
                location: pool_access::location_from_abi(node.location),
                access: node
                    .access
                    .iter()
                    .take(RM_MAX_POOL_ACCESS as usize)
                    .map(pool_access::access_from_abi)
                    .collect(),
                bytesize: node.bytesize,
                dptr,
            })
        }
        NodeInfo::MemFree(p) => RmNodeParams::RmNodeMemFree(p),
        NodeInfo::Kernel {
            function,
            grid,
            block,
            shared_mem_bytes,
            params,
        } => RmNodeParams::RmNodeKernel(RmKernelNode {
            function: st.function_handle(function).ok_or_else(|| {
                tracing::warn!("remora: a kernel node's function is not one of the session's; returning CUDA_ERROR_NOT_SUPPORTED");
                CuError(cu::NOT_SUPPORTED)
            })?,
            grid: dim(grid),
            block: dim(block),
            shared_mem_bytes,
            params: params.into(),
        }),
        NodeInfo::Memset(m) => RmNodeParams::RmNodeMemset(m.wire()),
        NodeInfo::Memcpy {
            src,
            dst,
            width,
            height,
            depth,
        } => {
            let side = |s: CopySideOut| -> CuResult<RmGraphCopySide> {
                let (kind, addr) = match s.mem {
                    GraphMemOut::Device(p) => (RmGraphMemKind::RmGraphMemDevice, p),
                    GraphMemOut::Area(o) => (RmGraphMemKind::RmGraphMemArea, o),
                    GraphMemOut::Host(p) => {
                        let o = area.and_then(|a| a.offset_of(p, 1)).ok_or_else(|| {
                            tracing::warn!("remora: a memcpy node's host side is not in the session's data area; returning CUDA_ERROR_NOT_SUPPORTED");
                            CuError(cu::NOT_SUPPORTED)
                        })?;
                        (RmGraphMemKind::RmGraphMemArea, o)
                    }
                };
                Ok(RmGraphCopySide {
                    kind,
                    addr,
                    pitch: s.pitch,
                    height: s.height,
                    x_bytes: s.x_bytes,
                    y: s.y,
                    z: s.z,
                })
            };
            RmNodeParams::RmNodeMemcpy(RmMemcpyNode {
                src: side(src)?,
                dst: side(dst)?,
                width_bytes: width,
                height,
                depth,
            })
        }
    })
}
