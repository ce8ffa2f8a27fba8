//! TEST ONLY (feature `test-pki`): a throw-away certificate authority for tests of TLS
//! endpoints: a CA, a server certificate for `localhost`, `127.0.0.1` and `::1`, client
//! certificates by name, and a second CA that signed none of them.

use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, CertifiedIssuer, DistinguishedName, DnType, IsCa, KeyPair,
};

/// The CA and the files a test server and its clients use (keys written with mode 0600).
pub struct TestPki {
    dir: PathBuf,
    ca: CertifiedIssuer<'static, KeyPair>,
    /// The CA certificate (PEM): what clients trust (`REMORA_TLS_CA`) and, as the client CA,
    /// what signs client certificates.
    pub ca_cert: PathBuf,
    /// The server's certificate (PEM), for `localhost`, `127.0.0.1` and `::1`.
    pub server_cert: PathBuf,
    /// The server's private key (PEM, mode 0600).
    pub server_key: PathBuf,
    /// The certificate of a CA that signed nothing of this PKI.
    pub other_ca_cert: PathBuf,
}

fn new_ca(name: &str) -> CertifiedIssuer<'static, KeyPair> {
    let mut params = CertificateParams::new(Vec::<String>::new()).expect("CA parameters");
    params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    params.distinguished_name = DistinguishedName::new();
    params.distinguished_name.push(DnType::CommonName, name);
    CertifiedIssuer::self_signed(params, KeyPair::generate().expect("CA key"))
        .expect("self-signed CA")
}

/// Writes `text` to `path`, private when `private`.
fn write(path: &Path, text: &str, private: bool) {
    use std::os::unix::fs::PermissionsExt;
    std::fs::write(path, text).expect("write a test PKI file");
    let mode = if private { 0o600 } else { 0o644 };
    std::fs::set_permissions(path, std::fs::Permissions::from_mode(mode))
        .expect("chmod a test PKI file");
}

impl TestPki {
    /// A new CA and server certificate, written into `dir`.
    pub fn new(dir: &Path) -> Self {
        let ca = new_ca("Remora test CA");
        let other = new_ca("Remora other test CA");
        let ca_cert = dir.join("ca.pem");
        let other_ca_cert = dir.join("other-ca.pem");
        write(&ca_cert, &ca.pem(), false);
        write(&other_ca_cert, &other.pem(), false);
        let pki = Self {
            dir: dir.to_owned(),
            ca,
            ca_cert,
            server_cert: dir.join("server.pem"),
            server_key: dir.join("server.key"),
            other_ca_cert,
        };
        let (cert, key) = pki.issue(
            Some("remora test server"),
            &["localhost", "127.0.0.1", "::1"],
        );
        write(&pki.server_cert, &cert, false);
        write(&pki.server_key, &key, true);
        pki
    }

    /// A certificate and key (PEM) signed by the CA, with subject CN `cn` (none when
    /// `None`) and the alternative names `sans` (IP addresses become IP SANs).
    pub fn issue(&self, cn: Option<&str>, sans: &[&str]) -> (String, String) {
        let mut params =
            CertificateParams::new(sans.iter().map(|s| (*s).to_owned()).collect::<Vec<_>>())
                .expect("certificate parameters");
        params.distinguished_name = DistinguishedName::new();
        if let Some(cn) = cn {
            params.distinguished_name.push(DnType::CommonName, cn);
        }
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &self.ca).expect("sign");
        (cert.pem(), key.serialize_pem())
    }

    /// Writes a client certificate named `cn` (CA-signed) and its key into the directory:
    /// (certificate file, key file).
    pub fn client(&self, cn: &str) -> (PathBuf, PathBuf) {
        let (cert, key) = self.issue(Some(cn), &[]);
        self.write_pair(&format!("client-{cn}"), &cert, &key)
    }

    /// Writes a client certificate named `cn` signed by the other CA, which the server does
    /// not trust.
    pub fn foreign_client(&self, cn: &str) -> (PathBuf, PathBuf) {
        let other = new_ca("Remora foreign CA");
        let mut params = CertificateParams::new(Vec::<String>::new()).expect("parameters");
        params.distinguished_name = DistinguishedName::new();
        params.distinguished_name.push(DnType::CommonName, cn);
        let key = KeyPair::generate().expect("key");
        let cert = params.signed_by(&key, &other).expect("sign");
        self.write_pair(&format!("foreign-{cn}"), &cert.pem(), &key.serialize_pem())
    }

    fn write_pair(&self, name: &str, cert: &str, key: &str) -> (PathBuf, PathBuf) {
        let (c, k) = (
            self.dir.join(format!("{name}.pem")),
            self.dir.join(format!("{name}.key")),
        );
        write(&c, cert, false);
        write(&k, key, true);
        (c, k)
    }
}
