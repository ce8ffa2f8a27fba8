//! Dispatch: the [`Service`] trait and what a handler sees ([`CallContext`], [`Dispatch`],
//! [`ProcResult`]), the registry of services, and turning a call record (header, auth,
//! program and version) into a call of its service and the reply to send.

use std::collections::BTreeMap;
use std::fmt;
use std::panic::{AssertUnwindSafe, catch_unwind};
use std::sync::{Arc, OnceLock};

use remora_xdr::{Bytes, Decoder, Encoder, XdrDecode, XdrEncode};

use super::connection::{DeferredReply, ReplySink};
#[cfg(doc)]
use crate::Server;
use crate::auth::{AUTH_NONE, AUTH_SYS, AuthStat, AuthSys, Credential, OpaqueAuth};
use crate::msg::{AcceptStat, MSG_CALL, MSG_REPLY, RPC_VERSION, RejectedReply, RpcMsg};
use crate::{DataArea, Peer, xdr};

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
    /// Caller's credentials (AUTH_SYS parsed).
    pub credential: Credential,
    /// The connection's peer.
    pub peer: Peer,
    /// Identifies the connection the call arrived on, unique for the server's lifetime;
    /// [`Service::connection_closed`] names it when the connection ends.
    pub connection: u64,
    /// Where a deferred reply is written; `None` when the transport cannot share its writer.
    pub(crate) reply_sink: Option<ReplySink>,
    /// The data area of the connection's shared-memory region, when it is in one.
    pub(crate) data_area: Option<DataArea>,
    /// Who the connection authenticated as ([`CallContext::authenticate`]), shared by every
    /// call of the connection.
    pub(crate) auth: ConnectionAuth,
}

/// A connection's authentication: empty until a service authenticates it, then the tenant's
/// name, for the rest of the connection (it cannot change).
pub(crate) type ConnectionAuth = Arc<OnceLock<String>>;

impl CallContext {
    /// A context for calling a service outside a server (tests, in-process use): connection
    /// 0, no deferred replies.
    pub fn detached(
        xid: u32,
        program: u32,
        version: u32,
        procedure: u32,
        credential: Credential,
        peer: Peer,
    ) -> Self {
        Self {
            xid,
            program,
            version,
            procedure,
            credential,
            peer,
            connection: 0,
            reply_sink: None,
            data_area: None,
            auth: ConnectionAuth::default(),
        }
    }

    /// Marks the connection this call arrived on as authenticated as `tenant` (a service does
    /// this once it has checked the caller's proof, e.g. a token in a handshake). With
    /// [`ServerConfig::auth_open_procedures`](crate::ServerConfig) set, only then are the
    /// connection's other calls served. A connection is authenticated once: returns false,
    /// changing nothing, when it already was.
    pub fn authenticate(&self, tenant: &str) -> bool {
        self.auth.set(tenant.to_owned()).is_ok()
    }

    /// The tenant the connection authenticated as, if it has.
    pub fn tenant(&self) -> Option<&str> {
        self.auth.get().map(String::as_str)
    }

