//! 2-D, 3-D and peer copies end to end (client `Session` → executor → EMULATED test backend):
//! every direction with odd pitches and offsets, synchronous and asynchronous, copies split
//! into bands, peer copies between two contexts, and the arguments the client and the server
//! refuse. Every result is compared with a reference computed here, byte by byte, over whole
//! buffers (so bytes outside the region must stay untouched).

use std::sync::{Arc, Mutex};

use remora_client::copy3d::{Extent, Layout};
use remora_client::proto::*;
use remora_client::{BandSink, Copy3dParams, CopyDst, CopySrc, CuError, Session, cu};
use remora_oncrpc::Endpoint;
use remora_server::{
    Backend, EmulatedBackend, EmulatedConfig, Running, ServeConfig, inventory_of,
    start_with_backend,
};
use remora_xdr::Bytes;

const LEGACY: u64 = RM_STREAM_LEGACY as u64;

struct Fixture {
    _dir: tempfile::TempDir,
    running: Option<Running>,
    session: Session,
    ctx: u64,
    /// Every emulated backend hands out the same addresses, which the client reserves in this
    /// process: one fixture at a time.
    _serial: std::sync::MutexGuard<'static, ()>,
}

static SERIAL: Mutex<()> = Mutex::new(());

impl Drop for Fixture {
    fn drop(&mut self) {
        if let Some(r) = self.running.take() {
            r.shutdown();
        }
    }
}

fn serve() -> Fixture {
    let serial = SERIAL
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let dir = tempfile::tempdir().unwrap();
    let backend = Arc::new(EmulatedBackend::new(EmulatedConfig::default()));
    let endpoint = Endpoint::Unix(dir.path().join("remora.sock"));
    let running = start_with_backend(
        ServeConfig {
            listen: vec![endpoint.clone()],
            ..ServeConfig::default()
        },
        Arc::clone(&backend) as Arc<dyn Backend>,
        inventory_of(&*backend),
    )
    .unwrap();
    let session = Session::connect(&endpoint).unwrap();
    let ctx = session.primary_ctx_retain(0).unwrap();
    Fixture {
        _dir: dir,
        running: Some(running),
        session,
        ctx,
        _serial: serial,
    }
}

/// A deterministic byte pattern, different per `seed`.
fn pattern(n: usize, seed: u32) -> Vec<u8> {
    (0..n as u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) ^ seed.wrapping_mul(97)) as u8 ^ (i >> 7) as u8)
        .collect()
}

/// The reference: what a copy of `e` from `src`/`sl` to `dst`/`dl` does, byte by byte.
fn reference(src: &[u8], sl: &Layout, dst: &mut [u8], dl: &Layout, e: &Extent) {
    for k in 0..e.depth {
        for r in 0..e.height {
            for c in 0..e.width {
                let s = ((sl.z + k) * sl.height + sl.y + r) * sl.pitch + sl.x + c;
                let d = ((dl.z + k) * dl.height + dl.y + r) * dl.pitch + dl.x + c;
                dst[d as usize] = src[s as usize];
            }
        }
    }
}

fn layout(x: u64, y: u64, z: u64, pitch: u64, height: u64) -> Layout {
    Layout {
        x,
        y,
        z,
        pitch,
        height,
    }
}

fn params(f: &Fixture, form: RmCopyForm, stream: u64, e: Extent) -> Copy3dParams {
    Copy3dParams {
        form,
        ctx: f.ctx,
        stream,
        extent: e,
        peer: None,
    }
}

impl Fixture {
    /// A device buffer of `n` bytes holding `pattern(n, seed)`.
    fn device(&self, n: usize, seed: u32) -> (u64, Vec<u8>) {
        let p = self.session.mem_alloc(self.ctx, n as u64).unwrap();
        let data = pattern(n, seed);
        self.session
            .memcpy_htod(self.ctx, LEGACY, p, &data)
            .unwrap();
        (p, data)
    }

    fn read(&self, p: u64, n: usize) -> Vec<u8> {
        let mut out = vec![0u8; n];
        self.session
            .memcpy_dtoh(self.ctx, LEGACY, p, &mut out)
            .unwrap();
        out
    }
}

