//! The CUDA ABI descriptors the server hands the real driver, built from a validated copy
//! (the layouts themselves are `remora_cuda_abi`'s, shared with the shim).

use std::ffi::{c_uint, c_void};

pub(super) use remora_cuda_abi::{
    LaunchAttribute, LaunchConfig, MemAccessDesc, MemAllocationProp, MemLocation, Memcpy2D,
    Memcpy3D,
};
use remora_cuda_abi::{MEMORYTYPE_DEVICE, MEMORYTYPE_HOST, MemcpySide};

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
    let (src, dst) = sides(c, src_host, dst_host);
    Memcpy2D::between(src, dst, c.width as usize, c.height as usize)
}

/// The two sides of `c`'s `CUDA_MEMCPY2D`/`3D`: a host side is `src_host` or `dst_host` (the
/// packed buffer); a peer copy's sides name their contexts.
fn sides(c: &Copy3d, src_host: *const c_void, dst_host: Ptr) -> (MemcpySide, MemcpySide) {
    let side = |side: &CopySide, host: Ptr| {
        let (memory_type, device) = side_kind(side);
        MemcpySide {
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
    };
    (side(&c.src, src_host.cast_mut()), side(&c.dst, dst_host))
}

/// The `CUDA_MEMCPY3D` of `c`; the contexts are set for a peer copy, else NULL
/// (`reserved0/1`).
pub(super) fn memcpy_3d(c: &Copy3d, src_host: *const c_void, dst_host: Ptr) -> Memcpy3D {
    let (src, dst) = sides(c, src_host, dst_host);
    Memcpy3D::between(
        src,
        dst,
        c.width as usize,
        c.height as usize,
        c.depth as usize,
    )
}
