//! What the executor needs from a backend for virtual memory management (`cuMemCreate`,
//! `cuMemAddressReserve`, `cuMemMap` and the calls around them, revision 10): the [`Vmm`] part
//! of every [`Backend`](super::Backend).

use remora_proto::cuda::CuResult;
use remora_proto::remora::{RmMemAccess, RmMemMapArgs, RmMemProp, RmMemReserveArgs};

/// Virtual memory management. `ctx` is the raw context the call runs in, or 0 for none (these
/// calls do not need one). Handles are the driver's `CUmemGenericAllocationHandle`; the
/// executor checks ranges and handles first.
pub trait Vmm {
    /// `cuMemCreate`: a physical allocation's handle.
    fn mem_create(&self, ctx: u64, size: u64, prop: &RmMemProp, flags: u64) -> CuResult<u64>;
    /// `cuMemRelease`.
    fn mem_release(&self, ctx: u64, handle: u64) -> CuResult<()>;
    /// `cuMemAddressReserve`: the reserved range's base.
    fn mem_address_reserve(&self, ctx: u64, r: &RmMemReserveArgs) -> CuResult<u64>;
    /// `cuMemAddressFree`.
    fn mem_address_free(&self, ctx: u64, ptr: u64, size: u64) -> CuResult<()>;
    /// `cuMemMap` of `handle` (raw) as in `m` (whose `ctx` and `handle` fields are ignored).
    fn mem_map(&self, ctx: u64, m: &RmMemMapArgs, handle: u64) -> CuResult<()>;
    /// `cuMemUnmap`.
    fn mem_unmap(&self, ctx: u64, ptr: u64, size: u64) -> CuResult<()>;
    /// `cuMemSetAccess`.
    fn mem_set_access(&self, ctx: u64, ptr: u64, size: u64, desc: &[RmMemAccess]) -> CuResult<()>;
    /// `cuMemGetAccess`: the `CUmemAccess_flags` of `location` on the mapping at `ptr`.
    fn mem_get_access(&self, ctx: u64, ptr: u64, location: (i32, i32)) -> CuResult<u64>;
    /// `cuMemGetAllocationGranularity`.
    fn mem_get_granularity(&self, ctx: u64, prop: &RmMemProp, option: u32) -> CuResult<u64>;
    /// `cuMemGetAllocationPropertiesFromHandle`.
    fn mem_get_properties(&self, ctx: u64, handle: u64) -> CuResult<RmMemProp>;
    /// `cuMemRetainAllocationHandle` of the allocation mapped at `ptr`: its handle, with one
    /// more reference (released by [`Vmm::mem_release`]).
    fn mem_retain_handle(&self, ctx: u64, ptr: u64) -> CuResult<u64>;
}
