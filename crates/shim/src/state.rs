//! Shim state: the session (made by cuInit), the per-thread context stack, handle encoding.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::c_void;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, Mutex, OnceLock};

use remora_client::{CuError, CuResult, Session, StreamRef, cu};

/// Handle kinds, in the low byte of every handle the shim gives out, so handles are never
/// NULL, never `CU_STREAM_LEGACY`/`CU_STREAM_PER_THREAD`, and a handle of the wrong kind is
/// caught.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum Kind {
    /// CUcontext
    Ctx = 0x11,
    /// CUmodule
    Module = 0x22,
    /// CUfunction
    Function = 0x33,
    /// CUstream
    Stream = 0x44,
    /// CUevent
    Event = 0x55,
    /// CUlibrary (a client-side id)
    Library = 0x66,
    /// CUkernel (a client-side id)
    Kernel = 0x77,
    /// CUgraph
    Graph = 0x88,
    /// CUgraphExec
    GraphExec = 0x99,
    /// CUmemoryPool
    MemPool = 0xAA,
    /// CUgraphNode
    GraphNode = 0xBB,
}

/// The kind of a non-NULL handle, from its low byte.
pub fn kind_of(p: *mut c_void) -> Option<Kind> {
    let v = p as usize as u64;
    if v >> 8 == 0 {
        return None;
    }
    [
        Kind::Ctx,
        Kind::Module,
        Kind::Function,
        Kind::Stream,
        Kind::Event,
        Kind::Library,
        Kind::Kernel,
        Kind::Graph,
        Kind::GraphExec,
        Kind::MemPool,
        Kind::GraphNode,
    ]
    .into_iter()
    .find(|k| v & 0xFF == *k as u64)
}

/// A protocol handle as the pointer-typed CUDA handle.
pub fn enc(kind: Kind, h: u64) -> *mut c_void {
    ((h << 8) | kind as u64) as usize as *mut c_void
}

/// A CUDA handle back to the protocol handle, checking its kind.
pub fn dec(kind: Kind, p: *mut c_void) -> CuResult<u64> {
    let v = p as usize as u64;
    if v & 0xFF != kind as u64 || v >> 8 == 0 {
        return Err(CuError(if kind == Kind::Ctx {
            cu::INVALID_CONTEXT
        } else {
            cu::INVALID_HANDLE
        }));
    }
    Ok(v >> 8)
}

/// A `CUstream` to a [`StreamRef`].
pub fn stream_ref(p: *mut c_void, per_thread_default: bool) -> CuResult<StreamRef> {
    match p as usize {
        0..=2 => Ok(StreamRef::from_raw(p as usize as u64, per_thread_default)),
        _ => Ok(StreamRef::Handle(dec(Kind::Stream, p)?)),
    }
}

/// The session handle of the stream of an asynchronous call, from the `(stream, per-thread
/// default)` its entry point got; `None` (no stream) for a synchronous call.
pub fn async_stream(
    s: &Session,
    ctx: u64,
    stream: Option<(*mut c_void, bool)>,
) -> CuResult<Option<u64>> {
    stream
        .map(|(st, ptds)| s.stream_handle(ctx, stream_ref(st, ptds)?))
        .transpose()
}

static SESSION: OnceLock<Result<Arc<Session>, i32>> = OnceLock::new();

unsafe extern "C" {
    /// C's `atexit` (libc, which every program loading the shim has).
    fn atexit(f: extern "C" fn()) -> std::ffi::c_int;
}

/// At exit: the session's call profile (`REMORA_CLIENT_PROFILE`) on standard error.
extern "C" fn print_profile_report() {
    let _ = std::panic::catch_unwind(|| {
        if let Some(Ok(s)) = SESSION.get()
            && let Some(report) = s.profile_report()
        {
            use std::io::Write as _;
            let _ = std::io::stderr().write_all(report.as_bytes());
        }
    });
}

/// At exit: the session's waiters' lines (`REMORA_WAIT_TRACE`), which are never dropped.
extern "C" fn trace_waits_at_exit() {
    let _ = std::panic::catch_unwind(|| {
        if let Some(Ok(s)) = SESSION.get() {
            s.trace_waits();
        }
    });
}

fn register_wait_trace() {
    // SAFETY: `trace_waits_at_exit` is an `extern "C" fn()` that never unwinds (it catches
    // panics), only reads the session, which lives until the process ends, and takes no lock
    // it would wait for (`try_lock` only).
    if unsafe { atexit(trace_waits_at_exit) } != 0 {
        tracing::warn!("remora: cannot register the waiters' report at exit (atexit failed)");
    }
}

