//! Explicit CUDA graphs (protocol revision 11): `cuGraphCreate`, `cuGraphAdd*Node` (and the
//! generic `cuGraphAddNode`), dependencies, node queries and parameters, `cuGraphClone`,
//! `cuGraphExec*SetParams`, `cuGraphExecUpdate` and `cuGraphDestroyNode`, each in the ABI
//! forms CUDA 13.0 exports (plain and `_v2`). A `CUgraphNode` is a session handle of the
//! server, encoded as [`Kind::GraphNode`].
//!
//! Kernel nodes pack `kernelParams` as launches do (`extra` is refused loudly). Host nodes
//! run their function in this process at every launch. A memcpy node's host side in
//! page-locked memory of the shared data area is read and written by the server when the
//! graph runs (zero-copy); other host memory gets a device staging buffer whose bytes every
//! launch moves (revision 12, `remora_client`'s `session/graph_host.rs`). Memory allocation
//! and free nodes and the graph memory attributes are carried (revision 12); CUDA arrays,
//! edge data and the other node types are refused with `CUDA_ERROR_NOT_SUPPORTED` and a
//! warning.

use std::collections::HashMap;
use std::ffi::{c_int, c_uint, c_void};
use std::sync::{Arc, Mutex, PoisonError};

use remora_client::proto::{
    RM_MAX_POOL_ACCESS, RmGraphCopySide, RmGraphMemKind, RmKernelNode, RmMemAllocNode,
    RmMemcpyNode, RmNodeParams,
};
use remora_client::proto_memset_node as memset_node;
use remora_client::proto_pool_access as pool_access;
use remora_client::{CuError, CuResult, NodeList, PointerKind, Session, StagedSide, cu};
use remora_cuda_abi::MemAccessDesc;
use remora_cuda_abi::graphs::{
    ExecUpdateResultInfo, GraphNodeParams, HostNodeParams, KernelNodeParams, KernelNodeParamsV1,
    MemAllocNodeParams, MemsetNodeParams,
};
use remora_cuda_abi::pools::{ALLOCATION_TYPE_PINNED, HANDLE_TYPE_NONE};
use remora_cuda_abi::{MEMORYTYPE_ARRAY, MEMORYTYPE_DEVICE, MEMORYTYPE_HOST, Memcpy3D, MemcpySide};

use super::Handle;
use super::exec::function_info;
use crate::state::{self, Kind, dec, enc, non_null, put, read_in};

/// Most nodes one call may pass (a bound on what is read from the program).
const MAX_NODES: usize = 65536;

fn invalid() -> CuError {
    CuError(cu::INVALID_VALUE)
}

fn not_supported(what: &str, why: &str) -> CuError {
    tracing::warn!("remora: {what}: {why}; returning CUDA_ERROR_NOT_SUPPORTED");
    CuError(cu::NOT_SUPPORTED)
}

fn graph(g: Handle) -> CuResult<u64> {
    dec(Kind::Graph, g)
}

fn node(n: Handle) -> CuResult<u64> {
    dec(Kind::GraphNode, n)
}

fn ctx_of(c: Handle) -> CuResult<u64> {
    if c.is_null() {
        Ok(0)
    } else {
        dec(Kind::Ctx, c)
    }
}

/// `n` node handles at `p`.
fn nodes_in(p: *const Handle, n: usize) -> CuResult<Vec<u64>> {
    if n == 0 {
        return Ok(Vec::new());
    }
    if p.is_null() || n > MAX_NODES {
        return Err(invalid());
    }
    // SAFETY: the program passes `n` readable handles at `p` (cuda.h), bounded above.
    let s = unsafe { std::slice::from_raw_parts(p, n) };
    s.iter().map(|h| node(*h)).collect()
}

/// Writes a node list the cuda.h way: with a NULL array only the count; else at most
/// `*count` entries, and the number written (the count if smaller).
fn put_nodes(out: *mut Handle, count: *mut usize, nodes: &[u64]) -> CuResult<()> {
    non_null(count)?;
    if out.is_null() {
        // SAFETY: non-null output per cuda.h.
        return unsafe { put(count, nodes.len()) };
    }
    // SAFETY: non-null, readable and writable per cuda.h.
    let room = unsafe { count.read_unaligned() };
    for (i, n) in nodes.iter().take(room).enumerate() {
        // SAFETY: `out` holds `room` entries per cuda.h.
        unsafe { out.add(i).write_unaligned(enc(Kind::GraphNode, *n)) };
    }
    // SAFETY: as above.
    unsafe { put(count, nodes.len().min(room)) }
}

fn add(
    out: *mut Handle,
    g: Handle,
    deps: *const Handle,
    n: usize,
    ctx: u64,
    params: RmNodeParams,
) -> CuResult<()> {
    non_null(out)?;
    let deps = nodes_in(deps, n)?;
    let h = state::session()?.graph_add_node(graph(g)?, ctx, &deps, params)?;
    // SAFETY: non-null output per cuda.h.
    unsafe { put(out, enc(Kind::GraphNode, h)) }
}

