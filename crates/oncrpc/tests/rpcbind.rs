//! Registration with the local rpcbind (PMAP v2). Skipped, with the reason printed, when no
//! rpcbind answers on 127.0.0.1:111.

mod common;

use common::*;
use remora_oncrpc::rpcbind::{IPPROTO_TCP, Mapping, PortMapper};
use remora_oncrpc::{Endpoint, RpcError};

fn portmapper() -> Option<PortMapper> {
    match PortMapper::connect_local().and_then(|pm| pm.null().map(|()| pm)) {
        Ok(pm) => Some(pm),
        Err(e) => {
            eprintln!(
                "SKIPPED: no rpcbind reachable on 127.0.0.1:111 ({e}); start it with `rpcbind -w`"
            );
            None
        }
    }
}

#[test]
fn register_getport_unregister() {
    let Some(pm) = portmapper() else { return };
    let mut s = start(Transport::Tcp);
    let Endpoint::Tcp(addr) = &s.endpoint else {
        panic!()
    };
    let port: u16 = addr.parse::<std::net::SocketAddr>().unwrap().port();
    let handle = s.handle.as_mut().unwrap();
    handle.register_rpcbind().unwrap();
    assert_eq!(pm.getport(PROG, 1, IPPROTO_TCP).unwrap(), port);
    assert_eq!(pm.getport(PROG, 3, IPPROTO_TCP).unwrap(), port);
    // (rpcbind answers GETPORT for an unregistered version with another version's port, so
    // version 2 is not checked.)
    // Shutdown removes the registrations.
    s.handle.take().unwrap().shutdown();
    assert_eq!(pm.getport(PROG, 1, IPPROTO_TCP).unwrap(), 0);
    assert_eq!(pm.getport(PROG, 3, IPPROTO_TCP).unwrap(), 0);
}

#[test]
fn portmapper_set_unset_directly() {
    let Some(pm) = portmapper() else { return };
    let prog = 0x2000_0777;
    let m = Mapping {
        prog,
        vers: 1,
        prot: IPPROTO_TCP,
        port: 40_123,
    };
    let _ = pm.unset(prog, 1);
    assert!(pm.set(&m).unwrap());
    assert_eq!(pm.getport(prog, 1, IPPROTO_TCP).unwrap(), 40_123);
    assert!(pm.unset(prog, 1).unwrap());
    assert_eq!(pm.getport(prog, 1, IPPROTO_TCP).unwrap(), 0);
}

#[test]
fn rpcbind_absent_is_a_clear_error() {
    // Nothing listens on this port: connecting fails with a Connect error.
    let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let ep = Endpoint::from(l.local_addr().unwrap());
    drop(l);
    let e = PortMapper::connect(&ep).unwrap_err();
    assert!(matches!(e, RpcError::Connect { .. }), "{e}");
}
