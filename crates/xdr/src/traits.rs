//! The [`XdrEncode`] and [`XdrDecode`] traits and their impls for the basic types.
//!
//! | XDR | Rust |
//! |---|---|
//! | `int`, `unsigned int` | `i32`, `u32` |
//! | `hyper`, `unsigned hyper` | `i64`, `u64` |
//! | `float`, `double` | `f32`, `f64` |
//! | `bool` | `bool` |
//! | `opaque<>` | [`Bytes`] (zero-copy) |
//! | `string<>` | `String` |
//! | `T<>` | `Vec<T>` |
//! | `T *` | `Option<T>` / `Option<Box<T>>` |
//! | `void` | `()` |
//!
//! Bounded and fixed-length forms are encoded through the [`Encoder`]/[`Decoder`] methods that
//! take the bound, which is what generated code does.

use bytes::Bytes;

use crate::{Decoder, Encoder, Result, UNBOUNDED};

/// A value with an XDR encoding.
pub trait XdrEncode {
    /// Appends the value's encoding to `enc`.
    fn encode(&self, enc: &mut Encoder) -> Result<()>;
}

/// A value that can be decoded from XDR.
pub trait XdrDecode: Sized {
    /// Reads one value from `dec`.
    fn decode(dec: &mut Decoder) -> Result<Self>;
}

/// Encodes `value` into one contiguous buffer.
pub fn encode_to_bytes<T: XdrEncode + ?Sized>(value: &T) -> Result<Bytes> {
    let mut enc = Encoder::new();
    value.encode(&mut enc)?;
    Ok(enc.to_bytes())
}

/// Decodes exactly one `T` from `buf`, rejecting trailing bytes.
pub fn decode_all<T: XdrDecode>(buf: Bytes) -> Result<T> {
    let mut dec = Decoder::new(buf);
    let v = T::decode(&mut dec)?;
    dec.finish()?;
    Ok(v)
}

macro_rules! primitive {
    ($t:ty, $put:ident, $get:ident) => {
        impl XdrEncode for $t {
            #[inline]
            fn encode(&self, enc: &mut Encoder) -> Result<()> {
                enc.$put(*self);
                Ok(())
            }
        }
        impl XdrDecode for $t {
            #[inline]
            fn decode(dec: &mut Decoder) -> Result<Self> {
                dec.$get()
            }
        }
    };
}

primitive!(i32, put_i32, get_i32);
primitive!(u32, put_u32, get_u32);
primitive!(i64, put_i64, get_i64);
primitive!(u64, put_u64, get_u64);
primitive!(f32, put_f32, get_f32);
primitive!(f64, put_f64, get_f64);
primitive!(bool, put_bool, get_bool);

impl XdrEncode for () {
    fn encode(&self, _: &mut Encoder) -> Result<()> {
        Ok(())
    }
}

impl XdrDecode for () {
    fn decode(_: &mut Decoder) -> Result<Self> {
        Ok(())
    }
}

/// A variable-length type without a bound: `opaque<>` or `string<>`.
macro_rules! unbounded {
    ($t:ty, $put:ident, $get:ident) => {
        impl XdrEncode for $t {
            fn encode(&self, enc: &mut Encoder) -> Result<()> {
                enc.$put(self, UNBOUNDED)
            }
        }
        impl XdrDecode for $t {
            fn decode(dec: &mut Decoder) -> Result<Self> {
                dec.$get(UNBOUNDED)
            }
        }
    };
}

unbounded!(Bytes, put_opaque_bytes, get_opaque);
unbounded!(String, put_string, get_string);

impl XdrEncode for str {
    fn encode(&self, enc: &mut Encoder) -> Result<()> {
        enc.put_string(self, UNBOUNDED)
    }
}

impl<T: XdrEncode> XdrEncode for [T] {
    fn encode(&self, enc: &mut Encoder) -> Result<()> {
        enc.put_array(self, UNBOUNDED, |e, v| v.encode(e))
    }
}

impl<T: XdrEncode> XdrEncode for Vec<T> {
    fn encode(&self, enc: &mut Encoder) -> Result<()> {
        self.as_slice().encode(enc)
    }
}

impl<T: XdrDecode> XdrDecode for Vec<T> {
    fn decode(dec: &mut Decoder) -> Result<Self> {
        dec.get_array(UNBOUNDED, T::decode)
    }
}

impl<T: XdrEncode> XdrEncode for Option<T> {
    fn encode(&self, enc: &mut Encoder) -> Result<()> {
        enc.put_option(self.as_ref(), |e, v| v.encode(e))
    }
}

impl<T: XdrDecode> XdrDecode for Option<T> {
    fn decode(dec: &mut Decoder) -> Result<Self> {
        dec.get_option(T::decode)
    }
}

impl<T: XdrEncode + ?Sized> XdrEncode for Box<T> {
    fn encode(&self, enc: &mut Encoder) -> Result<()> {
        (**self).encode(enc)
    }
}