/// A sink that writes the bands of an asynchronous copy into a shared buffer.
fn band_sink(buf: &Arc<Mutex<Vec<u8>>>) -> BandSink {
    let buf = Arc::clone(buf);
    Arc::new(move |l: &Layout, e: &Extent, data: &[u8]| {
        remora_client::copy3d::unpack(data, &mut buf.lock().unwrap(), l, e).unwrap();
    })
}

/// The cases: (form, extent, source layout, destination layout), with odd pitches, every
/// offset non-zero where the form allows, and 3-D slices taller than the copy.
fn cases() -> Vec<(RmCopyForm, Extent, Layout, Layout)> {
    let e2 = Extent {
        width: 13,
        height: 7,
        depth: 1,
    };
    let e3 = Extent {
        width: 11,
        height: 5,
        depth: 3,
    };
    vec![
        (
            RmCopyForm::RmCopy2D,
            e2,
            layout(3, 2, 0, 29, 0),
            layout(5, 1, 0, 21, 0),
        ),
        (
            RmCopyForm::RmCopy2DUnaligned,
            e2,
            layout(0, 4, 0, 13, 0),
            layout(7, 0, 0, 23, 0),
        ),
        (
            RmCopyForm::RmCopy3D,
            e3,
            layout(2, 1, 1, 17, 7),
            layout(4, 3, 2, 19, 9),
        ),
        (
            RmCopyForm::RmCopy3D,
            e3,
            layout(0, 0, 0, 11, 5),
            layout(1, 2, 1, 15, 8),
        ),
    ]
}

/// Bytes a buffer needs for a layout and extent.
fn span(l: &Layout, e: &Extent) -> usize {
    l.span(e).unwrap().1 as usize + 5
}

#[test]
fn synchronous_copies_in_every_direction_match_the_reference() {
    let f = serve();
    for (i, (form, e, sl, dl)) in cases().into_iter().enumerate() {
        let (sn, dn) = (span(&sl, &e), span(&dl, &e));
        let p = params(&f, form, LEGACY, e);
        let host_src = pattern(sn, 100 + i as u32);

        // Host to device.
        let (dev, mut want) = f.device(dn, 1);
        f.session
            .memcpy_3d(
                &p,
                CopySrc::Host {
                    base: &host_src,
                    layout: sl,
                },
                CopyDst::Device {
                    ptr: dev,
                    layout: dl,
                },
            )
            .unwrap();
        reference(&host_src, &sl, &mut want, &dl, &e);
        assert_eq!(f.read(dev, dn), want, "case {i}: host to device");

        // Device to host.
        let (src_dev, src_data) = f.device(sn, 2);
        let mut out = pattern(dn, 3);
        let mut want = out.clone();
        f.session
            .memcpy_3d(
                &p,
                CopySrc::Device {
                    ptr: src_dev,
                    layout: sl,
                },
                CopyDst::Host {
                    base: &mut out,
                    layout: dl,
                },
            )
            .unwrap();
        reference(&src_data, &sl, &mut want, &dl, &e);
        assert_eq!(out, want, "case {i}: device to host");

        // Device to device.
        let (dst_dev, mut want) = f.device(dn, 4);
        f.session
            .memcpy_3d(
                &p,
                CopySrc::Device {
                    ptr: src_dev,
                    layout: sl,
                },
                CopyDst::Device {
                    ptr: dst_dev,
                    layout: dl,
                },
            )
            .unwrap();
        reference(&src_data, &sl, &mut want, &dl, &e);
        assert_eq!(f.read(dst_dev, dn), want, "case {i}: device to device");

        // Host to host, on the client.
        let mut out = pattern(dn, 5);
        let mut want = out.clone();
        f.session
            .memcpy_3d(
                &p,
                CopySrc::Host {
                    base: &host_src,
                    layout: sl,
                },
                CopyDst::Host {
                    base: &mut out,
                    layout: dl,
                },
            )
            .unwrap();
        reference(&host_src, &sl, &mut want, &dl, &e);
        assert_eq!(out, want, "case {i}: host to host");

        for p in [dev, src_dev, dst_dev] {
            f.session.mem_free(f.ctx, p).unwrap();
        }
    }
}

