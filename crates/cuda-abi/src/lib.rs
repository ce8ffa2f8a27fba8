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
    use std::mem::{offset_of, size_of};

    /// Sizes and offsets from CUDA 13.0's cuda.h on x86-64 (`offsetof` of each C field).
    #[test]
    fn layouts_match_cuda_h() {
        assert_eq!(size_of::<Memcpy2D>(), 128);
        let m2 = [
            offset_of!(Memcpy2D, src_x_in_bytes),
            offset_of!(Memcpy2D, src_y),
            offset_of!(Memcpy2D, src_memory_type),
            offset_of!(Memcpy2D, src_host),
            offset_of!(Memcpy2D, src_device),
            offset_of!(Memcpy2D, src_array),
            offset_of!(Memcpy2D, src_pitch),
            offset_of!(Memcpy2D, dst_x_in_bytes),
            offset_of!(Memcpy2D, dst_y),
            offset_of!(Memcpy2D, dst_memory_type),
            offset_of!(Memcpy2D, dst_host),
            offset_of!(Memcpy2D, dst_device),
            offset_of!(Memcpy2D, dst_array),
            offset_of!(Memcpy2D, dst_pitch),
            offset_of!(Memcpy2D, width_in_bytes),
            offset_of!(Memcpy2D, height),
        ];
        assert_eq!(
            m2,
            [
                0, 8, 16, 24, 32, 40, 48, 56, 64, 72, 80, 88, 96, 104, 112, 120
            ]
        );

        assert_eq!(size_of::<Memcpy2DV1>(), 96);
        let m2v1 = [
            offset_of!(Memcpy2DV1, src_x_in_bytes),
            offset_of!(Memcpy2DV1, src_y),
            offset_of!(Memcpy2DV1, src_memory_type),
            offset_of!(Memcpy2DV1, src_host),
            offset_of!(Memcpy2DV1, src_device),
            offset_of!(Memcpy2DV1, src_array),
            offset_of!(Memcpy2DV1, src_pitch),
            offset_of!(Memcpy2DV1, dst_x_in_bytes),
            offset_of!(Memcpy2DV1, dst_y),
            offset_of!(Memcpy2DV1, dst_memory_type),
            offset_of!(Memcpy2DV1, dst_host),
            offset_of!(Memcpy2DV1, dst_device),
            offset_of!(Memcpy2DV1, dst_array),
            offset_of!(Memcpy2DV1, dst_pitch),
            offset_of!(Memcpy2DV1, width_in_bytes),
            offset_of!(Memcpy2DV1, height),
        ];
        assert_eq!(
            m2v1,
            [0, 4, 8, 16, 24, 32, 40, 44, 48, 52, 56, 64, 72, 80, 84, 88]
        );

        assert_eq!(size_of::<Memcpy3D>(), 200);
        let m3 = [
            offset_of!(Memcpy3D, src_x_in_bytes),
            offset_of!(Memcpy3D, src_y),
            offset_of!(Memcpy3D, src_z),
            offset_of!(Memcpy3D, src_lod),
            offset_of!(Memcpy3D, src_memory_type),
            offset_of!(Memcpy3D, src_host),
            offset_of!(Memcpy3D, src_device),
            offset_of!(Memcpy3D, src_array),
            offset_of!(Memcpy3D, src_context),
            offset_of!(Memcpy3D, src_pitch),
            offset_of!(Memcpy3D, src_height),
            offset_of!(Memcpy3D, dst_x_in_bytes),
            offset_of!(Memcpy3D, dst_y),
            offset_of!(Memcpy3D, dst_z),
            offset_of!(Memcpy3D, dst_lod),
            offset_of!(Memcpy3D, dst_memory_type),
            offset_of!(Memcpy3D, dst_host),
            offset_of!(Memcpy3D, dst_device),
            offset_of!(Memcpy3D, dst_array),
            offset_of!(Memcpy3D, dst_context),
            offset_of!(Memcpy3D, dst_pitch),
            offset_of!(Memcpy3D, dst_height),
            offset_of!(Memcpy3D, width_in_bytes),
            offset_of!(Memcpy3D, height),
            offset_of!(Memcpy3D, depth),
        ];
        let want: Vec<usize> = (0..25).map(|i| i * 8).collect();
        assert_eq!(m3.to_vec(), want);

        assert_eq!(size_of::<Memcpy3DV1>(), 144);
        let m3v1 = [
            offset_of!(Memcpy3DV1, src_x_in_bytes),
            offset_of!(Memcpy3DV1, src_y),
            offset_of!(Memcpy3DV1, src_z),
            offset_of!(Memcpy3DV1, src_lod),
            offset_of!(Memcpy3DV1, src_memory_type),
            offset_of!(Memcpy3DV1, src_host),
            offset_of!(Memcpy3DV1, src_device),
            offset_of!(Memcpy3DV1, src_array),
            offset_of!(Memcpy3DV1, reserved0),
            offset_of!(Memcpy3DV1, src_pitch),
            offset_of!(Memcpy3DV1, src_height),
            offset_of!(Memcpy3DV1, dst_x_in_bytes),
            offset_of!(Memcpy3DV1, dst_y),
            offset_of!(Memcpy3DV1, dst_z),
            offset_of!(Memcpy3DV1, dst_lod),
            offset_of!(Memcpy3DV1, dst_memory_type),
            offset_of!(Memcpy3DV1, dst_host),
            offset_of!(Memcpy3DV1, dst_device),
            offset_of!(Memcpy3DV1, dst_array),
            offset_of!(Memcpy3DV1, reserved1),
            offset_of!(Memcpy3DV1, dst_pitch),
            offset_of!(Memcpy3DV1, dst_height),
            offset_of!(Memcpy3DV1, width_in_bytes),
            offset_of!(Memcpy3DV1, height),
            offset_of!(Memcpy3DV1, depth),
        ];
        assert_eq!(
            m3v1,
            [
                0, 4, 8, 12, 16, 24, 32, 40, 48, 56, 60, 64, 68, 72, 76, 80, 88, 96, 104, 112, 120,
                124, 128, 132, 136
            ]
        );

        assert_eq!(size_of::<MemLocation>(), 8);
        assert_eq!(size_of::<MemAllocationProp>(), 32);
        assert_eq!(offset_of!(MemAllocationProp, location), 8);
        assert_eq!(offset_of!(MemAllocationProp, win32_handle_meta_data), 16);
        assert_eq!(offset_of!(MemAllocationProp, compression_type), 24);
        assert_eq!(offset_of!(MemAllocationProp, usage), 26);
        assert_eq!(size_of::<MemAccessDesc>(), 12);
        assert_eq!(offset_of!(MemAccessDesc, flags), 8);
        assert_eq!(size_of::<LaunchAttribute>(), 72);
        assert_eq!(offset_of!(LaunchAttribute, value), 8);
        assert_eq!(size_of::<LaunchConfig>(), 56);
        let lc = [
            offset_of!(LaunchConfig, grid),
            offset_of!(LaunchConfig, block),
            offset_of!(LaunchConfig, shared_mem_bytes),
            offset_of!(LaunchConfig, stream),
            offset_of!(LaunchConfig, attrs),
            offset_of!(LaunchConfig, num_attrs),
        ];
        assert_eq!(lc, [0, 12, 24, 32, 40, 48]);
    }
}
