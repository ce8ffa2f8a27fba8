//! [`Graphs`] on the real driver: explicit graph construction, queries and updates. Every
//! node the executor passes was checked against the session (handles resolved, device ranges
//! and data-area spans bounded); host sides of memcpy nodes point into this process's mapping
//! of the session's data area, which stays mapped while the session lives.

use std::ffi::{c_int, c_void};
use std::sync::Arc;

use remora_cuda_abi::graphs::{
    ExecUpdateResultInfo, HostNodeParams, KernelNodeParams, KernelNodeParamsV1, MemAllocNodeParams,
    MemsetNodeParams,
};
use remora_cuda_abi::{MEMORYTYPE_DEVICE, MEMORYTYPE_HOST, Memcpy3D, MemcpySide};
use remora_cuda_abi::{MemAccessDesc, MemLocation};
use remora_proto::cuda::{CuError, CuResult, cu};
use remora_proto::memset_node;

use super::CudaBackend;
use super::driver::{Driver, Ptr, ptr};
use crate::backend::graphs::{
    CopySideOut, Edges, ExecUpdate, GraphCopySide, GraphMem, GraphMemOut, GraphNode, Graphs,
    HostNode, KernelNode, LayoutOf, MemAllocNode, MemcpyNode, MemsetNode, NewNode, NodeInfo,
    NodeParams, NodeUpdate, node_type,
};
use crate::backend::pools::LOCATION_TYPE_DEVICE;

fn size(v: u64) -> CuResult<usize> {
    usize::try_from(v).map_err(|_| CuError(cu::INVALID_VALUE))
}

/// The driver's host-node function: `data` is an `Arc<HostNode>` the session keeps alive for
/// as long as any graph or executable graph of it may run the node.
unsafe extern "C" fn run_host_node(data: *mut c_void) {
    // SAFETY: `data` is `Arc::as_ptr` of a `HostNode` the session holds until after its
    // graphs and executable graphs are destroyed (see `SessionState::host_nodes`).
    let node = unsafe { &*data.cast::<HostNode>() };
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| (node.0)())).is_err() {
        tracing::error!("a graph host node panicked on the driver's thread");
    }
}

/// Scratch storage a kernel node's `kernelParams` point into (the driver copies the values).
struct KernelArgs {
    _aligned: Vec<u64>,
    _args: Vec<Ptr>,
}

fn kernel_params(k: &KernelNode) -> (KernelNodeParams, KernelArgs) {
    let mut aligned = vec![0u64; k.params.len().div_ceil(8)];
    let base = aligned.as_mut_ptr().cast::<u8>();
    // SAFETY: `aligned` holds at least params.len() bytes and does not overlap `params`.
    unsafe { std::ptr::copy_nonoverlapping(k.params.as_ptr(), base, k.params.len()) };
    let mut args: Vec<Ptr> = k
        .layout
        .iter()
        // SAFETY: the executor checked offset + size <= params.len() for every parameter.
        .map(|&(off, _)| unsafe { base.add(off as usize) }.cast::<c_void>())
        .collect();
    let p = KernelNodeParams {
        params: KernelNodeParamsV1 {
            func: ptr(k.function),
            grid_dim: k.grid,
            block_dim: k.block,
            shared_mem_bytes: k.shared_mem_bytes,
            kernel_params: if args.is_empty() {
                std::ptr::null_mut()
            } else {
                args.as_mut_ptr()
            },
            extra: std::ptr::null_mut(),
        },
        kern: std::ptr::null_mut(),
        ctx: std::ptr::null_mut(),
    };
    (
        p,
        KernelArgs {
            _aligned: aligned,
            _args: args,
        },
    )
}

fn memset_params(m: &MemsetNode) -> CuResult<MemsetNodeParams> {
    memset_node::to_abi(&m.wire()).ok_or(CuError(cu::INVALID_VALUE))
}

/// One side of a memcpy node for the driver; `extent` is the span the copy touches.
fn side(s: &GraphCopySide, extent: u64) -> CuResult<MemcpySide> {
    let (memory_type, host, device) = match &s.mem {
        GraphMem::Device(p) => (MEMORYTYPE_DEVICE, std::ptr::null_mut(), *p),
        GraphMem::Area(area, off) => {
            // The executor checked the span the copy touches from `off`.
            let p = area
                .ptr(*off, extent)
                .map_err(|_| CuError(cu::INVALID_VALUE))?;
            (MEMORYTYPE_HOST, p.cast(), 0)
        }
    };
    Ok(MemcpySide {
        memory_type,
        host,
        device,
        context: std::ptr::null_mut(),
        x_in_bytes: size(s.x_bytes)?,
        y: size(s.y)?,
        z: size(s.z)?,
        pitch: size(s.pitch)?,
        height: size(s.height)?,
    })
}

