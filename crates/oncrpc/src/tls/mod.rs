//! TLS over TCP (`tls://HOST:PORT`), with rustls and the `ring` provider.
//!
//! A rustls connection is one state machine that cannot be shared between the threads that
//! read and write a connection (the server's connection thread and its deferred replies; the
//! client's leader/follower reader and its writer), nor passed to another process (a
//! session worker under process isolation). So TLS ends in a pump thread of the process that
//! made the connection, which moves bytes between the TCP socket (ciphertext) and one end of
//! a Unix socket pair (plaintext); everything above uses the other end as it uses any
//! socket:
//!
//! ```text
//!   peer ══TLS/TCP══ pump thread ──plaintext── socketpair ── connection code (or a worker)
//!                    (this module)              (bounded buffers, EOF both ways)
//! ```
//!
//! * [`ServerTls`]: the server's certificate and key, and optionally the CA whose client
//!   certificates it requires; a verified client certificate names the connection's tenant
//!   (subject CN, else the first DNS name), as a token does.
//! * [`ClientTls`]: the CA a client trusts (`REMORA_TLS_CA`, else the system's roots) and
//!   optionally its own certificate (`REMORA_TLS_CERT`, `REMORA_TLS_KEY`).
//! * Handshakes have a deadline (the server's `hello_timeout`, the client's connect timeout),
//!   so a peer that never finishes one is dropped.
//!
//! Private key files must be private (no access for group or others), as token files are.

use std::fmt;
use std::io::{self, Read};
use std::net::TcpStream;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, Instant};

use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName};

mod pump;
#[cfg(feature = "test-pki")]
#[doc(hidden)]
pub mod test_pki;

pub(crate) use pump::spawn_pump;

/// Environment variable naming the PEM file of the CA(s) a client trusts.
pub const ENV_CA: &str = "REMORA_TLS_CA";
/// Environment variable naming the client's certificate chain (PEM).
pub const ENV_CERT: &str = "REMORA_TLS_CERT";
/// Environment variable naming the client's private key (PEM, mode 0600).
pub const ENV_KEY: &str = "REMORA_TLS_KEY";

/// Largest PEM file read (certificates, keys, CA bundles).
const MAX_PEM_FILE: u64 = 4 << 20;

/// Why TLS could not be set up. The messages name the file and what to do.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TlsError {
    /// A file could not be read.
    #[error("cannot read the {what} {path}: {source}")]
    Read {
        /// What the file is (e.g. "TLS certificate file").
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The error.
        #[source]
        source: io::Error,
    },
    /// A private key file that group or others may read or write.
    #[error(
        "the TLS private key file {path} may be read or written by group or others (mode \
         {mode:04o}): make it private with `chmod 600 {path}` (and replace the key if others \
         could read it)"
    )]
    KeyTooOpen {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// A file holds no usable PEM item of the kind wanted.
    #[error("the {what} {path} holds no {wanted}: {problem}")]
    Pem {
        /// What the file is.
        what: &'static str,
        /// The file.
        path: PathBuf,
        /// The PEM section wanted.
        wanted: &'static str,
        /// What is wrong.
        problem: String,
    },
    /// rustls refused the configuration (e.g. a key that does not match the certificate).
    #[error("{context}: {source}")]
    Config {
        /// What was being set up, and what to check.
        context: String,
        /// rustls' reason.
        #[source]
        source: rustls::Error,
    },
    /// The client-certificate verifier could not be built from the CA file.
    #[error("cannot verify client certificates with the CA file {path}: {reason}")]
    ClientCa {
        /// The CA file.
        path: PathBuf,
        /// Why.
        reason: String,
    },
    /// No trusted CA at all.
    #[error(
        "no CA certificate to trust: the system has none that could be loaded ({0}); set \
         REMORA_TLS_CA to the PEM file of the CA that signed the server's certificate"
    )]
    NoRoots(String),
    /// Only one of the client's certificate and key was given.
    #[error(
        "a client certificate needs both REMORA_TLS_CERT (the certificate chain, PEM) and \
         REMORA_TLS_KEY (its private key, PEM, mode 0600); only {0} is set"
    )]
    HalfClientIdentity(&'static str),
}

