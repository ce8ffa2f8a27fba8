//! Device-side `printf` output of a session worker, captured for the client.
//!
//! NVIDIA's driver writes what kernels `printf` to the process's standard output (C stdio's
//! `stdout`, which it flushes, so fd 1) when it flushes the device's printf buffer, inside
//! the synchronizing call that flushes it
//! (context, stream and event synchronize, synchronous copies, module unload, context
//! destroy). A session worker serves exactly one session, so everything that reaches its fd 1
//! is that session's device output:
//!
//! ```text
//!  driver ──write(1)──► pipe (1 MiB) ──reader thread──► buffer (≤ 64 MiB) ──► sync reply
//!                                     └─ and every take ─┘                     (≤ 16 MiB)
//! ```
//!
//! [`DeviceOutput::capture_stdout`] makes fd 1 the write end of a pipe (the worker logs to
//! stderr; nothing of ours writes to stdout). A reader thread moves what arrives into a bounded
//! in-memory buffer, so the driver never blocks on a full pipe; beyond the bound output is
//! dropped, with one warning in the log and a marker line in the output. Each synchronizing
//! reply takes what is there, after draining the pipe: the driver's `write` has returned by
//! the time its synchronizing call has, so the bytes it flushed are in the pipe or already in
//! the buffer.
//!
//! A session that negotiated a revision older than 4 cannot receive the output: it goes to
//! the worker's original standard output, as before.

use std::os::fd::{AsFd, OwnedFd};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use remora_xdr::Bytes;

/// Size asked for the pipe (`F_SETPIPE_SZ`), so that a burst does not wait for the reader.
const PIPE_BYTES: usize = 1 << 20;
/// Bytes read from the pipe at a time.
const CHUNK_BYTES: usize = 64 << 10;
/// Output kept for the client beyond which more is dropped.
const BUFFER_BOUND: usize = 64 << 20;
/// What the client reads where output was dropped.
const DROPPED_MARKER: &[u8] =
    b"\n[remora: device printf output dropped here: more than 64 MiB was waiting for the client]\n";

/// The first protocol revision whose synchronizing replies carry device output.
pub(crate) const DELIVERY_REVISION: u32 = 4;

#[derive(Default)]
struct State {
    /// Output waiting for the next synchronizing reply.
    buf: Vec<u8>,
    /// Whether the session takes the output (revision ≥ 4); else it goes to `original`.
    deliver: bool,
    /// Dropping since the last marker.
    overflowing: bool,
    /// Bytes dropped in all.
    dropped: u64,
    /// The buffer [`DeviceOutput::drain`] reads the pipe into, allocated once.
    chunk: Vec<u8>,
}

/// Captures this process's standard output for the one session it serves.
pub(crate) struct DeviceOutput {
    /// Non-blocking read end of the pipe that fd 1 now writes to.
    read: OwnedFd,
    /// The standard output the process had before, for output no client can receive.
    original: OwnedFd,
    state: Mutex<State>,
}

impl std::fmt::Debug for DeviceOutput {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("DeviceOutput").finish_non_exhaustive()
    }
}

