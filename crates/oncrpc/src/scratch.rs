//! One encoding buffer per thread, shared by the messages the thread encodes (the client's
//! calls, the server's replies) until it is used up: one allocation per so many small
//! messages, not one per message (a launch burst spent a quarter of the client's time in
//! `malloc` and `free`; the server encoded a reply header into a fresh buffer for every call,
//! one-way calls included).
//!
//! ```text
//!  encoder() ──► Encoder in this thread's spare room (a fresh buffer when it is used up)
//!  finish(enc) ──► the message's chunks; the room left goes back to the thread
//!  discard(enc) ──► nothing; the whole buffer goes back (a reply that is never sent)
//! ```

use remora_xdr::{BytesMut, Chunks, Encoder};
use std::cell::RefCell;

/// The buffer a thread encodes its messages into.
const ENCODE_BUFFER: usize = 64 << 10;
/// Room a message starts with in that buffer (it grows as needed).
const MESSAGE_ROOM: usize = 256;

thread_local! {
    /// Room for this thread's next messages ([`Encoder::finish_reusing`]).
    static SPARE: RefCell<BytesMut> = RefCell::new(BytesMut::new());
}

/// An encoder in this thread's spare room. A thread whose locals are being destroyed (a call
/// from a thread-exit or process-exit handler, as the CUDA runtime's teardown makes), or a
/// message encoded while another is (the room is taken), gets a small buffer of its own.
pub(crate) fn encoder() -> Encoder {
    let buf = match SPARE
        .try_with(|s| s.try_borrow_mut().map(|mut b| std::mem::take(&mut *b)))
        .ok()
        .and_then(Result::ok)
    {
        Some(b) if b.capacity() >= MESSAGE_ROOM => b,
        Some(mut b) => {
            // Used up: the same allocation again once every message in it has been dropped
            // (`reserve` takes it back then), else a new one.
            b.clear();
            b.reserve(ENCODE_BUFFER);
            b
        }
        None => BytesMut::with_capacity(MESSAGE_ROOM),
    };
    Encoder::in_buf(buf)
}

/// Ends `enc` (from [`encoder`]) and gives the room left back to this thread.
pub(crate) fn finish(enc: Encoder) -> Chunks {
    let (chunks, spare) = enc.finish_reusing();
    give_back(spare);
    chunks
}

/// Drops what `enc` (from [`encoder`]) holds and gives its buffer back to this thread whole
/// (a one-way call's reply, never sent: nothing is allocated or shared for it).
pub(crate) fn discard(enc: Encoder) {
    give_back(enc.into_buf());
}

/// Makes `buf` this thread's spare room (dropped instead while the thread's locals are being
/// destroyed or the room is borrowed).
fn give_back(buf: BytesMut) {
    let _ = SPARE.try_with(|s| {
        if let Ok(mut b) = s.try_borrow_mut() {
            *b = buf;
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An encoder from [`encoder`] holding `v`.
    fn holding(v: u32) -> Encoder {
        let mut e = encoder();
        e.put_u32(v);
        e
    }

    #[test]
    fn messages_share_one_allocation_until_it_is_used_up() {
        let a = finish(holding(1));
        let b = finish(holding(2));
        assert_eq!(
            (&a[0][..], &b[0][..]),
            (&1u32.to_be_bytes()[..], &2u32.to_be_bytes()[..])
        );
        // The second message lies right after the first in the same allocation.
        assert_eq!(a[0].as_ptr().wrapping_add(4), b[0].as_ptr());
    }

    #[test]
    fn a_used_up_buffer_is_taken_back_once_its_messages_are_dropped() {
        let first = finish(holding(0));
        let start = first[0].as_ptr();
        drop(first);
        // Use up the room with messages dropped at once, as one-way calls' replies are.
        for _ in 0..(ENCODE_BUFFER / 4) {
            drop(finish(holding(1)));
        }
        let again = finish(holding(2));
        let base = start as usize;
        let at = again[0].as_ptr() as usize;
        assert!(
            (base..base + ENCODE_BUFFER).contains(&at),
            "a new allocation at {at:#x}, the first at {base:#x}"
        );
    }

    #[test]
    fn a_discarded_message_leaves_its_room_to_the_next() {
        discard(holding(5));
        let kept = finish(holding(6));
        discard(holding(7));
        let next = finish(holding(8));
        assert_eq!(&kept[0][..], &6u32.to_be_bytes()[..]);
        // The discarded 7 took no room: 8 follows 6.
        assert_eq!(kept[0].as_ptr().wrapping_add(4), next[0].as_ptr());
    }

    #[test]
    fn a_message_encoded_during_another_gets_its_own_buffer() {
        let outer = holding(7);
        let i = finish(holding(8));
        let o = finish(outer);
        assert_eq!(&i[0][..], &8u32.to_be_bytes()[..]);
        assert_eq!(&o[0][..], &7u32.to_be_bytes()[..]);
    }
}
