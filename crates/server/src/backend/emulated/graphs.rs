//! Explicit CUDA graphs on the emulated **test** backend: enough of CUDA's graph model to test
//! the executor's graph handling end to end.
//!
//! A graph is a list of nodes, each an [`EmuOp`] with the nodes it depends on. Captured work
//! becomes a chain of nodes (each after the previous one). Instantiating orders the nodes
//! topologically (ties in the order they were added; child graphs are copied into the node
//! when it is added and flattened in place) into an executable list, which a launch runs in
//! order. An executable graph with host nodes runs on the context's host-function thread (a
//! host node blocks until the client's callback has run): its stream counts as busy until the
//! graph has run, so a synchronize of the stream waits for it, but, as with every emulated
//! host function, later work in the stream does not.

use std::collections::{HashMap, VecDeque};
use std::sync::Arc;

use remora_proto::cuda::{CuError, CuResult, cu};

use super::{EmuOp, EmulatedBackend, State, fill};
use crate::backend::graphs::{
    CopySideOut, EXEC_UPDATE_NODE_TYPE_CHANGED, EXEC_UPDATE_TOPOLOGY_CHANGED, Edges, ExecUpdate,
    GraphMem, GraphMemOut, GraphNode, Graphs, LayoutOf, MemAllocNode, MemcpyNode, MemsetNode,
    NewNode, NodeInfo, NodeParams, NodeUpdate, mem_attr, node_type,
};

/// One node of an emulated graph.
#[derive(Debug, Clone)]
pub(super) struct EmuNode {
    id: u64,
    kind: i32,
    op: EmuOp,
    deps: Vec<u64>,
}

/// An emulated graph.
#[derive(Debug, Clone, Default)]
pub(super) struct EmuGraph {
    nodes: Vec<EmuNode>,
}

/// An executable graph: its operations in launch order, each with the node it came from.
#[derive(Debug, Clone, Default)]
pub(super) struct EmuExec {
    pub(super) ops: Vec<(u64, EmuOp)>,
}

impl EmuExec {
    /// Whether a launch must run on the host-function thread.
    pub(super) fn has_host_nodes(&self) -> bool {
        self.ops.iter().any(|(_, op)| matches!(op, EmuOp::Host(_)))
    }
}

/// The graphs, executable graphs and nodes of the backend.
#[derive(Debug, Default)]
pub(super) struct EmuGraphs {
    pub(super) graphs: HashMap<u64, EmuGraph>,
    pub(super) execs: HashMap<u64, EmuExec>,
    /// Node → the graph it belongs to.
    owner: HashMap<u64, u64>,
    /// Graph memory allocations.
    pub(super) mem: EmuGraphMem,
}

/// Graph memory as the emulated device keeps it: every allocation node owns its bytes from
/// when it is added (so its address is fixed); a launch that reaches the node makes it
/// "used" until a free node, `cuMemFree` or `cuMemFreeAsync`. Reserved memory follows the
/// used memory up and goes down only at a trim (`cuDeviceGraphMemTrim`), as on a GPU.
#[derive(Debug, Default)]
pub(super) struct EmuGraphMem {
    /// Address → (size, allocated by a launch now).
    allocs: HashMap<u64, (u64, bool)>,
    used_high: u64,
    reserved: u64,
    reserved_high: u64,
}

impl EmuGraphs {
    /// Graph `g` (`CUDA_ERROR_INVALID_HANDLE` when there is none).
    pub(super) fn graph(&self, g: u64) -> CuResult<&EmuGraph> {
        self.graphs.get(&g).ok_or(CuError(cu::INVALID_HANDLE))
    }

    /// Graph `g`, to change (`CUDA_ERROR_INVALID_HANDLE` when there is none).
    pub(super) fn graph_mut(&mut self, g: u64) -> CuResult<&mut EmuGraph> {
        self.graphs.get_mut(&g).ok_or(CuError(cu::INVALID_HANDLE))
    }
}

impl EmuGraphMem {
    fn used(&self) -> u64 {
        self.allocs
            .values()
            .filter(|(_, a)| *a)
            .map(|(s, _)| s)
            .sum()
    }

    /// Whether `ptr` is a graph allocation.
    pub(super) fn owns(&self, ptr: u64) -> bool {
        self.allocs.contains_key(&ptr)
    }

