//! What the executor needs from a GPU: the [`Backend`] trait and its two implementations,
//! [`CudaBackend`] (the real driver) and [`EmulatedBackend`] (a test backend for machines
//! without a GPU, chosen only by `remora serve --backend emulated` or by tests).
//!
//! Every backend object (context, module, function, stream, event) is a raw `u64` here: the
//! driver's pointer for the real backend. These values never reach the wire; the session table
//! maps them to per-session handles.

use remora_oncrpc::DataArea;
use remora_proto::cuda::{CuError, CuResult, cu};
use remora_proto::remora::{RmLaunchAttr, RmStreamAttr};

pub mod cuda;
pub mod emulated;
mod emulated_kernels;
pub mod graphs;
pub mod pools;
pub mod vmm;

pub use cuda::CudaBackend;
pub use emulated::{EmulatedBackend, EmulatedConfig, LiveCounts};
pub use graphs::Graphs;
pub use pools::MemPools;
pub use vmm::Vmm;

/// The backend value of the CUDA legacy default stream (`CU_STREAM_LEGACY`).
pub const LEGACY_STREAM: u64 = 1;

/// Everything the client caches about a device.
#[derive(Debug, Clone, PartialEq)]
pub struct DeviceProps {
    /// Marketing name.
    pub name: String,
    /// Device UUID.
    pub uuid: [u8; 16],
    /// Total memory, bytes.
    pub total_memory: u64,
    /// PCI bus id.
    pub pci_bus_id: String,
    /// `(CUdevice_attribute, value)` for every attribute the driver answers.
    pub attributes: Vec<(i32, i32)>,
}

/// One function of a loaded module.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FunctionInfo {
    /// Mangled name.
    pub name: String,
    /// Backend value (`CUfunction`).
    pub raw: u64,
    /// `(offset, size)` of each parameter.
    pub params: Vec<(u32, u32)>,
}

/// A loaded module and its functions.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadedModule {
    /// Backend value (`CUmodule`).
    pub raw: u64,
    /// Its functions.
    pub functions: Vec<FunctionInfo>,
}

/// A memset: `height` rows of `width` elements of `elem` bytes (1, 2 or 4), `pitch` bytes
/// apart (a 1-D memset is one row; its pitch is not used).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Memset {
    /// First byte.
    pub dst: u64,
    /// The value; its low 8, 16 or 32 bits are used.
    pub value: u32,
    /// Element size in bytes.
    pub elem: u32,
    /// Elements per row.
    pub width: u64,
    /// Rows.
    pub height: u64,
    /// Bytes between rows.
    pub pitch: u64,
}

impl Memset {
    /// A 1-D memset of `count` elements.
    pub fn linear(dst: u64, value: u32, elem: u32, count: u64) -> Self {
        Self {
            dst,
            value,
            elem,
            width: count,
            height: 1,
            pitch: 0,
        }
    }

    /// The bytes of one row, and of the whole span from the first byte past the last
    /// (`None` on overflow, a bad element size, or rows that overlap).
    pub fn extent(&self) -> Option<(u64, u64)> {
        if !matches!(self.elem, 1 | 2 | 4) {
            return None;
        }
        let row = self.width.checked_mul(u64::from(self.elem))?;
        if self.height <= 1 {
            return Some((row, if self.height == 0 { 0 } else { row }));
        }
        if self.pitch < row {
            return None;
        }
        let span = self.pitch.checked_mul(self.height - 1)?.checked_add(row)?;
        Some((row, span))
    }
}

/// A kernel launch, with its parameters already checked against the function's layout.
#[derive(Debug)]
pub struct LaunchSpec<'a> {
    /// Backend function.
    pub function: u64,
    /// Grid dimensions.
    pub grid: [u32; 3],
    /// Block dimensions.
    pub block: [u32; 3],
    /// Dynamic shared memory per block.
    pub shared_mem_bytes: u32,
    /// Backend stream ([`LEGACY_STREAM`] for the legacy stream).
    pub stream: u64,
    /// Packed parameter bytes (8-byte aligned copy).
    pub params: &'a [u8],
    /// `(offset, size)` of each parameter inside `params`; every range is in bounds.
    pub layout: &'a [(u32, u32)],
    /// Launch attributes (cuLaunchKernelEx when not empty).
    pub attrs: &'a [RmLaunchAttr],
}

