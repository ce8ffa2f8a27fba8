//! Limits per tenant under process isolation (issue 13 §2), through the `remora` binary with
//! the emulated backend: each session runs in a worker process of its own, and a tenant's
//! sessions are still counted together (the server's shared ledger); a tenant past its
//! sessions is refused at HELLO with the reason; a session that ends gives its place and
//! memory back (the server clears its worker's slot); another tenant is not affected.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use remora_oncrpc::{Client, Endpoint};
use remora_proto::remora::*;

const REMORA: &str = env!("CARGO_BIN_EXE_remora");
const ALICE: &str = "alice-token-0123456789abcdef";
const BOB: &str = "bob-token-0123456789abcdef";
const OUT_OF_MEMORY: i32 = 2;

struct Serve {
    child: Child,
    endpoint: Endpoint,
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn serve(dir: &Path) -> Serve {
    std::fs::create_dir_all(dir.join("tmp")).unwrap();
    let tokens = dir.join("tokens");
    std::fs::write(&tokens, format!("alice {ALICE}\nbob {BOB}\n")).unwrap();
    std::fs::set_permissions(&tokens, std::fs::Permissions::from_mode(0o600)).unwrap();
    let tenants = dir.join("tenants.toml");
    std::fs::write(
        &tenants,
        "[tenant]\ndevice-memory = \"1MiB\"\nsessions = 2\n[tenants.bob]\nsessions = 1\n",
    )
    .unwrap();
    let sock = dir.join("remora.sock");
    let mut child = Command::new(REMORA)
        .args(["serve", "--backend", "emulated", "--isolation", "process"])
        .args(["--warm-workers", "1", "--no-shm"])
        .arg("--listen")
        .arg(format!("unix://{}", sock.display()))
        .arg("--auth-token-file")
        .arg(&tokens)
        .arg("--tenants")
        .arg(&tenants)
        .env("TMPDIR", dir.join("tmp"))
        .env("REMORA_LOG", "info")
        .stdout(Stdio::piped())
        .stderr(std::fs::File::create(dir.join("serve.log")).unwrap())
        .spawn()
        .unwrap();
    let mut line = String::new();
    BufReader::new(child.stdout.take().unwrap())
        .read_line(&mut line)
        .unwrap();
    assert!(line.contains("listening on"), "{line}");
    Serve {
        child,
        endpoint: Endpoint::Unix(sock),
    }
}

fn connect(serve: &Serve, token: &str) -> (RemoraV1Client, HelloReply) {
    // A plain Unix socket: shared memory is set up only after authentication, by real
    // clients.
    let config = remora_oncrpc::ClientConfig {
        transport: remora_oncrpc::TransportChoice::Unix,
        ..remora_oncrpc::ClientConfig::default()
    };
    let c = RemoraV1Client::new(Client::connect_with(&serve.endpoint, config).unwrap())
        .with_timeout(Duration::from_secs(20));
    let reply = c
        .remora_hello_auth(&HelloAuthArgs {
            hello: HelloArgs {
                min_revision: 1,
                max_revision: REMORA_PROTOCOL_REVISION,
                client_name: "quota test".into(),
                capabilities: u64::from(REMORA_CAP_ONEWAY),
            },
            token: token.as_bytes().to_vec().into(),
        })
        .unwrap();
    (c, reply)
}

/// A session of `token`'s tenant with a context.
fn session(serve: &Serve, token: &str) -> (RemoraV1Client, u64) {
    let (c, reply) = connect(serve, token);
    assert!(matches!(reply, HelloReply::True(_)), "{reply:?}");
    with_context(c)
}

/// [`session`], or `None` when the server refuses the session at HELLO.
fn try_session(serve: &Serve, token: &str) -> Option<(RemoraV1Client, u64)> {
    let (c, reply) = connect(serve, token);
    matches!(reply, HelloReply::True(_)).then(|| with_context(c))
}

/// The session's primary context.
fn with_context(c: RemoraV1Client) -> (RemoraV1Client, u64) {
    let RmHandleReply::Case0(ctx) = c.rm_primary_ctx_retain(&0).unwrap() else {
        panic!("no context")
    };
    (c, ctx)
}

fn alloc(c: &RemoraV1Client, ctx: u64, bytes: u64) -> Result<u64, i32> {
    match c
        .rm_mem_alloc(&RmAllocArgs {
            ctx,
            bytesize: bytes,
        })
        .unwrap()
    {
        RmU64Reply::Case0(p) => Ok(p),
        RmU64Reply::Default { discriminant } => Err(discriminant),
    }
}

#[test]
fn a_tenants_sessions_in_separate_workers_share_its_limits() {
    let dir = tempfile::tempdir().unwrap();
    let serve = serve(dir.path());

    let (a1, c1) = session(&serve, ALICE);
    let (a2, c2) = session(&serve, ALICE);
    alloc(&a1, c1, 600 << 10).unwrap();
    assert_eq!(
        alloc(&a2, c2, 600 << 10),
        Err(OUT_OF_MEMORY),
        "alice's second worker sees her first worker's allocation"
    );
    alloc(&a2, c2, 300 << 10).expect("what is left of alice's MiB");

    // Bob is a tenant of his own: his MiB, his single session.
    let (b, cb) = session(&serve, BOB);
    alloc(&b, cb, 900 << 10).expect("bob is not charged for alice");
    match connect(&serve, BOB).1 {
        HelloReply::False(r) => assert!(
            r.reason.contains("\"bob\"") && r.reason.contains("sessions=1"),
            "{}",
            r.reason
        ),
        other => panic!("bob's second session was let in: {other:?}"),
    }
    match connect(&serve, ALICE).1 {
        HelloReply::False(r) => assert!(r.reason.contains("sessions=2"), "{}", r.reason),
        other => panic!("alice's third session was let in: {other:?}"),
    }

    // remora status: each tenant sees itself only, also with all its sessions taken.
    let status = |token: &str| {
        let out = Command::new(REMORA)
            .arg("status")
            .arg("--server")
            .arg(serve.endpoint.to_string())
            .env("REMORA_AUTH_TOKEN", token)
            .env_remove("REMORA_AUTH_TOKEN_FILE")
            .output()
            .unwrap();
        let text = String::from_utf8_lossy(&out.stdout).into_owned()
            + &String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{text}");
        text
    };
    let alice = status(ALICE);
    let row = alice
        .lines()
        .find(|l| l.starts_with("alice "))
        .unwrap_or_else(|| panic!("{alice}"));
    let cols: Vec<&str> = row.split_whitespace().collect();
    assert_eq!(cols[1], "2", "alice's sessions: {row}");
    assert_eq!(
        &cols[2..4],
        ["900.0", "KiB"],
        "alice's device memory: {row}"
    );
    assert!(!alice.contains("bob"), "{alice}");
    assert!(alice.contains("only your own tenant"), "{alice}");
    let bob = status(BOB);
    assert!(
        bob.lines().any(|l| l.starts_with("bob ")) && !bob.contains("alice"),
        "{bob}"
    );

    // Alice's first session ends: its worker exits, the server clears its slot, and her
    // other session may use the memory, and a new session the place.
    drop(a1);
    let deadline = Instant::now() + Duration::from_secs(20);
    while alloc(&a2, c2, 600 << 10).is_err() {
        assert!(
            Instant::now() < deadline,
            "the ended session's memory never came back"
        );
        std::thread::sleep(Duration::from_millis(50));
    }
    // Its place in the tenant's session count is given back when its worker has exited,
    // which may come a little after its memory (freed as the session ends).
    let (a3, c3) = loop {
        if let Some(s) = try_session(&serve, ALICE) {
            break s;
        }
        assert!(
            Instant::now() < deadline,
            "the ended session's place never came back"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    assert_eq!(alloc(&a3, c3, 200 << 10), Err(OUT_OF_MEMORY));
    alloc(&a3, c3, 100 << 10).expect("alice's MiB less her other session's 900 KiB");
    drop((a2, a3, b));
}
