//! The CUDA executor end to end over a Unix socket, with the EMULATED test backend (CI has no
//! GPU): every procedure, deferred errors, async copies, session isolation and cleanup, deferred
//! replies for blocking calls, and the module cache.

use std::sync::Arc;
use std::time::{Duration, Instant};

use remora_oncrpc::{Client, Endpoint};
use remora_proto::remora::*;
use remora_server::{
    Backend, EmulatedBackend, EmulatedConfig, LiveCounts, Running, ServeConfig, inventory_of,
    start_with_backend,
};
use remora_xdr::Bytes;
use sha2::{Digest, Sha256};

const INVALID_VALUE: i32 = 1;
const INVALID_DEVICE: i32 = 101;
const INVALID_HANDLE: i32 = 400;
const NOT_FOUND: i32 = 500;
const NOT_SUPPORTED: i32 = 801;
const NEED_CTX: i32 = 201;

struct Fixture {
    _dir: tempfile::TempDir,
    running: Running,
    backend: Arc<EmulatedBackend>,
    endpoint: Endpoint,
}

fn serve(config: EmulatedConfig) -> Fixture {
    serve_with(config, ServeConfig::default())
}

/// As [`serve`], with `serve`'s options (its listen list is replaced).
fn serve_with(config: EmulatedConfig, serve: ServeConfig) -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let backend = Arc::new(EmulatedBackend::new(config));
    let endpoint = Endpoint::Unix(dir.path().join("remora.sock"));
    let running = start_with_backend(
        ServeConfig {
            listen: vec![endpoint.clone()],
            ..serve
        },
        Arc::clone(&backend) as Arc<dyn Backend>,
        inventory_of(&*backend),
    )
    .unwrap();
    Fixture {
        _dir: dir,
        running,
        backend,
        endpoint,
    }
}

impl Fixture {
    fn client(&self) -> RemoraV1Client {
        RemoraV1Client::new(Client::connect(&self.endpoint).unwrap())
            .with_timeout(Duration::from_secs(20))
    }

