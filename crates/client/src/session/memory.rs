//! [`Session`] methods for device allocations, host memory, pointer kinds and unified
//! addressing.

use super::*;
use crate::vaspace::ReserveError;

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
        // Mapped host memory of a socket session lies in a device reservation too, but it
        // is host memory to the program.
        if self.mirrors.active()
            && let Some(r) = self.host.find(ptr).filter(|r| r.mirrored)
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

    /// `cuMemHostAlloc`. With `CU_MEMHOSTALLOC_DEVICEMAP`, memory that does not lie in the
    /// shared data area (a socket session, or a full area) is mapped host memory built like
    /// managed memory: device memory on the server at the same address as host pages here,
    /// made coherent at launches and synchronizations (the `mirror` module). Other allocations
    /// come from [`HostMem::alloc`].
    pub fn mem_host_alloc(&self, ctx: RmHandle, size: u64, flags: u32) -> CuResult<u64> {
        const DEVICEMAP: u32 = 0x2;
        if flags & DEVICEMAP == 0 {
            return self.host.alloc(size, flags, ctx);
        }
        if self.area.is_some() {
            // In the area when it has room; private memory (which the GPU cannot reach) is
            // given back for a mirror.
            let p = self.host.alloc(size, flags, ctx)?;
            if self.host.find(p).is_some_and(|r| r.area_offset.is_some()) {
                return Ok(p);
            }
            self.host.free(p)?;
        }
        let base = self.mirrored_alloc(
            ctx,
            size.max(1),
            true,
            "cuMemHostAlloc with CU_MEMHOSTALLOC_DEVICEMAP",
        )?;
        self.host.insert_mirrored(base, size, flags, ctx);
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            tracing::info!(
                "remora: mapped host memory outside a shared data area is emulated: the server keeps a device copy, made coherent before launches and copies and after synchronizations (each costs a comparison and copies of the mapped bytes; see docs/architecture.md)"
            );
        });
        Ok(base)
    }

    /// `cuMemHostGetDevicePointer` (and the DEVICE_POINTER attribute of host memory): the
    /// device address of mapped host memory. Only host memory in the shared data area can be
    /// mapped — the server page-locks the area with `CU_MEMHOSTREGISTER_DEVICEMAP` and asks
    /// its driver (`RM_MEM_HOST_DEVICE_POINTER`, revision 9); the registration is one range,
    /// so the answer's distance from the area's offset is kept and later pointers cost no
    /// call. Other host memory lives only in this process, which the remote GPU cannot
    /// reach: CUDA_ERROR_NOT_SUPPORTED, logged.
    pub fn mem_host_device_pointer(&self, ctx: RmHandle, ptr: u64) -> CuResult<u64> {
        let r = self.host.find(ptr).ok_or(CuError(cu::INVALID_VALUE))?;
        if r.mirrored {
            // Mapped host memory of a socket session: the same address on both sides.
            return Ok(ptr);
        }
        let (Some(area), Some(base_off)) = (self.area.as_ref(), r.area_offset) else {
            tracing::warn!(
                "remora: host memory at {ptr:#x} was not allocated mapped (over a socket session only cuMemHostAlloc with CU_MEMHOSTALLOC_DEVICEMAP, cudaHostAlloc with cudaHostAllocMapped, gives the remote GPU a view of host memory; memory from cudaMallocHost or cuMemHostRegister is not mapped there), so cuMemHostGetDevicePointer cannot answer; returning CUDA_ERROR_NOT_SUPPORTED"
            );
            return Err(CuError(cu::NOT_SUPPORTED));
        };
        let offset = base_off + (ptr - r.base);
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
        if !area.same_address_as_peer() {
            tracing::warn!(
                "remora: the shared data area lies at another address in the server than in this process, so a host pointer handed to a kernel directly (unified addressing) does not reach it; pass the pointer cuMemHostGetDevicePointer gives"
            );
        }
        *lock(&self.area_device_delta) = Some(dev.wrapping_sub(offset));
        Ok(dev)
    }

    /// `cuMemFreeHost`. Natively it synchronizes the device first; for an allocation in the
    /// data area that matters, because the space may be handed out again at once: its
    /// context is synchronized first, so that no copy into it is still in flight.
    pub fn mem_free_host(&self, ptr: u64) -> CuResult<()> {
        if let Some(r) = self.host.find(ptr).filter(|r| r.base == ptr && r.mirrored) {
            self.deliver_pending("cuMemFreeHost");
            self.host.free(ptr)?;
            return match self.mem_free_mirrored(ptr, true) {
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
        if let Some(r) = self.host.find(ptr).filter(|r| r.base == ptr)
            && r.area_offset.is_some()
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
    pub fn mem_host_unregister(&self, ptr: u64) -> CuResult<()> {
        self.deliver_pending("cuMemHostUnregister");
        self.host.unregister(ptr)
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
