//! [`Session`]: one connection to `remora serve`, a method per protocol procedure.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::ThreadId;
use std::time::Duration;

use remora_oncrpc::{Client as RpcClient, ClientConfig, Endpoint, TransportChoice};
use remora_proto::remora::*;
use remora_xdr::Bytes;
use sha2::{Digest, Sha256};

use crate::area::{AreaAlloc, Lease};
use crate::copy3d::{self, Band, Extent, Layout};
use crate::error::{CuError, CuResult, cu};
use crate::host::{HostMem, HostRange};
use crate::host_callbacks::{HostCallback, HostCallbacks};
use crate::launch::{self, LaunchLimits, OccupancyLimits, dev_attr, func_attr};
use crate::library::Libraries;
use crate::vaspace::{ReserveError, VaSpace};

/// A device ordinal as the server numbers them.
pub type DeviceHandle = i32;

/// Device attributes that advertise managed memory or coherent access to pageable host
/// memory, which a remote GPU cannot give the client process: answered 0 (see
/// [`Session::device_attribute`]). `CU_DEVICE_ATTRIBUTE_MANAGED_MEMORY` (83),
/// `PAGEABLE_MEMORY_ACCESS` (88), `CONCURRENT_MANAGED_ACCESS` (89),
/// `PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES` (100) and
/// `DIRECT_MANAGED_MEM_ACCESS_FROM_HOST` (101).
pub const UNSUPPORTED_MEMORY_ATTRIBUTES: [i32; 5] = [83, 88, 89, 100, 101];

pub use crate::delivery::CopySink;
use crate::delivery::{Delivery, Fetch};

/// Copies larger than this travel as several calls of at most this many bytes, so that every
/// record stays far below the server's maximum record size (128 MiB by default) and memory
/// per call stays bounded on both sides.
pub(crate) const COPY_CHUNK: usize = 32 << 20;

/// Largest reply record the client accepts: a synchronizing reply may carry several
/// asynchronous device-to-host copies at once.
pub(crate) const MAX_REPLY_RECORD: usize = (1 << 30) + (1 << 16);

/// How long one-way calls (launches, async copies) may wait to be written together:
/// `REMORA_ONEWAY_BATCH_US` microseconds (default 50; 0 writes each call at once). A
/// synchronizing call always writes the queue first, so this adds no latency to a launch
/// followed by a synchronize.
fn oneway_batch_delay() -> Option<Duration> {
    let us = std::env::var("REMORA_ONEWAY_BATCH_US")
        .ok()
        .and_then(|v| v.trim().parse::<u64>().ok())
        .unwrap_or(50);
    (us > 0).then(|| Duration::from_micros(us))
}

/// Largest chunk of a copy through the data area (smaller areas: a quarter of the area).
const AREA_CHUNK: usize = 16 << 20;
/// How many device allocations that collide with this process's own mappings `cuMemAlloc`
/// holds on to while asking the server for another address.
const MAX_VA_RETRIES: usize = 8;
/// The smallest staging chunk worth streaming through the area.
const MIN_AREA_CHUNK: usize = 256 << 10;

/// Asynchronous copies smaller than this travel inside their (one-way) call: through the
/// area they would need a round trip to learn when the space is free again.
const AREA_ASYNC_MIN: usize = 64 << 10;

/// The arguments of an area copy, before the chunk fills in its offset and size.
fn area_args(ctx: RmHandle, stream: RmHandle, dev: u64) -> RmAreaCopyArgs {
    RmAreaCopyArgs {
        ctx,
        stream,
        dev,
        offset: 0,
        size: 0,
        copy_id: 0,
    }
}

/// `copy_id` of an `RM_AREA_MEMCPY_HTOD_ASYNC` from zero-copy pinned memory
/// (docs/protocol.md): the server may read the bytes until the stream reaches the copy, as
/// CUDA allows for a pinned source. Staging leases send 0 (read before the reply).
const AREA_PINNED_SOURCE: u64 = 1;

/// Splits `len` bytes into `(offset, size)` chunks of at most [`COPY_CHUNK`].
fn chunks(len: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..len.div_ceil(COPY_CHUNK).max(1)).map(move |i| {
        let off = i * COPY_CHUNK;
        (off, COPY_CHUNK.min(len - off))
    })
}

/// Reassembles an asynchronous device-to-host copy sent in chunks, then hands the whole to the
/// caller's sink once every chunk has arrived.
struct ChunkedSink {
    buf: Vec<u8>,
    remaining: usize,
    sink: Option<CopySink>,
}

/// Timeouts and names used by [`Session::connect_with`].
#[derive(Debug, Clone)]
pub struct SessionConfig {
    /// Bound on establishing the connection.
    pub connect_timeout: Duration,
    /// Bound on the HELLO exchange.
    pub hello_timeout: Duration,
    /// Bound on every other call (synchronizing calls wait for kernels: keep it long).
    pub call_timeout: Duration,
    /// Name sent in HELLO.
    pub client_name: String,
    /// How to reach the server (default: `REMORA_TRANSPORT`, else auto).
    pub transport: TransportChoice,
}

impl Default for SessionConfig {
    fn default() -> Self {
        let ms = |var: &str, default: u64| {
            Duration::from_millis(
                std::env::var(var)
                    .ok()
                    .and_then(|v| v.parse().ok())
                    .unwrap_or(default),
            )
        };
        Self {
            connect_timeout: ms("REMORA_CONNECT_TIMEOUT_MS", 5_000),
            hello_timeout: Duration::from_secs(10),
            call_timeout: ms("REMORA_CALL_TIMEOUT_MS", 24 * 3600 * 1000),
            client_name: format!("remora-client {}", env!("CARGO_PKG_VERSION")),
            transport: crate::endpoint::transport_from_env().unwrap_or_default(),
        }
    }
}

/// A stream as a CUDA call names it, before mapping to a protocol handle.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum StreamRef {
    /// NULL or `CU_STREAM_LEGACY`: the legacy default stream.
    Legacy,
    /// `CU_STREAM_PER_THREAD` (or NULL through a `_ptds`/`_ptsz` entry point).
    PerThread,
    /// A stream the client created.
    Handle(RmHandle),
}

impl StreamRef {
    /// Maps a raw `CUstream` value whose non-special values are protocol handles.
    /// `per_thread_default` is true for the `_ptds`/`_ptsz` entry points, where NULL means
    /// the per-thread stream.
    pub fn from_raw(raw: u64, per_thread_default: bool) -> StreamRef {
        match raw {
            0 if per_thread_default => StreamRef::PerThread,
            0 | 1 => StreamRef::Legacy,
            2 => StreamRef::PerThread,
            h => StreamRef::Handle(h),
        }
    }
}

/// Where the data of an asynchronous 2-D or 3-D copy to host memory goes: called once per
/// band of the copy (see [`copy3d::bands`]) with the band's layout in the destination, its
/// extent and its packed rows (fewer, or none, when the copy failed).
pub type BandSink = Arc<dyn Fn(&Layout, &Extent, &[u8]) + Send + Sync>;

/// The source of a 2-D or 3-D copy.
#[derive(Debug)]
pub enum CopySrc<'a> {
    /// Device memory at `ptr`.
    Device {
        /// `srcDevice`.
        ptr: u64,
        /// Offsets, pitch and height.
        layout: Layout,
    },
    /// Host memory: `base` is `srcHost` and holds at least the copy's span.
    Host {
        /// From `srcHost` to the end of the region.
        base: &'a [u8],
        /// Offsets, pitch and height.
        layout: Layout,
    },
}

/// The destination of a 2-D or 3-D copy.
pub enum CopyDst<'a> {
    /// Device memory at `ptr`.
    Device {
        /// `dstDevice`.
        ptr: u64,
        /// Offsets, pitch and height.
        layout: Layout,
    },
    /// Host memory written before the call returns (synchronous copies only).
    Host {
        /// From `dstHost` to the end of the region.
        base: &'a mut [u8],
        /// Offsets, pitch and height.
        layout: Layout,
    },
    /// Host memory written by `sink` when the data arrives (a synchronizing call's reply for
    /// an asynchronous copy; before the call returns for a synchronous one).
    Later {
        /// Offsets, pitch and height.
        layout: Layout,
        /// Writes each band.
        sink: BandSink,
    },
}

impl std::fmt::Debug for CopyDst<'_> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CopyDst::Device { ptr, layout } => f
                .debug_struct("Device")
                .field("ptr", ptr)
                .field("layout", layout)
                .finish(),
            CopyDst::Host { base, layout } => f
                .debug_struct("Host")
                .field("len", &base.len())
                .field("layout", layout)
                .finish(),
            CopyDst::Later { layout, .. } => {
                f.debug_struct("Later").field("layout", layout).finish()
            }
        }
    }
}

/// What a 2-D or 3-D copy is, besides its two sides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Copy3dParams {
    /// The driver call (`RM_COPY_2D` copies have depth 1 and z offsets 0).
    pub form: RmCopyForm,
    /// The calling context.
    pub ctx: RmHandle,
    /// For the async forms the stream; for the synchronous ones the stream whose pending
    /// asynchronous copies the call delivers (the legacy or the per-thread one).
    pub stream: RmHandle,
    /// Its size.
    pub extent: Extent,
    /// Peer copies: (source context, destination context).
    pub peer: Option<(RmHandle, RmHandle)>,
}

/// A launch attribute the protocol carries.
pub type LaunchAttr = RmLaunchAttr;

/// A function of a loaded module: its handle and parameter layout.
#[derive(Debug, Clone, PartialEq)]
pub struct FunctionInfo {
    /// Mangled name.
    pub name: String,
    /// The name with a NUL (`cuFuncGetName` hands out a pointer to it).
    pub c_name: std::ffi::CString,
    /// Server handle.
    pub handle: RmHandle,
    /// Parameter offsets and sizes (`cuFuncGetParamInfo`).
    pub params: Vec<RmParam>,
    /// The module it belongs to.
    pub module: RmHandle,
}

/// A loaded module: its handle and functions by name.
#[derive(Debug, Clone, PartialEq)]
pub struct ModuleInfo {
    /// Server handle.
    pub handle: RmHandle,
    /// The context it was loaded in.
    pub ctx: RmHandle,
    /// Functions by mangled name.
    pub functions: HashMap<String, Arc<FunctionInfo>>,
}

/// What a pointer is, as unified addressing sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PointerKind {
    /// Not in any device allocation or tracked host range of this session.
    Host,
    /// In host memory the client allocated (`cuMemHostAlloc`) or registered
    /// (`cuMemHostRegister`).
    HostTracked(HostRange),
    /// Inside the device allocation at `base` of `size` bytes, made in context `ctx`.
    Device {
        /// Base address of the allocation.
        base: u64,
        /// Its size in bytes.
        size: u64,
        /// The context that allocated it.
        ctx: RmHandle,
        /// `CU_POINTER_ATTRIBUTE_BUFFER_ID`: unique in the process, never reused.
        buffer_id: u64,
    },
}

