//! One client connection's state: its resource table, deferred (sticky) error and pending
//! asynchronous device-to-host copies. Handles on the wire are indices into this table, so a
//! client can only name its own objects.

use remora_proto::cuda::{CuError, CuResult, cu};
use std::collections::{BTreeMap, HashMap};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use remora_proto::remora::{RM_STREAM_LEGACY, RmCopyData};
use remora_xdr::Bytes;

use crate::backend::{Backend, LEGACY_STREAM, StagedCopy};
use crate::host_callbacks::HostCallbacks;
use crate::waiters::WaiterPool;

/// Most threads one session may block in synchronizing calls at once; further blocking calls
/// run on the connection's thread.
pub(crate) const MAX_WAITERS: usize = 32;

/// Most bytes of asynchronous device-to-host copy data one synchronizing reply carries (Remora's
/// client reads reply records of up to 1 GiB; a single copy chunk is at most 32 MiB). Without
/// a bound, a program that queued more than that before synchronizing got a reply its client
/// could not read, and the server built it whole in memory. Completed copies past the budget
/// stay pending and go out in a later reply, which the client asks for (`RM_STREAM_QUERY`)
/// when a synchronize returns without all its copies.
///
/// 32 MiB, one copy chunk: a reply record then fits the records a client's connection keeps
/// for reuse (`remora_oncrpc`'s record reader, 40 MiB), so a large copy's replies land in
/// memory already mapped instead of a fresh buffer per reply (a page fault per page: 64 MiB
/// replies held asynchronous device-to-host copies near 0.3 GB/s over TCP).
pub(crate) const REPLY_COPY_BUDGET: usize = 32 << 20;

/// Delivered copy data of at least this many bytes is sent from the copy's staging buffer
/// ([`crate::backend::staged_bytes`]) instead of a copy of it: one pass over the bytes less,
/// and the staging buffer is kept until the reply is written.
const DELIVERY_SHARE_MIN: usize = 64 << 10;

/// Default of the bound on the bytes one session may hold staged on the server in
/// asynchronous device-to-host copies not yet delivered (`PendingCopies`): a quarter of
/// the host's memory, between 4 GiB and 64 GiB (4 GiB when the size is unknown).
/// `remora serve --max-pending-copy-bytes` sets it.
///
/// A legitimate program may queue one whole large buffer before it synchronizes (NVIDIA's
/// memcpy_sweep of the GPU suite copies 1 GiB at once; PyTorch moves a model's state with
/// `non_blocking=True`): a bound of 1 GiB refused that with CUDA_ERROR_OUT_OF_MEMORY.
pub fn default_max_pending_copy_bytes() -> u64 {
    const MIN: u64 = 4 << 30;
    const MAX: u64 = 64 << 30;
    let info = rustix::system::sysinfo();
    let total = info
        .totalram
        .saturating_mul(u64::from(info.mem_unit).max(1));
    (total / 4).clamp(MIN, MAX)
}

/// What each pending copy counts against the bound beyond its bytes (its record and staging
/// object), so that a flood of empty or failed copies is bounded too.
pub(crate) const PENDING_COPY_OVERHEAD: u64 = 256;

/// Room past the bound for copies delivered empty (refused or failed: the client still waits
/// for each one), 65,536 of them; past it the session is closed.
pub(crate) const EMPTY_COPY_SLACK: u64 = 65_536 * PENDING_COPY_OVERHEAD;

/// A server-side object a session handle names.
#[derive(Debug, Clone)]
pub(crate) enum Resource {
    Context {
        raw: u64,
        device: i32,
        primary: bool,
    },
    Module {
        raw: u64,
        ctx: u64,
    },
    Function {
        raw: u64,
        ctx: u64,
        module: u64,
        params: Arc<[(u32, u32)]>,
        /// Loaded in the driver (see [`FunctionTarget::ensure_loaded`]).
        loaded: Arc<AtomicBool>,
    },
    Stream {
        raw: u64,
        ctx: u64,
    },
    Event {
        raw: u64,
        ctx: u64,
    },
    /// A graph: captured (`capture` `None`), or being captured on backend stream `capture`
    /// (the driver owns it until the capture ends).
    Graph {
        raw: u64,
        ctx: u64,
        capture: Option<u64>,
    },
    /// An executable graph.
    GraphExec {
        raw: u64,
        ctx: u64,
    },
    /// A physical allocation of `cuMemCreate` (`CUmemGenericAllocationHandle`), with the
    /// references the session holds on it (`cuMemCreate` and each `cuMemRetainAllocationHandle`
    /// add one; `cuMemRelease` drops one, and the driver's own count follows). Not bound to a
    /// context.
    MemHandle {
        raw: u64,
        refs: u32,
        /// Bytes charged for it (`cuMemCreate`'s size; 0 for a handle retained from an
        /// allocation the session did not create).
        size: u64,
    },
    /// A memory pool (`session/pools.rs`): one the session created (`created`, destroyed
    /// when the session ends), or a device's default or current pool, named when the session
    /// first asked for it. Pools belong to devices, not contexts.
    MemPool {
        raw: u64,
        created: bool,
    },
    /// A node of graph handle `graph` (`session/graphs.rs`): goes with its graph.
    GraphNode {
        raw: u64,
        graph: u64,
    },
}

/// A stream capture in progress (by the driver's capture id).
#[derive(Debug, Clone, Copy)]
pub(crate) struct Capture {
    /// Handle of the graph being captured.
    pub(crate) graph: u64,
    /// The first error of a one-way call captured into it: ending the capture returns it and
    /// destroys the graph (the call would have invalidated the capture natively).
    pub(crate) error: Option<i32>,
}

/// A device range the session may copy to or from.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Range {
    pub(crate) size: u64,
    pub(crate) ctx: u64,
    pub(crate) kind: RangeKind,
}

/// What made a [`Range`], which decides how it is freed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum RangeKind {
    /// `cuMemAlloc`/`cuMemAllocPitch`: freed with `cuMemFree`.
    Alloc,
    /// A global of module handle `.0`: goes with its module.
    Global(u64),
    /// An address range of `cuMemAddressReserve`: freed with `cuMemAddressFree` at the end
    /// of the session, after its mappings ([`SessionState::mappings`]) are unmapped. Not bound
    /// to a context either.
    Reservation,
    /// `cuMemAllocAsync`/`cuMemAllocFromPoolAsync`: freed with `cuMemFreeAsync` (or
    /// `cuMemFree`); at cleanup after a context synchronize (`session/pools.rs`).
    StreamOrdered,
    /// The address of a graph memory allocation node (revision 12): kept while a graph or
    /// executable graph holds the node or a launch left it allocated
    /// ([`SessionState::graph_mem`], `session/graphs.rs`).
    GraphMem,
}

impl Range {
    /// The module handle, for a global.
    pub(crate) fn module(&self) -> Option<u64> {
        match self.kind {
            RangeKind::Global(m) => Some(m),
            _ => None,
        }
    }
}

mod graphs;
mod pools;

pub(crate) use graphs::GraphMemHold;

/// The data area and the offset in it where a copy's bytes land.
pub(crate) type AreaTarget = (remora_oncrpc::DataArea, u64);

/// An asynchronous device-to-host copy not yet delivered.
pub(crate) struct PendingCopy {
    pub(crate) copy_id: u64,
    pub(crate) ctx: u64,
    /// Session stream handle ([`RM_STREAM_LEGACY`] for the legacy stream).
    pub(crate) stream: u64,
    pub(crate) copy: std::sync::Arc<dyn StagedCopy>,
    /// Where the bytes go instead of the reply: the session's data area at this offset
    /// (`RM_AREA_MEMCPY_DTOH_ASYNC` through a staging buffer, bounds checked when the copy
    /// was issued). `None` for a copy whose bytes the reply carries, and for one the backend
    /// made straight into the area ([`Backend::memcpy_dtoh_async_in_area`]: no bytes of its
    /// own, so its reply entry is empty too).
    ///
    /// [`Backend::memcpy_dtoh_async_in_area`]: crate::backend::Backend::memcpy_dtoh_async_in_area
    pub(crate) area: Option<AreaTarget>,
    /// Set by whoever delivers it: a synchronizing reply or a host function that follows it
    /// (exactly one of them).
    pub(crate) taken: std::sync::atomic::AtomicBool,
}

/// What a pending copy counts against the session's bound (see [`PendingCopies::admit`]).
fn charge(p: &PendingCopy) -> u64 {
    (p.copy.data().len() as u64).saturating_add(PENDING_COPY_OVERHEAD)
}

