//! When the bytes of an asynchronous device-to-host copy into ordinary host memory become
//! visible: no later than the moment CUDA guarantees that the copy completed (see
//! `remora_client`'s delivery module). The EMULATED backend here completes every such copy
//! late on purpose (`EmulatedConfig::copy_latency`), while streams and events say "done" at
//! once, so a client that relies on a reply happening to carry a copy reads stale bytes.
//! Every check reads every byte, over unix, shared memory (copies of 64 KiB and more go
//! through area leases) and tcp, for copies inside one record, through the area, and split
//! in chunks (over 32 MiB).
//! Client `Session` → executor → EMULATED backend.

mod common;

use std::sync::{Arc, Mutex};
use std::time::Duration;

use common::*;
use remora_client::Session;
use remora_oncrpc::TransportChoice;
use remora_server::{EmulatedConfig, ShmConfig};

/// How late every asynchronous device-to-host copy completes.
const LATENCY: Duration = Duration::from_millis(40);
/// Sizes: inside one record, through an area lease, in chunks.
const SIZES: [usize; 3] = [4 << 10, 1 << 20, 33 << 20];
/// The first two, for the checks that run many rounds.
const SMALL: [usize; 2] = [SIZES[0], SIZES[1]];
const NON_BLOCKING: u32 = 1;

fn server() -> Server {
    server_with(true)
}

/// [`server`], its data area's copies landing there by themselves (`area_dma`, as the CUDA
/// backend's DMA) or staged and written when delivered.
fn server_with(area_dma: bool) -> Server {
    serve_emulated(
        ShmConfig {
            enabled: true,
            data_bytes: 128 << 20,
            ..ShmConfig::default()
        },
        EmulatedConfig {
            copy_latency: LATENCY,
            memory_per_device: 4 << 30,
            // As the real driver may: a server that queries a copy on a host callback's way
            // (instead of having the host function publish it) deadlocks here.
            driver_busy_during_host_functions: true,
            area_dma,
            ..EmulatedConfig::default()
        },
    )
}

/// Sessions over every transport.
fn sessions(server: &Server) -> Vec<(&'static str, Session)> {
    vec![
        ("unix", session(&server.endpoint, TransportChoice::Unix)),
        ("shm", session(&server.endpoint, TransportChoice::Shm)),
        ("tcp", session(&server.tcp(), TransportChoice::Tcp)),
    ]
}

type Out = Arc<Mutex<Vec<u8>>>;

/// A device buffer of `n` bytes holding `pattern(n, seed)`.
fn filled(s: &Session, ctx: u64, n: usize, seed: u32) -> u64 {
    let dev = s.mem_alloc(ctx, n as u64).unwrap();
    s.memcpy_htod(ctx, LEGACY, dev, &pattern(n, seed)).unwrap();
    dev
}

/// Issues an async copy of `n` bytes from `dev` on `stream` into a fresh host buffer holding
/// a sentinel until the bytes arrive.
fn copy_async(s: &Session, ctx: u64, stream: u64, dev: u64, n: usize) -> Out {
    let out: Out = Arc::new(Mutex::new(vec![0xAB; n]));
    let sink = Arc::clone(&out);
    s.memcpy_dtoh_async(
        ctx,
        stream,
        dev,
        n as u64,
        Box::new(move |b: &[u8]| sink.lock().unwrap()[..b.len()].copy_from_slice(b)),
    )
    .unwrap();
    out
}

#[track_caller]
fn check(what: &str, out: &Out, n: usize, seed: u32) {
    let got = out.lock().unwrap();
    let want = pattern(n, seed);
    let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
    assert_eq!(bad, 0, "{what}: {bad} of {n} bytes stale");
}

