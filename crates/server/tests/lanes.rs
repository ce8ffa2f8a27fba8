//! Lanes (revision 16) over TCP on the emulated backend: synchronous copies of 16 MiB or more
//! (revision 17: asynchronous host-to-device ones, and stream-ordered reads into pageable
//! memory, too) are striped over the session's own
//! connection and its lanes; every byte arrives, a striped copy follows the session's earlier
//! (one-way) calls and precedes its later ones, a failing chunk on a lane fails the
//! copy and the session goes on; a lane serves only its session's copies, a wrong key or a
//! lane of an ended session is refused.

mod common;

use common::*;
use remora_client::{CuError, cu};
use remora_oncrpc::{AuthStat, Client, ClientConfig, RpcError, TransportChoice};
use remora_proto::remora::*;

fn lane_client(endpoint: &remora_oncrpc::Endpoint) -> RemoraV1Client {
    RemoraV1Client::new(
        Client::connect_with(
            endpoint,
            ClientConfig {
                transport: TransportChoice::Tcp,
                ..ClientConfig::default()
            },
        )
        .unwrap(),
    )
}

/// A session over TCP to a fresh emulated server (kept alive by the first element), its
/// primary context and a non-blocking stream there.
fn tcp_session_and_stream() -> (Server, remora_client::Session, u64, u64) {
    let server = serve(0);
    let s = session(&server.tcp(), TransportChoice::Auto);
    let ctx = s.primary_ctx_retain(0).unwrap();
    let stream = s.stream_create(ctx, 1, 0).unwrap(); // CU_STREAM_NON_BLOCKING
    (server, s, ctx, stream)
}

#[test]
fn striped_copies_move_every_byte_and_follow_earlier_calls() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(0);
    let s = session(&server.tcp(), TransportChoice::Auto);
    let ctx = s.primary_ctx_retain(0).unwrap();
    // Below the striping size: no lanes yet.
    let small = pattern(5 << 20, 3);
    let a = s.mem_alloc(ctx, (64 << 20) + 64).unwrap();
    s.memcpy_htod(ctx, LEGACY, a, &small).unwrap();
    assert_eq!(s.lane_count(), 0);

    // 41 MiB + 7 at an odd device offset, both ways: 11 chunks over 4 connections.
    let n = (41 << 20) + 7;
    let src = pattern(n, 11);
    s.memcpy_htod(ctx, LEGACY, a + 13, &src).unwrap();
    assert_eq!(s.lane_count(), 3, "REMORA_LANES defaults to 3");
    let mut back = vec![0u8; n + 2];
    s.memcpy_dtoh(ctx, LEGACY, a + 13, &mut back[1..=n])
        .unwrap();
    assert!(back[1..=n] == src[..], "striped D2H");
    assert_eq!((back[0], back[n + 1]), (0, 0), "nothing beside the range");

    // A striped read after one-way calls sees what they did: the first chunk's answer comes
    // only once the server has run them (memsets batched one-way before the copy).
    for round in 0..3u32 {
        let value = 0x40 + round;
        s.memset_async(&RmMemsetArgs {
            ctx,
            stream: LEGACY,
            dst: a,
            value,
            element_size: 1,
            count: 64 << 20,
        })
        .unwrap();
        let mut out = vec![0u8; 64 << 20];
        s.memcpy_dtoh(ctx, LEGACY, a, &mut out).unwrap();
        assert!(
            out.iter().all(|&b| u32::from(b) == value),
            "round {round}: a chunk was read before the memset ran"
        );
        // And a striped write is seen by the one-way call after it.
        let data = pattern(32 << 20, round);
        s.memcpy_htod(ctx, LEGACY, a, &data).unwrap();
        let b = s.mem_alloc(ctx, 32 << 20).unwrap();
        s.memcpy_dtod(ctx, LEGACY, b, a, 32 << 20).unwrap();
        let mut out = vec![0u8; 32 << 20];
        s.memcpy_dtoh(ctx, LEGACY, b, &mut out).unwrap();
        assert!(
            out == data,
            "round {round}: the copy after the striped write"
        );
        s.mem_free(ctx, b).unwrap();
    }

    // A chunk that fails (on a lane: the last one lies partly outside the allocation) fails
    // the copy; the session goes on.
    let c = s.mem_alloc(ctx, 20 << 20).unwrap();
    let data = pattern((20 << 20) + 1, 5);
    assert_eq!(
        s.memcpy_htod(ctx, LEGACY, c, &data),
        Err(CuError(cu::INVALID_VALUE))
    );
    let mut out = vec![0u8; (20 << 20) + 1];
    assert_eq!(
        s.memcpy_dtoh(ctx, LEGACY, c, &mut out),
        Err(CuError(cu::INVALID_VALUE))
    );
    s.memcpy_htod(ctx, LEGACY, c, &data[..20 << 20]).unwrap();
    s.memcpy_dtoh(ctx, LEGACY, c, &mut out[..20 << 20]).unwrap();
    assert!(out[..20 << 20] == data[..20 << 20]);
    s.mem_free(ctx, c).unwrap();
    s.mem_free(ctx, a).unwrap();
}

