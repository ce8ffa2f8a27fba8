//! `CUmemLocation` and `CUmemAccessDesc` between CUDA's ABI ([`remora_cuda_abi::MemLocation`],
//! [`remora_cuda_abi::MemAccessDesc`]) and the wire ([`RmPoolLocation`], [`RmPoolAccess`]):
//! memory pools, their access maps and memory allocation nodes, for the shim and the server.

use remora_cuda_abi::{MemAccessDesc, MemLocation};

use crate::remora::{RmPoolAccess, RmPoolLocation};

/// The wire form of `l`.
pub fn location_from_abi(l: MemLocation) -> RmPoolLocation {
    RmPoolLocation {
        kind: l.kind,
        id: l.id,
    }
}

/// The ABI form of `l`.
pub fn location_to_abi(l: &RmPoolLocation) -> MemLocation {
    MemLocation {
        kind: l.kind,
        id: l.id,
    }
}

/// The wire form of `d`.
pub fn access_from_abi(d: &MemAccessDesc) -> RmPoolAccess {
    RmPoolAccess {
        location: location_from_abi(d.location),
        flags: d.flags,
    }
}

/// The ABI form of `a`.
pub fn access_to_abi(a: &RmPoolAccess) -> MemAccessDesc {
    MemAccessDesc {
        location: location_to_abi(&a.location),
        flags: a.flags,
    }
}
