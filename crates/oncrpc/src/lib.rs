//! ONC RPC version 2 (RFC 5531): messages, record marking, client and server runtimes.
//!
//! CONTRACT SKELETON: the signatures below are the API that generated code (remora-rpcgen)
//! relies on. Bodies are being implemented.
#![forbid(unsafe_code)]

use std::net::SocketAddr;
use std::time::Duration;

pub use remora_xdr as xdr;
use remora_xdr::{Decoder, Encoder};

/// Where a client connects or a server listens: `tcp://HOST:PORT` or `unix:///PATH`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// A TCP address.
    Tcp(String),
    /// A Unix-domain stream socket path.
    Unix(std::path::PathBuf),
}

/// Errors seen by an RPC caller.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RpcError {
    /// The connection was lost.
    #[error("connection lost")]
    ConnectionLost,
}

/// Credentials a call carried.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Credential {
    /// AUTH_NONE.
    None,
}

/// Who is on the other end of a connection.
#[derive(Debug, Clone)]
#[non_exhaustive]
pub enum Peer {
    /// A TCP peer.
    Tcp(SocketAddr),
}

/// What a service handler knows about the call it is serving.
#[derive(Debug, Clone)]
pub struct CallContext {
    /// Transaction id.
    pub xid: u32,
    /// Program number.
    pub program: u32,
    /// Program version.
    pub version: u32,
    /// Procedure number.
    pub procedure: u32,
    /// Caller's credentials.
    pub credential: Credential,
    /// The connection's peer.
    pub peer: Peer,
}

/// How a dispatched call ended; the server runtime turns it into the reply.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dispatch {
    /// Reply SUCCESS with the bytes the handler encoded.
    Success,
    /// Send no reply (one-way procedure).
    NoReply,
    /// Reply PROC_UNAVAIL.
    ProcUnavail,
    /// Reply GARBAGE_ARGS.
    GarbageArgs,
    /// Reply SYSTEM_ERR.
    SystemErr,
}

/// Why a procedure handler failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum ProcError {
    /// Reply GARBAGE_ARGS.
    #[error("garbage arguments")]
    GarbageArgs,
    /// Reply SYSTEM_ERR.
    #[error("system error")]
    SystemErr,
}

/// Result of a procedure handler.
pub type ProcResult<T> = Result<T, ProcError>;

/// One program version served by a [`Server`].
pub trait Service: Send + Sync + 'static {
    /// Program number.
    fn program(&self) -> u32;
    /// Version number.
    fn version(&self) -> u32;
    /// Decodes the arguments from `args` (rejecting trailing bytes), runs the procedure
    /// `ctx.procedure`, and encodes its result into `reply`.
    fn dispatch(&self, ctx: &CallContext, args: &mut Decoder, reply: &mut Encoder) -> Dispatch;
}

/// A connection to an ONC RPC server; cheap to clone, usable from many threads.
#[derive(Debug, Clone)]
pub struct Client {}

impl Client {
    /// Connects to `endpoint`.
    pub fn connect(_endpoint: &Endpoint) -> Result<Client, RpcError> {
        todo!()
    }

    /// Calls `procedure`, encoding the arguments with `args` and decoding the result with
    /// `result` (trailing bytes rejected). `timeout` of `None` uses the client's default.
    pub fn call<R>(
        &self,
        _program: u32,
        _version: u32,
        _procedure: u32,
        _timeout: Option<Duration>,
        _args: impl FnOnce(&mut Encoder) -> xdr::Result<()>,
        _result: impl FnOnce(&mut Decoder) -> xdr::Result<R>,
    ) -> Result<R, RpcError> {
        todo!()
    }

    /// Sends a one-way call: no reply is awaited. Ordered with all other calls.
    pub fn call_oneway(
        &self,
        _program: u32,
        _version: u32,
        _procedure: u32,
        _args: impl FnOnce(&mut Encoder) -> xdr::Result<()>,
    ) -> Result<(), RpcError> {
        todo!()
    }
}

/// Placeholder for the server runtime.
pub struct Server {}
