//! Procedures on device allocations.

use super::*;
use remora_proto::cuda::{CuError, cu};

impl Executor {
    /// Runs `alloc` with `bytes` of device memory charged to the session first (refused
    /// past its limits, [`crate::quota`]); the charge is taken back if `alloc` fails.
    pub(super) fn charged<T>(
        &self,
        session: &Session,
        bytes: u64,
        what: &str,
        alloc: impl FnOnce() -> CuResult<T>,
    ) -> CuResult<T> {
        session.charge(crate::quota::Kind::DeviceMemory, bytes, what)?;
        let r = alloc();
        if r.is_err() {
            session.uncharge(crate::quota::Kind::DeviceMemory, bytes);
        }
        r
    }

    pub(super) fn mem_alloc(&self, session: &Session, a: RmAllocArgs) -> RmU64Reply {
        let r = self.charged(session, a.bytesize, "RM_MEM_ALLOC", || {
            self.in_ctx(session, a.ctx, |b, c| b.mem_alloc(c, a.bytesize))
        });
        if let Ok(ptr) = r {
            session.lock().ranges.insert(
                ptr,
                Range {
                    size: a.bytesize,
                    ctx: a.ctx,
                    kind: RangeKind::Alloc,
                },
            );
        }
        u64_reply("RM_MEM_ALLOC", r)
    }

    pub(super) fn mem_alloc_pitch(&self, session: &Session, a: RmAllocPitchArgs) -> RmPitchedReply {
        let asked = a.width_bytes.saturating_mul(a.height);
        let r = self.charged(session, asked, "RM_MEM_ALLOC_PITCH", || {
            self.in_ctx(session, a.ctx, |b, c| {
                b.mem_alloc_pitch(c, a.width_bytes, a.height, a.element_size)
            })
        });
        let r = r.map(|(ptr, pitch)| {
            // The rows' padding is the session's too.
            let size = pitch.saturating_mul(a.height);
            session.charge_made(crate::quota::Kind::DeviceMemory, size.saturating_sub(asked));
            session.lock().ranges.insert(
                ptr,
                Range {
                    size,
                    ctx: a.ctx,
                    kind: RangeKind::Alloc,
                },
            );
            RmPitched { ptr, pitch }
        });
        reply!("RM_MEM_ALLOC_PITCH", RmPitchedReply, r)
    }

    pub(super) fn mem_free(&self, session: &Session, a: RmPtrArgs) -> CuResult_ {
        let mut st = session.lock();
        // A stream-ordered allocation may be freed with cuMemFree too, as natively.
        let r = match st.ranges.get(&a.ptr).copied() {
            Some(
                r @ Range {
                    kind: RangeKind::Alloc | RangeKind::StreamOrdered | RangeKind::GraphMem,
                    ..
                },
            ) => st.ctx(r.ctx),
            _ => Err(CuError(cu::INVALID_VALUE)),
        };
        let r = r.and_then(|c| self.inner.backend.mem_free(c, a.ptr));
        if r.is_ok() {
            st.range_freed(a.ptr);
        }
        code("RM_MEM_FREE", r)
    }

    pub(super) fn mem_get_info(&self, session: &Session, h: RmHandle) -> RmMemInfoReply {
        let r = self.in_ctx(session, h, |b, c| b.mem_get_info(c));
        let r = r.map(|(free_bytes, total_bytes)| RmMemInfo {
            free_bytes,
            total_bytes,
        });
        reply!("RM_MEM_GET_INFO", RmMemInfoReply, r)
    }

    pub(super) fn mem_get_address_range(&self, session: &Session, a: RmPtrArgs) -> RmRangeReply {
        let st = session.lock();
        let r = st.ctx(a.ctx).and_then(|_| st.range_of(a.ptr));
        let r = r.map(|(base, r)| RmRange { base, size: r.size });
        reply!("RM_MEM_GET_ADDRESS_RANGE", RmRangeReply, r)
    }
}
