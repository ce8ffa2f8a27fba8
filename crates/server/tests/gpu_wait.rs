//! The waiter thread's wait for the GPU (issue 12 §4, `gpu_wait.rs`): when it sleeps on an
//! event of its own first, the stream synchronize still answers what the driver's
//! synchronize says (results, deferred errors), leaves no event behind, and leaves a capture
//! in progress alone. The emulated backend's `sync_delay` makes every synchronize outlast
//! the connection thread's brief poll, so that each one reaches a waiter thread.

mod common;

use std::time::Duration;

use common::{fill_i32, ints, launch_u64s};
use remora_client::{CuError, NodeList, cu};
use remora_oncrpc::TransportChoice;
use remora_server::{EmulatedConfig, GpuWait, ShmConfig};

#[test]
fn a_waiter_that_sleeps_on_an_event_first_answers_as_the_synchronize_does() {
    let _serial = common::SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let server = common::serve_emulated(
        ShmConfig::default(),
        EmulatedConfig {
            sync_delay: Duration::from_millis(5),
            ..EmulatedConfig::default()
        },
    );
    let exec = server.executor();
    for transport in [TransportChoice::Unix, TransportChoice::Tcp] {
        let endpoint = match transport {
            TransportChoice::Tcp => server.tcp(),
            _ => server.endpoint.clone(),
        };
        let s = common::session(&endpoint, transport);
        let kit = common::FillKit::new(&s, 0);
        let (ctx, stream, p) = (kit.ctx, kit.stream, kit.p);
        let f = kit.function("fill_i32");
        let events = server.backend.live().events;

        // The driver waits (as before): no event.
        exec.set_gpu_wait(GpuWait::Driver);
        let slept = exec.gpu_sleeps();
        fill_i32(&s, ctx, f, p, 3, stream);
        s.stream_synchronize(ctx, stream).unwrap();
        assert_eq!(exec.gpu_sleeps(), slept, "{transport:?}");

        // Sleeping first: the same answers, one sleep per synchronize that reached a waiter.
        exec.set_gpu_wait(GpuWait::Sleep);
        fill_i32(&s, ctx, f, p, 5, stream);
        s.stream_synchronize(ctx, stream).unwrap();
        assert_eq!(exec.gpu_sleeps(), slept + 1, "{transport:?}");
        assert_eq!(ints(&s, ctx, p), (5..5 + 64).collect::<Vec<_>>());
        // A launch that failed in the driver: the synchronize after the sleep reports it,
        // once.
        launch_u64s(&s, ctx, kit.function("missing"), stream, &[0]);
        assert_eq!(
            s.stream_synchronize(ctx, stream),
            Err(CuError(cu::NOT_SUPPORTED)),
            "{transport:?}"
        );
        s.stream_synchronize(ctx, stream).unwrap();
        assert_eq!(
            server.backend.live().events,
            events,
            "the waiter's events are destroyed ({transport:?})"
        );

        // While the session captures, the waiter does not record into any stream: the
        // capture's graph holds only what the program put there.
        let other = s.stream_create(ctx, 0, 0).unwrap();
        let slept = exec.gpu_sleeps();
        s.stream_begin_capture(ctx, stream, 0).unwrap();
        fill_i32(&s, ctx, f, p, 9, stream);
        s.stream_synchronize(ctx, other).unwrap();
        assert_eq!(exec.gpu_sleeps(), slept, "{transport:?}");
        let g = s.stream_end_capture(ctx, stream).unwrap();
        let nodes = s.graph_node_list(g, NodeList::Nodes).unwrap();
        assert_eq!(nodes.len(), 1, "one kernel node ({transport:?})");
        s.graph_destroy(g).unwrap();
        assert_eq!(server.backend.live().events, events, "{transport:?}");
    }
}
