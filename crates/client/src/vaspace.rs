//! Unified addressing on the client: device ranges reserved (PROT_NONE) in our own address
//! space, so no host allocation can take them and any pointer can be classified.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::sync::Mutex;

use rustix::mm::{MapFlags, ProtFlags};

/// One device allocation as the client knows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct Range {
    pub(crate) size: u64,
    pub(crate) ctx: u64,
    /// `CU_POINTER_ATTRIBUTE_BUFFER_ID`: unique in the process, never reused (from 1).
    pub(crate) buffer_id: u64,
    /// A `cuMemAddressReserve` range: it stays when its context is destroyed.
    pub(crate) outlives_context: bool,
}

#[derive(Debug, Default)]
struct State {
    /// Allocations by base address, oldest first. Two at one base only for a moment: once
    /// the server has freed an allocation, another thread's allocation may get the same
    /// address and be reserved before the freeing thread releases the first one here; that
    /// release then takes the older entry, not the live one (see [`VaSpace::release`]).
    ranges: BTreeMap<u64, Vec<Range>>,
    /// Reserved chunks of pages: start -> (end, number of allocations touching it). Device
    /// allocations can share a page (the driver sub-allocates), so chunks are counted.
    chunks: BTreeMap<u64, (u64, u32)>,
    /// The last buffer id handed out.
    last_buffer_id: u64,
}

/// The device allocations of a session, by base address.
#[derive(Debug, Default)]
pub(crate) struct VaSpace {
    state: Mutex<State>,
}

fn page_size() -> usize {
    rustix::param::page_size()
}

/// Why a range could not be reserved.
#[derive(Debug)]
pub(crate) enum ReserveError {
    /// Something of ours (a host mapping) already occupies part of the range.
    Collision(rustix::io::Errno),
    /// The kernel refused for another reason (or the range overflows).
    Other(rustix::io::Errno),
}

fn page_span(base: u64, size: u64) -> Option<(u64, u64)> {
    let page = page_size() as u64;
    let start = base & !(page - 1);
    let end = base.checked_add(size.max(1))?.checked_add(page - 1)? & !(page - 1);
    Some((start, end))
}

/// Unmaps a chunk this module reserved.
fn unmap(start: u64, end: u64) {
    // SAFETY: [start, end) was mapped PROT_NONE by `VaSpace::reserve` and is used by no one;
    // unmapping it frees only our reservation.
    let _ = unsafe { rustix::mm::munmap(start as *mut c_void, (end - start) as usize) };
}

impl State {
    fn overlapping(&self, start: u64, end: u64) -> Vec<(u64, u64)> {
        self.chunks
            .range(..end)
            .filter(|(_, (cend, _))| *cend > start)
            .map(|(&s, &(e, _))| (s, e))
            .collect()
    }
}

impl VaSpace {
    /// Reserves `[base, base + size)` (rounded out to pages) and records the allocation.
    #[cfg(test)]
    pub(crate) fn reserve(&self, base: u64, size: u64, ctx: u64) -> Result<(), ReserveError> {
        self.reserve_range(base, size, ctx, false)
    }

    /// Reserves `[base, base + size)` (rounded out to pages) and records the allocation, of
    /// context `ctx`; `outlives`: a `cuMemAddressReserve` range, which stays when `ctx` goes.
    pub(crate) fn reserve_range(
        &self,
        base: u64,
        size: u64,
        ctx: u64,
        outlives: bool,
    ) -> Result<(), ReserveError> {
        let (start, end) =
            page_span(base, size).ok_or(ReserveError::Other(rustix::io::Errno::INVAL))?;
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let mut gaps = Vec::new();
        let mut cursor = start;
        for (cs, ce) in st.overlapping(start, end) {
            if cs > cursor {
                gaps.push((cursor, cs));
            }
            cursor = cursor.max(ce);
        }
        if cursor < end {
            gaps.push((cursor, end));
        }
        for (i, &(gs, ge)) in gaps.iter().enumerate() {
            let len = (ge - gs) as usize;
            // SAFETY: MAP_FIXED_NOREPLACE never replaces an existing mapping (it fails with
            // EEXIST instead), so no memory of this process is invalidated. The range is
            // anonymous, PROT_NONE and unbacked (MAP_NORESERVE); nothing reads or writes it.
            let res = unsafe {
                rustix::mm::mmap_anonymous(
                    gs as *mut c_void,
                    len,
                    ProtFlags::empty(),
                    MapFlags::PRIVATE | MapFlags::NORESERVE | MapFlags::FIXED_NOREPLACE,
                )
            };
            let err = match res {
                Ok(p) if p as u64 == gs => None,
                Ok(p) => {
                    // A kernel without MAP_FIXED_NOREPLACE treats the address as a hint.
                    unmap(p as u64, p as u64 + len as u64);
                    Some(ReserveError::Collision(rustix::io::Errno::EXIST))
                }
                Err(e) if e == rustix::io::Errno::EXIST => Some(ReserveError::Collision(e)),
                Err(e) => Some(ReserveError::Other(e)),
            };
            if let Some(err) = err {
                for &(s, e) in &gaps[..i] {
                    unmap(s, e);
                }
                return Err(err);
            }
        }
        for (gs, ge) in gaps {
            st.chunks.insert(gs, (ge, 0));
        }
        for (cs, _) in st.overlapping(start, end) {
            if let Some(c) = st.chunks.get_mut(&cs) {
                c.1 += 1;
            }
        }
        st.last_buffer_id += 1;
        let buffer_id = st.last_buffer_id;
        st.ranges.entry(base).or_default().push(Range {
            size,
            ctx,
            buffer_id,
            outlives_context: outlives,
        });
        Ok(())
    }

