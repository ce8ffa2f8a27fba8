//! What the executor needs from a backend for stream-ordered allocation and memory pools
//! (`cuMemAllocAsync` and the `cuMemPool*` calls): the [`MemPools`] part of every
//! [`Backend`](super::Backend).
//!
//! Pools are raw `u64` values here (the driver's `CUmemoryPool`); the session maps them to
//! handles. Device ordinals are the ones clients see (after `--devices`): a backend maps them,
//! and the device ids inside [`MemLocation`]s of type [`LOCATION_TYPE_DEVICE`], to its own.

use remora_proto::cuda::CuResult;

pub use remora_cuda_abi::pools::{
    ALLOCATION_TYPE_PINNED, HANDLE_TYPE_NONE, LOCATION_TYPE_DEVICE, MemAccessDesc, MemLocation,
};

/// `CUmemPool_attribute` values.
pub mod attr {
    remora_proto::cuda_consts!(i32, "CU_MEMPOOL_ATTR_" {
        REUSE_FOLLOW_EVENT_DEPENDENCIES = 1 ("int"),
        REUSE_ALLOW_OPPORTUNISTIC = 2 ("int"),
        REUSE_ALLOW_INTERNAL_DEPENDENCIES = 3 ("int"),
        RELEASE_THRESHOLD = 4 ("cuuint64_t"),
        RESERVED_MEM_CURRENT = 5 ("cuuint64_t, read only"),
        RESERVED_MEM_HIGH = 6 ("cuuint64_t, may be reset to 0"),
        USED_MEM_CURRENT = 7 ("cuuint64_t, read only"),
        USED_MEM_HIGH = 8 ("cuuint64_t, may be reset to 0"),
    });

    /// Whether `a` is one of the `int` attributes (the reuse flags); the others are 64-bit.
    pub fn is_int(a: i32) -> bool {
        (REUSE_FOLLOW_EVENT_DEPENDENCIES..=REUSE_ALLOW_INTERNAL_DEPENDENCIES).contains(&a)
    }
}

/// What `cuMemPoolCreate` is asked for, checked by the executor: the handle types are
/// `CU_MEM_HANDLE_TYPE_NONE` (Remora carries no IPC of pools).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PoolProps {
    /// `CUmemAllocationType`.
    pub alloc_type: i32,
    /// Where the pool's memory lives (a device id is the client's ordinal).
    pub location: MemLocation,
    /// Largest size of the pool (0: the driver's default).
    pub max_size: u64,
    /// `CU_MEM_POOL_CREATE_USAGE_*` bits.
    pub usage: u16,
}

/// Stream-ordered allocation and memory pools. Every call that works on a stream takes the
/// stream's context, made current by the backend as for other stream calls.
pub trait MemPools {
    /// `cuMemAllocFromPoolAsync` from `pool`, or without one `cuMemAllocAsync`: from the
    /// current pool of the stream's device.
    fn mem_alloc_async(&self, ctx: u64, stream: u64, size: u64, pool: Option<u64>)
    -> CuResult<u64>;
    /// `cuMemFreeAsync` of an allocation the session made with one of the above.
    fn mem_free_async(&self, ctx: u64, stream: u64, ptr: u64) -> CuResult<()>;
    /// `cuDeviceGetDefaultMemPool`.
    fn device_get_default_mem_pool(&self, dev: i32) -> CuResult<u64>;
    /// `cuDeviceGetMemPool`: the device's current pool.
    fn device_get_mem_pool(&self, dev: i32) -> CuResult<u64>;
    /// `cuDeviceSetMemPool`.
    fn device_set_mem_pool(&self, dev: i32, pool: u64) -> CuResult<()>;
    /// `cuMemPoolCreate`.
    fn mem_pool_create(&self, props: &PoolProps) -> CuResult<u64>;
    /// `cuMemPoolDestroy`.
    fn mem_pool_destroy(&self, pool: u64) -> CuResult<()>;
    /// `cuMemPoolSetAttribute`: `value` is 0 or 1 for the `int` attributes ([`attr::is_int`]).
    fn mem_pool_set_attribute(&self, pool: u64, attribute: i32, value: u64) -> CuResult<()>;
    /// `cuMemPoolGetAttribute` (an `int` attribute widened).
    fn mem_pool_get_attribute(&self, pool: u64, attribute: i32) -> CuResult<u64>;
    /// `cuMemPoolTrimTo`.
    fn mem_pool_trim_to(&self, pool: u64, keep: u64) -> CuResult<()>;
    /// `cuMemPoolSetAccess`.
    fn mem_pool_set_access(&self, pool: u64, map: &[MemAccessDesc]) -> CuResult<()>;
    /// `cuMemPoolGetAccess`: the `CUmemAccess_flags` of `location`.
    fn mem_pool_get_access(&self, pool: u64, location: MemLocation) -> CuResult<i32>;
}
