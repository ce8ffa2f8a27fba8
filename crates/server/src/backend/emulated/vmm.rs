//! Virtual memory management of the emulated **test** backend ([`Vmm`]): physical
//! allocations of `cuMemCreate`, reserved address ranges and the mappings between them, with
//! the access each mapping allows.

use remora_proto::cuda::{CuError, CuResult, cu};
use remora_proto::remora::{RmMemAccess, RmMemMapArgs, RmMemProp, RmMemReserveArgs};

use super::{EmulatedBackend, State, align_up};
use crate::backend::Vmm;

/// A physical allocation of `cuMemCreate`: alive while referenced or mapped.
pub(super) struct EmuPhys {
    pub(super) dev: i32,
    pub(super) data: Vec<u8>,
    pub(super) prop: RmMemProp,
    pub(super) refs: u32,
    pub(super) maps: u32,
}

/// A `cuMemMap` mapping.
pub(super) struct EmuMapping {
    pub(super) phys: u64,
    pub(super) offset: u64,
    pub(super) size: u64,
    /// `CUmemAccess_flags` of the device (0 until `cuMemSetAccess`: accesses fail).
    pub(super) access: u64,
}

/// The granularity of emulated physical allocations and mappings (the H100's is 2 MiB).
const VMM_GRANULARITY: u64 = 2 << 20;

impl State {
    /// Forgets physical allocation `h` once it is neither referenced nor mapped.
    fn drop_unused_phys(&mut self, h: u64) {
        if self
            .phys
            .get(&h)
            .is_some_and(|p| p.refs == 0 && p.maps == 0)
            && let Some(p) = self.phys.remove(&h)
            && let Some(u) = self.used.get_mut(&p.dev)
        {
            *u -= p.data.len() as u64;
        }
    }

    /// The bases of the mappings that exactly tile `[ptr, end)` (`CUDA_ERROR_INVALID_VALUE`
    /// when a part is unmapped or a mapping sticks out).
    fn whole_mappings(&self, ptr: u64, end: u64) -> CuResult<Vec<u64>> {
        let mut at = ptr;
        let mut bases = Vec::new();
        while at < end {
            match self.mapped.get(&at) {
                Some(m) if at + m.size <= end => {
                    bases.push(at);
                    at += m.size;
                }
                _ => return Err(CuError(cu::INVALID_VALUE)),
            }
        }
        if bases.is_empty() {
            return Err(CuError(cu::INVALID_VALUE));
        }
        Ok(bases)
    }
}

