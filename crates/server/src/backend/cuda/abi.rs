//! The CUDA ABI structs the server hands the real driver (cuda.h 13.0 layouts).

use std::ffi::{c_uint, c_void};

use super::super::{Copy3d, CopyPlace, CopySide};
use super::driver::{Ptr, ptr};

/// `CUlaunchAttribute` (cuda.h 13.0): a 4-byte id, 4 bytes of padding, a 64-byte value union
/// (8-byte aligned: it holds pointers and 64-bit members). 72 bytes, value at offset 8.
#[repr(C, align(8))]
#[derive(Clone, Copy)]
pub(super) struct LaunchAttribute {
    pub(super) id: c_uint,
    pub(super) pad: [u8; 4],
    pub(super) value: [u32; 16],
}

/// `CUlaunchConfig` (cuda.h 13.0): 56 bytes, `hStream` at 32, `attrs` at 40, `numAttrs` at 48.
#[repr(C)]
pub(super) struct LaunchConfig {
    pub(super) grid: [c_uint; 3],
    pub(super) block: [c_uint; 3],
    pub(super) shared_mem_bytes: c_uint,
    pub(super) stream: Ptr,
    pub(super) attrs: *mut LaunchAttribute,
    pub(super) num_attrs: c_uint,
}

/// `CU_MEMORYTYPE_HOST`.
pub(super) const MEMORYTYPE_HOST: c_uint = 1;
/// `CU_MEMORYTYPE_DEVICE`.
pub(super) const MEMORYTYPE_DEVICE: c_uint = 2;

/// `CUDA_MEMCPY2D` (cuda.h 13.0, `CUDA_MEMCPY2D_v2`): 128 bytes on 64-bit platforms.
#[repr(C)]
pub(super) struct Memcpy2D {
    pub(super) src_x_in_bytes: usize,
    pub(super) src_y: usize,
    pub(super) src_memory_type: c_uint,
    pub(super) src_host: *const c_void,
    pub(super) src_device: u64,
    pub(super) src_array: Ptr,
    pub(super) src_pitch: usize,
    pub(super) dst_x_in_bytes: usize,
    pub(super) dst_y: usize,
    pub(super) dst_memory_type: c_uint,
    pub(super) dst_host: Ptr,
    pub(super) dst_device: u64,
    pub(super) dst_array: Ptr,
    pub(super) dst_pitch: usize,
    pub(super) width_in_bytes: usize,
    pub(super) height: usize,
}

/// `CUDA_MEMCPY3D` (cuda.h 13.0, `CUDA_MEMCPY3D_v2`), which has the layout of
/// `CUDA_MEMCPY3D_PEER` with `reserved0`/`reserved1` (NULL) where the peer form has
/// `srcContext`/`dstContext`: 200 bytes on 64-bit platforms.
#[repr(C)]
pub(super) struct Memcpy3D {
    pub(super) src_x_in_bytes: usize,
    pub(super) src_y: usize,
    pub(super) src_z: usize,
    pub(super) src_lod: usize,
    pub(super) src_memory_type: c_uint,
    pub(super) src_host: *const c_void,
    pub(super) src_device: u64,
    pub(super) src_array: Ptr,
    pub(super) src_context: Ptr,
    pub(super) src_pitch: usize,
    pub(super) src_height: usize,
    pub(super) dst_x_in_bytes: usize,
    pub(super) dst_y: usize,
    pub(super) dst_z: usize,
    pub(super) dst_lod: usize,
    pub(super) dst_memory_type: c_uint,
    pub(super) dst_host: Ptr,
    pub(super) dst_device: u64,
    pub(super) dst_array: Ptr,
    pub(super) dst_context: Ptr,
    pub(super) dst_pitch: usize,
    pub(super) dst_height: usize,
    pub(super) width_in_bytes: usize,
    pub(super) height: usize,
    pub(super) depth: usize,
}

const _: () = assert!(std::mem::size_of::<Memcpy2D>() == 128);
const _: () = assert!(std::mem::size_of::<Memcpy3D>() == 200);

/// `(memory type, device pointer)` of one side; a host side uses the packed buffer.
pub(super) fn side_kind(side: &CopySide) -> (c_uint, u64) {
    match side.place {
        CopyPlace::Device(p) => (MEMORYTYPE_DEVICE, p),
        CopyPlace::Host => (MEMORYTYPE_HOST, 0),
    }
}

impl Memcpy2D {
    pub(super) fn new(c: &Copy3d, src_host: *const c_void, dst_host: Ptr) -> Self {
        let (src_memory_type, src_device) = side_kind(&c.src);
        let (dst_memory_type, dst_device) = side_kind(&c.dst);
        Self {
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
}

impl Memcpy3D {
    /// The descriptor of `c`; the contexts are set for a peer copy, else NULL (`reserved0/1`).
    pub(super) fn new(c: &Copy3d, src_host: *const c_void, dst_host: Ptr) -> Self {
        let (src_memory_type, src_device) = side_kind(&c.src);
        let (dst_memory_type, dst_device) = side_kind(&c.dst);
        Self {
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
}