    /// A launch reached the allocation node of `ptr`.
    pub(super) fn allocated(&mut self, ptr: u64) {
        if let Some((_, a)) = self.allocs.get_mut(&ptr) {
            *a = true;
        }
        let used = self.used();
        self.used_high = self.used_high.max(used);
        self.reserved = self.reserved.max(used);
        self.reserved_high = self.reserved_high.max(self.reserved);
    }

    /// A launch reached a free node of `ptr`.
    pub(super) fn freed(&mut self, ptr: u64) {
        if let Some((_, a)) = self.allocs.get_mut(&ptr) {
            *a = false;
        }
    }

    /// `cuMemFree`/`cuMemFreeAsync` of `ptr` outside a graph: only an allocation a launch
    /// left allocated.
    pub(super) fn free_outside(&mut self, ptr: u64) -> CuResult<()> {
        match self.allocs.get_mut(&ptr) {
            Some((_, a)) if *a => {
                *a = false;
                Ok(())
            }
            _ => Err(invalid()),
        }
    }

    pub(super) fn trim(&mut self) {
        self.reserved = self.used();
    }

    pub(super) fn attribute(&self, attribute: i32) -> CuResult<u64> {
        Ok(match attribute {
            mem_attr::USED_MEM_CURRENT => self.used(),
            mem_attr::USED_MEM_HIGH => self.used_high,
            mem_attr::RESERVED_MEM_CURRENT => self.reserved,
            mem_attr::RESERVED_MEM_HIGH => self.reserved_high,
            _ => return Err(invalid()),
        })
    }

    /// `cuDeviceSetGraphMemAttribute`: only the high marks, only to 0.
    pub(super) fn reset_high(&mut self, attribute: i32, value: u64) -> CuResult<()> {
        match (attribute, value) {
            (mem_attr::USED_MEM_HIGH, 0) => self.used_high = self.used(),
            (mem_attr::RESERVED_MEM_HIGH, 0) => self.reserved_high = self.reserved,
            _ => return Err(invalid()),
        }
        Ok(())
    }
}

fn op_kind(op: &EmuOp) -> i32 {
    match op {
        EmuOp::Launch { .. } => node_type::KERNEL,
        EmuOp::Htod { .. } | EmuOp::Dtod { .. } | EmuOp::Copy(_) => node_type::MEMCPY,
        EmuOp::Memset { .. } | EmuOp::Memset2d(_) => node_type::MEMSET,
        EmuOp::Host(_) => node_type::HOST,
        EmuOp::Child(_) => node_type::GRAPH,
        EmuOp::Record(_) => node_type::EVENT_RECORD,
        EmuOp::Wait(_) => node_type::WAIT_EVENT,
        EmuOp::Nop => node_type::EMPTY,
        EmuOp::MemAlloc(..) => node_type::MEM_ALLOC,
        EmuOp::MemFree(_) => node_type::MEM_FREE,
    }
}

fn invalid() -> CuError {
    CuError(cu::INVALID_VALUE)
}

impl EmuGraph {
    /// Appends captured work after the last node.
    pub(super) fn push_captured(&mut self, id: u64, op: EmuOp) {
        let deps = self.nodes.last().map(|n| vec![n.id]).unwrap_or_default();
        self.nodes.push(EmuNode {
            id,
            kind: op_kind(&op),
            op,
            deps,
        });
    }

    pub(super) fn len(&self) -> usize {
        self.nodes.len()
    }

    pub(super) fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    fn node(&self, id: u64) -> CuResult<&EmuNode> {
        self.nodes.iter().find(|n| n.id == id).ok_or_else(invalid)
    }

    fn node_mut(&mut self, id: u64) -> CuResult<&mut EmuNode> {
        self.nodes
            .iter_mut()
            .find(|n| n.id == id)
            .ok_or_else(invalid)
    }

