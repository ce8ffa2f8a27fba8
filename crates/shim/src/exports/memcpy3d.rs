//! 2-D, 3-D and peer copies: `cuMemcpy2D*`, `cuMemcpy2DUnaligned*`, `cuMemcpy3D*`,
//! `cuMemcpyPeer*`, `cuMemcpy3DPeer*`.
//!
//! The CUDA descriptor is read here and each side classified: host memory (also a
//! `CU_MEMORYTYPE_UNIFIED` pointer outside every device allocation) is read or written by the
//! client, packed, so no host address reaches the server. Host-to-host copies are done here.
//! `CU_MEMORYTYPE_ARRAY` is CUDA_ERROR_NOT_SUPPORTED (CUDA arrays are not remoted yet), logged
//! once per entry point. The plain names (`cuMemcpy2D`, `cuMemcpy3D`, ...) have CUDA's version 1
//! ABI (32-bit fields and device pointers), as in NVIDIA's driver.

use std::ffi::c_uint;
use std::sync::{Arc, Mutex};

use remora_client::copy3d::{self, Extent, Layout};
use remora_client::proto::{RM_STREAM_LEGACY, RmCopyForm};
use remora_client::{
    BandSink, Copy3dParams, CopyDst, CopySrc, CuError, CuResult, PointerKind, StreamRef, cu,
};

use remora_cuda_abi::{
    MEMORYTYPE_ARRAY, MEMORYTYPE_DEVICE, MEMORYTYPE_HOST, MEMORYTYPE_UNIFIED, Memcpy2D, Memcpy2DV1,
    Memcpy3D, Memcpy3DV1,
};

use super::{DevPtr, Handle};
use crate::state::{self, Kind, read_in, stream_ref};

/// One side of a copy as the call describes it.
#[derive(Clone, Copy)]
struct Side {
    memory_type: c_uint,
    host: *mut u8,
    device: DevPtr,
    layout: Layout,
    /// `srcContext` / `dstContext` (peer copies), or `reserved0/1` (must be NULL).
    ctx: Handle,
}

/// Any of the descriptors, widened.
#[derive(Clone, Copy)]
struct Desc {
    form: RmCopyForm,
    src: Side,
    dst: Side,
    extent: Extent,
}

macro_rules! side {
    ($c:expr, $host:ident, $dev:ident, $ty:ident, $x:ident, $y:ident, $pitch:ident) => {
        Side {
            memory_type: $c.$ty,
            host: $c.$host as *mut u8,
            device: u64::from($c.$dev),
            layout: Layout {
                x: $c.$x as u64,
                y: $c.$y as u64,
                z: 0,
                pitch: $c.$pitch as u64,
                height: 0,
            },
            ctx: std::ptr::null_mut(),
        }
    };
}

macro_rules! desc_2d {
    ($c:expr, $form:expr) => {
        Desc {
            form: $form,
            src: side!(
                $c,
                src_host,
                src_device,
                src_memory_type,
                src_x_in_bytes,
                src_y,
                src_pitch
            ),
            dst: side!(
                $c,
                dst_host,
                dst_device,
                dst_memory_type,
                dst_x_in_bytes,
                dst_y,
                dst_pitch
            ),
            extent: Extent {
                width: $c.width_in_bytes as u64,
                height: $c.height as u64,
                depth: 1,
            },
        }
    };
}

macro_rules! desc_3d {
    ($c:expr, $src_ctx:ident, $dst_ctx:ident) => {{
        let mut d = desc_2d!($c, RmCopyForm::RmCopy3D);
        d.src.layout.z = $c.src_z as u64;
        d.src.layout.height = $c.src_height as u64;
        d.src.ctx = $c.$src_ctx;
        d.dst.layout.z = $c.dst_z as u64;
        d.dst.layout.height = $c.dst_height as u64;
        d.dst.ctx = $c.$dst_ctx;
        d.extent.depth = $c.depth as u64;
        d
    }};
}

/// CUDA arrays are not remoted yet: CUDA_ERROR_NOT_SUPPORTED, logged once per entry point.
fn array_not_supported(name: &'static str) -> CuError {
    static LOGGED: Mutex<Vec<&'static str>> = Mutex::new(Vec::new());
    let first = {
        let mut logged = LOGGED.lock().unwrap_or_else(|e| e.into_inner());
        let first = !logged.contains(&name);
        if first {
            logged.push(name);
        }
        first
    };
    if first {
        crate::log::init();
        tracing::warn!(
            "remora: {name}: CUDA arrays (CU_MEMORYTYPE_ARRAY) are not supported by Remora yet; returning CUDA_ERROR_NOT_SUPPORTED"
        );
    }
    CuError(cu::NOT_SUPPORTED)
}

