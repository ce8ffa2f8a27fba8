//! Host memory the client owns: `cuMemHostAlloc`/`cuMemAllocHost` allocations (page-aligned
//! anonymous mappings of this process) and `cuMemHostRegister` ranges.
//!
//! On a session in shared memory with a data area, allocations come from the area (the
//! client's `AreaAlloc`): the server sees those bytes too, so copies from and to them pass
//! only `(offset, size)` and nobody on the client copies them ("zero-copy pinned memory").
//! Otherwise, or when the area has no room, "pinned" memory is an ordinary private mapping:
//! copies from and to it go through the transport like any other host memory. The ranges are
//! tracked so that pointer classification, `cuPointerGetAttribute`, `cuMemHostGetFlags` and
//! `cuMemFreeHost` know them.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use remora_proto::remora::RmHandle;

use crate::area::{AreaAlloc, Lease};
use crate::error::{CuError, CuResult, cu};

/// One tracked host range.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct HostRange {
    /// First byte.
    pub base: u64,
    /// Size in bytes as asked (an allocation of 0 bytes still owns a page).
    pub size: u64,
    /// `CU_MEMHOSTALLOC_*` or `CU_MEMHOSTREGISTER_*` flags.
    pub flags: u32,
    /// The context current when it was made (0 if none).
    pub ctx: RmHandle,
    /// Registered by `cuMemHostRegister` (else allocated by the client).
    pub registered: bool,
    /// Offset of the allocation in the session's shared data area, when it lies there.
    pub area_offset: Option<u64>,
    /// An allocation in the data area that the server has page-locked and mapped for the
    /// GPU (`RM_AREA_MAP`, revision 18).
    pub area_mapped: bool,
    /// How the remote GPU sees it, on a session where it lies outside a shared data area.
    pub view: DeviceView,
    mapped: u64,
}

/// How the remote GPU sees host memory that lies outside a shared data area (a socket
/// session, or a full area): it cannot reach this process's pages, so mapped host memory is a
/// device copy that the session keeps coherent (the `mirror` module).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum DeviceView {
    /// None: private memory, or a registered range nobody asked a device pointer for.
    #[default]
    Private,
    /// Page-locked memory at an address that is reserved on the device too (a
    /// `cuMemAddressReserve` range of `span` bytes with the host pages mapped over it here):
    /// its device pointer is its host pointer, and device memory backs it (a mirror) from the
    /// first time a kernel may use it. The session owns the pages.
    Reserved {
        /// Bytes of the reservation.
        span: u64,
    },
    /// Mirrored on the device: device memory at `dev` holds a copy of the range, coherent at
    /// launches and synchronizations. For an allocation `dev` is its own address and the
    /// session owns the pages; a registered range keeps its pages and has a device copy
    /// elsewhere.
    Mirrored {
        /// The device address of the range's first byte.
        dev: u64,
    },
}

impl HostRange {
    /// Whether the session owns this range's pages (they lie in a device reservation).
    fn pages_owned_by_session(&self) -> bool {
        !self.registered && self.view != DeviceView::Private
    }

    /// A range of `size` bytes at `base`: allocated by the client (not registered), outside
    /// the data area, private to this process, nothing mapped.
    fn new(base: u64, size: u64, flags: u32, ctx: RmHandle) -> Self {
        Self {
            base,
            size,
            flags,
            ctx,
            registered: false,
            area_offset: None,
            area_mapped: false,
            view: DeviceView::Private,
            mapped: 0,
        }
    }

    fn span(&self) -> u64 {
        self.size.max(1)
    }

    fn contains(&self, ptr: u64) -> bool {
        ptr >= self.base && ptr - self.base < self.span()
    }
}

/// A tracked range and, for an allocation in the data area, the space it holds there.
#[derive(Debug)]
struct Entry {
    range: HostRange,
    /// Returned to the area's allocator when the entry is dropped (`cuMemFreeHost`).
    lease: Option<Lease>,
}

/// The host ranges of a session, by base address.
#[derive(Debug, Default)]
pub struct HostMem {
    ranges: Mutex<BTreeMap<u64, Entry>>,
    /// How many ranges have a view other than [`DeviceView::Private`].
    device_views: AtomicUsize,
    /// How many ranges are [`DeviceView::Reserved`], and the bounds of every such range ever
    /// recorded (a launch's parameter words outside them need no lookup).
    reserved: AtomicUsize,
    reserved_lo: AtomicU64,
    reserved_hi: AtomicU64,
    /// The shared data area that allocations come from first (sessions in shared memory).
    area: Option<Arc<AreaAlloc>>,
}

