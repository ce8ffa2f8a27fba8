//! Stream capture and CUDA graphs (protocol revision 5).
//!
//! Capture happens in the server, on the real streams: `cuStreamBeginCapture` and
//! `cuStreamEndCapture` are remoted, the stream work in between is captured by the real
//! driver, and graphs and executable graphs are handles of the session (`Kind::Graph`,
//! `Kind::GraphExec`). `cuGraphLaunch` is one-way like a kernel launch.
//!
//! The capture queries (`cuStreamIsCapturing`, `cuStreamGetCaptureInfo*`) are asked before
//! every GEMM by cuBLASLt, so the client answers "not capturing" itself for a stream that
//! takes part in no capture it began (it sees every begin and end, and every
//! `cuStreamWaitEvent` through which another stream joins); for a stream that may be
//! capturing, the server is asked. The dependency node arrays of `cuStreamGetCaptureInfo_v2/v3`
//! are not remoted (graph nodes have no handles here): asking for them while a capture has
//! dependencies fails loudly with `CUDA_ERROR_NOT_SUPPORTED`.
//!
//! `cuThreadExchangeStreamCaptureMode` is kept per thread in the client: the server captures
//! in relaxed mode (its threads are not the program's), so the calls that CUDA forbids during
//! a global or thread-local capture are not refused here (more permissive than CUDA).
//!
//! Explicit graph construction is `exports/graphs.rs` (revision 11);
//! `cuStreamBeginCaptureToGraph` and `cuStreamUpdateCaptureDependencies` stay generated
//! `CUDA_ERROR_NOT_SUPPORTED` stubs.

use std::cell::Cell;
use std::ffi::{c_char, c_int, c_ulonglong, c_void};
use std::ptr::null_mut as n;

use remora_client::{CuError, CuResult, cu};

use super::Handle;
use super::exec::mapped;
use crate::state::{self, Kind, dec, enc, non_null, put, read_in};

/// `CU_STREAM_CAPTURE_STATUS_ACTIVE`.
const CAPTURE_ACTIVE: c_int = 1;
/// `CU_STREAM_CAPTURE_MODE_GLOBAL`.
const MODE_GLOBAL: c_int = 0;
/// `CUDA_GRAPH_INSTANTIATE_FLAG_UPLOAD`.
const INSTANTIATE_FLAG_UPLOAD: u64 = 2;
/// `CUDA_GRAPH_INSTANTIATE_SUCCESS` / `CUDA_GRAPH_INSTANTIATE_ERROR`.
const INSTANTIATE_SUCCESS: c_int = 0;
const INSTANTIATE_ERROR: c_int = 1;

thread_local! {
    /// This thread's `CUstreamCaptureMode` (`cuThreadExchangeStreamCaptureMode`).
    static CAPTURE_MODE: Cell<c_int> = const { Cell::new(MODE_GLOBAL) };
}

/// Answers a capture query into the outputs that are non-null (`status` is required).
fn capture_info(
    st: Handle,
    ptds: bool,
    status: *mut c_int,
    id: *mut u64,
    graph: *mut Handle,
    deps: *mut *const c_void,
    edges: *mut *const c_void,
    count: *mut usize,
) -> CuResult<()> {
    non_null(status)?;
    let (s, ctx, h) = mapped(st, ptds)?;
    let info = s.stream_capture_info(ctx, h)?;
    let active = info.status == CAPTURE_ACTIVE;
    if active && info.dependencies > 0 && (!deps.is_null() || !edges.is_null()) {
        tracing::error!(
            "remora: cuStreamGetCaptureInfo: the capture's dependency nodes are not remoted \
             (graph nodes have no handles); returning CUDA_ERROR_NOT_SUPPORTED"
        );
        return Err(CuError(cu::NOT_SUPPORTED));
    }
    let g = if active && info.graph != 0 {
        enc(Kind::Graph, info.graph)
    } else {
        std::ptr::null_mut()
    };
    // SAFETY: output pointers per cuda.h: `status` is non-null (checked); the others are
    // optional and written only when non-null.
    unsafe {
        put(status, info.status)?;
        if !id.is_null() {
            id.write_unaligned(info.id);
        }
        if !graph.is_null() {
            graph.write_unaligned(g);
        }
        if !deps.is_null() {
            deps.write_unaligned(std::ptr::null());
        }
        if !edges.is_null() {
            edges.write_unaligned(std::ptr::null());
        }
        if !count.is_null() {
            count.write_unaligned(if active {
                info.dependencies as usize
            } else {
                0
            });
        }
    }
    Ok(())
}

