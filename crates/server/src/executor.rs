//! The CUDA executor: answers every procedure of `remora.x` for each client session, through a
//! [`Backend`].
//!
//! One-way calls never reply: their errors are kept by the session and returned by the next
//! synchronizing call. Calls that can block for long (context, stream and event synchronize,
//! synchronous device-to-host copies) run on a per-session waiter thread and reply through a
//! deferred reply, so the connection goes on with other client threads' calls meanwhile.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use remora_oncrpc::{CallContext, ProcError, ProcResult};
use remora_proto::remora::*;
use remora_xdr::XdrEncode;
use sha2::{Digest, Sha256};

use crate::backend::status::{INVALID_HANDLE, INVALID_VALUE, STREAM_CAPTURE_UNSUPPORTED, SUCCESS};
use crate::backend::{
    Backend, CaptureInfo, Copy3d, CopyForm, CopyPlace, CopySide, CuResult, LaunchSpec, StagedCopy,
    capture_status,
};
use crate::device_output::{DELIVERY_REVISION, DeviceOutput};
use crate::hello::{HelloService, truncate};
use crate::module_cache::ModuleCache;
use crate::session::{Capture, PendingCopy, Range, Resource, Scope, Session, SessionState};

/// How long a stream or event synchronize polls before it waits on a waiter thread.
const SYNC_POLL: std::time::Duration = std::time::Duration::from_micros(50);
/// How long RM_COPIES_COLLECT polls the copies a client names before it answers without them
/// (the client asks again).
const COLLECT_POLL: std::time::Duration = std::time::Duration::from_millis(2);

/// `CUDA_ERROR_INVALID_CONTEXT`.
const INVALID_CONTEXT: i32 = 201;
/// `CUDA_ERROR_UNKNOWN`, used if a backend ever reports failure as 0.
const UNKNOWN: i32 = 999;

fn nz(e: i32) -> i32 {
    if e == SUCCESS { UNKNOWN } else { e }
}

/// Logs a call that failed, naming the procedure and the CUresult (debug level).
fn log_failed(what: &str, status: i32) {
    if status != SUCCESS && status != crate::backend::status::NOT_READY {
        tracing::debug!(
            call = what,
            result = status,
            name = crate::backend::cuda::result_name(status),
            "call failed"
        );
    }
}

fn code(what: &str, r: CuResult<()>) -> i32 {
    let c = r.err().map_or(SUCCESS, nz);
    log_failed(what, c);
    c
}

macro_rules! reply_fn {
    ($name:ident, $ty:ident, $val:ty) => {
        fn $name(what: &str, r: CuResult<$val>) -> $ty {
            match r {
                Ok(v) => $ty::Case0(v),
                Err(e) => {
                    log_failed(what, nz(e));
                    $ty::Default {
                        discriminant: nz(e),
                    }
                }
            }
        }
    };
}
reply_fn!(int_reply, RmIntReply, i32);
reply_fn!(u64_reply, RmU64Reply, u64);
reply_fn!(handle_reply, RmHandleReply, u64);
reply_fn!(float_reply, RmFloatReply, f32);

fn int_pair_reply(what: &str, r: CuResult<(i32, i32)>) -> RmIntPairReply {
    match r {
        Ok((first, second)) => RmIntPairReply::Case0(RmIntPair { first, second }),
        Err(e) => {
            log_failed(what, nz(e));
            RmIntPairReply::Default {
                discriminant: nz(e),
            }
        }
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
    /// Set once any session has switched to its ordered thread (its first host callback):
    /// until then dispatch skips the per-call session lookup for it.
    any_ordered: std::sync::atomic::AtomicBool,
    backend: Arc<dyn Backend>,
    hello: HelloService,
    sessions: Mutex<HashMap<u64, Arc<Session>>>,
    cache: ModuleCache,
    /// This process's captured standard output (a session worker: one session), whose
    /// device-side printf output synchronizing replies carry.
    device_output: std::sync::OnceLock<Arc<DeviceOutput>>,
}

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
                any_ordered: std::sync::atomic::AtomicBool::new(false),
                backend,
                hello,
                sessions: Mutex::new(HashMap::new()),
                cache: ModuleCache::with_dir(cache_bytes, cache_dir),
                device_output: std::sync::OnceLock::new(),
            }),
        }
    }

    /// Measures the time kernel launches spend in the driver, per session, and logs it when
    /// the session ends (with `remora serve --profile`, beside the RPC runtime's profile).
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

    fn session(&self, call: &CallContext) -> Arc<Session> {
        let session = Arc::clone(
            self.inner
                .sessions()
                .entry(call.connection)
                .or_insert_with(|| Arc::new(Session::new(call.connection))),
        );
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
                let fits = *budget >= len;
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
                    "the server's page-locked memory budget (--shm-lock-max) has no room for this session's data area: its copies go through private staging buffers (slower)"
                );
            }
        }
        session
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
            tracing::debug!(
                connection = call.connection,
                call = what,
                result = e,
                name = crate::backend::cuda::result_name(e),
                "one-way call failed; its error is deferred to the next synchronizing call"
            );
            let mut st = session.lock();
            let capture = on.filter(|_| !st.captures.is_empty()).and_then(|(c, s)| {
                let t = stream_target(&st, c, s).ok()?;
                let info = self
                    .inner
                    .backend
                    .stream_capture_info(t.ctx, t.stream)
                    .ok()?;
                (info.status != capture_status::NONE).then_some(info.id)
            });
            match capture.and_then(|id| st.captures.get_mut(&id)) {
                Some(cap) => {
                    cap.error.get_or_insert(nz(e));
                }
                None => st.defer_error(nz(e)),
            }
        }
        Ok(())
    }

    /// Runs `job` on a waiter thread and replies from there, or inline when the connection
    /// cannot defer or the session's waiters are all busy.
    /// Polling, then blocking (DESIGN decision 11): polls `query` (a stream or event query)
    /// for up to [`SYNC_POLL`]; true when the work finished within it, so that the synchronize
    /// can be answered inline instead of through a waiter thread.
    /// Destroys the object behind handle `h` of this call's session: `pick` answers its (raw
    /// object, context handle), or the status to answer when `h` names no such object; then
    /// `destroy(backend, raw context, raw object)` runs and the handle is forgotten, whatever
    /// the driver said.
    fn destroy_in_ctx(
        &self,
        call: &CallContext,
        h: RmHandle,
        what: &str,
        pick: impl FnOnce(&Resource) -> Result<(u64, u64), i32>,
        destroy: impl FnOnce(&dyn Backend, u64, u64) -> CuResult<()>,
    ) -> ProcResult<CuResult_> {
        let session = self.session(call);
        let mut st = session.lock();
        let (raw, ctx) = match st.get(h).map_err(|_| INVALID_HANDLE).and_then(pick) {
            Ok(found) => found,
            Err(status) => return Ok(status),
        };
        let r = st
            .ctx(ctx)
            .and_then(|c| destroy(&*self.inner.backend, c, raw));
        st.remove(h);
        Ok(code(what, r))
    }

    fn poll_briefly(&self, query: impl Fn() -> CuResult<()>) -> bool {
        let until = std::time::Instant::now() + SYNC_POLL;
        loop {
            match query() {
                Ok(()) => return true,
                Err(crate::backend::status::NOT_READY) if std::time::Instant::now() < until => {
                    std::hint::spin_loop();
                }
                _ => return false,
            }
        }
    }

    /// Runs `job` inline when `done` (its wait would not block), else as [`Executor::blocking`].
    fn blocking_unless<T: XdrEncode + Send + 'static>(
        &self,
        call: &CallContext,
        done: bool,
        job: impl FnOnce(&Inner, &Session) -> T + Send + 'static,
    ) -> ProcResult<T> {
        if done {
            let session = self.session(call);
            return Ok(job(&self.inner, &session));
        }
        self.blocking(call, job)
    }

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

impl Inner {
    fn sessions(&self) -> MutexGuard<'_, HashMap<u64, Arc<Session>>> {
        self.sessions.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn sync_reply(
        &self,
        what: &str,
        st: &mut SessionState,
        own: CuResult<()>,
        scope: Scope,
    ) -> RmSyncReply {
        let mut status = st.sync_status(own.map_err(nz));
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
        let (h, refs) = *st.primary.get(&dev).ok_or(INVALID_CONTEXT)?;
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
            return Err(crate::backend::status::NO_DEVICE);
        }
        if dev < 0 || dev >= n {
            return Err(crate::backend::status::INVALID_DEVICE);
        }
        Ok(())
    }

    fn load(&self, st_session: &Session, ctx: u64, image: &[u8]) -> RmLoadReply {
        let raw_ctx = match st_session.lock().ctx(ctx) {
            Ok(c) => c,
            Err(e) => return RmLoadReply::RmLoadFailed(e),
        };
        let loaded = match self.backend.module_load(raw_ctx, image) {
            Ok(m) => m,
            Err(e) => {
                log_failed("RM_MODULE_LOAD", nz(e));
                return RmLoadReply::RmLoadFailed(nz(e));
            }
        };
        let mut st = st_session.lock();
        let module = st.insert(Resource::Module {
            raw: loaded.raw,
            ctx,
        });
        if loaded.functions.len() > RM_MAX_FUNCTIONS as usize {
            tracing::warn!(
                functions = loaded.functions.len(),
                "module lists more functions than the protocol carries; the rest are left out"
            );
        }
        let functions = loaded
            .functions
            .into_iter()
            .take(RM_MAX_FUNCTIONS as usize)
            .map(|f| {
                let mut params = f.params;
                params.truncate(RM_MAX_PARAM_COUNT as usize);
                let handle = st.insert(Resource::Function {
                    raw: f.raw,
                    ctx,
                    module,
                    params: params.clone().into(),
                });
                RmFunction {
                    name: f.name,
                    function: handle,
                    params: params
                        .into_iter()
                        .map(|(offset, size)| RmParam { offset, size })
                        .collect(),
                }
            })
            .collect();
        RmLoadReply::RmLoaded(RmModule { module, functions })
    }
}

