//! Issue 13, findings 3 and 4: connection limits of the server runtime. A per-peer cap, the
//! HELLO deadline and the small first-record bound, the minimum byte rate of a record
//! (slowloris), the idle timeout (never while a call is in flight), and a peer that does not
//! read its deferred replies is disconnected.

mod common;

use std::io::{Read, Write};
use std::sync::Arc;
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use remora_oncrpc::xdr::{Decoder, Encoder};
use remora_oncrpc::{
    CallContext, Client, Dispatch, Endpoint, Server, ServerConfig, ServerHandle, Service,
};

fn add(c: &Client) -> Result<i32, remora_oncrpc::RpcError> {
    c.call(
        PROG,
        1,
        ADD,
        Some(Duration::from_secs(5)),
        |e| {
            e.put_i32(20);
            e.put_i32(22);
            Ok(())
        },
        |d| d.get_i32(),
    )
}

fn wait_for_connections(h: &ServerHandle, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while h.connection_count() != n {
        assert!(
            Instant::now() < deadline,
            "{} connections, expected {n}",
            h.connection_count()
        );
        thread::sleep(Duration::from_millis(5));
    }
}

/// A call record of the test program with no arguments (procedure `proc_`).
fn call_record(xid: u32, proc_: u32) -> Vec<u8> {
    let mut v = Vec::new();
    for w in [xid, 0, 2, PROG, 1, proc_, 0, 0, 0, 0] {
        v.extend_from_slice(&w.to_be_bytes());
    }
    v
}

#[test]
fn one_peer_cannot_take_every_connection() {
    let dir = tempfile::tempdir().unwrap();
    let handle = Server::builder(ServerConfig {
        max_connections_per_peer: 3,
        ..ServerConfig::default()
    })
    .service(Arc::new(TestService {
        version: 1,
        log: Arc::default(),
    }))
    .listen(&Endpoint::Tcp("127.0.0.1:0".into()))
    .unwrap()
    .listen(&Endpoint::Unix(dir.path().join("rpc.sock")))
    .unwrap()
    .start()
    .unwrap();
    let eps = handle.local_endpoints();
    let (tcp, unix) = (&eps[0], &eps[1]);
    // Three idle connections from 127.0.0.1 are served; a fourth is closed at once.
    let idle: Vec<Raw> = (0..3).map(|_| Raw::connect(tcp)).collect();
    wait_for_connections(&handle, 3);
    let mut fourth = Raw::connect(tcp);
    assert!(fourth.closed_within(Duration::from_secs(2)));
    // Another peer (a Unix-socket user is counted by uid) is still served.
    assert_eq!(add(&Client::connect(unix).unwrap()).unwrap(), 42);
    // When one of the three goes, its peer may connect again.
    drop(idle);
    wait_for_connections(&handle, 0);
    assert_eq!(add(&Client::connect(tcp).unwrap()).unwrap(), 42);
}

#[test]
fn a_connection_must_make_its_first_call_in_time_and_small() {
    for t in BOTH {
        let s = start_with(
            t,
            ServerConfig {
                hello_timeout: Duration::from_millis(300),
                max_first_record_size: Some(1024),
                ..ServerConfig::default()
            },
        );
        // Silence after connecting: closed at the HELLO deadline.
        let t0 = Instant::now();
        let mut silent = Raw::connect(&s.endpoint);
        assert!(silent.closed_within(Duration::from_secs(3)));
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(300), "{took:?}");
        // A first record larger than the first-record bound: closed at its header.
        let mut big = Raw::connect(&s.endpoint);
        big.write_all(&(0x8000_0000u32 | 4096).to_be_bytes())
            .unwrap();
        assert!(big.closed_within(Duration::from_millis(200)));
        // After a first call, the deadline no longer applies and records may be large.
        let c = s.client().unwrap();
        assert_eq!(add(&c).unwrap(), 42);
        thread::sleep(Duration::from_millis(500));
        let echoed: Vec<u8> = c
            .call(
                PROG,
                1,
                ECHO,
                Some(Duration::from_secs(5)),
                |e| e.put_opaque(&[7u8; 4096], u32::MAX),
                |d| d.get_opaque(u32::MAX).map(|b| b.to_vec()),
            )
            .unwrap();
        assert_eq!(echoed, vec![7u8; 4096]);
    }
}

