//! Initialization, devices, contexts, errors, cuGetProcAddress.

use std::ffi::{c_char, c_int, c_uint, c_void};

use remora_client::{CuError, CuResult, Session, cu, cu_result_name_c, cu_result_string_c};

use super::Handle;
use crate::CUresult;
use crate::state::{self, Kind, dec, enc, entry, put, put_opt};

#[unsafe(no_mangle)]
pub extern "C" fn cuInit(flags: c_uint) -> CUresult {
    entry("cuInit", || {
        if flags != 0 {
            return Err(CuError(cu::INVALID_VALUE));
        }
        state::init()
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDriverGetVersion(version: *mut c_int) -> CUresult {
    entry("cuDriverGetVersion", || {
        // SAFETY: output pointer per cuda.h.
        unsafe { put(version, driver_version()) }
    })
}

/// What cuDriverGetVersion answers: the server's driver version, else 13000.
pub fn driver_version() -> c_int {
    state::session()
        .ok()
        .and_then(|s| s.driver_version())
        .unwrap_or(13000)
}

fn check_dev(dev: c_int) -> Result<&'static remora_client::Session, CuError> {
    let s = state::session()?;
    if dev < 0 || dev >= s.device_count() {
        return Err(CuError(cu::INVALID_DEVICE));
    }
    Ok(s)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetCount(count: *mut c_int) -> CUresult {
    entry("cuDeviceGetCount", || {
        let n = state::session()?.device_count();
        // SAFETY: output pointer per cuda.h.
        unsafe { put(count, n) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGet(device: *mut c_int, ordinal: c_int) -> CUresult {
    entry("cuDeviceGet", || {
        check_dev(ordinal)?;
        // SAFETY: output pointer per cuda.h.
        unsafe { put(device, ordinal) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: c_int) -> CUresult {
    entry("cuDeviceGetName", || {
        let p = check_dev(dev)?.device_props(dev)?;
        // SAFETY: `name` is writable for `len` bytes per cuda.h.
        unsafe { state::put_str(name, len, &p.name) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(bus: *mut c_char, len: c_int, dev: c_int) -> CUresult {
    entry("cuDeviceGetPCIBusId", || {
        let p = check_dev(dev)?.device_props(dev)?;
        // SAFETY: `bus` is writable for `len` bytes per cuda.h.
        unsafe { state::put_str(bus, len, &p.pci_bus_id) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid(uuid: *mut [u8; 16], dev: c_int) -> CUresult {
    entry("cuDeviceGetUuid", || {
        let p = check_dev(dev)?.device_props(dev)?;
        // SAFETY: CUuuid is 16 bytes; output pointer per cuda.h.
        unsafe { put(uuid, p.uuid) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(uuid: *mut [u8; 16], dev: c_int) -> CUresult {
    // SAFETY: same contract.
    unsafe { cuDeviceGetUuid(uuid, dev) }
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: c_int) -> CUresult {
    entry("cuDeviceTotalMem_v2", || {
        let p = check_dev(dev)?.device_props(dev)?;
        // SAFETY: output pointer per cuda.h.
        unsafe { put(bytes, p.total_memory as usize) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    value: *mut c_int,
    attrib: c_int,
    dev: c_int,
) -> CUresult {
    entry("cuDeviceGetAttribute", || {
        if !(1..=1024).contains(&attrib) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let v = check_dev(dev)?.device_attribute(dev, attrib)?;
        // SAFETY: output pointer per cuda.h.
        unsafe { put(value, v) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(pctx: *mut Handle, dev: c_int) -> CUresult {
    entry("cuDevicePrimaryCtxRetain", || {
        let h = check_dev(dev)?.primary_ctx_retain(dev)?;
        crate::export_tables::note_primary(dev, h);
        // SAFETY: output pointer per cuda.h.
        unsafe { put(pctx, enc(Kind::Ctx, h)) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: c_int) -> CUresult {
    entry("cuDevicePrimaryCtxRelease_v2", || {
        check_dev(dev)?.primary_ctx_release(dev)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxRelease(dev: c_int) -> CUresult {
    cuDevicePrimaryCtxRelease_v2(dev)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxSetFlags_v2(dev: c_int, flags: c_uint) -> CUresult {
    entry("cuDevicePrimaryCtxSetFlags_v2", || {
        check_dev(dev)?.primary_ctx_set_flags(dev, flags)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxSetFlags(dev: c_int, flags: c_uint) -> CUresult {
    cuDevicePrimaryCtxSetFlags_v2(dev, flags)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(
    dev: c_int,
    flags: *mut c_uint,
    active: *mut c_int,
) -> CUresult {
    entry("cuDevicePrimaryCtxGetState", || {
        let (f, a) = check_dev(dev)?.primary_ctx_get_state(dev)?;
        // SAFETY: output pointers per cuda.h.
        unsafe {
            put(flags, f)?;
            put(active, c_int::from(a))
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxReset_v2(dev: c_int) -> CUresult {
    entry("cuDevicePrimaryCtxReset_v2", || {
        check_dev(dev)?.primary_ctx_reset(dev)?;
        crate::export_tables::primary_reset(dev);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuDevicePrimaryCtxReset(dev: c_int) -> CUresult {
    cuDevicePrimaryCtxReset_v2(dev)
}

fn ctx_create(pctx: *mut Handle, flags: c_uint, dev: c_int) -> Result<(), CuError> {
    let h = check_dev(dev)?.ctx_create(flags, dev)?;
    state::push_ctx(h)?;
    // SAFETY: output pointer per cuda.h (checked by every caller's contract).
    unsafe { put(pctx, enc(Kind::Ctx, h)) }
}

entry_points! {
    cuCtxCreate_v2(pctx: *mut Handle, flags: c_uint, dev: c_int) => ctx_create(pctx, flags, dev);
    cuCtxCreate(pctx: *mut Handle, flags: c_uint, dev: c_int) => ctx_create(pctx, flags, dev);
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v3(
    pctx: *mut Handle,
    _params: *mut c_void,
    num_params: c_int,
    flags: c_uint,
    dev: c_int,
) -> CUresult {
    entry("cuCtxCreate_v3", || {
        if num_params != 0 {
            tracing::warn!("remora: execution-affinity contexts are not supported");
            return Err(CuError(cu::NOT_SUPPORTED));
        }
        ctx_create(pctx, flags, dev)
    })
}

/// `CUctxCreateParams`.
#[repr(C)]
pub struct CtxCreateParams {
    exec_affinity: *mut c_void,
    num_exec_affinity: c_int,
    cig: *mut c_void,
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxCreate_v4(
    pctx: *mut Handle,
    params: *mut CtxCreateParams,
    flags: c_uint,
    dev: c_int,
) -> CUresult {
    entry("cuCtxCreate_v4", || {
        if !params.is_null() {
            // SAFETY: non-null params point to a CUctxCreateParams per cuda.h.
            let p = unsafe { &*params };
            if p.num_exec_affinity != 0 || !p.cig.is_null() {
                tracing::warn!("remora: execution-affinity and CIG contexts are not supported");
                return Err(CuError(cu::NOT_SUPPORTED));
            }
        }
        ctx_create(pctx, flags, dev)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxDestroy_v2(ctx: Handle) -> CUresult {
    entry("cuCtxDestroy_v2", || {
        let h = dec(Kind::Ctx, ctx)?;
        state::session()?.ctx_destroy(h)?;
        // A thread whose stack is gone has nothing to forget.
        let _ = state::forget_ctx(h);
        crate::export_tables::context_destroyed(h);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxDestroy(ctx: Handle) -> CUresult {
    cuCtxDestroy_v2(ctx)
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxPushCurrent_v2(ctx: Handle) -> CUresult {
    entry("cuCtxPushCurrent_v2", || {
        state::push_ctx(dec(Kind::Ctx, ctx)?)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxPushCurrent(ctx: Handle) -> CUresult {
    cuCtxPushCurrent_v2(ctx)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(pctx: *mut Handle) -> CUresult {
    entry("cuCtxPopCurrent_v2", || {
        let h = state::pop_ctx()?.ok_or(CuError(cu::INVALID_CONTEXT))?;
        if !pctx.is_null() {
            // SAFETY: non-null output pointer per cuda.h.
            unsafe { put(pctx, enc(Kind::Ctx, h))? };
        }
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxPopCurrent(pctx: *mut Handle) -> CUresult {
    // SAFETY: same contract.
    unsafe { cuCtxPopCurrent_v2(pctx) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCurrent(ctx: Handle) -> CUresult {
    entry("cuCtxSetCurrent", || {
        let h = if ctx.is_null() {
            None
        } else {
            Some(dec(Kind::Ctx, ctx)?)
        };
        state::set_current(h)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetCurrent(pctx: *mut Handle) -> CUresult {
    entry("cuCtxGetCurrent", || {
        let p = state::current_ctx_opt().map_or(std::ptr::null_mut(), |h| enc(Kind::Ctx, h));
        // SAFETY: output pointer per cuda.h.
        unsafe { put(pctx, p) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice(device: *mut c_int) -> CUresult {
    entry("cuCtxGetDevice", || {
        let d = state::ctx_device(state::current_ctx()?)?;
        // SAFETY: output pointer per cuda.h.
        unsafe { put(device, d) }
    })
}

/// A context's unique id: Remora's handle for it, unique in the session and never reused.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetId(ctx: Handle, id: *mut u64) -> CUresult {
    entry("cuCtxGetId", || {
        let h = state::ctx_or_current(ctx)?;
        // SAFETY: output pointer per cuda.h.
        unsafe { put(id, h) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetDevice_v2(device: *mut c_int, ctx: Handle) -> CUresult {
    entry("cuCtxGetDevice_v2", || {
        let h = state::ctx_or_current(ctx)?;
        let d = state::ctx_device(h)?;
        // SAFETY: output pointer per cuda.h.
        unsafe { put(device, d) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    entry("cuCtxSynchronize", || {
        state::session()?.ctx_synchronize(state::current_ctx()?)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSynchronize_v2(ctx: Handle) -> CUresult {
    entry("cuCtxSynchronize_v2", || {
        let h = state::ctx_or_current(ctx)?;
        state::session()?.ctx_synchronize(h)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetLimit(limit: c_int, value: usize) -> CUresult {
    entry("cuCtxSetLimit", || {
        if !(0..=0x10).contains(&limit) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        state::session()?.ctx_set_limit(state::current_ctx()?, limit, value as u64)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetLimit(value: *mut usize, limit: c_int) -> CUresult {
    entry("cuCtxGetLimit", || {
        if !(0..=0x10).contains(&limit) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let v = state::session()?.ctx_get_limit(state::current_ctx()?, limit)?;
        // SAFETY: output pointer per cuda.h.
        unsafe { put(value, v as usize) }
    })
}

/// Remoted: the server's driver answers for the session's context.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetApiVersion(ctx: Handle, version: *mut c_uint) -> CUresult {
    entry("cuCtxGetApiVersion", || {
        let v = state::session()?.ctx_get_api_version(state::ctx_or_current(ctx)?)?;
        // SAFETY: output pointer per cuda.h.
        unsafe { state::put_as(version, v) }
    })
}

/// Writes `get(session, current context)` to the output pointer `out`, in its C type.
fn current_ctx_value<T: TryFrom<U>, U>(
    out: *mut T,
    get: impl FnOnce(&Session, u64) -> CuResult<U>,
) -> CuResult<()> {
    let v = get(state::session()?, state::current_ctx()?)?;
    // SAFETY: output pointer per cuda.h.
    unsafe { state::put_as(out, v) }
}

entry_points! {
    cuCtxGetFlags(flags: *mut c_uint) => current_ctx_value(flags, |s, c| s.ctx_get_flags(c));
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxSetCacheConfig(config: c_int) -> CUresult {
    entry("cuCtxSetCacheConfig", || {
        let config = u32::try_from(config)
            .ok()
            .filter(|c| *c <= 3)
            .ok_or(CuError(cu::INVALID_VALUE))?;
        state::session()?.ctx_set_cache_config(state::current_ctx()?, config)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuCtxResetPersistingL2Cache() -> CUresult {
    entry("cuCtxResetPersistingL2Cache", || {
        state::session()?.ctx_reset_persisting_l2_cache(state::current_ctx()?)
    })
}

entry_points! {
    cuCtxGetCacheConfig(config: *mut c_int) =>
        current_ctx_value(config, |s, c| s.ctx_get_cache_config(c));
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuCtxGetStreamPriorityRange(
    least: *mut c_int,
    greatest: *mut c_int,
) -> CUresult {
    entry("cuCtxGetStreamPriorityRange", || {
        let (l, g) = state::session()?.ctx_get_stream_priority_range(state::current_ctx()?)?;
        // SAFETY: optional output pointers per cuda.h.
        unsafe {
            put_opt(least, l)?;
            put_opt(greatest, g)?;
        }
        Ok(())
    })
}

/// The text `cuGetErrorString` gives for `code`: the driver's own, and for the code of the
/// latest transport failure (DEVICE_UNAVAILABLE or UNKNOWN) that text followed by the failure's
/// cause, so a program that prints `cudaGetErrorString` says why its remote GPU went away.
/// Each distinct text is leaked once (C callers keep the pointer); at most 64 are kept, then the
/// plain text is given.
pub(crate) fn error_string(code: c_int) -> Option<&'static std::ffi::CStr> {
    use std::collections::HashMap;
    use std::ffi::{CStr, CString};
    use std::sync::{Mutex, OnceLock};
    static TEXTS: OnceLock<Mutex<HashMap<String, &'static CStr>>> = OnceLock::new();
    let plain = cu_result_string_c(code)?;
    let Some(failure) = remora_client::last_transport_failure().filter(|f| f.code == code) else {
        return Some(plain);
    };
    let text = format!(
        "{} (Remora: {} failed in transport: {})",
        plain.to_string_lossy(),
        failure.call,
        failure.cause
    );
    let mut texts = TEXTS
        .get_or_init(Mutex::default)
        .lock()
        .unwrap_or_else(|e| e.into_inner());
    if let Some(t) = texts.get(&text) {
        return Some(t);
    }
    if texts.len() >= 64 {
        return Some(plain);
    }
    let leaked: &'static CStr = Box::leak(
        CString::new(text.replace('\0', " "))
            .ok()?
            .into_boxed_c_str(),
    );
    texts.insert(text, leaked);
    Some(leaked)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorString(error: c_int, s: *mut *const c_char) -> CUresult {
    entry("cuGetErrorString", || {
        let text = error_string(error).ok_or(CuError(cu::INVALID_VALUE))?;
        // SAFETY: output pointer per cuda.h; the string is static (leaked or from the table).
        unsafe { put(s, text.as_ptr()) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuGetErrorName(error: c_int, s: *mut *const c_char) -> CUresult {
    entry("cuGetErrorName", || {
        let name = cu_result_name_c(error).ok_or(CuError(cu::INVALID_VALUE))?;
        // SAFETY: output pointer per cuda.h; the string is static.
        unsafe { put(s, name.as_ptr()) }
    })
}

fn proc_address(
    symbol: *const c_char,
    pfn: *mut *mut c_void,
    version: c_int,
    flags: u64,
    status: *mut c_int,
) -> Result<(), CuError> {
    if symbol.is_null() || pfn.is_null() {
        return Err(CuError(cu::INVALID_VALUE));
    }
    // SAFETY: `symbol` is a NUL-terminated string per cuda.h.
    let name = unsafe { std::ffi::CStr::from_ptr(symbol) }.to_string_lossy();
    let r = crate::procaddr::resolve(&name, version, flags);
    let (addr, st) = match r {
        Ok(a) => (a, 0),
        Err(st) => (std::ptr::null_mut(), st),
    };
    // SAFETY: `pfn` is non-null and writable per cuda.h.
    unsafe { put(pfn, addr)? };
    if !status.is_null() {
        // SAFETY: non-null optional output pointer per cuda.h.
        unsafe { put(status, st)? };
    }
    if st != 0 {
        tracing::info!(
            "remora: cuGetProcAddress({name}, {version}, {flags}) misses: {}",
            if st == crate::procaddr::VERSION_NOT_SUFFICIENT {
                "CU_GET_PROC_ADDRESS_VERSION_NOT_SUFFICIENT"
            } else {
                "CU_GET_PROC_ADDRESS_SYMBOL_NOT_FOUND"
            }
        );
        return Err(CuError(cu::NOT_FOUND));
    }
    Ok(())
}

entry_points! {
    cuGetProcAddress_v2(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64, status: *mut c_int)
        => proc_address(symbol, pfn, version, flags, status);
    cuGetProcAddress_v2_ptsz(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64, status: *mut c_int)
        => proc_address(symbol, pfn, version, flags, status);
    cuGetProcAddress(symbol: *const c_char, pfn: *mut *mut c_void, version: c_int, flags: u64)
        => proc_address(symbol, pfn, version, flags, std::ptr::null_mut());
}