/// The crypto provider every Remora TLS configuration uses.
fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

/// Reads a PEM file of at most [`MAX_PEM_FILE`] bytes; `private` refuses a file that group
/// or others may read or write (checked on the file opened).
fn read_pem_file(path: &Path, what: &'static str, private: bool) -> Result<Vec<u8>, TlsError> {
    use std::os::unix::fs::PermissionsExt;
    let err = |source| TlsError::Read {
        what,
        path: path.to_owned(),
        source,
    };
    let file = std::fs::File::open(path).map_err(err)?;
    let meta = file.metadata().map_err(err)?;
    if !meta.is_file() {
        return Err(err(io::Error::new(
            io::ErrorKind::InvalidInput,
            "not a regular file",
        )));
    }
    let mode = meta.permissions().mode() & 0o7777;
    if private && mode & 0o077 != 0 {
        return Err(TlsError::KeyTooOpen {
            path: path.to_owned(),
            mode,
        });
    }
    let mut bytes = Vec::new();
    file.take(MAX_PEM_FILE + 1)
        .read_to_end(&mut bytes)
        .map_err(err)?;
    if bytes.len() as u64 > MAX_PEM_FILE {
        return Err(err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("larger than {MAX_PEM_FILE} bytes"),
        )));
    }
    Ok(bytes)
}

/// Every certificate in the PEM file `path` (at least one).
fn load_certs(path: &Path, what: &'static str) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let bytes = read_pem_file(path, what, false)?;
    let pem = |problem: String| TlsError::Pem {
        what,
        path: path.to_owned(),
        wanted: "certificate (-----BEGIN CERTIFICATE-----)",
        problem,
    };
    let certs = CertificateDer::pem_slice_iter(&bytes)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| pem(e.to_string()))?;
    if certs.is_empty() {
        return Err(pem("no CERTIFICATE section found".into()));
    }
    Ok(certs)
}

/// The private key in the PEM file `path`, which must be private.
fn load_key(path: &Path) -> Result<PrivateKeyDer<'static>, TlsError> {
    const WHAT: &str = "TLS private key file";
    let bytes = read_pem_file(path, WHAT, true)?;
    PrivateKeyDer::from_pem_slice(&bytes).map_err(|e| TlsError::Pem {
        what: WHAT,
        path: path.to_owned(),
        wanted: "private key (PKCS#8, PKCS#1 or SEC1 PEM)",
        problem: e.to_string(),
    })
}

/// A root store of the certificates in the PEM file `path`.
fn load_roots(path: &Path, what: &'static str) -> Result<rustls::RootCertStore, TlsError> {
    let mut roots = rustls::RootCertStore::empty();
    for cert in load_certs(path, what)? {
        roots.add(cert).map_err(|source| TlsError::Config {
            context: format!("the {what} {path:?} holds a certificate that cannot be a CA"),
            source,
        })?;
    }
    Ok(roots)
}

/// A server's TLS settings: its certificate chain and key, and optionally the CA whose
/// client certificates it requires ([`ServerTls::requires_client_certificates`]).
#[derive(Clone)]
pub struct ServerTls {
    config: Arc<rustls::ServerConfig>,
    client_certificates: bool,
}

impl fmt::Debug for ServerTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ServerTls")
            .field("client_certificates", &self.client_certificates)
            .finish_non_exhaustive()
    }
}