#[test]
fn pitched_allocations_work_like_cuda() {
    let f = serve();
    let (width, height) = (100u64, 9u64);
    let (dev, pitch) = f.session.mem_alloc_pitch(f.ctx, width, height, 4).unwrap();
    assert!(pitch >= width);
    let e = Extent {
        width,
        height,
        depth: 1,
    };
    let src = pattern((width * height) as usize, 9);
    let p = params(&f, RmCopyForm::RmCopy2D, LEGACY, e);
    let packed = layout(0, 0, 0, width, 0);
    let pitched = layout(0, 0, 0, pitch, 0);
    f.session
        .memcpy_3d(
            &p,
            CopySrc::Host {
                base: &src,
                layout: packed,
            },
            CopyDst::Device {
                ptr: dev,
                layout: pitched,
            },
        )
        .unwrap();
    let mut back = vec![0u8; src.len()];
    f.session
        .memcpy_3d(
            &p,
            CopySrc::Device {
                ptr: dev,
                layout: pitched,
            },
            CopyDst::Host {
                base: &mut back,
                layout: packed,
            },
        )
        .unwrap();
    assert_eq!(back, src);
}

#[test]
fn asynchronous_copies_land_by_the_stream_synchronize() {
    let f = serve();
    let stream = f.session.stream_create(f.ctx, 1, 0).unwrap();
    for (i, (form, e, sl, dl)) in cases().into_iter().enumerate() {
        if form == RmCopyForm::RmCopy2DUnaligned {
            continue; // no asynchronous form
        }
        let (sn, dn) = (span(&sl, &e), span(&dl, &e));
        let p = params(&f, form, stream, e);
        let host_src = pattern(sn, 200 + i as u32);

        let (dev, mut want_htod) = f.device(dn, 11);
        f.session
            .memcpy_3d_async(
                &p,
                CopySrc::Host {
                    base: &host_src,
                    layout: sl,
                },
                CopyDst::Device {
                    ptr: dev,
                    layout: dl,
                },
            )
            .unwrap();
        let (src_dev, src_data) = f.device(sn, 12);
        let out = Arc::new(Mutex::new(pattern(dn, 13)));
        let mut want_dtoh = out.lock().unwrap().clone();
        f.session
            .memcpy_3d_async(
                &p,
                CopySrc::Device {
                    ptr: src_dev,
                    layout: sl,
                },
                CopyDst::Later {
                    layout: dl,
                    sink: band_sink(&out),
                },
            )
            .unwrap();
        let (dst_dev, mut want_dtod) = f.device(dn, 14);
        f.session
            .memcpy_3d_async(
                &p,
                CopySrc::Device {
                    ptr: src_dev,
                    layout: sl,
                },
                CopyDst::Device {
                    ptr: dst_dev,
                    layout: dl,
                },
            )
            .unwrap();
        f.session.stream_synchronize(f.ctx, stream).unwrap();
        assert_eq!(f.session.pending_copies(), 0);

        reference(&host_src, &sl, &mut want_htod, &dl, &e);
        assert_eq!(f.read(dev, dn), want_htod, "case {i}: async host to device");
        reference(&src_data, &sl, &mut want_dtoh, &dl, &e);
        assert_eq!(
            *out.lock().unwrap(),
            want_dtoh,
            "case {i}: async device to host"
        );
        reference(&src_data, &sl, &mut want_dtod, &dl, &e);
        assert_eq!(
            f.read(dst_dev, dn),
            want_dtod,
            "case {i}: async device to device"
        );
    }
    f.session.stream_destroy(stream).unwrap();
}

