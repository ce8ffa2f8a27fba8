//! [`Session`] methods for managed memory (`cuMemAllocManaged`) and the coherence hooks every
//! call passes through ([`crate::mirror`] explains the model).
//!
//! A managed allocation is built from the virtual memory calls (revision 10): a reserved range
//! aligned to the allocation granularity, one physical allocation mapped over all of it, read-
//! write access for its device, and zeros written. The range is exclusively the allocation's,
//! so the host memory mapped at the same address here (over the PROT_NONE reservation that
//! unified addressing already holds) covers whole pages that nothing else uses.

use std::ffi::c_void;

use rustix::mm::{MapFlags, ProtFlags};

use super::*;
use crate::host::{DeviceView, HostRange};
use crate::mirror::{self, Backing, Mirror};

/// `CU_MEM_ATTACH_GLOBAL`.
const ATTACH_GLOBAL: u32 = 0x1;
/// `CU_MEM_ATTACH_HOST`.
const ATTACH_HOST: u32 = 0x2;
/// `CU_MEM_ATTACH_SINGLE`.
const ATTACH_SINGLE: u32 = 0x4;
/// Managed allocations above this are refused: each has a second host copy (the snapshot)
/// and is compared before launches and copied back after synchronizations.
const MAX_MANAGED_BYTES: u64 = 1 << 36;
/// Call-profile rows for the coherence work inside calls (not counted again in the total).
const PUSH_ROW: &str = "(within calls: mirror push)";
const PULL_ROW: &str = "(within calls: mirror pull)";
/// Marks the copy ids of mirrors read back by `RM_CTX_SYNCHRONIZE_READ` (the low bits are the
/// mirror's device address); asynchronous copies count up from 1 and never reach it, and
/// device output's id (all ones) is never made so, as device addresses stay below 2^62.
const MIRROR_READ_ID: u64 = 1 << 62;

fn page_round(n: u64) -> u64 {
    n.next_multiple_of(rustix::param::page_size() as u64)
}

impl Session {
    /// `cuMemAllocManaged`: device memory at an address that this process maps too; host and
    /// device views are made coherent at launches and synchronizations.
    pub fn mem_alloc_managed(&self, ctx: RmHandle, size: u64, flags: u32) -> CuResult<u64> {
        if size == 0 || !(flags == ATTACH_GLOBAL || flags == ATTACH_HOST) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        if size > MAX_MANAGED_BYTES {
            tracing::warn!(
                "remora: cuMemAllocManaged of {size} bytes: Remora keeps managed memory coherent by copying it, up to {MAX_MANAGED_BYTES} bytes per allocation; returning CUDA_ERROR_OUT_OF_MEMORY (use cuMemAlloc and explicit copies)"
            );
            return Err(CuError(cu::OUT_OF_MEMORY));
        }
        self.mirrored_alloc(ctx, size, false, "cuMemAllocManaged")
    }

    /// The allocation properties, device and granularity of mirrored device memory in `ctx`.
    pub(super) fn mirror_prop(&self, ctx: RmHandle) -> CuResult<(RmMemProp, DeviceHandle, u64)> {
        let (prop, dev) = self.mirror_location(ctx)?;
        let granularity = self.mem_get_granularity(ctx, prop.clone(), 0)?.max(1);
        Ok((prop, dev, granularity))
    }

    /// The allocation properties and device of mirrored device memory in `ctx` (no call).
    fn mirror_location(&self, ctx: RmHandle) -> CuResult<(RmMemProp, DeviceHandle)> {
        let dev = self.ctx_device(ctx)?;
        let prop = RmMemProp {
            r#type: 1,        // CU_MEM_ALLOCATION_TYPE_PINNED
            location_type: 1, // CU_MEM_LOCATION_TYPE_DEVICE
            location_id: dev,
            ..RmMemProp::default()
        };
        Ok((prop, dev))
    }

