//! Stream-ordered allocation and memory pools end to end (revision 10): client `Session` →
//! executor → EMULATED backend. Allocations are session ranges (copies into them are checked),
//! pools are session handles (the default pool one handle, never destroyed), attributes and
//! trimming reach the backend, and a session's allocations and pools go when it ends.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use common::{LEGACY, SERIAL, pattern};
use remora_client::proto::{RmPoolAccess, RmPoolLocation, RmPoolProps};
use remora_client::{CuError, Session, SessionConfig, cu};
use remora_oncrpc::{Endpoint, TransportChoice};
use remora_server::{
    Backend, EmulatedBackend, EmulatedConfig, Running, ServeConfig, inventory_of,
    start_with_backend,
};

const REUSE_FOLLOW_EVENT_DEPENDENCIES: i32 = 1;
const RELEASE_THRESHOLD: i32 = 4;
const RESERVED_MEM_CURRENT: i32 = 5;
const RESERVED_MEM_HIGH: i32 = 6;
const USED_MEM_CURRENT: i32 = 7;
const USED_MEM_HIGH: i32 = 8;
const PROT_READWRITE: i32 = 3;

struct Fixture {
    _dir: tempfile::TempDir,
    running: Option<Running>,
    backend: Arc<EmulatedBackend>,
    endpoint: Endpoint,
}

impl Drop for Fixture {
    fn drop(&mut self) {
        if let Some(r) = self.running.take() {
            r.shutdown();
        }
    }
}

fn serve() -> Fixture {
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
    Fixture {
        _dir: dir,
        running: Some(running),
        backend,
        endpoint,
    }
}

impl Fixture {
    fn session(&self) -> Session {
        Session::connect_with(
            &self.endpoint,
            SessionConfig {
                transport: TransportChoice::Unix,
                ..SessionConfig::default()
            },
        )
        .unwrap()
    }

    fn wait_for_sessions(&self, n: usize) {
        let executor = self.running.as_ref().and_then(Running::executor).unwrap();
        let deadline = Instant::now() + Duration::from_secs(10);
        while executor.session_count() != n {
            assert!(Instant::now() < deadline, "sessions never reached {n}");
            std::thread::sleep(Duration::from_millis(10));
        }
    }
}

fn device_props() -> RmPoolProps {
    RmPoolProps {
        alloc_type: 1,
        handle_types: 0,
        location: RmPoolLocation { kind: 1, id: 0 },
        max_size: 0,
        usage: 0,
    }
}

#[test]
fn stream_ordered_allocations_are_checked_session_ranges() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let fx = serve();
    let s = fx.session();
    let ctx = s.primary_ctx_retain(0).unwrap();
    let stream = s.stream_create(ctx, 1, 0).unwrap();
    let p = s.mem_alloc_async(ctx, stream, 4096, 0).unwrap();
    let data = pattern(4096, 7);
    s.memcpy_htod_async(ctx, stream, p, &data).unwrap();
    let mut back = vec![0u8; 4096];
    s.stream_synchronize(ctx, stream).unwrap();
    s.memcpy_dtoh(ctx, LEGACY, p, &mut back).unwrap();
    assert_eq!(back, data);
    assert_eq!(
        s.memcpy_htod(ctx, LEGACY, p + 4090, &[0; 16]),
        Err(CuError(cu::INVALID_VALUE)),
        "a copy past the allocation is refused"
    );
    // The default pool: one handle, also the current pool, and it counts the allocation.
    let dp = s.device_get_default_mem_pool(0).unwrap();
    assert_eq!(s.device_get_default_mem_pool(0), Ok(dp));
    assert_eq!(s.device_get_mem_pool(0), Ok(dp));
    assert_eq!(s.mem_pool_get_attribute(dp, USED_MEM_CURRENT), Ok(4096));
    assert!(s.mem_pool_get_attribute(dp, RESERVED_MEM_CURRENT).unwrap() >= 4096);
    assert_eq!(
        s.mem_pool_destroy(dp),
        Err(CuError(cu::INVALID_VALUE)),
        "the default pool cannot be destroyed"
    );
    s.mem_free_async(ctx, stream, p).unwrap();
    assert_eq!(
        s.mem_free_async(ctx, stream, p),
        Err(CuError(cu::INVALID_VALUE)),
        "freed twice"
    );
    assert_eq!(
        s.memcpy_htod(ctx, LEGACY, p, &[0; 16]),
        Err(CuError(cu::INVALID_VALUE)),
        "a freed allocation is no longer a range of the session"
    );
    assert_eq!(s.mem_pool_get_attribute(dp, USED_MEM_CURRENT), Ok(0));
    assert_eq!(
        s.mem_pool_get_attribute(dp, RESERVED_MEM_CURRENT),
        Ok(0),
        "release threshold 0: the pool keeps nothing"
    );
    // cuMemFreeAsync takes only stream-ordered allocations; cuMemFree takes both.
    let plain = s.mem_alloc(ctx, 256).unwrap();
    assert_eq!(
        s.mem_free_async(ctx, LEGACY, plain),
        Err(CuError(cu::INVALID_VALUE))
    );
    s.mem_free(ctx, plain).unwrap();
    let q = s.mem_alloc_async(ctx, LEGACY, 512, 0).unwrap();
    s.mem_free(ctx, q).unwrap();
    assert_eq!(s.mem_pool_get_attribute(dp, USED_MEM_CURRENT), Ok(0));
    assert_eq!(fx.backend.live().allocations, 0);
    assert_eq!(
        s.mem_pool_get_attribute(0xdead, USED_MEM_CURRENT),
        Err(CuError(cu::INVALID_HANDLE))
    );
    assert_eq!(
        s.mem_pool_get_attribute(stream, USED_MEM_CURRENT),
        Err(CuError(cu::INVALID_HANDLE)),
        "a stream handle is not a pool"
    );
}