// Kernel nodes ------------------------------------------------------------------------------

fn kernel_params(what: &str, p: KernelNodeParamsV1, kern: Handle) -> CuResult<RmNodeParams> {
    let KernelNodeParamsV1 {
        func,
        grid_dim: grid,
        block_dim: block,
        shared_mem_bytes: shared,
        kernel_params: params,
        extra,
    } = p;
    if !extra.is_null() {
        return Err(not_supported(
            what,
            "kernel node parameters given through `extra` are not carried (use kernelParams)",
        ));
    }
    let f = if func.is_null() { kern } else { func };
    let (s, info) = function_info(f)?;
    // What the program named the kernel by, given back by cuGraphKernelNodeGetParams: the
    // CUDA runtime maps that value back to its host-side entry point (it may be a CUkernel
    // handle given as `func`), so an equivalent but different handle fails there with
    // cudaErrorInvalidDeviceFunction.
    PROGRAM_FUNCS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .get_or_insert_with(HashMap::new)
        .insert(info.handle, (func as usize, kern as usize));
    // SAFETY: kernelParams holds one valid pointer per parameter of the function (cuda.h).
    let k = unsafe { s.kernel_node(&info, grid, block, shared, params.cast_const().cast()) }?;
    Ok(RmNodeParams::RmNodeKernel(k))
}

fn kernel_v2(what: &str, p: *const KernelNodeParams) -> CuResult<RmNodeParams> {
    let p = read_in(p)?;
    kernel_params(what, p.params, p.kern)
}

fn kernel_v1(what: &str, p: *const KernelNodeParamsV1) -> CuResult<RmNodeParams> {
    kernel_params(what, read_in(p)?, std::ptr::null_mut())
}

/// The parameter storage `cuGraphKernelNodeGetParams` hands out, per node (valid until the
/// next get of the same node, as the driver's own is until the node changes).
/// A kernel node's parameter values (8-byte aligned) and the pointers into them.
type KernelArgStore = (Vec<u64>, Vec<usize>);

static KERNEL_ARGS: Mutex<Option<HashMap<u64, KernelArgStore>>> = Mutex::new(None);

/// Function handle → the (`func`, `kern`) values the program last gave a kernel node of it.
static PROGRAM_FUNCS: Mutex<Option<HashMap<u64, (usize, usize)>>> = Mutex::new(None);

/// The (`func`, `kern`) values to give back for a node of function handle `f`.
fn program_func(f: u64) -> (Handle, Handle) {
    let given = PROGRAM_FUNCS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .as_ref()
        .and_then(|m| m.get(&f).copied());
    match given {
        Some((func, kern)) => (func as Handle, kern as Handle),
        None => (enc(Kind::Function, f), std::ptr::null_mut()),
    }
}

/// The `kernelParams` array of packed parameters `k`, kept for node `n`.
fn kernel_args(s: &Session, n: u64, k: &RmKernelNode) -> CuResult<(Handle, *mut *mut c_void)> {
    let info = s.function(k.function).ok_or(CuError(cu::INVALID_HANDLE))?;
    let mut words = vec![0u64; k.params.len().div_ceil(8)];
    let base = words.as_mut_ptr().cast::<u8>();
    // SAFETY: `words` holds at least params.len() bytes and does not overlap them.
    unsafe { std::ptr::copy_nonoverlapping(k.params.as_ptr(), base, k.params.len()) };
    let ptrs: Vec<usize> = info
        .params
        .iter()
        .map(|p| {
            let off = (p.offset as usize).min(k.params.len());
            base as usize + off
        })
        .collect();
    let mut map = KERNEL_ARGS.lock().unwrap_or_else(PoisonError::into_inner);
    let e = map.get_or_insert_with(HashMap::new).entry(n).or_default();
    *e = (words, ptrs);
    let array = if e.1.is_empty() {
        std::ptr::null_mut()
    } else {
        e.1.as_mut_ptr().cast()
    };
    Ok((enc(Kind::Function, k.function), array))
}

fn kernel_get(
    n: Handle,
    out_v2: *mut KernelNodeParams,
    out_v1: *mut KernelNodeParamsV1,
) -> CuResult<()> {
    let s = state::session()?;
    let h = node(n)?;
    let RmNodeParams::RmNodeKernel(k) = s.graph_node_params(h)? else {
        return Err(invalid());
    };
    let (_, args) = kernel_args(s, h, &k)?;
    let (func, kern) = program_func(k.function);
    let params = KernelNodeParamsV1 {
        func,
        grid_dim: [k.grid.x, k.grid.y, k.grid.z],
        block_dim: [k.block.x, k.block.y, k.block.z],
        shared_mem_bytes: k.shared_mem_bytes,
        kernel_params: args,
        extra: std::ptr::null_mut(),
    };
    // SAFETY: the non-null output is writable per cuda.h.
    unsafe {
        if !out_v2.is_null() {
            out_v2.write_unaligned(KernelNodeParams {
                params,
                kern,
                ctx: std::ptr::null_mut(),
            });
        } else if !out_v1.is_null() {
            out_v1.write_unaligned(params);
        } else {
            return Err(invalid());
        }
    }
    Ok(())
}

