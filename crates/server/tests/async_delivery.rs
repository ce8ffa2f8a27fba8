//! Asynchronous device-to-host copies over a socket travel inside synchronizing replies. A
//! reply carries at most the server's budget of copy data (64 MiB), so that no reply outgrows
//! what a client reads in one record (1 GiB) however much was queued; the client asks for the
//! rest. Here 160 MiB of async copies on one stream, then one synchronize (at least three
//! replies): every byte arrives, in place.
//! Client `Session` → executor → EMULATED backend.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use remora_oncrpc::TransportChoice;

#[test]
fn async_copies_larger_than_one_reply_all_arrive_at_the_synchronize() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve(0);
    let s = session(&server.endpoint, TransportChoice::Unix);
    let ctx = s.primary_ctx_retain(0).unwrap();
    let stream = s.stream_create(ctx, 1, 0).unwrap();
    const N: usize = 40 << 20;
    let mut devs = Vec::new();
    let mut outs = Vec::new();
    for k in 0..4u32 {
        let dev = s.mem_alloc(ctx, N as u64).unwrap();
        s.memcpy_htod(ctx, LEGACY, dev, &pattern(N, k)).unwrap();
        let out = Arc::new(Mutex::new(Vec::new()));
        let sink = Arc::clone(&out);
        s.memcpy_dtoh_async(
            ctx,
            stream,
            dev,
            N as u64,
            Box::new(move |b: &[u8]| sink.lock().unwrap().extend_from_slice(b)),
        )
        .unwrap();
        devs.push(dev);
        outs.push(out);
    }
    s.stream_synchronize(ctx, stream).unwrap();
    assert_eq!(
        s.pending_copies(),
        0,
        "everything delivered by the synchronize"
    );
    for (k, out) in outs.iter().enumerate() {
        assert!(*out.lock().unwrap() == pattern(N, k as u32), "copy {k}");
    }
    for d in devs {
        s.mem_free(ctx, d).unwrap();
    }
    s.stream_destroy(stream).unwrap();
}
