//! The real CUDA driver backend: `libcuda.so.1` (or `REMORA_REAL_LIBCUDA`) is `dlopen`ed, `cuInit`
//! called, and every entry point resolved through the driver's own `cuGetProcAddress_v2` for
//! CUDA 13.0 (falling back to `dlsym` of the versioned name). A missing entry point answers
//! `CUDA_ERROR_NOT_SUPPORTED` with a warning naming it. Without a driver the backend reports
//! zero devices and answers `CUDA_ERROR_NO_DEVICE`.

use remora_proto::cuda::{CuError, CuResult, cu};
use std::ffi::{CStr, CString, c_char, c_int, c_uint, c_void};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use remora_proto::remora::{RmLaunchAttr, RmStreamAttr};

use remora_oncrpc::DataArea;

use super::{
    AreaCopy, AreaHtod, Backend, CaptureInfo, Copy3d, Copy3dIo, CopyForm, CopyPlace, DeviceProps,
    DtodCopy, FunctionInfo, LaunchSpec, LoadedModule, Memset, Occupancy, PeerCopy, StagedResult,
    buffered_dtoh_area, staged_dtoh_area,
};

#[macro_use]
mod driver;
mod abi;
mod graphs;
mod pools;
mod staging;
mod vmm;

use abi::*;
use driver::*;
pub(crate) use driver::{LoadError, Loaded, need, open, result_name};

/// The driver's private TOOLS_CONTEXT table, `{21318C60-9714-3248-8CA6-41FF7324C8F2}`.
const TOOLS_CONTEXT_UUID: [u8; 16] = [
    0x21, 0x31, 0x8c, 0x60, 0x97, 0x14, 0x32, 0x48, 0x8c, 0xa6, 0x41, 0xff, 0x73, 0x24, 0xc8, 0xf2,
];
/// TOOLS_CONTEXT slot 51: `(ctx, 0, &object, 0)`, the context's object for slot 39.
type ToolsCtxObject = unsafe extern "C" fn(Ptr, u64, *mut Ptr, u64) -> c_int;
/// TOOLS_CONTEXT slot 39: `(ctx, object, &answer, mask, flag)`.
type ToolsCtxAsk = unsafe extern "C" fn(Ptr, Ptr, *mut u64, u64, u64) -> c_int;

/// `CU_STREAM_CAPTURE_MODE_RELAXED`.
const CAPTURE_MODE_RELAXED: c_int = 2;

/// `CU_MEMHOSTREGISTER_PORTABLE`.
const HOST_REGISTER_PORTABLE: c_uint = 1;
/// `CU_MEMHOSTREGISTER_DEVICEMAP`: the data area is also mapped for the GPU (mapped host
/// memory, `RM_MEM_HOST_DEVICE_POINTER`).
const HOST_REGISTER_DEVICEMAP: c_uint = 2;

/// What became of a session's shared data area (keyed by its address in this process).
#[derive(Debug, Clone, PartialEq, Eq)]
enum AreaReg {
    /// The session's area is known; no copy has needed it yet.
    Announced,
    /// Page-locked piece by piece, on demand, with `cuMemHostRegister` while `ctx` was
    /// current: copies in `ctx` between the device and registered chunks are DMA straight
    /// from or to the mapping. Chunks no copy has reached are never touched here, so a
    /// short program does not pay for zero-filling and pinning the whole area (256 MiB:
    /// ~150 ms on the H100 host).
    Registered {
        ctx: u64,
        /// Bytes of each chunk (the last may be shorter).
        chunk: usize,
        chunks: Vec<Chunk>,
    },
    /// Registration failed (logged once) or was undone: copies go through private buffers.
    Unregistered,
}

/// One [`CudaBackend::chunk`]-sized piece of a registered area.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Chunk {
    /// Not page-locked yet.
    Open,
    /// Page-locked.
    Locked,
    /// `cuMemHostRegister` failed: copies touching it use private buffers.
    Failed,
}

/// Bytes of a data area page-locked at a time. Registering costs mostly zero-filling and
/// pinning the pages (about 0.5 ms per MiB on the H100 host), paid once per chunk.
const AREA_CHUNK: usize = 4 << 20;

/// Page-locking this many chunks or more at once (the whole area, for a first
/// `cuMemHostGetDevicePointer`) first faults their pages in from several threads
/// ([`prefault`]).
const PREFAULT_MIN_CHUNKS: usize = 8;

/// Threads that fault an area's pages in at most.
const PREFAULT_THREADS: usize = 8;

/// Faults the pages of `chunks` (indices of `chunk`-byte pieces) of `area` in, without
/// changing their contents (`MADV_POPULATE_WRITE`), from up to [`PREFAULT_THREADS`] threads.
/// `cuMemHostRegister` of a fresh shared mapping spends nearly all its time faulting pages in
/// one by one on one thread (~155 ms for 256 MiB on the H100 host against ~13 ms once the
/// pages are there: `gpu/tools/startup_probe.c`). Best effort: a kernel without
/// `MADV_POPULATE_WRITE` (before 5.14) leaves the faulting to the registration.
fn prefault(area: &DataArea, chunk: usize, chunks: &[usize]) {
    let threads = std::thread::available_parallelism()
        .map_or(1, |n| n.get())
        .clamp(1, PREFAULT_THREADS)
        .min(chunks.len());
    let t0 = std::time::Instant::now();
    std::thread::scope(|scope| {
        for part in chunks.chunks(chunks.len().div_ceil(threads)) {
            scope.spawn(move || {
                for &i in part {
                    let start = i * chunk;
                    let size = chunk.min(area.len() - start);
                    if area.populate(start as u64, size as u64).is_err() {
                        return;
                    }
                }
            });
        }
    });
    tracing::debug!(
        target: "remora::startup",
        chunks = chunks.len(),
        threads,
        us = t0.elapsed().as_micros() as u64,
        "data area pages faulted in before page-locking"
    );
}

/// Bytes at the start of each session's data area faulted in on a thread of their own as soon
/// as the session announces the area ([`fill_ahead`]). The client places copies first fit
/// from the area's start, so these are the chunks its first copies page-lock. A fresh chunk
/// took ~2.2 ms to page-lock on the H200 host, nearly all of it zero-filling 4 MiB of shared
/// memory one fault at a time; pages already there page-locked at 12 ms per 256 MiB on the
/// H100 host (~0.2 ms a chunk). Costs one thread for ~10 ms per session and this much memory
/// resident early.
const AREA_FILL_AHEAD: usize = 16 << 20;

/// Bytes [`fill_ahead`] faults in at a time, checking `stop` between pieces.
const FILL_PIECE: usize = 1 << 20;

/// Faults the first `bytes` of `area` in (`DataArea::populate`), piece by piece from its
/// start, until done or `stop` is set (the session detached the area). Holds `area`, so the
/// mapping stays until the piece in progress ends. Best effort: stops at the first error
/// (a kernel without `MADV_POPULATE_WRITE` leaves the faulting to the registrations).
fn fill_ahead(area: &DataArea, bytes: usize, stop: &AtomicBool) -> usize {
    let end = bytes.min(area.len());
    let t0 = std::time::Instant::now();
    let mut at = 0;
    while at < end && !stop.load(Ordering::Acquire) {
        let n = FILL_PIECE.min(end - at);
        if let Err(e) = area.populate(at as u64, n as u64) {
            tracing::debug!(target: "remora::startup", error = %e, "data area not faulted in ahead");
            break;
        }
        at += n;
    }
    tracing::debug!(
        target: "remora::startup",
        bytes = at,
        us = t0.elapsed().as_micros() as u64,
        "data area's first bytes faulted in ahead of its copies"
    );
    at
}

/// `CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`.
const ATTR_HOST_POINTER_FOR_REGISTERED_MEM: c_int = 91;

/// The real CUDA driver.
pub struct CudaBackend {
    driver: Option<Arc<Driver>>,
    /// Data areas of live shared-memory sessions, by base address.
    areas: std::sync::Mutex<std::collections::HashMap<usize, AreaReg>>,
    /// Completion-word pages of shared-memory sessions (`Backend::stream_signal`), by page
    /// address: the context that registered the page and the page's device address in each
    /// context that signalled through it.
    signal_pages: std::sync::Mutex<std::collections::HashMap<usize, SignalReg>>,
    /// Whether every device reaches registered host memory at its host address
    /// (`CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM`): then areas are registered in
    /// [`AREA_CHUNK`] pieces, whose device addresses are contiguous like their host ones.
    /// Otherwise an area is registered whole, so that mapped host memory (a kernel given a
    /// pointer into the area) sees one contiguous device range.
    chunked: bool,
    /// Stop flags of the [`fill_ahead`] threads of live areas, by base address.
    fills: std::sync::Mutex<std::collections::HashMap<usize, Arc<AtomicBool>>>,
    /// A context made before the session came (`Backend::prewarm`): the first
    /// `ctx_create` with the same device and flags takes it instead of paying for a new one.
    warm: std::sync::Mutex<Option<(i32, u32, u64)>>,
}

impl std::fmt::Debug for CudaBackend {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CudaBackend")
            .field("loaded", &self.driver.is_some())
            .finish()
    }
}

