//! **Test backend**: emulates CUDA devices in host memory so that the executor, sessions and
//! protocol can be tested on machines without a GPU (CI). It is chosen only by
//! `remora serve --backend emulated` or by tests, never as a fallback, and never stands in for
//! the real GPU path.
//!
//! What it does: device memory is host memory at addresses from `0x2000_0000_0000` up (a range
//! a client can reserve); copies and memsets have their CUDA semantics; work completes when it
//! is issued, so streams are trivially ordered; events record host-clock timestamps; modules
//! accept any image and list functions only for the tiny test format below; kernel launches
//! run CPU implementations of the project's own test kernels, found by name
//! (`emulated_kernels`: vecadd, fill_i32, iota_u64, saxpy, daxpy, small_types, by_struct,
//! many_params, grid3d), each checking its parameter layout; any other kernel fails with
//! `CUDA_ERROR_NOT_SUPPORTED` and a log line naming the emulated backend. Stream capture
//! records the captured host-to-device and device-to-device copies, memsets, kernel launches,
//! event records and waits into a graph (a stream joins a capture by waiting for an event
//! recorded in it); launching an executable graph replays them in order. Synchronizing a capturing stream
//! invalidates its capture (`CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED`), as with the driver;
//! 2-D, 3-D, peer and device-to-host copies are not captured (the same error). Host functions (`cuLaunchHostFunc`) run on a thread
//! per context, in the order they were enqueued, as the driver's host-function thread runs
//! them; the stream they were enqueued on counts as busy until each returns (its synchronize
//! waits, its query answers cu::NOT_READY), which is what a real stream does for the work after
//! one. Other emulated work still completes at once.
//!
//! Test module format (UTF-8 text): a first line `REMORA-EMU-MODULE`, then lines
//! `func NAME SIZE,SIZE,...` (parameters, each aligned to its size up to 8) and
//! `global NAME BYTES`.
//!
//! This file holds the configuration, the shared state and the [`Backend`] implementation;
//! the concerns behind it have modules of their own: `capture` (captured operations and their
//! replay), `copies` (2-D/3-D rows, staged device-to-host copies), `graphs`, `host_functions`,
//! `memory` (allocations and address ranges), `module_format`, `pools` and `vmm`.

use remora_proto::cuda::{CuError, CuResult, cu};
use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use remora_proto::remora::{RmLaunchAttr, RmStreamAttr};

use super::emulated_kernels;

mod capture;
mod copies;
mod graphs;
mod host_functions;
mod memory;
mod module_format;
mod pools;
mod vmm;

use super::{
    Backend, CaptureInfo, Copy3d, Copy3dIo, CopyPlace, DeviceProps, DtodCopy, FunctionInfo, HostFn,
    LEGACY_STREAM, LaunchSpec, LoadedModule, Memset, Occupancy, StagedCopy, StagedResult,
};
use capture::{EmuCapture, EmuOp};
use host_functions::{HostPending, HostQueue};
use memory::{Alloc, fill};
use module_format::parse_module;
use vmm::{EmuMapping, EmuPhys};

/// First line of the emulated test module format.
pub const EMU_MODULE_MAGIC: &str = "REMORA-EMU-MODULE";

/// The key under which a context's cache configuration is kept among its limits.
const CACHE_CONFIG_KEY: i32 = -1;

/// Where emulated device memory starts.
pub const EMU_MEMORY_BASE: u64 = 0x2000_0000_0000;

/// Shared memory per multiprocessor of the emulated device, for occupancy answers.
const EMU_SHARED_PER_SM: u64 = 228 << 10;
/// Largest maximum dynamic shared memory a function may be given (`cuFuncSetAttribute`).
const EMU_MAX_DYNAMIC_SHARED: i32 = 227 << 10;

/// How the emulated devices look.
#[derive(Debug, Clone)]
pub struct EmulatedConfig {
    /// Number of devices.
    pub devices: usize,
    /// Memory per device, bytes.
    pub memory_per_device: u64,
    /// How long every synchronize call blocks (to test that blocking calls do not stall
    /// the connection). When non-zero, stream queries answer cu::NOT_READY, as for work that is
    /// still running, so that the server's polling hands the wait to a waiter thread.
    pub sync_delay: Duration,
    /// TEST ONLY: written to this process's fd 1 by every context and stream synchronize, as
    /// NVIDIA's driver writes a kernel's printf output there (see
    /// `remora_server::EMULATED_DEVICE_PRINTF_ENV`). Set only in a session worker.
    pub device_printf: Option<Vec<u8>>,
    /// TEST ONLY: an asynchronous device-to-host copy completes this long after it is
    /// issued (its query answers false and its wait blocks until then), even when the
    /// stream or event a client synchronizes says done at once. Tests set it so that a client
    /// that relies on a reply happening to carry a copy, instead of CUDA's ordering rules,
    /// reads stale bytes and fails.
    pub copy_latency: Duration,
    /// TEST ONLY: the queries and waits of asynchronous device-to-host copies block while
    /// any host function is pending, as NVIDIA's driver may hold its locks while a
    /// device-synchronizing call (`cuMemFreeHost`, `cuMemFree`) waits for a host function.
    /// Tests set it so that a server that calls the driver on a host callback's way deadlocks.
    pub driver_busy_during_host_functions: bool,
    /// TEST ONLY: every kernel launch call takes this long before it runs (a slow driver
    /// call), so that launches queue on the session's launch thread and a call that overtook
    /// them would see the device's memory before them.
    pub launch_delay: Duration,
    /// Asynchronous device-to-host copies into a session's data area land there themselves
    /// when they complete, as the CUDA backend's DMA does where the area is page-locked
    /// (`Backend::memcpy_dtoh_async_in_area`); off, they are staged and written into the
    /// area when delivered, the CUDA backend's way elsewhere. Default on.
    pub area_dma: bool,
}

