//! The implemented driver entry points. Their contracts are those of CUDA 13.0's `cuda.h`:
//! pointers are valid as it documents (null output pointers are rejected).
#![allow(non_snake_case, clippy::missing_safety_doc, clippy::too_many_arguments)]

/// Defines `#[no_mangle] pub unsafe extern "C"` entry points, one row each:
/// `cuName(arg: Type, ...) => body;`. The body is one expression of type `CuResult<()>`,
/// run under [`entry`](crate::state::entry), which logs the call by the row's name, maps the
/// result to a `CUresult` and keeps panics from crossing the C ABI. Doc comments and other
/// attributes may precede a row.
macro_rules! entry_points {
    ($($(#[$m:meta])* $name:ident ($($a:ident : $t:ty),* $(,)?) => $body:expr;)*) => { $(
        $(#[$m])*
        #[unsafe(no_mangle)]
        pub unsafe extern "C" fn $name($($a: $t),*) -> $crate::CUresult {
            $crate::state::entry(stringify!($name), || $body)
        }
    )* };
}

mod capture;
mod core;
mod exec;
mod graphs;
mod library;
mod managed;
mod mem;
mod memcpy3d;
mod pools;
mod private;
mod vmm;

pub use self::core::*;
pub use capture::*;
pub(crate) use exec::load_image;
pub use exec::*;
pub use graphs::*;
pub use library::*;
pub use managed::*;
pub use mem::*;
pub use memcpy3d::*;
pub use pools::*;
pub use private::*;
pub use vmm::*;

use std::ffi::c_void;

/// `CUcontext`, `CUmodule`, `CUfunction`, `CUstream`, `CUevent`.
pub type Handle = *mut c_void;
/// `CUdeviceptr`.
pub type DevPtr = u64;
