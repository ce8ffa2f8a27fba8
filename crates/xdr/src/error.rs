//! The one error type of the XDR layer.

/// What went wrong while encoding or decoding XDR data.
///
/// Decoding errors map onto the ONC RPC `GARBAGE_ARGS` accept status on a server and onto a
/// decode error on a client.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// The input ended early: {needed} more bytes were needed, {remaining} remain.
    #[error("XDR input ended early: {needed} bytes needed, {remaining} remain")]
    UnexpectedEof {
        /// Bytes the item needed.
        needed: usize,
        /// Bytes left in the input.
        remaining: usize,
    },
    /// A declared length is larger than the maximum the type allows.
    #[error("XDR length {len} exceeds the declared maximum {max}")]
    LengthExceedsBound {
        /// The declared length.
        len: u64,
        /// The maximum allowed by the type.
        max: u64,
    },
    /// A declared length cannot fit in what is left of the input, so it is rejected before any
    /// allocation is made.
    #[error(
        "XDR length {len} (at least {needed} bytes) exceeds the {remaining} bytes left in the input"
    )]
    LengthExceedsInput {
        /// The declared length (bytes or elements).
        len: u64,
        /// The least number of bytes that many items take.
        needed: u64,
        /// Bytes left in the input.
        remaining: usize,
    },
    /// A discriminant or enum value is not one the type declares.
    #[error("XDR value {value} is not a valid discriminant of {type_name}")]
    UnknownDiscriminant {
        /// The Rust name of the type being decoded.
        type_name: &'static str,
        /// The value on the wire.
        value: i64,
    },
    /// A boolean was neither 0 nor 1.
    #[error("XDR boolean must be 0 or 1, got {0}")]
    InvalidBool(u32),
    /// A string was not valid UTF-8.
    #[error("XDR string is not valid UTF-8")]
    InvalidUtf8,
    /// An integer on the wire does not fit the narrower type it decodes into (rpcgen's `char`,
    /// `short` and friends travel as 32-bit integers).
    #[error("XDR integer {value} out of range for {type_name}")]
    IntegerOutOfRange {
        /// The Rust type being decoded.
        type_name: &'static str,
        /// The value on the wire.
        value: i64,
    },
    /// The padding after opaque data or a string was not zero, as RFC 4506 §3 requires.
    #[error("XDR padding bytes must be zero")]
    NonZeroPadding,
    /// Bytes were left after the last item: the message is malformed.
    #[error("{0} trailing bytes after the XDR data")]
    TrailingBytes(usize),
    /// Optional data or unions nested deeper than the decoder allows (for example a linked
    /// list longer than the bound).
    #[error("XDR data nested deeper than the limit of {0}")]
    DepthExceeded(u32),
    /// A value to encode is longer than its declared maximum.
    #[error("cannot encode: length {len} exceeds the declared maximum {max}")]
    EncodeTooLong {
        /// The value's length.
        len: u64,
        /// The maximum allowed by the type.
        max: u64,
    },
    /// A fixed-length item had the wrong length when encoding.
    #[error("cannot encode: fixed-length item needs {expected} elements, got {actual}")]
    FixedLengthMismatch {
        /// The declared length.
        expected: usize,
        /// The value's length.
        actual: usize,
    },
}
