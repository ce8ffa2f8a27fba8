//! `cuGetExportTable`: the driver's private tables that the CUDA runtime (static or shared,
//! and the static runtimes inside cuBLAS, cuFFT, …) asks for by UUID.
//!
//! What each table holds comes from public reverse engineering (ZLUDA's dark-API notes, the
//! LUPINE list in the project's reference notes) and from watching CUDA 13's runtime call into
//! this shim (`docs/export-tables.md`); the implementation is our own. A table is an array of
//! pointer-sized slots; most begin with their own size in bytes. Every slot Remora does not
//! implement holds a *trap*, a function that logs the table and slot by name (once) and returns
//! `CUDA_ERROR_NOT_SUPPORTED`, so a runtime that reaches an unknown slot fails loudly instead of
//! jumping to NULL. A UUID Remora does not serve (unknown, or known but not implemented) is
//! logged and answered as NVIDIA's driver answers a table it lacks: `CUDA_ERROR_INVALID_VALUE`
//! with a null table, so that a library that can do without the table falls back (cuBLASLt asks
//! for tables a given driver may not have).

use std::collections::{HashMap, HashSet};
use std::ffi::{c_int, c_uint, c_void};
use std::sync::{Mutex, OnceLock};

use remora_client::{CuError, CuResult, cu};

use crate::exports::Handle;
use crate::state::{self, Kind, enc, entry, non_null, put};

/// A `CUuuid`, as its 16 bytes.
pub type Uuid = [u8; 16];

/// A table as the runtime sees it: pointer-sized slots.
#[repr(transparent)]
pub struct Slots<const N: usize>(pub [*const c_void; N]);

// SAFETY: the slots are written once at compile time and only read afterwards; they hold
// function addresses and sizes, never pointers to mutable data.
unsafe impl<const N: usize> Sync for Slots<N> {}

/// The tables Remora knows by UUID, in the order of [`TABLES`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Table {
    /// Module loading from fatbins, the primary context, and more.
    CudartInterface,
    /// The tools thread-local-storage table (size only).
    ToolsTls,
    /// Buffers through which tools install runtime callbacks.
    ToolsRuntimeCallbackHooks,
    /// Per-context storage for the runtime's own state (no size slot).
    ContextLocalStorage,
    /// A context-creation path that skips the runtime's hooks.
    CtxCreateBypass,
    /// Private heap allocation (not implemented).
    HeapAccess,
    /// Extended device attributes (not implemented).
    DeviceExtendedRt,
    /// The integrity token.
    IntegrityCheck,
    /// Context sanity checks.
    ContextChecks,
    /// The tools' view of contexts (`ToolsContext`), asked for by cuFFT and cuBLAS.
    ToolsContext,
    /// The tools' view of modules and functions (`ToolsModule`), asked for by cuFFT.
    ToolsModule,
    /// Asked for by cuBLASLt (bf16/fp16 GEMMs), which dereferences it without checking: a
    /// table must exist. Only its size is served; slot 4 declines (see `DECLINED`).
    CublasLt1734,
}

/// (table, name, UUID, served): a table that is not served is known by name only, and its
/// request is answered like an unknown one (but logged with its name).
pub const TABLES: [(Table, &str, Uuid, bool); 12] = [
    (
        Table::CudartInterface,
        "CUDART_INTERFACE",
        uuid("6bd5fb6c5bf4e74a8987d93912fd9df9"),
        true,
    ),
    (
        Table::ToolsTls,
        "TOOLS_TLS",
        uuid("42d85a8123f6cb478298f6e78a3aecdc"),
        true,
    ),
    (
        Table::ToolsRuntimeCallbackHooks,
        "TOOLS_RUNTIME_CALLBACK_HOOKS",
        uuid("a094798c2e742e7493f20800200c0a66"),
        true,
    ),
    (
        Table::ContextLocalStorage,
        "CONTEXT_LOCAL_STORAGE_INTERFACE_V0301",
        uuid("c693336e1121df11a8c368f355d89593"),
        true,
    ),
    (
        Table::CtxCreateBypass,
        "CTX_CREATE_BYPASS",
        uuid("0ca50b8c1004929a89a7d0df10e77286"),
        true,
    ),
    (
        Table::HeapAccess,
        "HEAP_ACCESS",
        uuid("195bcbf4d67d024aacc51d29cea631ae"),
        false,
    ),
    (
        Table::DeviceExtendedRt,
        "DEVICE_EXTENDED_RT",
        uuid("b10541e1f7c7c74a9f64f223be99f1e2"),
        false,
    ),
    (
        Table::IntegrityCheck,
        "INTEGRITY_CHECK",
        uuid("d4082055bde6704b8d34ba123c66e1f2"),
        true,
    ),
    (
        Table::ContextChecks,
        "CONTEXT_CHECKS",
        uuid("263e88607cd2614392f6bbd5006dfa7e"),
        true,
    ),
    (
        Table::ToolsContext,
        "TOOLS_CONTEXT",
        uuid("21318c60971432488ca641ff7324c8f2"),
        true,
    ),
    (
        Table::ToolsModule,
        "TOOLS_MODULE",
        uuid("6e163fbeb958444d835ce182aff1991e"),
        true,
    ),
    (
        Table::CublasLt1734,
        "CUBLASLT_1734DC26",
        uuid("1734dc26800d47458726c0f1e7dd8bca"),
        true,
    ),
];

