//! Stream-capture queries. Remora does not support stream capture yet (`cuStreamBeginCapture`
//! and the graph calls fail loudly with `CUDA_ERROR_NOT_SUPPORTED`), so no stream is ever
//! capturing: these queries answer `CU_STREAM_CAPTURE_STATUS_NONE`, which is the truth, after
//! checking the stream handle. Libraries ask before they launch (cuBLASLt does before every
//! GEMM) to decide whether they may synchronize.

use std::ffi::{c_int, c_void};

use remora_client::CuResult;

use super::Handle;
use crate::CUresult;
use crate::state::{self, entry, put};

/// `CU_STREAM_CAPTURE_STATUS_NONE`.
const CAPTURE_NONE: c_int = 0;

/// Checks the stream, then writes "not capturing" to `status` and clears the optional outputs.
fn not_capturing(
    st: Handle,
    ptds: bool,
    status: *mut c_int,
    id: *mut u64,
    graph: *mut Handle,
    deps: *mut *const c_void,
    edges: *mut *const c_void,
    count: *mut usize,
) -> CuResult<()> {
    let s = state::stream_ref(st, ptds)?;
    // A created stream must belong to a live context of this session.
    state::stream_ctx(s)?;
    // SAFETY: output pointers per cuda.h: `status` is required (null rejected by `put`); the
    // others are optional and written only when non-null.
    unsafe {
        put(status, CAPTURE_NONE)?;
        if !id.is_null() {
            id.write_unaligned(0);
        }
        if !graph.is_null() {
            graph.write_unaligned(std::ptr::null_mut());
        }
        if !deps.is_null() {
            deps.write_unaligned(std::ptr::null());
        }
        if !edges.is_null() {
            edges.write_unaligned(std::ptr::null());
        }
        if !count.is_null() {
            count.write_unaligned(0);
        }
    }
    Ok(())
}

macro_rules! is_capturing {
    ($($name:ident ptds=$ptds:expr;)*) => { $(
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(st: Handle, status: *mut c_int) -> CUresult {
            entry(stringify!($name), || {
                use std::ptr::null_mut as n;
                not_capturing(st, $ptds, status, n(), n(), n(), n(), n())
            })
        }
    )* };
}

is_capturing! {
    cuStreamIsCapturing ptds=false;
    cuStreamIsCapturing_ptsz ptds=true;
}

macro_rules! capture_info_v1 {
    ($($name:ident ptds=$ptds:expr;)*) => { $(
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(st: Handle, status: *mut c_int, id: *mut u64) -> CUresult {
            entry(stringify!($name), || {
                use std::ptr::null_mut as n;
                not_capturing(st, $ptds, status, id, n(), n(), n(), n())
            })
        }
    )* };
}

capture_info_v1! {
    cuStreamGetCaptureInfo ptds=false;
    cuStreamGetCaptureInfo_ptsz ptds=true;
}

macro_rules! capture_info_v2 {
    ($($name:ident ptds=$ptds:expr;)*) => { $(
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            st: Handle,
            status: *mut c_int,
            id: *mut u64,
            graph: *mut Handle,
            deps: *mut *const c_void,
            count: *mut usize,
        ) -> CUresult {
            entry(stringify!($name), || {
                not_capturing(st, $ptds, status, id, graph, deps, std::ptr::null_mut(), count)
            })
        }
    )* };
}

capture_info_v2! {
    cuStreamGetCaptureInfo_v2 ptds=false;
    cuStreamGetCaptureInfo_v2_ptsz ptds=true;
}

macro_rules! capture_info_v3 {
    ($($name:ident ptds=$ptds:expr;)*) => { $(
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name(
            st: Handle,
            status: *mut c_int,
            id: *mut u64,
            graph: *mut Handle,
            deps: *mut *const c_void,
            edges: *mut *const c_void,
            count: *mut usize,
        ) -> CUresult {
            entry(stringify!($name), || {
                not_capturing(st, $ptds, status, id, graph, deps, edges, count)
            })
        }
    )* };
}

capture_info_v3! {
    cuStreamGetCaptureInfo_v3 ptds=false;
    cuStreamGetCaptureInfo_v3_ptsz ptds=true;
}
