//! Unified addressing on the client: device ranges reserved (PROT_NONE) in our own address
//! space, so no host allocation can take them and any pointer can be classified.

use std::collections::{BTreeMap, VecDeque};
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

/// A reserved chunk of pages.
#[derive(Debug, Clone, Copy)]
struct Chunk {
    end: u64,
    /// Allocations touching it. Device allocations can share a page (the driver
    /// sub-allocates), so chunks are counted.
    users: u32,
    /// When no allocation touches it: its place in [`State::retired`] (from 1); else 0.
    retired: u64,
}

/// How many chunks, and how many bytes of address space, stay reserved once their last
/// allocation is gone. A freed range is often handed out again (pools and the caching
/// allocators reuse addresses), and keeping its reservation saves an `munmap` on the free and
/// an `mmap` on the next allocation, ~5 µs of a `cuMemFreeAsync`/`cuMemAllocAsync` pair. The
/// pages are unbacked PROT_NONE: they hold address space, no memory.
const KEEP_RETIRED_CHUNKS: usize = 64;
const KEEP_RETIRED_BYTES: u64 = 64 << 30;

#[derive(Debug)]
struct State {
    /// Allocations by base address, oldest first. Two at one base only for a moment: once
    /// the server has freed an allocation, another thread's allocation may get the same
    /// address and be reserved before the freeing thread releases the first one here; that
    /// release then takes the older entry, not the live one (see [`VaSpace::release`]).
    ranges: BTreeMap<u64, Vec<Range>>,
    /// Reserved chunks of pages by start, in use or retired.
    chunks: BTreeMap<u64, Chunk>,
    /// Chunks as they retired, oldest first, as (retirement number, start); an entry whose
    /// chunk was taken into use again since is stale and skipped.
    retired: VecDeque<(u64, u64)>,
    /// Bytes of the chunks now retired.
    retired_bytes: u64,
    /// The last retirement number given.
    last_retired: u64,
    keep_chunks: usize,
    keep_bytes: u64,
    /// The last buffer id handed out.
    last_buffer_id: u64,
}

impl Default for State {
    fn default() -> Self {
        State {
            ranges: BTreeMap::new(),
            chunks: BTreeMap::new(),
            retired: VecDeque::new(),
            retired_bytes: 0,
            last_retired: 0,
            keep_chunks: KEEP_RETIRED_CHUNKS,
            keep_bytes: KEEP_RETIRED_BYTES,
            last_buffer_id: 0,
        }
    }
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
            .filter(|(_, c)| c.end > start)
            .map(|(&s, c)| (s, c.end))
            .collect()
    }

    /// Chunk `start`, just left by its last allocation, stays reserved for the next one;
    /// the oldest retired chunks beyond the limits are unmapped.
    fn retire(&mut self, start: u64) {
        let Some(c) = self.chunks.get_mut(&start) else {
            return;
        };
        self.last_retired += 1;
        c.retired = self.last_retired;
        self.retired_bytes += c.end - start;
        self.retired.push_back((self.last_retired, start));
        while self.retired.len() > self.keep_chunks || self.retired_bytes > self.keep_bytes {
            let Some((n, s)) = self.retired.pop_front() else {
                break;
            };
            if let Some(c) = self.chunks.get(&s).copied().filter(|c| c.retired == n) {
                self.chunks.remove(&s);
                self.retired_bytes -= c.end - s;
                unmap(s, c.end);
            }
        }
    }
}

impl VaSpace {
    /// A space keeping at most `chunks` chunks and `bytes` bytes reserved once unused.
    #[cfg(test)]
    fn with_limits(chunks: usize, bytes: u64) -> Self {
        let state = State {
            keep_chunks: chunks,
            keep_bytes: bytes,
            ..State::default()
        };
        VaSpace {
            state: Mutex::new(state),
        }
    }

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
            let chunk = Chunk {
                end: ge,
                users: 0,
                retired: 0,
            };
            st.chunks.insert(gs, chunk);
        }
        for (cs, ce) in st.overlapping(start, end) {
            let Some(c) = st.chunks.get_mut(&cs) else {
                continue;
            };
            c.users += 1;
            if c.retired != 0 {
                // Taken into use again: its entry in `retired` goes stale.
                c.retired = 0;
                st.retired_bytes -= ce - cs;
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

    /// Forgets the allocation at `base`; the chunks no other allocation uses retire (stay
    /// reserved for the next allocation there, within [`KEEP_RETIRED_CHUNKS`] and
    /// [`KEEP_RETIRED_BYTES`]; the oldest beyond them are unmapped). With
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
            for (cs, _) in st.overlapping(start, end) {
                let Some(c) = st.chunks.get_mut(&cs) else {
                    continue;
                };
                c.users = c.users.saturating_sub(1);
                if c.users == 0 && c.retired == 0 {
                    st.retire(cs);
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
        for (&s, c) in &st.chunks {
            unmap(s, c.end);
        }
        st.chunks.clear();
        st.retired.clear();
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
        // Released, its pages stay reserved for the next allocation there...
        assert!(matches!(
            other.reserve(base, 4096, 1),
            Err(ReserveError::Collision(_))
        ));
        va.reserve(base, 4096, 9).unwrap();
        assert_eq!(va.find(base).map(|(_, r)| r.ctx), Some(9));
        va.release(base).unwrap();
        // ...and are unmapped with the space.
        drop(va);
        other.reserve(base, 4096, 1).unwrap();
    }

    #[test]
    fn retired_chunks_beyond_the_limits_are_unmapped_oldest_first() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        let page = page_size() as u64;
        let base = free_range(1 << 20);
        let at = |i: u64| base + i * 4 * page;
        let taken = |p: u64| {
            matches!(
                VaSpace::default().reserve(p, page, 1),
                Err(ReserveError::Collision(_))
            )
        };
        // Two chunks kept: the third retirement unmaps the first.
        let va = VaSpace::with_limits(2, 1 << 30);
        for i in 0..3 {
            va.reserve(at(i), page, 1).unwrap();
        }
        for i in 0..3 {
            va.release(at(i)).unwrap();
        }
        assert_eq!(
            (0..3).map(|i| taken(at(i))).collect::<Vec<_>>(),
            [false, true, true]
        );
        // A retired chunk taken into use again is no longer retired: its entry goes stale.
        // Retiring a fourth and fifth skips that entry and unmaps the third; retiring the
        // second again then unmaps the fourth.
        va.reserve(at(1), page, 1).unwrap();
        va.reserve(at(3), page, 1).unwrap();
        va.reserve(at(4), page, 1).unwrap();
        va.release(at(3)).unwrap();
        va.release(at(4)).unwrap();
        assert_eq!(
            (1..5).map(|i| taken(at(i))).collect::<Vec<_>>(),
            [true, false, true, true]
        );
        va.release(at(1)).unwrap();
        assert_eq!(
            (1..5).map(|i| taken(at(i))).collect::<Vec<_>>(),
            [true, false, false, true]
        );
        drop(va);
        // A byte limit of one page keeps only the newest.
        let va = VaSpace::with_limits(64, page);
        va.reserve(at(0), page, 1).unwrap();
        va.reserve(at(1), page, 1).unwrap();
        va.release(at(0)).unwrap();
        va.release(at(1)).unwrap();
        assert_eq!(
            (0..2).map(|i| taken(at(i))).collect::<Vec<_>>(),
            [false, true]
        );
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
        // Nothing is left in use: the first one's pages retired with the last allocation on
        // them, and go with the space.
        drop(va);
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
        drop(va);
        other.reserve(base, 16, 1).unwrap();
    }
}