    fn wait_for_sessions(&self, n: usize) {
        let deadline = Instant::now() + Duration::from_secs(10);
        while self.running.executor().unwrap().session_count() != n {
            assert!(Instant::now() < deadline, "sessions never reached {n}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn handle(r: RmHandleReply) -> u64 {
    match r {
        RmHandleReply::Case0(h) => h,
        other => panic!("expected a handle, got {other:?}"),
    }
}

fn ok_bytes(data: Bytes) -> RmDtohReply {
    RmDtohReply {
        status: 0,
        data,
        copies: Vec::new(),
    }
}

fn failed_dtoh(status: i32) -> RmDtohReply {
    RmDtohReply {
        status,
        data: Bytes::new(),
        copies: Vec::new(),
    }
}

fn u64v(r: RmU64Reply) -> u64 {
    match r {
        RmU64Reply::Case0(v) => v,
        other => panic!("expected a value, got {other:?}"),
    }
}

fn primary(c: &RemoraV1Client) -> u64 {
    handle(c.rm_primary_ctx_retain(&0).unwrap())
}

fn alloc(c: &RemoraV1Client, ctx: u64, size: u64) -> u64 {
    u64v(
        c.rm_mem_alloc(&RmAllocArgs {
            ctx,
            bytesize: size,
        })
        .unwrap(),
    )
}

fn sync(c: &RemoraV1Client, ctx: u64) -> RmSyncReply {
    c.rm_ctx_synchronize(&ctx).unwrap()
}

fn module_image(text: &str) -> (Bytes, [u8; 32]) {
    let image = Bytes::from(text.as_bytes().to_vec());
    let hash: [u8; 32] = Sha256::digest(&image).into();
    (image, hash)
}

fn load(c: &RemoraV1Client, ctx: u64, text: &str) -> RmModule {
    let (image, hash) = module_image(text);
    let mut reply = c
        .rm_module_load(&RmModuleLoadArgs {
            ctx,
            hash,
            image: Bytes::new(),
        })
        .unwrap();
    if reply == RmLoadReply::RmNeedImage {
        reply = c
            .rm_module_load(&RmModuleLoadArgs { ctx, hash, image })
            .unwrap();
    }
    match reply {
        RmLoadReply::RmLoaded(m) => m,
        other => panic!("load failed: {other:?}"),
    }
}

const MODULE: &str = "REMORA-EMU-MODULE\nfunc axpy 4,8,8\nfunc empty\nglobal table 64\n";

#[test]
fn every_procedure_round_trips() {
    let fx = serve(EmulatedConfig::default());
    let c = fx.client();
    c.remora_null().unwrap();

    // Devices.
    assert_eq!(c.rm_device_get_count().unwrap(), RmIntReply::Case0(1));
    let RmDevicePropsReply::Case0(props) = c.rm_device_get_props(&0).unwrap() else {
        panic!()
    };
    assert_eq!(props.name, "Remora emulated device");
    assert!(
        props
            .attributes
            .iter()
            .any(|a| a.attribute == 10 && a.value == 32)
    );
    assert_eq!(
        c.rm_device_get_props(&7).unwrap(),
        RmDevicePropsReply::Default {
            discriminant: INVALID_DEVICE
        }
    );
    assert_eq!(
        c.rm_device_get_attribute(&RmDeviceAttrArgs {
            attribute: 75,
            device: 0
        })
        .unwrap(),
        RmIntReply::Case0(9)
    );
    assert_eq!(
        c.rm_device_get_attribute(&RmDeviceAttrArgs {
            attribute: 75,
            device: 3
        })
        .unwrap(),
        RmIntReply::Default {
            discriminant: INVALID_DEVICE
        }
    );

    // Contexts.
    let ctx = primary(&c);
    assert_eq!(primary(&c), ctx, "a second retain names the same context");
    assert_eq!(c.rm_primary_ctx_release(&0).unwrap(), 0);
    assert_eq!(
        c.rm_primary_ctx_set_flags(&RmPrimaryFlagsArgs {
            device: 0,
            flags: 4
        })
        .unwrap(),
        0
    );
    assert_eq!(
        c.rm_primary_ctx_get_state(&0).unwrap(),
        RmPrimaryStateReply::Case0(RmPrimaryState {
            flags: 4,
            active: 1
        })
    );
    let own = handle(
        c.rm_ctx_create(&RmCtxCreateArgs {
            flags: 0,
            device: 0,
        })
        .unwrap(),
    );
    assert_ne!(own, ctx);
    assert_eq!(c.rm_ctx_destroy(&own).unwrap(), 0);
    assert_eq!(c.rm_ctx_destroy(&own).unwrap(), INVALID_HANDLE);
    assert_eq!(
        c.rm_ctx_destroy(&ctx).unwrap(),
        NEED_CTX,
        "primary: release, not destroy"
    );
    assert_eq!(
        c.rm_ctx_get_stream_priority_range(&ctx).unwrap(),
        RmIntPairReply::Case0(RmIntPair {
            first: 0,
            second: -5
        })
    );
    assert_eq!(
        c.rm_ctx_get_stream_priority_range(&4242).unwrap(),
        RmIntPairReply::Default {
            discriminant: INVALID_HANDLE
        }
    );
    assert_eq!(
        c.rm_ctx_set_limit(&RmLimitArgs {
            ctx,
            limit: 1,
            value: 4096
        })
        .unwrap(),
        0
    );
    assert_eq!(
        c.rm_ctx_get_limit(&RmLimitArgs {
            ctx,
            limit: 1,
            value: 0
        })
        .unwrap(),
        RmU64Reply::Case0(4096)
    );
    assert_eq!(
        c.rm_ctx_get_limit(&RmLimitArgs {
            ctx: 12345,
            limit: 1,
            value: 0
        })
        .unwrap(),
        RmU64Reply::Default {
            discriminant: INVALID_HANDLE
        }
    );
    assert_eq!(sync(&c, ctx).status, 0);
    assert_eq!(sync(&c, 999).status, INVALID_HANDLE);

    // Memory.
    let a = alloc(&c, ctx, 4096);
    let b = alloc(&c, ctx, 4096);
    assert!(a >= 0x2000_0000_0000, "{a:#x}");
    let RmPitchedReply::Case0(pitched) = c
        .rm_mem_alloc_pitch(&RmAllocPitchArgs {
            ctx,
            width_bytes: 100,
            height: 3,
            element_size: 4,
        })
        .unwrap()
    else {
        panic!()
    };
    assert!(pitched.pitch >= 100);
    let RmMemInfoReply::Case0(info) = c.rm_mem_get_info(&ctx).unwrap() else {
        panic!()
    };
    assert_eq!(info.total_bytes, 1 << 30);
    assert!(info.free_bytes < info.total_bytes);
    assert_eq!(
        c.rm_mem_get_address_range(&RmPtrArgs { ctx, ptr: a + 100 })
            .unwrap(),
        RmRangeReply::Case0(RmRange {
            base: a,
            size: 4096
        })
    );
    assert_eq!(
        c.rm_mem_get_address_range(&RmPtrArgs { ctx, ptr: 0x1234 })
            .unwrap(),
        RmRangeReply::Default {
            discriminant: NOT_FOUND
        }
    );
    let data: Vec<u8> = (0..=255).collect();
    let htod = |dst: u64, data: &[u8]| {
        c.rm_memcpy_htod(&RmHtodArgs {
            ctx,
            stream: 0,
            dst,
            data: Bytes::from(data.to_vec()),
        })
        .unwrap()
        .status
    };
    assert_eq!(htod(a + 16, &data), 0);
    assert_eq!(htod(a + 4000, &data), INVALID_VALUE, "past the allocation");
    assert_eq!(htod(0x10, &data), INVALID_VALUE, "not an allocation");
    let dtoh = |src: u64, size: u64| {
        c.rm_memcpy_dtoh(&RmDtohArgs {
            ctx,
            stream: 0,
            src,
            size,
            copy_id: 0,
        })
        .unwrap()
    };
    assert_eq!(dtoh(a + 16, 256), ok_bytes(Bytes::from(data.clone())));
    assert_eq!(dtoh(a + 4090, 16), failed_dtoh(INVALID_VALUE));
    assert_eq!(
        c.rm_memcpy_dtod(&RmDtodArgs {
            ctx,
            stream: 0,
            dst: b,
            src: a + 16,
            size: 256
        })
        .unwrap()
        .status,
        0
    );
    assert_eq!(
        c.rm_memset(&RmMemsetArgs {
            ctx,
            stream: 0,
            dst: b,
            value: 0xabcd_ef01,
            element_size: 2,
            count: 2
        })
        .unwrap()
        .status,
        0
    );
    assert_eq!(
        dtoh(b, 6),
        ok_bytes(Bytes::from_static(&[0x01, 0xef, 0x01, 0xef, 4, 5]))
    );
    assert_eq!(
        c.rm_memset(&RmMemsetArgs {
            ctx,
            stream: 0,
            dst: b,
            value: 0,
            element_size: 3,
            count: 1
        })
        .unwrap()
        .status,
        INVALID_VALUE
    );

    // Streams and events, with the async copies.
    let s = handle(
        c.rm_stream_create(&RmStreamCreateArgs {
            ctx,
            flags: 1,
            priority: 0,
        })
        .unwrap(),
    );
    let e0 = handle(
        c.rm_event_create(&RmHandleFlags {
            handle: ctx,
            flags: 0,
        })
        .unwrap(),
    );
    let e1 = handle(
        c.rm_event_create(&RmHandleFlags {
            handle: ctx,
            flags: 0,
        })
        .unwrap(),
    );
    c.rm_event_record(&RmEventRecordArgs {
        ctx,
        event: e0,
        stream: s,
    })
    .unwrap();
    c.rm_memcpy_htod_async(&RmHtodArgs {
        ctx,
        stream: s,
        dst: b,
        data: Bytes::from_static(b"async!"),
    })
    .unwrap();
    c.rm_memset_async(&RmMemsetArgs {
        ctx,
        stream: s,
        dst: b + 6,
        value: 0x7a,
        element_size: 1,
        count: 2,
    })
    .unwrap();
    c.rm_memcpy_dtod_async(&RmDtodArgs {
        ctx,
        stream: s,
        dst: a,
        src: b,
        size: 8,
    })
    .unwrap();
    c.rm_stream_wait_event(&RmStreamWaitArgs {
        ctx,
        stream: s,
        event: e0,
        flags: 0,
    })
    .unwrap();
    c.rm_memcpy_dtoh_async(&RmDtohArgs {
        ctx,
        stream: s,
        src: a,
        size: 8,
        copy_id: 77,
    })
    .unwrap();
    std::thread::sleep(Duration::from_millis(20));
    c.rm_event_record(&RmEventRecordArgs {
        ctx,
        event: e1,
        stream: s,
    })
    .unwrap();
    assert_eq!(c.rm_event_query(&e1).unwrap().status, 0);
    let r = c
        .rm_stream_synchronize(&RmStreamArgs { ctx, stream: s })
        .unwrap();
    assert_eq!(r.status, 0);
    // The async copy may have been delivered by the event query already.
    assert!(r.copies.is_empty() || r.copies[0].data == Bytes::from_static(b"async!zz"));
    assert_eq!(
        c.rm_stream_query(&RmStreamArgs { ctx, stream: s })
            .unwrap()
            .status,
        0
    );
    assert_eq!(c.rm_event_synchronize(&e1).unwrap().status, 0);
    let RmFloatReply::Case0(ms) = c
        .rm_event_elapsed_time(&RmElapsedArgs { start: e0, end: e1 })
        .unwrap()
    else {
        panic!()
    };
    assert!(ms >= 15.0, "{ms} ms");
    assert_eq!(
        c.rm_event_elapsed_time(&RmElapsedArgs {
            start: e0,
            end: 4242
        })
        .unwrap(),
        RmFloatReply::Default {
            discriminant: INVALID_HANDLE
        }
    );
    assert_eq!(
        c.rm_stream_query(&RmStreamArgs { ctx, stream: 4242 })
            .unwrap()
            .status,
        INVALID_HANDLE
    );
    assert_eq!(c.rm_event_destroy(&e0).unwrap(), 0);
    assert_eq!(c.rm_event_destroy(&e0).unwrap(), INVALID_HANDLE);
    assert_eq!(c.rm_event_destroy(&e1).unwrap(), 0);
    assert_eq!(c.rm_stream_destroy(&s).unwrap(), 0);
    assert_eq!(c.rm_stream_destroy(&s).unwrap(), INVALID_HANDLE);

    // Modules and functions.
    let m = load(&c, ctx, MODULE);
    let names: Vec<&str> = m.functions.iter().map(|f| f.name.as_str()).collect();
    assert_eq!(names, ["axpy", "empty"]);
    assert_eq!(
        m.functions[0].params,
        [
            RmParam { offset: 0, size: 4 },
            RmParam { offset: 8, size: 8 },
            RmParam {
                offset: 16,
                size: 8
            }
        ]
    );
    let f = m.functions[0].function;
    let RmGlobalReply::RmLoaded(g) = c
        .rm_module_get_global(&RmGetGlobalArgs {
            module: m.module,
            name: "table".into(),
        })
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(g.size, 64);
    assert_eq!(htod(g.ptr, &[1; 64]), 0, "globals can be copied to");
    assert_eq!(
        c.rm_module_get_global(&RmGetGlobalArgs {
            module: m.module,
            name: "nope".into(),
        })
        .unwrap(),
        RmGlobalReply::Default {
            discriminant: RmLoadStatus::RmLoadFailed,
            value: NOT_FOUND
        }
    );
    assert_eq!(
        c.rm_func_get_attribute(&RmFuncAttrArgs {
            function: f,
            attribute: 0,
            value: 0
        })
        .unwrap(),
        RmIntReply::Case0(1024)
    );
    assert_eq!(
        c.rm_func_set_attribute(&RmFuncAttrArgs {
            function: f,
            attribute: 8,
            value: 0
        })
        .unwrap(),
        0
    );
    assert_eq!(
        c.rm_func_set_attribute(&RmFuncAttrArgs {
            function: m.module,
            attribute: 8,
            value: 0
        })
        .unwrap(),
        INVALID_HANDLE,
        "a module handle is not a function"
    );
    assert_eq!(
        c.rm_func_set_cache_config(&RmHandleFlags {
            handle: f,
            flags: 1
        })
        .unwrap(),
        0
    );
    assert_eq!(
        c.rm_occupancy_max_active_blocks(&RmOccupancyArgs {
            function: f,
            block_size: 256,
            dynamic_smem_bytes: 0,
            flags: 0
        })
        .unwrap(),
        RmIntReply::Case0(8)
    );
    // Launches are not supported by the emulated backend: the error is deferred.
    let launch = |params: Vec<u8>| RmLaunchArgs {
        ctx,
        function: f,
        grid: RmDim3 { x: 1, y: 1, z: 1 },
        block: RmDim3 { x: 32, y: 1, z: 1 },
        shared_mem_bytes: 0,
        stream: u64::from(RM_STREAM_LEGACY),
        params: Bytes::from(params),
        attrs: vec![],
    };
    c.rm_launch_kernel(&launch(vec![0; 24])).unwrap();
    assert_eq!(sync(&c, ctx).status, NOT_SUPPORTED);
    c.rm_launch_kernel(&launch(vec![0; 23])).unwrap();
    assert_eq!(
        sync(&c, ctx).status,
        INVALID_VALUE,
        "params shorter than the layout"
    );
    assert_eq!(
        sync(&c, ctx).status,
        0,
        "a non-sticky error is reported once"
    );
    assert_eq!(c.rm_module_unload(&m.module).unwrap(), 0);
    assert_eq!(c.rm_module_unload(&m.module).unwrap(), INVALID_HANDLE);
    assert_eq!(
        c.rm_func_get_attribute(&RmFuncAttrArgs {
            function: f,
            attribute: 0,
            value: 0
        })
        .unwrap(),
        RmIntReply::Default {
            discriminant: INVALID_HANDLE
        },
        "functions go with their module"
    );
    assert_eq!(
        htod(g.ptr, &[1; 4]),
        INVALID_VALUE,
        "globals go with their module"
    );

    // Free, then release.
    assert_eq!(c.rm_mem_free(&RmPtrArgs { ctx, ptr: a }).unwrap(), 0);
    assert_eq!(
        c.rm_mem_free(&RmPtrArgs { ctx, ptr: a }).unwrap(),
        INVALID_VALUE
    );
    assert_eq!(
        c.rm_mem_free(&RmPtrArgs { ctx, ptr: b + 8 }).unwrap(),
        INVALID_VALUE
    );
    assert_eq!(c.rm_primary_ctx_reset(&0).unwrap(), 0);
    assert_eq!(c.rm_primary_ctx_release(&0).unwrap(), NEED_CTX);
    assert_eq!(
        fx.backend.live(),
        LiveCounts::default(),
        "reset freed everything"
    );
}

#[test]
fn async_device_to_host_copies_arrive_at_the_synchronizing_call() {
    let fx = serve(EmulatedConfig::default());
    let c = fx.client();
    let ctx = primary(&c);
    let a = alloc(&c, ctx, 64);
    let s = handle(
        c.rm_stream_create(&RmStreamCreateArgs {
            ctx,
            flags: 0,
            priority: 0,
        })
        .unwrap(),
    );
    c.rm_memcpy_htod_async(&RmHtodArgs {
        ctx,
        stream: s,
        dst: a,
        data: Bytes::from_static(b"0123456789"),
    })
    .unwrap();
    for (id, off) in [(1u64, 0u64), (2, 5)] {
        c.rm_memcpy_dtoh_async(&RmDtohArgs {
            ctx,
            stream: s,
            src: a + off,
            size: 5,
            copy_id: id,
        })
        .unwrap();
    }
    let r = c
        .rm_stream_synchronize(&RmStreamArgs { ctx, stream: s })
        .unwrap();
    assert_eq!(r.status, 0);
    let got: Vec<(u64, &[u8])> = r.copies.iter().map(|c| (c.copy_id, &c.data[..])).collect();
    assert_eq!(got, [(1, &b"01234"[..]), (2, &b"56789"[..])]);
    assert!(
        sync(&c, ctx).copies.is_empty(),
        "each copy is delivered once"
    );
    // A copy on the legacy stream comes with a context synchronize.
    c.rm_memcpy_dtoh_async(&RmDtohArgs {
        ctx,
        stream: 0,
        src: a,
        size: 2,
        copy_id: 9,
    })
    .unwrap();
    let r = sync(&c, ctx);
    assert_eq!(r.copies.len(), 1);
    assert_eq!(
        (r.copies[0].copy_id, &r.copies[0].data[..]),
        (9, &b"01"[..])
    );
    // A copy that cannot be issued (past the allocation) is delivered empty with its error,
    // so that the client never waits for data that will not come.
    c.rm_memcpy_dtoh_async(&RmDtohArgs {
        ctx,
        stream: s,
        src: a + 60,
        size: 8,
        copy_id: 10,
    })
    .unwrap();
    let r = c
        .rm_stream_synchronize(&RmStreamArgs { ctx, stream: s })
        .unwrap();
    assert_eq!(r.status, INVALID_VALUE);
    let got: Vec<(u64, usize)> = r.copies.iter().map(|c| (c.copy_id, c.data.len())).collect();
    assert_eq!(got, [(10, 0)]);
}

#[test]
fn deferred_errors_surface_at_the_next_synchronizing_call() {
    let fx = serve(EmulatedConfig::default());
    let c = fx.client();
    let ctx = primary(&c);
    let a = alloc(&c, ctx, 64);
    // Out of bounds, then a bad stream: the first error wins.
    c.rm_memset_async(&RmMemsetArgs {
        ctx,
        stream: 0,
        dst: a + 60,
        value: 0,
        element_size: 4,
        count: 2,
    })
    .unwrap();
    c.rm_memcpy_htod_async(&RmHtodArgs {
        ctx,
        stream: 999,
        dst: a,
        data: Bytes::from_static(b"x"),
    })
    .unwrap();
    // A later synchronous memcpy reports it even though it succeeds itself.
    let r = c
        .rm_memcpy_htod(&RmHtodArgs {
            ctx,
            stream: 0,
            dst: a,
            data: Bytes::from_static(b"ok"),
        })
        .unwrap();
    assert_eq!(r.status, INVALID_VALUE);
    assert_eq!(sync(&c, ctx).status, 0, "reported once");
    c.rm_event_record(&RmEventRecordArgs {
        ctx,
        event: 31337,
        stream: 0,
    })
    .unwrap();
    assert_eq!(
        c.rm_memcpy_dtoh(&RmDtohArgs {
            ctx,
            stream: 0,
            src: a,
            size: 2,
            copy_id: 0
        })
        .unwrap(),
        failed_dtoh(INVALID_HANDLE)
    );
    assert_eq!(
        c.rm_stream_query(&RmStreamArgs { ctx, stream: 0 })
            .unwrap()
            .status,
        0
    );
}

#[test]
fn sessions_cannot_name_each_others_objects() {
    let fx = serve(EmulatedConfig::default());
    let (c1, c2) = (fx.client(), fx.client());
    let ctx1 = primary(&c1);
    let a1 = alloc(&c1, ctx1, 64);
    let s1 = handle(
        c1.rm_stream_create(&RmStreamCreateArgs {
            ctx: ctx1,
            flags: 0,
            priority: 0,
        })
        .unwrap(),
    );
    // Session 2 has no context yet: session 1's handles are unknown to it.
    assert_eq!(sync(&c2, ctx1).status, INVALID_HANDLE);
    assert_eq!(c2.rm_stream_destroy(&s1).unwrap(), INVALID_HANDLE);
    let ctx2 = primary(&c2);
    // Even with a context of its own, session 1's memory is not reachable.
    let r = c2
        .rm_memcpy_dtoh(&RmDtohArgs {
            ctx: ctx2,
            stream: 0,
            src: a1,
            size: 8,
            copy_id: 0,
        })
        .unwrap();
    assert_eq!(r, failed_dtoh(INVALID_VALUE));
    assert_eq!(
        c2.rm_mem_free(&RmPtrArgs { ctx: ctx2, ptr: a1 }).unwrap(),
        INVALID_VALUE
    );
    assert_eq!(
        c1.rm_stream_query(&RmStreamArgs {
            ctx: ctx1,
            stream: s1
        })
        .unwrap()
        .status,
        0
    );
}

#[test]
fn a_dropped_connection_frees_everything_it_owned() {
    let fx = serve(EmulatedConfig::default());
    {
        let c = fx.client();
        let ctx = primary(&c);
        primary(&c);
        let own = handle(
            c.rm_ctx_create(&RmCtxCreateArgs {
                flags: 0,
                device: 0,
            })
            .unwrap(),
        );
        for _ in 0..3 {
            alloc(&c, ctx, 1024);
        }
        alloc(&c, own, 1024);
        c.rm_stream_create(&RmStreamCreateArgs {
            ctx: own,
            flags: 0,
            priority: 0,
        })
        .unwrap();
        c.rm_event_create(&RmHandleFlags {
            handle: ctx,
            flags: 0,
        })
        .unwrap();
        load(&c, ctx, MODULE);
        let a = alloc(&c, ctx, 16);
        c.rm_memcpy_dtoh_async(&RmDtohArgs {
            ctx,
            stream: 0,
            src: a,
            size: 16,
            copy_id: 5,
        })
        .unwrap();
        c.rm_device_get_count().unwrap();
        assert_eq!(
            fx.backend.live(),
            LiveCounts {
                allocations: 5,
                contexts: 2,
                modules: 1,
                streams: 1,
                events: 1,
                ..LiveCounts::default()
            }
        );
        assert_eq!(fx.running.executor().unwrap().session_count(), 1);
        // Dropped without releasing anything.
    }
    fx.wait_for_sessions(0);
    assert_eq!(fx.backend.live(), LiveCounts::default());
}

#[test]
fn a_blocking_synchronize_does_not_stall_other_client_threads() {
    let fx = serve(EmulatedConfig {
        sync_delay: Duration::from_millis(1500),
        ..EmulatedConfig::default()
    });
    let c = Arc::new(fx.client());
    let ctx = primary(&c);
    let started = Instant::now();
    let blocked = {
        let c = Arc::clone(&c);
        std::thread::spawn(move || {
            let r = sync(&c, ctx);
            (r.status, started.elapsed())
        })
    };
    std::thread::sleep(Duration::from_millis(100));
    let mut last = Duration::ZERO;
    for _ in 0..20 {
        let a = alloc(&c, ctx, 256);
        assert_eq!(c.rm_mem_free(&RmPtrArgs { ctx, ptr: a }).unwrap(), 0);
        last = started.elapsed();
    }
    assert!(
        last < Duration::from_millis(1200),
        "other calls waited for the synchronize ({last:?})"
    );
    let (status, took) = blocked.join().unwrap();
    assert_eq!(status, 0);
    assert!(took >= Duration::from_millis(1500), "{took:?}");
}

#[test]
fn the_module_cache_serves_a_second_load_by_hash() {
    let fx = serve(EmulatedConfig::default());
    let (image, hash) = module_image(MODULE);
    let c1 = fx.client();
    let ctx1 = primary(&c1);
    let empty = |ctx| RmModuleLoadArgs {
        ctx,
        hash,
        image: Bytes::new(),
    };
    assert_eq!(
        c1.rm_module_load(&empty(ctx1)).unwrap(),
        RmLoadReply::RmNeedImage
    );
    // A wrong hash is refused and not cached.
    let mut bad = hash;
    bad[0] ^= 1;
    assert_eq!(
        c1.rm_module_load(&RmModuleLoadArgs {
            ctx: ctx1,
            hash: bad,
            image: image.clone()
        })
        .unwrap(),
        RmLoadReply::RmLoadFailed(INVALID_VALUE)
    );
    assert_eq!(fx.running.executor().unwrap().cached_modules(), 0);
    let RmLoadReply::RmLoaded(_) = c1
        .rm_module_load(&RmModuleLoadArgs {
            ctx: ctx1,
            hash,
            image,
        })
        .unwrap()
    else {
        panic!()
    };
    // Another session loads it by hash alone.
    let c2 = fx.client();
    let ctx2 = primary(&c2);
    let RmLoadReply::RmLoaded(m) = c2.rm_module_load(&empty(ctx2)).unwrap() else {
        panic!("the cached image was not used")
    };
    assert_eq!(m.functions.len(), 2);
    assert_eq!(
        c2.rm_module_load(&empty(4242)).unwrap(),
        RmLoadReply::RmLoadFailed(INVALID_HANDLE)
    );
}

#[test]
fn the_real_driver_backend_without_a_gpu() {
    // The real path needs a GPU; on machines without one the backend must still answer.
    match remora_server::CudaBackend::load(None) {
        Ok(b) if b.device_count().unwrap_or(0) > 0 => {
            println!("a GPU is present: the real path is covered by the GPU test suite");
        }
        _ => {
            println!("SKIPPED: no CUDA driver or GPU here; checking the no-device answers");
            let b = remora_server::CudaBackend::unavailable();
            assert_eq!(b.device_count(), Ok(0));
            assert_eq!(b.mem_alloc(0, 16), Err(remora_proto::cuda::CuError(100)));
        }
    }
}

#[test]
fn each_session_has_a_primary_context_of_its_own() {
    let fx = serve(EmulatedConfig::default());
    let (c1, c2) = (fx.client(), fx.client());
    let ctx1 = primary(&c1);
    let ctx2 = primary(&c2);
    assert_eq!(
        fx.backend.live().contexts,
        2,
        "two sessions, two real contexts: a sticky error in one cannot reach the other"
    );
    // State and flags are the session's.
    assert_eq!(
        c2.rm_primary_ctx_set_flags(&RmPrimaryFlagsArgs {
            device: 0,
            flags: 4
        })
        .unwrap(),
        0
    );
    assert_eq!(
        c1.rm_primary_ctx_get_state(&0).unwrap(),
        RmPrimaryStateReply::Case0(RmPrimaryState {
            flags: 0,
            active: 1
        })
    );
    let fresh = fx.client();
    assert_eq!(
        fresh.rm_primary_ctx_get_state(&0).unwrap(),
        RmPrimaryStateReply::Case0(RmPrimaryState {
            flags: 0,
            active: 0
        })
    );
    assert_eq!(
        fresh
            .rm_primary_ctx_set_flags(&RmPrimaryFlagsArgs {
                device: 7,
                flags: 0
            })
            .unwrap(),
        INVALID_DEVICE
    );
    // Reset destroys session 1's context (and its memory); the next retain gets a new one.
    let a = alloc(&c1, ctx1, 64);
    assert_eq!(c1.rm_primary_ctx_reset(&0).unwrap(), 0);
    assert_eq!(fx.backend.live().contexts, 1);
    assert_eq!(fx.backend.live().allocations, 0);
    assert_eq!(
        sync(&c1, ctx1).status,
        709,
        "the old handle answers CUDA_ERROR_CONTEXT_IS_DESTROYED, as a reset primary context does"
    );
    let again = primary(&c1);
    assert_ne!(again, ctx1);
    assert_eq!(
        c1.rm_mem_free(&RmPtrArgs { ctx: again, ptr: a }).unwrap(),
        INVALID_VALUE
    );
    // Session 2 never noticed.
    assert_eq!(sync(&c2, ctx2).status, 0);
    // Retains are counted per session: the context goes at zero.
    primary(&c2);
    assert_eq!(c2.rm_primary_ctx_release(&0).unwrap(), 0);
    assert_eq!(fx.backend.live().contexts, 2);
    assert_eq!(c2.rm_primary_ctx_release(&0).unwrap(), 0);
    assert_eq!(fx.backend.live().contexts, 1);
    assert_eq!(c2.rm_primary_ctx_release(&0).unwrap(), NEED_CTX);
}

#[test]
fn stream_calls_use_the_context_they_name() {
    let fx = serve(EmulatedConfig::default());
    let c = fx.client();
    let ctx = primary(&c);
    let own = handle(
        c.rm_ctx_create(&RmCtxCreateArgs {
            flags: 0,
            device: 0,
        })
        .unwrap(),
    );
    let a = alloc(&c, own, 16);
    c.rm_memcpy_htod_async(&RmHtodArgs {
        ctx: own,
        stream: 0,
        dst: a,
        data: Bytes::from_static(b"legacy"),
    })
    .unwrap();
    c.rm_memcpy_dtoh_async(&RmDtohArgs {
        ctx: own,
        stream: u64::from(RM_STREAM_LEGACY),
        src: a,
        size: 6,
        copy_id: 3,
    })
    .unwrap();
    // A synchronous D2H copy in `own` delivers the async copy queued before it.
    let r = c
        .rm_memcpy_dtoh(&RmDtohArgs {
            ctx: own,
            stream: 0,
            src: a,
            size: 3,
            copy_id: 0,
        })
        .unwrap();
    assert_eq!(r.status, 0);
    assert_eq!(&r.data[..], b"leg");
    let got: Vec<(u64, &[u8])> = r.copies.iter().map(|c| (c.copy_id, &c.data[..])).collect();
    assert_eq!(got, [(3, &b"legacy"[..])]);
    // Legacy-stream calls need a context.
    assert_eq!(
        c.rm_stream_query(&RmStreamArgs { ctx: 0, stream: 0 })
            .unwrap()
            .status,
        NEED_CTX
    );
    assert_eq!(
        c.rm_stream_query(&RmStreamArgs { ctx, stream: 0 })
            .unwrap()
            .status,
        0
    );
    // Events and stream waits on the legacy stream of the named context.
    let e = handle(
        c.rm_event_create(&RmHandleFlags {
            handle: own,
            flags: 0,
        })
        .unwrap(),
    );
    c.rm_event_record(&RmEventRecordArgs {
        ctx: own,
        event: e,
        stream: 0,
    })
    .unwrap();
    c.rm_stream_wait_event(&RmStreamWaitArgs {
        ctx: own,
        stream: u64::from(RM_STREAM_LEGACY),
        event: e,
        flags: 0,
    })
    .unwrap();
    assert_eq!(
        c.rm_stream_synchronize(&RmStreamArgs {
            ctx: own,
            stream: 0
        })
        .unwrap()
        .status,
        0
    );
    // A failed synchronous D2H copy carries no data but still reports deferred errors.
    c.rm_event_record(&RmEventRecordArgs {
        ctx: own,
        event: 4242,
        stream: 0,
    })
    .unwrap();
    let r = c
        .rm_memcpy_dtoh(&RmDtohArgs {
            ctx: own,
            stream: 0,
            src: a,
            size: 3,
            copy_id: 0,
        })
        .unwrap();
    assert_eq!(r, failed_dtoh(INVALID_HANDLE));
}

#[test]
fn occupancy_of_clusters_and_potential_block_size() {
    let fx = serve(EmulatedConfig::default());
    let c = fx.client();
    let ctx = primary(&c);
    let m = load(&c, ctx, MODULE);
    let f = m.functions[1].function;
    let launch = |function: u64, cluster: u32| RmLaunchArgs {
        ctx,
        function,
        grid: RmDim3 { x: 8, y: 1, z: 1 },
        block: RmDim3 { x: 128, y: 1, z: 1 },
        shared_mem_bytes: 0,
        stream: 0,
        params: Bytes::new(),
        attrs: vec![RmLaunchAttr::RmLaunchClusterDimension(RmDim3 {
            x: cluster,
            y: 1,
            z: 1,
        })],
    };
    let RmIntReply::Case0(one) = c.rm_occupancy_max_active_clusters(&launch(f, 1)).unwrap() else {
        panic!()
    };
    let RmIntReply::Case0(two) = c.rm_occupancy_max_active_clusters(&launch(f, 2)).unwrap() else {
        panic!()
    };
    assert!(one > 0 && two > 0 && two <= one, "{one} {two}");
    assert_eq!(
        c.rm_occupancy_max_active_clusters(&launch(4242, 1))
            .unwrap(),
        RmIntReply::Default {
            discriminant: INVALID_HANDLE
        }
    );
    let RmIntPairReply::Case0(p) = c
        .rm_occupancy_max_potential_block_size(&RmPotentialBlockArgs {
            function: f,
            dynamic_smem_bytes: 0,
            block_size_limit: 256,
            flags: 0,
        })
        .unwrap()
    else {
        panic!()
    };
    assert_eq!(p.second, 256);
    assert!(p.first > 0);
    assert_eq!(
        c.rm_occupancy_max_potential_block_size(&RmPotentialBlockArgs {
            function: 4242,
            dynamic_smem_bytes: 0,
            block_size_limit: 0,
            flags: 0,
        })
        .unwrap(),
        RmIntPairReply::Default {
            discriminant: INVALID_HANDLE
        }
    );
}

/// `RM_TOOLS_CTX_QUERY` runs private driver entry points for a client: served by default
/// (the emulated device answers 0), refused with CUDA_ERROR_NOT_SUPPORTED under
/// `remora serve --no-private-driver-calls`; other calls are unaffected.
#[test]
fn private_driver_calls_can_be_refused() {
    for refuse in [false, true] {
        let f = serve_with(
            EmulatedConfig::default(),
            ServeConfig {
                no_private_driver_calls: refuse,
                ..ServeConfig::default()
            },
        );
        let c = f.client();
        let ctx = handle(c.rm_primary_ctx_retain(&0).unwrap());
        let reply = c
            .rm_tools_ctx_query(&RmToolsCtxQueryArgs {
                ctx,
                mask: 0x7fff_fffe_ffff,
                flag: 1,
            })
            .unwrap();
        if refuse {
            assert_eq!(
                reply,
                RmU64Reply::Default {
                    discriminant: NOT_SUPPORTED
                }
            );
        } else {
            assert_eq!(reply, RmU64Reply::Case0(0));
        }
        assert!(matches!(
            c.rm_ctx_get_stream_priority_range(&ctx).unwrap(),
            RmIntPairReply::Case0(_)
        ));
    }
}
