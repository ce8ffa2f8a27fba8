//! [`Session`] methods for stream-ordered allocation and memory pools (revision 10):
//! `cuMemAllocAsync`, `cuMemAllocFromPoolAsync`, `cuMemFreeAsync`, the device pool queries and
//! the `cuMemPool*` calls. Pools are session handles of the server.
//!
//! The allocation is a replying call (it answers the pointer, whose range is then reserved in
//! this process, as for `cuMemAlloc`); so is the free, whose status the program gets at once.
//! Both stay ordered on their stream on the server. Pools that export shareable handles, and
//! the export and import calls of pools and pool pointers, are not carried (IPC between
//! processes of the client's host cannot reach the server's GPU memory).

use super::*;

/// `CU_MEM_HANDLE_TYPE_NONE`.
const HANDLE_TYPE_NONE: i32 = 0;

impl Session {
    /// `cuMemAllocAsync` (`pool` 0: the current pool of the stream's device) or
    /// `cuMemAllocFromPoolAsync` on protocol stream `stream` of context `ctx`: the device
    /// address, with the same range reserved in this process.
    pub fn mem_alloc_async(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        bytesize: u64,
        pool: RmHandle,
    ) -> CuResult<u64> {
        self.need_revision(
            10,
            if pool == 0 {
                "cuMemAllocAsync"
            } else {
                "cuMemAllocFromPoolAsync"
            },
        )?;
        if bytesize == 0 {
            return Err(CuError(cu::INVALID_VALUE));
        }
        self.alloc_reserved(
            ctx,
            || {
                let ptr = Reply::value(call!(self.rm_mem_alloc_async(&RmAllocAsyncArgs {
                    ctx,
                    stream,
                    bytesize,
                    pool
                }))?)?;
                Ok((ptr, bytesize, ()))
            },
            super::memory::Reserved::Alloc,
        )
        .map(|(ptr, ())| {
            if self.stream_may_capture(stream) {
                self.note_stream_alloc(stream, ptr);
            } else {
                lock(&self.stream_allocs).insert(ptr, ctx);
            }
            ptr
        })
    }

    /// `cuMemFreeAsync` on protocol stream `stream` of context `ctx`: frees on the server (in
    /// stream order there), then releases the reservation. A live stream-ordered allocation
    /// of this session freed on a stream that is not capturing goes one-way to a server of
    /// revision 21, its error kept for the next synchronizing call as a launch's is (the
    /// pointer is known good; what could fail is the stream); anything else waits for the
    /// server's verdict. Why: a free that waits for its reply also waits for every one-way
    /// call queued before it to be made, 44-71 µs a free in pool_probe on the H200 against
    /// 1.6-2.1 natively, and PyTorch's `cudaMallocAsync` allocator frees every tensor so.
    pub fn mem_free_async(&self, ctx: RmHandle, stream: RmHandle, ptr: u64) -> CuResult<()> {
        self.need_revision(10, "cuMemFreeAsync")?;
        let args = RmFreeAsyncArgs { ctx, stream, ptr };
        let live = lock(&self.stream_allocs).remove(&ptr).is_some();
        if live && self.welcome.revision >= ONEWAY_FREE_REVISION && !self.stream_may_capture(stream)
        {
            // The reservation goes first: once the free is sent, the pool may hand the same
            // address to another thread's allocation, whose reservation must not meet ours.
            // (A live allocation was made outside a capture: never a graph allocation.)
            self.va.release(ptr);
            call!(self.rm_mem_free_async_oneway(&args))?;
            return Ok(());
        }
        CuError::check(call!(self.rm_mem_free_async(&args))?)?;
        if !self.is_graph_alloc(ptr) {
            self.va.release(ptr);
        }
        Ok(())
    }

    /// `cuDeviceGetDefaultMemPool`: the session's handle of the device's default pool.
    pub fn device_get_default_mem_pool(&self, dev: DeviceHandle) -> CuResult<RmHandle> {
        self.need_revision(10, "cuDeviceGetDefaultMemPool")?;
        self.check_device(dev)?;
        Reply::value(call!(self.rm_device_get_default_mem_pool(&dev))?)
    }

