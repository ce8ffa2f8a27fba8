//! Hostile and malformed input, against the real server and the real client.

mod common;

use std::io::{Read, Write};
use std::net::{Shutdown, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use common::*;
use remora_oncrpc::{Client, Endpoint, RpcError, ServerConfig};

fn still_serving(ep: &Endpoint) {
    let c = Client::connect(ep).unwrap();
    let v: i32 = c
        .call(
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
        .unwrap();
    assert_eq!(v, 42);
}

fn wait_for_no_connections(s: &TestServer) {
    let deadline = Instant::now() + Duration::from_secs(5);
    while s.handle().connection_count() > 0 {
        assert!(Instant::now() < deadline, "connection not closed");
        thread::sleep(Duration::from_millis(5));
    }
}

// ---- server side ----

#[test]
fn server_truncated_record() {
    for t in BOTH {
        let s = start(t);
        let mut raw = Raw::connect(&s.endpoint);
        // Declares 100 bytes, sends 10, then closes its write side.
        raw.write_all(&[0x80, 0, 0, 100]).unwrap();
        raw.write_all(&[0; 10]).unwrap();
        match &raw {
            Raw::Tcp(s) => s.shutdown(Shutdown::Write).unwrap(),
            Raw::Unix(s) => s.shutdown(Shutdown::Write).unwrap(),
        }
        assert!(raw.closed_within(Duration::from_secs(3)));
        wait_for_no_connections(&s);
        still_serving(&s.endpoint);
    }
}

#[test]
fn server_record_length_0x7fffffff() {
    for t in BOTH {
        let s = start(t);
        let mut raw = Raw::connect(&s.endpoint);
        raw.write_all(&[0xff, 0xff, 0xff, 0xff, 0, 0, 0, 1])
            .unwrap();
        // Rejected at the header, before reading further: the connection closes at once.
        assert!(raw.closed_within(Duration::from_secs(3)));
        still_serving(&s.endpoint);
    }
}

#[test]
fn server_opaque_length_0xffffffff() {
    for t in BOTH {
        let s = start(t);
        let mut raw = Raw::connect(&s.endpoint);
        let mut call = call_header(9, PROG, 1, ECHO);
        call.extend([0xff, 0xff, 0xff, 0xff, 1, 2, 3, 4]);
        raw.send_record(&call);
        // GARBAGE_ARGS, and the connection goes on.
        assert_eq!(words(&raw.read_record()), [9, 1, 0, 0, 0, 4]);
        raw.send_record(&call_header(10, PROG, 1, NULLPROC));
        assert_eq!(words(&raw.read_record()), [10, 1, 0, 0, 0, 0]);
    }
}

#[test]
fn server_unknown_msg_type() {
    for t in BOTH {
        let s = start(t);
        let mut raw = Raw::connect(&s.endpoint);
        let mut call = call_header(11, PROG, 1, NULLPROC);
        call[7] = 7; // msg_type 7
        raw.send_record(&call);
        assert_eq!(words(&raw.read_record()), [11, 1, 0, 0, 0, 4]);
        // Undecodable header with a readable xid: GARBAGE_ARGS.
        raw.send_record(&[0, 0, 0, 12, 0, 0]);
        assert_eq!(words(&raw.read_record()), [12, 1, 0, 0, 0, 4]);
        // An oversized credential body: AUTH_ERROR AUTH_BADCRED.
        let mut call = call_header(13, PROG, 1, NULLPROC);
        call.truncate(24);
        call.extend([0, 0, 0, 1, 0, 0, 1, 0x94]);
        call.extend([0u8; 404]);
        call.extend([0u8; 8]);
        raw.send_record(&call);
        assert_eq!(words(&raw.read_record()), [13, 1, 1, 1, 1]);
        // A record too short for an xid: the connection is closed.
        raw.send_record(&[1, 2]);
        assert!(raw.closed_within(Duration::from_secs(3)));
        still_serving(&s.endpoint);
    }
}

#[test]
fn server_unknown_auth_flavour_rejected() {
    let s = start(Transport::Tcp);
    let mut raw = Raw::connect(&s.endpoint);
    let mut call = call_header(5, PROG, 1, NULLPROC);
    call[27] = 6; // RPCSEC_GSS credential, empty body
    raw.send_record(&call);
    // MSG_DENIED, AUTH_ERROR, AUTH_REJECTEDCRED
    assert_eq!(words(&raw.read_record()), [5, 1, 1, 1, 2]);
}

#[test]
fn server_reply_message_closes_connection() {
    for t in BOTH {
        let s = start(t);
        let mut raw = Raw::connect(&s.endpoint);
        // A REPLY (SUCCESS) sent to the server.
        raw.send_record(&[
            0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0,
        ]);
        assert!(raw.closed_within(Duration::from_secs(3)));
        still_serving(&s.endpoint);
    }
}

#[test]
fn server_peer_closes_mid_record() {
    for t in BOTH {
        let s = start(t);
        {
            let mut raw = Raw::connect(&s.endpoint);
            let mut rec = vec![0x80, 0, 0, 44];
            rec.extend(call_header(1, PROG, 1, NULLPROC));
            raw.write_all(&rec[..20]).unwrap();
            thread::sleep(Duration::from_millis(20));
        } // dropped: closed mid-record
        wait_for_no_connections(&s);
        still_serving(&s.endpoint);
    }
}

#[test]
fn server_closes_stalled_connection_after_stall_timeout() {
    for t in BOTH {
        let s = start_with(
            t,
            ServerConfig {
                stall_timeout: Duration::from_millis(200),
                ..ServerConfig::default()
            },
        );
        let mut raw = Raw::connect(&s.endpoint);
        let t0 = Instant::now();
        raw.write_all(&[0x80, 0, 0, 40, 0, 0]).unwrap();
        // Other clients are served meanwhile.
        still_serving(&s.endpoint);
        assert!(raw.closed_within(Duration::from_secs(5)));
        let took = t0.elapsed();
        assert!(took >= Duration::from_millis(200), "{took:?}");
        assert!(took < Duration::from_secs(2), "{took:?}");
        // An idle connection (between records) is not subject to the stall timeout.
        let mut idle = Raw::connect(&s.endpoint);
        assert!(!idle.closed_within(Duration::from_millis(500)));
    }
}

#[test]
fn many_large_partial_records_share_the_servers_record_budget() {
    // Eight peers each declare a 32 MiB record and send 8 MiB of it; the server's
    // partial-record memory stays within its budget (one record alone may pass it), other
    // clients are served, and the stall timeout ends the waiting peers.
    const BUDGET: usize = 8 << 20;
    let budget = remora_oncrpc::record::RecordBudget::new(BUDGET);
    let s = start_with(
        Transport::Tcp,
        ServerConfig {
            record_budget: std::sync::Arc::clone(&budget),
            stall_timeout: Duration::from_secs(2),
            ..ServerConfig::default()
        },
    );
    let senders: Vec<_> = (0..8)
        .map(|_| {
            let ep = s.endpoint.clone();
            thread::spawn(move || {
                let mut raw = Raw::connect(&ep);
                if let Raw::Tcp(t) = &raw {
                    t.set_write_timeout(Some(Duration::from_secs(1))).unwrap();
                }
                let declared: u32 = 32 << 20;
                let _ = raw.write_all(&(declared | 0x8000_0000).to_be_bytes());
                let chunk = vec![0u8; 1 << 20];
                for _ in 0..8 {
                    if raw.write_all(&chunk).is_err() {
                        break;
                    }
                }
                raw
            })
        })
        .collect();
    let mut peak = 0;
    let deadline = Instant::now() + Duration::from_secs(3);
    while Instant::now() < deadline {
        peak = peak.max(budget.used());
        thread::sleep(Duration::from_millis(5));
    }
    assert!(
        peak <= BUDGET + (8 << 20),
        "{peak} bytes of partial records past a budget of {BUDGET} (and one record alone)"
    );
    assert!(
        peak >= BUDGET / 2,
        "the peers' records drew on the budget: {peak}"
    );
    still_serving(&s.endpoint);
    let raws: Vec<Raw> = senders.into_iter().map(|h| h.join().unwrap()).collect();
    wait_for_no_connections(&s);
    assert_eq!(budget.used(), 0, "closed connections gave their room back");
    drop(raws);
}

// ---- client side, against scripted fake servers ----

/// A fake server on TCP loopback running `script` on its one connection.
fn fake_server(
    script: impl FnOnce(TcpStream) + Send + 'static,
) -> (Endpoint, thread::JoinHandle<()>) {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let ep = Endpoint::from(l.local_addr().unwrap());
    let h = thread::spawn(move || {
        let (s, _) = l.accept().unwrap();
        script(s);
    });
    (ep, h)
}

/// Reads one call record and returns its xid.
fn read_call(s: &mut TcpStream) -> u32 {
    let mut raw = Raw::Tcp(s.try_clone().unwrap());
    let rec = raw.read_record();
    words(&rec)[0]
}

fn send(s: &mut TcpStream, payload: &[u8]) {
    let mut raw = Raw::Tcp(s.try_clone().unwrap());
    raw.send_record(payload);
}

fn success_reply(xid: u32, result: &[u32]) -> Vec<u8> {
    let mut v = Vec::new();
    for w in [xid, 1, 0, 0, 0, 0].iter().chain(result) {
        v.extend_from_slice(&w.to_be_bytes());
    }
    v
}

fn call_u32(c: &Client, timeout: Duration) -> Result<u32, RpcError> {
    c.call(PROG, 1, 1, Some(timeout), |_| Ok(()), |d| d.get_u32())
}

#[test]
fn client_drops_reply_with_unknown_xid() {
    let (ep, h) = fake_server(|mut s| {
        for _ in 0..2 {
            let xid = read_call(&mut s);
            send(&mut s, &success_reply(xid.wrapping_add(1000), &[1]));
            send(&mut s, &success_reply(xid, &[7]));
        }
    });
    let c = Client::connect(&ep).unwrap();
    assert_eq!(call_u32(&c, Duration::from_secs(5)).unwrap(), 7);
    assert_eq!(call_u32(&c, Duration::from_secs(5)).unwrap(), 7);
    h.join().unwrap();
}

#[test]
fn client_drops_call_message() {
    let (ep, h) = fake_server(|mut s| {
        let xid = read_call(&mut s);
        send(&mut s, &call_header(xid, PROG, 1, 0));
        send(&mut s, &success_reply(xid, &[8]));
    });
    let c = Client::connect(&ep).unwrap();
    assert_eq!(call_u32(&c, Duration::from_secs(5)).unwrap(), 8);
    h.join().unwrap();
}

#[test]
fn client_unknown_discriminants_in_reply() {
    let (ep, h) = fake_server(|mut s| {
        // reply_stat 5, accept_stat 9, reject_stat 4, auth_stat 77, msg_type 3, then a good one.
        let xid = read_call(&mut s);
        send(&mut s, &words_to_bytes(&[xid, 1, 5]));
        let xid = read_call(&mut s);
        send(&mut s, &words_to_bytes(&[xid, 1, 0, 0, 0, 9]));
        let xid = read_call(&mut s);
        send(&mut s, &words_to_bytes(&[xid, 1, 1, 4]));
        let xid = read_call(&mut s);
        send(&mut s, &words_to_bytes(&[xid, 1, 1, 1, 77]));
        let xid = read_call(&mut s);
        send(&mut s, &words_to_bytes(&[xid, 3, 0]));
        send(&mut s, &success_reply(xid, &[3]));
        // RPC_MISMATCH(2, 2) from a "server", mapped by the client.
        let xid = read_call(&mut s);
        send(&mut s, &words_to_bytes(&[xid, 1, 1, 0, 2, 2]));
    });
    let c = Client::connect(&ep).unwrap();
    let t = Duration::from_secs(5);
    for name in ["reply_stat", "accept_stat", "reject_stat", "auth_stat"] {
        match call_u32(&c, t) {
            Err(RpcError::MalformedReply(remora_oncrpc::xdr::Error::UnknownDiscriminant {
                type_name,
                ..
            })) => assert_eq!(type_name, name),
            other => panic!("{name}: {other:?}"),
        }
    }
    // A message of unknown type is dropped; the good reply after it is delivered.
    assert_eq!(call_u32(&c, t).unwrap(), 3);
    let e = call_u32(&c, t).unwrap_err();
    assert!(
        matches!(e, RpcError::RpcMismatch { low: 2, high: 2 }),
        "{e}"
    );
    h.join().unwrap();
}

fn words_to_bytes(w: &[u32]) -> Vec<u8> {
    w.iter().flat_map(|w| w.to_be_bytes()).collect()
}

#[test]
fn client_peer_closes_mid_record() {
    let (ep, h) = fake_server(|mut s| {
        let xid = read_call(&mut s);
        let reply = success_reply(xid, &[1]);
        let mut rec = (0x8000_0000u32 | reply.len() as u32).to_be_bytes().to_vec();
        rec.extend(&reply[..10]);
        s.write_all(&rec).unwrap();
        // Closes the connection in the middle of the reply record.
    });
    let c = Client::connect(&ep).unwrap();
    let e = call_u32(&c, Duration::from_secs(5)).unwrap_err();
    assert!(matches!(e, RpcError::ConnectionLost), "{e}");
    h.join().unwrap();
    let t0 = Instant::now();
    assert!(matches!(
        call_u32(&c, Duration::from_secs(5)),
        Err(RpcError::ConnectionLost)
    ));
    assert!(t0.elapsed() < Duration::from_millis(100));
}

#[test]
fn client_times_out_on_silent_server() {
    let (ep, h) = fake_server(|mut s| {
        let _ = read_call(&mut s);
        // Sends a reply header and part of the record, then goes silent.
        s.write_all(&[0x80, 0, 0, 28, 0, 0]).unwrap();
        let mut b = [0u8; 1];
        let _ = s.read(&mut b); // until the client closes
    });
    let c = Client::connect(&ep).unwrap();
    let t0 = Instant::now();
    let e = call_u32(&c, Duration::from_millis(150)).unwrap_err();
    assert!(matches!(e, RpcError::Timeout { .. }), "{e}");
    assert!(t0.elapsed() < Duration::from_secs(2));
    drop(c);
    h.join().unwrap();
}

#[test]
fn client_rejects_oversized_reply() {
    let (ep, h) = fake_server(|mut s| {
        let _ = read_call(&mut s);
        s.write_all(&[0xff, 0xff, 0xff, 0xff]).unwrap();
        let mut b = [0u8; 1];
        let _ = s.read(&mut b);
    });
    let cfg = remora_oncrpc::ClientConfig {
        max_record_size: 1 << 20,
        ..Default::default()
    };
    let c = Client::connect_with(&ep, cfg).unwrap();
    let e = call_u32(&c, Duration::from_secs(5)).unwrap_err();
    assert!(
        matches!(
            e,
            RpcError::RecordTooLarge {
                size: 0x7fff_ffff,
                max: 0x10_0000
            }
        ),
        "{e}"
    );
    assert!(matches!(
        call_u32(&c, Duration::from_secs(5)),
        Err(RpcError::ConnectionLost)
    ));
    drop(c);
    h.join().unwrap();
}
