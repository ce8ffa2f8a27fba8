//! Virtual memory management: physical allocations (`cuMemCreate`), reserved address ranges,
//! mappings and access, carried to the server (revision 10). A `CUmemGenericAllocationHandle`
//! here is the session's handle, never the server driver's.
//!
//! These calls need no current context natively; the caller's current one, if any, is sent
//! along (the server runs the call in it) and 0 otherwise. Shareable handles (a file
//! descriptor or fabric handle for another process) cannot be carried: the driver's handle
//! lives in the server, and a descriptor of the server's would mean nothing to the program.
//! Export and import are refused with `CUDA_ERROR_NOT_SUPPORTED`, logged.

use std::ffi::{c_int, c_ulonglong, c_void};

use remora_client::proto::{RmMemAccess, RmMemProp};
use remora_client::{CuError, CuResult, cu};
use remora_cuda_abi::{MemAccessDesc, MemAllocationProp, MemLocation};

use super::DevPtr;
use crate::state::{self, non_null, put, read_in};

/// The session and the caller's current context (0 when it has none).
fn session_ctx() -> CuResult<(&'static remora_client::Session, u64)> {
    Ok((state::session()?, state::current_ctx_opt().unwrap_or(0)))
}

/// The wire form of the program's `CUmemAllocationProp` (`CUDA_ERROR_INVALID_VALUE` for null).
///
/// # Safety
/// `prop` is null or points to a `CUmemAllocationProp`.
unsafe fn wire_prop(prop: *const MemAllocationProp) -> CuResult<RmMemProp> {
    non_null(prop)?;
    // SAFETY: non-null and a CUmemAllocationProp by the caller's contract (unaligned allowed).
    let p = unsafe { prop.read_unaligned() };
    Ok(remora_client::proto_mem_prop::from_abi(&p))
}

/// Logs why shareable handles are refused.
fn refuse_shareable(name: &str) -> CuResult<()> {
    tracing::warn!(
        "remora: {name}: shareable memory handles (file descriptors, fabric handles) cannot cross processes through Remora: the allocation lives in the server's process; returning CUDA_ERROR_NOT_SUPPORTED"
    );
    Err(CuError(cu::NOT_SUPPORTED))
}

entry_points! {
    cuMemCreate(handle: *mut c_ulonglong, size: usize, prop: *const MemAllocationProp, flags: c_ulonglong) => {
        non_null(handle)?;
        // SAFETY: `prop` per cuda.h.
        let prop = unsafe { wire_prop(prop)? };
        let (s, ctx) = session_ctx()?;
        let h = s.mem_create(ctx, size as u64, prop, flags)?;
        // SAFETY: output pointer per cuda.h.
        unsafe { put(handle, h) }
    };
    cuMemRelease(handle: c_ulonglong) => {
        let (s, ctx) = session_ctx()?;
        s.mem_release(ctx, handle)
    };
    cuMemAddressReserve(ptr: *mut DevPtr, size: usize, alignment: usize, addr: DevPtr, flags: c_ulonglong) => {
        non_null(ptr)?;
        let (s, ctx) = session_ctx()?;
        let p = s.mem_address_reserve(ctx, size as u64, alignment as u64, addr, flags)?;
        // SAFETY: output pointer per cuda.h.
        unsafe { put(ptr, p) }
    };
    cuMemAddressFree(ptr: DevPtr, size: usize) => {
        let (s, ctx) = session_ctx()?;
        s.mem_address_free(ctx, ptr, size as u64)
    };
    cuMemMap(ptr: DevPtr, size: usize, offset: usize, handle: c_ulonglong, flags: c_ulonglong) => {
        let (s, ctx) = session_ctx()?;
        s.mem_map(ctx, ptr, size as u64, offset as u64, handle, flags)
    };
    cuMemUnmap(ptr: DevPtr, size: usize) => {
        let (s, ctx) = session_ctx()?;
        s.mem_unmap(ctx, ptr, size as u64)
    };
    cuMemSetAccess(ptr: DevPtr, size: usize, desc: *const MemAccessDesc, count: usize) => {
        if count == 0 || desc.is_null() {
            return Err(CuError(cu::INVALID_VALUE));
        }
        if count > remora_client::proto::RM_MAX_ACCESS_DESCS as usize {
            tracing::warn!(
                "remora: cuMemSetAccess with {count} descriptors; Remora carries at most {}; returning CUDA_ERROR_INVALID_VALUE",
                remora_client::proto::RM_MAX_ACCESS_DESCS
            );
            return Err(CuError(cu::INVALID_VALUE));
        }
        let desc = (0..count)
            .map(|i| {
                // SAFETY: cuda.h: `desc` holds `count` descriptors (count bounded above).
                let d = unsafe { desc.add(i).read_unaligned() };
                RmMemAccess {
                    location_type: d.location.kind,
                    location_id: d.location.id,
                    flags: d.flags as u32,
                }
            })
            .collect();
        let (s, ctx) = session_ctx()?;
        s.mem_set_access(ctx, ptr, size as u64, desc)
    };
    cuMemGetAccess(flags: *mut c_ulonglong, location: *const MemLocation, ptr: DevPtr) => {
        non_null(flags)?;
        let loc = read_in(location)?;
        let (s, ctx) = session_ctx()?;
        let f = s.mem_get_access(ctx, ptr, (loc.kind, loc.id))?;
        // SAFETY: output pointer per cuda.h.
        unsafe { put(flags, f) }
    };
    cuMemGetAllocationGranularity(granularity: *mut usize, prop: *const MemAllocationProp, option: c_int) => {
        non_null(granularity)?;
        // SAFETY: `prop` per cuda.h.
        let prop = unsafe { wire_prop(prop)? };
        let (s, ctx) = session_ctx()?;
        let g = s.mem_get_granularity(ctx, prop, option as u32)?;
        // SAFETY: output pointer per cuda.h.
        unsafe { put(granularity, g as usize) }
    };
    cuMemGetAllocationPropertiesFromHandle(prop: *mut MemAllocationProp, handle: c_ulonglong) => {
        non_null(prop)?;
        let (s, ctx) = session_ctx()?;
        let p = s.mem_get_properties(ctx, handle)?;
        let out = remora_client::proto_mem_prop::to_abi(&p).ok_or(CuError(cu::INVALID_VALUE))?;
        // SAFETY: output pointer per cuda.h.
        unsafe { put(prop, out) }
    };
    cuMemRetainAllocationHandle(handle: *mut c_ulonglong, addr: *mut c_void) => {
        non_null(handle)?;
        let (s, ctx) = session_ctx()?;
        let h = s.mem_retain_handle(ctx, addr as u64)?;
        // SAFETY: output pointer per cuda.h.
        unsafe { put(handle, h) }
    };
    cuMemExportToShareableHandle(shareable: *mut c_void, handle: c_ulonglong, kind: c_int, flags: c_ulonglong) => {
        let _ = (shareable, handle, kind, flags);
        refuse_shareable("cuMemExportToShareableHandle")
    };
    cuMemImportFromShareableHandle(handle: *mut c_ulonglong, os_handle: *mut c_void, kind: c_int) => {
        let _ = (handle, os_handle, kind);
        refuse_shareable("cuMemImportFromShareableHandle")
    };
}
