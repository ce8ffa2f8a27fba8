//! Copies through the shared data area (revision 6) end to end: client `Session` in shared
//! memory → executor → EMULATED test backend. Every size from 1 byte to more than the area,
//! in every direction, synchronous and asynchronous, gives the bytes a Unix-socket session
//! gives; hostile (offset, size) from a hand-made client are refused with
//! CUDA_ERROR_INVALID_VALUE and the server goes on (also in the copy-id flag forms of
//! zero-copy pinned memory, tested end to end in `pinned_area.rs`).

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use remora_client::Session;
use remora_client::proto::*;
use remora_oncrpc::{Client, ClientConfig, TransportChoice};

const SIZES: [usize; 9] = [
    1,
    7,
    4096,
    65_535,
    65_536,
    100_000,
    AREA as usize / 4 + 1,
    AREA as usize,
    3 * AREA as usize + 123,
];

/// Every direction through `s`: H2D sync, D2H sync, H2D async + D2H async + synchronize,
/// D2D; returns what came back.
fn round_trips(s: &Session, n: usize, seed: u32) -> Vec<Vec<u8>> {
    let ctx = s.primary_ctx_retain(0).unwrap();
    let a = s.mem_alloc(ctx, n as u64).unwrap();
    let b = s.mem_alloc(ctx, n as u64).unwrap();
    let data = pattern(n, seed);
    let mut out = Vec::new();

    s.memcpy_htod(ctx, LEGACY, a, &data).unwrap();
    let mut back = vec![0u8; n];
    s.memcpy_dtoh(ctx, LEGACY, a, &mut back).unwrap();
    out.push(back);

    let stream = s.stream_create(ctx, 0, 0).unwrap();
    let data2 = pattern(n, seed + 1);
    s.memcpy_htod_async(ctx, stream, b, &data2).unwrap();
    let got = Arc::new(Mutex::new(None));
    let sink = Arc::clone(&got);
    s.memcpy_dtoh_async(
        ctx,
        stream,
        b,
        n as u64,
        Box::new(move |d: &[u8]| *sink.lock().unwrap() = Some(d.to_vec())),
    )
    .unwrap();
    s.stream_synchronize(ctx, stream).unwrap();
    out.push(got.lock().unwrap().take().expect("async copy delivered"));

    s.memcpy_dtod(ctx, LEGACY, a, b, n as u64).unwrap();
    let mut back = vec![0u8; n];
    s.memcpy_dtoh(ctx, LEGACY, a, &mut back).unwrap();
    out.push(back);
    assert_eq!(out[0], data);
    assert_eq!(out[1], data2);
    assert_eq!(out[2], data2);

    s.stream_destroy(stream).unwrap();
    s.mem_free(ctx, a).unwrap();
    s.mem_free(ctx, b).unwrap();
    out
}

#[test]
fn every_size_and_direction_matches_unix() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(AREA);
    let shm = session(&server.endpoint, TransportChoice::Shm);
    assert_eq!(shm.data_area_size(), AREA);
    let unix = session(&server.endpoint, TransportChoice::Unix);
    assert_eq!(unix.data_area_size(), 0);
    for (i, n) in SIZES.into_iter().enumerate() {
        let a = round_trips(&shm, n, i as u32);
        let b = round_trips(&unix, n, i as u32);
        assert_eq!(a, b, "{n} bytes");
    }
}

#[test]
fn no_data_area_keeps_copies_in_the_calls() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(0);
    let shm = session(&server.endpoint, TransportChoice::Shm);
    assert_eq!(shm.data_area_size(), 0);
    round_trips(&shm, 100_000, 9);
}

#[test]
fn concurrent_copies_share_the_area() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(AREA);
    let s = session(&server.endpoint, TransportChoice::Shm);
    let ctx = s.primary_ctx_retain(0).unwrap();
    std::thread::scope(|scope| {
        for t in 0..4u32 {
            let s = &s;
            scope.spawn(move || {
                let n = 150_000 + t as usize * 1000;
                let a = s.mem_alloc(ctx, n as u64).unwrap();
                for round in 0..5 {
                    let data = pattern(n, t * 10 + round);
                    s.memcpy_htod(ctx, LEGACY, a, &data).unwrap();
                    let mut back = vec![0u8; n];
                    s.memcpy_dtoh(ctx, LEGACY, a, &mut back).unwrap();
                    assert_eq!(back, data);
                }
                s.mem_free(ctx, a).unwrap();
            });
        }
    });
}

