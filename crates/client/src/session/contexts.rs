//! [`Session`] methods for devices, contexts and primary contexts (the limit calls are
//! generated: `client_glue!` in `mod.rs`).

use super::*;

impl Session {
    // Devices ----------------------------------------------------------------------------

    /// `RM_DEVICE_GET_PROPS`, fetched once per device and cached.
    pub fn device_props(&self, dev: DeviceHandle) -> CuResult<Arc<RmDeviceProps>> {
        self.check_device(dev)?;
        if let Some(p) = lock(&self.props).get(&dev) {
            return Ok(Arc::clone(p));
        }
        let props = Arc::new(Reply::value(call!(self.rm_device_get_props(&dev))?)?);
        lock(&self.props).insert(dev, Arc::clone(&props));
        Ok(props)
    }

    /// A device attribute: from the cached props, else `RM_DEVICE_GET_ATTRIBUTE` (cached).
    ///
    /// Concurrent access to managed memory and coherent access to pageable host memory are
    /// not supported through Remora: the attributes that advertise them
    /// ([`UNSUPPORTED_MEMORY_ATTRIBUTES`]) answer 0 whatever the server's GPU can do, so that
    /// the CUDA runtime's `cudaDeviceProp.concurrentManagedAccess`, `pageableMemoryAccess`,
    /// ... tell programs the truth (managed memory itself works, with the coherence model of
    /// such devices).
    pub fn device_attribute(&self, dev: DeviceHandle, attribute: i32) -> CuResult<i32> {
        let props = self.device_props(dev)?;
        if UNSUPPORTED_MEMORY_ATTRIBUTES.contains(&attribute) {
            return Ok(0);
        }
        if let Some(a) = props.attributes.iter().find(|a| a.attribute == attribute) {
            return Ok(a.value);
        }
        if let Some(v) = lock(&self.attrs).get(&(dev, attribute)) {
            return Ok(*v);
        }
        let v = Reply::value(call!(self.rm_device_get_attribute(&RmDeviceAttrArgs {
            attribute,
            device: dev
        }))?)?;
        lock(&self.attrs).insert((dev, attribute), v);
        Ok(v)
    }

    // Contexts -----------------------------------------------------------------------------

    /// `cuDevicePrimaryCtxRetain`.
    pub fn primary_ctx_retain(&self, dev: DeviceHandle) -> CuResult<RmHandle> {
        let h = self.changing_primary(dev, || {
            Reply::value(call!(self.rm_primary_ctx_retain(&dev))?)
        })?;
        lock(&self.ctx_devices).insert(h, dev);
        Ok(h)
    }

    /// `cuDevicePrimaryCtxRelease`.
    pub fn primary_ctx_release(&self, dev: DeviceHandle) -> CuResult<()> {
        self.ending_primary(dev, || call!(self.rm_primary_ctx_release(&dev)))
    }

    /// `cuDevicePrimaryCtxReset`.
    pub fn primary_ctx_reset(&self, dev: DeviceHandle) -> CuResult<()> {
        self.ending_primary(dev, || call!(self.rm_primary_ctx_reset(&dev)))
    }

    /// A call that may end the primary context of `dev` (`end`, answering a `CUresult`):
    /// the events of `dev`'s contexts are forgotten first, the device output it flushes is
    /// taken after it.
    fn ending_primary(
        &self,
        dev: DeviceHandle,
        end: impl FnOnce() -> CuResult<i32>,
    ) -> CuResult<()> {
        self.forget_events_of_device(dev);
        self.changing_primary(dev, || {
            let r = end()?;
            self.take_device_output();
            CuError::check(r)
        })
    }

    /// `cuDevicePrimaryCtxSetFlags`.
    pub fn primary_ctx_set_flags(&self, dev: DeviceHandle, flags: u32) -> CuResult<()> {
        self.changing_primary(dev, || {
            let args = RmPrimaryFlagsArgs { device: dev, flags };
            CuError::check(call!(self.rm_primary_ctx_set_flags(&args))?)
        })
    }

    /// `cuDevicePrimaryCtxGetState`: (flags, active).
    /// Answered from this session's cache after the first call (see `primary_states`).
    pub fn primary_ctx_get_state(&self, dev: DeviceHandle) -> CuResult<(u32, bool)> {
        self.check_device(dev)?;
        let generation = {
            let cache = lock(&self.primary_states);
            if let Some(state) = cache.1.get(&dev) {
                return Ok(*state);
            }
            cache.0
        };
        let state = Reply::value(call!(self.rm_primary_ctx_get_state(&dev))?)
            .map(|s| (s.flags, s.active != 0))?;
        let mut cache = lock(&self.primary_states);
        if cache.0 == generation {
            cache.1.insert(dev, state);
        }
        Ok(state)
    }

