//! The `#[repr(C)]` layouts of the CUDA driver's structs that cross Remora's edges, defined
//! once: the shim (`libcuda.so.1`) reads them from the program, the server fills them in for
//! the real driver. Layouts are those of CUDA 13.0's `cuda.h` on 64-bit platforms; the tests
//! pin every size and field offset.
//!
//! ```text
//! program --CUDA_MEMCPY3D*--> shim (reads)   ...wire...   server (builds) --CUDA_MEMCPY3D*--> driver
//! ```
//!
//! Plain data only: pointers are carried as raw pointers and never dereferenced here.

#![forbid(unsafe_code)]

use std::ffi::{c_int, c_uint, c_void};

/// Asserts that `$t` is `$size` bytes long and that each field lies at its offset (the tests
/// pin the layouts to cuda.h with it).
#[cfg(all(test, target_pointer_width = "64"))]
macro_rules! assert_layout {
    // Two structs with the same fields (a struct and its older ABI version), side by side.
    ([$t:ty, $u:ty], [$size:expr, $size_u:expr], {
        $($field:ident: [$offset:expr, $offset_u:expr]),* $(,)?
    }) => {{
        assert_layout!($t, $size, { $($field: $offset),* });
        assert_layout!($u, $size_u, { $($field: $offset_u),* });
    }};
    ($t:ty, $size:expr, { $($field:ident: $offset:expr),* $(,)? }) => {{
        assert_eq!(std::mem::size_of::<$t>(), $size, "size of {}", stringify!($t));
        $(assert_eq!(
            std::mem::offset_of!($t, $field),
            $offset,
            "offset of {}::{}",
            stringify!($t),
            stringify!($field)
        );)*
    }};
}

pub mod graphs;
pub mod pools;

/// `CU_MEMORYTYPE_HOST`.
pub const MEMORYTYPE_HOST: c_uint = 1;
/// `CU_MEMORYTYPE_DEVICE`.
pub const MEMORYTYPE_DEVICE: c_uint = 2;
/// `CU_MEMORYTYPE_ARRAY`.
pub const MEMORYTYPE_ARRAY: c_uint = 3;
/// `CU_MEMORYTYPE_UNIFIED`.
pub const MEMORYTYPE_UNIFIED: c_uint = 4;

/// `CUDA_MEMCPY2D` (`CUDA_MEMCPY2D_v2`): the ABI of the `_v2` 2-D copies. 128 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct Memcpy2D {
    pub src_x_in_bytes: usize,
    pub src_y: usize,
    pub src_memory_type: c_uint,
    pub src_host: *const c_void,
    pub src_device: u64,
    pub src_array: *mut c_void,
    pub src_pitch: usize,
    pub dst_x_in_bytes: usize,
    pub dst_y: usize,
    pub dst_memory_type: c_uint,
    pub dst_host: *mut c_void,
    pub dst_device: u64,
    pub dst_array: *mut c_void,
    pub dst_pitch: usize,
    pub width_in_bytes: usize,
    pub height: usize,
}

impl Memcpy2D {
    /// The copy of `width_in_bytes × height` bytes from `src` to `dst` (their `z`, `height`
    /// and `context` do not apply).
    pub fn between(src: MemcpySide, dst: MemcpySide, width_in_bytes: usize, height: usize) -> Self {
        Self {
            src_x_in_bytes: src.x_in_bytes,
            src_y: src.y,
            src_memory_type: src.memory_type,
            src_host: src.host.cast_const(),
            src_device: src.device,
            src_array: std::ptr::null_mut(),
            src_pitch: src.pitch,
            dst_x_in_bytes: dst.x_in_bytes,
            dst_y: dst.y,
            dst_memory_type: dst.memory_type,
            dst_host: dst.host,
            dst_device: dst.device,
            dst_array: std::ptr::null_mut(),
            dst_pitch: dst.pitch,
            width_in_bytes,
            height,
        }
    }
}

/// `CUDA_MEMCPY2D_v1` (`__CUDA_API_VERSION_INTERNAL`): the ABI of `cuMemcpy2D`,
/// `cuMemcpy2DUnaligned` and `cuMemcpy2DAsync` without `_v2` (32-bit sizes and device
/// pointers). 96 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct Memcpy2DV1 {
    pub src_x_in_bytes: c_uint,
    pub src_y: c_uint,
    pub src_memory_type: c_uint,
    pub src_host: *const c_void,
    pub src_device: c_uint,
    pub src_array: *mut c_void,
    pub src_pitch: c_uint,
    pub dst_x_in_bytes: c_uint,
    pub dst_y: c_uint,
    pub dst_memory_type: c_uint,
    pub dst_host: *mut c_void,
    pub dst_device: c_uint,
    pub dst_array: *mut c_void,
    pub dst_pitch: c_uint,
    pub width_in_bytes: c_uint,
    pub height: c_uint,
}

