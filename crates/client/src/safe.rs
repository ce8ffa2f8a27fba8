//! The safe API: RAII wrappers over [`Session`]. Whatever a value owns on the server is
//! released when it is dropped, and nothing can be used after it is released: buffers,
//! modules, streams and events hold their context alive.

use std::marker::PhantomData;
use std::sync::Arc;

use remora_proto::remora::{RM_STREAM_LEGACY, RmDim3, RmHandle, RmLaunchArgs};
use remora_xdr::Bytes;

use crate::error::{CuError, CuResult, cu};
use crate::session::{FunctionInfo, ModuleInfo, Session};

/// A connection to a Remora server.
///
/// ```no_run
/// let client = remora_client::Client::connect("tcp://127.0.0.1:7446")?;
/// println!("{} devices", client.device_count());
/// # Ok::<(), remora_client::CuError>(())
/// ```
#[derive(Debug, Clone)]
pub struct Client {
    session: Arc<Session>,
}

impl Client {
    /// Connects to `url` (`tcp://HOST:PORT` or `unix:///PATH`).
    pub fn connect(url: &str) -> CuResult<Client> {
        let endpoint = url.parse().map_err(|e| {
            tracing::error!("{e}");
            CuError(cu::INVALID_VALUE)
        })?;
        Ok(Client {
            session: Arc::new(Session::connect(&endpoint)?),
        })
    }

    /// Connects to `REMORA_SERVER`, else the default local socket.
    pub fn from_env() -> CuResult<Client> {
        Ok(Client {
            session: Arc::new(Session::from_env()?),
        })
    }

    /// The low-level session.
    pub fn session(&self) -> &Arc<Session> {
        &self.session
    }

    /// Number of devices the server offers.
    pub fn device_count(&self) -> i32 {
        self.session.device_count()
    }

    /// Device `ordinal`.
    pub fn device(&self, ordinal: i32) -> CuResult<Device> {
        if ordinal < 0 || ordinal >= self.device_count() {
            return Err(CuError(cu::INVALID_DEVICE));
        }
        Ok(Device {
            session: Arc::clone(&self.session),
            ordinal,
        })
    }
}

/// A GPU of the server.
#[derive(Debug, Clone)]
pub struct Device {
    session: Arc<Session>,
    ordinal: i32,
}

impl Device {
    /// The ordinal.
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The device name, e.g. "NVIDIA H100 80GB HBM3".
    pub fn name(&self) -> CuResult<String> {
        Ok(self.session.device_props(self.ordinal)?.name.clone())
    }

    /// The 16-byte UUID.
    pub fn uuid(&self) -> CuResult<[u8; 16]> {
        Ok(self.session.device_props(self.ordinal)?.uuid)
    }

    /// Total memory in bytes.
    pub fn total_memory(&self) -> CuResult<u64> {
        Ok(self.session.device_props(self.ordinal)?.total_memory)
    }

    /// A `CUdevice_attribute` value, e.g. 16 for the multiprocessor count.
    pub fn attribute(&self, attribute: i32) -> CuResult<i32> {
        self.session.device_attribute(self.ordinal, attribute)
    }
}

#[derive(Debug)]
struct CtxInner {
    session: Arc<Session>,
    handle: RmHandle,
    device: i32,
}

impl Drop for CtxInner {
    fn drop(&mut self) {
        if let Err(e) = self.session.primary_ctx_release(self.device) {
            tracing::warn!(
                "remora: releasing the primary context of device {} failed: {e}",
                self.device
            );
        }
    }
}

/// The primary context of a device, retained while any clone or anything made in it lives.
#[derive(Debug, Clone)]
pub struct Context {
    inner: Arc<CtxInner>,
}

impl Context {
    /// Retains the device's primary context.
    pub fn new(device: &Device) -> CuResult<Context> {
        let handle = device.session.primary_ctx_retain(device.ordinal)?;
        Ok(Context {
            inner: Arc::new(CtxInner {
                session: Arc::clone(&device.session),
                handle,
                device: device.ordinal,
            }),
        })
    }

    /// Waits for all work of the context.
    pub fn synchronize(&self) -> CuResult<()> {
        self.inner.session.ctx_synchronize(self.inner.handle)
    }

    /// (free, total) device memory.
    pub fn mem_info(&self) -> CuResult<(u64, u64)> {
        self.inner.session.mem_get_info(self.inner.handle)
    }

    fn session(&self) -> &Session {
        &self.inner.session
    }
}

