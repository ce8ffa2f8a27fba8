//! Transport endpoints (`tcp://HOST:PORT`, `tls://HOST:PORT`, `unix:///PATH`), the transport
//! choice, and the stream type over them (a socket, or the shared-memory rings of a Unix
//! connection; a TLS connection is the plaintext end of a socket pair, see [`crate::tls`]).

use std::fmt;
use std::io::{self, IoSlice, Read, Write};
use std::net::{Shutdown, SocketAddr, TcpStream, ToSocketAddrs};
use std::os::unix::net::UnixStream;
use std::path::PathBuf;
use std::str::FromStr;
use std::time::Duration;

use remora_shm::ShmStream;

/// Where a client connects or a server listens: `tcp://HOST:PORT`, `tls://HOST:PORT` or
/// `unix:///PATH`.
///
/// ```
/// use remora_oncrpc::Endpoint;
/// let e: Endpoint = "tcp://[::1]:5000".parse().unwrap();
/// assert_eq!(e, Endpoint::Tcp("[::1]:5000".into()));
/// let t: Endpoint = "tls://gpu.example:7447".parse().unwrap();
/// assert_eq!(t, Endpoint::Tls("gpu.example:7447".into()));
/// let u: Endpoint = "unix:///run/remora.sock".parse().unwrap();
/// assert_eq!(u.to_string(), "unix:///run/remora.sock");
/// ```
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Endpoint {
    /// A TCP address, `HOST:PORT` (IPv6 hosts in brackets).
    Tcp(String),
    /// A TCP address whose connections are TLS (`HOST:PORT`; the client checks the server's
    /// certificate against HOST, a DNS name or an IP address).
    Tls(String),
    /// A Unix-domain stream socket path.
    Unix(PathBuf),
}

/// Why an endpoint string could not be parsed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "invalid endpoint {input:?}: {reason}; expected tcp://HOST:PORT (IPv6: tcp://[::1]:PORT), tls://HOST:PORT or unix:///ABSOLUTE/PATH"
)]
pub struct EndpointParseError {
    /// The string given.
    pub input: String,
    /// What is wrong with it.
    pub reason: &'static str,
}

impl FromStr for Endpoint {
    type Err = EndpointParseError;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        let err = |reason| EndpointParseError {
            input: s.to_owned(),
            reason,
        };
        let (tls, tcp) = match s.strip_prefix("tls://") {
            Some(rest) => (true, Some(rest)),
            None => (false, s.strip_prefix("tcp://")),
        };
        if let Some(rest) = tcp {
            let (host, port) = rest.rsplit_once(':').ok_or_else(|| err("missing :PORT"))?;
            if host.is_empty() {
                return Err(err("missing host"));
            }
            port.parse::<u16>()
                .map_err(|_| err("port must be a number from 0 to 65535"))?;
            if host.starts_with('[') != host.ends_with(']') {
                return Err(err("unbalanced brackets around an IPv6 address"));
            }
            if let Some(inner) = host.strip_prefix('[').and_then(|h| h.strip_suffix(']')) {
                inner
                    .parse::<std::net::Ipv6Addr>()
                    .map_err(|_| err("bracketed host is not an IPv6 address"))?;
            } else if host.contains(':') {
                return Err(err("IPv6 addresses must be in brackets"));
            } else if host.contains('/') || host.contains(char::is_whitespace) {
                return Err(err("host contains '/' or whitespace"));
            }
            Ok(if tls {
                Endpoint::Tls(rest.to_owned())
            } else {
                Endpoint::Tcp(rest.to_owned())
            })
        } else if let Some(path) = s.strip_prefix("unix://") {
            if !path.starts_with('/') {
                return Err(err(
                    "the socket path must be absolute (three slashes: unix:///path)",
                ));
            }
            if path.len() == 1 {
                return Err(err("empty socket path"));
            }
            Ok(Endpoint::Unix(PathBuf::from(path)))
        } else {
            Err(err("unknown scheme"))
        }
    }
}

