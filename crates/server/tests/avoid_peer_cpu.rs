//! With the server-placement experiment on (`REMORA_SERVE_AVOID_PEER_CPU=1`: a server's
//! connection thread that finds itself on the CPU its shared-memory client last took a reply
//! on moves off it), the client says its CPU in the reply ring's header and every result is
//! still right, completion-word synchronizes and full calls alike. One test in this binary:
//! the variable is read once per process, by both sides (the server runs in it too).

mod common;

use remora_oncrpc::TransportChoice;

#[test]
fn a_server_that_avoids_its_clients_cpu_still_answers_right() {
    // SAFETY: set before this binary's only test starts its server and session, the
    // variable's one reader.
    unsafe { std::env::set_var("REMORA_SERVE_AVOID_PEER_CPU", "1") };
    assert!(remora_shm::say_cpu());
    let server = common::serve(64 << 20);
    let s = common::session(&server.endpoint, TransportChoice::Shm);
    let rounds = 200;
    common::fill_sync_rounds(&s, rounds);
    // Every synchronize either way: a word seen or the full call.
    let (seen, full) = s.signal_sync_counts().unwrap();
    assert_eq!(seen + full, u64::try_from(rounds).unwrap());
}
