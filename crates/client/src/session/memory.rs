//! [`Session`] methods for device allocations, host memory, pointer kinds and unified
//! addressing.

use super::*;
use crate::host::DeviceView;
use crate::vaspace::ReserveError;

/// Revision that brought `RM_AREA_MAP` (allocations in the data area mapped one by one).
pub(super) const AREA_MAP_REVISION: u32 = 18;

/// What a range [`Session::alloc_reserved`] reserves stands for.
pub(super) enum Reserved<'a> {
    /// A device allocation of context `ctx` (freed with `cuMemFree`, gone with its context).
    Alloc,
    /// A `cuMemAddressReserve` range, freed with this; it outlives its context.
    Virtual(&'a dyn Fn(u64)),
}

impl Session {
    /// Allocates device memory with `alloc` (which answers the pointer, the bytes it spans and
    /// whatever else the caller wants back) and reserves the same range in this process, as
    /// unified addressing needs. The server's driver picks the address; when it lands on one
    /// of this process's own mappings, that allocation is kept (so the driver cannot hand it
    /// out again) and another asked for, up to [`MAX_VA_RETRIES`] times; the collided ones
    /// are freed at the end (`cuMemFree` in `ctx`, or as `kind` says).
    pub(super) fn alloc_reserved<T>(
        &self,
        ctx: RmHandle,
        alloc: impl Fn() -> CuResult<(u64, u64, T)>,
        kind: Reserved<'_>,
    ) -> CuResult<(u64, T)> {
        let mut collided = Vec::new();
        let result = loop {
            let (ptr, size, extra) = match alloc() {
                Ok(a) => a,
                Err(e) => break Err(e),
            };
            let outlives = matches!(kind, Reserved::Virtual(_));
            match self.va.reserve_range(ptr, size, ctx, outlives) {
                Ok(()) => break Ok((ptr, extra)),
                Err(ReserveError::Collision(_)) if collided.len() < MAX_VA_RETRIES => {
                    tracing::debug!(
                        "remora: device allocation {ptr:#x}+{size:#x} collides with a host mapping of this process; allocating again"
                    );
                    collided.push(ptr);
                }
                Err(ReserveError::Collision(why) | ReserveError::Other(why)) => {
                    tracing::error!(
                        "remora: the device allocation {ptr:#x}+{size:#x} collides with a host mapping of this process ({why}); unified addressing needs the same range free in the client, so the allocation was freed and fails with CUDA_ERROR_OUT_OF_MEMORY"
                    );
                    collided.push(ptr);
                    break Err(CuError(cu::OUT_OF_MEMORY));
                }
            }
        };
        for p in collided {
            match kind {
                Reserved::Virtual(free) => free(p),
                Reserved::Alloc => {
                    let _ = self.rpc.rm_mem_free(&RmPtrArgs { ctx, ptr: p });
                }
            }
        }
        result
    }

    /// `cuMemAlloc`: the device address, with the same range reserved in this process.
    pub fn mem_alloc(&self, ctx: RmHandle, bytesize: u64) -> CuResult<u64> {
        if bytesize == 0 {
            return Err(CuError(cu::INVALID_VALUE));
        }
        self.alloc_reserved(
            ctx,
            || {
                let ptr = Reply::value(call!(self.rm_mem_alloc(&RmAllocArgs { ctx, bytesize }))?)?;
                Ok((ptr, bytesize, ()))
            },
            Reserved::Alloc,
        )
        .map(|(ptr, ())| ptr)
    }

    /// `cuMemAllocPitch`: (pointer, pitch).
    pub fn mem_alloc_pitch(
        &self,
        ctx: RmHandle,
        width_bytes: u64,
        height: u64,
        element_size: u32,
    ) -> CuResult<(u64, u64)> {
        if width_bytes == 0 || height == 0 || ![4, 8, 16].contains(&element_size) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        self.alloc_reserved(
            ctx,
            || {
                let args = RmAllocPitchArgs {
                    ctx,
                    width_bytes,
                    height,
                    element_size,
                };
                Reply::value(call!(self.rm_mem_alloc_pitch(&args))?)
                    .map(|a| (a.ptr, a.pitch.saturating_mul(height), a.pitch))
            },
            Reserved::Alloc,
        )
    }

