//! Managed (unified) memory: not supported through Remora.
//!
//! A managed allocation is one address that the CPU of the *client* process and the GPU of
//! the *server* both access, with pages migrating on fault. Remora's client and GPU are in
//! different processes (often on different hosts), so a faithful implementation would need a
//! page-fault-driven coherence protocol over RPC; that is out of reach, and a partial one
//! (device memory behind a host mirror, copied at synchronize points) would silently give
//! wrong results to programs that rely on concurrent access. So these entry points fail
//! loudly with `CUDA_ERROR_NOT_SUPPORTED` (the runtime's `cudaErrorNotSupported`) and a warning
//! naming the call, and `cuDeviceGetAttribute` answers 0 for `MANAGED_MEMORY`,
//! `CONCURRENT_MANAGED_ACCESS` and the pageable-memory-access attributes
//! (`remora_client::UNSUPPORTED_MEMORY_ATTRIBUTES`), so that programs which check them (and
//! `cudaDeviceProp::managedMemory`) take their explicit-copy path.

use std::collections::HashSet;
use std::ffi::{c_int, c_uint, c_ulonglong};
use std::sync::{Mutex, OnceLock};

use remora_client::{CuError, CuResult, cu};
use remora_cuda_abi::MemLocation;

use super::{DevPtr, Handle};
use crate::CUresult;
use crate::state::entry;

/// Logs that `name` is not supported: every time for an allocation (a program that gets here
/// is about to fail), once per name for prefetches and advice (they may run in loops).
fn refuse(name: &'static str, every_time: bool) -> CuResult<()> {
    static SEEN: OnceLock<Mutex<HashSet<&'static str>>> = OnceLock::new();
    let first = SEEN
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(name);
    if (first || every_time) && crate::log::usable() {
        crate::log::init();
        tracing::warn!(
            "remora: {name}: managed (unified) memory is not supported through Remora; \
             returning CUDA_ERROR_NOT_SUPPORTED (use cuMemAlloc and explicit copies)"
        );
    }
    Err(CuError(cu::NOT_SUPPORTED))
}

macro_rules! refused {
    ($($name:ident ($($a:ident : $t:ty),*) => $every_time:expr;)*) => { $(
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($a: $t),*) -> CUresult {
            $(let _ = $a;)*
            entry(stringify!($name), || refuse(stringify!($name), $every_time))
        }
    )* };
}

refused! {
    cuMemAllocManaged(dptr: *mut DevPtr, bytesize: usize, flags: c_uint) => true;
    cuMemPrefetchAsync(dev_ptr: DevPtr, count: usize, dst_device: c_int, stream: Handle) => false;
    cuMemPrefetchAsync_ptsz(dev_ptr: DevPtr, count: usize, dst_device: c_int, stream: Handle) => false;
    cuMemPrefetchAsync_v2(dev_ptr: DevPtr, count: usize, location: MemLocation, flags: c_uint, stream: Handle) => false;
    cuMemPrefetchAsync_v2_ptsz(dev_ptr: DevPtr, count: usize, location: MemLocation, flags: c_uint, stream: Handle) => false;
    cuMemPrefetchBatchAsync(dptrs: *mut DevPtr, sizes: *mut usize, count: usize, locations: *mut MemLocation, location_idxs: *mut usize, num_locations: usize, flags: c_ulonglong, stream: Handle) => false;
    cuMemPrefetchBatchAsync_ptsz(dptrs: *mut DevPtr, sizes: *mut usize, count: usize, locations: *mut MemLocation, location_idxs: *mut usize, num_locations: usize, flags: c_ulonglong, stream: Handle) => false;
    cuMemAdvise(dev_ptr: DevPtr, count: usize, advice: c_int, device: c_int) => false;
    cuMemAdvise_v2(dev_ptr: DevPtr, count: usize, advice: c_int, location: MemLocation) => false;
}
