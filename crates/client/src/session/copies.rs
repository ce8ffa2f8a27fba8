//! [`Session`] methods for 1-D copies (synchronous and asynchronous), peer copies and memset.

use super::*;

impl Session {
    /// `cuMemcpyHtoD` (synchronous).
    pub fn memcpy_htod(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        dst: u64,
        data: &[u8],
    ) -> CuResult<()> {
        self.htod(ctx, stream, dst, data, false)
    }

    /// `cuMemcpyDtoH` (synchronous) into `out`. Like every synchronizing call, its reply
    /// also delivers the asynchronous copies completed by then.
    pub fn memcpy_dtoh(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        src: u64,
        out: &mut [u8],
    ) -> CuResult<()> {
        if let Some(c) = self.pinned_copy(ctx, stream, src, out, false) {
            return self.memcpy_dtoh_pinned(c);
        }
        let mark = self.copy_mark();
        self.memcpy_dtoh_unsettled(ctx, stream, src, out)?;
        self.settle_stream(ctx, stream, mark)
    }

    /// The copy of [`Session::memcpy_dtoh`] without waiting for the delivery of earlier
    /// asynchronous copies: for the managed-memory hooks, which run inside another call whose
    /// reply (and the copies it carries) the calling thread has not processed yet (see
    /// `ctx_synchronize_unsettled`).
    pub(super) fn memcpy_dtoh_unsettled(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        src: u64,
        out: &mut [u8],
    ) -> CuResult<()> {
        if let Some((staging, chunk)) = self.area_staging(out.len()) {
            return self.area_dtoh(area_args(ctx, stream, src), out, &staging, chunk);
        }
        self.dtoh_socket(ctx, stream, src, out)
    }

    /// `cuMemcpyDtoD` (synchronous).
    pub fn memcpy_dtod(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        dst: u64,
        src: u64,
        size: u64,
    ) -> CuResult<()> {
        let r = call!(self.rm_memcpy_dtod(&RmDtodArgs {
            ctx,
            stream,
            dst,
            src,
            size
        }))?;
        self.finish_sync(r)
    }

    /// `cuMemsetD8/16/32` (synchronous).
    pub fn memset(&self, args: &RmMemsetArgs) -> CuResult<()> {
        if ![1, 2, 4].contains(&args.element_size) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let r = call!(self.rm_memset(args))?;
        self.finish_sync(r)
    }

    /// `cuMemcpyHtoDAsync`: one-way, the data travels with the call.
    pub fn memcpy_htod_async(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        dst: u64,
        data: &[u8],
    ) -> CuResult<()> {
        self.htod(ctx, stream, dst, data, true)
    }

    /// A host-to-device copy: from pinned memory through the data area, else staged in the
    /// data area (an asynchronous copy only from [`AREA_ASYNC_MIN`] bytes), else with the
    /// bytes in the calls. An asynchronous copy is one-way and refused on a capturing stream.
    fn htod(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        dst: u64,
        data: &[u8],
        asynchronous: bool,
    ) -> CuResult<()> {
        if let Some(c) = self.pinned_copy(ctx, stream, dst, data, asynchronous) {
            return self.memcpy_htod_pinned(c);
        }
        if asynchronous {
            self.not_captured(stream, "an asynchronous host-to-device copy")?;
        }
        if (!asynchronous || data.len() >= AREA_ASYNC_MIN)
            && let Some((staging, chunk)) = self.area_staging(data.len())
        {
            let args = area_args(ctx, stream, dst);
            return self.area_htod(args, data, &staging, chunk, asynchronous);
        }
        self.htod_socket(ctx, stream, dst, data, asynchronous)
    }

    /// `cuMemcpyDtoHAsync`: one-way; `sink` gets the data when a later synchronizing call's
    /// reply carries it.
    pub fn memcpy_dtoh_async(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        src: u64,
        size: u64,
        sink: CopySink,
    ) -> CuResult<()> {
        let total = usize::try_from(size).map_err(|_| CuError(cu::INVALID_VALUE))?;
        self.not_captured(stream, "an asynchronous device-to-host copy")?;
        if total <= COPY_CHUNK {
            return self.memcpy_dtoh_async_one(ctx, stream, src, size, sink.into());
        }
        let n = total.div_ceil(COPY_CHUNK);
        let state = Arc::new(Mutex::new(ChunkedSink {
            buf: vec![0; total],
            remaining: n,
            sink: Some(sink),
        }));
        for (off, len) in chunks(total) {
            let state = Arc::clone(&state);
            let part: CopySink = Box::new(move |data: &[u8]| {
                let mut st = lock(&state);
                let end = (off + data.len()).min(st.buf.len());
                st.buf[off..end].copy_from_slice(&data[..end - off]);
                st.remaining -= 1;
                if st.remaining == 0
                    && let Some(sink) = st.sink.take()
                {
                    sink(&st.buf);
                }
            });
            self.memcpy_dtoh_async_one(ctx, stream, src + off as u64, len as u64, part.into())?;
        }
        Ok(())
    }

