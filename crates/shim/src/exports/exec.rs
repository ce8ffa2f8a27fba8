//! Modules, functions, launches, streams, events, occupancy.

use std::ffi::{c_char, c_int, c_uint, c_void};
use std::ptr::null_mut as n;
use std::sync::Arc;

use remora_client::KernelArgs;
use remora_client::proto::{RmDim3, RmLaunchArgs, RmLaunchAttr};
use remora_client::{CuError, CuResult, FunctionInfo, ModuleInfo, Session, cu};

use super::{DevPtr, Handle};
use crate::CUresult;
use crate::state::{
    self, Kind, dec, enc, entry, non_null, put, put_opt, put_out, read_in, stream_ref,
};

/// A `CUfunction`, or a `CUkernel` in its place (as CUDA accepts), to the function's info;
/// a kernel resolves to its function in the current context.
pub(crate) fn function_info(f: Handle) -> CuResult<(&'static Session, Arc<FunctionInfo>)> {
    let s = state::session()?;
    if f.is_null() {
        return Err(CuError(cu::INVALID_HANDLE));
    }
    let info = match state::kind_of(f) {
        Some(Kind::Kernel) => s.kernel_function(dec(Kind::Kernel, f)?, state::current_ctx()?)?,
        _ => s
            .function(dec(Kind::Function, f)?)
            .ok_or(CuError(cu::INVALID_HANDLE))?,
    };
    Ok((s, info))
}

/// The protocol handle of a `CUfunction` (or `CUkernel`).
fn func_handle(f: Handle) -> CuResult<u64> {
    function_info(f).map(|(_, i)| i.handle)
}

/// Loads the kernel image at `image` (an ELF cubin, PTX text, a fatbin or a fatbin wrapper)
/// in the current context and writes the module's handle to `module`; also says the image's
/// size.
pub(crate) fn load_image(
    module: *mut Handle,
    image: *const c_void,
) -> CuResult<(Arc<ModuleInfo>, usize)> {
    non_null(module)?;
    // SAFETY: `image` is a kernel image as cuModuleLoadData documents (from the CUDA runtime:
    // its registered fatbin), readable for the extent its headers describe; `locate` reads
    // only those headers.
    let (p, n) = unsafe { crate::image::locate(image.cast()) }?;
    // SAFETY: `locate` found the image to span `n` readable bytes from `p`.
    let bytes = unsafe { std::slice::from_raw_parts(p, n) };
    let s = state::session()?;
    let m = s.module_load(state::current_ctx()?, bytes)?;
    // SAFETY: `module` is non-null (checked) and writable per cuda.h.
    unsafe { put(module, enc(Kind::Module, m.handle)) }?;
    Ok((m, n))
}

fn load(module: *mut Handle, image: *const c_void) -> CuResult<()> {
    load_image(module, image).map(|_| ())
}

/// The bytes of a module file for the server: the file is read here (no client path reaches
/// the server). A text image (PTX, or anything but an ELF cubin or a fatbin) gets the NUL
/// terminator that `cuModuleLoadData` expects of text.
fn module_file(fname: *const c_char) -> CuResult<Vec<u8>> {
    non_null(fname)?;
    // SAFETY: a NUL-terminated path per cuda.h.
    let bytes = unsafe { std::ffi::CStr::from_ptr(fname) }.to_bytes();
    let path =
        std::path::Path::new(<std::ffi::OsStr as std::os::unix::ffi::OsStrExt>::from_bytes(bytes));
    let not_found = |e: std::io::Error| {
        tracing::warn!("remora: cuModuleLoad cannot read {}: {e}", path.display());
        CuError(if e.kind() == std::io::ErrorKind::NotFound {
            cu::FILE_NOT_FOUND
        } else {
            cu::INVALID_VALUE
        })
    };
    let len = std::fs::metadata(path).map_err(not_found)?.len();
    if len == 0 || len >= u64::from(remora_client::proto::RM_MAX_IMAGE) {
        tracing::warn!(
            "remora: cuModuleLoad: {} has {len} bytes, not a module Remora can carry",
            path.display()
        );
        return Err(CuError(cu::INVALID_IMAGE));
    }
    let mut image = std::fs::read(path).map_err(not_found)?;
    let binary = image.starts_with(b"\x7fELF") || image.starts_with(&[0x50, 0xed, 0x55, 0xba]);
    if !binary && image.last() != Some(&0) {
        image.push(0);
    }
    Ok(image)
}

