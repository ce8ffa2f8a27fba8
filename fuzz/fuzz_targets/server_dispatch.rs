//! The server's per-connection logic fed an arbitrary byte stream: never panics.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    remora_oncrpc::fuzzing::dispatch(data);
});
