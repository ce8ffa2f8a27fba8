//! Launch checks done on the client and the occupancy search of
//! `cuOccupancyMaxPotentialBlockSize` with a dynamic-shared-memory callback.
//!
//! Launches are one-way, so a configuration error the server found would only surface at the
//! next synchronizing call. CUDA reports these errors from the launch itself, so the client
//! checks the configuration against the cached device and function limits first.

use crate::error::{CuError, CuResult, cu};

/// Default dynamic shared memory a function may use without
/// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`.
pub const DEFAULT_MAX_DYNAMIC_SMEM: u32 = 48 * 1024;

/// `CU_DEVICE_ATTRIBUTE_*` used here.
pub mod dev_attr {
    remora_proto::cuda_consts!(i32, "CU_DEVICE_ATTRIBUTE_" {
        MAX_THREADS_PER_BLOCK = 1,
        MAX_BLOCK_DIM_X = 2 ("Y, Z follow"),
        MAX_GRID_DIM_X = 5 ("Y, Z follow"),
        WARP_SIZE = 10,
        MULTIPROCESSOR_COUNT = 16,
        MAX_THREADS_PER_MULTIPROCESSOR = 39,
    });
}

/// `CU_FUNC_ATTRIBUTE_*` used here.
pub mod func_attr {
    remora_proto::cuda_consts!(i32, "CU_FUNC_ATTRIBUTE_" {
        MAX_THREADS_PER_BLOCK = 0,
        MAX_DYNAMIC_SHARED_SIZE_BYTES = 8,
    });
}

/// What a launch may ask for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LaunchLimits {
    /// Device maximum block dimensions.
    pub max_block: [u32; 3],
    /// Threads per block: the function's limit (else the device's).
    pub max_threads: u32,
    /// Device maximum grid dimensions.
    pub max_grid: [u32; 3],
    /// Dynamic shared memory the function may use.
    pub max_dynamic_smem: u32,
}

/// Checks a launch configuration as CUDA does before it queues the launch:
/// CUDA_ERROR_INVALID_VALUE for a zero or oversized dimension, too many threads per block,
/// or more dynamic shared memory than the function allows.
pub fn validate(l: &LaunchLimits, grid: [u32; 3], block: [u32; 3], shared: u32) -> CuResult<()> {
    let bad = || Err(CuError(cu::INVALID_VALUE));
    if grid.contains(&0) || block.contains(&0) {
        return bad();
    }
    if (0..3).any(|i| block[i] > l.max_block[i] || grid[i] > l.max_grid[i]) {
        return bad();
    }
    let threads = u64::from(block[0]) * u64::from(block[1]) * u64::from(block[2]);
    if threads > u64::from(l.max_threads) {
        return bad();
    }
    if shared > l.max_dynamic_smem {
        return bad();
    }
    Ok(())
}

/// What the block-size search needs to know about the device and function.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OccupancyLimits {
    /// Device maximum threads per block.
    pub device_max_threads: i32,
    /// The function's maximum threads per block.
    pub function_max_threads: i32,
    /// Warp size (the block-size granularity).
    pub warp_size: i32,
    /// Threads one multiprocessor can hold.
    pub max_threads_per_sm: i32,
    /// Multiprocessors.
    pub sm_count: i32,
}

/// `cuOccupancyMaxPotentialBlockSize` computed on the client, as CUDA's
/// `cuda_occupancy.h` does: every multiple of the warp size up to the limit (the smaller of
/// the device's and the function's threads per block, and `block_size_limit` if non-zero) is
/// tried from the largest down, `smem(block)` gives its dynamic shared memory and
/// `active(block, smem)` its resident blocks per multiprocessor; the block size with the most
/// resident threads wins (the largest on ties). Returns (minimum grid size, block size).
pub fn potential_block_size(
    l: &OccupancyLimits,
    block_size_limit: i32,
    mut smem: impl FnMut(i32) -> u64,
    mut active: impl FnMut(i32, u64) -> CuResult<i32>,
) -> CuResult<(i32, i32)> {
    if l.warp_size <= 0 {
        return Err(CuError(cu::INVALID_VALUE));
    }
    let mut max_block = l.device_max_threads.min(l.function_max_threads);
    if block_size_limit > 0 && block_size_limit < max_block {
        max_block = block_size_limit;
    }
    let gran = l.warp_size;
    let mut aligned = (max_block + gran - 1) / gran * gran;
    let (mut best_threads, mut best_block, mut best_blocks) = (0i64, 0, 0);
    while aligned > 0 {
        let block = max_block.min(aligned);
        let blocks = active(block, smem(block))?;
        let threads = i64::from(block) * i64::from(blocks);
        if threads > best_threads {
            (best_threads, best_block, best_blocks) = (threads, block, blocks);
        }
        if threads >= i64::from(l.max_threads_per_sm) {
            break;
        }
        aligned -= gran;
    }
    Ok((best_blocks.saturating_mul(l.sm_count), best_block))
}