// Memset and memcpy nodes -------------------------------------------------------------------

fn memset_params(p: *const MemsetNodeParams) -> CuResult<RmNodeParams> {
    let p = read_in(p)?;
    Ok(RmNodeParams::RmNodeMemset(memset_node::from_abi(&p)))
}

fn memset_get(n: Handle, out: *mut MemsetNodeParams) -> CuResult<()> {
    let RmNodeParams::RmNodeMemset(m) = state::session()?.graph_node_params(node(n)?)? else {
        return Err(invalid());
    };
    let p = memset_node::to_abi(&m).ok_or_else(invalid)?;
    // SAFETY: output per cuda.h (null rejected).
    unsafe { put(out, p) }
}

/// One side of a memcpy node from `CUDA_MEMCPY3D`: device memory, pinned memory of the
/// data area (zero-copy), or pageable host memory given a staging buffer (revision 12).
fn copy_side(
    s: &Session,
    what: &str,
    ctx: u64,
    c: &MemcpySide,
    extent: (u64, u64, u64),
    to_device: bool,
) -> CuResult<(RmGraphCopySide, Option<StagedSide>)> {
    let (w, h, d) = extent;
    let device = c.device;
    let (x, y, z) = (c.x_in_bytes as u64, c.y as u64, c.z as u64);
    let (pitch, height) = (c.pitch as u64, c.height as u64);
    let base = match c.memory_type {
        MEMORYTYPE_DEVICE => None,
        MEMORYTYPE_HOST => Some(c.host as usize as u64),
        4 => match s.pointer_kind(device) {
            PointerKind::Device { .. } => None,
            _ => Some(device),
        },
        MEMORYTYPE_ARRAY => return Err(not_supported(what, "CUDA arrays are not supported")),
        _ => return Err(invalid()),
    };
    let side = |kind, addr| RmGraphCopySide {
        kind,
        addr,
        pitch,
        height,
        x_bytes: x,
        y,
        z,
    };
    let Some(base) = base else {
        return Ok((side(RmGraphMemKind::RmGraphMemDevice, device), None));
    };
    // The bytes the copy touches from `base`: up to the end of its last row.
    let end = (z + d - 1)
        .checked_mul(height)
        .and_then(|v| v.checked_add(y + h - 1))
        .and_then(|v| v.checked_mul(pitch))
        .and_then(|v| v.checked_add(x + w))
        .ok_or_else(invalid)?;
    if let Some(offset) = s.pinned_offset(base, end) {
        return Ok((side(RmGraphMemKind::RmGraphMemArea, offset), None));
    }
    let ctx = if ctx == 0 { state::current_ctx()? } else { ctx };
    // SAFETY: cuda.h: a memcpy node's host memory stays valid for every launch of a graph
    // made from the node (the program's contract, as natively).
    let (dev, staged) = unsafe {
        s.graph_stage_host_side(
            ctx,
            side(RmGraphMemKind::RmGraphMemDevice, base),
            extent,
            to_device,
        )
    }?;
    Ok((dev, Some(staged)))
}

/// A memcpy node's parameters, and the staging records of its pageable host sides.
type MemcpyParams = (RmNodeParams, Vec<StagedSide>);

fn memcpy_params(what: &str, p: *const Memcpy3D, ctx: u64) -> CuResult<MemcpyParams> {
    let c = read_in(p)?;
    let s = state::session()?;
    let extent = (c.width_in_bytes as u64, c.height as u64, c.depth as u64);
    if extent.0 == 0 || extent.1 == 0 || extent.2 == 0 {
        return Err(invalid());
    }
    let (src, dst) = c.sides();
    let (src, src_staged) = copy_side(s, what, ctx, &src, extent, true)?;
    let (dst, dst_staged) = copy_side(s, what, ctx, &dst, extent, false)?;
    Ok((
        RmNodeParams::RmNodeMemcpy(RmMemcpyNode {
            src,
            dst,
            width_bytes: extent.0,
            height: extent.1,
            depth: extent.2,
        }),
        src_staged.into_iter().chain(dst_staged).collect(),
    ))
}