fn memcpy_params(c: &MemcpyNode) -> CuResult<Memcpy3D> {
    let span = |s: &GraphCopySide| {
        c.depth
            .checked_sub(1)
            .zip(c.height.checked_sub(1))
            .map_or(0, |(k, r)| {
                s.row_offset(k, r) - s.row_offset(0, 0) + c.width
            })
    };
    Ok(Memcpy3D::between(
        side(&c.src, span(&c.src))?,
        side(&c.dst, span(&c.dst))?,
        size(c.width)?,
        size(c.height)?,
        size(c.depth)?,
    ))
}

/// Reads a node list of the driver: asks for the count, then the nodes.
fn list(mut get: impl FnMut(*mut Ptr, *mut usize) -> CuResult<()>) -> CuResult<Vec<u64>> {
    let mut n = 0usize;
    get(std::ptr::null_mut(), &mut n)?;
    let mut v: Vec<Ptr> = vec![std::ptr::null_mut(); n];
    if n > 0 {
        get(v.as_mut_ptr(), &mut n)?;
        v.truncate(n);
    }
    Ok(v.into_iter().map(|p| p as usize as u64).collect())
}

/// One side of a memcpy node the driver describes.
fn side_out(s: &MemcpySide) -> CuResult<CopySideOut> {
    let mem = match s.memory_type {
        MEMORYTYPE_DEVICE => GraphMemOut::Device(s.device),
        MEMORYTYPE_HOST => GraphMemOut::Host(s.host as usize as u64),
        // Unified: a device address with unified addressing.
        4 => GraphMemOut::Device(s.device),
        _ => return Err(CuError(cu::NOT_SUPPORTED)),
    };
    Ok(CopySideOut {
        mem,
        pitch: s.pitch as u64,
        height: s.height as u64,
        x_bytes: s.x_in_bytes as u64,
        y: s.y as u64,
        z: s.z as u64,
    })
}

impl CudaBackend {
    fn add_node(&self, d: &Driver, graph: u64, deps: &[u64], params: &NodeParams) -> CuResult<u64> {
        let deps: Vec<Ptr> = deps.iter().map(|&n| ptr(n)).collect();
        let dp = deps.as_ptr();
        let n = deps.len();
        let g = ptr(graph);
        let mut node: Ptr = std::ptr::null_mut();
        // `cuGraphAdd*Node(&node, graph, deps, n, ...)`: the arguments every kind shares, then
        // the kind's own.
        macro_rules! add {
            ($f:ident $(, $arg:expr)*) => {
                // SAFETY (every kind): writes one CUgraphNode; `g` is a graph of this
                // session, `dp` holds `n` of its nodes, and every parameter struct lives across
                // the call (the driver copies it).
                call!(d.t, $f(&mut node, g, dp, n $(, $arg)*))
            };
        }
        match params {
            NodeParams::Kernel(k) => {
                let (p, _args) = kernel_params(k);
                add!(graph_add_kernel_node, &p)?;
            }
            NodeParams::Memset(m) => {
                let p = memset_params(m)?;
                add!(graph_add_memset_node, &p, ptr(m.ctx))?;
            }
            NodeParams::Memcpy(c) => {
                let p = memcpy_params(c)?;
                add!(graph_add_memcpy_node, &p, ptr(c.ctx))?;
            }
            NodeParams::Host(h) => {
                let p = HostNodeParams {
                    func: Some(run_host_node),
                    user_data: Arc::as_ptr(h).cast_mut().cast(),
                };
                add!(graph_add_host_node, &p)?;
            }
            NodeParams::Child(c) => add!(graph_add_child_graph_node, ptr(*c))?,
            NodeParams::Empty => add!(graph_add_empty_node)?,
            NodeParams::EventRecord(e) => add!(graph_add_event_record_node, ptr(*e))?,
            NodeParams::EventWait(e) => add!(graph_add_event_wait_node, ptr(*e))?,
            NodeParams::MemFree(p) => add!(graph_add_mem_free_node, *p)?,
        }
        Ok(node as usize as u64)
    }
}

