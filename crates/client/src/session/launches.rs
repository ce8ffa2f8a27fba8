//! [`Session`] methods for kernel launches and occupancy.

use super::*;
use crate::launch::{self, LaunchLimits, OccupancyLimits, dev_attr, func_attr};

/// A kernel launch's configuration ([`Session::launch_kernel`]).
#[derive(Debug, Clone)]
pub struct LaunchConfig {
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem_bytes: u32,
    pub stream: StreamRef,
    /// Launch attributes (`cuLaunchKernelEx`, cooperative launches).
    pub attrs: Vec<RmLaunchAttr>,
}

/// Where a launch's parameters come from, as `cuLaunchKernel` takes them.
#[derive(Debug, Clone, Copy)]
pub enum KernelArgs {
    /// `kernelParams`: one pointer per parameter.
    Params(*const *const std::ffi::c_void),
    /// `extra`: `CU_LAUNCH_PARAM_*` pairs, `CU_LAUNCH_PARAM_END`-terminated.
    Extra(*const *const std::ffi::c_void),
    /// Neither (a kernel without parameters).
    None,
}

impl Session {
    /// `cuOccupancyMaxActiveBlocksPerMultiprocessor(WithFlags)`.
    pub fn occupancy_max_active_blocks(
        &self,
        function: RmHandle,
        block_size: i32,
        dynamic_smem_bytes: u64,
        flags: u32,
    ) -> CuResult<i32> {
        // The function's maximum dynamic shared memory is part of the question: libraries
        // alternate it (one-way sets), and each value keeps its answers.
        let max_dynamic = lock(&self.func_attrs)
            .get(&(
                function,
                crate::launch::func_attr::MAX_DYNAMIC_SHARED_SIZE_BYTES,
            ))
            .copied();
        let key = (function, block_size, dynamic_smem_bytes, flags, max_dynamic);
        if let Some(v) = lock(&self.occupancy).get(&key) {
            return Ok(*v);
        }
        let v = Reply::value(call!(self.rm_occupancy_max_active_blocks(
            &RmOccupancyArgs {
                function,
                block_size,
                dynamic_smem_bytes,
                flags
            }
        ))?)?;
        lock(&self.occupancy).insert(key, v);
        Ok(v)
    }

    /// `cuOccupancyMaxActiveClusters`: `args` is the launch configuration (params unused).
    pub fn occupancy_max_active_clusters(&self, args: &RmLaunchArgs) -> CuResult<i32> {
        Reply::value(call!(self.rm_occupancy_max_active_clusters(args))?)
    }

    /// `cuOccupancyMaxPotentialBlockSize(WithFlags)` without a callback, on the server:
    /// (minimum grid size, block size).
    pub fn occupancy_max_potential_block_size(
        &self,
        function: RmHandle,
        dynamic_smem_bytes: u64,
        block_size_limit: i32,
        flags: u32,
    ) -> CuResult<(i32, i32)> {
        pair(call!(self.rm_occupancy_max_potential_block_size(
            &RmPotentialBlockArgs {
                function,
                dynamic_smem_bytes,
                block_size_limit,
                flags
            }
        ))?)
    }

    /// `cuOccupancyMaxPotentialBlockSize(WithFlags)` with a dynamic-shared-memory callback:
    /// searched on the client (see [`launch::potential_block_size`]), one
    /// `RM_OCCUPANCY_MAX_ACTIVE_BLOCKS` per block size tried.
    pub fn occupancy_potential_block_size_with(
        &self,
        dev: DeviceHandle,
        function: RmHandle,
        smem: impl FnMut(i32) -> u64,
        block_size_limit: i32,
        flags: u32,
    ) -> CuResult<(i32, i32)> {
        let limits = OccupancyLimits {
            device_max_threads: self.device_attribute(dev, dev_attr::MAX_THREADS_PER_BLOCK)?,
            function_max_threads: self
                .func_get_attribute(function, func_attr::MAX_THREADS_PER_BLOCK)?,
            warp_size: self.device_attribute(dev, dev_attr::WARP_SIZE)?,
            max_threads_per_sm: self
                .device_attribute(dev, dev_attr::MAX_THREADS_PER_MULTIPROCESSOR)?,
            sm_count: self.device_attribute(dev, dev_attr::MULTIPROCESSOR_COUNT)?,
        };
        launch::potential_block_size(&limits, block_size_limit, smem, |b, m| {
            self.occupancy_max_active_blocks(function, b, m, flags)
        })
    }

