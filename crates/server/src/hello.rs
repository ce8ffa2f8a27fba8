//! The HELLO handshake: protocol negotiation, server identity, the GPU list, and (with
//! `REMORA_HELLO_AUTH`) the token that authenticates a connection.

use std::sync::Arc;

use remora_proto::remora::{
    DeviceInfo, DriverOk, DriverReport, DriverStatus, HelloArgs, HelloRefused, HelloReply,
    HelloWelcome, REMORA_CAP_ONEWAY, REMORA_MAX_NAME, REMORA_MAX_REASON, REMORA_PROTOCOL_REVISION,
};

use crate::driver::Inventory;
use crate::tokens::Tokens;

/// A HELLO refused for `reason` (cut to what the protocol carries), with the revisions this
/// server speaks.
pub(crate) fn refusal(reason: String) -> HelloReply {
    HelloReply::False(HelloRefused {
        min_revision: MIN_REVISION,
        max_revision: MAX_REVISION,
        reason: truncate(reason, REMORA_MAX_REASON),
    })
}

/// The server's version string as HELLO reports it.
pub const SERVER_VERSION: &str = concat!("remora ", env!("CARGO_PKG_VERSION"));

/// Revisions this server speaks.
const MIN_REVISION: u32 = 1;
const MAX_REVISION: u32 = REMORA_PROTOCOL_REVISION;

/// Capability bits this server supports.
const SERVER_CAPABILITIES: u64 = REMORA_CAP_ONEWAY as u64;

/// Answers `REMORA_NULL`, `REMORA_HELLO` and `REMORA_HELLO_AUTH`.
#[derive(Debug, Clone)]
pub struct HelloService {
    hostname: String,
    driver: DriverReport,
    /// The tokens connections must present, when the server requires them.
    tokens: Option<Arc<Tokens>>,
}

/// Cuts `s` to at most `max` bytes, on a character boundary (protocol strings are bounded).
pub(crate) fn truncate(mut s: String, max: u32) -> String {
    let max = max as usize;
    if s.len() > max {
        let mut cut = max;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        s.truncate(cut);
    }
    s
}

impl HelloService {
    /// A HELLO service that reports `inventory`.
    pub fn new(inventory: &Inventory) -> Self {
        let hostname = std::fs::read_to_string("/proc/sys/kernel/hostname")
            .map(|s| s.trim().to_owned())
            .unwrap_or_else(|_| "unknown".to_owned());
        let driver = match inventory {
            Inventory::Ok {
                driver_version,
                devices,
            } => DriverReport::DriverOk(DriverOk {
                driver_version: *driver_version,
                devices: devices
                    .iter()
                    .map(|d| DeviceInfo {
                        ordinal: d.ordinal,
                        name: truncate(d.name.clone(), REMORA_MAX_NAME),
                        uuid: d.uuid,
                        total_memory: d.total_memory,
                        compute_major: d.compute_major,
                        compute_minor: d.compute_minor,
                        multiprocessor_count: d.multiprocessor_count,
                        pci_bus_id: truncate(d.pci_bus_id.clone(), REMORA_MAX_NAME),
                    })
                    .collect(),
            }),
            Inventory::NotFound(reason) => DriverReport::Default {
                discriminant: DriverStatus::DriverNotFound,
                value: truncate(reason.clone(), REMORA_MAX_REASON),
            },
            Inventory::InitFailed(reason) => DriverReport::Default {
                discriminant: DriverStatus::DriverInitFailed,
                value: truncate(reason.clone(), REMORA_MAX_REASON),
            },
        };
        Self {
            hostname: truncate(hostname, REMORA_MAX_NAME),
            driver,
            tokens: None,
        }
    }

    /// This service, requiring every connection to present one of `tokens` in
    /// `REMORA_HELLO_AUTH` (the RPC runtime enforces it with
    /// `ServerConfig::auth_open_procedures`).
    pub fn with_tokens(mut self, tokens: Option<Arc<Tokens>>) -> Self {
        self.tokens = tokens;
        self
    }

    /// The tokens connections must present, if the server requires them.
    pub fn tokens(&self) -> Option<&Tokens> {
        self.tokens.as_deref()
    }

    /// Negotiates with a client's HELLO arguments.
    pub fn answer(&self, args: &HelloArgs) -> HelloReply {
        let low = args.min_revision.max(MIN_REVISION);
        let high = args.max_revision.min(MAX_REVISION);
        if args.min_revision > args.max_revision || low > high {
            return HelloReply::False(HelloRefused {
                min_revision: MIN_REVISION,
                max_revision: MAX_REVISION,
                reason: format!(
                    "no common protocol revision: the client speaks {}..={}, this server \
                     ({SERVER_VERSION}) speaks {MIN_REVISION}..={MAX_REVISION}; upgrade the older side",
                    args.min_revision, args.max_revision
                ),
            });
        }
        HelloReply::True(HelloWelcome {
            revision: high,
            server_version: SERVER_VERSION.to_owned(),
            hostname: self.hostname.clone(),
            capabilities: args.capabilities & SERVER_CAPABILITIES,
            driver: self.driver.clone(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args(min: u32, max: u32, caps: u64) -> HelloArgs {
        HelloArgs {
            min_revision: min,
            max_revision: max,
            client_name: "test".into(),
            capabilities: caps,
        }
    }

    #[test]
    fn negotiates_highest_common_revision_and_capabilities() {
        let svc = HelloService::new(&Inventory::NotFound("no driver here".into()));
        let HelloReply::True(w) = svc.answer(&args(1, MAX_REVISION, 0xff)) else {
            panic!("refused")
        };
        assert_eq!(w.revision, MAX_REVISION);
        assert_eq!(w.capabilities, SERVER_CAPABILITIES);
        assert_eq!(w.server_version, SERVER_VERSION);
        assert!(matches!(
            w.driver,
            DriverReport::Default { discriminant: DriverStatus::DriverNotFound, ref value }
                if value == "no driver here"
        ));
    }

    #[test]
    fn refuses_disjoint_revisions_with_a_reason() {
        let svc = HelloService::new(&Inventory::NotFound(String::new()));
        let HelloReply::False(r) = svc.answer(&args(MAX_REVISION + 1, MAX_REVISION + 3, 0)) else {
            panic!("accepted")
        };
        assert_eq!(
            (r.min_revision, r.max_revision),
            (MIN_REVISION, MAX_REVISION)
        );
        assert!(
            r.reason.contains("no common protocol revision"),
            "{}",
            r.reason
        );
    }

    #[test]
    fn long_strings_are_cut_to_their_bounds() {
        let svc = HelloService::new(&Inventory::InitFailed("é".repeat(2000)));
        let HelloReply::True(w) = svc.answer(&args(1, 1, 0)) else {
            panic!("refused")
        };
        let DriverReport::Default {
            discriminant: DriverStatus::DriverInitFailed,
            value,
        } = w.driver
        else {
            panic!("wrong arm")
        };
        assert!(value.len() <= REMORA_MAX_REASON as usize);
    }
}