    /// Reserves a device address range for `size` bytes (rounded up to `granularity`: the
    /// span) and maps zero-filled read-write host pages at the same address here, over the
    /// PROT_NONE reservation that unified addressing made. Nothing backs the device side yet.
    /// Returns (base, span).
    pub(super) fn reserve_same_address(
        &self,
        ctx: RmHandle,
        size: u64,
        granularity: u64,
        what: &'static str,
    ) -> CuResult<(u64, u64)> {
        let span = size
            .max(1)
            .checked_next_multiple_of(granularity)
            .ok_or(CuError(cu::OUT_OF_MEMORY))?;
        let base = self.mem_address_reserve(ctx, span, granularity, 0, 0)?;
        // SAFETY: [base, base + page_round(size)) lies inside the PROT_NONE reservation that
        // `mem_address_reserve` made in this process for unified addressing (span is a multiple
        // of the granularity, itself a multiple of the page); nothing else maps it, and
        // replacing it with fresh zero-filled read-write pages affects only that range. The
        // pages are made PROT_NONE again by `release_same_address`.
        let mapped = unsafe {
            rustix::mm::mmap_anonymous(
                base as usize as *mut c_void,
                page_round(size.max(1)) as usize,
                ProtFlags::READ | ProtFlags::WRITE,
                MapFlags::PRIVATE | MapFlags::FIXED,
            )
        };
        if let Err(e) = mapped {
            tracing::warn!(
                "remora: {what}: mapping host memory at {base:#x} failed: {e}; returning CUDA_ERROR_OUT_OF_MEMORY"
            );
            let _ = self.mem_address_free(ctx, base, span);
            return Err(CuError(cu::OUT_OF_MEMORY));
        }
        Ok((base, span))
    }

    /// Undoes [`Session::reserve_same_address`]: the host pages become the PROT_NONE
    /// reservation again (another allocation may share its chunk) and the range is freed.
    pub(super) fn release_same_address(
        &self,
        ctx: RmHandle,
        base: u64,
        size: u64,
        span: u64,
    ) -> CuResult<()> {
        self.va.hide(base, page_round(size.max(1)));
        self.mem_address_free(ctx, base, span)
    }

    /// Device memory from the virtual memory calls with the same address mapped read-write
    /// in this process, zeroed, and registered as a mirror: managed memory, or mapped host
    /// memory on a session without a data area (`mapped_host`).
    pub(super) fn mirrored_alloc(
        &self,
        ctx: RmHandle,
        size: u64,
        mapped_host: bool,
        what: &'static str,
    ) -> CuResult<u64> {
        self.need_revision(10, what)?;
        let (prop, dev, granularity) = self.mirror_prop(ctx)?;
        let (base, span) = self.reserve_same_address(ctx, size, granularity, what)?;
        let handle = match self.back_managed(ctx, base, span, prop, dev) {
            Ok(h) => h,
            Err(e) => {
                let _ = self.release_same_address(ctx, base, size, span);
                return Err(e);
            }
        };
        if let Err(e) = self.memset(&RmMemsetArgs {
            ctx,
            stream: u64::from(RM_STREAM_LEGACY),
            dst: base,
            value: 0,
            element_size: 1,
            count: span,
        }) {
            let _ = self.mem_unmap(ctx, base, span);
            let _ = self.mem_release(ctx, handle);
            let _ = self.release_same_address(ctx, base, size, span);
            return Err(e);
        }
        let backing = Backing::Managed { handle, span };
        let mut mirror = Mirror::zeroed(base, base, size, ctx, backing);
        mirror.mapped_host = mapped_host;
        self.mirrors.insert(mirror);
        tracing::debug!("remora: {what}: mirrored allocation {base:#x}+{size:#x} (span {span:#x})");
        Ok(base)
    }