/// `cuGraph*NodeSetParams` of `node`, or with `exec` `cuGraphExec*NodeSetParams`.
fn set_params(d: &Driver, exec: Option<u64>, node: u64, params: &NodeParams) -> CuResult<()> {
    let nd = ptr(node);
    // The plain call of a node, or the exec form: the memset and memcpy ones also take the
    // node's context.
    macro_rules! set {
        ($plain:ident, $exec:ident, $p:expr $(, $ctx:expr)?) => {{
            let p = $p;
            // SAFETY: `nd` is a node of this session (of the graph `exec` was made from, for
            // the exec forms); the parameter struct lives across the call.
            match exec {
                None => call!(d.t, $plain(nd, &p)),
                Some(e) => call!(d.t, $exec(ptr(e), nd, &p $(, ptr($ctx))?)),
            }
        }};
    }
    match params {
        NodeParams::Kernel(k) => {
            let (p, _args) = kernel_params(k);
            set!(
                graph_kernel_node_set_params,
                graph_exec_kernel_node_set_params,
                p
            )
        }
        NodeParams::Memset(m) => set!(
            graph_memset_node_set_params,
            graph_exec_memset_node_set_params,
            memset_params(m)?,
            m.ctx
        ),
        NodeParams::Memcpy(c) => set!(
            graph_memcpy_node_set_params,
            graph_exec_memcpy_node_set_params,
            memcpy_params(c)?,
            c.ctx
        ),
        _ => Err(CuError(cu::INVALID_VALUE)),
    }
}

/// `location` with the client's device ordinal mapped to the driver's, and back.
fn map_location(
    location: MemLocation,
    map: impl Fn(i32) -> CuResult<i32>,
) -> CuResult<MemLocation> {
    if location.kind == LOCATION_TYPE_DEVICE {
        return Ok(MemLocation {
            kind: location.kind,
            id: map(location.id)?,
        });
    }
    Ok(location)
}

impl Graphs for CudaBackend {
    fn graph_add_mem_alloc_node(&self, new: NewNode<'_, MemAllocNode>) -> CuResult<(u64, u64)> {
        let (graph, m) = (new.graph, new.params);
        let d = self.in_ctx(new.ctx)?;
        let real = |id| d.dev(id);
        let access = m
            .access
            .iter()
            .map(|a| {
                Ok(MemAccessDesc {
                    location: map_location(a.location, real)?,
                    flags: a.flags,
                })
            })
            .collect::<CuResult<Vec<_>>>()?;
        let mut p = MemAllocNodeParams::pinned(
            map_location(m.location, real)?,
            &access,
            size(m.bytesize)?,
            0,
        );
        let deps: Vec<Ptr> = new.deps.iter().map(|&n| ptr(n)).collect();
        let mut node: Ptr = std::ptr::null_mut();
        // SAFETY: writes one CUgraphNode and the params' dptr; `graph` is a graph of this
        // session, `deps` holds its nodes, and `access` lives across the call.
        call!(
            d.t,
            graph_add_mem_alloc_node(&mut node, ptr(graph), deps.as_ptr(), deps.len(), &mut p)
        )?;
        Ok((node as usize as u64, p.dptr))
    }

    fn graph_create(&self, ctx: u64, flags: u32) -> CuResult<u64> {
        let d = self.in_ctx(ctx)?;
        let mut g: Ptr = std::ptr::null_mut();
        // SAFETY: writes one CUgraph.
        call!(d.t, graph_create(&mut g, flags))?;
        Ok(g as usize as u64)
    }

    fn graph_add_node(&self, n: NewNode<'_, NodeParams>) -> CuResult<u64> {
        let d = self.in_ctx(n.ctx)?;
        self.add_node(d, n.graph, n.deps, n.params)
    }

    fn graph_destroy_node(&self, ctx: u64, node: u64) -> CuResult<()> {
        let d = self.in_ctx(ctx)?;
        // SAFETY: a node of this session.
        call!(d.t, graph_destroy_node(ptr(node)))
    }

    fn graph_edges_change(&self, ctx: u64, edges: Edges<'_>, add: bool) -> CuResult<()> {
        let (d, graph) = (self.in_ctx(ctx)?, edges.graph());
        let f: Vec<Ptr> = edges.from().iter().map(|&n| ptr(n)).collect();
        let t: Vec<Ptr> = edges.to().iter().map(|&n| ptr(n)).collect();
        let none = std::ptr::null();
        // SAFETY: `f` and `t` hold `len` nodes of this session each; no edge data.
        if add {
            call!(
                d.t,
                graph_add_dependencies(ptr(graph), f.as_ptr(), t.as_ptr(), none, f.len())
            )
        } else {
            call!(
                d.t,
                graph_remove_dependencies(ptr(graph), f.as_ptr(), t.as_ptr(), none, f.len())
            )
        }
    }