    /// `cuMemcpyDtoHAsync` into host memory the caller names by address: like
    /// [`Session::memcpy_dtoh_async`], but a copy of several chunks has each chunk written
    /// straight to its place when a reply delivers it, instead of gathering the whole copy
    /// in a buffer first (an allocation of the copy's size, its page faults, and one more
    /// pass over the bytes).
    ///
    /// # Safety
    ///
    /// `dst` must stay valid for writes of `size` bytes until the copy is delivered, and
    /// nothing may read or write it meanwhile (CUDA's contract for an asynchronous copy: the
    /// program touches the destination only after a synchronizing call says it is complete).
    pub unsafe fn memcpy_dtoh_async_into(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        src: u64,
        dst: *mut u8,
        size: u64,
    ) -> CuResult<()> {
        let total = usize::try_from(size).map_err(|_| CuError(cu::INVALID_VALUE))?;
        self.not_captured(stream, "an asynchronous device-to-host copy")?;
        for (off, len) in chunks(total) {
            // SAFETY: `off + len <= size`: inside the caller's destination, which the caller
            // leaves to this copy until it is delivered.
            let place = Place(unsafe { dst.add(off) }, len);
            self.memcpy_dtoh_async_one(ctx, stream, src + off as u64, len as u64, place.into())?;
        }
        Ok(())
    }

    fn memcpy_dtoh_async_one(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        src: u64,
        size: u64,
        target: DtohTarget,
    ) -> CuResult<()> {
        let lease = self
            .area
            .as_ref()
            .filter(|_| size as usize >= AREA_ASYNC_MIN)
            .and_then(|a| a.alloc(size, 4096));
        if let Some(lease) = lease {
            // The server writes the bytes into the lease; the delivery says they are there.
            let offset = lease.offset();
            let len = size as usize;
            let from_area: CopySink = Box::new(move |_: &[u8]| {
                let read = |out: &mut [u8]| {
                    if !lease.get(out) {
                        tracing::error!("remora: an area copy's lease is smaller than the copy");
                    }
                };
                match target {
                    // Straight from the lease into the program's memory: one pass, no buffer
                    // (a fresh buffer of the copy's size, zeroed and faulted in, then a
                    // second pass, cost about 1 ms per 4 MiB on the H200 host).
                    DtohTarget::Place(place) => {
                        // SAFETY: see Place: writable for its length until delivered, now,
                        // and touched by nothing else meanwhile.
                        read(unsafe { std::slice::from_raw_parts_mut(place.0, place.1.min(len)) });
                    }
                    DtohTarget::Sink(sink) => {
                        let mut buf = vec![0u8; len];
                        read(&mut buf);
                        sink(&buf);
                    }
                }
            });
            return self
                .delivery
                .issue((ctx, stream, size), from_area, |copy_id| {
                    call!(self.rm_area_memcpy_dtoh_async(&RmAreaCopyArgs {
                        ctx,
                        stream,
                        dev: src,
                        offset,
                        size,
                        copy_id
                    }))
                });
        }
        self.delivery
            .issue((ctx, stream, size), target.into_sink(), |copy_id| {
                call!(self.rm_memcpy_dtoh_async(&RmDtohArgs {
                    ctx,
                    stream,
                    src,
                    size,
                    copy_id
                }))
            })
    }

    /// `cuMemcpyDtoDAsync`: one-way.
    pub fn memcpy_dtod_async(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        dst: u64,
        src: u64,
        size: u64,
    ) -> CuResult<()> {
        call!(self.rm_memcpy_dtod_async(&RmDtodArgs {
            ctx,
            stream,
            dst,
            src,
            size
        }))
    }