impl PendingCopy {
    /// Takes the copy for delivery, once: its reply entry (bytes, or, for a copy into the data
    /// area, the bytes written there and an empty entry). `None` when it was taken already.
    /// Calls no driver function (the copy has completed; host functions deliver this way).
    pub(crate) fn deliver(&self, status: &mut i32) -> Option<RmCopyData> {
        if self.taken.swap(true, std::sync::atomic::Ordering::AcqRel) {
            return None;
        }
        self.copy.delivering();
        Some(match &self.area {
            Some((area, offset)) => {
                if area.write(*offset, self.copy.data()).is_err() && *status == cu::SUCCESS {
                    *status = cu::INVALID_VALUE;
                }
                RmCopyData {
                    copy_id: self.copy_id,
                    data: Bytes::new(),
                }
            }
            None => {
                let src = self.copy.data();
                // A large copy's reply is sent from its staging buffer, which goes back to the
                // backend once sent; a small one is copied and its buffer let go at once.
                let data = if src.len() >= DELIVERY_SHARE_MIN {
                    crate::backend::staged_bytes(std::sync::Arc::clone(&self.copy))
                } else {
                    Bytes::copy_from_slice(src)
                };
                RmCopyData {
                    copy_id: self.copy_id,
                    data,
                }
            }
        })
    }

    /// Whether a host function or an earlier reply delivered it.
    fn is_taken(&self) -> bool {
        self.taken.load(std::sync::atomic::Ordering::Acquire)
    }
}

/// Which pending copies a synchronizing call guarantees complete.
#[derive(Debug, Clone, Copy)]
pub(crate) enum Scope {
    /// Only those already finished.
    Finished,
    /// Every copy of this context.
    Context(u64),
    /// Every copy on this stream: `(context handle, stream handle)`; for
    /// [`RM_STREAM_LEGACY`] the copies on that context's legacy stream.
    Stream(u64, u64),
}

/// A session's asynchronous copies not yet delivered, behind a lock of their own: a host
/// callback's client asks for them (`RM_COPIES_COLLECT`) while another call of the session
/// may hold the session's state lock, waiting in the driver for that very callback.
///
/// Host functions never take `list`'s lock (a thread holding it may wait in the driver for
/// them); they hold the copies they deliver themselves and publish the bytes in `ready`,
/// whose lock is never held across a driver call.
///
/// The bytes they hold are bounded (issue 13, finding 2): every copy in the list counts its
/// staged bytes plus [`PENDING_COPY_OVERHEAD`], and so do the bytes in `ready`, until they
/// are delivered. A copy that does not fit is refused before anything is staged
/// ([`PendingCopies::admit`]: `CUDA_ERROR_OUT_OF_MEMORY`, deferred as every one-way call's
/// error) and delivered empty; if even the empty entries outgrow [`EMPTY_COPY_SLACK`], the
/// session is closed ([`PendingCopies::overflowed`]). Waiting for room instead would hang:
/// room is made only by the client's next synchronizing call, which arrives behind this one
/// on the same connection.
pub(crate) struct PendingCopies {
    list: Mutex<Vec<Arc<PendingCopy>>>,
    /// Copies host functions delivered, for the next reply (or `RM_COPIES_READY`).
    ready: Mutex<Vec<RmCopyData>>,
    /// The bound on `staged`.
    max_bytes: u64,
    /// Bytes counted now: the charges of the copies in `list` and the bytes in `ready`.
    staged: std::sync::atomic::AtomicU64,
    /// Set when an empty entry did not fit the slack either: the session must be closed.
    overflowed: std::sync::atomic::AtomicBool,
    /// Whether a refusal was logged at WARN already (later ones log at DEBUG).
    warned: std::sync::atomic::AtomicBool,
    /// For logs.
    connection: u64,
    /// The session's limits ([`crate::quota`]): staged bytes are bytes in flight and, with
    /// the CUDA backend, page-locked host memory of the session and its tenant.
    pub(crate) quota: std::sync::OnceLock<Arc<crate::quota::SessionQuota>>,
}

impl Default for PendingCopies {
    fn default() -> Self {
        Self::new(0, default_max_pending_copy_bytes())
    }
}