/// `cuGraphAddMemcpyNode`: the node, then its pageable host sides bound to it.
fn add_memcpy(
    out: *mut Handle,
    g: Handle,
    deps: *const Handle,
    n: usize,
    ctx: u64,
    (params, staged): MemcpyParams,
) -> CuResult<()> {
    add(out, g, deps, n, ctx, params)?;
    if !staged.is_empty() {
        // SAFETY: `add` wrote the node to the non-null `out`.
        let node = node(unsafe { out.read_unaligned() })?;
        state::session()?.graph_bind_sides(graph(g)?, node, staged);
    }
    Ok(())
}

fn memcpy_get(n: Handle, out: *mut Memcpy3D) -> CuResult<()> {
    let s = state::session()?;
    let RmNodeParams::RmNodeMemcpy(c) = s.graph_node_params(node(n)?)? else {
        return Err(invalid());
    };
    // A staging buffer reads back as the pageable host side it stands for.
    let host_side = |sd: RmGraphCopySide| match sd.kind {
        RmGraphMemKind::RmGraphMemDevice => s.graph_host_side_of(sd.addr).unwrap_or(sd),
        RmGraphMemKind::RmGraphMemArea => sd,
    };
    let (src, dst) = (host_side(c.src.clone()), host_side(c.dst.clone()));
    let side = |sd: &RmGraphCopySide, staged: bool| -> CuResult<MemcpySide> {
        let (memory_type, host, device) = match sd.kind {
            RmGraphMemKind::RmGraphMemDevice if staged => (MEMORYTYPE_HOST, sd.addr, 0),
            RmGraphMemKind::RmGraphMemDevice => (MEMORYTYPE_DEVICE, 0, sd.addr),
            RmGraphMemKind::RmGraphMemArea => (MEMORYTYPE_HOST, s.area_host_ptr(sd.addr)?, 0),
        };
        Ok(MemcpySide {
            memory_type,
            host: host as usize as *mut c_void,
            device,
            context: std::ptr::null_mut(),
            x_in_bytes: sd.x_bytes as usize,
            y: sd.y as usize,
            z: sd.z as usize,
            pitch: sd.pitch as usize,
            height: sd.height as usize,
        })
    };
    let p = Memcpy3D::between(
        side(&src, src != c.src)?,
        side(&dst, dst != c.dst)?,
        c.width_bytes as usize,
        c.height as usize,
        c.depth as usize,
    );
    // SAFETY: output per cuda.h (null rejected).
    unsafe { put(out, p) }
}

// Host, child graph and event nodes ---------------------------------------------------------

/// A program's host function and its argument, called on the host-callback thread.
struct HostFn {
    f: unsafe extern "C" fn(*mut c_void),
    data: usize,
}

fn host_node(
    out: *mut Handle,
    g: Handle,
    deps: *const Handle,
    n: usize,
    p: *const HostNodeParams,
) -> CuResult<()> {
    non_null(out)?;
    let p = read_in(p)?;
    let f = p.func.ok_or_else(invalid)?;
    let hf = HostFn {
        f,
        data: p.user_data as usize,
    };
    let deps = nodes_in(deps, n)?;
    let s = state::session()?;
    let h = s.graph_add_host_node(
        graph(g)?,
        &deps,
        Arc::new(move || {
            // SAFETY: the program's CUhostFn with the userData it gave for this node, called
            // as the driver would, on a thread of this process, at every launch.
            unsafe { (hf.f)(hf.data as *mut c_void) }
        }),
    )?;
    // SAFETY: non-null output per cuda.h.
    unsafe { put(out, enc(Kind::GraphNode, h)) }
}

fn event(e: Handle) -> CuResult<u64> {
    dec(Kind::Event, e)
}

// The generic form ---------------------------------------------------------------------------

fn generic(
    out: *mut Handle,
    g: Handle,
    deps: *const Handle,
    edges: *const c_void,
    n: usize,
    p: *mut GraphNodeParams,
) -> CuResult<()> {
    const WHAT: &str = "cuGraphAddNode";
    if !edges.is_null() {
        return Err(not_supported(WHAT, "edge data is not carried"));
    }
    non_null(p)?;
    // SAFETY: non-null and readable per cuda.h; the union member read is the one `kind`
    // names.
    let (kind, u) = unsafe { ((*p).kind, (*p).u) };
    // SAFETY: each arm reads the union member of the type `kind` names, which the program
    // filled in (cuda.h); the pointers inside are checked by the functions called.
    let (params, ctx) = unsafe {
        match kind {
            0 => (kernel_v2(WHAT, &u.kernel)?, 0),
            1 => {
                let ctx = ctx_of(u.memcpy.copy_ctx)?;
                let p = memcpy_params(WHAT, &u.memcpy.copy, ctx)?;
                return add_memcpy(out, g, deps, n, ctx, p);
            }
            2 => (memset_params(&u.memset.params)?, ctx_of(u.memset.ctx)?),
            3 => return host_node(out, g, deps, n, &u.host),
            4 => (RmNodeParams::RmNodeGraph(graph(u.graph.graph)?), 0),
            5 => (RmNodeParams::RmNodeEmpty, 0),
            6 => (RmNodeParams::RmNodeEventWait(event(u.event.event)?), 0),
            7 => (RmNodeParams::RmNodeEventRecord(event(u.event.event)?), 0),
            10 => return mem_alloc_node(out, g, deps, n, &raw mut (*p).u.alloc),
            11 => (RmNodeParams::RmNodeMemFree(u.free), 0),
            other => {
                return Err(not_supported(
                    WHAT,
                    &format!(
                        "graph node type {other} (external semaphores, batch memory operations, conditional nodes) is not carried"
                    ),
                ));
            }
        }
    };
    add(out, g, deps, n, ctx, params)
}

