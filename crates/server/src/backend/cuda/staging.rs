//! Device-to-host copies into pinned staging memory, the pool that keeps those buffers for the
//! next copy, and the reaper thread that releases events and buffers off every caller's path.
//!
//! Page-locking memory (`cuMemHostAlloc`) and freeing it (`cuMemFreeHost`, which synchronizes
//! the device) cost far more than a small copy: with a fresh buffer per copy, a graph launch
//! that copies 8 bytes back to pageable memory took ~1.8 ms on the H100 instead of ~25 µs.
//! Buffers are therefore pooled per context in power-of-two size classes, up to
//! [`POOL_MAX_BYTES`] idle bytes.
//!
//! A buffer is memory this process maps itself and page-locks with `cuMemHostRegister`, not
//! `cuMemHostAlloc` memory: the driver unpins it when its context is destroyed but never
//! unmaps it. A device-to-host copy's bytes go out in the reply straight from the buffer
//! ([`PinnedLease`], a `Bytes` owner), which may still be being sent when another connection
//! of the session destroys the context; the bytes stay readable until the reply lets go of
//! them, and only then is the buffer unmapped.

use remora_proto::cuda::{CuError, CuResult, cu};
use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};

use super::super::StagedCopy;
use super::CudaBackend;
use super::driver::{CTX_GENERATION, Driver, EVENT_DISABLE_TIMING, Ptr, ptr};

/// Idle pinned bytes the pool keeps at most (past it, buffers are freed).
const POOL_MAX_BYTES: usize = 256 << 20;
/// Buffers above this size are never pooled.
const POOL_MAX_CLASS: usize = 64 << 20;
/// The smallest size class.
const MIN_CLASS: usize = 4096;
/// Pinned bytes that leases ([`PinnedLease`]) may hold at once in this process. A lease of a
/// device-to-host copy lasts until its reply is sent, so a client that stops reading its
/// replies keeps its leases; past this bound copies use private pageable buffers instead, and
/// page-locked memory stays bounded whatever clients do.
const LEASED_MAX: usize = 512 << 20;

/// Bytes the live leases hold.
static LEASED: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// Counts `class` bytes for a new lease; false (nothing counted) past [`LEASED_MAX`].
fn lease_admit(class: usize) -> bool {
    LEASED
        .fetch_update(Ordering::AcqRel, Ordering::Acquire, |held| {
            held.checked_add(class).filter(|&n| n <= LEASED_MAX)
        })
        .is_ok()
}

/// A lease of `class` bytes ended.
fn lease_release(class: usize) {
    LEASED.fetch_sub(class, Ordering::AcqRel);
}

/// The size class (bytes allocated) of a copy of `size` bytes.
fn class_of(size: usize) -> usize {
    size.checked_next_power_of_two()
        .unwrap_or(size)
        .max(MIN_CLASS)
}

/// Idle staging buffers: (context, size class) → addresses.
#[derive(Default)]
struct Pool {
    idle: HashMap<(u64, usize), Vec<usize>>,
    bytes: usize,
}

static POOL: Mutex<Option<Pool>> = Mutex::new(None);

fn pool() -> std::sync::MutexGuard<'static, Option<Pool>> {
    POOL.lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner)
}

/// An idle buffer of `class` bytes of context `ctx`, if the pool has one.
fn pool_take(ctx: u64, class: usize) -> Option<usize> {
    let mut guard = pool();
    let p = guard.as_mut()?;
    let host = p.idle.get_mut(&(ctx, class))?.pop()?;
    p.bytes -= class;
    Some(host)
}

/// Keeps a buffer whose copy has completed for the next copy; false (the caller frees it)
/// when the pool is full, the class too large, or a context was destroyed since the buffer
/// was allocated (it may have been this buffer's: its memory may be gone).
fn pool_put(ctx: u64, host: usize, class: usize, generation: u64) -> bool {
    let mut guard = pool();
    if CTX_GENERATION.load(Ordering::Acquire) != generation
        || class > POOL_MAX_CLASS
        || !class.is_power_of_two()
    {
        return false;
    }
    let p = guard.get_or_insert_with(Pool::default);
    if p.bytes + class > POOL_MAX_BYTES {
        return false;
    }
    p.bytes += class;
    p.idle.entry((ctx, class)).or_default().push(host);
    true
}