impl RemoraV1Server for Executor {
    // The plain calls, generated from their `@glue` annotations in remora.x.
    remora_proto::executor_glue!();

    fn remora_null(&self, _call: &CallContext) -> ProcResult<()> {
        Ok(())
    }

    fn remora_hello(&self, call: &CallContext, args: HelloArgs) -> ProcResult<HelloReply> {
        tracing::info!(client = %args.client_name, peer = ?call.peer, connection = call.connection, "HELLO");
        let reply = self.inner.hello.answer(&args);
        if let (HelloReply::True(w), Some(out)) = (&reply, self.inner.device_output.get()) {
            out.set_deliver(w.revision >= DELIVERY_REVISION);
        }
        Ok(reply)
    }

    // Devices --------------------------------------------------------------------------------

    fn rm_device_get_count(&self, _call: &CallContext) -> ProcResult<RmIntReply> {
        Ok(int_reply(
            "RM_DEVICE_GET_COUNT",
            self.inner.backend.device_count(),
        ))
    }

    fn rm_device_get_props(&self, _call: &CallContext, dev: i32) -> ProcResult<RmDevicePropsReply> {
        Ok(
            match self
                .inner
                .backend
                .device_props(dev)
                .inspect_err(|e| log_failed("RM_DEVICE_GET_PROPS", *e))
            {
                Ok(p) => RmDevicePropsReply::Case0(RmDeviceProps {
                    name: truncate(p.name, REMORA_MAX_NAME),
                    uuid: p.uuid,
                    total_memory: p.total_memory,
                    pci_bus_id: truncate(p.pci_bus_id, REMORA_MAX_NAME),
                    attributes: p
                        .attributes
                        .into_iter()
                        .take(RM_MAX_ATTRIBUTES as usize)
                        .map(|(attribute, value)| RmAttribute { attribute, value })
                        .collect(),
                }),
                Err(e) => RmDevicePropsReply::Default {
                    discriminant: nz(e),
                },
            },
        )
    }

    fn rm_device_get_attribute(
        &self,
        _call: &CallContext,
        a: RmDeviceAttrArgs,
    ) -> ProcResult<RmIntReply> {
        Ok(int_reply(
            "RM_DEVICE_GET_ATTRIBUTE",
            self.inner.backend.device_attribute(a.attribute, a.device),
        ))
    }

    // Contexts -------------------------------------------------------------------------------

    /// What the client calls the device's primary context is a context of this session's own
    /// (cuCtxCreate on the first retain, destroyed when the session's count reaches zero, by
    /// RM_PRIMARY_CTX_RESET or at session end). Sharing the server process's real primary
    /// context let one client's sticky error (an illegal address in a kernel) poison every
    /// later session: CUDA keeps such an error in the context for good.
    fn rm_primary_ctx_retain(&self, call: &CallContext, dev: i32) -> ProcResult<RmHandleReply> {
        let session = self.session(call);
        let mut st = session.lock();
        if let Some((h, refs)) = st.primary.get(&dev).copied() {
            st.primary.insert(dev, (h, refs + 1));
            return Ok(RmHandleReply::Case0(h));
        }
        let flags = st.primary_flags.get(&dev).copied().unwrap_or(0);
        Ok(handle_reply(
            "RM_PRIMARY_CTX_RETAIN",
            self.inner.backend.ctx_create(flags, dev).map(|raw| {
                let h = st.insert(Resource::Context {
                    raw,
                    device: dev,
                    primary: true,
                });
                st.primary.insert(dev, (h, 1));
                h
            }),
        ))
    }

    fn rm_primary_ctx_release(&self, call: &CallContext, dev: i32) -> ProcResult<CuResult_> {
        let session = self.session(call);
        let mut st = session.lock();
        Ok(code(
            "RM_PRIMARY_CTX_RELEASE",
            self.inner.release_primary(&mut st, dev, false),
        ))
    }

    /// The flags apply when the session's primary context is next created (after a reset, or
    /// on the first retain); a context already active keeps its own.
    fn rm_primary_ctx_set_flags(
        &self,
        call: &CallContext,
        a: RmPrimaryFlagsArgs,
    ) -> ProcResult<CuResult_> {
        let r = self.inner.check_device(a.device);
        if r.is_ok() {
            let session = self.session(call);
            session.lock().primary_flags.insert(a.device, a.flags);
        }
        Ok(code("RM_PRIMARY_CTX_SET_FLAGS", r))
    }

    fn rm_primary_ctx_get_state(
        &self,
        call: &CallContext,
        dev: i32,
    ) -> ProcResult<RmPrimaryStateReply> {
        let r = self.inner.check_device(dev).map(|()| {
            let session = self.session(call);
            let st = session.lock();
            (
                st.primary_flags.get(&dev).copied().unwrap_or(0),
                i32::from(st.primary.contains_key(&dev)),
            )
        });
        Ok(
            match r.inspect_err(|e| log_failed("RM_PRIMARY_CTX_GET_STATE", *e)) {
                Ok((flags, active)) => RmPrimaryStateReply::Case0(RmPrimaryState { flags, active }),
                Err(e) => RmPrimaryStateReply::Default {
                    discriminant: nz(e),
                },
            },
        )
    }

    fn rm_primary_ctx_reset(&self, call: &CallContext, dev: i32) -> ProcResult<CuResult_> {
        // The session's primary context is its own: it is destroyed, with everything in it,
        // and the next retain creates a fresh one (a sticky error goes with it).
        let session = self.session(call);
        let mut st = session.lock();
        if !st.primary.contains_key(&dev) {
            return Ok(code("RM_PRIMARY_CTX_RESET", self.inner.check_device(dev)));
        }
        Ok(code(
            "RM_PRIMARY_CTX_RESET",
            self.inner.release_primary(&mut st, dev, true),
        ))
    }

    fn rm_ctx_create(&self, call: &CallContext, a: RmCtxCreateArgs) -> ProcResult<RmHandleReply> {
        let session = self.session(call);
        let r = self.inner.backend.ctx_create(a.flags, a.device);
        let mut st = session.lock();
        Ok(handle_reply(
            "RM_CTX_CREATE",
            r.map(|raw| {
                st.insert(Resource::Context {
                    raw,
                    device: a.device,
                    primary: false,
                })
            }),
        ))
    }

    fn rm_ctx_destroy(&self, call: &CallContext, h: RmHandle) -> ProcResult<CuResult_> {
        let session = self.session(call);
        let mut st = session.lock();
        let raw = match st.get(h) {
            Ok(Resource::Context {
                raw,
                primary: false,
                ..
            }) => *raw,
            Ok(Resource::Context { primary: true, .. }) => return Ok(INVALID_CONTEXT),
            _ => return Ok(INVALID_HANDLE),
        };
        st.drop_ctx_resources(&*self.inner.backend, h);
        st.remove(h);
        st.clear_sticky();
        Ok(code("RM_CTX_DESTROY", self.inner.backend.ctx_destroy(raw)))
    }

    fn rm_ctx_synchronize(&self, call: &CallContext, h: RmHandle) -> ProcResult<RmSyncReply> {
        // Polling first: the context is idle once its legacy stream and every stream the
        // session made in it are; then the synchronize returns at once and is answered inline.
        let session = self.session(call);
        let target = {
            let st = session.lock();
            st.ctx(h).map(|raw| (raw, st.streams_in(h)))
        };
        let done = target.is_ok_and(|(raw, streams)| {
            self.poll_briefly(|| {
                std::iter::once(crate::backend::LEGACY_STREAM)
                    .chain(streams.iter().copied())
                    .try_for_each(|s| self.inner.backend.stream_query(raw, s))
            })
        });
        self.blocking_unless(call, done, move |inner, session| {
            let own = session.lock().ctx(h);
            let own = own.and_then(|raw| inner.backend.ctx_synchronize(raw));
            let mut st = session.lock();
            inner.sync_reply("RM_CTX_SYNCHRONIZE", &mut st, own, Scope::Context(h))
        })
    }

    fn rm_ctx_get_stream_priority_range(
        &self,
        call: &CallContext,
        h: RmHandle,
    ) -> ProcResult<RmIntPairReply> {
        let session = self.session(call);
        let raw = session.lock().ctx(h);
        let r = raw.and_then(|c| self.inner.backend.ctx_stream_priority_range(c));
        Ok(int_pair_reply("RM_CTX_GET_STREAM_PRIORITY_RANGE", r))
    }

