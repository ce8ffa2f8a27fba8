//! Lanes (revision 16) through the `remora` binary under process isolation (emulated backend,
//! TCP, tokens): the accepting process hands each lane to the worker that serves its session
//! (no worker starts for a lane), striped copies move every byte, and a lane whose key names
//! no worker of this server is refused.

mod common;

use std::process::Command;
use std::time::{Duration, Instant};

use common::{Served, private_file};

use remora_client::{AuthToken, Session, SessionConfig};
use remora_oncrpc::{Client, ClientConfig, RpcError, TransportChoice};
use remora_proto::remora::*;

const REMORA: &str = env!("CARGO_BIN_EXE_remora");
const TOKEN: &str = "dave-token-0123456789abcdef";

fn pattern(n: usize, seed: u8) -> Vec<u8> {
    (0..n)
        .map(|i| (i as u8).wrapping_mul(31) ^ seed ^ (i >> 11) as u8)
        .collect()
}

#[test]
fn a_workers_lanes_reach_it_and_striped_copies_arrive() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::create_dir_all(dir.path().join("tmp")).unwrap();
    let tokens = private_file(dir.path(), "tokens", &format!("dave {TOKEN}\n"));
    let mut cmd = Command::new(REMORA);
    cmd.args(["serve", "--backend", "emulated", "--isolation", "process"])
        .args(["--listen", "tcp://127.0.0.1:0", "--auth-token-file"])
        .arg(&tokens)
        .env("TMPDIR", dir.path().join("tmp"))
        .env("REMORA_LOG", "info,remora_server::worker_pool=debug");
    let serve = Served::start(cmd, &dir.path().join("serve.log"));
    let (endpoint, log) = (serve.endpoint.clone(), serve.log.clone());

    let s = Session::connect_with(
        &endpoint,
        SessionConfig {
            auth_token: Some(AuthToken::new(TOKEN).unwrap()),
            ..SessionConfig::default()
        },
    )
    .unwrap();
    let RmHandleReply::Case0(ctx) = s.rpc().rm_primary_ctx_retain(&0).unwrap() else {
        panic!("no context")
    };
    let n = (33 << 20) + 5;
    let a = s.mem_alloc(ctx, n as u64).unwrap();
    let src = pattern(n, 7);
    s.memcpy_htod(ctx, RM_STREAM_LEGACY as u64, a, &src)
        .unwrap();
    assert_eq!(
        s.lane_count(),
        3,
        "every lane reached the session's worker: {}",
        std::fs::read_to_string(&log).unwrap()
    );
    let mut back = vec![0u8; n];
    s.memcpy_dtoh(ctx, RM_STREAM_LEGACY as u64, a, &mut back)
        .unwrap();
    assert!(back == src, "striped copies through the worker");

    // A key whose route names no worker of this server: closed by the accepting process.
    let LaneKeyReply::Case0(key) = s.rpc().remora_lane_key().unwrap() else {
        panic!("no lane key")
    };
    let stray = RemoraV1Client::new(
        Client::connect_with(
            &endpoint,
            ClientConfig {
                transport: TransportChoice::Tcp,
                ..ClientConfig::default()
            },
        )
        .unwrap(),
    )
    .with_timeout(Duration::from_secs(20));
    let wrong_route = LaneKey {
        route: key.route + 1_000_000,
        secret: key.secret,
    };
    let refused = stray.remora_lane_attach(&wrong_route);
    assert!(
        matches!(refused, Err(RpcError::ConnectionLost)),
        "{refused:?}"
    );
    drop(s);

    let deadline = Instant::now() + Duration::from_secs(20);
    let text = loop {
        let text = std::fs::read_to_string(&log).unwrap();
        if text.contains("session worker finished") || Instant::now() > deadline {
            break text;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    assert_eq!(
        text.matches("session handed to a worker").count(),
        1,
        "lanes start no worker:\n{text}"
    );
    assert_eq!(
        text.matches("lane handed to its session's worker").count(),
        3,
        "{text}"
    );
    assert!(
        text.contains("a lane for a session this server does not serve"),
        "{text}"
    );
}
