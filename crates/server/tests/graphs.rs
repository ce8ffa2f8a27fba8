//! CUDA graphs through stream capture (`Session`, protocol revision 5) against the emulated
//! backend: captured copies, memsets and event joins of two streams replay at every launch of
//! the executable graph; the client answers capture queries and the server agrees; error
//! cases (ending a capture that is not one, a copy to host memory or a synchronize inside a
//! capture, a failed one-way call in a capture, a destroyed executable graph, the wrong
//! thread); and a session that ends frees its graphs, executable graphs and open captures.

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use remora_client::proto::{RmDim3, RmLaunchArgs, RmMemsetArgs};
use remora_client::{CaptureInfo, Session};
use remora_oncrpc::Endpoint;
use remora_server::{
    Backend, EmulatedBackend, EmulatedConfig, LiveCounts, Running, ServeConfig, inventory_of,
    start_with_backend,
};

const INVALID_VALUE: i32 = 1;
const INVALID_HANDLE: i32 = 400;
const ILLEGAL_STATE: i32 = 401;
const NOT_SUPPORTED: i32 = 801;
const CAPTURE_UNSUPPORTED: i32 = 900;
const CAPTURE_INVALIDATED: i32 = 901;
const CAPTURE_WRONG_THREAD: i32 = 908;
const GLOBAL: i32 = 0;
const RELAXED: i32 = 2;
const ACTIVE: i32 = 1;

/// Every emulated backend hands out the same device addresses, which each client session
/// reserves in this one test process: the tests run one at a time.
static SERIAL: Mutex<()> = Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn start() -> (tempfile::TempDir, Arc<EmulatedBackend>, Endpoint, Running) {
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
    (dir, backend, endpoint, running)
}

fn memset(
    ctx: u64,
    stream: u64,
    dst: u64,
    value: u32,
    element_size: u32,
    count: u64,
) -> RmMemsetArgs {
    RmMemsetArgs {
        ctx,
        stream,
        dst,
        value,
        element_size,
        count,
    }
}

fn read(s: &Session, ctx: u64, src: u64, n: usize) -> Vec<u8> {
    let mut out = vec![0; n];
    s.memcpy_dtoh(ctx, 1, src, &mut out).unwrap();
    out
}

fn code<T: std::fmt::Debug>(r: remora_client::CuResult<T>) -> i32 {
    r.unwrap_err().code()
}

