//! Memory pools of the emulated **test** backend: enough of CUDA's stream-ordered allocator to
//! test the executor's pool handling end to end.
//!
//! A pool holds *reserved* bytes (counted against its device's memory) of which *used* bytes
//! are handed out as allocations; the rest is cached for later allocations. Each device has a
//! default pool (made on first use) and a current pool. Work completes when it is issued, so
//! a free returns its bytes to the cache at once, and memory above the release threshold goes
//! back to the device right then (the driver does it at the next synchronize).
//! `cuMemPoolTrimTo` releases the cache down to what it is asked to keep. Pools on host
//! locations, managed pools and allocations on capturing streams are refused.

use std::collections::HashMap;

use remora_proto::cuda::{CuError, CuResult, cu};

use super::{EmuOp, EmulatedBackend, State};
use crate::backend::pools::{
    ALLOCATION_TYPE_PINNED, LOCATION_TYPE_DEVICE, MemAccessDesc, MemLocation, MemPools, PoolProps,
    attr,
};

/// `CU_MEM_ACCESS_FLAGS_PROT_READWRITE`.
const PROT_READWRITE: i32 = 3;

/// One emulated pool.
#[derive(Debug)]
struct EmuPool {
    dev: i32,
    /// The reuse flags, by attribute (1 to 3).
    reuse: [bool; 3],
    release_threshold: u64,
    max_size: u64,
    reserved: u64,
    reserved_high: u64,
    used: u64,
    used_high: u64,
    /// Access of other devices (their own device always has read-write access).
    access: HashMap<i32, i32>,
}

impl EmuPool {
    fn new(dev: i32, max_size: u64) -> Self {
        Self {
            dev,
            reuse: [true; 3],
            release_threshold: 0,
            max_size,
            reserved: 0,
            reserved_high: 0,
            used: 0,
            used_high: 0,
            access: HashMap::new(),
        }
    }

    /// Cached bytes: reserved and not handed out.
    fn cached(&self) -> u64 {
        self.reserved - self.used
    }
}

/// The pools of the emulated backend (part of its state, under its lock).
#[derive(Debug, Default)]
pub(super) struct Pools {
    pools: HashMap<u64, EmuPool>,
    /// Device → its default pool.
    defaults: HashMap<i32, u64>,
    /// Device → its current pool, when set to another than the default.
    current: HashMap<i32, u64>,
    /// Allocation → the pool it came from (absent once the pool was destroyed).
    allocations: HashMap<u64, Option<u64>>,
}

impl Pools {
    /// Whether `ptr` is a live stream-ordered allocation.
    pub(super) fn owns(&self, ptr: u64) -> bool {
        self.allocations.contains_key(&ptr)
    }
}

impl State {
    fn pool(&mut self, pool: u64) -> CuResult<&mut EmuPool> {
        self.pools
            .pools
            .get_mut(&pool)
            .ok_or(CuError(cu::INVALID_VALUE))
    }

    fn default_pool(&mut self, dev: i32) -> u64 {
        if let Some(p) = self.pools.defaults.get(&dev) {
            return *p;
        }
        let p = self.handle();
        self.pools.pools.insert(p, EmuPool::new(dev, 0));
        self.pools.defaults.insert(dev, p);
        p
    }

    /// Gives back up to `bytes` of `pool`'s cache to its device.
    fn release(&mut self, pool: u64, bytes: u64) {
        let Ok(p) = self.pool(pool) else { return };
        let n = bytes.min(p.cached());
        p.reserved -= n;
        let dev = p.dev;
        if let Some(u) = self.used.get_mut(&dev) {
            *u = u.saturating_sub(n);
        }
    }

