//! The real driver's entry points: the table resolved through `cuGetProcAddress_v2`, the
//! `call!` macro that calls one (or answers cu::NOT_SUPPORTED), result names, and [`Driver`], the
//! loaded library with the per-thread current-context cache.

use std::cell::Cell;
use std::ffi::CString;
use std::ffi::{CStr, c_char, c_int, c_uint, c_void};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use libloading::Library;

use remora_proto::cuda::{CuError, CuResult, cu};

use super::abi::{LaunchConfig, MemAccessDesc, MemAllocationProp, MemLocation, Memcpy2D, Memcpy3D};
use remora_cuda_abi::graphs::{
    ExecUpdateResultInfo, HostNodeParams, KernelNodeParams, MemAllocNodeParams, MemsetNodeParams,
};
use remora_cuda_abi::pools::MemPoolProps;

pub(super) type Ptr = *mut c_void;
pub(super) type Res = c_int;

/// The CUDA version whose entry-point ABI is requested from `cuGetProcAddress`.
pub(super) const CUDA_VERSION: c_int = 13000;
/// Entry points whose newest ABI at [`CUDA_VERSION`] differs from the prototype `cuda.h`
/// declares under the plain name, requested at an older version instead.
///
/// `cuCtxSynchronize` at 13000 is `cuCtxSynchronize_v2(CUcontext)` (`PFN_cuCtxSynchronize_v13000`
/// in cudaTypedefs.h), while the table calls the `(void)` form: called without its argument,
/// the driver read a garbage context and answered `CUDA_ERROR_CONTEXT_IS_DESTROYED` (709) to
/// every context synchronize of the first GPU run.
pub(super) const PINNED_VERSIONS: &[(&str, c_int)] = &[("cuCtxSynchronize", 12000)];
/// `CU_GET_PROC_ADDRESS_LEGACY_STREAM`: the legacy default-stream forms, never `_ptds`.
pub(super) const PROC_ADDRESS_LEGACY_STREAM: u64 = 1;

/// The version at which `name` is requested from `cuGetProcAddress`.
pub(super) fn requested_version(name: &str) -> c_int {
    PINNED_VERSIONS
        .iter()
        .find(|(n, _)| *n == name)
        .map_or(CUDA_VERSION, |&(_, v)| v)
}
/// `CU_EVENT_DISABLE_TIMING`.
pub(super) const EVENT_DISABLE_TIMING: c_uint = 2;
/// `CUDA_ERROR_INVALID_VALUE` as cuFuncGetParamInfo returns it past the last parameter.
pub(super) const PARAM_INFO_END: Res = 1;

macro_rules! driver_table {
    ($($field:ident = $name:literal / $fallback:literal : fn($($arg:ty),*);)*) => {
        /// Entry points of the real driver; `None` where the driver lacks one.
        #[derive(Default)]
        pub(super) struct Table {
            $(pub(super) $field: Option<unsafe extern "C" fn($($arg),*) -> Res>,)*
        }

        impl Table {
            pub(super) fn resolve(mut lookup: impl FnMut(&str, &str) -> Option<Ptr>) -> Self {
                Self {
                    $($field: lookup($name, $fallback).map(|p| {
                        // SAFETY: `p` is the driver's entry point for `$name` at CUDA 13.0
                        // (or the versioned symbol `$fallback`), whose C prototype in cuda.h
                        // 13.0 is exactly the declared signature; function and data pointers
                        // have the same size on every platform CUDA supports.
                        unsafe { std::mem::transmute::<Ptr, unsafe extern "C" fn($($arg),*) -> Res>(p) }
                    }),)*
                }
            }
        }
    };
}

