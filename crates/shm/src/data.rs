//! The data area of a region: bulk bytes of copies, passed by (offset, length) instead of
//! travelling inside the RPC records.
//!
//! Both sides map it, and the peer may write any byte of it at any time. So every offset and
//! length is bounded against the area before the mapping is touched, and a reader that needs
//! a stable value copies the bytes out once ([`DataArea::read`]) and works on its copy.

use std::sync::Arc;

use crate::region::Mapping;

/// An (offset, length) that does not lie inside the data area.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("{len} bytes at offset {offset} do not lie inside the {size}-byte data area")]
pub struct OutOfArea {
    /// The offset asked for.
    pub offset: u64,
    /// The length asked for.
    pub len: u64,
    /// Bytes of the data area.
    pub size: u64,
}

/// A handle on the data area of a mapped region; clones share the mapping, which stays
/// mapped while any handle lives.
#[derive(Clone)]
pub struct DataArea {
    map: Arc<Mapping>,
    /// Offset of the area in the mapping.
    start: usize,
    /// Bytes of the area.
    size: usize,
}

impl std::fmt::Debug for DataArea {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DataArea")
            .field("base", &self.base())
            .field("size", &self.size)
            .finish()
    }
}

impl DataArea {
    /// The area `start..start + size` of `map`, clamped to the mapping.
    pub(crate) fn new(map: Arc<Mapping>, start: usize, size: usize) -> Self {
        let start = start.min(map.len());
        let size = size.min(map.len() - start);
        Self { map, start, size }
    }

    /// Bytes of the area.
    pub fn len(&self) -> usize {
        self.size
    }

    /// Whether the area has no bytes (a session without one).
    pub fn is_empty(&self) -> bool {
        self.size == 0
    }

    /// Whether the peer (the server, seen from a client) maps the area at the same virtual
    /// address as this process, so that a pointer into it names the same bytes on both sides.
    pub fn same_address_as_peer(&self) -> bool {
        self.map.same_address_as_peer()
    }

    /// The region's completion words ([`crate::Signals`]), when the mapping is a whole
    /// region (the area starts after the header page; not so in tests of the area alone).
    pub fn signals(&self) -> Option<crate::Signals> {
        if self.start < crate::SIGNAL_PAGE {
            return None;
        }
        crate::Signals::new(Arc::clone(&self.map))
    }

    /// The first byte of the area in this process.
    pub fn base(&self) -> *mut u8 {
        // SAFETY: `start <= map.len()` (clamped in `new`), so the result is inside the
        // mapping or one past its end, never dereferenced here.
        unsafe { self.map.base().add(self.start) }
    }

    /// Checks that `len` bytes at `offset` lie inside the area and gives them as a range of
    /// `usize`. Every offset and length from the wire goes through here first.
    pub fn check(&self, offset: u64, len: u64) -> Result<std::ops::Range<usize>, OutOfArea> {
        let err = OutOfArea {
            offset,
            len,
            size: self.size as u64,
        };
        let end = offset.checked_add(len).ok_or(err)?;
        if end > self.size as u64 {
            return Err(err);
        }
        // Both fit in usize: they are at most `size`.
        Ok(offset as usize..end as usize)
    }

    /// A raw pointer to `len` bytes at `offset`, after the bounds check: for DMA by a
    /// driver. The peer may change those bytes at any time.
    pub fn ptr(&self, offset: u64, len: u64) -> Result<*mut u8, OutOfArea> {
        let r = self.check(offset, len)?;
        // SAFETY: `r.start <= size`, so the pointer stays inside the area (or one past it).
        Ok(unsafe { self.base().add(r.start) })
    }

    /// The offset in the area of `len` bytes at address `ptr` of this process, if they lie
    /// entirely inside it.
    pub fn offset_of(&self, ptr: u64, len: u64) -> Option<u64> {
        let base = self.base() as u64;
        let off = ptr.checked_sub(base)?;
        self.check(off, len).ok().map(|_| off)
    }

