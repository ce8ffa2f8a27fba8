//! The shared-memory ring under a hostile peer: scripts of pushes, pops and arbitrary writes
//! of the shared indices and message bytes. Never panics, never reads or writes outside the
//! ring, never allocates more than the ring holds.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    remora_shm::fuzzing::fuzz_consumer(data);
});