fn register_profile_report() {
    // SAFETY: `print_profile_report` is an `extern "C" fn()` that never unwinds (it catches
    // panics) and only reads the session, which lives until the process ends.
    if unsafe { atexit(print_profile_report) } != 0 {
        tracing::warn!("remora: cannot register the client profile report at exit (atexit failed)");
    }
}

/// Connects once; the outcome is kept (a later cuInit returns the same result).
pub fn init() -> CuResult<()> {
    crate::log::init();
    let r = SESSION.get_or_init(|| match Session::from_env() {
        Ok(s) => {
            if s.device_count() == 0 {
                match s.driver_problem() {
                    // Session::connect has logged the server's reason already: say it once.
                    Some(reason) => tracing::debug!(
                        "remora: the server has no usable GPU: {reason}; cuInit returns CUDA_ERROR_NO_DEVICE"
                    ),
                    None => tracing::warn!(
                        "remora: the server has no usable GPU: it reports 0 devices; cuInit returns CUDA_ERROR_NO_DEVICE"
                    ),
                }
            }
            if s.profile_report().is_some() {
                register_profile_report();
            }
            if remora_client::tracing_waits() {
                register_wait_trace();
            }
            Ok(Arc::new(s))
        }
        Err(e) => {
            tracing::warn!("remora: cuInit failed ({e}); no GPU is available through Remora");
            Err(e.code())
        }
    });
    match r {
        Ok(s) if s.device_count() == 0 => Err(CuError(cu::NO_DEVICE)),
        Ok(_) => Ok(()),
        Err(code) => Err(CuError(*code)),
    }
}

/// The session, if cuInit connected one.
///
/// As with NVIDIA's driver, every call that needs the driver returns
/// `CUDA_ERROR_NOT_INITIALIZED` until a cuInit has succeeded — also after a cuInit that failed
/// (unreachable server, or a server with no GPU).
pub fn session() -> CuResult<&'static Session> {
    match SESSION.get() {
        Some(Ok(s)) if s.device_count() > 0 => Ok(s),
        _ => Err(CuError(cu::NOT_INITIALIZED)),
    }
}

thread_local! {
    static CTX_STACK: RefCell<Vec<u64>> = const { RefCell::new(Vec::new()) };
}

/// Runs `f` on this thread's context stack. The CUDA runtime and libraries call the driver
/// from exit handlers and thread-local destructors, after this thread's stack may be gone:
/// then the answer is `CUDA_ERROR_DEINITIALIZED` (as the driver answers while it shuts down),
/// never a panic.
fn with_stack<R>(f: impl FnOnce(&mut Vec<u64>) -> R) -> CuResult<R> {
    CTX_STACK
        .try_with(|s| s.try_borrow_mut().map(|mut s| f(&mut s)))
        .map_err(|_| CuError(cu::DEINITIALIZED))?
        .map_err(|_| CuError(cu::DEINITIALIZED))
}

/// The calling thread's current context.
pub fn current_ctx() -> CuResult<u64> {
    with_stack(|s| s.last().copied())?.ok_or(CuError(cu::INVALID_CONTEXT))
}

/// The protocol handle of a context argument; NULL means the current context.
pub fn ctx_or_current(ctx: crate::exports::Handle) -> CuResult<u64> {
    if ctx.is_null() {
        current_ctx()
    } else {
        dec(Kind::Ctx, ctx)
    }
}

/// The current context, or none (also once this thread's stack is gone).
pub fn current_ctx_opt() -> Option<u64> {
    with_stack(|s| s.last().copied()).ok().flatten()
}

/// Pushes a context on this thread's stack.
pub fn push_ctx(ctx: u64) -> CuResult<()> {
    with_stack(|s| s.push(ctx))
}

/// Pops this thread's current context.
pub fn pop_ctx() -> CuResult<Option<u64>> {
    with_stack(Vec::pop)
}

/// cuCtxSetCurrent: replaces the top (NULL unbinds it).
pub fn set_current(ctx: Option<u64>) -> CuResult<()> {
    with_stack(|s| {
        s.pop();
        if let Some(c) = ctx {
            s.push(c);
        }
    })
}

/// Removes `ctx` from this thread's stack (it was destroyed).
pub fn forget_ctx(ctx: u64) -> CuResult<()> {
    with_stack(|s| s.retain(|c| *c != ctx))
}