driver_table! {
    driver_get_version = "cuDriverGetVersion" / "cuDriverGetVersion": fn(*mut c_int);
    device_get_count = "cuDeviceGetCount" / "cuDeviceGetCount": fn(*mut c_int);
    device_get = "cuDeviceGet" / "cuDeviceGet": fn(*mut c_int, c_int);
    device_get_name = "cuDeviceGetName" / "cuDeviceGetName": fn(*mut c_char, c_int, c_int);
    device_total_mem = "cuDeviceTotalMem" / "cuDeviceTotalMem_v2": fn(*mut usize, c_int);
    device_get_uuid = "cuDeviceGetUuid" / "cuDeviceGetUuid_v2": fn(*mut [u8; 16], c_int);
    device_get_pci_bus_id = "cuDeviceGetPCIBusId" / "cuDeviceGetPCIBusId": fn(*mut c_char, c_int, c_int);
    device_get_attribute = "cuDeviceGetAttribute" / "cuDeviceGetAttribute": fn(*mut c_int, c_int, c_int);
    ctx_create = "cuCtxCreate" / "cuCtxCreate_v4": fn(*mut Ptr, Ptr, c_uint, c_int);
    ctx_destroy = "cuCtxDestroy" / "cuCtxDestroy_v2": fn(Ptr);
    ctx_set_current = "cuCtxSetCurrent" / "cuCtxSetCurrent": fn(Ptr);
    ctx_synchronize = "cuCtxSynchronize" / "cuCtxSynchronize": fn();
    ctx_set_limit = "cuCtxSetLimit" / "cuCtxSetLimit": fn(c_int, usize);
    ctx_get_limit = "cuCtxGetLimit" / "cuCtxGetLimit": fn(*mut usize, c_int);
    ctx_get_api_version = "cuCtxGetApiVersion" / "cuCtxGetApiVersion": fn(Ptr, *mut c_uint);
    ctx_get_flags = "cuCtxGetFlags" / "cuCtxGetFlags": fn(*mut c_uint);
    ctx_set_cache_config = "cuCtxSetCacheConfig" / "cuCtxSetCacheConfig": fn(c_int);
    ctx_get_cache_config = "cuCtxGetCacheConfig" / "cuCtxGetCacheConfig": fn(*mut c_int);
    ctx_reset_persisting_l2_cache = "cuCtxResetPersistingL2Cache" / "cuCtxResetPersistingL2Cache": fn();
    stream_get_id = "cuStreamGetId" / "cuStreamGetId": fn(Ptr, *mut u64);
    ctx_get_stream_priority_range = "cuCtxGetStreamPriorityRange" / "cuCtxGetStreamPriorityRange": fn(*mut c_int, *mut c_int);
    mem_alloc = "cuMemAlloc" / "cuMemAlloc_v2": fn(*mut u64, usize);
    mem_alloc_pitch = "cuMemAllocPitch" / "cuMemAllocPitch_v2": fn(*mut u64, *mut usize, usize, usize, c_uint);
    mem_free = "cuMemFree" / "cuMemFree_v2": fn(u64);
    mem_get_info = "cuMemGetInfo" / "cuMemGetInfo_v2": fn(*mut usize, *mut usize);
    mem_create = "cuMemCreate" / "cuMemCreate": fn(*mut u64, usize, *const MemAllocationProp, u64);
    mem_release = "cuMemRelease" / "cuMemRelease": fn(u64);
    mem_address_reserve = "cuMemAddressReserve" / "cuMemAddressReserve": fn(*mut u64, usize, usize, u64, u64);
    mem_address_free = "cuMemAddressFree" / "cuMemAddressFree": fn(u64, usize);
    mem_map = "cuMemMap" / "cuMemMap": fn(u64, usize, usize, u64, u64);
    mem_unmap = "cuMemUnmap" / "cuMemUnmap": fn(u64, usize);
    mem_set_access = "cuMemSetAccess" / "cuMemSetAccess": fn(u64, usize, *const MemAccessDesc, usize);
    mem_get_access = "cuMemGetAccess" / "cuMemGetAccess": fn(*mut u64, *const MemLocation, u64);
    mem_get_allocation_granularity = "cuMemGetAllocationGranularity" / "cuMemGetAllocationGranularity": fn(*mut usize, *const MemAllocationProp, c_int);
    mem_get_allocation_properties_from_handle = "cuMemGetAllocationPropertiesFromHandle" / "cuMemGetAllocationPropertiesFromHandle": fn(*mut MemAllocationProp, u64);
    mem_retain_allocation_handle = "cuMemRetainAllocationHandle" / "cuMemRetainAllocationHandle": fn(*mut u64, Ptr);
    mem_host_register = "cuMemHostRegister" / "cuMemHostRegister_v2": fn(Ptr, usize, c_uint);
    mem_host_unregister = "cuMemHostUnregister" / "cuMemHostUnregister": fn(Ptr);
    mem_host_get_device_pointer = "cuMemHostGetDevicePointer" / "cuMemHostGetDevicePointer_v2": fn(*mut u64, Ptr, c_uint);
    memcpy_htod = "cuMemcpyHtoD" / "cuMemcpyHtoD_v2": fn(u64, *const c_void, usize);
    memcpy_dtoh = "cuMemcpyDtoH" / "cuMemcpyDtoH_v2": fn(Ptr, u64, usize);
    memcpy_dtod = "cuMemcpyDtoD" / "cuMemcpyDtoD_v2": fn(u64, u64, usize);
    memcpy_htod_async = "cuMemcpyHtoDAsync" / "cuMemcpyHtoDAsync_v2": fn(u64, *const c_void, usize, Ptr);
    memcpy_dtoh_async = "cuMemcpyDtoHAsync" / "cuMemcpyDtoHAsync_v2": fn(Ptr, u64, usize, Ptr);
    memcpy_dtod_async = "cuMemcpyDtoDAsync" / "cuMemcpyDtoDAsync_v2": fn(u64, u64, usize, Ptr);
    memcpy_2d = "cuMemcpy2D" / "cuMemcpy2D_v2": fn(*const Memcpy2D);
    memcpy_2d_unaligned = "cuMemcpy2DUnaligned" / "cuMemcpy2DUnaligned_v2": fn(*const Memcpy2D);
    memcpy_2d_async = "cuMemcpy2DAsync" / "cuMemcpy2DAsync_v2": fn(*const Memcpy2D, Ptr);
    memcpy_3d = "cuMemcpy3D" / "cuMemcpy3D_v2": fn(*const Memcpy3D);
    memcpy_3d_async = "cuMemcpy3DAsync" / "cuMemcpy3DAsync_v2": fn(*const Memcpy3D, Ptr);
    memcpy_3d_peer = "cuMemcpy3DPeer" / "cuMemcpy3DPeer": fn(*const Memcpy3D);
    memcpy_3d_peer_async = "cuMemcpy3DPeerAsync" / "cuMemcpy3DPeerAsync": fn(*const Memcpy3D, Ptr);
    memcpy_peer = "cuMemcpyPeer" / "cuMemcpyPeer": fn(u64, Ptr, u64, Ptr, usize);
    memcpy_peer_async = "cuMemcpyPeerAsync" / "cuMemcpyPeerAsync": fn(u64, Ptr, u64, Ptr, usize, Ptr);
    memset_d8 = "cuMemsetD8" / "cuMemsetD8_v2": fn(u64, u8, usize);
    memset_d16 = "cuMemsetD16" / "cuMemsetD16_v2": fn(u64, u16, usize);
    memset_d32 = "cuMemsetD32" / "cuMemsetD32_v2": fn(u64, u32, usize);
    memset_d2d8 = "cuMemsetD2D8" / "cuMemsetD2D8_v2": fn(u64, usize, u8, usize, usize);
    memset_d2d16 = "cuMemsetD2D16" / "cuMemsetD2D16_v2": fn(u64, usize, u16, usize, usize);
    memset_d2d32 = "cuMemsetD2D32" / "cuMemsetD2D32_v2": fn(u64, usize, u32, usize, usize);
    memset_d2d8_async = "cuMemsetD2D8Async" / "cuMemsetD2D8Async": fn(u64, usize, u8, usize, usize, Ptr);
    memset_d2d16_async = "cuMemsetD2D16Async" / "cuMemsetD2D16Async": fn(u64, usize, u16, usize, usize, Ptr);
    memset_d2d32_async = "cuMemsetD2D32Async" / "cuMemsetD2D32Async": fn(u64, usize, u32, usize, usize, Ptr);
    memset_d8_async = "cuMemsetD8Async" / "cuMemsetD8Async": fn(u64, u8, usize, Ptr);
    memset_d16_async = "cuMemsetD16Async" / "cuMemsetD16Async": fn(u64, u16, usize, Ptr);
    memset_d32_async = "cuMemsetD32Async" / "cuMemsetD32Async": fn(u64, u32, usize, Ptr);
    module_load_data = "cuModuleLoadData" / "cuModuleLoadData": fn(*mut Ptr, *const c_void);
    module_unload = "cuModuleUnload" / "cuModuleUnload": fn(Ptr);
    module_get_global = "cuModuleGetGlobal" / "cuModuleGetGlobal_v2": fn(*mut u64, *mut usize, Ptr, *const c_char);
    module_get_function_count = "cuModuleGetFunctionCount" / "cuModuleGetFunctionCount": fn(*mut c_uint, Ptr);
    module_enumerate_functions = "cuModuleEnumerateFunctions" / "cuModuleEnumerateFunctions": fn(*mut Ptr, c_uint, Ptr);
    func_get_name = "cuFuncGetName" / "cuFuncGetName": fn(*mut *const c_char, Ptr);
    func_get_param_info = "cuFuncGetParamInfo" / "cuFuncGetParamInfo": fn(Ptr, usize, *mut usize, *mut usize);
    func_load = "cuFuncLoad" / "cuFuncLoad": fn(Ptr);
    func_get_attribute = "cuFuncGetAttribute" / "cuFuncGetAttribute": fn(*mut c_int, c_int, Ptr);
    func_set_attribute = "cuFuncSetAttribute" / "cuFuncSetAttribute": fn(Ptr, c_int, c_int);
    func_set_cache_config = "cuFuncSetCacheConfig" / "cuFuncSetCacheConfig": fn(Ptr, c_int);
    occupancy = "cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags" / "cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags": fn(*mut c_int, Ptr, c_int, usize, c_uint);
    occupancy_max_active_clusters = "cuOccupancyMaxActiveClusters" / "cuOccupancyMaxActiveClusters": fn(*mut c_int, Ptr, *const LaunchConfig);
    occupancy_max_potential_block_size = "cuOccupancyMaxPotentialBlockSize" / "cuOccupancyMaxPotentialBlockSize": fn(*mut c_int, *mut c_int, Ptr, Ptr, usize, c_int);
    occupancy_max_potential_block_size_with_flags = "cuOccupancyMaxPotentialBlockSizeWithFlags" / "cuOccupancyMaxPotentialBlockSizeWithFlags": fn(*mut c_int, *mut c_int, Ptr, Ptr, usize, c_int, c_uint);
    launch_kernel = "cuLaunchKernel" / "cuLaunchKernel": fn(Ptr, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, c_uint, Ptr, *mut Ptr, *mut Ptr);
    launch_kernel_ex = "cuLaunchKernelEx" / "cuLaunchKernelEx": fn(*const LaunchConfig, Ptr, *mut Ptr, *mut Ptr);
    stream_create = "cuStreamCreateWithPriority" / "cuStreamCreateWithPriority": fn(*mut Ptr, c_uint, c_int);
    stream_destroy = "cuStreamDestroy" / "cuStreamDestroy_v2": fn(Ptr);
    stream_set_attribute = "cuStreamSetAttribute" / "cuStreamSetAttribute": fn(Ptr, c_int, *const [u8; 64]);
    stream_get_attribute = "cuStreamGetAttribute" / "cuStreamGetAttribute": fn(Ptr, c_int, *mut [u8; 64]);
    stream_synchronize = "cuStreamSynchronize" / "cuStreamSynchronize": fn(Ptr);
    stream_query = "cuStreamQuery" / "cuStreamQuery": fn(Ptr);
    stream_write_value64 = "cuStreamWriteValue64" / "cuStreamWriteValue64_v2": fn(Ptr, u64, u64, c_uint);
    launch_host_func = "cuLaunchHostFunc" / "cuLaunchHostFunc": fn(Ptr, Option<unsafe extern "C" fn(*mut c_void)>, *mut c_void);
    stream_wait_event = "cuStreamWaitEvent" / "cuStreamWaitEvent": fn(Ptr, Ptr, c_uint);
    event_create = "cuEventCreate" / "cuEventCreate": fn(*mut Ptr, c_uint);
    event_destroy = "cuEventDestroy" / "cuEventDestroy_v2": fn(Ptr);
    event_record = "cuEventRecord" / "cuEventRecord": fn(Ptr, Ptr);
    event_synchronize = "cuEventSynchronize" / "cuEventSynchronize": fn(Ptr);
    event_query = "cuEventQuery" / "cuEventQuery": fn(Ptr);
    event_elapsed = "cuEventElapsedTime" / "cuEventElapsedTime": fn(*mut f32, Ptr, Ptr);
    stream_begin_capture = "cuStreamBeginCapture" / "cuStreamBeginCapture_v2": fn(Ptr, c_int);
    stream_end_capture = "cuStreamEndCapture" / "cuStreamEndCapture": fn(Ptr, *mut Ptr);
    stream_get_capture_info = "cuStreamGetCaptureInfo" / "cuStreamGetCaptureInfo_v3": fn(Ptr, *mut c_int, *mut u64, *mut Ptr, *mut *const Ptr, *mut *const c_void, *mut usize);
    graph_instantiate = "cuGraphInstantiateWithFlags" / "cuGraphInstantiateWithFlags": fn(*mut Ptr, Ptr, u64);
    graph_launch = "cuGraphLaunch" / "cuGraphLaunch": fn(Ptr, Ptr);
    graph_upload = "cuGraphUpload" / "cuGraphUpload": fn(Ptr, Ptr);
    graph_exec_destroy = "cuGraphExecDestroy" / "cuGraphExecDestroy": fn(Ptr);
    graph_destroy = "cuGraphDestroy" / "cuGraphDestroy": fn(Ptr);
    graph_get_nodes = "cuGraphGetNodes" / "cuGraphGetNodes": fn(Ptr, *mut Ptr, *mut usize);
    get_export_table = "cuGetExportTable" / "cuGetExportTable": fn(*mut *const c_void, *const [u8; 16]);
    // Stream-ordered allocation and memory pools (backend/cuda/pools.rs).
    mem_alloc_async = "cuMemAllocAsync" / "cuMemAllocAsync": fn(*mut u64, usize, Ptr);
    mem_alloc_from_pool_async = "cuMemAllocFromPoolAsync" / "cuMemAllocFromPoolAsync": fn(*mut u64, usize, Ptr, Ptr);
    mem_free_async = "cuMemFreeAsync" / "cuMemFreeAsync": fn(u64, Ptr);
    device_get_default_mem_pool = "cuDeviceGetDefaultMemPool" / "cuDeviceGetDefaultMemPool": fn(*mut Ptr, c_int);
    device_get_mem_pool = "cuDeviceGetMemPool" / "cuDeviceGetMemPool": fn(*mut Ptr, c_int);
    device_set_mem_pool = "cuDeviceSetMemPool" / "cuDeviceSetMemPool": fn(c_int, Ptr);
    mem_pool_create = "cuMemPoolCreate" / "cuMemPoolCreate": fn(*mut Ptr, *const MemPoolProps);
    mem_pool_destroy = "cuMemPoolDestroy" / "cuMemPoolDestroy": fn(Ptr);
    mem_pool_set_attribute = "cuMemPoolSetAttribute" / "cuMemPoolSetAttribute": fn(Ptr, c_int, *mut c_void);
    mem_pool_get_attribute = "cuMemPoolGetAttribute" / "cuMemPoolGetAttribute": fn(Ptr, c_int, *mut c_void);
    mem_pool_trim_to = "cuMemPoolTrimTo" / "cuMemPoolTrimTo": fn(Ptr, usize);
    mem_pool_set_access = "cuMemPoolSetAccess" / "cuMemPoolSetAccess": fn(Ptr, *const MemAccessDesc, usize);
    mem_pool_get_access = "cuMemPoolGetAccess" / "cuMemPoolGetAccess": fn(*mut c_int, Ptr, *mut MemLocation);
    // Explicit graphs (backend/cuda/graphs.rs); the _v2 forms where CUDA 13.0 names them so.
    graph_create = "cuGraphCreate" / "cuGraphCreate": fn(*mut Ptr, c_uint);
    graph_add_kernel_node = "cuGraphAddKernelNode" / "cuGraphAddKernelNode_v2": fn(*mut Ptr, Ptr, *const Ptr, usize, *const KernelNodeParams);
    graph_add_memset_node = "cuGraphAddMemsetNode" / "cuGraphAddMemsetNode": fn(*mut Ptr, Ptr, *const Ptr, usize, *const MemsetNodeParams, Ptr);
    graph_add_memcpy_node = "cuGraphAddMemcpyNode" / "cuGraphAddMemcpyNode": fn(*mut Ptr, Ptr, *const Ptr, usize, *const Memcpy3D, Ptr);
    graph_add_host_node = "cuGraphAddHostNode" / "cuGraphAddHostNode": fn(*mut Ptr, Ptr, *const Ptr, usize, *const HostNodeParams);
    graph_add_child_graph_node = "cuGraphAddChildGraphNode" / "cuGraphAddChildGraphNode": fn(*mut Ptr, Ptr, *const Ptr, usize, Ptr);
    graph_add_empty_node = "cuGraphAddEmptyNode" / "cuGraphAddEmptyNode": fn(*mut Ptr, Ptr, *const Ptr, usize);
    graph_add_event_record_node = "cuGraphAddEventRecordNode" / "cuGraphAddEventRecordNode": fn(*mut Ptr, Ptr, *const Ptr, usize, Ptr);
    graph_add_event_wait_node = "cuGraphAddEventWaitNode" / "cuGraphAddEventWaitNode": fn(*mut Ptr, Ptr, *const Ptr, usize, Ptr);
    graph_destroy_node = "cuGraphDestroyNode" / "cuGraphDestroyNode": fn(Ptr);
    graph_add_dependencies = "cuGraphAddDependencies" / "cuGraphAddDependencies_v2": fn(Ptr, *const Ptr, *const Ptr, *const c_void, usize);
    graph_remove_dependencies = "cuGraphRemoveDependencies" / "cuGraphRemoveDependencies_v2": fn(Ptr, *const Ptr, *const Ptr, *const c_void, usize);
    graph_get_root_nodes = "cuGraphGetRootNodes" / "cuGraphGetRootNodes": fn(Ptr, *mut Ptr, *mut usize);
    graph_get_edges = "cuGraphGetEdges" / "cuGraphGetEdges_v2": fn(Ptr, *mut Ptr, *mut Ptr, *mut c_void, *mut usize);
    graph_node_get_type = "cuGraphNodeGetType" / "cuGraphNodeGetType": fn(Ptr, *mut c_int);
    graph_node_get_dependencies = "cuGraphNodeGetDependencies" / "cuGraphNodeGetDependencies_v2": fn(Ptr, *mut Ptr, *mut c_void, *mut usize);
    graph_node_get_dependent_nodes = "cuGraphNodeGetDependentNodes" / "cuGraphNodeGetDependentNodes_v2": fn(Ptr, *mut Ptr, *mut c_void, *mut usize);
    graph_kernel_node_get_params = "cuGraphKernelNodeGetParams" / "cuGraphKernelNodeGetParams_v2": fn(Ptr, *mut KernelNodeParams);
    graph_kernel_node_set_params = "cuGraphKernelNodeSetParams" / "cuGraphKernelNodeSetParams_v2": fn(Ptr, *const KernelNodeParams);
    graph_memset_node_get_params = "cuGraphMemsetNodeGetParams" / "cuGraphMemsetNodeGetParams": fn(Ptr, *mut MemsetNodeParams);
    graph_memset_node_set_params = "cuGraphMemsetNodeSetParams" / "cuGraphMemsetNodeSetParams": fn(Ptr, *const MemsetNodeParams);
    graph_memcpy_node_get_params = "cuGraphMemcpyNodeGetParams" / "cuGraphMemcpyNodeGetParams": fn(Ptr, *mut Memcpy3D);
    graph_memcpy_node_set_params = "cuGraphMemcpyNodeSetParams" / "cuGraphMemcpyNodeSetParams": fn(Ptr, *const Memcpy3D);
    graph_clone = "cuGraphClone" / "cuGraphClone": fn(*mut Ptr, Ptr);
    graph_exec_kernel_node_set_params = "cuGraphExecKernelNodeSetParams" / "cuGraphExecKernelNodeSetParams_v2": fn(Ptr, Ptr, *const KernelNodeParams);
    graph_exec_memset_node_set_params = "cuGraphExecMemsetNodeSetParams" / "cuGraphExecMemsetNodeSetParams": fn(Ptr, Ptr, *const MemsetNodeParams, Ptr);
    graph_exec_memcpy_node_set_params = "cuGraphExecMemcpyNodeSetParams" / "cuGraphExecMemcpyNodeSetParams": fn(Ptr, Ptr, *const Memcpy3D, Ptr);
    graph_exec_update = "cuGraphExecUpdate" / "cuGraphExecUpdate_v2": fn(Ptr, Ptr, *mut ExecUpdateResultInfo);
    // Graph memory nodes (revision 12).
    graph_add_mem_alloc_node = "cuGraphAddMemAllocNode" / "cuGraphAddMemAllocNode": fn(*mut Ptr, Ptr, *const Ptr, usize, *mut MemAllocNodeParams);
    graph_add_mem_free_node = "cuGraphAddMemFreeNode" / "cuGraphAddMemFreeNode": fn(*mut Ptr, Ptr, *const Ptr, usize, u64);
    graph_mem_alloc_node_get_params = "cuGraphMemAllocNodeGetParams" / "cuGraphMemAllocNodeGetParams": fn(Ptr, *mut MemAllocNodeParams);
    graph_mem_free_node_get_params = "cuGraphMemFreeNodeGetParams" / "cuGraphMemFreeNodeGetParams": fn(Ptr, *mut u64);
    device_graph_mem_trim = "cuDeviceGraphMemTrim" / "cuDeviceGraphMemTrim": fn(c_int);
    device_get_graph_mem_attribute = "cuDeviceGetGraphMemAttribute" / "cuDeviceGetGraphMemAttribute": fn(c_int, c_int, *mut c_void);
    device_set_graph_mem_attribute = "cuDeviceSetGraphMemAttribute" / "cuDeviceSetGraphMemAttribute": fn(c_int, c_int, *mut c_void);
}