/// Context `ctx` is being destroyed: takes its idle buffers out of the pool and answers them
/// as `(address, size class)`, for [`free_pinned`]. Call after bumping [`CTX_GENERATION`],
/// before the destroy.
pub(super) fn forget_ctx(ctx: u64) -> Vec<(usize, usize)> {
    let mut gone = Vec::new();
    if let Some(p) = pool().as_mut() {
        p.idle.retain(|(c, class), list| {
            if *c == ctx {
                p.bytes -= *class * list.len();
                gone.extend(list.iter().map(|&host| (host, *class)));
                false
            } else {
                true
            }
        });
    }
    gone
}

/// Maps `class` bytes and page-locks them in the current context (`ctx`, entered by the
/// caller): a new staging buffer.
fn map_pinned(driver: &Driver, class: usize) -> CuResult<usize> {
    // SAFETY: a fresh private anonymous mapping, aliasing nothing.
    let host = unsafe {
        rustix::mm::mmap_anonymous(
            std::ptr::null_mut(),
            class,
            rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
            rustix::mm::MapFlags::PRIVATE,
        )
    }
    .map_err(|_| CuError(cu::OUT_OF_MEMORY))?;
    // SAFETY: `host` is `class` bytes of this process's memory, registered once.
    if let Err(e) = call!(driver.t, mem_host_register(host, class, 0)) {
        unmap(host as usize, class);
        return Err(e);
    }
    Ok(host as usize)
}

/// A staging buffer of `class` bytes of `ctx` (the current context): an idle one of the pool,
/// else a new one ([`map_pinned`]); with [`CTX_GENERATION`] as read before taking or mapping
/// it (a context destroyed after that point makes the buffer unpoolable).
fn pooled_or_mapped(driver: &Driver, ctx: u64, class: usize) -> CuResult<(usize, u64)> {
    let generation = CTX_GENERATION.load(Ordering::Acquire);
    let host = match pool_take(ctx, class) {
        Some(h) => h,
        None => map_pinned(driver, class)?,
    };
    Ok((host, generation))
}

/// Unmaps a staging buffer that no copy uses any more and no context has page-locked (its
/// registration was undone, or its context destroyed).
fn unmap(host: usize, class: usize) {
    // SAFETY: `host..host + class` is a mapping `map_pinned` made, unmapped once, by its
    // last holder.
    if let Err(e) = unsafe { rustix::mm::munmap(host as *mut std::ffi::c_void, class) } {
        tracing::warn!(error = %e, "a pinned staging buffer could not be unmapped");
    }
}

/// Frees a staging buffer of `ctx` that nothing uses: unpinned in its context (a destroyed
/// context unpinned it already; the call then fails harmlessly), then unmapped. Not on a
/// caller's path: `cuMemHostUnregister` may synchronize the device (see [`reap`]).
pub(super) fn free_pinned(driver: &Driver, ctx: u64, host: usize, class: usize) {
    if driver.enter(ctx).is_ok() {
        // SAFETY: a buffer `map_pinned` registered; no copy uses it any more.
        let _ = call!(driver.t, mem_host_unregister(host as Ptr));
    }
    unmap(host, class);
}

/// A staging buffer of the pool held for one synchronous copy, and then for as long as the
/// reply that carries its bytes needs them (a `Bytes` owner: [`PinnedLease::into_bytes`]).
/// Dropped, it goes back to the pool, or is freed off the dropping thread's path.
pub(super) struct PinnedLease {
    driver: Arc<Driver>,
    ctx: u64,
    host: usize,
    /// Bytes of the copy (at most `class`).
    len: usize,
    /// Bytes mapped at `host` (the size class).
    class: usize,
    /// [`CTX_GENERATION`] when the buffer was mapped or taken from the pool.
    generation: u64,
}

