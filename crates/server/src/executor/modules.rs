//! Procedures on modules, functions, globals, occupancy and kernel launches.

use remora_proto::cuda::{CuError, CuResult, cu};
use remora_xdr::Bytes;
use sha2::{Digest, Sha256};

use super::*;

/// Images from this size on are checked and copied for the cache beside the driver's load
/// ([`Executor::load_checking_beside`]); below it, two threads cost more than they save.
const CHECK_BESIDE_LOAD_MIN: usize = 1 << 20;

/// The module-cache scope of a session: its authenticated tenant; without authentication,
/// its Unix user (from SO_PEERCRED), or one scope for all anonymous TCP clients.
fn cache_scope(call: &CallContext, session: &Session) -> String {
    if let Some(t) = session.tenant.get() {
        return format!("tenant:{t}");
    }
    match call.peer {
        remora_oncrpc::Peer::Unix { uid, .. } => format!("uid:{uid}"),
        _ => "anonymous".to_owned(),
    }
}

impl Executor {
    pub(super) fn module_load(
        &self,
        call: &CallContext,
        a: RmModuleLoadArgs,
    ) -> ProcResult<RmLoadReply> {
        let session = self.session(call);
        if let Err(e) = session.lock().ctx(a.ctx) {
            return Ok(RmLoadReply::RmLoadFailed(e.0));
        }
        let scope = cache_scope(call, &session);
        // Revision 20: an image sent with an all-zero hash is unnamed, and named here (no
        // SHA-256 of real bytes is all zeros: 2^-256).
        let unnamed = a.hash == [0; 32] && !a.image.is_empty();
        let image = if a.image.is_empty() {
            match self.inner.cache.get(&scope, &a.hash) {
                Some(image) => image,
                None => {
                    self.inner.images_asked.fetch_add(1, Ordering::Relaxed);
                    return Ok(RmLoadReply::RmNeedImage);
                }
            }
        } else if a.image.len() >= CHECK_BESIDE_LOAD_MIN {
            return Ok(self.load_checking_beside(&session, &scope, a, unnamed));
        } else {
            let t0 = std::time::Instant::now();
            let digest: [u8; 32] = Sha256::digest(&a.image).into();
            let hash_us = t0.elapsed().as_micros() as u64;
            if !unnamed && digest != a.hash {
                tracing::warn!(
                    connection = call.connection,
                    "RM_MODULE_LOAD: the image does not match its SHA-256"
                );
                return Ok(RmLoadReply::RmLoadFailed(cu::INVALID_VALUE));
            }
            let t1 = std::time::Instant::now();
            self.inner.cache.insert(&scope, digest, a.image.clone());
            tracing::debug!(
                target: "remora::module_load",
                bytes = a.image.len(),
                hash_us,
                cache_us = t1.elapsed().as_micros() as u64,
                unnamed,
                "image verified and cached"
            );
            a.image
        };
        Ok(self.inner.load(&session, a.ctx, &image))
    }

