//! The plain calls generated from their `@glue` annotations in remora.x (client method,
//! executor handler, backend signature): arguments arrive, handles are resolved and checked,
//! results and errors come back.
//! Client `Session` → executor → EMULATED backend.

mod common;

use common::*;
use remora_client::proto::RmPrimaryStateReply;
use remora_client::{CuError, cu};

#[test]
fn generated_calls_resolve_handles_and_return_results() {
    let t = unix_session();
    let s = &t.s;
    let ctx = s.primary_ctx_retain(0).unwrap();
    assert_eq!(s.ctx_get_api_version(ctx), Ok(3020));
    assert_eq!(s.ctx_get_flags(ctx), Ok(0));
    // Set and read back, per context.
    assert_eq!(s.ctx_get_cache_config(ctx), Ok(0));
    s.ctx_set_cache_config(ctx, 2).unwrap();
    assert_eq!(s.ctx_get_cache_config(ctx), Ok(2));
    assert_eq!(
        s.ctx_set_cache_config(ctx, 9),
        Err(CuError(cu::INVALID_VALUE)),
        "the backend's answer comes back"
    );
    s.ctx_reset_persisting_l2_cache(ctx).unwrap();
    s.ctx_set_limit(ctx, 1, 4096).unwrap();
    assert_eq!(s.ctx_get_limit(ctx, 1), Ok(4096));
    // Streams: distinct ids, the legacy stream's too; a stream of the session only.
    let a = s.stream_create(ctx, 0, 0).unwrap();
    let b = s.stream_create(ctx, 1, 0).unwrap();
    let (ia, ib) = (
        s.stream_get_id(ctx, a).unwrap(),
        s.stream_get_id(ctx, b).unwrap(),
    );
    let il = s.stream_get_id(ctx, LEGACY).unwrap();
    assert!(ia != ib && ia != il && ib != il, "{ia} {ib} {il}");
    assert_eq!(
        s.stream_get_id(ctx, 0xdead),
        Err(CuError(cu::INVALID_HANDLE))
    );
    // Handles that name nothing are refused before the backend runs.
    assert_eq!(
        s.ctx_get_api_version(0xbeef),
        Err(CuError(cu::INVALID_HANDLE))
    );
    s.stream_destroy(a).unwrap();
    s.stream_destroy(b).unwrap();
}

#[test]
fn memset_rows_fill_each_row_and_stay_inside_the_allocation() {
    use remora_client::proto::RmMemset2dArgs;
    let t = unix_session();
    let s = &t.s;
    let ctx = s.primary_ctx_retain(0).unwrap();
    let (pitch, rows) = (256u64, 8u64);
    let p = s.mem_alloc(ctx, pitch * rows).unwrap();
    s.memcpy_htod(ctx, LEGACY, p, &vec![0u8; (pitch * rows) as usize])
        .unwrap();
    let args = |dst, value, element_size, width, height| RmMemset2dArgs {
        ctx,
        stream: LEGACY,
        dst,
        pitch,
        value,
        element_size,
        width,
        height,
    };
    // Bytes 16..116 of every row.
    s.memset_rows(&args(p + 16, 0xab, 1, 100, rows)).unwrap();
    // The last 32 bytes of rows 2..6 as u32, on the stream.
    s.memset_rows_async(&args(p + 2 * pitch + 224, 0x0102_0304, 4, 8, 4))
        .unwrap();
    s.stream_synchronize(ctx, LEGACY).unwrap();
    let mut out = vec![0u8; (pitch * rows) as usize];
    s.memcpy_dtoh(ctx, LEGACY, p, &mut out).unwrap();
    for (r, row) in out.chunks(pitch as usize).enumerate() {
        for (i, b) in row.iter().enumerate() {
            let want = if (16..116).contains(&i) {
                0xab
            } else if (2..6).contains(&r) && i >= 224 {
                [4, 3, 2, 1][i % 4]
            } else {
                0
            };
            assert_eq!(*b, want, "row {r} byte {i}");
        }
    }
    // One row too many, or rows wider than the pitch: refused before the backend.
    assert_eq!(
        s.memset_rows(&args(p + 16, 0, 1, 100, rows + 1)),
        Err(CuError(cu::INVALID_VALUE))
    );
    assert_eq!(
        s.memset_rows(&args(p, 0, 1, pitch + 1, 2)),
        Err(CuError(cu::INVALID_VALUE))
    );
    s.mem_free(ctx, p).unwrap();
}

