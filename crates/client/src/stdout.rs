//! Device-side `printf` output from the server, written to this process's standard output.
//!
//! A session worker captures what the driver writes to its fd 1 and returns it in
//! synchronizing replies (protocol revision 4). NVIDIA's driver (13.0, observed on an H100)
//! writes that output through C stdio's `stdout` and flushes it during the synchronizing
//! call, so natively the program's own buffered `printf` output comes out first, then the
//! device's. Here the same happens: C `stdout` is flushed, then the bytes are written to fd 1
//! directly, before the call returns.

use std::sync::Mutex;

/// Serializes writers, so that two threads' chunks never interleave.
static STDOUT: Mutex<()> = Mutex::new(());

/// Writes all of `bytes` to fd 1: partial writes and `EINTR` are retried, a non-blocking
/// fd 1 is waited for. Other errors (a closed or invalid fd 1) drop the rest, as the driver
/// would. Never panics.
pub(crate) fn write_device_output(mut bytes: &[u8]) {
    use rustix::io::Errno;
    let _serial = STDOUT
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    // The program's buffered C stdio output goes out before the device's, as when the
    // driver appends to and flushes the same stream.
    remora_stdio::flush_c_stdout();
    let fd = rustix::stdio::stdout();
    while !bytes.is_empty() {
        match rustix::io::write(fd, bytes) {
            Ok(0) => return,
            Ok(n) => bytes = &bytes[n.min(bytes.len())..],
            Err(Errno::INTR) => {}
            Err(Errno::AGAIN) => {
                let mut fds = [rustix::event::PollFd::new(
                    &fd,
                    rustix::event::PollFlags::OUT,
                )];
                if matches!(rustix::event::poll(&mut fds, None), Err(e) if e != Errno::INTR) {
                    return;
                }
            }
            Err(_) => return,
        }
    }
}