    /// Has the connection's next wait for a call spin first for at least `spin` (at most
    /// 10 ms), whatever its waiter has learned to prefer: for a call after which the client
    /// is known to send its next one soon while it spins itself (a completion-word signal,
    /// which the client watches and answers with its next call). On a loaded host a lone
    /// waiter learns to block at once, and each next call then pays its wake-up. Ignored by
    /// in-memory streams; a later call replaces a hold not used yet.
    pub fn hold_next_read(&self, spin: std::time::Duration) {
        if let Some(sink) = &self.reply_sink {
            let ns = u64::try_from(spin.as_nanos()).unwrap_or(u64::MAX);
            sink.read_hold_ns
                .store(ns, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// The data area of the connection's shared-memory region (`None` on a socket, or when
    /// the region has no data area). The client may write it at any time: bound every
    /// offset and length with [`DataArea::check`] before use.
    pub fn data_area(&self) -> Option<&DataArea> {
        self.data_area.as_ref()
    }

    /// This context with `area` as its data area (tests, in-process use).
    pub fn with_data_area(mut self, area: Option<DataArea>) -> Self {
        self.data_area = area.filter(|a| !a.is_empty());
        self
    }

    /// Closes the connection this call arrived on, from any thread (e.g. a call run later on
    /// a thread of the service that finds the peer broke a limit, where returning
    /// [`Dispatch::Close`] is no longer possible): its thread stops reading and the services
    /// hear [`Service::connection_closed`]. Does nothing on a connection that cannot defer.
    pub fn close_connection(&self) {
        if let Some(sink) = &self.reply_sink {
            sink.shut_down();
        }
    }

    /// Takes over the reply to this call: the handler then returns
    /// [`ProcError::Deferred`] (or [`Dispatch::Deferred`]) and the connection goes on with its
    /// next calls, while the returned [`DeferredReply`] sends the SUCCESS reply later, from
    /// any thread. `None` when the connection cannot defer (answer inline then).
    ///
    /// A `DeferredReply` dropped without [`DeferredReply::reply`] answers SYSTEM_ERR, so a
    /// caller is never left waiting.
    pub fn defer(&self) -> Option<DeferredReply> {
        self.reply_sink
            .as_ref()
            .map(|sink| DeferredReply::new(self.xid, sink.clone()))
    }
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
    /// Send nothing now: the handler took a [`DeferredReply`] (see [`CallContext::defer`])
    /// that replies later.
    Deferred,
    /// Send no reply and close the connection: the peer broke a limit of the service (the
    /// service logs which), and no answer to this call could be right.
    Close,
    /// Reply AUTH_ERROR with this status (RFC 5531 `rejected_reply`), then close the
    /// connection: the caller failed to authenticate (the service logs why).
    Denied(AuthStat),
}

impl From<ProcError> for Dispatch {
    fn from(e: ProcError) -> Self {
        match e {
            ProcError::GarbageArgs => Dispatch::GarbageArgs,
            ProcError::SystemErr => Dispatch::SystemErr,
            ProcError::Deferred => Dispatch::Deferred,
            ProcError::Close => Dispatch::Close,
            ProcError::Denied(stat) => Dispatch::Denied(stat),
        }
    }
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
    /// Reply later: the handler holds a [`DeferredReply`] from [`CallContext::defer`].
    #[error("the reply is deferred")]
    Deferred,
    /// Send no reply and close the connection ([`Dispatch::Close`]): the peer broke a limit
    /// of the service, which logs which.
    #[error("the peer broke a limit; the connection is closed")]
    Close,
    /// Reply AUTH_ERROR with this status and close the connection ([`Dispatch::Denied`]):
    /// the caller failed to authenticate.
    #[error("authentication failed ({0}); the connection is closed")]
    Denied(AuthStat),
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
    ///
    /// `reply` already holds the reply header; it is discarded unless this returns
    /// [`Dispatch::Success`]. A panic is caught and answered SYSTEM_ERR.
    fn dispatch(&self, ctx: &CallContext, args: &mut Decoder, reply: &mut Encoder) -> Dispatch;

    /// Called once when connection `connection` (see [`CallContext::connection`]) has ended,
    /// on that connection's thread, before its socket is closed: release what the connection
    /// owned. Deferred replies sent from here still reach the peer if it is listening.
    fn connection_closed(&self, connection: u64) {
        let _ = connection;
    }

    /// The name of `procedure` as the specification spells it, for logs and profiles
    /// (`None` when unknown).
    fn procedure_name(&self, procedure: u32) -> Option<&'static str> {
        let _ = procedure;
        None
    }
}

/// The registered services, by program then version.
#[derive(Clone, Default)]
pub(crate) struct Registry {
    pub(super) programs: BTreeMap<u32, BTreeMap<u32, Arc<dyn Service>>>,
}

impl Registry {
    pub(crate) fn add(&mut self, svc: Arc<dyn Service>) {
        self.programs
            .entry(svc.program())
            .or_default()
            .insert(svc.version(), svc);
    }

    pub(super) fn pairs(&self) -> Vec<(u32, u32)> {
        self.programs
            .iter()
            .flat_map(|(p, vs)| vs.keys().map(move |v| (*p, *v)))
            .collect()
    }
}

impl fmt::Debug for Registry {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_list().entries(self.pairs()).finish()
    }
}

/// What to do after a record.
pub(crate) enum Outcome {
    Reply(Vec<Bytes>),
    NoReply,
    Close,
    /// Send this reply, then close the connection (authentication refused).
    ReplyThenClose(Vec<Bytes>),
}

fn reply_header(msg: &RpcMsg) -> Outcome {
    let mut enc = Encoder::with_capacity(32);
    match msg.encode(&mut enc) {
        Ok(()) => Outcome::Reply(enc.finish()),
        Err(_) => Outcome::Close,
    }
}

fn accepted(xid: u32, stat: AcceptStat) -> Outcome {
    reply_header(&RpcMsg::accepted(xid, stat))
}

fn auth_error(xid: u32, stat: AuthStat) -> Outcome {
    reply_header(&RpcMsg::denied(xid, RejectedReply::AuthError(stat)))
}

/// AUTH_ERROR with `stat`, then the connection is closed.
fn auth_error_then_close(xid: u32, stat: AuthStat) -> Outcome {
    match auth_error(xid, stat) {
        Outcome::Reply(chunks) => Outcome::ReplyThenClose(chunks),
        other => other,
    }
}

/// Whether a call of `program`'s `procedure` may be served on a connection whose
/// authentication is `auth`: always when the server requires none (`open` is `None`),
/// otherwise once the connection has authenticated or when the call is one of the `open`
/// (program, procedure) pairs.
pub(crate) fn admitted(
    open: Option<&[(u32, u32)]>,
    auth: &ConnectionAuth,
    program: u32,
    procedure: u32,
) -> bool {
    match open {
        None => true,
        Some(open) => auth.get().is_some() || open.contains(&(program, procedure)),
    }
}

fn read_auth(dec: &mut Decoder) -> Result<OpaqueAuth, AuthOrGarbage> {
    OpaqueAuth::decode(dec).map_err(|e| match e {
        xdr::Error::LengthExceedsBound { .. } => AuthOrGarbage::Auth,
        _ => AuthOrGarbage::Garbage,
    })
}

enum AuthOrGarbage {
    Auth,
    Garbage,
}

/// What [`process_call`] knows of the connection a record arrived on.
pub(crate) struct ConnectionInfo<'a> {
    pub(crate) peer: &'a Peer,
    pub(crate) connection: u64,
    pub(crate) sink: Option<&'a ReplySink>,
    pub(crate) area: Option<&'a DataArea>,
    pub(crate) auth: &'a ConnectionAuth,
    /// [`ServerConfig::auth_open_procedures`](crate::ServerConfig).
    pub(crate) open: Option<&'a [(u32, u32)]>,
}