    /// `cuMemFree`: frees on the server, then releases the reservation.
    pub fn mem_free(&self, ctx: RmHandle, ptr: u64) -> CuResult<()> {
        if let Some(r) = self.mem_free_mirrored(ptr, false) {
            return r;
        }
        CuError::check(call!(self.rm_mem_free(&RmPtrArgs { ctx, ptr }))?)?;
        lock(&self.stream_allocs).remove(&ptr);
        if !self.is_graph_alloc(ptr) {
            self.va.release(ptr);
        }
        Ok(())
    }

    /// `cuMemGetInfo`: (free, total).
    pub fn mem_get_info(&self, ctx: RmHandle) -> CuResult<(u64, u64)> {
        Reply::value(call!(self.rm_mem_get_info(&ctx))?).map(|i| (i.free_bytes, i.total_bytes))
    }

    /// `cuMemGetAddressRange`: (base, size).
    pub fn mem_get_address_range(&self, ctx: RmHandle, ptr: u64) -> CuResult<(u64, u64)> {
        let range = call!(self.rm_mem_get_address_range(&RmPtrArgs { ctx, ptr }))?;
        Reply::value(range).map(|r| (r.base, r.size))
    }

    /// Classifies a pointer as host or device (unified addressing), locally.
    pub fn pointer_kind(&self, ptr: u64) -> PointerKind {
        // Page-locked memory outside a data area lies in a device reservation too, but it
        // is host memory to the program.
        if self.host.has_device_views()
            && let Some(r) = self
                .host
                .find(ptr)
                .filter(|r| r.view != DeviceView::Private)
        {
            return PointerKind::HostTracked(r);
        }
        match self.va.find(ptr) {
            Some((base, r)) => {
                // A managed allocation is known by its own extent, not its reservation's.
                let (base, size) = self.managed_range(ptr).unwrap_or((base, r.size));
                PointerKind::Device {
                    base,
                    size,
                    ctx: r.ctx,
                    buffer_id: r.buffer_id,
                }
            }
            None => match self.host.find(ptr) {
                Some(r) => PointerKind::HostTracked(r),
                None => PointerKind::Host,
            },
        }
    }

    /// The client's host memory (`cuMemHostAlloc`, `cuMemHostRegister`).
    pub fn host_memory(&self) -> &HostMem {
        &self.host
    }

    /// `cuMemHostAlloc`. In the shared data area when the session has one with room (the
    /// server maps the area for the GPU: zero-copy both ways). Elsewhere (a socket session,
    /// or a full area) the GPU cannot reach this process's pages, so mapped host memory is
    /// emulated like managed memory (the `mirror` module): the allocation's address is
    /// reserved on the device too and host pages are mapped at it here. With
    /// `CU_MEMHOSTALLOC_DEVICEMAP` device memory backs it at once; without (`cudaMallocHost`,
    /// which unified addressing maps all the same) only when a device pointer is asked for
    /// with `cuMemHostGetDevicePointer`, so that pinned buffers used only for copies cost no
    /// coherence work. Against a server older than revision 10 memory without DEVICEMAP is
    /// private and cannot be mapped.
    pub fn mem_host_alloc(&self, ctx: RmHandle, size: u64, flags: u32) -> CuResult<u64> {
        const DEVICEMAP: u32 = 0x2;
        if let Some(p) = self.host.alloc_in_area(size, flags, ctx)? {
            // Revision 18: page-locked and mapped now, as the driver does natively, so that
            // a kernel can use it through its host pointer (unified addressing) with no
            // query first. If that fails the memory still serves copies; a device-pointer
            // query then asks again and reports the failure.
            if self.welcome.revision >= AREA_MAP_REVISION
                && ctx != 0
                && let Some(r) = self.host.find(p)
                && let Err(e) = self.map_area_alloc(&r, ctx)
            {
                tracing::debug!(
                    "remora: cuMemHostAlloc: {size} bytes at {p:#x} in the shared data area could not be mapped for the GPU now ({e})"
                );
            }
            return Ok(p);
        }
        if flags & DEVICEMAP != 0 {
            const WHAT: &str = "cuMemHostAlloc with CU_MEMHOSTALLOC_DEVICEMAP";
            let base = self.mirrored_alloc(ctx, size.max(1), true, WHAT)?;
            let view = DeviceView::Mirrored { dev: base };
            self.host.insert_device_view(base, size, flags, ctx, view);
            return Ok(base);
        }
        if self.welcome.revision < 10 || ctx == 0 {
            return self.host.alloc_private(size, flags, ctx);
        }
        let reserved = self.mirror_prop(ctx).and_then(|(_, _, granularity)| {
            self.reserve_same_address(ctx, size, granularity, "cuMemHostAlloc")
        });
        match reserved {
            Ok((base, span)) => {
                let view = DeviceView::Reserved { span };
                self.host.insert_device_view(base, size, flags, ctx, view);
                Ok(base)
            }
            Err(e) => {
                tracing::debug!(
                    "remora: cuMemHostAlloc: reserving a device address for {size} bytes failed ({e}); the memory is private to this process (not mappable)"
                );
                self.host.alloc_private(size, flags, ctx)
            }
        }
    }