    fn rm_tools_ctx_query(
        &self,
        call: &CallContext,
        a: RmToolsCtxQueryArgs,
    ) -> ProcResult<RmU64Reply> {
        if !self
            .inner
            .private_driver_calls
            .load(std::sync::atomic::Ordering::Relaxed)
        {
            static ONCE: std::sync::Once = std::sync::Once::new();
            ONCE.call_once(|| {
                tracing::warn!(
                    "RM_TOOLS_CTX_QUERY (a private driver query cuBLASLt makes) refused: this server runs with --no-private-driver-calls; the client's library call fails with CUDA_ERROR_NOT_SUPPORTED"
                );
            });
            return Ok(u64_reply(
                "RM_TOOLS_CTX_QUERY",
                Err(crate::backend::status::NOT_SUPPORTED),
            ));
        }
        let session = self.session(call);
        let raw = session.lock().ctx(a.ctx);
        // The mask and flag are passed on as the library gave them: they may be register
        // leftovers of a three-argument function (observed values: 0x7ffffffeffff and 1,
        // then other low bytes in later runs), so no value is refused; they are plain
        // integers, never dereferenced by Remora.
        let r = raw.and_then(|c| self.inner.backend.tools_ctx_query(c, a.mask, a.flag & 0xff));
        Ok(u64_reply("RM_TOOLS_CTX_QUERY", r))
    }

    // Memory ---------------------------------------------------------------------------------

    fn rm_mem_alloc(&self, call: &CallContext, a: RmAllocArgs) -> ProcResult<RmU64Reply> {
        let session = self.session(call);
        let raw = session.lock().ctx(a.ctx);
        let r = raw.and_then(|c| self.inner.backend.mem_alloc(c, a.bytesize));
        if let Ok(ptr) = r {
            session.lock().ranges.insert(
                ptr,
                Range {
                    size: a.bytesize,
                    ctx: a.ctx,
                    module: None,
                },
            );
        }
        Ok(u64_reply("RM_MEM_ALLOC", r))
    }

    fn rm_mem_alloc_pitch(
        &self,
        call: &CallContext,
        a: RmAllocPitchArgs,
    ) -> ProcResult<RmPitchedReply> {
        let session = self.session(call);
        let raw = session.lock().ctx(a.ctx);
        let r = raw.and_then(|c| {
            self.inner
                .backend
                .mem_alloc_pitch(c, a.width_bytes, a.height, a.element_size)
        });
        Ok(
            match r.inspect_err(|e| log_failed("RM_MEM_ALLOC_PITCH", *e)) {
                Ok((ptr, pitch)) => {
                    session.lock().ranges.insert(
                        ptr,
                        Range {
                            size: pitch.saturating_mul(a.height),
                            ctx: a.ctx,
                            module: None,
                        },
                    );
                    RmPitchedReply::Case0(RmPitched { ptr, pitch })
                }
                Err(e) => RmPitchedReply::Default {
                    discriminant: nz(e),
                },
            },
        )
    }

    fn rm_mem_free(&self, call: &CallContext, a: RmPtrArgs) -> ProcResult<CuResult_> {
        let session = self.session(call);
        let mut st = session.lock();
        let r = match st.ranges.get(&a.ptr).copied() {
            Some(r @ Range { module: None, .. }) => st.ctx(r.ctx),
            _ => Err(INVALID_VALUE),
        };
        let r = r.and_then(|c| self.inner.backend.mem_free(c, a.ptr));
        if r.is_ok() {
            st.ranges.remove(&a.ptr);
        }
        Ok(code("RM_MEM_FREE", r))
    }

    fn rm_mem_get_info(&self, call: &CallContext, h: RmHandle) -> ProcResult<RmMemInfoReply> {
        let session = self.session(call);
        let raw = session.lock().ctx(h);
        let r = raw.and_then(|c| self.inner.backend.mem_get_info(c));
        Ok(match r.inspect_err(|e| log_failed("RM_MEM_GET_INFO", *e)) {
            Ok((free_bytes, total_bytes)) => RmMemInfoReply::Case0(RmMemInfo {
                free_bytes,
                total_bytes,
            }),
            Err(e) => RmMemInfoReply::Default {
                discriminant: nz(e),
            },
        })
    }

    fn rm_mem_get_address_range(
        &self,
        call: &CallContext,
        a: RmPtrArgs,
    ) -> ProcResult<RmRangeReply> {
        let session = self.session(call);
        let st = session.lock();
        let r = st.ctx(a.ctx).and_then(|_| st.range_of(a.ptr));
        Ok(
            match r.inspect_err(|e| log_failed("RM_MEM_GET_ADDRESS_RANGE", *e)) {
                Ok((base, r)) => RmRangeReply::Case0(RmRange { base, size: r.size }),
                Err(e) => RmRangeReply::Default {
                    discriminant: nz(e),
                },
            },
        )
    }

    fn rm_memcpy_htod(&self, call: &CallContext, a: RmHtodArgs) -> ProcResult<RmSyncReply> {
        let session = self.session(call);
        let raw = {
            let st = session.lock();
            st.check_range(a.dst, a.data.len() as u64)
                .and_then(|()| st.ctx(a.ctx))
        };
        let own = raw.and_then(|c| self.inner.backend.memcpy_htod(c, None, a.dst, &a.data));
        let mut st = session.lock();
        Ok(self
            .inner
            .sync_reply("RM_MEMCPY_HTOD", &mut st, own, Scope::Finished))
    }

    fn rm_memcpy_dtoh(&self, call: &CallContext, a: RmDtohArgs) -> ProcResult<RmDtohReply> {
        self.blocking(call, move |inner, session| {
            let raw = {
                let st = session.lock();
                st.check_range(a.src, a.size)
                    .and_then(|()| st.ctx(a.ctx))
                    .and_then(|c| {
                        if a.size > u64::from(RM_MAX_COPY) {
                            Err(INVALID_VALUE)
                        } else {
                            Ok(c)
                        }
                    })
            };
            let r = raw.and_then(|c| {
                let mut buf = vec![0u8; a.size as usize];
                inner.backend.memcpy_dtoh(c, &mut buf, a.src)?;
                Ok(remora_xdr::Bytes::from(buf))
            });
            let mut st = session.lock();
            let mut status = st.sync_status(r.as_ref().map(|_| ()).map_err(|e| nz(*e)));
            // A synchronous copy waits for the context's legacy stream: the async copies
            // queued there before it are complete too.
            let copies = inner.collect(
                &mut st,
                Scope::Stream(a.ctx, u64::from(RM_STREAM_LEGACY)),
                &mut status,
            );
            let data = match r {
                Ok(data) if status == SUCCESS => data,
                _ => remora_xdr::Bytes::new(),
            };
            if status != SUCCESS {
                log_failed("RM_MEMCPY_DTOH", status);
            }
            RmDtohReply {
                status,
                data,
                copies,
            }
        })
    }

    fn rm_memcpy_dtod(&self, call: &CallContext, a: RmDtodArgs) -> ProcResult<RmSyncReply> {
        let session = self.session(call);
        let raw = {
            let st = session.lock();
            st.check_range(a.dst, a.size)
                .and_then(|()| st.check_range(a.src, a.size))
                .and_then(|()| st.ctx(a.ctx))
        };
        let own = raw.and_then(|c| {
            self.inner
                .backend
                .memcpy_dtod(c, None, a.dst, a.src, a.size)
        });
        let mut st = session.lock();
        Ok(self
            .inner
            .sync_reply("RM_MEMCPY_DTOD", &mut st, own, Scope::Finished))
    }

    fn rm_memset(&self, call: &CallContext, a: RmMemsetArgs) -> ProcResult<RmSyncReply> {
        let session = self.session(call);
        let raw = memset_target(&session.lock(), &a);
        let own = raw.and_then(|(c, _)| {
            self.inner
                .backend
                .memset(c, None, a.dst, a.value, a.element_size, a.count)
        });
        let mut st = session.lock();
        Ok(self
            .inner
            .sync_reply("RM_MEMSET", &mut st, own, Scope::Finished))
    }