    /// Gives host memory outside a data area a device copy, so that kernels can use it as
    /// mapped memory: device memory at the same address for an allocation whose address is
    /// reserved on the device ([`DeviceView::Reserved`]), at a new address for a registered
    /// range. The host's bytes are copied there and the pair becomes a mirror (coherent at
    /// launches and synchronizations). Returns the device address of `r.base`.
    pub(super) fn mirror_host_range(&self, r: HostRange, ctx: RmHandle) -> CuResult<u64> {
        const WHAT: &str = "mapped host memory";
        let _one_at_a_time = lock(&self.mirroring);
        // Another thread may have mirrored it meanwhile.
        let r = self
            .host
            .find(r.base)
            .filter(|f| f.base == r.base)
            .unwrap_or(r);
        let ctx = if r.ctx != 0 { r.ctx } else { ctx };
        let size = r.size.max(1);
        let (base, span) = match r.view {
            DeviceView::Mirrored { dev } => return Ok(dev),
            DeviceView::Reserved { span } => (r.base, span),
            DeviceView::Private => {
                self.need_revision(10, WHAT)?;
                let (_, _, granularity) = self.mirror_prop(ctx)?;
                let span = size
                    .checked_next_multiple_of(granularity)
                    .ok_or(CuError(cu::OUT_OF_MEMORY))?;
                (
                    self.mem_address_reserve(ctx, span, granularity, 0, 0)?,
                    span,
                )
            }
        };
        let (prop, dev) = self.mirror_location(ctx)?;
        let unreserve = || {
            if r.view == DeviceView::Private {
                let _ = self.mem_address_free(ctx, base, span);
            }
        };
        let handle = self
            .back_managed(ctx, base, span, prop, dev)
            .inspect_err(|_| unreserve())?;
        // SAFETY: a tracked host range: allocated pages of the session, or memory the program
        // registered and keeps mapped until it unregisters it (CUDA's contract).
        let host =
            unsafe { std::slice::from_raw_parts(r.base as usize as *const u8, size as usize) };
        if let Err(e) = self.memcpy_htod(ctx, u64::from(RM_STREAM_LEGACY), base, host) {
            let _ = self.mem_unmap(ctx, base, span);
            let _ = self.mem_release(ctx, handle);
            unreserve();
            return Err(e);
        }
        let backing = Backing::Managed { handle, span };
        let mut mirror = Mirror::agreed_on(r.base, base, ctx, backing, host.to_vec());
        mirror.mapped_host = true;
        self.mirrors.insert(mirror);
        self.host
            .set_view(r.base, DeviceView::Mirrored { dev: base });
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            tracing::info!(
                "remora: host memory outside a shared data area is used as mapped memory: the server keeps a device copy of it, made coherent before launches and copies and after synchronizations (each costs a comparison and copies of the mapped bytes; see docs/architecture.md)"
            );
        });
        tracing::debug!(
            "remora: {WHAT}: {:#x}+{size:#x} mirrored at device address {base:#x}",
            r.base
        );
        Ok(base)
    }

    /// Unified addressing lets a program hand a kernel the host pointer of page-locked
    /// memory directly, without asking `cuMemHostGetDevicePointer`. Before a launch (or a
    /// kernel node) with a pointer-sized parameter (8 bytes, per the function's `layout`)
    /// pointing into an allocation whose address is reserved on the device but not yet
    /// backed ([`DeviceView::Reserved`]), that allocation gets its device copy, as if the
    /// pointer had been asked for. Only whole 8-byte parameters count: a pair of 32-bit
    /// parameters can look like a host address (a high half of 0x7fxx), and a mirrored
    /// allocation costs a comparison of its bytes before every launch from then on (an
    /// H100 CNN run over tcp slowed 100-fold so). Pointers inside structures or stored in
    /// memory are not seen: ask for them first (`cuMemHostGetDevicePointer`).
    pub(super) fn map_pointed_host_memory(&self, ctx: RmHandle, params: &[u8], layout: &[RmParam]) {
        if !self.host.has_reserved() {
            return;
        }
        let words = layout
            .iter()
            .filter(|p| p.size == 8)
            .filter_map(|p| params.get(p.offset as usize..p.offset as usize + 8));
        for word in words {
            let Ok(word) = <[u8; 8]>::try_from(word) else {
                continue;
            };
            let Some(r) = self.host.reserved_at(u64::from_ne_bytes(word)) else {
                continue;
            };
            match self.mirror_host_range(r, ctx) {
                // Said once per allocation (it is mirrored from now on): the mirror costs a
                // comparison of its bytes before every launch, which a large allocation
                // matched by a word that only looks like a pointer makes visible.
                Ok(_) => tracing::warn!(
                    "remora: a kernel parameter points into page-locked host memory {:#x}+{:#x}: it now has a device copy, compared with the host before each launch and copied back after synchronizations",
                    r.base,
                    r.size
                ),
                Err(e) => tracing::warn!(
                    "remora: a kernel parameter points into page-locked host memory at {:#x} that could not be mapped for the device ({e}); the kernel will not reach it",
                    r.base
                ),
            }
        }
    }

    /// Before a host function on `stream`: enqueues an asynchronous copy of every mirror of
    /// `ctx` back to the host, on that stream, so that the function sees what device work
    /// before it wrote to managed (and mapped) memory. Their bytes arrive before the function
    /// runs (as every copy before a host function does); the function's wrapper merges them
    /// with [`crate::mirror::Mirrors::merge_read_back`]. Nothing when there is no mirror.
    pub(super) fn read_mirrors_before(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
    ) -> Vec<(u64, mirror::ReadBack)> {
        if !self.mirrors.active() || mirror::in_coherence() {
            return Vec::new();
        }
        let list: Vec<(u64, u64)> = {
            let st = self.mirrors.lock();
            st.list
                .values()
                .filter(|m| m.ctx == ctx)
                .map(|m| (m.dev, m.size))
                .collect()
        };
        let mut out = Vec::new();
        for (dev, size) in list {
            let buf = mirror::ReadBack::default();
            let sink_buf = Arc::clone(&buf);
            let sink: crate::CopySink = Box::new(move |data: &[u8]| {
                lock(&sink_buf).extend_from_slice(data);
            });
            let r = mirror::guarded(|| self.memcpy_dtoh_async(ctx, stream, dev, size, sink));
            match r {
                Some(Ok(())) => out.push((dev, buf)),
                Some(Err(e)) => tracing::error!(
                    "remora: reading managed memory {dev:#x}+{size:#x} back for a host function failed: {e}; the function sees the host's bytes"
                ),
                None => {}
            }
        }
        out
    }

    /// The physical allocation behind a managed range, mapped and accessible.
    fn back_managed(
        &self,
        ctx: RmHandle,
        base: u64,
        span: u64,
        prop: RmMemProp,
        dev: DeviceHandle,
    ) -> CuResult<RmHandle> {
        let handle = self.mem_create(ctx, span, prop, 0)?;
        let mapped = self.mem_map(ctx, base, span, 0, handle, 0).and_then(|()| {
            let rw = RmMemAccess {
                location_type: 1,
                location_id: dev,
                flags: 3, // CU_MEM_ACCESS_FLAGS_PROT_READWRITE
            };
            self.mem_set_access(ctx, base, span, vec![rw])
        });
        if let Err(e) = mapped {
            let _ = self.mem_unmap(ctx, base, span);
            let _ = self.mem_release(ctx, handle);
            return Err(e);
        }
        Ok(handle)
    }

    /// `cuMemFree` of a managed allocation (`cuMemFreeHost` of mapped host memory, or
    /// `cuMemHostUnregister` of a mirrored registered range, when `mapped_host`): `None` when
    /// `dev` is not one.
    pub(super) fn mem_free_mirrored(&self, dev: u64, mapped_host: bool) -> Option<CuResult<()>> {
        let m = self.mirrors.remove(dev, mapped_host)?;
        let Backing::Managed { handle, span } = m.backing;
        let ctx = m.ctx;
        let r = self
            .mem_unmap(ctx, dev, span)
            .and_then(|()| self.mem_release(ctx, handle))
            .and_then(|()| {
                if m.host == m.dev {
                    self.release_same_address(ctx, dev, m.size, span)
                } else {
                    self.mem_address_free(ctx, dev, span)
                }
            });
        Some(r)
    }

    /// Frees the mirrored allocations (managed and mapped host memory) of a context being
    /// destroyed.
    pub(super) fn free_managed_of(&self, ctx: RmHandle) {
        for base in self.mirrors.of_context(ctx) {
            let r = self
                .mem_free_mirrored(base, false)
                .or_else(|| self.mem_free_mirrored(base, true));
            if let Some(Err(e)) = r {
                tracing::debug!(
                    "remora: freeing managed memory {base:#x} of a destroyed context: {e}"
                );
            }
        }
    }

    /// The managed allocation containing `ptr`: (base, size).
    pub fn managed_range(&self, ptr: u64) -> Option<(u64, u64)> {
        self.mirrors.find_managed(ptr)
    }

    /// `cuMemPrefetchAsync` and `cuMemAdvise`: hints. Remora's managed memory lives on the
    /// device between synchronizations anyway, so they only check that `[ptr, ptr + count)`
    /// is managed memory, as CUDA does.
    pub fn managed_hint(&self, ptr: u64, count: u64) -> CuResult<()> {
        match self.managed_range(ptr) {
            Some((base, size)) if count > 0 && ptr - base + count <= size => Ok(()),
            _ => Err(CuError(cu::INVALID_VALUE)),
        }
    }

    /// `cuStreamAttachMemAsync`: checks the arguments; attaching changes nothing in Remora's
    /// model (the host may touch managed memory only while no kernel runs, whatever stream
    /// it is attached to).
    pub fn stream_attach_mem(&self, ptr: u64, length: u64, flags: u32) -> CuResult<()> {
        if ![ATTACH_GLOBAL, ATTACH_HOST, ATTACH_SINGLE].contains(&flags) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        match self.managed_range(ptr) {
            Some((base, size)) if ptr == base && (length == 0 || length == size) => Ok(()),
            _ => Err(CuError(cu::INVALID_VALUE)),
        }
    }

    /// Runs the remote procedure `proc` (`f`) with the coherence hooks: push host changes of
    /// managed memory before a call that lets the device use memory, pull the device's bytes
    /// after a call that completes device work. One atomic load when there is no managed
    /// memory.
    pub(super) fn coherent<T, E>(
        &self,
        proc: &'static str,
        f: impl FnOnce() -> Result<T, E>,
    ) -> Result<T, E> {
        if invalidates_occupancy(proc) {
            lock(&self.occupancy).clear();
        }
        let Some(profile) = &self.profile else {
            return self.coherent_unprofiled(proc, f);
        };
        let start = std::time::Instant::now();
        let r = self.coherent_unprofiled(proc, f);
        profile.record(proc, start.elapsed());
        r
    }

    fn coherent_unprofiled<T, E>(
        &self,
        proc: &'static str,
        f: impl FnOnce() -> Result<T, E>,
    ) -> Result<T, E> {
        if !self.mirrors.active() || mirror::in_coherence() {
            return f();
        }
        let class = mirror::classify(proc);
        if class.submits {
            if !crate::in_host_callback() {
                self.mirrors.wait_host_fns(proc);
            }
            self.profiled_within(PUSH_ROW, || self.mirror_push(proc));
        }
        let r = f();
        if class.submits {
            self.mirrors.lock().submitted += 1;
        }
        if class.completes && r.is_ok() {
            self.profiled_within(PULL_ROW, || self.mirror_pull(proc));
        }
        r
    }

    /// Runs `f`, a part of a call's time, as row `row` of the call profile (when profiling).
    pub(super) fn profiled_within<T>(&self, row: &'static str, f: impl FnOnce() -> T) -> T {
        match &self.profile {
            Some(profile) => {
                let start = std::time::Instant::now();
                let r = f();
                profile.record(row, start.elapsed());
                r
            }
            None => f(),
        }
    }

    /// After a query that reported completion: pull, as after a synchronization.
    pub(super) fn completed(&self, what: &'static str) {
        if self.mirrors.active() && !mirror::in_coherence() {
            self.mirror_pull(what);
        }
    }

    /// Copies the host changes of every managed allocation to the device (and waits for them,
    /// so that work on any stream sees them). Skipped while a stream capture is active: a
    /// synchronous copy would invalidate it, and nothing captured runs before the graph
    /// launch, which pushes again.
    fn mirror_push(&self, why: &'static str) {
        if !lock(&self.captures).active.is_empty() {
            return;
        }
        mirror::guarded(|| {
            let mut st = self.mirrors.lock();
            let mut pushed_ctx = Vec::new();
            for m in st.list.values_mut() {
                // SAFETY: a mirror's host range stays mapped while it is in the list, and the
                // list is locked.
                let host = unsafe { m.host_bytes() };
                for run in m.dirty_runs(host) {
                    let res = self.memcpy_htod(
                        m.ctx,
                        u64::from(RM_STREAM_LEGACY),
                        m.dev + run.start as u64,
                        &host[run.clone()],
                    );
                    match res {
                        Ok(()) => m.agreed(host, run),
                        Err(e) => tracing::error!(
                            "remora: {why}: copying managed memory {:#x}+{:#x} to the device failed: {e}",
                            m.dev + run.start as u64,
                            run.len()
                        ),
                    }
                    if !pushed_ctx.contains(&m.ctx) {
                        pushed_ctx.push(m.ctx);
                    }
                }
            }
            drop(st);
            for ctx in pushed_ctx {
                if let Err(e) = self.ctx_synchronize_unsettled(ctx) {
                    tracing::error!(
                        "remora: {why}: waiting for managed memory to reach the device failed: {e}"
                    );
                }
            }
        });
    }

    /// When device work was submitted since the last pull: waits for the contexts of managed
    /// memory, then copies every managed allocation back into its host pages.
    fn mirror_pull(&self, why: &'static str) {
        mirror::guarded(|| {
            let mut st = self.mirrors.lock();
            if st.submitted == st.pulled {
                return;
            }
            let epoch = st.submitted;
            let mut ctxs: Vec<RmHandle> = st.list.values().map(|m| m.ctx).collect();
            ctxs.sort_unstable();
            ctxs.dedup();
            // After cuCtxSynchronize, its context has nothing outstanding to wait for.
            ctxs.retain(|c| Some(*c) != mirror::synchronized_ctx());
            for ctx in ctxs {
                if let Err(e) = self.ctx_synchronize_unsettled(ctx) {
                    tracing::debug!(
                        "remora: {why}: synchronizing before reading managed memory back failed: {e}"
                    );
                }
            }
            let mut pulled = Vec::new();
            let mut failed = false;
            for (&key, m) in st.list.iter_mut() {
                let mut device = m.pull_buffer();
                let legacy = u64::from(RM_STREAM_LEGACY);
                match self.memcpy_dtoh_unsettled(m.ctx, legacy, m.dev, &mut device) {
                    Ok(()) => pulled.push((key, m.dev, Pulled::Buffer(device))),
                    Err(e) => {
                        tracing::error!(
                            "remora: {why}: reading managed memory {:#x}+{:#x} back from the device failed: {e}; the host keeps its bytes",
                            m.dev,
                            m.size
                        );
                        m.return_buffer(device);
                        failed = true;
                    }
                }
            }
            merge_pulled(&mut st, why, pulled, (!failed).then_some(epoch));
        });
    }

    /// `cuCtxSynchronize` and the managed-memory pull after it in one round trip
    /// (`RM_CTX_SYNCHRONIZE_READ`, revision 13), when every mirror belongs to `ctx` and they
    /// fit one call: the server reads them back once the context is idle. `None` when this
    /// does not apply (the caller synchronizes and the hooks pull as before). The mirror lock
    /// is not held during the call: host functions the synchronize waits for take it.
    pub(super) fn ctx_synchronize_reading(&self, ctx: RmHandle) -> Option<CuResult<RmSyncReply>> {
        if self.welcome.revision < 13 || !self.mirrors.active() || mirror::in_coherence() {
            return None;
        }
        let (epoch, ranges) = {
            let st = self.mirrors.lock();
            if st.submitted == st.pulled
                || st.list.len() > RM_MAX_READ_RANGES as usize
                || st.list.values().any(|m| m.ctx != ctx)
                || st.list.values().map(|m| m.size).sum::<u64>() > u64::from(RM_MAX_READ_BYTES)
            {
                return None;
            }
            let ranges: Vec<RmReadRange> = st
                .list
                .iter()
                .map(|(&key, m)| RmReadRange {
                    id: MIRROR_READ_ID | key,
                    ptr: m.dev,
                    size: m.size,
                })
                .collect();
            (st.submitted, ranges)
        };
        let args = RmCtxSyncReadArgs { ctx, ranges };
        let mut reply = match call!(self.rm_ctx_synchronize_read(&args)) {
            Ok(r) => r,
            Err(e) => return Some(Err(e)),
        };
        if reply.status != 0 {
            return Some(Ok(reply));
        }
        // Ours by id (device output keeps its own id, which is not among them).
        let devs: HashMap<u64, u64> = args.ranges.iter().map(|r| (r.id, r.ptr)).collect();
        let (read, rest): (Vec<_>, Vec<_>) = std::mem::take(&mut reply.copies)
            .into_iter()
            .partition(|c| devs.contains_key(&c.copy_id));
        reply.copies = rest;
        let pulled = read
            .into_iter()
            .filter_map(|c| {
                let dev = *devs.get(&c.copy_id)?;
                Some((c.copy_id & !MIRROR_READ_ID, dev, Pulled::Reply(c.data)))
            })
            .collect();
        let complete = args.ranges.len();
        mirror::guarded(|| {
            let mut st = self.mirrors.lock();
            let all = st.list.len() == complete;
            merge_pulled(&mut st, "cuCtxSynchronize", pulled, all.then_some(epoch));
        });
        Some(Ok(reply))
    }
}