/// The device of a context (the session keeps the map).
pub fn ctx_device(ctx: u64) -> CuResult<i32> {
    session()?.ctx_device(ctx)
}

/// What the shim remembers of a stream it created.
#[derive(Debug, Clone, Copy)]
struct StreamInfo {
    flags: u32,
    priority: i32,
    ctx: u64,
}

fn stream_info() -> &'static Mutex<HashMap<u64, StreamInfo>> {
    static M: OnceLock<Mutex<HashMap<u64, StreamInfo>>> = OnceLock::new();
    M.get_or_init(Mutex::default)
}

/// Remembers a stream's flags, priority (answered locally by cuStreamGetFlags/Priority) and
/// context.
pub fn note_stream(h: u64, flags: u32, priority: i32, ctx: u64) {
    stream_info()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(
            h,
            StreamInfo {
                flags,
                priority,
                ctx,
            },
        );
}

/// The context a stream belongs to: the stream's own for a created stream, else the calling
/// thread's current context (the legacy and per-thread streams are the current context's).
pub fn stream_ctx(s: StreamRef) -> CuResult<u64> {
    if let StreamRef::Handle(h) = s
        && let Some(i) = stream_info()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&h)
    {
        return Ok(i.ctx);
    }
    current_ctx()
}

/// Forgets a stream.
pub fn forget_stream(h: u64) {
    stream_info()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&h);
}

/// A stream's (flags, priority); special streams are (0, 0).
pub fn stream_props(s: StreamRef) -> CuResult<(u32, i32)> {
    match s {
        StreamRef::Handle(h) => stream_info()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&h)
            .map(|i| (i.flags, i.priority))
            .ok_or(CuError(cu::INVALID_HANDLE)),
        _ => Ok((0, 0)),
    }
}

/// Runs an export body: panics become CUDA_ERROR_UNKNOWN, errors their code.
///
/// Logging is safe from exit handlers too (see `crates/shim/src/log.rs`); it stays inside the unwind
/// guard all the same.
pub fn entry(name: &'static str, f: impl FnOnce() -> CuResult<()>) -> i32 {
    if remora_client::in_host_callback() {
        // CUDA forbids CUDA calls from a host callback; here one that waited for the stream
        // the callback blocks would never return.
        let _ = catch_unwind(|| {
            tracing::warn!(
                "remora: {name} called from a host callback; returning CUDA_ERROR_NOT_PERMITTED"
            )
        });
        return cu::NOT_PERMITTED;
    }
    let r = catch_unwind(AssertUnwindSafe(|| {
        tracing::trace!("{name}");
        let r = f();
        if let Err(e) = &r {
            tracing::debug!("{name} -> {e}");
        }
        r
    }));
    match r {
        Ok(Ok(())) => cu::SUCCESS,
        Ok(Err(e)) => e.code(),
        Err(_) => {
            let _ = catch_unwind(|| {
                tracing::error!("remora: {name} panicked; returning CUDA_ERROR_UNKNOWN")
            });
            cu::UNKNOWN
        }
    }
}

/// `Ok` for a pointer argument that is not null, else CUDA_ERROR_INVALID_VALUE.
pub fn non_null<T>(p: *const T) -> CuResult<()> {
    if p.is_null() {
        Err(CuError(cu::INVALID_VALUE))
    } else {
        Ok(())
    }
}

/// Writes `v` to an output pointer.
///
/// # Safety
/// `p` is null (rejected with CUDA_ERROR_INVALID_VALUE) or valid for a write of `T`.
pub unsafe fn put<T>(p: *mut T, v: T) -> CuResult<()> {
    non_null(p)?;
    // SAFETY: non-null and valid for writes by the caller's contract; unaligned is allowed.
    unsafe { p.write_unaligned(v) };
    Ok(())
}

/// [`put`] of `v` converted to the output's C type (a value that does not fit is
/// CUDA_ERROR_UNKNOWN).
///
/// # Safety
/// As for [`put`].
pub unsafe fn put_as<T: TryFrom<U>, U>(p: *mut T, v: U) -> CuResult<()> {
    let v = T::try_from(v).map_err(|_| CuError(cu::UNKNOWN))?;
    // SAFETY: the caller's contract, as for `put`.
    unsafe { put(p, v) }
}

