//! [`Session`] methods for virtual memory management (revision 10): physical allocations,
//! reserved address ranges, mappings and access. Physical allocations are session handles;
//! a reserved range is also reserved in this process, like any device allocation, so unified
//! addressing classifies pointers into it.

use super::memory::Reserved;
use super::*;

impl Session {
    revision_calls! {
        /// `cuMemCreate`: the session handle of a new physical allocation.
        mem_create(ctx: RmHandle, size: u64, prop: RmMemProp, flags: u64) -> RmHandle
            = 10, "cuMemCreate": Reply::value, rm_mem_create(&RmMemCreateArgs { ctx, size, prop, flags });
        /// `cuMemRelease`.
        mem_release(ctx: RmHandle, handle: RmHandle) -> ()
            = 10, "cuMemRelease": CuError::check, rm_mem_release(&RmMemHandleArgs { ctx, handle });
        /// `cuMemMap` of physical allocation `handle` at `[ptr, ptr + size)`.
        mem_map(ctx: RmHandle, ptr: u64, size: u64, offset: u64, handle: RmHandle, flags: u64) -> ()
            = 10, "cuMemMap": CuError::check,
            rm_mem_map(&RmMemMapArgs { ctx, ptr, size, offset, handle, flags });
        /// `cuMemUnmap`.
        mem_unmap(ctx: RmHandle, ptr: u64, size: u64) -> ()
            = 10, "cuMemUnmap": CuError::check, rm_mem_unmap(&RmMemRangeArgs { ctx, ptr, size });
        /// `cuMemGetAllocationGranularity`.
        mem_get_granularity(ctx: RmHandle, prop: RmMemProp, option: u32) -> u64
            = 10, "cuMemGetAllocationGranularity": Reply::value,
            rm_mem_get_granularity(&RmMemGranularityArgs { ctx, prop, option });
        /// `cuMemRetainAllocationHandle`: the handle of the allocation mapped at `ptr`, with one
        /// more reference (the same handle `cuMemCreate` gave, while the session still holds it).
        mem_retain_handle(ctx: RmHandle, ptr: u64) -> RmHandle
            = 10, "cuMemRetainAllocationHandle": Reply::value,
            rm_mem_retain_handle(&RmPtrArgs { ctx, ptr });
    }

    /// `cuMemAddressReserve`: the base of the reserved range.
    pub fn mem_address_reserve(
        &self,
        ctx: RmHandle,
        size: u64,
        alignment: u64,
        addr: u64,
        flags: u64,
    ) -> CuResult<u64> {
        self.need_revision(10, "cuMemAddressReserve")?;
        let args = RmMemReserveArgs {
            ctx,
            size,
            alignment,
            addr,
            flags,
        };
        let free = |ptr| {
            let _ = self
                .rpc
                .rm_mem_address_free(&RmMemRangeArgs { ctx, ptr, size });
        };
        self.alloc_reserved(
            ctx,
            || {
                Ok((
                    Reply::value(call!(self.rm_mem_address_reserve(&args))?)?,
                    size,
                    (),
                ))
            },
            Reserved::Virtual(&free),
        )
        .map(|(ptr, ())| ptr)
    }

    /// `cuMemAddressFree`: frees on the server, then releases the range here.
    pub fn mem_address_free(&self, ctx: RmHandle, ptr: u64, size: u64) -> CuResult<()> {
        self.need_revision(10, "cuMemAddressFree")?;
        let args = RmMemRangeArgs { ctx, ptr, size };
        CuError::check(call!(self.rm_mem_address_free(&args))?)?;
        self.va.release(ptr);
        Ok(())
    }

    /// `cuMemSetAccess`.
    pub fn mem_set_access(
        &self,
        ctx: RmHandle,
        ptr: u64,
        size: u64,
        desc: Vec<RmMemAccess>,
    ) -> CuResult<()> {
        self.need_revision(10, "cuMemSetAccess")?;
        if desc.len() > RM_MAX_ACCESS_DESCS as usize {
            tracing::warn!(
                "remora: cuMemSetAccess with {} descriptors; Remora carries at most {RM_MAX_ACCESS_DESCS}; returning CUDA_ERROR_INVALID_VALUE",
                desc.len()
            );
            return Err(CuError(cu::INVALID_VALUE));
        }
        let args = RmMemSetAccessArgs {
            ctx,
            ptr,
            size,
            desc,
        };
        CuError::check(call!(self.rm_mem_set_access(&args))?)
    }

    /// `cuMemGetAccess`: the access flags of `(location type, id)` on the mapping at `ptr`.
    pub fn mem_get_access(&self, ctx: RmHandle, ptr: u64, location: (i32, i32)) -> CuResult<u64> {
        self.need_revision(10, "cuMemGetAccess")?;
        let args = RmMemGetAccessArgs {
            ctx,
            ptr,
            location_type: location.0,
            location_id: location.1,
        };
        Reply::value(call!(self.rm_mem_get_access(&args))?)
    }

    /// `cuMemGetAllocationPropertiesFromHandle`.
    pub fn mem_get_properties(&self, ctx: RmHandle, handle: RmHandle) -> CuResult<RmMemProp> {
        self.need_revision(10, "cuMemGetAllocationPropertiesFromHandle")?;
        Reply::value(call!(
            self.rm_mem_get_properties(&RmMemHandleArgs { ctx, handle })
        )?)
    }
}
