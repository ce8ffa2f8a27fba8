//! [`Session`] methods for copies through the shared data area: zero-copy pinned memory and
//! staging leases.

use super::*;
use crate::area::Lease;

impl Session {
    /// Bytes of the shared data area this session copies through (0: none, the copies travel
    /// inside the calls).
    pub fn data_area_size(&self) -> u64 {
        self.area.as_ref().map_or(0, |a| a.len())
    }

    /// Bytes this client has copied into or out of the shared data area so far (0 without
    /// one). Copies whose host side is zero-copy pinned memory add nothing.
    pub fn area_bytes_copied(&self) -> u64 {
        self.area.as_ref().map_or(0, |a| a.copied_bytes())
    }

    /// Bytes of the shared data area free now (0 without one).
    pub fn area_free_bytes(&self) -> u64 {
        self.area.as_ref().map_or(0, |a| a.free_bytes())
    }

    /// The offset in the data area of `len` bytes of host memory at `host`, when they lie
    /// entirely inside one live `cuMemHostAlloc` allocation that the area holds.
    pub fn pinned_offset(&self, host: u64, len: u64) -> Option<u64> {
        self.area.as_ref()?;
        self.host.area_offset(host, len)
    }

    /// The area copies of `c`, one per piece within a copy's bound, with `copy_id`: the
    /// data-area offset of its pinned bytes is found first (`CUDA_ERROR_INVALID_VALUE` unless
    /// they lie inside one live allocation there), and an asynchronous copy (`what` names
    /// it) is refused on a capturing stream.
    fn pinned_pieces(
        &self,
        c: &PinnedCopy,
        what: &str,
        copy_id: u64,
    ) -> CuResult<impl Iterator<Item = RmAreaCopyArgs> + use<>> {
        let offset = self
            .pinned_offset(c.host, c.size)
            .ok_or(CuError(cu::INVALID_VALUE))?;
        if c.asynchronous {
            self.not_captured(c.stream, what)?;
        }
        let (
            max,
            &PinnedCopy {
                ctx,
                stream,
                dev,
                size,
                ..
            },
        ) = (u64::from(RM_MAX_COPY), c);
        Ok((0..size.div_ceil(max)).map(move |i| {
            let rel = i * max;
            RmAreaCopyArgs {
                ctx,
                stream,
                dev: dev + rel,
                offset: offset + rel,
                size: max.min(size - rel),
                copy_id,
            }
        }))
    }

    /// `cuMemcpyHtoD[Async]` from zero-copy pinned memory (`c.dev` is the destination), e.g.
    /// refused after `cuMemFreeHost`. Only `(offset, size)` travels; the server reads the
    /// bytes where they are.
    pub fn memcpy_htod_pinned(&self, c: PinnedCopy) -> CuResult<()> {
        let copy_id = if c.asynchronous {
            AREA_PINNED_SOURCE
        } else {
            0
        };
        for a in self.pinned_pieces(&c, "an asynchronous host-to-device copy", copy_id)? {
            if c.asynchronous {
                call!(self.rm_area_memcpy_htod_async(&a))?;
            } else {
                self.finish_sync(call!(self.rm_area_memcpy_htod(&a))?)?;
            }
        }
        Ok(())
    }

    /// `cuMemcpyDtoH[Async]` into zero-copy pinned memory (`c.dev` is the source). The server
    /// writes the bytes straight there. Synchronous: they are there when this returns.
    /// Asynchronous (one-way, copy id 0: no delivery): they are there once the stream's work
    /// up to the copy has completed, i.e. when the synchronize, event or query that CUDA
    /// defines says so; no pending copy is recorded on the client.
    pub fn memcpy_dtoh_pinned(&self, c: PinnedCopy) -> CuResult<()> {
        let pieces = self.pinned_pieces(&c, "an asynchronous device-to-host copy", 0)?;
        let mark = self.copy_mark();
        for a in pieces {
            if c.asynchronous {
                call!(self.rm_area_memcpy_dtoh_async(&a))?;
            } else {
                self.finish_sync(call!(self.rm_area_memcpy_dtoh(&a))?)?;
            }
        }
        if c.asynchronous {
            return Ok(());
        }
        self.settle_stream(c.ctx, c.stream, mark)
    }