#[test]
fn a_record_trickled_in_is_closed_even_though_bytes_keep_coming() {
    for t in BOTH {
        let s = start_with(
            t,
            ServerConfig {
                stall_timeout: Duration::from_millis(300),
                min_record_rate: 100,
                ..ServerConfig::default()
            },
        );
        let mut raw = Raw::connect(&s.endpoint);
        raw.send_record(&call_record(1, NULLPROC));
        assert!(!raw.read_record().is_empty());
        // A 1,000-byte record, one byte every 50 ms: never stalled, far below 100 bytes/s
        // after the 300 ms grace... it would take 50 s.
        raw.write_all(&(0x8000_0000u32 | 1000).to_be_bytes())
            .unwrap();
        let t0 = Instant::now();
        let mut closed = false;
        for _ in 0..100 {
            thread::sleep(Duration::from_millis(50));
            if raw.write_all(&[0]).is_err() {
                closed = true;
                break;
            }
            if s.handle().connection_count() == 0 {
                closed = true;
                break;
            }
        }
        assert!(closed, "a trickling record kept its connection open");
        let took = t0.elapsed();
        assert!(took < Duration::from_secs(3), "{took:?}");
        // Others are served.
        assert_eq!(add(&s.client().unwrap()).unwrap(), 42);
    }
}

#[test]
fn an_idle_connection_is_closed_but_not_while_a_call_is_in_flight() {
    let dir = tempfile::tempdir().unwrap();
    let svc = Arc::new(deferring::DeferringSvc::new(
        0x2000_0778,
        Duration::from_millis(900),
    ));
    let handle = Server::builder(ServerConfig {
        idle_timeout: Some(Duration::from_millis(300)),
        ..ServerConfig::default()
    })
    .service(Arc::clone(&svc) as Arc<dyn Service>)
    .listen(&Endpoint::Unix(dir.path().join("d.sock")))
    .unwrap()
    .start()
    .unwrap();
    let ep = handle.local_endpoints()[0].clone();
    let call = |c: &Client, proc_: u32| {
        c.call(
            0x2000_0778,
            1,
            proc_,
            Some(Duration::from_secs(5)),
            |e| {
                e.put_u32(1);
                Ok(())
            },
            |d| d.get_u32(),
        )
    };
    // A deferred reply 900 ms away: the connection is quiet for three idle timeouts, but a
    // call is in flight.
    let busy = Client::connect(&ep).unwrap();
    assert_eq!(call(&busy, deferring::SLOW).unwrap(), 2);
    // Then idle: closed.
    let t0 = Instant::now();
    while busy.is_connected() && call(&busy, deferring::FAST).is_ok() {
        thread::sleep(Duration::from_millis(400));
        assert!(t0.elapsed() < Duration::from_secs(5), "never closed");
    }
    wait_for_connections(&handle, 0);
}

/// A service whose BIG procedure answers 1 MiB through a deferred reply from another thread.
struct BigReplies;

const BIG_PROG: u32 = 0x2000_0779;
const BIG: u32 = 1;

impl Service for BigReplies {
    fn program(&self) -> u32 {
        BIG_PROG
    }
    fn version(&self) -> u32 {
        1
    }
    fn dispatch(&self, ctx: &CallContext, _args: &mut Decoder, _reply: &mut Encoder) -> Dispatch {
        if ctx.procedure != BIG {
            return Dispatch::Success;
        }
        let Some(deferred) = ctx.defer() else {
            return Dispatch::SystemErr;
        };
        thread::spawn(move || {
            let _ = deferred.reply(|e| e.put_opaque(&vec![1u8; 1 << 20], u32::MAX));
        });
        Dispatch::Deferred
    }
}

#[test]
fn a_peer_that_does_not_read_its_deferred_replies_is_disconnected() {
    let dir = tempfile::tempdir().unwrap();
    let handle = Server::builder(ServerConfig {
        stall_timeout: Duration::from_millis(300),
        ..ServerConfig::default()
    })
    .service(Arc::new(BigReplies) as Arc<dyn Service>)
    .listen(&Endpoint::Unix(dir.path().join("big.sock")))
    .unwrap()
    .start()
    .unwrap();
    let ep = handle.local_endpoints()[0].clone();
    let mut raw = Raw::connect(&ep);
    let mut calls = Vec::new();
    for xid in 0..16u32 {
        let mut v = Vec::new();
        for w in [xid, 0, 2, BIG_PROG, 1, BIG, 0, 0, 0, 0] {
            v.extend_from_slice(&w.to_be_bytes());
        }
        calls.push(v);
    }
    for c in &calls {
        raw.send_record(c);
    }
    wait_for_connections(&handle, 1);
    // 16 MiB of replies that nobody reads: the first write to stall past stall_timeout ends
    // the connection.
    wait_for_connections(&handle, 0);
    // Its socket is shut down: reading drains what was sent, then ends.
    raw.set_read_timeout(Duration::from_secs(5));
    let mut sink = [0u8; 1 << 16];
    loop {
        match raw.read(&mut sink) {
            Ok(0) => break,
            Ok(_) => {}
            Err(e) => panic!("the connection was not closed: {e}"),
        }
    }
}

/// Counts the connections handed to it and closes them.
#[derive(Default)]
struct CountingHandler {
    handled: std::sync::atomic::AtomicUsize,
}

