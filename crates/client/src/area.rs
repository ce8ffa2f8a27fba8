//! The client's allocator of the shared data area (revision 6, sessions in shared memory).
//!
//! The client decides where bulk bytes go in the area: copies take a [`Lease`] of space, put
//! their bytes there (or have the server write them there) and name `(offset, size)` in the
//! call; the lease returns the space when dropped. The server only checks the numbers
//! against the area's size. First fit over a free list kept by offset, with neighbours merged
//! on free; every block is a multiple of [`GRAIN`] bytes.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use remora_oncrpc::DataArea;

/// Allocation granule (a cache line pair: no two leases share a line).
const GRAIN: u64 = 128;

/// The data area and its free space.
#[derive(Debug)]
pub(crate) struct AreaAlloc {
    area: DataArea,
    /// Free blocks: offset → length.
    free: Mutex<BTreeMap<u64, u64>>,
    /// Bytes this client has copied into or out of the area ([`Lease::put`]/[`Lease::get`]):
    /// a test hook that shows zero-copy transfers copy nothing.
    copied: AtomicU64,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

impl AreaAlloc {
    /// An allocator over all of `area`.
    pub(crate) fn new(area: DataArea) -> Arc<Self> {
        let size = area.len() as u64 / GRAIN * GRAIN;
        let mut free = BTreeMap::new();
        if size > 0 {
            free.insert(0, size);
        }
        Arc::new(Self {
            area,
            free: Mutex::new(free),
            copied: AtomicU64::new(0),
        })
    }

    /// Whether the server maps the area at the same address as this process.
    pub(crate) fn same_address_as_peer(&self) -> bool {
        self.area.same_address_as_peer()
    }

    /// The address of the area's first byte in this process.
    pub(crate) fn base(&self) -> u64 {
        self.area.base() as u64
    }

    /// Bytes of the area.
    pub(crate) fn len(&self) -> u64 {
        self.area.len() as u64
    }

    /// Takes `len` bytes (at least one granule) aligned to `align` (a power of two, at least
    /// [`GRAIN`]); `None` when no free block fits.
    pub(crate) fn alloc(self: &Arc<Self>, len: u64, align: u64) -> Option<Lease> {
        let align = align.max(GRAIN);
        if !align.is_power_of_two() {
            return None;
        }
        let want = len.max(1).checked_next_multiple_of(GRAIN)?;
        let mut free = lock(&self.free);
        let (&at, &blen, start) = free.iter().find_map(|(at, blen)| {
            let start = at.checked_next_multiple_of(align)?;
            (start.checked_add(want)? <= at + blen).then_some((at, blen, start))
        })?;
        free.remove(&at);
        if start > at {
            free.insert(at, start - at);
        }
        let end = start + want;
        if end < at + blen {
            free.insert(end, at + blen - end);
        }
        Some(Lease {
            alloc: Arc::clone(self),
            offset: start,
            len: want,
        })
    }

    fn release(&self, offset: u64, len: u64) {
        let mut free = lock(&self.free);
        let (mut start, mut end) = (offset, offset + len);
        if let Some((&p, &plen)) = free.range(..offset).next_back()
            && p + plen == offset
        {
            free.remove(&p);
            start = p;
        }
        if let Some(&nlen) = free.get(&end) {
            free.remove(&end);
            end += nlen;
        }
        free.insert(start, end - start);
    }

    /// Bytes free now.
    pub(crate) fn free_bytes(&self) -> u64 {
        lock(&self.free).values().sum()
    }

    /// Bytes copied by this client into or out of the area so far.
    pub(crate) fn copied_bytes(&self) -> u64 {
        self.copied.load(Ordering::Relaxed)
    }
}

/// Space of the data area, returned when dropped.
#[derive(Debug)]
pub(crate) struct Lease {
    alloc: Arc<AreaAlloc>,
    offset: u64,
    len: u64,
}

impl Lease {
    /// Offset in the area.
    pub(crate) fn offset(&self) -> u64 {
        self.offset
    }

    /// The lease's first byte in this process.
    pub(crate) fn addr(&self) -> u64 {
        // `offset + len` lies inside the area (the allocator only hands out its blocks).
        self.alloc.area.base() as u64 + self.offset
    }

    /// Zero-fills the lease.
    pub(crate) fn zero(&self) {
        if let Ok(p) = self.alloc.area.ptr(self.offset, self.len) {
            // SAFETY: `p..p + len` lies inside the mapping (bounds checked by `ptr`), which
            // lives while `self.alloc` does; the lease is this client's own space.
            unsafe { std::ptr::write_bytes(p, 0, self.len as usize) };
        }
    }