// Dependencies, queries, clone, update -------------------------------------------------------

fn deps_change(
    g: Handle,
    from: *const Handle,
    to: *const Handle,
    edges: *const c_void,
    n: usize,
    add: bool,
) -> CuResult<()> {
    if !edges.is_null() {
        return Err(not_supported(
            if add {
                "cuGraphAddDependencies_v2"
            } else {
                "cuGraphRemoveDependencies_v2"
            },
            "edge data is not carried",
        ));
    }
    let (f, t) = (nodes_in(from, n)?, nodes_in(to, n)?);
    state::session()?.graph_change_dependencies(graph(g)?, &f, &t, add)
}

fn get_nodes(g: Handle, out: *mut Handle, count: *mut usize, list: NodeList) -> CuResult<()> {
    let nodes = state::session()?.graph_node_list(graph(g)?, list)?;
    put_nodes(out, count, &nodes)
}

fn get_edges(
    g: Handle,
    from: *mut Handle,
    to: *mut Handle,
    edges: *mut c_void,
    count: *mut usize,
) -> CuResult<()> {
    if !edges.is_null() {
        return Err(not_supported(
            "cuGraphGetEdges_v2",
            "edge data is not carried",
        ));
    }
    if count.is_null() || from.is_null() != to.is_null() {
        return Err(invalid());
    }
    let (f, t) = state::session()?.graph_edges(graph(g)?)?;
    if from.is_null() {
        // SAFETY: non-null output per cuda.h.
        return unsafe { put(count, f.len()) };
    }
    let mut c = count_in(count);
    put_nodes(from, &mut c, &f)?;
    put_nodes(to, count, &t)
}

fn count_in(count: *mut usize) -> usize {
    // SAFETY: non-null (checked by the callers) and readable per cuda.h.
    unsafe { count.read_unaligned() }
}

fn links(
    n: Handle,
    out: *mut Handle,
    edges: *mut c_void,
    count: *mut usize,
    list: NodeList,
) -> CuResult<()> {
    if !edges.is_null() {
        return Err(not_supported(
            "cuGraphNodeGetDependencies_v2",
            "edge data is not carried",
        ));
    }
    let nodes = state::session()?.graph_node_list(node(n)?, list)?;
    put_nodes(out, count, &nodes)
}

fn node_type(n: Handle, out: *mut c_int) -> CuResult<()> {
    let t = state::session()?.graph_node_type(node(n)?)?;
    // SAFETY: output per cuda.h (null rejected).
    unsafe { put(out, t) }
}

fn clone(out: *mut Handle, g: Handle) -> CuResult<()> {
    let h = state::session()?.graph_clone(graph(g)?)?;
    // SAFETY: output per cuda.h (null rejected).
    unsafe { put(out, enc(Kind::Graph, h)) }
}

fn set(n: Handle, p: CuResult<RmNodeParams>) -> CuResult<()> {
    state::session()?.graph_node_set_params(node(n)?, p?)
}

fn exec_set(e: Handle, n: Handle, p: CuResult<RmNodeParams>) -> CuResult<()> {
    state::session()?.graph_exec_node_set_params(dec(Kind::GraphExec, e)?, node(n)?, p?)
}

/// `cuGraphMemcpyNodeSetParams`: the node's pageable host sides follow.
fn memcpy_set(n: Handle, p: *const Memcpy3D) -> CuResult<()> {
    let (params, staged) = memcpy_params("cuGraphMemcpyNodeSetParams", p, 0)?;
    state::session()?.graph_memcpy_node_set_params(node(n)?, params, staged)
}

/// `cuGraphExecMemcpyNodeSetParams`: the executable graph's host sides follow.
fn memcpy_exec_set(e: Handle, n: Handle, p: *const Memcpy3D, ctx: Handle) -> CuResult<()> {
    let (params, staged) = memcpy_params("cuGraphExecMemcpyNodeSetParams", p, ctx_of(ctx)?)?;
    let s = state::session()?;
    let (e, h) = (dec(Kind::GraphExec, e)?, node(n)?);
    s.graph_exec_node_set_params(e, h, params)?;
    s.graph_exec_bind_sides(e, h, staged);
    Ok(())
}

