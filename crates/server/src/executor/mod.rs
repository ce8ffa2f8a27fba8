//! The CUDA executor: answers every procedure of `remora.x` for each client session, through a
//! [`Backend`].
//!
//! One-way calls never reply: their errors are kept by the session and returned by the next
//! synchronizing call. Calls that can block for long (context, stream and event synchronize,
//! synchronous device-to-host copies) run on a per-session waiter thread and reply through a
//! deferred reply, so the connection goes on with other client threads' calls meanwhile.

use remora_proto::cuda::{CuError, CuResult, cu};
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use remora_oncrpc::{CallContext, ProcError, ProcResult};
use remora_proto::remora::*;
use remora_xdr::XdrEncode;

use crate::backend::{
    AreaCopy, AreaHtod, AreaSpan, Backend, CaptureInfo, Copy3d, Copy3dIo, CopyForm, CopyPlace,
    CopySide, DtodCopy, LaunchSpec, Memset, Occupancy, PeerCopy, StagedCopy, capture_status,
};
use crate::device_output::{DELIVERY_REVISION, DeviceOutput};

/// The protocol revision from which the client asks for its functions to be loaded
/// (`RM_FUNC_LOAD`).
const FUNC_LOAD_REVISION: u32 = 13;
use crate::hello::{HelloService, truncate};
use crate::module_cache::ModuleCache;
use crate::session::{
    Capture, FunctionTarget, PendingCopy, Range, RangeKind, Resource, Scope, Session, SessionState,
};

// The one `impl RemoraV1Server for Executor` is in `procedures.rs`; the longer procedures
// call `Executor` methods of the modules by concern.
mod capture;
mod contexts;
mod copies;
mod graphs;
mod lanes;
mod memory;
mod modules;
mod pools;
mod procedures;
mod streams;
mod vmm;

/// How long a stream or event synchronize polls before it waits on a waiter thread.
const SYNC_POLL: std::time::Duration = std::time::Duration::from_micros(50);
/// How long RM_COPIES_COLLECT polls the copies a client names before it answers without them
/// (the client asks again).
const COLLECT_POLL: std::time::Duration = std::time::Duration::from_millis(2);
/// The wire code of a failure: `CUDA_ERROR_UNKNOWN` if a backend ever reports failure as 0.
pub(crate) fn nz(e: CuError) -> i32 {
    if e.0 == cu::SUCCESS { cu::UNKNOWN } else { e.0 }
}

/// Logs a call that failed, naming the procedure and the CUresult (debug level).
fn log_failed(what: &str, status: i32) {
    if status != cu::SUCCESS && status != cu::NOT_READY {
        tracing::debug!(
            call = what,
            result = status,
            name = crate::backend::cuda::result_name(status),
            "call failed"
        );
    }
}

fn code(what: &str, r: CuResult<()>) -> i32 {
    let c = r.err().map_or(cu::SUCCESS, nz);
    log_failed(what, c);
    c
}

/// The reply of a call whose union carries a value on success: `ok(value)`, or `failed` of
/// the failure's code (logged).
fn union_reply<T, R>(
    what: &str,
    r: CuResult<T>,
    ok: impl FnOnce(T) -> R,
    failed: impl FnOnce(i32) -> R,
) -> R {
    match r {
        Ok(v) => ok(v),
        Err(e) => {
            log_failed(what, nz(e));
            failed(nz(e))
        }
    }
}

/// The union reply `$ty` of `r`: `Case0` of the value, or the failure's code as the
/// discriminant (logged as `what`).
macro_rules! reply {
    ($what:expr, $ty:ident, $r:expr) => {
        union_reply($what, $r, $ty::Case0, |discriminant| $ty::Default {
            discriminant,
        })
    };
}

use reply;

macro_rules! reply_fn {
    ($name:ident, $ty:ident, $val:ty) => {
        fn $name(what: &str, r: CuResult<$val>) -> $ty {
            reply!(what, $ty, r)
        }
    };
}
reply_fn!(int_reply, RmIntReply, i32);
reply_fn!(u64_reply, RmU64Reply, u64);
reply_fn!(handle_reply, RmHandleReply, u64);
reply_fn!(float_reply, RmFloatReply, f32);

/// A reply made of a call's result, a failure logged as `what`: a plain code ([`code`]) or a
/// union that carries the value on success ([`reply!`]).
trait FromResult<T> {
    fn from_result(what: &str, r: CuResult<T>) -> Self;
}

impl FromResult<()> for CuResult_ {
    fn from_result(what: &str, r: CuResult<()>) -> Self {
        code(what, r)
    }
}

macro_rules! union_from_result {
    ($($ty:ident($val:ty),)*) => {
        $(impl FromResult<$val> for $ty {
            fn from_result(what: &str, r: CuResult<$val>) -> Self {
                reply!(what, $ty, r)
            }
        })*
    };
}
union_from_result! {
    RmIntReply(i32),
    RmU64Reply(u64),
    RmHandleReply(u64),
    RmStreamAttrReply(RmStreamAttr),
    RmCaptureBegunReply(RmCaptureBegun),
    RmMemAllocNodeReply(RmMemAllocNodeAdded),
    RmGraphEdgesReply(RmGraphEdges),
    RmMemPropReply(RmMemProp),
}