#[test]
fn stream_attributes_are_set_read_back_and_windows_checked() {
    use remora_client::proto::{RmAccessPolicy, RmStreamAttr};
    let t = unix_session();
    let s = &t.s;
    let ctx = s.primary_ctx_retain(0).unwrap();
    let st = s.stream_create(ctx, 1, 0).unwrap();
    let p = s.mem_alloc(ctx, 1 << 20).unwrap();
    let window = RmStreamAttr::Case1(RmAccessPolicy {
        base: p,
        num_bytes: 1 << 20,
        hit_ratio: 0.6,
        hit_prop: 2,
        miss_prop: 1,
    });
    assert_eq!(
        s.stream_get_attribute(ctx, st, 3),
        Ok(RmStreamAttr::Case3(0))
    );
    s.stream_set_attribute(ctx, st, window.clone()).unwrap();
    s.stream_set_attribute(ctx, st, RmStreamAttr::Case3(2))
        .unwrap();
    assert_eq!(s.stream_get_attribute(ctx, st, 1), Ok(window));
    assert_eq!(
        s.stream_get_attribute(ctx, st, 3),
        Ok(RmStreamAttr::Case3(2))
    );
    // A window over memory that is not the session's is refused before the driver sees it.
    let foreign = RmStreamAttr::Case1(RmAccessPolicy {
        base: 0x10,
        num_bytes: 4096,
        hit_ratio: 1.0,
        hit_prop: 2,
        miss_prop: 1,
    });
    assert_eq!(
        s.stream_set_attribute(ctx, st, foreign),
        Err(CuError(cu::INVALID_VALUE))
    );
    assert_eq!(
        s.stream_get_attribute(ctx, 0xdead, 3),
        Err(CuError(cu::INVALID_HANDLE))
    );
    s.stream_destroy(st).unwrap();
    s.mem_free(ctx, p).unwrap();
}

/// `cuDevicePrimaryCtxGetState` is answered from the session's cache after the first call;
/// every primary-context call of the session keeps it equal to the server's answer.
#[test]
fn primary_context_state_cache_follows_every_change() {
    let t = unix_session();
    let s = &t.s;
    let truth = || match s.rpc().rm_primary_ctx_get_state(&0).unwrap() {
        RmPrimaryStateReply::Case0(st) => (st.flags, st.active != 0),
        other => panic!("{other:?}"),
    };
    let check = |what: &str, want: (u32, bool)| {
        for _ in 0..2 {
            assert_eq!(s.primary_ctx_get_state(0), Ok(want), "{what}: cached");
        }
        assert_eq!(truth(), want, "{what}: server");
    };
    check("fresh", (0, false));
    s.primary_ctx_retain(0).unwrap();
    check("retained", (0, true));
    s.primary_ctx_set_flags(0, 4).unwrap();
    check("flags set", (4, true));
    s.primary_ctx_retain(0).unwrap();
    s.primary_ctx_release(0).unwrap();
    check("retained twice, released once", (4, true));
    s.primary_ctx_release(0).unwrap();
    check("released", (4, false));
    s.primary_ctx_retain(0).unwrap();
    s.primary_ctx_reset(0).unwrap();
    // What the flags become is the backend's answer; inactive either way.
    let after_reset = truth();
    assert!(!after_reset.1, "{after_reset:?}");
    check("reset", after_reset);
    assert_eq!(s.primary_ctx_get_state(7), Err(CuError(cu::INVALID_DEVICE)));
}