impl fmt::Display for Endpoint {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Endpoint::Tcp(addr) => write!(f, "tcp://{addr}"),
            Endpoint::Tls(addr) => write!(f, "tls://{addr}"),
            Endpoint::Unix(path) => write!(f, "unix://{}", path.display()),
        }
    }
}

impl From<SocketAddr> for Endpoint {
    fn from(addr: SocketAddr) -> Self {
        Endpoint::Tcp(addr.to_string())
    }
}

/// How a client reaches its server (`--transport`, `REMORA_TRANSPORT`).
///
/// ```
/// use remora_oncrpc::TransportChoice;
/// assert_eq!("shm".parse::<TransportChoice>().unwrap(), TransportChoice::Shm);
/// assert_eq!(TransportChoice::default().to_string(), "auto");
/// ```
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum TransportChoice {
    /// Shared memory when the server is a `unix://` socket (same host) and offers it, the
    /// plain Unix socket when it does not; TCP for a `tcp://` server, TLS for a `tls://` one.
    #[default]
    Auto,
    /// Shared memory, or fail: needs a `unix://` server that offers it.
    Shm,
    /// The plain Unix socket: needs a `unix://` server.
    Unix,
    /// TCP: needs a `tcp://` server (or a `tls://` one: TLS over TCP).
    Tcp,
}

impl FromStr for TransportChoice {
    type Err = String;

    fn from_str(s: &str) -> Result<Self, Self::Err> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" | "" => Ok(Self::Auto),
            "shm" => Ok(Self::Shm),
            "unix" => Ok(Self::Unix),
            "tcp" => Ok(Self::Tcp),
            _ => Err(format!(
                "unknown transport {s:?}: expected auto, shm, unix or tcp"
            )),
        }
    }
}

impl fmt::Display for TransportChoice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Auto => "auto",
            Self::Shm => "shm",
            Self::Unix => "unix",
            Self::Tcp => "tcp",
        })
    }
}

/// Connects to `addr` (`HOST:PORT`), trying each address it resolves to, each within
/// `timeout`.
fn connect_tcp(addr: &str, timeout: Option<Duration>) -> io::Result<TcpStream> {
    let mut last = None;
    for a in addr.to_socket_addrs()? {
        let res = match timeout {
            Some(t) if !t.is_zero() => TcpStream::connect_timeout(&a, t),
            _ => TcpStream::connect(a),
        };
        match res {
            Ok(s) => {
                s.set_nodelay(true)?;
                return Ok(s);
            }
            Err(e) => last = Some(e),
        }
    }
    Err(last.unwrap_or_else(|| {
        io::Error::new(io::ErrorKind::NotFound, "host name resolved to no address")
    }))
}

/// Socket buffer size asked for on Unix sockets (the kernel caps it at `net.core.wmem_max` /
/// `rmem_max`).
const UNIX_SOCKET_BUFFER: usize = 4 << 20;

/// Raises a Unix socket's send and receive buffers from the default (`wmem_default`, about
/// 208 KiB) towards [`UNIX_SOCKET_BUFFER`]: a bulk copy otherwise moves at most that much per
/// wake-up of the peer. Best effort. TCP sockets are left to the kernel's autotuning, which
/// grows further than a fixed size would (`tcp_wmem`/`tcp_rmem`) and which setting a size
/// turns off.
pub(crate) fn widen_unix_buffers(s: &UnixStream) {
    let sock = socket2::SockRef::from(s);
    let _ = sock.set_send_buffer_size(UNIX_SOCKET_BUFFER);
    let _ = sock.set_recv_buffer_size(UNIX_SOCKET_BUFFER);
}

/// A connected stream: a TCP or Unix socket, or the shared-memory rings of a Unix
/// connection that moved into shared memory.
#[derive(Debug)]
pub(crate) enum Stream {
    Tcp(TcpStream),
    Unix(UnixStream),
    Shm(ShmStream),
}

