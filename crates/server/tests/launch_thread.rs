//! Kernel launches made on a session's launch thread (issue 12 §5, `launcher.rs`) against the
//! emulated backend, whose launches are made slow (`EmulatedConfig::launch_delay`) so that
//! they queue: every other call runs only after the launches made before it (copies in both
//! directions see them, a launch that fails reports its error at the next synchronize), and a
//! session closed with launches queued frees everything, over shared memory and a Unix socket.

mod common;

use std::time::{Duration, Instant};

use common::{dtoh_async, fill_i32, ints, launch_u64s};
use remora_client::{CuError, cu};
use remora_oncrpc::TransportChoice;
use remora_server::{EmulatedConfig, LaunchThread, LiveCounts, ShmConfig};

fn filled(v: i32) -> Vec<i32> {
    (v..v + 64).collect()
}

#[test]
fn calls_after_queued_launches_see_them_over_every_transport() {
    let _serial = common::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = common::serve_emulated(
        ShmConfig {
            enabled: true,
            data_bytes: 1 << 20,
            ..ShmConfig::default()
        },
        EmulatedConfig {
            launch_delay: Duration::from_micros(300),
            ..EmulatedConfig::default()
        },
    );
    let exec = server.executor();
    exec.set_launch_thread(LaunchThread::Always);
    for transport in [TransportChoice::Shm, TransportChoice::Unix] {
        let before = exec.launches_queued();
        let s = common::session(&server.endpoint, transport);
        // A blocking stream: ordered with the legacy stream.
        let kit = common::FillKit::new(&s, 0);
        let (ctx, stream, p) = (kit.ctx, kit.stream, kit.p);
        let f = kit.function("fill_i32");

        // A burst of launches, then a synchronous copy to the host: it sees the last one
        // (a copy that overtook the queue would see an earlier value, or zeros).
        for round in 0..4 {
            for v in 0..16 {
                fill_i32(&s, ctx, f, p, round * 100 + v, stream);
            }
            assert_eq!(ints(&s, ctx, p), filled(round * 100 + 15), "{transport:?}");
        }
        // A launch, then a copy to the device over its output: the copy comes last.
        fill_i32(&s, ctx, f, p, 7, stream);
        fill_i32(&s, ctx, f, p, 8, stream);
        s.memcpy_htod(ctx, common::LEGACY, p, &[0u8; 256]).unwrap();
        assert_eq!(ints(&s, ctx, p), vec![0; 64], "{transport:?}");
        // An asynchronous copy after launches, delivered at the synchronize.
        fill_i32(&s, ctx, f, p, 21, stream);
        let got = dtoh_async(&s, ctx, stream, p, 256);
        s.stream_synchronize(ctx, stream).unwrap();
        let host = got.lock().unwrap().clone();
        assert_eq!(i32::from_le_bytes(host[..4].try_into().unwrap()), 21);

        // A launch that fails in the driver (no such emulated kernel) behind good ones: the
        // next synchronize reports it, once.
        fill_i32(&s, ctx, f, p, 1, stream);
        launch_u64s(&s, ctx, kit.function("missing"), stream, &[0]);
        fill_i32(&s, ctx, f, p, 2, stream);
        assert_eq!(
            s.stream_synchronize(ctx, stream),
            Err(CuError(cu::NOT_SUPPORTED)),
            "{transport:?}"
        );
        s.stream_synchronize(ctx, stream).unwrap();
        assert_eq!(ints(&s, ctx, p), filled(2));
        // A launch the server refuses before the driver (parameters shorter than the
        // layout) reports its error after the queued launches' errors.
        launch_u64s(&s, ctx, kit.function("missing"), stream, &[0]);
        let short = remora_client::proto::RmLaunchArgs {
            ctx,
            function: f.handle,
            grid: remora_client::proto::RmDim3 { x: 1, y: 1, z: 1 },
            block: remora_client::proto::RmDim3 { x: 1, y: 1, z: 1 },
            shared_mem_bytes: 0,
            stream,
            params: vec![0u8; 4].into(),
            attrs: Vec::new(),
        };
        s.launch(&short).unwrap();
        assert_eq!(
            s.stream_synchronize(ctx, stream),
            Err(CuError(cu::NOT_SUPPORTED)),
            "the first error is the queued launch's ({transport:?})"
        );
        s.stream_synchronize(ctx, stream).unwrap();
        assert!(
            exec.launches_queued() >= before + 70,
            "the launches went through the launch thread ({} queued)",
            exec.launches_queued() - before
        );

        // Closed with launches queued: they are made, then everything is freed.
        for v in 0..40 {
            fill_i32(&s, ctx, f, p, v, stream);
        }
        drop(s);
        let deadline = Instant::now() + Duration::from_secs(20);
        while exec.session_count() != 0 {
            assert!(Instant::now() < deadline, "the session was never freed");
            std::thread::sleep(Duration::from_millis(5));
        }
        assert_eq!(
            server.backend.live(),
            LiveCounts::default(),
            "{transport:?}"
        );
    }
}

#[test]
fn bursts_of_fast_launches_stay_in_order_by_default() {
    let _serial = common::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = common::serve(1 << 20);
    for transport in [TransportChoice::Shm, TransportChoice::Unix] {
        let s = common::session(&server.endpoint, transport);
        let ctx = s.primary_ctx_retain(0).unwrap();
        let m = s
            .module_load(ctx, b"REMORA-EMU-MODULE\nfunc fill_i32 8,4,4\n")
            .unwrap();
        let f = &m.functions["fill_i32"];
        let p = s.mem_alloc(ctx, 256).unwrap();
        // Whether bursts reach the launch thread depends on the host's spare cores (auto):
        // the results may not.
        for round in 0..20 {
            for v in 0..200 {
                fill_i32(&s, ctx, f, p, round * 1000 + v, 0);
            }
            assert_eq!(
                ints(&s, ctx, p),
                filled(round * 1000 + 199),
                "{transport:?}"
            );
        }
    }
}