    /// Staging space for a copy of `total` bytes through the data area: one lease, or two
    /// used alternately when the copy takes several chunks, and the chunk size. `None` when
    /// the session has no area or no room now (the copy then travels inside the calls).
    pub(super) fn area_staging(&self, total: usize) -> Option<(Vec<Lease>, usize)> {
        let alloc = self.area.as_ref()?;
        if total == 0 {
            return None;
        }
        let max_chunk = (alloc.len() / 4).clamp(4096, AREA_CHUNK as u64) as usize;
        // The largest chunk that fits now: halve down to MIN_AREA_CHUNK while the area is
        // busy (pinned allocations, other threads' copies) before sending the data inside
        // the calls, which is several times slower.
        let mut chunk = total.min(max_chunk);
        loop {
            let n = if total > chunk { 2 } else { 1 };
            let leases: Option<Vec<Lease>> =
                (0..n).map(|_| alloc.alloc(chunk as u64, 4096)).collect();
            if let Some(l) = leases {
                return Some((l, chunk));
            }
            let floor = MIN_AREA_CHUNK.min(max_chunk / 4).max(4096);
            if chunk <= floor {
                return None;
            }
            chunk = (chunk / 2).max(floor);
        }
    }

    /// A host-to-device copy through the data area, chunk by chunk: while the server copies
    /// chunk i out of one lease, this thread fills the other with chunk i + 1. `asynchronous`:
    /// `RM_AREA_MEMCPY_HTOD_ASYNC` on `stream` (errors deferred), else the synchronous form.
    pub(super) fn area_htod(
        &self,
        args: RmAreaCopyArgs,
        data: &[u8],
        staging: &[Lease],
        chunk: usize,
        asynchronous: bool,
    ) -> CuResult<()> {
        let one = |a: RmAreaCopyArgs| -> CuResult<()> {
            if asynchronous {
                call!(self.rm_area_memcpy_htod_async(&a))
            } else {
                self.finish_sync(call!(self.rm_area_memcpy_htod(&a))?)
            }
        };
        let joined = |h: std::thread::ScopedJoinHandle<'_, CuResult<()>>| {
            h.join().unwrap_or(Err(CuError(cu::UNKNOWN)))
        };
        std::thread::scope(|s| {
            let mut inflight = None;
            for (i, off) in (0..data.len()).step_by(chunk).enumerate() {
                let len = chunk.min(data.len() - off);
                let lease = &staging[i % staging.len()];
                // The lease's previous chunk (i - 2) was answered: the server is done with it.
                if !lease.put(&data[off..off + len]) {
                    return Err(CuError(cu::UNKNOWN));
                }
                if let Some(h) = inflight.take() {
                    joined(h)?;
                }
                let a = RmAreaCopyArgs {
                    dev: args.dev + off as u64,
                    offset: lease.offset(),
                    size: len as u64,
                    ..args.clone()
                };
                if data.len() <= chunk {
                    return one(a);
                }
                inflight = Some(s.spawn(move || one(a)));
            }
            inflight.map_or(Ok(()), joined)
        })
    }

    /// A synchronous device-to-host copy through the data area: the server writes chunk i + 1
    /// into one lease while this thread copies chunk i out of the other.
    pub(super) fn area_dtoh(
        &self,
        args: RmAreaCopyArgs,
        out: &mut [u8],
        staging: &[Lease],
        chunk: usize,
    ) -> CuResult<()> {
        let total = out.len();
        let issue = |i: usize| {
            let off = i * chunk;
            let a = RmAreaCopyArgs {
                dev: args.dev + off as u64,
                offset: staging[i % staging.len()].offset(),
                size: chunk.min(total - off) as u64,
                ..args.clone()
            };
            move || -> CuResult<()> { self.finish_sync(call!(self.rm_area_memcpy_dtoh(&a))?) }
        };
        let n = total.div_ceil(chunk);
        if n == 1 {
            issue(0)()?;
            return if staging[0].get(out) {
                Ok(())
            } else {
                Err(CuError(cu::UNKNOWN))
            };
        }
        std::thread::scope(|s| {
            let mut inflight = Some(s.spawn(issue(0)));
            for (i, part) in out.chunks_mut(chunk).enumerate() {
                if let Some(h) = inflight.take() {
                    h.join().unwrap_or(Err(CuError(cu::UNKNOWN)))?;
                }
                if i + 1 < n {
                    // Into the other lease, whose chunk (i - 1) has been copied out.
                    inflight = Some(s.spawn(issue(i + 1)));
                }
                if !staging[i % staging.len()].get(part) {
                    return Err(CuError(cu::UNKNOWN));
                }
            }
            Ok(())
        })
    }
}