/// The two ints of a call that answers a pair.
impl FromResult<(i32, i32)> for RmIntPairReply {
    fn from_result(what: &str, r: CuResult<(i32, i32)>) -> Self {
        let r = r.map(|(first, second)| RmIntPair { first, second });
        reply!(what, RmIntPairReply, r)
    }
}

struct Inner {
    /// Time driver calls of launches (see [`Executor::set_profile`]).
    profile: std::sync::atomic::AtomicBool,
    /// Procedures that call undocumented driver entry points are served (see
    /// [`Executor::set_private_driver_calls`]).
    private_driver_calls: std::sync::atomic::AtomicBool,
    /// Bytes of data area that may still be page-locked (see
    /// [`Executor::set_area_lock_budget`]).
    area_lock_budget: Mutex<u64>,
    /// Bound of each session's undelivered asynchronous copies, in bytes (see
    /// [`Executor::set_max_pending_copy_bytes`]).
    max_pending_copy_bytes: std::sync::atomic::AtomicU64,
    /// Whether sessions make their launches on a thread of their own during bursts (see
    /// [`Executor::set_launch_thread`]).
    launch_thread: std::sync::atomic::AtomicU8,
    /// Launches on the sessions' launch threads: while none is queued, dispatch skips the
    /// session lookup that waits for them.
    launch_counts: Arc<crate::launcher::LaunchCounts>,
    /// Set once any session has switched to its ordered thread (its first host callback):
    /// until then dispatch skips the per-call session lookup for it.
    any_ordered: std::sync::atomic::AtomicBool,
    backend: Arc<dyn Backend>,
    hello: HelloService,
    /// By connection number (server-assigned).
    sessions: Mutex<rustc_hash::FxHashMap<u64, Arc<Session>>>,
    cache: ModuleCache,
    /// `RM_NEED_IMAGE` answers given (hash-first loads of images not cached).
    images_asked: std::sync::atomic::AtomicU64,
    /// This process's captured standard output (a session worker: one session), whose
    /// device-side printf output synchronizing replies carry.
    device_output: std::sync::OnceLock<Arc<DeviceOutput>>,
    /// Limits and the ledger of what sessions use ([`Executor::set_quotas`]).
    quotas: std::sync::OnceLock<QuotaSetup>,
    /// The sessions' lane keys and lanes (revision 16, `lanes.rs`).
    lanes: Mutex<lanes::Lanes>,
    /// Lanes attached and not yet closed: while none is, dispatch skips the lane lookup.
    live_lanes: std::sync::atomic::AtomicUsize,
    /// Why every session is refused at HELLO, when one is ([`Executor::refuse_sessions`]).
    refusal: std::sync::OnceLock<String>,
}

/// The limits an executor applies and where it counts ([`crate::quota`]).
struct QuotaSetup {
    config: crate::quota::QuotaConfig,
    /// `None` only if no ledger could be made (logged): nothing is counted then.
    ledger: Option<Arc<crate::quota::Ledger>>,
    /// A session worker's slot, given by the server that started it; `None`: this executor
    /// claims a slot per session.
    worker_slot: Option<usize>,
}

/// Slots of the ledger an executor makes for itself (`remora serve` under thread isolation
/// makes one of `--max-connections` slots).
const DEFAULT_LEDGER_SLOTS: usize = 1024;

/// Serves `remora.x`: HELLO plus the CUDA driver procedures, one session per connection.
pub struct Executor {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for Executor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Executor")
            .field("backend", &self.inner.backend.kind())
            .finish_non_exhaustive()
    }
}

impl Executor {
    /// An executor over `backend`, answering HELLO with `hello`, with a module cache of
    /// `cache_bytes`.
    pub fn new(backend: Arc<dyn Backend>, hello: HelloService, cache_bytes: u64) -> Self {
        Self::with_module_cache_dir(backend, hello, cache_bytes, None)
    }

    /// As [`Executor::new`], with the module cache kept in `cache_dir` as well (one file per
    /// image, shared with the executors of other processes using the same directory).
    pub fn with_module_cache_dir(
        backend: Arc<dyn Backend>,
        hello: HelloService,
        cache_bytes: u64,
        cache_dir: Option<std::path::PathBuf>,
    ) -> Self {
        Self {
            inner: Arc::new(Inner {
                profile: std::sync::atomic::AtomicBool::new(false),
                private_driver_calls: std::sync::atomic::AtomicBool::new(true),
                area_lock_budget: Mutex::new(u64::MAX),
                max_pending_copy_bytes: std::sync::atomic::AtomicU64::new(
                    crate::session::default_max_pending_copy_bytes(),
                ),
                launch_thread: std::sync::atomic::AtomicU8::new(
                    crate::launcher::LaunchThread::from_env().to_u8(),
                ),
                launch_counts: Arc::default(),
                any_ordered: std::sync::atomic::AtomicBool::new(false),
                backend,
                hello,
                sessions: Mutex::default(),
                cache: ModuleCache::with_dir(cache_bytes, cache_dir),
                images_asked: std::sync::atomic::AtomicU64::new(0),
                device_output: std::sync::OnceLock::new(),
                quotas: std::sync::OnceLock::new(),
                lanes: Mutex::default(),
                live_lanes: std::sync::atomic::AtomicUsize::new(0),
                refusal: std::sync::OnceLock::new(),
            }),
        }
    }

