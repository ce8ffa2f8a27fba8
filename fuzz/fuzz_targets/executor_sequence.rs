//! The executor driven by a sequence of calls that the fuzzer chooses: one session per input,
//! over a Unix socket or shared memory (the input's first byte), against a `remora serve` with
//! the EMULATED backend and a small data area, started once in this process. The input picks
//! each call's procedure (every one of remora.x but those a sequence
//! must not call: the host-callback long poll, the shared-memory hand-over) and builds
//! its arguments from XDR fields: small numbers, words, 64-bit words, short opaques and the
//! handles earlier replies of the same session returned, so that later calls get past handle
//! resolution. The server must never panic (libfuzzer-sys aborts on a panic in any thread),
//! must answer or refuse every call within 10 s, and must still serve a new session after the
//! sequence. `server/tests/call_sequences.rs` runs the same kind of sequences from fixed seeds
//! in CI's tests; this target lets coverage steer them.
#![no_main]

use std::sync::OnceLock;
use std::time::Duration;

use libfuzzer_sys::fuzz_target;
use remora_client::{Session, SessionConfig};
use remora_oncrpc::{Endpoint, RpcError, TransportChoice};
use remora_proto::remora::{REMORA_PROG, REMORA_V1};
use remora_server::{
    Backend, EmulatedBackend, EmulatedConfig, Running, ServeConfig, ShmConfig, inventory_of,
    start_with_backend,
};

/// Calls per input at most.
const MAX_CALLS: usize = 48;

struct Harness {
    _running: Running,
    endpoint: Endpoint,
    /// (procedure number, one-way)
    procs: Vec<(u32, bool)>,
}

fn harness() -> &'static Harness {
    static H: OnceLock<Harness> = OnceLock::new();
    H.get_or_init(|| {
        // One directory per process id, emptied first: what is there was left by an ended
        // process with the same id (the server lives as long as the process, so nothing
        // removes it at the end), and the directories stay as few as the ids in use.
        let dir = std::env::temp_dir().join(format!("remora-fuzz-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("a directory for the fuzz server's socket");
        let endpoint = Endpoint::Unix(dir.join("remora.sock"));
        let backend = std::sync::Arc::new(EmulatedBackend::new(EmulatedConfig::default()));
        let running = start_with_backend(
            ServeConfig {
                listen: vec![endpoint.clone()],
                shm: ShmConfig {
                    enabled: true,
                    data_bytes: 1 << 20,
                    ..ShmConfig::default()
                },
                ..ServeConfig::default()
            },
            std::sync::Arc::clone(&backend) as std::sync::Arc<dyn Backend>,
            inventory_of(&*backend),
        )
        .expect("the fuzz server starts");
        Harness {
            _running: running,
            endpoint,
            procs: procedures(),
        }
    })
}

/// The procedures of remora.x ([`remora_proto::procedures`]), less those a sequence must not
/// call: the host-callback long poll and the shared-memory hand-over (HELLO is not an `RM_`
/// procedure).
fn procedures() -> Vec<(u32, bool)> {
    let out: Vec<(u32, bool)> = remora_proto::procedures()
        .into_iter()
        .filter(|p| p.name != "RM_WAIT_HOST_CALLBACKS" && !p.name.starts_with("RM_SHM"))
        .map(|p| (p.number, p.oneway))
        .collect();
    assert!(
        out.len() > 100,
        "remora.x parsed into {} procedures",
        out.len()
    );
    out
}

/// The input as a stream of choices; zeros once it runs out.
struct Choices<'a>(&'a [u8]);

impl Choices<'_> {
    fn byte(&mut self) -> u8 {
        let (b, rest) = self.0.split_first().map_or((0, &[][..]), |(b, r)| (*b, r));
        self.0 = rest;
        b
    }

    fn bytes<const N: usize>(&mut self) -> [u8; N] {
        std::array::from_fn(|_| self.byte())
    }

    fn done(&self) -> bool {
        self.0.is_empty()
    }
}

/// Arguments: up to 15 XDR fields, each chosen by one byte.
fn arguments(c: &mut Choices<'_>, handles: &[u64]) -> Vec<u8> {
    let mut a = Vec::new();
    for _ in 0..(c.byte() % 16) {
        match c.byte() % 6 {
            0 | 1 => a.extend_from_slice(&u32::from(c.byte() % 8).to_be_bytes()),
            2 if !handles.is_empty() => {
                let h = handles[usize::from(c.byte()) % handles.len()];
                a.extend_from_slice(&h.to_be_bytes());
            }
            3 => a.extend_from_slice(&c.bytes::<4>()),
            4 => a.extend_from_slice(&c.bytes::<8>()),
            _ => {
                let n = usize::from(c.byte() % 32);
                a.extend_from_slice(&(n as u32).to_be_bytes());
                a.extend((0..n.next_multiple_of(4)).map(|_| c.byte()));
            }
        }
    }
    a
}

fn session(endpoint: &Endpoint, transport: TransportChoice) -> Session {
    Session::connect_with(
        endpoint,
        SessionConfig {
            transport,
            ..SessionConfig::default()
        },
    )
    .expect("the fuzz server takes a session")
}

fuzz_target!(|data: &[u8]| {
    let h = harness();
    let mut c = Choices(data);
    let transport = if c.byte() % 2 == 0 {
        TransportChoice::Unix
    } else {
        TransportChoice::Shm
    };
    {
        let s = session(&h.endpoint, transport);
        let rpc = s.rpc().rpc();
        let mut handles: Vec<u64> = Vec::new();
        for _ in 0..MAX_CALLS {
            if c.done() {
                break;
            }
            let (number, oneway) =
                h.procs[usize::from(u16::from_be_bytes(c.bytes())) % h.procs.len()];
            let args = arguments(&mut c, &handles);
            let put = |e: &mut remora_xdr::Encoder| {
                e.put_raw(&args);
                Ok(())
            };
            if oneway {
                if rpc
                    .call_oneway(REMORA_PROG, REMORA_V1, number, put)
                    .is_err()
                {
                    break;
                }
                continue;
            }
            let reply = rpc.call(
                REMORA_PROG,
                REMORA_V1,
                number,
                Some(Duration::from_secs(10)),
                put,
                |d| d.get_fixed_opaque_bytes(d.remaining()),
            );
            match reply {
                // A successful handle or value reply: discriminant 0, then 64 bits.
                Ok(r) if r.len() == 12 && r[..4] == [0; 4] => {
                    let v = u64::from_be_bytes(r[4..12].try_into().unwrap_or_default());
                    if v != 0 && handles.len() < 64 {
                        handles.push(v);
                    }
                }
                Ok(_) => {}
                Err(RpcError::Timeout { .. }) => {
                    panic!("procedure {number} got no answer within 10 s")
                }
                // The server closed the connection (garbage it will not read on from).
                Err(RpcError::ConnectionLost | RpcError::Io(_)) => break,
                Err(_) => {}
            }
        }
    }
    // The server goes on serving new sessions.
    assert_eq!(
        session(&h.endpoint, TransportChoice::Unix).device_count(),
        1
    );
});