    /// `cuMemsetD2D8/16/32` (synchronous; revision 10): `height` rows, `pitch` bytes apart.
    pub fn memset_rows(&self, args: &RmMemset2dArgs) -> CuResult<()> {
        self.need_revision(10, "cuMemsetD2D8/16/32")?;
        if ![1, 2, 4].contains(&args.element_size) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        let r = call!(self.rm_memset_rows(args))?;
        self.finish_sync(r)
    }

    /// `cuMemsetD2D*Async`: one-way (revision 10).
    pub fn memset_rows_async(&self, args: &RmMemset2dArgs) -> CuResult<()> {
        self.need_revision(10, "cuMemsetD2D8/16/32Async")?;
        if ![1, 2, 4].contains(&args.element_size) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        call!(self.rm_memset_rows_async(args))
    }

    /// `cuMemsetD*Async`: one-way.
    pub fn memset_async(&self, args: &RmMemsetArgs) -> CuResult<()> {
        if ![1, 2, 4].contains(&args.element_size) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        call!(self.rm_memset_async(args))
    }

    fn peer_args(
        ctx: RmHandle,
        stream: RmHandle,
        (dst, dst_ctx): (u64, RmHandle),
        (src, src_ctx): (u64, RmHandle),
        size: u64,
    ) -> RmMemcpyPeerArgs {
        RmMemcpyPeerArgs {
            ctx,
            stream,
            dst,
            dst_ctx,
            src,
            src_ctx,
            size,
        }
    }

    /// `cuMemcpyPeer` (synchronous): `dst` and `src` are (pointer, context); `ctx` is the
    /// calling context.
    pub fn memcpy_peer(
        &self,
        ctx: RmHandle,
        dst: (u64, RmHandle),
        src: (u64, RmHandle),
        size: u64,
    ) -> CuResult<()> {
        self.need_revision(3, "cuMemcpyPeer")?;
        let r = call!(self.rm_memcpy_peer(&Self::peer_args(
            ctx,
            u64::from(RM_STREAM_LEGACY),
            dst,
            src,
            size
        )))?;
        self.finish_sync(r)
    }

    /// `cuMemcpyPeerAsync`: one-way.
    pub fn memcpy_peer_async(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        dst: (u64, RmHandle),
        src: (u64, RmHandle),
        size: u64,
    ) -> CuResult<()> {
        self.need_revision(3, "cuMemcpyPeerAsync")?;
        call!(self.rm_memcpy_peer_async(&Self::peer_args(ctx, stream, dst, src, size)))
    }

    /// A copy between device memory at `dev` and `host` when all of `host` lies in the
    /// session's pinned (data-area) memory, which copies reach without a staging copy.
    fn pinned_copy(
        &self,
        ctx: RmHandle,
        stream: RmHandle,
        dev: u64,
        host: &[u8],
        asynchronous: bool,
    ) -> Option<PinnedCopy> {
        let (ptr, size) = (host.as_ptr() as u64, host.len() as u64);
        (size > 0 && self.pinned_offset(ptr, size).is_some()).then_some(PinnedCopy {
            ctx,
            stream,
            dev,
            host: ptr,
            size,
            asynchronous,
        })
    }
}

/// Host memory an asynchronous device-to-host copy writes when it is delivered: address and
/// length.
struct Place(*mut u8, usize);

// SAFETY: per `Session::memcpy_dtoh_async_into`'s contract the place is writable until the
// copy is delivered and written only by the one sink that owns it, on whichever thread
// delivers.
unsafe impl Send for Place {}

/// Where the bytes of one asynchronous device-to-host copy go.
enum DtohTarget {
    /// A sink that gets them as a slice.
    Sink(CopySink),
    /// The program's memory, written in place.
    Place(Place),
}

impl From<Place> for DtohTarget {
    fn from(place: Place) -> Self {
        DtohTarget::Place(place)
    }
}

impl From<CopySink> for DtohTarget {
    fn from(sink: CopySink) -> Self {
        DtohTarget::Sink(sink)
    }
}

impl DtohTarget {
    /// The target as a sink of the delivered bytes (a copy whose bytes come in the reply).
    fn into_sink(self) -> CopySink {
        match self {
            DtohTarget::Sink(sink) => sink,
            DtohTarget::Place(place) => Box::new(move |data: &[u8]| {
                let place = place;
                let k = data.len().min(place.1);
                // SAFETY: see Place; `k` bytes fit it.
                unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), place.0, k) };
            }),
        }
    }
}
