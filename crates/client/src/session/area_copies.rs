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

    /// The `(relative offset, size)` pieces of a zero-copy copy of `size` bytes, each within
    /// one copy's bound.
    fn pinned_pieces(size: u64) -> impl Iterator<Item = (u64, u64)> {
        let max = u64::from(RM_MAX_COPY);
        (0..size.div_ceil(max)).map(move |i| (i * max, max.min(size - i * max)))
    }

    /// The data-area offset of the `size` pinned bytes at `host` (`CUDA_ERROR_INVALID_VALUE`
    /// unless they lie inside one live allocation there); an asynchronous copy (`Some(what)`)
    /// is also refused on a capturing `stream`.
    fn pinned_area_offset(
        &self,
        stream: RmHandle,
        host: u64,
        size: u64,
        asynchronous: Option<&str>,
    ) -> CuResult<u64> {
        let offset = self
            .pinned_offset(host, size)
            .ok_or(CuError(cu::INVALID_VALUE))?;
        if let Some(what) = asynchronous {
            self.not_captured(stream, what)?;
        }
        Ok(offset)
    }

    /// `cuMemcpyHtoD[Async]` from zero-copy pinned memory: `size` bytes at `host`, which must
    /// lie inside one live allocation in the data area (`CUDA_ERROR_INVALID_VALUE`
    /// otherwise, e.g. after `cuMemFreeHost`). Only `(offset, size)` travels; the server
    /// reads the bytes where they are. `asynchronous`: on `stream`, errors deferred.
    pub fn memcpy_htod_pinned(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        dst: u64,
        host: u64,
        size: u64,
        asynchronous: bool,
    ) -> CuResult<()> {
        let what = "an asynchronous host-to-device copy";
        let offset = self.pinned_area_offset(stream, host, size, asynchronous.then_some(what))?;
        for (rel, len) in Self::pinned_pieces(size) {
            let a = RmAreaCopyArgs {
                ctx,
                stream,
                dev: dst + rel,
                offset: offset + rel,
                size: len,
                copy_id: if asynchronous { AREA_PINNED_SOURCE } else { 0 },
            };
            if asynchronous {
                call!(self.rm_area_memcpy_htod_async(&a))?;
            } else {
                self.finish_sync(call!(self.rm_area_memcpy_htod(&a))?)?;
            }
        }
        Ok(())
    }

    /// `cuMemcpyDtoH[Async]` into zero-copy pinned memory: `size` bytes at `host`, which must
    /// lie inside one live allocation in the data area (`CUDA_ERROR_INVALID_VALUE`
    /// otherwise). The server writes the bytes straight there. Synchronous: they are there
    /// when this returns. Asynchronous (one-way, copy id 0: no delivery): they are there
    /// once the stream's work up to the copy has completed, i.e. when the synchronize, event
    /// or query that CUDA defines says so; no pending copy is recorded on the client.
    pub fn memcpy_dtoh_pinned(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        src: u64,
        host: u64,
        size: u64,
        asynchronous: bool,
    ) -> CuResult<()> {
        let what = "an asynchronous device-to-host copy";
        let offset = self.pinned_area_offset(stream, host, size, asynchronous.then_some(what))?;
        let mark = self.copy_mark();
        for (rel, len) in Self::pinned_pieces(size) {
            let a = RmAreaCopyArgs {
                ctx,
                stream,
                dev: src + rel,
                offset: offset + rel,
                size: len,
                copy_id: 0,
            };
            if asynchronous {
                call!(self.rm_area_memcpy_dtoh_async(&a))?;
            } else {
                self.finish_sync(call!(self.rm_area_memcpy_dtoh(&a))?)?;
            }
        }
        if asynchronous {
            return Ok(());
        }
        self.settle_stream(ctx, stream, mark)
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