/// Calls a driver entry point, or answers cu::NOT_SUPPORTED when the driver lacks it.
macro_rules! call {
    ($t:expr, $field:ident ( $($arg:expr),* )) => {
        match $t.$field {
            Some(f) => {
                // SAFETY: `f` has the cuda.h 13.0 prototype of this entry point (see
                // Table::resolve); the arguments follow its contract: every call site's
                // SAFETY note says which pointers it passes and what they point to.
                let rc = unsafe { f($($arg),*) };
                if rc != remora_proto::cuda::cu::SUCCESS {
                    $crate::backend::cuda::driver::log_failure(stringify!($field), rc);
                }
                $crate::backend::cuda::driver::check(rc)
            }
            None => {
                tracing::warn!(entry_point = stringify!($field), "the CUDA driver lacks this entry point: CUDA_ERROR_NOT_SUPPORTED");
                Err(remora_proto::cuda::CuError(remora_proto::cuda::cu::NOT_SUPPORTED))
            }
        }
    };
}

/// Logs a failed driver call with the entry point and the CUresult (debug level; `cu::NOT_READY`
/// from queries at trace level, as it is the normal answer while work is pending).
pub(super) fn log_failure(entry_point: &str, rc: Res) {
    if rc == cu::NOT_READY || (rc == PARAM_INFO_END && entry_point == "func_get_param_info") {
        tracing::trace!(
            entry_point,
            result = rc,
            "CUDA driver call returned non-success"
        );
    } else {
        tracing::debug!(
            entry_point,
            result = rc,
            name = result_name(rc),
            "CUDA driver call failed"
        );
    }
}

