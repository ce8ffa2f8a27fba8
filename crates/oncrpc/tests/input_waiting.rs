//! `CallContext::input_waiting`: a handler that keeps its connection's thread (a synchronize
//! polling the device) learns when the connection's next call has come, over TCP, Unix sockets
//! and shared memory, and says yes when it cannot tell (`ServerConfig::input_probes` off).

use std::sync::Arc;
use std::time::{Duration, Instant};

use remora_oncrpc::xdr::{Decoder, Encoder};
use remora_oncrpc::{
    CallContext, Client, ClientConfig, Dispatch, Endpoint, Server, ServerConfig, Service,
    TransportChoice,
};

const PROG: u32 = 0x2000_0778;
/// Replies (whether input was waiting when the call began, whether it came within 10 s).
const WATCH: u32 = 1;
/// Replies nothing but SUCCESS.
const NOOP: u32 = 2;

struct Watcher;

impl Service for Watcher {
    fn program(&self) -> u32 {
        PROG
    }
    fn version(&self) -> u32 {
        1
    }
    fn dispatch(&self, ctx: &CallContext, _args: &mut Decoder, reply: &mut Encoder) -> Dispatch {
        match ctx.procedure {
            WATCH => {
                let at_first = ctx.input_waiting();
                let deadline = Instant::now() + Duration::from_secs(10);
                let mut came = at_first;
                while !came && Instant::now() < deadline {
                    std::thread::sleep(Duration::from_micros(200));
                    came = ctx.input_waiting();
                }
                reply.put_u32(u32::from(at_first));
                reply.put_u32(u32::from(came));
                Dispatch::Success
            }
            NOOP => Dispatch::Success,
            _ => Dispatch::ProcUnavail,
        }
    }
}

fn call(c: &Client, proc_: u32) -> (u32, u32) {
    c.call(
        PROG,
        1,
        proc_,
        Some(Duration::from_secs(30)),
        |_| Ok(()),
        |d| {
            if proc_ == WATCH {
                Ok((d.get_u32()?, d.get_u32()?))
            } else {
                Ok((0, 0))
            }
        },
    )
    .unwrap()
}

/// A server with `input_probes` as given, and a client over `transport`.
fn serve(
    transport: TransportChoice,
    input_probes: bool,
) -> (remora_oncrpc::ServerHandle, Arc<Client>, tempfile::TempDir) {
    let dir = tempfile::tempdir().unwrap();
    let ep = match transport {
        TransportChoice::Tcp => Endpoint::Tcp("127.0.0.1:0".into()),
        _ => Endpoint::Unix(dir.path().join("w.sock")),
    };
    let handle = Server::builder(ServerConfig {
        input_probes,
        ..ServerConfig::default()
    })
    .service(Arc::new(Watcher) as Arc<dyn Service>)
    .listen(&ep)
    .unwrap()
    .start()
    .unwrap();
    let ep = handle.local_endpoints()[0].clone();
    let client = Client::connect_with(
        &ep,
        ClientConfig {
            transport,
            ..ClientConfig::default()
        },
    )
    .unwrap();
    assert_eq!(client.is_shm(), transport == TransportChoice::Shm);
    (handle, Arc::new(client), dir)
}

#[test]
fn a_handler_learns_that_the_next_call_has_come() {
    for transport in [
        TransportChoice::Tcp,
        TransportChoice::Unix,
        TransportChoice::Shm,
    ] {
        let (handle, client, _dir) = serve(transport, true);
        // The probe is made per connection: warm it up with a call first.
        call(&client, NOOP);
        let watching = {
            let c = Arc::clone(&client);
            std::thread::spawn(move || call(&c, WATCH))
        };
        // The WATCH call is being served (inline, on the connection's thread) before the
        // next one is sent.
        std::thread::sleep(Duration::from_millis(100));
        let start = Instant::now();
        call(&client, NOOP);
        let (at_first, came) = watching.join().unwrap();
        assert_eq!(
            at_first, 0,
            "{transport:?}: nothing waited when WATCH began"
        );
        assert_eq!(came, 1, "{transport:?}: the next call was seen");
        assert!(
            start.elapsed() < Duration::from_secs(5),
            "{transport:?}: {:?}",
            start.elapsed()
        );
        handle.shutdown();
    }
}

#[test]
fn without_probes_it_always_says_yes() {
    for transport in [TransportChoice::Tcp, TransportChoice::Shm] {
        let (handle, client, _dir) = serve(transport, false);
        let (at_first, came) = call(&client, WATCH);
        assert_eq!((at_first, came), (1, 1), "{transport:?}");
        handle.shutdown();
    }
}
