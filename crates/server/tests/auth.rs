//! Token authentication (`remora serve --auth-token-file`, `REMORA_HELLO_AUTH`) under thread
//! isolation, over TCP and Unix sockets, on the emulated backend: the right token is served
//! (shared memory too), a wrong one and none are refused clearly and the connection closed,
//! nothing (not even `SHM_SETUP`) is served before authentication, token files must be
//! private, and a TCP listener other hosts can reach needs tokens or `--insecure`.
//! Process isolation is tested through the binary (`crates/cli/tests/auth.rs`).

use std::io::{Read, Write};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::time::Duration;

use remora_client::{AuthToken, Session, SessionConfig};
use remora_oncrpc::{AuthStat, Client, ClientConfig, Endpoint, RpcError, TransportChoice};
use remora_proto::remora::*;
use remora_server::{BackendChoice, Isolation, Running, ServeConfig, ServeError};

const ALICE: &str = "alice-token-0123456789";
const BOB: &str = "bob-token-abcdefghijkl";

fn token_file(dir: &Path, text: &str, mode: u32) -> PathBuf {
    let path = dir.join("tokens");
    std::fs::write(&path, text).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(mode)).unwrap();
    path
}

fn serve(dir: &Path) -> Running {
    remora_server::start(ServeConfig {
        listen: vec![
            Endpoint::Unix(dir.join("r.sock")),
            Endpoint::Tcp("127.0.0.1:0".into()),
        ],
        backend: BackendChoice::Emulated,
        isolation: Some(Isolation::Thread),
        auth_token_file: Some(token_file(
            dir,
            &format!("# tenants\nalice {ALICE}\n\nbob {BOB}\n"),
            0o600,
        )),
        ..ServeConfig::default()
    })
    .unwrap()
}

fn hello_args() -> HelloArgs {
    HelloArgs {
        min_revision: 2,
        max_revision: REMORA_PROTOCOL_REVISION,
        client_name: "auth test".into(),
        capabilities: u64::from(REMORA_CAP_ONEWAY),
    }
}

fn session(endpoint: &Endpoint, token: Option<&str>) -> Result<Session, remora_client::CuError> {
    Session::connect_with(
        endpoint,
        SessionConfig {
            auth_token: token.map(|t| AuthToken::new(t).unwrap()),
            ..SessionConfig::default()
        },
    )
}

/// A connection that presents `token` first (a socket, never shared memory).
fn raw_connect(endpoint: &Endpoint, token: &str) -> Result<Client, RpcError> {
    let transport = match endpoint {
        Endpoint::Unix(_) => TransportChoice::Unix,
        Endpoint::Tcp(_) | Endpoint::Tls(_) => TransportChoice::Tcp,
    };
    Client::connect_with(
        endpoint,
        ClientConfig {
            transport,
            opening_call: Some(
                remora_proto::token::hello_auth_call(&hello_args(), token.as_bytes()).unwrap(),
            ),
            ..ClientConfig::default()
        },
    )
}

fn plain_client(endpoint: &Endpoint) -> RemoraV1Client {
    let transport = match endpoint {
        Endpoint::Unix(_) => TransportChoice::Unix,
        Endpoint::Tcp(_) | Endpoint::Tls(_) => TransportChoice::Tcp,
    };
    let rpc = Client::connect_with(
        endpoint,
        ClientConfig {
            transport,
            ..ClientConfig::default()
        },
    )
    .unwrap();
    RemoraV1Client::new(rpc).with_timeout(Duration::from_secs(10))
}

/// One raw stream to `endpoint`.
fn raw_stream(endpoint: &Endpoint) -> Box<dyn ReadWrite> {
    match endpoint {
        Endpoint::Unix(p) => Box::new(std::os::unix::net::UnixStream::connect(p).unwrap()),
        Endpoint::Tcp(a) | Endpoint::Tls(a) => {
            Box::new(std::net::TcpStream::connect(a.as_str()).unwrap())
        }
    }
}