/// The `CUresult` name of the codes the executor meets most, for logs.
pub(crate) fn result_name(rc: Res) -> &'static str {
    match rc {
        0 => "CUDA_SUCCESS",
        1 => "CUDA_ERROR_INVALID_VALUE",
        2 => "CUDA_ERROR_OUT_OF_MEMORY",
        3 => "CUDA_ERROR_NOT_INITIALIZED",
        100 => "CUDA_ERROR_NO_DEVICE",
        101 => "CUDA_ERROR_INVALID_DEVICE",
        200 => "CUDA_ERROR_INVALID_IMAGE",
        201 => "CUDA_ERROR_INVALID_CONTEXT",
        209 => "CUDA_ERROR_NO_BINARY_FOR_GPU",
        214 => "CUDA_ERROR_ECC_UNCORRECTABLE",
        215 => "CUDA_ERROR_UNSUPPORTED_LIMIT",
        218 => "CUDA_ERROR_INVALID_PTX",
        400 => "CUDA_ERROR_INVALID_HANDLE",
        500 => "CUDA_ERROR_NOT_FOUND",
        600 => "CUDA_ERROR_NOT_READY",
        700 => "CUDA_ERROR_ILLEGAL_ADDRESS",
        701 => "CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
        702 => "CUDA_ERROR_LAUNCH_TIMEOUT",
        709 => "CUDA_ERROR_CONTEXT_IS_DESTROYED",
        710 => "CUDA_ERROR_ASSERT",
        715 => "CUDA_ERROR_ILLEGAL_INSTRUCTION",
        719 => "CUDA_ERROR_LAUNCH_FAILED",
        720 => "CUDA_ERROR_COOPERATIVE_LAUNCH_TOO_LARGE",
        801 => "CUDA_ERROR_NOT_SUPPORTED",
        912 => "CUDA_ERROR_INVALID_CLUSTER_SIZE",
        913 => "CUDA_ERROR_FUNCTION_NOT_LOADED",
        999 => "CUDA_ERROR_UNKNOWN",
        _ => "CUresult",
    }
}

