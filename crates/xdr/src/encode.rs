//! The XDR encoder: big-endian, 4-byte aligned, with zero-copy chunks for large payloads.

use bytes::{BufMut, Bytes, BytesMut};

use crate::{Error, Result, padding};

/// `opaque<>` payloads held in [`Bytes`] at least this long are not copied into the encoder's
/// buffer: they are kept as their own chunk and sent with vectored I/O.
pub const ZERO_COPY_THRESHOLD: usize = 16 * 1024;

const ZEROS: [u8; 4] = [0; 4];

/// Builds an XDR byte stream as a list of chunks.
///
/// Small items are appended to an internal buffer. A large [`Bytes`] payload passed to
/// [`Encoder::put_opaque_bytes`] becomes a chunk of its own, shared rather than copied.
#[derive(Debug)]
pub struct Encoder {
    chunks: Vec<Bytes>,
    buf: BytesMut,
    len: usize,
    /// Small items wait here and go to `buf` together (`stage[..staged]`): one copy into
    /// `buf` per so many integers rather than one call each.
    stage: [u8; STAGE],
    staged: usize,
}

/// Bytes of small items gathered before they go to the buffer.
const STAGE: usize = 64;

impl Default for Encoder {
    fn default() -> Self {
        Self::in_buf(BytesMut::new())
    }
}

/// The chunks of one encoded message ([`Encoder::finish_reusing`]), in order; a slice of
/// [`Bytes`] through `Deref`.
#[derive(Debug, Clone)]
pub enum Chunks {
    /// One chunk, without a list allocated for it (the usual small message).
    One(Bytes),
    /// Any number of chunks (large payloads kept apart, or none at all).
    Many(Vec<Bytes>),
}

impl std::ops::Deref for Chunks {
    type Target = [Bytes];

    fn deref(&self) -> &[Bytes] {
        match self {
            Chunks::One(b) => std::slice::from_ref(b),
            Chunks::Many(v) => v,
        }
    }
}

impl From<Chunks> for Vec<Bytes> {
    fn from(c: Chunks) -> Self {
        match c {
            Chunks::One(b) => vec![b],
            Chunks::Many(v) => v,
        }
    }
}