    /// [`Executor::module_load`] of a large image: the driver loads it while two threads of
    /// the call check it against its SHA-256 (or, `unnamed`, name it) and copy it for the
    /// cache, so the call takes the longest of the three and not their sum (an 8 MiB cuBLAS
    /// image on the H200 host: load 5.1 ms, SHA-256 6.8 ms, copy 4.6 ms). An image that does
    /// not match its hash is refused as before: what the driver loaded from it is unloaded,
    /// and nothing is cached.
    fn load_checking_beside(
        &self,
        session: &Session,
        scope: &str,
        a: RmModuleLoadArgs,
        unnamed: bool,
    ) -> RmLoadReply {
        let image = &a.image;
        let t0 = std::time::Instant::now();
        let (reply, checked, copy) = std::thread::scope(|s| {
            let check = std::thread::Builder::new()
                .name("remora-image-check".into())
                .spawn_scoped(s, || {
                    let t = std::time::Instant::now();
                    let digest: [u8; 32] = Sha256::digest(image).into();
                    (digest, t.elapsed())
                })
                .ok();
            let copy = std::thread::Builder::new()
                .name("remora-image-copy".into())
                .spawn_scoped(s, || Bytes::copy_from_slice(image))
                .ok();
            let reply = self.inner.load(session, a.ctx, image);
            (
                reply,
                check.and_then(|t| t.join().ok()),
                copy.and_then(|t| t.join().ok()),
            )
        });
        // A thread that could not start (or ended early) leaves its part to this one.
        let (digest, hash_time) = checked.unwrap_or_else(|| {
            let t = std::time::Instant::now();
            (Sha256::digest(image).into(), t.elapsed())
        });
        if !unnamed && digest != a.hash {
            tracing::warn!(
                connection = session.connection,
                "RM_MODULE_LOAD: the image does not match its SHA-256"
            );
            if let RmLoadReply::RmLoaded(m) = &reply {
                let r = self.module_unload(session, m.module);
                if r != 0 {
                    tracing::warn!(
                        result = r,
                        "RM_MODULE_LOAD: unloading the module of an image that did not match its SHA-256 failed"
                    );
                }
            }
            return RmLoadReply::RmLoadFailed(cu::INVALID_VALUE);
        }
        let copy = copy.unwrap_or_else(|| Bytes::copy_from_slice(image));
        self.inner.cache.insert_own(scope, digest, copy);
        tracing::debug!(
            target: "remora::module_load",
            bytes = image.len(),
            hash_us = hash_time.as_micros() as u64,
            call_us = t0.elapsed().as_micros() as u64,
            unnamed,
            "image loaded, verified and cached side by side"
        );
        reply
    }

    pub(super) fn module_unload(&self, session: &Session, h: RmHandle) -> CuResult_ {
        let mut st = session.lock();
        let (raw, ctx) = match st.get(h) {
            Ok(Resource::Module { raw, ctx }) => (*raw, *ctx),
            _ => return cu::INVALID_HANDLE,
        };
        let raw_ctx = match st.ctx(ctx) {
            Ok(c) => c,
            Err(e) => return e.0,
        };
        let r = self.inner.backend.module_unload(raw_ctx, raw);
        st.remove(h);
        st.remove_module_children(h);
        st.ranges.retain(|_, g| g.module() != Some(h));
        code("RM_MODULE_UNLOAD", r)
    }

    pub(super) fn module_get_global(&self, session: &Session, a: RmGetGlobalArgs) -> RmGlobalReply {
        let r = self.resolved(
            session,
            |st| match st.get(a.module) {
                Ok(Resource::Module { raw, ctx }) => st.ctx(*ctx).map(|c| (*raw, *ctx, c)),
                _ => Err(CuError(cu::INVALID_HANDLE)),
            },
            |b, (raw, ctx, c)| {
                let (ptr, size) = b.module_get_global(c, raw, &a.name)?;
                session.lock().ranges.entry(ptr).or_insert(Range {
                    size,
                    ctx,
                    kind: RangeKind::Global(a.module),
                });
                Ok((ptr, size))
            },
        );
        union_reply(
            "RM_MODULE_GET_GLOBAL",
            r,
            |(ptr, size)| RmGlobalReply::RmLoaded(RmGlobal { ptr, size }),
            |value| RmGlobalReply::Default {
                discriminant: RmLoadStatus::RmLoadFailed,
                value,
            },
        )
    }

    pub(super) fn occupancy_max_active_clusters(
        &self,
        session: &Session,
        a: RmLaunchArgs,
    ) -> RmIntReply {
        let r = self.resolved(
            session,
            |st| launch_target(st, &a),
            |b, t| {
                t.function.ensure_loaded(b)?;
                b.occupancy_max_active_clusters(t.ctx, &launch_spec(&a, &t, &[], &[]))
            },
        );
        int_reply("RM_OCCUPANCY_MAX_ACTIVE_CLUSTERS", r)
    }