pub(super) fn check(rc: Res) -> CuResult<()> {
    CuError::check(rc)
}

/// The host function the driver calls for [`Backend::launch_host_func`]: runs the boxed
/// closure, never unwinding into the driver.
pub(super) unsafe extern "C" fn run_host_fn(data: *mut c_void) {
    // SAFETY: `data` is the `Box<HostFn>` leaked by `launch_host_func`; the driver calls each
    // host function once, so the box is taken back once.
    let f = unsafe { Box::from_raw(data.cast::<super::super::HostFn>()) };
    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(f)).is_err() {
        tracing::error!("a host function panicked on the driver's thread");
    }
}

pub(super) fn ptr(v: u64) -> Ptr {
    v as usize as Ptr
}

/// The real driver library, opened once per process ([`open`]): `cuInit` has succeeded and
/// every entry point is resolved.
pub(crate) struct Loaded {
    pub(super) t: Table,
    /// Keeps the entry points valid.
    _lib: Library,
}

// SAFETY: the table holds plain function pointers into the driver, which is thread-safe
// (CUDA driver entry points may be called from any thread); the Library is only kept alive.
unsafe impl Send for Loaded {}
// SAFETY: as above; nothing in Loaded is mutated after construction.
unsafe impl Sync for Loaded {}

/// Why the driver could not be opened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) enum LoadError {
    /// The library could not be loaded.
    NotFound(String),
    /// The library loaded but is not a usable CUDA driver (`cuInit` missing or failing).
    InitFailed(String),
}