    /// `cuMemHostGetDevicePointer`: the device address of page-locked host memory. Memory in
    /// the shared data area is mapped by the server, which page-locks the area with
    /// `CU_MEMHOSTREGISTER_DEVICEMAP` and asks its driver (`RM_MEM_HOST_DEVICE_POINTER`,
    /// revision 9); the registration is one range, so the answer's distance from the area's
    /// offset is kept and later pointers cost no call. Other page-locked memory gets a
    /// device copy now (`Session::mirror_host_range`): at its own address for an
    /// allocation, at a new one for a registered range.
    pub fn mem_host_device_pointer(&self, ctx: RmHandle, ptr: u64) -> CuResult<u64> {
        let r = self.host.find(ptr).ok_or(CuError(cu::INVALID_VALUE))?;
        let Some(base_off) = r.area_offset else {
            return match r.view {
                DeviceView::Mirrored { dev } => Ok(dev + (ptr - r.base)),
                DeviceView::Reserved { .. } => Ok(self.mirror_host_range(r, ctx)? + (ptr - r.base)),
                DeviceView::Private if r.registered => {
                    Ok(self.mirror_host_range(r, ctx)? + (ptr - r.base))
                }
                DeviceView::Private => {
                    tracing::warn!(
                        "remora: host memory at {ptr:#x} is private to this process (the server speaks protocol revision {}; mapping page-locked memory outside a shared data area needs 10), so cuMemHostGetDevicePointer cannot answer; returning CUDA_ERROR_NOT_SUPPORTED (allocate it with cuMemHostAlloc and CU_MEMHOSTALLOC_DEVICEMAP, or upgrade the server)",
                        self.welcome.revision
                    );
                    Err(CuError(cu::NOT_SUPPORTED))
                }
            };
        };
        self.area.as_ref().ok_or(CuError(cu::INVALID_VALUE))?;
        let offset = base_off + (ptr - r.base);
        if self.welcome.revision >= AREA_MAP_REVISION {
            // Each allocation is mapped on its own (at allocation, or now), never the whole
            // area: the answer's distance from the offset is the same for all of them.
            let known = *lock(&self.area_device_delta);
            let delta = match known {
                Some(delta) if r.area_mapped => delta,
                _ => self.map_area_alloc(&r, ctx).inspect_err(|e| {
                    tracing::warn!(
                        "remora: host memory at {ptr:#x} lies in the session's shared data area, which the server could not page-lock and map for the GPU there ({e}; past its --shm-lock-max, or cuMemHostRegister failed); cuMemHostGetDevicePointer fails"
                    );
                })?,
            };
            return Ok(offset.wrapping_add(delta));
        }
        if let Some(delta) = *lock(&self.area_device_delta) {
            return Ok(offset.wrapping_add(delta));
        }
        if self.welcome.revision < 9 {
            tracing::warn!(
                "remora: the server speaks protocol revision {} (mapped host memory needs 9); returning CUDA_ERROR_NOT_SUPPORTED",
                self.welcome.revision
            );
            return Err(CuError(cu::NOT_SUPPORTED));
        }
        let dev = Reply::value(call!(
            self.rm_mem_host_device_pointer(&RmAreaPtrArgs { ctx, offset })
        )?)?;
        self.keep_area_delta(dev, offset);
        Ok(dev)
    }

    /// Keeps the distance of the device address `dev` of area byte `offset` from it, the
    /// same for every byte of the area (once: the first answer's); returns the distance kept.
    fn keep_area_delta(&self, dev: u64, offset: u64) -> u64 {
        let mut delta = lock(&self.area_device_delta);
        *delta.get_or_insert_with(|| {
            if self
                .area
                .as_ref()
                .is_some_and(|a| !a.same_address_as_peer())
            {
                tracing::warn!(
                    "remora: the shared data area lies at another address in the server than in this process, so a host pointer handed to a kernel directly (unified addressing) does not reach it; pass the pointer cuMemHostGetDevicePointer gives"
                );
            }
            dev.wrapping_sub(offset)
        })
    }