/// `Encoder` methods that append a big-endian integer (through the stage).
macro_rules! put_int {
    ($($(#[$doc:meta])* $name:ident($t:ty);)*) => {$(
        $(#[$doc])*
        #[inline]
        pub fn $name(&mut self, v: $t) {
            self.put_be(v.to_be_bytes());
        }
    )*};
}

impl Encoder {
    /// An empty encoder.
    pub fn new() -> Self {
        Self::default()
    }

    /// An empty encoder whose buffer has room for `cap` bytes.
    pub fn with_capacity(cap: usize) -> Self {
        Self::in_buf(BytesMut::with_capacity(cap))
    }

    /// An empty encoder that writes into `buf` (cleared first), for a caller that keeps one
    /// buffer between messages: see [`Encoder::finish_reusing`].
    pub fn in_buf(mut buf: BytesMut) -> Self {
        buf.clear();
        Self {
            chunks: Vec::new(),
            buf,
            len: 0,
            stage: [0; STAGE],
            staged: 0,
        }
    }

    /// Appends `N` bytes (an integer's encoding) through the stage.
    #[inline]
    fn put_be<const N: usize>(&mut self, bytes: [u8; N]) {
        if self.staged + N > STAGE {
            self.flush_stage();
        }
        self.stage[self.staged..self.staged + N].copy_from_slice(&bytes);
        self.staged += N;
        self.len += N;
    }

    /// Appends `bytes`: through the stage when they fit in it, else straight to the buffer.
    fn put_bytes(&mut self, bytes: &[u8]) {
        if bytes.len() > STAGE - self.staged {
            self.flush_stage();
            if bytes.len() > STAGE {
                self.buf.put_slice(bytes);
                self.len += bytes.len();
                return;
            }
        }
        self.stage[self.staged..self.staged + bytes.len()].copy_from_slice(bytes);
        self.staged += bytes.len();
        self.len += bytes.len();
    }

    /// Moves what waits in the stage to the buffer (before the buffer is split or read).
    fn flush_stage(&mut self) {
        if self.staged > 0 {
            self.buf.put_slice(&self.stage[..self.staged]);
            self.staged = 0;
        }
    }

    /// Total number of bytes encoded so far.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether nothing has been encoded yet.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Appends raw bytes that are already XDR-encoded (a multiple of four long).
    pub fn put_raw(&mut self, raw: &[u8]) {
        self.put_bytes(raw);
    }

    put_int! {
        /// Encodes an `unsigned int`.
        put_u32(u32);
        /// Encodes an `int`.
        put_i32(i32);
        /// Encodes an `unsigned hyper`.
        put_u64(u64);
        /// Encodes a `hyper`.
        put_i64(i64);
    }

    /// Encodes a `float` (IEEE 754 single precision).
    #[inline]
    pub fn put_f32(&mut self, v: f32) {
        self.put_u32(v.to_bits());
    }

    /// Encodes a `double` (IEEE 754 double precision).
    #[inline]
    pub fn put_f64(&mut self, v: f64) {
        self.put_u64(v.to_bits());
    }

    /// Encodes a `bool` as 0 or 1.
    #[inline]
    pub fn put_bool(&mut self, v: bool) {
        self.put_u32(u32::from(v));
    }

    /// Encodes the presence flag of optional data (`*`): 1 when present, 0 when absent.
    #[inline]
    pub fn put_option_flag(&mut self, present: bool) {
        self.put_bool(present);
    }

    fn put_pad(&mut self, len: usize) {
        let pad = padding(len);
        self.put_bytes(&ZEROS[..pad]);
    }

    /// Encodes fixed-length opaque data `opaque x[n]`: the bytes, then zero padding.
    pub fn put_fixed_opaque(&mut self, data: &[u8]) {
        self.put_bytes(data);
        self.put_pad(data.len());
    }

    /// Encodes a length prefix for a variable-length item after checking it against `max`.
    pub fn put_len(&mut self, len: usize, max: u32) -> Result<()> {
        if len > max as usize {
            return Err(Error::EncodeTooLong {
                len: len as u64,
                max: u64::from(max),
            });
        }
        self.put_u32(len as u32);
        Ok(())
    }

    /// Encodes variable-length opaque data `opaque x<max>` from a slice (copied).
    pub fn put_opaque(&mut self, data: &[u8], max: u32) -> Result<()> {
        self.put_len(data.len(), max)?;
        self.put_fixed_opaque(data);
        Ok(())
    }

    /// Encodes variable-length opaque data `opaque x<max>` from [`Bytes`]. Payloads of at least
    /// [`ZERO_COPY_THRESHOLD`] bytes are shared, not copied.
    pub fn put_opaque_bytes(&mut self, data: &Bytes, max: u32) -> Result<()> {
        if data.len() < ZERO_COPY_THRESHOLD {
            return self.put_opaque(data, max);
        }
        self.put_len(data.len(), max)?;
        self.flush_stage();
        if !self.buf.is_empty() {
            self.chunks.push(self.buf.split().freeze());
        }
        self.chunks.push(data.clone());
        self.len += data.len();
        self.put_pad(data.len());
        Ok(())
    }

    /// Encodes a string `string x<max>`.
    pub fn put_string(&mut self, s: &str, max: u32) -> Result<()> {
        self.put_opaque(s.as_bytes(), max)
    }

    /// Encodes a variable-length array `T x<max>`, each element with `f`.
    pub fn put_array<T>(
        &mut self,
        items: &[T],
        max: u32,
        mut f: impl FnMut(&mut Self, &T) -> Result<()>,
    ) -> Result<()> {
        self.put_len(items.len(), max)?;
        items.iter().try_for_each(|item| f(self, item))
    }

    /// Encodes a fixed-length array `T x[n]`, each element with `f`.
    pub fn put_fixed_array<T>(
        &mut self,
        items: &[T],
        n: usize,
        mut f: impl FnMut(&mut Self, &T) -> Result<()>,
    ) -> Result<()> {
        if items.len() != n {
            return Err(Error::FixedLengthMismatch {
                expected: n,
                actual: items.len(),
            });
        }
        items.iter().try_for_each(|item| f(self, item))
    }

    /// Encodes optional data `T *x`: the presence flag, then the value with `f` if present.
    pub fn put_option<T>(
        &mut self,
        item: Option<&T>,
        f: impl FnOnce(&mut Self, &T) -> Result<()>,
    ) -> Result<()> {
        self.put_option_flag(item.is_some());
        match item {
            Some(v) => f(self, v),
            None => Ok(()),
        }
    }

    /// Ends encoding and returns the chunks, in order. Their total length is [`Encoder::len`].
    pub fn finish(mut self) -> Vec<Bytes> {
        self.flush_stage();
        if !self.buf.is_empty() {
            self.chunks.push(self.buf.split().freeze());
        }
        self.chunks
    }

    /// As [`Encoder::finish`], and gives back the buffer's unused room (which shares its
    /// allocation with the returned chunks) for the next message: once those are dropped,
    /// `BytesMut::reserve` reuses the allocation instead of making a new one, so a stream of
    /// small messages allocates a buffer only every so many messages. A message of one chunk
    /// (no large payload kept apart) allocates no list for it either.
    pub fn finish_reusing(mut self) -> (Chunks, BytesMut) {
        self.flush_stage();
        let chunks = if self.chunks.is_empty() && !self.buf.is_empty() {
            Chunks::One(self.buf.split().freeze())
        } else {
            if !self.buf.is_empty() {
                self.chunks.push(self.buf.split().freeze());
            }
            Chunks::Many(self.chunks)
        };
        (chunks, self.buf)
    }

    /// Drops what was encoded and gives back the buffer, cleared, with all its room (for a
    /// message that is not sent after all; see [`Encoder::in_buf`]).
    pub fn into_buf(mut self) -> BytesMut {
        self.buf.clear();
        self.buf
    }

    /// Ends encoding and returns one contiguous buffer (copying any shared chunks). Meant for
    /// small messages and tests; the record writer uses [`Encoder::finish`].
    pub fn to_bytes(self) -> Bytes {
        let mut chunks = self.finish();
        match chunks.len() {
            0 => Bytes::new(),
            1 => chunks.pop().unwrap_or_default(),
            _ => {
                let total = chunks.iter().map(Bytes::len).sum();
                let mut out = BytesMut::with_capacity(total);
                chunks.iter().for_each(|c| out.put_slice(c));
                out.freeze()
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// One encoder call, for the comparison with plain byte writes below.
    #[derive(Debug, Clone)]
    enum Op {
        U32(u32),
        U64(u64),
        Raw(Vec<u8>),
        Fixed(Vec<u8>),
        Opaque(Vec<u8>),
        Large(usize),
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            any::<u32>().prop_map(Op::U32),
            any::<u64>().prop_map(Op::U64),
            proptest::collection::vec(any::<u8>(), 0..20).prop_map(|v| {
                // put_raw takes whole XDR words.
                let n = v.len() / 4 * 4;
                Op::Raw(v[..n].to_vec())
            }),
            proptest::collection::vec(any::<u8>(), 0..150).prop_map(Op::Fixed),
            proptest::collection::vec(any::<u8>(), 0..150).prop_map(Op::Opaque),
            (0usize..3).prop_map(|k| Op::Large(ZERO_COPY_THRESHOLD + k)),
        ]
    }

    proptest! {
        #[test]
        fn staged_encoding_equals_plain_byte_writes(ops in proptest::collection::vec(op(), 0..60), reuse in any::<bool>()) {
            let mut e = if reuse { Encoder::in_buf(BytesMut::with_capacity(16)) } else { Encoder::new() };
            let mut want: Vec<u8> = Vec::new();
            let pad = |w: &mut Vec<u8>, n: usize| w.extend(std::iter::repeat_n(0u8, padding(n)));
            for op in &ops {
                match op {
                    Op::U32(v) => { e.put_u32(*v); want.extend(v.to_be_bytes()); }
                    Op::U64(v) => { e.put_u64(*v); want.extend(v.to_be_bytes()); }
                    Op::Raw(b) => { e.put_raw(b); want.extend(b); }
                    Op::Fixed(b) => { e.put_fixed_opaque(b); want.extend(b); pad(&mut want, b.len()); }
                    Op::Opaque(b) => {
                        e.put_opaque(b, u32::MAX).unwrap();
                        want.extend((b.len() as u32).to_be_bytes());
                        want.extend(b);
                        pad(&mut want, b.len());
                    }
                    Op::Large(n) => {
                        let b = Bytes::from(vec![0xA5u8; *n]);
                        e.put_opaque_bytes(&b, u32::MAX).unwrap();
                        want.extend((*n as u32).to_be_bytes());
                        want.extend(&b[..]);
                        pad(&mut want, *n);
                    }
                }
                prop_assert_eq!(e.len(), want.len());
            }
            let got: Vec<u8> = if reuse {
                e.finish_reusing().0.iter().flat_map(|c| c.to_vec()).collect()
            } else {
                e.finish().iter().flat_map(|c| c.to_vec()).collect()
            };
            prop_assert_eq!(got, want);
        }
    }

    #[test]
    fn a_reused_buffer_keeps_earlier_messages_intact_and_its_allocation() {
        let mut first = Encoder::in_buf(BytesMut::with_capacity(64));
        first.put_u32(1);
        first.put_u32(2);
        let (a, spare) = first.finish_reusing();
        assert_eq!(a.concat(), [0, 0, 0, 1, 0, 0, 0, 2]);
        assert!(
            spare.capacity() >= 64 - 8,
            "the room after the first message is kept"
        );
        let mut second = Encoder::in_buf(spare);
        second.put_u32(3);
        second.put_opaque(b"xyz", 16).unwrap();
        let (b, _) = second.finish_reusing();
        // The first message's bytes were not touched by the second one.
        assert_eq!(a.concat(), [0, 0, 0, 1, 0, 0, 0, 2]);
        assert_eq!(b.concat(), [0, 0, 0, 3, 0, 0, 0, 3, b'x', b'y', b'z', 0]);
        // Both came out of the one allocation made for the first.
        let end_a = a[0].as_ptr() as usize + a[0].len();
        assert_eq!(b[0].as_ptr() as usize, end_a);
    }
}