    /// Forgets the events of every context on `dev` before its primary context may go: the
    /// primary context's die with it (events of other contexts there lose only their
    /// one-way destruction, and pooled ones stay on the server until their context goes).
    fn forget_events_of_device(&self, dev: DeviceHandle) {
        let devices = lock(&self.ctx_devices).clone();
        self.forget_events_of(|ctx| devices.get(&ctx) == Some(&dev));
    }

    /// Runs `call`, which may change the primary context state of `dev`, with the cached
    /// state forgotten before and after it (a generation passes each time, so an answer
    /// asked for meanwhile is not kept).
    fn changing_primary<T>(
        &self,
        dev: DeviceHandle,
        call: impl FnOnce() -> CuResult<T>,
    ) -> CuResult<T> {
        self.check_device(dev)?;
        let forget = || {
            let mut cache = lock(&self.primary_states);
            cache.0 += 1;
            cache.1.remove(&dev);
        };
        forget();
        let r = call();
        forget();
        r
    }

    /// `cuCtxCreate`.
    pub fn ctx_create(&self, flags: u32, dev: DeviceHandle) -> CuResult<RmHandle> {
        self.check_device(dev)?;
        let h = Reply::value(call!(
            self.rm_ctx_create(&RmCtxCreateArgs { flags, device: dev })
        )?)?;
        lock(&self.ctx_devices).insert(h, dev);
        Ok(h)
    }

    /// The device of context `ctx` (one this session created or retained).
    pub fn ctx_device(&self, ctx: RmHandle) -> CuResult<DeviceHandle> {
        lock(&self.ctx_devices)
            .get(&ctx)
            .copied()
            .ok_or(CuError(cu::INVALID_CONTEXT))
    }

    /// `cuCtxDestroy`: also forgets the context's allocations and per-thread streams. The
    /// context's pending asynchronous copies are delivered first (destroying a context waits
    /// for its work; their bytes would otherwise be lost with it).
    pub fn ctx_destroy(&self, ctx: RmHandle) -> CuResult<()> {
        if !self.delivery.pending_in(Some(ctx)).is_empty()
            && let Err(e) = self.ctx_synchronize(ctx)
        {
            tracing::debug!("remora: cuCtxDestroy: synchronizing the context failed: {e}");
        }
        self.free_managed_of(ctx);
        let r = call!(self.rm_ctx_destroy(&ctx))?;
        self.take_device_output();
        CuError::check(r)?;
        for (base, id) in self.va.of_context(ctx) {
            self.va.release_buffer(base, id);
        }
        lock(&self.per_thread).retain(|(_, c), _| *c != ctx);
        self.forget_events_of(|c| c == ctx);
        self.libraries.forget_ctx(ctx);
        self.delivery.ctx_destroyed(ctx);
        Ok(())
    }

    /// `cuCtxSynchronize` (delivers pending asynchronous copies).
    pub fn ctx_synchronize(&self, ctx: RmHandle) -> CuResult<()> {
        let cov = self.delivery.context(ctx, self.copy_mark());
        let r = match self.ctx_synchronize_reading(ctx) {
            Some(r) => r?,
            // The managed-memory pull after it need not synchronize `ctx` again.
            None => crate::mirror::synchronizing_ctx(ctx, || call!(self.rm_ctx_synchronize(&ctx)))?,
        };
        self.finish_sync(r)?;
        self.delivery
            .settle(&cov, Fetch::Collect, self.collect_lanes())
    }

    /// A context synchronize that takes the copies its reply carries but waits for no other
    /// delivery: for the managed-memory hooks, which run inside another call whose reply
    /// (and the copies it carries) the calling thread has not processed yet. Settling there
    /// would wait for those copies, which arrive only after the hook returns.
    pub(super) fn ctx_synchronize_unsettled(&self, ctx: RmHandle) -> CuResult<()> {
        let r = call!(self.rm_ctx_synchronize(&ctx))?;
        self.finish_sync(r)
    }

    revision_calls! {
        /// The private TOOLS_CONTEXT query cuBLASLt makes (slots 51 and 39), answered by the
        /// server's driver: the 32-bit answer (revision 7).
        tools_ctx_query(ctx: RmHandle, mask: u64, flag: u32) -> u64
            = 7, "the TOOLS_CONTEXT query of cuBLASLt": Reply::value,
            rm_tools_ctx_query(&RmToolsCtxQueryArgs { ctx, mask, flag });
        /// The same query about stream `stream` of `ctx` (revision 10; cuBLAS asks it for
        /// reductions on a created stream).
        tools_stream_query(ctx: RmHandle, stream: RmHandle, mask: u64, flag: u32) -> u64
            = 10, "the TOOLS_CONTEXT query of cuBLAS about a stream": Reply::value,
            rm_tools_stream_query(&RmToolsStreamQueryArgs { ctx, stream, mask, flag });
    }
}
