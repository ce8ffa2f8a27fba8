//! The shared-memory bootstrap: how a Unix connection moves its RPC traffic into shared memory.
//!
//! ```text
//!  client (Unix socket connected)                 server (Unix peer, same host)
//!  CALL  SHM_PROGRAM v1 SHM_SETUP(ring_capacity) ─►
//!                                                 create a sealed memfd Region
//!        ◄─ REPLY status=OK, ring_capacity, data_size, server_base (memfd: SCM_RIGHTS)
//!  map it, check seals/size/header                switch the connection to the rings
//!  every later record: request ring ─►            ◄─ response ring
//!  Unix socket: silent, open; closed = session over
//! ```
//!
//! It is an ordinary ONC RPC call of a tiny program of its own (`SHM_PROGRAM`), so a client
//! that never asks is served over the socket exactly as before, and a server without it
//! answers PROG_UNAVAIL (the client then stays on the socket, or fails if shared memory was
//! required). The client makes the call first on a fresh connection, with nothing else in
//! flight; the server refuses (`BUSY`) if bytes follow the call on the socket. Records then
//! travel through the rings unchanged, record marking included.
//!
//! The XDR, for reference:
//!
//! ```text
//! program SHM_PROGRAM {                  /* 0x2053484D, "SHM" */
//!     version SHM_V1 {
//!         shm_setup_reply SHM_SETUP(unsigned int ring_capacity /* 0: server's choice */) = 1;
//!     } = 1;
//! } = 0x2053484D;
//! struct shm_setup_reply {
//!     unsigned int status;               /* SHM_OK, SHM_NOT_LOCAL, SHM_DISABLED, SHM_BUSY, SHM_FAILED */
//!     unsigned int ring_capacity;        /* bytes of each ring: a power of two >= 4096 */
//!     unsigned hyper data_size;          /* bytes of the data area (0: none) */
//!     unsigned hyper server_base;        /* where the server mapped the region (0: refused) */
//! };
//! ```
//!
//! The client maps the region at `server_base` when that range is free in its process
//! (`MAP_FIXED_NOREPLACE`, never replacing anything), elsewhere otherwise; at the same address
//! a pointer into the data area names the same bytes in both processes.
//!
//! ```text
//! ```

use std::io;
use std::os::fd::AsFd;
use std::os::unix::net::UnixStream;
use std::time::Duration;

pub use remora_shm::ShmStream;
use remora_shm::{Layout, Region, Side, recv_with_fd, send_with_fd};
use remora_xdr::{Bytes, Decoder, Encoder, XdrDecode, XdrEncode};

use crate::auth::OpaqueAuth;
use crate::msg::{AcceptStat, MSG_CALL, MsgBody, RPC_VERSION, RpcMsg};
use crate::record::{MAX_FRAGMENT_SIZE, write_record};
use crate::{Peer, RpcError, xdr};

/// Program number of the bootstrap ("SHM" in the user-defined range).
pub const SHM_PROGRAM: u32 = 0x2053_484D;
/// Its version.
pub const SHM_VERSION: u32 = 1;
/// `SHM_SETUP`: asks for a shared-memory session.
pub const SHM_SETUP: u32 = 1;

/// Status of `SHM_SETUP`: the region's memfd is attached, the connection is now in it.
pub const SHM_OK: u32 = 0;
/// The connection is not a Unix socket from this host.
pub const SHM_NOT_LOCAL: u32 = 1;
/// The server does not offer shared memory.
pub const SHM_DISABLED: u32 = 2;
/// Other bytes followed the call on the socket (the call must come alone).
pub const SHM_BUSY: u32 = 3;
/// The server could not make the region.
pub const SHM_FAILED: u32 = 4;

/// Largest `SHM_SETUP` reply record a client accepts.
const MAX_SETUP_REPLY: usize = 256;

fn status_text(status: u32) -> &'static str {
    match status {
        SHM_NOT_LOCAL => "the connection is not a Unix socket on the server's host",
        SHM_DISABLED => "the server does not offer shared memory",
        SHM_BUSY => "other data followed the request on the socket",
        SHM_FAILED => "the server could not create the shared region (see its log)",
        _ => "unknown status",
    }
}

/// Connects to the server's Unix socket at `path` and moves the connection into shared
/// memory, giving the raw record-marked byte stream (a [`Client`](crate::Client) configured
/// for shared memory does this itself). Fails if the server declines.
pub fn connect(path: &std::path::Path, timeout: Duration) -> io::Result<ShmStream> {
    let socket = UnixStream::connect(path)?;
    match client_setup(socket, timeout)? {
        Ok(stream) => Ok(stream),
        Err((_, reason)) => Err(io::Error::new(io::ErrorKind::Unsupported, reason)),
    }
}