    /// Refuses every session at HELLO with `reason` (a session worker that cannot give its
    /// session what the server promised, such as its tenant's GPU share). Once.
    pub fn refuse_sessions(&self, reason: String) {
        let _ = self.inner.refusal.set(reason);
    }

    /// Applies `config`'s limits to the sessions this executor serves, counting them in
    /// `ledger` (shared with the server's other processes), in slot `worker_slot` for a
    /// session worker, else in a slot claimed per session. Once, before the first session;
    /// false if limits were already in place. Without this call an executor applies the
    /// default limits ([`crate::quota::QuotaConfig::default`]) in a ledger of its own.
    pub fn set_quotas(
        &self,
        config: crate::quota::QuotaConfig,
        ledger: Arc<crate::quota::Ledger>,
        worker_slot: Option<usize>,
    ) -> bool {
        self.inner
            .quotas
            .set(QuotaSetup {
                config,
                ledger: Some(ledger),
                worker_slot,
            })
            .is_ok()
    }

    fn quotas(&self) -> &QuotaSetup {
        self.inner.quotas.get_or_init(|| {
            let ledger = crate::quota::Ledger::new(DEFAULT_LEDGER_SLOTS)
                .map(Arc::new)
                .map_err(|e| {
                    tracing::error!(error = %e, "cannot make the limits ledger: sessions are not limited");
                })
                .ok();
            QuotaSetup {
                config: crate::quota::QuotaConfig::default(),
                ledger,
                worker_slot: None,
            }
        })
    }

    /// Every tenant's use and refusals in the limits ledger ([`crate::quota::Ledger::report`]).
    pub(crate) fn quotas_report(
        &self,
    ) -> std::collections::BTreeMap<String, crate::quota::TenantReport> {
        self.quotas()
            .ledger
            .as_ref()
            .map(|l| l.report())
            .unwrap_or_default()
    }

    /// Places a new session in the ledger under its tenant, or says why it is refused.
    fn start_quota(
        &self,
        call: &CallContext,
    ) -> Option<Result<Arc<crate::quota::SessionQuota>, String>> {
        let setup = self.quotas();
        let ledger = Arc::clone(setup.ledger.as_ref()?);
        let tenant = limits_tenant(call, &setup.config);
        let (slot, owns) = match setup.worker_slot {
            Some(slot) => (Some(slot), false),
            None => (ledger.claim(), true),
        };
        let Some(slot) = slot else {
            return Some(Err(format!(
                "the limits ledger has no free slot ({} sessions are counted)",
                ledger.slots()
            )));
        };
        Some(
            crate::quota::SessionQuota::start(ledger, slot, owns, &tenant, &setup.config)
                .map(Arc::new)
                .map_err(|hit| format!("tenant {tenant:?} is {hit}")),
        )
    }

    /// Whether sessions started from now on make their kernel launches on a thread of their
    /// own during bursts ([`crate::LaunchThread`]; default `REMORA_LAUNCH_THREAD`, else auto).
    pub fn set_launch_thread(&self, policy: crate::launcher::LaunchThread) {
        self.inner
            .launch_thread
            .store(policy.to_u8(), std::sync::atomic::Ordering::Relaxed);
    }

