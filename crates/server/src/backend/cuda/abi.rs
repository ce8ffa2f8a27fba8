//! The CUDA ABI descriptors the server hands the real driver, built from a validated copy
//! (the layouts themselves are `remora_cuda_abi`'s, shared with the shim).

use std::ffi::{c_uint, c_void};

pub(super) use remora_cuda_abi::{
    LaunchAttribute, LaunchConfig, MemAccessDesc, MemAllocationProp, MemLocation, Memcpy2D,
    Memcpy3D,
};
use remora_cuda_abi::{MEMORYTYPE_DEVICE, MEMORYTYPE_HOST};

use super::super::{Copy3d, CopyPlace, CopySide};
use super::driver::{Ptr, ptr};
use remora_proto::cuda::{CuError, CuResult, cu};
use remora_proto::remora::RmMemProp;

/// `(memory type, device pointer)` of one side; a host side uses the packed buffer.
pub(super) fn side_kind(side: &CopySide) -> (c_uint, u64) {
    match side.place {
        CopyPlace::Device(p) => (MEMORYTYPE_DEVICE, p),
        CopyPlace::Host => (MEMORYTYPE_HOST, 0),
    }
}

/// The `CUDA_MEMCPY2D` of `c`.
pub(super) fn memcpy_2d(c: &Copy3d, src_host: *const c_void, dst_host: Ptr) -> Memcpy2D {
    let (src_memory_type, src_device) = side_kind(&c.src);
    let (dst_memory_type, dst_device) = side_kind(&c.dst);
    Memcpy2D {
        src_x_in_bytes: c.src.x_bytes as usize,
        src_y: c.src.y as usize,
        src_memory_type,
        src_host,
        src_device,
        src_array: std::ptr::null_mut(),
        src_pitch: c.src.pitch as usize,
        dst_x_in_bytes: c.dst.x_bytes as usize,
        dst_y: c.dst.y as usize,
        dst_memory_type,
        dst_host,
        dst_device,
        dst_array: std::ptr::null_mut(),
        dst_pitch: c.dst.pitch as usize,
        width_in_bytes: c.width as usize,
        height: c.height as usize,
    }
}

/// The `CUDA_MEMCPY3D` of `c`; the contexts are set for a peer copy, else NULL
/// (`reserved0/1`).
pub(super) fn memcpy_3d(c: &Copy3d, src_host: *const c_void, dst_host: Ptr) -> Memcpy3D {
    let (src_memory_type, src_device) = side_kind(&c.src);
    let (dst_memory_type, dst_device) = side_kind(&c.dst);
    Memcpy3D {
        src_x_in_bytes: c.src.x_bytes as usize,
        src_y: c.src.y as usize,
        src_z: c.src.z as usize,
        src_lod: 0,
        src_memory_type,
        src_host,
        src_device,
        src_array: std::ptr::null_mut(),
        src_context: ptr(c.src.ctx.unwrap_or(0)),
        src_pitch: c.src.pitch as usize,
        src_height: c.src.height as usize,
        dst_x_in_bytes: c.dst.x_bytes as usize,
        dst_y: c.dst.y as usize,
        dst_z: c.dst.z as usize,
        dst_lod: 0,
        dst_memory_type,
        dst_host,
        dst_device,
        dst_array: std::ptr::null_mut(),
        dst_context: ptr(c.dst.ctx.unwrap_or(0)),
        dst_pitch: c.dst.pitch as usize,
        dst_height: c.dst.height as usize,
        width_in_bytes: c.width as usize,
        height: c.height as usize,
        depth: c.depth as usize,
    }
}

/// The `CUmemAllocationProp` of a wire `rm_mem_prop` (no Windows metadata). Flag fields the
/// ABI holds in a byte or a short are refused with `CUDA_ERROR_INVALID_VALUE` past that width.
pub(super) fn mem_prop(p: &RmMemProp) -> CuResult<MemAllocationProp> {
    let byte = |v: u32| u8::try_from(v).map_err(|_| CuError(cu::INVALID_VALUE));
    Ok(MemAllocationProp {
        kind: p.r#type,
        requested_handle_types: p.handle_types,
        location: MemLocation {
            kind: p.location_type,
            id: p.location_id,
        },
        compression_type: byte(p.compression_type)?,
        gpu_direct_rdma_capable: byte(p.rdma_capable)?,
        usage: u16::try_from(p.usage).map_err(|_| CuError(cu::INVALID_VALUE))?,
        ..MemAllocationProp::default()
    })
}

/// The wire form of a `CUmemAllocationProp` the driver filled in.
pub(super) fn wire_mem_prop(p: &MemAllocationProp) -> RmMemProp {
    RmMemProp {
        r#type: p.kind,
        handle_types: p.requested_handle_types,
        location_type: p.location.kind,
        location_id: p.location.id,
        compression_type: u32::from(p.compression_type),
        rdma_capable: u32::from(p.gpu_direct_rdma_capable),
        usage: u32::from(p.usage),
    }
}
