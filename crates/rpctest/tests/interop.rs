//! Interop with Debian's rpcgen + libtirpc, from the same `rpctest.x`:
//! C client → Rust server, Rust client → C server, `rpcinfo` → Rust server, over TCP and Unix
//! sockets, including unions, optional lists, arrays and a 64 MiB opaque echo both ways.
//!
//! Skips (with the reason printed) only when rpcgen, libtirpc headers or a C compiler are
//! missing; `scripts/test` installs them, so CI always runs these.

use std::sync::{Arc, OnceLock};
use std::time::Duration;

use remora_oncrpc::{Client, Endpoint, Server, ServerConfig, ServerHandle};
use remora_rpctest::RtService;
use remora_rpctest::peers::{CPeers, endpoint_to_c, unavailable_reason};
use remora_rpctest::rpctest::*;
use remora_xdr::Bytes;

const BIG: usize = 64 << 20;

fn peers() -> Option<&'static CPeers> {
    static PEERS: OnceLock<Option<CPeers>> = OnceLock::new();
    PEERS
        .get_or_init(|| {
            if let Some(reason) = unavailable_reason() {
                eprintln!("SKIPPED: libtirpc interop tests need the C peers: {reason}");
                return None;
            }
            Some(CPeers::build().expect("building the libtirpc peers with rpcgen"))
        })
        .as_ref()
}

fn rust_server(endpoint: Endpoint) -> ServerHandle {
    Server::builder(ServerConfig::default())
        .service(Arc::new(RpctestV1Service::new(RtService)))
        .listen(&endpoint)
        .expect("listen")
        .start()
        .expect("start")
}

fn endpoints(dir: &tempfile::TempDir) -> [Endpoint; 2] {
    [
        Endpoint::Tcp("127.0.0.1:0".into()),
        Endpoint::Unix(dir.path().join("rt.sock")),
    ]
}

fn pattern(len: usize) -> Bytes {
    (0..len)
        .map(|i| (i * 7 + (i >> 13)) as u8)
        .collect::<Vec<u8>>()
        .into()
}

fn list(values: &[i32]) -> IntList {
    values
        .iter()
        .rev()
        .fold(None, |next, &value| Some(Box::new(IntNode { value, next })))
}

fn list_values(mut l: &IntList) -> Vec<i32> {
    let mut out = Vec::new();
    while let Some(node) = l {
        out.push(node.value);
        l = &node.next;
    }
    out
}

/// The Rust client's half of the matrix: the same checks the C client makes.
fn rust_client_checks(endpoint: &Endpoint) {
    let rpc = Client::connect(endpoint).expect("connect");
    let c = RpctestV1Client::new(rpc).with_timeout(Duration::from_secs(120));
    c.rt_null().expect("null");
    assert_eq!(c.rt_add(&40, &2).unwrap(), 42);
    assert_eq!(
        c.rt_add(&i32::MAX, &1).unwrap(),
        i32::MIN,
        "wrapping add on both sides"
    );
    assert_eq!(
        &c.rt_echo(&Bytes::from_static(b"hello")).unwrap()[..],
        b"hello"
    );

    let shapes = [
        Shape::ShapeCircle(2.5),
        Shape::ShapeRect(RectDims {
            width: 3.0,
            height: -4.25,
        }),
        Shape::ShapePolygon(vec![Point { x: 1, y: 2 }, Point { x: -3, y: 4 }]),
        Shape::ShapePoint(vec![Point { x: 5, y: -6 }]),
        Shape::Default {
            discriminant: ShapeKind::ShapeNone,
        },
    ];
    for s in shapes {
        assert_eq!(c.rt_shape_echo(&s).unwrap(), s);
    }

    let l = list(&[10, 20, 30, 40, 50]);
    assert_eq!(
        list_values(&c.rt_list_reverse(&l).unwrap()),
        [50, 40, 30, 20, 10]
    );
    assert_eq!(c.rt_list_sum(&l).unwrap(), 150);
    assert_eq!(c.rt_list_reverse(&None).unwrap(), None);

    let a = Arrays {
        fixed: [1, -2, 3, i32::MAX],
        wide: vec![u64::MAX, 42],
        names: "abcdefg".into(),
        tag: *b"xyz",
        flags: vec![true, false, true],
        f: 1.5,
        d: -0.125,
        h: -1_234_567_890_123,
        u: 4_000_000_000,
    };
    assert_eq!(c.rt_arrays_echo(&a).unwrap(), a);

    let n = NameList {
        names: vec!["alpha".into(), String::new(), "gamma-delta".into()],
    };
    assert_eq!(c.rt_names_echo(&n).unwrap(), n);

    let big = pattern(BIG);
    let back = c.rt_echo(&big).expect("64 MiB echo");
    assert!(back == big, "64 MiB echo came back different");
}

