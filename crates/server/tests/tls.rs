//! `remora serve` with `tls://` listeners under thread isolation, on the emulated backend:
//! sessions over TLS, client certificates naming the session's tenant (alone, and together
//! with tokens, where a token of another tenant is refused), TLS without client
//! certificates still needing tokens, and the rule for listeners other hosts can reach.
//! Process isolation and the audit log are tested through the binary
//! (`crates/cli/tests/tls.rs`).

use std::os::unix::fs::PermissionsExt;
use std::path::Path;
use std::sync::Arc;

use remora_client::{AuthToken, Session, SessionConfig};
use remora_oncrpc::tls::test_pki::TestPki;
use remora_oncrpc::{ClientTls, Endpoint};
use remora_proto::remora::*;
use remora_server::{BackendChoice, Isolation, Running, ServeConfig, ServeError, TlsFiles};

const ALICE: &str = "alice-token-0123456789";
const BOB: &str = "bob-token-abcdefghijkl";

fn tls_files(pki: &TestPki, client_ca: bool) -> TlsFiles {
    TlsFiles {
        cert: pki.server_cert.clone(),
        key: pki.server_key.clone(),
        client_ca: client_ca.then(|| pki.ca_cert.clone()),
    }
}

fn tokens(dir: &Path) -> std::path::PathBuf {
    let path = dir.join("tokens");
    std::fs::write(&path, format!("alice {ALICE}\nbob {BOB}\n")).unwrap();
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o600)).unwrap();
    path
}

fn serve(pki: &TestPki, client_ca: bool, token_file: Option<std::path::PathBuf>) -> Running {
    remora_server::start(ServeConfig {
        listen: vec!["tls://127.0.0.1:0".parse().unwrap()],
        backend: BackendChoice::Emulated,
        isolation: Some(Isolation::Thread),
        tls: Some(tls_files(pki, client_ca)),
        auth_token_file: token_file,
        ..ServeConfig::default()
    })
    .unwrap()
}

fn session(
    endpoint: &Endpoint,
    pki: &TestPki,
    client: Option<&str>,
    token: Option<&str>,
) -> Result<Session, remora_client::CuError> {
    let identity = client.map(|cn| pki.client(cn));
    let tls = ClientTls::from_pem_files(
        Some(&pki.ca_cert),
        identity.as_ref().map(|(c, k)| (c.as_path(), k.as_path())),
    )
    .unwrap();
    Session::connect_with(
        endpoint,
        SessionConfig {
            auth_token: token.map(|t| AuthToken::new(t).unwrap()),
            tls: Some(Arc::new(tls)),
            ..SessionConfig::default()
        },
    )
}

/// A context and an allocation: real calls after HELLO.
fn work(s: &Session) {
    let ctx = match s.rpc().rm_primary_ctx_retain(&0).unwrap() {
        RmHandleReply::Case0(h) => h,
        other => panic!("{other:?}"),
    };
    assert!(matches!(
        s.rpc()
            .rm_mem_alloc(&RmAllocArgs {
                ctx,
                bytesize: 1 << 20
            })
            .unwrap(),
        RmU64Reply::Case0(_)
    ));
}

#[test]
fn sessions_over_tls_are_served_and_a_client_certificate_names_the_tenant() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::new(dir.path());
    let running = serve(&pki, true, None);
    let endpoint = running.endpoints()[0].clone();
    assert!(matches!(endpoint, Endpoint::Tls(_)));
    let s = session(&endpoint, &pki, Some("alice"), None).unwrap();
    assert!(!s.rpc().rpc().is_shm());
    assert_eq!(s.devices().len(), 1);
    work(&s);
    assert_eq!(running.executor().unwrap().session_tenants(), ["alice"]);
    // No client certificate: nothing is served.
    assert!(session(&endpoint, &pki, None, None).is_err());
    drop(s);
    running.shutdown();
}

