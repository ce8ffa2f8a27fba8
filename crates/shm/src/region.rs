//! The shared region: a memfd holding a small header, the request ring, the response ring
//! and a data area, mapped by the server (which creates it) and the client (which receives the
//! descriptor over its Unix socket with SCM_RIGHTS).

use std::os::fd::{AsFd, OwnedFd};
use std::sync::Arc;

use rustix::fs::{MemfdFlags, SealFlags};
use rustix::mm::{MapFlags, ProtFlags};

use crate::ring::{Consumer, Producer, RING_HEADER};

/// `REMORASH` in ASCII: the first word of every region.
const MAGIC: u64 = u64::from_be_bytes(*b"REMORASH");
/// Version of the region layout.
const VERSION: u32 = 1;
/// Bytes of the region header (one page keeps the rings page-aligned).
const HEADER: usize = 4096;

/// Why a region could not be made or mapped.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    /// The layout asks for something impossible.
    #[error("invalid shared-memory layout: {0}")]
    Layout(&'static str),
    /// A system call failed.
    #[error("shared-memory region: {what}: {source}")]
    Os {
        /// What was being done.
        what: &'static str,
        /// The error.
        source: rustix::io::Errno,
    },
    /// The descriptor received does not hold the region that was announced.
    #[error("the shared-memory region received does not match the announced layout: {0}")]
    Mismatch(&'static str),
}

/// Sizes of a region, agreed in the handshake; both sides compute every offset from it and
/// never from the shared memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Layout {
    /// Bytes of each ring's message area: a power of two, at least 4096.
    pub ring_capacity: u32,
    /// Bytes of the data area, a multiple of 4096.
    pub data_size: u64,
}

impl Layout {
    fn check(&self) -> Result<(), RegionError> {
        if !self.ring_capacity.is_power_of_two() || self.ring_capacity < 4096 {
            return Err(RegionError::Layout(
                "the ring capacity must be a power of two of at least 4096 bytes",
            ));
        }
        if self.ring_capacity > 1 << 30 {
            return Err(RegionError::Layout("the ring capacity is above 1 GiB"));
        }
        if !self.data_size.is_multiple_of(4096) || self.data_size > 1 << 40 {
            return Err(RegionError::Layout(
                "the data area must be a multiple of 4096 bytes and at most 1 TiB",
            ));
        }
        Ok(())
    }

    fn ring_bytes(&self) -> usize {
        (RING_HEADER + self.ring_capacity as usize).next_multiple_of(4096)
    }

    fn request_offset(&self) -> usize {
        HEADER
    }

    fn response_offset(&self) -> usize {
        HEADER + self.ring_bytes()
    }

    /// Offset of the data area in the region.
    pub fn data_offset(&self) -> usize {
        HEADER + 2 * self.ring_bytes()
    }

    /// Total bytes of the region.
    pub fn total(&self) -> usize {
        self.data_offset() + self.data_size as usize
    }
}

/// A shared mapping; unmapped when the last ring endpoint and the region are gone.
#[derive(Debug)]
pub(crate) struct Mapping {
    ptr: *mut u8,
    len: usize,
    /// Where the peer maps the same memory, when known (the client learns the server's
    /// address in the setup reply).
    peer_base: Option<usize>,
}

// SAFETY: the mapping is plain shared memory; every access to it goes through atomics or
// byte copies that tolerate concurrent writers (see ring.rs), so it may move between threads.
unsafe impl Send for Mapping {}
// SAFETY: as above; `&Mapping` only hands out the base pointer.
unsafe impl Sync for Mapping {}

impl Mapping {
    /// A private anonymous mapping (tests and fuzzing: both ends in one process).
    pub(crate) fn anonymous(len: usize) -> Result<Self, RegionError> {
        // SAFETY: a fresh mapping at an address of the kernel's choosing.
        Self::from_mmap(len, unsafe {
            rustix::mm::mmap_anonymous(std::ptr::null_mut(), len, Self::PROT, MapFlags::SHARED)
        })
    }

