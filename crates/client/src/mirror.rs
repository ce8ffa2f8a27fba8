//! Host mirrors of device memory: the bookkeeping behind managed memory (`cuMemAllocManaged`).
//!
//! A managed allocation is one address that both the program (in this process) and kernels
//! (on the server's GPU) use. Remora gives it device memory on the server and maps ordinary
//! host memory at the *same address* in this process (the address is already reserved here for
//! unified addressing, so nothing else lives there). The two copies are kept coherent with the
//! model CUDA itself defines for devices that report `concurrentManagedAccess = 0`: the host
//! may touch managed memory only while no kernel runs, and the driver makes it coherent at
//! every launch and every synchronization point.
//!
//! * **Host → device ("push")**, before any call that lets the device read memory (launches,
//!   graph launches, copies, memsets): the pages whose bytes differ from the *snapshot* (the
//!   bytes host and device last agreed on) are copied to the device.
//! * **Device → host ("pull")**, after any call that tells the program the device's work is
//!   complete (context/stream/event synchronize, successful queries, synchronous copies), when
//!   device work was submitted since the last pull: the context is synchronized and every
//!   mirror is copied back. A page the host changed meanwhile (which CUDA forbids while a kernel
//!   may run) keeps the host's bytes and is pushed later; it is logged once, never lost.
//!
//! No signal handler and no page protection are involved: the snapshot comparison finds host
//! writes. The cost is a second host copy of each managed allocation, a comparison of it
//! before each launch, and a full copy back after each synchronization that follows device
//! work (see docs/architecture.md, "Managed memory").

use std::cell::Cell;
use std::collections::BTreeMap;
use std::ops::Range;
use std::sync::atomic::{AtomicBool, Ordering};

use remora_proto::remora::RmHandle;

/// Pages compared and copied as units.
pub(crate) const MIRROR_PAGE: usize = 4096;

/// One host mirror of device memory.
#[derive(Debug)]
pub(crate) struct Mirror {
    /// The address the program uses on the host (for managed memory and mapped host
    /// allocations the device address too; a registered range has its copy elsewhere).
    pub(crate) host: u64,
    /// The device address of the same bytes.
    pub(crate) dev: u64,
    /// Bytes the program asked for.
    pub(crate) size: u64,
    /// The context the device memory belongs to (synchronized before a pull).
    pub(crate) ctx: RmHandle,
    /// What the device memory is, for freeing it.
    pub(crate) backing: Backing,
    /// Mapped host memory (`cuMemHostAlloc` with `CU_MEMHOSTALLOC_DEVICEMAP` on a session
    /// without a shared data area): host memory to the program, not managed memory.
    pub(crate) mapped_host: bool,
    /// The bytes host and device last agreed on.
    snapshot: Vec<u8>,
    /// The snapshot before the last pull, kept (up to [`SPARE_MAX_BYTES`]) for the next pull to
    /// read the device's bytes into: a fresh buffer of that size is faulted in page by page
    /// as the copy fills it (0.8-0.9 ms for 4 MiB on the CPU side of the H200 host), an old
    /// one is already mapped. Empty until the first pull.
    spare: Vec<u8>,
}

/// Mirrors up to this size keep a spare buffer for pulls ([`Mirror::pull_buffer`]); bigger
/// ones get a fresh buffer per pull, so that a large allocation costs two host copies and not
/// three between pulls.
pub(crate) const SPARE_MAX_BYTES: u64 = 256 << 20;

/// The server-side resources behind a mirror.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Backing {
    /// A `cuMemAddressReserve` range of `span` bytes with physical allocation `handle`
    /// mapped over all of it (managed memory: the range is exclusively this allocation's).
    Managed { handle: RmHandle, span: u64 },
}

impl Mirror {
    /// A mirror whose host and device bytes both start as zeros.
    pub(crate) fn zeroed(host: u64, dev: u64, size: u64, ctx: RmHandle, backing: Backing) -> Self {
        Self {
            host,
            dev,
            size,
            ctx,
            backing,
            mapped_host: false,
            snapshot: vec![0; size as usize],
            spare: Vec::new(),
        }
    }