#[test]
fn with_tokens_too_a_certificate_suffices_and_a_token_of_another_tenant_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::new(dir.path());
    let running = serve(&pki, true, Some(tokens(dir.path())));
    let endpoint = running.endpoints()[0].clone();
    let s = session(&endpoint, &pki, Some("alice"), None).unwrap();
    work(&s);
    let same = session(&endpoint, &pki, Some("alice"), Some(ALICE)).unwrap();
    work(&same);
    assert!(
        session(&endpoint, &pki, Some("alice"), Some(BOB)).is_err(),
        "bob's token on alice's certificate"
    );
    assert_eq!(
        running.executor().unwrap().session_tenants(),
        ["alice", "alice"]
    );
    running.shutdown();
}

#[test]
fn tls_without_client_certificates_still_needs_a_token() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::new(dir.path());
    let running = serve(&pki, false, Some(tokens(dir.path())));
    let endpoint = running.endpoints()[0].clone();
    assert!(session(&endpoint, &pki, None, None).is_err());
    let s = session(&endpoint, &pki, None, Some(BOB)).unwrap();
    work(&s);
    // A client certificate the server did not ask for names no tenant.
    let s2 = session(&endpoint, &pki, Some("mallory"), Some(ALICE)).unwrap();
    work(&s2);
    assert_eq!(
        running.executor().unwrap().session_tenants(),
        ["alice", "bob"]
    );
    running.shutdown();
}

fn start_error(
    pki: &TestPki,
    listen: &str,
    tls: Option<TlsFiles>,
    token_file: Option<std::path::PathBuf>,
    insecure: bool,
) -> Option<ServeError> {
    let _ = pki;
    match remora_server::start(ServeConfig {
        listen: vec![listen.parse().unwrap()],
        backend: BackendChoice::Emulated,
        isolation: Some(Isolation::Thread),
        tls,
        auth_token_file: token_file,
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
fn a_tls_listener_other_hosts_can_reach_needs_client_certificates_tokens_or_insecure() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::new(dir.path());
    let any = "tls://0.0.0.0:0";
    let e = start_error(&pki, any, Some(tls_files(&pki, false)), None, false).unwrap();
    assert!(matches!(e, ServeError::Insecure(_)), "{e}");
    let msg = e.to_string();
    assert!(
        msg.contains("--tls-client-ca") && msg.contains("--auth-token-file"),
        "{msg}"
    );
    assert!(start_error(&pki, any, Some(tls_files(&pki, true)), None, false).is_none());
    let t = tokens(dir.path());
    assert!(start_error(&pki, any, Some(tls_files(&pki, false)), Some(t), false).is_none());
    assert!(start_error(&pki, any, Some(tls_files(&pki, false)), None, true).is_none());
    assert!(
        start_error(
            &pki,
            "tls://127.0.0.1:0",
            Some(tls_files(&pki, false)),
            None,
            false
        )
        .is_none()
    );
}

#[test]
fn tls_files_and_listeners_must_go_together_and_the_key_be_private() {
    let dir = tempfile::tempdir().unwrap();
    let pki = TestPki::new(dir.path());
    let e = start_error(&pki, "tls://127.0.0.1:0", None, None, false).unwrap();
    assert!(
        e.to_string().contains("--tls-cert") && e.to_string().contains("--tls-key"),
        "{e}"
    );
    let e = start_error(
        &pki,
        "tcp://127.0.0.1:0",
        Some(tls_files(&pki, false)),
        None,
        false,
    )
    .unwrap();
    assert!(e.to_string().contains("--listen tls://"), "{e}");
    std::fs::set_permissions(&pki.server_key, std::fs::Permissions::from_mode(0o644)).unwrap();
    let e = start_error(
        &pki,
        "tls://127.0.0.1:0",
        Some(tls_files(&pki, false)),
        None,
        false,
    )
    .unwrap();
    assert!(
        matches!(e, ServeError::Tls(_)) && e.to_string().contains("chmod 600"),
        "{e}"
    );
    std::fs::set_permissions(&pki.server_key, std::fs::Permissions::from_mode(0o600)).unwrap();
    let (_, other_key) = pki.client("x");
    let e = start_error(
        &pki,
        "tls://127.0.0.1:0",
        Some(TlsFiles {
            key: other_key,
            ..tls_files(&pki, false)
        }),
        None,
        false,
    )
    .unwrap();
    assert!(e.to_string().contains("does not fit"), "{e}");
}