/// `cuOccupancyAvailableDynamicSMemPerBlock` by search: the most dynamic shared memory (at
/// most `cap`) with which `num_blocks` blocks still fit on a multiprocessor, given
/// `active(smem)` resident blocks. 0 if they do not fit even without dynamic shared memory.
pub fn available_dynamic_smem(
    num_blocks: i32,
    cap: u64,
    mut active: impl FnMut(u64) -> CuResult<i32>,
) -> CuResult<u64> {
    if active(0)? < num_blocks {
        return Ok(0);
    }
    if active(cap)? >= num_blocks {
        return Ok(cap);
    }
    let (mut lo, mut hi) = (0u64, cap); // active(lo) fits, active(hi) does not
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if active(mid)? >= num_blocks {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    Ok(lo)
}

#[cfg(test)]
mod tests {
    use super::*;

    const H100: LaunchLimits = LaunchLimits {
        max_block: [1024, 1024, 64],
        max_threads: 1024,
        max_grid: [i32::MAX as u32, 65535, 65535],
        max_dynamic_smem: DEFAULT_MAX_DYNAMIC_SMEM,
    };

    #[test]
    fn launch_configurations_are_checked_locally() {
        let bad = Err(CuError(cu::INVALID_VALUE));
        assert_eq!(validate(&H100, [1, 1, 1], [1024, 1, 1], 0), Ok(()));
        assert_eq!(validate(&H100, [1, 1, 1], [2048, 1, 1], 0), bad);
        assert_eq!(validate(&H100, [1, 1, 1], [32, 32, 2], 0), bad);
        assert_eq!(validate(&H100, [1, 1, 1], [1, 1, 65], 0), bad);
        assert_eq!(validate(&H100, [0, 1, 1], [32, 1, 1], 0), bad);
        assert_eq!(validate(&H100, [1, 1, 1], [32, 0, 1], 0), bad);
        assert_eq!(validate(&H100, [1, 65536, 1], [32, 1, 1], 0), bad);
        assert_eq!(validate(&H100, [1, 1, 1], [32, 1, 1], 1 << 20), bad);
        assert_eq!(validate(&H100, [1, 1, 1], [32, 1, 1], 48 * 1024), Ok(()));
        assert_eq!(validate(&H100, [1, 1, 1], [32, 1, 1], 48 * 1024 + 1), bad);
        let raised = LaunchLimits {
            max_dynamic_smem: 100 * 1024,
            max_threads: 256,
            ..H100
        };
        assert_eq!(
            validate(&raised, [1, 1, 1], [256, 1, 1], 100 * 1024),
            Ok(())
        );
        assert_eq!(validate(&raised, [1, 1, 1], [512, 1, 1], 0), bad);
    }

    const OCC: OccupancyLimits = OccupancyLimits {
        device_max_threads: 1024,
        function_max_threads: 1024,
        warp_size: 32,
        max_threads_per_sm: 2048,
        sm_count: 132,
    };

    /// A toy multiprocessor: 2048 threads, 32 blocks, 228 KiB of shared memory.
    fn toy(block: i32, smem: u64) -> CuResult<i32> {
        let by_threads = 2048 / block;
        let by_smem = (228 * 1024u64).checked_div(smem).map_or(32, |v| v as i32);
        Ok(by_threads.min(32).min(by_smem))
    }

    #[test]
    fn potential_block_size_tries_warp_multiples() {
        let mut tried = Vec::new();
        let r = potential_block_size(
            &OCC,
            0,
            |b| {
                tried.push(b);
                0
            },
            toy,
        );
        // 1024 threads x 2 blocks fill the SM at once.
        assert_eq!(r, Ok((2 * 132, 1024)));
        assert_eq!(tried, vec![1024]);

        // 1 KiB of shared memory per thread: smaller blocks fit more threads.
        let r = potential_block_size(&OCC, 0, |b| b as u64 * 1024, toy).unwrap();
        assert_eq!(r.1 * toy(r.1, r.1 as u64 * 1024).unwrap(), 224);

        // A limit that is not a warp multiple is tried as is.
        let mut tried = Vec::new();
        let r = potential_block_size(
            &OCC,
            100,
            |b| {
                tried.push(b);
                0
            },
            |_, _| Ok(1),
        );
        assert_eq!(r, Ok((132, 100)));
        assert_eq!(tried, vec![100, 96, 64, 32]);

        // The function's own limit wins over the device's.
        let f = OccupancyLimits {
            function_max_threads: 256,
            ..OCC
        };
        assert_eq!(potential_block_size(&f, 0, |_| 0, toy), Ok((8 * 132, 256)));
        assert_eq!(
            potential_block_size(&OCC, 0, |_| 0, |_, _| Err(CuError(7))),
            Err(CuError(7))
        );
    }

    #[test]
    fn available_dynamic_smem_searches_the_largest_fit() {
        let sm =
            |s: u64| -> CuResult<i32> { Ok((233_472 / (s.div_ceil(128) * 128 + 1024)) as i32) };
        assert_eq!(available_dynamic_smem(2, 49_152, sm), Ok(49_152));
        let got = available_dynamic_smem(4, 200_000, sm).unwrap();
        assert!(sm(got).unwrap() >= 4 && sm(got + 1).unwrap() < 4);
        assert_eq!(available_dynamic_smem(1000, 1024, sm), Ok(0));
    }
}