    fn rm_memcpy_htod_async(&self, call: &CallContext, a: RmHtodArgs) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        self.oneway_on(call, "RM_MEMCPY_HTOD_ASYNC", on, |inner, session| {
            let (c, s, capturing) = {
                let st = session.lock();
                st.check_range(a.dst, a.data.len() as u64)?;
                (
                    st.ctx(a.ctx)?,
                    st.stream(a.stream)?,
                    !st.captures.is_empty(),
                )
            };
            not_captured(inner, capturing, c, s)?;
            inner.backend.memcpy_htod(c, Some(s), a.dst, &a.data)
        })
    }

    fn rm_memcpy_dtoh_async(&self, call: &CallContext, a: RmDtohArgs) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        self.oneway_on(call, "RM_MEMCPY_DTOH_ASYNC", on, |inner, session| {
            if a.copy_id == RM_DEVICE_OUTPUT_ID {
                // Reserved for device output: such a copy could never be told apart.
                return Err(INVALID_VALUE);
            }
            let issued = (|| {
                let (c, s, capturing) = {
                    let st = session.lock();
                    st.check_range(a.src, a.size)?;
                    if a.size > u64::from(RM_MAX_COPY) {
                        return Err(INVALID_VALUE);
                    }
                    (
                        st.ctx(a.ctx)?,
                        st.stream(a.stream)?,
                        !st.captures.is_empty(),
                    )
                };
                // Captured, the copy would land in staging memory only when the graph runs,
                // and its delivery would never come.
                not_captured(inner, capturing, c, s)?;
                inner
                    .backend
                    .memcpy_dtoh_async(c, s, a.src, a.size as usize)
            })();
            // A copy that cannot be issued is delivered empty, so that the client does not
            // wait for its data; its error is deferred like every one-way call's.
            let (copy, result): (Box<dyn StagedCopy>, CuResult<()>) = match issued {
                Ok(copy) => (copy, Ok(())),
                Err(e) => (Box::new(Undelivered), Err(e)),
            };
            let stream = if a.stream == 0 {
                u64::from(RM_STREAM_LEGACY)
            } else {
                a.stream
            };
            session.copies.push(PendingCopy {
                copy_id: a.copy_id,
                ctx: a.ctx,
                stream,
                copy,
                area: None,
                taken: Default::default(),
            });
            result
        })
    }

    fn rm_memcpy_dtod_async(&self, call: &CallContext, a: RmDtodArgs) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        self.oneway_on(call, "RM_MEMCPY_DTOD_ASYNC", on, |inner, session| {
            let (c, s) = {
                let st = session.lock();
                st.check_range(a.dst, a.size)?;
                st.check_range(a.src, a.size)?;
                (st.ctx(a.ctx)?, st.stream(a.stream)?)
            };
            inner.backend.memcpy_dtod(c, Some(s), a.dst, a.src, a.size)
        })
    }

    fn rm_memset_async(&self, call: &CallContext, a: RmMemsetArgs) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        self.oneway_on(call, "RM_MEMSET_ASYNC", on, |inner, session| {
            let (c, s) = memset_target(&session.lock(), &a)?;
            inner
                .backend
                .memset(c, Some(s), a.dst, a.value, a.element_size, a.count)
        })
    }

    // Modules and functions -----------------------------------------------------------------

    fn rm_module_load(&self, call: &CallContext, a: RmModuleLoadArgs) -> ProcResult<RmLoadReply> {
        let session = self.session(call);
        if let Err(e) = session.lock().ctx(a.ctx) {
            return Ok(RmLoadReply::RmLoadFailed(e));
        }
        let image = if a.image.is_empty() {
            match self.inner.cache.get(&a.hash) {
                Some(image) => image,
                None => return Ok(RmLoadReply::RmNeedImage),
            }
        } else {
            let digest: [u8; 32] = Sha256::digest(&a.image).into();
            if digest != a.hash {
                tracing::warn!(
                    connection = call.connection,
                    "RM_MODULE_LOAD: the image does not match its SHA-256"
                );
                return Ok(RmLoadReply::RmLoadFailed(INVALID_VALUE));
            }
            self.inner.cache.insert(a.hash, a.image.clone());
            a.image
        };
        Ok(self.inner.load(&session, a.ctx, &image))
    }

    fn rm_module_unload(&self, call: &CallContext, h: RmHandle) -> ProcResult<CuResult_> {
        let session = self.session(call);
        let mut st = session.lock();
        let (raw, ctx) = match st.get(h) {
            Ok(Resource::Module { raw, ctx }) => (*raw, *ctx),
            _ => return Ok(INVALID_HANDLE),
        };
        let raw_ctx = match st.ctx(ctx) {
            Ok(c) => c,
            Err(e) => return Ok(e),
        };
        let r = self.inner.backend.module_unload(raw_ctx, raw);
        st.remove(h);
        st.remove_module_children(h);
        st.ranges.retain(|_, g| g.module != Some(h));
        Ok(code("RM_MODULE_UNLOAD", r))
    }

    fn rm_module_get_global(
        &self,
        call: &CallContext,
        a: RmGetGlobalArgs,
    ) -> ProcResult<RmGlobalReply> {
        let session = self.session(call);
        let found = {
            let st = session.lock();
            match st.get(a.module) {
                Ok(Resource::Module { raw, ctx }) => st.ctx(*ctx).map(|c| (*raw, *ctx, c)),
                _ => Err(INVALID_HANDLE),
            }
        };
        let r = found.and_then(|(raw, ctx, c)| {
            let (ptr, size) = self.inner.backend.module_get_global(c, raw, &a.name)?;
            session.lock().ranges.entry(ptr).or_insert(Range {
                size,
                ctx,
                module: Some(a.module),
            });
            Ok((ptr, size))
        });
        Ok(
            match r.inspect_err(|e| log_failed("RM_MODULE_GET_GLOBAL", *e)) {
                Ok((ptr, size)) => RmGlobalReply::RmLoaded(RmGlobal { ptr, size }),
                Err(e) => RmGlobalReply::Default {
                    discriminant: RmLoadStatus::RmLoadFailed,
                    value: nz(e),
                },
            },
        )
    }

    fn rm_func_get_attribute(
        &self,
        call: &CallContext,
        a: RmFuncAttrArgs,
    ) -> ProcResult<RmIntReply> {
        let session = self.session(call);
        let f = session.lock().function(a.function);
        Ok(int_reply(
            "RM_FUNC_GET_ATTRIBUTE",
            f.and_then(|(raw, c, _)| self.inner.backend.func_get_attribute(c, raw, a.attribute)),
        ))
    }

    fn rm_func_set_attribute(
        &self,
        call: &CallContext,
        a: RmFuncAttrArgs,
    ) -> ProcResult<CuResult_> {
        let session = self.session(call);
        let f = session.lock().function(a.function);
        Ok(code(
            "RM_FUNC_SET_ATTRIBUTE",
            f.and_then(|(raw, c, _)| {
                self.inner
                    .backend
                    .func_set_attribute(c, raw, a.attribute, a.value)
            }),
        ))
    }

    fn rm_func_set_cache_config(
        &self,
        call: &CallContext,
        a: RmHandleFlags,
    ) -> ProcResult<CuResult_> {
        let session = self.session(call);
        let f = session.lock().function(a.handle);
        Ok(code(
            "RM_FUNC_SET_CACHE_CONFIG",
            f.and_then(|(raw, c, _)| self.inner.backend.func_set_cache_config(c, raw, a.flags)),
        ))
    }

    fn rm_occupancy_max_active_clusters(
        &self,
        call: &CallContext,
        a: RmLaunchArgs,
    ) -> ProcResult<RmIntReply> {
        let session = self.session(call);
        let target = {
            let st = session.lock();
            st.function(a.function).and_then(|(func, fctx, _)| {
                let c = if a.ctx == 0 { fctx } else { st.ctx(a.ctx)? };
                Ok((func, c, st.stream(a.stream)?))
            })
        };
        Ok(int_reply(
            "RM_OCCUPANCY_MAX_ACTIVE_CLUSTERS",
            target.and_then(|(func, c, s)| {
                self.inner.backend.occupancy_max_active_clusters(
                    c,
                    &LaunchSpec {
                        function: func,
                        grid: [a.grid.x, a.grid.y, a.grid.z],
                        block: [a.block.x, a.block.y, a.block.z],
                        shared_mem_bytes: a.shared_mem_bytes,
                        stream: s,
                        params: &[],
                        layout: &[],
                        attrs: &a.attrs,
                    },
                )
            }),
        ))
    }

    fn rm_occupancy_max_potential_block_size(
        &self,
        call: &CallContext,
        a: RmPotentialBlockArgs,
    ) -> ProcResult<RmIntPairReply> {
        let session = self.session(call);
        let f = session.lock().function(a.function);
        Ok(int_pair_reply(
            "RM_OCCUPANCY_MAX_POTENTIAL_BLOCK_SIZE",
            f.and_then(|(raw, c, _)| {
                self.inner.backend.occupancy_max_potential_block_size(
                    c,
                    raw,
                    a.dynamic_smem_bytes,
                    a.block_size_limit,
                    a.flags,
                )
            }),
        ))
    }

    fn rm_occupancy_max_active_blocks(
        &self,
        call: &CallContext,
        a: RmOccupancyArgs,
    ) -> ProcResult<RmIntReply> {
        let session = self.session(call);
        let f = session.lock().function(a.function);
        Ok(int_reply(
            "RM_OCCUPANCY_MAX_ACTIVE_BLOCKS",
            f.and_then(|(raw, c, _)| {
                self.inner.backend.occupancy_max_active_blocks(
                    c,
                    raw,
                    a.block_size,
                    a.dynamic_smem_bytes,
                    a.flags,
                )
            }),
        ))
    }

    // Launches -------------------------------------------------------------------------------

    fn rm_launch_kernel(&self, call: &CallContext, a: RmLaunchArgs) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        self.oneway_on(call, "RM_LAUNCH_KERNEL", on, |inner, session| {
            let (func, c, s, layout) = {
                let st = session.lock();
                let (func, fctx, layout) = st.function(a.function)?;
                let c = if a.ctx == 0 { fctx } else { st.ctx(a.ctx)? };
                (func, c, st.stream(a.stream)?, layout)
            };
            let needed = layout
                .iter()
                .map(|&(o, s)| u64::from(o) + u64::from(s))
                .max()
                .unwrap_or(0);
            if (a.params.len() as u64) < needed {
                return Err(INVALID_VALUE);
            }
            let timed = inner
                .profile
                .load(std::sync::atomic::Ordering::Relaxed)
                .then(std::time::Instant::now);
            let r = inner.backend.launch(
                c,
                &LaunchSpec {
                    function: func,
                    grid: [a.grid.x, a.grid.y, a.grid.z],
                    block: [a.block.x, a.block.y, a.block.z],
                    shared_mem_bytes: a.shared_mem_bytes,
                    stream: s,
                    params: &a.params,
                    layout: &layout,
                    attrs: &a.attrs,
                },
            );
            if let Some(t) = timed {
                session.count_launch(t.elapsed());
            }
            r
        })
    }

    // Streams and events ----------------------------------------------------------------------

    fn rm_stream_create(
        &self,
        call: &CallContext,
        a: RmStreamCreateArgs,
    ) -> ProcResult<RmHandleReply> {
        let session = self.session(call);
        let raw = session.lock().ctx(a.ctx);
        let r = raw.and_then(|c| self.inner.backend.stream_create(c, a.flags, a.priority));
        let mut st = session.lock();
        Ok(handle_reply(
            "RM_STREAM_CREATE",
            r.map(|raw| st.insert(Resource::Stream { raw, ctx: a.ctx })),
        ))
    }

    fn rm_stream_destroy(&self, call: &CallContext, h: RmHandle) -> ProcResult<CuResult_> {
        self.destroy_in_ctx(
            call,
            h,
            "RM_STREAM_DESTROY",
            |r| match r {
                Resource::Stream { raw, ctx } => Ok((*raw, *ctx)),
                _ => Err(INVALID_HANDLE),
            },
            |b, c, raw| b.stream_destroy(c, raw),
        )
    }

    fn rm_stream_synchronize(
        &self,
        call: &CallContext,
        a: RmStreamArgs,
    ) -> ProcResult<RmSyncReply> {
        let session = self.session(call);
        let target = stream_target(&session.lock(), a.ctx, a.stream);
        let done = target
            .is_ok_and(|t| self.poll_briefly(|| self.inner.backend.stream_query(t.ctx, t.stream)));
        self.blocking_unless(call, done, move |inner, session| {
            let target = stream_target(&session.lock(), a.ctx, a.stream);
            let (own, scope) = match target {
                Ok(t) => (
                    inner.backend.stream_synchronize(t.ctx, t.stream),
                    Scope::Stream(t.ctx_handle, t.stream_handle),
                ),
                Err(e) => (Err(e), Scope::Finished),
            };
            let mut st = session.lock();
            inner.sync_reply("RM_STREAM_SYNCHRONIZE", &mut st, own, scope)
        })
    }

    fn rm_stream_query(&self, call: &CallContext, a: RmStreamArgs) -> ProcResult<RmSyncReply> {
        let session = self.session(call);
        let target = stream_target(&session.lock(), a.ctx, a.stream);
        let own = target.and_then(|t| self.inner.backend.stream_query(t.ctx, t.stream));
        let mut st = session.lock();
        Ok(self
            .inner
            .sync_reply("RM_STREAM_QUERY", &mut st, own, Scope::Finished))
    }

    fn rm_stream_wait_event(&self, call: &CallContext, a: RmStreamWaitArgs) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        self.oneway_on(call, "RM_STREAM_WAIT_EVENT", on, |inner, session| {
            let (t, (e, _)) = {
                let st = session.lock();
                (stream_target(&st, a.ctx, a.stream)?, st.event(a.event)?)
            };
            inner.backend.stream_wait_event(t.ctx, t.stream, e, a.flags)
        })
    }

    fn rm_event_create(&self, call: &CallContext, a: RmHandleFlags) -> ProcResult<RmHandleReply> {
        let session = self.session(call);
        let raw = session.lock().ctx(a.handle);
        let r = raw.and_then(|c| self.inner.backend.event_create(c, a.flags));
        let mut st = session.lock();
        Ok(handle_reply(
            "RM_EVENT_CREATE",
            r.map(|raw| st.insert(Resource::Event { raw, ctx: a.handle })),
        ))
    }

    fn rm_event_destroy(&self, call: &CallContext, h: RmHandle) -> ProcResult<CuResult_> {
        let session = self.session(call);
        let mut st = session.lock();
        let r = st
            .event(h)
            .and_then(|(e, c)| self.inner.backend.event_destroy(c, e));
        if r.is_ok() || st.event(h).is_ok() {
            st.remove(h);
        }
        Ok(code("RM_EVENT_DESTROY", r))
    }

    fn rm_event_record(&self, call: &CallContext, a: RmEventRecordArgs) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        self.oneway_on(call, "RM_EVENT_RECORD", on, |inner, session| {
            let (e, t) = {
                let st = session.lock();
                let (e, event_ctx) = match st.get(a.event)? {
                    Resource::Event { raw, ctx } => (*raw, *ctx),
                    _ => return Err(INVALID_HANDLE),
                };
                // The legacy stream of the named context, else of the event's.
                let ctx = if a.ctx == 0 { event_ctx } else { a.ctx };
                (e, stream_target(&st, ctx, a.stream)?)
            };
            inner.backend.event_record(t.ctx, e, t.stream)
        })
    }

    fn rm_event_synchronize(&self, call: &CallContext, h: RmHandle) -> ProcResult<RmSyncReply> {
        let session = self.session(call);
        let ev = session.lock().event(h);
        let done =
            ev.is_ok_and(|(e, c)| self.poll_briefly(|| self.inner.backend.event_query(c, e)));
        self.blocking_unless(call, done, move |inner, session| {
            let ev = session.lock().event(h);
            let own = ev.and_then(|(e, c)| inner.backend.event_synchronize(c, e));
            let mut st = session.lock();
            inner.sync_reply("RM_EVENT_SYNCHRONIZE", &mut st, own, Scope::Finished)
        })
    }

    fn rm_event_query(&self, call: &CallContext, h: RmHandle) -> ProcResult<RmSyncReply> {
        let session = self.session(call);
        let ev = session.lock().event(h);
        let own = ev.and_then(|(e, c)| self.inner.backend.event_query(c, e));
        let mut st = session.lock();
        Ok(self
            .inner
            .sync_reply("RM_EVENT_QUERY", &mut st, own, Scope::Finished))
    }

    fn rm_event_elapsed_time(
        &self,
        call: &CallContext,
        a: RmElapsedArgs,
    ) -> ProcResult<RmFloatReply> {
        let session = self.session(call);
        let evs = {
            let st = session.lock();
            st.event(a.start).and_then(|s| Ok((s, st.event(a.end)?)))
        };
        Ok(float_reply(
            "RM_EVENT_ELAPSED_TIME",
            evs.and_then(|((s, c), (e, _))| self.inner.backend.event_elapsed(c, s, e)),
        ))
    }

    // 2-D, 3-D and peer copies ------------------------------------------------------------

    fn rm_memcpy_3_d(&self, call: &CallContext, a: RmMemcpy3dArgs) -> ProcResult<RmDtohReply> {
        self.copy_3d(call, a, false)
    }

    fn rm_memcpy_3_d_async(&self, call: &CallContext, a: RmMemcpy3dArgs) -> ProcResult<()> {
        self.copy_3d_async(call, a, false)
    }

    fn rm_memcpy_3_d_peer(&self, call: &CallContext, a: RmMemcpy3dArgs) -> ProcResult<RmDtohReply> {
        self.copy_3d(call, a, true)
    }

    fn rm_memcpy_3_d_peer_async(&self, call: &CallContext, a: RmMemcpy3dArgs) -> ProcResult<()> {
        self.copy_3d_async(call, a, true)
    }

    fn rm_memcpy_peer(&self, call: &CallContext, a: RmMemcpyPeerArgs) -> ProcResult<RmSyncReply> {
        let session = self.session(call);
        let raw = peer_target(&session.lock(), &a);
        let own = raw.and_then(|(c, _, dc, sc)| {
            self.inner
                .backend
                .memcpy_peer(c, None, a.dst, dc, a.src, sc, a.size)
        });
        let mut st = session.lock();
        Ok(self
            .inner
            .sync_reply("RM_MEMCPY_PEER", &mut st, own, Scope::Finished))
    }

    fn rm_memcpy_peer_async(&self, call: &CallContext, a: RmMemcpyPeerArgs) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        self.oneway_on(call, "RM_MEMCPY_PEER_ASYNC", on, |inner, session| {
            let (c, s, dc, sc) = peer_target(&session.lock(), &a)?;
            inner
                .backend
                .memcpy_peer(c, Some(s), a.dst, dc, a.src, sc, a.size)
        })
    }

    // Device-side printf output -------------------------------------------------------------

    fn rm_device_output_take(&self, _call: &CallContext) -> ProcResult<RmBytes> {
        Ok(self.inner.take_device_output().unwrap_or_default())
    }

    // Host callbacks (see crate::host_callbacks) ---------------------------------------------

    /// One-way: enqueues on the stream a host function that reports callback `callback_id`
    /// due when the stream reaches it and blocks the stream until the client reports it done.
    /// From here on the session's calls run on its ordered thread.
    fn rm_launch_host_func(&self, call: &CallContext, a: RmHostFuncArgs) -> ProcResult<()> {
        self.launch_host_func(call, "RM_LAUNCH_HOST_FUNC", a, Vec::new())
    }

    fn rm_launch_host_func_copies(
        &self,
        call: &CallContext,
        a: RmHostFuncCopiesArgs,
    ) -> ProcResult<()> {
        let args = RmHostFuncArgs {
            ctx: a.ctx,
            stream: a.stream,
            callback_id: a.callback_id,
        };
        self.launch_host_func(call, "RM_LAUNCH_HOST_FUNC_COPIES", args, a.copies)
    }

    /// Answered when callbacks are due (a deferred reply), never on the ordered thread.
    fn rm_wait_host_callbacks(&self, call: &CallContext) -> ProcResult<RmHostCallbacksReply> {
        let session = self.session(call);
        match call.defer() {
            Some(reply) => {
                session.callbacks.wait(reply);
                Err(ProcError::Deferred)
            }
            None => Ok(RmHostCallbacksReply {
                status: crate::backend::status::NOT_SUPPORTED,
                due: Vec::new(),
            }),
        }
    }

    fn rm_host_callback_done(&self, call: &CallContext, id: u64) -> ProcResult<CuResult_> {
        let session = self.session(call);
        Ok(code("RM_HOST_CALLBACK_DONE", session.callbacks.done(id)))
    }

    /// RM_COPIES_READY (revision 8): the copies host functions published, for the client's
    /// callback thread before it runs a callback. Answered on the connection thread with no
    /// driver call and no lock a driver call may hold (see `PendingCopies`).
    fn rm_copies_ready(&self, call: &CallContext) -> ProcResult<RmSyncReply> {
        let session = self.session(call);
        Ok(RmSyncReply {
            status: SUCCESS,
            copies: session.copies.take_ready(),
        })
    }

    /// RM_COPIES_COLLECT (revision 8): the completed asynchronous copies, for a client whose
    /// synchronizing point covers copies it has not received (in order with the session's
    /// other calls). The named copies are polled briefly, never waited for, so a wrong guess
    /// by the client cannot block the session.
    fn rm_copies_collect(&self, call: &CallContext, ids: Vec<u64>) -> ProcResult<RmSyncReply> {
        let session = self.session(call);
        let deadline = std::time::Instant::now() + COLLECT_POLL;
        loop {
            let mut status = SUCCESS;
            let copies = session.copies.collect(Scope::Finished, &mut status);
            if !copies.is_empty()
                || !session.copies.any_of(&ids)
                || std::time::Instant::now() >= deadline
            {
                log_failed("RM_COPIES_COLLECT", status);
                return Ok(RmSyncReply { status, copies });
            }
            std::thread::sleep(std::time::Duration::from_micros(20));
        }
    }

    // Graphs through stream capture (revision 5) ---------------------------------------------

    fn rm_stream_begin_capture(
        &self,
        call: &CallContext,
        a: RmBeginCaptureArgs,
    ) -> ProcResult<RmCaptureBegunReply> {
        let session = self.session(call);
        let mut st = session.lock();
        let r = (|| {
            if !(0..=2).contains(&a.mode) {
                return Err(INVALID_VALUE);
            }
            let t = stream_target(&st, a.ctx, a.stream)?;
            let info = self.inner.backend.stream_begin_capture(t.ctx, t.stream)?;
            let graph = st.insert(Resource::Graph {
                raw: info.graph,
                ctx: t.ctx_handle,
                capture: Some(t.stream),
            });
            st.captures.insert(info.id, Capture { graph, error: None });
            Ok(RmCaptureBegun { id: info.id, graph })
        })();
        Ok(match r {
            Ok(b) => RmCaptureBegunReply::Case0(b),
            Err(e) => {
                log_failed("RM_STREAM_BEGIN_CAPTURE", nz(e));
                RmCaptureBegunReply::Default {
                    discriminant: nz(e),
                }
            }
        })
    }

    fn rm_stream_end_capture(
        &self,
        call: &CallContext,
        a: RmStreamArgs,
    ) -> ProcResult<RmEndCaptureReply> {
        let session = self.session(call);
        let backend = &*self.inner.backend;
        let t = match stream_target(&session.lock(), a.ctx, a.stream) {
            Ok(t) => t,
            Err(e) => {
                return Ok(RmEndCaptureReply {
                    status: e,
                    graph: 0,
                    still_capturing: false,
                });
            }
        };
        let before = backend.stream_capture_info(t.ctx, t.stream);
        let r = backend.stream_end_capture(t.ctx, t.stream);
        let still_capturing = backend
            .stream_capture_info(t.ctx, t.stream)
            .is_ok_and(|i| i.status != capture_status::NONE);
        let mut st = session.lock();
        let ended = match before {
            Ok(i) if i.status != capture_status::NONE && !still_capturing => {
                st.captures.remove(&i.id)
            }
            _ => None,
        };
        let r = match (r, ended) {
            (Ok(raw), Some(cap)) => {
                if let Ok(Resource::Graph {
                    raw: g, capture, ..
                }) = st.get_mut(cap.graph)
                {
                    *g = raw;
                    *capture = None;
                }
                match cap.error {
                    Some(e) => {
                        // A captured call failed: natively the capture was invalidated.
                        st.remove(cap.graph);
                        let _ = backend.graph_destroy(t.ctx, raw);
                        Err(e)
                    }
                    None => Ok(cap.graph),
                }
            }
            (Ok(raw), None) => Ok(st.insert(Resource::Graph {
                raw,
                ctx: t.ctx_handle,
                capture: None,
            })),
            (Err(e), Some(cap)) => {
                // The driver freed the graph of the capture it ended with an error.
                st.remove(cap.graph);
                Err(e)
            }
            (Err(e), None) => Err(e),
        };
        let (status, graph) = match r {
            Ok(g) => (SUCCESS, g),
            Err(e) => {
                log_failed("RM_STREAM_END_CAPTURE", nz(e));
                (nz(e), 0)
            }
        };
        Ok(RmEndCaptureReply {
            status,
            graph,
            still_capturing,
        })
    }

    fn rm_stream_get_capture_info(
        &self,
        call: &CallContext,
        a: RmStreamArgs,
    ) -> ProcResult<RmCaptureInfoReply> {
        let session = self.session(call);
        let st = session.lock();
        let r = stream_target(&st, a.ctx, a.stream)
            .and_then(|t| self.inner.backend.stream_capture_info(t.ctx, t.stream));
        Ok(match r {
            Ok(i) => RmCaptureInfoReply::Case0(RmCaptureInfo {
                status: i.status,
                id: if i.status == capture_status::NONE {
                    0
                } else {
                    i.id
                },
                graph: capture_graph(&st, &i),
                dependencies: i.dependencies,
            }),
            Err(e) => {
                log_failed("RM_STREAM_GET_CAPTURE_INFO", nz(e));
                RmCaptureInfoReply::Default {
                    discriminant: nz(e),
                }
            }
        })
    }

    fn rm_graph_instantiate(
        &self,
        call: &CallContext,
        a: RmGraphInstantiateArgs,
    ) -> ProcResult<RmHandleReply> {
        let session = self.session(call);
        let mut st = session.lock();
        let r = (|| {
            let (raw, graph_ctx) = match st.get(a.graph)? {
                Resource::Graph {
                    raw,
                    ctx,
                    capture: None,
                } => (*raw, *ctx),
                // Still being captured.
                Resource::Graph { .. } => return Err(INVALID_VALUE),
                _ => return Err(INVALID_HANDLE),
            };
            let ctx = if a.ctx == 0 { graph_ctx } else { a.ctx };
            let c = st.ctx(ctx)?;
            let exec = self.inner.backend.graph_instantiate(c, raw, a.flags)?;
            Ok(st.insert(Resource::GraphExec { raw: exec, ctx }))
        })();
        Ok(handle_reply("RM_GRAPH_INSTANTIATE", r))
    }

    fn rm_graph_launch(&self, call: &CallContext, a: RmGraphLaunchArgs) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        self.oneway_on(call, "RM_GRAPH_LAUNCH", on, |inner, session| {
            let (exec, t) = graph_exec_target(&session.lock(), &a)?;
            inner.backend.graph_launch(t.ctx, exec, t.stream)
        })
    }

    fn rm_graph_upload(&self, call: &CallContext, a: RmGraphLaunchArgs) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        self.oneway_on(call, "RM_GRAPH_UPLOAD", on, |inner, session| {
            let (exec, t) = graph_exec_target(&session.lock(), &a)?;
            inner.backend.graph_upload(t.ctx, exec, t.stream)
        })
    }

    fn rm_graph_exec_destroy(&self, call: &CallContext, h: RmHandle) -> ProcResult<CuResult_> {
        self.destroy_in_ctx(
            call,
            h,
            "RM_GRAPH_EXEC_DESTROY",
            |r| match r {
                Resource::GraphExec { raw, ctx } => Ok((*raw, *ctx)),
                _ => Err(INVALID_HANDLE),
            },
            |b, c, raw| b.graph_exec_destroy(c, raw),
        )
    }

    fn rm_graph_destroy(&self, call: &CallContext, h: RmHandle) -> ProcResult<CuResult_> {
        self.destroy_in_ctx(
            call,
            h,
            "RM_GRAPH_DESTROY",
            |r| match r {
                Resource::Graph {
                    raw,
                    ctx,
                    capture: None,
                } => Ok((*raw, *ctx)),
                // The graph of a capture in progress belongs to the capture.
                Resource::Graph { .. } => Err(INVALID_VALUE),
                _ => Err(INVALID_HANDLE),
            },
            |b, c, raw| b.graph_destroy(c, raw),
        )
    }

    fn rm_graph_node_count(&self, call: &CallContext, h: RmHandle) -> ProcResult<RmU64Reply> {
        let session = self.session(call);
        let st = session.lock();
        let r = match st.get(h) {
            Ok(Resource::Graph { raw, ctx, .. }) => st
                .ctx(*ctx)
                .and_then(|c| self.inner.backend.graph_node_count(c, *raw)),
            _ => Err(INVALID_HANDLE),
        };
        Ok(u64_reply("RM_GRAPH_NODE_COUNT", r))
    }

    fn rm_area_memcpy_htod(
        &self,
        call: &CallContext,
        a: RmAreaCopyArgs,
    ) -> ProcResult<RmSyncReply> {
        let session = self.session(call);
        let raw = area_of(call, a.offset, a.size).and_then(|area| {
            let st = session.lock();
            st.check_range(a.dev, a.size)?;
            Ok((st.ctx(a.ctx)?, area))
        });
        let own = raw.and_then(|(c, area)| {
            self.inner
                .backend
                .memcpy_htod_area(c, None, a.dev, &area, a.offset, a.size)
        });
        let mut st = session.lock();
        Ok(self
            .inner
            .sync_reply("RM_AREA_MEMCPY_HTOD", &mut st, own, Scope::Finished))
    }

    fn rm_area_memcpy_dtoh(
        &self,
        call: &CallContext,
        a: RmAreaCopyArgs,
    ) -> ProcResult<RmSyncReply> {
        let area = area_of(call, a.offset, a.size);
        self.blocking(call, move |inner, session| {
            let raw = area.and_then(|area| {
                let st = session.lock();
                st.check_range(a.dev, a.size)?;
                Ok((st.ctx(a.ctx)?, area))
            });
            let r = raw.and_then(|(c, area)| {
                inner
                    .backend
                    .memcpy_dtoh_area(c, a.dev, &area, a.offset, a.size)
            });
            let mut st = session.lock();
            let mut status = st.sync_status(r.map_err(nz));
            // As RM_MEMCPY_DTOH: the legacy stream's earlier async copies are complete too.
            let copies = inner.collect(
                &mut st,
                Scope::Stream(a.ctx, u64::from(RM_STREAM_LEGACY)),
                &mut status,
            );
            log_failed("RM_AREA_MEMCPY_DTOH", status);
            RmSyncReply { status, copies }
        })
    }

    fn rm_area_memcpy_htod_async(&self, call: &CallContext, a: RmAreaCopyArgs) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        // The reply only says that the source bytes have been consumed; errors are deferred
        // as a one-way call's.
        self.oneway_on(call, "RM_AREA_MEMCPY_HTOD_ASYNC", on, |inner, session| {
            let area = area_of(call, a.offset, a.size)?;
            let (c, s, capturing) = {
                let st = session.lock();
                st.check_range(a.dev, a.size)?;
                (
                    st.ctx(a.ctx)?,
                    st.stream(a.stream)?,
                    !st.captures.is_empty(),
                )
            };
            not_captured(inner, capturing, c, s)?;
            if a.copy_id == AREA_PINNED_SOURCE {
                // Zero-copy pinned memory: the client does not reuse the bytes before the
                // stream reaches the copy, so the backend may read them as late as that.
                return inner
                    .backend
                    .memcpy_htod_async_area_pinned(c, s, a.dev, &area, a.offset, a.size);
            }
            inner
                .backend
                .memcpy_htod_area(c, Some(s), a.dev, &area, a.offset, a.size)
        })
    }

    fn rm_area_memcpy_dtoh_async(&self, call: &CallContext, a: RmAreaCopyArgs) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        self.oneway_on(call, "RM_AREA_MEMCPY_DTOH_ASYNC", on, |inner, session| {
            if a.copy_id == RM_DEVICE_OUTPUT_ID {
                return Err(INVALID_VALUE);
            }
            if a.copy_id == 0 {
                // Zero-copy pinned memory: the bytes go straight into the area when the
                // copy executes, and nothing is delivered (the client waits for nothing).
                let area = area_of(call, a.offset, a.size)?;
                let (c, s, capturing) = {
                    let st = session.lock();
                    st.check_range(a.dev, a.size)?;
                    (
                        st.ctx(a.ctx)?,
                        st.stream(a.stream)?,
                        !st.captures.is_empty(),
                    )
                };
                not_captured(inner, capturing, c, s)?;
                return inner
                    .backend
                    .memcpy_dtoh_async_area(c, s, a.dev, &area, a.offset, a.size);
            }
            let area = area_of(call, a.offset, a.size);
            let issued = (|| {
                let area = area.clone()?;
                let (c, s, capturing) = {
                    let st = session.lock();
                    st.check_range(a.dev, a.size)?;
                    (
                        st.ctx(a.ctx)?,
                        st.stream(a.stream)?,
                        !st.captures.is_empty(),
                    )
                };
                not_captured(inner, capturing, c, s)?;
                // `area_of` bounded the size by the area's.
                let copy = inner
                    .backend
                    .memcpy_dtoh_async(c, s, a.dev, a.size as usize)?;
                Ok((copy, area))
            })();
            // A copy that cannot be issued is delivered empty all the same (the client waits
            // for its delivery); its error is deferred like every one-way call's.
            let (copy, target, result): (Box<dyn StagedCopy>, _, CuResult<()>) = match issued {
                Ok((copy, area)) => (copy, Some((area, a.offset)), Ok(())),
                Err(e) => (Box::new(Undelivered), None, Err(e)),
            };
            let stream = if a.stream == 0 {
                u64::from(RM_STREAM_LEGACY)
            } else {
                a.stream
            };
            session.copies.push(PendingCopy {
                copy_id: a.copy_id,
                ctx: a.ctx,
                stream,
                copy,
                area: target,
                taken: Default::default(),
            });
            result
        })
    }
}