    /// A mirror whose host and device bytes both hold `snapshot` (just copied to the device).
    pub(crate) fn agreed_on(
        host: u64,
        dev: u64,
        ctx: RmHandle,
        backing: Backing,
        snapshot: Vec<u8>,
    ) -> Self {
        Self {
            host,
            dev,
            size: snapshot.len() as u64,
            ctx,
            backing,
            mapped_host: false,
            snapshot,
            spare: Vec::new(),
        }
    }

    /// The host bytes.
    ///
    /// # Safety
    /// `[host, host + size)` must be mapped readable for as long as the slice is used (the
    /// mirror's owner keeps it mapped until the mirror is removed).
    pub(crate) unsafe fn host_bytes<'a>(&self) -> &'a [u8] {
        // SAFETY: per this function's contract.
        unsafe { std::slice::from_raw_parts(self.host as usize as *const u8, self.size as usize) }
    }

    /// The page runs where the host bytes differ from the snapshot, as byte ranges.
    pub(crate) fn dirty_runs(&self, host: &[u8]) -> Vec<Range<usize>> {
        diff_runs(host, &self.snapshot)
    }

    /// Records that host and device agree on `range` (after pushing it).
    pub(crate) fn agreed(&mut self, host: &[u8], range: Range<usize>) {
        self.snapshot[range.clone()].copy_from_slice(&host[range]);
    }

    /// Merges `device` (the device's bytes, just copied back) into `host` page by page: a page
    /// the host left alone since the last agreement takes the device's bytes; a page the host
    /// changed keeps them (they are pushed next time). The snapshot becomes `device`. Returns
    /// how many pages kept host bytes.
    pub(crate) fn merge_pulled(&mut self, host: &mut [u8], device: &[u8]) -> usize {
        let kept = self.merge_pages(host, device);
        self.snapshot.copy_from_slice(device);
        kept
    }

    /// [`Mirror::merge_pulled`] of bytes the caller gives up: they become the snapshot as
    /// they are, without another pass over them, and the old snapshot becomes the next
    /// [`Mirror::pull_buffer`] (for mirrors up to [`SPARE_MAX_BYTES`]).
    pub(crate) fn merge_pulled_owned(&mut self, host: &mut [u8], device: Vec<u8>) -> usize {
        let kept = self.merge_pages(host, &device);
        let old = std::mem::replace(&mut self.snapshot, device);
        self.return_buffer(old);
        kept
    }

    /// A buffer of the mirror's size for a pull to copy the device's bytes into (its contents
    /// are whatever was there: the copy overwrites all of it): the spare one when there is
    /// one, else a fresh one. Give it back through [`Mirror::merge_pulled_owned`], or
    /// [`Mirror::return_buffer`] when the pull failed.
    pub(crate) fn pull_buffer(&mut self) -> Vec<u8> {
        let spare = std::mem::take(&mut self.spare);
        if spare.len() == self.size as usize {
            spare
        } else {
            vec![0; self.size as usize]
        }
    }

    /// Keeps `buffer` of the mirror's size (a [`Mirror::pull_buffer`] that a failed pull did
    /// not fill, or a replaced snapshot) for the next pull, up to [`SPARE_MAX_BYTES`].
    pub(crate) fn return_buffer(&mut self, buffer: Vec<u8>) {
        if buffer.len() == self.size as usize && self.size <= SPARE_MAX_BYTES {
            self.spare = buffer;
        }
    }

    /// The page-by-page merge of [`Mirror::merge_pulled`], leaving the snapshot as it was.
    fn merge_pages(&self, host: &mut [u8], device: &[u8]) -> usize {
        let mut kept = 0;
        for start in (0..host.len()).step_by(MIRROR_PAGE) {
            let end = (start + MIRROR_PAGE).min(host.len());
            let (h, s, d) = (
                &mut host[start..end],
                &self.snapshot[start..end],
                &device[start..end],
            );
            if h == s {
                h.copy_from_slice(d);
            } else if h != d {
                kept += 1;
            }
        }
        kept
    }
}