impl Default for EmulatedConfig {
    fn default() -> Self {
        Self {
            devices: 1,
            memory_per_device: 1 << 30,
            sync_delay: Duration::ZERO,
            device_printf: None,
            copy_latency: Duration::ZERO,
            driver_busy_during_host_functions: false,
            launch_delay: Duration::ZERO,
            area_dma: true,
        }
    }
}

/// Live objects, for tests that check that sessions free everything.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct LiveCounts {
    /// Device allocations (module globals excluded).
    pub allocations: usize,
    /// Contexts made by `ctx_create`.
    pub contexts: usize,
    /// Loaded modules.
    pub modules: usize,
    /// Streams.
    pub streams: usize,
    /// Events.
    pub events: usize,
    /// Graphs (captured or being captured).
    pub graphs: usize,
    /// Executable graphs.
    pub graph_execs: usize,
    /// Physical allocations of `cuMemCreate` not yet gone (released and unmapped).
    pub vmm_allocations: usize,
    /// Address ranges reserved by `cuMemAddressReserve`.
    pub vmm_reservations: usize,
    /// Mappings made by `cuMemMap`.
    pub vmm_mappings: usize,
}

struct EmuModule {
    globals: HashMap<String, (u64, u64)>,
}

#[derive(Default)]
struct State {
    next_handle: u64,
    next_addr: u64,
    allocs: BTreeMap<u64, Alloc>,
    used: HashMap<i32, u64>,
    /// Context handle → device.
    contexts: HashMap<u64, i32>,
    created: usize,
    modules: HashMap<u64, EmuModule>,
    /// Function → (name, parameter layout).
    functions: HashMap<u64, (String, Vec<(u32, u32)>)>,
    /// Functions listed by a module load and not loaded yet: as with the driver's lazy
    /// loading, launches, attribute and occupancy queries and graph nodes answer
    /// `CUDA_ERROR_FUNCTION_NOT_LOADED` until `cuFuncLoad`.
    unloaded: HashSet<u64>,
    /// (function, attribute) → value set with `cuFuncSetAttribute` (the settable attributes
    /// 8, maximum dynamic shared memory, and 9, shared memory carveout).
    func_attrs: HashMap<(u64, i32), i32>,
    streams: HashMap<u64, u64>,
    events: HashMap<u64, Option<Instant>>,
    limits: HashMap<(u64, i32), u64>,
    /// (context, stream) → id of the capture it takes part in.
    capturing: HashMap<(u64, u64), u64>,
    /// Capture id → capture.
    captures: HashMap<u64, EmuCapture>,
    /// Event → the capture it was last recorded in.
    event_capture: HashMap<u64, u64>,
    /// Graphs, executable graphs and their nodes (`emulated/graphs.rs`).
    graphs: graphs::EmuGraphs,
    /// Stream attributes set: (stream, attribute id) → value.
    stream_attrs: HashMap<(u64, i32), RmStreamAttr>,
    /// Physical allocations of `cuMemCreate`, by handle.
    phys: HashMap<u64, EmuPhys>,
    /// Reserved address ranges: base → size.
    reserved: BTreeMap<u64, u64>,
    /// Mappings: base → mapping.
    mapped: BTreeMap<u64, EmuMapping>,
    /// Memory pools and their stream-ordered allocations (`emulated/pools.rs`).
    pools: pools::Pools,
}

/// The emulated **test** backend (see the module documentation).
pub struct EmulatedBackend {
    config: EmulatedConfig,
    state: Arc<Mutex<State>>,
    /// Per context: the queue of its host-function thread.
    host_threads: Mutex<HashMap<u64, HostQueue>>,
    host_pending: Arc<HostPending>,
}

impl std::fmt::Debug for EmulatedBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmulatedBackend")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

fn align_up(v: u64, a: u64) -> u64 {
    v.div_ceil(a) * a
}

impl EmulatedBackend {
    /// A test backend with `config`.
    pub fn new(config: EmulatedConfig) -> Self {
        tracing::warn!(
            devices = config.devices,
            "using the EMULATED test backend: no GPU is used; only the project's test kernels run, on the CPU"
        );
        Self {
            config,
            state: Arc::new(Mutex::new(State {
                next_handle: 0x1000,
                next_addr: EMU_MEMORY_BASE,
                ..State::default()
            })),
            host_threads: Mutex::default(),
            host_pending: Arc::default(),
        }
    }

    /// The test hook: writes [`EmulatedConfig::device_printf`] to fd 1 as the driver writes
    /// device printf output, during the synchronizing call.
    fn device_printf(&self) {
        if let Some(text) = &self.config.device_printf {
            crate::device_output::write_stdout(text);
        }
    }