/// Occupancy answers are cached per (function, block size, shared memory, flags) and
/// forgotten when a function attribute changes; the maximum dynamic shared memory attribute
/// reads back as set and setting it again to the same value is answered here.
#[test]
fn occupancy_cache_follows_function_attributes() {
    let t = unix_session();
    let s = &t.s;
    let ctx = s.primary_ctx_retain(0).unwrap();
    let m = s
        .module_load(ctx, b"REMORA-EMU-MODULE\nfunc vecadd 8,8,8,4\n")
        .unwrap();
    let f = m.functions["vecadd"].handle;
    let truth = |attr: i32| match s
        .rpc()
        .rm_func_get_attribute(&remora_client::proto::RmFuncAttrArgs {
            function: f,
            attribute: attr,
            value: 0,
        })
        .unwrap()
    {
        remora_client::proto::RmIntReply::Case0(v) => v,
        other => panic!("{other:?}"),
    };
    const KIB: u64 = 1024;
    assert_eq!(s.occupancy_max_active_blocks(f, 256, 0, 0), Ok(8));
    assert_eq!(s.occupancy_max_active_blocks(f, 256, 64 * KIB, 0), Ok(0));
    assert_eq!(s.occupancy_max_active_blocks(f, 256, 64 * KIB, 0), Ok(0));
    s.func_set_attribute(f, 8, 100 << 10).unwrap();
    assert_eq!(
        s.occupancy_max_active_blocks(f, 256, 64 * KIB, 0),
        Ok(3),
        "a cached answer outlived the attribute change"
    );
    assert_eq!(s.func_get_attribute(f, 8), Ok(100 << 10));
    assert_eq!(truth(8), 100 << 10);
    s.func_set_attribute(f, 8, 100 << 10).unwrap();
    assert_eq!(
        s.func_set_attribute(f, 8, 300 << 10),
        Err(CuError(cu::INVALID_VALUE))
    );
    assert_eq!(s.func_get_attribute(f, 8), Ok(100 << 10));
    assert_eq!(truth(8), 100 << 10);
    s.func_set_attribute(f, 8, 0).unwrap();
    assert_eq!(s.occupancy_max_active_blocks(f, 256, 64 * KIB, 0), Ok(0));
    assert_eq!(s.occupancy_max_active_blocks(f, 256, 16 * KIB, 0), Ok(8));
    assert_eq!(s.occupancy_max_active_blocks(f, 128, 16 * KIB, 0), Ok(14));
    // Alternating values (one-way sets within the opt-in limit, as libraries make them):
    // each value's answers hold, and the server has the value last set.
    for round in 0..3 {
        s.func_set_attribute(f, 8, 100 << 10).unwrap();
        assert_eq!(
            s.occupancy_max_active_blocks(f, 256, 64 * KIB, 0),
            Ok(3),
            "round {round}"
        );
        s.func_set_attribute(f, 8, 16 << 10).unwrap();
        assert_eq!(
            s.occupancy_max_active_blocks(f, 256, 64 * KIB, 0),
            Ok(0),
            "round {round}"
        );
        assert_eq!(truth(8), 16 << 10);
    }
    assert_eq!(
        s.func_set_attribute(f, 8, 228 << 10),
        Err(CuError(cu::INVALID_VALUE)),
        "past the opt-in limit: asked synchronously, refused at once"
    );
    s.ctx_synchronize(ctx).unwrap();
}

/// Setting a function attribute to the value this session last set it to is answered by the
/// client; a failed set, and `cuFuncSetCacheConfig` (which moves the carveout), forget it.
#[test]
fn repeated_function_attribute_sets_stay_local() {
    let t = unix_session();
    let s = &t.s;
    let ctx = s.primary_ctx_retain(0).unwrap();
    let m = s
        .module_load(ctx, b"REMORA-EMU-MODULE\nfunc vecadd 8,8,8,4\n")
        .unwrap();
    let f = m.functions["vecadd"].handle;
    let args = |value| remora_client::proto::RmFuncAttrArgs {
        function: f,
        attribute: 9,
        value,
    };
    // Behind the client's back (only a test can): the server's value becomes 70.
    let set_on_server = |value| s.rpc().rm_func_set_attribute(&args(value)).unwrap();
    let truth = || match s.rpc().rm_func_get_attribute(&args(0)).unwrap() {
        remora_client::proto::RmIntReply::Case0(v) => v,
        other => panic!("{other:?}"),
    };
    s.func_set_attribute(f, 9, 50).unwrap();
    assert_eq!(truth(), 50);
    set_on_server(70);
    s.func_set_attribute(f, 9, 50).unwrap();
    assert_eq!(truth(), 70, "the repeated set went to the server");
    s.func_set_attribute(f, 9, 60).unwrap();
    assert_eq!(truth(), 60, "a new value goes to the server");
    s.func_set_cache_config(f, 1).unwrap();
    set_on_server(70);
    s.func_set_attribute(f, 9, 60).unwrap();
    assert_eq!(
        truth(),
        60,
        "the cache configuration did not forget the last set"
    );
    // A refused set forgets: the next set of the old value asks again.
    assert_eq!(
        s.func_set_attribute(f, 9, -5),
        Err(CuError(cu::INVALID_VALUE))
    );
    set_on_server(70);
    s.func_set_attribute(f, 9, 60).unwrap();
    assert_eq!(truth(), 60, "a failed set did not forget the last value");
}

