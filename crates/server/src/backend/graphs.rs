//! What the executor needs from a backend for explicit CUDA graphs (revision 11): the
//! [`Graphs`] part of every [`Backend`](super::Backend).
//!
//! Graphs, nodes and executable graphs are raw `u64` values here (the driver's `CUgraph`,
//! `CUgraphNode`, `CUgraphExec`); the session maps them to handles and checks every address
//! a node names before the backend sees it.

use std::sync::Arc;

use remora_oncrpc::DataArea;
use remora_proto::cuda::{CuError, CuResult, cu};
use remora_proto::remora::RmMemsetNode;

use super::pools::{MemAccessDesc, MemLocation};

/// `CUgraphNodeType` values Remora carries.
pub mod node_type {
    remora_proto::cuda_consts!(i32, "CU_GRAPH_NODE_TYPE_" {
        KERNEL = 0,
        MEMCPY = 1,
        MEMSET = 2,
        HOST = 3,
        GRAPH = 4,
        EMPTY = 5,
        WAIT_EVENT = 6,
        EVENT_RECORD = 7,
        MEM_ALLOC = 10,
        MEM_FREE = 11,
    });
}

/// `CUgraphMem_attribute` values (`cuDeviceGetGraphMemAttribute`).
pub mod mem_attr {
    remora_proto::cuda_consts!(i32, "CU_GRAPH_MEM_ATTR_" {
        USED_MEM_CURRENT = 0 ("read only"),
        USED_MEM_HIGH = 1 ("may be reset to 0"),
        RESERVED_MEM_CURRENT = 2 ("read only"),
        RESERVED_MEM_HIGH = 3 ("may be reset to 0"),
    });
}

/// The function a host node calls each time a launch reaches it (on the driver's
/// host-function thread). It may block; it must not call the driver.
pub struct HostNode(pub Box<dyn Fn() + Send + Sync + 'static>);

impl std::fmt::Debug for HostNode {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("HostNode")
    }
}

/// A kernel node, its parameters checked against the function's layout.
#[derive(Debug, Clone)]
pub struct KernelNode {
    /// Backend function.
    pub function: u64,
    pub grid: [u32; 3],
    pub block: [u32; 3],
    pub shared_mem_bytes: u32,
    /// Packed parameter bytes.
    pub params: Vec<u8>,
    /// `(offset, size)` of each parameter inside `params`; every range is in bounds.
    pub layout: Arc<[(u32, u32)]>,
}

/// A 2-D memset node of device memory (checked against the session's ranges).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct MemsetNode {
    /// Backend context the memset runs in.
    pub ctx: u64,
    pub dst: u64,
    pub pitch: u64,
    pub value: u32,
    /// 1, 2 or 4.
    pub element_size: u32,
    /// Elements per row.
    pub width: u64,
    pub height: u64,
}

impl MemsetNode {
    /// The memset `m` of the wire, in backend context `ctx`.
    pub fn new(ctx: u64, m: &RmMemsetNode) -> Self {
        MemsetNode {
            ctx,
            dst: m.dst,
            pitch: m.pitch,
            value: m.value,
            element_size: m.element_size,
            width: m.width,
            height: m.height,
        }
    }

    /// The wire form (without the context).
    pub fn wire(&self) -> RmMemsetNode {
        RmMemsetNode {
            dst: self.dst,
            pitch: self.pitch,
            value: self.value,
            element_size: self.element_size,
            width: self.width,
            height: self.height,
        }
    }
}

/// Where one side of a memcpy node is.
#[derive(Debug, Clone)]
pub enum GraphMem {
    /// Device memory at this address.
    Device(u64),
    /// Bytes of the session's data area from this offset (the span the copy touches was
    /// checked against the area).
    Area(DataArea, u64),
}

/// One side of a memcpy node: its memory `M` ([`GraphMem`] given, [`GraphMemOut`] read back)
/// and where the copy lies in it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CopySide<M> {
    pub mem: M,
    pub pitch: u64,
    pub height: u64,
    pub x_bytes: u64,
    pub y: u64,
    pub z: u64,
}

