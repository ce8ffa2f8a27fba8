//! The session's explicit graph nodes: node handles and their cleanup.
//!
//! A node handle names a [`Resource::GraphNode`]: the driver's node and the handle of the
//! graph it belongs to. Nodes the session adds get a handle at once; nodes the driver made
//! (captured or cloned graphs) get one the first time a reply names them, and the same node
//! always answers the same handle. A node handle goes with its node
//! (`cuGraphDestroyNode`) or its graph (`cuGraphDestroy`, the graph's context going).

use remora_proto::cuda::{CuError, CuResult, cu};

use super::{Resource, SessionState};

impl Resource {
    /// The backend graph and context handle of a graph not being captured
    /// (`CUDA_ERROR_INVALID_HANDLE` for anything else than a graph).
    pub(crate) fn explicit_graph(&self) -> CuResult<(u64, u64)> {
        match self {
            Resource::Graph {
                raw,
                ctx,
                capture: None,
            } => Ok((*raw, *ctx)),
            // The graph of a capture in progress belongs to the capture.
            Resource::Graph { .. } => Err(CuError(cu::INVALID_VALUE)),
            _ => Err(CuError(cu::INVALID_HANDLE)),
        }
    }
}

impl SessionState {
    /// The backend graph and context handle of graph handle `h` (not being captured).
    pub(crate) fn explicit_graph(&self, h: u64) -> CuResult<(u64, u64)> {
        self.get(h)?.explicit_graph()
    }

    /// The backend node and graph handle of node handle `h`.
    pub(crate) fn graph_node(&self, h: u64) -> CuResult<(u64, u64)> {
        match self.get(h)? {
            Resource::GraphNode { raw, graph } => Ok((*raw, *graph)),
            _ => Err(CuError(cu::INVALID_HANDLE)),
        }
    }

    /// The backend executable graph and context handle of executable graph handle `h`.
    pub(crate) fn graph_exec(&self, h: u64) -> CuResult<(u64, u64)> {
        match self.get(h)? {
            Resource::GraphExec { raw, ctx } => Ok((*raw, *ctx)),
            _ => Err(CuError(cu::INVALID_HANDLE)),
        }
    }

    /// The handle of backend node `raw` of graph handle `graph`: the one it has, else a new
    /// one.
    pub(crate) fn node_handle(&mut self, raw: u64, graph: u64) -> u64 {
        let known = self.table.iter().find_map(|(h, r)| match r {
            Resource::GraphNode { raw: n, graph: g } if *n == raw && *g == graph => Some(*h),
            _ => None,
        });
        known.unwrap_or_else(|| self.insert(Resource::GraphNode { raw, graph }))
    }

    /// `(backend function, parameter layout)` of every function of the session.
    pub(crate) fn table_functions(
        &self,
    ) -> impl Iterator<Item = (u64, std::sync::Arc<[(u32, u32)]>)> + '_ {
        self.table.values().filter_map(|r| match r {
            Resource::Function { raw, params, .. } => Some((*raw, std::sync::Arc::clone(params))),
            _ => None,
        })
    }

    /// The handle of backend function `raw`, if the session has it.
    pub(crate) fn function_handle(&self, raw: u64) -> Option<u64> {
        self.table.iter().find_map(|(h, r)| match r {
            Resource::Function { raw: f, .. } if *f == raw => Some(*h),
            _ => None,
        })
    }

    /// Forgets the node handles of graph handle `graph`.
    pub(crate) fn forget_nodes_of(&mut self, graph: u64) {
        self.table
            .retain(|_, r| !matches!(r, Resource::GraphNode { graph: g, .. } if *g == graph));
    }

    /// Forgets node handles whose graph is gone.
    pub(crate) fn forget_orphan_nodes(&mut self) {
        let graphs: std::collections::HashSet<u64> = self
            .table
            .iter()
            .filter(|(_, r)| matches!(r, Resource::Graph { .. }))
            .map(|(h, _)| *h)
            .collect();
        self.table.retain(
            |_, r| !matches!(r, Resource::GraphNode { graph, .. } if !graphs.contains(graph)),
        );
    }
}

/// Who keeps a graph memory allocation's address valid (revision 12). The driver fixes the
/// address when the allocation node is added; the address stays the graph's while the graph,
/// a clone, a graph with it as a child, or an executable graph made from any of them lives,
/// and after that while a launch left the memory allocated and nothing freed it. The session
/// range ([`RangeKind::GraphMem`](super::RangeKind::GraphMem)) lives exactly as long, so a
/// copy into the address passes the bounds check only while the address is the session's.
#[derive(Debug, Clone, Default)]
pub(crate) struct GraphMemHold {
    /// Graph and executable graph handles holding the node.
    pub(crate) holders: std::collections::HashSet<u64>,
    /// A free node of the allocation exists in a graph holding it: every launch frees it.
    pub(crate) freed_by_node: bool,
    /// Graph and executable graph handles with a free node of the allocation that do not
    /// hold it (CUDA lets another graph free it): a launch of one frees it.
    pub(crate) freers: std::collections::HashSet<u64>,
    /// A launch may have left it allocated (no free node, no cuMemFree since).
    pub(crate) live: bool,
}

