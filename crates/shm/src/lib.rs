//! Shared-memory transport primitives for colocated clients (issue 5): a memory region made
//! with `memfd_create` and shared by two processes, holding a request ring, a response ring
//! and a data area.
//!
//! * [`Producer`]/[`Consumer`]: the two ends of a single-producer/single-consumer byte ring of length-prefixed messages (whole
//!   ONC RPC records travel in it unchanged). The header is `#[repr(C)]`; indices are
//!   free-running `u32` byte counters, published with Release and read with Acquire.
//! * [`Waiter`]: polling, then blocking. A side that finds nothing to do spins for an adaptive
//!   budget that follows the waits it has observed, then sleeps on a futex in the shared
//!   region; the other side wakes it only when it said it sleeps.
//! * [`Region`]: the memfd, its layout and its mapping; [`DataArea`]: its data area, where
//!   copies pass their bytes by (offset, length), bounds-checked on every access.
//! * [`ShmStream`]: a `Read` + `Write` byte stream over the two rings of a region, which
//!   carries a record-marked ONC RPC connection once it has moved off its Unix socket (the
//!   socket stays open, silent, to tell whether the peer is alive); [`send_with_fd`] and
//!   [`recv_with_fd`] pass the memfd over that socket (SCM_RIGHTS).
//!
//! Nothing read from the shared memory is trusted: the peer may write any value at any time.
//! Indices that cannot be right (more bytes in use than the ring holds, misaligned, a message
//! longer than what is in use) make the consumer fail with [`RingError::Corrupt`]; the
//! session is then closed. Lengths are read once and bounded before anything is copied.

mod data;
mod region;
mod ring;
mod signal;
mod stream;
mod wait;

pub use data::{DataArea, OutOfArea};
pub use region::{Layout, Region, RegionError};
pub use ring::{Consumer, MAX_MESSAGE, Producer, RingError, RingWaker};
pub use signal::{
    SIGNAL_FALLBACK, SIGNAL_FLAGS, SIGNAL_OFFSET, SIGNAL_PAGE, SIGNAL_QUEUED, SIGNAL_SLOTS, Signals,
};
pub use stream::{ShmStream, Side, recv_with_fd, send_with_fd};
pub use wait::{
    DEVICE_SPIN_DEFAULT, EXPLORE_EVERY, GIVE_UP_SHARE, HoldRule, SIGNAL_HOLD_DEFAULT,
    SPARE_SPIN_DEFAULT, SPARE_SPIN_MAX, SPIN_FOREVER, UntriedRule, WAIT_BUCKETS, WaitOutcome,
    WaitPolicy, WaitStats, Waiter, avoid_cpu, avoid_peer_cpu, coarse_now, cores_to_spare,
    current_cpu, device_spin, mark_serving, say_cpu, signal_hold, spare_spin, tracing_waits,
};

/// Fuzzing hooks: drive a consumer with arbitrary ring contents and index values.
pub mod fuzzing {
    pub use crate::ring::fuzz_consumer;
}
