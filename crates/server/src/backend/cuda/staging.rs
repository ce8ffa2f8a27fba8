//! Device-to-host copies into pinned staging memory, and the reaper thread that releases their
//! events and buffers off every caller's path.

use remora_proto::cuda::{CuError, CuResult, cu};
use std::sync::Arc;

use super::super::StagedCopy;
use super::CudaBackend;
use super::driver::{Driver, EVENT_DISABLE_TIMING, Ptr, ptr};

/// A device-to-host copy into pinned staging memory, completed when its event is.
pub(super) struct CudaStaged {
    driver: Arc<Driver>,
    ctx: u64,
    host: Ptr,
    size: usize,
    event: Ptr,
}

// SAFETY: the staging buffer is owned by this object alone; the driver handles may be used from
// any thread (the context is made current before each use).
unsafe impl Send for CudaStaged {}
// SAFETY: shared use only reads: `query`/`wait` call thread-safe driver functions on the event,
// and `data` reads the staging buffer, which nothing writes once the copy has completed (the
// only time callers read it).
unsafe impl Sync for CudaStaged {}

impl StagedCopy for CudaStaged {
    fn query(&self) -> CuResult<bool> {
        self.driver.enter(self.ctx)?;
        // SAFETY: `event` is an event this object created and has not destroyed.
        match call!(self.driver.t, event_query(self.event)) {
            Ok(()) => Ok(true),
            Err(CuError(cu::NOT_READY)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    fn wait(&self) -> CuResult<()> {
        self.driver.enter(self.ctx)?;
        // SAFETY: as in query.
        call!(self.driver.t, event_synchronize(self.event))
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
        reap(Arc::clone(&self.driver), self.ctx, self.host, self.event);
    }
}

/// A pinned staging buffer to free: (driver, its context, address, the event after the copy
/// into it or null).
pub(super) type Reap = (Arc<Driver>, u64, usize, usize);

/// Frees a staging buffer off the caller's path. `cuMemFreeHost` synchronizes the whole
/// device; called while a reply is being built it waits for every stream, including one held
/// back by a host function that waits for this very client — a deadlock seen on the GPU
/// machine. A reaper thread, holding no lock, does the freeing instead.
pub(super) fn reap(driver: Arc<Driver>, ctx: u64, host: Ptr, event: Ptr) {
    static REAPER: std::sync::OnceLock<Option<std::sync::Mutex<std::sync::mpsc::Sender<Reap>>>> =
        std::sync::OnceLock::new();
    let reaper = REAPER.get_or_init(|| {
        let (tx, rx) = std::sync::mpsc::channel::<Reap>();
        std::thread::Builder::new()
            .name("remora-staging-reaper".into())
            .spawn(move || {
                for (driver, ctx, addr, event) in rx {
                    // A context destroyed meanwhile took its pinned memory with it; the free
                    // then fails harmlessly.
                    if driver.enter(ctx).is_ok() {
                        if event != 0 {
                            // SAFETY: the event was created for this copy and is destroyed
                            // once, here, after the copy into the buffer has completed.
                            let _ = call!(driver.t, event_synchronize(event as Ptr));
                            // SAFETY: as above.
                            let _ = call!(driver.t, event_destroy(event as Ptr));
                        }
                        // SAFETY: a buffer from cuMemHostAlloc whose copy completed and that
                        // nothing uses any more; freed once.
                        let _ = call!(driver.t, mem_free_host(addr as Ptr));
                    }
                }
            })
            .ok()
            .map(|_| std::sync::Mutex::new(tx))
    });
    let sent = reaper.as_ref().is_some_and(|tx| {
        tx.lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .send((driver.clone(), ctx, host as usize, event as usize))
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
        let mut host: Ptr = std::ptr::null_mut();
        // SAFETY: writes one host pointer to `size` bytes of pinned memory.
        call!(driver.t, mem_host_alloc(&mut host, size, 0))?;
        let mut event: Ptr = std::ptr::null_mut();
        // SAFETY: writes one CUevent.
        if let Err(e) = call!(driver.t, event_create(&mut event, EVENT_DISABLE_TIMING)) {
            // The buffer allocated just above, unused: freed off this path like the others.
            reap(Arc::clone(&driver), ctx, host, std::ptr::null_mut());
            return Err(e);
        }
        let staged = CudaStaged {
            driver: Arc::clone(&driver),
            ctx,
            host,
            size,
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
