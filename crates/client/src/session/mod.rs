//! [`Session`]: one connection to `remora serve`, a method per protocol procedure.

use rustc_hash::FxHashMap;
use std::collections::HashMap;
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::ThreadId;
use std::time::Duration;

use remora_oncrpc::{Client as RpcClient, ClientConfig, Endpoint, TransportChoice};
use remora_proto::remora::*;
use remora_xdr::Bytes;

use crate::area::AreaAlloc;
use crate::copy3d::{self, Extent, Layout};
use crate::error::{CuError, CuResult, cu, from_rpc};
use crate::host::{HostMem, HostRange};
use crate::host_callbacks::HostCallbacks;
use crate::library::Libraries;
use crate::vaspace::VaSpace;

/// Procedures after which cached occupancy answers may no longer hold: function attributes
/// and cache preferences (which set the shared memory carveout), context cache preferences
/// and limits, and unloading (a handle's functions are gone).
fn invalidates_occupancy(proc: &str) -> bool {
    matches!(
        proc,
        "rm_func_set_attribute"
            | "rm_func_set_cache_config"
            | "rm_ctx_set_cache_config"
            | "rm_ctx_set_limit"
            | "rm_module_unload"
            | "rm_primary_ctx_reset"
            | "rm_ctx_destroy"
    )
}

/// A device ordinal as the server numbers them.
pub type DeviceHandle = i32;

/// A primary context's (flags, active), as `cuDevicePrimaryCtxGetState` answers.
pub(crate) type PrimaryState = (u32, bool);

/// Device attributes that advertise concurrent access to managed or pageable host memory,
/// which a remote GPU cannot give the client process: answered 0 (see
/// [`Session::device_attribute`]). `CU_DEVICE_ATTRIBUTE_PAGEABLE_MEMORY_ACCESS` (88),
/// `CONCURRENT_MANAGED_ACCESS` (89), `PAGEABLE_MEMORY_ACCESS_USES_HOST_PAGE_TABLES` (100)
/// and `DIRECT_MANAGED_MEM_ACCESS_FROM_HOST` (101). `MANAGED_MEMORY` (83) is the server's
/// answer: Remora's managed memory follows CUDA's model for devices without concurrent
/// managed access (see `crate::mirror`). Also `CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM` (91):
/// the device copy of a registered range lies at another address, so programs must ask
/// `cuMemHostGetDevicePointer`.
pub const UNSUPPORTED_MEMORY_ATTRIBUTES: [i32; 5] = [88, 89, 91, 100, 101];

pub use crate::delivery::CopySink;
use crate::delivery::{Delivery, Fetch};

/// Copies larger than this travel as several calls of at most this many bytes, so that every
/// record stays far below the server's maximum record size (128 MiB by default) and memory
/// per call stays bounded on both sides.
pub(crate) const COPY_CHUNK: usize = 32 << 20;

/// Largest reply record the client accepts: a synchronizing reply may carry several
/// asynchronous device-to-host copies at once.
pub(crate) const MAX_REPLY_RECORD: usize = (1 << 30) + (1 << 16);

/// An occupancy question: (function, block size, dynamic shared memory, flags, the
/// function's maximum dynamic shared memory as last set or read, if known).
type OccupancyKey = (RmHandle, i32, u64, u32, Option<i32>);

/// Events made per `RM_EVENT_CREATE_MANY` (revision 13) when the pool of a context and
/// flags is empty.
const EVENT_BATCH: u32 = 16;
/// The protocol revision from which an image may go to the server unnamed (an all-zero hash)
/// for it to hash ([`Session::module_load`]).
const UNNAMED_IMAGE_REVISION: u32 = 20;

/// The protocol revision whose servers take `cuMemFreeAsync` of a live stream-ordered
/// allocation one-way (`RM_MEM_FREE_ASYNC_ONEWAY`).
const ONEWAY_FREE_REVISION: u32 = 21;

/// A session's events (revision 13).
#[derive(Default)]
struct EventPool {
    /// Fresh (never handed out) events by (context, flags).
    fresh: FxHashMap<(RmHandle, u32), Vec<RmHandle>>,
    /// Events handed out and not destroyed, with their context: their destruction is one-way.
    live: FxHashMap<RmHandle, RmHandle>,
}

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