/// Where a side is, once classified.
#[derive(Clone, Copy)]
enum Place {
    Device(DevPtr),
    Host(*mut u8),
}

fn place(s: &remora_client::Session, side: &Side) -> CuResult<Place> {
    match side.memory_type {
        MEMORYTYPE_HOST if !side.host.is_null() => Ok(Place::Host(side.host)),
        MEMORYTYPE_DEVICE => Ok(Place::Device(side.device)),
        MEMORYTYPE_UNIFIED if side.device != 0 => match s.pointer_kind(side.device) {
            PointerKind::Device { .. } => Ok(Place::Device(side.device)),
            PointerKind::Host | PointerKind::HostTracked(_) => {
                Ok(Place::Host(side.device as usize as *mut u8))
            }
        },
        _ => Err(CuError(cu::INVALID_VALUE)),
    }
}

/// The bytes from a host side's base to the end of its region (the layout checked).
fn host_len(layout: &Layout, e: &Extent) -> CuResult<usize> {
    let (_, end) = layout.span(e)?;
    usize::try_from(end)
        .ok()
        .filter(|&n| n <= isize::MAX as usize)
        .ok_or(CuError(cu::INVALID_VALUE))
}

/// A host destination written after the call returns, by whichever thread delivers the data.
struct HostOut(*mut u8);
// SAFETY: the destination stays valid until the copy is delivered, per CUDA's contract for
// asynchronous copies (the program may not touch it before synchronizing); each band writes
// rows of its own, through the raw pointer (no reference to the buffer is formed).
unsafe impl Send for HostOut {}
// SAFETY: as above.
unsafe impl Sync for HostOut {}

impl HostOut {
    /// The address `off` bytes in (a method, so that closures capture the whole `HostOut`).
    fn at(&self, off: u64) -> *mut u8 {
        self.0.wrapping_add(off as usize)
    }
}

fn later(base: *mut u8) -> BandSink {
    let out = HostOut(base);
    Arc::new(move |l: &Layout, e: &Extent, data: &[u8]| {
        let w = e.width as usize;
        if w == 0 {
            return;
        }
        for (off, row) in l.rows(e).zip(data.chunks_exact(w)) {
            // SAFETY: the band lies inside the region whose span was checked when the copy was
            // issued (`host_len`), which cuda.h says is writable; see HostOut.
            unsafe { std::ptr::copy_nonoverlapping(row.as_ptr(), out.at(off), w) };
        }
    })
}