#[test]
fn captured_copies_memsets_and_joins_replay_at_every_launch() {
    let _serial = serial();
    let (_dir, backend, endpoint, _running) = start();
    let s = Session::connect(&endpoint).unwrap();
    let ctx = s.primary_ctx_retain(0).unwrap();
    let (s1, s2, s3) = (
        s.stream_create(ctx, 1, 0).unwrap(),
        s.stream_create(ctx, 1, 0).unwrap(),
        s.stream_create(ctx, 1, 0).unwrap(),
    );
    let (fork, join) = (
        s.event_create(ctx, 2).unwrap(),
        s.event_create(ctx, 2).unwrap(),
    );
    let n = 256usize;
    let (a, b, c) = (
        s.mem_alloc(ctx, n as u64).unwrap(),
        s.mem_alloc(ctx, n as u64).unwrap(),
        s.mem_alloc(ctx, n as u64).unwrap(),
    );

    // Not capturing: answered by the client.
    assert_eq!(
        s.stream_capture_info(ctx, s1).unwrap(),
        CaptureInfo::default()
    );

    s.stream_begin_capture(ctx, s1, GLOBAL).unwrap();
    let info = s.stream_capture_info(ctx, s1).unwrap();
    assert_eq!(info.status, ACTIVE);
    assert_ne!(info.id, 0);
    assert_ne!(info.graph, 0);
    assert_eq!(s.stream_capture_info(ctx, s2).unwrap().status, 0);

    // s1: b = a, then fork to s2.
    s.memcpy_dtod_async(ctx, s1, b, a, n as u64).unwrap();
    s.event_record(ctx, fork, s1).unwrap();
    s.stream_wait_event(ctx, s2, fork, 0).unwrap();
    let joined = s.stream_capture_info(ctx, s2).unwrap();
    assert_eq!(
        (joined.status, joined.id),
        (ACTIVE, info.id),
        "s2 joined the capture"
    );
    // s2: c = 0x11 bytes, then the first half of c = 0x0000_2222 words; join back into s1.
    s.memset_async(&memset(ctx, s2, c, 0x11, 1, n as u64))
        .unwrap();
    s.memset_async(&memset(ctx, s2, c, 0x2222, 4, (n / 8) as u64))
        .unwrap();
    s.event_record(ctx, join, s2).unwrap();
    s.stream_wait_event(ctx, s1, join, 0).unwrap();
    // s1: the second half of b = the first half of c.
    s.memcpy_dtod_async(ctx, s1, b + (n / 2) as u64, c, (n / 2) as u64)
        .unwrap();
    // Nothing ran yet.
    assert_eq!(read(&s, ctx, b, n), vec![0; n]);
    let graph = s.stream_end_capture(ctx, s1).unwrap();
    assert_eq!(
        s.stream_capture_info(ctx, s1).unwrap(),
        CaptureInfo::default()
    );
    assert_eq!(
        s.stream_capture_info(ctx, s2).unwrap(),
        CaptureInfo::default()
    );
    assert!(s.graph_node_count(graph).unwrap() >= 5);
    assert_eq!(read(&s, ctx, c, n), vec![0; n]);

    let exec = s.graph_instantiate(ctx, graph, 0).unwrap();
    let mut expect_c = vec![0x11u8; n];
    for w in expect_c[..n / 2].chunks_mut(4) {
        w.copy_from_slice(&0x2222u32.to_le_bytes());
    }
    for launch in 0..5u8 {
        let input: Vec<u8> = (0..n).map(|i| (i as u8).wrapping_mul(launch + 3)).collect();
        s.memcpy_htod(ctx, 1, a, &input).unwrap();
        s.memset(&memset(ctx, 1, c, 0, 1, n as u64)).unwrap();
        s.graph_launch(ctx, exec, s3).unwrap();
        s.stream_synchronize(ctx, s3).unwrap();
        let mut expect_b = input.clone();
        expect_b[n / 2..].copy_from_slice(&expect_c[..n / 2]);
        assert_eq!(read(&s, ctx, b, n), expect_b, "launch {launch}");
        assert_eq!(read(&s, ctx, c, n), expect_c, "launch {launch}");
    }
    assert_eq!(backend.live().graphs, 1);
    assert_eq!(backend.live().graph_execs, 1);

    s.graph_exec_destroy(exec).unwrap();
    s.graph_destroy(graph).unwrap();
    assert_eq!(code(s.graph_launch(ctx, exec, s3)), INVALID_HANDLE);
    assert_eq!(code(s.graph_destroy(graph)), INVALID_HANDLE);
    assert_eq!(code(s.graph_exec_destroy(exec)), INVALID_HANDLE);
    assert_eq!((backend.live().graphs, backend.live().graph_execs), (0, 0));
    s.ctx_synchronize(ctx).unwrap();
}

