//! The shared-memory transport: transport choice, the bootstrap, and peers that misbehave
//! (scribbled ring indices, a client process killed mid-record). The ordinary client/server
//! suite also runs over shared memory (`Transport::Shm` in `client_server.rs`).

mod common;

use std::io::{BufRead, BufReader, Read, Write};
use std::process::{Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use remora_oncrpc::record::{RecordReader, write_record};
use remora_oncrpc::xdr::Bytes;
use remora_oncrpc::{Client, ClientConfig, Endpoint, RpcError, ServerConfig, TransportChoice};

fn add(c: &Client, a: i32, b: i32) -> Result<i32, RpcError> {
    c.call(
        PROG,
        1,
        ADD,
        None,
        |e| {
            e.put_i32(a);
            e.put_i32(b);
            Ok(())
        },
        |d| d.get_i32(),
    )
}

fn with(transport: TransportChoice) -> ClientConfig {
    ClientConfig {
        transport,
        ..ClientConfig::default()
    }
}

fn socket_path(ep: &Endpoint) -> std::path::PathBuf {
    match ep {
        Endpoint::Unix(p) => p.clone(),
        Endpoint::Tcp(_) | Endpoint::Tls(_) => panic!("not a Unix endpoint"),
    }
}

fn wait_for_connections(s: &TestServer, n: usize) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.handle().connection_count() != n {
        assert!(
            Instant::now() < deadline,
            "{} connections, expected {n}",
            s.handle().connection_count()
        );
        thread::sleep(Duration::from_millis(10));
    }
}

#[test]
fn auto_picks_shared_memory_for_unix_and_tcp_for_tcp() {
    let unix = start(Transport::Shm);
    let c = Client::connect_with(&unix.endpoint, with(TransportChoice::Auto)).unwrap();
    assert!(c.is_shm());
    assert_eq!(add(&c, 2, 3).unwrap(), 5);
    let plain = Client::connect_with(&unix.endpoint, with(TransportChoice::Unix)).unwrap();
    assert!(!plain.is_shm());
    assert_eq!(add(&plain, 2, 3).unwrap(), 5);
    let tcp = start(Transport::Tcp);
    let c = Client::connect_with(&tcp.endpoint, with(TransportChoice::Auto)).unwrap();
    assert!(!c.is_shm());
    assert_eq!(add(&c, 2, 3).unwrap(), 5);
}

#[test]
fn impossible_choices_fail_clearly() {
    let tcp = start(Transport::Tcp);
    let e = Client::connect_with(&tcp.endpoint, with(TransportChoice::Shm)).unwrap_err();
    assert!(matches!(e, RpcError::Transport { .. }), "{e}");
    assert!(e.to_string().contains("unix:///PATH"), "{e}");
    let e = Client::connect_with(&tcp.endpoint, with(TransportChoice::Unix)).unwrap_err();
    assert!(matches!(e, RpcError::Transport { .. }), "{e}");
    let unix = start(Transport::Shm);
    let e = Client::connect_with(&unix.endpoint, with(TransportChoice::Tcp)).unwrap_err();
    assert!(e.to_string().contains("tcp://HOST:PORT"), "{e}");
}

#[test]
fn a_server_without_shared_memory_keeps_auto_clients_on_the_socket() {
    let s = start_with(
        Transport::Shm,
        ServerConfig {
            shm_ring_capacity: 0,
            ..ServerConfig::default()
        },
    );
    let c = Client::connect_with(&s.endpoint, with(TransportChoice::Auto)).unwrap();
    assert!(!c.is_shm());
    assert_eq!(add(&c, 1, 2).unwrap(), 3);
    let e = Client::connect_with(&s.endpoint, with(TransportChoice::Shm)).unwrap_err();
    assert!(
        e.to_string().contains("does not offer shared memory"),
        "{e}"
    );
}