/// A zero-copy copy between device memory at `dev` and `size` bytes of pinned host memory
/// at `host`, which must lie inside one live allocation in the shared data area
/// (`CUDA_ERROR_INVALID_VALUE` otherwise), on `stream` of `ctx` ([`Session::memcpy_htod_pinned`],
/// [`Session::memcpy_dtoh_pinned`]). `asynchronous`: one-way on `stream`, errors deferred.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PinnedCopy {
    pub ctx: RmHandle,
    pub stream: RmHandle,
    pub dev: u64,
    pub host: u64,
    pub size: u64,
    pub asynchronous: bool,
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
    /// How a hung or vanished server is noticed while calls wait for it (default: pinged
    /// after 5 s of silence, given up after 120 s; `None`: only `call_timeout`). Calls then
    /// fail with CUDA_ERROR_DEVICE_UNAVAILABLE; a long synchronize on a live server is
    /// still waited for, as the server answers the pings meanwhile.
    pub liveness: Option<remora_oncrpc::Liveness>,
    /// The token presented in `REMORA_HELLO_AUTH`, for a server started with
    /// `--auth-token-file` (default: none; [`Session::from_env`] reads `REMORA_AUTH_TOKEN`
    /// and `REMORA_AUTH_TOKEN_FILE`).
    pub auth_token: Option<crate::endpoint::AuthToken>,
    /// The TLS settings for a `tls://` server (default: none, and a `tls://` connection
    /// reads `REMORA_TLS_CA`, `REMORA_TLS_CERT` and `REMORA_TLS_KEY`).
    pub tls: Option<std::sync::Arc<remora_oncrpc::ClientTls>>,
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
            liveness: Some(remora_oncrpc::Liveness::default()),
            auth_token: None,
            tls: None,
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
    streams: FxHashMap<RmHandle, u64>,
    /// Capture id → capture.
    active: FxHashMap<u64, ClientCapture>,
    /// Event → the capture it was last recorded in.
    events: FxHashMap<RmHandle, u64>,
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
    props: Mutex<FxHashMap<DeviceHandle, Arc<RmDeviceProps>>>,
    attrs: Mutex<FxHashMap<(DeviceHandle, i32), i32>>,
    modules: Mutex<FxHashMap<RmHandle, Arc<ModuleInfo>>>,
    functions: Mutex<FxHashMap<RmHandle, Arc<FunctionInfo>>>,
    /// Asynchronous device-to-host copies not yet written, and CUDA's ordering rules that
    /// say when they must be.
    delivery: Arc<Delivery>,
    /// Context → device, for every context this session created or retained.
    ctx_devices: Mutex<FxHashMap<RmHandle, DeviceHandle>>,
    /// `cuDevicePrimaryCtxGetState` answers by device, and a generation. The state is this
    /// session's own on the server (its retains and flags), so only this session's
    /// primary-context calls change it: each forgets the entry and counts a generation
    /// before and after it, and an answer is kept only when no generation passed while it
    /// was asked for. PyTorch asks before most operations.
    primary_states: Mutex<(u64, FxHashMap<DeviceHandle, PrimaryState>)>,
    /// (function, device) → the limits its launches are checked against (forgotten when an
    /// attribute of the function is set).
    launch_limits: Mutex<FxHashMap<(RmHandle, DeviceHandle), crate::launch::LaunchLimits>>,
    per_thread: Mutex<FxHashMap<(ThreadId, RmHandle), RmHandle>>,
    va: VaSpace,
    host: HostMem,
    /// The shared data area's allocator (a session in shared memory, revision 6).
    area: Option<Arc<AreaAlloc>>,
    /// Device address minus area offset of the data area's mapping for the GPU, once known
    /// (see `mem_host_device_pointer`).
    area_device_delta: Mutex<Option<u64>>,
    func_attrs: Mutex<FxHashMap<(RmHandle, i32), i32>>,
    /// The value each function attribute was last set to with success, by this session:
    /// setting it again to that value changes nothing, so it is answered here (PyTorch's
    /// libraries set attributes before launches). Forgotten when a set fails and, for the
    /// function, at `cuFuncSetCacheConfig` (which moves the shared-memory carveout).
    /// Functions whose loading this session asked for ([`Session::module_get_function`]).
    loads_asked: Mutex<std::collections::HashSet<RmHandle>>,
    /// Fresh events made ahead and events handed out ([`Session::event_create`]).
    events: Mutex<EventPool>,
    /// Stream-ordered allocations made outside a capture and not freed since, with their
    /// context: a server of revision 21 frees them one-way ([`Session::mem_free_async`]).
    stream_allocs: Mutex<FxHashMap<u64, RmHandle>>,
    func_sets: Mutex<FxHashMap<(RmHandle, i32), i32>>,
    /// `cuOccupancyMaxActiveBlocksPerMultiprocessor` answers by (function, block size,
    /// dynamic shared memory, flags): the occupancy calculator's answer depends only on them
    /// and on settings that this session's own calls change, each of which empties the cache
    /// (see [`invalidates_occupancy`]). PyTorch asks before many launches.
    occupancy: Mutex<FxHashMap<OccupancyKey, i32>>,
    libraries: Libraries,
    /// Whether kernel images go to the server whole and unnamed, in one call, for it to hash
    /// (revision 20, over a Unix socket or shared memory: moving an image there costs less
    /// than hashing it, 6.8 ms per 8 MiB at the H200 host's SHA-256 speed), instead of hash
    /// first ([`Session::module_load`]).
    unnamed_images: bool,
    callbacks: Arc<HostCallbacks>,
    captures: Mutex<Captures>,
    /// Host mirrors of managed memory ([`crate::mirror`]).
    mirrors: Arc<crate::mirror::Mirrors>,
    /// Held while host memory gets its device copy ([`Session::mirror_host_range`]).
    mirroring: Mutex<()>,
    /// Graph memory allocations and host sides of memcpy nodes (`session/graphs.rs`).
    graph_host: Mutex<graph_host::GraphHost>,
    /// Calls counted and timed by procedure, with `REMORA_CLIENT_PROFILE`.
    profile: Option<crate::call_profile::CallProfile>,
    /// Completion words for synchronizes seen in shared memory (`session/signal.rs`).
    signals: Option<signal::SignalSync>,
    /// More connections for bulk copies over TCP (`session/lanes.rs`, revision 16).
    lanes: lanes::Lanes,
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
            .coherent(stringify!($proc), || $self.rpc.$proc($arg))
            .map_err(|e| from_rpc(stringify!($proc), e))
    };
    ($self:ident . $proc:ident ()) => {
        $self
            .rpc
            .$proc()
            .map_err(|e| from_rpc(stringify!($proc), e))
    };
}