trait ReadWrite: Read + Write {}
impl<T: Read + Write> ReadWrite for T {}

/// Writes one call record (AUTH_NONE) of `procedure` with `args`.
fn send_call(s: &mut dyn ReadWrite, xid: u32, program: u32, procedure: u32, args: &[u8]) {
    let mut body = Vec::new();
    for w in [xid, 0, 2, program, 1, procedure, 0, 0, 0, 0] {
        body.extend_from_slice(&w.to_be_bytes());
    }
    body.extend_from_slice(args);
    let mark = 0x8000_0000u32 | body.len() as u32;
    s.write_all(&mark.to_be_bytes()).unwrap();
    s.write_all(&body).unwrap();
}

/// Reads everything until the peer closes (at most 10 s).
fn read_to_close(s: &mut dyn ReadWrite) -> Vec<u8> {
    let mut out = Vec::new();
    s.read_to_end(&mut out).unwrap();
    out
}

/// The words of a record-marked AUTH_ERROR reply to `xid` with `stat`.
fn auth_error_reply(xid: u32, stat: AuthStat) -> Vec<u8> {
    let mut out = Vec::new();
    for w in [0x8000_0014u32, xid, 1, 1, 1, stat.to_u32()] {
        out.extend_from_slice(&w.to_be_bytes());
    }
    out
}

#[test]
fn the_right_token_is_served_over_tcp_unix_and_shared_memory_and_names_the_tenant() {
    let dir = tempfile::tempdir().unwrap();
    let running = serve(dir.path());
    for endpoint in running.endpoints() {
        for token in [ALICE, BOB] {
            let s = session(&endpoint, Some(token)).unwrap();
            assert_eq!(s.devices().len(), 1, "{endpoint}");
            assert_eq!(
                s.rpc().rpc().is_shm(),
                matches!(endpoint, Endpoint::Unix(_)),
                "{endpoint}: a Unix client with a token still gets shared memory"
            );
            // A real call after authentication: a context and an allocation.
            let ctx = match s.rpc().rm_primary_ctx_retain(&0).unwrap() {
                RmHandleReply::Case0(h) => h,
                other => panic!("{other:?}"),
            };
            assert!(matches!(
                s.rpc()
                    .rm_mem_alloc(&RmAllocArgs {
                        ctx,
                        bytesize: 4096
                    })
                    .unwrap(),
                RmU64Reply::Case0(_)
            ));
        }
    }
    running.shutdown();
}

#[test]
fn a_wrong_token_is_refused_with_auth_badcred_and_the_connection_closed() {
    let dir = tempfile::tempdir().unwrap();
    let running = serve(dir.path());
    for endpoint in running.endpoints() {
        let e = raw_connect(&endpoint, "not-a-token-anyone-knows").unwrap_err();
        assert!(
            matches!(
                e,
                RpcError::AuthError {
                    stat: AuthStat::BadCred
                }
            ),
            "{endpoint}: {e}"
        );
        let line = remora_proto::token::auth_problem(&e, &endpoint, true).unwrap();
        assert!(
            line.contains("authentication failed: the server at")
                && line.contains("does not know this token"),
            "{line}"
        );
        assert!(session(&endpoint, Some("not-a-token-anyone-knows")).is_err());

        // On the wire: one AUTH_ERROR reply, then the server closes the connection.
        let mut s = raw_stream(&endpoint);
        let mut args = Vec::new();
        {
            let mut enc = remora_oncrpc::xdr::Encoder::new();
            remora_oncrpc::xdr::XdrEncode::encode(
                &HelloAuthArgs {
                    hello: hello_args(),
                    token: remora_oncrpc::xdr::Bytes::from_static(b"not-a-token-anyone-knows"),
                },
                &mut enc,
            )
            .unwrap();
            for chunk in enc.finish() {
                args.extend_from_slice(&chunk);
            }
        }
        send_call(&mut *s, 7, REMORA_PROG, REMORA_HELLO_AUTH, &args);
        assert_eq!(
            read_to_close(&mut *s),
            auth_error_reply(7, AuthStat::BadCred),
            "{endpoint}"
        );
    }
    // Still serving the right token.
    for endpoint in running.endpoints() {
        session(&endpoint, Some(ALICE)).unwrap();
    }
    running.shutdown();
}