    /// The nodes in a topological order (ties: the order they were added); a cycle is
    /// `INVALID_VALUE`.
    fn topo(&self) -> CuResult<Vec<&EmuNode>> {
        let index: HashMap<u64, usize> = self
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| (n.id, i))
            .collect();
        let mut waiting: Vec<usize> = self.nodes.iter().map(|n| n.deps.len()).collect();
        let mut after: Vec<Vec<usize>> = vec![Vec::new(); self.nodes.len()];
        for (i, n) in self.nodes.iter().enumerate() {
            for d in &n.deps {
                after[*index.get(d).ok_or_else(invalid)?].push(i);
            }
        }
        let mut ready: std::collections::BTreeSet<usize> =
            (0..self.nodes.len()).filter(|i| waiting[*i] == 0).collect();
        let mut out = Vec::with_capacity(self.nodes.len());
        while let Some(i) = ready.pop_first() {
            out.push(&self.nodes[i]);
            for &j in &after[i] {
                waiting[j] -= 1;
                if waiting[j] == 0 {
                    ready.insert(j);
                }
            }
        }
        if out.len() != self.nodes.len() {
            return Err(invalid());
        }
        Ok(out)
    }

    /// The executable operations, child graphs flattened in place.
    fn flatten(&self, out: &mut Vec<(u64, EmuOp)>) -> CuResult<()> {
        for n in self.topo()? {
            match &n.op {
                EmuOp::Child(g) => g.flatten(out)?,
                op => out.push((n.id, op.clone())),
            }
        }
        Ok(())
    }
}

/// Reads a node's parameters back.
fn info(op: &EmuOp) -> CuResult<NodeInfo> {
    let mem = |m: &GraphMem| match m {
        GraphMem::Device(p) => GraphMemOut::Device(*p),
        GraphMem::Area(_, off) => GraphMemOut::Area(*off),
    };
    let linear = |p: u64, size: u64| CopySideOut {
        mem: GraphMemOut::Device(p),
        pitch: size,
        height: 1,
        x_bytes: 0,
        y: 0,
        z: 0,
    };
    Ok(match op {
        EmuOp::Launch {
            function,
            grid,
            block,
            params,
            ..
        } => NodeInfo::Kernel {
            function: *function,
            grid: *grid,
            block: *block,
            shared_mem_bytes: 0,
            params: params.clone(),
        },
        EmuOp::Memset2d(m) => NodeInfo::Memset(*m),
        EmuOp::Memset {
            dst,
            value,
            elem,
            count,
        } => NodeInfo::Memset(MemsetNode {
            ctx: 0,
            dst: *dst,
            pitch: 0,
            value: *value,
            element_size: *elem,
            width: *count,
            height: 1,
        }),
        EmuOp::Copy(c) => NodeInfo::Memcpy {
            src: c.src.with_mem(mem(&c.src.mem)),
            dst: c.dst.with_mem(mem(&c.dst.mem)),
            width: c.width,
            height: c.height,
            depth: c.depth,
        },
        EmuOp::Dtod { dst, src, size } => NodeInfo::Memcpy {
            src: linear(*src, *size),
            dst: linear(*dst, *size),
            width: *size,
            height: 1,
            depth: 1,
        },
        EmuOp::MemAlloc(p, node) => NodeInfo::MemAlloc {
            node: node.clone(),
            dptr: *p,
        },
        EmuOp::MemFree(p) => NodeInfo::MemFree(*p),
        _ => return Err(invalid()),
    })
}

impl State {
    /// The operation of node parameters `p` (kernels found by their function).
    fn node_op(&self, p: &NodeParams) -> CuResult<EmuOp> {
        Ok(match p {
            NodeParams::Kernel(k) => {
                let (name, _) = self.function(k.function)?;
                EmuOp::Launch {
                    function: k.function,
                    name: name.clone(),
                    grid: k.grid,
                    block: k.block,
                    params: k.params.clone(),
                    layout: k.layout.to_vec(),
                }
            }
            NodeParams::Memset(m) => EmuOp::Memset2d(*m),
            NodeParams::Memcpy(c) => EmuOp::Copy(c.clone()),
            NodeParams::Host(h) => EmuOp::Host(Arc::clone(h)),
            NodeParams::Child(g) => EmuOp::Child(self.graphs.graph(*g)?.clone()),
            NodeParams::Empty => EmuOp::Nop,
            NodeParams::MemFree(p) => {
                if !self.graphs.mem.owns(*p) {
                    return Err(invalid());
                }
                EmuOp::MemFree(*p)
            }
            NodeParams::EventWait(e) | NodeParams::EventRecord(e) => {
                self.events.get(e).ok_or(CuError(cu::INVALID_HANDLE))?;
                match p {
                    NodeParams::EventWait(_) => EmuOp::Wait(*e),
                    _ => EmuOp::Record(*e),
                }
            }
        })
    }

    /// The bytes of a new graph allocation on device `dev`: its address is fixed from now.
    pub(super) fn graph_alloc(
        &mut self,
        dev: i32,
        node: &MemAllocNode,
        limit: u64,
    ) -> CuResult<u64> {
        let p = self.alloc(dev, node.bytesize, limit, false)?;
        self.graphs.mem.allocs.insert(p, (node.bytesize, false));
        Ok(p)
    }