/// `CUDA_MEMCPY3D` (`CUDA_MEMCPY3D_v2`) and `CUDA_MEMCPY3D_PEER`: the same layout, with
/// `reserved0`/`reserved1` (must be NULL) where the peer form has `srcContext`/`dstContext`.
/// 200 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct Memcpy3D {
    pub src_x_in_bytes: usize,
    pub src_y: usize,
    pub src_z: usize,
    pub src_lod: usize,
    pub src_memory_type: c_uint,
    pub src_host: *const c_void,
    pub src_device: u64,
    pub src_array: *mut c_void,
    pub src_context: *mut c_void,
    pub src_pitch: usize,
    pub src_height: usize,
    pub dst_x_in_bytes: usize,
    pub dst_y: usize,
    pub dst_z: usize,
    pub dst_lod: usize,
    pub dst_memory_type: c_uint,
    pub dst_host: *mut c_void,
    pub dst_device: u64,
    pub dst_array: *mut c_void,
    pub dst_context: *mut c_void,
    pub dst_pitch: usize,
    pub dst_height: usize,
    pub width_in_bytes: usize,
    pub height: usize,
    pub depth: usize,
}

/// One side of a [`Memcpy3D`] or [`Memcpy2D`] without an array (and at LOD 0), as
/// [`Memcpy3D::between`] and [`Memcpy2D::between`] take it.
#[derive(Debug, Clone, Copy)]
pub struct MemcpySide {
    /// `CU_MEMORYTYPE_*`.
    pub memory_type: c_uint,
    /// The host pointer of a host side (else NULL).
    pub host: *mut c_void,
    /// The device pointer of a device side (else 0).
    pub device: u64,
    /// The context of a peer copy's side (else NULL: `reserved0/1`).
    pub context: *mut c_void,
    /// Where the copy starts: bytes, rows and slices.
    pub x_in_bytes: usize,
    #[allow(missing_docs)]
    pub y: usize,
    #[allow(missing_docs)]
    pub z: usize,
    /// Bytes per row and rows per slice.
    pub pitch: usize,
    #[allow(missing_docs)]
    pub height: usize,
}

impl Memcpy3D {
    /// The copy of `width_in_bytes × height × depth` bytes from `src` to `dst`.
    pub fn between(
        src: MemcpySide,
        dst: MemcpySide,
        width_in_bytes: usize,
        height: usize,
        depth: usize,
    ) -> Self {
        Self {
            src_x_in_bytes: src.x_in_bytes,
            src_y: src.y,
            src_z: src.z,
            src_lod: 0,
            src_memory_type: src.memory_type,
            src_host: src.host.cast_const(),
            src_device: src.device,
            src_array: std::ptr::null_mut(),
            src_context: src.context,
            src_pitch: src.pitch,
            src_height: src.height,
            dst_x_in_bytes: dst.x_in_bytes,
            dst_y: dst.y,
            dst_z: dst.z,
            dst_lod: 0,
            dst_memory_type: dst.memory_type,
            dst_host: dst.host,
            dst_device: dst.device,
            dst_array: std::ptr::null_mut(),
            dst_context: dst.context,
            dst_pitch: dst.pitch,
            dst_height: dst.height,
            width_in_bytes,
            height,
            depth,
        }
    }

    /// The source and destination sides (the arrays and LODs left out): the inverse of
    /// [`Memcpy3D::between`].
    pub fn sides(&self) -> (MemcpySide, MemcpySide) {
        (
            MemcpySide {
                memory_type: self.src_memory_type,
                host: self.src_host.cast_mut(),
                device: self.src_device,
                context: self.src_context,
                x_in_bytes: self.src_x_in_bytes,
                y: self.src_y,
                z: self.src_z,
                pitch: self.src_pitch,
                height: self.src_height,
            },
            MemcpySide {
                memory_type: self.dst_memory_type,
                host: self.dst_host,
                device: self.dst_device,
                context: self.dst_context,
                x_in_bytes: self.dst_x_in_bytes,
                y: self.dst_y,
                z: self.dst_z,
                pitch: self.dst_pitch,
                height: self.dst_height,
            },
        )
    }
}

/// `CUDA_MEMCPY3D_v1` (`__CUDA_API_VERSION_INTERNAL`): the ABI of `cuMemcpy3D` and
/// `cuMemcpy3DAsync` without `_v2`. 144 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct Memcpy3DV1 {
    pub src_x_in_bytes: c_uint,
    pub src_y: c_uint,
    pub src_z: c_uint,
    pub src_lod: c_uint,
    pub src_memory_type: c_uint,
    pub src_host: *const c_void,
    pub src_device: c_uint,
    pub src_array: *mut c_void,
    pub reserved0: *mut c_void,
    pub src_pitch: c_uint,
    pub src_height: c_uint,
    pub dst_x_in_bytes: c_uint,
    pub dst_y: c_uint,
    pub dst_z: c_uint,
    pub dst_lod: c_uint,
    pub dst_memory_type: c_uint,
    pub dst_host: *mut c_void,
    pub dst_device: c_uint,
    pub dst_array: *mut c_void,
    pub reserved1: *mut c_void,
    pub dst_pitch: c_uint,
    pub dst_height: c_uint,
    pub width_in_bytes: c_uint,
    pub height: c_uint,
    pub depth: c_uint,
}