/// Plain data that may be copied to and from the device byte for byte.
///
/// # Safety
/// Every bit pattern is a valid value and the type has no padding bytes.
pub unsafe trait Pod: Copy + Send + Sync + 'static {}

macro_rules! pod {
    ($($t:ty),*) => { $(
        // SAFETY: a primitive number: no padding, every bit pattern valid.
        unsafe impl Pod for $t {}
    )* };
}
pod!(
    u8, i8, u16, i16, u32, i32, u64, i64, u128, i128, usize, isize, f32, f64
);
// SAFETY: an array of Pod has no padding and every bit pattern is valid.
unsafe impl<T: Pod, const N: usize> Pod for [T; N] {}

fn bytes_of<T: Pod>(v: &[T]) -> &[u8] {
    // SAFETY: T is Pod (no padding, so every byte is initialized); the slice covers exactly
    // the memory of `v` and shares its lifetime.
    unsafe { std::slice::from_raw_parts(v.as_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

fn bytes_of_mut<T: Pod>(v: &mut [T]) -> &mut [u8] {
    // SAFETY: T is Pod (any byte pattern written is a valid T); the slice covers exactly the
    // memory of `v` and borrows it mutably for its lifetime.
    unsafe { std::slice::from_raw_parts_mut(v.as_mut_ptr().cast::<u8>(), std::mem::size_of_val(v)) }
}

/// Device memory holding `len` values of `T`, freed on drop.
///
/// ```no_run
/// # use remora_client::*;
/// # let ctx: Context = unimplemented!();
/// let mut buf = DeviceBuffer::<f32>::zeroed(&ctx, 1024)?;
/// buf.copy_from(&vec![1.0; 1024])?;
/// let mut out = vec![0.0; 1024];
/// buf.copy_to(&mut out)?;
/// # Ok::<(), CuError>(())
/// ```
#[derive(Debug)]
pub struct DeviceBuffer<T: Pod> {
    ctx: Context,
    ptr: u64,
    len: usize,
    _t: PhantomData<T>,
}

impl<T: Pod> DeviceBuffer<T> {
    /// Allocates room for `len` values (contents unspecified but initialized bytes on the
    /// device; reading them is memory-safe).
    pub fn new(ctx: &Context, len: usize) -> CuResult<Self> {
        let bytes = len
            .checked_mul(std::mem::size_of::<T>())
            .ok_or(CuError(cu::INVALID_VALUE))?;
        let ptr = ctx
            .session()
            .mem_alloc(ctx.inner.handle, bytes.max(1) as u64)?;
        Ok(DeviceBuffer {
            ctx: ctx.clone(),
            ptr,
            len,
            _t: PhantomData,
        })
    }

    /// Allocates and zero-fills.
    pub fn zeroed(ctx: &Context, len: usize) -> CuResult<Self> {
        let buf = Self::new(ctx, len)?;
        let bytes = std::mem::size_of_val(&[0u8]) * len * std::mem::size_of::<T>();
        if bytes > 0 {
            ctx.session().memset(&remora_proto::remora::RmMemsetArgs {
                ctx: ctx.inner.handle,
                stream: u64::from(RM_STREAM_LEGACY),
                dst: buf.ptr,
                value: 0,
                element_size: 1,
                count: bytes as u64,
            })?;
        }
        Ok(buf)
    }

    /// Allocates and copies `data` in.
    pub fn from_slice(ctx: &Context, data: &[T]) -> CuResult<Self> {
        let mut buf = Self::new(ctx, data.len())?;
        buf.copy_from(data)?;
        Ok(buf)
    }

    /// Checks that a host slice of `n` values matches the buffer's length
    /// (CUDA_ERROR_INVALID_VALUE otherwise); true when both are empty.
    fn nothing_to_copy(&self, n: usize) -> CuResult<bool> {
        if n != self.len {
            return Err(CuError(cu::INVALID_VALUE));
        }
        Ok(n == 0)
    }

    /// Copies `data` (exactly `len` values) to the device.
    pub fn copy_from(&mut self, data: &[T]) -> CuResult<()> {
        if self.nothing_to_copy(data.len())? {
            return Ok(());
        }
        let (session, legacy) = (self.ctx.session(), u64::from(RM_STREAM_LEGACY));
        session.memcpy_htod(self.ctx.inner.handle, legacy, self.ptr, bytes_of(data))
    }

    /// Copies the device contents into `out` (exactly `len` values).
    pub fn copy_to(&self, out: &mut [T]) -> CuResult<()> {
        if self.nothing_to_copy(out.len())? {
            return Ok(());
        }
        let (session, legacy) = (self.ctx.session(), u64::from(RM_STREAM_LEGACY));
        session.memcpy_dtoh(self.ctx.inner.handle, legacy, self.ptr, bytes_of_mut(out))
    }

    /// The contents as a vector.
    pub fn to_vec(&self) -> CuResult<Vec<T>>
    where
        T: Default,
    {
        let mut v = vec![T::default(); self.len];
        self.copy_to(&mut v)?;
        Ok(v)
    }

    /// Number of values.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Whether it holds no values.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The device address (valid while `self` lives).
    pub fn device_ptr(&self) -> u64 {
        self.ptr
    }
}

impl<T: Pod> Drop for DeviceBuffer<T> {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.session().mem_free(self.ctx.inner.handle, self.ptr) {
            tracing::warn!("remora: freeing device memory {:#x} failed: {e}", self.ptr);
        }
    }
}

#[derive(Debug)]
struct ModInner {
    ctx: Context,
    info: Arc<ModuleInfo>,
}

impl Drop for ModInner {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.session().module_unload(self.info.handle) {
            tracing::warn!("remora: unloading a module failed: {e}");
        }
    }
}

/// A loaded kernel image (cubin, fatbin or PTX), unloaded when the last clone and the last
/// [`Function`] from it are dropped.
#[derive(Debug, Clone)]
pub struct Module {
    inner: Arc<ModInner>,
}

impl Module {
    /// Loads `image`: its hash goes first and the bytes only if the server lacks them.
    pub fn load(ctx: &Context, image: &[u8]) -> CuResult<Module> {
        let info = ctx.session().module_load(ctx.inner.handle, image)?;
        Ok(Module {
            inner: Arc::new(ModInner {
                ctx: ctx.clone(),
                info,
            }),
        })
    }

    /// The function named `name` (mangled, as in the image).
    pub fn function(&self, name: &str) -> CuResult<Function> {
        let info = self
            .inner
            .ctx
            .session()
            .module_get_function(self.inner.info.handle, name)?;
        Ok(Function {
            module: self.clone(),
            info,
        })
    }

    /// Names of the functions in the module.
    pub fn function_names(&self) -> Vec<String> {
        self.inner.info.functions.keys().cloned().collect()
    }
}

/// Grid or block dimensions.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Dim3 {
    /// x
    pub x: u32,
    /// y
    pub y: u32,
    /// z
    pub z: u32,
}