impl Vmm for EmulatedBackend {
    fn mem_create(&self, ctx: u64, size: u64, prop: &RmMemProp, flags: u64) -> CuResult<u64> {
        let mut st = self.lock();
        if ctx != 0 {
            st.ctx(ctx)?;
        }
        // CU_MEM_ALLOCATION_TYPE_PINNED on CU_MEM_LOCATION_TYPE_DEVICE, sizes in granules.
        if prop.r#type != 1 || prop.location_type != 1 || flags != 0 {
            return Err(CuError(cu::INVALID_VALUE));
        }
        self.check_dev(prop.location_id)?;
        if size == 0 || !size.is_multiple_of(VMM_GRANULARITY) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let dev = prop.location_id;
        let used = st.used.entry(dev).or_default();
        if size > self.config.memory_per_device.saturating_sub(*used) {
            return Err(CuError(cu::OUT_OF_MEMORY));
        }
        let data = vec![0u8; usize::try_from(size).map_err(|_| CuError(cu::OUT_OF_MEMORY))?];
        *used += size;
        st.next_handle += 1;
        let h = st.next_handle;
        st.phys.insert(
            h,
            EmuPhys {
                dev,
                data,
                prop: prop.clone(),
                refs: 1,
                maps: 0,
            },
        );
        Ok(h)
    }

    fn mem_release(&self, _ctx: u64, handle: u64) -> CuResult<()> {
        let mut st = self.lock();
        let p = st.phys.get_mut(&handle).ok_or(CuError(cu::INVALID_VALUE))?;
        if p.refs == 0 {
            return Err(CuError(cu::INVALID_VALUE));
        }
        p.refs -= 1;
        st.drop_unused_phys(handle);
        Ok(())
    }

    fn mem_address_reserve(&self, _ctx: u64, r: &RmMemReserveArgs) -> CuResult<u64> {
        let mut st = self.lock();
        if r.size == 0 || !r.size.is_multiple_of(VMM_GRANULARITY) || r.flags != 0 {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let align = r.alignment.max(VMM_GRANULARITY);
        if !align.is_power_of_two() {
            return Err(CuError(cu::INVALID_VALUE));
        }
        // The hint is ignored, as the driver may.
        let base = align_up(st.next_addr, align);
        st.next_addr = base
            .checked_add(r.size)
            .and_then(|e| e.checked_add(0x1000))
            .ok_or(CuError(cu::OUT_OF_MEMORY))?;
        st.reserved.insert(base, r.size);
        Ok(base)
    }

    fn mem_address_free(&self, _ctx: u64, ptr: u64, size: u64) -> CuResult<()> {
        let mut st = self.lock();
        if st.reserved.get(&ptr) != Some(&size) || st.mapped.range(ptr..ptr + size).next().is_some()
        {
            return Err(CuError(cu::INVALID_VALUE));
        }
        st.reserved.remove(&ptr);
        Ok(())
    }

    fn mem_map(&self, _ctx: u64, m: &RmMemMapArgs, handle: u64) -> CuResult<()> {
        let mut st = self.lock();
        let aligned = |v: u64| v.is_multiple_of(VMM_GRANULARITY);
        let end = m
            .ptr
            .checked_add(m.size)
            .ok_or(CuError(cu::INVALID_VALUE))?;
        let inside = st
            .reserved
            .range(..=m.ptr)
            .next_back()
            .is_some_and(|(b, s)| end <= b + s);
        let overlaps = st
            .mapped
            .range(..end)
            .next_back()
            .is_some_and(|(b, x)| b + x.size > m.ptr);
        let phys = st.phys.get(&handle).ok_or(CuError(cu::INVALID_HANDLE))?;
        let fits = m
            .offset
            .checked_add(m.size)
            .is_some_and(|e| e <= phys.data.len() as u64);
        if m.flags != 0
            || m.size == 0
            || !aligned(m.ptr)
            || !aligned(m.size)
            || !aligned(m.offset)
            || !inside
            || overlaps
            || !fits
        {
            return Err(CuError(cu::INVALID_VALUE));
        }
        if let Some(p) = st.phys.get_mut(&handle) {
            p.maps += 1;
        }
        st.mapped.insert(
            m.ptr,
            EmuMapping {
                phys: handle,
                offset: m.offset,
                size: m.size,
                access: 0,
            },
        );
        Ok(())
    }

    fn mem_unmap(&self, _ctx: u64, ptr: u64, size: u64) -> CuResult<()> {
        let mut st = self.lock();
        let end = ptr.checked_add(size).ok_or(CuError(cu::INVALID_VALUE))?;
        let bases = st.whole_mappings(ptr, end)?;
        for b in bases {
            if let Some(m) = st.mapped.remove(&b) {
                if let Some(p) = st.phys.get_mut(&m.phys) {
                    p.maps -= 1;
                }
                st.drop_unused_phys(m.phys);
            }
        }
        Ok(())
    }

    fn mem_set_access(&self, _ctx: u64, ptr: u64, size: u64, desc: &[RmMemAccess]) -> CuResult<()> {
        let mut st = self.lock();
        let end = ptr.checked_add(size).ok_or(CuError(cu::INVALID_VALUE))?;
        if desc.is_empty() {
            return Err(CuError(cu::INVALID_VALUE));
        }
        for d in desc {
            // CU_MEM_LOCATION_TYPE_DEVICE; flags NONE (0), READ (1), READWRITE (3).
            if d.location_type != 1 || !matches!(d.flags, 0 | 1 | 3) {
                return Err(CuError(cu::INVALID_VALUE));
            }
            self.check_dev(d.location_id)?;
        }
        let bases = st.whole_mappings(ptr, end)?;
        let flags = u64::from(desc.last().map_or(0, |d| d.flags));
        for b in bases {
            if let Some(m) = st.mapped.get_mut(&b) {
                m.access = flags;
            }
        }
        Ok(())
    }

    fn mem_get_access(&self, _ctx: u64, ptr: u64, location: (i32, i32)) -> CuResult<u64> {
        let st = self.lock();
        if location.0 != 1 {
            return Err(CuError(cu::INVALID_VALUE));
        }
        self.check_dev(location.1)?;
        match st.mapped.range(..=ptr).next_back() {
            Some((b, m)) if ptr < b + m.size => Ok(m.access),
            _ => Err(CuError(cu::INVALID_VALUE)),
        }
    }

    fn mem_get_granularity(&self, _ctx: u64, prop: &RmMemProp, option: u32) -> CuResult<u64> {
        if prop.r#type != 1 || prop.location_type != 1 || option > 1 {
            return Err(CuError(cu::INVALID_VALUE));
        }
        self.check_dev(prop.location_id)?;
        Ok(VMM_GRANULARITY)
    }

    fn mem_get_properties(&self, _ctx: u64, handle: u64) -> CuResult<RmMemProp> {
        let st = self.lock();
        match st.phys.get(&handle) {
            Some(p) if p.refs > 0 => Ok(p.prop.clone()),
            _ => Err(CuError(cu::INVALID_VALUE)),
        }
    }

    fn mem_retain_handle(&self, _ctx: u64, ptr: u64) -> CuResult<u64> {
        let mut st = self.lock();
        let phys = match st.mapped.range(..=ptr).next_back() {
            Some((b, m)) if ptr < b + m.size => m.phys,
            _ => return Err(CuError(cu::INVALID_VALUE)),
        };
        if let Some(p) = st.phys.get_mut(&phys) {
            p.refs += 1;
        }
        Ok(phys)
    }
}
