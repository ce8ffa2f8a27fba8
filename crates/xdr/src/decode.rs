//! The XDR decoder: bounded, zero-copy, never panics.

use bytes::Bytes;

use crate::{Error, Result, UNBOUNDED, padding};

/// Default limit on nesting through optional data and variable-length arrays.
///
/// A recursive list (`struct entry { ...; entry *next; }`) of more elements than this is
/// rejected with [`Error::DepthExceeded`] rather than risking the decoding thread's stack.
pub const DEFAULT_MAX_DEPTH: u32 = 1024;

/// Reads XDR items from one [`Bytes`] buffer, front to back.
///
/// Every read checks the remaining length first. Variable-length items check their declared
/// length against the declared maximum **and** against the bytes left before allocating, so
/// memory use is bounded by the size of the input.
#[derive(Debug, Clone)]
pub struct Decoder {
    buf: Bytes,
    pos: usize,
    depth: u32,
    max_depth: u32,
}

/// `Decoder` methods that read a big-endian integer.
macro_rules! get_int {
    ($($(#[$doc:meta])* $name:ident -> $t:ty;)*) => {$(
        $(#[$doc])*
        #[inline]
        pub fn $name(&mut self) -> Result<$t> {
            self.take_array::<{ std::mem::size_of::<$t>() }>()
                .map(<$t>::from_be_bytes)
        }
    )*};
}

impl Decoder {
    /// A decoder over `buf` with the default depth limit.
    pub fn new(buf: Bytes) -> Self {
        Self {
            buf,
            pos: 0,
            depth: 0,
            max_depth: DEFAULT_MAX_DEPTH,
        }
    }

    /// A decoder over a copy of `buf`.
    pub fn from_slice(buf: &[u8]) -> Self {
        Self::new(Bytes::copy_from_slice(buf))
    }

    /// Sets the limit on nesting through optional data and arrays.
    pub fn with_max_depth(mut self, max_depth: u32) -> Self {
        self.max_depth = max_depth;
        self
    }

    /// Bytes not read yet.
    #[inline]
    pub fn remaining(&self) -> usize {
        self.buf.len() - self.pos
    }

    /// Bytes read so far.
    #[inline]
    pub fn position(&self) -> usize {
        self.pos
    }

    /// The unread rest of the input, without consuming it.
    pub fn rest(&self) -> Bytes {
        self.buf.slice(self.pos..)
    }

    /// Checks that the whole input was consumed.
    pub fn finish(&self) -> Result<()> {
        match self.remaining() {
            0 => Ok(()),
            n => Err(Error::TrailingBytes(n)),
        }
    }

    #[inline]
    fn take(&mut self, n: usize) -> Result<&[u8]> {
        let remaining = self.remaining();
        if n > remaining {
            return Err(Error::UnexpectedEof {
                needed: n,
                remaining,
            });
        }
        let start = self.pos;
        self.pos += n;
        Ok(&self.buf[start..start + n])
    }

    #[inline]
    fn take_array<const N: usize>(&mut self) -> Result<[u8; N]> {
        let s = self.take(N)?;
        let mut out = [0u8; N];
        out.copy_from_slice(s);
        Ok(out)
    }

    /// Skips the padding after `len` bytes of opaque data; it must be zero (RFC 4506 §3), so
    /// that every value has exactly one encoding.
    fn skip_pad(&mut self, len: usize) -> Result<()> {
        if self.take(padding(len))?.iter().all(|&b| b == 0) {
            Ok(())
        } else {
            Err(Error::NonZeroPadding)
        }
    }

    get_int! {
        /// Decodes an `unsigned int`.
        get_u32 -> u32;
        /// Decodes an `int`.
        get_i32 -> i32;
        /// Decodes an `unsigned hyper`.
        get_u64 -> u64;
        /// Decodes a `hyper`.
        get_i64 -> i64;
    }

    /// Decodes a `float`.
    #[inline]
    pub fn get_f32(&mut self) -> Result<f32> {
        self.get_u32().map(f32::from_bits)
    }

    /// Decodes a `double`.
    #[inline]
    pub fn get_f64(&mut self) -> Result<f64> {
        self.get_u64().map(f64::from_bits)
    }

    /// Decodes a `bool`; anything but 0 or 1 is an error.
    #[inline]
    pub fn get_bool(&mut self) -> Result<bool> {
        match self.get_u32()? {
            0 => Ok(false),
            1 => Ok(true),
            v => Err(Error::InvalidBool(v)),
        }
    }

    /// Decodes an `int` and narrows it to `T` (rpcgen's `char`, `short`, `u_char`, `u_short`
    /// travel as 32-bit integers), rejecting values that do not fit.
    pub fn get_narrow<T: TryFrom<i64>>(&mut self, type_name: &'static str) -> Result<T> {
        let v = i64::from(self.get_i32()?);
        T::try_from(v).map_err(|_| Error::IntegerOutOfRange {
            type_name,
            value: v,
        })
    }

    /// Decodes an `unsigned int` and narrows it to `T`, rejecting values that do not fit.
    pub fn get_narrow_unsigned<T: TryFrom<u32>>(&mut self, type_name: &'static str) -> Result<T> {
        let v = self.get_u32()?;
        T::try_from(v).map_err(|_| Error::IntegerOutOfRange {
            type_name,
            value: i64::from(v),
        })
    }

    /// Decodes fixed-length opaque data `opaque x[N]` into an array.
    pub fn get_fixed_opaque<const N: usize>(&mut self) -> Result<[u8; N]> {
        let out = self.take_array::<N>()?;
        self.skip_pad(N)?;
        Ok(out)
    }

    /// Decodes fixed-length opaque data of `n` bytes as a zero-copy [`Bytes`] slice.
    pub fn get_fixed_opaque_bytes(&mut self, n: usize) -> Result<Bytes> {
        let total = n.saturating_add(padding(n));
        let remaining = self.remaining();
        if total > remaining {
            return Err(Error::UnexpectedEof {
                needed: total,
                remaining,
            });
        }
        if self.buf[self.pos + n..self.pos + total]
            .iter()
            .any(|&b| b != 0)
        {
            return Err(Error::NonZeroPadding);
        }
        let out = self.buf.slice(self.pos..self.pos + n);
        self.pos += total;
        Ok(out)
    }

    /// Reads a length prefix and checks it against `max` and against the input left, where
    /// each of the `len` items takes at least `min_item_size` bytes.
    pub fn get_len(&mut self, max: u32, min_item_size: usize) -> Result<usize> {
        let len = self.get_u32()?;
        if len > max {
            return Err(Error::LengthExceedsBound {
                len: u64::from(len),
                max: u64::from(max),
            });
        }
        let len_usize = len as usize;
        let needed = len_usize
            .checked_mul(min_item_size.max(1))
            .map(|n| {
                n + if min_item_size == 1 {
                    padding(len_usize)
                } else {
                    0
                }
            })
            .unwrap_or(usize::MAX);
        let remaining = self.remaining();
        if needed > remaining {
            return Err(Error::LengthExceedsInput {
                len: u64::from(len),
                needed: needed as u64,
                remaining,
            });
        }
        Ok(len_usize)
    }

    /// Decodes variable-length opaque data `opaque x<max>` as a zero-copy [`Bytes`] slice of
    /// the input.
    pub fn get_opaque(&mut self, max: u32) -> Result<Bytes> {
        let len = self.get_len(max, 1)?;
        self.get_fixed_opaque_bytes(len)
    }

    /// Decodes variable-length opaque data into a `Vec<u8>` (one copy).
    pub fn get_opaque_vec(&mut self, max: u32) -> Result<Vec<u8>> {
        self.get_opaque(max).map(|b| b.to_vec())
    }

    /// Decodes a string `string x<max>`; it must be valid UTF-8.
    pub fn get_string(&mut self, max: u32) -> Result<String> {
        let len = self.get_len(max, 1)?;
        let bytes = self.take(len)?;
        let s = core::str::from_utf8(bytes)
            .map_err(|_| Error::InvalidUtf8)?
            .to_owned();
        self.skip_pad(len)?;
        Ok(s)
    }

    /// Runs `f` one nesting level deeper, failing if that passes the depth limit.
    pub fn nested<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<T> {
        if self.depth >= self.max_depth {
            return Err(Error::DepthExceeded(self.max_depth));
        }
        self.depth += 1;
        let out = f(self);
        self.depth -= 1;
        out
    }

    /// Decodes a variable-length array `T x<max>`, each element with `f`.
    ///
    /// Every XDR item but `void` takes at least four bytes, so a count larger than a quarter of
    /// the remaining input is rejected before the vector is allocated.
    pub fn get_array<T>(
        &mut self,
        max: u32,
        mut f: impl FnMut(&mut Self) -> Result<T>,
    ) -> Result<Vec<T>> {
        let len = self.get_len(max, 4)?;
        self.nested(|d| {
            let mut out = Vec::with_capacity(len);
            for _ in 0..len {
                out.push(f(d)?);
            }
            Ok(out)
        })
    }

    /// Decodes a fixed-length array `T x[N]`, each element with `f`.
    pub fn get_fixed_array<T, const N: usize>(
        &mut self,
        mut f: impl FnMut(&mut Self) -> Result<T>,
    ) -> Result<[T; N]> {
        let needed = N.saturating_mul(4);
        let remaining = self.remaining();
        if needed > remaining {
            return Err(Error::UnexpectedEof { needed, remaining });
        }
        let mut items = Vec::with_capacity(N);
        for _ in 0..N {
            items.push(f(self)?);
        }
        items
            .try_into()
            .map_err(|v: Vec<T>| Error::FixedLengthMismatch {
                expected: N,
                actual: v.len(),
            })
    }

    /// Decodes optional data `T *x`: a presence flag, then the value with `f` if present.
    pub fn get_option<T>(&mut self, f: impl FnOnce(&mut Self) -> Result<T>) -> Result<Option<T>> {
        if self.get_bool()? {
            self.nested(f).map(Some)
        } else {
            Ok(None)
        }
    }

    /// Decodes an unbounded string, the common case.
    pub fn get_string_unbounded(&mut self) -> Result<String> {
        self.get_string(UNBOUNDED)
    }
}