    /// Kernel launches made by the sessions' launch threads so far.
    pub fn launches_queued(&self) -> u64 {
        self.inner
            .launch_counts
            .queued
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Waits until the launches queued by the session of `connection` have been made: every
    /// call but a launch (and the host-callback procedures, which must never wait for the
    /// device) runs only after the launches the client made before it.
    pub(crate) fn drain_launches(&self, connection: u64) {
        if self
            .inner
            .launch_counts
            .pending
            .load(std::sync::atomic::Ordering::Acquire)
            == 0
        {
            return;
        }
        let session = self.inner.sessions().get(&connection).map(Arc::clone);
        if let Some(session) = session {
            session.launcher.drain();
        }
    }

    /// Measures the time kernel launches and synchronous copies through the record path spend
    /// in the driver, per session, and logs it when the session ends (with `remora serve --profile`, beside the RPC runtime's profile).
    pub fn set_profile(&self, on: bool) {
        self.inner
            .profile
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Bytes of shared data areas this executor may have page-locked at once (the CUDA
    /// backend registers each session's area for DMA): a session whose area does not fit
    /// copies through private staging buffers instead, logged once. Unlimited by default;
    /// `remora serve --shm-lock-max` sets it (under process isolation the server gives each
    /// session worker what is left).
    pub fn set_area_lock_budget(&self, bytes: u64) {
        *self
            .inner
            .area_lock_budget
            .lock()
            .unwrap_or_else(PoisonError::into_inner) = bytes;
    }

    /// Bytes of data area that may still be page-locked ([`Executor::set_area_lock_budget`]).
    pub fn area_lock_budget(&self) -> u64 {
        *self
            .inner
            .area_lock_budget
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
    }

    /// Most bytes each session created from now on may hold staged in asynchronous
    /// device-to-host copies it has not yet synchronized for (default
    /// [`crate::default_max_pending_copy_bytes`], `remora serve --max-pending-copy-bytes`).
    /// A copy past it fails with CUDA_ERROR_OUT_OF_MEMORY at the session's next synchronizing
    /// call, logged with the limit.
    pub fn set_max_pending_copy_bytes(&self, bytes: u64) {
        self.inner
            .max_pending_copy_bytes
            .store(bytes, std::sync::atomic::Ordering::Relaxed);
    }

    /// Bytes staged now in undelivered asynchronous copies, over all sessions.
    pub fn pending_copy_bytes(&self) -> u64 {
        self.inner
            .sessions()
            .values()
            .map(|s| s.copies.staged_bytes())
            .sum()
    }

    /// Whether procedures that call undocumented entry points of the real driver on a
    /// client's behalf (`RM_TOOLS_CTX_QUERY`) are served (the default) or refused with
    /// CUDA_ERROR_NOT_SUPPORTED (`remora serve --no-private-driver-calls`).
    pub fn set_private_driver_calls(&self, on: bool) {
        self.inner
            .private_driver_calls
            .store(on, std::sync::atomic::Ordering::Relaxed);
    }

    /// Returns what `out` captures (device-side printf output) to the client in every
    /// synchronizing reply, once it negotiated revision 4. Only for a process that serves one
    /// session (a session worker): the output of a process cannot be told apart by session.
    pub(crate) fn deliver_device_output(&self, out: Arc<DeviceOutput>) {
        let _ = self.inner.device_output.set(out);
    }

    /// Number of live sessions.
    pub fn session_count(&self) -> usize {
        self.inner.sessions().len()
    }

    /// Number of objects in the module cache.
    pub fn cached_modules(&self) -> usize {
        self.inner.cache.len()
    }

    /// How many `RM_MODULE_LOAD` calls were answered `RM_NEED_IMAGE` (a hash not cached).
    pub fn images_asked_for(&self) -> u64 {
        self.inner.images_asked.load(Ordering::Relaxed)
    }

    /// The tenants of the live sessions that authenticated (by token or TLS client
    /// certificate), sorted.
    pub fn session_tenants(&self) -> Vec<String> {
        let mut tenants: Vec<String> = self
            .inner
            .sessions()
            .values()
            .filter_map(|s| s.tenant.get().cloned())
            .collect();
        tenants.sort();
        tenants
    }

    fn session(&self, call: &CallContext) -> Arc<Session> {
        let mut began = false;
        let session = Arc::clone(self.inner.sessions().entry(call.connection).or_insert_with(
            || {
                began = true;
                let max = self
                    .inner
                    .max_pending_copy_bytes
                    .load(std::sync::atomic::Ordering::Relaxed);
                let launcher = crate::launcher::Launcher::new(
                    format!("remora-launch-{}", call.connection),
                    crate::launcher::LaunchThread::from_u8(
                        self.inner
                            .launch_thread
                            .load(std::sync::atomic::Ordering::Relaxed),
                    ),
                    Arc::clone(&self.inner.launch_counts),
                );
                let session = Arc::new(Session::new(call.connection, max, launcher));
                if let Some(quota) = self.start_quota(call) {
                    match &quota {
                        Ok(q) => {
                            session.lock().quota = Some(Arc::clone(q));
                            let _ = session.copies.quota.set(Arc::clone(q));
                        }
                        Err(why) => remora_oncrpc::audit!(
                            warn,
                            limit "tenants",
                            connection = call.connection,
                            peer = %call.peer,
                            "session refused: {why} (limits: remora serve --tenants / --limit)"
                        ),
                    }
                    let _ = session.quota.set(quota);
                }
                session
            },
        ));
        if began {
            // Thread isolation: this executor holds every session of the server.
            crate::gpu_share::note_sessions(self.session_count());
        }
        let mapped = match call.peer {
            remora_oncrpc::Peer::Unix { uid, .. } if call.tenant().is_none() => self
                .inner
                .quotas
                .get()
                .and_then(|q| q.config.tenant_of_uid(uid)),
            _ => None,
        };
        if session.tenant.get().is_none()
            && let Some(tenant) = call.tenant().or(mapped)
            && session.tenant.set(tenant.to_owned()).is_ok()
        {
            tracing::info!(connection = call.connection, peer = %call.peer, tenant, "session opened");
        }
        if session.area.get().is_none()
            && let Some(area) = call.data_area()
            && session.area.set(area.clone()).is_ok()
        {
            let fits = {
                let mut budget = self
                    .inner
                    .area_lock_budget
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                let len = area.len() as u64;
                // The session's own limits too: the area is page-locked memory of its
                // tenant's (kept charged until the session ends).
                let fits = *budget >= len
                    && match session.quota.get() {
                        Some(Ok(q)) => q.try_charge(crate::quota::Kind::PinnedMemory, len).is_ok(),
                        Some(Err(_)) => false,
                        None => true,
                    };
                if fits {
                    *budget -= len;
                }
                fits
            };
            if fits {
                session
                    .area_locked
                    .store(true, std::sync::atomic::Ordering::Relaxed);
                self.inner.backend.area_attach(area);
            } else {
                tracing::warn!(
                    connection = call.connection,
                    area_bytes = area.len(),
                    "the server's page-locked memory budget (--shm-lock-max) or the tenant's pinned-memory limit has no room for this session's data area: its copies go through private staging buffers (slower)"
                );
            }
        }
        session
    }

    /// `run(backend, objects)` for the raw objects `resolve` finds in `session`'s state
    /// (under the session lock; `run` goes without it).
    fn resolved<X, T>(
        &self,
        session: &Session,
        resolve: impl FnOnce(&SessionState) -> CuResult<X>,
        run: impl FnOnce(&dyn Backend, X) -> CuResult<T>,
    ) -> CuResult<T> {
        let x = resolve(&session.lock());
        x.and_then(|x| run(&*self.inner.backend, x))
    }

    /// `f(backend, raw context)` for context handle `h` of `session`.
    fn in_ctx<T>(
        &self,
        session: &Session,
        h: RmHandle,
        f: impl FnOnce(&dyn Backend, u64) -> CuResult<T>,
    ) -> CuResult<T> {
        self.resolved(session, |st| st.ctx(h), f)
    }

    /// `f(backend, raw function, raw context)` for function handle `h` of `session`.
    fn in_function<T>(
        &self,
        session: &Session,
        h: RmHandle,
        f: impl FnOnce(&dyn Backend, u64, u64) -> CuResult<T>,
    ) -> CuResult<T> {
        self.resolved(
            session,
            |st| st.function(h),
            |b, t| {
                t.ensure_loaded(b)?;
                f(b, t.raw, t.ctx)
            },
        )
    }

    /// Creates an object in context handle `ctx` (`create(backend, raw context)`) and answers
    /// the session handle of `resource(raw object)`.
    fn create_in_ctx(
        &self,
        session: &Session,
        what: &str,
        ctx: RmHandle,
        kind: crate::quota::Kind,
        create: impl FnOnce(&dyn Backend, u64) -> CuResult<u64>,
        resource: impl FnOnce(u64) -> Resource,
    ) -> RmHandleReply {
        if let Err(e) = session.charge(kind, 1, what) {
            return handle_reply(what, Err(e));
        }
        let r = self.in_ctx(session, ctx, create);
        if r.is_err() {
            session.uncharge(kind, 1);
        }
        let mut st = session.lock();
        handle_reply(what, r.map(|raw| st.insert(resource(raw))))
    }

    /// A synchronous call answered with the session's deferred error and the copies finished
    /// by then: `resolve` finds the call's raw objects under the session lock, then
    /// `run(backend, them)` runs without it.
    fn sync_call<X>(
        &self,
        call: &CallContext,
        what: &str,
        resolve: impl FnOnce(&SessionState) -> CuResult<X>,
        run: impl FnOnce(&dyn Backend, X) -> CuResult<()>,
    ) -> ProcResult<RmSyncReply> {
        let session = self.session(call);
        let own = self.resolved(&session, resolve, run);
        let mut st = session.lock();
        Ok(self.inner.sync_reply(what, &mut st, own, Scope::Finished))
    }

    /// [`Executor::oneway_on`] the stream `on` = (context handle, stream handle): `resolve`
    /// finds the call's raw objects under the session lock, then `run(backend, them)` runs
    /// without it.
    fn oneway_on_stream<X>(
        &self,
        call: &CallContext,
        what: &str,
        on: (u64, u64),
        resolve: impl FnOnce(&SessionState) -> CuResult<X>,
        run: impl FnOnce(&dyn Backend, X) -> CuResult<()>,
    ) -> ProcResult<()> {
        self.oneway_on(call, what, Some(on), |inner, session| {
            let x = resolve(&session.lock())?;
            run(&*inner.backend, x)
        })
    }

    /// Runs a one-way call on stream `on` = (context handle, stream handle): its error is kept
    /// for the next synchronizing call, or, when that stream is capturing, by the capture
    /// (ending the capture returns it), as natively the failed call would have invalidated
    /// the capture.
    fn oneway_on(
        &self,
        call: &CallContext,
        what: &str,
        on: Option<(u64, u64)>,
        f: impl FnOnce(&Inner, &Session) -> CuResult<()>,
    ) -> ProcResult<()> {
        let session = self.session(call);
        if let Err(e) = f(&self.inner, &session) {
            self.inner.oneway_failed(&session, what, on, e);
        }
        oneway_end(&session)
    }

    /// Destroys the object behind handle `h` of this call's session: `pick` answers its (raw
    /// object, context handle), or the status to answer when `h` names no such object; then
    /// `destroy(backend, raw context, raw object)` runs and the handle is forgotten, whatever
    /// the driver said.
    fn destroy_in_ctx(
        &self,
        session: &Session,
        h: RmHandle,
        what: &str,
        pick: impl FnOnce(&Resource) -> CuResult<(u64, u64)>,
        destroy: impl FnOnce(&dyn Backend, u64, u64) -> CuResult<()>,
    ) -> CuResult_ {
        let mut st = session.lock();
        let (raw, ctx) = match st
            .get(h)
            .map_err(|_| CuError(cu::INVALID_HANDLE))
            .and_then(pick)
        {
            Ok(found) => found,
            Err(e) => return e.0,
        };
        let r = st
            .ctx(ctx)
            .and_then(|c| destroy(&*self.inner.backend, c, raw));
        st.remove(h);
        code(what, r)
    }

    /// Polling, then blocking (DESIGN decision 11): polls `query` (a stream or event query)
    /// for up to [`SYNC_POLL`]; true when the work finished within it, so that the synchronize
    /// can be answered inline instead of through a waiter thread.
    fn poll_briefly(&self, query: impl Fn() -> CuResult<()>) -> bool {
        let until = std::time::Instant::now() + SYNC_POLL;
        loop {
            match query() {
                Ok(()) => return true,
                Err(CuError(cu::NOT_READY)) if std::time::Instant::now() < until => {
                    std::hint::spin_loop();
                }
                _ => return false,
            }
        }
    }

    /// A synchronizing call: `resolve` finds what it waits for under the session lock and
    /// `idle(backend, that)` is polled briefly ([`Executor::poll_briefly`]); when the work is
    /// complete the wait would not block and `job` runs inline, else as
    /// [`Executor::blocking`].
    fn synchronizing<X, T: XdrEncode + Send + 'static>(
        &self,
        call: &CallContext,
        resolve: impl FnOnce(&SessionState) -> CuResult<X>,
        idle: impl Fn(&dyn Backend, &X) -> CuResult<()>,
        job: impl FnOnce(&Inner, &Session) -> T + Send + 'static,
    ) -> ProcResult<T> {
        let session = self.session(call);
        let target = resolve(&session.lock());
        let polled_from = remora_shm::tracing_waits().then(std::time::Instant::now);
        let poll_cpu = polled_from.map(|_| crate::sync_trace::thread_cpu());
        if target.is_ok_and(|x| self.poll_briefly(|| idle(&*self.inner.backend, &x))) {
            let out = job(&self.inner, &session);
            if let Some(t0) = polled_from {
                session.sync_trace.inline(t0.elapsed());
            }
            return Ok(out);
        }
        match polled_from {
            None => self.blocking(call, job),
            Some(t0) => {
                let polled = t0.elapsed();
                let poll_sched = poll_cpu.map(|c| crate::sync_trace::Sched::polled(polled, c));
                let deferred_at = t0 + polled;
                self.blocking(call, move |inner, session: &Session| {
                    let started = std::time::Instant::now();
                    let sched = crate::sync_trace::Sched::now();
                    let out = job(inner, session);
                    let driver_sched = crate::sync_trace::Sched::since(sched);
                    session.sync_trace.deferred(
                        polled,
                        started.duration_since(deferred_at),
                        started.elapsed(),
                        poll_sched,
                        driver_sched,
                    );
                    out
                })
            }
        }
    }

    /// Runs `job` on a waiter thread and replies from there, or inline when the connection
    /// cannot defer or the session's waiters are all busy.
    fn blocking<T: XdrEncode + Send + 'static>(
        &self,
        call: &CallContext,
        job: impl FnOnce(&Inner, &Session) -> T + Send + 'static,
    ) -> ProcResult<T> {
        let session = self.session(call);
        let Some(reply) = call.defer() else {
            return Ok(job(&self.inner, &session));
        };
        let inner = Arc::clone(&self.inner);
        let sess = Arc::clone(&session);
        let work: crate::waiters::Job = Box::new(move || {
            let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| job(&inner, &sess)));
            match out {
                Ok(v) => {
                    if let Err(e) = reply.reply(|enc| v.encode(enc)) {
                        tracing::debug!(error = %e, "deferred reply not delivered");
                    }
                }
                Err(_) => {
                    tracing::error!("a blocking call panicked; SYSTEM_ERR");
                    drop(reply);
                }
            }
        });
        if let Err(work) = session.waiters.submit(work) {
            // Every waiter is busy (or none can start): wait on the connection thread.
            work();
        }
        Err(ProcError::Deferred)
    }
}