#[test]
fn an_event_on_the_legacy_stream_covers_copies_on_blocking_streams() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = server();
    for (t, s) in sessions(&server) {
        let ctx = s.primary_ctx_retain(0).unwrap();
        let streams: Vec<u64> = (0..3)
            .map(|_| s.stream_create(ctx, 0, 0).unwrap())
            .collect();
        let ev = s.event_create(ctx, 0).unwrap();
        for (k, &n) in SIZES.iter().enumerate() {
            let mut outs = Vec::new();
            for (i, &st) in streams.iter().enumerate() {
                let seed = (k * 10 + i) as u32;
                let dev = filled(&s, ctx, n, seed);
                outs.push((copy_async(&s, ctx, st, dev, n), seed, dev));
            }
            s.event_record(ctx, ev, LEGACY).unwrap();
            s.event_synchronize(ev).unwrap();
            for (i, (out, seed, dev)) in outs.into_iter().enumerate() {
                check(&format!("{t}, {n} bytes, stream {i}"), &out, n, seed);
                s.mem_free(ctx, dev).unwrap();
            }
        }
        assert_eq!(s.pending_copies(), 0, "{t}");
        // The same through a synchronize of the legacy stream.
        let dev = filled(&s, ctx, 4096, 77);
        let out = copy_async(&s, ctx, streams[1], dev, 4096);
        s.stream_synchronize(ctx, LEGACY).unwrap();
        check(&format!("{t}: legacy stream synchronize"), &out, 4096, 77);
        s.mem_free(ctx, dev).unwrap();
        s.event_destroy(ev).unwrap();
        for st in streams {
            s.stream_destroy(st).unwrap();
        }
    }
}

#[test]
fn copies_into_program_memory_arrive_whole_at_synchronize() {
    // The shim's path (`memcpy_dtoh_async_into`: the bytes go straight to the program's
    // memory, from the reply or from the area lease), with the area's copies landing there
    // by themselves when they complete, and staged.
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    for area_dma in [true, false] {
        let server = server_with(area_dma);
        for (t, s) in sessions(&server) {
            let ctx = s.primary_ctx_retain(0).unwrap();
            let st = s.stream_create(ctx, 0, 0).unwrap();
            for (k, &n) in SIZES.iter().enumerate() {
                let seed = 500 + k as u32;
                let dev = filled(&s, ctx, n, seed);
                let mut out = vec![0xABu8; n];
                // SAFETY: `out` lives past the synchronize that delivers the copy, and
                // nothing touches it before.
                unsafe { s.memcpy_dtoh_async_into(ctx, st, dev, out.as_mut_ptr(), n as u64) }
                    .unwrap();
                s.stream_synchronize(ctx, st).unwrap();
                let want = pattern(n, seed);
                let bad = out.iter().zip(&want).filter(|(a, b)| a != b).count();
                assert_eq!(bad, 0, "{t}, area_dma {area_dma}, {n} bytes: {bad} stale");
                s.mem_free(ctx, dev).unwrap();
            }
            assert_eq!(s.pending_copies(), 0, "{t}, area_dma {area_dma}");
            s.stream_destroy(st).unwrap();
        }
    }
}

#[test]
fn non_blocking_streams_are_not_covered_by_the_legacy_stream() {
    // The other half of the rule, which also shows the late completion is in effect: a copy
    // on a non-blocking stream is not waited for by the legacy stream's event.
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = server();
    for (t, s) in sessions(&server) {
        let ctx = s.primary_ctx_retain(0).unwrap();
        let st = s.stream_create(ctx, NON_BLOCKING, 0).unwrap();
        let ev = s.event_create(ctx, 0).unwrap();
        let dev = filled(&s, ctx, 4096, 5);
        let out = copy_async(&s, ctx, st, dev, 4096);
        s.event_record(ctx, ev, LEGACY).unwrap();
        s.event_synchronize(ev).unwrap();
        assert_eq!(s.pending_copies(), 1, "{t}: the copy completes late");
        s.stream_synchronize(ctx, st).unwrap();
        check(&format!("{t}: its own stream"), &out, 4096, 5);
        s.mem_free(ctx, dev).unwrap();
        s.event_destroy(ev).unwrap();
        s.stream_destroy(st).unwrap();
    }
}

