//! Reuse of large buffers whose pages are already mapped.
//!
//! A bulk copy over a socket moves many records of a few MiB each. Allocating a fresh buffer
//! for each one costs a page fault per 4 KiB page (and the kernel zeroing it) the first time it
//! is touched, which on its own held socket copies near 1 GB/s. A [`Recycler`] keeps a clone of
//! the last few large buffers it handed out; once every other handle to one is gone (the reply
//! was written, the record was decoded and dropped) the next [`Recycler::take`] gets it back
//! without zeroing or faulting.
//!
//! ```text
//!  take(n) ──► BytesMut (reused if a kept buffer is unique and large enough, else new)
//!  keep(&Bytes) ──► a clone is kept (at most `slots` buffers and `max_bytes` bytes in all;
//!                   the oldest are let go)
//! ```

use std::collections::VecDeque;

use remora_xdr::{Bytes, BytesMut};

/// Keeps up to `slots` large buffers, at most `max_bytes` in all, for reuse. Not thread-safe
/// by itself: put it behind the lock of whatever owns it.
#[derive(Debug)]
pub struct Recycler {
    kept: VecDeque<Bytes>,
    slots: usize,
    max_bytes: usize,
    /// Sum of the kept buffers' lengths.
    bytes: usize,
}

impl Recycler {
    /// A recycler keeping at most `slots` buffers of at most `max_bytes` in all.
    pub fn new(slots: usize, max_bytes: usize) -> Self {
        Self {
            kept: VecDeque::with_capacity(slots),
            slots,
            max_bytes,
            bytes: 0,
        }
    }

    /// A buffer of `len` initialised bytes: a kept buffer that nobody else holds any more and
    /// that is large enough (its old contents left in place, no zeroing), or else a new,
    /// zeroed one.
    pub fn take(&mut self, len: usize) -> BytesMut {
        if let Some(mut buf) = self.take_any(len) {
            buf.truncate(len);
            return buf;
        }
        BytesMut::zeroed(len)
    }

    /// A kept buffer that nobody else holds and whose length is at least `min`, with its old
    /// contents (its length is the old record's); `None` when there is none.
    pub fn take_any(&mut self, min: usize) -> Option<BytesMut> {
        let i = self
            .kept
            .iter()
            .position(|b| b.len() >= min && b.is_unique())?;
        let b = self.kept.remove(i)?;
        self.bytes -= b.len();
        // Unique a moment ago, and only this recycler could have cloned it since.
        b.try_into_mut().ok()
    }

    /// Keeps a handle to `buf` for reuse once every other handle is gone (not when it alone
    /// exceeds `max_bytes`), letting the oldest kept buffers go to stay within the bounds.
    pub fn keep(&mut self, buf: &Bytes) {
        if self.slots == 0 || buf.len() > self.max_bytes {
            return;
        }
        while self.kept.len() == self.slots || self.bytes + buf.len() > self.max_bytes {
            let Some(old) = self.kept.pop_front() else {
                break;
            };
            self.bytes -= old.len();
        }
        self.bytes += buf.len();
        self.kept.push_back(buf.clone());
    }

    /// Changes the bounds (more connections share the recycler, say); kept buffers past
    /// smaller bounds are let go, oldest first.
    pub fn set_limits(&mut self, slots: usize, max_bytes: usize) {
        self.slots = slots;
        self.max_bytes = max_bytes;
        while self.kept.len() > slots || self.bytes > max_bytes {
            let Some(old) = self.kept.pop_front() else {
                break;
            };
            self.bytes -= old.len();
        }
    }

    /// Number of buffers kept.
    pub fn len(&self) -> usize {
        self.kept.len()
    }

    /// Whether no buffer is kept.
    pub fn is_empty(&self) -> bool {
        self.kept.is_empty()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reuses_only_released_buffers() {
        let mut r = Recycler::new(2, 1 << 20);
        let a = r.take(1000).freeze();
        assert!(a.iter().all(|&b| b == 0));
        let ptr = a.as_ptr();
        r.keep(&a);
        // Still held elsewhere: a new buffer.
        let b = r.take(1000);
        assert_ne!(b.as_ptr(), ptr);
        drop(a);
        // Released: the same memory, truncated to the length asked for.
        let c = r.take(500);
        assert_eq!(c.as_ptr(), ptr);
        assert_eq!(c.len(), 500);
        assert!(r.is_empty());
        // Too small for the request: not reused.
        let small = c.freeze();
        r.keep(&small);
        drop(small);
        assert!(r.take_any(600).is_none());
        assert_eq!(r.len(), 1);
    }

    #[test]
    fn set_limits_grows_and_shrinks() {
        let mut r = Recycler::new(1, 1 << 20);
        let bufs: Vec<Bytes> = (0..3).map(|_| r.take(1000).freeze()).collect();
        for b in &bufs {
            r.keep(b);
        }
        assert_eq!(r.len(), 1, "one slot");
        r.set_limits(3, 1 << 20);
        for b in &bufs[..2] {
            r.keep(b);
        }
        assert_eq!(r.len(), 3);
        r.set_limits(3, 2500);
        assert_eq!(r.len(), 2, "bytes bound: the oldest let go");
        r.set_limits(0, 1 << 20);
        assert!(r.is_empty());
    }

    #[test]
    fn keeps_at_most_slots() {
        let mut r = Recycler::new(2, 1 << 20);
        let held: Vec<Bytes> = (0..5)
            .map(|_| {
                let b = r.take(10).freeze();
                r.keep(&b);
                b
            })
            .collect();
        assert_eq!(r.len(), 2);
        // The two kept are the newest.
        drop(held);
        assert_eq!(r.take_any(1).map(|b| b.len()), Some(10));
        let mut none = Recycler::new(0, 1 << 20);
        none.keep(&Bytes::from_static(b"x"));
        assert!(none.is_empty());
        // The byte bound: the oldest go; a buffer larger than it is not kept.
        let mut r = Recycler::new(8, 25);
        let held: Vec<Bytes> = (0..3).map(|_| r.take(10).freeze()).collect();
        for b in &held {
            r.keep(b);
        }
        assert_eq!(r.len(), 2);
        r.keep(&Bytes::from(vec![0u8; 26]));
        assert_eq!(r.len(), 2);
    }
}
