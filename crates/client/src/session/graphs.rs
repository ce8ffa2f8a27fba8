//! [`Session`] methods for explicit CUDA graphs (revision 11): `cuGraphCreate`, adding nodes,
//! dependencies, node queries and parameters, `cuGraphClone`, `cuGraphExec*SetParams` and
//! `cuGraphExecUpdate`. Graphs and nodes are session handles of the server.
//!
//! Kernel nodes pack their parameters as launches do. A host node's function stays in this
//! process and runs on the host-callback thread every time a launch reaches the node. A
//! memcpy node's host side in page-locked memory of the shared data area (`cuMemHostAlloc`
//! over shared memory) is named by its offset there, and the server reads and writes it
//! when the graph runs (zero-copy); any other host memory gets a device staging buffer whose
//! bytes every launch moves (revision 12, `session/graph_host.rs`).

use super::*;
use crate::host_callbacks::RepeatedCallback;

/// What `cuGraphExecUpdate` answers besides its status.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct ExecUpdateInfo {
    /// `CUgraphExecUpdateResult`.
    pub result: i32,
    /// The node handle that made it fail (0: none).
    pub error_node: RmHandle,
}

/// Which nodes [`Session::graph_node_list`] answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum NodeList {
    /// `cuGraphGetNodes`: every node of a graph.
    Nodes,
    /// `cuGraphGetRootNodes`: a graph's nodes without dependencies.
    Roots,
    /// `cuGraphNodeGetDependencies`: the nodes a node depends on.
    Dependencies,
    /// `cuGraphNodeGetDependentNodes`: the nodes that depend on a node.
    Dependents,
}

impl Session {
    revision_calls! {
        /// `cuGraphCreate` in context `ctx`.
        graph_create(ctx: RmHandle, flags: u32) -> RmHandle
            = 11, "cuGraphCreate": Reply::value, rm_graph_create(&RmGraphCreateArgs { ctx, flags });
        /// `cuGraphNodeGetType`.
        graph_node_type(node: RmHandle) -> i32
            = 11, "cuGraphNodeGetType": Reply::value, rm_graph_node_get_type(&node);
        /// `cuGraph{Kernel,Memset,Memcpy}NodeSetParams`.
        graph_node_set_params(node: RmHandle, params: RmNodeParams) -> ()
            = 11, "cuGraphKernelNodeSetParams": CuError::check,
            rm_graph_node_set_params(&RmNodeSetArgs { node, params });
        /// `cuGraphExec{Kernel,Memset,Memcpy}NodeSetParams`.
        graph_exec_node_set_params(exec: RmHandle, node: RmHandle, params: RmNodeParams) -> ()
            = 11, "cuGraphExecKernelNodeSetParams": CuError::check,
            rm_graph_exec_node_set_params(&RmExecNodeSetArgs { exec, node, params });
    }