const fn hex(c: u8) -> u8 {
    match c {
        b'0'..=b'9' => c - b'0',
        b'a'..=b'f' => c - b'a' + 10,
        _ => panic!("not a lowercase hex digit"),
    }
}

/// 32 hex digits to the UUID's bytes, in the order they are written.
pub const fn uuid(s: &str) -> Uuid {
    let b = s.as_bytes();
    assert!(b.len() == 32);
    let mut out = [0u8; 16];
    let mut i = 0;
    while i < 16 {
        out[i] = hex(b[2 * i]) << 4 | hex(b[2 * i + 1]);
        i += 1;
    }
    out
}

/// The UUID as CUDA tools print it: `{6BD5FB6C-5BF4-E74A-8987-D93912FD9DF9}`.
pub fn format_uuid(u: &Uuid) -> String {
    format!("{{{}}}", remora_client::uuid_groups(u, true))
}

// Traps --------------------------------------------------------------------------------------

/// The most slots a served table has (TOOLS_MODULE: a size and 98 functions).
const MAX_SLOTS: usize = 99;

fn trapped() -> &'static Mutex<HashSet<(usize, usize)>> {
    static M: OnceLock<Mutex<HashSet<(usize, usize)>>> = OnceLock::new();
    M.get_or_init(Mutex::default)
}

/// Slots that are not implemented but whose refusal a library is known to survive: (table,
/// slot, what was observed). They answer `CUDA_ERROR_NOT_SUPPORTED` like every trap and log
/// once at warn level instead of error level.
const DECLINED: [(Table, usize, &str); 1] = [(
    Table::CublasLt1734,
    4,
    "cuBLASLt carries on without it: on the H100 (driver 580) its GEMMs gave results identical to \
     the native run with this slot refused (docs/export-tables.md)",
)];

/// What every unimplemented slot does.
fn trap_called(table: usize, slot: usize) -> i32 {
    let first = trapped()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert((table, slot));
    if first {
        crate::log::init();
        let name = TABLES.get(table).map_or("?", |t| t.1);
        match DECLINED
            .iter()
            .find(|d| d.0 as usize == table && d.1 == slot)
        {
            Some((_, _, why)) => tracing::warn!(
                "remora: slot {slot} of the private driver table {name} is not implemented; returning CUDA_ERROR_NOT_SUPPORTED ({why})"
            ),
            None => tracing::error!(
                "remora: the CUDA runtime called slot {slot} of the private driver table {name}, which Remora does not implement; returning CUDA_ERROR_NOT_SUPPORTED"
            ),
        }
    }
    cu::NOT_SUPPORTED
}

extern "C" fn trap<const T: usize, const S: usize>() -> i32 {
    // No panic can cross the ABI: `trap_called` only locks (poison-tolerant) and logs.
    std::panic::catch_unwind(|| trap_called(T, S)).unwrap_or(cu::UNKNOWN)
}

macro_rules! traps {
    ($t:literal) => {
        traps!(@ $t;
            0 1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30 31
            32 33 34 35 36 37 38 39 40 41 42 43 44 45 46 47 48 49 50 51 52 53 54 55 56 57 58 59 60
            61 62 63 64 65 66 67 68 69 70 71 72 73 74 75 76 77 78 79 80 81 82 83 84 85 86 87 88 89
            90 91 92 93 94 95 96 97 98)
    };
    (@ $t:literal; $($s:literal)*) => {
        [$(trap::<$t, $s> as extern "C" fn() -> i32 as *const c_void),*]
    };
}

const TRAPS: [[*const c_void; MAX_SLOTS]; 12] = [
    traps!(0),
    traps!(1),
    traps!(2),
    traps!(3),
    traps!(4),
    traps!(5),
    traps!(6),
    traps!(7),
    traps!(8),
    traps!(9),
    traps!(10),
    traps!(11),
];

/// A table of `N` slots: traps everywhere, then the size in slot 0 when `sized`, then `fns`.
const fn build<const N: usize>(
    table: Table,
    sized: bool,
    fns: &[(usize, *const c_void)],
) -> Slots<N> {
    assert!(N <= MAX_SLOTS);
    let mut t = [std::ptr::null::<c_void>(); N];
    let mut i = 0;
    while i < N {
        t[i] = TRAPS[table as usize][i];
        i += 1;
    }
    if sized {
        t[0] = std::ptr::without_provenance(N * size_of::<usize>());
    }
    let mut j = 0;
    while j < fns.len() {
        t[fns[j].0] = fns[j].1;
        j += 1;
    }
    Slots(t)
}

/// Runs a table function body: no panic crosses the ABI, errors become their code.
fn call(table: &'static str, f: impl FnOnce() -> CuResult<()>) -> i32 {
    entry(table, || {
        tracing::debug!("remora: private table call {table}");
        f()
    })
}

/// Logs at debug level without ever unwinding (the runtime calls some slots from exit
/// handlers).
fn note(what: &str) {
    let _ = std::panic::catch_unwind(|| tracing::debug!("remora: private table call {what}"));
}

// CUDART_INTERFACE ---------------------------------------------------------------------------

fn load_image(module: *mut Handle, image: *const c_void) -> CuResult<()> {
    let (m, n) = crate::exports::load_image(module, image)?;
    tracing::debug!(
        "remora: the CUDA runtime loaded a {n}-byte image as module {} ({} functions)",
        m.handle,
        m.functions.len()
    );
    Ok(())
}