#[test]
fn striped_async_copies_stay_in_stream_order() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (_server, s, ctx, stream) = tcp_session_and_stream();
    let n = (40 << 20) + 5;
    let a = s.mem_alloc(ctx, (n + 64) as u64).unwrap();
    let b = s.mem_alloc(ctx, (n + 64) as u64).unwrap();
    for round in 0..3u32 {
        // Before: a one-way memset on the stream. A chunk on a lane that overtook it would be
        // overwritten.
        s.memset_async(&RmMemsetArgs {
            ctx,
            stream,
            dst: a,
            value: 0x20 + round,
            element_size: 1,
            count: (n + 64) as u64,
        })
        .unwrap();
        let data = pattern(n, 7 + round);
        s.memcpy_htod_async(ctx, stream, a + 3, &data).unwrap();
        assert_eq!(s.lane_count(), 3, "round {round}: striped over the lanes");
        // After: a one-way device copy on the stream must see every chunk.
        s.memcpy_dtod_async(ctx, stream, b, a, (n + 64) as u64)
            .unwrap();
        s.stream_synchronize(ctx, stream).unwrap();
        let mut out = vec![0u8; n + 64];
        s.memcpy_dtoh(ctx, LEGACY, b, &mut out).unwrap();
        assert!(
            out[3..3 + n] == data[..],
            "round {round}: a chunk out of order"
        );
        assert!(
            out[..3]
                .iter()
                .chain(&out[3 + n..])
                .all(|&x| u32::from(x) == 0x20 + round),
            "round {round}: the memset around the copy"
        );
    }
    // A chunk that fails (the last one lies partly outside the allocation): like any
    // asynchronous copy's, its error comes with the next synchronizing call.
    let data = pattern(n + 64, 1);
    s.memcpy_htod_async(ctx, stream, a + 1, &data).unwrap();
    assert_eq!(
        s.stream_synchronize(ctx, stream),
        Err(CuError(cu::INVALID_VALUE))
    );
    s.memcpy_htod_async(ctx, stream, a, &data[..n]).unwrap();
    s.stream_synchronize(ctx, stream).unwrap();
    let mut out = vec![0u8; n];
    s.memcpy_dtoh(ctx, LEGACY, a, &mut out).unwrap();
    assert!(out == data[..n]);
    s.mem_free(ctx, a).unwrap();
    s.mem_free(ctx, b).unwrap();
}

#[test]
fn pageable_async_reads_follow_their_stream_and_deliver_earlier_copies() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (_server, s, ctx, stream) = tcp_session_and_stream();
    let n = (40 << 20) + 5;
    let a = s.mem_alloc(ctx, (n + 64) as u64).unwrap();
    // Too small: the caller issues the asynchronous copy instead.
    let mut small = vec![0u8; 1 << 20];
    assert!(s.memcpy_dtoh_pageable(ctx, stream, a, &mut small).is_none());
    for (round, len) in [(0u32, n), (1, 9 << 20), (2, n)] {
        let value = 0x30 + round;
        // An earlier small asynchronous read on the stream, delivered by the copy's reply.
        let got = std::sync::Arc::new(std::sync::Mutex::new(Vec::new()));
        let g = std::sync::Arc::clone(&got);
        s.memset_async(&RmMemsetArgs {
            ctx,
            stream,
            dst: a,
            value,
            element_size: 1,
            count: (n + 64) as u64,
        })
        .unwrap();
        s.memcpy_dtoh_async(
            ctx,
            stream,
            a,
            16,
            Box::new(move |d: &[u8]| g.lock().unwrap().extend_from_slice(d)),
        )
        .unwrap();
        let mut out = vec![0u8; len];
        s.memcpy_dtoh_pageable(ctx, stream, a + 1, &mut out)
            .expect("a server of revision 17 over TCP")
            .unwrap();
        assert!(
            out.iter().all(|&b| u32::from(b) == value),
            "round {round}: read before the stream's memset ran"
        );
        assert_eq!(*got.lock().unwrap(), vec![value as u8; 16], "round {round}");
    }
    assert_eq!(s.lane_count(), 3, "striped");
    // Past the allocation: the copy fails, the session goes on.
    let mut out = vec![0u8; n + 128];
    assert_eq!(
        s.memcpy_dtoh_pageable(ctx, stream, a, &mut out),
        Some(Err(CuError(cu::INVALID_VALUE)))
    );
    s.stream_synchronize(ctx, stream).unwrap();
    s.mem_free(ctx, a).unwrap();
}

