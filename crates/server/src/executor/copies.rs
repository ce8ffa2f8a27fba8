//! Copy procedures: synchronous and asynchronous 1-D copies, memset, peer copies, 2-D and
//! 3-D copies, and copies through the shared data area.

use super::*;
use crate::backend::staged_bytes;
use remora_proto::cuda::{CuError, CuResult, cu};

/// Synchronous host-to-device copies at least this large run on a waiter thread
/// ([`Executor::memcpy_htod`]).
const HTOD_ON_WAITER_MIN: usize = 1 << 20;

impl Executor {
    pub(super) fn memcpy_htod(&self, call: &CallContext, a: RmHtodArgs) -> ProcResult<RmSyncReply> {
        fn resolve(st: &SessionState, a: &RmHtodArgs) -> CuResult<u64> {
            st.check_range(a.dst, a.data.len() as u64)?;
            st.ctx(a.ctx)
        }
        if a.data.len() < HTOD_ON_WAITER_MIN {
            return self.sync_call(
                call,
                "RM_MEMCPY_HTOD",
                |st| resolve(st, &a),
                |b, c| b.memcpy_htod(c, None, a.dst, &a.data),
            );
        }
        // A large copy is a chunk of a pipelined one (the client sends the next chunks without
        // waiting): copy it on a waiter thread, so that the connection thread receives the
        // next chunk meanwhile.
        self.blocking(call, move |inner, session| {
            let c = resolve(&session.lock(), &a);
            let timed = inner.profiling().then(std::time::Instant::now);
            let own = c.and_then(|c| inner.backend.memcpy_htod(c, None, a.dst, &a.data));
            if let Some(t) = timed {
                session.count_bulk_copy(a.data.len(), t.elapsed());
            }
            drop(a);
            let mut st = session.lock();
            inner.sync_reply("RM_MEMCPY_HTOD", &mut st, own, Scope::Finished)
        })
    }

    pub(super) fn memcpy_dtoh(&self, call: &CallContext, a: RmDtohArgs) -> ProcResult<RmDtohReply> {
        self.blocking(call, move |inner, session| {
            let raw = {
                let st = session.lock();
                st.check_range(a.src, a.size)
                    .and_then(|()| st.ctx(a.ctx))
                    .and_then(|c| {
                        if a.size > u64::from(RM_MAX_COPY) {
                            Err(CuError(cu::INVALID_VALUE))
                        } else {
                            Ok(c)
                        }
                    })
            };
            let r = raw.and_then(|c| {
                // Into the backend's pinned memory, which the reply is sent from; else into a
                // reused buffer of the session.
                timed_read(inner, session, || {
                    inner
                        .backend
                        .memcpy_dtoh_owned(c, a.src, a.size as usize)
                        .unwrap_or_else(|| {
                            bulk_read(session, a.size, |buf| {
                                inner.backend.memcpy_dtoh(c, buf, a.src)
                            })
                        })
                })
            });
            // A synchronous copy waits for the context's legacy stream: the async copies
            // queued there before it are complete too.
            let scope = Scope::Stream(a.ctx, u64::from(RM_STREAM_LEGACY));
            dtoh_reply(inner, session, "RM_MEMCPY_DTOH", scope, r)
        })
    }

    /// RM_MEMCPY_DTOH_STREAM (revision 17): a device-to-host copy in `a.stream`'s order,
    /// answered with its bytes once it has completed, as the driver runs a copy into pageable
    /// memory. On a waiter thread: staged in pinned memory and waited for; the reply is sent
    /// from the staging buffer ([`staged_bytes`]).
    pub(super) fn memcpy_dtoh_stream(
        &self,
        call: &CallContext,
        a: RmDtohArgs,
    ) -> ProcResult<RmDtohReply> {
        self.blocking(call, move |inner, session| {
            let r = (|| {
                if a.size > u64::from(RM_MAX_COPY) || a.copy_id != 0 {
                    return Err(CuError(cu::INVALID_VALUE));
                }
                let (c, s) = copy_on_stream(inner, session, (a.ctx, a.stream), a.src, a.size)?;
                timed_read(inner, session, || {
                    let staged = inner
                        .backend
                        .memcpy_dtoh_async(c, s, a.src, a.size as usize)?;
                    staged.wait()?;
                    Ok(staged_bytes(staged.into()))
                })
            })();
            // The copy waited for the stream: its earlier asynchronous copies are complete.
            let scope = Scope::Stream(a.ctx, a.stream);
            dtoh_reply(inner, session, "RM_MEMCPY_DTOH_STREAM", scope, r)
        })
    }