    /// Asks `ask` an occupancy question about function handle `function`: blocks of
    /// `block_size` threads (or at most that many), with `dynamic_smem` bytes of dynamic
    /// shared memory and `flags`.
    pub(super) fn occupancy<T>(
        &self,
        session: &Session,
        function: RmHandle,
        (block_size, dynamic_smem, flags): (i32, u64, u32),
        ask: impl FnOnce(&dyn Backend, u64, &Occupancy) -> CuResult<T>,
    ) -> CuResult<T> {
        self.in_function(session, function, |b, func, c| {
            let q = Occupancy {
                func,
                block_size,
                dynamic_smem,
                flags,
            };
            ask(b, c, &q)
        })
    }

    /// `RM_LAUNCH_KERNEL`: resolved and checked here; made here, or during a burst by the
    /// session's launch thread, behind the launches queued there ([`crate::launcher`]).
    pub(super) fn launch_kernel(&self, call: &CallContext, a: RmLaunchArgs) -> ProcResult<()> {
        use crate::launcher::{LaunchSlot, Route};
        const WHAT: &str = "RM_LAUNCH_KERNEL";
        let on = Some((a.ctx, a.stream));
        let session = self.session(call);
        // The ordered thread (host callbacks) runs the session's calls in order itself.
        let route = if session.ordered.is_on() {
            Route::Here
        } else {
            session.launcher.route(|| {
                Box::new(SessionRunner {
                    backend: Arc::clone(&self.inner.backend),
                    inner: Arc::downgrade(&self.inner),
                    session: Arc::downgrade(&session),
                })
            })
        };
        let target = launch_target(&session.lock(), &a).and_then(|t| {
            let needed = t
                .function
                .layout
                .iter()
                .map(|&(o, s)| u64::from(o) + u64::from(s))
                .max()
                .unwrap_or(0);
            if (a.params.len() as u64) < needed {
                return Err(CuError(cu::INVALID_VALUE));
            }
            t.function.ensure_loaded(&*self.inner.backend)?;
            Ok(t)
        });
        let t = match target {
            Ok(t) => t,
            Err(e) => {
                // After the queued launches, whose errors come first.
                session.launcher.drain();
                self.inner.oneway_failed(&session, WHAT, on, e);
                return oneway_end(&session);
            }
        };
        let profile = self.inner.profiling();
        let queued = route == Route::Queue
            && session.launcher.submit(|slot| {
                slot.ctx = t.ctx;
                slot.function = t.function.raw;
                slot.grid = [a.grid.x, a.grid.y, a.grid.z];
                slot.block = [a.block.x, a.block.y, a.block.z];
                slot.shared_mem_bytes = a.shared_mem_bytes;
                slot.stream = t.stream;
                LaunchSlot::refill(&mut slot.params, &a.params);
                LaunchSlot::refill(&mut slot.layout, &t.function.layout);
                slot.attrs.clone_from(&a.attrs);
                slot.on = (a.ctx, a.stream);
                slot.profile = profile;
            });
        if !queued {
            let timed = profile.then(std::time::Instant::now);
            let r = self
                .inner
                .backend
                .launch(t.ctx, &launch_spec(&a, &t, &a.params, &t.function.layout));
            if let Some(t) = timed {
                session.count_launch(t.elapsed());
            }
            if let Err(e) = r {
                self.inner.oneway_failed(&session, WHAT, on, e);
            }
            session.launcher.ran_here();
        }
        oneway_end(&session)
    }
}

/// Makes a session's queued launches on its launch thread, deferring their errors as
/// [`Executor::launch_kernel`] does for the launches it makes itself. Holds the session and
/// executor weakly: the session owns the thread.
struct SessionRunner {
    backend: Arc<dyn Backend>,
    inner: std::sync::Weak<Inner>,
    session: std::sync::Weak<Session>,
}