/// `CU_STREAM_CAPTURE_MODE_RELAXED`.
const CAPTURE_MODE_RELAXED: i32 = 2;

/// What `cuStreamGetCaptureInfo` answers about a stream.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct CaptureInfo {
    /// `CUstreamCaptureStatus`: 0 none, 1 active, 2 invalidated.
    pub status: i32,
    /// The capture id (0 when not capturing).
    pub id: u64,
    /// The graph being captured (0 unless active).
    pub graph: RmHandle,
    /// Number of capture dependencies of the stream.
    pub dependencies: u64,
}

/// A stream capture this client began.
struct ClientCapture {
    /// The stream that began it (only it may end it).
    origin: RmHandle,
    /// `CUstreamCaptureMode` the program asked for.
    mode: i32,
    /// The thread that began it (a non-relaxed capture must end there).
    thread: ThreadId,
    /// An error the client gave a call that cannot be captured: ending the capture returns it.
    error: Option<i32>,
}

/// The streams taking part in captures, as far as the client can know: every capture begins
/// and ends through it, and a stream joins one only by waiting for an event recorded in it
/// (`cuStreamWaitEvent`). A stream absent from here is not capturing, so the capture queries
/// (cuBLASLt asks before every GEMM) are answered without a round trip; for a stream listed
/// here, the server is asked (it knows whether the capture was invalidated).
#[derive(Default)]
struct Captures {
    /// Stream handle → capture id.
    streams: HashMap<RmHandle, u64>,
    /// Capture id → capture.
    active: HashMap<u64, ClientCapture>,
    /// Event → the capture it was last recorded in.
    events: HashMap<RmHandle, u64>,
    /// Executable graphs alive.
    execs: std::collections::HashSet<RmHandle>,
}

impl Captures {
    fn end(&mut self, id: u64) {
        self.active.remove(&id);
        self.streams.retain(|_, c| *c != id);
        self.events.retain(|_, c| *c != id);
    }
}

/// One connection to `remora serve`. `Send + Sync`: calls from many threads are pipelined.
pub struct Session {
    rpc: RemoraV1Client,
    welcome: HelloWelcome,
    props: Mutex<HashMap<DeviceHandle, Arc<RmDeviceProps>>>,
    attrs: Mutex<HashMap<(DeviceHandle, i32), i32>>,
    modules: Mutex<HashMap<RmHandle, Arc<ModuleInfo>>>,
    functions: Mutex<HashMap<RmHandle, Arc<FunctionInfo>>>,
    /// Asynchronous device-to-host copies not yet written, and CUDA's ordering rules that
    /// say when they must be.
    delivery: Arc<Delivery>,
    per_thread: Mutex<HashMap<(ThreadId, RmHandle), RmHandle>>,
    va: VaSpace,
    host: HostMem,
    /// The shared data area's allocator (a session in shared memory, revision 6).
    area: Option<Arc<AreaAlloc>>,
    func_attrs: Mutex<HashMap<(RmHandle, i32), i32>>,
    libraries: Libraries,
    callbacks: Arc<HostCallbacks>,
    captures: Mutex<Captures>,
}

impl std::fmt::Debug for Session {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Session")
            .field("endpoint", self.rpc.rpc().endpoint())
            .field("revision", &self.welcome.revision)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

macro_rules! call {
    ($self:ident . $proc:ident ( $arg:expr )) => {
        $self
            .rpc
            .$proc($arg)
            .map_err(|e| CuError::from_rpc(stringify!($proc), e))
    };
    ($self:ident . $proc:ident ()) => {
        $self
            .rpc
            .$proc()
            .map_err(|e| CuError::from_rpc(stringify!($proc), e))
    };
}

fn int(r: RmIntReply) -> CuResult<i32> {
    match r {
        RmIntReply::Case0(v) => Ok(v),
        RmIntReply::Default { discriminant } => Err(CuError(nonzero(discriminant))),
    }
}

fn u64r(r: RmU64Reply) -> CuResult<u64> {
    match r {
        RmU64Reply::Case0(v) => Ok(v),
        RmU64Reply::Default { discriminant } => Err(CuError(nonzero(discriminant))),
    }
}

fn handle(r: RmHandleReply) -> CuResult<RmHandle> {
    match r {
        RmHandleReply::Case0(v) => Ok(v),
        RmHandleReply::Default { discriminant } => Err(CuError(nonzero(discriminant))),
    }
}

/// A union's default arm with status 0 cannot happen (0 has its own arm); be safe anyway.
fn nonzero(code: i32) -> i32 {
    if code == 0 { cu::UNKNOWN } else { code }
}

impl Session {
    // The plain calls, generated from their `@glue` annotations in remora.x.
    remora_proto::client_glue!();

    /// Connects to the server named by `REMORA_SERVER`, else the default endpoint.
    pub fn from_env() -> CuResult<Session> {
        let endpoint = crate::endpoint::endpoint_from_env()?;
        let transport = crate::endpoint::transport_from_env()?;
        Self::connect_with(
            &endpoint,
            SessionConfig {
                transport,
                ..SessionConfig::default()
            },
        )
    }

    /// Connects to `endpoint` and says HELLO. An unreachable server is
    /// CUDA_ERROR_NO_DEVICE (logged with the reason); a server that speaks no revision ≥ 2
    /// is CUDA_ERROR_NOT_SUPPORTED.
    pub fn connect(endpoint: &Endpoint) -> CuResult<Session> {
        Self::connect_with(endpoint, SessionConfig::default())
    }

    /// [`Session::connect`] with explicit timeouts.
    pub fn connect_with(endpoint: &Endpoint, config: SessionConfig) -> CuResult<Session> {
        let rpc_config = ClientConfig {
            connect_timeout: Some(config.connect_timeout),
            default_timeout: config.call_timeout,
            max_record_size: MAX_REPLY_RECORD,
            oneway_batch_delay: oneway_batch_delay(),
            transport: config.transport,
            ..ClientConfig::default()
        };
        let rpc = RpcClient::connect_with(endpoint, rpc_config).map_err(|e| {
            if matches!(e, remora_oncrpc::RpcError::Transport { .. }) {
                tracing::error!("remora: {e} (REMORA_TRANSPORT={})", config.transport);
                return CuError(cu::NO_DEVICE);
            }
            tracing::warn!("remora: {e} (set REMORA_SERVER to tcp://HOST:PORT or unix:///PATH)");
            CuError(cu::NO_DEVICE)
        })?;
        let hello_client = RemoraV1Client::new(rpc.clone()).with_timeout(config.hello_timeout);
        let reply = hello_client
            .remora_hello(&HelloArgs {
                min_revision: 2,
                max_revision: REMORA_PROTOCOL_REVISION,
                client_name: config.client_name.clone(),
                capabilities: u64::from(REMORA_CAP_ONEWAY),
            })
            .map_err(|e| {
                tracing::warn!("remora: HELLO to {endpoint} failed: {e}");
                CuError(cu::NO_DEVICE)
            })?;
        let welcome = match reply {
            HelloReply::True(w) if w.revision >= 2 => w,
            HelloReply::True(w) => {
                tracing::error!(
                    "remora: server at {endpoint} negotiated revision {}, this client needs 2 or later",
                    w.revision
                );
                return Err(CuError(cu::NOT_SUPPORTED));
            }
            HelloReply::False(r) => {
                tracing::error!(
                    "remora: server at {endpoint} refused HELLO (it speaks revisions {}..={}): {}",
                    r.min_revision,
                    r.max_revision,
                    r.reason
                );
                return Err(CuError(cu::NOT_SUPPORTED));
            }
        };
        if let DriverReport::Default {
            discriminant,
            value,
        } = &welcome.driver
        {
            tracing::warn!(
                "remora: server {} has no usable CUDA driver ({discriminant:?}): {value}",
                welcome.hostname
            );
        }
        let area = rpc
            .data_area()
            .filter(|_| welcome.revision >= 6)
            .map(AreaAlloc::new);
        let rpc = RemoraV1Client::new(rpc);
        Ok(Session {
            delivery: Arc::new(Delivery::new(rpc.clone(), welcome.revision)),
            rpc,
            welcome,
            props: Mutex::default(),
            attrs: Mutex::default(),
            modules: Mutex::default(),
            functions: Mutex::default(),
            per_thread: Mutex::default(),
            va: VaSpace::default(),
            host: HostMem::with_area(area.clone()),
            area,
            func_attrs: Mutex::default(),
            libraries: Libraries::default(),
            callbacks: Arc::default(),
            captures: Mutex::default(),
        })
    }

    /// The server's HELLO answer.
    pub fn welcome(&self) -> &HelloWelcome {
        &self.welcome
    }

    /// The generated protocol client, for procedures not wrapped here.
    pub fn rpc(&self) -> &RemoraV1Client {
        &self.rpc
    }

    /// The server's devices from HELLO (empty when it has no driver).
    pub fn devices(&self) -> &[DeviceInfo] {
        match &self.welcome.driver {
            DriverReport::DriverOk(ok) => &ok.devices,
            DriverReport::Default { .. } => &[],
        }
    }

    /// Why the server has no devices, if it has no driver.
    pub fn driver_problem(&self) -> Option<&str> {
        match &self.welcome.driver {
            DriverReport::DriverOk(_) => None,
            DriverReport::Default { value, .. } => Some(value),
        }
    }

    /// The server driver's version (`cuDriverGetVersion`), if it has one.
    pub fn driver_version(&self) -> Option<i32> {
        match &self.welcome.driver {
            DriverReport::DriverOk(ok) => Some(ok.driver_version),
            DriverReport::Default { .. } => None,
        }
    }

    /// Number of devices.
    pub fn device_count(&self) -> i32 {
        self.devices().len() as i32
    }

    fn check_device(&self, dev: DeviceHandle) -> CuResult<()> {
        if dev < 0 || dev >= self.device_count() {
            return Err(CuError(cu::INVALID_DEVICE));
        }
        Ok(())
    }

    // Devices ----------------------------------------------------------------------------

    /// `RM_DEVICE_GET_PROPS`, fetched once per device and cached.
    pub fn device_props(&self, dev: DeviceHandle) -> CuResult<Arc<RmDeviceProps>> {
        self.check_device(dev)?;
        if let Some(p) = lock(&self.props).get(&dev) {
            return Ok(Arc::clone(p));
        }
        let props = match call!(self.rm_device_get_props(&dev))? {
            RmDevicePropsReply::Case0(p) => Arc::new(p),
            RmDevicePropsReply::Default { discriminant } => {
                return Err(CuError(nonzero(discriminant)));
            }
        };
        lock(&self.props).insert(dev, Arc::clone(&props));
        Ok(props)
    }