type GetProcAddress = unsafe extern "C" fn(*const c_char, *mut Ptr, c_int, u64, *mut c_int) -> Res;

/// Opens the CUDA driver at `path`, calls `cuInit(0)` and resolves the entry-point table through
/// `cuGetProcAddress_v2` for CUDA 13.0 (falling back to `dlsym` of the versioned name). Once
/// per process: later calls for the same path share the first successful load (the HELLO
/// inventory and the backend use one). Never panics.
pub(crate) fn open(path: &str) -> Result<Arc<Loaded>, LoadError> {
    static OPENED: Mutex<Vec<(String, Arc<Loaded>)>> = Mutex::new(Vec::new());
    let mut opened = OPENED.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some((_, l)) = opened.iter().find(|(p, _)| p == path) {
        return Ok(Arc::clone(l));
    }
    let loaded = Arc::new(open_uncached(path)?);
    opened.push((path.to_owned(), Arc::clone(&loaded)));
    Ok(loaded)
}

fn open_uncached(path: &str) -> Result<Loaded, LoadError> {
    // SAFETY: loading a shared library runs its initialisers. The path names NVIDIA's CUDA
    // driver (or an operator-chosen replacement via REMORA_REAL_LIBCUDA); its initialisers
    // are designed to run in any process that loads it.
    let lib = unsafe { Library::new(path) }.map_err(|e| {
        let mut detail = e.to_string();
        let mut source = std::error::Error::source(&e);
        while let Some(s) = source {
            detail = format!("{detail}: {s}");
            source = s.source();
        }
        LoadError::NotFound(format!(
            "could not load the CUDA driver {path} ({detail}). Install the NVIDIA driver, \
             or set REMORA_REAL_LIBCUDA to its path"
        ))
    })?;
    // SAFETY: cuInit has the prototype CUresult cuInit(unsigned int).
    let init = unsafe { lib.get::<unsafe extern "C" fn(c_uint) -> Res>(b"cuInit\0") }
        .map(|s| *s)
        .map_err(|e| LoadError::InitFailed(format!("the CUDA driver {path} lacks cuInit ({e})")))?;
    // SAFETY: cuGetProcAddress_v2 has the prototype declared by GetProcAddress (cuda.h 13.0).
    let gpa = unsafe { lib.get::<GetProcAddress>(b"cuGetProcAddress_v2\0") }
        .map(|s| *s)
        .ok();
    // SAFETY: cuInit(0) takes no pointers.
    need("cuInit", CuError::check(unsafe { init(0) })).map_err(LoadError::InitFailed)?;
    let t = Table::resolve(|name, fallback| {
        let cname = CString::new(name).ok()?;
        if let Some(gpa) = gpa {
            let mut f: Ptr = std::ptr::null_mut();
            let mut status: c_int = 0;
            // SAFETY: `cname` is NUL-terminated; the driver writes one pointer to `f` and
            // one int to `status`.
            let rc = unsafe {
                gpa(
                    cname.as_ptr(),
                    &mut f,
                    requested_version(name),
                    PROC_ADDRESS_LEGACY_STREAM,
                    &mut status,
                )
            };
            if rc == cu::SUCCESS && !f.is_null() {
                return Some(f);
            }
        }
        let sym = format!("{fallback}\0");
        // SAFETY: the symbol is only read as an address here; its type is fixed by the table.
        unsafe { lib.get::<Ptr>(sym.as_bytes()) }
            .ok()
            .map(|s| *s)
            .filter(|p| !p.is_null())
    });
    Ok(Loaded { t, _lib: lib })
}

