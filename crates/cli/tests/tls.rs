//! TLS through the `remora` binary under process isolation (emulated backend): sessions
//! over `tls://` reach their worker processes as the tenant their client certificate names;
//! `remora info` and `remora run` take `--tls-ca`/`--tls-cert`/`--tls-key` (or the
//! `REMORA_TLS_*` variables) and say clearly what is wrong; the server logs `auth_ok` and
//! `auth_failed`; a `tls://` listener other hosts can reach needs client certificates,
//! tokens or `--insecure`.

mod common;

use std::io::{BufRead, BufReader};
use std::path::Path;
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;

use remora_client::{Session, SessionConfig};
use remora_oncrpc::tls::test_pki::TestPki;
use remora_oncrpc::{ClientTls, Endpoint};
use remora_proto::remora::*;

const REMORA: &str = env!("CARGO_BIN_EXE_remora");

struct Serve {
    child: Child,
    endpoint: Endpoint,
    log: std::path::PathBuf,
}

impl Serve {
    fn start(dir: &Path, pki: &TestPki, listen: &str, extra: &[&str]) -> Result<Serve, String> {
        std::fs::create_dir_all(dir.join("tmp")).unwrap();
        let log = dir.join("serve.log");
        let mut child = Command::new(REMORA)
            .args(["serve", "--backend", "emulated", "--isolation", "process"])
            .args(["--listen", listen])
            .arg("--tls-cert")
            .arg(&pki.server_cert)
            .arg("--tls-key")
            .arg(&pki.server_key)
            .args(extra)
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
        let Some((_, url)) = line.split_once("listening on ") else {
            let _ = child.wait();
            return Err(std::fs::read_to_string(&log).unwrap());
        };
        Ok(Serve {
            endpoint: url.trim().parse().unwrap(),
            child,
            log,
        })
    }
}

impl Drop for Serve {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn text(out: &Output) -> String {
    String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr)
}

/// `remora CMD --server URL ARGS` without any TLS or token variable inherited.
fn remora(
    cmd: &str,
    server: &Endpoint,
    args: &[&std::ffi::OsStr],
    env: &[(&str, &Path)],
) -> Output {
    let mut c = Command::new(REMORA);
    c.arg(cmd)
        .arg("--server")
        .arg(server.to_string())
        .args(args);
    for var in [
        "REMORA_TLS_CA",
        "REMORA_TLS_CERT",
        "REMORA_TLS_KEY",
        "REMORA_AUTH_TOKEN",
        "REMORA_AUTH_TOKEN_FILE",
    ] {
        c.env_remove(var);
    }
    for (k, v) in env {
        c.env(k, v);
    }
    c.output().unwrap()
}