impl ServerTls {
    /// Loads the certificate chain `cert` and private key `key` (PEM; the key file must not
    /// be readable or writable by group or others) and, with `client_ca`, requires every
    /// client to present a certificate that this CA (PEM) signed. Fails, saying which file
    /// and why, when a file is missing, unreadable, too open, holds nothing usable, or the
    /// key does not belong to the certificate.
    pub fn from_pem_files(
        cert: &Path,
        key: &Path,
        client_ca: Option<&Path>,
    ) -> Result<Self, TlsError> {
        let chain = load_certs(cert, "TLS certificate file")?;
        let key_der = load_key(key)?;
        let provider = provider();
        let builder = rustls::ServerConfig::builder_with_provider(Arc::clone(&provider))
            .with_safe_default_protocol_versions()
            .map_err(|source| TlsError::Config {
                context: "no TLS protocol version available".into(),
                source,
            })?;
        let builder = match client_ca {
            Some(ca) => {
                let roots = load_roots(ca, "TLS client CA file")?;
                let verifier = rustls::server::WebPkiClientVerifier::builder_with_provider(
                    Arc::new(roots),
                    provider,
                )
                .build()
                .map_err(|e| TlsError::ClientCa {
                    path: ca.to_owned(),
                    reason: e.to_string(),
                })?;
                builder.with_client_cert_verifier(verifier)
            }
            None => builder.with_no_client_auth(),
        };
        let config =
            builder
                .with_single_cert(chain, key_der)
                .map_err(|source| TlsError::Config {
                    context: format!(
                        "the TLS key {} does not fit the certificate {} (give the key that \
                     belongs to the certificate's first entry)",
                        key.display(),
                        cert.display()
                    ),
                    source,
                })?;
        Ok(Self {
            config: Arc::new(config),
            client_certificates: client_ca.is_some(),
        })
    }

    /// Whether clients must present a certificate signed by the client CA (which then
    /// authenticates them and names their tenant).
    pub fn requires_client_certificates(&self) -> bool {
        self.client_certificates
    }
}

/// A client's TLS settings: the CAs it trusts and optionally its own certificate.
#[derive(Clone)]
pub struct ClientTls {
    config: Arc<rustls::ClientConfig>,
}

impl fmt::Debug for ClientTls {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ClientTls").finish_non_exhaustive()
    }
}

impl ClientTls {
    /// Trusts the CA certificates in `ca` (PEM), or the system's roots when `None`, and
    /// presents the client certificate `identity` = (certificate chain, private key; PEM,
    /// the key file private) when given.
    pub fn from_pem_files(
        ca: Option<&Path>,
        identity: Option<(&Path, &Path)>,
    ) -> Result<Self, TlsError> {
        let roots = match ca {
            Some(path) => load_roots(path, "TLS CA file (REMORA_TLS_CA)")?,
            None => system_roots()?,
        };
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|source| TlsError::Config {
                context: "no TLS protocol version available".into(),
                source,
            })?
            .with_root_certificates(roots);
        let config = match identity {
            Some((cert, key)) => {
                let chain = load_certs(cert, "TLS client certificate file")?;
                let key_der = load_key(key)?;
                builder
                    .with_client_auth_cert(chain, key_der)
                    .map_err(|source| TlsError::Config {
                        context: format!(
                            "the TLS client key {} does not fit the certificate {}",
                            key.display(),
                            cert.display()
                        ),
                        source,
                    })?
            }
            None => builder.with_no_client_auth(),
        };
        Ok(Self {
            config: Arc::new(config),
        })
    }

    /// The settings the environment names: [`ENV_CA`] (`REMORA_TLS_CA`, else the system's
    /// roots), [`ENV_CERT`] and [`ENV_KEY`] (`REMORA_TLS_CERT`, `REMORA_TLS_KEY`: both or
    /// neither).
    pub fn from_env() -> Result<Self, TlsError> {
        let var = |name| {
            std::env::var_os(name)
                .filter(|v| !v.is_empty())
                .map(PathBuf::from)
        };
        let (ca, cert, key) = (var(ENV_CA), var(ENV_CERT), var(ENV_KEY));
        let identity = match (&cert, &key) {
            (Some(c), Some(k)) => Some((c.as_path(), k.as_path())),
            (None, None) => None,
            (Some(_), None) => return Err(TlsError::HalfClientIdentity(ENV_CERT)),
            (None, Some(_)) => return Err(TlsError::HalfClientIdentity(ENV_KEY)),
        };
        Self::from_pem_files(ca.as_deref(), identity)
    }
}