// SAFETY: the buffer is this lease's alone (taken out of the pool, or new); the driver handle
// may be used from any thread.
unsafe impl Send for PinnedLease {}

impl PinnedLease {
    /// A buffer for `size` bytes of `ctx` (the current context): from the pool, else newly
    /// mapped and page-locked. `None` when the size is past what is pooled; the error of the
    /// driver when no pinned memory could be had.
    fn take(driver: &Arc<Driver>, ctx: u64, size: usize) -> Option<CuResult<Self>> {
        let class = class_of(size);
        if class > POOL_MAX_CLASS || !lease_admit(class) {
            return None;
        }
        let (host, generation) = match pooled_or_mapped(driver, ctx, class) {
            Ok(b) => b,
            Err(e) => {
                lease_release(class);
                return Some(Err(e));
            }
        };
        Some(Ok(Self {
            driver: Arc::clone(driver),
            ctx,
            host,
            len: size,
            class,
            generation,
        }))
    }

    /// The driver, with the lease's context current on the thread that took it.
    pub(super) fn driver(&self) -> &Driver {
        &self.driver
    }

    /// The buffer, for a copy into or out of it.
    pub(super) fn ptr(&self) -> Ptr {
        self.host as Ptr
    }

    /// The copy's bytes, shared with no copy: the reply sends them from the pinned buffer,
    /// which returns to the pool when the reply lets go of them. Call once the copy into the
    /// buffer has completed.
    pub(super) fn into_bytes(self) -> remora_xdr::Bytes {
        remora_xdr::Bytes::from_owner(self)
    }
}

impl AsRef<[u8]> for PinnedLease {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: `host` maps `class >= len` bytes, kept mapped while this lease lives; read
        // only after the copy into them completed (`into_bytes`).
        unsafe { std::slice::from_raw_parts(self.host as *const u8, self.len) }
    }
}

impl Drop for PinnedLease {
    /// Calls no driver function: back to the pool when it has room, else freed by the reaper.
    fn drop(&mut self) {
        lease_release(self.class);
        if !pool_put(self.ctx, self.host, self.class, self.generation) {
            reap(
                Arc::clone(&self.driver),
                self.ctx,
                self.host as Ptr,
                std::ptr::null_mut(),
                (self.class, self.generation),
            );
        }
    }
}

/// A device-to-host copy into pinned staging memory, completed when its event is.
pub(super) struct CudaStaged {
    driver: Arc<Driver>,
    ctx: u64,
    host: Ptr,
    size: usize,
    /// Bytes allocated at `host` (the size class).
    class: usize,
    /// [`CTX_GENERATION`] when the buffer was allocated or taken from the pool.
    generation: u64,
    event: Ptr,
}

// SAFETY: the staging buffer is owned by this object alone; the driver handles may be used from
// any thread (the context is made current before each use).
unsafe impl Send for CudaStaged {}
// SAFETY: shared use only reads: `query`/`wait` call thread-safe driver functions on the event,
// and `data` reads the staging buffer, which nothing writes once the copy has completed (the
// only time callers read it).
unsafe impl Sync for CudaStaged {}