/// The end of a one-way call of `session`: the connection closes when the session is past
/// every bound of its copies (logged by `PendingCopies::push`).
fn oneway_end(session: &Session) -> ProcResult<()> {
    if session.copies.overflowed() {
        return Err(ProcError::Close);
    }
    Ok(())
}

impl Inner {
    /// One-way call `what` on stream `on` of `session` failed with `e`: the error is kept for
    /// the next synchronizing call, or, when that stream is capturing, by the capture (ending
    /// the capture returns it), as natively the failed call would have invalidated the capture.
    fn oneway_failed(&self, session: &Session, what: &str, on: Option<(u64, u64)>, e: CuError) {
        tracing::debug!(
            connection = session.connection,
            call = what,
            result = e.0,
            name = crate::backend::cuda::result_name(e.0),
            "one-way call failed; its error is deferred to the next synchronizing call"
        );
        let mut st = session.lock();
        let capture = on.filter(|_| !st.captures.is_empty()).and_then(|(c, s)| {
            let t = stream_target(&st, c, s).ok()?;
            let info = self.backend.stream_capture_info(t.ctx, t.stream).ok()?;
            (info.status != capture_status::NONE).then_some(info.id)
        });
        match capture.and_then(|id| st.captures.get_mut(&id)) {
            Some(cap) => {
                cap.error.get_or_insert(nz(e));
            }
            None => st.defer_error(nz(e)),
        }
    }