#[test]
fn created_pools_keep_attributes_reuse_memory_and_trim() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let fx = serve();
    let s = fx.session();
    let ctx = s.primary_ctx_retain(0).unwrap();
    let pool = s.mem_pool_create(&device_props()).unwrap();
    assert_eq!(
        s.mem_pool_get_attribute(pool, REUSE_FOLLOW_EVENT_DEPENDENCIES),
        Ok(1)
    );
    s.mem_pool_set_attribute(pool, REUSE_FOLLOW_EVENT_DEPENDENCIES, 0)
        .unwrap();
    assert_eq!(
        s.mem_pool_get_attribute(pool, REUSE_FOLLOW_EVENT_DEPENDENCIES),
        Ok(0)
    );
    s.mem_pool_set_attribute(pool, RELEASE_THRESHOLD, u64::MAX)
        .unwrap();
    assert_eq!(
        s.mem_pool_get_attribute(pool, RELEASE_THRESHOLD),
        Ok(u64::MAX)
    );
    const K: u64 = 64 << 10;
    let a: Vec<u64> = (0..3)
        .map(|_| s.mem_alloc_async(ctx, LEGACY, K, pool).unwrap())
        .collect();
    assert_eq!(s.mem_pool_get_attribute(pool, USED_MEM_CURRENT), Ok(3 * K));
    assert_eq!(
        s.mem_pool_get_attribute(pool, RESERVED_MEM_CURRENT),
        Ok(3 * K)
    );
    s.mem_free_async(ctx, LEGACY, a[0]).unwrap();
    s.mem_free_async(ctx, LEGACY, a[1]).unwrap();
    assert_eq!(s.mem_pool_get_attribute(pool, USED_MEM_CURRENT), Ok(K));
    assert_eq!(
        s.mem_pool_get_attribute(pool, RESERVED_MEM_CURRENT),
        Ok(3 * K),
        "under the release threshold the pool keeps its memory"
    );
    assert_eq!(s.mem_pool_get_attribute(pool, USED_MEM_HIGH), Ok(3 * K));
    s.mem_pool_set_attribute(pool, USED_MEM_HIGH, 0).unwrap();
    assert_eq!(s.mem_pool_get_attribute(pool, USED_MEM_HIGH), Ok(K));
    assert_eq!(
        s.mem_pool_set_attribute(pool, USED_MEM_HIGH, 5),
        Err(CuError(cu::INVALID_VALUE)),
        "a high-water mark can only be reset"
    );
    assert_eq!(
        s.mem_pool_set_attribute(pool, RESERVED_MEM_CURRENT, 0),
        Err(CuError(cu::INVALID_VALUE)),
        "read only"
    );
    assert_eq!(s.mem_pool_get_attribute(pool, RESERVED_MEM_HIGH), Ok(3 * K));
    // A new allocation reuses the cached memory.
    let b = s.mem_alloc_async(ctx, LEGACY, K, pool).unwrap();
    assert_eq!(
        s.mem_pool_get_attribute(pool, RESERVED_MEM_CURRENT),
        Ok(3 * K)
    );
    assert_eq!(s.mem_pool_get_attribute(pool, USED_MEM_CURRENT), Ok(2 * K));
    // Trimming gives back the cache, never what is in use.
    s.mem_pool_trim_to(pool, 0).unwrap();
    assert_eq!(
        s.mem_pool_get_attribute(pool, RESERVED_MEM_CURRENT),
        Ok(2 * K)
    );
    // Copies into a pool's allocation work like any other.
    let data = pattern(K as usize, 3);
    s.memcpy_htod(ctx, LEGACY, b, &data).unwrap();
    let mut back = vec![0u8; K as usize];
    s.memcpy_dtoh(ctx, LEGACY, b, &mut back).unwrap();
    assert_eq!(back, data);
    // Access: the pool's own device reads and writes.
    s.mem_pool_set_access(
        pool,
        &[RmPoolAccess {
            location: RmPoolLocation { kind: 1, id: 0 },
            flags: PROT_READWRITE,
        }],
    )
    .unwrap();
    assert_eq!(
        s.mem_pool_get_access(pool, RmPoolLocation { kind: 1, id: 0 }),
        Ok(PROT_READWRITE)
    );
    assert_eq!(
        s.mem_pool_get_access(pool, RmPoolLocation { kind: 1, id: 9 }),
        Err(CuError(cu::INVALID_VALUE))
    );
    // The device's current pool: cuMemAllocAsync takes from it.
    s.device_set_mem_pool(0, pool).unwrap();
    assert_eq!(s.device_get_mem_pool(0), Ok(pool));
    let c = s.mem_alloc_async(ctx, LEGACY, K, 0).unwrap();
    assert_eq!(s.mem_pool_get_attribute(pool, USED_MEM_CURRENT), Ok(3 * K));
    // Destroying it (allocations still out) makes the default pool current again; the
    // allocations stay usable until freed.
    s.mem_pool_destroy(pool).unwrap();
    let dp = s.device_get_default_mem_pool(0).unwrap();
    assert_eq!(s.device_get_mem_pool(0), Ok(dp));
    assert_eq!(
        s.mem_pool_get_attribute(pool, USED_MEM_CURRENT),
        Err(CuError(cu::INVALID_HANDLE))
    );
    s.memcpy_htod(ctx, LEGACY, c, &data).unwrap();
    for p in [a[2], b, c] {
        s.mem_free_async(ctx, LEGACY, p).unwrap();
    }
    // One-way frees (revision 21): made once the stream gets there.
    s.stream_synchronize(ctx, LEGACY).unwrap();
    assert_eq!(fx.backend.live().allocations, 0);
    assert_eq!(fx.backend.live_pools(), 0);
    // Shareable handles (IPC) are refused.
    assert_eq!(
        s.mem_pool_create(&RmPoolProps {
            handle_types: 1,
            ..device_props()
        }),
        Err(CuError(cu::NOT_SUPPORTED))
    );
}

