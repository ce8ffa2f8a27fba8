//! A minimal portmapper (rpcbind PMAP version 2, RFC 1833) client: SET, UNSET, GETPORT.

use std::time::Duration;

use remora_xdr::{Decoder, Encoder};

use crate::client::{Client, ClientConfig};
use crate::{Endpoint, RpcError};

/// The portmapper's well-known port.
pub const PMAP_PORT: u16 = 111;
/// The portmapper program number.
pub const PMAP_PROG: u32 = 100_000;
/// The portmapper version spoken here.
pub const PMAP_VERS: u32 = 2;
/// PMAPPROC_NULL.
pub const PMAPPROC_NULL: u32 = 0;
/// PMAPPROC_SET: register a mapping.
pub const PMAPPROC_SET: u32 = 1;
/// PMAPPROC_UNSET: remove the mappings of a program version.
pub const PMAPPROC_UNSET: u32 = 2;
/// PMAPPROC_GETPORT: look a mapping up.
pub const PMAPPROC_GETPORT: u32 = 3;
/// Protocol number of TCP in a mapping.
pub const IPPROTO_TCP: u32 = 6;
/// Protocol number of UDP in a mapping.
pub const IPPROTO_UDP: u32 = 17;

/// A portmapper mapping (`struct mapping`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Mapping {
    /// Program number.
    pub prog: u32,
    /// Program version.
    pub vers: u32,
    /// Protocol ([`IPPROTO_TCP`] or [`IPPROTO_UDP`]).
    pub prot: u32,
    /// Port.
    pub port: u32,
}

impl Mapping {
    fn encode(&self, enc: &mut Encoder) {
        enc.put_u32(self.prog);
        enc.put_u32(self.vers);
        enc.put_u32(self.prot);
        enc.put_u32(self.port);
    }
}

/// A connection to a portmapper.
#[derive(Debug, Clone)]
pub struct PortMapper {
    client: Client,
}

fn get_bool(d: &mut Decoder) -> crate::xdr::Result<bool> {
    d.get_bool()
}

impl PortMapper {
    /// Connects to the portmapper at `endpoint`.
    pub fn connect(endpoint: &Endpoint) -> Result<Self, RpcError> {
        let config = ClientConfig {
            default_timeout: Duration::from_secs(5),
            connect_timeout: Some(Duration::from_secs(2)),
            ..ClientConfig::default()
        };
        Ok(Self {
            client: Client::connect_with(endpoint, config)?,
        })
    }

    /// Connects to the local portmapper, `tcp://127.0.0.1:111`.
    pub fn connect_local() -> Result<Self, RpcError> {
        Self::connect(&Endpoint::Tcp(format!("127.0.0.1:{PMAP_PORT}")))
    }

    /// Calls PMAPPROC_NULL (a ping).
    pub fn null(&self) -> Result<(), RpcError> {
        self.client.call(
            PMAP_PROG,
            PMAP_VERS,
            PMAPPROC_NULL,
            None,
            |_| Ok(()),
            |_| Ok(()),
        )
    }

    /// PMAPPROC_SET: registers `mapping`; false if the portmapper refused (for example a
    /// mapping for the program, version and protocol already exists).
    pub fn set(&self, mapping: &Mapping) -> Result<bool, RpcError> {
        self.client.call(
            PMAP_PROG,
            PMAP_VERS,
            PMAPPROC_SET,
            None,
            |e| {
                mapping.encode(e);
                Ok(())
            },
            get_bool,
        )
    }

    /// PMAPPROC_UNSET: removes every mapping of `prog` version `vers`.
    pub fn unset(&self, prog: u32, vers: u32) -> Result<bool, RpcError> {
        let m = Mapping {
            prog,
            vers,
            prot: 0,
            port: 0,
        };
        self.client.call(
            PMAP_PROG,
            PMAP_VERS,
            PMAPPROC_UNSET,
            None,
            |e| {
                m.encode(e);
                Ok(())
            },
            get_bool,
        )
    }

    /// PMAPPROC_GETPORT: the port of `prog` version `vers` over `prot`, 0 if not registered.
    pub fn getport(&self, prog: u32, vers: u32, prot: u32) -> Result<u16, RpcError> {
        let m = Mapping {
            prog,
            vers,
            prot,
            port: 0,
        };
        self.client.call(
            PMAP_PROG,
            PMAP_VERS,
            PMAPPROC_GETPORT,
            None,
            |e| {
                m.encode(e);
                Ok(())
            },
            |d| d.get_narrow_unsigned::<u16>("port"),
        )
    }
}
