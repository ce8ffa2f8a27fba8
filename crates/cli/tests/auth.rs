//! Token authentication through the `remora` binary under process isolation (emulated
//! backend): the worker process of each connection serves nothing before the client's
//! `REMORA_HELLO_AUTH` succeeds; `remora info` and `remora run` present tokens and report a
//! missing or wrong one clearly; `remora serve` refuses a non-loopback TCP listener without
//! tokens unless `--insecure`.

use std::io::{BufRead, BufReader};
use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use remora_client::{AuthToken, Session, SessionConfig};
use remora_oncrpc::{AuthStat, Client, Endpoint, RpcError};
use remora_proto::remora::*;

const REMORA: &str = env!("CARGO_BIN_EXE_remora");
const TOKEN: &str = "carol-token-0123456789abcdef";

fn private_file(dir: &Path, name: &str, text: &str) -> PathBuf {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o600)).unwrap();
    p
}

struct Serve {
    child: Child,
    endpoint: Endpoint,
    log: PathBuf,
}

impl Serve {
    fn start(dir: &Path) -> Serve {
        std::fs::create_dir_all(dir.join("tmp")).unwrap();
        let tokens = private_file(dir, "tokens", &format!("carol {TOKEN}\n"));
        let sock = dir.join("remora.sock");
        let log = dir.join("serve.log");
        let mut child = Command::new(REMORA)
            .args(["serve", "--backend", "emulated", "--isolation", "process"])
            .arg("--listen")
            .arg(format!("unix://{}", sock.display()))
            .arg("--auth-token-file")
            .arg(&tokens)
            .env("TMPDIR", dir.join("tmp"))
            .env("REMORA_LOG", "info")
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log).unwrap())
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
            log,
        }
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn process_isolation_serves_the_right_token_only() {
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start(dir.path());

    // The right token: a session in its worker, over shared memory.
    let s = Session::connect_with(
        &serve.endpoint,
        SessionConfig {
            auth_token: Some(AuthToken::new(TOKEN).unwrap()),
            ..SessionConfig::default()
        },
    )
    .unwrap();
    assert!(s.rpc().rpc().is_shm());
    assert!(matches!(
        s.rpc().rm_primary_ctx_retain(&0).unwrap(),
        RmHandleReply::Case0(_)
    ));
    drop(s);

    // No token: the worker answers AUTH_TOOWEAK and closes.
    let c = RemoraV1Client::new(
        Client::connect_with(
            &serve.endpoint,
            remora_oncrpc::ClientConfig {
                transport: remora_oncrpc::TransportChoice::Unix,
                ..remora_oncrpc::ClientConfig::default()
            },
        )
        .unwrap(),
    )
    .with_timeout(Duration::from_secs(20));
    c.remora_null().unwrap();
    assert!(matches!(
        c.rm_device_get_count().unwrap_err(),
        RpcError::AuthError {
            stat: AuthStat::TooWeak
        }
    ));

    // remora info: with the token, without, with a wrong one.
    let info = |args: &[&str]| {
        let out = Command::new(REMORA)
            .arg("info")
            .arg("--server")
            .arg(serve.endpoint.to_string())
            .args(args)
            .env_remove("REMORA_AUTH_TOKEN")
            .env_remove("REMORA_AUTH_TOKEN_FILE")
            .output()
            .unwrap();
        (
            out.status.success(),
            String::from_utf8_lossy(&out.stdout).into_owned()
                + &String::from_utf8_lossy(&out.stderr),
        )
    };
    let good = private_file(dir.path(), "good", &format!("{TOKEN}\n"));
    let bad = private_file(dir.path(), "bad", "someone-elses-token-xyz\n");
    let (ok, text) = info(&["--auth-token-file", good.to_str().unwrap()]);
    assert!(ok && text.contains("protocol revision"), "{text}");
    let (ok, text) = info(&[]);
    assert!(!ok && text.contains("authentication required"), "{text}");
    let (ok, text) = info(&["--auth-token-file", bad.to_str().unwrap()]);
    assert!(
        !ok && text.contains("authentication failed: the server at")
            && text.contains("does not know this token"),
        "{text}"
    );
    assert!(!text.contains("someone-elses-token-xyz"), "{text}");

    // remora run checks the token before the program starts.
    let run = |file: &Path| {
        Command::new(REMORA)
            .args(["run", "--server"])
            .arg(serve.endpoint.to_string())
            .arg("--auth-token-file")
            .arg(file)
            .args(["--", "true"])
            .env_remove("REMORA_AUTH_TOKEN")
            .output()
            .unwrap()
    };
    let out = run(&bad);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("does not know this token"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    std::fs::set_permissions(&good, std::fs::Permissions::from_mode(0o644)).unwrap();
    let out = run(&good);
    assert!(!out.status.success());
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("chmod 600"),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );

    let log = std::fs::read_to_string(&serve.log).unwrap();
    assert!(log.contains("tenant=\"carol\""), "{log}");
    assert!(log.contains("authentication failed"), "{log}");
    // Audit events: one target, an `audit` field naming the event.
    let audit = |event: &str| {
        log.lines()
            .any(|l| l.contains("remora::audit") && l.contains(&format!("audit=\"{event}\"")))
    };
    assert!(audit("auth_ok") && audit("auth_failed"), "{log}");
    assert!(audit("auth_required"), "a call without a token: {log}");
    assert!(
        !log.contains(TOKEN) && !log.contains("someone-elses"),
        "{log}"
    );
}