/// A completion-word page registered for the device (`cuMemHostRegister` with DEVICEMAP).
#[derive(Debug)]
struct SignalReg {
    /// The context it was registered in, current again to unregister it.
    ctx: u64,
    /// The page's device address, per context.
    dev: Vec<(u64, u64)>,
}

impl CudaBackend {
    /// A backend with no driver: zero devices, every call `CUDA_ERROR_NO_DEVICE`.
    pub fn unavailable() -> Self {
        Self {
            driver: None,
            areas: Default::default(),
            signal_pages: Default::default(),
            fills: Default::default(),
            chunked: false,
            warm: Default::default(),
        }
    }

    /// Loads the driver named by `REMORA_REAL_LIBCUDA` (default `libcuda.so.1`) and exposes the
    /// real devices `selection` (all when `None`) renumbered from 0. On failure returns the
    /// reason; callers fall back to [`CudaBackend::unavailable`].
    pub fn load(selection: Option<&[i32]>) -> Result<Self, String> {
        let lib = driver::open(&crate::driver::driver_library()).map_err(|e| match e {
            LoadError::NotFound(r) | LoadError::InitFailed(r) => r,
        })?;
        let count = need("cuDeviceGetCount", lib.device_count())?;
        let ordinals: Vec<i32> = match selection {
            Some(sel) => sel.to_vec(),
            None => (0..count).collect(),
        };
        let devices: Vec<c_int> = ordinals
            .into_iter()
            .map(|o| need(&format!("cuDeviceGet({o})"), lib.device(o)))
            .collect::<Result<_, _>>()?;
        let chunked = devices
            .iter()
            .all(|&d| lib.attribute(ATTR_HOST_POINTER_FOR_REGISTERED_MEM, d) == Ok(1));
        Ok(Self {
            driver: Some(Arc::new(Driver { lib, devices })),
            areas: Default::default(),
            signal_pages: Default::default(),
            fills: Default::default(),
            chunked,
            warm: Default::default(),
        })
    }

    fn d(&self) -> CuResult<&Driver> {
        self.driver.as_deref().ok_or(CuError(cu::NO_DEVICE))
    }

    fn in_ctx(&self, ctx: u64) -> CuResult<&Driver> {
        let d = self.d()?;
        d.enter(ctx)?;
        Ok(d)
    }

    fn areas(&self) -> std::sync::MutexGuard<'_, std::collections::HashMap<usize, AreaReg>> {
        self.areas
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Bytes page-locked at a time in an area of `len` bytes.
    fn chunk(&self, len: usize) -> usize {
        if self.chunked { AREA_CHUNK } else { len.max(1) }
    }

    /// The device address of the data-area byte at `offset`, whose chunk is registered.
    fn area_pointer(&self, ctx: u64, area: &DataArea, offset: u64) -> CuResult<u64> {
        let d = self.in_ctx(ctx)?;
        let mut dev = 0u64;
        let p = area.base().wrapping_add(offset as usize);
        // SAFETY: `p` lies inside the data area (checked by the executor), registered with
        // PORTABLE | DEVICEMAP where it lies and mapped; `dev` is a local output.
        call!(d.t, mem_host_get_device_pointer(&mut dev, p.cast(), 0))?;
        if self.chunked && dev != p as u64 {
            // Chunks registered apart are contiguous for the GPU only at their host
            // addresses; the device attribute promised that.
            tracing::warn!(
                "the driver mapped the session's data area away from its host address although the device reports CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM; answering CUDA_ERROR_NOT_SUPPORTED"
            );
            return Err(CuError(cu::NOT_SUPPORTED));
        }
        Ok(dev)
    }

    /// The driver, with `ctx` current, when `offset..offset + len` of `area` is page-locked
    /// for copies in `ctx`. The first copy of a session that [`Backend::area_attach`]
    /// announced fixes the context (registration needs a current one); each copy registers
    /// the chunks it touches that are not yet. `None`: use the private-buffer path. Callers
    /// split their copies at chunk boundaries ([`CudaBackend::pieces`]), so that no driver
    /// call spans two registrations.
    /// Queues `cuMemcpyDtoHAsync` of `copy` (`len` bytes) into its span of the area on
    /// `stream`, split at the area's chunk boundaries, once [`CudaBackend::area_dma`] has
    /// made them DMA-ready for the stream's context (`d`).
    fn dtoh_async_into_area(
        &self,
        d: &Driver,
        stream: u64,
        copy: AreaCopy<'_>,
        len: usize,
    ) -> CuResult<()> {
        let p: *mut u8 = copy.span.ptr()?;
        for (skip, n) in self.pieces(copy.span.area.len(), copy.span.offset, len) {
            // SAFETY: as in `memcpy_htod_area`'s pinned form: the DMA on `stream` writes
            // inside one registered chunk of the area (split by `pieces`), which outlives it
            // (synchronized before unregister).
            call!(
                d.t,
                memcpy_dtoh_async(
                    p.wrapping_add(skip).cast(),
                    copy.dev + skip as u64,
                    n,
                    ptr(stream)
                )
            )?;
        }
        Ok(())
    }

    fn area_dma(&self, ctx: u64, area: &DataArea, offset: u64, len: usize) -> Option<&Driver> {
        let base = area.base() as usize;
        let chunk = self.chunk(area.len());
        let mut areas = self.areas();
        let reg = areas.get_mut(&base)?;
        if *reg == AreaReg::Announced {
            *reg = AreaReg::Registered {
                ctx,
                chunk,
                chunks: vec![Chunk::Open; area.len().div_ceil(chunk)],
            };
        }
        let AreaReg::Registered { ctx: c, chunks, .. } = reg else {
            return None;
        };
        if *c != ctx {
            return None;
        }
        let d = self.in_ctx(ctx).ok()?;
        let offset = usize::try_from(offset).ok()?;
        if len == 0 {
            return Some(d);
        }
        let last = offset.checked_add(len - 1)?;
        if last >= area.len() {
            return None;
        }
        // Copies are split at chunk boundaries: only a mapping spans many chunks.
        if last / chunk - offset / chunk + 1 >= PREFAULT_MIN_CHUNKS {
            let open: Vec<usize> = (offset / chunk..=last / chunk)
                .filter(|&i| chunks.get(i) == Some(&Chunk::Open))
                .collect();
            if open.len() >= PREFAULT_MIN_CHUNKS {
                prefault(area, chunk, &open);
            }
        }
        for i in offset / chunk..=last / chunk {
            match chunks.get(i).copied()? {
                Chunk::Locked => continue,
                Chunk::Failed => return None,
                Chunk::Open => {}
            }
            let start = i * chunk;
            let size = chunk.min(area.len() - start);
            let t0 = std::time::Instant::now();
            // SAFETY: `start..start + size` lies inside the data area, a live shared mapping
            // of this process (page-aligned; chunks are multiples of 4096 bytes) that stays
            // mapped until `area_detach` has unregistered it: the executor's session keeps a
            // handle on it. No other registration covers it (each chunk is registered once).
            let r = call!(
                d.t,
                mem_host_register(
                    area.base().wrapping_add(start).cast(),
                    size,
                    HOST_REGISTER_PORTABLE | HOST_REGISTER_DEVICEMAP
                )
            );
            match r {
                Ok(()) => {
                    tracing::debug!(target: "remora::startup", chunk = i, bytes = size, us = t0.elapsed().as_micros() as u64, "data area chunk page-locked");
                    chunks[i] = Chunk::Locked;
                }
                Err(e) => {
                    if !chunks.contains(&Chunk::Failed) {
                        tracing::warn!(
                            result = e.0,
                            bytes = size,
                            "cuMemHostRegister of part of a session's shared data area failed; \
                             copies touching it go through private buffers"
                        );
                    }
                    chunks[i] = Chunk::Failed;
                    return None;
                }
            }
        }
        Some(d)
    }

    /// The pieces `(skip, len)` of a copy of `len` bytes at `offset` in an area of
    /// `area_len` bytes that each lie inside one registered chunk.
    fn pieces(&self, area_len: usize, offset: u64, len: usize) -> Vec<(usize, usize)> {
        let chunk = self.chunk(area_len);
        let mut out = Vec::new();
        let mut at = offset as usize;
        let end = at.saturating_add(len);
        while at < end {
            let next = ((at / chunk) + 1).saturating_mul(chunk).min(end);
            out.push((at - offset as usize, next - at));
            at = next;
        }
        out
    }

