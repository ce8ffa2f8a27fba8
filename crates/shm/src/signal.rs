//! Completion words: a page of the region where the GPU says that a stream has reached a
//! point, so that a colocated client sees a synchronize complete in shared memory instead of
//! waiting for a reply (issue 12 §3).
//!
//! The words live in the second half of the region's header page (the header itself takes
//! its first bytes). The client picks a free slot and a fresh sequence number, asks the
//! server (one-way) to have the stream write that number into the slot when it gets there
//! (`cuStreamWriteValue64` into the page, registered for the device), and polls the slot. The
//! server may instead write the number with [`SIGNAL_FALLBACK`] set, at once, when the client
//! must make the full synchronizing call (an error to report, output to deliver); when it has
//! the stream write the number, it first writes the number with [`SIGNAL_QUEUED`] set itself,
//! so that the client knows the server has got to its request. The client
//! only ever acts on its own exact number: a slot's stale value from an earlier use never
//! matches.

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use crate::region::Mapping;

/// Offset of the first completion word in the region.
pub const SIGNAL_OFFSET: usize = 2048;
/// Number of completion words.
pub const SIGNAL_SLOTS: usize = 256;
/// Set in a word by the server instead of the stream: make the full synchronizing call.
pub const SIGNAL_FALLBACK: u64 = 1 << 63;
/// Set in a word by the server, with the number, just before it queues the stream's write
/// (session 41): from then on the word's end is the device's alone, with no host thread of
/// the server's left to run. A client that does not know it sees a number not its own and
/// goes on looking, as before.
pub const SIGNAL_QUEUED: u64 = 1 << 62;
/// The bits of a word that are not the number.
pub const SIGNAL_FLAGS: u64 = SIGNAL_FALLBACK | SIGNAL_QUEUED;
/// Bytes of the page holding the words (from the region's start).
pub const SIGNAL_PAGE: usize = 4096;

const _: () = assert!(SIGNAL_OFFSET + SIGNAL_SLOTS * 8 <= SIGNAL_PAGE);

/// The completion words of a mapped region; clones share the mapping, which stays mapped
/// while any handle lives.
#[derive(Clone)]
pub struct Signals {
    map: Arc<Mapping>,
}

impl std::fmt::Debug for Signals {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Signals")
            .field("page", &self.page())
            .finish()
    }
}

impl Signals {
    pub(crate) fn new(map: Arc<Mapping>) -> Option<Self> {
        (map.len() >= SIGNAL_PAGE).then_some(Self { map })
    }

    /// Word `slot` (`None` past [`SIGNAL_SLOTS`]). The peer and the GPU write it at any time.
    pub fn word(&self, slot: usize) -> Option<&AtomicU64> {
        if slot >= SIGNAL_SLOTS {
            return None;
        }
        // SAFETY: the word lies inside the mapping's first page (checked in `new` and by the
        // constant assertion above), is 8-aligned (the mapping is page-aligned, the offset a
        // multiple of 8), and lives as long as `self` holds the mapping. Atomics tolerate the
        // peer's and the device's concurrent writes.
        Some(unsafe {
            &*self
                .map
                .base()
                .add(SIGNAL_OFFSET + slot * 8)
                .cast::<AtomicU64>()
        })
    }

    /// The page holding the words, in this process: what a backend registers for the
    /// device.
    pub fn page(&self) -> *mut u8 {
        self.map.base()
    }
}