    /// `cuOccupancyAvailableDynamicSMemPerBlock`, searched with
    /// `RM_OCCUPANCY_MAX_ACTIVE_BLOCKS` up to the function's dynamic shared memory limit.
    pub fn occupancy_available_dynamic_smem(
        &self,
        function: RmHandle,
        num_blocks: i32,
        block_size: i32,
    ) -> CuResult<u64> {
        if num_blocks <= 0 || block_size <= 0 {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let cap = self.func_get_attribute(function, func_attr::MAX_DYNAMIC_SHARED_SIZE_BYTES)?;
        launch::available_dynamic_smem(num_blocks, cap.max(0) as u64, |m| {
            self.occupancy_max_active_blocks(function, block_size, m, 0)
        })
    }

    /// The limits a launch of `function` on device `dev` is checked against. A function limit
    /// the server cannot answer falls back to the device's (threads) or 48 KiB (dynamic
    /// shared memory).
    pub fn launch_limits(&self, dev: DeviceHandle, function: RmHandle) -> CuResult<LaunchLimits> {
        let a = |i: i32| -> CuResult<u32> { Ok(self.device_attribute(dev, i)?.max(0) as u32) };
        let max_block = [
            a(dev_attr::MAX_BLOCK_DIM_X)?,
            a(dev_attr::MAX_BLOCK_DIM_X + 1)?,
            a(dev_attr::MAX_BLOCK_DIM_X + 2)?,
        ];
        let max_grid = [
            a(dev_attr::MAX_GRID_DIM_X)?,
            a(dev_attr::MAX_GRID_DIM_X + 1)?,
            a(dev_attr::MAX_GRID_DIM_X + 2)?,
        ];
        let dev_threads = a(dev_attr::MAX_THREADS_PER_BLOCK)?;
        let max_threads = self
            .func_get_attribute(function, func_attr::MAX_THREADS_PER_BLOCK)
            .map_or(dev_threads, |v| v.max(0) as u32);
        let max_dynamic_smem = self
            .func_get_attribute(function, func_attr::MAX_DYNAMIC_SHARED_SIZE_BYTES)
            .map_or(launch::DEFAULT_MAX_DYNAMIC_SMEM, |v| v.max(0) as u32);
        Ok(LaunchLimits {
            max_block,
            max_threads,
            max_grid,
            max_dynamic_smem,
        })
    }

    /// [`Session::launch_limits`], remembered per (function, device) until an attribute of
    /// the function is set: a launch checks its configuration with one lookup.
    fn cached_launch_limits(
        &self,
        dev: DeviceHandle,
        function: RmHandle,
    ) -> CuResult<LaunchLimits> {
        if let Some(l) = lock(&self.launch_limits).get(&(function, dev)) {
            return Ok(*l);
        }
        let l = self.launch_limits(dev, function)?;
        lock(&self.launch_limits).insert((function, dev), l);
        Ok(l)
    }

    /// `cuLaunchKernel(Ex)` in context `ctx`: checks the configuration against the function's
    /// limits (configuration errors are synchronous, as in CUDA), packs the parameters at the
    /// offsets the server reported for the function, and sends the launch one-way.
    ///
    /// # Safety
    /// `args` holds what `cuLaunchKernel` takes: `kernelParams` with one valid pointer per
    /// parameter of `function`, or an `extra` array terminated by `CU_LAUNCH_PARAM_END`.
    pub unsafe fn launch_kernel(
        &self,
        ctx: RmHandle,
        function: &FunctionInfo,
        config: &LaunchConfig,
        args: KernelArgs,
    ) -> CuResult<()> {
        let limits = self.cached_launch_limits(self.ctx_device(ctx)?, function.handle)?;
        launch::validate(&limits, config.grid, config.block, config.shared_mem_bytes)?;
        let params = match args {
            KernelArgs::Params(p) => {
                // SAFETY: the caller's contract: one valid pointer per parameter.
                unsafe { crate::params::pack_kernel_params(&function.params, p) }?
            }
            // SAFETY: the caller's contract.
            KernelArgs::Extra(e) => unsafe { crate::params::pack_extra(e) }?,
            KernelArgs::None if function.params.is_empty() => Vec::new(),
            KernelArgs::None => return Err(CuError(cu::INVALID_VALUE)),
        };
        self.map_pointed_host_memory(ctx, &params, &function.params);
        let dim = |d: [u32; 3]| RmDim3 {
            x: d[0],
            y: d[1],
            z: d[2],
        };
        self.launch(&RmLaunchArgs {
            ctx,
            function: function.handle,
            grid: dim(config.grid),
            block: dim(config.block),
            shared_mem_bytes: config.shared_mem_bytes,
            stream: self.stream_handle(ctx, config.stream)?,
            params: params.into(),
            attrs: config.attrs.clone(),
        })
    }

    /// `cuLaunchKernel`: one-way; `args` already checked and packed (see
    /// [`Session::launch_kernel`], which does both).
    pub fn launch(&self, args: &RmLaunchArgs) -> CuResult<()> {
        call!(self.rm_launch_kernel(args))
    }
}