    /// An allocation of `size` bytes from `pool`, reusing its cache first.
    fn pool_alloc(&mut self, pool: u64, size: u64, limit: u64) -> CuResult<u64> {
        if size == 0 {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let p = self.pool(pool)?;
        if p.max_size != 0 && size > p.max_size.saturating_sub(p.used) {
            return Err(CuError(cu::OUT_OF_MEMORY));
        }
        let (dev, take) = (p.dev, size.min(p.cached()));
        // The cached bytes move into the allocation, which counts them again.
        *self.used.entry(dev).or_default() -= take;
        let ptr = match self.alloc(dev, size, limit, false) {
            Ok(ptr) => ptr,
            Err(e) => {
                *self.used.entry(dev).or_default() += take;
                return Err(e);
            }
        };
        let p = self.pool(pool)?;
        p.reserved += size - take;
        p.used += size;
        p.reserved_high = p.reserved_high.max(p.reserved);
        p.used_high = p.used_high.max(p.used);
        self.pools.allocations.insert(ptr, Some(pool));
        Ok(ptr)
    }

    /// Frees a stream-ordered allocation: its bytes go back to its pool's cache, then the
    /// pool keeps at most its release threshold.
    pub(super) fn pool_free(&mut self, ptr: u64) -> CuResult<()> {
        let pool = self
            .pools
            .allocations
            .remove(&ptr)
            .ok_or(CuError(cu::INVALID_VALUE))?;
        let size = self.allocs.get(&ptr).map_or(0, |a| a.data.len() as u64);
        let dev = self.allocs.get(&ptr).map(|a| a.dev);
        self.free(ptr)?;
        let Some(pool) = pool.filter(|p| self.pools.pools.contains_key(p)) else {
            return Ok(());
        };
        if let Some(dev) = dev {
            *self.used.entry(dev).or_default() += size;
        }
        let p = self.pool(pool)?;
        p.used -= size;
        let excess = p.reserved.saturating_sub(p.release_threshold.max(p.used));
        self.release(pool, excess);
        Ok(())
    }

    fn check_location(&self, devices: usize, l: MemLocation) -> CuResult<i32> {
        if l.kind != LOCATION_TYPE_DEVICE || l.id < 0 || l.id as usize >= devices {
            return Err(CuError(cu::INVALID_VALUE));
        }
        Ok(l.id)
    }
}

impl EmulatedBackend {
    /// Live pools the programs created (default pools excluded), for tests.
    pub fn live_pools(&self) -> usize {
        let st = self.lock();
        st.pools.pools.len() - st.pools.defaults.len()
    }

    fn pool_alloc_on(&self, ctx: u64, stream: u64, size: u64, pool: Option<u64>) -> CuResult<u64> {
        let mut st = self.lock();
        st.stream(ctx, stream)?;
        if st.capturing.contains_key(&(ctx, stream)) {
            // Captured: a graph memory allocation node (from the device's memory, not the
            // pool's: enough for the tests).
            let dev = st.ctx(ctx)?;
            let node = crate::backend::graphs::MemAllocNode {
                location: crate::backend::pools::MemLocation {
                    kind: crate::backend::pools::LOCATION_TYPE_DEVICE,
                    id: dev,
                },
                access: Vec::new(),
                bytesize: size,
            };
            let p = st.graph_alloc(dev, &node, self.config.memory_per_device)?;
            st.capture(ctx, stream, EmuOp::MemAlloc(p, node));
            return Ok(p);
        }
        let pool = match pool {
            Some(p) => p,
            None => {
                let dev = st.ctx(ctx)?;
                match st.pools.current.get(&dev) {
                    Some(p) => *p,
                    None => st.default_pool(dev),
                }
            }
        };
        st.pool_alloc(pool, size, self.config.memory_per_device)
    }
}

impl MemPools for EmulatedBackend {
    fn mem_alloc_async(
        &self,
        ctx: u64,
        stream: u64,
        size: u64,
        pool: Option<u64>,
    ) -> CuResult<u64> {
        self.pool_alloc_on(ctx, stream, size, pool)
    }

    fn mem_free_async(&self, ctx: u64, stream: u64, ptr: u64) -> CuResult<()> {
        let mut st = self.lock();
        st.stream(ctx, stream)?;
        if st.graphs.mem.owns(ptr) {
            // Captured: a free node; else an allocation a graph launch left allocated.
            if st.capture(ctx, stream, EmuOp::MemFree(ptr)) {
                return Ok(());
            }
            return st.graphs.mem.free_outside(ptr);
        }
        st.refuse_in_capture(ctx, stream)?;
        st.pool_free(ptr)
    }

    fn device_get_default_mem_pool(&self, dev: i32) -> CuResult<u64> {
        self.check_dev(dev)?;
        Ok(self.lock().default_pool(dev))
    }

    fn device_get_mem_pool(&self, dev: i32) -> CuResult<u64> {
        self.check_dev(dev)?;
        let mut st = self.lock();
        match st.pools.current.get(&dev) {
            Some(p) => Ok(*p),
            None => Ok(st.default_pool(dev)),
        }
    }