/// [`Session`] methods that need protocol revision `$rev` (`$what` names the call in the
/// error) and make one call, whose argument is built from the method's parameters; `$answer`
/// turns the reply into the result (`CuError::check`, `Reply::value`). A row:
/// `name(param: Type, ...) -> T = revision, "what": answer, rm_procedure(&argument);`.
macro_rules! revision_calls {
    ($($(#[$m:meta])* $name:ident($($a:ident: $t:ty),* $(,)?) -> $ret:ty
        = $rev:literal, $what:literal: $answer:path, $proc:ident($arg:expr);)*) => {$(
        $(#[$m])*
        pub fn $name(&self, $($a: $t),*) -> CuResult<$ret> {
            self.need_revision($rev, $what)?;
            $answer(call!(self.$proc($arg))?)
        }
    )*};
}

/// A reply union: a value (`case 0`) or a failure status (its default arm).
trait Reply {
    /// What `case 0` holds.
    type Value;
    /// The value, or the failure status as the error.
    fn value(self) -> CuResult<Self::Value>;
}

macro_rules! replies {
    ($($reply:ident => $value:ty,)*) => {$(
        impl Reply for $reply {
            type Value = $value;
            fn value(self) -> CuResult<$value> {
                match self {
                    $reply::Case0(v) => Ok(v),
                    $reply::Default { discriminant } => Err(CuError(nonzero(discriminant))),
                }
            }
        }
    )*};
}

replies! {
    RmIntReply => i32,
    RmDevicePropsReply => RmDeviceProps,
    RmU64Reply => u64,
    RmFloatReply => f32,
    RmHandleReply => RmHandle,
    RmIntPairReply => RmIntPair,
    RmPitchedReply => RmPitched,
    RmMemInfoReply => RmMemInfo,
    RmRangeReply => RmRange,
    RmMemPropReply => RmMemProp,
    RmPrimaryStateReply => RmPrimaryState,
    RmStreamAttrReply => RmStreamAttr,
    RmCaptureInfoReply => RmCaptureInfo,
    RmNodeListReply => RmNodeList,
    RmNodeParamsReply => RmNodeParams,
    RmGraphEdgesReply => RmGraphEdges,
}

/// A union's default arm with status 0 cannot happen (0 has its own arm); be safe anyway.
fn nonzero(code: i32) -> i32 {
    if code == 0 { cu::UNKNOWN } else { code }
}

// The methods by concern, each file its own `impl Session` block (declared after `call!`,
// which they use).
mod area_copies;
mod capture;
mod contexts;
mod copies;
mod copies_3d;
mod graph_host;
mod graphs;
mod lanes;
pub use graph_host::StagedSide;
pub use graphs::{ExecUpdateInfo, NodeList};
mod launches;
mod managed;
pub use launches::{KernelArgs, LaunchConfig};
mod memory;
mod modules;
mod pools;
mod signal;
mod socket_copies;
mod streams;
mod vmm;

impl Session {
    // The plain calls, generated from their `@glue` annotations in remora.x.
    remora_proto::client_glue!();

    /// Connects to the server named by `REMORA_SERVER`, else the default endpoint.
    pub fn from_env() -> CuResult<Session> {
        let endpoint = crate::endpoint::endpoint_from_env()?;
        let transport = crate::endpoint::transport_from_env()?;
        let auth_token = crate::endpoint::auth_token_from_env()?;
        Self::connect_with(
            &endpoint,
            SessionConfig {
                transport,
                auth_token,
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
        let t0 = std::time::Instant::now();
        let hello = HelloArgs {
            min_revision: 2,
            max_revision: REMORA_PROTOCOL_REVISION,
            client_name: config.client_name.clone(),
            capabilities: u64::from(REMORA_CAP_ONEWAY),
        };
        // With a token, HELLO_AUTH is the connection's first call, made before it moves into
        // shared memory: a server with tokens serves nothing else before it.
        let opening_call = match &config.auth_token {
            Some(token) => Some(
                remora_proto::token::hello_auth_call(&hello, token.as_bytes()).map_err(|e| {
                    tracing::error!("remora: cannot encode HELLO_AUTH: {e}");
                    CuError(cu::INVALID_VALUE)
                })?,
            ),
            None => None,
        };
        let with_token = opening_call.is_some();
        let rpc_config = ClientConfig {
            opening_call,
            connect_timeout: Some(config.connect_timeout),
            default_timeout: config.call_timeout,
            max_record_size: MAX_REPLY_RECORD,
            oneway_batch_delay: oneway_batch_delay(),
            transport: config.transport,
            liveness: config.liveness,
            tls: config.tls.clone(),
            ..ClientConfig::default()
        };
        let rpc = RpcClient::connect_with(endpoint, rpc_config).map_err(|e| {
            if let Some(line) = remora_proto::token::auth_problem(&e, endpoint, with_token) {
                tracing::error!("{line}");
                return CuError(cu::NO_DEVICE);
            }
            if matches!(e, remora_oncrpc::RpcError::Transport { .. }) {
                tracing::error!("remora: {e} (REMORA_TRANSPORT={})", config.transport);
                return CuError(cu::NO_DEVICE);
            }
            tracing::warn!(
                "remora: {e} (set REMORA_SERVER to tcp://HOST:PORT, tls://HOST:PORT or unix:///PATH)"
            );
            CuError(cu::NO_DEVICE)
        })?;
        // Start-up timeline (with `remora run`'s and the server's `remora::startup` lines):
        // when the connection stood, and below when the session's worker answered HELLO
        // (under process isolation it answers once its driver and context are ready).
        let connected_us = t0.elapsed().as_micros() as u64;
        tracing::debug!(target: "remora::startup", %endpoint, connected_us, shm = rpc.is_shm(), "client connected");
        let reply = match rpc.opening_reply() {
            Some(bytes) => {
                let mut dec = remora_xdr::Decoder::new(bytes.clone());
                remora_xdr::XdrDecode::decode(&mut dec)
                    .and_then(|r: HelloReply| dec.finish().map(|()| r))
                    .map_err(|e| {
                        tracing::warn!(
                            "remora: the answer to HELLO_AUTH from {endpoint} is malformed: {e}"
                        );
                        CuError(cu::NO_DEVICE)
                    })?
            }
            None => RemoraV1Client::new(rpc.clone())
                .with_timeout(config.hello_timeout)
                .remora_hello(&hello)
                .map_err(|e| {
                    match remora_proto::token::auth_problem(&e, endpoint, false) {
                        Some(line) => tracing::error!("{line}"),
                        None => tracing::warn!("remora: HELLO to {endpoint} failed: {e}"),
                    }
                    CuError(cu::NO_DEVICE)
                })?,
        };
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
        tracing::debug!(
            target: "remora::startup",
            revision = welcome.revision,
            hello_us = t0.elapsed().as_micros() as u64 - connected_us,
            "client session ready (HELLO answered)"
        );
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
        let signals = signal::SignalSync::new(rpc.data_area().as_ref(), welcome.revision);
        let area = rpc
            .data_area()
            .filter(|_| welcome.revision >= 6)
            .map(AreaAlloc::new);
        let rpc = RemoraV1Client::new(rpc);
        let lanes = lanes::Lanes::new(endpoint, welcome.revision, rpc.rpc().is_shm(), &config);
        let unnamed_images =
            welcome.revision >= UNNAMED_IMAGE_REVISION && matches!(endpoint, Endpoint::Unix(_));
        Ok(Session {
            lanes,
            delivery: Arc::new(Delivery::new(rpc.clone(), welcome.revision)),
            ctx_devices: Mutex::default(),
            primary_states: Mutex::default(),
            launch_limits: Mutex::default(),
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
            area_device_delta: Mutex::new(None),
            func_attrs: Mutex::default(),
            func_sets: Mutex::default(),
            events: Mutex::default(),
            stream_allocs: Mutex::default(),
            loads_asked: Mutex::default(),
            occupancy: Mutex::default(),
            libraries: Libraries::default(),
            unnamed_images,
            callbacks: Arc::default(),
            captures: Mutex::default(),
            mirrors: Arc::default(),
            mirroring: Mutex::new(()),
            graph_host: Mutex::default(),
            profile: crate::call_profile::enabled_from_env()
                .then(crate::call_profile::CallProfile::new),
            signals,
        })
    }

    /// With `REMORA_CLIENT_PROFILE`: the table of calls by procedure so far (count, total,
    /// mean and maximum time); `None` without it.
    pub fn profile_report(&self) -> Option<String> {
        self.profile.as_ref().map(|p| p.report())
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

    /// Delivers the copies of a sync reply to their sinks, then returns its status
    /// (`Delivery::finish`).
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
        self.delivery.settle(
            &self.delivery.frontier(ctx, stream, mark),
            Fetch::Collect,
            self.collect_lanes(),
        )
    }

    /// The lanes [`Delivery::settle`] may collect held copies on: the session's (opened now
    /// if need be) when the server is of revision 19 or later and more than one reply's worth
    /// of asynchronous reads is pending; else none.
    fn collect_lanes(&self) -> &[RemoraV1Client] {
        if self.welcome.revision >= crate::delivery::LANE_COLLECT_REVISION
            && self.delivery.pending_bytes() > crate::delivery::COLLECT_REPLY_BYTES
        {
            self.lanes()
        } else {
            &[]
        }
    }

    /// Logs the session's waiters (`REMORA_WAIT_TRACE`): its connection's, its lanes' and its
    /// completion words'. For a process about to exit, whose session is never dropped.
    pub fn trace_waits(&self) {
        self.rpc.rpc().trace_waits();
        for lane in self.lanes.opened() {
            lane.rpc().trace_waits();
        }
        if let Some(s) = &self.signals {
            s.trace_waits();
        }
    }

    /// How many `RM_COPIES_COLLECT` calls this session's lanes answered (revision 19).
    pub fn collects_on_lanes(&self) -> u64 {
        self.delivery.collects_on_lanes()
    }

    /// Number of asynchronous device-to-host copies not yet delivered.
    pub fn pending_copies(&self) -> usize {
        self.delivery.pending()
    }

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
}

fn pair(r: RmIntPairReply) -> CuResult<(i32, i32)> {
    r.value().map(|p| (p.first, p.second))
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