fn extra_args(name: &str, a3: *mut c_void, a4: *mut c_void, a5: c_uint) {
    if !a3.is_null() || !a4.is_null() || a5 != 0 {
        tracing::debug!(
            "remora: CUDART_INTERFACE {name}: extra arguments {a3:p} {a4:p} {a5} ignored"
        );
    }
}

extern "C" fn get_module_from_cubin(module: *mut Handle, wrapper: *const c_void) -> i32 {
    call("CUDART_INTERFACE get_module_from_cubin", || {
        load_image(module, wrapper)
    })
}

extern "C" fn primary_context(pctx: *mut Handle, dev: c_int) -> i32 {
    call("CUDART_INTERFACE primary_context", || {
        let h = state::session()?.primary_ctx_retain(dev)?;
        note_primary(dev, h);
        // SAFETY: output slot of the runtime (null rejected by `put`).
        unsafe { put(pctx, enc(Kind::Ctx, h)) }
    })
}

extern "C" fn get_module_from_cubin_ext1(
    module: *mut Handle,
    wrapper: *const c_void,
    a3: *mut c_void,
    a4: *mut c_void,
    a5: c_uint,
) -> i32 {
    call("CUDART_INTERFACE get_module_from_cubin_ext1", || {
        extra_args("get_module_from_cubin_ext1", a3, a4, a5);
        load_image(module, wrapper)
    })
}

/// Observed as a no-op in NVIDIA's driver as far as the runtime can tell; answers success.
extern "C" fn cudart_fn7(arg: usize) -> i32 {
    note(&format!("CUDART_INTERFACE fn7({arg:#x})"));
    cu::SUCCESS
}

extern "C" fn get_module_from_cubin_ext2(
    fatbin: *const c_void,
    module: *mut Handle,
    a3: *mut c_void,
    a4: *mut c_void,
    a5: c_uint,
) -> i32 {
    call("CUDART_INTERFACE get_module_from_cubin_ext2", || {
        extra_args("get_module_from_cubin_ext2", a3, a4, a5);
        load_image(module, fatbin)
    })
}

/// The CUDART_INTERFACE table.
pub static CUDART_INTERFACE: Slots<13> = build(
    Table::CudartInterface,
    true,
    &[
        (
            1,
            get_module_from_cubin as extern "C" fn(*mut Handle, *const c_void) -> i32
                as *const c_void,
        ),
        (
            2,
            primary_context as extern "C" fn(*mut Handle, c_int) -> i32 as *const c_void,
        ),
        (
            6,
            get_module_from_cubin_ext1
                as extern "C" fn(
                    *mut Handle,
                    *const c_void,
                    *mut c_void,
                    *mut c_void,
                    c_uint,
                ) -> i32 as *const c_void,
        ),
        (
            7,
            cudart_fn7 as extern "C" fn(usize) -> i32 as *const c_void,
        ),
        (
            8,
            get_module_from_cubin_ext2
                as extern "C" fn(
                    *const c_void,
                    *mut Handle,
                    *mut c_void,
                    *mut c_void,
                    c_uint,
                ) -> i32 as *const c_void,
        ),
    ],
);

// TOOLS_TLS, TOOLS_RUNTIME_CALLBACK_HOOKS ------------------------------------------------------

/// TOOLS_TLS slot 2: the calling thread's current context, as `cuCtxGetCurrent` answers
/// (cuBLAS asks for it before every GEMM; public reverse-engineering notes describe it so).
extern "C" fn tools_tls_current_context(ctx: *mut Handle) -> i32 {
    note("TOOLS_TLS current context");
    // SAFETY: `ctx` is the runtime's output slot; cuCtxGetCurrent rejects null.
    unsafe { crate::exports::cuCtxGetCurrent(ctx) }
}

/// The TOOLS_TLS table: its size and the current-context query (no tool is ever attached to a
/// Remora client).
pub static TOOLS_TLS: Slots<4> = build(
    Table::ToolsTls,
    true,
    &[(
        2,
        tools_tls_current_context as extern "C" fn(*mut Handle) -> i32 as *const c_void,
    )],
);

/// A zeroed buffer handed to the runtime, which may write into it.
#[repr(C, align(16))]
struct Buffer<const N: usize>(std::cell::UnsafeCell<[u8; N]>);

// SAFETY: Remora never reads or writes the buffer; only the runtime does, through the pointer
// it was given, under its own synchronization.
unsafe impl<const N: usize> Sync for Buffer<N> {}

/// Reported as 4096 bytes (1024 u32 callback slots, all empty); twice that is allocated.
static HOOKS_1: Buffer<8192> = Buffer(std::cell::UnsafeCell::new([0; 8192]));
/// Reported as 56 bytes (14 u32); more is allocated.
static HOOKS_2: Buffer<256> = Buffer(std::cell::UnsafeCell::new([0; 256]));

fn give_buffer(ptr: *mut *mut c_void, size: *mut usize, buf: *mut u8, reported: usize) {
    if ptr.is_null() || size.is_null() {
        return;
    }
    // SAFETY: both output pointers are non-null and writable per the table's contract.
    unsafe {
        ptr.write_unaligned(buf.cast());
        size.write_unaligned(reported);
    }
}

extern "C" fn callback_buffer_1(ptr: *mut *mut c_void, size: *mut usize) {
    note("TOOLS_RUNTIME_CALLBACK_HOOKS buffer 1");
    give_buffer(ptr, size, HOOKS_1.0.get().cast(), 4096);
}

