//! Libraries and kernels (`CUlibrary`, `CUkernel`) on top of module loading: a library is
//! a module per context, loaded in the current context on first use; a kernel is the
//! function of the same name in the current context's module.

use std::ffi::{c_char, c_int, c_uint, c_void};

use remora_client::{CuError, CuResult, cu};

use super::exec::function_info;
use super::{DevPtr, Handle};
use crate::CUresult;
use crate::state::{self, Kind, c_name, dec, enc, entry, non_null, put_out};

/// JIT and library options are accepted and ignored (the server's driver uses its defaults).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLibraryLoadData(
    library: *mut Handle,
    code: *const c_void,
    _jit_options: *mut c_int,
    _jit_values: *mut *mut c_void,
    _num_jit: c_uint,
    _lib_options: *mut c_int,
    _lib_values: *mut *mut c_void,
    _num_lib: c_uint,
) -> CUresult {
    entry("cuLibraryLoadData", || {
        non_null(library)?;
        // SAFETY: `code` is a kernel image as cuLibraryLoadData documents.
        let (p, n) = unsafe { crate::image::locate(code.cast()) }?;
        // SAFETY: `locate` found the image to span `n` readable bytes from `p`.
        let bytes = unsafe { std::slice::from_raw_parts(p, n) };
        let id = state::session()?.library_load(state::current_ctx_opt(), bytes)?;
        put_out(library, enc(Kind::Library, id))
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuLibraryUnload(library: Handle) -> CUresult {
    entry("cuLibraryUnload", || {
        state::session()?.library_unload(dec(Kind::Library, library)?)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLibraryGetModule(module: *mut Handle, library: Handle) -> CUresult {
    entry("cuLibraryGetModule", || {
        let m = state::session()?
            .library_module(dec(Kind::Library, library)?, state::current_ctx()?)?;
        put_out(module, enc(Kind::Module, m.handle))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLibraryGetKernel(
    kernel: *mut Handle,
    library: Handle,
    name: *const c_char,
) -> CUresult {
    entry("cuLibraryGetKernel", || {
        let name = c_name(name)?;
        let k = state::session()?.library_get_kernel(
            dec(Kind::Library, library)?,
            &name,
            state::current_ctx_opt(),
        )?;
        put_out(kernel, enc(Kind::Kernel, k))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLibraryGetKernelCount(count: *mut c_uint, library: Handle) -> CUresult {
    entry("cuLibraryGetKernelCount", || {
        let names = state::session()?
            .library_kernel_names(dec(Kind::Library, library)?, state::current_ctx_opt())?;
        put_out(count, names.len() as c_uint)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLibraryEnumerateKernels(
    kernels: *mut Handle,
    num: c_uint,
    library: Handle,
) -> CUresult {
    entry("cuLibraryEnumerateKernels", || {
        non_null(kernels)?;
        let s = state::session()?;
        let (lib, ctx) = (dec(Kind::Library, library)?, state::current_ctx_opt());
        let names = s.library_kernel_names(lib, ctx)?;
        for (i, name) in names.iter().take(num as usize).enumerate() {
            let k = s.library_get_kernel(lib, name, ctx)?;
            // SAFETY: `kernels` holds `num` entries per cuda.h and `i < num`.
            put_out(unsafe { kernels.add(i) }, enc(Kind::Kernel, k))?;
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuLibraryGetGlobal(
    dptr: *mut DevPtr,
    bytes: *mut usize,
    library: Handle,
    name: *const c_char,
) -> CUresult {
    entry("cuLibraryGetGlobal", || {
        let name = c_name(name)?;
        let range = state::session()?.library_get_global(
            dec(Kind::Library, library)?,
            &name,
            state::current_ctx()?,
        )?;
        // SAFETY: optional output pointers per cuda.h.
        unsafe { state::put_range(dptr, bytes, range) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuKernelGetFunction(f: *mut Handle, kernel: Handle) -> CUresult {
    entry("cuKernelGetFunction", || {
        let info =
            state::session()?.kernel_function(dec(Kind::Kernel, kernel)?, state::current_ctx()?)?;
        put_out(f, enc(Kind::Function, info.handle))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuKernelGetLibrary(library: *mut Handle, kernel: Handle) -> CUresult {
    entry("cuKernelGetLibrary", || {
        let (lib, _) = state::session()?.kernel(dec(Kind::Kernel, kernel)?)?;
        put_out(library, enc(Kind::Library, lib))
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuKernelGetName(name: *mut *const c_char, kernel: Handle) -> CUresult {
    entry("cuKernelGetName", || {
        dec(Kind::Kernel, kernel)?;
        let (_, info) = function_info(kernel)?;
        put_out(name, info.c_name.as_ptr())
    })
}

/// The kernel's function in the current context; `dev` must be that context's device.
fn kernel_handle(kernel: Handle, dev: c_int) -> CuResult<u64> {
    dec(Kind::Kernel, kernel)?;
    if state::ctx_device(state::current_ctx()?)? != dev {
        tracing::warn!(
            "remora: cuKernel{{Get,Set}}Attribute for a device other than the current context's is not supported"
        );
        return Err(CuError(cu::NOT_SUPPORTED));
    }
    Ok(function_info(kernel)?.1.handle)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuKernelGetAttribute(
    value: *mut c_int,
    attrib: c_int,
    kernel: Handle,
    dev: c_int,
) -> CUresult {
    entry("cuKernelGetAttribute", || {
        super::exec::check_func_attribute(attrib)?;
        let v = state::session()?.func_get_attribute(kernel_handle(kernel, dev)?, attrib)?;
        put_out(value, v)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuKernelSetAttribute(
    attrib: c_int,
    value: c_int,
    kernel: Handle,
    dev: c_int,
) -> CUresult {
    entry("cuKernelSetAttribute", || {
        super::exec::check_func_attribute(attrib)?;
        state::session()?.func_set_attribute(kernel_handle(kernel, dev)?, attrib, value)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuKernelGetParamInfo(
    kernel: Handle,
    index: usize,
    offset: *mut usize,
    size: *mut usize,
) -> CUresult {
    entry("cuKernelGetParamInfo", || {
        dec(Kind::Kernel, kernel)?;
        super::exec::param_info(kernel, index, offset, size)
    })
}