    /// A device attribute: from the cached props, else `RM_DEVICE_GET_ATTRIBUTE` (cached).
    ///
    /// Managed (unified) memory and coherent access to pageable host memory are not
    /// supported through Remora: the attributes that advertise them
    /// ([`UNSUPPORTED_MEMORY_ATTRIBUTES`]) answer 0 whatever the server's GPU can do, so that
    /// well-behaved programs (and the CUDA runtime's `cudaDeviceProp.managedMemory`,
    /// `concurrentManagedAccess`, `pageableMemoryAccess`, ...) do not try.
    pub fn device_attribute(&self, dev: DeviceHandle, attribute: i32) -> CuResult<i32> {
        let props = self.device_props(dev)?;
        if UNSUPPORTED_MEMORY_ATTRIBUTES.contains(&attribute) {
            return Ok(0);
        }
        if let Some(a) = props.attributes.iter().find(|a| a.attribute == attribute) {
            return Ok(a.value);
        }
        if let Some(v) = lock(&self.attrs).get(&(dev, attribute)) {
            return Ok(*v);
        }
        let v = int(call!(self.rm_device_get_attribute(&RmDeviceAttrArgs {
            attribute,
            device: dev
        }))?)?;
        lock(&self.attrs).insert((dev, attribute), v);
        Ok(v)
    }

    // Contexts -----------------------------------------------------------------------------

    /// `cuDevicePrimaryCtxRetain`.
    pub fn primary_ctx_retain(&self, dev: DeviceHandle) -> CuResult<RmHandle> {
        self.check_device(dev)?;
        handle(call!(self.rm_primary_ctx_retain(&dev))?)
    }

    /// `cuDevicePrimaryCtxRelease`.
    pub fn primary_ctx_release(&self, dev: DeviceHandle) -> CuResult<()> {
        self.check_device(dev)?;
        let r = call!(self.rm_primary_ctx_release(&dev))?;
        self.take_device_output();
        CuError::check(r)
    }

    /// `cuDevicePrimaryCtxSetFlags`.
    pub fn primary_ctx_set_flags(&self, dev: DeviceHandle, flags: u32) -> CuResult<()> {
        self.check_device(dev)?;
        CuError::check(call!(
            self.rm_primary_ctx_set_flags(&RmPrimaryFlagsArgs { device: dev, flags })
        )?)
    }

    /// `cuDevicePrimaryCtxGetState`: (flags, active).
    pub fn primary_ctx_get_state(&self, dev: DeviceHandle) -> CuResult<(u32, bool)> {
        self.check_device(dev)?;
        match call!(self.rm_primary_ctx_get_state(&dev))? {
            RmPrimaryStateReply::Case0(s) => Ok((s.flags, s.active != 0)),
            RmPrimaryStateReply::Default { discriminant } => Err(CuError(nonzero(discriminant))),
        }
    }

    /// `cuDevicePrimaryCtxReset`.
    pub fn primary_ctx_reset(&self, dev: DeviceHandle) -> CuResult<()> {
        self.check_device(dev)?;
        let r = call!(self.rm_primary_ctx_reset(&dev))?;
        self.take_device_output();
        CuError::check(r)
    }

    /// `cuCtxCreate`.
    pub fn ctx_create(&self, flags: u32, dev: DeviceHandle) -> CuResult<RmHandle> {
        self.check_device(dev)?;
        handle(call!(
            self.rm_ctx_create(&RmCtxCreateArgs { flags, device: dev })
        )?)
    }

    /// `cuCtxDestroy`: also forgets the context's allocations and per-thread streams. The
    /// context's pending asynchronous copies are delivered first (destroying a context waits
    /// for its work; their bytes would otherwise be lost with it).
    pub fn ctx_destroy(&self, ctx: RmHandle) -> CuResult<()> {
        if !self.delivery.pending_in(Some(ctx)).is_empty()
            && let Err(e) = self.ctx_synchronize(ctx)
        {
            tracing::debug!("remora: cuCtxDestroy: synchronizing the context failed: {e}");
        }
        let r = call!(self.rm_ctx_destroy(&ctx))?;
        self.take_device_output();
        CuError::check(r)?;
        for base in self.va.of_context(ctx) {
            self.va.release(base);
        }
        lock(&self.per_thread).retain(|(_, c), _| *c != ctx);
        self.libraries.forget_ctx(ctx);
        self.delivery.ctx_destroyed(ctx);
        Ok(())
    }

    /// `cuCtxSynchronize` (delivers pending asynchronous copies).
    pub fn ctx_synchronize(&self, ctx: RmHandle) -> CuResult<()> {
        let cov = self.delivery.context(ctx, self.copy_mark());
        let r = call!(self.rm_ctx_synchronize(&ctx))?;
        self.finish_sync(r)?;
        self.delivery.settle(&cov, Fetch::Collect)
    }

    /// The private TOOLS_CONTEXT query cuBLASLt makes (slots 51 and 39), answered by the
    /// server's driver: the 32-bit answer (revision 7).
    pub fn tools_ctx_query(&self, ctx: RmHandle, mask: u64, flag: u32) -> CuResult<u64> {
        self.need_revision(7, "the TOOLS_CONTEXT query of cuBLASLt")?;
        u64r(call!(self.rm_tools_ctx_query(&RmToolsCtxQueryArgs {
            ctx,
            mask,
            flag
        }))?)
    }

    // Memory -------------------------------------------------------------------------------

    /// Allocates device memory with `alloc` (which answers the pointer, the bytes it spans and
    /// whatever else the caller wants back) and reserves the same range in this process, as
    /// unified addressing needs. The server's driver picks the address; when it lands on one
    /// of this process's own mappings, that allocation is kept (so the driver cannot hand it
    /// out again) and another asked for, up to [`MAX_VA_RETRIES`] times; the collided ones
    /// are freed at the end.
    fn alloc_reserved<T>(
        &self,
        ctx: RmHandle,
        alloc: impl Fn() -> CuResult<(u64, u64, T)>,
    ) -> CuResult<(u64, T)> {
        let mut collided = Vec::new();
        let result = loop {
            let (ptr, size, extra) = match alloc() {
                Ok(a) => a,
                Err(e) => break Err(e),
            };
            match self.va.reserve(ptr, size, ctx) {
                Ok(()) => break Ok((ptr, extra)),
                Err(ReserveError::Collision(_)) if collided.len() < MAX_VA_RETRIES => {
                    tracing::debug!(
                        "remora: device allocation {ptr:#x}+{size:#x} collides with a host mapping of this process; allocating again"
                    );
                    collided.push(ptr);
                }
                Err(ReserveError::Collision(why) | ReserveError::Other(why)) => {
                    tracing::error!(
                        "remora: the device allocation {ptr:#x}+{size:#x} collides with a host mapping of this process ({why}); unified addressing needs the same range free in the client, so the allocation was freed and fails with CUDA_ERROR_OUT_OF_MEMORY"
                    );
                    collided.push(ptr);
                    break Err(CuError(cu::OUT_OF_MEMORY));
                }
            }
        };
        for p in collided {
            let _ = self.rpc.rm_mem_free(&RmPtrArgs { ctx, ptr: p });
        }
        result
    }

    /// `cuMemAlloc`: the device address, with the same range reserved in this process.
    pub fn mem_alloc(&self, ctx: RmHandle, bytesize: u64) -> CuResult<u64> {
        if bytesize == 0 {
            return Err(CuError(cu::INVALID_VALUE));
        }
        self.alloc_reserved(ctx, || {
            let ptr = u64r(call!(self.rm_mem_alloc(&RmAllocArgs { ctx, bytesize }))?)?;
            Ok((ptr, bytesize, ()))
        })
        .map(|(ptr, ())| ptr)
    }

    /// `cuMemAllocPitch`: (pointer, pitch).
    pub fn mem_alloc_pitch(
        &self,
        ctx: RmHandle,
        width_bytes: u64,
        height: u64,
        element_size: u32,
    ) -> CuResult<(u64, u64)> {
        if width_bytes == 0 || height == 0 || ![4, 8, 16].contains(&element_size) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        self.alloc_reserved(ctx, || {
            match call!(self.rm_mem_alloc_pitch(&RmAllocPitchArgs {
                ctx,
                width_bytes,
                height,
                element_size
            }))? {
                RmPitchedReply::Case0(a) => Ok((a.ptr, a.pitch.saturating_mul(height), a.pitch)),
                RmPitchedReply::Default { discriminant } => Err(CuError(nonzero(discriminant))),
            }
        })
    }

    /// `cuMemFree`: frees on the server, then releases the reservation.
    pub fn mem_free(&self, ctx: RmHandle, ptr: u64) -> CuResult<()> {
        CuError::check(call!(self.rm_mem_free(&RmPtrArgs { ctx, ptr }))?)?;
        self.va.release(ptr);
        Ok(())
    }

    /// `cuMemGetInfo`: (free, total).
    pub fn mem_get_info(&self, ctx: RmHandle) -> CuResult<(u64, u64)> {
        match call!(self.rm_mem_get_info(&ctx))? {
            RmMemInfoReply::Case0(i) => Ok((i.free_bytes, i.total_bytes)),
            RmMemInfoReply::Default { discriminant } => Err(CuError(nonzero(discriminant))),
        }
    }

    /// `cuMemGetAddressRange`: (base, size).
    pub fn mem_get_address_range(&self, ctx: RmHandle, ptr: u64) -> CuResult<(u64, u64)> {
        match call!(self.rm_mem_get_address_range(&RmPtrArgs { ctx, ptr }))? {
            RmRangeReply::Case0(r) => Ok((r.base, r.size)),
            RmRangeReply::Default { discriminant } => Err(CuError(nonzero(discriminant))),
        }
    }

    /// Classifies a pointer as host or device (unified addressing), locally.
    pub fn pointer_kind(&self, ptr: u64) -> PointerKind {
        match self.va.find(ptr) {
            Some((base, r)) => PointerKind::Device {
                base,
                size: r.size,
                ctx: r.ctx,
                buffer_id: r.buffer_id,
            },
            None => match self.host.find(ptr) {
                Some(r) => PointerKind::HostTracked(r),
                None => PointerKind::Host,
            },
        }
    }

    /// The client's host memory (`cuMemHostAlloc`, `cuMemHostRegister`).
    pub fn host_memory(&self) -> &HostMem {
        &self.host
    }

    /// Maps a [`StreamRef`] to a protocol handle; the per-thread stream is created on first
    /// use by each client thread (flags 0, priority 0).
    ///
    /// Approximation: CUDA's per-thread default stream synchronizes with the legacy stream
    /// like a blocking stream and lives as long as its thread; here it is an ordinary
    /// blocking stream created per (client thread, context) and destroyed with the context
    /// or the session, not when the thread exits.
    pub fn stream_handle(&self, ctx: RmHandle, s: StreamRef) -> CuResult<RmHandle> {
        match s {
            StreamRef::Legacy => Ok(u64::from(RM_STREAM_LEGACY)),
            StreamRef::Handle(h) => Ok(h),
            StreamRef::PerThread => {
                let key = (std::thread::current().id(), ctx);
                if let Some(h) = lock(&self.per_thread).get(&key) {
                    return Ok(*h);
                }
                let h = self.stream_create(ctx, 0, 0)?;
                lock(&self.per_thread).insert(key, h);
                Ok(h)
            }
        }
    }