impl SessionState {
    /// Records a new graph allocation at `ptr` of `size` bytes in context handle `ctx`,
    /// held by graph handle `graph`.
    pub(crate) fn add_graph_mem(&mut self, ptr: u64, size: u64, ctx: u64, graph: u64) {
        self.ranges.insert(
            ptr,
            super::Range {
                size,
                ctx,
                kind: super::RangeKind::GraphMem,
            },
        );
        let hold = self.graph_mem.entry(ptr).or_default();
        hold.holders.insert(graph);
    }

    /// Whether `ptr` is a graph allocation of this session (a free node may name only one).
    pub(crate) fn is_graph_mem(&self, ptr: u64) -> bool {
        self.graph_mem.contains_key(&ptr)
    }

    /// A free node of graph allocation `ptr` was added to graph handle `graph`: in a graph
    /// that holds the allocation every launch frees it; in another graph, that graph's
    /// launches free it.
    pub(crate) fn graph_mem_freed_by_node(&mut self, ptr: u64, graph: u64) {
        if let Some(h) = self.graph_mem.get_mut(&ptr) {
            if h.holders.contains(&graph) {
                h.freed_by_node = true;
            } else {
                h.freers.insert(graph);
            }
        }
    }

    /// What `from` holds is now held by `to` too (a clone, a child graph node, an
    /// instantiation, an update).
    pub(crate) fn share_graph_mem(&mut self, from: u64, to: u64) {
        for h in self.graph_mem.values_mut() {
            if h.holders.contains(&from) {
                h.holders.insert(to);
            }
            if h.freers.contains(&from) {
                h.freers.insert(to);
            }
        }
    }

    /// A launch of executable graph `exec`: its allocations without a free node stay
    /// allocated afterwards; the allocations of other graphs it frees do not.
    pub(crate) fn graph_mem_launched(&mut self, exec: u64) {
        for h in self.graph_mem.values_mut() {
            if h.holders.contains(&exec) && !h.freed_by_node {
                h.live = true;
            }
            if h.freers.contains(&exec) {
                h.live = false;
            }
        }
        self.sweep_graph_mem();
    }

    /// `cuMemFree`/`cuMemFreeAsync` of graph allocation `ptr` (the driver accepted it).
    pub(crate) fn graph_mem_freed(&mut self, ptr: u64) {
        if let Some(h) = self.graph_mem.get_mut(&ptr) {
            h.live = false;
        }
        self.sweep_graph_mem();
    }

    /// The driver freed `ptr` (`cuMemFree`, `cuMemFreeAsync`): its range goes, unless it is
    /// a graph allocation that a graph still holds (a later launch allocates it again).
    pub(crate) fn range_freed(&mut self, ptr: u64) {
        if self.graph_mem.contains_key(&ptr) {
            self.graph_mem_freed(ptr);
        } else {
            self.remove_range(ptr);
        }
    }

    /// The handle of the graph that capture `id` is building, if the session knows it.
    pub(crate) fn capture_graph_handle(&self, id: u64) -> Option<u64> {
        self.captures.get(&id).map(|c| c.graph)
    }

    /// Graph or executable graph handle `h` is gone.
    pub(crate) fn graph_mem_released_by(&mut self, h: u64) {
        for hold in self.graph_mem.values_mut() {
            hold.holders.remove(&h);
            hold.freers.remove(&h);
        }
        self.sweep_graph_mem();
    }

    /// Forgets the allocations nothing keeps valid, with their ranges.
    fn sweep_graph_mem(&mut self) {
        let gone: Vec<u64> = self
            .graph_mem
            .iter()
            .filter(|(_, h)| h.holders.is_empty() && !h.live)
            .map(|(p, _)| *p)
            .collect();
        for p in gone {
            self.graph_mem.remove(&p);
            if self
                .ranges
                .get(&p)
                .is_some_and(|r| r.kind == super::RangeKind::GraphMem)
            {
                self.ranges.remove(&p);
            }
        }
    }

    /// Context handle `ctx` is going: its graph allocations go with it.
    pub(crate) fn forget_graph_mem_of(&mut self, ctx: u64) {
        let gone: Vec<u64> = self
            .ranges
            .iter()
            .filter(|(_, r)| r.ctx == ctx && r.kind == super::RangeKind::GraphMem)
            .map(|(p, _)| *p)
            .collect();
        for p in gone {
            self.ranges.remove(&p);
            self.graph_mem.remove(&p);
        }
    }
}