impl Stream {
    /// Connects to `endpoint`, with `timeout` bounding each TCP connection attempt (and a
    /// TLS handshake). A `tls://` endpoint needs `tls`; its stream is the plaintext end of a
    /// socket pair whose pump thread ends the connection when `stall` passes without the
    /// server taking data, or when both ends have closed.
    pub(crate) fn connect(
        endpoint: &Endpoint,
        timeout: Option<Duration>,
        tls: Option<&crate::tls::ClientTls>,
        stall: Duration,
        on_tcp: impl FnOnce(&TcpStream) -> io::Result<()>,
    ) -> io::Result<Stream> {
        match endpoint {
            Endpoint::Tcp(addr) => {
                let s = connect_tcp(addr, timeout)?;
                on_tcp(&s)?;
                Ok(Stream::Tcp(s))
            }
            Endpoint::Tls(addr) => {
                let tls = tls.ok_or_else(|| {
                    io::Error::new(io::ErrorKind::InvalidInput, "no TLS configuration")
                })?;
                let start = std::time::Instant::now();
                let mut s = connect_tcp(addr, timeout)?;
                on_tcp(&s)?;
                let limit = timeout
                    .filter(|t| !t.is_zero())
                    .unwrap_or(Duration::from_secs(10));
                let conn =
                    crate::tls::connect(tls, crate::tls::host_of(addr), &mut s, start + limit)?;
                let (plain, _pump) =
                    crate::tls::spawn_pump(conn, s, stall, format!("tls://{addr}"))?;
                Ok(Stream::Unix(plain))
            }
            Endpoint::Unix(path) => {
                let s = UnixStream::connect(path)?;
                widen_unix_buffers(&s);
                Ok(Stream::Unix(s))
            }
        }
    }

    pub(crate) fn try_clone(&self) -> io::Result<Stream> {
        Ok(match self {
            Stream::Tcp(s) => Stream::Tcp(s.try_clone()?),
            Stream::Unix(s) => Stream::Unix(s.try_clone()?),
            Stream::Shm(s) => Stream::Shm(s.clone()),
        })
    }

    /// The Unix socket, when this is one (not after a move into shared memory).
    pub(crate) fn unix_socket(&self) -> Option<&UnixStream> {
        match self {
            Stream::Unix(s) => Some(s),
            _ => None,
        }
    }

    pub(crate) fn set_write_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_write_timeout(t),
            Stream::Unix(s) => s.set_write_timeout(t),
            Stream::Shm(s) => s.set_write_timeout(t),
        }
    }

    pub(crate) fn set_read_timeout(&self, t: Option<Duration>) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.set_read_timeout(t),
            Stream::Unix(s) => s.set_read_timeout(t),
            Stream::Shm(s) => s.set_read_timeout(t),
        }
    }

    /// A read that never waits: `Some(Err(WouldBlock))` when nothing has arrived; `None`
    /// for shared memory, whose rings wait their own way.
    pub(crate) fn try_read(&mut self, buf: &mut [u8]) -> Option<io::Result<usize>> {
        use std::os::fd::AsFd;
        let fd = match &*self {
            Stream::Tcp(s) => s.as_fd(),
            Stream::Unix(s) => s.as_fd(),
            Stream::Shm(_) => return None,
        };
        Some(
            rustix::net::recv(fd, buf, rustix::net::RecvFlags::DONTWAIT)
                .map(|(n, _)| n)
                .map_err(io::Error::from),
        )
    }

    pub(crate) fn shutdown(&self, how: Shutdown) -> io::Result<()> {
        match self {
            Stream::Tcp(s) => s.shutdown(how),
            Stream::Unix(s) => s.shutdown(how),
            Stream::Shm(s) => s.shutdown(how),
        }
    }
}

impl Read for Stream {
    fn read(&mut self, buf: &mut [u8]) -> io::Result<usize> {
        match self {
            Stream::Tcp(s) => s.read(buf),
            Stream::Unix(s) => s.read(buf),
            Stream::Shm(s) => s.read(buf),
        }
    }
}