// Memory allocation and free nodes (revision 12) ----------------------------------------------

/// `cuGraphAddMemAllocNode`: writes the node and the allocation's address into `p.dptr`.
fn mem_alloc_node(
    out: *mut Handle,
    g: Handle,
    deps: *const Handle,
    n: usize,
    p: *mut MemAllocNodeParams,
) -> CuResult<()> {
    const WHAT: &str = "cuGraphAddMemAllocNode";
    non_null(out)?;
    let a = read_in(p)?;
    let props = a.pool_props;
    if props.alloc_type != ALLOCATION_TYPE_PINNED || a.bytesize == 0 {
        return Err(invalid());
    }
    if props.handle_types != HANDLE_TYPE_NONE {
        return Err(not_supported(
            WHAT,
            "graph allocations exportable as shareable handles cannot leave the server",
        ));
    }
    if a.access_desc_count > RM_MAX_POOL_ACCESS as usize
        || (a.access_desc_count > 0 && a.access_descs.is_null())
    {
        return Err(invalid());
    }
    let access = if a.access_desc_count == 0 {
        &[][..]
    } else {
        // SAFETY: the program passes `accessDescCount` descriptors (cuda.h), bounded above.
        unsafe { std::slice::from_raw_parts(a.access_descs, a.access_desc_count) }
    };
    let wire = RmMemAllocNode {
        location: pool_access::location_from_abi(props.location),
        access: access.iter().map(pool_access::access_from_abi).collect(),
        bytesize: a.bytesize as u64,
        dptr: 0,
    };
    let deps = nodes_in(deps, n)?;
    let s = state::session()?;
    let (h, dptr) = s.graph_add_mem_alloc_node(graph(g)?, state::current_ctx()?, &deps, wire)?;
    // SAFETY: non-null outputs per cuda.h (`dptr` is the struct's out field).
    unsafe {
        (&raw mut (*p).dptr).write_unaligned(dptr);
        put(out, enc(Kind::GraphNode, h))
    }
}

/// The access descriptors `cuGraphMemAllocNodeGetParams` hands out, per node (valid until
/// the next get of the same node or its destruction).
static ALLOC_ACCESS: Mutex<Option<HashMap<u64, Vec<MemAccessDesc>>>> = Mutex::new(None);

fn mem_alloc_get(n: Handle, out: *mut MemAllocNodeParams) -> CuResult<()> {
    let h = node(n)?;
    let RmNodeParams::RmNodeMemAlloc(m) = state::session()?.graph_node_params(h)? else {
        return Err(invalid());
    };
    non_null(out)?;
    let access: Vec<MemAccessDesc> = m.access.iter().map(pool_access::access_to_abi).collect();
    let mut map = ALLOC_ACCESS.lock().unwrap_or_else(PoisonError::into_inner);
    let kept = map.get_or_insert_with(HashMap::new).entry(h).or_default();
    *kept = access;
    let p = MemAllocNodeParams::pinned(
        pool_access::location_to_abi(&m.location),
        kept,
        usize::try_from(m.bytesize).map_err(|_| invalid())?,
        m.dptr,
    );
    // SAFETY: non-null output per cuda.h.
    unsafe { out.write_unaligned(p) };
    Ok(())
}

fn mem_free_get(n: Handle, out: *mut u64) -> CuResult<()> {
    let RmNodeParams::RmNodeMemFree(p) = state::session()?.graph_node_params(node(n)?)? else {
        return Err(invalid());
    };
    // SAFETY: output per cuda.h (null rejected).
    unsafe { put(out, p) }
}

fn graph_mem_device(dev: c_int) -> CuResult<&'static Session> {
    let s = state::session()?;
    if dev < 0 || dev >= s.device_count() {
        return Err(CuError(cu::INVALID_DEVICE));
    }
    Ok(s)
}

fn graph_mem_get(dev: c_int, attr: c_int, value: *mut c_void) -> CuResult<()> {
    let v = graph_mem_device(dev)?.graph_mem_attribute(dev, attr)?;
    // SAFETY: every CUgraphMem_attribute is a cuuint64_t (cuda.h); null rejected.
    unsafe { put(value.cast::<u64>(), v) }
}

fn graph_mem_set(dev: c_int, attr: c_int, value: *mut c_void) -> CuResult<()> {
    // A cuuint64_t per cuda.h.
    let v = read_in(value.cast::<u64>())?;
    graph_mem_device(dev)?.set_graph_mem_attribute(dev, attr, v)
}

