//! Stream-ordered allocation and memory pools: `cuMemAllocAsync`, `cuMemFreeAsync`,
//! `cuMemAllocFromPoolAsync` (each with its `_ptsz` form), the device pool calls and the
//! `cuMemPool*` calls, remoted through the session (revision 10). A `CUmemoryPool` is a
//! session handle of the server, encoded as [`Kind::MemPool`].
//!
//! Not carried, CUDA_ERROR_NOT_SUPPORTED with a warning: pools that export shareable handles
//! and the IPC calls of pools (`cuMemPoolExportToShareableHandle`,
//! `cuMemPoolImportFromShareableHandle`, `cuMemPoolExportPointer`, `cuMemPoolImportPointer`),
//! and the location-based pool calls of CUDA 13 (`cuMemGetDefaultMemPool`, `cuMemGetMemPool`,
//! `cuMemSetMemPool`) for anything but pinned memory of a device, which they map onto the
//! device calls.

use std::ffi::{c_int, c_ulonglong, c_void};

use remora_client::proto::{RmPoolAccess, RmPoolProps};
use remora_client::proto_pool_access as pool_access;
use remora_client::{CuError, CuResult, cu};
use remora_cuda_abi::pools::{
    ALLOCATION_TYPE_PINNED, LOCATION_TYPE_DEVICE, MemAccessDesc, MemLocation, MemPoolProps,
};

use super::exec::mapped;
use super::{DevPtr, Handle};
use crate::state::{self, Kind, dec, enc, non_null, put, read_in};

/// Most descriptors one `cuMemPoolSetAccess` may pass (a bound on what is read from the
/// program; the driver knows far fewer locations).
const MAX_ACCESS_DESCS: usize = 4096;

fn pool(p: Handle) -> CuResult<u64> {
    dec(Kind::MemPool, p)
}

fn put_pool(out: *mut Handle, h: u64) -> CuResult<()> {
    // SAFETY: output pointer per cuda.h (null rejected by `put`).
    unsafe { put(out, enc(Kind::MemPool, h)) }
}

fn check_dev(dev: c_int) -> CuResult<&'static remora_client::Session> {
    let s = state::session()?;
    if dev < 0 || dev >= s.device_count() {
        return Err(CuError(cu::INVALID_DEVICE));
    }
    Ok(s)
}

fn alloc_async(
    dptr: *mut DevPtr,
    size: usize,
    p: Option<Handle>,
    st: Handle,
    ptsz: bool,
) -> CuResult<()> {
    non_null(dptr)?;
    let pool = match p {
        Some(p) => pool(p)?,
        None => 0,
    };
    let (s, ctx, stream) = mapped(st, ptsz)?;
    let ptr = s.mem_alloc_async(ctx, stream, size as u64, pool)?;
    // SAFETY: output pointer per cuda.h (checked non-null above).
    unsafe { put(dptr, ptr) }
}

fn free_async(dptr: DevPtr, st: Handle, ptsz: bool) -> CuResult<()> {
    if dptr == 0 {
        return Ok(());
    }
    let (s, ctx, stream) = mapped(st, ptsz)?;
    s.mem_free_async(ctx, stream, dptr)
}

fn pool_create(out: *mut Handle, props: *const MemPoolProps) -> CuResult<()> {
    if out.is_null() || props.is_null() {
        return Err(CuError(cu::INVALID_VALUE));
    }
    // SAFETY: `props` points to a CUmemPoolProps per cuda.h (non-null checked above); read
    // unaligned into a copy.
    let p = unsafe { props.read_unaligned() };
    if p.reserved.iter().any(|b| *b != 0) {
        return Err(CuError(cu::INVALID_VALUE));
    }
    let h = state::session()?.mem_pool_create(&RmPoolProps {
        alloc_type: p.alloc_type,
        handle_types: p.handle_types,
        location: pool_access::location_from_abi(p.location),
        max_size: p.max_size as u64,
        usage: u32::from(p.usage),
    })?;
    put_pool(out, h)
}

/// `CU_MEMPOOL_ATTR_*` 1 to 3 are `int`, 4 to 8 `cuuint64_t`.
fn int_attr(attr: c_int) -> CuResult<bool> {
    match attr {
        1..=3 => Ok(true),
        4..=8 => Ok(false),
        _ => Err(CuError(cu::INVALID_VALUE)),
    }
}

fn set_attribute(p: Handle, attr: c_int, value: *mut c_void) -> CuResult<()> {
    non_null(value)?;
    let v = if int_attr(attr)? {
        // SAFETY: `value` points to the attribute's type per cuda.h, an int here (non-null
        // checked above).
        u64::from(unsafe { value.cast::<c_int>().read_unaligned() } != 0)
    } else {
        // SAFETY: as above, a cuuint64_t.
        unsafe { value.cast::<u64>().read_unaligned() }
    };
    state::session()?.mem_pool_set_attribute(pool(p)?, attr, v)
}

fn get_attribute(p: Handle, attr: c_int, value: *mut c_void) -> CuResult<()> {
    let is_int = int_attr(attr)?;
    let v = state::session()?.mem_pool_get_attribute(pool(p)?, attr)?;
    // SAFETY: `value` points to storage of the attribute's type per cuda.h (null rejected by
    // `put`).
    unsafe {
        if is_int {
            put(value.cast::<c_int>(), c_int::from(v != 0))
        } else {
            put(value.cast::<u64>(), v)
        }
    }
}