/// Whether the copy that `event` (of `ctx`, live) follows has completed.
fn event_done(driver: &Driver, ctx: u64, event: Ptr) -> CuResult<bool> {
    driver.enter(ctx)?;
    // SAFETY: the callers pass an event they created and have not destroyed.
    match call!(driver.t, event_query(event)) {
        Ok(()) => Ok(true),
        Err(CuError(cu::NOT_READY)) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Blocks until the copy that `event` (of `ctx`, live) follows has completed.
fn event_wait(driver: &Driver, ctx: u64, event: Ptr) -> CuResult<()> {
    driver.enter(ctx)?;
    // SAFETY: as in event_done.
    call!(driver.t, event_synchronize(event))
}

impl StagedCopy for CudaStaged {
    fn query(&self) -> CuResult<bool> {
        event_done(&self.driver, self.ctx, self.event)
    }

    fn wait(&self) -> CuResult<()> {
        event_wait(&self.driver, self.ctx, self.event)
    }

    fn data(&self) -> &[u8] {
        // SAFETY: `host` points to `size` bytes of pinned memory owned by this object (from
        // cuMemHostAlloc); callers read it only after the copy completed.
        unsafe { std::slice::from_raw_parts(self.host as *const u8, self.size) }
    }
}

impl Drop for CudaStaged {
    /// Calls no driver function: the last holder may be a host function (which must not call
    /// CUDA) or a thread whose driver calls could wait for one. The reaper waits for the copy,
    /// then destroys the event and frees the buffer.
    fn drop(&mut self) {
        reap(
            Arc::clone(&self.driver),
            self.ctx,
            self.host,
            self.event,
            (self.class, self.generation),
        );
    }
}

/// An asynchronous device-to-host copy straight into a session's shared data area
/// ([`CudaBackend::in_area`]): its bytes land there, so it holds only the event recorded after
/// it.
pub(super) struct CudaInArea {
    driver: Arc<Driver>,
    ctx: u64,
    event: Ptr,
}

// SAFETY: the event handle may be used from any thread (the context is made current first).
unsafe impl Send for CudaInArea {}
// SAFETY: shared use only queries and synchronizes the event, thread-safe driver calls.
unsafe impl Sync for CudaInArea {}

impl StagedCopy for CudaInArea {
    fn query(&self) -> CuResult<bool> {
        event_done(&self.driver, self.ctx, self.event)
    }

    fn wait(&self) -> CuResult<()> {
        event_wait(&self.driver, self.ctx, self.event)
    }

    fn data(&self) -> &[u8] {
        &[]
    }
}

impl Drop for CudaInArea {
    /// Calls no driver function (see [`CudaStaged`]'s drop): the reaper destroys the event.
    fn drop(&mut self) {
        reap(
            Arc::clone(&self.driver),
            self.ctx,
            std::ptr::null_mut(),
            self.event,
            (0, 0),
        );
    }
}

/// A pinned staging buffer to free or pool: (driver, its context, address, the event after the
/// copy into it or null, (size class, context generation at allocation)).
type Reap = (Arc<Driver>, u64, usize, usize, (usize, u64));

/// Frees a staging buffer off the caller's path. Unpinning (like `cuMemFreeHost`) synchronizes
/// the whole device; called while a reply is being built it waits for every stream, including one held
/// back by a host function that waits for this very client — a deadlock seen on the GPU
/// machine. A reaper thread, holding no lock, does the freeing instead.
fn reap(driver: Arc<Driver>, ctx: u64, host: Ptr, event: Ptr, pooling: (usize, u64)) {
    static REAPER: std::sync::OnceLock<Option<std::sync::Mutex<std::sync::mpsc::Sender<Reap>>>> =
        std::sync::OnceLock::new();
    let reaper = REAPER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Reap>();
        std::thread::Builder::new()
            .name("remora-staging-reaper".into())
            .spawn(move || {
                for (driver, ctx, addr, event, (class, generation)) in rx {
                    // A context destroyed meanwhile took its events with it and unpinned
                    // the buffer: the calls then fail harmlessly, and the buffer is unmapped.
                    if event != 0 && driver.enter(ctx).is_ok() {
                        // SAFETY: the event was created for this copy and is destroyed once,
                        // here, after the copy into the buffer has completed.
                        let _ = call!(driver.t, event_synchronize(event as Ptr));
                        // SAFETY: as above.
                        let _ = call!(driver.t, event_destroy(event as Ptr));
                    }
                    // No buffer: a copy into a data area ([`CudaInArea`]).
                    if addr != 0 && !pool_put(ctx, addr, class, generation) {
                        free_pinned(&driver, ctx, addr, class);
                    }
                }
            })
            .ok()
            .map(|_| std::sync::Mutex::new(tx))
    });
    let sent = reaper.as_ref().is_some_and(|tx| {
        tx.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .send((driver.clone(), ctx, host as usize, event as usize, pooling))
            .is_ok()
    });
    if !sent {
        // No reaper thread could be started: leak the buffer rather than risk the deadlock.
        tracing::warn!("no staging reaper thread; a pinned staging buffer is leaked");
    }
}