    /// Counts a copy of `len` bytes into or out of the lease (`Session::area_bytes_copied`);
    /// whether it fits in the lease.
    fn count_copy(&self, len: usize) -> bool {
        self.alloc.copied.fetch_add(len as u64, Ordering::Relaxed);
        len as u64 <= self.len
    }

    /// Copies `data` to the start of the lease (at most its length). Large copies are split
    /// between two threads: one core copies about 8 GB/s, less than the DMA on the other side
    /// of the area (measured on the H100 host: pageable copies were bounded by this copy).
    pub(crate) fn put(&self, data: &[u8]) -> bool {
        if !self.count_copy(data.len()) {
            return false;
        }
        let area = &self.alloc.area;
        in_halves(data.len(), data, <[u8]>::split_at, |at, part| {
            area.write(self.offset + at, part).is_ok()
        })
    }

    /// Copies the first `out.len()` bytes of the lease out (large copies on two threads, as
    /// [`Lease::put`]).
    pub(crate) fn get(&self, out: &mut [u8]) -> bool {
        if !self.count_copy(out.len()) {
            return false;
        }
        let area = &self.alloc.area;
        in_halves(out.len(), out, <[u8]>::split_at_mut, |at, part| {
            area.read(self.offset + at, part).is_ok()
        })
    }
}

/// Copies of at least this many bytes use two threads (a thread costs tens of microseconds;
/// 2 MiB take about 250 µs on one core).
const PARALLEL_COPY_BYTES: usize = 2 << 20;

/// Runs `copy(offset in the buffer, part)` over the `len` bytes of `buf`: at once, or, from
/// [`PARALLEL_COPY_BYTES`] on, as two halves on two threads. True when every part copied.
fn in_halves<B: Send>(
    len: usize,
    buf: B,
    split: impl FnOnce(B, usize) -> (B, B),
    copy: impl Fn(u64, B) -> bool + Sync,
) -> bool {
    match split_point(len) {
        None => copy(0, buf),
        Some(half) => {
            let (a, b) = split(buf, half);
            std::thread::scope(|s| {
                let first = s.spawn(|| copy(0, a));
                let second = copy(half as u64, b);
                first.join().unwrap_or(false) && second
            })
        }
    }
}

/// Where a copy of `len` bytes is split between two threads (page-aligned), if it is.
fn split_point(len: usize) -> Option<usize> {
    (len >= PARALLEL_COPY_BYTES).then_some((len / 2) & !4095)
}

impl Drop for Lease {
    fn drop(&mut self) {
        self.alloc.release(self.offset, self.len);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn first_fit_alignment_and_merge() {
        let region = remora_oncrpc_test_area();
        let a = AreaAlloc::new(region);
        let total = a.free_bytes();
        let x = a.alloc(1, 1).unwrap();
        let y = a.alloc(5000, 4096).unwrap();
        assert_eq!(x.offset(), 0);
        assert_eq!(y.offset() % 4096, 0);
        assert!(a.alloc(total, 1).is_none());
        drop(x);
        drop(y);
        assert_eq!(a.free_bytes(), total);
        let all = a.alloc(total, 1).unwrap();
        assert_eq!(all.offset(), 0);
        assert!(a.alloc(1, 1).is_none());
        assert!(all.put(&[1, 2, 3]));
        let mut back = [0u8; 3];
        assert!(all.get(&mut back));
        assert_eq!(back, [1, 2, 3]);
    }

    #[test]
    fn large_copies_split_between_threads_round_trip() {
        let layout = remora_shm::Layout {
            ring_capacity: 4096,
            data_size: 8 << 20,
        };
        let a = AreaAlloc::new(
            remora_shm::Region::create("area-split", layout)
                .unwrap()
                .data_area(),
        );
        for n in [
            PARALLEL_COPY_BYTES - 1,
            PARALLEL_COPY_BYTES,
            (5 << 20) + 12345,
        ] {
            let lease = a.alloc(n as u64, 4096).unwrap();
            let data: Vec<u8> = (0..n).map(|i| (i * 7 + i / 4096) as u8).collect();
            assert!(lease.put(&data));
            let mut back = vec![0u8; n];
            assert!(lease.get(&mut back));
            assert!(back == data, "{n} bytes");
            assert!(!lease.put(&vec![0u8; n + 4096]), "longer than the lease");
        }
        assert_eq!(split_point(PARALLEL_COPY_BYTES - 1), None);
        assert_eq!(split_point(3 << 20), Some(3 << 19));
    }

    fn remora_oncrpc_test_area() -> DataArea {
        let layout = remora_shm::Layout {
            ring_capacity: 4096,
            data_size: 1 << 16,
        };
        remora_shm::Region::create("area-test", layout)
            .unwrap()
            .data_area()
    }
}