extern "C" fn callback_buffer_2(ptr: *mut *mut c_void, size: *mut usize) {
    note("TOOLS_RUNTIME_CALLBACK_HOOKS buffer 2");
    give_buffer(ptr, size, HOOKS_2.0.get().cast(), 56);
}

/// The TOOLS_RUNTIME_CALLBACK_HOOKS table.
pub static TOOLS_RUNTIME_CALLBACK_HOOKS: Slots<7> = build(
    Table::ToolsRuntimeCallbackHooks,
    true,
    &[
        (
            2,
            callback_buffer_1 as extern "C" fn(*mut *mut c_void, *mut usize) as *const c_void,
        ),
        (
            6,
            callback_buffer_2 as extern "C" fn(*mut *mut c_void, *mut usize) as *const c_void,
        ),
    ],
);

// CONTEXT_LOCAL_STORAGE ------------------------------------------------------------------------

/// `void (*)(CUcontext, void *key, void *value)`, called when the context goes away.
pub type ClsDestructor = Option<extern "C" fn(Handle, *mut c_void, *mut c_void)>;

#[derive(Clone, Copy)]
struct ClsEntry {
    value: usize,
    dtor: ClsDestructor,
}

fn cls() -> &'static Mutex<HashMap<(u64, usize), ClsEntry>> {
    static M: OnceLock<Mutex<HashMap<(u64, usize), ClsEntry>>> = OnceLock::new();
    M.get_or_init(Mutex::default)
}

extern "C" fn cls_put(
    ctx: Handle,
    key: *mut c_void,
    value: *mut c_void,
    dtor: ClsDestructor,
) -> i32 {
    call("CONTEXT_LOCAL_STORAGE put", || {
        let h = state::ctx_or_current(ctx)?;
        cls().lock().unwrap_or_else(|e| e.into_inner()).insert(
            (h, key as usize),
            ClsEntry {
                value: value as usize,
                dtor,
            },
        );
        Ok(())
    })
}

extern "C" fn cls_delete(ctx: Handle, key: *mut c_void) -> i32 {
    call("CONTEXT_LOCAL_STORAGE delete", || {
        let h = state::ctx_or_current(ctx)?;
        cls()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .remove(&(h, key as usize));
        Ok(())
    })
}

/// A missing key answers `CUDA_ERROR_INVALID_HANDLE`, as NVIDIA's driver does; the runtime then
/// creates its state and puts it.
extern "C" fn cls_get(value: *mut *mut c_void, ctx: Handle, key: *mut c_void) -> i32 {
    let r = std::panic::catch_unwind(|| -> CuResult<()> {
        note("CONTEXT_LOCAL_STORAGE get");
        let h = state::ctx_or_current(ctx)?;
        let v = cls()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(h, key as usize))
            .map(|e| e.value)
            .ok_or(CuError(cu::INVALID_HANDLE))?;
        // SAFETY: output slot of the runtime (null rejected by `put`).
        unsafe { put(value, v as *mut c_void) }
    });
    match r {
        Ok(Ok(())) => cu::SUCCESS,
        Ok(Err(e)) => e.code(),
        Err(_) => cu::UNKNOWN,
    }
}

/// The CONTEXT_LOCAL_STORAGE_INTERFACE_V0301 table (slot 0 is a function, not a size).
pub static CONTEXT_LOCAL_STORAGE: Slots<4> = build(
    Table::ContextLocalStorage,
    false,
    &[
        (
            0,
            cls_put as extern "C" fn(Handle, *mut c_void, *mut c_void, ClsDestructor) -> i32
                as *const c_void,
        ),
        (
            1,
            cls_delete as extern "C" fn(Handle, *mut c_void) -> i32 as *const c_void,
        ),
        (
            2,
            cls_get as extern "C" fn(*mut *mut c_void, Handle, *mut c_void) -> i32 as *const c_void,
        ),
    ],
);

fn primaries() -> &'static Mutex<HashMap<c_int, u64>> {
    static M: OnceLock<Mutex<HashMap<c_int, u64>>> = OnceLock::new();
    M.get_or_init(Mutex::default)
}

/// Remembers a device's primary context (from `cuDevicePrimaryCtxRetain` or the runtime's
/// table), so that a reset can run its context-local-storage destructors.
pub fn note_primary(dev: c_int, ctx: u64) {
    primaries()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .insert(dev, ctx);
}

/// `cuDevicePrimaryCtxReset`: the device's primary context is gone.
pub fn primary_reset(dev: c_int) {
    let ctx = primaries()
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .remove(&dev);
    if let Some(ctx) = ctx {
        context_destroyed(ctx);
    }
}

/// Runs (outside the lock) and forgets the destructors registered for `ctx`.
pub fn context_destroyed(ctx: u64) {
    let gone: Vec<(usize, ClsEntry)> = {
        let mut m = cls().lock().unwrap_or_else(|e| e.into_inner());
        let keys: Vec<(u64, usize)> = m.keys().filter(|k| k.0 == ctx).copied().collect();
        keys.into_iter()
            .filter_map(|k| m.remove(&k).map(|e| (k.1, e)))
            .collect()
    };
    for (key, e) in gone {
        if let Some(dtor) = e.dtor {
            dtor(
                enc(Kind::Ctx, ctx),
                key as *mut c_void,
                e.value as *mut c_void,
            );
        }
    }
}

// CTX_CREATE_BYPASS ------------------------------------------------------------------------------

