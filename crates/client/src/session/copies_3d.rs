//! [`Session`] methods for 2-D and 3-D copies.

use super::*;
use crate::copy3d::Band;

impl Session {
    /// Checks a 2-D or 3-D copy locally, as CUDA does synchronously: the extent does not
    /// overflow, pitches are at least the width, host buffers hold the whole region, 2-D
    /// copies are flat. `Ok(false)` when there is nothing to copy.
    fn check_3d(p: &Copy3dParams, src: &CopySrc<'_>, dst: &CopyDst<'_>) -> CuResult<bool> {
        let e = &p.extent;
        e.bytes().ok_or(CuError(cu::INVALID_VALUE))?;
        let (sl, dl) = (src_layout(src), dst_layout(dst));
        if p.form != RmCopyForm::RmCopy3D && (e.depth > 1 || sl.z != 0 || dl.z != 0) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        if e.is_empty() {
            return Ok(false);
        }
        sl.span(e)?;
        let (_, dend) = dl.span(e)?;
        if let CopySrc::Host { base, layout } = src
            && layout.span(e)?.1 > base.len() as u64
        {
            return Err(CuError(cu::INVALID_VALUE));
        }
        if let CopyDst::Host { base, .. } = dst
            && dend > base.len() as u64
        {
            return Err(CuError(cu::INVALID_VALUE));
        }
        Ok(true)
    }

    /// The wire description of band `b` of a copy; also the packed source when it is host
    /// memory.
    fn band_args(
        p: &Copy3dParams,
        src: &CopySrc<'_>,
        dst: &CopyDst<'_>,
        b: &Band,
    ) -> CuResult<RmMemcpy3dArgs> {
        let (src_ctx, dst_ctx) = p.peer.unwrap_or((0, 0));
        let side = |ptr: Option<u64>, l: &Layout, ctx: RmHandle| match ptr {
            Some(ptr) => {
                let l = l.band(b);
                RmMemcpy3dSide {
                    kind: RmMemKind::RmMemDevice,
                    ptr,
                    pitch: l.pitch,
                    height: l.height,
                    x_bytes: l.x,
                    y: l.y,
                    z: l.z,
                    ctx,
                }
            }
            None => RmMemcpy3dSide {
                kind: RmMemKind::RmMemHostPacked,
                ptr: 0,
                pitch: b.extent.width,
                height: b.extent.height,
                x_bytes: 0,
                y: 0,
                z: 0,
                ctx,
            },
        };
        let (src_side, data) = match src {
            CopySrc::Device { ptr, layout } => (side(Some(*ptr), layout, src_ctx), Bytes::new()),
            CopySrc::Host { base, layout } => (
                side(None, layout, src_ctx),
                Bytes::from(copy3d::pack(base, &layout.band(b), &b.extent)?),
            ),
        };
        let dst_side = match dst {
            CopyDst::Device { ptr, layout } => side(Some(*ptr), layout, dst_ctx),
            CopyDst::Host { layout, .. } | CopyDst::Later { layout, .. } => {
                side(None, layout, dst_ctx)
            }
        };
        Ok(RmMemcpy3dArgs {
            desc: RmMemcpy3dDesc {
                form: p.form,
                ctx: p.ctx,
                stream: p.stream,
                src: src_side,
                dst: dst_side,
                width_bytes: b.extent.width,
                height: b.extent.height,
                depth: b.extent.depth,
            },
            data,
            copy_id: 0,
        })
    }

    /// A copy from host memory to host memory, done here.
    fn copy_3d_host(p: &Copy3dParams, src: &CopySrc<'_>, dst: CopyDst<'_>) -> CuResult<()> {
        let CopySrc::Host { base, layout } = src else {
            return Err(CuError(cu::INVALID_VALUE));
        };
        let packed = copy3d::pack(base, layout, &p.extent)?;
        match dst {
            CopyDst::Host { base, layout } => copy3d::unpack(&packed, base, &layout, &p.extent),
            CopyDst::Later { layout, sink } => {
                sink(&layout, &p.extent, &packed);
                Ok(())
            }
            CopyDst::Device { .. } => Err(CuError(cu::INVALID_VALUE)),
        }
    }

