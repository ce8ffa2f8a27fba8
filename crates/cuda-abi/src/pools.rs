//! The structs of CUDA's memory pools (`cuMemPoolCreate`, `cuMemPoolSetAccess`,
//! `cuMemPoolGetAccess`), as CUDA 13.0's `cuda.h` lays them out on 64-bit platforms.

use std::ffi::{c_int, c_ushort, c_void};

pub use crate::{MemAccessDesc, MemLocation};

/// `CU_MEM_ALLOCATION_TYPE_PINNED`.
pub const ALLOCATION_TYPE_PINNED: c_int = 1;
/// `CU_MEM_LOCATION_TYPE_DEVICE`.
pub const LOCATION_TYPE_DEVICE: c_int = 1;
/// `CU_MEM_HANDLE_TYPE_NONE`.
pub const HANDLE_TYPE_NONE: c_int = 0;

/// `CUmemPoolProps` (`CUmemPoolProps_v1`): 88 bytes.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct MemPoolProps {
    /// `CUmemAllocationType`.
    pub alloc_type: c_int,
    /// `CUmemAllocationHandleType` bits.
    pub handle_types: c_int,
    /// Where the pool's memory lives.
    pub location: MemLocation,
    /// `LPSECURITYATTRIBUTES` (Windows only; zero elsewhere).
    pub win32_security_attributes: *mut c_void,
    /// Largest size of the pool (0: a system default).
    pub max_size: usize,
    /// `CU_MEM_POOL_CREATE_USAGE_*` bits.
    pub usage: c_ushort,
    /// Reserved; must be zero.
    pub reserved: [u8; 54],
}

impl Default for MemPoolProps {
    fn default() -> Self {
        Self {
            alloc_type: 0,
            handle_types: 0,
            location: MemLocation::default(),
            win32_security_attributes: std::ptr::null_mut(),
            max_size: 0,
            usage: 0,
            reserved: [0; 54],
        }
    }
}

#[cfg(all(test, target_pointer_width = "64"))]
mod tests {
    use super::*;

    /// Sizes and offsets from CUDA 13.0's cuda.h on x86-64.
    #[test]
    fn layouts_match_cuda_h() {
        assert_layout!(MemPoolProps, 88, {
            alloc_type: 0, handle_types: 4, location: 8, win32_security_attributes: 16,
            max_size: 24, usage: 32, reserved: 34,
        });
    }
}