/// Every 2-D and 3-D copy: `stream` is `Some((CUstream, per-thread default))` for the async
/// forms; `ptds` marks the synchronous `_ptds` forms; `peer` the `cuMemcpy3DPeer` forms.
fn copy(
    name: &'static str,
    d: Desc,
    stream: Option<(Handle, bool)>,
    ptds: bool,
    peer: bool,
) -> CuResult<()> {
    if d.src.memory_type == MEMORYTYPE_ARRAY || d.dst.memory_type == MEMORYTYPE_ARRAY {
        return Err(array_not_supported(name));
    }
    let s = state::session()?;
    let (ctx, peer_ctxs) = if peer {
        let src_ctx = state::dec(Kind::Ctx, d.src.ctx)?;
        let dst_ctx = state::dec(Kind::Ctx, d.dst.ctx)?;
        (
            state::current_ctx_opt().unwrap_or(dst_ctx),
            Some((src_ctx, dst_ctx)),
        )
    } else {
        if !d.src.ctx.is_null() || !d.dst.ctx.is_null() {
            return Err(CuError(cu::INVALID_VALUE)); // reserved0 / reserved1
        }
        (state::current_ctx()?, None)
    };
    let (src, dst) = (place(s, &d.src)?, place(s, &d.dst)?);
    let e = d.extent;
    let flat = d.form != RmCopyForm::RmCopy3D;
    if e.bytes().is_none() || (flat && (e.depth != 1 || d.src.layout.z != 0)) {
        return Err(CuError(cu::INVALID_VALUE));
    }
    if e.is_empty() {
        return Ok(());
    }
    let stream_h = match stream {
        Some((st, p)) => s.stream_handle(ctx, stream_ref(st, p)?)?,
        None if ptds => s.stream_handle(ctx, StreamRef::PerThread)?,
        None => u64::from(RM_STREAM_LEGACY),
    };
    let params = Copy3dParams {
        form: d.form,
        ctx,
        stream: stream_h,
        extent: e,
        peer: peer_ctxs,
    };
    let (sl, dl) = (d.src.layout, d.dst.layout);
    let src = match src {
        Place::Device(ptr) => CopySrc::Device { ptr, layout: sl },
        Place::Host(p) => {
            let n = host_len(&sl, &e)?;
            if let Place::Host(q) = dst {
                return host_to_host(p, &sl, q, &dl, &e);
            }
            // SAFETY: cuda.h: the source region is readable; `n` ends at its last byte.
            let base = unsafe { std::slice::from_raw_parts(p.cast_const(), n) };
            CopySrc::Host { base, layout: sl }
        }
    };
    match (dst, stream) {
        (Place::Device(ptr), None) => {
            s.memcpy_3d(&params, src, CopyDst::Device { ptr, layout: dl })
        }
        (Place::Device(ptr), Some(_)) => {
            s.memcpy_3d_async(&params, src, CopyDst::Device { ptr, layout: dl })
        }
        (Place::Host(q), None) => {
            let n = host_len(&dl, &e)?;
            // SAFETY: cuda.h: the destination region is writable; `n` ends at its last byte.
            // The source is device memory here, so no other reference overlaps it.
            let base = unsafe { std::slice::from_raw_parts_mut(q, n) };
            s.memcpy_3d(&params, src, CopyDst::Host { base, layout: dl })
        }
        (Place::Host(q), Some(_)) => {
            host_len(&dl, &e)?;
            let sink = later(q);
            s.memcpy_3d_async(&params, src, CopyDst::Later { layout: dl, sink })
        }
    }
}

/// A copy between two host regions, which may overlap: packed first, then scattered.
fn host_to_host(src: *mut u8, sl: &Layout, dst: *mut u8, dl: &Layout, e: &Extent) -> CuResult<()> {
    let packed = {
        let n = host_len(sl, e)?;
        // SAFETY: cuda.h: the source region is readable; the slice is dropped before the
        // destination is written.
        let base = unsafe { std::slice::from_raw_parts(src.cast_const(), n) };
        copy3d::pack(base, sl, e)?
    };
    let n = host_len(dl, e)?;
    // SAFETY: cuda.h: the destination region is writable; no other reference to it is live.
    let base = unsafe { std::slice::from_raw_parts_mut(dst, n) };
    copy3d::unpack(&packed, base, dl, e)
}

fn copy_2d(
    name: &'static str,
    p: *const Memcpy2D,
    form: RmCopyForm,
    st: Option<(Handle, bool)>,
    ptds: bool,
) -> CuResult<()> {
    let c = read_in(p)?;
    copy(name, desc_2d!(c, form), st, ptds, false)
}

fn copy_2d_v1(
    name: &'static str,
    p: *const Memcpy2DV1,
    form: RmCopyForm,
    st: Option<(Handle, bool)>,
) -> CuResult<()> {
    let c = read_in(p)?;
    copy(name, desc_2d!(c, form), st, false, false)
}

fn copy_3d(
    name: &'static str,
    p: *const Memcpy3D,
    st: Option<(Handle, bool)>,
    ptds: bool,
    peer: bool,
) -> CuResult<()> {
    let c = read_in(p)?;
    copy(name, desc_3d!(c, src_context, dst_context), st, ptds, peer)
}

fn copy_3d_v1(
    name: &'static str,
    p: *const Memcpy3DV1,
    st: Option<(Handle, bool)>,
) -> CuResult<()> {
    let c = read_in(p)?;
    copy(name, desc_3d!(c, reserved0, reserved1), st, false, false)
}

/// `cuMemcpyPeer(Async)`: `ctx` for the legacy stream is the current context, else the
/// destination's.
fn peer(
    dst: DevPtr,
    dst_ctx: Handle,
    src: DevPtr,
    src_ctx: Handle,
    n: usize,
    stream: Option<(Handle, bool)>,
) -> CuResult<()> {
    let s = state::session()?;
    let dc = state::dec(Kind::Ctx, dst_ctx)?;
    let sc = state::dec(Kind::Ctx, src_ctx)?;
    if n == 0 {
        return Ok(());
    }
    let ctx = state::current_ctx_opt().unwrap_or(dc);
    match state::async_stream(s, ctx, stream)? {
        Some(h) => s.memcpy_peer_async(ctx, h, (dst, dc), (src, sc), n as u64),
        None => s.memcpy_peer(ctx, (dst, dc), (src, sc), n as u64),
    }
}

