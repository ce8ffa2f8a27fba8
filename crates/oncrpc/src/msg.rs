//! RPC messages (RFC 5531 §8–9): `rpc_msg` headers for calls and replies.
//!
//! Only the headers are modelled: a call's arguments and a successful reply's results follow
//! the header in the same record and are encoded/decoded by the service's own code.

use remora_xdr::{Decoder, Encoder, XdrDecode, XdrEncode};

use crate::auth::{AuthStat, OpaqueAuth};
use crate::xdr;

/// The only RPC protocol version (`rpcvers`) this crate speaks.
pub const RPC_VERSION: u32 = 2;

/// `msg_type` CALL.
pub const MSG_CALL: u32 = 0;
/// `msg_type` REPLY.
pub const MSG_REPLY: u32 = 1;
/// `reply_stat` MSG_ACCEPTED.
pub const MSG_ACCEPTED: u32 = 0;
/// `reply_stat` MSG_DENIED.
pub const MSG_DENIED: u32 = 1;
/// `reject_stat` RPC_MISMATCH.
pub const RPC_MISMATCH: u32 = 0;
/// `reject_stat` AUTH_ERROR.
pub const AUTH_ERROR: u32 = 1;

/// `accept_stat` values.
pub mod accept_stat {
    /// RPC executed successfully.
    pub const SUCCESS: u32 = 0;
    /// Remote hasn't exported the program.
    pub const PROG_UNAVAIL: u32 = 1;
    /// Remote can't support the version number.
    pub const PROG_MISMATCH: u32 = 2;
    /// Program can't support the procedure.
    pub const PROC_UNAVAIL: u32 = 3;
    /// Procedure can't decode the arguments.
    pub const GARBAGE_ARGS: u32 = 4;
    /// Memory allocation failure or other server-side error.
    pub const SYSTEM_ERR: u32 = 5;
}

fn unknown(type_name: &'static str, value: u32) -> xdr::Error {
    xdr::Error::UnknownDiscriminant {
        type_name,
        value: i64::from(value),
    }
}

/// `call_body`: the header of a CALL message after the xid and message type.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CallBody {
    /// RPC protocol version; must be [`RPC_VERSION`].
    pub rpcvers: u32,
    /// Program number.
    pub prog: u32,
    /// Program version.
    pub vers: u32,
    /// Procedure number.
    pub proc: u32,
    /// Caller's credential.
    pub cred: OpaqueAuth,
    /// Caller's verifier.
    pub verf: OpaqueAuth,
}

impl XdrEncode for CallBody {
    fn encode(&self, enc: &mut Encoder) -> xdr::Result<()> {
        enc.put_u32(self.rpcvers);
        enc.put_u32(self.prog);
        enc.put_u32(self.vers);
        enc.put_u32(self.proc);
        self.cred.encode(enc)?;
        self.verf.encode(enc)
    }
}

impl XdrDecode for CallBody {
    /// Decodes a call body; an `rpcvers` other than 2 is an error (a server wanting to answer
    /// RPC_MISMATCH reads `rpcvers` itself first).
    fn decode(dec: &mut Decoder) -> xdr::Result<Self> {
        let rpcvers = dec.get_u32()?;
        if rpcvers != RPC_VERSION {
            return Err(unknown("rpcvers", rpcvers));
        }
        Ok(Self {
            rpcvers,
            prog: dec.get_u32()?,
            vers: dec.get_u32()?,
            proc: dec.get_u32()?,
            cred: OpaqueAuth::decode(dec)?,
            verf: OpaqueAuth::decode(dec)?,
        })
    }
}

/// `accept_stat` with its arm data: what an accepted call produced.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AcceptStat {
    /// SUCCESS: the procedure's results follow.
    Success,
    /// PROG_UNAVAIL: the program is not served.
    ProgUnavail,
    /// PROG_MISMATCH: the version is not served; the lowest and highest served follow.
    ProgMismatch {
        /// Lowest version served.
        low: u32,
        /// Highest version served.
        high: u32,
    },
    /// PROC_UNAVAIL: no such procedure.
    ProcUnavail,
    /// GARBAGE_ARGS: the arguments could not be decoded.
    GarbageArgs,
    /// SYSTEM_ERR: the server failed.
    SystemErr,
}