impl CudaBackend {
    /// Allocates `size` bytes of pinned staging memory and an event, lets `issue` queue a copy
    /// into it on `stream`, and records the event after it.
    pub(super) fn stage(
        &self,
        ctx: u64,
        stream: u64,
        size: usize,
        issue: impl FnOnce(&Driver, Ptr) -> CuResult<()>,
    ) -> CuResult<Box<dyn StagedCopy>> {
        let driver = Arc::clone(self.driver.as_ref().ok_or(CuError(cu::NO_DEVICE))?);
        driver.enter(ctx)?;
        if size == 0 {
            return Ok(Box::new(super::super::NoBytes));
        }
        let class = class_of(size);
        let (host, generation) = pooled_or_mapped(&driver, ctx, class)?;
        let host = host as Ptr;
        let mut event: Ptr = std::ptr::null_mut();
        // SAFETY: writes one CUevent.
        if let Err(e) = call!(driver.t, event_create(&mut event, EVENT_DISABLE_TIMING)) {
            // The buffer, unused: pooled or freed off this path like the others.
            reap(
                Arc::clone(&driver),
                ctx,
                host,
                std::ptr::null_mut(),
                (class, generation),
            );
            return Err(e);
        }
        let staged = CudaStaged {
            driver: Arc::clone(&driver),
            ctx,
            host,
            size,
            class,
            generation,
            event,
        };
        // `host` holds `size` bytes and lives until `staged` is dropped, which waits for the
        // copy first.
        issue(&driver, host)?;
        // SAFETY: the event and stream are live.
        call!(driver.t, event_record(event, ptr(stream)))?;
        Ok(Box::new(staged))
    }
}

impl CudaBackend {
    /// An asynchronous device-to-host copy that `issue` queues on `stream` of `ctx` straight
    /// into a session's data area, and the event recorded after it. When `issue` fails after
    /// queueing part of the copy, this waits for that part before answering the error: the
    /// client gives the area's bytes back once the error is delivered, and no DMA may land
    /// in them after that.
    pub(super) fn in_area(
        &self,
        ctx: u64,
        stream: u64,
        issue: impl FnOnce(&Driver) -> CuResult<()>,
    ) -> CuResult<Box<dyn StagedCopy>> {
        let driver = Arc::clone(self.driver.as_ref().ok_or(CuError(cu::NO_DEVICE))?);
        driver.enter(ctx)?;
        let mut event: Ptr = std::ptr::null_mut();
        // SAFETY: writes one CUevent.
        call!(driver.t, event_create(&mut event, EVENT_DISABLE_TIMING))?;
        // From here the event is destroyed with `copy`, by the reaper.
        let copy = CudaInArea {
            driver: Arc::clone(&driver),
            ctx,
            event,
        };
        let issued = issue(&driver);
        // SAFETY: the event and stream are live.
        let recorded = call!(driver.t, event_record(event, ptr(stream)));
        match (issued, recorded) {
            (Ok(()), Ok(())) => Ok(Box::new(copy)),
            (Err(e), Ok(())) => {
                let _ = copy.wait();
                Err(e)
            }
            // Not recorded: whatever was queued is waited for with the whole context (which
            // returns at once after a sticky error, when nothing runs).
            (issued, Err(e)) => {
                // SAFETY: synchronizes the current context (`ctx`, entered above).
                let _ = call!(driver.t, ctx_synchronize());
                Err(issued.err().unwrap_or(e))
            }
        }
    }
}

/// Synchronous copies between the host and the device at least this large go through a
/// pinned buffer of the pool ([`CudaBackend::with_pinned`]) instead of the driver's own
/// staging of pageable memory. Measured on the H100 (gVisor) with the striped copies of
/// several connections of one session: the driver's pageable path serializes the copies of
/// concurrent threads, CPU part included (0.9 GB/s per copying thread with four of them, 6.8
/// with one), while a copy through pinned memory holds the driver only for the DMA (~50 GB/s)
/// and the threads' CPU copies run side by side.
pub(super) const SYNC_STAGING_MIN: usize = 1 << 20;