/// Page-granular runs where `a` and `b` differ (same length), merged when adjacent.
fn diff_runs(a: &[u8], b: &[u8]) -> Vec<Range<usize>> {
    let mut runs: Vec<Range<usize>> = Vec::new();
    for start in (0..a.len()).step_by(MIRROR_PAGE) {
        let end = (start + MIRROR_PAGE).min(a.len());
        if a[start..end] != b[start..end] {
            match runs.last_mut() {
                Some(r) if r.end == start => r.end = end,
                _ => runs.push(start..end),
            }
        }
    }
    runs
}

/// The mirrors of a session and the device-work epochs that say when a pull is due.
#[derive(Debug, Default)]
pub(crate) struct Mirrors {
    /// Whether any mirror exists: the calls' hooks cost one load when none does.
    active: AtomicBool,
    pub(crate) state: std::sync::Mutex<MirrorState>,
    /// Host functions enqueued while mirrors existed and not yet run (see
    /// [`Mirrors::wait_host_fns`]).
    host_fns: std::sync::Mutex<u64>,
    host_fns_done: std::sync::Condvar,
}

/// The mirrors, by device address, and the epochs.
#[derive(Debug, Default)]
pub(crate) struct MirrorState {
    pub(crate) list: BTreeMap<u64, Mirror>,
    /// Calls that let the device write memory, counted.
    pub(crate) submitted: u64,
    /// `submitted` as it was when the last pull began.
    pub(crate) pulled: u64,
    /// Whether the "host changed managed memory while the device was busy" line was logged.
    pub(crate) conflict_logged: bool,
    /// Host functions that ran since the last pull: host changes they made are allowed
    /// (CUDA lets a host function use managed memory), so the pull does not call them a
    /// conflict.
    pub(crate) host_fns_ran: u64,
}

impl Mirrors {
    pub(crate) fn active(&self) -> bool {
        self.active.load(Ordering::Acquire)
    }

    pub(crate) fn lock(&self) -> std::sync::MutexGuard<'_, MirrorState> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub(crate) fn insert(&self, m: Mirror) {
        let mut s = self.lock();
        s.list.insert(m.dev, m);
        self.active.store(true, Ordering::Release);
    }

    /// Removes the mirror at `dev` when it is mapped host memory (`mapped_host`) or managed
    /// memory (`!mapped_host`), as the freeing call expects.
    pub(crate) fn remove(&self, dev: u64, mapped_host: bool) -> Option<Mirror> {
        let mut s = self.lock();
        if s.list.get(&dev)?.mapped_host != mapped_host {
            return None;
        }
        let m = s.list.remove(&dev);
        self.active.store(!s.list.is_empty(), Ordering::Release);
        m
    }

    /// The managed-memory mirror containing device address `ptr`: (base, size).
    pub(crate) fn find_managed(&self, ptr: u64) -> Option<(u64, u64)> {
        if !self.active() {
            return None;
        }
        let s = self.lock();
        s.list
            .range(..=ptr)
            .next_back()
            .filter(|(b, m)| ptr - **b < m.size.max(1) && !m.mapped_host)
            .map(|(b, m)| (*b, m.size))
    }

    /// A host function counted by [`HostFnGate::enter`] has run (or never will).
    fn host_fn_ran(&self) {
        let mut n = self.host_fns.lock().unwrap_or_else(|e| e.into_inner());
        *n = n.saturating_sub(1);
        drop(n);
        self.lock().host_fns_ran += 1;
        self.host_fns_done.notify_all();
    }

    /// Waits until every counted host function has run. A host function may write managed
    /// or mapped memory that device work enqueued after it reads; that work is submitted
    /// here only once the function's writes can be pushed first. A host function never waits
    /// for work enqueued after it (it runs when its stream reaches it), so this ends; it logs
    /// while it waits long.
    pub(crate) fn wait_host_fns(&self, why: &str) {
        let mut n = self.host_fns.lock().unwrap_or_else(|e| e.into_inner());
        let mut waited = 0u32;
        while *n > 0 {
            let (guard, timeout) = self
                .host_fns_done
                .wait_timeout(n, std::time::Duration::from_secs(10))
                .unwrap_or_else(|e| e.into_inner());
            n = guard;
            if timeout.timed_out() && *n > 0 {
                waited += 10;
                tracing::warn!(
                    "remora: {why} has waited {waited} s for {} host function(s) enqueued before it: with managed or mapped memory, device work after a host function is submitted once the function has run, so that what it wrote reaches the device first",
                    *n
                );
            }
        }
    }

    /// The device addresses of the mirrors of context `ctx`.
    pub(crate) fn of_context(&self, ctx: RmHandle) -> Vec<u64> {
        self.lock()
            .list
            .values()
            .filter(|m| m.ctx == ctx)
            .map(|m| m.dev)
            .collect()
    }
}

