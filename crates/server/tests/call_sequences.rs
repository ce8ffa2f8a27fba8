//! The executor driven by sequences of calls rather than single records: every procedure of
//! remora.x, in random order, with arguments built from small numbers, random words, opaque
//! data and the handles earlier replies of the same session returned (so that later calls
//! reach past handle resolution). The server must never panic, must answer or refuse each
//! call, and must keep serving new sessions after each sequence. Deterministic seeds; over a
//! Unix socket and shared memory. Client `Session` (HELLO) then raw calls → executor →
//! EMULATED backend.

mod common;

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use common::*;
use remora_client::proto::{REMORA_PROG, REMORA_V1};
use remora_oncrpc::{RpcError, TransportChoice};

/// A procedure of remora.x: number, whether it is one-way (declared `void`).
#[derive(Debug, Clone, Copy)]
struct Proc {
    number: u32,
    oneway: bool,
}

/// The procedures of remora.x ([`remora_proto::procedures`]), but for those a sequence must
/// not call: the host-callback long poll (waits for callbacks that never come) and the
/// shared-memory hand-over. (HELLO is not an `RM_` procedure; the session has had one.)
fn procedures() -> Vec<(String, Proc)> {
    remora_proto::procedures()
        .into_iter()
        .filter(|p| p.name != "RM_WAIT_HOST_CALLBACKS" && !p.name.starts_with("RM_SHM"))
        .map(|p| {
            let proc = Proc {
                number: p.number,
                oneway: p.oneway,
            };
            (p.name, proc)
        })
        .collect()
}

/// xorshift64*: reproducible, no dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next() % n.max(1)
    }
}

/// Arguments: XDR fields, each a small number, a handle seen in this session, a random word,
/// a random 64-bit word or a short opaque; `len`: stop at that many bytes (a length the
/// procedure's arguments were seen to decode with), else a random number of fields.
fn arguments(rng: &mut Rng, handles: &[u64], len: Option<usize>) -> Vec<u8> {
    let mut a = Vec::new();
    let fields = if len.is_some() { 64 } else { rng.below(9) };
    for _ in 0..fields {
        if len.is_some_and(|n| a.len() >= n) {
            break;
        }
        match rng.below(6) {
            0 | 1 => a.extend_from_slice(&(rng.below(5) as u32).to_be_bytes()),
            2 if !handles.is_empty() => {
                let h = handles[rng.below(handles.len() as u64) as usize];
                a.extend_from_slice(&h.to_be_bytes());
            }
            3 => a.extend_from_slice(&(rng.next() as u32).to_be_bytes()),
            4 => a.extend_from_slice(&rng.next().to_be_bytes()),
            _ => {
                let n = rng.below(24) as usize;
                a.extend_from_slice(&(n as u32).to_be_bytes());
                a.extend((0..n.next_multiple_of(4)).map(|_| rng.next() as u8));
            }
        }
    }
    if let Some(n) = len {
        a.resize(n, 0);
    }
    a
}

#[test]
fn random_call_sequences_never_break_the_server() {
    let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
    let procs = procedures();
    assert!(
        procs.len() > 100 && procs.iter().filter(|p| p.1.oneway).count() >= 10,
        "remora.x parsed into {} procedures",
        procs.len()
    );
    let panics = Arc::new(AtomicUsize::new(0));
    let seen = Arc::clone(&panics);
    let previous = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        seen.fetch_add(1, Ordering::SeqCst);
        previous(info);
    }));
    let server = serve(AREA);
    let (mut answered, mut refused) = (0u32, 0u32);
    // By procedure: argument lengths that decoded (answered), reused with new contents.
    let mut good: Vec<Vec<usize>> = vec![Vec::new(); procs.len()];
    let seeds: u64 = std::env::var("REMORA_SEQUENCE_SEEDS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(48);
    for seed in 1..=seeds {
        let transport = if seed % 2 == 0 {
            TransportChoice::Shm
        } else {
            TransportChoice::Unix
        };
        let mut rng = Rng(seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1);
        let s = session(&server.endpoint, transport);
        let rpc = s.rpc().rpc();
        let mut handles: Vec<u64> = Vec::new();
        for _ in 0..60 {
            let i = rng.below(procs.len() as u64) as usize;
            let (name, p) = &procs[i];
            let len = (!good[i].is_empty() && rng.below(4) != 0)
                .then(|| good[i][rng.below(good[i].len() as u64) as usize]);
            let args = arguments(&mut rng, &handles, len);
            let put = |e: &mut remora_xdr::Encoder| {
                e.put_raw(&args);
                Ok(())
            };
            if p.oneway {
                if rpc
                    .call_oneway(REMORA_PROG, REMORA_V1, p.number, put)
                    .is_err()
                {
                    break;
                }
                continue;
            }
            let reply = rpc.call(
                REMORA_PROG,
                REMORA_V1,
                p.number,
                Some(Duration::from_secs(10)),
                put,
                |d| d.get_fixed_opaque_bytes(d.remaining()),
            );
            match reply {
                Ok(r) => {
                    answered += 1;
                    if !good[i].contains(&args.len()) {
                        good[i].push(args.len());
                    }
                    // A successful handle or value reply: discriminant 0, then 64 bits.
                    if r.len() == 12 && r[..4] == [0; 4] {
                        let h = u64::from_be_bytes(r[4..12].try_into().unwrap());
                        if h != 0 && handles.len() < 64 {
                            handles.push(h);
                        }
                    }
                }
                Err(RpcError::Timeout { .. }) => {
                    panic!("{name} (seed {seed}) got no answer within 10 s")
                }
                // Garbage arguments and the like: refused, the connection goes on.
                Err(RpcError::ConnectionLost | RpcError::Io(_)) => break,
                Err(_) => refused += 1,
            }
        }
        drop(s);
        // The server goes on serving new sessions.
        let fresh = session(&server.endpoint, TransportChoice::Unix);
        assert_eq!(fresh.device_count(), 1, "after seed {seed}");
    }
    let _ = std::panic::take_hook();
    eprintln!("call sequences: {answered} calls answered, {refused} refused");
    assert_eq!(
        panics.load(Ordering::SeqCst),
        0,
        "the server panicked (see the messages above)"
    );
    assert!(
        answered > 500 && refused > 50,
        "{answered} answered, {refused} refused"
    );
}