/// `cuModuleLoad`: reads the file in the client and loads its bytes like `cuModuleLoadData`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleLoad(module: *mut Handle, fname: *const c_char) -> CUresult {
    entry("cuModuleLoad", || {
        non_null(module)?;
        let image = module_file(fname)?;
        let m = state::session()?.module_load(state::current_ctx()?, &image)?;
        // SAFETY: output pointer per cuda.h.
        unsafe { put(module, enc(Kind::Module, m.handle)) }
    })
}

entry_points! {
    cuModuleLoadData(module: *mut Handle, image: *const c_void) => load(module, image);
    /// JIT options are accepted and ignored (the server's driver JITs with its defaults).
    cuModuleLoadDataEx(module: *mut Handle, image: *const c_void, _num_options: c_uint, _options: *mut c_int, _values: *mut *mut c_void)
        => load(module, image);
    cuModuleLoadFatBinary(module: *mut Handle, image: *const c_void) => load(module, image);
}

#[unsafe(no_mangle)]
pub extern "C" fn cuModuleUnload(module: Handle) -> CUresult {
    entry("cuModuleUnload", || {
        state::session()?.module_unload(dec(Kind::Module, module)?)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetFunction(
    f: *mut Handle,
    module: Handle,
    name: *const c_char,
) -> CUresult {
    entry("cuModuleGetFunction", || {
        let name = state::c_name(name)?;
        let info = state::session()?.module_get_function(dec(Kind::Module, module)?, &name)?;
        // SAFETY: output pointer per cuda.h.
        unsafe { put(f, enc(Kind::Function, info.handle)) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuModuleGetGlobal_v2(
    dptr: *mut DevPtr,
    bytes: *mut usize,
    module: Handle,
    name: *const c_char,
) -> CUresult {
    entry("cuModuleGetGlobal_v2", || {
        let name = state::c_name(name)?;
        let range = state::session()?.module_get_global(dec(Kind::Module, module)?, &name)?;
        // SAFETY: optional output pointers per cuda.h.
        unsafe { state::put_range(dptr, bytes, range) }
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFuncGetAttribute(
    value: *mut c_int,
    attrib: c_int,
    f: Handle,
) -> CUresult {
    entry("cuFuncGetAttribute", || {
        check_func_attribute(attrib)?;
        let v = state::session()?.func_get_attribute(func_handle(f)?, attrib)?;
        // SAFETY: output pointer per cuda.h.
        unsafe { put(value, v) }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuFuncSetAttribute(f: Handle, attrib: c_int, value: c_int) -> CUresult {
    entry("cuFuncSetAttribute", || {
        check_func_attribute(attrib)?;
        state::session()?.func_set_attribute(func_handle(f)?, attrib, value)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuFuncLoad(f: Handle) -> CUresult {
    entry("cuFuncLoad", || {
        let (s, info) = function_info(f)?;
        s.func_load(info.handle)
    })
}

/// `CU_FUNCTION_LOADING_STATE_LOADED` or `_UNLOADED` (1, 0) into `state`.
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFuncIsLoaded(state: *mut c_int, f: Handle) -> CUresult {
    entry("cuFuncIsLoaded", || {
        non_null(state)?;
        let (s, info) = function_info(f)?;
        put_out(state, c_int::from(s.func_is_loaded(info.handle)?))
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuFuncSetCacheConfig(f: Handle, config: c_uint) -> CUresult {
    entry("cuFuncSetCacheConfig", || {
        if config > 3 {
            return Err(CuError(cu::INVALID_VALUE));
        }
        state::session()?.func_set_cache_config(func_handle(f)?, config)
    })
}

entry_points! {
    cuFuncGetParamInfo(f: Handle, index: usize, offset: *mut usize, size: *mut usize) =>
        param_info(f, index, offset, size);
}

/// `cuFuncGetParamInfo`/`cuKernelGetParamInfo`: the offset and size of parameter `index` of
/// function `f` into the optional outputs `offset` and `size`.
pub(crate) fn param_info(
    f: Handle,
    index: usize,
    offset: *mut usize,
    size: *mut usize,
) -> CuResult<()> {
    let (_, info) = function_info(f)?;
    let p = info.params.get(index).ok_or(CuError(cu::INVALID_VALUE))?;
    // SAFETY: optional output pointers per cuda.h.
    unsafe {
        put_opt(offset, p.offset as usize)?;
        put_opt(size, p.size as usize)?;
    }
    Ok(())
}

/// Checks that `attrib` is a `CUfunction_attribute` (0 to 20).
pub(crate) fn check_func_attribute(attrib: c_int) -> CuResult<()> {
    if (0..=20).contains(&attrib) {
        Ok(())
    } else {
        Err(CuError(cu::INVALID_VALUE))
    }
}

struct Launch {
    f: Handle,
    grid: [u32; 3],
    block: [u32; 3],
    shared: u32,
    stream: Handle,
    ptds: bool,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    attrs: Vec<RmLaunchAttr>,
}

/// Validation and packing are the client's ([`remora_client::Session::launch_kernel`]); the
/// shim maps the C handles and says where the parameters are.
fn launch(l: Launch) -> CuResult<()> {
    let ctx = state::current_ctx()?;
    let (s, info) = function_info(l.f)?;
    let args = match (l.params.is_null(), l.extra.is_null()) {
        (false, true) => KernelArgs::Params(l.params.cast_const().cast()),
        (true, false) => KernelArgs::Extra(l.extra.cast_const().cast()),
        (true, true) => KernelArgs::None,
        (false, false) => return Err(CuError(cu::INVALID_VALUE)),
    };
    let config = remora_client::LaunchConfig {
        grid: l.grid,
        block: l.block,
        shared_mem_bytes: l.shared,
        stream: stream_ref(l.stream, l.ptds)?,
        attrs: l.attrs,
    };
    // SAFETY: kernelParams holds one pointer per parameter, and `extra` is a
    // CU_LAUNCH_PARAM_END-terminated array, per cuda.h.
    unsafe { s.launch_kernel(ctx, &info, &config, args) }
}

/// A launch of `cuLaunchKernel` or `cuLaunchCooperativeKernel` (kernelParams or `extra`).
#[allow(clippy::too_many_arguments)]
fn launch_grid(
    f: Handle,
    grid: [u32; 3],
    block: [u32; 3],
    shared: u32,
    stream: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    ptds: bool,
    cooperative: bool,
) -> CuResult<()> {
    let attrs = if cooperative {
        vec![RmLaunchAttr::RmLaunchCooperative(1)]
    } else {
        Vec::new()
    };
    launch(Launch {
        f,
        grid,
        block,
        shared,
        stream,
        ptds,
        params,
        extra,
        attrs,
    })
}

entry_points! {
    cuLaunchKernel(f: Handle, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, st: Handle, params: *mut *mut c_void, extra: *mut *mut c_void)
        => launch_grid(f, [gx, gy, gz], [bx, by, bz], shared, st, params, extra, false, false);
    cuLaunchKernel_ptsz(f: Handle, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, st: Handle, params: *mut *mut c_void, extra: *mut *mut c_void)
        => launch_grid(f, [gx, gy, gz], [bx, by, bz], shared, st, params, extra, true, false);
    cuLaunchCooperativeKernel(f: Handle, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, st: Handle, params: *mut *mut c_void)
        => launch_grid(f, [gx, gy, gz], [bx, by, bz], shared, st, params, n(), false, true);
    cuLaunchCooperativeKernel_ptsz(f: Handle, gx: c_uint, gy: c_uint, gz: c_uint, bx: c_uint, by: c_uint, bz: c_uint, shared: c_uint, st: Handle, params: *mut *mut c_void)
        => launch_grid(f, [gx, gy, gz], [bx, by, bz], shared, st, params, n(), true, true);
}

/// `CUlaunchAttribute`: id, padding to 8, a 64-byte value union.
#[repr(C)]
pub struct LaunchAttribute {
    id: u32,
    pad: [u8; 4],
    value: [u8; 64],
}

/// `CUlaunchConfig`.
#[repr(C)]
pub struct LaunchConfig {
    grid: [u32; 3],
    block: [u32; 3],
    shared: u32,
    stream: Handle,
    attrs: *const LaunchAttribute,
    num_attrs: u32,
}

fn attrs_of(cfg: &LaunchConfig) -> CuResult<Vec<RmLaunchAttr>> {
    if cfg.num_attrs == 0 {
        return Ok(Vec::new());
    }
    if cfg.attrs.is_null() || cfg.num_attrs > 64 {
        return Err(CuError(cu::INVALID_VALUE));
    }
    // SAFETY: `attrs` holds `num_attrs` attributes per cuda.h.
    let attrs = unsafe { std::slice::from_raw_parts(cfg.attrs, cfg.num_attrs as usize) };
    let word = |v: &[u8; 64], i: usize| {
        u32::from_ne_bytes([v[4 * i], v[4 * i + 1], v[4 * i + 2], v[4 * i + 3]])
    };
    let mut out = Vec::new();
    for a in attrs {
        out.push(match a.id {
            0 => continue, // CU_LAUNCH_ATTRIBUTE_IGNORE
            2 => RmLaunchAttr::RmLaunchCooperative(word(&a.value, 0) as i32),
            4 => RmLaunchAttr::RmLaunchClusterDimension(RmDim3 {
                x: word(&a.value, 0),
                y: word(&a.value, 1),
                z: word(&a.value, 2),
            }),
            5 => RmLaunchAttr::RmLaunchClusterScheduling(word(&a.value, 0) as i32),
            6 => RmLaunchAttr::RmLaunchProgrammaticSerialization(word(&a.value, 0) as i32),
            8 => RmLaunchAttr::RmLaunchPriority(word(&a.value, 0) as i32),
            10 => RmLaunchAttr::RmLaunchMemSyncDomain(word(&a.value, 0) as i32),
            1 | 3 | 7 | 9 | 11..=32 => {
                tracing::warn!(
                    "remora: launch attribute {} is not supported yet; returning CUDA_ERROR_NOT_SUPPORTED",
                    a.id
                );
                return Err(CuError(cu::NOT_SUPPORTED));
            }
            _ => return Err(CuError(cu::INVALID_VALUE)),
        });
    }
    if out.len() > 8 {
        return Err(CuError(cu::NOT_SUPPORTED));
    }
    Ok(out)
}

fn launch_ex(
    cfg: *const LaunchConfig,
    f: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
    ptds: bool,
) -> CuResult<()> {
    non_null(cfg)?;
    // SAFETY: a valid CUlaunchConfig per cuda.h.
    let cfg = unsafe { &*cfg };
    launch(Launch {
        f,
        grid: cfg.grid,
        block: cfg.block,
        shared: cfg.shared,
        stream: cfg.stream,
        ptds,
        params,
        extra,
        attrs: attrs_of(cfg)?,
    })
}

entry_points! {
    cuLaunchKernelEx(cfg: *const LaunchConfig, f: Handle, params: *mut *mut c_void, extra: *mut *mut c_void)
        => launch_ex(cfg, f, params, extra, false);
    cuLaunchKernelEx_ptsz(cfg: *const LaunchConfig, f: Handle, params: *mut *mut c_void, extra: *mut *mut c_void)
        => launch_ex(cfg, f, params, extra, true);
}

fn occupancy(n: *mut c_int, f: Handle, block: c_int, smem: usize, flags: c_uint) -> CuResult<()> {
    if flags > 1 {
        return Err(CuError(cu::INVALID_VALUE));
    }
    let v = state::session()?.occupancy_max_active_blocks(
        func_handle(f)?,
        block,
        smem as u64,
        flags,
    )?;
    // SAFETY: output pointer per cuda.h.
    unsafe { put(n, v) }
}

entry_points! {
    cuOccupancyMaxActiveBlocksPerMultiprocessor(n: *mut c_int, f: Handle, block: c_int, smem: usize)
        => occupancy(n, f, block, smem, 0);
    cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(n: *mut c_int, f: Handle, block: c_int, smem: usize, flags: c_uint)
        => occupancy(n, f, block, smem, flags);
}

fn stream_create(ps: *mut Handle, flags: c_uint, priority: c_int) -> CuResult<()> {
    if flags > 1 {
        return Err(CuError(cu::INVALID_VALUE));
    }
    let ctx = state::current_ctx()?;
    let h = state::session()?.stream_create(ctx, flags, priority)?;
    state::note_stream(h, flags, priority, ctx);
    // SAFETY: output pointer per cuda.h.
    unsafe { put(ps, enc(Kind::Stream, h)) }
}

entry_points! {
    cuStreamCreate(ps: *mut Handle, flags: c_uint) => stream_create(ps, flags, 0);
    cuStreamCreateWithPriority(ps: *mut Handle, flags: c_uint, priority: c_int) => stream_create(ps, flags, priority);
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamDestroy_v2(st: Handle) -> CUresult {
    entry("cuStreamDestroy_v2", || {
        let h = dec(Kind::Stream, st)?;
        state::session()?.stream_destroy(h)?;
        state::forget_stream(h);
        Ok(())
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuStreamDestroy(st: Handle) -> CUresult {
    cuStreamDestroy_v2(st)
}

/// A stream to (session, its context, protocol handle).
pub(crate) fn mapped(st: Handle, ptds: bool) -> CuResult<(&'static Session, u64, u64)> {
    let s = state::session()?;
    let r = stream_ref(st, ptds)?;
    let ctx = state::stream_ctx(r)?;
    let h = s.stream_handle(ctx, r)?;
    Ok((s, ctx, h))
}

fn query(st: Handle, ptds: bool) -> CuResult<()> {
    let (s, ctx, h) = mapped(st, ptds)?;
    if s.stream_query(ctx, h)? {
        Ok(())
    } else {
        Err(CuError(cu::NOT_READY))
    }
}

fn wait(st: Handle, ev: Handle, flags: c_uint, ptds: bool) -> CuResult<()> {
    if flags > 1 {
        return Err(CuError(cu::INVALID_VALUE));
    }
    let (s, ctx, h) = mapped(st, ptds)?;
    s.stream_wait_event(ctx, h, dec(Kind::Event, ev)?, flags)
}

fn props(st: Handle, ptds: bool) -> CuResult<(u32, i32)> {
    state::stream_props(stream_ref(st, ptds)?)
}

fn record(ev: Handle, st: Handle, ptds: bool) -> CuResult<()> {
    let e = dec(Kind::Event, ev)?;
    let (s, ctx, h) = mapped(st, ptds)?;
    s.event_record(ctx, e, h)
}

/// `CU_EVENT_RECORD_EXTERNAL`.
const EVENT_RECORD_EXTERNAL: c_uint = 1;

/// `cuEventRecordWithFlags`: the default flag (0, which the CUDA runtime's `cudaEventRecord`
/// may pass) records as `cuEventRecord`. `CU_EVENT_RECORD_EXTERNAL` (an event record *node*
/// in a stream capture) is not implemented yet and is refused by name; other bits are invalid.
fn record_with_flags(ev: Handle, st: Handle, flags: c_uint, ptds: bool) -> CuResult<()> {
    match flags {
        0 => record(ev, st, ptds),
        EVENT_RECORD_EXTERNAL => {
            tracing::warn!(
                "remora: cuEventRecordWithFlags with CU_EVENT_RECORD_EXTERNAL (an external event node in a stream capture) is not implemented yet; returning CUDA_ERROR_NOT_SUPPORTED"
            );
            Err(CuError(cu::NOT_SUPPORTED))
        }
        _ => Err(CuError(cu::INVALID_VALUE)),
    }
}

/// `CUhostFn`.
pub type HostFn = Option<unsafe extern "C" fn(*mut c_void)>;
/// `CUstreamCallback`.
pub type StreamCallback = Option<unsafe extern "C" fn(Handle, CUresult, *mut c_void)>;

/// A pointer the application handed to a host callback, carried to the callback thread.
struct AppPtr(*mut c_void);
// SAFETY: CUDA lets the application pass any `userData` (and stream handle) to a callback
// that runs on another thread; the shim never dereferences it, only hands it back.
unsafe impl Send for AppPtr {}

/// `cuLaunchHostFunc`: `f(user)` runs in this process when the stream reaches this point.
fn host_func(st: Handle, f: HostFn, user: *mut c_void, ptds: bool) -> CuResult<()> {
    let f = f.ok_or(CuError(cu::INVALID_VALUE))?;
    let (s, ctx, h) = mapped(st, ptds)?;
    let user = AppPtr(user);
    s.launch_host_func(
        ctx,
        h,
        Box::new(move |_status| {
            let user = user;
            // SAFETY: the application's host function with its own user data, called once,
            // as cuLaunchHostFunc promises; it must not call CUDA (entry refuses if it does).
            unsafe { f(user.0) }
        }),
    )
}

/// `cuStreamAddCallback`: `cb(stream, status, user)` with the stream as the application named
/// it and CUDA_SUCCESS or the context's sticky error.
fn stream_callback(
    st: Handle,
    cb: StreamCallback,
    user: *mut c_void,
    flags: c_uint,
    ptds: bool,
) -> CuResult<()> {
    let cb = cb.ok_or(CuError(cu::INVALID_VALUE))?;
    if flags != 0 {
        return Err(CuError(cu::INVALID_VALUE));
    }
    let (s, ctx, h) = mapped(st, ptds)?;
    let (user, stream) = (AppPtr(user), AppPtr(st));
    s.launch_host_func(
        ctx,
        h,
        Box::new(move |status| {
            let (user, stream) = (user, stream);
            // SAFETY: the application's stream callback with its own arguments, called once,
            // as cuStreamAddCallback promises.
            unsafe { cb(stream.0, status, user.0) }
        }),
    )
}

/// `cuStreamSetAttribute`: the attributes CUDA defines for streams (access policy window,
/// synchronization policy, priority, memory sync domain and its map); others are
/// `CUDA_ERROR_INVALID_VALUE`, as natively.
fn set_attribute(st: Handle, kind: c_int, value: *const [u8; 64], ptds: bool) -> CuResult<()> {
    // A CUstreamAttrValue (64 bytes) per cuda.h.
    let v = read_in(value)?;
    let attr =
        remora_client::proto_stream_attr::from_abi(kind, &v).ok_or(CuError(cu::INVALID_VALUE))?;
    let (s, ctx, h) = mapped(st, ptds)?;
    s.stream_set_attribute(ctx, h, attr)
}

/// `cuStreamGetAttribute`.
fn get_attribute(st: Handle, kind: c_int, out: *mut [u8; 64], ptds: bool) -> CuResult<()> {
    if out.is_null() || remora_client::proto_stream_attr::from_abi(kind, &[0; 64]).is_none() {
        return Err(CuError(cu::INVALID_VALUE));
    }
    let (s, ctx, h) = mapped(st, ptds)?;
    let attr = s.stream_get_attribute(ctx, h, kind)?;
    put_out(out, remora_client::proto_stream_attr::to_abi(&attr).1)
}

entry_points! {
    cuStreamSetAttribute(st: Handle, kind: c_int, value: *const [u8; 64]) => set_attribute(st, kind, value, false);
    cuStreamSetAttribute_ptsz(st: Handle, kind: c_int, value: *const [u8; 64]) => set_attribute(st, kind, value, true);
    cuStreamGetAttribute(st: Handle, kind: c_int, out: *mut [u8; 64]) => get_attribute(st, kind, out, false);
    cuStreamGetAttribute_ptsz(st: Handle, kind: c_int, out: *mut [u8; 64]) => get_attribute(st, kind, out, true);
    cuStreamSynchronize(st: Handle) => { let (s, c, h) = mapped(st, false)?; s.stream_synchronize(c, h) };
    cuStreamSynchronize_ptsz(st: Handle) => { let (s, c, h) = mapped(st, true)?; s.stream_synchronize(c, h) };
    cuStreamQuery(st: Handle) => query(st, false);
    cuStreamQuery_ptsz(st: Handle) => query(st, true);
    cuStreamWaitEvent(st: Handle, ev: Handle, flags: c_uint) => wait(st, ev, flags, false);
    cuStreamWaitEvent_ptsz(st: Handle, ev: Handle, flags: c_uint) => wait(st, ev, flags, true);
    cuStreamGetPriority(st: Handle, p: *mut c_int) => put_out(p, props(st, false)?.1);
    cuStreamGetPriority_ptsz(st: Handle, p: *mut c_int) => put_out(p, props(st, true)?.1);
    cuStreamGetFlags(st: Handle, f: *mut c_uint) => put_out(f, props(st, false)?.0);
    cuStreamGetFlags_ptsz(st: Handle, f: *mut c_uint) => put_out(f, props(st, true)?.0);
    cuStreamGetId(st: Handle, id: *mut u64) => { let (s, c, h) = mapped(st, false)?; put_out(id, s.stream_get_id(c, h)?) };
    cuStreamGetId_ptsz(st: Handle, id: *mut u64) => { let (s, c, h) = mapped(st, true)?; put_out(id, s.stream_get_id(c, h)?) };
    cuEventRecord(ev: Handle, st: Handle) => record(ev, st, false);
    cuEventRecord_ptsz(ev: Handle, st: Handle) => record(ev, st, true);
    cuEventRecordWithFlags(ev: Handle, st: Handle, flags: c_uint) => record_with_flags(ev, st, flags, false);
    cuEventRecordWithFlags_ptsz(ev: Handle, st: Handle, flags: c_uint) => record_with_flags(ev, st, flags, true);
    cuLaunchHostFunc(st: Handle, f: HostFn, user: *mut c_void) => host_func(st, f, user, false);
    cuLaunchHostFunc_ptsz(st: Handle, f: HostFn, user: *mut c_void) => host_func(st, f, user, true);
    cuStreamAddCallback(st: Handle, cb: StreamCallback, user: *mut c_void, flags: c_uint) => stream_callback(st, cb, user, flags, false);
    cuStreamAddCallback_ptsz(st: Handle, cb: StreamCallback, user: *mut c_void, flags: c_uint) => stream_callback(st, cb, user, flags, true);
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventCreate(pe: *mut Handle, flags: c_uint) -> CUresult {
    entry("cuEventCreate", || {
        if flags & !0xF != 0 {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let h = state::session()?.event_create(state::current_ctx()?, flags)?;
        put_out(pe, enc(Kind::Event, h))
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventQuery(ev: Handle) -> CUresult {
    entry("cuEventQuery", || {
        if state::session()?.event_query(dec(Kind::Event, ev)?)? {
            Ok(())
        } else {
            Err(CuError(cu::NOT_READY))
        }
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventSynchronize(ev: Handle) -> CUresult {
    entry("cuEventSynchronize", || {
        state::session()?.event_synchronize(dec(Kind::Event, ev)?)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime_v2(
    ms: *mut f32,
    start: Handle,
    end: Handle,
) -> CUresult {
    entry("cuEventElapsedTime_v2", || {
        let v = state::session()?
            .event_elapsed_time(dec(Kind::Event, start)?, dec(Kind::Event, end)?)?;
        put_out(ms, v)
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuEventElapsedTime(ms: *mut f32, start: Handle, end: Handle) -> CUresult {
    // SAFETY: same contract.
    unsafe { cuEventElapsedTime_v2(ms, start, end) }
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventDestroy_v2(ev: Handle) -> CUresult {
    entry("cuEventDestroy_v2", || {
        state::session()?.event_destroy(dec(Kind::Event, ev)?)
    })
}

#[unsafe(no_mangle)]
pub extern "C" fn cuEventDestroy(ev: Handle) -> CUresult {
    cuEventDestroy_v2(ev)
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFuncGetName(name: *mut *const c_char, f: Handle) -> CUresult {
    entry("cuFuncGetName", || {
        let (_, info) = function_info(f)?;
        // The name lives as long as the function's module stays loaded, as in CUDA.
        put_out(name, info.c_name.as_ptr())
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuFuncGetModule(module: *mut Handle, f: Handle) -> CUresult {
    entry("cuFuncGetModule", || {
        let (_, info) = function_info(f)?;
        put_out(module, enc(Kind::Module, info.module))
    })
}

/// The launch configuration as the protocol carries it (no parameters).
fn config_args(f: Handle, cfg: *const LaunchConfig) -> CuResult<RmLaunchArgs> {
    non_null(cfg)?;
    // SAFETY: a valid CUlaunchConfig per cuda.h.
    let cfg = unsafe { &*cfg };
    let (s, info) = function_info(f)?;
    let ctx = state::current_ctx()?;
    let dim = |d: [u32; 3]| RmDim3 {
        x: d[0],
        y: d[1],
        z: d[2],
    };
    Ok(RmLaunchArgs {
        ctx,
        function: info.handle,
        grid: dim(cfg.grid),
        block: dim(cfg.block),
        shared_mem_bytes: cfg.shared,
        stream: s.stream_handle(ctx, stream_ref(cfg.stream, false)?)?,
        params: Vec::new().into(),
        attrs: attrs_of(cfg)?,
    })
}

#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuOccupancyMaxActiveClusters(
    n: *mut c_int,
    f: Handle,
    cfg: *const LaunchConfig,
) -> CUresult {
    entry("cuOccupancyMaxActiveClusters", || {
        let args = config_args(f, cfg)?;
        let v = state::session()?.occupancy_max_active_clusters(&args)?;
        put_out(n, v)
    })
}

/// `CUoccupancyB2DSize`: dynamic shared memory for a block size.
pub type B2DSize = Option<unsafe extern "C" fn(c_int) -> usize>;

/// Without a callback the server answers; with one, the shim searches the block sizes itself
/// (multiples of the warp size up to the limit), calling the callback and
/// RM_OCCUPANCY_MAX_ACTIVE_BLOCKS for each (see `remora_client::launch::potential_block_size`).
fn potential_block_size(
    min_grid: *mut c_int,
    block: *mut c_int,
    f: Handle,
    callback: B2DSize,
    smem: usize,
    limit: c_int,
    flags: c_uint,
) -> CuResult<()> {
    if min_grid.is_null() || block.is_null() || flags > 1 {
        return Err(CuError(cu::INVALID_VALUE));
    }
    let (s, info) = function_info(f)?;
    let (g, b) = match callback {
        None => s.occupancy_max_potential_block_size(info.handle, smem as u64, limit, flags)?,
        Some(cb) => s.occupancy_potential_block_size_with(
            state::ctx_device(state::current_ctx()?)?,
            info.handle,
            // SAFETY: the program's callback, called with a block size as cuda.h documents.
            |bs| unsafe { cb(bs) } as u64,
            limit,
            flags,
        )?,
    };
    put_out(min_grid, g)?;
    put_out(block, b)
}

entry_points! {
    cuOccupancyMaxPotentialBlockSize(
        min_grid: *mut c_int, block: *mut c_int, f: Handle, callback: B2DSize, smem: usize,
        limit: c_int,
    ) => potential_block_size(min_grid, block, f, callback, smem, limit, 0);
    cuOccupancyMaxPotentialBlockSizeWithFlags(
        min_grid: *mut c_int, block: *mut c_int, f: Handle, callback: B2DSize, smem: usize,
        limit: c_int, flags: c_uint,
    ) => potential_block_size(min_grid, block, f, callback, smem, limit, flags);
}

/// Searched with RM_OCCUPANCY_MAX_ACTIVE_BLOCKS (see
/// `remora_client::launch::available_dynamic_smem`).
#[unsafe(no_mangle)]
pub unsafe extern "C" fn cuOccupancyAvailableDynamicSMemPerBlock(
    out: *mut usize,
    f: Handle,
    num_blocks: c_int,
    block_size: c_int,
) -> CUresult {
    entry("cuOccupancyAvailableDynamicSMemPerBlock", || {
        let (s, info) = function_info(f)?;
        let v = s.occupancy_available_dynamic_smem(info.handle, num_blocks, block_size)?;
        put_out(out, v as usize)
    })
}