    pub(super) fn memcpy_htod_async(&self, call: &CallContext, a: RmHtodArgs) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        self.oneway_on(call, "RM_MEMCPY_HTOD_ASYNC", on, |inner, session| {
            let (c, s) = copy_on_stream(
                inner,
                session,
                (a.ctx, a.stream),
                a.dst,
                a.data.len() as u64,
            )?;
            inner.backend.memcpy_htod(c, Some(s), a.dst, &a.data)
        })
    }

    pub(super) fn memcpy_dtoh_async(&self, call: &CallContext, a: RmDtohArgs) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        self.oneway_on(call, "RM_MEMCPY_DTOH_ASYNC", on, |inner, session| {
            if a.copy_id == RM_DEVICE_OUTPUT_ID {
                // Reserved for device output: such a copy could never be told apart.
                return Err(CuError(cu::INVALID_VALUE));
            }
            let issued = (|| {
                let (c, s, capturing) = {
                    let st = session.lock();
                    st.check_range(a.src, a.size)?;
                    if a.size > u64::from(RM_MAX_COPY) {
                        return Err(CuError(cu::INVALID_VALUE));
                    }
                    (
                        st.ctx(a.ctx)?,
                        st.stream(a.stream)?,
                        !st.captures.is_empty(),
                    )
                };
                session.copies.admit(a.size)?;
                // Captured, the copy would land in staging memory only when the graph runs,
                // and its delivery would never come.
                not_captured(inner, capturing, c, s)?;
                inner
                    .backend
                    .memcpy_dtoh_async(c, s, a.src, a.size as usize)
            })();
            let issued = issued.map(|copy| (copy, None));
            push_pending(session, a.copy_id, a.ctx, a.stream, issued)
        })
    }

    pub(super) fn mem_host_device_pointer(
        &self,
        call: &CallContext,
        a: RmAreaPtrArgs,
    ) -> ProcResult<RmU64Reply> {
        let area = area_of(call, a.offset, 1);
        let r = self.in_ctx(&self.session(call), a.ctx, |b, c| {
            b.area_device_pointer(c, &area?, a.offset)
        });
        Ok(u64_reply("RM_MEM_HOST_DEVICE_POINTER", r))
    }

    pub(super) fn area_map(&self, call: &CallContext, a: RmAreaMapArgs) -> ProcResult<RmU64Reply> {
        let area = call
            .data_area()
            .ok_or(CuError(cu::NOT_SUPPORTED))
            .and_then(|area| {
                if a.size == 0 || area.check(a.offset, a.size).is_err() {
                    Err(CuError(cu::INVALID_VALUE))
                } else {
                    Ok(area.clone())
                }
            });
        let r = self.in_ctx(&self.session(call), a.ctx, |b, c| {
            b.area_map(c, &area?, a.offset, a.size)
        });
        Ok(u64_reply("RM_AREA_MAP", r))
    }

    pub(super) fn area_memcpy_htod(
        &self,
        call: &CallContext,
        a: RmAreaCopyArgs,
    ) -> ProcResult<RmSyncReply> {
        let area = area_of(call, a.offset, a.size);
        self.sync_call(
            call,
            "RM_AREA_MEMCPY_HTOD",
            |st| {
                let area = area?;
                st.check_range(a.dev, a.size)?;
                Ok((st.ctx(a.ctx)?, area))
            },
            |b, (c, area)| b.memcpy_htod_area(c, AreaHtod::Sync, area_copy(&area, &a)),
        )
    }

    pub(super) fn area_memcpy_dtoh(
        &self,
        call: &CallContext,
        a: RmAreaCopyArgs,
    ) -> ProcResult<RmSyncReply> {
        let area = area_of(call, a.offset, a.size);
        self.blocking(call, move |inner, session| {
            let raw = area.and_then(|area| {
                let st = session.lock();
                st.check_range(a.dev, a.size)?;
                Ok((st.ctx(a.ctx)?, area))
            });
            let r =
                raw.and_then(|(c, area)| inner.backend.memcpy_dtoh_area(c, area_copy(&area, &a)));
            let mut st = session.lock();
            let mut status = st.sync_status(r);
            // As RM_MEMCPY_DTOH: the legacy stream's earlier async copies are complete too.
            let copies = inner.collect(
                &mut st,
                Scope::Stream(a.ctx, u64::from(RM_STREAM_LEGACY)),
                &mut status,
            );
            log_failed("RM_AREA_MEMCPY_DTOH", status);
            RmSyncReply { status, copies }
        })
    }

    pub(super) fn area_memcpy_htod_async(
        &self,
        call: &CallContext,
        a: RmAreaCopyArgs,
    ) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        // The reply only says that the source bytes have been consumed; errors are deferred
        // as a one-way call's.
        self.oneway_on(call, "RM_AREA_MEMCPY_HTOD_ASYNC", on, |inner, session| {
            let area = area_of(call, a.offset, a.size)?;
            let (c, s) = copy_on_stream(inner, session, (a.ctx, a.stream), a.dev, a.size)?;
            // Zero-copy pinned memory: the client does not reuse the bytes before the stream
            // reaches the copy, so the backend may read them as late as that.
            let how = if a.copy_id == AREA_PINNED_SOURCE {
                AreaHtod::AsyncPinned(s)
            } else {
                AreaHtod::Async(s)
            };
            inner.backend.memcpy_htod_area(c, how, area_copy(&area, &a))
        })
    }

    pub(super) fn area_memcpy_dtoh_async(
        &self,
        call: &CallContext,
        a: RmAreaCopyArgs,
    ) -> ProcResult<()> {
        let on = Some((a.ctx, a.stream));
        self.oneway_on(call, "RM_AREA_MEMCPY_DTOH_ASYNC", on, |inner, session| {
            if a.copy_id == RM_DEVICE_OUTPUT_ID {
                return Err(CuError(cu::INVALID_VALUE));
            }
            if a.copy_id == 0 {
                // Zero-copy pinned memory: the bytes go straight into the area when the
                // copy executes, and nothing is delivered (the client waits for nothing).
                let area = area_of(call, a.offset, a.size)?;
                let (c, s) = copy_on_stream(inner, session, (a.ctx, a.stream), a.dev, a.size)?;
                return inner
                    .backend
                    .memcpy_dtoh_async_area(c, s, area_copy(&area, &a));
            }
            let area = area_of(call, a.offset, a.size);
            let issued = (|| {
                let area = area.clone()?;
                let (c, s) = copy_on_stream(inner, session, (a.ctx, a.stream), a.dev, a.size)?;
                // Straight into the area where the backend can DMA there: no staging buffer,
                // and nothing to write at delivery (the client reads its lease then).
                session.copies.admit(0)?;
                if let Some(copy) =
                    inner
                        .backend
                        .memcpy_dtoh_async_in_area(c, s, area_copy(&area, &a))
                {
                    return Ok((copy?, None));
                }
                session.copies.admit(a.size)?;
                // `area_of` bounded the size by the area's.
                let copy = inner
                    .backend
                    .memcpy_dtoh_async(c, s, a.dev, a.size as usize)?;
                Ok((copy, Some((area, a.offset))))
            })();
            push_pending(session, a.copy_id, a.ctx, a.stream, issued)
        })
    }

    /// `RM_MEMCPY_3D` / `RM_MEMCPY_3D_PEER`: a synchronizing call. A copy to host memory
    /// returns the packed bytes and, like `RM_MEMCPY_DTOH`, runs on a waiter thread and
    /// delivers the asynchronous copies of the context's legacy stream.
    pub(super) fn copy_3d(
        &self,
        call: &CallContext,
        a: RmMemcpy3dArgs,
        peer: bool,
    ) -> ProcResult<RmDtohReply> {
        let what = if peer {
            "RM_MEMCPY_3D_PEER"
        } else {
            "RM_MEMCPY_3D"
        };
        let to_host = a.desc.dst.kind == RmMemKind::RmMemHostPacked;
        let job = move |inner: &Inner, session: &Session| {
            let target = copy_target(&session.lock(), &a, peer, false);
            let r = target.and_then(|(ctx, copy)| {
                let Some(copy) = copy else {
                    return Ok(remora_xdr::Bytes::new());
                };
                let mut buf = if to_host {
                    // Bounded by copy_target (RM_MAX_COPY).
                    vec![0u8; copy.packed_len() as usize]
                } else {
                    Vec::new()
                };
                inner.backend.memcpy_3d(
                    ctx,
                    None,
                    Copy3dIo {
                        copy: &copy,
                        src_host: &a.data,
                        dst_host: &mut buf,
                    },
                )?;
                Ok(remora_xdr::Bytes::from(buf))
            });
            let scope = if to_host {
                Scope::Stream(a.desc.ctx, u64::from(RM_STREAM_LEGACY))
            } else {
                Scope::Finished
            };
            dtoh_reply(inner, session, what, scope, r)
        };
        if to_host {
            self.blocking(call, job)
        } else {
            let session = self.session(call);
            Ok(job(&self.inner, &session))
        }
    }

    /// `RM_MEMCPY_3D_ASYNC` / `RM_MEMCPY_3D_PEER_ASYNC`: one-way. A copy to host memory lands
    /// in staging memory and is delivered, tagged with its `copy_id`, by a later synchronizing
    /// reply; one that fails is delivered empty (its error is deferred as for every one-way
    /// call), so that the client never waits for data that will not come.
    pub(super) fn copy_3d_async(
        &self,
        call: &CallContext,
        a: RmMemcpy3dArgs,
        peer: bool,
    ) -> ProcResult<()> {
        let what = if peer {
            "RM_MEMCPY_3D_PEER_ASYNC"
        } else {
            "RM_MEMCPY_3D_ASYNC"
        };
        let to_host = a.desc.dst.kind == RmMemKind::RmMemHostPacked;
        let stream_handle = match a.desc.stream {
            0 => u64::from(RM_STREAM_LEGACY),
            s => s,
        };
        let from_host = a.desc.src.kind == RmMemKind::RmMemHostPacked;
        let on = Some((a.desc.ctx, a.desc.stream));
        self.oneway_on(call, what, on, |inner, session| {
            if to_host && a.copy_id == RM_DEVICE_OUTPUT_ID {
                return Err(CuError(cu::INVALID_VALUE));
            }
            let issued = (|| {
                let (ctx, copy, stream, capturing) = {
                    let st = session.lock();
                    let (ctx, copy) = copy_target(&st, &a, peer, true)?;
                    let capturing = !st.captures.is_empty() && (to_host || from_host);
                    (ctx, copy, st.stream(a.desc.stream)?, capturing)
                };
                not_captured(inner, capturing, ctx, stream)?;
                let Some(copy) = copy else {
                    return Ok(None);
                };
                if to_host {
                    session.copies.admit(copy.packed_len())?;
                    Ok(Some(
                        inner.backend.memcpy_3d_dtoh_async(ctx, stream, &copy)?,
                    ))
                } else {
                    inner.backend.memcpy_3d(
                        ctx,
                        Some(stream),
                        Copy3dIo {
                            copy: &copy,
                            src_host: &a.data,
                            dst_host: &mut [],
                        },
                    )?;
                    Ok(None)
                }
            })();
            let (copy, result): (Option<Box<dyn StagedCopy>>, CuResult<()>) = match issued {
                Ok(c) => (c, Ok(())),
                Err(e) => (Some(Box::new(crate::backend::NoBytes)), Err(e)),
            };
            if to_host && let Some(copy) = copy {
                session.copies.push(PendingCopy {
                    copy_id: a.copy_id,
                    ctx: a.desc.ctx,
                    stream: stream_handle,
                    copy: copy.into(),
                    area: None,
                    taken: Default::default(),
                });
            }
            result
        })
    }
}