    /// Forgets the allocation at `base` and releases the pages no other allocation uses. With
    /// two allocations at `base` (one freed on the server and since handed out again), the
    /// older one: the caller freed it before the newer one could exist.
    pub(crate) fn release(&self, base: u64) -> Option<Range> {
        self.release_where(base, |_| true)
    }

    /// [`VaSpace::release`] of the oldest allocation at `base` that `pick` accepts.
    fn release_where(&self, base: u64, pick: impl Fn(&Range) -> bool) -> Option<Range> {
        let mut st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let at = st.ranges.get_mut(&base)?;
        let i = at.iter().position(&pick)?;
        let r = at.remove(i);
        if at.is_empty() {
            st.ranges.remove(&base);
        }
        if let Some((start, end)) = page_span(base, r.size) {
            for (cs, ce) in st.overlapping(start, end) {
                let Some(c) = st.chunks.get_mut(&cs) else {
                    continue;
                };
                c.1 -= 1;
                if c.1 == 0 {
                    st.chunks.remove(&cs);
                    unmap(cs, ce);
                }
            }
        }
        Some(r)
    }

    /// Makes `[base, base + len)` (page-aligned, inside a range this space holds, where the
    /// session mapped host pages) the unbacked PROT_NONE reservation again, so that freeing
    /// the range leaves no host memory behind even while its chunk stays reserved.
    pub(crate) fn hide(&self, base: u64, len: u64) {
        let held = self
            .find(base)
            .is_some_and(|(b, r)| base + len <= b + r.size.max(1));
        if !held || !base.is_multiple_of(rustix::param::page_size() as u64) {
            tracing::error!("remora: not hiding {base:#x}+{len:#x}: no reserved range holds it");
            return;
        }
        // SAFETY: the range lies inside a reservation of this space (checked above) whose
        // pages the session mapped for host use and no longer uses; replacing them with an
        // unbacked PROT_NONE mapping touches nothing else.
        let res = unsafe {
            rustix::mm::mmap_anonymous(
                base as usize as *mut c_void,
                len as usize,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::NORESERVE | MapFlags::FIXED,
            )
        };
        if let Err(e) = res {
            tracing::warn!("remora: returning host pages at {base:#x}+{len:#x} failed: {e}");
        }
    }

    /// The allocation containing `ptr`, as (base, range).
    pub(crate) fn find(&self, ptr: u64) -> Option<(u64, Range)> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        let (&base, at) = st.ranges.range(..=ptr).next_back()?;
        // The newest at a base is the live one.
        let r = *at.last()?;
        (ptr < base + r.size.max(1)).then_some((base, r))
    }

    /// Every allocation of context `ctx` that goes with it (for context teardown), as (base,
    /// buffer id) for [`VaSpace::release_buffer`].
    pub(crate) fn of_context(&self, ctx: u64) -> Vec<(u64, u64)> {
        let st = self.state.lock().unwrap_or_else(|e| e.into_inner());
        st.ranges
            .iter()
            .flat_map(|(&b, at)| at.iter().map(move |r| (b, r)))
            .filter(|(_, r)| r.ctx == ctx && !r.outlives_context)
            .map(|(b, r)| (b, r.buffer_id))
            .collect()
    }

    /// Forgets the allocation at `base` with buffer id `id` (one [`VaSpace::of_context`]
    /// listed), whatever else is at `base`.
    pub(crate) fn release_buffer(&self, base: u64, id: u64) -> Option<Range> {
        self.release_where(base, |r| r.buffer_id == id)
    }
}