#[test]
fn rust_client_to_c_server() {
    let Some(peers) = peers() else { return };
    let dir = tempfile::tempdir().unwrap();
    for addr in [
        "tcp:127.0.0.1:0".to_owned(),
        format!("unix:{}", dir.path().join("c.sock").display()),
    ] {
        let server = peers.start_server(&addr).expect("start the C server");
        rust_client_checks(&server.endpoint());
    }
}

#[test]
fn c_client_to_rust_server() {
    let Some(peers) = peers() else { return };
    let dir = tempfile::tempdir().unwrap();
    for endpoint in endpoints(&dir) {
        let server = rust_server(endpoint);
        let addr = endpoint_to_c(&server.local_endpoints()[0]);
        let out = peers
            .run_client(&addr, &["check", "64"])
            .expect("run the C client");
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "C client against the Rust server at {addr} failed:\n{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(
            stdout.contains("ok echo_big") && stdout.contains("13 of 13 checks ok"),
            "{stdout}"
        );
        server.shutdown();
    }
}

#[test]
fn rust_client_to_rust_server() {
    let dir = tempfile::tempdir().unwrap();
    for endpoint in endpoints(&dir) {
        let server = rust_server(endpoint);
        rust_client_checks(&server.local_endpoints()[0]);
        server.shutdown();
    }
}

/// `rpcinfo -n PORT -t 127.0.0.1 PROG [VERS]` against the Rust server. Debian's rpcinfo
/// (rpcbind 1.2.6) asks rpcbind for the port even when `-n` names it, so the server registers
/// with rpcbind first (which also checks our registration end to end).
#[test]
fn rpcinfo_pings_the_rust_server() {
    let rpcinfo = ["/usr/sbin/rpcinfo", "/usr/bin/rpcinfo", "/sbin/rpcinfo"]
        .into_iter()
        .find(|p| std::path::Path::new(p).exists());
    let Some(rpcinfo) = rpcinfo else {
        eprintln!("SKIPPED: rpcinfo is not installed (package rpcbind)");
        return;
    };
    let server = rust_server(Endpoint::Tcp("127.0.0.1:0".into()));
    if let Err(e) = server.register_rpcbind() {
        eprintln!("SKIPPED: rpcinfo needs a running rpcbind to look the port up: {e}");
        return;
    }
    let Endpoint::Tcp(addr) = &server.local_endpoints()[0] else {
        unreachable!()
    };
    let port = addr.rsplit_once(':').unwrap().1.to_owned();
    let prog = RPCTEST_PROG.to_string();
    let run = |args: &[&str]| {
        let out = std::process::Command::new(rpcinfo)
            .args(args)
            .output()
            .expect("run rpcinfo");
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    };
    let (ok, text) = run(&["-n", &port, "-t", "127.0.0.1", &prog, "1"]);
    assert!(ok && text.contains("version 1 ready and waiting"), "{text}");
    // Without a version rpcinfo probes with version 0, gets PROG_MISMATCH (1..1) from our
    // server, then pings each supported version.
    let (ok, text) = run(&["-n", &port, "-t", "127.0.0.1", &prog]);
    assert!(ok && text.contains("version 1 ready and waiting"), "{text}");
    server.shutdown();
}