    /// Undoes the registrations of the area at `base` made in `ctx` (the `Locked` ones of
    /// `chunks`, each `chunk` bytes): waits for the context's work (the only DMA into the
    /// area, see [`CudaBackend::area_dma`]), then unregisters.
    /// The device address of the completion-word page at `page` in `ctx` (current),
    /// page-locking it for the device first if no context has.
    fn signal_page_device(&self, d: &Driver, ctx: u64, page: usize) -> CuResult<u64> {
        let mut pages = self
            .signal_pages
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some(reg) = pages.get(&page)
            && let Some(&(_, dev)) = reg.dev.iter().find(|(c, _)| *c == ctx)
        {
            return Ok(dev);
        }
        if let std::collections::hash_map::Entry::Vacant(slot) = pages.entry(page) {
            // SAFETY: `page` is the first page of a session's mapped shared region, which
            // stays mapped until `area_detach`, where it is unregistered first.
            call!(
                d.t,
                mem_host_register(
                    page as Ptr,
                    remora_shm::SIGNAL_PAGE,
                    HOST_REGISTER_PORTABLE | HOST_REGISTER_DEVICEMAP
                )
            )?;
            slot.insert(SignalReg {
                ctx,
                dev: Vec::new(),
            });
        }
        let mut dev = 0u64;
        // SAFETY: `page` is registered with DEVICEMAP (above); `dev` is a local output.
        call!(d.t, mem_host_get_device_pointer(&mut dev, page as Ptr, 0))?;
        if let Some(reg) = pages.get_mut(&page) {
            reg.dev.push((ctx, dev));
        }
        Ok(dev)
    }

    /// Unregisters the completion-word page at `page` (registered in `reg.ctx`, which is
    /// live), after the work of every context that wrote into it (the writes still queued
    /// must land while the page is mapped for the device).
    fn signal_page_unregister(&self, d: &Driver, page: usize, reg: &SignalReg) {
        let r = reg
            .dev
            .iter()
            .map(|&(c, _)| c)
            .filter(|&c| c != reg.ctx)
            .chain([reg.ctx])
            .try_for_each(|c| {
                d.enter(c)?;
                // SAFETY: no arguments; a live context of the session is current.
                call!(d.t, ctx_synchronize())
            })
            .and_then(|()| {
                // SAFETY: registered at exactly this address while `reg.ctx` (current now)
                // was, still mapped.
                call!(d.t, mem_host_unregister(page as Ptr))
            });
        if let Err(e) = r {
            tracing::warn!(
                result = e.0,
                "cuMemHostUnregister of a completion-word page failed"
            );
        }
    }

    fn area_unregister(&self, d: &Driver, ctx: u64, base: usize, chunks: &[Chunk], chunk: usize) {
        let r = d.enter(ctx).and_then(|()| {
            // SAFETY: no arguments; `ctx` is current.
            call!(d.t, ctx_synchronize())?;
            for (i, _) in chunks
                .iter()
                .enumerate()
                .filter(|(_, c)| **c == Chunk::Locked)
            {
                // SAFETY: this chunk was registered with cuMemHostRegister in `ctx` at
                // exactly this address and is still mapped (the caller holds the area or is
                // about to destroy `ctx`, which is live).
                call!(d.t, mem_host_unregister((base + i * chunk) as Ptr))?;
            }
            Ok(())
        });
        if let Err(e) = r {
            tracing::warn!(
                result = e.0,
                "cuMemHostUnregister of a shared data area failed"
            );
        }
    }
}

/// Issues a validated 2-D or 3-D copy (see [`Copy3d`]): `src_host`/`dst_host` point to the
/// packed host buffers of host sides (`packed_len()` bytes), else they are unused.
fn issue_3d(
    d: &Driver,
    stream: Option<u64>,
    c: &Copy3d,
    src_host: *const c_void,
    dst_host: Ptr,
) -> CuResult<()> {
    if c.is_peer() || c.form == CopyForm::ThreeD {
        let p = memcpy_3d(c, src_host, dst_host);
        // SAFETY (all arms): `p` describes ranges the executor checked against the session's
        // allocations and host buffers of exactly the packed size, alive for the call (an
        // asynchronous copy from pageable memory returns once the source is staged; an
        // asynchronous copy to host memory goes to pinned staging memory that outlives it).
        return match (c.is_peer(), stream) {
            (true, None) => call!(d.t, memcpy_3d_peer(&p)),
            (true, Some(s)) => call!(d.t, memcpy_3d_peer_async(&p, ptr(s))),
            (false, None) => call!(d.t, memcpy_3d(&p)),
            (false, Some(s)) => call!(d.t, memcpy_3d_async(&p, ptr(s))),
        };
    }
    let p = memcpy_2d(c, src_host, dst_host);
    // SAFETY (all arms): as above.
    match (c.form, stream) {
        (CopyForm::TwoDUnaligned, None) => call!(d.t, memcpy_2d_unaligned(&p)),
        (_, None) => call!(d.t, memcpy_2d(&p)),
        (_, Some(s)) => call!(d.t, memcpy_2d_async(&p, ptr(s))),
    }
}

/// Backend methods that make `ctx` current and hand their `u64` objects, as the pointers
/// the driver gave, to the entry point of the same name: `fn event_record(event, stream);`.
macro_rules! in_ctx_calls {
    ($(fn $name:ident($($arg:ident),*);)*) => {
        $(fn $name(&self, ctx: u64, $($arg: u64),*) -> CuResult<()> {
            let d = self.in_ctx(ctx)?;
            // SAFETY: every argument is a driver object of this session (a module, stream,
            // event, graph or executable graph the session table resolved, or
            // CU_STREAM_LEGACY); the entry point takes them by value and writes nothing.
            call!(d.t, $name($(ptr($arg)),*))
        })*
    };
}