/// `copy_id` of an `RM_AREA_MEMCPY_HTOD_ASYNC` whose source is zero-copy pinned memory
/// (docs/protocol.md, revision 6): the bytes stay put until the stream reaches the copy.
/// Any other value: a staging lease that the client reuses once the call is answered.
const AREA_PINNED_SOURCE: u64 = 1;

/// The session's data area, when `size` bytes at `offset` lie inside it and the size is
/// within one copy's bound; `CUDA_ERROR_INVALID_VALUE` otherwise (no area, or out of bounds:
/// the client chose these numbers).
fn area_of(call: &CallContext, offset: u64, size: u64) -> CuResult<remora_oncrpc::DataArea> {
    let area = call.data_area().ok_or(INVALID_VALUE)?;
    if size > u64::from(RM_MAX_COPY) || area.check(offset, size).is_err() {
        tracing::debug!(
            offset,
            size,
            area = area.len(),
            "an area copy names bytes outside the data area"
        );
        return Err(INVALID_VALUE);
    }
    Ok(area.clone())
}

impl Executor {
    /// RM_LAUNCH_HOST_FUNC(_COPIES): a host function that reports the client's callback due
    /// when the stream reaches it, after publishing the pending copies `copies` (which the
    /// callback is ordered after, so they have completed) for RM_COPIES_READY.
    fn launch_host_func(
        &self,
        call: &CallContext,
        what: &'static str,
        a: RmHostFuncArgs,
        copies: Vec<u64>,
    ) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        self.oneway_on(call, what, on, move |inner, session| {
            let (t, capturing) = {
                let st = session.lock();
                (
                    stream_target(&st, a.ctx, a.stream)?,
                    !st.captures.is_empty(),
                )
            };
            // Captured, the host function would run at every graph launch, but the client's
            // callback runs once.
            not_captured(inner, capturing, t.ctx, t.stream)?;
            session.ordered.start(session.connection)?;
            inner
                .any_ordered
                .store(true, std::sync::atomic::Ordering::Release);
            let callbacks = Arc::clone(&session.callbacks);
            // The host function runs on the driver's thread while a call of this session may
            // hold the session lock inside the driver waiting for it (cuMemFree, a
            // synchronous copy): it must not take that lock, nor call the driver. The sticky
            // error is read from its own cell; the copies it publishes are held here.
            let sticky = session.lock().sticky_cell();
            let follows = if copies.is_empty() {
                Vec::new()
            } else {
                session.copies.find(&copies)
            };
            let published = Arc::clone(&session.copies);
            let id = a.callback_id;
            inner.backend.launch_host_func(
                t.ctx,
                t.stream,
                Box::new(move || {
                    published.publish(&follows);
                    drop(follows);
                    let status = sticky.load(std::sync::atomic::Ordering::Acquire);
                    callbacks.reached(id, status);
                }),
            )
        })
    }

    /// `RM_MEMCPY_3D` / `RM_MEMCPY_3D_PEER`: a synchronizing call. A copy to host memory
    /// returns the packed bytes and, like `RM_MEMCPY_DTOH`, runs on a waiter thread and
    /// delivers the asynchronous copies of the context's legacy stream.
    fn copy_3d(
        &self,
        call: &CallContext,
        a: RmMemcpy3dArgs,
        peer: bool,
    ) -> ProcResult<RmDtohReply> {
        let what = if peer {
            "RM_MEMCPY_3D_PEER"
        } else {
            "RM_MEMCPY_3D"
        };
        let to_host = a.desc.dst.kind == RmMemKind::RmMemHostPacked;
        let job = move |inner: &Inner, session: &Session| {
            let target = copy_target(&session.lock(), &a, peer, false);
            let r = target.and_then(|(ctx, copy)| {
                let Some(copy) = copy else {
                    return Ok(remora_xdr::Bytes::new());
                };
                let mut buf = if to_host {
                    // Bounded by copy_target (RM_MAX_COPY).
                    vec![0u8; copy.packed_len() as usize]
                } else {
                    Vec::new()
                };
                inner
                    .backend
                    .memcpy_3d(ctx, None, &copy, &a.data, &mut buf)?;
                Ok(remora_xdr::Bytes::from(buf))
            });
            let mut st = session.lock();
            let mut status = st.sync_status(r.as_ref().map(|_| ()).map_err(|e| nz(*e)));
            let scope = if to_host {
                Scope::Stream(a.desc.ctx, u64::from(RM_STREAM_LEGACY))
            } else {
                Scope::Finished
            };
            let copies = inner.collect(&mut st, scope, &mut status);
            let data = match r {
                Ok(data) if status == SUCCESS => data,
                _ => remora_xdr::Bytes::new(),
            };
            log_failed(what, status);
            RmDtohReply {
                status,
                data,
                copies,
            }
        };
        if to_host {
            self.blocking(call, job)
        } else {
            let session = self.session(call);
            Ok(job(&self.inner, &session))
        }
    }

    /// `RM_MEMCPY_3D_ASYNC` / `RM_MEMCPY_3D_PEER_ASYNC`: one-way. A copy to host memory lands
    /// in staging memory and is delivered, tagged with its `copy_id`, by a later synchronizing
    /// reply; one that fails is delivered empty (its error is deferred as for every one-way
    /// call), so that the client never waits for data that will not come.
    fn copy_3d_async(&self, call: &CallContext, a: RmMemcpy3dArgs, peer: bool) -> ProcResult<()> {
        let what = if peer {
            "RM_MEMCPY_3D_PEER_ASYNC"
        } else {
            "RM_MEMCPY_3D_ASYNC"
        };
        let to_host = a.desc.dst.kind == RmMemKind::RmMemHostPacked;
        let stream_handle = match a.desc.stream {
            0 => u64::from(RM_STREAM_LEGACY),
            s => s,
        };
        let from_host = a.desc.src.kind == RmMemKind::RmMemHostPacked;
        let on = Some((a.desc.ctx, a.desc.stream));
        self.oneway_on(call, what, on, |inner, session| {
            if to_host && a.copy_id == RM_DEVICE_OUTPUT_ID {
                return Err(INVALID_VALUE);
            }
            let issued = (|| {
                let (ctx, copy, stream, capturing) = {
                    let st = session.lock();
                    let (ctx, copy) = copy_target(&st, &a, peer, true)?;
                    let capturing = !st.captures.is_empty() && (to_host || from_host);
                    (ctx, copy, st.stream(a.desc.stream)?, capturing)
                };
                not_captured(inner, capturing, ctx, stream)?;
                let Some(copy) = copy else {
                    return Ok(None);
                };
                if to_host {
                    Ok(Some(
                        inner.backend.memcpy_3d_dtoh_async(ctx, stream, &copy)?,
                    ))
                } else {
                    inner
                        .backend
                        .memcpy_3d(ctx, Some(stream), &copy, &a.data, &mut [])?;
                    Ok(None)
                }
            })();
            let (copy, result): (Option<Box<dyn StagedCopy>>, CuResult<()>) = match issued {
                Ok(c) => (c, Ok(())),
                Err(e) => (Some(Box::new(Undelivered)), Err(e)),
            };
            if to_host && let Some(copy) = copy {
                session.copies.push(PendingCopy {
                    copy_id: a.copy_id,
                    ctx: a.desc.ctx,
                    stream: stream_handle,
                    copy,
                    area: None,
                    taken: Default::default(),
                });
            }
            result
        })
    }
}