    /// `cuMemcpy2D(Unaligned)`, `cuMemcpy3D`, `cuMemcpy3DPeer` (synchronous). Host-to-host
    /// copies are done here; others travel in bands of at most 32 MiB, host sources packed,
    /// host destinations returned packed and scattered here. Like every synchronous copy to
    /// host memory, it also delivers the asynchronous copies pending on `p.stream`.
    pub fn memcpy_3d(
        &self,
        p: &Copy3dParams,
        src: CopySrc<'_>,
        mut dst: CopyDst<'_>,
    ) -> CuResult<()> {
        if !Self::check_3d(p, &src, &dst)? {
            return Ok(());
        }
        let host_src = matches!(src, CopySrc::Host { .. });
        let host_dst = !matches!(dst, CopyDst::Device { .. });
        if host_src && host_dst {
            return Self::copy_3d_host(p, &src, dst);
        }
        self.need_revision(3, "a 2-D or 3-D copy")?;
        let mark = self.copy_mark();
        for b in copy3d::bands(&p.extent, COPY_CHUNK as u64) {
            let args = Self::band_args(p, &src, &dst, &b)?;
            let r = if p.peer.is_some() {
                call!(self.rm_memcpy_3_d_peer(&args))?
            } else {
                call!(self.rm_memcpy_3_d(&args))?
            };
            self.finish_sync(RmSyncReply {
                status: r.status,
                copies: r.copies,
            })?;
            let want = b.extent.bytes().unwrap_or(0);
            match &mut dst {
                CopyDst::Device { .. } => {}
                _ if r.data.len() as u64 != want => {
                    tracing::error!(
                        "remora: a 2-D/3-D copy of {want} bytes returned {}",
                        r.data.len()
                    );
                    return Err(CuError(cu::UNKNOWN));
                }
                CopyDst::Host { base, layout } => {
                    copy3d::unpack(&r.data, base, &layout.band(&b), &b.extent)?;
                }
                CopyDst::Later { layout, sink } => sink(&layout.band(&b), &b.extent, &r.data),
            }
        }
        if host_dst {
            self.settle_stream(p.ctx, p.stream, mark)?;
        }
        Ok(())
    }

    /// `cuMemcpy2DAsync`, `cuMemcpy3DAsync`, `cuMemcpy3DPeerAsync`: one-way, in bands like
    /// [`Session::memcpy_3d`]. A host destination must be [`CopyDst::Later`]: its sink gets
    /// each band when a later synchronizing call's reply carries it. Host-to-host copies are
    /// done at once.
    pub fn memcpy_3d_async(
        &self,
        p: &Copy3dParams,
        src: CopySrc<'_>,
        dst: CopyDst<'_>,
    ) -> CuResult<()> {
        if p.form == RmCopyForm::RmCopy2DUnaligned || matches!(dst, CopyDst::Host { .. }) {
            return Err(CuError(cu::INVALID_VALUE));
        }
        if !Self::check_3d(p, &src, &dst)? {
            return Ok(());
        }
        if matches!(src, CopySrc::Host { .. }) && !matches!(dst, CopyDst::Device { .. }) {
            return Self::copy_3d_host(p, &src, dst);
        }
        self.need_revision(3, "a 2-D or 3-D copy")?;
        if matches!(src, CopySrc::Host { .. }) || matches!(dst, CopyDst::Later { .. }) {
            self.not_captured(
                p.stream,
                "an asynchronous 2-D or 3-D copy to or from host memory",
            )?;
        }
        for b in copy3d::bands(&p.extent, COPY_CHUNK as u64) {
            let mut args = Self::band_args(p, &src, &dst, &b)?;
            let send = |args: &RmMemcpy3dArgs| {
                if p.peer.is_some() {
                    call!(self.rm_memcpy_3_d_peer_async(args))
                } else {
                    call!(self.rm_memcpy_3_d_async(args))
                }
            };
            if let CopyDst::Later { layout, sink } = &dst {
                let (sink, layout, extent) = (Arc::clone(sink), layout.band(&b), b.extent);
                let sink: CopySink = Box::new(move |data: &[u8]| sink(&layout, &extent, data));
                let bytes = extent.width * extent.height * extent.depth;
                self.delivery
                    .issue((p.ctx, p.stream, bytes), sink, |copy_id| {
                        args.copy_id = copy_id;
                        send(&args)
                    })?;
            } else {
                send(&args)?;
            }
        }
        Ok(())
    }
}

fn src_layout(src: &CopySrc<'_>) -> Layout {
    match src {
        CopySrc::Device { layout, .. } | CopySrc::Host { layout, .. } => *layout,
    }
}

fn dst_layout(dst: &CopyDst<'_>) -> Layout {
    match dst {
        CopyDst::Device { layout, .. }
        | CopyDst::Host { layout, .. }
        | CopyDst::Later { layout, .. } => *layout,
    }
}