    fn shared(fd: &OwnedFd, len: usize) -> Result<Self, RegionError> {
        // SAFETY: maps `len` bytes of the memfd, which is at least that long (checked by the
        // callers), at an address of the kernel's choosing.
        Self::from_mmap(len, unsafe {
            rustix::mm::mmap(
                std::ptr::null_mut(),
                len,
                Self::PROT,
                MapFlags::SHARED,
                fd.as_fd(),
                0,
            )
        })
    }

    /// As [`Mapping::shared`], but at `at` if that range is free in this process
    /// (`MAP_FIXED_NOREPLACE`: nothing mapped there is ever replaced); elsewhere if it is not.
    fn shared_at(fd: &OwnedFd, len: usize, at: usize) -> Result<Self, RegionError> {
        if at == 0 || !at.is_multiple_of(4096) {
            return Self::shared(fd, len);
        }
        // SAFETY: asks for `len` bytes of the memfd (at least that long) at `at`; with
        // FIXED_NOREPLACE the kernel fails instead of replacing an existing mapping, so no
        // memory of this process can be clobbered.
        let fixed = Self::from_mmap(len, unsafe {
            rustix::mm::mmap(
                at as *mut std::ffi::c_void,
                len,
                Self::PROT,
                MapFlags::SHARED | MapFlags::FIXED_NOREPLACE,
                fd.as_fd(),
                0,
            )
        });
        match fixed {
            // Kernels before 4.17 ignore the flag and may map elsewhere: that is fine too.
            Ok(m) => Ok(m),
            Err(_) => Self::shared(fd, len),
        }
    }

    const PROT: ProtFlags = ProtFlags::READ.union(ProtFlags::WRITE);

    fn from_mmap(
        len: usize,
        mapped: rustix::io::Result<*mut std::ffi::c_void>,
    ) -> Result<Self, RegionError> {
        let ptr = mapped.map_err(|source| RegionError::Os {
            what: "mmap",
            source,
        })?;
        Ok(Self {
            ptr: ptr.cast(),
            len,
            peer_base: None,
        })
    }

    pub(crate) fn base(&self) -> *mut u8 {
        self.ptr
    }

    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Whether the peer maps this memory at the same virtual address as this process.
    pub(crate) fn same_address_as_peer(&self) -> bool {
        self.peer_base == Some(self.ptr as usize)
    }
}

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: `ptr`/`len` is a mapping this object made and nothing uses it any more
        // (ring endpoints hold an Arc of it).
        let _ = unsafe { rustix::mm::munmap(self.ptr.cast(), self.len) };
    }
}

/// One session's shared region.
#[derive(Debug)]
pub struct Region {
    fd: OwnedFd,
    map: Arc<Mapping>,
    layout: Layout,
}

#[repr(C)]
struct Header {
    magic: u64,
    version: u32,
    ring_capacity: u32,
    data_size: u64,
}