/// The data of an asynchronous copy to host memory that failed: delivered empty.
struct Undelivered;

impl StagedCopy for Undelivered {
    fn query(&self) -> CuResult<bool> {
        Ok(true)
    }
    fn wait(&self) -> CuResult<()> {
        Ok(())
    }
    fn data(&self) -> &[u8] {
        &[]
    }
}

/// `(calling context, stream, destination context, source context)` of a peer copy, with
/// both ranges checked against the session's allocations.
fn peer_target(st: &SessionState, a: &RmMemcpyPeerArgs) -> CuResult<(u64, u64, u64, u64)> {
    st.check_range(a.dst, a.size)?;
    st.check_range(a.src, a.size)?;
    Ok((
        st.ctx(a.ctx)?,
        st.stream(a.stream)?,
        st.ctx(a.dst_ctx)?,
        st.ctx(a.src_ctx)?,
    ))
}

/// Checks one side of a 2-D or 3-D copy from the wire (see [`copy_target`]).
fn copy_side(
    st: &SessionState,
    s: &RmMemcpy3dSide,
    d: &RmMemcpy3dDesc,
    peer: bool,
    call_ctx: u64,
) -> CuResult<CopySide> {
    let (w, h, depth) = (d.width_bytes, d.height, d.depth);
    let ctx = match (peer, s.ctx) {
        (false, 0) => None,
        (false, _) => return Err(INVALID_VALUE),
        (true, 0) if s.kind == RmMemKind::RmMemHostPacked => Some(call_ctx),
        (true, c) => Some(st.ctx(c)?),
    };
    match s.kind {
        RmMemKind::RmMemHostPacked => {
            // The canonical packed layout, nothing else.
            if s.ptr != 0 || s.x_bytes != 0 || s.y != 0 || s.z != 0 || s.pitch != w || s.height != h
            {
                return Err(INVALID_VALUE);
            }
            Ok(CopySide {
                place: CopyPlace::Host,
                pitch: w,
                height: h,
                x_bytes: 0,
                y: 0,
                z: 0,
                ctx,
            })
        }
        RmMemKind::RmMemDevice => {
            if s.pitch < w || (depth > 1 && s.height < h) {
                return Err(INVALID_VALUE);
            }
            // Rows start at ((z + k) * height + y + r) * pitch + x, increasing in k and r: the
            // copy touches bytes between the first row's start and the last row's end only.
            let row = |k: u64, r: u64| -> Option<u64> {
                s.z.checked_add(k)?
                    .checked_mul(s.height)?
                    .checked_add(s.y.checked_add(r)?)?
                    .checked_mul(s.pitch)?
                    .checked_add(s.x_bytes)
            };
            let first = row(0, 0).ok_or(INVALID_VALUE)?;
            let end = row(depth - 1, h - 1)
                .and_then(|l| l.checked_add(w))
                .ok_or(INVALID_VALUE)?;
            let start = s.ptr.checked_add(first).ok_or(INVALID_VALUE)?;
            st.check_range(start, end - first)?;
            Ok(CopySide {
                place: CopyPlace::Device(s.ptr),
                pitch: s.pitch,
                height: s.height,
                x_bytes: s.x_bytes,
                y: s.y,
                z: s.z,
                ctx,
            })
        }
    }
}