/// The device's bytes of one mirror, read back for a host function.
pub(crate) type ReadBack = std::sync::Arc<std::sync::Mutex<Vec<u8>>>;

impl Mirrors {
    /// Merges bytes read back before a host function ([`ReadBack`] per device address) into
    /// the mirrors still alive, as a pull does (pages the host changed keep the host's bytes).
    pub(crate) fn merge_read_back(&self, read: &[(u64, ReadBack)]) {
        if read.is_empty() {
            return;
        }
        let mut st = self.lock();
        for (dev, buf) in read {
            let device = buf.lock().unwrap_or_else(|e| e.into_inner());
            let Some(m) = st.list.get_mut(dev) else {
                continue;
            };
            if device.len() != m.size as usize {
                tracing::error!(
                    "remora: managed memory {dev:#x} read back for a host function came with {} of {} bytes; the function sees the host's bytes",
                    device.len(),
                    m.size
                );
                continue;
            }
            // SAFETY: the mirror's host range is mapped read-write while it is in the
            // (locked) list; the host function is the program's only code touching it now, as
            // CUDA's model for managed memory requires.
            let host = unsafe {
                std::slice::from_raw_parts_mut(m.host as usize as *mut u8, m.size as usize)
            };
            m.merge_pulled(host, &device);
        }
    }
}

/// Held by the wrapper of a host function enqueued while mirrors exist, from the enqueue
/// until the function has run or is dropped unrun (a failed enqueue, a lost connection):
/// [`Mirrors::wait_host_fns`] waits for every gate to be gone.
pub(crate) struct HostFnGate(Option<std::sync::Arc<Mirrors>>);

impl HostFnGate {
    /// A gate counted in `mirrors` when any mirror exists, else an empty one.
    pub(crate) fn enter(mirrors: &std::sync::Arc<Mirrors>) -> Self {
        if !mirrors.active() {
            return Self(None);
        }
        *mirrors.host_fns.lock().unwrap_or_else(|e| e.into_inner()) += 1;
        Self(Some(std::sync::Arc::clone(mirrors)))
    }
}

impl Drop for HostFnGate {
    fn drop(&mut self) {
        if let Some(m) = self.0.take() {
            m.host_fn_ran();
        }
    }
}

/// What a remote procedure means for mirrors, by its name.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct ProcClass {
    /// The device may read or write memory: push before, count as device work.
    pub(crate) submits: bool,
    /// When it returns successfully, CUDA says the work it waited for is complete: pull after.
    pub(crate) completes: bool,
}

/// Classifies a protocol procedure (the generated client method's name).
pub(crate) fn classify(proc: &str) -> ProcClass {
    let submits = proc == "rm_launch_kernel"
        || proc == "rm_graph_launch"
        || proc.starts_with("rm_memcpy")
        || proc.starts_with("rm_area_memcpy")
        || proc.starts_with("rm_memset");
    let completes = matches!(
        proc,
        "rm_ctx_synchronize" | "rm_stream_synchronize" | "rm_event_synchronize"
    ) || (submits
        && proc != "rm_launch_kernel"
        && proc != "rm_graph_launch"
        && !proc.ends_with("_async"));
    ProcClass { submits, completes }
}