#[test]
fn large_asynchronous_reads_into_host_memory_arrive_whole() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let (_server, s, ctx, stream) = tcp_session_and_stream();
    // 100 MiB + 3: four chunks, each written straight to its place, delivered one reply
    // (at most 32 MiB of copy data) at a time.
    let n = (100 << 20) + 3;
    let a = s.mem_alloc(ctx, n as u64).unwrap();
    let data = pattern(n, 21);
    s.memcpy_htod(ctx, LEGACY, a, &data).unwrap();
    for round in 0..2 {
        let mut out = vec![0u8; n];
        // SAFETY: `out` outlives the copy, which the synchronize below completes, and
        // nothing touches it meanwhile.
        unsafe { s.memcpy_dtoh_async_into(ctx, stream, a, out.as_mut_ptr(), n as u64) }.unwrap();
        s.stream_synchronize(ctx, stream).unwrap();
        assert!(out == data, "round {round}");
    }
    // Revision 19: what the synchronize's reply could not carry was collected on the
    // session's connection and its lanes at once.
    assert!(s.collects_on_lanes() > 0, "no collect went on a lane");
    // Reads on three streams, held together, each into its own place; a context synchronize
    // covers them all.
    let streams: Vec<u64> = (0..3)
        .map(|_| s.stream_create(ctx, 1, 0).unwrap())
        .collect();
    let mut outs: Vec<Vec<u8>> = (0..3).map(|_| vec![0u8; n]).collect();
    for (st, out) in streams.iter().zip(outs.iter_mut()) {
        // SAFETY: as above; the context synchronize completes the copy.
        unsafe { s.memcpy_dtoh_async_into(ctx, *st, a, out.as_mut_ptr(), n as u64) }.unwrap();
    }
    s.ctx_synchronize(ctx).unwrap();
    for (i, out) in outs.iter().enumerate() {
        assert!(*out == data, "stream {i}");
    }
    assert_eq!(s.pending_copies(), 0);
    s.mem_free(ctx, a).unwrap();
}

#[test]
fn a_lane_serves_only_its_sessions_copies_and_only_with_its_key() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(0);
    let endpoint = server.tcp();
    let s = session(&endpoint, TransportChoice::Auto);
    let ctx = s.primary_ctx_retain(0).unwrap();
    let a = s.mem_alloc(ctx, 4096).unwrap();
    let LaneKeyReply::Case0(key) = s.rpc().remora_lane_key().unwrap() else {
        panic!("no lane key")
    };

    // A wrong secret: AUTH_ERROR, and the connection is closed.
    let wrong = LaneKey {
        route: key.route,
        secret: [7; 16],
    };
    let bad = lane_client(&endpoint);
    assert!(matches!(
        bad.remora_lane_attach(&wrong),
        Err(RpcError::AuthError {
            stat: AuthStat::BadCred
        })
    ));

    // The right key: the lane copies in the session (its device memory)...
    let lane = lane_client(&endpoint);
    assert_eq!(lane.remora_lane_attach(&key).unwrap(), 0);
    let data = pattern(4096, 9);
    let r = lane
        .rm_memcpy_htod(&RmHtodArgs {
            ctx,
            stream: LEGACY,
            dst: a,
            data: data.clone().into(),
        })
        .unwrap();
    assert_eq!(r.status, 0);
    let mut out = vec![0u8; 4096];
    s.memcpy_dtoh(ctx, LEGACY, a, &mut out).unwrap();
    assert!(
        out == data,
        "the lane's copy landed in the session's memory"
    );
    // ... collects the session's completed copies (revision 19; none are pending here)...
    let r = lane.rm_copies_collect(&vec![]).unwrap();
    assert_eq!((r.status, r.copies.len()), (0, 0));
    // ... and nothing else.
    assert!(matches!(
        lane.rm_device_get_count(),
        Err(RpcError::ProcUnavail { .. })
    ));
    // A lane has no lanes, nor a second key on the same connection.
    let again = lane_client(&endpoint);
    assert_eq!(again.remora_lane_attach(&key).unwrap(), 0);
    assert!(again.remora_lane_attach(&key).is_err());

    // The session ends: its lanes are refused from then on.
    drop(s);
    let t0 = std::time::Instant::now();
    while server.executor().session_count() > 0 {
        assert!(t0.elapsed().as_secs() < 10, "the session did not end");
        std::thread::sleep(std::time::Duration::from_millis(10));
    }
    assert!(
        lane.rm_memcpy_dtoh(&RmDtohArgs {
            ctx,
            stream: LEGACY,
            src: a,
            size: 16,
            copy_id: 0,
        })
        .is_err()
    );
    let late = lane_client(&endpoint);
    assert!(matches!(
        late.remora_lane_attach(&key),
        Err(RpcError::AuthError {
            stat: AuthStat::BadCred
        })
    ));
}

#[test]
fn a_session_on_a_unix_socket_stripes_too_and_one_in_shared_memory_does_not() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(0);
    for (transport, lanes) in [(TransportChoice::Unix, 3), (TransportChoice::Shm, 0)] {
        let s = session(&server.endpoint, transport);
        let ctx = s.primary_ctx_retain(0).unwrap();
        let n = (21 << 20) + 9;
        let a = s.mem_alloc(ctx, n as u64).unwrap();
        let src = pattern(n, 17);
        s.memcpy_htod(ctx, LEGACY, a, &src).unwrap();
        let mut back = vec![0u8; n];
        s.memcpy_dtoh(ctx, LEGACY, a, &mut back).unwrap();
        assert!(back == src, "{transport:?}");
        assert_eq!(s.lane_count(), lanes, "{transport:?}");
        s.mem_free(ctx, a).unwrap();
    }
}
