//! Stream attribute values between CUDA's ABI and the wire: a `CUstreamAttrValue` (the 64-byte
//! `CUlaunchAttributeValue` union, 8-byte aligned) and [`RmStreamAttr`]. The shim reads the
//! program's value, the server hands the driver one; both use these two functions.
//!
//! Layouts (CUDA 13.0 `cuda.h`, 64-bit): the access policy window is `{ void *base_ptr;
//! size_t num_bytes; float hitRatio; CUaccessProperty hitProp, missProp; }` at 0, 8, 16, 20,
//! 24; the synchronization policy, priority and memory sync domain are an `int` at 0; the
//! memory sync domain map is two bytes (default, remote) at 0.

use crate::remora::{RmAccessPolicy, RmStreamAttr};

/// Bytes of a `CUstreamAttrValue`.
pub const VALUE_BYTES: usize = 64;

fn word<const N: usize>(v: &[u8; VALUE_BYTES], at: usize) -> [u8; N] {
    let mut w = [0u8; N];
    w.copy_from_slice(&v[at..at + N]);
    w
}

/// The wire value of attribute `kind` read from `value`; `None` for an attribute CUDA does not
/// define for streams.
pub fn from_abi(kind: i32, value: &[u8; VALUE_BYTES]) -> Option<RmStreamAttr> {
    let int = i32::from_ne_bytes(word(value, 0));
    Some(match kind {
        1 => RmStreamAttr::Case1(RmAccessPolicy {
            base: u64::from_ne_bytes(word(value, 0)),
            num_bytes: u64::from_ne_bytes(word(value, 8)),
            hit_ratio: f32::from_ne_bytes(word(value, 16)),
            hit_prop: i32::from_ne_bytes(word(value, 20)),
            miss_prop: i32::from_ne_bytes(word(value, 24)),
        }),
        3 => RmStreamAttr::Case3(int),
        8 => RmStreamAttr::Case8(int),
        9 => RmStreamAttr::Case9(u32::from(value[0]) | u32::from(value[1]) << 8),
        10 => RmStreamAttr::Case10(int),
        _ => return None,
    })
}

/// The attribute id and the `CUstreamAttrValue` of a wire value (unused bytes zero).
pub fn to_abi(attr: &RmStreamAttr) -> (i32, [u8; VALUE_BYTES]) {
    let mut v = [0u8; VALUE_BYTES];
    let kind = match attr {
        RmStreamAttr::Case1(w) => {
            v[0..8].copy_from_slice(&w.base.to_ne_bytes());
            v[8..16].copy_from_slice(&w.num_bytes.to_ne_bytes());
            v[16..20].copy_from_slice(&w.hit_ratio.to_ne_bytes());
            v[20..24].copy_from_slice(&w.hit_prop.to_ne_bytes());
            v[24..28].copy_from_slice(&w.miss_prop.to_ne_bytes());
            1
        }
        RmStreamAttr::Case3(x) | RmStreamAttr::Case8(x) | RmStreamAttr::Case10(x) => {
            v[0..4].copy_from_slice(&x.to_ne_bytes());
            match attr {
                RmStreamAttr::Case3(_) => 3,
                RmStreamAttr::Case8(_) => 8,
                _ => 10,
            }
        }
        RmStreamAttr::Case9(m) => {
            v[0] = (*m & 0xff) as u8;
            v[1] = (*m >> 8 & 0xff) as u8;
            9
        }
    };
    (kind, v)
}

/// The attribute id of a wire value.
pub fn kind(attr: &RmStreamAttr) -> i32 {
    to_abi(attr).0
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_stream_attribute_round_trips_through_the_abi() {
        let values = [
            RmStreamAttr::Case1(RmAccessPolicy {
                base: 0x7f00_1234_5000,
                num_bytes: 3 << 20,
                hit_ratio: 0.6,
                hit_prop: 2,
                miss_prop: 1,
            }),
            RmStreamAttr::Case3(2),
            RmStreamAttr::Case8(-1),
            RmStreamAttr::Case9(0x0201),
            RmStreamAttr::Case10(1),
        ];
        for v in values {
            let (kind, abi) = to_abi(&v);
            assert_eq!(from_abi(kind, &abi), Some(v));
        }
        assert_eq!(
            from_abi(2, &[0; VALUE_BYTES]),
            None,
            "cooperative is not a stream attribute"
        );
    }
}