/// The system's CA certificates (`SSL_CERT_FILE`/`SSL_CERT_DIR`, else the distribution's
/// bundle).
fn system_roots() -> Result<rustls::RootCertStore, TlsError> {
    let found = rustls_native_certs::load_native_certs();
    let mut roots = rustls::RootCertStore::empty();
    let (added, _) = roots.add_parsable_certificates(found.certs);
    if added == 0 {
        let why = found
            .errors
            .first()
            .map_or_else(|| "none found".to_owned(), ToString::to_string);
        return Err(TlsError::NoRoots(why));
    }
    Ok(roots)
}

/// Why a tenant name (from a token file or a client certificate) is not valid: names have 1
/// to 64 characters of `A-Z a-z 0-9 _ . -`.
pub fn tenant_name_problem(name: &str) -> Option<String> {
    const MAX: usize = 64;
    if name.is_empty() || name.len() > MAX {
        return Some(format!(
            "the tenant name is {} characters long; names have 1 to {MAX}",
            name.len()
        ));
    }
    if !name
        .bytes()
        .all(|b| b.is_ascii_alphanumeric() || matches!(b, b'_' | b'.' | b'-'))
    {
        return Some(format!(
            "the tenant name {name:?} has a character other than A-Z, a-z, 0-9, '_', '.' and '-'"
        ));
    }
    None
}

/// The tenant a (verified) client certificate names: its subject's common name, else its
/// first DNS subject alternative name; it must be a valid tenant name.
pub fn certificate_tenant(der: &[u8]) -> Result<String, String> {
    use x509_parser::extensions::GeneralName;
    let (_, cert) = x509_parser::parse_x509_certificate(der)
        .map_err(|e| format!("the client certificate cannot be parsed: {e}"))?;
    let cn = match cert.subject().iter_common_name().next() {
        Some(attr) => Some(
            attr.as_str()
                .map_err(|_| "the client certificate's subject CN is not a text string")?
                .to_owned(),
        ),
        None => None,
    };
    let name = match cn {
        Some(cn) => cn,
        None => cert
            .subject_alternative_name()
            .map_err(|e| format!("the client certificate's alternative names are malformed: {e}"))?
            .and_then(|san| {
                san.value.general_names.iter().find_map(|n| match n {
                    GeneralName::DNSName(d) => Some((*d).to_owned()),
                    _ => None,
                })
            })
            .ok_or("the client certificate names no subject CN and no DNS name")?,
    };
    match tenant_name_problem(&name) {
        Some(problem) => Err(format!("the client certificate's name: {problem}")),
        None => Ok(name),
    }
}

/// A hint for a handshake error, saying what to check.
fn hint(e: &rustls::Error, server_side: bool) -> &'static str {
    use rustls::{AlertDescription as A, CertificateError as C, Error as E};
    match e {
        E::InvalidCertificate(C::UnknownIssuer | C::BadSignature) if !server_side => {
            " (the server's certificate is not signed by a CA this client trusts: set \
             REMORA_TLS_CA to the PEM file of the CA that signed it)"
        }
        E::InvalidCertificate(C::NotValidForName | C::NotValidForNameContext { .. }) => {
            " (the server's certificate does not name the host in the URL: connect by a name \
             or IP address the certificate lists)"
        }
        E::InvalidCertificate(C::Expired | C::ExpiredContext { .. }) => {
            " (the certificate has expired: renew it)"
        }
        E::AlertReceived(A::CertificateRequired | A::HandshakeFailure) if !server_side => {
            " (the server requires a client certificate: set REMORA_TLS_CERT and \
             REMORA_TLS_KEY)"
        }
        E::AlertReceived(A::UnknownCA | A::BadCertificate | A::DecryptError) if !server_side => {
            " (the server does not accept this client certificate: use one its client CA signed)"
        }
        E::InvalidMessage(_) if !server_side => {
            " (is the server listening with tls://? a plain tcp:// server does not speak TLS)"
        }
        _ => "",
    }
}

