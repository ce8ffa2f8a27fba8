//! C stdio interop shared by Remora's client and server.
//!
//! NVIDIA's driver writes device-side `printf` output through C stdio's `stdout` and flushes
//! it itself. Both ends of Remora write such output to fd 1 directly (the server captures
//! it, the client prints what the server returned), so each first flushes C `stdout`: the
//! program's own buffered output goes out first, as natively.

/// `fflush(stdout)` on the C library's standard output stream. Never panics.
pub fn flush_c_stdout() {
    unsafe extern "C" {
        static stdout: *mut std::ffi::c_void;
        fn fflush(stream: *mut std::ffi::c_void) -> std::ffi::c_int;
    }
    // SAFETY: `stdout` is the C library's standard output stream pointer, set before any
    // Rust code runs and never freed; it is read by value through a raw pointer (no
    // reference to the static). fflush locks the stream itself and accepts it in any state.
    unsafe {
        let stream = (&raw const stdout).read();
        if !stream.is_null() {
            fflush(stream);
        }
    }
}
