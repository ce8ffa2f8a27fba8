//! cuGetExportTable (the private tables of [`crate::export_tables`]) and the profiler control
//! entry points of cudaProfiler.h.

use std::ffi::c_void;

use crate::CUresult;
use crate::export_tables::Uuid;
use crate::state::{self, entry};

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetExportTable(table: *mut *const c_void, id: *const Uuid) -> CUresult {
    // SAFETY: the pointers come from the caller under cuda.h's contract.
    entry("cuGetExportTable", || unsafe {
        crate::export_tables::get_export_table(table, id)
    })
}

/// No profiler is ever attached to a Remora client (tools would attach on the server), and
/// NVIDIA's driver answers CUDA_SUCCESS when none is attached: so does Remora, once cuInit has
/// succeeded (before, as NVIDIA's driver, CUDA_ERROR_NOT_INITIALIZED).
#[unsafe(no_mangle)]
pub extern "C" fn cuProfilerStart() -> CUresult {
    entry("cuProfilerStart", || state::session().map(|_| ()))
}

/// See [`cuProfilerStart`].
#[unsafe(no_mangle)]
pub extern "C" fn cuProfilerStop() -> CUresult {
    entry("cuProfilerStop", || state::session().map(|_| ()))
}

/// As NVIDIA's driver: `CUDA_MODULE_LOADING=EAGER` selects eager loading, anything else the
/// default since CUDA 12.2, lazy loading. It only decides when the runtime loads its modules;
/// the server loads every function of a module when the module is loaded.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetLoadingMode(mode: *mut std::ffi::c_int) -> CUresult {
    entry("cuModuleGetLoadingMode", || {
        let eager = std::env::var("CUDA_MODULE_LOADING").is_ok_and(|v| v == "EAGER");
        // SAFETY: output pointer per cuda.h.
        unsafe { state::put(mode, if eager { 1 } else { 2 }) }
    })
}