    /// Whether driver time is measured ([`Executor::set_profile`]).
    fn profiling(&self) -> bool {
        self.profile.load(std::sync::atomic::Ordering::Relaxed)
    }

    fn sessions(&self) -> MutexGuard<'_, rustc_hash::FxHashMap<u64, Arc<Session>>> {
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn sync_reply(
        &self,
        what: &str,
        st: &mut SessionState,
        own: CuResult<()>,
        scope: Scope,
    ) -> RmSyncReply {
        let mut status = st.sync_status(own);
        let copies = self.collect(st, scope, &mut status);
        log_failed(what, status);
        RmSyncReply { status, copies }
    }

    /// What a synchronizing reply delivers: the asynchronous copies `scope` covers
    /// ([`SessionState::collect`]) and the device output captured by now, as the entry
    /// `RM_DEVICE_OUTPUT_ID`. Call it after the synchronizing driver call has returned (the
    /// driver writes the output during that call).
    fn collect(&self, st: &mut SessionState, scope: Scope, status: &mut i32) -> Vec<RmCopyData> {
        let mut copies = st.collect(scope, status);
        if let Some(data) = self.take_device_output() {
            copies.push(RmCopyData {
                copy_id: RM_DEVICE_OUTPUT_ID,
                data,
            });
        }
        copies
    }