thread_local! {
    /// Set while this thread pushes or pulls, so that the calls doing it skip the hooks.
    static IN_COHERENCE: Cell<bool> = const { Cell::new(false) };
}

/// Runs `f` with the hooks off on this thread; `None` when they already were (a nested call).
pub(crate) fn guarded<T>(f: impl FnOnce() -> T) -> Option<T> {
    if IN_COHERENCE.with(Cell::get) {
        return None;
    }
    IN_COHERENCE.with(|c| c.set(true));
    struct Reset;
    impl Drop for Reset {
        fn drop(&mut self) {
            IN_COHERENCE.with(|c| c.set(false));
        }
    }
    let _reset = Reset;
    Some(f())
}

thread_local! {
    /// The context a `cuCtxSynchronize` on this thread is synchronizing, while it runs.
    static SYNCHRONIZED_CTX: Cell<Option<RmHandle>> = const { Cell::new(None) };
}

/// Runs `f`, a synchronize of all of `ctx`, telling the pull it triggers that `ctx` needs no
/// second synchronize ([`synchronized_ctx`]).
pub(crate) fn synchronizing_ctx<T>(ctx: RmHandle, f: impl FnOnce() -> T) -> T {
    let before = SYNCHRONIZED_CTX.with(|c| c.replace(Some(ctx)));
    let r = f();
    SYNCHRONIZED_CTX.with(|c| c.set(before));
    r
}

/// The context the running `cuCtxSynchronize` of this thread has just waited for.
pub(crate) fn synchronized_ctx() -> Option<RmHandle> {
    SYNCHRONIZED_CTX.with(Cell::get)
}