impl From<u32> for Dim3 {
    fn from(x: u32) -> Self {
        Dim3 { x, y: 1, z: 1 }
    }
}

impl From<(u32, u32)> for Dim3 {
    fn from((x, y): (u32, u32)) -> Self {
        Dim3 { x, y, z: 1 }
    }
}

impl From<(u32, u32, u32)> for Dim3 {
    fn from((x, y, z): (u32, u32, u32)) -> Self {
        Dim3 { x, y, z }
    }
}

impl From<Dim3> for RmDim3 {
    fn from(d: Dim3) -> Self {
        RmDim3 {
            x: d.x,
            y: d.y,
            z: d.z,
        }
    }
}

/// A kernel argument: its bytes as the kernel receives them.
pub trait KernelArg {
    /// The argument's bytes.
    fn arg_bytes(&self) -> Vec<u8>;
}

impl<T: Pod> KernelArg for T {
    fn arg_bytes(&self) -> Vec<u8> {
        bytes_of(std::slice::from_ref(self)).to_vec()
    }
}

impl<T: Pod> KernelArg for DeviceBuffer<T> {
    fn arg_bytes(&self) -> Vec<u8> {
        self.ptr.to_ne_bytes().to_vec()
    }
}

/// A kernel of a [`Module`].
#[derive(Debug, Clone)]
pub struct Function {
    module: Module,
    info: Arc<FunctionInfo>,
}

impl Function {
    /// The parameter layout (offset, size) as the driver reports it.
    pub fn params(&self) -> Vec<(u32, u32)> {
        self.info
            .params
            .iter()
            .map(|p| (p.offset, p.size))
            .collect()
    }