#[test]
fn a_session_end_frees_its_allocations_then_its_pools() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let fx = serve();
    {
        let s = fx.session();
        let ctx = s.primary_ctx_retain(0).unwrap();
        let other = s.ctx_create(0, 0).unwrap();
        let stream = s.stream_create(ctx, 0, 0).unwrap();
        let pool = s.mem_pool_create(&device_props()).unwrap();
        s.mem_pool_set_attribute(pool, RELEASE_THRESHOLD, u64::MAX)
            .unwrap();
        s.device_set_mem_pool(0, pool).unwrap();
        s.mem_alloc_async(ctx, stream, 1000, 0).unwrap();
        s.mem_alloc_async(ctx, LEGACY, 3000, pool).unwrap();
        s.mem_alloc_async(other, LEGACY, 5000, pool).unwrap();
        let freed = s.mem_alloc_async(other, LEGACY, 7000, pool).unwrap();
        s.mem_free_async(other, LEGACY, freed).unwrap();
        // A context destroyed with allocations still out frees them first.
        s.ctx_destroy(other).unwrap();
        assert_eq!(fx.backend.live().allocations, 2);
        assert_eq!(fx.backend.live_pools(), 1);
        // Dropped without freeing anything.
    }
    fx.wait_for_sessions(0);
    let live = fx.backend.live();
    assert_eq!(live.allocations, 0, "{live:?}");
    assert_eq!(live.contexts, 0, "{live:?}");
    assert_eq!(fx.backend.live_pools(), 0);
    // The device's current pool is its default again.
    let s = fx.session();
    assert_eq!(
        s.device_get_mem_pool(0),
        Ok(s.device_get_default_mem_pool(0).unwrap())
    );
}