/// Which driver call a 2-D or 3-D copy maps onto.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyForm {
    /// `cuMemcpy3D(Async)` (or `cuMemcpy3DPeer(Async)` for peer copies).
    ThreeD,
    /// `cuMemcpy2D(Async)`.
    TwoD,
    /// `cuMemcpy2DUnaligned` (synchronous only).
    TwoDUnaligned,
}

/// Where one side of a 2-D or 3-D copy is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CopyPlace {
    /// Device memory at this address (checked against the session's allocations).
    Device(u64),
    /// The packed host buffer passed next to the copy (x, y, z are 0, the pitch is the width
    /// and the height is the copy's height).
    Host,
}

/// One side of a 2-D or 3-D copy.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopySide {
    /// Device address or packed host buffer.
    pub place: CopyPlace,
    /// Bytes per row.
    pub pitch: u64,
    /// Rows per slice (3-D only; may be 0 when the depth is 1).
    pub height: u64,
    /// Offset of the first byte in a row.
    pub x_bytes: u64,
    /// First row.
    pub y: u64,
    /// First slice.
    pub z: u64,
    /// Peer copies: the backend context of this side.
    pub ctx: Option<u64>,
}

/// A 2-D or 3-D copy, validated by the executor: every device range it touches lies inside
/// one allocation of the session, pitches are at least the width, and a host side's buffer
/// holds exactly `width * height * depth` bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy3d {
    /// The driver call.
    pub form: CopyForm,
    /// Source.
    pub src: CopySide,
    /// Destination.
    pub dst: CopySide,
    /// Bytes per row.
    pub width: u64,
    /// Rows per slice.
    pub height: u64,
    /// Slices.
    pub depth: u64,
}

impl Copy3d {
    /// Whether both sides name a context (`cuMemcpy3DPeer`).
    pub fn is_peer(&self) -> bool {
        self.src.ctx.is_some() || self.dst.ctx.is_some()
    }

    /// Bytes copied (the size of a packed host side). Validated not to overflow.
    pub fn packed_len(&self) -> u64 {
        self.width
            .saturating_mul(self.height)
            .saturating_mul(self.depth)
    }

    /// The offset of each row of the copy from `side`'s base, slice by slice and row by row
    /// (the order of the packed layout). Validated not to overflow.
    pub fn row_offsets(&self, side: &CopySide) -> impl Iterator<Item = u64> + use<> {
        let s = *side;
        let (height, depth) = (self.height, self.depth);
        (0..depth).flat_map(move |k| {
            (0..height).map(move |r| {
                s.z.saturating_add(k)
                    .saturating_mul(s.height)
                    .saturating_add(s.y.saturating_add(r))
                    .saturating_mul(s.pitch)
                    .saturating_add(s.x_bytes)
            })
        })
    }
}

/// A copy between the memory of two contexts (`cuMemcpyPeer`), checked by the executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PeerCopy {
    /// Destination device address.
    pub dst: u64,
    /// Backend context of the destination.
    pub dst_ctx: u64,
    /// Source device address.
    pub src: u64,
    /// Backend context of the source.
    pub src_ctx: u64,
    /// Bytes.
    pub size: u64,
}

/// A device-to-device copy in one context (`cuMemcpyDtoD`), checked by the executor.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DtodCopy {
    /// Destination device address.
    pub dst: u64,
    /// Source device address.
    pub src: u64,
    /// Bytes.
    pub size: u64,
}

/// A [`Copy3d`] with its packed host bytes: `src_host` when `copy.src` is
/// [`CopyPlace::Host`] (else empty), `dst_host` when `copy.dst` is (synchronous copies only;
/// else empty).
#[derive(Debug)]
pub struct Copy3dIo<'a> {
    /// The copy.
    pub copy: &'a Copy3d,
    /// The packed source.
    pub src_host: &'a [u8],
    /// Where the packed destination goes.
    pub dst_host: &'a mut [u8],
}