    /// Delivers the copies of a sync reply to their sinks, then returns its status
    /// ([`Delivery::finish`]).
    pub fn finish_sync(&self, reply: RmSyncReply) -> CuResult<()> {
        self.delivery.finish(reply)
    }

    /// After a call that makes the driver flush device-side printf output but replies only a
    /// status (context destroy, primary context release and reset, module unload): fetches the
    /// output captured by now and writes it to standard output (revision 4; best effort).
    fn take_device_output(&self) {
        if self.welcome.revision < 4 {
            return;
        }
        match call!(self.rm_device_output_take()) {
            Ok(data) => crate::stdout::write_device_output(&data),
            Err(e) => tracing::debug!("remora: device output not fetched: {e}"),
        }
    }

    /// The copy-id mark: copies issued before now have smaller ids.
    fn copy_mark(&self) -> u64 {
        self.delivery.mark()
    }

    /// After a successful synchronizing call on (`ctx`, `stream`) that began at `mark`: waits
    /// until every asynchronous copy CUDA says it completed has been written
    /// ([`Delivery::settle`]).
    fn settle_stream(&self, ctx: RmHandle, stream: RmHandle, mark: u64) -> CuResult<()> {
        self.delivery
            .settle(&self.delivery.frontier(ctx, stream, mark), Fetch::Collect)
    }

    /// Number of asynchronous device-to-host copies not yet delivered.
    pub fn pending_copies(&self) -> usize {
        self.delivery.pending()
    }

    /// Bytes of the shared data area this session copies through (0: none, the copies travel
    /// inside the calls).
    pub fn data_area_size(&self) -> u64 {
        self.area.as_ref().map_or(0, |a| a.len())
    }

    /// Bytes this client has copied into or out of the shared data area so far (0 without
    /// one). Copies whose host side is zero-copy pinned memory add nothing.
    pub fn area_bytes_copied(&self) -> u64 {
        self.area.as_ref().map_or(0, |a| a.copied_bytes())
    }

    /// Bytes of the shared data area free now (0 without one).
    pub fn area_free_bytes(&self) -> u64 {
        self.area.as_ref().map_or(0, |a| a.free_bytes())
    }

    /// The offset in the data area of `len` bytes of host memory at `host`, when they lie
    /// entirely inside one live `cuMemHostAlloc` allocation that the area holds.
    pub fn pinned_offset(&self, host: u64, len: u64) -> Option<u64> {
        self.area.as_ref()?;
        self.host.area_offset(host, len)
    }

    /// `cuMemFreeHost`. Natively it synchronizes the device first; for an allocation in the
    /// data area that matters, because the space may be handed out again at once: its
    /// context is synchronized first, so that no copy into it is still in flight.
    pub fn mem_free_host(&self, ptr: u64) -> CuResult<()> {
        if let Some(r) = self.host.find(ptr).filter(|r| r.base == ptr)
            && r.area_offset.is_some()
            && r.ctx != 0
            && let Err(e) = self.ctx_synchronize(r.ctx)
        {
            tracing::debug!("remora: cuMemFreeHost: synchronizing the context failed: {e}");
        }
        self.deliver_pending("cuMemFreeHost");
        self.host.free(ptr)
    }

    /// `cuMemHostUnregister`: like the native call, waits for the asynchronous copies still
    /// pending (their bytes land before the memory stops being registered).
    pub fn mem_host_unregister(&self, ptr: u64) -> CuResult<()> {
        self.deliver_pending("cuMemHostUnregister");
        self.host.unregister(ptr)
    }

    /// Synchronizes every context with asynchronous copies pending, so that their bytes are
    /// written before host memory goes away (`cuMemFreeHost`, `cuMemHostUnregister`, which
    /// synchronize natively).
    fn deliver_pending(&self, what: &str) {
        for ctx in self.delivery.pending_in(None) {
            if let Err(e) = self.ctx_synchronize(ctx) {
                tracing::debug!("remora: {what}: synchronizing context {ctx} failed: {e}");
            }
        }
    }

    /// The `(relative offset, size)` pieces of a zero-copy copy of `size` bytes, each within
    /// one copy's bound.
    fn pinned_pieces(size: u64) -> impl Iterator<Item = (u64, u64)> {
        let max = u64::from(RM_MAX_COPY);
        (0..size.div_ceil(max)).map(move |i| (i * max, max.min(size - i * max)))
    }

    /// `cuMemcpyHtoD[Async]` from zero-copy pinned memory: `size` bytes at `host`, which must
    /// lie inside one live allocation in the data area (`CUDA_ERROR_INVALID_VALUE`
    /// otherwise, e.g. after `cuMemFreeHost`). Only `(offset, size)` travels; the server
    /// reads the bytes where they are. `asynchronous`: on `stream`, errors deferred.
    pub fn memcpy_htod_pinned(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        dst: u64,
        host: u64,
        size: u64,
        asynchronous: bool,
    ) -> CuResult<()> {
        let offset = self
            .pinned_offset(host, size)
            .ok_or(CuError(cu::INVALID_VALUE))?;
        if asynchronous {
            self.not_captured(stream, "an asynchronous host-to-device copy")?;
        }
        for (rel, len) in Self::pinned_pieces(size) {
            let a = RmAreaCopyArgs {
                ctx,
                stream,
                dev: dst + rel,
                offset: offset + rel,
                size: len,
                copy_id: if asynchronous { AREA_PINNED_SOURCE } else { 0 },
            };
            if asynchronous {
                call!(self.rm_area_memcpy_htod_async(&a))?;
            } else {
                self.finish_sync(call!(self.rm_area_memcpy_htod(&a))?)?;
            }
        }
        Ok(())
    }

    /// `cuMemcpyDtoH[Async]` into zero-copy pinned memory: `size` bytes at `host`, which must
    /// lie inside one live allocation in the data area (`CUDA_ERROR_INVALID_VALUE`
    /// otherwise). The server writes the bytes straight there. Synchronous: they are there
    /// when this returns. Asynchronous (one-way, copy id 0: no delivery): they are there
    /// once the stream's work up to the copy has completed, i.e. when the synchronize, event
    /// or query that CUDA defines says so; no pending copy is recorded on the client.
    pub fn memcpy_dtoh_pinned(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        src: u64,
        host: u64,
        size: u64,
        asynchronous: bool,
    ) -> CuResult<()> {
        let offset = self
            .pinned_offset(host, size)
            .ok_or(CuError(cu::INVALID_VALUE))?;
        if asynchronous {
            self.not_captured(stream, "an asynchronous device-to-host copy")?;
        }
        let mark = self.copy_mark();
        for (rel, len) in Self::pinned_pieces(size) {
            let a = RmAreaCopyArgs {
                ctx,
                stream,
                dev: src + rel,
                offset: offset + rel,
                size: len,
                copy_id: 0,
            };
            if asynchronous {
                call!(self.rm_area_memcpy_dtoh_async(&a))?;
            } else {
                self.finish_sync(call!(self.rm_area_memcpy_dtoh(&a))?)?;
            }
        }
        if asynchronous {
            return Ok(());
        }
        self.settle_stream(ctx, stream, mark)
    }

    /// Staging space for a copy of `total` bytes through the data area: one lease, or two
    /// used alternately when the copy takes several chunks, and the chunk size. `None` when
    /// the session has no area or no room now (the copy then travels inside the calls).
    fn area_staging(&self, total: usize) -> Option<(Vec<Lease>, usize)> {
        let alloc = self.area.as_ref()?;
        if total == 0 {
            return None;
        }
        let max_chunk = (alloc.len() / 4).clamp(4096, AREA_CHUNK as u64) as usize;
        // The largest chunk that fits now: halve down to MIN_AREA_CHUNK while the area is
        // busy (pinned allocations, other threads' copies) before sending the data inside
        // the calls, which is several times slower.
        let mut chunk = total.min(max_chunk);
        loop {
            let n = if total > chunk { 2 } else { 1 };
            let leases: Option<Vec<Lease>> =
                (0..n).map(|_| alloc.alloc(chunk as u64, 4096)).collect();
            if let Some(l) = leases {
                return Some((l, chunk));
            }
            let floor = MIN_AREA_CHUNK.min(max_chunk / 4).max(4096);
            if chunk <= floor {
                return None;
            }
            chunk = (chunk / 2).max(floor);
        }
    }

    /// A host-to-device copy through the data area, chunk by chunk: while the server copies
    /// chunk i out of one lease, this thread fills the other with chunk i + 1. `asynchronous`:
    /// `RM_AREA_MEMCPY_HTOD_ASYNC` on `stream` (errors deferred), else the synchronous form.
    fn area_htod(
        &self,
        args: RmAreaCopyArgs,
        data: &[u8],
        staging: &[Lease],
        chunk: usize,
        asynchronous: bool,
    ) -> CuResult<()> {
        let one = |a: RmAreaCopyArgs| -> CuResult<()> {
            if asynchronous {
                call!(self.rm_area_memcpy_htod_async(&a))
            } else {
                self.finish_sync(call!(self.rm_area_memcpy_htod(&a))?)
            }
        };
        let joined = |h: std::thread::ScopedJoinHandle<'_, CuResult<()>>| {
            h.join().unwrap_or(Err(CuError(cu::UNKNOWN)))
        };
        std::thread::scope(|s| {
            let mut inflight = None;
            for (i, off) in (0..data.len()).step_by(chunk).enumerate() {
                let len = chunk.min(data.len() - off);
                let lease = &staging[i % staging.len()];
                // The lease's previous chunk (i - 2) was answered: the server is done with it.
                if !lease.put(&data[off..off + len]) {
                    return Err(CuError(cu::UNKNOWN));
                }
                if let Some(h) = inflight.take() {
                    joined(h)?;
                }
                let a = RmAreaCopyArgs {
                    dev: args.dev + off as u64,
                    offset: lease.offset(),
                    size: len as u64,
                    ..args.clone()
                };
                if data.len() <= chunk {
                    return one(a);
                }
                inflight = Some(s.spawn(move || one(a)));
            }
            inflight.map_or(Ok(()), joined)
        })
    }

    /// A synchronous device-to-host copy through the data area: the server writes chunk i + 1
    /// into one lease while this thread copies chunk i out of the other.
    fn area_dtoh(
        &self,
        args: RmAreaCopyArgs,
        out: &mut [u8],
        staging: &[Lease],
        chunk: usize,
    ) -> CuResult<()> {
        let total = out.len();
        let issue = |i: usize| {
            let off = i * chunk;
            let a = RmAreaCopyArgs {
                dev: args.dev + off as u64,
                offset: staging[i % staging.len()].offset(),
                size: chunk.min(total - off) as u64,
                ..args.clone()
            };
            move || -> CuResult<()> { self.finish_sync(call!(self.rm_area_memcpy_dtoh(&a))?) }
        };
        let n = total.div_ceil(chunk);
        if n == 1 {
            issue(0)()?;
            return if staging[0].get(out) {
                Ok(())
            } else {
                Err(CuError(cu::UNKNOWN))
            };
        }
        std::thread::scope(|s| {
            let mut inflight = Some(s.spawn(issue(0)));
            for (i, part) in out.chunks_mut(chunk).enumerate() {
                if let Some(h) = inflight.take() {
                    h.join().unwrap_or(Err(CuError(cu::UNKNOWN)))?;
                }
                if i + 1 < n {
                    // Into the other lease, whose chunk (i - 1) has been copied out.
                    inflight = Some(s.spawn(issue(i + 1)));
                }
                if !staging[i % staging.len()].get(part) {
                    return Err(CuError(cu::UNKNOWN));
                }
            }
            Ok(())
        })
    }