impl<M> CopySide<M> {
    /// The same side in memory `mem`.
    pub fn with_mem<N>(&self, mem: N) -> CopySide<N> {
        CopySide {
            mem,
            pitch: self.pitch,
            height: self.height,
            x_bytes: self.x_bytes,
            y: self.y,
            z: self.z,
        }
    }
}

/// One side of a memcpy node.
pub type GraphCopySide = CopySide<GraphMem>;

impl GraphCopySide {
    /// The offset of the first byte of row `r` of slice `k` from the side's base.
    pub fn row_offset(&self, k: u64, r: u64) -> u64 {
        self.z
            .saturating_add(k)
            .saturating_mul(self.height)
            .saturating_add(self.y.saturating_add(r))
            .saturating_mul(self.pitch)
            .saturating_add(self.x_bytes)
    }
}

/// A 3-D memcpy node, validated by the executor.
#[derive(Debug, Clone)]
pub struct MemcpyNode {
    /// Backend context the copy runs in.
    pub ctx: u64,
    pub src: GraphCopySide,
    pub dst: GraphCopySide,
    pub width: u64,
    pub height: u64,
    pub depth: u64,
}

/// A memory allocation node (`CUDA_MEM_ALLOC_NODE_PARAMS`): pinned memory of one location
/// (a device id is the client's ordinal), the access others get, and its size.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemAllocNode {
    pub location: MemLocation,
    pub access: Vec<MemAccessDesc>,
    pub bytesize: u64,
}

/// The parameters of a node to add or set.
#[derive(Debug, Clone)]
pub enum NodeParams {
    Kernel(KernelNode),
    Memset(MemsetNode),
    Memcpy(MemcpyNode),
    Host(Arc<HostNode>),
    /// A child graph (backend graph), copied into the node.
    Child(u64),
    Empty,
    /// Backend event.
    EventWait(u64),
    /// Backend event.
    EventRecord(u64),
    /// Frees this graph allocation (checked by the executor to be one of the session's).
    MemFree(u64),
}

/// Where a memcpy node's side is, as a backend reads it back.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GraphMemOut {
    Device(u64),
    /// A host address of this process (the executor maps it back into the data area).
    Host(u64),
    /// An offset into the data area.
    Area(u64),
}

/// One side of a memcpy node read back.
pub type CopySideOut = CopySide<GraphMemOut>;

/// A node's parameters read back (kernel, memset and memcpy nodes).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum NodeInfo {
    Kernel {
        function: u64,
        grid: [u32; 3],
        block: [u32; 3],
        shared_mem_bytes: u32,
        /// Packed at the offsets of the function's layout.
        params: Vec<u8>,
    },
    Memset(MemsetNode),
    Memcpy {
        src: CopySideOut,
        dst: CopySideOut,
        width: u64,
        height: u64,
        depth: u64,
    },
    /// A memory allocation node and the address the driver fixed for it.
    MemAlloc {
        node: MemAllocNode,
        dptr: u64,
    },
    /// A memory free node's address.
    MemFree(u64),
}

/// A node to add to `graph` (which runs in backend context `ctx`), after `deps` (nodes of
/// `graph`), with `params`.
#[derive(Debug)]
pub struct NewNode<'a, P> {
    pub ctx: u64,
    pub graph: u64,
    pub deps: &'a [u64],
    pub params: &'a P,
}

/// Edges `from[i] -> to[i]` between nodes of `graph`: as many sources as targets.
#[derive(Debug, Clone, Copy)]
pub struct Edges<'a> {
    graph: u64,
    from: &'a [u64],
    to: &'a [u64],
}

impl<'a> Edges<'a> {
    /// `INVALID_VALUE` unless there are as many sources as targets.
    pub fn new(graph: u64, from: &'a [u64], to: &'a [u64]) -> CuResult<Self> {
        if from.len() != to.len() {
            return Err(CuError(cu::INVALID_VALUE));
        }
        Ok(Self { graph, from, to })
    }

    /// The graph.
    pub fn graph(&self) -> u64 {
        self.graph
    }

    /// The sources.
    pub fn from(&self) -> &'a [u64] {
        self.from
    }

    /// The targets.
    pub fn to(&self) -> &'a [u64] {
        self.to
    }

    /// `(from, to)` of every edge.
    pub fn pairs(&self) -> impl Iterator<Item = (&'a u64, &'a u64)> + use<'a> {
        self.from.iter().zip(self.to)
    }
}

