//! Host callbacks (`cuLaunchHostFunc` / `cuStreamAddCallback` through `Session`) against the
//! emulated backend: they run in the client process on its callback thread, in the order the
//! streams reach them, a synchronize returns only after the callbacks before it ran, the
//! connection serves `RM_HOST_CALLBACK_DONE` while a synchronize is waiting, and a client that
//! disconnects with callbacks pending frees its server session.

use std::sync::mpsc;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use remora_client::Session;
use remora_oncrpc::Endpoint;
use remora_server::{
    Backend, EmulatedBackend, EmulatedConfig, Running, ServeConfig, inventory_of,
    start_with_backend,
};

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

type Log = Arc<Mutex<Vec<String>>>;

/// A callback that appends `name` (and the thread it ran on) to `log` after `delay`.
fn note(log: &Log, name: &str, delay: Duration) -> remora_client::HostCallback {
    let (log, name) = (Arc::clone(log), name.to_owned());
    Box::new(move |status| {
        std::thread::sleep(delay);
        let thread = std::thread::current().name().unwrap_or("?").to_owned();
        log.lock()
            .unwrap()
            .push(format!("{name} {status} {thread}"));
    })
}

#[test]
fn callbacks_run_here_in_order_and_synchronize_waits_for_them() {
    let _serial = serial();
    let (_dir, _backend, endpoint, running) = start();
    let session = Session::connect(&endpoint).unwrap();
    let ctx = session.primary_ctx_retain(0).unwrap();
    let s1 = session.stream_create(ctx, 1, 0).unwrap();
    let s2 = session.stream_create(ctx, 1, 0).unwrap();
    let dev = session.mem_alloc(ctx, 64).unwrap();
    let log: Log = Arc::default();

    let t = Instant::now();
    session
        .launch_host_func(ctx, s1, note(&log, "a", Duration::from_millis(150)))
        .unwrap();
    session.memcpy_htod_async(ctx, s1, dev, &[7u8; 64]).unwrap();
    session
        .launch_host_func(ctx, s1, note(&log, "b", Duration::ZERO))
        .unwrap();
    session.stream_synchronize(ctx, s1).unwrap();
    assert!(
        t.elapsed() >= Duration::from_millis(150),
        "the synchronize returned before the callback ran"
    );
    let got = log.lock().unwrap().clone();
    assert_eq!(
        got,
        ["a 0 remora-host-callbacks", "b 0 remora-host-callbacks"],
        "in this process, on the callback thread, in stream order"
    );

    // Calls after the first callback still work and keep their order (they now run on the
    // session's ordered thread on the server): a synchronous copy, a read back.
    session.memcpy_htod(ctx, 1, dev, &[9u8; 64]).unwrap();
    let mut back = [0u8; 64];
    session.memcpy_dtoh(ctx, 1, dev, &mut back).unwrap();
    assert_eq!(back, [9u8; 64]);

    // Several streams and the legacy stream; the context synchronize waits for all.
    log.lock().unwrap().clear();
    for i in 0..20 {
        let s = [s1, s2, 1][i % 3];
        session
            .launch_host_func(
                ctx,
                s,
                note(&log, &format!("{i}"), Duration::from_millis(2)),
            )
            .unwrap();
    }
    session.ctx_synchronize(ctx).unwrap();
    let got = log.lock().unwrap().clone();
    assert_eq!(got.len(), 20, "{got:?}");
    // Per stream, the order of enqueueing.
    for k in 0..3 {
        let order: Vec<usize> = got
            .iter()
            .map(|l| l.split(' ').next().unwrap().parse::<usize>().unwrap())
            .filter(|i| i % 3 == k)
            .collect();
        let mut sorted = order.clone();
        sorted.sort();
        assert_eq!(order, sorted, "stream {k}");
    }
    assert_eq!(session.host_callbacks_outstanding(), 0);
    session.stream_destroy(s1).unwrap();
    session.stream_destroy(s2).unwrap();
    drop(session);
    running.shutdown();
}

