//! A service whose SLOW procedure answers through a deferred reply from another thread, for
//! the deferred-reply and hand-off tests.

use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use remora_oncrpc::xdr::{Decoder, Encoder};
use remora_oncrpc::{CallContext, Dispatch, Peer, Service};

/// Answers `v + 1` after the service's delay, through a deferred reply.
pub const SLOW: u32 = 1;
/// Answers `2 v` at once.
pub const FAST: u32 = 2;
/// Takes the deferred reply and drops it unsent (the runtime answers SYSTEM_ERR).
pub const DROPPED: u32 = 3;

pub struct DeferringSvc {
    pub program: u32,
    pub delay: Duration,
    /// Connections whose end `connection_closed` reported.
    pub closed: Mutex<Vec<u64>>,
    /// The connection and peer of every call.
    pub connections: Mutex<Vec<u64>>,
    pub peers: Mutex<Vec<Peer>>,
    /// SLOW calls answered inline because the transport could not defer.
    pub inline: AtomicUsize,
    waiters: Mutex<Vec<std::thread::JoinHandle<()>>>,
}

impl DeferringSvc {
    pub fn new(program: u32, delay: Duration) -> Self {
        Self {
            program,
            delay,
            closed: Mutex::default(),
            connections: Mutex::default(),
            peers: Mutex::default(),
            inline: AtomicUsize::new(0),
            waiters: Mutex::default(),
        }
    }
}

impl Service for DeferringSvc {
    fn program(&self) -> u32 {
        self.program
    }
    fn version(&self) -> u32 {
        1
    }
    fn dispatch(&self, ctx: &CallContext, args: &mut Decoder, reply: &mut Encoder) -> Dispatch {
        self.connections.lock().unwrap().push(ctx.connection);
        self.peers.lock().unwrap().push(ctx.peer.clone());
        let Ok(v) = args.get_u32() else {
            return Dispatch::GarbageArgs;
        };
        match ctx.procedure {
            SLOW => {
                let Some(deferred) = ctx.defer() else {
                    self.inline.fetch_add(1, Ordering::SeqCst);
                    reply.put_u32(v);
                    return Dispatch::Success;
                };
                let delay = self.delay;
                let h = std::thread::spawn(move || {
                    std::thread::sleep(delay);
                    deferred
                        .reply(|e| {
                            e.put_u32(v + 1);
                            Ok(())
                        })
                        .unwrap();
                });
                self.waiters.lock().unwrap().push(h);
                Dispatch::Deferred
            }
            FAST => {
                reply.put_u32(v * 2);
                Dispatch::Success
            }
            DROPPED => {
                drop(ctx.defer());
                Dispatch::Deferred
            }
            _ => Dispatch::ProcUnavail,
        }
    }
    fn connection_closed(&self, connection: u64) {
        for h in std::mem::take(&mut *self.waiters.lock().unwrap()) {
            let _ = h.join();
        }
        self.closed.lock().unwrap().push(connection);
    }
}