/// Events come from a pool made `RM_EVENT_CREATE_MANY` at a time and are destroyed one-way
/// (revision 13): every event works as a fresh one, handles stay distinct, destroying an
/// event twice or one the session never had answers at once, and the events of a destroyed
/// context leave no deferred error behind.
#[test]
fn pooled_events_work_and_destruction_errors_stay_synchronous() {
    let t = unix_session();
    let s = &t.s;
    let ctx = s.primary_ctx_retain(0).unwrap();
    let mut seen = std::collections::HashSet::new();
    for round in 0..3 {
        // More than one batch, with two flag sets (pooled apart).
        let events: Vec<_> = (0..40)
            .map(|i| s.event_create(ctx, if i % 2 == 0 { 0 } else { 2 }).unwrap())
            .collect();
        for &e in &events {
            assert!(seen.insert(e), "round {round}: handle {e} handed out twice");
            assert_eq!(s.event_query(e), Ok(true), "a fresh event is complete");
        }
        for pair in events.chunks_exact(2) {
            s.event_record(ctx, pair[0], LEGACY).unwrap();
            s.event_record(ctx, pair[1], LEGACY).unwrap();
            s.event_synchronize(pair[1]).unwrap();
        }
        for &e in &events {
            s.event_destroy(e).unwrap();
        }
        assert_eq!(
            s.event_destroy(events[0]),
            Err(CuError(cu::INVALID_HANDLE)),
            "a second destroy answers at once"
        );
        s.ctx_synchronize(ctx).unwrap();
    }
    assert_eq!(
        s.event_destroy(0x7777_0000),
        Err(CuError(cu::INVALID_HANDLE))
    );
    assert_eq!(
        s.event_create(ctx, 0x80),
        Err(CuError(cu::INVALID_VALUE)),
        "bad flags are refused by the server, as natively"
    );
    // A created context's events go with it.
    let other = s.ctx_create(0, 0).unwrap();
    let e = s.event_create(other, 0).unwrap();
    s.ctx_destroy(other).unwrap();
    assert!(
        s.event_destroy(e).is_err(),
        "an event of a destroyed context"
    );
    s.ctx_synchronize(ctx).unwrap();
    let fresh = s.event_create(ctx, 0).unwrap();
    s.event_destroy(fresh).unwrap();
    s.ctx_synchronize(ctx).unwrap();
}

#[test]
fn images_go_unnamed_over_unix_and_by_hash_first_over_tcp() {
    use remora_client::proto::{RmLoadReply, RmModuleLoadArgs};
    use remora_oncrpc::TransportChoice;
    use sha2::{Digest, Sha256};
    // Revision 20: over a Unix socket (or shared memory) the client sends an image whole with
    // an all-zero hash, and the server names it by its SHA-256, so that a hash-first load of
    // the same image (another session, a TCP client of the same scope) finds it cached.
    let t = unix_session();
    let s = &t.s;
    let cached = || t.server.executor().cached_modules();
    let asked = || t.server.executor().images_asked_for();
    let ctx = s.primary_ctx_retain(0).unwrap();
    // A small image (hashed on the call's thread) and one past 1 MiB (hashed beside the load).
    let small = b"REMORA-EMU-MODULE\nfunc vecadd 8,8,8,4\n".to_vec();
    let mut large = b"REMORA-EMU-MODULE\nfunc big 8\nfunc other 4\n".to_vec();
    large.resize(large.len() + (2 << 20), b'\n');
    for (image, functions, n) in [(&small, 1, 1), (&large, 2, 2)] {
        let m = s.module_load(ctx, image).unwrap();
        assert_eq!(m.functions.len(), functions);
        assert_eq!(cached(), n, "the server named and cached the image");
        assert_eq!(asked(), 0, "the client sent the hash first");
        let hash: [u8; 32] = Sha256::digest(image).into();
        let by_hash = s
            .rpc()
            .rm_module_load(&RmModuleLoadArgs {
                ctx,
                hash,
                image: Default::default(),
            })
            .unwrap();
        let RmLoadReply::RmLoaded(again) = by_hash else {
            panic!("not cached under its SHA-256: {by_hash:?}")
        };
        assert_eq!(again.functions.len(), functions);
    }
    // An all-zero hash with no image names nothing: the server asks for the image.
    assert_eq!(
        s.rpc()
            .rm_module_load(&RmModuleLoadArgs {
                ctx,
                hash: [0; 32],
                image: Default::default(),
            })
            .unwrap(),
        RmLoadReply::RmNeedImage
    );
    assert_eq!(asked(), 1);
    // Over TCP the hash goes first: the server asks for a new image, then caches it.
    let tcp = session(&t.server.tcp(), TransportChoice::Tcp);
    let tctx = tcp.primary_ctx_retain(0).unwrap();
    let other = b"REMORA-EMU-MODULE\nfunc saxpy 4,8,8\n";
    assert_eq!(tcp.module_load(tctx, other).unwrap().functions.len(), 1);
    assert_eq!(asked(), 2, "over TCP the hash goes first");
    assert_eq!(cached(), 3);
}
