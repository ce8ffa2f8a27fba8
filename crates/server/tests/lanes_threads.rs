//! Striped copies from several program threads at once (revision 17), as async_visibility's
//! section 9 makes them on the GPU: each thread reads into pageable memory on its own
//! per-thread default stream (large reads: `RM_MEMCPY_DTOH_STREAM` over the lanes; small ones
//! one-way, delivered later), in a session that host functions have made ordered. On the
//! EMULATED backend with late copies (`EmulatedConfig::copy_latency`); every byte is checked
//! and the whole run must finish well within its deadline.
//! Client `Session` → executor → EMULATED backend.

mod common;

use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::*;
use remora_client::StreamRef;
use remora_oncrpc::TransportChoice;
use remora_proto::remora::RmMemsetArgs;
use remora_server::{EmulatedConfig, ShmConfig};

#[test]
fn per_thread_reads_from_four_threads_in_an_ordered_session() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = serve_emulated(
        ShmConfig::default(),
        EmulatedConfig {
            copy_latency: Duration::from_millis(3),
            memory_per_device: 4 << 30,
            driver_busy_during_host_functions: true,
            ..EmulatedConfig::default()
        },
    );
    let s = session(&server.tcp(), TransportChoice::Tcp);
    let ctx = s.primary_ctx_retain(0).unwrap();
    // A host function makes the session's calls run in order on its ordered thread.
    let ran = Arc::new(Mutex::new(false));
    let r = Arc::clone(&ran);
    s.launch_host_func(ctx, LEGACY, Box::new(move |_| *r.lock().unwrap() = true))
        .unwrap();
    s.ctx_synchronize(ctx).unwrap();
    assert!(*ran.lock().unwrap());
    let started = Instant::now();
    let sizes = [4096usize, (4 << 20) + 1000, (40 << 20) + 3];
    std::thread::scope(|scope| {
        for t in 0..4u32 {
            let s = &s;
            scope.spawn(move || {
                let stream = s.stream_handle(ctx, StreamRef::PerThread).unwrap();
                let dev = s.mem_alloc(ctx, (sizes[2] + 64) as u64).unwrap();
                for round in 0..6u32 {
                    for (i, &n) in sizes.iter().enumerate() {
                        let value = (t * 31 + round * 7 + i as u32) & 0xff;
                        s.memset_async(&RmMemsetArgs {
                            ctx,
                            stream,
                            dst: dev,
                            value,
                            element_size: 1,
                            count: n as u64,
                        })
                        .unwrap();
                        let mut out = vec![0u8; n];
                        match s.memcpy_dtoh_pageable(ctx, stream, dev, &mut out) {
                            Some(r) => r.unwrap_or_else(|e| {
                                panic!("{e:?}: {:?}", remora_client::last_transport_failure())
                            }),
                            None => {
                                // SAFETY: `out` outlives the copy, which the synchronize
                                // below completes; nothing touches it meanwhile.
                                unsafe {
                                    s.memcpy_dtoh_async_into(
                                        ctx,
                                        stream,
                                        dev,
                                        out.as_mut_ptr(),
                                        n as u64,
                                    )
                                }
                                .unwrap()
                            }
                        }
                        s.stream_synchronize(ctx, stream).unwrap();
                        assert!(
                            out.iter().all(|&b| u32::from(b) == value),
                            "thread {t}, round {round}, {n} bytes"
                        );
                    }
                }
                s.mem_free(ctx, dev).unwrap();
            });
        }
    });
    assert!(
        started.elapsed() < Duration::from_secs(60),
        "took {:?}",
        started.elapsed()
    );
}