    /// `cuMemcpyHtoD` (synchronous).
    pub fn memcpy_htod(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        dst: u64,
        data: &[u8],
    ) -> CuResult<()> {
        let (host, size) = (data.as_ptr() as u64, data.len() as u64);
        if size > 0 && self.pinned_offset(host, size).is_some() {
            return self.memcpy_htod_pinned(ctx, stream, dst, host, size, false);
        }
        if let Some((staging, chunk)) = self.area_staging(data.len()) {
            let args = area_args(ctx, stream, dst);
            return self.area_htod(args, data, &staging, chunk, false);
        }
        for (off, len) in chunks(data.len()) {
            let r = call!(self.rm_memcpy_htod(&RmHtodArgs {
                ctx,
                stream,
                dst: dst + off as u64,
                data: Bytes::copy_from_slice(&data[off..off + len])
            }))?;
            self.finish_sync(r)?;
        }
        Ok(())
    }

    /// `cuMemcpyDtoH` (synchronous) into `out`. Like every synchronizing call, its reply
    /// also delivers the asynchronous copies completed by then.
    pub fn memcpy_dtoh(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        src: u64,
        out: &mut [u8],
    ) -> CuResult<()> {
        let (host, size) = (out.as_mut_ptr() as u64, out.len() as u64);
        if size > 0 && self.pinned_offset(host, size).is_some() {
            return self.memcpy_dtoh_pinned(ctx, stream, src, host, size, false);
        }
        let mark = self.copy_mark();
        if let Some((staging, chunk)) = self.area_staging(out.len()) {
            self.area_dtoh(area_args(ctx, stream, src), out, &staging, chunk)?;
            return self.settle_stream(ctx, stream, mark);
        }
        for (off, len) in chunks(out.len()) {
            let r = call!(self.rm_memcpy_dtoh(&RmDtohArgs {
                ctx,
                stream,
                src: src + off as u64,
                size: len as u64,
                copy_id: 0
            }))?;
            self.finish_sync(RmSyncReply {
                status: r.status,
                copies: r.copies,
            })?;
            if r.data.len() != len {
                tracing::error!("remora: DtoH of {len} bytes returned {}", r.data.len());
                return Err(CuError(cu::UNKNOWN));
            }
            out[off..off + len].copy_from_slice(&r.data);
        }
        self.settle_stream(ctx, stream, mark)
    }

    /// `cuMemcpyDtoD` (synchronous).
    pub fn memcpy_dtod(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        dst: u64,
        src: u64,
        size: u64,
    ) -> CuResult<()> {
        let r = call!(self.rm_memcpy_dtod(&RmDtodArgs {
            ctx,
            stream,
            dst,
            src,
            size
        }))?;
        self.finish_sync(r)
    }

    /// `cuMemsetD8/16/32` (synchronous).
    pub fn memset(&self, args: &RmMemsetArgs) -> CuResult<()> {
        if ![1, 2, 4].contains(&args.element_size) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let r = call!(self.rm_memset(args))?;
        self.finish_sync(r)
    }

    /// `cuMemcpyHtoDAsync`: one-way, the data travels with the call.
    pub fn memcpy_htod_async(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        dst: u64,
        data: &[u8],
    ) -> CuResult<()> {
        let (host, size) = (data.as_ptr() as u64, data.len() as u64);
        if size > 0 && self.pinned_offset(host, size).is_some() {
            return self.memcpy_htod_pinned(ctx, stream, dst, host, size, true);
        }
        self.not_captured(stream, "an asynchronous host-to-device copy")?;
        if data.len() >= AREA_ASYNC_MIN
            && let Some((staging, chunk)) = self.area_staging(data.len())
        {
            let args = area_args(ctx, stream, dst);
            return self.area_htod(args, data, &staging, chunk, true);
        }
        for (off, len) in chunks(data.len()) {
            call!(self.rm_memcpy_htod_async(&RmHtodArgs {
                ctx,
                stream,
                dst: dst + off as u64,
                data: Bytes::copy_from_slice(&data[off..off + len])
            }))?;
        }
        Ok(())
    }

    /// `cuMemcpyDtoHAsync`: one-way; `sink` gets the data when a later synchronizing call's
    /// reply carries it.
    pub fn memcpy_dtoh_async(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        src: u64,
        size: u64,
        sink: CopySink,
    ) -> CuResult<()> {
        let total = usize::try_from(size).map_err(|_| CuError(cu::INVALID_VALUE))?;
        self.not_captured(stream, "an asynchronous device-to-host copy")?;
        if total <= COPY_CHUNK {
            return self.memcpy_dtoh_async_one(ctx, stream, src, size, sink);
        }
        let n = total.div_ceil(COPY_CHUNK);
        let state = Arc::new(Mutex::new(ChunkedSink {
            buf: vec![0; total],
            remaining: n,
            sink: Some(sink),
        }));
        for (off, len) in chunks(total) {
            let state = Arc::clone(&state);
            let part: CopySink = Box::new(move |data: &[u8]| {
                let mut st = lock(&state);
                let end = (off + data.len()).min(st.buf.len());
                st.buf[off..end].copy_from_slice(&data[..end - off]);
                st.remaining -= 1;
                if st.remaining == 0
                    && let Some(sink) = st.sink.take()
                {
                    sink(&st.buf);
                }
            });
            self.memcpy_dtoh_async_one(ctx, stream, src + off as u64, len as u64, part)?;
        }
        Ok(())
    }

    fn memcpy_dtoh_async_one(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        src: u64,
        size: u64,
        sink: CopySink,
    ) -> CuResult<()> {
        let lease = self
            .area
            .as_ref()
            .filter(|_| size as usize >= AREA_ASYNC_MIN)
            .and_then(|a| a.alloc(size, 4096));
        if let Some(lease) = lease {
            // The server writes the bytes into the lease; the delivery says they are there.
            let offset = lease.offset();
            let len = size as usize;
            let from_area: CopySink = Box::new(move |_: &[u8]| {
                let mut buf = vec![0u8; len];
                if !lease.get(&mut buf) {
                    tracing::error!("remora: an area copy's lease is smaller than the copy");
                }
                sink(&buf);
            });
            let copy_id = self.delivery.register(ctx, stream, from_area);
            let r = call!(self.rm_area_memcpy_dtoh_async(&RmAreaCopyArgs {
                ctx,
                stream,
                dev: src,
                offset,
                size,
                copy_id
            }));
            if r.is_err() {
                self.delivery.forget(copy_id);
            }
            return r;
        }
        let copy_id = self.delivery.register(ctx, stream, sink);
        let r = call!(self.rm_memcpy_dtoh_async(&RmDtohArgs {
            ctx,
            stream,
            src,
            size,
            copy_id
        }));
        if r.is_err() {
            self.delivery.forget(copy_id);
        }
        r
    }

    /// `cuMemcpyDtoDAsync`: one-way.
    pub fn memcpy_dtod_async(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        dst: u64,
        src: u64,
        size: u64,
    ) -> CuResult<()> {
        call!(self.rm_memcpy_dtod_async(&RmDtodArgs {
            ctx,
            stream,
            dst,
            src,
            size
        }))
    }

    /// `cuMemsetD*Async`: one-way.
    pub fn memset_async(&self, args: &RmMemsetArgs) -> CuResult<()> {
        if ![1, 2, 4].contains(&args.element_size) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        call!(self.rm_memset_async(args))
    }

    // 2-D, 3-D and peer copies --------------------------------------------------------------

    /// CUDA_ERROR_NOT_SUPPORTED (logged) when the server speaks a revision older than `rev`.
    fn need_revision(&self, rev: u32, what: &str) -> CuResult<()> {
        if self.welcome.revision >= rev {
            return Ok(());
        }
        tracing::warn!(
            "remora: {what} needs protocol revision {rev}; the server speaks {} (upgrade it); returning CUDA_ERROR_NOT_SUPPORTED",
            self.welcome.revision
        );
        Err(CuError(cu::NOT_SUPPORTED))
    }

    /// Checks a 2-D or 3-D copy locally, as CUDA does synchronously: the extent does not
    /// overflow, pitches are at least the width, host buffers hold the whole region, 2-D
    /// copies are flat. `Ok(false)` when there is nothing to copy.
    fn check_3d(p: &Copy3dParams, src: &CopySrc<'_>, dst: &CopyDst<'_>) -> CuResult<bool> {
        let e = &p.extent;
        e.bytes().ok_or(CuError(cu::INVALID_VALUE))?;
        let (sl, dl) = (src_layout(src), dst_layout(dst));
        if p.form != RmCopyForm::RmCopy3D && (e.depth > 1 || sl.z != 0 || dl.z != 0) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        if e.is_empty() {
            return Ok(false);
        }
        sl.span(e)?;
        let (_, dend) = dl.span(e)?;
        if let CopySrc::Host { base, layout } = src
            && layout.span(e)?.1 > base.len() as u64
        {
            return Err(CuError(cu::INVALID_VALUE));
        }
        if let CopyDst::Host { base, .. } = dst
            && dend > base.len() as u64
        {
            return Err(CuError(cu::INVALID_VALUE));
        }
        Ok(true)
    }

    /// The wire description of band `b` of a copy; also the packed source when it is host
    /// memory.
    fn band_args(
        p: &Copy3dParams,
        src: &CopySrc<'_>,
        dst: &CopyDst<'_>,
        b: &Band,
    ) -> CuResult<RmMemcpy3dArgs> {
        let (src_ctx, dst_ctx) = p.peer.unwrap_or((0, 0));
        let side = |ptr: Option<u64>, l: &Layout, ctx: RmHandle| match ptr {
            Some(ptr) => {
                let l = l.band(b);
                RmMemcpy3dSide {
                    kind: RmMemKind::RmMemDevice,
                    ptr,
                    pitch: l.pitch,
                    height: l.height,
                    x_bytes: l.x,
                    y: l.y,
                    z: l.z,
                    ctx,
                }
            }
            None => RmMemcpy3dSide {
                kind: RmMemKind::RmMemHostPacked,
                ptr: 0,
                pitch: b.extent.width,
                height: b.extent.height,
                x_bytes: 0,
                y: 0,
                z: 0,
                ctx,
            },
        };
        let (src_side, data) = match src {
            CopySrc::Device { ptr, layout } => (side(Some(*ptr), layout, src_ctx), Bytes::new()),
            CopySrc::Host { base, layout } => (
                side(None, layout, src_ctx),
                Bytes::from(copy3d::pack(base, &layout.band(b), &b.extent)?),
            ),
        };
        let dst_side = match dst {
            CopyDst::Device { ptr, layout } => side(Some(*ptr), layout, dst_ctx),
            CopyDst::Host { layout, .. } | CopyDst::Later { layout, .. } => {
                side(None, layout, dst_ctx)
            }
        };
        Ok(RmMemcpy3dArgs {
            desc: RmMemcpy3dDesc {
                form: p.form,
                ctx: p.ctx,
                stream: p.stream,
                src: src_side,
                dst: dst_side,
                width_bytes: b.extent.width,
                height: b.extent.height,
                depth: b.extent.depth,
            },
            data,
            copy_id: 0,
        })
    }