#[test]
fn capture_errors_are_those_of_cuda_and_leave_the_session_usable() {
    let _serial = serial();
    let (_dir, backend, endpoint, _running) = start();
    let s = Session::connect(&endpoint).unwrap();
    let ctx = s.primary_ctx_retain(0).unwrap();
    let s1 = s.stream_create(ctx, 1, 0).unwrap();
    let a = s.mem_alloc(ctx, 64).unwrap();

    // Ending a capture that never began; capturing the legacy stream; beginning twice.
    assert_eq!(code(s.stream_end_capture(ctx, s1)), ILLEGAL_STATE);
    assert_eq!(
        code(s.stream_begin_capture(ctx, 1, GLOBAL)),
        CAPTURE_UNSUPPORTED
    );
    assert_eq!(code(s.stream_begin_capture(ctx, s1, 7)), INVALID_VALUE);
    s.stream_begin_capture(ctx, s1, GLOBAL).unwrap();
    assert_eq!(code(s.stream_begin_capture(ctx, s1, GLOBAL)), ILLEGAL_STATE);

    // Copies to or from host memory cannot be captured: refused at once, nothing pending,
    // and the capture ends with the error.
    let sink: remora_client::CopySink = Box::new(|_: &[u8]| panic!("never delivered"));
    assert_eq!(
        code(s.memcpy_dtoh_async(ctx, s1, a, 64, sink)),
        CAPTURE_UNSUPPORTED
    );
    assert_eq!(
        code(s.memcpy_htod_async(ctx, s1, a, &[1; 64])),
        CAPTURE_UNSUPPORTED
    );
    assert_eq!(s.pending_copies(), 0);
    assert_eq!(code(s.stream_end_capture(ctx, s1)), CAPTURE_UNSUPPORTED);
    assert_eq!(s.stream_capture_info(ctx, s1).unwrap().status, 0);
    assert_eq!(
        backend.live().graphs,
        0,
        "the failed capture's graph is freed"
    );

    // A synchronize inside a capture fails and invalidates it, as in CUDA.
    s.stream_begin_capture(ctx, s1, GLOBAL).unwrap();
    s.memset_async(&memset(ctx, s1, a, 5, 1, 64)).unwrap();
    assert_eq!(code(s.stream_synchronize(ctx, s1)), CAPTURE_UNSUPPORTED);
    assert_eq!(s.stream_capture_info(ctx, s1).unwrap().status, 2);
    assert_eq!(code(s.stream_end_capture(ctx, s1)), CAPTURE_INVALIDATED);
    assert_eq!(
        read(&s, ctx, a, 64),
        vec![0; 64],
        "the captured memset never ran"
    );

    // A one-way call that fails inside a capture fails the capture, not a later call.
    s.stream_begin_capture(ctx, s1, GLOBAL).unwrap();
    s.memset_async(&memset(ctx, s1, a, 5, 1, 65)).unwrap();
    assert_eq!(code(s.stream_end_capture(ctx, s1)), INVALID_VALUE);
    s.stream_synchronize(ctx, s1).unwrap();
    assert_eq!(backend.live().graphs, 0);

    // A non-relaxed capture ends on the thread that began it.
    s.stream_begin_capture(ctx, s1, GLOBAL).unwrap();
    std::thread::scope(|t| {
        t.spawn(|| assert_eq!(code(s.stream_end_capture(ctx, s1)), CAPTURE_WRONG_THREAD));
    });
    let g = s.stream_end_capture(ctx, s1).unwrap();
    s.graph_destroy(g).unwrap();
    s.stream_begin_capture(ctx, s1, RELAXED).unwrap();
    let g =
        std::thread::scope(|t| t.spawn(|| s.stream_end_capture(ctx, s1).unwrap()).join()).unwrap();
    // A graph being captured cannot be instantiated; a finished one can.
    let exec = s.graph_instantiate(ctx, g, 0).unwrap();
    s.graph_exec_destroy(exec).unwrap();
    s.graph_destroy(g).unwrap();

    // A captured kernel launch fails when the graph runs (emulated launches do).
    let module = s
        .module_load(ctx, b"REMORA-EMU-MODULE\nfunc k 8\n")
        .unwrap();
    let k = module.functions["k"].handle;
    s.stream_begin_capture(ctx, s1, GLOBAL).unwrap();
    s.launch(&RmLaunchArgs {
        ctx,
        function: k,
        grid: RmDim3 { x: 1, y: 1, z: 1 },
        block: RmDim3 { x: 32, y: 1, z: 1 },
        shared_mem_bytes: 0,
        stream: s1,
        params: remora_xdr::Bytes::from(vec![0u8; 8]),
        attrs: Vec::new(),
    })
    .unwrap();
    let g = s.stream_end_capture(ctx, s1).unwrap();
    let exec = s.graph_instantiate(ctx, g, 0).unwrap();
    s.graph_launch(ctx, exec, s1).unwrap();
    assert_eq!(code(s.stream_synchronize(ctx, s1)), NOT_SUPPORTED);
    s.stream_synchronize(ctx, s1).unwrap();
    assert_eq!((backend.live().graphs, backend.live().graph_execs), (1, 1));
}

#[test]
fn a_session_that_ends_frees_its_graphs_and_open_captures() {
    let _serial = serial();
    let (_dir, backend, endpoint, running) = start();
    {
        let s = Session::connect(&endpoint).unwrap();
        let ctx = s.primary_ctx_retain(0).unwrap();
        let (s1, s2) = (
            s.stream_create(ctx, 1, 0).unwrap(),
            s.stream_create(ctx, 1, 0).unwrap(),
        );
        let a = s.mem_alloc(ctx, 64).unwrap();
        s.stream_begin_capture(ctx, s1, GLOBAL).unwrap();
        s.memset_async(&memset(ctx, s1, a, 1, 1, 64)).unwrap();
        let g = s.stream_end_capture(ctx, s1).unwrap();
        let _exec = s.graph_instantiate(ctx, g, 0).unwrap();
        // Left open.
        s.stream_begin_capture(ctx, s2, GLOBAL).unwrap();
        s.memset_async(&memset(ctx, s2, a, 2, 1, 64)).unwrap();
        s.ctx_synchronize(ctx).unwrap();
        let live = backend.live();
        assert_eq!((live.graphs, live.graph_execs), (2, 1));
    }
    // The session is removed from the table, then freed.
    let deadline = Instant::now() + Duration::from_secs(10);
    while running.executor().unwrap().session_count() != 0
        || backend.live() != LiveCounts::default()
    {
        assert!(
            Instant::now() < deadline,
            "the session left {:?}",
            backend.live()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
}