/// `copy_id` of an `RM_AREA_MEMCPY_HTOD_ASYNC` whose source is zero-copy pinned memory
/// (docs/protocol.md, revision 6): the bytes stay put until the stream reaches the copy.
/// Any other value: a staging lease that the client reuses once the call is answered.
const AREA_PINNED_SOURCE: u64 = 1;

/// The session's data area, when `size` bytes at `offset` lie inside it and the size is
/// within one copy's bound; `CUDA_ERROR_INVALID_VALUE` otherwise (no area, or out of bounds:
/// the client chose these numbers).
/// Queues an asynchronous device-to-host copy (and the data-area bytes it lands in, if
/// any) for delivery to the client on stream handle `stream` (0: the legacy stream). A copy
/// that could not be issued is delivered empty all the same, so that the client does not wait
/// for data that will not come; its error is returned, to be deferred like every one-way
/// call's.
fn push_pending(
    session: &Session,
    copy_id: u64,
    ctx: u64,
    stream: u64,
    issued: CuResult<(Box<dyn StagedCopy>, Option<crate::session::AreaTarget>)>,
) -> CuResult<()> {
    let (copy, area, result): (Box<dyn StagedCopy>, _, _) = match issued {
        Ok((copy, area)) => (copy, area, Ok(())),
        Err(e) => (Box::new(crate::backend::NoBytes), None, Err(e)),
    };
    let stream = if stream == 0 {
        u64::from(RM_STREAM_LEGACY)
    } else {
        stream
    };
    session.copies.push(PendingCopy {
        copy_id,
        ctx,
        stream,
        copy: copy.into(),
        area,
        taken: Default::default(),
    });
    result
}