    /// A copy from host memory to host memory, done here.
    fn copy_3d_host(p: &Copy3dParams, src: &CopySrc<'_>, dst: CopyDst<'_>) -> CuResult<()> {
        let CopySrc::Host { base, layout } = src else {
            return Err(CuError(cu::INVALID_VALUE));
        };
        let packed = copy3d::pack(base, layout, &p.extent)?;
        match dst {
            CopyDst::Host { base, layout } => copy3d::unpack(&packed, base, &layout, &p.extent),
            CopyDst::Later { layout, sink } => {
                sink(&layout, &p.extent, &packed);
                Ok(())
            }
            CopyDst::Device { .. } => Err(CuError(cu::INVALID_VALUE)),
        }
    }

    /// `cuMemcpy2D(Unaligned)`, `cuMemcpy3D`, `cuMemcpy3DPeer` (synchronous). Host-to-host
    /// copies are done here; others travel in bands of at most 32 MiB, host sources packed,
    /// host destinations returned packed and scattered here. Like every synchronous copy to
    /// host memory, it also delivers the asynchronous copies pending on `p.stream`.
    pub fn memcpy_3d(
        &self,
        p: &Copy3dParams,
        src: CopySrc<'_>,
        mut dst: CopyDst<'_>,
    ) -> CuResult<()> {
        if !Self::check_3d(p, &src, &dst)? {
            return Ok(());
        }
        let host_src = matches!(src, CopySrc::Host { .. });
        let host_dst = !matches!(dst, CopyDst::Device { .. });
        if host_src && host_dst {
            return Self::copy_3d_host(p, &src, dst);
        }
        self.need_revision(3, "a 2-D or 3-D copy")?;
        let mark = self.copy_mark();
        for b in copy3d::bands(&p.extent, COPY_CHUNK as u64) {
            let args = Self::band_args(p, &src, &dst, &b)?;
            let r = if p.peer.is_some() {
                call!(self.rm_memcpy_3_d_peer(&args))?
            } else {
                call!(self.rm_memcpy_3_d(&args))?
            };
            self.finish_sync(RmSyncReply {
                status: r.status,
                copies: r.copies,
            })?;
            let want = b.extent.bytes().unwrap_or(0);
            match &mut dst {
                CopyDst::Device { .. } => {}
                _ if r.data.len() as u64 != want => {
                    tracing::error!(
                        "remora: a 2-D/3-D copy of {want} bytes returned {}",
                        r.data.len()
                    );
                    return Err(CuError(cu::UNKNOWN));
                }
                CopyDst::Host { base, layout } => {
                    copy3d::unpack(&r.data, base, &layout.band(&b), &b.extent)?;
                }
                CopyDst::Later { layout, sink } => sink(&layout.band(&b), &b.extent, &r.data),
            }
        }
        if host_dst {
            self.settle_stream(p.ctx, p.stream, mark)?;
        }
        Ok(())
    }

    /// `cuMemcpy2DAsync`, `cuMemcpy3DAsync`, `cuMemcpy3DPeerAsync`: one-way, in bands like
    /// [`Session::memcpy_3d`]. A host destination must be [`CopyDst::Later`]: its sink gets
    /// each band when a later synchronizing call's reply carries it. Host-to-host copies are
    /// done at once.
    pub fn memcpy_3d_async(
        &self,
        p: &Copy3dParams,
        src: CopySrc<'_>,
        dst: CopyDst<'_>,
    ) -> CuResult<()> {
        if p.form == RmCopyForm::RmCopy2DUnaligned || matches!(dst, CopyDst::Host { .. }) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        if !Self::check_3d(p, &src, &dst)? {
            return Ok(());
        }
        if matches!(src, CopySrc::Host { .. }) && !matches!(dst, CopyDst::Device { .. }) {
            return Self::copy_3d_host(p, &src, dst);
        }
        self.need_revision(3, "a 2-D or 3-D copy")?;
        if matches!(src, CopySrc::Host { .. }) || matches!(dst, CopyDst::Later { .. }) {
            self.not_captured(
                p.stream,
                "an asynchronous 2-D or 3-D copy to or from host memory",
            )?;
        }
        for b in copy3d::bands(&p.extent, COPY_CHUNK as u64) {
            let mut args = Self::band_args(p, &src, &dst, &b)?;
            let mut issued = None;
            if let CopyDst::Later { layout, sink } = &dst {
                let (sink, layout, extent) = (Arc::clone(sink), layout.band(&b), b.extent);
                let copy_id = self.delivery.register(
                    p.ctx,
                    p.stream,
                    Box::new(move |data: &[u8]| sink(&layout, &extent, data)),
                );
                args.copy_id = copy_id;
                issued = Some(copy_id);
            }
            let r = if p.peer.is_some() {
                call!(self.rm_memcpy_3_d_peer_async(&args))
            } else {
                call!(self.rm_memcpy_3_d_async(&args))
            };
            if r.is_err()
                && let Some(id) = issued
            {
                self.delivery.forget(id);
            }
            r?;
        }
        Ok(())
    }

    fn peer_args(
        ctx: RmHandle,
        stream: RmHandle,
        (dst, dst_ctx): (u64, RmHandle),
        (src, src_ctx): (u64, RmHandle),
        size: u64,
    ) -> RmMemcpyPeerArgs {
        RmMemcpyPeerArgs {
            ctx,
            stream,
            dst,
            dst_ctx,
            src,
            src_ctx,
            size,
        }
    }

    /// `cuMemcpyPeer` (synchronous): `dst` and `src` are (pointer, context); `ctx` is the
    /// calling context.
    pub fn memcpy_peer(
        &self,
        ctx: RmHandle,
        dst: (u64, RmHandle),
        src: (u64, RmHandle),
        size: u64,
    ) -> CuResult<()> {
        self.need_revision(3, "cuMemcpyPeer")?;
        let r = call!(self.rm_memcpy_peer(&Self::peer_args(
            ctx,
            u64::from(RM_STREAM_LEGACY),
            dst,
            src,
            size
        )))?;
        self.finish_sync(r)
    }

    /// `cuMemcpyPeerAsync`: one-way.
    pub fn memcpy_peer_async(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        dst: (u64, RmHandle),
        src: (u64, RmHandle),
        size: u64,
    ) -> CuResult<()> {
        self.need_revision(3, "cuMemcpyPeerAsync")?;
        call!(self.rm_memcpy_peer_async(&Self::peer_args(ctx, stream, dst, src, size)))
    }

    // Modules ------------------------------------------------------------------------------

    /// Loads a kernel image: sends its SHA-256 first and the bytes only if the server asks
    /// (`RM_NEED_IMAGE`). The function list and parameter layouts are cached.
    pub fn module_load(&self, ctx: RmHandle, image: &[u8]) -> CuResult<Arc<ModuleInfo>> {
        if image.is_empty() || image.len() > RM_MAX_IMAGE as usize {
            return Err(CuError(cu::INVALID_IMAGE));
        }
        let hash: [u8; 32] = Sha256::digest(image).into();
        let mut args = RmModuleLoadArgs {
            ctx,
            hash,
            image: Bytes::new(),
        };
        let mut reply = call!(self.rm_module_load(&args))?;
        if reply == RmLoadReply::RmNeedImage {
            args.image = Bytes::copy_from_slice(image);
            reply = call!(self.rm_module_load(&args))?;
        }
        let m = match reply {
            RmLoadReply::RmLoaded(m) => m,
            RmLoadReply::RmLoadFailed(e) => return Err(CuError(nonzero(e))),
            RmLoadReply::RmNeedImage => {
                tracing::error!("remora: the server asked for the image again after receiving it");
                return Err(CuError(cu::UNKNOWN));
            }
        };
        let mut functions = HashMap::new();
        {
            let mut by_handle = lock(&self.functions);
            for f in m.functions {
                let info = Arc::new(FunctionInfo {
                    c_name: std::ffi::CString::new(f.name.replace('\0', "")).unwrap_or_default(),
                    name: f.name.clone(),
                    handle: f.function,
                    params: f.params,
                    module: m.module,
                });
                by_handle.insert(f.function, Arc::clone(&info));
                functions.insert(f.name, info);
            }
        }
        let info = Arc::new(ModuleInfo {
            handle: m.module,
            ctx,
            functions,
        });
        lock(&self.modules).insert(m.module, Arc::clone(&info));
        Ok(info)
    }

    /// `cuModuleUnload`; forgets the cached functions.
    pub fn module_unload(&self, module: RmHandle) -> CuResult<()> {
        let r = call!(self.rm_module_unload(&module))?;
        self.take_device_output();
        CuError::check(r)?;
        if let Some(m) = lock(&self.modules).remove(&module) {
            let mut f = lock(&self.functions);
            let mut attrs = lock(&self.func_attrs);
            for info in m.functions.values() {
                f.remove(&info.handle);
                attrs.retain(|(h, _), _| *h != info.handle);
            }
        }
        Ok(())
    }

    /// A loaded module, from the cache.
    pub fn module(&self, module: RmHandle) -> Option<Arc<ModuleInfo>> {
        lock(&self.modules).get(&module).cloned()
    }

    /// A function of a loaded module, from the cache.
    pub fn function(&self, function: RmHandle) -> Option<Arc<FunctionInfo>> {
        lock(&self.functions).get(&function).cloned()
    }

    /// `cuModuleGetGlobal`: (pointer, size).
    pub fn module_get_global(&self, module: RmHandle, name: &str) -> CuResult<(u64, u64)> {
        match call!(self.rm_module_get_global(&RmGetGlobalArgs {
            module,
            name: name.to_owned()
        }))? {
            RmGlobalReply::RmLoaded(g) => Ok((g.ptr, g.size)),
            RmGlobalReply::Default { value, .. } => Err(CuError(nonzero(value))),
        }
    }

    /// `cuFuncGetAttribute`. The attributes fixed at load time (0..=7) and the two that only
    /// `cuFuncSetAttribute` changes (8, 9) are cached.
    pub fn func_get_attribute(&self, function: RmHandle, attribute: i32) -> CuResult<i32> {
        let cacheable = (0..=9).contains(&attribute);
        if cacheable && let Some(v) = lock(&self.func_attrs).get(&(function, attribute)) {
            return Ok(*v);
        }
        let v = int(call!(self.rm_func_get_attribute(&RmFuncAttrArgs {
            function,
            attribute,
            value: 0
        }))?)?;
        if cacheable {
            lock(&self.func_attrs).insert((function, attribute), v);
        }
        Ok(v)
    }