    fn graph_of(&self, node: u64) -> CuResult<u64> {
        self.graphs.owner.get(&node).copied().ok_or(invalid())
    }

    /// Runs a memcpy node.
    pub(super) fn copy_node(&mut self, c: &MemcpyNode) -> CuResult<()> {
        let width = usize::try_from(c.width).map_err(|_| invalid())?;
        for k in 0..c.depth {
            for r in 0..c.height {
                let (so, d_o) = (c.src.row_offset(k, r), c.dst.row_offset(k, r));
                let row = match &c.src.mem {
                    GraphMem::Device(p) => self
                        .range(p.checked_add(so).ok_or_else(invalid)?, c.width)?
                        .to_vec(),
                    GraphMem::Area(area, off) => {
                        let mut b = vec![0u8; width];
                        area.read(off.saturating_add(so), &mut b)
                            .map_err(|_| invalid())?;
                        b
                    }
                };
                match &c.dst.mem {
                    GraphMem::Device(p) => self
                        .range(p.checked_add(d_o).ok_or_else(invalid)?, c.width)?
                        .copy_from_slice(&row),
                    GraphMem::Area(area, off) => area
                        .write(off.saturating_add(d_o), &row)
                        .map_err(|_| invalid())?,
                }
            }
        }
        Ok(())
    }

    /// Runs a 2-D memset node.
    pub(super) fn memset_node(&mut self, m: &MemsetNode) -> CuResult<()> {
        let row = m.width.saturating_mul(u64::from(m.element_size));
        for r in 0..m.height {
            let p = m
                .dst
                .checked_add(r.saturating_mul(m.pitch))
                .ok_or_else(invalid)?;
            fill(self.range(p, row)?, m.value, m.element_size);
        }
        Ok(())
    }

    /// Forgets graph `g` and its nodes.
    pub(super) fn drop_graph(&mut self, g: u64) -> Option<EmuGraph> {
        let graph = self.graphs.graphs.remove(&g)?;
        for n in &graph.nodes {
            self.graphs.owner.remove(&n.id);
        }
        Some(graph)
    }

    /// Adds a captured operation to graph `g`.
    pub(super) fn capture_into(&mut self, g: u64, op: EmuOp) {
        let id = self.handle();
        if let Some(graph) = self.graphs.graphs.get_mut(&g) {
            graph.push_captured(id, op);
            self.graphs.owner.insert(id, g);
        }
    }

    /// Instantiates graph `g`.
    pub(super) fn instantiate(&mut self, g: u64) -> CuResult<u64> {
        let mut ops = Vec::new();
        self.graphs.graph(g)?.flatten(&mut ops)?;
        let exec = self.handle();
        self.graphs.execs.insert(exec, EmuExec { ops });
        Ok(exec)
    }

    /// Copies graph `g` into a new graph with new node ids.
    fn clone_graph(&mut self, g: u64) -> CuResult<u64> {
        let mut graph = self.graphs.graph(g)?.clone();
        let h = self.handle();
        let mut ids = HashMap::new();
        for n in &mut graph.nodes {
            let id = self.handle();
            ids.insert(n.id, id);
            n.id = id;
            self.graphs.owner.insert(id, h);
        }
        for n in &mut graph.nodes {
            for d in &mut n.deps {
                *d = ids[d];
            }
        }
        self.graphs.graphs.insert(h, graph);
        Ok(h)
    }
}

impl EmulatedBackend {
    /// `run(state, graph)` for graph `graph` of a live context.
    fn with_graph<T>(
        &self,
        ctx: u64,
        graph: u64,
        run: impl FnOnce(&mut EmuGraph) -> CuResult<T>,
    ) -> CuResult<T> {
        let mut st = self.lock();
        st.ctx(ctx)?;
        if st.captures.values().any(|c| c.graph == graph) {
            // Being captured: the capture owns it.
            return Err(invalid());
        }
        let g = st.graphs.graph_mut(graph)?;
        run(g)
    }

