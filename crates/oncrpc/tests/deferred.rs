//! Deferred replies: a handler hands its reply to another thread and the connection serves the
//! next calls meanwhile; services hear when a connection ends.

mod common;

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use common::deferring::{DeferringSvc as Svc, *};
use remora_oncrpc::{Client, Endpoint, Server, ServerConfig, Service};

const PROG: u32 = 0x2000_0777;

fn call(c: &Client, proc_: u32, v: u32) -> Result<u32, remora_oncrpc::RpcError> {
    c.call(
        PROG,
        1,
        proc_,
        Some(Duration::from_secs(10)),
        |e| {
            e.put_u32(v);
            Ok(())
        },
        |d| d.get_u32(),
    )
}

#[test]
fn a_deferred_reply_lets_later_calls_on_the_connection_complete_first() {
    let dir = tempfile::tempdir().unwrap();
    let svc = Arc::new(Svc::new(PROG, Duration::from_millis(800)));
    let handle = Server::builder(ServerConfig::default())
        .service(Arc::clone(&svc) as Arc<dyn Service>)
        .listen(&Endpoint::Unix(dir.path().join("d.sock")))
        .unwrap()
        .start()
        .unwrap();
    let ep = handle.local_endpoints()[0].clone();
    let client = Arc::new(Client::connect(&ep).unwrap());
    let start = Instant::now();
    let slow = {
        let c = Arc::clone(&client);
        std::thread::spawn(move || (call(&c, SLOW, 41), start.elapsed()))
    };
    std::thread::sleep(Duration::from_millis(50));
    for i in 0..10 {
        assert_eq!(call(&client, FAST, i).unwrap(), i * 2);
    }
    let fast_done = start.elapsed();
    let (slow_result, slow_done) = slow.join().unwrap();
    assert_eq!(slow_result.unwrap(), 42);
    assert!(fast_done < Duration::from_millis(600), "{fast_done:?}");
    assert!(slow_done >= Duration::from_millis(800), "{slow_done:?}");
    assert_eq!(svc.inline.load(Ordering::SeqCst), 0);
    // A deferred reply dropped unsent answers SYSTEM_ERR rather than leaving the caller hanging.
    let err = call(&client, DROPPED, 0).unwrap_err();
    assert!(format!("{err}").to_lowercase().contains("system"), "{err}");

    // Connection ids: one per connection; the service hears when each closes.
    let other = Client::connect(&ep).unwrap();
    call(&other, FAST, 1).unwrap();
    let ids: Vec<u64> = svc.connections.lock().unwrap().clone();
    let first = ids[0];
    let second = *ids.last().unwrap();
    assert_ne!(first, second);
    drop(other);
    let deadline = Instant::now() + Duration::from_secs(5);
    while !svc.closed.lock().unwrap().contains(&second) {
        assert!(Instant::now() < deadline, "connection_closed never called");
        std::thread::sleep(Duration::from_millis(10));
    }
    assert!(!svc.closed.lock().unwrap().contains(&first));

    // Shutdown with a deferred reply in flight: it is still delivered, then all closes.
    let c = Arc::clone(&client);
    let pending = std::thread::spawn(move || call(&c, SLOW, 1));
    std::thread::sleep(Duration::from_millis(100));
    handle.shutdown();
    assert_eq!(pending.join().unwrap().unwrap(), 2);
    assert!(svc.closed.lock().unwrap().contains(&first));
}