    /// `cuFuncSetAttribute`.
    pub fn func_set_attribute(
        &self,
        function: RmHandle,
        attribute: i32,
        value: i32,
    ) -> CuResult<()> {
        let r = CuError::check(call!(self.rm_func_set_attribute(&RmFuncAttrArgs {
            function,
            attribute,
            value
        }))?);
        // Forget the cached value either way: the next get asks the server.
        lock(&self.func_attrs).remove(&(function, attribute));
        r
    }

    /// `cuFuncSetCacheConfig`.
    pub fn func_set_cache_config(&self, function: RmHandle, config: u32) -> CuResult<()> {
        CuError::check(call!(self.rm_func_set_cache_config(&RmHandleFlags {
            handle: function,
            flags: config
        }))?)
    }

    /// `cuOccupancyMaxActiveBlocksPerMultiprocessor(WithFlags)`.
    pub fn occupancy_max_active_blocks(
        &self,
        function: RmHandle,
        block_size: i32,
        dynamic_smem_bytes: u64,
        flags: u32,
    ) -> CuResult<i32> {
        int(call!(self.rm_occupancy_max_active_blocks(
            &RmOccupancyArgs {
                function,
                block_size,
                dynamic_smem_bytes,
                flags
            }
        ))?)
    }

    /// `cuOccupancyMaxActiveClusters`: `args` is the launch configuration (params unused).
    pub fn occupancy_max_active_clusters(&self, args: &RmLaunchArgs) -> CuResult<i32> {
        int(call!(self.rm_occupancy_max_active_clusters(args))?)
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

    /// `cuLaunchKernel`: one-way; `params` already packed (see [`crate::params`]).
    pub fn launch(&self, args: &RmLaunchArgs) -> CuResult<()> {
        call!(self.rm_launch_kernel(args))
    }

    // Libraries ----------------------------------------------------------------------------

    /// `cuLibraryLoadData`: keeps a copy of the image; loads it at once in `ctx` if given
    /// (so a bad image fails here), else in each context on first use. Returns the library id.
    pub fn library_load(&self, ctx: Option<RmHandle>, image: &[u8]) -> CuResult<u64> {
        if image.is_empty() || image.len() > RM_MAX_IMAGE as usize {
            return Err(CuError(cu::INVALID_IMAGE));
        }
        let loaded = match ctx {
            Some(ctx) => Some((ctx, self.module_load(ctx, image)?)),
            None => None,
        };
        Ok(self.libraries.add(image, loaded))
    }

    /// The module of library `lib` in context `ctx` (`cuLibraryGetModule`), loaded on first use.
    pub fn library_module(&self, lib: u64, ctx: RmHandle) -> CuResult<Arc<ModuleInfo>> {
        self.libraries.module(
            lib,
            ctx,
            |image| self.module_load(ctx, image),
            |extra| {
                let _ = self.module_unload(extra);
            },
        )
    }

    /// `cuLibraryUnload`: unloads its modules and forgets its kernels.
    pub fn library_unload(&self, lib: u64) -> CuResult<()> {
        let mut result = Ok(());
        for m in self.libraries.remove(lib)? {
            if let Err(e) = self.module_unload(m.handle) {
                result = result.and(Err(e));
            }
        }
        result
    }

    /// The kernel names of library `lib` (sorted), from its module in `ctx`.
    pub fn library_kernel_names(&self, lib: u64, ctx: RmHandle) -> CuResult<Vec<String>> {
        let m = self.library_module(lib, ctx)?;
        let mut names: Vec<String> = m.functions.keys().cloned().collect();
        names.sort();
        Ok(names)
    }

    /// `cuLibraryGetKernel`: the kernel id of `name` (the same id for the same name).
    pub fn library_get_kernel(&self, lib: u64, name: &str, ctx: RmHandle) -> CuResult<u64> {
        let m = self.library_module(lib, ctx)?;
        if !m.functions.contains_key(name) {
            return Err(CuError(cu::NOT_FOUND));
        }
        self.libraries.kernel_id(lib, name)
    }

    /// A kernel's (library id, function name).
    pub fn kernel(&self, kernel: u64) -> CuResult<(u64, String)> {
        self.libraries.kernel(kernel)
    }

    /// `cuKernelGetFunction`: the kernel's function in context `ctx` (loading the library's
    /// module there if needed).
    pub fn kernel_function(&self, kernel: u64, ctx: RmHandle) -> CuResult<Arc<FunctionInfo>> {
        let (lib, name) = self.kernel(kernel)?;
        let m = self.library_module(lib, ctx)?;
        m.functions
            .get(&name)
            .cloned()
            .ok_or(CuError(cu::NOT_FOUND))
    }

    /// `cuLibraryGetGlobal`: (pointer, size) of `name` in the library's module in `ctx`.
    pub fn library_get_global(&self, lib: u64, name: &str, ctx: RmHandle) -> CuResult<(u64, u64)> {
        let m = self.library_module(lib, ctx)?;
        self.module_get_global(m.handle, name)
    }

    // Streams and events -----------------------------------------------------------------------

    /// `cuCtxGetStreamPriorityRange`: (least, greatest).
    pub fn ctx_get_stream_priority_range(&self, ctx: RmHandle) -> CuResult<(i32, i32)> {
        pair(call!(self.rm_ctx_get_stream_priority_range(&ctx))?)
    }

    /// `cuStreamCreateWithPriority`.
    pub fn stream_create(&self, ctx: RmHandle, flags: u32, priority: i32) -> CuResult<RmHandle> {
        let h = handle(call!(self.rm_stream_create(&RmStreamCreateArgs {
            ctx,
            flags,
            priority
        }))?)?;
        self.delivery.stream_created(h, flags);
        Ok(h)
    }

    /// `cuStreamDestroy`.
    pub fn stream_destroy(&self, stream: RmHandle) -> CuResult<()> {
        CuError::check(call!(self.rm_stream_destroy(&stream))?)?;
        lock(&self.per_thread).retain(|_, s| *s != stream);
        lock(&self.captures).streams.remove(&stream);
        self.delivery.stream_destroyed(stream);
        Ok(())
    }

    /// `cuStreamSynchronize` (`RM_STREAM_LEGACY` names `ctx`'s legacy stream).
    pub fn stream_synchronize(&self, ctx: RmHandle, stream: RmHandle) -> CuResult<()> {
        let mark = self.copy_mark();
        let r = call!(self.rm_stream_synchronize(&RmStreamArgs { ctx, stream }))?;
        self.finish_sync(r)?;
        self.settle_stream(ctx, stream, mark)
    }

    /// `cuStreamQuery`: `Ok(true)` when done, `Ok(false)` for CUDA_ERROR_NOT_READY.
    pub fn stream_query(&self, ctx: RmHandle, stream: RmHandle) -> CuResult<bool> {
        let mark = self.copy_mark();
        let r = call!(self.rm_stream_query(&RmStreamArgs { ctx, stream }))?;
        let done = ready(self.finish_sync(r))?;
        if done {
            self.settle_stream(ctx, stream, mark)?;
        }
        Ok(done)
    }

    /// `cuLaunchHostFunc` / `cuStreamAddCallback`: `cb` runs in this process, on the
    /// session's callback thread, when `stream` (of `ctx`) reaches this point; later work in
    /// the stream waits until it returns. One-way, in order with launches and copies.
    pub fn launch_host_func(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        cb: HostCallback,
    ) -> CuResult<()> {
        self.need_revision(4, "a host callback")?;
        self.not_captured(stream, "a host callback")?;
        // The callback must see the bytes of the copies its stream is ordered after: they are
        // named to the server, whose host function publishes them (revision 8), and the
        // callback thread takes them before it runs the callback.
        let cov = self.delivery.frontier(ctx, stream, self.copy_mark());
        let copies = self.delivery.covered_ids(&cov);
        let named = self.delivery.revision() >= 8;
        let delivery = Arc::clone(&self.delivery);
        let cb: HostCallback = Box::new(move |status| {
            if named && let Err(e) = delivery.settle(&cov, Fetch::Ready) {
                tracing::error!(
                    "remora: a host callback runs without the data of copies before it: {e}"
                );
            }
            cb(status)
        });
        let id = self.callbacks.register(&self.rpc, cb).map_err(|e| {
            tracing::error!("remora: cannot start the host callback thread: {e}");
            CuError(cu::OUT_OF_MEMORY)
        })?;
        let r = if named {
            call!(self.rm_launch_host_func_copies(&RmHostFuncCopiesArgs {
                ctx,
                stream,
                callback_id: id,
                copies,
            }))
        } else {
            call!(self.rm_launch_host_func(&RmHostFuncArgs {
                ctx,
                stream,
                callback_id: id
            }))
        };
        if r.is_err() {
            self.callbacks.forget(id);
        }
        r
    }

    /// Host callbacks enqueued and not yet run.
    pub fn host_callbacks_outstanding(&self) -> usize {
        self.callbacks.outstanding()
    }

    /// `cuStreamWaitEvent`: one-way.
    pub fn stream_wait_event(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        event: RmHandle,
        flags: u32,
    ) -> CuResult<()> {
        {
            // Waiting for an event recorded in a capture joins the capture.
            let mut caps = lock(&self.captures);
            if let Some(id) = caps.events.get(&event).copied()
                && caps.active.contains_key(&id)
            {
                caps.streams.entry(stream).or_insert(id);
            }
        }
        self.delivery.stream_waits(ctx, stream, event);
        call!(self.rm_stream_wait_event(&RmStreamWaitArgs {
            ctx,
            stream,
            event,
            flags
        }))
    }

    /// `cuEventCreate`.
    pub fn event_create(&self, ctx: RmHandle, flags: u32) -> CuResult<RmHandle> {
        handle(call!(
            self.rm_event_create(&RmHandleFlags { handle: ctx, flags })
        )?)
    }

    /// `cuEventDestroy`.
    pub fn event_destroy(&self, event: RmHandle) -> CuResult<()> {
        CuError::check(call!(self.rm_event_destroy(&event))?)?;
        self.delivery.event_destroyed(event);
        Ok(())
    }

    /// `cuEventRecord`: one-way.
    pub fn event_record(&self, ctx: RmHandle, event: RmHandle, stream: RmHandle) -> CuResult<()> {
        let capturing = {
            let mut caps = lock(&self.captures);
            match caps.streams.get(&stream).copied() {
                Some(id) => {
                    caps.events.insert(event, id);
                    true
                }
                None => {
                    caps.events.remove(&event);
                    false
                }
            }
        };
        // A record captured into a graph does not change the event outside it: the copies
        // its synchronize waits for stay those of its last record outside a capture.
        if !capturing {
            self.delivery
                .event_recorded(event, ctx, stream, self.copy_mark());
        }
        call!(self.rm_event_record(&RmEventRecordArgs { ctx, event, stream }))
    }

    /// Waits for the copies an event covers: those its stream was ordered after at its record.
    fn settle_event(&self, event: RmHandle) -> CuResult<()> {
        self.delivery
            .settle(&self.delivery.event(event), Fetch::Collect)
    }

    /// `cuEventSynchronize`.
    pub fn event_synchronize(&self, event: RmHandle) -> CuResult<()> {
        let r = call!(self.rm_event_synchronize(&event))?;
        self.finish_sync(r)?;
        self.settle_event(event)
    }

    /// `cuEventQuery`: `Ok(true)` when complete.
    pub fn event_query(&self, event: RmHandle) -> CuResult<bool> {
        let r = call!(self.rm_event_query(&event))?;
        let done = ready(self.finish_sync(r))?;
        if done {
            self.settle_event(event)?;
        }
        Ok(done)
    }

    /// `cuEventElapsedTime` in milliseconds.
    pub fn event_elapsed_time(&self, start: RmHandle, end: RmHandle) -> CuResult<f32> {
        match call!(self.rm_event_elapsed_time(&RmElapsedArgs { start, end }))? {
            RmFloatReply::Case0(v) => Ok(v),
            RmFloatReply::Default { discriminant } => Err(CuError(nonzero(discriminant))),
        }
    }
}

// Graphs through stream capture (revision 5) -------------------------------------------------

impl Session {
    /// CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED (logged) when `stream` takes part in a capture
    /// this client knows of: copies to or from host memory and host callbacks cannot be put
    /// into a graph that runs in the server. The capture is marked failed: ending it returns
    /// the error (natively an invalid call invalidates the capture).
    fn not_captured(&self, stream: RmHandle, what: &str) -> CuResult<()> {
        let mut caps = lock(&self.captures);
        let Some(id) = caps.streams.get(&stream).copied() else {
            return Ok(());
        };
        if let Some(c) = caps.active.get_mut(&id) {
            c.error.get_or_insert(cu::STREAM_CAPTURE_UNSUPPORTED);
        }
        tracing::error!(
            "remora: {what} on a capturing stream cannot be captured (the graph runs in the \
             server, the host memory is here); returning CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED"
        );
        Err(CuError(cu::STREAM_CAPTURE_UNSUPPORTED))
    }