impl remora_oncrpc::ConnectionHandler for CountingHandler {
    fn handle(&self, _connection: remora_oncrpc::AcceptedConnection) {
        self.handled
            .fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }
}

#[test]
fn a_handed_off_connection_is_handed_only_after_its_first_record() {
    let dir = tempfile::tempdir().unwrap();
    let handler = Arc::new(CountingHandler::default());
    let handle = Server::builder(ServerConfig {
        hello_timeout: Duration::from_millis(400),
        max_first_record_size: Some(1024),
        ..ServerConfig::default()
    })
    .hand_off(Arc::clone(&handler) as Arc<dyn remora_oncrpc::ConnectionHandler>)
    .listen(&Endpoint::Unix(dir.path().join("h.sock")))
    .unwrap()
    .start()
    .unwrap();
    let ep = handle.local_endpoints()[0].clone();
    let handled = || handler.handled.load(std::sync::atomic::Ordering::SeqCst);
    // Silent, half a record, or a first record too large: nothing is started for them.
    let mut silent = Raw::connect(&ep);
    let mut half = Raw::connect(&ep);
    half.write_all(&(0x8000_0000u32 | 40).to_be_bytes())
        .unwrap();
    half.write_all(&[0; 20]).unwrap();
    let mut big = Raw::connect(&ep);
    big.write_all(&(0x8000_0000u32 | 4096).to_be_bytes())
        .unwrap();
    assert!(big.closed_within(Duration::from_secs(1)));
    assert!(silent.closed_within(Duration::from_secs(3)));
    assert!(half.closed_within(Duration::from_secs(3)));
    assert_eq!(handled(), 0);
    // A whole first record: handed off, with the record still unread in the socket.
    let mut raw = Raw::connect(&ep);
    raw.send_record(&call_record(1, NULLPROC));
    let deadline = Instant::now() + Duration::from_secs(3);
    while handled() == 0 {
        assert!(Instant::now() < deadline, "never handed off");
        thread::sleep(Duration::from_millis(5));
    }
    assert_eq!(handled(), 1);
}

// ---- finding 8: a client notices a hung server, and still waits for a long call ----

fn live_client(ep: &Endpoint) -> Client {
    Client::connect_with(
        ep,
        remora_oncrpc::ClientConfig {
            liveness: Some(remora_oncrpc::Liveness {
                probe_after: Duration::from_millis(100),
                dead_after: Duration::from_millis(600),
            }),
            ..remora_oncrpc::ClientConfig::default()
        },
    )
    .unwrap()
}

#[test]
fn a_client_gives_up_on_a_server_that_stops_answering() {
    // A server that reads every call and answers none (as a stopped or deadlocked one).
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let ep = Endpoint::Tcp(listener.local_addr().unwrap().to_string());
    let server = thread::spawn(move || {
        let (mut s, _) = listener.accept().unwrap();
        let mut b = [0u8; 4096];
        while matches!(s.read(&mut b), Ok(n) if n > 0) {}
    });
    let c = live_client(&ep);
    let t0 = Instant::now();
    let e = c
        .call(
            PROG,
            1,
            ADD,
            Some(Duration::from_secs(60)),
            |e| {
                e.put_i32(1);
                e.put_i32(2);
                Ok(())
            },
            |d| d.get_i32(),
        )
        .unwrap_err();
    assert!(
        matches!(e, remora_oncrpc::RpcError::ServerUnresponsive { .. }),
        "{e}"
    );
    let took = t0.elapsed();
    assert!(took >= Duration::from_millis(600), "{took:?}");
    assert!(took < Duration::from_secs(3), "{took:?}");
    assert!(!c.is_connected());
    drop(c);
    server.join().unwrap();
}

#[test]
fn a_long_call_on_a_live_server_is_waited_for_past_the_liveness_bound() {
    // SLOW answers after 1.5 s through a deferred reply: the server reads (and answers the
    // pings) meanwhile.
    let svc = Arc::new(deferring::DeferringSvc::new(
        0x2000_077a,
        Duration::from_millis(1500),
    ));
    let handle = Server::builder(ServerConfig::default())
        .service(Arc::clone(&svc) as Arc<dyn Service>)
        .listen(&Endpoint::Tcp("127.0.0.1:0".into()))
        .unwrap()
        .start()
        .unwrap();
    let c = live_client(&handle.local_endpoints()[0]);
    let t0 = Instant::now();
    let v: u32 = c
        .call(
            0x2000_077a,
            1,
            deferring::SLOW,
            Some(Duration::from_secs(60)),
            |e| {
                e.put_u32(41);
                Ok(())
            },
            |d| d.get_u32(),
        )
        .unwrap();
    assert_eq!(v, 42);
    assert!(t0.elapsed() >= Duration::from_millis(1500));
    assert!(c.is_connected());
}