/// Checks a 2-D or 3-D copy from the wire and maps it onto the backend: the calling context,
/// and the copy (`None` when the extent is empty: nothing to do). Every device range is checked
/// against the session's allocations; a packed host side is at most `RM_MAX_COPY` bytes and
/// the data carried must be exactly the packed source.
fn copy_target(
    st: &SessionState,
    a: &RmMemcpy3dArgs,
    peer: bool,
    is_async: bool,
) -> CuResult<(u64, Option<Copy3d>)> {
    let d = &a.desc;
    let ctx = st.ctx(d.ctx)?;
    let form = match d.form {
        RmCopyForm::RmCopy3D => CopyForm::ThreeD,
        RmCopyForm::RmCopy2D => CopyForm::TwoD,
        RmCopyForm::RmCopy2DUnaligned => CopyForm::TwoDUnaligned,
    };
    let two_d = form != CopyForm::ThreeD;
    if (two_d && (peer || d.depth != 1 || d.src.z != 0 || d.dst.z != 0))
        || (is_async && form == CopyForm::TwoDUnaligned)
    {
        return Err(INVALID_VALUE);
    }
    let host_src = d.src.kind == RmMemKind::RmMemHostPacked;
    let host_dst = d.dst.kind == RmMemKind::RmMemHostPacked;
    if host_src && host_dst {
        return Err(INVALID_VALUE);
    }
    let total = d
        .width_bytes
        .checked_mul(d.height)
        .and_then(|n| n.checked_mul(d.depth))
        .ok_or(INVALID_VALUE)?;
    if (host_src || host_dst) && total > u64::from(RM_MAX_COPY) {
        return Err(INVALID_VALUE);
    }
    let carried = if host_src { total } else { 0 };
    if a.data.len() as u64 != carried {
        return Err(INVALID_VALUE);
    }
    if total == 0 {
        return Ok((ctx, None));
    }
    let copy = Copy3d {
        form,
        src: copy_side(st, &d.src, d, peer, ctx)?,
        dst: copy_side(st, &d.dst, d, peer, ctx)?,
        width: d.width_bytes,
        height: d.height,
        depth: d.depth,
    };
    Ok((ctx, Some(copy)))
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
            return Err(INVALID_CONTEXT);
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
        _ => Err(INVALID_HANDLE),
    }
}

