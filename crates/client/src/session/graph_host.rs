//! Graphs and the client's own memory (revision 12): graph memory allocations, and memcpy
//! nodes whose host side is ordinary (pageable) memory of this process.
//!
//! **Graph allocations.** The address a memory allocation node answers is reserved in this
//! process at once (unified addressing: copies and pointer queries see device memory) and
//! stays reserved until the session ends: the graph may allocate it again at any launch, so
//! `cuMemFree` of it (an allocation a launch left live) does not release the reservation.
//!
//! **Pageable host sides.** The server's GPU cannot reach this process's memory when a graph
//! runs, so such a side is replaced by a device *staging* buffer of the session, with the
//! same pitch and height: the graph's node copies device to device, and every launch of an
//! executable graph moves the host bytes around it, in stream order:
//! 1. before the launch, the current bytes of each host-to-device source go into its staging
//!    buffer (`cuMemcpyHtoDAsync`, which copies them when issued: each launch sees the host
//!    data of that moment);
//! 2. after the launch, each device-to-host destination's staging buffer is copied out with
//!    `cuMemcpyDtoHAsync`: an ordinary asynchronous copy, so its bytes reach the host at the
//!    completion points CUDA defines (`crate::delivery`), and only the rows the node writes
//!    are written;
//! 3. launches of one executable graph on different streams are ordered through an event,
//!    as CUDA orders them, so one launch's staging buffers are not overwritten while an
//!    earlier launch still uses them.
//!
//! What this cannot express is refused loudly (`CUDA_ERROR_NOT_SUPPORTED`, logged), never
//! run with stale bytes: a graph with host nodes and pageable host sides (a host node could
//! write a source, or read a destination, inside the launch), and a captured host-to-device
//! copy whose source overlaps an earlier captured device-to-host destination.
//! Copies in a captured stream are recorded the same way (`cudaMemcpyAsync` of pageable
//! memory inside a capture).

use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use super::*;

/// A device buffer standing for host memory in graphs; freed when nothing holds it.
#[derive(Debug)]
pub(crate) struct Staging {
    ptr: u64,
    size: u64,
    ctx: RmHandle,
}

/// One pageable host side of a memcpy node.
#[derive(Debug, Clone)]
pub(crate) struct HostSide {
    /// The node (or child-graph node) it belongs to; 0 for a captured copy.
    node: RmHandle,
    staging: Arc<Staging>,
    /// The host address of the first byte the copy touches.
    host: u64,
    pitch: u64,
    height: u64,
    width: u64,
    rows: u64,
    depth: u64,
    to_device: bool,
    /// The side as the program gave it (read back by `cuGraphMemcpyNodeGetParams`).
    original: RmGraphCopySide,
}

impl HostSide {
    /// The byte offsets (from the first byte) of every row the copy touches.
    fn rows(&self) -> impl Iterator<Item = u64> + '_ {
        (0..self.depth)
            .flat_map(move |k| (0..self.rows).map(move |r| (k * self.height + r) * self.pitch))
    }

    fn overlaps(&self, other: &HostSide) -> bool {
        let end = |s: &HostSide| s.host + s.staging.size;
        self.host < end(other) && other.host < end(self)
    }
}

/// The pageable host sides and host nodes of one graph or executable graph.
#[derive(Debug, Clone, Default)]
struct Sides {
    sides: Vec<HostSide>,
    /// Host nodes, or child-graph nodes holding some.
    host_nodes: HashSet<RmHandle>,
}

/// An executable graph's sides and how its launches are ordered.
#[derive(Debug, Default)]
struct ExecSides {
    sides: Sides,
    /// (context, stream) of the last launch.
    last: Option<(RmHandle, RmHandle)>,
    /// An event recorded after each launch.
    event: Option<RmHandle>,
}

/// The session's graph state that concerns its own memory.
#[derive(Debug, Default)]
pub(crate) struct GraphHost {
    /// Addresses of graph memory allocations (reserved here until the session ends).
    allocs: HashSet<u64>,
    graphs: HashMap<RmHandle, Sides>,
    execs: HashMap<RmHandle, ExecSides>,
    /// Capture id → the sides of the copies it recorded.
    captures: HashMap<u64, Sides>,
    /// Every staging buffer; the session frees those no graph holds any more.
    staging: Vec<Arc<Staging>>,
    /// Node → graph, for the nodes this session added.
    node_graph: HashMap<RmHandle, RmHandle>,
}

