//! The implemented driver entry points. Their contracts are those of CUDA 13.0's `cuda.h`:
//! pointers are valid as it documents (null output pointers are rejected).
#![allow(non_snake_case, clippy::missing_safety_doc, clippy::too_many_arguments)]

mod capture;
mod core;
mod exec;
mod library;
mod managed;
mod mem;
mod memcpy3d;
mod private;

pub use self::core::*;
pub use capture::*;
pub use exec::*;
pub use library::*;
pub use managed::*;
pub use mem::*;
pub use memcpy3d::*;
pub use private::*;

use std::ffi::c_void;

/// `CUcontext`, `CUmodule`, `CUfunction`, `CUstream`, `CUevent`.
pub type Handle = *mut c_void;
/// `CUdeviceptr`.
pub type DevPtr = u64;