    /// Launches on `stream` (one-way: errors surface at the next synchronization). Each
    /// argument's size must match the kernel's parameter of the same position.
    ///
    /// ```no_run
    /// # use remora_client::*;
    /// # let (ctx, module): (Context, Module) = unimplemented!();
    /// let f = module.function("axpy")?;
    /// let x = DeviceBuffer::from_slice(&ctx, &[1.0f32; 256])?;
    /// let stream = Stream::new(&ctx)?;
    /// f.launch(1u32, 256u32, 0, &stream, &[&2.0f32, &x, &256u32])?;
    /// stream.synchronize()?;
    /// # Ok::<(), CuError>(())
    /// ```
    pub fn launch(
        &self,
        grid: impl Into<Dim3>,
        block: impl Into<Dim3>,
        shared_mem_bytes: u32,
        stream: &Stream,
        args: &[&dyn KernelArg],
    ) -> CuResult<()> {
        if args.len() != self.info.params.len() {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let values: Vec<Vec<u8>> = args.iter().map(|a| a.arg_bytes()).collect();
        let params = crate::params::pack_with(&self.info.params, |i| &values[i])?;
        let ctx = &self.module.inner.ctx;
        ctx.session().launch(&RmLaunchArgs {
            ctx: ctx.inner.handle,
            function: self.info.handle,
            grid: grid.into().into(),
            block: block.into().into(),
            shared_mem_bytes,
            stream: stream.handle,
            params: Bytes::from(params),
            attrs: Vec::new(),
        })
    }
}

/// A CUDA stream, destroyed on drop (the legacy stream is never destroyed).
#[derive(Debug)]
pub struct Stream {
    ctx: Context,
    handle: RmHandle,
    owned: bool,
}

impl Stream {
    /// Creates a stream (flags 0, priority 0).
    pub fn new(ctx: &Context) -> CuResult<Stream> {
        let handle = ctx.session().stream_create(ctx.inner.handle, 0, 0)?;
        Ok(Stream {
            ctx: ctx.clone(),
            handle,
            owned: true,
        })
    }

    /// The legacy default stream of `ctx`.
    pub fn legacy(ctx: &Context) -> Stream {
        Stream {
            ctx: ctx.clone(),
            handle: u64::from(RM_STREAM_LEGACY),
            owned: false,
        }
    }

    /// Waits for all work on the stream.
    pub fn synchronize(&self) -> CuResult<()> {
        self.ctx
            .session()
            .stream_synchronize(self.ctx.inner.handle, self.handle)
    }

    /// Whether all work on the stream is done.
    pub fn is_done(&self) -> CuResult<bool> {
        self.ctx
            .session()
            .stream_query(self.ctx.inner.handle, self.handle)
    }

    /// Makes later work on this stream wait for `event`.
    pub fn wait(&self, event: &Event) -> CuResult<()> {
        self.ctx
            .session()
            .stream_wait_event(self.ctx.inner.handle, self.handle, event.handle, 0)
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if self.owned
            && let Err(e) = self.ctx.session().stream_destroy(self.handle)
        {
            tracing::warn!("remora: destroying a stream failed: {e}");
        }
    }
}

/// A CUDA event, destroyed on drop.
///
/// ```no_run
/// # use remora_client::*;
/// # let (ctx, stream): (Context, Stream) = unimplemented!();
/// let (start, end) = (Event::new(&ctx)?, Event::new(&ctx)?);
/// start.record(&stream)?;
/// // ... launches ...
/// end.record(&stream)?;
/// end.synchronize()?;
/// println!("{} ms", end.elapsed_since(&start)?);
/// # Ok::<(), CuError>(())
/// ```
#[derive(Debug)]
pub struct Event {
    ctx: Context,
    handle: RmHandle,
}

impl Event {
    /// Creates an event (default flags: timing enabled).
    pub fn new(ctx: &Context) -> CuResult<Event> {
        let handle = ctx.session().event_create(ctx.inner.handle, 0)?;
        Ok(Event {
            ctx: ctx.clone(),
            handle,
        })
    }

    /// Records the event on `stream` (one-way).
    pub fn record(&self, stream: &Stream) -> CuResult<()> {
        self.ctx
            .session()
            .event_record(stream.ctx.inner.handle, self.handle, stream.handle)
    }

    /// Waits until the event completes.
    pub fn synchronize(&self) -> CuResult<()> {
        self.ctx.session().event_synchronize(self.handle)
    }

    /// Whether the event has completed.
    pub fn is_done(&self) -> CuResult<bool> {
        self.ctx.session().event_query(self.handle)
    }

    /// Milliseconds from `start` to `self`.
    pub fn elapsed_since(&self, start: &Event) -> CuResult<f32> {
        self.ctx
            .session()
            .event_elapsed_time(start.handle, self.handle)
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if let Err(e) = self.ctx.session().event_destroy(self.handle) {
            tracing::warn!("remora: destroying an event failed: {e}");
        }
    }
}