/// The backend executable graph and the stream a graph launch or upload names.
fn graph_exec_target(st: &SessionState, a: &RmGraphLaunchArgs) -> CuResult<(u64, StreamTarget)> {
    let (exec, exec_ctx) = match st.get(a.exec)? {
        Resource::GraphExec { raw, ctx } => (*raw, *ctx),
        _ => return Err(INVALID_HANDLE),
    };
    let ctx = if a.ctx == 0 { exec_ctx } else { a.ctx };
    Ok((exec, stream_target(st, ctx, a.stream)?))
}

fn memset_target(st: &SessionState, a: &RmMemsetArgs) -> CuResult<(u64, u64)> {
    if !matches!(a.element_size, 1 | 2 | 4) {
        return Err(INVALID_VALUE);
    }
    let len = a
        .count
        .checked_mul(u64::from(a.element_size))
        .ok_or(INVALID_VALUE)?;
    st.check_range(a.dst, len)?;
    Ok((st.ctx(a.ctx)?, st.stream(a.stream)?))
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
            Err(STREAM_CAPTURE_UNSUPPORTED)
        }
    }
}

/// The session handle of the graph a capture is building, if known.
fn capture_graph(st: &SessionState, info: &CaptureInfo) -> u64 {
    if info.status == capture_status::ACTIVE {
        st.captures.get(&info.id).map_or(0, |c| c.graph)
    } else {
        0
    }
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
        let session = self.inner.sessions().remove(&connection);
        if let Some(session) = session {
            if let Some((n, total)) = session.launch_profile() {
                tracing::info!(
                    connection,
                    launches = n,
                    "session profile: {n} kernel launches, mean {:.2} us in the driver's launch call",
                    total.as_secs_f64() * 1e6 / n as f64
                );
            }
            // Before the contexts go: a backend may need one to undo its registration.
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
            session.close(&*self.inner.backend);
        }
    }
}
