//! XDR, the External Data Representation of RFC 4506, as Remora's ONC RPC layer uses it.
//!
//! ```text
//!  Rust value ──XdrEncode──► Encoder ──finish()──► Vec<Bytes> chunks ──writev──► socket
//!  socket ──record reassembly──► Bytes ──Decoder──XdrDecode──► Rust value (opaque<> zero-copy)
//! ```
//!
//! * [`Encoder`] appends big-endian, 4-byte-aligned items. Large `opaque<>` payloads held in
//!   [`Bytes`] are never copied: they become their own chunk, so the record writer can send
//!   them with vectored I/O.
//! * [`Decoder`] reads from one [`Bytes`] record. Variable-length `opaque<>` decodes as a
//!   [`Bytes`] slice of the record (zero-copy). **Every declared length is checked, against
//!   the declared maximum and against the bytes actually left in the record, before anything
//!   is allocated**, so a hostile length such as `0xFFFF_FFFF` costs nothing. Recursion through
//!   optional data (`*`, linked lists) is limited by a depth bound.
//! * [`Decoder::finish`] rejects trailing bytes.
//! * Nothing here panics on any input.
//!
//! Generated code (see the `remora-rpcgen` crate) calls the primitives on [`Encoder`] and
//! [`Decoder`] for each declaration, and implements [`XdrEncode`]/[`XdrDecode`] for each
//! struct, enum and union.
//!
//! ```
//! use remora_xdr::{Decoder, Encoder, XdrDecode, XdrEncode};
//! let mut enc = Encoder::new();
//! 42u32.encode(&mut enc).unwrap();
//! enc.put_string("hi", 16).unwrap();
//! let bytes = enc.to_bytes();
//! assert_eq!(&bytes[..], &[0, 0, 0, 42, 0, 0, 0, 2, b'h', b'i', 0, 0]);
//! let mut dec = Decoder::new(bytes);
//! assert_eq!(u32::decode(&mut dec).unwrap(), 42);
//! assert_eq!(dec.get_string(16).unwrap(), "hi");
//! dec.finish().unwrap();
//! ```
#![forbid(unsafe_code)]

mod decode;
mod encode;
mod error;
mod traits;

pub use bytes::{Bytes, BytesMut};
pub use decode::{DEFAULT_MAX_DEPTH, Decoder};
pub use encode::{Chunks, Encoder, ZERO_COPY_THRESHOLD};
pub use error::Error;
pub use traits::{XdrDecode, XdrEncode, decode_all, encode_to_bytes};

/// The unlimited bound of a variable-length item declared `<>`: 2^32 - 1, as RFC 4506 says.
pub const UNBOUNDED: u32 = u32::MAX;

/// Number of zero bytes that pad `len` bytes to a multiple of four.
#[inline]
pub const fn padding(len: usize) -> usize {
    (4 - (len % 4)) % 4
}

/// Result of an XDR operation.
pub type Result<T, E = Error> = core::result::Result<T, E>;

/// Declares module `$name` holding the code `remora-rpcgen` wrote to `$file` in the calling
/// crate's `OUT_DIR` (from its `build.rs`), with `#[allow(..)]` of the lints generated code may
/// trip (`remora_rpcgen::ALLOWED_LINTS`; an included file cannot carry inner attributes).
///
/// ```ignore
/// remora_xdr::include_generated! {
///     /// Generated from `x/nfs.x`.
///     pub mod nfs = "nfs.rs";
/// }
/// ```
#[macro_export]
macro_rules! include_generated {
    ($(#[$attr:meta])* $vis:vis mod $name:ident = $file:literal;) => {
        $(#[$attr])*
        #[allow(dead_code, missing_docs, unreachable_pub, non_camel_case_types, clippy::all)]
        $vis mod $name {
            include!(concat!(env!("OUT_DIR"), "/", $file));
        }
    };
}