/// What the occupancy calculator is asked about one kernel.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Occupancy {
    /// The backend function.
    pub func: u64,
    /// Threads per block (`cuOccupancyMaxActiveBlocksPerMultiprocessor`), or the largest
    /// block size to consider (`cuOccupancyMaxPotentialBlockSize`; 0: no limit).
    pub block_size: i32,
    /// Dynamic shared memory per block, bytes.
    pub dynamic_smem: u64,
    /// `CU_OCCUPANCY_*` flags.
    pub flags: u32,
}

/// `CUstreamCaptureStatus` values.
pub mod capture_status {
    remora_proto::cuda_consts!(i32, "CU_STREAM_CAPTURE_STATUS_" {
        NONE = 0,
        ACTIVE = 1,
        INVALIDATED = 2,
    });
}

/// What `cuStreamGetCaptureInfo` says about a stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CaptureInfo {
    /// A [`capture_status`] value.
    pub status: i32,
    /// The capture id (meaningful unless the status is NONE).
    pub id: u64,
    /// The backend graph being captured (while ACTIVE).
    pub graph: u64,
    /// Number of capture dependencies of the stream.
    pub dependencies: u64,
}

/// An asynchronous device-to-host copy into a server-side staging buffer.
pub trait StagedCopy: Send + Sync {
    /// `Ok(true)` when the copy has completed, `Ok(false)` while in flight.
    fn query(&self) -> CuResult<bool>;
    /// Blocks until the copy has completed.
    fn wait(&self) -> CuResult<()>;
    /// The copied bytes; meaningful once [`StagedCopy::query`] says complete.
    fn data(&self) -> &[u8];
    /// The copy is taken for delivery, complete (by a query, a wait, or the stream order a
    /// host function follows). The emulated backend's copies into a data area land there
    /// now at the latest; the default does nothing.
    fn delivering(&self) {}
}

/// An asynchronous device-to-host copy into a staging buffer, once issued.
pub type StagedResult = CuResult<Box<dyn StagedCopy>>;

/// The bytes of a completed staged copy, shared rather than copied: a reply sends them from
/// the staging buffer, which its backend gets back (the CUDA backend: to its pool) once every
/// holder has let go of them.
pub(crate) fn staged_bytes(copy: std::sync::Arc<dyn StagedCopy>) -> remora_xdr::Bytes {
    /// A completed staged copy as a `Bytes` owner.
    struct Completed(std::sync::Arc<dyn StagedCopy>);
    impl AsRef<[u8]> for Completed {
        fn as_ref(&self) -> &[u8] {
            self.0.data()
        }
    }
    remora_xdr::Bytes::from_owner(Completed(copy))
}

/// A copy that carries no bytes and is complete: an empty copy, or one that could not be
/// issued (delivered empty, so that the client waits for nothing; its error is deferred).
pub(crate) struct NoBytes;

impl StagedCopy for NoBytes {
    fn query(&self) -> CuResult<bool> {
        Ok(true)
    }
    fn wait(&self) -> CuResult<()> {
        Ok(())
    }
    fn data(&self) -> &[u8] {
        &[]
    }
}

/// A host function enqueued on a stream ([`Backend::launch_host_func`]). It may block: later
/// work in its stream waits until it returns.
pub type HostFn = Box<dyn FnOnce() + Send + 'static>;

