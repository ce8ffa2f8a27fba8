//! Serving one already-connected socket (`Server::serve_fd`), and servers that hand their
//! accepted connections to a handler (`Server::hand_off`), as a process-per-connection server
//! does.

mod common;

use std::net::TcpListener;
use std::os::fd::OwnedFd;
use std::os::unix::net::UnixListener;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use common::deferring::{DeferringSvc as Svc, *};
use remora_oncrpc::{
    AcceptedConnection, Client, ConnectionHandler, Endpoint, Peer, Server, ServerConfig, Service,
};

const PROG: u32 = 0x2000_0778;

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

/// A deferred reply arrives after later calls, then the peer closes and `serve_fd` returns.
fn exercise(ep: &Endpoint, accept: impl FnOnce() -> OwnedFd + Send + 'static) -> Arc<Svc> {
    let svc = Arc::new(Svc::new(PROG, Duration::from_millis(500)));
    let server = {
        let svc = Arc::clone(&svc);
        std::thread::spawn(move || {
            let fd = accept();
            Server::builder(ServerConfig::default())
                .service(svc as Arc<dyn Service>)
                .serve_fd(fd)
        })
    };
    let client = Arc::new(Client::connect(ep).unwrap());
    let slow = {
        let c = Arc::clone(&client);
        std::thread::spawn(move || call(&c, SLOW, 41))
    };
    std::thread::sleep(Duration::from_millis(50));
    assert_eq!(call(&client, FAST, 21).unwrap(), 42);
    assert_eq!(slow.join().unwrap().unwrap(), 42);
    drop(client);
    server.join().unwrap().unwrap();
    assert_eq!(*svc.closed.lock().unwrap(), vec![0]);
    svc
}

#[test]
fn serve_fd_serves_an_inherited_unix_socket_with_deferred_replies() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("s.sock");
    let listener = UnixListener::bind(&path).unwrap();
    let svc = exercise(&Endpoint::Unix(path), move || {
        OwnedFd::from(listener.accept().unwrap().0)
    });
    let me = std::process::id() as i32;
    assert!(
        svc.peers
            .lock()
            .unwrap()
            .iter()
            .all(|p| matches!(p, Peer::Unix { pid, .. } if *pid == me)),
        "the peer comes from SO_PEERCRED"
    );
}

#[test]
fn serve_fd_serves_an_inherited_tcp_socket() {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let ep = Endpoint::from(listener.local_addr().unwrap());
    let svc = exercise(&ep, move || OwnedFd::from(listener.accept().unwrap().0));
    assert!(
        svc.peers
            .lock()
            .unwrap()
            .iter()
            .all(|p| matches!(p, Peer::Tcp(a) if a.ip().is_loopback()))
    );
}

#[test]
fn serve_fd_refuses_what_is_not_a_stream_socket() {
    let file = tempfile::tempfile().unwrap();
    assert!(Server::new().serve_fd(OwnedFd::from(file)).is_err());
}

/// Serves each handed-off connection on a thread of its own with `serve_fd`, as a worker
/// process would.
struct Handler {
    svc: Arc<Svc>,
    handled: Mutex<Vec<(u64, Peer)>>,
}

impl ConnectionHandler for Handler {
    fn handle(&self, conn: AcceptedConnection) {
        self.handled
            .lock()
            .unwrap()
            .push((conn.id(), conn.peer().clone()));
        assert!(!conn.shutting_down());
        let fd = conn.try_clone_fd().unwrap();
        Server::builder(ServerConfig::default())
            .service(Arc::clone(&self.svc) as Arc<dyn Service>)
            .serve_fd(fd)
            .unwrap();
    }
}

