//! Procedures of stream-ordered allocation and memory pools (revision 10): `cuMemAllocAsync`,
//! `cuMemFreeAsync`, `cuMemAllocFromPoolAsync`, the device pool queries and the `cuMemPool*`
//! calls. Pools are session handles ([`Resource::MemPool`]); every stream-ordered allocation is
//! a session range ([`RangeKind::StreamOrdered`]) so copies into it pass the bounds check.

use super::*;
use crate::backend::pools::PoolProps;
use remora_proto::cuda::{CuError, cu};
use remora_proto::pool_access;

impl Executor {
    pub(super) fn mem_alloc_async(&self, session: &Session, a: RmAllocAsyncArgs) -> RmU64Reply {
        let resolved = {
            let st = session.lock();
            stream_target(&st, a.ctx, a.stream).and_then(|t| {
                let pool = match a.pool {
                    0 => None,
                    h => Some(st.mem_pool(h)?),
                };
                Ok((t, pool))
            })
        };
        let r = self.charged(session, a.bytesize, "RM_MEM_ALLOC_ASYNC", || {
            resolved.and_then(|(t, pool)| {
                let ptr = self
                    .inner
                    .backend
                    .mem_alloc_async(t.ctx, t.stream, a.bytesize, pool)?;
                Ok((ptr, t.ctx_handle))
            })
        });
        let r = r.map(|(ptr, ctx)| {
            let mut st = session.lock();
            // Captured, the allocation is a graph memory node: the address is the graph's.
            match self.capturing_graph(&st, a.ctx, a.stream) {
                Some(graph) => {
                    // A graph's memory is the driver's to manage: not counted.
                    session.uncharge(crate::quota::Kind::DeviceMemory, a.bytesize);
                    st.add_graph_mem(ptr, a.bytesize, ctx, graph)
                }
                None => {
                    st.ranges.insert(
                        ptr,
                        Range {
                            size: a.bytesize,
                            ctx,
                            kind: RangeKind::StreamOrdered,
                        },
                    );
                }
            }
            ptr
        });
        u64_reply("RM_MEM_ALLOC_ASYNC", r)
    }

    pub(super) fn mem_free_async(&self, session: &Session, a: RmFreeAsyncArgs) -> CuResult_ {
        code("RM_MEM_FREE_ASYNC", self.free_async(session, &a))
    }

    /// `RM_MEM_FREE_ASYNC_ONEWAY` (revision 21): the same free, its error kept for the next
    /// synchronizing call.
    pub(super) fn mem_free_async_oneway(
        &self,
        call: &CallContext,
        a: RmFreeAsyncArgs,
    ) -> ProcResult<()> {
        self.oneway_on(
            call,
            "RM_MEM_FREE_ASYNC_ONEWAY",
            Some((a.ctx, a.stream)),
            |_, session| self.free_async(session, &a),
        )
    }

    /// `cuMemFreeAsync` of `a.ptr` on `a.stream`, and the session's record of the range.
    fn free_async(&self, session: &Session, a: &RmFreeAsyncArgs) -> CuResult<()> {
        // The lock is held across the (non-blocking) driver call, as for RM_MEM_FREE: two
        // threads freeing one pointer must not both reach the driver.
        let mut st = session.lock();
        let r = stream_target(&st, a.ctx, a.stream).and_then(|t| {
            match st.ranges.get(&a.ptr) {
                // cuMemAlloc memory too: the driver accepts it (cuSPARSE frees some of its
                // buffers so) and decides.
                Some(r)
                    if matches!(
                        r.kind,
                        RangeKind::StreamOrdered | RangeKind::Alloc | RangeKind::GraphMem
                    ) => {}
                _ => return Err(CuError(cu::INVALID_VALUE)),
            }
            self.inner.backend.mem_free_async(t.ctx, t.stream, a.ptr)
        });
        if r.is_ok() {
            // Captured, the free is a graph memory node: the graph keeps the address.
            match self.capturing_graph(&st, a.ctx, a.stream) {
                Some(graph) if st.is_graph_mem(a.ptr) => {
                    st.graph_mem_freed_by_node(a.ptr, graph);
                }
                _ => st.range_freed(a.ptr),
            }
        }
        r
    }