/// A node of a graph and the backend context the graph runs in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GraphNode {
    pub ctx: u64,
    pub node: u64,
}

/// New parameters for `node`, in backend context `ctx`; with `exec`, for that node's copy in
/// executable graph `exec`.
#[derive(Debug)]
pub struct NodeUpdate<'a> {
    pub ctx: u64,
    pub exec: Option<u64>,
    pub node: u64,
    pub params: &'a NodeParams,
}

/// The parameter layout of a backend function, if the session knows it.
pub type LayoutOf<'a> = &'a dyn Fn(u64) -> Option<Arc<[(u32, u32)]>>;

/// `CUgraphExecUpdateResult` and the backend node that made the update fail (0 when none).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExecUpdate {
    pub result: i32,
    pub error_node: u64,
}

/// `CU_GRAPH_EXEC_UPDATE_ERROR_TOPOLOGY_CHANGED`.
pub const EXEC_UPDATE_TOPOLOGY_CHANGED: i32 = 2;
/// `CU_GRAPH_EXEC_UPDATE_ERROR_NODE_TYPE_CHANGED`.
pub const EXEC_UPDATE_NODE_TYPE_CHANGED: i32 = 3;

/// Explicit graph construction, queries and updates. `ctx` is the backend context the call
/// runs in (made current when needed).
pub trait Graphs {
    /// `cuGraphCreate`.
    fn graph_create(&self, ctx: u64, flags: u32) -> CuResult<u64>;
    /// `cuGraphAdd*Node`: the new node.
    fn graph_add_node(&self, node: NewNode<'_, NodeParams>) -> CuResult<u64>;
    /// `cuGraphAddMemAllocNode`: the new node and the allocation's address.
    fn graph_add_mem_alloc_node(&self, node: NewNode<'_, MemAllocNode>) -> CuResult<(u64, u64)>;
    /// `cuGraphDestroyNode`.
    fn graph_destroy_node(&self, ctx: u64, node: u64) -> CuResult<()>;
    /// `cuGraphAddDependencies` (`add`) or `cuGraphRemoveDependencies` of `edges`.
    fn graph_edges_change(&self, ctx: u64, edges: Edges<'_>, add: bool) -> CuResult<()>;
    /// `cuGraphGetNodes` (`roots`: `cuGraphGetRootNodes`).
    fn graph_nodes(&self, ctx: u64, graph: u64, roots: bool) -> CuResult<Vec<u64>>;
    /// `cuGraphGetEdges`: (from, to).
    fn graph_edges(&self, ctx: u64, graph: u64) -> CuResult<(Vec<u64>, Vec<u64>)>;
    /// `cuGraphNodeGetType`.
    fn graph_node_type(&self, ctx: u64, node: u64) -> CuResult<i32>;
    /// `cuGraphNodeGetDependencies` (`dependents`: `cuGraphNodeGetDependentNodes`).
    fn graph_node_links(&self, ctx: u64, node: u64, dependents: bool) -> CuResult<Vec<u64>>;
    /// `cuGraphKernelNodeGetParams`, `cuGraphMemsetNodeGetParams`,
    /// `cuGraphMemcpyNodeGetParams`, `cuGraphMemAllocNodeGetParams`,
    /// `cuGraphMemFreeNodeGetParams`, by the node's type (others: `INVALID_VALUE`).
    fn graph_node_get_params(&self, n: GraphNode, layout: LayoutOf<'_>) -> CuResult<NodeInfo>;
    /// `cuGraph{Kernel,Memset,Memcpy}NodeSetParams` (the node keeps its type); with
    /// `update.exec`, `cuGraphExec{Kernel,Memset,Memcpy}NodeSetParams` on that node of the
    /// executable graph.
    fn graph_node_set_params(&self, update: NodeUpdate<'_>) -> CuResult<()>;
    /// `cuGraphClone`.
    fn graph_clone(&self, ctx: u64, graph: u64) -> CuResult<u64>;
    /// `cuGraphExecUpdate_v2`: `Err` with the update result when it failed.
    fn graph_exec_update(&self, ctx: u64, exec: u64, graph: u64) -> (CuResult<()>, ExecUpdate);
}