#[test]
fn wait_event_chains_queries_and_context_synchronize_deliver() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = server();
    for (t, s) in sessions(&server) {
        let ctx = s.primary_ctx_retain(0).unwrap();
        let a = s.stream_create(ctx, NON_BLOCKING, 0).unwrap();
        let b = s.stream_create(ctx, NON_BLOCKING, 0).unwrap();
        let e = s.event_create(ctx, 0).unwrap();
        let f = s.event_create(ctx, 0).unwrap();
        for &n in &SMALL {
            // A → event E → B waits E → event F on B: F's synchronize covers A's copy.
            let dev = filled(&s, ctx, n, 1);
            let out = copy_async(&s, ctx, a, dev, n);
            s.event_record(ctx, e, a).unwrap();
            s.stream_wait_event(ctx, b, e, 0).unwrap();
            s.event_record(ctx, f, b).unwrap();
            s.event_synchronize(f).unwrap();
            check(&format!("{t}, {n}: wait-event chain"), &out, n, 1);
            // A stream synchronize of B covers it too.
            let out = copy_async(&s, ctx, a, dev, n);
            s.event_record(ctx, e, a).unwrap();
            s.stream_wait_event(ctx, b, e, 0).unwrap();
            s.stream_synchronize(ctx, b).unwrap();
            check(
                &format!("{t}, {n}: synchronize of the waiting stream"),
                &out,
                n,
                1,
            );
            // Polling: an event query and a stream query that answer done.
            let out = copy_async(&s, ctx, a, dev, n);
            s.event_record(ctx, e, a).unwrap();
            while !s.event_query(e).unwrap() {}
            check(&format!("{t}, {n}: event query"), &out, n, 1);
            let out = copy_async(&s, ctx, a, dev, n);
            while !s.stream_query(ctx, a).unwrap() {}
            check(&format!("{t}, {n}: stream query"), &out, n, 1);
            // A context synchronize.
            let out = copy_async(&s, ctx, b, dev, n);
            s.ctx_synchronize(ctx).unwrap();
            check(&format!("{t}, {n}: context synchronize"), &out, n, 1);
            s.mem_free(ctx, dev).unwrap();
        }
        assert_eq!(s.pending_copies(), 0, "{t}");
        for ev in [e, f] {
            s.event_destroy(ev).unwrap();
        }
        for st in [a, b] {
            s.stream_destroy(st).unwrap();
        }
    }
}

#[test]
fn a_host_callback_sees_the_copies_before_it_from_several_threads() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = server();
    for (t, s) in sessions(&server) {
        let ctx = s.primary_ctx_retain(0).unwrap();
        std::thread::scope(|scope| {
            for th in 0..3u32 {
                let s = &s;
                scope.spawn(move || {
                    let st = s.stream_create(ctx, 0, 0).unwrap();
                    for round in 0..3u32 {
                        let n = SIZES[(round % 2) as usize];
                        let seed = th * 100 + round;
                        let dev = filled(s, ctx, n, seed);
                        let out = copy_async(s, ctx, st, dev, n);
                        let seen = Arc::new(Mutex::new(None));
                        let (o, sn) = (Arc::clone(&out), Arc::clone(&seen));
                        s.launch_host_func(
                            ctx,
                            st,
                            Box::new(move |_| {
                                let want = pattern(n, seed);
                                let got = o.lock().unwrap();
                                let bad = got.iter().zip(&want).filter(|(a, b)| a != b).count();
                                *sn.lock().unwrap() = Some(bad);
                            }),
                        )
                        .unwrap();
                        s.stream_synchronize(ctx, st).unwrap();
                        assert_eq!(
                            *seen.lock().unwrap(),
                            Some(0),
                            "{t}, thread {th}, round {round}: stale bytes in the callback"
                        );
                        s.mem_free(ctx, dev).unwrap();
                    }
                    s.stream_destroy(st).unwrap();
                });
            }
        });
        assert_eq!(s.pending_copies(), 0, "{t}");
    }
}

#[test]
fn unregister_free_host_and_context_destroy_deliver_pending_copies() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = server();
    for (t, s) in sessions(&server) {
        let ctx = s.ctx_create(0, 0).unwrap();
        let st = s.stream_create(ctx, NON_BLOCKING, 0).unwrap();
        let dev = filled(&s, ctx, 4096, 9);
        // cuMemHostUnregister of the destination.
        let mut host = vec![0u8; 8192];
        let base = host.as_mut_ptr() as u64;
        s.host_memory().register(base, 8192, 0, ctx).unwrap();
        let out = copy_async(&s, ctx, st, dev, 4096);
        s.mem_host_unregister(base).unwrap();
        check(&format!("{t}: unregister"), &out, 4096, 9);
        // cuCtxDestroy.
        let out = copy_async(&s, ctx, st, dev, 4096);
        s.ctx_destroy(ctx).unwrap();
        check(&format!("{t}: context destroy"), &out, 4096, 9);
        assert_eq!(s.pending_copies(), 0, "{t}");
    }
}
