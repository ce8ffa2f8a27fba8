//! The node parameter structs of explicit CUDA graphs (`cuGraphAdd*Node`, `cuGraphAddNode`),
//! as CUDA 13.0's `cuda.h` lays them out on 64-bit platforms.

use std::ffi::{c_int, c_uint, c_void};

use crate::pools::{ALLOCATION_TYPE_PINNED, MemPoolProps};
use crate::{MemAccessDesc, MemLocation, Memcpy3D};

/// `CUDA_KERNEL_NODE_PARAMS_v1`: the ABI of `cuGraphAddKernelNode` and its getters without
/// `_v2`. 56 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct KernelNodeParamsV1 {
    pub func: *mut c_void,
    pub grid_dim: [c_uint; 3],
    pub block_dim: [c_uint; 3],
    pub shared_mem_bytes: c_uint,
    pub kernel_params: *mut *mut c_void,
    pub extra: *mut *mut c_void,
}

/// `CUDA_KERNEL_NODE_PARAMS` (`_v2`, also `_v3` inside `CUgraphNodeParams`): a function or a
/// kernel, and the context of a kernel. 72 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct KernelNodeParams {
    /// The `_v1` fields, which come first.
    pub params: KernelNodeParamsV1,
    pub kern: *mut c_void,
    pub ctx: *mut c_void,
}

/// `CUDA_MEMSET_NODE_PARAMS` (`_v1`): 40 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct MemsetNodeParams {
    pub dst: u64,
    pub pitch: usize,
    pub value: c_uint,
    pub element_size: c_uint,
    pub width: usize,
    pub height: usize,
}

/// `CUDA_MEMSET_NODE_PARAMS_v2`: the memset and its context. 48 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct MemsetNodeParamsV2 {
    pub params: MemsetNodeParams,
    pub ctx: *mut c_void,
}

/// `CUDA_HOST_NODE_PARAMS` (`_v1` and `_v2` alike): 16 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct HostNodeParams {
    pub func: Option<unsafe extern "C" fn(*mut c_void)>,
    pub user_data: *mut c_void,
}

/// `CUDA_MEMCPY_NODE_PARAMS`: 216 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct MemcpyNodeParams {
    pub flags: c_int,
    pub reserved: c_int,
    pub copy_ctx: *mut c_void,
    pub copy: Memcpy3D,
}

/// `CUDA_CHILD_GRAPH_NODE_PARAMS`: the graph and its ownership (CUDA 12.9+). 16 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct ChildGraphNodeParams {
    pub graph: *mut c_void,
    pub ownership: c_int,
}

/// `CUDA_EVENT_RECORD_NODE_PARAMS` / `CUDA_EVENT_WAIT_NODE_PARAMS`: 8 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct EventNodeParams {
    pub event: *mut c_void,
}

/// `CUDA_MEM_ALLOC_NODE_PARAMS` (`_v1` and `_v2` alike): the pool properties of the
/// allocation, the access others get, its size, and the address the driver answers. 120
/// bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct MemAllocNodeParams {
    pub pool_props: MemPoolProps,
    pub access_descs: *const MemAccessDesc,
    pub access_desc_count: usize,
    pub bytesize: usize,
    pub dptr: u64,
}

impl MemAllocNodeParams {
    /// An allocation of `bytesize` bytes of pinned memory at `location`, at `dptr` (0 when
    /// the driver is to answer it), with the access `access` gives others. The struct points
    /// into `access`, which must outlive its use.
    pub fn pinned(
        location: MemLocation,
        access: &[MemAccessDesc],
        bytesize: usize,
        dptr: u64,
    ) -> Self {
        Self {
            pool_props: MemPoolProps {
                alloc_type: ALLOCATION_TYPE_PINNED,
                location,
                ..MemPoolProps::default()
            },
            access_descs: if access.is_empty() {
                std::ptr::null()
            } else {
                access.as_ptr()
            },
            access_desc_count: access.len(),
            bytesize,
            dptr,
        }
    }
}

/// The union inside `CUgraphNodeParams` (232 bytes), for the node types Remora carries.
#[repr(C)]
#[derive(Clone, Copy)]
#[allow(missing_docs)]
pub union GraphNodeUnion {
    pub reserved1: [i64; 29],
    pub kernel: KernelNodeParams,
    pub memcpy: MemcpyNodeParams,
    pub memset: MemsetNodeParamsV2,
    pub host: HostNodeParams,
    pub graph: ChildGraphNodeParams,
    pub event: EventNodeParams,
    pub alloc: MemAllocNodeParams,
    /// `CUDA_MEM_FREE_NODE_PARAMS`: the address to free.
    pub free: u64,
}

/// `CUgraphNodeParams`: the node type, then its parameters. 256 bytes.
#[repr(C)]
#[derive(Clone, Copy)]
#[allow(missing_docs)]
pub struct GraphNodeParams {
    pub kind: c_int,
    pub reserved0: [c_int; 3],
    pub u: GraphNodeUnion,
    pub reserved2: i64,
}

/// `CUgraphExecUpdateResultInfo`: 24 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct ExecUpdateResultInfo {
    pub result: c_int,
    pub error_node: *mut c_void,
    pub error_from_node: *mut c_void,
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::mem::{offset_of, size_of};

    #[test]
    fn layouts_match_cuda_h_13_0() {
        assert_eq!(size_of::<KernelNodeParamsV1>(), 56);
        assert_eq!(offset_of!(KernelNodeParamsV1, kernel_params), 40);
        assert_eq!(size_of::<KernelNodeParams>(), 72);
        assert_eq!(offset_of!(KernelNodeParams, params.kernel_params), 40);
        assert_eq!(offset_of!(KernelNodeParams, kern), 56);
        assert_eq!(offset_of!(KernelNodeParams, ctx), 64);
        assert_eq!(size_of::<MemsetNodeParams>(), 40);
        assert_eq!(offset_of!(MemsetNodeParams, value), 16);
        assert_eq!(offset_of!(MemsetNodeParams, width), 24);
        assert_eq!(size_of::<MemsetNodeParamsV2>(), 48);
        assert_eq!(size_of::<HostNodeParams>(), 16);
        assert_eq!(size_of::<MemcpyNodeParams>(), 216);
        assert_eq!(offset_of!(MemcpyNodeParams, copy), 16);
        assert_eq!(size_of::<ChildGraphNodeParams>(), 16);
        assert_eq!(size_of::<GraphNodeUnion>(), 232);
        assert_eq!(size_of::<GraphNodeParams>(), 256);
        assert_eq!(offset_of!(GraphNodeParams, u), 16);
        assert_eq!(offset_of!(GraphNodeParams, reserved2), 248);
        assert_eq!(size_of::<ExecUpdateResultInfo>(), 24);
        assert_eq!(size_of::<MemAllocNodeParams>(), 120);
        assert_eq!(offset_of!(MemAllocNodeParams, access_descs), 88);
        assert_eq!(offset_of!(MemAllocNodeParams, bytesize), 104);
        assert_eq!(offset_of!(MemAllocNodeParams, dptr), 112);
    }
}