/// The executor's view of a GPU driver. Device ordinals are the ones clients see (after
/// `--devices`); every call that works in a context takes it explicitly and the backend makes it
/// current on the calling thread when needed. Implementations must be callable from several
/// threads at once. Stream-ordered allocation and memory pools are the [`MemPools`] part,
/// explicit graphs the [`Graphs`] part, virtual memory management the [`Vmm`] part.
pub trait Backend: MemPools + Graphs + Vmm + Send + Sync + 'static {
    /// A short name for logs ("cuda", "emulated").
    fn kind(&self) -> &'static str;
    /// `cuDriverGetVersion`.
    fn driver_version(&self) -> CuResult<i32>;
    /// Number of visible devices.
    fn device_count(&self) -> CuResult<i32>;
    /// Everything about a device.
    fn device_props(&self, dev: i32) -> CuResult<DeviceProps>;
    /// `cuDeviceGetAttribute`.
    fn device_attribute(&self, attr: i32, dev: i32) -> CuResult<i32>;

    /// `cuCtxCreate`. The executor also uses it for what a client calls its primary context:
    /// every session gets a context of its own, so a sticky error cannot spread to others.
    fn ctx_create(&self, flags: u32, dev: i32) -> CuResult<u64>;

    /// Before any session: makes what the first session would otherwise wait for (the CUDA
    /// backend creates a context on device 0 with flags 0, which the first matching
    /// [`Backend::ctx_create`] takes). Session workers of a warm pool call it while they wait
    /// for their connection. Best effort; the default does nothing.
    fn prewarm(&self) {}
    /// Destroys the context [`Backend::prewarm`] made if no session took it: a session
    /// worker that has served its session holds nothing on the GPU once it says so
    /// (`worker_pool::RELEASED`). The default does nothing.
    fn discard_warm(&self) {}
    /// `cuCtxDestroy`.
    fn ctx_destroy(&self, ctx: u64) -> CuResult<()>;
    /// `cuCtxSynchronize` (blocks).
    fn ctx_synchronize(&self, ctx: u64) -> CuResult<()>;
    // The plain calls, generated from their `@glue` annotations in remora.x: `ctx_set_limit`,
    // `ctx_get_limit`, `ctx_get_api_version`, `ctx_get_flags`, `ctx_set_cache_config`,
    // `ctx_get_cache_config`, `ctx_reset_persisting_l2_cache`, `stream_get_id`.
    remora_proto::backend_glue!();
    /// `cuCtxGetStreamPriorityRange`: `(least, greatest)`.
    fn ctx_stream_priority_range(&self, ctx: u64) -> CuResult<(i32, i32)>;
    /// The private TOOLS_CONTEXT query that cuBLASLt makes (slot 51 for the context's object,
    /// then slot 39 with `mask` and `flag`): the 32-bit answer.
    /// `stream` is slot 51's second argument: 0 for the NULL stream, else a backend stream.
    fn tools_ctx_query(&self, ctx: u64, stream: u64, mask: u64, flag: u32) -> CuResult<u64>;

    /// `cuMemAlloc`.
    fn mem_alloc(&self, ctx: u64, size: u64) -> CuResult<u64>;
    /// `cuMemAllocPitch`: `(ptr, pitch)`.
    fn mem_alloc_pitch(&self, ctx: u64, width: u64, height: u64, elem: u32)
    -> CuResult<(u64, u64)>;
    /// `cuMemFree`.
    fn mem_free(&self, ctx: u64, ptr: u64) -> CuResult<()>;
    /// `cuMemGetInfo`: `(free, total)`.
    fn mem_get_info(&self, ctx: u64) -> CuResult<(u64, u64)>;
    /// `cuMemcpyHtoD` (`stream` `None`) or `cuMemcpyHtoDAsync`.
    fn memcpy_htod(&self, ctx: u64, stream: Option<u64>, dst: u64, data: &[u8]) -> CuResult<()>;
    /// `cuMemcpyDtoH` (blocks).
    fn memcpy_dtoh(&self, ctx: u64, dst: &mut [u8], src: u64) -> CuResult<()>;
    /// `cuMemcpyDtoH` of `size` bytes into memory the backend keeps, answered as bytes a reply
    /// sends without copying them (the CUDA backend: a pinned staging buffer, which goes back
    /// to its pool once the reply lets go of it). `None` when the backend has no such memory
    /// for this copy: the caller copies into its own buffer with [`Backend::memcpy_dtoh`].
    fn memcpy_dtoh_owned(
        &self,
        _ctx: u64,
        _src: u64,
        _size: usize,
    ) -> Option<CuResult<remora_xdr::Bytes>> {
        None
    }
    /// `cuMemcpyHtoD[Async]` from `copy.span` of a session's shared data area. The client may
    /// write those bytes at any time; a synchronous or plain asynchronous copy no longer reads
    /// them when this returns (the client may reuse the space). The source of
    /// [`AreaHtod::AsyncPinned`] is zero-copy pinned memory: its bytes may still be read after
    /// this returns, until the stream reaches the copy (CUDA's contract for pinned sources).
    /// The default copies the bytes out once and calls [`Backend::memcpy_htod`].
    fn memcpy_htod_area(&self, ctx: u64, how: AreaHtod, copy: AreaCopy<'_>) -> CuResult<()> {
        self.memcpy_htod(ctx, how.stream(), copy.dev, &copy.span.read()?)
    }
    /// `cuMemcpyDtoH` into `copy.span` of a session's shared data area (blocks). The default
    /// copies through a private buffer.
    fn memcpy_dtoh_area(&self, ctx: u64, copy: AreaCopy<'_>) -> CuResult<()> {
        buffered_dtoh_area(self, ctx, copy)
    }
    /// `cuMemcpyDtoHAsync` straight into `copy.span` of a session's shared data area
    /// (zero-copy pinned memory): the bytes must be there once `stream`'s work up to this
    /// copy has completed, and nothing is delivered. The default stages the copy, waits for
    /// it and writes the bytes (correct, but it blocks until the stream reaches the copy).
    fn memcpy_dtoh_async_area(&self, ctx: u64, stream: u64, copy: AreaCopy<'_>) -> CuResult<()> {
        staged_dtoh_area(self, ctx, stream, copy)
    }
    /// A session with a shared data area begins: a backend may prepare the area for DMA
    /// (the CUDA backend page-locks it with `cuMemHostRegister`, chunk by chunk as copies
    /// reach it). Best effort; the default does nothing.
    fn area_attach(&self, _area: &DataArea) {}
    /// The session of `area` has ended and the area is about to be unmapped: undo
    /// [`Backend::area_attach`].
    fn area_detach(&self, _area: &DataArea) {}
    /// `cuMemHostGetDevicePointer` of the byte at `offset` of `area` (already checked to lie
    /// inside it), in `ctx`: mapped host memory. The CUDA backend page-locks the area with
    /// `CU_MEMHOSTREGISTER_DEVICEMAP` first if it has not yet.
    fn area_device_pointer(&self, ctx: u64, area: &DataArea, offset: u64) -> CuResult<u64>;
    /// `RM_AREA_MAP`: page-locks and maps `offset..offset + size` of the session's data area
    /// for the GPU in `ctx` (checked to lie inside it) and answers the device address of the
    /// byte at `offset`.
    fn area_map(&self, ctx: u64, area: &DataArea, offset: u64, size: u64) -> CuResult<u64>;
    /// `cuMemcpyDtoHAsync` straight into `copy.span` of a session's shared data area, for a
    /// copy delivered like a staged one (`RM_AREA_MEMCPY_DTOH_ASYNC`): the copy, whose
    /// [`StagedCopy::data`] is empty (its bytes land in the area), to query and wait for;
    /// `None` when the area cannot take the DMA here (not page-locked for `ctx`), and the
    /// caller stages the copy with [`Backend::memcpy_dtoh_async`] instead. The default says
    /// `None`.
    fn memcpy_dtoh_async_in_area(
        &self,
        _ctx: u64,
        _stream: u64,
        _copy: AreaCopy<'_>,
    ) -> Option<StagedResult> {
        None
    }
    /// `cuMemcpyDtoHAsync` into a staging buffer.
    fn memcpy_dtoh_async(&self, ctx: u64, stream: u64, src: u64, size: usize) -> StagedResult;
    /// `cuMemcpyDtoD` (`stream` `None`) or `cuMemcpyDtoDAsync`.
    fn memcpy_dtod(&self, ctx: u64, stream: Option<u64>, copy: DtodCopy) -> CuResult<()>;
    /// `cuMemcpy2D/2DUnaligned/3D/3DPeer` (`stream` `None`) or the async forms.
    fn memcpy_3d(&self, ctx: u64, stream: Option<u64>, io: Copy3dIo<'_>) -> CuResult<()>;
    /// `cuMemcpy2DAsync/3DAsync/3DPeerAsync` from device memory into a packed staging buffer
    /// (`copy.dst` is [`CopyPlace::Host`]).
    fn memcpy_3d_dtoh_async(&self, ctx: u64, stream: u64, copy: &Copy3d) -> StagedResult;
    /// `cuMemcpyPeer` (`stream` `None`) or `cuMemcpyPeerAsync`; `ctx` is the calling context.
    fn memcpy_peer(&self, ctx: u64, stream: Option<u64>, copy: PeerCopy) -> CuResult<()>;
    /// `cuMemsetD8/16/32` and `cuMemsetD2D8/16/32` (`stream` `None`) or their async forms.
    fn memset(&self, ctx: u64, stream: Option<u64>, m: &Memset) -> CuResult<()>;

    /// `cuModuleLoadData` plus the function list with parameter layouts.
    fn module_load(&self, ctx: u64, image: &[u8]) -> CuResult<LoadedModule>;
    /// `cuModuleUnload`.
    fn module_unload(&self, ctx: u64, module: u64) -> CuResult<()>;
    /// `cuModuleGetGlobal`: `(ptr, size)`.
    fn module_get_global(&self, ctx: u64, module: u64, name: &str) -> CuResult<(u64, u64)>;
    /// `cuFuncLoad`: loads a function [`Backend::module_load`] listed before its first use
    /// (the driver's lazy loading). Backends whose functions are always loaded answer `Ok`.
    fn func_load(&self, _ctx: u64, _func: u64) -> CuResult<()> {
        Ok(())
    }
    /// `cuFuncGetAttribute`.
    fn func_get_attribute(&self, ctx: u64, func: u64, attr: i32) -> CuResult<i32>;
    /// `cuFuncSetAttribute`.
    fn func_set_attribute(&self, ctx: u64, func: u64, attr: i32, value: i32) -> CuResult<()>;
    /// `cuFuncSetCacheConfig`.
    fn func_set_cache_config(&self, ctx: u64, func: u64, config: u32) -> CuResult<()>;
    /// `cuOccupancyMaxActiveBlocksPerMultiprocessorWithFlags`.
    fn occupancy_max_active_blocks(&self, ctx: u64, q: &Occupancy) -> CuResult<i32>;
    /// `cuOccupancyMaxActiveClusters` for a launch configuration (`spec.params` is ignored).
    fn occupancy_max_active_clusters(&self, ctx: u64, spec: &LaunchSpec<'_>) -> CuResult<i32>;
    /// `cuOccupancyMaxPotentialBlockSize` without a shared-memory callback, block sizes up to
    /// `q.block_size`: `(min_grid_size, block_size)`.
    fn occupancy_max_potential_block_size(&self, ctx: u64, q: &Occupancy) -> CuResult<(i32, i32)>;
    /// `cuLaunchKernel` / `cuLaunchKernelEx`.
    fn launch(&self, ctx: u64, spec: &LaunchSpec<'_>) -> CuResult<()>;

    /// `cuStreamCreateWithPriority`.
    fn stream_create(&self, ctx: u64, flags: u32, priority: i32) -> CuResult<u64>;
    /// `cuStreamDestroy`.
    fn stream_destroy(&self, ctx: u64, stream: u64) -> CuResult<()>;
    /// `cuStreamSetAttribute` (the range of an access policy window was checked).
    fn stream_set_attribute(&self, ctx: u64, stream: u64, value: &RmStreamAttr) -> CuResult<()>;
    /// `cuStreamGetAttribute` of a stream attribute id (1, 3, 8, 9 or 10).
    fn stream_get_attribute(&self, ctx: u64, stream: u64, kind: i32) -> CuResult<RmStreamAttr>;
    /// `cuStreamSynchronize` (blocks).
    fn stream_synchronize(&self, ctx: u64, stream: u64) -> CuResult<()>;
    /// `cuStreamQuery` (`Err(CuError(cu::NOT_READY))` while busy).
    fn stream_query(&self, ctx: u64, stream: u64) -> CuResult<()>;
    /// Has `stream` write `value` into completion word `slot` of `signals` (a session's
    /// shared region) when it reaches this point, in order with its other work
    /// (`RM_STREAM_SIGNAL`). The default refuses: the client then makes the full
    /// synchronizing call.
    fn stream_signal(
        &self,
        _ctx: u64,
        _stream: u64,
        _signals: &remora_shm::Signals,
        _slot: usize,
        _value: u64,
    ) -> CuResult<()> {
        Err(CuError(cu::NOT_SUPPORTED))
    }
    /// `cuStreamWaitEvent`.
    fn stream_wait_event(&self, ctx: u64, stream: u64, event: u64, flags: u32) -> CuResult<()>;
    /// `cuEventCreate`.
    fn event_create(&self, ctx: u64, flags: u32) -> CuResult<u64>;
    /// `cuEventDestroy`.
    fn event_destroy(&self, ctx: u64, event: u64) -> CuResult<()>;
    /// `cuEventRecord`.
    fn event_record(&self, ctx: u64, event: u64, stream: u64) -> CuResult<()>;
    /// `cuEventSynchronize` (blocks).
    fn event_synchronize(&self, ctx: u64, event: u64) -> CuResult<()>;
    /// `cuEventQuery` (`Err(CuError(cu::NOT_READY))` while pending).
    fn event_query(&self, ctx: u64, event: u64) -> CuResult<()>;
    /// `cuEventElapsedTime`, milliseconds.
    fn event_elapsed(&self, ctx: u64, start: u64, end: u64) -> CuResult<f32>;
    /// `cuLaunchHostFunc`: `f` runs on a thread of the backend (the driver's host-function
    /// thread) when `stream` reaches it; later work in the stream waits until it returns.
    /// `f` may block for as long as it needs, but must never wait for the thread that called
    /// this (the executor's connection thread). Dropped unrun when it cannot be enqueued.
    fn launch_host_func(&self, ctx: u64, stream: u64, f: HostFn) -> CuResult<()>;

    /// `cuStreamBeginCapture_v2` in `CU_STREAM_CAPTURE_MODE_RELAXED` (the client keeps the
    /// mode the program asked for: the server's threads are not the program's), then the
    /// capture's id and graph (`cuStreamGetCaptureInfo`).
    fn stream_begin_capture(&self, ctx: u64, stream: u64) -> CuResult<CaptureInfo>;
    /// `cuStreamEndCapture`: the captured graph.
    fn stream_end_capture(&self, ctx: u64, stream: u64) -> CuResult<u64>;
    /// `cuStreamGetCaptureInfo` (status, id, graph, number of dependencies).
    fn stream_capture_info(&self, ctx: u64, stream: u64) -> CuResult<CaptureInfo>;
    /// `cuGraphInstantiateWithFlags`.
    fn graph_instantiate(&self, ctx: u64, graph: u64, flags: u64) -> CuResult<u64>;
    /// `cuGraphLaunch`.
    fn graph_launch(&self, ctx: u64, exec: u64, stream: u64) -> CuResult<()>;
    /// `cuGraphUpload`.
    fn graph_upload(&self, ctx: u64, exec: u64, stream: u64) -> CuResult<()>;
    /// `cuGraphExecDestroy`.
    fn graph_exec_destroy(&self, ctx: u64, exec: u64) -> CuResult<()>;
    /// `cuGraphDestroy`.
    fn graph_destroy(&self, ctx: u64, graph: u64) -> CuResult<()>;
    /// `cuGraphGetNodes` with a NULL array: the number of nodes.
    fn graph_node_count(&self, ctx: u64, graph: u64) -> CuResult<u64>;
}

/// `size` bytes at `offset` of a session's shared data area, bounds-checked by the executor.
#[derive(Debug, Clone, Copy)]
pub struct AreaSpan<'a> {
    /// The data area.
    pub area: &'a DataArea,
    /// First byte.
    pub offset: u64,
    /// Bytes.
    pub size: u64,
}

/// A copy between device memory at `dev` and `span` of a session's shared data area.
#[derive(Debug, Clone, Copy)]
pub struct AreaCopy<'a> {
    /// The device address.
    pub dev: u64,
    /// The bytes in the area.
    pub span: AreaSpan<'a>,
}

