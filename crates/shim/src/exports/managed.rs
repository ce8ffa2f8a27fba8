//! Managed (unified) memory: `cuMemAllocManaged`, prefetches, advice and stream attachment.
//!
//! The client keeps managed memory coherent with the model CUDA defines for devices that
//! report `concurrentManagedAccess = 0` (see `remora_client`'s `mirror` module and
//! docs/architecture.md): the program may touch it on the host while no kernel runs, and
//! Remora copies host changes to the device before launches and copies and the device's bytes
//! back after synchronizations. `cuDeviceGetAttribute` answers the server's value for
//! `MANAGED_MEMORY` and 0 for `CONCURRENT_MANAGED_ACCESS` and the pageable-memory attributes
//! (`remora_client::UNSUPPORTED_MEMORY_ATTRIBUTES`). Prefetches and advice are hints: they
//! check their arguments and change nothing (the bytes live on the device between
//! synchronizations anyway).

use std::ffi::{c_int, c_uint, c_ulonglong};

use remora_client::{CuError, CuResult, cu};
use remora_cuda_abi::MemLocation;

use super::exec::mapped;
use super::{DevPtr, Handle};
use crate::CUresult;
use crate::state::{self, entry, non_null, put};

/// `CU_MEM_ADVISE_SET_READ_MOSTLY` .. `CU_MEM_ADVISE_UNSET_ACCESSED_BY`.
const ADVICE: std::ops::RangeInclusive<c_int> = 1..=6;

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuMemAllocManaged(
    dptr: *mut DevPtr,
    bytesize: usize,
    flags: c_uint,
) -> CUresult {
    entry("cuMemAllocManaged", || {
        non_null(dptr)?;
        let s = state::session()?;
        let ctx = state::current_ctx()?;
        let p = s.mem_alloc_managed(ctx, bytesize as u64, flags)?;
        // SAFETY: output pointer per cuda.h (checked non-null above).
        unsafe { put(dptr, p) }
    })
}

/// A prefetch: the stream must be valid and the range managed.
fn prefetch(ptr: DevPtr, count: usize, stream: Handle, ptsz: bool) -> CuResult<()> {
    let (s, _, _) = mapped(stream, ptsz)?;
    s.managed_hint(ptr, count as u64)
}

/// Advice: a known advice value on a managed range.
fn advise(ptr: DevPtr, count: usize, advice: c_int) -> CuResult<()> {
    if !ADVICE.contains(&advice) {
        return Err(CuError(cu::INVALID_VALUE));
    }
    state::session()?.managed_hint(ptr, count as u64)
}

entry_points! {
    cuMemPrefetchAsync(dev_ptr: DevPtr, count: usize, dst_device: c_int, stream: Handle) =>
        { let _ = dst_device; prefetch(dev_ptr, count, stream, false) };
    cuMemPrefetchAsync_ptsz(dev_ptr: DevPtr, count: usize, dst_device: c_int, stream: Handle) =>
        { let _ = dst_device; prefetch(dev_ptr, count, stream, true) };
    cuMemPrefetchAsync_v2(dev_ptr: DevPtr, count: usize, location: MemLocation, flags: c_uint, stream: Handle) =>
        { let _ = (location, flags); prefetch(dev_ptr, count, stream, false) };
    cuMemPrefetchAsync_v2_ptsz(dev_ptr: DevPtr, count: usize, location: MemLocation, flags: c_uint, stream: Handle) =>
        { let _ = (location, flags); prefetch(dev_ptr, count, stream, true) };
    cuMemAdvise(dev_ptr: DevPtr, count: usize, advice: c_int, device: c_int) =>
        { let _ = device; advise(dev_ptr, count, advice) };
    cuMemAdvise_v2(dev_ptr: DevPtr, count: usize, advice: c_int, location: MemLocation) =>
        { let _ = location; advise(dev_ptr, count, advice) };
    cuMemPrefetchBatchAsync(dptrs: *mut DevPtr, sizes: *mut usize, count: usize, locations: *mut MemLocation, location_idxs: *mut usize, num_locations: usize, flags: c_ulonglong, stream: Handle) =>
        { let _ = (locations, location_idxs, num_locations, flags); prefetch_batch(dptrs, sizes, count, stream, false) };
    cuMemPrefetchBatchAsync_ptsz(dptrs: *mut DevPtr, sizes: *mut usize, count: usize, locations: *mut MemLocation, location_idxs: *mut usize, num_locations: usize, flags: c_ulonglong, stream: Handle) =>
        { let _ = (locations, location_idxs, num_locations, flags); prefetch_batch(dptrs, sizes, count, stream, true) };
    cuStreamAttachMemAsync(stream: Handle, dptr: DevPtr, length: usize, flags: c_uint) =>
        attach(stream, dptr, length, flags, false);
    cuStreamAttachMemAsync_ptsz(stream: Handle, dptr: DevPtr, length: usize, flags: c_uint) =>
        attach(stream, dptr, length, flags, true);
}

/// `cuMemPrefetchBatchAsync`: every range checked as a single prefetch.
fn prefetch_batch(
    dptrs: *mut DevPtr,
    sizes: *mut usize,
    count: usize,
    stream: Handle,
    ptsz: bool,
) -> CuResult<()> {
    if count == 0 || dptrs.is_null() || sizes.is_null() {
        return Err(CuError(cu::INVALID_VALUE));
    }
    for i in 0..count {
        // SAFETY: cuda.h: `dptrs` and `sizes` hold `count` entries each (checked non-null).
        let (p, n) = unsafe { (*dptrs.add(i), *sizes.add(i)) };
        prefetch(p, n, stream, ptsz)?;
    }
    Ok(())
}

fn attach(stream: Handle, dptr: DevPtr, length: usize, flags: c_uint, ptsz: bool) -> CuResult<()> {
    let (s, _, _) = mapped(stream, ptsz)?;
    s.stream_attach_mem(dptr, length as u64, flags)
}