entry_points! {
    cuStreamIsCapturing(st: Handle, status: *mut c_int) => capture_info(st, false, status, n(), n(), n(), n(), n());
    cuStreamIsCapturing_ptsz(st: Handle, status: *mut c_int) => capture_info(st, true, status, n(), n(), n(), n(), n());
    cuStreamGetCaptureInfo(st: Handle, status: *mut c_int, id: *mut u64) => capture_info(st, false, status, id, n(), n(), n(), n());
    cuStreamGetCaptureInfo_ptsz(st: Handle, status: *mut c_int, id: *mut u64) => capture_info(st, true, status, id, n(), n(), n(), n());
    cuStreamGetCaptureInfo_v2(st: Handle, status: *mut c_int, id: *mut u64, graph: *mut Handle, deps: *mut *const c_void, count: *mut usize)
        => capture_info(st, false, status, id, graph, deps, n(), count);
    cuStreamGetCaptureInfo_v2_ptsz(st: Handle, status: *mut c_int, id: *mut u64, graph: *mut Handle, deps: *mut *const c_void, count: *mut usize)
        => capture_info(st, true, status, id, graph, deps, n(), count);
    cuStreamGetCaptureInfo_v3(st: Handle, status: *mut c_int, id: *mut u64, graph: *mut Handle, deps: *mut *const c_void, edges: *mut *const c_void, count: *mut usize)
        => capture_info(st, false, status, id, graph, deps, edges, count);
    cuStreamGetCaptureInfo_v3_ptsz(st: Handle, status: *mut c_int, id: *mut u64, graph: *mut Handle, deps: *mut *const c_void, edges: *mut *const c_void, count: *mut usize)
        => capture_info(st, true, status, id, graph, deps, edges, count);
}

fn begin(st: Handle, mode: c_int, ptds: bool) -> CuResult<()> {
    let (s, ctx, h) = mapped(st, ptds)?;
    s.stream_begin_capture(ctx, h, mode)
}

fn end(st: Handle, graph: *mut Handle, ptds: bool) -> CuResult<()> {
    non_null(graph)?;
    let (s, ctx, h) = mapped(st, ptds)?;
    let g = s.stream_end_capture(ctx, h);
    // SAFETY: `graph` is non-null and writable per cuda.h; NULL on failure, as CUDA does.
    unsafe {
        put(
            graph,
            g.as_ref()
                .map_or(std::ptr::null_mut(), |g| enc(Kind::Graph, *g)),
        )?
    };
    g.map(|_| ())
}

/// Instantiates `graph` in the current context and writes the executable graph.
fn instantiate(exec: *mut Handle, graph: Handle, flags: u64) -> CuResult<u64> {
    non_null(exec)?;
    let s = state::session()?;
    let g = dec(Kind::Graph, graph)?;
    let e = s.graph_instantiate(state::current_ctx()?, g, flags)?;
    // SAFETY: `exec` is non-null and writable per cuda.h.
    unsafe { put(exec, enc(Kind::GraphExec, e))? };
    Ok(e)
}

fn launch(exec: Handle, st: Handle, ptds: bool, upload: bool) -> CuResult<()> {
    let e = dec(Kind::GraphExec, exec)?;
    let (s, ctx, h) = mapped(st, ptds)?;
    if upload {
        s.graph_upload(ctx, e, h)
    } else {
        s.graph_launch(ctx, e, h)
    }
}

/// `CUDA_GRAPH_INSTANTIATE_PARAMS` (cuda.h 13.0).
#[repr(C)]
pub struct InstantiateParams {
    flags: u64,
    upload_stream: Handle,
    err_node_out: Handle,
    result_out: c_int,
}