impl PendingCopies {
    /// No copies yet, with at most `max_bytes` staged for `connection`'s session.
    pub(crate) fn new(connection: u64, max_bytes: u64) -> Self {
        Self {
            list: Mutex::default(),
            ready: Mutex::default(),
            max_bytes,
            staged: Default::default(),
            overflowed: Default::default(),
            warned: Default::default(),
            connection,
            quota: std::sync::OnceLock::new(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, Vec<Arc<PendingCopy>>> {
        self.list.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Bytes staged and counted against the bound now.
    pub(crate) fn staged_bytes(&self) -> u64 {
        self.staged.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Whether a copy of `bytes` may be staged now: `CUDA_ERROR_OUT_OF_MEMORY` (logged,
    /// naming the limit) when it would take the session past its bound. Called before the
    /// copy is issued, so nothing is staged for a refused one; the caller then delivers it
    /// empty. One-way copies of a session are issued one at a time (its connection or ordered
    /// thread), so the room seen here is still there at [`PendingCopies::push`].
    pub(crate) fn admit(&self, bytes: u64) -> CuResult<()> {
        let staged = self.staged_bytes();
        let need = bytes.saturating_add(PENDING_COPY_OVERHEAD);
        if staged.saturating_add(need) <= self.max_bytes {
            // The limits file's in-flight and pinned-memory limits, of the session and its
            // tenant: checked here, counted at push (one-way copies of a session are issued
            // one at a time; sessions of one tenant may pass its limit by a copy each).
            let Some(q) = self.quota.get() else {
                return Ok(());
            };
            use crate::quota::Kind;
            for kind in [Kind::InFlight, Kind::PinnedMemory] {
                if let Err(hit) = q.try_charge(kind, need) {
                    remora_oncrpc::audit!(
                        debug,
                        limit "tenants",
                        connection = self.connection,
                        tenant = q.tenant(),
                        "asynchronous device-to-host copy refused: {hit}; CUDA_ERROR_OUT_OF_MEMORY at the next synchronizing call"
                    );
                    if !self.warned.swap(true, std::sync::atomic::Ordering::Relaxed) {
                        remora_oncrpc::audit!(
                            warn,
                            limit "tenants",
                            connection = self.connection,
                            tenant = q.tenant(),
                            "asynchronous device-to-host copy refused: {hit}; CUDA_ERROR_OUT_OF_MEMORY at the next synchronizing call (limits: remora serve --tenants / --limit)"
                        );
                    }
                    return Err(CuError(cu::OUT_OF_MEMORY));
                }
                q.uncharge(kind, need);
            }
            return Ok(());
        }
        let first = !self.warned.swap(true, std::sync::atomic::Ordering::Relaxed);
        let line = "asynchronous device-to-host copy refused with CUDA_ERROR_OUT_OF_MEMORY: the session's undelivered copies would pass --max-pending-copy-bytes (the program issues copies without synchronizing; a synchronizing call delivers them and makes room, or raise the limit)";
        // Warned once per session, then at debug level.
        macro_rules! refused {
            ($level:ident) => {
                remora_oncrpc::audit!(
                    $level,
                    limit "max_pending_copy_bytes",
                    connection = self.connection,
                    staged,
                    copy_bytes = bytes,
                    max_bytes = self.max_bytes,
                    "{line}"
                )
            };
        }
        if first {
            refused!(warn);
        } else {
            refused!(debug);
        }
        Err(CuError(cu::OUT_OF_MEMORY))
    }

    /// Whether the session must be closed: even its empty entries (refused or failed copies,
    /// which the client still waits for) outgrew the bound's slack.
    pub(crate) fn overflowed(&self) -> bool {
        self.overflowed.load(std::sync::atomic::Ordering::Acquire)
    }

    fn uncount(&self, bytes: u64) {
        if let Some(q) = self.quota.get() {
            q.uncharge(crate::quota::Kind::InFlight, bytes);
            q.uncharge(crate::quota::Kind::PinnedMemory, bytes);
        }
        // Never below zero: every uncount matches an earlier count.
        let _ = self.staged.fetch_update(
            std::sync::atomic::Ordering::AcqRel,
            std::sync::atomic::Ordering::Acquire,
            |s| Some(s.saturating_sub(bytes)),
        );
    }

    fn uncount_copies<'a>(&self, gone: impl IntoIterator<Item = &'a Arc<PendingCopy>>) {
        self.uncount(gone.into_iter().map(|p| charge(p)).sum());
    }

    fn ready(&self) -> MutexGuard<'_, Vec<RmCopyData>> {
        self.ready.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Adds a copy just issued (admitted by [`PendingCopies::admit`], or empty). An empty
    /// entry that does not fit even the slack past the bound is not added; the session is
    /// marked [`PendingCopies::overflowed`] instead, to be closed.
    pub(crate) fn push(&self, p: PendingCopy) {
        let c = charge(&p);
        let limit = self.max_bytes.saturating_add(EMPTY_COPY_SLACK);
        if self.staged_bytes().saturating_add(c) > limit {
            remora_oncrpc::audit!(
                error,
                limit "max_pending_copy_bytes",
                connection = self.connection,
                max_bytes = self.max_bytes,
                "the session keeps issuing asynchronous device-to-host copies that are refused (past --max-pending-copy-bytes) without ever synchronizing; closing its connection"
            );
            self.overflowed
                .store(true, std::sync::atomic::Ordering::Release);
            return;
        }
        self.staged
            .fetch_add(c, std::sync::atomic::Ordering::AcqRel);
        if let Some(q) = self.quota.get() {
            q.add(crate::quota::Kind::InFlight, c);
            q.add(crate::quota::Kind::PinnedMemory, c);
        }
        self.lock().push(Arc::new(p));
    }

    /// Whether no copy waits to be delivered (pending or ready).
    pub(crate) fn is_empty(&self) -> bool {
        self.lock().is_empty()
            && self
                .ready
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .is_empty()
    }

    /// Whether any of `ids` is still pending.
    pub(crate) fn any_of(&self, ids: &[u64]) -> bool {
        self.lock()
            .iter()
            .any(|p| !p.is_taken() && ids.contains(&p.copy_id))
    }

    /// The pending copies among `ids` (for a host function that follows them).
    pub(crate) fn find(&self, ids: &[u64]) -> Vec<Arc<PendingCopy>> {
        self.lock()
            .iter()
            .filter(|p| ids.contains(&p.copy_id))
            .cloned()
            .collect()
    }

    /// Publishes the copies a host function follows (they have completed): called on the
    /// driver's host-function thread, so it calls no driver function and takes only `ready`.
    pub(crate) fn publish(&self, copies: &[Arc<PendingCopy>]) {
        let mut status = cu::SUCCESS;
        let out: Vec<RmCopyData> = copies
            .iter()
            .filter_map(|p| p.deliver(&mut status))
            .collect();
        if !out.is_empty() {
            let bytes: u64 = out.iter().map(|c| c.data.len() as u64).sum();
            self.staged
                .fetch_add(bytes, std::sync::atomic::Ordering::AcqRel);
            if let Some(q) = self.quota.get() {
                q.add(crate::quota::Kind::InFlight, bytes);
                q.add(crate::quota::Kind::PinnedMemory, bytes);
            }
            self.ready().extend(out);
        }
    }

    /// The copies host functions published (`RM_COPIES_READY`): no driver call, no lock but
    /// `ready`'s.
    pub(crate) fn take_ready(&self) -> Vec<RmCopyData> {
        let out = std::mem::take(&mut *self.ready());
        self.uncount(out.iter().map(|c| c.data.len() as u64).sum());
        out
    }

    /// Waits for the copies of context handle `ctx` and drops them (the context goes).
    fn drop_ctx(&self, ctx: u64) {
        let gone: Vec<Arc<PendingCopy>> = {
            let mut list = self.lock();
            let (gone, keep) = std::mem::take(&mut *list)
                .into_iter()
                .partition(|p| p.ctx == ctx);
            *list = keep;
            gone
        };
        self.uncount_copies(&gone);
        for p in gone {
            let _ = p.copy.wait();
        }
    }

    /// Waits for every copy and drops it (the session ends).
    fn drop_all(&self) {
        let gone = std::mem::take(&mut *self.lock());
        self.uncount_copies(&gone);
        let ready = std::mem::take(&mut *self.ready());
        self.uncount(ready.iter().map(|c| c.data.len() as u64).sum());
        for p in gone {
            let _ = p.copy.wait();
        }
    }

    /// Takes the pending copies complete at this point (all of `scope`'s, which the caller has
    /// synchronized, and any other that has finished). A failed copy sets `status`.
    pub(crate) fn collect(&self, scope: Scope, status: &mut i32) -> Vec<RmCopyData> {
        // Phase 1: which copies have completed. This calls the driver, which may block (a
        // device-synchronizing call elsewhere may hold the driver's locks while it waits for a
        // host function), so nothing is held and nothing is taken meanwhile: a host function
        // can still publish any of these copies for its callback.
        let snapshot: Vec<Arc<PendingCopy>> = self
            .lock()
            .iter()
            .filter(|p| !p.is_taken())
            .cloned()
            .collect();
        let mut done = Vec::new();
        for p in snapshot {
            let covered = match scope {
                Scope::Finished => false,
                Scope::Context(ctx) => p.ctx == ctx,
                Scope::Stream(ctx, s) => {
                    p.stream == s && (s != u64::from(RM_STREAM_LEGACY) || p.ctx == ctx)
                }
            };
            let r = if covered {
                p.copy.wait().map(|()| true)
            } else {
                p.copy.query()
            };
            match r {
                Ok(true) => done.push((p, None)),
                Ok(false) => {}
                Err(e) => done.push((p, Some(e))),
            }
        }
        // Phase 2: take them, without a driver call, after what host functions published.
        // Past REPLY_COPY_BUDGET bytes of copy data, completed copies wait for a later reply
        // (the client asks for them), so that no reply outgrows what a client reads in one
        // record.
        let mut out = Vec::new();
        let mut carried = 0usize;
        {
            let mut ready = self.ready();
            let mut rest = Vec::new();
            for c in ready.drain(..) {
                if carried > 0 && carried + c.data.len() > REPLY_COPY_BUDGET {
                    rest.push(c);
                } else {
                    carried += c.data.len();
                    out.push(c);
                }
            }
            *ready = rest;
        }
        self.uncount(carried as u64);
        for (p, err) in done {
            if let Some(e) = err {
                if *status == cu::SUCCESS {
                    *status = e.0;
                }
                // Delivered empty: the client must not wait for data that will not come.
                if !p.taken.swap(true, std::sync::atomic::Ordering::AcqRel) {
                    out.push(RmCopyData {
                        copy_id: p.copy_id,
                        data: Bytes::new(),
                    });
                }
                continue;
            }
            if p.area.is_none() && carried > 0 && carried + p.copy.data().len() > REPLY_COPY_BUDGET
            {
                continue;
            }
            if let Some(c) = p.deliver(status) {
                carried += c.data.len();
                out.push(c);
            }
        }
        // Forget what is delivered (by this reply, another, or a host function).
        let gone: Vec<Arc<PendingCopy>> = {
            let mut list = self.lock();
            let (gone, keep) = std::mem::take(&mut *list)
                .into_iter()
                .partition(|p| p.is_taken());
            *list = keep;
            gone
        };
        self.uncount_copies(&gone);
        out
    }
}

/// A function handle resolved: the backend function, its context and parameter layout.
pub(crate) struct FunctionTarget {
    pub(crate) raw: u64,
    /// The backend context of the function's module.
    pub(crate) ctx: u64,
    pub(crate) layout: Arc<[(u32, u32)]>,
    loaded: Arc<AtomicBool>,
}

impl FunctionTarget {
    /// Loads the function in the driver before its first use. A module load enumerates its
    /// functions without loading them (the driver's lazy loading, CUDA's default: loading
    /// every function of every module cost PyTorch ~0.5 s at start-up), and an enumerated
    /// function must be loaded (`cuFuncLoad`) before a launch, attribute or occupancy query
    /// or graph node uses it. Two threads may both load it the first time: harmless.
    pub(crate) fn ensure_loaded(&self, backend: &dyn crate::Backend) -> CuResult<()> {
        if !self.loaded.load(Ordering::Acquire) {
            backend.func_load(self.ctx, self.raw)?;
            self.loaded.store(true, Ordering::Release);
        }
        Ok(())
    }
}

/// What freeing a session's resources is made of, for the end-of-session line
/// (`remora::startup`, debug): a short program's run under `remora run` ends when its session's
/// resources are freed, and some programs' frees took 63-80 ms on an H200 where vecadd's took
/// 0.1-0.25 ms (sessions 30-34's timelines).
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub(crate) enum FreePart {
    /// The session's threads stopped (launch thread, host functions, ordered, waiters).
    Threads,
    /// Stream-ordered allocations (`cuMemFreeAsync` left undone), their synchronize included.
    StreamOrdered,
    /// Memory pools the session created.
    Pools,
    /// `cuMemMap` mappings, physical allocations and reserved ranges.
    VirtualMemory,
    /// Executable graphs and graphs.
    Graphs,
    /// Events.
    Events,
    /// Streams.
    Streams,
    /// Modules.
    Modules,
    /// `cuMemAlloc` allocations.
    Allocations,
    /// The contexts themselves (the backend's `ctx_destroy`).
    Contexts,
}

impl FreePart {
    const ALL: [FreePart; 10] = [
        FreePart::Threads,
        FreePart::StreamOrdered,
        FreePart::Pools,
        FreePart::VirtualMemory,
        FreePart::Graphs,
        FreePart::Events,
        FreePart::Streams,
        FreePart::Modules,
        FreePart::Allocations,
        FreePart::Contexts,
    ];

    fn name(self) -> &'static str {
        match self {
            FreePart::Threads => "threads",
            FreePart::StreamOrdered => "stream-ordered",
            FreePart::Pools => "pools",
            FreePart::VirtualMemory => "virtual memory",
            FreePart::Graphs => "graphs",
            FreePart::Events => "events",
            FreePart::Streams => "streams",
            FreePart::Modules => "modules",
            FreePart::Allocations => "allocations",
            FreePart::Contexts => "contexts",
        }
    }
}

/// Time and count per [`FreePart`] of one session's end.
#[derive(Debug, Default, Clone)]
pub(crate) struct FreeTimes {
    parts: [(u32, std::time::Duration); FreePart::ALL.len()],
}

impl FreeTimes {
    /// Counts `n` objects of `part` that took `took` to free.
    pub(crate) fn add(&mut self, part: FreePart, n: u32, took: std::time::Duration) {
        let slot = &mut self.parts[part as usize];
        slot.0 = slot.0.saturating_add(n);
        slot.1 += took;
    }

    /// "contexts 1 in 40.0 ms, modules 2 in 31.2 ms, threads in 0.1 ms": the parts that
    /// freed something or took 10 µs or more, slowest first.
    pub(crate) fn summary(&self) -> String {
        let mut parts: Vec<(FreePart, u32, std::time::Duration)> = FreePart::ALL
            .iter()
            .map(|&p| (p, self.parts[p as usize].0, self.parts[p as usize].1))
            .filter(|&(_, n, took)| n > 0 || took >= std::time::Duration::from_micros(10))
            .collect();
        parts.sort_by(|a, b| b.2.cmp(&a.2).then(a.0.cmp(&b.0)));
        if parts.is_empty() {
            return "nothing".to_owned();
        }
        parts
            .iter()
            .map(|(p, n, took)| {
                let ms = took.as_secs_f64() * 1e3;
                match n {
                    0 => format!("{} in {ms:.1} ms", p.name()),
                    n => format!("{} {n} in {ms:.1} ms", p.name()),
                }
            })
            .collect::<Vec<_>>()
            .join(", ")
    }
}

/// The resource table of a session.
#[derive(Default)]
pub(crate) struct SessionState {
    next: u64,
    /// By handle: server-assigned integers, so a fast non-keyed hash is safe (a client
    /// chooses no key here), and every call looks up a few.
    table: rustc_hash::FxHashMap<u64, Resource>,
    pub(crate) ranges: BTreeMap<u64, Range>,
    /// Device → (context handle, this session's retain count) of the session's own context
    /// that stands for the device's primary context.
    pub(crate) primary: HashMap<i32, (u64, u32)>,
    /// Device → flags from RM_PRIMARY_CTX_SET_FLAGS, applied when that context is created.
    pub(crate) primary_flags: HashMap<i32, u32>,
    deferred: Option<i32>,
    /// The sticky part of `deferred`, readable without the session lock (by the host
    /// functions the driver runs: a call holding the lock may be waiting for them).
    sticky: Arc<std::sync::atomic::AtomicI32>,
    /// The asynchronous copies not yet delivered (shared with [`Session::copies`], which
    /// reaches them without this state's lock).
    pub(crate) copies: Arc<PendingCopies>,
    /// Handles of primary contexts destroyed by RM_PRIMARY_CTX_RESET: using one answers
    /// CUDA_ERROR_CONTEXT_IS_DESTROYED, as NVIDIA's driver does for a reset primary context.
    pub(crate) reset_primaries: std::collections::HashSet<u64>,
    /// Stream captures in progress, by capture id.
    pub(crate) captures: HashMap<u64, Capture>,
    /// `cuMemMap` mappings inside the session's reservations: base → size.
    pub(crate) mappings: BTreeMap<u64, u64>,
    /// The functions of graph host nodes, alive while any graph may run them
    /// (`session/graphs.rs`).
    pub(crate) host_nodes: Vec<Arc<crate::backend::graphs::HostNode>>,
    /// Graph memory allocations by address: who holds them (`session/graphs.rs`).
    pub(crate) graph_mem: HashMap<u64, GraphMemHold>,
    /// The session's place in the limits ledger ([`crate::quota`]): objects and memory are
    /// charged to it when made and taken back when they go.
    pub(crate) quota: Option<Arc<crate::quota::SessionQuota>>,
    /// Where the frees of this session's resources went (see [`FreeTimes`]); reset when
    /// the session ends, so that its line counts the end's frees alone.
    pub(crate) free_times: FreeTimes,
}

impl SessionState {
    /// The raw streams the session created in context handle `ctx`.
    pub(crate) fn streams_in(&self, ctx: u64) -> Vec<u64> {
        self.table
            .values()
            .filter_map(|r| match r {
                Resource::Stream { raw, ctx: c } if *c == ctx => Some(*raw),
                _ => None,
            })
            .collect()
    }

    pub(crate) fn insert(&mut self, r: Resource) -> u64 {
        // 0 is "none"; 1 and 2 are the special stream handles.
        self.next = self.next.max(15) + 1;
        self.table.insert(self.next, r);
        self.next
    }

    pub(crate) fn get(&self, h: u64) -> CuResult<&Resource> {
        self.table.get(&h).ok_or(CuError(cu::INVALID_HANDLE))
    }

    pub(crate) fn get_mut(&mut self, h: u64) -> CuResult<&mut Resource> {
        self.table.get_mut(&h).ok_or(CuError(cu::INVALID_HANDLE))
    }

    pub(crate) fn remove(&mut self, h: u64) -> Option<Resource> {
        let r = self.table.remove(&h)?;
        if let Some(q) = &self.quota {
            use crate::quota::Kind;
            match &r {
                Resource::Stream { .. } => q.uncharge(Kind::Streams, 1),
                Resource::Event { .. } => q.uncharge(Kind::Events, 1),
                Resource::Module { .. } => q.uncharge(Kind::Modules, 1),
                Resource::MemHandle { size, .. } => q.uncharge(Kind::DeviceMemory, *size),
                _ => {}
            }
        }
        Some(r)
    }

    /// Range `ptr` is gone: its device memory is no longer charged.
    pub(crate) fn remove_range(&mut self, ptr: u64) -> Option<Range> {
        let r = self.ranges.remove(&ptr)?;
        if let Some(q) = &self.quota
            && matches!(r.kind, RangeKind::Alloc | RangeKind::StreamOrdered)
        {
            q.uncharge(crate::quota::Kind::DeviceMemory, r.size);
        }
        Some(r)
    }

    /// The handle standing for physical allocation `raw` with one more reference: the
    /// session's existing handle of it, or a new one.
    pub(crate) fn retain_mem_handle(&mut self, raw: u64) -> u64 {
        for (h, r) in &mut self.table {
            if let Resource::MemHandle { raw: x, refs, .. } = r
                && *x == raw
            {
                *refs += 1;
                return *h;
            }
        }
        self.insert(Resource::MemHandle {
            raw,
            refs: 1,
            size: 0,
        })
    }

    /// Removes the functions of module handle `module`.
    pub(crate) fn remove_module_children(&mut self, module: u64) {
        self.table
            .retain(|_, r| !matches!(r, Resource::Function { module: m, .. } if *m == module));
    }

    pub(crate) fn len(&self) -> usize {
        self.table.len()
    }

    /// The backend context of context handle `h`.
    pub(crate) fn ctx(&self, h: u64) -> CuResult<u64> {
        if self.reset_primaries.contains(&h) {
            return Err(CuError(cu::CONTEXT_IS_DESTROYED));
        }
        match self.get(h)? {
            Resource::Context { raw, .. } => Ok(*raw),
            _ => Err(CuError(cu::INVALID_HANDLE)),
        }
    }

    /// The backend stream of stream handle `h` (0 and RM_STREAM_LEGACY: the legacy stream).
    pub(crate) fn stream(&self, h: u64) -> CuResult<u64> {
        if h == 0 || h == u64::from(RM_STREAM_LEGACY) {
            return Ok(LEGACY_STREAM);
        }
        match self.get(h)? {
            Resource::Stream { raw, .. } => Ok(*raw),
            _ => Err(CuError(cu::INVALID_HANDLE)),
        }
    }

    /// `(backend event, backend context)` of event handle `h`.
    pub(crate) fn event(&self, h: u64) -> CuResult<(u64, u64)> {
        match self.get(h)? {
            Resource::Event { raw, ctx } => Ok((*raw, self.ctx(*ctx)?)),
            _ => Err(CuError(cu::INVALID_HANDLE)),
        }
    }

    /// Function handle `h` resolved.
    pub(crate) fn function(&self, h: u64) -> CuResult<FunctionTarget> {
        match self.get(h)? {
            Resource::Function {
                raw,
                ctx,
                params,
                loaded,
                ..
            } => Ok(FunctionTarget {
                raw: *raw,
                ctx: self.ctx(*ctx)?,
                layout: Arc::clone(params),
                loaded: Arc::clone(loaded),
            }),
            _ => Err(CuError(cu::INVALID_HANDLE)),
        }
    }

    /// The bases of the session's ranges of `kind` in context handle `ctx`.
    pub(crate) fn ranges_of(&self, ctx: u64, kind: RangeKind) -> Vec<u64> {
        self.ranges
            .iter()
            .filter(|(_, r)| r.ctx == ctx && r.kind == kind)
            .map(|(p, _)| *p)
            .collect()
    }

    /// Checks that `[ptr, ptr + len)` lies inside one of the session's ranges.
    pub(crate) fn check_range(&self, ptr: u64, len: u64) -> CuResult<()> {
        let (base, r) = self
            .ranges
            .range(..=ptr)
            .next_back()
            .ok_or(CuError(cu::INVALID_VALUE))?;
        let end = ptr.checked_add(len).ok_or(CuError(cu::INVALID_VALUE))?;
        if end > base + r.size {
            return Err(CuError(cu::INVALID_VALUE));
        }
        Ok(())
    }

    /// The range holding `ptr`.
    pub(crate) fn range_of(&self, ptr: u64) -> CuResult<(u64, Range)> {
        match self.ranges.range(..=ptr).next_back() {
            Some((base, r)) if ptr < base + r.size.max(1) => Ok((*base, *r)),
            _ => Err(CuError(cu::NOT_FOUND)),
        }
    }

    /// Keeps the error of a one-way call for the next synchronizing call (the first wins).
    pub(crate) fn defer_error(&mut self, code: i32) {
        if self.deferred.is_none() && code != cu::SUCCESS {
            self.deferred = Some(code);
            if CuError(code).is_sticky() {
                self.sticky
                    .store(code, std::sync::atomic::Ordering::Release);
            }
        }
    }

    /// The session's sticky error as a shared cell (0 when none), for code that must not take
    /// the session lock.
    pub(crate) fn sticky_cell(&self) -> Arc<std::sync::atomic::AtomicI32> {
        Arc::clone(&self.sticky)
    }

    /// Forgets a sticky deferred error when a context of the session is destroyed or reset:
    /// it belonged to a context that no longer exists (CUDA keeps a sticky error in the
    /// faulting context; the driver goes on answering it for any other one still alive).
    pub(crate) fn clear_sticky(&mut self) {
        if self.deferred.is_some_and(|c| CuError(c).is_sticky()) {
            self.deferred = None;
        }
        self.sticky
            .store(cu::SUCCESS, std::sync::atomic::Ordering::Release);
    }

    /// Whether an error waits for the next synchronizing call.
    pub(crate) fn has_deferred(&self) -> bool {
        self.deferred.is_some()
    }

    /// The status a synchronizing call returns: a deferred error if there is one (kept when
    /// CUDA keeps it sticky), else the call's own result.
    pub(crate) fn sync_status(&mut self, own: CuResult<()>) -> i32 {
        match self.deferred {
            Some(e) => {
                if !CuError(e).is_sticky() {
                    self.deferred = None;
                }
                e
            }
            None => own.err().map_or(cu::SUCCESS, crate::executor::nz),
        }
    }

    /// Takes the pending copies complete at this point ([`PendingCopies::collect`]).
    pub(crate) fn collect(&mut self, scope: Scope, status: &mut i32) -> Vec<RmCopyData> {
        self.copies.collect(scope, status)
    }

    /// Frees everything that lives in context handle `ctx` (before the context goes).
    pub(crate) fn drop_ctx_resources(&mut self, backend: &dyn Backend, ctx: u64) {
        let Ok(raw_ctx) = self.ctx(ctx) else {
            return;
        };
        self.copies.drop_ctx(ctx);
        let mut handles: Vec<(u64, Resource)> = self
            .table
            .iter()
            .filter(|(_, r)| match r {
                Resource::Module { ctx: c, .. }
                | Resource::Function { ctx: c, .. }
                | Resource::Stream { ctx: c, .. }
                | Resource::Event { ctx: c, .. }
                | Resource::Graph { ctx: c, .. }
                | Resource::GraphExec { ctx: c, .. } => *c == ctx,
                Resource::Context { .. }
                | Resource::MemHandle { .. }
                | Resource::MemPool { .. }
                | Resource::GraphNode { .. } => false,
            })
            .map(|(h, r)| (*h, r.clone()))
            .collect();
        // Executable graphs, graphs, events, streams, functions, modules.
        handles.sort_by_key(|(h, r)| {
            let rank = match r {
                Resource::GraphExec { .. } => 0,
                Resource::Graph { .. } => 1,
                Resource::Event { .. } => 2,
                Resource::Stream { .. } => 3,
                Resource::Function { .. } => 4,
                _ => 5,
            };
            (rank, *h)
        });
        for (h, r) in handles {
            self.remove(h);
            let t0 = std::time::Instant::now();
            // Functions free nothing of their own: not counted.
            let (part, rc) = match r {
                Resource::Event { raw, .. } => {
                    (Some(FreePart::Events), backend.event_destroy(raw_ctx, raw))
                }
                Resource::Stream { raw, .. } => (
                    Some(FreePart::Streams),
                    backend.stream_destroy(raw_ctx, raw),
                ),
                Resource::GraphExec { raw, .. } => (
                    Some(FreePart::Graphs),
                    backend.graph_exec_destroy(raw_ctx, raw),
                ),
                Resource::Graph { raw, capture, .. } => (
                    Some(FreePart::Graphs),
                    match capture {
                        None => backend.graph_destroy(raw_ctx, raw),
                        // Still capturing: end the capture, then free what it made.
                        Some(stream) => backend
                            .stream_end_capture(raw_ctx, stream)
                            .and_then(|g| backend.graph_destroy(raw_ctx, g)),
                    },
                ),
                Resource::Module { raw, .. } => {
                    self.ranges.retain(|_, g| g.module() != Some(h));
                    (Some(FreePart::Modules), backend.module_unload(raw_ctx, raw))
                }
                _ => (None, Ok(())),
            };
            if let Some(part) = part {
                self.free_times.add(part, 1, t0.elapsed());
            }
            if let Err(e) = rc {
                tracing::debug!(handle = h, error = e.0, "cleanup: the driver refused");
            }
        }
        self.forget_orphan_nodes();
        self.forget_graph_mem_of(ctx);
        let t0 = std::time::Instant::now();
        let n = self.free_stream_ordered(backend, ctx, raw_ctx);
        self.free_times
            .add(FreePart::StreamOrdered, n, t0.elapsed());
        for ptr in self.ranges_of(ctx, RangeKind::Alloc) {
            self.remove_range(ptr);
            let t0 = std::time::Instant::now();
            let rc = backend.mem_free(raw_ctx, ptr);
            self.free_times.add(FreePart::Allocations, 1, t0.elapsed());
            if let Err(e) = rc {
                tracing::debug!(ptr, error = e.0, "cleanup: cuMemFree refused");
            }
        }
    }

    /// Unmaps the session's `cuMemMap` mappings, drops its references on physical
    /// allocations and frees its reserved ranges, in that order (while its contexts live: a
    /// live one is made current for the calls, though they need none). Answers how many
    /// mappings, allocations and ranges it let go of.
    pub(crate) fn release_virtual_memory(&mut self, backend: &dyn Backend) -> u32 {
        let mut n = 0u32;
        let ctx = self
            .table
            .values()
            .find_map(|r| match r {
                Resource::Context { raw, .. } => Some(*raw),
                _ => None,
            })
            .unwrap_or(0);
        for (ptr, size) in std::mem::take(&mut self.mappings) {
            n = n.saturating_add(1);
            if let Err(e) = backend.mem_unmap(ctx, ptr, size) {
                tracing::debug!(ptr, error = e.0, "cleanup: cuMemUnmap refused");
            }
        }
        let handles: Vec<(u64, u64, u32)> = self
            .table
            .iter()
            .filter_map(|(h, r)| match r {
                Resource::MemHandle { raw, refs, .. } => Some((*h, *raw, *refs)),
                _ => None,
            })
            .collect();
        for (h, raw, refs) in handles {
            n = n.saturating_add(1);
            self.remove(h);
            for _ in 0..refs {
                if let Err(e) = backend.mem_release(ctx, raw) {
                    tracing::debug!(handle = h, error = e.0, "cleanup: cuMemRelease refused");
                }
            }
        }
        let reserved: Vec<(u64, u64)> = self
            .ranges
            .iter()
            .filter(|(_, r)| r.kind == RangeKind::Reservation)
            .map(|(p, r)| (*p, r.size))
            .collect();
        for (ptr, size) in reserved {
            n = n.saturating_add(1);
            self.ranges.remove(&ptr);
            if let Err(e) = backend.mem_address_free(ctx, ptr, size) {
                tracing::debug!(ptr, error = e.0, "cleanup: cuMemAddressFree refused");
            }
        }
        n
    }

    /// Frees everything the session owns.
    pub(crate) fn release_all(&mut self, backend: &dyn Backend) {
        self.copies.drop_all();
        // Stream-ordered allocations, then the pools they came from, while contexts live.
        self.release_pools(backend);
        let t0 = std::time::Instant::now();
        let n = self.release_virtual_memory(backend);
        self.free_times
            .add(FreePart::VirtualMemory, n, t0.elapsed());
        let mut contexts: Vec<(u64, i32, bool, u64)> = self
            .table
            .iter()
            .filter_map(|(h, r)| match r {
                Resource::Context {
                    raw,
                    device,
                    primary,
                } => Some((*h, *device, *primary, *raw)),
                _ => None,
            })
            .collect();
        contexts.sort();
        for (h, device, primary, raw) in contexts {
            self.drop_ctx_resources(backend, h);
            self.remove(h);
            if primary {
                self.primary.remove(&device);
            }
            // The session's primary context is a context of its own too (see
            // Executor::rm_primary_ctx_retain): both are destroyed.
            let t0 = std::time::Instant::now();
            let rc = backend.ctx_destroy(raw);
            self.free_times.add(FreePart::Contexts, 1, t0.elapsed());
            if let Err(e) = rc {
                tracing::debug!(
                    handle = h,
                    error = e.0,
                    "cleanup: releasing a context failed"
                );
            }
        }
        self.table.clear();
        self.captures.clear();
        self.ranges.clear();
        self.mappings.clear();
        self.primary.clear();
        self.primary_flags.clear();
    }
}

/// Bounds of a session's ordered queue: bytes of queued calls, queued calls, and how long a
/// call may wait for room before the connection is closed.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OrderedLimits {
    /// Bytes of call arguments queued (each call also counts [`ORDERED_CALL_OVERHEAD`]).
    pub max_bytes: usize,
    /// Calls queued.
    pub max_calls: usize,
    /// How long the connection thread waits for room before giving up on the session.
    pub full_wait: std::time::Duration,
}

/// What a queued call counts beyond its argument bytes (the job and its context).
pub const ORDERED_CALL_OVERHEAD: usize = 256;

impl Default for OrderedLimits {
    /// 256 MiB and 65,536 calls (a kernel launch queue natively holds about a thousand
    /// launches per stream before `cuLaunchKernel` blocks), 30 s.
    fn default() -> Self {
        OrderedLimits {
            max_bytes: 256 << 20,
            max_calls: 1 << 16,
            full_wait: std::time::Duration::from_secs(30),
        }
    }
}

static ORDERED_LIMITS: Mutex<Option<OrderedLimits>> = Mutex::new(None);

/// Sets the bounds of the ordered queues of sessions created from now on (the default is
/// [`OrderedLimits::default`]); tests use small ones.
pub fn set_ordered_limits(limits: OrderedLimits) {
    *ORDERED_LIMITS
        .lock()
        .unwrap_or_else(PoisonError::into_inner) = Some(limits);
}

fn ordered_limits() -> OrderedLimits {
    ORDERED_LIMITS
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .unwrap_or_default()
}

/// Why [`Ordered::submit`] did not queue a call.
pub(crate) enum Refused {
    /// The ordered thread has stopped (the session is closing): the job comes back.
    Stopped(crate::waiters::Job),
    /// The queue stayed full for [`OrderedLimits::full_wait`]: `(bytes, calls)` queued.
    Full(usize, usize),
}

#[derive(Default)]
struct OrderedQueue {
    jobs: std::collections::VecDeque<(crate::waiters::Job, usize)>,
    bytes: usize,
    started: bool,
    closed: bool,
}

/// The session's ordered thread: once the session has used a host callback, its calls run
/// here, in the order they arrived, instead of on the connection thread, so that the
/// connection thread stays free to read `RM_HOST_CALLBACK_DONE` while a call waits for a
/// stream blocked by a host callback (see [`crate::host_callbacks`]).
///
/// The queue is bounded ([`OrderedLimits`]): a connection thread whose call does not fit
/// waits for room, as a native launch waits when the device's queue is full, but only for
/// `full_wait`; then the call is refused and the connection closed (a one-way call can be
/// neither run out of order nor dropped silently). Without the bound one client could make
/// the server queue calls until it ran out of memory.
pub(crate) struct Ordered {
    queue: Arc<(Mutex<OrderedQueue>, std::sync::Condvar)>,
    thread: Mutex<Option<std::thread::JoinHandle<()>>>,
    on: std::sync::atomic::AtomicBool,
    limits: OrderedLimits,
}

impl Default for Ordered {
    fn default() -> Self {
        Ordered {
            queue: Arc::default(),
            thread: Mutex::default(),
            on: std::sync::atomic::AtomicBool::new(false),
            limits: ordered_limits(),
        }
    }
}

impl Ordered {
    fn lock(&self) -> MutexGuard<'_, OrderedQueue> {
        self.queue.0.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether calls go to the ordered thread.
    pub(crate) fn is_on(&self) -> bool {
        self.on.load(std::sync::atomic::Ordering::Acquire)
    }

    /// Starts the ordered thread (once); later calls go through [`Ordered::submit`].
    pub(crate) fn start(&self, connection: u64) -> CuResult<()> {
        let mut q = self.lock();
        if q.started || q.closed {
            return Ok(());
        }
        let queue = Arc::clone(&self.queue);
        let handle = std::thread::Builder::new()
            .name(format!("remora-ordered-{connection}"))
            .spawn(move || {
                let (m, cv) = &*queue;
                loop {
                    let (job, size) = {
                        let mut q = m.lock().unwrap_or_else(PoisonError::into_inner);
                        loop {
                            if let Some(j) = q.jobs.pop_front() {
                                break j;
                            }
                            if q.closed {
                                return;
                            }
                            q = cv.wait(q).unwrap_or_else(PoisonError::into_inner);
                        }
                    };
                    if std::panic::catch_unwind(std::panic::AssertUnwindSafe(job)).is_err() {
                        tracing::error!("a call panicked on the session's ordered thread");
                    }
                    m.lock().unwrap_or_else(PoisonError::into_inner).bytes -= size;
                    cv.notify_all();
                }
            })
            .map_err(|e| {
                tracing::warn!(error = %e, "cannot start a session's ordered thread");
                CuError(cu::OUT_OF_MEMORY)
            })?;
        q.started = true;
        drop(q);
        *self.thread.lock().unwrap_or_else(PoisonError::into_inner) = Some(handle);
        // Release: a connection thread that sees `on` finds the thread started.
        self.on.store(true, std::sync::atomic::Ordering::Release);
        Ok(())
    }

    /// Queues `job`, whose arguments take `arg_bytes`, behind the calls already queued,
    /// waiting up to `full_wait` for room. A call always fits an empty queue, so one large
    /// record is never refused for its size alone.
    pub(crate) fn submit(&self, job: crate::waiters::Job, arg_bytes: usize) -> Result<(), Refused> {
        let size = arg_bytes.saturating_add(ORDERED_CALL_OVERHEAD);
        let deadline = std::time::Instant::now() + self.limits.full_wait;
        let mut q = self.lock();
        loop {
            if !q.started || q.closed {
                return Err(Refused::Stopped(job));
            }
            let full = q.bytes.saturating_add(size) > self.limits.max_bytes
                || q.jobs.len() >= self.limits.max_calls;
            if !full || q.jobs.is_empty() {
                break;
            }
            let left = deadline.saturating_duration_since(std::time::Instant::now());
            if left.is_zero() {
                return Err(Refused::Full(q.bytes, q.jobs.len()));
            }
            q = self
                .queue
                .1
                .wait_timeout(q, left)
                .unwrap_or_else(PoisonError::into_inner)
                .0;
        }
        q.bytes += size;
        q.jobs.push_back((job, size));
        drop(q);
        self.queue.1.notify_all();
        Ok(())
    }

    /// Runs the queued calls, then stops the thread.
    fn close(&self) {
        self.lock().closed = true;
        self.queue.1.notify_all();
        let handle = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(h) = handle {
            crate::waiters::join_unless_current(h);
        }
    }
}

/// A client connection's session.
pub(crate) struct Session {
    pub(crate) connection: u64,
    /// The tenant the connection authenticated as (`remora serve --auth-token-file`), for
    /// log lines (and, later, quotas).
    pub(crate) tenant: std::sync::OnceLock<String>,
    state: Mutex<SessionState>,
    /// The asynchronous copies not yet delivered (also reachable from the state).
    pub(crate) copies: Arc<PendingCopies>,
    pub(crate) waiters: WaiterPool,
    /// How the session's synchronizes waited (`REMORA_WAIT_TRACE`, [`crate::sync_trace`]).
    pub(crate) sync_trace: crate::sync_trace::SyncTrace,
    /// Host callbacks reached by their streams and waiting for the client.
    pub(crate) callbacks: Arc<HostCallbacks>,
    /// Where calls run once the session uses host callbacks.
    pub(crate) ordered: Ordered,
    /// The thread making the session's kernel launches during bursts ([`crate::launcher`]).
    pub(crate) launcher: crate::launcher::Launcher,
    /// Profiling: kernel launches and their total time in the driver, in nanoseconds.
    launches: std::sync::atomic::AtomicU64,
    launch_ns: std::sync::atomic::AtomicU64,
    /// Profiling: synchronous copies through the record path (the bytes in the calls), their
    /// bytes and their total time in the driver, in nanoseconds.
    bulk_copies: std::sync::atomic::AtomicU64,
    bulk_bytes: std::sync::atomic::AtomicU64,
    bulk_ns: std::sync::atomic::AtomicU64,
    /// The session's shared data area once it is in shared memory: kept mapped until the
    /// session is closed, so that a backend can undo what it did to the area
    /// ([`crate::Backend::area_detach`]) before the mapping goes away.
    pub(crate) area: std::sync::OnceLock<remora_oncrpc::DataArea>,
    /// Whether the backend was told of the area ([`crate::Backend::area_attach`]: page-locked
    /// for DMA); false when the server's locked-memory budget had no room for it.
    pub(crate) area_locked: std::sync::atomic::AtomicBool,
    /// The client asks for its functions to be loaded (`RM_FUNC_LOAD`, revision 13); until
    /// a HELLO says so, a module load loads every function of the module.
    pub(crate) loads_functions: std::sync::atomic::AtomicBool,
    /// A module of the session may call device-side printf (`printf_scan`), whose output the
    /// driver writes only inside a synchronizing call: completion words are refused.
    pub(crate) may_print: std::sync::atomic::AtomicBool,
    /// Buffers of synchronous device-to-host copies over sockets, reused once their reply
    /// has been written (fresh ones cost a page fault per page: `remora_oncrpc::recycle`).
    pub(crate) bulk_buffers: Mutex<remora_oncrpc::recycle::Recycler>,
    /// The session's limits and place in the ledger ([`crate::quota`]), or why it has none:
    /// its tenant had all the sessions it may have (HELLO is refused, and so is every charge).
    pub(crate) quota: std::sync::OnceLock<Result<Arc<crate::quota::SessionQuota>, String>>,
    /// A refused session's charges have been logged once.
    refusal_logged: std::sync::atomic::AtomicBool,
}

/// Buffers a session keeps for reuse ([`Session::bulk_buffers`]): a pipelined copy has a
/// few chunks in flight (the client's window) plus one being written.
const BULK_BUFFERS: usize = 6;
/// Connections (the session's and its lanes) whose windows of buffers a session keeps at most.
const BULK_CONNECTIONS_MAX: usize = 4;
/// Smaller buffers come from the allocator's free lists cheaply; they are not kept.
const BULK_BUFFER_MIN: usize = 256 << 10;
/// Bytes those buffers may hold in all (a copy's window of chunks, with room).
const BULK_BUFFER_BYTES: usize = 32 << 20;

impl Session {
    /// A session of `connection` that may hold `max_pending_copy_bytes` in undelivered
    /// asynchronous copies ([`PendingCopies`]), making its launches as `launcher` says.
    pub(crate) fn new(
        connection: u64,
        max_pending_copy_bytes: u64,
        launcher: crate::launcher::Launcher,
    ) -> Self {
        let copies = Arc::new(PendingCopies::new(connection, max_pending_copy_bytes));
        Self {
            connection,
            tenant: std::sync::OnceLock::new(),
            state: Mutex::new(SessionState {
                copies: Arc::clone(&copies),
                ..SessionState::default()
            }),
            copies,
            waiters: WaiterPool::new(format!("remora-wait-{connection}"), MAX_WAITERS),
            sync_trace: Default::default(),
            callbacks: Arc::default(),
            ordered: Ordered::default(),
            launcher,
            launches: Default::default(),
            launch_ns: Default::default(),
            bulk_copies: Default::default(),
            bulk_bytes: Default::default(),
            bulk_ns: Default::default(),
            area: std::sync::OnceLock::new(),
            area_locked: std::sync::atomic::AtomicBool::new(false),
            loads_functions: std::sync::atomic::AtomicBool::new(false),
            may_print: std::sync::atomic::AtomicBool::new(false),
            bulk_buffers: Mutex::new(remora_oncrpc::recycle::Recycler::new(
                BULK_BUFFERS,
                BULK_BUFFER_BYTES,
            )),
            quota: std::sync::OnceLock::new(),
            refusal_logged: std::sync::atomic::AtomicBool::new(false),
        }
    }

    /// Charges `n` of `kind` to the session and its tenant before `what` makes it:
    /// CUDA_ERROR_OUT_OF_MEMORY past a limit (logged, [`crate::quota::SessionQuota::charge`]).
    pub(crate) fn charge(&self, kind: crate::quota::Kind, n: u64, what: &str) -> CuResult<()> {
        match self.quota.get() {
            Some(Ok(q)) => q.charge(kind, n, what),
            Some(Err(why)) => {
                if !self
                    .refusal_logged
                    .swap(true, std::sync::atomic::Ordering::Relaxed)
                {
                    remora_oncrpc::audit!(
                        warn,
                        limit "tenants",
                        connection = self.connection,
                        "{what} refused: this session was refused ({why}); every allocation and object of it is, CUDA_ERROR_OUT_OF_MEMORY"
                    );
                }
                Err(CuError(cu::OUT_OF_MEMORY))
            }
            None => Ok(()),
        }
    }

    /// Takes back a charge ([`Session::charge`]) whose object was not made after all.
    pub(crate) fn uncharge(&self, kind: crate::quota::Kind, n: u64) {
        if let Some(Ok(q)) = self.quota.get() {
            q.uncharge(kind, n);
        }
    }

    /// Charges `n` of `kind` whatever the limits (what the driver made beyond what was
    /// asked, such as a pitched allocation's padding), so that it is taken back when freed.
    pub(crate) fn charge_made(&self, kind: crate::quota::Kind, n: u64) {
        if let Some(Ok(q)) = self.quota.get() {
            q.add(kind, n);
        }
    }

    /// A buffer of `len` bytes for a copy's reply: a reused one whose earlier reply has been
    /// written, else a new one. Pass the frozen buffer to [`Session::keep_bulk_buffer`].
    pub(crate) fn bulk_buffer(&self, len: usize) -> remora_xdr::BytesMut {
        self.bulk_buffers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take(len)
    }

    /// The session has `lanes` lanes now: each connection keeps a copy's window of chunks in
    /// flight, so the session keeps buffers for all of them (with too few, every chunk past
    /// them got a fresh buffer and paid its page faults: striped device-to-host copies stalled
    /// near 4 GB/s on the H100).
    pub(crate) fn lanes_changed(&self, lanes: usize) {
        // Bounded: a session that attaches many lanes keeps no more than four connections'
        // worth (the default client opens three lanes).
        let connections = lanes.saturating_add(1).min(BULK_CONNECTIONS_MAX);
        self.bulk_buffers
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .set_limits(
                BULK_BUFFERS.saturating_mul(connections),
                BULK_BUFFER_BYTES.saturating_mul(connections),
            );
    }

    /// Keeps `buf` (from [`Session::bulk_buffer`]) for reuse once its reply is written.
    pub(crate) fn keep_bulk_buffer(&self, buf: &remora_xdr::Bytes) {
        if buf.len() >= BULK_BUFFER_MIN {
            self.bulk_buffers
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .keep(buf);
        }
    }

    pub(crate) fn lock(&self) -> MutexGuard<'_, SessionState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Profiling: counts one kernel launch that spent `took` in the driver.
    pub(crate) fn count_launch(&self, took: std::time::Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        self.launches.fetch_add(1, Relaxed);
        self.launch_ns
            .fetch_add(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX), Relaxed);
    }

    /// Profiling: (launches, total time in the driver), when any launch was counted.
    pub(crate) fn launch_profile(&self) -> Option<(u64, std::time::Duration)> {
        use std::sync::atomic::Ordering::Relaxed;
        let n = self.launches.load(Relaxed);
        (n > 0).then(|| {
            (
                n,
                std::time::Duration::from_nanos(self.launch_ns.load(Relaxed)),
            )
        })
    }

    /// Profiling: counts one synchronous copy of `bytes` through the record path that spent
    /// `took` in the driver.
    pub(crate) fn count_bulk_copy(&self, bytes: usize, took: std::time::Duration) {
        use std::sync::atomic::Ordering::Relaxed;
        self.bulk_copies.fetch_add(1, Relaxed);
        self.bulk_bytes.fetch_add(bytes as u64, Relaxed);
        self.bulk_ns
            .fetch_add(u64::try_from(took.as_nanos()).unwrap_or(u64::MAX), Relaxed);
    }

    /// Profiling: (copies, bytes, total time in the driver) of the synchronous copies through
    /// the record path, when any was counted.
    pub(crate) fn bulk_copy_profile(&self) -> Option<(u64, u64, std::time::Duration)> {
        use std::sync::atomic::Ordering::Relaxed;
        let n = self.bulk_copies.load(Relaxed);
        (n > 0).then(|| {
            (
                n,
                self.bulk_bytes.load(Relaxed),
                std::time::Duration::from_nanos(self.bulk_ns.load(Relaxed)),
            )
        })
    }

    /// Releases the host functions blocked for the client, waits for the calls in flight,
    /// then frees everything. The order matters: a call in flight (a synchronize) may wait for
    /// a stream that a host function blocks, and streams are destroyed only after their host
    /// functions are released.
    pub(crate) fn close(&self, backend: &dyn Backend) {
        let t0 = std::time::Instant::now();
        self.launcher.close();
        self.callbacks.close();
        self.ordered.close();
        self.waiters.close();
        let threads = t0.elapsed();
        let mut st = self.lock();
        let objects = st.len();
        // Only the end's frees: those made during the session (a context the program
        // destroyed) are not part of it.
        st.free_times = FreeTimes::default();
        st.free_times.add(FreePart::Threads, 0, threads);
        st.release_all(backend);
        // Part of a short program's run under `remora run`: what its end's frees took.
        tracing::debug!(
            target: "remora::startup",
            connection = self.connection,
            objects,
            us = t0.elapsed().as_micros() as u64,
            "session's resources freed: {}",
            st.free_times.summary()
        );
    }
}

#[cfg(test)]
mod pending_copy_tests {
    use super::*;

    fn empty(copy_id: u64) -> PendingCopy {
        PendingCopy {
            copy_id,
            ctx: 1,
            stream: 0,
            copy: std::sync::Arc::new(crate::backend::NoBytes),
            area: None,
            taken: Default::default(),
        }
    }

    #[test]
    fn refused_copies_are_bounded_too_and_then_the_session_must_close() {
        let copies = PendingCopies::new(7, 4096);
        assert!(copies.admit(4096 - PENDING_COPY_OVERHEAD).is_ok());
        assert_eq!(
            copies.admit(4096 - PENDING_COPY_OVERHEAD + 1),
            Err(CuError(cu::OUT_OF_MEMORY))
        );
        // Refused copies are delivered empty; each counts its overhead, up to the slack.
        let fit = (4096 + EMPTY_COPY_SLACK) / PENDING_COPY_OVERHEAD;
        for id in 0..fit {
            copies.push(empty(id));
            assert!(!copies.overflowed());
        }
        assert_eq!(copies.staged_bytes(), fit * PENDING_COPY_OVERHEAD);
        copies.push(empty(fit));
        assert!(copies.overflowed(), "past the slack the session is closed");
        assert_eq!(copies.staged_bytes(), fit * PENDING_COPY_OVERHEAD);
        // Delivery uncounts them.
        let mut status = cu::SUCCESS;
        let out = copies.collect(Scope::Finished, &mut status);
        assert_eq!(out.len() as u64, fit);
        assert_eq!(copies.staged_bytes(), 0);
    }
}

#[cfg(test)]
mod ordered_tests {
    use std::sync::mpsc;
    use std::time::{Duration, Instant};

    use super::*;

    fn ordered(max_bytes: usize, max_calls: usize, wait_ms: u64) -> Ordered {
        Ordered {
            limits: OrderedLimits {
                max_bytes,
                max_calls,
                full_wait: Duration::from_millis(wait_ms),
            },
            ..Ordered::default()
        }
    }

    #[test]
    fn a_blocked_queue_refuses_past_its_bound_and_keeps_the_order() {
        let o = ordered(4 * (1000 + ORDERED_CALL_OVERHEAD), 100, 200);
        o.start(1).unwrap();
        let (release, held) = mpsc::channel::<()>();
        let (done_tx, done) = mpsc::channel::<usize>();
        // The first call blocks the thread, as a call waiting behind a host callback does.
        o.submit(
            Box::new(move || {
                held.recv().unwrap();
            }),
            1000,
        )
        .ok()
        .unwrap();
        let mut queued = 0;
        let refused = loop {
            let tx = done_tx.clone();
            let i = queued;
            match o.submit(Box::new(move || tx.send(i).unwrap()), 1000) {
                Ok(()) => queued += 1,
                Err(r) => break r,
            }
            assert!(queued < 50, "never refused");
        };
        let started = Instant::now();
        match refused {
            Refused::Full(bytes, calls) => {
                assert!(bytes <= 4 * (1000 + ORDERED_CALL_OVERHEAD), "{bytes}");
                assert_eq!(calls, queued);
            }
            Refused::Stopped(_) => panic!("refused as stopped"),
        }
        assert!(started.elapsed() < Duration::from_secs(5));
        // Once the blocked call ends, the queued ones run, in order.
        release.send(()).unwrap();
        let ran: Vec<usize> = (0..queued)
            .map(|_| done.recv_timeout(Duration::from_secs(5)).unwrap())
            .collect();
        assert_eq!(ran, (0..queued).collect::<Vec<_>>());
        // Room again: a call fits, even one larger than the whole bound (an empty queue
        // takes anything, so a large record is never refused for its size alone).
        let (tx, rx) = mpsc::channel();
        o.submit(Box::new(move || tx.send(()).unwrap()), 1 << 30)
            .ok()
            .unwrap();
        rx.recv_timeout(Duration::from_secs(5)).unwrap();
        o.close();
        assert!(matches!(
            o.submit(Box::new(|| {}), 1),
            Err(Refused::Stopped(_))
        ));
    }

    #[test]
    fn the_call_count_is_bounded_too() {
        let o = ordered(usize::MAX, 3, 50);
        o.start(2).unwrap();
        let (release, held) = mpsc::channel::<()>();
        o.submit(Box::new(move || held.recv().unwrap()), 0)
            .ok()
            .unwrap();
        // Wait until the thread holds the first call, so that the queue is empty.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !o.lock().jobs.is_empty() {
            assert!(Instant::now() < deadline);
            std::thread::sleep(Duration::from_millis(1));
        }
        for _ in 0..3 {
            o.submit(Box::new(|| {}), 0).ok().unwrap();
        }
        assert!(matches!(
            o.submit(Box::new(|| {}), 0),
            Err(Refused::Full(_, 3))
        ));
        release.send(()).unwrap();
        o.close();
    }
}

#[cfg(test)]
mod free_times_tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn the_summary_names_the_slowest_part_first_and_leaves_out_what_did_nothing() {
        let mut t = FreeTimes::default();
        assert_eq!(t.summary(), "nothing");
        t.add(FreePart::Threads, 0, Duration::from_micros(3));
        t.add(FreePart::Modules, 1, Duration::from_micros(1500));
        t.add(FreePart::Modules, 1, Duration::from_micros(500));
        t.add(FreePart::Contexts, 1, Duration::from_millis(40));
        t.add(FreePart::Streams, 2, Duration::ZERO);
        assert_eq!(
            t.summary(),
            "contexts 1 in 40.0 ms, modules 2 in 2.0 ms, streams 2 in 0.0 ms"
        );
        t.add(FreePart::Threads, 0, Duration::from_micros(100));
        assert_eq!(
            t.summary(),
            "contexts 1 in 40.0 ms, modules 2 in 2.0 ms, threads in 0.1 ms, streams 2 in 0.0 ms"
        );
    }
}