#[test]
fn no_token_is_refused_as_authentication_required() {
    let dir = tempfile::tempdir().unwrap();
    let running = serve(dir.path());
    for endpoint in running.endpoints() {
        assert!(session(&endpoint, None).is_err(), "{endpoint}");
        // Plain HELLO is not answered before authentication (nor is the GPU list).
        let c = plain_client(&endpoint);
        let e = c.remora_hello(&hello_args()).unwrap_err();
        assert!(
            matches!(
                e,
                RpcError::AuthError {
                    stat: AuthStat::TooWeak
                }
            ),
            "{endpoint}: {e}"
        );
        let line = remora_proto::token::auth_problem(&e, &endpoint, false).unwrap();
        assert!(line.contains("authentication required"), "{line}");
        // And the connection is closed.
        assert!(c.remora_null().is_err(), "{endpoint}");
    }
    running.shutdown();
}

#[test]
fn nothing_but_null_and_hello_auth_is_served_before_authentication() {
    let dir = tempfile::tempdir().unwrap();
    let running = serve(dir.path());
    for endpoint in running.endpoints() {
        // NULL is answered (liveness pings), and does not count as authenticating.
        let c = plain_client(&endpoint);
        c.remora_null().unwrap();
        c.remora_null().unwrap();
        let e = c.rm_device_get_count().unwrap_err();
        assert!(
            matches!(
                e,
                RpcError::AuthError {
                    stat: AuthStat::TooWeak
                }
            ),
            "{endpoint}: {e}"
        );
        // On the wire: AUTH_TOOWEAK, then the connection closes.
        let mut s = raw_stream(&endpoint);
        send_call(&mut *s, 9, REMORA_PROG, RM_DEVICE_GET_COUNT, &[]);
        assert_eq!(
            read_to_close(&mut *s),
            auth_error_reply(9, AuthStat::TooWeak)
        );
        // Another program is not even looked up.
        let mut s = raw_stream(&endpoint);
        send_call(&mut *s, 10, 0x3000_0000, 0, &[]);
        assert_eq!(
            read_to_close(&mut *s),
            auth_error_reply(10, AuthStat::TooWeak)
        );
    }
    running.shutdown();
}

#[test]
fn shared_memory_is_not_set_up_before_authentication() {
    let dir = tempfile::tempdir().unwrap();
    let running = serve(dir.path());
    let sock = dir.path().join("r.sock");
    let e = remora_oncrpc::shm::connect(&sock, Duration::from_secs(5)).unwrap_err();
    assert_eq!(e.kind(), std::io::ErrorKind::PermissionDenied, "{e}");
    assert!(e.to_string().contains("AUTH_TOOWEAK"), "{e}");
    // On the wire: the SHM_SETUP call gets AUTH_TOOWEAK and no descriptor; closed.
    let mut s = raw_stream(&Endpoint::Unix(sock.clone()));
    send_call(
        &mut *s,
        11,
        remora_oncrpc::shm::SHM_PROGRAM,
        remora_oncrpc::shm::SHM_SETUP,
        &0u32.to_be_bytes(),
    );
    assert_eq!(
        read_to_close(&mut *s),
        auth_error_reply(11, AuthStat::TooWeak)
    );
    // A client with shared memory required and no token is told why.
    let e = Client::connect_with(
        &Endpoint::Unix(sock),
        ClientConfig {
            transport: TransportChoice::Shm,
            ..ClientConfig::default()
        },
    )
    .unwrap_err();
    assert!(
        matches!(
            e,
            RpcError::AuthError {
                stat: AuthStat::TooWeak
            }
        ),
        "{e}"
    );
    running.shutdown();
}

