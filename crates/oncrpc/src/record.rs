//! Record marking for stream transports (RFC 5531 §11).
//!
//! A record is sent as one or more fragments, each preceded by a 4-byte big-endian header
//! whose high bit marks the last fragment and whose low 31 bits give the fragment length.
//!
//! * [`RecordReader`] reassembles records under a maximum record size. Its buffer grows only
//!   as bytes actually arrive: a declared fragment length is never used to pre-allocate, and a
//!   header that would take the record past the maximum is an error before anything more is
//!   read. It is resumable: a read timeout mid-record keeps the partial state and the next
//!   call continues where the last one stopped.
//! * [`write_record`] sends a record given as a list of [`Bytes`] chunks with vectored
//!   writes, without copying the payload, splitting it into fragments when it is larger than
//!   the maximum fragment size.

use std::io::{self, IoSlice, Read, Write};

use remora_xdr::{Bytes, BytesMut};

use crate::recycle::Recycler;

/// Largest fragment length the header can express (2^31 - 1), the default maximum fragment
/// size of the writer.
pub const MAX_FRAGMENT_SIZE: usize = 0x7FFF_FFFF;

const LAST_FRAGMENT: u32 = 0x8000_0000;

/// Size of the reader's read-ahead buffer; also the first step of growth of a record buffer.
const READ_AHEAD: usize = 8 * 1024;

/// Records at least this large leave their buffer for reuse by the next large record.
const RECYCLE_MIN: usize = 256 * 1024;

/// Large record buffers kept for reuse. A bulk copy keeps several records in flight (the
/// client holds a few replies it has not copied out yet, the server a few calls its waiter
/// threads still copy from), so one is not enough.
const RECYCLE_SLOTS: usize = 6;
/// Bytes those buffers may hold in all: a few bulk-copy chunks, or one 32 MiB band of a
/// 3-D copy as before.
const RECYCLE_MAX_BYTES: usize = 40 << 20;

/// Why a record could not be read.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RecordError {
    /// The underlying read failed. If the kind is `WouldBlock` or `TimedOut` the reader's
    /// state is intact and reading can be retried.
    #[error("I/O error while reading a record: {0}")]
    Io(#[from] io::Error),
    /// A fragment header declared a record larger than the maximum. The stream cannot be
    /// resynchronised: close it.
    #[error(
        "record of at least {declared} bytes exceeds the maximum record size of {max} bytes; \
         raise the maximum record size if such records are expected"
    )]
    TooLarge {
        /// Bytes the record would have (bytes so far plus the declared fragment).
        declared: u64,
        /// The configured maximum.
        max: usize,
    },
    /// The peer closed the stream in the middle of a record.
    #[error("peer closed the connection in the middle of a record ({received} bytes received)")]
    TruncatedRecord {
        /// Record bytes received before the end of the stream (headers excluded).
        received: usize,
    },
    /// An earlier error left the stream in an unknown state.
    #[error("the record stream is unusable after an earlier error")]
    Poisoned,
}

impl RecordError {
    /// Whether this is a read timeout after which the reader can simply be called again.
    pub fn is_timeout(&self) -> bool {
        matches!(self, Self::Io(e) if is_timeout_kind(e.kind()))
    }
}

pub(crate) fn is_timeout_kind(kind: io::ErrorKind) -> bool {
    matches!(kind, io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut)
}

/// Bytes of memory that the partial records of many readers (a server's connections) may
/// hold together beyond [`BUDGET_FREE`] each. A reader whose record needs more waits for room
/// (it stops reading its stream: backpressure), and a connection that waits past its stall
/// timeout is closed, so many peers sending large records at once cannot exhaust the server's
/// memory (issue 13, finding 3).
#[derive(Debug)]
pub struct RecordBudget {
    limit: usize,
    used: std::sync::Mutex<usize>,
    freed: std::sync::Condvar,
}

/// What one reader's current record may hold without drawing on its [`RecordBudget`].
pub const BUDGET_FREE: usize = 256 << 10;
/// How long a reader waits for room in its budget before answering a timeout (it is called
/// again; the stall timeout ends the wait).
const BUDGET_WAIT: std::time::Duration = std::time::Duration::from_millis(100);

impl RecordBudget {
    /// A budget of `limit` bytes.
    pub fn new(limit: usize) -> std::sync::Arc<Self> {
        std::sync::Arc::new(Self {
            limit,
            used: std::sync::Mutex::new(0),
            freed: std::sync::Condvar::new(),
        })
    }