impl DeviceOutput {
    /// Makes fd 1 the write end of a pipe and starts the reader thread. Call it before the
    /// driver is loaded and before any other thread writes to fd 1.
    pub(crate) fn capture_stdout() -> std::io::Result<Arc<Self>> {
        use rustix::pipe::{PipeFlags, fcntl_setpipe_size, pipe_with};
        let original = rustix::io::fcntl_dupfd_cloexec(rustix::stdio::stdout(), 3)?;
        let (read, write) = pipe_with(PipeFlags::CLOEXEC)?;
        if let Err(e) = fcntl_setpipe_size(&write, PIPE_BYTES) {
            tracing::debug!(error = %e, "the device output pipe keeps its default size");
        }
        // The read end only: the driver's writes stay blocking (and complete) as on a terminal.
        rustix::io::ioctl_fionbio(&read, true)?;
        rustix::stdio::dup2_stdout(&write)?;
        drop(write);
        let out = Arc::new(Self {
            read,
            original,
            state: Mutex::new(State::default()),
        });
        let reader = Arc::clone(&out);
        std::thread::Builder::new()
            .name("remora-devout".into())
            .spawn(move || reader.run())?;
        Ok(out)
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Whether the session takes the output (it negotiated revision ≥ 4).
    pub(crate) fn set_deliver(&self, deliver: bool) {
        let mut st = self.lock();
        st.deliver = deliver;
        if !deliver {
            let held = std::mem::take(&mut st.buf);
            self.pass_through(&held);
        }
    }

    /// The reader thread: waits for output and moves it out of the pipe, so that the driver
    /// never blocks on a full one.
    fn run(&self) {
        use rustix::event::{PollFd, PollFlags, poll};
        loop {
            let mut fds = [PollFd::new(&self.read, PollFlags::IN)];
            match poll(&mut fds, None) {
                Ok(_) | Err(rustix::io::Errno::INTR) => {}
                Err(e) => {
                    tracing::warn!(error = %e, "device output reader stopped");
                    return;
                }
            }
            if !self.drain(&mut self.lock()) {
                return;
            }
        }
    }

    /// Reads everything the pipe holds now into the buffer (or to the original standard
    /// output). False once the pipe has no writer left.
    /// The chunk is kept in `st` between calls: this runs on every synchronizing reply and
    /// every completion-word signal, and zeroing a fresh 64 KiB each time cost ~2 µs of
    /// every launch + synchronize round trip under process isolation (session 23).
    fn drain(&self, st: &mut State) -> bool {
        let mut chunk = std::mem::take(&mut st.chunk);
        chunk.resize(CHUNK_BYTES, 0);
        let alive = loop {
            match rustix::io::read(&self.read, &mut chunk[..]) {
                Ok(0) => break false,
                Ok(n) => self.keep(st, &chunk[..n]),
                Err(rustix::io::Errno::INTR) => {}
                Err(rustix::io::Errno::AGAIN) => break true,
                Err(e) => {
                    tracing::warn!(error = %e, "cannot read the device output pipe");
                    break false;
                }
            }
        };
        st.chunk = chunk;
        alive
    }

    fn keep(&self, st: &mut State, bytes: &[u8]) {
        if !st.deliver {
            self.pass_through(bytes);
            return;
        }
        let room = BUFFER_BOUND.saturating_sub(st.buf.len()).min(bytes.len());
        st.buf.extend_from_slice(&bytes[..room]);
        let lost = bytes.len() - room;
        if lost == 0 {
            return;
        }
        if !st.overflowing {
            st.overflowing = true;
            st.buf.extend_from_slice(DROPPED_MARKER);
            if st.dropped == 0 {
                tracing::warn!(
                    bound = BUFFER_BOUND,
                    "device printf output is not being collected fast enough: dropping what \
                     exceeds the bound (the client sees a marker line where it was dropped)"
                );
            }
        }
        st.dropped += lost as u64;
    }

    /// Writes `bytes` to the process's original standard output (best effort).
    fn pass_through(&self, mut bytes: &[u8]) {
        while !bytes.is_empty() {
            match rustix::io::write(&self.original, bytes) {
                Ok(0) => return,
                Ok(n) => bytes = &bytes[n..],
                Err(rustix::io::Errno::INTR) => {}
                Err(_) => return,
            }
        }
    }

    /// Whether output the reader thread has moved out of the pipe waits for a synchronizing
    /// reply to carry it. Asked by every completion-word signal (`RM_STREAM_SIGNAL`), so it
    /// makes no system call: reading the empty pipe each time cost ~0.5 µs of every launch +
    /// synchronize round trip under process isolation (session 23). Bytes still in the pipe
    /// go with the next synchronizing reply instead; a signal is only served for sessions
    /// with no module that may print, whose kernels write none.
    pub(crate) fn pending(&self) -> bool {
        let st = self.lock();
        st.deliver && !st.buf.is_empty()
    }

    /// What a synchronizing reply carries: the output captured by now, at most `max` bytes
    /// (the rest stays for the next reply); `None` when there is none or the session does not
    /// take it. Call it after the synchronizing driver call has returned.
    pub(crate) fn take(&self, max: usize) -> Option<Bytes> {
        let mut st = self.lock();
        if !st.deliver {
            return None;
        }
        // NVIDIA's driver writes device output through C stdio's `stdout` and flushes it
        // itself; this only makes sure nothing stays in its buffer.
        remora_stdio::flush_c_stdout();
        self.drain(&mut st);
        if st.buf.is_empty() {
            return None;
        }
        let n = st.buf.len().min(max);
        let out = if n == st.buf.len() {
            std::mem::take(&mut st.buf)
        } else {
            st.buf.drain(..n).collect()
        };
        st.overflowing = false;
        Some(Bytes::from(out))
    }

    /// Bytes dropped so far because the client did not collect them in time.
    pub(crate) fn dropped(&self) -> u64 {
        self.lock().dropped
    }
}

/// Writes `bytes` to this process's fd 1 as NVIDIA's driver writes device output: directly,
/// whole (partial writes and `EINTR` retried). For the emulated backend's test hook.
pub(crate) fn write_stdout(mut bytes: &[u8]) {
    let fd = rustix::stdio::stdout();
    while !bytes.is_empty() {
        match rustix::io::write(fd.as_fd(), bytes) {
            Ok(0) => return,
            Ok(n) => bytes = &bytes[n..],
            Err(rustix::io::Errno::INTR) => {}
            Err(_) => return,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A `DeviceOutput` over a pipe of the test's own (fd 1 untouched).
    fn over_pipe() -> (DeviceOutput, OwnedFd) {
        let (read, write) = rustix::pipe::pipe_with(rustix::pipe::PipeFlags::CLOEXEC).unwrap();
        rustix::io::ioctl_fionbio(&read, true).unwrap();
        let original = OwnedFd::from(
            std::fs::OpenOptions::new()
                .write(true)
                .open("/dev/null")
                .unwrap(),
        );
        let out = DeviceOutput {
            read,
            original,
            state: Mutex::new(State::default()),
        };
        (out, write)
    }

    #[test]
    fn take_drains_the_pipe_in_order_and_bounds_each_reply() {
        let (out, write) = over_pipe();
        out.set_deliver(true);
        rustix::io::write(&write, b"first ").unwrap();
        out.drain(&mut out.lock());
        rustix::io::write(&write, b"second").unwrap();
        assert_eq!(out.take(8).as_deref(), Some(&b"first se"[..]));
        assert_eq!(out.take(8).as_deref(), Some(&b"cond"[..]));
        assert_eq!(out.take(8), None);
    }

    #[test]
    fn draining_reuses_one_chunk() {
        let (out, write) = over_pipe();
        out.set_deliver(true);
        out.drain(&mut out.lock());
        let first = out.lock().chunk.as_ptr();
        assert_eq!(out.lock().chunk.len(), CHUNK_BYTES);
        rustix::io::write(&write, b"more").unwrap();
        out.drain(&mut out.lock());
        // The same allocation: a drain (every synchronizing reply) neither allocates nor
        // zeroes a fresh chunk.
        assert_eq!(out.lock().chunk.as_ptr(), first);
        assert_eq!(out.take(16).as_deref(), Some(&b"more"[..]));
    }

    #[test]
    fn pending_says_what_was_moved_out_of_the_pipe() {
        let (out, write) = over_pipe();
        out.set_deliver(true);
        assert!(!out.pending());
        rustix::io::write(&write, b"late").unwrap();
        // Not yet moved (the reader thread, or a take, moves it): no system call here.
        assert!(!out.pending());
        out.drain(&mut out.lock());
        assert!(out.pending());
        assert_eq!(out.take(16).as_deref(), Some(&b"late"[..]));
        assert!(!out.pending());
    }

    #[test]
    fn output_beyond_the_bound_is_dropped_with_one_marker() {
        let (out, _write) = over_pipe();
        out.set_deliver(true);
        let mut st = out.lock();
        out.keep(&mut st, &vec![b'a'; BUFFER_BOUND - 1]);
        out.keep(&mut st, b"bcd");
        out.keep(&mut st, b"efg");
        assert_eq!(st.dropped, 5);
        assert!(st.buf.ends_with(&[b"ab", DROPPED_MARKER].concat()));
        drop(st);
        let all = out.take(usize::MAX).unwrap();
        assert_eq!(all.len(), BUFFER_BOUND + DROPPED_MARKER.len());
    }

    #[test]
    fn nothing_is_kept_for_an_older_client() {
        let (out, write) = over_pipe();
        rustix::io::write(&write, b"to the original stdout").unwrap();
        out.drain(&mut out.lock());
        assert!(out.lock().buf.is_empty());
        out.set_deliver(true);
        assert_eq!(out.take(16), None);
    }
}
