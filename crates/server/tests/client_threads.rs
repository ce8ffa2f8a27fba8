//! Many client threads on one `remora_client::Session`, each with its own stream doing async
//! host-to-device and device-to-host copies and a stream synchronize per round, against the
//! emulated backend: every round's data is right, and nothing hangs (the GPU suite's
//! `multithread` program, without kernels).

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use remora_client::Session;
use remora_oncrpc::Endpoint;
use remora_server::{
    Backend, EmulatedBackend, EmulatedConfig, ServeConfig, inventory_of, start_with_backend,
};

#[test]
fn threads_with_their_own_streams_get_their_own_async_copies() {
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
    let session = Arc::new(Session::connect(&endpoint).unwrap());
    let ctx = session.primary_ctx_retain(0).unwrap();
    let start = Instant::now();
    let threads: Vec<_> = (0..8u32)
        .map(|t| {
            let session = Arc::clone(&session);
            std::thread::spawn(move || {
                let stream = session.stream_create(ctx, 1, 0).unwrap();
                for round in 0..40u32 {
                    let n = 1000 + (t * 997 + round * 13) as usize;
                    let data: Vec<u8> = (0..n)
                        .map(|i| (i as u32 ^ (t << 8) ^ round) as u8)
                        .collect();
                    let dev = session.mem_alloc(ctx, n as u64).unwrap();
                    session.memcpy_htod_async(ctx, stream, dev, &data).unwrap();
                    let out = Arc::new(Mutex::new(Vec::new()));
                    let sink_out = Arc::clone(&out);
                    session
                        .memcpy_dtoh_async(
                            ctx,
                            stream,
                            dev,
                            n as u64,
                            Box::new(move |bytes: &[u8]| {
                                *sink_out.lock().unwrap() = bytes.to_vec()
                            }),
                        )
                        .unwrap();
                    session.stream_synchronize(ctx, stream).unwrap();
                    assert_eq!(*out.lock().unwrap(), data, "thread {t} round {round}");
                    session.mem_free(ctx, dev).unwrap();
                }
                session.stream_destroy(stream).unwrap();
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "took {:?}",
        start.elapsed()
    );
    running.shutdown();
}