/// What ended a handshake.
#[derive(Debug)]
pub(crate) enum HandshakeError {
    /// The deadline passed first.
    Timeout,
    /// The peer closed the connection or the socket failed.
    Io(io::Error),
    /// TLS itself failed (bad certificate, protocol error, ...): the reason, with a hint.
    Tls {
        error: rustls::Error,
        message: String,
    },
}

impl HandshakeError {
    /// Whether the peer's certificate was missing or refused (an authentication failure).
    pub(crate) fn is_certificate(&self) -> bool {
        matches!(
            self,
            HandshakeError::Tls {
                error: rustls::Error::NoCertificatesPresented
                    | rustls::Error::InvalidCertificate(_),
                ..
            }
        )
    }
}

impl fmt::Display for HandshakeError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            HandshakeError::Timeout => f.write_str("the TLS handshake did not finish in time"),
            HandshakeError::Io(e) => write!(f, "the TLS handshake failed: {e}"),
            HandshakeError::Tls { message, .. } => {
                write!(f, "the TLS handshake failed: {message}")
            }
        }
    }
}

impl From<HandshakeError> for io::Error {
    fn from(e: HandshakeError) -> io::Error {
        let kind = match &e {
            HandshakeError::Timeout => io::ErrorKind::TimedOut,
            HandshakeError::Io(io) => io.kind(),
            HandshakeError::Tls { .. } => io::ErrorKind::InvalidData,
        };
        io::Error::new(kind, e.to_string())
    }
}

/// Runs the handshake of `conn` on the blocking socket `tcp` until it completes, fails, or
/// `deadline` passes (a trickling peer is cut off at the deadline too: every read waits at
/// most until then).
fn handshake(
    conn: &mut rustls::Connection,
    tcp: &mut TcpStream,
    deadline: Instant,
    server_side: bool,
) -> Result<(), HandshakeError> {
    let mut io = pump::NoSigPipe(tcp);
    while conn.is_handshaking() {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(HandshakeError::Timeout);
        }
        let wait = Some(left.max(Duration::from_millis(1)));
        if conn.wants_write() {
            io.0.set_write_timeout(wait).map_err(HandshakeError::Io)?;
            match conn.write_tls(&mut io) {
                Ok(_) => {}
                Err(e) if is_timeout(&e) => return Err(HandshakeError::Timeout),
                Err(e) => return Err(HandshakeError::Io(e)),
            }
            continue;
        }
        io.0.set_read_timeout(wait).map_err(HandshakeError::Io)?;
        match conn.read_tls(&mut io) {
            Ok(0) => {
                return Err(HandshakeError::Io(io::Error::new(
                    io::ErrorKind::UnexpectedEof,
                    "the peer closed the connection during the TLS handshake",
                )));
            }
            Ok(_) => {}
            Err(e) if is_timeout(&e) => continue,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(HandshakeError::Io(e)),
        }
        if let Err(error) = conn.process_new_packets() {
            // Tell the peer why (the alert rustls queued), best effort.
            let _ = io.0.set_write_timeout(Some(Duration::from_millis(200)));
            let _ = conn.write_tls(&mut io);
            let message = format!("{error}{}", hint(&error, server_side));
            return Err(HandshakeError::Tls { error, message });
        }
    }
    Ok(())
}

fn is_timeout(e: &io::Error) -> bool {
    matches!(
        e.kind(),
        io::ErrorKind::WouldBlock | io::ErrorKind::TimedOut
    )
}

/// A server connection whose handshake is done.
pub(crate) struct Accepted {
    pub(crate) conn: rustls::Connection,
    /// The tenant its client certificate names, when the server requires them.
    pub(crate) tenant: Option<String>,
}

/// Why a server handshake did not give a connection to serve.
pub(crate) enum AcceptError {
    Handshake(HandshakeError),
    /// The certificate verified but names no usable tenant.
    Tenant(String),
}

