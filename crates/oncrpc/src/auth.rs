//! Authentication flavours (RFC 5531 §8.2, §9, appendix A): `opaque_auth`, AUTH_NONE and
//! AUTH_SYS, and the `auth_stat` values of an AUTH_ERROR reply.

use std::fmt;

use remora_xdr::{Bytes, Decoder, Encoder, XdrDecode, XdrEncode};

use crate::xdr;

/// Largest body of an `opaque_auth` (RFC 5531 §8.2: `opaque body<400>`).
pub const MAX_AUTH_BYTES: u32 = 400;
/// Flavour number of AUTH_NONE.
pub const AUTH_NONE: u32 = 0;
/// Flavour number of AUTH_SYS (also known as AUTH_UNIX).
pub const AUTH_SYS: u32 = 1;
/// Flavour number of AUTH_SHORT (not supported: rejected by the server).
pub const AUTH_SHORT: u32 = 2;
/// Flavour number of AUTH_DH (not supported: rejected by the server).
pub const AUTH_DH: u32 = 3;
/// Flavour number of RPCSEC_GSS (not supported: rejected by the server).
pub const RPCSEC_GSS: u32 = 6;

/// Longest AUTH_SYS machine name (`string machinename<255>`).
pub const AUTH_SYS_MAX_MACHINENAME: u32 = 255;
/// Most supplementary groups in AUTH_SYS (`unsigned int gids<16>`).
pub const AUTH_SYS_MAX_GIDS: u32 = 16;

/// `opaque_auth`: a flavour and an opaque body of at most 400 bytes.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct OpaqueAuth {
    /// The authentication flavour (`auth_flavor`).
    pub flavor: u32,
    /// The flavour-specific body, at most [`MAX_AUTH_BYTES`] long.
    pub body: Bytes,
}

impl OpaqueAuth {
    /// The AUTH_NONE credential or verifier: flavour 0, empty body.
    pub const NONE: OpaqueAuth = OpaqueAuth {
        flavor: AUTH_NONE,
        body: Bytes::new(),
    };

    /// An `opaque_auth`, checking that `body` fits in [`MAX_AUTH_BYTES`].
    pub fn new(flavor: u32, body: Bytes) -> xdr::Result<Self> {
        if body.len() > MAX_AUTH_BYTES as usize {
            return Err(xdr::Error::EncodeTooLong {
                len: body.len() as u64,
                max: u64::from(MAX_AUTH_BYTES),
            });
        }
        Ok(Self { flavor, body })
    }
}

impl XdrEncode for OpaqueAuth {
    fn encode(&self, enc: &mut Encoder) -> xdr::Result<()> {
        enc.put_u32(self.flavor);
        enc.put_opaque(&self.body, MAX_AUTH_BYTES)
    }
}

impl XdrDecode for OpaqueAuth {
    fn decode(dec: &mut Decoder) -> xdr::Result<Self> {
        let flavor = dec.get_u32()?;
        let body = dec.get_opaque(MAX_AUTH_BYTES)?;
        Ok(Self { flavor, body })
    }
}

/// AUTH_SYS parameters (`authsys_parms`, RFC 5531 appendix A).
///
/// These are claims made by the caller, not proof of identity: trust them only as far as you
/// trust the network path (over a Unix socket, compare them with [`Peer::Unix`](crate::Peer)).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct AuthSys {
    /// Arbitrary id the caller's machine generates (often a timestamp).
    pub stamp: u32,
    /// The caller's host name, at most 255 bytes.
    pub machinename: String,
    /// The caller's effective user id.
    pub uid: u32,
    /// The caller's effective group id.
    pub gid: u32,
    /// Supplementary groups, at most 16.
    pub gids: Vec<u32>,
}

impl AuthSys {
    /// Credentials of the current process: its uid, gid, supplementary groups (first 16) and
    /// host name.
    pub fn current() -> Self {
        let uid = rustix::process::getuid().as_raw();
        let gid = rustix::process::getgid().as_raw();
        let mut gids: Vec<u32> = rustix::process::getgroups()
            .map(|g| g.into_iter().map(|g| g.as_raw()).collect())
            .unwrap_or_default();
        gids.truncate(AUTH_SYS_MAX_GIDS as usize);
        let mut machinename = rustix::system::uname()
            .nodename()
            .to_string_lossy()
            .into_owned();
        truncate_utf8(&mut machinename, AUTH_SYS_MAX_MACHINENAME as usize);
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs() as u32)
            .unwrap_or(0);
        Self {
            stamp,
            machinename,
            uid,
            gid,
            gids,
        }
    }

    /// Encodes these parameters as an AUTH_SYS `opaque_auth`.
    pub fn to_opaque_auth(&self) -> xdr::Result<OpaqueAuth> {
        let mut enc = Encoder::new();
        self.encode(&mut enc)?;
        OpaqueAuth::new(AUTH_SYS, enc.to_bytes())
    }

    /// Parses the body of an AUTH_SYS `opaque_auth`, rejecting trailing bytes.
    pub fn from_body(body: Bytes) -> xdr::Result<Self> {
        xdr::decode_all(body)
    }
}