/// How [`Backend::memcpy_htod_area`] runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AreaHtod {
    /// `cuMemcpyHtoD`.
    Sync,
    /// `cuMemcpyHtoDAsync` on a stream; the bytes are consumed when the call returns.
    Async(u64),
    /// `cuMemcpyHtoDAsync` on a stream from zero-copy pinned memory, which the client keeps
    /// until the stream reaches the copy.
    AsyncPinned(u64),
}

impl AreaHtod {
    /// The stream of an asynchronous copy.
    pub fn stream(self) -> Option<u64> {
        match self {
            AreaHtod::Sync => None,
            AreaHtod::Async(s) | AreaHtod::AsyncPinned(s) => Some(s),
        }
    }
}

/// [`Backend::memcpy_dtoh_area`] through a private buffer: the default, and the CUDA
/// backend's way for an area it cannot reach by DMA.
pub(crate) fn buffered_dtoh_area<B: Backend + ?Sized>(
    b: &B,
    ctx: u64,
    copy: AreaCopy<'_>,
) -> CuResult<()> {
    let mut buf = vec![0u8; copy.span.len_usize()?];
    b.memcpy_dtoh(ctx, &mut buf, copy.dev)?;
    copy.span.write(&buf)
}

/// [`Backend::memcpy_dtoh_async_area`] through a staging buffer, waited for: the default, and
/// the CUDA backend's way for an area it cannot reach by DMA.
pub(crate) fn staged_dtoh_area<B: Backend + ?Sized>(
    b: &B,
    ctx: u64,
    stream: u64,
    copy: AreaCopy<'_>,
) -> CuResult<()> {
    let staged = b.memcpy_dtoh_async(ctx, stream, copy.dev, copy.span.len_usize()?)?;
    staged.wait()?;
    copy.span.write(staged.data())
}