extern "C" fn ctx_create_bypass(pctx: *mut Handle, flags: c_uint, dev: c_int) -> i32 {
    // SAFETY: the same contract as cuCtxCreate_v2.
    unsafe { crate::exports::cuCtxCreate_v2(pctx, flags, dev) }
}

/// The CTX_CREATE_BYPASS table.
pub static CTX_CREATE_BYPASS: Slots<2> = build(
    Table::CtxCreateBypass,
    true,
    &[(
        1,
        ctx_create_bypass as extern "C" fn(*mut Handle, c_uint, c_int) -> i32 as *const c_void,
    )],
);

// INTEGRITY_CHECK ------------------------------------------------------------------------------

unsafe extern "C" {
    safe fn pthread_self() -> usize;
}

fn integrity_inputs(version: u32, unix_seconds: u64) -> CuResult<crate::integrity::Inputs> {
    let s = state::session()?;
    let mut devices = Vec::new();
    for dev in 0..s.device_count() {
        devices.push(crate::integrity::DeviceId {
            uuid: s.device_props(dev)?.uuid,
            pci_domain: s.device_attribute(dev, 50)?,
            pci_bus: s.device_attribute(dev, 33)?,
            pci_device: s.device_attribute(dev, 34)?,
        });
    }
    Ok(crate::integrity::Inputs {
        version,
        unix_seconds,
        driver_version: crate::exports::driver_version() as u32,
        process: std::process::id(),
        thread: pthread_self() as u32,
        cudart_table: CUDART_INTERFACE.0.as_ptr() as u64,
        integrity_table: INTEGRITY_CHECK.0.as_ptr() as u64,
        function: INTEGRITY_CHECK.0[1] as u64,
        devices,
    })
}

extern "C" fn integrity_check(version: c_uint, unix_seconds: u64, result: *mut [u64; 2]) -> i32 {
    call("INTEGRITY_CHECK", || {
        tracing::debug!("remora: INTEGRITY_CHECK version {version}");
        let token = crate::integrity::token(&integrity_inputs(version, unix_seconds)?);
        // SAFETY: output slot of the runtime (null rejected by `put`).
        unsafe { put(result, token) }
    })
}

/// The INTEGRITY_CHECK table.
pub static INTEGRITY_CHECK: Slots<3> = build(
    Table::IntegrityCheck,
    true,
    &[(
        1,
        integrity_check as extern "C" fn(c_uint, u64, *mut [u64; 2]) -> i32 as *const c_void,
    )],
);

// CONTEXT_CHECKS --------------------------------------------------------------------------------

/// Answers 0 ("nothing special") for any context, as NVIDIA's driver was observed to.
extern "C" fn context_check(_ctx: Handle, result: *mut u32, _other: *mut *const c_void) -> i32 {
    note("CONTEXT_CHECKS context_check");
    if !result.is_null() {
        // SAFETY: non-null output slot of the runtime.
        unsafe { result.write_unaligned(0) };
    }
    cu::SUCCESS
}

extern "C" fn check_3() -> u32 {
    note("CONTEXT_CHECKS check 3");
    0
}

/// The CONTEXT_CHECKS table.
pub static CONTEXT_CHECKS: Slots<4> = build(
    Table::ContextChecks,
    true,
    &[
        (
            2,
            context_check as extern "C" fn(Handle, *mut u32, *mut *const c_void) -> i32
                as *const c_void,
        ),
        (3, check_3 as extern "C" fn() -> u32 as *const c_void),
    ],
);

// TOOLS_CONTEXT ---------------------------------------------------------------------------------

/// TOOLS_CONTEXT slot 4: a context's unique id, as `cuCtxGetId` answers (public
/// reverse-engineering notes describe it so).
extern "C" fn tools_context_id(ctx: Handle, id: *mut u64) -> i32 {
    note("TOOLS_CONTEXT context id");
    // SAFETY: `id` is the runtime's output slot; cuCtxGetId rejects null.
    unsafe { crate::exports::cuCtxGetId(ctx, id) }
}

/// What a slot-51 object stands for: a context, and the stream slot 51 was asked about
/// (`None`: the NULL stream).
type ToolsTarget = (u64, Option<u64>);

/// The objects slot 51 has handed out: address → what it stands for. Each is a zeroed, leaked
/// block (one per context and stream) that only slot 39 interprets.
fn tools_objects() -> &'static Mutex<HashMap<usize, ToolsTarget>> {
    static M: OnceLock<Mutex<HashMap<usize, ToolsTarget>>> = OnceLock::new();
    M.get_or_init(Mutex::default)
}

/// Bytes of the block slot 51 hands out (the driver's own object is larger than the 256 bytes
/// observed; nothing of it is read by the libraries as far as observed).
const TOOLS_OBJECT_BYTES: usize = 4096;

