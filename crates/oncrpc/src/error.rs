//! Errors seen by RPC callers.

use std::io;
use std::time::Duration;

use crate::auth::AuthStat;
use crate::xdr;

/// Errors seen by an RPC caller. Each says what happened and what to do about it.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RpcError {
    /// The connection was lost (closed by the server, reset, or broken by an earlier protocol
    /// error). Every call pending on it failed; later calls on this [`Client`](crate::Client)
    /// fail at once.
    #[error(
        "connection to the RPC server was lost (closed, reset or unusable after an earlier error); \
         the call may or may not have run: reconnect with Client::connect and retry if the \
         call is idempotent"
    )]
    ConnectionLost,
    /// The connection could not be established.
    #[error(
        "cannot connect to {endpoint}: {source}; check that the server is running and the address is right"
    )]
    Connect {
        /// The endpoint, as text.
        endpoint: String,
        /// The underlying error.
        #[source]
        source: io::Error,
    },
    /// No reply came within the timeout. The call may still run on the server; a late reply is
    /// dropped.
    #[error(
        "no reply to the call within {timeout:?}; the server may be slow or stuck (the call may \
         still run): raise the timeout or check the server"
    )]
    Timeout {
        /// The timeout that expired.
        timeout: Duration,
    },
    /// The server sent nothing for `silent` while calls were waiting for it, and did not
    /// answer a liveness ping either ([`ClientConfig::liveness`](crate::ClientConfig)): it
    /// is hung, stopped or unreachable. The connection is closed and every call on it fails.
    #[error(
        "the RPC server sent nothing for {silent:?} while calls waited, and did not answer a \
         liveness ping: it is hung, stopped or unreachable; the connection is closed (check \
         the server and the network, then reconnect)"
    )]
    ServerUnresponsive {
        /// How long the server was silent.
        silent: Duration,
    },
    /// PROG_UNAVAIL: the server does not serve the program.
    #[error(
        "server does not serve program {program:#x} (PROG_UNAVAIL): check the program number or \
         that the server is running the right service"
    )]
    ProgUnavail {
        /// The program called.
        program: u32,
    },
    /// PROG_MISMATCH: the server serves the program but not this version.
    #[error(
        "server does not serve version {version} of program {program:#x} (PROG_MISMATCH; it \
         serves versions {low} to {high}): use a client built for a supported version"
    )]
    ProgMismatch {
        /// The program called.
        program: u32,
        /// The version called.
        version: u32,
        /// Lowest version the server serves.
        low: u32,
        /// Highest version the server serves.
        high: u32,
    },
    /// PROC_UNAVAIL: the program version has no such procedure.
    #[error(
        "program {program:#x} version {version} has no procedure {procedure} (PROC_UNAVAIL): \
         client and server disagree on the interface; rebuild both from the same .x file"
    )]
    ProcUnavail {
        /// The program called.
        program: u32,
        /// The version called.
        version: u32,
        /// The procedure called.
        procedure: u32,
    },
    /// GARBAGE_ARGS: the server could not decode the arguments.
    #[error(
        "server could not decode the arguments of procedure {procedure} of program {program:#x} \
         version {version} (GARBAGE_ARGS): client and server disagree on the argument types"
    )]
    GarbageArgs {
        /// The program called.
        program: u32,
        /// The version called.
        version: u32,
        /// The procedure called.
        procedure: u32,
    },
    /// SYSTEM_ERR: the server failed while running the procedure.
    #[error(
        "server failed while running procedure {procedure} of program {program:#x} version \
         {version} (SYSTEM_ERR): see the server's log"
    )]
    SystemErr {
        /// The program called.
        program: u32,
        /// The version called.
        version: u32,
        /// The procedure called.
        procedure: u32,
    },
    /// RPC_MISMATCH: the server does not speak RPC version 2.
    #[error(
        "server rejected the call: it supports RPC versions {low} to {high}, not 2 (RPC_MISMATCH); \
         the server is not an ONC RPC v2 server"
    )]
    RpcMismatch {
        /// Lowest RPC version the server supports.
        low: u32,
        /// Highest RPC version the server supports.
        high: u32,
    },
    /// AUTH_ERROR: the server rejected the call's credentials.
    #[error(
        "server rejected the call's authentication ({stat}, AUTH_ERROR): present what the \
         server requires (AUTH_TOOWEAK: it serves nothing before the connection has \
         authenticated; AUTH_BADCRED: it does not accept the credential or token given; \
         AUTH_REJECTEDCRED: use AUTH_NONE or AUTH_SYS)"
    )]
    AuthError {
        /// Why authentication failed.
        stat: AuthStat,
    },
    /// The reply's results could not be decoded (or had trailing bytes).
    #[error(
        "cannot decode the result of procedure {procedure} of program {program:#x} version \
         {version}: {source}; client and server disagree on the result type"
    )]
    Decode {
        /// The program called.
        program: u32,
        /// The version called.
        version: u32,
        /// The procedure called.
        procedure: u32,
        /// The XDR error.
        #[source]
        source: xdr::Error,
    },
    /// The call's arguments could not be encoded (a value exceeds its declared bound).
    #[error("cannot encode the arguments: {0}; the value does not fit its XDR declaration")]
    Encode(#[source] xdr::Error),
    /// The reply's header was malformed (the connection itself stays usable).
    #[error(
        "malformed reply header from the server: {0}; the server does not speak ONC RPC correctly"
    )]
    MalformedReply(#[source] xdr::Error),
    /// An I/O error other than a lost connection (for example setting a socket option).
    #[error("I/O error: {0}")]
    Io(#[from] io::Error),
    /// A reply record exceeded the client's maximum record size; the connection is closed.
    #[error(
        "reply of at least {size} bytes exceeds the maximum record size of {max} bytes; raise \
         ClientConfig::max_record_size if replies this large are expected"
    )]
    RecordTooLarge {
        /// Declared record size.
        size: u64,
        /// The configured maximum.
        max: usize,
    },
    /// The transport asked for cannot be used with this endpoint or server.
    #[error("cannot use the {transport} transport with {endpoint}: {reason}")]
    Transport {
        /// The transport asked for.
        transport: crate::TransportChoice,
        /// The endpoint, as text.
        endpoint: String,
        /// Why, and what to do instead.
        reason: String,
    },
    /// The server could not bind an endpoint or start.
    #[error(transparent)]
    Server(#[from] crate::ServerError),
}
