//! `remora serve --gpu-share mps` through the binary (emulated backend, process isolation):
//! the server refuses to start when a share cannot be enforced, and a tenant with a share
//! gets a session worker started with it as CUDA_MPS_ACTIVE_THREAD_PERCENTAGE while other
//! tenants get workers with the whole GPU. The MPS daemon itself is stood in for by a Unix
//! socket named `control` in CUDA_MPS_PIPE_DIRECTORY (the emulated backend never calls MPS);
//! what MPS does with the share is measured on a GPU by `remora bench fairness`.

mod common;

use std::path::Path;
use std::process::{Command, Output};
use std::time::{Duration, Instant};

use common::{Served, private_file};

use remora_client::{AuthToken, Session, SessionConfig};
use remora_oncrpc::Endpoint;
use remora_proto::remora::RmHandleReply;

const REMORA: &str = env!("CARGO_BIN_EXE_remora");
const ALICE: &str = "alice-token-0123456789abcdef";
const BOB: &str = "bob-token-0123456789abcdef01";

fn serve(dir: &Path, args: &[&str], pipe_dir: &Path) -> Command {
    std::fs::create_dir_all(dir.join("tmp")).unwrap();
    let tokens = private_file(dir, "tokens", &format!("alice {ALICE}\nbob {BOB}\n"));
    let mut c = Command::new(REMORA);
    c.args(["serve", "--backend", "emulated", "--listen"])
        .arg(format!("unix://{}", dir.join("remora.sock").display()))
        .arg("--auth-token-file")
        .arg(tokens)
        .args(args)
        .env("TMPDIR", dir.join("tmp"))
        .env("CUDA_MPS_PIPE_DIRECTORY", pipe_dir)
        .env("REMORA_LOG", "info");
    c
}

fn refused(out: Output, expect: &[&str]) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "started: {err}");
    for e in expect {
        assert!(err.contains(e), "no {e:?} in: {err}");
    }
}

#[test]
fn shares_that_cannot_be_enforced_stop_the_server_with_what_to_do() {
    let dir = tempfile::tempdir().unwrap();
    let no_daemon = dir.path().join("no-mps");
    std::fs::create_dir(&no_daemon).unwrap();
    let tenants = private_file(
        dir.path(),
        "tenants.toml",
        "[tenants.bob]\ngpu-share = 50\n",
    );
    let tenants = tenants.to_str().unwrap();

    // A share, and no --gpu-share: never silently not enforced.
    refused(
        serve(
            dir.path(),
            &["--isolation", "process", "--tenants", tenants],
            &no_daemon,
        )
        .output()
        .unwrap(),
        &["tenant bob gpu-share = 50%", "--gpu-share mps"],
    );
    // The same through --limit.
    refused(
        serve(dir.path(), &["--limit", "tenant.gpu-share=30"], &no_daemon)
            .output()
            .unwrap(),
        &["every tenant gpu-share = 30%"],
    );
    // MPS limits processes: thread isolation cannot have it.
    refused(
        serve(
            dir.path(),
            &["--isolation", "thread", "--gpu-share", "mps"],
            &no_daemon,
        )
        .output()
        .unwrap(),
        &["needs process isolation"],
    );
    // No MPS control daemon.
    refused(
        serve(
            dir.path(),
            &[
                "--isolation",
                "process",
                "--gpu-share",
                "mps",
                "--tenants",
                tenants,
            ],
            &no_daemon,
        )
        .output()
        .unwrap(),
        &[
            "no MPS control daemon is running",
            "nvidia-cuda-mps-control -d",
        ],
    );
    // A share that is not a percentage.
    let bad = private_file(dir.path(), "bad.toml", "[tenants.bob]\ngpu-share = 150\n");
    refused(
        serve(
            dir.path(),
            &["--isolation", "process", "--tenants", bad.to_str().unwrap()],
            &no_daemon,
        )
        .output()
        .unwrap(),
        &["gpu-share", "percentage from 1 to 100"],
    );
    refused(
        serve(dir.path(), &["--gpu-share", "time-slice"], &no_daemon)
            .output()
            .unwrap(),
        &["use off or mps"],
    );
}