/// The server side of a handshake on the accepted `tcp`, within `deadline`.
pub(crate) fn accept(
    tls: &ServerTls,
    tcp: &mut TcpStream,
    deadline: Instant,
) -> Result<Accepted, AcceptError> {
    let server = rustls::ServerConnection::new(Arc::clone(&tls.config)).map_err(|error| {
        AcceptError::Handshake(HandshakeError::Tls {
            message: error.to_string(),
            error,
        })
    })?;
    let mut conn = rustls::Connection::Server(server);
    handshake(&mut conn, tcp, deadline, true).map_err(AcceptError::Handshake)?;
    let tenant = if tls.client_certificates {
        let der = conn
            .peer_certificates()
            .and_then(|c| c.first())
            .ok_or_else(|| AcceptError::Tenant("no client certificate".into()))?;
        Some(certificate_tenant(der).map_err(AcceptError::Tenant)?)
    } else {
        None
    };
    Ok(Accepted { conn, tenant })
}

/// The client side of a handshake with the server `host` (a DNS name or an IP address,
/// IPv6 without brackets) on `tcp`, within `deadline`.
pub(crate) fn connect(
    tls: &ClientTls,
    host: &str,
    tcp: &mut TcpStream,
    deadline: Instant,
) -> Result<rustls::Connection, HandshakeError> {
    let name = ServerName::try_from(host.to_owned()).map_err(|e| {
        HandshakeError::Io(io::Error::new(
            io::ErrorKind::InvalidInput,
            format!("{host:?} is not a valid TLS server name: {e}"),
        ))
    })?;
    let client = rustls::ClientConnection::new(Arc::clone(&tls.config), name).map_err(|error| {
        HandshakeError::Tls {
            message: error.to_string(),
            error,
        }
    })?;
    let mut conn = rustls::Connection::Client(client);
    handshake(&mut conn, tcp, deadline, false)?;
    Ok(conn)
}

/// The host part of `HOST:PORT` as a TLS server name: brackets around an IPv6 address go.
pub(crate) fn host_of(addr: &str) -> &str {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    host.strip_prefix('[')
        .and_then(|h| h.strip_suffix(']'))
        .unwrap_or(host)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hosts_of_endpoints() {
        assert_eq!(host_of("gpu.example:7446"), "gpu.example");
        assert_eq!(host_of("127.0.0.1:1"), "127.0.0.1");
        assert_eq!(host_of("[::1]:5000"), "::1");
    }

    #[test]
    fn tenant_names() {
        assert!(tenant_name_problem("alice").is_none());
        assert!(tenant_name_problem("ci.runner-2_x").is_none());
        assert!(tenant_name_problem("").is_some());
        assert!(tenant_name_problem("Alice Smith").is_some());
        assert!(tenant_name_problem(&"a".repeat(65)).is_some());
    }

    fn cert_with(cn: Option<&str>, sans: &[&str]) -> Vec<u8> {
        let mut params =
            rcgen::CertificateParams::new(sans.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
                .unwrap();
        params.distinguished_name = rcgen::DistinguishedName::new();
        if let Some(cn) = cn {
            params
                .distinguished_name
                .push(rcgen::DnType::CommonName, cn);
        }
        let key = rcgen::KeyPair::generate().unwrap();
        params.self_signed(&key).unwrap().der().to_vec()
    }

    #[test]
    fn the_tenant_is_the_cn_else_the_first_dns_name() {
        assert_eq!(
            certificate_tenant(&cert_with(Some("alice"), &["x.example"])).unwrap(),
            "alice"
        );
        assert_eq!(
            certificate_tenant(&cert_with(None, &["bob.example", "c.example"])).unwrap(),
            "bob.example"
        );
        let e = certificate_tenant(&cert_with(None, &[])).unwrap_err();
        assert!(e.contains("no subject CN and no DNS name"), "{e}");
        let e = certificate_tenant(&cert_with(Some("Alice Smith"), &[])).unwrap_err();
        assert!(e.contains("character other than"), "{e}");
        assert!(certificate_tenant(b"\x30\x03\x02\x01\x00").is_err());
    }
}