/// TOOLS_CONTEXT slot 51 `(ctx, stream, &object, 0)`: an object of the context's stream
/// (`stream` 0: the NULL stream) that cuBLAS then passes to slot 39 (observed on driver 580
/// with cuBLAS 13.0, `docs/export-tables.md`: the object and slot 39's answer differ per
/// stream). Remora answers a client-side block per context and stream and runs the question
/// itself on the server.
extern "C" fn tools_context_object(ctx: Handle, stream: Handle, object: *mut *mut c_void) -> i32 {
    call("TOOLS_CONTEXT object (slot 51)", || {
        let ctx = state::ctx_or_current(ctx)?;
        let stream = if stream.is_null() {
            None
        } else {
            let r = state::stream_ref(stream, false)?;
            Some(state::session()?.stream_handle(ctx, r)?)
        };
        let target = (ctx, stream);
        let mut objects = tools_objects().lock().unwrap_or_else(|e| e.into_inner());
        let existing = objects.iter().find(|(_, t)| **t == target).map(|(a, _)| *a);
        let addr = match existing {
            Some(a) => a,
            None => {
                let block: &'static mut [u64] = Vec::leak(vec![0u64; TOOLS_OBJECT_BYTES / 8]);
                let a = block.as_mut_ptr() as usize;
                objects.insert(a, target);
                a
            }
        };
        // SAFETY: the runtime's output slot (null rejected by `put`).
        unsafe { put(object, addr as *mut c_void) }
    })
}

/// TOOLS_CONTEXT slot 39 `(ctx, object, &answer, mask, flag)`: asks the object from slot 51 a
/// question; the server runs slots 51 and 39 against its driver (`RM_TOOLS_CTX_QUERY`, or
/// `RM_TOOLS_STREAM_QUERY` for an object of a stream). The answer fills the 64-bit cell
/// (driver 580 answered 7 for the NULL stream and 13 for a created one, clearing the cell's
/// upper half, which held stack garbage). `mask` and `flag` were 0x7ffffffeffff and 1 (0 for
/// a created stream) when observed but vary between runs: they may be register leftovers, so
/// they are passed on, never checked.
extern "C" fn tools_context_ask(
    _ctx: Handle,
    object: *mut c_void,
    answer: *mut u64,
    mask: u64,
    flag: u64,
) -> i32 {
    call("TOOLS_CONTEXT query (slot 39)", || {
        let ctx = tools_objects()
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .get(&(object as usize))
            .copied();
        let Some((ctx, stream)) = ctx else {
            tracing::error!(
                "remora: TOOLS_CONTEXT slot 39 was called with {object:p}, which slot 51 did not hand out; CUDA_ERROR_INVALID_VALUE"
            );
            return Err(CuError(cu::INVALID_VALUE));
        };
        // Only the register's low byte is taken: the fifth argument is a bool at most (the
        // SysV ABI leaves the rest of a bool's register unspecified) and may be a leftover
        // of a shorter signature; cuBLASLt's calls carried garbage there.
        let flag = u32::from(flag as u8);
        let s = state::session()?;
        let v = match stream {
            None => s.tools_ctx_query(ctx, mask, flag)?,
            Some(h) => s.tools_stream_query(ctx, h, mask, flag)?,
        };
        // SAFETY: the runtime's output slot (null rejected by `put`).
        unsafe { put(answer, v) }
    })
}

/// The TOOLS_CONTEXT table: a size and 94 slots, as large as the largest driver seen (driver
/// 580 serves 93 words, a CUDA 13.4 driver 95); the context id (4) and cuBLASLt's context
/// query (51, 39) are served, every other slot is a loud trap.
pub static TOOLS_CONTEXT: Slots<95> = build(
    Table::ToolsContext,
    true,
    &[
        (
            4,
            tools_context_id as extern "C" fn(Handle, *mut u64) -> i32 as *const c_void,
        ),
        (
            39,
            tools_context_ask as extern "C" fn(Handle, *mut c_void, *mut u64, u64, u64) -> i32
                as *const c_void,
        ),
        (
            51,
            tools_context_object as extern "C" fn(Handle, Handle, *mut *mut c_void) -> i32
                as *const c_void,
        ),
    ],
);

// TOOLS_MODULE ----------------------------------------------------------------------------------

/// The callback of TOOLS_MODULE slot 7: `(user, function, name)`; its result is not used
/// (cuFFT's stores the function through `user` and returns nothing).
type FunctionVisitor = extern "C" fn(*mut c_void, Handle, *const std::ffi::c_char);

/// TOOLS_MODULE slot 7 `(ctx, module, visit, user)`: calls `visit(user, function, name)` for
/// every function of the module and answers how many it visited (driver 580 answered 1 for
/// cuFFT's one-kernel module). Functions are visited in name order.
extern "C" fn tools_module_each_function(
    _ctx: Handle,
    module: Handle,
    visit: Option<FunctionVisitor>,
    user: *mut c_void,
) -> i32 {
    let visited = std::panic::catch_unwind(|| -> CuResult<i32> {
        note("TOOLS_MODULE functions of a module (slot 7)");
        let visit = visit.ok_or(CuError(cu::INVALID_VALUE))?;
        let m = state::session()?
            .module(state::dec(Kind::Module, module)?)
            .ok_or(CuError(cu::INVALID_HANDLE))?;
        let mut functions: Vec<_> = m.functions.values().cloned().collect();
        functions.sort_by(|a, b| a.c_name.cmp(&b.c_name));
        // The callback is the library's code: it runs with no Remora lock held.
        for f in &functions {
            visit(user, enc(Kind::Function, f.handle), f.c_name.as_ptr());
        }
        Ok(i32::try_from(functions.len()).unwrap_or(i32::MAX))
    });
    match visited {
        Ok(Ok(n)) => n,
        Ok(Err(CuError(code))) => {
            tracing::error!(
                "remora: TOOLS_MODULE slot 7 (the functions of a module) failed with CUDA error {code}"
            );
            code
        }
        Err(_) => cu::UNKNOWN,
    }
}

