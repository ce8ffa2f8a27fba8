//! Procedures of virtual memory management (revision 10): physical allocations
//! (`cuMemCreate`), reserved address ranges, mappings and access.
//!
//! The session lock is held across each driver call: these calls are short, and the checks
//! (a range inside one of the session's own reservations, a handle of the session) must still
//! hold when the driver acts on them.

use super::*;

/// The raw context of a virtual-memory call's context handle; 0 (the caller had no current
/// context, which these calls allow) stays 0.
fn vmm_ctx(st: &SessionState, h: RmHandle) -> CuResult<u64> {
    if h == 0 { Ok(0) } else { st.ctx(h) }
}

impl SessionState {
    /// The driver's handle behind memory handle `h`.
    fn mem_handle(&self, h: RmHandle) -> CuResult<u64> {
        match self.get(h)? {
            Resource::MemHandle { raw, .. } => Ok(*raw),
            _ => Err(CuError(cu::INVALID_HANDLE)),
        }
    }

    /// Checks that `[ptr, ptr + size)` (non-empty) lies inside one reservation of the session.
    fn check_reserved(&self, ptr: u64, size: u64) -> CuResult<()> {
        match self.ranges.range(..=ptr).next_back() {
            Some((b, r))
                if r.kind == RangeKind::Reservation
                    && size > 0
                    && ptr.checked_add(size).is_some_and(|e| e <= b + r.size) =>
            {
                Ok(())
            }
            _ => Err(CuError(cu::INVALID_VALUE)),
        }
    }

    /// Whether `ptr` lies inside one of the session's mappings.
    fn is_mapped(&self, ptr: u64) -> bool {
        self.mappings
            .range(..=ptr)
            .next_back()
            .is_some_and(|(b, size)| ptr < b + size)
    }
}

impl Executor {
    fn backend(&self) -> &dyn Backend {
        &*self.inner.backend
    }

    pub(super) fn mem_create(&self, session: &Session, a: RmMemCreateArgs) -> RmHandleReply {
        let r = self.charged(session, a.size, "RM_MEM_CREATE", || {
            let st = session.lock();
            vmm_ctx(&st, a.ctx).and_then(|c| self.backend().mem_create(c, a.size, &a.prop, a.flags))
        });
        let mut st = session.lock();
        let r = r.map(|raw| {
            st.insert(Resource::MemHandle {
                raw,
                refs: 1,
                size: a.size,
            })
        });
        handle_reply("RM_MEM_CREATE", r)
    }

    pub(super) fn mem_release(&self, st: &mut SessionState, a: RmMemHandleArgs) -> CuResult<()> {
        let c = vmm_ctx(st, a.ctx)?;
        self.backend().mem_release(c, st.mem_handle(a.handle)?)?;
        if let Ok(Resource::MemHandle { refs, .. }) = st.get_mut(a.handle) {
            *refs -= 1;
            if *refs == 0 {
                st.remove(a.handle);
            }
        }
        Ok(())
    }

    pub(super) fn mem_address_reserve(&self, session: &Session, a: RmMemReserveArgs) -> RmU64Reply {
        let mut st = session.lock();
        let r = vmm_ctx(&st, a.ctx).and_then(|c| self.backend().mem_address_reserve(c, &a));
        if let Ok(ptr) = r {
            st.ranges.insert(
                ptr,
                Range {
                    size: a.size,
                    ctx: a.ctx,
                    kind: RangeKind::Reservation,
                },
            );
        }
        u64_reply("RM_MEM_ADDRESS_RESERVE", r)
    }

    pub(super) fn mem_address_free(&self, session: &Session, a: RmMemRangeArgs) -> i32 {
        let mut st = session.lock();
        let r = match st.ranges.get(&a.ptr) {
            Some(r) if r.kind == RangeKind::Reservation && r.size == a.size => vmm_ctx(&st, a.ctx),
            _ => Err(CuError(cu::INVALID_VALUE)),
        };
        let r = r.and_then(|c| self.backend().mem_address_free(c, a.ptr, a.size));
        if r.is_ok() {
            st.ranges.remove(&a.ptr);
            let end = a.ptr.saturating_add(a.size);
            st.mappings.retain(|b, _| !(a.ptr..end).contains(b));
        }
        code("RM_MEM_ADDRESS_FREE", r)
    }

    pub(super) fn mem_map(&self, st: &mut SessionState, a: RmMemMapArgs) -> CuResult<()> {
        st.check_reserved(a.ptr, a.size)?;
        let raw = st.mem_handle(a.handle)?;
        let c = vmm_ctx(st, a.ctx)?;
        self.backend().mem_map(c, &a, raw)?;
        st.mappings.insert(a.ptr, a.size);
        Ok(())
    }

    pub(super) fn mem_unmap(&self, st: &mut SessionState, a: RmMemRangeArgs) -> CuResult<()> {
        st.check_reserved(a.ptr, a.size)?;
        let c = vmm_ctx(st, a.ctx)?;
        self.backend().mem_unmap(c, a.ptr, a.size)?;
        let end = a.ptr + a.size;
        st.mappings.retain(|b, _| !(a.ptr..end).contains(b));
        Ok(())
    }

    pub(super) fn mem_set_access(&self, session: &Session, a: RmMemSetAccessArgs) -> i32 {
        let st = session.lock();
        let r = st
            .check_reserved(a.ptr, a.size)
            .and_then(|()| vmm_ctx(&st, a.ctx))
            .and_then(|c| self.backend().mem_set_access(c, a.ptr, a.size, &a.desc));
        code("RM_MEM_SET_ACCESS", r)
    }

    pub(super) fn mem_get_access(&self, session: &Session, a: RmMemGetAccessArgs) -> RmU64Reply {
        let st = session.lock();
        let r = st
            .check_reserved(a.ptr, 1)
            .and_then(|()| vmm_ctx(&st, a.ctx))
            .and_then(|c| {
                self.backend()
                    .mem_get_access(c, a.ptr, (a.location_type, a.location_id))
            });
        u64_reply("RM_MEM_GET_ACCESS", r)
    }

    pub(super) fn mem_get_granularity(
        &self,
        session: &Session,
        a: RmMemGranularityArgs,
    ) -> RmU64Reply {
        let r = vmm_ctx(&session.lock(), a.ctx)
            .and_then(|c| self.backend().mem_get_granularity(c, &a.prop, a.option));
        u64_reply("RM_MEM_GET_GRANULARITY", r)
    }

    pub(super) fn mem_get_properties(
        &self,
        st: &SessionState,
        a: RmMemHandleArgs,
    ) -> CuResult<RmMemProp> {
        let raw = st.mem_handle(a.handle)?;
        self.backend().mem_get_properties(vmm_ctx(st, a.ctx)?, raw)
    }

    pub(super) fn mem_retain_handle(
        &self,
        st: &mut SessionState,
        a: RmPtrArgs,
    ) -> CuResult<RmHandle> {
        if !st.is_mapped(a.ptr) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let raw = self
            .backend()
            .mem_retain_handle(vmm_ctx(st, a.ctx)?, a.ptr)?;
        Ok(st.retain_mem_handle(raw))
    }
}
