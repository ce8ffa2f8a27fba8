//! `CUmemAllocationProp` between CUDA's ABI ([`remora_cuda_abi::MemAllocationProp`]) and the
//! wire ([`RmMemProp`]), for the shim (which reads the program's and fills the program's) and
//! the server (which hands the driver one and reads one back). The Windows metadata pointer
//! does not travel.

use remora_cuda_abi::{MemAllocationProp, MemLocation};

use crate::remora::RmMemProp;

/// The wire form of `p`.
pub fn from_abi(p: &MemAllocationProp) -> RmMemProp {
    RmMemProp {
        r#type: p.kind,
        handle_types: p.requested_handle_types,
        location_type: p.location.kind,
        location_id: p.location.id,
        compression_type: u32::from(p.compression_type),
        rdma_capable: u32::from(p.gpu_direct_rdma_capable),
        usage: u32::from(p.usage),
    }
}

/// The ABI form of `p`; `None` when a flag does not fit its byte or short.
pub fn to_abi(p: &RmMemProp) -> Option<MemAllocationProp> {
    Some(MemAllocationProp {
        kind: p.r#type,
        requested_handle_types: p.handle_types,
        location: MemLocation {
            kind: p.location_type,
            id: p.location_id,
        },
        compression_type: u8::try_from(p.compression_type).ok()?,
        gpu_direct_rdma_capable: u8::try_from(p.rdma_capable).ok()?,
        usage: u16::try_from(p.usage).ok()?,
        ..MemAllocationProp::default()
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_property_round_trips_and_oversized_flags_are_refused() {
        let wire = RmMemProp {
            r#type: 1,
            handle_types: 1,
            location_type: 1,
            location_id: 3,
            compression_type: 1,
            rdma_capable: 1,
            usage: 2,
        };
        assert_eq!(from_abi(&to_abi(&wire).unwrap()), wire);
        assert!(
            to_abi(&RmMemProp {
                usage: 1 << 16,
                ..wire
            })
            .is_none()
        );
    }
}
