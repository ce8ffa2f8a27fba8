//! With waits traced (`REMORA_WAIT_TRACE`), the server says in the request ring's header which
//! CPU it ran on when it last took a call, and the client counts its completion-word
//! synchronizes by how they ended, each again where the server was on the client's own CPU
//! (issue 12 §4: whether pairs that settle on the full call share a core); with server
//! placement turned off (`REMORA_SERVE_AVOID_PEER_CPU=0`), tracing alone still has both sides
//! say their CPUs. One test in this binary: the variables are read once per process, by both
//! sides (the server runs in it too).

mod common;

use remora_oncrpc::TransportChoice;

#[test]
fn traced_synchronizes_are_counted_with_where_the_server_ran() {
    // SAFETY: set before this binary's only test starts its server and session, the
    // variable's one reader.
    unsafe {
        std::env::set_var("REMORA_WAIT_TRACE", "1");
        std::env::set_var("REMORA_SERVE_AVOID_PEER_CPU", "0");
    }
    assert!(
        !remora_shm::avoid_peer_cpu(),
        "REMORA_SERVE_AVOID_PEER_CPU=0 turns it off"
    );
    assert!(remora_shm::say_cpu(), "a traced process says its CPU");
    let server = common::serve(64 << 20);
    let s = common::session(&server.endpoint, TransportChoice::Shm);
    assert_eq!(s.signal_cpu_counts(), Some(([[0; 2]; 4], 0)));
    let rounds = 200;
    common::fill_sync_rounds(&s, rounds);
    let (ended, unknown) = s.signal_cpu_counts().unwrap();
    // Every synchronize once: a word seen (soon or late), a watch given up, or the full call
    // at once; the server, tracing too, said its CPU for each (it took the launch before).
    let all: u64 = ended.iter().map(|[n, _]| n).sum();
    assert_eq!(unknown, 0, "{ended:?}");
    assert_eq!(all, u64::try_from(rounds).unwrap(), "{ended:?}");
    for [n, same] in ended {
        assert!(same <= n, "{ended:?}");
    }
    let (seen, full) = s.signal_sync_counts().unwrap();
    assert_eq!(ended[0][0] + ended[1][0], seen, "words seen: {ended:?}");
    assert_eq!(ended[2][0] + ended[3][0], full, "full calls: {ended:?}");
}