impl AreaSpan<'_> {
    /// The size as a `usize` (`INVALID_VALUE` where it does not fit).
    pub fn len_usize(&self) -> CuResult<usize> {
        usize::try_from(self.size).map_err(|_| CuError(cu::INVALID_VALUE))
    }

    /// The span's first byte in this process's mapping of the area.
    pub fn ptr(&self) -> CuResult<*mut u8> {
        self.area
            .ptr(self.offset, self.size)
            .map_err(|_| CuError(cu::INVALID_VALUE))
    }

    /// A private copy of the span's bytes (the client may change them at any time).
    pub fn read(&self) -> CuResult<Vec<u8>> {
        let mut buf = vec![0u8; self.len_usize()?];
        self.area
            .read(self.offset, &mut buf)
            .map_err(|_| CuError(cu::INVALID_VALUE))?;
        Ok(buf)
    }

    /// Writes `bytes` at the span's start.
    pub fn write(&self, bytes: &[u8]) -> CuResult<()> {
        self.area
            .write(self.offset, bytes)
            .map_err(|_| CuError(cu::INVALID_VALUE))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;
    use std::sync::atomic::{AtomicBool, Ordering};

    /// A completed staged copy that records when its backend got it back.
    struct Staged(Vec<u8>, Arc<AtomicBool>);
    impl StagedCopy for Staged {
        fn query(&self) -> CuResult<bool> {
            Ok(true)
        }
        fn wait(&self) -> CuResult<()> {
            Ok(())
        }
        fn data(&self) -> &[u8] {
            &self.0
        }
    }
    impl Drop for Staged {
        fn drop(&mut self) {
            self.1.store(true, Ordering::SeqCst);
        }
    }

    /// A reply's bytes are the staging buffer itself, and the buffer goes back only when the
    /// last holder (the pending copy, then the reply) lets go of it.
    #[test]
    fn staged_bytes_share_the_staging_buffer_until_the_last_holder_lets_go() {
        let released = Arc::new(AtomicBool::new(false));
        let copy: Arc<dyn StagedCopy> = Arc::new(Staged(
            (0..=255u8).cycle().take(1 << 20).collect(),
            released.clone(),
        ));
        let bytes = staged_bytes(Arc::clone(&copy));
        assert_eq!(bytes.as_ptr(), copy.data().as_ptr(), "shared, not copied");
        assert_eq!(bytes.len(), 1 << 20);
        let sent = bytes.slice(4096..8192);
        drop(copy);
        drop(bytes);
        assert!(!released.load(Ordering::SeqCst), "a slice still holds it");
        assert_eq!(sent[0], 0);
        assert_eq!(sent[255], 255);
        drop(sent);
        assert!(released.load(Ordering::SeqCst));
    }
}