    /// The device output captured by now, at most `RM_MAX_DEVICE_OUTPUT` bytes.
    fn take_device_output(&self) -> Option<remora_xdr::Bytes> {
        self.device_output
            .get()?
            .take(RM_MAX_DEVICE_OUTPUT as usize)
    }

    /// Drops one of the session's references to its primary context of `dev` (all of them
    /// when `all`); at zero the session's context is destroyed, with everything in it.
    fn release_primary(&self, st: &mut SessionState, dev: i32, all: bool) -> CuResult<()> {
        let (h, refs) = *st.primary.get(&dev).ok_or(CuError(cu::INVALID_CONTEXT))?;
        if refs > 1 && !all {
            st.primary.insert(dev, (h, refs - 1));
            return Ok(());
        }
        let raw = st.ctx(h)?;
        st.drop_ctx_resources(&*self.backend, h);
        st.remove(h);
        st.primary.remove(&dev);
        st.clear_sticky();
        if all {
            st.reset_primaries.insert(h);
        }
        self.backend.ctx_destroy(raw)
    }

    /// Checks that `dev` names a device.
    fn check_device(&self, dev: i32) -> CuResult<()> {
        let n = self.backend.device_count()?;
        if n == 0 {
            return Err(CuError(cu::NO_DEVICE));
        }
        if dev < 0 || dev >= n {
            return Err(CuError(cu::INVALID_DEVICE));
        }
        Ok(())
    }
}

/// Where a stream call runs.
struct StreamTarget {
    /// Backend context (made current).
    ctx: u64,
    /// Backend stream.
    stream: u64,
    /// Session handle of the context.
    ctx_handle: u64,
    /// Session handle of the stream (RM_STREAM_LEGACY for the legacy stream).
    stream_handle: u64,
}