impl XdrEncode for AcceptStat {
    fn encode(&self, enc: &mut Encoder) -> xdr::Result<()> {
        use accept_stat::*;
        match *self {
            Self::Success => enc.put_u32(SUCCESS),
            Self::ProgUnavail => enc.put_u32(PROG_UNAVAIL),
            Self::ProgMismatch { low, high } => {
                enc.put_u32(PROG_MISMATCH);
                enc.put_u32(low);
                enc.put_u32(high);
            }
            Self::ProcUnavail => enc.put_u32(PROC_UNAVAIL),
            Self::GarbageArgs => enc.put_u32(GARBAGE_ARGS),
            Self::SystemErr => enc.put_u32(SYSTEM_ERR),
        }
        Ok(())
    }
}

impl XdrDecode for AcceptStat {
    fn decode(dec: &mut Decoder) -> xdr::Result<Self> {
        use accept_stat::*;
        Ok(match dec.get_u32()? {
            SUCCESS => Self::Success,
            PROG_UNAVAIL => Self::ProgUnavail,
            PROG_MISMATCH => Self::ProgMismatch {
                low: dec.get_u32()?,
                high: dec.get_u32()?,
            },
            PROC_UNAVAIL => Self::ProcUnavail,
            GARBAGE_ARGS => Self::GarbageArgs,
            SYSTEM_ERR => Self::SystemErr,
            v => return Err(unknown("accept_stat", v)),
        })
    }
}

/// `accepted_reply`: the server's verifier and the accept status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AcceptedReply {
    /// Server's verifier.
    pub verf: OpaqueAuth,
    /// Outcome.
    pub stat: AcceptStat,
}

/// `rejected_reply`: why the server refused to run the call.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RejectedReply {
    /// RPC_MISMATCH: the RPC version is not supported; the supported range follows.
    RpcMismatch {
        /// Lowest RPC version supported.
        low: u32,
        /// Highest RPC version supported.
        high: u32,
    },
    /// AUTH_ERROR: authentication failed.
    AuthError(AuthStat),
}

impl XdrEncode for RejectedReply {
    fn encode(&self, enc: &mut Encoder) -> xdr::Result<()> {
        match *self {
            Self::RpcMismatch { low, high } => {
                enc.put_u32(RPC_MISMATCH);
                enc.put_u32(low);
                enc.put_u32(high);
                Ok(())
            }
            Self::AuthError(stat) => {
                enc.put_u32(AUTH_ERROR);
                stat.encode(enc)
            }
        }
    }
}

impl XdrDecode for RejectedReply {
    fn decode(dec: &mut Decoder) -> xdr::Result<Self> {
        Ok(match dec.get_u32()? {
            RPC_MISMATCH => Self::RpcMismatch {
                low: dec.get_u32()?,
                high: dec.get_u32()?,
            },
            AUTH_ERROR => Self::AuthError(AuthStat::decode(dec)?),
            v => return Err(unknown("reject_stat", v)),
        })
    }
}

/// `reply_body`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReplyBody {
    /// MSG_ACCEPTED.
    Accepted(AcceptedReply),
    /// MSG_DENIED.
    Denied(RejectedReply),
}

impl XdrEncode for ReplyBody {
    fn encode(&self, enc: &mut Encoder) -> xdr::Result<()> {
        match self {
            Self::Accepted(a) => {
                enc.put_u32(MSG_ACCEPTED);
                a.verf.encode(enc)?;
                a.stat.encode(enc)
            }
            Self::Denied(r) => {
                enc.put_u32(MSG_DENIED);
                r.encode(enc)
            }
        }
    }
}

impl XdrDecode for ReplyBody {
    fn decode(dec: &mut Decoder) -> xdr::Result<Self> {
        Ok(match dec.get_u32()? {
            MSG_ACCEPTED => Self::Accepted(AcceptedReply {
                verf: OpaqueAuth::decode(dec)?,
                stat: AcceptStat::decode(dec)?,
            }),
            MSG_DENIED => Self::Denied(RejectedReply::decode(dec)?),
            v => return Err(unknown("reply_stat", v)),
        })
    }
}