fn session(endpoint: &Endpoint, token: &str) -> Session {
    let s = Session::connect_with(
        endpoint,
        SessionConfig {
            auth_token: Some(AuthToken::new(token).unwrap()),
            ..SessionConfig::default()
        },
    )
    .unwrap();
    assert!(matches!(
        s.rpc().rm_primary_ctx_retain(&0).unwrap(),
        RmHandleReply::Case0(_)
    ));
    s
}

/// Waits until the server's log holds a line with every one of `words`; answers the log.
fn wait_for_line(log: &Path, words: &[&str]) -> String {
    let t0 = Instant::now();
    loop {
        let text = std::fs::read_to_string(log).unwrap_or_default();
        if text.lines().any(|l| words.iter().all(|w| l.contains(w))) {
            return text;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "no line with {words:?} in: {text}"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
}

#[test]
fn a_tenants_sessions_run_in_workers_started_with_its_share() {
    let dir = tempfile::tempdir().unwrap();
    // The stand-in for the MPS control daemon's pipe.
    let pipes = dir.path().join("mps");
    std::fs::create_dir(&pipes).unwrap();
    let _control = std::os::unix::net::UnixListener::bind(pipes.join("control")).unwrap();
    let tenants = private_file(
        dir.path(),
        "tenants.toml",
        "[tenants.alice]\ngpu-share = 40\n[tenants.bob]\ndevice-memory = \"1GiB\"\n",
    );
    let mut cmd = serve(
        dir.path(),
        &[
            "--isolation",
            "process",
            "--gpu-share",
            "mps",
            "--tenants",
            tenants.to_str().unwrap(),
        ],
        &pipes,
    );
    // The server's own setting never reaches a worker that has no share.
    cmd.env("CUDA_MPS_ACTIVE_THREAD_PERCENTAGE", "77");
    let serve = Served::start(cmd, &dir.path().join("serve.log"));
    let endpoint = serve.endpoint.clone();

    let a = session(&endpoint, ALICE);
    let text = wait_for_line(
        &serve.log,
        &["active_thread_percentage=40", "runs under MPS"],
    );
    assert!(
        text.lines().any(|l| l.contains("tenant=alice")
            && l.contains("gpu_share=40%")
            && l.contains("starting a session worker")),
        "{text}"
    );
    let b = session(&endpoint, BOB);
    let t0 = Instant::now();
    while std::fs::read_to_string(&serve.log)
        .unwrap_or_default()
        .matches("session handed to a worker")
        .count()
        < 2
    {
        assert!(
            t0.elapsed() < Duration::from_secs(20),
            "bob's session was not handed off"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    drop((a, b));
    let text = std::fs::read_to_string(&serve.log).unwrap();
    assert!(!text.contains("tenant=bob gpu_share"), "{text}");
    assert!(!text.contains("active_thread_percentage=77"), "{text}");
    assert_eq!(
        text.matches("runs under MPS with its tenant's gpu-share")
            .count(),
        1,
        "{text}"
    );

    // The MPS daemon goes away: a session with a share is refused, with the reason, rather
    // than given the whole GPU; one without a share still runs.
    drop(_control);
    std::fs::remove_file(pipes.join("control")).unwrap();
    let refused = Session::connect_with(
        &endpoint,
        SessionConfig {
            auth_token: Some(AuthToken::new(ALICE).unwrap()),
            ..SessionConfig::default()
        },
    );
    assert!(refused.is_err(), "alice's session ran without MPS");
    wait_for_line(
        &serve.log,
        &["gpu-share (40%) cannot be enforced", "refusing the session"],
    );
    drop(session(&endpoint, BOB));
}
