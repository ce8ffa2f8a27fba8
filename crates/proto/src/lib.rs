//! The Remora wire protocol.
//!
//! `x/remora.x` is the single source of truth; `build.rs` compiles it with
//! `remora-rpcgen` into [`remora`]: Rust types with XDR encoding, the typed client
//! [`remora::RemoraV1Client`], the server trait [`remora::RemoraV1Server`] and its dispatcher
//! [`remora::RemoraV1Service`]. Nothing generated is committed. `docs/protocol.md` describes
//! the protocol for implementers in other languages.
#![forbid(unsafe_code)]

remora_xdr::include_generated! {
    /// Generated from `x/remora.x`.
    pub mod remora = "remora.rs";
}

// The per-call glue of the `@glue`-annotated procedures: `client_glue!()`,
// `executor_glue!()` and `backend_glue!()` (see remora-glue).
include!(concat!(env!("OUT_DIR"), "/glue.rs"));

pub mod cuda;
pub mod mem_prop;
pub mod memset_node;
pub mod pool_access;
pub mod stream_attr;
pub mod token;

/// A device UUID in the 8-4-4-4-12 hex groups CUDA's tools print (upper- or lowercase
/// digits), without the prefix or braces each tool adds.
pub fn uuid_groups(uuid: &[u8; 16], upper: bool) -> String {
    let h: Vec<String> = uuid
        .iter()
        .map(|b| {
            if upper {
                format!("{b:02X}")
            } else {
                format!("{b:02x}")
            }
        })
        .collect();
    [&h[0..4], &h[4..6], &h[6..8], &h[8..10], &h[10..16]]
        .map(|g| g.concat())
        .join("-")
}

/// The `remora.x` source, for tools that want to show or ship it.
pub const REMORA_X: &str = include_str!("../x/remora.x");

/// One procedure of `remora.x`, as its text declares it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Procedure {
    /// Its name (`RM_LAUNCH_KERNEL`).
    pub name: String,
    /// Its number.
    pub number: u32,
    /// Declared `void`: a one-way call, no reply.
    pub oneway: bool,
}

/// Every procedure `remora.x` declares (`RESULT NAME(ARGS) = NUMBER;` lines whose name starts
/// with `RM_`), read from its text: for tools and tests that call procedures by number, such
/// as the call-sequence test and fuzz target.
pub fn procedures() -> Vec<Procedure> {
    let mut out = Vec::new();
    for line in REMORA_X.lines() {
        let line = line.trim();
        let Some((head, number)) = line.strip_suffix(';').and_then(|l| l.rsplit_once(" = ")) else {
            continue;
        };
        let mut words = head.split_whitespace();
        let (Some(result), Some(call)) = (words.next(), words.next()) else {
            continue;
        };
        let Some(name) = call.split('(').next().filter(|n| n.starts_with("RM_")) else {
            continue;
        };
        let Ok(number) = number.trim().parse::<u32>() else {
            continue;
        };
        out.push(Procedure {
            name: name.to_owned(),
            number,
            oneway: result == "void",
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use remora_xdr::{Encoder, XdrEncode, decode_all};

    use super::remora::*;

    #[test]
    fn procedures_are_read_from_remora_x() {
        let procs = super::procedures();
        assert!(procs.len() > 100, "{} procedures", procs.len());
        let launch = procs.iter().find(|p| p.name == "RM_LAUNCH_KERNEL").unwrap();
        assert_eq!(launch.number, RM_LAUNCH_KERNEL);
        assert!(launch.oneway);
        let alloc = procs.iter().find(|p| p.name == "RM_MEM_ALLOC").unwrap();
        assert_eq!(alloc.number, RM_MEM_ALLOC);
        assert!(!alloc.oneway);
        // REMORA_HELLO and the lane procedures are not RM_ procedures.
        assert!(procs.iter().all(|p| p.name.starts_with("RM_")));
    }

    #[test]
    fn program_number_is_in_the_user_range() {
        assert!((0x2000_0000..=0x3FFF_FFFF).contains(&REMORA_PROG));
        assert_eq!(REMORA_V1, 1);
    }

    #[test]
    fn hello_args_golden_bytes() {
        let args = HelloArgs {
            min_revision: 1,
            max_revision: 2,
            client_name: "ab".into(),
            capabilities: 1,
        };
        let mut enc = Encoder::new();
        args.encode(&mut enc).unwrap();
        let bytes = enc.to_bytes();
        assert_eq!(
            &bytes[..],
            &[
                0, 0, 0, 1, 0, 0, 0, 2, 0, 0, 0, 2, b'a', b'b', 0, 0, 0, 0, 0, 0, 0, 0, 0, 1
            ]
        );
        assert_eq!(decode_all::<HelloArgs>(bytes).unwrap(), args);
    }

    #[test]
    fn hello_reply_roundtrips_every_arm() {
        let device = DeviceInfo {
            ordinal: 0,
            name: "NVIDIA H100 80GB HBM3".into(),
            uuid: [7; 16],
            total_memory: 85_520_809_984,
            compute_major: 9,
            compute_minor: 0,
            multiprocessor_count: 132,
            pci_bus_id: "0000:3B:00.0".into(),
        };
        let replies = [
            HelloReply::True(HelloWelcome {
                revision: 1,
                server_version: "remora 0.1.0".into(),
                hostname: "gpu1".into(),
                capabilities: 1,
                driver: DriverReport::DriverOk(DriverOk {
                    driver_version: 13000,
                    devices: vec![device],
                }),
            }),
            HelloReply::True(HelloWelcome {
                revision: 1,
                server_version: "remora 0.1.0".into(),
                hostname: "cpu1".into(),
                capabilities: 0,
                driver: DriverReport::Default {
                    discriminant: DriverStatus::DriverNotFound,
                    value: "no libcuda.so.1".into(),
                },
            }),
            HelloReply::False(HelloRefused {
                min_revision: 1,
                max_revision: 1,
                reason: "too new".into(),
            }),
        ];
        for reply in replies {
            let mut enc = Encoder::new();
            reply.encode(&mut enc).unwrap();
            assert_eq!(decode_all::<HelloReply>(enc.to_bytes()).unwrap(), reply);
        }
    }

    #[test]
    fn bounds_from_remora_x_are_enforced() {
        let args = HelloArgs {
            min_revision: 1,
            max_revision: 1,
            client_name: "x".repeat(REMORA_MAX_NAME as usize + 1),
            capabilities: 0,
        };
        let mut enc = Encoder::new();
        assert!(
            args.encode(&mut enc).is_err(),
            "an over-long name must not encode"
        );
    }
}