/// Client side: asks for shared memory on a fresh Unix connection. `Ok(Ok(stream))`: the
/// connection is now in shared memory; `Ok(Err((socket, reason)))`: the server declined and
/// the socket is usable as before; `Err`: the connection is unusable.
pub(crate) fn client_setup(
    socket: UnixStream,
    timeout: Duration,
) -> Result<Result<ShmStream, (UnixStream, String)>, io::Error> {
    let xid = std::process::id().rotate_left(16) ^ 0x5348_4d00;
    let mut enc = Encoder::with_capacity(64);
    for w in [
        xid,
        MSG_CALL,
        RPC_VERSION,
        SHM_PROGRAM,
        SHM_VERSION,
        SHM_SETUP,
    ] {
        enc.put_u32(w);
    }
    xdr::XdrEncode::encode(&OpaqueAuth::NONE, &mut enc).map_err(io::Error::other)?;
    xdr::XdrEncode::encode(&OpaqueAuth::NONE, &mut enc).map_err(io::Error::other)?;
    enc.put_u32(0);
    let old_timeout = socket.read_timeout()?;
    socket.set_read_timeout(Some(timeout))?;
    write_record(&mut &socket, &enc.finish(), MAX_FRAGMENT_SIZE)?;

    // The reply: one small fragment, the descriptor attached to its first byte.
    let mut buf = [0u8; 4 + MAX_SETUP_REPLY];
    let mut have = 0;
    let mut fd = None;
    let need = loop {
        if have >= 4 {
            let h = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]);
            let len = (h & 0x7fff_ffff) as usize;
            if h & 0x8000_0000 == 0 || len > MAX_SETUP_REPLY {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    "malformed reply to the shared-memory request",
                ));
            }
            if have >= 4 + len {
                break 4 + len;
            }
        }
        // Never read past the reply: what follows it is not ours to take.
        let want = if have < 4 {
            4 - have
        } else {
            let h = u32::from_be_bytes([buf[0], buf[1], buf[2], buf[3]]);
            4 + (h & 0x7fff_ffff) as usize - have
        };
        let (n, got) = recv_with_fd(&socket, &mut buf[have..have + want])?;
        if n == 0 {
            return Err(io::ErrorKind::UnexpectedEof.into());
        }
        have += n;
        if fd.is_none() {
            fd = got;
        }
    };
    socket.set_read_timeout(old_timeout)?;
    let body = Bytes::copy_from_slice(&buf[4..need]);
    let decoded = crate::client::decode_reply(body, SHM_PROGRAM, SHM_VERSION, SHM_SETUP, |d| {
        Ok((d.get_u32()?, d.get_u32()?, d.get_u64()?, d.get_u64()?))
    });
    let reply_xid = u32::from_be_bytes([buf[4], buf[5], buf[6], buf[7]]);
    if reply_xid != xid {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the reply to the shared-memory request has another XID",
        ));
    }
    let (status, ring_capacity, data_size, server_base) = match decoded {
        Ok(v) => v,
        Err(
            RpcError::ProgUnavail { .. }
            | RpcError::ProgMismatch { .. }
            | RpcError::ProcUnavail { .. },
        ) => {
            return Ok(Err((
                socket,
                "the server does not offer shared memory (an older or non-Remora server)".into(),
            )));
        }
        // The server requires authentication first: not a reason to stay on the socket,
        // which the server closes.
        Err(RpcError::AuthError { stat }) => {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                AuthRefused(stat),
            ));
        }
        Err(e) => return Ok(Err((socket, e.to_string()))),
    };
    if status != SHM_OK {
        return Ok(Err((socket, status_text(status).into())));
    }
    let Some(fd) = fd else {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "the server accepted shared memory but passed no region",
        ));
    };
    let layout = Layout {
        ring_capacity,
        data_size,
    };
    // Mapped at the server's address when that range is free here: pointers into the data
    // area then mean the same bytes on both sides (mapped host memory, `DEVICEMAP`).
    let server_base = usize::try_from(server_base).ok().filter(|&b| b != 0);
    let region = Region::open_at(fd, layout, server_base)
        .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
    Ok(Ok(ShmStream::new(region, socket, Side::Client)))
}

/// The server answered `SHM_SETUP` with AUTH_ERROR (it requires authentication first).
#[derive(Debug, thiserror::Error)]
#[error("the server refused the shared-memory request: {0} (AUTH_ERROR)")]
struct AuthRefused(crate::AuthStat);

/// The AUTH_ERROR status inside an error of [`client_setup`], if that is what it is.
pub(crate) fn auth_refused(e: &io::Error) -> Option<crate::AuthStat> {
    e.get_ref()
        .and_then(|inner| inner.downcast_ref::<AuthRefused>())
        .map(|r| r.0)
}

/// A `SHM_SETUP` call, as the server sees it.
pub(crate) struct SetupRequest {
    xid: u32,
    ring_capacity: u32,
}

