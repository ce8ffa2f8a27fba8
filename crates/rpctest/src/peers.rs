//! The libtirpc C peers: building them with Debian's `rpcgen` and running them.

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};

use anyhow::{Context, Result, bail};

/// The C peers' source directory (`crates/rpctest/c`).
pub fn source_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("c")
}

/// Why the C peers cannot be built here, or `None` when they can.
pub fn unavailable_reason() -> Option<String> {
    let have = |cmd: &str| {
        Command::new("sh")
            .args(["-c", &format!("command -v {cmd}")])
            .stdout(Stdio::null())
            .status()
            .is_ok_and(|s| s.success())
    };
    if !have("rpcgen") {
        return Some("Debian's rpcgen is not installed (package rpcsvc-proto)".into());
    }
    if !Path::new("/usr/include/tirpc/rpc/rpc.h").exists() {
        return Some("libtirpc headers are not installed (package libtirpc-dev)".into());
    }
    if !have("cc") {
        return Some("no C compiler (cc) is installed".into());
    }
    None
}

/// Built C peers in a directory.
#[derive(Debug)]
pub struct CPeers {
    dir: PathBuf,
    _temp: Option<tempfile::TempDir>,
}

impl CPeers {
    /// Builds the peers into a fresh temporary directory with `c/build.sh`.
    pub fn build() -> Result<Self> {
        if let Some(reason) = unavailable_reason() {
            bail!("cannot build the libtirpc peers: {reason}");
        }
        let temp = tempfile::tempdir().context("cannot create a temporary directory")?;
        let out = Command::new("bash")
            .arg(source_dir().join("build.sh"))
            .arg(temp.path())
            .output()
            .context("cannot run c/build.sh")?;
        if !out.status.success() {
            bail!(
                "c/build.sh failed:\n{}{}",
                String::from_utf8_lossy(&out.stdout),
                String::from_utf8_lossy(&out.stderr)
            );
        }
        Ok(Self {
            dir: temp.path().to_owned(),
            _temp: Some(temp),
        })
    }

    /// Uses peers already built into `dir`.
    pub fn existing(dir: &Path) -> Result<Self> {
        for bin in ["rpctest_server", "rpctest_client"] {
            if !dir.join(bin).is_file() {
                bail!(
                    "{} has no {bin}; build it with crates/rpctest/c/build.sh DIR",
                    dir.display()
                );
            }
        }
        Ok(Self {
            dir: dir.to_owned(),
            _temp: None,
        })
    }

    /// Starts the C server on `addr` (`tcp:127.0.0.1:0` or `unix:PATH`) and returns it with
    /// the address clients should use.
    pub fn start_server(&self, addr: &str) -> Result<CServer> {
        let mut child = Command::new(self.dir.join("rpctest_server"))
            .arg(addr)
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("cannot start rpctest_server")?;
        let stdout = child
            .stdout
            .take()
            .context("no stdout from rpctest_server")?;
        let mut line = String::new();
        BufReader::new(stdout)
            .read_line(&mut line)
            .context("reading rpctest_server's port")?;
        let port = line
            .strip_prefix("LISTENING ")
            .and_then(|p| p.trim().parse::<u16>().ok())
            .with_context(|| format!("rpctest_server said {line:?}, expected LISTENING <port>"));
        let port = match port {
            Ok(p) => p,
            Err(e) => {
                let _ = child.kill();
                return Err(e);
            }
        };
        let address = match addr.strip_prefix("tcp:") {
            Some(hostport) => {
                let host = hostport.rsplit_once(':').map_or(hostport, |(h, _)| h);
                format!("tcp:{host}:{port}")
            }
            None => addr.to_owned(),
        };
        Ok(CServer { child, address })
    }

    /// Runs the C client with `args` against `addr` and returns its output.
    pub fn run_client(&self, addr: &str, args: &[&str]) -> Result<Output> {
        Command::new(self.dir.join("rpctest_client"))
            .arg(addr)
            .args(args)
            .output()
            .context("cannot run rpctest_client")
    }
}

/// A running C server; killed on drop.
#[derive(Debug)]
pub struct CServer {
    child: Child,
    address: String,
}

impl CServer {
    /// Its address in the C peers' form (`tcp:HOST:PORT` / `unix:PATH`).
    pub fn address(&self) -> &str {
        &self.address
    }

    /// Its address as a Remora endpoint URL.
    pub fn endpoint(&self) -> remora_oncrpc::Endpoint {
        c_to_endpoint(&self.address)
    }
}

impl Drop for CServer {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// Converts a C peer address (`tcp:HOST:PORT`, `unix:PATH`) to an [`Endpoint`].
///
/// [`Endpoint`]: remora_oncrpc::Endpoint
pub fn c_to_endpoint(addr: &str) -> remora_oncrpc::Endpoint {
    match addr.strip_prefix("unix:") {
        Some(path) => remora_oncrpc::Endpoint::Unix(path.into()),
        None => remora_oncrpc::Endpoint::Tcp(addr.trim_start_matches("tcp:").to_owned()),
    }
}

/// Converts an [`Endpoint`] to the C peers' address form.
///
/// [`Endpoint`]: remora_oncrpc::Endpoint
pub fn endpoint_to_c(endpoint: &remora_oncrpc::Endpoint) -> String {
    match endpoint {
        remora_oncrpc::Endpoint::Tcp(addr) => format!("tcp:{addr}"),
        remora_oncrpc::Endpoint::Unix(path) => format!("unix:{}", path.display()),
        // The C peers speak no TLS: they refuse this address form.
        remora_oncrpc::Endpoint::Tls(addr) => format!("tls:{addr}"),
    }
}