    /// What is alive now.
    pub fn live(&self) -> LiveCounts {
        let st = self.lock();
        LiveCounts {
            allocations: st.allocs.values().filter(|a| !a.global).count(),
            contexts: st.created,
            modules: st.modules.len(),
            streams: st.streams.len(),
            events: st.events.len(),
            graphs: st.graphs.graphs.len(),
            graph_execs: st.graphs.execs.len(),
            vmm_allocations: st.phys.len(),
            vmm_reservations: st.reserved.len(),
            vmm_mappings: st.mapped.len(),
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    fn check_dev(&self, dev: i32) -> CuResult<()> {
        if dev < 0 || dev as usize >= self.config.devices {
            return Err(CuError(cu::INVALID_DEVICE));
        }
        Ok(())
    }

    fn pause(&self) {
        if !self.config.sync_delay.is_zero() {
            std::thread::sleep(self.config.sync_delay);
        }
    }
}

impl State {
    /// Function `f`'s name and parameter layout, when it is loaded.
    fn function(&self, f: u64) -> CuResult<&(String, Vec<(u32, u32)>)> {
        let found = self.functions.get(&f).ok_or(CuError(cu::INVALID_HANDLE))?;
        if self.unloaded.contains(&f) {
            return Err(CuError(cu::FUNCTION_NOT_LOADED));
        }
        Ok(found)
    }

    fn handle(&mut self) -> u64 {
        self.next_handle += 0x10;
        self.next_handle
    }

    /// A new object of context `ctx`: its handle, which `insert` records.
    fn create_in(&mut self, ctx: u64, insert: impl FnOnce(&mut Self, u64)) -> CuResult<u64> {
        self.ctx(ctx)?;
        let h = self.handle();
        insert(self, h);
        Ok(h)
    }

    fn ctx(&self, ctx: u64) -> CuResult<i32> {
        self.contexts
            .get(&ctx)
            .copied()
            .ok_or(CuError(cu::INVALID_HANDLE))
    }

    fn stream(&self, ctx: u64, stream: u64) -> CuResult<()> {
        self.ctx(ctx)?;
        if stream == LEGACY_STREAM || stream == 0 || self.streams.get(&stream) == Some(&ctx) {
            Ok(())
        } else {
            Err(CuError(cu::INVALID_HANDLE))
        }
    }
}

/// Forgets object `h` of `map`, answering it (`INVALID_HANDLE` when there is none).
fn forget<V>(map: &mut HashMap<u64, V>, h: u64) -> CuResult<V> {
    map.remove(&h).ok_or(CuError(cu::INVALID_HANDLE))
}

impl Backend for EmulatedBackend {
    fn kind(&self) -> &'static str {
        "emulated"
    }

    fn driver_version(&self) -> CuResult<i32> {
        Ok(13000)
    }

    fn device_count(&self) -> CuResult<i32> {
        Ok(self.config.devices as i32)
    }

    fn device_props(&self, dev: i32) -> CuResult<DeviceProps> {
        self.check_dev(dev)?;
        let mut uuid = *b"remora-emulated-";
        uuid[15] = dev as u8;
        let attributes = [1, 2, 3, 4, 5, 6, 7, 8, 10, 16, 41, 75, 76, 83, 89]
            .into_iter()
            .map(|a| Ok((a, self.device_attribute(a, dev)?)))
            .collect::<CuResult<Vec<_>>>()?;
        Ok(DeviceProps {
            name: "Remora emulated device".into(),
            uuid,
            total_memory: self.config.memory_per_device,
            pci_bus_id: format!("0000:{:02x}:00.0", dev),
            attributes,
        })
    }

    fn device_attribute(&self, attr: i32, dev: i32) -> CuResult<i32> {
        self.check_dev(dev)?;
        Ok(match attr {
            1..=3 => 1024,  // max threads per block, block dim x / y
            4 => 64,        // block dim z
            5..=7 => 65535, // grid dims
            8 => 48 * 1024, // shared memory per block
            10 => 32,       // warp size
            16 => 1,        // multiprocessors
            41 => 1,        // unified addressing
            75 => 9,        // compute capability major
            76 => 0,        // compute capability minor
            // Managed memory and concurrent managed access, as an H100 answers (the client
            // answers 0 for both: Remora does not support managed memory).
            83 | 89 => 1,
            // Shared memory per block opt-in: what the maximum dynamic shared memory
            // attribute of a function may reach, as on an H100.
            97 => EMU_MAX_DYNAMIC_SHARED,
            a if (1..=200).contains(&a) => 0,
            _ => return Err(CuError(cu::INVALID_VALUE)),
        })
    }

    fn ctx_create(&self, _flags: u32, dev: i32) -> CuResult<u64> {
        self.check_dev(dev)?;
        let mut st = self.lock();
        let h = st.handle();
        st.contexts.insert(h, dev);
        st.created += 1;
        Ok(h)
    }

    fn ctx_destroy(&self, ctx: u64) -> CuResult<()> {
        let mut st = self.lock();
        st.contexts
            .remove(&ctx)
            .ok_or(CuError(cu::INVALID_HANDLE))?;
        st.created -= 1;
        drop(st);
        // Its host-function thread ends once the functions already queued have run.
        self.host_threads
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .remove(&ctx);
        Ok(())
    }

    fn ctx_stream_priority_range(&self, ctx: u64) -> CuResult<(i32, i32)> {
        self.lock().ctx(ctx)?;
        // What an H100 answers: least 0, greatest -5.
        Ok((0, -5))
    }

    fn ctx_synchronize(&self, ctx: u64) -> CuResult<()> {
        self.lock().ctx(ctx)?;
        self.host_pending.wait_idle(ctx, None);
        self.pause();
        self.device_printf();
        Ok(())
    }

    fn ctx_set_limit(&self, ctx: u64, limit: i32, value: u64) -> CuResult<()> {
        let mut st = self.lock();
        st.ctx(ctx)?;
        if !(0..=6).contains(&limit) {
            return Err(CuError(cu::UNSUPPORTED_LIMIT));
        }
        st.limits.insert((ctx, limit), value);
        Ok(())
    }

    fn ctx_get_limit(&self, ctx: u64, limit: i32) -> CuResult<u64> {
        let st = self.lock();
        st.ctx(ctx)?;
        if !(0..=6).contains(&limit) {
            return Err(CuError(cu::UNSUPPORTED_LIMIT));
        }
        Ok(st.limits.get(&(ctx, limit)).copied().unwrap_or(1024))
    }

    /// 3020, what NVIDIA's driver answers for contexts of the v2 API.
    fn ctx_get_api_version(&self, ctx: u64) -> CuResult<u64> {
        self.lock().ctx(ctx)?;
        Ok(3020)
    }

    fn ctx_get_flags(&self, ctx: u64) -> CuResult<u64> {
        self.lock().ctx(ctx)?;
        Ok(0)
    }

    /// `CU_FUNC_CACHE_PREFER_*` (0–3), kept per context.
    fn ctx_set_cache_config(&self, ctx: u64, value: u32) -> CuResult<()> {
        let mut st = self.lock();
        st.ctx(ctx)?;
        if value > 3 {
            return Err(CuError(cu::INVALID_VALUE));
        }
        st.limits.insert((ctx, CACHE_CONFIG_KEY), u64::from(value));
        Ok(())
    }

    /// The emulated device has no L2 cache to reset.
    fn device_graph_mem_trim(&self, device: i32) -> CuResult<()> {
        self.check_dev(device)?;
        self.lock().graphs.mem.trim();
        Ok(())
    }

    fn device_get_graph_mem_attribute(&self, device: i32, attribute: i32) -> CuResult<u64> {
        self.check_dev(device)?;
        self.lock().graphs.mem.attribute(attribute)
    }

    fn device_set_graph_mem_attribute(
        &self,
        device: i32,
        attribute: i32,
        value: u64,
    ) -> CuResult<()> {
        self.check_dev(device)?;
        self.lock().graphs.mem.reset_high(attribute, value)
    }

    fn ctx_reset_persisting_l2_cache(&self, ctx: u64) -> CuResult<()> {
        self.lock().ctx(ctx).map(|_| ())
    }

    fn ctx_get_cache_config(&self, ctx: u64) -> CuResult<u64> {
        let st = self.lock();
        st.ctx(ctx)?;
        Ok(st
            .limits
            .get(&(ctx, CACHE_CONFIG_KEY))
            .copied()
            .unwrap_or(0))
    }

    /// The stream's handle (unique in the backend, never reused); the legacy stream's is 1.
    fn stream_get_id(&self, ctx: u64, stream: u64) -> CuResult<u64> {
        self.lock().stream(ctx, stream)?;
        Ok(stream)
    }

    /// The emulated device answers the private tools query with 0 (no capability bits).
    fn tools_ctx_query(&self, ctx: u64, stream: u64, _mask: u64, _flag: u32) -> CuResult<u64> {
        let st = self.lock();
        if stream != 0 {
            st.stream(ctx, stream)?;
        }
        st.ctx(ctx)?;
        Ok(0)
    }

    fn mem_alloc(&self, ctx: u64, size: u64) -> CuResult<u64> {
        let mut st = self.lock();
        let dev = st.ctx(ctx)?;
        st.alloc(dev, size, self.config.memory_per_device, false)
    }

    fn mem_alloc_pitch(
        &self,
        ctx: u64,
        width: u64,
        height: u64,
        elem: u32,
    ) -> CuResult<(u64, u64)> {
        if !matches!(elem, 4 | 8 | 16) || width == 0 || height == 0 {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let pitch = align_up(width, 512);
        let size = pitch
            .checked_mul(height)
            .ok_or(CuError(cu::INVALID_VALUE))?;
        Ok((self.mem_alloc(ctx, size)?, pitch))
    }

    fn mem_free(&self, ctx: u64, ptr: u64) -> CuResult<()> {
        // cuMemFree synchronizes implicitly: it waits for the context's work, host functions
        // included (a host function that needs something the caller holds would deadlock).
        self.host_pending.wait_idle(ctx, None);
        let mut st = self.lock();
        st.ctx(ctx)?;
        if st.graphs.mem.owns(ptr) {
            // An allocation a graph launch left allocated.
            return st.graphs.mem.free_outside(ptr);
        }
        match st.allocs.get(&ptr) {
            // cuMemFree of a stream-ordered allocation gives it back to its pool.
            Some(_) if st.pools.owns(ptr) => st.pool_free(ptr),
            Some(a) if !a.global => st.free(ptr),
            _ => Err(CuError(cu::INVALID_VALUE)),
        }
    }

    fn mem_get_info(&self, ctx: u64) -> CuResult<(u64, u64)> {
        let st = self.lock();
        let dev = st.ctx(ctx)?;
        let used = st.used.get(&dev).copied().unwrap_or(0);
        let total = self.config.memory_per_device;
        Ok((total - used, total))
    }

    fn memcpy_htod(&self, ctx: u64, stream: Option<u64>, dst: u64, data: &[u8]) -> CuResult<()> {
        let mut st = self.lock();
        let s = stream.unwrap_or(LEGACY_STREAM);
        st.stream(ctx, s)?;
        let range = st.range(dst, data.len() as u64)?;
        if stream.is_none() {
            range.copy_from_slice(data);
            return Ok(());
        }
        let op = EmuOp::Htod {
            dst,
            data: data.to_vec(),
        };
        if !st.capture(ctx, s, op) {
            st.range(dst, data.len() as u64)?.copy_from_slice(data);
        }
        Ok(())
    }

    fn memcpy_dtoh(&self, ctx: u64, dst: &mut [u8], src: u64) -> CuResult<()> {
        let mut st = self.lock();
        st.ctx(ctx)?;
        dst.copy_from_slice(st.range(src, dst.len() as u64)?);
        Ok(())
    }

    /// As a driver with unified addressing answers for registered host memory: the host
    /// address itself (the server's, which is what its kernels would use).
    fn area_device_pointer(
        &self,
        ctx: u64,
        area: &remora_oncrpc::DataArea,
        offset: u64,
    ) -> CuResult<u64> {
        self.area_map(ctx, area, offset, 1)
    }

    fn area_map(
        &self,
        ctx: u64,
        area: &remora_oncrpc::DataArea,
        offset: u64,
        _size: u64,
    ) -> CuResult<u64> {
        self.lock().ctx(ctx)?;
        Ok(area.base() as u64 + offset)
    }

    fn memcpy_dtoh_async_in_area(
        &self,
        ctx: u64,
        stream: u64,
        copy: super::AreaCopy<'_>,
    ) -> Option<StagedResult> {
        if !self.config.area_dma {
            return None;
        }
        let landing = (|| {
            let mut st = self.lock();
            st.stream(ctx, stream)?;
            st.refuse_in_capture(ctx, stream)?;
            let data = st.range(copy.dev, copy.span.size)?.to_vec();
            let target = (copy.span.area.clone(), copy.span.offset);
            Ok(Box::new(self.landing(data, target)) as Box<dyn StagedCopy>)
        })();
        Some(landing)
    }

    fn memcpy_dtoh_async(&self, ctx: u64, stream: u64, src: u64, size: usize) -> StagedResult {
        let mut st = self.lock();
        st.stream(ctx, stream)?;
        st.refuse_in_capture(ctx, stream)?;
        let data = st.range(src, size as u64)?.to_vec();
        Ok(Box::new(self.staged(data)))
    }

    fn memcpy_dtod(&self, ctx: u64, stream: Option<u64>, copy: DtodCopy) -> CuResult<()> {
        let DtodCopy { dst, src, size } = copy;
        let mut st = self.lock();
        let s = stream.unwrap_or(LEGACY_STREAM);
        st.stream(ctx, s)?;
        let bytes = st.range(src, size)?.to_vec();
        st.range(dst, size)?;
        if stream.is_some() && st.capture(ctx, s, EmuOp::Dtod { dst, src, size }) {
            return Ok(());
        }
        st.range(dst, size)?.copy_from_slice(&bytes);
        Ok(())
    }

    fn memcpy_3d(&self, ctx: u64, stream: Option<u64>, io: Copy3dIo<'_>) -> CuResult<()> {
        let copy = io.copy;
        let mut st = self.lock();
        st.copy_contexts(ctx, stream.unwrap_or(LEGACY_STREAM), copy)?;
        if let Some(s) = stream {
            st.refuse_in_capture(ctx, s)?;
        }
        // Gathered first, so overlapping device ranges copy as from a snapshot.
        let packed = st.gather(copy, io.src_host)?;
        match copy.dst.place {
            CopyPlace::Host if io.dst_host.len() == packed.len() => {
                io.dst_host.copy_from_slice(&packed);
                Ok(())
            }
            CopyPlace::Host => Err(CuError(cu::INVALID_VALUE)),
            CopyPlace::Device(_) => st.scatter(copy, &packed),
        }
    }

    fn memcpy_3d_dtoh_async(&self, ctx: u64, stream: u64, copy: &Copy3d) -> StagedResult {
        let mut st = self.lock();
        st.copy_contexts(ctx, stream, copy)?;
        st.refuse_in_capture(ctx, stream)?;
        if copy.dst.place != CopyPlace::Host {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let data = st.gather(copy, &[])?;
        Ok(Box::new(self.staged(data)))
    }

    fn memcpy_peer(&self, ctx: u64, stream: Option<u64>, c: super::PeerCopy) -> CuResult<()> {
        let mut st = self.lock();
        st.stream(ctx, stream.unwrap_or(LEGACY_STREAM))?;
        if let Some(s) = stream {
            st.refuse_in_capture(ctx, s)?;
        }
        st.ctx(c.dst_ctx)?;
        st.ctx(c.src_ctx)?;
        let bytes = st.range(c.src, c.size)?.to_vec();
        st.range(c.dst, c.size)?.copy_from_slice(&bytes);
        Ok(())
    }

    fn memset(&self, ctx: u64, stream: Option<u64>, m: &Memset) -> CuResult<()> {
        let mut st = self.lock();
        let s = stream.unwrap_or(LEGACY_STREAM);
        st.stream(ctx, s)?;
        let elem = m.elem;
        let (row, span) = m.extent().ok_or(CuError(cu::INVALID_VALUE))?;
        if !m.dst.is_multiple_of(u64::from(elem))
            || (m.height > 1 && !m.pitch.is_multiple_of(u64::from(elem)))
        {
            return Err(CuError(cu::INVALID_VALUE));
        }
        // The whole span lies in one allocation.
        st.range(m.dst, span)?;
        let rows: Vec<u64> = (0..m.height).map(|r| m.dst + r * m.pitch).collect();
        if stream.is_some() && st.capturing.contains_key(&(ctx, s)) {
            for dst in rows {
                let op = EmuOp::Memset {
                    dst,
                    value: m.value,
                    elem,
                    count: m.width,
                };
                st.capture(ctx, s, op);
            }
            return Ok(());
        }
        for dst in rows {
            fill(st.range(dst, row)?, m.value, elem);
        }
        Ok(())
    }

    fn module_load(&self, ctx: u64, image: &[u8]) -> CuResult<LoadedModule> {
        if image.is_empty() {
            return Err(CuError(cu::INVALID_IMAGE));
        }
        let (funcs, globals) = parse_module(image)?;
        let mut st = self.lock();
        let dev = st.ctx(ctx)?;
        let mut module = EmuModule {
            globals: HashMap::new(),
        };
        for (name, size) in globals {
            let ptr = st.alloc(dev, size.max(1), self.config.memory_per_device, true)?;
            module.globals.insert(name, (ptr, size));
        }
        let raw = st.handle();
        let functions = funcs
            .into_iter()
            .map(|(name, params)| {
                let f = st.handle();
                st.functions.insert(f, (name.clone(), params.clone()));
                st.unloaded.insert(f);
                FunctionInfo {
                    name,
                    raw: f,
                    params,
                }
            })
            .collect();
        st.modules.insert(raw, module);
        Ok(LoadedModule { raw, functions })
    }

    fn module_unload(&self, ctx: u64, module: u64) -> CuResult<()> {
        let mut st = self.lock();
        st.ctx(ctx)?;
        let m = forget(&mut st.modules, module)?;
        for (ptr, _) in m.globals.into_values() {
            st.free(ptr)?;
        }
        Ok(())
    }

    fn module_get_global(&self, ctx: u64, module: u64, name: &str) -> CuResult<(u64, u64)> {
        let st = self.lock();
        st.ctx(ctx)?;
        let m = st.modules.get(&module).ok_or(CuError(cu::INVALID_HANDLE))?;
        m.globals.get(name).copied().ok_or(CuError(cu::NOT_FOUND))
    }

    fn func_load(&self, ctx: u64, func: u64) -> CuResult<()> {
        let mut st = self.lock();
        st.ctx(ctx)?;
        if !st.functions.contains_key(&func) {
            return Err(CuError(cu::INVALID_HANDLE));
        }
        st.unloaded.remove(&func);
        Ok(())
    }

    fn func_get_attribute(&self, ctx: u64, func: u64, attr: i32) -> CuResult<i32> {
        let st = self.lock();
        st.ctx(ctx)?;
        st.function(func)?;
        match attr {
            0 => Ok(1024), // CU_FUNC_ATTRIBUTE_MAX_THREADS_PER_BLOCK
            8 | 9 => Ok(st.func_attrs.get(&(func, attr)).copied().unwrap_or(0)),
            1..=10 => Ok(0),
            _ => Err(CuError(cu::INVALID_VALUE)),
        }
    }

    fn func_set_attribute(&self, ctx: u64, func: u64, attr: i32, value: i32) -> CuResult<()> {
        self.func_get_attribute(ctx, func, attr)?;
        if matches!(attr, 8 | 9) {
            if value < 0 || (attr == 8 && value > EMU_MAX_DYNAMIC_SHARED) {
                return Err(CuError(cu::INVALID_VALUE));
            }
            self.lock().func_attrs.insert((func, attr), value);
        }
        Ok(())
    }

    fn func_set_cache_config(&self, ctx: u64, func: u64, config: u32) -> CuResult<()> {
        self.func_get_attribute(ctx, func, 0)?;
        if config > 4 {
            return Err(CuError(cu::INVALID_VALUE));
        }
        Ok(())
    }

    /// As a GPU answers: threads and blocks per multiprocessor bound the blocks, and so does
    /// dynamic shared memory, of which a block may use 48 KiB, or up to the function's
    /// maximum dynamic shared memory attribute when that is set higher (0 blocks above it).
    fn occupancy_max_active_blocks(&self, ctx: u64, q: &Occupancy) -> CuResult<i32> {
        let max_dynamic = self.func_get_attribute(ctx, q.func, 8)?;
        if !(1..=1024).contains(&q.block_size) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let blocks = (2048 / q.block_size).min(32);
        let smem = q.dynamic_smem;
        if smem > u64::from(max_dynamic.max(48 << 10).unsigned_abs()) {
            return Ok(0);
        }
        let by_smem = EMU_SHARED_PER_SM.checked_div(smem).unwrap_or(u64::MAX);
        Ok(blocks.min(i32::try_from(by_smem).unwrap_or(i32::MAX)))
    }

    fn occupancy_max_active_clusters(&self, ctx: u64, spec: &LaunchSpec<'_>) -> CuResult<i32> {
        let st = self.lock();
        st.ctx(ctx)?;
        st.stream(ctx, spec.stream)?;
        st.function(spec.function)?;
        let threads: u64 = spec.block.iter().map(|&d| u64::from(d)).product();
        if threads == 0 || threads > 1024 || spec.grid.contains(&0) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let cluster: u64 = spec
            .attrs
            .iter()
            .find_map(|a| match a {
                RmLaunchAttr::RmLaunchClusterDimension(c) => {
                    Some(u64::from(c.x) * u64::from(c.y) * u64::from(c.z))
                }
                _ => None,
            })
            .unwrap_or(1);
        if cluster == 0 || cluster > 16 {
            return Err(CuError(cu::INVALID_VALUE));
        }
        // A plausible H100-like answer: 132 SMs, 2048 threads each.
        let blocks = 132 * (2048 / threads).min(32);
        Ok(i32::try_from(blocks / cluster).unwrap_or(i32::MAX))
    }

    fn occupancy_max_potential_block_size(&self, ctx: u64, q: &Occupancy) -> CuResult<(i32, i32)> {
        self.func_get_attribute(ctx, q.func, 0)?;
        let block_size_limit = q.block_size;
        if block_size_limit < 0 {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let block = if block_size_limit == 0 {
            1024
        } else {
            block_size_limit.min(1024)
        };
        let per_sm = (2048 / block).clamp(1, 32);
        Ok((132 * per_sm, block))
    }

    fn launch(&self, ctx: u64, spec: &LaunchSpec<'_>) -> CuResult<()> {
        if !self.config.launch_delay.is_zero() {
            std::thread::sleep(self.config.launch_delay);
        }
        let mut st = self.lock();
        st.stream(ctx, spec.stream)?;
        let (name, _) = st.function(spec.function)?.clone();
        let op = EmuOp::Launch {
            function: spec.function,
            name,
            grid: spec.grid,
            block: spec.block,
            params: spec.params.to_vec(),
            layout: spec.layout.to_vec(),
        };
        if st.capture(ctx, spec.stream, op.clone()) {
            return Ok(());
        }
        // Runs at once, like every emulated operation (the stream order is the call order).
        st.replay(&op)
    }

    fn stream_create(&self, ctx: u64, _flags: u32, _priority: i32) -> CuResult<u64> {
        self.lock().create_in(ctx, |st, h| {
            st.streams.insert(h, ctx);
        })
    }

    fn stream_set_attribute(&self, ctx: u64, stream: u64, value: &RmStreamAttr) -> CuResult<()> {
        let mut st = self.lock();
        st.stream(ctx, stream)?;
        st.stream_attrs.insert(
            (stream, remora_proto::stream_attr::kind(value)),
            value.clone(),
        );
        Ok(())
    }

    fn stream_get_attribute(&self, ctx: u64, stream: u64, kind: i32) -> CuResult<RmStreamAttr> {
        let st = self.lock();
        st.stream(ctx, stream)?;
        match st.stream_attrs.get(&(stream, kind)) {
            Some(v) => Ok(v.clone()),
            // Never set: the zero value of that attribute.
            None => remora_proto::stream_attr::from_abi(kind, &[0; 64])
                .ok_or(CuError(cu::INVALID_VALUE)),
        }
    }

    fn stream_destroy(&self, ctx: u64, stream: u64) -> CuResult<()> {
        let mut st = self.lock();
        st.ctx(ctx)?;
        forget(&mut st.streams, stream).map(|_| ())
    }

    fn stream_synchronize(&self, ctx: u64, stream: u64) -> CuResult<()> {
        self.outside_capture(ctx, stream)?;
        self.host_pending.wait_idle(ctx, Some(stream));
        self.pause();
        self.device_printf();
        Ok(())
    }

    fn stream_query(&self, ctx: u64, stream: u64) -> CuResult<()> {
        self.outside_capture(ctx, stream)?;
        if self.host_pending.lock().contains_key(&(ctx, stream)) {
            return Err(CuError(cu::NOT_READY));
        }
        if self.config.sync_delay.is_zero() {
            Ok(())
        } else {
            Err(CuError(cu::NOT_READY))
        }
    }

    fn stream_wait_event(&self, ctx: u64, stream: u64, event: u64, _flags: u32) -> CuResult<()> {
        let mut st = self.lock();
        st.stream(ctx, stream)?;
        st.events.get(&event).ok_or(CuError(cu::INVALID_HANDLE))?;
        if st.capture(ctx, stream, EmuOp::Nop) {
            return Ok(());
        }
        // Waiting for an event recorded in a capture joins the capture.
        if let Some(id) = st.event_capture.get(&event).copied()
            && st.captures.contains_key(&id)
        {
            st.capturing.insert((ctx, stream), id);
        }
        Ok(())
    }

    fn event_create(&self, ctx: u64, flags: u32) -> CuResult<u64> {
        // BLOCKING_SYNC 1, DISABLE_TIMING 2, INTERPROCESS 4 (which needs DISABLE_TIMING).
        if flags & !0x7 != 0 || (flags & 4 != 0 && flags & 2 == 0) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        self.lock().create_in(ctx, |st, h| {
            st.events.insert(h, None);
        })
    }

    fn event_destroy(&self, ctx: u64, event: u64) -> CuResult<()> {
        let mut st = self.lock();
        st.ctx(ctx)?;
        forget(&mut st.events, event).map(|_| ())
    }

    fn event_record(&self, ctx: u64, event: u64, stream: u64) -> CuResult<()> {
        let mut st = self.lock();
        st.stream(ctx, stream)?;
        st.events.get(&event).ok_or(CuError(cu::INVALID_HANDLE))?;
        if let Some(id) = st.capturing.get(&(ctx, stream)).copied() {
            st.capture(ctx, stream, EmuOp::Nop);
            st.event_capture.insert(event, id);
            return Ok(());
        }
        st.event_capture.remove(&event);
        if let Some(e) = st.events.get_mut(&event) {
            *e = Some(Instant::now());
        }
        Ok(())
    }

    fn event_synchronize(&self, ctx: u64, event: u64) -> CuResult<()> {
        self.event_query(ctx, event)?;
        self.pause();
        Ok(())
    }

    fn event_query(&self, ctx: u64, event: u64) -> CuResult<()> {
        let st = self.lock();
        st.ctx(ctx)?;
        st.events
            .get(&event)
            .map(|_| ())
            .ok_or(CuError(cu::INVALID_HANDLE))
    }

    fn event_elapsed(&self, ctx: u64, start: u64, end: u64) -> CuResult<f32> {
        let st = self.lock();
        st.ctx(ctx)?;
        let (Some(Some(a)), Some(Some(b))) = (st.events.get(&start), st.events.get(&end)) else {
            return Err(CuError(cu::INVALID_HANDLE));
        };
        let ms = if b >= a {
            b.duration_since(*a).as_secs_f64() * 1e3
        } else {
            -(a.duration_since(*b).as_secs_f64() * 1e3)
        };
        Ok(ms as f32)
    }

    /// An idle stream's word is written at once; a busy one's by the context's host-function
    /// thread, in order with the stream's host functions (the emulated stream's only work
    /// that runs later). Refused with the device-printf test hook on.
    fn stream_signal(
        &self,
        ctx: u64,
        stream: u64,
        signals: &remora_shm::Signals,
        slot: usize,
        value: u64,
    ) -> CuResult<()> {
        let word = signals.word(slot).ok_or(CuError(cu::INVALID_VALUE))?;
        if self.config.device_printf.is_some() {
            // The test hook prints at every synchronize, as if every module printed: the
            // synchronize must reach the backend.
            return Err(CuError(cu::NOT_SUPPORTED));
        }
        if self.stream_query(ctx, stream).is_ok() {
            // Nothing of the stream runs later: it has got there.
            word.store(value, std::sync::atomic::Ordering::Release);
            return Ok(());
        }
        let signals = signals.clone();
        self.launch_host_func(
            ctx,
            stream,
            Box::new(move || {
                if let Some(w) = signals.word(slot) {
                    w.store(value, std::sync::atomic::Ordering::Release);
                }
            }),
        )
    }

    fn launch_host_func(&self, ctx: u64, stream: u64, f: HostFn) -> CuResult<()> {
        self.outside_capture(ctx, stream)?;
        let tx = self.host_thread(ctx)?;
        let key = (ctx, stream);
        *self.host_pending.lock().entry(key).or_default() += 1;
        if tx.send((key, f)).is_err() {
            self.host_pending.finished(key);
            return Err(CuError(cu::INVALID_HANDLE));
        }
        Ok(())
    }

    fn stream_begin_capture(&self, ctx: u64, stream: u64) -> CuResult<CaptureInfo> {
        let mut st = self.lock();
        st.stream(ctx, stream)?;
        if stream == LEGACY_STREAM || stream == 0 {
            return Err(CuError(cu::STREAM_CAPTURE_UNSUPPORTED));
        }
        if st.capturing.contains_key(&(ctx, stream)) {
            return Err(CuError(cu::ILLEGAL_STATE));
        }
        let id = st.handle();
        let graph = st.handle();
        st.graphs.graphs.insert(graph, Default::default());
        st.captures.insert(
            id,
            EmuCapture {
                graph,
                origin: (ctx, stream),
                invalidated: false,
            },
        );
        st.capturing.insert((ctx, stream), id);
        Ok(CaptureInfo {
            status: super::capture_status::ACTIVE,
            id,
            graph,
            dependencies: 0,
        })
    }

    fn stream_end_capture(&self, ctx: u64, stream: u64) -> CuResult<u64> {
        let mut st = self.lock();
        st.stream(ctx, stream)?;
        let id = *st
            .capturing
            .get(&(ctx, stream))
            .ok_or(CuError(cu::ILLEGAL_STATE))?;
        let (origin, graph, invalidated) = match st.captures.get(&id) {
            Some(c) => (c.origin, c.graph, c.invalidated),
            None => return Err(CuError(cu::ILLEGAL_STATE)),
        };
        if origin != (ctx, stream) {
            return Err(CuError(cu::STREAM_CAPTURE_UNMATCHED));
        }
        st.captures.remove(&id);
        st.capturing.retain(|_, c| *c != id);
        st.event_capture.retain(|_, c| *c != id);
        if invalidated {
            st.drop_graph(graph);
            return Err(CuError(cu::STREAM_CAPTURE_INVALIDATED));
        }
        Ok(graph)
    }

    fn stream_capture_info(&self, ctx: u64, stream: u64) -> CuResult<CaptureInfo> {
        let st = self.lock();
        st.stream(ctx, stream)?;
        let Some(id) = st.capturing.get(&(ctx, stream)).copied() else {
            return Ok(CaptureInfo::default());
        };
        let c = st.captures.get(&id).ok_or(CuError(cu::ILLEGAL_STATE))?;
        let deps = st
            .graphs
            .graphs
            .get(&c.graph)
            .map_or(0, |g| u64::from(!g.is_empty()));
        Ok(if c.invalidated {
            CaptureInfo {
                status: super::capture_status::INVALIDATED,
                id,
                graph: 0,
                dependencies: 0,
            }
        } else {
            CaptureInfo {
                status: super::capture_status::ACTIVE,
                id,
                graph: c.graph,
                dependencies: deps,
            }
        })
    }

    fn graph_instantiate(&self, ctx: u64, graph: u64, _flags: u64) -> CuResult<u64> {
        let mut st = self.lock();
        st.ctx(ctx)?;
        if st.captures.values().any(|c| c.graph == graph) {
            // Still being captured.
            return Err(CuError(cu::INVALID_VALUE));
        }
        st.instantiate(graph)
    }

    fn graph_launch(&self, ctx: u64, exec: u64, stream: u64) -> CuResult<()> {
        let mut st = self.lock();
        st.stream(ctx, stream)?;
        let e = st
            .graphs
            .execs
            .get(&exec)
            .ok_or(CuError(cu::INVALID_HANDLE))?
            .clone();
        if st.capturing.contains_key(&(ctx, stream)) {
            if e.has_host_nodes() {
                return st.refuse_in_capture(ctx, stream);
            }
            // Captured into another graph: its operations, inline.
            for (_, op) in e.ops {
                st.capture(ctx, stream, op);
            }
            return Ok(());
        }
        if e.has_host_nodes() {
            drop(st);
            return self.launch_with_host_nodes(ctx, stream, e.ops);
        }
        for (_, op) in &e.ops {
            st.replay(op)?;
        }
        Ok(())
    }

    fn graph_upload(&self, ctx: u64, exec: u64, stream: u64) -> CuResult<()> {
        let st = self.lock();
        st.stream(ctx, stream)?;
        st.graphs
            .execs
            .get(&exec)
            .map(|_| ())
            .ok_or(CuError(cu::INVALID_HANDLE))
    }

    fn graph_exec_destroy(&self, ctx: u64, exec: u64) -> CuResult<()> {
        let mut st = self.lock();
        st.ctx(ctx)?;
        forget(&mut st.graphs.execs, exec).map(|_| ())
    }

    fn graph_destroy(&self, ctx: u64, graph: u64) -> CuResult<()> {
        let mut st = self.lock();
        st.ctx(ctx)?;
        st.drop_graph(graph)
            .map(|_| ())
            .ok_or(CuError(cu::INVALID_HANDLE))
    }

    fn graph_node_count(&self, ctx: u64, graph: u64) -> CuResult<u64> {
        let st = self.lock();
        st.ctx(ctx)?;
        st.graphs
            .graphs
            .get(&graph)
            .map(|g| g.len() as u64)
            .ok_or(CuError(cu::INVALID_HANDLE))
    }
}