/// A failed driver call as a reason string: `"{what} failed with CUDA error 100
/// (CUDA_ERROR_NO_DEVICE)"`.
pub(crate) fn need<T>(what: &str, r: CuResult<T>) -> Result<T, String> {
    r.map_err(|e| {
        let label = remora_proto::cuda::cu_result_name(e.0).unwrap_or("unknown error");
        format!("{what} failed with CUDA error {} ({label})", e.0)
    })
}

impl Loaded {
    /// `cuDriverGetVersion`.
    pub(crate) fn driver_version(&self) -> CuResult<i32> {
        let mut v = 0;
        // SAFETY: writes one int.
        call!(self.t, driver_get_version(&mut v))?;
        Ok(v)
    }

    /// `cuDeviceGetCount`.
    pub(crate) fn device_count(&self) -> CuResult<i32> {
        let mut v = 0;
        // SAFETY: writes one int.
        call!(self.t, device_get_count(&mut v))?;
        Ok(v)
    }

    /// `cuDeviceGet`: the driver's CUdevice of a real ordinal.
    pub(crate) fn device(&self, ordinal: i32) -> CuResult<c_int> {
        let mut d: c_int = 0;
        // SAFETY: cuDeviceGet writes one CUdevice.
        call!(self.t, device_get(&mut d, ordinal))?;
        Ok(d)
    }

