//! Device-side `printf` output from the server, written to this process's standard output.
//!
//! A session worker captures what the driver writes to its fd 1 and returns it in
//! synchronizing replies (protocol revision 4). NVIDIA's driver writes that output with
//! `write(2)` to fd 1 during the synchronizing call, bypassing C stdio's buffer; writing it the
//! same way here, before the call returns, keeps a remoted program's output in the order it
//! has natively (host lines the program flushed before the call come first, those it prints
//! after come later).

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