fn set_access(p: Handle, map: *const MemAccessDesc, count: usize) -> CuResult<()> {
    if count == 0 {
        return Ok(());
    }
    if map.is_null() || count > MAX_ACCESS_DESCS {
        return Err(CuError(cu::INVALID_VALUE));
    }
    let descs: Vec<RmPoolAccess> = (0..count)
        .map(|i| {
            // SAFETY: `map` holds `count` CUmemAccessDesc per cuda.h (non-null and bounded
            // above); each is read unaligned.
            let d = unsafe { map.add(i).read_unaligned() };
            pool_access::access_from_abi(&d)
        })
        .collect();
    state::session()?.mem_pool_set_access(pool(p)?, &descs)
}

fn get_access(flags: *mut c_int, p: Handle, location: *mut MemLocation) -> CuResult<()> {
    let l = read_in(location)?;
    let f = state::session()?.mem_pool_get_access(pool(p)?, pool_access::location_from_abi(l))?;
    // SAFETY: output pointer per cuda.h (null rejected by `put`).
    unsafe { put(flags, f) }
}

/// The device of a CUDA 13 location-based pool call, when it names pinned memory of a device;
/// otherwise CUDA_ERROR_NOT_SUPPORTED, logged.
fn pinned_device(what: &str, location: *mut MemLocation, kind: c_int) -> CuResult<c_int> {
    let l = read_in(location)?;
    if l.kind != LOCATION_TYPE_DEVICE || kind != ALLOCATION_TYPE_PINNED {
        tracing::warn!(
            "remora: {what} for location type {} and allocation type {kind}: only pinned device memory pools are carried; returning CUDA_ERROR_NOT_SUPPORTED",
            l.kind
        );
        return Err(CuError(cu::NOT_SUPPORTED));
    }
    Ok(l.id)
}

/// The IPC calls of pools: refused, with a line saying why.
fn no_ipc(what: &str) -> CuResult<()> {
    tracing::warn!(
        "remora: {what}: IPC of memory pools (exporting and importing pools and pool pointers) is not carried by Remora; returning CUDA_ERROR_NOT_SUPPORTED"
    );
    Err(CuError(cu::NOT_SUPPORTED))
}

entry_points! {
    cuMemAllocAsync(dptr: *mut DevPtr, size: usize, st: Handle) => alloc_async(dptr, size, None, st, false);
    cuMemAllocAsync_ptsz(dptr: *mut DevPtr, size: usize, st: Handle) => alloc_async(dptr, size, None, st, true);
    cuMemAllocFromPoolAsync(dptr: *mut DevPtr, size: usize, p: Handle, st: Handle) => alloc_async(dptr, size, Some(p), st, false);
    cuMemAllocFromPoolAsync_ptsz(dptr: *mut DevPtr, size: usize, p: Handle, st: Handle) => alloc_async(dptr, size, Some(p), st, true);
    cuMemFreeAsync(dptr: DevPtr, st: Handle) => free_async(dptr, st, false);
    cuMemFreeAsync_ptsz(dptr: DevPtr, st: Handle) => free_async(dptr, st, true);
    cuDeviceGetDefaultMemPool(out: *mut Handle, dev: c_int) => put_pool(out, check_dev(dev)?.device_get_default_mem_pool(dev)?);
    cuDeviceGetMemPool(out: *mut Handle, dev: c_int) => put_pool(out, check_dev(dev)?.device_get_mem_pool(dev)?);
    cuDeviceSetMemPool(dev: c_int, p: Handle) => check_dev(dev)?.device_set_mem_pool(dev, pool(p)?);
    cuMemGetDefaultMemPool(out: *mut Handle, location: *mut MemLocation, kind: c_int) => {
        let dev = pinned_device("cuMemGetDefaultMemPool", location, kind)?;
        put_pool(out, check_dev(dev)?.device_get_default_mem_pool(dev)?)
    };
    cuMemGetMemPool(out: *mut Handle, location: *mut MemLocation, kind: c_int) => {
        let dev = pinned_device("cuMemGetMemPool", location, kind)?;
        put_pool(out, check_dev(dev)?.device_get_mem_pool(dev)?)
    };
    cuMemSetMemPool(location: *mut MemLocation, kind: c_int, p: Handle) => {
        let dev = pinned_device("cuMemSetMemPool", location, kind)?;
        check_dev(dev)?.device_set_mem_pool(dev, pool(p)?)
    };
    cuMemPoolCreate(out: *mut Handle, props: *const MemPoolProps) => pool_create(out, props);
    cuMemPoolDestroy(p: Handle) => state::session()?.mem_pool_destroy(pool(p)?);
    cuMemPoolSetAttribute(p: Handle, attr: c_int, value: *mut c_void) => set_attribute(p, attr, value);
    cuMemPoolGetAttribute(p: Handle, attr: c_int, value: *mut c_void) => get_attribute(p, attr, value);
    cuMemPoolTrimTo(p: Handle, keep: usize) => state::session()?.mem_pool_trim_to(pool(p)?, keep as u64);
    cuMemPoolSetAccess(p: Handle, map: *const MemAccessDesc, count: usize) => set_access(p, map, count);
    cuMemPoolGetAccess(flags: *mut c_int, p: Handle, location: *mut MemLocation) => get_access(flags, p, location);
    cuMemPoolExportToShareableHandle(_out: *mut c_void, _p: Handle, _kind: c_int, _flags: c_ulonglong) => no_ipc("cuMemPoolExportToShareableHandle");
    cuMemPoolImportFromShareableHandle(_out: *mut Handle, _handle: *mut c_void, _kind: c_int, _flags: c_ulonglong) => no_ipc("cuMemPoolImportFromShareableHandle");
    cuMemPoolExportPointer(_out: *mut c_void, _ptr: DevPtr) => no_ipc("cuMemPoolExportPointer");
    cuMemPoolImportPointer(_out: *mut DevPtr, _p: Handle, _data: *mut c_void) => no_ipc("cuMemPoolImportPointer");
}