#[test]
fn a_plain_oncrpc_server_answers_prog_unavail_and_auto_falls_back() {
    // A listener that answers every call PROG_UNAVAIL, as a server without the program does:
    // the hand-made server below reads one record and replies.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("plain.sock");
    let listener = std::os::unix::net::UnixListener::bind(&path).unwrap();
    let t = thread::spawn(move || {
        let (sock, _) = listener.accept().unwrap();
        let mut rd = RecordReader::new(sock.try_clone().unwrap(), 1 << 16);
        for _ in 0..2 {
            let rec = rd.read_record().unwrap().unwrap();
            let xid = [rec[0], rec[1], rec[2], rec[3]];
            let mut reply = Vec::new();
            reply.extend_from_slice(&xid);
            for w in [1u32, 0, 0, 0, 1] {
                reply.extend_from_slice(&w.to_be_bytes());
            }
            write_record(&mut &sock, &[Bytes::from(reply)], 1 << 20).unwrap();
        }
    });
    let c = Client::connect_with(&Endpoint::Unix(path), with(TransportChoice::Auto)).unwrap();
    assert!(!c.is_shm());
    assert!(matches!(add(&c, 1, 1), Err(RpcError::ProgUnavail { .. })));
    t.join().unwrap();
}

#[test]
fn sessions_are_freed_when_clients_go() {
    let s = start(Transport::Shm);
    let clients: Vec<Client> = (0..4).map(|_| s.client().unwrap()).collect();
    for (i, c) in clients.iter().enumerate() {
        assert_eq!(add(c, i as i32, 1).unwrap(), i as i32 + 1);
    }
    wait_for_connections(&s, 4);
    drop(clients);
    wait_for_connections(&s, 0);
}