/// The TOOLS_MODULE table as driver 580 sizes it (a size and 98 slots): the function
/// iteration (7) is served, every other slot is a loud trap.
pub static TOOLS_MODULE: Slots<99> = build(
    Table::ToolsModule,
    true,
    &[(
        7,
        tools_module_each_function
            as extern "C" fn(Handle, Handle, Option<FunctionVisitor>, *mut c_void) -> i32
            as *const c_void,
    )],
);

// CUBLASLT_1734DC26 -------------------------------------------------------------------------------

/// The table cuBLASLt asks for before its first bf16 or fp16 GEMM, sized as driver 580 sizes it
/// (a size and 16 slots). cuBLASLt calls through it without checking that `cuGetExportTable`
/// succeeded, so refusing the UUID crashes it (natively too). Observed with export_spy on the
/// H100: it calls slot 4 (two output pointers, a table of its own, two small integers), which
/// creates two objects, and slot 13, which frees them; when slot 4 fails it skips slot 13 and
/// carries on with identical results. So every slot is a trap, slot 4 a declined one.
pub static CUBLASLT_1734DC26: Slots<17> = build(Table::CublasLt1734, true, &[]);

// Declined --------------------------------------------------------------------------------------

/// Tables the CUDA libraries ask for and, refused, carry on without, with results identical to
/// native (observed with export_spy on driver 580; docs/export-tables.md): refused like any
/// table Remora lacks, logged at info level since nothing is lost.
pub const DECLINED_TABLES: [(&str, Uuid); 2] = [
    (
        "3 slots, asked for by every CUDA library",
        uuid("f8cff95121468b4eb9e2fb469e7c0dd9"),
    ),
    (
        "34 slots, asked for by cuBLASLt, which then skips its slots 19, 21, 24 and 25",
        uuid("69a28e9f24498b47b030c5da330ea4e9"),
    ),
];

// Lookup -----------------------------------------------------------------------------------------

/// The table for `id`, if Remora serves it.
pub fn lookup(id: &Uuid) -> Result<*const c_void, Option<&'static str>> {
    let Some(&(table, name, _, served)) = TABLES.iter().find(|t| &t.2 == id) else {
        return Err(None);
    };
    if !served {
        return Err(Some(name));
    }
    Ok(match table {
        Table::CudartInterface => CUDART_INTERFACE.0.as_ptr().cast(),
        Table::ToolsTls => TOOLS_TLS.0.as_ptr().cast(),
        Table::ToolsRuntimeCallbackHooks => TOOLS_RUNTIME_CALLBACK_HOOKS.0.as_ptr().cast(),
        Table::ContextLocalStorage => CONTEXT_LOCAL_STORAGE.0.as_ptr().cast(),
        Table::CtxCreateBypass => CTX_CREATE_BYPASS.0.as_ptr().cast(),
        Table::IntegrityCheck => INTEGRITY_CHECK.0.as_ptr().cast(),
        Table::ContextChecks => CONTEXT_CHECKS.0.as_ptr().cast(),
        Table::ToolsContext => TOOLS_CONTEXT.0.as_ptr().cast(),
        Table::ToolsModule => TOOLS_MODULE.0.as_ptr().cast(),
        Table::CublasLt1734 => CUBLASLT_1734DC26.0.as_ptr().cast(),
        Table::HeapAccess | Table::DeviceExtendedRt => return Err(Some(name)),
    })
}