impl Backend for CudaBackend {
    fn kind(&self) -> &'static str {
        "cuda"
    }

    fn driver_version(&self) -> CuResult<i32> {
        self.d()?.driver_version()
    }

    fn device_count(&self) -> CuResult<i32> {
        Ok(self.driver.as_ref().map_or(0, |d| d.devices.len() as i32))
    }

    fn device_props(&self, dev: i32) -> CuResult<DeviceProps> {
        let d = self.d()?;
        let cu = d.dev(dev)?;
        let total_memory = d.total_mem(cu)?;
        let uuid = d.uuid(cu)?;
        // Unknown attributes fail with INVALID_VALUE and are left out.
        let attributes = (1..=200)
            .filter_map(|attr| Some((attr, d.attribute(attr, cu).ok()?)))
            .collect();
        Ok(DeviceProps {
            name: d.name(cu)?,
            uuid,
            total_memory,
            pci_bus_id: d.pci_bus_id(cu)?,
            attributes,
        })
    }

    fn device_attribute(&self, attr: i32, dev: i32) -> CuResult<i32> {
        let d = self.d()?;
        d.attribute(attr, d.dev(dev)?)
    }

    fn ctx_create(&self, flags: u32, dev: i32) -> CuResult<u64> {
        let d = self.d()?;
        let warm = self
            .warm
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        match warm {
            Some((wd, wf, ctx)) if (wd, wf) == (dev, flags) => {
                tracing::debug!(target: "remora::startup", dev, flags, "context made before the session taken");
                return Ok(ctx);
            }
            Some((wd, wf, ctx)) => {
                tracing::debug!(target: "remora::startup", dev, flags, warm_dev = wd, warm_flags = wf, "the context made before the session does not match; destroyed");
                // SAFETY: a context this backend created and nobody has used.
                let _ = call!(d.t, ctx_destroy(ptr(ctx)));
                CTX_GENERATION.fetch_add(1, Ordering::AcqRel);
            }
            None => {}
        }
        let t0 = std::time::Instant::now();
        let mut c: Ptr = std::ptr::null_mut();
        // SAFETY: cuCtxCreate_v4 writes one CUcontext; ctxCreateParams may be NULL.
        call!(
            d.t,
            ctx_create(&mut c, std::ptr::null_mut(), flags, d.dev(dev)?)
        )?;
        // cuCtxCreate makes the new context current; forget what this thread had.
        CURRENT.with(|cur| cur.set((0, u64::MAX)));
        tracing::debug!(target: "remora::startup", dev, flags, us = t0.elapsed().as_micros() as u64, "context created");
        Ok(c as usize as u64)
    }

    fn prewarm(&self) {
        let Ok(d) = self.d() else { return };
        if d.devices.is_empty() {
            return;
        }
        match self.ctx_create(0, 0) {
            Ok(ctx) => {
                // SAFETY: NULL unbinds whatever context this thread has current.
                let _ = call!(d.t, ctx_set_current(std::ptr::null_mut()));
                CURRENT.with(|cur| cur.set((0, u64::MAX)));
                *self
                    .warm
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner) = Some((0, 0, ctx));
            }
            Err(e) => tracing::debug!(result = e.0, "no context made ahead of the session"),
        }
    }

    fn discard_warm(&self) {
        let warm = self
            .warm
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        let (Some((_, _, ctx)), Ok(d)) = (warm, self.d()) else {
            return;
        };
        // SAFETY: a context this backend created and no session has used.
        let _ = call!(d.t, ctx_destroy(ptr(ctx)));
        CTX_GENERATION.fetch_add(1, Ordering::AcqRel);
        tracing::debug!(target: "remora::startup", "the context made ahead of the session was not used; destroyed");
    }

    fn ctx_destroy(&self, ctx: u64) -> CuResult<()> {
        let d = self.d()?;
        let t0 = std::time::Instant::now();
        // Areas registered in this context are unregistered while it lives; their later
        // copies go through private buffers.
        for (base, reg) in self.areas().iter_mut() {
            if let AreaReg::Registered {
                ctx: c,
                chunk,
                chunks,
            } = reg
                && *c == ctx
            {
                self.area_unregister(d, ctx, *base, chunks, *chunk);
                *reg = AreaReg::Unregistered;
            }
        }
        {
            let mut pages = self
                .signal_pages
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            pages.retain(|&page, reg| {
                if reg.ctx == ctx {
                    self.signal_page_unregister(d, page, reg);
                    return false;
                }
                reg.dev.retain(|(c, _)| *c != ctx);
                true
            });
        }
        CTX_GENERATION.fetch_add(1, Ordering::AcqRel);
        let registrations = t0.elapsed();
        let staged = staging::forget_ctx(ctx);
        let (buffers, bytes) = (staged.len(), staged.iter().map(|&(_, c)| c).sum::<usize>());
        for (host, class) in staged {
            staging::free_pinned(d, ctx, host, class);
        }
        let staging = t0.elapsed() - registrations;
        // SAFETY: a context this backend created.
        let rc = call!(d.t, ctx_destroy(ptr(ctx)));
        // Part of a session's end (see `FreeTimes`): which of its steps took the time.
        tracing::debug!(
            target: "remora::startup",
            registrations_us = registrations.as_micros() as u64,
            staging_buffers = buffers,
            staging_bytes = bytes,
            staging_us = staging.as_micros() as u64,
            destroy_us = (t0.elapsed() - registrations - staging).as_micros() as u64,
            "context destroyed"
        );
        rc
    }

    // The calls that make `ctx` current and pass their objects to one entry point.
    in_ctx_calls! {
        fn ctx_synchronize();
        fn module_unload(module);
        fn stream_destroy(stream);
        fn stream_synchronize(stream);
        fn stream_query(stream);
        fn event_destroy(event);
        fn event_record(event, stream);
        fn event_synchronize(event);
        fn event_query(event);
        fn graph_launch(exec, stream);
        fn graph_upload(exec, stream);
        fn graph_exec_destroy(exec);
        fn graph_destroy(graph);
    }

    fn ctx_set_limit(&self, ctx: u64, limit: i32, value: u64) -> CuResult<()> {
        let d = self.in_ctx(ctx)?;
        // SAFETY: plain values.
        call!(d.t, ctx_set_limit(limit, value as usize))
    }

    fn ctx_get_limit(&self, ctx: u64, limit: i32) -> CuResult<u64> {
        let d = self.in_ctx(ctx)?;
        let mut v: usize = 0;
        // SAFETY: writes one size_t.
        call!(d.t, ctx_get_limit(&mut v, limit))?;
        Ok(v as u64)
    }

    fn ctx_get_api_version(&self, ctx: u64) -> CuResult<u64> {
        let d = self.in_ctx(ctx)?;
        let mut v: c_uint = 0;
        // SAFETY: a context of this session; writes one unsigned int.
        call!(d.t, ctx_get_api_version(ptr(ctx), &mut v))?;
        Ok(u64::from(v))
    }

    fn ctx_get_flags(&self, ctx: u64) -> CuResult<u64> {
        let d = self.in_ctx(ctx)?;
        let mut v: c_uint = 0;
        // SAFETY: writes one unsigned int; the context is current.
        call!(d.t, ctx_get_flags(&mut v))?;
        Ok(u64::from(v))
    }

    fn ctx_set_cache_config(&self, ctx: u64, value: u32) -> CuResult<()> {
        let config = c_int::try_from(value).map_err(|_| CuError(cu::INVALID_VALUE))?;
        let d = self.in_ctx(ctx)?;
        // SAFETY: a plain value (the driver checks it); the context is current.
        call!(d.t, ctx_set_cache_config(config))
    }

    fn ctx_get_cache_config(&self, ctx: u64) -> CuResult<u64> {
        let d = self.in_ctx(ctx)?;
        let mut v: c_int = 0;
        // SAFETY: writes one int; the context is current.
        call!(d.t, ctx_get_cache_config(&mut v))?;
        u64::try_from(v).map_err(|_| CuError(cu::INVALID_VALUE))
    }

    fn device_graph_mem_trim(&self, device: i32) -> CuResult<()> {
        let d = self.d()?;
        // SAFETY: a real device ordinal (mapped from the client's).
        call!(d.t, device_graph_mem_trim(d.dev(device)?))
    }

    fn device_get_graph_mem_attribute(&self, device: i32, attribute: i32) -> CuResult<u64> {
        let d = self.d()?;
        let (dev, mut v) = (d.dev(device)?, 0u64);
        // SAFETY: a real device ordinal; every CUgraphMem_attribute is a cuuint64_t, written
        // into a live cell.
        call!(
            d.t,
            device_get_graph_mem_attribute(dev, attribute, (&raw mut v).cast())
        )?;
        Ok(v)
    }

    fn device_set_graph_mem_attribute(
        &self,
        device: i32,
        attribute: i32,
        value: u64,
    ) -> CuResult<()> {
        let d = self.d()?;
        let (dev, mut v) = (d.dev(device)?, value);
        // SAFETY: a real device ordinal; the value is a cuuint64_t in a live cell.
        call!(
            d.t,
            device_set_graph_mem_attribute(dev, attribute, (&raw mut v).cast())
        )
    }

    fn ctx_reset_persisting_l2_cache(&self, ctx: u64) -> CuResult<()> {
        let d = self.in_ctx(ctx)?;
        // SAFETY: no arguments; the context is current.
        call!(d.t, ctx_reset_persisting_l2_cache())
    }

    fn stream_get_id(&self, ctx: u64, stream: u64) -> CuResult<u64> {
        let d = self.in_ctx(ctx)?;
        let mut v: u64 = 0;
        // SAFETY: a stream of this session or CU_STREAM_LEGACY; writes one unsigned long long.
        call!(d.t, stream_get_id(ptr(stream), &mut v))?;
        Ok(v)
    }

    fn ctx_stream_priority_range(&self, ctx: u64) -> CuResult<(i32, i32)> {
        let d = self.in_ctx(ctx)?;
        let (mut least, mut greatest) = (0 as c_int, 0 as c_int);
        // SAFETY: writes two ints.
        call!(
            d.t,
            ctx_get_stream_priority_range(&mut least, &mut greatest)
        )?;
        Ok((least, greatest))
    }

    fn stream_set_attribute(&self, ctx: u64, stream: u64, value: &RmStreamAttr) -> CuResult<()> {
        let d = self.in_ctx(ctx)?;
        let (kind, v) = remora_proto::stream_attr::to_abi(value);
        // SAFETY: a stream of this session (or CU_STREAM_LEGACY) and a complete 64-byte
        // CUstreamAttrValue that the driver only reads.
        call!(d.t, stream_set_attribute(ptr(stream), kind, &v))
    }

    fn stream_get_attribute(&self, ctx: u64, stream: u64, kind: i32) -> CuResult<RmStreamAttr> {
        let d = self.in_ctx(ctx)?;
        let mut v = [0u8; remora_proto::stream_attr::VALUE_BYTES];
        // SAFETY: the driver fills in one 64-byte CUstreamAttrValue.
        call!(d.t, stream_get_attribute(ptr(stream), kind, &mut v))?;
        remora_proto::stream_attr::from_abi(kind, &v).ok_or(CuError(cu::INVALID_VALUE))
    }

    fn tools_ctx_query(&self, ctx: u64, stream: u64, mask: u64, flag: u32) -> CuResult<u64> {
        let d = self.in_ctx(ctx)?;
        let mut table: *const c_void = std::ptr::null();
        // SAFETY: writes one pointer; the UUID is 16 readable bytes.
        call!(d.t, get_export_table(&mut table, &TOOLS_CONTEXT_UUID))?;
        let table = table.cast::<*const c_void>();
        let size = if table.is_null() {
            0
        } else {
            // SAFETY: a table the driver served begins with its size in bytes (observed on
            // driver 580: 0x2e8, 93 slots); it is read before any slot.
            (unsafe { *table }) as usize
        };
        if size <= 51 * size_of::<usize>() {
            tracing::error!(
                "the driver's TOOLS_CONTEXT table has {size} bytes, too few for slot 51: the query cuBLASLt makes cannot be answered (CUDA_ERROR_NOT_SUPPORTED)"
            );
            return Err(CuError(cu::NOT_SUPPORTED));
        }
        // SAFETY: slots 39 and 51 lie inside the table (checked above); their signatures were
        // observed on driver 580 (docs/export-tables.md): slot 51 writes one pointer, slot 39
        // one 32-bit answer into a zeroed 64-bit cell. The context is current and live.
        let (object_of, ask): (ToolsCtxObject, ToolsCtxAsk) = unsafe {
            (
                std::mem::transmute::<*const c_void, ToolsCtxObject>(*table.add(51)),
                std::mem::transmute::<*const c_void, ToolsCtxAsk>(*table.add(39)),
            )
        };
        let mut object: Ptr = std::ptr::null_mut();
        // SAFETY: see above; `object` is a writable pointer cell.
        // `stream` is 0 (the NULL stream) or a live stream of the context.
        check(unsafe { object_of(ptr(ctx), stream, &mut object, 0) })?;
        let mut answer: u64 = 0;
        // SAFETY: see above; `answer` is a writable, zeroed cell; mask and flag are plain values.
        check(unsafe { ask(ptr(ctx), object, &mut answer, mask, u64::from(flag)) })?;
        Ok(answer & u64::from(u32::MAX))
    }

    fn mem_alloc(&self, ctx: u64, size: u64) -> CuResult<u64> {
        let d = self.in_ctx(ctx)?;
        let mut p: u64 = 0;
        // SAFETY: writes one CUdeviceptr.
        call!(
            d.t,
            mem_alloc(
                &mut p,
                usize::try_from(size).map_err(|_| CuError(cu::OUT_OF_MEMORY))?
            )
        )?;
        Ok(p)
    }

    fn mem_alloc_pitch(
        &self,
        ctx: u64,
        width: u64,
        height: u64,
        elem: u32,
    ) -> CuResult<(u64, u64)> {
        let d = self.in_ctx(ctx)?;
        let (mut p, mut pitch) = (0u64, 0usize);
        // SAFETY: writes one CUdeviceptr and one size_t.
        call!(
            d.t,
            mem_alloc_pitch(&mut p, &mut pitch, width as usize, height as usize, elem)
        )?;
        Ok((p, pitch as u64))
    }

    fn mem_free(&self, ctx: u64, p: u64) -> CuResult<()> {
        let d = self.in_ctx(ctx)?;
        // SAFETY: an allocation of this session (checked by the caller).
        call!(d.t, mem_free(p))
    }

    fn mem_get_info(&self, ctx: u64) -> CuResult<(u64, u64)> {
        let d = self.in_ctx(ctx)?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: writes two size_t.
        call!(d.t, mem_get_info(&mut free, &mut total))?;
        Ok((free as u64, total as u64))
    }

    fn memcpy_htod(&self, ctx: u64, stream: Option<u64>, dst: u64, data: &[u8]) -> CuResult<()> {
        let d = self.in_ctx(ctx)?;
        let src = data.as_ptr().cast::<c_void>();
        match stream {
            // SAFETY: `data` is valid for its length; the destination range was checked
            // against the session's allocations. From pageable memory the async form returns
            // only once the bytes are staged, so `data` may be freed after the call.
            Some(s) => call!(d.t, memcpy_htod_async(dst, src, data.len(), ptr(s))),
            None => {
                if data.len() >= staging::SYNC_STAGING_MIN
                    && let Some(r) = self.with_pinned(ctx, data.len(), |d, pinned| {
                        // SAFETY: `pinned` holds at least `data.len()` bytes of this
                        // thread's alone; the copy from pinned memory is synchronous, so the
                        // buffer is free again when it returns.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                data.as_ptr(),
                                pinned.cast::<u8>(),
                                data.len(),
                            )
                        };
                        // SAFETY: as above; the destination range was checked.
                        call!(d.t, memcpy_htod(dst, pinned.cast_const(), data.len()))
                    })
                {
                    return r;
                }
                // SAFETY: as above.
                call!(d.t, memcpy_htod(dst, src, data.len()))
            }
        }
    }

    fn memcpy_dtoh_owned(
        &self,
        ctx: u64,
        src: u64,
        size: usize,
    ) -> Option<CuResult<remora_xdr::Bytes>> {
        if size < staging::SYNC_STAGING_MIN {
            return None;
        }
        // With `ctx` current; `None` (the caller's path reports a bad context) without it.
        let lease = self.pinned_lease(ctx, size)?;
        // SAFETY: the lease holds at least `size` bytes of pinned memory of this copy's alone;
        // the source range was checked.
        let r = call!(lease.driver().t, memcpy_dtoh(lease.ptr(), src, size));
        Some(r.map(|()| lease.into_bytes()))
    }

    fn memcpy_dtoh(&self, ctx: u64, dst: &mut [u8], src: u64) -> CuResult<()> {
        let d = self.in_ctx(ctx)?;
        if dst.len() >= staging::SYNC_STAGING_MIN
            && let Some(r) = self.with_pinned(ctx, dst.len(), |d, pinned| {
                // SAFETY: `pinned` holds at least `dst.len()` bytes of this thread's alone;
                // the source range was checked.
                call!(d.t, memcpy_dtoh(pinned, src, dst.len()))?;
                // SAFETY: the synchronous copy has completed: `pinned` holds the bytes.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        pinned.cast::<u8>().cast_const(),
                        dst.as_mut_ptr(),
                        dst.len(),
                    )
                };
                Ok(())
            })
        {
            return r;
        }
        // SAFETY: `dst` is writable for its length; the source range was checked.
        call!(d.t, memcpy_dtoh(dst.as_mut_ptr().cast(), src, dst.len()))
    }

    fn area_attach(&self, area: &DataArea) {
        if self.driver.is_some() && !area.is_empty() {
            let base = area.base() as usize;
            self.areas().insert(base, AreaReg::Announced);
            let stop = Arc::new(AtomicBool::new(false));
            let (held, flag) = (area.clone(), Arc::clone(&stop));
            let spawned = std::thread::Builder::new()
                .name("remora-area-fill".into())
                .spawn(move || fill_ahead(&held, AREA_FILL_AHEAD, &flag));
            if spawned.is_ok() {
                self.fills
                    .lock()
                    .unwrap_or_else(std::sync::PoisonError::into_inner)
                    .insert(base, stop);
            }
        }
    }

    fn area_device_pointer(&self, ctx: u64, area: &DataArea, offset: u64) -> CuResult<u64> {
        // A kernel may reach any byte of the area through the pointer (a client older than
        // revision 18 does not map its allocations one by one): all of it is page-locked
        // first (once).
        if self.area_dma(ctx, area, 0, area.len()).is_none() {
            tracing::warn!(
                "the session's shared data area is not page-locked (past --shm-lock-max, or cuMemHostRegister failed), so it cannot be mapped for the GPU; answering CUDA_ERROR_NOT_SUPPORTED"
            );
            return Err(CuError(cu::NOT_SUPPORTED));
        }
        self.area_pointer(ctx, area, offset)
    }

    fn area_map(&self, ctx: u64, area: &DataArea, offset: u64, size: u64) -> CuResult<u64> {
        let len = usize::try_from(size).map_err(|_| CuError(cu::INVALID_VALUE))?;
        if self.area_dma(ctx, area, offset, len).is_none() {
            tracing::debug!(
                offset,
                size,
                "part of the session's shared data area cannot be page-locked for the GPU (past --shm-lock-max, cuMemHostRegister failed, or another context registered the area); answering CUDA_ERROR_NOT_SUPPORTED"
            );
            return Err(CuError(cu::NOT_SUPPORTED));
        }
        self.area_pointer(ctx, area, offset)
    }

    fn area_detach(&self, area: &DataArea) {
        if let Some(stop) = self
            .fills
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .remove(&(area.base() as usize))
        {
            stop.store(true, Ordering::Release);
        }
        if let (Some(signals), Ok(d)) = (area.signals(), self.d()) {
            let page = signals.page() as usize;
            let reg = self
                .signal_pages
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner)
                .remove(&page);
            if let Some(reg) = reg {
                self.signal_page_unregister(d, page, &reg);
            }
        }
        let base = area.base() as usize;
        let reg = self.areas().remove(&base);
        if let (
            Some(AreaReg::Registered {
                ctx, chunk, chunks, ..
            }),
            Ok(d),
        ) = (reg, self.d())
        {
            self.area_unregister(d, ctx, base, &chunks, chunk);
        }
    }

    fn memcpy_htod_area(&self, ctx: u64, how: AreaHtod, copy: AreaCopy<'_>) -> CuResult<()> {
        let AreaCopy { dev: dst, span } = copy;
        let len = span.len_usize()?;
        // A plain asynchronous copy must have consumed the bytes when it returns (the client
        // reuses the space): from page-locked memory the driver would read them later.
        let dma = match how {
            AreaHtod::Async(_) => None,
            AreaHtod::Sync | AreaHtod::AsyncPinned(_) => {
                self.area_dma(ctx, span.area, span.offset, len)
            }
        };
        if let Some(d) = dma {
            let p: *const u8 = span.ptr()?.cast_const();
            for (skip, n) in self.pieces(span.area.len(), span.offset, len) {
                let (dst, p) = (dst + skip as u64, p.wrapping_add(skip).cast());
                match how.stream() {
                    // SAFETY: `p..p + n` lies inside one registered chunk of the area (bounds
                    // checked by `ptr`, split by `pieces`); from page-locked memory
                    // cuMemcpyHtoD returns once the copy is done. The client may write the
                    // bytes meanwhile: the device then gets some mix, as it would.
                    None => call!(d.t, memcpy_htod(dst, p, n))?,
                    // SAFETY: (`AsyncPinned`) `p..p + n` lies inside one registered chunk,
                    // which stays mapped and registered until `area_detach`/`ctx_destroy` has
                    // synchronized `ctx`, so the DMA that reads it later on `stream` (of
                    // `ctx`) never outlives the mapping.
                    Some(stream) => call!(d.t, memcpy_htod_async(dst, p, n, ptr(stream)))?,
                }
            }
            return Ok(());
        }
        self.memcpy_htod(ctx, how.stream(), dst, &span.read()?)
    }

    fn memcpy_dtoh_area(&self, ctx: u64, copy: AreaCopy<'_>) -> CuResult<()> {
        let len = copy.span.len_usize()?;
        let Some(d) = self.area_dma(ctx, copy.span.area, copy.span.offset, len) else {
            return buffered_dtoh_area(self, ctx, copy);
        };
        let p: *mut u8 = copy.span.ptr()?;
        for (skip, n) in self.pieces(copy.span.area.len(), copy.span.offset, len) {
            // SAFETY: `p + skip..p + skip + n` lies inside one registered chunk of the area
            // (bounds checked by `ptr`, split by `pieces`), writable shared memory;
            // cuMemcpyDtoH returns once the bytes are there.
            call!(
                d.t,
                memcpy_dtoh(p.wrapping_add(skip).cast(), copy.dev + skip as u64, n)
            )?;
        }
        Ok(())
    }

    fn memcpy_dtoh_async_area(&self, ctx: u64, stream: u64, copy: AreaCopy<'_>) -> CuResult<()> {
        let len = copy.span.len_usize()?;
        let Some(d) = self.area_dma(ctx, copy.span.area, copy.span.offset, len) else {
            return staged_dtoh_area(self, ctx, stream, copy);
        };
        self.dtoh_async_into_area(d, stream, copy, len)
    }

    fn memcpy_dtoh_async_in_area(
        &self,
        ctx: u64,
        stream: u64,
        copy: AreaCopy<'_>,
    ) -> Option<StagedResult> {
        let len = copy.span.len_usize().ok().filter(|&n| n > 0)?;
        self.area_dma(ctx, copy.span.area, copy.span.offset, len)?;
        // The client leaves the span alone until the copy is delivered.
        Some(self.in_area(ctx, stream, |d| {
            self.dtoh_async_into_area(d, stream, copy, len)
        }))
    }

    fn memcpy_dtoh_async(&self, ctx: u64, stream: u64, src: u64, size: usize) -> StagedResult {
        self.stage(ctx, stream, size, |d, host| {
            // SAFETY: `host` holds `size` bytes of pinned memory that outlive the copy (see
            // `stage`); the source range was checked by the caller.
            call!(d.t, memcpy_dtoh_async(host, src, size, ptr(stream)))
        })
    }

    fn memcpy_3d(&self, ctx: u64, stream: Option<u64>, io: Copy3dIo<'_>) -> CuResult<()> {
        let Copy3dIo {
            copy,
            src_host,
            dst_host,
        } = io;
        let d = self.in_ctx(ctx)?;
        let len = usize::try_from(copy.packed_len()).map_err(|_| CuError(cu::INVALID_VALUE))?;
        if (copy.src.place == CopyPlace::Host && src_host.len() != len)
            || (copy.dst.place == CopyPlace::Host && (dst_host.len() != len || stream.is_some()))
        {
            return Err(CuError(cu::INVALID_VALUE));
        }
        issue_3d(
            d,
            stream,
            copy,
            src_host.as_ptr().cast(),
            dst_host.as_mut_ptr().cast(),
        )
    }

    fn memcpy_3d_dtoh_async(&self, ctx: u64, stream: u64, copy: &Copy3d) -> StagedResult {
        if copy.dst.place != CopyPlace::Host || copy.src.place == CopyPlace::Host {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let len = usize::try_from(copy.packed_len()).map_err(|_| CuError(cu::INVALID_VALUE))?;
        self.stage(ctx, stream, len, |d, host| {
            issue_3d(d, Some(stream), copy, std::ptr::null(), host)
        })
    }

    fn memcpy_peer(&self, ctx: u64, stream: Option<u64>, copy: PeerCopy) -> CuResult<()> {
        let d = self.in_ctx(ctx)?;
        let PeerCopy {
            dst,
            dst_ctx,
            src,
            src_ctx,
            size,
        } = copy;
        let n = usize::try_from(size).map_err(|_| CuError(cu::INVALID_VALUE))?;
        match stream {
            // SAFETY: both ranges were checked against the session's allocations; the
            // contexts are the session's.
            Some(s) => call!(
                d.t,
                memcpy_peer_async(dst, ptr(dst_ctx), src, ptr(src_ctx), n, ptr(s))
            ),
            // SAFETY: as above.
            None => call!(d.t, memcpy_peer(dst, ptr(dst_ctx), src, ptr(src_ctx), n)),
        }
    }

    fn memcpy_dtod(&self, ctx: u64, stream: Option<u64>, copy: DtodCopy) -> CuResult<()> {
        let d = self.in_ctx(ctx)?;
        let DtodCopy { dst, src, size } = copy;
        match stream {
            // SAFETY: both ranges were checked against the session's allocations.
            Some(s) => call!(d.t, memcpy_dtod_async(dst, src, size as usize, ptr(s))),
            // SAFETY: as above.
            None => call!(d.t, memcpy_dtod(dst, src, size as usize)),
        }
    }

    fn memset(&self, ctx: u64, stream: Option<u64>, m: &Memset) -> CuResult<()> {
        let d = self.in_ctx(ctx)?;
        let (dst, value) = (m.dst, m.value);
        let n = usize_of(m.width)?;
        if m.height == 1 {
            // SAFETY (all arms): the range dst..dst+width*elem was checked by the caller.
            return match (m.elem, stream) {
                (1, None) => call!(d.t, memset_d8(dst, value as u8, n)),
                (2, None) => call!(d.t, memset_d16(dst, value as u16, n)),
                (4, None) => call!(d.t, memset_d32(dst, value, n)),
                (1, Some(s)) => call!(d.t, memset_d8_async(dst, value as u8, n, ptr(s))),
                (2, Some(s)) => call!(d.t, memset_d16_async(dst, value as u16, n, ptr(s))),
                (4, Some(s)) => call!(d.t, memset_d32_async(dst, value, n, ptr(s))),
                _ => Err(CuError(cu::INVALID_VALUE)),
            };
        }
        let (p, h) = (usize_of(m.pitch)?, usize_of(m.height)?);
        // SAFETY (all arms): the rows' span (pitch * (height - 1) + width * elem bytes from
        // dst) was checked by the caller.
        match (m.elem, stream) {
            (1, None) => call!(d.t, memset_d2d8(dst, p, value as u8, n, h)),
            (2, None) => call!(d.t, memset_d2d16(dst, p, value as u16, n, h)),
            (4, None) => call!(d.t, memset_d2d32(dst, p, value, n, h)),
            (1, Some(s)) => call!(d.t, memset_d2d8_async(dst, p, value as u8, n, h, ptr(s))),
            (2, Some(s)) => call!(d.t, memset_d2d16_async(dst, p, value as u16, n, h, ptr(s))),
            (4, Some(s)) => call!(d.t, memset_d2d32_async(dst, p, value, n, h, ptr(s))),
            _ => Err(CuError(cu::INVALID_VALUE)),
        }
    }

    fn module_load(&self, ctx: u64, image: &[u8]) -> CuResult<LoadedModule> {
        let d = self.in_ctx(ctx)?;
        if image.is_empty() {
            return Err(CuError(cu::INVALID_IMAGE));
        }
        // cuModuleLoadData reads a NUL-terminated PTX or a self-describing fatbin/cubin; a
        // NUL is appended so that text images are terminated.
        let mut owned = Vec::with_capacity(image.len() + 1);
        owned.extend_from_slice(image);
        owned.push(0);
        let mut m: Ptr = std::ptr::null_mut();
        let t0 = std::time::Instant::now();
        // SAFETY: `owned` is a readable image terminated by a NUL; writes one CUmodule.
        call!(d.t, module_load_data(&mut m, owned.as_ptr().cast()))?;
        let t1 = std::time::Instant::now();
        let functions = list_functions(d, m).inspect_err(|_| {
            // SAFETY: unloads the module loaded above.
            let _ = call!(d.t, module_unload(m));
        })?;
        tracing::debug!(
            target: "remora::module_load",
            bytes = image.len(),
            functions = functions.len(),
            load_us = (t1 - t0).as_micros() as u64,
            list_us = t1.elapsed().as_micros() as u64,
            "cuModuleLoadData and the function list"
        );
        Ok(LoadedModule {
            raw: m as usize as u64,
            functions,
        })
    }

    fn module_get_global(&self, ctx: u64, module: u64, name: &str) -> CuResult<(u64, u64)> {
        let d = self.in_ctx(ctx)?;
        let cname = CString::new(name).map_err(|_| CuError(cu::INVALID_VALUE))?;
        let (mut p, mut size) = (0u64, 0usize);
        // SAFETY: `cname` is NUL-terminated; writes one CUdeviceptr and one size_t.
        call!(
            d.t,
            module_get_global(&mut p, &mut size, ptr(module), cname.as_ptr())
        )?;
        Ok((p, size as u64))
    }

    fn func_load(&self, ctx: u64, func: u64) -> CuResult<()> {
        let d = self.in_ctx(ctx)?;
        if d.t.func_load.is_none() {
            // Drivers before 12.4 have neither cuFuncLoad nor lazily enumerated functions.
            return Ok(());
        }
        // SAFETY: `func` is a function of a module of this session.
        call!(d.t, func_load(ptr(func)))
    }

    fn func_get_attribute(&self, ctx: u64, func: u64, attr: i32) -> CuResult<i32> {
        let d = self.in_ctx(ctx)?;
        let mut v: c_int = 0;
        // SAFETY: writes one int; `func` is a function of this session.
        call!(d.t, func_get_attribute(&mut v, attr, ptr(func)))?;
        Ok(v)
    }

    fn func_set_attribute(&self, ctx: u64, func: u64, attr: i32, value: i32) -> CuResult<()> {
        let d = self.in_ctx(ctx)?;
        // SAFETY: plain values and a function of this session.
        call!(d.t, func_set_attribute(ptr(func), attr, value))
    }

    fn func_set_cache_config(&self, ctx: u64, func: u64, config: u32) -> CuResult<()> {
        let d = self.in_ctx(ctx)?;
        // SAFETY: as above.
        call!(d.t, func_set_cache_config(ptr(func), config as c_int))
    }

    fn occupancy_max_active_blocks(&self, ctx: u64, q: &Occupancy) -> CuResult<i32> {
        let d = self.in_ctx(ctx)?;
        let mut v: c_int = 0;
        let (block_size, smem) = (q.block_size, q.dynamic_smem as usize);
        // SAFETY: writes one int.
        call!(
            d.t,
            occupancy(&mut v, ptr(q.func), block_size, smem, q.flags)
        )?;
        Ok(v)
    }

    fn occupancy_max_active_clusters(&self, ctx: u64, spec: &LaunchSpec<'_>) -> CuResult<i32> {
        let d = self.in_ctx(ctx)?;
        let mut attrs = launch_attributes(spec.attrs);
        let config = launch_config(spec, &mut attrs);
        let mut n: c_int = 0;
        // SAFETY: writes one int; `config` and `attrs` outlive the call.
        call!(
            d.t,
            occupancy_max_active_clusters(&mut n, ptr(spec.function), &config)
        )?;
        Ok(n)
    }

    fn occupancy_max_potential_block_size(&self, ctx: u64, q: &Occupancy) -> CuResult<(i32, i32)> {
        let d = self.in_ctx(ctx)?;
        let &Occupancy {
            func,
            block_size: block_size_limit,
            dynamic_smem,
            flags,
        } = q;
        let (mut min_grid, mut block) = (0 as c_int, 0 as c_int);
        let smem = usize::try_from(dynamic_smem).map_err(|_| CuError(cu::INVALID_VALUE))?;
        if flags == 0 {
            // SAFETY: writes two ints; a NULL blockSizeToDynamicSMemSize callback means
            // `dynamicSMemSize` for every block size.
            call!(
                d.t,
                occupancy_max_potential_block_size(
                    &mut min_grid,
                    &mut block,
                    ptr(func),
                    std::ptr::null_mut(),
                    smem,
                    block_size_limit
                )
            )?;
        } else {
            // SAFETY: as above, with flags.
            call!(
                d.t,
                occupancy_max_potential_block_size_with_flags(
                    &mut min_grid,
                    &mut block,
                    ptr(func),
                    std::ptr::null_mut(),
                    smem,
                    block_size_limit,
                    flags
                )
            )?;
        }
        Ok((min_grid, block))
    }

    fn stream_signal(
        &self,
        ctx: u64,
        stream: u64,
        signals: &remora_shm::Signals,
        slot: usize,
        value: u64,
    ) -> CuResult<()> {
        if slot >= remora_shm::SIGNAL_SLOTS {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let d = self.in_ctx(ctx)?;
        let dev = self.signal_page_device(d, ctx, signals.page() as usize)?;
        let word = dev + (remora_shm::SIGNAL_OFFSET + slot * 8) as u64;
        // SAFETY: a stream of this session (or the legacy stream) and the device address of
        // a word inside the registered page.
        call!(d.t, stream_write_value64(ptr(stream), word, value, 0))
    }

    fn launch(&self, ctx: u64, spec: &LaunchSpec<'_>) -> CuResult<()> {
        let d = self.in_ctx(ctx)?;
        LAUNCH_BUFFERS.with(|cell| {
            // Reused per thread: a launch allocates nothing. Launches do not nest, so the
            // borrow cannot fail; if it ever did, fresh buffers serve.
            let mut fresh = (Vec::new(), Vec::new());
            let mut guard = cell.try_borrow_mut();
            let (aligned, args) = match guard.as_deref_mut() {
                Ok(b) => (&mut b.0, &mut b.1),
                Err(_) => (&mut fresh.0, &mut fresh.1),
            };
            launch_with(d, spec, aligned, args)
        })
    }

    fn stream_create(&self, ctx: u64, flags: u32, priority: i32) -> CuResult<u64> {
        let d = self.in_ctx(ctx)?;
        let mut s: Ptr = std::ptr::null_mut();
        // SAFETY: writes one CUstream.
        call!(d.t, stream_create(&mut s, flags, priority))?;
        Ok(s as usize as u64)
    }

    fn launch_host_func(&self, ctx: u64, stream: u64, f: super::HostFn) -> CuResult<()> {
        let d = self.in_ctx(ctx)?;
        let data = Box::into_raw(Box::new(f)).cast::<c_void>();
        // SAFETY: a stream of this session or CU_STREAM_LEGACY; `data` is a leaked
        // `Box<HostFn>` that `run_host_fn` takes back exactly once, when the driver calls it.
        let r = call!(d.t, launch_host_func(ptr(stream), Some(run_host_fn), data));
        if r.is_err() {
            // SAFETY: the driver refused the call, so it will never call `run_host_fn` with
            // `data`: take the box back here instead.
            drop(unsafe { Box::from_raw(data.cast::<super::HostFn>()) });
        }
        r
    }

    fn stream_wait_event(&self, ctx: u64, stream: u64, event: u64, flags: u32) -> CuResult<()> {
        let d = self.in_ctx(ctx)?;
        // SAFETY: a stream and an event of this session.
        call!(d.t, stream_wait_event(ptr(stream), ptr(event), flags))
    }

    fn event_create(&self, ctx: u64, flags: u32) -> CuResult<u64> {
        let d = self.in_ctx(ctx)?;
        let mut e: Ptr = std::ptr::null_mut();
        // SAFETY: writes one CUevent.
        call!(d.t, event_create(&mut e, flags))?;
        Ok(e as usize as u64)
    }

    fn event_elapsed(&self, ctx: u64, start: u64, end: u64) -> CuResult<f32> {
        let d = self.in_ctx(ctx)?;
        let mut ms = 0f32;
        // SAFETY: writes one float; both events belong to this session.
        call!(d.t, event_elapsed(&mut ms, ptr(start), ptr(end)))?;
        Ok(ms)
    }

    fn stream_begin_capture(&self, ctx: u64, stream: u64) -> CuResult<CaptureInfo> {
        let d = self.in_ctx(ctx)?;
        // SAFETY: a stream of this session (or CU_STREAM_LEGACY, which the driver refuses).
        call!(d.t, stream_begin_capture(ptr(stream), CAPTURE_MODE_RELAXED))?;
        self.stream_capture_info(ctx, stream)
    }

    fn stream_end_capture(&self, ctx: u64, stream: u64) -> CuResult<u64> {
        let d = self.in_ctx(ctx)?;
        let mut g: Ptr = std::ptr::null_mut();
        // SAFETY: a stream of this session; writes one CUgraph.
        call!(d.t, stream_end_capture(ptr(stream), &mut g))?;
        Ok(g as usize as u64)
    }

    fn stream_capture_info(&self, ctx: u64, stream: u64) -> CuResult<CaptureInfo> {
        let d = self.in_ctx(ctx)?;
        let (mut status, mut id, mut graph, mut n): (c_int, u64, Ptr, usize) =
            (0, 0, std::ptr::null_mut(), 0);
        // SAFETY: a stream of this session; writes the status, the id, one CUgraph and the
        // dependency count; the dependency and edge arrays are not asked for (NULL).
        call!(
            d.t,
            stream_get_capture_info(
                ptr(stream),
                &mut status,
                &mut id,
                &mut graph,
                std::ptr::null_mut(),
                std::ptr::null_mut(),
                &mut n
            )
        )?;
        Ok(CaptureInfo {
            status,
            id,
            graph: graph as usize as u64,
            dependencies: n as u64,
        })
    }

    fn graph_instantiate(&self, ctx: u64, graph: u64, flags: u64) -> CuResult<u64> {
        let d = self.in_ctx(ctx)?;
        let mut e: Ptr = std::ptr::null_mut();
        // SAFETY: a graph of this session; writes one CUgraphExec.
        call!(d.t, graph_instantiate(&mut e, ptr(graph), flags))?;
        Ok(e as usize as u64)
    }

    fn graph_node_count(&self, ctx: u64, graph: u64) -> CuResult<u64> {
        let d = self.in_ctx(ctx)?;
        let mut n: usize = 0;
        // SAFETY: a graph of this session; with a NULL array the driver only writes the count.
        call!(
            d.t,
            graph_get_nodes(ptr(graph), std::ptr::null_mut(), &mut n)
        )?;
        Ok(n as u64)
    }
}

/// `CUlaunchAttribute`s for the protocol's launch attributes.
/// Launches `spec` with `aligned` and `args` as scratch buffers.
fn launch_with(
    d: &Driver,
    spec: &LaunchSpec<'_>,
    aligned: &mut Vec<u64>,
    args: &mut Vec<Ptr>,
) -> CuResult<()> {
    // An 8-byte aligned copy of the parameters; kernelParams[i] points at parameter i.
    aligned.clear();
    aligned.resize(spec.params.len().div_ceil(8), 0);
    let base = aligned.as_mut_ptr().cast::<u8>();
    // SAFETY: `aligned` holds at least params.len() bytes and does not overlap `params`.
    unsafe { std::ptr::copy_nonoverlapping(spec.params.as_ptr(), base, spec.params.len()) };
    args.clear();
    args.extend(
        spec.layout
            .iter()
            // SAFETY: the executor checked offset + size <= params.len() for every parameter.
            .map(|&(off, _)| unsafe { base.add(off as usize) }.cast::<c_void>()),
    );
    let args_ptr = if args.is_empty() {
        std::ptr::null_mut()
    } else {
        args.as_mut_ptr()
    };
    if spec.attrs.is_empty() {
        // SAFETY: `args` and `aligned` outlive the call, which copies the parameter values.
        return call!(
            d.t,
            launch_kernel(
                ptr(spec.function),
                spec.grid[0],
                spec.grid[1],
                spec.grid[2],
                spec.block[0],
                spec.block[1],
                spec.block[2],
                spec.shared_mem_bytes,
                ptr(spec.stream),
                args_ptr,
                std::ptr::null_mut()
            )
        );
    }
    let mut attrs = launch_attributes(spec.attrs);
    let config = launch_config(spec, &mut attrs);
    // SAFETY: `config`, `attrs`, `args` and `aligned` outlive the call.
    call!(
        d.t,
        launch_kernel_ex(&config, ptr(spec.function), args_ptr, std::ptr::null_mut())
    )
}

/// The `CUlaunchConfig` of `spec`, pointing at `attrs`, its attributes (NULL when there are
/// none); `attrs` must outlive every use of it.
fn launch_config(spec: &LaunchSpec<'_>, attrs: &mut [LaunchAttribute]) -> LaunchConfig {
    LaunchConfig {
        grid: spec.grid,
        block: spec.block,
        shared_mem_bytes: spec.shared_mem_bytes,
        stream: ptr(spec.stream),
        attrs: if attrs.is_empty() {
            std::ptr::null_mut()
        } else {
            attrs.as_mut_ptr()
        },
        num_attrs: attrs.len() as c_uint,
    }
}

fn launch_attributes(attrs: &[RmLaunchAttr]) -> Vec<LaunchAttribute> {
    attrs
        .iter()
        .map(|a| {
            let mut v = LaunchAttribute {
                id: 0,
                pad: [0; 4],
                value: [0; 16],
            };
            match a {
                RmLaunchAttr::RmLaunchCooperative(x) => (v.id, v.value[0]) = (2, *x as u32),
                RmLaunchAttr::RmLaunchClusterDimension(c) => {
                    v.id = 4;
                    v.value[..3].copy_from_slice(&[c.x, c.y, c.z]);
                }
                RmLaunchAttr::RmLaunchClusterScheduling(x) => (v.id, v.value[0]) = (5, *x as u32),
                RmLaunchAttr::RmLaunchProgrammaticSerialization(x) => {
                    (v.id, v.value[0]) = (6, *x as u32)
                }
                RmLaunchAttr::RmLaunchPriority(x) => (v.id, v.value[0]) = (8, *x as u32),
                RmLaunchAttr::RmLaunchMemSyncDomain(x) => (v.id, v.value[0]) = (10, *x as u32),
            }
            v
        })
        .collect()
}

/// Every function of a module with its parameter layout.
fn list_functions(d: &Driver, m: Ptr) -> CuResult<Vec<FunctionInfo>> {
    let mut count: c_uint = 0;
    // SAFETY: writes one unsigned int.
    call!(d.t, module_get_function_count(&mut count, m))?;
    let count = count.min(remora_proto::remora::RM_MAX_FUNCTIONS);
    let mut funcs: Vec<Ptr> = vec![std::ptr::null_mut(); count as usize];
    if count > 0 {
        // SAFETY: `funcs` has room for `count` CUfunction values.
        call!(
            d.t,
            module_enumerate_functions(funcs.as_mut_ptr(), count, m)
        )?;
    }
    let mut out = Vec::with_capacity(funcs.len());
    for f in funcs {
        // With lazy loading (CUDA's default since 12.2) an enumerated function is not loaded:
        // cuFuncGetAttribute, occupancy queries and launches would answer
        // CUDA_ERROR_FUNCTION_NOT_LOADED. The executor loads each one before its first use
        // (`Backend::func_load`): PyTorch's libraries bring tens of modules of hundreds of
        // functions, of which a run uses few.
        let mut name: *const c_char = std::ptr::null();
        // SAFETY: writes a pointer to a NUL-terminated name owned by the driver.
        call!(d.t, func_get_name(&mut name, f))?;
        let name = if name.is_null() {
            String::new()
        } else {
            // SAFETY: non-null, NUL-terminated, valid while the module is loaded.
            unsafe { CStr::from_ptr(name) }
                .to_string_lossy()
                .into_owned()
        };
        let mut params = Vec::new();
        let (mut i, mut loaded) = (0, false);
        while i < remora_proto::remora::RM_MAX_PARAM_COUNT as usize {
            let (mut off, mut size) = (0usize, 0usize);
            // SAFETY: writes two size_t; fails with cu::INVALID_VALUE past the last parameter.
            match call!(d.t, func_get_param_info(f, i, &mut off, &mut size)) {
                Ok(()) => params.push((off as u32, size as u32)),
                Err(CuError(PARAM_INFO_END)) => break,
                // A driver that wants the function loaded to describe its parameters.
                Err(CuError(cu::FUNCTION_NOT_LOADED)) if !loaded && d.t.func_load.is_some() => {
                    // SAFETY: `f` is a function of the module just loaded.
                    call!(d.t, func_load(f))?;
                    loaded = true;
                    continue;
                }
                Err(e) => return Err(e),
            }
            i += 1;
        }
        out.push(FunctionInfo {
            name,
            raw: f as usize as u64,
            params,
        });
    }
    Ok(out)
}

/// A size from the wire as the driver's `size_t` (`CUDA_ERROR_INVALID_VALUE` past it).
fn usize_of(v: u64) -> CuResult<usize> {
    usize::try_from(v).map_err(|_| CuError(cu::INVALID_VALUE))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Regression (first GPU run): cuCtxSynchronize resolved at 13000 is
    /// `cuCtxSynchronize_v2(CUcontext)`; the `(void)` form must be requested.
    #[test]
    fn ctx_synchronize_is_requested_in_its_void_form() {
        assert!(requested_version("cuCtxSynchronize") < 13000);
        assert_eq!(requested_version("cuMemAlloc"), CUDA_VERSION);
    }

    #[test]
    fn attributes_are_encoded_at_their_ids() {
        let a = launch_attributes(&[
            RmLaunchAttr::RmLaunchClusterDimension(remora_proto::remora::RmDim3 {
                x: 2,
                y: 1,
                z: 1,
            }),
            RmLaunchAttr::RmLaunchPriority(-3),
        ]);
        assert_eq!((a[0].id, &a[0].value[..3]), (4, &[2, 1, 1][..]));
        assert_eq!((a[1].id, a[1].value[0] as i32), (8, -3));
    }

    #[test]
    fn fill_ahead_stops_at_its_bytes_the_area_end_or_when_told() {
        let region = |mib: u64| {
            remora_shm::Region::create(
                "remora-fill-test",
                remora_shm::Layout {
                    ring_capacity: 4096,
                    data_size: mib << 20,
                },
            )
            .unwrap()
        };
        let (r, go) = (region(4), AtomicBool::new(false));
        let area = r.data_area();
        area.write(3 << 20, b"kept").unwrap();
        let done = fill_ahead(&area, 3 << 20 | 100, &go);
        if done == 0 {
            eprintln!("skipped: this kernel has no MADV_POPULATE_WRITE");
            return;
        }
        // Whole pieces up to the bytes asked for (the last one shorter), never past them.
        assert_eq!(done, 3 << 20 | 100);
        let mut kept = [0u8; 4];
        area.read(3 << 20, &mut kept).unwrap();
        assert_eq!(&kept, b"kept");
        // Past the area's end: its length.
        assert_eq!(fill_ahead(&region(2).data_area(), 16 << 20, &go), 2 << 20);
        // Told to stop: nothing more.
        let stop = AtomicBool::new(true);
        assert_eq!(fill_ahead(&region(2).data_area(), 16 << 20, &stop), 0);
    }
}