    /// Adds node `op` to graph `graph` of context `ctx` after `deps`.
    fn add_op(&self, ctx: u64, graph: u64, deps: &[u64], op: EmuOp) -> CuResult<u64> {
        let mut st = self.lock();
        st.ctx(ctx)?;
        if st.captures.values().any(|c| c.graph == graph) {
            return Err(invalid());
        }
        let id = st.handle();
        let g = st.graphs.graph_mut(graph)?;
        for (i, d) in deps.iter().enumerate() {
            if g.node(*d).is_err() || deps[..i].contains(d) {
                return Err(invalid());
            }
        }
        g.nodes.push(EmuNode {
            id,
            kind: op_kind(&op),
            op,
            deps: deps.to_vec(),
        });
        st.graphs.owner.insert(id, graph);
        Ok(id)
    }

    /// Runs the operations of an executable graph with host nodes on the context's
    /// host-function thread.
    pub(super) fn launch_with_host_nodes(
        &self,
        ctx: u64,
        stream: u64,
        ops: Vec<(u64, EmuOp)>,
    ) -> CuResult<()> {
        let state = Arc::clone(&self.state);
        crate::backend::Backend::launch_host_func(
            self,
            ctx,
            stream,
            Box::new(move || {
                for (_, op) in &ops {
                    let r = match op {
                        EmuOp::Host(h) => {
                            (h.0)();
                            Ok(())
                        }
                        op => state
                            .lock()
                            .unwrap_or_else(std::sync::PoisonError::into_inner)
                            .replay(op),
                    };
                    if let Err(e) = r {
                        tracing::debug!(error = e.0, "emulated graph launch: an operation failed");
                    }
                }
            }),
        )
    }
}

impl Graphs for EmulatedBackend {
    fn graph_create(&self, ctx: u64, flags: u32) -> CuResult<u64> {
        if flags != 0 {
            return Err(invalid());
        }
        self.lock().create_in(ctx, |st, h| {
            st.graphs.graphs.insert(h, EmuGraph::default());
        })
    }

    fn graph_add_mem_alloc_node(&self, new: NewNode<'_, MemAllocNode>) -> CuResult<(u64, u64)> {
        let (ctx, node) = (new.ctx, new.params);
        let dev = {
            let st = self.lock();
            let dev = st.ctx(ctx)?;
            if node.location.kind != crate::backend::pools::LOCATION_TYPE_DEVICE
                || node.location.id != dev
            {
                return Err(invalid());
            }
            dev
        };
        let p = self
            .lock()
            .graph_alloc(dev, node, self.config.memory_per_device)?;
        let n = self.add_op(ctx, new.graph, new.deps, EmuOp::MemAlloc(p, node.clone()));
        if n.is_err() {
            let mut st = self.lock();
            st.graphs.mem.allocs.remove(&p);
            let _ = st.free(p);
        }
        Ok((n?, p))
    }

    fn graph_add_node(&self, n: NewNode<'_, NodeParams>) -> CuResult<u64> {
        let op = {
            let st = self.lock();
            st.ctx(n.ctx)?;
            st.node_op(n.params)?
        };
        self.add_op(n.ctx, n.graph, n.deps, op)
    }

    fn graph_destroy_node(&self, ctx: u64, node: u64) -> CuResult<()> {
        let mut st = self.lock();
        st.ctx(ctx)?;
        let g = st.graph_of(node)?;
        let graph = st.graphs.graph_mut(g)?;
        graph.nodes.retain(|n| n.id != node);
        for n in &mut graph.nodes {
            n.deps.retain(|d| *d != node);
        }
        st.graphs.owner.remove(&node);
        Ok(())
    }

    fn graph_edges_change(&self, ctx: u64, edges: Edges<'_>, add: bool) -> CuResult<()> {
        self.with_graph(ctx, edges.graph(), |g| {
            // Checked whole first: a refused call changes nothing.
            for (f, t) in edges.pairs() {
                g.node(*f)?;
                let present = g.node(*t)?.deps.contains(f);
                if f == t || present == add {
                    return Err(invalid());
                }
            }
            for (f, t) in edges.pairs() {
                let n = g.node_mut(*t)?;
                if add {
                    n.deps.push(*f);
                } else {
                    n.deps.retain(|d| d != f);
                }
            }
            Ok(())
        })
    }

    fn graph_nodes(&self, ctx: u64, graph: u64, roots: bool) -> CuResult<Vec<u64>> {
        let st = self.lock();
        st.ctx(ctx)?;
        let g = st.graphs.graph(graph)?;
        Ok(g.nodes
            .iter()
            .filter(|n| !roots || n.deps.is_empty())
            .map(|n| n.id)
            .collect())
    }

