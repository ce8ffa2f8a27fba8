//! Stream capture in the emulated **test** backend: the operations a capture records into a
//! graph ([`EmuOp`]), the capture itself, and how an executable graph replays them.

use std::sync::Arc;
use std::time::Instant;

use remora_proto::cuda::{CuError, CuResult, cu};

use super::{EmulatedBackend, State, emulated_kernels, fill, graphs};

/// A captured operation of an emulated graph.
#[derive(Debug, Clone)]
pub(super) enum EmuOp {
    Htod {
        dst: u64,
        data: Vec<u8>,
    },
    Dtod {
        dst: u64,
        src: u64,
        size: u64,
    },
    Memset {
        dst: u64,
        value: u32,
        elem: u32,
        count: u64,
    },
    /// A kernel launch: the function, the kernel's name, grid, block, parameters and their
    /// layout.
    Launch {
        function: u64,
        name: String,
        grid: [u32; 3],
        block: [u32; 3],
        params: Vec<u8>,
        layout: Vec<(u32, u32)>,
    },
    /// Event records and waits: ordering only, nothing to replay here.
    Nop,
    /// A memset node (2-D).
    Memset2d(crate::backend::graphs::MemsetNode),
    /// A memcpy node (device memory or the data area on either side).
    Copy(crate::backend::graphs::MemcpyNode),
    /// A host node: runs on the host-function thread.
    Host(Arc<crate::backend::graphs::HostNode>),
    /// A child graph node: a copy of the child, flattened when instantiated.
    Child(graphs::EmuGraph),
    /// An event record node.
    Record(u64),
    /// An event wait node (ordering only).
    Wait(u64),
    /// A graph memory allocation node: its address (fixed when added) and parameters.
    MemAlloc(u64, crate::backend::graphs::MemAllocNode),
    /// A graph memory free node.
    MemFree(u64),
}

/// A capture in progress.
pub(super) struct EmuCapture {
    pub(super) graph: u64,
    /// (context, stream) that began it.
    pub(super) origin: (u64, u64),
    pub(super) invalidated: bool,
}

impl State {
    /// Whether `stream` of `ctx` is capturing; if so records `op` (already validated) into
    /// the capture's graph.
    pub(super) fn capture(&mut self, ctx: u64, stream: u64, op: EmuOp) -> bool {
        let Some(id) = self.capturing.get(&(ctx, stream)).copied() else {
            return false;
        };
        if let Some(g) = self.captures.get(&id).map(|c| c.graph) {
            self.capture_into(g, op);
        }
        true
    }

    /// Refuses an operation that cannot be captured on a capturing stream, invalidating the
    /// capture as the driver does.
    pub(super) fn refuse_in_capture(&mut self, ctx: u64, stream: u64) -> CuResult<()> {
        if let Some(id) = self.capturing.get(&(ctx, stream)).copied() {
            if let Some(c) = self.captures.get_mut(&id) {
                c.invalidated = true;
            }
            return Err(CuError(cu::STREAM_CAPTURE_UNSUPPORTED));
        }
        Ok(())
    }

    /// Runs one operation of an executable graph.
    pub(super) fn replay(&mut self, op: &EmuOp) -> CuResult<()> {
        match op {
            EmuOp::Htod { dst, data } => {
                self.range(*dst, data.len() as u64)?.copy_from_slice(data);
            }
            EmuOp::Dtod { dst, src, size } => {
                let bytes = self.range(*src, *size)?.to_vec();
                self.range(*dst, *size)?.copy_from_slice(&bytes);
            }
            EmuOp::Memset {
                dst,
                value,
                elem,
                count,
            } => fill(self.range(*dst, count * u64::from(*elem))?, *value, *elem),
            EmuOp::Launch {
                name,
                function: _,
                grid,
                block,
                params,
                layout,
            } => {
                let l = emulated_kernels::Launch {
                    name,
                    grid: *grid,
                    block: *block,
                    params,
                    layout,
                };
                emulated_kernels::run(&l, self)?;
            }
            EmuOp::Nop | EmuOp::Child(_) => {}
            EmuOp::Wait(e) => {
                self.events.get(e).ok_or(CuError(cu::INVALID_HANDLE))?;
            }
            EmuOp::Memset2d(m) => self.memset_node(m)?,
            EmuOp::Copy(c) => self.copy_node(c)?,
            EmuOp::MemAlloc(p, _) => self.graphs.mem.allocated(*p),
            EmuOp::MemFree(p) => self.graphs.mem.freed(*p),
            // Run by the host-function thread (graphs::launch_with_host_nodes).
            EmuOp::Host(_) => {}
            EmuOp::Record(e) => {
                if let Some(t) = self.events.get_mut(e) {
                    *t = Some(Instant::now());
                }
            }
        }
        Ok(())
    }
}

impl EmulatedBackend {
    /// Checks that `stream` of `ctx` exists and is not capturing: a blocking call on a
    /// capturing stream is refused and invalidates the capture, as CUDA does.
    pub(super) fn outside_capture(&self, ctx: u64, stream: u64) -> CuResult<()> {
        let mut st = self.lock();
        st.stream(ctx, stream)?;
        st.refuse_in_capture(ctx, stream)
    }
}