    /// Bytes drawn now.
    pub fn used(&self) -> usize {
        *self
            .used
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Draws `n` more bytes for a reader that holds `held`, waiting up to `wait` for room;
    /// false if there was none. A reader that is the only one drawing always gets what it
    /// asks (a record larger than the budget is still read, alone), so the budget never
    /// stops every reader at once.
    fn acquire(&self, n: usize, held: usize, wait: std::time::Duration) -> bool {
        let full = |u: &mut usize| u.saturating_add(n) > self.limit && *u > held;
        let guard = self
            .used
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        let (mut used, _) = self
            .freed
            .wait_timeout_while(guard, wait, full)
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if full(&mut used) {
            return false;
        }
        *used += n;
        true
    }

    fn release(&self, n: usize) {
        if n > 0 {
            let mut used = self
                .used
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            *used = used.saturating_sub(n);
            drop(used);
            self.freed.notify_all();
        }
    }
}

/// Reads records from a byte stream, reassembling fragments.
#[derive(Debug)]
pub struct RecordReader<R> {
    inner: R,
    max_record: usize,
    /// Read-ahead buffer, `ahead[pos..end]` not consumed yet.
    ahead: Box<[u8]>,
    pos: usize,
    end: usize,
    /// The record being assembled: `record[..filled]` is data; `record[filled..]` is zeroed
    /// spare space that the next reads fill (see [`RecordReader::ensure_spare`]).
    record: BytesMut,
    filled: usize,
    /// The last large records handed out. Once every handle to one is dropped, its buffer
    /// (already initialised, pages already mapped) is reused for the next large record without
    /// zeroing.
    recycle: Recycler,
    hdr: [u8; 4],
    hdr_len: usize,
    /// Whether the current fragment's header has been read and its body is being read.
    in_fragment: bool,
    frag_left: usize,
    frag_last: bool,
    /// Whether any byte (header included) of the current record has arrived.
    in_record: bool,
    poisoned: bool,
    total_read: u64,
    /// The budget the current record draws on past [`BUDGET_FREE`], and what it holds.
    budget: Option<std::sync::Arc<RecordBudget>>,
    held: usize,
}

impl<R> Drop for RecordReader<R> {
    fn drop(&mut self) {
        if let Some(b) = &self.budget {
            b.release(self.held);
        }
    }
}

impl<R: Read> RecordReader<R> {
    /// A reader over `inner` accepting records of at most `max_record_size` bytes (headers
    /// excluded).
    pub fn new(inner: R, max_record_size: usize) -> Self {
        Self {
            inner,
            max_record: max_record_size,
            ahead: vec![0; READ_AHEAD].into_boxed_slice(),
            pos: 0,
            end: 0,
            record: BytesMut::new(),
            filled: 0,
            recycle: Recycler::new(RECYCLE_SLOTS, RECYCLE_MAX_BYTES),
            hdr: [0; 4],
            hdr_len: 0,
            in_fragment: false,
            frag_left: 0,
            frag_last: false,
            in_record: false,
            poisoned: false,
            total_read: 0,
            budget: None,
            held: 0,
        }
    }

    /// Makes records past [`BUDGET_FREE`] bytes draw on `budget` (shared with other readers)
    /// while they are being read.
    pub fn with_budget(mut self, budget: std::sync::Arc<RecordBudget>) -> Self {
        self.budget = Some(budget);
        self
    }

    /// Before the record grows to `len` bytes: draws what that takes past [`BUDGET_FREE`]
    /// from the budget, or answers `WouldBlock` (nothing consumed; call again) when there is
    /// no room within [`BUDGET_WAIT`].
    fn reserve(&mut self, len: usize) -> io::Result<()> {
        let Some(budget) = &self.budget else {
            return Ok(());
        };
        let want = len.saturating_sub(BUDGET_FREE);
        if want <= self.held {
            return Ok(());
        }
        if !budget.acquire(want - self.held, self.held, BUDGET_WAIT) {
            tracing::debug!(
                record_bytes = self.filled,
                budget = budget.limit,
                "ONC RPC: the budget for partial records is spent; this record waits"
            );
            return Err(io::Error::new(
                io::ErrorKind::WouldBlock,
                "the server's memory for partial records is in use; waiting for room",
            ));
        }
        self.held = want;
        Ok(())
    }

    /// The record is complete (or gone): what it drew goes back to the budget.
    fn release_budget(&mut self) {
        if let Some(b) = &self.budget {
            b.release(std::mem::take(&mut self.held));
        }
    }

    /// The underlying stream.
    pub fn get_ref(&self) -> &R {
        &self.inner
    }