#[test]
fn large_copies_travel_in_bands() {
    let f = serve();
    // 33 MiB and a bit in 4099-byte rows: more than one 32 MiB band, in both directions.
    let e = Extent {
        width: 4099,
        height: 8500,
        depth: 1,
    };
    let dl = layout(7, 3, 0, 4160, 0);
    let dn = span(&dl, &e);
    let src = pattern((e.width * e.height) as usize, 21);
    let sl = Layout::packed(&e);
    let dev = f.session.mem_alloc(f.ctx, dn as u64).unwrap();
    let p = params(&f, RmCopyForm::RmCopy2D, LEGACY, e);
    f.session
        .memcpy_3d(
            &p,
            CopySrc::Host {
                base: &src,
                layout: sl,
            },
            CopyDst::Device {
                ptr: dev,
                layout: dl,
            },
        )
        .unwrap();
    let stream = f.session.stream_create(f.ctx, 1, 0).unwrap();
    let out = Arc::new(Mutex::new(vec![0u8; src.len()]));
    f.session
        .memcpy_3d_async(
            &params(&f, RmCopyForm::RmCopy2D, stream, e),
            CopySrc::Device {
                ptr: dev,
                layout: dl,
            },
            CopyDst::Later {
                layout: sl,
                sink: band_sink(&out),
            },
        )
        .unwrap();
    f.session.stream_synchronize(f.ctx, stream).unwrap();
    assert!(*out.lock().unwrap() == src, "the round trip differs");
}

#[test]
fn peer_copies_between_two_contexts() {
    let f = serve();
    let a = f.session.ctx_create(0, 0).unwrap();
    let b = f.session.ctx_create(0, 0).unwrap();
    let n = 4096usize;
    let pa = f.session.mem_alloc(a, n as u64).unwrap();
    let pb = f.session.mem_alloc(b, n as u64).unwrap();
    let data = pattern(n, 31);
    f.session.memcpy_htod(a, LEGACY, pa, &data).unwrap();

    f.session
        .memcpy_peer(a, (pb + 16, b), (pa + 8, a), 1000)
        .unwrap();
    let mut out = vec![0u8; n];
    f.session.memcpy_dtoh(b, LEGACY, pb, &mut out).unwrap();
    assert_eq!(&out[16..1016], &data[8..1008]);
    assert!(out[..16].iter().all(|&x| x == 0) && out[1016..].iter().all(|&x| x == 0));

    let stream = f.session.stream_create(b, 1, 0).unwrap();
    f.session
        .memcpy_peer_async(b, stream, (pa, a), (pb + 16, b), 1000)
        .unwrap();
    f.session.stream_synchronize(b, stream).unwrap();
    let mut back = vec![0u8; n];
    f.session.memcpy_dtoh(a, LEGACY, pa, &mut back).unwrap();
    assert_eq!(&back[..1000], &data[8..1008]);

    // 3-D peer copies, synchronous and asynchronous, device to device and to host.
    let e = Extent {
        width: 10,
        height: 4,
        depth: 3,
    };
    let sl = layout(1, 2, 0, 20, 7);
    let dl = layout(3, 0, 1, 16, 5);
    let p = Copy3dParams {
        form: RmCopyForm::RmCopy3D,
        ctx: a,
        stream: LEGACY,
        extent: e,
        peer: Some((a, b)),
    };
    let before = {
        let mut v = vec![0u8; n];
        f.session.memcpy_dtoh(b, LEGACY, pb, &mut v).unwrap();
        v
    };
    f.session
        .memcpy_3d(
            &p,
            CopySrc::Device {
                ptr: pa,
                layout: sl,
            },
            CopyDst::Device {
                ptr: pb,
                layout: dl,
            },
        )
        .unwrap();
    let mut want = before.clone();
    reference(&back, &sl, &mut want, &dl, &e);
    let mut got = vec![0u8; n];
    f.session.memcpy_dtoh(b, LEGACY, pb, &mut got).unwrap();
    assert_eq!(got, want, "3-D peer device to device");

    let out = Arc::new(Mutex::new(vec![0u8; 300]));
    let hl = layout(0, 0, 0, 10, 4);
    let mut pa_async = p;
    pa_async.stream = stream;
    pa_async.ctx = b;
    f.session
        .memcpy_3d_async(
            &pa_async,
            CopySrc::Device {
                ptr: pb,
                layout: dl,
            },
            CopyDst::Later {
                layout: hl,
                sink: band_sink(&out),
            },
        )
        .unwrap();
    f.session.stream_synchronize(b, stream).unwrap();
    let mut want = vec![0u8; 300];
    reference(&got, &dl, &mut want, &hl, &e);
    assert_eq!(*out.lock().unwrap(), want, "3-D peer async device to host");

    // A context the session does not have.
    assert_eq!(
        f.session.memcpy_peer(a, (pb, 0xdead_0000), (pa, a), 10),
        Err(CuError(400))
    );
    f.session.stream_destroy(stream).unwrap();
    f.session.ctx_destroy(a).unwrap();
    f.session.ctx_destroy(b).unwrap();
}