    /// `cuDeviceGetMemPool`: the session's handle of the device's current pool.
    pub fn device_get_mem_pool(&self, dev: DeviceHandle) -> CuResult<RmHandle> {
        self.need_revision(10, "cuDeviceGetMemPool")?;
        self.check_device(dev)?;
        Reply::value(call!(self.rm_device_get_mem_pool(&dev))?)
    }

    /// `cuDeviceSetMemPool`.
    pub fn device_set_mem_pool(&self, dev: DeviceHandle, pool: RmHandle) -> CuResult<()> {
        self.need_revision(10, "cuDeviceSetMemPool")?;
        self.check_device(dev)?;
        CuError::check(call!(
            self.rm_device_set_mem_pool(&RmDevicePoolArgs { device: dev, pool })
        )?)
    }

    /// `cuMemPoolCreate`. Pools that export shareable handles are refused here
    /// (CUDA_ERROR_NOT_SUPPORTED, logged): Remora does not carry IPC of pools.
    pub fn mem_pool_create(&self, props: &RmPoolProps) -> CuResult<RmHandle> {
        self.need_revision(10, "cuMemPoolCreate")?;
        if props.handle_types != HANDLE_TYPE_NONE {
            tracing::warn!(
                "remora: cuMemPoolCreate with handle types {:#x}: pools that export shareable handles (IPC) are not carried by Remora; returning CUDA_ERROR_NOT_SUPPORTED",
                props.handle_types
            );
            return Err(CuError(cu::NOT_SUPPORTED));
        }
        Reply::value(call!(self.rm_mem_pool_create(props))?)
    }

    revision_calls! {
        /// `cuMemPoolDestroy`.
        mem_pool_destroy(pool: RmHandle) -> ()
            = 10, "cuMemPoolDestroy": CuError::check, rm_mem_pool_destroy(&pool);
        /// `cuMemPoolSetAttribute`: `value` is 0 or 1 for the reuse flags (attributes 1 to 3),
        /// the `cuuint64_t` value for the others.
        mem_pool_set_attribute(pool: RmHandle, attribute: i32, value: u64) -> ()
            = 10, "cuMemPoolSetAttribute": CuError::check,
            rm_mem_pool_set_attribute(&RmPoolAttrArgs { pool, attribute, value });
        /// `cuMemPoolGetAttribute`, widened to 64 bits.
        mem_pool_get_attribute(pool: RmHandle, attribute: i32) -> u64
            = 10, "cuMemPoolGetAttribute": Reply::value,
            rm_mem_pool_get_attribute(&RmPoolAttrArgs { pool, attribute, value: 0 });
        /// `cuMemPoolTrimTo`.
        mem_pool_trim_to(pool: RmHandle, keep: u64) -> ()
            = 10, "cuMemPoolTrimTo": CuError::check,
            rm_mem_pool_trim_to(&RmPoolTrimArgs { pool, keep });
        /// `cuMemPoolGetAccess`: the `CUmemAccess_flags` of `location`.
        mem_pool_get_access(pool: RmHandle, location: RmPoolLocation) -> i32
            = 10, "cuMemPoolGetAccess": Reply::value,
            rm_mem_pool_get_access(&RmPoolGetAccessArgs { pool, location });
    }

    /// `cuMemPoolSetAccess`: at most `RM_MAX_POOL_ACCESS` descriptors in one call (more are
    /// sent in several).
    pub fn mem_pool_set_access(&self, pool: RmHandle, map: &[RmPoolAccess]) -> CuResult<()> {
        self.need_revision(10, "cuMemPoolSetAccess")?;
        for part in map.chunks(RM_MAX_POOL_ACCESS as usize) {
            CuError::check(call!(self.rm_mem_pool_set_access(&RmPoolSetAccessArgs {
                pool,
                map: part.to_vec()
            }))?)?;
        }
        Ok(())
    }
}