impl CudaBackend {
    /// A pinned staging buffer of `size` bytes of `ctx` (which becomes current), from the
    /// pool or newly mapped; `None` when no pinned memory could be had (the caller copies
    /// without it).
    pub(super) fn pinned_lease(&self, ctx: u64, size: usize) -> Option<PinnedLease> {
        let driver = self.driver.as_ref()?;
        if driver.enter(ctx).is_err() {
            return None;
        }
        match PinnedLease::take(driver, ctx, size)? {
            Ok(lease) => Some(lease),
            Err(e) => {
                static ONCE: std::sync::Once = std::sync::Once::new();
                ONCE.call_once(|| {
                    tracing::info!(
                        "no pinned staging memory for synchronous copies ({e}); they use the driver's pageable path (slower when several run at once)"
                    );
                });
                None
            }
        }
    }

    /// Runs `f` with `size` bytes of pinned memory of `ctx` ([`CudaBackend::pinned_lease`]);
    /// `None` when no pinned memory could be had. `f` must be done with the buffer when it
    /// returns: a synchronous copy.
    pub(super) fn with_pinned<T>(
        &self,
        ctx: u64,
        size: usize,
        f: impl FnOnce(&Driver, Ptr) -> CuResult<T>,
    ) -> Option<CuResult<T>> {
        let lease = self.pinned_lease(ctx, size)?;
        Some(f(lease.driver(), lease.ptr()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn size_classes() {
        assert_eq!(class_of(0), MIN_CLASS);
        assert_eq!(class_of(8), MIN_CLASS);
        assert_eq!(class_of(4097), 8192);
        assert_eq!(class_of(64 << 20), 64 << 20);
    }

    /// Leases are admitted up to LEASED_MAX bytes at once, and room comes back with them.
    #[test]
    fn leases_are_bounded() {
        let class = 64 << 20;
        let before = LEASED.load(Ordering::Acquire);
        let mut taken = 0;
        while lease_admit(class) {
            taken += 1;
            assert!(taken <= LEASED_MAX / class, "admitted past the bound");
        }
        assert!(LEASED.load(Ordering::Acquire) <= LEASED_MAX);
        lease_release(class);
        assert!(lease_admit(class), "room came back");
        for _ in 0..taken {
            lease_release(class);
        }
        assert_eq!(LEASED.load(Ordering::Acquire), before);
    }

    /// Buffers come back by (context, class); a context destroy (generation bump) makes
    /// buffers allocated before it unpoolable, and forgets the idle ones of that context.
    #[test]
    fn pooled_by_context_and_class_and_forgotten_with_the_context() {
        let ctx = 0x5eed_0000;
        let g = CTX_GENERATION.load(Ordering::Acquire);
        assert!(pool_put(ctx, 0x1000, 8192, g));
        assert!(pool_put(ctx, 0x3000, 8192, g));
        assert!(pool_put(ctx + 1, 0x5000, 8192, g));
        assert!(!pool_put(ctx, 0x7000, 3000, g), "not a size class");
        assert!(!pool_put(ctx, 0x7000, 128 << 20, g), "too large to pool");
        assert_eq!(pool_take(ctx, 4096), None);
        assert_eq!(pool_take(ctx, 8192), Some(0x3000));
        CTX_GENERATION.fetch_add(1, Ordering::AcqRel);
        assert_eq!(
            forget_ctx(ctx),
            vec![(0x1000, 8192)],
            "its idle buffers, to unmap"
        );
        assert!(
            !pool_put(ctx, 0x3000, 8192, g),
            "allocated before a destroy"
        );
        assert_eq!(pool_take(ctx, 8192), None);
        assert_eq!(pool_take(ctx + 1, 8192), Some(0x5000));
        assert_eq!(pool().as_ref().map_or(0, |p| p.bytes), 0);
    }
}
