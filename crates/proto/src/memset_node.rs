//! A memset node's parameters between CUDA's ABI ([`remora_cuda_abi::graphs::MemsetNodeParams`],
//! `CUDA_MEMSET_NODE_PARAMS`) and the wire ([`RmMemsetNode`]), for the shim (which reads the
//! program's and fills the program's) and the server (which hands the driver one and reads one
//! back).

use remora_cuda_abi::graphs::MemsetNodeParams;

use crate::remora::RmMemsetNode;

/// The wire form of `p`.
pub fn from_abi(p: &MemsetNodeParams) -> RmMemsetNode {
    RmMemsetNode {
        dst: p.dst,
        pitch: p.pitch as u64,
        value: p.value,
        element_size: p.element_size,
        width: p.width as u64,
        height: p.height as u64,
    }
}

/// The ABI form of `m`; `None` when a size does not fit a `size_t`.
pub fn to_abi(m: &RmMemsetNode) -> Option<MemsetNodeParams> {
    Some(MemsetNodeParams {
        dst: m.dst,
        pitch: usize::try_from(m.pitch).ok()?,
        value: m.value,
        element_size: m.element_size,
        width: usize::try_from(m.width).ok()?,
        height: usize::try_from(m.height).ok()?,
    })
}