#[test]
fn process_isolation_serves_tls_sessions_as_their_certificates_tenant() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::new(dir.path());
    let ca = pki.ca_cert.clone();
    let serve = Serve::start(
        dir.path(),
        &pki,
        "tls://127.0.0.1:0",
        &["--tls-client-ca", ca.to_str().unwrap()],
    )
    .unwrap();
    let ep = serve.endpoint.clone();
    assert!(matches!(ep, Endpoint::Tls(_)), "{ep}");
    let (cert, key) = pki.client("alice");

    // A session in its worker process, over TLS (never shared memory).
    let tls = ClientTls::from_pem_files(Some(&ca), Some((&cert, &key))).unwrap();
    let s = Session::connect_with(
        &ep,
        SessionConfig {
            tls: Some(Arc::new(tls)),
            ..SessionConfig::default()
        },
    )
    .unwrap();
    assert!(!s.rpc().rpc().is_shm());
    let ctx = match s.rpc().rm_primary_ctx_retain(&0).unwrap() {
        RmHandleReply::Case0(h) => h,
        other => panic!("{other:?}"),
    };
    assert!(matches!(
        s.rpc()
            .rm_mem_alloc(&RmAllocArgs {
                ctx,
                bytesize: 8 << 20
            })
            .unwrap(),
        RmU64Reply::Case0(_)
    ));
    drop(s);

    // remora info: options, the environment, a wrong CA, no client certificate.
    let os = |p: &Path| p.as_os_str().to_owned();
    let flags = [
        "--tls-ca".into(),
        os(&ca),
        "--tls-cert".into(),
        os(&cert),
        "--tls-key".into(),
        os(&key),
    ];
    let args: Vec<&std::ffi::OsStr> = flags.iter().map(|a| a.as_os_str()).collect();
    let out = remora("info", &ep, &args, &[]);
    assert!(
        out.status.success() && text(&out).contains("protocol revision"),
        "{}",
        text(&out)
    );
    let out = remora(
        "info",
        &ep,
        &[],
        &[
            ("REMORA_TLS_CA", &ca),
            ("REMORA_TLS_CERT", &cert),
            ("REMORA_TLS_KEY", &key),
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    let wrong = [
        "--tls-ca".into(),
        os(&pki.other_ca_cert),
        "--tls-cert".into(),
        os(&cert),
        "--tls-key".into(),
        os(&key),
    ];
    let args: Vec<&std::ffi::OsStr> = wrong.iter().map(|a| a.as_os_str()).collect();
    let out = remora("info", &ep, &args, &[]);
    assert!(
        !out.status.success()
            && text(&out).contains("UnknownIssuer")
            && text(&out).contains("REMORA_TLS_CA"),
        "{}",
        text(&out)
    );
    let out = remora("info", &ep, &["--tls-ca".as_ref(), ca.as_os_str()], &[]);
    assert!(!out.status.success(), "{}", text(&out));
    assert!(
        text(&out).contains("requires a client certificate")
            || text(&out).contains("CertificateRequired"),
        "{}",
        text(&out)
    );
    // remora run checks the server with the same files before the program starts, and
    // refuses TLS options for a server that is not tls://.
    let out = remora(
        "run",
        &ep,
        &[
            "--tls-ca".as_ref(),
            ca.as_os_str(),
            "--".as_ref(),
            "true".as_ref(),
        ],
        &[],
    );
    assert!(!out.status.success(), "{}", text(&out));
    let plain: Endpoint = "tcp://127.0.0.1:1".parse().unwrap();
    let out = remora(
        "run",
        &plain,
        &[
            "--tls-ca".as_ref(),
            ca.as_os_str(),
            "--".as_ref(),
            "true".as_ref(),
        ],
        &[],
    );
    assert!(
        text(&out).contains("for a --server tls://"),
        "{}",
        text(&out)
    );
    if let Some(shim) = common::shim() {
        let flags: Vec<std::ffi::OsString> = flags.to_vec();
        let mut run_args: Vec<&std::ffi::OsStr> = flags.iter().map(|a| a.as_os_str()).collect();
        run_args.extend([
            "--shim".as_ref(),
            shim.as_os_str(),
            "--".as_ref(),
            "sh".as_ref(),
            "-c".as_ref(),
            "echo cert=$REMORA_TLS_CERT".as_ref(),
        ]);
        let out = remora("run", &ep, &run_args, &[]);
        assert!(
            out.status.success() && text(&out).contains(&format!("cert={}", cert.display())),
            "{}",
            text(&out)
        );
    }

    let log = std::fs::read_to_string(&serve.log).unwrap();
    let audit = |event: &str| {
        log.lines()
            .any(|l| l.contains("remora::audit") && l.contains(&format!("audit=\"{event}\"")))
    };
    assert!(
        audit("auth_ok") && log.contains("tenant=\"alice\""),
        "{log}"
    );
    assert!(audit("auth_failed"), "no client certificate: {log}");
    // The worker's session names the certificate's tenant.
    assert!(
        log.lines()
            .any(|l| l.contains("session opened") && l.contains("alice")),
        "{log}"
    );
    assert!(log.contains("session handed to a worker"), "{log}");
}

#[test]
fn a_public_tls_listener_needs_client_certificates_tokens_or_insecure() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::new(dir.path());
    let err = Serve::start(dir.path(), &pki, "tls://0.0.0.0:0", &[])
        .err()
        .expect("refused");
    assert!(
        err.contains("refusing to listen on tls://0.0.0.0:0 without authentication")
            && err.contains("--tls-client-ca"),
        "{err}"
    );
    let ca = pki.ca_cert.to_str().unwrap().to_owned();
    Serve::start(
        dir.path(),
        &pki,
        "tls://0.0.0.0:0",
        &["--tls-client-ca", &ca],
    )
    .unwrap();
    Serve::start(dir.path(), &pki, "tls://0.0.0.0:0", &["--insecure"]).unwrap();
    // TLS options need a tls:// listener, and the key must be private.
    let err = Serve::start(dir.path(), &pki, "tcp://127.0.0.1:0", &[])
        .err()
        .expect("refused");
    assert!(err.contains("--listen tls://"), "{err}");
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&pki.server_key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let err = Serve::start(dir.path(), &pki, "tls://127.0.0.1:0", &[])
        .err()
        .expect("refused");
    assert!(err.contains("chmod 600"), "{err}");
}

#[test]
fn lanes_over_tls_carry_striped_copies_of_their_certificates_tenant_only() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::new(dir.path());
    let ca = pki.ca_cert.clone();
    let serve = Serve::start(
        dir.path(),
        &pki,
        "tls://127.0.0.1:0",
        &["--tls-client-ca", ca.to_str().unwrap()],
    )
    .unwrap();
    let ep = serve.endpoint.clone();
    let tls_of = |who: &str| {
        let (cert, key) = pki.client(who);
        Arc::new(ClientTls::from_pem_files(Some(&ca), Some((&cert, &key))).unwrap())
    };
    let s = Session::connect_with(
        &ep,
        SessionConfig {
            tls: Some(tls_of("alice")),
            ..SessionConfig::default()
        },
    )
    .unwrap();
    let RmHandleReply::Case0(ctx) = s.rpc().rm_primary_ctx_retain(&0).unwrap() else {
        panic!("no context")
    };
    // Striped over three TLS lanes, each handed to alice's worker.
    let n = (18 << 20) + 3;
    let a = s.mem_alloc(ctx, n as u64).unwrap();
    let src: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
    s.memcpy_htod(ctx, RM_STREAM_LEGACY as u64, a, &src)
        .unwrap();
    assert_eq!(s.lane_count(), 3);
    let mut back = vec![0u8; n];
    s.memcpy_dtoh(ctx, RM_STREAM_LEGACY as u64, a, &mut back)
        .unwrap();
    assert!(back == src);

    // Bob's certificate with alice's key: refused.
    let LaneKeyReply::Case0(key) = s.rpc().remora_lane_key().unwrap() else {
        panic!("no lane key")
    };
    let bob = RemoraV1Client::new(
        remora_oncrpc::Client::connect_with(
            &ep,
            remora_oncrpc::ClientConfig {
                tls: Some(tls_of("bob")),
                ..remora_oncrpc::ClientConfig::default()
            },
        )
        .unwrap(),
    );
    assert!(matches!(
        bob.remora_lane_attach(&key),
        Err(remora_oncrpc::RpcError::AuthError {
            stat: remora_oncrpc::AuthStat::BadCred
        })
    ));
    drop(s);
    let log = std::fs::read_to_string(&serve.log).unwrap();
    assert!(
        log.contains("the lane's client certificate names tenant bob"),
        "{log}"
    );
}