#[test]
fn a_hand_off_server_bounds_connections_and_shutdown_waits_for_handlers() {
    let dir = tempfile::tempdir().unwrap();
    let svc = Arc::new(Svc::new(PROG, Duration::from_millis(500)));
    let handler = Arc::new(Handler {
        svc: Arc::clone(&svc),
        handled: Mutex::new(Vec::new()),
    });
    let handle = Server::builder(ServerConfig {
        max_connections: 2,
        ..ServerConfig::default()
    })
    .hand_off(Arc::clone(&handler) as Arc<dyn ConnectionHandler>)
    .listen(&Endpoint::Unix(dir.path().join("h.sock")))
    .unwrap()
    .start()
    .unwrap();
    let ep = handle.local_endpoints()[0].clone();
    let a = Client::connect(&ep).unwrap();
    let b = Client::connect(&ep).unwrap();
    assert_eq!(call(&a, FAST, 1).unwrap(), 2);
    assert_eq!(call(&b, FAST, 2).unwrap(), 4);
    assert_eq!(handle.connection_count(), 2);
    // A third is over the bound: accepted and closed (noticed when connecting, by the
    // shared-memory request, or by the first call on a plain socket).
    assert!(Client::connect(&ep).map_or(true, |c| call(&c, FAST, 3).is_err()));
    // Closing one frees its place.
    drop(b);
    let deadline = Instant::now() + Duration::from_secs(5);
    while handle.connection_count() != 1 {
        assert!(Instant::now() < deadline, "the handler never returned");
        std::thread::sleep(Duration::from_millis(10));
    }
    let d = Client::connect(&ep).unwrap();
    assert_eq!(call(&d, FAST, 4).unwrap(), 8);
    let ids: Vec<u64> = handler
        .handled
        .lock()
        .unwrap()
        .iter()
        .map(|h| h.0)
        .collect();
    assert_eq!(ids.len(), 3);
    assert!(ids.windows(2).all(|w| w[0] != w[1]));
    // Shutdown with live connections: their sockets see end of file and the handlers return.
    let pending = std::thread::spawn(move || call(&a, SLOW, 1));
    std::thread::sleep(Duration::from_millis(100));
    handle.shutdown();
    assert_eq!(pending.join().unwrap().unwrap(), 2);
    assert_eq!(svc.closed.lock().unwrap().len(), 3);
    drop(d);
}

fn null(c: &Client, prog: u32) -> Result<(), remora_oncrpc::RpcError> {
    c.call(
        prog,
        1,
        0,
        Some(Duration::from_secs(10)),
        |_| Ok(()),
        |_| Ok(()),
    )
}

/// NULL calls of a served program before anything else (pings such as `remora run
/// --server`'s check) are answered by the accepting server itself: they start no handler
/// (no worker process). The first other call hands the connection off as before.
#[test]
fn a_hand_off_server_answers_null_pings_itself() {
    let dir = tempfile::tempdir().unwrap();
    let svc = Arc::new(Svc::new(PROG, Duration::from_millis(500)));
    let handler = Arc::new(Handler {
        svc: Arc::clone(&svc),
        handled: Mutex::new(Vec::new()),
    });
    let handle = Server::builder(ServerConfig::default())
        .service(Arc::clone(&svc) as Arc<dyn Service>)
        .hand_off(Arc::clone(&handler) as Arc<dyn ConnectionHandler>)
        .listen(&Endpoint::Unix(dir.path().join("n.sock")))
        .unwrap()
        .listen(&Endpoint::Tcp("127.0.0.1:0".into()))
        .unwrap()
        .start()
        .unwrap();
    for ep in handle.local_endpoints() {
        let before = handler.handled.lock().unwrap().len();
        // The socket alone (a shared-memory request is a call of its own, handed off).
        let connect = || {
            let transport = match ep {
                Endpoint::Unix(_) => remora_oncrpc::TransportChoice::Unix,
                Endpoint::Tcp(_) | Endpoint::Tls(_) => remora_oncrpc::TransportChoice::Tcp,
            };
            Client::connect_with(
                &ep,
                remora_oncrpc::ClientConfig {
                    transport,
                    ..Default::default()
                },
            )
            .unwrap()
        };
        let probe = connect();
        null(&probe, PROG).unwrap();
        null(&probe, PROG).unwrap();
        drop(probe);
        std::thread::sleep(Duration::from_millis(50));
        assert_eq!(
            handler.handled.lock().unwrap().len(),
            before,
            "{ep}: a ping started a handler"
        );
        // A ping, then a real call on the same connection: handed off, and answered.
        let c = connect();
        null(&c, PROG).unwrap();
        assert_eq!(call(&c, FAST, 5).unwrap(), 10);
        assert_eq!(handler.handled.lock().unwrap().len(), before + 1);
        // NULL of a program this server does not serve is the handler's to answer.
        let d = connect();
        let _ = null(&d, PROG + 1);
        assert_eq!(handler.handled.lock().unwrap().len(), before + 2);
        drop((c, d));
    }
    handle.shutdown();
}