    /// Copies `out.len()` bytes at `offset` out of the area (once: what the caller then
    /// checks or uses cannot change under it).
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), OutOfArea> {
        let p = self.ptr(offset, out.len() as u64)?;
        // SAFETY: `p..p + out.len()` lies inside the mapping (bounds checked above), which
        // lives as long as `self`; `out` is private memory, so the two do not overlap. The
        // peer may write the source meanwhile: the bytes copied are then some mix of old and
        // new, which callers tolerate (they are plain data, never trusted).
        unsafe { std::ptr::copy_nonoverlapping(p, out.as_mut_ptr(), out.len()) };
        Ok(())
    }

    /// Faults the pages holding `len` bytes at `offset` in as writable, without changing a
    /// byte of them (`MADV_POPULATE_WRITE`): a fresh shared mapping otherwise zero-fills each
    /// page on its first touch, one fault at a time, and page-locking it for a device pays for
    /// that. The range is widened to whole pages. `Unsupported` on a kernel without
    /// `MADV_POPULATE_WRITE` (before Linux 5.14).
    pub fn populate(&self, offset: u64, len: u64) -> std::io::Result<()> {
        let r = self
            .check(offset, len)
            .map_err(|e| std::io::Error::new(std::io::ErrorKind::InvalidInput, e))?;
        if r.is_empty() {
            return Ok(());
        }
        let page = rustix::param::page_size();
        let start = self.base().wrapping_add(r.start);
        let lead = start as usize % page;
        let first = start.wrapping_sub(lead);
        // SAFETY: `start..start + r.len()` lies inside this live mapping (checked above), and
        // the mapping begins on a page boundary (mmap), so `first`, `start` rounded down to
        // its page, lies inside it too (perhaps before the area: harmless, see below); the
        // kernel widens the length to whole pages, which the mapping has.
        // MADV_POPULATE_WRITE only faults pages in and changes no byte, so the peer's and
        // this process's concurrent accesses see the same contents.
        unsafe {
            rustix::mm::madvise(
                first.cast(),
                lead + r.len(),
                rustix::mm::Advice::LinuxPopulateWrite,
            )
        }
        .map_err(|e| {
            if e == rustix::io::Errno::INVAL {
                std::io::Error::new(
                    std::io::ErrorKind::Unsupported,
                    "MADV_POPULATE_WRITE is not supported by this kernel (Linux 5.14 or later has it)",
                )
            } else {
                e.into()
            }
        })
    }

    /// Copies `data` into the area at `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), OutOfArea> {
        let p = self.ptr(offset, data.len() as u64)?;
        // SAFETY: as in `read`, with the roles swapped: the destination lies inside the
        // mapping, the source is private memory.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn area(size: usize) -> DataArea {
        let map = Arc::new(Mapping::anonymous(size + 4096).unwrap());
        DataArea::new(map, 4096, size)
    }

    #[test]
    fn bounds_are_checked() {
        let a = area(8192);
        assert!(a.check(0, 8192).is_ok());
        assert!(a.check(8192, 0).is_ok());
        assert!(a.check(8192, 1).is_err());
        assert!(a.check(1, 8192).is_err());
        assert!(a.check(u64::MAX, 2).is_err());
        assert!(a.check(2, u64::MAX).is_err());
        let mut buf = [0u8; 4];
        assert!(a.read(8190, &mut buf).is_err());
        assert!(a.write(8190, &buf).is_err());
    }

    /// Resident bytes of the mapping of this process that holds `addr` (`Rss` in
    /// /proc/self/smaps).
    fn resident_bytes(addr: *mut u8) -> u64 {
        let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap();
        let addr = addr as usize;
        let holds = |l: &str| {
            let range = l.split_whitespace().next().unwrap_or("");
            let Some((a, b)) = range.split_once('-') else {
                return false;
            };
            match (usize::from_str_radix(a, 16), usize::from_str_radix(b, 16)) {
                (Ok(a), Ok(b)) => (a..b).contains(&addr),
                _ => false,
            }
        };
        let rss = smaps
            .lines()
            .skip_while(|l| !holds(l))
            .skip(1)
            .find_map(|l| l.strip_prefix("Rss:"))
            .expect("the mapping is in /proc/self/smaps");
        rss.trim()
            .trim_end_matches("kB")
            .trim()
            .parse::<u64>()
            .unwrap()
            * 1024
    }

    #[test]
    fn populate_faults_pages_in_and_keeps_their_bytes() {
        let region = crate::Region::create(
            "remora-populate-test",
            crate::Layout {
                ring_capacity: 4096,
                data_size: 1 << 20,
            },
        )
        .unwrap();
        let a = region.data_area();
        a.write(70_000, b"kept").unwrap();
        let before = resident_bytes(a.base());
        match a.populate(65_536 + 100, 256 << 10) {
            Err(e) if e.kind() == std::io::ErrorKind::Unsupported => {
                eprintln!("skipped: {e}");
                return;
            }
            r => r.unwrap(),
        }
        let after = resident_bytes(a.base());
        // The 256 KiB range, widened to whole pages, is resident now (it was not: only the
        // header and the page written are).
        assert!(
            after >= before + (256 << 10) - 4096,
            "resident {before} -> {after} bytes"
        );
        let mut buf = [0u8; 4];
        a.read(70_000, &mut buf).unwrap();
        assert_eq!(&buf, b"kept");
        a.read(200_000, &mut buf).unwrap();
        assert_eq!(buf, [0; 4]);
        assert_eq!(
            a.populate(1 << 20, 1).unwrap_err().kind(),
            std::io::ErrorKind::InvalidInput
        );
        a.populate(1 << 20, 0).unwrap();
    }

    #[test]
    fn read_back_what_was_written() {
        let a = area(8192);
        a.write(100, b"remora").unwrap();
        let mut buf = [0u8; 6];
        a.read(100, &mut buf).unwrap();
        assert_eq!(&buf, b"remora");
        let p = a.ptr(100, 6).unwrap() as u64;
        assert_eq!(a.offset_of(p, 6), Some(100));
        assert_eq!(a.offset_of(p, 8093), None);
        assert_eq!(a.offset_of(a.base() as u64 - 1, 1), None);
    }
}