/// `cuGraphExecUpdate_v2` (`info`) or the CUDA 11 form (`err_node`, `result`).
fn exec_update(
    e: Handle,
    g: Handle,
    info: *mut ExecUpdateResultInfo,
    err_node: *mut Handle,
    result: *mut c_int,
) -> CuResult<()> {
    let (r, i) = state::session()?.graph_exec_update(dec(Kind::GraphExec, e)?, graph(g)?);
    let node = if i.error_node == 0 {
        std::ptr::null_mut()
    } else {
        enc(Kind::GraphNode, i.error_node)
    };
    // SAFETY: the non-null outputs are writable per cuda.h.
    unsafe {
        if !info.is_null() {
            info.write_unaligned(ExecUpdateResultInfo {
                result: i.result,
                error_node: node,
                error_from_node: std::ptr::null_mut(),
            });
        }
        if !err_node.is_null() {
            err_node.write_unaligned(node);
        }
        if !result.is_null() {
            result.write_unaligned(i.result);
        }
    }
    r
}

fn create(out: *mut Handle, flags: c_uint) -> CuResult<()> {
    let h = state::session()?.graph_create(state::current_ctx()?, flags)?;
    // SAFETY: output per cuda.h (null rejected).
    unsafe { put(out, enc(Kind::Graph, h)) }
}

fn destroy_node(n: Handle) -> CuResult<()> {
    let h = node(n)?;
    state::session()?.graph_destroy_node(h)?;
    if let Some(m) = KERNEL_ARGS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .as_mut()
    {
        m.remove(&h);
    }
    Ok(())
}

type Deps = *const Handle;