    /// The underlying stream, mutably (for writing replies on the same stream).
    pub fn get_mut(&mut self) -> &mut R {
        &mut self.inner
    }

    /// The maximum record size.
    pub fn max_record_size(&self) -> usize {
        self.max_record
    }

    /// Changes the maximum record size for records from now on (a server raises it once a
    /// connection's first call was served). A record in progress is held to the new bound
    /// for its fragments still to come.
    pub fn set_max_record_size(&mut self, max_record_size: usize) {
        self.max_record = max_record_size;
    }

    /// Whether part of a record has been received (a read timeout now is a stall, not idleness).
    pub fn in_record(&self) -> bool {
        self.in_record || self.pos < self.end
    }

    /// Total bytes read from the stream so far (progress counter).
    pub fn bytes_read(&self) -> u64 {
        self.total_read
    }

    /// Bytes currently held for the partial record (reassembled data only).
    pub fn buffered_record_bytes(&self) -> usize {
        self.filled
    }

    fn read_inner(&mut self, buf_is_ahead: bool, want: usize) -> io::Result<usize> {
        loop {
            let res = if buf_is_ahead {
                self.inner.read(&mut self.ahead[..])
            } else {
                self.ensure_spare()?;
                let window = (self.record.len() - self.filled).min(want);
                let r = self
                    .inner
                    .read(&mut self.record[self.filled..self.filled + window]);
                self.filled += *r.as_ref().unwrap_or(&0);
                r
            };
            match res {
                Ok(n) => {
                    self.total_read += n as u64;
                    return Ok(n);
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(e),
            }
        }
    }

    /// Makes sure `record` has spare space past `filled` for a direct read.
    ///
    /// The buffer grows geometrically (doubling, at least [`READ_AHEAD`] bytes) with what has
    /// *arrived*, never with what a header declares, and never past the maximum record size or
    /// the end of a last fragment. `BytesMut::resize` first reclaims the allocation of earlier
    /// records once their `Bytes` are dropped, so a steady stream of large records reuses one
    /// buffer whose pages are already mapped; the new space is zeroed once, not once per read.
    fn ensure_spare(&mut self) -> io::Result<()> {
        if self.record.len() > self.filled {
            return Ok(());
        }
        let mut grow = self
            .filled
            .max(READ_AHEAD)
            .min(self.max_record.saturating_sub(self.filled));
        if self.frag_last {
            grow = grow.min(self.frag_left);
        }
        self.reserve(self.filled + grow.max(1))?;
        self.record.resize(self.filled + grow.max(1), 0);
        Ok(())
    }

    /// At the start of a large record of at least `len` bytes, takes back an earlier large
    /// record's buffer that nobody holds any more, preferring one that holds `len` bytes
    /// (the record is then read without growing its buffer).
    fn try_recycle(&mut self, len: usize) {
        if let Some(buf) = self
            .recycle
            .take_any(len)
            .or_else(|| self.recycle.take_any(0))
        {
            self.record = buf;
        }
    }

    /// Fills the read-ahead buffer (it must be empty). Returns false at end of stream.
    fn fill_ahead(&mut self) -> io::Result<bool> {
        debug_assert_eq!(self.pos, self.end);
        let n = self.read_inner(true, 0)?;
        self.pos = 0;
        self.end = n;
        Ok(n > 0)
    }

    fn eof_error(&mut self) -> RecordError {
        self.poisoned = true;
        RecordError::TruncatedRecord {
            received: self.filled,
        }
    }

    /// Reads the next record. `Ok(None)` means the peer closed the stream cleanly between
    /// records. A timeout (`WouldBlock`/`TimedOut`) leaves the partial record in place: call
    /// again to continue. Any other error leaves the reader unusable.
    pub fn read_record(&mut self) -> Result<Option<Bytes>, RecordError> {
        if self.poisoned {
            return Err(RecordError::Poisoned);
        }
        match self.read_record_inner() {
            Err(RecordError::Io(e)) if !is_timeout_kind(e.kind()) => {
                self.poisoned = true;
                Err(RecordError::Io(e))
            }
            Err(e @ RecordError::TooLarge { .. }) => {
                self.poisoned = true;
                Err(e)
            }
            other => other,
        }
    }

    fn read_record_inner(&mut self) -> Result<Option<Bytes>, RecordError> {
        loop {
            if !self.in_fragment {
                while self.hdr_len < 4 {
                    if self.pos == self.end && !self.fill_ahead()? {
                        if self.hdr_len == 0 && !self.in_record {
                            return Ok(None);
                        }
                        return Err(self.eof_error());
                    }
                    let take = (4 - self.hdr_len).min(self.end - self.pos);
                    self.hdr[self.hdr_len..self.hdr_len + take]
                        .copy_from_slice(&self.ahead[self.pos..self.pos + take]);
                    self.hdr_len += take;
                    self.pos += take;
                    self.in_record = true;
                }
                let h = u32::from_be_bytes(self.hdr);
                let len = (h & !LAST_FRAGMENT) as usize;
                let total = self.filled as u64 + len as u64;
                if total > self.max_record as u64 {
                    return Err(RecordError::TooLarge {
                        declared: total,
                        max: self.max_record,
                    });
                }
                if self.filled == 0 && len >= READ_AHEAD {
                    self.try_recycle(len);
                }
                self.hdr_len = 0;
                self.in_fragment = true;
                self.frag_left = len;
                self.frag_last = h & LAST_FRAGMENT != 0;
            }
            // Fast path: a whole single-fragment record already in the read-ahead buffer.
            if self.frag_last
                && self.filled == 0
                && self.end - self.pos >= self.frag_left
                && self.frag_left < READ_AHEAD
            {
                let out = Bytes::copy_from_slice(&self.ahead[self.pos..self.pos + self.frag_left]);
                self.pos += self.frag_left;
                self.frag_left = 0;
                self.in_fragment = false;
                self.in_record = false;
                return Ok(Some(out));
            }
            while self.frag_left > 0 {
                if self.pos < self.end {
                    let take = self.frag_left.min(self.end - self.pos);
                    let src = &self.ahead[self.pos..self.pos + take];
                    if self.record.len() - self.filled >= take {
                        self.record[self.filled..self.filled + take].copy_from_slice(src);
                    } else {
                        let len = self.filled + take;
                        self.reserve(len)?;
                        let src = &self.ahead[self.pos..self.pos + take];
                        self.record.truncate(self.filled);
                        self.record.extend_from_slice(src);
                    }
                    self.filled += take;
                    self.pos += take;
                    self.frag_left -= take;
                } else if self.frag_left >= READ_AHEAD {
                    // Large fragment: read straight into the record buffer, growing it
                    // geometrically with what has arrived, never by the declared length.
                    let want = self.frag_left;
                    let n = self.read_inner(false, want)?;
                    if n == 0 {
                        return Err(self.eof_error());
                    }
                    self.frag_left -= n;
                } else if !self.fill_ahead()? {
                    return Err(self.eof_error());
                }
            }
            self.in_fragment = false;
            if self.frag_last {
                self.in_record = false;
                self.release_budget();
                self.record.truncate(self.filled);
                self.filled = 0;
                let out = self.record.split().freeze();
                // Drop the empty remainder so that `out` can become the buffer's only owner.
                self.record = BytesMut::new();
                if out.len() >= RECYCLE_MIN {
                    self.recycle.keep(&out);
                }
                return Ok(Some(out));
            }
        }
    }
}

fn fragment_header(len: usize, last: bool) -> [u8; 4] {
    let mut h = len as u32;
    if last {
        h |= LAST_FRAGMENT;
    }
    h.to_be_bytes()
}

/// Writes one record made of `chunks` (in order) to `w`, as fragments of at most
/// `max_fragment` bytes (clamped to 1..=[`MAX_FRAGMENT_SIZE`]), with vectored writes. The
/// chunks are not copied. Partial writes are resumed.
pub fn write_record<W: Write + ?Sized>(
    w: &mut W,
    chunks: &[Bytes],
    max_fragment: usize,
) -> io::Result<()> {
    write_records(w, &[chunks], max_fragment)
}

/// Writes several records back to back with as few vectored writes as possible (each record
/// framed as [`write_record`] frames one). Used to send batched one-way calls together.
pub fn write_records<W: Write + ?Sized>(
    w: &mut W,
    records: &[&[Bytes]],
    max_fragment: usize,
) -> io::Result<()> {
    let slices: Vec<Vec<&[u8]>> = records
        .iter()
        .map(|chunks| chunks.iter().map(|b| &b[..]).collect())
        .collect();
    write_record_slices(w, &slices, max_fragment)
}

/// A record of fewer parts than this (its header included) is framed on the stack.
const FEW_PARTS: usize = 8;

/// [`write_records`] for records given as borrowed byte slices (e.g. a call's encoded header
/// followed by the caller's own buffer, written without copying it anywhere first).
pub fn write_record_slices<'a, W: Write + ?Sized, R: AsRef<[&'a [u8]]>>(
    w: &mut W,
    records: &[R],
    max_fragment: usize,
) -> io::Result<()> {
    let max_fragment = max_fragment.clamp(1, MAX_FRAGMENT_SIZE);
    // The usual case, one small record of a few parts (a call's header and arguments, maybe
    // a payload after them), framed with nothing allocated.
    if let [one] = records
        && let one = one.as_ref()
        && one.len() < FEW_PARTS
    {
        let total: usize = one.iter().map(|c| c.len()).sum();
        if total <= max_fragment {
            let header = fragment_header(total, true);
            let mut bufs = [IoSlice::new(&[]); FEW_PARTS];
            bufs[0] = IoSlice::new(&header);
            for (b, part) in bufs[1..].iter_mut().zip(one) {
                *b = IoSlice::new(part);
            }
            return write_all_vectored(w, &mut bufs[..=one.len()]);
        }
    }
    let totals: Vec<usize> = records
        .iter()
        .map(|chunks| chunks.as_ref().iter().map(|c| c.len()).sum())
        .collect();
    let mut headers: Vec<[u8; 4]> = Vec::new();
    for &total in &totals {
        let nfrags = total.div_ceil(max_fragment).max(1);
        let mut left = total;
        for i in 0..nfrags {
            let len = left.min(max_fragment);
            headers.push(fragment_header(len, i + 1 == nfrags));
            left -= len;
        }
    }
    let mut slices: Vec<IoSlice<'_>> = Vec::with_capacity(headers.len() + records.len() * 2);
    let mut next_header = headers.iter();
    for (chunks, &total) in records.iter().zip(&totals) {
        if let Some(h) = next_header.next() {
            slices.push(IoSlice::new(h));
        }
        // Bytes the current fragment can still take, and fragments started so far.
        let mut frag_room = total.min(max_fragment);
        let mut frags = 1;
        for chunk in chunks.as_ref() {
            let mut rest: &[u8] = chunk;
            while !rest.is_empty() {
                if frag_room == 0 {
                    if let Some(h) = next_header.next() {
                        slices.push(IoSlice::new(h));
                    }
                    frag_room = (total - frags * max_fragment).min(max_fragment);
                    frags += 1;
                }
                let take = rest.len().min(frag_room);
                slices.push(IoSlice::new(&rest[..take]));
                rest = &rest[take..];
                frag_room -= take;
            }
        }
    }
    // writev takes at most IOV_MAX (1024) buffers at a time.
    for group in slices.chunks_mut(512) {
        write_all_vectored(w, group)?;
    }
    Ok(())
}

fn write_all_vectored<W: Write + ?Sized>(
    w: &mut W,
    mut bufs: &mut [IoSlice<'_>],
) -> io::Result<()> {
    // Drop leading empty slices so that a zero-length write really means "no progress".
    IoSlice::advance_slices(&mut bufs, 0);
    while !bufs.is_empty() {
        match w.write_vectored(bufs) {
            Ok(0) => {
                return Err(io::Error::new(
                    io::ErrorKind::WriteZero,
                    "failed to write the whole record",
                ));
            }
            Ok(n) => IoSlice::advance_slices(&mut bufs, n),
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    w.flush()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::VecDeque;
    use std::sync::Arc;

    /// A stream that hands out scripted read results.
    struct Script {
        steps: VecDeque<io::Result<Vec<u8>>>,
    }

    impl Script {
        fn new(steps: Vec<io::Result<Vec<u8>>>) -> Self {
            Self {
                steps: steps.into(),
            }
        }
    }

    impl Read for Script {
        fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
            match self.steps.pop_front() {
                None => Ok(0),
                Some(Err(e)) => Err(e),
                Some(Ok(mut data)) => {
                    let n = data.len().min(buf.len());
                    buf[..n].copy_from_slice(&data[..n]);
                    if n < data.len() {
                        data.drain(..n);
                        self.steps.push_front(Ok(data));
                    }
                    Ok(n)
                }
            }
        }
    }

    fn frame(data: &[u8], frag: usize) -> Vec<u8> {
        let mut out = Vec::new();
        write_record(&mut out, &[Bytes::copy_from_slice(data)], frag).unwrap();
        out
    }

    fn would_block() -> io::Result<Vec<u8>> {
        Err(io::Error::new(io::ErrorKind::WouldBlock, "no more yet"))
    }

    #[test]
    fn partial_records_of_many_readers_share_one_budget() {
        let budget = RecordBudget::new(1 << 20);
        // A: a 3 MiB record of which 1.5 MiB arrived. Alone, it may pass the budget (a record
        // larger than the budget must still be readable).
        let big = vec![7u8; 3 << 20];
        let framed = frame(&big, 3 << 20);
        let mut a = RecordReader::new(
            Script::new(vec![
                Ok(framed[..(3 << 19)].to_vec()),
                would_block(),
                would_block(),
            ]),
            4 << 20,
        )
        .with_budget(Arc::clone(&budget));
        assert!(a.read_record().unwrap_err().is_timeout());
        assert_eq!(
            a.buffered_record_bytes(),
            (3 << 19) - 4,
            "alone, A read what arrived"
        );
        let held_by_a = budget.used();
        assert!(held_by_a > 1 << 20);
        // B: a whole 2 MiB record waits for room, beyond what any record may hold freely
        // (nothing of it is lost)...
        let data: Vec<u8> = (0..2u32 << 20).map(|i| i as u8).collect();
        let mut b = RecordReader::new(Script::new(vec![Ok(frame(&data, 1 << 16))]), 4 << 20)
            .with_budget(Arc::clone(&budget));
        assert!(b.read_record().unwrap_err().is_timeout());
        assert_eq!(budget.used(), held_by_a, "B drew nothing");
        assert!(b.buffered_record_bytes() <= BUDGET_FREE + READ_AHEAD);
        // ...until A's connection goes; then it is read whole and gives the room back.
        drop(a);
        assert_eq!(&b.read_record().unwrap().unwrap()[..], &data[..]);
        assert_eq!(budget.used(), 0);
        // Small records never touch the budget.
        let small = RecordBudget::new(0);
        let mut c = RecordReader::new(Script::new(vec![Ok(frame(&[1u8; 100_000], 4096))]), 1 << 20)
            .with_budget(small);
        assert_eq!(c.read_record().unwrap().unwrap().len(), 100_000);
    }

    #[test]
    fn golden_single_fragment() {
        assert_eq!(
            frame(&[1, 2, 3, 4], MAX_FRAGMENT_SIZE),
            [0x80, 0, 0, 4, 1, 2, 3, 4]
        );
        assert_eq!(frame(&[], MAX_FRAGMENT_SIZE), [0x80, 0, 0, 0]);
    }

    #[test]
    fn writer_splits_fragments_across_chunks() {
        let chunks = [
            Bytes::from_static(&[1, 2, 3]),
            Bytes::from_static(&[4, 5, 6, 7, 8]),
        ];
        let mut out = Vec::new();
        write_record(&mut out, &chunks, 3).unwrap();
        assert_eq!(
            out,
            [
                0, 0, 0, 3, 1, 2, 3, 0, 0, 0, 3, 4, 5, 6, 0x80, 0, 0, 2, 7, 8
            ]
        );
        let mut r = RecordReader::new(&out[..], 100);
        assert_eq!(
            &r.read_record().unwrap().unwrap()[..],
            &[1, 2, 3, 4, 5, 6, 7, 8]
        );
        assert!(r.read_record().unwrap().is_none());
    }

    /// A writer that accepts at most a few bytes per call, to exercise partial writes.
    struct Trickle(Vec<u8>);
    impl Write for Trickle {
        fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
            let n = buf.len().min(3);
            self.0.extend_from_slice(&buf[..n]);
            Ok(n)
        }
        fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
            let first = bufs.iter().find(|b| !b.is_empty());
            first.map_or(Ok(0), |b| self.write(b))
        }
        fn flush(&mut self) -> io::Result<()> {
            Ok(())
        }
    }

    #[test]
    fn writer_handles_partial_writes() {
        let data: Vec<u8> = (0..100).collect();
        let chunks = [
            Bytes::copy_from_slice(&data[..10]),
            Bytes::new(),
            Bytes::copy_from_slice(&data[10..]),
        ];
        let mut t = Trickle(Vec::new());
        write_record(&mut t, &chunks, 7).unwrap();
        let mut r = RecordReader::new(&t.0[..], 1000);
        assert_eq!(&r.read_record().unwrap().unwrap()[..], &data[..]);
    }

    #[test]
    fn several_records_in_one_write_read_back_in_order() {
        let a = vec![Bytes::from_static(b"first"), Bytes::from(vec![7u8; 300])];
        let b = vec![Bytes::from(vec![9u8; 1000])];
        let c: Vec<Bytes> = vec![Bytes::from_static(b"x")];
        let mut out = Vec::new();
        write_records(&mut out, &[&a, &b, &c], 256).unwrap();
        let mut r = RecordReader::new(&out[..], 1 << 20);
        let first = r.read_record().unwrap().unwrap();
        assert_eq!(&first[..5], b"first");
        assert_eq!(first.len(), 305);
        assert_eq!(
            r.read_record().unwrap().unwrap(),
            Bytes::from(vec![9u8; 1000])
        );
        assert_eq!(&r.read_record().unwrap().unwrap()[..], b"x");
        assert!(r.read_record().unwrap().is_none());
    }

    #[test]
    fn libtirpc_sized_fragments_reassemble() {
        // libtirpc sends records in fragments of 65,532 bytes (its 64 KiB buffer less the header).
        let data: Vec<u8> = (0..300_000u32).map(|i| (i * 7) as u8).collect();
        let wire = frame(&data, 65_532);
        assert_eq!(&wire[..4], &[0, 0, 0xff, 0xfc]);
        let mut r = RecordReader::new(&wire[..], 1 << 20);
        let rec = r.read_record().unwrap().unwrap();
        assert_eq!(&rec[..], &data[..]);
        assert!(r.read_record().unwrap().is_none());
    }

    #[test]
    fn zero_length_fragments() {
        let mut wire = vec![0, 0, 0, 0, 0, 0, 0, 2, 9, 9, 0, 0, 0, 0, 0x80, 0, 0, 0];
        wire.extend([0x80, 0, 0, 0]); // an empty record
        let mut r = RecordReader::new(&wire[..], 100);
        assert_eq!(&r.read_record().unwrap().unwrap()[..], &[9, 9]);
        assert!(r.read_record().unwrap().unwrap().is_empty());
        assert!(r.read_record().unwrap().is_none());
    }

    #[test]
    fn several_records_back_to_back() {
        let mut wire = frame(b"abcd", 100);
        wire.extend(frame(b"efgh", 2));
        wire.extend(frame(&[5; 20_000], 9_000));
        let mut r = RecordReader::new(&wire[..], 100_000);
        assert_eq!(&r.read_record().unwrap().unwrap()[..], b"abcd");
        assert_eq!(&r.read_record().unwrap().unwrap()[..], b"efgh");
        assert_eq!(&r.read_record().unwrap().unwrap()[..], &[5; 20_000][..]);
        assert!(r.read_record().unwrap().is_none());
    }

    #[test]
    fn truncated_record() {
        for cut in [1, 3, 4, 6] {
            let wire = frame(&[1, 2, 3, 4], 100);
            let mut r = RecordReader::new(&wire[..cut], 100);
            assert!(
                matches!(r.read_record(), Err(RecordError::TruncatedRecord { .. })),
                "cut at {cut}"
            );
            assert!(matches!(r.read_record(), Err(RecordError::Poisoned)));
        }
        // A non-last fragment followed by EOF.
        let wire = [0, 0, 0, 2, 1, 2];
        let mut r = RecordReader::new(&wire[..], 100);
        assert!(matches!(
            r.read_record(),
            Err(RecordError::TruncatedRecord { received: 2 })
        ));
    }

    #[test]
    fn huge_length_rejected_cheaply() {
        let wire = [0xff, 0xff, 0xff, 0xff, 1, 2, 3, 4];
        let mut r = RecordReader::new(&wire[..], 1 << 20);
        assert!(matches!(
            r.read_record(),
            Err(RecordError::TooLarge {
                declared: 0x7fff_ffff,
                max: 0x10_0000
            })
        ));
        assert_eq!(r.buffered_record_bytes(), 0);
        assert_eq!(r.bytes_read(), 8);
        // Fragments adding up past the maximum are rejected at the header that crosses it.
        let mut wire = frame(&[0; 60], 30);
        wire.truncate(4 + 30 + 4);
        let mut r = RecordReader::new(&wire[..], 50);
        assert!(matches!(
            r.read_record(),
            Err(RecordError::TooLarge { declared: 60, .. })
        ));
    }

    #[test]
    fn huge_declared_length_costs_nothing_until_data_arrives() {
        // Within the maximum, a 2^31-1 declared fragment only grows the buffer with data.
        let mut wire = vec![0xff, 0xff, 0xff, 0xff];
        wire.extend(vec![7u8; 100]);
        let mut r = RecordReader::new(&wire[..], usize::MAX);
        assert!(matches!(
            r.read_record(),
            Err(RecordError::TruncatedRecord { received: 100 })
        ));
    }

    #[test]
    fn peer_closes_mid_record() {
        let mut wire = frame(&[3; 50_000], 65_532);
        wire.truncate(30_000);
        let mut r = RecordReader::new(&wire[..], 1 << 20);
        assert!(matches!(
            r.read_record(),
            Err(RecordError::TruncatedRecord { received: 29_996 })
        ));
    }

    #[test]
    fn resumes_after_timeout() {
        let data: Vec<u8> = (0..40_000u32).map(|i| i as u8).collect();
        let wire = frame(&data, 16_000);
        let timeout = || io::Error::new(io::ErrorKind::WouldBlock, "timeout");
        let steps = vec![
            Ok(wire[..2].to_vec()),
            Err(timeout()),
            Ok(wire[2..10].to_vec()),
            Err(io::Error::new(io::ErrorKind::TimedOut, "timeout")),
            Err(io::Error::new(io::ErrorKind::Interrupted, "eintr")),
            Ok(wire[10..16_005].to_vec()),
            Err(timeout()),
            Ok(wire[16_005..30_000].to_vec()),
            Err(timeout()),
            Ok(wire[30_000..].to_vec()),
        ];
        let mut r = RecordReader::new(Script::new(steps), 1 << 20);
        let mut timeouts = 0;
        let rec = loop {
            match r.read_record() {
                Ok(Some(rec)) => break rec,
                Err(e) if e.is_timeout() => {
                    assert!(r.in_record());
                    timeouts += 1;
                }
                other => panic!("{other:?}"),
            }
        };
        assert_eq!(timeouts, 4);
        assert_eq!(&rec[..], &data[..]);
        assert!(!r.in_record());
        assert!(r.read_record().unwrap().is_none());
    }

    #[test]
    fn timeout_between_records_is_not_in_record() {
        let wire = frame(b"abcd", 100);
        let steps = vec![
            Err(io::Error::new(io::ErrorKind::WouldBlock, "t")),
            Ok(wire.clone()),
        ];
        let mut r = RecordReader::new(Script::new(steps), 100);
        let e = r.read_record().unwrap_err();
        assert!(e.is_timeout());
        assert!(!r.in_record());
        assert_eq!(&r.read_record().unwrap().unwrap()[..], b"abcd");
    }

    #[test]
    fn hard_error_poisons() {
        let steps = vec![Err(io::Error::new(io::ErrorKind::ConnectionReset, "reset"))];
        let mut r = RecordReader::new(Script::new(steps), 100);
        assert!(matches!(r.read_record(), Err(RecordError::Io(_))));
        assert!(matches!(r.read_record(), Err(RecordError::Poisoned)));
    }

    proptest::proptest! {
        #[test]
        fn roundtrip_any_fragmentation(
            records in proptest::collection::vec(proptest::collection::vec(proptest::num::u8::ANY, 0..3000), 1..5),
            frag in 1usize..5000,
        ) {
            let mut wire = Vec::new();
            for rec in &records {
                write_record(&mut wire, &[Bytes::copy_from_slice(rec)], frag).unwrap();
            }
            let mut r = RecordReader::new(&wire[..], 10_000);
            for rec in &records {
                let got = r.read_record().unwrap().unwrap();
                proptest::prop_assert_eq!(&got[..], &rec[..]);
            }
            proptest::prop_assert!(r.read_record().unwrap().is_none());
        }

        #[test]
        fn a_record_of_any_parts_reads_back_whole(
            data in proptest::collection::vec(proptest::num::u8::ANY, 0..3000),
            cuts in proptest::collection::vec(0usize..3000, 0..12),
            frag in 1usize..5000,
        ) {
            // Parts of one record, fewer and more than the stack-framed few, some empty.
            let mut cuts: Vec<usize> = cuts.into_iter().map(|c| c.min(data.len())).collect();
            cuts.sort_unstable();
            let mut parts: Vec<&[u8]> = Vec::new();
            let mut at = 0;
            for c in cuts.into_iter().chain([data.len()]) {
                parts.push(&data[at..c]);
                at = c;
            }
            let mut wire = Vec::new();
            write_record_slices(&mut wire, &[&parts[..]], frag).unwrap();
            if data.len() <= frag {
                proptest::prop_assert_eq!(&wire[..], &frame(&data, frag)[..]);
            }
            let mut t = Trickle(Vec::new());
            write_record_slices(&mut t, &[parts.clone()], frag).unwrap();
            proptest::prop_assert_eq!(&t.0, &wire);
            let mut r = RecordReader::new(&wire[..], 10_000);
            proptest::prop_assert_eq!(&r.read_record().unwrap().unwrap()[..], &data[..]);
            proptest::prop_assert!(r.read_record().unwrap().is_none());
        }

        #[test]
        fn arbitrary_bytes_never_panic(raw in proptest::collection::vec(proptest::num::u8::ANY, 0..200)) {
            let mut r = RecordReader::new(&raw[..], 64);
            for _ in 0..10 {
                if r.read_record().is_err() { break; }
            }
        }
    }
}