fn page_round(size: u64) -> CuResult<u64> {
    let page = rustix::param::page_size() as u64;
    size.max(1)
        .checked_next_multiple_of(page)
        .ok_or(CuError(cu::OUT_OF_MEMORY))
}

impl HostMem {
    /// Host ranges whose allocations come from `area` first, when there is one.
    pub(crate) fn with_area(area: Option<Arc<AreaAlloc>>) -> Self {
        Self {
            ranges: Mutex::default(),
            device_views: AtomicUsize::new(0),
            reserved: AtomicUsize::new(0),
            reserved_lo: AtomicU64::new(u64::MAX),
            reserved_hi: AtomicU64::new(0),
            area,
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, BTreeMap<u64, Entry>> {
        self.ranges.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The range containing `ptr`.
    pub fn find(&self, ptr: u64) -> Option<HostRange> {
        let m = self.lock();
        m.range(..=ptr)
            .next_back()
            .map(|(_, e)| e.range)
            .filter(|r| r.contains(ptr))
    }

    /// Records that the allocation at `base` in the data area is mapped for the GPU.
    pub(crate) fn set_area_mapped(&self, base: u64) {
        if let Some(e) = self.lock().get_mut(&base) {
            e.range.area_mapped = true;
        }
    }

    /// The offset in the data area of `len` bytes at `ptr`, when they lie entirely inside
    /// one live allocation that the area holds (a zero-copy transfer may then name them).
    pub fn area_offset(&self, ptr: u64, len: u64) -> Option<u64> {
        let r = self.find(ptr)?;
        let base = r.area_offset?;
        let rel = ptr - r.base; // `find` checked `ptr >= r.base`
        (rel.checked_add(len)? <= r.span()).then(|| base + rel)
    }

    fn overlaps(m: &BTreeMap<u64, Entry>, base: u64, size: u64) -> bool {
        let end = base.saturating_add(size.max(1));
        if m.range(base..end).next().is_some() {
            return true;
        }
        m.range(..base)
            .next_back()
            .is_some_and(|(_, e)| e.range.contains(base))
    }

    /// Allocates `size` bytes of page-aligned, zero-filled host memory: in the shared data
    /// area when the session has one with room, else a private mapping.
    pub fn alloc(&self, size: u64, flags: u32, ctx: RmHandle) -> CuResult<u64> {
        if let Some(base) = self.alloc_in_area(size, flags, ctx)? {
            return Ok(base);
        }
        self.alloc_private(size, flags, ctx)
    }

    /// Allocates `size` bytes of zero-filled host memory in the shared data area: `None`
    /// when the session has no area or the area has no room.
    pub(crate) fn alloc_in_area(
        &self,
        size: u64,
        flags: u32,
        ctx: RmHandle,
    ) -> CuResult<Option<u64>> {
        let len = page_round(size)?;
        let Some(area) = &self.area else {
            return Ok(None);
        };
        // Pinned memory may not take the staging space that pageable copies stream
        // through (a full area would send them inside the calls, several times slower).
        let reserve = staging_reserve(area.len());
        let room = area.free_bytes().saturating_sub(reserve) >= len;
        match area
            .alloc(len, rustix::param::page_size() as u64)
            .filter(|_| room)
        {
            Some(lease) => {
                lease.zero();
                let base = lease.addr();
                self.insert_alloc(base, size, flags, ctx, 0, Some(lease));
                Ok(Some(base))
            }
            None => {
                tracing::debug!(
                    "remora: no room for {size} bytes of host memory in the shared data area; \
                     allocating outside it (copies from and to it are not zero-copy)"
                );
                Ok(None)
            }
        }
    }

    /// Allocates `size` bytes of page-aligned, zero-filled private host memory.
    pub(crate) fn alloc_private(&self, size: u64, flags: u32, ctx: RmHandle) -> CuResult<u64> {
        let len = page_round(size)?;
        let len_usize = usize::try_from(len).map_err(|_| CuError(cu::OUT_OF_MEMORY))?;
        // SAFETY: a fresh anonymous private mapping at an address of the kernel's choosing
        // aliases nothing; it is unmapped only by `free`.
        let p = unsafe {
            rustix::mm::mmap_anonymous(
                std::ptr::null_mut(),
                len_usize,
                rustix::mm::ProtFlags::READ | rustix::mm::ProtFlags::WRITE,
                rustix::mm::MapFlags::PRIVATE,
            )
        }
        .map_err(|e| {
            tracing::warn!("remora: host allocation of {size} bytes failed: {e}");
            CuError(cu::OUT_OF_MEMORY)
        })?;
        let base = p as usize as u64;
        self.insert_alloc(base, size, flags, ctx, len, None);
        Ok(base)
    }

    /// Records an allocation of [`HostMem::alloc`]: in the data area when `lease` is some,
    /// else `mapped` bytes of private memory.
    fn insert_alloc(
        &self,
        base: u64,
        size: u64,
        flags: u32,
        ctx: RmHandle,
        mapped: u64,
        lease: Option<Lease>,
    ) {
        let range = HostRange {
            area_offset: lease.as_ref().map(Lease::offset),
            mapped,
            ..HostRange::new(base, size, flags, ctx)
        };
        self.lock().insert(base, Entry { range, lease });
    }

    /// Records host memory at `base` whose pages lie in a device reservation (`view` is not
    /// [`DeviceView::Private`]): the session frees them; [`HostMem::free`] only forgets the
    /// range.
    pub(crate) fn insert_device_view(
        &self,
        base: u64,
        size: u64,
        flags: u32,
        ctx: RmHandle,
        view: DeviceView,
    ) {
        let range = HostRange {
            view,
            ..HostRange::new(base, size, flags, ctx)
        };
        self.lock().insert(base, Entry { range, lease: None });
        self.device_views.fetch_add(1, Ordering::Release);
        if matches!(view, DeviceView::Reserved { .. }) {
            self.reserved_lo.fetch_min(base, Ordering::Relaxed);
            self.reserved_hi
                .fetch_max(base.saturating_add(size.max(1)), Ordering::Relaxed);
            self.reserved.fetch_add(1, Ordering::Release);
        }
    }

    /// The [`DeviceView::Reserved`] range containing `ptr`, if any (cheap when there is
    /// none, or `ptr` lies outside every one).
    pub(crate) fn reserved_at(&self, ptr: u64) -> Option<HostRange> {
        if self.reserved.load(Ordering::Acquire) == 0
            || ptr < self.reserved_lo.load(Ordering::Relaxed)
            || ptr >= self.reserved_hi.load(Ordering::Relaxed)
        {
            return None;
        }
        self.find(ptr)
            .filter(|r| matches!(r.view, DeviceView::Reserved { .. }))
    }

    /// Whether some range is [`DeviceView::Reserved`].
    pub(crate) fn has_reserved(&self) -> bool {
        self.reserved.load(Ordering::Acquire) > 0
    }

    /// Changes how the device sees the range at `base` (a mirror was made for it).
    pub(crate) fn set_view(&self, base: u64, view: DeviceView) {
        let mut m = self.lock();
        if let Some(e) = m.get_mut(&base) {
            if e.range.view == DeviceView::Private {
                self.device_views.fetch_add(1, Ordering::Release);
            }
            if matches!(e.range.view, DeviceView::Reserved { .. }) {
                self.reserved.fetch_sub(1, Ordering::Release);
            }
            e.range.view = view;
        }
    }

    /// Whether some range lies in a device reservation or has a device copy (so that pointer
    /// classification must ask this table before the device allocations).
    pub(crate) fn has_device_views(&self) -> bool {
        self.device_views.load(Ordering::Acquire) > 0
    }

    fn forget(&self, e: &Entry) {
        if e.range.view != DeviceView::Private {
            self.device_views.fetch_sub(1, Ordering::Release);
        }
        if matches!(e.range.view, DeviceView::Reserved { .. }) {
            self.reserved.fetch_sub(1, Ordering::Release);
        }
    }

    /// Frees an allocation made by [`HostMem::alloc`]; `ptr` must be its base.
    pub fn free(&self, ptr: u64) -> CuResult<()> {
        let e = {
            let mut m = self.lock();
            match m.get(&ptr) {
                Some(e) if !e.range.registered => m.remove(&ptr),
                _ => None,
            }
        }
        .ok_or(CuError(cu::INVALID_VALUE))?;
        self.forget(&e);
        if e.lease.is_some() || e.range.pages_owned_by_session() {
            // Dropping the lease returns the space to the area's allocator; pages in a device
            // reservation are the session's to free.
            return Ok(());
        }
        let r = e.range;
        // SAFETY: `r` is a mapping `alloc` made of `r.mapped` bytes at `r.base`, removed from
        // the table above so it is unmapped once; CUDA's contract makes the caller stop using
        // it.
        let res = unsafe { rustix::mm::munmap(r.base as usize as *mut _, r.mapped as usize) };
        if let Err(e) = res {
            tracing::warn!("remora: unmapping host memory at {:#x} failed: {e}", r.base);
        }
        Ok(())
    }

    /// Records a registered range (`cuMemHostRegister`).
    pub fn register(&self, ptr: u64, size: u64, flags: u32, ctx: RmHandle) -> CuResult<()> {
        if ptr == 0 || size == 0 || ptr.checked_add(size).is_none() {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let mut m = self.lock();
        if Self::overlaps(&m, ptr, size) {
            return Err(CuError(cu::HOST_MEMORY_ALREADY_REGISTERED));
        }
        let range = HostRange {
            registered: true,
            ..HostRange::new(ptr, size, flags, ctx)
        };
        m.insert(ptr, Entry { range, lease: None });
        Ok(())
    }

    /// Forgets a registered range (`cuMemHostUnregister`); `ptr` must be its base.
    pub fn unregister(&self, ptr: u64) -> CuResult<()> {
        let mut m = self.lock();
        match m.get(&ptr) {
            Some(e) if e.range.registered => {
                if let Some(e) = m.remove(&ptr) {
                    self.forget(&e);
                }
                Ok(())
            }
            _ => Err(CuError(cu::HOST_MEMORY_NOT_REGISTERED)),
        }
    }

    /// Number of tracked ranges.
    pub fn len(&self) -> usize {
        self.lock().len()
    }

    /// Whether no range is tracked.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for HostMem {
    fn drop(&mut self) {
        let m = self.ranges.get_mut().unwrap_or_else(|e| e.into_inner());
        for r in m
            .values()
            .filter(|e| {
                !e.range.registered && e.lease.is_none() && !e.range.pages_owned_by_session()
            })
            .map(|e| e.range)
        {
            // SAFETY: mappings made by `alloc`, not freed; the table is going away.
            let _ = unsafe { rustix::mm::munmap(r.base as usize as *mut _, r.mapped as usize) };
        }
    }
}

/// The part of a data area of `area_len` bytes that pinned allocations leave free for the
/// staging of pageable copies: a quarter of the area, at most 32 MiB (two 16 MiB chunks).
pub(crate) fn staging_reserve(area_len: u64) -> u64 {
    (area_len / 4).min(32 << 20)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn alloc_is_page_aligned_writable_and_tracked() {
        let h = HostMem::default();
        let p = h.alloc(10_000, 1, 7).unwrap();
        assert_eq!(p % rustix::param::page_size() as u64, 0);
        // SAFETY: 10 000 bytes were just allocated at `p`.
        unsafe {
            let s = std::slice::from_raw_parts_mut(p as usize as *mut u8, 10_000);
            assert!(s.iter().all(|b| *b == 0));
            s[9_999] = 5;
        }
        let r = h.find(p + 9_999).unwrap();
        assert_eq!(
            (r.base, r.size, r.flags, r.ctx, r.registered),
            (p, 10_000, 1, 7, false)
        );
        assert_eq!(h.find(p + 10_000), None);
        assert_eq!(h.free(p + 1), Err(CuError(cu::INVALID_VALUE)));
        h.free(p).unwrap();
        assert_eq!(h.find(p), None);
        assert_eq!(h.free(p), Err(CuError(cu::INVALID_VALUE)));
    }

    #[test]
    fn zero_bytes_still_gets_a_pointer() {
        let h = HostMem::default();
        let p = h.alloc(0, 0, 1).unwrap();
        assert_ne!(p, 0);
        assert_eq!(h.find(p).map(|r| r.size), Some(0));
        h.free(p).unwrap();
        assert!(h.is_empty());
    }

    #[test]
    fn register_checks_overlap_and_unregister_the_base() {
        let h = HostMem::default();
        let buf = vec![0u8; 4096];
        let p = buf.as_ptr() as u64;
        assert_eq!(h.register(0, 16, 0, 1), Err(CuError(cu::INVALID_VALUE)));
        assert_eq!(h.register(p, 0, 0, 1), Err(CuError(cu::INVALID_VALUE)));
        h.register(p + 100, 1000, 2, 1).unwrap();
        assert_eq!(
            h.register(p, 200, 0, 1),
            Err(CuError(cu::HOST_MEMORY_ALREADY_REGISTERED))
        );
        assert_eq!(
            h.register(p + 500, 10, 0, 1),
            Err(CuError(cu::HOST_MEMORY_ALREADY_REGISTERED))
        );
        h.register(p + 1100, 10, 0, 1).unwrap();
        assert!(h.find(p + 1099).unwrap().registered);
        assert_eq!(h.find(p + 99), None);
        // cuMemFreeHost does not free registered memory.
        assert_eq!(h.free(p + 100), Err(CuError(cu::INVALID_VALUE)));
        assert_eq!(
            h.unregister(p + 101),
            Err(CuError(cu::HOST_MEMORY_NOT_REGISTERED))
        );
        h.unregister(p + 100).unwrap();
        h.unregister(p + 1100).unwrap();
        assert!(h.is_empty());
        drop(buf);
    }
}
