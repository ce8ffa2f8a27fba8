//! The server-wide kernel image cache, keyed by SHA-256, bounded in bytes, least recently used
//! out first. Shared by every session, so a client that loads an image another client sent
//! sends only its hash.

use std::collections::HashMap;
use std::sync::{Mutex, MutexGuard, PoisonError};

use remora_xdr::Bytes;

/// Default bound of the cache: 1 GiB.
pub const DEFAULT_CACHE_BYTES: u64 = 1 << 30;

#[derive(Default)]
struct State {
    map: HashMap<[u8; 32], (Bytes, u64)>,
    total: u64,
    tick: u64,
}

/// Kernel images by hash.
pub(crate) struct ModuleCache {
    capacity: u64,
    state: Mutex<State>,
}

impl ModuleCache {
    pub(crate) fn new(capacity: u64) -> Self {
        Self {
            capacity,
            state: Mutex::new(State::default()),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    pub(crate) fn len(&self) -> usize {
        self.lock().map.len()
    }

    /// The image with `hash`, marking it recently used.
    pub(crate) fn get(&self, hash: &[u8; 32]) -> Option<Bytes> {
        let mut st = self.lock();
        st.tick += 1;
        let tick = st.tick;
        st.map.get_mut(hash).map(|(image, used)| {
            *used = tick;
            image.clone()
        })
    }

    /// Adds an image (whose hash the caller has verified), evicting the least recently used
    /// ones to stay within the bound. An image larger than the whole cache is not kept.
    pub(crate) fn insert(&self, hash: [u8; 32], image: Bytes) {
        let size = image.len() as u64;
        if size > self.capacity {
            return;
        }
        let mut st = self.lock();
        st.tick += 1;
        let tick = st.tick;
        if let Some((_, used)) = st.map.get_mut(&hash) {
            *used = tick;
            return;
        }
        while st.total + size > self.capacity {
            let Some(oldest) = st.map.iter().min_by_key(|(_, (_, t))| *t).map(|(h, _)| *h) else {
                break;
            };
            if let Some((old, _)) = st.map.remove(&oldest) {
                st.total -= old.len() as u64;
            }
        }
        st.total += size;
        // Keep a copy of its own, not a view that pins the whole received record.
        st.map.insert(hash, (Bytes::copy_from_slice(&image), tick));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn evicts_least_recently_used_within_the_bound() {
        let c = ModuleCache::new(10);
        c.insert([1; 32], Bytes::from_static(b"aaaa"));
        c.insert([2; 32], Bytes::from_static(b"bbbb"));
        assert!(c.get(&[1; 32]).is_some());
        c.insert([3; 32], Bytes::from_static(b"cccc"));
        assert!(c.get(&[2; 32]).is_none(), "2 was least recently used");
        assert!(c.get(&[1; 32]).is_some() && c.get(&[3; 32]).is_some());
        c.insert([4; 32], Bytes::from(vec![0u8; 11]));
        assert!(c.get(&[4; 32]).is_none(), "larger than the cache");
    }
}
