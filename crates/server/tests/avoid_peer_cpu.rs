//! With server placement on (the default; `REMORA_SERVE_AVOID_PEER_CPU=0` turns it off: a
//! server's connection thread that finds itself on the CPU its shared-memory client last took
//! a reply on moves off it), the client says its CPU in the reply ring's header and every
//! result is still right, completion-word synchronizes and full calls alike. One test in this
//! binary: the variable is read once per process, by both sides (the server runs in it too).

mod common;

use remora_oncrpc::TransportChoice;

#[test]
fn a_server_that_avoids_its_clients_cpu_still_answers_right() {
    // SAFETY: removed before this binary's only test starts its server and session, the
    // variable's one reader: the default.
    unsafe { std::env::remove_var("REMORA_SERVE_AVOID_PEER_CPU") };
    assert!(remora_shm::avoid_peer_cpu() && remora_shm::say_cpu());
    let server = common::serve(64 << 20);
    let s = common::session(&server.endpoint, TransportChoice::Shm);
    let rounds = 200;
    common::fill_sync_rounds(&s, rounds);
    // Every synchronize either way: a word seen or the full call.
    let (seen, full) = s.signal_sync_counts().unwrap();
    assert_eq!(seen + full, u64::try_from(rounds).unwrap());
}