impl<T: XdrDecode> XdrDecode for Box<T> {
    fn decode(dec: &mut Decoder) -> Result<Self> {
        T::decode(dec).map(Box::new)
    }
}

impl<T: XdrEncode + ?Sized> XdrEncode for &T {
    fn encode(&self, enc: &mut Encoder) -> Result<()> {
        (**self).encode(enc)
    }
}

#[cfg(test)]
mod tests {
    use proptest::prelude::*;

    use super::*;
    use crate::{Error, ZERO_COPY_THRESHOLD};

    fn enc<T: XdrEncode + ?Sized>(v: &T) -> Vec<u8> {
        encode_to_bytes(v).unwrap().to_vec()
    }

    // Golden bytes from RFC 4506's rules: big-endian, 4-byte units, zero padding.
    #[test]
    fn golden_primitives() {
        assert_eq!(enc(&-2i32), [0xff, 0xff, 0xff, 0xfe]);
        assert_eq!(enc(&0xdead_beefu32), [0xde, 0xad, 0xbe, 0xef]);
        assert_eq!(enc(&-1i64), [0xff; 8]);
        assert_eq!(enc(&0x0102_0304_0506_0708u64), [1, 2, 3, 4, 5, 6, 7, 8]);
        assert_eq!(enc(&1.0f32), [0x3f, 0x80, 0, 0]);
        assert_eq!(enc(&-2.0f64), [0xc0, 0, 0, 0, 0, 0, 0, 0]);
        assert_eq!(enc(&true), [0, 0, 0, 1]);
        assert_eq!(enc(&()), [0u8; 0]);
    }

    #[test]
    fn golden_opaque_and_string() {
        assert_eq!(
            enc(&Bytes::from_static(b"abcde")),
            [0, 0, 0, 5, b'a', b'b', b'c', b'd', b'e', 0, 0, 0]
        );
        assert_eq!(enc("sillyprog"), b"\0\0\0\x09sillyprog\0\0\0");
        let mut e = Encoder::new();
        e.put_fixed_opaque(&[1, 2, 3]);
        assert_eq!(&e.to_bytes()[..], &[1, 2, 3, 0]);
    }

    #[test]
    fn golden_array_and_option() {
        assert_eq!(enc(&vec![1u32, 2]), [0, 0, 0, 2, 0, 0, 0, 1, 0, 0, 0, 2]);
        assert_eq!(enc(&Some(7u32)), [0, 0, 0, 1, 0, 0, 0, 7]);
        assert_eq!(enc(&None::<u32>), [0, 0, 0, 0]);
    }

    #[test]
    fn bounds_are_checked_on_encode() {
        let mut e = Encoder::new();
        assert_eq!(
            e.put_opaque(&[0; 5], 4),
            Err(Error::EncodeTooLong { len: 5, max: 4 })
        );
        assert!(
            e.put_fixed_array(&[1u32, 2], 3, |e, v| v.encode(e))
                .is_err()
        );
    }

    #[test]
    fn hostile_opaque_length_is_rejected_before_allocation() {
        let mut d = Decoder::from_slice(&[0xff, 0xff, 0xff, 0xff, 1, 2, 3, 4]);
        assert!(matches!(
            d.get_opaque(UNBOUNDED),
            Err(Error::LengthExceedsInput {
                len: 0xffff_ffff,
                ..
            })
        ));
        let mut d = Decoder::from_slice(&[0, 0, 0, 9, 1, 2, 3, 4]);
        assert_eq!(
            d.get_opaque(8),
            Err(Error::LengthExceedsBound { len: 9, max: 8 })
        );
        let mut d = Decoder::from_slice(&[0x7f, 0xff, 0xff, 0xff]);
        assert!(matches!(
            Vec::<u64>::decode(&mut d),
            Err(Error::LengthExceedsInput { .. })
        ));
    }

    #[test]
    fn padding_must_be_present() {
        // "abc" needs one byte of padding; without it the input is short.
        let mut d = Decoder::from_slice(&[0, 0, 0, 3, b'a', b'b', b'c']);
        assert!(matches!(
            d.get_string(UNBOUNDED),
            Err(Error::LengthExceedsInput {
                len: 3,
                needed: 4,
                ..
            })
        ));
    }

    #[test]
    fn nonzero_padding_rejected() {
        let mut d = Decoder::from_slice(&[0, 0, 0, 1, b'a', 0, 1, 0]);
        assert_eq!(d.get_string(UNBOUNDED), Err(Error::NonZeroPadding));
        let mut d = Decoder::from_slice(&[0, 0, 0, 1, 7, 0, 0, 9]);
        assert_eq!(d.get_opaque(UNBOUNDED), Err(Error::NonZeroPadding));
        let mut d = Decoder::from_slice(&[1, 2, 3, 4]);
        assert_eq!(d.get_fixed_opaque::<3>(), Err(Error::NonZeroPadding));
    }

