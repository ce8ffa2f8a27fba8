//! Shared test fixtures: a test service and helpers to run it over TCP or a Unix socket.
#![allow(dead_code, unreachable_pub)]

pub mod deferring;

use std::io::{Read, Write};
use std::net::TcpStream;
use std::os::unix::net::UnixStream;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use remora_oncrpc::xdr::{self, Bytes, Decoder, Encoder, UNBOUNDED};
use remora_oncrpc::{
    CallContext, Credential, Dispatch, Endpoint, Peer, Server, ServerConfig, ServerHandle, Service,
};

pub const PROG: u32 = 0x2000_0001;
pub const NULLPROC: u32 = 0;
pub const ECHO: u32 = 1;
pub const ADD: u32 = 2;
pub const FAIL: u32 = 3;
pub const ONEWAY_PUSH: u32 = 4;
pub const GET_LOG: u32 = 5;
pub const SLOW: u32 = 6;
pub const WHOAMI: u32 = 7;
pub const PANIC: u32 = 8;
pub const CLOSE: u32 = 9;

/// The test program; versions 1 and 3 are served (so version 2 gets PROG_MISMATCH(1, 3)).
pub struct TestService {
    pub version: u32,
    pub log: Arc<Mutex<Vec<u32>>>,
}

impl Service for TestService {
    fn program(&self) -> u32 {
        PROG
    }
    fn version(&self) -> u32 {
        self.version
    }
    fn dispatch(&self, ctx: &CallContext, args: &mut Decoder, reply: &mut Encoder) -> Dispatch {
        let res: xdr::Result<Dispatch> = (|| match ctx.procedure {
            NULLPROC => {
                args.finish()?;
                Ok(Dispatch::Success)
            }
            ECHO => {
                let b = args.get_opaque(UNBOUNDED)?;
                args.finish()?;
                reply.put_opaque_bytes(&b, UNBOUNDED)?;
                Ok(Dispatch::Success)
            }
            ADD => {
                let a = args.get_i32()?;
                let b = args.get_i32()?;
                args.finish()?;
                reply.put_i32(a.wrapping_add(b));
                Ok(Dispatch::Success)
            }
            FAIL => Ok(Dispatch::SystemErr),
            ONEWAY_PUSH => {
                let v = args.get_u32()?;
                args.finish()?;
                self.log.lock().unwrap().push(v);
                Ok(Dispatch::NoReply)
            }
            GET_LOG => {
                args.finish()?;
                let log = self.log.lock().unwrap().clone();
                reply.put_array(&log, UNBOUNDED, |e, v| {
                    e.put_u32(*v);
                    Ok(())
                })?;
                Ok(Dispatch::Success)
            }
            SLOW => {
                let ms = args.get_u32()?;
                args.finish()?;
                std::thread::sleep(Duration::from_millis(u64::from(ms)));
                reply.put_u32(ms);
                Ok(Dispatch::Success)
            }
            WHOAMI => {
                args.finish()?;
                match &ctx.credential {
                    Credential::Sys(s) => {
                        reply.put_u32(1);
                        reply.put_u32(s.uid);
                        reply.put_u32(s.gid);
                        reply.put_string(&s.machinename, 255)?;
                        reply.put_array(&s.gids, 16, |e, g| {
                            e.put_u32(*g);
                            Ok(())
                        })?;
                    }
                    _ => reply.put_u32(0),
                }
                match &ctx.peer {
                    Peer::Tcp(_) => reply.put_u32(1),
                    Peer::Unix { pid, uid, .. } => {
                        reply.put_u32(2);
                        reply.put_i32(*pid);
                        reply.put_u32(*uid);
                    }
                    _ => reply.put_u32(0),
                }
                Ok(Dispatch::Success)
            }
            PANIC => panic!("test panic"),
            CLOSE => Ok(Dispatch::Close),
            _ => Ok(Dispatch::ProcUnavail),
        })();
        res.unwrap_or(Dispatch::GarbageArgs)
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Transport {
    Tcp,
    /// A Unix socket, the client asking for the plain socket.
    Unix,
    /// A Unix socket, the client asking for shared memory (and failing without it).
    Shm,
}

/// The socket transports, for tests writing raw bytes.
#[allow(dead_code)]
pub const BOTH: [Transport; 2] = [Transport::Tcp, Transport::Unix];
/// Every transport a client can use.
#[allow(dead_code)]
pub const ALL: [Transport; 3] = [Transport::Tcp, Transport::Unix, Transport::Shm];

pub struct TestServer {
    pub transport: Transport,
    pub handle: Option<ServerHandle>,
    pub endpoint: Endpoint,
    pub log: Arc<Mutex<Vec<u32>>>,
    pub _dir: tempfile::TempDir,
}

impl TestServer {
    pub fn handle(&self) -> &ServerHandle {
        self.handle.as_ref().unwrap()
    }

    /// A client over this server's transport, with `config` otherwise.
    #[allow(dead_code)]
    pub fn client_with(
        &self,
        mut config: remora_oncrpc::ClientConfig,
    ) -> Result<remora_oncrpc::Client, remora_oncrpc::RpcError> {
        config.transport = match self.transport {
            Transport::Tcp => remora_oncrpc::TransportChoice::Tcp,
            Transport::Unix => remora_oncrpc::TransportChoice::Unix,
            Transport::Shm => remora_oncrpc::TransportChoice::Shm,
        };
        let c = remora_oncrpc::Client::connect_with(&self.endpoint, config)?;
        assert_eq!(c.is_shm(), self.transport == Transport::Shm);
        Ok(c)
    }

    /// A client over this server's transport.
    #[allow(dead_code)]
    pub fn client(&self) -> Result<remora_oncrpc::Client, remora_oncrpc::RpcError> {
        self.client_with(remora_oncrpc::ClientConfig::default())
    }
}

pub fn start(t: Transport) -> TestServer {
    start_with(t, ServerConfig::default())
}

pub fn start_with(t: Transport, config: ServerConfig) -> TestServer {
    let dir = tempfile::tempdir().unwrap();
    let ep = match t {
        Transport::Tcp => Endpoint::Tcp("127.0.0.1:0".into()),
        Transport::Unix | Transport::Shm => Endpoint::Unix(dir.path().join("rpc.sock")),
    };
    let log = Arc::new(Mutex::new(Vec::new()));
    let handle = Server::builder(config)
        .service(Arc::new(TestService {
            version: 1,
            log: Arc::clone(&log),
        }))
        .service(Arc::new(TestService {
            version: 3,
            log: Arc::clone(&log),
        }))
        .listen(&ep)
        .unwrap()
        .start()
        .unwrap();
    let endpoint = handle.local_endpoints()[0].clone();
    TestServer {
        transport: t,
        handle: Some(handle),
        endpoint,
        log,
        _dir: dir,
    }
}

/// A raw stream to the server, for sending hand-made bytes.
pub enum Raw {
    Tcp(TcpStream),
    Unix(UnixStream),
}

impl Raw {
    pub fn connect(ep: &Endpoint) -> Raw {
        match ep {
            Endpoint::Tcp(a) | Endpoint::Tls(a) => {
                Raw::Tcp(TcpStream::connect(a.as_str()).unwrap())
            }
            Endpoint::Unix(p) => Raw::Unix(UnixStream::connect(p).unwrap()),
        }
    }

    pub fn set_read_timeout(&self, t: Duration) {
        match self {
            Raw::Tcp(s) => s.set_read_timeout(Some(t)).unwrap(),
            Raw::Unix(s) => s.set_read_timeout(Some(t)).unwrap(),
        }
    }

    /// Sends `payload` as one record.
    pub fn send_record(&mut self, payload: &[u8]) {
        let mut buf = (0x8000_0000u32 | payload.len() as u32)
            .to_be_bytes()
            .to_vec();
        buf.extend_from_slice(payload);
        self.write_all(&buf).unwrap();
    }

    /// Reads one record (panics on EOF or timeout).
    pub fn read_record(&mut self) -> Vec<u8> {
        let mut out = Vec::new();
        loop {
            let mut h = [0u8; 4];
            self.read_exact(&mut h).unwrap();
            let h = u32::from_be_bytes(h);
            let mut frag = vec![0u8; (h & 0x7fff_ffff) as usize];
            self.read_exact(&mut frag).unwrap();
            out.extend(frag);
            if h & 0x8000_0000 != 0 {
                return out;
            }
        }
    }

    /// Whether the server closed the connection (EOF or reset) within `t`.
    pub fn closed_within(&mut self, t: Duration) -> bool {
        self.set_read_timeout(t);
        let mut b = [0u8; 64];
        loop {
            match self.read(&mut b) {
                Ok(0) => return true,
                Ok(_) => continue,
                Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
                Err(_) => return false,
            }
        }
    }
}

impl Read for Raw {
    fn read(&mut self, buf: &mut [u8]) -> std::io::Result<usize> {
        match self {
            Raw::Tcp(s) => s.read(buf),
            Raw::Unix(s) => s.read(buf),
        }
    }
}

impl Write for Raw {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        match self {
            Raw::Tcp(s) => s.write(buf),
            Raw::Unix(s) => s.write(buf),
        }
    }
    fn flush(&mut self) -> std::io::Result<()> {
        Ok(())
    }
}

/// A call header with AUTH_NONE, as raw bytes.
pub fn call_header(xid: u32, prog: u32, vers: u32, proc_: u32) -> Vec<u8> {
    let mut v = Vec::new();
    for w in [xid, 0, 2, prog, vers, proc_, 0, 0, 0, 0] {
        v.extend_from_slice(&w.to_be_bytes());
    }
    v
}

pub fn words(raw: &[u8]) -> Vec<u32> {
    raw.chunks(4)
        .map(|c| {
            let mut w = [0u8; 4];
            w[..c.len()].copy_from_slice(c);
            u32::from_be_bytes(w)
        })
        .collect()
}

pub fn bytes(v: Vec<u8>) -> Bytes {
    Bytes::from(v)
}

/// Resident set size of this process in bytes (from /proc/self/statm).
pub fn rss_bytes() -> usize {
    let s = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: usize = s.split_whitespace().nth(1).unwrap().parse().unwrap();
    pages * 4096
}