    fn graph_nodes(&self, ctx: u64, graph: u64, roots: bool) -> CuResult<Vec<u64>> {
        let d = self.in_ctx(ctx)?;
        list(|p, n| {
            // SAFETY: `p` is NULL or holds `*n` entries; the driver writes the count.
            if roots {
                call!(d.t, graph_get_root_nodes(ptr(graph), p, n))
            } else {
                call!(d.t, graph_get_nodes(ptr(graph), p, n))
            }
        })
    }

    fn graph_edges(&self, ctx: u64, graph: u64) -> CuResult<(Vec<u64>, Vec<u64>)> {
        let d = self.in_ctx(ctx)?;
        let mut n = 0usize;
        let null: Ptr = std::ptr::null_mut();
        let no_list: *mut Ptr = std::ptr::null_mut();
        // SAFETY: with NULL arrays the driver writes the count only.
        call!(
            d.t,
            graph_get_edges(ptr(graph), no_list, no_list, null, &mut n)
        )?;
        let mut f: Vec<Ptr> = vec![null; n];
        let mut t: Vec<Ptr> = vec![null; n];
        if n > 0 {
            // SAFETY: both arrays hold `n` entries; no edge data.
            call!(
                d.t,
                graph_get_edges(ptr(graph), f.as_mut_ptr(), t.as_mut_ptr(), null, &mut n)
            )?;
            f.truncate(n);
            t.truncate(n);
        }
        let u = |v: Vec<Ptr>| v.into_iter().map(|p| p as usize as u64).collect();
        Ok((u(f), u(t)))
    }

    fn graph_node_type(&self, ctx: u64, node: u64) -> CuResult<i32> {
        let d = self.in_ctx(ctx)?;
        let mut t: c_int = 0;
        // SAFETY: a node of this session; writes one int.
        call!(d.t, graph_node_get_type(ptr(node), &mut t))?;
        Ok(t)
    }

    fn graph_node_links(&self, ctx: u64, node: u64, dependents: bool) -> CuResult<Vec<u64>> {
        let d = self.in_ctx(ctx)?;
        list(|p, n| {
            let none = std::ptr::null_mut();
            // SAFETY: `p` is NULL or holds `*n` entries; no edge data.
            if dependents {
                call!(d.t, graph_node_get_dependent_nodes(ptr(node), p, none, n))
            } else {
                call!(d.t, graph_node_get_dependencies(ptr(node), p, none, n))
            }
        })
    }