/// `CUlaunchAttribute`: a 4-byte id, 4 bytes of padding, a 64-byte value union (8-byte
/// aligned: it holds pointers and 64-bit members). 72 bytes, value at offset 8.
#[repr(C, align(8))]
#[derive(Debug, Clone, Copy)]
pub struct LaunchAttribute {
    /// `CUlaunchAttributeID`.
    pub id: c_uint,
    /// Padding.
    pub pad: [u8; 4],
    /// `CUlaunchAttributeValue`, as 32-bit words.
    pub value: [u32; 16],
}

/// `CUlaunchConfig`: 56 bytes, `hStream` at 32, `attrs` at 40, `numAttrs` at 48.
#[repr(C)]
#[derive(Debug)]
#[allow(missing_docs)]
pub struct LaunchConfig {
    pub grid: [c_uint; 3],
    pub block: [c_uint; 3],
    pub shared_mem_bytes: c_uint,
    pub stream: *mut c_void,
    pub attrs: *mut LaunchAttribute,
    pub num_attrs: c_uint,
}

/// `CUmemLocation`: 8 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct MemLocation {
    /// `CUmemLocationType`.
    pub kind: c_int,
    /// Device ordinal or NUMA node.
    pub id: c_int,
}

/// `CUmemAllocationProp` (`_v1`): 32 bytes, `win32HandleMetaData` at 16, `allocFlags` at 24.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct MemAllocationProp {
    /// `CUmemAllocationType`.
    pub kind: c_int,
    pub requested_handle_types: c_int,
    pub location: MemLocation,
    /// Windows only; NULL on Linux.
    pub win32_handle_meta_data: *mut c_void,
    pub compression_type: u8,
    pub gpu_direct_rdma_capable: u8,
    pub usage: u16,
    pub reserved: [u8; 4],
}

impl Default for MemAllocationProp {
    fn default() -> Self {
        Self {
            kind: 0,
            requested_handle_types: 0,
            location: MemLocation::default(),
            win32_handle_meta_data: std::ptr::null_mut(),
            compression_type: 0,
            gpu_direct_rdma_capable: 0,
            usage: 0,
            reserved: [0; 4],
        }
    }
}

/// `CUmemAccessDesc` (`_v1`): 12 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
#[allow(missing_docs)]
pub struct MemAccessDesc {
    pub location: MemLocation,
    /// `CUmemAccess_flags`.
    pub flags: c_int,
}

#[cfg(all(test, target_pointer_width = "64"))]
mod tests {
    use super::*;

    /// Sizes and offsets from CUDA 13.0's cuda.h on x86-64 (`offsetof` of each C field).
    #[test]
    fn layouts_match_cuda_h() {
        assert_layout!([Memcpy2D, Memcpy2DV1], [128, 96], {
            src_x_in_bytes: [0, 0], src_y: [8, 4], src_memory_type: [16, 8],
            src_host: [24, 16], src_device: [32, 24], src_array: [40, 32], src_pitch: [48, 40],
            dst_x_in_bytes: [56, 44], dst_y: [64, 48], dst_memory_type: [72, 52],
            dst_host: [80, 56], dst_device: [88, 64], dst_array: [96, 72], dst_pitch: [104, 80],
            width_in_bytes: [112, 84], height: [120, 88],
        });
        // The version-1 3-D form has reserved words where the current one has contexts.
        assert_layout!([Memcpy3D, Memcpy3DV1], [200, 144], {
            src_x_in_bytes: [0, 0], src_y: [8, 4], src_z: [16, 8], src_lod: [24, 12],
            src_memory_type: [32, 16], src_host: [40, 24], src_device: [48, 32],
            src_array: [56, 40], src_pitch: [72, 56], src_height: [80, 60],
            dst_x_in_bytes: [88, 64], dst_y: [96, 68], dst_z: [104, 72], dst_lod: [112, 76],
            dst_memory_type: [120, 80], dst_host: [128, 88], dst_device: [136, 96],
            dst_array: [144, 104], dst_pitch: [160, 120], dst_height: [168, 124],
            width_in_bytes: [176, 128], height: [184, 132], depth: [192, 136],
        });
        assert_layout!(Memcpy3D, 200, { src_context: 64, dst_context: 152 });
        assert_layout!(Memcpy3DV1, 144, { reserved0: 48, reserved1: 112 });
        assert_layout!(MemLocation, 8, {});
        assert_layout!(MemAllocationProp, 32, {
            location: 8, win32_handle_meta_data: 16, compression_type: 24, usage: 26,
        });
        assert_layout!(MemAccessDesc, 12, { flags: 8 });
        assert_layout!(LaunchAttribute, 72, { value: 8 });
        assert_layout!(LaunchConfig, 56, {
            grid: 0, block: 12, shared_mem_bytes: 24, stream: 32, attrs: 40, num_attrs: 48,
        });
    }
}