/// A staged host side made for a node about to be added or set.
#[derive(Debug)]
pub struct StagedSide(HostSide);

impl Session {
    fn need_graph_host(&self, what: &str) -> CuResult<()> {
        self.need_revision(12, what)
    }

    /// `cuGraphAddMemAllocNode`: the node and the allocation's address, reserved here.
    pub fn graph_add_mem_alloc_node(
        &self,
        graph: RmHandle,
        ctx: RmHandle,
        deps: &[RmHandle],
        node: RmMemAllocNode,
    ) -> CuResult<(RmHandle, u64)> {
        self.need_graph_host("cuGraphAddMemAllocNode")?;
        if deps.len() > RM_MAX_GRAPH_NODES as usize
            || node.access.len() > RM_MAX_POOL_ACCESS as usize
        {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let size = node.bytesize;
        let r = call!(self.rm_graph_add_mem_alloc_node(&RmAddNodeArgs {
            graph,
            ctx,
            dependencies: deps.to_vec(),
            params: RmNodeParams::RmNodeMemAlloc(node),
        }))?;
        let added = match r {
            RmMemAllocNodeReply::Case0(a) => a,
            RmMemAllocNodeReply::Default { discriminant } => {
                return Err(CuError(nonzero(discriminant)));
            }
        };
        if let Err(e) = self.reserve_graph_alloc(added.dptr, size, ctx) {
            let _ = self.graph_destroy_node(added.node);
            return Err(e);
        }
        Ok((added.node, added.dptr))
    }

    /// Reserves graph allocation `[ptr, ptr + size)` here as device memory of `ctx`.
    fn reserve_graph_alloc(&self, ptr: u64, size: u64, ctx: RmHandle) -> CuResult<()> {
        let mut g = lock(&self.graph_host);
        if !g.allocs.insert(ptr) {
            return Ok(());
        }
        if let Err(e) = self.va.reserve_range(ptr, size, ctx, false) {
            g.allocs.remove(&ptr);
            tracing::error!(
                "remora: the graph allocation at {ptr:#x} ({size} bytes) collides with memory of this process ({e:?}), so it cannot be classified as device memory; returning CUDA_ERROR_OUT_OF_MEMORY"
            );
            return Err(CuError(cu::OUT_OF_MEMORY));
        }
        Ok(())
    }

    /// A `cuMemAllocAsync` on `stream` answered `ptr`: inside a capture it is a graph
    /// allocation, whose reservation outlives frees.
    pub(super) fn note_stream_alloc(&self, stream: RmHandle, ptr: u64) {
        if self.stream_may_capture(stream) {
            lock(&self.graph_host).allocs.insert(ptr);
        }
    }

    /// Whether `ptr` is a graph allocation (its reservation stays until the session ends).
    pub(super) fn is_graph_alloc(&self, ptr: u64) -> bool {
        lock(&self.graph_host).allocs.contains(&ptr)
    }

    /// `cuDeviceGraphMemTrim`.
    pub fn graph_mem_trim(&self, dev: DeviceHandle) -> CuResult<()> {
        self.need_graph_host("cuDeviceGraphMemTrim")?;
        self.check_device(dev)?;
        self.device_graph_mem_trim(dev)
    }

    /// `cuDeviceGetGraphMemAttribute`.
    pub fn graph_mem_attribute(&self, dev: DeviceHandle, attribute: i32) -> CuResult<u64> {
        self.need_graph_host("cuDeviceGetGraphMemAttribute")?;
        self.check_device(dev)?;
        self.device_get_graph_mem_attribute(dev, attribute)
    }

    /// `cuDeviceSetGraphMemAttribute`.
    pub fn set_graph_mem_attribute(
        &self,
        dev: DeviceHandle,
        attribute: i32,
        value: u64,
    ) -> CuResult<()> {
        self.need_graph_host("cuDeviceSetGraphMemAttribute")?;
        self.check_device(dev)?;
        self.device_set_graph_mem_attribute(dev, attribute, value)
    }

    /// A staging buffer of `size` bytes in `ctx`.
    fn new_staging(&self, ctx: RmHandle, size: u64) -> CuResult<Arc<Staging>> {
        if size == 0 || size > u64::from(RM_MAX_COPY) {
            tracing::warn!(
                "remora: a graph copy of pageable host memory spans {size} bytes (at most {RM_MAX_COPY}); returning CUDA_ERROR_NOT_SUPPORTED"
            );
            return Err(CuError(cu::NOT_SUPPORTED));
        }
        let ptr = self.mem_alloc(ctx, size)?;
        let s = Arc::new(Staging { ptr, size, ctx });
        lock(&self.graph_host).staging.push(Arc::clone(&s));
        Ok(s)
    }

    /// Frees the staging buffers no graph, executable graph or capture holds.
    fn sweep_staging(&self) {
        let gone: Vec<Arc<Staging>> = {
            let mut g = lock(&self.graph_host);
            let (gone, keep) = std::mem::take(&mut g.staging)
                .into_iter()
                .partition(|s| Arc::strong_count(s) == 1);
            g.staging = keep;
            gone
        };
        for s in gone {
            if let Err(e) = self.mem_free(s.ctx, s.ptr) {
                tracing::debug!("remora: freeing a graph staging buffer failed: {e}");
            }
        }
    }

    /// Stages pageable host side `side` of a memcpy node (extent `w` bytes x `h` rows x `d`
    /// slices) in context `ctx`: the device side the node gets instead, and the record to
    /// bind to the node once it exists.
    ///
    /// # Safety
    /// The host bytes the copy touches stay valid (readable for a source, writable for a
    /// destination) for every launch of every graph made from the node, as CUDA requires of
    /// a memcpy node's host memory.
    pub unsafe fn graph_stage_host_side(
        &self,
        ctx: RmHandle,
        side: RmGraphCopySide,
        (w, h, d): (u64, u64, u64),
        to_device: bool,
    ) -> CuResult<(RmGraphCopySide, StagedSide)> {
        self.need_graph_host("a graph memcpy node of pageable host memory")?;
        let bad = || CuError(cu::INVALID_VALUE);
        if w == 0 || h == 0 || d == 0 || ((h > 1 || d > 1) && side.pitch < w) {
            return Err(bad());
        }
        if d > 1 && side.height < h {
            return Err(bad());
        }
        let first = side
            .z
            .checked_mul(side.height)
            .and_then(|v| v.checked_add(side.y))
            .and_then(|v| v.checked_mul(side.pitch))
            .and_then(|v| v.checked_add(side.x_bytes))
            .ok_or_else(bad)?;
        let span = (d - 1)
            .checked_mul(side.height)
            .and_then(|v| v.checked_add(h - 1))
            .and_then(|v| v.checked_mul(side.pitch))
            .and_then(|v| v.checked_add(w))
            .ok_or_else(bad)?;
        let host = side.addr.checked_add(first).ok_or_else(bad)?;
        host.checked_add(span).ok_or_else(bad)?;
        let staging = self.new_staging(ctx, span)?;
        let device = RmGraphCopySide {
            kind: RmGraphMemKind::RmGraphMemDevice,
            addr: staging.ptr,
            pitch: side.pitch,
            height: side.height,
            x_bytes: 0,
            y: 0,
            z: 0,
        };
        let hs = HostSide {
            node: 0,
            staging,
            host,
            pitch: side.pitch,
            height: side.height,
            width: w,
            rows: h,
            depth: d,
            to_device,
            original: side,
        };
        Ok((device, StagedSide(hs)))
    }

    /// Binds the staged sides of node `node` of graph `graph` (replacing what it had).
    pub fn graph_bind_sides(&self, graph: RmHandle, node: RmHandle, staged: Vec<StagedSide>) {
        {
            let mut g = lock(&self.graph_host);
            let e = g.graphs.entry(graph).or_default();
            e.sides.retain(|s| s.node != node);
            e.sides.extend(staged.into_iter().map(|StagedSide(mut s)| {
                s.node = node;
                s
            }));
        }
        self.sweep_staging();
    }

    /// `cuGraphMemcpyNodeSetParams` with the staging records of the new parameters' pageable
    /// host sides, which replace the node's.
    pub fn graph_memcpy_node_set_params(
        &self,
        node: RmHandle,
        params: RmNodeParams,
        staged: Vec<StagedSide>,
    ) -> CuResult<()> {
        let graph = lock(&self.graph_host).node_graph.get(&node).copied();
        let graph = match graph {
            Some(g) => g,
            None if staged.is_empty() => return self.graph_node_set_params(node, params),
            None => {
                tracing::warn!(
                    "remora: cuGraphMemcpyNodeSetParams: pageable host memory for a node this process did not add (captured or cloned) is not carried; returning CUDA_ERROR_NOT_SUPPORTED"
                );
                return Err(CuError(cu::NOT_SUPPORTED));
            }
        };
        self.graph_node_set_params(node, params)?;
        self.graph_bind_sides(graph, node, staged);
        Ok(())
    }

    /// Node `node` of `graph` was added by this session.
    pub(super) fn graph_note_node(&self, graph: RmHandle, node: RmHandle) {
        lock(&self.graph_host).node_graph.insert(node, graph);
    }

    /// Binds the staged sides of node `node` in executable graph `exec` (replacing what it
    /// had there), after `cuGraphExecMemcpyNodeSetParams`.
    pub fn graph_exec_bind_sides(&self, exec: RmHandle, node: RmHandle, staged: Vec<StagedSide>) {
        {
            let mut g = lock(&self.graph_host);
            let e = g.execs.entry(exec).or_default();
            e.sides.sides.retain(|s| s.node != node);
            e.sides
                .sides
                .extend(staged.into_iter().map(|StagedSide(mut s)| {
                    s.node = node;
                    s
                }));
        }
        self.sweep_staging();
    }

    /// The pageable host side that staging address `addr` (a memcpy node's side read back)
    /// stands for.
    pub fn graph_host_side_of(&self, addr: u64) -> Option<RmGraphCopySide> {
        let g = lock(&self.graph_host);
        g.staging
            .iter()
            .any(|s| s.ptr == addr)
            .then(|| {
                g.graphs
                    .values()
                    .flat_map(|x| x.sides.iter())
                    .chain(g.execs.values().flat_map(|x| x.sides.sides.iter()))
                    .find(|s| s.staging.ptr == addr)
                    .map(|s| s.original.clone())
            })
            .flatten()
    }

    /// Graph `graph` got host node (or child node with host nodes) `node`.
    pub(super) fn graph_note_host_node(&self, graph: RmHandle, node: RmHandle) {
        lock(&self.graph_host)
            .graphs
            .entry(graph)
            .or_default()
            .host_nodes
            .insert(node);
    }

    /// Child graph `child` was copied into `graph` as node `node`: its sides and host
    /// nodes come along.
    pub(super) fn graph_note_child(&self, graph: RmHandle, node: RmHandle, child: RmHandle) {
        let mut g = lock(&self.graph_host);
        let Some(c) = g.graphs.get(&child).cloned() else {
            return;
        };
        let e = g.graphs.entry(graph).or_default();
        e.sides.extend(c.sides.into_iter().map(|mut s| {
            s.node = node;
            s
        }));
        if !c.host_nodes.is_empty() {
            e.host_nodes.insert(node);
        }
    }

    /// Node `node` of `graph` is gone.
    pub(super) fn graph_forget_node(&self, node: RmHandle) {
        {
            let mut g = lock(&self.graph_host);
            for s in g.graphs.values_mut() {
                s.sides.retain(|x| x.node != node);
                s.host_nodes.remove(&node);
            }
            g.node_graph.remove(&node);
        }
        self.sweep_staging();
    }

    /// `to` is a copy of `from` (`cuGraphClone`): same sides (node handles are the
    /// server's new ones, so the sides are kept by graph, not node, for launches).
    pub(super) fn graph_note_clone(&self, from: RmHandle, to: RmHandle) {
        let mut g = lock(&self.graph_host);
        if let Some(s) = g.graphs.get(&from).cloned() {
            g.graphs.insert(to, s);
        }
    }

    /// Graph `graph` is gone.
    pub(super) fn graph_forget(&self, graph: RmHandle) {
        {
            let mut g = lock(&self.graph_host);
            g.graphs.remove(&graph);
            g.node_graph.retain(|_, x| *x != graph);
        }
        self.sweep_staging();
    }

    /// Executable graph `exec` was made from (or updated with) `graph`: refused loudly when
    /// host nodes and pageable host sides meet in it.
    pub(super) fn graph_exec_from(&self, exec: RmHandle, graph: RmHandle) -> CuResult<()> {
        let mut g = lock(&self.graph_host);
        let sides = g.graphs.get(&graph).cloned().unwrap_or_default();
        if !sides.sides.is_empty() && !sides.host_nodes.is_empty() {
            tracing::warn!(
                "remora: this graph has host nodes and memcpy nodes of pageable host memory; a host node could read or write that memory inside a launch, which Remora stages around the launch, so the program could see stale bytes; returning CUDA_ERROR_NOT_SUPPORTED (use cudaMallocHost memory over shared memory, or no host nodes)"
            );
            return Err(CuError(cu::NOT_SUPPORTED));
        }
        g.execs.entry(exec).or_default().sides = sides;
        Ok(())
    }

    /// After a launch of `exec` whose graph has host nodes, while managed or mapped memory
    /// exists: an empty host function follows the launch on its stream, so that device work
    /// submitted later waits for the graph, host nodes included, and gets what they wrote
    /// pushed first (as after `cuLaunchHostFunc`, see `Session::launch_host_func`). Inside the
    /// graph, host nodes see that memory as of the last synchronization and nodes after them
    /// do not see their writes: said once, loudly.
    pub(super) fn gate_graph_host_nodes(
        &self,
        ctx: RmHandle,
        exec: RmHandle,
        stream: RmHandle,
    ) -> CuResult<()> {
        if !self.mirrors.active() {
            return Ok(());
        }
        let host_nodes = lock(&self.graph_host)
            .execs
            .get(&exec)
            .is_some_and(|e| !e.sides.host_nodes.is_empty());
        // Launched into a capture, the graph becomes part of another one: nothing runs now.
        if !host_nodes || self.stream_may_capture(stream) {
            return Ok(());
        }
        static ONCE: std::sync::Once = std::sync::Once::new();
        ONCE.call_once(|| {
            tracing::warn!(
                "remora: a graph with host nodes runs while managed or mapped memory exists: inside the graph, host nodes see that memory as of the last synchronization and later nodes of the same launch do not see what host nodes write to it (work after the launch does); keep host nodes off managed and mapped memory, or use cuLaunchHostFunc between graph launches"
            );
        });
        self.host_func(ctx, stream, Box::new(|_| {}), false)
    }

    /// Executable graph `exec` is gone.
    pub(super) fn graph_exec_forget(&self, exec: RmHandle) {
        let event = lock(&self.graph_host)
            .execs
            .remove(&exec)
            .and_then(|e| e.event);
        if let Some(ev) = event {
            let _ = self.event_destroy(ev);
        }
        self.sweep_staging();
    }

    /// Before a launch of `exec` on (`ctx`, `stream`): orders it after the previous launch
    /// and copies the current host bytes of every source into its staging buffer. Returns
    /// the destinations to copy out after the launch.
    pub(super) fn graph_launch_prologue(
        &self,
        ctx: RmHandle,
        exec: RmHandle,
        stream: RmHandle,
    ) -> CuResult<Vec<HostSide>> {
        let (sides, wait) = {
            let g = lock(&self.graph_host);
            let Some(e) = g.execs.get(&exec) else {
                return Ok(Vec::new());
            };
            if e.sides.sides.is_empty() {
                return Ok(Vec::new());
            }
            let wait = match (e.last, e.event) {
                (Some(last), Some(ev)) if last != (ctx, stream) => Some(ev),
                _ => None,
            };
            (e.sides.sides.clone(), wait)
        };
        if let Some(ev) = wait {
            self.stream_wait_event(ctx, stream, ev, 0)?;
        }
        for s in sides.iter().filter(|s| s.to_device) {
            let mut buf = vec![0u8; s.staging.size as usize];
            for off in s.rows() {
                let o = off as usize;
                // SAFETY: `graph_stage_host_side`'s contract: the program keeps the rows of
                // the source readable for every launch; each row is `width` bytes from
                // `host + off`, inside the span the staging buffer mirrors.
                let row = unsafe {
                    std::slice::from_raw_parts(
                        (s.host + off) as usize as *const u8,
                        s.width as usize,
                    )
                };
                buf[o..o + row.len()].copy_from_slice(row);
            }
            self.memcpy_htod_async(ctx, stream, s.staging.ptr, &buf)?;
        }
        Ok(sides.into_iter().filter(|s| !s.to_device).collect())
    }

    /// After a launch of `exec` on (`ctx`, `stream`): copies every destination's staging
    /// buffer out into its host rows, and records the launch's end for the next launch.
    pub(super) fn graph_launch_epilogue(
        &self,
        ctx: RmHandle,
        exec: RmHandle,
        stream: RmHandle,
        outs: Vec<HostSide>,
    ) -> CuResult<()> {
        let had_sides = lock(&self.graph_host)
            .execs
            .get(&exec)
            .is_some_and(|e| !e.sides.sides.is_empty());
        if !had_sides {
            return Ok(());
        }
        for s in outs {
            let rows: Vec<u64> = s.rows().collect();
            let (host, width) = (s.host as usize, s.width as usize);
            let sink: CopySink = Box::new(move |data: &[u8]| {
                for off in rows {
                    let o = off as usize;
                    let Some(row) = data.get(o..o + width) else {
                        return;
                    };
                    // SAFETY: `graph_stage_host_side`'s contract: the program keeps the rows
                    // of the destination writable for every launch (and, as for every
                    // asynchronous copy, untouched until a completion point delivers it).
                    unsafe {
                        std::ptr::copy_nonoverlapping(row.as_ptr(), (host + o) as *mut u8, width)
                    };
                }
            });
            self.memcpy_dtoh_async(ctx, stream, s.staging.ptr, s.staging.size, sink)?;
        }
        let event = {
            let g = lock(&self.graph_host);
            g.execs.get(&exec).and_then(|e| e.event)
        };
        let event = match event {
            Some(e) => e,
            None => {
                // CU_EVENT_DISABLE_TIMING.
                let e = self.event_create(ctx, 0x2)?;
                if let Some(x) = lock(&self.graph_host).execs.get_mut(&exec) {
                    x.event = Some(e);
                }
                e
            }
        };
        self.event_record(ctx, event, stream)?;
        if let Some(x) = lock(&self.graph_host).execs.get_mut(&exec) {
            x.last = Some((ctx, stream));
        }
        Ok(())
    }

    /// `cudaMemcpyAsync` between device address `dev` and pageable host memory at `host`
    /// (`size` bytes) on capturing stream `stream`: the capture records a device-to-device
    /// copy with a staging buffer, and every launch moves the host bytes (module docs).
    ///
    /// # Safety
    /// As [`Session::graph_stage_host_side`]: the host bytes stay valid for every launch of
    /// every graph made from the capture.
    pub unsafe fn graph_capture_host_copy(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        dev: u64,
        host: u64,
        size: u64,
        to_device: bool,
    ) -> CuResult<()> {
        let Some(id) = lock(&self.captures).streams.get(&stream).copied() else {
            return Err(CuError(cu::INVALID_VALUE));
        };
        let fail = |e: i32| {
            if let Some(c) = lock(&self.captures).active.get_mut(&id) {
                c.error.get_or_insert(e);
            }
            CuError(e)
        };
        if self.welcome.revision < 12 {
            tracing::error!(
                "remora: the server speaks protocol revision {} (capturing copies of pageable host memory needs 12); returning CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED",
                self.welcome.revision
            );
            return Err(fail(cu::STREAM_CAPTURE_UNSUPPORTED));
        }
        let side = RmGraphCopySide {
            kind: RmGraphMemKind::RmGraphMemDevice,
            addr: host,
            pitch: 0,
            height: 0,
            x_bytes: 0,
            y: 0,
            z: 0,
        };
        // SAFETY: the caller's contract.
        let (staged, StagedSide(hs)) =
            unsafe { self.graph_stage_host_side(ctx, side, (size, 1, 1), to_device) }
                .map_err(|e| fail(e.0))?;
        if to_device {
            let g = lock(&self.graph_host);
            if let Some(c) = g.captures.get(&id)
                && c.sides.iter().any(|s| !s.to_device && s.overlaps(&hs))
            {
                drop(g);
                tracing::error!(
                    "remora: a captured host-to-device copy reads pageable host memory that an earlier captured device-to-host copy writes; Remora moves those bytes around each launch, so the graph would read stale bytes; returning CUDA_ERROR_NOT_SUPPORTED"
                );
                let e = fail(cu::NOT_SUPPORTED);
                drop(hs);
                self.sweep_staging();
                return Err(e);
            }
        }
        let r = if to_device {
            self.memcpy_dtod_async(ctx, stream, dev, staged.addr, size)
        } else {
            self.memcpy_dtod_async(ctx, stream, staged.addr, dev, size)
        };
        if let Err(e) = r {
            drop(hs);
            self.sweep_staging();
            return Err(fail(e.0));
        }
        lock(&self.graph_host)
            .captures
            .entry(id)
            .or_default()
            .sides
            .push(hs);
        Ok(())
    }

    /// Capture `id` ended, with graph `graph` (0: failed).
    pub(super) fn graph_capture_ended(&self, id: u64, graph: RmHandle) {
        let sides = lock(&self.graph_host).captures.remove(&id);
        if let Some(s) = sides
            && graph != 0
        {
            lock(&self.graph_host).graphs.insert(graph, s);
        }
        self.sweep_staging();
    }
}