fn truncate_utf8(s: &mut String, max: usize) {
    if s.len() > max {
        let mut end = max;
        while !s.is_char_boundary(end) {
            end -= 1;
        }
        s.truncate(end);
    }
}

impl XdrEncode for AuthSys {
    fn encode(&self, enc: &mut Encoder) -> xdr::Result<()> {
        enc.put_u32(self.stamp);
        enc.put_string(&self.machinename, AUTH_SYS_MAX_MACHINENAME)?;
        enc.put_u32(self.uid);
        enc.put_u32(self.gid);
        enc.put_array(&self.gids, AUTH_SYS_MAX_GIDS, |e, g| {
            e.put_u32(*g);
            Ok(())
        })
    }
}

impl XdrDecode for AuthSys {
    fn decode(dec: &mut Decoder) -> xdr::Result<Self> {
        Ok(Self {
            stamp: dec.get_u32()?,
            machinename: dec.get_string(AUTH_SYS_MAX_MACHINENAME)?,
            uid: dec.get_u32()?,
            gid: dec.get_u32()?,
            gids: dec.get_array(AUTH_SYS_MAX_GIDS, Decoder::get_u32)?,
        })
    }
}

/// Why the server rejected a call's authentication (`auth_stat`, RFC 5531 §9).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[non_exhaustive]
pub enum AuthStat {
    /// AUTH_OK (0): success; never sent in an AUTH_ERROR reply by a correct server.
    Ok,
    /// AUTH_BADCRED (1): bad credential (seal broken or malformed).
    BadCred,
    /// AUTH_REJECTEDCRED (2): the client must begin a new session (unsupported flavour).
    RejectedCred,
    /// AUTH_BADVERF (3): bad verifier (seal broken).
    BadVerf,
    /// AUTH_REJECTEDVERF (4): verifier expired or replayed.
    RejectedVerf,
    /// AUTH_TOOWEAK (5): rejected for security reasons.
    TooWeak,
    /// AUTH_INVALIDRESP (6): bogus response verifier.
    InvalidResp,
    /// AUTH_FAILED (7): reason unknown.
    Failed,
    /// AUTH_KERB_GENERIC (8): Kerberos generic error.
    KerbGeneric,
    /// AUTH_TIMEEXPIRE (9): the credential's time expired.
    TimeExpire,
    /// AUTH_TKT_FILE (10): problem with the ticket file.
    TktFile,
    /// AUTH_DECODE (11): could not decode the authenticator.
    Decode,
    /// AUTH_NET_ADDR (12): wrong network address in the ticket.
    NetAddr,
    /// RPCSEC_GSS_CREDPROBLEM (13): no credentials for the user.
    GssCredProblem,
    /// RPCSEC_GSS_CTXPROBLEM (14): problem with the GSS context.
    GssCtxProblem,
}

impl AuthStat {
    /// The value on the wire.
    pub fn to_u32(self) -> u32 {
        match self {
            Self::Ok => 0,
            Self::BadCred => 1,
            Self::RejectedCred => 2,
            Self::BadVerf => 3,
            Self::RejectedVerf => 4,
            Self::TooWeak => 5,
            Self::InvalidResp => 6,
            Self::Failed => 7,
            Self::KerbGeneric => 8,
            Self::TimeExpire => 9,
            Self::TktFile => 10,
            Self::Decode => 11,
            Self::NetAddr => 12,
            Self::GssCredProblem => 13,
            Self::GssCtxProblem => 14,
        }
    }

    /// The value for a wire number, if it is one RFC 5531 defines.
    pub fn from_u32(v: u32) -> Option<Self> {
        Some(match v {
            0 => Self::Ok,
            1 => Self::BadCred,
            2 => Self::RejectedCred,
            3 => Self::BadVerf,
            4 => Self::RejectedVerf,
            5 => Self::TooWeak,
            6 => Self::InvalidResp,
            7 => Self::Failed,
            8 => Self::KerbGeneric,
            9 => Self::TimeExpire,
            10 => Self::TktFile,
            11 => Self::Decode,
            12 => Self::NetAddr,
            13 => Self::GssCredProblem,
            14 => Self::GssCtxProblem,
            _ => return None,
        })
    }