#[test]
fn concurrent_threads_on_one_shm_client() {
    let s = start(Transport::Shm);
    let c = s.client().unwrap();
    let threads: Vec<_> = (0..8)
        .map(|t| {
            let c = c.clone();
            thread::spawn(move || {
                for i in 0..500 {
                    assert_eq!(add(&c, t, i).unwrap(), t + i);
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
}

/// A NULL call record of the test program.
fn null_call(xid: u32) -> Vec<Bytes> {
    vec![Bytes::from(call_header(xid, PROG, 1, NULLPROC))]
}

#[test]
fn hostile_ring_indices_close_that_session_only() {
    let s = start(Transport::Shm);
    let good = s.client().unwrap();
    let path = socket_path(&s.endpoint);
    let mut bad = remora_oncrpc::shm::connect(&path, Duration::from_secs(5)).unwrap();
    write_record(&mut bad, &null_call(7), 1 << 20).unwrap();
    let mut rd = RecordReader::new(bad.clone(), 1 << 16);
    let reply = rd.read_record().unwrap().unwrap();
    assert_eq!(&reply[..4], &7u32.to_be_bytes());
    wait_for_connections(&s, 2);
    // Scribble on the request ring's tail (the first word after the region's one-page
    // header) through the memfd, as a hostile client can: tail - head > size.
    let fd = bad.region().fd();
    rustix::io::pwrite(fd, &0x8000_0000u32.to_le_bytes(), 4096).unwrap();
    // The server notices within a sleep slice, closes that session (the client sees end of
    // file) and goes on serving the others.
    let start = Instant::now();
    assert!(matches!(rd.read_record(), Ok(None) | Err(_)));
    assert!(start.elapsed() < Duration::from_secs(3));
    wait_for_connections(&s, 1);
    assert_eq!(add(&good, 20, 22).unwrap(), 42);
    let again = s.client().unwrap();
    assert_eq!(add(&again, 1, 1).unwrap(), 2);
}

#[test]
fn a_hostile_length_word_closes_the_session() {
    let s = start(Transport::Shm);
    let path = socket_path(&s.endpoint);
    let bad = remora_oncrpc::shm::connect(&path, Duration::from_secs(5)).unwrap();
    // A message whose length word claims more than was published: a length word of 1000 at
    // the start of the request ring's message area (256 bytes into the ring), then a tail
    // publishing 8 bytes.
    let fd = bad.region().fd();
    rustix::io::pwrite(fd, &1000u32.to_le_bytes(), 4096 + 256).unwrap();
    rustix::io::pwrite(fd, &8u32.to_le_bytes(), 4096).unwrap();
    let mut buf = [0u8; 8];
    let got = (&bad).read(&mut buf);
    assert!(matches!(got, Ok(0) | Err(_)), "{got:?}");
    wait_for_connections(&s, 0);
}

/// Not a test on its own: the child process of `a_client_killed_mid_record_frees_its_session`.
#[test]
#[ignore = "helper run as a child process"]
fn child_shm_client() {
    let Some(path) = std::env::var_os("REMORA_TEST_SHM_CHILD") else {
        return;
    };
    let mut s = remora_oncrpc::shm::connect(path.as_ref(), Duration::from_secs(5)).unwrap();
    // Half a record: a header announcing 1000 bytes, then 100 of them.
    s.write_all(&(0x8000_0000u32 | 1000).to_be_bytes()).unwrap();
    s.write_all(&[0u8; 100]).unwrap();
    println!("CHILD-READY");
    std::io::stdout().flush().unwrap();
    thread::sleep(Duration::from_secs(60));
}

#[test]
fn a_client_killed_mid_record_frees_its_session() {
    let s = start(Transport::Shm);
    let good = s.client().unwrap();
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "child_shm_client",
            "--ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env("REMORA_TEST_SHM_CHILD", socket_path(&s.endpoint))
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(child.stdout.take().unwrap());
    let mut line = String::new();
    loop {
        line.clear();
        assert!(
            out.read_line(&mut line).unwrap() > 0,
            "the child ended early"
        );
        if line.contains("CHILD-READY") {
            break;
        }
    }
    wait_for_connections(&s, 2);
    child.kill().unwrap();
    child.wait().unwrap();
    // The server thread, waiting for the rest of the record, sees the socket hang up.
    wait_for_connections(&s, 1);
    assert_eq!(add(&good, 2, 2).unwrap(), 4);
}

#[test]
fn large_records_stream_through_small_rings() {
    let s = start_with(
        Transport::Shm,
        ServerConfig {
            shm_ring_capacity: 4096,
            ..ServerConfig::default()
        },
    );
    let c = s.client().unwrap();
    let data = Bytes::from(
        (0..3_000_000u32)
            .map(|i| (i % 251) as u8)
            .collect::<Vec<u8>>(),
    );
    let back: Bytes = c
        .call(
            PROG,
            1,
            ECHO,
            None,
            |e| e.put_opaque_bytes(&data, remora_oncrpc::xdr::UNBOUNDED),
            |d| d.get_opaque(remora_oncrpc::xdr::UNBOUNDED),
        )
        .unwrap();
    assert_eq!(back, data);
}

#[test]
fn a_client_that_stops_reading_replies_is_closed_after_the_stall_timeout() {
    let s = start_with(
        Transport::Shm,
        ServerConfig {
            stall_timeout: Duration::from_millis(300),
            shm_ring_capacity: 4096,
            ..ServerConfig::default()
        },
    );
    let good = s.client().unwrap();
    let path = socket_path(&s.endpoint);
    let bad = remora_oncrpc::shm::connect(&path, Duration::from_secs(5)).unwrap();
    bad.set_write_timeout(Some(Duration::from_millis(50)))
        .unwrap();
    wait_for_connections(&s, 2);
    // Calls whose replies fill the 4 KiB response ring, never read: the server's reply write
    // stalls, times out and the session ends (the client's own writes may stall too once
    // the server stops reading; they time out quickly and are ignored).
    let started = Instant::now();
    let mut w = bad.clone();
    for xid in 0..1000 {
        if write_record(&mut w, &null_call(xid), 1 << 20).is_err() {
            break;
        }
    }
    wait_for_connections(&s, 1);
    assert!(started.elapsed() < Duration::from_secs(5));
    // The others are served on.
    assert_eq!(add(&good, 40, 2).unwrap(), 42);
}