/// Turns one call record into the reply to send (or none).
pub(crate) fn process_call(
    record: Bytes,
    conn: &ConnectionInfo<'_>,
    registry: &Registry,
) -> Outcome {
    let ConnectionInfo {
        peer,
        connection,
        sink,
        area,
        auth,
        open,
    } = *conn;
    let mut dec = Decoder::new(record);
    let Ok(xid) = dec.get_u32() else {
        tracing::warn!(%peer, "ONC RPC server: record too short to hold an XID; connection closed");
        return Outcome::Close;
    };
    let garbage = |what: &str| {
        tracing::debug!(%peer, xid, what, "ONC RPC server: undecodable call header; GARBAGE_ARGS");
        accepted(xid, AcceptStat::GarbageArgs)
    };
    match dec.get_u32() {
        Ok(MSG_CALL) => {}
        Ok(MSG_REPLY) => {
            tracing::warn!(%peer, xid, "ONC RPC server: protocol error: a REPLY message was sent to the server; connection closed");
            return Outcome::Close;
        }
        Ok(_) => return garbage("unknown msg_type"),
        Err(_) => return garbage("msg_type"),
    }
    let Ok(rpcvers) = dec.get_u32() else {
        return garbage("rpcvers");
    };
    if rpcvers != RPC_VERSION {
        tracing::debug!(%peer, xid, rpcvers, "ONC RPC server: wrong RPC version; RPC_MISMATCH");
        return reply_header(&RpcMsg::denied(
            xid,
            RejectedReply::RpcMismatch {
                low: RPC_VERSION,
                high: RPC_VERSION,
            },
        ));
    }
    let (Ok(program), Ok(version), Ok(procedure)) = (dec.get_u32(), dec.get_u32(), dec.get_u32())
    else {
        return garbage("prog/vers/proc");
    };
    let cred = match read_auth(&mut dec) {
        Ok(c) => c,
        Err(AuthOrGarbage::Auth) => return auth_error(xid, AuthStat::BadCred),
        Err(AuthOrGarbage::Garbage) => return garbage("credential"),
    };
    match read_auth(&mut dec) {
        Ok(_) => {}
        Err(AuthOrGarbage::Auth) => return auth_error(xid, AuthStat::BadVerf),
        Err(AuthOrGarbage::Garbage) => return garbage("verifier"),
    }
    let credential = match cred.flavor {
        AUTH_NONE => Credential::None,
        AUTH_SYS => match AuthSys::from_body(cred.body) {
            Ok(sys) => Credential::Sys(sys),
            Err(e) => {
                tracing::debug!(%peer, xid, error = %e, "ONC RPC server: malformed AUTH_SYS credential; AUTH_BADCRED");
                return auth_error(xid, AuthStat::BadCred);
            }
        },
        flavor => {
            tracing::debug!(%peer, xid, flavor, "ONC RPC server: unsupported credential flavour; AUTH_REJECTEDCRED");
            return auth_error(xid, AuthStat::RejectedCred);
        }
    };
    if !admitted(open, auth, program, procedure) {
        // Before authentication nothing but the open procedures (NULL, the authenticating
        // handshake) is served, not even an answer to which programs exist.
        crate::audit!(info, "auth_required", %peer, xid, program, procedure, "ONC RPC server: a call before the connection authenticated; AUTH_ERROR (AUTH_TOOWEAK), connection closed");
        return auth_error_then_close(xid, AuthStat::TooWeak);
    }
    let Some(versions) = registry.programs.get(&program) else {
        tracing::debug!(%peer, xid, program, "ONC RPC server: unknown program; PROG_UNAVAIL");
        return accepted(xid, AcceptStat::ProgUnavail);
    };
    let Some(service) = versions.get(&version) else {
        let low = versions.keys().next().copied().unwrap_or(0);
        let high = versions.keys().next_back().copied().unwrap_or(0);
        tracing::debug!(%peer, xid, program, version, "ONC RPC server: unknown version; PROG_MISMATCH");
        return accepted(xid, AcceptStat::ProgMismatch { low, high });
    };
    let ctx = CallContext {
        xid,
        program,
        version,
        procedure,
        credential,
        peer: peer.clone(),
        connection,
        reply_sink: sink.cloned(),
        data_area: area.cloned(),
        auth: Arc::clone(auth),
    };
    // In this thread's encoding buffer, shared with its other replies (crate::scratch): a
    // one-way call, which sends none, gives the room straight back.
    let mut reply = crate::scratch::encoder();
    if RpcMsg::accepted(xid, AcceptStat::Success)
        .encode(&mut reply)
        .is_err()
    {
        return Outcome::Close;
    }
    let dispatched = catch_unwind(AssertUnwindSafe(|| {
        service.dispatch(&ctx, &mut dec, &mut reply)
    }));
    let outcome = match dispatched {
        Ok(Dispatch::Success) => return Outcome::Reply(crate::scratch::finish(reply).into()),
        Ok(Dispatch::NoReply) | Ok(Dispatch::Deferred) => Outcome::NoReply,
        Ok(Dispatch::ProcUnavail) => accepted(xid, AcceptStat::ProcUnavail),
        Ok(Dispatch::GarbageArgs) => accepted(xid, AcceptStat::GarbageArgs),
        Ok(Dispatch::SystemErr) => accepted(xid, AcceptStat::SystemErr),
        Ok(Dispatch::Close) => Outcome::Close,
        Ok(Dispatch::Denied(stat)) => auth_error_then_close(xid, stat),
        Err(_) => {
            tracing::error!(%peer, xid, program, version, procedure, "ONC RPC server: the procedure panicked; SYSTEM_ERR");
            accepted(xid, AcceptStat::SystemErr)
        }
    };
    // No reply of the procedure's own is sent: its buffer goes back whole.
    crate::scratch::discard(reply);
    outcome
}