/// `cuGetExportTable`'s body.
///
/// # Safety
/// `out` is null or writable; `id` is null or points to 16 readable bytes (cuda.h's contract).
pub unsafe fn get_export_table(out: *mut *const c_void, id: *const Uuid) -> CuResult<()> {
    if out.is_null() || id.is_null() {
        return Err(CuError(cu::INVALID_VALUE));
    }
    // SAFETY: `id` points to a CUuuid (16 bytes) per cuda.h.
    let id = unsafe { id.read_unaligned() };
    let found = lookup(&id);
    let table = match found {
        Ok(t) => {
            let name = TABLES.iter().find(|t| t.2 == id).map_or("?", |t| t.1);
            tracing::info!("remora: cuGetExportTable {} ({name})", format_uuid(&id));
            t
        }
        Err(None) if let Some((what, _)) = DECLINED_TABLES.iter().find(|t| t.1 == id) => {
            tracing::info!(
                "remora: cuGetExportTable {} ({what}) declined with CUDA_ERROR_INVALID_VALUE; the libraries carry on without it, as observed",
                format_uuid(&id)
            );
            std::ptr::null()
        }
        Err(name) => {
            tracing::error!(
                "remora: cuGetExportTable {} ({}) is not implemented by the Remora shim; answering CUDA_ERROR_INVALID_VALUE and a null table, as the driver does for a table it lacks",
                format_uuid(&id),
                name.unwrap_or("unknown table")
            );
            std::ptr::null()
        }
    };
    // SAFETY: `out` is non-null and writable per cuda.h.
    unsafe { put(out, table)? };
    non_null(table)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn uuids_print_as_cuda_tools_print_them() {
        assert_eq!(
            format_uuid(&TABLES[0].2),
            "{6BD5FB6C-5BF4-E74A-8987-D93912FD9DF9}"
        );
        assert_eq!(
            format_uuid(&DECLINED_TABLES[0].1),
            "{F8CFF951-2146-8B4E-B9E2-FB469E7C0DD9}"
        );
        assert_eq!(
            format_uuid(&DECLINED_TABLES[1].1),
            "{69A28E9F-2449-8B47-B030-C5DA330EA4E9}"
        );
    }

    #[test]
    fn tables_have_their_size_and_traps_in_empty_slots() {
        assert_eq!(CUDART_INTERFACE.0[0] as usize, 13 * 8);
        assert_eq!(TOOLS_TLS.0[0] as usize, 32);
        assert_eq!(INTEGRITY_CHECK.0[0] as usize, 24);
        // An empty slot is a trap that fails loudly.
        // SAFETY: slot 3 of TOOLS_TLS is `trap::<1, 3>`, a `extern "C" fn() -> i32`.
        let f: extern "C" fn() -> i32 = unsafe { std::mem::transmute(TOOLS_TLS.0[3]) };
        assert_eq!(f(), cu::NOT_SUPPORTED);
        assert_eq!(f(), cu::NOT_SUPPORTED);
        // TOOLS_CONTEXT: a size and 94 slots, as CUDA 13's driver serves it; slot 4 is the
        // context id, the others are traps.
        assert_eq!(TOOLS_CONTEXT.0[0] as usize, 95 * 8);
        assert_eq!(
            TOOLS_CONTEXT.0[4],
            tools_context_id as extern "C" fn(Handle, *mut u64) -> i32 as *const c_void
        );
        // SAFETY: slot 94 of TOOLS_CONTEXT is `trap::<9, 94>`, a `extern "C" fn() -> i32`.
        let f: extern "C" fn() -> i32 = unsafe { std::mem::transmute(TOOLS_CONTEXT.0[94]) };
        assert_eq!(f(), cu::NOT_SUPPORTED);
        assert_eq!(
            lookup(&uuid("21318c60971432488ca641ff7324c8f2")),
            Ok(TOOLS_CONTEXT.0.as_ptr().cast())
        );
        assert_eq!(
            TOOLS_TLS.0[2],
            tools_tls_current_context as extern "C" fn(*mut Handle) -> i32 as *const c_void
        );
        // cuBLASLt's table exists (it crashes without one), sized as driver 580 sizes it, and
        // its slot 4 declines with NOT_SUPPORTED, which cuBLASLt survives.
        assert_eq!(CUBLASLT_1734DC26.0[0] as usize, 0x88);
        assert_eq!(
            lookup(&uuid("1734dc26800d47458726c0f1e7dd8bca")),
            Ok(CUBLASLT_1734DC26.0.as_ptr().cast())
        );
        for slot in [4, 13, 16] {
            // SAFETY: every slot but 0 of CUBLASLT_1734DC26 is a trap, `extern "C" fn() -> i32`.
            let f: extern "C" fn() -> i32 =
                unsafe { std::mem::transmute(CUBLASLT_1734DC26.0[slot]) };
            assert_eq!(f(), cu::NOT_SUPPORTED);
        }
    }

    #[test]
    fn unknown_and_unserved_uuids_are_errors_with_a_null_table() {
        let mut out = std::ptr::dangling::<c_void>();
        let id = [0xEE; 16];
        // SAFETY: valid pointers.
        let r = unsafe { get_export_table(&mut out, &id) };
        assert_eq!(r, Err(CuError(cu::INVALID_VALUE)), "as the driver answers");
        assert!(out.is_null());
        assert_eq!(lookup(&TABLES[5].2), Err(Some("HEAP_ACCESS")));
        for (_, declined) in DECLINED_TABLES {
            let mut out = std::ptr::dangling::<c_void>();
            // SAFETY: valid pointers.
            let r = unsafe { get_export_table(&mut out, &declined) };
            assert_eq!(r, Err(CuError(cu::INVALID_VALUE)), "refused as the unknown");
            assert!(out.is_null());
        }
        // SAFETY: null output is rejected.
        let r = unsafe { get_export_table(std::ptr::null_mut(), &id) };
        assert_eq!(r, Err(CuError(cu::INVALID_VALUE)));
        let mut out = std::ptr::null();
        // SAFETY: valid pointers.
        let r = unsafe { get_export_table(&mut out, &TABLES[0].2) };
        assert_eq!(r, Ok(()));
        assert_eq!(out, CUDART_INTERFACE.0.as_ptr().cast());
    }

    #[test]
    fn context_local_storage_round_trips_and_runs_destructors() {
        static CALLED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        extern "C" fn dtor(_c: Handle, _k: *mut c_void, v: *mut c_void) {
            CALLED.store(v as usize, std::sync::atomic::Ordering::SeqCst);
        }
        let ctx = enc(Kind::Ctx, 77);
        let key = 0x1000 as *mut c_void;
        let mut v = std::ptr::null_mut();
        assert_eq!(cls_get(&mut v, ctx, key), cu::INVALID_HANDLE);
        assert_eq!(cls_put(ctx, key, 0x42 as *mut c_void, Some(dtor)), 0);
        assert_eq!(cls_get(&mut v, ctx, key), 0);
        assert_eq!(v as usize, 0x42);
        context_destroyed(77);
        assert_eq!(CALLED.load(std::sync::atomic::Ordering::SeqCst), 0x42);
        assert_eq!(cls_get(&mut v, ctx, key), cu::INVALID_HANDLE);
        assert_eq!(cls_put(ctx, key, 0x43 as *mut c_void, None), 0);
        assert_eq!(cls_delete(ctx, key), 0);
        assert_eq!(cls_get(&mut v, ctx, key), cu::INVALID_HANDLE);
    }
}