/// A hand-made client on shared memory naming bytes outside the area.
#[test]
fn hostile_offsets_are_refused() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(AREA);
    // A session for the device allocation, then raw calls on a second connection would not
    // see it: use one raw connection for everything.
    let rpc = Client::connect_with(
        &server.endpoint,
        ClientConfig {
            transport: TransportChoice::Shm,
            ..ClientConfig::default()
        },
    )
    .unwrap();
    assert!(rpc.data_area().is_some());
    let c = RemoraV1Client::new(rpc);
    let hello = c
        .remora_hello(&HelloArgs {
            min_revision: 6,
            max_revision: REMORA_PROTOCOL_REVISION,
            client_name: "hostile".into(),
            capabilities: u64::from(REMORA_CAP_ONEWAY),
        })
        .unwrap();
    assert!(matches!(hello, HelloReply::True(_)));
    let RmHandleReply::Case0(ctx) = c.rm_primary_ctx_retain(&0).unwrap() else {
        panic!("no context")
    };
    // RM_AREA_MAP (revision 18): an empty range, or one outside the area, is refused.
    let invalid = remora_client::cu::INVALID_VALUE;
    for (offset, size) in [(0, 0), (AREA, 4096), (u64::MAX - 10, 100)] {
        let r = c.rm_area_map(&RmAreaMapArgs { ctx, offset, size }).unwrap();
        assert!(
            matches!(r, RmU64Reply::Default { discriminant } if discriminant == invalid),
            "RM_AREA_MAP {offset:#x}+{size}: {r:?}"
        );
    }
    assert!(matches!(
        c.rm_area_map(&RmAreaMapArgs {
            ctx,
            offset: 0,
            size: 4096
        })
        .unwrap(),
        RmU64Reply::Case0(_)
    ));
    let RmU64Reply::Case0(dev) = c
        .rm_mem_alloc(&RmAllocArgs {
            ctx,
            bytesize: 1 << 20,
        })
        .unwrap()
    else {
        panic!("no memory")
    };
    let bad = [
        (AREA, 1),
        (AREA - 1, 2),
        (0, AREA + 1),
        (u64::MAX, 2),
        (2, u64::MAX),
        (u64::MAX, u64::MAX),
    ];
    for (offset, size) in bad {
        let a = RmAreaCopyArgs {
            ctx,
            stream: LEGACY,
            dev,
            offset,
            size,
            copy_id: 1,
        };
        let r = c.rm_area_memcpy_htod(&a).unwrap();
        assert_eq!(r.status, 1, "htod {offset} {size}");
        let r = c.rm_area_memcpy_dtoh(&a).unwrap();
        assert_eq!(r.status, 1, "dtoh {offset} {size}");
        // The async forms defer their error to the next synchronizing call.
        c.rm_area_memcpy_htod_async(&a).unwrap();
        let r = c.rm_ctx_synchronize(&ctx).unwrap();
        assert_eq!(r.status, 1, "htod async {offset} {size}");
        c.rm_area_memcpy_dtoh_async(&a).unwrap();
        let r = c.rm_ctx_synchronize(&ctx).unwrap();
        assert_eq!(r.status, 1, "dtoh async {offset} {size}");
        // Copy id 0: the flag forms (pinned source, no delivery) are bounded the same way.
        let z = RmAreaCopyArgs { copy_id: 0, ..a };
        c.rm_area_memcpy_htod_async(&z).unwrap();
        let r = c.rm_ctx_synchronize(&ctx).unwrap();
        assert_eq!(r.status, 1, "htod async (id 0) {offset} {size}");
        c.rm_area_memcpy_dtoh_async(&z).unwrap();
        let r = c.rm_ctx_synchronize(&ctx).unwrap();
        assert_eq!(r.status, 1, "dtoh async (no delivery) {offset} {size}");
        assert!(r.copies.is_empty());
    }
    // A device range outside the allocation is refused too, and good calls still work.
    let ok = RmAreaCopyArgs {
        ctx,
        stream: LEGACY,
        dev,
        offset: 0,
        size: AREA,
        copy_id: 0,
    };
    assert_eq!(c.rm_area_memcpy_htod(&ok).unwrap().status, 0);
    assert_eq!(c.rm_area_memcpy_dtoh(&ok).unwrap().status, 0);
    let outside = RmAreaCopyArgs {
        dev: dev + (1 << 20) - 1,
        ..ok
    };
    assert_ne!(c.rm_area_memcpy_htod(&outside).unwrap().status, 0);
    // The server still serves others.
    let other = session(&server.endpoint, TransportChoice::Shm);
    round_trips(&other, 1000, 3);
}

/// Over a Unix socket the area procedures have nothing to name: INVALID_VALUE.
#[test]
fn area_calls_without_an_area_are_refused() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(AREA);
    let rpc = Client::connect_with(
        &server.endpoint,
        ClientConfig {
            transport: TransportChoice::Unix,
            ..ClientConfig::default()
        },
    )
    .unwrap();
    assert!(rpc.data_area().is_none());
    let c = RemoraV1Client::new(rpc);
    let RmHandleReply::Case0(ctx) = c.rm_primary_ctx_retain(&0).unwrap() else {
        panic!("no context")
    };
    let RmU64Reply::Case0(dev) = c
        .rm_mem_alloc(&RmAllocArgs {
            ctx,
            bytesize: 4096,
        })
        .unwrap()
    else {
        panic!("no memory")
    };
    let a = RmAreaCopyArgs {
        ctx,
        stream: LEGACY,
        dev,
        offset: 0,
        size: 16,
        copy_id: 0,
    };
    assert_eq!(c.rm_area_memcpy_htod(&a).unwrap().status, 1);
    assert_eq!(c.rm_area_memcpy_dtoh(&a).unwrap().status, 1);
}