    /// `RM_AREA_MAP` of the allocation `r` in the data area, in `ctx`: the server page-locks
    /// and maps it; returns the distance of device addresses from area offsets
    /// ([`Session::keep_area_delta`]).
    fn map_area_alloc(&self, r: &HostRange, ctx: RmHandle) -> CuResult<u64> {
        let offset = r.area_offset.ok_or(CuError(cu::INVALID_VALUE))?;
        let dev = Reply::value(call!(self.rm_area_map(&RmAreaMapArgs {
            ctx,
            offset,
            size: r.size.max(1),
        }))?)?;
        self.host.set_area_mapped(r.base);
        Ok(self.keep_area_delta(dev, offset))
    }

    /// `CU_POINTER_ATTRIBUTE_DEVICE_POINTER` of host memory: as
    /// [`Session::mem_host_device_pointer`], except that an allocation whose address is
    /// reserved on the device answers that address without making its device copy
    /// (`cudaPointerGetAttributes`, which PyTorch calls on every pinned tensor, asks for it).
    pub fn mem_host_device_address(&self, ctx: RmHandle, ptr: u64) -> CuResult<u64> {
        match self.host.find(ptr) {
            Some(r) if matches!(r.view, DeviceView::Reserved { .. }) => Ok(ptr),
            _ => self.mem_host_device_pointer(ctx, ptr),
        }
    }

    /// `cuMemFreeHost`. Natively it synchronizes the device first; for an allocation in the
    /// data area that matters, because the space may be handed out again at once: its
    /// context is synchronized first, so that no copy into it is still in flight.
    pub fn mem_free_host(&self, ptr: u64) -> CuResult<()> {
        let Some(r) = self.host.find(ptr).filter(|r| r.base == ptr) else {
            self.deliver_pending("cuMemFreeHost");
            return self.host.free(ptr);
        };
        match r.view {
            DeviceView::Reserved { span } => {
                self.deliver_pending("cuMemFreeHost");
                self.host.free(ptr)?;
                return self.release_same_address(r.ctx, ptr, r.size, span);
            }
            DeviceView::Mirrored { dev } => {
                self.deliver_pending("cuMemFreeHost");
                self.host.free(ptr)?;
                return match self.mem_free_mirrored(dev, true) {
                    Some(res) => res,
                    // Its context was destroyed, which freed it.
                    None => {
                        tracing::debug!(
                            "remora: mapped host memory {ptr:#x} of context {} went with it",
                            r.ctx
                        );
                        Ok(())
                    }
                };
            }
            DeviceView::Private => {}
        }
        if r.area_offset.is_some()
            && r.ctx != 0
            && let Err(e) = self.ctx_synchronize(r.ctx)
        {
            tracing::debug!("remora: cuMemFreeHost: synchronizing the context failed: {e}");
        }
        self.deliver_pending("cuMemFreeHost");
        self.host.free(ptr)
    }

    /// `cuMemHostUnregister`: like the native call, waits for the asynchronous copies still
    /// pending (their bytes land before the memory stops being registered).
    /// A registered range that was given a device copy loses it.
    pub fn mem_host_unregister(&self, ptr: u64) -> CuResult<()> {
        self.deliver_pending("cuMemHostUnregister");
        let view = self
            .host
            .find(ptr)
            .filter(|r| r.base == ptr)
            .map(|r| r.view);
        self.host.unregister(ptr)?;
        if let Some(DeviceView::Mirrored { dev }) = view
            && let Some(Err(e)) = self.mem_free_mirrored(dev, true)
        {
            tracing::debug!(
                "remora: cuMemHostUnregister: freeing the device copy of {ptr:#x} failed: {e}"
            );
        }
        Ok(())
    }

    /// Synchronizes every context with asynchronous copies pending, so that their bytes are
    /// written before host memory goes away (`cuMemFreeHost`, `cuMemHostUnregister`, which
    /// synchronize natively).
    fn deliver_pending(&self, what: &str) {
        for ctx in self.delivery.pending_in(None) {
            if let Err(e) = self.ctx_synchronize(ctx) {
                tracing::debug!("remora: {what}: synchronizing context {ctx} failed: {e}");
            }
        }
    }
}