    /// `cuDeviceTotalMem`.
    pub(crate) fn total_mem(&self, dev: c_int) -> CuResult<u64> {
        let mut total: usize = 0;
        // SAFETY: writes one size_t.
        call!(self.t, device_total_mem(&mut total, dev))?;
        Ok(total as u64)
    }

    /// `cuDeviceGetUuid`.
    pub(crate) fn uuid(&self, dev: c_int) -> CuResult<[u8; 16]> {
        let mut uuid = [0u8; 16];
        // SAFETY: CUuuid is 16 bytes; the driver writes exactly that.
        call!(self.t, device_get_uuid(&mut uuid, dev))?;
        Ok(uuid)
    }

    /// `cuDeviceGetAttribute`.
    pub(crate) fn attribute(&self, attr: c_int, dev: c_int) -> CuResult<c_int> {
        let mut v: c_int = 0;
        // SAFETY: writes one int; unknown attributes fail with INVALID_VALUE.
        call!(self.t, device_get_attribute(&mut v, attr, dev))?;
        Ok(v)
    }

    /// `cuDeviceGetName`.
    pub(crate) fn name(&self, dev: c_int) -> CuResult<String> {
        self.string(self.t.device_get_name, dev)
    }

    /// `cuDeviceGetPCIBusId`.
    pub(crate) fn pci_bus_id(&self, dev: c_int) -> CuResult<String> {
        self.string(self.t.device_get_pci_bus_id, dev)
    }

    fn string(
        &self,
        f: Option<unsafe extern "C" fn(*mut c_char, c_int, c_int) -> Res>,
        dev: c_int,
    ) -> CuResult<String> {
        let f = f.ok_or(CuError(cu::NOT_SUPPORTED))?;
        let mut buf = [0 as c_char; 256];
        // SAFETY: the driver writes at most `len` bytes, NUL-terminated, into `buf`.
        CuError::check(unsafe { f(buf.as_mut_ptr(), buf.len() as c_int, dev) })?;
        buf[255] = 0;
        // SAFETY: `buf` is NUL-terminated (forced above) and outlives the borrow.
        Ok(unsafe { CStr::from_ptr(buf.as_ptr()) }
            .to_string_lossy()
            .into_owned())
    }
}

/// The loaded driver and the devices a backend exposes.
pub(super) struct Driver {
    pub(super) lib: Arc<Loaded>,
    /// Visible ordinal → the driver's CUdevice.
    pub(super) devices: Vec<c_int>,
}

impl std::ops::Deref for Driver {
    type Target = Loaded;
    fn deref(&self) -> &Loaded {
        &self.lib
    }
}

/// Bumped whenever a context is destroyed, so threads re-make theirs current.
pub(super) static CTX_GENERATION: AtomicU64 = AtomicU64::new(0);

thread_local! {
    /// Scratch buffers of [`launch_with`] (parameter copy, kernelParams array).
    pub(super) static LAUNCH_BUFFERS: std::cell::RefCell<(Vec<u64>, Vec<Ptr>)> =
        const { std::cell::RefCell::new((Vec::new(), Vec::new())) };
    /// The context this thread made current, and the generation it was made in.
    pub(super) static CURRENT: Cell<(u64, u64)> = const { Cell::new((0, u64::MAX)) };
}

impl Driver {
    /// Makes `ctx` current on this thread unless it already is.
    pub(super) fn enter(&self, ctx: u64) -> CuResult<()> {
        let generation = CTX_GENERATION.load(Ordering::Acquire);
        if CURRENT.with(Cell::get) == (ctx, generation) {
            return Ok(());
        }
        // SAFETY: cuCtxSetCurrent takes a context value the driver gave us.
        call!(self.t, ctx_set_current(ptr(ctx)))?;
        CURRENT.with(|c| c.set((ctx, generation)));
        Ok(())
    }

    pub(super) fn dev(&self, ordinal: i32) -> CuResult<c_int> {
        usize::try_from(ordinal)
            .ok()
            .and_then(|i| self.devices.get(i).copied())
            .ok_or(CuError(cu::INVALID_DEVICE))
    }
}
