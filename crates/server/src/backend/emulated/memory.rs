//! Device memory of the emulated **test** backend: allocations in host memory, the bytes of
//! an address range (of an allocation or of a `cuMemMap` mapping), and the kernels' view of
//! them.

use remora_proto::cuda::{CuError, CuResult, cu};

use super::{State, align_up, emulated_kernels};

/// One allocation: its device, its bytes, and whether it is a module global.
pub(super) struct Alloc {
    pub(super) dev: i32,
    pub(super) data: Vec<u8>,
    pub(super) global: bool,
}

impl State {
    pub(super) fn alloc(&mut self, dev: i32, size: u64, limit: u64, global: bool) -> CuResult<u64> {
        if size == 0 {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let used = self.used.entry(dev).or_default();
        if size > limit.saturating_sub(*used) {
            return Err(CuError(cu::OUT_OF_MEMORY));
        }
        let data = vec![0u8; usize::try_from(size).map_err(|_| CuError(cu::OUT_OF_MEMORY))?];
        *used += size;
        let ptr = self.next_addr;
        // Leave a gap so that off-by-one accesses land outside every allocation.
        self.next_addr = align_up(ptr + size, 0x1000) + 0x1000;
        self.allocs.insert(ptr, Alloc { dev, data, global });
        Ok(ptr)
    }

    pub(super) fn free(&mut self, ptr: u64) -> CuResult<()> {
        let a = self.allocs.remove(&ptr).ok_or(CuError(cu::INVALID_VALUE))?;
        if let Some(u) = self.used.get_mut(&a.dev) {
            *u -= a.data.len() as u64;
        }
        Ok(())
    }

    /// The bytes `[ptr, ptr + len)` of one allocation or one mapping (with access set).
    pub(super) fn range(&mut self, ptr: u64, len: u64) -> CuResult<&mut [u8]> {
        if let Some((&va, m)) = self.mapped.range(..=ptr).next_back()
            && ptr < va + m.size
        {
            let off = ptr - va;
            let end = off.checked_add(len).ok_or(CuError(cu::INVALID_VALUE))?;
            if end > m.size || m.access == 0 {
                return Err(CuError(cu::INVALID_VALUE));
            }
            let p = self
                .phys
                .get_mut(&m.phys)
                .ok_or(CuError(cu::INVALID_VALUE))?;
            let start = (m.offset + off) as usize;
            return Ok(&mut p.data[start..start + len as usize]);
        }
        let (base, a) = self
            .allocs
            .range_mut(..=ptr)
            .next_back()
            .ok_or(CuError(cu::INVALID_VALUE))?;
        let off = ptr - base;
        let end = off.checked_add(len).ok_or(CuError(cu::INVALID_VALUE))?;
        if end > a.data.len() as u64 {
            return Err(CuError(cu::INVALID_VALUE));
        }
        Ok(&mut a.data[off as usize..end as usize])
    }
}

impl emulated_kernels::Memory for State {
    fn read(&mut self, ptr: u64, len: u64) -> CuResult<Vec<u8>> {
        Ok(self.range(ptr, len)?.to_vec())
    }
    fn write(&mut self, ptr: u64, data: &[u8]) -> CuResult<()> {
        self.range(ptr, data.len() as u64)?.copy_from_slice(data);
        Ok(())
    }
}

/// Fills `bytes` with `value` as elements of `elem` bytes.
pub(super) fn fill(bytes: &mut [u8], value: u32, elem: u32) {
    let v = value.to_le_bytes();
    for chunk in bytes.chunks_mut(elem as usize) {
        chunk.copy_from_slice(&v[..chunk.len()]);
    }
}