/// [`put`] to an output pointer that cuda.h defines for the calling entry point (null
/// rejected).
pub(crate) fn put_out<T>(p: *mut T, v: T) -> CuResult<()> {
    // SAFETY: output pointer per cuda.h (null rejected by `put`).
    unsafe { put(p, v) }
}

/// Reads an input pointer that cuda.h defines for the calling entry point (null is
/// CUDA_ERROR_INVALID_VALUE; unaligned is allowed).
pub(crate) fn read_in<T: Copy>(p: *const T) -> CuResult<T> {
    non_null(p)?;
    // SAFETY: non-null, and points to a `T` per cuda.h; unaligned is allowed.
    Ok(unsafe { p.read_unaligned() })
}

/// [`put`] for an optional output: a null `p` is skipped, not rejected.
///
/// # Safety
/// `p` is null or valid for writes of a `T` (unaligned allowed).
pub unsafe fn put_opt<T>(p: *mut T, v: T) -> CuResult<()> {
    if p.is_null() {
        return Ok(());
    }
    // SAFETY: non-null, and valid for writes by the caller's contract.
    unsafe { put(p, v) }
}

/// Writes a device range, its address `p` and `n` bytes, to the optional outputs `ptr_out`
/// and `size_out` (`cuModuleGetGlobal`, `cuLibraryGetGlobal`, `cuMemGetAddressRange`).
///
/// # Safety
/// Each pointer is null or valid for writes of its type (unaligned allowed).
pub unsafe fn put_range(
    ptr_out: *mut u64,
    size_out: *mut usize,
    (p, n): (u64, u64),
) -> CuResult<()> {
    // SAFETY: the caller's contract, for each pointer.
    unsafe {
        put_opt(ptr_out, p)?;
        put_opt(size_out, n as usize)
    }
}

/// A NUL-terminated name from the application (null is CUDA_ERROR_INVALID_VALUE).
pub(crate) fn c_name<'a>(name: *const std::ffi::c_char) -> CuResult<std::borrow::Cow<'a, str>> {
    non_null(name)?;
    // SAFETY: a non-null name is NUL-terminated per cuda.h.
    Ok(unsafe { std::ffi::CStr::from_ptr(name) }.to_string_lossy())
}

/// Copies a string with NUL into a caller buffer of `len` bytes, truncating.
///
/// # Safety
/// `p` is null (rejected) or valid for writes of `len` bytes.
pub unsafe fn put_str(p: *mut std::ffi::c_char, len: i32, s: &str) -> CuResult<()> {
    if p.is_null() || len <= 0 {
        return Err(CuError(cu::INVALID_VALUE));
    }
    let n = s.len().min(len as usize - 1);
    // SAFETY: `p` is writable for `len` bytes and `n + 1 <= len`.
    unsafe {
        std::ptr::copy_nonoverlapping(s.as_ptr(), p.cast::<u8>(), n);
        *p.add(n) = 0;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handles_round_trip_and_check_their_kind() {
        let p = enc(Kind::Stream, 1);
        assert!(p as usize > 2);
        assert_eq!(dec(Kind::Stream, p), Ok(1));
        assert_eq!(dec(Kind::Event, p), Err(CuError(cu::INVALID_HANDLE)));
        assert_eq!(dec(Kind::Ctx, p), Err(CuError(cu::INVALID_CONTEXT)));
        assert_eq!(
            stream_ref(std::ptr::null_mut(), false),
            Ok(StreamRef::Legacy)
        );
        assert_eq!(
            stream_ref(std::ptr::null_mut(), true),
            Ok(StreamRef::PerThread)
        );
        assert_eq!(
            stream_ref(2 as *mut c_void, false),
            Ok(StreamRef::PerThread)
        );
        assert_eq!(stream_ref(p, false), Ok(StreamRef::Handle(1)));
    }

    #[test]
    fn panics_do_not_cross_the_boundary() {
        assert_eq!(entry("test", || panic!("boom")), cu::UNKNOWN);
        assert_eq!(entry("test", || Err(CuError(5))), 5);
        assert_eq!(entry("test", || Ok(())), 0);
    }

    #[test]
    fn context_stack_is_per_thread() {
        push_ctx(5).unwrap();
        assert_eq!(current_ctx(), Ok(5));
        std::thread::spawn(|| assert!(current_ctx().is_err()))
            .join()
            .unwrap();
        set_current(Some(6)).unwrap();
        assert_eq!(current_ctx(), Ok(6));
        assert_eq!(pop_ctx(), Ok(Some(6)));
        assert!(current_ctx().is_err());
    }
}
