//! The CUDA ABI descriptors the server hands the real driver, built from a validated copy
//! (the layouts themselves are `remora_cuda_abi`'s, shared with the shim).

use std::ffi::{c_uint, c_void};

pub(super) use remora_cuda_abi::{
    LaunchAttribute, LaunchConfig, MemAccessDesc, MemAllocationProp, MemLocation, Memcpy2D,
    Memcpy3D,
};
use remora_cuda_abi::{MEMORYTYPE_DEVICE, MEMORYTYPE_HOST, Memcpy3DSide};

use super::super::{Copy3d, CopyPlace, CopySide};
use super::driver::{Ptr, ptr};

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

/// One side of `c`'s `CUDA_MEMCPY3D`: `host` for a host side (the packed buffer), the context
/// for a peer copy's side.
fn side_3d(side: &CopySide, host: Ptr) -> Memcpy3DSide {
    let (memory_type, device) = side_kind(side);
    Memcpy3DSide {
        memory_type,
        host,
        device,
        context: ptr(side.ctx.unwrap_or(0)),
        x_in_bytes: side.x_bytes as usize,
        y: side.y as usize,
        z: side.z as usize,
        pitch: side.pitch as usize,
        height: side.height as usize,
    }
}

/// The `CUDA_MEMCPY3D` of `c`; the contexts are set for a peer copy, else NULL
/// (`reserved0/1`).
pub(super) fn memcpy_3d(c: &Copy3d, src_host: *const c_void, dst_host: Ptr) -> Memcpy3D {
    Memcpy3D::between(
        side_3d(&c.src, src_host.cast_mut()),
        side_3d(&c.dst, dst_host),
        c.width as usize,
        c.height as usize,
        c.depth as usize,
    )
}