/// The bytes a device-to-host copy reads with `read`, its time counted when profiling.
fn timed_read(
    inner: &Inner,
    session: &Session,
    read: impl FnOnce() -> CuResult<remora_xdr::Bytes>,
) -> CuResult<remora_xdr::Bytes> {
    let timed = inner.profiling().then(std::time::Instant::now);
    let r = read();
    if let (Some(t), Ok(bytes)) = (timed, &r) {
        session.count_bulk_copy(bytes.len(), t.elapsed());
    }
    r
}

/// `size` bytes a synchronous device-to-host copy reads: `fill` writes them into one of the
/// session's reused bulk buffers.
fn bulk_read(
    session: &Session,
    size: u64,
    fill: impl FnOnce(&mut [u8]) -> CuResult<()>,
) -> CuResult<remora_xdr::Bytes> {
    let mut buf = session.bulk_buffer(size as usize);
    fill(&mut buf)?;
    let buf = buf.freeze();
    session.keep_bulk_buffer(&buf);
    Ok(buf)
}

/// The reply of a synchronous device-to-host copy (`what`, for the log) whose bytes are `r`:
/// the session's status (a deferred error comes first) and the completed asynchronous copies
/// `scope` covers; no bytes unless all went well.
fn dtoh_reply(
    inner: &Inner,
    session: &Session,
    what: &str,
    scope: Scope,
    r: CuResult<remora_xdr::Bytes>,
) -> RmDtohReply {
    let mut st = session.lock();
    let mut status = st.sync_status(r.as_ref().map(|_| ()).map_err(|e| *e));
    let copies = inner.collect(&mut st, scope, &mut status);
    let data = match r {
        Ok(data) if status == cu::SUCCESS => data,
        _ => remora_xdr::Bytes::new(),
    };
    log_failed(what, status);
    RmDtohReply {
        status,
        data,
        copies,
    }
}