#[test]
fn no_session_worker_starts_before_the_token_is_checked() {
    let dir = tempfile::tempdir().unwrap();
    let serve = Serve::start(dir.path());
    let raw = || {
        RemoraV1Client::new(
            Client::connect_with(
                &serve.endpoint,
                remora_oncrpc::ClientConfig {
                    transport: remora_oncrpc::TransportChoice::Unix,
                    ..remora_oncrpc::ClientConfig::default()
                },
            )
            .unwrap(),
        )
        .with_timeout(Duration::from_secs(20))
    };
    let hello = |token: &str| HelloAuthArgs {
        hello: HelloArgs {
            min_revision: 1,
            max_revision: REMORA_PROTOCOL_REVISION,
            client_name: "gate test".into(),
            capabilities: u64::from(REMORA_CAP_ONEWAY),
        },
        token: token.as_bytes().to_vec().into(),
    };
    // A wrong token and a call without one are refused by the accepting process.
    assert!(matches!(
        raw()
            .remora_hello_auth(&hello("not-the-right-token-at-all"))
            .unwrap_err(),
        RpcError::AuthError {
            stat: AuthStat::BadCred
        }
    ));
    assert!(matches!(
        raw().rm_device_get_count().unwrap_err(),
        RpcError::AuthError {
            stat: AuthStat::TooWeak
        }
    ));
    // The right token gets a session in a worker.
    let c = raw();
    assert!(matches!(
        c.remora_hello_auth(&hello(TOKEN)).unwrap(),
        HelloReply::True(_)
    ));
    drop(c);
    // The hand-off is logged after the worker took the connection.
    let deadline = std::time::Instant::now() + Duration::from_secs(20);
    let log = loop {
        let log = std::fs::read_to_string(&serve.log).unwrap();
        if log.contains("session handed to a worker") || std::time::Instant::now() > deadline {
            break log;
        }
        std::thread::sleep(Duration::from_millis(20));
    };
    let handed = log.matches("session handed to a worker").count();
    assert_eq!(
        handed, 1,
        "only the authenticated connection got a worker:\n{log}"
    );
    assert_eq!(
        log.matches("before a session worker started").count(),
        2,
        "{log}"
    );
}

#[test]
fn serve_refuses_a_public_tcp_listener_without_tokens_unless_insecure() {
    let out = Command::new(REMORA)
        .args([
            "serve",
            "--backend",
            "emulated",
            "--listen",
            "tcp://0.0.0.0:0",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("refusing to listen on tcp://0.0.0.0:0 without authentication")
            && err.contains("--insecure"),
        "{err}"
    );
}