/// The body of an `rpc_msg`, by `msg_type`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum MsgBody {
    /// CALL.
    Call(CallBody),
    /// REPLY.
    Reply(ReplyBody),
}

/// `rpc_msg` header: the transaction id and the call or reply header. Arguments or results
/// follow it in the record.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RpcMsg {
    /// Transaction id, chosen by the caller and echoed in the reply.
    pub xid: u32,
    /// Call or reply header.
    pub body: MsgBody,
}

impl RpcMsg {
    /// A CALL header with AUTH_NONE verifier and the given credential.
    pub fn call(xid: u32, prog: u32, vers: u32, proc: u32, cred: OpaqueAuth) -> Self {
        Self {
            xid,
            body: MsgBody::Call(CallBody {
                rpcvers: RPC_VERSION,
                prog,
                vers,
                proc,
                cred,
                verf: OpaqueAuth::NONE,
            }),
        }
    }

    /// An accepted REPLY header with an AUTH_NONE verifier.
    pub fn accepted(xid: u32, stat: AcceptStat) -> Self {
        Self {
            xid,
            body: MsgBody::Reply(ReplyBody::Accepted(AcceptedReply {
                verf: OpaqueAuth::NONE,
                stat,
            })),
        }
    }

    /// A denied REPLY header.
    pub fn denied(xid: u32, rejected: RejectedReply) -> Self {
        Self {
            xid,
            body: MsgBody::Reply(ReplyBody::Denied(rejected)),
        }
    }
}

impl XdrEncode for RpcMsg {
    fn encode(&self, enc: &mut Encoder) -> xdr::Result<()> {
        enc.put_u32(self.xid);
        match &self.body {
            MsgBody::Call(c) => {
                enc.put_u32(MSG_CALL);
                c.encode(enc)
            }
            MsgBody::Reply(r) => {
                enc.put_u32(MSG_REPLY);
                r.encode(enc)
            }
        }
    }
}