fn instantiate_with_params(
    exec: *mut Handle,
    graph: Handle,
    params: *mut InstantiateParams,
    ptds: bool,
) -> CuResult<()> {
    non_null(params)?;
    // SAFETY: non-null and valid for reads and writes of the struct per cuda.h.
    let p = unsafe { &mut *params };
    let upload = p.flags & INSTANTIATE_FLAG_UPLOAD != 0;
    let r = instantiate(exec, graph, p.flags & !INSTANTIATE_FLAG_UPLOAD).and_then(|e| {
        if upload {
            launch(enc(Kind::GraphExec, e), p.upload_stream, ptds, true)?;
        }
        Ok(())
    });
    p.err_node_out = std::ptr::null_mut();
    p.result_out = if r.is_ok() {
        INSTANTIATE_SUCCESS
    } else {
        INSTANTIATE_ERROR
    };
    r
}

/// The CUDA 10 form: error node and log buffer (cleared).
fn instantiate_v1(
    exec: *mut Handle,
    graph: Handle,
    err_node: *mut Handle,
    log: *mut c_char,
    log_len: usize,
) -> CuResult<()> {
    // SAFETY: optional outputs per cuda.h, written only when non-null (the log buffer holds
    // `log_len` bytes).
    unsafe {
        if !err_node.is_null() {
            err_node.write_unaligned(std::ptr::null_mut());
        }
        if !log.is_null() && log_len > 0 {
            *log = 0;
        }
    }
    instantiate(exec, graph, 0).map(|_| ())
}

entry_points! {
    cuStreamBeginCapture(st: Handle) => begin(st, MODE_GLOBAL, false);
    cuStreamBeginCapture_ptsz(st: Handle) => begin(st, MODE_GLOBAL, true);
    cuStreamBeginCapture_v2(st: Handle, mode: c_int) => begin(st, mode, false);
    cuStreamBeginCapture_v2_ptsz(st: Handle, mode: c_int) => begin(st, mode, true);
    cuStreamEndCapture(st: Handle, graph: *mut Handle) => end(st, graph, false);
    cuStreamEndCapture_ptsz(st: Handle, graph: *mut Handle) => end(st, graph, true);
    cuGraphInstantiateWithFlags(exec: *mut Handle, graph: Handle, flags: c_ulonglong) => instantiate(exec, graph, flags).map(|_| ());
    cuGraphInstantiate(exec: *mut Handle, graph: Handle, err: *mut Handle, log: *mut c_char, len: usize) => instantiate_v1(exec, graph, err, log, len);
    cuGraphInstantiate_v2(exec: *mut Handle, graph: Handle, err: *mut Handle, log: *mut c_char, len: usize) => instantiate_v1(exec, graph, err, log, len);
    cuGraphInstantiateWithParams(exec: *mut Handle, graph: Handle, p: *mut InstantiateParams) => instantiate_with_params(exec, graph, p, false);
    cuGraphInstantiateWithParams_ptsz(exec: *mut Handle, graph: Handle, p: *mut InstantiateParams) => instantiate_with_params(exec, graph, p, true);
    cuGraphLaunch(exec: Handle, st: Handle) => launch(exec, st, false, false);
    cuGraphLaunch_ptsz(exec: Handle, st: Handle) => launch(exec, st, true, false);
    cuGraphUpload(exec: Handle, st: Handle) => launch(exec, st, false, true);
    cuGraphUpload_ptsz(exec: Handle, st: Handle) => launch(exec, st, true, true);
    cuGraphExecDestroy(exec: Handle) => state::session()?.graph_exec_destroy(dec(Kind::GraphExec, exec)?);
    cuGraphDestroy(graph: Handle) => state::session()?.graph_destroy(dec(Kind::Graph, graph)?);
    cuThreadExchangeStreamCaptureMode(mode: *mut c_int) => exchange_mode(mode);
}

/// `cuThreadExchangeStreamCaptureMode`: swaps this thread's mode with `*mode`.
fn exchange_mode(mode: *mut c_int) -> CuResult<()> {
    let new = read_in(mode)?;
    if !(0..=2).contains(&new) {
        return Err(CuError(cu::INVALID_VALUE));
    }
    let old = CAPTURE_MODE
        .try_with(|m| m.replace(new))
        .map_err(|_| CuError(cu::DEINITIALIZED))?;
    // SAFETY: as above.
    unsafe { mode.write_unaligned(old) };
    Ok(())
}