/// `RM_MEM_FREE_ASYNC_ONEWAY` (revision 21) from a hand-made client: the free is made in
/// order with the calls after it, and a failed one's error comes with the next synchronize.
#[test]
fn a_one_way_free_is_ordered_and_its_error_is_deferred() {
    use remora_client::proto::*;
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let fx = serve();
    let rpc = remora_oncrpc::Client::connect_with(
        &fx.endpoint,
        remora_oncrpc::ClientConfig {
            transport: TransportChoice::Unix,
            ..remora_oncrpc::ClientConfig::default()
        },
    )
    .unwrap();
    let c = RemoraV1Client::new(rpc);
    let hello = c
        .remora_hello(&HelloArgs {
            min_revision: 21,
            max_revision: REMORA_PROTOCOL_REVISION,
            client_name: "one-way free".into(),
            capabilities: u64::from(REMORA_CAP_ONEWAY),
        })
        .unwrap();
    assert!(matches!(hello, HelloReply::True(_)), "{hello:?}");
    let RmHandleReply::Case0(ctx) = c.rm_primary_ctx_retain(&0).unwrap() else {
        panic!("no context")
    };
    let RmU64Reply::Case0(p) = c
        .rm_mem_alloc_async(&RmAllocAsyncArgs {
            ctx,
            stream: LEGACY,
            bytesize: 4096,
            pool: 0,
        })
        .unwrap()
    else {
        panic!("no allocation")
    };
    let RmHandleReply::Case0(dp) = c.rm_device_get_default_mem_pool(&0).unwrap() else {
        panic!("no default pool")
    };
    let used = |c: &RemoraV1Client| {
        let r = c
            .rm_mem_pool_get_attribute(&RmPoolAttrArgs {
                pool: dp,
                attribute: USED_MEM_CURRENT,
                value: 0,
            })
            .unwrap();
        let RmU64Reply::Case0(v) = r else {
            panic!("{r:?}")
        };
        v
    };
    assert_eq!(used(&c), 4096);
    let free = RmFreeAsyncArgs {
        ctx,
        stream: LEGACY,
        ptr: p,
    };
    c.rm_mem_free_async_oneway(&free).unwrap();
    // The next call (synchronous, no synchronize between) sees the free made.
    assert_eq!(used(&c), 0);
    assert_eq!(fx.backend.live().allocations, 0);
    // The status of a synchronize of the legacy stream.
    let sync = |c: &RemoraV1Client| {
        c.rm_stream_synchronize(&RmStreamArgs {
            ctx,
            stream: LEGACY,
        })
        .unwrap()
        .status
    };
    assert_eq!(sync(&c), 0, "nothing failed");
    // Freed twice: no answer now, the error at the next synchronize, then cleared.
    c.rm_mem_free_async_oneway(&free).unwrap();
    assert_eq!(sync(&c), cu::INVALID_VALUE, "the second free's error");
    assert_eq!(sync(&c), 0, "reported once");
}

/// Through the client: live stream-ordered allocations are freed one-way (their frees still
/// ordered), anything else waits for the server's verdict.
#[test]
fn the_client_frees_live_stream_allocations_one_way_and_others_with_a_verdict() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let fx = serve();
    let s = fx.session();
    let ctx = s.primary_ctx_retain(0).unwrap();
    let stream = s.stream_create(ctx, 1, 0).unwrap();
    let dp = s.device_get_default_mem_pool(0).unwrap();
    let ptrs: Vec<u64> = (0..8)
        .map(|i| s.mem_alloc_async(ctx, stream, 4096 << i, 0).unwrap())
        .collect();
    for (i, &p) in ptrs.iter().enumerate() {
        let data = pattern(64, i as u32);
        s.memcpy_htod_async(ctx, stream, p, &data).unwrap();
        s.mem_free_async(ctx, stream, p).unwrap();
    }
    // Made, in order, before the next synchronous call.
    assert_eq!(s.mem_pool_get_attribute(dp, USED_MEM_CURRENT), Ok(0));
    assert_eq!(fx.backend.live().allocations, 0);
    s.stream_synchronize(ctx, stream).unwrap();
    // A pointer no longer live is asked about, and refused at once.
    assert_eq!(
        s.mem_free_async(ctx, stream, ptrs[0]),
        Err(CuError(cu::INVALID_VALUE)),
        "freed twice"
    );
    let plain = s.mem_alloc(ctx, 256).unwrap();
    assert_eq!(
        s.mem_free_async(ctx, LEGACY, plain),
        Err(CuError(cu::INVALID_VALUE)),
        "not a stream-ordered allocation"
    );
    s.mem_free(ctx, plain).unwrap();
    // Freed with cuMemFree, an allocation is no longer live: cuMemFreeAsync of it is refused.
    let q = s.mem_alloc_async(ctx, stream, 512, 0).unwrap();
    s.mem_free(ctx, q).unwrap();
    assert_eq!(
        s.mem_free_async(ctx, stream, q),
        Err(CuError(cu::INVALID_VALUE))
    );
    s.stream_synchronize(ctx, stream).unwrap();
}
