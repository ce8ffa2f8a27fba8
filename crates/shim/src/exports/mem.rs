//! Memory: allocation, copies, memsets, pointer attributes.

use std::ffi::{c_int, c_uint, c_void};

use remora_client::host::HostRange;
use remora_client::proto::{RmMemset2dArgs, RmMemsetArgs};
use remora_client::{CuError, CuResult, PointerKind, Session, cu};

use super::{DevPtr, Handle};
use crate::CUresult;
use crate::state::{self, Kind, enc, entry, non_null, put, stream_ref};

fn ctx_session() -> CuResult<(&'static remora_client::Session, u64)> {
    Ok((state::session()?, state::current_ctx()?))
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAlloc_v2(dptr: *mut DevPtr, bytesize: usize) -> CUresult {
    entry("cuMemAlloc_v2", || {
        non_null(dptr)?;
        let (s, ctx) = ctx_session()?;
        let p = s.mem_alloc(ctx, bytesize as u64)?;
        // SAFETY: output pointer per cuda.h.
        unsafe { put(dptr, p) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocPitch_v2(
    dptr: *mut DevPtr,
    pitch: *mut usize,
    width: usize,
    height: usize,
    element_size: c_uint,
) -> CUresult {
    entry("cuMemAllocPitch_v2", || {
        if dptr.is_null() || pitch.is_null() {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let (s, ctx) = ctx_session()?;
        let (p, pt) = s.mem_alloc_pitch(ctx, width as u64, height as u64, element_size)?;
        // SAFETY: output pointers per cuda.h.
        unsafe {
            put(dptr, p)?;
            put(pitch, pt as usize)
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFree_v2(dptr: DevPtr) -> CUresult {
    entry("cuMemFree_v2", || {
        if dptr == 0 {
            return Ok(());
        }
        let s = state::session()?;
        let ctx = match s.pointer_kind(dptr) {
            PointerKind::Device { ctx, .. } => ctx,
            PointerKind::Host | PointerKind::HostTracked(_) => state::current_ctx()?,
        };
        s.mem_free(ctx, dptr)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    entry("cuMemGetInfo_v2", || {
        let (s, ctx) = ctx_session()?;
        let (f, t) = s.mem_get_info(ctx)?;
        // SAFETY: output pointers per cuda.h.
        unsafe {
            put(free, f as usize)?;
            put(total, t as usize)
        }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemGetAddressRange_v2(
    base: *mut DevPtr,
    size: *mut usize,
    dptr: DevPtr,
) -> CUresult {
    entry("cuMemGetAddressRange_v2", || {
        let (s, ctx) = ctx_session()?;
        let range = match s.pointer_kind(dptr) {
            PointerKind::Device { base, size, .. } => (base, size),
            PointerKind::Host | PointerKind::HostTracked(_) => {
                s.mem_get_address_range(ctx, dptr)?
            }
        };
        // SAFETY: optional output pointers per cuda.h.
        unsafe { state::put_range(base, size, range) }
    })
}

/// Pointer attributes answered from unified addressing: CONTEXT (1), MEMORY_TYPE (2),
/// DEVICE_POINTER (3), IS_MANAGED (8), DEVICE_ORDINAL (9), RANGE_START_ADDR (11),
/// RANGE_SIZE (12), MAPPED (13), and HOST_POINTER (4) of managed memory (the same address;
/// CUDA_ERROR_INVALID_VALUE for other device memory, which no host pointer reaches);
/// for host memory of `cuMemHostAlloc`/`cuMemHostRegister` also HOST_POINTER (4), and
/// DEVICE_POINTER as `cuMemHostGetDevicePointer` answers it (page-locked allocations outside
/// a data area answer their own address without being mapped yet: PyTorch asks this of every
/// pinned tensor). Other host pointers are CUDA_ERROR_INVALID_VALUE, as for memory CUDA does
/// not know.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuPointerGetAttribute(
    data: *mut c_void,
    attribute: c_int,
    ptr: DevPtr,
) -> CUresult {
    entry("cuPointerGetAttribute", || {
        let s = state::session()?;
        let (base, size, ctx, buffer_id) = match s.pointer_kind(ptr) {
            PointerKind::Device {
                base,
                size,
                ctx,
                buffer_id,
            } => (base, size, ctx, buffer_id),
            PointerKind::HostTracked(r) => return host_attribute(data, attribute, ptr, &r),
            PointerKind::Host => return Err(CuError(cu::INVALID_VALUE)),
        };
        // SAFETY: `data` points to storage of the attribute's type per cuda.h.
        unsafe {
            match attribute {
                1 => put(data.cast::<Handle>(), enc(Kind::Ctx, ctx)),
                2 => put(data.cast::<c_uint>(), 2), // CU_MEMORYTYPE_DEVICE
                3 => put(data.cast::<DevPtr>(), ptr),
                7 => put(data.cast::<u64>(), buffer_id),
                4 if s.managed_range(ptr).is_some() => {
                    put(data.cast::<*mut c_void>(), ptr as usize as *mut c_void)
                }
                // No host pointer reaches plain device memory: the driver answers
                // CUDA_ERROR_INVALID_VALUE (cuDNN asks, several times per training step).
                4 => Err(CuError(cu::INVALID_VALUE)),
                8 => put(
                    data.cast::<c_uint>(),
                    u32::from(s.managed_range(ptr).is_some()),
                ),
                9 => put(data.cast::<c_int>(), state::ctx_device(ctx)?),
                11 => put(data.cast::<DevPtr>(), base),
                12 => put(data.cast::<usize>(), size as usize),
                13 => put(data.cast::<c_uint>(), 1),
                0..=32 => {
                    tracing::warn!(
                        "remora: cuPointerGetAttribute: attribute {attribute} is not supported \
                         for device memory yet; returning CUDA_ERROR_NOT_SUPPORTED"
                    );
                    Err(CuError(cu::NOT_SUPPORTED))
                }
                _ => Err(CuError(cu::INVALID_VALUE)),
            }
        }
    })
}

/// `cuPointerGetAttributes`: each attribute as `cuPointerGetAttribute` answers it. As in CUDA,
/// a pointer CUDA does not know (or an attribute that does not apply) is not an error: the
/// slot gets its null default where the attribute's type is known (context, memory type,
/// pointers, device ordinal, range) and is left untouched otherwise.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuPointerGetAttributes(
    count: c_uint,
    attributes: *const c_int,
    data: *mut *mut c_void,
    ptr: DevPtr,
) -> CUresult {
    entry("cuPointerGetAttributes", || {
        if count > 0 && (attributes.is_null() || data.is_null()) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        for i in 0..count as usize {
            // SAFETY: cuda.h: `attributes` and `data` hold `count` entries each.
            let (attribute, slot) = unsafe { (*attributes.add(i), *data.add(i)) };
            // SAFETY: `slot` points to storage of the attribute's type, as for the singular call.
            match unsafe { cuPointerGetAttribute(slot, attribute, ptr) } {
                0 => {}
                rc if rc == cu::NOT_SUPPORTED || rc == cu::INVALID_VALUE => {
                    let size = match attribute {
                        2 | 9 => 4,                   // CUmemorytype, device ordinal (int)
                        1 | 3 | 4 | 7 | 11 | 12 => 8, // context, pointers, buffer id, range
                        _ => 0,
                    };
                    if size > 0 && !slot.is_null() {
                        // SAFETY: `slot` holds the attribute's type, `size` bytes long.
                        unsafe { std::ptr::write_bytes(slot.cast::<u8>(), 0, size) };
                    }
                }
                rc => return Err(CuError(rc)),
            }
        }
        Ok(())
    })
}

fn htod(dst: DevPtr, src: *const c_void, n: usize, stream: Option<(Handle, bool)>) -> CuResult<()> {
    let (s, ctx) = ctx_session()?;
    if n == 0 {
        return Ok(());
    }
    non_null(src)?;
    // SAFETY: `src` is readable for `n` bytes per cuda.h; the slice is used only here.
    let data = unsafe { std::slice::from_raw_parts(src.cast::<u8>(), n) };
    match stream {
        Some(st) => match async_host_copy(s, ctx, st, dst, src as usize as u64, n, true)? {
            Some(h) => s.memcpy_htod_async(ctx, h, dst, data),
            None => Ok(()),
        },
        None => s.memcpy_htod(ctx, 1, dst, data),
    }
}

/// The stream handle of an asynchronous copy of `n` bytes between device address `dev` and
/// host address `host` on `(stream, per-thread default)`; `None` when that stream is
/// capturing and the copy went into the graph instead.
fn async_host_copy(
    s: &Session,
    ctx: u64,
    (stream, ptds): (Handle, bool),
    dev: DevPtr,
    host: u64,
    n: usize,
    to_device: bool,
) -> CuResult<Option<u64>> {
    let h = s.stream_handle(ctx, stream_ref(stream, ptds)?)?;
    if !s.stream_may_capture(h) {
        return Ok(Some(h));
    }
    // Pageable or page-locked alike: the capture stages the host bytes around each launch
    // (page-locked memory in the data area included: its zero-copy path issues the copy now,
    // which a capture cannot record).
    // SAFETY: cuda.h: host memory a captured copy names stays valid for every launch of the
    // graph.
    unsafe { s.graph_capture_host_copy(ctx, h, dev, host, n as u64, to_device) }?;
    Ok(None)
}

fn dtoh(
    dst: *mut c_void,
    src: DevPtr,
    n: usize,
    stream: Option<(Handle, bool)>,
    ptds: bool,
) -> CuResult<()> {
    let (s, ctx) = ctx_session()?;
    if n == 0 {
        return Ok(());
    }
    non_null(dst)?;
    match stream {
        Some(st) => {
            let Some(h) = async_host_copy(s, ctx, st, src, dst as usize as u64, n, false)? else {
                return Ok(());
            };
            if s.pinned_offset(dst as usize as u64, n as u64).is_some() {
                // Zero-copy pinned memory: the server writes it, nothing is delivered.
                return s.memcpy_dtoh_pinned(remora_client::PinnedCopy {
                    ctx,
                    stream: h,
                    dev: src,
                    host: dst as usize as u64,
                    size: n as u64,
                    asynchronous: true,
                });
            }
            if s.host_memory().find(dst as usize as u64).is_none() {
                // Pageable memory: natively the copy returns once complete, and so may this
                // one (large copies over a socket: pipelined, in the stream's order).
                // SAFETY: `dst` is writable for `n` bytes per cuda.h.
                let out = unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), n) };
                if let Some(r) = s.memcpy_dtoh_pageable(ctx, h, src, out) {
                    return r;
                }
            }
            // SAFETY: cuda.h: `dst` is writable for `n` bytes, and the program leaves it alone
            // until a synchronizing call says the copy is complete (by then it is delivered).
            unsafe { s.memcpy_dtoh_async_into(ctx, h, src, dst.cast(), n as u64) }
        }
        None => {
            let h = if ptds {
                s.stream_handle(ctx, remora_client::StreamRef::PerThread)?
            } else {
                1
            };
            // SAFETY: `dst` is writable for `n` bytes per cuda.h.
            let out = unsafe { std::slice::from_raw_parts_mut(dst.cast::<u8>(), n) };
            s.memcpy_dtoh(ctx, h, src, out)
        }
    }
}

fn dtod(dst: DevPtr, src: DevPtr, n: usize, stream: Option<(Handle, bool)>) -> CuResult<()> {
    let (s, ctx) = ctx_session()?;
    match state::async_stream(s, ctx, stream)? {
        Some(h) => s.memcpy_dtod_async(ctx, h, dst, src, n as u64),
        None => s.memcpy_dtod(ctx, 1, dst, src, n as u64),
    }
}

/// `cuMemsetD2D*`: `height` rows of `width` elements, `pitch` bytes apart.
fn memset_rows(
    (dst, pitch): (DevPtr, usize),
    value: u32,
    element_size: u32,
    (width, height): (usize, usize),
    stream: Option<(Handle, bool)>,
) -> CuResult<()> {
    let (s, ctx) = ctx_session()?;
    let args = RmMemset2dArgs {
        ctx,
        stream: 1,
        dst,
        pitch: pitch as u64,
        value,
        element_size,
        width: width as u64,
        height: height as u64,
    };
    match state::async_stream(s, ctx, stream)? {
        Some(stream) => s.memset_rows_async(&RmMemset2dArgs { stream, ..args }),
        None => s.memset_rows(&args),
    }
}

fn memset(
    dst: DevPtr,
    value: u32,
    element_size: u32,
    count: usize,
    stream: Option<(Handle, bool)>,
) -> CuResult<()> {
    let (s, ctx) = ctx_session()?;
    let args = RmMemsetArgs {
        ctx,
        stream: 1,
        dst,
        value,
        element_size,
        count: count as u64,
    };
    match state::async_stream(s, ctx, stream)? {
        Some(stream) => s.memset_async(&RmMemsetArgs { stream, ..args }),
        None => s.memset(&args),
    }
}

entry_points! {
    cuMemcpyHtoD_v2(dst: DevPtr, src: *const c_void, n: usize) => htod(dst, src, n, None);
    cuMemcpyHtoD_v2_ptds(dst: DevPtr, src: *const c_void, n: usize) => htod(dst, src, n, None);
    cuMemcpyHtoDAsync_v2(dst: DevPtr, src: *const c_void, n: usize, st: Handle) => htod(dst, src, n, Some((st, false)));
    cuMemcpyHtoDAsync_v2_ptsz(dst: DevPtr, src: *const c_void, n: usize, st: Handle) => htod(dst, src, n, Some((st, true)));
    cuMemcpyDtoH_v2(dst: *mut c_void, src: DevPtr, n: usize) => dtoh(dst, src, n, None, false);
    cuMemcpyDtoH_v2_ptds(dst: *mut c_void, src: DevPtr, n: usize) => dtoh(dst, src, n, None, true);
    cuMemcpyDtoHAsync_v2(dst: *mut c_void, src: DevPtr, n: usize, st: Handle) => dtoh(dst, src, n, Some((st, false)), false);
    cuMemcpyDtoHAsync_v2_ptsz(dst: *mut c_void, src: DevPtr, n: usize, st: Handle) => dtoh(dst, src, n, Some((st, true)), true);
    cuMemcpyDtoD_v2(dst: DevPtr, src: DevPtr, n: usize) => dtod(dst, src, n, None);
    cuMemcpyDtoD_v2_ptds(dst: DevPtr, src: DevPtr, n: usize) => dtod(dst, src, n, None);
    cuMemcpyDtoDAsync_v2(dst: DevPtr, src: DevPtr, n: usize, st: Handle) => dtod(dst, src, n, Some((st, false)));
    cuMemcpyDtoDAsync_v2_ptsz(dst: DevPtr, src: DevPtr, n: usize, st: Handle) => dtod(dst, src, n, Some((st, true)));
    cuMemsetD8_v2(dst: DevPtr, v: u8, n: usize) => memset(dst, v.into(), 1, n, None);
    cuMemsetD8_v2_ptds(dst: DevPtr, v: u8, n: usize) => memset(dst, v.into(), 1, n, None);
    cuMemsetD16_v2(dst: DevPtr, v: u16, n: usize) => memset(dst, v.into(), 2, n, None);
    cuMemsetD16_v2_ptds(dst: DevPtr, v: u16, n: usize) => memset(dst, v.into(), 2, n, None);
    cuMemsetD32_v2(dst: DevPtr, v: u32, n: usize) => memset(dst, v, 4, n, None);
    cuMemsetD32_v2_ptds(dst: DevPtr, v: u32, n: usize) => memset(dst, v, 4, n, None);
    cuMemsetD8Async(dst: DevPtr, v: u8, n: usize, st: Handle) => memset(dst, v.into(), 1, n, Some((st, false)));
    cuMemsetD8Async_ptsz(dst: DevPtr, v: u8, n: usize, st: Handle) => memset(dst, v.into(), 1, n, Some((st, true)));
    cuMemsetD16Async(dst: DevPtr, v: u16, n: usize, st: Handle) => memset(dst, v.into(), 2, n, Some((st, false)));
    cuMemsetD16Async_ptsz(dst: DevPtr, v: u16, n: usize, st: Handle) => memset(dst, v.into(), 2, n, Some((st, true)));
    cuMemsetD32Async(dst: DevPtr, v: u32, n: usize, st: Handle) => memset(dst, v, 4, n, Some((st, false)));
    cuMemsetD32Async_ptsz(dst: DevPtr, v: u32, n: usize, st: Handle) => memset(dst, v, 4, n, Some((st, true)));
    cuMemsetD2D8_v2(dst: DevPtr, p: usize, v: u8, w: usize, h: usize) => memset_rows((dst, p), v.into(), 1, (w, h), None);
    cuMemsetD2D8_v2_ptds(dst: DevPtr, p: usize, v: u8, w: usize, h: usize) => memset_rows((dst, p), v.into(), 1, (w, h), None);
    cuMemsetD2D16_v2(dst: DevPtr, p: usize, v: u16, w: usize, h: usize) => memset_rows((dst, p), v.into(), 2, (w, h), None);
    cuMemsetD2D16_v2_ptds(dst: DevPtr, p: usize, v: u16, w: usize, h: usize) => memset_rows((dst, p), v.into(), 2, (w, h), None);
    cuMemsetD2D32_v2(dst: DevPtr, p: usize, v: u32, w: usize, h: usize) => memset_rows((dst, p), v, 4, (w, h), None);
    cuMemsetD2D32_v2_ptds(dst: DevPtr, p: usize, v: u32, w: usize, h: usize) => memset_rows((dst, p), v, 4, (w, h), None);
    cuMemsetD2D8Async(dst: DevPtr, p: usize, v: u8, w: usize, h: usize, st: Handle) => memset_rows((dst, p), v.into(), 1, (w, h), Some((st, false)));
    cuMemsetD2D8Async_ptsz(dst: DevPtr, p: usize, v: u8, w: usize, h: usize, st: Handle) => memset_rows((dst, p), v.into(), 1, (w, h), Some((st, true)));
    cuMemsetD2D16Async(dst: DevPtr, p: usize, v: u16, w: usize, h: usize, st: Handle) => memset_rows((dst, p), v.into(), 2, (w, h), Some((st, false)));
    cuMemsetD2D16Async_ptsz(dst: DevPtr, p: usize, v: u16, w: usize, h: usize, st: Handle) => memset_rows((dst, p), v.into(), 2, (w, h), Some((st, true)));
    cuMemsetD2D32Async(dst: DevPtr, p: usize, v: u32, w: usize, h: usize, st: Handle) => memset_rows((dst, p), v, 4, (w, h), Some((st, false)));
    cuMemsetD2D32Async_ptsz(dst: DevPtr, p: usize, v: u32, w: usize, h: usize, st: Handle) => memset_rows((dst, p), v, 4, (w, h), Some((st, true)));
}

fn host_attribute(data: *mut c_void, attribute: c_int, ptr: DevPtr, r: &HostRange) -> CuResult<()> {
    // SAFETY: `data` points to storage of the attribute's type per cuda.h.
    unsafe {
        match attribute {
            1 => put(
                data.cast::<Handle>(),
                if r.ctx == 0 {
                    std::ptr::null_mut()
                } else {
                    enc(Kind::Ctx, r.ctx)
                },
            ),
            2 => put(data.cast::<c_uint>(), 1), // CU_MEMORYTYPE_HOST
            3 => {
                let (s, ctx) = ctx_session()?;
                put(data.cast::<DevPtr>(), s.mem_host_device_address(ctx, ptr)?)
            }
            4 => put(data.cast::<*mut c_void>(), ptr as usize as *mut c_void),
            8 => put(data.cast::<c_uint>(), 0),
            9 => put(data.cast::<c_int>(), state::ctx_device(r.ctx)?),
            11 => put(data.cast::<DevPtr>(), r.base),
            12 => put(data.cast::<usize>(), r.size as usize),
            13 => put(data.cast::<c_uint>(), 1),
            0..=32 => Err(CuError(cu::NOT_SUPPORTED)),
            _ => Err(CuError(cu::INVALID_VALUE)),
        }
    }
}

/// `CU_MEMHOSTALLOC_PORTABLE | DEVICEMAP | WRITECOMBINED`.
const HOST_ALLOC_FLAGS: c_uint = 0x7;
/// `CU_MEMHOSTREGISTER_PORTABLE | DEVICEMAP | IOMEMORY | READ_ONLY`.
const HOST_REGISTER_FLAGS: c_uint = 0xF;

fn host_alloc(pp: *mut *mut c_void, size: usize, flags: c_uint) -> CuResult<()> {
    if pp.is_null() || flags & !HOST_ALLOC_FLAGS != 0 {
        return Err(CuError(cu::INVALID_VALUE));
    }
    let (s, ctx) = ctx_session()?;
    let p = s.mem_host_alloc(ctx, size as u64, flags)?;
    // SAFETY: output pointer per cuda.h.
    unsafe { put(pp, p as usize as *mut c_void) }
}

entry_points! {
    /// Host memory is allocated by the client: on a shared-memory session in the data area
    /// (zero-copy: 1-D copies from and to it pass only its offset), else page-aligned memory
    /// at an address reserved on the device too, whose copies go through the transport.
    /// PORTABLE and WRITECOMBINED are accepted. Every allocation is mapped for the GPU, as
    /// with unified addressing: in the data area by the server when it is made (revision 18,
    /// `RM_AREA_MAP`; an older server maps the whole area on the first device-pointer query),
    /// so a kernel may use its host pointer directly; other memory through a device
    /// copy kept coherent at launches and synchronizations, made at once with DEVICEMAP and
    /// otherwise when `cuMemHostGetDevicePointer` is asked or a kernel parameter points into
    /// it (see `Session::mem_host_alloc`).
    cuMemHostAlloc(pp: *mut *mut c_void, size: usize, flags: c_uint) => host_alloc(pp, size, flags);
    cuMemAllocHost_v2(pp: *mut *mut c_void, size: usize) => host_alloc(pp, size, 0);
    cuMemAllocHost(pp: *mut *mut c_void, size: c_uint) => host_alloc(pp, size as usize, 0);
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    entry("cuMemFreeHost", || {
        state::session()?.mem_free_host(p as usize as u64)
    })
}

fn host_register(p: *mut c_void, size: usize, flags: c_uint) -> CuResult<()> {
    if flags & !HOST_REGISTER_FLAGS != 0 {
        return Err(CuError(cu::INVALID_VALUE));
    }
    let (s, ctx) = ctx_session()?;
    s.host_memory()
        .register(p as usize as u64, size as u64, flags, ctx)
}

/// The range is recorded and accepted; nothing is pinned (see cuMemHostAlloc). It is mapped
/// for the GPU when `cuMemHostGetDevicePointer` is asked: a device copy at another address,
/// kept coherent at launches and synchronizations (so `CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`
/// answers 0).
#[unsafe(no_mangle)]
pub extern "C" fn cuMemHostRegister_v2(p: *mut c_void, size: usize, flags: c_uint) -> CUresult {
    entry("cuMemHostRegister_v2", || host_register(p, size, flags))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemHostRegister(p: *mut c_void, size: usize, flags: c_uint) -> CUresult {
    entry("cuMemHostRegister", || host_register(p, size, flags))
}

#[unsafe(no_mangle)]
pub extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CUresult {
    entry("cuMemHostUnregister", || {
        state::session()?.mem_host_unregister(p as usize as u64)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemHostGetFlags(flags: *mut c_uint, p: *mut c_void) -> CUresult {
    entry("cuMemHostGetFlags", || {
        let r = state::session()?
            .host_memory()
            .find(p as usize as u64)
            .ok_or(CuError(cu::INVALID_VALUE))?;
        // SAFETY: output pointer per cuda.h.
        unsafe { put(flags, r.flags) }
    })
}

fn host_device_pointer(dptr: *mut DevPtr, p: *mut c_void, flags: c_uint) -> CuResult<()> {
    if dptr.is_null() || flags != 0 {
        return Err(CuError(cu::INVALID_VALUE));
    }
    let (s, ctx) = ctx_session()?;
    let dev = s.mem_host_device_pointer(ctx, p as usize as u64)?;
    // SAFETY: `dptr` is non-null, the caller's output slot per cuda.h.
    unsafe { put(dptr, dev) }
}

entry_points! {
    cuMemHostGetDevicePointer_v2(dptr: *mut DevPtr, p: *mut c_void, flags: c_uint) =>
        host_device_pointer(dptr, p, flags);
    cuMemHostGetDevicePointer(dptr: *mut DevPtr, p: *mut c_void, flags: c_uint) =>
        host_device_pointer(dptr, p, flags);
}

/// `cuMemcpy(Async)`: unified addressing infers the direction. A pointer in no device
/// allocation of this session is host memory (module globals are not tracked: use the
/// explicit copies for them).
fn unified(dst: DevPtr, src: DevPtr, n: usize, stream: Option<(Handle, bool)>) -> CuResult<()> {
    let s = state::session()?;
    let dev = |p| matches!(s.pointer_kind(p), PointerKind::Device { .. });
    match (dev(dst), dev(src)) {
        (true, true) => dtod(dst, src, n, stream),
        (true, false) => htod(dst, src as usize as *const c_void, n, stream),
        (false, true) => {
            let ptds = stream.is_some_and(|(_, p)| p);
            dtoh(dst as usize as *mut c_void, src, n, stream, ptds)
        }
        (false, false) => {
            if n > 0 {
                if dst == 0 || src == 0 {
                    return Err(CuError(cu::INVALID_VALUE));
                }
                // SAFETY: both are host buffers of `n` bytes per cuda.h; `copy` allows overlap.
                unsafe {
                    std::ptr::copy(src as usize as *const u8, dst as usize as *mut u8, n);
                }
            }
            Ok(())
        }
    }
}

entry_points! {
    cuMemcpy(dst: DevPtr, src: DevPtr, n: usize) => unified(dst, src, n, None);
    cuMemcpy_ptds(dst: DevPtr, src: DevPtr, n: usize) => unified(dst, src, n, None);
    cuMemcpyAsync(dst: DevPtr, src: DevPtr, n: usize, st: Handle) => unified(dst, src, n, Some((st, false)));
    cuMemcpyAsync_ptsz(dst: DevPtr, src: DevPtr, n: usize, st: Handle) => unified(dst, src, n, Some((st, true)));
}
