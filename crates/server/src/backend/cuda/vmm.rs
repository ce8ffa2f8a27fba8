//! [`Vmm`] on the real driver: virtual memory management (`cuMemCreate`, `cuMemMap` and the
//! calls around them). Each call runs in the calling session's context when it names one
//! (`ctx` 0: none is needed).

use std::ffi::c_int;

use remora_proto::cuda::{CuError, CuResult, cu};
use remora_proto::remora::{RmMemAccess, RmMemMapArgs, RmMemProp, RmMemReserveArgs};

use super::abi::*;
use super::driver::*;
use super::{CudaBackend, usize_of};
use crate::backend::Vmm;

impl CudaBackend {
    /// The driver for a virtual-memory call: in `ctx` when the caller had a current context,
    /// as it is (these calls need none) when `ctx` is 0.
    fn vmm(&self, ctx: u64) -> CuResult<&Driver> {
        if ctx == 0 { self.d() } else { self.in_ctx(ctx) }
    }
}

impl Vmm for CudaBackend {
    fn mem_create(&self, ctx: u64, size: u64, prop: &RmMemProp, flags: u64) -> CuResult<u64> {
        let d = self.vmm(ctx)?;
        let prop = remora_proto::mem_prop::to_abi(prop).ok_or(CuError(cu::INVALID_VALUE))?;
        let mut h = 0u64;
        // SAFETY: `prop` is a complete CUmemAllocationProp (no Windows metadata); `h` is a
        // local output.
        call!(d.t, mem_create(&mut h, usize_of(size)?, &prop, flags))?;
        Ok(h)
    }

    fn mem_release(&self, ctx: u64, handle: u64) -> CuResult<()> {
        let d = self.vmm(ctx)?;
        // SAFETY: a handle of this session (checked by the executor); a value, no memory.
        call!(d.t, mem_release(handle))
    }

    fn mem_address_reserve(&self, ctx: u64, r: &RmMemReserveArgs) -> CuResult<u64> {
        let d = self.vmm(ctx)?;
        let mut p = 0u64;
        // SAFETY: values and one local output.
        call!(
            d.t,
            mem_address_reserve(
                &mut p,
                usize_of(r.size)?,
                usize_of(r.alignment)?,
                r.addr,
                r.flags
            )
        )?;
        Ok(p)
    }

    fn mem_address_free(&self, ctx: u64, ptr: u64, size: u64) -> CuResult<()> {
        let d = self.vmm(ctx)?;
        // SAFETY: a reservation of this session (checked by the executor).
        call!(d.t, mem_address_free(ptr, usize_of(size)?))
    }

    fn mem_map(&self, ctx: u64, m: &RmMemMapArgs, handle: u64) -> CuResult<()> {
        let d = self.vmm(ctx)?;
        // SAFETY: a range inside a reservation of this session and a handle of it (checked by
        // the executor); the driver validates the rest.
        call!(
            d.t,
            mem_map(
                m.ptr,
                usize_of(m.size)?,
                usize_of(m.offset)?,
                handle,
                m.flags
            )
        )
    }

    fn mem_unmap(&self, ctx: u64, ptr: u64, size: u64) -> CuResult<()> {
        let d = self.vmm(ctx)?;
        // SAFETY: a range inside a reservation of this session (checked by the executor).
        call!(d.t, mem_unmap(ptr, usize_of(size)?))
    }

    fn mem_set_access(&self, ctx: u64, ptr: u64, size: u64, desc: &[RmMemAccess]) -> CuResult<()> {
        let d = self.vmm(ctx)?;
        let desc: Vec<MemAccessDesc> = desc
            .iter()
            .map(|a| MemAccessDesc {
                location: MemLocation {
                    kind: a.location_type,
                    id: a.location_id,
                },
                flags: a.flags as c_int,
            })
            .collect();
        // SAFETY: `desc` holds `desc.len()` descriptors; the range lies inside a reservation
        // of this session (checked by the executor).
        call!(
            d.t,
            mem_set_access(ptr, usize_of(size)?, desc.as_ptr(), desc.len())
        )
    }

    fn mem_get_access(&self, ctx: u64, ptr: u64, location: (i32, i32)) -> CuResult<u64> {
        let d = self.vmm(ctx)?;
        let loc = MemLocation {
            kind: location.0,
            id: location.1,
        };
        let mut flags = 0u64;
        // SAFETY: a local location in, a local output.
        call!(d.t, mem_get_access(&mut flags, &loc, ptr))?;
        Ok(flags)
    }

    fn mem_get_granularity(&self, ctx: u64, prop: &RmMemProp, option: u32) -> CuResult<u64> {
        let d = self.vmm(ctx)?;
        let prop = remora_proto::mem_prop::to_abi(prop).ok_or(CuError(cu::INVALID_VALUE))?;
        let mut g = 0usize;
        // SAFETY: a complete CUmemAllocationProp in, a local output.
        call!(
            d.t,
            mem_get_allocation_granularity(&mut g, &prop, option as c_int)
        )?;
        Ok(g as u64)
    }

    fn mem_get_properties(&self, ctx: u64, handle: u64) -> CuResult<RmMemProp> {
        let d = self.vmm(ctx)?;
        let mut prop = MemAllocationProp::default();
        // SAFETY: the driver fills in one CUmemAllocationProp.
        call!(
            d.t,
            mem_get_allocation_properties_from_handle(&mut prop, handle)
        )?;
        Ok(remora_proto::mem_prop::from_abi(&prop))
    }

    fn mem_retain_handle(&self, ctx: u64, ptr: u64) -> CuResult<u64> {
        let d = self.vmm(ctx)?;
        let mut h = 0u64;
        // SAFETY: `ptr` is an address the driver only looks up (inside a mapping of this
        // session, checked by the executor); `h` is a local output.
        call!(
            d.t,
            mem_retain_allocation_handle(&mut h, ptr as usize as Ptr)
        )?;
        Ok(h)
    }
}