impl XdrDecode for RpcMsg {
    fn decode(dec: &mut Decoder) -> xdr::Result<Self> {
        let xid = dec.get_u32()?;
        let body = match dec.get_u32()? {
            MSG_CALL => MsgBody::Call(CallBody::decode(dec)?),
            MSG_REPLY => MsgBody::Reply(ReplyBody::decode(dec)?),
            v => return Err(unknown("msg_type", v)),
        };
        Ok(Self { xid, body })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::auth::{AUTH_SYS, AuthSys};
    use remora_xdr::Bytes;

    fn enc(m: &RpcMsg) -> Vec<u8> {
        let mut e = Encoder::new();
        m.encode(&mut e).unwrap();
        e.to_bytes().to_vec()
    }

    fn roundtrip(m: &RpcMsg) {
        let bytes = enc(m);
        let back: RpcMsg = xdr::decode_all(Bytes::from(bytes)).unwrap();
        assert_eq!(&back, m);
    }

    #[test]
    fn golden_call_auth_none() {
        let m = RpcMsg::call(0x1234_5678, 100_003, 3, 0, OpaqueAuth::NONE);
        #[rustfmt::skip]
        let expected: &[u8] = &[
            0x12, 0x34, 0x56, 0x78, // xid
            0, 0, 0, 0,             // CALL
            0, 0, 0, 2,             // rpcvers
            0, 0x01, 0x86, 0xa3,    // prog 100003
            0, 0, 0, 3,             // vers
            0, 0, 0, 0,             // proc
            0, 0, 0, 0, 0, 0, 0, 0, // cred AUTH_NONE
            0, 0, 0, 0, 0, 0, 0, 0, // verf AUTH_NONE
        ];
        assert_eq!(enc(&m), expected);
        roundtrip(&m);
    }

    #[test]
    fn golden_call_auth_sys() {
        let sys = AuthSys {
            stamp: 0,
            machinename: "h".into(),
            uid: 0,
            gid: 0,
            gids: vec![],
        };
        let m = RpcMsg::call(1, 2, 3, 4, sys.to_opaque_auth().unwrap());
        #[rustfmt::skip]
        let expected: &[u8] = &[
            0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 4,
            0, 0, 0, AUTH_SYS as u8, 0, 0, 0, 24, // cred flavor, length
            0, 0, 0, 0,                  // stamp
            0, 0, 0, 1, b'h', 0, 0, 0,   // machinename
            0, 0, 0, 0, 0, 0, 0, 0,      // uid gid
            0, 0, 0, 0,                  // gids<>
            0, 0, 0, 0, 0, 0, 0, 0,      // verf
        ];
        assert_eq!(enc(&m), expected);
        roundtrip(&m);
    }

    #[test]
    fn golden_replies() {
        // xid 7, REPLY, then MSG_ACCEPTED with an AUTH_NONE verifier (flavor 0, no body) and
        // the accept_stat, or MSG_DENIED and the rejection.
        let accepted = |stat: u32, extra: &[u32]| -> Vec<u8> {
            [7, 1, 0, 0, 0, stat]
                .iter()
                .chain(extra)
                .flat_map(|w: &u32| w.to_be_bytes())
                .collect()
        };
        let denied = |words: &[u32]| -> Vec<u8> {
            [7, 1, 1]
                .iter()
                .chain(words)
                .flat_map(|w: &u32| w.to_be_bytes())
                .collect()
        };
        let cases: Vec<(RpcMsg, Vec<u8>)> = vec![
            (RpcMsg::accepted(7, AcceptStat::Success), accepted(0, &[])),
            (
                RpcMsg::accepted(7, AcceptStat::ProgUnavail),
                accepted(1, &[]),
            ),
            (
                RpcMsg::accepted(7, AcceptStat::ProgMismatch { low: 1, high: 3 }),
                accepted(2, &[1, 3]),
            ),
            (
                RpcMsg::accepted(7, AcceptStat::ProcUnavail),
                accepted(3, &[]),
            ),
            (
                RpcMsg::accepted(7, AcceptStat::GarbageArgs),
                accepted(4, &[]),
            ),
            (RpcMsg::accepted(7, AcceptStat::SystemErr), accepted(5, &[])),
            (
                RpcMsg::denied(7, RejectedReply::RpcMismatch { low: 2, high: 2 }),
                denied(&[0, 2, 2]),
            ),
            (
                RpcMsg::denied(7, RejectedReply::AuthError(AuthStat::RejectedCred)),
                denied(&[1, 2]),
            ),
        ];
        // The helpers agree with a reply written out by hand.
        assert_eq!(
            accepted(2, &[1, 3]),
            [
                0, 0, 0, 7, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 2, 0, 0, 0, 1,
                0, 0, 0, 3
            ]
        );
        for (m, bytes) in cases {
            assert_eq!(enc(&m), bytes, "{m:?}");
            roundtrip(&m);
        }
    }

    #[test]
    fn unknown_discriminants_rejected() {
        let bad_type = [0, 0, 0, 1, 0, 0, 0, 2];
        let bad_reply_stat = [0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 9];
        let bad_accept = [
            0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 6,
        ];
        let bad_reject = [0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 2];
        let bad_auth_stat = [0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 1, 0, 0, 0, 99];
        for (raw, name) in [
            (&bad_type[..], "msg_type"),
            (&bad_reply_stat[..], "reply_stat"),
            (&bad_accept[..], "accept_stat"),
            (&bad_reject[..], "reject_stat"),
            (&bad_auth_stat[..], "auth_stat"),
        ] {
            match RpcMsg::decode(&mut Decoder::from_slice(raw)) {
                Err(xdr::Error::UnknownDiscriminant { type_name, .. }) => {
                    assert_eq!(type_name, name)
                }
                other => panic!("{name}: {other:?}"),
            }
        }
    }

    #[test]
    fn rpcvers_must_be_two() {
        let mut raw = enc(&RpcMsg::call(1, 2, 3, 4, OpaqueAuth::NONE));
        raw[11] = 3;
        assert!(matches!(
            RpcMsg::decode(&mut Decoder::from_slice(&raw)),
            Err(xdr::Error::UnknownDiscriminant {
                type_name: "rpcvers",
                value: 3
            })
        ));
    }

    #[test]
    fn truncated_headers_rejected() {
        let raw = enc(&RpcMsg::call(1, 2, 3, 4, OpaqueAuth::NONE));
        for n in 0..raw.len() {
            assert!(RpcMsg::decode(&mut Decoder::from_slice(&raw[..n])).is_err());
        }
    }
}