#[test]
fn a_call_that_synchronizes_implicitly_waits_for_the_callback_without_deadlock() {
    let _serial = serial();
    // cuMemFree waits for the context's work, host functions included, inside the driver;
    // the server's host function must not need anything the freeing call holds (it once
    // took the session lock, which the free held: a deadlock, seen on the GPU machine).
    let (_dir, _backend, endpoint, running) = start();
    let session = Arc::new(Session::connect(&endpoint).unwrap());
    let ctx = session.primary_ctx_retain(0).unwrap();
    let s = session.stream_create(ctx, 1, 0).unwrap();
    let dev = session.mem_alloc(ctx, 64).unwrap();
    let log: Log = Arc::default();
    // `a` holds the stream until released; `b` is reached only after, while the free below
    // is already waiting inside the (emulated) driver.
    let (release_tx, release_rx) = mpsc::channel::<()>();
    session
        .launch_host_func(
            ctx,
            s,
            Box::new(move |_| {
                release_rx.recv().unwrap();
            }),
        )
        .unwrap();
    session
        .launch_host_func(ctx, s, note(&log, "b", Duration::ZERO))
        .unwrap();
    let free = {
        let session = Arc::clone(&session);
        std::thread::spawn(move || session.mem_free(ctx, dev))
    };
    std::thread::sleep(Duration::from_millis(100));
    assert!(!free.is_finished(), "the free waits for the host functions");
    release_tx.send(()).unwrap();
    let deadline = Instant::now() + Duration::from_secs(20);
    while !free.is_finished() {
        if Instant::now() >= deadline {
            // Deadlocked threads would make the server's shutdown hang: leave them.
            std::mem::forget(running);
            std::mem::forget(session);
            panic!("cuMemFree after a host callback never returned (deadlock)");
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    free.join().unwrap().unwrap();
    assert_eq!(log.lock().unwrap().len(), 1);
    running.shutdown();
}

#[test]
fn done_is_served_while_a_synchronize_waits_for_the_callback() {
    let _serial = serial();
    let (_dir, _backend, endpoint, running) = start();
    let session = Arc::new(Session::connect(&endpoint).unwrap());
    let ctx = session.primary_ctx_retain(0).unwrap();
    let s = session.stream_create(ctx, 1, 0).unwrap();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    let (ran_tx, ran_rx) = mpsc::channel::<()>();
    session
        .launch_host_func(
            ctx,
            s,
            Box::new(move |_| {
                ran_tx.send(()).unwrap();
                release_rx.recv().unwrap();
            }),
        )
        .unwrap();
    // The callback is running (the stream is blocked on the server).
    ran_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    let sync = {
        let session = Arc::clone(&session);
        std::thread::spawn(move || session.stream_synchronize(ctx, s))
    };
    // Other calls are still answered meanwhile.
    let _ = session.mem_get_info(ctx).unwrap();
    std::thread::sleep(Duration::from_millis(100));
    assert!(
        !sync.is_finished(),
        "the synchronize waits for the callback"
    );
    release_tx.send(()).unwrap();
    sync.join().unwrap().unwrap();
    assert_eq!(session.host_callbacks_outstanding(), 0);
    running.shutdown();
}

#[test]
fn a_client_that_disconnects_with_callbacks_pending_frees_the_server() {
    let _serial = serial();
    let (_dir, backend, endpoint, running) = start();
    let session = Arc::new(Session::connect(&endpoint).unwrap());
    let ctx = session.primary_ctx_retain(0).unwrap();
    let s = session.stream_create(ctx, 1, 0).unwrap();
    let (ran_tx, ran_rx) = mpsc::channel::<()>();
    let (release_tx, release_rx) = mpsc::channel::<()>();
    // A callback that does not return until the end of the test, and more behind it.
    session
        .launch_host_func(
            ctx,
            s,
            Box::new(move |_| {
                ran_tx.send(()).unwrap();
                let _ = release_rx.recv();
            }),
        )
        .unwrap();
    for _ in 0..3 {
        session.launch_host_func(ctx, s, Box::new(|_| {})).unwrap();
    }
    ran_rx.recv_timeout(Duration::from_secs(10)).unwrap();
    // A synchronize in flight on the server, waiting for the blocked stream.
    let sync = {
        let session = Arc::clone(&session);
        std::thread::spawn(move || session.stream_synchronize(ctx, s))
    };
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(backend.live().contexts, 1);
    // The client goes away.
    session.rpc().rpc().close();
    let deadline = Instant::now() + Duration::from_secs(20);
    while running.executor().unwrap().session_count() > 0 || backend.live().contexts > 0 {
        assert!(
            Instant::now() < deadline,
            "the server session was not freed: {:?}",
            backend.live()
        );
        std::thread::sleep(Duration::from_millis(10));
    }
    assert_eq!(backend.live().streams, 0);
    // The synchronize returns (it must not hang): with an error, the connection being
    // closed, or with success when the server's reply, sent while it released the session's
    // host functions, crossed the close.
    let _ = sync.join().unwrap();
    release_tx.send(()).unwrap();
    running.shutdown();
}