#[test]
fn invalid_arguments_are_invalid_value() {
    let f = serve();
    let (dev, _) = f.device(1024, 41);
    let e = Extent {
        width: 16,
        height: 4,
        depth: 2,
    };
    let p = params(&f, RmCopyForm::RmCopy3D, LEGACY, e);
    let host = vec![0u8; 4096];
    let invalid = Err(CuError(cu::INVALID_VALUE));
    let d2d = |sl: Layout, dl: Layout| {
        f.session.memcpy_3d(
            &p,
            CopySrc::Device {
                ptr: dev,
                layout: sl,
            },
            CopyDst::Device {
                ptr: dev,
                layout: dl,
            },
        )
    };
    let ok = layout(0, 0, 0, 16, 4);
    assert_eq!(d2d(layout(0, 0, 0, 15, 4), ok), invalid, "pitch < width");
    assert_eq!(d2d(ok, layout(0, 0, 0, 16, 3)), invalid, "height < rows");
    // Past the end of the 1024-byte allocation (checked by the server).
    assert_eq!(d2d(ok, layout(0, 0, 15, 16, 4)), invalid, "out of range");
    assert_eq!(
        d2d(ok, layout(0, 0, 14, 16, 4)),
        Ok(()),
        "up to the last byte"
    );
    assert_eq!(d2d(layout(1, 0, 0, 16, 4), ok), Ok(()), "in range");
    // A host buffer shorter than the region.
    assert_eq!(
        f.session.memcpy_3d(
            &p,
            CopySrc::Host {
                base: &host[..100],
                layout: ok,
            },
            CopyDst::Device {
                ptr: dev,
                layout: ok,
            },
        ),
        invalid
    );
    // 2-D copies are flat.
    let flat = params(&f, RmCopyForm::RmCopy2D, LEGACY, e);
    assert_eq!(
        f.session.memcpy_3d(
            &flat,
            CopySrc::Device {
                ptr: dev,
                layout: ok,
            },
            CopyDst::Device {
                ptr: dev,
                layout: ok,
            },
        ),
        invalid
    );
    // An empty extent copies nothing, successfully.
    let empty = params(
        &f,
        RmCopyForm::RmCopy3D,
        LEGACY,
        Extent {
            width: 0,
            height: 4,
            depth: 2,
        },
    );
    assert_eq!(
        f.session.memcpy_3d(
            &empty,
            CopySrc::Device { ptr: 0, layout: ok },
            CopyDst::Device { ptr: 0, layout: ok },
        ),
        Ok(())
    );
    // Asynchronous: the range error surfaces at the synchronize, and an undelivered copy to
    // host memory does not make later synchronizing calls wait for it.
    let stream = f.session.stream_create(f.ctx, 1, 0).unwrap();
    let pa = params(&f, RmCopyForm::RmCopy3D, stream, e);
    let out = Arc::new(Mutex::new(vec![0u8; 4096]));
    f.session
        .memcpy_3d_async(
            &pa,
            CopySrc::Device {
                ptr: dev,
                layout: layout(0, 0, 20, 16, 4),
            },
            CopyDst::Later {
                layout: ok,
                sink: band_sink(&out),
            },
        )
        .unwrap();
    assert_eq!(f.session.stream_synchronize(f.ctx, stream), invalid);
    assert_eq!(f.session.pending_copies(), 0);
    assert_eq!(f.session.stream_synchronize(f.ctx, stream), Ok(()));
    f.session.stream_destroy(stream).unwrap();
}

