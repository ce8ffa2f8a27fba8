//! Bulk 1-D copies through the record path (pipelined chunks, the source written from the
//! caller's memory) end to end over Unix and TCP sockets: every byte of large copies with odd
//! sizes, odd host offsets and odd device offsets arrives intact in both directions,
//! synchronous and asynchronous, and nothing beside the copied range is touched; a copy that
//! fails in a later chunk reports the error and leaves the session usable.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use remora_client::{CuError, Session, cu};
use remora_oncrpc::TransportChoice;

/// Sizes around the client's 4 MiB chunk, and one of several windows' worth.
const SIZES: [usize; 6] = [
    1,
    4093,
    (4 << 20) - 1,
    (4 << 20) + 1,
    3 * (4 << 20) + 5,
    (37 << 20) + 3,
];

/// Copies `n` bytes to and from the device at odd offsets on both sides and checks every byte
/// of the device buffer and of what came back.
fn check_size(s: &Session, n: usize, seed: u32) {
    const DEV_OFF: usize = 13;
    const HOST_OFF: usize = 3;
    let ctx = s.primary_ctx_retain(0).unwrap();
    let total = n + 2 * DEV_OFF;
    let a = s.mem_alloc(ctx, total as u64).unwrap();
    // A known background over the whole allocation.
    let background = pattern(total, seed ^ 0xffff);
    s.memcpy_htod(ctx, LEGACY, a, &background).unwrap();

    // Synchronous H2D from an odd host offset to an odd device offset.
    let src = pattern(n + HOST_OFF, seed);
    s.memcpy_htod(ctx, LEGACY, a + DEV_OFF as u64, &src[HOST_OFF..])
        .unwrap();
    let mut expect = background.clone();
    expect[DEV_OFF..DEV_OFF + n].copy_from_slice(&src[HOST_OFF..]);
    let mut whole = vec![0u8; total];
    s.memcpy_dtoh(ctx, LEGACY, a, &mut whole).unwrap();
    assert!(whole == expect, "{n} bytes: device contents after H2D");

    // Synchronous D2H from an odd device offset into an odd host offset.
    let mut back = vec![0x77u8; n + 2 * HOST_OFF];
    s.memcpy_dtoh(
        ctx,
        LEGACY,
        a + DEV_OFF as u64,
        &mut back[HOST_OFF..HOST_OFF + n],
    )
    .unwrap();
    assert!(
        back[HOST_OFF..HOST_OFF + n] == src[HOST_OFF..],
        "{n} bytes: D2H"
    );
    assert!(back[..HOST_OFF].iter().all(|&b| b == 0x77), "{n}: before");
    assert!(
        back[HOST_OFF + n..].iter().all(|&b| b == 0x77),
        "{n}: after"
    );

    // Asynchronous both ways on a stream.
    let stream = s.stream_create(ctx, 0, 0).unwrap();
    let src2 = pattern(n + HOST_OFF, seed + 1);
    s.memcpy_htod_async(ctx, stream, a + DEV_OFF as u64, &src2[HOST_OFF..])
        .unwrap();
    let got = Arc::new(Mutex::new(None));
    let sink = Arc::clone(&got);
    s.memcpy_dtoh_async(
        ctx,
        stream,
        a + DEV_OFF as u64,
        n as u64,
        Box::new(move |d: &[u8]| *sink.lock().unwrap() = Some(d.to_vec())),
    )
    .unwrap();
    s.stream_synchronize(ctx, stream).unwrap();
    let got = got.lock().unwrap().take().expect("async copy delivered");
    assert!(got == src2[HOST_OFF..], "{n} bytes: async round trip");
    let mut whole = vec![0u8; total];
    s.memcpy_dtoh(ctx, LEGACY, a, &mut whole).unwrap();
    expect[DEV_OFF..DEV_OFF + n].copy_from_slice(&src2[HOST_OFF..]);
    assert!(
        whole == expect,
        "{n} bytes: device contents after async H2D"
    );

    s.stream_destroy(stream).unwrap();
    s.mem_free(ctx, a).unwrap();
}

fn every_size_over(transport: TransportChoice, tcp: bool) {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(AREA);
    let endpoint = if tcp {
        server.tcp()
    } else {
        server.endpoint.clone()
    };
    let s = session(&endpoint, transport);
    assert_eq!(s.data_area_size(), 0, "the record path, not the data area");
    for (i, &n) in SIZES.iter().enumerate() {
        check_size(&s, n, i as u32 * 31 + 5);
    }
}

#[test]
fn every_byte_arrives_over_unix() {
    every_size_over(TransportChoice::Unix, false);
}

#[test]
fn every_byte_arrives_over_tcp() {
    every_size_over(TransportChoice::Auto, true);
}

#[test]
fn a_failing_chunk_fails_the_copy_and_the_session_goes_on() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(AREA);
    for (endpoint, transport) in [
        (server.endpoint.clone(), TransportChoice::Unix),
        (server.tcp(), TransportChoice::Auto),
    ] {
        let s = session(&endpoint, transport);
        let ctx = s.primary_ctx_retain(0).unwrap();
        let n = 9 << 20;
        let a = s.mem_alloc(ctx, n as u64).unwrap();
        // 1 byte too many: the last chunk lies partly outside the allocation.
        let data = pattern(n + 1, 1);
        assert_eq!(
            s.memcpy_htod(ctx, LEGACY, a, &data),
            Err(CuError(cu::INVALID_VALUE))
        );
        let mut out = vec![0u8; n + 1];
        assert_eq!(
            s.memcpy_dtoh(ctx, LEGACY, a, &mut out),
            Err(CuError(cu::INVALID_VALUE))
        );
        // The session still copies.
        s.memcpy_htod(ctx, LEGACY, a, &data[..n]).unwrap();
        s.memcpy_dtoh(ctx, LEGACY, a, &mut out[..n]).unwrap();
        assert!(out[..n] == data[..n]);
        s.mem_free(ctx, a).unwrap();
    }
}
