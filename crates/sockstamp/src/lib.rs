//! Arrival stamps of TCP reads (`SO_TIMESTAMPNS`), for the socket waiter's spin budget
//! (`remora_oncrpc`'s `Spinning`, which keeps its own crate free of `unsafe`).
//!
//! A read that blocked ends one wake-up after its bytes arrived; under CPU contention that
//! wake-up is tens of microseconds. Learning it as part of how long the peer takes to answer
//! would keep the budget down and every later read asleep (each wait then costs a wake-up,
//! which proves the next wait long too). The kernel's receive time of the bytes tells the
//! wake-up apart: the waiter learns the time until the bytes arrived. Unix sockets have no
//! such stamps on streams; their waits are learned as they are.

use std::io;
use std::net::TcpStream;
use std::os::fd::AsRawFd;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

/// Turns receive stamps on for `s`. Best effort: without them [`read`] says no lag, and the
/// error is returned only for logging.
pub fn enable(s: &TcpStream) -> io::Result<()> {
    let one: libc::c_int = 1;
    // SAFETY: `s` is an open socket; the option value is a live `c_int` of the size passed.
    let r = unsafe {
        libc::setsockopt(
            s.as_raw_fd(),
            libc::SOL_SOCKET,
            libc::SO_TIMESTAMPNS,
            (&raw const one).cast(),
            std::mem::size_of::<libc::c_int>() as libc::socklen_t,
        )
    };
    if r != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok(())
}

/// `read(2)` on `s` into `buf` (same errors, same timeout), and how long ago the bytes read
/// arrived, when the kernel stamped them (not, for instance, bytes that came in before the
/// host's stamping was switched on, shortly after the first [`enable`]).
pub fn read(s: &TcpStream, buf: &mut [u8]) -> io::Result<(usize, Option<Duration>)> {
    let mut iov = libc::iovec {
        iov_base: buf.as_mut_ptr().cast(),
        iov_len: buf.len(),
    };
    // Room for one timestamp message (and some slack), 8-aligned as cmsg headers need.
    let mut control = [0u64; 8];
    // SAFETY: `msghdr` is plain data; all-zero is a valid empty header.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &raw mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.as_mut_ptr().cast();
    msg.msg_controllen = std::mem::size_of_val(&control) as _;
    // SAFETY: `msg` points at one iovec over `buf` (writable, `buf.len()` bytes) and at the
    // control buffer of the size given; both outlive the call.
    let n = unsafe { libc::recvmsg(s.as_raw_fd(), &raw mut msg, 0) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    let now = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap_or_default();
    let mut lag = None;
    // SAFETY: `msg` was filled by recvmsg; CMSG_FIRSTHDR/CMSG_NXTHDR stay within
    // `msg_controllen` bytes of the control buffer and return null past its end.
    let mut c = unsafe { libc::CMSG_FIRSTHDR(&raw const msg) };
    while !c.is_null() {
        // SAFETY: `c` is a non-null header inside the control buffer (see above).
        let h = unsafe { &*c };
        // SAFETY: CMSG_LEN is arithmetic on its argument.
        let want = unsafe { libc::CMSG_LEN(std::mem::size_of::<libc::timespec>() as u32) };
        if h.cmsg_level == libc::SOL_SOCKET
            && h.cmsg_type == libc::SCM_TIMESTAMPNS
            && h.cmsg_len as usize >= want as usize
        {
            // SAFETY: the message holds a `timespec` (its length was checked); the data may be
            // unaligned for it, hence read_unaligned.
            let ts: libc::timespec = unsafe { std::ptr::read_unaligned(libc::CMSG_DATA(c).cast()) };
            let at = Duration::new(
                ts.tv_sec.max(0) as u64,
                ts.tv_nsec.clamp(0, 999_999_999) as u32,
            );
            lag = Some(now.saturating_sub(at));
        }
        // SAFETY: as for CMSG_FIRSTHDR.
        c = unsafe { libc::CMSG_NXTHDR(&raw const msg, c) };
    }
    Ok((n as usize, lag))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;
    use std::net::TcpListener;

    #[test]
    fn a_blocked_read_learns_how_late_it_saw_its_bytes() {
        let l = TcpListener::bind("127.0.0.1:0").unwrap();
        let mut c = TcpStream::connect(l.local_addr().unwrap()).unwrap();
        let (s, _) = l.accept().unwrap();
        enable(&s).unwrap();
        // The kernel turns stamping on for the whole host shortly after the first socket asks
        // (a deferred switch): bytes that arrive before are not stamped.
        std::thread::sleep(Duration::from_millis(100));
        c.write_all(b"hello").unwrap();
        std::thread::sleep(Duration::from_millis(30));
        let mut buf = [0u8; 16];
        let (n, lag) = read(&s, &mut buf).unwrap();
        assert_eq!(&buf[..n], b"hello");
        // The bytes sat in the socket ~30 ms before this read.
        let lag = lag.expect("TCP reads are stamped");
        assert!(
            lag >= Duration::from_millis(25) && lag < Duration::from_secs(5),
            "{lag:?}"
        );
        // End of file reads 0 bytes and no stamp.
        drop(c);
        assert_eq!(read(&s, &mut buf).unwrap(), (0, None));
    }
}