/// What the server refuses when a client bypasses the `Session` checks.
#[test]
fn the_server_checks_every_field_from_the_wire() {
    let f = serve();
    let (dev, _) = f.device(1024, 51);
    let side = |kind, ptr, pitch, height, x, y, z| RmMemcpy3dSide {
        kind,
        ptr,
        pitch,
        height,
        x_bytes: x,
        y,
        z,
        ctx: 0,
    };
    let device = |pitch, height, y| side(RmMemKind::RmMemDevice, dev, pitch, height, 0, y, 0);
    let packed = || side(RmMemKind::RmMemHostPacked, 0, 8, 4, 0, 0, 0);
    let args = |src, dst, data: Vec<u8>, (w, h, d)| RmMemcpy3dArgs {
        desc: RmMemcpy3dDesc {
            form: RmCopyForm::RmCopy3D,
            ctx: f.ctx,
            stream: LEGACY,
            src,
            dst,
            width_bytes: w,
            height: h,
            depth: d,
        },
        data: Bytes::from(data),
        copy_id: 0,
    };
    let status = |a: &RmMemcpy3dArgs| f.session.rpc().rm_memcpy_3_d(a).unwrap().status;
    let good = args(device(8, 4, 0), packed(), vec![], (8, 4, 1));
    assert_eq!(status(&good), 0);
    let cases = [
        (
            "pitch < width",
            args(device(7, 4, 0), packed(), vec![], (8, 4, 1)),
        ),
        (
            "height < rows with depth > 1",
            args(
                device(8, 3, 0),
                side(RmMemKind::RmMemHostPacked, 0, 8, 4, 0, 0, 0),
                vec![],
                (8, 4, 2),
            ),
        ),
        (
            "out of range",
            args(device(8, 4, 126), packed(), vec![], (8, 4, 1)),
        ),
        (
            "extent overflows",
            args(device(8, 4, 0), packed(), vec![], (u64::MAX, 4, 1)),
        ),
        (
            "offset overflows",
            args(device(8, 4, u64::MAX / 4), packed(), vec![], (8, 4, 1)),
        ),
        (
            "host side bigger than RM_MAX_COPY",
            args(
                device(1 << 20, 1 << 12, 0),
                side(RmMemKind::RmMemHostPacked, 0, 1 << 20, 1 << 12, 0, 0, 0),
                vec![],
                (1 << 20, 1 << 12, 1),
            ),
        ),
        (
            "packed() side not canonical",
            args(
                device(8, 4, 0),
                side(RmMemKind::RmMemHostPacked, 0, 9, 4, 0, 0, 0),
                vec![],
                (8, 4, 1),
            ),
        ),
        (
            "data that is not the packed() source",
            args(packed(), device(8, 4, 0), vec![0; 31], (8, 4, 1)),
        ),
        (
            "data with a device source",
            args(device(8, 4, 0), packed(), vec![0; 32], (8, 4, 1)),
        ),
        (
            "host to host",
            args(packed(), packed(), vec![0; 32], (8, 4, 1)),
        ),
        (
            "a context on a non-peer side",
            args(
                RmMemcpy3dSide {
                    ctx: f.ctx,
                    ..device(8, 4, 0)
                },
                packed(),
                vec![],
                (8, 4, 1),
            ),
        ),
    ];
    for (what, a) in cases {
        assert_eq!(status(&a), cu::INVALID_VALUE, "{what}");
    }
    let mut flat = good.clone();
    flat.desc.form = RmCopyForm::RmCopy2D;
    flat.desc.depth = 2;
    assert_eq!(status(&flat), cu::INVALID_VALUE, "2-D with depth 2");
    let mut bad_ctx = good.clone();
    bad_ctx.desc.ctx = 0xdead;
    assert_eq!(status(&bad_ctx), 400, "unknown context");
    // The unaligned form has no asynchronous variant: deferred to the next synchronize.
    let mut unaligned = good;
    unaligned.desc.form = RmCopyForm::RmCopy2DUnaligned;
    unaligned.desc.dst = device(8, 4, 8);
    f.session.rpc().rm_memcpy_3_d_async(&unaligned).unwrap();
    assert_eq!(
        f.session.ctx_synchronize(f.ctx),
        Err(CuError(cu::INVALID_VALUE))
    );
}