fn start_error(
    dir: &Path,
    listen: &str,
    tokens: Option<(&str, u32)>,
    insecure: bool,
) -> Option<ServeError> {
    let auth_token_file = tokens.map(|(text, mode)| token_file(dir, text, mode));
    match remora_server::start(ServeConfig {
        listen: vec![listen.parse().unwrap()],
        backend: BackendChoice::Emulated,
        isolation: Some(Isolation::Thread),
        auth_token_file,
        insecure,
        ..ServeConfig::default()
    }) {
        Ok(running) => {
            running.shutdown();
            None
        }
        Err(e) => Some(e),
    }
}

#[test]
fn a_token_file_must_be_private_present_and_well_formed() {
    let dir = tempfile::tempdir().unwrap();
    let good = format!("alice {ALICE}\n");
    assert!(start_error(dir.path(), "tcp://127.0.0.1:0", Some((&good, 0o600)), false).is_none());
    assert!(start_error(dir.path(), "tcp://127.0.0.1:0", Some((&good, 0o400)), false).is_none());
    for mode in [0o640, 0o604, 0o660, 0o644] {
        let e = start_error(dir.path(), "tcp://127.0.0.1:0", Some((&good, mode)), false).unwrap();
        let msg = e.to_string();
        assert!(
            msg.contains("chmod 600") && !msg.contains(ALICE),
            "{mode:o}: {msg}"
        );
    }
    for (text, what) in [
        ("# nothing\n\n", "is empty"),
        ("alice short\n", "line 1"),
        (&*format!("alice {ALICE}\nalice {BOB}\n"), "line 2"),
        (&*format!("alice {ALICE}\nbob {ALICE}\n"), "line 2"),
        (&*format!("a/b {ALICE}\n"), "line 1"),
    ] {
        let msg = start_error(dir.path(), "tcp://127.0.0.1:0", Some((text, 0o600)), false)
            .unwrap()
            .to_string();
        assert!(
            msg.contains(what) && !msg.contains(ALICE) && !msg.contains(BOB),
            "{msg}"
        );
    }
    std::fs::remove_file(dir.path().join("tokens")).unwrap();
    let e = remora_server::start(ServeConfig {
        listen: vec!["tcp://127.0.0.1:0".parse().unwrap()],
        backend: BackendChoice::Emulated,
        isolation: Some(Isolation::Thread),
        auth_token_file: Some(dir.path().join("tokens")),
        ..ServeConfig::default()
    })
    .err()
    .unwrap();
    assert!(e.to_string().contains("does not exist"), "{e}");
}

#[test]
fn a_listener_other_hosts_can_reach_needs_tokens_or_insecure() {
    let dir = tempfile::tempdir().unwrap();
    let e = start_error(dir.path(), "tcp://0.0.0.0:0", None, false).unwrap();
    assert!(matches!(e, ServeError::Insecure(_)), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("--auth-token-file") && msg.contains("--insecure"),
        "{msg}"
    );
    assert!(start_error(dir.path(), "tcp://0.0.0.0:0", None, true).is_none());
    let good = format!("alice {ALICE}\n");
    assert!(start_error(dir.path(), "tcp://0.0.0.0:0", Some((&good, 0o600)), false).is_none());
    // Loopback and Unix sockets are served without tokens.
    assert!(start_error(dir.path(), "tcp://127.0.0.1:0", None, false).is_none());
    assert!(start_error(dir.path(), "tcp://[::1]:0", None, false).is_none() || !ipv6());
    let sock = format!("unix://{}", dir.path().join("s.sock").display());
    assert!(start_error(dir.path(), &sock, None, false).is_none());
}

fn ipv6() -> bool {
    std::net::TcpListener::bind("[::1]:0").is_ok()
}
