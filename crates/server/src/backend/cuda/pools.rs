//! [`MemPools`] on the real driver: stream-ordered allocation and memory pools. Pool calls
//! need no current context (pools belong to devices); the allocation calls run in the
//! stream's context. Device ordinals, including those inside locations, are mapped to the
//! real devices (`--devices`).

use std::ffi::{c_int, c_void};

use remora_cuda_abi::pools::MemPoolProps;
use remora_proto::cuda::{CuError, CuResult, cu};

use super::CudaBackend;
use super::driver::{Driver, Ptr, ptr};
use crate::backend::pools::{
    LOCATION_TYPE_DEVICE, MemAccessDesc, MemLocation, MemPools, PoolProps, attr,
};

/// `location` with a device ordinal of the client mapped to the driver's device.
fn real_location(d: &Driver, location: MemLocation) -> CuResult<MemLocation> {
    if location.kind == LOCATION_TYPE_DEVICE {
        return Ok(MemLocation {
            kind: location.kind,
            id: d.dev(location.id)?,
        });
    }
    Ok(location)
}

fn size(v: u64) -> CuResult<usize> {
    usize::try_from(v).map_err(|_| CuError(cu::INVALID_VALUE))
}

impl MemPools for CudaBackend {
    fn mem_alloc_async(
        &self,
        ctx: u64,
        stream: u64,
        bytes: u64,
        pool: Option<u64>,
    ) -> CuResult<u64> {
        let d = self.in_ctx(ctx)?;
        let mut p: u64 = 0;
        match pool {
            // SAFETY: writes one CUdeviceptr; `stream` is a stream of this context or
            // CU_STREAM_LEGACY; the context is current.
            None => call!(d.t, mem_alloc_async(&mut p, size(bytes)?, ptr(stream)))?,
            // SAFETY: writes one CUdeviceptr; `pool` is a pool the driver gave this process
            // and `stream` a stream of this context (or CU_STREAM_LEGACY); the context is
            // current.
            Some(pool) => call!(
                d.t,
                mem_alloc_from_pool_async(&mut p, size(bytes)?, ptr(pool), ptr(stream))
            )?,
        }
        Ok(p)
    }

    fn mem_free_async(&self, ctx: u64, stream: u64, p: u64) -> CuResult<()> {
        let d = self.in_ctx(ctx)?;
        // SAFETY: a stream-ordered allocation of this session (checked by the caller) and a
        // stream of this context or CU_STREAM_LEGACY.
        call!(d.t, mem_free_async(p, ptr(stream)))
    }

    fn device_get_default_mem_pool(&self, dev: i32) -> CuResult<u64> {
        let d = self.d()?;
        let mut pool: Ptr = std::ptr::null_mut();
        // SAFETY: writes one CUmemoryPool; the device is a real one.
        call!(d.t, device_get_default_mem_pool(&mut pool, d.dev(dev)?))?;
        Ok(pool as u64)
    }

    fn device_get_mem_pool(&self, dev: i32) -> CuResult<u64> {
        let d = self.d()?;
        let mut pool: Ptr = std::ptr::null_mut();
        // SAFETY: writes one CUmemoryPool; the device is a real one.
        call!(d.t, device_get_mem_pool(&mut pool, d.dev(dev)?))?;
        Ok(pool as u64)
    }

    fn device_set_mem_pool(&self, dev: i32, pool: u64) -> CuResult<()> {
        let d = self.d()?;
        // SAFETY: a pool the driver gave this process (a session handle resolved it).
        call!(d.t, device_set_mem_pool(d.dev(dev)?, ptr(pool)))
    }

    fn mem_pool_create(&self, props: &PoolProps) -> CuResult<u64> {
        let d = self.d()?;
        let p = MemPoolProps {
            alloc_type: props.alloc_type,
            handle_types: crate::backend::pools::HANDLE_TYPE_NONE,
            location: real_location(d, props.location)?,
            max_size: size(props.max_size)?,
            usage: props.usage,
            ..MemPoolProps::default()
        };
        let mut pool: Ptr = std::ptr::null_mut();
        // SAFETY: writes one CUmemoryPool; `p` is a complete CUmemPoolProps (reserved bytes
        // and the Windows field zero) that lives across the call.
        call!(d.t, mem_pool_create(&mut pool, &p))?;
        Ok(pool as u64)
    }

    fn mem_pool_destroy(&self, pool: u64) -> CuResult<()> {
        let d = self.d()?;
        // SAFETY: a pool this session created (checked by the caller).
        call!(d.t, mem_pool_destroy(ptr(pool)))
    }

    fn mem_pool_set_attribute(&self, pool: u64, attribute: i32, value: u64) -> CuResult<()> {
        let d = self.d()?;
        if attr::is_int(attribute) {
            let mut v = c_int::try_from(value).map_err(|_| CuError(cu::INVALID_VALUE))?;
            // SAFETY: an int attribute reads one int from a live cell.
            call!(
                d.t,
                mem_pool_set_attribute(ptr(pool), attribute, (&raw mut v).cast::<c_void>())
            )
        } else {
            let mut v = value;
            // SAFETY: the other attributes read one cuuint64_t from a live cell (an unknown
            // attribute is refused by the driver before it reads).
            call!(
                d.t,
                mem_pool_set_attribute(ptr(pool), attribute, (&raw mut v).cast::<c_void>())
            )
        }
    }

    fn mem_pool_get_attribute(&self, pool: u64, attribute: i32) -> CuResult<u64> {
        let d = self.d()?;
        // Room for a cuuint64_t whatever the attribute; an int attribute fills the first
        // four bytes (zeroed, so the value reads the same either way).
        let mut cell = [0u8; 8];
        // SAFETY: writes at most eight bytes into a live eight-byte cell.
        call!(
            d.t,
            mem_pool_get_attribute(ptr(pool), attribute, cell.as_mut_ptr().cast::<c_void>())
        )?;
        if attr::is_int(attribute) {
            let v = c_int::from_ne_bytes([cell[0], cell[1], cell[2], cell[3]]);
            return u64::try_from(v).map_err(|_| CuError(cu::UNKNOWN));
        }
        Ok(u64::from_ne_bytes(cell))
    }

    fn mem_pool_trim_to(&self, pool: u64, keep: u64) -> CuResult<()> {
        let d = self.d()?;
        // SAFETY: a pool the driver gave this process; a plain size.
        call!(d.t, mem_pool_trim_to(ptr(pool), size(keep)?))
    }

    fn mem_pool_set_access(&self, pool: u64, map: &[MemAccessDesc]) -> CuResult<()> {
        let d = self.d()?;
        let map = map
            .iter()
            .map(|a| {
                Ok(MemAccessDesc {
                    location: real_location(d, a.location)?,
                    flags: a.flags,
                })
            })
            .collect::<CuResult<Vec<_>>>()?;
        // SAFETY: `map` holds `map.len()` CUmemAccessDesc (bounded by the protocol) and lives
        // across the call.
        call!(d.t, mem_pool_set_access(ptr(pool), map.as_ptr(), map.len()))
    }

    fn mem_pool_get_access(&self, pool: u64, location: MemLocation) -> CuResult<i32> {
        let d = self.d()?;
        let mut loc = real_location(d, location)?;
        let mut flags: c_int = 0;
        // SAFETY: writes one CUmemAccess_flags; reads one CUmemLocation from a live cell.
        call!(d.t, mem_pool_get_access(&mut flags, ptr(pool), &mut loc))?;
        Ok(flags)
    }
}