/// Whether `record` is a well-formed `SHM_SETUP` call (looked at cheaply first: the program
/// word).
pub(crate) fn setup_request(record: &Bytes) -> Option<SetupRequest> {
    if record.get(12..16) != Some(&SHM_PROGRAM.to_be_bytes()[..]) {
        return None;
    }
    let mut dec = Decoder::new(record.clone());
    let msg = RpcMsg::decode(&mut dec).ok()?;
    let MsgBody::Call(call) = msg.body else {
        return None;
    };
    if call.rpcvers != RPC_VERSION || call.vers != SHM_VERSION || call.proc != SHM_SETUP {
        return None;
    }
    let ring_capacity = dec.get_u32().ok()?;
    dec.finish().ok()?;
    Some(SetupRequest {
        xid: msg.xid,
        ring_capacity,
    })
}

/// The reply record to `SHM_SETUP`, unframed.
/// The reply to `SHM_SETUP`: status, ring capacity and data size (0 when refused), and the
/// address at which the server mapped the region (0 when refused).
pub(crate) fn setup_reply(xid: u32, status: u32, region: Option<(Layout, usize)>) -> Vec<Bytes> {
    let mut enc = Encoder::with_capacity(56);
    // Encoding a fixed-size header into a growable buffer cannot fail.
    let _ = RpcMsg::accepted(xid, AcceptStat::Success).encode(&mut enc);
    enc.put_u32(status);
    enc.put_u32(region.map_or(0, |r| r.0.ring_capacity));
    enc.put_u64(region.map_or(0, |r| r.0.data_size));
    enc.put_u64(region.map_or(0, |r| r.1 as u64));
    enc.finish()
}

/// What the server does with a `SHM_SETUP` call.
pub(crate) enum Setup {
    /// Send this reply as usual and stay on the socket.
    Refuse(Vec<Bytes>),
    /// The reply (memfd attached) is to be sent on `socket`, after which the connection
    /// lives in `stream`.
    Accept { reply: Vec<u8>, stream: ShmStream },
}

/// Decides on a `SHM_SETUP` call and, when it is granted, makes the region. `socket` is the
/// connection's Unix socket if it is one; `alone` whether no byte followed the call.
pub(crate) fn serve_setup(
    req: &SetupRequest,
    socket: Option<&UnixStream>,
    peer: &Peer,
    alone: bool,
    max_ring: u32,
    data_bytes: u64,
) -> Setup {
    let refuse = |status| Setup::Refuse(setup_reply(req.xid, status, None));
    let (Some(socket), Peer::Unix { .. }) = (socket, peer) else {
        return refuse(SHM_NOT_LOCAL);
    };
    if max_ring == 0 {
        return refuse(SHM_DISABLED);
    }
    if !alone {
        tracing::warn!(%peer, "ONC RPC server: a shared-memory request came with other data; refused");
        return refuse(SHM_BUSY);
    }
    let max_ring = max_ring.max(4096).next_power_of_two();
    let ring_capacity = match req.ring_capacity {
        0 => max_ring,
        n => n.clamp(4096, max_ring).next_power_of_two().min(max_ring),
    };
    let layout = Layout {
        ring_capacity,
        data_size: data_bytes.min(1 << 40).next_multiple_of(4096),
    };
    let region = match Region::create("remora-session", layout) {
        Ok(v) => v,
        Err(e) => {
            tracing::warn!(%peer, error = %e, "ONC RPC server: cannot create a shared-memory region; the session stays on its socket");
            return refuse(SHM_FAILED);
        }
    };
    let liveness = match socket.try_clone() {
        Ok(s) => s,
        Err(e) => {
            tracing::warn!(%peer, error = %e, "ONC RPC server: cannot clone the session's socket; the session stays on it");
            return refuse(SHM_FAILED);
        }
    };
    let mut reply = Vec::with_capacity(64);
    if write_record(
        &mut reply,
        &setup_reply(req.xid, SHM_OK, Some((layout, region.base_address()))),
        MAX_FRAGMENT_SIZE,
    )
    .is_err()
    {
        return refuse(SHM_FAILED);
    }
    let stream = ShmStream::new(region, liveness, Side::Server);
    // The session ends as soon as its client process does, not at the next sleep slice.
    if let Err(e) = stream.watch_peer() {
        tracing::debug!(%peer, error = %e, "ONC RPC server: no watcher for the shared-memory session's socket; a vanished client is noticed within a sleep slice");
    }
    Setup::Accept { reply, stream }
}

/// Sends the granted reply on `socket` with the region's descriptor.
pub(crate) fn send_grant(socket: &UnixStream, reply: &[u8], stream: &ShmStream) -> io::Result<()> {
    send_with_fd(socket, reply, stream.region().fd().as_fd())
}
