//! Issue 13, finding 2: a session's undelivered asynchronous device-to-host copies are bounded
//! (`ServeConfig::max_pending_copy_bytes`). A client that floods one-way copies without ever
//! synchronizing gets CUDA_ERROR_OUT_OF_MEMORY at its next synchronizing call, the server's
//! staged bytes stay under the bound, and other sessions are served as before. EMULATED
//! backend.

use std::sync::Arc;
use std::time::Duration;

use remora_oncrpc::{Client, Endpoint};
use remora_proto::remora::*;
use remora_server::{
    Backend, EmulatedBackend, EmulatedConfig, Running, ServeConfig, inventory_of,
    start_with_backend,
};

const OUT_OF_MEMORY: i32 = 2;
/// The bound of these tests: sixteen 4 KiB copies and their overhead do not fit.
const LIMIT: u64 = 64 << 10;
const COPY: u64 = 4 << 10;

fn handle(r: RmHandleReply) -> u64 {
    match r {
        RmHandleReply::Case0(h) => h,
        other => panic!("expected a handle, got {other:?}"),
    }
}

fn client(endpoint: &Endpoint) -> RemoraV1Client {
    RemoraV1Client::new(Client::connect(endpoint).unwrap()).with_timeout(Duration::from_secs(20))
}

/// A session with a context and `COPY` bytes of device memory: `(ctx, dptr)`.
fn setup(c: &RemoraV1Client) -> (u64, u64) {
    let ctx = handle(c.rm_primary_ctx_retain(&0).unwrap());
    let RmU64Reply::Case0(dptr) = c
        .rm_mem_alloc(&RmAllocArgs {
            ctx,
            bytesize: COPY,
        })
        .unwrap()
    else {
        panic!("no memory")
    };
    (ctx, dptr)
}

fn serve(dir: &tempfile::TempDir) -> (Running, Endpoint) {
    let backend = Arc::new(EmulatedBackend::new(EmulatedConfig::default()));
    let endpoint = Endpoint::Unix(dir.path().join("remora.sock"));
    let running = start_with_backend(
        ServeConfig {
            listen: vec![endpoint.clone()],
            max_pending_copy_bytes: Some(LIMIT),
            ..ServeConfig::default()
        },
        Arc::clone(&backend) as Arc<dyn Backend>,
        inventory_of(&*backend),
    )
    .unwrap();
    (running, endpoint)
}

#[test]
fn a_flood_of_unsynchronized_copies_is_bounded_and_fails_only_its_session() {
    let dir = tempfile::tempdir().unwrap();
    let (running, endpoint) = serve(&dir);
    let executor = running.executor().unwrap();

    let flooder = client(&endpoint);
    let (ctx, src) = setup(&flooder);
    let other = client(&endpoint);
    let (other_ctx, other_src) = setup(&other);

    // 512 one-way copies of 4 KiB (2 MiB), 32 times the bound, and never a synchronize.
    const N: u64 = 512;
    for copy_id in 1..=N {
        flooder
            .rm_memcpy_dtoh_async(&RmDtohArgs {
                ctx,
                stream: 0,
                src,
                size: COPY,
                copy_id: 100 + copy_id,
            })
            .unwrap();
    }
    // A synchronous call on the same connection: every copy above has been issued.
    assert!(matches!(
        flooder.rm_device_get_count().unwrap(),
        RmIntReply::Case0(1)
    ));
    let staged = executor.pending_copy_bytes();
    assert!(
        staged <= LIMIT + N * 256,
        "{staged} bytes staged past the bound of {LIMIT}"
    );
    assert!(
        staged >= 8 * COPY,
        "the copies that fit are staged: {staged}"
    );

    // Another session is served as before, its copies included.
    other
        .rm_memcpy_dtoh_async(&RmDtohArgs {
            ctx: other_ctx,
            stream: 0,
            src: other_src,
            size: COPY,
            copy_id: 7,
        })
        .unwrap();
    let r = other.rm_ctx_synchronize(&other_ctx).unwrap();
    assert_eq!(r.status, 0);
    assert_eq!(r.copies.len(), 1);
    assert_eq!(r.copies[0].data.len() as u64, COPY);

    // The flooder's next synchronize reports the refusal, and delivers every copy it waits
    // for: those that fit with their bytes, the refused ones empty.
    let r = flooder.rm_ctx_synchronize(&ctx).unwrap();
    assert_eq!(r.status, OUT_OF_MEMORY);
    assert_eq!(r.copies.len() as u64, N);
    let full = r
        .copies
        .iter()
        .filter(|c| c.data.len() as u64 == COPY)
        .count() as u64;
    assert!((8..16).contains(&full), "{full} copies fit");
    assert!(
        r.copies
            .iter()
            .all(|c| c.data.is_empty() || c.data.len() as u64 == COPY)
    );
    assert_eq!(executor.pending_copy_bytes(), 0, "all delivered");

    // Room again: the session goes on, and its error was reported once.
    flooder
        .rm_memcpy_dtoh_async(&RmDtohArgs {
            ctx,
            stream: 0,
            src,
            size: COPY,
            copy_id: 1,
        })
        .unwrap();
    let r = flooder.rm_ctx_synchronize(&ctx).unwrap();
    assert_eq!(r.status, 0);
    assert_eq!(r.copies.len(), 1);
    assert_eq!(r.copies[0].data.len() as u64, COPY);
    running.shutdown();
}

/// Issue 13, finding 8: a client notices a hung server within its liveness bound, yet a
/// synchronize that takes longer than that bound on a live server is waited for: the server
/// answers the client's liveness pings while a waiter thread waits for the GPU.
#[test]
fn a_long_synchronize_outlasts_the_liveness_bound() {
    let dir = tempfile::tempdir().unwrap();
    let backend = Arc::new(EmulatedBackend::new(EmulatedConfig {
        sync_delay: Duration::from_millis(1500),
        ..EmulatedConfig::default()
    }));
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
    let session = remora_client::Session::connect_with(
        &endpoint,
        remora_client::SessionConfig {
            liveness: Some(remora_oncrpc::Liveness {
                probe_after: Duration::from_millis(100),
                dead_after: Duration::from_millis(500),
            }),
            ..remora_client::SessionConfig::default()
        },
    )
    .unwrap();
    let ctx = session.primary_ctx_retain(0).unwrap();
    let t0 = std::time::Instant::now();
    session.ctx_synchronize(ctx).unwrap();
    assert!(t0.elapsed() >= Duration::from_millis(1500));
    running.shutdown();
}
