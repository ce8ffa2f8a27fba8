//! The session's memory pools and stream-ordered allocations: pool handles and their cleanup.
//!
//! A pool handle names a [`Resource::MemPool`]. Pools the session created are destroyed when
//! it ends; a device's default or current pool gets a handle the first time the session asks
//! (the same backend pool always the same handle) and is never destroyed by Remora. Every
//! stream-ordered allocation is a [`Range`] of kind [`RangeKind::StreamOrdered`]; those still
//! allocated when their context goes, or the session ends, are freed with `cuMemFree` after a
//! context synchronize (the frees of the program may still be queued), before the pools.

use remora_proto::cuda::{CuError, CuResult, cu};

use super::{RangeKind, Resource, SessionState};
use crate::backend::Backend;

impl SessionState {
    /// The backend pool of pool handle `h`.
    pub(crate) fn mem_pool(&self, h: u64) -> CuResult<u64> {
        match self.get(h)? {
            Resource::MemPool { raw, .. } => Ok(*raw),
            _ => Err(CuError(cu::INVALID_HANDLE)),
        }
    }

    /// The handle of backend pool `raw`: the one it has, else a new one that the session
    /// does not own.
    pub(crate) fn pool_handle(&mut self, raw: u64) -> u64 {
        let known = self.table.iter().find_map(|(h, r)| match r {
            Resource::MemPool { raw: p, .. } if *p == raw => Some(*h),
            _ => None,
        });
        known.unwrap_or_else(|| {
            self.insert(Resource::MemPool {
                raw,
                created: false,
            })
        })
    }

    /// Frees the stream-ordered allocations of context handle `ctx` (backend context
    /// `raw_ctx`), after synchronizing it; answers how many it freed.
    pub(crate) fn free_stream_ordered(
        &mut self,
        backend: &dyn Backend,
        ctx: u64,
        raw_ctx: u64,
    ) -> u32 {
        let left = self.ranges_of(ctx, RangeKind::StreamOrdered);
        if left.is_empty() {
            return 0;
        }
        let n = u32::try_from(left.len()).unwrap_or(u32::MAX);
        if let Err(e) = backend.ctx_synchronize(raw_ctx) {
            tracing::debug!(
                error = e.0,
                "cleanup: synchronizing before freeing stream-ordered allocations failed"
            );
        }
        for ptr in left {
            self.remove_range(ptr);
            if let Err(e) = backend.mem_free(raw_ctx, ptr) {
                tracing::debug!(
                    ptr,
                    error = e.0,
                    "cleanup: cuMemFree of a stream-ordered allocation refused"
                );
            }
        }
        n
    }

    /// At session end: every stream-ordered allocation left, then the pools the session
    /// created (contexts are still alive).
    pub(crate) fn release_pools(&mut self, backend: &dyn Backend) {
        let mut contexts: Vec<u64> = self
            .ranges
            .values()
            .filter(|r| r.kind == RangeKind::StreamOrdered)
            .map(|r| r.ctx)
            .collect();
        contexts.sort_unstable();
        contexts.dedup();
        for ctx in contexts {
            match self.ctx(ctx) {
                Ok(raw) => {
                    let t0 = std::time::Instant::now();
                    let n = self.free_stream_ordered(backend, ctx, raw);
                    self.free_times
                        .add(super::FreePart::StreamOrdered, n, t0.elapsed());
                }
                // Its context is gone (and its memory with it).
                Err(_) => self
                    .ranges
                    .retain(|_, r| !(r.ctx == ctx && r.kind == RangeKind::StreamOrdered)),
            }
        }
        let mut pools: Vec<(u64, u64, bool)> = self
            .table
            .iter()
            .filter_map(|(h, r)| match r {
                Resource::MemPool { raw, created, .. } => Some((*h, *raw, *created)),
                _ => None,
            })
            .collect();
        pools.sort_unstable();
        for (h, raw, created) in pools {
            self.remove(h);
            if created {
                let t0 = std::time::Instant::now();
                let rc = backend.mem_pool_destroy(raw);
                self.free_times.add(super::FreePart::Pools, 1, t0.elapsed());
                if let Err(e) = rc {
                    tracing::debug!(handle = h, error = e.0, "cleanup: cuMemPoolDestroy refused");
                }
            }
        }
    }
}