    /// The graph handle stream (`ctx`, `stream`) is capturing into, if it is capturing
    /// (asks the driver only while the session has a capture in progress).
    fn capturing_graph(&self, st: &SessionState, ctx: RmHandle, stream: RmHandle) -> Option<u64> {
        if st.captures.is_empty() {
            return None;
        }
        let t = stream_target(st, ctx, stream).ok()?;
        let info = self
            .inner
            .backend
            .stream_capture_info(t.ctx, t.stream)
            .ok()?;
        (info.status == crate::backend::capture_status::ACTIVE)
            .then(|| st.capture_graph_handle(info.id))
            .flatten()
    }

    /// The session handle of the pool `get(backend, device)` answers.
    fn device_pool(
        &self,
        session: &Session,
        what: &str,
        dev: i32,
        get: impl FnOnce(&dyn Backend, i32) -> CuResult<u64>,
    ) -> RmHandleReply {
        let r = self
            .inner
            .check_device(dev)
            .and_then(|()| get(&*self.inner.backend, dev))
            .map(|raw| session.lock().pool_handle(raw));
        handle_reply(what, r)
    }

    pub(super) fn device_get_default_mem_pool(&self, session: &Session, dev: i32) -> RmHandleReply {
        self.device_pool(session, "RM_DEVICE_GET_DEFAULT_MEM_POOL", dev, |b, d| {
            b.device_get_default_mem_pool(d)
        })
    }

    pub(super) fn device_get_mem_pool(&self, session: &Session, dev: i32) -> RmHandleReply {
        self.device_pool(session, "RM_DEVICE_GET_MEM_POOL", dev, |b, d| {
            b.device_get_mem_pool(d)
        })
    }

    /// [`Executor::resolved`] once `dev` is checked to name a device.
    pub(super) fn resolved_on_device<X, T>(
        &self,
        session: &Session,
        dev: i32,
        resolve: impl FnOnce(&SessionState) -> CuResult<X>,
        run: impl FnOnce(&dyn Backend, X) -> CuResult<T>,
    ) -> CuResult<T> {
        self.inner
            .check_device(dev)
            .and_then(|()| self.resolved(session, resolve, run))
    }

    pub(super) fn mem_pool_create(
        &self,
        call: &CallContext,
        a: RmPoolProps,
    ) -> ProcResult<RmHandleReply> {
        if a.handle_types != 0 {
            tracing::warn!(
                handle_types = a.handle_types,
                "remora: cuMemPoolCreate of a pool that exports shareable handles: IPC of memory pools is not carried by Remora; returning CUDA_ERROR_NOT_SUPPORTED"
            );
            return Ok(handle_reply(
                "RM_MEM_POOL_CREATE",
                Err(CuError(cu::NOT_SUPPORTED)),
            ));
        }
        let session = self.session(call);
        let r = u16::try_from(a.usage)
            .map_err(|_| CuError(cu::INVALID_VALUE))
            .and_then(|usage| {
                self.inner.backend.mem_pool_create(&PoolProps {
                    alloc_type: a.alloc_type,
                    location: pool_access::location_to_abi(&a.location),
                    max_size: a.max_size,
                    usage,
                })
            })
            .map(|raw| {
                session
                    .lock()
                    .insert(Resource::MemPool { raw, created: true })
            });
        Ok(handle_reply("RM_MEM_POOL_CREATE", r))
    }

    pub(super) fn mem_pool_destroy(&self, session: &Session, h: RmHandle) -> CuResult_ {
        let mut st = session.lock();
        let r = match st.get(h) {
            Ok(Resource::MemPool {
                raw, created: true, ..
            }) => {
                let raw = *raw;
                let r = self.inner.backend.mem_pool_destroy(raw);
                if r.is_ok() {
                    st.remove(h);
                }
                r
            }
            // A device's default pool (or one the session did not make): natively the
            // default pool cannot be destroyed.
            Ok(Resource::MemPool { .. }) => Err(CuError(cu::INVALID_VALUE)),
            _ => Err(CuError(cu::INVALID_HANDLE)),
        };
        code("RM_MEM_POOL_DESTROY", r)
    }
}