/// Socket writes pass `MSG_NOSIGNAL`: a peer that has gone makes the write fail with
/// `BrokenPipe` instead of raising SIGPIPE, whose default action ends the process. The client
/// runs inside programs that never asked for sockets (a C program under the shim keeps the
/// default action), so a server that ends or closes a connection must give the program a
/// CUDA error, not kill it.
impl Write for Stream {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        use std::os::fd::AsFd;
        let send = |fd| rustix::net::send(fd, buf, rustix::net::SendFlags::NOSIGNAL);
        match self {
            Stream::Tcp(s) => send(s.as_fd()).map_err(io::Error::from),
            Stream::Unix(s) => send(s.as_fd()).map_err(io::Error::from),
            Stream::Shm(s) => s.write(buf),
        }
    }

    fn write_vectored(&mut self, bufs: &[IoSlice<'_>]) -> io::Result<usize> {
        use std::os::fd::AsFd;
        let send = |fd| {
            rustix::net::sendmsg(
                fd,
                bufs,
                &mut rustix::net::SendAncillaryBuffer::default(),
                rustix::net::SendFlags::NOSIGNAL,
            )
        };
        match self {
            Stream::Tcp(s) => send(s.as_fd()).map_err(io::Error::from),
            Stream::Unix(s) => send(s.as_fd()).map_err(io::Error::from),
            Stream::Shm(s) => s.write_vectored(bufs),
        }
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

/// The directory of Remora's default Unix socket: `$XDG_RUNTIME_DIR/remora`, or
/// `/tmp/remora-$UID` when there is no runtime directory.
pub fn default_socket_dir() -> std::path::PathBuf {
    match std::env::var_os("XDG_RUNTIME_DIR") {
        Some(dir) if !dir.is_empty() => std::path::PathBuf::from(dir).join("remora"),
        _ => {
            use std::os::unix::fs::MetadataExt;
            let uid = std::fs::metadata("/proc/self")
                .map(|m| m.uid())
                .unwrap_or(0);
            std::path::PathBuf::from(format!("/tmp/remora-{uid}"))
        }
    }
}

impl Endpoint {
    /// Where `remora serve` listens by default and clients look first: the Unix socket
    /// `remora.sock` in [`default_socket_dir`].
    pub fn default_local() -> Endpoint {
        Endpoint::Unix(default_socket_dir().join("remora.sock"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parse_and_display() {
        for (s, e) in [
            ("tcp://127.0.0.1:111", Endpoint::Tcp("127.0.0.1:111".into())),
            ("tcp://localhost:0", Endpoint::Tcp("localhost:0".into())),
            ("tcp://[::1]:5000", Endpoint::Tcp("[::1]:5000".into())),
            ("tls://[::1]:5000", Endpoint::Tls("[::1]:5000".into())),
            (
                "tls://gpu.example:7447",
                Endpoint::Tls("gpu.example:7447".into()),
            ),
            ("unix:///tmp/x.sock", Endpoint::Unix("/tmp/x.sock".into())),
        ] {
            let parsed: Endpoint = s.parse().unwrap();
            assert_eq!(parsed, e);
            assert_eq!(parsed.to_string(), s);
        }
    }

    #[test]
    fn parse_errors_say_what_is_expected() {
        for (s, reason) in [
            ("127.0.0.1:111", "unknown scheme"),
            ("tcp://127.0.0.1", "missing :PORT"),
            ("tcp://:80", "missing host"),
            ("tcp://h:99999", "port must be"),
            ("tcp://::1:80", "IPv6 addresses must be in brackets"),
            ("tcp://[zz]:80", "not an IPv6"),
            ("tcp://[::1:80", "unbalanced"),
            ("tls://127.0.0.1", "missing :PORT"),
            ("tls://::1:80", "IPv6 addresses must be in brackets"),
            ("unix://relative/x", "must be absolute"),
            ("unix:///", "empty socket path"),
        ] {
            let e = s.parse::<Endpoint>().unwrap_err();
            assert!(e.reason.contains(reason), "{s}: {e}");
            assert!(e.to_string().contains("expected tcp://HOST:PORT"));
        }
    }
}