    /// `cuGraphAdd*Node`/`cuGraphAddNode`: a node of `graph` after `deps`; memset and memcpy
    /// nodes run in `ctx` (0: the graph's context).
    pub fn graph_add_node(
        &self,
        graph: RmHandle,
        ctx: RmHandle,
        deps: &[RmHandle],
        params: RmNodeParams,
    ) -> CuResult<RmHandle> {
        self.need_revision(11, "cuGraphAdd*Node")?;
        if deps.len() > RM_MAX_GRAPH_NODES as usize {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let child = match params {
            RmNodeParams::RmNodeGraph(c) => Some(c),
            _ => None,
        };
        let node = Reply::value(call!(self.rm_graph_add_node(&RmAddNodeArgs {
            graph,
            ctx,
            dependencies: deps.to_vec(),
            params,
        }))?)?;
        self.graph_note_node(graph, node);
        if let Some(c) = child {
            self.graph_note_child(graph, node, c);
        }
        Ok(node)
    }

    /// `cuGraphAddHostNode`: `f` runs in this process at every launch that reaches the node.
    pub fn graph_add_host_node(
        &self,
        graph: RmHandle,
        deps: &[RmHandle],
        f: RepeatedCallback,
    ) -> CuResult<RmHandle> {
        self.need_revision(11, "cuGraphAddHostNode")?;
        let id = self
            .callbacks
            .register_repeated(&self.rpc, f)
            .map_err(|e| {
                tracing::error!("remora: cannot start the host callback thread: {e}");
                CuError(cu::OUT_OF_MEMORY)
            })?;
        let node = self.graph_add_node(graph, 0, deps, RmNodeParams::RmNodeHost(id))?;
        self.graph_note_host_node(graph, node);
        Ok(node)
    }

    /// The kernel node parameters of a launch of `function`, packed as launches are.
    ///
    /// # Safety
    /// `params` is NULL for a kernel without parameters, else holds one valid pointer per
    /// parameter of `function` (as `kernelParams` of `cuLaunchKernel`).
    pub unsafe fn kernel_node(
        &self,
        function: &FunctionInfo,
        grid: [u32; 3],
        block: [u32; 3],
        shared_mem_bytes: u32,
        params: *const *const std::ffi::c_void,
    ) -> CuResult<RmKernelNode> {
        let packed = if params.is_null() {
            if !function.params.is_empty() {
                return Err(CuError(cu::INVALID_VALUE));
            }
            Vec::new()
        } else {
            // SAFETY: the caller's contract.
            unsafe { crate::params::pack_kernel_params(&function.params, params) }?
        };
        // Reserved host ranges carry their own context.
        self.map_pointed_host_memory(0, &packed, &function.params);
        let dim = |d: [u32; 3]| RmDim3 {
            x: d[0],
            y: d[1],
            z: d[2],
        };
        Ok(RmKernelNode {
            function: function.handle,
            grid: dim(grid),
            block: dim(block),
            shared_mem_bytes,
            params: packed.into(),
        })
    }

    /// The data-area offset of `len` bytes of host memory at `ptr`, for a memcpy node; host
    /// memory the server cannot reach when the graph runs is refused loudly.
    pub fn graph_host_side(&self, what: &str, ptr: u64, len: u64) -> CuResult<u64> {
        self.pinned_offset(ptr, len).ok_or_else(|| {
            tracing::warn!(
                "remora: {what}: a memcpy node's host memory must be page-locked memory in the shared data area (cuMemHostAlloc/cudaMallocHost over shared memory), which the server reads when the graph runs; this memory is not (pageable, registered, or a socket session), and copying it now would give the graph stale data; returning CUDA_ERROR_NOT_SUPPORTED"
            );
            CuError(cu::NOT_SUPPORTED)
        })
    }

    /// The host address of data-area offset `offset` (memcpy node parameters read back).
    pub fn area_host_ptr(&self, offset: u64) -> CuResult<u64> {
        let area = self.area.as_ref().ok_or(CuError(cu::NOT_SUPPORTED))?;
        if offset > area.len() {
            return Err(CuError(cu::INVALID_VALUE));
        }
        Ok(area.base() + offset)
    }

    /// `cuGraphDestroyNode`.
    pub fn graph_destroy_node(&self, node: RmHandle) -> CuResult<()> {
        self.need_revision(11, "cuGraphDestroyNode")?;
        CuError::check(call!(self.rm_graph_destroy_node(&node))?)?;
        self.graph_forget_node(node);
        Ok(())
    }

    /// `cuGraphAddDependencies` (`add`) or `cuGraphRemoveDependencies`.
    pub fn graph_change_dependencies(
        &self,
        graph: RmHandle,
        from: &[RmHandle],
        to: &[RmHandle],
        add: bool,
    ) -> CuResult<()> {
        self.need_revision(11, "cuGraphAddDependencies")?;
        if from.len() != to.len() || from.len() > RM_MAX_GRAPH_NODES as usize {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let a = RmGraphEdgesArgs {
            graph,
            from: from.to_vec(),
            to: to.to_vec(),
        };
        CuError::check(if add {
            call!(self.rm_graph_add_dependencies(&a))?
        } else {
            call!(self.rm_graph_remove_dependencies(&a))?
        })
    }

    /// The nodes `list` names of `h`: a graph's for [`NodeList::Nodes`] and
    /// [`NodeList::Roots`], a node's for the others.
    pub fn graph_node_list(&self, h: RmHandle, list: NodeList) -> CuResult<Vec<RmHandle>> {
        let what = match list {
            NodeList::Nodes | NodeList::Roots => "cuGraphGetNodes",
            NodeList::Dependencies | NodeList::Dependents => "cuGraphNodeGetDependencies",
        };
        self.need_revision(11, what)?;
        Reply::value(match list {
            NodeList::Nodes => call!(self.rm_graph_get_nodes(&h))?,
            NodeList::Roots => call!(self.rm_graph_get_root_nodes(&h))?,
            NodeList::Dependencies => call!(self.rm_graph_node_get_dependencies(&h))?,
            NodeList::Dependents => call!(self.rm_graph_node_get_dependent_nodes(&h))?,
        })
    }

    /// `cuGraphGetEdges`: (from, to).
    pub fn graph_edges(&self, graph: RmHandle) -> CuResult<(Vec<RmHandle>, Vec<RmHandle>)> {
        self.need_revision(11, "cuGraphGetEdges")?;
        Reply::value(call!(self.rm_graph_get_edges(&graph))?).map(|e| (e.from, e.to))
    }

    /// `cuGraph{Kernel,Memset,Memcpy}NodeGetParams`.
    pub fn graph_node_params(&self, node: RmHandle) -> CuResult<RmNodeParams> {
        self.need_revision(11, "cuGraphKernelNodeGetParams")?;
        Reply::value(call!(self.rm_graph_node_get_params(&node))?)
    }

    /// `cuGraphClone`.
    pub fn graph_clone(&self, graph: RmHandle) -> CuResult<RmHandle> {
        self.need_revision(11, "cuGraphClone")?;
        let clone = Reply::value(call!(self.rm_graph_clone(&graph))?)?;
        self.graph_note_clone(graph, clone);
        Ok(clone)
    }

    /// `cuGraphExecUpdate`: the status, with the update result and failing node.
    pub fn graph_exec_update(
        &self,
        exec: RmHandle,
        graph: RmHandle,
    ) -> (CuResult<()>, ExecUpdateInfo) {
        if let Err(e) = self.need_revision(11, "cuGraphExecUpdate") {
            return (Err(e), ExecUpdateInfo::default());
        }
        match call!(self.rm_graph_exec_update(&RmExecUpdateArgs { exec, graph })) {
            Ok(r) => {
                let mut status = CuError::check(r.status);
                if status.is_ok() {
                    status = self.graph_exec_from(exec, graph);
                }
                (
                    status,
                    ExecUpdateInfo {
                        result: r.result,
                        error_node: r.error_node,
                    },
                )
            }
            Err(e) => (Err(e), ExecUpdateInfo::default()),
        }
    }
}