impl Drop for VaSpace {
    fn drop(&mut self) {
        let st = self.state.get_mut().unwrap_or_else(|e| e.into_inner());
        for (&s, &(e, _)) in &st.chunks {
            unmap(s, e);
        }
        st.chunks.clear();
        st.ranges.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A free, page-aligned address range that other threads of the test binary will not take
    /// before the test reserves it. The kernel places new mappings top-down at the high end of
    /// the highest hole that fits, so the test uses the low end of a freshly freed 1 GiB hole.
    /// Tests that take address ranges run one at a time: two of them could be handed the same
    /// freed hole.
    static SERIAL: Mutex<()> = Mutex::new(());

    fn free_range(len: usize) -> u64 {
        const HOLE: usize = 1 << 30;
        assert!(len < HOLE / 2);
        // SAFETY: a fresh anonymous, unbacked mapping at an address of the kernel's choosing.
        let p = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                HOLE,
                ProtFlags::empty(),
                MapFlags::PRIVATE | MapFlags::NORESERVE,
            )
        }
        .unwrap();
        // SAFETY: unmapping the mapping just made.
        unsafe { rustix::mm::munmap(p, HOLE) }.unwrap();
        p as u64
    }

    #[test]
    fn reserves_classifies_and_releases() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let va = VaSpace::default();
        let base = free_range(1 << 20);
        va.reserve(base, 1 << 20, 7).unwrap();
        assert_eq!(va.find(base + 10).map(|(b, r)| (b, r.ctx)), Some((base, 7)));
        assert!(va.find(base + (1 << 20)).is_none());
        assert!(va.find(base - 1).is_none());
        // The range is ours now: reserving it again collides.
        let other = VaSpace::default();
        assert!(matches!(
            other.reserve(base, 4096, 1),
            Err(ReserveError::Collision(_))
        ));
        assert_eq!(va.of_context(7).len(), 1);
        assert_eq!(va.of_context(7)[0].0, base);
        va.release(base).unwrap();
        assert!(va.find(base).is_none());
        // Released: it can be reserved again.
        other.reserve(base, 4096, 1).unwrap();
    }

    #[test]
    fn an_address_handed_out_again_before_its_release_keeps_the_new_allocation() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let va = VaSpace::default();
        let base = free_range(1 << 20);
        va.reserve(base, 1 << 20, 7).unwrap();
        let first = va.find(base).unwrap().1.buffer_id;
        // The server freed it and gave the address to another thread's allocation, reserved
        // before the first thread's release.
        va.reserve(base, 4096, 8).unwrap();
        let (b, r) = va.find(base + 10).unwrap();
        assert_eq!(
            (b, r.ctx),
            (base, 8),
            "the newer allocation is the live one"
        );
        assert_eq!(va.release(base).map(|r| r.buffer_id), Some(first));
        // The newer one stays, classified and reserved.
        assert_eq!(va.find(base + 10).map(|(_, r)| r.ctx), Some(8));
        let other = VaSpace::default();
        assert!(matches!(
            other.reserve(base, 4096, 1),
            Err(ReserveError::Collision(_))
        ));
        // A context's teardown releases its own allocation by buffer id.
        let listed = va.of_context(8);
        assert_eq!(listed.len(), 1);
        assert!(va.release_buffer(listed[0].0, listed[0].1).is_some());
        assert!(va.find(base).is_none());
        // Nothing is left reserved: the first one's pages went with the last allocation on
        // them.
        other.reserve(base, 1 << 20, 1).unwrap();
    }

    #[test]
    fn a_host_mapping_collides() {
        let v = vec![0u8; 1 << 16];
        let va = VaSpace::default();
        let page = page_size() as u64;
        let p = (v.as_ptr() as u64 + page) & !(page - 1);
        assert!(matches!(
            va.reserve(p, 16, 1),
            Err(ReserveError::Collision(_))
        ));
    }

    #[test]
    fn sub_page_allocations_share_a_reservation() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let va = VaSpace::default();
        let base = free_range(1 << 16);
        va.reserve(base, 256, 1).unwrap();
        va.reserve(base + 512, 256, 1).unwrap();
        assert_eq!(va.find(base + 600).map(|(b, _)| b), Some(base + 512));
        // Releasing the first keeps the shared page reserved for the second.
        va.release(base).unwrap();
        let other = VaSpace::default();
        assert!(matches!(
            other.reserve(base, 16, 1),
            Err(ReserveError::Collision(_))
        ));
        va.release(base + 512).unwrap();
        other.reserve(base, 16, 1).unwrap();
    }
}