    /// The RFC 5531 name, such as `AUTH_BADCRED`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Ok => "AUTH_OK",
            Self::BadCred => "AUTH_BADCRED",
            Self::RejectedCred => "AUTH_REJECTEDCRED",
            Self::BadVerf => "AUTH_BADVERF",
            Self::RejectedVerf => "AUTH_REJECTEDVERF",
            Self::TooWeak => "AUTH_TOOWEAK",
            Self::InvalidResp => "AUTH_INVALIDRESP",
            Self::Failed => "AUTH_FAILED",
            Self::KerbGeneric => "AUTH_KERB_GENERIC",
            Self::TimeExpire => "AUTH_TIMEEXPIRE",
            Self::TktFile => "AUTH_TKT_FILE",
            Self::Decode => "AUTH_DECODE",
            Self::NetAddr => "AUTH_NET_ADDR",
            Self::GssCredProblem => "RPCSEC_GSS_CREDPROBLEM",
            Self::GssCtxProblem => "RPCSEC_GSS_CTXPROBLEM",
        }
    }
}

impl fmt::Display for AuthStat {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl XdrEncode for AuthStat {
    fn encode(&self, enc: &mut Encoder) -> xdr::Result<()> {
        enc.put_u32(self.to_u32());
        Ok(())
    }
}

impl XdrDecode for AuthStat {
    fn decode(dec: &mut Decoder) -> xdr::Result<Self> {
        let v = dec.get_u32()?;
        Self::from_u32(v).ok_or(xdr::Error::UnknownDiscriminant {
            type_name: "auth_stat",
            value: i64::from(v),
        })
    }
}

/// The credentials a call carried, as the server saw them.
#[derive(Debug, Clone, PartialEq, Eq)]
#[non_exhaustive]
pub enum Credential {
    /// AUTH_NONE.
    None,
    /// AUTH_SYS, parsed.
    Sys(AuthSys),
    /// Any other flavour, sent as is. Only for clients talking to servers that accept other
    /// flavours: the [`Server`](crate::Server) of this crate answers AUTH_REJECTEDCRED and
    /// never hands this variant to a service.
    Raw(OpaqueAuth),
}

impl Credential {
    /// Encodes this credential as an `opaque_auth`.
    pub fn to_opaque_auth(&self) -> xdr::Result<OpaqueAuth> {
        match self {
            Self::None => Ok(OpaqueAuth::NONE),
            Self::Sys(sys) => sys.to_opaque_auth(),
            Self::Raw(raw) => OpaqueAuth::new(raw.flavor, raw.body.clone()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn golden_authsys() {
        let sys = AuthSys {
            stamp: 0x0102_0304,
            machinename: "box".into(),
            uid: 1000,
            gid: 100,
            gids: vec![4, 27],
        };
        let oa = sys.to_opaque_auth().unwrap();
        let mut e = Encoder::new();
        oa.encode(&mut e).unwrap();
        #[rustfmt::skip]
        let expected: &[u8] = &[
            0, 0, 0, 1,             // flavor AUTH_SYS
            0, 0, 0, 32,            // body length: 4 + 8 + 4 + 4 + 12
            1, 2, 3, 4,             // stamp
            0, 0, 0, 3, b'b', b'o', b'x', 0, // machinename
            0, 0, 0x03, 0xe8,       // uid 1000
            0, 0, 0, 100,           // gid
            0, 0, 0, 2, 0, 0, 0, 4, 0, 0, 0, 27, // gids
        ];
        assert_eq!(&e.to_bytes()[..], expected);
        let back = AuthSys::from_body(oa.body).unwrap();
        assert_eq!(back, sys);
    }

    #[test]
    fn authsys_bounds() {
        let too_many = AuthSys {
            gids: vec![0; 17],
            ..AuthSys::default()
        };
        assert!(too_many.to_opaque_auth().is_err());
        let long_name = AuthSys {
            machinename: "x".repeat(256),
            ..AuthSys::default()
        };
        assert!(long_name.to_opaque_auth().is_err());
        // Trailing bytes after authsys_parms are rejected.
        let mut e = Encoder::new();
        AuthSys::default().encode(&mut e).unwrap();
        e.put_u32(0);
        assert!(AuthSys::from_body(e.to_bytes()).is_err());
        let me = AuthSys::current();
        assert!(me.to_opaque_auth().is_ok());
    }

    #[test]
    fn opaque_auth_body_limit() {
        assert!(OpaqueAuth::new(AUTH_SYS, Bytes::from(vec![0; 400])).is_ok());
        assert!(OpaqueAuth::new(AUTH_SYS, Bytes::from(vec![0; 401])).is_err());
        // A declared body of 404 bytes is rejected on decode even if the bytes are there.
        let mut raw = vec![0, 0, 0, 1, 0, 0, 1, 0x94];
        raw.extend(vec![0; 404]);
        let mut d = Decoder::from_slice(&raw);
        assert!(matches!(
            OpaqueAuth::decode(&mut d),
            Err(xdr::Error::LengthExceedsBound { len: 404, max: 400 })
        ));
    }

    #[test]
    fn auth_stat_roundtrip() {
        for v in 0..15 {
            let s = AuthStat::from_u32(v).unwrap();
            assert_eq!(s.to_u32(), v);
        }
        assert_eq!(AuthStat::from_u32(15), None);
        assert_eq!(AuthStat::BadCred.to_string(), "AUTH_BADCRED");
    }
}
