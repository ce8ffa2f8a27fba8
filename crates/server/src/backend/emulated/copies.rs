//! Copies of the emulated **test** backend: the rows of 2-D and 3-D copies, and asynchronous
//! device-to-host copies staged when issued.

use std::sync::{Arc, Mutex};

use remora_proto::cuda::{CuError, CuResult, cu};

use super::host_functions::HostPending;
use super::{Copy3d, CopyPlace, EmulatedBackend, StagedCopy, State};
use crate::session::AreaTarget;

impl State {
    /// The rows of a 2-D or 3-D copy's source, packed.
    pub(super) fn gather(&mut self, copy: &Copy3d, src_host: &[u8]) -> CuResult<Vec<u8>> {
        let len = usize::try_from(copy.packed_len()).map_err(|_| CuError(cu::INVALID_VALUE))?;
        match copy.src.place {
            CopyPlace::Host if src_host.len() == len => Ok(src_host.to_vec()),
            CopyPlace::Host => Err(CuError(cu::INVALID_VALUE)),
            CopyPlace::Device(base) => {
                let mut out = Vec::with_capacity(len);
                for off in copy.row_offsets(&copy.src) {
                    let p = base.checked_add(off).ok_or(CuError(cu::INVALID_VALUE))?;
                    out.extend_from_slice(self.range(p, copy.width)?);
                }
                Ok(out)
            }
        }
    }

    /// Writes packed rows to a 2-D or 3-D copy's device destination.
    pub(super) fn scatter(&mut self, copy: &Copy3d, packed: &[u8]) -> CuResult<()> {
        let CopyPlace::Device(base) = copy.dst.place else {
            return Err(CuError(cu::INVALID_VALUE));
        };
        let width = usize::try_from(copy.width).map_err(|_| CuError(cu::INVALID_VALUE))?;
        let rows = packed.chunks(width.max(1));
        for (off, row) in copy.row_offsets(&copy.dst).zip(rows) {
            let p = base.checked_add(off).ok_or(CuError(cu::INVALID_VALUE))?;
            self.range(p, copy.width)?.copy_from_slice(row);
        }
        Ok(())
    }

    /// Checks the contexts a copy names (peer copies) and the calling context's stream.
    pub(super) fn copy_contexts(&self, ctx: u64, stream: u64, copy: &Copy3d) -> CuResult<()> {
        self.stream(ctx, stream)?;
        for c in [copy.src.ctx, copy.dst.ctx].into_iter().flatten() {
            self.ctx(c)?;
        }
        Ok(())
    }
}

/// An emulated asynchronous copy: its bytes, taken when issued, when it completes, and the
/// host functions its queries wait for (`EmulatedConfig::driver_busy_during_host_functions`).
pub(super) struct ReadyCopy(Vec<u8>, std::time::Instant, Option<Arc<HostPending>>);

/// An emulated asynchronous copy into a session's data area: its bytes, taken when issued,
/// land in the area once the copy completes (the first query that says so, or its wait), as
/// a DMA would; it has no bytes of its own to deliver.
pub(super) struct LandingCopy {
    done: ReadyCopy,
    bytes: Mutex<Option<Vec<u8>>>,
    target: AreaTarget,
}

impl LandingCopy {
    fn land(&self) {
        let bytes = self
            .bytes
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .take();
        if let Some(bytes) = bytes {
            let (area, offset) = &self.target;
            if area.write(*offset, &bytes).is_err() {
                tracing::error!(offset, "an emulated copy's bytes do not fit the data area");
            }
        }
    }
}

impl StagedCopy for LandingCopy {
    fn query(&self) -> CuResult<bool> {
        let done = self.done.query()?;
        if done {
            self.land();
        }
        Ok(done)
    }
    fn wait(&self) -> CuResult<()> {
        self.done.wait()?;
        self.land();
        Ok(())
    }
    fn data(&self) -> &[u8] {
        &[]
    }
    fn delivering(&self) {
        self.land();
    }
}

impl EmulatedBackend {
    /// A copy of `data` into `target` that lands there when it completes.
    pub(super) fn landing(&self, data: Vec<u8>, target: AreaTarget) -> LandingCopy {
        LandingCopy {
            done: self.staged(Vec::new()),
            bytes: Mutex::new(Some(data)),
            target,
        }
    }

    pub(super) fn staged(&self, data: Vec<u8>) -> ReadyCopy {
        ReadyCopy(
            data,
            std::time::Instant::now() + self.config.copy_latency,
            self.config
                .driver_busy_during_host_functions
                .then(|| Arc::clone(&self.host_pending)),
        )
    }
}

impl StagedCopy for ReadyCopy {
    fn query(&self) -> CuResult<bool> {
        if let Some(h) = &self.2 {
            h.wait_none();
        }
        Ok(std::time::Instant::now() >= self.1)
    }
    fn wait(&self) -> CuResult<()> {
        if let Some(h) = &self.2 {
            h.wait_none();
        }
        std::thread::sleep(self.1.saturating_duration_since(std::time::Instant::now()));
        Ok(())
    }
    fn data(&self) -> &[u8] {
        &self.0
    }
}