    /// `cuStreamBeginCapture_v2` with `CUstreamCaptureMode` `mode`. The server captures in
    /// relaxed mode (its threads are not the program's); the mode is kept here for the
    /// thread rule of `cuStreamEndCapture`.
    pub fn stream_begin_capture(&self, ctx: RmHandle, stream: RmHandle, mode: i32) -> CuResult<()> {
        self.need_revision(5, "stream capture")?;
        if !(0..=2).contains(&mode) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let r = call!(self.rm_stream_begin_capture(&RmBeginCaptureArgs { ctx, stream, mode }))?;
        let begun = match r {
            RmCaptureBegunReply::Case0(b) => b,
            RmCaptureBegunReply::Default { discriminant } => {
                return Err(CuError(nonzero(discriminant)));
            }
        };
        let mut caps = lock(&self.captures);
        caps.active.insert(
            begun.id,
            ClientCapture {
                origin: stream,
                mode,
                thread: std::thread::current().id(),
                error: None,
            },
        );
        caps.streams.insert(stream, begun.id);
        Ok(())
    }

    /// `cuStreamEndCapture`: the captured graph's handle.
    pub fn stream_end_capture(&self, ctx: RmHandle, stream: RmHandle) -> CuResult<RmHandle> {
        self.need_revision(5, "stream capture")?;
        let known = {
            let caps = lock(&self.captures);
            let id = caps.streams.get(&stream).copied();
            if let Some(c) = id.and_then(|id| caps.active.get(&id))
                && c.origin == stream
                && c.mode != CAPTURE_MODE_RELAXED
                && c.thread != std::thread::current().id()
            {
                return Err(CuError(cu::STREAM_CAPTURE_WRONG_THREAD));
            }
            id
        };
        let r = call!(self.rm_stream_end_capture(&RmStreamArgs { ctx, stream }))?;
        let error = {
            let mut caps = lock(&self.captures);
            let error = known
                .and_then(|id| caps.active.get(&id))
                .and_then(|c| c.error);
            if !r.still_capturing
                && let Some(id) = known
            {
                caps.end(id);
            }
            error
        };
        CuError::check(r.status)?;
        if let Some(e) = error {
            // A call the client refused during the capture: the graph lacks it.
            let _ = self.graph_destroy(r.graph);
            return Err(CuError(e));
        }
        Ok(r.graph)
    }

    /// `cuStreamGetCaptureInfo` / `cuStreamIsCapturing`. Answered locally for a stream that
    /// takes part in no capture (see [`Captures`]), else by the server.
    pub fn stream_capture_info(&self, ctx: RmHandle, stream: RmHandle) -> CuResult<CaptureInfo> {
        let ask = {
            let caps = lock(&self.captures);
            caps.streams.contains_key(&stream)
                || (stream == u64::from(RM_STREAM_LEGACY) && !caps.active.is_empty())
        };
        if !ask {
            return Ok(CaptureInfo::default());
        }
        match call!(self.rm_stream_get_capture_info(&RmStreamArgs { ctx, stream }))? {
            RmCaptureInfoReply::Case0(i) => Ok(CaptureInfo {
                status: i.status,
                id: i.id,
                graph: i.graph,
                dependencies: i.dependencies,
            }),
            RmCaptureInfoReply::Default { discriminant } => Err(CuError(nonzero(discriminant))),
        }
    }

    /// Whether `stream` takes part in a capture this client began (no round trip).
    pub fn stream_may_capture(&self, stream: RmHandle) -> bool {
        lock(&self.captures).streams.contains_key(&stream)
    }

    /// `cuGraphInstantiateWithFlags`.
    pub fn graph_instantiate(
        &self,
        ctx: RmHandle,
        graph: RmHandle,
        flags: u64,
    ) -> CuResult<RmHandle> {
        self.need_revision(5, "a CUDA graph")?;
        let h = handle(call!(self.rm_graph_instantiate(&RmGraphInstantiateArgs {
            ctx,
            graph,
            flags
        }))?)?;
        lock(&self.captures).execs.insert(h);
        Ok(h)
    }

    /// `cuGraphLaunch`: one-way. An executable graph this client does not know (destroyed)
    /// is CUDA_ERROR_INVALID_HANDLE at once.
    pub fn graph_launch(&self, ctx: RmHandle, exec: RmHandle, stream: RmHandle) -> CuResult<()> {
        if !lock(&self.captures).execs.contains(&exec) {
            return Err(CuError(cu::INVALID_HANDLE));
        }
        call!(self.rm_graph_launch(&RmGraphLaunchArgs { ctx, exec, stream }))
    }

    /// `cuGraphUpload`: one-way.
    pub fn graph_upload(&self, ctx: RmHandle, exec: RmHandle, stream: RmHandle) -> CuResult<()> {
        if !lock(&self.captures).execs.contains(&exec) {
            return Err(CuError(cu::INVALID_HANDLE));
        }
        call!(self.rm_graph_upload(&RmGraphLaunchArgs { ctx, exec, stream }))
    }

    /// `cuGraphExecDestroy`.
    pub fn graph_exec_destroy(&self, exec: RmHandle) -> CuResult<()> {
        self.need_revision(5, "a CUDA graph")?;
        lock(&self.captures).execs.remove(&exec);
        CuError::check(call!(self.rm_graph_exec_destroy(&exec))?)
    }

    /// `cuGraphDestroy`.
    pub fn graph_destroy(&self, graph: RmHandle) -> CuResult<()> {
        self.need_revision(5, "a CUDA graph")?;
        CuError::check(call!(self.rm_graph_destroy(&graph))?)
    }

    /// `cuGraphGetNodes` with a NULL array: the number of nodes.
    pub fn graph_node_count(&self, graph: RmHandle) -> CuResult<u64> {
        self.need_revision(5, "a CUDA graph")?;
        u64r(call!(self.rm_graph_node_count(&graph))?)
    }
}

fn src_layout(src: &CopySrc<'_>) -> Layout {
    match src {
        CopySrc::Device { layout, .. } | CopySrc::Host { layout, .. } => *layout,
    }
}

fn dst_layout(dst: &CopyDst<'_>) -> Layout {
    match dst {
        CopyDst::Device { layout, .. }
        | CopyDst::Host { layout, .. }
        | CopyDst::Later { layout, .. } => *layout,
    }
}

fn pair(r: RmIntPairReply) -> CuResult<(i32, i32)> {
    match r {
        RmIntPairReply::Case0(p) => Ok((p.first, p.second)),
        RmIntPairReply::Default { discriminant } => Err(CuError(nonzero(discriminant))),
    }
}

fn ready(r: CuResult<()>) -> CuResult<bool> {
    match r {
        Ok(()) => Ok(true),
        Err(CuError(cu::NOT_READY)) => Ok(false),
        Err(e) => Err(e),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copies_split_into_bounded_chunks() {
        assert_eq!(chunks(0).collect::<Vec<_>>(), [(0, 0)]);
        assert_eq!(chunks(5).collect::<Vec<_>>(), [(0, 5)]);
        assert_eq!(chunks(COPY_CHUNK).collect::<Vec<_>>(), [(0, COPY_CHUNK)]);
        let big = 2 * COPY_CHUNK + 7;
        let parts: Vec<_> = chunks(big).collect();
        assert_eq!(
            parts,
            [
                (0, COPY_CHUNK),
                (COPY_CHUNK, COPY_CHUNK),
                (2 * COPY_CHUNK, 7)
            ]
        );
        assert_eq!(parts.iter().map(|p| p.1).sum::<usize>(), big);
    }

    #[test]
    fn stream_mapping() {
        assert_eq!(StreamRef::from_raw(0, false), StreamRef::Legacy);
        assert_eq!(StreamRef::from_raw(1, false), StreamRef::Legacy);
        assert_eq!(StreamRef::from_raw(2, false), StreamRef::PerThread);
        assert_eq!(StreamRef::from_raw(0, true), StreamRef::PerThread);
        assert_eq!(StreamRef::from_raw(1, true), StreamRef::Legacy);
        assert_eq!(
            StreamRef::from_raw(0x1234, false),
            StreamRef::Handle(0x1234)
        );
    }

    #[test]
    fn session_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Session>();
    }

    #[test]
    fn unreachable_server_is_no_device_within_the_timeout() {
        let dir = std::env::temp_dir().join(format!("remora-none-{}", std::process::id()));
        let start = std::time::Instant::now();
        let err = Session::connect(&Endpoint::Unix(dir.join("absent.sock"))).unwrap_err();
        assert_eq!(err, CuError(cu::NO_DEVICE));
        assert!(start.elapsed() < Duration::from_secs(5));
    }
}