/// Whether this thread is inside a push or pull.
pub(crate) fn in_coherence() -> bool {
    IN_COHERENCE.with(Cell::get)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mirror(size: usize) -> Mirror {
        Mirror::zeroed(
            0,
            0,
            size as u64,
            1,
            Backing::Managed { handle: 1, span: 0 },
        )
    }

    #[test]
    fn dirty_runs_are_page_granular_and_merged() {
        let m = mirror(5 * MIRROR_PAGE + 100);
        let mut host = vec![0u8; m.size as usize];
        assert!(m.dirty_runs(&host).is_empty());
        host[10] = 1; // page 0
        host[MIRROR_PAGE + 5] = 1; // page 1 (merges with 0)
        host[3 * MIRROR_PAGE] = 1; // page 3
        host[5 * MIRROR_PAGE + 99] = 1; // the short last page
        assert_eq!(
            m.dirty_runs(&host),
            [
                0..2 * MIRROR_PAGE,
                3 * MIRROR_PAGE..4 * MIRROR_PAGE,
                5 * MIRROR_PAGE..5 * MIRROR_PAGE + 100
            ]
        );
    }

    #[test]
    fn agreed_ranges_are_no_longer_dirty() {
        let mut m = mirror(3 * MIRROR_PAGE);
        let mut host = vec![0u8; m.size as usize];
        host[0] = 7;
        host[2 * MIRROR_PAGE] = 9;
        for r in m.dirty_runs(&host) {
            m.agreed(&host, r);
        }
        assert!(m.dirty_runs(&host).is_empty());
    }

    #[test]
    fn pull_takes_device_bytes_but_keeps_host_changes() {
        let mut m = mirror(3 * MIRROR_PAGE);
        let mut host = vec![0u8; m.size as usize];
        host[MIRROR_PAGE] = 5; // the host changed page 1 after the last agreement
        let device = vec![3u8; m.size as usize];
        assert_eq!(m.merge_pulled(&mut host, &device), 1);
        assert!(host[..MIRROR_PAGE].iter().all(|&b| b == 3));
        assert_eq!(host[MIRROR_PAGE], 5);
        assert!(host[2 * MIRROR_PAGE..].iter().all(|&b| b == 3));
        // The kept page is dirty against the new snapshot, so it is pushed next.
        assert_eq!(m.dirty_runs(&host), vec![(MIRROR_PAGE..2 * MIRROR_PAGE)]);
    }

    #[test]
    fn an_owned_pull_merges_and_snapshots_as_a_borrowed_one() {
        let mut a = mirror(3 * MIRROR_PAGE);
        let mut b = mirror(3 * MIRROR_PAGE);
        let mut host_a = vec![0u8; a.size as usize];
        host_a[2 * MIRROR_PAGE + 7] = 9; // changed by the host since the last agreement
        let mut host_b = host_a.clone();
        let mut device = vec![4u8; a.size as usize];
        device[1] = 1;
        assert_eq!(a.merge_pulled(&mut host_a, &device), 1);
        assert_eq!(b.merge_pulled_owned(&mut host_b, device.clone()), 1);
        assert_eq!(host_a, host_b);
        assert_eq!(a.snapshot, device);
        assert_eq!(b.snapshot, device);
        assert_eq!(
            b.dirty_runs(&host_b),
            vec![(2 * MIRROR_PAGE..3 * MIRROR_PAGE)]
        );
    }

    #[test]
    fn pulls_reuse_the_snapshot_they_replace() {
        let mut m = mirror(3 * MIRROR_PAGE + 5);
        let mut host = vec![0u8; m.size as usize];
        // The first pull has no spare: a fresh buffer of the mirror's size.
        let first = m.pull_buffer();
        assert_eq!(first.len(), m.size as usize);
        let old_snapshot = m.snapshot.as_ptr();
        let mut device = first;
        device.fill(6);
        assert_eq!(m.merge_pulled_owned(&mut host, device), 0);
        assert!(host.iter().all(|&b| b == 6));
        // The next pull reads into the replaced snapshot's pages, whatever they hold.
        let second = m.pull_buffer();
        assert_eq!(second.as_ptr(), old_snapshot);
        assert_eq!(second.len(), m.size as usize);
        // A failed pull gives its buffer back for the one after it.
        m.return_buffer(second);
        let third = m.pull_buffer();
        assert_eq!(third.as_ptr(), old_snapshot);
        // Then the pull's bytes win as before: the buffer's old contents do not matter.
        let mut device = third;
        device.fill(8);
        host[MIRROR_PAGE] = 1; // changed by the host since the last agreement
        assert_eq!(m.merge_pulled_owned(&mut host, device), 1);
        assert_eq!(host[0], 8);
        assert_eq!(host[MIRROR_PAGE], 1);
        assert_eq!(m.dirty_runs(&host), vec![(MIRROR_PAGE..2 * MIRROR_PAGE)]);
        // A buffer of another size is never kept.
        m.return_buffer(vec![0; 3]);
        assert_eq!(m.pull_buffer().len(), m.size as usize);
    }

    #[test]
    fn procedures_are_classified() {
        let c = classify("rm_launch_kernel");
        assert!(c.submits && !c.completes);
        let c = classify("rm_memcpy_dtoh");
        assert!(c.submits && c.completes);
        let c = classify("rm_memcpy_htod_async");
        assert!(c.submits && !c.completes);
        let c = classify("rm_area_memcpy_dtoh_async");
        assert!(c.submits && !c.completes);
        let c = classify("rm_ctx_synchronize");
        assert!(!c.submits && c.completes);
        let c = classify("rm_mem_alloc");
        assert!(!c.submits && !c.completes);
        assert!(classify("rm_memset_rows").completes);
        assert!(classify("rm_graph_launch").submits);
    }

    #[test]
    fn nested_guards_are_refused() {
        assert!(!in_coherence());
        let r = guarded(|| {
            assert!(in_coherence());
            guarded(|| ())
        });
        assert_eq!(r, Some(None));
        assert!(!in_coherence());
    }
}