    fn graph_node_get_params(&self, n: GraphNode, layout: LayoutOf<'_>) -> CuResult<NodeInfo> {
        let GraphNode { ctx, node } = n;
        let kind = self.graph_node_type(ctx, node)?;
        let d = self.in_ctx(ctx)?;
        match kind {
            node_type::KERNEL => {
                // SAFETY: all-zero is a valid value of this plain C struct.
                let mut v2: KernelNodeParams = unsafe { std::mem::zeroed() };
                // SAFETY: a kernel node of this session; writes the struct.
                call!(d.t, graph_kernel_node_get_params(ptr(node), &mut v2))?;
                let p = v2.params;
                let function = p.func as usize as u64;
                let layout = layout(function).ok_or_else(|| {
                    tracing::warn!("remora: cuGraphKernelNodeGetParams: the node's kernel is not a function of this session; returning CUDA_ERROR_NOT_SUPPORTED");
                    CuError(cu::NOT_SUPPORTED)
                })?;
                let len = layout
                    .iter()
                    .map(|&(o, s)| (o + s) as usize)
                    .max()
                    .unwrap_or(0);
                let mut params = vec![0u8; len];
                if !layout.is_empty() && p.kernel_params.is_null() {
                    return Err(CuError(cu::NOT_SUPPORTED));
                }
                for (i, &(off, sz)) in layout.iter().enumerate() {
                    // SAFETY: the driver's kernelParams holds one pointer per parameter of
                    // the function, each to `sz` bytes (its layout).
                    unsafe {
                        let src = *p.kernel_params.add(i);
                        std::ptr::copy_nonoverlapping(
                            src.cast::<u8>(),
                            params.as_mut_ptr().add(off as usize),
                            sz as usize,
                        );
                    }
                }
                Ok(NodeInfo::Kernel {
                    function,
                    grid: p.grid_dim,
                    block: p.block_dim,
                    shared_mem_bytes: p.shared_mem_bytes,
                    params,
                })
            }
            node_type::MEMSET => {
                // SAFETY: all-zero is a valid value of this plain C struct.
                let mut p: MemsetNodeParams = unsafe { std::mem::zeroed() };
                // SAFETY: a memset node of this session; writes the struct.
                call!(d.t, graph_memset_node_get_params(ptr(node), &mut p))?;
                Ok(NodeInfo::Memset(MemsetNode::new(
                    ctx,
                    &memset_node::from_abi(&p),
                )))
            }
            node_type::MEMCPY => {
                // SAFETY: all-zero is a valid value of this plain C struct.
                let mut p: Memcpy3D = unsafe { std::mem::zeroed() };
                // SAFETY: a memcpy node of this session; writes the struct.
                call!(d.t, graph_memcpy_node_get_params(ptr(node), &mut p))?;
                let (src, dst) = p.sides();
                Ok(NodeInfo::Memcpy {
                    src: side_out(&src)?,
                    dst: side_out(&dst)?,
                    width: p.width_in_bytes as u64,
                    height: p.height as u64,
                    depth: p.depth as u64,
                })
            }
            node_type::MEM_ALLOC => {
                // SAFETY: all-zero is a valid value of this plain C struct.
                let mut p: MemAllocNodeParams = unsafe { std::mem::zeroed() };
                // SAFETY: an allocation node of this session; writes the struct, whose
                // access array the driver owns.
                call!(d.t, graph_mem_alloc_node_get_params(ptr(node), &mut p))?;
                let n = p
                    .access_desc_count
                    .min(remora_proto::remora::RM_MAX_POOL_ACCESS as usize);
                let access = if n == 0 || p.access_descs.is_null() {
                    Vec::new()
                } else {
                    // SAFETY: the driver's array holds access_desc_count entries (read at
                    // most that many), valid while the node is unchanged.
                    unsafe { std::slice::from_raw_parts(p.access_descs, n) }.to_vec()
                };
                let client = |id: i32| {
                    d.devices
                        .iter()
                        .position(|&r| r == id)
                        .and_then(|i| i32::try_from(i).ok())
                        .ok_or(CuError(cu::INVALID_DEVICE))
                };
                Ok(NodeInfo::MemAlloc {
                    node: MemAllocNode {
                        location: map_location(p.pool_props.location, client)?,
                        access: access
                            .into_iter()
                            .map(|a| {
                                Ok(MemAccessDesc {
                                    location: map_location(a.location, client)?,
                                    flags: a.flags,
                                })
                            })
                            .collect::<CuResult<Vec<_>>>()?,
                        bytesize: p.bytesize as u64,
                    },
                    dptr: p.dptr,
                })
            }
            node_type::MEM_FREE => {
                let mut p: u64 = 0;
                // SAFETY: a free node of this session; writes one CUdeviceptr.
                call!(d.t, graph_mem_free_node_get_params(ptr(node), &mut p))?;
                Ok(NodeInfo::MemFree(p))
            }
            _ => Err(CuError(cu::INVALID_VALUE)),
        }
    }

    fn graph_node_set_params(&self, u: NodeUpdate<'_>) -> CuResult<()> {
        set_params(self.in_ctx(u.ctx)?, u.exec, u.node, u.params)
    }

    fn graph_clone(&self, ctx: u64, graph: u64) -> CuResult<u64> {
        let d = self.in_ctx(ctx)?;
        let mut g: Ptr = std::ptr::null_mut();
        // SAFETY: a graph of this session; writes one CUgraph.
        call!(d.t, graph_clone(&mut g, ptr(graph)))?;
        Ok(g as usize as u64)
    }

    fn graph_exec_update(&self, ctx: u64, exec: u64, graph: u64) -> (CuResult<()>, ExecUpdate) {
        let d = match self.in_ctx(ctx) {
            Ok(d) => d,
            Err(e) => return (Err(e), ExecUpdate::default()),
        };
        let mut info = ExecUpdateResultInfo {
            result: 0,
            error_node: std::ptr::null_mut(),
            error_from_node: std::ptr::null_mut(),
        };
        // SAFETY: an executable graph and a graph of this session; writes the result info.
        let r = call!(d.t, graph_exec_update(ptr(exec), ptr(graph), &mut info));
        (
            r,
            ExecUpdate {
                result: info.result,
                error_node: info.error_node as usize as u64,
            },
        )
    }
}
