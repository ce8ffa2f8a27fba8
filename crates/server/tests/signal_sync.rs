//! Stream synchronizes seen in shared memory (`RM_STREAM_SIGNAL`, revision 14) against the
//! emulated backend: a synchronize over shared memory completes through a completion word;
//! whenever the full `RM_STREAM_SYNCHRONIZE` has something to carry (a deferred error,
//! copies to deliver, a module that may print from the device) the client makes it, and the
//! results are those of the full call. Over a Unix socket there are no completion words.

mod common;

use std::ffi::c_void;

use remora_client::{CuError, KernelArgs, LaunchConfig, StreamRef, cu};
use remora_oncrpc::TransportChoice;

#[test]
fn a_synchronize_over_shared_memory_is_seen_in_a_completion_word_and_falls_back_when_needed() {
    let server = common::serve(64 << 20);
    let s = common::session(&server.endpoint, TransportChoice::Shm);
    assert_eq!(s.signal_sync_counts(), Some((0, 0)));
    let kit = common::FillKit::new(&s, 1);
    let (ctx, stream, p) = (kit.ctx, kit.stream, kit.p);
    let f = kit.function("fill_i32");

    // Plain work: seen in shared memory (a word that comes later than the spin budget on a
    // busy machine sends the client to the full call, so not every one), and the kernel's
    // bytes are there either way. On a loaded machine adaptive waiting may settle on the full
    // call at once for a while (it tries the word again every so many synchronizes): up to
    // 400 synchronizes for one seen in shared memory.
    let mut synced = 0;
    for v in 0..400 {
        common::fill_i32(&s, ctx, f, p, v, stream);
        s.stream_synchronize(ctx, stream).unwrap();
        synced += 1;
        assert_eq!(common::ints(&s, ctx, p), (v..v + 64).collect::<Vec<_>>());
        if v >= 19 && s.signal_sync_counts().unwrap().0 > 0 {
            break;
        }
    }
    let (seen, full) = s.signal_sync_counts().unwrap();
    assert_eq!(seen + full, synced);
    assert!(
        seen > 0,
        "no synchronize was seen in shared memory ({full} full calls)"
    );

    // A launch that fails on the server (the emulated backend has no such kernel): its
    // error is deferred; the server's word sends the client to the full call, which reports
    // it, as natively the next synchronize does.
    let missing = kit.function("missing");
    let config = LaunchConfig {
        grid: [1, 1, 1],
        block: [1, 1, 1],
        shared_mem_bytes: 0,
        stream: StreamRef::Handle(stream),
        attrs: Vec::new(),
    };
    let arg = 0u64;
    let args: [*const c_void; 1] = [(&arg as *const u64).cast()];
    // SAFETY: one valid pointer for the one 8-byte parameter.
    unsafe { s.launch_kernel(ctx, missing, &config, KernelArgs::Params(args.as_ptr())) }.unwrap();
    assert_eq!(
        s.stream_synchronize(ctx, stream),
        Err(CuError(cu::NOT_SUPPORTED))
    );
    assert_eq!(s.signal_sync_counts().unwrap(), (seen, full + 1));
    // The error was reported once (not sticky): the next synchronize succeeds.
    common::fill_i32(&s, ctx, f, p, 9, stream);
    s.stream_synchronize(ctx, stream).unwrap();
    let (seen, full) = s.signal_sync_counts().unwrap();

    // An asynchronous copy to host memory waits for delivery: the full call carries it.
    common::fill_i32(&s, ctx, f, p, 11, stream);
    let got = common::dtoh_async(&s, ctx, stream, p, 256);
    s.stream_synchronize(ctx, stream).unwrap();
    let host = got.lock().unwrap().clone();
    assert_eq!(host.len(), 256);
    assert_eq!(i32::from_le_bytes(host[..4].try_into().unwrap()), 11);
    assert_eq!(i32::from_le_bytes(host[252..].try_into().unwrap()), 11 + 63);
    assert_eq!(
        s.signal_sync_counts().unwrap(),
        (seen, full),
        "not even tried"
    );

    // A module that may print from the device: every later synchronize is the full call.
    s.module_load(ctx, b"REMORA-EMU-MODULE\nfunc uses_vprintf 8\n")
        .unwrap();
    common::fill_i32(&s, ctx, f, p, 13, stream);
    s.stream_synchronize(ctx, stream).unwrap();
    assert_eq!(common::ints(&s, ctx, p)[0], 13);
    assert_eq!(s.signal_sync_counts().unwrap(), (seen, full + 1));
}

#[test]
fn sessions_over_sockets_have_no_completion_words() {
    let server = common::serve(64 << 20);
    let s = common::session(&server.endpoint, TransportChoice::Unix);
    assert_eq!(s.signal_sync_counts(), None);
    let ctx = s.primary_ctx_retain(0).unwrap();
    let stream = s.stream_create(ctx, 1, 0).unwrap();
    s.stream_synchronize(ctx, stream).unwrap();
}