/// The raw context and stream of an asynchronous copy from or to client memory that touches
/// `size` bytes at device address `dev`; refused on a capturing stream ([`not_captured`]).
fn copy_on_stream(
    inner: &Inner,
    session: &Session,
    (ctx, stream): (u64, u64),
    dev: u64,
    size: u64,
) -> CuResult<(u64, u64)> {
    let (c, s, capturing) = {
        let st = session.lock();
        st.check_range(dev, size)?;
        (st.ctx(ctx)?, st.stream(stream)?, !st.captures.is_empty())
    };
    not_captured(inner, capturing, c, s)?;
    Ok((c, s))
}

/// The copy between device memory and the data area that an area copy names.
fn area_copy<'a>(area: &'a remora_oncrpc::DataArea, a: &RmAreaCopyArgs) -> AreaCopy<'a> {
    AreaCopy {
        dev: a.dev,
        span: AreaSpan {
            area,
            offset: a.offset,
            size: a.size,
        },
    }
}

/// The device-to-device copy that `RM_MEMCPY_DTOD[_ASYNC]` names.
pub(super) fn dtod_copy(a: &RmDtodArgs) -> DtodCopy {
    DtodCopy {
        dst: a.dst,
        src: a.src,
        size: a.size,
    }
}

fn area_of(call: &CallContext, offset: u64, size: u64) -> CuResult<remora_oncrpc::DataArea> {
    let area = call.data_area().ok_or(CuError(cu::INVALID_VALUE))?;
    if size > u64::from(RM_MAX_COPY) || area.check(offset, size).is_err() {
        tracing::debug!(
            offset,
            size,
            area = area.len(),
            "an area copy names bytes outside the data area"
        );
        return Err(CuError(cu::INVALID_VALUE));
    }
    Ok(area.clone())
}