/// The `Region` methods that open one end of one ring.
macro_rules! ring_ends {
    ($($(#[$doc:meta])* $name:ident: $end:ident at $offset:ident;)*) => {$(
        $(#[$doc])*
        pub fn $name(&self) -> $end {
            $end::new(Arc::clone(&self.map), self.layout.$offset(), self.layout.ring_capacity)
        }
    )*};
}

impl Region {
    /// Creates a region (server side): a sealed-size memfd named `name`, zero-filled.
    pub fn create(name: &str, layout: Layout) -> Result<Self, RegionError> {
        layout.check()?;
        let os = |what| move |source| RegionError::Os { what, source };
        let fd = rustix::fs::memfd_create(name, MemfdFlags::CLOEXEC | MemfdFlags::ALLOW_SEALING)
            .map_err(os("memfd_create"))?;
        rustix::fs::ftruncate(&fd, layout.total() as u64).map_err(os("ftruncate"))?;
        // Neither side can resize the region under the other's mapping (a shrink would turn
        // accesses into SIGBUS).
        rustix::fs::fcntl_add_seals(&fd, SealFlags::SHRINK | SealFlags::GROW | SealFlags::SEAL)
            .map_err(os("fcntl(F_ADD_SEALS)"))?;
        let map = Mapping::shared(&fd, layout.total())?;
        let header = Header {
            magic: MAGIC,
            version: VERSION,
            ring_capacity: layout.ring_capacity,
            data_size: layout.data_size,
        };
        // SAFETY: the mapping is at least HEADER bytes, page-aligned, and nobody else has it
        // yet.
        unsafe { map.base().cast::<Header>().write(header) };
        Ok(Self {
            fd,
            map: Arc::new(map),
            layout,
        })
    }

    /// Maps a region received from the server (client side), checking that it is sealed at
    /// the announced size and carries the announced layout.
    pub fn open(fd: OwnedFd, layout: Layout) -> Result<Self, RegionError> {
        Self::open_at(fd, layout, None)
    }

    /// As [`Region::open`], trying first to map the region at `peer_base`, the address where
    /// the server mapped it: when that range is free here, both processes see the region at
    /// the same addresses, so a pointer into the data area means the same bytes on both sides
    /// (what a GPU kernel given a mapped host pointer needs; see
    /// `DataArea::same_address_as_peer`).
    pub fn open_at(
        fd: OwnedFd,
        layout: Layout,
        peer_base: Option<usize>,
    ) -> Result<Self, RegionError> {
        layout.check()?;
        let st = rustix::fs::fstat(&fd).map_err(|source| RegionError::Os {
            what: "fstat",
            source,
        })?;
        if st.st_size as u64 != layout.total() as u64 {
            return Err(RegionError::Mismatch("its size differs"));
        }
        let seals = rustix::fs::fcntl_get_seals(&fd).map_err(|source| RegionError::Os {
            what: "fcntl(F_GET_SEALS)",
            source,
        })?;
        if !seals.contains(SealFlags::SHRINK) {
            return Err(RegionError::Mismatch("it can be shrunk (not sealed)"));
        }
        let mut map = match peer_base {
            Some(at) => Mapping::shared_at(&fd, layout.total(), at)?,
            None => Mapping::shared(&fd, layout.total())?,
        };
        map.peer_base = peer_base;
        // SAFETY: the mapping holds at least HEADER bytes; the header is copied out once.
        let h = unsafe { map.base().cast::<Header>().read_volatile() };
        if h.magic != MAGIC || h.version != VERSION {
            return Err(RegionError::Mismatch("no Remora region header"));
        }
        if h.ring_capacity != layout.ring_capacity || h.data_size != layout.data_size {
            return Err(RegionError::Mismatch("its header announces other sizes"));
        }
        Ok(Self {
            fd,
            map: Arc::new(map),
            layout,
        })
    }

    /// The memfd, to pass to the peer.
    pub fn fd(&self) -> &OwnedFd {
        &self.fd
    }

    /// The address of the region in this process.
    pub fn base_address(&self) -> usize {
        self.map.base() as usize
    }

    /// The layout.
    pub fn layout(&self) -> Layout {
        self.layout
    }

    ring_ends! {
        /// The producing end of the request ring (client side).
        request_producer: Producer at request_offset;
        /// The consuming end of the request ring (server side).
        request_consumer: Consumer at request_offset;
        /// The producing end of the response ring (server side).
        response_producer: Producer at response_offset;
        /// The consuming end of the response ring (client side).
        response_consumer: Consumer at response_offset;
    }

    /// A handle on the data area (keeps the mapping alive).
    pub fn data_area(&self) -> crate::DataArea {
        // The layout was checked: data_offset + data_size = total = the mapping's length.
        crate::DataArea::new(
            Arc::clone(&self.map),
            self.layout.data_offset(),
            self.layout.data_size as usize,
        )
    }

    /// The data area: base pointer and length. Shared with the peer, which may write it at
    /// any time.
    pub fn data(&self) -> (*mut u8, usize) {
        debug_assert!(self.layout.data_offset() + self.layout.data_size as usize <= self.map.len());
        // SAFETY: data_offset is inside the mapping (total() = data_offset + data_size).
        let p = unsafe { self.map.base().add(self.layout.data_offset()) };
        (p, self.layout.data_size as usize)
    }
}