    fn device_set_mem_pool(&self, dev: i32, pool: u64) -> CuResult<()> {
        self.check_dev(dev)?;
        let mut st = self.lock();
        if st.pool(pool)?.dev != dev {
            return Err(CuError(cu::INVALID_DEVICE));
        }
        st.pools.current.insert(dev, pool);
        Ok(())
    }

    fn mem_pool_create(&self, props: &PoolProps) -> CuResult<u64> {
        if props.alloc_type != ALLOCATION_TYPE_PINNED {
            tracing::warn!(
                alloc_type = props.alloc_type,
                "emulated backend: only pinned device pools are emulated (CUDA_ERROR_NOT_SUPPORTED)"
            );
            return Err(CuError(cu::NOT_SUPPORTED));
        }
        let mut st = self.lock();
        let dev = st.check_location(self.config.devices, props.location)?;
        let p = st.handle();
        st.pools.pools.insert(p, EmuPool::new(dev, props.max_size));
        Ok(p)
    }

    fn mem_pool_destroy(&self, pool: u64) -> CuResult<()> {
        let mut st = self.lock();
        let dev = st.pool(pool)?.dev;
        if st.pools.defaults.get(&dev) == Some(&pool) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        // Its cache goes back; allocations still out live on until freed, as natively.
        st.release(pool, u64::MAX);
        st.pools.pools.remove(&pool);
        if st.pools.current.get(&dev) == Some(&pool) {
            st.pools.current.remove(&dev);
        }
        for owner in st.pools.allocations.values_mut() {
            if *owner == Some(pool) {
                *owner = None;
            }
        }
        Ok(())
    }

    fn mem_pool_set_attribute(&self, pool: u64, attribute: i32, value: u64) -> CuResult<()> {
        let mut st = self.lock();
        let p = st.pool(pool)?;
        match attribute {
            a if attr::is_int(a) => p.reuse[(a - 1) as usize] = value != 0,
            attr::RELEASE_THRESHOLD => p.release_threshold = value,
            attr::RESERVED_MEM_HIGH if value == 0 => p.reserved_high = p.reserved,
            attr::USED_MEM_HIGH if value == 0 => p.used_high = p.used,
            _ => return Err(CuError(cu::INVALID_VALUE)),
        }
        Ok(())
    }

    fn mem_pool_get_attribute(&self, pool: u64, attribute: i32) -> CuResult<u64> {
        let mut st = self.lock();
        let p = st.pool(pool)?;
        Ok(match attribute {
            a if attr::is_int(a) => u64::from(p.reuse[(a - 1) as usize]),
            attr::RELEASE_THRESHOLD => p.release_threshold,
            attr::RESERVED_MEM_CURRENT => p.reserved,
            attr::RESERVED_MEM_HIGH => p.reserved_high,
            attr::USED_MEM_CURRENT => p.used,
            attr::USED_MEM_HIGH => p.used_high,
            _ => return Err(CuError(cu::INVALID_VALUE)),
        })
    }

    fn mem_pool_trim_to(&self, pool: u64, keep: u64) -> CuResult<()> {
        let mut st = self.lock();
        let p = st.pool(pool)?;
        let excess = p.reserved.saturating_sub(keep.max(p.used));
        st.release(pool, excess);
        Ok(())
    }

    fn mem_pool_set_access(&self, pool: u64, map: &[MemAccessDesc]) -> CuResult<()> {
        let mut st = self.lock();
        let devices = self.config.devices;
        let mut checked = Vec::with_capacity(map.len());
        let own = st.pool(pool)?.dev;
        for a in map {
            let dev = st.check_location(devices, a.location)?;
            if !matches!(a.flags, 0 | 1 | PROT_READWRITE)
                || (dev == own && a.flags != PROT_READWRITE)
            {
                return Err(CuError(cu::INVALID_VALUE));
            }
            checked.push((dev, a.flags));
        }
        let p = st.pool(pool)?;
        for (dev, flags) in checked {
            if dev != own {
                p.access.insert(dev, flags);
            }
        }
        Ok(())
    }

    fn mem_pool_get_access(&self, pool: u64, location: MemLocation) -> CuResult<i32> {
        let mut st = self.lock();
        let dev = st.check_location(self.config.devices, location)?;
        let p = st.pool(pool)?;
        if dev == p.dev {
            return Ok(PROT_READWRITE);
        }
        Ok(p.access.get(&dev).copied().unwrap_or(0))
    }
}