/// `(calling context, stream, destination context, source context)` of a peer copy, with
/// both ranges checked against the session's allocations.
pub(super) fn peer_target(
    st: &SessionState,
    a: &RmMemcpyPeerArgs,
) -> CuResult<(u64, u64, PeerCopy)> {
    st.check_range(a.dst, a.size)?;
    st.check_range(a.src, a.size)?;
    let (c, s) = (st.ctx(a.ctx)?, st.stream(a.stream)?);
    let copy = PeerCopy {
        dst: a.dst,
        dst_ctx: st.ctx(a.dst_ctx)?,
        src: a.src,
        src_ctx: st.ctx(a.src_ctx)?,
        size: a.size,
    };
    Ok((c, s, copy))
}

/// The bytes one side of a copy of `(width, rows, depth)` touches at `base`, placed at
/// `[x_bytes, y, z]` in rows of `pitch` bytes and slices of `height` rows: `(start, length)`.
/// Rows start at ((z + k) * height + y + r) * pitch + x, increasing in k and r: the copy
/// touches bytes between the first row's start and the last row's end only.
pub(super) fn side_span(
    base: u64,
    [x_bytes, y, z]: [u64; 3],
    (pitch, height): (u64, u64),
    (width, rows, depth): (u64, u64, u64),
) -> CuResult<(u64, u64)> {
    let row = |k: u64, r: u64| -> Option<u64> {
        z.checked_add(k)?
            .checked_mul(height)?
            .checked_add(y.checked_add(r)?)?
            .checked_mul(pitch)?
            .checked_add(x_bytes)
    };
    let first = row(0, 0).ok_or(CuError(cu::INVALID_VALUE))?;
    let end = row(depth - 1, rows - 1)
        .and_then(|l| l.checked_add(width))
        .ok_or(CuError(cu::INVALID_VALUE))?;
    let start = base.checked_add(first).ok_or(CuError(cu::INVALID_VALUE))?;
    Ok((start, end - first))
}

/// Checks one side of a 2-D or 3-D copy from the wire (see [`copy_target`]).
fn copy_side(
    st: &SessionState,
    s: &RmMemcpy3dSide,
    d: &RmMemcpy3dDesc,
    peer: bool,
    call_ctx: u64,
) -> CuResult<CopySide> {
    let (w, h, depth) = (d.width_bytes, d.height, d.depth);
    let ctx = match (peer, s.ctx) {
        (false, 0) => None,
        (false, _) => return Err(CuError(cu::INVALID_VALUE)),
        (true, 0) if s.kind == RmMemKind::RmMemHostPacked => Some(call_ctx),
        (true, c) => Some(st.ctx(c)?),
    };
    match s.kind {
        RmMemKind::RmMemHostPacked => {
            // The canonical packed layout, nothing else.
            if s.ptr != 0 || s.x_bytes != 0 || s.y != 0 || s.z != 0 || s.pitch != w || s.height != h
            {
                return Err(CuError(cu::INVALID_VALUE));
            }
            Ok(CopySide {
                place: CopyPlace::Host,
                pitch: w,
                height: h,
                x_bytes: 0,
                y: 0,
                z: 0,
                ctx,
            })
        }
        RmMemKind::RmMemDevice => {
            if s.pitch < w || (depth > 1 && s.height < h) {
                return Err(CuError(cu::INVALID_VALUE));
            }
            let (start, len) = side_span(
                s.ptr,
                [s.x_bytes, s.y, s.z],
                (s.pitch, s.height),
                (w, h, depth),
            )?;
            st.check_range(start, len)?;
            Ok(CopySide {
                place: CopyPlace::Device(s.ptr),
                pitch: s.pitch,
                height: s.height,
                x_bytes: s.x_bytes,
                y: s.y,
                z: s.z,
                ctx,
            })
        }
    }
}

