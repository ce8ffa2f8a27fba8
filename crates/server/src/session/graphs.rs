//! The session's explicit graph nodes: node handles and their cleanup.
//!
//! A node handle names a [`Resource::GraphNode`]: the driver's node and the handle of the
//! graph it belongs to. Nodes the session adds get a handle at once; nodes the driver made
//! (captured or cloned graphs) get one the first time a reply names them, and the same node
//! always answers the same handle. A node handle goes with its node
//! (`cuGraphDestroyNode`) or its graph (`cuGraphDestroy`, the graph's context going).

use remora_proto::cuda::{CuError, CuResult, cu};

use super::{Resource, SessionState};

impl SessionState {
    /// The backend graph and context handle of graph handle `h` (not being captured).
    pub(crate) fn explicit_graph(&self, h: u64) -> CuResult<(u64, u64)> {
        match self.get(h)? {
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

    /// The backend node and graph handle of node handle `h`.
    pub(crate) fn graph_node(&self, h: u64) -> CuResult<(u64, u64)> {
        match self.get(h)? {
            Resource::GraphNode { raw, graph } => Ok((*raw, *graph)),
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
