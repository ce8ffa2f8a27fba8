//! The record-marking deframer on arbitrary streams: never panics, never allocates past the
//! record bound.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    remora_oncrpc::fuzzing::deframe(data);
});