/// A mirror's bytes read back from the device.
enum Pulled {
    /// Into a [`Mirror::pull_buffer`].
    Buffer(Vec<u8>),
    /// In a reply (`RM_CTX_SYNCHRONIZE_READ`).
    Reply(remora_proto::remora::RmBytes),
}

impl Pulled {
    fn len(&self) -> usize {
        match self {
            Pulled::Buffer(b) => b.len(),
            Pulled::Reply(b) => b.len(),
        }
    }
}

/// Merges device bytes read back (mirror key, the device address they were read from, bytes)
/// into the mirrors still there at that address; marks the pull done up to `epoch` when
/// given (every mirror was read); logs, once, host changes of managed memory made while
/// device work was outstanding.
fn merge_pulled(
    st: &mut mirror::MirrorState,
    why: &str,
    pulled: Vec<(u64, u64, Pulled)>,
    epoch: Option<u64>,
) {
    let mut kept = 0;
    for (key, dev, device) in pulled {
        let Some(m) = st.list.get_mut(&key) else {
            continue;
        };
        if m.dev != dev || m.size as usize != device.len() {
            continue;
        }
        // SAFETY: the mirror's host range is mapped read-write while it is in the (locked)
        // list; CUDA's model for managed memory makes the program leave it alone during a
        // synchronizing call.
        let host =
            unsafe { std::slice::from_raw_parts_mut(m.host as usize as *mut u8, m.size as usize) };
        let k = match device {
            // The pull's buffer becomes the snapshot as it is (no second pass over it).
            Pulled::Buffer(device) => m.merge_pulled_owned(host, device),
            // Copied into the snapshot's pages, which are mapped already.
            Pulled::Reply(device) => m.merge_pulled(host, &device),
        };
        // Mapped host memory may change while kernels run (copies land in it, and natively
        // the program may write it): only managed memory breaks a rule.
        if !m.mapped_host {
            kept += k;
        }
    }
    if let Some(epoch) = epoch {
        st.pulled = st.pulled.max(epoch);
    }
    // Pages a host function changed are the program's right (CUDA lets host functions use
    // managed memory): kept and pushed later, as any host change, but not logged.
    let by_host_fns = std::mem::take(&mut st.host_fns_ran) > 0;
    if kept > 0 && !by_host_fns && !st.conflict_logged {
        st.conflict_logged = true;
        tracing::warn!(
            "remora: {why}: the program changed {kept} page(s) of managed memory while device work was outstanding (CUDA forbids that on devices without concurrent managed access); the host's bytes were kept and go to the device before the next launch"
        );
    }
}