use RmCopyForm::{RmCopy2D as D2, RmCopy2DUnaligned as U2};

entry_points! {
    cuMemcpy2D(p: *const Memcpy2DV1) => copy_2d_v1("cuMemcpy2D", p, D2, None);
    cuMemcpy2D_v2(p: *const Memcpy2D) => copy_2d("cuMemcpy2D_v2", p, D2, None, false);
    cuMemcpy2D_v2_ptds(p: *const Memcpy2D) => copy_2d("cuMemcpy2D_v2_ptds", p, D2, None, true);
    cuMemcpy2DUnaligned(p: *const Memcpy2DV1) => copy_2d_v1("cuMemcpy2DUnaligned", p, U2, None);
    cuMemcpy2DUnaligned_v2(p: *const Memcpy2D) => copy_2d("cuMemcpy2DUnaligned_v2", p, U2, None, false);
    cuMemcpy2DUnaligned_v2_ptds(p: *const Memcpy2D) => copy_2d("cuMemcpy2DUnaligned_v2_ptds", p, U2, None, true);
    cuMemcpy2DAsync(p: *const Memcpy2DV1, st: Handle) => copy_2d_v1("cuMemcpy2DAsync", p, D2, Some((st, false)));
    cuMemcpy2DAsync_v2(p: *const Memcpy2D, st: Handle) => copy_2d("cuMemcpy2DAsync_v2", p, D2, Some((st, false)), false);
    cuMemcpy2DAsync_v2_ptsz(p: *const Memcpy2D, st: Handle) => copy_2d("cuMemcpy2DAsync_v2_ptsz", p, D2, Some((st, true)), false);
    cuMemcpy3D(p: *const Memcpy3DV1) => copy_3d_v1("cuMemcpy3D", p, None);
    cuMemcpy3D_v2(p: *const Memcpy3D) => copy_3d("cuMemcpy3D_v2", p, None, false, false);
    cuMemcpy3D_v2_ptds(p: *const Memcpy3D) => copy_3d("cuMemcpy3D_v2_ptds", p, None, true, false);
    cuMemcpy3DAsync(p: *const Memcpy3DV1, st: Handle) => copy_3d_v1("cuMemcpy3DAsync", p, Some((st, false)));
    cuMemcpy3DAsync_v2(p: *const Memcpy3D, st: Handle) => copy_3d("cuMemcpy3DAsync_v2", p, Some((st, false)), false, false);
    cuMemcpy3DAsync_v2_ptsz(p: *const Memcpy3D, st: Handle) => copy_3d("cuMemcpy3DAsync_v2_ptsz", p, Some((st, true)), false, false);
    cuMemcpy3DPeer(p: *const Memcpy3D) => copy_3d("cuMemcpy3DPeer", p, None, false, true);
    cuMemcpy3DPeer_ptds(p: *const Memcpy3D) => copy_3d("cuMemcpy3DPeer_ptds", p, None, true, true);
    cuMemcpy3DPeerAsync(p: *const Memcpy3D, st: Handle) => copy_3d("cuMemcpy3DPeerAsync", p, Some((st, false)), false, true);
    cuMemcpy3DPeerAsync_ptsz(p: *const Memcpy3D, st: Handle) => copy_3d("cuMemcpy3DPeerAsync_ptsz", p, Some((st, true)), false, true);
    cuMemcpyPeer(dst: DevPtr, dc: Handle, src: DevPtr, sc: Handle, n: usize) => peer(dst, dc, src, sc, n, None);
    cuMemcpyPeer_ptds(dst: DevPtr, dc: Handle, src: DevPtr, sc: Handle, n: usize) => peer(dst, dc, src, sc, n, None);
    cuMemcpyPeerAsync(dst: DevPtr, dc: Handle, src: DevPtr, sc: Handle, n: usize, st: Handle) => peer(dst, dc, src, sc, n, Some((st, false)));
    cuMemcpyPeerAsync_ptsz(dst: DevPtr, dc: Handle, src: DevPtr, sc: Handle, n: usize, st: Handle) => peer(dst, dc, src, sc, n, Some((st, true)));
}