impl crate::launcher::Runner for SessionRunner {
    fn run(&self, slot: &crate::launcher::LaunchSlot) {
        let spec = LaunchSpec {
            function: slot.function,
            grid: slot.grid,
            block: slot.block,
            shared_mem_bytes: slot.shared_mem_bytes,
            stream: slot.stream,
            params: &slot.params,
            layout: &slot.layout,
            attrs: &slot.attrs,
        };
        let timed = slot.profile.then(std::time::Instant::now);
        let r = self.backend.launch(slot.ctx, &spec);
        if let Some(t) = timed
            && let Some(session) = self.session.upgrade()
        {
            session.count_launch(t.elapsed());
        }
        if let Err(e) = r
            && let (Some(inner), Some(session)) = (self.inner.upgrade(), self.session.upgrade())
        {
            inner.oneway_failed(&session, "RM_LAUNCH_KERNEL", Some(slot.on), e);
        }
    }
}

/// The raw objects a kernel launch (or its occupancy query) names: its function, the
/// context (`a.ctx`, or the function's when 0) and the stream.
struct LaunchTarget {
    function: FunctionTarget,
    ctx: u64,
    stream: u64,
}

fn launch_target(st: &SessionState, a: &RmLaunchArgs) -> CuResult<LaunchTarget> {
    let function = st.function(a.function)?;
    let ctx = if a.ctx == 0 {
        function.ctx
    } else {
        st.ctx(a.ctx)?
    };
    Ok(LaunchTarget {
        function,
        ctx,
        stream: st.stream(a.stream)?,
    })
}

/// The backend's description of launch `a` of `t` with `params` laid out as `layout`.
fn launch_spec<'a>(
    a: &'a RmLaunchArgs,
    t: &LaunchTarget,
    params: &'a [u8],
    layout: &'a [(u32, u32)],
) -> LaunchSpec<'a> {
    LaunchSpec {
        function: t.function.raw,
        grid: [a.grid.x, a.grid.y, a.grid.z],
        block: [a.block.x, a.block.y, a.block.z],
        shared_mem_bytes: a.shared_mem_bytes,
        stream: t.stream,
        params,
        layout,
        attrs: &a.attrs,
    }
}

impl Inner {
    fn load(&self, st_session: &Session, ctx: u64, image: &[u8]) -> RmLoadReply {
        let raw_ctx = match st_session.lock().ctx(ctx) {
            Ok(c) => c,
            Err(e) => return RmLoadReply::RmLoadFailed(e.0),
        };
        if let Err(e) = st_session.charge(crate::quota::Kind::Modules, 1, "RM_MODULE_LOAD") {
            return RmLoadReply::RmLoadFailed(e.0);
        }
        let loaded = match self.backend.module_load(raw_ctx, image) {
            Ok(m) => {
                if crate::printf_scan::may_print(image)
                    && !st_session.may_print.swap(true, Ordering::Relaxed)
                {
                    tracing::debug!(
                        connection = st_session.connection,
                        "a module of the session may print from the device: synchronizes go to the server"
                    );
                }
                m
            }
            Err(e) => {
                st_session.uncharge(crate::quota::Kind::Modules, 1);
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
        // A client older than revision 13 never asks for a function to be loaded: load them
        // all now, as its functions were before (a first load at a launch could wait for
        // work that waits for the program, see RM_FUNC_LOAD).
        let load_all = !st_session.loads_functions.load(Ordering::Relaxed);
        let mut failed = None;
        let functions = loaded
            .functions
            .into_iter()
            .take(RM_MAX_FUNCTIONS as usize)
            .map(|f| {
                let mut params = f.params;
                params.truncate(RM_MAX_PARAM_COUNT as usize);
                let loaded = load_all
                    && match self.backend.func_load(raw_ctx, f.raw) {
                        Ok(()) => true,
                        Err(e) => {
                            failed.get_or_insert(e);
                            false
                        }
                    };
                let handle = st.insert(Resource::Function {
                    raw: f.raw,
                    ctx,
                    module,
                    params: params.clone().into(),
                    loaded: Arc::new(std::sync::atomic::AtomicBool::new(loaded)),
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
        if let Some(e) = failed {
            // Each failed function is tried again at its first use, which reports the error.
            tracing::warn!(
                result = e.0,
                "loading the functions of a module failed; they are tried again at first use"
            );
        }
        RmLoadReply::RmLoaded(RmModule { module, functions })
    }
}