entry_points! {
    cuGraphCreate(out: *mut Handle, flags: c_uint) => create(out, flags);
    cuGraphAddEmptyNode(out: *mut Handle, g: Handle, d: Deps, n: usize) => add(out, g, d, n, 0, RmNodeParams::RmNodeEmpty);
    cuGraphAddKernelNode(out: *mut Handle, g: Handle, d: Deps, n: usize, p: *const KernelNodeParamsV1)
        => kernel_v1("cuGraphAddKernelNode", p).and_then(|p| add(out, g, d, n, 0, p));
    cuGraphAddKernelNode_v2(out: *mut Handle, g: Handle, d: Deps, n: usize, p: *const KernelNodeParams)
        => kernel_v2("cuGraphAddKernelNode_v2", p).and_then(|p| add(out, g, d, n, 0, p));
    cuGraphAddMemsetNode(out: *mut Handle, g: Handle, d: Deps, n: usize, p: *const MemsetNodeParams, ctx: Handle)
        => memset_params(p).and_then(|p| add(out, g, d, n, ctx_of(ctx)?, p));
    cuGraphAddMemcpyNode(out: *mut Handle, g: Handle, d: Deps, n: usize, p: *const Memcpy3D, ctx: Handle)
        => memcpy_params("cuGraphAddMemcpyNode", p, ctx_of(ctx)?).and_then(|p| add_memcpy(out, g, d, n, ctx_of(ctx)?, p));
    cuGraphAddMemAllocNode(out: *mut Handle, g: Handle, d: Deps, n: usize, p: *mut MemAllocNodeParams) => mem_alloc_node(out, g, d, n, p);
    cuGraphAddMemFreeNode(out: *mut Handle, g: Handle, d: Deps, n: usize, dptr: u64) => add(out, g, d, n, 0, RmNodeParams::RmNodeMemFree(dptr));
    cuGraphMemAllocNodeGetParams(n: Handle, p: *mut MemAllocNodeParams) => mem_alloc_get(n, p);
    cuGraphMemFreeNodeGetParams(n: Handle, p: *mut u64) => mem_free_get(n, p);
    cuDeviceGraphMemTrim(dev: c_int) => graph_mem_device(dev)?.graph_mem_trim(dev);
    cuDeviceGetGraphMemAttribute(dev: c_int, attr: c_int, value: *mut c_void) => graph_mem_get(dev, attr, value);
    cuDeviceSetGraphMemAttribute(dev: c_int, attr: c_int, value: *mut c_void) => graph_mem_set(dev, attr, value);
    cuGraphAddHostNode(out: *mut Handle, g: Handle, d: Deps, n: usize, p: *const HostNodeParams) => host_node(out, g, d, n, p);
    cuGraphAddChildGraphNode(out: *mut Handle, g: Handle, d: Deps, n: usize, child: Handle)
        => add(out, g, d, n, 0, RmNodeParams::RmNodeGraph(graph(child)?));
    cuGraphAddEventRecordNode(out: *mut Handle, g: Handle, d: Deps, n: usize, e: Handle)
        => add(out, g, d, n, 0, RmNodeParams::RmNodeEventRecord(event(e)?));
    cuGraphAddEventWaitNode(out: *mut Handle, g: Handle, d: Deps, n: usize, e: Handle)
        => add(out, g, d, n, 0, RmNodeParams::RmNodeEventWait(event(e)?));
    cuGraphAddNode(out: *mut Handle, g: Handle, d: Deps, n: usize, p: *mut GraphNodeParams) => generic(out, g, d, std::ptr::null(), n, p);
    cuGraphAddNode_v2(out: *mut Handle, g: Handle, d: Deps, edges: *const c_void, n: usize, p: *mut GraphNodeParams) => generic(out, g, d, edges, n, p);
    cuGraphDestroyNode(n: Handle) => destroy_node(n);
    cuGraphAddDependencies(g: Handle, from: Deps, to: Deps, n: usize) => deps_change(g, from, to, std::ptr::null(), n, true);
    cuGraphAddDependencies_v2(g: Handle, from: Deps, to: Deps, edges: *const c_void, n: usize) => deps_change(g, from, to, edges, n, true);
    cuGraphRemoveDependencies(g: Handle, from: Deps, to: Deps, n: usize) => deps_change(g, from, to, std::ptr::null(), n, false);
    cuGraphRemoveDependencies_v2(g: Handle, from: Deps, to: Deps, edges: *const c_void, n: usize) => deps_change(g, from, to, edges, n, false);
    cuGraphGetNodes(g: Handle, out: *mut Handle, count: *mut usize) => get_nodes(g, out, count, NodeList::Nodes);
    cuGraphGetRootNodes(g: Handle, out: *mut Handle, count: *mut usize) => get_nodes(g, out, count, NodeList::Roots);
    cuGraphGetEdges(g: Handle, from: *mut Handle, to: *mut Handle, count: *mut usize) => get_edges(g, from, to, std::ptr::null_mut(), count);
    cuGraphGetEdges_v2(g: Handle, from: *mut Handle, to: *mut Handle, edges: *mut c_void, count: *mut usize) => get_edges(g, from, to, edges, count);
    cuGraphNodeGetType(n: Handle, out: *mut c_int) => node_type(n, out);
    cuGraphNodeGetDependencies(n: Handle, out: *mut Handle, count: *mut usize) => links(n, out, std::ptr::null_mut(), count, NodeList::Dependencies);
    cuGraphNodeGetDependencies_v2(n: Handle, out: *mut Handle, edges: *mut c_void, count: *mut usize) => links(n, out, edges, count, NodeList::Dependencies);
    cuGraphNodeGetDependentNodes(n: Handle, out: *mut Handle, count: *mut usize) => links(n, out, std::ptr::null_mut(), count, NodeList::Dependents);
    cuGraphNodeGetDependentNodes_v2(n: Handle, out: *mut Handle, edges: *mut c_void, count: *mut usize) => links(n, out, edges, count, NodeList::Dependents);
    cuGraphKernelNodeGetParams(n: Handle, p: *mut KernelNodeParamsV1) => kernel_get(n, std::ptr::null_mut(), p);
    cuGraphKernelNodeGetParams_v2(n: Handle, p: *mut KernelNodeParams) => kernel_get(n, p, std::ptr::null_mut());
    cuGraphKernelNodeSetParams(n: Handle, p: *const KernelNodeParamsV1) => set(n, kernel_v1("cuGraphKernelNodeSetParams", p));
    cuGraphKernelNodeSetParams_v2(n: Handle, p: *const KernelNodeParams) => set(n, kernel_v2("cuGraphKernelNodeSetParams_v2", p));
    cuGraphMemsetNodeGetParams(n: Handle, p: *mut MemsetNodeParams) => memset_get(n, p);
    cuGraphMemsetNodeSetParams(n: Handle, p: *const MemsetNodeParams) => set(n, memset_params(p));
    cuGraphMemcpyNodeGetParams(n: Handle, p: *mut Memcpy3D) => memcpy_get(n, p);
    cuGraphMemcpyNodeSetParams(n: Handle, p: *const Memcpy3D) => memcpy_set(n, p);
    cuGraphClone(out: *mut Handle, g: Handle) => clone(out, g);
    cuGraphExecKernelNodeSetParams(e: Handle, n: Handle, p: *const KernelNodeParamsV1) => exec_set(e, n, kernel_v1("cuGraphExecKernelNodeSetParams", p));
    cuGraphExecKernelNodeSetParams_v2(e: Handle, n: Handle, p: *const KernelNodeParams) => exec_set(e, n, kernel_v2("cuGraphExecKernelNodeSetParams_v2", p));
    cuGraphExecMemsetNodeSetParams(e: Handle, n: Handle, p: *const MemsetNodeParams, _ctx: Handle) => exec_set(e, n, memset_params(p));
    cuGraphExecMemcpyNodeSetParams(e: Handle, n: Handle, p: *const Memcpy3D, ctx: Handle) => memcpy_exec_set(e, n, p, ctx);
    cuGraphExecUpdate(e: Handle, g: Handle, err_node: *mut Handle, result: *mut c_int) => exec_update(e, g, std::ptr::null_mut(), err_node, result);
    cuGraphExecUpdate_v2(e: Handle, g: Handle, info: *mut ExecUpdateResultInfo) => exec_update(e, g, info, std::ptr::null_mut(), std::ptr::null_mut());
}