/// The context and stream a stream call names: a stream of the session runs in its own
/// context; 0 / RM_STREAM_LEGACY is the legacy stream of context handle `ctx`.
fn stream_target(st: &SessionState, ctx: u64, h: u64) -> CuResult<StreamTarget> {
    if h == 0 || h == u64::from(RM_STREAM_LEGACY) {
        if ctx == 0 {
            return Err(CuError(cu::INVALID_CONTEXT));
        }
        return Ok(StreamTarget {
            ctx: st.ctx(ctx)?,
            stream: crate::backend::LEGACY_STREAM,
            ctx_handle: ctx,
            stream_handle: u64::from(RM_STREAM_LEGACY),
        });
    }
    match st.get(h)? {
        Resource::Stream { raw, ctx: owner } => Ok(StreamTarget {
            ctx: st.ctx(*owner)?,
            stream: *raw,
            ctx_handle: *owner,
            stream_handle: h,
        }),
        _ => Err(CuError(cu::INVALID_HANDLE)),
    }
}

/// CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED when backend `stream` of `ctx` takes part in a
/// stream capture (the driver is asked only while the session has one in progress): used for
/// the calls that move data between the GPU and client memory, or call the client, which a
/// graph cannot replay. The driver's own refusal (a query of a stream that depends on a
/// capturing one) is returned as it is.
fn not_captured(inner: &Inner, capturing: bool, ctx: u64, stream: u64) -> CuResult<()> {
    if !capturing {
        return Ok(());
    }
    match inner.backend.stream_capture_info(ctx, stream)?.status {
        capture_status::NONE => Ok(()),
        _ => {
            tracing::warn!(
                "remora: a copy to or from client memory (or a host callback) on a capturing \
                 stream cannot be captured; returning CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
            );
            Err(CuError(cu::STREAM_CAPTURE_UNSUPPORTED))
        }
    }
}

/// The tenant a session's limits are counted under ([`crate::quota::QuotaConfig::tenant_of`]).
pub(crate) fn limits_tenant(call: &CallContext, config: &crate::quota::QuotaConfig) -> String {
    config.tenant_of(call.tenant(), &call.peer)
}

/// `cu_result` as the generated code names it.
type CuResult_ = remora_proto::remora::CuResult;

impl Executor {
    /// The ordered thread of `connection`'s session, once it uses host callbacks: where its
    /// calls other than the host-callback procedures run (see [`crate::host_callbacks`]).
    pub(crate) fn ordered_session(&self, connection: u64) -> Option<Arc<Session>> {
        if !self
            .inner
            .any_ordered
            .load(std::sync::atomic::Ordering::Acquire)
        {
            return None;
        }
        let session = self.inner.sessions().get(&connection).map(Arc::clone)?;
        session.ordered.is_on().then_some(session)
    }

    /// Frees the session of `connection` (called when the connection ends).
    pub fn close_session(&self, connection: u64) {
        self.forget_lanes(connection);
        // The session leaves the table only once its resources are freed, so that
        // `session_count` counts what still holds GPU resources (the connection is closing:
        // no call of it arrives meanwhile).
        let session = self.inner.sessions().get(&connection).cloned();
        if let Some(session) = session {
            // Its queued launches are made before anything of it is freed.
            session.launcher.close();
            let freeing = std::time::Instant::now();
            let tenant = session.tenant.get().map(String::as_str);
            if let Some(tenant) = tenant {
                tracing::info!(connection, tenant, "session closed");
            }
            if let Some((n, total)) = session.launch_profile() {
                tracing::info!(
                    target: crate::PROFILE_LOG_TARGET,
                    connection,
                    tenant = tenant.unwrap_or("-"),
                    launches = n,
                    "session profile: {n} kernel launches, mean {:.2} us in the driver's launch call",
                    total.as_secs_f64() * 1e6 / n as f64
                );
            }
            if let Some((n, bytes, took)) = session.bulk_copy_profile() {
                tracing::info!(
                    target: crate::PROFILE_LOG_TARGET,
                    connection,
                    tenant = tenant.unwrap_or("-"),
                    copies = n,
                    bytes,
                    "session profile: {n} synchronous copies through the record path, {:.1} MiB, {:.1} ms in the driver ({:.2} GB/s while copying)",
                    bytes as f64 / (1 << 20) as f64,
                    took.as_secs_f64() * 1e3,
                    bytes as f64 / took.as_secs_f64().max(1e-9) / 1e9
                );
            }
            // Before the contexts go: a backend may need one to undo its registration.
            let detaching = std::time::Instant::now();
            if let Some(area) = session.area.get()
                && session
                    .area_locked
                    .load(std::sync::atomic::Ordering::Relaxed)
            {
                self.inner.backend.area_detach(area);
                let mut budget = self
                    .inner
                    .area_lock_budget
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner);
                *budget = budget.saturating_add(area.len() as u64);
            }
            let area_us = detaching.elapsed().as_micros() as u64;
            session.close(&*self.inner.backend);
            self.inner.sessions().remove(&connection);
            // Part of a short program's run time under `remora run` (its end): the session's
            // resources are freed before its worker exits.
            tracing::debug!(
                target: "remora::startup",
                connection,
                free_us = freeing.elapsed().as_micros() as u64,
                area_us,
                "session closed and its resources freed"
            );
        }
        // A worker process ends with its session: its images reach the shared directory
        // first, for the next session's worker.
        self.inner.cache.flush();
    }
}