    fn graph_edges(&self, ctx: u64, graph: u64) -> CuResult<(Vec<u64>, Vec<u64>)> {
        let st = self.lock();
        st.ctx(ctx)?;
        let g = st.graphs.graph(graph)?;
        Ok(g.nodes
            .iter()
            .flat_map(|n| n.deps.iter().map(move |d| (*d, n.id)))
            .unzip())
    }

    fn graph_node_type(&self, ctx: u64, node: u64) -> CuResult<i32> {
        let st = self.lock();
        st.ctx(ctx)?;
        let g = st.graph_of(node)?;
        Ok(st.graphs.graphs[&g].node(node)?.kind)
    }

    fn graph_node_links(&self, ctx: u64, node: u64, dependents: bool) -> CuResult<Vec<u64>> {
        let st = self.lock();
        st.ctx(ctx)?;
        let g = &st.graphs.graphs[&st.graph_of(node)?];
        if dependents {
            Ok(g.nodes
                .iter()
                .filter(|n| n.deps.contains(&node))
                .map(|n| n.id)
                .collect())
        } else {
            Ok(g.node(node)?.deps.clone())
        }
    }

    fn graph_node_get_params(&self, n: GraphNode, _layout: LayoutOf<'_>) -> CuResult<NodeInfo> {
        let st = self.lock();
        st.ctx(n.ctx)?;
        let g = &st.graphs.graphs[&st.graph_of(n.node)?];
        info(&g.node(n.node)?.op)
    }

    fn graph_node_set_params(&self, u: NodeUpdate<'_>) -> CuResult<()> {
        let NodeUpdate {
            ctx,
            exec,
            node,
            params,
        } = u;
        let mut st = self.lock();
        st.ctx(ctx)?;
        let op = st.node_op(params)?;
        let (kind, slot) = match exec {
            None => {
                let g = st.graph_of(node)?;
                let n = st.graphs.graph_mut(g)?.node_mut(node)?;
                (n.kind, &mut n.op)
            }
            Some(exec) => {
                let e = st
                    .graphs
                    .execs
                    .get_mut(&exec)
                    .ok_or(CuError(cu::INVALID_HANDLE))?;
                let slot = e
                    .ops
                    .iter_mut()
                    .find(|(id, _)| *id == node)
                    .ok_or_else(invalid)?;
                (op_kind(&slot.1), &mut slot.1)
            }
        };
        if kind != op_kind(&op) {
            return Err(invalid());
        }
        *slot = op;
        Ok(())
    }

    fn graph_clone(&self, ctx: u64, graph: u64) -> CuResult<u64> {
        let mut st = self.lock();
        st.ctx(ctx)?;
        st.clone_graph(graph)
    }

    fn graph_exec_update(&self, ctx: u64, exec: u64, graph: u64) -> (CuResult<()>, ExecUpdate) {
        let mut st = self.lock();
        let fail = |result, error_node| {
            (
                Err(CuError(cu::GRAPH_EXEC_UPDATE_FAILURE)),
                ExecUpdate { result, error_node },
            )
        };
        if let Err(e) = st.ctx(ctx) {
            return (Err(e), ExecUpdate::default());
        }
        let mut ops = Vec::new();
        match st.graphs.graphs.get(&graph) {
            Some(g) => {
                if let Err(e) = g.flatten(&mut ops) {
                    return (Err(e), ExecUpdate::default());
                }
            }
            None => return (Err(CuError(cu::INVALID_HANDLE)), ExecUpdate::default()),
        }
        let Some(e) = st.graphs.execs.get_mut(&exec) else {
            return (Err(CuError(cu::INVALID_HANDLE)), ExecUpdate::default());
        };
        if e.ops.len() != ops.len() {
            return fail(EXEC_UPDATE_TOPOLOGY_CHANGED, 0);
        }
        if let Some((_, (id, _))) = e
            .ops
            .iter()
            .zip(&ops)
            .find(|((_, a), (_, b))| op_kind(a) != op_kind(b))
        {
            return fail(EXEC_UPDATE_NODE_TYPE_CHANGED, *id);
        }
        // The executable keeps its own node identities; the operations are the new graph's.
        let queue: VecDeque<EmuOp> = ops.into_iter().map(|(_, op)| op).collect();
        for ((_, slot), op) in e.ops.iter_mut().zip(queue) {
            *slot = op;
        }
        (Ok(()), ExecUpdate::default())
    }
}