/// Checks a 2-D or 3-D copy from the wire and maps it onto the backend: the calling context,
/// and the copy (`None` when the extent is empty: nothing to do). Every device range is checked
/// against the session's allocations; a packed host side is at most `RM_MAX_COPY` bytes and
/// the data carried must be exactly the packed source.
fn copy_target(
    st: &SessionState,
    a: &RmMemcpy3dArgs,
    peer: bool,
    is_async: bool,
) -> CuResult<(u64, Option<Copy3d>)> {
    let d = &a.desc;
    let ctx = st.ctx(d.ctx)?;
    let form = match d.form {
        RmCopyForm::RmCopy3D => CopyForm::ThreeD,
        RmCopyForm::RmCopy2D => CopyForm::TwoD,
        RmCopyForm::RmCopy2DUnaligned => CopyForm::TwoDUnaligned,
    };
    let two_d = form != CopyForm::ThreeD;
    if (two_d && (peer || d.depth != 1 || d.src.z != 0 || d.dst.z != 0))
        || (is_async && form == CopyForm::TwoDUnaligned)
    {
        return Err(CuError(cu::INVALID_VALUE));
    }
    let host_src = d.src.kind == RmMemKind::RmMemHostPacked;
    let host_dst = d.dst.kind == RmMemKind::RmMemHostPacked;
    if host_src && host_dst {
        return Err(CuError(cu::INVALID_VALUE));
    }
    let total = d
        .width_bytes
        .checked_mul(d.height)
        .and_then(|n| n.checked_mul(d.depth))
        .ok_or(CuError(cu::INVALID_VALUE))?;
    if (host_src || host_dst) && total > u64::from(RM_MAX_COPY) {
        return Err(CuError(cu::INVALID_VALUE));
    }
    let carried = if host_src { total } else { 0 };
    if a.data.len() as u64 != carried {
        return Err(CuError(cu::INVALID_VALUE));
    }
    if total == 0 {
        return Ok((ctx, None));
    }
    let copy = Copy3d {
        form,
        src: copy_side(st, &d.src, d, peer, ctx)?,
        dst: copy_side(st, &d.dst, d, peer, ctx)?,
        width: d.width_bytes,
        height: d.height,
        depth: d.depth,
    };
    Ok((ctx, Some(copy)))
}

pub(super) fn memset_target(st: &SessionState, a: &RmMemsetArgs) -> CuResult<(u64, u64)> {
    if !matches!(a.element_size, 1 | 2 | 4) {
        return Err(CuError(cu::INVALID_VALUE));
    }
    let len = a
        .count
        .checked_mul(u64::from(a.element_size))
        .ok_or(CuError(cu::INVALID_VALUE))?;
    st.check_range(a.dst, len)?;
    Ok((st.ctx(a.ctx)?, st.stream(a.stream)?))
}

/// `((raw context, raw stream), memset)` of a 2-D memset whose rows lie inside one range of
/// the session.
pub(super) fn memset_2d_target(
    st: &SessionState,
    a: &RmMemset2dArgs,
) -> CuResult<((u64, u64), Memset)> {
    let m = Memset {
        dst: a.dst,
        value: a.value,
        elem: a.element_size,
        width: a.width,
        height: a.height,
        pitch: a.pitch,
    };
    let (_, span) = m.extent().ok_or(CuError(cu::INVALID_VALUE))?;
    st.check_range(a.dst, span)?;
    Ok(((st.ctx(a.ctx)?, st.stream(a.stream)?), m))
}