    #[test]
    fn trailing_bytes_rejected() {
        assert_eq!(
            decode_all::<u32>(Bytes::from_static(&[0, 0, 0, 1, 0])),
            Err(Error::TrailingBytes(1))
        );
    }

    #[test]
    fn invalid_bool_and_utf8() {
        assert_eq!(
            decode_all::<bool>(Bytes::from_static(&[0, 0, 0, 2])),
            Err(Error::InvalidBool(2))
        );
        assert_eq!(
            decode_all::<String>(Bytes::from_static(&[0, 0, 0, 1, 0xff, 0, 0, 0])),
            Err(Error::InvalidUtf8)
        );
    }

    #[test]
    fn opaque_decodes_zero_copy() {
        let input = Bytes::from(enc(&Bytes::from(vec![9u8; 100])));
        let mut d = Decoder::new(input.clone());
        let out = d.get_opaque(UNBOUNDED).unwrap();
        assert_eq!(out.as_ptr(), input[4..].as_ptr());
    }

    #[test]
    fn large_opaque_encodes_zero_copy() {
        let payload = Bytes::from(vec![1u8; ZERO_COPY_THRESHOLD + 1]);
        let mut e = Encoder::new();
        e.put_u32(5);
        e.put_opaque_bytes(&payload, UNBOUNDED).unwrap();
        e.put_u32(6);
        let len = e.len();
        let chunks = e.finish();
        assert_eq!(chunks.len(), 3);
        assert_eq!(chunks[1].as_ptr(), payload.as_ptr());
        assert_eq!(chunks.iter().map(Bytes::len).sum::<usize>(), len);
        assert_eq!(len, 4 + 4 + ZERO_COPY_THRESHOLD + 1 + 3 + 4);
    }

    #[test]
    fn depth_limit_stops_deep_nesting() {
        // A list of 10 nested options, decoded with a limit of 5.
        let mut e = Encoder::new();
        for _ in 0..10 {
            e.put_bool(true);
        }
        e.put_bool(false);
        fn list(d: &mut Decoder) -> crate::Result<u32> {
            Ok(d.get_option(list)?.map_or(0, |n| n + 1))
        }
        let mut d = Decoder::new(e.to_bytes()).with_max_depth(5);
        assert_eq!(list(&mut d), Err(Error::DepthExceeded(5)));
        let mut e = Encoder::new();
        (0..10).for_each(|_| e.put_bool(true));
        e.put_bool(false);
        let mut d = Decoder::new(e.to_bytes());
        assert_eq!(list(&mut d), Ok(10));
    }

    #[test]
    fn narrow_integers() {
        let mut d = Decoder::from_slice(&[0, 0, 1, 0, 0, 0, 0, 0x7f]);
        assert!(matches!(
            d.get_narrow::<i8>("char"),
            Err(Error::IntegerOutOfRange { value: 256, .. })
        ));
        assert_eq!(d.get_narrow::<i8>("char"), Ok(127));
    }

    #[test]
    fn fixed_array_roundtrip() {
        let mut e = Encoder::new();
        e.put_fixed_array(&[1i32, -1, 3], 3, |e, v| v.encode(e))
            .unwrap();
        let mut d = Decoder::new(e.to_bytes());
        let a: [i32; 3] = d.get_fixed_array(i32::decode).unwrap();
        assert_eq!(a, [1, -1, 3]);
        d.finish().unwrap();
    }

    proptest! {
        #[test]
        fn roundtrip_values(a: i32, b: u64, s in "\\PC{0,40}", v: Vec<u32>, o: Option<i64>, raw: Vec<u8>) {
            let mut e = Encoder::new();
            a.encode(&mut e).unwrap();
            b.encode(&mut e).unwrap();
            s.encode(&mut e).unwrap();
            v.encode(&mut e).unwrap();
            o.encode(&mut e).unwrap();
            Bytes::from(raw.clone()).encode(&mut e).unwrap();
            let buf = e.to_bytes();
            prop_assert_eq!(buf.len() % 4, 0);
            let mut d = Decoder::new(buf);
            prop_assert_eq!(i32::decode(&mut d).unwrap(), a);
            prop_assert_eq!(u64::decode(&mut d).unwrap(), b);
            prop_assert_eq!(String::decode(&mut d).unwrap(), s);
            prop_assert_eq!(Vec::<u32>::decode(&mut d).unwrap(), v);
            prop_assert_eq!(Option::<i64>::decode(&mut d).unwrap(), o);
            prop_assert_eq!(Bytes::decode(&mut d).unwrap().to_vec(), raw);
            prop_assert!(d.finish().is_ok());
        }

        #[test]
        fn arbitrary_input_never_panics(raw: Vec<u8>) {
            let mut d = Decoder::from_slice(&raw);
            let _ = Vec::<Option<Vec<String>>>::decode(&mut d);
            let mut d = Decoder::from_slice(&raw);
            let _ = Vec::<Bytes>::decode(&mut d);
        }
    }
}
